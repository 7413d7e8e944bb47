//! Attention over a quantized KV cache (`--cache-type-k` / `--cache-type-v` `q8_0` or `q4_0`,
//! llama.cpp's names and ggml's block layouts): keys and values are stored as `block_q8_0` (an
//! f16 scale and 32 signed bytes) or `block_q4_0` (an f16 scale and 32 nibbles offset by 8), or
//! f16 where only the other one is quantized, and attention reads those blocks in place; no
//! dequantized copy of the cache is ever made.
//!
//! - **K**: each query head's row is quantized once per call to Q8_0 (ggml's reference rounding),
//!   and a score is the integer dot product of the two rows' blocks, scaled by the product of
//!   their block scales: per block, eight exact 32-bit partial sums (bytes `4l..4l + 4` for lane
//!   `l`, as AVX2's `vpmaddubsw` + `vpmaddwd` leave them), each multiply-added in f32 into lane
//!   `l` of an accumulator, whose lanes are summed in ggml's `hsum_float_8` order.
//! - **Softmax**: two passes over the scores of one (query row, head): the maximum, then
//!   `exp(s - max)` summed in f32 in position order.
//! - **V**: the weighted sum is accumulated in f32 straight from the blocks: per block, the
//!   weight times the block scale once, then one multiply-add per value.
//!
//! Every kernel has an AVX2 version and a scalar twin with the same arithmetic; the tests hold
//! them equal bit for bit and hold the whole attention to an f64 softmax over the dequantized
//! cache. The arithmetic of a row does not depend on the batch (one kernel for prefill and decode),
//! so the backend's row-invariant mode holds without a special path. A unit of work is one query
//! row and a part of a GQA group (the heads that share a KV head), so each thread reads a key or
//! value row once for the part's heads.

use half::f16;

use crate::kernels::cpu::backend::CpuAct;
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::kernels::cpu::SharedMut;
use crate::model::backend::{AttnQuery, AttnShape, CacheType};
use crate::quant::dequantize_row;
use crate::quant::quantize::{quantize_row_f16, quantize_row_q4_0, quantize_row_q8_0};

/// Values per quantized block.
pub const QK: usize = 32;
/// Bytes of a query head's Q8_0 block.
const Q8_BYTES: usize = 34;
/// Most query heads one unit runs (a GQA group is cut into parts of at most this many).
const MAX_HEADS: usize = 8;

/// The K/V storage: per layer, `slots` rows of `kv_dim` values for K and V, each in its type.
pub struct KvQuant {
    pub k_type: CacheType,
    pub v_type: CacheType,
    pub kv_dim: usize,
    /// Bytes of one slot's K row and V row.
    pub k_row: usize,
    pub v_row: usize,
    pub k: Vec<Vec<u8>>, // (n_layer, slots * k_row)
    pub v: Vec<Vec<u8>>, // (n_layer, slots * v_row)
}

impl KvQuant {
    /// Zeroed storage for `slots` positions per layer (`kv_dim` a multiple of 32).
    pub fn new(
        n_layer: usize,
        slots: usize,
        kv_dim: usize,
        k_type: CacheType,
        v_type: CacheType,
    ) -> anyhow::Result<KvQuant> {
        anyhow::ensure!(
            kv_dim.is_multiple_of(QK),
            "a quantized KV cache needs rows of whole 32-value blocks, not {kv_dim}"
        );
        let (k_row, v_row) = (k_type.row_bytes(kv_dim), v_type.row_bytes(kv_dim));
        let plane = |row: usize| {
            slots
                .checked_mul(row)
                .ok_or_else(|| anyhow::anyhow!("KV cache size overflows"))
        };
        let (kb, vb) = (plane(k_row)?, plane(v_row)?);
        Ok(KvQuant {
            k_type,
            v_type,
            kv_dim,
            k_row,
            v_row,
            k: (0..n_layer).map(|_| vec![0u8; kb]).collect(),
            v: (0..n_layer).map(|_| vec![0u8; vb]).collect(),
        })
    }

    pub fn layers(&self) -> usize {
        self.k.len()
    }

