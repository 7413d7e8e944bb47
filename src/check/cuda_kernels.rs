//! Every kernel against the crate's CPU scalar reference, on any [`Launch`]: the tests run these
//! on the CPU emulator, `infer selftest --device cuda` on a GPU. Each check draws deterministic
//! inputs, runs the kernel, and compares with an independent host computation (the quantizers and
//! dequantizers of `crate::quant`, `kernels::cpu::ops`, an f64 softmax attention), at shapes
//! chosen to hit ragged tails (rows not a multiple of 4 or of the GEMM's 64, tokens not a multiple
//! of 8 or 64, rows shorter than a warp's stride, several attention splits, GQA groups). Errors
//! are relative to the scale named per check; tolerances are stated next to each.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use half::f16;

use crate::format::GgmlType;
use crate::kernels::cpu::ops as cpu;
use crate::kernels::cuda::launch::{DevBuf, Launch};
use crate::kernels::cuda::{ops, repack};
use crate::model::backend::HeadCopy;
use crate::model::config::{Activation, RopeStyle};
use crate::quant;

/// The outcome of one kernel at one shape.
#[derive(Clone, Debug)]
pub struct Check {
    pub kernel: String,
    pub shape: String,
    /// Largest error found (as defined by the check: relative or absolute, see `tol`).
    pub err: f64,
    pub tol: f64,
    /// Seconds of the kernel launch(es) including the wait for completion.
    pub secs: f64,
}

impl Check {
    pub fn pass(&self) -> bool {
        self.err <= self.tol
    }
}

/// Deterministic floats in [-1, 1) (an LCG).
pub fn floats(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

pub(super) struct Ctx<'a> {
    l: &'a Arc<dyn Launch>,
    out: Vec<Check>,
}

impl Ctx<'_> {
    fn buf(&self, v: &[f32]) -> Result<DevBuf> {
        DevBuf::from_f32(self.l, v)
    }
    fn ints(&self, v: &[i32]) -> Result<DevBuf> {
        DevBuf::from_i32(self.l, v)
    }
    /// Runs `f`, waits, and returns its duration.
    fn timed(&self, f: impl FnOnce() -> Result<()>) -> Result<f64> {
        self.l.sync()?;
        let t = Instant::now();
        f()?;
        self.l.sync()?;
        Ok(t.elapsed().as_secs_f64())
    }
    fn push(&mut self, kernel: &str, shape: String, err: f64, tol: f64, secs: f64) {
        let kernel = kernel.to_string();
        self.out.push(Check {
            kernel,
            shape,
            err,
            tol,
            secs,
        });
    }
}

/// Max |a - b| / scale.
pub(super) fn max_rel(a: &[f32], b: &[f32], scale: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| {
            if x.is_nan() || y.is_nan() {
                f64::INFINITY
            } else {
                (x as f64 - y as f64).abs() / scale
            }
        })
        .fold(0.0, f64::max)
}

pub(super) fn max_abs(v: &[f32]) -> f64 {
    v.iter().map(|x| x.abs() as f64).fold(1e-30, f64::max)
}

/// Runs every kernel check; an `Err` means a launch or copy failed (a wrong result is a failing
/// [`Check`], not an error).
pub fn run_all(l: &Arc<dyn Launch>) -> Result<Vec<Check>> {
    let mut c = Ctx { l, out: Vec::new() };
    quantize(&mut c)?;
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::F16,
        GgmlType::F32,
    ] {
        gemv(&mut c, ty)?;
        if ops::gemv_multi_kernel(ty).is_some() {
            gemv_multi(&mut c, ty)?;
        }
        if ops::gemm_kernel(ty).is_some() {
            gemm(&mut c, ty)?;
        }
        get_rows(&mut c, ty)?;
    }
    rms_norm(&mut c)?;
    rope(&mut c)?;
    glu(&mut c)?;
    elementwise(&mut c)?;
    argmax(&mut c)?;
    top_k(&mut c)?;
    super::cuda_fused::fused(l, &mut c.out)?;
    super::cuda_attention::attention(l, &mut c.out)?;
    super::cuda_quant_cache::quant_cache(l, &mut c.out)?;
    super::cuda_sample::sample(l, &[1531], 50, &mut c.out)?;
    super::cuda_sample::sample(l, &[151_936], 8, &mut c.out)?;
    Ok(c.out)
}

