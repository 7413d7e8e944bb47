//! The importance matrix, end to end.
//!
//! - The weighted quantizers reproduce ggml's `quantize_*_impl` bytes with an importance matrix
//!   (golden vectors from ggml itself, tests/fixtures/quant/imatrix_golden.json).
//! - With an importance vector, the importance-weighted squared error of every weighted type is
//!   lower than without it, on a synthetic tensor.
//! - `infer imatrix` on a tiny f32 fixture: the first layer's q/k/v input is computable by hand
//!   (RMS norm of the token embeddings times the norm weight), so the collected means of
//!   `blk.0.attn_{q,k,v}.weight` are checked against that, computed here from the GGUF tensors.
//! - Observing a model does not change its logits; `quantize --imatrix` uses the file and rejects
//!   one made for another model.

mod common;

use std::path::{Path, PathBuf};

use common::{f32s, infer, load_runner, root, stderr, unhex};
use infer::eval::imatrix::Imatrix;
use infer::format::{GgmlType, Gguf};
use infer::quant::{dequantize_row, quantize_row, quantize_row_weighted};

const TYPES: [(GgmlType, &str); 9] = [
    (GgmlType::Q2K, "q2_K"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q5_1, "q5_1"),
    (GgmlType::Q3K, "q3_K"),
    (GgmlType::Q4K, "q4_K"),
    (GgmlType::Q5K, "q5_K"),
    (GgmlType::Q6K, "q6_K"),
];

