//! AVX-512 decode kernels for Q8_0 and Q5_0 weights (Q8_0 activations): the AVX2 four-row
//! kernels (`simd::avx2::legacy`) with `vpdpbusd` in place of `vpmaddubsw` + `vpmaddwd` (the same
//! four products per i32 lane, and the AVX2 pair sums never saturate for these values, so the
//! integers are equal) and, for Q5_0, the fifth bits expanded by one `vpmovm2b` instead of a
//! shuffle, an OR and a compare. Float steps are untouched, so results are bit-identical to the
//! AVX2 kernels and their scalar twins.

use std::arch::x86_64::*;

use super::wrows_entry;
use crate::kernels::cpu::simd::avx2::bytes_from_nibbles_32;
use crate::kernels::cpu::simd::avx2::legacy::{q5_0_rows, q8_0_rows, signed_q8_0_wrows4};
use crate::quant::blocks::{Block, BlockQ5_0, BlockQ8_0};

/// `vpdpbusd` from zero: four u8 × i8 products summed into each i32 lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn dp(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// Q8_0: four weight rows against one activation row.
///
/// # Safety
/// The AVX-512 level is available; as the AVX2 `signed_q8_0_wrows4` with Q8_0 weight blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0_wrows4(nb: usize, w: *const u8, row_bytes: usize, a: *const u8, out: *mut f32) {
    // SAFETY (of the closure's read): `x` is a block pointer, whose 32 quants sit at 2..34.
    let unpack = |x: *const u8| _mm256_loadu_si256(x.add(2).cast());
    signed_q8_0_wrows4(
        nb,
        w,
        BlockQ8_0::BYTES,
        row_bytes,
        a,
        out,
        unpack,
        |u, s| dp(u, s),
    );
}

/// Q5_0: four weight rows against one activation row.
///
/// # Safety
/// The AVX-512 level is available; as the AVX2 `signed_q8_0_wrows4` with Q5_0 weight blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q5_0_wrows4(nb: usize, w: *const u8, row_bytes: usize, a: *const u8, out: *mut f32) {
    // SAFETY (of the closure's reads): `qh` sits at 2..6 and `qs` at 6..22 of the block.
    let unpack = |x: *const u8| {
        let bits = _mm256_movm_epi8(x.add(2).cast::<u32>().read_unaligned());
        let hi = _mm256_andnot_si256(bits, _mm256_set1_epi8(-16));
        _mm256_or_si256(bytes_from_nibbles_32(x.add(6)), hi)
    };
    signed_q8_0_wrows4(
        nb,
        w,
        BlockQ5_0::BYTES,
        row_bytes,
        a,
        out,
        unpack,
        |u, s| dp(u, s),
    );
}

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
