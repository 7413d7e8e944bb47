//! Tests of the SIMD kernels against the scalar reference (`crate::quant::vec_dot`), of their
//! batch invariance (`tile` row j == `dot` bit for bit), of agreement between every level this CPU
//! has, and of the `INFER_SIMD` dispatch (including a child process that really sets it).

use super::*;
use crate::quant::{
    activation_row_bytes, dequantize_row, quantize_activations, quantize_row, vec_dot_type,
};
use half::f16;

/// Every type with a SIMD kernel, in the priority order of the brief.
const TYPES: [GgmlType; 13] = [
    GgmlType::IQ4NL,
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q5K,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::Q2K,
    GgmlType::Q3K,
];

/// xorshift64* — deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    fn uni(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Weight-like floats: each 32-value group has its own magnitude (1e-3..10), an offset (so the
/// k-quants' mins matter) and the odd outlier.
fn weight_floats(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let scale = 10f32.powf(2.0 * rng.uni() - 1.0);
        let offset = 0.3 * scale * rng.uni();
        for _ in 0..32.min(n - v.len()) {
            let outlier = if rng.next().is_multiple_of(29) {
                4.0
            } else {
                1.0
            };
            v.push(scale * (rng.uni() * outlier + offset));
        }
    }
    v
}

/// Activation-like floats: per 64 values a magnitude in 1e-2..1e1.
fn act_floats(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let scale = 10f32.powf(1.5 * rng.uni() - 0.5);
        for _ in 0..64.min(n - v.len()) {
            v.push(scale * rng.uni());
        }
    }
    v
}

/// Row lengths to test: 1..=16 blocks, plus ragged lengths for the float types.
fn lengths(ty: GgmlType) -> Vec<usize> {
    let bs = ty.block_size();
    let mut v: Vec<usize> = (1..=16).map(|k| k * bs.max(32)).collect();
    if bs == 1 {
        v.extend([1, 7, 31, 33, 63, 100, 257]);
    }
    v
}

/// The activation row of `ty`'s `vec_dot_type` at `bytes`, as f32.
fn dequantize_acts(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let act = vec_dot_type(ty);
    let mut out = vec![0f32; n];
    if act == GgmlType::Q8_1 {
        // 36-byte blocks: d f16, s f16, 32 i8.
        for (blk, o) in bytes.chunks_exact(36).zip(out.chunks_exact_mut(32)) {
            let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            for (q, v) in blk[4..].iter().zip(o.iter_mut()) {
                *v = d * (*q as i8) as f32;
            }
        }
    } else {
        dequantize_row(act, bytes, &mut out).unwrap();
    }
    out
}

/// Σ|w_i · a_i| over the dequantized rows, the scale of the allowed rounding difference.
fn abs_dot(ty: GgmlType, n: usize, w: &[u8], a: &[u8]) -> f64 {
    let mut wf = vec![0f32; n];
    dequantize_row(ty, w, &mut wf).unwrap();
    let af = dequantize_acts(ty, a, n);
    wf.iter()
        .zip(&af)
        .map(|(&x, &y)| (x as f64 * y as f64).abs())
        .sum()
}

fn assert_close(what: &str, got: f32, want: f32, abs: f64) {
    let tol = 1e-5 * abs + 1e-6;
    assert!(
        ((got as f64) - (want as f64)).abs() <= tol,
        "{what}: got {got:e}, want {want:e} (diff {:e}, tolerance {tol:e})",
        (got as f64 - want as f64).abs()
    );
}

/// The SIMD levels this CPU has (never `Scalar`).
fn simd_levels() -> Vec<Level> {
    Level::ALL
        .into_iter()
        .filter(|&l| l != Level::Scalar && l.available())
        .collect()
}

/// A weight row and `rows` activation rows of `n` values, the activations at `stride` bytes
/// (row bytes + 7, so rows start at odd offsets) in one buffer.
struct Case {
    n: usize,
    w: Vec<u8>,
    acts: Vec<u8>,
    row: usize,
    stride: usize,
    rows: usize,
}

impl Case {
    fn new(ty: GgmlType, n: usize, rows: usize, rng: &mut Rng) -> Case {
        Case::from_floats(ty, &weight_floats(rng, n), rows, |_| act_floats(rng, n))
    }

