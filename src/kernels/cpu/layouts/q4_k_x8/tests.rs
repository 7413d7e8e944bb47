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

/// Group `g` of a `rows × cols` Q4_K matrix `w` packed alone, in the plain x8 layout.
fn group(w: &[u8], cols: usize, g: usize) -> Vec<u8> {
    let nb = cols / 256;
    let mut out = vec![0u8; nb * BLOCK_BYTES];
    pack_unit(
        &w[g * GROUP * nb * 144..(g + 1) * GROUP * nb * 144],
        GROUP,
        nb,
        &mut out,
    );
    out
}

#[test]
fn simd_equals_scalar_twin_and_unpacked_kernels() {
    let (rows, cols) = (16, 768);
    let nb = cols / 256;
    let (w, a) = problem(rows, cols, 4);
    let a_row = nb * A_BYTES;
    let gemv = simd::kernels(GgmlType::Q4K).map(|k| k.dot);
    for g in 0..rows / GROUP {
        let wg = group(&w, cols, g);
        for m in 1..=4 {
            for pair in [false, true] {
                let mut got = [[0f32; GROUP]; 4];
                dot_group(nb, &wg, &a, a_row, m, pair, &mut got);
                let mut want = [[0f32; GROUP]; 4];
                dot_group_scalar(nb, &wg, &a, a_row, m, pair, &mut want);
                for r in 0..m {
                    for c in 0..GROUP {
                        let row = g * GROUP + c;
                        let wr = &w[row * nb * 144..(row + 1) * nb * 144];
                        let ar = &a[r * a_row..(r + 1) * a_row];
                        let (x, y) = (got[r][c], want[r][c]);
                        assert_eq!(x.to_bits(), y.to_bits(), "m={m} pair={pair} r={r} c={c}");
                        let unpacked = if pair {
                            crate::kernels::cpu::simd::q4_k_gemm::dot(cols, wr, ar)
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

#[test]
fn matmul_splits_rows_as_llamacpp() {
    let (rows, cols) = (24, 512);
    let nb = cols / 256;
    let pool = ThreadPool::new(2);
    // Tails of two and three rows run as padded tiles of four (see `matmul`); with `gemm` off
    // (row-invariant) every row is the GEMV flavour.
    for (n, gemm) in [1, 2, 3, 4, 6, 7, 13]
        .into_iter()
        .flat_map(|n| [(n, true), (n, false)])
    {
        let (w, a) = problem(rows, cols, n);
        let packed = pack(&pool, &w, rows, cols);
        let mut out = vec![0f32; n * rows];
        matmul(&pool, &packed, rows, cols, &a, n, gemm, &mut out);
        let gemm_rows = if gemm && n >= 4 { n - n % 4 } else { 0 };
        let a_row = nb * A_BYTES;
        for t in 0..n {
            for row in 0..rows {
                let (g, c) = (row / GROUP, row % GROUP);
                let wg = group(&w, cols, g);
                let mut want = [[0f32; GROUP]; 4];
                let ar = &a[t * a_row..(t + 1) * a_row];
                dot_group_scalar(nb, &wg, ar, a_row, 1, t < gemm_rows, &mut want);
                assert_eq!(
                    out[t * rows + row].to_bits(),
                    want[0][c].to_bits(),
                    "n={n} t={t}"
                );
            }
        }
    }
}

/// An x16 unit through [`dot_pair`] (the AVX-512 kernel where the CPU has it) equals the scalar
/// twin on each of its x8 groups, bit for bit, in both flavours and for 1..=4 rows; and
/// [`gemv_groups`] over a matrix with an odd group count (a last x8 group in the wide layout)
/// equals the twin row for row.
#[test]
fn x16_units_equal_scalar_twin() {
    // Both with and without the decode flavour's prefetches (`prefetch`).
    crate::kernels::cpu::layouts::prefetch::each(|_| x16_units_equal_scalar_twin_once());
}

fn x16_units_equal_scalar_twin_once() {
    let (rows, cols) = (40, 1024);
    let nb = cols / 256;
    let (w, a) = problem(rows, cols, 4);
    let a_row = nb * A_BYTES;
    let plain: Vec<Vec<u8>> = (0..rows / GROUP).map(|g| group(&w, cols, g)).collect();
    for g in [0, 2] {
        let mut unit = vec![0u8; 2 * nb * BLOCK_BYTES];
        let src = &w[g * GROUP * nb * 144..(g + 2) * GROUP * nb * 144];
        pack_unit(src, 2 * GROUP, nb, &mut unit);
        let mut flat = vec![0f32; 4 * 2 * GROUP];
        dot_scalar(2 * GROUP, nb, &unit, &a, a_row, 4, true, &mut flat);
        for m in 1..=4 {
            for pair in [false, true] {
                let mut got = [[f32::NAN; 2 * GROUP]; 4];
                dot_pair(nb, &unit, &a, a_row, m, pair, &mut got);
                for k in 0..2 {
                    let mut want = [[0f32; GROUP]; 4];
                    dot_group_scalar(nb, &plain[g + k], &a, a_row, m, pair, &mut want);
                    for r in 0..m {
                        for c in 0..GROUP {
                            assert_eq!(
                                got[r][k * GROUP + c].to_bits(),
                                want[r][c].to_bits(),
                                "g={g} m={m} pair={pair} r={r} row {}",
                                (g + k) * GROUP + c
                            );
                            if pair && m == 4 {
                                let x16 = flat[r * 2 * GROUP + k * GROUP + c];
                                assert_eq!(x16.to_bits(), want[r][c].to_bits());
                            }
                        }
                    }
                }
            }
        }
    }
    let pool = ThreadPool::new(1);
    let packed = pack(&pool, &w, rows, cols);
    let mut out = vec![f32::NAN; rows];
    gemv_groups(
        &packed,
        rows,
        cols,
        &a[..a_row],
        (0, rows / GROUP),
        &mut out,
    );
    for (g, wg) in plain.iter().enumerate() {
        let mut want = [[0f32; GROUP]; 4];
        dot_group_scalar(nb, wg, &a, a_row, 1, false, &mut want);
        for (c, w) in want[0].iter().enumerate() {
            let row = g * GROUP + c;
            assert_eq!(out[row].to_bits(), w.to_bits(), "row {row}");
        }
    }
    // A share that starts and ends inside the matrix (whole units only) gives the same rows.
    let mut part = vec![f32::NAN; 2 * GROUP];
    gemv_groups(&packed, rows, cols, &a[..a_row], (2, 4), &mut part);
    for (i, (p, o)) in part.iter().zip(&out[2 * GROUP..4 * GROUP]).enumerate() {
        assert_eq!(p.to_bits(), o.to_bits(), "row {}", 2 * GROUP + i);
    }
}
