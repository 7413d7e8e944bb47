//! The AVX2 level (AVX2 + FMA + F16C): one kernel per weight type, each written once as
//! `rows::<M>` — one weight row against `M` (1..=4) activation rows, the weight blocks unpacked
//! once per block for all `M` rows — from which [`entries!`] derives the safe `dot` (`M = 1`) and
//! `tile` (rows in groups of up to four) entry points.
//!
//! Invariants: every kernel here is reachable only through [`kernels`] and [`q4k_gemm`], which
//! first check that the CPU has AVX2, FMA and F16C, so the `#[target_feature]` code never runs
//! where it cannot; every entry point checks the byte lengths (as the scalar reference does) before
//! any raw-pointer read, and `rows` reads only the `nb` weight blocks and, per activation row, its
//! `nb` activation blocks (all loads unaligned: GGUF bytes are 1-byte aligned); the only accesses
//! past them are prefetch hints, which cannot fault. The float operations of row `j` never depend
//! on `M` or on the other rows, which is what makes `tile` bit-identical to `dot`.

use std::arch::x86_64::*;

use super::Kernels;
use crate::format::GgmlType;

mod float;
pub(crate) mod kquants;
pub(crate) mod legacy;

/// Whether this CPU has everything the AVX2 kernels use (std caches the CPUID probe).
pub(super) fn detected() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// The AVX2 kernels for `ty`, or `None` if the CPU lacks AVX2/FMA/F16C or no kernel exists.
pub(super) fn kernels(ty: GgmlType) -> Option<Kernels> {
    if !detected() {
        return None;
    }
    use GgmlType::*;
    let (dot, tile, name): (super::DotFn, super::DotTileFn, &'static str) = match ty {
        Q4K => (kquants::q4k_dot, kquants::q4k_tile, "avx2/q4_K"),
        Q6K => (kquants::q6k_dot, kquants::q6k_tile, "avx2/q6_K"),
        Q5K => (kquants::q5k_dot, kquants::q5k_tile, "avx2/q5_K"),
        Q3K => (kquants::q3k_dot, kquants::q3k_tile, "avx2/q3_K"),
        Q2K => (kquants::q2k_dot, kquants::q2k_tile, "avx2/q2_K"),
        Q4_0 => (legacy::q4_0_dot, legacy::q4_0_tile, "avx2/q4_0"),
        IQ4NL => (legacy::iq4_nl_dot, legacy::iq4_nl_tile, "avx2/iq4_nl"),
        Q4_1 => (legacy::q4_1_dot, legacy::q4_1_tile, "avx2/q4_1"),
        Q5_0 => (legacy::q5_0_dot, legacy::q5_0_tile, "avx2/q5_0"),
        Q5_1 => (legacy::q5_1_dot, legacy::q5_1_tile, "avx2/q5_1"),
        Q8_0 => (legacy::q8_0_dot, legacy::q8_0_tile, "avx2/q8_0"),
        F16 => (float::f16_dot, float::f16_tile, "avx2/f16"),
        BF16 => (float::bf16_dot, float::bf16_tile, "avx2/bf16"),
        _ => return None,
    };
    Some(Kernels { dot, tile, name })
}

/// The AVX2 decode kernel over many weight rows for `ty` (see [`super::DotRowsFn`]), where one
/// exists and the CPU has AVX2/FMA/F16C.
pub(super) fn dot_rows(ty: GgmlType) -> Option<super::DotRowsFn> {
    if !detected() {
        return None;
    }
    match ty {
        GgmlType::Q8_0 => Some(legacy::q8_0_dot_rows),
        GgmlType::Q5_0 => Some(legacy::q5_0_dot_rows),
        GgmlType::Q6K => Some(kquants::q6k_dot_rows),
        _ => None,
    }
}

/// The AVX2 x4-layout decode kernel for `ty` (see [`super::DotX4Fn`]), where one exists and the
/// CPU has AVX2/FMA/F16C.
pub(super) fn dot_x4(ty: GgmlType) -> Option<super::DotX4Fn> {
    if !detected() {
        return None;
    }
    match ty {
        GgmlType::Q6K => Some(kquants::q6k_dot_x4),
        _ => None,
    }
}

/// The AVX2 Q4_K tile with llama.cpp's repacked-GEMM accumulation (see `kquants`), or `None`
/// without AVX2/FMA/F16C.
pub(super) fn q4k_gemm() -> Option<Kernels> {
    detected().then_some(Kernels {
        dot: kquants::q4k_gemm_dot,
        tile: kquants::q4k_gemm_tile,
        name: "avx2/q4_K-gemm",
    })
}

