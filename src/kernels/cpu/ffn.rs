//! Decode's dense feed-forward in two parallel regions (`Backend::ffn_dense` for one row).
//!
//! Unfused, a decode step's feed-forward runs the gate/up region (each thread one stream: in
//! practice one thread the gate matrix, the other the up one), a GLU region, a serial quantization
//! of the GLU row on the calling thread, then the down projection's region. When the pool's cores
//! sit on different chiplets every value one writes and the other reads crosses between them. Here
//! each thread computes the same rows of both projections, one after the other, applies the GLU to
//! them and quantizes them for the down projection ([`PartsQuantizer`]), so the GLU values stay
//! where they were computed and the down projection starts right after.
//!
//! Invariant: every value is what `matmul_many`, `ops::glu` and `matmul` compute (each is an
//! element-wise or per-block operation, run on a part), which the tests check bit for bit.

use crate::format::GgmlType;
use crate::kernels::cpu::backend::{CpuAct, CpuWeight};
use crate::kernels::cpu::chain;
use crate::kernels::cpu::matmul::{
    decode_many, decode_rows_of, packed_for_decode, quantize_rows, DECODE_UNIT, XQ,
};
use crate::kernels::cpu::pool::ThreadPool;
use crate::kernels::cpu::simd;
use crate::kernels::cpu::{ops, SharedMut};
use crate::model::config::Activation;

thread_local! {
    /// [`decode`]'s quantized GLU row, for the down projection (`XQ` holds its input then); the
    /// attention row for `wo` in `attn_block`.
    pub(super) static XQ_DOWN: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The dense feed-forward of one activation row, `out = (act(h·Gᵀ) * (h·Uᵀ)) · Dᵀ`, in
/// two parallel regions instead of three: each thread computes the same rows of the gate and the
/// up projection (one after the other, so it still reads one stream at a time), applies the GLU
/// to them and quantizes them for the down projection, so no GLU value crosses between cores
/// before the down projection reads the quantized row. A quantization block cut between threads
/// is quantized by whichever of them finishes last. `gate` ends holding the GLU output and `up`
/// the up projection, every value as `matmul_many`, [`ops::glu`] and `matmul` compute them.
/// Returns false, having done nothing, where it does not apply (several rows, gate and up of
/// different types or shapes, or no AVX-512 quantizer for the down projection's format).
#[allow(clippy::too_many_arguments)]
pub fn decode(
    pool: &ThreadPool,
    h: &CpuAct,
    (gate_w, up_w, down_w): (&CpuWeight, &CpuWeight, &CpuWeight),
    act: Activation,
    gate: &mut CpuAct,
    up: &mut CpuAct,
    out: &mut CpuAct,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let Some((quantize, elems)) = avx512_quantizer(down_w.ty) else {
            return false;
        };
        let (ff, cols) = (gate_w.rows, gate_w.cols);
        if h.rows != 1
            || (up_w.ty, up_w.rows, up_w.cols) != (gate_w.ty, ff, cols)
            || h.cols != cols
            || down_w.cols != ff
            || !ff.is_multiple_of(elems)
        {
            return false;
        }
        assert_eq!(
            (gate.rows, gate.cols, up.rows, up.cols),
            (1, ff, 1, ff),
            "gate, up shapes"
        );
        assert_eq!(
            (out.rows, out.cols),
            (1, down_w.rows),
            "matmul output shape"
        );
        let a_bytes =
            crate::quant::activation_row_bytes(crate::quant::vec_dot_type(gate_w.ty), cols)
                .expect("activation row fits the block size");
        let d_bytes = crate::quant::activation_row_bytes(crate::quant::vec_dot_type(down_w.ty), ff)
            .expect("whole blocks");
        let packed = [gate_w, up_w].map(|w| packed_for_decode(pool, w));
        // Thread t's rows: units cuts[t]..cuts[t + 1] of DECODE_UNIT rows, evenly.
        let n = pool.n_threads();
        let units = ff.div_ceil(DECODE_UNIT);
        let cuts: Vec<usize> = (0..=n)
            .map(|t| (units * t / n * DECODE_UNIT).min(ff))
            .collect();
        XQ.with_borrow_mut(|xq| {
            quantize_rows(pool, gate_w.ty, h, a_bytes, xq);
            XQ_DOWN.with_borrow_mut(|xd| {
                xd.resize(d_bytes, 0);
                let (g, u) = (
                    SharedMut(gate.data.as_mut_ptr()),
                    SharedMut(up.data.as_mut_ptr()),
                );
                let parts = PartsQuantizer::new(quantize, elems, &cuts, g, xd);
                // Each thread starts on its gate rows; each worker, once done, prefetches its
                // first bytes of the next region (the down projection; module `chain`).
                let base = packed[0].unwrap_or_else(|| gate_w.bytes()).as_ptr() as usize;
                let start = |t: usize| {
                    let r = cuts[t];
                    (base + r * gate_w.row_bytes, (ff - r) * gate_w.row_bytes)
                };
                let key = gate_w as *const CpuWeight as usize;
                let after = chain::record(key, (0..n).map(start));
                pool.broadcast_then_prefetch(
                    |t, _| {
                        let (r0, r1) = (cuts[t], cuts[t + 1]);
                        if r0 == r1 {
                            return;
                        }
                        // SAFETY: rows r0..r1 of `gate` and `up` (ff values each) are this thread's
                        // only; the pool joins before they are read elsewhere.
                        let (gs, us) = unsafe {
                            (
                                std::slice::from_raw_parts_mut(g.ptr().add(r0), r1 - r0),
                                std::slice::from_raw_parts_mut(u.ptr().add(r0), r1 - r0),
                            )
                        };
                        decode_rows_of(gate_w, packed[0], xq, r0, gs);
                        decode_rows_of(up_w, packed[1], xq, r0, us);
                        ops::glu(gs, us, act);
                        // SAFETY: this thread has written its part r0..r1 of `gate` and does not
                        // touch it again in this region.
                        unsafe { parts.part_done(t) };
                    },
                    &after,
                );
                decode_many(pool, &mut [(down_w, out)], &[None], xd);
            });
        });
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pool, h, gate_w, up_w, down_w, act, gate, up, out);
        false
    }
}

