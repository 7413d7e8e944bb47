//! The `{arch}.*` metadata llama.cpp's `convert_hf_to_gguf.py` writes for a checkpoint: the
//! hyperparameters read from `config.json` (with the converter's fallbacks and defaults), RoPE
//! parameters (incl. Llama 3 scaling and its `rope_freqs` factors) and per-architecture keys.

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value as Json};

use super::{Config, Family, Hparams};
use crate::convert::target::Target;
use crate::format::Value;

pub(super) fn hparams(family: Family, cfg: &Config) -> Result<Hparams> {
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
        crate::convert::deepseek::Mla::read(cfg)?; // fail early on missing MLA dimensions
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
pub(super) fn rope_parameters(cfg: &Config) -> Map<String, Json> {
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
pub(super) fn full_rope(rp: &Map<String, Json>) -> &Map<String, Json> {
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
pub(super) fn arch_metadata(
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
            for item in crate::convert::deepseek::metadata(cfg, hp)? {
                set(&mut kv, item);
            }
        }
        Family::Qwen2 | Family::Qwen3 | Family::Phi3 => {}
    }
    Ok(kv)
}

/// Llama 3 RoPE frequency factors (`LlamaModel.generate_extra_tensors`), computed in f32 like the
/// converter's torch code.
pub(super) fn llama3_rope_factors(rope: &Map<String, Json>, head_dim: u64) -> Vec<f32> {
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
