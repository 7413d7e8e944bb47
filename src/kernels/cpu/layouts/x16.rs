//! What the x16 decode layouts (`q6_k_x16`, `q5_0_x16`, `q8_0_x16`) share: a matrix cut into
//! units of sixteen rows, each unit's blocks stored one after another, packed unit by unit across
//! the pool, and multiplied by a kernel that produces a unit's sixteen outputs at a time; and, for
//! the two layouts of 32-value blocks against Q8_0 activations, the packing and multiplying
//! wrappers, the kernels' per-lane float steps ([`lanes`]) and their test against the row kernel.
//!
//! Invariant: a unit is `R` whole file rows, so its packed bytes are exactly as many as its file
//! bytes, and unit `u` sits at `u * unit_bytes` in both.

use crate::kernels::cpu::threads::pool::ThreadPool;
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

/// A unit kernel: `(blocks per row, the first unit, units, the activation row, 16 outputs a
/// unit)`, the units consecutive. One call covers a thread's whole share of a matrix instead of
/// one call a unit: on Zen 4, alternated step by step in one process (2026-11-27), Gemma-3 270M's
/// decode step 0.993-0.997 of the time in the high-bandwidth state (707-760 pairs) and
/// 1.001-1.006 in the low (19-69), Qwen2.5-1.5B's 0.991 (147) and 1.002-1.005 (145-300). A call
/// needs the AVX-512 level and the units' blocks, the activation row's blocks and the outputs
/// where the pointers say.
#[cfg(target_arch = "x86_64")]
pub type UnitKernel = unsafe fn(usize, *const u8, usize, *const u8, *mut f32);

/// Panics unless `w_len` bytes are whole units of `unit_bytes`, `out_len` is one output per
/// row of them, the activation row is long enough (`xq_ok`), and the AVX-512 level (which the
/// x16 layouts are only packed at) is available: what the x16 kernels' calls rely on.
#[cfg(target_arch = "x86_64")]
fn check_gemv(w_len: usize, unit_bytes: usize, out_len: usize, xq_ok: bool) {
    use crate::kernels::cpu::simd::{current, Level};
    assert!(w_len.is_multiple_of(unit_bytes), "whole units");
    assert_eq!(out_len, w_len / unit_bytes * R, "one output per row");
    assert!(xq_ok, "activation bytes");
    assert!(
        current() >= Level::Avx512,
        "the x16 layouts are only packed at the AVX-512 level"
    );
}

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
    check_gemv(w.len(), unit_bytes, out.len(), xq.len() >= a_bytes);
    let units = w.len() / unit_bytes;
    // SAFETY: the AVX-512 level is available (checked); `w` is `units` whole units, the
    // activation row lies inside `xq` (checked length), and `out` has 16 slots a unit (checked).
    unsafe { kernel(nb, w.as_ptr(), units, xq.as_ptr(), out.as_mut_ptr()) }
}

/// Bytes of one Q8_0 activation block (the activations of the 32-value layouts).
pub const Q8_0_BYTES: usize = 34;

/// Packs a matrix of 32-value blocks of `w_bytes` bytes (Q5_0, Q8_0; `src`: `rows` file rows of
/// `cols / 32` blocks) into `out` (the same size), units split across the pool: `pack_block(s,
/// nb, b, o)` packs block `b` of the sixteen rows in `s` (rows of `nb` blocks) into the zeroed
/// unit block `o`. Panics unless `rows % 16 == 0`, `cols % 32 == 0` and the sizes match.
pub fn pack_blocks32(
    pool: &ThreadPool,
    (src, rows, cols, w_bytes): (&[u8], usize, usize, usize),
    out: &mut [u8],
    pack_block: impl Fn(&[u8], usize, usize, &mut [u8]) + Sync,
) {
    assert!(
        rows.is_multiple_of(R) && cols.is_multiple_of(32),
        "{rows}x{cols} is not x16-packable"
    );
    let nb = cols / 32;
    assert_eq!(src.len(), rows * nb * w_bytes, "matrix bytes");
    let block = R * w_bytes;
    pack_units(pool, src, nb * block, out, |s, o| {
        for (b, ob) in o.chunks_exact_mut(block).enumerate() {
            pack_block(s, nb, b, ob);
        }
    });
}

