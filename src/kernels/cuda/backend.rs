//! `model::Backend` on a CUDA device (or the emulator): weights uploaded once as stored
//! (quantized; types without a kernel are dequantized to f16 at load), activations as device f32
//! matrices, the paged KV cache as f16 device blocks (also for `KvType::F32` models). The host side
//! only sequences kernels (`ops`) through a [`Launch`]; small per-call tables (token ids,
//! positions, KV slots, block tables) are uploaded per call. Errors inside an op cannot be returned
//! through the `Backend` trait and end the process with a message naming the op (a launch fails
//! only for a lost device or a bug).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use half::f16;

use super::launch::{DevBuf, Launch};
use super::ops::{self, AttnArgs, RopeKv};
use crate::format::GgmlType;
use crate::model::backend::{
    attention_block_steps, AttnBatch, AttnBlock, AttnQuery, AttnScratch, AttnShape, Backend,
    HeadCopy, KvType, MatmulJob, Rope, WeightSource,
};
use crate::model::config::Activation;

pub struct CudaWeight {
    pub buf: DevBuf,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

pub struct CudaVec {
    pub buf: DevBuf,
    pub len: usize,
}

pub struct CudaAct {
    pub buf: DevBuf,
    pub rows: usize,
    pub cols: usize,
}

pub struct CudaKv {
    pub k: Vec<DevBuf>,
    pub v: Vec<DevBuf>,
    pub block_size: usize,
    pub kv_dim: usize,
}

pub struct CudaBackend {
    l: Arc<dyn Launch>,
    /// Grow-only scratch: q8_1 activations and attention partials.
    scratch: Mutex<[Option<DevBuf>; 2]>,
    /// Recently uploaded index tables (positions, KV slots, block tables), most recent first: a
    /// decode step asks for the same tables in every layer, so each is uploaded once per step.
    /// Kernels only read them.
    tables: Mutex<Vec<(Vec<i32>, DevBuf)>>,
    /// Counts launches and activation uploads (through [`CudaBackend::l`]): what [`Q8Ready`] was
    /// stamped with is still true while the count has not moved.
    epoch: AtomicU64,
    /// The q8_1 blocks a fused kernel (norm, GLU) wrote of its output, for the matmul that reads
    /// that output next (it then skips its own quantize launch).
    q8_ready: Mutex<Option<Q8Ready>>,
}

/// q8_1 blocks of an activation, valid while [`CudaBackend::epoch`] equals `epoch`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Q8Ready {
    act: u64,
    values: usize,
    q8: u64,
    epoch: u64,
}

/// Index tables kept by [`CudaBackend::ints`]; an op uses at most 3, so none it asked for is
/// dropped (and freed before its launch) while it still needs it.
const TABLES: usize = 8;

const Q8: usize = 0;
const PART: usize = 1;

/// Unwraps the result of an op; see the module docs for why this ends the process.
fn ok<T>(what: &str, r: Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("infer: CUDA backend failed in {what}: {e:#}"),
    }
}

fn i32s(v: impl IntoIterator<Item = usize>) -> Vec<i32> {
    v.into_iter().map(|x| x as i32).collect()
}

impl CudaBackend {
    pub fn new(l: Arc<dyn Launch>) -> CudaBackend {
        CudaBackend {
            l,
            scratch: Mutex::new([None, None]),
            tables: Mutex::new(Vec::with_capacity(TABLES)),
            epoch: AtomicU64::new(0),
            q8_ready: Mutex::new(None),
        }
    }

    /// The launcher, for one op: every launch and upload of an activation goes through here, so
    /// that a fused kernel's q8_1 blocks are known stale once anything else ran (a new activation
    /// at a freed one's address is caught in `act`).
    fn l(&self) -> &dyn Launch {
        self.epoch.fetch_add(1, Ordering::Relaxed);
        &*self.l
    }

