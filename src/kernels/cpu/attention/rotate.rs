//! The orthonormal rotation a quantized KV cache applies to each 32-value block before rounding:
//! a Walsh–Hadamard transform with a fixed sign pattern, `T = H·D / √n` on each run of `n` values
//! (`n` a power of two, `D` diagonal ±1, `H` the Sylvester Hadamard matrix; the cache uses
//! `n = 32`, one block, which measured better than the whole head). A channel far larger than its
//! neighbours (Qwen2.5's keys carry some, from the K bias) would set the scale of its block;
//! rotated, its weight is spread evenly over the run, so the block scale follows the block's
//! overall size and the other channels keep their precision. Scores are
//! unchanged by construction: `(Tq)·(Tk) = q·k` for orthonormal `T`, so keys are rotated as they
//! are written and each query once per call; values are rotated as written and the weighted sum,
//! `T·Σ wᵢvᵢ`, is rotated back once per head (`Tᵀ = D·H / √n`, as `H` is symmetric).

/// The sign of value `i` in a run (`D`'s diagonal): the top bit of `i` times the golden ratio's
/// fraction, a fixed pattern that no Walsh function follows.
#[inline(always)]
fn negated(i: usize) -> bool {
    (i as u32).wrapping_mul(0x9E37_79B9) >> 31 == 1
}

/// The unnormalised fast Walsh–Hadamard transform of `x` (`x.len()` a power of two), in place.
fn fwht(x: &mut [f32]) {
    let n = x.len();
    let mut h = 1;
    while h < n {
        for blk in x.chunks_exact_mut(2 * h) {
            let (a, b) = blk.split_at_mut(h);
            for (a, b) in a.iter_mut().zip(b.iter_mut()) {
                let (s, d) = (*a + *b, *a - *b);
                *a = s;
                *b = d;
            }
        }
        h *= 2;
    }
}

/// `x ← T·x` on each run of `n` values of `x` (`n` a power of two dividing `x.len()`).
pub fn rotate(x: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two() && x.len().is_multiple_of(n));
    let scale = 1.0 / (n as f32).sqrt();
    for run in x.chunks_exact_mut(n) {
        for (i, v) in run.iter_mut().enumerate() {
            if negated(i) {
                *v = -*v;
            }
        }
        fwht(run);
        run.iter_mut().for_each(|v| *v *= scale);
    }
}

/// `x ← Tᵀ·x` on each run of `n` values: the inverse of [`rotate`].
pub fn unrotate(x: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two() && x.len().is_multiple_of(n));
    let scale = 1.0 / (n as f32).sqrt();
    for run in x.chunks_exact_mut(n) {
        fwht(run);
        for (i, v) in run.iter_mut().enumerate() {
            *v *= if negated(i) { -scale } else { scale };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::test_floats;

    /// `T`'s columns (the rotations of the unit vectors) are orthonormal, and `unrotate` undoes
    /// `rotate`.
    #[test]
    fn the_rotation_is_orthonormal_and_unrotate_inverts_it() {
        for n in [1usize, 2, 32, 128, 256] {
            let cols: Vec<Vec<f32>> = (0..n)
                .map(|i| {
                    let mut e = vec![0f32; n];
                    e[i] = 1.0;
                    rotate(&mut e, n);
                    e
                })
                .collect();
            for i in 0..n {
                for j in 0..n {
                    let d: f64 = cols[i]
                        .iter()
                        .zip(&cols[j])
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((d - want).abs() < 1e-6, "n {n}: column {i}·{j} = {d}");
                }
            }
            let x = test_floats(3 * n, 5);
            let mut y = x.clone();
            rotate(&mut y, n);
            unrotate(&mut y, n);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "n {n}: {a} {b}");
            }
        }
    }

    /// A lone outlier channel is spread evenly: every rotated value has its size over √n.
    #[test]
    fn an_outlier_is_spread_over_the_run() {
        let mut x = vec![0f32; 128];
        x[37] = 64.0;
        rotate(&mut x, 128);
        for v in &x {
            assert!((v.abs() - 64.0 / 128f32.sqrt()).abs() < 1e-4, "{v}");
        }
    }

    /// Dot products survive: `(Tq)·(Tk) = q·k` up to f32 rounding.
    #[test]
    fn dot_products_are_preserved() {
        for n in [32usize, 128] {
            let (q, k) = (test_floats(2 * n, 8), test_floats(2 * n, 9));
            let (mut qr, mut kr) = (q.clone(), k.clone());
            rotate(&mut qr, n);
            rotate(&mut kr, n);
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
            };
            let mag: f64 = q.iter().zip(&k).map(|(&x, &y)| (x * y).abs() as f64).sum();
            assert!((dot(&q, &k) - dot(&qr, &kr)).abs() <= 1e-5 * mag);
        }
    }
}
