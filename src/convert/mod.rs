//! Model conversion and quantization (`infer quantize`): Hugging Face safetensors checkpoints to
//! GGUF, and GGUF to GGUF of another type.
//!
//! Owns: reading checkpoints ([`safetensors`]), mapping Hugging Face architectures, metadata and
//! tokenizers to llama.cpp's names ([`hf`], [`deepseek`], [`vocab`]), llama.cpp's per-tensor type
//! policy ([`policy`], [`target`]) and the parallel convert-and-write loop ([`pipeline`]).
//!
//! Invariants: output files carry the keys and tensor names llama.cpp's `convert_hf_to_gguf.py`
//! and `llama-quantize` write, so llama.cpp and gguf-py read them; the per-tensor types are the
//! ones `llama-quantize` would pick for the same tensors; inputs are read through memory maps and
//! the output appears under its final name only once complete (temporary file + rename).
//! Known deviations from llama.cpp are documented where they happen (pre-tokenizer detection and
//! SentencePiece scores in [`vocab`], Mistral's sliding window in [`hf`]).

pub mod deepseek;
pub mod hf;
pub mod pipeline;
pub mod policy;
pub mod safetensors;
pub mod synthetic;
pub mod target;
pub mod vocab;

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result};

use crate::format::{GgmlType, Gguf, Value};
use pipeline::{PlannedTensor, Rows, Summary};
use policy::{ModelShape, TensorDesc};
pub use target::Target;

/// How to convert.
#[derive(Clone, Debug)]
pub struct Options {
    pub target: Target,
    /// Threads for quantization (at least 1).
    pub threads: usize,
    /// Importance matrix weighting the quantization error of the tensors it has entries for.
    pub imatrix: Option<std::sync::Arc<crate::eval::imatrix::Imatrix>>,
}

/// What a conversion wrote.
#[derive(Clone, Debug)]
pub struct Report {
    pub summary: Summary,
    /// The type of every tensor written, in file order.
    pub types: Vec<(String, GgmlType)>,
}

impl Report {
    /// `"F32: 25, Q4_K: 98, Q6_K: 15"`, types in id order.
    pub fn type_counts(&self) -> String {
        let mut counts: BTreeMap<u32, (GgmlType, usize)> = BTreeMap::new();
        for (_, t) in &self.types {
            counts.entry(t.id()).or_insert((*t, 0)).1 += 1;
        }
        counts
            .values()
            .map(|(t, n)| format!("{}: {n}", t.name()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn choose_and_write(
    out: &Path,
    metadata: Vec<(String, Value)>,
    shape: &ModelShape,
    tensors: &[PlannedTensor],
    opts: &Options,
) -> Result<Report> {
    let descs: Vec<TensorDesc> = tensors
        .iter()
        .map(|t| TensorDesc {
            name: &t.name,
            dims: &t.dims,
            ty: t.src_type,
        })
        .collect();
    let types = policy::choose_types(opts.target, shape, &descs)?;
    let summary = pipeline::write_gguf(
        out,
        metadata,
        tensors,
        &types,
        opts.threads,
        opts.imatrix.as_deref(),
    )?;
    Ok(Report {
        summary,
        types: tensors.iter().map(|t| t.name.clone()).zip(types).collect(),
    })
}

/// Converts the Hugging Face checkpoint folder `dir` (config.json, safetensors, tokenizer.json,
/// tokenizer_config.json) to a GGUF file at `out`.
pub fn convert_hf(dir: &Path, out: &Path, opts: &Options) -> Result<Report> {
    hf::check_supported(dir)?;
    let ckpt = safetensors::Checkpoint::open(dir)?;
    let plan = hf::plan(dir, &ckpt, opts.target)?;
    choose_and_write(out, plan.metadata, &plan.shape, &plan.tensors, opts)
}

/// The architecture facts the type policy needs, from a GGUF file's metadata.
fn gguf_shape(g: &Gguf) -> Result<ModelShape> {
    let arch = g
        .architecture()
        .context("general.architecture is missing")?
        .to_owned();
    // Per-layer arrays (some architectures) count by their first element.
    let num = |k: &str| -> Option<usize> {
        let v = g.get(&format!("{arch}.{k}"))?;
        v.as_u64()
            .or_else(|| v.as_array().and_then(|a| a.first()).and_then(Value::as_u64))
            .map(|x| x as usize)
    };
    let n_head = num("attention.head_count").unwrap_or(0);
    Ok(ModelShape {
        n_layer: num("block_count").with_context(|| format!("{arch}.block_count is missing"))?,
        n_expert: num("expert_count").unwrap_or(0),
        n_head,
        n_head_kv: num("attention.head_count_kv").unwrap_or(n_head),
        arch,
    })
}

/// Re-quantizes the GGUF file `input` to `out`: every tensor llama.cpp would quantize is decoded
/// and encoded as the target chooses; the others, and tensors already of their chosen type, are
/// copied unchanged. Metadata is kept, with `general.file_type` updated.
pub fn requantize(input: &Path, out: &Path, opts: &Options) -> Result<Report> {
    let g = Gguf::open(input)?;
    let shape = gguf_shape(&g)?;
    let mut metadata: Vec<(String, Value)> = g
        .metadata()
        .iter()
        .filter(|(k, _)| !k.starts_with("split."))
        .cloned()
        .collect();
    for (k, v) in [
        ("general.quantization_version", Value::U32(2)),
        ("general.file_type", Value::U32(opts.target.file_type())),
    ] {
        match metadata.iter_mut().find(|(key, _)| key == k) {
            Some(slot) => slot.1 = v,
            None => metadata.push((k.to_owned(), v)),
        }
    }
    let tensors: Vec<PlannedTensor> = g
        .tensors
        .iter()
        .map(|t| PlannedTensor {
            name: t.name.clone(),
            dims: t.dims.clone(),
            src_type: t.ty,
            rows: Rows::Gguf {
                ty: t.ty,
                data: g.tensor_data(t),
            },
        })
        .collect();
    choose_and_write(out, metadata, &shape, &tensors, opts)
}
