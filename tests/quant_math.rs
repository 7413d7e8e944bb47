//! Properties of `quant` that hold for any input: block layouts agree with `format::GgmlType`,
//! block codecs round-trip on unaligned bytes, every dot product equals the dot of the dequantized
//! weights with the f32 activations up to a bound derived from the activation quantization step,
//! Q8_K activations round-trip within half a step, the Q8 rounding variants break ties as ggml's
//! builds do, the weight quantizers reach the accuracy their bit widths allow, and unsupported
//! types are refused by name.

use half::f16;
use infer::format::GgmlType;
use infer::quant::blocks::{
    get_scale_min_k4, iter_blocks, Block, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1,
    BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, QK_K,
};
use infer::quant::iq4_nl::BlockIQ4NL;
use infer::quant::{
    dequantize_row, quantize_activations, quantize_activations_as, quantize_row,
    quantize_row_q8_0_as, quantize_row_q8_1_as, quantize_row_q8_k, supports_vec_dot, vec_dot,
    vec_dot_type, Q8Variant,
};

/// xorshift64* with Box–Muller: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
    /// `n` Gaussian values whose scale changes every 32 values (as real activations' do).
    fn row(&mut self, n: usize, scale: f64) -> Vec<f32> {
        let mut s = scale;
        (0..n)
            .map(|i| {
                if i % 32 == 0 {
                    s = scale * (0.25 + 2.0 * self.uniform());
                }
                (self.normal() * s) as f32
            })
            .collect()
    }
}

/// Every weight type `quant` registers: each has a dot product, a quantizer and a dequantizer,
/// and every property below holds for each (a type added to the registry is checked here without
/// naming it).
fn dot_types() -> Vec<GgmlType> {
    let types: Vec<GgmlType> = infer::quant::types::TYPES.iter().map(|o| o.ty).collect();
    use GgmlType::*;
    for t in [
        F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, IQ4NL,
    ] {
        assert!(types.contains(&t), "{} is registered", t.name());
    }
    types
}

#[test]
fn block_layouts_match_format_types() {
    fn check<B: Block>(t: GgmlType) {
        assert_eq!(B::BYTES, t.type_size(), "{} bytes", t.name());
        assert_eq!(B::ELEMS, t.block_size(), "{} elements", t.name());
    }
    check::<BlockQ4_0>(GgmlType::Q4_0);
    check::<BlockQ4_1>(GgmlType::Q4_1);
    check::<BlockQ5_0>(GgmlType::Q5_0);
    check::<BlockQ5_1>(GgmlType::Q5_1);
    check::<BlockQ8_0>(GgmlType::Q8_0);
    check::<BlockQ2K>(GgmlType::Q2K);
    check::<BlockQ3K>(GgmlType::Q3K);
    check::<BlockQ4K>(GgmlType::Q4K);
    check::<BlockQ5K>(GgmlType::Q5K);
    check::<BlockQ6K>(GgmlType::Q6K);
    check::<BlockQ8K>(GgmlType::Q8K);
    check::<BlockIQ4NL>(GgmlType::IQ4NL);
    // ggml's block_q8_1 is 2 f16 + 32 i8 (gguf-py's size table still lists an older 40-byte layout).
    assert_eq!(BlockQ8_1::BYTES, 36);
    assert_eq!(
        infer::quant::activation_row_bytes(GgmlType::Q8_1, 64).unwrap(),
        72
    );
}

