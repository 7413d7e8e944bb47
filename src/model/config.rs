//! Hyperparameters read from GGUF metadata (`{arch}.*` keys), one struct for every supported
//! architecture. Invariants: `n_head % n_head_kv == 0`, `head_dim` is even (RoPE rotates pairs), and
//! `layers.len() == n_layer`; anything else is a load error naming the key.

use anyhow::{bail, Context, Result};

use crate::format::{GgmlType, Gguf, Value};
use crate::model::backend::KvType;

/// The architectures the forward loop knows, and the variations each one switches on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama, Mistral and Mixtral (llama.cpp writes all three as `llama`; Mixtral adds experts).
    Llama,
    Qwen2,
    /// Qwen2 plus a per-head RMS norm of q and k.
    Qwen3,
    /// Qwen3 with mixture-of-experts feed-forwards.
    Qwen3Moe,
    Gemma3,
    /// Fused QKV and gate/up matrices (`attn_qkv`, `ffn_up` twice `n_ff` wide).
    Phi3,
    /// DeepSeek-V2/V3: multi-head latent attention, leading dense layers, then shared + routed
    /// experts.
    Deepseek2,
}

/// Architectures `Arch::from_name` accepts, for messages.
const ARCH_NAMES: &str = "llama, mistral, qwen2, qwen3, qwen3moe, gemma3, phi3, deepseek2";

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        Ok(match name {
            "llama" | "mistral" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            "gemma3" => Arch::Gemma3,
            "phi3" => Arch::Phi3,
            "deepseek2" => Arch::Deepseek2,
            other => bail!("unsupported architecture `{other}` (supported: {ARCH_NAMES})"),
        })
    }
}

/// How RoPE pairs dimensions: `Normal` rotates (2i, 2i+1) (llama), `Neox` rotates (i, i + d/2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    Normal,
    Neox,
}

/// The gated feed-forward's activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: silu(gate) * up.
    Silu,
    /// GeGLU with the tanh approximation of GELU, as ggml computes it (through an f16 table).
    GeluTanh,
    /// The same GELU computed in f32 (PyTorch's `gelu(approximate="tanh")`), for f32 models.
    GeluTanhF32,
}

/// Mixture-of-experts feed-forward: `n_expert` experts of width `n_ff`, `n_used` per token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_used: usize,
    /// Width of one expert's feed-forward.
    pub n_ff: usize,
    /// Renormalize the chosen experts' weights to sum to 1.
    pub norm_weights: bool,
    /// How router scores become weights.
    pub gating: Gating,
    /// Multiplier of the routed experts' weights (DeepSeek's `routed_scaling_factor`).
    pub weights_scale: f32,
    /// Shared experts run on every token (their layers hold `ffn_*_shexp`, `n_shared * n_ff`
    /// wide).
    pub n_shared: usize,
}

/// Router score → expert weight (llama.cpp's `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    /// Independent sigmoids (DeepSeek-V3); a per-expert bias may steer the choice only.
    Sigmoid,
}

/// Per-layer attention variation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerConfig {
    /// Sliding window in tokens: a query at position p sees keys at p - window < k <= p. None = full.
    pub window: Option<u32>,
    pub rope_base: f32,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub n_ctx_train: usize,
    pub norm_eps: f32,
    pub rope_style: RopeStyle,
    pub activation: Activation,
    /// Multiplier applied to the token embedding (gemma: sqrt(n_embd)).
    pub embd_scale: f32,
    /// Scale applied to q before the dot with k (1/sqrt(head_dim) for most).
    pub attn_scale: f32,
    /// True when q is scaled before attention (gemma) rather than the scores after (llama).
    pub scale_q_first: bool,
    /// Mixture-of-experts layers' shape (their layers hold `ffn_gate_inp`), if any.
    pub moe: Option<MoeConfig>,
    /// Multi-head latent attention (DeepSeek); `head_dim` is then the q/k head width and V is
    /// stored padded to it.
    pub mla: Option<crate::model::mla::MlaConfig>,
    /// KV cache precision. `F32` is chosen when every weight matrix is F32: such a model is
    /// computed in f32 end to end (also GELU without ggml's f16 table), to match the reference
    /// implementation rather than llama.cpp's f16 rounding.
    pub kv_type: KvType,
    pub layers: Vec<LayerConfig>,
}

fn req_u64(g: &Gguf, key: &str) -> Result<usize> {
    let v = g
        .get_u64(key)
        .with_context(|| format!("GGUF metadata `{key}` is missing or not an integer"))?;
    usize::try_from(v).with_context(|| format!("GGUF metadata `{key}` = {v} is too large"))
}

