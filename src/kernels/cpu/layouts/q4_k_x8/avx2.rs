//! AVX2 kernels over x8-packed Q4_K (see the parent module for the layout and the arithmetic).
//!
//! One 32-byte load holds four columns of eight weight rows; its low and high nibbles meet the
//! same four activation bytes, broadcast to all eight lanes, through `vpmaddubsw` (unsigned
//! nibble × signed byte, at most 2·15·128 = 3840 per i16 lane, so eight steps of one sub-block
//! sum to at most 30720 in i16 without saturating), then `vpmaddwd` by the eight rows' scales
//! gives exact i32 sub-block sums, one lane per weight row. The float steps are lane-wise, so each
//! lane runs exactly the scalar twin's chain.

use std::arch::x86_64::*;

use crate::kernels::cpu::simd::avx2::{bcast32, ld};

use super::{A_BYTES, BLOCK_BYTES, GROUP};

/// How far ahead decode prefetches, in bytes (eight x8 blocks).
const PREFETCH: usize = 8 * BLOCK_BYTES;
/// Cache lines of one block (18, of its 32 steps).
const LINES: usize = BLOCK_BYTES / 64;
const _: () = assert!(LINES <= 32);

/// Eight bytes at `p` as 16 i16 `(b0, b0, b1, b1, ..)`: the scale of weight row `c` in both
/// words of dword `c`, for `vpmaddwd`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dup_words(p: *const u8) -> __m256i {
    let v = _mm_loadl_epi64(p.cast());
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v))
}

/// Eight bytes at `p` and eight at `q` as 16 i16 `(p0, q0, p1, q1, ..)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair_words(p: *const u8, q: *const u8) -> __m256i {
    let (a, b) = (_mm_loadl_epi64(p.cast()), _mm_loadl_epi64(q.cast()));
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b))
}

/// See [`super::dot_group`].
///
/// # Safety
/// AVX2, FMA and F16C are available; `w` points at `nb` packed blocks; `a + r * stride` for
/// `r < m` at `nb` Q8_K blocks; `1 <= m <= 4`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_group(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    m: usize,
    pair: bool,
    out: &mut [[f32; GROUP]; 4],
) {
    match (m, pair) {
        (4, true) => rows_m::<4, true>(nb, w, a, stride, out),
        (3, true) => rows_m::<3, true>(nb, w, a, stride, out),
        (2, true) => rows_m::<2, true>(nb, w, a, stride, out),
        (1, true) => rows_m::<1, true>(nb, w, a, stride, out),
        (4, false) => rows_m::<4, false>(nb, w, a, stride, out),
        (3, false) => rows_m::<3, false>(nb, w, a, stride, out),
        (2, false) => rows_m::<2, false>(nb, w, a, stride, out),
        _ => rows_m::<1, false>(nb, w, a, stride, out),
    }
}

