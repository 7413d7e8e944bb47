//! Which type each tensor gets: llama.cpp's `llama_tensor_get_type` (src/llama-quant.cpp) for the
//! targets this crate supports.
//!
//! Three steps, as in llama.cpp: [`allows_quantization`] keeps norms, biases, 1-D tensors and
//! expert routers in their current type; the k-quant mixes then move some tensors to other types
//! (output / tied token embedding to Q6_K, `attn_v` and `ffn_down` to more bits in the layers
//! `use_more_bits` picks, ...); finally [`fallback`] swaps a block type whose block does not divide
//! the row length for one that does (Q4_K → Q5_0, Q6_K → Q8_0, ..., else F16).
//!
//! Invariants: the result depends only on the tensors' names, dims and current types and on the
//! model's layer / head / expert counts — never on the order the caller lists tensors in, because
//! the per-category counters advance in llama.cpp's loader order (`weight_name_comparer`: tensors
//! outside `blk.N.` first, then by layer, then by name). Every returned type divides its tensor's
//! row length into whole blocks.

use std::cmp::Ordering;

use anyhow::{bail, Result};

use super::target::{Mix, Target};
use crate::format::GgmlType;

/// The model facts llama.cpp's policy consults.
#[derive(Clone, Debug, Default)]
pub struct ModelShape {
    /// `general.architecture`.
    pub arch: String,
    /// `{arch}.block_count`.
    pub n_layer: usize,
    /// `{arch}.expert_count` (0 for dense models).
    pub n_expert: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
}

impl ModelShape {
    /// llama.cpp's `LLM_TYPE_70B`, the only model size its policy looks at.
    fn is_70b(&self) -> bool {
        self.n_layer == 80
            && match self.arch.as_str() {
                "llama" => self.n_head != self.n_head_kv,
                "qwen2" => true,
                _ => false,
            }
    }
}

/// One tensor as the policy sees it.
#[derive(Clone, Copy, Debug)]
pub struct TensorDesc<'a> {
    pub name: &'a str,
    /// ggml order: `dims[0]` is the row length.
    pub dims: &'a [u64],
    /// The type the tensor has before quantization (kept when it may not be quantized).
    pub ty: GgmlType,
}

/// llama.cpp's `tensor_category`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    AttentionQkv,
    AttentionKvB,
    AttentionV,
    AttentionK,
    AttentionQ,
    AttentionOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    use Category::*;
    if name == "output.weight" {
        return Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return TokenEmbd;
    }
    let table = [
        ("attn_qkv.weight", AttentionQkv),
        ("attn_kv_b.weight", AttentionKvB),
        ("attn_v.weight", AttentionV),
        ("attn_k.weight", AttentionK),
        ("attn_q.weight", AttentionQ),
        ("attn_output.weight", AttentionOutput),
        ("ffn_up", FfnUp),
        ("ffn_gate", FfnGate),
        ("ffn_down", FfnDown),
    ];
    table
        .iter()
        .find(|(pat, _)| name.contains(pat))
        .map_or(Other, |&(_, c)| c)
}

fn is_attn_v_like(c: Category) -> bool {
    matches!(
        c,
        Category::AttentionV | Category::AttentionQkv | Category::AttentionKvB
    )
}

/// llama.cpp's `tensor_allows_quantization` for the architectures converted here: 2-D and 3-D
/// tensors whose name ends in `weight`, except norms and expert routers.
pub fn allows_quantization(name: &str, n_dims: usize) -> bool {
    if n_dims < 2 || !name.ends_with("weight") {
        return false;
    }
    const NEVER: [&str; 8] = [
        "_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_tid2eid.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d",
        "attn_rel_b.weight",
    ];
    !NEVER.iter().any(|p| name.contains(p))
        && name != "position_embd.weight"
        && name != "token_types.weight"
}

/// `ggml_n_dims`: the number of dimensions, not counting trailing 1s (at least 1).
pub fn ggml_n_dims(dims: &[u64]) -> usize {
    dims.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1)
}

/// `use_more_bits` from llama-quant.cpp (C integer arithmetic; the last clause is only reached
/// with `i >= n / 8`).
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The layer number in `blk.N.…`.
fn layer_of(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    let end = rest.find('.')?;
    rest[..end].parse().ok()
}

/// llama.cpp's `weight_name_comparer`: tensors without a layer first, then by layer, then by name.
pub(crate) fn loader_order(a: &str, b: &str) -> Ordering {
    let la = layer_of(a).map_or(-1, |l| l as i64);
    let lb = layer_of(b).map_or(-1, |l| l as i64);
    la.cmp(&lb).then_with(|| a.cmp(b))
}

