//! AVX2 k-quant kernels (Q2_K..Q6_K weights × Q8_K activations).
//!
//! Each `*_rows::<M>` unpacks a 256-value super-block once and multiplies it with `M` activation
//! rows. Integer sums are exact (`vpmaddubsw` with unsigned weights that cannot saturate, then
//! `vpmaddwd` by the sub-block scales). Float accumulation per row follows the ggml-cpu x86 kernel
//! llama.cpp runs on an AVX2 machine:
//! - Q4_K: the repacked `ggml_gemv_q4_K_8x8_q8_K` — per super-block one integer sum `isum` and one
//!   min sum `imin`, `acc = fma(isum, d_w * d_a, acc)`, `accm = fma(imin, dmin_w * d_a, accm)`,
//!   result `acc - accm` (rows sit in the lanes of one vector, so each lane is that scalar chain).
//! - Q4_K, second flavour (`q4k_gemm_*`): the repacked `ggml_gemm_q4_K_8x8_q8_K` that llama.cpp
//!   uses for whole groups of four activation rows — the same with one `fma` per pair of
//!   sub-blocks (64 values) instead of one per super-block.
//! - Q2_K, Q3_K, Q5_K, Q6_K: `ggml_vec_dot_*_q8_K`'s AVX2 branch — eight i32 lanes per super-block
//!   (lane `l` holds bytes `4l..4l+4` of every 32-byte group), `acc = fma(d, lanes, acc)` in eight
//!   f32 lanes, then `hsum_float_8` (plus Q5_K's separately fused min sum).
//!
//! Block layouts (byte offsets) are ggml's, see `crate::quant::blocks`; Q8_K is `d: f32` at 0,
//! `qs` at 4, `bsums: [i16; 16]` at 260.

use std::arch::x86_64::*;

use super::{
    entries, f16_bcast, f16x2_at, hsum_float_8, hsum_rows, k4_scales_mins, ld, ld128,
    prefetch_ahead, rd_f32, rd_u32, wrows_entry, x4_entry,
};
use crate::quant::blocks::{Block, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, BlockQ8K};

const QK: usize = 256;
const A_BYTES: usize = BlockQ8K::BYTES;
const A_QS: usize = 4;
const A_BSUMS: usize = 260;

entries!(q4k_dot, q4k_tile, q4k_rows, QK, BlockQ4K::BYTES, A_BYTES, 4);
entries!(
    q4k_gemm_dot,
    q4k_gemm_tile,
    q4k_gemm_rows,
    QK,
    BlockQ4K::BYTES,
    A_BYTES,
    4
);
entries!(q6k_dot, q6k_tile, q6k_rows, QK, BlockQ6K::BYTES, A_BYTES, 8);
entries!(q5k_dot, q5k_tile, q5k_rows, QK, BlockQ5K::BYTES, A_BYTES, 4);
entries!(q3k_dot, q3k_tile, q3k_rows, QK, BlockQ3K::BYTES, A_BYTES, 4);
entries!(q2k_dot, q2k_tile, q2k_rows, QK, BlockQ2K::BYTES, A_BYTES, 4);

/// A `vpshufb` control that broadcasts i16 word `k` (0..8) of each 128-bit lane to all its words.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn word_bcast(k: usize) -> __m256i {
    _mm256_set1_epi16((((2 * k + 1) << 8) | (2 * k)) as i16)
}

/// The 8 scale bytes of `sc` (little-endian) as 8 dwords `scale | scale << 16`, so that broadcasting
/// dword `k` gives `vpmaddwd` the i16 scale of sub-block `k` in every word.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_scale_dwords(sc: u64) -> __m256i {
    let d = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(sc as i64));
    _mm256_or_si256(d, _mm256_slli_epi32::<16>(d))
}

/// ggml's `get_scale_shuffle_q3k(k)`: word `2k` to the low lane's words, `2k + 1` to the high's.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn word_pair_bcast(k: usize) -> __m256i {
    _mm256_set_m128i(
        _mm_set1_epi16((((4 * k + 3) << 8) | (4 * k + 2)) as i16),
        _mm_set1_epi16((((4 * k + 1) << 8) | (4 * k)) as i16),
    )
}

