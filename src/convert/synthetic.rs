//! Synthetic model files: a real model's GGUF header (architecture, hyperparameters, tokenizer,
//! chat template) and tensor list with random weights, for measuring and checking a backend where
//! the real file cannot go (the lent GPU machine takes at most 64 MiB of the working tree).
//!
//! Two steps. [`skeleton`] keeps a file's metadata and describes its tensors in one more key,
//! [`SKELETON_KEY`], with no tensor data (a few MiB for a 1 GB model). [`expand`] turns a skeleton
//! into a full file of the same shapes and types: norms near 1, every other tensor random
//! N(0, 0.02) values quantized to its type by the scalar reference quantizers (16 distinct random
//! rows per tensor, repeated: the content does not change a step's cost, and repeating keeps
//! expansion to seconds). Invariants: the expanded file has exactly the skeleton's source
//! metadata and tensor names, dims and types, in order; the same seed gives the same bytes.

use anyhow::{bail, Context, Result};

use crate::format::{GgmlType, Gguf, GgufWriter, Value};
use crate::quant;

/// The metadata key listing a skeleton's tensors: one string per tensor, `name:type_id:d0,d1,..`.
pub const SKELETON_KEY: &str = "infer.synthetic.tensors";

/// Rows quantized per tensor; the tensor repeats them.
const DISTINCT_ROWS: usize = 16;

/// `g`'s metadata and tensor list, without data.
pub fn skeleton(g: &Gguf) -> Result<GgufWriter> {
    if g.get(SKELETON_KEY).is_some() {
        bail!("this file is already a skeleton");
    }
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add_kv(k, v.clone());
    }
    let list = g
        .tensors
        .iter()
        .map(|t| {
            let dims: Vec<String> = t.dims.iter().map(u64::to_string).collect();
            Value::String(format!("{}:{}:{}", t.name, t.ty.id(), dims.join(",")))
        })
        .collect();
    w.add_kv(SKELETON_KEY, Value::Array(list));
    Ok(w)
}

/// One tensor of a skeleton.
struct Spec {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
}

fn specs(g: &Gguf) -> Result<Vec<Spec>> {
    let Some(list) = g.get(SKELETON_KEY).and_then(Value::as_array) else {
        bail!("not a skeleton: the file has no {SKELETON_KEY} (make one with --skeleton-of)");
    };
    list.iter()
        .map(|v| {
            let s = v.as_str().context("a tensor entry is not a string")?;
            let mut parts = s.rsplitn(3, ':');
            let (dims, ty, name) = (parts.next(), parts.next(), parts.next());
            let (Some(dims), Some(ty), Some(name)) = (dims, ty, name) else {
                bail!("malformed tensor entry {s:?}");
            };
            let ty = ty
                .parse()
                .ok()
                .and_then(GgmlType::from_id)
                .with_context(|| format!("unknown type in {s:?}"))?;
            let dims = dims
                .split(',')
                .map(|d| {
                    d.parse::<u64>()
                        .with_context(|| format!("bad dims in {s:?}"))
                })
                .collect::<Result<Vec<u64>>>()?;
            Ok(Spec {
                name: name.to_string(),
                ty,
                dims,
            })
        })
        .collect()
}

/// splitmix64: a small, seedable stream for the weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Approximately N(0, 1): the sum of four uniforms, rescaled.
    fn normal(&mut self) -> f32 {
        let u: f64 = (0..4)
            .map(|_| (self.next() >> 11) as f64 / (1u64 << 53) as f64)
            .sum();
        ((u - 2.0) * 3f64.sqrt()) as f32
    }
}

/// The bytes of one tensor of `spec`'s shape and type.
fn tensor_data(spec: &Spec, rng: &mut Rng) -> Result<Vec<u8>> {
    let row_len = spec.dims[0] as usize;
    let n_rows: usize = spec.dims[1..].iter().product::<u64>() as usize;
    let is_norm = spec.name.ends_with("norm.weight");
    let distinct = n_rows.clamp(1, DISTINCT_ROWS);
    let mut rows = Vec::with_capacity(distinct);
    let mut values = vec![0f32; row_len];
    for _ in 0..distinct {
        for v in values.iter_mut() {
            *v = if is_norm {
                1.0 + 0.05 * rng.normal()
            } else {
                0.02 * rng.normal()
            };
        }
        let mut bytes = Vec::new();
        quant::quantize_row(spec.ty, &values, &mut bytes)
            .with_context(|| format!("writing {} as {}", spec.name, spec.ty))?;
        rows.push(bytes);
    }
    let row_bytes = rows[0].len();
    let mut data = Vec::with_capacity(row_bytes * n_rows);
    for r in 0..n_rows {
        data.extend_from_slice(&rows[r % distinct]);
    }
    Ok(data)
}