    fn from_floats(
        ty: GgmlType,
        wf: &[f32],
        rows: usize,
        mut act: impl FnMut(usize) -> Vec<f32>,
    ) -> Case {
        let n = wf.len();
        let mut w = Vec::new();
        quantize_row(ty, wf, &mut w).unwrap();
        let row = activation_row_bytes(vec_dot_type(ty), n).unwrap();
        let stride = row + 7;
        let mut acts = vec![0xA5u8; 3 + rows * stride];
        let mut tmp = Vec::new();
        for j in 0..rows {
            quantize_activations(ty, &act(j), &mut tmp).unwrap();
            acts[3 + j * stride..3 + j * stride + row].copy_from_slice(&tmp);
        }
        // Start at offset 3 so that nothing is even 4-byte aligned.
        acts.drain(..3);
        Case {
            n,
            w,
            acts,
            row,
            stride,
            rows,
        }
    }

    fn act(&self, j: usize) -> &[u8] {
        &self.acts[j * self.stride..j * self.stride + self.row]
    }

    /// Checks `k` against the reference for every row, and its tile against its dot for every
    /// tile height 1..=rows.
    fn check(&self, ty: GgmlType, k: &Kernels) {
        let n = self.n;
        let dots: Vec<f32> = (0..self.rows)
            .map(|j| (k.dot)(n, &self.w, self.act(j)))
            .collect();
        for (j, &got) in dots.iter().enumerate() {
            let a = self.act(j);
            let want = crate::quant::vec_dot(ty, n, &self.w, a);
            let what = format!("{} n={n} row {j} vs reference", k.name);
            assert_close(&what, got, want, abs_dot(ty, n, &self.w, a));
        }
        for m in 1..=self.rows {
            let mut out = vec![f32::NAN; m + 1];
            (k.tile)(n, &self.w, &self.acts, self.stride, m, &mut out);
            for j in 0..m {
                assert_eq!(
                    out[j].to_bits(),
                    dots[j].to_bits(),
                    "{} n={n}: tile m={m} row {j} = {} but dot = {}",
                    k.name,
                    out[j],
                    dots[j]
                );
            }
            assert!(out[m].is_nan(), "{} tile m={m} wrote past m", k.name);
        }
    }
}

#[test]
fn simd_kernels_match_reference_and_tiles_match_dots() {
    let levels = simd_levels();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for ty in TYPES {
        for n in lengths(ty) {
            let case = Case::new(ty, n, 13, &mut rng);
            for &level in &levels {
                let k = kernels_at(level, ty).expect("every listed type has a kernel");
                case.check(ty, &k);
            }
            // The reference in kernel shape obeys the same contract.
            case.check(ty, &reference(ty).unwrap());
        }
    }
}

/// The Q4_K GEMM-structure kernels: SIMD bit-identical to the scalar twin, close to the
/// reference, tile == dot.
#[test]
fn q4k_gemm_kernels_match_their_scalar_twin() {
    let twin = Kernels {
        dot: q4_k_gemm::dot,
        tile: q4_k_gemm::tile,
        name: "scalar/q4_K-gemm",
    };
    let mut rng = Rng(0xfeed_beef);
    for nb in 1..=16 {
        let case = Case::new(GgmlType::Q4K, 256 * nb, 13, &mut rng);
        case.check(GgmlType::Q4K, &twin);
        for level in simd_levels() {
            let k = q4k_gemm_kernels_at(level).unwrap();
            case.check(GgmlType::Q4K, &k);
            for j in 0..case.rows {
                let (got, want) = (
                    (k.dot)(case.n, &case.w, case.act(j)),
                    (twin.dot)(case.n, &case.w, case.act(j)),
                );
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{} nb={nb} row {j}: {got} vs {want}",
                    k.name
                );
            }
        }
    }
    assert!(q4k_gemm_kernels().name.ends_with("/q4_K-gemm"));
}