fn quantize(c: &mut Ctx) -> Result<()> {
    for n in [32, 96, 4096] {
        let mut x = floats(n, n as u64);
        x[5] = 0.0;
        if n == 96 {
            x[32..64].iter_mut().for_each(|v| *v = 0.0); // an all-zero block: d = 0
        }
        let (xd, q) = (c.buf(&x)?, DevBuf::new(c.l, n / 32 * ops::Q8_1_BYTES)?);
        let secs = c.timed(|| ops::quantize_q8_1(&**c.l, xd.ptr, q.ptr, n))?;
        let mut want = vec![0u8; n / 32 * ops::Q8_1_BYTES];
        quant::quantize::quantize_row_q8_1(&x, &mut want);
        let got = q.to_bytes()?;
        let diff = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        c.push(
            "quantize_q8_1",
            format!("n={n} (bytes differing)"),
            diff as f64,
            0.0,
            secs,
        );
    }
    Ok(())
}

/// Weights of `ty` quantized by the crate's reference quantizer, in the device's layout (as the
/// backend uploads them: Q6_K repacked, [`repack`]), and their dequantized values (from the
/// file's bytes, by the crate's dequantizer).
pub(super) fn weights(
    ty: GgmlType,
    rows: usize,
    cols: usize,
    seed: u64,
) -> Result<(Vec<u8>, Vec<f32>)> {
    let f = floats(rows * cols, seed);
    let (mut bytes, mut deq, mut row) = (Vec::new(), vec![0f32; rows * cols], Vec::new());
    for (r, src) in f.chunks_exact(cols).enumerate() {
        quant::quantize_row(ty, src, &mut row)?;
        quant::dequantize_row(ty, &row, &mut deq[r * cols..(r + 1) * cols])?;
        bytes.extend_from_slice(&row);
    }
    Ok((repack::to_device(ty, cols, &bytes).into_owned(), deq))
}

/// Q6_K's GEMV (four lanes a block, so a row of up to 8 blocks leaves lanes idle and a longer one
/// wraps) at more shapes: every token count of one pass (1..8), rows not a multiple of 4, and
/// widths of 1, 6 (Qwen2.5-1.5B's 1,536), 9 and 35 (its FFN's 8,960) blocks.
const Q6_K_GEMV_SHAPES: [(usize, usize, usize); 8] = [
    (5, 256, 1),
    (13, 1536, 2),
    (3, 2304, 3),
    (6, 1536, 4),
    (2, 8960, 5),
    (9, 768, 6),
    (1, 2304, 7),
    (7, 1536, 8),
];

fn gemv(c: &mut Ctx, ty: GgmlType) -> Result<()> {
    let (kernel, q8) = ops::gemv_kernel(ty).expect("checked types have kernels");
    let cols_small = if ty.block_size() == 256 { 256 } else { 64 };
    let mut shapes = vec![(1, cols_small, 1), (7, 512, 3), (37, 768, 9), (5, 1280, 16)];
    if ty == GgmlType::Q6K {
        shapes.extend(Q6_K_GEMV_SHAPES);
    }
    for (rows, cols, nt) in shapes {
        let (wb, wdeq) = weights(ty, rows, cols, 7 + rows as u64)?;
        let x = floats(nt * cols, 11 + nt as u64);
        // The activations the kernel sees: q8_1 (reference quantizer) or f32 as is.
        let mut xq = vec![0u8; nt * cols / 32 * ops::Q8_1_BYTES];
        quant::quantize::quantize_row_q8_1(&x, &mut xq);
        let xdeq = dequant_q8_1(&xq);
        let xs = if q8 { &xdeq } else { &x };
        let (w, out) = (
            DevBuf::from_bytes(c.l, &wb)?,
            DevBuf::new(c.l, nt * rows * 4)?,
        );
        let input = if q8 {
            DevBuf::from_bytes(c.l, &xq)?
        } else {
            c.buf(&x)?
        };
        // Odd token counts also add a bias (fused into the store), taken off again for the check.
        let bias = (nt % 2 == 1).then(|| floats(rows, 5 + rows as u64));
        let bias_d = bias.as_ref().map(|b| c.buf(b)).transpose()?;
        let bp = bias_d.as_ref().map(|b| b.ptr);
        let secs =
            c.timed(|| ops::gemv(&**c.l, ty, w.ptr, input.ptr, out.ptr, bp, (rows, cols, nt)))?;
        let mut got = out.to_f32()?;
        if let Some(b) = &bias {
            got.iter_mut()
                .enumerate()
                .for_each(|(i, v)| *v -= b[i % rows]);
        }
        let err = matmul_err(&got, &wdeq, xs, (rows, cols, nt));
        c.push(
            kernel,
            format!(
                "{rows}x{cols}, {nt} tok{} (rel. to sum|w·x|)",
                if bias.is_some() { " + bias" } else { "" }
            ),
            err,
            matmul_tol(ty),
            secs,
        );
    }
    Ok(())
}

