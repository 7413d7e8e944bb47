//! The mean square of RMS norm, as ggml computes it (`ggml_compute_forward_rms_norm_f32`: each
//! square rounded to f32, summed into an f64 one element after another, divided by the count and
//! rounded to f32), without waiting on that chain of dependent f64 additions (1536 of them took
//! 850 ns, 190 with the lanes below; a decode step runs two per layer on one thread while the
//! other waits).
//!
//! The squares are summed in eight independent lanes instead. Any order of summing `n`
//! non-negative terms in f64 lands within `γ(n) · S` of the exact sum `S` (`γ(n) ≈ n · 2^-53`), the
//! in-order sum included, so the in-order sum lies in a known interval around the fast one. Both
//! ends of that interval go through the same division and rounding to f32; those are monotone, so
//! when both ends give the same f32 the in-order sum gives it too. Otherwise (an interval that
//! straddles an f32 rounding boundary: 1 of the test's 3,600 random inputs; or a NaN or an
//! infinity) the in-order sum is computed. Invariant: `mean_square` returns exactly what the
//! in-order loop returns, for every input.

/// `(Σ (x_i · x_i) as f64, in order) / n`, rounded to f32 (`n` = `x.len()`, ggml's `ne00`).
pub fn mean_square(x: &[f32]) -> f32 {
    mean_square_fast(x).unwrap_or_else(|| mean_square_in_order(x))
}

/// ggml's loop itself. An empty row (which ggml never normalizes) gives the canonical NaN: its
/// `0 / 0` would take its sign from whether the compiler folded the division or the CPU ran it.
pub fn mean_square_in_order(x: &[f32]) -> f32 {
    if x.is_empty() {
        return f32::NAN;
    }
    let mut sum = 0f64;
    for &v in x {
        sum += (v * v) as f64;
    }
    (sum / x.len() as f64) as f32
}

/// The in-order result where the lane sum decides it, else `None`.
fn mean_square_fast(x: &[f32]) -> Option<f32> {
    let n = x.len();
    if n == 0 {
        return None;
    }
    let mut lanes = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += (v * v) as f64;
        }
    }
    for (l, &v) in lanes.iter_mut().zip(tail) {
        *l += (v * v) as f64;
    }
    let s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
        + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    if !s.is_finite() || n as f64 * f64::EPSILON > 1e-3 {
        return None;
    }
    // Both sums are within γ(n)·S of S, so within 2γ(n)·S ≤ 4n·u·s of each other (u = 2^-53 =
    // EPSILON / 2; n·u tiny); 8u·s more covers the rounding of the bounds themselves.
    let e = (2.0 * n as f64 + 4.0) * f64::EPSILON * s;
    let mean = |sum: f64| (sum / n as f64) as f32;
    let (lo, hi) = (mean((s - e).max(0.0)), mean(s + e));
    (lo.to_bits() == hi.to_bits()).then_some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equals_the_in_order_sum_bit_for_bit() {
        let mut undecided = 0;
        let mut cases = 0;
        for n in [1usize, 7, 8, 64, 640, 1152, 1536, 2048, 4096] {
            for seed in 0..400u32 {
                // Values over many magnitudes, as hidden states have (and exact zeros).
                let x: Vec<f32> = crate::kernels::cpu::test_floats(n, seed)
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| match (i + seed as usize) % 11 {
                        0 => 0.0,
                        1 => v * 1e4,
                        2 => v * 1e-6,
                        _ => v * (1 + seed % 5) as f32,
                    })
                    .collect();
                cases += 1;
                undecided += usize::from(mean_square_fast(&x).is_none());
                let (got, want) = (mean_square(&x), mean_square_in_order(&x));
                assert_eq!(got.to_bits(), want.to_bits(), "n {n} seed {seed}");
            }
        }
        // The fast path decides nearly always (else it would buy nothing).
        assert!(undecided * 100 < cases, "{undecided} of {cases} undecided");
    }

    #[test]
    fn undecidable_and_special_inputs_fall_back() {
        assert_eq!(
            mean_square(&[]).to_bits(),
            mean_square_in_order(&[]).to_bits()
        );
        assert!(mean_square(&[1.0, f32::NAN]).is_nan());
        assert_eq!(mean_square(&[f32::MAX, f32::MAX]), f32::INFINITY);
        assert_eq!(mean_square(&[0.0; 16]), 0.0);
        // A sum whose mean sits exactly on an f32 rounding boundary cannot be decided by an
        // interval around it: 1 + 2^-24 (halfway between two f32s) from f32 squares.
        let x = [1.0f32, 2f32.powi(-12)];
        assert_eq!(mean_square_fast(&x), None);
        assert_eq!(
            mean_square(&x).to_bits(),
            mean_square_in_order(&x).to_bits()
        );
    }
}