/// A 32-value layout's unit kernel: `(blocks per row, the first unit, units, the activation row,
/// its blocks' [`lanes::Prep`], 16 outputs a unit)`, the units consecutive (as [`UnitKernel`]). A
/// call needs the AVX-512 level and the units' blocks, the activation row's blocks, their preps
/// and the outputs where the pointers say.
#[cfg(target_arch = "x86_64")]
pub type Block32Kernel =
    unsafe fn(usize, *const u8, usize, *const u8, *const lanes::Prep, *mut f32);

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// [`gemv_blocks32`]'s activation preps (grown to the widest row seen, never shrunk).
    static PREPS: std::cell::RefCell<Vec<lanes::Prep>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One Q8_0 activation row (`xq`: `cols / 32` blocks) against the x16 units in `w` of a layout of
/// 32-value blocks of `w_bytes` file bytes, through `kernel`, whose weights enter `vpdpbusd`
/// offset by `off`: `out[i]` = packed row `i`. What depends on the activation block alone (its
/// scale as f32, each lane's start) is worked out once per call here, not in every unit: on one
/// core in cache, Q5_0's kernel read Gemma-3 270M's 1024×640 query matrix at 68.6 GB/s with it
/// in every unit and 90.1 so, Q8_0's its value matrix at 123.8 and 126.4. Gemma-3's decode step,
/// alternated step by step in one process, 1.07% shorter in the low-bandwidth state and 3.8% in
/// the high (1111 and 889 pairs), where its Q5_0 matrices had streamed at 67-77% of the probe;
/// Qwen2.5-1.5B's (no such matrices) unchanged (0.9999 and 1.0016). The same bits: the same
/// integers and float steps, only computed once.
#[cfg(target_arch = "x86_64")]
pub fn gemv_blocks32(
    cols: usize,
    w_bytes: usize,
    w: &[u8],
    xq: &[u8],
    out: &mut [f32],
    (kernel, off): (Block32Kernel, i8),
) {
    assert!(cols.is_multiple_of(32), "whole blocks");
    let nb = cols / 32;
    let unit_bytes = nb * R * w_bytes;
    check_gemv(w.len(), unit_bytes, out.len(), xq.len() >= nb * Q8_0_BYTES);
    PREPS.with_borrow_mut(|preps| {
        preps.resize(nb, lanes::Prep::default());
        for (b, p) in preps.iter_mut().enumerate() {
            // SAFETY: the AVX-512 level is available (checked); block b lies inside `xq`.
            *p = unsafe { lanes::prep(xq.as_ptr().add(b * Q8_0_BYTES), off) };
        }
        let units = w.len() / unit_bytes;
        // SAFETY: the AVX-512 level is available (checked); `w` is `units` whole units, the
        // activation row lies inside `xq` (checked length), its nb preps in `preps`, and `out`
        // has 16 slots a unit (checked).
        unsafe {
            let (wp, ap, op) = (w.as_ptr(), xq.as_ptr(), out.as_mut_ptr());
            kernel(nb, wp, units, ap, preps.as_ptr(), op)
        }
    });
}

/// A 32-value layout's kernel over `m` activation rows (`ROWS[m - 1]`, `m` in 1..=4): `(blocks per
/// row, the unit, the first activation row (the others follow, `nb` blocks apart), its
/// [`lanes::Prep`]s (the others' follow, `nb` apart), the m rows' 16 outputs)`. Each row's outputs
/// are the one-row kernel's bits. A call needs the AVX-512 level and all of those where the
/// pointers say.
#[cfg(target_arch = "x86_64")]
pub type Block32RowsKernel =
    unsafe fn(usize, *const u8, *const u8, *const lanes::Prep, &mut [[f32; R]; 4]);

/// A 32-value layout's `matmul`: `(pool, cols, packed matrix, n activation rows, n, n × rows
/// outputs)`.
pub type Blocks32Matmul = fn(&ThreadPool, usize, &[u8], &[u8], usize, &mut [f32]);