/// Several matrices of one type over the same q8_1 activations in one launch: three of ragged
/// row counts (one with a bias) and a pair, for one token and for 9 (two token blocks).
fn gemv_multi(c: &mut Ctx, ty: GgmlType) -> Result<()> {
    let kernel = ops::gemv_multi_kernel(ty).expect("checked types have multi kernels");
    let cols = if ty.block_size() == 256 { 512 } else { 96 };
    for (rows, nt) in [(&[7, 1, 37][..], 1), (&[5, 12][..], 9)] {
        let x = floats(nt * cols, 23 + nt as u64);
        let mut xq = vec![0u8; nt * cols / 32 * ops::Q8_1_BYTES];
        quant::quantize::quantize_row_q8_1(&x, &mut xq);
        let (xdeq, input) = (dequant_q8_1(&xq), DevBuf::from_bytes(c.l, &xq)?);
        let mut mats = Vec::new();
        for (j, &r) in rows.iter().enumerate() {
            let (wb, wdeq) = weights(ty, r, cols, 29 + j as u64)?;
            let bias = (j == 0).then(|| floats(r, 31));
            let bd = bias.as_ref().map(|b| c.buf(b)).transpose()?;
            let (w, out) = (DevBuf::from_bytes(c.l, &wb)?, DevBuf::new(c.l, nt * r * 4)?);
            mats.push((w, out, bias, bd, wdeq, r));
        }
        let parts: Vec<ops::GemvPart> = mats
            .iter()
            .map(|(w, o, _, bd, _, r)| (w.ptr, o.ptr, bd.as_ref().map(|b| b.ptr), *r))
            .collect();
        let secs = c.timed(|| ops::gemv_multi(&**c.l, ty, input.ptr, &parts, (cols, nt)))?;
        let mut err = 0f64;
        for (_, out, bias, _, wdeq, r) in &mats {
            let mut got = out.to_f32()?;
            if let Some(b) = bias {
                got.iter_mut().enumerate().for_each(|(i, v)| *v -= b[i % r]);
            }
            err = err.max(matmul_err(&got, wdeq, &xdeq, (*r, cols, nt)));
        }
        c.push(
            kernel,
            format!("{rows:?}x{cols}, {nt} tok, one with bias (rel. to sum|w·x|)"),
            err,
            matmul_tol(ty),
            secs,
        );
    }
    Ok(())
}

/// Largest |got - w·x| / sum|w·x| over an `nt × rows` result, with f64 dot products of the
/// dequantized weights and activations.
fn matmul_err(
    got: &[f32],
    wdeq: &[f32],
    xs: &[f32],
    (rows, cols, nt): (usize, usize, usize),
) -> f64 {
    let mut err = 0f64;
    for t in 0..nt {
        for r in 0..rows {
            let (wr, xr) = (
                &wdeq[r * cols..(r + 1) * cols],
                &xs[t * cols..(t + 1) * cols],
            );
            let exact: f64 = wr.iter().zip(xr).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = wr
                .iter()
                .zip(xr)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            err = err.max((got[t * rows + r] as f64 - exact).abs() / mag.max(1e-30));
        }
    }
    err
}

