//! The panel GEMM against the type's `simd` dot kernel, bit for bit.

use super::*;
use crate::quant::{quantize_activations, quantize_row};

use crate::kernels::cpu::test_floats as data;

thread_local! {
    /// Makes [`matmul`] on this thread take the AVX2 tile even at the AVX-512 level.
    pub(super) static FORCE_AVX2: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

#[test]
#[cfg_attr(
    not(infer_host_avx2),
    ignore = "needs AVX2, FMA and F16C, which the CPU that built the tests lacks"
)]
fn gemm_equals_dot_bit_for_bit() {
    gemm_equals_dot(false);
}

#[test]
#[cfg_attr(
    not(infer_host_avx2),
    ignore = "needs AVX2, FMA and F16C, which the CPU that built the tests lacks"
)]
fn avx2_tile_equals_dot_at_every_level() {
    FORCE_AVX2.with(|f| f.set(true));
    gemm_equals_dot(true);
}

fn gemm_equals_dot(avx2: bool) {
    // Rows of 10 and of 45 blocks (a real model's rows are 20-448).
    for cols in [320, 1440] {
        gemm_equals_dot_at(avx2, cols);
    }
}

fn gemm_equals_dot_at(avx2: bool, cols: usize) {
    let rows = 10;
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
        let k = crate::kernels::cpu::simd::kernels(ty).expect("SIMD kernels at the level in use");
        let mut w = Vec::new();
        let mut tmp = Vec::new();
        for r in 0..rows {
            quantize_row(ty, &data(cols, 50 + r as u32), &mut tmp).unwrap();
            w.extend_from_slice(&tmp);
        }
        let rb = tmp.len();
        for n in [16, 17, 18, 19, 20, 21, 22, 23, 35] {
            let mut a = Vec::new();
            for t in 0..n {
                quantize_activations(ty, &data(cols, 900 + t as u32), &mut tmp).unwrap();
                a.extend_from_slice(&tmp);
            }
            let ab = tmp.len();
            let pool = ThreadPool::new(2);
            let mut out = vec![f32::NAN; n * rows];
            let done = matmul(&pool, ty, &w, rows, cols, &a, n, &mut out);
            assert_eq!(done, 8);
            for t in 0..n {
                for r in 0..done {
                    let want = (k.dot)(cols, &w[r * rb..(r + 1) * rb], &a[t * ab..(t + 1) * ab]);
                    let got = out[t * rows + r];
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{} cols={cols} n={n} t={t} r={r} avx2-forced={avx2}",
                        ty.name()
                    );
                }
            }
        }
    }
}

#[test]
#[cfg_attr(
    not(infer_host_avx2),
    ignore = "needs AVX2, FMA and F16C, which the CPU that built the tests lacks"
)]
fn simd_pack_equals_scalar_pack() {
    let cols = 96;
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
        assert!(applies(ty, cols, MIN_ROWS), "{} panels apply", ty.name());
        let mut w = Vec::new();
        let mut tmp = Vec::new();
        for r in 0..GROUP {
            quantize_row(ty, &data(cols, 7 + r as u32), &mut tmp).unwrap();
            w.extend_from_slice(&tmp);
        }
        let (rb, nb) = (tmp.len(), cols / 32);
        let mut a = vec![0u8; nb * GROUP * SLOT];
        let mut b = vec![0u8; nb * GROUP * SLOT];
        pack_group(ty, &w, rb, nb, &mut a);
        pack_group_scalar(ty, &w, rb, nb, &mut b);
        for (i, (x, y)) in a.chunks(SLOT).zip(b.chunks(SLOT)).enumerate() {
            assert_eq!(x[..4], y[..4], "{} slot {i} d", ty.name());
            assert_eq!(x[16..], y[16..], "{} slot {i} values", ty.name());
        }
    }
}