/// `n` Q8_0 activation rows (`xq`: rows of `cols / 32` blocks) against a whole x16-packed matrix
/// `w` of a layout of 32-value blocks of `w_bytes` file bytes, through `kernel` (weights offset by
/// `off` in `vpdpbusd`, as [`gemv_blocks32`]): `out[t * rows + i]` = activation row `t` · packed
/// row `i`, each as [`gemv_blocks32`] computes it for that row alone. Units are split across the
/// pool; each is read once per four activation rows (the first time from memory).
#[cfg(target_arch = "x86_64")]
pub fn matmul_blocks32(
    pool: &ThreadPool,
    (cols, w_bytes, n): (usize, usize, usize),
    w: &[u8],
    xq: &[u8],
    out: &mut [f32],
    (kernels, off): (&[Block32RowsKernel; 4], i8),
) {
    assert!(cols.is_multiple_of(32), "whole blocks");
    let nb = cols / 32;
    let unit_bytes = nb * R * w_bytes;
    assert!(n > 0, "at least one activation row");
    let rows = w.len() / unit_bytes * R;
    check_gemv(
        w.len(),
        unit_bytes,
        out.len() / n,
        xq.len() >= n * nb * Q8_0_BYTES,
    );
    assert_eq!(out.len(), n * rows, "one output per row and activation row");
    PREPS.with_borrow_mut(|preps| {
        preps.resize(n * nb, lanes::Prep::default());
        for (i, p) in preps.iter_mut().enumerate() {
            // SAFETY: the AVX-512 level is available (checked); block i of the n rows lies
            // inside `xq` (checked length).
            *p = unsafe { lanes::prep(xq.as_ptr().add(i * Q8_0_BYTES), off) };
        }
        let preps = &preps[..];
        unit_rows(pool, n, out, |u, t0, m, res| {
            // SAFETY: the AVX-512 level is available (checked); unit u lies inside `w`, rows
            // t0..t0 + m inside `xq` and their preps inside `preps`.
            unsafe {
                kernels[m - 1](
                    nb,
                    w.as_ptr().add(u * unit_bytes),
                    xq.as_ptr().add(t0 * nb * Q8_0_BYTES),
                    preps.as_ptr().add(t0 * nb),
                    res,
                )
            }
        });
    });
}

/// The multi-row x16 matmuls' loop: for every unit `u` of `out.len() / n / R` (split across the
/// pool) and every run of up to four of the `n` activation rows `t0..t0 + m`, `kernel(u, t0, m,
/// res)` fills `res[..m]` with the run's sixteen outputs a row, stored at `out[(t0 + r) * rows +
/// 16 u..]`. A unit is read once per run, from memory the first time, then from cache.
pub(crate) fn unit_rows(
    pool: &ThreadPool,
    n: usize,
    out: &mut [f32],
    kernel: impl Fn(usize, usize, usize, &mut [[f32; R]; 4]) + Sync,
) {
    assert!(
        n > 0 && out.len().is_multiple_of(n * R),
        "whole units of n rows"
    );
    let rows = out.len() / n;
    let dst = SharedMut(out.as_mut_ptr());
    pool.for_range(rows / R, 4, |range| {
        let mut res = [[0f32; R]; 4];
        for u in range {
            for t0 in (0..n).step_by(4) {
                let m = (n - t0).min(4);
                kernel(u, t0, m, &mut res);
                // SAFETY: rows t0..t0 + m < n and columns u * 16..(u + 1) * 16 <= rows are
                // inside `out` (n * rows); unit u belongs to this chunk only.
                unsafe { dst.store_tile(rows, t0, u * R, &res[..m], R) };
            }
        }
    });
}

/// The per-block steps the 32-value x16 kernels share, on sixteen rows at once: `f[l]` holds
/// lane `l` (of ggml's eight, four products each) of every row, as the AVX2 row kernel holds it
/// in one `__m256` per row.
#[cfg(target_arch = "x86_64")]
pub mod lanes {
    use std::arch::x86_64::*;

    /// What a kernel needs of one Q8_0 activation block besides its codes.
    #[derive(Clone, Copy, Default)]
    pub struct Prep {
        /// Lane `l`'s `-off · (the sum of its four activation codes)`: where its accumulator
        /// starts when the weights enter `vpdpbusd` offset by `off`.
        pub starts: [i32; 8],
        /// The block's scale (f16 in the block) as f32.
        pub da: f32,
    }

