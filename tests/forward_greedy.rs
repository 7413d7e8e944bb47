//! The forward pass alone (no tokenizer, no sampler): greedy argmax from llama.cpp's own prompt ids
//! must reproduce llama.cpp's generated ids on both real models.

mod common;

use std::sync::Arc;

use common::{fixture, model, GEMMA, QWEN};
use infer::engine::runner::{Runner, Sequence, BLOCK_SIZE};
use infer::format::Gguf;
use infer::kernels::cpu::backend::CpuBackend;
use infer::model::{Model, ModelConfig, Weights};

fn ids(name: &str, tag: &str) -> Vec<u32> {
    let s = std::fs::read_to_string(fixture(&format!("refs/{name}.ids"))).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(tag))
        .unwrap()
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn check(file: &str, name: &str) {
    let g = Arc::new(Gguf::open(&model(file)).unwrap());
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let backend = CpuBackend::new(2);
    let weights = Weights::load(&g, &cfg, &backend).unwrap();
    let model = Model {
        cfg,
        weights,
        backend,
        block_size: BLOCK_SIZE,
    };
    let mut runner = Runner::new(model, 256).unwrap();
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
