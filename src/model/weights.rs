//! Tensor names and shapes: finds every weight a layer needs by its llama.cpp name, checks its shape
//! against the config, and hands it to the backend. Invariant: once `Weights::load` succeeds, every
//! matrix has the shape the forward loop assumes (rows = outputs, cols = inputs).

use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::format::{GgmlType, Gguf};
use crate::model::backend::{Backend, WeightSource};
use crate::model::config::{Arch, ModelConfig};

pub struct LayerWeights<B: Backend> {
    pub attn_norm: B::Vector, // (n_embd)
    pub wq: B::Weight,        // (n_head * head_dim, n_embd)
    pub wk: B::Weight,        // (n_head_kv * head_dim, n_embd)
    pub wv: B::Weight,        // (n_head_kv * head_dim, n_embd)
    pub bq: Option<B::Vector>,
    pub bk: Option<B::Vector>,
    pub bv: Option<B::Vector>,
    pub q_norm: Option<B::Vector>, // (head_dim)
    pub k_norm: Option<B::Vector>, // (head_dim)
    pub wo: B::Weight,             // (n_embd, n_head * head_dim)
    pub post_attn_norm: Option<B::Vector>,
    pub ffn_norm: B::Vector, // (n_embd)
    pub w_gate: B::Weight,   // (n_ff, n_embd)
    pub w_up: B::Weight,     // (n_ff, n_embd)
    pub w_down: B::Weight,   // (n_embd, n_ff)
    pub post_ffn_norm: Option<B::Vector>,
}

pub struct Weights<B: Backend> {
    pub token_embd: B::Weight, // (vocab, n_embd)
    /// None when the output head is tied to the embedding table.
    pub output: Option<B::Weight>, // (vocab, n_embd)
    pub output_norm: B::Vector, // (n_embd)
    pub layers: Vec<LayerWeights<B>>,
}

struct Loader<'a, B: Backend> {
    g: &'a Arc<Gguf>,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<B::Weight> {
        self.opt_matrix(name, rows, cols)?
            .with_context(|| format!("tensor `{name}` is missing from the model file"))
    }

    fn opt_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Option<B::Weight>> {
        let Some(index) = self.g.tensors.iter().position(|t| t.name == name) else {
            return Ok(None);
        };
        let t = &self.g.tensors[index];
        let dims: Vec<u64> = t.dims.clone();
        let (c, r) = match dims.as_slice() {
            [c] => (*c as usize, 1),
            [c, r] => (*c as usize, *r as usize),
            [c, r, 1] | [c, r, 1, 1] => (*c as usize, *r as usize),
            _ => bail!("tensor `{name}` has shape {dims:?}, expected a matrix"),
        };
        if (r, c) != (rows, cols) {
            bail!("tensor `{name}` has shape [{c}, {r}] (ggml order), expected [{cols}, {rows}]");
        }
        let src = WeightSource {
            file: self.g,
            index,
            name,
            ty: t.ty,
            rows,
            cols,
            bytes: self.g.tensor_data(t),
        };
        self.backend
            .load_weight(&src)
            .map(Some)
            .with_context(|| format!("loading tensor `{name}`"))
    }

    fn vector(&self, name: &str, len: usize) -> Result<B::Vector> {
        self.opt_vector(name, len)?
            .with_context(|| format!("tensor `{name}` is missing from the model file"))
    }

    fn opt_vector(&self, name: &str, len: usize) -> Result<Option<B::Vector>> {
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
        self.backend.load_vector(&data).map(Some)
    }
}

impl<B: Backend> Weights<B> {
    pub fn load(g: &Arc<Gguf>, cfg: &ModelConfig, backend: &B) -> Result<Weights<B>> {
        let l = Loader { g, backend };
        let (d, q, kv, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            let gemma = cfg.arch == Arch::Gemma3;
            let lw = LayerWeights {
                attn_norm: l.vector(&n("attn_norm.weight"), d)?,
                wq: l.matrix(&n("attn_q.weight"), q, d)?,
                wk: l.matrix(&n("attn_k.weight"), kv, d)?,
                wv: l.matrix(&n("attn_v.weight"), kv, d)?,
                bq: l.opt_vector(&n("attn_q.bias"), q)?,
                bk: l.opt_vector(&n("attn_k.bias"), kv)?,
                bv: l.opt_vector(&n("attn_v.bias"), kv)?,
                q_norm: l.opt_vector(&n("attn_q_norm.weight"), cfg.head_dim)?,
                k_norm: l.opt_vector(&n("attn_k_norm.weight"), cfg.head_dim)?,
                wo: l.matrix(&n("attn_output.weight"), d, q)?,
                post_attn_norm: if gemma {
                    Some(l.vector(&n("post_attention_norm.weight"), d)?)
                } else {
                    None
                },
                ffn_norm: l.vector(&n("ffn_norm.weight"), d)?,
                w_gate: l.matrix(&n("ffn_gate.weight"), ff, d)?,
                w_up: l.matrix(&n("ffn_up.weight"), ff, d)?,
                w_down: l.matrix(&n("ffn_down.weight"), d, ff)?,
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
            layers,
        })
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
