//! AVX-512 VNNI kernel over one x16 unit of packed Q4_K (see the parent module for the layout and
//! the arithmetic).
//!
//! One 64-byte load holds the same four columns of sixteen weight rows; its low and high nibbles
//! meet four activation bytes broadcast to all lanes through `vpdpbusd`, which adds the four
//! products straight into the i32 lane of each weight row, so after the eight steps of a
//! sub-block every lane holds that row's exact sub-block sum (the high nibbles' sum times 16, as
//! they stay in place). Multiplying by the rows' 6-bit scales (`vpmulld` in the GEMV flavour,
//! exact float products below 2^24 in the GEMM one) gives the same exact values the AVX2 kernel
//! builds with `vpmaddubsw`/`vpmaddwd`, and the float steps are the same lane-wise operations, so
//! every output is bit-identical to the AVX2 kernel and the scalar twin.

use std::arch::x86_64::*;

use crate::kernels::cpu::simd::avx512::{bcast32x16, ld2x256};

use super::{A_BYTES, BLOCK_BYTES, GROUP};

/// Weight rows per unit.
const R: usize = 2 * GROUP;
/// How far ahead decode prefetches, in bytes (three unit blocks). Qwen2.5-1.5B's decode step,
/// alternated step by step in one process against four blocks ahead (paired ratios of step
/// times, split by the bandwidth probe read before each pair; 2026-11-26): three blocks 1.010,
/// 1.011 and 1.008 while the probe read 48-50 GB/s (603-680 pairs), 1.000, 0.999 and 1.000 while
/// it read 77-81 (182-397 pairs); Gemma-3 270M's 1.006 at 80 (2369 pairs). Two blocks and two and
/// a half: 1.012-1.014 in the low state, 0.973 and 0.989 in the high; five 0.982 in the high. In
/// that session the kernel alone, on two threads over a 113 MB matrix, read 87-92% of the probe
/// in the high state and 96-98% in the low (three blocks ahead 90% and 98%). (Earlier sessions,
/// alone on a 186 MB matrix while the probe, then on 4 KiB pages, read 75 GB/s: into L1 9216
/// bytes ahead 82.5 GB/s, 6912 80.8, 13824 80.2, 4608 76.3; into L2 9216 bytes ahead 77.9, 4608
/// 71.6.) With the non-temporal hint (`prefetchnta`) instead of `T0`, Qwen2.5-1.5B's decode step,
/// alternated step by step in one process: 0.4-1.1% shorter while the probe read 47-51 GB/s
/// (five runs of 181-600 pairs), 1.2-1.6% while it read 74-79 (two runs of 279-419); Gemma-3
/// 270M's 0.4% (low state). In the 2026-11-26 session `T0` was again 1.1-1.3% slower in the low
/// state; in the high state 2.1% slower four blocks ahead (49 pairs) and 1.0% faster three ahead
/// (482 pairs), but neither its down-projection part nor the rest alone was faster (0.998 and
/// 0.995). (Q6_K's kernel with `prefetchnta`: -0.4 to +1%.)
/// (Measured on AMD family 26. On Zen 4, where [`crate::kernels::cpu::layouts::prefetch::on`] is false,
/// the kernel leaves the stream to the hardware prefetcher, the GEMV flavour only seeding it:
/// [`SEED_AHEAD`].)
const PREFETCH: usize = 6 * BLOCK_BYTES;
/// Cache lines of one unit block (36: one per step of its 32, four steps taking two).
const LINES: usize = 2 * BLOCK_BYTES / 64;
/// Where the GEMV flavour leaves the stream to the hardware prefetcher (AMD family 25), it still
/// asks for one line twelve unit blocks (27 KB) ahead into L2 once per block: a seed, not the
/// stream (one line of the block's 36). Measured on Zen 4 (2026-11-27), the kernel alone on two
/// threads over a 200 MB matrix of 1536-value rows, alternated with probe reads (three runs of
/// 33-50 reads in the high-bandwidth state): 0.898, 0.944 and 0.973 of the probe without, 0.924,
/// 0.965 and 0.995 with (18 KB ahead 0.933, 0.969, 0.984); in the low state 0.956 and 0.982
/// without, 0.977 and 0.999 with. Qwen2.5-1.5B's decode step, alternated step by step in one
/// process: 0.9885, 0.9959 and 1.0045 in the high state (281, 198 and 83 pairs), 0.9941-0.9997 in
/// the low (five runs of 119-800); 36 KB ahead against 27 KB 1.0018 in both. Gemma-3 270M's step
/// 0.9994 (little of it is Q4_K). Not kept: `T0` 4 or 9 KB ahead (0.85 and 0.92 of the probe
/// alone, against 0.96 without), `prefetchnta` 9 KB ahead (0.90), the same seed in Q6_K's kernel
/// (Qwen's step 1.0016 low, 0.9994 high). The GEMV flavour's two rows seed it the same way, and
/// three or four rows prefetch every line this far ahead (see `rows_m`).
const SEED_AHEAD: usize = 12 * 2 * BLOCK_BYTES;
const _: () = assert!(LINES > 32 && LINES - 32 <= 32);

