//! A decode step's attention sublayer in two parallel regions instead of three
//! (`Backend::attention_block` for one query row).
//!
//! Unfused, a decode step's attention runs the Q/K/V region, then on the calling thread the bias
//! adds, norms, RoPE and the cache write, then an attention region, then a serial quantization of
//! the attention row and `wo`'s region. Here each thread takes whole KV heads: it computes the
//! Q, K and V rows of its heads, adds their biases, norms, rotates and scales them, attends over
//! the cache and its own new K/V rows, and quantizes its part of the attention row for `wo`
//! ([`PartsQuantizer`]), all on values it wrote itself; then the calling thread stores the new
//! K/V rows into the cache and `wo` runs as one region. A region boundary and the serial RoPE
//! go, and the K/V heads' rows stay on the core that attends over them.
//!
//! Invariant: every value is what `attention_block_steps` computes (each step is the same
//! per-element, per-head or per-block operation, run on a part), which the tests check bit for
//! bit; the cache is not written while the region reads it (the new rows reach the attention
//! through [`HeadsJob::fresh`] and the cache after the region).

use std::cell::RefCell;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kernels::cpu::attention::{run_heads, HeadsJob};
use crate::kernels::cpu::backend::{CpuAct, CpuBackend, CpuKv, CpuWeight};
use crate::kernels::cpu::fused::ffn::{avx512_quantizer, PartsQuantizer, XQ_DOWN};
use crate::kernels::cpu::matmul::{decode_many, decode_rows_of, packed_for_decode, DECODE_UNIT};
use crate::kernels::cpu::matmul::{quantize_rows, XQ};
use crate::kernels::cpu::threads::chain;
use crate::kernels::cpu::{ops, SharedMut};
use crate::model::backend::{AttnBatch, AttnBlock, AttnScratch};
use crate::quant::{activation_row_bytes, vec_dot_type};

thread_local! {
    /// The step's new K then V rows in f16 (`2 * kv_dim`), stored into the cache after the region.
    static NEW_KV: RefCell<Vec<f16>> = const { RefCell::new(Vec::new()) };
}

