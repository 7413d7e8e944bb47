//! Scalar dequantization to f32, bit-for-bit as ggml's `dequantize_row_*` (`ggml-quants.c`).
//!
//! Every per-type function takes a row's raw bytes (a whole number of blocks, any alignment) and
//! writes exactly `blocks * ELEMS` floats. The arithmetic mirrors ggml's expression order and
//! operand types (int-to-float conversions, `d * sc` computed once per sub-block, no fused
//! multiply-add), so results are identical to ggml built without FP contraction (ggml-base on
//! x86-64) and to gguf-py's numpy dequantizers. [`dequantize_row`] dispatches on [`GgmlType`] and
//! checks the lengths.

use anyhow::{bail, ensure, Result};
use half::{bf16, f16};

use super::blocks::{
    get_scale_min_k4, iter_blocks, q3k_scales, Block, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
    BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, QK_K,
};
use crate::format::GgmlType;

/// Dequantizes one row of `ty` from `src` (exactly the row's bytes) into `dst` (its elements).
///
/// Supported: every registered weight type (`super::types::TYPES`) and the activation format Q8_K.
/// Errors for other types (naming the type), for `dst.len()` not a multiple of the block size, and
/// for `src.len()` differing from the bytes of `dst.len()` elements.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let f: fn(&[u8], &mut [f32]) = match super::types::ops(ty) {
        Some(o) => o.dequantize,
        None if ty == GgmlType::Q8K => dequantize_row_q8k,
        None => bail!("dequantization of {} is not supported", ty.name()),
    };
    let block = ty.block_size();
    ensure!(
        dst.len().is_multiple_of(block),
        "{} row of {} elements is not a whole number of {}-element blocks",
        ty.name(),
        dst.len(),
        block
    );
    let want = dst.len() / block * ty.type_size();
    ensure!(
        src.len() == want,
        "{} row of {} elements needs {} bytes, got {}",
        ty.name(),
        dst.len(),
        want,
        src.len()
    );
    f(src, dst);
    Ok(())
}

/// Splits `dst` into one chunk per block of `src`, asserting the counts agree.
fn chunks<'a, B: Block>(
    src: &'a [u8],
    dst: &'a mut [f32],
) -> impl Iterator<Item = (B, &'a mut [f32])> {
    assert_eq!(
        src.len() / B::BYTES * B::ELEMS,
        dst.len(),
        "source blocks and destination length disagree"
    );
    iter_blocks::<B>(src).zip(dst.chunks_exact_mut(B::ELEMS))
}

/// F32: the little-endian floats themselves.
pub fn dequantize_row_f32(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * 4);
    for (o, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// F16: exact widening.
pub fn dequantize_row_f16(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * 2);
    for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// BF16: exact widening (the bits shifted into the top half of an f32).
pub fn dequantize_row_bf16(src: &[u8], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len() * 2);
    for (o, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Q4_0: `(q - 8) * d`.
pub fn dequantize_row_q4_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ4_0>(src, dst) {
        let d = b.d.to_f32();
        for (j, &q) in b.qs.iter().enumerate() {
            y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// Q4_1: `q * d + m`.
pub fn dequantize_row_q4_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ4_1>(src, dst) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        for (j, &q) in b.qs.iter().enumerate() {
            y[j] = (q & 0x0F) as f32 * d + m;
            y[j + 16] = (q >> 4) as f32 * d + m;
        }
    }
}

/// The 5-bit values of a Q5_0/Q5_1 block: nibble from `qs`, bit 4 from bit j of `qh`.
#[inline]
fn q5_values(qh: &[u8; 4], qs: &[u8; 16]) -> [u8; 32] {
    let qh = u32::from_le_bytes(*qh);
    let mut v = [0u8; 32];
    for (j, &q) in qs.iter().enumerate() {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        v[j] = (q & 0x0F) | h0;
        v[j + 16] = (q >> 4) | h1;
    }
    v
}

/// Q5_0: `(q - 16) * d`.
pub fn dequantize_row_q5_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ5_0>(src, dst) {
        let d = b.d.to_f32();
        for (o, q) in y.iter_mut().zip(q5_values(&b.qh, &b.qs)) {
            *o = (q as i32 - 16) as f32 * d;
        }
    }
}

/// Q5_1: `q * d + m`.
pub fn dequantize_row_q5_1(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ5_1>(src, dst) {
        let d = b.d.to_f32();
        let m = b.m.to_f32();
        for (o, q) in y.iter_mut().zip(q5_values(&b.qh, &b.qs)) {
            *o = q as f32 * d + m;
        }
    }
}

/// Q8_0: `q * d`.
pub fn dequantize_row_q8_0(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ8_0>(src, dst) {
        let d = b.d.to_f32();
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = q as f32 * d;
        }
    }
}

