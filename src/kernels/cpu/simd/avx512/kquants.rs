//! AVX-512 k-quant kernels: Q6_K weights × Q8_K activations (`ggml_vec_dot_q6_K_q8_K`'s
//! arithmetic, as the AVX2 kernel in `simd::avx2::kquants`).
//!
//! A super-block's eight i32 lanes (lane `l` holds products `4l..4l+4` of every 32-value group,
//! weighted by the group's 16-value scales, minus `32 · Σ scale · bsum`) are built here 64 values
//! at a time: one 64-byte vector holds two 32-value groups, `vpmaddubsw` forms the pair sums and
//! `vpdpwssd` multiplies them by the groups' scales and adds them into sixteen lanes; folding the
//! two halves gives exactly the AVX2 kernel's eight integers (integer sums, so the order does not
//! matter), and the float steps after it are the AVX2 kernel's, so results are bit-identical.

use std::arch::x86_64::*;

use super::{entries, wrows_entry, x4_entry};
use crate::kernels::cpu::simd::avx2::kquants::q6k_decode_kernels;
use crate::kernels::cpu::simd::avx2::{f16_bcast, hsum_float_8, ld, ld128, prefetch_ahead, rd_f32};
use crate::quant::blocks::{Block, BlockQ6K, BlockQ8K};

const QK: usize = 256;
const A_BYTES: usize = BlockQ8K::BYTES;
const A_QS: usize = 4;
const A_BSUMS: usize = 260;

entries!(q6k_dot, q6k_tile, q6k_rows, QK, BlockQ6K::BYTES, A_BYTES, 8);

/// `vpermw` indices picking, for half-block `j` and value quarter pair `h` (0: values 0..64, 1:
/// 64..128 of the half-block), the i16 scale of each 16-value run for every word: word `i` takes
/// scale `8j + 4h + i / 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn scale_idx(j: usize, h: usize) -> __m512i {
    let base = (8 * j + 4 * h) as i16;
    let w = |i: i16| base + i / 8;
    _mm512_set_epi16(
        w(31),
        w(30),
        w(29),
        w(28),
        w(27),
        w(26),
        w(25),
        w(24),
        w(23),
        w(22),
        w(21),
        w(20),
        w(19),
        w(18),
        w(17),
        w(16),
        w(15),
        w(14),
        w(13),
        w(12),
        w(11),
        w(10),
        w(9),
        w(8),
        w(7),
        w(6),
        w(5),
        w(4),
        w(3),
        w(2),
        w(1),
        w(0),
    )
}

/// The exact integer lanes of one Q6_K block against `M` Q8_K activation blocks (`stride` bytes
/// apart): bit for bit `simd::avx2::kquants::q6k_block_isums`.
///
/// # Safety
/// The AVX-512 level is available; `x` points at one Q6_K block and `ya + r * stride` at a Q8_K
/// block for every `r < M`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q6k_block_isums<const M: usize>(
    x: *const u8,
    ya: *const u8,
    stride: usize,
) -> [__m256i; M] {
    let m15 = _mm512_set1_epi8(15);
    // High bits: the low 256-bit half takes bit pairs 0-1 (<< 4) for values 0..32 of a quarter,
    // the high half pairs 2-3 (<< 2) for values 32..64; then pairs 4-5 (as they are) and 6-7
    // (>> 2) for the next 64 values. Masking first keeps the 64-bit lane shifts inside bytes.
    let split = |lo: i8, hi: i8| {
        _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set1_epi8(lo)),
            _mm256_set1_epi8(hi),
        )
    };
    let (mask01, mask23) = (split(3, 12), split(48, -64));
    let sh01 = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);
    let sh23 = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    let scales16 = _mm256_cvtepi8_epi16(ld128(x.add(192)));
    let sc = _mm512_castsi256_si512(scales16);
    let mut sumi = [_mm512_setzero_si512(); M];
    for j in 0..2 {
        let bits = _mm512_loadu_si512(x.add(64 * j).cast());
        let hb = _mm512_broadcast_i64x4(ld(x.add(128 + 32 * j)));
        let h01 = _mm512_sllv_epi64(_mm512_and_si512(hb, mask01), sh01);
        let h23 = _mm512_srlv_epi64(_mm512_and_si512(hb, mask23), sh23);
        let q01 = _mm512_or_si512(_mm512_and_si512(bits, m15), h01);
        let q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(bits), m15), h23);
        let s01 = _mm512_permutexvar_epi16(scale_idx(j, 0), sc);
        let s23 = _mm512_permutexvar_epi16(scale_idx(j, 1), sc);
        for (r, s) in sumi.iter_mut().enumerate() {
            let y = ya.add(r * stride + A_QS + 128 * j);
            let p01 = _mm512_maddubs_epi16(q01, _mm512_loadu_si512(y.cast()));
            let p23 = _mm512_maddubs_epi16(q23, _mm512_loadu_si512(y.add(64).cast()));
            *s = _mm512_dpwssd_epi32(*s, p01, s01);
            *s = _mm512_dpwssd_epi32(*s, p23, s23);
        }
    }
    let mut out = [_mm256_setzero_si256(); M];
    for (r, (o, s)) in out.iter_mut().zip(&sumi).enumerate() {
        let lanes = _mm256_add_epi32(
            _mm512_castsi512_si256(*s),
            _mm512_extracti64x4_epi64::<1>(*s),
        );
        let bs = ld(ya.add(r * stride + A_BSUMS));
        let sub = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bs, scales16));
        *o = _mm256_sub_epi32(lanes, sub);
    }
    out
}

/// Q6_K against `M` activation rows: the AVX2 `q6k_rows` with these integer lanes.
///
/// # Safety
/// The AVX-512 level is available; `w` points at `nb` Q6_K blocks, `a + r * stride` (`r < M`)
/// at `nb` Q8_K blocks, `out` at `M` writable slots.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6k_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    let mut acc = [_mm256_setzero_ps(); M];
    for b in 0..nb {
        let x = w.add(b * BlockQ6K::BYTES);
        prefetch_ahead(x, 4);
        let ya = a.add(b * A_BYTES);
        let sumi: [__m256i; M] = q6k_block_isums(x, ya, stride);
        let dw = f16_bcast(x.add(208));
        for (r, (s, ac)) in sumi.iter().zip(acc.iter_mut()).enumerate() {
            let d = _mm256_mul_ps(_mm256_set1_ps(rd_f32(ya.add(r * stride))), dw);
            *ac = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(*s), *ac);
        }
    }
    for (r, ac) in acc.iter().enumerate() {
        *out.add(r) = hsum_float_8(*ac);
    }
}

q6k_decode_kernels!("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni");
