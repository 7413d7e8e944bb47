//! How much GPU memory a model needs with its first `gpu_layers` layers on the GPU, and how many
//! layers fit in a given amount: weights as the CUDA backend stores them (as in the file, Q6_K
//! repacked; f16 for types without a kernel), the KV cache of those layers in its types (f16, or
//! q8_0/q4_0 blocks per `--cache-type-k/-v`), and a margin for activations and scratch. Used by
//! the CLI to refuse a load with a clear message instead of failing midway.

use crate::format::{Gguf, TensorInfo};

/// Bytes kept free beyond the estimate (activations, attention partials, driver overhead).
pub const MARGIN: u64 = 512 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VramPlan {
    pub weights: u64,
    pub kv: u64,
}

impl VramPlan {
    pub fn total(&self) -> u64 {
        self.weights + self.kv + MARGIN
    }
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

fn stored_bytes(t: &TensorInfo) -> u64 {
    let n = t.n_elements();
    if super::ops::gemv_kernel(t.ty).is_some() {
        // Rows as the device holds them (Q6_K's repacked: a few bytes more per row).
        let cols = t.row_len().max(1);
        super::repack::row_bytes(t.ty, cols).map_or(n * 2, |b| n / cols as u64 * b as u64)
    } else {
        n * 2 // dequantized to f16 at load
    }
}

/// The plan for layers `0..gpu_layers` of an `n_layer` model (the embedding table and output
/// head count only when every layer is on the GPU, as `DeviceBackend` places them), whose cache
/// stores `kv_row` bytes (K row, V row) per position and layer (`KvType::row_bytes`; an f32
/// model's cache is f16 on the GPU).
pub fn plan(
    g: &Gguf,
    n_layer: usize,
    gpu_layers: usize,
    n_ctx: usize,
    kv_row: (usize, usize),
) -> VramPlan {
    let gpu_layers = gpu_layers.min(n_layer);
    let weights = g
        .tensors
        .iter()
        .filter(|t| match layer_of(&t.name) {
            Some(l) => l < gpu_layers,
            None => gpu_layers == n_layer,
        })
        .map(stored_bytes)
        .sum();
    let kv = (gpu_layers * n_ctx * (kv_row.0 + kv_row.1)) as u64;
    VramPlan { weights, kv }
}

/// The most layers whose plan fits in `free` bytes.
pub fn layers_that_fit(
    g: &Gguf,
    n_layer: usize,
    n_ctx: usize,
    kv_row: (usize, usize),
    free: u64,
) -> usize {
    (0..=n_layer)
        .rev()
        .find(|&k| plan(g, n_layer, k, n_ctx, kv_row).total() <= free)
        .unwrap_or(0)
}

/// GiB with two decimals, for messages.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{GgmlType, GgufWriter};

    /// Two layers of one 256×256 Q8_0 matrix (69 632 bytes) and one 256×256 Q5_K matrix (no CUDA
    /// kernel: 131 072 bytes as f16) each, and a 1000×256 F16 embedding table (512 000 bytes).
    fn model() -> Gguf {
        let mut w = GgufWriter::new();
        let q8 = GgmlType::Q8_0.row_bytes(256).unwrap() * 256;
        let q5k = GgmlType::Q5K.row_bytes(256).unwrap() * 256;
        for l in 0..2 {
            w.add_tensor(
                &format!("blk.{l}.attn_q.weight"),
                &[256, 256],
                GgmlType::Q8_0,
                vec![0; q8],
            )
            .unwrap();
            w.add_tensor(
                &format!("blk.{l}.ffn_up.weight"),
                &[256, 256],
                GgmlType::Q5K,
                vec![0; q5k],
            )
            .unwrap();
        }
        w.add_tensor(
            "token_embd.weight",
            &[256, 1000],
            GgmlType::F16,
            vec![0; 512_000],
        )
        .unwrap();
        Gguf::from_bytes(w.to_bytes()).unwrap()
    }

    /// The rows of a 64-wide f16 cache.
    const F16: (usize, usize) = (128, 128);

    #[test]
    fn plan_counts_gpu_layers_and_the_head_only_with_every_layer() {
        let g = model();
        let layer = 69_632 + 131_072;
        assert_eq!(plan(&g, 2, 0, 100, F16), VramPlan { weights: 0, kv: 0 });
        assert_eq!(
            plan(&g, 2, 1, 100, F16),
            VramPlan {
                weights: layer,
                kv: 100 * 64 * 4
            }
        );
        assert_eq!(plan(&g, 2, 2, 100, F16).weights, 2 * layer + 512_000);
        assert_eq!(plan(&g, 2, 9, 100, F16), plan(&g, 2, 2, 100, F16));
        let one = plan(&g, 2, 1, 100, F16).total();
        assert_eq!(layers_that_fit(&g, 2, 100, F16, one), 1);
        assert_eq!(layers_that_fit(&g, 2, 100, F16, one - 1), 0);
        assert_eq!(layers_that_fit(&g, 2, 100, F16, u64::MAX), 2);
    }

    /// A quantized cache counts its blocks' bytes: 64 values are 68 bytes in q8_0, 36 in q4_0.
    #[test]
    fn plan_counts_the_quantized_cache_in_its_blocks() {
        use crate::model::backend::{CacheType, KvType};
        let g = model();
        for (k, v, per_pos) in [
            (CacheType::Q8_0, CacheType::Q8_0, 136),
            (CacheType::Q4_0, CacheType::Q4_0, 72),
            (CacheType::Q8_0, CacheType::F16, 68 + 128),
        ] {
            let row = KvType::of(k, v).row_bytes(64);
            assert_eq!(plan(&g, 2, 2, 100, row).kv, 2 * 100 * per_pos);
        }
    }
}
