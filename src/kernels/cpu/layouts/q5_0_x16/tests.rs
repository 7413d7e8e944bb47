use super::*;
use crate::format::GgmlType;
use crate::kernels::cpu::layouts::x16::{check_blocks32_against_rows, raw_blocks32};

/// Packing keeps every row's `d` and values, and `read_block` gives them back.
#[test]
fn read_block_inverts_pack() {
    let (rows, cols) = (32, 96);
    let nb = cols / 32;
    let w = raw_blocks32(rows, nb, W_BYTES, 3);
    let mut packed = vec![0u8; w.len()];
    pack_into(&ThreadPool::new(2), &w, rows, cols, &mut packed);
    for row in 0..rows {
        for b in 0..nb {
            let x = &w[(row * nb + b) * W_BYTES..][..W_BYTES];
            let at = (row / R * nb + b) * BLOCK_BYTES;
            let (d, q) = read_block(&packed[at..at + BLOCK_BYTES], row % R);
            assert_eq!(d.to_le_bytes(), [x[0], x[1]], "d of row {row} block {b}");
            let want: [u8; 32] = std::array::from_fn(|e| file_value(x, e));
            assert_eq!(q, want, "values of row {row} block {b}");
        }
    }
}

/// The x16 kernel equals the row kernels (AVX2 and AVX-512, `ggml_vec_dot_q5_0_q8_0`'s
/// arithmetic) bit for bit (`x16::check_blocks32_against_rows`).
#[test]
#[cfg_attr(
    not(infer_host_avx512),
    ignore = "needs AVX-512 F/BW/VL/VNNI, which the CPU that built the tests lacks"
)]
fn x16_decode_equals_row_decode_bit_for_bit() {
    crate::kernels::cpu::simd::require(crate::kernels::cpu::simd::Level::Avx512);
    assert!(applies(R, 32));
    check_blocks32_against_rows(GgmlType::Q5_0, W_BYTES, pack_into, gemv);
}

/// Several activation rows at once give each row the one-row kernel's bits
/// (`x16::check_blocks32_rows_against_gemv`): the row-invariant verify depends on it.
#[cfg(target_arch = "x86_64")]
#[test]
#[cfg_attr(
    not(infer_host_avx512),
    ignore = "needs AVX-512 F/BW/VL/VNNI, which the CPU that built the tests lacks"
)]
fn rows_at_once_equal_one_row_bit_for_bit() {
    crate::kernels::cpu::layouts::x16::check_blocks32_rows_against_gemv(
        W_BYTES, pack_into, gemv, matmul,
    );
}
