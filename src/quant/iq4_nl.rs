//! IQ4_NL: 4-bit non-linear quantization (ggml type 20). A block is 32 values `d · K[q]`: one f16
//! scale `d` and 32 nibbles `q` that index the fixed table [`KVALUES`] (`kvalues_iq4nl`), whose
//! levels crowd near zero where weights do. Nibble order as Q4_0: byte `j` holds value `j` in its
//! low nibble and value `j + 16` in its high one. Its dot product reads Q8_0 activations.
//!
//! Everything here reproduces ggml bit for bit: `dequantize_row_iq4_nl`, the generic
//! `ggml_vec_dot_iq4_nl_q8_0` (integer sums per half block, `sumf += d_x·d_y · (sumi1 + sumi2)`)
//! and the quantizer `quantize_iq4_nl` → `quantize_row_iq4_nl_impl` with 32-value super-blocks
//! and seven tries each way: a first scale `-max / K[0]`, its least-squares refinement, then the
//! scales `(t + K[0]) / max` for `t` in `-7..=7`, keeping the best `Σwqx² / Σwq²`, and finally
//! every value re-rounded to the nearest level under the chosen scale. Weights are `x²` without
//! an importance matrix, `qw · sqrt(σ² + x²)` with one (σ² twice the block's mean square). All
//! float steps are single operations in ggml's order with no fused multiply-add (ggml-base is
//! built without FMA on x86-64).

use half::f16;

use super::blocks::{iter_blocks, Block, BlockQ8_0, Rd, Wr};
use super::types::QuantType;
use crate::format::GgmlType;

/// Values per block.
pub const QK4_NL: usize = 32;

/// The sixteen levels a nibble indexes (`kvalues_iq4nl`).
pub const KVALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// `block_iq4_nl`: 32 values `d · KVALUES[q]`, q a nibble (low nibbles values 0..16, high 16..32).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockIQ4NL {
    pub d: f16,
    pub qs: [u8; QK4_NL / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIQ4NL>() == 18);

impl Block for BlockIQ4NL {
    const ELEMS: usize = QK4_NL;
    fn read(bytes: &[u8]) -> Self {
        let mut r = Rd::new(bytes, Self::BYTES);
        BlockIQ4NL {
            d: r.f16(),
            qs: r.arr(),
        }
    }
    fn write(&self, out: &mut [u8]) {
        let mut w = Wr::new(out, Self::BYTES);
        w.f16(self.d);
        w.bytes(&self.qs);
    }
}

impl QuantType for BlockIQ4NL {
    const TYPE: GgmlType = GgmlType::IQ4NL;
    const VEC_DOT_TYPE: GgmlType = GgmlType::Q8_0;
    /// `LLAMA_FTYPE_MOSTLY_IQ4_NL`.
    const FILE_TYPE: u32 = 25;
    const WEIGHTED: bool = true;

    fn dequantize(src: &[u8], dst: &mut [f32]) {
        assert_eq!(
            src.len() / Self::BYTES * QK4_NL,
            dst.len(),
            "blocks and values"
        );
        for (b, y) in iter_blocks::<Self>(src).zip(dst.chunks_exact_mut(QK4_NL)) {
            let d = b.d.to_f32();
            for (j, &q) in b.qs.iter().enumerate() {
                y[j] = d * KVALUES[(q & 0x0F) as usize] as f32;
                y[j + 16] = d * KVALUES[(q >> 4) as usize] as f32;
            }
        }
    }

    fn quantize(src: &[f32], dst: &mut [u8]) {
        quantize(src, None, dst)
    }

    fn quantize_weighted(src: &[f32], qw: &[f32], dst: &mut [u8]) {
        quantize(src, Some(qw), dst)
    }

    fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        assert!(n.is_multiple_of(QK4_NL), "{n} values is not whole blocks");
        let nb = n / QK4_NL;
        assert_eq!(
            (w.len(), a.len()),
            (nb * Self::BYTES, nb * BlockQ8_0::BYTES)
        );
        let mut sumf = 0f32;
        for (x, y) in iter_blocks::<Self>(w).zip(iter_blocks::<BlockQ8_0>(a)) {
            let d = y.d.to_f32() * x.d.to_f32();
            let (mut sumi1, mut sumi2) = (0i32, 0i32);
            for (j, &q) in x.qs.iter().enumerate() {
                sumi1 += y.qs[j] as i32 * KVALUES[(q & 0x0F) as usize] as i32;
                sumi2 += y.qs[j + 16] as i32 * KVALUES[(q >> 4) as usize] as i32;
            }
            sumf += d * (sumi1 + sumi2) as f32;
        }
        sumf
    }
}

