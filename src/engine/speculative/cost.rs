//! Cost-based draft length: running measurements of what a target forward over `n` rows costs,
//! what one drafted token costs, and how often drafts are accepted, and the draft length `k`
//! that maximises expected tokens per second under them.
//!
//! Model: the `i`th drafted token is accepted with probability `a_i` given its predecessors were,
//! estimated per position (drafts are bursty: a lookup that copies a passage is either wrong at
//! once or right for long, which one overall rate would miss; a position seldom tried leans on
//! the one before it), so a step drafting `k` yields `1 + a_1 + a_1 a_2 + … + a_1…a_k` tokens on
//! average, at the cost of `k` draft tokens plus one target forward over `k + 1` rows. The forward cost is a
//! least-squares line through the measured row counts (means that decay toward recent values),
//! extrapolated to unmeasured ones. Until two different row counts are measured there is no
//! line, and no choice is made (the caller's adaptive length rules alone). Length 0 means plain
//! decoding is expected to be faster than any draft.

/// Weight of a new measurement in the running means.
const NEW: f64 = 0.3;
/// Decay of the acceptance counts per step (recent behaviour dominates).
const DECAY: f64 = 0.95;

#[derive(Clone, Debug, Default)]
pub struct CostModel {
    /// Mean seconds of a target forward over `n` rows, at index `n`.
    forward: Vec<Option<f64>>,
    /// Mean seconds per drafted token.
    draft: Option<f64>,
    /// Decayed counts of accepted drafts and of draft positions tried (accepted or the rejected).
    accepted: f64,
    tried: f64,
    /// The same counts per draft position.
    accepted_at: Vec<f64>,
    tried_at: Vec<f64>,
}

/// Weight (in tries) of the previous position's rate in a position's estimate.
const PRIOR: f64 = 2.0;

fn mix(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| o + NEW * (new - o))
}

impl CostModel {
    /// A target forward over `rows` rows took `secs`.
    pub fn record_forward(&mut self, rows: usize, secs: f64) {
        if self.forward.len() <= rows {
            self.forward.resize(rows + 1, None);
        }
        self.forward[rows] = Some(mix(self.forward[rows], secs));
    }

    /// Drafting `tokens` tokens took `secs`.
    pub fn record_draft(&mut self, tokens: usize, secs: f64) {
        if tokens > 0 {
            self.draft = Some(mix(self.draft, secs / tokens as f64));
        }
    }

    /// A verification kept `accepted` of `drafted` tokens.
    pub fn record_verdict(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let tried = accepted + usize::from(accepted < drafted);
        self.accepted = self.accepted * DECAY + accepted as f64;
        self.tried = self.tried * DECAY + tried as f64;
        if self.tried_at.len() < drafted {
            self.tried_at.resize(drafted, 0.0);
            self.accepted_at.resize(drafted, 0.0);
        }
        for i in 0..self.tried_at.len() {
            self.tried_at[i] = self.tried_at[i] * DECAY + f64::from(u8::from(i < tried));
            self.accepted_at[i] = self.accepted_at[i] * DECAY + f64::from(u8::from(i < accepted));
        }
    }

    /// Estimated acceptance probability of draft position `i` (0-based) given the earlier ones
    /// were accepted, for `i < max`.
    fn acceptance_at(&self, max: usize) -> Option<Vec<f64>> {
        let mut prev = self.acceptance()?;
        let mut out = Vec::with_capacity(max);
        for i in 0..max {
            let (acc, tried) = (
                self.accepted_at.get(i).copied().unwrap_or(0.0),
                self.tried_at.get(i).copied().unwrap_or(0.0),
            );
            prev = (acc + PRIOR * prev) / (tried + PRIOR);
            out.push(prev);
        }
        Some(out)
    }

    /// Estimated probability that a drafted token is accepted (given its predecessors were).
    pub fn acceptance(&self) -> Option<f64> {
        (self.tried > 0.0).then(|| self.accepted / self.tried)
    }