/// See [`super::dot_pair`].
///
/// # Safety
/// The AVX-512 level is available (AVX2, FMA, F16C, AVX-512 F/BW/VL/VNNI); `w` points at `nb`
/// x16 blocks; `a + r * stride` for `r < m` at `nb` Q8_K blocks; `1 <= m <= 4`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_pair(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    m: usize,
    pair: bool,
    out: &mut [[f32; R]; 4],
) {
    // The prefetch choice is a constant of each kernel: tested inside the loops, its branches
    // cost decode (see `gemv_units`).
    let stream = crate::kernels::cpu::layouts::prefetch::on();
    match (m, pair, stream) {
        (4, true, _) => rows_m::<4, true, false>(nb, w, a, stride, out),
        (3, true, _) => rows_m::<3, true, false>(nb, w, a, stride, out),
        (2, true, _) => rows_m::<2, true, false>(nb, w, a, stride, out),
        (1, true, _) => rows_m::<1, true, false>(nb, w, a, stride, out),
        (4, false, true) => rows_m::<4, false, true>(nb, w, a, stride, out),
        (3, false, true) => rows_m::<3, false, true>(nb, w, a, stride, out),
        (2, false, true) => rows_m::<2, false, true>(nb, w, a, stride, out),
        (_, false, true) => rows_m::<1, false, true>(nb, w, a, stride, out),
        (4, false, false) => rows_m::<4, false, false>(nb, w, a, stride, out),
        (3, false, false) => rows_m::<3, false, false>(nb, w, a, stride, out),
        (2, false, false) => rows_m::<2, false, false>(nb, w, a, stride, out),
        _ => rows_m::<1, false, false>(nb, w, a, stride, out),
    }
}