/// The index of the level nearest `x` (`best_index_int8`): the ends below the first level and
/// above the last, else a bisection and the nearer neighbour, ties to the upper one.
fn best_index(x: f32) -> usize {
    let v = |i: usize| KVALUES[i] as f32;
    if x <= v(0) {
        return 0;
    }
    if x >= v(15) {
        return 15;
    }
    let (mut ml, mut mu) = (0, 15);
    while mu - ml > 1 {
        let mav = (ml + mu) / 2;
        if x < v(mav) {
            mu = mav;
        } else {
            ml = mav;
        }
    }
    if x - v(mu - 1) < v(mu) - x {
        mu - 1
    } else {
        mu
    }
}

/// `quantize_iq4_nl` for one row (`src`, whole blocks) into `dst` (exactly its bytes), with an
/// importance per value or without.
fn quantize(src: &[f32], qw: Option<&[f32]>, dst: &mut [u8]) {
    assert!(src.len().is_multiple_of(QK4_NL), "row is not whole blocks");
    let nb = src.len() / QK4_NL;
    assert_eq!(dst.len(), nb * BlockIQ4NL::BYTES, "destination bytes");
    if let Some(qw) = qw {
        assert_eq!(qw.len(), src.len(), "one importance per value");
    }
    for (i, (x, out)) in src
        .chunks_exact(QK4_NL)
        .zip(dst.chunks_exact_mut(BlockIQ4NL::BYTES))
        .enumerate()
    {
        let qw = qw.map(|q| &q[i * QK4_NL..(i + 1) * QK4_NL]);
        quantize_block(x, qw).write(out);
    }
}

/// `quantize_row_iq4_nl_impl` for one 32-value block (`super_block_size == block_size`,
/// `ntry = 7`).
fn quantize_block(x: &[f32], qw: Option<&[f32]>) -> BlockIQ4NL {
    const NTRY: i32 = 7;
    /// ggml's `GROUP_MAX_EPS`.
    const GROUP_MAX_EPS: f32 = 1e-15;
    let mut sigma2 = 0f32;
    for &v in x {
        sigma2 += v * v;
    }
    sigma2 *= 2.0 / QK4_NL as f32;
    let mut weight = [0f32; QK4_NL];
    for (j, w) in weight.iter_mut().enumerate() {
        *w = match qw {
            Some(qw) => qw[j] * (sigma2 + x[j] * x[j]).sqrt(),
            None => x[j] * x[j],
        };
    }
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    let k0 = KVALUES[0] as f32;
    // Σ w·q·x and Σ w·q² of the block rounded at inverse scale `id`.
    let sums = |id: f32| {
        let (mut sumqx, mut sumq2) = (0f32, 0f32);
        for (&v, &w) in x.iter().zip(&weight) {
            let q = KVALUES[best_index(id * v)] as f32;
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let scale = if amax < GROUP_MAX_EPS {
        0.0
    } else {
        let d = -max / k0;
        let (sumqx, sumq2) = sums(1.0 / d);
        // Zero only when every importance is: ggml then keeps a zero scale.
        let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
        let mut best = d * sumqx;
        for itry in -NTRY..=NTRY {
            let id = (itry + KVALUES[0] as i32) as f32 / max;
            let (sumqx, sumq2) = sums(id);
            if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        d
    };
    let id = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut qs = [0u8; QK4_NL / 2];
    for (j, q) in qs.iter_mut().enumerate() {
        *q = best_index(id * x[j]) as u8 | (best_index(id * x[j + 16]) as u8) << 4;
    }
    BlockIQ4NL {
        d: f16::from_f32(scale),
        qs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_index_picks_the_nearest_level() {
        for (i, &k) in KVALUES.iter().enumerate() {
            assert_eq!(best_index(k as f32), i);
        }
        assert_eq!(best_index(-1000.0), 0);
        assert_eq!(best_index(1000.0), 15);
        // Between -10 and 1 the midpoint -4.5 goes up; just below it, down.
        assert_eq!(best_index(-4.5), 8);
        assert_eq!(best_index(-4.6), 7);
        assert_eq!(best_index(0.0), 8);
    }

    /// Every value comes back within half the gap between the levels around it, times `d`.
    #[test]
    fn quantize_then_dequantize_stays_within_a_level() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let mut q = vec![0u8; 8 * 18];
        BlockIQ4NL::quantize(&x, &mut q);
        let mut y = vec![0f32; 256];
        BlockIQ4NL::dequantize(&q, &mut y);
        for (b, (xb, yb)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let d = BlockIQ4NL::read(&q[b * 18..]).d.to_f32().abs();
            for (a, c) in xb.iter().zip(yb) {
                assert!((a - c).abs() <= d * 16.0, "block {b}: {a} vs {c} (d {d})");
            }
        }
    }

    /// With every importance zero the search has nothing to weigh: ggml keeps a zero scale, not
    /// 0/0.
    #[test]
    fn zero_importance_gives_a_zero_scale() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 15.5).collect();
        let mut q = vec![0u8; 18];
        BlockIQ4NL::quantize_weighted(&x, &[0.0; 32], &mut q);
        assert_eq!(BlockIQ4NL::read(&q).d.to_bits(), 0);
    }
}
