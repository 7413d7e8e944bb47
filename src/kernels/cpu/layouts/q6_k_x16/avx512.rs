//! AVX-512 kernel over one x16 unit of packed Q6_K (the layout and why: the parent module).
//!
//! Per unit block and 32-value group `g`: the rows' scale pairs `(s[2g], s[2g + 1])` widened to
//! words, duplicated into `(s[2g + h], s[2g + h])` dwords for the two 16-value halves; per half,
//! three loads give four vectors of values (`V_j`), each meeting its four activation bytes through
//! `vpmaddubsw` (pair sums, below 2^15: values < 64, activations ≥ -128) and `vpdpwssd` by the
//! scales into lane `4h + j`'s accumulator; then `-32 · (bsum[2g] · s[2g] + bsum[2g + 1] · s[2g + 1])`
//! into lane `g`'s (after the groups). Those are the exact integers of the AVX2 kernel's eight lanes; the block's
//! `fma`s and the final sum are its float steps, lane for lane.

use std::arch::x86_64::*;

use super::{BLOCK_BYTES, QUANTS, R, SCALES};
use crate::kernels::cpu::layouts::x16::lanes;
use crate::kernels::cpu::simd::avx2::rd_f32;
use crate::kernels::cpu::simd::avx512::{bcast32x16, ld2x256};

/// Bytes of one Q8_K activation block, and where its values and its 16-value sums start.
const A_BYTES: usize = 292;
const A_QS: usize = 4;
const A_BSUMS: usize = 260;
/// How far ahead decode prefetches, in bytes: two unit blocks. Streaming a 191 MB matrix on two
/// threads, distances alternated in one process (medians of 113-400 rounds): while the probe read
/// 74 GB/s, 6720-10080 bytes ahead read 74-75 GB/s, 3360 66.5, 5040 70, 13440 71, no prefetch 64;
/// while it read 48 GB/s, 3360-8400 bytes all read 47-48 GB/s. (Those with `T0`, seven at a time;
/// with the spread non-temporal ones below, Qwen2.5-1.5B's decode step was the same at 5040 and
/// 8400 bytes ahead as at 6720: paired ratios 0.994-1.003.)
/// (Measured on AMD family 26. On Zen 4, where [`crate::kernels::cpu::layouts::prefetch::on`] is false,
/// the kernel leaves the stream to the hardware prefetcher.)
const PREFETCH: usize = 2 * BLOCK_BYTES;
/// How far ahead [`rows_m`] prefetches into L2: six unit blocks (measured there).
const ROWS_AHEAD: usize = 6 * BLOCK_BYTES;
/// Cache lines of one unit block (53), prefetched seven per group `g` (the last three into the
/// next block), one per step of its first seven.
const LINES: usize = BLOCK_BYTES.div_ceil(64);
const _: () = assert!(LINES <= 8 * 7 && R == 16);

/// The four vectors `V_0..V_3` (values 0..64, byte `4r + e`) of the 192-byte chunk at `c`, as
/// [`super::unpack_chunk`] spells them out.
///
/// # Safety
/// The AVX-512 level is available; `c` points at one chunk.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn values(c: *const u8) -> [__m512i; 4] {
    let lo = |v: __m512i| _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
    let top = |v: __m512i| _mm512_and_si512(v, _mm512_set1_epi8(0x30));
    let (zl1, zl2, zh) = (ld2x256(c), ld2x256(c.add(64)), ld2x256(c.add(128)));
    [
        _mm512_or_si512(lo(zl1), top(zh)),
        _mm512_or_si512(
            lo(_mm512_srli_epi16::<4>(zl1)),
            top(_mm512_slli_epi16::<2>(zh)),
        ),
        _mm512_or_si512(lo(zl2), top(_mm512_slli_epi16::<4>(zh))),
        _mm512_or_si512(
            lo(_mm512_srli_epi16::<4>(zl2)),
            top(_mm512_srli_epi16::<2>(zh)),
        ),
    ]
}

/// `vpshufb` controls (per 128-bit lane) copying each dword's low word (`[0]`), or its high word
/// (`[1]`), to both of its words: a scale pair `(s[2g], s[2g + 1])` to `(s[2g + h], s[2g + h])`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn scale_dups() -> [__m512i; 2] {
    std::array::from_fn(|h| {
        let h = h as i32;
        let d = |k: i32| (4 * k + 2 * h) | ((4 * k + 2 * h + 1) << 8);
        let v = |k: i32| d(k) | (d(k) << 16);
        _mm512_set4_epi32(v(3), v(2), v(1), v(0))
    })
}

