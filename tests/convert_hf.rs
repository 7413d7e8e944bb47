//! `infer quantize`, end to end through the real binary: Hugging Face checkpoints (the tiny
//! transformers-written fixtures in tests/fixtures/convert/hf-tiny) to GGUF, checked against the
//! safetensors values, against gguf-py (scripts/check-gguf-py.py: llama.cpp's own names and
//! quantizers), against transformers' greedy ids through this crate's engine, and re-quantization
//! of the real Gemma 3 model.
//!
//! Needs python3 with gguf-py for the gguf-py checks (`scripts/test.sh` installs it); those tests
//! fail with that instruction when it is missing.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::{infer, model, root, stderr, GEMMA};
use infer::convert::policy::{allows_quantization, choose_types, ModelShape, TensorDesc};
use infer::convert::Target;
use infer::format::{GgmlType, Gguf, Value};
use serde_json::Value as Json;

/// Fixtures this converter supports.
const FIXTURES: [&str; 9] = [
    "llama-gqa",
    "llama3-ropescaled",
    "mistral-swa",
    "qwen2",
    "qwen3",
    "gemma3",
    "mixtral-moe",
    "qwen3-moe",
    "phi3",
];

fn fixture(name: &str) -> PathBuf {
    root().join("tests/fixtures/convert/hf-tiny").join(name)
}

/// A fresh, empty directory for one test.
fn scratch(test: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("convert-{test}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn json(path: &Path) -> Json {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// Runs `infer quantize` and asserts success.
fn quantize(args: &[&str]) -> String {
    let mut all = vec!["quantize"];
    all.extend_from_slice(args);
    let o = infer(&all, None);
    assert!(o.status.success(), "infer {all:?} failed: {}", stderr(&o));
    stderr(&o)
}

/// Runs `infer quantize` and returns its error message, asserting failure.
fn quantize_err(args: &[&str]) -> String {
    let mut all = vec!["quantize"];
    all.extend_from_slice(args);
    let o = infer(&all, None);
    assert!(!o.status.success(), "infer {all:?} unexpectedly succeeded");
    stderr(&o)
}

fn convert(name: &str, dir: &Path, ty: &str) -> PathBuf {
    let out = dir.join(format!("{name}.{ty}.gguf"));
    quantize(&[
        "--from-hf",
        fixture(name).to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--type",
        ty,
    ]);
    out
}

/// The checkpoint's tensors as f32 with their shapes (read with the safetensors crate directly).
fn checkpoint(name: &str) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(fixture(name).join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32);
            let vals = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (n, (v.shape().to_vec(), vals))
        })
        .collect()
}

fn f32_tensor(g: &Gguf, name: &str) -> (Vec<u64>, Vec<f32>) {
    let t = g
        .tensor(name)
        .unwrap_or_else(|| panic!("tensor {name} missing"));
    assert_eq!(t.ty, GgmlType::F32, "{name}");
    let vals = g
        .tensor_data(t)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (t.dims.clone(), vals)
}

fn u64_key(g: &Gguf, key: &str) -> u64 {
    g.get_u64(key)
        .unwrap_or_else(|| panic!("metadata {key} missing or not an integer"))
}

