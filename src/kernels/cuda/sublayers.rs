//! The CUDA backend's steps of several kernels, apart from `backend.rs`'s one-op-one-kernel
//! methods: matmuls (GEMV or tensor-core GEMM by row count, GEMVs of one type sharing a launch),
//! the fused residual add + norm, the decode FFN's gate/up/GLU launch, a sublayer's last product
//! with the residual join after it, the attention sublayer (Q/K/V products, `rope_kv`, attention,
//! output product) and attention itself; and the record of
//! the q8_1 blocks a fused kernel wrote of its output, which lets the matmul that reads that
//! output next skip its quantize launch.

use std::sync::atomic::Ordering;

use anyhow::{bail, Result};

use super::backend::{
    i32s, CudaAct, CudaBackend, CudaKv, CudaVec, CudaWeight, ATTN_DONE, GLU_DONE, NORM_DONE, PART,
    Q8, Q8_GLU, Q8_NORM, QKV_DONE,
};
use super::launch::Launch;
use super::ops::{self, AttnArgs, RopeKv};
use crate::model::backend::{
    AttnBatch, AttnBlock, AttnQuery, AttnScratch, AttnShape, Join, MatmulJob,
};
use crate::model::config::Activation;

/// Whether an `INFER_CUDA_FUSED_*` switch is on (unset, or anything but `0`): each fusion can be
/// turned off to measure what it gives on a GPU. Read once.
fn switch(cell: &'static std::sync::OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).as_deref() != Ok("0"))
}

/// The decode FFN's gate, up and GLU in one launch.
fn fused_ffn() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch(&ON, "INFER_CUDA_FUSED_FFN")
}

/// A sublayer's last product and the residual join after it in one launch.
fn fused_norm() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch(&ON, "INFER_CUDA_FUSED_NORM")
}

/// A decode step's Q/K/V products and `rope_kv` in one launch.
fn fused_qkv() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch(&ON, "INFER_CUDA_FUSED_QKV")
}

/// Decode attention's splits merged by the block that finishes the last of them (else an
/// `attn_merge` launch).
fn fused_merge() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    switch(&ON, "INFER_CUDA_FUSED_MERGE")
}

/// Most rows for which the join runs inside the product's launch: its last block normalises the
/// rows one after another (about what a launch of `add_rms_norm_q8` costs for one row, where
/// that kernel takes the rows in parallel).
const FUSED_NORM_ROWS: usize = 1;

/// Most rows a row-invariant call takes on the GEMV's per-row sums (two passes over the weights
/// of 8 rows each, where the tensor-core GEMM reads them once): enough for speculative
/// verification of a lone request (`--draft-max` 8 makes 9 rows) and for a scheduler step of up to
/// 16 sequences to give each its lone output. Larger batches take the GEMM and tiled attention
/// for throughput, and a row's sums there depend on the batch (as in vLLM and llama.cpp's server).
const INVARIANT_ROWS: usize = 16;

/// q8_1 blocks of an activation, valid while [`CudaBackend::epoch`] equals `epoch`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) struct Q8Ready {
    pub(super) act: u64,
    pub(super) values: usize,
    pub(super) q8: u64,
    pub(super) epoch: u64,
}

impl CudaBackend {
    /// Records that `q8` holds the q8_1 blocks of `a` (just written by the last launch).
    pub(super) fn set_q8(&self, a: &CudaAct, q8: u64) {
        let r = Q8Ready {
            act: a.buf.ptr,
            values: a.rows * a.cols,
            q8,
            epoch: self.epoch.load(Ordering::Relaxed),
        };
        *self.q8_ready.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
    }

    /// The q8_1 blocks of `x` if the last launch wrote them and nothing ran since.
    pub(super) fn q8_of(&self, x: &CudaAct) -> Option<u64> {
        let r = self
            .q8_ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let now = self.epoch.load(Ordering::Relaxed);
        (r.act == x.buf.ptr && r.values == x.rows * x.cols && r.epoch == now).then_some(r.q8)
    }

    /// Whether a call over `rows` rows keeps row-invariant numerics: while
    /// `Backend::set_row_invariant` is on, up to [`INVARIANT_ROWS`] rows.
    pub(super) fn invariant(&self, rows: usize) -> bool {
        self.row_invariant.load(Ordering::Relaxed) && rows <= INVARIANT_ROWS
    }

