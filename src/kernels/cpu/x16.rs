//! What the x16 decode layouts (`q6k_x16`, `q5_0_x16`) share: a matrix cut into units of
//! sixteen rows, each unit's blocks stored one after another, packed unit by unit across the
//! pool, and multiplied by a kernel that produces a unit's sixteen outputs at a time.
//!
//! Invariant: a unit is `R` whole file rows, so its packed bytes are exactly as many as its file
//! bytes, and unit `u` sits at `u * unit_bytes` in both.

use crate::kernels::cpu::pool::ThreadPool;
use crate::kernels::cpu::SharedMut;

/// Weight rows per unit.
pub const R: usize = 16;

/// Packs `src` (whole units of `unit_bytes` file bytes) into `out` (the same size): `pack_unit`
/// gets one unit's file bytes and its zeroed output, units split across the pool.
pub fn pack_units(
    pool: &ThreadPool,
    src: &[u8],
    unit_bytes: usize,
    out: &mut [u8],
    pack_unit: impl Fn(&[u8], &mut [u8]) + Sync,
) {
    assert!(src.len().is_multiple_of(unit_bytes), "whole units");
    assert_eq!(out.len(), src.len(), "packed bytes");
    let dst = SharedMut(out.as_mut_ptr());
    pool.for_range(src.len() / unit_bytes, 16, |range| {
        for u in range {
            // SAFETY: unit u's bytes `u * unit_bytes .. (u + 1) * unit_bytes` lie inside `out`
            // (u < its units) and belong to this chunk only, so no two threads alias them.
            let o = unsafe {
                std::slice::from_raw_parts_mut(dst.ptr().add(u * unit_bytes), unit_bytes)
            };
            o.fill(0);
            pack_unit(&src[u * unit_bytes..(u + 1) * unit_bytes], o);
        }
    });
}

/// A unit kernel: `(blocks per row, the unit, the activation row, 16 outputs)`. A call needs the
/// AVX-512 level and the unit's blocks, the activation row's blocks and the 16 outputs where the
/// pointers say.
#[cfg(target_arch = "x86_64")]
pub type UnitKernel = unsafe fn(usize, *const u8, *const u8, *mut f32);

/// One activation row (`xq`, at least `a_bytes` long) against the whole units in `w` (`nb`
/// blocks a row, `unit_bytes` a unit) through `kernel`: `out[i]` = packed row `i`. Panics below
/// the AVX-512 level, which the x16 layouts are only packed at.
#[cfg(target_arch = "x86_64")]
pub fn gemv_units(
    nb: usize,
    unit_bytes: usize,
    w: &[u8],
    xq: &[u8],
    a_bytes: usize,
    out: &mut [f32],
    kernel: UnitKernel,
) {
    use crate::kernels::cpu::simd::{current, Level};
    assert!(w.len().is_multiple_of(unit_bytes), "whole units");
    assert_eq!(out.len(), w.len() / unit_bytes * R, "one output per row");
    assert!(xq.len() >= a_bytes, "activation bytes");
    assert!(
        current() >= Level::Avx512,
        "the x16 layouts are only packed at the AVX-512 level"
    );
    for (u, o) in out.chunks_exact_mut(R).enumerate() {
        // SAFETY: the AVX-512 level is available (asserted); unit u lies inside `w`, the
        // activation row inside `xq` (asserted length), and `o` has 16 slots.
        unsafe {
            kernel(
                nb,
                w.as_ptr().add(u * unit_bytes),
                xq.as_ptr(),
                o.as_mut_ptr(),
            )
        };
    }
}

/// Deterministic test bytes (an LCG), for the layouts' tests.
#[cfg(test)]
pub(crate) fn test_bytes(n: usize, seed: u32) -> Vec<u8> {
    crate::kernels::cpu::test_lcg(seed)
        .take(n)
        .map(|s| (s >> 24) as u8)
        .collect()
}

/// The bit patterns of `v`, for bit-for-bit comparisons.
#[cfg(test)]
pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}
