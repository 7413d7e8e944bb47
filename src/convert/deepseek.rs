//! DeepSeek-V3 (`DeepseekV3ForCausalLM`) → llama.cpp's `deepseek2` architecture: the metadata keys
//! `DeepseekV2Model.set_gguf_parameters` writes and the shapes of the MLA attention, dense
//! and expert tensors. The file uses llama.cpp's unsplit layout (`attn_kv_b`, with
//! `attention.key_length` = nope + rope dims and `attention.value_length` = v_head_dim), which
//! llama.cpp loads as multi-head attention; the `attn_k_b`/`attn_v_b` split of newer llama.cpp
//! files (absorbed MLA) is not written.

use anyhow::{bail, Context, Result};
use serde_json::Value as Json;

use super::hf::{Config, Hparams};
use crate::format::Value;

/// The MLA dimensions of `config.json`.
pub(super) struct Mla {
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub nope: u64,
    pub rope: u64,
    pub v_dim: u64,
    pub first_dense: u64,
    pub n_shared: u64,
}

impl Mla {
    pub fn read(cfg: &Config) -> Result<Mla> {
        Ok(Mla {
            q_lora_rank: cfg.u64(&["q_lora_rank"]),
            kv_lora_rank: cfg.req_u64(&["kv_lora_rank"])?,
            nope: cfg.req_u64(&["qk_nope_head_dim"])?,
            rope: cfg.req_u64(&["qk_rope_head_dim"])?,
            v_dim: cfg.req_u64(&["v_head_dim"])?,
            first_dense: cfg.u64(&["first_k_dense_replace"]).unwrap_or(0),
            n_shared: cfg.u64(&["n_shared_experts"]).unwrap_or(0),
        })
    }
}

/// The `deepseek2.*` keys beyond the common ones (they replace common keys of the same name).
pub(super) fn metadata(cfg: &Config, hp: &Hparams) -> Result<Vec<(String, Value)>> {
    let m = Mla::read(cfg)?;
    let k = |s: &str| format!("deepseek2.{s}");
    let u = |s: &str, v: u64| (k(s), Value::U32(v as u32));
    let mut kv = vec![
        u("leading_dense_block_count", m.first_dense),
        u("vocab_size", hp.n_vocab),
        u("attention.kv_lora_rank", m.kv_lora_rank),
        u("attention.key_length", m.nope + m.rope),
        u("attention.value_length", m.v_dim),
        u("expert_feed_forward_length", hp.moe_ff),
        u("expert_shared_count", m.n_shared),
        u("rope.dimension_count", m.rope),
        (
            k("expert_weights_scale"),
            Value::F32(cfg.f64(&["routed_scaling_factor"]).unwrap_or(1.0) as f32),
        ),
        (
            k("expert_weights_norm"),
            Value::Bool(
                cfg.get("norm_topk_prob")
                    .and_then(Json::as_bool)
                    .unwrap_or(false),
            ),
        ),
    ];
    if let Some(r) = m.q_lora_rank {
        kv.push(u("attention.q_lora_rank", r));
    }
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE: 1 softmax, 2 sigmoid (DeepSeek-V3's default).
    let gating = match cfg.get("scoring_func").and_then(Json::as_str) {
        None | Some("sigmoid") => 2,
        Some("softmax") => 1,
        Some(other) => bail!("config.json: DeepSeek scoring_func {other:?} is not supported"),
    };
    kv.push(u("expert_gating_func", gating));
    if cfg.u64(&["n_group"]).unwrap_or(1) > 1 {
        let used = cfg
            .u64(&["topk_group"])
            .context("config.json: n_group without topk_group")?;
        kv.push(u("expert_group_used_count", used));
    }
    Ok(kv)
}

/// Every tensor of one layer, as `(llama.cpp name without "blk.N.", ggml dims, required)`.
pub(super) fn layer_tensors(
    m: &Mla,
    hp: &Hparams,
    layer: u64,
) -> Vec<(&'static str, Vec<u64>, bool)> {
    let (e, nh) = (hp.n_embd, hp.n_head);
    let qk = m.nope + m.rope;
    let mut t = vec![
        (
            "attn_kv_a_mqa.weight",
            vec![e, m.kv_lora_rank + m.rope],
            true,
        ),
        ("attn_kv_a_norm.weight", vec![m.kv_lora_rank], true),
        (
            "attn_kv_b.weight",
            vec![m.kv_lora_rank, nh * (m.nope + m.v_dim)],
            true,
        ),
        ("attn_output.weight", vec![nh * m.v_dim, e], true),
    ];
    match m.q_lora_rank {
        Some(r) => t.extend([
            ("attn_q_a.weight", vec![e, r], true),
            ("attn_q_a_norm.weight", vec![r], true),
            ("attn_q_b.weight", vec![r, nh * qk], true),
        ]),
        None => t.push(("attn_q.weight", vec![e, nh * qk], true)),
    }
    if layer < m.first_dense {
        t.extend([
            ("ffn_gate.weight", vec![e, hp.n_ff], true),
            ("ffn_up.weight", vec![e, hp.n_ff], true),
            ("ffn_down.weight", vec![hp.n_ff, e], true),
        ]);
        return t;
    }
    let (n, ff) = (hp.n_expert, hp.moe_ff);
    t.extend([
        ("ffn_gate_inp.weight", vec![e, n], true),
        ("exp_probs_b.bias", vec![n], false),
        ("ffn_gate_exps.weight", vec![e, ff, n], true),
        ("ffn_up_exps.weight", vec![e, ff, n], true),
        ("ffn_down_exps.weight", vec![ff, e, n], true),
    ]);
    if m.n_shared > 0 {
        let sff = ff * m.n_shared;
        t.extend([
            ("ffn_gate_shexp.weight", vec![e, sff], true),
            ("ffn_up_shexp.weight", vec![e, sff], true),
            ("ffn_down_shexp.weight", vec![sff, e], true),
        ]);
    }
    t
}

/// Hugging Face per-layer names (after `model.layers.N.`, without `.weight`) and llama.cpp's.
pub(super) const LAYER_NAMES: [(&str, &str); 12] = [
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.q_a_proj", "attn_q_a"),
    ("self_attn.q_a_layernorm", "attn_q_a_norm"),
    ("self_attn.q_b_proj", "attn_q_b"),
    ("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"),
    ("self_attn.kv_a_layernorm", "attn_kv_a_norm"),
    ("self_attn.kv_b_proj", "attn_kv_b"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate", "ffn_gate_inp"),
    ("mlp.shared_experts.gate_proj", "ffn_gate_shexp"),
    ("mlp.shared_experts.up_proj", "ffn_up_shexp"),
    ("mlp.shared_experts.down_proj", "ffn_down_shexp"),
];