/// Q4_K's min term uses the f16-rounded block sum `s` of q8_1 (as ggml's CUDA and CPU q8_1 dot
/// products do): up to 2^-11 of that term. Everything else is exact integer sums scaled in f32.
fn matmul_tol(ty: GgmlType) -> f64 {
    if ty == GgmlType::Q4K {
        2e-3
    } else {
        1e-5
    }
}

/// The tensor-core GEMM (q8_1 activations) at ragged shapes: 1, 37 and 256 + 13 rows (tiles of 64),
/// 9, 64 and 130 tokens (tiles of 64, and just past the GEMV's 8), one and several staging steps
/// of 4 sub-blocks (cols 64/96 for 32-blocks: a partial step; 256/1536 for k-quants).
fn gemm(c: &mut Ctx, ty: GgmlType) -> Result<()> {
    let kernel = ops::gemm_kernel(ty).expect("checked types have GEMM kernels");
    let (small, large) = if ty.block_size() == 256 {
        (256, 1536)
    } else {
        (64, 96)
    };
    let shapes = [
        (1, small, 9),
        (37, large, 64),
        (269, small, 130),
        (64, large, 130),
        (269, large, 9),
    ];
    for (rows, cols, nt) in shapes {
        let (wb, wdeq) = weights(ty, rows, cols, 17 + rows as u64)?;
        let x = floats(nt * cols, 19 + nt as u64);
        let mut xq = vec![0u8; nt * cols / 32 * ops::Q8_1_BYTES];
        quant::quantize::quantize_row_q8_1(&x, &mut xq);
        let xdeq = dequant_q8_1(&xq);
        let (w, input, out) = (
            DevBuf::from_bytes(c.l, &wb)?,
            DevBuf::from_bytes(c.l, &xq)?,
            DevBuf::new(c.l, nt * rows * 4)?,
        );
        let secs =
            c.timed(|| ops::gemm(&**c.l, ty, w.ptr, input.ptr, out.ptr, (rows, cols, nt)))?;
        let err = matmul_err(&out.to_f32()?, &wdeq, &xdeq, (rows, cols, nt));
        c.push(
            kernel,
            format!("{rows}x{cols}, {nt} tok (rel. to sum|w·x|)"),
            err,
            matmul_tol(ty),
            secs,
        );
    }
    Ok(())
}

fn get_rows(c: &mut Ctx, ty: GgmlType) -> Result<()> {
    let (rows, cols) = (9, if ty.block_size() == 256 { 512 } else { 96 });
    let (wb, wdeq) = weights(ty, rows, cols, 3)?;
    let ids = [4, 0, 8, 4];
    let (w, idb, out) = (
        DevBuf::from_bytes(c.l, &wb)?,
        c.ints(&ids)?,
        DevBuf::new(c.l, ids.len() * cols * 4)?,
    );
    let scale = 1.5f32;
    let secs = c.timed(|| {
        ops::get_rows(
            &**c.l,
            ty,
            w.ptr,
            idb.ptr,
            out.ptr,
            (ids.len(), cols),
            scale,
        )
    })?;
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| {
            wdeq[i as usize * cols..(i as usize + 1) * cols]
                .iter()
                .map(|v| v * scale)
        })
        .collect();
    let got = out.to_f32()?;
    let err = max_rel(&got, &want, max_abs(&want));
    c.push(
        &format!("get_rows_{}", ty.name().to_lowercase()),
        format!("4 of {rows}x{cols} (rel. to max)"),
        err,
        1e-6,
        secs,
    );
    Ok(())
}

