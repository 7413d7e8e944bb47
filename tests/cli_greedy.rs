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
