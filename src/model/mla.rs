//! Multi-head latent attention (DeepSeek-V2/V3, llama.cpp's `deepseek2`): queries come through a
//! low-rank `q_a` → norm → `q_b` path (or one `attn_q`), keys and values are decompressed per head
//! from one normed latent vector per token (`attn_kv_a_mqa` → norm → `attn_kv_b`), and RoPE
//! touches only the last `rope` dims of each q/k head, its key part shared by all heads.
//!
//! This is the straightforward (non-absorbed) computation, as llama.cpp runs files with the unsplit
//! `attn_kv_b`: K/V are cached per head, V padded with zeros to the q/k head width so that the
//! ordinary attention applies; the padding is dropped before `attn_output`. Files with
//! llama.cpp's split `attn_k_b`/`attn_v_b` layout (`attention.key_length_mla`) are rejected.

use anyhow::{bail, Context, Result};

use crate::format::Gguf;
use crate::model::backend::{Backend, HeadCopy, Rope};
use crate::model::config::{Arch, ModelConfig, RopeStyle};
use crate::model::weights::Loader;

/// Epsilon of the latent RMS norms (`q_a_norm`, `kv_a_norm`): DeepSeek's reference code and
/// transformers build them with the norm's default 1e-6, not `rms_norm_eps` (llama.cpp uses the
/// latter; the difference moves logits by ~4e-5 on the test checkpoint).
const LATENT_NORM_EPS: f32 = 1e-6;

/// MLA dimensions; q/k heads are `nope + rope` wide (the model's `head_dim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    /// Rank of the query compression (None: queries are one `attn_q` projection).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    /// Per-head q/k dims without RoPE.
    pub nope: usize,
    /// Per-head q/k dims with RoPE (the key's are shared by all heads).
    pub rope: usize,
    /// Per-head value width.
    pub v_dim: usize,
}

impl MlaConfig {
    /// The MLA dimensions of a `deepseek2` file (None for other architectures).
    pub fn from_gguf(
        g: &Gguf,
        arch_name: &str,
        arch: Arch,
        head_dim: usize,
    ) -> Result<Option<MlaConfig>> {
        if arch != Arch::Deepseek2 {
            return Ok(None);
        }
        let k = |s: &str| format!("{arch_name}.{s}");
        let num = |s: &str| -> Result<usize> {
            g.get_u64(&k(s))
                .map(|v| v as usize)
                .with_context(|| format!("GGUF metadata `{}` is missing", k(s)))
        };
        if g.get_u64(&k("attention.key_length_mla")).is_some() {
            bail!("DeepSeek files with the split attn_k_b/attn_v_b layout (attention.key_length_mla) are not supported; convert with `infer quantize --from-hf`");
        }
        let rope = num("rope.dimension_count")?;
        let v_dim = num("attention.value_length")?;
        if rope == 0 || rope % 2 != 0 || rope >= head_dim || v_dim == 0 || v_dim > head_dim {
            bail!("MLA dimensions do not fit: key_length {head_dim}, rope.dimension_count {rope}, value_length {v_dim}");
        }
        Ok(Some(MlaConfig {
            q_lora_rank: g
                .get_u64(&k("attention.q_lora_rank"))
                .map(|v| v as usize)
                .filter(|&r| r > 0),
            kv_lora_rank: num("attention.kv_lora_rank")?,
            nope: head_dim - rope,
            rope,
            v_dim,
        }))
    }
}

/// One layer's MLA weights.
pub struct MlaWeights<B: Backend> {
    /// (q_a, q_a_norm): (q_lora_rank, n_embd) and (q_lora_rank); None when `q` is direct.
    pub q_a: Option<(B::Weight, B::Vector)>,
    /// `attn_q_b` (n_head·head_dim, q_lora_rank) or `attn_q` (n_head·head_dim, n_embd).
    pub q: B::Weight,
    pub kv_a: B::Weight,      // (kv_lora_rank + rope, n_embd)
    pub kv_a_norm: B::Vector, // (kv_lora_rank)
    pub kv_b: B::Weight,      // (n_head·(nope + v_dim), kv_lora_rank)
}

