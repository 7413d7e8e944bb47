//! AVX-512 VNNI kernel over wide Q6_K panels of sixteen rows (see the parent module for the
//! layouts and the arithmetic).
//!
//! One 64-byte load holds four values of sixteen weight rows; `vpdpbusd` multiplies them
//! (unsigned, 0..64) with four activation bytes broadcast to all lanes and adds the four products
//! into each row's i32 lane, so after the four steps of a sub-block every lane holds that row's
//! exact sub-block sum, which `vpmulld` weights by the row's scale. The `-32` offset is taken off
//! once per super-block as in the AVX2 kernel (`vpdpwssd` of the scale pairs with the Q8_K block
//! sums). The integers are exact and the float steps are the AVX2 kernel's, lane for lane, so
//! every output is bit-identical to it and to the scalar twin.

use std::arch::x86_64::*;

use crate::kernels::cpu::simd::avx512::bcast32x16;

use super::{A_BYTES, WIDE, WIDE_BLOCK};

/// See [`super::dot_wide`].
///
/// # Safety
/// The AVX-512 level is available; `panel` points at `nb` wide panel blocks; `a + r * stride`
/// for `r < m` at `nb` Q8_K blocks; `1 <= m <= 4`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_wide(
    nb: usize,
    panel: *const u8,
    a: *const u8,
    stride: usize,
    m: usize,
    out: &mut [[f32; WIDE]; 4],
) {
    match m {
        4 => rows_m::<4>(nb, panel, a, stride, out),
        3 => rows_m::<3>(nb, panel, a, stride, out),
        2 => rows_m::<2>(nb, panel, a, stride, out),
        _ => rows_m::<1>(nb, panel, a, stride, out),
    }
}

/// [`dot_wide`] for `M` rows.
///
/// # Safety
/// As [`dot_wide`] with `m = M`.
#[allow(clippy::needless_range_loop)] // rows index several arrays at once
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_m<const M: usize>(
    nb: usize,
    panel: *const u8,
    a: *const u8,
    stride: usize,
    out: &mut [[f32; WIDE]; 4],
) {
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..nb {
        let x = panel.add(b * WIDE_BLOCK);
        let ya = a.add(b * A_BYTES);
        let mut sum = [_mm512_setzero_si512(); M];
        for sb in 0..16 {
            let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(x.add(64 + 16 * sb).cast()));
            let mut s = [_mm512_setzero_si512(); M];
            for st in 0..4 {
                let wv = _mm512_loadu_si512(x.add(320 + 64 * (4 * sb + st)).cast());
                for r in 0..M {
                    let y = ya.add(r * stride + 4 + 16 * sb + 4 * st);
                    s[r] = _mm512_dpbusd_epi32(s[r], wv, bcast32x16(y));
                }
            }
            for r in 0..M {
                sum[r] = _mm512_add_epi32(sum[r], _mm512_mullo_epi32(s[r], sc));
            }
        }
        // 32 · Σ_sb scale_sb · bsum_sb, two sub-blocks per `vpdpwssd`.
        let mut corr = [_mm512_setzero_si512(); M];
        for j in 0..8 {
            let s0 = _mm_loadu_si128(x.add(64 + 32 * j).cast());
            let s1 = _mm_loadu_si128(x.add(80 + 32 * j).cast());
            let sp = _mm512_cvtepi8_epi16(_mm256_set_m128i(
                _mm_unpackhi_epi8(s0, s1),
                _mm_unpacklo_epi8(s0, s1),
            ));
            for r in 0..M {
                let bs = bcast32x16(ya.add(r * stride + 260 + 4 * j));
                corr[r] = _mm512_dpwssd_epi32(corr[r], sp, bs);
            }
        }
        let dw = _mm512_loadu_ps(x.cast());
        for r in 0..M {
            let isum = _mm512_sub_epi32(sum[r], _mm512_slli_epi32::<5>(corr[r]));
            let ad = _mm512_set1_ps(ya.add(r * stride).cast::<f32>().read_unaligned());
            let prod = _mm512_mul_ps(dw, _mm512_cvtepi32_ps(isum));
            acc[r] = _mm512_fmadd_ps(prod, ad, acc[r]);
        }
    }
    for r in 0..M {
        _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
}
