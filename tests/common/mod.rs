//! Shared helpers for integration tests: the real `infer` binary, the real model files, and the
//! llama.cpp reference outputs copied from ../shared/refs into tests/fixtures/refs.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

pub const QWEN: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";
pub const GEMMA: &str = "gemma-3-270m-q4_k_m.gguf";

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Path of a real model; fails (never skips) with the command that fetches it.
pub fn model(file: &str) -> PathBuf {
    let dir = std::env::var_os("INFER_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("models"));
    let p = dir.join(file);
    assert!(
        p.exists(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    p
}

pub fn fixture(rel: &str) -> PathBuf {
    root().join("tests/fixtures").join(rel)
}

/// The bytes of a lowercase hex string (the fixtures' encoding of byte strings).
pub fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd-length hex");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

/// The little-endian f32s of a hex string (the fixtures' encoding of float arrays, bit-exact).
pub fn f32s(hex: &str) -> Vec<f32> {
    unhex(hex)
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// A fresh, empty directory `name` under the tests' temporary folder.
pub fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The tiny Hugging Face fixture `name` (tests/fixtures/convert/hf-tiny) converted to `ty` by
/// `infer quantize`, written in `dir`.
pub fn convert_tiny(dir: &std::path::Path, name: &str, ty: &str) -> PathBuf {
    let out = dir.join(format!("{name}.{ty}.gguf"));
    let src = root().join("tests/fixtures/convert/hf-tiny").join(name);
    let (src_s, out_s) = (src.to_str().unwrap(), out.to_str().unwrap());
    let o = infer(
        &["quantize", "--from-hf", src_s, "--out", out_s, "--type", ty],
        None,
    );
    assert!(
        o.status.success(),
        "converting {name} to {ty}: {}",
        stderr(&o)
    );
    out
}

/// Runs the real binary with the given args and stdin.
pub fn infer(args: &[&str], stdin: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_infer"));
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("spawn infer");
    if let Some(s) = stdin {
        use std::io::Write;
        let mut w = child.stdin.take().unwrap();
        w.write_all(s.as_bytes()).unwrap();
    }
    child.wait_with_output().expect("wait for infer")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("stdout is UTF-8")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs and asserts success, returning stdout.
#[macro_export]
macro_rules! infer_ok {
    ($stdin:expr; $($arg:expr),+ $(,)?) => {{
        let o = common::infer(&[$($arg),+], $stdin);
        assert!(o.status.success(), "infer failed ({:?}): {}", o.status, common::stderr(&o));
        common::stdout(&o)
    }};
}

/// Opens a GGUF and builds a CPU runner (2 threads) with `n_ctx` positions of KV.
pub fn load_runner(
    path: &std::path::Path,
    n_ctx: usize,
) -> (
    std::sync::Arc<infer::format::Gguf>,
    infer::engine::runner::Runner<infer::kernels::cpu::backend::CpuBackend>,
) {
    use infer::model::{Model, ModelConfig, Weights};
    let g = std::sync::Arc::new(infer::format::Gguf::open(path).unwrap());
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let backend = infer::kernels::cpu::backend::CpuBackend::new(2);
    let weights = Weights::load(&g, &cfg, &backend).unwrap();
    let model = Model {
        cfg,
        weights,
        backend,
        block_size: infer::engine::runner::BLOCK_SIZE,
    };
    (g, infer::engine::runner::Runner::new(model, n_ctx).unwrap())
}

/// Index of the largest logit (the lowest index on ties, as greedy sampling picks).
pub fn argmax(v: &[f32]) -> u32 {
    (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b }) as u32
}
