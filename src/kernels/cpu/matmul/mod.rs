//! Quantized matrix multiplication on the CPU, reproducing bit for bit what llama.cpp's x86 CPU
//! backend computes for the same weights: the activations are quantized once per call to the weight
//! type's dot-product format with ggml-cpu's x86 quantizer (`quantize_row_q8_0`: `id = 127/amax`,
//! round half to even; Q8_K has a single quantizer in ggml), then every output element is the dot
//! product of one stored weight row with one activation row, its float accumulation following the
//! kernel llama.cpp picks — which depends on the number `n` of activation rows in the call:
//!
//! - Q4_K with a multiple of 8 rows (llama.cpp repacks those, "CPU_REPACK"): the x8-packed
//!   matrices of `q4_k_x8`, rows in groups of four through `ggml_gemm_q4_K_8x8_q8_K`'s arithmetic, the
//!   last `n % 4` (all of them when `n < 4`) through `ggml_gemv_q4_K_8x8_q8_K`'s;
//! - Q6_K with `n >= 8`: ggml-cpu's tiled k-quant matmul (`q6_k_panels` for whole groups of eight
//!   weight rows, [`q6k_tiled`] for the rest); with `n < 8`:
//!   `ggml_vec_dot_q6_K_q8_K` (`simd`; at the AVX-512 level the x16 copy's kernel, the same
//!   arithmetic, one pass over the weights for up to four rows);
//! - Q5_0 / Q8_0: tinyBLAS (`q8_0_panels`) for `n >= 16`, `ggml_vec_dot_*` below (`simd`; at the
//!   AVX-512 level the x16 copies' kernels, the same bits, one pass for up to four rows), which
//!   agree per element.
//!
//! So a result depends on how many rows are multiplied together: greedy parity with llama.cpp
//! holds when the engine batches tokens as llama.cpp does (whole prompt ubatches, then one token
//! per step). Other weight types use the `simd` kernels as they are (not checked against llama.cpp);
//! without AVX2 the scalar reference (ggml's generic C) is used. Weights are never dequantized to
//! memory. Output rows are split across the thread pool; each thread writes a disjoint set of
//! output elements.

use crate::format::GgmlType;
use crate::kernels::cpu::backend::{CpuAct, CpuWeight};
use crate::kernels::cpu::layouts::q6_k_x16::Layout;
use crate::kernels::cpu::layouts::x16::Blocks32Matmul;
use crate::kernels::cpu::layouts::{q5_0_x16, q8_0_x16};
use crate::kernels::cpu::simd;
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::kernels::cpu::SharedMut;
use crate::quant::Q8Variant;

mod decode;
pub mod q6_k_panels;
pub mod q8_0_panels;

pub(crate) use decode::{
    decode_many, decode_rows_of, packed_for_decode, region_shares, split_min_units, with_cuts,
    DECODE_UNIT, STACK_THREADS,
};

/// Weight types this matmul can multiply: every type `quant` registers (the unpacked path runs
/// its SIMD kernels where `simd` has them, else its scalar reference dot product).
pub fn supported(ty: GgmlType) -> bool {
    crate::quant::ops(ty).is_some()
}

/// Activation rows per tile call (the kernels take up to eight rows at once, Q6_K all eight in one
/// pass over the weights, the others in runs of at most four).
const TILE: usize = 8;

/// out (n × rows) = x (n × cols) · Wᵀ. With `invariant`, every row is computed as a one-row call
/// would compute it (no GEMM flavours), so results do not depend on `n`.
pub fn matmul(pool: &ThreadPool, w: &CpuWeight, x: &CpuAct, out: &mut CpuAct, invariant: bool) {
    matmul_many(pool, x, &mut [(w, out)], &[None], invariant);
}

