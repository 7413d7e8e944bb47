//! Reference k-quant weight quantizers, as ggml's `quantize_row_q{2..6}_K_ref` (`ggml-quants.c`).
//!
//! These are the deterministic, importance-matrix-free quantizers ggml uses to create model
//! files. The search helpers (`make_qx_quants`, `make_q3_quants`, `make_qkx2_quants`) keep ggml's
//! exact float expression order (`w*x*l` is `(w*x)*l`, int-to-float conversions where C makes them,
//! no fused multiply-add) and ggml's integer truncations (`(uint8_t)`/`(int8_t)` casts wrap), so the
//! output bytes are identical to ggml built without FP contraction. Each function writes whole
//! 256-value super-blocks; lengths are asserted as in `quantize`.

use super::blocks::{
    get_scale_min_k4, Block, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, K_SCALE_SIZE, QK_K,
};
use super::quantize::{fp16, nearest_int};

/// ggml's `GROUP_MAX_EPS`: groups whose largest magnitude is below this quantize to zero.
pub(super) const GROUP_MAX_EPS: f32 = 1e-15;

pub(super) fn check_lens<B: Block>(src: &[f32], dst: &[u8]) {
    assert!(
        src.len().is_multiple_of(QK_K),
        "row of {} values is not a whole number of {QK_K}-value super-blocks",
        src.len()
    );
    assert_eq!(
        dst.len(),
        src.len() / QK_K * B::BYTES,
        "destination must hold exactly the row's blocks"
    );
}

