//! Importance-weighted weight quantizers: ggml's `quantize_row_*_impl` with `quant_weights`, the
//! path `llama-quantize --imatrix` takes for Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0 and
//! Q5_1.
//!
//! `qw` holds one importance per column of the row (the imatrix entry: mean squared activation
//! of that input channel). As ggml does, the weight of value `x` in column `c` is
//! `qw[c] · sqrt(σ² + x²)` (σ² the row's or super-block's mean square, times 2 for k-quants),
//! except Q6_K which uses `qw[c]` alone; the scale searches then minimise the weighted squared
//! error (`make_qx_quants`, `make_qkx3_quants`), and the k-quants' 6-bit sub-block scales are
//! themselves chosen by `make_qp_quants` weighted by the sub-blocks' total weight. Float
//! expression order follows the C (`w*x*l` is `(w*x)*l`, no fused multiply-add).

use super::blocks::{
    Block, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, QK_K,
};
use super::kquantize::{
    check_lens, make_qx_quants, pack_2bit, pack_q3k, q45k_finish, quantize_q6k, write_q4k,
    write_q5k, GROUP_MAX_EPS,
};
use super::quantize::{fp16, nearest_int, pack_q5};

/// `make_qkx3_quants` with weights: asymmetric `x ≈ scale·l − min`, `l` in `0..=nmax`, the
/// weighted squared error minimised over `nstep + 1` candidate scales. Returns `(scale, min)`
/// with `min ≥ 0` the amount subtracted (ggml's `*the_min`).
fn make_qkx3_quants(nmax: i32, x: &[f32], w: &[f32], l_out: &mut [u8]) -> (f32, f32) {
    let (rmin, rdelta, nstep) = (-0.9f32, 0.05f32, 36);
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max <= min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best += w[i] * (diff * diff);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let lf = l as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur += w[i] * (diff * diff);
            }
            if cur < best {
                l_out.copy_from_slice(&laux[..n]);
                best = cur;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// `make_qp_quants`: non-negative `x ≈ scale·l`, `l` in `0..=nmax`, weighted by `qw`: a scale
/// search over 9 candidates, then up to 5 passes of per-element refinement. Returns the scale.
fn make_qp_quants(nmax: i32, x: &[f32], l_out: &mut [u8], qw: &[f32]) -> f32 {
    let n = x.len();
    let max = x.iter().fold(0.0f32, |m, &v| m.max(v));
    if max < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let mut iscale = nmax as f32 / max;
    for i in 0..n {
        l_out[i] = nearest_int(iscale * x[i]) as u8;
    }
    let scale = 1.0 / iscale;
    let mut best = 0.0f32;
    for i in 0..n {
        let diff = x[i] - scale * l_out[i] as f32;
        best += qw[i] * diff * diff;
    }
    for is in -4..=4 {
        if is == 0 {
            continue;
        }
        let iscale_is = (0.1 * is as f32 + nmax as f32) / max;
        let scale_is = 1.0 / iscale_is;
        let mut mse = 0.0f32;
        for i in 0..n {
            let l = nearest_int(iscale_is * x[i]).min(nmax);
            let diff = x[i] - scale_is * l as f32;
            mse += qw[i] * diff * diff;
        }
        if mse < best {
            best = mse;
            iscale = iscale_is;
        }
    }
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).min(nmax);
        l_out[i] = l as u8;
        sumlx += qw[i] * x[i] * l as f32;
        suml2 += qw[i] * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut changed = 0;
        for i in 0..n {
            let w = qw[i];
            let cur = l_out[i] as f32;
            let mut slx = sumlx - w * x[i] * cur;
            let mut sl2 = suml2 - w * cur * cur;
            if slx > 0.0 && sl2 > 0.0 {
                let new_l = nearest_int(x[i] * sl2 / slx).min(nmax);
                if new_l != l_out[i] as i32 {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_out[i] = new_l as u8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed += 1;
                    }
                }
            }
        }
        if changed == 0 {
            break;
        }
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// `Σ x²` in order.
fn sum_sq(x: &[f32]) -> f32 {
    let mut s = 0.0f32;
    for &v in x {
        s += v * v;
    }
    s
}

