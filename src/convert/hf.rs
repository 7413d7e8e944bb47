//! Hugging Face checkpoint → GGUF plan: which architecture a `config.json` describes, the
//! `{arch}.*` metadata llama.cpp's `convert_hf_to_gguf.py` writes for it, and where every output
//! tensor's rows come from (names mapped to llama.cpp's, Q/K rows permuted for the `llama`
//! architecture, Gemma norms shifted by +1, per-expert matrices stacked into 3-D tensors, Llama 3
//! `rope_freqs` computed).
//!
//! Supported: Llama (incl. Llama 3 RoPE scaling), Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE,
//! Gemma 3 (text), Phi-3 and DeepSeek-V3 (see [`super::deepseek`]). Invariants: every tensor of the checkpoint is either converted,
//! deliberately skipped (rotary caches, Gemma's redundant `lm_head`) or reported as an error;
//! every required tensor is present with the shape `config.json` implies, before any data is
//! read; output names are unique.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value as Json};

use super::pipeline::{PlannedTensor, RopePermute, Rows};
use super::policy::ModelShape;
use super::safetensors::{Checkpoint, HfTensor};
use super::target::Target;
use super::vocab::HfTokenizer;
use crate::format::{GgmlType, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Llama,
    Mistral,
    Mixtral,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Gemma3,
    Phi3,
    /// DeepSeek-V3: MLA attention, shared + routed experts (llama.cpp's `deepseek2`).
    Deepseek2,
}

/// Hugging Face `architectures` names this converter accepts.
const ARCHITECTURES: [(&str, Family); 9] = [
    ("LlamaForCausalLM", Family::Llama),
    ("MistralForCausalLM", Family::Mistral),
    ("MixtralForCausalLM", Family::Mixtral),
    ("Qwen2ForCausalLM", Family::Qwen2),
    ("Qwen3ForCausalLM", Family::Qwen3),
    ("Qwen3MoeForCausalLM", Family::Qwen3Moe),
    ("Gemma3ForCausalLM", Family::Gemma3),
    ("Phi3ForCausalLM", Family::Phi3),
    ("DeepseekV3ForCausalLM", Family::Deepseek2),
];

/// The supported Hugging Face architectures, for messages.
pub fn supported_architectures() -> String {
    ARCHITECTURES.map(|(n, _)| n).join(", ")
}

impl Family {
    fn gguf_arch(self) -> &'static str {
        match self {
            Family::Llama | Family::Mistral | Family::Mixtral => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Qwen3Moe => "qwen3moe",
            Family::Gemma3 => "gemma3",
            Family::Phi3 => "phi3",
            Family::Deepseek2 => "deepseek2",
        }
    }

    /// llama.cpp's `LlamaModel` family: Q/K rows are permuted to the interleaved RoPE layout.
    fn permutes_qk(self) -> bool {
        matches!(self, Family::Llama | Family::Mistral | Family::Mixtral)
    }

    fn has_qk_norm(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Qwen3Moe | Family::Gemma3)
    }
}

/// `config.json`, with `text_config` merged into the root as the converter does.
pub(super) struct Config {
    root: Map<String, Json>,
}

impl Config {
    fn load(dir: &Path) -> Result<Config> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let json: Json =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let Json::Object(mut root) = json else {
            bail!("{} is not a JSON object", path.display());
        };
        if let Some(Json::Object(tc)) = root.get("text_config").cloned() {
            root.extend(tc);
        }
        Ok(Config { root })
    }

    /// The value of `k` unless absent or null.
    pub(super) fn get(&self, k: &str) -> Option<&Json> {
        self.root.get(k).filter(|v| !v.is_null())
    }

    pub(super) fn u64(&self, keys: &[&str]) -> Option<u64> {
        keys.iter().find_map(|k| self.get(k)).and_then(Json::as_u64)
    }

    pub(super) fn f64(&self, keys: &[&str]) -> Option<f64> {
        keys.iter().find_map(|k| self.get(k)).and_then(Json::as_f64)
    }

    pub(super) fn req_u64(&self, keys: &[&str]) -> Result<u64> {
        self.u64(keys).with_context(|| {
            format!(
                "config.json has no integer {}",
                keys.iter()
                    .map(|k| format!("\"{k}\""))
                    .collect::<Vec<_>>()
                    .join(" or ")
            )
        })
    }
}

/// The dimensions the tensor shapes are checked against.
#[derive(Clone, Debug)]
pub(super) struct Hparams {
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim: u64,
    pub n_vocab: u64,
    pub n_expert: u64,
    pub moe_ff: u64,
    pub tied: bool,
}

