//! Weight layouts on the device that differ from the file's. Only Q6_K is repacked: its 210-byte
//! blocks (ql[128], qh[64], int8 scales[16], f16 d) are only 2-byte aligned in a row, so a kernel
//! could read them only 2 bytes at a time. At upload each row becomes four planes (the `Q6_K`
//! comment in `cuda/gemv.cu` is the kernels' side of the same layout):
//!
//! | plane  | bytes          | at       | contents                                                 |
//! |--------|----------------|----------|----------------------------------------------------------|
//! | ql     | nb × 128       | 0        | each block's ql, as in the file                          |
//! | qh     | nb × 64        | 128 nb   | each block's qh, as in the file                          |
//! | scales | nb × 16        | 192 nb   | byte 8n + 4h + t of a block is its scales[8n + 2t + h]   |
//! | d      | nb × 2 + pad   | 208 nb   | each block's d, then zeros to a multiple of 16 bytes     |
//!
//! (nb = blocks per row.) Every plane of every row is then 16-byte aligned, so the GEMV's lanes read
//! 16 quant bytes per load, and a lane's four scales (t = 0..3 of one 16-value half h of one
//! 128-value half n) are one aligned int. Planes per row rather than per matrix keep a row
//! addressable from its index and the row length alone (the embedding lookup needs nothing else),
//! and padded blocks (224 bytes) would cost 6.7% more bytes read; the row padding costs
//! 14 bytes at most (4 for Qwen2.5-1.5B's 1,536-wide rows: 1,264 bytes against 1,260).

use std::borrow::Cow;

use crate::format::GgmlType;

/// Bytes of one Q6_K block in the file.
const Q6_K_BLOCK: usize = 210;

/// Bytes of one `cols`-wide row of `ty` on the device (None where the file's type has no row of
/// that length).
pub fn row_bytes(ty: GgmlType, cols: usize) -> Option<usize> {
    let file = ty.row_bytes(cols)?;
    Some(match ty {
        GgmlType::Q6K => {
            let nb = cols / 256;
            208 * nb + (2 * nb).next_multiple_of(16)
        }
        _ => file,
    })
}

/// A `cols`-wide matrix of `ty` in the file's bytes, as the kernels read it on the device (the
/// bytes as they are where rows of that width do not exist: the caller's shape check refuses them).
pub fn to_device(ty: GgmlType, cols: usize, bytes: &[u8]) -> Cow<'_, [u8]> {
    let nb = cols / 256;
    let dst_row = match row_bytes(ty, cols) {
        Some(b) if ty == GgmlType::Q6K && nb > 0 => b,
        _ => return Cow::Borrowed(bytes),
    };
    let src_row = nb * Q6_K_BLOCK;
    let mut out = vec![0u8; bytes.len() / src_row * dst_row];
    for (src, dst) in bytes
        .chunks_exact(src_row)
        .zip(out.chunks_exact_mut(dst_row))
    {
        for (b, blk) in src.chunks_exact(Q6_K_BLOCK).enumerate() {
            dst[128 * b..128 * (b + 1)].copy_from_slice(&blk[..128]);
            dst[128 * nb + 64 * b..128 * nb + 64 * (b + 1)].copy_from_slice(&blk[128..192]);
            let sc = &mut dst[192 * nb + 16 * b..192 * nb + 16 * (b + 1)];
            for (j, s) in sc.iter_mut().enumerate() {
                let (n, h, t) = (j / 8, j % 8 / 4, j % 4);
                *s = blk[192 + 8 * n + 2 * t + h];
            }
            dst[208 * nb + 2 * b..208 * nb + 2 * (b + 1)].copy_from_slice(&blk[208..210]);
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    /// Value `k` of block `b` of a repacked row, read as the kernels read it.
    fn value(row: &[u8], nb: usize, b: usize, k: usize) -> f32 {
        let (n, l) = (k / 128, k % 128);
        let (t, h, i) = (l / 32, l % 32 / 16, l % 16);
        let ql = row[128 * b + 64 * n + 32 * (t & 1) + 16 * h + i] >> (4 * (t >> 1)) & 15;
        let qh = row[128 * nb + 64 * b + 32 * n + 16 * h + i] >> (2 * t) & 3;
        let sc = row[192 * nb + 16 * b + 8 * n + 4 * h + t] as i8;
        let d = f16::from_le_bytes([row[208 * nb + 2 * b], row[208 * nb + 2 * b + 1]]);
        d.to_f32() * sc as f32 * ((ql | qh << 4) as i32 - 32) as f32
    }

    #[test]
    fn q6_k_rows_hold_the_files_values_in_aligned_planes() {
        for cols in [256, 1536, 2560] {
            let rows = 3;
            let src: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i / 300) as f32))
                .collect();
            let mut file = Vec::new();
            let mut q = Vec::new();
            for r in src.chunks_exact(cols) {
                crate::quant::quantize_row(GgmlType::Q6K, r, &mut q).unwrap();
                file.extend_from_slice(&q);
            }
            let dev = to_device(GgmlType::Q6K, cols, &file);
            let rb = row_bytes(GgmlType::Q6K, cols).unwrap();
            assert_eq!(rb % 16, 0);
            assert_eq!(dev.len(), rows * rb);
            let nb = cols / 256;
            let mut want = vec![0f32; cols];
            for (r, frow) in file.chunks_exact(nb * Q6_K_BLOCK).enumerate() {
                crate::quant::dequantize_row(GgmlType::Q6K, frow, &mut want).unwrap();
                let drow = &dev[r * rb..(r + 1) * rb];
                for (k, &w) in want.iter().enumerate() {
                    assert_eq!(value(drow, nb, k / 256, k % 256), w, "row {r} value {k}");
                }
                assert!(drow[208 * nb + 2 * nb..].iter().all(|&b| b == 0));
            }
        }
        assert_eq!(row_bytes(GgmlType::Q6K, 1536), Some(1264));
        assert_eq!(row_bytes(GgmlType::Q4K, 1536), Some(864));
        assert!(matches!(
            to_device(GgmlType::Q4K, 256, &[0; 144]),
            Cow::Borrowed(_)
        ));
        assert!(matches!(
            to_device(GgmlType::Q6K, 100, &[0; 10]),
            Cow::Borrowed(_)
        ));
    }
}