#[test]
fn block_codecs_round_trip_unaligned_bytes() {
    fn check<B: Block>(rng: &mut Rng) {
        // Three blocks starting at an odd offset: nothing may assume alignment.
        let bytes: Vec<u8> = (0..3 * B::BYTES + 1)
            .map(|_| rng.next_u64() as u8)
            .collect();
        let src = &bytes[1..];
        let blocks: Vec<B> = iter_blocks::<B>(src).collect();
        assert_eq!(blocks.len(), 3);
        let mut out = vec![0u8; src.len()];
        for (b, o) in blocks.iter().zip(out.chunks_exact_mut(B::BYTES)) {
            b.write(o);
        }
        assert_eq!(out, src);
        // Reading straight from an offset slice gives the same block (compared by its bytes, as
        // random f16/f32 fields may be NaN).
        let mut again = vec![0u8; B::BYTES];
        B::read(&src[B::BYTES..]).write(&mut again);
        assert_eq!(again, &src[B::BYTES..2 * B::BYTES]);
    }
    let mut rng = Rng(7);
    for _ in 0..20 {
        check::<BlockQ4_0>(&mut rng);
        check::<BlockQ4_1>(&mut rng);
        check::<BlockQ5_0>(&mut rng);
        check::<BlockQ5_1>(&mut rng);
        check::<BlockQ8_0>(&mut rng);
        check::<BlockQ8_1>(&mut rng);
        check::<BlockQ2K>(&mut rng);
        check::<BlockQ3K>(&mut rng);
        check::<BlockQ4K>(&mut rng);
        check::<BlockQ5K>(&mut rng);
        check::<BlockQ6K>(&mut rng);
        check::<BlockQ8K>(&mut rng);
        check::<BlockIQ4NL>(&mut rng);
    }
    // Field order: Q4_K starts with d, dmin; Q6_K ends with d; Q8_K starts with an f32 d.
    let mut raw = [0u8; 292];
    raw[..4].copy_from_slice(&1.5f32.to_le_bytes());
    raw[4] = 0xFF;
    raw[260..262].copy_from_slice(&(-300i16).to_le_bytes());
    let b = BlockQ8K::read(&raw);
    assert_eq!((b.d, b.qs[0], b.bsums[0]), (1.5, -1, -300));
    let mut raw = [0u8; 210];
    raw[208..].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
    assert_eq!(BlockQ6K::read(&raw).d.to_f32(), 0.5);
}

#[test]
fn get_scale_min_k4_unpacks_six_bit_fields() {
    // Pack 8 known (scale, min) pairs the way quantize_row_q4_K_ref does, then unpack.
    let pairs: [(u8, u8); 8] = [
        (0, 63),
        (1, 62),
        (17, 33),
        (63, 0),
        (40, 21),
        (5, 60),
        (32, 31),
        (63, 63),
    ];
    let mut q = [0u8; 12];
    for (j, &(ls, lm)) in pairs.iter().enumerate() {
        if j < 4 {
            q[j] = ls;
            q[j + 4] = lm;
        } else {
            q[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            q[j - 4] |= (ls >> 4) << 6;
            q[j] |= (lm >> 4) << 6;
        }
    }
    for (j, &p) in pairs.iter().enumerate() {
        assert_eq!(get_scale_min_k4(j, &q), p, "sub-block {j}");
    }
}

#[test]
fn vec_dot_types_follow_ggml_cpu() {
    use GgmlType::*;
    for (w, a) in [
        (F32, F32),
        (F16, F16),
        (BF16, BF16),
        (Q4_0, Q8_0),
        (Q5_0, Q8_0),
        (Q8_0, Q8_0),
        (Q4_1, Q8_1),
        (Q5_1, Q8_1),
        (Q2K, Q8K),
        (Q3K, Q8K),
        (Q4K, Q8K),
        (Q5K, Q8K),
        (Q6K, Q8K),
        (IQ4NL, Q8_0),
        (IQ2XXS, Q8K),
    ] {
        assert_eq!(vec_dot_type(w), a, "{}", w.name());
    }
    for t in dot_types() {
        assert!(supports_vec_dot(t));
    }
    assert!(!supports_vec_dot(Q8K) && !supports_vec_dot(IQ2XXS));
}

/// Per-element magnitude of the min a weight type subtracts (0 for symmetric types).
fn weight_mins(t: GgmlType, w: &[u8]) -> Vec<f64> {
    let mut out = Vec::new();
    match t {
        GgmlType::Q4_1 => {
            iter_blocks::<BlockQ4_1>(w).for_each(|b| out.extend([b.m.to_f64().abs(); 32]))
        }
        GgmlType::Q5_1 => {
            iter_blocks::<BlockQ5_1>(w).for_each(|b| out.extend([b.m.to_f64().abs(); 32]))
        }
        GgmlType::Q2K => iter_blocks::<BlockQ2K>(w).for_each(|b| {
            for sc in b.scales {
                out.extend([b.dmin.to_f64().abs() * (sc >> 4) as f64; 16]);
            }
        }),
        GgmlType::Q4K => iter_blocks::<BlockQ4K>(w).for_each(|b| {
            for j in 0..8 {
                out.extend([b.dmin.to_f64().abs() * get_scale_min_k4(j, &b.scales).1 as f64; 32]);
            }
        }),
        GgmlType::Q5K => iter_blocks::<BlockQ5K>(w).for_each(|b| {
            for j in 0..8 {
                out.extend([b.dmin.to_f64().abs() * get_scale_min_k4(j, &b.scales).1 as f64; 32]);
            }
        }),
        _ => {}
    }
    out
}

/// Upper bound on |x_i - dequant(q8(x))_i| for each activation, from the quantization step:
/// half a step `d = amax/127` (f32), plus the change of `d` when it is stored as f16 times |q|,
/// plus the float error of `x * id` (< 2^-14 step). F16/BF16 round to 11/8 significant bits.
fn activation_error_bounds(act_ty: GgmlType, x: &[f32], a: &[u8]) -> Vec<f64> {
    const SLOP: f64 = 1.0 / 16384.0;
    let mut e = Vec::with_capacity(x.len());
    match act_ty {
        GgmlType::F32 => e.resize(x.len(), 0.0),
        GgmlType::F16 => e.extend(
            x.iter()
                .map(|v| (v.abs() as f64 * 2f64.powi(-11)).max(2f64.powi(-25))),
        ),
        GgmlType::BF16 => e.extend(x.iter().map(|v| v.abs() as f64 * 2f64.powi(-8))),
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            for (xb, i) in x.chunks_exact(32).zip(0..) {
                let (d16, qs) = if act_ty == GgmlType::Q8_0 {
                    let b = BlockQ8_0::read(&a[i * 34..]);
                    (b.d.to_f64(), b.qs)
                } else {
                    let b = BlockQ8_1::read(&a[i * 36..]);
                    (b.d.to_f64(), b.qs)
                };
                let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d32 = (amax / 127.0) as f64;
                e.extend(
                    qs.iter()
                        .map(|&q| d32 * (0.5 + SLOP) + (q as f64).abs() * (d16 - d32).abs()),
                );
            }
        }
        GgmlType::Q8K => {
            for b in iter_blocks::<BlockQ8K>(a) {
                e.extend([(b.d as f64).abs() * (0.5 + SLOP); QK_K]);
            }
        }
        other => panic!("not an activation type: {}", other.name()),
    }
    e
}

