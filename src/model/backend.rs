//! The seam between the forward loop and the hardware: every piece of math the model does goes through
//! `Backend`, so a CUDA backend can sit beside the CPU one. A backend owns where buffers live
//! (`Act`, `Weight`, `Vector`, `Kv`); the forward loop only sequences operations and never touches
//! their contents. Activations are row-major `rows × cols` f32 matrices, one row per batch entry.

use std::sync::Arc;

use anyhow::Result;

use crate::format::{GgmlType, Gguf};
use crate::model::config::{Activation, RopeStyle};

/// A weight matrix as stored in the file: `rows` outputs, each `cols` inputs wide, of type `ty`.
/// `file` and `index` let a backend keep a zero-copy view (the file stays mapped while it holds the Arc).
pub struct WeightSource<'a> {
    pub file: &'a Arc<Gguf>,
    /// Index into `file.tensors`.
    pub index: usize,
    pub name: &'a str,
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: &'a [u8],
}

/// RoPE parameters of one layer.
#[derive(Clone, Copy, Debug)]
pub struct Rope {
    pub style: RopeStyle,
    pub base: f32,
    pub head_dim: usize,
}

/// A strided copy between head layouts (`Backend::copy_heads`): for each row and each head `h` of
/// the destination (`dst.cols / dst_hd` heads), `width` values from `src_off` within source head
/// `h % (src.cols / src_hd)` go to `dst_off` within destination head `h` (a single source head is
/// thus shared by every destination head).
#[derive(Clone, Copy, Debug)]
pub struct HeadCopy {
    pub src_hd: usize,
    pub src_off: usize,
    pub dst_hd: usize,
    pub dst_off: usize,
    pub width: usize,
}

/// What the KV cache stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvType {
    /// f16, as llama.cpp stores it by default (attention then follows llama.cpp's kernels).
    F16,
    /// f32, for models computed in f32 end to end (attention is a plain f32 softmax).
    F32,
    /// K and V each in a [`CacheType`] (`--cache-type-k`, `--cache-type-v`), at least one of them
    /// quantized: attention reads the blocks in place (`kernels::cpu::attention::quant_cache`).
    /// Built by [`KvType::of`], never with both `F16`.
    Quant { k: CacheType, v: CacheType },
}

impl KvType {
    /// The type of a cache with keys in `k` and values in `v`: [`KvType::F16`] for two f16s.
    pub fn of(k: CacheType, v: CacheType) -> KvType {
        match (k, v) {
            (CacheType::F16, CacheType::F16) => KvType::F16,
            (k, v) => KvType::Quant { k, v },
        }
    }

    /// Bytes of one position's K row and V row (`kv_dim` values each) in one layer.
    pub fn row_bytes(self, kv_dim: usize) -> (usize, usize) {
        match self {
            KvType::F16 => (2 * kv_dim, 2 * kv_dim),
            KvType::F32 => (4 * kv_dim, 4 * kv_dim),
            KvType::Quant { k, v } => (k.row_bytes(kv_dim), v.row_bytes(kv_dim)),
        }
    }

    /// How `--cache-type-k`/`--cache-type-v` spell it: `"f16"`, `"f32"`, or `"K/V"` (`"q8_0/q8_0"`).
    pub fn name(self) -> String {
        match self {
            KvType::F16 => "f16".into(),
            KvType::F32 => "f32".into(),
            KvType::Quant { k, v } => format!("{}/{}", k.name(), v.name()),
        }
    }
}

/// The element type of a KV cache's keys or values, with llama.cpp's names (`--cache-type-k`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub enum CacheType {
    #[default]
    F16,
    /// ggml's `block_q8_0`: an f16 scale and 32 signed bytes (34 bytes per 32 values).
    Q8_0,
    /// ggml's `block_q4_0`: an f16 scale and 32 nibbles offset by 8 (18 bytes per 32 values).
    Q4_0,
}

impl CacheType {
    pub const ALL: [CacheType; 3] = [CacheType::F16, CacheType::Q8_0, CacheType::Q4_0];

