//! Greedy parity with llama.cpp: for every fixture in `tests/fixtures/parity/` (a prompt, its token
//! ids from `llama-tokenize`, and the ids llama.cpp 0c1e57098 generated greedily from them), the
//! engine, driven through the library as `infer run --temp 0` drives it (prompt in one
//! `Runner::extend`, then one token per step), must generate exactly the same ids.
//!
//! Most fixtures were made by a CPU llama.cpp built with `GGML_NATIVE=ON` on an AVX2 machine (this
//! kind of VM with AVX-512 hidden) with 2 threads and default flags (flash attention auto, f16 KV
//! cache, batch 2048 / ubatch 512); the two `refs_*_avx512` ones are the reference outputs of the
//! AVX-512 build (`tests/fixtures/refs`). Each records its build in its `llamacpp` object, and the
//! test makes the kernels mimic it (`set_ggml_isa`, `set_llamacpp_threads`) whatever CPU runs the
//! test. They cover short prompts of
//! many kinds (code, lists, JSON, chat templates, unicode, emoji), the tiled attention kernel
//! (prompts of 64+ tokens), a prompt longer than one 512-token ubatch, and decoding past 256 and
//! 512 KV cells (llama.cpp's split-KV decode kernel).

mod common;

use std::sync::Arc;

use common::{fixture, model};
use infer::engine::runner::{Runner, Sequence, BLOCK_SIZE};
use infer::format::Gguf;
use infer::kernels::cpu::attention::set_llamacpp_threads;
use infer::kernels::cpu::backend::CpuBackend;
use infer::kernels::cpu::ops::{set_ggml_isa, GgmlIsa};
use infer::model::{Model, ModelConfig, Weights};
use serde_json::Value;

struct Fixture {
    name: String,
    model: String,
    prompt_ids: Vec<u32>,
    gen_ids: Vec<u32>,
    isa: GgmlIsa,
    threads: usize,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("token id") as u32)
        .collect()
}

fn load_fixtures() -> Vec<Fixture> {
    let dir = fixture("parity");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
            let l = &v["llamacpp"];
            Fixture {
                name: v["name"].as_str().unwrap().to_string(),
                model: v["model"].as_str().unwrap().to_string(),
                prompt_ids: ids(&v["prompt_ids"]),
                gen_ids: ids(&v["gen_ids"]),
                isa: match l["isa"].as_str() {
                    Some("avx512") => GgmlIsa::Avx512,
                    _ => GgmlIsa::Avx2,
                },
                threads: l["threads"].as_u64().unwrap_or(2) as usize,
            }
        })
        .collect()
}

/// Greedy ids (first maximum, as llama.cpp's greedy sampler) for `f.gen_ids.len()` steps.
fn generate(runner: &mut Runner<CpuBackend>, f: &Fixture) -> Vec<u32> {
    let mut seq = Sequence::default();
    let mut logits = runner.extend(&mut seq, &f.prompt_ids).unwrap();
    let mut out = Vec::new();
    loop {
        let mut best = 0;
        for (j, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = j;
            }
        }
        out.push(best as u32);
        if out.len() == f.gen_ids.len() || best as u32 != f.gen_ids[out.len() - 1] {
            break;
        }
        logits = runner.extend(&mut seq, &[best as u32]).unwrap();
    }
    drop(seq);
    out
}

#[test]
fn greedy_ids_match_llamacpp() {
    let fixtures = load_fixtures();
    assert!(fixtures.len() >= 20, "expected the parity fixtures");
    let mut models: Vec<&str> = fixtures.iter().map(|f| f.model.as_str()).collect();
    models.sort();
    models.dedup();
    let mut failures = Vec::new();
    let mut tokens = 0;
    for file in models {
        let g = Arc::new(Gguf::open(&model(file)).unwrap());
        let cfg = ModelConfig::from_gguf(&g).unwrap();
        let backend = CpuBackend::new(2);
        let weights = Weights::load(&g, &cfg, &backend).unwrap();
        let m = Model {
            cfg,
            weights,
            backend,
            block_size: BLOCK_SIZE,
        };
        let n_ctx = fixtures
            .iter()
            .filter(|f| f.model == file)
            .map(|f| f.prompt_ids.len() + f.gen_ids.len() + 1)
            .max()
            .unwrap();
        let mut runner = Runner::new(m, n_ctx).unwrap();
        for f in fixtures.iter().filter(|f| f.model == file) {
            set_ggml_isa(f.isa);
            set_llamacpp_threads(f.threads);
            let t0 = std::time::Instant::now();
            let got = generate(&mut runner, f);
            let secs = t0.elapsed().as_secs_f32();
            tokens += got.len();
            if got != f.gen_ids {
                let at = got
                    .iter()
                    .zip(&f.gen_ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                eprintln!(
                    "{}: diverges at generated token {at}: llama.cpp {:?}, ours {:?}",
                    f.name,
                    f.gen_ids.get(at),
                    got.get(at)
                );
                failures.push(f.name.clone());
            } else {
                eprintln!("{}: {} tokens identical ({secs:.1} s)", f.name, got.len());
            }
        }
    }
    eprintln!("{tokens} generated tokens compared");
    assert!(
        failures.is_empty(),
        "greedy output differs from llama.cpp: {failures:?}"
    );
}
