//! Prefill GEMM for the weight types whose dot product is against Q8_0 activations with signed
//! weight bytes (Q8_0, Q5_0), over weight panels of four rows unpacked once per call.
//!
//! llama.cpp multiplies these with tinyBLAS for two or more activation rows and with
//! `ggml_vec_dot_*_q8_0` for one; both compute every output the same way: per 32-value block the
//! exact integer sums of the `_mm256_sign_epi8` / `vpmaddubsw` / `vpmaddwd` pattern in eight i32
//! lanes, `acc = fma(d_w · d_a, lanes, acc)` in eight f32 lanes, and `hsum_float_8` at the end.
//! This module keeps exactly that per output and only changes what is shared: each block's weight
//! bytes are unpacked once per call into a panel (`d` as f32, the signed bytes and their absolute
//! values), and a register tile of four weight rows × three activation rows reuses every load.
//!
//! Panel layout: for each block `b` and row `r` of the group, [`SLOT`] bytes at
//! `(b * 4 + r) * SLOT`: `d` (f32) at 0, the 32 signed weights at 16, their absolute values at 48.
//! At the AVX-512 level the panel has its own layout and the tile is four weight rows × six
//! activation rows with `vpdpbusd` (see `avx512`), with the same integers and float steps.
//!
//! Invariants: only rows in whole groups of four go through here (the caller handles the rest);
//! results are bit-identical to the type's `simd` dot kernel at every level, which the tests check.

use crate::format::GgmlType;
use crate::kernels::cpu::threads::pool::{ThreadPool, FINE_CHUNKS};
use crate::kernels::cpu::SharedMut;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

/// Weight rows per panel.
pub const GROUP: usize = 4;
/// Panel bytes per (block, row).
const SLOT: usize = 80;
/// Bytes of one Q8_0 activation block.
const A_BYTES: usize = 34;
/// Activation rows per register tile.
const TILE_M: usize = 3;

/// Activation rows from which unpacking the panel pays for itself (below, the per-row `tile`
/// kernels are as fast: `cargo bench --bench kernels -- q5_0 q8_0`).
pub const MIN_ROWS: usize = 16;

/// Whether this path takes a `ty` matrix with `n` activation rows on this CPU.
pub fn applies(ty: GgmlType, cols: usize, n: usize) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q5_0)
        && n >= MIN_ROWS
        && cols.is_multiple_of(32)
        && crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar
}

/// Whether [`matmul`] takes the AVX-512 tile: at that level, unless a test asked for the AVX2 one.
fn use_avx512() -> bool {
    #[cfg(test)]
    if tests::FORCE_AVX2.with(|f| f.get()) {
        return false;
    }
    crate::kernels::cpu::simd::current() >= crate::kernels::cpu::simd::Level::Avx512
}