/// Checks `python3 -c "import gguf"` and returns the check script's path.
fn gguf_py() -> PathBuf {
    let ok = Command::new("python3")
        .args(["-c", "import gguf, numpy"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        ok,
        "these checks need python3 with gguf-py: run the tests with `scripts/test.sh`, which installs \
         it (or `pip install -r scripts/test-requirements.txt`)"
    );
    root().join("scripts/check-gguf-py.py")
}

fn run_check(mode: &str, a: &Path, b: &Path) -> String {
    let o = Command::new("python3")
        .arg(gguf_py())
        .args([mode, a.to_str().unwrap(), b.to_str().unwrap()])
        .output()
        .expect("run python3");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "check-gguf-py {mode} {} {} failed:\n{out}{}",
        a.display(),
        b.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn every_fixture_converts_to_f32_with_the_right_metadata_and_values() {
    let dir = scratch("f32");
    // (fixture, general.architecture, tokenizer model, tensor count)
    let expect: [(&str, &str, &str, usize); 9] = [
        ("llama-gqa", "llama", "llama", 21),
        ("llama3-ropescaled", "llama", "gpt2", 21), // tied output, + rope_freqs
        ("mistral-swa", "llama", "llama", 21),
        ("qwen2", "qwen2", "gpt2", 26), // tied output, q/k/v biases
        ("qwen3", "qwen3", "gpt2", 24),
        ("gemma3", "gemma3", "llama", 28),
        ("mixtral-moe", "llama", "llama", 23),
        ("qwen3-moe", "qwen3moe", "gpt2", 27),
        ("phi3", "phi3", "llama", 15),
    ];
    for (name, arch, tok_model, n_tensors) in expect {
        let out = convert(name, &dir, "f32");
        let g = Gguf::open(&out).unwrap();
        let cfg = json(&fixture(name).join("config.json"));
        let c = |k: &str| cfg[k].as_u64().unwrap();
        assert_eq!(g.architecture(), Some(arch), "{name}");
        assert_eq!(g.tensors.len(), n_tensors, "{name}");
        assert_eq!(
            u64_key(&g, &format!("{arch}.block_count")),
            c("num_hidden_layers")
        );
        assert_eq!(
            u64_key(&g, &format!("{arch}.embedding_length")),
            c("hidden_size")
        );
        assert_eq!(
            u64_key(&g, &format!("{arch}.feed_forward_length")),
            c("intermediate_size")
        );
        assert_eq!(
            u64_key(&g, &format!("{arch}.attention.head_count")),
            c("num_attention_heads")
        );
        assert_eq!(
            u64_key(&g, &format!("{arch}.attention.head_count_kv")),
            c("num_key_value_heads")
        );
        assert_eq!(
            u64_key(&g, &format!("{arch}.context_length")),
            c("max_position_embeddings")
        );
        assert_eq!(
            g.get_f32(&format!("{arch}.attention.layer_norm_rms_epsilon")),
            Some(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
            "{name}"
        );
        let theta = cfg["rope_parameters"]
            .get("full_attention")
            .unwrap_or(&cfg["rope_parameters"])["rope_theta"]
            .as_f64()
            .unwrap();
        assert_eq!(
            g.get_f32(&format!("{arch}.rope.freq_base")),
            Some(theta as f32)
        );
        assert_eq!(u64_key(&g, "general.file_type"), 0);
        assert_eq!(u64_key(&g, "general.quantization_version"), 2);

        // Tokenizer: tokens by id as tokenizer.json numbers them; specials; template.
        let tj = json(&fixture(name).join("tokenizer.json"));
        let tc = json(&fixture(name).join("tokenizer_config.json"));
        assert_eq!(g.get_str("tokenizer.ggml.model"), Some(tok_model), "{name}");
        let tokens = g.get("tokenizer.ggml.tokens").unwrap().as_array().unwrap();
        assert_eq!(tokens.len() as u64, c("vocab_size"), "{name}");
        for (t, id) in tj["model"]["vocab"].as_object().unwrap() {
            assert_eq!(
                tokens[id.as_u64().unwrap() as usize].as_str(),
                Some(t.as_str())
            );
        }
        let types = g
            .get("tokenizer.ggml.token_type")
            .unwrap()
            .as_array()
            .unwrap();
        assert_eq!(types.len(), tokens.len());
        assert_eq!(
            u64_key(&g, "tokenizer.ggml.eos_token_id"),
            c("eos_token_id"),
            "{name}"
        );
        assert_eq!(
            types[c("eos_token_id") as usize],
            Value::I32(3),
            "{name}: EOS is CONTROL"
        );
        assert_eq!(
            g.get_str("tokenizer.chat_template"),
            tc["chat_template"].as_str(),
            "{name}"
        );
        assert_eq!(
            g.get_bool("tokenizer.ggml.add_bos_token"),
            tc["add_bos_token"].as_bool(),
            "{name}"
        );
        if tok_model == "gpt2" {
            assert_eq!(g.get_str("tokenizer.ggml.pre"), Some("qwen2"), "{name}");
            let merges = g.get("tokenizer.ggml.merges").unwrap().as_array().unwrap();
            let want = tj["model"]["merges"].as_array().unwrap();
            assert_eq!(merges.len(), want.len());
            assert_eq!(
                merges[0].as_str().unwrap(),
                format!(
                    "{} {}",
                    want[0][0].as_str().unwrap(),
                    want[0][1].as_str().unwrap()
                )
            );
        } else {
            // byte tokens are BYTE, <unk> is UNKNOWN; scores favour earlier merges
            assert_eq!(types[0], Value::I32(2), "{name}");
            assert_eq!(types[3], Value::I32(6), "{name}: <0x00>");
            let scores = g.get("tokenizer.ggml.scores").unwrap().as_array().unwrap();
            let first = tj["model"]["merges"][0].as_array().unwrap();
            let second = tj["model"]["merges"][1].as_array().unwrap();
            let id_of = |m: &Vec<Json>| {
                let t = format!("{}{}", m[0].as_str().unwrap(), m[1].as_str().unwrap());
                tj["model"]["vocab"][&t].as_u64().unwrap() as usize
            };
            assert!(
                scores[id_of(first)].as_f32() > scores[id_of(second)].as_f32(),
                "{name}: the first merge must score highest"
            );
        }

        // Tensor values: exactly the checkpoint's, mapped as llama.cpp expects.
        let ck = checkpoint(name);
        let hf = |n: &str| &ck[n];
        let (dims, vals) = f32_tensor(&g, "token_embd.weight");
        assert_eq!(dims, vec![c("hidden_size"), c("vocab_size")]);
        assert_eq!(vals, hf("model.embed_tokens.weight").1, "{name} token_embd");
        let (_, norm) = f32_tensor(&g, "output_norm.weight");
        let hf_norm = &hf("model.norm.weight").1;
        if arch == "gemma3" {
            // Gemma's RMSNorm multiplies by (1 + w): the converter stores w + 1.
            let shifted: Vec<f32> = hf_norm.iter().map(|w| w + 1.0).collect();
            assert_eq!(norm, shifted);
            let (_, qn) = f32_tensor(&g, "blk.1.attn_q_norm.weight");
            let hq: Vec<f32> = hf("model.layers.1.self_attn.q_norm.weight")
                .1
                .iter()
                .map(|w| w + 1.0)
                .collect();
            assert_eq!(qn, hq);
        } else {
            assert_eq!(&norm, hf_norm, "{name} output_norm");
        }
        let tied = g.tensor("output.weight").is_none();
        assert_eq!(
            tied,
            !ck.contains_key("lm_head.weight") || arch == "gemma3",
            "{name}"
        );
        match name {
            "llama-gqa" | "mistral-swa" | "mixtral-moe" | "llama3-ropescaled" => {
                // Q and K rows: per head, the rotate-half layout [x0..x(d/2-1) | y0..] becomes
                // interleaved pairs x0 y0 x1 y1 ...
                let hd = (c("hidden_size") / c("num_attention_heads")) as usize;
                for (proj, gg, heads) in [
                    ("q_proj", "attn_q", c("num_attention_heads")),
                    ("k_proj", "attn_k", c("num_key_value_heads")),
                ] {
                    let (shape, src) = hf(&format!("model.layers.1.self_attn.{proj}.weight"));
                    let (_, got) = f32_tensor(&g, &format!("blk.1.{gg}.weight"));
                    let cols = shape[1];
                    for h in 0..heads as usize {
                        for i in 0..hd / 2 {
                            for (k, src_row) in [(0, h * hd + i), (1, h * hd + hd / 2 + i)] {
                                let out_row = h * hd + 2 * i + k;
                                assert_eq!(
                                    got[out_row * cols..(out_row + 1) * cols],
                                    src[src_row * cols..(src_row + 1) * cols],
                                    "{name} {gg} row {out_row}"
                                );
                            }
                        }
                    }
                    let (_, v) = f32_tensor(&g, "blk.1.attn_v.weight");
                    assert_eq!(v, hf("model.layers.1.self_attn.v_proj.weight").1);
                }
            }
            _ if arch != "phi3" => {
                // qwen2/qwen3/gemma3 use NeoX RoPE on the Hugging Face layout: no permutation.
                let (_, q) = f32_tensor(&g, "blk.1.attn_q.weight");
                assert_eq!(
                    q,
                    hf("model.layers.1.self_attn.q_proj.weight").1,
                    "{name} attn_q"
                );
            }
            _ => {}
        }
        match name {
            "mixtral-moe" => {
                let (dims, exps) = f32_tensor(&g, "blk.1.ffn_down_exps.weight");
                assert_eq!(dims, vec![160, 64, 4]);
                let per = 160 * 64;
                for e in 0..4 {
                    let src = &hf(&format!(
                        "model.layers.1.block_sparse_moe.experts.{e}.w2.weight"
                    ))
                    .1;
                    assert_eq!(&exps[e * per..(e + 1) * per], &src[..], "expert {e}");
                }
                let (_, gate) = f32_tensor(&g, "blk.0.ffn_gate_inp.weight");
                assert_eq!(gate, hf("model.layers.0.block_sparse_moe.gate.weight").1);
            }
            "qwen3-moe" => {
                let (dims, exps) = f32_tensor(&g, "blk.0.ffn_up_exps.weight");
                assert_eq!(dims, vec![64, 48, 8]);
                let src = &hf("model.layers.0.mlp.experts.5.up_proj.weight").1;
                assert_eq!(&exps[5 * 48 * 64..6 * 48 * 64], &src[..]);
            }
            "qwen2" => {
                let (_, b) = f32_tensor(&g, "blk.0.attn_k.bias");
                assert_eq!(b, hf("model.layers.0.self_attn.k_proj.bias").1);
            }
            "phi3" => {
                let (dims, qkv) = f32_tensor(&g, "blk.1.attn_qkv.weight");
                assert_eq!(dims, vec![64, 128]);
                assert_eq!(qkv, hf("model.layers.1.self_attn.qkv_proj.weight").1);
                let (_, up) = f32_tensor(&g, "blk.0.ffn_up.weight");
                assert_eq!(up, hf("model.layers.0.mlp.gate_up_proj.weight").1);
                assert_eq!(
                    u64_key(&g, "phi3.rope.scaling.original_context_length"),
                    4096
                );
            }
            "mistral-swa" => {
                assert_eq!(u64_key(&g, "llama.attention.sliding_window"), 8);
            }
            "gemma3" => {
                assert_eq!(u64_key(&g, "gemma3.attention.sliding_window"), 8);
                assert_eq!(g.get_f32("gemma3.rope.freq_base_swa"), Some(10_000.0));
                let (_, n) = f32_tensor(&g, "blk.0.post_ffw_norm.weight");
                let want: Vec<f32> = hf("model.layers.0.post_feedforward_layernorm.weight")
                    .1
                    .iter()
                    .map(|w| w + 1.0)
                    .collect();
                assert_eq!(n, want);
            }
            "llama3-ropescaled" => {
                // factor 8, low 1, high 4, original context 32, theta 5e5, head_dim 16:
                // wavelength 2π·θ^(2i/16) against 32 (low) and 8 (high).
                let (dims, f) = f32_tensor(&g, "rope_freqs.weight");
                assert_eq!(dims, vec![8]);
                let want: Vec<f32> = (0..8)
                    .map(|i| {
                        let wl =
                            2.0 * std::f64::consts::PI * 500_000f64.powf(2.0 * i as f64 / 16.0);
                        if wl < 8.0 {
                            1.0
                        } else if wl > 32.0 {
                            8.0
                        } else {
                            let s = (32.0 / wl - 1.0) / 3.0;
                            (1.0 / ((1.0 - s) / 8.0 + s)) as f32
                        }
                    })
                    .collect();
                for (a, b) in f.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-5 * b.abs(),
                        "rope_freqs {f:?} vs {want:?}"
                    );
                }
            }
            _ => {}
        }
    }
}

#[test]
fn gguf_py_reads_every_converted_fixture_with_llama_cpp_names_and_values() {
    gguf_py();
    let dir = scratch("gguf-py");
    for name in FIXTURES {
        let out = convert(name, &dir, "f32");
        let msg = run_check("hf", &out, &fixture(name));
        assert!(msg.starts_with("ok:"), "{name}: {msg}");
    }
}

#[test]
fn simple_types_are_byte_identical_to_gguf_py_quantizers() {
    gguf_py();
    let dir = scratch("simple-types");
    for name in ["llama-gqa", "qwen2", "gemma3"] {
        let f32_out = convert(name, &dir, "f32");
        for ty in [
            "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k_m",
        ] {
            let out = convert(name, &dir, ty);
            let msg = run_check("quant", &out, &f32_out);
            assert!(msg.starts_with("ok:"), "{name} {ty}: {msg}");
            let g = Gguf::open(&out).unwrap();
            let want_ft = Target::parse(ty).unwrap().file_type() as u64;
            assert_eq!(u64_key(&g, "general.file_type"), want_ft);
            // Norms, biases and other vectors stay F32 whatever the target.
            for t in &g.tensors {
                if t.dims.len() == 1 {
                    assert_eq!(t.ty, GgmlType::F32, "{name} {ty} {}", t.name);
                }
            }
        }
    }
}

#[test]
fn rows_that_do_not_fit_the_block_fall_back_like_llama_cpp() {
    // The fixtures' rows are 64 or 160 wide: no k-quant block (256) fits.
    let dir = scratch("fallback");
    let out = convert("llama-gqa", &dir, "q4_k");
    let g = Gguf::open(&out).unwrap();
    for t in &g.tensors {
        let want = if t.dims.len() == 1 {
            GgmlType::F32
        } else {
            GgmlType::Q5_0 // llama.cpp: Q4_K → Q5_0
        };
        assert_eq!(t.ty, want, "{}", t.name);
    }
    let out = convert("llama-gqa", &dir, "q4_k_m");
    let g = Gguf::open(&out).unwrap();
    let ty = |n: &str| g.tensor(n).unwrap().ty;
    assert_eq!(
        ty("output.weight"),
        GgmlType::Q8_0,
        "Q6_K does not fit 64 → Q8_0"
    );
    assert_eq!(ty("token_embd.weight"), GgmlType::Q5_0);
    // 2 layers: use_more_bits(i, 2) picks layer 1 only (i >= 7*2/8); its Q6_K → Q8_0, while
    // layer 0 keeps Q4_K → Q5_0.
    assert_eq!(ty("blk.0.attn_v.weight"), GgmlType::Q5_0);
    assert_eq!(ty("blk.1.attn_v.weight"), GgmlType::Q8_0);
    assert_eq!(ty("blk.0.ffn_down.weight"), GgmlType::Q5_0);
    assert_eq!(ty("blk.1.ffn_down.weight"), GgmlType::Q8_0);
    assert_eq!(ty("blk.1.attn_q.weight"), GgmlType::Q5_0);
}

/// The facts the policy needs and what a converted f16 file would hold before quantization.
fn policy_inputs(g: &Gguf) -> (ModelShape, Vec<TensorDesc<'_>>) {
    let arch = g.architecture().unwrap().to_owned();
    let shape = ModelShape {
        n_layer: u64_key(g, &format!("{arch}.block_count")) as usize,
        n_expert: 0,
        n_head: u64_key(g, &format!("{arch}.attention.head_count")) as usize,
        n_head_kv: u64_key(g, &format!("{arch}.attention.head_count_kv")) as usize,
        arch,
    };
    let descs = g
        .tensors
        .iter()
        .map(|t| TensorDesc {
            name: &t.name,
            dims: &t.dims,
            ty: if allows_quantization(&t.name, t.dims.len()) {
                GgmlType::F16
            } else {
                GgmlType::F32
            },
        })
        .collect();
    (shape, descs)
}

#[test]
fn q4_k_m_policy_reproduces_the_real_models_tensor_types() {
    let q4_k_m = Target::parse("q4_k_m").unwrap();
    // Gemma 3 270M was quantized by a current llama.cpp: every tensor's type must match.
    let g = Gguf::open(&model(GEMMA)).unwrap();
    let (shape, descs) = policy_inputs(&g);
    let types = choose_types(q4_k_m, &shape, &descs).unwrap();
    for (t, ty) in g.tensors.iter().zip(types) {
        assert_eq!(ty, t.ty, "gemma: {}", t.name);
    }
    // The Qwen2.5 file comes from an older llama.cpp that walked the tensors in string order
    // (blk.0, blk.1, blk.10, ...) when counting attn_v / ffn_down layers; the current one counts
    // in layer order. Everything else must match, and the same number of layers get Q6_K.
    let g = Gguf::open(&model(common::QWEN)).unwrap();
    let (shape, descs) = policy_inputs(&g);
    let types = choose_types(q4_k_m, &shape, &descs).unwrap();
    let mut q6 = [0usize; 2];
    for (t, ty) in g.tensors.iter().zip(types) {
        let counted = ["attn_v.weight", "ffn_down.weight"]
            .iter()
            .position(|k| t.name.ends_with(k));
        match counted {
            Some(i) => {
                assert!(
                    matches!(ty, GgmlType::Q4K | GgmlType::Q6K),
                    "qwen: {}",
                    t.name
                );
                q6[i] += usize::from(ty == GgmlType::Q6K);
            }
            None => assert_eq!(ty, t.ty, "qwen: {}", t.name),
        }
    }
    let in_file = |k: &str| {
        g.tensors
            .iter()
            .filter(|t| t.name.ends_with(k) && t.ty == GgmlType::Q6K)
            .count()
    };
    assert_eq!(q6, [in_file("attn_v.weight"), in_file("ffn_down.weight")]);
    assert_eq!(q6, [14, 14]);
}

#[test]
fn gemma_requantized_to_q4_k_m_keeps_every_tensor_byte_for_byte() {
    // Same policy, same types: every tensor is copied, so the data is identical.
    let dir = scratch("gemma-q4km");
    let out = dir.join("gemma.gguf");
    let input = model(GEMMA);
    quantize(&[
        "--in",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--type",
        "q4_k_m",
    ]);
    let (a, b) = (Gguf::open(&input).unwrap(), Gguf::open(&out).unwrap());
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!((&x.name, &x.dims, x.ty), (&y.name, &y.dims, y.ty));
        assert!(a.tensor_data(x) == b.tensor_data(y), "{}", x.name);
    }
}