/// [`dot_pair`] for `M` rows, flavour `PAIR`; `STREAM`: the GEMV flavour streams with
/// prefetches ([`crate::kernels::cpu::layouts::prefetch::on`]), else it seeds the hardware prefetcher.
///
/// # Safety
/// As [`dot_pair`] with `m = M`.
#[allow(clippy::needless_range_loop)] // rows and pairs index several arrays at once
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_m<const M: usize, const PAIR: bool, const STREAM: bool>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: &mut [[f32; R]; 4],
) {
    let m4 = _mm512_set1_epi8(0xF);
    let mf0 = _mm512_set1_epi8(0xF0u8 as i8);
    let c63 = _mm512_set1_epi8(63);
    let cc0 = _mm512_set1_epi8(0xC0u8 as i8);
    let mut acc = [_mm512_setzero_ps(); M];
    let mut accm = [_mm512_setzero_ps(); M];
    // The GEMV flavour streams with prefetches where this CPU gains by it (`prefetch`); where
    // it does not (Zen 4) it seeds the hardware prefetcher (`SEED_AHEAD`): one and two rows one
    // line a unit block, three and four rows every line (`dense`), as slow enough for the
    // hardware alone to fall behind. On Zen 4, Qwen2.5-1.5B's row-invariant forward of k tokens,
    // alternated in one process (2026-11-27, paired ratios of forward times): two rows seeded
    // instead of streamed 0.964-0.999 in the low state (three runs of 80 pairs) and 0.90-0.94 in
    // the high (3 and 10 pairs); three and four rows seeded instead of left alone 0.963 (60
    // pairs) and 0.994-0.996 (two runs of 60), eight 0.994 (40); then every line instead of the
    // seed 0.949 at three rows, 0.943 and 0.952 at four (0.931 low, 0.974 high), 0.937 at eight
    // (0.920 low, 0.941 high), 9 or 55 KB ahead instead of 27 0.955 and 0.960 at four; two
    // rows 1.059, so they keep the seed.
    let stream = !PAIR && STREAM;
    let dense = !PAIR && !stream && M >= 3;
    let seed = !PAIR && !stream && !dense;
    for b in 0..nb {
        let x = w.add(2 * b * BLOCK_BYTES);
        if seed {
            // One line ahead into L2 (`SEED_AHEAD`); a hint that never faults past the end.
            _mm_prefetch::<_MM_HINT_T1>(x.wrapping_add(SEED_AHEAD).cast());
        }
        // Scales and mins of the 16 rows (get_scale_min_k4 on the transposed bytes, all rows at
        // once): byte 16j + c of `sc03` is sub-block j's scale of row c, `sc47` the same for
        // sub-blocks 4..8, `mn03`/`mn47` for the mins.
        let ld = |o: usize| _mm512_loadu_si512(x.add(o).cast());
        let (q0, q1, q2) = (ld(4 * R), ld(8 * R), ld(12 * R));
        let sc03 = _mm512_and_si512(q0, c63);
        let mn03 = _mm512_and_si512(q1, c63);
        let sc47 = _mm512_or_si512(
            _mm512_and_si512(q2, m4),
            _mm512_srli_epi16::<2>(_mm512_and_si512(q0, cc0)),
        );
        let mn47 = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16::<4>(q2), m4),
            _mm512_srli_epi16::<2>(_mm512_and_si512(q1, cc0)),
        );
        // Pair p's scale and min bytes are 128-bit lanes 0 and 1 of `scq` and `mnq`: each pair
        // shifts the queue (`sc03` then `sc47`) down two lanes, so no lane is picked by a
        // runtime index (a chain of branches): Qwen2.5-1.5B's decode step 0.995-1.001 of the time
        // in the high-bandwidth state (Zen 4, five runs of 271-289 pairs alternated in one
        // process), bit-identical.
        let (mut scq, mut scr, mut mnq, mut mnr) = (sc03, sc47, mn03, mn47);

        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(x.cast()));
        let dmw = _mm512_cvtph_ps(_mm256_loadu_si256(x.add(2 * R).cast()));
        let mut dd = [_mm512_setzero_ps(); M];
        let mut dm = [_mm512_setzero_ps(); M];
        // Per row: the 8 sub-block activation sums as i16, dword p = (S[2p], S[2p + 1]).
        // Aligned: see `Aligned` (this keeps the kernel's spills on whole lines).
        let mut bsp = crate::kernels::cpu::Aligned([[0i32; 4]; M]);
        for r in 0..M {
            let y = a.add(r * stride + b * A_BYTES);
            let ad = _mm512_set1_ps(y.cast::<f32>().read_unaligned());
            dd[r] = _mm512_mul_ps(dw, ad);
            dm[r] = _mm512_mul_ps(dmw, ad);
            let s = _mm_hadd_epi16(
                _mm_loadu_si128(y.add(260).cast()),
                _mm_loadu_si128(y.add(276).cast()),
            );
            _mm_storeu_si128(bsp.0[r].as_mut_ptr().cast(), s);
        }

        let mut isum_t = [_mm512_setzero_si512(); M];
        let mut imin_t = [_mm512_setzero_si512(); M];
        for p in 0..4 {
            let mut alo = [_mm512_setzero_si512(); M];
            let mut ahi = [_mm512_setzero_si512(); M];
            for s in 0..8 {
                if stream {
                    // The GEMV flavour (decode, and the row-invariant verify of up to four
                    // rows), where `prefetch::on`, streams the packed weights once: prefetch
                    // three unit blocks ahead (past the unit's end too, into the next unit of
                    // the same stream; prefetches never fault), one line per step, spread over
                    // the block's arithmetic. Issued as one burst of 36 at the block's start,
                    // they stall on the core's miss buffers and the arithmetic waits behind
                    // them: Qwen's Q4_K decode matmuls stream at 19.7 GB/s that way, 24.9 GB/s
                    // spread; a four-row verify costs 1.80 decode steps without these
                    // prefetches, 1.43 with them.
                    let l = 8 * p + s;
                    _mm_prefetch::<_MM_HINT_NTA>(x.wrapping_add(PREFETCH + 64 * l).cast());
                    if l < LINES - 32 {
                        _mm_prefetch::<_MM_HINT_NTA>(
                            x.wrapping_add(PREFETCH + 64 * (32 + l)).cast(),
                        );
                    }
                    // Keeps the compiler from gathering the prefetches back into one burst.
                    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
                }
                if dense {
                    // Every line of the unit block `SEED_AHEAD` bytes ahead into L2, one or two
                    // a step as the stream does.
                    let l = 8 * p + s;
                    let ahead = x.wrapping_add(SEED_AHEAD + 64 * l);
                    _mm_prefetch::<_MM_HINT_T1>(ahead.cast());
                    if l < LINES - 32 {
                        _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * 32).cast());
                    }
                    // Keeps the compiler from gathering the prefetches back into one burst.
                    std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
                }
                // The nibbles: one 64-byte load a line once compiled (see `ld2x256`).
                let bits = ld2x256(x.add(16 * R + 32 * R * p + 4 * R * s));
                let lo = _mm512_and_si512(bits, m4);
                // The high nibbles stay in place (16·q): `vpdpbusd` does not saturate, so the
                // sums are exactly 16 times the nibbles' and one shift per pair replaces eight.
                let hi = _mm512_and_si512(bits, mf0);
                for r in 0..M {
                    let y = a.add(r * stride + b * A_BYTES + 4 + 64 * p + 4 * s);
                    alo[r] = _mm512_dpbusd_epi32(alo[r], lo, bcast32x16(y));
                    ahi[r] = _mm512_dpbusd_epi32(ahi[r], hi, bcast32x16(y.add(32)));
                }
            }
            let s0 = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(scq));
            let s1 = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32::<1>(scq));
            let (ma, mb) = (
                _mm512_castsi512_si128(mnq),
                _mm512_extracti32x4_epi32::<1>(mnq),
            );
            let mv = _mm512_cvtepu8_epi16(_mm256_set_m128i(
                _mm_unpackhi_epi8(ma, mb),
                _mm_unpacklo_epi8(ma, mb),
            ));
            let next = _mm512_set_epi64(11, 10, 9, 8, 7, 6, 5, 4);
            scq = _mm512_permutex2var_epi64(scq, next, scr);
            mnq = _mm512_permutex2var_epi64(mnq, next, mnr);
            scr = _mm512_shuffle_i64x2::<0xEE>(scr, scr);
            mnr = _mm512_shuffle_i64x2::<0xEE>(mnr, mnr);
            if PAIR {
                // The pair's sum in floats, exactly: |alo|, |ahi| ≤ 32·15·128 and the scales
                // are below 64, so every product and the sum are integers below 2^24, and
                // `16·ahi · (s1 / 16)` is exact too. This is the integer the GEMV flavour forms,
                // on the ports the float units share instead of two-µop `vpmulld`s.
                let f0 = _mm512_cvtepi32_ps(s0);
                let f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(1.0 / 16.0));
                for r in 0..M {
                    let lo = _mm512_mul_ps(_mm512_cvtepi32_ps(alo[r]), f0);
                    let isum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ahi[r]), f1, lo);
                    let imin = _mm512_madd_epi16(mv, _mm512_set1_epi32(bsp.0[r][p]));
                    acc[r] = _mm512_fmadd_ps(isum, dd[r], acc[r]);
                    accm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), dm[r], accm[r]);
                }
            } else {
                for r in 0..M {
                    let isum = _mm512_add_epi32(
                        _mm512_mullo_epi32(alo[r], s0),
                        _mm512_mullo_epi32(_mm512_srai_epi32::<4>(ahi[r]), s1),
                    );
                    let imin = _mm512_madd_epi16(mv, _mm512_set1_epi32(bsp.0[r][p]));
                    isum_t[r] = _mm512_add_epi32(isum_t[r], isum);
                    imin_t[r] = _mm512_add_epi32(imin_t[r], imin);
                }
            }
        }
        if !PAIR {
            for r in 0..M {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum_t[r]), dd[r], acc[r]);
                accm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin_t[r]), dm[r], accm[r]);
            }
        }
    }
    for r in 0..M {
        _mm512_storeu_ps(out[r].as_mut_ptr(), _mm512_sub_ps(acc[r], accm[r]));
    }
}

