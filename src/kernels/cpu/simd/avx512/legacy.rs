//! AVX-512 decode kernels for the 32-value weight types with Q8_0 activations (Q8_0, Q5_0): four
//! weight rows against one activation row, as the AVX2 `signed_q8_0_wrows4`, with fewer
//! instructions per block.
//!
//! The AVX2 kernel builds each block's eight i32 lanes (four products each) with the sign trick
//! (`vpsignb` twice, `vpmaddubsw`, `vpmaddwd`), and Q5_0 first expands its fifth bits with a
//! shuffle, an `or` and a compare. Here the weights go into `vpdpbusd` as *unsigned* bytes
//! offset by `o` (128 for Q8_0: `q ^ 0x80`; 16 for Q5_0: the stored 5-bit value, the fifth bit
//! added under a byte mask loaded straight from `qh`), and the accumulator starts from
//! `-o · Σ a` per lane, formed once per block for all four rows: `Σ (q + o)·a - o·Σ a = Σ q·a`,
//! exactly the integers of the AVX2 kernel for activation codes within ±127, which is all the
//! Q8_0 quantizer produces (its i16 pair sums never saturate there; it would negate a -128 to
//! itself, this kernel would not).
//! The float steps are the AVX2 kernel's, lane for lane (`d_w · d_a` rounded, one FMA per block,
//! `hsum_float_8` at the end), so results are bit-identical, which the tests check.

use std::arch::x86_64::*;

use super::wrows_entry;
use crate::kernels::cpu::simd::avx2::legacy::{
    prefetch_run_ahead, q5_0_rows, q8_0_activation_entries, q8_0_rows,
};
use crate::kernels::cpu::simd::avx2::{f16_bcast, hsum_float_8, ld, ld128, rd_u32};
use crate::quant::blocks::{Block, BlockQ5_0, BlockQ8_0};

/// Four weight rows (`row_bytes` apart, `wbytes`-byte blocks) against one Q8_0 activation row:
/// `unsigned(x)` gives a block's 32 weights offset by `off` as unsigned bytes.
///
/// # Safety
/// The AVX-512 level is available; four rows of `nb` blocks at `w + r * row_bytes`, one
/// activation row of `nb` Q8_0 blocks at `a`; `out` has four slots; `unsigned` reads only inside
/// the block it is given.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn wrows4(
    nb: usize,
    w: *const u8,
    wbytes: usize,
    row_bytes: usize,
    a: *const u8,
    out: *mut f32,
    off: i8,
    unsigned: impl Fn(*const u8) -> __m256i,
) {
    let mut acc = [_mm256_setzero_ps(); 4];
    let offset = _mm256_set1_epi8(off);
    let mut x = w;
    let mut ya = a;
    for b in 0..nb {
        // The AVX2 kernel's prefetches.
        prefetch_run_ahead(w, wbytes, row_bytes, b);
        let (ay, da) = (ld(ya.add(2)), f16_bcast(ya));
        // -off · (sum of each lane's four activations), shared by the four rows.
        let start = _mm256_sub_epi32(
            _mm256_setzero_si256(),
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), offset, ay),
        );
        for (r, c) in acc.iter_mut().enumerate() {
            let xr = x.add(r * row_bytes);
            let q = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(start, unsigned(xr), ay));
            *c = _mm256_fmadd_ps(_mm256_mul_ps(f16_bcast(xr), da), q, *c);
        }
        x = x.add(wbytes);
        ya = ya.add(BlockQ8_0::BYTES);
    }
    for (r, c) in acc.iter().enumerate() {
        *out.add(r) = hsum_float_8(*c);
    }
}

/// Q8_0: four weight rows against one activation row ([`wrows4`], weights `q ^ 0x80 = q + 128`).
///
/// # Safety
/// As [`wrows4`], with Q8_0 weight blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0_wrows4(nb: usize, w: *const u8, row_bytes: usize, a: *const u8, out: *mut f32) {
    let flip = _mm256_set1_epi8(-128);
    // SAFETY (of the closure's read): `x` is a block pointer, whose 32 quants sit at 2..34.
    let unsigned = |x: *const u8| _mm256_xor_si256(ld(x.add(2)), flip);
    wrows4(nb, w, BlockQ8_0::BYTES, row_bytes, a, out, -128, unsigned);
}

/// Q5_0: four weight rows against one activation row ([`wrows4`], weights as their stored 5-bit
/// values `q + 16`: the nibble, plus 16 where the block's `qh` bit is set).
///
/// # Safety
/// As [`wrows4`], with Q5_0 weight blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q5_0_wrows4(nb: usize, w: *const u8, row_bytes: usize, a: *const u8, out: *mut f32) {
    let (m4, c16) = (_mm256_set1_epi8(0xF), _mm256_set1_epi8(16));
    // The 16 nibble bytes in both halves, the high half shifted down by four (one variable shift
    // instead of a shift and an insert).
    let shifts = _mm256_set_epi64x(0x0004_0004_0004_0004, 0x0004_0004_0004_0004, 0, 0);
    // SAFETY (of the closure's reads): `qh` sits at 2..6 and `qs` at 6..22 of the block.
    let unsigned = |x: *const u8| {
        let t = _mm256_broadcastsi128_si256(ld128(x.add(6)));
        let nib = _mm256_and_si256(_mm256_srlv_epi16(t, shifts), m4);
        _mm256_mask_add_epi8(nib, rd_u32(x.add(2)), nib, c16)
    };
    wrows4(nb, w, BlockQ5_0::BYTES, row_bytes, a, out, 16, unsigned);
}

q8_0_activation_entries!();
