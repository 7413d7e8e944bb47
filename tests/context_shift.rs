//! Context shift with attention sinks (`--context-shift`): when the context is full the oldest
//! block after the kept start is dropped and the later keys are rotated to their new positions.
//! The truth for the rotation is the model itself: the first layer's keys of the moved positions
//! must equal the keys it computes for the same tokens at the new positions from scratch (up to
//! the cache's rounding). Then the real binary generates far past its context, where without the
//! flag it stops.

mod common;

use std::path::{Path, PathBuf};

use common::{infer, load_runner, model, stderr, stdout, GEMMA};
use infer::engine::runner::{Runner, Sequence};
use infer::kernels::cpu::backend::CpuBackend;

fn scratch(test: &str) -> PathBuf {
    common::scratch(&format!("context-shift-{test}"))
}

/// A tiny fixture checkpoint converted to `ty` in `dir`.
fn tiny(dir: &Path, name: &str, ty: &str) -> PathBuf {
    common::convert_tiny(dir, name, ty)
}

/// Layer 0's keys of the first `n` positions of `seq`, as f32 (from the cache's export layout:
/// per block, per layer, K's values then V's, in the cache's type).
fn layer0_keys(r: &Runner<CpuBackend>, seq: &Sequence, n: usize, f16: bool) -> Vec<f32> {
    let bytes = r.export_kv(seq, n).unwrap();
    let cfg = &r.model.cfg;
    let (bs, d, w) = (32, cfg.kv_dim(), if f16 { 2 } else { 4 });
    let per_block = 2 * cfg.n_layer * bs * d * w;
    let mut keys = Vec::new();
    for block in bytes.chunks_exact(per_block) {
        for c in block[..bs * d * w].chunks_exact(w) {
            keys.push(if f16 {
                half::f16::from_le_bytes([c[0], c[1]]).to_f32()
            } else {
                f32::from_le_bytes([c[0], c[1], c[2], c[3]])
            });
        }
    }
    keys.truncate(n * d);
    keys
}

/// After positions 32..96 of 128 are dropped, the first layer's keys of the positions that moved
/// (their K depends only on their token and position) equal the keys the model computes for the
/// same tokens at the new positions from scratch: within float rounding for an f32 cache, within
/// f16 rounding for an f16 one. (Deeper layers' K/V also carry the dropped context, as in
/// StreamingLLM, so they are not compared; the rotation is the same code at every layer, held to
/// RoPE at the new position for several bases in the CPU backend's tests.)
#[test]
fn shifted_keys_equal_keys_computed_at_their_new_positions() {
    let dir = scratch("rotation");
    // f32 files (an f32 cache) and q8_0 ones (an f16 cache); Llama's normal RoPE, Qwen2's and
    // Gemma 3's NeoX RoPE.
    for (name, ty, tol) in [
        ("llama-gqa", "f32", 1e-5),
        ("qwen2", "f32", 1e-5),
        ("gemma3", "f32", 1e-5),
        ("qwen2", "q8_0", 2e-3),
        ("gemma3", "q8_0", 2e-3),
    ] {
        let path = tiny(&dir, name, ty);
        let (_g, mut r) = load_runner(&path, 256);
        let vocab = r.vocab_size() as u32;
        let tokens: Vec<u32> = (0..128u32).map(|i| (i * 7919 + 13) % vocab).collect();
        let mut a = Sequence::new(tokens.clone());
        r.compute(&mut a).unwrap();
        assert_eq!(r.shift(&mut a, 1, 2).unwrap(), 64);
        let kept: Vec<u32> = tokens[..32].iter().chain(&tokens[96..]).copied().collect();
        assert_eq!(a.tokens, kept);
        let mut b = Sequence::new(kept);
        r.compute(&mut b).unwrap();
        let f16 = ty != "f32";
        let (ka, kb) = (layer0_keys(&r, &a, 64, f16), layer0_keys(&r, &b, 64, f16));
        let scale = kb.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = ka
            .iter()
            .zip(&kb)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
            / scale;
        assert!(d <= tol, "{name} {ty}: relative difference {d:e} > {tol:e}");
        // The kept start is untouched.
        let n0 = 32 * r.model.cfg.kv_dim();
        assert_eq!(ka[..n0], kb[..n0], "{name} {ty}");
    }
}

