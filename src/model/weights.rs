//! Tensor names and shapes: finds every weight a layer needs by its llama.cpp name, checks its shape
//! against the config, and hands it to the backend. Invariant: once `Weights::load` succeeds, every
//! matrix has the shape the forward loop assumes (rows = outputs, cols = inputs). Fused and stacked
//! tensors are handed over as row ranges (zero-copy views): Phi-3's `attn_qkv` as Q, K and V, its
//! `ffn_up` as gate and up, and each expert of a 3-D `ffn_*_exps` tensor as its own matrix.
//! DeepSeek's latent attention weights are found by `mla`.

use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::format::{GgmlType, Gguf};
use crate::model::backend::{Backend, WeightSource};
use crate::model::config::{Arch, ModelConfig};
use crate::model::mla::{self, MlaWeights};

pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Vector, // (n_embd)
    pub attn: Attn<B>,
    pub wo: B::Weight, // (n_embd, n_head * value head width)
    pub post_attn_norm: Option<B::Vector>,
    pub ffn_norm: B::Vector, // (n_embd)
    pub ffn: Ffn<B>,
    pub post_ffn_norm: Option<B::Vector>,
}

/// How a layer's queries, keys and values are made.
pub enum Attn<B: Backend> {
    Mha(Qkv<B>),
    /// Multi-head latent attention (DeepSeek).
    Mla(MlaWeights<B>),
}

/// Plain projections (Phi-3's fused `attn_qkv` as three row views), with optional biases and
/// per-head RMS norms of q and k (Qwen3, Gemma 3).
pub struct Qkv<B: Backend> {
    pub wq: B::Weight, // (n_head * head_dim, n_embd)
    pub wk: B::Weight, // (n_head_kv * head_dim, n_embd)
    pub wv: B::Weight, // (n_head_kv * head_dim, n_embd)
    pub bq: Option<B::Vector>,
    pub bk: Option<B::Vector>,
    pub bv: Option<B::Vector>,
    pub q_norm: Option<B::Vector>, // (head_dim)
    pub k_norm: Option<B::Vector>, // (head_dim)
}

/// A gated feed-forward: down(act(gate · x) * (up · x)).
pub struct Mlp<B: Backend> {
    pub gate: B::Weight, // (n_ff, n_embd)
    pub up: B::Weight,   // (n_ff, n_embd)
    pub down: B::Weight, // (n_embd, n_ff)
}

pub enum Ffn<B: Backend> {
    Dense(Mlp<B>),
    /// Mixture of experts: `router` scores the experts for each token; `select_bias` (host
    /// values, DeepSeek-V3's `exp_probs_b`) is added to the scores for choosing only; `shared`
    /// runs on every token.
    Moe {
        router: B::Weight, // (n_expert, n_embd)
        select_bias: Option<Vec<f32>>,
        experts: Vec<Mlp<B>>,
        shared: Option<Mlp<B>>,
    },
}

pub struct Weights<B: Backend> {
    pub token_embd: B::Weight, // (vocab, n_embd)
    /// None when the output head is tied to the embedding table.
    pub output: Option<B::Weight>, // (vocab, n_embd)
    pub output_norm: B::Vector, // (n_embd)
    /// RoPE frequency factors (`rope_freqs`, Llama 3 scaling), (head_dim / 2).
    pub rope_freqs: Option<B::Vector>,
    pub layers: Vec<LayerWeights<B>>,
}

