//! The fused kernels' check (part of [`super::cuda_kernels::run_all`]): `add_rms_norm_q8`,
//! `rope_kv`, `glu_q8`, `gemv_glu_*`, `gemv_norm_*` and `gemv_qkv_*` (cuda/fused.cu) against the
//! CPU backend's scalar ops composed as the unfused path composes them (`kernels::cpu::ops`: RMS
//! norm, RoPE caches and rotation, the gated activations) and the crate's q8_1 quantizer, at
//! ragged shapes: rows of 100 (no q8_1), 640 (Gemma-3-270M's width) and 896/1536, with and without
//! the residual add and Gemma's norm of the sublayer output; GQA and MQA head layouts with both
//! RoPE pairings, frequency factors, per-head q/k norms, q scaling and scattered KV slots. The q8_1
//! blocks are held bit for bit to the reference quantizer applied to the kernel's own f32 output.
//! The fused gate/up GEMV + GLU (`gemv_glu_*`), the fused output product + residual join
//! (`gemv_norm_*`) and the fused Q/K/V products + RoPE and KV write (`gemv_qkv_*`) are held bit
//! for bit to the unfused launches they replace.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use half::f16;

use super::cuda_kernels::{floats, max_abs, max_rel, Check};
use crate::kernels::cpu::ops as cpu;
use crate::kernels::cuda::launch::{DevBuf, Launch};
use crate::kernels::cuda::ops::{self, RopeKv};
use crate::model::config::{Activation, RopeStyle};
use crate::quant::quantize::quantize_row_q8_1;

pub fn fused(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    add_rms_norm(l, out)?;
    rope_kv(l, out)?;
    glu(l, out)?;
    gemv_glu(l, out)?;
    gemv_norm(l, out)?;
    gemv_qkv(l, out)?;
    Ok(())
}

