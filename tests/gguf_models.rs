//! The GGUF reader against the two real model files in `models/` (fetched by
//! `scripts/fetch-models.sh`). Expected values — counts, dims, types, offsets and the first bytes of
//! tensor data — were read from the same files with gguf-py's `GGUFReader`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use infer::format::{GgmlType, Gguf, Value};

const QWEN: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
const GEMMA: &str = "gemma-3-270m-q4_k_m.gguf";

fn model_path(file: &str) -> PathBuf {
    let dir = std::env::var_os("INFER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("models"));
    let path = dir.join(file);
    assert!(
        path.is_file(),
        "model file {} is missing: run scripts/fetch-models.sh",
        path.display()
    );
    path
}

fn open(file: &str) -> Gguf {
    let path = model_path(file);
    let start = Instant::now();
    let g = Gguf::open(&path).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("Gguf::open({file}) took {:?}", start.elapsed());
    g
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[track_caller]
fn check_tensor(
    g: &Gguf,
    name: &str,
    dims: &[u64],
    ty: GgmlType,
    offset: u64,
    size: usize,
    head: &str,
) {
    let t = g
        .tensor(name)
        .unwrap_or_else(|| panic!("tensor {name} missing"));
    assert_eq!(t.name, name);
    assert_eq!(t.dims, dims, "{name} dims");
    assert_eq!(t.ty, ty, "{name} type");
    assert_eq!(t.offset, offset, "{name} offset");
    assert_eq!(t.size_bytes, size, "{name} size");
    assert_eq!(t.row_len() as u64, dims[0]);
    assert_eq!(t.n_rows() as u64, dims[1..].iter().product::<u64>());
    assert_eq!(t.n_elements(), dims.iter().product::<u64>());
    let data = g.tensor_data(t);
    assert_eq!(data.len(), size);
    assert_eq!(hex(&data[..16]), head, "{name} first 16 bytes");
}

#[test]
fn qwen_file_matches_gguf_py() {
    let g = open(QWEN);
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 32);
    assert_eq!(g.tensors.len(), 339);
    assert_eq!(g.metadata().len(), 26);
    assert_eq!(g.file_size(), 1_117_320_768);
    assert_eq!(g.data_offset(), 5_950_528);
    assert_eq!(g.architecture(), Some("qwen2"));
    assert_eq!(g.metadata()[0].0, "general.architecture");
    assert_eq!(g.metadata()[25].0, "general.quantization_version");

    assert_eq!(g.get("qwen2.block_count"), Some(&Value::U32(28)));
    assert_eq!(g.get_u64("qwen2.block_count"), Some(28));
    assert_eq!(g.get_u64("qwen2.embedding_length"), Some(1536));
    assert_eq!(g.get_u64("qwen2.attention.head_count_kv"), Some(2));
    assert_eq!(g.get_u64("general.file_type"), Some(15));
    assert_eq!(g.get_f32("qwen2.rope.freq_base"), Some(1_000_000.0));
    assert_eq!(
        g.get_f32("qwen2.attention.layer_norm_rms_epsilon"),
        Some(1e-6)
    );
    assert_eq!(g.get_str("tokenizer.ggml.model"), Some("gpt2"));
    assert_eq!(g.get_str("tokenizer.ggml.pre"), Some("qwen2"));
    assert_eq!(g.get_bool("tokenizer.ggml.add_bos_token"), Some(false));
    assert_eq!(g.get_u64("tokenizer.ggml.eos_token_id"), Some(151645));
    assert_eq!(
        g.get_str("tokenizer.chat_template").map(str::len),
        Some(2509)
    );
    assert_eq!(g.get("no.such.key"), None);
    assert_eq!(g.get_str("qwen2.block_count"), None);

    let tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!(tokens.len(), 151936);
    let first: Vec<&str> = tokens[..5].iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(first, ["!", "\"", "#", "$", "%"]);
    assert_eq!(tokens[151935].as_str(), Some("[PAD151935]"));
    let types = g
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!(types.len(), 151936);
    assert_eq!(types[0], Value::I32(1));
    let merges = g
        .get("tokenizer.ggml.merges")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!(merges.len(), 151387);
    assert_eq!(merges[0].as_str(), Some("Ġ Ġ"));
    assert_eq!(merges[2].as_str(), Some("i n"));

    let count = |ty| g.tensors.iter().filter(|t| t.ty == ty).count();
    assert_eq!(
        (
            count(GgmlType::Q4K),
            count(GgmlType::F32),
            count(GgmlType::Q6K)
        ),
        (169, 141, 29)
    );

    check_tensor(
        &g,
        "output.weight",
        &[1536, 151936],
        GgmlType::Q6K,
        0,
        191_439_360,
        "de98b490c1082a37cfd20117c718e47a",
    );
    check_tensor(
        &g,
        "token_embd.weight",
        &[1536, 151936],
        GgmlType::Q4K,
        191_439_360,
        131_272_704,
        "9406c811e3a8e4bfa9aa98bf5198e068",
    );
    check_tensor(
        &g,
        "blk.0.attn_q.weight",
        &[1536, 1536],
        GgmlType::Q4K,
        351_052_288,
        1_327_104,
        "ca034f10eaa4f3f7e39eecb6fd5d5f97",
    );
    check_tensor(
        &g,
        "blk.0.attn_norm.weight",
        &[1536],
        GgmlType::F32,
        328_662_592 - 5_950_528,
        6144,
        "0020243f00200a3f00c01e3f00a04d3f",
    );
    // The last tensor ends exactly at the end of the file.
    check_tensor(
        &g,
        "output_norm.weight",
        &[1536],
        GgmlType::F32,
        1_117_314_624 - 5_950_528,
        6144,
        "00008d40000093400000544000009440",
    );
    assert_eq!(g.tensors.last().unwrap().name, "output_norm.weight");
    let norm = g.tensor_data(g.tensor("output_norm.weight").unwrap());
    assert_eq!(f32::from_le_bytes(norm[..4].try_into().unwrap()), 4.40625);
    assert!(g.tensor("no.such.tensor").is_none());
}

#[test]
fn gemma_file_matches_gguf_py() {
    let g = open(GEMMA);
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 32);
    assert_eq!(g.tensors.len(), 236);
    assert_eq!(g.metadata().len(), 33);
    assert_eq!(g.file_size(), 253_113_024);
    assert_eq!(g.data_offset(), 6_525_120);
    assert_eq!(g.architecture(), Some("gemma3"));
    assert_eq!(g.get_u64("gemma3.block_count"), Some(18));
    assert_eq!(g.get_u64("gemma3.embedding_length"), Some(640));
    assert_eq!(g.get_u64("gemma3.attention.sliding_window"), Some(512));
    assert_eq!(g.get_u64("gemma3.attention.key_length"), Some(256));
    assert_eq!(g.get_bool("tokenizer.ggml.add_bos_token"), Some(true));
    assert_eq!(g.get_str("tokenizer.ggml.model"), Some("llama"));

    let tags = g.get("general.tags").and_then(Value::as_array).unwrap();
    let tags: Vec<&str> = tags.iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(tags, ["gemma3", "gemma", "google", "text-generation"]);

    let tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!(tokens.len(), 262144);
    let first: Vec<&str> = tokens[..5].iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(first, ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]);
    assert_eq!(tokens[262143].as_str(), Some("<unused6241>"));
    let scores = g
        .get("tokenizer.ggml.scores")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!(scores.len(), 262144);
    assert_eq!(scores[0], Value::F32(-1000.0));
    let types = g
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .unwrap();
    assert_eq!(types[0], Value::I32(3));

    let count = |ty| g.tensors.iter().filter(|t| t.ty == ty).count();
    assert_eq!(
        [
            GgmlType::F32,
            GgmlType::Q5_0,
            GgmlType::Q4K,
            GgmlType::Q8_0,
            GgmlType::Q6K
        ]
        .map(count),
        [109, 81, 27, 10, 9]
    );

    check_tensor(
        &g,
        "token_embd.weight",
        &[640, 262144],
        GgmlType::Q8_0,
        2560,
        178_257_920,
        "f210f447c7ddec3008cb3febf64d4610",
    );
    check_tensor(
        &g,
        "output_norm.weight",
        &[640],
        GgmlType::F32,
        0,
        2560,
        "0000e4400000194100003c4200001143",
    );
    check_tensor(
        &g,
        "blk.0.attn_k.weight",
        &[640, 256],
        GgmlType::Q5_0,
        184_785_600 - 6_525_120,
        112_640,
        "081c356ef9c93099d3e998234a2d70ff",
    );
    check_tensor(
        &g,
        "blk.0.attn_q.weight",
        &[640, 1024],
        GgmlType::Q5_0,
        178_745_344,
        450_560,
        "c017720b47dd3e6498cdc69510cb620a",
    );
    check_tensor(
        &g,
        "blk.17.post_ffw_norm.weight",
        &[640],
        GgmlType::F32,
        253_110_464 - 6_525_120,
        2560,
        "0080bc430080a9430000864200005c42",
    );
}

/// Every tensor's data of both files lies inside the file, the tensors tile the data section in
/// order without overlap, and `tensor()` finds each by name.
#[test]
fn real_files_tensor_layout_is_consistent() {
    for file in [QWEN, GEMMA] {
        let g = open(file);
        let mut spans: Vec<(u64, u64)> = g
            .tensors
            .iter()
            .map(|t| (t.offset, t.offset + t.size_bytes as u64))
            .collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{file}: overlapping tensors {w:?}");
        }
        assert_eq!(
            g.data_offset() as u64 + spans.last().unwrap().1,
            g.file_size() as u64
        );
        for t in &g.tensors {
            assert!(std::ptr::eq(g.tensor(&t.name).unwrap(), t));
            assert_eq!(t.offset % g.alignment as u64, 0);
            assert_eq!(
                Some(t.size_bytes),
                t.ty.row_bytes(t.row_len()).map(|r| r * t.n_rows())
            );
        }
    }
}