/// Q4_K (block: `d` f16 @0, `dmin` f16 @2, 12 packed scale/min bytes @4, 128 nibble bytes @16;
/// byte `i` of 32-byte chunk `j` holds value `64j + i` low and `64j + 32 + i` high).
///
/// # Safety
/// AVX2, FMA and F16C are available; `w` points at `nb` Q4_K blocks; `a + r * stride` for
/// `r < M` at `nb` Q8_K blocks; `out` at `M` writable f32 slots.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    let m4 = _mm256_set1_epi8(0xF);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let x = w.add(b * BlockQ4K::BYTES);
        prefetch_ahead(x, 3);
        let ya = a.add(b * A_BYTES);
        let (sc, mn) = k4_scales_mins(x.add(4));
        // The 8 scales as dwords `sc | sc << 16`, read back below as broadcasts from memory
        // (`vpbroadcastd` from memory needs no vector ALU; `black_box` keeps the compiler from
        // turning the reloads into register shuffles).
        let mut sc_buf = [0i32; 8];
        _mm256_storeu_si256(sc_buf.as_mut_ptr().cast(), k4_scale_dwords(sc));
        let sc_buf = std::hint::black_box(&sc_buf);
        // The 8 mins as i16 pairs (m0, m0, m1, m1, ..), for `vpmaddwd` with the 16 bsums.
        let mins8 = _mm_cvtsi64_si128(mn as i64);
        let mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mins8, mins8));

        let mut isum = [_mm256_setzero_si256(); M];
        for j in 0..4 {
            let bits = ld(x.add(16 + 32 * j));
            let lo = _mm256_and_si256(bits, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            let s_lo = _mm256_set1_epi32(sc_buf[2 * j]);
            let s_hi = _mm256_set1_epi32(sc_buf[2 * j + 1]);
            for (r, s) in isum.iter_mut().enumerate() {
                let y = ya.add(r * stride + A_QS + 64 * j);
                let p_lo = _mm256_madd_epi16(s_lo, _mm256_maddubs_epi16(lo, ld(y)));
                let p_hi = _mm256_madd_epi16(s_hi, _mm256_maddubs_epi16(hi, ld(y.add(32))));
                *s = _mm256_add_epi32(*s, _mm256_add_epi32(p_lo, p_hi));
            }
        }
        // imin = Σ_k min_k * (bsums[2k] + bsums[2k+1]), exact.
        let mut imin = [_mm256_setzero_si256(); M];
        let mut da = [0f32; 4];
        for (r, (im, d)) in imin.iter_mut().zip(da.iter_mut()).enumerate() {
            let y = ya.add(r * stride);
            *im = _mm256_madd_epi16(ld(y.add(A_BSUMS)), mins);
            *d = rd_f32(y);
        }
        // [d_w, dmin_w] in one conversion.
        let dd = _mm_cvtph_ps(_mm_cvtsi32_si128(rd_u32(x) as i32));
        acc = q4k_fold(acc, &isum, &imin, dd, &da);
    }
    let mut res = [0f32; 8];
    _mm256_storeu_ps(res.as_mut_ptr(), acc);
    let lanes = if M == 1 {
        1
    } else if M == 2 {
        2
    } else {
        4
    };
    for r in 0..M {
        *out.add(r) = res[r] - res[r + lanes];
    }
}