/// [`dot_group`] for `M` rows, flavour `PAIR`.
///
/// # Safety
/// As [`dot_group`] with `m = M`.
#[allow(clippy::needless_range_loop)] // rows and pairs index several arrays at once
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_m<const M: usize, const PAIR: bool>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: &mut [[f32; GROUP]; 4],
) {
    let m4 = _mm256_set1_epi8(0xF);
    let c63 = _mm256_set1_epi8(63);
    let cc0 = _mm256_set1_epi8(0xC0u8 as i8);
    let mut acc = [_mm256_setzero_ps(); M];
    let mut accm = [_mm256_setzero_ps(); M];
    for b in 0..nb {
        let x = w.add(b * BLOCK_BYTES);
        // Scales and mins of the 8 rows: bytes [8j + c] for sub-block j, row c (get_scale_min_k4
        // on the transposed bytes, all rows at once).
        let (q0, q1, q2) = (ld(x.add(32)), ld(x.add(64)), ld(x.add(96)));
        let sc03 = _mm256_and_si256(q0, c63);
        let mn03 = _mm256_and_si256(q1, c63);
        let sc47 = _mm256_or_si256(
            _mm256_and_si256(q2, m4),
            _mm256_srli_epi16::<2>(_mm256_and_si256(q0, cc0)),
        );
        let mn47 = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(q2), m4),
            _mm256_srli_epi16::<2>(_mm256_and_si256(q1, cc0)),
        );
        let mut scb = [0u8; 64];
        let mut mnb = [0u8; 64];
        _mm256_storeu_si256(scb.as_mut_ptr().cast(), sc03);
        _mm256_storeu_si256(scb.as_mut_ptr().add(32).cast(), sc47);
        _mm256_storeu_si256(mnb.as_mut_ptr().cast(), mn03);
        _mm256_storeu_si256(mnb.as_mut_ptr().add(32).cast(), mn47);

        let dw = _mm256_cvtph_ps(_mm_loadu_si128(x.cast()));
        let dmw = _mm256_cvtph_ps(_mm_loadu_si128(x.add(16).cast()));
        let mut dd = [_mm256_setzero_ps(); M];
        let mut dm = [_mm256_setzero_ps(); M];
        // Per row: the 8 sub-block activation sums as i16, dword p = (S[2p], S[2p + 1]).
        let mut bsp = [[0i32; 4]; M];
        for r in 0..M {
            let y = a.add(r * stride + b * A_BYTES);
            let ad = _mm256_set1_ps(y.cast::<f32>().read_unaligned());
            dd[r] = _mm256_mul_ps(dw, ad);
            dm[r] = _mm256_mul_ps(dmw, ad);
            let bs = ld(y.add(260));
            let s = _mm_hadd_epi16(
                _mm256_castsi256_si128(bs),
                _mm256_extracti128_si256::<1>(bs),
            );
            _mm_storeu_si128(bsp[r].as_mut_ptr().cast(), s);
        }

        let mut isum_t = [_mm256_setzero_si256(); M];
        let mut imin_t = [_mm256_setzero_si256(); M];
        for p in 0..4 {
            let mut alo = [_mm256_setzero_si256(); M];
            let mut ahi = [_mm256_setzero_si256(); M];
            let wq = x.add(128 + 256 * p);
            for s in 0..8 {
                let l = 8 * p + s;
                if !PAIR && l < LINES {
                    // The GEMV flavour (decode, row-invariant verify) streams the packed
                    // weights once: prefetch into L2 eight blocks ahead, one line per step,
                    // spread over the block's arithmetic (see the AVX-512 kernel: a burst
                    // stalls on the core's miss buffers).
                    _mm_prefetch::<_MM_HINT_T1>(x.wrapping_add(PREFETCH + 64 * l).cast());
                    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
                }
                let bits = ld(wq.add(32 * s));
                let lo = _mm256_and_si256(bits, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
                for r in 0..M {
                    let y = a.add(r * stride + b * A_BYTES + 4 + 64 * p + 4 * s);
                    alo[r] = _mm256_add_epi16(alo[r], _mm256_maddubs_epi16(lo, bcast32(y)));
                    ahi[r] = _mm256_add_epi16(ahi[r], _mm256_maddubs_epi16(hi, bcast32(y.add(32))));
                }
            }
            let s0 = dup_words(scb.as_ptr().add(16 * p));
            let s1 = dup_words(scb.as_ptr().add(16 * p + 8));
            let mv = pair_words(mnb.as_ptr().add(16 * p), mnb.as_ptr().add(16 * p + 8));
            for r in 0..M {
                let isum =
                    _mm256_add_epi32(_mm256_madd_epi16(alo[r], s0), _mm256_madd_epi16(ahi[r], s1));
                let imin = _mm256_madd_epi16(mv, _mm256_set1_epi32(bsp[r][p]));
                if PAIR {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd[r], acc[r]);
                    accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), dm[r], accm[r]);
                } else {
                    isum_t[r] = _mm256_add_epi32(isum_t[r], isum);
                    imin_t[r] = _mm256_add_epi32(imin_t[r], imin);
                }
            }
        }
        if !PAIR {
            for r in 0..M {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum_t[r]), dd[r], acc[r]);
                accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin_t[r]), dm[r], accm[r]);
            }
        }
    }
    for r in 0..M {
        _mm256_storeu_ps(out[r].as_mut_ptr(), _mm256_sub_ps(acc[r], accm[r]));
    }
}
