//! Q4_K matrices repacked eight rows at a time ("x8"), and the matmul over them.
//!
//! llama.cpp repacks every Q4_K matrix whose row count is a multiple of 8 (its CPU_REPACK buffer)
//! so that one SIMD register holds the same four columns of eight weight rows; its GEMV and GEMM
//! then accumulate eight outputs lane-wise, with no horizontal reductions. This module does the
//! same with its own layout, once per weight (on first use, [`pack`] across the thread pool), and
//! keeps the float arithmetic of llama.cpp's two kernels, operation for operation, so results stay
//! bit-identical to it:
//! - **GEMV flavour** (`ggml_gemv_q4_K_8x8_q8_K`, activation rows that are not part of a group of
//!   four): per super-block one exact integer sum `isum` and min sum `imin`,
//!   `acc = fma(isum, d_w·d_a, acc)`, `accm = fma(imin, dmin_w·d_a, accm)`, result `acc - accm`.
//! - **GEMM flavour** (`ggml_gemm_q4_K_8x8_q8_K`, whole groups of four activation rows when a call
//!   has four or more): the same with one `fma` per pair of sub-blocks (64 values).
//!
//! Layout of one packed block of `R` weight rows × 256 columns (`R = 8`: 1152 bytes = 8 × 144, the
//! same size as the file's blocks, so decode reads no more bytes than before):
//! - `@0`: the rows' `d` (f16), `@2R`: their `dmin` (f16);
//! - `@4R`: the 12 packed scale/min bytes transposed: byte `i` of row `c` at `4R + R·i + c`;
//! - `@16R`: the nibbles: for pair `p` (0..4) and step `s` (0..8), the `4R` bytes at
//!   `16R + 32R·p + 4R·s` hold row `c`'s file bytes `16 + 32p + 4s .. +4` at offset `4c` (low
//!   nibbles: sub-block `2p`, values `4s..4s+4`; high nibbles: sub-block `2p + 1`).
//!
//! Blocks are stored group by group (`group * nb + block`), `R = 8` ("x8"). In the **wide**
//! layout the AVX-512 level packs ([`wide`]), each pair of groups `(2u, 2u + 1)` is one unit of
//! `R = 16` rows ("x16"), so one 64-byte load holds four columns of sixteen rows and the kernel
//! reads one sequential stream (reading the two groups' x8 blocks side by side, two streams, cost
//! decode half its bandwidth on the development machine); a last odd group stays x8. Units never
//! split across threads.
//!
//! Invariant: a packed buffer is only built from a matrix with `rows % 8 == 0` and
//! `cols % 256 == 0`, exactly `rows * cols / 256` file blocks, and only read in the layout this
//! process packs ([`wide`] is fixed per process). The scalar twin [`dot_scalar`] is what the AVX2
//! kernels (one x8 group, [`dot_group`]) and the AVX-512 ones (one x16 unit, [`dot_pair`]) are
//! tested against, bit for bit, and what runs on CPUs without AVX2.

use crate::kernels::cpu::memory::hugebuf::HugeBuf;
use crate::kernels::cpu::threads::pool::{ThreadPool, CHUNKS_PER_THREAD, FINE_CHUNKS};
use crate::kernels::cpu::SharedMut;
use crate::quant::blocks::get_scale_min_k4;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512_x16;
#[cfg(test)]
mod tests;

/// Weight rows per packed group.
pub const GROUP: usize = 8;
/// Bytes of one packed block (eight 144-byte Q4_K blocks).
pub const BLOCK_BYTES: usize = GROUP * 144;
/// Bytes of one Q8_K activation block (`d: f32`, 256 `i8`, 16 `i16` bsums).
const A_BYTES: usize = 292;

/// Whether [`pack`] accepts a `rows × cols` Q4_K matrix.
pub fn packable(rows: usize, cols: usize) -> bool {
    rows.is_multiple_of(GROUP) && cols.is_multiple_of(256) && rows > 0
}

/// Whether this process packs the wide layout and multiplies sixteen rows at a time (the AVX-512
/// level); fixed for the process, like the level.
pub fn wide() -> bool {
    use crate::kernels::cpu::simd::{current, Level};
    cfg!(target_arch = "x86_64") && current() >= Level::Avx512
}

/// Groups in the unit that starts at group `g` of `groups` (`g` even in the wide layout).
fn unit_groups(wide: bool, groups: usize, g: usize) -> usize {
    if wide && g + 1 < groups {
        2
    } else {
        1
    }
}

