//! The quantized KV cache (`--cache-type-k` / `--cache-type-v` `q8_0`, `q4_0`) end to end. The
//! truth is the same model with the default f16 cache: on Gemma-3-270M, over a prompt longer
//! than its 512-position sliding window, the greedy tokens of a q8_0 cache follow f16's (each
//! step fed f16's previous token, so one early difference does not decide the rest). Then the
//! real binary: the prompt cache saves and reloads a quantized cache and refuses one of another
//! type, context shift re-rotates quantized keys and goes on, and the flags' usage errors.

mod common;

use std::path::{Path, PathBuf};

use common::{argmax, infer, model, stderr, stdout, GEMMA};
use infer::engine::load::{load_cpu, LoadOptions};
use infer::engine::runner::Sequence;
use infer::model::backend::CacheType;

fn scratch(test: &str) -> PathBuf {
    common::scratch(&format!("kv-quant-{test}"))
}

/// The first `chars` characters of a long public-domain-licensed text (the GPL's own words).
fn text(chars: usize) -> String {
    let t = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").expect("GPL-3 text");
    t.chars().take(chars).collect()
}

/// Greedy tokens of f16's run, and for each other cache type how many of its steps pick the
/// same token as f16 when fed f16's tokens (teacher forcing).
fn agreement(path: &Path, prompt: &str, n: usize, types: &[CacheType]) -> Vec<(usize, Vec<u32>)> {
    let load = |t: CacheType| {
        load_cpu(
            path,
            &LoadOptions {
                threads: Some(2),
                n_ctx: Some(2048),
                cache_type_k: t,
                cache_type_v: t,
                ..LoadOptions::default()
            },
        )
        .unwrap()
    };
    let base = load(CacheType::F16);
    let ids = base.tokenizer.encode(prompt, true, false).unwrap();
    assert!(ids.len() > 600, "past the sliding window: {}", ids.len());
    let mut runner = base.runner;
    let mut seq = Sequence::default();
    let mut want = vec![argmax(&runner.extend(&mut seq, &ids).unwrap())];
    while want.len() < n {
        let last = *want.last().unwrap();
        want.push(argmax(&runner.extend(&mut seq, &[last]).unwrap()));
    }
    drop((seq, runner));
    let mut out = Vec::new();
    for &t in types {
        let mut runner = load(t).runner;
        assert_eq!(
            runner.model.cfg.kv_type,
            infer::model::backend::KvType::of(t, t)
        );
        let mut seq = Sequence::default();
        let mut got = vec![argmax(&runner.extend(&mut seq, &ids).unwrap())];
        for &w in &want[..n - 1] {
            got.push(argmax(&runner.extend(&mut seq, &[w]).unwrap()));
        }
        let same = got.iter().zip(&want).filter(|(a, b)| a == b).count();
        out.push((same, got));
    }
    out
}

#[test]
fn gemma_greedy_tokens_with_a_quantized_cache_follow_f16() {
    let n = 48;
    let r = agreement(
        &model(GEMMA),
        &text(3000),
        n,
        &[CacheType::Q8_0, CacheType::Q4_0],
    );
    let (q8, q4) = (r[0].0, r[1].0);
    eprintln!("same top-1 token as f16 over {n} steps: q8_0 {q8}, q4_0 {q4}");
    assert!(q8 * 100 >= 90 * n, "q8_0 K+V: {q8} of {n}");
    assert!(q4 * 100 >= 60 * n, "q4_0 K+V: {q4} of {n}");
}

/// `infer run --temp 0 --json` on the tiny Qwen3 checkpoint (heads of 32 values) with `extra`
/// flags: the generated ids and stderr (the run must succeed).
fn run(m: &Path, extra: &[&str]) -> (Vec<u64>, String) {
    let mut args = vec!["run", "-m", m.to_str().unwrap(), "--temp", "0", "--json"];
    args.extend(extra);
    let o = infer(&args, None);
    assert!(o.status.success(), "{}", stderr(&o));
    let ids = stdout(&o)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("id").and_then(|i| i.as_u64()))
        .collect();
    (ids, stderr(&o))
}

#[test]
fn prompt_cache_and_context_shift_keep_a_quantized_cache() {
    let dir = scratch("cli");
    let m = common::convert_tiny(&dir, "qwen3", "q8_0");
    let q8 = ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"];
    let prompt = "a b c d e f g h i j k l m n o p q r s t u v w x y z ".repeat(3);
    let gen = ["-p", prompt.as_str(), "-n", "16"];
    let (plain, _) = run(&m, &[&gen[..], &q8].concat());
    assert_eq!(plain.len(), 16);
    // Saved, then loaded: the same tokens.
    let cache = dir.join("prompt.cache");
    let c = ["--prompt-cache", cache.to_str().unwrap()];
    let (ids, _) = run(&m, &[&gen[..], &q8, &c].concat());
    assert_eq!(ids, plain);
    assert!(cache.is_file());
    let (ids, err) = run(&m, &[&gen[..], &q8, &c].concat());
    assert_eq!(ids, plain, "{err}");
    // Another cache type refuses the file, says why, and computes.
    let q4 = ["--cache-type-k", "q8_0", "--cache-type-v", "q4_0"];
    let (_, err) = run(&m, &[&gen[..], &q4, &c].concat());
    assert!(
        err.contains("q8_0/q8_0 KV cache, and this run's is q8_0/q4_0"),
        "{err}"
    );
    // Context shift re-rotates the quantized keys and goes on far past the context.
    let shift = [
        "--ctx",
        "96",
        "--context-shift",
        "--ignore-eos",
        "-p",
        "a b c",
    ];
    let (ids, _) = run(&m, &[&shift[..], &["-n", "3000"], &q4].concat());
    assert_eq!(ids.len(), 3000);
}

#[test]
fn unknown_types_and_unfit_models_are_usage_errors() {
    let dir = scratch("usage");
    let tiny = |name: &str| common::convert_tiny(&dir, name, "q8_0");
    let gqa = tiny("llama-gqa");
    let m = gqa.to_str().unwrap();
    let o = infer(
        &["run", "-m", m, "-p", "hi", "--cache-type-k", "q5_0"],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("unknown KV cache type \"q5_0\"; use one of f16, q8_0, q4_0"),
        "{}",
        stderr(&o)
    );
    // Heads of 16 values are not whole blocks.
    let o = infer(
        &["run", "-m", m, "-p", "hi", "--cache-type-v", "q4_0"],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("16 values wide, not a multiple of the 32-value blocks"),
        "{}",
        stderr(&o)
    );
    // A model computed in f32 keeps its f32 cache.
    let f32m = common::convert_tiny(&dir, "qwen3", "f32");
    let args = ["run", "-m", f32m.to_str().unwrap(), "-p", "hi"];
    let o = infer(&[&args[..], &["--cache-type-k", "q8_0"]].concat(), None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("computes in f32"), "{}", stderr(&o));
    // f16 is the default and changes nothing.
    let o = infer(
        &[&args[..], &["--cache-type-k", "f16", "-n", "2"]].concat(),
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
}
