//! Scalar quantization from f32, reproducing ggml's rounding exactly.
//!
//! Two jobs live here:
//! - **Activations** (`quantize_row_q8_0`, `quantize_row_q8_1`, `quantize_row_q8_k`): the per-matmul
//!   conversion of an f32 row into the weight type's vec-dot format. The `*_ref` semantics are
//!   ggml's `quantize_row_q8_*_ref` (`roundf`, ties away from zero, `id = 1/d`), which is also what
//!   gguf-py does. ggml-cpu's SIMD builds quantize Q8_0/Q8_1 slightly differently (round half to
//!   even; on x86 also `id = 127/amax`): [`Q8Variant`] selects which one to mirror bit-for-bit.
//!   Q8_K has a single implementation in ggml (`nearest_int`, `iscale = -127/max`, `d = 1/iscale`).
//! - **Weights** of the legacy block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the float types, as
//!   ggml's `quantize_row_*_ref` (the k-quant weight quantizers are in `kquantize`).
//!
//! Every function writes whole blocks in ggml's byte layout; `src.len()` must be a multiple of the
//! block size and `dst.len()` exactly the bytes of that many blocks (both asserted).

use half::{bf16, f16};

use super::blocks::{
    Block, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8K, BlockQ8_0, BlockQ8_1, QK_K,
};

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5 * 2^23 magic constant.
/// Exact for `|fval| <= 4194303`; outside that range it returns the same meaningless value as
/// ggml's release build (whose `assert` is compiled out), which callers then clamp.
#[inline]
pub(crate) fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    (val.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// ggml's `GGML_FP32_TO_FP16`: round to nearest even (subnormals included).
#[inline]
pub(crate) fn fp16(v: f32) -> f16 {
    f16::from_f32(v)
}

/// ggml's `GGML_FP32_TO_BF16`: NaNs forced quiet, everything else rounded to nearest even.
#[inline]
pub fn fp32_to_bf16(s: f32) -> bf16 {
    let u = s.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return bf16::from_bits(((u >> 16) | 64) as u16);
    }
    bf16::from_bits(((u as u64 + (0x7fff + ((u >> 16) & 1)) as u64) >> 16) as u16)
}

/// Which of ggml's Q8_0 / Q8_1 activation quantizers to reproduce.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Q8Variant {
    /// `quantize_row_q8_{0,1}_ref` (ggml's generic CPU build, gguf-py): `d = amax/127`,
    /// `id = 1/d`, `roundf` (ties away from zero).
    #[default]
    Reference,
    /// ggml-cpu on x86 with AVX/AVX2/AVX-512 (`arch/x86/quants.c`): `d = amax/127`,
    /// `id = 127/amax`, `_mm256_round_ps` to nearest (ties to even), saturating packs.
    X86Avx,
    /// ggml-cpu on ARM NEON (`arch/arm/quants.c`): `d = amax/127`, `id = 1/d`, `vcvtnq_s32_f32`
    /// (ties to even).
    ArmNeon,
}

/// `x.round_ties_even()` without a library call where SSE4.1 is not compiled in: adding and
/// subtracting 1.5·2^23 rounds to the nearest even integer exactly for |x| < 2^22 (the quantizers'
/// values are within ±128); other values (and NaN) take the library path.
#[inline(always)]
fn rne_small(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    if x.abs() < 4_194_304.0 {
        (x + MAGIC) - MAGIC
    } else {
        x.round_ties_even()
    }
}

/// Quantizes one 32-value block the way `variant` does; returns (d as f32 before f16, qs).
#[inline]
fn q8_block(x: &[f32], variant: Q8Variant) -> (f32, [i8; 32]) {
    let mut amax = 0.0f32;
    for &v in x {
        // C `MAX(amax, fabsf(v))` (SIMD `max_ps` agrees on non-NaN input).
        let a = v.abs();
        amax = if amax > a { amax } else { a };
    }
    let d = amax / 127.0;
    let mut qs = [0i8; 32];
    match variant {
        Q8Variant::Reference => {
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(x) {
                *q = (v * id).round() as i8;
            }
        }
        Q8Variant::X86Avx => {
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(x) {
                *q = (rne_small(v * id) as i32).clamp(-128, 127) as i8;
            }
        }
        Q8Variant::ArmNeon => {
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for (q, &v) in qs.iter_mut().zip(x) {
                *q = rne_small(v * id) as i32 as i8;
            }
        }
    }
    (d, qs)
}