/// One activation row (`a`: `nb` Q8_K blocks) against `units` consecutive x16 units at `w` (the
/// GEMV flavour): `out[16u + c]` = weight row `c` of unit `u`, each as [`dot_pair`] computes it
/// for one row (the same kernel, inlined). One call covers a thread's whole share of a matrix, so
/// nothing is dispatched per unit (16 rows of 1536 values for most of Qwen2.5's matrices), and
/// the prefetch choice is a constant of the kernel instead of a flag tested at every step of its
/// loops. On Zen 4, Qwen2.5-1.5B's decode step against per-unit calls with that flag, alternated
/// step by step in one process (2026-11-27, paired ratios of step times): 0.953, 0.959, 0.962
/// and 0.962 in the high-bandwidth state (probe 53-58 GB/s; 17-137 pairs a run), 0.990-1.002 in
/// the low (142-300). The unit loop alone, calling the kernel with its flag, gave 0.988-0.992.
///
/// # Safety
/// The AVX-512 level is available; `w` points at `units * nb` x16 blocks, `a` at `nb` Q8_K
/// blocks, `out` at `16 * units` writable floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn gemv_units<const STREAM: bool>(
    nb: usize,
    w: *const u8,
    units: usize,
    a: *const u8,
    out: *mut f32,
) {
    let mut res = [[0f32; R]; 4];
    for u in 0..units {
        rows_m::<1, false, STREAM>(nb, w.add(u * 2 * nb * BLOCK_BYTES), a, 0, &mut res);
        std::ptr::copy_nonoverlapping(res[0].as_ptr(), out.add(R * u), R);
    }
}
