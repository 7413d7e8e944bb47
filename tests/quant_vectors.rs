//! `quant` against gguf-py, an independent implementation of ggml's formats: the vectors in
//! tests/fixtures/quant/ were produced by scripts/gen-quant-vectors.py from gguf-py's numpy code.
//!
//! Dequantization and the quantizers gguf-py has (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) must
//! agree bit for bit; so must dequantization of rows of the real models' Q4_K/Q6_K/Q5_0/Q8_0/F32
//! tensors, read through `format::Gguf`.

mod common;

use infer::format::{GgmlType, Gguf};
use infer::quant::{dequantize_row, quantize_row};
use serde_json::Value;

use common::{f32s, unhex};

fn load(name: &str) -> Vec<Value> {
    let path = common::fixture(&format!("quant/{name}"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).expect("fixture is JSON");
    v["cases"].as_array().expect("cases array").clone()
}

fn ty(case: &Value) -> GgmlType {
    let name = case["type"].as_str().unwrap();
    GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name}"))
}

/// Asserts bit equality and reports the first differing element.
fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i}: got {g:e} ({:#010x}), gguf-py {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn dequantize_matches_gguf_py_bit_exactly() {
    let cases = load("dequant.json");
    let mut seen = Vec::new();
    for case in &cases {
        let t = ty(case);
        let raw = unhex(case["raw"].as_str().unwrap());
        let want = f32s(case["expected_f32"].as_str().unwrap());
        assert_eq!(want.len(), case["n"].as_u64().unwrap() as usize);
        let mut got = vec![f32::NAN; want.len()];
        dequantize_row(t, &raw, &mut got).unwrap();
        assert_bits_eq(t.name(), &got, &want);
        // Real values, not a degenerate all-zero case.
        assert!(
            want.iter().filter(|v| **v != 0.0).count() > want.len() / 2,
            "{}",
            t.name()
        );
        seen.push(t);
    }
    use GgmlType::*;
    for t in [
        F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K,
    ] {
        assert!(seen.contains(&t), "no dequant vectors for {}", t.name());
    }
}

#[test]
fn quantize_matches_gguf_py_bytes() {
    let cases = load("quantize.json");
    assert_eq!(cases.len(), 7);
    for case in &cases {
        let t = ty(case);
        let x = f32s(case["input_f32"].as_str().unwrap());
        let want = unhex(case["expected"].as_str().unwrap());
        let mut got = Vec::new();
        quantize_row(t, &x, &mut got).unwrap();
        assert_eq!(got.len(), want.len(), "{}", t.name());
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            let bs = t.type_size();
            panic!(
                "{}: byte {i} (block {}) differs: got {:02x?}, gguf-py {:02x?}",
                t.name(),
                i / bs,
                &got[i / bs * bs..(i / bs + 1) * bs],
                &want[i / bs * bs..(i / bs + 1) * bs]
            );
        }
    }
}

#[test]
fn real_model_rows_dequantize_like_gguf_py() {
    let cases = load("models.json");
    let mut types = Vec::new();
    let mut open: Option<(String, Gguf)> = None;
    for case in &cases {
        let file = case["model"].as_str().unwrap();
        if open.as_ref().map(|(f, _)| f.as_str()) != Some(file) {
            let path = common::model(file);
            let g = Gguf::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            open = Some((file.to_string(), g));
        }
        let g = &open.as_ref().unwrap().1;
        let name = case["tensor"].as_str().unwrap();
        let info = g
            .tensor(name)
            .unwrap_or_else(|| panic!("{file}: no tensor {name}"));
        let t = ty(case);
        assert_eq!(info.ty, t, "{file}:{name} type");
        let row_len = case["row_len"].as_u64().unwrap() as usize;
        assert_eq!(info.row_len(), row_len, "{file}:{name} row length");
        assert_eq!(info.n_rows(), case["n_rows"].as_u64().unwrap() as usize);
        let row = case["row"].as_u64().unwrap() as usize;
        let n = case["n"].as_u64().unwrap() as usize;
        let row_bytes = t.row_bytes(row_len).unwrap();
        let data = g.tensor_data(info);
        let bytes = &data[row * row_bytes..][..t.row_bytes(n).unwrap()];
        let want = f32s(case["expected_f32"].as_str().unwrap());
        let mut got = vec![f32::NAN; n];
        dequantize_row(t, bytes, &mut got).unwrap();
        assert_bits_eq(&format!("{file}:{name} row {row}"), &got, &want);
        assert!(got.iter().any(|v| *v != 0.0));
        types.push(t);
    }
    use GgmlType::*;
    for t in [Q4K, Q6K, Q5_0, Q8_0, F32] {
        assert!(types.contains(&t), "no real-model vectors for {}", t.name());
    }
}
