//! Q6_K prefill GEMM over weight panels of eight rows, packed on the fly.
//!
//! For 8 or more activation rows llama.cpp multiplies Q6_K (which it does not repack) with
//! ggml-cpu's tiled k-quant matmul: per output and per super-block one exact integer sum
//! `isum = Σ_sb scale_sb · Σ (q - 32)·a`, then `acc = fma(d_w · isum, d_a, acc)`. This module
//! computes the same floats eight weight rows at a time: each group of eight rows is unpacked once
//! per call into a panel of plain 6-bit values (`pack_group`), which the AVX2 kernel then multiplies
//! with four activation rows at a time, lane `c` of every vector being weight row `c`.
//!
//! Panel block layout (eight rows × 256 columns, [`PANEL_BLOCK`] bytes): `@0` the rows' `d` as
//! f32; `@32` the 16 sub-block scales (i8) transposed, sub-block `sb` of row `c` at `32 + 8sb + c`;
//! `@160` the values `q` (0..64, unsigned): value `e` of row `c` at `160 + 32(e / 4) + 4c + e % 4`.
//!
//! At the AVX-512 level pairs of groups are packed side by side into **wide** panels of sixteen
//! rows ([`WIDE_BLOCK`] bytes a block: `@0` the rows' `d` as f32; `@64` the scales, sub-block `sb`
//! of row `c` at `64 + 16sb + c`; `@320` the values, value `e` of row `c` at
//! `320 + 64(e / 4) + 4c + e % 4`), multiplied by the `avx512` kernel; a last odd group takes the
//! eight-row path.
//!
//! Invariant: panels are built only for `rows % 8 == 0`, `cols % 256 == 0`; rows that are not part
//! of a whole group stay on the unpacked path. [`dot_group_scalar`] is the scalar twin both
//! kernels are held to, bit for bit.

use crate::kernels::cpu::layouts::q6_k_x16::{self, unpack_file_block, Layout};
use crate::kernels::cpu::threads::pool::{ThreadPool, FINE_CHUNKS};
use crate::kernels::cpu::SharedMut;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

/// Weight rows per panel.
pub const GROUP: usize = 8;
/// Bytes of one panel block.
pub const PANEL_BLOCK: usize = 32 + 128 + 2048;
const _: () = assert!(PANEL_BLOCK == 276 * GROUP && WIDE_BLOCK == 276 * WIDE);
/// Weight rows per wide panel (AVX-512).
pub const WIDE: usize = 2 * GROUP;
/// Bytes of one wide panel block.
pub const WIDE_BLOCK: usize = 64 + 256 + 4096;
/// Bytes of one Q6_K file block and one Q8_K activation block.
const W_BYTES: usize = 210;
const A_BYTES: usize = 292;

/// Whether a `rows × cols` Q6_K matrix with `n` activation rows takes this path (llama.cpp's
/// tiled matmul runs for `n >= 8`).
pub fn applies(rows: usize, cols: usize, n: usize) -> bool {
    n >= 8 && rows >= GROUP && cols.is_multiple_of(256)
}

/// Packs eight rows (`src`: 8 rows of `nb` file blocks) into `panel` (`nb` panel blocks).
pub fn pack_group(src: &[u8], nb: usize, panel: &mut [u8]) {
    pack_rows(src, Layout::File, nb, 0, GROUP, panel);
}

/// Packs sixteen rows (`src`: 16 rows of `nb` blocks, laid out as `layout` says) into a wide
/// `panel` (`nb` blocks).
pub fn pack_wide(src: &[u8], layout: Layout, nb: usize, panel: &mut [u8]) {
    if layout == Layout::X16 {
        pack_wide_x16(src, nb, panel);
    } else {
        pack_rows(src, layout, nb, 0, WIDE, panel);
    }
}

/// [`pack_wide`] from one x16 unit: its chunks' vectors are the wide panel's value rows as they
/// are (four values of each of the sixteen rows), so they are unpacked straight into place.
fn pack_wide_x16(src: &[u8], nb: usize, panel: &mut [u8]) {
    use crate::kernels::cpu::layouts::q6_k_x16::{scale_at, unpack_chunk, BLOCK_BYTES, QUANTS};
    let mut v = [[0u8; 64]; 4];
    for b in 0..nb {
        let x = &src[b * BLOCK_BYTES..(b + 1) * BLOCK_BYTES];
        let o = &mut panel[b * WIDE_BLOCK..(b + 1) * WIDE_BLOCK];
        for c in 0..WIDE {
            let d = half::f16::from_le_bytes([x[2 * c], x[2 * c + 1]]).to_f32();
            o[4 * c..4 * c + 4].copy_from_slice(&d.to_le_bytes());
            for sb in 0..16 {
                o[4 * WIDE + WIDE * sb + c] = x[scale_at(c, sb)];
            }
        }
        for k in 0..16 {
            unpack_chunk(&x[QUANTS + 192 * k..QUANTS + 192 * (k + 1)], &mut v);
            for (j, vj) in v.iter().enumerate() {
                let at = 20 * WIDE + 64 * (4 * k + j);
                o[at..at + 64].copy_from_slice(vj);
            }
        }
    }
}