fn check_lens<B: Block>(src: &[f32], dst: &[u8]) -> usize {
    assert!(
        src.len().is_multiple_of(B::ELEMS),
        "row of {} values is not a whole number of {}-value blocks",
        src.len(),
        B::ELEMS
    );
    let nb = src.len() / B::ELEMS;
    assert_eq!(
        dst.len(),
        nb * B::BYTES,
        "destination must hold exactly {nb} blocks"
    );
    nb
}

/// Q8_0 activations (and weights), as `quantize_row_q8_0_ref`.
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [u8]) {
    quantize_row_q8_0_as(src, dst, Q8Variant::Reference);
}

/// Q8_0 as the chosen ggml implementation does it.
pub fn quantize_row_q8_0_as(src: &[f32], dst: &mut [u8], variant: Q8Variant) {
    check_lens::<BlockQ8_0>(src, dst);
    for (x, out) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ8_0::BYTES))
    {
        let (d, qs) = q8_block(x, variant);
        BlockQ8_0 { d: fp16(d), qs }.write(out);
    }
}

/// Q8_1 activations, as `quantize_row_q8_1_ref` (`s = fp16(sum(q) * d)`).
pub fn quantize_row_q8_1(src: &[f32], dst: &mut [u8]) {
    quantize_row_q8_1_as(src, dst, Q8Variant::Reference);
}

/// Q8_1 as the chosen ggml implementation does it (the SIMD paths compute `s` the same way).
pub fn quantize_row_q8_1_as(src: &[f32], dst: &mut [u8], variant: Q8Variant) {
    check_lens::<BlockQ8_1>(src, dst);
    for (x, out) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ8_1::BYTES))
    {
        let (d, qs) = q8_block(x, variant);
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        BlockQ8_1 {
            d: fp16(d),
            s: fp16(sum as f32 * d),
            qs,
        }
        .write(out);
    }
}

/// Q8_K activations, as `quantize_row_q8_K_ref` (the only Q8_K quantizer ggml-cpu has).
///
/// An all-zero block gets `d = 0`, zero quants and zero `bsums` (ggml leaves `bsums` unwritten
/// there; every dot product multiplies them by `d = 0`).
pub fn quantize_row_q8_k(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ8K>(src, dst);
    for (x, out) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ8K::BYTES))
    {
        let mut max = 0.0f32;
        let mut amax = 0.0f32;
        for &v in x {
            let ax = v.abs();
            if ax > amax {
                amax = ax;
                max = v;
            }
        }
        let mut b = BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        };
        if amax != 0.0 {
            let iscale = -127.0 / max;
            for (q, &v) in b.qs.iter_mut().zip(x) {
                *q = nearest_int(iscale * v).min(127) as i8;
            }
            for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
                *s = q.iter().map(|&v| v as i32).sum::<i32>() as i16;
            }
            b.d = 1.0 / iscale;
        }
        b.write(out);
    }
}

/// The first element of largest magnitude, with its sign (ggml's `amax`/`max` scan).
#[inline]
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Minimum and maximum of a block as ggml's legacy `_1` quantizers scan them.
#[inline]
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// Q4_0 weights, as `quantize_row_q4_0_ref`.
pub fn quantize_row_q4_0(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ4_0>(src, dst);
    for (x, out) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ4_0::BYTES))
    {
        let d = signed_absmax(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            // C: MIN(15, (int8_t)(x*id + 8.5f)), truncating toward zero.
            let xi0 = ((x[j] * id + 8.5) as i32 as i8).min(15) as u8;
            let xi1 = ((x[j + 16] * id + 8.5) as i32 as i8).min(15) as u8;
            *q = xi0 | (xi1 << 4);
        }
        BlockQ4_0 { d: fp16(d), qs }.write(out);
    }
}