fn rms_norm(c: &mut Ctx) -> Result<()> {
    for (rows, cols, n) in [(1, 64, 64), (3, 896, 896), (5, 256, 64), (2, 2048, 2048)] {
        let x: Vec<f32> = floats(rows * cols, 5).iter().map(|v| v * 3.0).collect();
        let w = floats(n, 6);
        let (xd, wd, yd) = (c.buf(&x)?, c.buf(&w)?, DevBuf::new(c.l, rows * cols * 4)?);
        let secs =
            c.timed(|| ops::rms_norm(&**c.l, xd.ptr, wd.ptr, yd.ptr, rows * cols / n, n, 1e-6))?;
        let mut want = vec![0f32; rows * cols];
        for (xs, ys) in x.chunks_exact(n).zip(want.chunks_exact_mut(n)) {
            cpu::rms_norm(xs, &w, 1e-6, ys);
        }
        let err = max_rel(&yd.to_f32()?, &want, max_abs(&want));
        c.push(
            "rms_norm",
            format!("{rows}x{cols}, groups of {n} (rel. to max)"),
            err,
            1e-5,
            secs,
        );
    }
    Ok(())
}

fn rope(c: &mut Ctx) -> Result<()> {
    let cases = [
        (3, 4, 64, RopeStyle::Normal, false),
        (2, 2, 128, RopeStyle::Neox, false),
        (3, 3, 32, RopeStyle::Neox, true),
        (1, 1, 256, RopeStyle::Normal, true),
    ];
    for (rows, heads, hd, style, with_ff) in cases {
        let cols = heads * hd;
        let x = floats(rows * cols, 9);
        let pos: Vec<i32> = [0, 17, 4095].iter().take(rows).copied().collect();
        let ff: Vec<f32> = (0..hd / 2).map(|i| 1.0 + (i % 5) as f32).collect();
        let (xd, pd, fd) = (c.buf(&x)?, c.ints(&pos)?, c.buf(&ff)?);
        let ffp = with_ff.then_some(fd.ptr);
        let base = 10000.0;
        let secs =
            c.timed(|| ops::rope(&**c.l, xd.ptr, pd.ptr, ffp, (rows, cols), hd, base, style))?;
        let mut want = x.clone();
        let mut cache = vec![0f32; hd];
        for (r, row) in want.chunks_exact_mut(cols).enumerate() {
            match with_ff {
                true => cpu::rope_cache_scaled(pos[r] as u32, base, hd, &ff, &mut cache),
                false => cpu::rope_cache(pos[r] as u32, base, hd, &mut cache),
            }
            row.chunks_exact_mut(hd)
                .for_each(|h| cpu::rope_head(h, &cache, style));
        }
        let err = max_rel(&xd.to_f32()?, &want, 1.0);
        let shape = format!(
            "{rows}x{heads}x{hd} {style:?}{} (abs)",
            if with_ff { " +freq factors" } else { "" }
        );
        c.push("rope", shape, err, 2e-6, secs);
    }
    Ok(())
}

fn glu(c: &mut Ctx) -> Result<()> {
    for (act, n) in [
        (Activation::Silu, 1000),
        (Activation::Silu, 4096),
        (Activation::GeluTanh, 1003),
        (Activation::GeluTanhF32, 517),
    ] {
        let g: Vec<f32> = floats(n, 1).iter().map(|v| v * 12.0).collect();
        let u = floats(n, 2);
        let (gd, ud) = (c.buf(&g)?, c.buf(&u)?);
        let secs = c.timed(|| ops::glu(&**c.l, gd.ptr, ud.ptr, n, act))?;
        let mut want = g.clone();
        cpu::glu(&mut want, &u, act);
        // SiLU: the CPU uses ggml's expf approximation (1.5 ulp); GELU through f16 may land one
        // f16 step (2^-11 relative) away where tanhf differs by an ulp at a rounding boundary.
        let tol = if act == Activation::GeluTanh {
            1e-3
        } else {
            1e-5
        };
        let err = max_rel(&gd.to_f32()?, &want, max_abs(&want));
        c.push(
            "glu",
            format!("{act:?} n={n} (rel. to max)"),
            err,
            tol,
            secs,
        );
    }
    Ok(())
}

