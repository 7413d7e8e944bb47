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
//! cache. The arithmetic of a row does not depend on the batch (one kernel for prefill and decode)
//! except for how a row's positions are split between threads, which the row-invariant mode fixes
//! to a one-row call's. A unit of work is one query row and one KV head with all the query heads
//! that read it (each key and value row is read once for them), or a part of its positions where
//! there are fewer such pairs than threads (a decode step; the parts are merged by their maxima).

use half::f16;

use crate::kernels::cpu::attention::rotate;
use crate::kernels::cpu::backend::CpuAct;
use crate::kernels::cpu::threads::pool::{ThreadPool, FINE_CHUNKS};
use crate::kernels::cpu::SharedMut;
use crate::model::backend::{AttnQuery, AttnShape, CacheType};
use crate::quant::dequantize_row;
use crate::quant::quantize::{quantize_row_f16, quantize_row_q4_0, quantize_row_q8_0};

/// Values per quantized block.
pub const QK: usize = 32;
/// Bytes of a query head's Q8_0 block.
const Q8_BYTES: usize = 34;

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
    /// The run each quantized K (V) row is rotated in before rounding ([`rotate`]), 0 where the
    /// rows are stored as they are (an f16 K or V).
    pub k_rot: usize,
    pub v_rot: usize,
}

