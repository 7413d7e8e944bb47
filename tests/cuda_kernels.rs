//! Every CUDA kernel, run on the CPU emulator, against the crate's scalar reference
//! (`infer::check::cuda_kernels`: the same checks `infer selftest --device cuda` runs on a GPU),
//! plus the emulator's own guarantees: a divergent warp shuffle and a mismatched barrier are
//! reported with their source line instead of passing silently; and the CUDA backend's
//! host-side copies of a quantized KV cache's blocks.

mod cuda_emu;

use infer::check::cuda_kernels as check;
use infer::kernels::cuda::launch::DevBuf;

#[test]
fn every_kernel_matches_the_cpu_reference() {
    let l = cuda_emu::emulator();
    let checks = check::run_all(&l).expect("kernels launch");
    let mut failed = Vec::new();
    for c in &checks {
        eprintln!(
            "{:<5} {:<18} {:<58} err {:.3e} (tol {:.0e})",
            if c.pass() { "ok" } else { "FAIL" },
            c.kernel,
            c.shape,
            c.err,
            c.tol
        );
        if !c.pass() {
            failed.push(format!(
                "{} {}: {:.3e} > {:.0e}",
                c.kernel, c.shape, c.err, c.tol
            ));
        }
    }
    assert!(checks.len() >= 40, "only {} checks ran", checks.len());
    assert!(
        failed.is_empty(),
        "kernels differ from the reference:\n{}",
        failed.join("\n")
    );
}

fn run_rule_kernel(name: &str, threads: u32) -> Result<Vec<f32>, String> {
    let l = cuda_emu::emulator();
    let out = DevBuf::new(&l, threads as usize * 4).unwrap();
    l.launch(name, [1, 1, 1], [threads, 1, 1], &[out.arg()])
        .map_err(|e| format!("{e:#}"))?;
    Ok(out.to_f32().unwrap())
}

#[test]
fn emulator_reports_divergent_shuffles_with_their_line() {
    let e = run_rule_kernel("emu_divergent_shfl", 32).unwrap_err();
    assert!(e.contains("divergent warp op"), "{e}");
    assert!(e.contains("selftest.cu:8"), "{e}");
}

#[test]
fn emulator_reports_barrier_mismatches_with_their_lines() {
    let e = run_rule_kernel("emu_barrier_mismatch", 64).unwrap_err();
    assert!(e.contains("barrier mismatch"), "{e}");
    assert!(
        e.contains("selftest.cu:16") && e.contains("selftest.cu:18"),
        "{e}"
    );
}

#[test]
fn emulator_runs_well_formed_warp_and_block_ops() {
    let got = run_rule_kernel("emu_well_formed", 96).unwrap();
    let total: f32 = (0..96).map(|i| i as f32).sum();
    for (i, v) in got.iter().enumerate() {
        let partner = (i / 32) * 32 + 31 - i % 32;
        assert_eq!(*v, partner as f32 + 1000.0 * total, "thread {i}");
    }
}

#[test]
fn device_sampler_picks_the_cpu_samplers_tokens() {
    let l = cuda_emu::emulator();
    let mut checks = Vec::new();
    infer::check::cuda_sample::sample(&l, &[1531, 4099], 50, &mut checks).expect("launches");
    let failed: Vec<String> = checks
        .iter()
        .filter(|c| !c.pass())
        .map(|c| format!("{}: {} wrong", c.shape, c.err))
        .collect();
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// A quantized cache's planes hold rows of their own types (K q8_0: 68 bytes for 64 values, V
/// q4_0: 36): copy-on-write copies whole blocks of those rows in every layer and nothing else,
/// and heads that are not whole 32-value blocks are refused with the alternative named.
#[test]
fn quantized_kv_blocks_copy_in_their_row_sizes() {
    use infer::kernels::cuda::backend::CudaBackend;
    use infer::model::backend::{Backend, CacheType, KvType};
    let be = CudaBackend::new(cuda_emu::emulator());
    let (layers, blocks, bs, kv_dim) = (2, 4, 16, 64);
    let ty = KvType::of(CacheType::Q8_0, CacheType::Q4_0);
    let mut kv = be.alloc_kv(layers, blocks, bs, kv_dim, 32, ty).unwrap();
    assert_eq!(kv.row_bytes(), (68, 36));
    let planes = |kv: &infer::kernels::cuda::backend::CudaKv| -> Vec<Vec<u8>> {
        kv.k.iter()
            .chain(kv.v.iter())
            .map(|p| p.to_bytes().unwrap())
            .collect()
    };
    for (i, p) in kv.k.iter().chain(kv.v.iter()).enumerate() {
        assert_eq!(p.bytes, blocks * bs * if i < layers { 68 } else { 36 });
        let fill: Vec<u8> = (0..p.bytes).map(|b| (b * 7 + i * 31) as u8).collect();
        be.launcher().upload(p.ptr, &fill).unwrap();
    }
    let before = planes(&kv);
    be.kv_copy_blocks(&mut kv, &[(1, 3)]);
    for (i, (old, new)) in before.iter().zip(planes(&kv)).enumerate() {
        let n = bs * if i < layers { 68 } else { 36 };
        let mut want = old.clone();
        want.copy_within(n..2 * n, 3 * n);
        assert!(
            new == want,
            "plane {i}: block 3 is not block 1, or more was written"
        );
    }
    let e = be
        .alloc_kv(1, 1, bs, 48, 16, ty)
        .err()
        .expect("16-value heads refused")
        .to_string();
    assert!(
        e.contains("whole 32-value blocks") && e.contains("f16"),
        "{e}"
    );
}