#[test]
fn gemma_requantized_to_q8_0_reopens_runs_and_matches_gguf_py() {
    let dir = scratch("gemma-q8");
    let out = dir.join("gemma-q8_0.gguf");
    let input = model(GEMMA);
    let t0 = Instant::now();
    let log = quantize(&[
        "--in",
        input.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    eprintln!(
        "gemma q4_k_m → q8_0: {:.2} s ({})",
        t0.elapsed().as_secs_f64(),
        log.trim()
    );
    let (a, b) = (Gguf::open(&input).unwrap(), Gguf::open(&out).unwrap());
    assert_eq!(u64_key(&b, "general.file_type"), 7);
    assert_eq!(a.tensors.len(), b.tensors.len());
    for (x, y) in a.tensors.iter().zip(&b.tensors) {
        assert_eq!((&x.name, &x.dims), (&y.name, &y.dims));
        let want = if allows_quantization(&x.name, x.dims.len()) {
            GgmlType::Q8_0
        } else {
            x.ty
        };
        assert_eq!(y.ty, want, "{}", x.name);
    }
    for (k, v) in a.metadata() {
        if k != "general.file_type" {
            assert_eq!(b.get(k), Some(v), "metadata {k}");
        }
    }
    // The engine loads it and generates.
    let o = infer(
        &[
            "run",
            "-m",
            out.to_str().unwrap(),
            "-p",
            "The capital of France is",
            "-n",
            "4",
            "--temp",
            "0",
        ],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!o.stdout.is_empty());
    // Every re-quantized tensor is gguf-py's quantize(dequantize(input)), byte for byte.
    let msg = run_check("requant", &out, &input);
    assert!(msg.starts_with("ok:"), "{msg}");
}

#[test]
fn engine_reproduces_transformers_greedy_ids_on_converted_models() {
    let dir = scratch("greedy");
    for name in ["llama-gqa", "qwen2", "mistral-swa", "gemma3"] {
        let out = convert(name, &dir, "f32");
        let r = json(&fixture(name).join("reference.json"));
        let ids = |k: &str| -> Vec<u64> {
            r[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect()
        };
        let prompt: Vec<String> = ids("prompt_ids").iter().map(u64::to_string).collect();
        let want = ids("greedy_ids");
        let o = infer(
            &[
                "run",
                "-m",
                out.to_str().unwrap(),
                "--prompt-ids",
                &prompt.join(","),
                "-n",
                &want.len().to_string(),
                "--temp",
                "0",
                "--json",
            ],
            None,
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let got: Vec<u64> = String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<Json>(l).ok())
            .filter_map(|j| j.get("id").and_then(Json::as_u64))
            .collect();
        assert_eq!(got, want, "{name}: greedy ids differ from transformers'");
    }
}

#[test]
fn sharded_checkpoint_converts_to_the_same_file() {
    let dir = scratch("sharded");
    let src = fixture("llama-gqa");
    let shard_dir = dir.join("llama-gqa");
    std::fs::create_dir_all(&shard_dir).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), shard_dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut index = serde_json::Map::new();
    for (i, part) in [first, second].into_iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> = part
            .iter()
            .map(|n| (n.clone(), st.tensor(n).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &shard_dir.join(&file)).unwrap();
        for n in part {
            index.insert(n.clone(), Json::String(file.clone()));
        }
    }
    std::fs::write(
        shard_dir.join("model.safetensors.index.json"),
        serde_json::json!({ "metadata": {}, "weight_map": index }).to_string(),
    )
    .unwrap();
    let single = convert("llama-gqa", &dir, "q8_0");
    let sharded = dir.join("sharded.gguf");
    quantize(&[
        "--from-hf",
        shard_dir.to_str().unwrap(),
        "--out",
        sharded.to_str().unwrap(),
        "--type",
        "q8_0",
    ]);
    assert!(std::fs::read(&single).unwrap() == std::fs::read(&sharded).unwrap());
}

/// A copy of a fixture whose model.safetensors is rewritten by `edit`.
fn edited_fixture(
    dir: &Path,
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture(name).join(f), d.join(f)).unwrap();
    }
    let bytes = std::fs::read(fixture(name).join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, dt, s, data)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*dt, s.clone(), data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &d.join("model.safetensors")).unwrap();
    d
}