impl KvQuant {
    /// Zeroed storage for `slots` positions per layer (`kv_dim` values in heads of `head_dim`, a
    /// multiple of 32).
    pub fn new(
        n_layer: usize,
        slots: usize,
        kv_dim: usize,
        head_dim: usize,
        k_type: CacheType,
        v_type: CacheType,
    ) -> anyhow::Result<KvQuant> {
        anyhow::ensure!(
            head_dim.is_multiple_of(QK) && kv_dim.is_multiple_of(head_dim),
            "a quantized KV cache needs heads of whole 32-value blocks, not {head_dim}"
        );
        let (k_row, v_row) = (k_type.row_bytes(kv_dim), v_type.row_bytes(kv_dim));
        let plane = |row: usize| {
            slots
                .checked_mul(row)
                .ok_or_else(|| anyhow::anyhow!("KV cache size overflows"))
        };
        let (kb, vb) = (plane(k_row)?, plane(v_row)?);
        // One block at a time: measured better than the whole head (docs/engine.md).
        let rot = |ty: CacheType| if ty.is_quantized() { QK } else { 0 };
        Ok(KvQuant {
            k_rot: rot(k_type),
            v_rot: rot(v_type),
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

    /// Quantizes row i of `k` and `v` into slot `slots[i]` of `layer` (rotated first where
    /// that side is quantized).
    pub fn write(&mut self, layer: usize, k: &CpuAct, v: &CpuAct, slots: &[usize]) {
        let (kr, vr) = (self.k_row, self.v_row);
        let mut tmp = Vec::new();
        for (i, &slot) in slots.iter().enumerate() {
            let dst = &mut self.k[layer][slot * kr..(slot + 1) * kr];
            store(self.k_type, self.k_rot, k.row(i), &mut tmp, dst);
            let dst = &mut self.v[layer][slot * vr..(slot + 1) * vr];
            store(self.v_type, self.v_rot, v.row(i), &mut tmp, dst);
        }
    }

    /// The K row of `slot` in `layer`, dequantized (and rotated back).
    pub fn key(&self, layer: usize, slot: usize, out: &mut [f32]) {
        let r = slot * self.k_row..(slot + 1) * self.k_row;
        dequantize_row(self.k_type.ggml(), &self.k[layer][r], out).expect("whole blocks");
        if self.k_rot > 0 {
            rotate::unrotate(out, self.k_rot);
        }
    }

    /// The V row of `slot` in `layer`, dequantized (and rotated back).
    pub fn value(&self, layer: usize, slot: usize, out: &mut [f32]) {
        let r = slot * self.v_row..(slot + 1) * self.v_row;
        dequantize_row(self.v_type.ggml(), &self.v[layer][r], out).expect("whole blocks");
        if self.v_rot > 0 {
            rotate::unrotate(out, self.v_rot);
        }
    }

    /// Overwrites the K row of `slot` in `layer` with `row`, rotated and quantized.
    pub fn set_key(&mut self, layer: usize, slot: usize, row: &[f32]) {
        let r = slot * self.k_row..(slot + 1) * self.k_row;
        store(
            self.k_type,
            self.k_rot,
            row,
            &mut Vec::new(),
            &mut self.k[layer][r],
        );
    }
}

/// `src`, rotated in runs of `rot` values unless `rot` is 0 (through `tmp`), in `ty`'s bytes
/// (`dst` exactly as long), with ggml's reference quantizers.
fn store(ty: CacheType, rot: usize, src: &[f32], tmp: &mut Vec<f32>, dst: &mut [u8]) {
    let src = if rot > 0 {
        tmp.clear();
        tmp.extend_from_slice(src);
        rotate::rotate(tmp, rot);
        &tmp[..]
    } else {
        src
    };
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
#[inline]
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

/// The scores of one key head row `k` with `out.len()` Q8_0 query rows (`q`, one after another,
/// `nb` blocks each): `out[j] =` [`key_dot_scalar`] of row `j`.
pub fn key_dots_scalar(ty: CacheType, nb: usize, k: &[u8], q: &[u8], out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        *o = key_dot_scalar(ty, nb, k, &q[j * nb * Q8_BYTES..]);
    }
}

/// [`key_dots_scalar`] with AVX2 ([`key_dot_avx2`] per row; the key row stays in L1).
///
/// # Safety
/// As [`key_dot_avx2`], with `q` holding `out.len()` rows of `nb` Q8_0 blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn key_dots_avx2(ty: CacheType, nb: usize, k: &[u8], q: &[u8], out: &mut [f32]) {
    assert!(q.len() >= out.len() * nb * Q8_BYTES);
    for (j, o) in out.iter_mut().enumerate() {
        *o = key_dot_avx2(ty, nb, k, &q[j * nb * Q8_BYTES..]);
    }
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
        let (d, x) = widen_block(ty, vp.add(b * bb));
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

/// One V block of `ty` at `blk` widened to f32: its scale (1 for f16) and its 32 values in
/// order ([`value_scale`], [`value_at`]).
///
/// # Safety
/// AVX2, FMA and F16C are available; `blk` points at one whole block of `ty`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn widen_block(ty: CacheType, blk: *const u8) -> (f32, [std::arch::x86_64::__m256; 4]) {
    use std::arch::x86_64::*;
    match ty {
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
    }
}

/// Key positions whose rows [`key_dots8_avx2`] scores at once.
pub const KGROUP: usize = 8;

/// The scores of [`KGROUP`] key head rows `keys` (Q8_0 or Q4_0, `nb` blocks each) with `m`
/// Q8_0 query rows (`q`, one after another): `out[j * stride + i] =` [`key_dot_scalar`] of key
/// `i` and query row `j`. The scalar twin of [`key_dots8_avx2`].
pub fn key_dots8_scalar(
    ty: CacheType,
    nb: usize,
    keys: &[&[u8]; KGROUP],
    q: &[u8],
    m: usize,
    out: &mut [f32],
    stride: usize,
) {
    for j in 0..m {
        let qj = &q[j * nb * Q8_BYTES..];
        for (i, k) in keys.iter().enumerate() {
            out[j * stride + i] = key_dot_scalar(ty, nb, k, qj);
        }
    }
}

/// The most blocks per head [`key_dots8_avx2`] takes (heads of up to 512 values).
pub const KGROUP_MAX_NB: usize = 16;

/// [`key_dots8_scalar`] with AVX2, each score bit for bit [`key_dot_avx2`]'s: the eight key rows
/// are unpacked once (bytes, their magnitudes, scales) for all `m` query rows; each query row
/// runs eight independent chains, one per key, reduced together in `hsum_float_8`'s order.
///
/// # Safety
/// AVX2, FMA and F16C are available. (Lengths are checked: `nb <= KGROUP_MAX_NB`, each key
/// holds `nb` blocks of quantized `ty`, `q` holds `m` rows of `nb` Q8_0 blocks and `out`
/// `(m - 1) * stride + 8` values.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn key_dots8_avx2(
    ty: CacheType,
    nb: usize,
    keys: &[&[u8]; KGROUP],
    q: &[u8],
    m: usize,
    out: &mut [f32],
    stride: usize,
) {
    use std::arch::x86_64::*;
    let kb = ty.row_bytes(QK);
    assert!(nb <= KGROUP_MAX_NB && ty.is_quantized());
    assert!(keys.iter().all(|k| k.len() >= nb * kb) && q.len() >= m * nb * Q8_BYTES);
    assert!(m == 0 || (stride >= KGROUP && out.len() >= (m - 1) * stride + KGROUP));
    let mut kv = [[_mm256_setzero_si256(); KGROUP]; KGROUP_MAX_NB];
    let mut ka = kv;
    let mut dk = [[0f32; KGROUP]; KGROUP_MAX_NB];
    for (i, k) in keys.iter().enumerate() {
        for b in 0..nb {
            let blk = k.as_ptr().add(b * kb);
            dk[b][i] = f16::from_bits(u16::from_le_bytes([*blk, *blk.add(1)])).to_f32();
            let x = match ty {
                CacheType::Q4_0 => {
                    let x = _mm_loadu_si128(blk.add(2).cast());
                    let hi = _mm_srli_epi16(x, 4);
                    let both = _mm256_and_si256(_mm256_set_m128i(hi, x), _mm256_set1_epi8(0x0F));
                    _mm256_sub_epi8(both, _mm256_set1_epi8(8))
                }
                _ => _mm256_loadu_si256(blk.add(2).cast()),
            };
            kv[b][i] = x;
            ka[b][i] = _mm256_sign_epi8(x, x);
        }
    }
    let ones = _mm256_set1_epi16(1);
    let qp = q.as_ptr();
    for j in 0..m {
        let mut acc = [_mm256_setzero_ps(); KGROUP];
        for b in 0..nb {
            let qblk = qp.add((j * nb + b) * Q8_BYTES);
            let dq = f16::from_bits(u16::from_le_bytes([*qblk, *qblk.add(1)])).to_f32();
            let qv = _mm256_loadu_si256(qblk.add(2).cast());
            for i in 0..KGROUP {
                let sy = _mm256_sign_epi8(qv, kv[b][i]);
                let lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(ka[b][i], sy), ones);
                let c = _mm256_set1_ps(dk[b][i] * dq);
                acc[i] = _mm256_fmadd_ps(c, _mm256_cvtepi32_ps(lanes), acc[i]);
            }
        }
        _mm256_storeu_ps(out.as_mut_ptr().add(j * stride), hsum8x8(&acc));
    }
}

