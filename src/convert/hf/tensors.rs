//! Where each output tensor comes from and what shape it must have: per-layer Hugging Face names
//! mapped to llama.cpp's, per-expert matrices, and the shapes `config.json` implies.

use std::collections::HashMap;

use serde_json::Value as Json;

use super::{Config, Family, Hparams};

/// Per-layer Hugging Face names (after `model.layers.N.`, without `.weight` / `.bias`) and the
/// llama.cpp names they map to.
pub(super) fn layer_names(family: Family) -> Vec<(&'static str, &'static str)> {
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
        Family::Deepseek2 => m.extend(crate::convert::deepseek::LAYER_NAMES),
        _ => m.push(("post_attention_layernorm", "ffn_norm")),
    }
    m
}

/// Which per-expert projection a tensor name is: `(layer, expert, gguf base name)`.
pub(super) fn expert_of(family: Family, layer_rest: &str) -> Option<(usize, &'static str)> {
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
pub(super) struct Expect {
    /// ggml order.
    pub dims: Vec<u64>,
    pub required: bool,
}

pub(super) fn is_moe_layer(family: Family, cfg: &Config, hp: &Hparams, layer: u64) -> bool {
    match family {
        Family::Mixtral => true,
        Family::Qwen3Moe => {
            let mlp_only = cfg
                .get("mlp_only_layers")
                .and_then(Json::as_array)
                .is_some_and(|l| l.iter().any(|x| x.as_u64() == Some(layer)));
            let step = cfg.u64(&["decoder_sparse_step"]).unwrap_or(1).max(1);
            !mlp_only && hp.n_expert > 0 && (layer + 1).is_multiple_of(step)
        }
        _ => false,
    }
}

/// Every tensor the output may hold, with its shape from `config.json`.
pub(super) fn expected(
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
        Family::Deepseek2 => crate::convert::deepseek::Mla::read(cfg).ok(),
        _ => None,
    };
    for l in 0..hp.n_layer {
        let b = |s: &str| format!("blk.{l}.{s}");
        add(b("attn_norm.weight"), vec![e], true);
        add(b("ffn_norm.weight"), vec![e], true);
        if let Some(m) = &mla {
            for (name, dims, required) in crate::convert::deepseek::layer_tensors(m, hp, l) {
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