#[test]
fn simd_levels_agree_with_each_other() {
    let mut rng = Rng(0x5151_7a7a_0101_3c3c);
    for ty in TYPES {
        let mut all: Vec<Kernels> = vec![reference(ty).unwrap()];
        all.extend(simd_levels().into_iter().filter_map(|l| kernels_at(l, ty)));
        for n in [ty.block_size().max(32) * 3, ty.block_size().max(32) * 16] {
            let case = Case::new(ty, n, 5, &mut rng);
            for j in 0..case.rows {
                let a = case.act(j);
                let abs = abs_dot(ty, n, &case.w, a);
                for (i, x) in all.iter().enumerate() {
                    for y in &all[i + 1..] {
                        let what = format!("{} vs {} n={n} row {j}", x.name, y.name);
                        assert_close(&what, (x.dot)(n, &case.w, a), (y.dot)(n, &case.w, a), abs);
                    }
                }
            }
        }
    }
}

/// Saturated inputs: weights at their extreme codes (and k-quant scales at their maximum) times
/// activations of ±127 everywhere, where an i16 intermediate would overflow if it could.
#[test]
fn simd_kernels_exact_on_extreme_blocks() {
    let levels = simd_levels();
    let mut rng = Rng(7);
    for ty in TYPES {
        let n = 4 * ty.block_size().max(32);
        let patterns: [fn(usize) -> f32; 3] = [
            |i| if i % 2 == 0 { 1.0 } else { -1.0 },
            |i| if i % 3 == 0 { 4.0 } else { -0.5 },
            |_| 1.0,
        ];
        for p in patterns {
            let wf: Vec<f32> = (0..n).map(p).collect();
            for sign in [1.0f32, -1.0] {
                let case = Case::from_floats(ty, &wf, 3, |j| {
                    (0..n)
                        .map(|i| match j {
                            0 => sign,
                            1 => sign * if (i / 7) % 2 == 0 { 1.0 } else { -1.0 },
                            _ => sign * rng.uni().signum(),
                        })
                        .collect()
                });
                for &level in &levels {
                    case.check(ty, &kernels_at(level, ty).unwrap());
                }
            }
        }
    }
}

#[test]
fn tile_with_no_rows_writes_nothing() {
    for level in simd_levels() {
        let k = kernels_at(level, GgmlType::Q4K).unwrap();
        let case = Case::new(GgmlType::Q4K, 256, 1, &mut Rng(3));
        let mut out = [f32::NAN; 2];
        (k.tile)(256, &case.w, &[], 0, 0, &mut out);
        assert!(out.iter().all(|v| v.is_nan()));
    }
}

#[test]
#[should_panic(expected = "activation rows")]
fn tile_rejects_short_activations() {
    let k = reference(GgmlType::Q8_0).unwrap();
    let k = simd_levels()
        .first()
        .and_then(|&l| kernels_at(l, GgmlType::Q8_0))
        .unwrap_or(k);
    let case = Case::new(GgmlType::Q8_0, 64, 2, &mut Rng(5));
    let mut out = [0f32; 3];
    (k.tile)(64, &case.w, &case.acts, case.stride, 3, &mut out);
}

#[test]
#[should_panic(expected = "weight row")]
fn dot_rejects_wrong_weight_length() {
    let k = simd_levels()
        .first()
        .and_then(|&l| kernels_at(l, GgmlType::Q4K))
        .unwrap_or_else(|| reference(GgmlType::Q4K).unwrap());
    let case = Case::new(GgmlType::Q4K, 512, 1, &mut Rng(9));
    (k.dot)(512, &case.w[..144], case.act(0));
}

#[test]
fn kernels_exist_exactly_for_the_listed_types() {
    for level in simd_levels() {
        for ty in GgmlType::ALL {
            assert_eq!(
                kernels_at(level, ty).is_some(),
                TYPES.contains(&ty),
                "{} at {}",
                ty.name(),
                level.name()
            );
        }
    }
    for ty in GgmlType::ALL {
        assert!(kernels_at(Level::Scalar, ty).is_none());
        assert_eq!(
            reference(ty).is_some(),
            crate::quant::supports_vec_dot(ty),
            "{}",
            ty.name()
        );
    }
}