fn elementwise(c: &mut Ctx) -> Result<()> {
    let l = &**c.l;
    let (rows, cols) = (5, 300);
    let (x, y, b) = (
        floats(rows * cols, 1),
        floats(rows * cols, 2),
        floats(cols, 3),
    );
    let (xd, yd, bd) = (c.buf(&x)?, c.buf(&y)?, c.buf(&b)?);
    let secs = c.timed(|| ops::add(l, xd.ptr, yd.ptr, rows * cols))?;
    let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    c.push(
        "add",
        format!("{rows}x{cols} (abs)"),
        max_rel(&xd.to_f32()?, &want, 1.0),
        0.0,
        secs,
    );
    let secs = c.timed(|| ops::scale(l, xd.ptr, 0.25, rows * cols))?;
    let want: Vec<f32> = want.iter().map(|v| v * 0.25).collect();
    c.push(
        "scale",
        format!("{rows}x{cols} (abs)"),
        max_rel(&xd.to_f32()?, &want, 1.0),
        0.0,
        secs,
    );
    let secs = c.timed(|| ops::add_bias(l, xd.ptr, bd.ptr, rows, cols))?;
    let want: Vec<f32> = want
        .iter()
        .enumerate()
        .map(|(i, v)| v + b[i % cols])
        .collect();
    c.push(
        "add_bias",
        format!("{rows}x{cols} (abs)"),
        max_rel(&xd.to_f32()?, &want, 1.0),
        0.0,
        secs,
    );

    let (idx, scales) = ([3, 0, 4], [0.5f32, -2.0, 1.0]);
    let (id, sd) = (c.ints(&idx)?, c.buf(&scales)?);
    let secs = c.timed(|| ops::add_rows_scaled(l, xd.ptr, yd.ptr, id.ptr, sd.ptr, 3, cols))?;
    let mut want2 = want.clone();
    for (i, &r) in idx.iter().enumerate() {
        for k in 0..cols {
            want2[r as usize * cols + k] += scales[i] * y[i * cols + k];
        }
    }
    c.push(
        "add_rows_scaled",
        format!("3 rows of {cols} (abs)"),
        max_rel(&xd.to_f32()?, &want2, 1.0),
        0.0,
        secs,
    );

    let od = DevBuf::new(c.l, 3 * cols * 4)?;
    let secs = c.timed(|| ops::gather_rows(l, yd.ptr, id.ptr, od.ptr, 3, cols))?;
    let want: Vec<f32> = idx
        .iter()
        .flat_map(|&r| y[r as usize * cols..(r as usize + 1) * cols].to_vec())
        .collect();
    c.push(
        "gather_rows",
        format!("3 of {rows}x{cols} (abs)"),
        max_rel(&od.to_f32()?, &want, 1.0),
        0.0,
        secs,
    );

    // MLA-style head copy: 2 source heads of 24 shared by 6 destination heads of 40.
    let hc = HeadCopy {
        src_hd: 24,
        src_off: 8,
        dst_hd: 40,
        dst_off: 20,
        width: 16,
    };
    let (src, dst0) = (floats(rows * 48, 4), floats(rows * 240, 5));
    let (sd2, dd) = (c.buf(&src)?, c.buf(&dst0)?);
    let secs = c.timed(|| ops::copy_heads(l, sd2.ptr, dd.ptr, rows, (48, 240), hc))?;
    let mut want = dst0.clone();
    cpu::copy_heads(&src, 48, &mut want, 240, hc);
    c.push(
        "copy_heads",
        format!("{rows} rows, 2->6 heads (abs)"),
        max_rel(&dd.to_f32()?, &want, 1.0),
        0.0,
        secs,
    );

    // KV write: f32 rows to f16 at scattered slots of a paged cache.
    let (n, kv_dim, slots_total) = (3, 80, 96);
    let (k, v) = (floats(n * kv_dim, 6), floats(n * kv_dim, 7));
    let slots = [70, 3, 33];
    let (kd, vd, sl) = (c.buf(&k)?, c.buf(&v)?, c.ints(&slots)?);
    let (kc, vc) = (
        DevBuf::new(c.l, slots_total * kv_dim * 2)?,
        DevBuf::new(c.l, slots_total * kv_dim * 2)?,
    );
    let secs =
        c.timed(|| ops::kv_write(l, (kc.ptr, vc.ptr), (kd.ptr, vd.ptr), sl.ptr, n, kv_dim))?;
    let mut bad = 0;
    for (cache, src) in [(kc.to_bytes()?, &k), (vc.to_bytes()?, &v)] {
        let mut want = vec![0u8; slots_total * kv_dim * 2];
        for (i, &s) in slots.iter().enumerate() {
            for j in 0..kv_dim {
                let h = f16::from_f32(src[i * kv_dim + j]).to_le_bytes();
                want[(s as usize * kv_dim + j) * 2..][..2].copy_from_slice(&h);
            }
        }
        bad += cache.iter().zip(&want).filter(|(a, b)| a != b).count();
    }
    c.push(
        "kv_write",
        format!("{n} rows of {kv_dim} into {slots_total} slots (bytes differing)"),
        bad as f64,
        0.0,
        secs,
    );
    Ok(())
}

