//! The x4 decode layout of Q6_K matrices: each group of four rows stored with its blocks
//! interleaved row by row (block `b` of row `r` of group `g` at `(4 (g · nb + b) + r) · 210`).
//!
//! Decode multiplies four rows at a time against one activation row (`DotX4Fn`); in the file's
//! layout those four rows are four streams `row_bytes` apart, in this one a single linear stream,
//! which the prefetches (and the hardware's) follow. The blocks are the file's bytes unchanged and
//! the kernels do each row's arithmetic exactly as the row-layout kernel does, so outputs are
//! bit-identical. Decode and the prefill GEMM (`q6_k_panels`, which packs its panels from either layout)
//! read this copy; embedding lookups, row-invariant verifies and short prompts read the file.
//!
//! Invariant: a matrix is packed only when `rows % 4 == 0` and `cols % 256 == 0`.

use crate::kernels::cpu::memory::hugebuf::HugeBuf;
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::kernels::cpu::SharedMut;

/// Bytes of one Q6_K block.
const W_BYTES: usize = 210;

/// Whether a `rows × cols` Q6_K matrix can be packed.
pub fn packable(rows: usize, cols: usize) -> bool {
    rows > 0 && rows.is_multiple_of(4) && cols.is_multiple_of(256)
}

/// The x4 copy of a Q6_K matrix (`src`: `rows` rows of `cols / 256` blocks), in a buffer of its
/// own. Panics unless [`packable`] and `src` holds exactly the matrix.
pub fn pack(pool: &ThreadPool, src: &[u8], rows: usize, cols: usize) -> HugeBuf {
    let mut out = HugeBuf::zeroed(src.len());
    pack_into(pool, src, rows, cols, &mut out);
    out
}

/// [`pack`] into `out` (exactly the matrix's size).
pub fn pack_into(pool: &ThreadPool, src: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    assert!(packable(rows, cols), "{rows}x{cols} is not x4-packable");
    let nb = cols / 256;
    let row_bytes = nb * W_BYTES;
    assert_eq!(src.len(), rows * row_bytes, "Q6_K matrix bytes");
    assert_eq!(out.len(), src.len(), "packed bytes");
    let group = 4 * row_bytes;
    let dst = SharedMut(out.as_mut_ptr());
    pool.for_range(rows / 4, 64, |range| {
        for g in range {
            // SAFETY: group g's bytes `g * group .. (g + 1) * group` lie inside `out` (g < rows /
            // 4) and belong to this chunk only, so no two threads alias them.
            let o = unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(g * group), group) };
            pack_group(&src[g * group..(g + 1) * group], nb, o);
        }
    });
}

/// Where block `b` of row `r` (counted from the start of a group of four) starts in an x4 copy
/// of rows of `nb` blocks: the one place the layout is spelled out.
pub fn block_offset(nb: usize, r: usize, b: usize) -> usize {
    (r / 4 * 4 * nb + 4 * b + r % 4) * W_BYTES
}

/// Four file-layout rows of `nb` blocks (`src`) into one x4 group (`out`).
fn pack_group(src: &[u8], nb: usize, out: &mut [u8]) {
    let row_bytes = nb * W_BYTES;
    for r in 0..4 {
        for b in 0..nb {
            let (from, to) = (r * row_bytes + b * W_BYTES, block_offset(nb, r, b));
            out[to..to + W_BYTES].copy_from_slice(&src[from..from + W_BYTES]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::GgmlType;
    use crate::kernels::cpu::simd;
    use crate::quant::{quantize_activations, quantize_row};

    /// The x4 kernel on a packed matrix equals the row-layout decode kernel bit for bit, at every
    /// available level (and the packing is a permutation of whole blocks).
    #[test]
    fn x4_decode_equals_row_decode_bit_for_bit() {
        let (rows, cols) = (24, 768);
        let mut w = Vec::new();
        let mut tmp = Vec::new();
        for r in 0..rows {
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 + r * 101) % 61) as f32 / 7.0 - 4.0 + (r as f32) * 0.01)
                .collect();
            quantize_row(GgmlType::Q6K, &x, &mut tmp).unwrap();
            w.extend_from_slice(&tmp);
        }
        let a: Vec<f32> = (0..cols)
            .map(|i| ((i * 13) % 29) as f32 / 5.0 - 2.5)
            .collect();
        let mut xq = Vec::new();
        quantize_activations(GgmlType::Q6K, &a, &mut xq).unwrap();
        let pool = ThreadPool::new(2);
        let packed = pack(&pool, &w, rows, cols);
        let mut sorted_src: Vec<&[u8]> = w.chunks_exact(W_BYTES).collect();
        let mut sorted_dst: Vec<&[u8]> = packed.chunks_exact(W_BYTES).collect();
        sorted_src.sort();
        sorted_dst.sort();
        assert_eq!(sorted_src, sorted_dst, "packing permutes whole blocks");
        let levels = simd::Level::ALL.into_iter().filter(|l| l.available());
        for level in levels {
            let (Some(x4), Some(rows_fn)) = (
                simd::dot_x4_at(level, GgmlType::Q6K),
                simd::dot_rows_at(level, GgmlType::Q6K),
            ) else {
                continue;
            };
            let (mut want, mut got) = (vec![0f32; rows], vec![0f32; rows]);
            rows_fn(cols, &w, w.len() / rows, &xq, &mut want);
            x4(cols, &packed, &xq, &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{}", level.name());
            // A sub-range of whole groups, as decode hands them out.
            let mut part = vec![0f32; 8];
            x4(
                cols,
                &packed[4 * 4 * (cols / 256) * W_BYTES..],
                &xq,
                &mut part,
            );
            assert_eq!(
                bits(&part),
                bits(&want[16..24]),
                "{} groups 4..6",
                level.name()
            );
        }
    }
}