/// For Q8_1 activations the dot uses the stored `s = fp16(d * sum(q))` for the min term instead of
/// `sum(dequant(q))`: the difference, weighted by the weight block's min, is exact from the bytes.
fn q8_1_sum_term(t: GgmlType, w: &[u8], a: &[u8]) -> f64 {
    let mins = weight_mins(t, w);
    iter_blocks::<BlockQ8_1>(a)
        .enumerate()
        .map(|(i, b)| {
            let sumq: i32 = b.qs.iter().map(|&q| q as i32).sum();
            mins[32 * i] * (b.s.to_f64() - b.d.to_f64() * sumq as f64).abs()
        })
        .sum()
}

#[test]
fn dot_products_are_within_the_activation_quantization_bound() {
    let mut rng = Rng(0x5eed);
    for t in dot_types() {
        for trial in 0..6 {
            let n = if trial % 2 == 0 { 1024 } else { 512 };
            let xw = rng.row(n, 0.05);
            let mut w = Vec::new();
            quantize_row(t, &xw, &mut w).unwrap();
            let mut wd = vec![0f32; n];
            dequantize_row(t, &w, &mut wd).unwrap();
            let scale = 10f64.powf(-2.0 + 3.0 * rng.uniform());
            let x = rng.row(n, scale);
            let exact: f64 = wd.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let abs_sum: f64 = wd
                .iter()
                .zip(&x)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            let mins = weight_mins(t, &w);
            // f32 rounding in ggml's per-block scaling and accumulation (< 2^-19 relative for these
            // sizes), measured against the magnitudes before the min is subtracted.
            let float_slop: f64 = 2f64.powi(-16)
                * (0..n)
                    .map(|i| {
                        (wd[i].abs() as f64 + mins.get(i).copied().unwrap_or(0.0))
                            * x[i].abs() as f64
                    })
                    .sum::<f64>();
            for variant in [Q8Variant::Reference, Q8Variant::X86Avx] {
                let mut a = Vec::new();
                quantize_activations_as(t, &x, &mut a, variant).unwrap();
                let act_ty = vec_dot_type(t);
                let e = activation_error_bounds(act_ty, &x, &a);
                let mut bound: f64 = wd.iter().zip(&e).map(|(&w, &e)| w.abs() as f64 * e).sum();
                if act_ty == GgmlType::Q8_1 {
                    bound += q8_1_sum_term(t, &w, &a);
                }
                bound += float_slop;
                let got = vec_dot(t, n, &w, &a) as f64;
                let err = (got - exact).abs();
                assert!(
                    err <= bound,
                    "{} n={n} {variant:?}: dot {got:e} vs dequantized {exact:e}: error {err:e} > bound {bound:e}",
                    t.name()
                );
                // The bound is tight enough to catch a wrong dot product (errors of O(100%)).
                assert!(
                    bound < 0.05 * abs_sum,
                    "{}: bound {bound:e} vs sum |w x| {abs_sum:e}",
                    t.name()
                );
                assert!(exact.abs() > 0.0);
            }
        }
    }
}

