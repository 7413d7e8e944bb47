//! The standard speculative acceptance rule (Leviathan et al. 2023; Chen et al. 2023). For each
//! drafted token `x` proposed from the draft distribution `q`, with `p` the distribution the
//! target's sampler draws from at that position (after penalties, top-k/top-p/min-p and
//! temperature: [`Sampler::distribution`]): keep `x` with probability `min(1, p(x)/q(x))`; at the
//! first rejection output a draw from `normalise(max(p − q, 0))` and stop. If every draft is kept
//! the caller samples the bonus token from the target's last row. Each output token is then
//! distributed exactly as `p`.
//!
//! A deterministic draft (prompt lookup, a greedy draft model) has a one-hot `q`: the rule becomes
//! "keep `x` with probability `p(x)`, else draw from `p` without `x`", which is exactly "draw
//! `y ~ p` with the sampler and keep `x` iff `y == x`, else output `y`". That form is used for
//! one-hot drafts: it spends the sampler's RNG exactly as plain decoding does, so a seeded run
//! with such a draft gives plain decoding's tokens, and greedy is the special case `p` one-hot.

use crate::engine::sampler::Sampler;

/// A draft distribution as `(id, prob)` pairs (any order; ids absent have probability 0).
pub type Dist = Vec<(u32, f32)>;

/// The outcome of verifying one draft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// How many drafted tokens were kept (a prefix of the draft).
    pub accepted: usize,
    /// The token output at the first rejected position (`None` if all were kept).
    pub rejected_with: Option<u32>,
}

/// `d(id)` in a distribution sorted by id.
fn prob(d: &[(u32, f32)], id: u32) -> f32 {
    d.binary_search_by_key(&id, |e| e.0).map_or(0.0, |i| d[i].1)
}

/// Verifies `drafts` against the target rows. `rows[i]` are the target logits for the position of
/// `drafts[i]`, i.e. after `history[..base + i]`, where `history[base..]` begins with the drafts
/// (the penalty window of the sampler sees the drafts before each position). `q[i]` is the
/// distribution `drafts[i]` was drawn from; `None` means one-hot drafts.
pub fn verify(
    sampler: &mut Sampler,
    history: &[u32],
    base: usize,
    rows: &[Vec<f32>],
    drafts: &[u32],
    q: Option<&[Dist]>,
) -> Verdict {
    assert!(rows.len() >= drafts.len(), "a target row per drafted token");
    assert!(history.len() >= base + drafts.len().saturating_sub(1));
    for (i, &x) in drafts.iter().enumerate() {
        let h = &history[..base + i];
        let out = match q {
            None => {
                let y = sampler.sample(&rows[i], h);
                (y != x).then_some(y)
            }
            Some(q) => {
                let p = sampler.distribution(&rows[i], h);
                let mut qi = q[i].clone();
                qi.sort_unstable_by_key(|e| e.0);
                let px = p.iter().find(|e| e.0 == x).map_or(0.0, |e| e.1);
                let qx = prob(&qi, x);
                // u < p/q, written without dividing (q(x) > 0 as x was drawn from q).
                if sampler.uniform() * f64::from(qx) < f64::from(px) {
                    None
                } else {
                    let residual: Dist = p
                        .iter()
                        .map(|&(id, pi)| (id, (pi - prob(&qi, id)).max(0.0)))
                        .filter(|e| e.1 > 0.0)
                        .collect();
                    Some(if residual.is_empty() {
                        // p == q up to rounding: the residual is undefined, p is the limit.
                        sampler.draw(&p)
                    } else {
                        sampler.draw(&residual)
                    })
                }
            }
        };
        if let Some(y) = out {
            return Verdict {
                accepted: i,
                rejected_with: Some(y),
            };
        }
    }
    Verdict {
        accepted: drafts.len(),
        rejected_with: None,
    }
}