/// Loads layer `i`'s MLA weights.
pub(crate) fn load<B: Backend>(
    l: &Loader<'_, B>,
    cfg: &ModelConfig,
    m: &MlaConfig,
    i: usize,
) -> Result<MlaWeights<B>> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let (d, nh, r) = (cfg.n_embd, cfg.n_head, m.kv_lora_rank);
    let (q_a, q) = match m.q_lora_rank {
        Some(qr) => (
            Some((
                l.matrix(&n("attn_q_a.weight"), qr, d)?,
                l.vector(&n("attn_q_a_norm.weight"), qr)?,
            )),
            l.matrix(&n("attn_q_b.weight"), cfg.q_dim(), qr)?,
        ),
        None => (None, l.matrix(&n("attn_q.weight"), cfg.q_dim(), d)?),
    };
    Ok(MlaWeights {
        q_a,
        q,
        kv_a: l.matrix(&n("attn_kv_a_mqa.weight"), r + m.rope, d)?,
        kv_a_norm: l.vector(&n("attn_kv_a_norm.weight"), r)?,
        kv_b: l.matrix(&n("attn_kv_b.weight"), nh * (m.nope + m.v_dim), r)?,
    })
}

/// Copies `width` values per head between layouts.
fn copy<B: Backend>(
    be: &B,
    src: &B::Act,
    dst: &mut B::Act,
    from: (usize, usize),
    to: (usize, usize),
    width: usize,
) {
    let c = HeadCopy {
        src_hd: from.0,
        src_off: from.1,
        dst_hd: to.0,
        dst_off: to.1,
        width,
    };
    be.copy_heads(src, dst, c);
}

/// q, k and v (each rows × n_head·head_dim, RoPE applied, v zero-padded) of the normed input `h`.
pub fn qkv<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    m: &MlaConfig,
    w: &MlaWeights<B>,
    h: &B::Act,
    positions: &[u32],
    rope_base: f32,
) -> (B::Act, B::Act, B::Act) {
    let n = be.rows(h);
    let (nh, hd, r) = (cfg.n_head, cfg.head_dim, m.kv_lora_rank);
    let rope = Rope {
        style: RopeStyle::Normal,
        base: rope_base,
        head_dim: m.rope,
    };
    let mut q = be.act(n, nh * hd);
    match &w.q_a {
        Some((q_a, norm)) => {
            // q_a exists only with a compression rank.
            let mut qa = be.act(n, m.q_lora_rank.unwrap_or_default());
            be.matmul(q_a, h, None, &mut qa);
            be.rms_norm_inplace(&mut qa, norm, LATENT_NORM_EPS);
            be.matmul(&w.q, &qa, None, &mut q);
        }
        None => be.matmul(&w.q, h, None, &mut q),
    }
    let mut q_pe = be.act(n, nh * m.rope);
    copy(be, &q, &mut q_pe, (hd, m.nope), (m.rope, 0), m.rope);
    be.rope(&mut q_pe, positions, rope, None);
    copy(be, &q_pe, &mut q, (m.rope, 0), (hd, m.nope), m.rope);

    let mut ckv = be.act(n, r + m.rope);
    be.matmul(&w.kv_a, h, None, &mut ckv);
    let mut latent = be.act(n, r);
    copy(be, &ckv, &mut latent, (r + m.rope, 0), (r, 0), r);
    be.rms_norm_inplace(&mut latent, &w.kv_a_norm, LATENT_NORM_EPS);
    let mut k_pe = be.act(n, m.rope);
    copy(be, &ckv, &mut k_pe, (r + m.rope, r), (m.rope, 0), m.rope);
    be.rope(&mut k_pe, positions, rope, None);
    let kvw = m.nope + m.v_dim;
    let mut kv = be.act(n, nh * kvw);
    be.matmul(&w.kv_b, &latent, None, &mut kv);

    let mut k = be.act(n, nh * hd);
    copy(be, &kv, &mut k, (kvw, 0), (hd, 0), m.nope);
    copy(be, &k_pe, &mut k, (m.rope, 0), (hd, m.nope), m.rope);
    let mut v = be.act(n, nh * hd);
    copy(be, &kv, &mut v, (kvw, m.nope), (hd, 0), m.v_dim);
    (q, k, v)
}

/// The attention output without the value padding: rows × n_head·v_dim.
pub fn values<B: Backend>(be: &B, cfg: &ModelConfig, m: &MlaConfig, attn: &B::Act) -> B::Act {
    let mut out = be.act(be.rows(attn), cfg.n_head * m.v_dim);
    copy(be, attn, &mut out, (cfg.head_dim, 0), (m.v_dim, 0), m.v_dim);
    out
}