fn hparams(family: Family, cfg: &Config) -> Result<Hparams> {
    let n_layer = cfg.req_u64(&["num_hidden_layers", "n_layers", "n_layer", "num_layers"])?;
    let n_embd = cfg.req_u64(&["hidden_size", "n_embd", "dim"])?;
    let n_ff = cfg.req_u64(&["intermediate_size", "n_inner", "hidden_dim"])?;
    let n_head = cfg.req_u64(&["num_attention_heads", "n_head", "n_heads"])?;
    let n_head_kv = cfg
        .u64(&["num_key_value_heads", "n_kv_heads"])
        .unwrap_or(n_head);
    if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
        bail!("config.json: num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}");
    }
    let head_dim = cfg.u64(&["head_dim"]).unwrap_or(n_embd / n_head);
    let n_vocab = cfg.req_u64(&["vocab_size"])?;
    let n_expert = match family {
        Family::Mixtral | Family::Qwen3Moe | Family::Deepseek2 => {
            cfg.req_u64(&["num_local_experts", "num_experts", "n_routed_experts"])?
        }
        _ => 0,
    };
    let moe_ff = match family {
        Family::Qwen3Moe | Family::Deepseek2 => cfg.req_u64(&["moe_intermediate_size"])?,
        _ => n_ff,
    };
    if family == Family::Deepseek2 {
        super::deepseek::Mla::read(cfg)?; // fail early on missing MLA dimensions
    }
    let tied = cfg
        .get("tie_word_embeddings")
        .and_then(Json::as_bool)
        .unwrap_or(true);
    Ok(Hparams {
        n_layer,
        n_embd,
        n_ff,
        n_head,
        n_head_kv,
        head_dim,
        n_vocab,
        n_expert,
        moe_ff,
        tied,
    })
}

/// `rope_parameters` (or `rope_scaling`), completed from top-level keys as `TextModel.__init__`
/// does.
fn rope_parameters(cfg: &Config) -> Map<String, Json> {
    let mut rp = cfg
        .get("rope_parameters")
        .or_else(|| cfg.get("rope_scaling"))
        .and_then(Json::as_object)
        .cloned()
        .unwrap_or_default();
    if !rp.contains_key("full_attention") && !rp.contains_key("sliding_attention") {
        let local = cfg.f64(&[
            "local_rope_theta",
            "rope_local_theta",
            "rope_theta_local",
            "swa_rope_theta",
            "rope_local_base_freq",
        ]);
        if let Some(l) = local {
            rp.insert(
                "sliding_attention".into(),
                serde_json::json!({ "rope_theta": l }),
            );
        }
        let global = cfg.f64(&[
            "global_rope_theta",
            "rope_global_theta",
            "rope_theta_global",
            "rope_theta",
            "rotary_emb_base",
        ]);
        if let Some(g) = global.filter(|_| !rp.contains_key("rope_theta")) {
            rp.insert("rope_theta".into(), g.into());
        }
        if !rp.contains_key("rope_type") {
            if let Some(t) = rp.get("type").cloned() {
                rp.insert("rope_type".into(), t);
            }
        }
        if let Some(p) = cfg
            .f64(&["partial_rotary_factor", "rope_pct", "rope_percent"])
            .filter(|_| !rp.contains_key("partial_rotary_factor"))
        {
            rp.insert("partial_rotary_factor".into(), p.into());
        }
        if let Some(o) = cfg
            .u64(&["original_max_position_embeddings"])
            .filter(|_| !rp.contains_key("original_max_position_embeddings"))
        {
            rp.insert("original_max_position_embeddings".into(), o.into());
        }
    }
    rp
}

/// The parameters of the full-attention layers' RoPE.
fn full_rope(rp: &Map<String, Json>) -> &Map<String, Json> {
    rp.get("full_attention")
        .and_then(Json::as_object)
        .unwrap_or(rp)
}

fn u32_kv(k: String, v: u64) -> (String, Value) {
    (k, Value::U32(v as u32))
}

fn f32_kv(k: String, v: f64) -> (String, Value) {
    (k, Value::F32(v as f32))
}

