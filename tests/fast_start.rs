//! Fast start: the repacked weights kept in a pack file between runs
//! (`kernels::cpu::layouts::pack_file`) and the huge-page copies made in the background give the
//! same bytes as repacking at every start. Each real model is run three ways: repacking at load
//! (`INFER_PACK_CACHE=0`), writing the pack file (first start) and reading it (later starts), and
//! the outputs (tokens and their logprobs, as JSON) must be byte-identical; a damaged pack file is
//! ignored and replaced.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{model, scratch, stderr, stdout, GEMMA, QWEN};

/// A prompt over eight tokens, so the prefill takes the GEMM kernels too, then decode steps.
const PROMPT: &str = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n";

fn run(model: &Path, pack: &str, extra: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_infer"));
    cmd.args(["run", "-m"])
        .arg(model)
        .args([
            "-p",
            PROMPT,
            "-n",
            "12",
            "--temp",
            "0",
            "--json",
            "--logprobs",
            "3",
        ])
        .env("INFER_PACK_CACHE", pack)
        .stdin(Stdio::null());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let o = cmd.output().expect("spawn infer");
    assert!(o.status.success(), "{}", stderr(&o));
    o
}

/// The generated tokens and logprobs (the last line's speeds vary from run to run).
fn tokens(o: &Output) -> String {
    let out = stdout(o);
    let lines: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with("{\"done\""))
        .collect();
    assert_eq!(lines.len(), 12, "{out}");
    lines.join("\n")
}

fn packs(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

fn same_output_every_way(file: &str, name: &str, extra: &[(&str, &str)]) {
    let m = model(file);
    let dir = scratch(name);
    let dir_s = dir.to_str().unwrap();

    let repack = run(&m, "0", extra);
    assert!(packs(&dir).is_empty());

    let first = run(&m, dir_s, extra);
    assert!(
        stderr(&first).contains("wrote the repacked weights"),
        "{}",
        stderr(&first)
    );
    let written = packs(&dir);
    assert_eq!(written.len(), 1, "{written:?}");
    assert!(written[0].to_str().unwrap().ends_with(".pack"));

    let warm = run(&m, dir_s, extra);
    assert!(!stderr(&warm).contains("wrote"), "{}", stderr(&warm));
    assert_eq!(packs(&dir), written, "read, not rewritten");

    let want = tokens(&repack);
    assert!(want.contains("\"logprob\""), "{want}");
    assert_eq!(
        tokens(&first),
        want,
        "writing the pack file changed the output"
    );
    assert_eq!(
        tokens(&warm),
        want,
        "reading the pack file changed the output"
    );

    // A damaged footer: the file is ignored, replaced, and the output stays the same.
    let len = std::fs::metadata(&written[0]).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&written[0])
        .unwrap();
    f.set_len(len - 1).unwrap();
    drop(f);
    let again = run(&m, dir_s, extra);
    assert!(stderr(&again).contains("wrote the repacked weights"));
    assert_eq!(std::fs::metadata(&written[0]).unwrap().len(), len);
    assert_eq!(tokens(&again), want);
}

#[test]
fn qwen_pack_file_output_is_byte_identical() {
    same_output_every_way(QWEN, "fast-start-qwen", &[]);
}

/// Gemma-3 packs few bytes on an AVX2 CPU (its Q8_0 and Q5_0 matrices get plain copies there), so
/// the size floor is lifted to write a pack file anyway; the plain copies are made in the
/// background either way.
#[test]
fn gemma_pack_file_output_is_byte_identical() {
    same_output_every_way(GEMMA, "fast-start-gemma", &[("INFER_PACK_MIN_BYTES", "0")]);
}