    /// The [`Prep`] of the Q8_0 block at `ya` for weights offset by `off`.
    ///
    /// # Safety
    /// The AVX-512 level is available; `ya` points at one Q8_0 block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn prep(ya: *const u8, off: i8) -> Prep {
        let zero = _mm256_setzero_si256();
        // SAFETY: ya points at one Q8_0 block: 2 bytes of scale, 32 codes.
        let (a, da) = unsafe {
            (
                _mm256_loadu_si256(ya.add(2).cast()),
                half::f16::from_bits(u16::from_le_bytes([*ya, *ya.add(1)])).to_f32(),
            )
        };
        let sums = _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(off), a);
        let mut starts = [0i32; 8];
        // SAFETY: starts holds eight i32.
        unsafe { _mm256_storeu_si256(starts.as_mut_ptr().cast(), _mm256_sub_epi32(zero, sums)) };
        Prep { starts, da }
    }

    /// The row kernel's float step for one block: `f[l] = fma(d_w · d_a, acc[l], f[l])`, with
    /// the sixteen rows' `d` (f16) at `dw` and the activation block's scale `da`.
    ///
    /// # Safety
    /// The AVX-512 level is available; `dw` points at 16 f16 values.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn fold(f: &mut [__m512; 8], dw: *const u8, da: f32, acc: &[__m512i; 8]) {
        // SAFETY: dw points at 16 f16 values.
        let dw = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(dw.cast()) });
        let d = _mm512_mul_ps(dw, _mm512_set1_ps(da));
        for (f, &a) in f.iter_mut().zip(acc) {
            *f = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(a), *f);
        }
    }

    /// What the multi-row kernels need of `M` activation rows at one block: each row's prep and
    /// codes, and `d_w · d_a` ([`fold`]'s step) for the unit block's sixteen rows.
    pub struct RowsAt<const M: usize> {
        bp: [*const Prep; M],
        ya: [*const u8; M],
        d: [__m512; M],
    }

    impl<const M: usize> RowsAt<M> {
        /// Block `b` of `M` activation rows (`a`: rows of `nb` Q8_0 blocks, `pr`: their preps,
        /// rows `nb` apart) against the unit block whose rows' `d` (f16) are at `dw`.
        ///
        /// # Safety
        /// The AVX-512 level is available; `dw` points at 16 f16 values, and block `b` of each
        /// of the `M` rows and its prep lie where `a` and `pr` say.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub unsafe fn new(
            dw: *const u8,
            a: *const u8,
            pr: *const Prep,
            nb: usize,
            b: usize,
        ) -> Self {
            // SAFETY: the caller's contract.
            unsafe {
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(dw.cast()));
                let bp: [*const Prep; M] = std::array::from_fn(|r| pr.add(r * nb + b));
                RowsAt {
                    bp,
                    ya: std::array::from_fn(|r| a.add((r * nb + b) * super::Q8_0_BYTES)),
                    d: std::array::from_fn(|r| _mm512_mul_ps(dw, _mm512_set1_ps((*bp[r]).da))),
                }
            }
        }

        /// Lane `l` for every row: `vpdpbusd` of the weight vector `v` against the row's four
        /// activation bytes, started from the row's lane start, folded into `f[r][l]` by its `d`
        /// (one lane of [`fold`], in the same float steps). The preps and codes are read where
        /// they are: copied into locals, the starts went through general registers, and four
        /// rows in cache ran at 15.8 GB/s on one core instead of 25.9.
        ///
        /// # Safety
        /// The AVX-512 level is available; `l < 8`.
        #[inline]
        #[allow(clippy::needless_range_loop)] // rows index three arrays at once
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        pub unsafe fn fold_lane(&self, f: &mut [[__m512; 8]; M], l: usize, v: __m512i) {
            for r in 0..M {
                // SAFETY: the prep and the codes lie where `new`'s contract says.
                unsafe {
                    let start = _mm512_set1_epi32((*self.bp[r]).starts[l]);
                    let y =
                        crate::kernels::cpu::simd::avx512::bcast32x16(self.ya[r].add(2 + 4 * l));
                    let acc = _mm512_dpbusd_epi32(start, v, y);
                    f[r][l] = _mm512_fmadd_ps(self.d[r], _mm512_cvtepi32_ps(acc), f[r][l]);
                }
            }
        }
    }

    /// A 32-value layout's step of its multi-row kernels ([`rows_kernel`]): every lane of one unit
    /// block, for `M` rows, folded into `f`.
    pub trait FoldBlock {
        /// Bytes of one unit block.
        const BLOCK_BYTES: usize;

        /// Folds lanes 0..8 of the unit block at `x` into `f` for the `rows`
        /// ([`RowsAt::fold_lane`]).
        ///
        /// # Safety
        /// The AVX-512 level is available; `x` points at one unit block.
        unsafe fn fold_block<const M: usize>(
            x: *const u8,
            rows: &RowsAt<M>,
            f: &mut [[__m512; 8]; M],
        );
    }

    /// Layout `L`'s kernels for one to four rows, `[m - 1]` for `m` rows.
    pub const fn rows_kernels<L: FoldBlock>() -> [super::Block32RowsKernel; 4] {
        [
            rows_kernel::<L, 1>,
            rows_kernel::<L, 2>,
            rows_kernel::<L, 3>,
            rows_kernel::<L, 4>,
        ]
    }

    /// Sixteen outputs of one x16 unit (`w`: `nb` unit blocks of layout `L`) against each of `M`
    /// (1..=4) activation rows (`a`: the first row's `nb` Q8_0 blocks, the others following; `pr`:
    /// their preps, likewise), `out[r]` bit-identical to the layout's one-row kernel for row `r`
    /// alone: the same lane integers and float steps per block, the unit read once for all the
    /// rows (a [`super::Block32RowsKernel`]).
    ///
    /// # Safety
    /// The AVX-512 level is available; `w` points at `nb` unit blocks, `a` and `pr` at `nb` blocks
    /// and preps of each of `M` rows.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn rows_kernel<L: FoldBlock, const M: usize>(
        nb: usize,
        w: *const u8,
        a: *const u8,
        pr: *const Prep,
        out: &mut [[f32; super::R]; 4],
    ) {
        let mut f = [[_mm512_setzero_ps(); 8]; M];
        for b in 0..nb {
            // SAFETY: the caller's contract.
            unsafe {
                let x = w.add(b * L::BLOCK_BYTES);
                L::fold_block(x, &RowsAt::<M>::new(x, a, pr, nb, b), &mut f);
            }
        }
        for (f, o) in f.iter().zip(out.iter_mut()) {
            // SAFETY: `o` holds sixteen floats.
            unsafe { store(f, o.as_mut_ptr()) };
        }
    }

    /// Each row's sum of its eight lanes in `hsum_float_8`'s order, ((l0 + l4) + (l2 + l6)) +
    /// ((l1 + l5) + (l3 + l7)), stored to the sixteen floats at `out`.
    ///
    /// # Safety
    /// The AVX-512 level is available; `out` points at 16 writable floats.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub unsafe fn store(f: &[__m512; 8], out: *mut f32) {
        let r: [__m512; 4] = std::array::from_fn(|i| _mm512_add_ps(f[i + 4], f[i]));
        let sum = _mm512_add_ps(_mm512_add_ps(r[0], r[2]), _mm512_add_ps(r[1], r[3]));
        _mm512_storeu_ps(out, sum);
    }
}

