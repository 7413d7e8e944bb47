//! The backend the CLI runs: the CPU backend, plus optionally the CUDA backend for the first
//! `gpu_layers` transformer layers (llama.cpp's `-ngl`; with every layer, the embedding table and
//! output head too). A weight lives on the device of its layer (from its `blk.N.` name); norm
//! vectors are tiny and live on both. Each op runs where its weight or KV layer lives, else where
//! its main input lives; an input on the other device is copied over for the op, and an in-place
//! target or an output buffer is moved (once: the residual stream crosses at the layer boundary
//! and stays). With no CUDA layers this is the CPU backend plus one match per op.

use std::ops::Deref;

use anyhow::Result;

use crate::kernels::cpu::backend::{CpuAct, CpuBackend, CpuKv, CpuWeight};
use crate::kernels::cuda::backend::{CudaAct, CudaBackend, CudaKv, CudaVec, CudaWeight};
use crate::model::backend::{
    attention_block_steps, ffn_dense_steps, then_join, AttnBatch, AttnBlock, AttnQuery,
    AttnScratch, AttnShape, Backend, DevicePick, DeviceSampler, DeviceSampling, HeadCopy, Join,
    KvType, MatmulJob, Rope, WeightSource,
};
use crate::model::config::Activation;

pub struct DeviceBackend {
    pub cpu: CpuBackend,
    pub cuda: Option<CudaBackend>,
    /// Layers `0..gpu_layers` run on CUDA (0 without CUDA).
    pub gpu_layers: usize,
    pub n_layer: usize,
}

pub enum DevWeight {
    Cpu(CpuWeight),
    Cuda(CudaWeight),
}

/// A norm vector or bias: on the host always, on the GPU too when CUDA is used.
pub struct DevVec {
    host: Vec<f32>,
    gpu: Option<CudaVec>,
}

pub enum DevAct {
    Cpu(CpuAct),
    Cuda(CudaAct),
}

pub struct DevKv {
    cpu: Option<CpuKv>,
    cuda: Option<CudaKv>,
}

/// A borrowed value or a converted copy.
enum Held<'a, T> {
    B(&'a T),
    O(T),
}

impl<T> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match self {
            Held::B(t) => t,
            Held::O(t) => t,
        }
    }
}

/// The layer a tensor name belongs to (`blk.N.…`), if any.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

impl DeviceBackend {
    pub fn cpu_only(cpu: CpuBackend) -> DeviceBackend {
        DeviceBackend {
            cpu,
            cuda: None,
            gpu_layers: 0,
            n_layer: 0,
        }
    }

    /// CUDA for layers `0..gpu_layers` (clamped to `n_layer`) of an `n_layer`-layer model.
    pub fn hybrid(
        cpu: CpuBackend,
        cuda: CudaBackend,
        gpu_layers: usize,
        n_layer: usize,
    ) -> DeviceBackend {
        let gpu_layers = gpu_layers.min(n_layer);
        DeviceBackend {
            cpu,
            cuda: Some(cuda),
            gpu_layers,
            n_layer,
        }
    }

    fn on_gpu(&self, layer: Option<usize>) -> bool {
        self.cuda.is_some()
            && match layer {
                Some(l) => l < self.gpu_layers,
                None => self.gpu_layers >= self.n_layer,
            }
    }

    fn gpu(&self) -> &CudaBackend {
        self.cuda
            .as_ref()
            .expect("a CUDA value exists only with a CUDA backend")
    }

