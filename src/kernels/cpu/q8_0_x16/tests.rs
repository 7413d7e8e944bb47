use super::*;
use crate::format::GgmlType;
use crate::kernels::cpu::simd;
use crate::kernels::cpu::x16::{bits, test_bytes as bytes};
use crate::quant::{quantize_activations, quantize_row};

/// `rows` Q8_0 rows of raw random blocks (every byte value, -128 included), finite `d`.
fn raw_matrix(rows: usize, nb: usize, seed: u32) -> Vec<u8> {
    let mut w = bytes(rows * nb * W_BYTES, seed);
    for (i, blk) in w.chunks_exact_mut(W_BYTES).enumerate() {
        let d = half::f16::from_f32(0.002 + (i % 13) as f32 * 0.0009);
        blk[..2].copy_from_slice(&d.to_le_bytes());
    }
    w
}

/// One Q8_0 activation row of `nb` blocks with raw codes in -127..=127 (the quantizer's range,
/// both ends included).
fn raw_activations(nb: usize, seed: u32) -> Vec<u8> {
    let q = bytes(nb * 32, seed);
    let mut a = Vec::new();
    for (b, vals) in q.chunks_exact(32).enumerate() {
        a.extend_from_slice(&half::f16::from_f32(0.01 + b as f32 * 0.002).to_le_bytes());
        for (i, &v) in vals.iter().enumerate() {
            let code = match i % 8 {
                0 => 127,
                1 => -127,
                _ => (v as i8).max(-127),
            };
            a.push(code as u8);
        }
    }
    a
}

/// Packing keeps every row's `d` and values, and `read_block` gives them back.
#[test]
fn read_block_inverts_pack() {
    let (rows, cols) = (32, 96);
    let nb = cols / 32;
    let w = raw_matrix(rows, nb, 3);
    let mut packed = vec![0u8; w.len()];
    pack_into(&ThreadPool::new(2), &w, rows, cols, &mut packed);
    for row in 0..rows {
        for b in 0..nb {
            let x = &w[(row * nb + b) * W_BYTES..][..W_BYTES];
            let at = (row / R * nb + b) * BLOCK_BYTES;
            let (d, q) = read_block(&packed[at..at + BLOCK_BYTES], row % R);
            assert_eq!(d.to_le_bytes(), [x[0], x[1]], "d of row {row} block {b}");
            let want: [i8; 32] = std::array::from_fn(|e| x[2 + e] as i8);
            assert_eq!(q, want, "values of row {row} block {b}");
        }
    }
}

/// The x16 kernel equals the row kernels (AVX2 and AVX-512, `ggml_vec_dot_q8_0_q8_0`'s
/// arithmetic) bit for bit: on quantized real-valued rows, and on raw blocks with every byte
/// value against activation codes of ±127.
#[test]
fn x16_decode_equals_row_decode_bit_for_bit() {
    if !applies(R, 32) {
        eprintln!("skipped: no AVX-512 level on this CPU");
        return;
    }
    let pool = ThreadPool::new(2);
    for (case, rows, cols) in [(0, 48, 640), (1, 32, 640), (2, 16, 32)] {
        let nb = cols / 32;
        let (w, xq) = if case == 0 {
            let mut w = Vec::new();
            let mut tmp = Vec::new();
            for r in 0..rows {
                let x = crate::kernels::cpu::test_floats(cols, 21 + r as u32);
                quantize_row(GgmlType::Q8_0, &x, &mut tmp).unwrap();
                w.extend_from_slice(&tmp);
            }
            let a = crate::kernels::cpu::test_floats(cols, 8);
            let mut xq = Vec::new();
            quantize_activations(GgmlType::Q8_0, &a, &mut xq).unwrap();
            (w, xq)
        } else {
            (
                raw_matrix(rows, nb, 40 + case),
                raw_activations(nb, 50 + case),
            )
        };
        let mut packed = vec![0u8; w.len()];
        pack_into(&pool, &w, rows, cols, &mut packed);
        let mut got = vec![0f32; rows];
        gemv(cols, &packed, &xq, &mut got);
        for level in [simd::Level::Avx2, simd::Level::Avx512] {
            let rows_fn = simd::dot_rows_at(level, GgmlType::Q8_0).expect("Q8_0 row kernel");
            let mut want = vec![0f32; rows];
            rows_fn(cols, &w, nb * W_BYTES, &xq, &mut want);
            assert_eq!(
                bits(&got),
                bits(&want),
                "case {case} against {}",
                level.name()
            );
        }
        // A later run of whole units, as decode hands them out.
        let unit = nb * BLOCK_BYTES;
        let mut part = vec![0f32; rows - R];
        gemv(cols, &packed[unit..], &xq, &mut part);
        assert_eq!(bits(&part), bits(&got[R..]), "case {case}, units 1..");
    }
}