/// `gemv_qkv_<types>` against the Q, K and V GEMVs (one launch each) followed by `rope_kv`: q (as
/// rotated), k, v and both caches' bytes bit for bit (err = bytes that differ, tolerance 0): one
/// type and Q4_K_M's mix (V in Q6_K), biases, per-head q/k norms, both pairings, frequency
/// factors, a q scale, an f16 and a q8_0/q4_0 cache, 1, 3 and 9 tokens (two token tiles); each
/// shape launched twice, so a counter left non-zero by the first launch would show in the second.
fn gemv_qkv(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    use crate::format::GgmlType::{self, Q4K, Q4_0, Q5_0, Q6K, Q8_0};
    use crate::model::backend::CacheType::{self, F16, Q4_0 as C4, Q8_0 as C8};
    // (Q/K type, V type, cols, tokens, heads, KV heads, head_dim, pairing, biases + norms + ff,
    // cache types)
    #[rustfmt::skip]
    type Case = (
        GgmlType, GgmlType, usize, usize, usize, usize, usize, RopeStyle, bool,
        (CacheType, CacheType),
    );
    #[rustfmt::skip]
    let cases: [Case; 6] = [
        (Q4K, Q6K, 256, 1, 4, 2, 64, RopeStyle::Neox, true, (F16, F16)),
        (Q4K, Q4K, 512, 1, 2, 1, 128, RopeStyle::Normal, false, (C8, C8)),
        (Q8_0, Q8_0, 96, 3, 3, 1, 32, RopeStyle::Neox, true, (C4, F16)),
        (Q4_0, Q4_0, 64, 9, 2, 2, 16, RopeStyle::Normal, true, (F16, F16)),
        (Q5_0, Q5_0, 160, 1, 2, 1, 256, RopeStyle::Neox, false, (F16, C8)),
        // Gemma-3-270M's layers with a Q8_0 V: its shapes
        (Q5_0, Q8_0, 640, 1, 4, 1, 256, RopeStyle::Neox, true, (F16, F16)),
    ];
    let (eps, base, slots_total) = (1e-6, 10000.0, 40);
    for (i, (tqk, tv, cols, n, nh, nkv, hd, style, extras, types)) in cases.into_iter().enumerate()
    {
        let seed = 140 + 10 * i as u64;
        let (qd, kvd) = (nh * hd, nkv * hd);
        let dev = |v: &[f32]| DevBuf::from_f32(l, v);
        let mat = |ty, rows, s| -> Result<DevBuf> {
            DevBuf::from_bytes(l, &super::cuda_kernels::weights(ty, rows, cols, s)?.0)
        };
        let (wq, wk, wv) = (
            mat(tqk, qd, seed)?,
            mat(tqk, kvd, seed + 1)?,
            mat(tv, kvd, seed + 2)?,
        );
        let (bq, bk, bv) = (
            dev(&floats(qd, seed + 3))?,
            dev(&floats(kvd, seed + 4))?,
            dev(&floats(kvd, seed + 5))?,
        );
        let (qn, kn) = (dev(&floats(hd, seed + 6))?, dev(&floats(hd, seed + 7))?);
        let ff: Vec<f32> = (0..hd / 2).map(|i| 1.0 + (i % 3) as f32).collect();
        let ffb = dev(&ff)?;
        let x = floats(n * cols, seed + 8);
        let xd = dev(&x)?;
        let xq = DevBuf::new(l, n * cols / 32 * ops::Q8_1_BYTES)?;
        ops::quantize_q8_1(&**l, xd.ptr, xq.ptr, n * cols)?;
        let pos: Vec<i32> = (0..n as i32).map(|t| 5 + 97 * t).collect();
        let slots: Vec<i32> = (0..n as i32)
            .map(|t| (33 + 3 * t) % slots_total as i32)
            .collect();
        let (sb, pb) = (DevBuf::from_i32(l, &slots)?, DevBuf::from_i32(l, &pos)?);
        let r = RopeKv {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            base,
            style,
            ff: extras.then_some(ffb.ptr),
            q_norm: extras.then_some(qn.ptr),
            k_norm: extras.then_some(kn.ptr),
            eps,
            q_scale: if extras { 0.125 } else { 1.0 },
        };
        let bias = |b: &DevBuf| extras.then_some(b.ptr);
        let cache = |t: CacheType| DevBuf::new(l, slots_total * t.row_bytes(kvd));
        // The unfused path.
        let (q0, k0, v0) = (
            DevBuf::new(l, n * qd * 4)?,
            DevBuf::new(l, n * kvd * 4)?,
            DevBuf::new(l, n * kvd * 4)?,
        );
        let (kc0, vc0) = (cache(types.0)?, cache(types.1)?);
        ops::gemv(&**l, tqk, wq.ptr, xq.ptr, q0.ptr, bias(&bq), (qd, cols, n))?;
        ops::gemv(&**l, tqk, wk.ptr, xq.ptr, k0.ptr, bias(&bk), (kvd, cols, n))?;
        ops::gemv(&**l, tv, wv.ptr, xq.ptr, v0.ptr, bias(&bv), (kvd, cols, n))?;
        let tables = (sb.ptr, pb.ptr);
        ops::rope_kv_typed(
            &**l,
            (q0.ptr, k0.ptr, v0.ptr),
            (kc0.ptr, vc0.ptr),
            types,
            tables,
            n,
            &r,
        )?;
        let want = [
            q0.to_bytes()?,
            k0.to_bytes()?,
            v0.to_bytes()?,
            kc0.to_bytes()?,
            vc0.to_bytes()?,
        ];
        let (q1, k1, v1) = (
            DevBuf::new(l, n * qd * 4)?,
            DevBuf::new(l, n * kvd * 4)?,
            DevBuf::new(l, n * kvd * 4)?,
        );
        let (kc1, vc1) = (cache(types.0)?, cache(types.1)?);
        let done = DevBuf::new(l, ops::gemv_qkv_done_bytes(nh + nkv, n))?;
        let parts = (
            (wq.ptr, tqk, bias(&bq), q1.ptr),
            (wk.ptr, tqk, bias(&bk), k1.ptr),
            (wv.ptr, tv, bias(&bv), v1.ptr),
        );
        let kernel = ops::gemv_qkv_kernel((tqk, tqk, tv)).expect("a case of a fused type");
        for round in 1..=2 {
            let secs = timed(l, || {
                let caches = (kc1.ptr, vc1.ptr);
                ops::gemv_qkv(
                    &**l,
                    xq.ptr,
                    parts,
                    (cols, n),
                    caches,
                    types,
                    tables,
                    &r,
                    done.ptr,
                )
            })?;
            let got = [
                q1.to_bytes()?,
                k1.to_bytes()?,
                v1.to_bytes()?,
                kc1.to_bytes()?,
                vc1.to_bytes()?,
            ];
            let differ: usize = (got.iter().zip(&want))
                .map(|(g, w)| g.iter().zip(w).filter(|(a, b)| a != b).count())
                .sum();
            let shape = format!(
                "{qd}+{kvd}+{kvd}x{cols} {n} tok {style:?} {types:?} #{round} (bytes differing from gemv ×3 + rope_kv)"
            );
            push(out, kernel, shape, differ as f64, 0.0, secs);
        }
    }
    Ok(())
}