    pub fn name(self) -> &'static str {
        match self {
            CacheType::F16 => "f16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
        }
    }

    /// The type named `s` (llama.cpp's spelling), if it is one of [`CacheType::ALL`].
    pub fn parse(s: &str) -> Option<CacheType> {
        CacheType::ALL.into_iter().find(|t| t.name() == s)
    }

    /// The ggml tensor type of the same bytes.
    pub fn ggml(self) -> GgmlType {
        match self {
            CacheType::F16 => GgmlType::F16,
            CacheType::Q8_0 => GgmlType::Q8_0,
            CacheType::Q4_0 => GgmlType::Q4_0,
        }
    }

    /// Whether values come in blocks of 32 (a head's width must then be a multiple of 32).
    pub fn is_quantized(self) -> bool {
        self != CacheType::F16
    }

    /// Bytes of `n` values (`n` a multiple of 32 for the block types).
    pub fn row_bytes(self, n: usize) -> usize {
        match self {
            CacheType::F16 => 2 * n,
            CacheType::Q8_0 => n / 32 * 34,
            CacheType::Q4_0 => n / 32 * 18,
        }
    }
}

/// One query row of attention: where its sequence's keys live and how far it may look.
#[derive(Clone, Copy, Debug)]
pub struct AttnQuery<'a> {
    /// The query's sequence (queries of one sequence share `block_table`).
    pub seq: u32,
    /// Physical KV blocks of the query's sequence, in position order.
    pub block_table: &'a [u32],
    /// The query's position; it attends to keys at positions `lo..=pos`.
    pub pos: u32,
    /// First visible key position (`pos + 1 - window` for sliding-window layers, else 0).
    pub lo: u32,
}

/// Shape of the attention problem for one layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Multiplier of q·k (1.0 when q was pre-scaled).
    pub scale: f32,
}

/// An attention sublayer with plain projections (multi-head or grouped-query), for
/// [`Backend::attention_block`]: `q, k, v = h · Wᵀ (+ b)`, per-head RMS norms of q and k where
/// given, RoPE of both, q optionally scaled, K/V into the cache, attention, then `wo`.
pub struct AttnBlock<'a, B: Backend + ?Sized> {
    pub wq: &'a B::Weight, // (n_head * head_dim, n_embd)
    pub wk: &'a B::Weight, // (n_head_kv * head_dim, n_embd)
    pub wv: &'a B::Weight, // (n_head_kv * head_dim, n_embd)
    pub bq: Option<&'a B::Vector>,
    pub bk: Option<&'a B::Vector>,
    pub bv: Option<&'a B::Vector>,
    pub q_norm: Option<&'a B::Vector>, // (head_dim)
    pub k_norm: Option<&'a B::Vector>, // (head_dim)
    pub norm_eps: f32,
    pub rope: Rope,
    pub rope_freqs: Option<&'a B::Vector>,
    /// Multiplies q before attention (a model that scales q rather than the scores).
    pub q_scale: Option<f32>,
    pub wo: &'a B::Weight, // (n_embd, n_head * head_dim)
}

/// Where an attention sublayer's rows go: each row's position, its KV slot and its query.
pub struct AttnBatch<'a, 'b> {
    pub positions: &'a [u32],
    pub slots: &'a [usize],
    pub queries: &'a [AttnQuery<'b>],
    pub shape: AttnShape,
}

/// The rows an attention sublayer works in: `q` and `attn` (n, n_head * head_dim), `k` and `v`
/// (n, n_head_kv * head_dim).
pub struct AttnScratch<'a, B: Backend + ?Sized> {
    pub q: &'a mut B::Act,
    pub k: &'a mut B::Act,
    pub v: &'a mut B::Act,
    pub attn: &'a mut B::Act,
}

/// The residual join that follows a sublayer, handed to the sublayer so that a backend may fuse
/// it into the sublayer's last matrix product: with the sublayer's output `y`,
/// [`Backend::add_rms_norm`]`(x, y, y_norm, w, eps, h)` (x += y, normed by `y_norm` first when
/// given; h = rms_norm(x) * w).
pub struct Join<'a, B: Backend + ?Sized> {
    pub x: &'a mut B::Act,
    pub y_norm: Option<&'a B::Vector>,
    pub w: &'a B::Vector,
    pub eps: f32,
    pub h: &'a mut B::Act,
}