    /// The launcher for an op that reads `x` as q8_1 blocks, and those blocks: the ones a fused
    /// kernel just wrote of `x` (on record), else `x` quantized into the `Q8` scratch now.
    pub(super) fn l_with_q8(&self, x: &CudaAct) -> Result<(&dyn Launch, u64)> {
        let ready = self.q8_of(x); // before `l()`, which marks every record stale
        let l = self.l();
        let q8 = match ready {
            Some(q8) => q8,
            None => {
                let q8 = self.scratch(Q8, x.rows * x.cols / 32 * ops::Q8_1_BYTES)?;
                ops::quantize_q8_1(l, x.buf.ptr, q8, x.rows * x.cols)?;
                q8
            }
        };
        Ok((l, q8))
    }

    /// q8_1 scratch for `values` activations (a multiple of 32), or None if they cannot be.
    pub(super) fn q8_scratch(&self, values: usize, cols: usize) -> Result<Option<u64>> {
        if !cols.is_multiple_of(32) {
            return Ok(None);
        }
        Ok(Some(self.scratch(Q8, values / 32 * ops::Q8_1_BYTES)?))
    }

    /// A decode FFN's gate and up products and the GLU in one launch ([`ops::gemv_glu`]): gate
    /// becomes act(gate) * up with its q8_1 blocks on record for the down product. False (and
    /// nothing done) where it does not apply: more rows than a GEMV takes, gate and up of another
    /// type or shape than each other, widths not whole q8_1 blocks, a type without the kernel, or
    /// `INFER_CUDA_FUSED_FFN=0`.
    pub(super) fn try_gate_up_glu(
        &self,
        h: &CudaAct,
        (gw, uw): (&CudaWeight, &CudaWeight),
        act: Activation,
        gate: &mut CudaAct,
        up: &mut CudaAct,
    ) -> Result<bool> {
        let (n, ff) = (h.rows, gw.rows);
        if !fused_ffn()
            || n > ops::GEMV_TOKENS
            || ops::gemv_glu_kernel(gw.ty).is_none()
            || (uw.ty, uw.rows, uw.cols) != (gw.ty, ff, gw.cols)
            || gw.cols != h.cols
            || !h.cols.is_multiple_of(32)
            || !ff.is_multiple_of(32)
            || (gate.rows, gate.cols, up.rows, up.cols) != (n, ff, n, ff)
        {
            return Ok(false);
        }
        // q8_1 blocks of h: the norm before the FFN just wrote them, or quantized now
        let (l, xq) = self.l_with_q8(h)?;
        let q8 = self.scratch(Q8_GLU, n * ff / 32 * ops::Q8_1_BYTES)?;
        let done = self.scratch(GLU_DONE, ops::gemv_glu_done_bytes(ff, n))?;
        let shape = (ff, h.cols, n);
        let (g, u) = ((gw.buf.ptr, gate.buf.ptr), (uw.buf.ptr, up.buf.ptr));
        ops::gemv_glu(l, gw.ty, xq, g, u, shape, (q8, done), act)?;
        self.set_q8(gate, q8);
        Ok(true)
    }

    /// `out = x · Wᵀ`, then the residual `join` (when given) on it, the two in one launch
    /// ([`ops::gemv_norm`]) for a lone row: the join's output and its q8_1 blocks (on record for
    /// the next matmul) as `add_rms_norm_q8` writes them. Elsewhere (more rows, a weight type
    /// without the kernel, widths not whole q8_1 blocks, a join of another width, or
    /// `INFER_CUDA_FUSED_NORM=0`) the matmul and then the join.
    pub(super) fn try_matmul_join(
        &self,
        x: &CudaAct,
        w: &CudaWeight,
        out: &mut CudaAct,
        join: Option<Join<'_, Self>>,
    ) -> Result<()> {
        let Some(j) = join else {
            return self.try_matmul_many(x, &mut [(w, None, out)]);
        };
        let (n, d) = (x.rows, w.rows);
        let fits = |a: &CudaAct| (a.rows, a.cols) == (n, d);
        if !fused_norm()
            || n > FUSED_NORM_ROWS
            || ops::gemv_norm_kernel(w.ty).is_none()
            || w.cols != x.cols
            || !x.cols.is_multiple_of(32)
            || !d.is_multiple_of(32)
            || j.w.len != d
            || j.y_norm.is_some_and(|v| v.len != d)
            || !(fits(out) && fits(j.x) && fits(j.h))
        {
            self.try_matmul_many(x, &mut [(w, None, &mut *out)])?;
            j.run(self, out);
            return Ok(());
        }
        // q8_1 blocks of x: attention or the GLU just wrote them, or quantized now
        let (l, xq) = self.l_with_q8(x)?;
        let args = ops::NormJoin {
            x: j.x.buf.ptr,
            y_norm: j.y_norm.map(|v| v.buf.ptr),
            w: j.w.buf.ptr,
            out: j.h.buf.ptr,
            q8: self.scratch(Q8_NORM, n * d / 32 * ops::Q8_1_BYTES)?,
            eps: j.eps,
        };
        let done = self.scratch(NORM_DONE, ops::gemv_norm_done_bytes(n))?;
        let (ptrs, shape) = ((w.buf.ptr, xq, out.buf.ptr), (d, x.cols, n));
        ops::gemv_norm(l, w.ty, ptrs, shape, &args, done)?;
        self.set_q8(j.h, args.q8);
        Ok(())
    }

