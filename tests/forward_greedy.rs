//! The forward pass alone (no tokenizer, no sampler): greedy argmax from llama.cpp's own prompt ids
//! must reproduce llama.cpp's generated ids on both real models.

mod common;

use common::{argmax, fixture, load_runner, model, GEMMA, QWEN};
use infer::engine::runner::Sequence;

fn ids(name: &str, tag: &str) -> Vec<u32> {
    let s = std::fs::read_to_string(fixture(&format!("refs/{name}.ids"))).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(tag))
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

fn check(file: &str, name: &str) {
    let (_, mut runner) = load_runner(&model(file), 256);
    let prompt = ids(name, "PROMPT_IDS:");
    let want = ids(name, "GEN_IDS:");
    let mut seq = Sequence::default();
    let mut logits = runner.extend(&mut seq, &prompt).unwrap();
    let mut got = Vec::new();
    for _ in 0..want.len() {
        let t = argmax(&logits);
        got.push(t);
        if got.len() == want.len() || got[..] != want[..got.len()] {
            break;
        }
        logits = runner.extend(&mut seq, &[t]).unwrap();
    }
    assert_eq!(got, want, "greedy ids differ from llama.cpp's");
}

#[test]
fn qwen_forward_greedy_ids() {
    check(QWEN, "qwen-coder-1.5b__capital");
}

#[test]
fn gemma_forward_greedy_ids() {
    check(GEMMA, "gemma-3-270m-q4_k_m__capital");
}