/// Repacks a Q4_K matrix (`src`: `rows` rows of `cols / 256` file blocks) into the x8 layout (the
/// wide one when [`wide`]), in a buffer of its own. Panics unless [`packable`] and `src` has
/// exactly the matrix's bytes.
pub fn pack(pool: &ThreadPool, src: &[u8], rows: usize, cols: usize) -> HugeBuf {
    let mut out = HugeBuf::zeroed(src.len());
    pack_into(pool, src, rows, cols, &mut out);
    out
}

/// [`pack`] into `out` (exactly the matrix's size).
pub fn pack_into(pool: &ThreadPool, src: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    assert!(packable(rows, cols), "{rows}x{cols} is not x8-packable");
    let nb = cols / 256;
    let row_bytes = nb * 144;
    assert_eq!(src.len(), rows * row_bytes, "Q4_K matrix bytes");
    assert_eq!(out.len(), src.len(), "packed bytes");
    let groups = rows / GROUP;
    let group_bytes = nb * BLOCK_BYTES;
    let dst = SharedMut(out.as_mut_ptr());
    let wide = wide();
    let step = if wide { 2 } else { 1 };
    pool.for_range(groups.div_ceil(step), 2, |range| {
        for u in range {
            let g = u * step;
            let k = unit_groups(wide, groups, g);
            // SAFETY: the unit's packed bytes `g * group_bytes .. (g + k) * group_bytes` lie
            // inside `out` (g + k <= groups) and belong to this unit only, so no two threads
            // alias them.
            let o = unsafe {
                std::slice::from_raw_parts_mut(dst.ptr().add(g * group_bytes), k * group_bytes)
            };
            let unit_rows = g * GROUP * row_bytes..(g + k) * GROUP * row_bytes;
            pack_unit(&src[unit_rows], k * GROUP, nb, o);
        }
    });
}

/// `r` rows (8 or 16; `src`: `r` rows of `nb` file blocks) into `out` (`nb` packed blocks of
/// `r` rows, the layout in the module doc).
fn pack_unit(src: &[u8], r: usize, nb: usize, out: &mut [u8]) {
    let row_bytes = nb * 144;
    let block = r * 144;
    for b in 0..nb {
        let o = &mut out[b * block..(b + 1) * block];
        for c in 0..r {
            let x = &src[c * row_bytes + b * 144..c * row_bytes + (b + 1) * 144];
            o[2 * c..2 * c + 2].copy_from_slice(&x[0..2]);
            o[2 * r + 2 * c..2 * r + 2 * c + 2].copy_from_slice(&x[2..4]);
            for i in 0..12 {
                o[4 * r + r * i + c] = x[4 + i];
            }
            for p in 0..4 {
                for s in 0..8 {
                    let at = 16 * r + 32 * r * p + 4 * r * s + 4 * c;
                    let from = 16 + 32 * p + 4 * s;
                    o[at..at + 4].copy_from_slice(&x[from..from + 4]);
                }
            }
        }
    }
}

/// The packed bytes of the unit that starts at group `g` (even in the wide layout) of a
/// `rows × cols` matrix packed by this process, and its width in rows (8 or 16).
pub fn unit(packed: &[u8], rows: usize, cols: usize, g: usize) -> (&[u8], usize) {
    let (gb, groups) = ((cols / 256) * BLOCK_BYTES, rows / GROUP);
    let k = unit_groups(wide(), groups, g);
    (&packed[g * gb..(g + k) * gb], k * GROUP)
}

