//! Q8_0 matrices repacked sixteen rows at a time ("x16") for the AVX-512 decode kernel.
//!
//! The four-row kernel (`simd`) spends about seven vector instructions per 34-byte block and row
//! (the offset, one `vpdpbusd`, and a float step of eight lanes per row). Gemma-3's output head is
//! a 262144 × 640 Q8_0 matrix, 178 MB of its 250 MB a token: with the two cores of the
//! development machine each streaming about 42 GB/s, that kernel held the head to about 87% of
//! the bandwidth. Here, as in `q5_0_x16`, one 64-byte vector holds four values of each of sixteen
//! rows (row `r` in dword `r`), four activation bytes broadcast to all lanes meet them in one
//! `vpdpbusd`, and each of ggml's eight lanes per block (four products each) has an accumulator
//! holding that lane for all sixteen rows, so the conversion and the `fma` cost one instruction
//! per lane per sixteen rows.
//!
//! Layout of one unit block (sixteen rows × 32 columns, [`BLOCK_BYTES`] = 16 × 34 bytes, the
//! file's size): `@0` the rows' `d` (f16), row `r` at `2r`; `@32` eight vectors of 64 bytes,
//! vector `V_l` (`l` in 0..8) holding values `4l..4l + 4` of every row, value `4l + e` of row `r`
//! at byte `4r + e`, as the unsigned byte `q + 128` (`q ^ 0x80`).
//!
//! The integers are exactly the AVX2 kernel's lanes (`Σ (q + 128)·a - 128·Σ a` per lane,
//! activation codes within ±127 as the Q8_0 quantizer makes them) and the float steps are its
//! lane-wise `fma`s (`d_w · d_a` rounded) and its final horizontal sum, so every output is
//! bit-identical to the row kernel, which the tests hold it to.
//!
//! This copy replaces the plain one: decode reads only it, and what else reads the matrix
//! (prefill's GEMM, embedding lookups) reads the mapped file, so the matrix is held in memory
//! once.
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

/// Bytes of one Q8_0 block (file and activation alike).
const W_BYTES: usize = 34;
/// Bytes of one unit block.
pub const BLOCK_BYTES: usize = R * W_BYTES;
/// Offset of the value vectors in a unit block.
const VALUES: usize = 2 * R;
const _: () = assert!(VALUES + 8 * 64 == BLOCK_BYTES);

/// Whether this process packs a `rows × cols` Q8_0 matrix into x16 units for decode (fixed per
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

/// The byte of a unit block that holds value `e` (0..32) of row `r`. The one place the layout is
/// spelled out.
fn value_at(r: usize, e: usize) -> usize {
    VALUES + 64 * (e / 4) + 4 * r + e % 4
}

/// Sixteen file rows' block `b` (`src`: rows of `nb` blocks) into one unit block (`out`).
fn pack_block(src: &[u8], nb: usize, b: usize, out: &mut [u8]) {
    for r in 0..R {
        let at = (r * nb + b) * W_BYTES;
        let x = &src[at..at + W_BYTES];
        out[2 * r..2 * r + 2].copy_from_slice(&x[..2]);
        for e in 0..32 {
            out[value_at(r, e)] = x[2 + e] ^ 0x80;
        }
    }
}

/// Row `r` (0..16) of a unit block: its `d` bits and its 32 values (`q`, as `i8`).
pub fn read_block(unit_block: &[u8], r: usize) -> (u16, [i8; 32]) {
    let x = unit_block;
    let d = u16::from_le_bytes([x[2 * r], x[2 * r + 1]]);
    (d, std::array::from_fn(|e| (x[value_at(r, e)] ^ 0x80) as i8))
}

/// Packs a Q8_0 matrix (`src`: `rows` file rows of `cols / 32` blocks) into `out` (the same
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
        (&avx512::ROWS, -128),
    );
}

/// One Q8_0 activation row (`xq`: `cols / 32` blocks, codes within ±127) against the x16 units in
/// `w` (whole units of a packed matrix): `out[i]` = packed row `i`, as the row kernel computes it.
pub fn gemv(cols: usize, w: &[u8], xq: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let kernel: crate::kernels::cpu::layouts::x16::Block32Kernel =
            crate::kernels::cpu::layouts::prefetch::pick(
                avx512::dot_unit::<true>,
                avx512::dot_unit::<false>,
            );
        gemv_blocks32(cols, W_BYTES, w, xq, out, (kernel, -128));
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (cols, w, xq, out);
        unreachable!("the x16 layout is only packed at the AVX-512 level");
    }
}