    /// Copies `n` slots from slot `from` to slot `to` in every layer's K and V.
    pub fn copy(&mut self, from: usize, to: usize, n: usize) {
        for (plane, row) in self
            .k
            .iter_mut()
            .map(|p| (p, self.k_row))
            .chain(self.v.iter_mut().map(|p| (p, self.v_row)))
        {
            plane.copy_within(from * row..(from + n) * row, to * row);
        }
    }

    /// Quantizes row i of `k` and `v` into slot `slots[i]` of `layer`.
    pub fn write(&mut self, layer: usize, k: &CpuAct, v: &CpuAct, slots: &[usize]) {
        let (kr, vr) = (self.k_row, self.v_row);
        for (i, &slot) in slots.iter().enumerate() {
            store(
                self.k_type,
                k.row(i),
                &mut self.k[layer][slot * kr..(slot + 1) * kr],
            );
            store(
                self.v_type,
                v.row(i),
                &mut self.v[layer][slot * vr..(slot + 1) * vr],
            );
        }
    }

    /// The K row of `slot` in `layer`, dequantized.
    pub fn key(&self, layer: usize, slot: usize, out: &mut [f32]) {
        let r = slot * self.k_row..(slot + 1) * self.k_row;
        dequantize_row(self.k_type.ggml(), &self.k[layer][r], out).expect("whole blocks");
    }

    /// The V row of `slot` in `layer`, dequantized.
    pub fn value(&self, layer: usize, slot: usize, out: &mut [f32]) {
        let r = slot * self.v_row..(slot + 1) * self.v_row;
        dequantize_row(self.v_type.ggml(), &self.v[layer][r], out).expect("whole blocks");
    }

    /// Overwrites the K row of `slot` in `layer` with `row`, quantized.
    pub fn set_key(&mut self, layer: usize, slot: usize, row: &[f32]) {
        let r = slot * self.k_row..(slot + 1) * self.k_row;
        store(self.k_type, row, &mut self.k[layer][r]);
    }
}

/// `src` in `ty`'s bytes (`dst` exactly as long), with ggml's reference quantizers.
fn store(ty: CacheType, src: &[f32], dst: &mut [u8]) {
    match ty {
        CacheType::F16 => quantize_row_f16(src, dst),
        CacheType::Q8_0 => quantize_row_q8_0(src, dst),
        CacheType::Q4_0 => quantize_row_q4_0(src, dst),
    }
}

/// Which implementation the kernels run: the scalar twins, or AVX2 (tests pick both).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
}