/// One Q4_K super-block's float step for `M` rows: reduces each row's `isum` and `imin` to
/// scalars and does `acc_r = fma(isum_r, d_w * d_a_r, acc_r)`, `accm_r = fma(imin_r,
/// dmin_w * d_a_r, accm_r)` lane-wise. `dd` is `[d_w, dmin_w, ..]`, `da[r]` row `r`'s `d`. Lanes of
/// `acc`: `[acc_0, accm_0]` for one row, `[acc_0, acc_1, accm_0, accm_1]` for two, else
/// `[acc_0..acc_3 | accm_0..accm_3]` — the fewest shuffles for each case.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4k_fold<const M: usize>(
    acc: __m256,
    isum: &[__m256i; M],
    imin: &[__m256i; M],
    dd: __m128,
    da: &[f32; 4],
) -> __m256 {
    let z = _mm256_setzero_si256();
    let (sums, scale) = match M {
        1 => {
            // [i01 i23 m01 m23 | i45 i67 m45 m67] -> [I M I M | ..] -> halves added.
            let t = _mm256_hadd_epi32(isum[0], imin[0]);
            let t = _mm256_hadd_epi32(t, t);
            let scale = _mm_mul_ps(dd, _mm_set1_ps(da[0]));
            (t, _mm256_castps128_ps256(scale))
        }
        2 => {
            let t = _mm256_hadd_epi32(
                _mm256_hadd_epi32(isum[0], isum[1]),
                _mm256_hadd_epi32(imin[0], imin[1]),
            );
            let d2 = _mm_unpacklo_ps(dd, dd);
            let scale = _mm_mul_ps(d2, _mm_setr_ps(da[0], da[1], da[0], da[1]));
            (t, _mm256_castps128_ps256(scale))
        }
        _ => {
            let mut i4 = [z; 4];
            let mut m4 = [z; 4];
            i4[..M].copy_from_slice(isum);
            m4[..M].copy_from_slice(imin);
            let ti = _mm256_hadd_epi32(
                _mm256_hadd_epi32(i4[0], i4[1]),
                _mm256_hadd_epi32(i4[2], i4[3]),
            );
            let tm = _mm256_hadd_epi32(
                _mm256_hadd_epi32(m4[0], m4[1]),
                _mm256_hadd_epi32(m4[2], m4[3]),
            );
            let s = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(ti, tm),
                _mm256_permute2x128_si256::<0x31>(ti, tm),
            );
            let dw = _mm256_permutevar8x32_ps(
                _mm256_castps128_ps256(dd),
                _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1),
            );
            let da4 = _mm_setr_ps(da[0], da[1], da[2], da[3]);
            let scale = _mm256_mul_ps(dw, _mm256_set_m128(da4, da4));
            let f = _mm256_cvtepi32_ps(s);
            return _mm256_fmadd_ps(f, scale, acc);
        }
    };
    // One or two rows: the sums sit in the low 128 bits (halves of `sums` still to add).
    let s = _mm_add_epi32(
        _mm256_castsi256_si128(sums),
        _mm256_extracti128_si256::<1>(sums),
    );
    let f = _mm_cvtepi32_ps(s);
    _mm256_castps128_ps256(_mm_fmadd_ps(
        f,
        _mm256_castps256_ps128(scale),
        _mm256_castps256_ps128(acc),
    ))
}