#[test]
fn select_level_caps_at_detected() {
    use Level::*;
    assert_eq!(select_level(None, Avx2), (Avx2, None));
    assert_eq!(select_level(Some(""), Avx2), (Avx2, None));
    assert_eq!(select_level(Some("auto"), Scalar), (Scalar, None));
    assert_eq!(select_level(Some("scalar"), Avx2), (Scalar, None));
    assert_eq!(select_level(Some(" AVX2 "), Avx2), (Avx2, None));
    assert_eq!(select_level(Some("avx2"), Scalar), (Scalar, None));
    assert_eq!(select_level(Some("avx512"), Avx2), (Avx2, None));
    assert_eq!(select_level(Some("avx512vnni"), Scalar), (Scalar, None));
    assert_eq!(select_level(Some("avx512"), Avx512), (Avx512, None));
    assert_eq!(select_level(Some("avx2"), Avx512), (Avx2, None));
    assert_eq!(select_level(None, Avx512), (Avx512, None));
    let (l, warning) = select_level(Some("sse9"), Avx2);
    assert_eq!(l, Avx2);
    assert!(warning.unwrap().contains("sse9"));
}

/// Runs only in the child process `infer_simd_env_is_honoured` starts (which sets
/// `INFER_SIMD_TEST_EXPECT`): checks what the real, cached dispatch chose.
#[test]
#[ignore = "run by infer_simd_env_is_honoured in a child process"]
fn env_child() {
    let expect = std::env::var("INFER_SIMD_TEST_EXPECT").expect("INFER_SIMD_TEST_EXPECT set");
    assert_eq!(level(), expect);
    let k = kernels(GgmlType::Q4K);
    if expect == "scalar" {
        assert!(k.is_none());
    } else {
        // The kernel's own level: the one in use, or a lower one it falls back on.
        let name = k.unwrap().name;
        let own = name.split('/').next().unwrap();
        assert!(
            Level::ALL
                .iter()
                .any(|&l| l.name() == own && l != Level::Scalar && l <= current()),
            "{name} at {expect}"
        );
    }
}

/// The levels the test run must have, from `INFER_EXPECT_SIMD` (a comma-separated list of level
/// names; `scripts/test.sh` sets `avx2` unless told otherwise): a CI machine without one fails
/// here instead of quietly ignoring that level's kernel tests. Each must also be what the tests
/// were compiled for (`build.rs`), or its tests were compiled as ignored.
#[test]
fn expected_levels_are_present() {
    let expect = std::env::var("INFER_EXPECT_SIMD").unwrap_or_default();
    for name in expect.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let level = Level::ALL
            .into_iter()
            .find(|l| l.name() == name)
            .unwrap_or_else(|| panic!("INFER_EXPECT_SIMD names {name:?}: not a level"));
        assert!(
            level.available(),
            "INFER_EXPECT_SIMD expects {name}, which this CPU lacks"
        );
        let compiled = match level {
            Level::Scalar => true,
            Level::Avx2 => cfg!(infer_host_avx2),
            Level::Avx512 => cfg!(infer_host_avx512),
        };
        assert!(
            compiled,
            "the tests were built without the {name} level's tests"
        );
        assert!(current() >= level, "INFER_SIMD caps the level below {name}");
    }
}

