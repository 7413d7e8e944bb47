//! Quantized matrix multiplication on the CPU, reproducing what llama.cpp's x86 CPU backend computes
//! for the same weights: the activations are quantized once per call to the weight type's
//! dot-product format with ggml-cpu's x86 quantizer (`quantize_row_q8_0`: `id = 127/amax`, round
//! half to even; Q8_K has a single quantizer in ggml), then every output element is the dot product
//! of one stored weight row with one activation row. The dot kernels (`simd`) follow, float
//! operation for float operation, the x86 kernel llama.cpp runs for that type (the repacked
//! `gemv/gemm_q4_K_8x8_q8_K` for Q4_K, `ggml_vec_dot_*` / tinyBLAS for the others, which agree per
//! element), so results are bit-identical to llama.cpp's; without AVX2 the scalar reference
//! (ggml's generic C) is used. Weights are never dequantized to memory. Output rows are split
//! across the thread pool; each thread writes a disjoint set of output elements.

use crate::format::GgmlType;
use crate::kernels::cpu::backend::{CpuAct, CpuWeight};
use crate::kernels::cpu::pool::ThreadPool;
use crate::kernels::cpu::simd;
use crate::quant::Q8Variant;

/// Weight types this matmul can multiply.
pub fn supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K
    )
}

/// A raw pointer that may be shared across the pool's threads.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every thread writes a disjoint set of elements (its own output rows) and the pool joins
// all threads before the buffer is used again.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

/// Activation rows per tile call (the kernels take up to four rows at once).
const TILE: usize = 4;

/// out (n × rows) = x (n × cols) · Wᵀ.
pub fn matmul(pool: &ThreadPool, w: &CpuWeight, x: &CpuAct, out: &mut CpuAct) {
    let (n, cols, rows) = (x.rows, w.cols, w.rows);
    assert_eq!(x.cols, cols, "matmul input width");
    assert_eq!((out.rows, out.cols), (n, rows), "matmul output shape");
    let act_ty = crate::quant::vec_dot_type(w.ty);
    let a_bytes = crate::quant::activation_row_bytes(act_ty, cols)
        .expect("activation row fits the block size");
    let mut xq = Vec::with_capacity(n * a_bytes);
    let mut tmp = Vec::with_capacity(a_bytes);
    for t in 0..n {
        crate::quant::quantize_activations_as(w.ty, x.row(t), &mut tmp, Q8Variant::X86Avx)
            .expect("activation quantization for a supported type");
        xq.extend_from_slice(&tmp[..a_bytes]);
    }
    let kern = simd::kernels(w.ty)
        .or_else(|| simd::reference(w.ty))
        .expect("supported weight type has a dot product");
    // llama.cpp repacks Q4_K matrices whose row count is a multiple of 8 and then multiplies the
    // activation rows in groups of four with `ggml_gemm_q4_K_8x8_q8_K` (one FMA per pair of
    // sub-blocks) and the remaining `n % 4` rows with `ggml_gemv_q4_K_8x8_q8_K` (one per block).
    let gemm_rows = if w.ty == GgmlType::Q4K && rows % 8 == 0 && n > 3 {
        n - n % 4
    } else {
        0
    };
    let wb = w.bytes();
    let rb = w.row_bytes;
    let dst = SharedOut(out.data.as_mut_ptr());
    pool.for_range(rows, 16, |range| {
        let dst = dst;
        let mut res = [0f32; TILE];
        for r in range {
            let wr = &wb[r * rb..(r + 1) * rb];
            for t0 in (0..n).step_by(TILE) {
                let m = (n - t0).min(TILE);
                let acts = &xq[t0 * a_bytes..(t0 + m) * a_bytes];
                if t0 < gemm_rows {
                    q4k_gemm_tile(cols, wr, acts, a_bytes, m, &mut res);
                } else {
                    (kern.tile)(cols, wr, acts, a_bytes, m, &mut res);
                }
                for (j, &v) in res[..m].iter().enumerate() {
                    // SAFETY: r < rows and t0 + j < n, so (t0 + j) * rows + r is inside out.data
                    // (n * rows); row r belongs to exactly one thread's range, so no two threads
                    // write the same element.
                    unsafe { *dst.0.add((t0 + j) * rows + r) = v };
                }
            }
        }
    });
}

/// One Q4_K weight row times `m` Q8_K activation rows as llama.cpp's repacked
/// `ggml_gemm_q4_K_8x8_q8_K` computes each output: per block and per pair of sub-blocks `2j, 2j+1`
/// an exact integer sum `isum = sc[2j]·dot[2j] + sc[2j+1]·dot[2j+1]` and min sum
/// `imin = m[2j]·bsum[2j] + m[2j+1]·bsum[2j+1]`, accumulated as `acc = fma(isum, d_w·d_a, acc)`,
/// `accm = fma(imin, dmin_w·d_a, accm)`; the result is `acc - accm`.
fn q4k_gemm_tile(n: usize, w: &[u8], acts: &[u8], stride: usize, m: usize, out: &mut [f32]) {
    use crate::quant::blocks::{get_scale_min_k4, Block, BlockQ4K, BlockQ8K};
    let nb = n / 256;
    assert_eq!(w.len(), nb * BlockQ4K::BYTES, "Q4_K weight row length");
    for (j, o) in out[..m].iter_mut().enumerate() {
        let a = &acts[j * stride..j * stride + nb * BlockQ8K::BYTES];
        let (mut acc, mut accm) = (0f32, 0f32);
        for b in 0..nb {
            let x = &w[b * BlockQ4K::BYTES..(b + 1) * BlockQ4K::BYTES];
            let y = &a[b * BlockQ8K::BYTES..(b + 1) * BlockQ8K::BYTES];
            let d = half::f16::from_le_bytes([x[0], x[1]]).to_f32();
            let dmin = half::f16::from_le_bytes([x[2], x[3]]).to_f32();
            let ad = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
            let scales: &[u8; 12] = x[4..16].try_into().expect("12 scale bytes");
            let bsum = |k: usize| i16::from_le_bytes([y[260 + 2 * k], y[261 + 2 * k]]) as i32;
            let (dd, dm) = (d * ad, dmin * ad);
            for p in 0..4 {
                let q = &x[16 + 32 * p..48 + 32 * p];
                let ya = &y[4 + 64 * p..68 + 64 * p];
                let (mut s0, mut s1) = (0i32, 0i32);
                for l in 0..32 {
                    s0 += (q[l] & 0xF) as i32 * ya[l] as i8 as i32;
                    s1 += (q[l] >> 4) as i32 * ya[32 + l] as i8 as i32;
                }
                let (sc0, m0) = get_scale_min_k4(2 * p, scales);
                let (sc1, m1) = get_scale_min_k4(2 * p + 1, scales);
                let isum = sc0 as i32 * s0 + sc1 as i32 * s1;
                let imin = m0 as i32 * (bsum(4 * p) + bsum(4 * p + 1))
                    + m1 as i32 * (bsum(4 * p + 2) + bsum(4 * p + 3));
                acc = (isum as f32).mul_add(dd, acc);
                accm = (imin as f32).mul_add(dm, accm);
            }
        }
        *o = acc - accm;
    }
}