/// Q4_K with llama.cpp's repacked-GEMM accumulation: per super-block and per pair `p` of
/// sub-blocks (`2p`, `2p + 1`: the low and high nibbles of 32-byte chunk `p`) an exact
/// `isum_p = sc[2p]·dot[2p] + sc[2p+1]·dot[2p+1]` and `imin_p = m[2p]·bsum[2p] + m[2p+1]·bsum[2p+1]`
/// (`bsum[k]` the activation sum of sub-block `k`), then `acc = fma(isum_p, d_w·d_a, acc)` and
/// `accm = fma(imin_p, dmin_w·d_a, accm)`; result `acc - accm`. Rows sit in the lanes of `acc`.
///
/// # Safety
/// As [`q4k_rows`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4k_gemm_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    let m4 = _mm256_set1_epi8(0xF);
    let mut acc = _mm_setzero_ps();
    let mut accm = _mm_setzero_ps();
    for b in 0..nb {
        let x = w.add(b * BlockQ4K::BYTES);
        prefetch_ahead(x, 3);
        let ya = a.add(b * A_BYTES);
        let (sc, mn) = k4_scales_mins(x.add(4));
        // As in `q4k_rows`: scales broadcast from memory.
        let mut sc_buf = [0i32; 8];
        _mm256_storeu_si256(sc_buf.as_mut_ptr().cast(), k4_scale_dwords(sc));
        let sc_buf = std::hint::black_box(&sc_buf);
        let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
        // Per row, imin_p in lane p; then transposed so that `imin[p]` has row r in lane r.
        let mut imin = [_mm_setzero_si128(); 4];
        let mut da = [0f32; 4];
        for (r, (im, d)) in imin.iter_mut().zip(da.iter_mut()).take(M).enumerate() {
            let y = ya.add(r * stride);
            let bs = ld(y.add(A_BSUMS));
            let q8s = _mm_hadd_epi16(
                _mm256_castsi256_si128(bs),
                _mm256_extracti128_si256::<1>(bs),
            );
            *im = _mm_madd_epi16(q8s, mins);
            *d = rd_f32(y);
        }
        let imin = transpose4(imin);
        let da = _mm_setr_ps(da[0], da[1], da[2], da[3]);
        let (dw, dminw) = f16x2_at(x);
        let d = _mm_mul_ps(_mm_set1_ps(dw), da);
        let dmin = _mm_mul_ps(_mm_set1_ps(dminw), da);
        for (p, imin_p) in imin.iter().enumerate() {
            let bits = ld(x.add(16 + 32 * p));
            let lo = _mm256_and_si256(bits, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            let s_lo = _mm256_set1_epi32(sc_buf[2 * p]);
            let s_hi = _mm256_set1_epi32(sc_buf[2 * p + 1]);
            let mut isum = [_mm256_setzero_si256(); M];
            for (r, s) in isum.iter_mut().enumerate() {
                let y = ya.add(r * stride + A_QS + 64 * p);
                let p_lo = _mm256_madd_epi16(s_lo, _mm256_maddubs_epi16(lo, ld(y)));
                let p_hi = _mm256_madd_epi16(s_hi, _mm256_maddubs_epi16(hi, ld(y.add(32))));
                *s = _mm256_add_epi32(p_lo, p_hi);
            }
            acc = _mm_fmadd_ps(_mm_cvtepi32_ps(hsum_rows(&isum)), d, acc);
            accm = _mm_fmadd_ps(_mm_cvtepi32_ps(*imin_p), dmin, accm);
        }
    }
    let mut res = [0f32; 4];
    _mm_storeu_ps(res.as_mut_ptr(), _mm_sub_ps(acc, accm));
    std::ptr::copy_nonoverlapping(res.as_ptr(), out, M);
}

/// The 4×4 transpose of four i32 vectors: lane `r` of result `p` is lane `p` of `v[r]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose4(v: [__m128i; 4]) -> [__m128i; 4] {
    let t0 = _mm_unpacklo_epi32(v[0], v[1]);
    let t1 = _mm_unpacklo_epi32(v[2], v[3]);
    let t2 = _mm_unpackhi_epi32(v[0], v[1]);
    let t3 = _mm_unpackhi_epi32(v[2], v[3]);
    [
        _mm_unpacklo_epi64(t0, t1),
        _mm_unpackhi_epi64(t0, t1),
        _mm_unpacklo_epi64(t2, t3),
        _mm_unpackhi_epi64(t2, t3),
    ]
}

/// Q6_K (block: `ql` 128 bytes @0, `qh` 64 bytes @128, 16 i8 scales @192, `d` f16 @208). Values
/// are taken unsigned (0..64) and `32 * Σ scale * bsum` is subtracted, as ggml does.
///
/// # Safety
/// As [`q4k_rows`], with Q6_K weight blocks.
#[target_feature(enable = "avx2,fma,f16c")]
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

/// The `vpshufb` control that, from eight i16 scales in each 128-bit lane, broadcasts scale `2k`
/// over the low lane and scale `2k + 1` over the high lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn scale_pick(k: usize) -> __m256i {
    let lo = (0x0100 + 0x0202 * 2 * k as i64) * 0x0001_0001_0001_0001;
    let hi = (0x0100 + 0x0202 * (2 * k as i64 + 1)) * 0x0001_0001_0001_0001;
    _mm256_set_epi64x(hi, hi, lo, lo)
}