impl<B: Backend + ?Sized> Join<'_, B> {
    /// The join as its own step, on the sublayer's output `y`.
    pub fn run(self, be: &B, y: &mut B::Act) {
        be.add_rms_norm(self.x, y, self.y_norm, self.w, self.eps, self.h)
    }
}

/// Runs `join` (when there is one) on the sublayer output `y`.
pub fn then_join<B: Backend + ?Sized>(be: &B, join: Option<Join<'_, B>>, y: &mut B::Act) {
    if let Some(j) = join {
        j.run(be, y)
    }
}

/// [`Backend::attention_block`] as its steps, one backend call each (its default, and a fusing
/// backend's fallback).
#[allow(clippy::too_many_arguments)]
pub fn attention_block_steps<B: Backend + ?Sized>(
    be: &B,
    h: &B::Act,
    blk: &AttnBlock<'_, B>,
    kv: &mut B::Kv,
    layer: usize,
    batch: &AttnBatch<'_, '_>,
    s: AttnScratch<'_, B>,
    out: &mut B::Act,
) {
    be.matmul_many(
        h,
        &mut [
            (blk.wq, blk.bq, &mut *s.q),
            (blk.wk, blk.bk, &mut *s.k),
            (blk.wv, blk.bv, &mut *s.v),
        ],
    );
    if let Some(qn) = blk.q_norm {
        be.rms_norm_inplace(s.q, qn, blk.norm_eps);
    }
    if let Some(kn) = blk.k_norm {
        be.rms_norm_inplace(s.k, kn, blk.norm_eps);
    }
    be.rope(s.q, batch.positions, blk.rope, blk.rope_freqs);
    be.rope(s.k, batch.positions, blk.rope, blk.rope_freqs);
    if let Some(scale) = blk.q_scale {
        be.scale(s.q, scale);
    }
    be.kv_write(kv, layer, s.k, s.v, batch.slots);
    be.attention(s.q, kv, layer, batch.queries, batch.shape, s.attn);
    be.matmul(blk.wo, s.attn, None, out);
}

/// One job of [`Backend::matmul_many`]: a weight, its optional bias, and the output.
pub type MatmulJob<'a, B> = (
    &'a <B as Backend>::Weight,
    Option<&'a <B as Backend>::Vector>,
    &'a mut <B as Backend>::Act,
);

/// [`Backend::ffn_dense`] as its steps, one backend call each (its default, and a fusing
/// backend's fallback).
pub fn ffn_dense_steps<B: Backend + ?Sized>(
    be: &B,
    h: &B::Act,
    (gate_w, up_w, down_w): (&B::Weight, &B::Weight, &B::Weight),
    act: Activation,
    gate: &mut B::Act,
    up: &mut B::Act,
    out: &mut B::Act,
) {
    be.matmul_many(h, &mut [(gate_w, None, gate), (up_w, None, up)]);
    be.glu(gate, up, act);
    be.matmul(down_w, gate, None, out);
}

pub trait Backend {
    /// A weight matrix, resident where this backend computes.
    type Weight;
    /// An f32 parameter vector (norm weights, biases).
    type Vector;
    /// An activation matrix (rows × cols f32).
    type Act;
    /// Paged K/V storage for every layer: `n_blocks` blocks of `block_size` positions.
    type Kv;

    fn name(&self) -> &'static str;

    /// Row-invariant numerics: while on, every row of a multi-row forward is computed with exactly
    /// the arithmetic a one-row forward would use for it (speculative verification relies on this
    /// so that its greedy output equals plain decoding). Off by default: multi-row calls may then
    /// use faster kernels with another float accumulation order. A backend whose kernels never
    /// depend on the row count may ignore it.
    fn set_row_invariant(&self, _on: bool) {}