impl Isa {
    /// AVX2 where this process's SIMD level allows it (`INFER_SIMD`), else scalar.
    pub fn current() -> Isa {
        use crate::kernels::cpu::simd::{current, Level};
        if cfg!(target_arch = "x86_64") && current() >= Level::Avx2 {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// ggml's `hsum_float_8`: `((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7))`.
#[inline(always)]
fn hsum8(x: &[f32; 8]) -> f32 {
    let w: [f32; 4] = std::array::from_fn(|i| x[i + 4] + x[i]);
    (w[0] + w[2]) + (w[1] + w[3])
}

/// One 32-value block of a key row as signed bytes (Q8_0 as stored, Q4_0's nibbles minus 8:
/// low nibbles are values 0..16, high nibbles 16..32).
#[inline(always)]
fn key_bytes(ty: CacheType, blk: &[u8]) -> [i8; 32] {
    match ty {
        CacheType::Q4_0 => std::array::from_fn(|i| {
            let b = blk[2 + i % 16];
            (if i < 16 { b & 0x0F } else { b >> 4 }) as i8 - 8
        }),
        _ => std::array::from_fn(|i| blk[2 + i] as i8),
    }
}

/// Score of one key head row `k` (`nb` blocks of `ty`, Q8_0 or Q4_0) with a Q8_0 query row `q`:
/// the scalar twin of [`key_dot_avx2`] (see the module's K paragraph), bit for bit.
pub fn key_dot_scalar(ty: CacheType, nb: usize, k: &[u8], q: &[u8]) -> f32 {
    let kb = ty.row_bytes(QK);
    let mut acc = [0f32; 8];
    for b in 0..nb {
        let (kblk, qblk) = (
            &k[b * kb..(b + 1) * kb],
            &q[b * Q8_BYTES..(b + 1) * Q8_BYTES],
        );
        let d = f16_at(kblk, 0) * f16_at(qblk, 0);
        let kv = key_bytes(ty, kblk);
        for (l, a) in acc.iter_mut().enumerate() {
            let s: i32 = (4 * l..4 * l + 4)
                .map(|i| kv[i] as i32 * qblk[2 + i] as i8 as i32)
                .sum();
            *a = d.mul_add(s as f32, *a);
        }
    }
    hsum8(&acc)
}

/// [`key_dot_scalar`] with AVX2 (`vpsignb`/`vpmaddubsw`/`vpmaddwd` give each lane's exact sum).
///
/// # Safety
/// AVX2, FMA and F16C are available; `k` holds `nb` blocks of `ty` and `q` `nb` Q8_0 blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn key_dot_avx2(ty: CacheType, nb: usize, k: &[u8], q: &[u8]) -> f32 {
    use std::arch::x86_64::*;
    let kb = ty.row_bytes(QK);
    assert!(k.len() >= nb * kb && q.len() >= nb * Q8_BYTES && ty.is_quantized());
    let (kp, qp) = (k.as_ptr(), q.as_ptr());
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let (kblk, qblk) = (kp.add(b * kb), qp.add(b * Q8_BYTES));
        let dk = f16::from_bits(u16::from_le_bytes([*kblk, *kblk.add(1)])).to_f32();
        let dq = f16::from_bits(u16::from_le_bytes([*qblk, *qblk.add(1)])).to_f32();
        let kv = match ty {
            CacheType::Q4_0 => {
                let x = _mm_loadu_si128(kblk.add(2).cast());
                let hi = _mm_srli_epi16(x, 4);
                let both = _mm256_and_si256(_mm256_set_m128i(hi, x), _mm256_set1_epi8(0x0F));
                _mm256_sub_epi8(both, _mm256_set1_epi8(8))
            }
            _ => _mm256_loadu_si256(kblk.add(2).cast()),
        };
        let qv = _mm256_loadu_si256(qblk.add(2).cast());
        let ax = _mm256_sign_epi8(kv, kv);
        let sy = _mm256_sign_epi8(qv, kv);
        let lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), ones);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(dk * dq), _mm256_cvtepi32_ps(lanes), acc);
    }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), acc);
    hsum8(&out)
}

/// The value of element `i` of a V block of `ty` (F16 "blocks" are 32 plain values, scale 1).
#[inline(always)]
fn value_at(ty: CacheType, blk: &[u8], i: usize) -> f32 {
    match ty {
        CacheType::F16 => f16_at(blk, 2 * i),
        CacheType::Q8_0 => blk[2 + i] as i8 as f32,
        CacheType::Q4_0 => {
            let b = blk[2 + i % 16];
            ((if i < 16 { b & 0x0F } else { b >> 4 }) as i32 - 8) as f32
        }
    }
}

/// The scale of a V block of `ty` (1 for f16).
#[inline(always)]
fn value_scale(ty: CacheType, blk: &[u8]) -> f32 {
    match ty {
        CacheType::F16 => 1.0,
        _ => f16_at(blk, 0),
    }
}

/// `acc[j * hd + e] += w[j] * v[e]` for each head `j < w.len()` and each value `e` of one V head
/// row `v` (`hd / 32` blocks of `ty`): per block `c = w[j] * scale`, then `acc = fma(value, c,
/// acc)`. The scalar twin of [`accumulate_v_avx2`].
pub fn accumulate_v_scalar(ty: CacheType, hd: usize, v: &[u8], w: &[f32], acc: &mut [f32]) {
    let bb = ty.row_bytes(QK);
    for b in 0..hd / QK {
        let blk = &v[b * bb..(b + 1) * bb];
        let d = value_scale(ty, blk);
        let vals: [f32; QK] = std::array::from_fn(|i| value_at(ty, blk, i));
        for (j, &wj) in w.iter().enumerate() {
            let c = wj * d;
            let a = &mut acc[j * hd + b * QK..j * hd + (b + 1) * QK];
            for (a, &x) in a.iter_mut().zip(&vals) {
                *a = x.mul_add(c, *a);
            }
        }
    }
}

