//! `model::Backend` on a CUDA device (or the emulator): weights uploaded once as stored
//! (quantized, Q6_K rows repacked into aligned planes: `repack`; types without a kernel are
//! dequantized to f16 at load), activations as device f32 matrices, the paged KV cache as f16
//! device blocks (also for `KvType::F32` models), or K and V each in its `--cache-type` (ggml
//! q8_0/q4_0 blocks of rotated values, as the CPU stores them, read in place by the `_q` attention
//! kernels). The host side only sequences kernels (`ops`) through a [`Launch`]; small per-call
//! tables (token ids, positions, KV slots, block tables) are uploaded per call. Errors inside an
//! op cannot be returned through the `Backend` trait and end the process with a message naming
//! the op (a launch fails only for a lost device or a bug). The steps of several kernels
//! (matmuls, the fused sublayer paths) are in `sublayers.rs`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Result};
use half::f16;

use super::launch::{DevBuf, Launch};
use super::ops;
use super::sublayers::Q8Ready;
use crate::format::GgmlType;
use crate::model::backend::{
    attention_block_steps, ffn_dense_steps, then_join, AttnBatch, AttnBlock, AttnQuery,
    AttnScratch, AttnShape, Backend, CacheType, DevicePick, DeviceSampler, DeviceSampling,
    HeadCopy, Join, KvType, MatmulJob, Rope, WeightSource,
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
    /// The types of K's and V's rows (f16 unless the cache is `KvType::Quant`).
    pub k_type: CacheType,
    pub v_type: CacheType,
}

impl CudaKv {
    /// Bytes of one slot's K row and V row.
    pub fn row_bytes(&self) -> (usize, usize) {
        (
            self.k_type.row_bytes(self.kv_dim),
            self.v_type.row_bytes(self.kv_dim),
        )
    }

    fn quantized(&self) -> bool {
        self.k_type.is_quantized() || self.v_type.is_quantized()
    }
}

pub struct CudaBackend {
    pub(super) l: Arc<dyn Launch>,
    /// Grow-only scratch: q8_1 activations, attention partials, sampled rows, and the fused
    /// kernels' outputs and arrival counters (FFN, norm, Q/K/V, attention's merge).
    pub(super) scratch: Mutex<[Option<DevBuf>; 9]>,
    /// The sample table last uploaded to the `SAMPLE` scratch buffer (so an unchanged one is
    /// not uploaded again).
    sample_table: Mutex<Vec<u8>>,
    /// Recently uploaded index tables (positions, KV slots, block tables), most recent first: a
    /// decode step asks for the same tables in every layer, so each is uploaded once per step.
    /// Kernels only read them.
    pub(super) tables: Mutex<Vec<(Vec<i32>, DevBuf)>>,
    /// Counts launches and activation uploads (through [`CudaBackend::l`]): what [`Q8Ready`] was
    /// stamped with is still true while the count has not moved.
    pub(super) epoch: AtomicU64,
    /// The q8_1 blocks a fused kernel (norm, GLU) wrote of its output, for the matmul that reads
    /// that output next (it then skips its own quantize launch).
    pub(super) q8_ready: Mutex<Option<Q8Ready>>,
    /// `Backend::set_row_invariant`: while set, every row of a batch of up to 16 rows takes the
    /// kernels a lone row takes (GEMVs in tiles of 8 rows, split-KV attention), whose sums for a
    /// row do not depend on the others (`sublayers::INVARIANT_ROWS`).
    pub(super) row_invariant: AtomicBool,
}

/// Index tables kept by [`CudaBackend::ints`]; an op uses at most 3, so none it asked for is
/// dropped (and freed before its launch) while it still needs it.
const TABLES: usize = 8;

/// Scratch buffers: q8_1 activations, attention partials, sampled rows (records, windows, ids).
/// Each is grown by reallocation, which zeroes it.
pub(super) const Q8: usize = 0;
pub(super) const PART: usize = 1;
pub(super) const SAMPLE: usize = 2;
/// The fused FFN's q8_1 output (apart from its input's, in `Q8`) and its arrival counters.
pub(super) const Q8_GLU: usize = 3;
pub(super) const GLU_DONE: usize = 4;
/// The fused output product + norm's q8_1 output and arrival counters.
pub(super) const Q8_NORM: usize = 5;
pub(super) const NORM_DONE: usize = 6;
/// The fused Q/K/V products + RoPE's arrival counters.
pub(super) const QKV_DONE: usize = 7;
/// Decode attention's arrival counters (the merge in the last split's block).
pub(super) const ATTN_DONE: usize = 8;