/// Row `c`'s block `b` of a run of rows (the run starting at a group of four in the x4 layout, at
/// a unit in the x16 one): its `d`, its scales and its 256 values into `q`.
fn read_block(
    src: &[u8],
    layout: Layout,
    nb: usize,
    c: usize,
    b: usize,
    q: &mut [u8; 256],
) -> (f32, [i8; 16]) {
    let file_block = |at: usize, q: &mut [u8; 256]| {
        let x = &src[at..at + W_BYTES];
        unpack_file_block(x, q);
        let d = half::f16::from_le_bytes([x[208], x[209]]).to_f32();
        (d, std::array::from_fn(|s| x[192 + s] as i8))
    };
    match layout {
        Layout::File => file_block((c * nb + b) * W_BYTES, q),
        Layout::X4 => file_block(
            crate::kernels::cpu::layouts::q6_k_x4::block_offset(nb, c, b),
            q,
        ),
        Layout::X16 => {
            use crate::kernels::cpu::layouts::q6_k_x16::{BLOCK_BYTES, R};
            let at = (c / R * nb + b) * BLOCK_BYTES;
            q6_k_x16::read_block(&src[at..at + BLOCK_BYTES], c % R, q)
        }
    }
}

/// Rows `row0..row0 + r` of `src` (`r` 8 or 16, laid out as `layout` says; `row0` a multiple of
/// `r`) into panel blocks of `276r` bytes: both panel layouts are this one (`d` at 0, scales at
/// `4r`, values at `20r`) for their row count. The rows are addressed in the whole of `src`, so an
/// eight-row group of a sixteen-row x16 unit is read where the unit keeps it.
fn pack_rows(src: &[u8], layout: Layout, nb: usize, row0: usize, r: usize, panel: &mut [u8]) {
    let block = 276 * r;
    let mut q = [0u8; 256];
    for b in 0..nb {
        let o = &mut panel[b * block..(b + 1) * block];
        for c in 0..r {
            let (d, scales) = read_block(src, layout, nb, row0 + c, b, &mut q);
            o[4 * c..4 * c + 4].copy_from_slice(&d.to_le_bytes());
            for (sb, s) in scales.iter().enumerate() {
                o[4 * r + r * sb + c] = *s as u8;
            }
            for (e4, v) in q.chunks_exact(4).enumerate() {
                let at = 20 * r + 4 * r * e4 + 4 * c;
                o[at..at + 4].copy_from_slice(v);
            }
        }
    }
}

/// Whether this process multiplies wide panels (the AVX-512 level).
fn wide() -> bool {
    use crate::kernels::cpu::simd::{current, Level};
    cfg!(target_arch = "x86_64") && current() >= Level::Avx512
}

/// `out (n × rows)` columns `0..rows / 8 * 8` of `x · Wᵀ` for a Q6_K matrix `w` (`rows × cols`,
/// laid out as `layout` says) and `n` Q8_K activation rows
/// `xq`; returns how many rows it computed (the rest, fewer than eight, are the caller's).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    pool: &ThreadPool,
    w: &[u8],
    layout: Layout,
    rows: usize,
    cols: usize,
    xq: &[u8],
    n: usize,
    out: &mut [f32],
) -> usize {
    let nb = cols / 256;
    let (row_bytes, a_row) = (nb * W_BYTES, nb * A_BYTES);
    assert!(
        cols.is_multiple_of(256) && w.len() == rows * row_bytes,
        "Q6_K matrix bytes"
    );
    assert_eq!(xq.len(), n * a_row, "activation bytes");
    assert_eq!(out.len(), n * rows, "output size");
    let groups = rows / GROUP;
    let dst = SharedMut(out.as_mut_ptr());
    // Units of `step` groups: a wide panel (two groups) at the AVX-512 level, else one group.
    let step = if wide() { 2 } else { 1 };
    pool.for_range_with(groups.div_ceil(step), 1, FINE_CHUNKS, |range| {
        let mut panel = vec![0u8; nb * PANEL_BLOCK.max(WIDE_BLOCK)];
        for u in range {
            let g = u * step;
            if step == 2 && g + 1 < groups {
                pack_wide(
                    &w[g * GROUP * row_bytes..(g + 2) * GROUP * row_bytes],
                    layout,
                    nb,
                    &mut panel,
                );
                for t0 in (0..n).step_by(4) {
                    let m = (n - t0).min(4);
                    let mut res = [[0f32; WIDE]; 4];
                    dot_wide(
                        nb,
                        &panel,
                        &xq[t0 * a_row..(t0 + m) * a_row],
                        a_row,
                        m,
                        &mut res,
                    );
                    // SAFETY: rows t0..t0 + m < n and columns g * 8..g * 8 + 16 <= rows are
                    // inside `out`; groups g, g + 1 belong to this chunk only.
                    unsafe { dst.store_tile(rows, t0, g * GROUP, &res[..m], WIDE) };
                }
                continue;
            }
            let panel = &mut panel[..nb * PANEL_BLOCK];
            // Addressed in the whole matrix: in the x16 layout a group's rows sit inside a unit
            // of two groups (this path takes one group at a time below the AVX-512 level).
            pack_rows(w, layout, nb, g * GROUP, GROUP, panel);
            for t0 in (0..n).step_by(4) {
                let m = (n - t0).min(4);
                let mut res = [[0f32; GROUP]; 4];
                dot_group(
                    nb,
                    panel,
                    &xq[t0 * a_row..(t0 + m) * a_row],
                    a_row,
                    m,
                    &mut res,
                );
                // SAFETY: rows t0..t0 + m < n and columns g * 8..g * 8 + 8 <= rows are inside
                // `out`; group g belongs to this chunk only.
                unsafe { dst.store_tile(rows, t0, g * GROUP, &res[..m], GROUP) };
            }
        }
    });
    groups * GROUP
}