/// `rows` rows of raw random 32-value blocks of `w_bytes` bytes (every bit pattern) with a
/// finite `d` in their first two bytes, for the 32-value layouts' tests.
#[cfg(test)]
pub(crate) fn raw_blocks32(rows: usize, nb: usize, w_bytes: usize, seed: u32) -> Vec<u8> {
    let mut w = test_bytes(rows * nb * w_bytes, seed);
    for (i, blk) in w.chunks_exact_mut(w_bytes).enumerate() {
        let d = half::f16::from_f32(0.002 + (i % 13) as f32 * 0.0009);
        blk[..2].copy_from_slice(&d.to_le_bytes());
    }
    w
}

/// One Q8_0 activation row of `nb` blocks with raw codes in -127..=127 (the quantizer's range,
/// both ends included).
#[cfg(test)]
pub(crate) fn raw_q8_0_activations(nb: usize, seed: u32) -> Vec<u8> {
    let q = test_bytes(nb * 32, seed);
    let mut a = Vec::new();
    for (b, vals) in q.chunks_exact(32).enumerate() {
        a.extend_from_slice(&half::f16::from_f32(0.01 + b as f32 * 0.002).to_le_bytes());
        for (i, &v) in vals.iter().enumerate() {
            let code = match i % 8 {
                0 => 127,
                1 => -127,
                _ => (v as i8).max(-127),
            };
            a.push(code as u8);
        }
    }
    a
}

