//! Decode's dense feed-forward in two parallel regions (`Backend::ffn_dense` for one row).
//!
//! Unfused, a decode step's feed-forward runs the gate/up region (each thread one stream: in
//! practice one thread the gate matrix, the other the up one), a GLU region, a serial quantization
//! of the GLU row on the calling thread, then the down projection's region. When the pool's cores
//! sit on different chiplets every value one writes and the other reads crosses between them. Here
//! each thread computes the same rows of both projections, one after the other, applies the GLU to
//! them and quantizes them for the down projection ([`PartsQuantizer`]), so the GLU values stay
//! where they were computed and the down projection starts right after. A large region (Qwen2.5's
//! 15 MB) shares its rows as every large decode region does ([`Split`]): a thread done with its
//! own rows takes rows from the end of the other's, since one core may read slower than the
//! other for a while.
//!
//! Invariant: every value is what `matmul_many`, `ops::glu` and `matmul` compute (each is an
//! element-wise or per-block operation, run on a part), which the tests check bit for bit.

use crate::format::GgmlType;
use crate::kernels::cpu::backend::{CpuAct, CpuWeight};
use crate::kernels::cpu::matmul::{
    decode_many, decode_rows_of, packed_for_decode, quantize_rows, region_shares, split_min_units,
    with_cuts, DECODE_UNIT, XQ,
};
use crate::kernels::cpu::simd;
use crate::kernels::cpu::threads::chain;
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::kernels::cpu::threads::split::Split;
use crate::kernels::cpu::{ops, SharedMut};
use crate::model::config::Activation;
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    /// [`decode`]'s quantized GLU row, for the down projection (`XQ` holds its input then); the
    /// attention row for `wo` in `fused::attention`.
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
        // Thread t owns units ucuts(t)..ucuts(t + 1) of DECODE_UNIT rows, evenly; in a region
        // large enough (`region_shares`) it shares them as a `Split` does, a thread done with its
        // own taking chunks from the end of another's.
        let n = pool.n_threads();
        let units = ff.div_ceil(DECODE_UNIT);
        let ucuts = |t: usize| units * t / n;
        let row = |u: usize| (u * DECODE_UNIT).min(ff);
        let split = region_shares(2 * ff * gate_w.row_bytes).then(|| {
            let min = split_min_units(2 * DECODE_UNIT * gate_w.row_bytes);
            with_cuts(n, ucuts, |c| Split::new(c, min))
        });
        XQ.with_borrow_mut(|xq| {
            quantize_rows(pool, gate_w.ty, h, a_bytes, xq);
            XQ_DOWN.with_borrow_mut(|xd| {
                xd.resize(d_bytes, 0);
                let (g, u) = (
                    SharedMut(gate.data.as_mut_ptr()),
                    SharedMut(up.data.as_mut_ptr()),
                );
                let parts = PartsQuantizer::new(quantize, elems, ff, g, xd);
                // Each thread starts on its gate rows; each worker, once done, prefetches its
                // first bytes of the next region (the down projection; module `chain`).
                let base = packed[0].unwrap_or_else(|| gate_w.bytes()).as_ptr() as usize;
                let start = |t: usize| {
                    let r = row(ucuts(t));
                    (base + r * gate_w.row_bytes, (ff - r) * gate_w.row_bytes)
                };
                let key = gate_w as *const CpuWeight as usize;
                let after = chain::record(key, (0..n).map(start));
                pool.broadcast_then_prefetch(
                    |t, _| {
                        let chunk = |us: std::ops::Range<usize>| {
                            let (r0, r1) = (row(us.start), row(us.end));
                            if r0 == r1 {
                                return; // more threads than units: an empty share
                            }
                            // SAFETY: rows r0..r1 of `gate` and `up` (ff values each) are this
                            // chunk's only (`Split` hands each unit out once); the pool joins
                            // before they are read elsewhere.
                            let (gs, ups) = unsafe {
                                (
                                    std::slice::from_raw_parts_mut(g.ptr().add(r0), r1 - r0),
                                    std::slice::from_raw_parts_mut(u.ptr().add(r0), r1 - r0),
                                )
                            };
                            decode_rows_of(gate_w, packed[0], xq, r0, gs);
                            decode_rows_of(up_w, packed[1], xq, r0, ups);
                            ops::glu(gs, ups, act);
                            // SAFETY: rows r0..r1 of `gate` are written and not written again
                            // in this region; no other chunk holds them.
                            unsafe { parts.done(r0, r1) };
                        };
                        match &split {
                            Some(split) => split.run(t, chunk),
                            None => chunk(ucuts(t)..ucuts(t + 1)),
                        }
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

/// One activation row quantized by the pool's threads as they produce it in parts: a thread
/// that has written values `r0..r1` of `src` calls [`PartsQuantizer::done`], which quantizes the
/// blocks inside that range into `dst` and, for a block the range covers only in part, counts its
/// values in: whichever thread completes a block quantizes it. No thread waits on another, so
/// this is safe in a pool region whatever order the parts come in, however they are cut (a
/// thread's fixed share, or the chunks a [`Split`] hands out), and when the caller runs a late
/// worker's part after its own.
pub(super) struct PartsQuantizer {
    quantize: Quantizer,
    elems: usize,
    blk_bytes: usize,
    /// Per block: how many of its values have been reported written.
    done: Vec<AtomicUsize>,
    src: SharedMut<f32>,
    dst: SharedMut<u8>,
}

thread_local! {
    /// Block counters a dropped [`PartsQuantizer`] leaves for the next one on this thread.
    static DONE: std::cell::RefCell<Vec<AtomicUsize>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Drop for PartsQuantizer {
    fn drop(&mut self) {
        let done = std::mem::take(&mut self.done);
        DONE.with_borrow_mut(|spare| *spare = done);
    }
}

impl PartsQuantizer {
    /// `src` holds `len` values (whole blocks of `elems`), `dst` their quantized bytes.
    pub(super) fn new(
        quantize: Quantizer,
        elems: usize,
        len: usize,
        src: SharedMut<f32>,
        dst: &mut [u8],
    ) -> PartsQuantizer {
        assert!(len.is_multiple_of(elems), "whole blocks");
        let nblk = len / elems;
        assert!(dst.len().is_multiple_of(nblk.max(1)), "bytes per block");
        PartsQuantizer {
            quantize,
            elems,
            blk_bytes: dst.len() / nblk.max(1),
            done: DONE.with_borrow_mut(|spare| {
                // The counters of the last quantizer dropped on this thread, reused: an allocation
                // is a cold path between two decode regions.
                let mut done = std::mem::take(spare);
                done.clear();
                done.resize_with(nblk, || AtomicUsize::new(0));
                done
            }),
            src,
            dst: SharedMut(dst.as_mut_ptr()),
        }
    }

    /// Values `r0..r1` of `src` are written: quantizes every block this completes.
    ///
    /// # Safety
    /// Values `r0..r1` of `src` are written and no thread writes them again while this quantizer
    /// lives; the ranges reported are disjoint; `src` and `dst` outlive the quantizer.
    pub(super) unsafe fn done(&self, r0: usize, r1: usize) {
        let e = self.elems;
        for b in r0 / e..r1.div_ceil(e) {
            let n = r1.min((b + 1) * e) - r0.max(b * e);
            // A block in part: the AcqRel count makes the other threads' values of it visible
            // to the thread whose values complete it, which quantizes it.
            if n < e && self.done[b].fetch_add(n, Ordering::AcqRel) + n < e {
                continue;
            }
            // SAFETY: block b's values were all written (by this thread, or by the threads that
            // counted theirs before it) and are not written again; its bytes of `dst` are
            // written by this one thread only (the one whose values completed the block).
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

    /// Every block is quantized once, as a whole row's quantization gives it, only after all
    /// its values are written, whatever order the parts come in and however they are cut: blocks
    /// inside a part, blocks cut between two or more parts, parts of one unit and empty parts
    /// (more threads than units of rows, as `decode` cuts them), in ascending, descending and
    /// shuffled order. Each part's values are written just before it is reported (the rest of
    /// the row holding NaN), as the threads write them.
    #[test]
    #[cfg_attr(
        not(infer_host_avx512),
        ignore = "needs AVX-512 F/BW/VL/VNNI, which the CPU that built the tests lacks"
    )]
    fn parts_quantize_every_block_once() {
        static CALLS: AtomicUsize = AtomicUsize::new(0);
        simd::require(simd::Level::Avx512);
        let (quantize, elems) = avx512_quantizer(GgmlType::Q4_0).expect("an AVX-512 quantizer");
        fn counted(x: &[f32], q: &mut [u8]) {
            CALLS.fetch_add(1, Ordering::Relaxed);
            simd::avx512::quantize::quantize_row_q8_0(x, q);
        }
        for (len, n) in [
            (32usize, 4usize),
            (64, 3),
            (256, 3),
            (1280, 2),
            (1280, 7),
            (1280, 80),
        ] {
            let src = data(len, len as u32);
            let blk = crate::quant::activation_row_bytes(GgmlType::Q8_0, elems).unwrap();
            let mut want = vec![0u8; len / elems * blk];
            for (x, q) in src.chunks_exact(elems).zip(want.chunks_exact_mut(blk)) {
                quantize(x, q);
            }
            let units = len.div_ceil(DECODE_UNIT);
            let cuts: Vec<usize> = (0..=n)
                .map(|t| (units * t / n * DECODE_UNIT).min(len))
                .collect();
            for order in 0..3 {
                let mut parts: Vec<(usize, usize)> =
                    cuts.windows(2).map(|c| (c[0], c[1])).collect();
                match order {
                    1 => parts.reverse(),
                    2 => parts.sort_by_key(|&(a, _)| (a * 7919) % 101),
                    _ => {}
                }
                let mut got = vec![0u8; want.len()];
                let mut s = vec![f32::NAN; len];
                let sp = SharedMut(s.as_mut_ptr());
                let q = PartsQuantizer::new(counted, elems, len, sp, &mut got);
                CALLS.store(0, Ordering::Relaxed);
                for (r0, r1) in parts {
                    // SAFETY: `s` outlives the quantizer and only this loop writes it, each
                    // part's values once, before the part is reported; the parts are disjoint.
                    unsafe {
                        std::slice::from_raw_parts_mut(sp.ptr().add(r0), r1 - r0)
                            .copy_from_slice(&src[r0..r1]);
                        q.done(r0, r1);
                    }
                }
                drop(q);
                let case = format!("len {len} over {n} parts, order {order}");
                assert_eq!(got, want, "{case}");
                assert_eq!(CALLS.load(Ordering::Relaxed), len / elems, "{case}: calls");
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
                        be.ffn_dense(&h, (g, u, d), act, &mut g2, &mut u2, &mut o2, None);
                        let case = format!("{act:?} {:?}/{:?} n={n}", g.ty, d.ty);
                        assert!(same_bits(&g1.data, &g2.data), "{case}: gate");
                        assert!(same_bits(&u1.data, &u2.data), "{case}: up");
                        assert!(same_bits(&o1.data, &o2.data), "{case}: out");
                    }
                }
            }
        }
    }

    /// A feed-forward large enough to share its rows between the threads (`region_shares`), on
    /// pools of 2 and 4 threads, several times over (which thread takes which chunk varies from
    /// run to run): still bit for bit what the steps give.
    #[test]
    fn ffn_dense_shared_region_equals_its_steps() {
        use crate::kernels::cpu::backend::CpuBackend;
        use crate::kernels::cpu::matmul::tests::test_weights_on;
        use crate::model::backend::Backend;
        let (cols, ff) = (1536, 2816);
        for threads in [2, 4] {
            let be = CpuBackend::new(threads);
            let ws = test_weights_on(&be, &[(GgmlType::Q4K, ff), (GgmlType::Q4K, ff)], cols);
            let downs = test_weights_on(&be, &[(GgmlType::Q4K, 64)], ff);
            let (g, u, d) = (&ws[0], &ws[1], &downs[0]);
            assert!(
                region_shares(2 * ff * g.row_bytes),
                "the shape shares its rows"
            );
            let mut h = be.act(1, cols);
            h.data.copy_from_slice(&data(cols, 7));
            let (mut g1, mut u1, mut o1) = (be.act(1, ff), be.act(1, ff), be.act(1, d.rows));
            be.matmul_many(&h, &mut [(g, None, &mut g1), (u, None, &mut u1)]);
            be.glu(&mut g1, &u1, Activation::Silu);
            be.matmul(d, &g1, None, &mut o1);
            for run in 0..8 {
                let (mut g2, mut u2, mut o2) = (be.act(1, ff), be.act(1, ff), be.act(1, d.rows));
                be.ffn_dense(
                    &h,
                    (g, u, d),
                    Activation::Silu,
                    &mut g2,
                    &mut u2,
                    &mut o2,
                    None,
                );
                let case = format!("{threads} threads, run {run}");
                assert!(same_bits(&g1.data, &g2.data), "{case}: gate");
                assert!(same_bits(&u1.data, &u2.data), "{case}: up");
                assert!(same_bits(&o1.data, &o2.data), "{case}: out");
            }
        }
    }
}
