//! Greedy generation on the real models must equal llama.cpp's continuation of the same file, token
//! for token (refs in tests/fixtures/refs, produced by llama.cpp's CPU build).

mod common;

use common::{fixture, model, GEMMA, QWEN};

fn reference(name: &str) -> (String, Vec<u32>, Vec<u32>) {
    let text = std::fs::read_to_string(fixture(&format!("refs/{name}.txt"))).unwrap();
    let ids = std::fs::read_to_string(fixture(&format!("refs/{name}.ids"))).unwrap();
    let line = |tag: &str| -> Vec<u32> {
        ids.lines()
            .find_map(|l| l.strip_prefix(tag))
            .unwrap_or_else(|| panic!("{tag} in {name}.ids"))
            .split_whitespace()
            .map(|t| t.parse().unwrap())
            .collect()
    };
    (text, line("PROMPT_IDS:"), line("GEN_IDS:"))
}

fn check(file: &str, refname: &str) {
    let m = model(file);
    let m = m.to_str().unwrap();
    let (text, prompt_ids, gen_ids) = reference(refname);
    let out = infer_ok!(None; "run", "-m", m, "-p", "The capital of France is", "-n", "48", "--temp", "0", "--json");
    let mut ids = Vec::new();
    let mut got_text = String::new();
    let mut done = None;
    for line in out.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v.get("done").is_some() {
            done = Some(v);
        } else {
            if let Some(id) = v.get("id") {
                ids.push(id.as_u64().unwrap() as u32);
            }
            got_text.push_str(v["text"].as_str().unwrap());
        }
    }
    let done = done.expect("a final done line");
    assert_eq!(
        done["prompt_tokens"].as_u64(),
        Some(prompt_ids.len() as u64)
    );
    assert_eq!(ids, gen_ids, "generated ids differ from llama.cpp's");
    assert_eq!(got_text, text.trim_end_matches('\n'));
    assert_eq!(done["generated_tokens"].as_u64(), Some(48));
    assert_eq!(done["stop"].as_str(), Some("length"));
    // the plain text mode prints the same continuation and nothing else
    let plain = infer_ok!(None; "run", "-m", m, "-p", "The capital of France is", "-n", "48", "--temp", "0");
    assert_eq!(plain, text.trim_end_matches('\n'));
}

#[test]
fn qwen_greedy_matches_llama_cpp() {
    check(QWEN, "qwen-coder-1.5b__capital");
}

#[test]
fn gemma_greedy_matches_llama_cpp() {
    check(GEMMA, "gemma-3-270m-q4_k_m__capital");
}

/// Ids and log-probabilities of `infer run --json --logprobs 1` at the SIMD level `level`.
fn run_at(file: &str, level: &str, n: usize) -> (Vec<u32>, Vec<String>) {
    let m = model(file);
    let n = n.to_string();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_infer"))
        .args([
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "The capital of France is",
        ])
        .args(["-n", &n, "--temp", "0", "--json", "--logprobs", "1"])
        .env("INFER_SIMD", level)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::stderr(&out));
    let (mut ids, mut lps) = (Vec::new(), Vec::new());
    for line in common::stdout(&out).lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if let Some(id) = v.get("id") {
            ids.push(id.as_u64().unwrap() as u32);
            lps.push(v["logprob"].to_string());
        }
    }
    (ids, lps)
}

/// Every SIMD level this CPU has, forced with `INFER_SIMD`: each vector level gives llama.cpp's
/// ids, and all of them the same log-probabilities to the printed digit (the AVX-512 kernels
/// reproduce the AVX2 ones' arithmetic); the scalar level, ggml's generic C whose float sums run
/// in another order (as llama.cpp's own non-SIMD build differs from its AVX2 build), gives
/// llama.cpp's first ten tokens on Gemma. Levels the CPU lacks are named on stderr.
#[test]
fn every_simd_level_gives_llama_cpp_tokens() {
    use infer::kernels::cpu::simd::Level;
    for (file, refname) in [
        (GEMMA, "gemma-3-270m-q4_k_m__capital"),
        (QWEN, "qwen-coder-1.5b__capital"),
    ] {
        let (_, _, want) = reference(refname);
        let mut first: Option<(&str, Vec<String>)> = None;
        for level in [Level::Avx2, Level::Avx512] {
            if !level.available() {
                eprintln!("{file}: no {} level on this CPU", level.name());
                continue;
            }
            let (ids, lps) = run_at(file, level.name(), 48);
            assert_eq!(ids, want, "{file} at {}", level.name());
            match &first {
                None => first = Some((level.name(), lps)),
                Some((name, base)) => {
                    assert_eq!(&lps, base, "{file}: {} vs {name}", level.name())
                }
            }
        }
        assert!(first.is_some(), "no SIMD level ran");
    }
    let (_, _, want) = reference("gemma-3-270m-q4_k_m__capital");
    let (ids, _) = run_at(GEMMA, "scalar", 10);
    assert_eq!(ids, want[..10], "gemma at the scalar level");
}