    fn to_gpu<'a>(&self, a: &'a DevAct) -> Held<'a, CudaAct> {
        match a {
            DevAct::Cuda(x) => Held::B(x),
            DevAct::Cpu(x) => {
                let mut y = self.gpu().act(x.rows, x.cols);
                self.gpu().upload(&mut y, &x.data);
                Held::O(y)
            }
        }
    }

    fn to_cpu<'a>(&self, a: &'a DevAct) -> Held<'a, CpuAct> {
        match a {
            DevAct::Cpu(x) => Held::B(x),
            DevAct::Cuda(x) => Held::O(CpuAct {
                data: self.gpu().to_host(x),
                rows: x.rows,
                cols: x.cols,
            }),
        }
    }

    /// Moves `a` (contents included) to the GPU or the CPU.
    fn place(&self, a: &mut DevAct, gpu: bool) {
        let moved = match (&*a, gpu) {
            (DevAct::Cpu(_), true) => DevAct::Cuda(match self.to_gpu(a) {
                Held::O(y) => y,
                Held::B(_) => unreachable!(),
            }),
            (DevAct::Cuda(_), false) => DevAct::Cpu(match self.to_cpu(a) {
                Held::O(y) => y,
                Held::B(_) => unreachable!(),
            }),
            _ => return,
        };
        *a = moved;
    }

    /// `out` as a GPU (or CPU) buffer of the same shape; contents are not kept.
    fn out_gpu<'a>(&self, out: &'a mut DevAct) -> &'a mut CudaAct {
        if let DevAct::Cpu(x) = out {
            *out = DevAct::Cuda(self.gpu().act(x.rows, x.cols));
        }
        match out {
            DevAct::Cuda(x) => x,
            DevAct::Cpu(_) => unreachable!(),
        }
    }

    fn out_cpu<'a>(&self, out: &'a mut DevAct) -> &'a mut CpuAct {
        if let DevAct::Cuda(x) = out {
            *out = DevAct::Cpu(self.cpu.act(x.rows, x.cols));
        }
        match out {
            DevAct::Cpu(x) => x,
            DevAct::Cuda(_) => unreachable!(),
        }
    }

    fn is_gpu(a: &DevAct) -> bool {
        matches!(a, DevAct::Cuda(_))
    }

    fn vec_gpu<'a>(&self, v: &'a DevVec) -> &'a CudaVec {
        v.gpu
            .as_ref()
            .expect("vectors are uploaded when CUDA is used")
    }

    /// A sublayer's join for the CPU backend: x moved to the CPU, as `add_rms_norm` would move it
    /// to where the sublayer's output is.
    fn join_cpu<'a>(&self, j: Join<'a, Self>) -> Join<'a, CpuBackend> {
        let x = j.x;
        self.place(x, false);
        let DevAct::Cpu(x) = x else {
            unreachable!("placed above")
        };
        Join {
            x,
            y_norm: j.y_norm.map(|v| &v.host),
            w: &j.w.host,
            eps: j.eps,
            h: self.out_cpu(j.h),
        }
    }

    /// A sublayer's join for the CUDA backend (x moved to the GPU, as for [`Self::join_cpu`]).
    fn join_gpu<'a>(&self, j: Join<'a, Self>) -> Join<'a, CudaBackend> {
        let x = j.x;
        self.place(x, true);
        let DevAct::Cuda(x) = x else {
            unreachable!("placed above")
        };
        Join {
            x,
            y_norm: j.y_norm.map(|v| self.vec_gpu(v)),
            w: self.vec_gpu(j.w),
            eps: j.eps,
            h: self.out_gpu(j.h),
        }
    }
}

impl Backend for DeviceBackend {
    type Weight = DevWeight;
    type Vector = DevVec;
    type Act = DevAct;
    type Kv = DevKv;