#[test]
fn infer_simd_env_is_honoured() {
    let exe = std::env::current_exe().unwrap();
    let best = detect().name();
    for (env, expect) in [
        ("scalar", "scalar"),
        ("avx2", detect().min(Level::Avx2).name()),
        ("avx512", best),
        ("", best),
    ] {
        let out = std::process::Command::new(&exe)
            .args([
                "--exact",
                "kernels::cpu::simd::tests::env_child",
                "--ignored",
                "--test-threads=1",
            ])
            .env("INFER_SIMD", env)
            .env("INFER_SIMD_TEST_EXPECT", expect)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "INFER_SIMD={env:?} expecting {expect}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn dot_rows_equals_dot_bit_for_bit() {
    let mut rng = Rng(0x05ee_dd07);
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q6K] {
        let (Some(rows_fn), Some(k)) = (dot_rows(ty), kernels(ty)) else {
            continue;
        };
        // An even and an odd block count of 32-value blocks (the AVX-512 kernels take those in
        // pairs); Q6_K rows are whole 256-value blocks.
        let ns: &[usize] = if ty == GgmlType::Q6K {
            &[768]
        } else {
            &[768, 800]
        };
        for &n in ns {
            let mut w = Vec::new();
            let mut tmp = Vec::new();
            for _ in 0..11 {
                quantize_row(ty, &weight_floats(&mut rng, n), &mut tmp).unwrap();
                w.extend_from_slice(&tmp);
            }
            let rb = tmp.len();
            let mut a = Vec::new();
            quantize_activations(ty, &act_floats(&mut rng, n), &mut a).unwrap();
            for r in [1, 3, 4, 5, 8, 11] {
                let mut out = vec![f32::NAN; r];
                rows_fn(n, &w[..r * rb], rb, &a, &mut out);
                for (i, o) in out.iter().enumerate() {
                    let want = (k.dot)(n, &w[i * rb..(i + 1) * rb], &a);
                    assert_eq!(
                        o.to_bits(),
                        want.to_bits(),
                        "{} n={n} r={r} row {i}",
                        ty.name()
                    );
                }
            }
        }
    }
}

/// The four-row decode kernels on raw extreme blocks: Q8_0 weight bytes spanning -128..=127
/// (-128 never comes out of ggml's quantizer, but a file may hold it), Q5_0 with every fifth
/// bit set, clear and mixed, against activation bytes of ±127: bit-identical to the
/// AVX2 dot product, which computes these integers with the sign trick.
#[test]
#[cfg_attr(
    not(infer_host_avx2),
    ignore = "needs AVX2, FMA and F16C, which the CPU that built the tests lacks"
)]
fn dot_rows_exact_on_extreme_raw_blocks() {
    assert!(Level::Avx2.available(), "needs the AVX2 level");
    let avx2 = Level::Avx2;
    let f16b = |v: f32| f16::from_f32(v).to_le_bytes();
    let nb = 6; // 192 values
    for ty in [GgmlType::Q8_0, GgmlType::Q5_0] {
        let (Some(rows_fn), Some(k)) = (dot_rows(ty), kernels_at(avx2, ty)) else {
            continue;
        };
        let mut rows: Vec<Vec<u8>> = Vec::new();
        for r in 0..5usize {
            let mut row = Vec::new();
            for b in 0..nb {
                row.extend_from_slice(&f16b(0.03 * (1 + r + b) as f32));
                if ty == GgmlType::Q8_0 {
                    row.extend((0..32).map(|i| match (r + b) % 3 {
                        0 => 0x80u8,                // -128 everywhere
                        1 => 0x7f,                  // 127 everywhere
                        _ => (i * 8 + r * 3) as u8, // a sweep over all codes
                    }));
                } else {
                    let qh: u32 = [0, u32::MAX, 0x5555_aaaa, 0x0f0f_f0f0][(r + b) % 4];
                    row.extend_from_slice(&qh.to_le_bytes());
                    row.extend((0..16).map(|i| [0x00u8, 0xff, 0x0f, 0xf0][(i + r) % 4]));
                }
            }
            rows.push(row);
        }
        let rb = rows[0].len();
        let w: Vec<u8> = rows.concat();
        // Activations come from the Q8_0 quantizer, whose codes are ±127 at most (the sign
        // trick of the AVX2 kernel would negate a -128 to itself).
        for pattern in 0..2 {
            let mut a = Vec::new();
            for b in 0..nb {
                a.extend_from_slice(&f16b(0.5 + b as f32));
                a.extend((0..32).map(|i| match pattern {
                    0 => 127u8,
                    _ => {
                        if (i + b) % 2 == 0 {
                            127
                        } else {
                            0x81 // -127
                        }
                    }
                }));
            }
            let mut out = vec![f32::NAN; rows.len()];
            rows_fn(nb * 32, &w, rb, &a, &mut out);
            for (i, o) in out.iter().enumerate() {
                let want = (k.dot)(nb * 32, &w[i * rb..(i + 1) * rb], &a);
                assert_eq!(
                    o.to_bits(),
                    want.to_bits(),
                    "{} row {i} pattern {pattern}",
                    ty.name()
                );
            }
        }
    }
}