/// The exact integer sums of one Q6_K block against `M` Q8_K activation blocks (`stride` bytes
/// apart), eight i32 lanes each, lane for lane as `ggml_vec_dot_q6_K_q8_K` forms them: the unsigned
/// 6-bit values times the activations, weighted per 16 values by the block's scales, minus
/// `32 * Σ scale * bsum`.
///
/// # Safety
/// `x` points at one Q6_K block and `ya + r * stride` at a Q8_K block for every `r < M`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q6k_block_isums<const M: usize>(
    x: *const u8,
    ya: *const u8,
    stride: usize,
) -> [__m256i; M] {
    let m3 = _mm256_set1_epi8(3);
    let m15 = _mm256_set1_epi8(15);
    let scales = ld128(x.add(192));
    // The 16 scales widened once; per half-block j both 128-bit lanes hold its eight scales, and
    // one in-lane byte shuffle per group g = 4j + k then puts scale 2g in the low lane's eight
    // i16 slots and 2g+1 in the high lane's.
    let scales16 = _mm256_cvtepi8_epi16(scales);
    let mut sumi = [_mm256_setzero_si256(); M];
    for j in 0..2 {
        let sj = if j == 0 {
            _mm256_permute4x64_epi64::<0x44>(scales16)
        } else {
            _mm256_permute4x64_epi64::<0xEE>(scales16)
        };
        let bits1 = ld(x.add(64 * j));
        let bits2 = ld(x.add(64 * j + 32));
        let hbits = ld(x.add(128 + 32 * j));
        let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(hbits, m3));
        let h1 = _mm256_slli_epi16::<2>(_mm256_and_si256(hbits, _mm256_set1_epi8(12)));
        let h2 = _mm256_and_si256(hbits, _mm256_set1_epi8(48));
        let h3 = _mm256_srli_epi16::<2>(_mm256_and_si256(hbits, _mm256_set1_epi8(-64)));
        let q = [
            _mm256_or_si256(_mm256_and_si256(bits1, m15), h0),
            _mm256_or_si256(_mm256_and_si256(bits2, m15), h1),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bits1), m15), h2),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(bits2), m15), h3),
        ];
        for (k, qk) in q.iter().enumerate() {
            // Scales 2g and 2g+1 (g = 4j + k) for the two 16-value halves of this group.
            let sc = _mm256_shuffle_epi8(sj, scale_pick(k));
            for (r, s) in sumi.iter_mut().enumerate() {
                let y = ya.add(r * stride + A_QS + 128 * j + 32 * k);
                let p = _mm256_madd_epi16(sc, _mm256_maddubs_epi16(*qk, ld(y)));
                *s = _mm256_add_epi32(*s, p);
            }
        }
    }
    for (r, s) in sumi.iter_mut().enumerate() {
        let y = ya.add(r * stride);
        let sub = _mm256_slli_epi32::<5>(_mm256_madd_epi16(ld(y.add(A_BSUMS)), scales16));
        *s = _mm256_sub_epi32(*s, sub);
    }
    sumi
}