    fn name(&self) -> &'static str {
        match (self.cuda.is_some(), self.gpu_layers >= self.n_layer) {
            (false, _) => "cpu",
            (true, true) => "cuda",
            (true, false) => "cuda+cpu",
        }
    }

    fn set_row_invariant(&self, on: bool) {
        self.cpu.set_row_invariant(on);
        if let Some(c) = &self.cuda {
            c.set_row_invariant(on);
        }
    }

    fn load_weight(&self, src: &WeightSource<'_>) -> Result<DevWeight> {
        Ok(match self.on_gpu(layer_of(src.name)) {
            true => DevWeight::Cuda(self.gpu().load_weight(src)?),
            false => DevWeight::Cpu(self.cpu.load_weight(src)?),
        })
    }

    fn load_vector(&self, data: &[f32]) -> Result<DevVec> {
        let gpu = match &self.cuda {
            Some(c) => Some(c.load_vector(data)?),
            None => None,
        };
        Ok(DevVec {
            host: data.to_vec(),
            gpu,
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
    ) -> Result<DevKv> {
        let g = self.gpu_layers.min(n_layer);
        let cuda = match &self.cuda {
            Some(c) if g > 0 => {
                Some(c.alloc_kv(g, n_blocks, block_size, kv_dim, head_dim, kv_type)?)
            }
            _ => None,
        };
        let cpu = if g < n_layer {
            // The GPU layers' host storage is never touched, so it takes no memory (`KvPlane`).
            Some(
                self.cpu
                    .alloc_kv(n_layer, n_blocks, block_size, kv_dim, head_dim, kv_type)?,
            )
        } else {
            None
        };
        Ok(DevKv { cpu, cuda })
    }

    fn act(&self, rows: usize, cols: usize) -> DevAct {
        match self.on_gpu(Some(0)) {
            true => DevAct::Cuda(self.gpu().act(rows, cols)),
            false => DevAct::Cpu(self.cpu.act(rows, cols)),
        }
    }

    fn rows(&self, x: &DevAct) -> usize {
        match x {
            DevAct::Cpu(x) => x.rows,
            DevAct::Cuda(x) => x.rows,
        }
    }

    fn embed(&self, table: &DevWeight, tokens: &[u32], scale: f32, out: &mut DevAct) {
        match table {
            DevWeight::Cpu(t) => self.cpu.embed(t, tokens, scale, self.out_cpu(out)),
            DevWeight::Cuda(t) => self.gpu().embed(t, tokens, scale, self.out_gpu(out)),
        }
    }

    fn rms_norm(&self, x: &DevAct, w: &DevVec, eps: f32, out: &mut DevAct) {
        match x {
            DevAct::Cpu(x) => self.cpu.rms_norm(x, &w.host, eps, self.out_cpu(out)),
            DevAct::Cuda(x) => self
                .gpu()
                .rms_norm(x, self.vec_gpu(w), eps, self.out_gpu(out)),
        }
    }

    fn rms_norm_inplace(&self, x: &mut DevAct, w: &DevVec, eps: f32) {
        match x {
            DevAct::Cpu(x) => self.cpu.rms_norm_inplace(x, &w.host, eps),
            DevAct::Cuda(x) => self.gpu().rms_norm_inplace(x, self.vec_gpu(w), eps),
        }
    }

    fn matmul(&self, w: &DevWeight, x: &DevAct, bias: Option<&DevVec>, out: &mut DevAct) {
        self.matmul_many(x, &mut [(w, bias, out)]);
    }

    fn matmul_many(&self, x: &DevAct, jobs: &mut [MatmulJob<'_, Self>]) {
        let gpu = jobs.iter().map(|(w, _, _)| matches!(w, DevWeight::Cuda(_)));
        let (any_gpu, all_gpu) = gpu.fold((false, true), |(a, b), g| (a || g, b && g));
        if any_gpu && all_gpu {
            let x = self.to_gpu(x);
            let mut inner: Vec<MatmulJob<'_, CudaBackend>> = Vec::with_capacity(jobs.len());
            for (w, b, o) in jobs.iter_mut() {
                let DevWeight::Cuda(w) = w else {
                    unreachable!()
                };
                inner.push((w, b.map(|b| self.vec_gpu(b)), self.out_gpu(o)));
            }
            self.gpu().matmul_many(&x, &mut inner);
        } else if !any_gpu {
            let x = self.to_cpu(x);
            let mut inner: Vec<MatmulJob<'_, CpuBackend>> = Vec::with_capacity(jobs.len());
            for (w, b, o) in jobs.iter_mut() {
                let DevWeight::Cpu(w) = w else { unreachable!() };
                inner.push((w, b.map(|b| &b.host), self.out_cpu(o)));
            }
            self.cpu.matmul_many(&x, &mut inner);
        } else {
            for (w, b, o) in jobs.iter_mut() {
                self.matmul_many(x, &mut [(*w, *b, &mut **o)]);
            }
        }
    }

    fn rope(&self, x: &mut DevAct, positions: &[u32], rope: Rope, ff: Option<&DevVec>) {
        match x {
            DevAct::Cpu(x) => self.cpu.rope(x, positions, rope, ff.map(|f| &f.host)),
            DevAct::Cuda(x) => self
                .gpu()
                .rope(x, positions, rope, ff.map(|f| self.vec_gpu(f))),
        }
    }

    fn scale(&self, x: &mut DevAct, s: f32) {
        match x {
            DevAct::Cpu(x) => self.cpu.scale(x, s),
            DevAct::Cuda(x) => self.gpu().scale(x, s),
        }
    }

    fn add(&self, x: &mut DevAct, y: &DevAct) {
        self.place(x, Self::is_gpu(y));
        match (x, y) {
            (DevAct::Cpu(x), DevAct::Cpu(y)) => self.cpu.add(x, y),
            (DevAct::Cuda(x), DevAct::Cuda(y)) => self.gpu().add(x, y),
            _ => unreachable!("placed above"),
        }
    }

    fn add_rms_norm(
        &self,
        x: &mut DevAct,
        y: &mut DevAct,
        y_norm: Option<&DevVec>,
        w: &DevVec,
        eps: f32,
        out: &mut DevAct,
    ) {
        // As `add`: x goes where y is, and the norm runs there.
        self.place(x, Self::is_gpu(y));
        match (x, y) {
            (DevAct::Cpu(x), DevAct::Cpu(y)) => {
                let yn = y_norm.map(|v| &v.host);
                self.cpu
                    .add_rms_norm(x, y, yn, &w.host, eps, self.out_cpu(out))
            }
            (DevAct::Cuda(x), DevAct::Cuda(y)) => {
                let yn = y_norm.map(|v| self.vec_gpu(v));
                let out = self.out_gpu(out);
                self.gpu().add_rms_norm(x, y, yn, self.vec_gpu(w), eps, out)
            }
            _ => unreachable!("placed above"),
        }
    }

    fn glu(&self, gate: &mut DevAct, up: &DevAct, act: Activation) {
        match gate {
            DevAct::Cpu(g) => self.cpu.glu(g, &self.to_cpu(up), act),
            DevAct::Cuda(g) => self.gpu().glu(g, &self.to_gpu(up), act),
        }
    }

    fn ffn_dense(
        &self,
        h: &DevAct,
        ws: (&DevWeight, &DevWeight, &DevWeight),
        act: Activation,
        gate: &mut DevAct,
        up: &mut DevAct,
        out: &mut DevAct,
        join: Option<Join<'_, Self>>,
    ) {
        // The CPU backend's fused decode regions when the layer is on the CPU.
        if let (DevWeight::Cpu(g), DevWeight::Cpu(u), DevWeight::Cpu(d)) = ws {
            let (h, gate, up) = (self.to_cpu(h), self.out_cpu(gate), self.out_cpu(up));
            let join = join.map(|j| self.join_cpu(j));
            return self
                .cpu
                .ffn_dense(&h, (g, u, d), act, gate, up, self.out_cpu(out), join);
        }
        // The CUDA backend's fused kernels when it is on the GPU.
        if let (DevWeight::Cuda(g), DevWeight::Cuda(u), DevWeight::Cuda(d)) = ws {
            let (h, gate, up) = (self.to_gpu(h), self.out_gpu(gate), self.out_gpu(up));
            let join = join.map(|j| self.join_gpu(j));
            return self
                .gpu()
                .ffn_dense(&h, (g, u, d), act, gate, up, self.out_gpu(out), join);
        }
        ffn_dense_steps(self, h, ws, act, gate, up, out);
        then_join(self, join, out)
    }

    fn attention_block(
        &self,
        h: &DevAct,
        blk: &AttnBlock<'_, Self>,
        kv: &mut DevKv,
        layer: usize,
        batch: &AttnBatch<'_, '_>,
        s: AttnScratch<'_, Self>,
        out: &mut DevAct,
        join: Option<Join<'_, Self>>,
    ) {
        // The CPU backend's fused decode region when the layer is on the CPU.
        fn cpu(w: &DevWeight) -> Option<&CpuWeight> {
            match w {
                DevWeight::Cpu(w) => Some(w),
                DevWeight::Cuda(_) => None,
            }
        }
        fn host(v: Option<&DevVec>) -> Option<&Vec<f32>> {
            v.map(|v| &v.host)
        }
        let ws = (cpu(blk.wq), cpu(blk.wk), cpu(blk.wv), cpu(blk.wo));
        if let ((Some(wq), Some(wk), Some(wv), Some(wo)), false, Some(c)) =
            (ws, layer < self.gpu_layers, &mut kv.cpu)
        {
            let b = AttnBlock::<CpuBackend> {
                wq,
                wk,
                wv,
                bq: host(blk.bq),
                bk: host(blk.bk),
                bv: host(blk.bv),
                q_norm: host(blk.q_norm),
                k_norm: host(blk.k_norm),
                norm_eps: blk.norm_eps,
                rope: blk.rope,
                rope_freqs: host(blk.rope_freqs),
                q_scale: blk.q_scale,
                wo,
            };
            let h = self.to_cpu(h);
            let s = AttnScratch {
                q: self.out_cpu(s.q),
                k: self.out_cpu(s.k),
                v: self.out_cpu(s.v),
                attn: self.out_cpu(s.attn),
            };
            let join = join.map(|j| self.join_cpu(j));
            return self
                .cpu
                .attention_block(&h, &b, c, layer, batch, s, self.out_cpu(out), join);
        }
        fn gpu(w: &DevWeight) -> Option<&CudaWeight> {
            match w {
                DevWeight::Cuda(w) => Some(w),
                DevWeight::Cpu(_) => None,
            }
        }
        let ws = (gpu(blk.wq), gpu(blk.wk), gpu(blk.wv), gpu(blk.wo));
        if let ((Some(wq), Some(wk), Some(wv), Some(wo)), true, Some(c)) =
            (ws, layer < self.gpu_layers, &mut kv.cuda)
        {
            fn v(v: Option<&DevVec>) -> Option<&CudaVec> {
                v.map(|v| {
                    v.gpu
                        .as_ref()
                        .expect("vectors are uploaded when CUDA is used")
                })
            }
            let b = AttnBlock::<CudaBackend> {
                wq,
                wk,
                wv,
                bq: v(blk.bq),
                bk: v(blk.bk),
                bv: v(blk.bv),
                q_norm: v(blk.q_norm),
                k_norm: v(blk.k_norm),
                norm_eps: blk.norm_eps,
                rope: blk.rope,
                rope_freqs: v(blk.rope_freqs),
                q_scale: blk.q_scale,
                wo,
            };
            let h = self.to_gpu(h);
            let s = AttnScratch {
                q: self.out_gpu(s.q),
                k: self.out_gpu(s.k),
                v: self.out_gpu(s.v),
                attn: self.out_gpu(s.attn),
            };
            let join = join.map(|j| self.join_gpu(j));
            return self
                .gpu()
                .attention_block(&h, &b, c, layer, batch, s, self.out_gpu(out), join);
        }
        attention_block_steps(self, h, blk, kv, layer, batch, s, out);
        then_join(self, join, out)
    }

    fn kv_copy_blocks(&self, kv: &mut DevKv, pairs: &[(u32, u32)]) {
        if let Some(c) = &mut kv.cuda {
            self.gpu().kv_copy_blocks(c, pairs);
        }
        if let Some(c) = &mut kv.cpu {
            // Only the CPU's layers: the GPU layers' host planes stay untouched (no memory).
            let layers = self.gpu_layers.min(c.k.layers())..c.k.layers();
            c.copy_blocks(pairs, layers);
        }
    }

    fn kv_export(&self, kv: &DevKv, blocks: &[u32]) -> Result<Vec<u8>> {
        match (&kv.cpu, self.gpu_layers) {
            (Some(c), 0) => Ok(c.export(blocks)),
            _ => anyhow::bail!(
                "the prompt cache keeps the KV cache on the CPU only (this run holds some on the GPU: use --device cpu)"
            ),
        }
    }

    fn kv_shift(
        &self,
        kv: &mut DevKv,
        layer: usize,
        slots: &[usize],
        delta: u32,
        rope: Rope,
        ff: Option<&DevVec>,
    ) -> Result<()> {
        match (&mut kv.cpu, layer < self.gpu_layers) {
            (Some(c), false) => {
                c.shift_keys(layer, slots, delta, rope, ff.map(|f| f.host.as_slice()));
                Ok(())
            }
            _ => anyhow::bail!(
                "shifting the context works on the CPU's KV cache only (this run holds some on the GPU: use --device cpu)"
            ),
        }
    }

    fn kv_import(&self, kv: &mut DevKv, blocks: &[u32], bytes: &[u8]) -> Result<()> {
        match (&mut kv.cpu, self.gpu_layers) {
            (Some(c), 0) => c.import(blocks, bytes),
            _ => anyhow::bail!(
                "the prompt cache keeps the KV cache on the CPU only (this run holds some on the GPU: use --device cpu)"
            ),
        }
    }

    fn kv_write(&self, kv: &mut DevKv, layer: usize, k: &DevAct, v: &DevAct, slots: &[usize]) {
        match (layer < self.gpu_layers, &mut kv.cuda, &mut kv.cpu) {
            (true, Some(c), _) => {
                self.gpu()
                    .kv_write(c, layer, &self.to_gpu(k), &self.to_gpu(v), slots)
            }
            (_, _, Some(c)) => self
                .cpu
                .kv_write(c, layer, &self.to_cpu(k), &self.to_cpu(v), slots),
            _ => unreachable!("every layer has KV storage"),
        }
    }

    fn attention(
        &self,
        q: &DevAct,
        kv: &DevKv,
        layer: usize,
        queries: &[AttnQuery<'_>],
        shape: AttnShape,
        out: &mut DevAct,
    ) {
        match (layer < self.gpu_layers, &kv.cuda, &kv.cpu) {
            (true, Some(c), _) => {
                self.gpu()
                    .attention(&self.to_gpu(q), c, layer, queries, shape, self.out_gpu(out))
            }
            (_, _, Some(c)) => {
                self.cpu
                    .attention(&self.to_cpu(q), c, layer, queries, shape, self.out_cpu(out))
            }
            _ => unreachable!("every layer has KV storage"),
        }
    }

    fn add_rows_scaled(&self, x: &mut DevAct, y: &DevAct, rows: &[usize], scales: &[f32]) {
        self.place(x, Self::is_gpu(y));
        match (x, y) {
            (DevAct::Cpu(x), DevAct::Cpu(y)) => self.cpu.add_rows_scaled(x, y, rows, scales),
            (DevAct::Cuda(x), DevAct::Cuda(y)) => self.gpu().add_rows_scaled(x, y, rows, scales),
            _ => unreachable!("placed above"),
        }
    }

    fn copy_heads(&self, src: &DevAct, dst: &mut DevAct, c: HeadCopy) {
        match dst {
            DevAct::Cpu(d) => self.cpu.copy_heads(&self.to_cpu(src), d, c),
            DevAct::Cuda(d) => self.gpu().copy_heads(&self.to_gpu(src), d, c),
        }
    }

    fn gather_rows(&self, x: &DevAct, rows: &[usize]) -> DevAct {
        match x {
            DevAct::Cpu(x) => DevAct::Cpu(self.cpu.gather_rows(x, rows)),
            DevAct::Cuda(x) => DevAct::Cuda(self.gpu().gather_rows(x, rows)),
        }
    }

    fn to_host(&self, x: &DevAct) -> Vec<f32> {
        match x {
            DevAct::Cpu(x) => x.data.clone(),
            DevAct::Cuda(x) => self.gpu().to_host(x),
        }
    }

    fn device_sampler(&self, s: &DeviceSampling) -> Option<DeviceSampler> {
        // Only where the output head (and so the logits) is on the GPU.
        match self.on_gpu(None) {
            true => self.gpu().device_sampler(s),
            false => None,
        }
    }

    fn sample_on_device(
        &self,
        logits: &mut DevAct,
        picks: &mut [DevicePick<'_>],
    ) -> Result<Vec<u32>> {
        match logits {
            DevAct::Cuda(x) => self.gpu().sample_on_device(x, picks),
            DevAct::Cpu(_) => anyhow::bail!("device sampling of logits on the CPU"),
        }
    }

    fn device_sampler_rng(&self, sampler: &DeviceSampler) -> Result<[u64; 4]> {
        self.gpu().device_sampler_rng(sampler)
    }

    fn take_host(&self, x: DevAct) -> Vec<f32> {
        match x {
            DevAct::Cpu(x) => x.data,
            DevAct::Cuda(x) => self.gpu().to_host(&x),
        }
    }

    fn act_for_overwrite(&self, rows: usize, cols: usize) -> DevAct {
        match self.on_gpu(Some(0)) {
            true => DevAct::Cuda(self.gpu().act(rows, cols)),
            false => DevAct::Cpu(self.cpu.act_for_overwrite(rows, cols)),
        }
    }

    fn recycle(&self, host: Vec<f32>) {
        self.cpu.recycle(host);
    }
}

#[cfg(test)]
mod tests {
    use super::{DevAct, DeviceBackend};
    use crate::format::GgmlType;
    use crate::kernels::cpu::backend::{CpuAct, CpuBackend};
    use crate::kernels::cpu::matmul::tests::{same_bits, test_weights_on};
    use crate::kernels::cpu::test_floats as data;
    use crate::model::backend::{
        AttnBatch, AttnBlock, AttnQuery, AttnShape, Backend, KvType, Rope,
    };
    use crate::model::config::{Activation, RopeStyle};

    /// One decode step's attention sublayer and feed-forward on `be` (weights as `test_weights`
    /// makes them), with biases and q/k norms, at position 37 over a scrambled block table: the
    /// attention output and the feed-forward output.
    fn sublayers<B: Backend>(be: &B, act: impl Fn(&[f32], usize) -> B::Act) -> (B::Act, B::Act) {
        let (hd, nh, nkv, n_embd, ff) = (64, 4, 2, 256, 512);
        let (qd, kvd) = (nh * hd, nkv * hd);
        let ty = [GgmlType::Q4K, GgmlType::Q4K, GgmlType::Q6K];
        let ws = test_weights_on(be, &[(ty[0], qd), (ty[1], kvd), (ty[2], kvd)], n_embd);
        let wo = test_weights_on(be, &[(GgmlType::Q4K, n_embd)], qd);
        let mlp = test_weights_on(be, &[(GgmlType::Q4K, ff), (GgmlType::Q4K, ff)], n_embd);
        let down = test_weights_on(be, &[(GgmlType::Q6K, n_embd)], ff);
        let vec = |n: usize, s: u32| be.load_vector(&data(n, s)).unwrap();
        let (bq, bk, bv, qn, kn) = (vec(qd, 1), vec(kvd, 2), vec(kvd, 3), vec(hd, 4), vec(hd, 5));
        let blk = AttnBlock::<B> {
            wq: &ws[0],
            wk: &ws[1],
            wv: &ws[2],
            bq: Some(&bq),
            bk: Some(&bk),
            bv: Some(&bv),
            q_norm: Some(&qn),
            k_norm: Some(&kn),
            norm_eps: 1e-6,
            rope: Rope {
                style: RopeStyle::Neox,
                base: 10000.0,
                head_dim: hd,
            },
            rope_freqs: None,
            q_scale: None,
            wo: &wo[0],
        };
        let (pos, bs) = (37usize, 16usize);
        let table: Vec<u32> = (0..8u32).map(|b| (b * 5) % 8).collect();
        let mut kv = be
            .alloc_kv(1, table.len(), bs, kvd, hd, KvType::F16)
            .unwrap();
        let slot = |p: usize| table[p / bs] as usize * bs + p % bs;
        let slots: Vec<usize> = (0..pos).map(slot).collect();
        let (k, v) = (act(&data(pos * kvd, 7), kvd), act(&data(pos * kvd, 8), kvd));
        be.kv_write(&mut kv, 0, &k, &v, &slots);
        let queries = [AttnQuery {
            seq: 0,
            block_table: &table,
            pos: pos as u32,
            lo: 0,
        }];
        let batch = AttnBatch {
            positions: &[pos as u32],
            slots: &[slot(pos)],
            queries: &queries,
            shape: AttnShape {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: hd,
                scale: 0.125,
            },
        };
        let h = act(&data(n_embd, 9), n_embd);
        let out = crate::kernels::cpu::fused::attention::tests::with_scratch(
            be,
            (qd, kvd, n_embd),
            |s, out| be.attention_block(&h, &blk, &mut kv, 0, &batch, s, out, None),
        );
        let (mut g, mut u, mut o) = (be.act(1, ff), be.act(1, ff), be.act(1, n_embd));
        let ws = (&mlp[0], &mlp[1], &down[0]);
        be.ffn_dense(&out, ws, Activation::Silu, &mut g, &mut u, &mut o, None);
        (out, o)
    }

    /// The CLI's backend (CPU only) gives what the CPU backend gives for a decode step's
    /// attention sublayer and feed-forward, bit for bit: it hands each over whole (so the fused
    /// regions run) with every weight, bias and norm in its place.
    #[test]
    fn device_backend_sublayers_equal_the_cpu_backends() {
        let shaped = |x: &[f32], cols: usize| CpuAct {
            data: x.to_vec(),
            rows: x.len() / cols,
            cols,
        };
        let want = sublayers(&CpuBackend::new(2), shaped);
        let dev = DeviceBackend::cpu_only(CpuBackend::new(2));
        let got = sublayers(&dev, |x, cols| DevAct::Cpu(shaped(x, cols)));
        let host = |a: &DevAct| dev.to_host(a);
        assert!(same_bits(&want.0.data, &host(&got.0)), "attention sublayer");
        assert!(same_bits(&want.1.data, &host(&got.1)), "feed-forward");
    }
}
