//! Scalar reference dot products of one weight row with one quantized activation row, bit-for-bit
//! as ggml-cpu's generic `ggml_vec_dot_*` (`ggml-cpu/quants.c`, `ggml-cpu/vec.cpp` without SIMD).
//!
//! Each function takes `n` (elements), the weight row's bytes and the activation row's bytes in the
//! weight type's vec-dot format (Q8_0, Q8_1, Q8_K, or the float type itself), and returns the f32
//! ggml would store. Integer products are summed exactly (i32, with ggml's i16 intermediates where
//! it has them) per block; the float scaling and accumulation keep ggml's operand order — e.g. Q4_0
//! is `sumi * d_w * d_a`, Q8_0 is `sumi * (d_w * d_a)`, the k-quants keep ggml's eight f32 lane
//! accumulators and subtract the min term in a separate running sum — and never fuse multiply-adds.
//! The float-type dots accumulate in f64 (ggml's `ggml_float`) over f32 products.
//!
//! All functions panic if `n` is not a whole number of blocks or a slice is not exactly the bytes
//! of `n` elements: they are references for tests and kernels, not input validators.

use half::{bf16, f16};

use super::blocks::{
    get_scale_min_k4, iter_blocks, q3k_scales, Block, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0,
    BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, QK_K,
};
use super::dequant::q6k_values;

/// Pairs the weight blocks with the activation blocks after checking both lengths against `n`.
fn pairs<'a, W: Block, A: Block>(
    n: usize,
    w: &'a [u8],
    a: &'a [u8],
) -> impl Iterator<Item = (W, A)> + 'a {
    assert_eq!(W::ELEMS, A::ELEMS);
    assert!(
        n.is_multiple_of(W::ELEMS),
        "n = {n} is not a whole number of {}-element blocks",
        W::ELEMS
    );
    let nb = n / W::ELEMS;
    assert_eq!(
        w.len(),
        nb * W::BYTES,
        "weight row must be exactly {nb} blocks"
    );
    assert_eq!(
        a.len(),
        nb * A::BYTES,
        "activation row must be exactly {nb} blocks"
    );
    iter_blocks::<W>(w).zip(iter_blocks::<A>(a))
}

/// The 32 five-bit values of a Q5 block (0..32), as ggml's dot products extract them.
#[inline]
fn q5_values(qh: &[u8; 4], qs: &[u8; 16]) -> [i32; 32] {
    let qh = u32::from_le_bytes(*qh);
    let mut v = [0i32; 32];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        v[j] = ((qs[j] & 0xF) as u32 | h0) as i32;
        v[j + 16] = ((qs[j] >> 4) as u32 | h1) as i32;
    }
    v
}

/// `ggml_vec_dot_q4_0_q8_0`.
pub fn vec_dot_q4_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in pairs::<BlockQ4_0, BlockQ8_0>(n, w, a) {
        let (mut s0, mut s1) = (0i32, 0i32);
        for j in 0..16 {
            let v0 = (x.qs[j] & 0x0F) as i32 - 8;
            let v1 = (x.qs[j] >> 4) as i32 - 8;
            s0 += v0 * y.qs[j] as i32;
            s1 += v1 * y.qs[j + 16] as i32;
        }
        let sumi = s0 + s1;
        sumf += sumi as f32 * x.d.to_f32() * y.d.to_f32();
    }
    sumf
}

/// `ggml_vec_dot_q4_1_q8_1`: `(d_w * d_a) * sumi + m_w * s_a` per block.
pub fn vec_dot_q4_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in pairs::<BlockQ4_1, BlockQ8_1>(n, w, a) {
        let (mut s0, mut s1) = (0i32, 0i32);
        for j in 0..16 {
            s0 += (x.qs[j] & 0x0F) as i32 * y.qs[j] as i32;
            s1 += (x.qs[j] >> 4) as i32 * y.qs[j + 16] as i32;
        }
        let sumi = s0 + s1;
        sumf += (x.d.to_f32() * y.d.to_f32()) * sumi as f32 + x.m.to_f32() * y.s.to_f32();
    }
    sumf
}

/// `ggml_vec_dot_q5_0_q8_0`: `(d_w * d_a) * sumi` per block.
pub fn vec_dot_q5_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in pairs::<BlockQ5_0, BlockQ8_0>(n, w, a) {
        let v = q5_values(&x.qh, &x.qs);
        let (mut s0, mut s1) = (0i32, 0i32);
        for j in 0..16 {
            s0 += (v[j] - 16) * y.qs[j] as i32;
            s1 += (v[j + 16] - 16) * y.qs[j + 16] as i32;
        }
        let sumi = s0 + s1;
        sumf += (x.d.to_f32() * y.d.to_f32()) * sumi as f32;
    }
    sumf
}