    /// Estimated seconds of a target forward over `rows` rows (`None` before two row counts are
    /// measured).
    pub fn forward_cost(&self, rows: usize) -> Option<f64> {
        let pts: Vec<(f64, f64)> = self
            .forward
            .iter()
            .enumerate()
            .filter_map(|(n, t)| t.map(|t| (n as f64, t)))
            .collect();
        if pts.len() < 2 {
            return None;
        }
        let m = pts.len() as f64;
        let (sx, sy) = pts.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0, a.1 + p.1));
        let (mx, my) = (sx / m, sy / m);
        let sxx: f64 = pts.iter().map(|p| (p.0 - mx) * (p.0 - mx)).sum();
        let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let slope = (sxy / sxx).max(0.0);
        Some((my + slope * (rows as f64 - mx)).max(1e-9))
    }

    /// The draft length in `0..=max` with the most expected tokens per second (0: a plain step
    /// beats every draft length), or `None` while the measurements do not determine one.
    pub fn best_k(&self, max: usize) -> Option<usize> {
        let a = self.acceptance_at(max)?;
        let draft = self.draft.unwrap_or(0.0);
        let mut best = (1.0 / self.forward_cost(1)?, 0);
        let (mut tokens, mut run) = (1.0, 1.0);
        for k in 1..=max {
            run *= a[k - 1].clamp(0.0, 0.999);
            tokens += run;
            let secs = self.forward_cost(k + 1)? + k as f64 * draft;
            let rate = tokens / secs;
            if rate > best.0 {
                best = (rate, k);
            }
        }
        Some(best.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` verdicts, each drafting `drafted` and keeping `accepted`.
    fn verdicts(c: &mut CostModel, n: usize, drafted: usize, accepted: usize) {
        for _ in 0..n {
            c.record_verdict(drafted, accepted);
        }
    }

    #[test]
    fn picks_the_length_that_maximises_tokens_per_second() {
        let mut c = CostModel::default();
        assert_eq!(c.best_k(8), None);
        // Forward cost 10 ms + 10 ms per extra row: a k-row verify costs k+1 steps.
        for n in [1, 3, 5] {
            c.record_forward(n, 0.010 * n as f64);
        }
        assert!((c.forward_cost(9).unwrap() - 0.090).abs() < 1e-12);
        // Acceptance 0.5 at every position: tokens(k) = 2 - 0.5^k, secs(k) = 0.01 (k + 1): the
        // best draft, k = 1 (1.5 / 0.02 = 75 t/s), loses to plain decoding (100 t/s).
        for _ in 0..100 {
            verdicts(&mut c, 2, 2, 0);
            verdicts(&mut c, 1, 2, 1);
            verdicts(&mut c, 1, 2, 2);
        }
        // (The decay weighs the latest verdicts most, hence the tolerance.)
        assert!((c.acceptance().unwrap() - 0.5).abs() < 0.05);
        let a = c.acceptance_at(2).unwrap();
        assert!(
            (a[0] - 0.5).abs() < 0.05 && (a[1] - 0.5).abs() < 0.05,
            "{a:?}"
        );
        assert_eq!(c.best_k(8), Some(0));
        // With 3 ms per extra row, k = 1 wins (1.5 / 0.013 = 115 t/s; k = 2: 1.75 / 0.016 = 109).
        c.forward = Vec::new();
        c.record_forward(1, 0.010);
        c.record_forward(4, 0.019);
        assert_eq!(c.best_k(8), Some(1));
        // Bursty drafts: the first token is right half the time, and then the whole draft is:
        // long drafts pay at 3 ms per row (k = 8: 5 tokens / 34 ms = 147 t/s).
        let mut c = CostModel::default();
        c.record_forward(1, 0.010);
        c.record_forward(4, 0.019);
        for _ in 0..100 {
            c.record_verdict(8, 8);
            c.record_verdict(8, 0);
        }
        let a = c.acceptance_at(8).unwrap();
        assert!((a[0] - 0.5).abs() < 0.05 && a[7] > 0.99, "{a:?}");
        assert_eq!(c.best_k(8), Some(8));
    }

    #[test]
    fn cheap_verifies_and_costly_drafts() {
        // A nearly free verify (1 ms per extra row) and high acceptance: draft long.
        let mut c = CostModel::default();
        c.record_forward(1, 0.010);
        c.record_forward(2, 0.011);
        for _ in 0..50 {
            c.record_verdict(8, 8);
        }
        c.record_verdict(8, 7);
        assert_eq!(c.best_k(8), Some(8));
        // ...unless each drafted token costs two steps: k = 1 gives 2 tokens per 31 ms, below
        // plain decoding's 1 per 10 ms.
        c.record_draft(4, 0.080);
        assert_eq!(c.best_k(8), Some(0));
        // At half a step per drafted token and near-certain acceptance, long drafts pay again
        // (k = 8: 9 tokens per 58 ms).
        for _ in 0..40 {
            c.record_draft(1, 0.005);
        }
        assert_eq!(c.best_k(8), Some(8));
    }
}