/// [`accumulate_v_scalar`] with AVX2: each block widened to four f32 vectors once for all heads.
///
/// # Safety
/// AVX2, FMA and F16C are available; `v` holds `hd / 32` blocks of `ty`; `acc` holds
/// `w.len() * hd` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn accumulate_v_avx2(ty: CacheType, hd: usize, v: &[u8], w: &[f32], acc: &mut [f32]) {
    use std::arch::x86_64::*;
    let bb = ty.row_bytes(QK);
    let nb = hd / QK;
    assert!(v.len() >= nb * bb && acc.len() >= w.len() * hd);
    let (vp, ap) = (v.as_ptr(), acc.as_mut_ptr());
    for b in 0..nb {
        let blk = vp.add(b * bb);
        let (d, x): (f32, [__m256; 4]) = match ty {
            CacheType::F16 => (
                1.0,
                std::array::from_fn(|i| _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * i).cast()))),
            ),
            CacheType::Q8_0 => {
                let d = f16::from_bits(u16::from_le_bytes([*blk, *blk.add(1)])).to_f32();
                let x = std::array::from_fn(|i| {
                    let q = _mm_loadl_epi64(blk.add(2 + 8 * i).cast());
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))
                });
                (d, x)
            }
            CacheType::Q4_0 => {
                let d = f16::from_bits(u16::from_le_bytes([*blk, *blk.add(1)])).to_f32();
                let raw = _mm_loadu_si128(blk.add(2).cast());
                let m = _mm_set1_epi8(0x0F);
                let eight = _mm_set1_epi8(8);
                let lo = _mm_sub_epi8(_mm_and_si128(raw, m), eight);
                let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), m), eight);
                let x = [
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)),
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))),
                ];
                (d, x)
            }
        };
        for (j, &wj) in w.iter().enumerate() {
            let c = _mm256_set1_ps(wj * d);
            let a = ap.add(j * hd + b * QK);
            for (i, &xi) in x.iter().enumerate() {
                let p = a.add(8 * i);
                _mm256_storeu_ps(p, _mm256_fmadd_ps(xi, c, _mm256_loadu_ps(p)));
            }
        }
    }
}