/// `σ²` of a k-quant super-block: twice the mean square.
fn sigma2_k(x: &[f32]) -> f32 {
    2.0 * sum_sq(x) / QK_K as f32
}

/// The importance-derived weights of `n` values starting at `x[at]`.
fn weights(x: &[f32], qw: &[f32], sigma2: f32) -> Vec<f32> {
    x.iter()
        .zip(qw)
        .map(|(&v, &q)| q * (sigma2 + v * v).sqrt())
        .collect()
}

/// Q2_K with importance (`quantize_row_q2_K_impl`; σ² is the plain mean square here).
pub fn quantize_q2k(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ2K>(src, dst);
    for (bi, (x, out)) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ2K::BYTES))
        .enumerate()
    {
        let sigma2 = sum_sq(x) / QK_K as f32;
        let mut l = [0u8; QK_K];
        let (mut scales, mut mins, mut sw) = ([0f32; 16], [0f32; 16], [0f32; 16]);
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            let w = weights(xs, &qw[QK_K * bi + 16 * j..], sigma2);
            sw[j] = w.iter().fold(0.0f32, |a, &b| a + b);
            (scales[j], mins[j]) = make_qkx3_quants(3, xs, &w, &mut l[16 * j..16 * j + 16]);
        }
        let (mut ls, mut lm) = ([0u8; 16], [0u8; 16]);
        let d = fp16(make_qp_quants(15, &scales, &mut ls, &sw));
        let dmin = fp16(make_qp_quants(15, &mins, &mut lm, &sw));
        let (dm, mm) = (d.to_f32(), dmin.to_f32());
        let packed: [u8; 16] = std::array::from_fn(|j| ls[j] | (lm[j] << 4));
        for j in 0..16 {
            let dd = dm * (packed[j] & 0xF) as f32;
            if dd == 0.0 {
                continue;
            }
            let m = mm * (packed[j] >> 4) as f32;
            for ii in 0..16 {
                l[16 * j + ii] = nearest_int((x[16 * j + ii] + m) / dd).clamp(0, 3) as u8;
            }
        }
        let mut b = BlockQ2K {
            scales: packed,
            qs: [0; 64],
            d,
            dmin,
        };
        pack_2bit(&l, &mut b.qs);
        b.write(out);
    }
}

/// Q3_K with importance (`quantize_row_q3_K_impl`).
pub fn quantize_q3k(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ3K>(src, dst);
    for (bi, (x, out)) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ3K::BYTES))
        .enumerate()
    {
        let sigma2 = sigma2_k(x);
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let mut sw = [0f32; 16];
        for j in 0..16 {
            let w = weights(&x[16 * j..16 * j + 16], &qw[QK_K * bi + 16 * j..], sigma2);
            sw[j] = w.iter().fold(0.0f32, |a, &b| a + b);
            scales[j] = make_qx_quants(
                4,
                &x[16 * j..16 * j + 16],
                &mut l[16 * j..16 * j + 16],
                1,
                Some(&w),
            );
        }
        let mut ls = [0i8; 16];
        let d = make_qx_quants(32, &scales, &mut ls, 1, Some(&sw));
        pack_q3k(x, &ls.map(|v| v as u8), fp16(d), &mut l, out);
    }
}

/// The importance-weighted sub-block search of Q4_K (`nmax` 15) and Q5_K (31).
fn q45k(x: &[f32], qw: &[f32], nmax: i32) -> (half::f16, half::f16, [u8; 12], [u8; QK_K]) {
    let sigma2 = sigma2_k(x);
    let mut l = [0u8; QK_K];
    let (mut scales, mut mins, mut sw) = ([0f32; 8], [0f32; 8], [0f32; 8]);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let w = weights(xs, &qw[32 * j..], sigma2);
        sw[j] = w.iter().fold(0.0f32, |a, &b| a + b);
        (scales[j], mins[j]) = make_qkx3_quants(nmax, xs, &w, &mut l[32 * j..32 * j + 32]);
    }
    let (mut ls, mut lm) = ([0u8; 8], [0u8; 8]);
    let d = fp16(make_qp_quants(63, &scales, &mut ls, &sw));
    let dmin = fp16(make_qp_quants(63, &mins, &mut lm, &sw));
    let (ls, lm) = (ls.map(|v| v.min(63)), lm.map(|v| v.min(63)));
    let packed = q45k_finish(x, &ls, &lm, d, dmin, nmax, &mut l);
    (d, dmin, packed, l)
}

