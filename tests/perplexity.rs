//! `infer perplexity` against independent truths.
//!
//! Perplexity: the tiny hf-tiny checkpoints come with transformers' logits for every position of
//! a 24-token reference prompt (`reference.safetensors`). A window of `ctx <= 24` tokens of that
//! prompt is exactly one window of llama.cpp's method, so the expected figure is computed here,
//! in f64, from transformers' logits: `exp(mean over p in ctx/2..=ctx-2 of -ln softmax(logits[p])
//! [ids[p+1]])`, with its standard error. The CLI must reproduce it from the converted f32 GGUF
//! (whose logits are within 1e-4 of transformers', see hf_fixtures.rs).
//!
//! KL divergence: a q8_0 conversion of the same checkpoint is scored against the f32 one; the
//! expected KL(base || model) uses transformers' logits for the base and this crate's runner for
//! the q8_0 model's logits (computed here through the library, not the CLI), with the sum over
//! the vocabulary written out in this file.

mod common;

use std::path::{Path, PathBuf};

use common::{infer, load_runner, root, stderr, stdout};
use infer::engine::runner::Sequence;
use serde_json::Value as Json;

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/convert/hf-tiny").join(name)
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("perplexity-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn convert(name: &str, ty: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}.{ty}.gguf"));
    let src = fixture(name);
    let o = infer(
        &[
            "quantize",
            "--from-hf",
            src.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--type",
            ty,
        ],
        None,
    );
    assert!(
        o.status.success(),
        "{name}: conversion failed: {}",
        stderr(&o)
    );
    out
}

/// transformers' prompt ids and logits (row-major, one row per prompt position), and the prompt.
fn reference(name: &str) -> (Vec<u32>, Vec<Vec<f32>>, String) {
    let bytes = std::fs::read(fixture(name).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids: Vec<u32> = st
        .tensor("input_ids")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32)
        .collect();
    let flat: Vec<f32> = st
        .tensor("logits")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let vocab = flat.len() / ids.len();
    let rows = flat.chunks_exact(vocab).map(|r| r.to_vec()).collect();
    let json: Json = serde_json::from_str(
        &std::fs::read_to_string(fixture(name).join("reference.json")).unwrap(),
    )
    .unwrap();
    (ids, rows, json["prompt"].as_str().unwrap().to_owned())
}

/// ln softmax(row)[i] in f64.
fn log_probs(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row.iter().map(|&x| x as f64 - max - z.ln()).collect()
}

/// Mean and standard error (sample sd / sqrt(n)) of a sample.
fn mean_err(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0);
    (m, (var / n).sqrt())
}

