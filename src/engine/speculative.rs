//! Speculative decoding: a drafter proposes tokens, the target verifies them all in one forward,
//! the standard acceptance rule ([`verify`]) keeps a prefix, and the sequence is rewound past the
//! rest. Drafters: prompt lookup ([`lookup`], no model), a separate CPU draft model and the
//! target's own first layers ([`draft`]). The draft length adapts (grows by two on full
//! acceptance, drops to what was accepted plus one otherwise) and is capped by the cost model
//! ([`cost`]) once it has measurements.
//!
//! Invariants: verification runs with row-invariant numerics (`Backend::set_row_invariant`), so
//! every verified row's logits are bit-identical to a one-token step's; with a greedy sampler the
//! output is therefore exactly plain decoding's, whatever the drafter. Rollback is truncation
//! (`Runner::truncate`), no KV is copied.

pub mod cost;
pub mod draft;
pub mod lookup;
pub mod verify;

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::Result;

use crate::engine::constraint::Constraint;
use crate::engine::runner::{Runner, Sequence};
use crate::engine::sampler::Sampler;
use crate::model::Backend;
use cost::CostModel;
pub use draft::{check_vocab, DraftModel};
use draft::{draft_sampler, self_draft, Draft};
pub use lookup::PromptLookup;

/// The draft length after a verdict: two longer when all `drafted` tokens were kept, else what was
/// kept plus one, within `1..=max`.
pub fn next_draft_len(k: usize, drafted: usize, accepted: usize, max: usize) -> usize {
    if accepted == drafted {
        (k + 2).min(max)
    } else {
        (accepted + 1).clamp(1, max)
    }
}

/// While plain decoding is cheaper, one step in this many still drafts (see `next_k`).
pub const EXPLORE: usize = 16;

/// Counters over a generation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Tokens proposed by the drafter.
    pub drafted: usize,
    /// Proposed tokens the target model agreed with.
    pub accepted: usize,
    /// Forward passes over the target model made to decode (verifications and plain steps).
    pub forwards: usize,
    /// Tokens those forwards produced (each forward yields its accepted drafts plus one).
    pub produced: usize,
    /// Seconds spent drafting.
    pub draft_secs: f64,
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

/// Where drafts come from.
pub enum Method {
    /// `--lookup N`: n-grams of the prompt and output.
    Lookup(PromptLookup),
    /// `--draft-model FILE`: a second model on the CPU.
    Model(Box<DraftModel>),
    /// `--self-draft LAYERS`: the target's first layers, final norm and head.
    SelfDraft { layers: usize },
}

impl Method {
    pub fn name(&self) -> &'static str {
        match self {
            Method::Lookup(_) => "lookup",
            Method::Model(_) => "draft-model",
            Method::SelfDraft { .. } => "self-draft",
        }
    }
}

/// A drafter with its adaptive draft length, cost model and counters.
pub struct Speculator {
    pub method: Method,
    /// Most tokens drafted per step.
    pub draft_max: usize,
    /// Cap the draft length by the cost model (on by default).
    pub cost_based: bool,
    /// With a draft model: draft the next step's tokens on another thread while the target
    /// verifies (`DraftModel::draft_ahead`). Pays when the target runs elsewhere (a GPU); on
    /// the CPU the two compete for the same cores. Off by default.
    pub overlap: bool,
    /// Current adaptive draft length.
    k: usize,
    pub stats: SpecStats,
    pub cost: CostModel,
    /// The draft model's sampler (created from the target's settings at the first step).
    sampler: Option<Sampler>,
}

impl Speculator {
    pub fn new(method: Method, draft_max: usize) -> Speculator {
        let draft_max = draft_max.max(1);
        Speculator {
            method,
            draft_max,
            cost_based: true,
            overlap: false,
            k: draft_max.min(4),
            stats: SpecStats::default(),
            cost: CostModel::default(),
            sampler: None,
        }
    }

    /// Prompt lookup over n-grams of up to `ngram_max` tokens.
    pub fn lookup(ngram_max: usize, draft_max: usize) -> Speculator {
        Speculator::new(Method::Lookup(PromptLookup::new(ngram_max)), draft_max)
    }

    /// The draft length the next step asks for: the cost model's best length once it has the
    /// measurements (its per-position acceptance already knows that a draft which just failed
    /// early tends to fail early again, and that a copy which held tends to hold, so it needs no
    /// slow regrowth after a rejection), else the acceptance-adapted length. When the cost model
    /// finds plain decoding faster than any draft it is 0, except on every [`EXPLORE`]th step,
    /// which drafts one token to keep the measurements current.
    pub fn next_k(&self) -> usize {
        match self.cost.best_k(self.draft_max) {
            Some(0) if self.cost_based && !self.stats.forwards.is_multiple_of(EXPLORE) => 0,
            Some(best) if self.cost_based => best.max(1),
            _ => self.k,
        }
    }

