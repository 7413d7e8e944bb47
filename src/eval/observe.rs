//! A backend that watches matmul inputs: [`Observed`] wraps any [`Backend`], delegates every
//! operation to it unchanged, and before each matmul adds the input activation's squares to an
//! importance-matrix [`Collector`] under the weight's tensor name. This is the imatrix hook: it
//! lives outside the forward loop and the kernels, so a model that is not being observed runs
//! exactly as before, with no check on its path. Outputs are bit-identical to the wrapped
//! backend's (only reads of the input are added).
//!
//! A weight's slot is its expert when the tensor is 3-D (`[cols, rows, n_expert]`: experts are
//! loaded as row ranges of it), else 0. Tensors outside the transformer blocks (the output head,
//! a tied embedding used as head) are not collected.

use std::sync::{Mutex, MutexGuard};

use anyhow::Result;

use crate::eval::imatrix::{collects, Collector, Imatrix};
use crate::model::backend::{
    AttnQuery, AttnShape, Backend, HeadCopy, KvType, MatmulJob, Rope, WeightSource,
};
use crate::model::config::Activation;

/// A weight of the wrapped backend and its collector tag (None: not collected).
pub struct Tagged<W> {
    pub inner: W,
    tag: Option<usize>,
}

/// `B` with its matmul inputs collected.
pub struct Observed<B: Backend> {
    pub inner: B,
    collector: Mutex<Collector>,
}

impl<B: Backend> Observed<B> {
    pub fn new(inner: B) -> Observed<B> {
        Observed {
            inner,
            collector: Mutex::new(Collector::default()),
        }
    }

    fn collector(&self) -> MutexGuard<'_, Collector> {
        self.collector.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The importance matrix of everything observed (see [`Collector::finish`]); the collector
    /// is emptied, so call it once, after the last forward.
    pub fn finish(&self, chunk_size: usize, chunks: u32, dataset: &str) -> Imatrix {
        std::mem::take(&mut *self.collector()).finish(chunk_size, chunks, dataset)
    }

    fn observe(&self, w: &Tagged<B::Weight>, x: &B::Act) {
        if let Some(tag) = w.tag {
            if self.inner.rows(x) > 0 {
                let host = self.inner.to_host(x);
                self.collector().add(tag, &host);
            }
        }
    }
}

/// Which expert (slot) of how many a weight view is.
fn slot_of(src: &WeightSource<'_>) -> (usize, usize) {
    let t = &src.file.tensors[src.index];
    let dims: Vec<u64> = t.dims.clone();
    if dims.len() < 3 || dims[2] <= 1 {
        return (0, 1);
    }
    let data = src.file.tensor_data(t);
    let row_bytes = src.bytes.len() / src.rows.max(1);
    let first_row = (src.bytes.as_ptr() as usize - data.as_ptr() as usize) / row_bytes.max(1);
    (first_row / dims[1] as usize, dims[2] as usize)
}

impl<B: Backend> Backend for Observed<B> {
    type Weight = Tagged<B::Weight>;
    type Vector = B::Vector;
    type Act = B::Act;
    type Kv = B::Kv;

    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn set_row_invariant(&self, on: bool) {
        self.inner.set_row_invariant(on)
    }
    fn load_weight(&self, src: &WeightSource<'_>) -> Result<Self::Weight> {
        let inner = self.inner.load_weight(src)?;
        let tag = collects(src.name).then(|| {
            let (slot, n_slots) = slot_of(src);
            self.collector().tag(src.name, src.cols, slot, n_slots)
        });
        Ok(Tagged { inner, tag })
    }
    fn load_vector(&self, data: &[f32]) -> Result<Self::Vector> {
        self.inner.load_vector(data)
    }
    fn alloc_kv(
        &self,
        n_layer: usize,
        n_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        head_dim: usize,
        kv_type: KvType,
    ) -> Result<Self::Kv> {
        self.inner
            .alloc_kv(n_layer, n_blocks, block_size, kv_dim, head_dim, kv_type)
    }
    fn act(&self, rows: usize, cols: usize) -> Self::Act {
        self.inner.act(rows, cols)
    }
    fn rows(&self, x: &Self::Act) -> usize {
        self.inner.rows(x)
    }
    fn embed(&self, table: &Self::Weight, tokens: &[u32], scale: f32, out: &mut Self::Act) {
        self.inner.embed(&table.inner, tokens, scale, out)
    }
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32, out: &mut Self::Act) {
        self.inner.rms_norm(x, w, eps, out)
    }
    fn rms_norm_inplace(&self, x: &mut Self::Act, w: &Self::Vector, eps: f32) {
        self.inner.rms_norm_inplace(x, w, eps)
    }
    fn matmul(
        &self,
        w: &Self::Weight,
        x: &Self::Act,
        bias: Option<&Self::Vector>,
        out: &mut Self::Act,
    ) {
        self.observe(w, x);
        self.inner.matmul(&w.inner, x, bias, out)
    }
    fn matmul_many(&self, x: &Self::Act, jobs: &mut [MatmulJob<'_, Self>]) {
        if jobs.iter().any(|j| j.0.tag.is_some()) && self.inner.rows(x) > 0 {
            let host = self.inner.to_host(x);
            let mut c = self.collector();
            for tag in jobs.iter().filter_map(|j| j.0.tag) {
                c.add(tag, &host);
            }
        }
        let mut inner: Vec<MatmulJob<'_, B>> = jobs
            .iter_mut()
            .map(|(w, b, o)| (&w.inner, *b, &mut **o))
            .collect();
        self.inner.matmul_many(x, &mut inner)
    }
    fn rope(
        &self,
        x: &mut Self::Act,
        positions: &[u32],
        rope: Rope,
        freq_factors: Option<&Self::Vector>,
    ) {
        self.inner.rope(x, positions, rope, freq_factors)
    }
    fn scale(&self, x: &mut Self::Act, s: f32) {
        self.inner.scale(x, s)
    }
    fn add(&self, x: &mut Self::Act, y: &Self::Act) {
        self.inner.add(x, y)
    }
    fn glu(&self, gate: &mut Self::Act, up: &Self::Act, act: Activation) {
        self.inner.glu(gate, up, act)
    }
    fn kv_copy_blocks(&self, kv: &mut Self::Kv, pairs: &[(u32, u32)]) {
        self.inner.kv_copy_blocks(kv, pairs)
    }
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        k: &Self::Act,
        v: &Self::Act,
        slots: &[usize],
    ) {
        self.inner.kv_write(kv, layer, k, v, slots)
    }
    fn attention(
        &self,
        q: &Self::Act,
        kv: &Self::Kv,
        layer: usize,
        queries: &[AttnQuery<'_>],
        shape: AttnShape,
        out: &mut Self::Act,
    ) {
        self.inner.attention(q, kv, layer, queries, shape, out)
    }
    fn add_rows_scaled(&self, x: &mut Self::Act, y: &Self::Act, rows: &[usize], scales: &[f32]) {
        self.inner.add_rows_scaled(x, y, rows, scales)
    }
    fn copy_heads(&self, src: &Self::Act, dst: &mut Self::Act, c: HeadCopy) {
        self.inner.copy_heads(src, dst, c)
    }
    fn gather_rows(&self, x: &Self::Act, rows: &[usize]) -> Self::Act {
        self.inner.gather_rows(x, rows)
    }
    fn to_host(&self, x: &Self::Act) -> Vec<f32> {
        self.inner.to_host(x)
    }
    fn take_host(&self, x: Self::Act) -> Vec<f32> {
        self.inner.take_host(x)
    }
}