/// One activation row quantized by the pool's threads as they produce it in parts: thread `t`
/// writes values `cuts[t]..cuts[t + 1]` of `src`, then calls [`PartsQuantizer::part_done`], which
/// quantizes the blocks inside its part into `dst` and, for a block cut between parts, counts
/// itself done: the last of that block's threads to finish quantizes it. No thread waits on
/// another, so this is safe in a pool region even when the caller runs a late worker's part
/// after its own.
pub(super) struct PartsQuantizer<'a> {
    quantize: Quantizer,
    elems: usize,
    blk_bytes: usize,
    cuts: &'a [usize],
    /// Per block: how many of its threads have finished their part of it.
    done: Vec<std::sync::atomic::AtomicUsize>,
    src: SharedMut<f32>,
    dst: SharedMut<u8>,
}

impl<'a> PartsQuantizer<'a> {
    /// `src` holds `*cuts.last()` values (whole blocks of `elems`), `dst` their quantized bytes.
    pub(super) fn new(
        quantize: Quantizer,
        elems: usize,
        cuts: &'a [usize],
        src: SharedMut<f32>,
        dst: &mut [u8],
    ) -> PartsQuantizer<'a> {
        let len = *cuts.last().expect("one cut at least");
        assert!(len.is_multiple_of(elems), "whole blocks");
        let nblk = len / elems;
        assert!(dst.len().is_multiple_of(nblk.max(1)), "bytes per block");
        PartsQuantizer {
            quantize,
            elems,
            blk_bytes: dst.len() / nblk.max(1),
            cuts,
            done: (0..nblk).map(|_| Default::default()).collect(),
            src,
            dst: SharedMut(dst.as_mut_ptr()),
        }
    }

    /// Thread `t`'s part of `src` is written: quantizes what it can (see the type).
    ///
    /// # Safety
    /// Values `cuts[t]..cuts[t + 1]` of `src` are written and no thread writes them again while
    /// this quantizer lives; each `t` calls this once; `src` and `dst` outlive the quantizer.
    pub(super) unsafe fn part_done(&self, t: usize) {
        use std::sync::atomic::Ordering;
        let (r0, r1, e) = (self.cuts[t], self.cuts[t + 1], self.elems);
        if r0 == r1 {
            return;
        }
        let sharing = |b: usize| {
            let (lo, hi) = (b * e, (b + 1) * e);
            // Parts that hold values of block b (an empty part holds none and never counts).
            self.cuts
                .windows(2)
                .filter(|c| c[0] < c[1] && c[0] < hi && lo < c[1])
                .count()
        };
        for b in r0 / e..r1.div_ceil(e) {
            let whole = b * e >= r0 && (b + 1) * e <= r1;
            // A shared block: the AcqRel count makes the other threads' values visible to the
            // last one, which quantizes it.
            if !whole && self.done[b].fetch_add(1, Ordering::AcqRel) + 1 < sharing(b) {
                continue;
            }
            // SAFETY: block b's values were all written (by this thread, or by the sharing
            // threads that counted before it) and are not written again; its bytes of `dst` are
            // written by this one thread only (a whole block has no other thread, a shared one
            // one last thread).
            let (x, q) = unsafe {
                (
                    std::slice::from_raw_parts(self.src.ptr().add(b * e), e),
                    std::slice::from_raw_parts_mut(
                        self.dst.ptr().add(b * self.blk_bytes),
                        self.blk_bytes,
                    ),
                )
            };
            (self.quantize)(x, q);
        }
    }
}