impl ModelConfig {
    pub fn from_gguf(g: &Gguf) -> Result<ModelConfig> {
        let arch_name = g
            .architecture()
            .context("GGUF metadata `general.architecture` is missing")?;
        let arch = Arch::from_name(arch_name)?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let n_layer = req_u64(g, &k("block_count"))?;
        let n_embd = req_u64(g, &k("embedding_length"))?;
        let n_ff = req_u64(g, &k("feed_forward_length"))?;
        let n_head = req_u64(g, &k("attention.head_count"))?;
        let n_head_kv = g
            .get_u64(&k("attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_head);
        let head_dim = g
            .get_u64(&k("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(n_embd.checked_div(n_head).unwrap_or(0));
        if let Some(vl) = g.get_u64(&k("attention.value_length")) {
            if vl as usize != head_dim && arch != Arch::Deepseek2 {
                bail!("value_length {vl} != key_length {head_dim} is not supported");
            }
        }
        if n_layer == 0 || n_embd == 0 || n_head == 0 || n_head_kv == 0 || head_dim == 0 {
            bail!("model has a zero dimension (layers {n_layer}, embd {n_embd}, heads {n_head}/{n_head_kv}, head_dim {head_dim})");
        }
        if n_head % n_head_kv != 0 {
            bail!("head_count {n_head} is not a multiple of head_count_kv {n_head_kv}");
        }
        if !head_dim.is_multiple_of(2) {
            bail!("head dimension {head_dim} is odd; RoPE needs pairs");
        }
        let vocab_size = match g.strings("tokenizer.ggml.tokens") {
            Some(a) => a.len(),
            None => req_u64(g, &k("vocab_size"))?,
        };
        let n_ctx_train = g.get_u64(&k("context_length")).unwrap_or(4096) as usize;
        let norm_eps = g
            .get_f32(&k("attention.layer_norm_rms_epsilon"))
            .unwrap_or(1e-5);
        let rope_base = g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0);
        match g.get(&k("rope.scaling.type")).and_then(Value::as_str) {
            None | Some("none") => {}
            Some(t) => bail!("RoPE scaling type `{t}` is not supported"),
        }
        // A window of 0 (Phi-3 writes one) means none.
        let window = g
            .get_u64(&k("attention.sliding_window"))
            .filter(|&w| w > 0)
            .map(|w| w as u32);
        let swa_base = g.get_f32(&k("rope.freq_base_swa")).unwrap_or(10_000.0);
        let sliding = sliding_layers(g, &k("attention.sliding_window_pattern"), arch, n_layer)?;
        let all_f32 = g
            .tensors
            .iter()
            .filter(|t| t.dims.len() >= 2)
            .all(|t| t.ty == GgmlType::F32);
        let kv_type = if all_f32 { KvType::F32 } else { KvType::F16 };
        let moe = match g.get_u64(&k("expert_count")).unwrap_or(0) as usize {
            0 => None,
            n_expert => {
                let n_used = req_u64(g, &k("expert_used_count"))?;
                let groups = g.get_u64(&k("expert_group_count")).unwrap_or(1);
                let used_groups = g.get_u64(&k("expert_group_used_count")).unwrap_or(groups);
                if groups > 1 && used_groups < groups {
                    bail!("group-limited expert routing ({used_groups} of {groups} groups) is not supported");
                }
                if n_used == 0 || n_used > n_expert {
                    bail!("expert_used_count {n_used} is not in 1..={n_expert}");
                }
                Some(MoeConfig {
                    n_expert,
                    n_used,
                    n_ff: g
                        .get_u64(&k("expert_feed_forward_length"))
                        .map_or(n_ff, |v| v as usize),
                    norm_weights: g
                        .get(&k("expert_weights_norm"))
                        .and_then(Value::as_bool)
                        .unwrap_or(arch != Arch::Deepseek2),
                    gating: match g.get_u64(&k("expert_gating_func")) {
                        None | Some(1) => Gating::Softmax,
                        Some(2) => Gating::Sigmoid,
                        Some(f) => bail!("expert_gating_func {f} is not supported"),
                    },
                    weights_scale: g.get_f32(&k("expert_weights_scale")).unwrap_or(1.0),
                    n_shared: g.get_u64(&k("expert_shared_count")).unwrap_or(0) as usize,
                })
            }
        };

        let (rope_style, activation, embd_scale, scale_q_first) = match arch {
            Arch::Llama | Arch::Deepseek2 => (RopeStyle::Normal, Activation::Silu, 1.0, false),
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Phi3 => {
                (RopeStyle::Neox, Activation::Silu, 1.0, false)
            }
            Arch::Gemma3 => (
                RopeStyle::Neox,
                match kv_type {
                    KvType::F32 => Activation::GeluTanhF32,
                    KvType::F16 | KvType::Quant { .. } => Activation::GeluTanh,
                },
                (n_embd as f32).sqrt(),
                true,
            ),
        };
        let layers = (0..n_layer)
            .map(|il| match (arch, &sliding) {
                // Gemma 3: sliding-window layers use the local RoPE base.
                (Arch::Gemma3, Some(s)) if s[il] => LayerConfig {
                    window,
                    rope_base: swa_base,
                },
                (_, Some(s)) if !s[il] => LayerConfig {
                    window: None,
                    rope_base,
                },
                // Mistral-style: every layer slides when a window is given.
                _ => LayerConfig { window, rope_base },
            })
            .collect();
        Ok(ModelConfig {
            arch,
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            vocab_size,
            n_ctx_train,
            norm_eps,
            rope_style,
            activation,
            embd_scale,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            scale_q_first,
            moe,
            mla: crate::model::mla::MlaConfig::from_gguf(g, arch_name, arch, head_dim)?,
            kv_type,
            layers,
        })
    }

    /// Width of one token's K (or V) across all KV heads.
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Bytes the KV cache stores per position: every layer's K row and V row in the cache's type.
    pub fn kv_bytes_per_position(&self) -> u64 {
        let (k, v) = self.kv_type.row_bytes(self.kv_dim());
        (self.n_layer * (k + v)) as u64
    }

    /// Bytes of the KV cache a one-token step at position `pos` reads: the keys and values of
    /// every position it sees, in every layer (a sliding-window layer sees at most its window).
    pub fn kv_read_bytes(&self, pos: usize) -> u64 {
        let (k, v) = self.kv_type.row_bytes(self.kv_dim());
        // Both are even (f16 values, 34- or 18-byte blocks): the mean of the two is exact.
        kv_read_bytes((k + v) / 2, self.layers.iter().map(|l| l.window), pos)
    }
}

/// [`ModelConfig::kv_read_bytes`] for cache rows of `row_bytes` (one position's K, or its V, in
/// one layer) and the layers' windows.
fn kv_read_bytes(row_bytes: usize, windows: impl Iterator<Item = Option<u32>>, pos: usize) -> u64 {
    windows
        .map(|w| {
            let seen = w.map_or(pos + 1, |w| (pos + 1).min(w as usize));
            2 * (row_bytes * seen) as u64
        })
        .sum()
}

/// Which layers use the sliding window: `key` as a per-layer bool array, or as a period `n` (the
/// last layer of every `n` is global); Gemma 3 without the key has llama.cpp's fixed period 6.
/// `None`: every layer follows `attention.sliding_window`.
fn sliding_layers(g: &Gguf, key: &str, arch: Arch, n_layer: usize) -> Result<Option<Vec<bool>>> {
    let period = |n: usize| Some((0..n_layer).map(|il| il % n < n - 1).collect());
    Ok(match g.get(key) {
        Some(Value::Array(a)) => {
            if a.len() != n_layer {
                bail!("`{key}` has {} entries for {n_layer} layers", a.len());
            }
            let flags: Option<Vec<bool>> = a.iter().map(Value::as_bool).collect();
            Some(flags.with_context(|| format!("`{key}` is not an array of booleans"))?)
        }
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => period(n as usize),
            _ => bail!("`{key}` is neither a layer count nor an array of booleans"),
        },
        None if arch == Arch::Gemma3 => period(6),
        None => None,
    })
}

#[cfg(test)]
mod tests {
    use super::kv_read_bytes;

    #[test]
    fn kv_bytes_count_every_visible_position_and_stop_at_windows() {
        // Gemma-3's pattern: five sliding-window layers (512) then a global one.
        let windows = || (0..6).map(|i| (i % 6 < 5).then_some(512u32));
        // Position 9 sees 10 positions everywhere: K and V rows of 1024 bytes, six layers.
        assert_eq!(kv_read_bytes(1024, windows(), 9), 6 * 10 * 2 * 1024);
        // Position 999: the windowed layers see 512, the global one 1000.
        assert_eq!(
            kv_read_bytes(1024, windows(), 999),
            (5 * 512 + 1000) * 2 * 1024
        );
        assert_eq!(kv_read_bytes(64, std::iter::empty(), 5), 0);
    }
}
