//! AVX2 tile of [`super::tile`]: four weight rows × up to three activation rows, twelve eight-lane
//! accumulators; per pair exactly the `ggml_vec_dot_q8_0_q8_0` steps (`vpsignb`, `vpmaddubsw`,
//! `vpmaddwd` by ones, convert, `d_w · d_a`, FMA).

use std::arch::x86_64::*;

use crate::kernels::cpu::simd::avx2::{bytes_from_bits_32, bytes_from_nibbles_32, hsum_float_8};

use super::{A_BYTES, GROUP, SLOT};

/// Unpacks one weight block at `x` (Q8_0 when `q5` is false, else Q5_0) into the panel slot at
/// `o`: `d` as f32, the 32 signed values, their absolute values (as the scalar `pack_group`).
///
/// # Safety
/// AVX2, FMA and F16C are available; `x` points at one block of the type, `o` at `SLOT` writable
/// bytes.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn pack_block(x: *const u8, q5: bool, o: *mut u8) {
    let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
        x.cast::<u16>().read_unaligned() as i32,
    )));
    o.cast::<f32>().write_unaligned(d);
    let q = if q5 {
        // ggml's Q5_0 unpack: nibbles (low half first), 0xF0 where the fifth bit is clear.
        let hi = _mm256_andnot_si256(bytes_from_bits_32(x.add(2)), _mm256_set1_epi8(-16));
        _mm256_or_si256(bytes_from_nibbles_32(x.add(6)), hi)
    } else {
        _mm256_loadu_si256(x.add(2).cast())
    };
    _mm256_storeu_si256(o.add(16).cast(), q);
    _mm256_storeu_si256(o.add(48).cast(), _mm256_sign_epi8(q, q));
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
        // d_w · d_a for every (row, activation row) of the block, rounded as the kernels do,
        // read back below as broadcasts from memory.
        let dw = _mm_setr_ps(
            *p.cast::<f32>(),
            *p.add(SLOT).cast::<f32>(),
            *p.add(2 * SLOT).cast::<f32>(),
            *p.add(3 * SLOT).cast::<f32>(),
        );
        let mut dd = [[0f32; GROUP]; M];
        for j in 0..M {
            _mm_storeu_ps(
                dd[j].as_mut_ptr(),
                _mm_mul_ps(dw, _mm_set1_ps(*da.add(j * nb + b))),
            );
        }
        let dd = std::hint::black_box(&dd);
        for r in 0..GROUP {
            let s = p.add(r * SLOT);
            let qx = _mm256_loadu_si256(s.add(16).cast());
            let ax = _mm256_loadu_si256(s.add(48).cast());
            for j in 0..M {
                let y = _mm256_loadu_si256(a.add(j * stride + b * A_BYTES + 2).cast());
                let dot =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(y, qx)), ones);
                let d = _mm256_broadcast_ss(&dd[j][r]);
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