/// One activation row (`xq`) against the packed weight rows `8 * g0 .. 8 * g1` (`g0` the first
/// group of a unit; `g1` the end of one or the last group): `out[i]` = weight row `8 * g0 + i`.
/// Every output as a one-row [`matmul`] computes it (GEMV flavour).
pub fn gemv_groups(
    packed: &[u8],
    rows: usize,
    cols: usize,
    xq: &[u8],
    (g0, g1): (usize, usize),
    out: &mut [f32],
) {
    let (nb, groups) = (cols / 256, rows / GROUP);
    let gb = nb * BLOCK_BYTES;
    let wide = wide();
    assert!(
        g0 <= g1 && g1 <= groups && (!wide || g0 % 2 == 0),
        "unit-aligned groups"
    );
    assert_eq!(out.len(), (g1 - g0) * GROUP, "one output per weight row");
    let mut g = g0;
    #[cfg(target_arch = "x86_64")]
    if wide {
        // The whole x16 units in one kernel call (a last odd group stays x8, below).
        let units = (g1 - g0 - usize::from(g1 == groups && groups % 2 == 1)) / 2;
        assert!(xq.len() >= nb * A_BYTES, "one activation row");
        let w = &packed[g0 * gb..(g0 + 2 * units) * gb];
        let o = &mut out[..units * 2 * GROUP];
        let (wp, ap, op) = (w.as_ptr(), xq.as_ptr(), o.as_mut_ptr());
        // SAFETY: `wide` holds only at the AVX-512 level, selected after its features were
        // detected; `w` is `units` x16 units of `nb` blocks, `xq` holds one row of `nb` Q8_K
        // blocks and `o` 16 floats a unit (all checked above).
        unsafe {
            let kernel: crate::kernels::cpu::layouts::x16::UnitKernel =
                crate::kernels::cpu::layouts::prefetch::pick(
                    avx512_x16::gemv_units::<true>,
                    avx512_x16::gemv_units::<false>,
                );
            kernel(nb, wp, units, ap, op);
        }
        g = g0 + 2 * units;
    }
    while g < g1 {
        let k = unit_groups(wide, groups, g);
        let at = (g - g0) * GROUP;
        let mut res = [[0f32; 2 * GROUP]; 4];
        dot_unit(
            nb,
            &packed[g * gb..(g + k) * gb],
            k * GROUP,
            xq,
            xq.len(),
            1,
            false,
            &mut res,
        );
        out[at..at + k * GROUP].copy_from_slice(&res[0][..k * GROUP]);
        g += k;
    }
}

/// Activation rows per cache block of the GEMM: enough bytes to stay in L2 next to a weight
/// group, in whole groups of four.
fn rows_per_chunk(a_row_bytes: usize) -> usize {
    ((192 * 1024 / a_row_bytes.max(1)) / 4 * 4).max(4)
}

/// `out (n × rows) = x · Wᵀ` for a packed Q4_K matrix `packed` (`rows × cols`) and `n`
/// activation rows already quantized to Q8_K (`xq`: `n` rows of `cols / 256` blocks). With `gemm`,
/// whole groups of four rows take the GEMM flavour when `n >= 4` and the rest the GEMV flavour, as
/// llama.cpp splits them; without, every row takes the GEMV flavour (what a one-row call gives).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    pool: &ThreadPool,
    packed: &[u8],
    rows: usize,
    cols: usize,
    xq: &[u8],
    n: usize,
    gemm: bool,
    out: &mut [f32],
) {
    let nb = cols / 256;
    let a_row = nb * A_BYTES;
    assert!(packable(rows, cols) && packed.len() == rows * nb * 144);
    assert_eq!(xq.len(), n * a_row, "activation bytes");
    assert_eq!(out.len(), n * rows, "output size");
    let gemm_rows = if gemm && n >= 4 { n - n % 4 } else { 0 };
    let chunk = rows_per_chunk(a_row);
    let groups = rows / GROUP;
    let group_bytes = nb * BLOCK_BYTES;
    let dst = SharedMut(out.as_mut_ptr());
    let min_groups = if n == 1 { 8 } else { 1 };
    let wide = wide();
    let step = if wide { 2 } else { 1 };
    // Eight activation rows or more are compute-bound: fine chunks; fewer stream.
    let per_thread = if n >= 8 {
        FINE_CHUNKS
    } else {
        CHUNKS_PER_THREAD
    };
    let (n_units, min_units) = (groups.div_ceil(step), min_groups / step);
    // The AVX2 GEMV flavour runs two or three rows slower than four (measured: 1536x1536, one
    // thread, 144 us for two rows against 112 for four). Its rows are independent, so a last
    // tile of two or three rows runs as four: its rows, then copies of its first.
    let tail = (n - gemm_rows) % 4;
    let padded: Option<Vec<u8>> = (!wide && (2..4).contains(&tail)).then(|| {
        let t0 = n - tail;
        let mut p = xq[t0 * a_row..n * a_row].to_vec();
        while p.len() < 4 * a_row {
            p.extend_from_slice(&xq[t0 * a_row..(t0 + 1) * a_row]);
        }
        p
    });
    pool.for_range_with(n_units, min_units, per_thread, |range| {
        // The unit of groups g..g + k (k = 2 in the wide layout) against rows t0..t0 + m.
        let kernel = |g: usize, k: usize, t0: usize, m: usize, pair: bool| {
            let w = &packed[g * group_bytes..(g + k) * group_bytes];
            let a = &xq[t0 * a_row..(t0 + m) * a_row];
            let mut res = [[0f32; 2 * GROUP]; 4];
            dot_unit(nb, w, k * GROUP, a, a_row, m, pair, &mut res);
            // SAFETY: rows t0..t0 + m < n and columns g * 8..(g + k) * 8 <= rows are inside
            // `out` (n * rows); the unit's groups belong to this chunk only, so no other thread
            // writes them.
            unsafe { dst.store_tile(rows, t0, g * GROUP, &res[..m], k * GROUP) };
        };
        let units = || {
            range
                .clone()
                .map(|u| (u * step, unit_groups(wide, groups, u * step)))
        };
        for c0 in (0..gemm_rows).step_by(chunk) {
            let c1 = (c0 + chunk).min(gemm_rows);
            for (g, k) in units() {
                for t0 in (c0..c1).step_by(4) {
                    kernel(g, k, t0, 4, true);
                }
            }
        }
        for (g, k) in units() {
            for t0 in (gemm_rows..n).step_by(4) {
                let m = (n - t0).min(4);
                match &padded {
                    Some(p) if m > 1 && m < 4 => {
                        let w = &packed[g * group_bytes..(g + k) * group_bytes];
                        let mut res = [[0f32; 2 * GROUP]; 4];
                        dot_unit(nb, w, k * GROUP, p, a_row, 4, false, &mut res);
                        // SAFETY: as in `kernel`, for rows t0..t0 + m.
                        unsafe { dst.store_tile(rows, t0, g * GROUP, &res[..m], k * GROUP) };
                    }
                    _ => kernel(g, k, t0, m, false),
                }
            }
        }
    });
}