/// Number of blocks in a row of `n` elements; panics unless `n` is a whole number of `elems`-element
/// blocks and `w_len` is exactly that many `w_bytes`-byte blocks.
pub(crate) fn blocks(n: usize, elems: usize, w_len: usize, w_bytes: usize) -> usize {
    assert!(
        n.is_multiple_of(elems),
        "n = {n} is not a whole number of {elems}-element blocks"
    );
    let nb = n / elems;
    assert_eq!(
        w_len,
        nb * w_bytes,
        "weight row must be exactly {nb} blocks"
    );
    nb
}

/// Defines the safe entry points `$dot` ([`super::DotFn`]) and `$tile` ([`super::DotTileFn`]) of a
/// kernel `$rows::<M>(nb, w, a, stride, out)`, for `$elems`-element blocks of `$wb` weight bytes
/// and `$ab` activation bytes; `$max` (2, 4 or 8) is the most rows one `rows` call takes.
macro_rules! entries {
    ($dot:ident, $tile:ident, $rows:ident, $elems:expr, $wb:expr, $ab:expr, $max:tt) => {
        pub(super) fn $dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
            let nb = super::blocks(n, $elems, w.len(), $wb);
            assert_eq!(
                a.len(),
                nb * $ab,
                "activation row must be exactly {nb} blocks"
            );
            let mut out = [0f32; 1];
            // SAFETY: only the level's `kernels()` hands this function out, after checking the
            // CPU has the level's features;
            // `w` is exactly `nb` weight blocks and `a` exactly `nb` activation blocks (checked
            // above), and `rows::<1>` reads only those and writes only `out[0]`.
            unsafe { $rows::<1>(nb, w.as_ptr(), a.as_ptr(), 0, out.as_mut_ptr()) };
            out[0]
        }

        pub(super) fn $tile(
            n: usize,
            w: &[u8],
            acts: &[u8],
            stride: usize,
            m: usize,
            out: &mut [f32],
        ) {
            let nb = super::blocks(n, $elems, w.len(), $wb);
            crate::kernels::cpu::simd::check_tile(nb * $ab, acts.len(), stride, m, out.len());
            let (w, a, o) = (w.as_ptr(), acts.as_ptr(), out.as_mut_ptr());
            let mut j = 0;
            while j < m {
                let k = (m - j).min($max);
                // SAFETY: as in the dot entry point for the CPU features; rows j..j+k start inside
                // `acts` at multiples of `stride` and each has `nb * $ab` bytes there, and `out`
                // has at least `m` slots (both checked by `check_tile`).
                unsafe {
                    let (a, o) = (a.add(j * stride), o.add(j));
                    super::rows_dispatch!($rows, $max, k, nb, w, a, stride, o);
                }
                j += k;
            }
        }
    };
}
pub(crate) use entries;

/// `$rows::<k>(..)` for a run-time `k` in `1..=$max` (`$max` 2, 4 or 8).
macro_rules! rows_dispatch {
    ($rows:ident, 2, $k:expr, $($arg:expr),*) => {
        match $k {
            1 => $rows::<1>($($arg),*),
            _ => $rows::<2>($($arg),*),
        }
    };
    ($rows:ident, 4, $k:expr, $($arg:expr),*) => {
        match $k {
            1 => $rows::<1>($($arg),*),
            2 => $rows::<2>($($arg),*),
            3 => $rows::<3>($($arg),*),
            _ => $rows::<4>($($arg),*),
        }
    };
    ($rows:ident, 8, $k:expr, $($arg:expr),*) => {
        match $k {
            1 => $rows::<1>($($arg),*),
            2 => $rows::<2>($($arg),*),
            3 => $rows::<3>($($arg),*),
            4 => $rows::<4>($($arg),*),
            5 => $rows::<5>($($arg),*),
            6 => $rows::<6>($($arg),*),
            7 => $rows::<7>($($arg),*),
            _ => $rows::<8>($($arg),*),
        }
    };
}
pub(crate) use rows_dispatch;