/// `ggml_vec_dot_q5_1_q8_1`: `(d_w * d_a) * sumi + m_w * s_a` per block.
pub fn vec_dot_q5_1_q8_1(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in pairs::<BlockQ5_1, BlockQ8_1>(n, w, a) {
        let v = q5_values(&x.qh, &x.qs);
        let (mut s0, mut s1) = (0i32, 0i32);
        for j in 0..16 {
            s0 += v[j] * y.qs[j] as i32;
            s1 += v[j + 16] * y.qs[j + 16] as i32;
        }
        let sumi = s0 + s1;
        sumf += (x.d.to_f32() * y.d.to_f32()) * sumi as f32 + x.m.to_f32() * y.s.to_f32();
    }
    sumf
}

/// `ggml_vec_dot_q8_0_q8_0`: `sumi * (d_w * d_a)` per block.
pub fn vec_dot_q8_0_q8_0(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in pairs::<BlockQ8_0, BlockQ8_0>(n, w, a) {
        let sumi: i32 =
            x.qs.iter()
                .zip(&y.qs)
                .map(|(&p, &q)| p as i32 * q as i32)
                .sum();
        sumf += sumi as f32 * (x.d.to_f32() * y.d.to_f32());
    }
    sumf
}

/// `ggml_vec_dot_q2_K_q8_K`: `dall * isum - dmin * summs` per super-block, with the min term
/// taken from the activation's `bsums`.
pub fn vec_dot_q2k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0.0f32;
    for (x, y) in pairs::<BlockQ2K, BlockQ8K>(n, w, a) {
        let summs: i32 = (0..16)
            .map(|j| y.bsums[j] as i32 * (x.scales[j] >> 4) as i32)
            .sum();
        let dall = y.d * x.d.to_f32();
        let dmin = y.d * x.dmin.to_f32();
        let mut isum = 0i32;
        let mut is = 0;
        let mut q8 = 0;
        for q2 in x.qs.chunks_exact(32) {
            for shift in [0, 2, 4, 6] {
                for half in 0..2 {
                    let d = (x.scales[is] & 0xF) as i32;
                    is += 1;
                    let mut isuml = 0i32;
                    let range = 16 * half..16 * half + 16;
                    for (&a8, &w2) in y.qs[q8..q8 + 32][range.clone()].iter().zip(&q2[range]) {
                        isuml += a8 as i32 * ((w2 >> shift) & 3) as i32;
                    }
                    isum += d * isuml;
                }
                q8 += 32;
            }
        }
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

/// The shared tail of ggml's generic Q3_K..Q6_K dots: values `a` (256, signed), one integer scale
/// per `group` values, accumulated into eight i32 lanes through i16 products.
#[inline]
fn lane_sums(
    a: &[i8; QK_K],
    q8: &[i8; QK_K],
    group: usize,
    scale: impl Fn(usize) -> i32,
) -> [i32; 8] {
    let mut aux32 = [0i32; 8];
    for (g, (ag, qg)) in a
        .chunks_exact(group)
        .zip(q8.chunks_exact(group))
        .enumerate()
    {
        let sc = scale(g);
        for (a8, q8) in ag.chunks_exact(8).zip(qg.chunks_exact(8)) {
            for l in 0..8 {
                let aux16 = (q8[l] as i16) * (a8[l] as i16);
                aux32[l] += sc * aux16 as i32;
            }
        }
    }
    aux32
}

/// Finishes a ggml generic k-quant dot: `sums[l]` accumulated over blocks, added at the end.
#[inline]
fn add_lanes(sums: &mut [f32; 8], d: f32, aux32: &[i32; 8]) {
    for l in 0..8 {
        sums[l] += d * aux32[l] as f32;
    }
}

/// `ggml_vec_dot_q3_K_q8_K`.
pub fn vec_dot_q3k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sums = [0f32; 8];
    for (x, y) in pairs::<BlockQ3K, BlockQ8K>(n, w, a) {
        let mut aux8 = [0i8; QK_K];
        let mut m = 1u8;
        let mut out = 0;
        for q3 in x.qs.chunks_exact(32) {
            for shift in [0, 2, 4, 6] {
                for l in 0..32 {
                    let v = ((q3[l] >> shift) & 3) as i8;
                    aux8[out + l] = v - if x.hmask[l] & m != 0 { 0 } else { 4 };
                }
                out += 32;
                m = m.wrapping_shl(1);
            }
        }
        let scales = q3k_scales(&x.scales);
        let aux32 = lane_sums(&aux8, &y.qs, 16, |g| scales[g] as i32 - 32);
        add_lanes(&mut sums, x.d.to_f32() * y.d, &aux32);
    }
    let mut sumf = 0.0f32;
    for s in sums {
        sumf += s;
    }
    sumf
}