/// A 32-value x16 layout of weight type `ty` (`w_bytes` a block) equals the row kernels (AVX2 and
/// AVX-512) bit for bit through its `pack` and `gemv`: on quantized real-valued rows, and on raw
/// blocks with every bit pattern against activation codes of ±127; also from a later unit on.
#[cfg(test)]
pub(crate) fn check_blocks32_against_rows(
    ty: crate::format::GgmlType,
    w_bytes: usize,
    pack: fn(&ThreadPool, &[u8], usize, usize, &mut [u8]),
    gemv: fn(usize, &[u8], &[u8], &mut [f32]),
) {
    use crate::kernels::cpu::simd;
    use crate::quant::{quantize_activations, quantize_row};
    let pool = ThreadPool::new(2);
    for (case, rows, cols) in [(0u32, 48, 640), (1, 32, 640), (2, 16, 32)] {
        let nb = cols / 32;
        let (w, xq) = if case == 0 {
            let mut w = Vec::new();
            let mut tmp = Vec::new();
            for r in 0..rows {
                let x = crate::kernels::cpu::test_floats(cols, 21 + r as u32);
                quantize_row(ty, &x, &mut tmp).unwrap();
                w.extend_from_slice(&tmp);
            }
            let a = crate::kernels::cpu::test_floats(cols, 8);
            let mut xq = Vec::new();
            quantize_activations(ty, &a, &mut xq).unwrap();
            (w, xq)
        } else {
            (
                raw_blocks32(rows, nb, w_bytes, 40 + case),
                raw_q8_0_activations(nb, 50 + case),
            )
        };
        let mut packed = vec![0u8; w.len()];
        pack(&pool, &w, rows, cols, &mut packed);
        let mut got = vec![0f32; rows];
        gemv(cols, &packed, &xq, &mut got);
        for level in [simd::Level::Avx2, simd::Level::Avx512] {
            let rows_fn = simd::dot_rows_at(level, ty).expect("row kernel");
            let mut want = vec![0f32; rows];
            rows_fn(cols, &w, nb * w_bytes, &xq, &mut want);
            assert_eq!(
                bits(&got),
                bits(&want),
                "case {case} against {}",
                level.name()
            );
        }
        // A later run of whole units, as decode hands them out.
        let unit = nb * R * w_bytes;
        let mut part = vec![0f32; rows - R];
        gemv(cols, &packed[unit..], &xq, &mut part);
        assert_eq!(bits(&part), bits(&got[R..]), "case {case}, units 1..");
    }
}

/// A 32-value x16 layout's multi-row `matmul` gives every activation row exactly what its `gemv`
/// gives that row alone, for 1 to 9 rows (whole passes of four and the rest), on raw blocks.
#[cfg(test)]
pub(crate) fn check_blocks32_rows_against_gemv(
    w_bytes: usize,
    pack: fn(&ThreadPool, &[u8], usize, usize, &mut [u8]),
    gemv: fn(usize, &[u8], &[u8], &mut [f32]),
    matmul: Blocks32Matmul,
) {
    crate::kernels::cpu::simd::require(crate::kernels::cpu::simd::Level::Avx512);
    let pool = ThreadPool::new(2);
    let (rows, cols) = (64, 640);
    let nb = cols / 32;
    let w = raw_blocks32(rows, nb, w_bytes, 77);
    let mut packed = vec![0u8; w.len()];
    pack(&pool, &w, rows, cols, &mut packed);
    let a_row = nb * Q8_0_BYTES;
    for n in 1..=9 {
        let xq: Vec<u8> = (0..n)
            .flat_map(|t| raw_q8_0_activations(nb, 90 + t as u32))
            .collect();
        let mut got = vec![0f32; n * rows];
        matmul(&pool, cols, &packed, &xq, n, &mut got);
        for t in 0..n {
            let mut want = vec![0f32; rows];
            gemv(cols, &packed, &xq[t * a_row..(t + 1) * a_row], &mut want);
            let row = &got[t * rows..(t + 1) * rows];
            assert_eq!(bits(row), bits(&want), "{n} rows, row {t}");
        }
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