fn argmax(c: &mut Ctx) -> Result<()> {
    let (rows, cols) = (4, 151_936);
    let mut x = floats(rows * cols, 8);
    x[cols + 77] = 5.0; // row 1: a tie, the lower index wins
    x[cols + 140_000] = 5.0;
    x[2 * cols + cols - 1] = 9.0; // row 2: the very last value
    x[3 * cols..4 * cols].iter_mut().for_each(|v| *v = -3.0); // row 3: all equal -> 0
    let (xd, od) = (c.buf(&x)?, DevBuf::new(c.l, rows * 4)?);
    let secs = c.timed(|| ops::argmax(&**c.l, xd.ptr, od.ptr, rows, cols))?;
    let got: Vec<i32> = od
        .to_bytes()?
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let want: Vec<i32> = x
        .chunks_exact(cols)
        .map(|r| {
            r.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                    if v > bv {
                        (i, v)
                    } else {
                        (bi, bv)
                    }
                })
                .0 as i32
        })
        .collect();
    let wrong = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    c.push(
        "argmax",
        format!("{rows}x{cols} (rows wrong)"),
        wrong as f64,
        0.0,
        secs,
    );
    Ok(())
}

/// Top-k against a full sort by (value descending, index ascending) without NaN: a vocabulary row
/// with ties, one with NaN and -inf, and a short row asked for every value (plus the -1 padding
/// past its numbers).
fn top_k(c: &mut Ctx) -> Result<()> {
    for (rows, cols, k) in [(3, 151_936, 40), (2, 100, 100)] {
        let mut x = floats(rows * cols, 21 + cols as u64);
        x[7] = 2.0; // row 0: a tie, the lower index first
        x[cols - 3] = 2.0;
        x[cols + 1] = f32::NAN; // row 1: NaN is never chosen, -inf comes last
        x[cols + 2] = f32::NEG_INFINITY;
        x[cols + 5] = 3.0;
        let (xd, id, vd) = (
            c.buf(&x)?,
            DevBuf::new(c.l, rows * k * 4)?,
            DevBuf::new(c.l, rows * k * 4)?,
        );
        let secs = c.timed(|| ops::top_k(&**c.l, xd.ptr, (id.ptr, vd.ptr), rows, cols, k))?;
        let idx: Vec<i32> = id
            .to_bytes()?
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let val = vd.to_f32()?;
        let mut wrong = 0;
        for (r, row) in x.chunks_exact(cols).enumerate() {
            let mut order: Vec<usize> = (0..cols).filter(|&i| !row[i].is_nan()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for j in 0..k {
                let (gi, gv) = (idx[r * k + j], val[r * k + j]);
                let ok = match order.get(j) {
                    Some(&i) => gi == i as i32 && gv == row[i],
                    None => gi == -1,
                };
                wrong += !ok as usize;
            }
        }
        c.push(
            "top_k",
            format!("{rows}x{cols}, k={k} (entries wrong)"),
            wrong as f64,
            0.0,
            secs,
        );
    }
    Ok(())
}

/// Dequantizes q8_1 blocks (f16 d, f16 s, 32 × i8).
fn dequant_q8_1(bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(bytes.len() / ops::Q8_1_BYTES * 32);
    for b in bytes.chunks_exact(ops::Q8_1_BYTES) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        out.extend(b[4..].iter().map(|&q| q as i8 as f32 * d));
    }
    out
}