/// Eight vectors each summed as [`hsum8`] (`hsum_float_8`'s order), lane `i` the sum of `a[i]`:
/// the halves added pairwise, a 4x4 transpose in each half, then `(w0 + w2) + (w1 + w3)`.
///
/// # Safety
/// AVX2 is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum8x8(a: &[std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // w[j] = [x[4..8] + x[0..4] of a[j] | the same of a[j + 4]]
    let w: [__m256; 4] = std::array::from_fn(|j| {
        _mm256_add_ps(
            _mm256_permute2f128_ps(a[j], a[j + 4], 0x20),
            _mm256_permute2f128_ps(a[j], a[j + 4], 0x31),
        )
    });
    let t0 = _mm256_unpacklo_ps(w[0], w[1]);
    let t1 = _mm256_unpackhi_ps(w[0], w[1]);
    let t2 = _mm256_unpacklo_ps(w[2], w[3]);
    let t3 = _mm256_unpackhi_ps(w[2], w[3]);
    // c_k: lane j (and 4 + j) is w_k of a[j] (of a[j + 4])
    let c0 = _mm256_shuffle_ps(t0, t2, 0x44);
    let c1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    let c2 = _mm256_shuffle_ps(t1, t3, 0x44);
    let c3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    _mm256_add_ps(_mm256_add_ps(c0, c2), _mm256_add_ps(c1, c3))
}

/// `acc[j * hd + e] += w[j * stride + k] * v_k[e]` for each head `j < m`, each value `e` and
/// each position `k < offs.len()` in order, `v_k` the V head row at `plane[offs[k]..]` (`hd /
/// 32` blocks of `ty`): [`accumulate_v_scalar`] one position after the other. The scalar twin
/// of [`accumulate_v_rows_avx2`].
#[allow(clippy::too_many_arguments)]
pub fn accumulate_v_rows_scalar(
    ty: CacheType,
    hd: usize,
    plane: &[u8],
    offs: &[usize],
    w: &[f32],
    stride: usize,
    m: usize,
    acc: &mut [f32],
) {
    let mut col = vec![0f32; m];
    for (k, &off) in offs.iter().enumerate() {
        for (j, c) in col.iter_mut().enumerate() {
            *c = w[j * stride + k];
        }
        accumulate_v_scalar(ty, hd, &plane[off..], &col, acc);
    }
}

/// f32 values [`accumulate_v_rows_avx2`] widens at a time (so many positions' V rows).
const VBUF: usize = 4096;

/// [`accumulate_v_rows_scalar`] with AVX2, bit for bit: the V rows are widened to f32 a chunk of
/// positions at a time, once for all `m` heads, and each block's accumulators of up to three
/// heads stay in registers over the chunk's positions (one FMA per value, no accumulator load
/// or store per position).
///
/// # Safety
/// AVX2, FMA and F16C are available. (Lengths are checked.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn accumulate_v_rows_avx2(
    ty: CacheType,
    hd: usize,
    plane: &[u8],
    offs: &[usize],
    w: &[f32],
    stride: usize,
    m: usize,
    acc: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (bb, nb, n) = (ty.row_bytes(QK), hd / QK, offs.len());
    assert!(hd.is_multiple_of(QK) && hd <= VBUF && acc.len() >= m * hd);
    assert!(offs.iter().all(|&o| o + nb * bb <= plane.len()));
    assert!(m == 0 || n == 0 || (stride >= n && w.len() >= (m - 1) * stride + n));
    let pc = VBUF / hd;
    let mut x = [0f32; VBUF];
    let mut ds = [0f32; VBUF / QK];
    let (xp, dp, wp, ap) = (
        x.as_mut_ptr(),
        ds.as_mut_ptr(),
        w.as_ptr(),
        acc.as_mut_ptr(),
    );
    for k0 in (0..n).step_by(pc) {
        let kn = pc.min(n - k0);
        for k in 0..kn {
            let row = plane.as_ptr().add(offs[k0 + k]);
            for b in 0..nb {
                let (d, v) = widen_block(ty, row.add(b * bb));
                *dp.add(k * nb + b) = d;
                for (i, &vi) in v.iter().enumerate() {
                    _mm256_storeu_ps(xp.add(k * hd + b * QK + 8 * i), vi);
                }
            }
        }
        for b in 0..nb {
            let mut j = 0;
            while j < m {
                let (xb, db) = (xp.add(b * QK).cast_const(), dp.add(b).cast_const());
                let (wj, aj) = (wp.add(j * stride + k0), ap.add(j * hd + b * QK));
                j += match m - j {
                    1 => v_heads::<1>(xb, db, wj, aj, hd, nb, stride, kn),
                    2 => v_heads::<2>(xb, db, wj, aj, hd, nb, stride, kn),
                    _ => v_heads::<3>(xb, db, wj, aj, hd, nb, stride, kn),
                };
            }
        }
    }
}

/// `N` heads' accumulators of one block (`a`, heads `hd` apart) over `kn` widened positions
/// (`x`, rows `hd` apart; scales `d`, `nb` apart; weights `w`, heads `stride` apart); returns
/// `N`.
///
/// # Safety
/// AVX2 and FMA are available; the pointers cover what is read and written.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn v_heads<const N: usize>(
    x: *const f32,
    d: *const f32,
    w: *const f32,
    a: *mut f32,
    hd: usize,
    nb: usize,
    stride: usize,
    kn: usize,
) -> usize {
    use std::arch::x86_64::*;
    let mut r: [[__m256; 4]; N] =
        std::array::from_fn(|j| std::array::from_fn(|i| _mm256_loadu_ps(a.add(j * hd + 8 * i))));
    for k in 0..kn {
        let dk = *d.add(k * nb);
        let xk = x.add(k * hd);
        for (j, rj) in r.iter_mut().enumerate() {
            let c = _mm256_set1_ps(*w.add(j * stride + k) * dk);
            for (i, ri) in rj.iter_mut().enumerate() {
                *ri = _mm256_fmadd_ps(_mm256_loadu_ps(xk.add(8 * i)), c, *ri);
            }
        }
    }
    for (j, rj) in r.iter().enumerate() {
        for (i, &ri) in rj.iter().enumerate() {
            _mm256_storeu_ps(a.add(j * hd + 8 * i), ri);
        }
    }
    N
}