/// Q4_1 weights, as `quantize_row_q4_1_ref`.
pub fn quantize_row_q4_1(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ4_1>(src, dst);
    for (x, out) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ4_1::BYTES))
    {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            let xi0 = (((x[j] - min) * id + 0.5) as i32 as i8).min(15) as u8;
            let xi1 = (((x[j + 16] - min) * id + 0.5) as i32 as i8).min(15) as u8;
            *q = xi0 | (xi1 << 4);
        }
        BlockQ4_1 {
            d: fp16(d),
            m: fp16(min),
            qs,
        }
        .write(out);
    }
}

/// Packs 32 five-bit values into (qh, qs) as ggml's Q5 quantizers do.
#[inline]
pub(crate) fn pack_q5(v: &[u8; 32]) -> ([u8; 4], [u8; 16]) {
    let mut qh = 0u32;
    let mut qs = [0u8; 16];
    for j in 0..16 {
        let (a, b) = (v[j], v[j + 16]);
        qs[j] = (a & 0x0F) | ((b & 0x0F) << 4);
        qh |= (((a & 0x10) as u32) >> 4) << j;
        qh |= (((b & 0x10) as u32) >> 4) << (j + 16);
    }
    (qh.to_le_bytes(), qs)
}

/// Q5_0 weights, as `quantize_row_q5_0_ref`.
pub fn quantize_row_q5_0(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ5_0>(src, dst);
    for (x, out) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ5_0::BYTES))
    {
        let d = signed_absmax(x) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut v = [0u8; 32];
        for (q, &xv) in v.iter_mut().zip(x) {
            *q = ((xv * id + 16.5) as i32 as i8).min(31) as u8;
        }
        let (qh, qs) = pack_q5(&v);
        BlockQ5_0 { d: fp16(d), qh, qs }.write(out);
    }
}

/// Q5_1 weights, as `quantize_row_q5_1_ref`.
pub fn quantize_row_q5_1(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ5_1>(src, dst);
    for (x, out) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ5_1::BYTES))
    {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut v = [0u8; 32];
        for (q, &xv) in v.iter_mut().zip(x) {
            // C: (uint8_t)(x*id + 0.5f) with no clamp (the value is in 0..=31 by construction).
            *q = ((xv - min) * id + 0.5) as i32 as u8;
        }
        let (qh, qs) = pack_q5(&v);
        BlockQ5_1 {
            d: fp16(d),
            m: fp16(min),
            qh,
            qs,
        }
        .write(out);
    }
}

/// F16 weights/activations: round to nearest even, little-endian.
pub fn quantize_row_f16(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * 2);
    for (o, &v) in dst.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&fp16(v).to_le_bytes());
    }
}

/// BF16 weights/activations, as `GGML_FP32_TO_BF16`.
pub fn quantize_row_bf16(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * 2);
    for (o, &v) in dst.chunks_exact_mut(2).zip(src) {
        o.copy_from_slice(&fp32_to_bf16(v).to_le_bytes());
    }
}

/// F32: the values' little-endian bytes.
pub fn quantize_row_f32(src: &[f32], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * 4);
    for (o, &v) in dst.chunks_exact_mut(4).zip(src) {
        o.copy_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod rne_tests {
    #[test]
    fn rne_small_equals_round_ties_even() {
        let mut x = -300.0f32;
        while x < 300.0 {
            for v in [x, x + 0.5, x - 0.5, x.next_up(), (x + 0.5).next_down()] {
                assert_eq!(super::rne_small(v), v.round_ties_even(), "{v}");
            }
            x += 0.25;
        }
        assert!(super::rne_small(f32::NAN).is_nan());
        assert_eq!(super::rne_small(1e9), 1e9);
    }
}