    /// Records that `q8` holds the q8_1 blocks of `a` (just written by the last launch).
    fn set_q8(&self, a: &CudaAct, q8: u64) {
        let r = Q8Ready {
            act: a.buf.ptr,
            values: a.rows * a.cols,
            q8,
            epoch: self.epoch.load(Ordering::Relaxed),
        };
        *self.q8_ready.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
    }

    /// The q8_1 blocks of `x` if the last launch wrote them and nothing ran since.
    fn q8_of(&self, x: &CudaAct) -> Option<u64> {
        let r = self
            .q8_ready
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()?;
        let now = self.epoch.load(Ordering::Relaxed);
        (r.act == x.buf.ptr && r.values == x.rows * x.cols && r.epoch == now).then_some(r.q8)
    }

    /// q8_1 scratch for `values` activations (a multiple of 32), or None if they cannot be.
    fn q8_scratch(&self, values: usize, cols: usize) -> Result<Option<u64>> {
        if !cols.is_multiple_of(32) {
            return Ok(None);
        }
        Ok(Some(self.scratch(Q8, values / 32 * ops::Q8_1_BYTES)?))
    }

    pub fn launcher(&self) -> &Arc<dyn Launch> {
        &self.l
    }

    /// Overwrites `a` with host rows (`a.rows * a.cols` values).
    pub fn upload(&self, a: &mut CudaAct, data: &[f32]) {
        assert_eq!(data.len(), a.rows * a.cols, "upload: shape");
        let bytes = super::launch::f32_bytes(data);
        ok(
            "uploading an activation",
            self.l().upload(a.buf.ptr, &bytes),
        )
    }

    /// Device memory bandwidth in bytes/s (read + written), for `infer bench`: one `scale` pass
    /// over `buf` (every value read and written once), timed between two stream syncs.
    pub fn stream_bandwidth(&self, buf: &DevBuf) -> Result<f64> {
        self.l.sync()?;
        let t0 = std::time::Instant::now();
        ops::scale(self.l(), buf.ptr, 1.0, buf.bytes / 4)?;
        self.l.sync()?;
        Ok(2.0 * buf.bytes as f64 / t0.elapsed().as_secs_f64())
    }