#[test]
fn bad_inputs_give_clear_errors_and_leave_no_output() {
    let dir = scratch("errors");
    let out = dir.join("out.gguf");
    let o = out.to_str().unwrap();
    let run = |src: &Path, ty: &str| {
        quantize_err(&["--from-hf", src.to_str().unwrap(), "--out", o, "--type", ty])
    };

    let unknown = dir.join("unknown-arch");
    std::fs::create_dir_all(&unknown).unwrap();
    std::fs::write(
        unknown.join("config.json"),
        r#"{"architectures": ["FalconForCausalLM"], "hidden_size": 64}"#,
    )
    .unwrap();
    let e = run(&unknown, "f16");
    assert!(
        e.contains("FalconForCausalLM")
            && e.contains("LlamaForCausalLM")
            && e.contains("Gemma3ForCausalLM"),
        "{e}"
    );
    let e = run(&fixture("llama-gqa"), "iq2_xxs");
    assert!(e.contains("iq2_xxs") && e.contains("q4_k_m"), "{e}");

    let missing = edited_fixture(&dir.join("missing"), "llama-gqa", |t| {
        t.retain(|(n, ..)| n != "model.layers.1.mlp.down_proj.weight")
    });
    let e = run(&missing, "f16");
    assert!(
        e.contains("missing") && e.contains("blk.1.ffn_down.weight"),
        "{e}"
    );

    let wrong = edited_fixture(&dir.join("shape"), "llama-gqa", |t| {
        let x = t
            .iter_mut()
            .find(|(n, ..)| n == "model.layers.0.mlp.up_proj.weight")
            .unwrap();
        x.2 = vec![64, 160]; // transposed
    });
    let e = run(&wrong, "f16");
    assert!(
        e.contains("model.layers.0.mlp.up_proj.weight")
            && e.contains("[64, 160]")
            && e.contains("[160, 64]"),
        "{e}"
    );

    let dtype = edited_fixture(&dir.join("dtype"), "llama-gqa", |t| {
        let x = t
            .iter_mut()
            .find(|(n, ..)| n == "model.norm.weight")
            .unwrap();
        x.1 = safetensors::Dtype::I32;
    });
    let e = run(&dtype, "f16");
    assert!(e.contains("model.norm.weight") && e.contains("I32"), "{e}");

    let e = quantize_err(&[
        "--in",
        dir.join("nope.gguf").to_str().unwrap(),
        "--out",
        o,
        "--type",
        "q8_0",
    ]);
    assert!(e.contains("nope.gguf"), "{e}");

    // Nothing was written: no output, no temporary file.
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// A llama checkpoint whose rows are 256 and 512 wide, so that the k-quants fit: the tiny
/// llama-gqa fixture's config and tokenizer with `hidden_size` 256, `intermediate_size` 512 and
/// one layer, and weights N(0, 0.05)-like from a fixed xorshift, written with the safetensors crate.
fn wide_checkpoint(dir: &Path) -> PathBuf {
    let ck = dir.join("llama-wide");
    std::fs::create_dir_all(&ck).unwrap();
    let src = fixture("llama-gqa");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), ck.join(f)).unwrap();
    }
    let mut cfg = json(&src.join("config.json"));
    cfg["hidden_size"] = 256.into();
    cfg["intermediate_size"] = 512.into();
    cfg["head_dim"] = 64.into();
    cfg["num_hidden_layers"] = 1.into();
    std::fs::write(ck.join("config.json"), cfg.to_string()).unwrap();
    let (h, i, v, q, kv) = (256usize, 512usize, 512usize, 4 * 64usize, 2 * 64usize);
    let shapes: Vec<(String, Vec<usize>)> = [
        ("model.embed_tokens.weight", vec![v, h]),
        ("lm_head.weight", vec![v, h]),
        ("model.norm.weight", vec![h]),
        ("model.layers.0.input_layernorm.weight", vec![h]),
        ("model.layers.0.post_attention_layernorm.weight", vec![h]),
        ("model.layers.0.self_attn.q_proj.weight", vec![q, h]),
        ("model.layers.0.self_attn.k_proj.weight", vec![kv, h]),
        ("model.layers.0.self_attn.v_proj.weight", vec![kv, h]),
        ("model.layers.0.self_attn.o_proj.weight", vec![h, q]),
        ("model.layers.0.mlp.gate_proj.weight", vec![i, h]),
        ("model.layers.0.mlp.up_proj.weight", vec![i, h]),
        ("model.layers.0.mlp.down_proj.weight", vec![h, i]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s))
    .collect();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|(name, s)| {
            let n: usize = s.iter().product();
            (0..n)
                .flat_map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    let x = if name.ends_with("norm.weight") {
                        1.0 + 0.2 * u
                    } else {
                        0.1 * u
                    };
                    x.to_le_bytes()
                })
                .collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = shapes
        .iter()
        .zip(&data)
        .map(|((n, s), d)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d);
            (n.clone(), view.unwrap())
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(ck.join("model.safetensors"), bytes).unwrap();
    ck
}