/// Unpacks `GROUP` rows (`src`, `row_bytes` each, `nb` blocks of type `ty`) into `panel`.
fn pack_group(ty: GgmlType, src: &[u8], row_bytes: usize, nb: usize, panel: &mut [u8]) {
    let wb = row_bytes / nb;
    assert!(src.len() >= GROUP * row_bytes && panel.len() >= nb * GROUP * SLOT);
    #[cfg(target_arch = "x86_64")]
    {
        let q5 = ty == GgmlType::Q5_0;
        for b in 0..nb {
            for r in 0..GROUP {
                // SAFETY: `applies` admitted this call only at a non-scalar level (AVX2, FMA,
                // F16C); block (r, b) lies inside `src` and its slot inside `panel` (asserted).
                unsafe {
                    avx2::pack_block(
                        src.as_ptr().add(r * row_bytes + b * wb),
                        q5,
                        panel.as_mut_ptr().add((b * GROUP + r) * SLOT),
                    )
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    pack_group_scalar(ty, src, row_bytes, nb, panel);
}

/// The scalar twin of the AVX2 block unpacking (tests hold the two to each other).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn pack_group_scalar(ty: GgmlType, src: &[u8], row_bytes: usize, nb: usize, panel: &mut [u8]) {
    let wb = row_bytes / nb;
    for b in 0..nb {
        for r in 0..GROUP {
            let x = &src[r * row_bytes + b * wb..r * row_bytes + (b + 1) * wb];
            let o = &mut panel[(b * GROUP + r) * SLOT..(b * GROUP + r + 1) * SLOT];
            let d = half::f16::from_le_bytes([x[0], x[1]]).to_f32();
            o[..4].copy_from_slice(&d.to_le_bytes());
            let mut q = [0i8; 32];
            match ty {
                GgmlType::Q8_0 => q.iter_mut().zip(&x[2..34]).for_each(|(q, &v)| *q = v as i8),
                _ => {
                    // Q5_0: qh (u32) at 2, nibbles at 6; value = (nibble | bit << 4) - 16.
                    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
                    for j in 0..16 {
                        let lo = (x[6 + j] & 0xF) | ((((qh >> j) & 1) as u8) << 4);
                        let hi = (x[6 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                        q[j] = lo as i8 - 16;
                        q[j + 16] = hi as i8 - 16;
                    }
                }
            }
            for j in 0..32 {
                o[16 + j] = q[j] as u8;
                o[48 + j] = q[j].unsigned_abs();
            }
        }
    }
}

/// Columns `0..rows / 4 * 4` of `out (n × rows) = x · Wᵀ` for a `ty` matrix `w` (file layout) and
/// `n` Q8_0 activation rows `xq`; returns how many weight rows it computed.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    pool: &ThreadPool,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    xq: &[u8],
    n: usize,
    out: &mut [f32],
) -> usize {
    assert!(applies(ty, cols, n));
    let nb = cols / 32;
    let row_bytes = w.len() / rows;
    let a_row = nb * A_BYTES;
    assert_eq!(row_bytes * rows, w.len(), "weight bytes");
    assert_eq!(xq.len(), n * a_row, "activation bytes");
    assert_eq!(out.len(), n * rows, "output size");
    // The activation scales as f32, once: da[t * nb + b].
    let da: Vec<f32> = (0..n * nb)
        .map(|i| {
            let y = &xq[(i / nb) * a_row + (i % nb) * A_BYTES..];
            half::f16::from_le_bytes([y[0], y[1]]).to_f32()
        })
        .collect();
    let groups = rows / GROUP;
    #[cfg(target_arch = "x86_64")]
    if use_avx512() {
        matmul_avx512(pool, ty, w, rows, xq, n, nb, &da, out);
        return groups * GROUP;
    }
    let dst = SharedMut(out.as_mut_ptr());
    pool.for_range_with(groups, 1, FINE_CHUNKS, |range| {
        let mut panel = vec![0u8; nb * GROUP * SLOT];
        for g in range {
            pack_group(
                ty,
                &w[g * GROUP * row_bytes..(g + 1) * GROUP * row_bytes],
                row_bytes,
                nb,
                &mut panel,
            );
            let mut t0 = 0;
            while t0 < n {
                let m = (n - t0).min(TILE_M);
                let mut res = [[0f32; GROUP]; 3];
                tile(
                    nb,
                    &panel,
                    &xq[t0 * a_row..(t0 + m) * a_row],
                    a_row,
                    &da[t0 * nb..(t0 + m) * nb],
                    m,
                    &mut res,
                );
                // SAFETY: rows t0..t0 + m < n and columns g * 4..g * 4 + 4 <= rows are inside
                // `out`; group g is this chunk's only.
                unsafe { dst.store_tile(rows, t0, g * GROUP, &res[..m], GROUP) };
                t0 += m;
            }
        }
    });
    groups * GROUP
}

/// [`matmul`] at the AVX-512 level: activations offset to unsigned bytes once, then per group of
/// four weight rows one `avx512` panel and tiles of up to six activation rows.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn matmul_avx512(
    pool: &ThreadPool,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    xq: &[u8],
    n: usize,
    nb: usize,
    da: &[f32],
    out: &mut [f32],
) {
    let row_bytes = w.len() / rows;
    YU.with_borrow_mut(|yu| {
        // yu[(t * nb + b) * 32 ..]: block b of activation row t, each byte + 128.
        yu.resize(n * nb * 32, 0);
        let dst = SharedMut(yu.as_mut_ptr());
        pool.for_range(n, 8, |range| {
            let (lo, hi) = (range.start * nb, range.end * nb);
            // SAFETY: blocks `lo..hi` (rows `range`) of `yu` (n * nb blocks of 32 bytes) belong to
            // this chunk only.
            let o =
                unsafe { std::slice::from_raw_parts_mut(dst.ptr().add(lo * 32), (hi - lo) * 32) };
            let src = xq[lo * A_BYTES..hi * A_BYTES].chunks_exact(A_BYTES);
            for (o, blk) in o.chunks_exact_mut(32).zip(src) {
                for (o, &v) in o.iter_mut().zip(&blk[2..]) {
                    *o = v ^ 0x80;
                }
            }
        });
        matmul_avx512_panels(pool, ty, w, rows, row_bytes, yu, n, nb, da, out);
    });
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The offset activation bytes of the current AVX-512 matmul, reused across calls (a fresh
    /// buffer each prefill matmul costs page faults).
    static YU: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The parallel part of [`matmul_avx512`], over groups of four weight rows.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn matmul_avx512_panels(
    pool: &ThreadPool,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    row_bytes: usize,
    yu: &[u8],
    n: usize,
    nb: usize,
    da: &[f32],
    out: &mut [f32],
) {
    assert_eq!(yu.len(), n * nb * 32);
    let q5 = ty == GgmlType::Q5_0;
    let wb = row_bytes / nb;
    let dst = SharedMut(out.as_mut_ptr());
    pool.for_range_with(rows / GROUP, 1, FINE_CHUNKS, |range| {
        let mut panel = vec![0u8; nb * avx512::SLOT];
        for g in range {
            for b in 0..nb {
                for r in 0..GROUP {
                    // SAFETY: AVX-512 detected; block (g * 4 + r, b) lies inside `w` (whole
                    // groups of rows, `nb` blocks of `wb` bytes each) and block b's slot inside
                    // `panel`.
                    unsafe {
                        avx512::pack_block(
                            w.as_ptr().add((g * GROUP + r) * row_bytes + b * wb),
                            q5,
                            r,
                            panel.as_mut_ptr().add(b * avx512::SLOT),
                        )
                    };
                }
            }
            let mut t0 = 0;
            while t0 < n {
                let m = (n - t0).min(avx512::TILE_M);
                let mut res = [[0f32; GROUP]; avx512::TILE_M];
                // SAFETY: AVX-512 detected; the panel holds `nb` blocks; rows `t0..t0 + m` of
                // `yu` and `da` exist (`t0 + m <= n`); `m` is in 1..=TILE_M.
                unsafe {
                    avx512::tile(
                        nb,
                        panel.as_ptr(),
                        yu.as_ptr().add(t0 * nb * 32),
                        da.as_ptr().add(t0 * nb),
                        m,
                        &mut res,
                    )
                };
                // SAFETY: rows t0..t0 + m < n and columns g * 4..g * 4 + 4 <= rows are inside
                // `out`; group g is this chunk's only.
                unsafe { dst.store_tile(rows, t0, g * GROUP, &res[..m], GROUP) };
                t0 += m;
            }
        }
    });
}

/// One panel against `m` (1..=3) activation rows: `out[j][r]` = activation row `j` · weight row
/// `r`. `da` holds the rows' block scales (`m * nb`).
fn tile(
    nb: usize,
    panel: &[u8],
    a: &[u8],
    stride: usize,
    da: &[f32],
    m: usize,
    out: &mut [[f32; GROUP]; 3],
) {
    assert!((1..=3).contains(&m) && panel.len() == nb * GROUP * SLOT);
    assert!(a.len() >= (m - 1) * stride + nb * A_BYTES && da.len() >= m * nb);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `applies` admitted this call only at a non-scalar level (AVX2, FMA and F16C
        // detected); the panel holds `nb` blocks of four rows, and each of the `m` activation rows
        // `nb` blocks and `nb` scales (asserted above); it writes `out[..m]` only.
        unsafe { avx2::tile(nb, panel.as_ptr(), a.as_ptr(), stride, da.as_ptr(), m, out) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("q8_0_panels::applies is false without AVX2");
}
