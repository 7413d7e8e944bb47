//! Draft-free speculative decoding by prompt lookup: propose the tokens that followed the most
//! recent earlier occurrence of the sequence's last n-gram, verify them all in one forward, keep
//! the longest prefix the target model agrees with, and rewind the sequence past the rest.
//!
//! Invariants: verification runs with row-invariant numerics (`Backend::set_row_invariant`), so
//! every verified row's logits are bit-identical to a one-token step's; a drafted token is
//! accepted only if the caller's own decision on those logits (the sampler, with the history up to
//! that position) picks it. With a deterministic decision (greedy) the output is therefore exactly
//! plain decoding's. Rollback is truncation (`Runner::truncate`), no KV is copied.

use std::collections::VecDeque;

use anyhow::Result;

use crate::engine::runner::{Runner, Sequence};
use crate::model::Backend;

/// Counters over a generation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Tokens proposed by the lookup.
    pub drafted: usize,
    /// Proposed tokens the target model agreed with.
    pub accepted: usize,
    /// Forward passes over the target model made to decode (verifications and plain steps).
    pub forwards: usize,
    /// Tokens those forwards produced (each forward yields its accepted drafts plus one).
    pub produced: usize,
}

impl SpecStats {
    /// Accepted / drafted (0 when nothing was drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Mean tokens produced per target forward.
    pub fn tokens_per_forward(&self) -> f64 {
        if self.forwards == 0 {
            0.0
        } else {
            self.produced as f64 / self.forwards as f64
        }
    }
}

/// Prompt-lookup drafting with an adaptive draft length.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    /// Longest n-gram matched (shorter ones are tried down to 1).
    pub ngram_max: usize,
    /// Most tokens drafted per step.
    pub draft_max: usize,
    /// Current draft length (grows on full acceptance, shrinks to what was accepted otherwise).
    k: usize,
    pub stats: SpecStats,
}

impl PromptLookup {
    pub fn new(ngram_max: usize, draft_max: usize) -> PromptLookup {
        let draft_max = draft_max.max(1);
        PromptLookup {
            ngram_max: ngram_max.max(1),
            draft_max,
            k: draft_max.min(4),
            stats: SpecStats::default(),
        }
    }

    /// The continuation (at most `max` tokens) of the most recent earlier occurrence of the last
    /// n-gram of `history`, longest n first; empty if no n-gram recurs.
    pub fn draft(&self, history: &[u32], max: usize) -> Vec<u32> {
        let len = history.len();
        for n in (1..=self.ngram_max.min(len.saturating_sub(1))).rev() {
            let tail = &history[len - n..];
            // Occurrences ending before the tail itself, most recent first.
            for start in (0..len - n).rev() {
                if &history[start..start + n] == tail {
                    let from = start + n;
                    let take = max.min(len - from);
                    if take > 0 {
                        return history[from..from + take].to_vec();
                    }
                }
            }
        }
        Vec::new()
    }

    /// One decoding step. `seq.tokens` ends with the token just chosen, not yet computed. Drafts
    /// after it, verifies the draft in one row-invariant forward and keeps the accepted prefix.
    /// `decide(logits, history)` is the caller's choice of the token following `history` (its
    /// sampler): a draft token is accepted when `decide` picks it, and at the first position where
    /// it picks another token, that token is the output there (for a sampler this is the standard
    /// rule with a one-hot draft: `x` is kept with probability `p(x)`, otherwise the output is
    /// drawn from `p` without `x`, so the output distribution is exactly `p`).
    ///
    /// Returns the logits after the chosen token, each accepted draft token with the logits after
    /// it, and the decided token at the first rejection (`None` if every draft was accepted). The
    /// sequence keeps the chosen token and the accepted drafts, all cached.
    pub fn step<B: Backend>(
        &mut self,
        runner: &mut Runner<B>,
        seq: &mut Sequence,
        room: usize,
        mut decide: impl FnMut(&[f32], &[u32]) -> u32,
    ) -> Result<Step> {
        let max = self
            .k
            .min(room)
            .min(runner.n_ctx().saturating_sub(seq.tokens.len()));
        let draft = if max > 0 {
            self.draft(&seq.tokens, max)
        } else {
            Vec::new()
        };
        self.stats.forwards += 1;
        if draft.is_empty() {
            self.stats.produced += 1;
            let logits = runner.compute(seq)?;
            return Ok(Step {
                logits,
                accepted: VecDeque::new(),
                rejected_with: None,
            });
        }
        let base = seq.tokens.len(); // the chosen token is at base - 1
        seq.tokens.extend_from_slice(&draft);
        runner.model.backend.set_row_invariant(true);
        let rows = runner.compute_all(seq);
        runner.model.backend.set_row_invariant(false);
        let mut rows = rows?;
        let mut accepted = 0;
        let mut rejected_with = None;
        while accepted < draft.len() {
            let history = &seq.tokens[..base + accepted];
            let choice = decide(&rows[accepted], history);
            if choice != draft[accepted] {
                rejected_with = Some(choice);
                break;
            }
            accepted += 1;
        }
        runner.truncate(seq, base + accepted);
        self.stats.drafted += draft.len();
        self.stats.accepted += accepted;
        self.stats.produced += accepted + 1;
        self.k = if accepted == draft.len() {
            (self.k + 2).min(self.draft_max)
        } else {
            (accepted + 1).clamp(1, self.draft_max)
        };
        rows.truncate(accepted + 1);
        let mut rows = rows.into_iter();
        let first = rows.next().expect("the chosen token's row");
        let queue = draft[..accepted].iter().copied().zip(rows).collect();
        Ok(Step {
            logits: first,
            accepted: queue,
            rejected_with,
        })
    }
}

/// What [`PromptLookup::step`] found.
pub struct Step {
    /// Logits after the chosen token.
    pub logits: Vec<f32>,
    /// Accepted draft tokens in order, each with the logits after it.
    pub accepted: VecDeque<(u32, Vec<f32>)>,
    /// The caller's decision at the first rejected draft position: the token to output there.
    pub rejected_with: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_continues_the_latest_longest_match() {
        let l = PromptLookup::new(3, 8);
        // "1 2 3 4 5 ... 1 2 3" → continue with "4 5".
        assert_eq!(l.draft(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // The most recent occurrence wins: "7 8" → "1" (second), not "2" (first).
        assert_eq!(l.draft(&[7, 8, 2, 7, 8, 1, 7, 8], 1), vec![1]);
        // Falls back to shorter n-grams; nothing recurs → empty.
        assert_eq!(l.draft(&[5, 6, 9, 6], 3), vec![9, 6]);
        assert!(l.draft(&[1, 2, 3], 4).is_empty());
        assert!(l.draft(&[], 4).is_empty());
    }
}