/// Defines the safe entry point `$name` ([`super::DotRowsFn`]) from a four-row decode kernel
/// `$wrows4(nb, w, row_bytes, a, out)` and, for a last group of fewer than four rows, the one-row
/// kernel `$rows::<1>`; `$elems`-element blocks of `$wb` weight bytes and `$ab` activation bytes.
macro_rules! wrows_entry {
    ($name:ident, $wrows4:ident, $rows:ident, $elems:expr, $wb:expr, $ab:expr) => {
        pub(super) fn $name(n: usize, w: &[u8], row_bytes: usize, a: &[u8], out: &mut [f32]) {
            let r = out.len();
            assert!(
                n % $elems == 0 && row_bytes == n / $elems * $wb,
                "row of {n} values is not {row_bytes} bytes"
            );
            let nb = n / $elems;
            assert!(w.len() >= r * row_bytes, "weight rows");
            assert_eq!(
                a.len(),
                nb * $ab,
                "activation row must be exactly {nb} blocks"
            );
            let (wp, ap, o) = (w.as_ptr(), a.as_ptr(), out.as_mut_ptr());
            let mut i = 0;
            while i < r {
                // SAFETY: only the level's `dot_rows()` hands this function out, after checking
                // the CPU has the level's features; `w` holds `r` rows of `nb` blocks `row_bytes` apart and `a` one row
                // of `nb` activation blocks (checked above); `out` has `r` slots, and the calls
                // touch rows / slots `i..i + 4` (or `i`) only, all below `r`.
                unsafe {
                    if r - i >= 4 {
                        $wrows4(nb, wp.add(i * row_bytes), row_bytes, ap, o.add(i));
                        i += 4;
                    } else {
                        $rows::<1>(nb, wp.add(i * row_bytes), ap, 0, o.add(i));
                        i += 1;
                    }
                }
            }
        }
    };
}
pub(crate) use wrows_entry;

/// How far ahead (bytes) the x4-layout decode kernels prefetch into L1: three steps of four
/// blocks. The layout is one linear stream, and longer distances were slower (see the AVX-512
/// `q6k_wrows4_at`).
pub(crate) const X4_AHEAD: usize = 3 * 840;

/// Defines `$name(n, w, a, out)`, the [`super::DotX4Fn`] entry of a level: `out.len()` rows (a
/// multiple of four) stored in the x4 layout at `w` (groups of four rows, each group's blocks
/// interleaved row by row: block `b` of row `r` of group `g` at `(4 (g · nb + b) + r) · $wb`)
/// against one activation row, through `$wrows4_at(nb, w, (rs, bs, pd), a, out)`.
macro_rules! x4_entry {
    ($name:ident, $wrows4_at:ident, $elems:expr, $wb:expr, $ab:expr) => {
        pub(super) fn $name(n: usize, w: &[u8], a: &[u8], out: &mut [f32]) {
            let r = out.len();
            assert!(n % $elems == 0 && r % 4 == 0, "{r} rows of {n} values");
            let nb = n / $elems;
            let group = 4 * nb * $wb;
            assert!(w.len() >= r / 4 * group, "weight rows");
            assert_eq!(
                a.len(),
                nb * $ab,
                "activation row must be exactly {nb} blocks"
            );
            let (wp, ap, o) = (w.as_ptr(), a.as_ptr(), out.as_mut_ptr());
            let strides = ($wb, 4 * $wb, crate::kernels::cpu::simd::avx2::X4_AHEAD);
            for g in 0..r / 4 {
                // SAFETY: only the level's `dot_x4()` hands this function out, after checking
                // the CPU has the level's features; group `g < r / 4` of `nb` interleaved
                // blocks lies inside `w` and `a` holds one row of `nb` activation blocks (both
                // checked above); the call writes slots `4g..4g + 4` of `out` only.
                unsafe { $wrows4_at(nb, wp.add(g * group), strides, ap, o.add(4 * g)) };
            }
        }
    };
}
pub(crate) use x4_entry;

// ---- shared helpers: all `#[inline]` + the level's features, so they inline into the kernels ----

/// How far ahead of the block being read the kernels prefetch weights, in bytes. Decode streams
/// each weight row from memory exactly once; prefetching 2304 bytes (16 Q4_K blocks) ahead cut
/// the from-memory Q4_K dot time by about 10% on the development machine (AMD EPYC, AVX2), where
/// the hardware prefetcher alone left the loads and the arithmetic mostly serialized.
const PREFETCH: usize = 2304;

/// Prefetches the `lines` cache lines at `PREFETCH` bytes past the block at `x` into L1. Never
/// faults (the address may lie past the weights: `wrapping_add`, and prefetches are only hints).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn prefetch_ahead(x: *const u8, lines: usize) {
    for l in 0..lines {
        _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add(PREFETCH + 64 * l).cast());
    }
}

