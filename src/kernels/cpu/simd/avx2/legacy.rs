//! AVX2 kernels for the 32-value blocks: Q4_0, Q5_0, Q8_0, IQ4_NL × Q8_0 and Q4_1, Q5_1 × Q8_1.
//!
//! Each `*_rows::<M>` unpacks one weight block to 32 bytes once and multiplies it with `M`
//! activation rows. Signed × signed products use ggml's sign transfer (`|w|` times `a` carrying
//! `w`'s sign, `vpmaddubsw`, `vpmaddwd` by ones): exact as long as no activation byte is -128.
//! Float accumulation per row follows what llama.cpp runs on an AVX2 machine:
//! - Q4_0 and IQ4_NL: the repacked `gemv_q4_0_8x8_q8_0` and `gemv_iq4_nl_8x8_q8_0` (llama.cpp
//!   repacks both on AVX2; for IQ4_NL its GEMM accumulates the same way) — one integer sum per
//!   block, `acc = fma(isum, d_w * d_a, acc)` (rows in the lanes of one vector). IQ4_NL's weight
//!   bytes are its nibbles looked up in `kvalues_iq4nl` (`vpshufb`).
//! - Q5_0, Q8_0, Q4_1, Q5_1: `ggml_vec_dot_*`'s AVX2 branch — eight i32 lanes per block
//!   (lane `l` = bytes `4l..4l+4`), `acc = fma(d_w * d_a, lanes, acc)`, `hsum_float_8`; Q4_1/Q5_1
//!   add `Σ m_w * s_a` kept in a scalar (fused, as compilers contract ggml's `summs += m * s`).
//!
//! Layouts (byte offsets): Q4_0 and IQ4_NL `d`@0 `qs`@2; Q4_1 `d`@0 `m`@2 `qs`@4; Q5_0 `d`@0 `qh`@2 `qs`@6;
//! Q5_1 `d`@0 `m`@2 `qh`@4 `qs`@8; Q8_0 `d`@0 `qs`@2; Q8_1 `d`@0 `s`@2 `qs`@4.

use std::arch::x86_64::*;

use super::{
    bytes_from_bits_32, bytes_from_nibbles_32, entries, f16_bcast, f16x2_at, f16x4_gather,
    hsum_float_8, hsum_rows, ld, ld128, mul_sum_us8, prefetch_ahead, wrows_entry,
};
use crate::quant::blocks::{
    Block, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, BlockQ8_1,
};
use crate::quant::iq4_nl::{BlockIQ4NL, KVALUES};

const QK: usize = 32;

entries!(
    q4_0_dot,
    q4_0_tile,
    q4_0_rows,
    QK,
    BlockQ4_0::BYTES,
    BlockQ8_0::BYTES,
    4
);
entries!(
    iq4_nl_dot,
    iq4_nl_tile,
    iq4_nl_rows,
    QK,
    BlockIQ4NL::BYTES,
    BlockQ8_0::BYTES,
    4
);
entries!(
    q5_0_dot,
    q5_0_tile,
    q5_0_rows,
    QK,
    BlockQ5_0::BYTES,
    BlockQ8_0::BYTES,
    4
);
entries!(
    q8_0_dot,
    q8_0_tile,
    q8_0_rows,
    QK,
    BlockQ8_0::BYTES,
    BlockQ8_0::BYTES,
    4
);
entries!(
    q4_1_dot,
    q4_1_tile,
    q4_1_rows,
    QK,
    BlockQ4_1::BYTES,
    BlockQ8_1::BYTES,
    4
);
entries!(
    q5_1_dot,
    q5_1_tile,
    q5_1_rows,
    QK,
    BlockQ5_1::BYTES,
    BlockQ8_1::BYTES,
    4
);

/// Q4_0 (values `nibble - 8`).
///
/// # Safety
/// AVX2, FMA and F16C are available; `w` points at `nb` Q4_0 blocks; `a + r * stride` for
/// `r < M` at `nb` Q8_0 blocks; `out` at `M` writable f32 slots.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    nibble_rows::<M>(nb, w, BlockQ4_0::BYTES, a, stride, out, |x| {
        _mm256_sub_epi8(bytes_from_nibbles_32(x.add(2)), _mm256_set1_epi8(8))
    })
}

