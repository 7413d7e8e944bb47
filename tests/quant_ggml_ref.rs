//! `quant` against golden vectors produced by ggml's own C code (tests/fixtures/quant/ggml_ref.json;
//! its `source` field names the commit and build flags): the parts gguf-py cannot check — the
//! k-quant weight quantizers, the Q8_1/Q8_K activation quantizers, ggml-cpu's x86 AVX Q8_0/Q8_1
//! activation quantizer, and the generic `ggml_vec_dot_*` results — must match bit for bit.

mod common;

use infer::format::GgmlType;
use infer::quant::{quantize_activations_as, quantize_row, vec_dot, Q8Variant};
use serde_json::Value;

use common::{f32s, unhex};

fn golden() -> (usize, Vec<Value>) {
    let path = common::fixture("quant/ggml_ref.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap();
    (
        v["n"].as_u64().unwrap() as usize,
        v["rows"].as_array().unwrap().clone(),
    )
}

const WEIGHT_TYPES: [GgmlType; 10] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

#[test]
fn weight_quantizers_match_ggml_ref() {
    let (n, rows) = golden();
    assert_eq!(rows.len(), 5);
    for (r, row) in rows.iter().enumerate() {
        let x = f32s(row["x"].as_str().unwrap());
        assert_eq!(x.len(), n);
        for t in WEIGHT_TYPES {
            let want = unhex(row["weights"][t.name()].as_str().unwrap());
            let mut got = Vec::new();
            quantize_row(t, &x, &mut got).unwrap();
            assert_eq!(got.len(), want.len(), "{} row {r}", t.name());
            if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                panic!(
                    "{} row {r}: byte {i} is {:#04x}, ggml wrote {:#04x}",
                    t.name(),
                    got[i],
                    want[i]
                );
            }
        }
    }
}

#[test]
fn activation_quantizers_match_ggml() {
    let (_, rows) = golden();
    let mut variants_differ = false;
    for (r, row) in rows.iter().enumerate() {
        let a = f32s(row["a"].as_str().unwrap());
        // One weight type per activation format.
        for (act, w) in [
            ("Q8_0", GgmlType::Q4_0),
            ("Q8_1", GgmlType::Q4_1),
            ("Q8_K", GgmlType::Q4K),
        ] {
            let mut got = Vec::new();
            quantize_activations_as(w, &a, &mut got, Q8Variant::Reference).unwrap();
            let want = unhex(row["act"][act].as_str().unwrap());
            assert!(got == want, "{act} (reference) row {r} differs from ggml");
            if act != "Q8_K" {
                let reference = got.clone();
                quantize_activations_as(w, &a, &mut got, Q8Variant::X86Avx).unwrap();
                let want = unhex(row["act_x86avx"][act].as_str().unwrap());
                assert!(
                    got == want,
                    "{act} (x86 AVX) row {r} differs from ggml-cpu's AVX quantizer"
                );
                variants_differ |= got != reference;
            } else {
                // ggml-cpu has one Q8_K quantizer: the variant must not matter.
                let mut avx = Vec::new();
                quantize_activations_as(w, &a, &mut avx, Q8Variant::X86Avx).unwrap();
                assert_eq!(avx, got);
            }
        }
    }
    assert!(
        variants_differ,
        "the vectors should include a row where ties make the AVX quantizer differ"
    );
}

#[test]
fn dot_products_match_ggml_generic_bit_exactly() {
    let (n, rows) = golden();
    for (r, row) in rows.iter().enumerate() {
        for t in WEIGHT_TYPES {
            let w = unhex(row["weights"][t.name()].as_str().unwrap());
            let act = match t {
                GgmlType::Q4_1 | GgmlType::Q5_1 => "Q8_1",
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => "Q8_0",
                _ => "Q8_K",
            };
            let a = unhex(row["act"][act].as_str().unwrap());
            let want = f32s(row["dots"][t.name()].as_str().unwrap())[0];
            let got = vec_dot(t, n, &w, &a);
            assert!(
                got.to_bits() == want.to_bits(),
                "{} row {r}: dot {got:e}, ggml {want:e}",
                t.name()
            );
        }
    }
}