/// The scores of the key head rows at `plane[offs[k]..]` (f16 or quantized, positions `k`)
/// with `m` query heads: `out[j * stride + k]` for head `j`. `q8` holds the heads' Q8_0 rows
/// (quantized keys), `qf(j)` is head `j`'s f32 row (f16 keys).
#[allow(clippy::too_many_arguments)]
fn key_scores<'q>(
    isa: Isa,
    ty: CacheType,
    hd: usize,
    plane: &[u8],
    offs: &[usize],
    q8: &[u8],
    qf: impl Fn(usize) -> &'q [f32],
    m: usize,
    out: &mut [f32],
    stride: usize,
) {
    let (n, nb, kb) = (offs.len(), hd / QK, ty.row_bytes(hd));
    if ty == CacheType::F16 {
        for (k, &off) in offs.iter().enumerate() {
            let kr = &plane[off..off + kb];
            for j in 0..m {
                let mut acc = [0f32; 8];
                for (kc, qc) in kr.chunks_exact(16).zip(qf(j).chunks_exact(8)) {
                    for l in 0..8 {
                        acc[l] = f16_at(kc, 2 * l).mul_add(qc[l], acc[l]);
                    }
                }
                out[j * stride + k] = hsum8(&acc);
            }
        }
        return;
    }
    for k0 in (0..n).step_by(KGROUP) {
        // A last group short of eight positions repeats the last key; its extra scores land in
        // the padding past `n` (`stride` is a multiple of 8).
        let keys: [&[u8]; KGROUP] = std::array::from_fn(|i| {
            let off = offs[(k0 + i).min(n - 1)];
            &plane[off..off + kb]
        });
        let out = &mut out[k0..];
        match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx2` is only chosen where AVX2, FMA and F16C were detected; the
            // callee checks the lengths.
            Isa::Avx2 if nb <= KGROUP_MAX_NB => unsafe {
                key_dots8_avx2(ty, nb, &keys, q8, m, out, stride)
            },
            _ => key_dots8_scalar(ty, nb, &keys, q8, m, out, stride),
        }
    }
}

/// [`accumulate_v_rows_avx2`] or its scalar twin, as `isa` says.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn accumulate_v(
    isa: Isa,
    ty: CacheType,
    hd: usize,
    plane: &[u8],
    offs: &[usize],
    w: &[f32],
    stride: usize,
    m: usize,
    acc: &mut [f32],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::Avx2` is only chosen where AVX2, FMA and F16C were detected; the callee
        // checks the lengths.
        Isa::Avx2 => unsafe { accumulate_v_rows_avx2(ty, hd, plane, offs, w, stride, m, acc) },
        _ => accumulate_v_rows_scalar(ty, hd, plane, offs, w, stride, m, acc),
    }
}

/// Per-thread buffers of one unit, kept between calls (a decode step attends once per layer).
#[derive(Default)]
struct Scratch {
    /// The unit's query heads quantized to Q8_0, one row after another.
    q8: Vec<u8>,
    /// One query head rotated as the keys are.
    qr: Vec<f32>,
    /// Byte offsets of the unit's key (then value) head rows in their plane, by position.
    offs: Vec<usize>,
    /// Scores, then softmax weights: `[head][position]`, each head's row padded to a multiple
    /// of eight positions.
    s: Vec<f32>,
    /// Per head: the part's maximum score, then its sum of weights.
    m: Vec<f32>,
    sum: Vec<f32>,
    /// The V accumulators `[head][hd]`.
    acc: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Positions of a unit when a query's keys are split between threads: fewer are not worth a
/// unit of their own.
const MIN_SPLIT: usize = 64;

/// The most consecutive query rows of one sequence in a unit (a tile) during prefill: they
/// share every key and value read and widened.
pub const TILE_ROWS: usize = 8;

/// One query row of a unit: all its heads, and the positions `a..=b` it attends over here.
#[derive(Clone, Copy)]
struct TileRow<'q> {
    q: &'q [f32],
    a: usize,
    b: usize,
}

/// What a query row and a KV head's heads attend over.
struct Job<'a> {
    kv: &'a KvQuant,
    layer: usize,
    block_size: usize,
    shape: AttnShape,
    isa: Isa,
}