/// IQ4_NL (values `kvalues_iq4nl[nibble]`).
///
/// # Safety
/// As [`q4_0_rows`], with `nb` IQ4_NL blocks at `w`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn iq4_nl_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    let table = _mm256_broadcastsi128_si256(ld128(KVALUES.as_ptr().cast()));
    nibble_rows::<M>(nb, w, BlockIQ4NL::BYTES, a, stride, out, |x| {
        _mm256_shuffle_epi8(table, bytes_from_nibbles_32(x.add(2)))
    })
}

/// The shared body of the 4-bit × Q8_0 kernels (Q4_0, IQ4_NL): `unpack(x)` gives a block's 32
/// signed weight bytes (none -128) from its block pointer (`d` at 0); one exact integer sum per
/// block and row, `acc = fma(isum, d_w * d_a, acc)`.
///
/// # Safety
/// As [`q4_0_rows`], with `wbytes`-byte weight blocks that `unpack` reads within.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    wbytes: usize,
    a: *const u8,
    stride: usize,
    out: *mut f32,
    unpack: impl Fn(*const u8) -> __m256i,
) {
    let mut acc = _mm_setzero_ps();
    for b in 0..nb {
        let x = w.add(b * wbytes);
        prefetch_ahead(x, 1);
        let ya = a.add(b * BlockQ8_0::BYTES);
        let qx = unpack(x);
        let ax = _mm256_sign_epi8(qx, qx);
        let mut isum = [_mm256_setzero_si256(); M];
        let mut yr = [ya; M];
        for (r, (s, y)) in isum.iter_mut().zip(yr.iter_mut()).enumerate() {
            *y = ya.add(r * stride);
            *s = mul_sum_us8(ax, _mm256_sign_epi8(ld(y.add(2)), qx));
        }
        let d = _mm_mul_ps(_mm256_castps256_ps128(f16_bcast(x)), f16x4_gather(&yr));
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum_rows(&isum)), d, acc);
    }
    let mut res = [0f32; 4];
    _mm_storeu_ps(res.as_mut_ptr(), acc);
    std::ptr::copy_nonoverlapping(res.as_ptr(), out, M);
}

/// The shared body of the signed × Q8_0 kernels (Q5_0, Q8_0): `unpack(x)` gives a block's 32
/// signed weight bytes from its block pointer.
///
/// # Safety
/// As [`q4_0_rows`], with `wbytes`-byte weight blocks that `unpack` reads within.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn signed_q8_0_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    wbytes: usize,
    a: *const u8,
    stride: usize,
    out: *mut f32,
    unpack: impl Fn(*const u8) -> __m256i,
) {
    let mut acc = [_mm256_setzero_ps(); M];
    for b in 0..nb {
        let x = w.add(b * wbytes);
        prefetch_ahead(x, 1);
        let ya = a.add(b * BlockQ8_0::BYTES);
        let qx = unpack(x);
        let ax = _mm256_sign_epi8(qx, qx);
        let dw = f16_bcast(x);
        for (r, ac) in acc.iter_mut().enumerate() {
            let y = ya.add(r * stride);
            let q = _mm256_cvtepi32_ps(mul_sum_us8(ax, _mm256_sign_epi8(ld(y.add(2)), qx)));
            let d = _mm256_mul_ps(dw, f16_bcast(y));
            *ac = _mm256_fmadd_ps(d, q, *ac);
        }
    }
    for (r, ac) in acc.iter().enumerate() {
        *out.add(r) = hsum_float_8(*ac);
    }
}

