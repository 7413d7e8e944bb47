//! AVX2 kernel over Q6_K panels (see the parent module for the layout and the arithmetic).
//!
//! One 32-byte load holds four values of eight weight rows; `vpmaddubsw` multiplies them (unsigned,
//! 0..64) with four activation bytes broadcast to all lanes — at most 2·63·128 = 16128 per i16, so
//! two steps (8 values, half a sub-block) still fit an i16 — and `vpmaddwd` by the rows' scales
//! sums them exactly into i32 lanes, one per weight row. The `-32` offset is taken off once per
//! super-block: `32 · Σ_sb scale_sb · bsum_sb`, with the Q8_K block sums.

use std::arch::x86_64::*;

use crate::kernels::cpu::simd::avx2::{bcast32, ld};

use super::{A_BYTES, GROUP, PANEL_BLOCK};

/// See [`super::dot_group`].
///
/// # Safety
/// AVX2, FMA and F16C are available; `panel` points at `nb` panel blocks; `a + r * stride` for
/// `r < m` at `nb` Q8_K blocks; `1 <= m <= 4`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_group(
    nb: usize,
    panel: *const u8,
    a: *const u8,
    stride: usize,
    m: usize,
    out: &mut [[f32; GROUP]; 4],
) {
    match m {
        4 => rows_m::<4>(nb, panel, a, stride, out),
        3 => rows_m::<3>(nb, panel, a, stride, out),
        2 => rows_m::<2>(nb, panel, a, stride, out),
        _ => rows_m::<1>(nb, panel, a, stride, out),
    }
}

/// [`dot_group`] for `M` rows.
///
/// # Safety
/// As [`dot_group`] with `m = M`.
#[allow(clippy::needless_range_loop)] // rows index several arrays at once
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_m<const M: usize>(
    nb: usize,
    panel: *const u8,
    a: *const u8,
    stride: usize,
    out: &mut [[f32; GROUP]; 4],
) {
    let mut acc = [_mm256_setzero_ps(); M];
    for b in 0..nb {
        let x = panel.add(b * PANEL_BLOCK);
        let ya = a.add(b * A_BYTES);
        let mut sum = [_mm256_setzero_si256(); M];
        for sb in 0..16 {
            let sv = _mm_loadl_epi64(x.add(32 + 8 * sb).cast());
            let sv = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sv, sv));
            for h in 0..2 {
                let wq = x.add(160 + 32 * (4 * sb + 2 * h));
                let (w0, w1) = (ld(wq), ld(wq.add(32)));
                for r in 0..M {
                    let y = ya.add(r * stride + 4 + 16 * sb + 8 * h);
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w0, bcast32(y)),
                        _mm256_maddubs_epi16(w1, bcast32(y.add(4))),
                    );
                    sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(p, sv));
                }
            }
        }
        // 32 · Σ_sb scale_sb · bsum_sb, two sub-blocks per `vpmaddwd`.
        let mut corr = [_mm256_setzero_si256(); M];
        for j in 0..8 {
            let s0 = _mm_loadl_epi64(x.add(32 + 16 * j).cast());
            let s1 = _mm_loadl_epi64(x.add(40 + 16 * j).cast());
            let sp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));
            for r in 0..M {
                let bs = bcast32(ya.add(r * stride + 260 + 4 * j));
                corr[r] = _mm256_add_epi32(corr[r], _mm256_madd_epi16(sp, bs));
            }
        }
        let dw = _mm256_loadu_ps(x.cast());
        for r in 0..M {
            let isum = _mm256_sub_epi32(sum[r], _mm256_slli_epi32::<5>(corr[r]));
            let ad = _mm256_set1_ps(ya.add(r * stride).cast::<f32>().read_unaligned());
            let prod = _mm256_mul_ps(dw, _mm256_cvtepi32_ps(isum));
            acc[r] = _mm256_fmadd_ps(prod, ad, acc[r]);
        }
    }
    for r in 0..M {
        _mm256_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
}
