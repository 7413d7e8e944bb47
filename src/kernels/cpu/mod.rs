//! CPU kernels: persistent thread pool, quantized matmul, attention over the paged KV cache, and the
//! element-wise ops, gathered behind `CpuBackend`.

pub mod attention;
pub mod backend;
pub mod fused;
pub mod layouts;
pub mod matmul;
pub mod memory;
pub mod ops;
pub mod simd;
pub mod threads;

/// A value on a 64-byte boundary. A kernel that keeps a local in one makes the compiler align its
/// whole stack frame, so the 64-byte vectors it spills sit on whole lines; on a frame 16 or 48
/// bytes off a line those spills are split stores whose reloads cannot be forwarded, and the
/// kernel's speed depends on where the calling thread's stack happens to sit. Q4_K's one-row GEMV
/// (`q4_k_x8`) runs out of vector registers and keeps its activation sums in one: before, its rows
/// in L2 on one thread ran at 22-25 GB/s at two of the four 16-byte stack offsets and 43-44 at
/// the other two (Zen 4, 2026-11-26), and against that unaligned kernel, alternated in one
/// process, Qwen2.5-1.5B's decode step is 4.3-8.3% shorter while the probe reads 50-53 GB/s
/// (93-108 pairs, three processes), and 0.991-1.006 of it in the low state (four). Decode
/// attention spills its key rows around each `expf` call and keeps a byte in one for the same
/// reason (not measured apart: Gemma-3 at depth 2048 read 75-88% of the bandwidth either way).
#[repr(C, align(64))]
pub(crate) struct Aligned<T>(pub(crate) T);

/// A raw pointer into a buffer that the pool's threads write in disjoint parts (each its own
/// output rows or pieces); the pool joins every thread before the buffer is read or written again.
/// Users state at each write why their part is disjoint and in bounds.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub(crate) *mut T);
// SAFETY: see the type's contract above: writes through it are disjoint across threads and end
// before the pool call returns.
unsafe impl<T> Sync for SharedMut<T> {}
unsafe impl<T> Send for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    pub(crate) fn ptr(self) -> *mut T {
        self.0
    }
}

impl SharedMut<f32> {
    /// Writes a GEMM tile's results into the `(_, stride)` row-major output behind the pointer:
    /// the first `width` values of `res[j]` to row `t0 + j`, columns `col..col + width`.
    ///
    /// # Safety
    /// Those elements lie inside the output, and no other thread reads or writes them until the
    /// pool call that hands out this tile returns; `width <= W`.
    pub(crate) unsafe fn store_tile<const W: usize>(
        self,
        stride: usize,
        t0: usize,
        col: usize,
        res: &[[f32; W]],
        width: usize,
    ) {
        for (j, r) in res.iter().enumerate() {
            std::ptr::copy_nonoverlapping(r.as_ptr(), self.0.add((t0 + j) * stride + col), width);
        }
    }
}

/// Requests every cache line of `data` into L1 at once (`prefetcht0`, one per 64 bytes from its
/// start): a hint, which never faults and changes no result.
pub(crate) fn prefetch_l1<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for at in (0..std::mem::size_of_val(data)).step_by(64) {
        // SAFETY: `at` lies inside `data`, and a prefetch has no architectural effect.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().cast::<i8>().add(at));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = data;
}

/// The states of a 32-bit LCG after `seed`, the source of the kernel tests' data.
#[cfg(test)]
pub(crate) fn test_lcg(seed: u32) -> impl Iterator<Item = u32> {
    std::iter::successors(Some(seed), |s| {
        Some(s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223))
    })
    .skip(1)
}

/// Deterministic test floats in [-2, 2) (an LCG), for the kernel tests.
#[cfg(test)]
pub(crate) fn test_floats(n: usize, seed: u32) -> Vec<f32> {
    test_lcg(seed)
        .take(n)
        .map(|s| ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 4.0)
        .collect()
}
