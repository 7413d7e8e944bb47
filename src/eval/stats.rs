//! The math on logit rows and the running sums of an evaluation.
//!
//! Log-probabilities follow llama.cpp's `llama-perplexity`: the row maximum in f32, the sum of
//! `expf(logit - max)` accumulated in f64, `nll = max + ln(sum) - logit[target]`. The KL divergence
//! is exact over the whole vocabulary, in f64 (llama.cpp stores base log-probabilities as 16-bit
//! values and skips those below e^-16; the difference is far below the standard errors).
//! [`Mean`] keeps `n`, `Σx`, `Σx²` and gives the mean and its standard error
//! `sqrt((E[x²] - E[x]²) / (n - 1))`, the estimate llama.cpp prints after `±`.

/// One logit row reduced to what every score needs: the maximum, `ln Σ exp(l - max)` and the
/// index of the maximum (the first one on ties).
#[derive(Clone, Copy, Debug)]
pub struct LogSumExp {
    pub max: f32,
    pub lse: f64,
    pub argmax: usize,
}

impl LogSumExp {
    pub fn of(row: &[f32]) -> LogSumExp {
        assert!(!row.is_empty(), "empty logit row");
        let mut max = row[0];
        let mut argmax = 0;
        for (i, &l) in row.iter().enumerate().skip(1) {
            if l > max {
                max = l;
                argmax = i;
            }
        }
        let sum: f64 = row.iter().map(|&l| (l - max).exp() as f64).sum();
        LogSumExp {
            max,
            lse: sum.ln(),
            argmax,
        }
    }

    /// `ln p(i)` of the row this was computed from.
    pub fn log_prob(&self, row: &[f32], i: usize) -> f64 {
        (row[i] - self.max) as f64 - self.lse
    }
}

/// Negative log-likelihood of `target` under the softmax of `row`.
pub fn nll(row: &[f32], target: usize) -> f64 {
    -LogSumExp::of(row).log_prob(row, target)
}

/// KL(base ‖ model) = Σ p_base (ln p_base − ln p_model) of two logit rows over the same vocabulary.
pub fn kl_divergence(base: &[f32], model: &[f32]) -> f64 {
    assert_eq!(
        base.len(),
        model.len(),
        "logit rows of different vocabularies"
    );
    let (b, m) = (LogSumExp::of(base), LogSumExp::of(model));
    let mut sum = 0f64;
    for i in 0..base.len() {
        let lb = b.log_prob(base, i);
        sum += lb.exp() * (lb - m.log_prob(model, i));
    }
    sum
}

/// Scores of one predicted token: its NLL under the model and, with a base model, the base's
/// NLL, KL(base ‖ model) and whether both put the same token first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenScore {
    pub nll: f64,
    pub base: Option<BaseScore>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BaseScore {
    pub nll: f64,
    pub kl: f64,
    pub same_top1: bool,
}

/// Scores one row (and its base row).
pub fn score(model: &[f32], base: Option<&[f32]>, target: usize) -> TokenScore {
    let m = LogSumExp::of(model);
    let base = base.map(|b_row| {
        assert_eq!(
            b_row.len(),
            model.len(),
            "logit rows of different vocabularies"
        );
        let b = LogSumExp::of(b_row);
        let mut kl = 0f64;
        for i in 0..model.len() {
            let lb = b.log_prob(b_row, i);
            kl += lb.exp() * (lb - m.log_prob(model, i));
        }
        BaseScore {
            nll: -b.log_prob(b_row, target),
            kl,
            same_top1: b.argmax == m.argmax,
        }
    });
    TokenScore {
        nll: -m.log_prob(model, target),
        base,
    }
}

