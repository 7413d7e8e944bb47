//! Model files that are valid GGUF containers but not valid models: a missing hyperparameter, a
//! missing tensor, a tensor of the wrong shape, an unknown architecture. The GGUF reader accepts
//! each (the container is fine); loading the model must refuse it with an error that names what
//! is wrong, exit 1, and never panic. Each file is the tiny Qwen2 checkpoint converted by
//! `infer quantize`, then rewritten with one change through the crate's GGUF writer.

mod common;

use std::path::{Path, PathBuf};

use common::{infer, stderr};
use infer::format::{Gguf, GgufWriter, Value};

fn scratch(test: &str) -> PathBuf {
    common::scratch(&format!("malformed-{test}"))
}

/// The tiny Qwen2 checkpoint as a valid f32 GGUF model in `dir`.
fn valid(dir: &Path) -> PathBuf {
    let out = common::convert_tiny(dir, "qwen2", "f32");
    let valid = dir.join("valid.gguf");
    std::fs::rename(out, &valid).unwrap();
    valid
}

/// `src` rewritten to `name` with its metadata and tensors passed through `edit`.
fn rewrite(
    src: &Path,
    name: &str,
    edit: impl FnOnce(&mut Vec<(String, Value)>, &mut Vec<(String, Vec<u64>, Vec<u8>)>),
) -> PathBuf {
    let g = Gguf::open(src).unwrap();
    let mut meta: Vec<(String, Value)> = g
        .metadata()
        .iter()
        .filter(|(k, _)| k != "general.alignment")
        .cloned()
        .collect();
    let mut tensors: Vec<(String, Vec<u64>, Vec<u8>)> = g
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), g.tensor_data(t).to_vec()))
        .collect();
    let ty = g.tensors[0].ty;
    edit(&mut meta, &mut tensors);
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.add_kv(&k, v);
    }
    for (n, dims, data) in tensors {
        let ty = if n.ends_with("norm.weight") || n.ends_with(".bias") {
            infer::format::GgmlType::F32
        } else {
            ty
        };
        w.add_tensor(&n, &dims, ty, data).unwrap();
    }
    let out = src.with_file_name(name);
    w.write_file(&out).unwrap();
    // The container itself is valid: the reader opens it.
    Gguf::open(&out).unwrap_or_else(|e| panic!("{name}: {e}"));
    out
}

/// `infer run` on `file`: must fail with exit 1, an `infer: ` error naming every needle, no panic.
fn refused(file: &Path, needles: &[&str]) {
    let o = infer(
        &["run", "-m", file.to_str().unwrap(), "-p", "hi", "-n", "1"],
        None,
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{}: {e}", file.display());
    assert!(e.starts_with("infer: "), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    for n in needles {
        assert!(e.contains(n), "{}: {e:?} lacks {n:?}", file.display());
    }
}

#[test]
fn valid_containers_that_are_not_models_are_refused() {
    let dir = scratch("models");
    let ok = valid(&dir);
    // The unchanged rewrite runs: the edits below are what breaks each file.
    let same = rewrite(&ok, "same.gguf", |_, _| {});
    let o = infer(
        &["run", "-m", same.to_str().unwrap(), "-p", "hi", "-n", "2"],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));

    let f = rewrite(&ok, "no-block-count.gguf", |m, _| {
        m.retain(|(k, _)| k != "qwen2.block_count")
    });
    refused(&f, &["qwen2.block_count"]);

    let f = rewrite(&ok, "no-tensor.gguf", |_, t| {
        t.retain(|(n, _, _)| n != "blk.1.ffn_down.weight")
    });
    refused(&f, &["blk.1.ffn_down.weight"]);

    let f = rewrite(&ok, "wrong-shape.gguf", |_, t| {
        let q = t
            .iter_mut()
            .find(|(n, _, _)| n == "blk.0.attn_q.weight")
            .unwrap();
        // 64 × 64 stored as 32 × 128: the same bytes, the wrong shape.
        q.1 = vec![32, 128];
    });
    refused(&f, &["blk.0.attn_q.weight"]);

    let f = rewrite(&ok, "unknown-arch.gguf", |m, _| {
        for (k, v) in m.iter_mut() {
            if k == "general.architecture" {
                *v = Value::String("gpt-nonexistent".into());
            }
        }
    });
    refused(&f, &["gpt-nonexistent"]);
}