    pub(super) fn try_matmul_many(
        &self,
        x: &CudaAct,
        jobs: &mut [MatmulJob<'_, Self>],
    ) -> Result<()> {
        let n = x.rows;
        let need_q8 = jobs
            .iter()
            .any(|(w, _, _)| ops::gemv_kernel(w.ty).is_some_and(|(_, q)| q));
        let ready = self.q8_of(x);
        let l = self.l();
        let q8 = if let Some(q8) = ready.filter(|_| need_q8) {
            q8 // a fused norm or GLU just wrote them
        } else if need_q8 {
            if !x.cols.is_multiple_of(32) {
                bail!("matmul input width {} is not a multiple of 32", x.cols);
            }
            let q8 = self.scratch(Q8, n * x.cols / 32 * ops::Q8_1_BYTES)?;
            ops::quantize_q8_1(l, x.buf.ptr, q8, n * x.cols)?;
            q8
        } else {
            0
        };
        for (w, _, out) in jobs.iter() {
            if w.cols != x.cols || out.cols != w.rows || out.rows != n {
                bail!(
                    "matmul shapes: weight {}x{}, input {}x{}, output {}x{}",
                    w.rows,
                    w.cols,
                    n,
                    x.cols,
                    out.rows,
                    out.cols
                );
            }
        }
        // Prefill: tensor-core tiles read the weights n/64 times instead of n/8 (not with
        // row-invariant numerics: a GEMV row's sums do not depend on the other rows).
        let tiled = |w: &CudaWeight| {
            n > ops::GEMV_TOKENS && ops::gemm_kernel(w.ty).is_some() && !self.invariant(n)
        };
        let mut done = vec![false; jobs.len()];
        for i in 0..jobs.len() {
            if done[i] {
                continue;
            }
            let (w, bias, out) = &jobs[i];
            let shape = (w.rows, w.cols, n);
            if tiled(w) {
                ops::gemm(l, w.ty, w.buf.ptr, q8, out.buf.ptr, shape)?;
                if let Some(b) = bias {
                    ops::add_bias(l, out.buf.ptr, b.buf.ptr, n, w.rows)?;
                }
                continue;
            }
            // GEMVs add the bias as they store (one launch fewer per biased matmul), and up to
            // three of one type (Q, K and V; gate and up) go in one launch.
            let group: Vec<usize> = (i..jobs.len())
                .filter(|&j| !done[j] && jobs[j].0.ty == w.ty && !tiled(jobs[j].0))
                .take(ops::GEMV_MULTI)
                .collect();
            if group.len() > 1 && ops::gemv_multi_kernel(w.ty).is_some() {
                let parts: Vec<ops::GemvPart> = group
                    .iter()
                    .map(|&j| {
                        let (w, b, o) = &jobs[j];
                        (w.buf.ptr, o.buf.ptr, b.map(|b| b.buf.ptr), w.rows)
                    })
                    .collect();
                ops::gemv_multi(l, w.ty, q8, &parts, (x.cols, n))?;
                group.iter().for_each(|&j| done[j] = true);
                continue;
            }
            let quantized = ops::gemv_kernel(w.ty).is_some_and(|(_, q)| q);
            let input = if quantized { q8 } else { x.buf.ptr };
            let b = bias.map(|b| b.buf.ptr);
            ops::gemv(l, w.ty, w.buf.ptr, input, out.buf.ptr, b, shape)?;
        }
        Ok(())
    }

    /// `add_rms_norm_q8` over whole rows: with `y`, x += y (normed by its weights first when
    /// given; x is written only then); out = rms_norm(x) * w, and its q8_1 blocks on record for
    /// the next matmul.
    pub(super) fn try_norm(
        &self,
        x: &CudaAct,
        y: Option<(&CudaAct, Option<&CudaVec>)>,
        w: &CudaVec,
        eps: f32,
        out: &mut CudaAct,
    ) -> Result<()> {
        let q8 = self.q8_scratch(x.rows * x.cols, x.cols)?;
        let y = y.map(|(y, yn)| (y.buf.ptr, yn.map(|v| v.buf.ptr)));
        let (x_ptr, shape) = (x.buf.ptr, (x.rows, x.cols));
        ops::add_rms_norm_q8(self.l(), x_ptr, y, w.buf.ptr, out.buf.ptr, q8, shape, eps)?;
        if let Some(q8) = q8 {
            self.set_q8(out, q8);
        }
        Ok(())
    }

    /// [`Backend::attention_block`] in four steps: the Q/K/V products (one quantize of h, if
    /// the norm before did not leave it quantized already), `rope_kv` (q/k norms, RoPE, q's
    /// scale and the KV write, in the cache's types, in one kernel), attention, and the output product.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_attention_block(
        &self,
        h: &CudaAct,
        blk: &AttnBlock<'_, Self>,
        kv: &mut CudaKv,
        layer: usize,
        batch: &AttnBatch<'_, '_>,
        s: AttnScratch<'_, Self>,
        out: &mut CudaAct,
        join: Option<Join<'_, Self>>,
    ) -> Result<()> {
        let sh = batch.shape;
        let r = RopeKv {
            n_head: sh.n_head,
            n_head_kv: sh.n_head_kv,
            head_dim: sh.head_dim,
            base: blk.rope.base,
            style: blk.rope.style,
            ff: blk.rope_freqs.map(|f| f.buf.ptr),
            q_norm: blk.q_norm.map(|v| v.buf.ptr),
            k_norm: blk.k_norm.map(|v| v.buf.ptr),
            eps: blk.norm_eps,
            q_scale: blk.q_scale.unwrap_or(1.0),
        };
        let slots = self.ints(&i32s(batch.slots.iter().copied()))?;
        let pos = self.ints(&i32s(batch.positions.iter().map(|&p| p as usize)))?;
        if !self.try_qkv_rope(h, blk, (kv, layer), &s, &r, (slots, pos))? {
            self.try_matmul_many(
                h,
                &mut [
                    (blk.wq, blk.bq, &mut *s.q),
                    (blk.wk, blk.bk, &mut *s.k),
                    (blk.wv, blk.bv, &mut *s.v),
                ],
            )?;
            ops::rope_kv_typed(
                self.l(),
                (s.q.buf.ptr, s.k.buf.ptr, s.v.buf.ptr),
                (kv.k[layer].ptr, kv.v[layer].ptr),
                (kv.k_type, kv.v_type),
                (slots, pos),
                s.q.rows,
                &r,
            )?;
        }
        self.try_attention(s.q, kv, layer, batch.queries, sh, s.attn)?;
        self.try_matmul_join(s.attn, blk.wo, out, join)
    }

