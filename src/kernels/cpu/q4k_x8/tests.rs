//! The packed kernels against their scalar twin and against the unpacked Q4_K kernels whose
//! arithmetic they reproduce (bit for bit).

use super::*;
use crate::format::GgmlType;
use crate::kernels::cpu::simd;
use crate::quant::{quantize_activations, quantize_row};

use crate::kernels::cpu::test_floats as data;

/// A `rows × cols` Q4_K matrix (file layout) and `n` Q8_K activation rows.
fn problem(rows: usize, cols: usize, n: usize) -> (Vec<u8>, Vec<u8>) {
    let mut w = Vec::new();
    let mut tmp = Vec::new();
    for r in 0..rows {
        quantize_row(GgmlType::Q4K, &data(cols, 100 + r as u32), &mut tmp).unwrap();
        w.extend_from_slice(&tmp);
    }
    let mut a = Vec::new();
    for t in 0..n {
        quantize_activations(GgmlType::Q4K, &data(cols, 7 + t as u32), &mut tmp).unwrap();
        a.extend_from_slice(&tmp);
    }
    (w, a)
}

#[test]
fn simd_equals_scalar_twin_and_unpacked_kernels() {
    let (rows, cols) = (16, 768);
    let nb = cols / 256;
    let (w, a) = problem(rows, cols, 4);
    let pool = ThreadPool::new(2);
    let packed = pack(&pool, &w, rows, cols);
    let a_row = nb * A_BYTES;
    let gemv = simd::kernels(GgmlType::Q4K).map(|k| k.dot);
    for g in 0..rows / GROUP {
        let wg = &packed[g * nb * BLOCK_BYTES..(g + 1) * nb * BLOCK_BYTES];
        for m in 1..=4 {
            for pair in [false, true] {
                let mut got = [[0f32; GROUP]; 4];
                rows_fn(nb, wg, &a, a_row, m, pair, &mut got);
                let mut want = [[0f32; GROUP]; 4];
                dot_group_scalar(nb, wg, &a, a_row, m, pair, &mut want);
                for r in 0..m {
                    for c in 0..GROUP {
                        let row = g * GROUP + c;
                        let wr = &w[row * nb * 144..(row + 1) * nb * 144];
                        let ar = &a[r * a_row..(r + 1) * a_row];
                        let (x, y) = (got[r][c], want[r][c]);
                        assert_eq!(x.to_bits(), y.to_bits(), "m={m} pair={pair} r={r} c={c}");
                        let unpacked = if pair {
                            crate::kernels::cpu::simd::q4k_gemm::dot(cols, wr, ar)
                        } else if let Some(dot) = gemv {
                            dot(cols, wr, ar)
                        } else {
                            continue;
                        };
                        assert_eq!(x.to_bits(), unpacked.to_bits(), "pair={pair} r={r} c={c}");
                        let exact = crate::quant::vec_dot(GgmlType::Q4K, cols, wr, ar);
                        assert!((x - exact).abs() <= 1e-4 * exact.abs().max(1.0));
                    }
                }
            }
        }
    }
}

fn rows_fn(
    nb: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    m: usize,
    pair: bool,
    out: &mut [[f32; GROUP]; 4],
) {
    super::dot_group(nb, w, a, stride, m, pair, out)
}

#[test]
fn matmul_splits_rows_as_llamacpp() {
    let (rows, cols) = (24, 512);
    let nb = cols / 256;
    let pool = ThreadPool::new(2);
    for n in [1, 3, 4, 7, 13] {
        let (w, a) = problem(rows, cols, n);
        let packed = pack(&pool, &w, rows, cols);
        let mut out = vec![0f32; n * rows];
        matmul(&pool, &packed, rows, cols, &a, n, true, &mut out);
        let gemm_rows = if n >= 4 { n - n % 4 } else { 0 };
        let a_row = nb * A_BYTES;
        for t in 0..n {
            for row in 0..rows {
                let (g, c) = (row / GROUP, row % GROUP);
                let wg = &packed[g * nb * BLOCK_BYTES..(g + 1) * nb * BLOCK_BYTES];
                let mut want = [[0f32; GROUP]; 4];
                let ar = &a[t * a_row..(t + 1) * a_row];
                dot_group_scalar(nb, wg, ar, a_row, 1, t < gemm_rows, &mut want);
                assert_eq!(
                    out[t * rows + row].to_bits(),
                    want[0][c].to_bits(),
                    "n={n} t={t}"
                );
            }
        }
    }
}
