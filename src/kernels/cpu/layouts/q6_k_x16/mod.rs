//! Q6_K matrices repacked sixteen rows at a time ("x16") for the AVX-512 decode kernel.
//!
//! The file's Q6_K blocks make a one-row kernel unpack each block's 6-bit values, fetch each
//! 16-value run's scale with a permute, and fold, offset and convert eight lanes per block and row:
//! about twice the vector instructions per byte of the Q4_K kernel, which on a fast memory system
//! leaves Q6_K matmuls short of the bandwidth. In this layout one 64-byte vector holds four values
//! of each of sixteen rows (row `r` in dword `r`), so four activation bytes broadcast to all lanes
//! meet sixteen rows at once (`vpmaddubsw`, then `vpdpwssd` by the rows' scales), each lane of
//! ggml's eight-lane block sum has an accumulator of its own (lane `l` of all sixteen rows in one
//! register), and the scales, the `-32` offset and the block's float step cost a few instructions
//! per sixteen rows instead of per row.
//!
//! Layout of one unit block (sixteen rows × 256 columns, [`BLOCK_BYTES`] = 16 × 210 bytes, the
//! file's size):
//! - `@0`: the rows' `d` (f16), row `r` at `2r`;
//! - `@32` ([`SCALES`]): the scales in pairs: scales `2p, 2p + 1` of row `r` at `32 + 32p + 2r`;
//! - `@288` ([`QUANTS`]): sixteen chunks of 192 bytes, chunk `k = 2g + h` holding the four
//!   vectors `V_j` (`j` in 0..4) of values `32g + 4(4h + j) + e` (`e` in 0..4) of every row, byte
//!   `i = 4r + e` of a vector: its low nibble at byte `i` of `ZL1` (`V_0`, bits 0-3; `V_1`, bits
//!   4-7) or `ZL2` (`V_2`, `V_3`), its top two bits at byte `i` of `ZH` (bits 4-5 for `V_0`, 2-3
//!   for `V_1`, 0-1 for `V_2`, 6-7 for `V_3`), `ZL1`, `ZL2`, `ZH` at `0, 64, 128` in the chunk.
//!
//! Units follow each other (`u * nb + b`), so decode reads one linear stream. The integer lanes
//! are exactly those of `ggml_vec_dot_q6_K_q8_K`'s AVX2 kernel and the float steps are its
//! lane-wise `fma`s and its final horizontal sum, so every output is bit-identical to the row
//! kernel (`simd`), which the tests hold it to. The prefill GEMM (`q6_k_panels`) builds its panels
//! from this copy through [`unpack_chunk`] ([`read_block`] gives one row's block).
//!
//! Invariant: a matrix is packed only when [`applies`] (the AVX-512 level, `rows % 16 == 0`,
//! `cols % 256 == 0`), and that is fixed for the process.

#[cfg(target_arch = "x86_64")]
use crate::kernels::cpu::layouts::x16::gemv_units;
use crate::kernels::cpu::layouts::x16::pack_units;
pub use crate::kernels::cpu::layouts::x16::R;
use crate::kernels::cpu::threads::pool::ThreadPool;

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

/// Bytes of one Q6_K file block.
const W_BYTES: usize = 210;
/// Bytes of one unit block.
pub const BLOCK_BYTES: usize = R * W_BYTES;
/// Offset of the scale pairs in a unit block.
pub const SCALES: usize = 2 * R;
/// Offset of the value chunks in a unit block.
pub const QUANTS: usize = SCALES + 16 * R;
const _: () = assert!(QUANTS + 16 * 192 == BLOCK_BYTES);

/// Where a Q6_K matrix's decode copy keeps its blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The file's rows.
    File,
    /// `q6_k_x4`: groups of four rows, blocks interleaved.
    X4,
    /// This module's units of sixteen rows.
    X16,
}