    /// A decode step's Q/K/V products and `rope_kv` in one launch ([`ops::gemv_qkv`]), exactly as
    /// the two steps compute them. False (and nothing done) where it does not apply: more rows
    /// than a GEMV takes, weight types without the kernel, heads not a multiple of 4 wide, widths
    /// not whole q8_1 blocks, or `INFER_CUDA_FUSED_QKV=0`.
    fn try_qkv_rope(
        &self,
        h: &CudaAct,
        blk: &AttnBlock<'_, Self>,
        (kv, layer): (&CudaKv, usize),
        s: &AttnScratch<'_, Self>,
        r: &RopeKv,
        tables: (u64, u64),
    ) -> Result<bool> {
        let (n, hd) = (h.rows, r.head_dim);
        let (qd, kvd) = (r.n_head * hd, r.n_head_kv * hd);
        let ws = [blk.wq, blk.wk, blk.wv];
        let shapes = |a: &CudaAct, cols| (a.rows, a.cols) == (n, cols);
        if !fused_qkv()
            || n > ops::GEMV_TOKENS
            || ops::gemv_qkv_kernel((blk.wq.ty, blk.wk.ty, blk.wv.ty)).is_none()
            || !hd.is_multiple_of(4)
            || !h.cols.is_multiple_of(32)
            || ws.iter().any(|w| w.cols != h.cols)
            || (blk.wq.rows, blk.wk.rows, blk.wv.rows) != (qd, kvd, kvd)
            || !(shapes(s.q, qd) && shapes(s.k, kvd) && shapes(s.v, kvd))
        {
            return Ok(false);
        }
        // q8_1 blocks of h: the norm before attention just wrote them, or quantized now
        let (l, xq) = self.l_with_q8(h)?;
        let heads = r.n_head + r.n_head_kv;
        let done = self.scratch(QKV_DONE, ops::gemv_qkv_done_bytes(heads, n))?;
        let part = |w: &CudaWeight, b: Option<&CudaVec>, o: &CudaAct| {
            (w.buf.ptr, w.ty, b.map(|b| b.buf.ptr), o.buf.ptr)
        };
        let parts = (
            part(blk.wq, blk.bq, s.q),
            part(blk.wk, blk.bk, s.k),
            part(blk.wv, blk.bv, s.v),
        );
        let cache = (kv.k[layer].ptr, kv.v[layer].ptr);
        let types = (kv.k_type, kv.v_type);
        ops::gemv_qkv(l, xq, parts, (h.cols, n), cache, types, tables, r, done)?;
        Ok(true)
    }