#[test]
fn weighted_quantizers_match_ggml() {
    let text = std::fs::read_to_string(common::fixture("quant/imatrix_golden.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let qw = f32s(v["imatrix"].as_str().unwrap());
    let rows: Vec<Vec<f32>> = v["x"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| f32s(r.as_str().unwrap()))
        .collect();
    for (ty, key) in TYPES {
        for (r, x) in rows.iter().enumerate() {
            let want = unhex(v["weights"][key][r].as_str().unwrap());
            let mut got = Vec::new();
            quantize_row_weighted(ty, x, &qw, &mut got).unwrap();
            assert_eq!(got.len(), want.len(), "{key} row {r}");
            if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                panic!(
                    "{key} row {r}: byte {i} is {:#04x}, ggml wrote {:#04x}",
                    got[i], want[i]
                );
            }
            // and the importance changes the result (else the test above proves little)
            let mut plain = Vec::new();
            quantize_row(ty, x, &mut plain).unwrap();
            if r == 0 {
                assert_ne!(plain, got, "{key}: the importance matrix changed nothing");
            }
        }
    }
}

/// A deterministic pseudo-random stream in [-1, 1).
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn importance_lowers_the_weighted_error() {
    let (n, rows) = (1024, 32);
    // importance spanning four orders of magnitude, a few channels dominating
    let imp: Vec<f32> = noise(7, n)
        .iter()
        .enumerate()
        .map(|(i, u)| {
            if i % 37 == 0 {
                500.0
            } else {
                10f32.powf(2.0 * u)
            }
        })
        .collect();
    let x: Vec<f32> = noise(11, n * rows)
        .iter()
        .map(|u| 0.02 * u * u * u)
        .collect();
    for (ty, key) in TYPES {
        let err = |weighted: bool| -> f64 {
            let mut total = 0f64;
            for row in x.chunks_exact(n) {
                let mut q = Vec::new();
                if weighted {
                    quantize_row_weighted(ty, row, &imp, &mut q).unwrap();
                } else {
                    quantize_row(ty, row, &mut q).unwrap();
                }
                let mut back = vec![0f32; n];
                dequantize_row(ty, &q, &mut back).unwrap();
                for ((a, b), w) in row.iter().zip(&back).zip(&imp) {
                    total += *w as f64 * ((a - b) as f64).powi(2);
                }
            }
            total
        };
        let (plain, weighted) = (err(false), err(true));
        eprintln!("{key}: weighted error {plain:.4e} without, {weighted:.4e} with the importance");
        assert!(
            weighted < 0.9 * plain,
            "{key}: importance-weighted error {weighted:e} is not below {plain:e}"
        );
    }
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("imatrix-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run_ok(args: &[&str]) {
    let o = infer(args, None);
    assert!(o.status.success(), "{args:?} failed: {}", stderr(&o));
}

/// Converts an hf-tiny fixture to `ty`.
fn convert(name: &str, ty: &str, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{name}.{ty}.gguf"));
    let src = root().join("tests/fixtures/convert/hf-tiny").join(name);
    run_ok(&[
        "quantize",
        "--from-hf",
        src.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--type",
        ty,
    ]);
    out
}

fn tensor_f32(g: &Gguf, name: &str) -> Vec<f32> {
    let t = g.tensor(name).unwrap();
    let mut v = vec![0f32; t.n_elements() as usize];
    dequantize_row(t.ty, g.tensor_data(t), &mut v).unwrap();
    v
}

#[test]
fn imatrix_of_the_first_layer_matches_a_direct_computation() {
    let dir = scratch("first-layer");
    let gguf = convert("llama-gqa", "f32", &dir);
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            root().join("tests/fixtures/convert/hf-tiny/llama-gqa/reference.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let ids: Vec<usize> = json["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let text = dir.join("calib.txt");
    std::fs::write(&text, json["prompt"].as_str().unwrap()).unwrap();
    let out = dir.join("imatrix.dat");
    run_ok(&[
        "imatrix",
        "-m",
        gguf.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--ctx",
        &ids.len().to_string(),
        "--chunks",
        "1",
    ]);
    let m = Imatrix::load(&out).unwrap();

    let g = Gguf::open(&gguf).unwrap();
    let n_layer = g.get("llama.block_count").unwrap().as_u64().unwrap() as usize;
    assert_eq!(
        m.entries.len(),
        7 * n_layer,
        "q k v o gate up down per layer"
    );
    assert!(m.entries.keys().all(|k| k.starts_with("blk.")));
    assert_eq!(m.chunks, 1);
    assert!(m.dataset.ends_with("calib.txt"));

    // x_t = rmsnorm(embd[ids[t]]) * attn_norm; expected[c] = mean_t x_t[c]^2
    let eps = g
        .get("llama.attention.layer_norm_rms_epsilon")
        .unwrap()
        .as_f32()
        .unwrap() as f64;
    let embd = tensor_f32(&g, "token_embd.weight");
    let norm = tensor_f32(&g, "blk.0.attn_norm.weight");
    let d = norm.len();
    let mut want = vec![0f64; d];
    for &id in &ids {
        let e = &embd[id * d..(id + 1) * d];
        let ms = e.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + eps).sqrt();
        for c in 0..d {
            want[c] += (e[c] as f64 * r * norm[c] as f64).powi(2) / ids.len() as f64;
        }
    }
    for name in ["attn_q", "attn_k", "attn_v"] {
        let e = &m.entries[&format!("blk.0.{name}.weight")];
        assert_eq!(e.ncall, 1);
        assert_eq!(e.values.len(), d);
        for (c, (&got, &w)) in e.values.iter().zip(&want).enumerate() {
            assert!(
                (got as f64 - w).abs() <= 1e-4 * w.abs() + 1e-9,
                "blk.0.{name} channel {c}: {got} vs {w}"
            );
        }
    }
    // ffn_down's input is gate activations: n_ff wide
    let ff = m.entries["blk.0.ffn_down.weight"].values.len();
    assert_eq!(
        ff,
        g.get("llama.feed_forward_length")
            .unwrap()
            .as_u64()
            .unwrap() as usize
    );

    // quantize with it: used for every block matrix, and the bytes differ from without
    let (a, b) = (dir.join("with.gguf"), dir.join("without.gguf"));
    for (o, im) in [(&a, true), (&b, false)] {
        let mut args = vec![
            "quantize",
            "--in",
            gguf.to_str().unwrap(),
            "--out",
            o.to_str().unwrap(),
            "--type",
            "q4_0",
        ];
        if im {
            args.extend(["--imatrix", out.to_str().unwrap()]);
        }
        let r = infer(&args, None);
        assert!(r.status.success(), "{}", stderr(&r));
        if im {
            assert!(
                stderr(&r).contains(&format!(
                    "{} tensors quantized with the importance",
                    7 * n_layer
                )),
                "{}",
                stderr(&r)
            );
        }
    }
    assert_ne!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());

    // an entry of the wrong size (an imatrix of another model) is refused, naming the tensor
    let mut bad = m.clone();
    bad.entries
        .get_mut("blk.1.ffn_up.weight")
        .unwrap()
        .values
        .pop();
    let bad_path = dir.join("bad.dat");
    bad.save(&bad_path).unwrap();
    let r = infer(
        &[
            "quantize",
            "--in",
            gguf.to_str().unwrap(),
            "--out",
            dir.join("bad.gguf").to_str().unwrap(),
            "--type",
            "q4_k_m",
            "--imatrix",
            bad_path.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(r.status.code(), Some(1));
    let e = stderr(&r);
    assert!(
        e.contains("imatrix entry of `blk.1.ffn_up.weight` has 63 values"),
        "{e}"
    );
    assert!(!dir.join("bad.gguf").exists(), "no output on failure");
}

#[test]
fn imatrix_of_experts_has_one_slot_per_expert() {
    let dir = scratch("moe");
    let gguf = convert("mixtral-moe", "f32", &dir);
    let text = dir.join("calib.txt");
    std::fs::write(
        &text,
        "The quick brown fox jumps over the lazy dog. ".repeat(6),
    )
    .unwrap();
    let out = dir.join("imatrix.dat");
    run_ok(&[
        "imatrix",
        "-m",
        gguf.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--ctx",
        "32",
    ]);
    let m = Imatrix::load(&out).unwrap();
    let g = Gguf::open(&gguf).unwrap();
    let n_expert = g.get("llama.expert_count").unwrap().as_u64().unwrap() as usize;
    let up = &m.entries["blk.0.ffn_up_exps.weight"].values;
    assert_eq!(up.len(), n_expert * 64);
    // each expert saw only its own tokens: the slots differ
    assert_ne!(up[..64], up[64..128]);
    let q = dir.join("q.gguf");
    run_ok(&[
        "quantize",
        "--in",
        gguf.to_str().unwrap(),
        "--out",
        q.to_str().unwrap(),
        "--type",
        "q4_k_m",
        "--imatrix",
        out.to_str().unwrap(),
    ]);
}

#[test]
fn observing_a_model_leaves_its_logits_unchanged() {
    use infer::engine::runner::{Runner, Sequence, BLOCK_SIZE};
    use infer::eval::observe::Observed;
    use infer::kernels::cpu::backend::CpuBackend;
    use infer::model::{Model, ModelConfig, Weights};
    let dir = scratch("observe");
    let gguf = convert("qwen2", "q8_0", &dir);
    let tokens: Vec<u32> = (1..40).map(|i| (i * 7) % 300).collect();
    let (_g, mut plain) = load_runner(&gguf, 64);
    let mut s = Sequence {
        tokens: tokens.clone(),
        ..Sequence::default()
    };
    let want = plain.compute_all(&mut s).unwrap();

    let g = std::sync::Arc::new(Gguf::open(&gguf).unwrap());
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let backend = Observed::new(CpuBackend::new(2));
    let weights = Weights::load(&g, &cfg, &backend).unwrap();
    let model = Model {
        cfg,
        weights,
        backend,
        block_size: BLOCK_SIZE,
    };
    let mut observed = Runner::new(model, 64).unwrap();
    let mut s = Sequence {
        tokens,
        ..Sequence::default()
    };
    let got = observed.compute_all(&mut s).unwrap();
    assert_eq!(got, want, "observed logits differ");
    let m = observed.model.backend.finish(64, 1, "x");
    assert!(!m.entries.is_empty());
    // 39 tokens went through every block matrix: ceil(39 / 64) = 1 call
    assert!(m.entries.values().all(|e| e.ncall == 1));
}

#[test]
fn imatrix_usage_and_file_errors() {
    let dir = scratch("errors");
    let gguf = convert("qwen2", "f32", &dir);
    let (m, out) = (gguf.to_str().unwrap(), dir.join("i.dat"));
    let o = out.to_str().unwrap();
    let short = dir.join("short.txt");
    std::fs::write(&short, "hello").unwrap();
    let s = short.to_str().unwrap();
    let code = |args: &[&str]| {
        let r = infer(args, None);
        (r.status.code(), stderr(&r))
    };
    let (c, e) = code(&["imatrix", "-m", m, "-f", "/nonexistent", "-o", o]);
    assert_eq!(c, Some(2), "{e}");
    let (c, e) = code(&["imatrix", "-m", m, "-f", s, "-o", o, "--ctx", "2"]);
    assert_eq!(c, Some(2), "{e}");
    let (c, e) = code(&["imatrix", "-m", m, "-f", s, "-o", o, "--ctx", "64"]);
    assert_eq!(c, Some(1));
    assert!(e.contains("fewer than one window of 64"), "{e}");
    assert!(!out.exists());
    let q = dir.join("q.gguf");
    let q = q.to_str().unwrap();
    let args = [
        "quantize",
        "--in",
        m,
        "--out",
        q,
        "--type",
        "q4_0",
        "--imatrix",
    ];
    let (c, e) = code(&[&args[..], &["/nonexistent.dat"]].concat());
    assert_eq!(c, Some(2), "{e}");
    std::fs::write(&out, b"\x05\x00\x00\x00garbage").unwrap();
    let (c, e) = code(&[&args[..], &[o]].concat());
    assert_eq!(c, Some(1));
    assert!(e.contains("is not an imatrix file"), "{e}");
}