/// The decode shape of [`signed_q8_0_rows`]: four weight rows (`row_bytes` apart) against ONE
/// activation row, whose blocks are loaded once for all four. Each weight row keeps its own
/// eight-lane accumulator and the same float operations as `rows::<1>`, so `out[r]` is
/// bit-identical to the `dot` of row `r`; the four independent chains hide the FMA latency that
/// bounds a single row.
///
/// # Safety
/// As [`signed_q8_0_rows`], with four weight rows of `nb` blocks at `w + r * row_bytes` and one
/// activation row; `out` has four slots.
#[inline(always)]
unsafe fn signed_q8_0_wrows4(
    nb: usize,
    w: *const u8,
    wbytes: usize,
    row_bytes: usize,
    a: *const u8,
    out: *mut f32,
    unpack: impl Fn(*const u8) -> __m256i,
) {
    let (mut c0, mut c1, mut c2, mut c3) = (
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
        _mm256_setzero_ps(),
    );
    let step = |x: *const u8, ay: __m256i, da: __m256, acc: __m256| {
        let qx = unpack(x);
        let ax = _mm256_sign_epi8(qx, qx);
        let q = _mm256_cvtepi32_ps(mul_sum_us8(ax, _mm256_sign_epi8(ay, qx)));
        _mm256_fmadd_ps(_mm256_mul_ps(f16_bcast(x), da), q, acc)
    };
    let mut x = w;
    let mut ya = a;
    for b in 0..nb {
        prefetch_run_ahead(w, wbytes, row_bytes, b);
        let (ay, da) = (ld(ya.add(2)), f16_bcast(ya));
        c0 = step(x, ay, da, c0);
        c1 = step(x.add(row_bytes), ay, da, c1);
        c2 = step(x.add(2 * row_bytes), ay, da, c2);
        c3 = step(x.add(3 * row_bytes), ay, da, c3);
        x = x.add(wbytes);
        ya = ya.add(BlockQ8_0::BYTES);
    }
    *out = hsum_float_8(c0);
    *out.add(1) = hsum_float_8(c1);
    *out.add(2) = hsum_float_8(c2);
    *out.add(3) = hsum_float_8(c3);
}

/// Prefetches what a four-row decode kernel reads for block `b` four runs ahead. The four rows
/// (`w`, `row_bytes` apart, `wbytes`-byte blocks) are one contiguous run of `4 * row_bytes`
/// bytes, short streams the hardware prefetcher does not pick up: each block step prefetches the
/// matching part of the fourth run after this one, into L1. On the AMD EPYC development machine
/// (a 178 MB Q8_0 matrix of Gemma-3's head shape on two threads, variants alternated in one
/// process, three sweeps while the probe read 72-81 GB/s) that streamed 74-97 GB/s. In the sweep
/// at 81 GB/s: two runs ahead into L2 (the earlier choice, made on an Intel Xeon, where into L2
/// was a few percent faster) 68.7, two runs into L1 84.8, three 93.0, four 97.0; the Q5_0 kernel
/// 37.2 GB/s two runs into L2, 48.6 four runs into L1. Never faults (prefetches are hints; the
/// address may lie past the weights).
#[inline(always)]
pub(crate) fn prefetch_run_ahead(w: *const u8, wbytes: usize, row_bytes: usize, b: usize) {
    let pf = w.wrapping_add(16 * row_bytes + b * 4 * wbytes);
    for l in 0..(4 * wbytes).div_ceil(64) {
        // SAFETY: a prefetch is only a hint and never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(64 * l).cast()) };
    }
}

/// Q8_0: four weight rows against one activation row ([`signed_q8_0_wrows4`]).
///
/// # Safety
/// As [`signed_q8_0_wrows4`], with Q8_0 weight blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_wrows4(nb: usize, w: *const u8, row_bytes: usize, a: *const u8, out: *mut f32) {
    // SAFETY (of the closure's read): `x` is a block pointer, whose 32 quants sit at 2..34.
    let unpack = |x: *const u8| ld(x.add(2));
    signed_q8_0_wrows4(nb, w, BlockQ8_0::BYTES, row_bytes, a, out, unpack);
}

/// Q5_0: four weight rows against one activation row ([`signed_q8_0_wrows4`]).
///
/// # Safety
/// As [`signed_q8_0_wrows4`], with Q5_0 weight blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_wrows4(nb: usize, w: *const u8, row_bytes: usize, a: *const u8, out: *mut f32) {
    // SAFETY (of the closure's reads): `qh` sits at 2..6 and `qs` at 6..22 of the block.
    let unpack = |x: *const u8| {
        let hi = _mm256_andnot_si256(bytes_from_bits_32(x.add(2)), _mm256_set1_epi8(-16));
        _mm256_or_si256(bytes_from_nibbles_32(x.add(6)), hi)
    };
    signed_q8_0_wrows4(nb, w, BlockQ5_0::BYTES, row_bytes, a, out, unpack);
}