/// `tensor_type_fallback`: a type that divides `ncols` into whole blocks.
pub fn fallback(ncols: u64, target: GgmlType) -> GgmlType {
    let bs = target.block_size() as u64;
    if ncols.is_multiple_of(bs) {
        return target;
    }
    let ret = match target {
        GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        // A 32-element block type has nothing smaller to fall back to: F16 below.
        t => t,
    };
    if !ncols.is_multiple_of(ret.block_size() as u64) {
        GgmlType::F16
    } else {
        ret
    }
}

/// Counters llama.cpp keeps while it walks the tensors.
struct State<'s> {
    shape: &'s ModelShape,
    n_attention_wv: usize,
    i_attention_wv: usize,
    i_ffn_down: usize,
    has_tied_embeddings: bool,
}

impl State<'_> {
    /// `layer_info`: the counter for dense models, the name's layer for MoE ones.
    fn layer(&self, counter: usize, name: &str) -> Result<(usize, usize)> {
        let n_layer = self.shape.n_layer;
        if self.shape.n_expert > 1 {
            match layer_of(name) {
                Some(l) if l < n_layer => Ok((l, n_layer)),
                Some(l) => bail!("bad layer {l} for tensor {name}: must be in [0, {n_layer})"),
                None => bail!("cannot determine the layer of tensor {name}"),
            }
        } else {
            Ok((counter, n_layer))
        }
    }

    /// `llama_tensor_get_type_impl` for the k-quant mixes.
    fn mix_type(
        &mut self,
        mix: Mix,
        ty: GgmlType,
        t: &TensorDesc,
        cat: Category,
    ) -> Result<GgmlType> {
        use GgmlType::*;
        let n_expert = self.shape.n_expert;
        let mut new_type = ty;
        if cat == Category::Output || (self.has_tied_embeddings && cat == Category::TokenEmbd) {
            let nx = t.dims[0];
            if self.shape.arch == "falcon" || !nx.is_multiple_of(new_type.block_size() as u64) {
                new_type = Q8_0;
            } else if new_type != Q8_0 {
                new_type = Q6K;
            }
        } else if cat == Category::TokenEmbd {
            // untied token embedding: the default type for these mixes
        } else if is_attn_v_like(cat) {
            match mix {
                Mix::Q3KM => new_type = if self.i_attention_wv < 2 { Q5K } else { Q4K },
                Mix::Q4KM | Mix::Q5KM => {
                    if use_more_bits(self.i_attention_wv, self.n_attention_wv) {
                        new_type = Q6K;
                    }
                }
            }
            if self.shape.is_70b() && matches!(new_type, Q3K | Q4K) {
                new_type = Q5K;
            }
            if n_expert == 8 {
                new_type = Q8_0;
            }
            self.i_attention_wv += 1;
        } else if cat == Category::AttentionK {
            if n_expert == 8 {
                new_type = Q8_0;
            }
        } else if cat == Category::FfnDown {
            let (i_layer, n_layer) = self.layer(self.i_ffn_down, t.name)?;
            let falcon = self.shape.arch == "falcon";
            match mix {
                Mix::Q3KM => {
                    new_type = if i_layer < n_layer / 16 {
                        Q5K
                    } else if !falcon || use_more_bits(i_layer, n_layer) {
                        Q4K
                    } else {
                        Q3K
                    }
                }
                Mix::Q4KM => {
                    if falcon {
                        new_type = if i_layer < n_layer / 16 {
                            Q6K
                        } else if use_more_bits(i_layer, n_layer) {
                            Q5K
                        } else {
                            Q4K
                        };
                    } else if use_more_bits(i_layer, n_layer) {
                        new_type = Q6K;
                    }
                }
                Mix::Q5KM => {
                    if use_more_bits(i_layer, n_layer) {
                        new_type = Q6K;
                    }
                }
            }
            self.i_ffn_down += 1;
        } else if cat == Category::AttentionOutput && self.shape.arch != "falcon" {
            if n_expert == 8 {
                if matches!(mix, Mix::Q3KM | Mix::Q4KM) {
                    new_type = Q5K;
                }
            } else if mix == Mix::Q3KM {
                new_type = Q4K;
            }
        }
        Ok(new_type)
    }
}