/// Defines, at a SIMD level whose `q6k_block_isums::<1>` and `q6k_rows` are in scope (`$feat`: the
/// level's target features), the Q6_K decode kernels over four rows:
/// - `q6k_wrows4`: four weight rows (`row_bytes` apart) against ONE activation row. Each row keeps
///   its own accumulator and the float operations of `q6k_rows::<1>`, so `out[r]` is
///   bit-identical to the `dot` of row `r`; the four rows' independent work overlaps, and each step
///   prefetches the matching part of the next four rows (a short contiguous run the hardware
///   prefetcher does not pick up in time);
/// - `q6k_wrows4_at`: the same over four rows whose block `b` of row `r` lies at
///   `w + r * rs + b * bs` (`(rs, bs, pd)`), prefetching the 4 × 210 bytes at `pd + 840 b` (the
///   same part of the next four rows, or the run `pd` bytes ahead in the x4 layout), a few lines
///   before each row's block rather than all at once, so that the prefetches overlap the
///   arithmetic instead of waiting in a burst on the core's miss buffers. Into L1: in the x4
///   layout (one linear stream) a short distance into L1 beat 13 KiB into L2 (Qwen's Q6_K decode
///   matmuls, alternated in one process: 2.5 KiB 13.2 ms, 3.4 KiB 14.0, 5 KiB 15.1, 13 KiB 15.3);
/// - their entries `q6k_dot_rows` ([`super::DotRowsFn`]) and `q6k_dot_x4` ([`super::DotX4Fn`]).
macro_rules! q6k_decode_kernels {
    ($feat:literal) => {
        /// See `q6k_decode_kernels`.
        ///
        /// # Safety
        /// The level's features are present; four weight rows of `nb` Q6_K blocks at
        /// `w + r * row_bytes`, one activation row of `nb` Q8_K blocks at `a`; `out` has four
        /// slots.
        #[target_feature(enable = $feat)]
        unsafe fn q6k_wrows4(
            nb: usize,
            w: *const u8,
            row_bytes: usize,
            a: *const u8,
            out: *mut f32,
        ) {
            let strides = (row_bytes, BlockQ6K::BYTES, 4 * row_bytes);
            q6k_wrows4_at(nb, w, strides, a, out);
        }

        /// See `q6k_decode_kernels`.
        ///
        /// # Safety
        /// As `q6k_wrows4`, with the blocks where `(rs, bs)` put them.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q6k_wrows4_at(
            nb: usize,
            w: *const u8,
            (rs, bs, pd): (usize, usize, usize),
            a: *const u8,
            out: *mut f32,
        ) {
            const LINES: usize = (4 * BlockQ6K::BYTES).div_ceil(64);
            let mut acc = [_mm256_setzero_ps(); 4];
            for b in 0..nb {
                let pf = w.wrapping_add(pd + b * 4 * BlockQ6K::BYTES);
                let ya = a.add(b * A_BYTES);
                let da = _mm256_set1_ps(rd_f32(ya));
                for (r, ac) in acc.iter_mut().enumerate() {
                    for l in 4 * r..(4 * r + 4).min(LINES) {
                        _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(64 * l).cast());
                    }
                    // Keeps the compiler from gathering the prefetches back into one burst.
                    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
                    let x = w.add(r * rs + b * bs);
                    let [s] = q6k_block_isums::<1>(x, ya, 0);
                    let d = _mm256_mul_ps(da, f16_bcast(x.add(208)));
                    *ac = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), *ac);
                }
            }
            for (r, ac) in acc.iter().enumerate() {
                *out.add(r) = hsum_float_8(*ac);
            }
        }

        wrows_entry!(
            q6k_dot_rows,
            q6k_wrows4,
            q6k_rows,
            QK,
            BlockQ6K::BYTES,
            A_BYTES
        );
        x4_entry!(q6k_dot_x4, q6k_wrows4_at, QK, BlockQ6K::BYTES, A_BYTES);
    };
}
pub(crate) use q6k_decode_kernels;

q6k_decode_kernels!("avx2,fma,f16c");