/// Sixteen outputs a unit (`out`) of `units` consecutive x16 units (`w`: `nb` unit blocks each)
/// against one activation row (`a`: `nb` Q8_K blocks).
///
/// # Safety
/// The AVX-512 level is available (AVX2, FMA, F16C, AVX-512 F/BW/VL/VNNI); `w` points at
/// `units * nb` unit blocks, `a` at `nb` Q8_K blocks, `out` at `16 * units` writable
/// floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_unit<const STREAM: bool>(
    nb: usize,
    w: *const u8,
    units: usize,
    a: *const u8,
    out: *mut f32,
) {
    for u in 0..units {
        dot_one::<STREAM>(nb, w.add(u * nb * BLOCK_BYTES), a, out.add(R * u));
    }
}

/// [`dot_unit`] for one unit.
///
/// # Safety
/// As [`dot_unit`] with `units = 1`.
#[allow(clippy::needless_range_loop)] // lanes index several arrays at once
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_one<const STREAM: bool>(nb: usize, w: *const u8, a: *const u8, out: *mut f32) {
    let [dup_lo, dup_hi] = scale_dups();
    let neg32 = _mm512_set1_epi16(-32);
    let mut f = [_mm512_setzero_ps(); 8];
    // A constant of the kernel, not a flag tested inside its loops (see `q4_k_x8`'s
    // `gemv_units`): Qwen2.5-1.5B's decode step 0.995 of the time in the high-bandwidth state
    // (Zen 4, 115 pairs alternated in one process), 0.995-1.005 in the low.
    let stream = STREAM;
    for b in 0..nb {
        let x = w.add(b * BLOCK_BYTES);
        let ya = a.add(b * A_BYTES);
        let mut acc = [_mm512_setzero_si512(); 8];
        for g in 0..8 {
            let sp = _mm512_cvtepi8_epi16(_mm256_loadu_si256(x.add(SCALES + 32 * g).cast()));
            let s = [
                _mm512_shuffle_epi8(sp, dup_lo),
                _mm512_shuffle_epi8(sp, dup_hi),
            ];
            for h in 0..2 {
                let c = x.add(QUANTS + 192 * (2 * g + h));
                let v = values(c);
                for j in 0..4 {
                    let l = 4 * h + j;
                    if stream && l < 7 {
                        // One non-temporal prefetch per step, not seven `T0` ones at the
                        // group's start. The kernel alone, on two threads over a 191 MB
                        // matrix, alternated with the bandwidth probe (medians of 60-80 rounds,
                        // 2026-11-26): 0.92-0.93 of the probe that way, 0.99-1.0 this way, in
                        // both states (probe 47 and 74 GB/s); spread with `T0` 0.94-0.96 in
                        // the low state, `prefetchnta` seven at a time 0.92. Qwen2.5-1.5B's
                        // decode step 1.7-2.6% shorter in the low state and 1.3% in the high
                        // (paired, 199-600 pairs a run); Gemma-3 270M's the same.
                        _mm_prefetch::<_MM_HINT_NTA>(
                            x.wrapping_add(PREFETCH + 64 * (7 * g + l)).cast(),
                        );
                        // Keeps the compiler from gathering the prefetches into one burst.
                        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
                    }
                    let y = bcast32x16(ya.add(A_QS + 32 * g + 4 * l));
                    let p = _mm512_maddubs_epi16(v[j], y);
                    acc[l] = _mm512_dpwssd_epi32(acc[l], p, s[h]);
                }
            }
        }
        // The offset, lane by lane (a loop of its own: indexing the lanes by `g` above would
        // keep them in memory).
        for l in 0..8 {
            let sp = _mm512_cvtepi8_epi16(_mm256_loadu_si256(x.add(SCALES + 32 * l).cast()));
            let bs = bcast32x16(ya.add(A_BSUMS + 4 * l));
            acc[l] = _mm512_dpwssd_epi32(acc[l], bs, _mm512_mullo_epi16(sp, neg32));
        }
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(x.cast()));
        let d = _mm512_mul_ps(_mm512_set1_ps(rd_f32(ya)), dw);
        for l in 0..8 {
            f[l] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acc[l]), f[l]);
        }
    }
    lanes::store(&f, out);
}

/// The multi-row kernels for one to four rows, `ROWS[m - 1]` (see [`rows_m`]).
pub(super) const ROWS: [RowsKernel; 4] = [rows_m::<1>, rows_m::<2>, rows_m::<3>, rows_m::<4>];

/// A multi-row kernel: `(nb, unit, first activation row, activation row stride, outputs)`.
pub(super) type RowsKernel = unsafe fn(usize, *const u8, *const u8, usize, &mut [[f32; R]; 4]);

