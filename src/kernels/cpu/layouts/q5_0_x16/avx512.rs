//! AVX-512 kernel over one x16 unit of packed Q5_0 (the layout and why: the parent module).
//!
//! Per unit block: each vector `V_l` is its plane's nibbles (shifted down for odd `l`) plus 16
//! under the byte mask of its fifth bits (`vptestmb`), and lane `l`'s accumulator starts from the
//! block's `-16 · Σ a` for that lane, so one `vpdpbusd` against the four activation bytes leaves
//! the AVX2 kernel's exact lane integer for all sixteen rows; then its float step, lane for lane.

use std::arch::x86_64::*;

use super::{BLOCK_BYTES, FIFTH, NIBBLES, R};
use crate::kernels::cpu::layouts::x16::lanes::{self, Prep};
use crate::kernels::cpu::layouts::x16::Block32RowsKernel;
use crate::kernels::cpu::simd::avx512::{bcast32x16, ld2x256};

/// Bytes of one Q8_0 activation block.
const A_BYTES: usize = 34;
/// How far ahead decode prefetches into L1, in bytes: sixteen unit blocks (5.6 KB). Gemma-3
/// 270M's decode step, alternated in one process against eight blocks (2.8 KB): 1.1-2.3% shorter
/// while the probe read 80-82 GB/s (three runs of 354-488 pairs), unchanged (0.998-1.004) while
/// it read 48-50 GB/s; 24 blocks: +1.6% and -0.5%. Those were `T0` hints, issued at a block's
/// start. Non-temporal ones spread over its lane pairs (2026-11-26): the step 1.1% shorter in
/// the low state (1198 pairs) and 0.1% in the high (1302); `T0` spread 0.5% shorter and 0.2%
/// longer.
const PREFETCH: usize = 16 * BLOCK_BYTES;
/// Cache lines of one unit block (5.5), prefetched one per lane pair (the first six).
const LINES: usize = BLOCK_BYTES.div_ceil(64);
const _: () = assert!(LINES <= 8 && R == 16);

/// The value vectors of lanes `2p` and `2p + 1` of the unit block at `x` (`fifth`: its fifth
/// bits): each plane nibble plus 16 where its fifth bit is set.
///
/// # Safety
/// The AVX-512 level is available; `x` points at one unit block, `p < 4`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn lane_values(x: *const u8, fifth: __m512i, p: usize) -> [__m512i; 2] {
    let m0f = _mm512_set1_epi8(0x0F);
    let plane = ld2x256(x.add(NIBBLES + 64 * p));
    let nib = [
        _mm512_and_si512(plane, m0f),
        _mm512_and_si512(_mm512_srli_epi16::<4>(plane), m0f),
    ];
    std::array::from_fn(|h| {
        let bit = _mm512_test_epi8_mask(fifth, _mm512_set1_epi8(1 << (2 * p + h)));
        _mm512_mask_add_epi8(nib[h], bit, nib[h], _mm512_set1_epi8(16))
    })
}

/// One prefetch of the stream, for lane `l` of the unit block at `x` (see [`PREFETCH`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn prefetch_lane(x: *const u8, l: usize) {
    if l < LINES {
        _mm_prefetch::<_MM_HINT_NTA>(x.wrapping_add(PREFETCH + 64 * l).cast());
        // Keeps the compiler from gathering the prefetches back into one burst.
        std::sync::atomic::compiler_fence(std::sync::atomic::Ordering::SeqCst);
    }
}

/// Sixteen outputs a unit (`o`) of `units` consecutive x16 units (`w`: `nb` unit blocks each)
/// against one activation row (`a`: `nb` Q8_0 blocks, `pr`: their [`Prep`]s).
///
/// # Safety
/// The AVX-512 level is available (AVX2, FMA, F16C, AVX-512 F/BW/VL/VNNI); `w` points at
/// `units * nb` unit blocks, `a` at `nb` Q8_0 blocks, `pr` at their `nb` preps, `o` at
/// `16 * units` writable floats.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_unit(
    nb: usize,
    w: *const u8,
    units: usize,
    a: *const u8,
    pr: *const Prep,
    o: *mut f32,
) {
    for u in 0..units {
        dot_one(nb, w.add(u * nb * BLOCK_BYTES), a, pr, o.add(R * u));
    }
}

/// [`dot_unit`] for one unit.
///
/// # Safety
/// As [`dot_unit`] with `units = 1`.
#[allow(clippy::needless_range_loop)] // lanes index several arrays at once
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_one(nb: usize, w: *const u8, a: *const u8, pr: *const Prep, o: *mut f32) {
    let mut f = [_mm512_setzero_ps(); 8];
    for b in 0..nb {
        let x = w.add(b * BLOCK_BYTES);
        let ya = a.add(b * A_BYTES);
        let bp = *pr.add(b);
        let fifth = ld2x256(x.add(FIFTH));
        let mut acc = [_mm512_setzero_si512(); 8];
        for p in 0..4 {
            let v = lane_values(x, fifth, p);
            for h in 0..2 {
                let l = 2 * p + h;
                prefetch_lane(x, l);
                let start = _mm512_set1_epi32(bp.starts[l]);
                acc[l] = _mm512_dpbusd_epi32(start, v[h], bcast32x16(ya.add(2 + 4 * l)));
            }
        }
        lanes::fold(&mut f, x, bp.da, &acc);
    }
    lanes::store(&f, o);
}

/// Q5_0's kernels for one to four rows (`lanes::rows_kernel`), four rows as two passes of two
/// ([`two_pairs`]).
pub(super) const ROWS: [Block32RowsKernel; 4] = {
    let r = lanes::rows_kernels::<Q5_0>();
    [r[0], r[1], r[2], two_pairs]
};

/// Four rows as two passes of two over the unit (the second from cache): four rows in one pass
/// keep 32 float accumulators, more than the registers hold. Gemma-3 270M's row-invariant
/// forwards, alternated in one process (2026-11-27, 100 pairs a run): four tokens 0.965-0.975 of
/// the time, eight 0.953 (0.964 low state, 0.929 high); three rows the same either way (1.003),
/// so they stay one pass.
///
/// # Safety
/// As [`lanes::rows_kernel`] with four rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn two_pairs(
    nb: usize,
    w: *const u8,
    a: *const u8,
    pr: *const Prep,
    out: &mut [[f32; R]; 4],
) {
    lanes::rows_kernel::<Q5_0, 2>(nb, w, a, pr, out);
    let mut hi = [[0f32; R]; 4];
    lanes::rows_kernel::<Q5_0, 2>(nb, w, a.add(2 * nb * A_BYTES), pr.add(2 * nb), &mut hi);
    out[2..].copy_from_slice(&hi[..2]);
}

/// Q5_0's unit block for the multi-row kernels: its values built once for all the rows,
/// prefetching as [`dot_unit`] does.
struct Q5_0;

impl lanes::FoldBlock for Q5_0 {
    const BLOCK_BYTES: usize = BLOCK_BYTES;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn fold_block<const M: usize>(
        x: *const u8,
        rows: &lanes::RowsAt<M>,
        f: &mut [[__m512; 8]; M],
    ) {
        let fifth = ld2x256(x.add(FIFTH));
        for p in 0..4 {
            let v = lane_values(x, fifth, p);
            for (h, &vh) in v.iter().enumerate() {
                prefetch_lane(x, 2 * p + h);
                rows.fold_lane(f, 2 * p + h, vh);
            }
        }
    }
}