/// Q4_K with importance (`quantize_row_q4_K_impl`).
pub fn quantize_q4k(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ4K>(src, dst);
    for (bi, (x, out)) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ4K::BYTES))
        .enumerate()
    {
        let (d, dmin, scales, l) = q45k(x, &qw[QK_K * bi..], 15);
        write_q4k(d, dmin, scales, &l, out);
    }
}

/// Q5_K with importance (`quantize_row_q5_K_impl`).
pub fn quantize_q5k(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ5K>(src, dst);
    for (bi, (x, out)) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ5K::BYTES))
        .enumerate()
    {
        let (d, dmin, scales, l) = q45k(x, &qw[QK_K * bi..], 31);
        write_q5k(d, dmin, scales, &l, out);
    }
}

/// Q6_K with importance (`quantize_row_q6_K_impl`).
pub fn quantize_q6k_weighted(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    quantize_q6k(src, Some(qw), dst);
}

/// `σ²` of a legacy-quant row: its mean square.
fn sigma2_row(x: &[f32]) -> f32 {
    sum_sq(x) / x.len() as f32
}

/// Q4_0 with importance (`quantize_row_q4_0_impl`).
pub fn quantize_q4_0(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    let sigma2 = sigma2_row(src);
    for (ib, (xb, out)) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ4_0::BYTES))
        .enumerate()
    {
        let w = weights(xb, &qw[32 * ib..], sigma2);
        let mut l = [0i8; 32];
        let d = make_qx_quants(8, xb, &mut l, 1, Some(&w));
        let qs = std::array::from_fn(|j| l[j] as u8 | ((l[j + 16] as u8) << 4));
        BlockQ4_0 { d: fp16(d), qs }.write(out);
    }
}

/// Q4_1 with importance (`quantize_row_q4_1_impl`).
pub fn quantize_q4_1(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    let sigma2 = sigma2_row(src);
    for (ib, (xb, out)) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ4_1::BYTES))
        .enumerate()
    {
        let w = weights(xb, &qw[32 * ib..], sigma2);
        let mut l = [0u8; 32];
        let (d, min) = make_qkx3_quants(15, xb, &w, &mut l);
        let qs = std::array::from_fn(|j| l[j] | (l[j + 16] << 4));
        BlockQ4_1 {
            d: fp16(d),
            m: fp16(-min),
            qs,
        }
        .write(out);
    }
}

/// Q5_0 with importance (`quantize_row_q5_0_impl`).
pub fn quantize_q5_0(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    let sigma2 = sigma2_row(src);
    for (ib, (xb, out)) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ5_0::BYTES))
        .enumerate()
    {
        let w = weights(xb, &qw[32 * ib..], sigma2);
        let mut l = [0i8; 32];
        let d = make_qx_quants(16, xb, &mut l, 1, Some(&w));
        let (qh, qs) = pack_q5(&l.map(|v| v as u8));
        BlockQ5_0 { d: fp16(d), qh, qs }.write(out);
    }
}

/// Q5_1 with importance (`quantize_row_q5_1_impl`).
pub fn quantize_q5_1(src: &[f32], qw: &[f32], dst: &mut [u8]) {
    let sigma2 = sigma2_row(src);
    for (ib, (xb, out)) in src
        .chunks_exact(32)
        .zip(dst.chunks_exact_mut(BlockQ5_1::BYTES))
        .enumerate()
    {
        let w = weights(xb, &qw[32 * ib..], sigma2);
        let mut l = [0u8; 32];
        let (d, min) = make_qkx3_quants(31, xb, &w, &mut l);
        let (qh, qs) = pack_q5(&l);
        BlockQ5_1 {
            d: fp16(d),
            m: fp16(-min),
            qh,
            qs,
        }
        .write(out);
    }
}