impl Job<'_> {
    /// Heads `g * group..(g + 1) * group` of each row of `rows` (one sequence, blocks `table`),
    /// each over its own positions (non-empty): per (row, head) `j = r * group + h`, the maximum
    /// score, the sum of weights and the unnormalised V sum in `s`. Scores and V sums run over
    /// the union of the rows' positions, each key and value row read once for all the rows; a
    /// position outside a row's own range weighs 0 for it, so each row's arithmetic is the one
    /// it has alone (scores, maximum and sum in position order; V chains in position order,
    /// where the extra positions add zeros).
    fn part(&self, rows: &[TileRow<'_>], table: &[u32], g: usize, s: &mut Scratch) {
        let (kv, isa) = (self.kv, self.isa);
        let hd = self.shape.head_dim;
        let nh = self.shape.n_head / self.shape.n_head_kv;
        let m = rows.len() * nh;
        let h0 = g * nh;
        let qh = |j: usize| {
            let (r, h) = (j / nh, h0 + j % nh);
            &rows[r].q[h * hd..(h + 1) * hd]
        };
        let row_q8 = hd / QK * Q8_BYTES;
        if kv.k_type.is_quantized() {
            s.q8.resize(m * row_q8, 0);
            for (j, dst) in s.q8.chunks_exact_mut(row_q8).enumerate() {
                if kv.k_rot > 0 {
                    s.qr.clear();
                    s.qr.extend_from_slice(qh(j));
                    rotate::rotate(&mut s.qr, kv.k_rot);
                    quantize_row_q8_0(&s.qr, dst);
                } else {
                    quantize_row_q8_0(qh(j), dst);
                }
            }
        }
        let a0 = rows.iter().map(|r| r.a).min().expect("a row");
        let b0 = rows.iter().map(|r| r.b).max().expect("a row");
        let (n, stride) = (b0 + 1 - a0, (b0 + 1 - a0).next_multiple_of(KGROUP));
        let bs = self.block_size;
        let slot = |p: usize| table[p / bs] as usize * bs + p % bs;
        let (kb, vb) = (kv.k_type.row_bytes(hd), kv.v_type.row_bytes(hd));
        s.offs.clear();
        s.offs
            .extend((a0..=b0).map(|p| slot(p) * kv.k_row + g * kb));
        s.s.resize(m * stride, 0.0);
        let kp = &kv.k[self.layer][..];
        key_scores(
            isa, kv.k_type, hd, kp, &s.offs, &s.q8, qh, m, &mut s.s, stride,
        );
        s.m.clear();
        s.m.resize(m, f32::NEG_INFINITY);
        s.sum.clear();
        s.sum.resize(m, 0.0);
        for (j, sc) in s.s.chunks_exact_mut(stride).enumerate() {
            let r = &rows[j / nh];
            let (lo, hi) = (r.a - a0, r.b - a0);
            let mut mx = f32::NEG_INFINITY;
            for x in &mut sc[lo..=hi] {
                *x *= self.shape.scale;
                mx = mx.max(*x);
            }
            let mut sum = 0f32;
            for x in &mut sc[lo..=hi] {
                *x = (*x - mx).exp();
                sum += *x;
            }
            sc[..lo].fill(0.0);
            sc[hi + 1..n].fill(0.0);
            (s.m[j], s.sum[j]) = (mx, sum);
        }
        s.offs.clear();
        s.offs
            .extend((a0..=b0).map(|p| slot(p) * kv.v_row + g * vb));
        s.acc.clear();
        s.acc.resize(m * hd, 0.0);
        let vp = &kv.v[self.layer][..];
        accumulate_v(isa, kv.v_type, hd, vp, &s.offs, &s.s, stride, m, &mut s.acc);
    }
}