/// `gemv_norm_<type>` against `gemv_<type>` followed by `add_rms_norm_q8`: the product, the
/// residual, the normed output and its q8_1 blocks bit for bit (err = values and bytes that
/// differ, tolerance 0), at widths of 64 to 1,536 (Qwen2.5-1.5B's), with and without Gemma's norm
/// of the product, 1 token (what the backend fuses), 3, and 9 (two token tiles, two counters);
/// each shape launched twice, so a counter left non-zero by the first launch would show in the
/// second.
fn gemv_norm(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    use crate::format::GgmlType;
    // (type, rows = the join's width, cols, tokens, norm of the product)
    let cases = [
        (GgmlType::Q4K, 1536, 512, 1, false),
        (GgmlType::Q6K, 640, 256, 1, true),
        (GgmlType::Q8_0, 96, 160, 9, true),
        (GgmlType::Q4_0, 160, 96, 1, false),
        (GgmlType::Q5_0, 64, 64, 3, true),
    ];
    let eps = 1e-6;
    for (i, (ty, d, cols, n, post)) in cases.into_iter().enumerate() {
        let (w, _) = super::cuda_kernels::weights(ty, d, cols, 90 + i as u64)?;
        let w = DevBuf::from_bytes(l, &w)?;
        let a: Vec<f32> = floats(n * cols, 100 + i as u64);
        let ad = DevBuf::from_f32(l, &a)?;
        let aq = DevBuf::new(l, n * cols / 32 * ops::Q8_1_BYTES)?;
        ops::quantize_q8_1(&**l, ad.ptr, aq.ptr, n * cols)?;
        let x: Vec<f32> = floats(n * d, 110 + i as u64)
            .iter()
            .map(|v| v * 4.0)
            .collect();
        let (nw, yw) = (floats(d, 120 + i as u64), floats(d, 130 + i as u64));
        let (nwd, ywd) = (DevBuf::from_f32(l, &nw)?, DevBuf::from_f32(l, &yw)?);
        let y_norm = post.then_some(ywd.ptr);
        let q8_bytes = n * d / 32 * ops::Q8_1_BYTES;
        // The unfused path.
        let (y0, x0) = (DevBuf::new(l, n * d * 4)?, DevBuf::from_f32(l, &x)?);
        let (h0, q0) = (DevBuf::new(l, n * d * 4)?, DevBuf::new(l, q8_bytes)?);
        ops::gemv(&**l, ty, w.ptr, aq.ptr, y0.ptr, None, (d, cols, n))?;
        let yarg = Some((y0.ptr, y_norm));
        ops::add_rms_norm_q8(
            &**l,
            x0.ptr,
            yarg,
            nwd.ptr,
            h0.ptr,
            Some(q0.ptr),
            (n, d),
            eps,
        )?;
        let want: Vec<Vec<u8>> = vec![
            bytes_of(&y0.to_f32()?),
            bytes_of(&x0.to_f32()?),
            bytes_of(&h0.to_f32()?),
            q0.to_bytes()?,
        ];
        let done = DevBuf::new(l, ops::gemv_norm_done_bytes(n))?;
        let (y1, h1, q1) = (
            DevBuf::new(l, n * d * 4)?,
            DevBuf::new(l, n * d * 4)?,
            DevBuf::new(l, q8_bytes)?,
        );
        for round in 1..=2 {
            let x1 = DevBuf::from_f32(l, &x)?;
            let j = ops::NormJoin {
                x: x1.ptr,
                y_norm,
                w: nwd.ptr,
                out: h1.ptr,
                q8: q1.ptr,
                eps,
            };
            let secs = timed(l, || {
                ops::gemv_norm(
                    &**l,
                    ty,
                    (w.ptr, aq.ptr, y1.ptr),
                    (d, cols, n),
                    &j,
                    done.ptr,
                )
            })?;
            let got = [
                bytes_of(&y1.to_f32()?),
                bytes_of(&x1.to_f32()?),
                bytes_of(&h1.to_f32()?),
                q1.to_bytes()?,
            ];
            let differ: usize = (got.iter().zip(&want))
                .map(|(g, w)| g.iter().zip(w).filter(|(a, b)| a != b).count())
                .sum();
            let kernel = ops::gemv_norm_kernel(ty).expect("a case of a fused type");
            let norm = if post { " norm y +" } else { "" };
            let shape = format!(
                "{d}x{cols} {n} tok{norm} add + norm #{round} (bytes differing from gemv + add_rms_norm_q8)"
            );
            push(out, kernel, shape, differ as f64, 0.0, secs);
        }
    }
    Ok(())
}

