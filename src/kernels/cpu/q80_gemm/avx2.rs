//! AVX2 tile of [`super::tile`]: four weight rows × up to three activation rows, twelve eight-lane
//! accumulators; per pair exactly the `ggml_vec_dot_q8_0_q8_0` steps (`vpsignb`, `vpmaddubsw`,
//! `vpmaddwd` by ones, convert, `d_w · d_a`, FMA).

use std::arch::x86_64::*;

use super::{A_BYTES, GROUP, SLOT};

/// ggml's `hsum_float_8`: `((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7))`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_float_8(x: __m256) -> f32 {
    let mut r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// # Safety
/// AVX2, FMA and F16C are available; `panel` holds `nb` blocks of four rows; `a + j * stride`
/// (`j < m`) `nb` Q8_0 blocks and `da + j * nb` `nb` scales; `1 <= m <= 3`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile(
    nb: usize,
    panel: *const u8,
    a: *const u8,
    stride: usize,
    da: *const f32,
    m: usize,
    out: &mut [[f32; GROUP]; 3],
) {
    match m {
        3 => tile_m::<3>(nb, panel, a, stride, da, out),
        2 => tile_m::<2>(nb, panel, a, stride, da, out),
        _ => tile_m::<1>(nb, panel, a, stride, da, out),
    }
}

#[allow(clippy::needless_range_loop)] // rows and columns index several arrays at once
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_m<const M: usize>(
    nb: usize,
    panel: *const u8,
    a: *const u8,
    stride: usize,
    da: *const f32,
    out: &mut [[f32; GROUP]; 3],
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); GROUP]; M];
    for b in 0..nb {
        let p = panel.add(b * GROUP * SLOT);
        let mut dj = [0f32; M];
        for j in 0..M {
            dj[j] = *da.add(j * nb + b);
        }
        for r in 0..GROUP {
            let s = p.add(r * SLOT);
            let qx = _mm256_loadu_si256(s.add(16).cast());
            let ax = _mm256_loadu_si256(s.add(48).cast());
            let dw = *s.cast::<f32>();
            for j in 0..M {
                let y = _mm256_loadu_si256(a.add(j * stride + b * A_BYTES + 2).cast());
                let dot =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(y, qx)), ones);
                let d = _mm256_set1_ps(dw * dj[j]);
                acc[j][r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), acc[j][r]);
            }
        }
    }
    for j in 0..M {
        for r in 0..GROUP {
            out[j][r] = hsum_float_8(acc[j][r]);
        }
    }
}