/// Sixteen outputs of one x16 unit (`w`: `nb` unit blocks) against each of `M` (1..=4)
/// activation rows `a + r * stride` (`out[r]`), every one bit-identical to [`dot_unit`]'s for that
/// row alone: the row-invariant verify and the small batches below the GEMM's eight rows read the
/// unit once for all their rows.
///
/// Streaming: the kernel does about 130-180 cycles of multiplies a unit block per extra row
/// (cache-resident, one core: 288 cycles a unit block for one row, 449, 579 and 762 for two,
/// three and four), and from two rows on the hardware prefetcher alone falls behind. Qwen2.5-1.5B's
/// row-invariant forwards of k tokens, alternated in one process (2026-11-27, paired ratios of
/// forward times, 40-60 pairs a run): every line [`ROWS_AHEAD`] bytes ahead into L2 against
/// `prefetchnta` two unit blocks ahead, three rows 0.904, four 0.915 (0.912 low state, 0.918
/// high), eight 0.945; 6.7, 13.4 and 27 KB ahead 0.940, 0.928-0.929 and 0.952 at four. Two rows
/// against none 0.921 and 0.896 (0.860 in 15 high-state pairs). (Before, the kernel alone on two
/// threads: `prefetchnta` two blocks ahead 16.8-20.5 GB/s for three rows and 15.8-19.1 for four,
/// none 15.1-18.8 and 13.1-15.7, probe 26-28.)
///
/// The integer lanes are [`dot_unit`]'s, summed in another order (one half `h` of every group at a
/// time, so that `4 M` accumulators are live, not `8 M`): wrapping integer sums do not depend on
/// the order, and the float steps per block and lane and the final sum are the same.
///
/// # Safety
/// As [`dot_unit`], with `a + r * stride` at `nb` Q8_K blocks for each `r < M`.
#[allow(clippy::needless_range_loop)] // rows and lanes index several arrays at once
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_m<const M: usize>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: &mut [[f32; R]; 4],
) {
    let dups = scale_dups();
    let neg32 = _mm512_set1_epi16(-32);
    let mut f = [[_mm512_setzero_ps(); 8]; M];
    for b in 0..nb {
        let x = w.add(b * BLOCK_BYTES);
        let ya: [*const u8; M] = std::array::from_fn(|r| a.add(r * stride + b * A_BYTES));
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(x.cast()));
        for h in 0..2 {
            let mut acc = [[_mm512_setzero_si512(); 4]; M];
            for g in 0..8 {
                let sp = _mm512_cvtepi8_epi16(_mm256_loadu_si256(x.add(SCALES + 32 * g).cast()));
                let s = _mm512_shuffle_epi8(sp, dups[h]);
                let c = x.add(QUANTS + 192 * (2 * g + h));
                if M >= 2 {
                    // More than one row is slow enough for the hardware prefetcher alone to fall
                    // behind, even on Zen 4: every line [`ROWS_AHEAD`] bytes ahead into L2, four
                    // a chunk (measured: this function's doc).
                    let k = 8 * h + g;
                    for i in 0..4 {
                        let l = 4 * k + i;
                        if l < LINES {
                            _mm_prefetch::<_MM_HINT_T1>(x.wrapping_add(ROWS_AHEAD + 64 * l).cast());
                        }
                    }
                }
                let v = values(c);
                for r in 0..M {
                    for j in 0..4 {
                        let y = bcast32x16(ya[r].add(A_QS + 32 * g + 4 * (4 * h + j)));
                        let p = _mm512_maddubs_epi16(v[j], y);
                        acc[r][j] = _mm512_dpwssd_epi32(acc[r][j], p, s);
                    }
                }
            }
            // The offset of lane l = 4h + j is group l's (as in `dot_unit`).
            for j in 0..4 {
                let l = 4 * h + j;
                let sp = _mm512_cvtepi8_epi16(_mm256_loadu_si256(x.add(SCALES + 32 * l).cast()));
                let ns = _mm512_mullo_epi16(sp, neg32);
                for r in 0..M {
                    let bs = bcast32x16(ya[r].add(A_BSUMS + 4 * l));
                    acc[r][j] = _mm512_dpwssd_epi32(acc[r][j], bs, ns);
                }
            }
            for r in 0..M {
                let d = _mm512_mul_ps(_mm512_set1_ps(rd_f32(ya[r])), dw);
                for j in 0..4 {
                    let l = 4 * h + j;
                    f[r][l] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acc[r][j]), f[r][l]);
                }
            }
        }
    }
    for (f, o) in f.iter().zip(out.iter_mut()) {
        lanes::store(f, o.as_mut_ptr());
    }
}
