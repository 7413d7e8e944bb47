//! Attention over an f32 KV cache, for models computed in f32 end to end (F32 weights): the
//! reference implementation's arithmetic (PyTorch's softmax attention in f32) rather than
//! llama.cpp's f16 kernels in `attention`. Scores are f32 dot products, the softmax subtracts the
//! row maximum and sums in f64, and V is accumulated in f32. Each (query row, head) pair is one
//! unit of work split across the pool; queries see keys `lo..=pos` of their own sequence.

use crate::kernels::cpu::backend::CpuAct;
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::model::backend::{AttnQuery, AttnShape};

/// The f32 K/V storage: per layer, `n_blocks * block_size` slots of `kv_dim` values.
pub struct KvF32 {
    pub k: Vec<Vec<f32>>, // (n_layer, n_blocks * block_size * kv_dim)
    pub v: Vec<Vec<f32>>, // (n_layer, n_blocks * block_size * kv_dim)
}

impl KvF32 {
    /// Zeroed storage of `per_layer` values per layer for K and for V.
    pub fn new(n_layer: usize, per_layer: usize) -> KvF32 {
        KvF32 {
            k: (0..n_layer).map(|_| vec![0.0; per_layer]).collect(),
            v: (0..n_layer).map(|_| vec![0.0; per_layer]).collect(),
        }
    }

    /// Copies `n` values from offset `from` to offset `to` in every layer's K and V.
    pub fn copy(&mut self, from: usize, to: usize, n: usize) {
        for plane in self.k.iter_mut().chain(self.v.iter_mut()) {
            plane.copy_within(from..from + n, to);
        }
    }

    /// Copies row i of `k` and `v` into slot `slots[i]` of `layer`.
    pub fn write(&mut self, layer: usize, k: &CpuAct, v: &CpuAct, slots: &[usize]) {
        let d = k.cols;
        for (i, &slot) in slots.iter().enumerate() {
            self.k[layer][slot * d..(slot + 1) * d].copy_from_slice(k.row(i));
            self.v[layer][slot * d..(slot + 1) * d].copy_from_slice(v.row(i));
        }
    }
}

#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: each (query, head) unit writes only its own head_dim slice of the output, and the pool
// joins all threads before the output is read.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

impl SharedOut {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    fn ptr(self) -> *mut f32 {
        self.0
    }
}

/// f32 dot product with eight partial sums (vectorizable; the order is fixed, so results do not
/// depend on the thread or the CPU).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Causal attention of each query row of `q` (rows × n_head·head_dim) over the cached keys and
/// values of `layer`, written to `out` (same shape).
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    q: &CpuAct,
    kv: &KvF32,
    layer: usize,
    block_size: usize,
    queries: &[AttnQuery<'_>],
    shape: AttnShape,
    out: &mut CpuAct,
) {
    let hd = shape.head_dim;
    let group = shape.n_head / shape.n_head_kv;
    let kvd = shape.n_head_kv * hd;
    let (ks, vs) = (&kv.k[layer], &kv.v[layer]);
    let out_cols = out.cols;
    let dst = SharedOut(out.data.as_mut_ptr());
    pool.for_range(queries.len() * shape.n_head, 1, |range| {
        let mut scores: Vec<f32> = Vec::new();
        let mut acc = vec![0f32; hd];
        for unit in range {
            let (i, h) = (unit / shape.n_head, unit % shape.n_head);
            let qa = &queries[i];
            let qrow = &q.row(i)[h * hd..(h + 1) * hd];
            let off = (h / group) * hd;
            let slot = |p: usize| {
                let b = qa.block_table[p / block_size] as usize;
                (b * block_size + p % block_size) * kvd + off
            };
            let (lo, pos) = (qa.lo as usize, qa.pos as usize);
            scores.clear();
            scores.extend((lo..=pos).map(|p| {
                let s = slot(p);
                dot(qrow, &ks[s..s + hd]) * shape.scale
            }));
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f64;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s as f64;
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (p, &w) in (lo..=pos).zip(&scores) {
                let s = slot(p);
                for (a, &x) in acc.iter_mut().zip(&vs[s..s + hd]) {
                    *a += w * x;
                }
            }
            let inv = (1.0 / sum) as f32;
            // SAFETY: i < out.rows and (h + 1) * hd <= out_cols; unit (i, h) is handled by exactly
            // one thread, so this slice is written once, and the pool joins before `out` is read.
            let o =
                unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(i * out_cols + h * hd), hd) };
            for (o, &a) in o.iter_mut().zip(&acc) {
                *o = a * inv;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attends_to_the_window_with_softmax_weights() {
        let pool = ThreadPool::new(2);
        // One KV head of dim 2, block size 4, positions 0..3 in block 1.
        let (bs, hd) = (4, 2);
        let mut kv = KvF32::new(1, 2 * bs * hd);
        let keys = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]];
        let vals = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]];
        for p in 0..3 {
            let slot = bs + p;
            kv.k[0][slot * hd..(slot + 1) * hd].copy_from_slice(&keys[p]);
            kv.v[0][slot * hd..(slot + 1) * hd].copy_from_slice(&vals[p]);
        }
        let table = [1u32];
        let q = CpuAct {
            data: vec![1.0, 0.0, 1.0, 0.0],
            rows: 2,
            cols: 2,
        };
        let queries = [
            AttnQuery {
                seq: 0,
                block_table: &table,
                pos: 2,
                lo: 0,
            },
            AttnQuery {
                seq: 0,
                block_table: &table,
                pos: 2,
                lo: 1,
            },
        ];
        let shape = AttnShape {
            n_head: 1,
            n_head_kv: 1,
            head_dim: hd,
            scale: 0.5,
        };
        let mut out = CpuAct {
            data: vec![0.0; 4],
            rows: 2,
            cols: 2,
        };
        attention(&pool, &q, &kv, 0, bs, &queries, shape, &mut out);
        // Scores 0.5·(1, 0, 1) over all three, (0, 1) over positions 1..=2.
        let w: Vec<f64> = [0.5f64, 0.0, 0.5].iter().map(|s| s.exp()).collect();
        let z: f64 = w.iter().sum();
        let want0 = (w[0] * 1.0 + w[1] * 3.0 + w[2] * 5.0) / z;
        assert!((out.data[0] as f64 - want0).abs() < 1e-6);
        let (a, b) = (1.0f64, 0.5f64.exp());
        let want1 = (a * 3.0 + b * 5.0) / (a + b);
        assert!((out.data[2] as f64 - want1).abs() < 1e-6, "{}", out.data[2]);
    }
}