/// One panel (`nb` blocks) times `m` (1..=4) Q8_K activation rows `stride` bytes apart;
/// `out[r][c]` = activation row `r` · weight row `c`.
pub fn dot_group(
    nb: usize,
    panel: &[u8],
    a: &[u8],
    stride: usize,
    m: usize,
    out: &mut [[f32; GROUP]; 4],
) {
    assert!((1..=4).contains(&m), "1..=4 activation rows");
    assert_eq!(panel.len(), nb * PANEL_BLOCK, "panel bytes");
    assert!(stride >= nb * A_BYTES && a.len() >= (m - 1) * stride + nb * A_BYTES);
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar {
        // SAFETY: a non-scalar level is selected only after AVX2, FMA and F16C were detected;
        // `panel` holds `nb` panel blocks and each of the `m` activation rows `nb` Q8_K blocks
        // (asserted above), which is all the kernel reads; it writes `out[..m]` only.
        unsafe { avx2::dot_group(nb, panel.as_ptr(), a.as_ptr(), stride, m, out) };
        return;
    }
    dot_group_scalar(nb, panel, a, stride, m, out);
}

/// One wide panel (`nb` blocks, sixteen rows) times `m` (1..=4) Q8_K activation rows `stride`
/// bytes apart; `out[r][c]` = activation row `r` · weight row `c`. Only at the AVX-512 level.
pub fn dot_wide(
    nb: usize,
    panel: &[u8],
    a: &[u8],
    stride: usize,
    m: usize,
    out: &mut [[f32; WIDE]; 4],
) {
    assert!((1..=4).contains(&m), "1..=4 activation rows");
    assert_eq!(panel.len(), nb * WIDE_BLOCK, "wide panel bytes");
    assert!(stride >= nb * A_BYTES && a.len() >= (m - 1) * stride + nb * A_BYTES);
    assert!(wide(), "wide Q6_K panels need the AVX-512 level");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `wide()` holds only at the AVX-512 level, selected after its features were
    // detected; `panel` holds `nb` wide blocks and each of the `m` activation rows `nb` Q8_K
    // blocks (asserted above), which is all the kernel reads; it writes `out[..m]` only.
    unsafe {
        avx512::dot_wide(nb, panel.as_ptr(), a.as_ptr(), stride, m, out)
    };
}

/// The scalar twin of [`dot_group`], one output at a time.
pub fn dot_group_scalar(
    nb: usize,
    panel: &[u8],
    a: &[u8],
    stride: usize,
    m: usize,
    out: &mut [[f32; GROUP]; 4],
) {
    for (r, out_r) in out.iter_mut().enumerate().take(m) {
        for (c, o) in out_r.iter_mut().enumerate() {
            let mut acc = 0f32;
            for b in 0..nb {
                let x = &panel[b * PANEL_BLOCK..(b + 1) * PANEL_BLOCK];
                let y = &a[r * stride + b * A_BYTES..r * stride + (b + 1) * A_BYTES];
                let dw = f32::from_le_bytes([x[4 * c], x[4 * c + 1], x[4 * c + 2], x[4 * c + 3]]);
                let ad = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                let mut isum = 0i32;
                for e in 0..256 {
                    let q = x[160 + 32 * (e / 4) + 4 * c + e % 4] as i32 - 32;
                    let sc = x[32 + 8 * (e / 16) + c] as i8 as i32;
                    isum += sc * q * y[4 + e] as i8 as i32;
                }
                acc = (dw * isum as f32).mul_add(ad, acc);
            }
            *o = acc;
        }
    }
}
