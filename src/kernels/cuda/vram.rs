//! How much GPU memory a model needs with its first `gpu_layers` layers on the GPU, and how many
//! layers fit in a given amount: weights as the CUDA backend stores them (as in the file; f16 for
//! types without a kernel), the f16 KV cache of those layers, and a margin for activations and
//! scratch. Used by the CLI to refuse a load with a clear message instead of failing midway.

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
        t.ty.row_bytes(n as usize).map_or(n * 2, |b| b as u64)
    } else {
        n * 2 // dequantized to f16 at load
    }
}

/// The plan for layers `0..gpu_layers` of an `n_layer` model (the embedding table and output
/// head count only when every layer is on the GPU, as `DeviceBackend` places them).
pub fn plan(g: &Gguf, n_layer: usize, gpu_layers: usize, n_ctx: usize, kv_dim: usize) -> VramPlan {
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
    let kv = (gpu_layers * n_ctx * kv_dim * 2 * 2) as u64;
    VramPlan { weights, kv }
}

/// The most layers whose plan fits in `free` bytes.
pub fn layers_that_fit(g: &Gguf, n_layer: usize, n_ctx: usize, kv_dim: usize, free: u64) -> usize {
    (0..=n_layer)
        .rev()
        .find(|&k| plan(g, n_layer, k, n_ctx, kv_dim).total() <= free)
        .unwrap_or(0)
}

/// GiB with two decimals, for messages.
pub fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}