pub(crate) struct Loader<'a, B: Backend> {
    g: &'a Arc<Gguf>,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    pub(crate) fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weight> {
        self.opt_matrix(name, rows, cols)?
            .with_context(|| format!("tensor `{name}` is missing from the model file"))
    }

    pub(crate) fn opt_matrix(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Option<B::Weight>> {
        self.view(name, &[cols, rows], 0, rows)
    }

    /// Rows `first..first + rows` of tensor `name`, whose ggml shape must be `dims` (the first
    /// dimension is the row length; the others multiply to the row count). None if absent.
    fn view(
        &self,
        name: &str,
        dims: &[usize],
        first: usize,
        rows: usize,
    ) -> Result<Option<B::Weight>> {
        let Some(index) = self.g.tensors.iter().position(|t| t.name == name) else {
            return Ok(None);
        };
        let t = &self.g.tensors[index];
        // Trailing 1s are not dimensions (a matrix may be stored as [c, r, 1]).
        let mut got: Vec<u64> = t.dims.clone();
        while got.len() > dims.len() && got.last() == Some(&1) {
            got.pop();
        }
        while got.len() < dims.len() {
            got.push(1);
        }
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if got != want {
            bail!(
                "tensor `{name}` has shape {:?} (ggml order), expected {want:?}",
                t.dims
            );
        }
        let cols = dims[0];
        let total: usize = dims[1..].iter().product();
        debug_assert!(first + rows <= total);
        let row_bytes = t.ty.row_bytes(cols).with_context(|| {
            format!(
                "tensor `{name}`: row length {cols} is not a multiple of the {} block size",
                t.ty.name()
            )
        })?;
        let data = self.g.tensor_data(t);
        if data.len() != row_bytes * total {
            bail!(
                "tensor `{name}` holds {} bytes, expected {}",
                data.len(),
                row_bytes * total
            );
        }
        let src = WeightSource {
            file: self.g,
            index,
            name,
            ty: t.ty,
            rows,
            cols,
            bytes: &data[first * row_bytes..(first + rows) * row_bytes],
        };
        self.backend
            .load_weight(&src)
            .map(Some)
            .with_context(|| format!("loading tensor `{name}`"))
    }

    /// Rows `first..first + rows` of a required tensor of ggml shape `dims`.
    fn part(&self, name: &str, dims: &[usize], first: usize, rows: usize) -> Result<B::Weight> {
        self.view(name, dims, first, rows)?
            .with_context(|| format!("tensor `{name}` is missing from the model file"))
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<B::Vector> {
        self.opt_vector(name, len)?
            .with_context(|| format!("tensor `{name}` is missing from the model file"))
    }

    pub(crate) fn opt_vector(&self, name: &str, len: usize) -> Result<Option<B::Vector>> {
        match self.host_vector(name, len)? {
            Some(data) => self.backend.load_vector(&data).map(Some),
            None => Ok(None),
        }
    }

    /// A vector's values in host memory (None if absent).
    fn host_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        let Some(t) = self.g.tensor(name) else {
            return Ok(None);
        };
        if t.n_elements() != len as u64 {
            bail!(
                "tensor `{name}` has {} elements, expected {len}",
                t.n_elements()
            );
        }
        let mut data = vec![0f32; len];
        crate::quant::dequantize_row(t.ty, self.g.tensor_data(t), &mut data)
            .with_context(|| format!("reading tensor `{name}` ({})", t.ty.name()))?;
        Ok(Some(data))
    }
}

impl<B: Backend> Weights<B> {
    pub fn load(g: &Arc<Gguf>, cfg: &ModelConfig, backend: &B) -> Result<Weights<B>> {
        let l = Loader { g, backend };
        let (d, q) = (cfg.n_embd, cfg.q_dim());
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let gemma = cfg.arch == Arch::Gemma3;
            let lw = LayerWeights {
                attn_norm: l.vector(&n("attn_norm.weight"), d)?,
                attn: match &cfg.mla {
                    Some(m) => Attn::Mla(mla::load(&l, cfg, m, i)?),
                    None => Attn::Mha(l.qkv(cfg, i)?),
                },
                wo: match &cfg.mla {
                    Some(m) => l.matrix(&n("attn_output.weight"), d, cfg.n_head * m.v_dim)?,
                    None => l.matrix(&n("attn_output.weight"), d, q)?,
                },
                post_attn_norm: if gemma {
                    Some(l.vector(&n("post_attention_norm.weight"), d)?)
                } else {
                    None
                },
                ffn_norm: l.vector(&n("ffn_norm.weight"), d)?,
                ffn: l.ffn(cfg, i)?,
                post_ffn_norm: if gemma {
                    Some(l.vector(&n("post_ffw_norm.weight"), d)?)
                } else {
                    None
                },
            };
            layers.push(lw);
        }
        let token_embd = l.matrix("token_embd.weight", cfg.vocab_size, d)?;
        let output = l.opt_matrix("output.weight", cfg.vocab_size, d)?;
        Ok(Weights {
            token_embd,
            output,
            output_norm: l.vector("output_norm.weight", d)?,
            rope_freqs: l.opt_vector("rope_freqs.weight", cfg.head_dim / 2)?,
            layers,
        })
    }
}