    fn load_weight(&self, src: &WeightSource<'_>) -> Result<Self::Weight>;
    fn load_vector(&self, data: &[f32]) -> Result<Self::Vector>;
    /// KV storage for `n_blocks` blocks of `block_size` positions per layer, each position
    /// `kv_dim` values (KV heads of `head_dim`) for K and for V, in `kv_type`.
    fn alloc_kv(
        &self,
        n_layer: usize,
        n_blocks: usize,
        block_size: usize,
        kv_dim: usize,
        head_dim: usize,
        kv_type: KvType,
    ) -> Result<Self::Kv>;

    /// A zeroed rows × cols activation.
    fn act(&self, rows: usize, cols: usize) -> Self::Act;
    fn rows(&self, x: &Self::Act) -> usize;

    /// out[i] = table[tokens[i]] * scale (dequantized rows of an embedding table).
    fn embed(&self, table: &Self::Weight, tokens: &[u32], scale: f32, out: &mut Self::Act);
    /// Row-wise RMS norm over groups of `w.len()` columns (a row may hold several heads), times w.
    fn rms_norm(&self, x: &Self::Act, w: &Self::Vector, eps: f32, out: &mut Self::Act);
    /// In-place variant of `rms_norm`.
    fn rms_norm_inplace(&self, x: &mut Self::Act, w: &Self::Vector, eps: f32);
    /// out = x · Wᵀ (+ bias): out[t][r] = dot(W row r, x row t).
    fn matmul(
        &self,
        w: &Self::Weight,
        x: &Self::Act,
        bias: Option<&Self::Vector>,
        out: &mut Self::Act,
    );
    /// Several matmuls of one input: `out_i = x · W_iᵀ (+ bias_i)` for each job, every result as
    /// [`Backend::matmul`] gives it alone. A backend may share work between them (the CPU one
    /// quantizes `x` once and runs a decode step's jobs in one parallel region).
    fn matmul_many(&self, x: &Self::Act, jobs: &mut [MatmulJob<'_, Self>]) {
        for (w, bias, out) in jobs.iter_mut() {
            self.matmul(w, x, *bias, out);
        }
    }
    /// Rotate each head of each row by its position; pair i's angle is divided by
    /// `freq_factors[i]` when given (llama.cpp's `rope_freqs`, e.g. Llama 3 RoPE scaling).
    fn rope(
        &self,
        x: &mut Self::Act,
        positions: &[u32],
        rope: Rope,
        freq_factors: Option<&Self::Vector>,
    );
    fn scale(&self, x: &mut Self::Act, s: f32);
    /// x += y.
    fn add(&self, x: &mut Self::Act, y: &Self::Act);
    /// The residual add and the next norm as one step: `y` is RMS-normed by `y_norm` first when
    /// given (Gemma's norm of a sublayer's output), then `x += y`, then `out = rms_norm(x) * w`
    /// over whole rows, each exactly as [`Backend::rms_norm_inplace`], [`Backend::add`] and
    /// [`Backend::rms_norm`] compute it (`y` is left unspecified). A backend may fuse the steps (the
    /// CUDA one runs them as one kernel that also quantizes `out` for the matmul that follows).
    fn add_rms_norm(
        &self,
        x: &mut Self::Act,
        y: &mut Self::Act,
        y_norm: Option<&Self::Vector>,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Act,
    ) {
        if let Some(yn) = y_norm {
            self.rms_norm_inplace(y, yn, eps);
        }
        self.add(x, y);
        self.rms_norm(x, w, eps, out);
    }
    /// gate = act(gate) * up.
    fn glu(&self, gate: &mut Self::Act, up: &Self::Act, act: Activation);
    /// The dense gated feed-forward: `gate = h · Gᵀ`, `up = h · Uᵀ`, `gate = act(gate) * up`,
    /// `out = gate · Dᵀ`, then the `join` after it when given, each exactly as
    /// [`Backend::matmul_many`], [`Backend::glu`], [`Backend::matmul`] and
    /// [`Backend::add_rms_norm`] compute it (`gate` and `up` are the scratch rows). A backend may
    /// fuse the steps (the CPU one runs a decode step's in two parallel regions, the CUDA one its
    /// last product with the join).
    #[allow(clippy::too_many_arguments)]
    fn ffn_dense(
        &self,
        h: &Self::Act,
        (gate_w, up_w, down_w): (&Self::Weight, &Self::Weight, &Self::Weight),
        act: Activation,
        gate: &mut Self::Act,
        up: &mut Self::Act,
        out: &mut Self::Act,
        join: Option<Join<'_, Self>>,
    ) {
        ffn_dense_steps(self, h, (gate_w, up_w, down_w), act, gate, up, out);
        then_join(self, join, out)
    }
    /// Write rows of k and v into the cache at the given physical slots (block * block_size + offset).
    fn kv_write(
        &self,
        kv: &mut Self::Kv,
        layer: usize,
        k: &Self::Act,
        v: &Self::Act,
        slots: &[usize],
    );
    /// Copies whole KV blocks, every layer's K and V: for each `(from, to)`, block `to` gets
    /// block `from`'s positions (copy-on-write of a shared block before it is written).
    fn kv_copy_blocks(&self, kv: &mut Self::Kv, pairs: &[(u32, u32)]);
    /// The K/V of `blocks`, every layer, as bytes to save: per block, per layer, K's slots then
    /// V's, each value little-endian in the cache's own type ([`KvType`]). A backend that cannot
    /// read its cache back says so.
    fn kv_export(&self, _kv: &Self::Kv, _blocks: &[u32]) -> Result<Vec<u8>> {
        anyhow::bail!("the {} backend cannot save its KV cache", self.name())
    }
    /// Rotates the keys in `slots` of `layer` back by `delta` positions (RoPE by `-delta`, with the
    /// layer's `rope` and frequency factors `ff`): after a context shift moved those positions
    /// `delta` places earlier, each key is as if computed at its new position (up to the cache's
    /// rounding). Values do not depend on position and stay.
    fn kv_shift(
        &self,
        _kv: &mut Self::Kv,
        _layer: usize,
        _slots: &[usize],
        _delta: u32,
        _rope: Rope,
        _ff: Option<&Self::Vector>,
    ) -> Result<()> {
        anyhow::bail!("the {} backend cannot shift its KV cache", self.name())
    }
    /// Writes bytes of [`Backend::kv_export`]'s layout (from a cache of the same model, type and
    /// block size) into `blocks`.
    fn kv_import(&self, _kv: &mut Self::Kv, _blocks: &[u32], _bytes: &[u8]) -> Result<()> {
        anyhow::bail!("the {} backend cannot load a saved KV cache", self.name())
    }
    /// A whole attention sublayer with plain projections (see [`AttnBlock`]), its output into
    /// `out` (n, n_embd), then the `join` after it when given, every value as
    /// [`attention_block_steps`] and [`Join::run`] compute it (the scratch rows are left
    /// unspecified). A backend may fuse the steps (the CPU one runs a decode step's Q/K/V
    /// projections, RoPE and attention in one parallel region, the CUDA one the output product
    /// with the join).
    #[allow(clippy::too_many_arguments)]
    fn attention_block(
        &self,
        h: &Self::Act,
        blk: &AttnBlock<'_, Self>,
        kv: &mut Self::Kv,
        layer: usize,
        batch: &AttnBatch<'_, '_>,
        s: AttnScratch<'_, Self>,
        out: &mut Self::Act,
        join: Option<Join<'_, Self>>,
    ) {
        attention_block_steps(self, h, blk, kv, layer, batch, s, out);
        then_join(self, join, out)
    }
    /// Causal attention of each q row over its sequence's cached keys and values.
    fn attention(
        &self,
        q: &Self::Act,
        kv: &Self::Kv,
        layer: usize,
        queries: &[AttnQuery<'_>],
        shape: AttnShape,
        out: &mut Self::Act,
    );
    /// x[rows[i]] += scales[i] * y[i] for every row i of y (mixture-of-experts: an expert's
    /// outputs added to the tokens routed to it, times their routing weights).
    fn add_rows_scaled(&self, x: &mut Self::Act, y: &Self::Act, rows: &[usize], scales: &[f32]);
    /// Copies parts of heads between activations with the same row count (see [`HeadCopy`]).
    fn copy_heads(&self, src: &Self::Act, dst: &mut Self::Act, c: HeadCopy);
    /// A new activation holding the given rows of x.
    fn gather_rows(&self, x: &Self::Act, rows: &[usize]) -> Self::Act;
    /// Copy an activation back to host memory, row-major.
    fn to_host(&self, x: &Self::Act) -> Vec<f32>;
    /// [`Backend::to_host`] for an activation that is not needed any more: a host backend hands
    /// its buffer over instead of copying it (a decode step's logits are 0.6 MB for a 152k
    /// vocabulary; copying them took ~0.3 ms a step in `cargo bench --bench decode`, most of it
    /// page faults on the fresh copy).
    fn take_host(&self, x: Self::Act) -> Vec<f32> {
        self.to_host(&x)
    }
    /// A rows × cols activation whose every element the caller overwrites before reading any:
    /// its contents are unspecified. The CPU backend hands back a buffer given to
    /// [`Backend::recycle`] (zeroing a fresh 1 MB logits row took 34-54 µs of Gemma-3's 4-6 ms
    /// decode step); the default is [`Backend::act`].
    fn act_for_overwrite(&self, rows: usize, cols: usize) -> Self::Act {
        self.act(rows, cols)
    }
    /// Gives a vector from [`Backend::take_host`] back for a later
    /// [`Backend::act_for_overwrite`] to reuse; the default drops it.
    fn recycle(&self, _host: Vec<f32>) {}

    /// A sampler that picks tokens where this backend keeps the logits, so that only ids come
    /// back (see [`DeviceSampling`]); its RNG state starts at `s.rng` and lives on the device.
    /// None (the default, and the CPU backend) means the engine samples on the host.
    fn device_sampler(&self, _s: &DeviceSampling) -> Option<DeviceSampler> {
        None
    }
    /// Picks a token from each row `picks` name in `logits` (the model's output, whose picked
    /// rows this may change) with each one's sampler from [`Backend::device_sampler`], in one
    /// go, advancing each RNG as the CPU sampler would; returns the ids in `picks` order.
    fn sample_on_device(
        &self,
        _logits: &mut Self::Act,
        _picks: &mut [DevicePick<'_>],
    ) -> Result<Vec<u32>> {
        anyhow::bail!("the {} backend does not sample on the device", self.name())
    }
    /// The RNG state of a sampler from [`Backend::device_sampler`] (to go on on the host).
    fn device_sampler_rng(&self, _sampler: &DeviceSampler) -> Result<[u64; 4]> {
        anyhow::bail!("the {} backend does not sample on the device", self.name())
    }
}

/// Most candidates a device sampler's top-k takes (`SAMPLE_MAX_K` in `cuda/sample.cu`): the
/// sorted candidate list lives in one block's shared memory.
pub const DEVICE_SAMPLE_MAX_K: usize = 1024;

/// The CPU sampler's chain (`engine::sampler`) reduced to the numbers a device sampler reads,
/// built only for configurations the device samples exactly as the host does (greedy, or a
/// top-k of 1..=[`DEVICE_SAMPLE_MAX_K`] below the vocabulary size, with any top-p, min-p,
/// temperature and penalties).
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceSampling {
    /// 0: greedy (argmax of the penalised logits); else the top-k.
    pub top_k: usize,
    /// 1.0: off.
    pub top_p: f32,
    /// 0.0: off.
    pub min_p: f32,
    /// `min_p.ln()` as the host computes it (the device has no bit-identical `ln`).
    pub ln_min_p: f32,
    /// `1 / temperature` as the host computes it.
    pub inv_temp: f32,
    pub repeat_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Whether any penalty is on (then the window given to each sample counts).
    pub penalised: bool,
    /// The xoshiro256** state to continue from.
    pub rng: [u64; 4],
}

/// A row of a logits activation to sample on the device ([`Backend::sample_on_device`]).
pub struct DevicePick<'a> {
    /// The row of the activation.
    pub row: usize,
    pub sampler: &'a mut DeviceSampler,
    /// Its penalty window: the last `repeat_last_n` tokens of its history, or nothing when no
    /// penalty is on.
    pub window: &'a [u32],
}

/// A backend's device-side sampler state (buffers and the RNG), opaque to the engine.
pub struct DeviceSampler(pub Box<dyn std::any::Any + Send>);