/// The type of every tensor in `tensors` (same order) for `target`, as llama.cpp's quantizer
/// would choose them for a model of `shape`.
pub fn choose_types(
    target: Target,
    shape: &ModelShape,
    tensors: &[TensorDesc],
) -> Result<Vec<GgmlType>> {
    let mut state = State {
        shape,
        n_attention_wv: 0,
        i_attention_wv: 0,
        i_ffn_down: 0,
        has_tied_embeddings: true,
    };
    for t in tensors {
        let c = category(t.name);
        if is_attn_v_like(c) {
            state.n_attention_wv += 1;
        }
        if c == Category::Output {
            state.has_tied_embeddings = false;
        }
    }
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| loader_order(tensors[a].name, tensors[b].name));

    let default_type = target.default_type();
    let mut out = vec![GgmlType::F32; tensors.len()];
    for i in order {
        let t = &tensors[i];
        if !allows_quantization(t.name, ggml_n_dims(t.dims)) {
            out[i] = t.ty;
            continue;
        }
        let mut new_type = default_type;
        if target.is_quantized() {
            if let Target::Mix(mix) = target {
                new_type = state.mix_type(mix, new_type, t, category(t.name))?;
            }
            new_type = fallback(t.dims[0], new_type);
        }
        out[i] = new_type;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType::*;

    #[test]
    fn use_more_bits_matches_llama_cpp_counts() {
        // 28 layers (Qwen2.5 1.5B): 14 layers get more bits; 18 layers (Gemma 3 270M): 9.
        assert_eq!((0..28).filter(|&i| use_more_bits(i, 28)).count(), 14);
        assert_eq!((0..18).filter(|&i| use_more_bits(i, 18)).count(), 9);
        let picked: Vec<usize> = (0..18).filter(|&i| use_more_bits(i, 18)).collect();
        assert_eq!(picked, [0, 1, 4, 7, 10, 13, 15, 16, 17]);
    }

    #[test]
    fn fallback_follows_llama_cpp() {
        assert_eq!(fallback(640, Q4K), Q5_0);
        assert_eq!(fallback(640, Q5K), Q5_1);
        assert_eq!(fallback(640, Q6K), Q8_0);
        assert_eq!(fallback(640, Q3K), Q4_0);
        assert_eq!(fallback(512, Q4K), Q4K);
        assert_eq!(fallback(48, Q4K), F16);
        assert_eq!(fallback(48, Q8_0), F16);
        assert_eq!(fallback(64, Q8_0), Q8_0);
    }

    #[test]
    fn allows_quantization_excludes_norms_routers_and_vectors() {
        assert!(allows_quantization("blk.0.attn_q.weight", 2));
        assert!(allows_quantization("blk.0.ffn_down_exps.weight", 3));
        assert!(!allows_quantization("blk.0.attn_q.bias", 1));
        assert!(!allows_quantization("blk.0.attn_norm.weight", 1));
        assert!(!allows_quantization("blk.0.attn_q_norm.weight", 2));
        assert!(!allows_quantization("blk.0.ffn_gate_inp.weight", 2));
        assert!(!allows_quantization("rope_freqs.weight", 1));
    }

    #[test]
    fn q4_k_m_attn_v_and_ffn_down_by_layer() {
        let shape = ModelShape {
            arch: "llama".into(),
            n_layer: 8,
            n_expert: 0,
            n_head: 32,
            n_head_kv: 8,
        };
        let names: Vec<String> = (0..8)
            .flat_map(|l| {
                [
                    format!("blk.{l}.attn_v.weight"),
                    format!("blk.{l}.ffn_down.weight"),
                ]
            })
            .chain(["output.weight".to_string(), "token_embd.weight".to_string()])
            .collect();
        let dims = [4096u64, 4096];
        let descs: Vec<TensorDesc> = names
            .iter()
            .rev() // input order must not matter
            .map(|n| TensorDesc {
                name: n,
                dims: &dims,
                ty: F16,
            })
            .collect();
        let types = choose_types(Target::Mix(Mix::Q4KM), &shape, &descs).unwrap();
        let by_name = |n: &str| types[descs.iter().position(|d| d.name == n).unwrap()];
        // use_more_bits(i, 8): i < 1 || i >= 7 || (i - 1) % 3 == 2 → layers 0, 3, 6, 7.
        for l in 0..8 {
            let want = if [0, 3, 6, 7].contains(&l) { Q6K } else { Q4K };
            assert_eq!(
                by_name(&format!("blk.{l}.attn_v.weight")),
                want,
                "attn_v {l}"
            );
            assert_eq!(
                by_name(&format!("blk.{l}.ffn_down.weight")),
                want,
                "ffn_down {l}"
            );
        }
        assert_eq!(by_name("output.weight"), Q6K);
        assert_eq!(by_name("token_embd.weight"), Q4K);
    }
}