/// Several matmuls of the same input, `out_i = x · W_iᵀ`, each computed exactly as [`matmul`]
/// computes it alone. What is shared: the activations are quantized once when every weight takes
/// the same activation format, and a one-row call (decode) runs all the weights' rows in one
/// parallel region instead of one region per weight (the small K and V projections cost less
/// than the dispatch otherwise).
pub fn matmul_many(
    pool: &ThreadPool,
    x: &CpuAct,
    jobs: &mut [(&CpuWeight, &mut CpuAct)],
    biases: &[Option<&[f32]>],
    invariant: bool,
) {
    let n = x.rows;
    for (w, out) in jobs.iter() {
        assert_eq!(x.cols, w.cols, "matmul input width");
        assert_eq!((out.rows, out.cols), (n, w.rows), "matmul output shape");
    }
    let Some((first, _)) = jobs.first() else {
        return;
    };
    let act_ty = crate::quant::vec_dot_type(first.ty);
    if jobs[1..]
        .iter()
        .any(|(w, _)| crate::quant::vec_dot_type(w.ty) != act_ty)
    {
        for ((w, out), b) in jobs.iter_mut().zip(biases) {
            matmul_many(pool, x, &mut [(*w, &mut **out)], &[*b], invariant);
        }
        return;
    }
    let a_bytes = crate::quant::activation_row_bytes(act_ty, x.cols)
        .expect("activation row fits the block size");
    XQ.with_borrow_mut(|xq| {
        quantize_rows(pool, first.ty, x, a_bytes, xq);
        if n == 1 {
            decode_many(pool, jobs, biases, xq);
            return;
        }
        for (w, out) in jobs.iter_mut() {
            matmul_quantized(pool, w, xq, a_bytes, n, out, invariant);
        }
        for ((w, out), b) in jobs.iter_mut().zip(biases) {
            if let Some(b) = b {
                for row in out.data.chunks_exact_mut(w.rows) {
                    row.iter_mut().zip(b.iter()).for_each(|(o, b)| *o += b);
                }
            }
        }
    });
}

/// The body of [`matmul`] once the `n` activation rows are quantized into `xq`.
fn matmul_quantized(
    pool: &ThreadPool,
    w: &CpuWeight,
    xq: &[u8],
    a_bytes: usize,
    n: usize,
    out: &mut CpuAct,
    invariant: bool,
) {
    let (rows, cols) = (w.rows, w.cols);
    if let Some(packed) = w.packed_q4k(pool) {
        let gemm = !invariant;
        crate::kernels::cpu::layouts::q4_k_x8::matmul(
            pool,
            packed,
            rows,
            cols,
            xq,
            n,
            gemm,
            &mut out.data,
        );
    } else if let Some((packed, mm)) = x16_blocks32(pool, w).filter(|_| n < q8_0_panels::MIN_ROWS) {
        // Below the GEMM's rows llama.cpp takes the per-row kernels, which the x16 copies'
        // kernels reproduce bit for bit: from that copy, in one pass for up to four rows.
        mm(pool, cols, packed, xq, n, &mut out.data);
    } else if q8_0_panels::applies(w.ty, cols, n) {
        let done = q8_0_panels::matmul(pool, w.ty, w.bytes(), rows, cols, xq, n, &mut out.data);
        matmul_rows(pool, w, xq, a_bytes, n, done, out, false);
    } else if let Some(packed) = w
        .packed_q6k(pool)
        .filter(|_| (invariant || n < TILE) && w.q6k_layout() == Layout::X16)
    {
        // Below the GEMM's eight rows (and in the row-invariant verify) llama.cpp takes
        // `ggml_vec_dot_q6_K_q8_K` per row, which the x16 kernel reproduces bit for bit, from
        // the packed copy on huge pages in one pass for up to four rows.
        crate::kernels::cpu::layouts::q6_k_x16::matmul(
            pool,
            packed,
            rows,
            cols,
            xq,
            n,
            &mut out.data,
        );
    } else if !invariant && w.ty == GgmlType::Q6K && q6_k_panels::applies(rows, cols, n) {
        // From the packed copy where there is one (huge pages; the file's pages are released).
        let (src, layout) = w
            .packed_q6k(pool)
            .map_or((w.bytes(), Layout::File), |p| (p, w.q6k_layout()));
        let done = q6_k_panels::matmul(pool, src, layout, rows, cols, xq, n, &mut out.data);
        matmul_rows(pool, w, xq, a_bytes, n, done, out, false);
        if done < rows {
            w.release_file_pages();
        }
    } else {
        matmul_rows(pool, w, xq, a_bytes, n, 0, out, invariant);
        w.release_file_pages();
    }
}

