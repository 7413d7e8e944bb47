//! `infer selftest`: on a machine with a CUDA GPU, runs every kernel check of
//! `check::cuda_kernels` (the ones the tests run on the CPU emulator) on the real device, and
//! optionally a whole forward pass of a model on both backends (its logits, 64 greedy tokens
//! each backend chooses on its own, and the CUDA backend's row invariance), and prints a pass/fail table with timings on stdout. Exit
//! status 1 if any check fails or no device is usable.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};

use crate::cli::args::SelftestArgs;
use infer::check::{cuda_forward as check_forward, cuda_kernels as check};
use infer::format::{GgmlType, Gguf};
use infer::kernels::cuda::driver;
use infer::kernels::cuda::launch::{Arg, Launch};
use infer::model::ModelConfig;
use std::time::Instant;

pub fn selftest(a: SelftestArgs) -> Result<()> {
    let driver =
        driver::probe().map_err(|e| anyhow!("selftest needs a usable CUDA device: {e:#}"))?;
    let l: Arc<dyn Launch> = driver;
    println!("device: {}", l.describe());
    println!(
        "{:<6} {:<18} {:<60} {:>10} {:>8} {:>10}",
        "result", "kernel", "shape", "error", "tol", "time"
    );
    let checks = check::run_all(&l)?;
    let mut failed = 0;
    for c in &checks {
        failed += !c.pass() as usize;
        println!(
            "{:<6} {:<18} {:<60} {:>10.2e} {:>8.0e} {:>8.3}ms",
            if c.pass() { "PASS" } else { "FAIL" },
            c.kernel,
            c.shape,
            c.err,
            c.tol,
            c.secs * 1e3
        );
    }
    let mut total = checks.len();
    if let Some(m) = &a.model {
        let path = crate::cli::models::resolve(m)?;
        let g = Gguf::open(&path).map_err(|e| anyhow!("reading {}: {e:#}", path.display()))?;
        let vocab = ModelConfig::from_gguf(&g)?.vocab_size as u32;
        let float_only = g
            .tensors
            .iter()
            .all(|t| matches!(t.ty, GgmlType::F32 | GgmlType::F16));
        // As tests/cuda_forward.rs: the backends quantize activations differently. Random weights
        // (`infer synth` files) give small, flat logits, over which the backends' activation
        // roundings (q8_K on the CPU, q8_1 on the GPU) compound through the layers to several %
        // of the largest logit: on the emulator, which runs these kernels' source, 9.1% (Qwen2.5-
        // 1.5B's shapes) and 7.4% (Gemma-3-270M's) over 12 prompt rows and 4 decode steps, argmax
        // equal in every row. There the tolerance is 0.15, and every row's argmax must agree up to
        // a near tie.
        let synthetic =
            g.get_str("general.name") == Some(infer::convert::synthetic::SYNTHETIC_NAME);
        let tol = match (float_only, synthetic) {
            (true, _) => 1e-3,
            (false, false) => 0.04,
            (false, true) => 0.15,
        };
        let prompt: Vec<u32> = (0..a.tokens as u32).map(|i| (i * 37 + 5) % vocab).collect();
        let r = check_forward::forward(Arc::clone(&l), &path, &prompt, 4)?;
        let rel = (r.max_diff / r.scale) as f64;
        let flips_ok = !synthetic || r.worst_flip <= check_forward::NEAR_TIE * r.scale;
        let pass = rel <= tol && flips_ok;
        failed += !pass as usize;
        total += 1;
        println!(
            "{:<6} {:<18} {:<60} {:>10.2e} {:>8.0e} {:>8.1}ms  (cpu {:.1}ms, argmax differs in {} of {} rows)",
            if pass { "PASS" } else { "FAIL" },
            "forward",
            format!("{}: {} prompt + 4 decode (rel. to max logit)", path.display(), a.tokens),
            rel,
            tol,
            r.cuda_secs * 1e3,
            r.cpu_secs * 1e3,
            r.argmax_differs,
            r.rows
        );
        // Both backends decoding greedily on their own.
        const STEPS: usize = 64;
        let t = Instant::now();
        let gr = check_forward::greedy(Arc::clone(&l), &path, &prompt, STEPS)?;
        failed += !gr.pass() as usize;
        total += 1;
        println!(
            "{:<6} {:<18} {:<60} {:>10} {:>8} {:>8.1}ms  (first differing step's CPU gap {:.2e} of max logit; a near tie is up to {})",
            if gr.pass() { "PASS" } else { "FAIL" },
            "greedy",
            format!("{}: {STEPS} tokens, each backend its own", path.display()),
            format!("{}/{STEPS}", gr.agreed),
            "agree",
            t.elapsed().as_secs_f64() * 1e3,
            gr.gap,
            check_forward::NEAR_TIE
        );
        // A batch past the GEMV's 8 rows (at most the 16 the backend keeps row-invariant) with
        // row-invariant numerics, against one-token forwards: bit for bit.
        let n = prompt.len().clamp(12, 16);
        let p: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 5) % vocab).collect();
        let t = Instant::now();
        let ri = check_forward::row_invariance(Arc::clone(&l), &path, &p, None)?;
        let pass = ri.differ_on == 0;
        failed += !pass as usize;
        total += 1;
        println!(
            "{:<6} {:<18} {:<60} {:>10} {:>8} {:>8.1}ms  ({} of them without it)",
            if pass { "PASS" } else { "FAIL" },
            "row invariance",
            format!("{}: {n} rows in one batch vs one at a time", path.display()),
            format!("{}/{n}", ri.differ_on),
            "differ",
            t.elapsed().as_secs_f64() * 1e3,
            ri.differ_off
        );
    }
    launch_overhead(&*l)?;
    if failed > 0 {
        bail!("{failed} of {total} CUDA checks failed");
    }
    println!("all {total} checks passed");
    Ok(())
}

/// What one kernel launch costs, the floor under a decode step of a few hundred small kernels:
/// 2000 launches of a one-element kernel, timed from the first launch until the device has run
/// them all, three times: the first run goes one launch at a time, the second builds a CUDA graph
/// of the run (see `kernels::cuda::graphs`), the third replays it.
fn launch_overhead(l: &dyn Launch) -> Result<()> {
    const N: u32 = 2000;
    let buf = l.alloc(256)?;
    let args = [Arg::Ptr(buf), Arg::F32(1.0), Arg::I64(1)];
    let mut per = Vec::new();
    for _ in 0..3 {
        l.sync()?;
        let t0 = Instant::now();
        for _ in 0..N {
            l.launch("scale", [1, 1, 1], [32, 1, 1], &args)?;
        }
        l.sync()?;
        per.push(t0.elapsed().as_secs_f64() / N as f64 * 1e6);
    }
    l.free(buf);
    println!(
        "launch overhead ({N} launches): {:.2} µs per kernel one by one, {:.2} µs replayed as a CUDA graph",
        per[0], per[2]
    );
    Ok(())
}