/// With rows that fit a 256-value block, `q4_k_m` writes Q4_K and Q6_K tensors (not the
/// fallbacks of the narrow fixtures), and gguf-py (`gguf==0.19.0`, pinned in
/// scripts/test-requirements.txt) reads every one of them and dequantizes it to within the
/// k-quant's error bound of the f32 conversion; the other tensors byte-identical to its quantizers.
#[test]
fn k_quants_of_256_wide_rows_are_read_back_by_gguf_py() {
    gguf_py();
    let dir = scratch("wide");
    let ck = wide_checkpoint(&dir);
    let f32_out = dir.join("wide.f32.gguf");
    let out = dir.join("wide.q4_k_m.gguf");
    for (ty, o) in [("f32", &f32_out), ("q4_k_m", &out)] {
        let (ck, o) = (ck.to_str().unwrap(), o.to_str().unwrap());
        quantize(&["--from-hf", ck, "--out", o, "--type", ty]);
    }
    let g = Gguf::open(&out).unwrap();
    let ty = |n: &str| g.tensor(n).unwrap().ty;
    assert_eq!(ty("blk.0.attn_q.weight"), GgmlType::Q4K);
    assert_eq!(ty("blk.0.ffn_gate.weight"), GgmlType::Q4K);
    assert_eq!(ty("blk.0.ffn_down.weight"), GgmlType::Q6K);
    assert_eq!(ty("output.weight"), GgmlType::Q6K);
    let msg = run_check("quant", &out, &f32_out);
    assert!(msg.starts_with("ok:"), "{msg}");
    assert!(!msg.contains(" 0 k-quant tensors"), "{msg}");
}