/// Scores many rows on up to `threads` threads; `rows[i]` predicts `targets[i]`.
pub fn score_rows(
    rows: &[Vec<f32>],
    base: Option<&[Vec<f32>]>,
    targets: &[u32],
    threads: usize,
) -> Vec<TokenScore> {
    assert_eq!(rows.len(), targets.len());
    if let Some(b) = base {
        assert_eq!(b.len(), rows.len());
    }
    let one = |i: usize| score(&rows[i], base.map(|b| &b[i][..]), targets[i] as usize);
    let per = rows.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let parts: Vec<_> = (0..rows.len())
            .step_by(per)
            .map(|lo| {
                s.spawn(move || {
                    (lo..(lo + per).min(rows.len()))
                        .map(one)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().expect("scoring thread panicked"))
            .collect()
    })
}

/// Running mean of a sample and its standard error.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mean {
    pub n: u64,
    sum: f64,
    sum2: f64,
}

impl Mean {
    pub fn add(&mut self, x: f64) {
        self.n += 1;
        self.sum += x;
        self.sum2 += x * x;
    }

    pub fn mean(&self) -> f64 {
        if self.n == 0 {
            f64::NAN
        } else {
            self.sum / self.n as f64
        }
    }

    /// Standard error of the mean (0 with fewer than two values).
    pub fn stderr(&self) -> f64 {
        if self.n < 2 {
            return 0.0;
        }
        let m = self.mean();
        let var = self.sum2 / self.n as f64 - m * m;
        (var.max(0.0) / (self.n - 1) as f64).sqrt()
    }
}

/// The `q`-quantile (0..=1) of `v` by linear interpolation between order statistics, as numpy's
/// default; NaN for an empty sample.
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_minus_log_softmax() {
        // softmax of (1, 2, 3): p(2) = e^3 / (e + e^2 + e^3)
        let row = [1.0f32, 2.0, 3.0];
        let z = 1f64.exp() + 2f64.exp() + 3f64.exp();
        assert!((nll(&row, 2) - (z.ln() - 3.0)).abs() < 1e-6);
        assert!((nll(&row, 0) - (z.ln() - 1.0)).abs() < 1e-6);
    }

    #[test]
    fn kl_of_known_distributions() {
        // base p = (1/2, 1/2) from logits (0, 0); model q = (1/(1+e), e/(1+e)) from (0, 1)
        let (b, m) = ([0.0f32, 0.0], [0.0f32, 1.0]);
        let q0 = 1.0 / (1.0 + 1f64.exp());
        let q1 = 1.0 - q0;
        let want = 0.5 * (0.5f64 / q0).ln() + 0.5 * (0.5f64 / q1).ln();
        assert!((kl_divergence(&b, &m) - want).abs() < 1e-7);
        assert!(kl_divergence(&m, &m).abs() < 1e-12);
        let s = score(&m, Some(&b), 1);
        assert!((s.base.unwrap().kl - want).abs() < 1e-7);
        // base's first maximum is token 0, the model's token 1
        assert!(!s.base.unwrap().same_top1);
        assert!(score(&b, Some(&b), 1).base.unwrap().same_top1);
    }

    #[test]
    fn mean_and_standard_error() {
        let mut m = Mean::default();
        for x in [1.0, 2.0, 3.0, 4.0] {
            m.add(x);
        }
        assert_eq!(m.mean(), 2.5);
        // sample sd = sqrt(5/3), stderr = sd / sqrt(4)
        assert!((m.stderr() - (5.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-12);
        let mut v = vec![4.0, 1.0, 3.0, 2.0];
        assert_eq!(quantile(&mut v, 0.5), 2.5);
        assert_eq!(quantile(&mut v, 1.0), 4.0);
    }

    #[test]
    fn threaded_scores_equal_serial() {
        let rows: Vec<Vec<f32>> = (0..7)
            .map(|r| (0..5).map(|i| ((r * 5 + i) as f32 * 0.37).sin()).collect())
            .collect();
        let base: Vec<Vec<f32>> = rows
            .iter()
            .map(|r| r.iter().map(|x| x * 1.5).collect())
            .collect();
        let targets = [0, 1, 2, 3, 4, 0, 1];
        let serial: Vec<_> = (0..7)
            .map(|i| score(&rows[i], Some(&base[i]), targets[i] as usize))
            .collect();
        assert_eq!(score_rows(&rows, Some(&base), &targets, 3), serial);
    }
}