/// The `general.name` of every file [`expand`] writes (how `infer selftest` knows random weights).
pub const SYNTHETIC_NAME: &str = "synthetic (random weights)";

/// A full model file from a skeleton: its metadata (without [`SKELETON_KEY`]) and random tensors.
pub fn expand(skel: &Gguf, seed: u64) -> Result<GgufWriter> {
    let specs = specs(skel)?;
    let mut w = GgufWriter::new();
    for (k, v) in skel.metadata().iter().filter(|(k, _)| k != SKELETON_KEY) {
        w.add_kv(k, v.clone());
    }
    w.add_kv("general.name", Value::String(SYNTHETIC_NAME.into()));
    let mut rng = Rng(seed);
    for s in &specs {
        let data = tensor_data(s, &mut rng)?;
        w.add_tensor(&s.name, &s.dims, s.ty, data)
            .with_context(|| format!("tensor {}", s.name))?;
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small model file: metadata and tensors of three types.
    fn model() -> Gguf {
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", Value::String("llama".into()));
        w.add_kv("llama.block_count", Value::U32(1));
        let mut add = |name: &str, dims: &[u64], ty: GgmlType| {
            let n: u64 = dims.iter().product();
            let mut data = Vec::new();
            quant::quantize_row(ty, &vec![0.5; n as usize], &mut data).unwrap();
            w.add_tensor(name, dims, ty, data).unwrap();
        };
        add("blk.0.attn_norm.weight", &[256], GgmlType::F32);
        add("blk.0.attn_q.weight", &[256, 4], GgmlType::Q4K);
        add("token_embd.weight", &[256, 40], GgmlType::Q6K);
        Gguf::from_bytes(w.to_bytes()).unwrap()
    }

    #[test]
    fn expanded_file_has_the_real_shapes_types_and_metadata() {
        let real = model();
        let skel = Gguf::from_bytes(skeleton(&real).unwrap().to_bytes()).unwrap();
        assert!(skel.tensors.is_empty());
        let full = Gguf::from_bytes(expand(&skel, 7).unwrap().to_bytes()).unwrap();
        let shape = |g: &Gguf| -> Vec<(String, GgmlType, Vec<u64>)> {
            g.tensors
                .iter()
                .map(|t| (t.name.clone(), t.ty, t.dims.clone()))
                .collect()
        };
        assert_eq!(shape(&full), shape(&real));
        assert_eq!(full.get_u64("llama.block_count"), Some(1));
        assert!(full.get(SKELETON_KEY).is_none());
        // Norms near 1, matrices small and not all equal; the values decode.
        let norm = &full.tensors[0];
        let mut v = vec![0f32; 256];
        quant::dequantize_row(norm.ty, full.tensor_data(norm), &mut v).unwrap();
        assert!(v.iter().all(|x| (0.7..1.3).contains(x)), "{:?}", &v[..4]);
        let q = &full.tensors[1];
        quant::dequantize_row(q.ty, &full.tensor_data(q)[..144], &mut v).unwrap();
        assert!(v.iter().all(|x| x.abs() < 0.2) && v.iter().any(|&x| x != v[0]));
        // The same seed, the same bytes; another seed, other bytes.
        let again = expand(&skel, 7).unwrap().to_bytes();
        assert_eq!(again, expand(&skel, 7).unwrap().to_bytes());
        assert_ne!(again, expand(&skel, 8).unwrap().to_bytes());
    }

    #[test]
    fn expanding_a_real_file_is_refused() {
        let err = expand(&model(), 1).err().unwrap();
        assert!(format!("{err}").contains("not a skeleton"), "{err}");
    }
}