/// Q2_K: per 16 values `dl * q - ml` with `dl = d * (sc & 15)`, `ml = dmin * (sc >> 4)`.
pub fn dequantize_row_q2k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ2K>(src, dst) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        let mut out = 0;
        let mut is = 0;
        for q in b.qs.chunks_exact(32) {
            for shift in [0, 2, 4, 6] {
                for half in [&q[..16], &q[16..]] {
                    let sc = b.scales[is];
                    is += 1;
                    let dl = d * (sc & 0xF) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for &ql in half {
                        y[out] = dl * ((ql >> shift) & 3) as f32 - ml;
                        out += 1;
                    }
                }
            }
        }
    }
}

/// Q3_K: per 16 values `dl * (q - 4 * !hbit)` with `dl = d * (sc - 32)`.
pub fn dequantize_row_q3k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ3K>(src, dst) {
        let d_all = b.d.to_f32();
        let scales = q3k_scales(&b.scales);
        let mut out = 0;
        let mut is = 0;
        let mut m: u8 = 1;
        for q in b.qs.chunks_exact(32) {
            for shift in [0, 2, 4, 6] {
                for off in [0, 16] {
                    let dl = d_all * (scales[is] as i32 - 32) as f32;
                    is += 1;
                    for (&ql, &h) in q[off..off + 16].iter().zip(&b.hmask[off..off + 16]) {
                        let low = ((ql >> shift) & 3) as i32;
                        let sub = if h & m != 0 { 0 } else { 4 };
                        y[out] = dl * (low - sub) as f32;
                        out += 1;
                    }
                }
                m = m.wrapping_shl(1);
            }
        }
    }
}

/// Q4_K: per 32 values `d * sc * q - dmin * m`.
pub fn dequantize_row_q4k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ4K>(src, dst) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for (j, (q, y)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
        {
            let (sc1, m1) = get_scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = get_scale_min_k4(2 * j + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0xF) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

/// Q5_K: per 32 values `d * sc * q - dmin * m`, q with its fifth bit from `qh`.
pub fn dequantize_row_q5k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ5K>(src, dst) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for (j, (ql, y)) in
            b.qs.chunks_exact(32)
                .zip(y.chunks_exact_mut(64))
                .enumerate()
        {
            let (sc1, m1) = get_scale_min_k4(2 * j, &b.scales);
            let (sc2, m2) = get_scale_min_k4(2 * j + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let u1 = 1u8 << (2 * j);
            let u2 = 2u8 << (2 * j);
            for l in 0..32 {
                let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0xF) + h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

/// The 256 signed 6-bit values (-32..32) of a Q6_K block, in element order.
#[inline]
pub(crate) fn q6k_values(b: &BlockQ6K) -> [i8; QK_K] {
    let mut a = [0i8; QK_K];
    for ((ql, qh), a) in
        b.ql.chunks_exact(64)
            .zip(b.qh.chunks_exact(32))
            .zip(a.chunks_exact_mut(128))
    {
        for l in 0..32 {
            a[l] = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            a[l + 32] = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            a[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            a[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    a
}

/// Q6_K: `d * sc * q` per 16 values, evaluated as `(d * sc) * q`.
pub fn dequantize_row_q6k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ6K>(src, dst) {
        let d = b.d.to_f32();
        let q = q6k_values(&b);
        for (i, (o, &q)) in y.iter_mut().zip(&q).enumerate() {
            *o = d * b.scales[i / 16] as f32 * q as f32;
        }
    }
}

/// Q8_K: `d * q` with an f32 `d`.
pub fn dequantize_row_q8k(src: &[u8], dst: &mut [f32]) {
    for (b, y) in chunks::<BlockQ8K>(src, dst) {
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = b.d * q as f32;
        }
    }
}
