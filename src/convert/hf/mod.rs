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
//! read; output names are unique. This file holds the architecture table, `config.json` and the
//! plan; [`metadata`] the `{arch}.*` keys and hyperparameters, [`tensors`] the name mapping and
//! expected shapes.

mod metadata;
mod tensors;

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
use metadata::{arch_metadata, full_rope, hparams, llama3_rope_factors, rope_parameters};
use tensors::{expected, expert_of, layer_names};

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