/// The `{arch}.*` keys (and `general.file_type`) `convert_hf_to_gguf.py` writes.
fn arch_metadata(
    family: Family,
    cfg: &Config,
    hp: &Hparams,
    rp: &Map<String, Json>,
    target: Target,
) -> Result<Vec<(String, Value)>> {
    let arch = family.gguf_arch();
    let k = |s: &str| format!("{arch}.{s}");
    let mut kv: Vec<(String, Value)> = Vec::new();
    let set = |kv: &mut Vec<(String, Value)>, item: (String, Value)| match kv
        .iter_mut()
        .find(|(key, _)| *key == item.0)
    {
        Some(slot) => slot.1 = item.1,
        None => kv.push(item),
    };
    let ctx_keys = [
        "max_position_embeddings",
        "n_ctx",
        "n_positions",
        "max_length",
        "max_sequence_length",
        "model_max_length",
    ];
    let full = full_rope(rp);
    if family == Family::Phi3 {
        // Phi3MiniModel.set_gguf_parameters (does not call the base).
        let orig = rp
            .get("original_max_position_embeddings")
            .and_then(Json::as_u64)
            .context("config.json: Phi-3 needs original_max_position_embeddings")?;
        let rot = rp
            .get("partial_rotary_factor")
            .and_then(Json::as_f64)
            .unwrap_or(1.0);
        kv.push(u32_kv(
            k("context_length"),
            cfg.req_u64(&["n_positions", "max_position_embeddings"])?,
        ));
        kv.push(u32_kv(k("rope.scaling.original_context_length"), orig));
        kv.push(u32_kv(k("embedding_length"), hp.n_embd));
        kv.push(u32_kv(k("feed_forward_length"), hp.n_ff));
        kv.push(u32_kv(k("block_count"), hp.n_layer));
        kv.push(u32_kv(k("attention.head_count"), hp.n_head));
        kv.push(u32_kv(k("attention.head_count_kv"), hp.n_head_kv));
        kv.push(f32_kv(
            k("attention.layer_norm_rms_epsilon"),
            cfg.f64(&["rms_norm_eps"])
                .context("config.json has no rms_norm_eps")?,
        ));
        kv.push(u32_kv(
            k("rope.dimension_count"),
            ((rot * hp.n_embd as f64) as u64) / hp.n_head,
        ));
        kv.push(f32_kv(
            k("rope.freq_base"),
            full.get("rope_theta")
                .and_then(Json::as_f64)
                .context("config.json has no rope_theta")?,
        ));
        kv.push(u32_kv(
            "general.file_type".into(),
            target.file_type() as u64,
        ));
        let sw = cfg.u64(&["sliding_window"]).unwrap_or(0);
        kv.push(u32_kv(k("attention.sliding_window"), sw));
        if full.get("long_factor").is_some() {
            bail!("Phi-3 long-context RoPE factors (rope_scaling.long_factor) are not supported");
        }
        return Ok(kv);
    }

    // TextModel.set_gguf_parameters
    kv.push(u32_kv(k("block_count"), hp.n_layer));
    if let Some(n) = cfg.u64(&ctx_keys) {
        kv.push(u32_kv(k("context_length"), n));
    }
    kv.push(u32_kv(k("embedding_length"), hp.n_embd));
    if let Some(n) = cfg.u64(&[
        "prefix_dense_intermediate_size",
        "dense_intermediate_size",
        "intermediate_size",
        "n_inner",
        "hidden_dim",
    ]) {
        kv.push(u32_kv(k("feed_forward_length"), n));
    }
    kv.push(u32_kv(k("attention.head_count"), hp.n_head));
    if let Some(n) = cfg.u64(&["num_key_value_heads", "n_kv_heads"]) {
        kv.push(u32_kv(k("attention.head_count_kv"), n));
    }
    let rope_type = full.get("rope_type").and_then(Json::as_str);
    let factor = full.get("factor").and_then(Json::as_f64);
    match (rope_type, factor) {
        (Some("linear"), Some(f)) => {
            kv.push((k("rope.scaling.type"), Value::String("linear".into())));
            kv.push(f32_kv(k("rope.scaling.factor"), f));
        }
        (Some("yarn"), Some(f)) => {
            kv.push((k("rope.scaling.type"), Value::String("yarn".into())));
            kv.push(f32_kv(k("rope.scaling.factor"), f));
            let orig = full
                .get("original_max_position_embeddings")
                .and_then(Json::as_u64)
                .context("config.json: yarn RoPE scaling needs original_max_position_embeddings")?;
            kv.push(u32_kv(k("rope.scaling.original_context_length"), orig));
            for (src, dst) in [
                ("extrapolation_factor", "rope.scaling.yarn_ext_factor"),
                ("attention_factor", "rope.scaling.yarn_attn_factor"),
                ("beta_fast", "rope.scaling.yarn_beta_fast"),
                ("beta_slow", "rope.scaling.yarn_beta_slow"),
            ] {
                if let Some(v) = full.get(src).and_then(Json::as_f64) {
                    kv.push(f32_kv(k(dst), v));
                }
            }
        }
        (Some("su" | "longrope"), _) => {
            kv.push((k("rope.scaling.type"), Value::String("longrope".into())));
        }
        (Some("llama3"), _) if !family.permutes_qk() => {
            bail!("llama3 RoPE scaling is only supported for Llama-family models")
        }
        (Some("default" | "llama3" | "dynamic") | None, _) => {}
        (Some(other), _) => bail!("config.json: RoPE type {other:?} is not supported"),
    }
    if let Some(theta) = full.get("rope_theta").and_then(Json::as_f64) {
        kv.push(f32_kv(k("rope.freq_base"), theta));
    }
    if let Some(theta) = rp
        .get("sliding_attention")
        .and_then(|s| s.get("rope_theta"))
        .and_then(Json::as_f64)
    {
        kv.push(f32_kv(k("rope.freq_base_swa"), theta));
    }
    if let Some(eps) = cfg.f64(&["rms_norm_eps", "norm_eps"]) {
        kv.push(f32_kv(k("attention.layer_norm_rms_epsilon"), eps));
    }
    if let Some(n) = cfg.u64(&["num_local_experts", "num_experts", "n_routed_experts"]) {
        kv.push(u32_kv(k("expert_count"), n));
    }
    if let Some(n) = cfg.u64(&[
        "num_experts_per_tok",
        "num_experts_per_token",
        "top_k_experts",
    ]) {
        kv.push(u32_kv(k("expert_used_count"), n));
    }
    if let Some(n) = cfg.u64(&["n_group"]) {
        kv.push(u32_kv(k("expert_group_count"), n));
    }
    if let Some(n) = cfg.u64(&["topk_group"]) {
        kv.push(u32_kv(k("expert_group_used_count"), n));
    }
    if let Some(hd) = cfg.u64(&["head_dim"]) {
        kv.push(u32_kv(k("attention.key_length"), hd));
        kv.push(u32_kv(k("attention.value_length"), hd));
    }
    kv.push(u32_kv(
        "general.file_type".into(),
        target.file_type() as u64,
    ));

    match family {
        Family::Llama | Family::Mistral | Family::Mixtral => {
            kv.push(u32_kv(k("vocab_size"), hp.n_vocab));
            kv.push(u32_kv(k("rope.dimension_count"), hp.head_dim));
            // Not written by llama.cpp's converter (its llama architecture ignores Mistral's
            // sliding window); this crate's engine honours it.
            if family == Family::Mistral {
                if let Some(w) = cfg.u64(&["sliding_window"]) {
                    kv.push(u32_kv(k("attention.sliding_window"), w));
                }
            }
        }
        Family::Qwen3Moe => {
            kv.push(u32_kv(k("expert_feed_forward_length"), hp.moe_ff));
            // llama.cpp always renormalizes Qwen3-MoE's top-k weights; say so when the
            // checkpoint does not (this crate's engine reads the key).
            if cfg.get("norm_topk_prob").and_then(Json::as_bool) == Some(false) {
                kv.push((k("expert_weights_norm"), Value::Bool(false)));
            }
            if let Some(n) = cfg.u64(&["shared_expert_intermediate_size"]) {
                kv.push(u32_kv(k("expert_shared_feed_forward_length"), n));
            }
        }
        Family::Gemma3 => {
            set(
                &mut kv,
                u32_kv(
                    k("context_length"),
                    cfg.u64(&["max_position_embeddings"]).unwrap_or(131_072),
                ),
            );
            set(&mut kv, u32_kv(k("attention.head_count"), hp.n_head));
            set(
                &mut kv,
                f32_kv(
                    k("attention.layer_norm_rms_epsilon"),
                    cfg.f64(&["rms_norm_eps"]).unwrap_or(1e-6),
                ),
            );
            set(&mut kv, u32_kv(k("attention.key_length"), hp.head_dim));
            set(&mut kv, u32_kv(k("attention.value_length"), hp.head_dim));
            let theta = full
                .get("rope_theta")
                .and_then(Json::as_f64)
                .unwrap_or(1_000_000.0);
            set(&mut kv, f32_kv(k("rope.freq_base"), theta));
            if cfg.get("attn_logit_softcapping").is_some() {
                bail!("Gemma 3 checkpoints do not use attn_logit_softcapping; this config sets it");
            }
            if let Some(c) = cfg.f64(&["final_logit_softcapping"]).filter(|&c| c != 0.0) {
                set(&mut kv, f32_kv(k("final_logit_softcapping"), c));
            }
            if cfg.u64(&["sliding_window_pattern"]) != Some(1) {
                set(
                    &mut kv,
                    u32_kv(
                        k("attention.sliding_window"),
                        cfg.req_u64(&["sliding_window"])?,
                    ),
                );
            }
            // Which layers slide, when config.json says (`layer_types`): llama.cpp assumes five
            // sliding layers then a global one, which a checkpoint need not follow.
            if let Some(types) = cfg.get("layer_types").and_then(Json::as_array) {
                let flags = types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(Value::Bool(true)),
                        Some("full_attention") => Ok(Value::Bool(false)),
                        _ => bail!("config.json: unknown layer type {t} in layer_types"),
                    })
                    .collect::<Result<Vec<_>>>()?;
                if flags.len() as u64 != hp.n_layer {
                    bail!(
                        "config.json: layer_types has {} entries for {} layers",
                        flags.len(),
                        hp.n_layer
                    );
                }
                set(
                    &mut kv,
                    (k("attention.sliding_window_pattern"), Value::Array(flags)),
                );
            }
            set(
                &mut kv,
                u32_kv(
                    k("attention.head_count_kv"),
                    cfg.u64(&["num_key_value_heads"]).unwrap_or(4),
                ),
            );
        }
        Family::Deepseek2 => {
            for item in super::deepseek::metadata(cfg, hp)? {
                set(&mut kv, item);
            }
        }
        Family::Qwen2 | Family::Qwen3 | Family::Phi3 => {}
    }
    Ok(kv)
}