    pub(super) fn try_attention(
        &self,
        q: &CudaAct,
        kv: &CudaKv,
        layer: usize,
        queries: &[AttnQuery<'_>],
        shape: AttnShape,
        out: &mut CudaAct,
    ) -> Result<()> {
        let mut tables = Vec::new();
        let mut meta = Vec::with_capacity(queries.len() * 3);
        let mut longest = 1;
        for qr in queries {
            meta.extend([tables.len() as i32, qr.pos as i32, qr.lo as i32]);
            tables.extend(qr.block_table.iter().map(|&b| b as i32));
            longest = longest.max((qr.pos + 1).saturating_sub(qr.lo) as usize);
        }
        let (tables, meta) = (self.ints(&tables)?, self.ints(&meta)?);
        // Rows of one sequence (a prefill chunk, a speculative verify) share K/V loads in the
        // tiled kernel; lone rows (decode, batched decode) use split-KV flash decoding, and so
        // does every row with row-invariant numerics: a split covers the same ATTN_SPLIT keys of
        // a row however many splits the batch's longest row needs, and the merge skips empty
        // splits and scales a lone one by e^0 = 1, so a row's result is its one-row result.
        let tiles = ops::prefill_tiles(queries.len(), |i, j| queries[i].seq == queries[j].seq);
        let tiled = tiles.len() / 2 < queries.len() && !self.invariant(queries.len());
        let n_split = longest.div_ceil(ops::ATTN_SPLIT);
        let part_bytes = ops::attn_part_bytes(queries.len(), shape.n_head, shape.head_dim, n_split);
        let a = AttnArgs {
            q: q.buf.ptr,
            k_cache: kv.k[layer].ptr,
            v_cache: kv.v[layer].ptr,
            tables,
            meta,
            part: if tiled {
                0
            } else {
                self.scratch(PART, part_bytes)?
            },
            out: out.buf.ptr,
            q8: 0,
            n_q: queries.len(),
            n_head: shape.n_head,
            n_head_kv: shape.n_head_kv,
            head_dim: shape.head_dim,
            block_size: kv.block_size,
            kv_dim: kv.kv_dim,
            k_type: kv.k_type,
            v_type: kv.v_type,
            scale: shape.scale,
            n_split,
            done: 0,
        };
        if tiled {
            let tiles_d = self.ints(&tiles)?;
            return ops::attention_prefill(self.l(), &a, tiles_d, tiles.len() / 2);
        }
        // Decode: the kernel writing the output also quantizes it for the output product.
        let q8 = match shape.head_dim.is_multiple_of(32) {
            true => self.q8_scratch(out.rows * out.cols, out.cols)?,
            false => None,
        };
        // Several splits: the block finishing a (row, KV head)'s last split merges them.
        let done = match n_split > 1 && fused_merge() {
            true => self.scratch(
                ATTN_DONE,
                ops::attn_done_bytes(queries.len(), shape.n_head_kv),
            )?,
            false => 0,
        };
        let a = AttnArgs {
            q8: q8.unwrap_or(0),
            done,
            ..a
        };
        ops::attention(self.l(), &a)?;
        if let Some(q8) = q8 {
            self.set_q8(out, q8);
        }
        Ok(())
    }
}