/// Q5_K (block: `d` @0, `dmin` @2, 12 scale/min bytes @4, `qh` 32 bytes @16, `qs` 128 @48).
///
/// # Safety
/// As [`q4k_rows`], with Q5_K weight blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5k_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    let m4 = _mm256_set1_epi8(0xF);
    let sixteen = _mm256_set1_epi8(16);
    let mut acc = [_mm256_setzero_ps(); M];
    let mut summs = [0f32; M];
    for b in 0..nb {
        let x = w.add(b * BlockQ5K::BYTES);
        prefetch_ahead(x, 3);
        let ya = a.add(b * A_BYTES);
        let (sc, mn) = k4_scales_mins(x.add(4));
        let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(sc as i64)));
        let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(mn as i64));
        let (dw, dminw) = f16x2_at(x);
        // Min term: ggml's `summs += dmin * hsum(madd(mins, hadd(bsums)))`, fused as compiled.
        for (r, sm) in summs.iter_mut().enumerate() {
            let y = ya.add(r * stride);
            let bs = ld(y.add(A_BSUMS));
            let q8s = _mm_hadd_epi16(
                _mm256_castsi256_si128(bs),
                _mm256_extracti128_si256::<1>(bs),
            );
            let prod = _mm_madd_epi16(mins, q8s);
            let z = _mm_setzero_si128();
            let hs = _mm_cvtsi128_si32(_mm_hadd_epi32(_mm_hadd_epi32(prod, z), z));
            let dmin = -rd_f32(y) * dminw;
            *sm = dmin.mul_add(hs as f32, *sm);
        }
        let hbits = ld(x.add(16));
        let mut sumi = [_mm256_setzero_si256(); M];
        for j in 0..4 {
            let bits = ld(x.add(48 + 32 * j));
            let hm0 = _mm256_set1_epi8((1u8 << (2 * j)) as i8);
            let hm1 = _mm256_set1_epi8((1u8 << (2 * j + 1)) as i8);
            // 16 where the value's fifth bit is set (ggml shifts the bit; same bytes).
            let h0 = _mm256_and_si256(
                _mm256_cmpeq_epi8(_mm256_and_si256(hbits, hm0), hm0),
                sixteen,
            );
            let h1 = _mm256_and_si256(
                _mm256_cmpeq_epi8(_mm256_and_si256(hbits, hm1), hm1),
                sixteen,
            );
            let q0 = _mm256_add_epi8(_mm256_and_si256(bits, m4), h0);
            let q1 = _mm256_add_epi8(_mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4), h1);
            let s0 = _mm256_shuffle_epi8(scales, word_bcast(2 * j));
            let s1 = _mm256_shuffle_epi8(scales, word_bcast(2 * j + 1));
            for (r, s) in sumi.iter_mut().enumerate() {
                let y = ya.add(r * stride + A_QS + 64 * j);
                let p0 = _mm256_madd_epi16(s0, _mm256_maddubs_epi16(q0, ld(y)));
                let p1 = _mm256_madd_epi16(s1, _mm256_maddubs_epi16(q1, ld(y.add(32))));
                *s = _mm256_add_epi32(*s, _mm256_add_epi32(p0, p1));
            }
        }
        for (r, (s, ac)) in sumi.iter().zip(acc.iter_mut()).enumerate() {
            let d = rd_f32(ya.add(r * stride)) * dw;
            *ac = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(*s), *ac);
        }
    }
    for (r, (ac, sm)) in acc.iter().zip(summs.iter()).enumerate() {
        *out.add(r) = hsum_float_8(*ac) + sm;
    }
}

/// Q3_K (block: `hmask` 32 bytes @0, `qs` 64 @32, 12 packed scale bytes @96, `d` f16 @108).
/// Values are `q2 - 4 * !hbit`: the 2-bit part and the "minus 4" part are multiplied separately.
///
/// # Safety
/// As [`q4k_rows`], with Q3_K weight blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3k_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    const K1: u32 = 0x0303_0303;
    const K2: u32 = 0x0f0f_0f0f;
    let m3 = _mm256_set1_epi8(3);
    let four = _mm256_set1_epi8(4);
    let mut acc = [_mm256_setzero_ps(); M];
    for b in 0..nb {
        let x = w.add(b * BlockQ3K::BYTES);
        prefetch_ahead(x, 2);
        let ya = a.add(b * A_BYTES);
        let (a0, a1, a2) = (rd_u32(x.add(96)), rd_u32(x.add(100)), rd_u32(x.add(104)));
        let scales128 = _mm_sub_epi8(
            _mm_set_epi32(
                (((a1 >> 4) & K2) | (((a2 >> 6) & K1) << 4)) as i32,
                (((a0 >> 4) & K2) | (((a2 >> 4) & K1) << 4)) as i32,
                ((a1 & K2) | (((a2 >> 2) & K1) << 4)) as i32,
                ((a0 & K2) | ((a2 & K1) << 4)) as i32,
            ),
            _mm_set1_epi8(32),
        );
        let all = _mm256_cvtepi8_epi16(scales128);
        let halves = [
            _mm256_broadcastsi128_si256(_mm256_castsi256_si128(all)),
            _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(all)),
        ];
        let hbits = ld(x);
        let mut sumi = [_mm256_setzero_si256(); M];
        for (j, half) in halves.iter().enumerate() {
            let bits = ld(x.add(32 + 32 * j));
            let lows = [
                _mm256_and_si256(bits, m3),
                _mm256_and_si256(_mm256_srli_epi16::<2>(bits), m3),
                _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m3),
                _mm256_and_si256(_mm256_srli_epi16::<6>(bits), m3),
            ];
            for (k, lo) in lows.iter().enumerate() {
                let hm = _mm256_set1_epi8((1u8 << (4 * j + k)) as i8);
                // 4 where the high bit is clear (ggml's andnot/shift; same bytes).
                let hi =
                    _mm256_andnot_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hbits, hm), hm), four);
                let sc = _mm256_shuffle_epi8(*half, word_pair_bcast(k));
                for (r, s) in sumi.iter_mut().enumerate() {
                    let q8 = ld(ya.add(r * stride + A_QS + 128 * j + 32 * k));
                    let p = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(*lo, q8),
                        _mm256_maddubs_epi16(hi, q8),
                    );
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(sc, p));
                }
            }
        }
        let dw = f16_bcast(x.add(108));
        for (r, (s, ac)) in sumi.iter().zip(acc.iter_mut()).enumerate() {
            let d = _mm256_mul_ps(_mm256_set1_ps(rd_f32(ya.add(r * stride))), dw);
            *ac = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(*s), *ac);
        }
    }
    for (r, ac) in acc.iter().enumerate() {
        *out.add(r) = hsum_float_8(*ac);
    }
}