/// The score of one key head row (f16 or quantized) with query head `j`: `q8` is the query's Q8_0
/// row (quantized keys), `qf` its f32 row (f16 keys).
#[inline(always)]
fn key_score(isa: Isa, ty: CacheType, hd: usize, k: &[u8], q8: &[u8], qf: &[f32]) -> f32 {
    match ty {
        CacheType::F16 => {
            let mut acc = [0f32; 8];
            for (kc, qc) in k.chunks_exact(16).zip(qf.chunks_exact(8)) {
                for l in 0..8 {
                    acc[l] = f16_at(kc, 2 * l).mul_add(qc[l], acc[l]);
                }
            }
            hsum8(&acc)
        }
        _ => match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx2` is only chosen where AVX2, FMA and F16C were detected; the
            // rows hold `hd / 32` blocks (sliced by the caller).
            Isa::Avx2 => unsafe { key_dot_avx2(ty, hd / QK, k, q8) },
            _ => key_dot_scalar(ty, hd / QK, k, q8),
        },
    }
}

#[inline(always)]
fn accumulate_v(isa: Isa, ty: CacheType, hd: usize, v: &[u8], w: &[f32], acc: &mut [f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only chosen where AVX2, FMA and F16C were detected; `v` is one
        // head row and `acc` holds `w.len()` heads (the caller's buffers).
        Isa::Avx2 => unsafe { accumulate_v_avx2(ty, hd, v, w, acc) },
        _ => accumulate_v_scalar(ty, hd, v, w, acc),
    }
}

/// Per-thread buffers of one unit.
#[derive(Default)]
struct Scratch {
    /// The unit's query heads quantized to Q8_0, one row after another.
    q8: Vec<u8>,
    /// Scores, then softmax weights: `[head][position]`.
    s: Vec<f32>,
    /// The V accumulators `[head][hd]`.
    acc: Vec<f32>,
    /// One position's weights, one per head.
    w: Vec<f32>,
}

/// Causal attention of each query row of `q` (rows × n_head·head_dim) over the cached keys and
/// values of `layer`, written to `out` (same shape), with the kernels `isa` selects.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    q: &CpuAct,
    kv: &KvQuant,
    layer: usize,
    block_size: usize,
    queries: &[AttnQuery<'_>],
    shape: AttnShape,
    out: &mut CpuAct,
    isa: Isa,
) {
    let hd = shape.head_dim;
    assert!(hd.is_multiple_of(QK), "head width {hd} is not whole blocks");
    let group = shape.n_head / shape.n_head_kv;
    // Cut each GQA group into parts so there are work units for every thread.
    let units_wanted = 2 * pool.n_threads();
    let base_units = (queries.len() * shape.n_head_kv).max(1);
    let parts = units_wanted
        .div_ceil(base_units)
        .max(group.div_ceil(MAX_HEADS))
        .min(group);
    let per_part = group.div_ceil(parts);
    let parts = group.div_ceil(per_part);
    let units = queries.len() * shape.n_head_kv * parts;
    let (kp, vp) = (&kv.k[layer][..], &kv.v[layer][..]);
    let (kb, vb) = (kv.k_type.row_bytes(hd), kv.v_type.row_bytes(hd));
    let out_cols = out.cols;
    let dst = SharedMut(out.data.as_mut_ptr());
    pool.for_range(units, 1, |range| {
        let mut s = Scratch::default();
        for unit in range {
            let i = unit / (shape.n_head_kv * parts);
            let g = unit / parts % shape.n_head_kv;
            let part = unit % parts;
            let h0 = g * group + part * per_part;
            let h1 = (h0 + per_part).min((g + 1) * group);
            let nh = h1 - h0;
            let qa = &queries[i];
            let (lo, pos) = (qa.lo as usize, qa.pos as usize);
            let n = pos + 1 - lo;
            let qrow = q.row(i);
            let qh = |j: usize| &qrow[(h0 + j) * hd..(h0 + j + 1) * hd];
            if kv.k_type.is_quantized() {
                s.q8.resize(nh * hd / QK * Q8_BYTES, 0);
                for (j, dst) in s.q8.chunks_exact_mut(hd / QK * Q8_BYTES).enumerate() {
                    quantize_row_q8_0(qh(j), dst);
                }
            }
            let slot =
                |p: usize| qa.block_table[p / block_size] as usize * block_size + p % block_size;
            s.s.resize(nh * n, 0.0);
            for p in lo..=pos {
                let sl = slot(p);
                let k = &kp[sl * kv.k_row + g * kb..][..kb];
                for j in 0..nh {
                    let q8 = s.q8.get(j * hd / QK * Q8_BYTES..).unwrap_or(&[]);
                    s.s[j * n + p - lo] = key_score(isa, kv.k_type, hd, k, q8, qh(j)) * shape.scale;
                }
            }
            let mut sums = [0f32; MAX_HEADS];
            for (j, row) in s.s.chunks_exact_mut(n).enumerate() {
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for x in row.iter_mut() {
                    *x = (*x - m).exp();
                    sum += *x;
                }
                sums[j] = sum;
            }
            s.acc.clear();
            s.acc.resize(nh * hd, 0.0);
            s.w.resize(nh, 0.0);
            for p in lo..=pos {
                let sl = slot(p);
                let v = &vp[sl * kv.v_row + g * vb..][..vb];
                for j in 0..nh {
                    s.w[j] = s.s[j * n + p - lo];
                }
                accumulate_v(isa, kv.v_type, hd, v, &s.w, &mut s.acc);
            }
            for j in 0..nh {
                let inv = if sums[j] == 0.0 { 0.0 } else { 1.0 / sums[j] };
                // SAFETY: i < out.rows and h0 + j < n_head, so the slice lies inside `out`; each
                // (row, head) belongs to exactly one unit, run once, so the slices written by the
                // pool's threads are disjoint, and the pool joins before `out` is read.
                let o = unsafe {
                    std::slice::from_raw_parts_mut(dst.ptr().add(i * out_cols + (h0 + j) * hd), hd)
                };
                for (o, &a) in o.iter_mut().zip(&s.acc[j * hd..(j + 1) * hd]) {
                    *o = a * inv;
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::test_floats;

    fn q8(x: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; x.len() / QK * Q8_BYTES];
        quantize_row_q8_0(x, &mut b);
        b
    }

    fn row(ty: CacheType, x: &[f32]) -> Vec<u8> {
        let mut b = vec![0u8; ty.row_bytes(x.len())];
        store(ty, x, &mut b);
        b
    }

    fn avx2() -> bool {
        Isa::current() == Isa::Avx2
    }

    /// The scalar K kernel is the quantized rows' exact dot product up to f32 rounding (checked
    /// against ggml's reference `vec_dot` and an f64 sum of the dequantized values).
    #[test]
    fn key_dot_matches_the_reference_dot() {
        for ty in [CacheType::Q8_0, CacheType::Q4_0] {
            for (seed, nb) in [(1u32, 1usize), (2, 2), (3, 4), (4, 8)] {
                let n = nb * QK;
                let k = row(ty, &test_floats(n, seed));
                let q = q8(&test_floats(n, seed + 100));
                let got = key_dot_scalar(ty, nb, &k, &q);
                let want = crate::quant::vec_dot(ty.ggml(), n, &k, &q);
                let (mut kd, mut qd) = (vec![0f32; n], vec![0f32; n]);
                dequantize_row(ty.ggml(), &k, &mut kd).unwrap();
                dequantize_row(crate::format::GgmlType::Q8_0, &q, &mut qd).unwrap();
                let exact: f64 = kd.iter().zip(&qd).map(|(&a, &b)| a as f64 * b as f64).sum();
                let mag: f64 = kd
                    .iter()
                    .zip(&qd)
                    .map(|(&a, &b)| (a * b).abs() as f64)
                    .sum();
                assert!(
                    (got as f64 - exact).abs() <= 1e-5 * mag,
                    "{ty:?} {nb}: {got} {exact}"
                );
                assert!(
                    (got - want).abs() as f64 <= 1e-5 * mag,
                    "{ty:?} {nb}: {got} {want}"
                );
            }
        }
    }

    #[test]
    fn avx2_kernels_equal_their_scalar_twins_bit_for_bit() {
        if !avx2() {
            eprintln!("skipped: no AVX2");
            return;
        }
        for ty in [CacheType::Q8_0, CacheType::Q4_0] {
            for nb in [1usize, 3, 4, 8] {
                let n = nb * QK;
                let k = row(ty, &test_floats(n, 7 + nb as u32));
                let q = q8(&test_floats(n, 70 + nb as u32));
                let s = key_dot_scalar(ty, nb, &k, &q);
                // SAFETY: AVX2 checked above; the rows hold nb blocks.
                let a = unsafe { key_dot_avx2(ty, nb, &k, &q) };
                assert_eq!(s.to_bits(), a.to_bits(), "{ty:?} K, {nb} blocks");
            }
        }
        for ty in CacheType::ALL {
            for (hd, heads) in [(32usize, 1usize), (64, 3), (128, 6), (256, 1)] {
                let v = row(ty, &test_floats(hd, 9 + hd as u32));
                let w = test_floats(heads, 5);
                let init = test_floats(heads * hd, 6);
                let (mut a, mut b) = (init.clone(), init);
                accumulate_v_scalar(ty, hd, &v, &w, &mut a);
                // SAFETY: AVX2 checked above; `v` is one head row, `b` holds `heads` rows.
                unsafe { accumulate_v_avx2(ty, hd, &v, &w, &mut b) };
                for (x, y) in a.iter().zip(&b) {
                    assert_eq!(x.to_bits(), y.to_bits(), "{ty:?} V, {hd} x {heads}");
                }
            }
        }
    }

    /// The whole attention, for every pair of types, both ISAs, ragged lengths and windows, GQA,
    /// scattered blocks: within a tolerance of an f64 softmax attention over the dequantized cache
    /// with an f64 query (so the only error is the query's Q8_0 rounding and f32 sums).
    #[test]
    fn attention_matches_an_f64_reference_over_the_dequantized_cache() {
        let pool = ThreadPool::new(2);
        let (bs, n_head, n_kv) = (16usize, 6usize, 2usize);
        for hd in [32usize, 128] {
            let kvd = n_kv * hd;
            let n_blocks = 12;
            let table: Vec<u32> = vec![3, 0, 7, 1, 11, 5, 2, 9, 4];
            for kt in CacheType::ALL {
                for vt in CacheType::ALL {
                    let mut kv = KvQuant::new(1, n_blocks * bs, kvd, kt, vt).unwrap();
                    let npos = table.len() * bs - 3;
                    let slot = |p: usize| table[p / bs] as usize * bs + p % bs;
                    let kact = CpuAct {
                        data: test_floats(npos * kvd, 21)
                            .iter()
                            .map(|x| x * 0.7)
                            .collect(),
                        rows: npos,
                        cols: kvd,
                    };
                    let vact = CpuAct {
                        data: test_floats(npos * kvd, 22),
                        rows: npos,
                        cols: kvd,
                    };
                    let slots: Vec<usize> = (0..npos).map(slot).collect();
                    kv.write(0, &kact, &vact, &slots);
                    // (lo, pos): one position, ragged lengths, a window, the last position
                    let cases = [
                        (0usize, 0usize),
                        (0, 1),
                        (0, 33),
                        (5, 47),
                        (40, 100),
                        (0, npos - 1),
                    ];
                    let q = CpuAct {
                        data: test_floats(cases.len() * n_head * hd, 23),
                        rows: cases.len(),
                        cols: n_head * hd,
                    };
                    let queries: Vec<AttnQuery<'_>> = cases
                        .iter()
                        .map(|&(lo, pos)| AttnQuery {
                            seq: 0,
                            block_table: &table,
                            pos: pos as u32,
                            lo: lo as u32,
                        })
                        .collect();
                    let shape = AttnShape {
                        n_head,
                        n_head_kv: n_kv,
                        head_dim: hd,
                        scale: 1.0 / (hd as f32).sqrt(),
                    };
                    let mut got = Vec::new();
                    for isa in [Isa::Scalar, Isa::Avx2] {
                        if isa == Isa::Avx2 && !avx2() {
                            continue;
                        }
                        let mut out = CpuAct {
                            data: vec![0.0; q.data.len()],
                            rows: q.rows,
                            cols: q.cols,
                        };
                        attention(&pool, &q, &kv, 0, bs, &queries, shape, &mut out, isa);
                        got.push(out.data);
                    }
                    if got.len() == 2 {
                        assert_eq!(got[0], got[1], "{kt:?}/{vt:?}: AVX2 and scalar differ");
                    }
                    let (mut kr, mut vr) = (vec![0f32; kvd], vec![0f32; kvd]);
                    for (i, &(lo, pos)) in cases.iter().enumerate() {
                        for h in 0..n_head {
                            let g = h / (n_head / n_kv);
                            let qh = &q.row(i)[h * hd..(h + 1) * hd];
                            let mut sc = Vec::new();
                            let mut vals = Vec::new();
                            for p in lo..=pos {
                                kv.key(0, slot(p), &mut kr);
                                kv.value(0, slot(p), &mut vr);
                                let s: f64 = kr[g * hd..(g + 1) * hd]
                                    .iter()
                                    .zip(qh)
                                    .map(|(&a, &b)| a as f64 * b as f64)
                                    .sum();
                                sc.push(s * shape.scale as f64);
                                vals.push(vr[g * hd..(g + 1) * hd].to_vec());
                            }
                            let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                            let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                            let z: f64 = e.iter().sum();
                            for d in 0..hd {
                                let want: f64 = e
                                    .iter()
                                    .zip(&vals)
                                    .map(|(w, v)| w * v[d] as f64)
                                    .sum::<f64>()
                                    / z;
                                let x = got[0][i * n_head * hd + h * hd + d] as f64;
                                // The query's Q8_0 rounding moves scores by up to ~1% of |q||k|.
                                let tol = if kt.is_quantized() { 0.03 } else { 1e-4 };
                                assert!(
                                    (x - want).abs() <= tol * (1.0 + want.abs()),
                                    "{kt:?}/{vt:?} hd {hd} case {i} head {h} dim {d}: {x} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