/// The `dot_rows` entries of the 32-value types with Q8_0 activations (`q8_0_dot_rows`,
/// `q5_0_dot_rows`) over the `q8_0_wrows4` / `q5_0_wrows4` and `q8_0_rows` / `q5_0_rows` in
/// scope where it is invoked (each SIMD level has its own four-row kernels).
macro_rules! q8_0_activation_entries {
    () => {
        wrows_entry!(
            q8_0_dot_rows,
            q8_0_wrows4,
            q8_0_rows,
            32,
            BlockQ8_0::BYTES,
            BlockQ8_0::BYTES
        );
        wrows_entry!(
            q5_0_dot_rows,
            q5_0_wrows4,
            q5_0_rows,
            32,
            BlockQ5_0::BYTES,
            BlockQ8_0::BYTES
        );
    };
}
pub(crate) use q8_0_activation_entries;

q8_0_activation_entries!();

/// Q8_0 × Q8_0.
///
/// # Safety
/// As [`q4_0_rows`], with Q8_0 weight blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q8_0_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    // SAFETY (of the closure's read): `x` is a block pointer, whose 32 quants sit at 2..34.
    let unpack = |x: *const u8| ld(x.add(2));
    signed_q8_0_rows::<M>(nb, w, BlockQ8_0::BYTES, a, stride, out, unpack);
}

/// Q5_0 (values `q5 - 16`: nibble | 0xF0 where the fifth bit is clear, as ggml builds them).
///
/// # Safety
/// As [`q4_0_rows`], with Q5_0 weight blocks.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q5_0_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    // SAFETY (of the closure's reads): `qh` sits at 2..6 and `qs` at 6..22 of the block.
    let unpack = |x: *const u8| {
        let hi = _mm256_andnot_si256(bytes_from_bits_32(x.add(2)), _mm256_set1_epi8(-16));
        _mm256_or_si256(bytes_from_nibbles_32(x.add(6)), hi)
    };
    signed_q8_0_rows::<M>(nb, w, BlockQ5_0::BYTES, a, stride, out, unpack);
}

/// The shared body of the unsigned × Q8_1 kernels (Q4_1, Q5_1): `unpack(x)` gives a block's 32
/// unsigned weight bytes; the block's `m` (f16 @2) times the activation's `s` is added apart.
///
/// # Safety
/// As [`q4_0_rows`], with `wbytes`-byte weight blocks that `unpack` reads within, and Q8_1
/// activation blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unsigned_q8_1_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    wbytes: usize,
    a: *const u8,
    stride: usize,
    out: *mut f32,
    unpack: impl Fn(*const u8) -> __m256i,
) {
    let mut acc = [_mm256_setzero_ps(); M];
    let mut summs = [0f32; M];
    for b in 0..nb {
        let x = w.add(b * wbytes);
        prefetch_ahead(x, 1);
        let ya = a.add(b * BlockQ8_1::BYTES);
        let qx = unpack(x);
        let (dw, mw) = f16x2_at(x);
        for (r, (ac, sm)) in acc.iter_mut().zip(summs.iter_mut()).enumerate() {
            let y = ya.add(r * stride);
            let (da, sa) = f16x2_at(y);
            *sm = mw.mul_add(sa, *sm);
            let q = _mm256_cvtepi32_ps(mul_sum_us8(qx, ld(y.add(4))));
            *ac = _mm256_fmadd_ps(_mm256_set1_ps(dw * da), q, *ac);
        }
    }
    for (r, (ac, sm)) in acc.iter().zip(summs.iter()).enumerate() {
        *out.add(r) = hsum_float_8(*ac) + sm;
    }
}

/// Q4_1 × Q8_1.
///
/// # Safety
/// As [`q4_0_rows`], with Q4_1 weight blocks and Q8_1 activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    // SAFETY (of the closure's read): `qs` sits at 4..20 of the block.
    let unpack = |x: *const u8| bytes_from_nibbles_32(x.add(4));
    unsigned_q8_1_rows::<M>(nb, w, BlockQ4_1::BYTES, a, stride, out, unpack);
}

/// Q5_1 × Q8_1 (values nibble | 0x10 where the fifth bit is set).
///
/// # Safety
/// As [`q4_0_rows`], with Q5_1 weight blocks and Q8_1 activation blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_1_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    // SAFETY (of the closure's reads): `qh` sits at 4..8 and `qs` at 8..24 of the block.
    let unpack = |x: *const u8| {
        let hi = _mm256_and_si256(bytes_from_bits_32(x.add(4)), _mm256_set1_epi8(0x10));
        _mm256_or_si256(bytes_from_nibbles_32(x.add(8)), hi)
    };
    unsigned_q8_1_rows::<M>(nb, w, BlockQ5_1::BYTES, a, stride, out, unpack);
}
