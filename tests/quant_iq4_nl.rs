//! IQ4_NL, a type added as one `quant::QuantType`, against truth that is not ours:
//! - gguf-py's dequantization of synthetic blocks and of the tensors of a file llama.cpp wrote
//!   (`tests/fixtures/quant/iq4_nl/gguf_py.json`, from `scripts/gen-iq4nl-vectors.py`);
//! - that file itself: `llama-quantize tiny-qwen2-f32.gguf ... IQ4_NL` (llama.cpp 0c1e57098, see the
//!   fixture folder's README): our quantizer writes its IQ4_NL tensors byte for byte from the F32
//!   source, through the library and through `infer quantize --type iq4_nl`;
//! - llama.cpp's greedy tokens on that file (`llamacpp_greedy.json`, from llama-server), which
//!   `infer run` reproduces on the CPU backend.

mod common;

use std::path::PathBuf;

use infer::format::{GgmlType, Gguf};
use infer::quant::{dequantize_row, quantize_row};
use serde_json::Value;

fn dir(file: &str) -> PathBuf {
    common::fixture("quant/iq4_nl").join(file)
}

fn json(file: &str) -> Value {
    let p = dir(file);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

use common::{f32s, unhex};

fn f32_bits(hex: &str) -> Vec<u32> {
    f32s(hex).iter().map(|x| x.to_bits()).collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn open(file: &str) -> Gguf {
    Gguf::open(&dir(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// The IQ4_NL tensors of llama.cpp's file, with the F32 source's values of each.
fn iq4_nl_tensors() -> Vec<(String, usize, Vec<u8>, Vec<f32>)> {
    let (q, f) = (open("tiny-qwen2-iq4_nl.gguf"), open("tiny-qwen2-f32.gguf"));
    let mut out = Vec::new();
    for t in q.tensors.iter().filter(|t| t.ty == GgmlType::IQ4NL) {
        let src = f.tensor(&t.name).expect("the source has every tensor");
        assert_eq!((src.ty, &src.dims), (GgmlType::F32, &t.dims), "{}", t.name);
        let values: Vec<f32> = f
            .tensor_data(src)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let row_len = t.dims[0] as usize;
        out.push((t.name.clone(), row_len, q.tensor_data(t).to_vec(), values));
    }
    // Every weight matrix of the two layers: q, k, v, output, gate, up, down.
    assert_eq!(out.len(), 14, "IQ4_NL tensors in the fixture");
    out
}

#[test]
fn synthetic_blocks_dequantize_like_gguf_py() {
    let v = json("gguf_py.json");
    let cases = v["cases"].as_array().unwrap();
    assert!(!cases.is_empty());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let n = case["n"].as_u64().unwrap() as usize;
        let raw = unhex(case["raw"].as_str().unwrap());
        assert_eq!(raw.len(), n / 32 * 18, "{name}");
        let mut got = vec![0f32; n];
        dequantize_row(GgmlType::IQ4NL, &raw, &mut got).unwrap();
        assert_eq!(
            bits(&got),
            f32_bits(case["expected_f32"].as_str().unwrap()),
            "{name}"
        );
    }
}

#[test]
fn llama_cpp_file_dequantizes_like_gguf_py() {
    let v = json("gguf_py.json");
    let g = open("tiny-qwen2-iq4_nl.gguf");
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 14);
    for e in tensors {
        let name = e["name"].as_str().unwrap();
        let t = g
            .tensor(name)
            .unwrap_or_else(|| panic!("{name} in the file"));
        assert_eq!(t.ty, GgmlType::IQ4NL, "{name}");
        let (rows, len) = (
            e["n_rows"].as_u64().unwrap() as usize,
            e["row_len"].as_u64().unwrap() as usize,
        );
        let data = g.tensor_data(t);
        let rb = GgmlType::IQ4NL.row_bytes(len).unwrap();
        assert_eq!(data.len(), rows * rb, "{name}");
        for (row, key) in [(0, "first_row_f32"), (rows - 1, "last_row_f32")] {
            let mut got = vec![0f32; len];
            dequantize_row(GgmlType::IQ4NL, &data[row * rb..(row + 1) * rb], &mut got).unwrap();
            let want = f32_bits(e[key].as_str().unwrap());
            assert_eq!(bits(&got), want, "{name} row {row}");
        }
    }
}

#[test]
fn quantizer_writes_llama_cpp_bytes() {
    for (name, row_len, want, values) in iq4_nl_tensors() {
        let mut got = Vec::new();
        let mut row = Vec::new();
        for r in values.chunks_exact(row_len) {
            quantize_row(GgmlType::IQ4NL, r, &mut row).unwrap();
            got.extend_from_slice(&row);
        }
        assert_eq!(got.len(), want.len(), "{name}");
        let first = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(first.is_none(), "{name}: first differing byte {first:?}");
    }
}

#[test]
fn quantize_command_writes_the_same_tensors() {
    let out = std::env::temp_dir().join(format!("infer-iq4nl-{}.gguf", std::process::id()));
    let src = dir("tiny-qwen2-f32.gguf");
    let o = common::infer(
        &[
            "quantize",
            "--in",
            src.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--type",
            "iq4_nl",
        ],
        None,
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    let ours = Gguf::open(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    // llama.cpp's IQ4_NL file type, as `llama-quantize` records it.
    let ft = ours.get_u64("general.file_type");
    assert_eq!(ft, Some(25));
    for (name, _, want, _) in iq4_nl_tensors() {
        let t = ours.tensor(&name).unwrap();
        assert_eq!(t.ty, GgmlType::IQ4NL, "{name}");
        assert!(ours.tensor_data(t) == &want[..], "{name}: bytes differ");
    }
}

#[test]
fn greedy_run_matches_llama_cpp() {
    let v = json("llamacpp_greedy.json");
    let ids = |k: &str| -> Vec<u64> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    let prompt: Vec<String> = ids("prompt_ids").iter().map(u64::to_string).collect();
    let want = ids("iq4_nl_greedy_ids");
    let m = dir("tiny-qwen2-iq4_nl.gguf");
    let o = common::infer(
        &[
            "run",
            "-m",
            m.to_str().unwrap(),
            "--prompt-ids",
            &prompt.join(","),
            "-n",
            &want.len().to_string(),
            "--temp",
            "0",
            "--json",
            "--logprobs",
            "2",
            "--device",
            "cpu",
        ],
        None,
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    let lines: Vec<Value> = common::stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v.get("id").is_some())
        .collect();
    let got: Vec<u64> = lines.iter().map(|v| v["id"].as_u64().unwrap()).collect();
    assert_eq!(got, want, "greedy ids on llama.cpp's IQ4_NL file");
    // The two most likely tokens of every step, with llama-server's probabilities (rounded there
    // to 9 digits): the logits agree far below the smallest top-1/top-2 gap (a 5% ratio).
    for (step, (line, top2)) in lines
        .iter()
        .zip(v["iq4_nl_top2"].as_array().unwrap())
        .enumerate()
    {
        let ours = line["top_logprobs"].as_array().unwrap();
        for (o, t) in ours.iter().zip(top2.as_array().unwrap()) {
            let (id, p) = (t[0].as_u64().unwrap(), t[1].as_f64().unwrap());
            assert_eq!(o["id"].as_u64(), Some(id), "step {step}");
            let q = o["logprob"].as_f64().unwrap().exp();
            assert!(
                (q - p).abs() <= 1e-5 * p,
                "step {step} token {id}: {q} vs {p}"
            );
        }
    }
}

/// llama.cpp's quantizer on 64 stress blocks (zeros, values under its 1e-15 threshold, exact ties
/// of the nearest-level search, outliers, scales past f16's range): the same bytes.
#[test]
fn quantizer_matches_ggml_on_stress_blocks() {
    let v = json("ggml_ref.json");
    let q = &v["quantize"];
    let n = q["n_per_row"].as_u64().unwrap() as usize;
    let x = f32s(q["input_f32"].as_str().unwrap());
    let want = unhex(q["expected"].as_str().unwrap());
    let mut got = Vec::new();
    let mut row = Vec::new();
    for r in x.chunks_exact(n) {
        quantize_row(GgmlType::IQ4NL, r, &mut row).unwrap();
        got.extend_from_slice(&row);
    }
    assert_eq!(got.len(), want.len());
    for (b, (g, w)) in got.chunks(18).zip(want.chunks(18)).enumerate() {
        let kind = &q["block_kinds"].as_array().map(|k| k[b].to_string());
        assert_eq!(g, w, "block {b} ({kind:?})");
    }
}

/// The dot products: the CPU kernel the matmul runs for IQ4_NL equals llama.cpp's default AVX2
/// path (the repacked `gemv`) bit for bit, and the scalar reference (ggml's generic arithmetic)
/// both of llama.cpp's within float rounding. Rows of 256 and 160 values (an odd block count).
#[test]
fn dot_products_match_llama_cpp() {
    let v = json("ggml_ref.json");
    for case in v["dots"].as_array().unwrap() {
        let num = |k: &str| case[k].as_u64().unwrap() as usize;
        let (n, rows) = (num("n"), num("n_rows"));
        let w = unhex(case["weights"].as_str().unwrap());
        let a = unhex(case["act_q8_0"].as_str().unwrap());
        let rb = GgmlType::IQ4NL.row_bytes(n).unwrap();
        let floats = |k: &str| f32s(case[k].as_str().unwrap());
        let (gemv, vec_dot) = (floats("gemv_iq4_nl_8x8_avx2"), floats("vec_dot_avx2"));
        let kernel = infer::kernels::cpu::simd::kernels(GgmlType::IQ4NL);
        for r in 0..rows {
            let wr = &w[r * rb..(r + 1) * rb];
            let reference = infer::quant::vec_dot(GgmlType::IQ4NL, n, wr, &a);
            let scale: f32 = gemv[r].abs().max(1.0);
            for (what, want) in [("gemv", gemv[r]), ("vec_dot", vec_dot[r])] {
                let err = (reference - want).abs();
                assert!(
                    err <= 1e-5 * scale,
                    "n={n} row {r}: reference vs {what}: {err}"
                );
            }
            if let Some(k) = kernel {
                let got = (k.dot)(n, wr, &a);
                assert_eq!(got.to_bits(), gemv[r].to_bits(), "{} n={n} row {r}", k.name);
            }
        }
    }
}