/// Q2_K (block: 16 scale/min bytes @0, `qs` 64 bytes @16, `d` f16 @80, `dmin` f16 @82).
///
/// # Safety
/// As [`q4k_rows`], with Q2_K weight blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2k_rows<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    let m3 = _mm256_set1_epi8(3);
    let m4 = _mm_set1_epi8(0xF);
    let mut acc = [_mm256_setzero_ps(); M];
    for b in 0..nb {
        let x = w.add(b * BlockQ2K::BYTES);
        prefetch_ahead(x, 2);
        let ya = a.add(b * A_BYTES);
        let (dw, dminw) = f16x2_at(x.add(80));
        let ms = ld128(x);
        let scales8 = _mm_and_si128(ms, m4);
        let mins = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(ms), m4));
        // The min term goes into the same lanes first, as ggml does.
        for (r, ac) in acc.iter_mut().enumerate() {
            let y = ya.add(r * stride);
            let prod = _mm256_madd_epi16(mins, ld(y.add(A_BSUMS)));
            let dmin = -rd_f32(y) * dminw;
            *ac = _mm256_fmadd_ps(_mm256_set1_ps(dmin), _mm256_cvtepi32_ps(prod), *ac);
        }
        let all = _mm256_cvtepi8_epi16(scales8);
        let halves = [
            _mm256_broadcastsi128_si256(_mm256_castsi256_si128(all)),
            _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(all)),
        ];
        let mut sumi = [_mm256_setzero_si256(); M];
        for (j, half) in halves.iter().enumerate() {
            let bits = ld(x.add(16 + 32 * j));
            let q = [
                _mm256_and_si256(bits, m3),
                _mm256_and_si256(_mm256_srli_epi16::<2>(bits), m3),
                _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m3),
                _mm256_and_si256(_mm256_srli_epi16::<6>(bits), m3),
            ];
            for (k, qk) in q.iter().enumerate() {
                let sc = _mm256_shuffle_epi8(*half, word_pair_bcast(k));
                for (r, s) in sumi.iter_mut().enumerate() {
                    let q8 = ld(ya.add(r * stride + A_QS + 128 * j + 32 * k));
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(sc, _mm256_maddubs_epi16(*qk, q8)));
                }
            }
        }
        for (r, (s, ac)) in sumi.iter().zip(acc.iter_mut()).enumerate() {
            let d = rd_f32(ya.add(r * stride)) * dw;
            *ac = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(*s), *ac);
        }
    }
    for (r, ac) in acc.iter().enumerate() {
        *out.add(r) = hsum_float_8(*ac);
    }
}