/// Llama 3 RoPE frequency factors (`LlamaModel.generate_extra_tensors`), computed in f32 like the
/// converter's torch code.
fn llama3_rope_factors(rope: &Map<String, Json>, head_dim: u64) -> Vec<f32> {
    let get = |k: &str, d: f64| rope.get(k).and_then(Json::as_f64).unwrap_or(d) as f32;
    let base = get("rope_theta", 10_000.0);
    let factor = get("factor", 8.0);
    let low = get("low_freq_factor", 1.0);
    let high = get("high_freq_factor", 4.0);
    let old_ctx = get("original_max_position_embeddings", 8192.0);
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    let dim = head_dim as f32;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf((2 * i) as f32 / dim);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// Per-layer Hugging Face names (after `model.layers.N.`, without `.weight` / `.bias`) and the
/// llama.cpp names they map to.
fn layer_names(family: Family) -> Vec<(&'static str, &'static str)> {
    let mut m = vec![
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("self_attn.q_norm", "attn_q_norm"),
        ("self_attn.k_norm", "attn_k_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    match family {
        Family::Gemma3 => m.extend([
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
        ]),
        Family::Phi3 => m.extend([
            ("post_attention_layernorm", "ffn_norm"),
            ("self_attn.qkv_proj", "attn_qkv"),
            ("mlp.gate_up_proj", "ffn_up"),
        ]),
        Family::Mixtral => m.extend([
            ("post_attention_layernorm", "ffn_norm"),
            ("block_sparse_moe.gate", "ffn_gate_inp"),
        ]),
        Family::Qwen3Moe => m.extend([
            ("post_attention_layernorm", "ffn_norm"),
            ("mlp.gate", "ffn_gate_inp"),
        ]),
        Family::Deepseek2 => m.extend(super::deepseek::LAYER_NAMES),
        _ => m.push(("post_attention_layernorm", "ffn_norm")),
    }
    m
}

/// Which per-expert projection a tensor name is: `(layer, expert, gguf base name)`.
fn expert_of(family: Family, layer_rest: &str) -> Option<(usize, &'static str)> {
    let (prefix, table): (&str, &[(&str, &str)]) = match family {
        Family::Mixtral => (
            "block_sparse_moe.experts.",
            &[
                ("w1", "ffn_gate_exps"),
                ("w2", "ffn_down_exps"),
                ("w3", "ffn_up_exps"),
            ],
        ),
        Family::Qwen3Moe | Family::Deepseek2 => (
            "mlp.experts.",
            &[
                ("gate_proj", "ffn_gate_exps"),
                ("down_proj", "ffn_down_exps"),
                ("up_proj", "ffn_up_exps"),
            ],
        ),
        _ => return None,
    };
    let rest = layer_rest.strip_prefix(prefix)?.strip_suffix(".weight")?;
    let (e, proj) = rest.split_once('.')?;
    let e: usize = e.parse().ok()?;
    table
        .iter()
        .find(|(hf, _)| *hf == proj)
        .map(|&(_, g)| (e, g))
}

/// An expected output tensor.
struct Expect {
    /// ggml order.
    dims: Vec<u64>,
    required: bool,
}

fn is_moe_layer(family: Family, cfg: &Config, hp: &Hparams, layer: u64) -> bool {
    match family {
        Family::Mixtral => true,
        Family::Qwen3Moe => {
            let mlp_only = cfg
                .get("mlp_only_layers")
                .and_then(Json::as_array)
                .is_some_and(|l| l.iter().any(|x| x.as_u64() == Some(layer)));
            let step = cfg.u64(&["decoder_sparse_step"]).unwrap_or(1).max(1);
            !mlp_only && hp.n_expert > 0 && (layer + 1) % step == 0
        }
        _ => false,
    }
}

/// Every tensor the output may hold, with its shape from `config.json`.
fn expected(
    family: Family,
    cfg: &Config,
    hp: &Hparams,
    vocab_rows: u64,
) -> HashMap<String, Expect> {
    let (e, hd) = (hp.n_embd, hp.head_dim);
    let (q, kv) = (hp.n_head * hd, hp.n_head_kv * hd);
    let mut m = HashMap::new();
    let mut add = |name: String, dims: Vec<u64>, required: bool| {
        m.insert(name, Expect { dims, required });
    };
    add("token_embd.weight".into(), vec![e, vocab_rows], true);
    add("output_norm.weight".into(), vec![e], true);
    if family != Family::Gemma3 {
        add("output.weight".into(), vec![e, vocab_rows], !hp.tied);
    }
    add("rope_freqs.weight".into(), vec![hd / 2], false);
    let mla = match family {
        Family::Deepseek2 => super::deepseek::Mla::read(cfg).ok(),
        _ => None,
    };
    for l in 0..hp.n_layer {
        let b = |s: &str| format!("blk.{l}.{s}");
        add(b("attn_norm.weight"), vec![e], true);
        add(b("ffn_norm.weight"), vec![e], true);
        if let Some(m) = &mla {
            for (name, dims, required) in super::deepseek::layer_tensors(m, hp, l) {
                add(b(name), dims, required);
            }
            continue;
        }
        add(b("attn_output.weight"), vec![q, e], true);
        add(b("attn_output.bias"), vec![e], false);
        if family == Family::Phi3 {
            add(b("attn_qkv.weight"), vec![e, q + 2 * kv], true);
            add(b("ffn_up.weight"), vec![e, 2 * hp.n_ff], true);
            add(b("ffn_down.weight"), vec![hp.n_ff, e], true);
            continue;
        }
        add(b("attn_q.weight"), vec![e, q], true);
        add(b("attn_k.weight"), vec![e, kv], true);
        add(b("attn_v.weight"), vec![e, kv], true);
        add(b("attn_q.bias"), vec![q], false);
        add(b("attn_k.bias"), vec![kv], false);
        add(b("attn_v.bias"), vec![kv], false);
        if family.has_qk_norm() {
            add(b("attn_q_norm.weight"), vec![hd], true);
            add(b("attn_k_norm.weight"), vec![hd], true);
        }
        if family == Family::Gemma3 {
            add(b("post_attention_norm.weight"), vec![e], true);
            add(b("post_ffw_norm.weight"), vec![e], true);
        }
        if is_moe_layer(family, cfg, hp, l) {
            let (n, ff) = (hp.n_expert, hp.moe_ff);
            add(b("ffn_gate_inp.weight"), vec![e, n], true);
            add(b("ffn_gate_exps.weight"), vec![e, ff, n], true);
            add(b("ffn_up_exps.weight"), vec![e, ff, n], true);
            add(b("ffn_down_exps.weight"), vec![ff, e, n], true);
        } else {
            add(b("ffn_gate.weight"), vec![e, hp.n_ff], true);
            add(b("ffn_up.weight"), vec![e, hp.n_ff], true);
            add(b("ffn_down.weight"), vec![hp.n_ff, e], true);
        }
    }
    m
}

/// Everything needed to write the converted file.
pub struct HfPlan<'a> {
    pub shape: ModelShape,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<PlannedTensor<'a>>,
}

/// Reads `config.json` and picks the architecture, with an error listing the supported ones.
fn family_of(cfg: &Config) -> Result<(Family, String)> {
    let archs: Vec<&str> = cfg
        .get("architectures")
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default();
    let Some(&name) = archs.first() else {
        bail!(
            "config.json has no \"architectures\" entry (supported: {})",
            supported_architectures()
        );
    };
    match ARCHITECTURES.iter().find(|(n, _)| *n == name) {
        Some(&(_, f)) => Ok((f, name.to_owned())),
        None => bail!(
            "unsupported architecture {name} in config.json (supported: {})",
            supported_architectures()
        ),
    }
}

/// Fails unless `dir/config.json` names a supported architecture (checked before any weights are
/// opened).
pub fn check_supported(dir: &Path) -> Result<()> {
    family_of(&Config::load(dir)?).map(|_| ())
}

/// Builds the conversion plan for the checkpoint in `dir` (already opened as `ckpt`).
pub fn plan<'a>(dir: &Path, ckpt: &'a Checkpoint, target: Target) -> Result<HfPlan<'a>> {
    let cfg = Config::load(dir)?;
    let (family, hf_arch) = family_of(&cfg)?;
    let hp = hparams(family, &cfg)?;
    let rp = rope_parameters(&cfg);
    let tokenizer = HfTokenizer::load(dir)?;
    let vocab_rows = if family == Family::Gemma3 {
        hp.n_vocab.min(tokenizer.gemma_real_count() as u64)
    } else {
        hp.n_vocab
    };

    let layer_map = layer_names(family);
    let mut tensors: Vec<PlannedTensor<'a>> = Vec::new();
    let mut hf_name_of: HashMap<String, String> = HashMap::new();
    // (layer, gguf base) → per-expert tensors
    let mut experts: HashMap<(usize, &'static str), Vec<Option<HfTensor<'a>>>> = HashMap::new();
    for name in ckpt.names() {
        let key = name.replace("language_model.", "");
        if key.ends_with(".rotary_emb.inv_freq")
            || key.ends_with(".attention.masked_bias")
            || key.ends_with(".attention.bias")
            || (family == Family::Gemma3 && key == "lm_head.weight")
        {
            continue;
        }
        let t = ckpt.tensor(name)?;
        let unknown = || {
            anyhow::anyhow!(
                "cannot map checkpoint tensor {name} to a llama.cpp tensor for {hf_arch}"
            )
        };
        let gguf_name = match key.as_str() {
            "model.embed_tokens.weight" => "token_embd.weight".to_owned(),
            "model.norm.weight" => "output_norm.weight".to_owned(),
            "lm_head.weight" => "output.weight".to_owned(),
            _ => {
                let rest = key.strip_prefix("model.layers.").ok_or_else(unknown)?;
                let (layer, rest) = rest.split_once('.').ok_or_else(unknown)?;
                let layer: usize = layer.parse().map_err(|_| unknown())?;
                if layer as u64 >= hp.n_layer {
                    bail!("checkpoint tensor {name} is for layer {layer}, but config.json has {} layers", hp.n_layer);
                }
                if let Some((e, base)) = expert_of(family, rest) {
                    if e as u64 >= hp.n_expert {
                        bail!("checkpoint tensor {name} is for expert {e}, but config.json has {} experts", hp.n_expert);
                    }
                    let slot = experts
                        .entry((layer, base))
                        .or_insert_with(|| vec![None; hp.n_expert as usize]);
                    slot[e] = Some(t);
                    continue;
                }
                if family == Family::Deepseek2 && rest == "mlp.gate.e_score_correction_bias" {
                    // DeepSeek-V3's expert-selection bias (llama.cpp's `exp_probs_b`).
                    format!("blk.{layer}.exp_probs_b.bias")
                } else {
                    let (stem, suffix) = rest
                        .strip_suffix(".weight")
                        .map(|s| (s, "weight"))
                        .or_else(|| rest.strip_suffix(".bias").map(|s| (s, "bias")))
                        .ok_or_else(unknown)?;
                    let base = layer_map
                        .iter()
                        .find(|(hf, _)| *hf == stem)
                        .map(|&(_, g)| g)
                        .ok_or_else(unknown)?;
                    format!("blk.{layer}.{base}.{suffix}")
                }
            }
        };
        let permute = if family.permutes_qk() {
            if key.ends_with("q_proj.weight") || key.ends_with("q_proj.bias") {
                Some(RopePermute {
                    n_head: hp.n_head as usize,
                })
            } else if key.ends_with("k_proj.weight") || key.ends_with("k_proj.bias") {
                Some(RopePermute {
                    n_head: hp.n_head_kv as usize,
                })
            } else {
                None
            }
        } else {
            None
        };
        let add = if family == Family::Gemma3 && key.ends_with("norm.weight") {
            1.0
        } else {
            0.0
        };
        let mut dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        if dims.is_empty() {
            bail!("checkpoint tensor {name} is a scalar");
        }
        if gguf_name == "token_embd.weight" && dims.len() == 2 && dims[1] > vocab_rows {
            dims[1] = vocab_rows; // Gemma 3: drop rows past the tokenizer's vocabulary
        }
        if let Some(p) = permute {
            let len = t.shape[0];
            if len % (2 * p.n_head) != 0 {
                bail!("checkpoint tensor {name}: {len} rows do not split into {} heads of rotary pairs", p.n_head);
            }
        }
        if hf_name_of.insert(gguf_name.clone(), name.clone()).is_some() {
            bail!("two checkpoint tensors map to {gguf_name} (the second is {name})");
        }
        tensors.push(PlannedTensor {
            name: gguf_name,
            dims,
            src_type: GgmlType::F32,
            rows: Rows::Hf {
                parts: vec![t],
                permute,
                add,
            },
        });
    }
    let mut expert_keys: Vec<_> = experts.keys().copied().collect();
    expert_keys.sort();
    for key @ (layer, base) in expert_keys {
        let parts = experts.remove(&key).unwrap_or_default();
        let missing: Vec<usize> = (0..parts.len()).filter(|&e| parts[e].is_none()).collect();
        if !missing.is_empty() {
            bail!("checkpoint is missing experts {missing:?} of layer {layer} for {base}");
        }
        let parts: Vec<HfTensor<'a>> = parts.into_iter().flatten().collect();
        let shape = parts[0].shape;
        if let Some(odd) = parts.iter().find(|p| p.shape != shape) {
            bail!(
                "expert tensor {} has shape {:?}, unlike {} with {shape:?}",
                odd.name,
                odd.shape,
                parts[0].name
            );
        }
        if shape.len() != 2 {
            bail!(
                "expert tensor {} has shape {shape:?}, expected a matrix",
                parts[0].name
            );
        }
        let name = format!("blk.{layer}.{base}.weight");
        hf_name_of.insert(
            name.clone(),
            format!("{} and the other experts", parts[0].name),
        );
        tensors.push(PlannedTensor {
            name,
            dims: vec![shape[1] as u64, shape[0] as u64, parts.len() as u64],
            src_type: GgmlType::F32,
            rows: Rows::Hf {
                parts,
                permute: None,
                add: 0.0,
            },
        });
    }
    let full = full_rope(&rp);
    if family.permutes_qk() && full.get("rope_type").and_then(Json::as_str) == Some("llama3") {
        let factors = llama3_rope_factors(full, hp.head_dim);
        hf_name_of.insert(
            "rope_freqs.weight".into(),
            "(computed from rope_parameters)".into(),
        );
        tensors.push(PlannedTensor {
            name: "rope_freqs.weight".into(),
            dims: vec![factors.len() as u64],
            src_type: GgmlType::F32,
            rows: Rows::Values(factors),
        });
    }

    // Shapes and completeness, before any data is read.
    let expect = expected(family, &cfg, &hp, vocab_rows);
    for t in &tensors {
        let hf = &hf_name_of[&t.name];
        let Some(x) = expect.get(&t.name) else {
            bail!(
                "checkpoint tensor {hf} maps to {}, which the {} architecture does not have",
                t.name,
                family.gguf_arch()
            );
        };
        if x.dims != t.dims {
            let rev = |d: &[u64]| d.iter().rev().copied().collect::<Vec<_>>();
            bail!(
                "checkpoint tensor {hf} has shape {:?}, but config.json implies {:?} (for {})",
                rev(&t.dims),
                rev(&x.dims),
                t.name
            );
        }
    }
    let mut missing: Vec<&String> = expect
        .iter()
        .filter(|(n, x)| x.required && !hf_name_of.contains_key(*n))
        .map(|(n, _)| n)
        .collect();
    if !missing.is_empty() {
        missing.sort_by(|a, b| super::policy::loader_order(a, b));
        let shown: Vec<String> = missing.iter().take(5).map(|s| s.to_string()).collect();
        bail!(
            "checkpoint is missing {} tensor(s) {} needs: {}{}",
            missing.len(),
            hf_arch,
            shown.join(", "),
            if missing.len() > 5 { ", ..." } else { "" }
        );
    }
    tensors.sort_by(|a, b| super::policy::loader_order(&a.name, &b.name));

    let arch = family.gguf_arch();
    // The folder's name as given (a `.` or `..` is resolved), like the converter's fallback.
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .or_else(|| {
            let p = dir.canonicalize().ok()?;
            p.file_name().map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "model".into());
    let mut metadata = vec![
        (
            "general.architecture".to_owned(),
            Value::String(arch.into()),
        ),
        ("general.type".to_owned(), Value::String("model".into())),
        ("general.name".to_owned(), Value::String(name)),
    ];
    metadata.extend(arch_metadata(family, &cfg, &hp, &rp, target)?);
    metadata.push(("general.quantization_version".into(), Value::U32(2)));
    metadata.extend(tokenizer.metadata(vocab_rows as usize, &cfg.root)?);

    Ok(HfPlan {
        shape: ModelShape {
            arch: arch.into(),
            n_layer: hp.n_layer as usize,
            n_expert: hp.n_expert as usize,
            n_head: hp.n_head as usize,
            n_head_kv: hp.n_head_kv as usize,
        },
        metadata,
        tensors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_factors_follow_the_formula() {
        let rope: Map<String, Json> = serde_json::from_str(
            r#"{"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}"#,
        )
        .unwrap();
        let f = llama3_rope_factors(&rope, 128);
        assert_eq!(f.len(), 64);
        // High frequencies untouched, low frequencies divided by the full factor.
        assert_eq!(f[0], 1.0);
        assert_eq!(f[63], 8.0);
        assert!(f.iter().all(|&x| (1.0..=8.0).contains(&x)));
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn expert_names_parse() {
        assert_eq!(
            expert_of(Family::Mixtral, "block_sparse_moe.experts.3.w2.weight"),
            Some((3, "ffn_down_exps"))
        );
        assert_eq!(
            expert_of(Family::Qwen3Moe, "mlp.experts.7.up_proj.weight"),
            Some((7, "ffn_up_exps"))
        );
        assert_eq!(
            expert_of(Family::Llama, "mlp.experts.7.up_proj.weight"),
            None
        );
    }
}