/// An activation quantizer: whole blocks of floats into their bytes.
pub(super) type Quantizer = fn(&[f32], &mut [u8]);

/// The AVX-512 quantizer of `w`'s activation format and its block length, where there is one.
#[cfg(target_arch = "x86_64")]
pub(super) fn avx512_quantizer(w: GgmlType) -> Option<(Quantizer, usize)> {
    use simd::avx512::quantize::{quantize_row_q8_0, quantize_row_q8k};
    if simd::current() < simd::Level::Avx512 {
        return None;
    }
    match crate::quant::vec_dot_type(w) {
        GgmlType::Q8K => Some((quantize_row_q8k, 256)),
        GgmlType::Q8_0 => Some((quantize_row_q8_0, 32)),
        _ => None,
    }
}

/// No AVX-512 quantizer off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn avx512_quantizer(_: GgmlType) -> Option<(Quantizer, usize)> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::matmul::tests::{same_bits, test_weights};
    use crate::kernels::cpu::test_floats as data;

    /// Every block is quantized once, as a whole row's quantization gives it, whatever order the
    /// parts finish in: blocks inside a part, blocks cut between two or more parts, and parts
    /// left empty (more threads than units of rows, as `decode` cuts them).
    #[test]
    fn parts_quantize_every_block_once() {
        let Some((quantize, elems)) = avx512_quantizer(GgmlType::Q4_0) else {
            return; // no AVX-512 quantizer on this CPU
        };
        for (len, n) in [(32usize, 4usize), (64, 3), (256, 3), (1280, 2), (1280, 7)] {
            let src = data(len, len as u32);
            let blk = crate::quant::activation_row_bytes(GgmlType::Q8_0, elems).unwrap();
            let mut want = vec![0u8; len / elems * blk];
            for (x, q) in src.chunks(elems).zip(want.chunks_mut(blk)) {
                quantize(x, q);
            }
            let units = len.div_ceil(DECODE_UNIT);
            let cuts: Vec<usize> = (0..=n)
                .map(|t| (units * t / n * DECODE_UNIT).min(len))
                .collect();
            for order in 0..n {
                let mut got = vec![0u8; want.len()];
                let mut s = src.clone();
                let parts = PartsQuantizer::new(
                    quantize,
                    elems,
                    &cuts,
                    SharedMut(s.as_mut_ptr()),
                    &mut got,
                );
                for k in 0..n {
                    // SAFETY: the source is fully written before any part is reported, and each
                    // part is reported once.
                    unsafe { parts.part_done((k + order) % n) };
                }
                drop(parts);
                assert_eq!(got, want, "len {len} over {n} parts, order {order}");
            }
        }
    }

    /// `ffn_dense` (decode's two-region feed-forward) gives what `matmul_many`, `glu` and
    /// `matmul` give, bit for bit, in all three outputs: gate/up types with and without packed
    /// copies, both activation formats of the down projection, and a quantization block cut
    /// between the threads (1280 rows: the cut falls inside the third 256-value block).
    #[test]
    fn ffn_dense_equals_its_steps() {
        use crate::model::backend::Backend;
        let (cols, ff) = (256, 1280);
        let (be, ws) = test_weights(&[(GgmlType::Q4K, ff), (GgmlType::Q4K, ff)], cols);
        let (_, ws2) = test_weights(&[(GgmlType::Q5_0, ff), (GgmlType::Q5_0, ff)], cols);
        let (_, downs) = test_weights(
            &[
                (GgmlType::Q6K, 48),
                (GgmlType::Q4K, 32),
                (GgmlType::Q8_0, 32),
            ],
            ff,
        );
        for act in [Activation::Silu, Activation::GeluTanh] {
            for (g, u) in [(&ws[0], &ws[1]), (&ws2[0], &ws2[1])] {
                for d in &downs {
                    for n in [1, 2] {
                        let mut h = be.act(n, cols);
                        h.data.copy_from_slice(&data(n * cols, 80 + n as u32));
                        let (mut g1, mut u1, mut o1) =
                            (be.act(n, ff), be.act(n, ff), be.act(n, d.rows));
                        be.matmul_many(&h, &mut [(g, None, &mut g1), (u, None, &mut u1)]);
                        be.glu(&mut g1, &u1, act);
                        be.matmul(d, &g1, None, &mut o1);
                        let (mut g2, mut u2, mut o2) =
                            (be.act(n, ff), be.act(n, ff), be.act(n, d.rows));
                        be.ffn_dense(&h, (g, u, d), act, &mut g2, &mut u2, &mut o2);
                        let case = format!("{act:?} {:?}/{:?} n={n}", g.ty, d.ty);
                        assert!(same_bits(&g1.data, &g2.data), "{case}: gate");
                        assert!(same_bits(&u1.data, &u2.data), "{case}: up");
                        assert!(same_bits(&o1.data, &o2.data), "{case}: out");
                    }
                }
            }
        }
    }
}
