//! The panel kernel against its scalar twin and against the unpacked tiled Q6_K arithmetic.

use super::*;
use crate::format::GgmlType;
use crate::quant::{quantize_activations, quantize_row};

use crate::kernels::cpu::test_floats as data;

#[test]
fn panel_kernel_matches_twin_and_tiled_matmul() {
    let (rows, cols, n) = (28, 512, 11);
    let nb = cols / 256;
    let mut w = Vec::new();
    let mut tmp = Vec::new();
    for r in 0..rows {
        quantize_row(GgmlType::Q6K, &data(cols, 300 + r as u32), &mut tmp).unwrap();
        w.extend_from_slice(&tmp);
    }
    let mut a = Vec::new();
    for t in 0..n {
        quantize_activations(GgmlType::Q6K, &data(cols, 9 + t as u32), &mut tmp).unwrap();
        a.extend_from_slice(&tmp);
    }
    let a_row = nb * A_BYTES;
    let pool = ThreadPool::new(2);
    let mut out = vec![f32::NAN; n * rows];
    assert_eq!(
        matmul(&pool, &w, Layout::File, rows, cols, &a, n, &mut out),
        24
    );
    // The same matrix in the x4 layout gives the same bits.
    let x4 = crate::kernels::cpu::layouts::q6_k_x4::pack(&pool, &w, rows, cols);
    let mut out_x4 = vec![f32::NAN; n * rows];
    assert_eq!(
        matmul(&pool, &x4, Layout::X4, rows, cols, &a, n, &mut out_x4),
        24
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out_x4[..]), bits(&out[..]), "x4 source");
    // And the first sixteen rows in the x16 layout.
    let w16 = &w[..16 * nb * 210];
    let mut x16 = vec![0u8; w16.len()];
    crate::kernels::cpu::layouts::q6_k_x16::pack_into(&pool, w16, 16, cols, &mut x16);
    let mut out_x16 = vec![f32::NAN; n * 16];
    assert_eq!(
        matmul(&pool, &x16, Layout::X16, 16, cols, &a, n, &mut out_x16),
        16
    );
    for t in 0..n {
        let want = &out[t * rows..t * rows + 16];
        assert_eq!(
            bits(&out_x16[t * 16..(t + 1) * 16]),
            bits(want),
            "x16 source, row {t}"
        );
    }
    let mut panel = vec![0u8; nb * PANEL_BLOCK];
    for g in 0..3 {
        pack_group(&w[g * 8 * nb * 210..(g + 1) * 8 * nb * 210], nb, &mut panel);
        for t in 0..n {
            let mut want = [[0f32; GROUP]; 4];
            dot_group_scalar(
                nb,
                &panel,
                &a[t * a_row..(t + 1) * a_row],
                a_row,
                1,
                &mut want,
            );
            for (c, want) in want[0].iter().enumerate() {
                let row = g * GROUP + c;
                let got = out[t * rows + row];
                assert_eq!(got.to_bits(), want.to_bits(), "t={t} row={row}");
                let wr = &w[row * nb * 210..(row + 1) * nb * 210];
                let tiled = crate::kernels::cpu::matmul::q6k_tiled_scalar(
                    nb,
                    wr,
                    &a[t * a_row..(t + 1) * a_row],
                );
                assert_eq!(got.to_bits(), tiled.to_bits(), "t={t} row={row}");
            }
        }
    }
}