/// `make_qx_quants`: symmetric quantization of `x` to `-nmax..nmax-1` (stored in `l` offset by
/// `nmax`), searching 19 candidate scales; returns the scale. The squared errors are weighted by
/// `qw` (an importance) when given, else by a function of `x` chosen by `rmse_type`.
pub(super) fn make_qx_quants(
    nmax: i32,
    x: &[f32],
    l_out: &mut [i8],
    rmse_type: i32,
    qw: Option<&[f32]>,
) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let clamp = |l: i32| l.clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    if rmse_type == 0 {
        for (o, &v) in l_out.iter_mut().zip(x) {
            *o = (nmax + clamp(nearest_int(iscale * v))) as i8;
        }
        return 1.0 / iscale;
    }
    let (rmse_type, return_early) = if rmse_type < 0 {
        (-rmse_type, true)
    } else {
        (rmse_type, false)
    };
    let weight = |i: usize, v: f32| match (qw, rmse_type) {
        (Some(q), _) => q[i],
        (None, 1) => v * v,
        (None, 2) => 1.0,
        (None, 3) => v.abs(),
        _ => v.abs().sqrt(),
    };
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (i, (o, &v)) in l_out.iter_mut().zip(x).enumerate() {
        let l = clamp(nearest_int(iscale * v));
        *o = (l + nmax) as i8;
        let w = weight(i, v);
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    if return_early {
        return if suml2 > 0.0 {
            0.5 * (scale + 1.0 / iscale)
        } else {
            1.0 / iscale
        };
    }
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for (i, &v) in x.iter().enumerate() {
            let l = clamp(nearest_int(iscale * v));
            let w = weight(i, v);
            sumlx += w * v * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in l_out.iter_mut().zip(x) {
                *o = (nmax + clamp(nearest_int(iscale * v))) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants` with `do_rmse = true`: symmetric quantization with iterative per-element
/// refinement (up to 5 passes); `l` gets values offset by `nmax`. Returns the scale.
fn make_q3_quants(nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (o, &v) in l_out.iter_mut().zip(x) {
        let l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        *o = l as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _ in 0..5 {
        let mut n_changed = 0;
        for (o, &v) in l_out.iter_mut().zip(x) {
            let w = v * v;
            let cur = *o as f32;
            let mut slx = sumlx - w * v * cur;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * cur * cur;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *o as i32 {
                    slx += w * v * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *o = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for o in l_out.iter_mut() {
        *o += nmax as i8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// Parameters of one `make_qkx2_quants` search.
struct Qkx2 {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
}

/// `make_qkx2_quants`: asymmetric quantization `x ≈ scale * l - min` with `l` in `0..=nmax`,
/// minimizing weighted squared (or absolute) error over `nstep + 1` candidate scales.
/// Returns `(scale, min)` where `min >= 0` is the amount subtracted (ggml's `*the_min`).
fn make_qkx2_quants(p: &Qkx2, x: &[f32], weights: &[f32], l_out: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if p.use_mad { diff.abs() } else { diff * diff };
    let mut iscale = p.nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, p.nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if p.nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    let laux = &mut laux[..n];
    for is in 0..=p.nstep {
        iscale = (p.rmin + p.rdelta * is as f32 + p.nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, p.nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l_out.copy_from_slice(laux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Packs 2-bit values (256) into 64 bytes as Q2_K/Q3_K do: byte `j/4 + l` of each 128-value half
/// holds values `l, l+32, l+64, l+96` at bits 0, 2, 4, 6.
pub(super) fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8; QK_K / 4]) {
    for j in (0..QK_K).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] =
                l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
}

/// Q2_K weights, as `quantize_row_q2_K_ref`.
pub fn quantize_row_q2k(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ2K>(src, dst);
    const Q4SCALE: f32 = 15.0;
    let p = Qkx2 {
        nmax: 3,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: true,
    };
    for (x, out) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ2K::BYTES))
    {
        let mut l = [0u8; QK_K];
        let mut scales = [0f32; 16];
        let mut mins = [0f32; 16];
        let mut max_scale = 0.0f32;
        let mut max_min = 0.0f32;
        for j in 0..16 {
            let xs = &x[16 * j..16 * j + 16];
            let weights: [f32; 16] = std::array::from_fn(|i| xs[i].abs());
            let (s, m) = make_qkx2_quants(&p, xs, &weights, &mut l[16 * j..16 * j + 16]);
            scales[j] = s;
            mins[j] = m;
            if s > max_scale {
                max_scale = s;
            }
            if m > max_min {
                max_min = m;
            }
        }
        let mut b = BlockQ2K {
            scales: [0; 16],
            qs: [0; 64],
            d: fp16(0.0),
            dmin: fp16(0.0),
        };
        if max_scale > 0.0 {
            let iscale = Q4SCALE / max_scale;
            for (sc, &s) in b.scales.iter_mut().zip(&scales) {
                *sc = nearest_int(iscale * s) as u8;
            }
            b.d = fp16(max_scale / Q4SCALE);
        }
        if max_min > 0.0 {
            let iscale = Q4SCALE / max_min;
            for (sc, &m) in b.scales.iter_mut().zip(&mins) {
                *sc |= (nearest_int(iscale * m) << 4) as u8;
            }
            b.dmin = fp16(max_min / Q4SCALE);
        }
        for j in 0..16 {
            let d = b.d.to_f32() * (b.scales[j] & 0xF) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = b.dmin.to_f32() * (b.scales[j] >> 4) as f32;
            for ii in 0..16 {
                l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
            }
        }
        pack_2bit(&l, &mut b.qs);
        b.write(out);
    }
}

/// Q3_K weights, as `quantize_row_q3_K_ref`.
pub fn quantize_row_q3k(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ3K>(src, dst);
    for (x, out) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ3K::BYTES))
    {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let mut max_scale = 0.0f32;
        let mut amax = 0.0f32;
        for j in 0..16 {
            scales[j] = make_q3_quants(4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
            let scale = scales[j].abs();
            if scale > amax {
                amax = scale;
                max_scale = scales[j];
            }
        }
        let (mut ls, mut d) = ([0u8; 16], fp16(0.0));
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for (lv, &s) in ls.iter_mut().zip(&scales) {
                // C: int8_t l = nearest_int(..); l = MAX(-32, MIN(31, l)) + 32;
                *lv = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            }
            d = fp16(1.0 / iscale);
        }
        pack_q3k(x, &ls, d, &mut l, out);
    }
}

/// The end of a Q3_K block: 6-bit scales `ls` (offset by 32) and `d` stored, the values
/// requantized against the stored scales, high bits to `hmask`, low bits packed.
pub(super) fn pack_q3k(x: &[f32], ls: &[u8; 16], d: half::f16, l: &mut [i8; QK_K], out: &mut [u8]) {
    let mut b = BlockQ3K {
        hmask: [0; 32],
        qs: [0; 64],
        scales: [0; 12],
        d,
    };
    for (j, &lv) in ls.iter().enumerate() {
        if j < 8 {
            b.scales[j] = lv & 0xF;
        } else {
            b.scales[j - 8] |= (lv & 0xF) << 4;
        }
        b.scales[j % 4 + 8] |= (lv >> 4) << (2 * (j / 4));
    }
    for j in 0..16 {
        let low = if j < 8 {
            b.scales[j] & 0xF
        } else {
            b.scales[j - 8] >> 4
        };
        let sc = (low | (((b.scales[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) as i32 - 32;
        let d = b.d.to_f32() * sc as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-4, 3) + 4) as i8;
        }
    }
    let mut m = 0;
    let mut hm = 1u8;
    let mut low = [0u8; QK_K];
    for (j, lo) in low.iter_mut().enumerate() {
        let mut v = l[j];
        if v > 3 {
            b.hmask[m] |= hm;
            v -= 4;
        }
        *lo = v as u8;
        m += 1;
        if m == QK_K / 8 {
            m = 0;
            hm = hm.wrapping_shl(1);
        }
    }
    pack_2bit(&low, &mut b.qs);
    b.write(out);
}

/// The shared scale search of Q4_K / Q5_K: per 32-value sub-block `make_qkx2_quants` with weights
/// `sqrt(mean(x^2)) + |x|`, then 6-bit scales and mins packed as `get_scale_min_k4` reads them.
/// Returns `(d, dmin, packed scales, L)` with `L` requantized against the stored scales.
fn q45k_block(x: &[f32], p: &Qkx2) -> (half::f16, half::f16, [u8; K_SCALE_SIZE], [u8; QK_K]) {
    let mut l = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        let (s, m) = make_qkx2_quants(p, xs, &weights, &mut l[32 * j..32 * j + 32]);
        scales[j] = s;
        mins[j] = m;
        if s > max_scale {
            max_scale = s;
        }
        if m > max_min {
            max_min = m;
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let ls: [u8; 8] = std::array::from_fn(|j| (nearest_int(inv_scale * scales[j]) as u8).min(63));
    let lm: [u8; 8] = std::array::from_fn(|j| (nearest_int(inv_min * mins[j]) as u8).min(63));
    let d = fp16(max_scale / 63.0);
    let dmin = fp16(max_min / 63.0);
    let packed = q45k_finish(x, &ls, &lm, d, dmin, p.nmax, &mut l);
    (d, dmin, packed, l)
}

/// The end of a Q4_K/Q5_K block: 6-bit scales `ls` and mins `lm` packed as `get_scale_min_k4`
/// reads them, and `l` requantized to `0..=nmax` against the stored scales (sub-blocks whose
/// stored scale is 0 keep their values). Returns the packed scales.
pub(super) fn q45k_finish(
    x: &[f32],
    ls: &[u8; 8],
    lm: &[u8; 8],
    d: half::f16,
    dmin: half::f16,
    nmax: i32,
    l: &mut [u8; QK_K],
) -> [u8; K_SCALE_SIZE] {
    let mut packed = [0u8; K_SCALE_SIZE];
    for j in 0..8 {
        let (ls, lm) = (ls[j], lm[j]);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    for j in 0..8 {
        let (sc, m) = get_scale_min_k4(j, &packed);
        let dd = d.to_f32() * sc as f32;
        if dd == 0.0 {
            continue;
        }
        let dm = dmin.to_f32() * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dd).clamp(0, nmax) as u8;
        }
    }
    packed
}

/// Q4_K weights, as `quantize_row_q4_K_ref`.
pub fn quantize_row_q4k(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ4K>(src, dst);
    let p = Qkx2 {
        nmax: 15,
        rmin: -1.0,
        rdelta: 0.1,
        nstep: 20,
        use_mad: false,
    };
    for (x, out) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ4K::BYTES))
    {
        let (d, dmin, scales, l) = q45k_block(x, &p);
        write_q4k(d, dmin, scales, &l, out);
    }
}

/// Packs a Q4_K block from its stored scales and 4-bit values.
pub(super) fn write_q4k(
    d: half::f16,
    dmin: half::f16,
    scales: [u8; K_SCALE_SIZE],
    l: &[u8; QK_K],
    out: &mut [u8],
) {
    let mut qs = [0u8; QK_K / 2];
    for (j, q) in qs.chunks_exact_mut(32).enumerate() {
        let base = 64 * j;
        for i in 0..32 {
            q[i] = l[base + i] | (l[base + i + 32] << 4);
        }
    }
    BlockQ4K {
        d,
        dmin,
        scales,
        qs,
    }
    .write(out);
}

/// Q5_K weights, as `quantize_row_q5_K_ref`.
pub fn quantize_row_q5k(src: &[f32], dst: &mut [u8]) {
    check_lens::<BlockQ5K>(src, dst);
    let p = Qkx2 {
        nmax: 31,
        rmin: -0.5,
        rdelta: 0.1,
        nstep: 15,
        use_mad: false,
    };
    for (x, out) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ5K::BYTES))
    {
        let (d, dmin, scales, l) = q45k_block(x, &p);
        write_q5k(d, dmin, scales, &l, out);
    }
}

/// Packs a Q5_K block from its stored scales and 5-bit values.
pub(super) fn write_q5k(
    d: half::f16,
    dmin: half::f16,
    scales: [u8; K_SCALE_SIZE],
    l: &[u8; QK_K],
    out: &mut [u8],
) {
    let mut qh = [0u8; QK_K / 8];
    let mut qs = [0u8; QK_K / 2];
    let (mut m1, mut m2) = (1u8, 2u8);
    for (n, ql) in qs.chunks_exact_mut(32).enumerate() {
        let base = 64 * n;
        for j in 0..32 {
            let mut l1 = l[base + j];
            if l1 > 15 {
                l1 -= 16;
                qh[j] |= m1;
            }
            let mut l2 = l[base + j + 32];
            if l2 > 15 {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[j] = l1 | (l2 << 4);
        }
        m1 = m1.wrapping_shl(2);
        m2 = m2.wrapping_shl(2);
    }
    BlockQ5K {
        d,
        dmin,
        scales,
        qh,
        qs,
    }
    .write(out);
}

/// Q6_K weights, as `quantize_row_q6_K_ref`.
pub fn quantize_row_q6k(src: &[f32], dst: &mut [u8]) {
    quantize_q6k(src, None, dst);
}

/// Q6_K weights with an optional importance per value (`quantize_row_q6_K_impl`: the importance
/// weights each sub-block's scale search directly; without it this is the reference quantizer).
pub(super) fn quantize_q6k(src: &[f32], qw: Option<&[f32]>, dst: &mut [u8]) {
    check_lens::<BlockQ6K>(src, dst);
    for (bi, (x, out)) in src
        .chunks_exact(QK_K)
        .zip(dst.chunks_exact_mut(BlockQ6K::BYTES))
        .enumerate()
    {
        let mut l = [0i8; QK_K];
        let mut scales = [0f32; 16];
        let mut max_scale = 0.0f32;
        let mut max_abs_scale = 0.0f32;
        for ib in 0..16 {
            let w = qw.map(|q| &q[QK_K * bi + 16 * ib..QK_K * bi + 16 * ib + 16]);
            let scale = make_qx_quants(
                32,
                &x[16 * ib..16 * ib + 16],
                &mut l[16 * ib..16 * ib + 16],
                1,
                w,
            );
            scales[ib] = scale;
            let abs_scale = scale.abs();
            if abs_scale > max_abs_scale {
                max_abs_scale = abs_scale;
                max_scale = scale;
            }
        }
        let mut b = BlockQ6K {
            ql: [0; 128],
            qh: [0; 64],
            scales: [0; 16],
            d: fp16(0.0),
        };
        if max_abs_scale < GROUP_MAX_EPS {
            b.write(out);
            continue;
        }
        let iscale = -128.0 / max_scale;
        b.d = fp16(1.0 / iscale);
        for (sc, &s) in b.scales.iter_mut().zip(&scales) {
            *sc = nearest_int(iscale * s).min(127) as i8;
        }
        for j in 0..16 {
            let d = b.d.to_f32() * b.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-32, 31) + 32) as i8;
            }
        }
        let l = l.map(|v| v as u8);
        for (half, (ql, qh)) in
            b.ql.chunks_exact_mut(64)
                .zip(b.qh.chunks_exact_mut(32))
                .enumerate()
        {
            let j = 128 * half;
            for i in 0..32 {
                let q1 = l[j + i] & 0xF;
                let q2 = l[j + i + 32] & 0xF;
                let q3 = l[j + i + 64] & 0xF;
                let q4 = l[j + i + 96] & 0xF;
                ql[i] = q1 | (q3 << 4);
                ql[i + 32] = q2 | (q4 << 4);
                qh[i] = (l[j + i] >> 4)
                    | ((l[j + i + 32] >> 4) << 2)
                    | ((l[j + i + 64] >> 4) << 4)
                    | ((l[j + i + 96] >> 4) << 6);
            }
        }
        b.write(out);
    }
}
