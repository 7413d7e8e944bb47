//! Quantized matrix multiplication on the CPU: the activations are quantized once per call to the
//! weight type's dot-product format (as llama.cpp does), then every output row is an integer dot
//! product straight on the stored blocks; weights are never dequantized to memory. Output rows are
//! split across the thread pool; each thread writes a disjoint set of output elements.

use crate::format::GgmlType;
use crate::kernels::cpu::backend::{CpuAct, CpuWeight};
use crate::kernels::cpu::pool::ThreadPool;

/// Weight types this matmul can multiply.
pub fn supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K
    )
}

/// A raw pointer that may be shared across the pool's threads.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: every thread writes a disjoint set of elements (its own output rows) and the pool joins
// all threads before the buffer is used again.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

/// out (n × rows) = x (n × cols) · Wᵀ.
pub fn matmul(pool: &ThreadPool, w: &CpuWeight, x: &CpuAct, out: &mut CpuAct) {
    let (n, cols, rows) = (x.rows, w.cols, w.rows);
    assert_eq!(x.cols, cols, "matmul input width");
    assert_eq!((out.rows, out.cols), (n, rows), "matmul output shape");
    let act_ty = crate::quant::vec_dot_type(w.ty);
    let a_bytes = crate::quant::activation_row_bytes(act_ty, cols)
        .expect("activation row fits the block size");
    let mut xq = Vec::with_capacity(n * a_bytes);
    let mut tmp = Vec::with_capacity(a_bytes);
    for t in 0..n {
        tmp.clear();
        crate::quant::quantize_activations(w.ty, x.row(t), &mut tmp)
            .expect("activation quantization for a supported type");
        xq.extend_from_slice(&tmp[..a_bytes]);
    }
    let wb = w.bytes();
    let rb = w.row_bytes;
    let ty = w.ty;
    let dst = SharedOut(out.data.as_mut_ptr());
    pool.for_range(rows, 16, |range| {
        let dst = dst;
        for r in range {
            let wr = &wb[r * rb..(r + 1) * rb];
            for t in 0..n {
                let v = crate::quant::vec_dot(ty, cols, wr, &xq[t * a_bytes..(t + 1) * a_bytes]);
                // SAFETY: r < rows and t < n, so t * rows + r is inside out.data (n * rows); row r
                // belongs to exactly one thread's range, so no two threads write the same element.
                unsafe { *dst.0.add(t * rows + r) = v };
            }
        }
    });
}
