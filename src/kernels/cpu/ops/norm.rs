//! RMS norm's arithmetic as ggml does it (`ggml_compute_forward_rms_norm_f32`): the mean square
//! (each square rounded to f32, summed into an f64 one element after another, divided by the count
//! and rounded to f32) and the product `(x · scale) · w`, rounded twice.
//!
//! The mean square is taken without waiting on that chain of dependent f64 additions (1536 of
//! them took 850 ns, 190 with the lanes below; a decode step runs several per layer on one thread
//! while the other waits): the squares are summed in eight independent lanes instead. Any order
//! of summing `n` non-negative terms in f64 lands within `γ(n) · S` of the exact sum `S` (`γ(n) ≈
//! n · 2^-53`), the in-order sum included, so the in-order sum lies in a known interval around
//! the fast one. Both ends of that interval go through the same division and rounding to f32;
//! those are monotone, so when both ends give the same f32 the in-order sum gives it too.
//! Otherwise (an interval that straddles an f32 rounding boundary: 1 of the test's 3,600 random
//! inputs; or a NaN or an infinity) the in-order sum is computed.
//!
//! Invariants: `mean_square` returns exactly what the in-order loop returns, for every input; the
//! AVX-512 forms run the scalar loops' operations lane for lane, so they return the same bits.

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
    let mut lanes = square_lanes(x);
    let tail = x.chunks_exact(8).remainder();
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

/// Lane `l`: `Σ (x_i · x_i) as f64` over the whole groups of eight, `i ≡ l (mod 8)`, in order.
fn square_lanes(x: &[f32]) -> [f64; 8] {
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: the AVX-512 level (AVX-512 F among it) was detected.
        return unsafe { avx512::square_lanes(x) };
    }
    square_lanes_scalar(x)
}

/// [`square_lanes`] one value at a time, the twin the AVX-512 form is held to.
fn square_lanes_scalar(x: &[f32]) -> [f64; 8] {
    let mut lanes = [0f64; 8];
    for c in x.chunks_exact(8) {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += (v * v) as f64;
        }
    }
    lanes
}

/// `y_i = (x_i · scale) · w_i`, RMS norm's product as ggml rounds it (twice).
pub fn scale_into(x: &[f32], scale: f32, w: &[f32], y: &mut [f32]) {
    assert!(
        x.len() == w.len() && y.len() == x.len(),
        "one weight and output per value"
    );
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: the AVX-512 level was detected; x, w and y hold x.len() values each.
        unsafe { avx512::scale(x.as_ptr(), scale, w.as_ptr(), y.as_mut_ptr(), x.len()) };
        return;
    }
    for ((yi, &xi), &wi) in y.iter_mut().zip(x).zip(w) {
        *yi = (xi * scale) * wi;
    }
}

/// [`scale_into`] of `x` into `x` itself.
pub fn scale_in_place(x: &mut [f32], scale: f32, w: &[f32]) {
    assert_eq!(x.len(), w.len(), "one weight per value");
    #[cfg(target_arch = "x86_64")]
    if wide() {
        let p = x.as_mut_ptr();
        // SAFETY: the AVX-512 level was detected; x and w hold x.len() values each, and the
        // kernel reads each value of x before it writes the same value.
        unsafe { avx512::scale(p, scale, w.as_ptr(), p, x.len()) };
        return;
    }
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = (*xi * scale) * wi;
    }
}

/// Whether the AVX-512 forms run. The compiler's SSE2 forms (and a zeroed 4 KiB buffer the
/// in-place norm went through) took about 3 cycles a value: Gemma-3 270M's per-head Q and K norms
/// of a layer (1280 values) 1.0-1.4 µs of a decode step's serial work, 0.6-0.7 with these; the
/// decode step, alternated step by step in one process, 0.42% shorter while the probe read 77 GB/s
/// (639 pairs), unchanged (0.9994) while it read 52 (861); Qwen2.5-1.5B's unchanged (1.0012 and
/// 0.9999, 287 and 313 pairs).
#[cfg(target_arch = "x86_64")]
fn wide() -> bool {
    use crate::kernels::cpu::simd::{current, Level};
    current() >= Level::Avx512
}

/// The AVX-512 forms: the same operations lane for lane as the scalar loops, so the same bits.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// [`super::square_lanes`]: each group of eight squared in f32, widened, added to its lanes.
    ///
    /// # Safety
    /// AVX-512 F is available.
    #[target_feature(enable = "avx2,avx512f")]
    pub(super) unsafe fn square_lanes(x: &[f32]) -> [f64; 8] {
        let mut acc = _mm512_setzero_pd();
        for c in x.chunks_exact(8) {
            // SAFETY: c holds eight f32.
            let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
            acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm256_mul_ps(v, v)));
        }
        let mut lanes = [0f64; 8];
        // SAFETY: lanes holds eight f64.
        unsafe { _mm512_storeu_pd(lanes.as_mut_ptr(), acc) };
        lanes
    }

    /// `y_i = (x_i · scale) · w_i` for `i < n`, sixteen at a time; `y` may be `x`.
    ///
    /// # Safety
    /// AVX-512 F is available; `x`, `w` and `y` point at `n` values each (`y` at writable ones).
    #[target_feature(enable = "avx2,avx512f")]
    pub(super) unsafe fn scale(x: *const f32, scale: f32, w: *const f32, y: *mut f32, n: usize) {
        let s = _mm512_set1_ps(scale);
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n, inside all three rows; each lane is read before it is stored.
            unsafe {
                let v = _mm512_mul_ps(
                    _mm512_mul_ps(_mm512_loadu_ps(x.add(i)), s),
                    _mm512_loadu_ps(w.add(i)),
                );
                _mm512_storeu_ps(y.add(i), v);
            }
            i += 16;
        }
        while i < n {
            // SAFETY: i < n.
            unsafe { *y.add(i) = (*x.add(i) * scale) * *w.add(i) };
            i += 1;
        }
    }
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
    fn wide_forms_match_their_scalar_twins_bit_for_bit() {
        for n in [0usize, 1, 7, 8, 15, 16, 17, 256, 640, 1000, 1536] {
            let x: Vec<f32> = crate::kernels::cpu::test_floats(n, n as u32)
                .iter()
                .enumerate()
                .map(|(i, &v)| if i % 7 == 0 { v * 1e5 } else { v })
                .collect();
            let w = crate::kernels::cpu::test_floats(n, 7 + n as u32);
            assert_eq!(
                square_lanes(&x).map(f64::to_bits),
                square_lanes_scalar(&x).map(f64::to_bits),
                "lanes, n {n}"
            );
            let scale = 0.37f32;
            let want: Vec<u32> = x
                .iter()
                .zip(&w)
                .map(|(&a, &b)| ((a * scale) * b).to_bits())
                .collect();
            let mut y = vec![0f32; n];
            scale_into(&x, scale, &w, &mut y);
            assert_eq!(
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want,
                "into, n {n}"
            );
            let mut z = x.clone();
            scale_in_place(&mut z, scale, &w);
            assert_eq!(
                z.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want,
                "in place, n {n}"
            );
        }
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