/// `ggml_vec_dot_q4_K_q8_K`: lanes for the scaled products, a running `-= dmin * sumi` for mins.
pub fn vec_dot_q4k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sums = [0f32; 8];
    let mut sumf = 0.0f32;
    for (x, y) in pairs::<BlockQ4K, BlockQ8K>(n, w, a) {
        let mut aux8 = [0i8; QK_K];
        for (q4, a) in x.qs.chunks_exact(32).zip(aux8.chunks_exact_mut(64)) {
            for l in 0..32 {
                a[l] = (q4[l] & 0xF) as i8;
                a[l + 32] = (q4[l] >> 4) as i8;
            }
        }
        let sm: [(u8, u8); 8] = std::array::from_fn(|j| get_scale_min_k4(j, &x.scales));
        let sumi: i32 = (0..16)
            .map(|j| y.bsums[j] as i32 * sm[j / 2].1 as i32)
            .sum();
        let aux32 = lane_sums(&aux8, &y.qs, 32, |g| sm[g].0 as i32);
        add_lanes(&mut sums, x.d.to_f32() * y.d, &aux32);
        let dmin = x.dmin.to_f32() * y.d;
        sumf -= dmin * sumi as f32;
    }
    for s in sums {
        sumf += s;
    }
    sumf
}

/// `ggml_vec_dot_q5_K_q8_K`: as Q4_K with the fifth bit from `qh`.
pub fn vec_dot_q5k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sums = [0f32; 8];
    let mut sumf = 0.0f32;
    for (x, y) in pairs::<BlockQ5K, BlockQ8K>(n, w, a) {
        let mut aux8 = [0i8; QK_K];
        let mut m = 1u8;
        for (q4, a) in x.qs.chunks_exact(32).zip(aux8.chunks_exact_mut(64)) {
            for l in 0..32 {
                a[l] = (q4[l] & 0xF) as i8 + if x.qh[l] & m != 0 { 16 } else { 0 };
            }
            m = m.wrapping_shl(1);
            for l in 0..32 {
                a[l + 32] = (q4[l] >> 4) as i8 + if x.qh[l] & m != 0 { 16 } else { 0 };
            }
            m = m.wrapping_shl(1);
        }
        let sm: [(u8, u8); 8] = std::array::from_fn(|j| get_scale_min_k4(j, &x.scales));
        let sumi: i32 = (0..16)
            .map(|j| y.bsums[j] as i32 * sm[j / 2].1 as i32)
            .sum();
        let aux32 = lane_sums(&aux8, &y.qs, 32, |g| sm[g].0 as i32);
        add_lanes(&mut sums, x.d.to_f32() * y.d, &aux32);
        let dmin = x.dmin.to_f32() * y.d;
        sumf -= dmin * sumi as f32;
    }
    for s in sums {
        sumf += s;
    }
    sumf
}

/// `ggml_vec_dot_q6_K_q8_K`.
pub fn vec_dot_q6k_q8k(n: usize, w: &[u8], a: &[u8]) -> f32 {
    let mut sums = [0f32; 8];
    for (x, y) in pairs::<BlockQ6K, BlockQ8K>(n, w, a) {
        let aux8 = q6k_values(&x);
        let aux32 = lane_sums(&aux8, &y.qs, 16, |g| x.scales[g] as i32);
        add_lanes(&mut sums, x.d.to_f32() * y.d, &aux32);
    }
    let mut sumf = 0.0f32;
    for s in sums {
        sumf += s;
    }
    sumf
}

/// `ggml_vec_dot_f32` (scalar build): f32 products summed in f64.
pub fn vec_dot_f32(n: usize, w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), n * 4);
    assert_eq!(a.len(), n * 4);
    let mut sumf = 0.0f64;
    for (x, y) in w.chunks_exact(4).zip(a.chunks_exact(4)) {
        let x = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
        let y = f32::from_le_bytes([y[0], y[1], y[2], y[3]]);
        sumf += (x * y) as f64;
    }
    sumf as f32
}

/// `ggml_vec_dot_f16` (scalar build): f16 widened to f32, f32 products summed in f64.
pub fn vec_dot_f16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), n * 2);
    assert_eq!(a.len(), n * 2);
    let mut sumf = 0.0f64;
    for (x, y) in w.chunks_exact(2).zip(a.chunks_exact(2)) {
        let x = f16::from_le_bytes([x[0], x[1]]).to_f32();
        let y = f16::from_le_bytes([y[0], y[1]]).to_f32();
        sumf += (x * y) as f64;
    }
    sumf as f32
}

/// `ggml_vec_dot_bf16` (scalar build): bf16 widened to f32, f32 products summed in f64.
pub fn vec_dot_bf16(n: usize, w: &[u8], a: &[u8]) -> f32 {
    assert_eq!(w.len(), n * 2);
    assert_eq!(a.len(), n * 2);
    let mut sumf = 0.0f64;
    for (x, y) in w.chunks_exact(2).zip(a.chunks_exact(2)) {
        let x = bf16::from_le_bytes([x[0], x[1]]).to_f32();
        let y = bf16::from_le_bytes([y[0], y[1]]).to_f32();
        sumf += (x * y) as f64;
    }
    sumf as f32
}
