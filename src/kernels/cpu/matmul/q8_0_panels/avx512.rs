//! AVX-512 VNNI tile of [`super::matmul`]: four weight rows × up to six activation rows, twelve
//! sixteen-lane accumulators, each holding two (weight row, activation row) pairs side by side.
//!
//! The integer lanes are those of the AVX2 tile, computed differently: `vpdpbusd` multiplies
//! unsigned by signed bytes, so the activations go in offset by 128 (`y + 128`, one conversion per
//! call) and the weights stay signed; `Σ (y + 128)·w = Σ y·w + 128·Σ w`, and the panel holds
//! `-128·Σ w` per lane (four weights each) as the accumulator's start value, so one `vpdpbusd`
//! gives exactly `Σ y·w` of the lane's four products: the integers of `vpsignb` / `vpmaddubsw` /
//! `vpmaddwd`, without their -128 caveat. The float steps per lane are the AVX2 tile's (`d_w · d_a`
//! rounded, one FMA per block, `hsum_float_8` per pair at the end), so results are bit-identical.
//!
//! Panel layout (per block `b` of a group of four rows, [`SLOT`] bytes at `b * SLOT`): for each
//! row pair `p` (rows `2p`, `2p + 1`) 192 bytes at `192p`: the two rows' 32 signed weights (64
//! bytes), their eight `-128·Σ w` lanes each (i32, 64 bytes), their `d` repeated eight times each
//! (f32, 64 bytes): each part one 64-byte load, low half row `2p`, high half row `2p + 1`.

use std::arch::x86_64::*;

use crate::kernels::cpu::simd::avx2::hsum_float_8;

use super::GROUP;

/// Panel bytes per block of four rows.
pub(super) const SLOT: usize = 384;
/// Activation rows per register tile.
pub(super) const TILE_M: usize = 6;

/// Unpacks one weight block at `x` (Q8_0 when `q5` is false, else Q5_0) for row `r` (0..4) into
/// the panel block at `o` (the layout in the module doc).
///
/// # Safety
/// The AVX-512 level is available; `x` points at one block of the type, `o` at `SLOT` writable
/// bytes; `r < 4`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn pack_block(x: *const u8, q5: bool, r: usize, o: *mut u8) {
    let mut tmp = [0u8; super::SLOT];
    super::avx2::pack_block(x, q5, tmp.as_mut_ptr());
    let q = _mm256_loadu_si256(tmp.as_ptr().add(16).cast());
    let d = tmp.as_ptr().cast::<f32>().read_unaligned();
    let sum128 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(-128), q);
    let o = o.add(192 * (r / 2) + 32 * (r % 2));
    _mm256_storeu_si256(o.cast(), q);
    _mm256_storeu_si256(
        o.add(64).cast(),
        _mm256_sub_epi32(_mm256_setzero_si256(), sum128),
    );
    _mm256_storeu_ps(o.add(128).cast(), _mm256_set1_ps(d));
}

/// # Safety
/// The AVX-512 level is available; `panel` holds `nb` blocks of four rows; `yu + j * nb * 32`
/// (`j < m`) `nb` offset activation blocks and `da + j * nb` `nb` scales; `1 <= m <= TILE_M`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn tile(
    nb: usize,
    panel: *const u8,
    yu: *const u8,
    da: *const f32,
    m: usize,
    out: &mut [[f32; GROUP]; TILE_M],
) {
    match m {
        6 => tile_m::<6>(nb, panel, yu, da, out),
        5 => tile_m::<5>(nb, panel, yu, da, out),
        4 => tile_m::<4>(nb, panel, yu, da, out),
        3 => tile_m::<3>(nb, panel, yu, da, out),
        2 => tile_m::<2>(nb, panel, yu, da, out),
        _ => tile_m::<1>(nb, panel, yu, da, out),
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_m<const M: usize>(
    nb: usize,
    panel: *const u8,
    yu: *const u8,
    da: *const f32,
    out: &mut [[f32; GROUP]; TILE_M],
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; M];
    for b in 0..nb {
        let p = panel.add(b * SLOT);
        let w = [
            _mm512_loadu_si512(p.cast()),
            _mm512_loadu_si512(p.add(192).cast()),
        ];
        let bias = [
            _mm512_loadu_si512(p.add(64).cast()),
            _mm512_loadu_si512(p.add(256).cast()),
        ];
        let dw = [
            _mm512_loadu_ps(p.add(128).cast()),
            _mm512_loadu_ps(p.add(320).cast()),
        ];
        for (j, acc) in acc.iter_mut().enumerate() {
            let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(yu.add((j * nb + b) * 32).cast()));
            let d_a = _mm512_set1_ps(*da.add(j * nb + b));
            for q in 0..2 {
                let dot = _mm512_dpbusd_epi32(bias[q], y, w[q]);
                let d = _mm512_mul_ps(dw[q], d_a);
                acc[q] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(dot), acc[q]);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(&acc) {
        for q in 0..2 {
            o[2 * q] = hsum_float_8(_mm512_castps512_ps256(acc[q]));
            o[2 * q + 1] = hsum_float_8(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                _mm512_castps_pd(acc[q]),
            )));
        }
    }
}