#[test]
fn q8_k_round_trips_within_half_a_step() {
    let mut rng = Rng(42);
    let mut x = rng.row(4 * QK_K, 3.0);
    x[QK_K..2 * QK_K].fill(0.0); // an all-zero block
    x[2 * QK_K + 17] = 1000.0; // a block dominated by one positive outlier
    let mut a = vec![0u8; 4 * BlockQ8K::BYTES];
    quantize_row_q8_k(&x, &mut a);
    let mut back = vec![0f32; x.len()];
    dequantize_row(GgmlType::Q8K, &a, &mut back).unwrap();
    for (i, b) in iter_blocks::<BlockQ8K>(&a).enumerate() {
        let xb = &x[i * QK_K..(i + 1) * QK_K];
        for (j, (s, q)) in b.bsums.iter().zip(b.qs.chunks_exact(16)).enumerate() {
            assert_eq!(
                *s as i32,
                q.iter().map(|&v| v as i32).sum::<i32>(),
                "block {i} bsums[{j}]"
            );
        }
        if i == 1 {
            assert_eq!(b.d, 0.0);
            assert!(b.qs.iter().all(|&q| q == 0) && b.bsums.iter().all(|&s| s == 0));
            continue;
        }
        // The element of largest magnitude maps to -127 and d = -max/127 (ggml's sign convention).
        let (imax, &max) = xb
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
            .unwrap();
        assert_eq!(b.qs[imax], -127, "block {i}");
        assert!(((b.d as f64) * -127.0 - max as f64).abs() <= max.abs() as f64 * 1e-6);
        let half_step = (b.d as f64).abs() * (0.5 + 1.0 / 16384.0);
        for j in 0..QK_K {
            let v = back[i * QK_K + j];
            assert_eq!(v, b.d * b.qs[j] as f32);
            assert!(
                (v as f64 - xb[j] as f64).abs() <= half_step,
                "block {i} element {j}: {v} vs {} (half step {half_step:e})",
                xb[j]
            );
        }
    }
}

#[test]
fn q8_rounding_variants_break_ties_like_ggml_builds() {
    // amax = 127 makes d = 1 and id = 1 exactly, so x * id lands on .5 ties.
    let mut x = [0f32; 32];
    x[..8].copy_from_slice(&[127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 3.5]);
    let qs = |variant| {
        let mut out = [0u8; 34];
        quantize_row_q8_0_as(&x, &mut out, variant);
        let b = BlockQ8_0::read(&out);
        assert_eq!(b.d.to_f32(), 1.0);
        b.qs[..8].to_vec()
    };
    // roundf: ties away from zero.
    assert_eq!(qs(Q8Variant::Reference), [127, 3, -3, 1, -1, 2, -2, 4]);
    // _mm256_round_ps / vcvtnq_s32_f32: ties to even.
    assert_eq!(qs(Q8Variant::X86Avx), [127, 2, -2, 0, 0, 2, -2, 4]);
    assert_eq!(qs(Q8Variant::ArmNeon), [127, 2, -2, 0, 0, 2, -2, 4]);
    // Q8_1 also stores s = fp16(d * sum(q)).
    let mut out = [0u8; 36];
    quantize_row_q8_1_as(&x, &mut out, Q8Variant::Reference);
    let b = BlockQ8_1::read(&out);
    assert_eq!(b.s.to_f32(), 131.0);
    quantize_row_q8_1_as(&x, &mut out, Q8Variant::X86Avx);
    assert_eq!(
        BlockQ8_1::read(&out).s.to_f32(),
        127.0 + 2.0 - 2.0 + 2.0 - 2.0 + 4.0
    );
    // An all-zero block: d = 0, quants 0, s = 0 in every variant.
    for variant in [Q8Variant::Reference, Q8Variant::X86Avx, Q8Variant::ArmNeon] {
        quantize_row_q8_1_as(&[0.0; 32], &mut out, variant);
        assert!(out.iter().all(|&v| v == 0), "{variant:?}");
    }
}