/// Runs the sublayer fused where it applies: one query row, the f16 cache, whole KV heads per
/// thread (`n_head_kv` a multiple of the thread count), Q/K/V taking one activation format, head
/// rows in whole decode units, an AVX-512 quantizer for `wo`. Elsewhere it gives the scratch rows
/// back untouched, having done nothing.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode<'a>(
    be: &CpuBackend,
    h: &CpuAct,
    blk: &AttnBlock<'_, CpuBackend>,
    kv: &mut CpuKv,
    layer: usize,
    batch: &AttnBatch<'_, '_>,
    s: AttnScratch<'a, CpuBackend>,
    out: &mut CpuAct,
) -> Result<(), AttnScratch<'a, CpuBackend>> {
    let pool = &be.pool;
    let sh = batch.shape;
    let (hd, nh, nkv) = (sh.head_dim, sh.n_head, sh.n_head_kv);
    let threads = pool.n_threads();
    let (wq, wk, wv, wo) = (blk.wq, blk.wk, blk.wv, blk.wo);
    let act = vec_dot_type(wq.ty);
    let Some((quantize, elems)) = avx512_quantizer(wo.ty) else {
        return Err(s);
    };
    let (qd, kvd) = (nh * hd, nkv * hd);
    if h.rows != 1
        || batch.queries.len() != 1
        || kv.f32.is_some()
        || kv.quant.is_some()
        || kv.kv_dim != kvd
        || nkv == 0
        || !nh.is_multiple_of(nkv)
        || !nkv.is_multiple_of(threads)
        || !hd.is_multiple_of(DECODE_UNIT)
        || blk.rope.head_dim != hd
        || vec_dot_type(wk.ty) != act
        || vec_dot_type(wv.ty) != act
        || (wq.rows, wk.rows, wv.rows, wo.cols) != (qd, kvd, kvd, qd)
        || (wq.cols, wk.cols, wv.cols) != (h.cols, h.cols, h.cols)
        || !qd.is_multiple_of(elems)
    {
        return Err(s);
    }
    let Ok(a_bytes) = activation_row_bytes(act, h.cols) else {
        return Err(s);
    };
    let o_bytes = activation_row_bytes(vec_dot_type(wo.ty), qd).expect("whole blocks");
    assert_eq!((out.rows, out.cols), (1, wo.rows), "matmul output shape");
    let group = nh / nkv;
    let (qa, slot) = (&batch.queries[0], batch.slots[0]);
    let ff = blk.rope_freqs.map(Vec::as_slice);
    let table = be
        .rope_tables
        .get(pool, batch.positions, blk.rope.base, hd, ff);
    let cos_sin = &table[..hd];
    let packed = [wq, wk, wv].map(|w| packed_for_decode(pool, w));
    // Thread t's KV heads kh(t)..kh(t + 1); its query rows are their heads' rows.
    let kh = |t: usize| nkv * t / threads;
    let q_cuts = |t: usize| kh(t) * group * hd;
    let (q, k, v, attn) = (s.q, s.k, s.v, s.attn);
    let ptrs = [&mut *q, &mut *k, &mut *v, &mut *attn].map(|a| SharedMut(a.data.as_mut_ptr()));
    let planes = (&kv.k[layer][..], &kv.v[layer][..]);
    let shape = (kv.block_size, kvd);
    NEW_KV.with_borrow_mut(|new_kv| {
        new_kv.resize(2 * kvd, f16::ZERO);
        let fresh = SharedMut(new_kv.as_mut_ptr());
        XQ.with_borrow_mut(|xq| {
            quantize_rows(pool, wq.ty, h, a_bytes, xq);
            XQ_DOWN.with_borrow_mut(|xo| {
                xo.resize(o_bytes, 0);
                let parts = PartsQuantizer::new(quantize, elems, qd, ptrs[3], xo);
                // Each thread starts on its Q rows; each worker, once done, prefetches its first
                // bytes of the next region (`wo`'s; module `chain`).
                let base = packed[0].unwrap_or_else(|| wq.bytes()).as_ptr() as usize;
                let start = |t: usize| {
                    let r = q_cuts(t);
                    (base + r * wq.row_bytes, (q_cuts(t + 1) - r) * wq.row_bytes)
                };
                let key = wq as *const CpuWeight as usize;
                let after = chain::record(key, (0..threads).map(start));
                pool.broadcast_then_prefetch(
                    |t, _| {
                        let (g0, g1) = (kh(t), kh(t + 1));
                        let (q0, q1, k0, k1) = (q_cuts(t), q_cuts(t + 1), g0 * hd, g1 * hd);
                        // SAFETY: these are thread t's rows of q and attn (its heads' values), of
                        // k and v (its KV heads') and of the new f16 K and V rows; no other thread
                        // touches them in this region, and the pool joins before they are read
                        // elsewhere.
                        let (qs, ks, vs, nk, nv) = unsafe {
                            let part = |p: SharedMut<f32>, a: usize, b: usize| {
                                std::slice::from_raw_parts_mut(p.ptr().add(a), b - a)
                            };
                            (
                                part(ptrs[0], q0, q1),
                                part(ptrs[1], k0, k1),
                                part(ptrs[2], k0, k1),
                                std::slice::from_raw_parts_mut(fresh.ptr().add(k0), k1 - k0),
                                std::slice::from_raw_parts_mut(fresh.ptr().add(kvd + k0), k1 - k0),
                            )
                        };
                        for (w, p, bias, r0, o) in [
                            (wq, packed[0], blk.bq, q0, &mut *qs),
                            (wk, packed[1], blk.bk, k0, &mut *ks),
                            (wv, packed[2], blk.bv, k0, &mut *vs),
                        ] {
                            decode_rows_of(w, p, xq, r0, o);
                            if let Some(b) = bias {
                                o.iter_mut().zip(&b[r0..]).for_each(|(o, b)| *o += b);
                            }
                        }
                        for (x, norm) in [(&mut *qs, blk.q_norm), (&mut *ks, blk.k_norm)] {
                            for head in x.chunks_exact_mut(hd) {
                                if let Some(w) = norm {
                                    ops::rms_norm_inplace(head, w, blk.norm_eps);
                                }
                                ops::rope_head(head, cos_sin, blk.rope.style);
                            }
                        }
                        if let Some(sc) = blk.q_scale {
                            qs.iter_mut().for_each(|x| *x *= sc);
                        }
                        nk.convert_from_f32_slice(ks);
                        nv.convert_from_f32_slice(vs);
                        let job = HeadsJob::decode(qa, planes, shape, sh, Some((g0, nk, nv)));
                        let qs = &*qs;
                        run_heads(
                            &job,
                            g0 * group..g1 * group,
                            |h| &qs[h * hd - q0..(h + 1) * hd - q0],
                            // SAFETY: head h's values of the attention row lie in this thread's
                            // part q0..q1 (its heads), each head's handed out once.
                            |h| unsafe {
                                std::slice::from_raw_parts_mut(ptrs[3].ptr().add(h * hd), hd)
                            },
                            &mut None,
                        );
                        // SAFETY: this thread's part q0..q1 of the attention row is written and
                        // not written again in this region.
                        unsafe { parts.done(q0, q1) };
                    },
                    &after,
                );
                drop(parts);
                decode_many(pool, &mut [(wo, out)], &[None], xo);
            });
        });
    });
    NEW_KV.with_borrow(|new_kv| {
        let (nk, nv) = new_kv.split_at(kvd);
        kv.k[layer][slot * kvd..(slot + 1) * kvd].copy_from_slice(nk);
        kv.v[layer][slot * kvd..(slot + 1) * kvd].copy_from_slice(nv);
    });
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::format::GgmlType;
    use crate::kernels::cpu::backend::CpuBackend;
    use crate::kernels::cpu::fused::ffn::avx512_quantizer;
    use crate::kernels::cpu::matmul::tests::{same_bits, test_weights};
    use crate::kernels::cpu::test_floats as data;
    use crate::model::backend::{
        attention_block_steps, AttnBatch, AttnBlock, AttnQuery, AttnScratch, AttnShape, Backend,
        KvType, Rope,
    };
    use crate::model::config::RopeStyle;

    /// A cache of `n` positions of random keys and values, over blocks in a scrambled order.
    fn cache(
        be: &CpuBackend,
        kvd: usize,
        n: usize,
        table: &[u32],
    ) -> crate::kernels::cpu::backend::CpuKv {
        const BS: usize = 16;
        // An f16 cache: the head width only matters to a quantized one.
        let mut kv = be
            .alloc_kv(1, table.len(), BS, kvd, kvd, KvType::F16)
            .unwrap();
        let (mut k, mut v) = (be.act(n, kvd), be.act(n, kvd));
        k.data.copy_from_slice(&data(n * kvd, 7));
        v.data.copy_from_slice(&data(n * kvd, 8));
        let slots: Vec<usize> = (0..n)
            .map(|p| table[p / BS] as usize * BS + p % BS)
            .collect();
        be.kv_write(&mut kv, 0, &k, &v, &slots);
        kv
    }

    /// Runs `f` on fresh scratch rows (`qd` wide for q and the attention row, `kvd` for k and v)
    /// and an `n_embd`-wide output row, which it returns.
    pub(crate) fn with_scratch<B: Backend>(
        be: &B,
        (qd, kvd, n_embd): (usize, usize, usize),
        f: impl FnOnce(AttnScratch<'_, B>, &mut B::Act),
    ) -> B::Act {
        let (mut q, mut k, mut v, mut a) =
            (be.act(1, qd), be.act(1, kvd), be.act(1, kvd), be.act(1, qd));
        let s = AttnScratch {
            q: &mut q,
            k: &mut k,
            v: &mut v,
            attn: &mut a,
        };
        let mut out = be.act(1, n_embd);
        f(s, &mut out);
        out
    }

    /// The fused decode region gives what `attention_block`'s steps give, bit for bit: the
    /// sublayer's output and the cache it leaves. Q/K/V types with both activation formats
    /// (Q4_K/Q6_K as Qwen2.5's, Q5_0/Q8_0 as Gemma-3's), with and without biases, q/k norms and
    /// q pre-scaling, one, two and four threads (up to four KV heads each), before and past the
    /// split-KV kernel's 512 cells, with and without a window, and a `wo` quantization block cut
    /// between threads.
    #[test]
    fn attention_block_equals_its_steps() {
        let (hd, n_embd) = (64, 256);
        let fused = [1, 2, 4].map(CpuBackend::new);
        for (nh, nkv) in [(4, 2), (8, 4), (12, 2)] {
            let (qd, kvd) = (nh * hd, nkv * hd);
            for [tq, tk, tv, to] in [
                [GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q4K],
                [
                    GgmlType::Q5_0,
                    GgmlType::Q5_0,
                    GgmlType::Q8_0,
                    GgmlType::Q8_0,
                ],
            ] {
                let (be, ws) = test_weights(&[(tq, qd), (tk, kvd), (tv, kvd)], n_embd);
                let (_, wo) = test_weights(&[(to, n_embd)], qd);
                let bias = |n: usize, s: u32| data(n, s);
                let (bq, bk, bv) = (bias(qd, 31), bias(kvd, 32), bias(kvd, 33));
                let (qn, kn) = (bias(hd, 34), bias(hd, 35));
                for extras in [false, true] {
                    let blk = AttnBlock::<CpuBackend> {
                        wq: &ws[0],
                        wk: &ws[1],
                        wv: &ws[2],
                        bq: extras.then_some(&bq),
                        bk: extras.then_some(&bk),
                        bv: extras.then_some(&bv),
                        q_norm: extras.then_some(&qn),
                        k_norm: extras.then_some(&kn),
                        norm_eps: 1e-6,
                        rope: Rope {
                            style: if extras {
                                RopeStyle::Normal
                            } else {
                                RopeStyle::Neox
                            },
                            base: 10000.0,
                            head_dim: hd,
                        },
                        rope_freqs: None,
                        q_scale: extras.then_some(0.125),
                        wo: &wo[0],
                    };
                    for pos in [0usize, 37, 700] {
                        let table: Vec<u32> = (0..48u32).map(|b| (b * 29) % 48).collect();
                        let shape = AttnShape {
                            n_head: nh,
                            n_head_kv: nkv,
                            head_dim: hd,
                            scale: if extras { 1.0 } else { 0.125 },
                        };
                        let queries = [AttnQuery {
                            seq: 0,
                            block_table: &table,
                            pos: pos as u32,
                            lo: if extras {
                                0
                            } else {
                                (pos as u32).saturating_sub(20)
                            },
                        }];
                        let slot = table[pos / 16] as usize * 16 + pos % 16;
                        let batch = AttnBatch {
                            positions: &[pos as u32],
                            slots: &[slot],
                            queries: &queries,
                            shape,
                        };
                        let mut h = be.act(1, n_embd);
                        h.data.copy_from_slice(&data(n_embd, 40 + pos as u32));
                        // The steps, then the fused region on backends of 1, 2 and 4 threads
                        // (4 only where each takes whole KV heads).
                        let run = |fb: Option<&CpuBackend>| {
                            let mut kv = cache(&be, kvd, pos, &table);
                            let out = with_scratch(&be, (qd, kvd, n_embd), |s, out| {
                                if let Some(fb) = fb {
                                    // As the backend runs it: the steps where the region declines,
                                    // which it does exactly when there is no AVX-512 quantizer.
                                    let r = super::decode(fb, &h, &blk, &mut kv, 0, &batch, s, out);
                                    if let Err(s) = r {
                                        assert!(
                                            avx512_quantizer(blk.wo.ty).is_none(),
                                            "the fused region applies"
                                        );
                                        attention_block_steps(
                                            fb, &h, &blk, &mut kv, 0, &batch, s, out,
                                        );
                                    }
                                } else {
                                    attention_block_steps(
                                        &be, &h, &blk, &mut kv, 0, &batch, s, out,
                                    );
                                }
                            });
                            (out.data, kv.k[0].to_vec(), kv.v[0].to_vec())
                        };
                        let want = run(None);
                        for fb in &fused {
                            let n = fb.pool.n_threads();
                            if !nkv.is_multiple_of(n) {
                                continue;
                            }
                            let got = run(Some(fb));
                            let case = format!(
                                "{nh}/{nkv} heads, {tq:?}/{to:?}, extras {extras}, pos {pos}, {n} threads"
                            );
                            assert!(same_bits(&want.0, &got.0), "{case}: output");
                            assert!(want.1 == got.1 && want.2 == got.2, "{case}: cache");
                        }
                    }
                }
            }
        }
    }
}