/// Whether this process packs a `rows × cols` Q6_K matrix into x16 units (fixed per process, like
/// the SIMD level).
pub fn applies(rows: usize, cols: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::cpu::simd::{current, Level};
        rows > 0 && rows.is_multiple_of(R) && cols.is_multiple_of(256) && current() >= Level::Avx512
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (rows, cols);
        false
    }
}

/// Where scale `s` (0..16) of row `r` of a unit block lives.
pub fn scale_at(r: usize, s: usize) -> usize {
    SCALES + 32 * (s / 2) + 2 * r + s % 2
}

/// Which value byte `i` (0..64) of vector `j` (0..4) of chunk `k` (0..16) holds: (row, value
/// index). With [`unpack_chunk`]'s bit positions (and [`pack_block`], its inverse), the one place
/// the value order is spelled out.
fn chunk_value(k: usize, j: usize, i: usize) -> (usize, usize) {
    (i / 4, 32 * (k / 2) + 4 * (4 * (k % 2) + j) + i % 4)
}

/// The 256 values (0..64) of one file block.
pub(crate) fn unpack_file_block(x: &[u8], q: &mut [u8; 256]) {
    for h in 0..2 {
        let (ql, qh) = (&x[64 * h..64 * h + 64], &x[128 + 32 * h..128 + 32 * h + 32]);
        for l in 0..32 {
            let e = 128 * h + l;
            q[e] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            q[e + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            q[e + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            q[e + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
}

/// Sixteen file rows' block `b` (`src`: rows of `nb` blocks) into one unit block (`out`,
/// zeroed): the inverse of [`unpack_chunk`] for every chunk.
fn pack_block(src: &[u8], nb: usize, b: usize, out: &mut [u8]) {
    let mut q = [[0u8; 256]; R];
    for (r, qr) in q.iter_mut().enumerate() {
        let at = (r * nb + b) * W_BYTES;
        let x = &src[at..at + W_BYTES];
        out[2 * r..2 * r + 2].copy_from_slice(&x[208..210]);
        for s in 0..16 {
            out[scale_at(r, s)] = x[192 + s];
        }
        unpack_file_block(x, qr);
    }
    for k in 0..16 {
        let c = &mut out[QUANTS + 192 * k..QUANTS + 192 * (k + 1)];
        for i in 0..64 {
            let v: [u8; 4] = std::array::from_fn(|j| {
                let (r, e) = chunk_value(k, j, i);
                q[r][e]
            });
            c[i] = (v[0] & 0xF) | ((v[1] & 0xF) << 4);
            c[64 + i] = (v[2] & 0xF) | ((v[3] & 0xF) << 4);
            c[128 + i] = ((v[0] >> 4) << 4) | ((v[1] >> 4) << 2) | (v[2] >> 4) | ((v[3] >> 4) << 6);
        }
    }
}

/// The four vectors `V_0..V_3` (values 0..64, byte `4r + e`) of one 192-byte chunk: what the
/// kernel unpacks, for the prefill panels.
pub fn unpack_chunk(c: &[u8], v: &mut [[u8; 64]; 4]) {
    let (zl1, zl2, zh) = (&c[..64], &c[64..128], &c[128..192]);
    for i in 0..64 {
        let (l1, l2, h) = (zl1[i], zl2[i], zh[i]);
        v[0][i] = (l1 & 0xF) | (h & 0x30);
        v[1][i] = (l1 >> 4) | ((h << 2) & 0x30);
        v[2][i] = (l2 & 0xF) | ((h << 4) & 0x30);
        v[3][i] = (l2 >> 4) | ((h >> 2) & 0x30);
    }
}

/// Row `r` (0..16) of a unit block: its `d`, its sixteen scales and its 256 values (0..64).
pub fn read_block(unit_block: &[u8], r: usize, q: &mut [u8; 256]) -> (f32, [i8; 16]) {
    let x = unit_block;
    let d = half::f16::from_le_bytes([x[2 * r], x[2 * r + 1]]).to_f32();
    let scales = std::array::from_fn(|s| x[scale_at(r, s)] as i8);
    let mut v = [[0u8; 64]; 4];
    for k in 0..16 {
        unpack_chunk(&x[QUANTS + 192 * k..QUANTS + 192 * (k + 1)], &mut v);
        for (j, vj) in v.iter().enumerate() {
            for i in 4 * r..4 * r + 4 {
                q[chunk_value(k, j, i).1] = vj[i];
            }
        }
    }
    (d, scales)
}

/// Packs a Q6_K matrix (`src`: `rows` file rows of `cols / 256` blocks) into `out` (the same
/// size), units split across the pool. Panics unless `rows % 16 == 0`, `cols % 256 == 0` and the
/// sizes match.
pub fn pack_into(pool: &ThreadPool, src: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    assert!(
        rows.is_multiple_of(R) && cols.is_multiple_of(256),
        "{rows}x{cols} is not x16-packable"
    );
    let nb = cols / 256;
    assert_eq!(src.len(), rows * nb * W_BYTES, "Q6_K matrix bytes");
    pack_units(pool, src, nb * BLOCK_BYTES, out, |s, o| {
        for (b, ob) in o.chunks_exact_mut(BLOCK_BYTES).enumerate() {
            pack_block(s, nb, b, ob);
        }
    });
}

/// `n` activation rows (`xq`: rows of `cols / 256` Q8_K blocks) against a whole packed matrix
/// (`rows` rows): `out[t * rows + i]` = activation row `t` · packed row `i`, each as [`gemv`] (and
/// so the row kernel) computes it for that row alone. Units are split across the pool; each
/// unit is read once per four activation rows (the first time from memory, then from cache).
pub fn matmul(
    pool: &ThreadPool,
    packed: &[u8],
    rows: usize,
    cols: usize,
    xq: &[u8],
    n: usize,
    out: &mut [f32],
) {
    assert!(applies(rows, cols), "{rows}x{cols} is not x16-packed here");
    let nb = cols / 256;
    let (unit, a_row) = (nb * BLOCK_BYTES, nb * 292);
    assert_eq!(packed.len(), rows / R * unit, "packed matrix bytes");
    assert_eq!(xq.len(), n * a_row, "activation bytes");
    assert_eq!(out.len(), n * rows, "output size");
    #[cfg(target_arch = "x86_64")]
    crate::kernels::cpu::layouts::x16::unit_rows(pool, n, out, |u, t0, m, res| {
        // SAFETY: the AVX-512 level is available (`applies`); unit `u` lies inside `packed` and
        // rows t0..t0 + m inside `xq` (both checked above).
        unsafe {
            let w = packed.as_ptr().add(u * unit);
            let a = xq.as_ptr().add(t0 * a_row);
            avx512::ROWS[m - 1](nb, w, a, a_row, res);
        }
    });
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pool, nb, unit, a_row);
        unreachable!("the x16 layout is only packed at the AVX-512 level");
    }
}

/// One activation row (`xq`: `cols / 256` Q8_K blocks) against the x16 units in `w` (whole units
/// of a packed matrix): `out[i]` = packed row `i`, as the row kernel computes it.
pub fn gemv(cols: usize, w: &[u8], xq: &[u8], out: &mut [f32]) {
    assert!(cols.is_multiple_of(256), "whole blocks");
    let nb = cols / 256;
    #[cfg(target_arch = "x86_64")]
    {
        let kernel: crate::kernels::cpu::layouts::x16::UnitKernel =
            crate::kernels::cpu::layouts::prefetch::pick(
                avx512::dot_unit::<true>,
                avx512::dot_unit::<false>,
            );
        gemv_units(nb, nb * BLOCK_BYTES, w, xq, nb * 292, out, kernel);
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (nb, w, xq, out);
        unreachable!("the x16 layout is only packed at the AVX-512 level");
    }
}