#[test]
fn weight_quantizers_reach_their_expected_accuracy() {
    // Relative RMS error of quantize -> dequantize on Gaussian rows (ggml's reference quantizers,
    // no importance matrix). Each ceiling sits 15-20% above the error measured on this data and
    // below the error of the next-coarser format, so a broken quantizer cannot pass.
    let mut rng = Rng(99);
    let x = rng.row(16 * QK_K, 1.0);
    let power: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum();
    use GgmlType::*;
    for (t, ceiling) in [
        (Q2K, 0.35),
        (Q3K, 0.175),
        (Q4_0, 0.10),
        (IQ4NL, 0.09),
        (Q4_1, 0.092),
        (Q4K, 0.085),
        (Q5_0, 0.05),
        (Q5_1, 0.044),
        (Q5K, 0.042),
        (Q6K, 0.021),
        (Q8_0, 0.0064),
        (BF16, 0.002),
        (F16, 2.5e-4),
        (F32, 0.0),
    ] {
        let mut q = Vec::new();
        quantize_row(t, &x, &mut q).unwrap();
        assert_eq!(q.len(), t.row_bytes(x.len()).unwrap());
        let mut back = vec![0f32; x.len()];
        dequantize_row(t, &q, &mut back).unwrap();
        let err: f64 = x
            .iter()
            .zip(&back)
            .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
            .sum();
        let rel = (err / power).sqrt();
        assert!(
            rel <= ceiling,
            "{}: relative RMS error {rel:.4} > {ceiling}",
            t.name()
        );
        // Zeros stay zeros.
        quantize_row(t, &[0.0; QK_K], &mut q).unwrap();
        let mut z = vec![1f32; QK_K];
        dequantize_row(t, &q, &mut z).unwrap();
        assert!(z.iter().all(|&v| v == 0.0), "{} of zeros", t.name());
    }
}

#[test]
fn unsupported_types_and_bad_lengths_are_refused() {
    let mut out = vec![0f32; 256];
    let err = dequantize_row(GgmlType::IQ2XXS, &[0u8; 66], &mut out).unwrap_err();
    assert!(err.to_string().contains("IQ2_XXS"), "{err}");
    let err = dequantize_row(GgmlType::Q4K, &[0u8; 143], &mut out).unwrap_err();
    assert!(err.to_string().contains("144"), "{err}");
    let err = dequantize_row(GgmlType::Q4_0, &[0u8; 18], &mut out[..31]).unwrap_err();
    assert!(err.to_string().contains("Q4_0"), "{err}");
    let mut bytes = Vec::new();
    let err = quantize_row(GgmlType::IQ4XS, &[0.0; 256], &mut bytes).unwrap_err();
    assert!(err.to_string().contains("IQ4_XS"), "{err}");
    let err = quantize_row(GgmlType::Q6K, &[0.0; 100], &mut bytes).unwrap_err();
    assert!(err.to_string().contains("Q6_K"), "{err}");
    let err = quantize_activations(GgmlType::IQ1S, &[0.0; 256], &mut bytes).unwrap_err();
    assert!(err.to_string().contains("IQ1_S"), "{err}");
    let err = quantize_activations(GgmlType::Q4K, &[0.0; 100], &mut bytes).unwrap_err();
    assert!(err.to_string().contains("Q8_K"), "{err}");
}

#[test]
#[should_panic(expected = "IQ3_S")]
fn vec_dot_panics_for_types_without_a_dot() {
    vec_dot(GgmlType::IQ3S, 256, &[0u8; 110], &[0u8; 292]);
}