/// One packed group (`w`: `nb` packed blocks) times `m` (1..=4) Q8_K activation rows `stride`
/// bytes apart (`a`); `out[r][c]` = row `r` · weight row `c` of the group. `pair` picks the GEMM
/// flavour (one fold per pair of sub-blocks), else the GEMV flavour (one per super-block).
pub fn dot_group(
    nb: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    m: usize,
    pair: bool,
    out: &mut [[f32; GROUP]; 4],
) {
    assert!((1..=4).contains(&m), "1..=4 activation rows");
    assert_eq!(w.len(), nb * BLOCK_BYTES, "packed group bytes");
    assert!(stride >= nb * A_BYTES && a.len() >= (m - 1) * stride + nb * A_BYTES);
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar {
        // SAFETY: a non-scalar level is selected only after AVX2, FMA and F16C were detected;
        // `w` holds `nb` packed blocks and each of the `m` activation rows `nb` Q8_K blocks
        // (asserted above), which is all the kernel reads; it writes `out[..m]` only.
        unsafe { avx2::dot_group(nb, w.as_ptr(), a.as_ptr(), stride, m, pair, out) };
        return;
    }
    dot_group_scalar(nb, w, a, stride, m, pair, out);
}

/// [`dot_group`] (`width` 8) or [`dot_pair`] (`width` 16) into the first `width` outputs of each
/// row of `out`.
#[allow(clippy::too_many_arguments)]
fn dot_unit(
    nb: usize,
    w: &[u8],
    width: usize,
    a: &[u8],
    stride: usize,
    m: usize,
    pair: bool,
    out: &mut [[f32; 2 * GROUP]; 4],
) {
    if width == 2 * GROUP {
        dot_pair(nb, w, a, stride, m, pair, out);
    } else {
        let mut one = [[0f32; GROUP]; 4];
        dot_group(nb, w, a, stride, m, pair, &mut one);
        for (r, o) in out.iter_mut().zip(&one) {
            r[..GROUP].copy_from_slice(o);
        }
    }
}