/// Causal attention of each query row of `q` (rows × n_head·head_dim) over the cached keys and
/// values of `layer`, written to `out` (same shape), with the kernels `isa` selects. A unit is a
/// tile of up to [`TILE_ROWS`] consecutive query rows of one sequence and one KV head (all the
/// query heads that read it), where there are enough rows for every thread (prefill), else one
/// row; where there are fewer (row, KV head) pairs than threads (a decode step), each pair's
/// positions are split into parts computed apart and merged as flash attention merges (rescaled
/// by the parts' maxima). A row's arithmetic is the same in a tile as alone. With `invariant`,
/// each row is its own tile and is split as a one-row call would split it, so its result does
/// not depend on the batch.
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
    invariant: bool,
) {
    let hd = shape.head_dim;
    assert!(hd.is_multiple_of(QK), "head width {hd} is not whole blocks");
    let (n_kv, group) = (shape.n_head_kv, shape.n_head / shape.n_head_kv);
    let threads = pool.n_threads();
    let rows = if invariant { 1 } else { queries.len() };
    // Rows per tile: enough units left for two per thread.
    let per_tile = (rows * n_kv / (2 * threads)).clamp(1, TILE_ROWS);
    // Tile t is queries tiles[t].0..tiles[t].0 + tiles[t].1.
    let mut tiles: Vec<(usize, usize)> = Vec::with_capacity(queries.len().div_ceil(per_tile));
    for (i, qa) in queries.iter().enumerate() {
        match tiles.last_mut() {
            Some((f, c))
                if *c < per_tile
                    && queries[*f].seq == qa.seq
                    && queries[*f].block_table == qa.block_table =>
            {
                *c += 1
            }
            _ => tiles.push((i, 1)),
        }
    }
    // How many parts a (one-row) tile's positions are cut into.
    let parts_of = |&(i, c): &(usize, usize)| {
        if c > 1 || rows * n_kv >= threads {
            return 1;
        }
        let qa = &queries[i];
        let n = (qa.pos + 1 - qa.lo) as usize;
        (2 * threads)
            .div_ceil(rows * n_kv)
            .min(n.div_ceil(MIN_SPLIT))
            .max(1)
    };
    let parts: Vec<usize> = tiles.iter().map(parts_of).collect();
    // Tile t's units are first[t]..first[t + 1]: KV head by KV head, part by part.
    let mut first = Vec::with_capacity(tiles.len() + 1);
    first.push(0);
    for &p in &parts {
        first.push(first.last().copied().unwrap_or(0) + n_kv * p);
    }
    let units = first[tiles.len()];
    let split = parts.iter().any(|&p| p > 1);
    let job = Job {
        kv,
        layer,
        block_size,
        shape,
        isa,
    };
    let out_cols = out.cols;
    let dst = SharedMut(out.data.as_mut_ptr());
    // For split rows: per unit and head, the maximum, the sum and the V sum.
    let stride = hd + 2;
    let mut partial = vec![0f32; if split { units * group * stride } else { 0 }];
    let pdst = SharedMut(partial.as_mut_ptr());
    pool.for_range_with(units, 1, FINE_CHUNKS, |range| {
        SCRATCH.with_borrow_mut(|s| {
            for unit in range {
                let t = first.partition_point(|&f| f <= unit) - 1;
                let ((i0, nr), np) = (tiles[t], parts[t]);
                let (g, c) = ((unit - first[t]) / np, (unit - first[t]) % np);
                let mut trows = [TileRow { q: &[], a: 0, b: 0 }; TILE_ROWS];
                for (r, tr) in trows[..nr].iter_mut().enumerate() {
                    let qa = &queries[i0 + r];
                    // Part c of the positions lo..=pos (empty when there are fewer positions).
                    let (lo, pos) = (qa.lo as usize, qa.pos as usize);
                    let len = (pos + 1 - lo).div_ceil(np);
                    let a = lo + c * len;
                    *tr = TileRow {
                        q: q.row(i0 + r),
                        a,
                        b: pos.min(a + len - 1),
                    };
                }
                if trows[0].a > trows[0].b {
                    // Only a split row (one row) has empty parts.
                    for j in 0..group {
                        // SAFETY: unit < units, so its `group * stride` values lie inside
                        // `partial` (only split rows have empty parts); each unit is run once, by
                        // one thread, and the pool joins before `partial` is read.
                        unsafe { *pdst.ptr().add((unit * group + j) * stride) = f32::NEG_INFINITY };
                    }
                    continue;
                }
                job.part(&trows[..nr], queries[i0].block_table, g, s);
                for r in 0..nr {
                    let i = i0 + r;
                    for j in 0..group {
                        let rj = r * group + j;
                        let acc = &s.acc[rj * hd..(rj + 1) * hd];
                        if np > 1 {
                            // SAFETY: as above: this unit's own values of `partial` (a split
                            // tile is one row, r = 0).
                            let p = unsafe {
                                std::slice::from_raw_parts_mut(
                                    pdst.ptr().add((unit * group + j) * stride),
                                    stride,
                                )
                            };
                            p[0] = s.m[rj];
                            p[1] = s.sum[rj];
                            p[2..].copy_from_slice(acc);
                            continue;
                        }
                        let inv = if s.sum[rj] == 0.0 {
                            0.0
                        } else {
                            1.0 / s.sum[rj]
                        };
                        let h = g * group + j;
                        // SAFETY: i < out.rows and h < n_head, so the slice lies inside `out`;
                        // each (row, head) belongs to exactly one unit, run once, so the slices
                        // written by the pool's threads are disjoint, and the pool joins before
                        // `out` is read.
                        let o = unsafe {
                            std::slice::from_raw_parts_mut(dst.ptr().add(i * out_cols + h * hd), hd)
                        };
                        for (o, &x) in o.iter_mut().zip(acc) {
                            *o = x * inv;
                        }
                        if kv.v_rot > 0 {
                            rotate::unrotate(o, kv.v_rot);
                        }
                    }
                }
            }
        })
    });
    for (t, &np) in parts.iter().enumerate().filter(|(_, &p)| p > 1) {
        let i = tiles[t].0;
        for h in 0..shape.n_head {
            let (g, j) = (h / group, h % group);
            let at = |c: usize| ((first[t] + g * np + c) * group + j) * stride;
            let m = (0..np)
                .map(|c| partial[at(c)])
                .fold(f32::NEG_INFINITY, f32::max);
            let o = &mut out.data[i * out_cols + h * hd..i * out_cols + (h + 1) * hd];
            o.iter_mut().for_each(|x| *x = 0.0);
            let mut sum = 0f32;
            for c in 0..np {
                let p = &partial[at(c)..at(c) + stride];
                if p[0] == f32::NEG_INFINITY {
                    continue;
                }
                let f = (p[0] - m).exp();
                sum += p[1] * f;
                for (o, &x) in o.iter_mut().zip(&p[2..]) {
                    *o += x * f;
                }
            }
            let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
            o.iter_mut().for_each(|x| *x *= inv);
            if kv.v_rot > 0 {
                rotate::unrotate(o, kv.v_rot);
            }
        }
    }
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
        store(ty, 0, x, &mut Vec::new(), &mut b);
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

    /// Keys with outlier channels (as Qwen2.5's K bias leaves them): rotating keys and query
    /// before rounding cuts the scores' error against the exact f64 `q·k` of the unrounded rows.
    #[test]
    fn rotation_shrinks_the_score_error_of_keys_with_outlier_channels() {
        let hd = 128;
        for (ty, gain) in [(CacheType::Q8_0, 1.3), (CacheType::Q4_0, 1.3)] {
            let rms = |rot: usize| -> f64 {
                let mut total = 0.0;
                for t in 0..64u32 {
                    let mut k = test_floats(hd, 300 + t);
                    k[17] += 60.0;
                    k[90] -= 35.0;
                    let q = test_floats(hd, 500 + t);
                    let exact: f64 = k.iter().zip(&q).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let mut kb = vec![0u8; ty.row_bytes(hd)];
                    store(ty, rot, &k, &mut Vec::new(), &mut kb);
                    let mut qr = q.clone();
                    if rot > 0 {
                        rotate::rotate(&mut qr, rot);
                    }
                    let got = key_dot_scalar(ty, hd / QK, &kb, &q8(&qr));
                    total += (got as f64 - exact).powi(2);
                }
                (total / 64.0).sqrt()
            };
            let (plain, rotated) = (rms(0), rms(QK));
            eprintln!("{ty:?}: score error rms {plain:.4} plain, {rotated:.4} rotated");
            assert!(rotated * gain < plain, "{ty:?}: {rotated} vs {plain}");
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
                    let mut kv = KvQuant::new(1, n_blocks * bs, kvd, hd, kt, vt).unwrap();
                    // Quantized sides are rotated block by block (the reference below reads the
                    // cache rotated back, so it holds the rotated path to the plain scores).
                    let rot = |t: CacheType| if t.is_quantized() { QK } else { 0 };
                    assert_eq!((kv.k_rot, kv.v_rot), (rot(kt), rot(vt)));
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
                        attention(&pool, &q, &kv, 0, bs, &queries, shape, &mut out, isa, false);
                        // Each row alone (a decode step: its positions split between threads)
                        // and row-invariant: the same up to the split's rounding, and exactly.
                        let mut inv = CpuAct {
                            data: vec![0.0; q.data.len()],
                            rows: q.rows,
                            cols: q.cols,
                        };
                        attention(&pool, &q, &kv, 0, bs, &queries, shape, &mut inv, isa, true);
                        for (i, qa) in queries.iter().enumerate() {
                            let one = CpuAct {
                                data: q.row(i).to_vec(),
                                rows: 1,
                                cols: q.cols,
                            };
                            let mut o1 = CpuAct {
                                data: vec![0.0; q.cols],
                                rows: 1,
                                cols: q.cols,
                            };
                            let qs = [*qa];
                            attention(&pool, &one, &kv, 0, bs, &qs, shape, &mut o1, isa, false);
                            assert_eq!(o1.data, inv.row(i), "{kt:?}/{vt:?} row {i}: not invariant");
                            for (x, y) in o1.data.iter().zip(out.row(i)) {
                                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} {y}");
                            }
                        }
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

    /// The eight-key AVX2 score kernel gives each score bit for bit as [`key_dot_scalar`] (so as
    /// [`key_dot_avx2`]), for both key types, heads of 1 to 16 blocks and ragged head counts.
    #[test]
    fn key_dots8_avx2_equals_its_scalar_twin_bit_for_bit() {
        if !avx2() {
            eprintln!("skipped: no AVX2");
            return;
        }
        for ty in [CacheType::Q8_0, CacheType::Q4_0] {
            for nb in [1usize, 4, 8, KGROUP_MAX_NB] {
                let n = nb * QK;
                let ks: Vec<Vec<u8>> = (0..KGROUP as u32)
                    .map(|i| row(ty, &test_floats(n, 40 + i + 10 * nb as u32)))
                    .collect();
                let keys: [&[u8]; KGROUP] = std::array::from_fn(|i| ks[i].as_slice());
                for m in [1usize, 5, 13] {
                    let q = q8(&test_floats(m * n, 90 + m as u32));
                    let stride = 24;
                    let mut a = vec![f32::NAN; m * stride];
                    let mut b = a.clone();
                    key_dots8_scalar(ty, nb, &keys, &q, m, &mut a, stride);
                    // SAFETY: AVX2 checked above; the callee checks the lengths.
                    unsafe { key_dots8_avx2(ty, nb, &keys, &q, m, &mut b, stride) };
                    for j in 0..m {
                        for i in 0..KGROUP {
                            let (x, y) = (a[j * stride + i], b[j * stride + i]);
                            assert_eq!(x.to_bits(), y.to_bits(), "{ty:?} nb {nb} m {m} ({j}, {i})");
                            // SAFETY: as above.
                            let one = unsafe {
                                key_dot_avx2(ty, nb, keys[i], &q[j * n / QK * Q8_BYTES..])
                            };
                            assert_eq!(x.to_bits(), one.to_bits(), "{ty:?} against key_dot_avx2");
                        }
                    }
                }
            }
        }
    }

    /// The AVX2 V kernel over many positions (scattered rows, more than one widened chunk, zero
    /// weights) equals its scalar twin bit for bit, for every V type, head width and ragged head
    /// count.
    #[test]
    fn accumulate_v_rows_avx2_equals_its_scalar_twin_bit_for_bit() {
        if !avx2() {
            eprintln!("skipped: no AVX2");
            return;
        }
        for ty in CacheType::ALL {
            for hd in [32usize, 128, 256] {
                let n_rows = 50;
                let vb = ty.row_bytes(hd);
                let plane: Vec<u8> = (0..n_rows as u32)
                    .flat_map(|r| row(ty, &test_floats(hd, 200 + r)))
                    .collect();
                for (m, n) in [(1usize, 1usize), (2, 9), (3, 33), (4, 40), (7, 50)] {
                    let offs: Vec<usize> = (0..n).map(|k| (k * 17 + 3) % n_rows * vb).collect();
                    let stride = n.next_multiple_of(8) + 8;
                    let mut w = test_floats(m * stride, 7 + m as u32);
                    for (k, x) in w.iter_mut().enumerate() {
                        if k % 5 == 0 {
                            *x = 0.0;
                        }
                    }
                    let init = test_floats(m * hd, 8);
                    let (mut a, mut b) = (init.clone(), init);
                    accumulate_v_rows_scalar(ty, hd, &plane, &offs, &w, stride, m, &mut a);
                    // SAFETY: AVX2 checked above; the callee checks the lengths.
                    unsafe { accumulate_v_rows_avx2(ty, hd, &plane, &offs, &w, stride, m, &mut b) };
                    for (x, y) in a.iter().zip(&b) {
                        assert_eq!(x.to_bits(), y.to_bits(), "{ty:?} hd {hd} m {m} n {n}");
                    }
                }
            }
        }
    }

    /// An f64 softmax attention of one query row (all heads) over positions `lo..=pos` of the
    /// dequantized cache (rotated back), blocks `table`.
    fn reference(
        kv: &KvQuant,
        table: &[u32],
        bs: usize,
        q: &[f32],
        (lo, pos): (usize, usize),
        shape: AttnShape,
    ) -> Vec<f64> {
        let (hd, kvd) = (shape.head_dim, kv.kv_dim);
        let slot = |p: usize| table[p / bs] as usize * bs + p % bs;
        let (mut kr, mut vr) = (vec![0f32; kvd], vec![0f32; kvd]);
        let mut out = vec![0f64; shape.n_head * hd];
        for h in 0..shape.n_head {
            let g = h / (shape.n_head / shape.n_head_kv);
            let qh = &q[h * hd..(h + 1) * hd];
            let (mut sc, mut vals) = (Vec::new(), Vec::new());
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
                out[h * hd + d] = e
                    .iter()
                    .zip(&vals)
                    .map(|(w, v)| w * v[d] as f64)
                    .sum::<f64>()
                    / z;
            }
        }
        out
    }

    /// Prefill batches that take the tiled path (tiles of up to `TILE_ROWS` rows of one
    /// sequence): two sequences with their own scattered blocks, ragged row counts (tiles cut
    /// short at a sequence's end), causal rows and sliding windows, GQA and MQA, every pair of
    /// K/V types, both ISAs. Each row equals the row-invariant result (each row alone) bit for
    /// bit where a row alone is not split (as many KV heads as threads), else within the
    /// split's rounding; scalar and AVX2 agree exactly; and every row is within tolerance of an
    /// f64 softmax over the dequantized cache.
    #[test]
    fn tiled_prefill_matches_rows_alone_and_an_f64_reference() {
        let pool = ThreadPool::new(2);
        let bs = 16usize;
        for (n_head, n_kv, hd) in [(6usize, 2usize, 128usize), (4, 1, 256), (4, 2, 32)] {
            let kvd = n_kv * hd;
            let tables: [Vec<u32>; 2] = [vec![3, 0, 7, 1, 11, 5, 2, 9, 4], vec![10, 6, 8, 12]];
            let shape = AttnShape {
                n_head,
                n_head_kv: n_kv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            for kt in CacheType::ALL {
                for vt in CacheType::ALL {
                    let mut kv = KvQuant::new(1, 13 * bs, kvd, hd, kt, vt).unwrap();
                    let kact = CpuAct {
                        data: test_floats(13 * bs * kvd, 31)
                            .iter()
                            .map(|x| x * 0.7)
                            .collect(),
                        rows: 13 * bs,
                        cols: kvd,
                    };
                    let vact = CpuAct {
                        data: test_floats(13 * bs * kvd, 32),
                        rows: 13 * bs,
                        cols: kvd,
                    };
                    let slots: Vec<usize> = (0..13 * bs).collect();
                    kv.write(0, &kact, &vact, &slots);
                    // (sequence, lo, pos): 37 causal rows of sequence 0 from position 60, 11
                    // rows of sequence 1 under a window of 20, then 5 more rows of sequence 0
                    // under a window of 30.
                    let mut rows: Vec<(usize, usize, usize)> =
                        (60..97).map(|p| (0, 0, p)).collect();
                    rows.extend((40..51usize).map(|p| (1, (p + 1).saturating_sub(20), p)));
                    rows.extend((97..102).map(|p| (0, p + 1 - 30, p)));
                    let queries: Vec<AttnQuery<'_>> = rows
                        .iter()
                        .map(|&(sq, lo, pos)| AttnQuery {
                            seq: sq as u32,
                            block_table: &tables[sq],
                            pos: pos as u32,
                            lo: lo as u32,
                        })
                        .collect();
                    let q = CpuAct {
                        data: test_floats(rows.len() * n_head * hd, 33),
                        rows: rows.len(),
                        cols: n_head * hd,
                    };
                    let mut got = Vec::new();
                    for isa in [Isa::Scalar, Isa::Avx2] {
                        if isa == Isa::Avx2 && !avx2() {
                            continue;
                        }
                        let run = |invariant: bool| {
                            let mut out = CpuAct {
                                data: vec![0.0; q.data.len()],
                                rows: q.rows,
                                cols: q.cols,
                            };
                            attention(
                                &pool, &q, &kv, 0, bs, &queries, shape, &mut out, isa, invariant,
                            );
                            out.data
                        };
                        let (tiled, alone) = (run(false), run(true));
                        if n_kv >= pool.n_threads() {
                            assert_eq!(tiled, alone, "{kt:?}/{vt:?} hd {hd}: tiled != alone");
                        } else {
                            for (x, y) in tiled.iter().zip(&alone) {
                                assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} {y}");
                            }
                        }
                        got.push(tiled);
                    }
                    if got.len() == 2 {
                        assert_eq!(
                            got[0], got[1],
                            "{kt:?}/{vt:?} hd {hd}: AVX2 and scalar differ"
                        );
                    }
                    let tol = if kt.is_quantized() { 0.03 } else { 1e-4 };
                    for (i, &(sq, lo, pos)) in rows.iter().enumerate() {
                        let want = reference(&kv, &tables[sq], bs, q.row(i), (lo, pos), shape);
                        for (d, (&x, &w)) in got[0][i * q.cols..(i + 1) * q.cols]
                            .iter()
                            .zip(&want)
                            .enumerate()
                        {
                            assert!(
                                (x as f64 - w).abs() <= tol * (1.0 + w.abs()),
                                "{kt:?}/{vt:?} hd {hd} row {i} value {d}: {x} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}