/// `infer run --json` with `args`: generated tokens and the stop reason.
fn generate(args: &[&str]) -> (u64, String) {
    let o = infer(args, None);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let done: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    (
        done["generated_tokens"].as_u64().unwrap(),
        done["stop"].as_str().unwrap().to_string(),
    )
}

#[test]
fn generation_goes_on_past_the_context() {
    let dir = scratch("cli");
    let m = tiny(&dir, "qwen2", "q8_0");
    let m = m.to_str().unwrap();
    let base = [
        "run",
        "-m",
        m,
        "-p",
        "a b c",
        "--ctx",
        "96",
        "--json",
        "--ignore-eos",
    ];
    let (n, stop) = generate(&[&base[..], &["-n", "5000", "--temp", "0"]].concat());
    assert_eq!(stop, "context_full");
    assert!(n < 96, "{n}");
    let shift = ["--context-shift", "--keep", "4"];
    for sampling in [["--temp", "0"], ["--temp", "1"]] {
        let args = [&base[..], &shift, &["-n", "20000"], &sampling].concat();
        assert_eq!(generate(&args), (20_000, "length".to_string()));
    }
    // With a prompt cache: a shift that drops part of the prompt leaves no file behind (its K/V
    // moved); one that drops only generated tokens keeps a file a later run loads.
    let cache = dir.join("prompt.cache");
    let long = "a b c d e f g h i j k l m n o p q r s t u v w x y z ".repeat(2);
    let c = cache.to_str().unwrap();
    let args = [
        &base[..4],
        &[long.as_str(), "--ctx", "96", "-n", "300", "--ignore-eos"],
    ]
    .concat();
    let o = infer(&[&args[..], &shift, &["--prompt-cache", c]].concat(), None);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("not written"), "{}", stderr(&o));
    assert!(!cache.exists());
    let args = [&base[..4], &["a b", "--ctx", "96", "-n", "300", "--json"]].concat();
    let o = infer(&[&args[..], &shift, &["--prompt-cache", c]].concat(), None);
    assert!(o.status.success() && cache.exists(), "{}", stderr(&o));
    let (n, _) = generate(&[&args[..], &shift, &["--prompt-cache", c]].concat());
    assert!(n > 0);
    // A context too small for the kept block and two more is refused.
    let o = infer(
        &[&base[..3], &["-p", "hi", "--ctx", "64", "--context-shift"]].concat(),
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("at least 96"), "{}", stderr(&o));
    // The real Gemma-3-270M past a 128-token context.
    let g = model(GEMMA);
    let args = [
        "run",
        "-m",
        g.to_str().unwrap(),
        "-p",
        "Once upon a time",
        "--ctx",
        "128",
    ];
    let more = ["-n", "400", "--temp", "0", "--json", "--ignore-eos"];
    assert_eq!(
        generate(&[&args[..], &shift, &more].concat()),
        (400, "length".to_string())
    );
}

/// The two moving-window perplexities score exactly the same tokens (every one from position
/// `window` on, once), and with no shift needed yet both are the plain computation's.
#[test]
fn streaming_and_sliding_score_the_same_tokens() {
    use infer::eval::streaming::{sliding, streaming};
    let dir = scratch("streaming");
    let path = tiny(&dir, "qwen2", "f32");
    let (_g, mut r) = load_runner(&path, 128);
    let vocab = r.vocab_size() as u32;
    let tokens: Vec<u32> = (0..333u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let s = streaming(&mut r, &tokens, 4, 32, &mut |_, _| {}).unwrap();
    let w = sliding(&mut r, &tokens, 48, None, &mut |_, _| {}).unwrap();
    assert_eq!((s.tokens, w.tokens), (333 - 128, 333 - 128));
    assert!(s.nll.is_finite() && w.nll.is_finite());
    // A stride of 1 recomputes every target's full window: a different mean, the same count.
    let one = sliding(&mut r, &tokens[..140], 1, None, &mut |_, _| {}).unwrap();
    assert_eq!(one.tokens, 140 - 128);
}