impl<B: Backend> Loader<'_, B> {
    /// Layer `i`'s q, k and v projections.
    fn qkv(&self, cfg: &ModelConfig, i: usize) -> Result<Qkv<B>> {
        let l = self;
        let n = |s: &str| format!("blk.{i}.{s}");
        let (d, q, kv) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim());
        let (wq, wk, wv) = if cfg.arch == Arch::Phi3 {
            let qkv = n("attn_qkv.weight");
            let dims = [d, q + 2 * kv];
            (
                l.part(&qkv, &dims, 0, q)?,
                l.part(&qkv, &dims, q, kv)?,
                l.part(&qkv, &dims, q + kv, kv)?,
            )
        } else {
            (
                l.matrix(&n("attn_q.weight"), q, d)?,
                l.matrix(&n("attn_k.weight"), kv, d)?,
                l.matrix(&n("attn_v.weight"), kv, d)?,
            )
        };
        Ok(Qkv {
            wq,
            wk,
            wv,
            bq: l.opt_vector(&n("attn_q.bias"), q)?,
            bk: l.opt_vector(&n("attn_k.bias"), kv)?,
            bv: l.opt_vector(&n("attn_v.bias"), kv)?,
            q_norm: l.opt_vector(&n("attn_q_norm.weight"), cfg.head_dim)?,
            k_norm: l.opt_vector(&n("attn_k_norm.weight"), cfg.head_dim)?,
        })
    }

    /// Layer `i`'s feed-forward: experts when the layer has a router (`ffn_gate_inp`), else dense.
    fn ffn(&self, cfg: &ModelConfig, i: usize) -> Result<Ffn<B>> {
        let n = |s: &str| format!("blk.{i}.{s}");
        let (d, ff) = (cfg.n_embd, cfg.n_ff);
        if let Some(moe) = cfg.moe {
            let (ne, eff) = (moe.n_expert, moe.n_ff);
            if let Some(router) = self.opt_matrix(&n("ffn_gate_inp.weight"), ne, d)? {
                let experts = (0..ne)
                    .map(|e| {
                        Ok(Mlp {
                            gate: self.part(
                                &n("ffn_gate_exps.weight"),
                                &[d, eff, ne],
                                e * eff,
                                eff,
                            )?,
                            up: self.part(&n("ffn_up_exps.weight"), &[d, eff, ne], e * eff, eff)?,
                            down: self.part(&n("ffn_down_exps.weight"), &[eff, d, ne], e * d, d)?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let shared = match moe.n_shared * eff {
                    0 => None,
                    sff => Some(Mlp {
                        gate: self.matrix(&n("ffn_gate_shexp.weight"), sff, d)?,
                        up: self.matrix(&n("ffn_up_shexp.weight"), sff, d)?,
                        down: self.matrix(&n("ffn_down_shexp.weight"), d, sff)?,
                    }),
                };
                return Ok(Ffn::Moe {
                    router,
                    select_bias: self.host_vector(&n("exp_probs_b.bias"), ne)?,
                    experts,
                    shared,
                });
            }
        }
        if cfg.arch == Arch::Phi3 {
            // One `ffn_up` of 2 * n_ff rows: the gate's, then the up projection's.
            let up = n("ffn_up.weight");
            return Ok(Ffn::Dense(Mlp {
                gate: self.part(&up, &[d, 2 * ff], 0, ff)?,
                up: self.part(&up, &[d, 2 * ff], ff, ff)?,
                down: self.matrix(&n("ffn_down.weight"), d, ff)?,
            }));
        }
        Ok(Ffn::Dense(Mlp {
            gate: self.matrix(&n("ffn_gate.weight"), ff, d)?,
            up: self.matrix(&n("ffn_up.weight"), ff, d)?,
            down: self.matrix(&n("ffn_down.weight"), d, ff)?,
        }))
    }
}

/// Bytes of weights read per generated token (every matrix once; the embedding only one row).
pub fn bytes_per_token(g: &Gguf) -> u64 {
    g.tensors
        .iter()
        .map(|t| {
            if t.name == "token_embd.weight" && g.tensor("output.weight").is_some() {
                t.ty.row_bytes(t.row_len()).unwrap_or(0) as u64
            } else {
                t.size_bytes as u64
            }
        })
        .sum()
}

/// The tensor types a file uses, for diagnostics.
pub fn type_summary(g: &Gguf) -> String {
    let mut counts: Vec<(GgmlType, usize)> = Vec::new();
    for t in &g.tensors {
        match counts.iter_mut().find(|(ty, _)| *ty == t.ty) {
            Some((_, c)) => *c += 1,
            None => counts.push((t.ty, 1)),
        }
    }
    counts
        .iter()
        .map(|(ty, c)| format!("{} {}", ty.name(), c))
        .collect::<Vec<_>>()
        .join(", ")
}
