//! The scalar twin of the Q4_K kernel with llama.cpp's repacked-GEMM accumulation.
//!
//! llama.cpp on an AVX2 CPU repacks Q4_K matrices whose row count is a multiple of 8 and computes
//! whole groups of four activation rows with `ggml_gemm_q4_K_8x8_q8_K`, the rest with
//! `ggml_gemv_q4_K_8x8_q8_K`. Both sum integers exactly; they differ only in how often they fold
//! them into floats: the GEMV once per super-block (what `kernels(Q4K)` reproduces), the GEMM once
//! per pair of sub-blocks (64 values), which is what this module computes. The reference
//! `crate::quant::vec_dot` has no such variant, so this scalar version is the twin that the SIMD
//! kernel (`avx2::kquants::q4k_gemm_rows`) is tested against, bit for bit.

use crate::quant::blocks::{get_scale_min_k4, iter_blocks, BlockQ4K, BlockQ8K, QK_K};

/// One Q4_K weight row · one Q8_K activation row, accumulated as llama.cpp's Q4_K GEMM does: per
/// block and per pair `p` of sub-blocks an exact `isum = sc[2p]·dot[2p] + sc[2p+1]·dot[2p+1]` and
/// `imin = m[2p]·bsum[2p] + m[2p+1]·bsum[2p+1]`, then `acc = fma(isum, d_w·d_a, acc)`,
/// `accm = fma(imin, dmin_w·d_a, accm)`; the result is `acc - accm`. Panics on wrong lengths.
pub fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
    assert!(
        n.is_multiple_of(QK_K),
        "n = {n} is not a whole number of 256-element blocks"
    );
    let nb = n / QK_K;
    assert_eq!(w.len(), nb * 144, "weight row must be exactly {nb} blocks");
    assert_eq!(
        a.len(),
        nb * 292,
        "activation row must be exactly {nb} blocks"
    );
    let (mut acc, mut accm) = (0f32, 0f32);
    for (x, y) in iter_blocks::<BlockQ4K>(w).zip(iter_blocks::<BlockQ8K>(a)) {
        let d = x.d.to_f32() * y.d;
        let dmin = x.dmin.to_f32() * y.d;
        for p in 0..4 {
            let q = &x.qs[32 * p..32 * p + 32];
            let q8 = &y.qs[64 * p..64 * p + 64];
            let (mut s0, mut s1) = (0i32, 0i32);
            for l in 0..32 {
                s0 += (q[l] & 0xF) as i32 * q8[l] as i32;
                s1 += (q[l] >> 4) as i32 * q8[32 + l] as i32;
            }
            let (sc0, m0) = get_scale_min_k4(2 * p, &x.scales);
            let (sc1, m1) = get_scale_min_k4(2 * p + 1, &x.scales);
            let bsum = |k: usize| y.bsums[2 * k] as i32 + y.bsums[2 * k + 1] as i32;
            let isum = sc0 as i32 * s0 + sc1 as i32 * s1;
            let imin = m0 as i32 * bsum(2 * p) + m1 as i32 * bsum(2 * p + 1);
            acc = (isum as f32).mul_add(d, acc);
            accm = (imin as f32).mul_add(dmin, accm);
        }
    }
    acc - accm
}

/// [`dot`] of one weight row with `m` activation rows at `stride` bytes.
pub fn tile(n: usize, w: &[u8], acts: &[u8], stride: usize, m: usize, out: &mut [f32]) {
    let row = n / QK_K * 292;
    super::check_tile(row, acts.len(), stride, m, out.len());
    for (j, o) in out[..m].iter_mut().enumerate() {
        *o = dot(n, w, &acts[j * stride..j * stride + row]);
    }
}
