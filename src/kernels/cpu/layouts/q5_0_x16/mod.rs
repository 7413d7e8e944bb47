//! Q5_0 matrices repacked sixteen rows at a time ("x16") for the AVX-512 decode kernel.
//!
//! The four-row kernel (`simd`) spends about ten vector instructions per 22-byte block and row
//! (the fifth bits, one `vpdpbusd`, and a float step of eight lanes per row): one core computes it
//! at about 26 GB/s in cache, so on a machine that streams 80 GB/s Gemma-3's Q5_0 matrices ran at
//! half the bandwidth. Here one 64-byte vector holds four values of each of sixteen rows (row `r`
//! in dword `r`), four activation bytes broadcast to all lanes meet them in one `vpdpbusd`, and
//! each of ggml's eight lanes per block (four products each) has an accumulator holding that lane
//! for all sixteen rows, so the offset, the conversion and the `fma` cost one instruction per lane
//! per sixteen rows.
//!
//! Layout of one unit block (sixteen rows × 32 columns, [`BLOCK_BYTES`] = 16 × 22 bytes, the
//! file's size): `@0` the rows' `d` (f16), row `r` at `2r`; `@32` four planes of 64 bytes, plane
//! `p` holding the low nibbles of vectors `V_2p` (bits 0-3) and `V_2p+1` (bits 4-7); `@288` one
//! plane of 64 bytes whose bit `v` of byte `i` is the fifth bit of `V_v`'s byte `i`. Vector `V_l`
//! (`l` in 0..8) holds values `4l..4l + 4` of every row, value `4l + e` of row `r` at byte
//! `4r + e`, as the stored 5-bit value (`q + 16`).
//!
//! The integers are exactly the AVX2 kernel's lanes (`Σ (q + 16)·a - 16·Σ a` per lane, activation
//! codes within ±127 as the Q8_0 quantizer makes them) and the float steps are its lane-wise
//! `fma`s (`d_w · d_a` rounded) and its final horizontal sum, so every output is bit-identical to
//! the row kernel, which the tests hold it to. Prefill keeps reading the plain copy (`q8_0_panels`):
//! this copy is decode's, and costs the matrix's size once more.
//!
//! Invariant: a matrix is packed only when [`applies`] (the AVX-512 level, `rows % 16 == 0`,
//! `cols % 32 == 0`), fixed for the process.

#[cfg(target_arch = "x86_64")]
use crate::kernels::cpu::layouts::x16::gemv_blocks32;
use crate::kernels::cpu::layouts::x16::pack_blocks32;
pub use crate::kernels::cpu::layouts::x16::R;
use crate::kernels::cpu::threads::pool::ThreadPool;

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

/// Bytes of one Q5_0 file block.
const W_BYTES: usize = 22;
/// Bytes of one unit block.
pub const BLOCK_BYTES: usize = R * W_BYTES;
/// Offsets of the nibble planes and of the fifth-bit plane in a unit block.
const NIBBLES: usize = 2 * R;
const FIFTH: usize = NIBBLES + 4 * 64;
const _: () = assert!(FIFTH + 64 == BLOCK_BYTES);

/// Whether this process packs a `rows × cols` Q5_0 matrix into x16 units for decode (fixed per
/// process, like the SIMD level).
pub fn applies(rows: usize, cols: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::cpu::simd::{current, Level};
        rows > 0 && rows.is_multiple_of(R) && cols.is_multiple_of(32) && current() >= Level::Avx512
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, cols);
        false
    }
}

/// Where value `e` (0..32) of row `r` of a unit block lives: (byte of its nibble, the nibble's
/// shift, byte of its fifth bit, that bit). The one place the layout is spelled out.
fn value_at(r: usize, e: usize) -> (usize, u32, usize, u32) {
    let (l, i) = (e / 4, 4 * r + e % 4);
    (
        NIBBLES + 64 * (l / 2) + i,
        4 * (l % 2) as u32,
        FIFTH + i,
        l as u32,
    )
}

/// The stored 5-bit value (0..32) of value `e` of a file block.
fn file_value(x: &[u8], e: usize) -> u8 {
    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
    let nibble = if e < 16 {
        x[6 + e] & 0xF
    } else {
        x[6 + e - 16] >> 4
    };
    nibble | ((((qh >> e) & 1) as u8) << 4)
}

/// Sixteen file rows' block `b` (`src`: rows of `nb` blocks) into one unit block (`out`, zeroed).
fn pack_block(src: &[u8], nb: usize, b: usize, out: &mut [u8]) {
    for r in 0..R {
        let at = (r * nb + b) * W_BYTES;
        let x = &src[at..at + W_BYTES];
        out[2 * r..2 * r + 2].copy_from_slice(&x[..2]);
        for e in 0..32 {
            let v = file_value(x, e);
            let (lo, ls, hi, hb) = value_at(r, e);
            out[lo] |= (v & 0xF) << ls;
            out[hi] |= (v >> 4) << hb;
        }
    }
}

/// Row `r` (0..16) of a unit block: its `d` bits and its 32 stored values (0..32).
pub fn read_block(unit_block: &[u8], r: usize) -> (u16, [u8; 32]) {
    let x = unit_block;
    let d = u16::from_le_bytes([x[2 * r], x[2 * r + 1]]);
    let q = std::array::from_fn(|e| {
        let (lo, ls, hi, hb) = value_at(r, e);
        ((x[lo] >> ls) & 0xF) | (((x[hi] >> hb) & 1) << 4)
    });
    (d, q)
}

/// Packs a Q5_0 matrix (`src`: `rows` file rows of `cols / 32` blocks) into `out` (the same
/// size), units split across the pool. Panics unless `rows % 16 == 0`, `cols % 32 == 0` and the
/// sizes match.
pub fn pack_into(pool: &ThreadPool, src: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    pack_blocks32(pool, (src, rows, cols, W_BYTES), out, pack_block);
}

/// `n` Q8_0 activation rows (`xq`: rows of `cols / 32` blocks, codes within ±127) against a whole
/// packed matrix `w`: `out[t * rows + i]` = activation row `t` · packed row `i`, each as [`gemv`]
/// computes it for that row alone (`x16::matmul_blocks32`). Only at the AVX-512 level, which the
/// layout is only packed at.
#[cfg(target_arch = "x86_64")]
pub fn matmul(pool: &ThreadPool, cols: usize, w: &[u8], xq: &[u8], n: usize, out: &mut [f32]) {
    let shape = (cols, W_BYTES, n);
    crate::kernels::cpu::layouts::x16::matmul_blocks32(
        pool,
        shape,
        w,
        xq,
        out,
        (&avx512::ROWS, 16),
    );
}

/// One Q8_0 activation row (`xq`: `cols / 32` blocks, codes within ±127) against the x16 units in
/// `w` (whole units of a packed matrix): `out[i]` = packed row `i`, as the row kernel computes it.
pub fn gemv(cols: usize, w: &[u8], xq: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    gemv_blocks32(cols, W_BYTES, w, xq, out, (avx512::dot_unit, 16));
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (cols, w, xq, out);
        unreachable!("the x16 layout is only packed at the AVX-512 level");
    }
}
