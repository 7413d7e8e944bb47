use super::*;
use crate::format::GgmlType;
use crate::kernels::cpu::layouts::x16::{bits, test_bytes as bytes};
use crate::kernels::cpu::simd;
use crate::quant::{quantize_activations, quantize_row};

/// `rows` Q6_K rows of raw random blocks (every code, scale and top-bit pattern), finite `d`.
fn raw_matrix(rows: usize, nb: usize, seed: u32) -> Vec<u8> {
    let mut w = bytes(rows * nb * W_BYTES, seed);
    for (i, blk) in w.chunks_exact_mut(W_BYTES).enumerate() {
        let d = half::f16::from_f32(0.001 + (i % 17) as f32 * 0.0007);
        blk[208..210].copy_from_slice(&d.to_le_bytes());
    }
    w
}

/// One Q8_K activation row of `nb` blocks with raw values (extremes -128 and 127 included) and
/// consistent 16-value sums.
fn raw_activations(nb: usize, seed: u32) -> Vec<u8> {
    let q = bytes(nb * 256, seed);
    let mut a = Vec::new();
    for (b, vals) in q.chunks_exact(256).enumerate() {
        a.extend_from_slice(&(0.01 + b as f32 * 0.003).to_le_bytes());
        a.extend_from_slice(vals);
        for run in vals.chunks_exact(16) {
            let s: i16 = run.iter().map(|&v| v as i8 as i16).sum();
            a.extend_from_slice(&s.to_le_bytes());
        }
    }
    a
}

/// Packing keeps every row's `d`, scales and values, and `read_block` gives them back.
#[test]
fn read_block_inverts_pack() {
    let (rows, cols) = (32, 512);
    let nb = cols / 256;
    let w = raw_matrix(rows, nb, 7);
    let mut packed = vec![0u8; w.len()];
    pack_into(&ThreadPool::new(2), &w, rows, cols, &mut packed);
    let (mut want, mut got) = ([0u8; 256], [0u8; 256]);
    for row in 0..rows {
        for b in 0..nb {
            let x = &w[(row * nb + b) * W_BYTES..][..W_BYTES];
            let at = (row / R * nb + b) * BLOCK_BYTES;
            let (d, scales) = read_block(&packed[at..at + BLOCK_BYTES], row % R, &mut got);
            unpack_file_block(x, &mut want);
            assert_eq!(got, want, "values of row {row} block {b}");
            assert_eq!(d, half::f16::from_le_bytes([x[208], x[209]]).to_f32());
            assert_eq!(scales.map(|s| s as u8), x[192..208]);
        }
    }
}

/// The x16 kernel equals the AVX2 row kernel (`ggml_vec_dot_q6_K_q8_K`'s arithmetic) bit for bit:
/// on quantized real-valued rows, and on raw blocks with extreme values and activations.
#[test]
#[cfg_attr(
    not(infer_host_avx512),
    ignore = "needs AVX-512 F/BW/VL/VNNI, which the CPU that built the tests lacks"
)]
fn x16_decode_equals_row_decode_bit_for_bit() {
    crate::kernels::cpu::simd::require(crate::kernels::cpu::simd::Level::Avx512);
    assert!(applies(R, 256));
    let rows_fn = simd::dot_rows_at(simd::Level::Avx2, GgmlType::Q6K).expect("AVX2 Q6_K kernel");
    let pool = ThreadPool::new(2);
    for (case, rows, cols) in [(0, 48, 768), (1, 32, 1536), (2, 16, 256)] {
        let nb = cols / 256;
        let (w, xq) = if case == 0 {
            let mut w = Vec::new();
            let mut tmp = Vec::new();
            for r in 0..rows {
                let x = crate::kernels::cpu::test_floats(cols, 11 + r as u32);
                quantize_row(GgmlType::Q6K, &x, &mut tmp).unwrap();
                w.extend_from_slice(&tmp);
            }
            let a = crate::kernels::cpu::test_floats(cols, 5);
            let mut xq = Vec::new();
            quantize_activations(GgmlType::Q6K, &a, &mut xq).unwrap();
            (w, xq)
        } else {
            (
                raw_matrix(rows, nb, 100 + case),
                raw_activations(nb, 200 + case),
            )
        };
        let mut packed = vec![0u8; w.len()];
        pack_into(&pool, &w, rows, cols, &mut packed);
        let mut want = vec![0f32; rows];
        rows_fn(cols, &w, nb * W_BYTES, &xq, &mut want);
        crate::kernels::cpu::layouts::prefetch::each(|stream| {
            let mut got = vec![0f32; rows];
            gemv(cols, &packed, &xq, &mut got);
            assert_eq!(bits(&got), bits(&want), "case {case}, prefetch {stream}");
            // A later run of whole units, as decode hands them out.
            let unit = nb * BLOCK_BYTES;
            let mut part = vec![0f32; rows - R];
            gemv(cols, &packed[unit..], &xq, &mut part);
            assert_eq!(bits(&part), bits(&want[R..]), "case {case}, units 1..");
        });
    }
}

/// Several activation rows at once (`matmul`, up to four per pass over a unit) give each row
/// exactly what the one-row kernel gives it: the row-invariant verify depends on it.
#[test]
#[cfg_attr(
    not(infer_host_avx512),
    ignore = "needs AVX-512 F/BW/VL/VNNI, which the CPU that built the tests lacks"
)]
fn rows_at_once_equal_one_row_bit_for_bit() {
    crate::kernels::cpu::simd::require(crate::kernels::cpu::simd::Level::Avx512);
    assert!(applies(R, 256));
    let pool = ThreadPool::new(2);
    let (rows, cols) = (64, 768);
    let nb = cols / 256;
    let w = raw_matrix(rows, nb, 31);
    let mut packed = vec![0u8; w.len()];
    pack_into(&pool, &w, rows, cols, &mut packed);
    let a_row = nb * 292;
    for n in 1..=9 {
        let xq: Vec<u8> = (0..n)
            .flat_map(|t| raw_activations(nb, 300 + t as u32))
            .collect();
        let mut got = vec![0f32; n * rows];
        matmul(&pool, &packed, rows, cols, &xq, n, &mut got);
        for t in 0..n {
            let mut want = vec![0f32; rows];
            gemv(cols, &packed, &xq[t * a_row..(t + 1) * a_row], &mut want);
            let row = &got[t * rows..(t + 1) * rows];
            assert_eq!(bits(row), bits(&want), "{n} rows, row {t}");
        }
    }
}