/// Unaligned 32-byte load.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn ld(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p.cast())
}

/// The 4 bytes at `p` (unaligned) broadcast to all eight dwords (`vpbroadcastd` from memory).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bcast32(p: *const u8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// Unaligned 16-byte load.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn ld128(p: *const u8) -> __m128i {
    _mm_loadu_si128(p.cast())
}

/// The little-endian f32 at `p` (unaligned).
#[inline]
pub(crate) unsafe fn rd_f32(p: *const u8) -> f32 {
    p.cast::<f32>().read_unaligned()
}

/// The little-endian u32 at `p` (unaligned).
#[inline]
pub(crate) unsafe fn rd_u32(p: *const u8) -> u32 {
    p.cast::<u32>().read_unaligned()
}

/// The f16 at `p` (unaligned) widened to f32 (exact, F16C), in all eight lanes.
///
/// The f16 helpers load full vector widths on purpose: converting a lone 16-bit value lets the
/// compiler insert it into whatever register is free (`vpinsrw`), a false dependency that chained
/// the per-block scale of the 32-value kernels to the previous block's accumulator.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_bcast(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16(p.cast::<i16>().read_unaligned()))
}

/// The f16 at `p` (unaligned) widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    _mm256_cvtss_f32(f16_bcast(p))
}

/// The two consecutive f16 at `p` and `p + 2` (reads 4 bytes) widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x2_at(p: *const u8) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128(rd_u32(p) as i32));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// The four f16 at `p[0]`, `p[1]`, .. (2 bytes each, unaligned; `p.len() <= 4`, the rest 0)
/// widened to f32 in lanes 0..4.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x4_gather(p: &[*const u8]) -> __m128 {
    let mut bits = 0u64;
    for (i, q) in p.iter().enumerate() {
        bits |= (q.cast::<u16>().read_unaligned() as u64) << (16 * i);
    }
    _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64))
}

/// ggml's `hsum_float_8`: `((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7))`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum_float_8(x: __m256) -> f32 {
    let mut r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Sums each of up to four 8-lane i32 vectors: lane `r` of the result is the sum of `v[r]` (lanes
/// past `M` are 0). Exact (wrapping i32, as ggml).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum_rows<const M: usize>(v: &[__m256i; M]) -> __m128i {
    let z = _mm256_setzero_si256();
    let h = match M {
        1 => _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], z), z),
        2 => _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), z),
        _ => {
            let mut p = [z; 4];
            p[..M].copy_from_slice(v);
            _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]))
        }
    };
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

/// ggml's `bytes_from_nibbles_32`: the 32 nibbles of 16 bytes, low nibbles first, as bytes 0..16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bytes_from_nibbles_32(p: *const u8) -> __m256i {
    let t = ld128(p);
    let b = _mm256_set_m128i(_mm_srli_epi16::<4>(t), t);
    _mm256_and_si256(b, _mm256_set1_epi8(0xF))
}

/// ggml's `bytes_from_bits_32`: byte `j` is 0xFF where bit `j` of the little-endian u32 at `p` is
/// set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn bytes_from_bits_32(p: *const u8) -> __m256i {
    let x = rd_u32(p) as i32;
    let shuf = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    let bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1))
}

/// Sums of four adjacent u8 × i8 products as 8 i32 lanes (lane `l`: bytes `4l..4l+4`), via
/// `vpmaddubsw` + `vpmaddwd` — ggml's `mul_sum_us8_pairs_float` before its conversion. The i16
/// pair sums cannot saturate for `u <= 127` or `|s| <= 127`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_us8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(u, s))
}

/// The 8 scales and 8 mins of a Q4_K/Q5_K block's 12 packed bytes at `p`, as ggml's `utmp`
/// shuffle leaves them: `(scales as 8 bytes, mins as 8 bytes)`, each a little-endian u64.
#[inline]
unsafe fn k4_scales_mins(p: *const u8) -> (u64, u64) {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let (u0, u1, u2) = (rd_u32(p), rd_u32(p.add(4)), rd_u32(p.add(8)));
    let u3 = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    let mins_lo = u1 & K1;
    let sc_hi = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let sc_lo = u0 & K1;
    (
        sc_lo as u64 | (sc_hi as u64) << 32,
        mins_lo as u64 | (u3 as u64) << 32,
    )
}