/// Unwraps the result of an op; see the module docs for why this ends the process.
pub(super) fn ok<T>(what: &str, r: Result<T>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("infer: CUDA backend failed in {what}: {e:#}"),
    }
}

pub(super) fn i32s(v: impl IntoIterator<Item = usize>) -> Vec<i32> {
    v.into_iter().map(|x| x as i32).collect()
}

impl CudaBackend {
    pub fn new(l: Arc<dyn Launch>) -> CudaBackend {
        CudaBackend {
            l,
            scratch: Mutex::new(Default::default()),
            sample_table: Mutex::new(Vec::new()),
            tables: Mutex::new(Vec::with_capacity(TABLES)),
            epoch: AtomicU64::new(0),
            q8_ready: Mutex::new(None),
            row_invariant: AtomicBool::new(false),
        }
    }

    /// The launcher, for one op: every launch and upload of an activation goes through here, so
    /// that a fused kernel's q8_1 blocks are known stale once anything else ran (a new activation
    /// at a freed one's address is caught in `act`).
    pub(super) fn l(&self) -> &dyn Launch {
        self.epoch.fetch_add(1, Ordering::Relaxed);
        &*self.l
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
    pub(super) fn scratch(&self, which: usize, bytes: usize) -> Result<u64> {
        let mut s = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if s[which].as_ref().is_none_or(|b| b.bytes < bytes) {
            if which == SAMPLE {
                // The new buffer holds no table yet (even at the old address).
                self.sample_table
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clear();
            }
            s[which] = None; // free first: the old one is not needed any more
            s[which] = Some(DevBuf::new(&self.l, bytes.next_power_of_two())?);
        }
        Ok(s[which].as_ref().map(|b| b.ptr).unwrap_or(0))
    }

    /// The device address of a table holding `v` (see `tables`).
    pub(super) fn ints(&self, v: &[i32]) -> Result<u64> {
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
}

impl Backend for CudaBackend {
    type Weight = CudaWeight;
    type Vector = CudaVec;
    type Act = CudaAct;
    type Kv = CudaKv;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn set_row_invariant(&self, on: bool) {
        self.row_invariant.store(on, Ordering::Relaxed);
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
            // As stored, except Q6_K rows, which the kernels read repacked (`repack`).
            let bytes = super::repack::to_device(src.ty, src.cols, src.bytes);
            let buf = DevBuf::from_bytes(&self.l, &bytes)?;
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
        head_dim: usize,
        kv_type: KvType,
    ) -> Result<CudaKv> {
        let (k_type, v_type) = match kv_type {
            KvType::Quant { k, v } => {
                if !head_dim.is_multiple_of(32) || !kv_dim.is_multiple_of(head_dim) {
                    bail!(
                        "a {} KV cache needs heads of whole 32-value blocks, not {head_dim} \
                         (use --cache-type-k f16 --cache-type-v f16)",
                        kv_type.name()
                    );
                }
                (k, v)
            }
            KvType::F16 | KvType::F32 => (CacheType::F16, CacheType::F16),
        };
        let slots = n_blocks * block_size;
        let (kb, vb) = (k_type.row_bytes(kv_dim), v_type.row_bytes(kv_dim));
        let mut k = Vec::with_capacity(n_layer);
        let mut v = Vec::with_capacity(n_layer);
        for _ in 0..n_layer {
            k.push(DevBuf::new(&self.l, slots * kb)?);
            v.push(DevBuf::new(&self.l, slots * vb)?);
        }
        Ok(CudaKv {
            k,
            v,
            block_size,
            kv_dim,
            k_type,
            v_type,
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

    fn ffn_dense(
        &self,
        h: &CudaAct,
        (gate_w, up_w, down_w): (&CudaWeight, &CudaWeight, &CudaWeight),
        act: Activation,
        gate: &mut CudaAct,
        up: &mut CudaAct,
        out: &mut CudaAct,
        join: Option<Join<'_, Self>>,
    ) {
        // Decode: gate, up and the GLU in one launch where it applies, then the down product with
        // the join (sublayers.rs).
        if ok(
            "ffn",
            self.try_gate_up_glu(h, (gate_w, up_w), act, gate, up),
        ) {
            ok("ffn", self.try_matmul_join(gate, down_w, out, join));
        } else {
            ffn_dense_steps(self, h, (gate_w, up_w, down_w), act, gate, up, out);
            then_join(self, join, out)
        }
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
        join: Option<Join<'_, Self>>,
    ) {
        let hd = batch.shape.head_dim;
        if !hd.is_multiple_of(2) || hd > ops::ATTN_MAX_HD || blk.rope.head_dim != hd {
            attention_block_steps(self, h, blk, kv, layer, batch, s, out);
            return then_join(self, join, out);
        }
        ok(
            "attention_block",
            self.try_attention_block(h, blk, kv, layer, batch, s, out, join),
        )
    }

    fn kv_copy_blocks(&self, kv: &mut CudaKv, pairs: &[(u32, u32)]) {
        // Through the host: copy-on-write is rare (a forked or cache-shared partial block), and
        // the launch interface has no device-to-device copy. A block of a plane is block_size rows
        // of its type (quantized rows included: bytes are bytes).
        let (kb, vb) = kv.row_bytes();
        let planes = (kv.k.iter().map(|p| (p, kb))).chain(kv.v.iter().map(|p| (p, vb)));
        let mut buf = Vec::new();
        for (plane, row) in planes {
            let n = kv.block_size * row;
            buf.resize(n, 0u8);
            for &(from, to) in pairs {
                let (from, to) = (from as u64 * n as u64, to as u64 * n as u64);
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
                let (rows, n) = ((k.buf.ptr, v.buf.ptr), slots.len());
                match kv.quantized() {
                    true => {
                        let types = (kv.k_type, kv.v_type);
                        ops::kv_write_q(self.l(), caches, rows, s, n, kv.kv_dim, types)
                    }
                    false => ops::kv_write(self.l(), caches, rows, s, n, kv.kv_dim),
                }
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

    fn device_sampler(&self, s: &DeviceSampling) -> Option<DeviceSampler> {
        let rng: Vec<u8> = s.rng.iter().flat_map(|v| v.to_le_bytes()).collect();
        let state = (|| -> Result<CudaSampler> {
            Ok(CudaSampler {
                s: s.clone(),
                rng: DevBuf::from_bytes(&self.l, &rng)?,
            })
        })();
        match state {
            Ok(state) => Some(DeviceSampler(Box::new(state))),
            Err(e) => {
                eprintln!("infer: sampling on the host ({e:#})");
                None
            }
        }
    }

    fn sample_on_device(
        &self,
        logits: &mut CudaAct,
        picks: &mut [DevicePick<'_>],
    ) -> Result<Vec<u32>> {
        let n = logits.cols;
        let mut rows = Vec::with_capacity(picks.len());
        for p in picks.iter() {
            let cs = p
                .sampler
                .0
                .downcast_ref::<CudaSampler>()
                .ok_or_else(|| anyhow::anyhow!("a device sampler of another backend"))?;
            anyhow::ensure!(
                p.row < logits.rows,
                "sampling row {} of {} logits rows",
                p.row,
                logits.rows
            );
            rows.push(ops::SampleRow {
                row: p.row,
                rng: cs.rng.ptr,
                window: p.window,
                s: &cs.s,
            });
        }
        // At most one upload of the rows' records and windows (none when they are the last
        // step's), one launch, one download of the ids.
        let need = ops::sample_table_bytes(&rows);
        let table = self.scratch(SAMPLE, need + 4 * rows.len())?;
        let out = table + need as u64; // after the table: the kernel never writes the table
        let mut last = self.sample_table.lock().unwrap_or_else(|p| p.into_inner());
        ops::sample(self.l(), &rows, table, &mut last, logits.buf.ptr, n, out)?;
        drop(last);
        let mut ids = vec![0u8; 4 * rows.len()];
        self.l.download(out, &mut ids)?;
        Ok(ids
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect())
    }

    fn device_sampler_rng(&self, sampler: &DeviceSampler) -> Result<[u64; 4]> {
        let cs = sampler
            .0
            .downcast_ref::<CudaSampler>()
            .ok_or_else(|| anyhow::anyhow!("a device sampler of another backend"))?;
        let mut b = [0u8; 32];
        self.l.download(cs.rng.ptr, &mut b)?;
        Ok(std::array::from_fn(|i| {
            u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
        }))
    }
}

/// [`CudaBackend`]'s device sampler: the kernel's parameters and the RNG state (4 u64, in device
/// memory; a step's rows, windows and ids go through the backend's sample scratch).
struct CudaSampler {
    s: DeviceSampling,
    rng: DevBuf,
}
