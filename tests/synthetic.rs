//! `infer synth` on a real model: the skeleton is small, and the file expanded from it has the
//! real file's metadata, tensor names, types and shapes, and runs.

mod common;

use infer::format::Gguf;

#[test]
fn synthetic_gemma_has_the_real_shapes_and_runs() {
    let real_path = common::model(common::GEMMA);
    let dir = std::env::temp_dir().join(format!("infer-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (skel, full) = (dir.join("gemma.skel.gguf"), dir.join("gemma.gguf"));
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    infer_ok!(None; "synth", "--skeleton-of", &s(&real_path), "-o", &s(&skel));
    assert!(
        std::fs::metadata(&skel).unwrap().len() < 16 << 20,
        "the skeleton is small"
    );
    infer_ok!(None; "synth", "--from", &s(&skel), "-o", &s(&full), "--seed", "3");
    let (real, synth) = (Gguf::open(&real_path).unwrap(), Gguf::open(&full).unwrap());
    let list = |g: &Gguf| -> Vec<_> {
        g.tensors
            .iter()
            .map(|t| (t.name.clone(), t.ty, t.dims.clone()))
            .collect()
    };
    assert_eq!(list(&synth), list(&real));
    for (k, v) in real.metadata() {
        if k != "general.name" {
            assert_eq!(synth.get(k), Some(v), "metadata {k}");
        }
    }
    let out = infer_ok!(None; "run", "-q", "-m", &s(&full), "-p", "Hello", "-n", "4", "--temp", "0", "--json");
    assert!(out.contains("\"generated_tokens\":4"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}
