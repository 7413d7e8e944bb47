//! AVX-512 kernel over one x16 unit of packed Q8_0 (the layout and why: the parent module).
//!
//! Per unit block: lane `l`'s accumulator starts from the block's `-128 · Σ a` for that lane, so
//! one `vpdpbusd` of the offset values `V_l` against the four activation bytes leaves the AVX2
//! kernel's exact lane integer for all sixteen rows; then its float step, lane for lane.

use std::arch::x86_64::*;

use super::{BLOCK_BYTES, R, VALUES, W_BYTES};
use crate::kernels::cpu::simd::avx512::{bcast32x16, ld2x256};
use crate::kernels::cpu::x16::lanes;

/// How far ahead decode prefetches into L1, in bytes: eight unit blocks (4.3 KB). Alternated in
/// one process on Gemma-3 270M's head: twelve blocks made the step 1.4% shorter while the probe
/// read 78 GB/s but 1.6% longer while it read 50; sixteen +2.2% and -2.5%; an L2 prefetch
/// twenty blocks ahead besides, 4% longer in both.
const PREFETCH: usize = 8 * BLOCK_BYTES;
/// Cache lines of one unit block (8.5).
const LINES: usize = BLOCK_BYTES.div_ceil(64);
const _: () = assert!(LINES <= 9 && R == 16);

/// Sixteen outputs (`out`) of one x16 unit (`w`: `nb` unit blocks) against one activation row
/// (`a`: `nb` Q8_0 blocks).
///
/// # Safety
/// The AVX-512 level is available (AVX2, FMA, F16C, AVX-512 F/BW/VL/VNNI); `w` points at `nb`
/// unit blocks, `a` at `nb` Q8_0 blocks, `out` at 16 writable floats.
#[allow(clippy::needless_range_loop)] // lanes index several arrays at once
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn dot_unit(nb: usize, w: *const u8, a: *const u8, out: *mut f32) {
    let mut f = [_mm512_setzero_ps(); 8];
    for b in 0..nb {
        let x = w.add(b * BLOCK_BYTES);
        let ya = a.add(b * W_BYTES);
        for k in 0..LINES {
            _mm_prefetch::<_MM_HINT_T0>(x.wrapping_add(PREFETCH + 64 * k).cast());
        }
        let starts = lanes::starts(ya, -128);
        let mut acc = [_mm512_setzero_si512(); 8];
        for l in 0..8 {
            let v = ld2x256(x.add(VALUES + 64 * l));
            let start = _mm512_set1_epi32(starts[l]);
            acc[l] = _mm512_dpbusd_epi32(start, v, bcast32x16(ya.add(2 + 4 * l)));
        }
        lanes::fold(&mut f, x, ya, &acc);
    }
    lanes::store(&f, out);
}