/// The bytes of f32 values, so that values are compared bit for bit.
fn bytes_of(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `gemv_glu_<type>` against `gemv_multi_<type>` of gate and up followed by `glu_q8`: the GLU
/// output and its q8_1 blocks bit for bit (err = values and bytes that differ, tolerance 0), at
/// FFN widths of 3 and 5 q8_1 groups (not a multiple of the 8 blocks of 4 rows a group takes),
/// 1, 3 and 8 tokens and each activation; each shape launched twice, so a counter left non-zero
/// by the first launch would show in the second.
fn gemv_glu(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    use crate::format::GgmlType;
    let cases = [
        (GgmlType::Q4K, 96, 512, 1, Activation::Silu),
        (GgmlType::Q6K, 160, 256, 3, Activation::GeluTanh),
        (GgmlType::Q8_0, 96, 160, 8, Activation::GeluTanhF32),
        (GgmlType::Q4_0, 160, 96, 2, Activation::Silu),
        (GgmlType::Q5_0, 96, 64, 5, Activation::GeluTanh),
    ];
    for (i, (ty, ff, cols, n, act)) in cases.into_iter().enumerate() {
        let (wg, _) = super::cuda_kernels::weights(ty, ff, cols, 60 + i as u64)?;
        let (wu, _) = super::cuda_kernels::weights(ty, ff, cols, 70 + i as u64)?;
        let (wg, wu) = (DevBuf::from_bytes(l, &wg)?, DevBuf::from_bytes(l, &wu)?);
        let x: Vec<f32> = floats(n * cols, 80 + i as u64);
        let xd = DevBuf::from_f32(l, &x)?;
        let xq = DevBuf::new(l, n * cols / 32 * ops::Q8_1_BYTES)?;
        ops::quantize_q8_1(&**l, xd.ptr, xq.ptr, n * cols)?;
        // The unfused path.
        let (g0, u0) = (DevBuf::new(l, n * ff * 4)?, DevBuf::new(l, n * ff * 4)?);
        let q0 = DevBuf::new(l, n * ff / 32 * ops::Q8_1_BYTES)?;
        let parts = [(wg.ptr, g0.ptr, None, ff), (wu.ptr, u0.ptr, None, ff)];
        ops::gemv_multi(&**l, ty, xq.ptr, &parts, (cols, n))?;
        ops::glu_q8(&**l, g0.ptr, u0.ptr, q0.ptr, n * ff, act)?;
        let (want, want_q8) = (g0.to_f32()?, q0.to_bytes()?);
        let (g1, u1) = (DevBuf::new(l, n * ff * 4)?, DevBuf::new(l, n * ff * 4)?);
        let q1 = DevBuf::new(l, n * ff / 32 * ops::Q8_1_BYTES)?;
        let done = DevBuf::new(l, ops::gemv_glu_done_bytes(ff, n))?;
        for round in 1..=2 {
            let secs = timed(l, || {
                ops::gemv_glu(
                    &**l,
                    ty,
                    xq.ptr,
                    (wg.ptr, g1.ptr),
                    (wu.ptr, u1.ptr),
                    (ff, cols, n),
                    (q1.ptr, done.ptr),
                    act,
                )
            })?;
            let got = g1.to_f32()?;
            let differ = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            let q8 = q1.to_bytes()?;
            let bytes = q8.iter().zip(&want_q8).filter(|(a, b)| a != b).count();
            let kernel = ops::gemv_glu_kernel(ty).expect("a case of a fused type");
            let shape = format!(
                "{ff}x{cols} {n} tok {act:?} #{round} (values + q8_1 bytes differing from gemv_multi + glu_q8)"
            );
            push(out, kernel, shape, (differ + bytes) as f64, 0.0, secs);
        }
    }
    Ok(())
}

fn push(out: &mut Vec<Check>, kernel: &str, shape: String, err: f64, tol: f64, secs: f64) {
    out.push(Check {
        kernel: kernel.into(),
        shape,
        err,
        tol,
        secs,
    });
}

/// Runs `f`, waits, and returns its duration.
fn timed(l: &Arc<dyn Launch>, f: impl FnOnce() -> Result<()>) -> Result<f64> {
    l.sync()?;
    let t = Instant::now();
    f()?;
    l.sync()?;
    Ok(t.elapsed().as_secs_f64())
}

/// Bytes of `q8` that differ from the reference quantizer's q8_1 of `x`.
fn q8_diff(q8: &[u8], x: &[f32]) -> usize {
    let mut want = vec![0u8; x.len() / 32 * ops::Q8_1_BYTES];
    quantize_row_q8_1(x, &mut want);
    q8.iter().zip(&want).filter(|(a, b)| a != b).count() + q8.len().abs_diff(want.len())
}

fn add_rms_norm(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    // (rows, n, residual add, norm of the added rows, q8_1)
    let cases = [
        (1, 64, false, false, true),
        (3, 896, true, false, true),
        (2, 1536, true, true, true),
        (5, 640, true, true, true),
        (2, 100, true, false, false),
    ];
    let eps = 1e-6;
    for (rows, n, add, post, q8) in cases {
        let x: Vec<f32> = floats(rows * n, 31).iter().map(|v| v * 4.0).collect();
        let y: Vec<f32> = floats(rows * n, 32).iter().map(|v| v * 2.0).collect();
        let (w, yw) = (floats(n, 33), floats(n, 34));
        let (xd, yd, wd, ywd) = (
            DevBuf::from_f32(l, &x)?,
            DevBuf::from_f32(l, &y)?,
            DevBuf::from_f32(l, &w)?,
            DevBuf::from_f32(l, &yw)?,
        );
        let od = DevBuf::new(l, rows * n * 4)?;
        let qd = DevBuf::new(l, rows * n / 32 * ops::Q8_1_BYTES + 4)?;
        let yarg = add.then_some((yd.ptr, post.then_some(ywd.ptr)));
        let secs = timed(l, || {
            let q = q8.then_some(qd.ptr);
            ops::add_rms_norm_q8(&**l, xd.ptr, yarg, wd.ptr, od.ptr, q, (rows, n), eps)
        })?;
        // The unfused path: rms_norm_inplace(y, yw); add(x, y); rms_norm(x, w).
        let mut xr = x.clone();
        if add {
            let mut yn = y.clone();
            if post {
                yn.chunks_exact_mut(n)
                    .for_each(|r| cpu::rms_norm_inplace(r, &yw, eps));
            }
            xr.iter_mut().zip(&yn).for_each(|(a, b)| *a += b);
        }
        let mut want = vec![0f32; rows * n];
        for (xs, ys) in xr.chunks_exact(n).zip(want.chunks_exact_mut(n)) {
            cpu::rms_norm(xs, &w, eps, ys);
        }
        let got = od.to_f32()?;
        let err =
            max_rel(&got, &want, max_abs(&want)).max(max_rel(&xd.to_f32()?, &xr, max_abs(&xr)));
        let what = match (add, post) {
            (false, _) => "norm",
            (true, false) => "add + norm",
            (true, true) => "norm y + add + norm",
        };
        let shape = format!("{rows}x{n} {what} (rel. to max)");
        push(out, "add_rms_norm_q8", shape, err, 1e-5, secs);
        if q8 {
            let bytes = qd.to_bytes()?[..rows * n / 32 * ops::Q8_1_BYTES].to_vec();
            let diff = q8_diff(&bytes, &got);
            let shape = format!("{rows}x{n} q8_1 of its output (bytes differing)");
            push(out, "add_rms_norm_q8", shape, diff as f64, 0.0, 0.0);
        }
    }
    Ok(())
}

/// (rows, heads, KV heads, head_dim, pairing, frequency factors, q/k norms, q scale)
type RopeCase = (usize, usize, usize, usize, RopeStyle, bool, bool, f32);

fn rope_kv(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    let cases: [RopeCase; 4] = [
        (3, 4, 2, 64, RopeStyle::Normal, false, false, 1.0),
        (2, 8, 1, 128, RopeStyle::Neox, true, true, 0.125),
        (1, 2, 2, 256, RopeStyle::Normal, false, true, 1.0),
        (2, 3, 3, 80, RopeStyle::Neox, false, false, 0.5),
    ];
    let (eps, base, slots_total) = (1e-6, 10000.0, 40);
    for (rows, nh, nkv, hd, style, with_ff, norms, q_scale) in cases {
        let (qd_, kvd) = (nh * hd, nkv * hd);
        let q: Vec<f32> = floats(rows * qd_, 41).iter().map(|v| v * 2.0).collect();
        let (k, v) = (floats(rows * kvd, 42), floats(rows * kvd, 43));
        let (qn, kn) = (floats(hd, 44), floats(hd, 45));
        let ff: Vec<f32> = (0..hd / 2).map(|i| 1.0 + (i % 3) as f32).collect();
        let pos: Vec<i32> = [5, 4095, 130].iter().take(rows).copied().collect();
        let slots: Vec<i32> = [33, 2, 17].iter().take(rows).copied().collect();
        let dev = |v: &[f32]| DevBuf::from_f32(l, v);
        let (qb, kb, vb) = (dev(&q)?, dev(&k)?, dev(&v)?);
        let (qnb, knb, ffb) = (dev(&qn)?, dev(&kn)?, dev(&ff)?);
        let (sb, pb) = (DevBuf::from_i32(l, &slots)?, DevBuf::from_i32(l, &pos)?);
        let kc = DevBuf::new(l, slots_total * kvd * 2)?;
        let vc = DevBuf::new(l, slots_total * kvd * 2)?;
        let r = RopeKv {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            base,
            style,
            ff: with_ff.then_some(ffb.ptr),
            q_norm: norms.then_some(qnb.ptr),
            k_norm: norms.then_some(knb.ptr),
            eps,
            q_scale,
        };
        let secs = timed(l, || {
            let caches = (kc.ptr, vc.ptr);
            ops::rope_kv(
                &**l,
                (qb.ptr, kb.ptr, vb.ptr),
                caches,
                (sb.ptr, pb.ptr),
                rows,
                &r,
            )
        })?;
        // The unfused path: per-head norms, RoPE of q and k, q's scale, the f16 KV write.
        let (mut wq, mut wk) = (q.clone(), k.clone());
        let mut cache = vec![0f32; hd];
        for row in 0..rows {
            let p = pos[row] as u32;
            match with_ff {
                true => cpu::rope_cache_scaled(p, base, hd, &ff, &mut cache),
                false => cpu::rope_cache(p, base, hd, &mut cache),
            }
            let heads = [(&mut wq, qd_, &qn), (&mut wk, kvd, &kn)];
            for (x, width, nw) in heads {
                for h in x[row * width..(row + 1) * width].chunks_exact_mut(hd) {
                    if norms {
                        cpu::rms_norm_inplace(h, nw, eps);
                    }
                    cpu::rope_head(h, &cache, style);
                }
            }
        }
        wq.iter_mut().for_each(|x| *x *= q_scale);
        let mut want_kc = vec![0f32; slots_total * kvd];
        let mut want_vc = vec![0f32; slots_total * kvd];
        for (row, &s) in slots.iter().enumerate() {
            let (dst, src) = (
                s as usize * kvd..(s as usize + 1) * kvd,
                row * kvd..(row + 1) * kvd,
            );
            let f16s = |x: &[f32]| {
                x.iter()
                    .map(|&v| f16::from_f32(v).to_f32())
                    .collect::<Vec<_>>()
            };
            want_kc[dst.clone()].copy_from_slice(&f16s(&wk[src.clone()]));
            want_vc[dst].copy_from_slice(&f16s(&v[src]));
        }
        let err_q = max_rel(&qb.to_f32()?, &wq, max_abs(&wq));
        let mut err_c = 0f64;
        for (cache, want) in [(&kc, &want_kc), (&vc, &want_vc)] {
            let got: Vec<f32> = cache
                .to_bytes()?
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect();
            err_c = err_c.max(max_rel(&got, want, max_abs(want)));
        }
        let shape = format!(
            "{rows}x{nh}/{nkv}x{hd} {style:?}{}{}{}",
            if with_ff { " +ff" } else { "" },
            if norms { " +q/k norms" } else { "" },
            if q_scale != 1.0 { " +scale" } else { "" }
        );
        push(
            out,
            "rope_kv",
            format!("{shape}: q (rel. to max)"),
            err_q,
            1e-5,
            secs,
        );
        // Against the reference rounded to f16: where the f32 values differ in their last bits
        // (norms), one may round to the neighbouring f16 (2^-10 of the value at most).
        push(
            out,
            "rope_kv",
            format!("{shape}: f16 K/V (rel. to max)"),
            err_c,
            1e-3,
            0.0,
        );
    }
    Ok(())
}

fn glu(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    for (act, n) in [
        (Activation::Silu, 1024),
        (Activation::GeluTanh, 2080),
        (Activation::GeluTanhF32, 512),
    ] {
        let g: Vec<f32> = floats(n, 51).iter().map(|v| v * 12.0).collect();
        let u = floats(n, 52);
        let (gd, ud) = (DevBuf::from_f32(l, &g)?, DevBuf::from_f32(l, &u)?);
        let qd = DevBuf::new(l, n / 32 * ops::Q8_1_BYTES)?;
        let secs = timed(l, || ops::glu_q8(&**l, gd.ptr, ud.ptr, qd.ptr, n, act))?;
        let mut want = g.clone();
        cpu::glu(&mut want, &u, act);
        let got = gd.to_f32()?;
        // As the `glu` check: ggml's expf approximation on the CPU, GELU's f16 rounding.
        let tol = if act == Activation::GeluTanh {
            1e-3
        } else {
            1e-5
        };
        let err = max_rel(&got, &want, max_abs(&want));
        push(
            out,
            "glu_q8",
            format!("{act:?} n={n} (rel. to max)"),
            err,
            tol,
            secs,
        );
        let diff = q8_diff(&qd.to_bytes()?, &got);
        let shape = format!("{act:?} n={n} q8_1 of its output (bytes differing)");
        push(out, "glu_q8", shape, diff as f64, 0.0, 0.0);
    }
    Ok(())
}