    /// One decoding step. `seq.tokens` ends with the token just chosen, not yet computed. Drafts
    /// at most `room` tokens after it, verifies them in one row-invariant forward and keeps what
    /// the rule accepts, drawing with `sampler` (the target's own).
    ///
    /// Returns the logits after the chosen token, each accepted draft token with the logits after
    /// it, and the token output at the first rejection (`None` if every draft was accepted). The
    /// sequence keeps the chosen token and the accepted drafts, all cached.
    pub fn step<B: Backend>(
        &mut self,
        runner: &mut Runner<B>,
        seq: &mut Sequence,
        room: usize,
        sampler: &mut Sampler,
        mut constraint: Option<&mut Constraint>,
    ) -> Result<Step> {
        let max = self
            .next_k()
            .min(room)
            .min(runner.n_ctx().saturating_sub(seq.tokens.len()));
        let t0 = Instant::now();
        let draft = if max == 0 {
            Draft::default()
        } else {
            let ds = self
                .sampler
                .get_or_insert_with(|| draft_sampler(sampler.config()));
            match &mut self.method {
                Method::Lookup(l) => Draft {
                    tokens: l.draft(&seq.tokens, max),
                    ..Draft::default()
                },
                Method::Model(m) => m.draft(&seq.tokens, max, runner.vocab_size(), ds)?,
                Method::SelfDraft { layers } => self_draft(runner, seq, *layers, max, ds)?,
            }
        };
        let mut draft = draft;
        if let Some(c) = constraint.as_deref_mut() {
            // Only drafts the constraint accepts are worth verifying.
            let keep = c.accepted_prefix(&draft.tokens);
            draft.tokens.truncate(keep);
            if let Some(q) = &mut draft.q {
                q.truncate(keep);
            }
        }
        let draft_secs = t0.elapsed().as_secs_f64();
        self.stats.draft_secs += draft_secs;
        self.cost
            .record_draft(draft.tokens.len(), draft_secs - draft.setup_secs);
        self.stats.forwards += 1;
        let n = draft.tokens.len();
        if n == 0 {
            self.stats.produced += 1;
            let t = Instant::now();
            let logits = runner.compute(seq)?;
            self.cost.record_forward(1, t.elapsed().as_secs_f64());
            return Ok(Step {
                logits,
                accepted: VecDeque::new(),
                rejected_with: None,
            });
        }
        let base = seq.tokens.len(); // the chosen token is at base - 1
        seq.tokens.extend_from_slice(&draft.tokens);
        let t = Instant::now();
        runner.model.backend.set_row_invariant(true);
        let rows = match (&mut self.method, self.overlap) {
            (Method::Model(m), true) => {
                // The draft model drafts ahead on its own thread while the target verifies.
                let (history, vocab) = (seq.tokens.clone(), runner.vocab_size());
                let ds = self
                    .sampler
                    .as_mut()
                    .expect("the draft sampler exists once a draft was made");
                std::thread::scope(|s| {
                    let ahead = s.spawn(|| m.draft_ahead(&history, n, vocab, ds));
                    let rows = runner.compute_all(seq);
                    // A failed draft-ahead (an error) only means the next step drafts as usual;
                    // a panic there is a bug and carries on here.
                    if let Err(panic) = ahead.join() {
                        std::panic::resume_unwind(panic);
                    }
                    rows
                })
            }
            _ => runner.compute_all(seq),
        };
        runner.model.backend.set_row_invariant(false);
        let mut rows = rows?;
        self.cost
            .record_forward(rows.len(), t.elapsed().as_secs_f64());
        // The chosen token's row and one per draft (earlier uncached tokens, if any, go first).
        let mut rows = rows.split_off(rows.len() - (n + 1));
        if let Some(c) = constraint {
            // Each row is verified against the distribution the constraint leaves there.
            c.mask_rows(&draft.tokens, &mut rows, room)?;
        }
        let v = verify::verify(
            sampler,
            &seq.tokens,
            base,
            &rows,
            &draft.tokens,
            draft.q.as_deref(),
        );
        let accepted = v.accepted;
        runner.truncate(seq, base + accepted);
        self.stats.drafted += n;
        self.stats.accepted += accepted;
        // The token after the accepted drafts is output only if there is room left for it.
        self.stats.produced += accepted + usize::from(accepted < room);
        self.cost.record_verdict(n, accepted);
        self.k = next_draft_len(self.k, n, accepted, self.draft_max);
        rows.truncate(accepted + 1);
        let mut rows = rows.into_iter();
        let first = rows.next().expect("the chosen token's row");
        let queue = draft.tokens[..accepted].iter().copied().zip(rows).collect();
        Ok(Step {
            logits: first,
            accepted: queue,
            rejected_with: v.rejected_with,
        })
    }
}

/// What [`Speculator::step`] found.
pub struct Step {
    /// Logits after the chosen token.
    pub logits: Vec<f32>,
    /// Accepted draft tokens in order, each with the logits after it.
    pub accepted: VecDeque<(u32, Vec<f32>)>,
    /// The token output at the first rejected draft position.
    pub rejected_with: Option<u32>,
}
