//! Row-invariant numerics (`Backend::set_row_invariant`): a forward over several new tokens gives,
//! for every row, bit-for-bit the logits that one-token steps give — what speculative
//! verification needs so that its greedy output equals plain decoding. Checked on both real models,
//! for a short context (one-chunk attention) and past 512 positions (split-KV attention).

mod common;

use common::{argmax, fixture, load_runner, model, GEMMA, QWEN};
use infer::engine::runner::Sequence;
use infer::model::backend::Backend;

fn prompt_ids(name: &str) -> Vec<u32> {
    let s = std::fs::read_to_string(fixture(&format!("refs/{name}.ids"))).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("PROMPT_IDS:"))
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

fn check(file: &str, name: &str, min_context: usize) {
    let (_, mut runner) = load_runner(&model(file), 1024);
    let base = prompt_ids(name);
    let mut prompt = base.clone();
    while prompt.len() < min_context {
        prompt.extend_from_slice(&base[1..]);
    }
    let mut seq = Sequence::default();
    let mut logits = runner.extend(&mut seq, &prompt).unwrap();
    // One-token steps.
    let mut steps = Vec::new();
    let mut toks = Vec::new();
    for _ in 0..9 {
        let t = argmax(&logits);
        toks.push(t);
        logits = runner.extend(&mut seq, &[t]).unwrap();
        steps.push(logits.clone());
    }
    // The same tokens again in one forward, row-invariant.
    runner.truncate(&mut seq, prompt.len());
    runner.model.backend.set_row_invariant(true);
    seq.tokens.extend_from_slice(&toks);
    let rows = runner.compute_all(&mut seq).unwrap();
    runner.model.backend.set_row_invariant(false);
    assert_eq!(rows.len(), steps.len());
    for (i, (a, b)) in rows.iter().zip(&steps).enumerate() {
        let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(
            same,
            "{name}: row {i} of a 9-token forward differs from its one-token step"
        );
    }
}

#[test]
fn gemma_rows_equal_steps_short_and_long_context() {
    check(GEMMA, "gemma-3-270m-q4_k_m__capital", 0);
    check(GEMMA, "gemma-3-270m-q4_k_m__capital", 600);
}

#[test]
fn qwen_rows_equal_steps() {
    check(QWEN, "qwen-coder-1.5b__capital", 0);
}