/// The x16 copy of a Q8_0 or Q5_0 matrix (packing it on first use) and its multi-row matmul.
#[cfg(target_arch = "x86_64")]
fn x16_blocks32<'a>(pool: &ThreadPool, w: &'a CpuWeight) -> Option<(&'a [u8], Blocks32Matmul)> {
    match w.ty {
        GgmlType::Q8_0 => w
            .packed_q8_0(pool)
            .map(|p| (p, q8_0_x16::matmul as Blocks32Matmul)),
        GgmlType::Q5_0 => w
            .packed_q5_0(pool)
            .map(|p| (p, q5_0_x16::matmul as Blocks32Matmul)),
        _ => None,
    }
}

/// No x16 copies off x86-64.
#[cfg(not(target_arch = "x86_64"))]
fn x16_blocks32<'a>(_: &ThreadPool, _: &'a CpuWeight) -> Option<(&'a [u8], Blocks32Matmul)> {
    None
}

thread_local! {
    /// The quantized activations of the current matmul, reused across calls (allocating them each
    /// time costs page faults on every prefill matmul).
    pub(super) static XQ: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Quantizes the `x.rows` activation rows for weight type `ty` into `xq` (`a_bytes` each), rows
/// split across the pool.
pub(super) fn quantize_rows(
    pool: &ThreadPool,
    ty: GgmlType,
    x: &CpuAct,
    a_bytes: usize,
    xq: &mut Vec<u8>,
) {
    let n = x.rows;
    xq.resize(n * a_bytes, 0);
    let dst = SharedMut(xq.as_mut_ptr());
    let min_rows = if x.cols >= 4096 { 1 } else { 4 };
    // The AVX-512 quantizers (bit-identical to the scalar `X86Avx` ones) where there is one.
    #[cfg(target_arch = "x86_64")]
    if simd::current() >= simd::Level::Avx512 {
        use simd::avx512::quantize::{quantize_row_q8_0, quantize_row_q8k};
        type Quantize = fn(&[f32], &mut [u8]);
        let quantize: Option<Quantize> = match crate::quant::vec_dot_type(ty) {
            GgmlType::Q8K => Some(quantize_row_q8k),
            GgmlType::Q8_0 => Some(quantize_row_q8_0),
            _ => None,
        };
        if let Some(quantize) = quantize {
            pool.for_range(n, min_rows, |range| {
                for t in range {
                    // SAFETY: row t's bytes `t * a_bytes .. (t + 1) * a_bytes` lie inside `xq`
                    // (t < n) and belong to this chunk only.
                    let o = unsafe {
                        std::slice::from_raw_parts_mut(dst.ptr().add(t * a_bytes), a_bytes)
                    };
                    quantize(x.row(t), o);
                }
            });
            return;
        }
    }
    thread_local! {
        /// One quantized row, reused: no allocation per call.
        static TMP: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    pool.for_range(n, min_rows, |range| {
        TMP.with_borrow_mut(|tmp| {
            for t in range {
                crate::quant::quantize_activations_as(ty, x.row(t), tmp, Q8Variant::X86Avx)
                    .expect("activation quantization for a supported type");
                // SAFETY: row t's bytes `t * a_bytes .. (t + 1) * a_bytes` lie inside `xq` (t < n)
                // and belong to this chunk only.
                unsafe {
                    std::ptr::copy_nonoverlapping(tmp.as_ptr(), dst.ptr().add(t * a_bytes), a_bytes)
                };
            }
        });
    });
}

/// The unpacked path: every weight row from `first_row` on against the activation rows in tiles
/// of four (`invariant`: no GEMM flavours, each row as a one-row call computes it).
#[allow(clippy::too_many_arguments)]
fn matmul_rows(
    pool: &ThreadPool,
    w: &CpuWeight,
    xq: &[u8],
    a_bytes: usize,
    n: usize,
    first_row: usize,
    out: &mut CpuAct,
    invariant: bool,
) {
    let (cols, rows) = (w.cols, w.rows);
    let kern = simd::kernels(w.ty)
        .or_else(|| simd::reference(w.ty))
        .expect("supported weight type has a dot product");
    // Non-repacked k-quants (Q6_K here) with 8+ activation rows go through ggml-cpu's tiled
    // matmul (`ggml_compute_forward_mul_mat_tiled`): one exact integer sum per block,
    // `acc = fma(d_w · isum, d_a, acc)`. (Repacked Q4_K never gets here: see `q4_k_x8`.)
    let tiled = w.ty == GgmlType::Q6K && n >= 8 && !invariant;
    let wb = w.bytes();
    let rb = w.row_bytes;
    let dst = SharedMut(out.data.as_mut_ptr());
    pool.for_range(rows - first_row, 16, |range| {
        let mut res = [0f32; TILE];
        for r in range.start + first_row..range.end + first_row {
            let wr = &wb[r * rb..(r + 1) * rb];
            for t0 in (0..n).step_by(TILE) {
                let m = (n - t0).min(TILE);
                let acts = &xq[t0 * a_bytes..(t0 + m) * a_bytes];
                if tiled {
                    q6k_tiled(cols, wr, acts, a_bytes, m, &mut res);
                } else {
                    (kern.tile)(cols, wr, acts, a_bytes, m, &mut res);
                }
                for (j, &v) in res[..m].iter().enumerate() {
                    // SAFETY: r < rows and t0 + j < n, so (t0 + j) * rows + r is inside out.data
                    // (n * rows); row r belongs to exactly one thread's range, so no two threads
                    // write the same element.
                    unsafe { *dst.ptr().add((t0 + j) * rows + r) = v };
                }
            }
        }
    });
}

/// One Q6_K weight row times `m` activation rows (`stride` bytes apart) in the arithmetic of
/// ggml-cpu's tiled k-quant matmul: per block the exact `isum = Σ sc·Σ (q-32)·a`,
/// `acc = fma(d_w·isum, d_a, acc)`.
fn q6k_tiled(n: usize, w: &[u8], acts: &[u8], stride: usize, m: usize, out: &mut [f32]) {
    use crate::quant::blocks::{Block, BlockQ6K, BlockQ8K};
    let nb = n / 256;
    assert!(
        n.is_multiple_of(256) && w.len() == nb * BlockQ6K::BYTES,
        "weight row length"
    );
    assert!(m == 0 || acts.len() >= (m - 1) * stride + nb * BlockQ8K::BYTES);
    assert!(m <= TILE && out.len() >= m, "at most TILE rows per call");
    for (j, o) in out[..m].iter_mut().enumerate() {
        #[cfg(target_arch = "x86_64")]
        if simd::current() != simd::Level::Scalar {
            // SAFETY: a non-scalar level is only selected after AVX2, FMA and F16C were detected;
            // `w` holds exactly `nb` weight blocks and activation row j `nb` Q8_K blocks
            // (asserted above), which is all the kernel reads.
            *o = unsafe { x86::q6k_tiled(nb, w.as_ptr(), acts.as_ptr().add(j * stride)) };
            continue;
        }
        *o = q6k_tiled_scalar(nb, w, &acts[j * stride..j * stride + nb * BlockQ8K::BYTES]);
    }
}

/// [`q6k_tiled`] for one activation row, scalar (the AVX2 kernel's twin).
pub(crate) fn q6k_tiled_scalar(nb: usize, w: &[u8], a: &[u8]) -> f32 {
    use crate::quant::blocks::{Block, BlockQ6K, BlockQ8K};
    let mut acc = 0f32;
    for b in 0..nb {
        let x = &w[b * BlockQ6K::BYTES..(b + 1) * BlockQ6K::BYTES];
        let y = &a[b * BlockQ8K::BYTES..(b + 1) * BlockQ8K::BYTES];
        let dw = half::f16::from_le_bytes([x[208], x[209]]).to_f32();
        let ad = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        let mut isum = 0i32;
        for half_ in 0..2 {
            let (ql, qh) = (&x[64 * half_..], &x[128 + 32 * half_..]);
            for l in 0..32 {
                let q = [
                    (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                    (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                    (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                    (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
                ];
                for (k, &qk) in q.iter().enumerate() {
                    let e = 128 * half_ + 32 * k + l;
                    let sc = x[192 + e / 16] as i8 as i32;
                    isum += sc * (qk as i32 - 32) * y[4 + e] as i8 as i32;
                }
            }
        }
        acc = (dw * isum as f32).mul_add(ad, acc);
    }
    acc
}

/// The AVX2 tiled Q6_K kernel (integer parts as ggml's AVX2 kernels, exact).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn f16_at(p: *const u8) -> f32 {
        let h = p.cast::<u16>().read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        _mm_cvtsi128_si32(s)
    }

    /// [`super::q6k_tiled`] for one activation row.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; `w` points at `nb` Q6_K blocks and `a` at `nb` Q8_K.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn q6k_tiled(nb: usize, w: *const u8, a: *const u8) -> f32 {
        let mut acc = 0f32;
        for b in 0..nb {
            let x = w.add(b * 210);
            let y = a.add(b * 292);
            // The exact integer lanes of ggml's Q6_K dot (values offset by 32 already taken off).
            let [lanes] = crate::kernels::cpu::simd::avx2::kquants::q6k_block_isums::<1>(x, y, 0);
            let isum = hsum_i32(lanes);
            let ad = y.cast::<f32>().read_unaligned();
            acc = (f16_at(x.add(208)) * isum as f32).mul_add(ad, acc);
        }
        acc
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::{quantize_activations, quantize_row};

    use crate::kernels::cpu::test_floats as data;

    /// A CPU backend and `(type, rows)` weights of `cols` columns, each row quantized from its own
    /// test floats, loaded as the model loader loads them (packed copies included).
    pub(crate) fn test_weights(
        specs: &[(GgmlType, usize)],
        cols: usize,
    ) -> (crate::kernels::cpu::backend::CpuBackend, Vec<CpuWeight>) {
        let be = crate::kernels::cpu::backend::CpuBackend::new(2);
        let ws = test_weights_on(&be, specs, cols);
        (be, ws)
    }

    /// [`test_weights`] loaded by any backend.
    pub(crate) fn test_weights_on<B: crate::model::backend::Backend>(
        be: &B,
        specs: &[(GgmlType, usize)],
        cols: usize,
    ) -> Vec<B::Weight> {
        use crate::format::{writer::GgufWriter, Gguf};
        use crate::model::backend::WeightSource;
        use std::sync::Arc;
        let mut wr = GgufWriter::new();
        for (i, &(ty, rows)) in specs.iter().enumerate() {
            let mut bytes = Vec::new();
            for r in 0..rows {
                let mut row = Vec::new();
                quantize_row(ty, &data(cols, 100 + (i * 31 + r) as u32), &mut row).unwrap();
                bytes.extend(row);
            }
            wr.add_tensor(&format!("w{i}"), &[cols as u64, rows as u64], ty, bytes)
                .unwrap();
        }
        let g = Arc::new(Gguf::from_bytes(wr.to_bytes()).unwrap());
        specs
            .iter()
            .enumerate()
            .map(|(i, &(ty, rows))| {
                let t = &g.tensors[i];
                be.load_weight(&WeightSource {
                    file: &g,
                    index: i,
                    name: &t.name,
                    ty,
                    rows,
                    cols,
                    bytes: g.tensor_data(t),
                })
                .unwrap()
            })
            .collect()
    }

    pub(crate) fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// `matmul_many` gives each job exactly what a `matmul` of its own gives, plus its bias, for
    /// one activation row (the merged decode region, which adds the biases) and several, with one
    /// shared quantization and without (a job whose weight takes another activation format).
    #[test]
    fn matmul_many_equals_single_matmuls() {
        use crate::model::backend::Backend;
        let cols = 512;
        let specs = [
            (GgmlType::Q4K, 24),  // x8-packed
            (GgmlType::Q6K, 13),  // dot_rows, a ragged last unit
            (GgmlType::Q8_0, 9),  // the plain copy
            (GgmlType::Q8_0, 32), // x16-packed at the AVX-512 level
            (GgmlType::Q4_0, 5),  // tile kernel
            (GgmlType::F16, 3),   // its own activation format
        ];
        let (be, ws) = test_weights(&specs, cols);
        let biases: Vec<Vec<f32>> = ws
            .iter()
            .enumerate()
            .map(|(i, w)| data(w.rows, 900 + i as u32))
            .collect();
        for n in [1, 3, 17] {
            let mut x = be.act(n, cols);
            x.data.copy_from_slice(&data(n * cols, 7 + n as u32));
            let single: Vec<Vec<f32>> = ws
                .iter()
                .map(|w| {
                    let mut o = be.act(n, w.rows);
                    be.matmul(w, &x, None, &mut o);
                    o.data
                })
                .collect();
            // Every output element is written, whatever the buffer held before (logits rows are
            // recycled through `act_for_overwrite`).
            for (w, want) in ws.iter().zip(&single) {
                let mut o = be.act(n, w.rows);
                o.data.fill(f32::NAN);
                be.matmul(w, &x, None, &mut o);
                assert!(
                    same_bits(&o.data, want),
                    "n={n} {:?}: an output left unwritten",
                    w.ty
                );
            }
            // all but the F16 weight share one quantization; then every job together; odd jobs
            // with a bias
            for take in [specs.len() - 1, specs.len()] {
                let mut outs: Vec<_> = ws[..take].iter().map(|w| be.act(n, w.rows)).collect();
                let mut jobs: Vec<_> = ws[..take]
                    .iter()
                    .zip(outs.iter_mut())
                    .enumerate()
                    .map(|(i, (w, o))| (w, (i % 2 == 1).then_some(&biases[i]), o))
                    .collect();
                be.matmul_many(&x, &mut jobs);
                for (i, o) in outs.iter().enumerate() {
                    let mut want = single[i].clone();
                    if i % 2 == 1 {
                        let rows = ws[i].rows;
                        want.iter_mut()
                            .enumerate()
                            .for_each(|(j, v)| *v += biases[i][j % rows]);
                    }
                    assert!(
                        same_bits(&o.data, &want),
                        "n={n} job {i} ({:?}) of {take}",
                        specs[i].0
                    );
                }
            }
        }
    }

    /// A decode region whose units are claimed in chunks, and taken from the end of the other
    /// thread's range when one runs out, gives every row what a `matmul` of its own gives (plus
    /// its bias), whichever thread computed which chunk.
    #[test]
    fn flavors_simd_equal_scalar() {
        let n = 1024;
        let x = data(n, 7);
        let mut act = Vec::new();
        quantize_activations(GgmlType::Q4K, &x, &mut act).unwrap();
        // The Q6_K tiled matmul, and the Q4_K GEMM flavour (now only behind `q4_k_x8`, whose
        // unpacked form is `simd::q4k_gemm_kernels`).
        type Tile = fn(usize, &[u8], &[u8], usize, usize, &mut [f32]);
        let q4k_gemm: Tile = simd::q4k_gemm_kernels().tile;
        let q6k: Tile = q6k_tiled;
        type Twin = fn(usize, &[u8], &[u8]) -> f32;
        let twins: [(GgmlType, Tile, Twin); 2] = [
            (GgmlType::Q4K, q4k_gemm, |nb, w, a| {
                simd::q4_k_gemm::dot(nb * 256, w, a)
            }),
            (GgmlType::Q6K, q6k, q6k_tiled_scalar),
        ];
        for (ty, tile, twin) in twins {
            let mut w = Vec::new();
            quantize_row(ty, &data(n, 11), &mut w).unwrap();
            // Three activation rows in one call give the same result per row.
            let acts = [act.clone(), act.clone(), act.clone()].concat();
            let mut three = [0f32; 3];
            tile(n, &w, &acts, act.len(), 3, &mut three);
            let mut out = [0f32; 1];
            tile(n, &w, &act, act.len(), 1, &mut out);
            assert!(
                three.iter().all(|v| v.to_bits() == out[0].to_bits()),
                "{ty:?}"
            );
            let want = twin(n / 256, &w, &act);
            assert_eq!(out[0].to_bits(), want.to_bits(), "{ty:?}");
            // and close to the reference dot
            let r = crate::quant::vec_dot(ty, n, &w, &act);
            assert!(
                (out[0] - r).abs() <= 1e-3 * r.abs().max(1.0),
                "{ty:?} {} {r}",
                out[0]
            );
        }
    }
}
