//! AVX-512 kernel over one x16 unit of packed Q8_0 (the layout and why: the parent module).
//!
//! Per unit block: lane `l`'s accumulator starts from the block's `-128 · Σ a` for that lane, so
//! one `vpdpbusd` of the offset values `V_l` against the four activation bytes leaves the AVX2
//! kernel's exact lane integer for all sixteen rows; then its float step, lane for lane.

use std::arch::x86_64::*;

use super::{BLOCK_BYTES, R, VALUES, W_BYTES};
use crate::kernels::cpu::layouts::x16::lanes::{self, Prep};
use crate::kernels::cpu::layouts::x16::Block32RowsKernel;
use crate::kernels::cpu::simd::avx512::{bcast32x16, ld2x256};

/// How far ahead decode prefetches, in bytes: eight unit blocks (4.3 KB), with the non-temporal
/// hint (`prefetchnta`). Gemma-3 270M's 178 MB head alone, alternated in one process: with `T0`
/// hints twelve blocks ahead read 95% of the bandwidth probe while it read 48-50 GB/s and 93-95%
/// while it read 82, against 97% and 89-90% at eight, and sixteen 93% and 97%; an L2 prefetch
/// twenty blocks ahead besides made the step 4% longer in both states. `prefetchnta` at eight
/// blocks instead of `T0`: the head 101-105% against 98.5-99% in the low state; the decode step,
/// alternated step by step, 0.1-1.3% shorter while the probe read 75-79 GB/s (four runs of
/// 510-798 pairs) and not longer while it read 47-50 (0.1%, and 3% in a run of 28 pairs).
/// (Q5_0's kernel with `prefetchnta`: 1-2% shorter in the low state, 2-2.5% longer in the high.)
/// Spread over the block's eight lanes rather than issued at its start (2026-11-26): the head
/// alone read 0.869 of the probe against 0.857 in the high state (59 rounds), 0.977 and 0.975 in
/// the low; Gemma-3's decode step 1.8% shorter in the high state (437 pairs) and 0.3% longer in
/// the low (2063); with Q5_0's spread as well, 0.1% and 0.6% shorter (1794 and 1206).
/// (Measured on AMD family 26. On Zen 4, where [`crate::kernels::cpu::layouts::prefetch::on`] is false,
/// the kernel leaves the stream to the hardware prefetcher.)
const PREFETCH: usize = 8 * BLOCK_BYTES;
/// How far ahead the multi-row kernels prefetch into L2: 32 unit blocks (17 KB; measured at
/// `Q8_0::fold_block`).
const ROWS_AHEAD: usize = 32 * BLOCK_BYTES;
/// Cache lines of one unit block (8.5): one prefetched per lane, the last with the first lane's.
const LINES: usize = BLOCK_BYTES.div_ceil(64);
const _: () = assert!(LINES == 9 && R == 16);

/// Sixteen outputs a unit (`o`) of `units` consecutive x16 units (`w`: `nb` unit blocks each)
/// against one activation row (`a`: `nb` Q8_0 blocks, `pr`: their [`Prep`]s).
///
/// # Safety
/// The AVX-512 level is available (AVX2, FMA, F16C, AVX-512 F/BW/VL/VNNI); `w` points at
/// `units * nb` unit blocks, `a` at `nb` Q8_0 blocks, `pr` at their `nb` preps, `o` at
/// `16 * units` writable floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_unit<const STREAM: bool>(
    nb: usize,
    w: *const u8,
    units: usize,
    a: *const u8,
    pr: *const Prep,
    o: *mut f32,
) {
    for u in 0..units {
        dot_one::<STREAM>(nb, w.add(u * nb * BLOCK_BYTES), a, pr, o.add(R * u));
    }
}

/// [`dot_unit`] for one unit.
///
/// # Safety
/// As [`dot_unit`] with `units = 1`.
#[allow(clippy::needless_range_loop)] // lanes index several arrays at once
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_one<const STREAM: bool>(
    nb: usize,
    w: *const u8,
    a: *const u8,
    pr: *const Prep,
    o: *mut f32,
) {
    let mut f = [_mm512_setzero_ps(); 8];
    // A constant of the kernel, not a flag tested inside its loops (see `q4_k_x8`'s
    // `gemv_units`): Gemma-3 270M's decode step 0.987 of the time in the high-bandwidth state
    // (Zen 4, 570 pairs alternated in one process), 0.997-1.002 in the low (1830).
    let stream = STREAM;
    for b in 0..nb {
        let x = w.add(b * BLOCK_BYTES);
        let ya = a.add(b * W_BYTES);
        let bp = *pr.add(b);
        let mut acc = [_mm512_setzero_si512(); 8];
        for l in 0..8 {
            if stream {
                _mm_prefetch::<_MM_HINT_NTA>(x.wrapping_add(PREFETCH + 64 * l).cast());
                if l == 0 {
                    _mm_prefetch::<_MM_HINT_NTA>(
                        x.wrapping_add(PREFETCH + 64 * (LINES - 1)).cast(),
                    );
                }
                // Keeps the compiler from gathering the prefetches back into one burst.
                std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
            }
            let v = ld2x256(x.add(VALUES + 64 * l));
            let start = _mm512_set1_epi32(bp.starts[l]);
            acc[l] = _mm512_dpbusd_epi32(start, v, bcast32x16(ya.add(2 + 4 * l)));
        }
        lanes::fold(&mut f, x, bp.da, &acc);
    }
    lanes::store(&f, o);
}

/// Q8_0's kernels for one to four rows (`lanes::rows_kernel`).
pub(super) const ROWS: [Block32RowsKernel; 4] = lanes::rows_kernels::<Q8_0>();

/// Q8_0's unit block for the multi-row kernels.
struct Q8_0;

impl lanes::FoldBlock for Q8_0 {
    const BLOCK_BYTES: usize = BLOCK_BYTES;

    /// Three and four rows prefetch every line into L2, [`ROWS_AHEAD`] bytes ahead, on every
    /// CPU: the hardware prefetcher alone falls behind there. A 262144 × 640 matrix on two
    /// threads (2026-11-27, low state, two runs of 5 reads): four rows 11.6 and 12.4 GB/s with
    /// none, 15.6-17.1 with `prefetchnta` eight blocks ahead; then Gemma-3 270M's row-invariant
    /// forwards, alternated in one process (paired ratios of forward times, 80-100 pairs), `T1`
    /// 32 blocks ahead against that: three rows 0.957, four 0.911 (0.909 low state, 0.915 high;
    /// 16 blocks ahead 0.920), eight 0.962. One and two rows read as fast with none (two rows
    /// `T1` 16 or 32 blocks ahead 1.021 and 0.999).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn fold_block<const M: usize>(
        x: *const u8,
        rows: &lanes::RowsAt<M>,
        f: &mut [[__m512; 8]; M],
    ) {
        for l in 0..8 {
            if M >= 3 {
                // One line a lane, the last with the first lane's (measured: this function's doc).
                let ahead = x.wrapping_add(ROWS_AHEAD);
                _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * l).cast());
                if l == 0 {
                    _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(64 * (LINES - 1)).cast());
                }
                // Keeps the compiler from gathering the prefetches back into one burst.
                std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
            }
            rows.fold_lane(f, l, ld2x256(x.add(VALUES + 64 * l)));
        }
    }
}