/// [`dot_group`] for one x16 unit (`w`: `nb` packed blocks of sixteen rows): `out[r][c]` = row
/// `r` · weight row `c` of the unit. Bit-identical to [`dot_group`] on each half. The AVX-512
/// kernel where the level has it, else the scalar twin (only tests read an x16 unit at another
/// level).
pub fn dot_pair(
    nb: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    m: usize,
    pair: bool,
    out: &mut [[f32; 2 * GROUP]; 4],
) {
    assert!((1..=4).contains(&m), "1..=4 activation rows");
    assert_eq!(w.len(), 2 * nb * BLOCK_BYTES, "an x16 unit's bytes");
    assert!(stride >= nb * A_BYTES && a.len() >= (m - 1) * stride + nb * A_BYTES);
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: `wide` holds only at the AVX-512 level, selected after its features were
        // detected; `w` holds `nb` x16 blocks and each of the `m` activation rows `nb` Q8_K
        // blocks (asserted above), which is all the kernel reads; it writes `out[..m]` only.
        unsafe { avx512_x16::dot_pair(nb, w.as_ptr(), a.as_ptr(), stride, m, pair, out) };
        return;
    }
    let mut flat = [0f32; 4 * 2 * GROUP];
    dot_scalar(2 * GROUP, nb, w, a, stride, m, pair, &mut flat);
    for (r, o) in out.iter_mut().enumerate().take(m) {
        o.copy_from_slice(&flat[r * 2 * GROUP..(r + 1) * 2 * GROUP]);
    }
}

/// [`dot_scalar`] for one x8 group, in [`dot_group`]'s shape.
pub fn dot_group_scalar(
    nb: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    m: usize,
    pair: bool,
    out: &mut [[f32; GROUP]; 4],
) {
    let mut flat = [0f32; 4 * GROUP];
    dot_scalar(GROUP, nb, w, a, stride, m, pair, &mut flat);
    for (r, o) in out.iter_mut().enumerate().take(m) {
        o.copy_from_slice(&flat[r * GROUP..(r + 1) * GROUP]);
    }
}

/// The scalar twin of [`dot_group`] and [`dot_pair`]: the same exact integer sums and the same
/// float operations per output, one element at a time, over `nb` packed blocks of `width` rows
/// (8 or 16): `out[r * width + c]` = activation row `r` · weight row `c`.
#[allow(clippy::too_many_arguments)]
pub fn dot_scalar(
    width: usize,
    nb: usize,
    w: &[u8],
    a: &[u8],
    stride: usize,
    m: usize,
    pair: bool,
    out: &mut [f32],
) {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let rw = width;
    let block = rw * 144;
    for r in 0..m {
        for c in 0..rw {
            let (mut acc, mut accm) = (0f32, 0f32);
            for b in 0..nb {
                let x = &w[b * block..(b + 1) * block];
                let y = &a[r * stride + b * A_BYTES..r * stride + (b + 1) * A_BYTES];
                let ad = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
                let dd = f16(&x[2 * c..]) * ad;
                let dm = f16(&x[2 * rw + 2 * c..]) * ad;
                let q: [u8; 12] = std::array::from_fn(|i| x[4 * rw + rw * i + c]);
                let bs = |k: usize| i16::from_le_bytes([y[260 + 2 * k], y[261 + 2 * k]]) as i32;
                let sub = |k: usize| bs(2 * k) + bs(2 * k + 1);
                let (mut isum_t, mut imin_t) = (0i32, 0i32);
                for p in 0..4 {
                    let (mut s0, mut s1) = (0i32, 0i32);
                    for s in 0..8 {
                        for j in 0..4 {
                            let qb = x[16 * rw + 32 * rw * p + 4 * rw * s + 4 * c + j];
                            let k = 64 * p + 4 * s + j;
                            s0 += (qb & 0xF) as i32 * y[4 + k] as i8 as i32;
                            s1 += (qb >> 4) as i32 * y[4 + 32 + k] as i8 as i32;
                        }
                    }
                    let (sc0, m0) = get_scale_min_k4(2 * p, &q);
                    let (sc1, m1) = get_scale_min_k4(2 * p + 1, &q);
                    let isum = sc0 as i32 * s0 + sc1 as i32 * s1;
                    let imin = m0 as i32 * sub(2 * p) + m1 as i32 * sub(2 * p + 1);
                    if pair {
                        acc = (isum as f32).mul_add(dd, acc);
                        accm = (imin as f32).mul_add(dm, accm);
                    } else {
                        isum_t += isum;
                        imin_t += imin;
                    }
                }
                if !pair {
                    acc = (isum_t as f32).mul_add(dd, acc);
                    accm = (imin_t as f32).mul_add(dm, accm);
                }
            }
            out[r * rw + c] = acc - accm;
        }
    }
}