fn perplexity_json(args: &[&str]) -> Json {
    let o = infer(args, None);
    assert!(o.status.success(), "perplexity failed: {}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).expect("one JSON object")
}

fn close(got: f64, want: f64, rel: f64, what: &str) {
    assert!(
        (got - want).abs() <= rel * want.abs().max(1e-12),
        "{what}: got {got}, expected {want} (relative tolerance {rel})"
    );
}

/// The CLI's perplexity of one window of `ctx` prompt tokens equals the one computed from
/// transformers' logits.
fn check_window(name: &str, ctxs: &[usize]) {
    let dir = scratch(name);
    let gguf = convert(name, "f32", &dir);
    let (ids, logits, prompt) = reference(name);
    let text = dir.join("prompt.txt");
    std::fs::write(&text, &prompt).unwrap();
    for &ctx in ctxs {
        let nll: Vec<f64> = (ctx / 2..=ctx - 2)
            .map(|p| -log_probs(&logits[p])[ids[p + 1] as usize])
            .collect();
        let (m, e) = mean_err(&nll);
        let c = ctx.to_string();
        // forward calls of 5 tokens: the window is run in pieces, same figures
        let batch = if ctx % 2 == 0 { "512" } else { "5" };
        let j = perplexity_json(&[
            "perplexity",
            "-m",
            gguf.to_str().unwrap(),
            "-f",
            text.to_str().unwrap(),
            "--ctx",
            &c,
            "--batch",
            batch,
            "--chunks",
            "1",
            "--json",
        ]);
        eprintln!("{name} ctx {ctx}: {j}, expected ppl {}", m.exp());
        assert_eq!(j["windows"], 1);
        assert_eq!(j["tokens_scored"].as_u64().unwrap() as usize, nll.len());
        close(j["nll"].as_f64().unwrap(), m, 1e-4, "mean NLL");
        close(j["ppl"].as_f64().unwrap(), m.exp(), 1e-4, "perplexity");
        close(
            j["ppl_err"].as_f64().unwrap(),
            e * m.exp(),
            1e-2,
            "standard error",
        );
    }
}

#[test]
fn perplexity_matches_transformers_logits_with_bos() {
    // llama's tokenizer adds BOS: the window starts with it
    check_window("llama-gqa", &[24, 16, 9]);
}

#[test]
fn perplexity_matches_transformers_logits_without_bos() {
    check_window("qwen2", &[24, 13, 21]);
}

#[test]
fn kl_divergence_matches_independent_sum() {
    let name = "llama-gqa";
    let dir = scratch("kl");
    let base = convert(name, "f32", &dir);
    let q = convert(name, "q4_0", &dir);
    let (ids, ref_logits, prompt) = reference(name);
    let text = dir.join("prompt.txt");
    std::fs::write(&text, &prompt).unwrap();
    let ctx = 24;

    // the quantized model's logits through the library
    let (_g, mut runner) = load_runner(&q, 64);
    let mut seq = Sequence {
        tokens: ids[..ctx].to_vec(),
        ..Sequence::default()
    };
    let rows = runner.compute_all(&mut seq).unwrap();
    let (mut kls, mut same, mut base_nll, mut diffs) = (Vec::new(), 0usize, Vec::new(), Vec::new());
    for p in ctx / 2..=ctx - 2 {
        let (lb, lm) = (log_probs(&ref_logits[p]), log_probs(&rows[p]));
        kls.push(
            lb.iter()
                .zip(&lm)
                .map(|(b, m)| b.exp() * (b - m))
                .sum::<f64>(),
        );
        same += (common::argmax(&ref_logits[p]) == common::argmax(&rows[p])) as usize;
        base_nll.push(-lb[ids[p + 1] as usize]);
        diffs.push(lb[ids[p + 1] as usize] - lm[ids[p + 1] as usize]);
    }
    let (kl, kl_err) = mean_err(&kls);
    let top1 = same as f64 / kls.len() as f64;
    assert!(kl > 1e-6, "q4_0 must differ from f32 (KL {kl})");

    let j = perplexity_json(&[
        "perplexity",
        "-m",
        q.to_str().unwrap(),
        "--kl-divergence",
        base.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "--ctx",
        "24",
        "--chunks",
        "1",
        "--json",
    ]);
    eprintln!("{j}; expected KL {kl} ± {kl_err}, top-1 {top1}");
    let k = &j["kl"];
    close(k["mean"].as_f64().unwrap(), kl, 2e-2, "mean KL");
    close(
        k["err"].as_f64().unwrap(),
        kl_err,
        5e-2,
        "KL standard error",
    );
    assert!((k["top1"].as_f64().unwrap() - top1).abs() < 1e-9, "top-1");
    close(
        k["base_ppl"].as_f64().unwrap(),
        mean_err(&base_nll).0.exp(),
        1e-4,
        "base perplexity",
    );
    // the paired comparison: mean of nll(model) - nll(base) per token, and its standard error
    let (ln_ratio, ln_ratio_err) = mean_err(&diffs);
    assert!(
        (k["ln_ppl_ratio"].as_f64().unwrap() - ln_ratio).abs() < 1e-3,
        "ln(PPL / base PPL) {} vs {ln_ratio}",
        k["ln_ppl_ratio"]
    );
    close(
        k["ln_ppl_ratio_err"].as_f64().unwrap(),
        ln_ratio_err,
        5e-2,
        "ln ratio standard error",
    );

    // a model against itself: no divergence, always the same first token
    let j = perplexity_json(&[
        "perplexity",
        "-m",
        base.to_str().unwrap(),
        "--kl-divergence",
        base.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "--ctx",
        "24",
        "--json",
    ]);
    assert!(j["kl"]["mean"].as_f64().unwrap().abs() < 1e-9);
    assert_eq!(j["kl"]["top1"].as_f64().unwrap(), 1.0);
    assert_eq!(j["ppl"], j["kl"]["base_ppl"]);
    assert_eq!(j["kl"]["ln_ppl_ratio"].as_f64().unwrap(), 0.0);
}

#[test]
fn perplexity_usage_errors() {
    let dir = scratch("usage");
    let gguf = convert("qwen2", "f32", &dir);
    let m = gguf.to_str().unwrap();
    let text = dir.join("short.txt");
    std::fs::write(&text, "too short").unwrap();
    let t = text.to_str().unwrap();
    let o = infer(&["perplexity", "-m", m, "-f", t, "--ctx", "2"], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--ctx must be at least 4"));
    let o = infer(&["perplexity", "-m", m, "-f", "/nonexistent.txt"], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = infer(&["perplexity", "-m", m, "-f", t, "--ctx", "64"], None);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(
        e.starts_with("infer: ") && e.contains("fewer than one window of 64"),
        "{e}"
    );
    // text output: one line, the llama.cpp-style figure
    let long = dir.join("long.txt");
    std::fs::write(
        &long,
        "the quick brown fox jumps over the lazy dog. ".repeat(8),
    )
    .unwrap();
    let o = infer(
        &[
            "perplexity",
            "-q",
            "-m",
            m,
            "-f",
            long.to_str().unwrap(),
            "--ctx",
            "16",
        ],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("PPL = ") && out.contains(" +/- "), "{out}");
    assert!(stderr(&o).is_empty(), "--quiet leaves stderr empty");
}

/// Both real models against llama.cpp's `llama-perplexity` on the same text and windows
/// (`llama-perplexity -m MODEL -f tests/fixtures/eval/sherlock-eval.txt -c CTX --chunks 4 -t 2`,
/// llama.cpp build of ggml 0.25.3): the final figure within 1%. Gemma adds BOS (each window starts
/// with it), Qwen does not.
#[test]
fn real_models_match_llama_perplexity() {
    let text = root().join("tests/fixtures/eval/sherlock-eval.txt");
    for (file, ctx, want) in [
        (common::QWEN, "128", 16.0129),
        (common::GEMMA, "256", 28.8105),
    ] {
        let m = common::model(file);
        let j = perplexity_json(&[
            "perplexity",
            "-m",
            m.to_str().unwrap(),
            "-f",
            text.to_str().unwrap(),
            "--ctx",
            ctx,
            "--chunks",
            "4",
            "--json",
        ]);
        let got = j["ppl"].as_f64().unwrap();
        eprintln!("{file}: PPL {got} (llama.cpp {want})");
        assert_eq!(j["windows"], 4);
        close(got, want, 0.01, file);
    }
}