    /// A device address of scratch buffer `which` holding at least `bytes`.
    fn scratch(&self, which: usize, bytes: usize) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if s[which].as_ref().is_none_or(|b| b.bytes < bytes) {
            s[which] = None; // free first: the old one is not needed any more
            s[which] = Some(DevBuf::new(&self.l, bytes.next_power_of_two())?);
        }
        Ok(s[which].as_ref().map(|b| b.ptr).unwrap_or(0))
    }

    /// The device address of a table holding `v` (see `tables`).
    fn ints(&self, v: &[i32]) -> Result<u64> {
        let v = if v.is_empty() { &[0][..] } else { v };
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = t.iter().position(|(k, _)| k == v) {
            let hit = t.remove(i);
            t.insert(0, hit);
        } else {
            t.truncate(TABLES - 1);
            t.insert(0, (v.to_vec(), DevBuf::from_i32(&self.l, v)?));
        }
        Ok(t[0].1.ptr)
    }

    fn try_matmul_many(&self, x: &CudaAct, jobs: &mut [MatmulJob<'_, Self>]) -> Result<()> {
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
        // Prefill: tensor-core tiles read the weights n/64 times instead of n/8.
        let tiled = |w: &CudaWeight| n > ops::GEMV_TOKENS && ops::gemm_kernel(w.ty).is_some();
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
    fn try_norm(
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
    /// scale and the KV write in one kernel), attention, and the output product.
    #[allow(clippy::too_many_arguments)]
    fn try_attention_block(
        &self,
        h: &CudaAct,
        blk: &AttnBlock<'_, Self>,
        kv: &mut CudaKv,
        layer: usize,
        batch: &AttnBatch<'_, '_>,
        s: AttnScratch<'_, Self>,
        out: &mut CudaAct,
    ) -> Result<()> {
        self.try_matmul_many(
            h,
            &mut [
                (blk.wq, blk.bq, &mut *s.q),
                (blk.wk, blk.bk, &mut *s.k),
                (blk.wv, blk.bv, &mut *s.v),
            ],
        )?;
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
        ops::rope_kv(
            self.l(),
            (s.q.buf.ptr, s.k.buf.ptr, s.v.buf.ptr),
            (kv.k[layer].ptr, kv.v[layer].ptr),
            (slots, pos),
            s.q.rows,
            &r,
        )?;
        self.try_attention(s.q, kv, layer, batch.queries, sh, s.attn)?;
        self.try_matmul_many(s.attn, &mut [(blk.wo, None, out)])
    }

    fn try_attention(
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
        // tiled kernel; lone rows (decode, batched decode) use split-KV flash decoding.
        let tiles = ops::prefill_tiles(queries.len(), |i, j| queries[i].seq == queries[j].seq);
        let tiled = tiles.len() / 2 < queries.len();
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
            scale: shape.scale,
            n_split,
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
        let a = AttnArgs {
            q8: q8.unwrap_or(0),
            ..a
        };
        ops::attention(self.l(), &a)?;
        if let Some(q8) = q8 {
            self.set_q8(out, q8);
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Weight = CudaWeight;
    type Vector = CudaVec;
    type Act = CudaAct;
    type Kv = CudaKv;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn load_weight(&self, src: &WeightSource<'_>) -> Result<CudaWeight> {
        let Some(row_bytes) = src.ty.row_bytes(src.cols) else {
            bail!(
                "`{}`: row length {} does not fit {}",
                src.name,
                src.cols,
                src.ty.name()
            );
        };
        if row_bytes * src.rows != src.bytes.len() {
            bail!(
                "`{}`: {} bytes for a {}x{} {}",
                src.name,
                src.bytes.len(),
                src.rows,
                src.cols,
                src.ty.name()
            );
        }
        if ops::gemv_kernel(src.ty).is_some() {
            let buf = DevBuf::from_bytes(&self.l, src.bytes)?;
            return Ok(CudaWeight {
                buf,
                ty: src.ty,
                rows: src.rows,
                cols: src.cols,
            });
        }
        // No kernel for this type: dequantize once to f16.
        let mut row = vec![0f32; src.cols];
        let mut bytes = Vec::with_capacity(src.rows * src.cols * 2);
        for r in src.bytes.chunks_exact(row_bytes) {
            crate::quant::dequantize_row(src.ty, r, &mut row)?;
            bytes.extend(row.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()));
        }
        let buf = DevBuf::from_bytes(&self.l, &bytes)?;
        Ok(CudaWeight {
            buf,
            ty: GgmlType::F16,
            rows: src.rows,
            cols: src.cols,
        })
    }

    fn load_vector(&self, data: &[f32]) -> Result<CudaVec> {
        Ok(CudaVec {
            buf: DevBuf::from_f32(&self.l, data)?,
            len: data.len(),
        })
    }

    fn alloc_kv(
        &self,
        n_layer: usize,
        n_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        _kv_type: KvType,
    ) -> Result<CudaKv> {
        let bytes = n_blocks * block_size * kv_dim * 2;
        let mut k = Vec::with_capacity(n_layer);
        let mut v = Vec::with_capacity(n_layer);
        for _ in 0..n_layer {
            k.push(DevBuf::new(&self.l, bytes)?);
            v.push(DevBuf::new(&self.l, bytes)?);
        }
        Ok(CudaKv {
            k,
            v,
            block_size,
            kv_dim,
        })
    }

    fn act(&self, rows: usize, cols: usize) -> CudaAct {
        let buf = ok(
            "allocating an activation",
            DevBuf::new(&self.l, rows * cols * 4),
        );
        // The activation whose q8_1 blocks are on record was freed if this one took its place.
        let mut r = self.q8_ready.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_some_and(|r| r.act == buf.ptr) {
            *r = None;
        }
        drop(r);
        CudaAct { buf, rows, cols }
    }

    fn rows(&self, x: &CudaAct) -> usize {
        x.rows
    }

    fn embed(&self, table: &CudaWeight, tokens: &[u32], scale: f32, out: &mut CudaAct) {
        ok(
            "embed",
            (|| {
                let ids = self.ints(&i32s(tokens.iter().map(|&t| t as usize)))?;
                ops::get_rows(
                    self.l(),
                    table.ty,
                    table.buf.ptr,
                    ids,
                    out.buf.ptr,
                    (tokens.len(), table.cols),
                    scale,
                )
            })(),
        )
    }

    fn rms_norm(&self, x: &CudaAct, w: &CudaVec, eps: f32, out: &mut CudaAct) {
        if w.len == x.cols {
            // A whole row: the fused kernel, which also quantizes it for the next matmul.
            return ok("rms_norm", self.try_norm(x, None, w, eps, out));
        }
        let groups = x.rows * x.cols / w.len;
        ok(
            "rms_norm",
            ops::rms_norm(
                self.l(),
                x.buf.ptr,
                w.buf.ptr,
                out.buf.ptr,
                groups,
                w.len,
                eps,
            ),
        )
    }

    fn add_rms_norm(
        &self,
        x: &mut CudaAct,
        y: &mut CudaAct,
        y_norm: Option<&CudaVec>,
        w: &CudaVec,
        eps: f32,
        out: &mut CudaAct,
    ) {
        assert_eq!(
            (x.rows, x.cols),
            (y.rows, y.cols),
            "add_rms_norm: shapes differ"
        );
        if w.len != x.cols {
            if let Some(yn) = y_norm {
                self.rms_norm_inplace(y, yn, eps);
            }
            self.add(x, y);
            return self.rms_norm(x, w, eps, out);
        }
        ok(
            "add_rms_norm",
            self.try_norm(x, Some((y, y_norm)), w, eps, out),
        )
    }

    fn rms_norm_inplace(&self, x: &mut CudaAct, w: &CudaVec, eps: f32) {
        let groups = x.rows * x.cols / w.len;
        ok(
            "rms_norm",
            ops::rms_norm(
                self.l(),
                x.buf.ptr,
                w.buf.ptr,
                x.buf.ptr,
                groups,
                w.len,
                eps,
            ),
        )
    }

    fn matmul(&self, w: &CudaWeight, x: &CudaAct, bias: Option<&CudaVec>, out: &mut CudaAct) {
        self.matmul_many(x, &mut [(w, bias, out)]);
    }

    fn matmul_many(&self, x: &CudaAct, jobs: &mut [MatmulJob<'_, Self>]) {
        ok("matmul", self.try_matmul_many(x, jobs))
    }

    fn rope(&self, x: &mut CudaAct, positions: &[u32], rope: Rope, ff: Option<&CudaVec>) {
        ok(
            "rope",
            (|| {
                let pos = self.ints(&i32s(positions.iter().map(|&p| p as usize)))?;
                let ff = ff.map(|f| f.buf.ptr);
                ops::rope(
                    self.l(),
                    x.buf.ptr,
                    pos,
                    ff,
                    (x.rows, x.cols),
                    rope.head_dim,
                    rope.base,
                    rope.style,
                )
            })(),
        )
    }

    fn scale(&self, x: &mut CudaAct, s: f32) {
        ok("scale", ops::scale(self.l(), x.buf.ptr, s, x.rows * x.cols))
    }

    fn add(&self, x: &mut CudaAct, y: &CudaAct) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add: shapes differ");
        ok(
            "add",
            ops::add(self.l(), x.buf.ptr, y.buf.ptr, x.rows * x.cols),
        )
    }

    fn glu(&self, gate: &mut CudaAct, up: &CudaAct, act: Activation) {
        ok(
            "glu",
            (|| {
                let n = gate.rows * gate.cols;
                match self.q8_scratch(n, gate.cols)? {
                    Some(q8) => {
                        ops::glu_q8(self.l(), gate.buf.ptr, up.buf.ptr, q8, n, act)?;
                        self.set_q8(gate, q8);
                        Ok(())
                    }
                    None => ops::glu(self.l(), gate.buf.ptr, up.buf.ptr, n, act),
                }
            })(),
        )
    }

    fn attention_block(
        &self,
        h: &CudaAct,
        blk: &AttnBlock<'_, Self>,
        kv: &mut CudaKv,
        layer: usize,
        batch: &AttnBatch<'_, '_>,
        s: AttnScratch<'_, Self>,
        out: &mut CudaAct,
    ) {
        let hd = batch.shape.head_dim;
        if !hd.is_multiple_of(2) || hd > ops::ATTN_MAX_HD || blk.rope.head_dim != hd {
            return attention_block_steps(self, h, blk, kv, layer, batch, s, out);
        }
        ok(
            "attention_block",
            self.try_attention_block(h, blk, kv, layer, batch, s, out),
        )
    }

    fn kv_copy_blocks(&self, kv: &mut CudaKv, pairs: &[(u32, u32)]) {
        // Through the host: copy-on-write is rare (a forked or cache-shared partial block), and
        // the launch interface has no device-to-device copy.
        let n = kv.block_size * kv.kv_dim * 2;
        let mut buf = vec![0u8; n];
        for &(from, to) in pairs {
            let (from, to) = (from as u64 * n as u64, to as u64 * n as u64);
            for plane in kv.k.iter().chain(kv.v.iter()) {
                ok(
                    "kv_copy_blocks",
                    self.l
                        .download(plane.ptr + from, &mut buf)
                        .and_then(|()| self.l.upload(plane.ptr + to, &buf)),
                );
            }
        }
    }

    fn kv_write(&self, kv: &mut CudaKv, layer: usize, k: &CudaAct, v: &CudaAct, slots: &[usize]) {
        ok(
            "kv_write",
            (|| {
                let s = self.ints(&i32s(slots.iter().copied()))?;
                let caches = (kv.k[layer].ptr, kv.v[layer].ptr);
                ops::kv_write(
                    self.l(),
                    caches,
                    (k.buf.ptr, v.buf.ptr),
                    s,
                    slots.len(),
                    kv.kv_dim,
                )
            })(),
        )
    }

    fn attention(
        &self,
        q: &CudaAct,
        kv: &CudaKv,
        layer: usize,
        queries: &[AttnQuery<'_>],
        shape: AttnShape,
        out: &mut CudaAct,
    ) {
        ok(
            "attention",
            self.try_attention(q, kv, layer, queries, shape, out),
        )
    }

    fn add_rows_scaled(&self, x: &mut CudaAct, y: &CudaAct, rows: &[usize], scales: &[f32]) {
        if rows.is_empty() {
            return;
        }
        ok(
            "add_rows_scaled",
            (|| {
                let r = self.ints(&i32s(rows.iter().copied()))?;
                let s = DevBuf::from_f32(&self.l, scales)?;
                ops::add_rows_scaled(self.l(), x.buf.ptr, y.buf.ptr, r, s.ptr, rows.len(), x.cols)
            })(),
        )
    }

    fn copy_heads(&self, src: &CudaAct, dst: &mut CudaAct, c: HeadCopy) {
        ok(
            "copy_heads",
            ops::copy_heads(
                self.l(),
                src.buf.ptr,
                dst.buf.ptr,
                src.rows,
                (src.cols, dst.cols),
                c,
            ),
        )
    }

    fn gather_rows(&self, x: &CudaAct, rows: &[usize]) -> CudaAct {
        let out = self.act(rows.len(), x.cols);
        if !rows.is_empty() {
            ok(
                "gather_rows",
                (|| {
                    let idx = self.ints(&i32s(rows.iter().copied()))?;
                    ops::gather_rows(self.l(), x.buf.ptr, idx, out.buf.ptr, rows.len(), x.cols)
                })(),
            );
        }
        out
    }

    fn to_host(&self, x: &CudaAct) -> Vec<f32> {
        let mut v = ok("reading results", x.buf.to_f32());
        v.truncate(x.rows * x.cols);
        v
    }
}
