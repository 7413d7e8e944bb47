//! Model drafts: a second, smaller model on the CPU (`--draft-model`) or the target's own first
//! layers (`--self-draft`), each proposing tokens autoregressively from its own sampling
//! distribution `q` (the target's sampler settings applied to the draft's logits, with its own
//! RNG; one-hot when greedy).
//!
//! Invariants: the draft model keeps its own runner, KV and sequence; before drafting it is
//! brought to the target's history with [`Runner::reuse_prefix`], which rewinds it past any
//! rejected drafts (truncation, no copy) and computes only what it has not seen. A self-draft
//! writes K/V of its layers at the drafted positions of the target's own cache without marking
//! them cached: those layers are the target's, so they hold what the target would write, and
//! the verify forward rewrites them anyway (no second cache).

use anyhow::{bail, Result};

use crate::engine::runner::{Runner, Sequence};
use crate::engine::sampler::{Sampler, SamplerConfig};
use crate::engine::speculative::verify::Dist;
use crate::kernels::cpu::backend::CpuBackend;
use crate::model::Backend;
use crate::tokenizer::{attr, Tokenizer};

/// Drafted tokens and the distributions they were drawn from (`None`: one-hot, i.e. greedy).
#[derive(Clone, Debug, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub q: Option<Vec<Dist>>,
    /// Seconds of one-off work before drafting (the draft model's prefill of the prompt), not
    /// part of the per-token draft cost.
    pub setup_secs: f64,
}

/// A catch-up longer than this many tokens is a prefill (timed as setup).
const PREFILL_TOKENS: usize = 8;

/// The draft's own sampler: the target's settings, a different RNG stream.
pub fn draft_sampler(target: &SamplerConfig) -> Sampler {
    let mut cfg = target.clone();
    cfg.seed ^= 0xd4af_7d4a_f7d4_af7d;
    Sampler::new(cfg)
}

/// Picks the next draft token from `logits`, with its distribution unless greedy.
fn pick(sampler: &mut Sampler, logits: &[f32], history: &[u32], draft: &mut Draft) {
    if sampler.is_greedy() {
        draft.tokens.push(sampler.sample(logits, history));
    } else {
        let dist = sampler.distribution(logits, history);
        draft.tokens.push(sampler.draw(&dist));
        draft.q.get_or_insert_with(Vec::new).push(dist);
    }
}

/// A separate draft model, always on the CPU, with its own KV cache.
pub struct DraftModel {
    pub runner: Runner<CpuBackend>,
    seq: Sequence,
    /// A draft made ahead of time ([`DraftModel::draft_ahead`]) and the history it follows.
    ahead: Option<(Vec<u32>, Draft)>,
    /// How many drafts were served from a draft made ahead.
    pub ahead_used: usize,
}

impl DraftModel {
    pub fn new(runner: Runner<CpuBackend>) -> DraftModel {
        DraftModel {
            runner,
            seq: Sequence::default(),
            ahead: None,
            ahead_used: 0,
        }
    }

    /// Drafts ahead while the target verifies `history` (which ends with the drafted tokens):
    /// the draft's own pick `g` for the token after them, then up to `k` tokens after
    /// `history + g`, kept for the next [`DraftModel::draft`], which uses them if its history is
    /// exactly `history + g` (every draft accepted and the target's next token is `g`). The
    /// kept tokens were drawn from the draft's distributions given that history, so using them
    /// is the same as drafting them then.
    pub fn draft_ahead(
        &mut self,
        history: &[u32],
        k: usize,
        target_vocab: usize,
        sampler: &mut Sampler,
    ) -> Result<()> {
        self.ahead = None;
        let mut d = self.draft(history, k + 1, target_vocab, sampler)?;
        if d.tokens.len() < 2 {
            return Ok(());
        }
        let g = d.tokens.remove(0);
        if let Some(q) = &mut d.q {
            q.remove(0);
        }
        d.setup_secs = 0.0;
        let mut follows = history.to_vec();
        follows.push(g);
        self.ahead = Some((follows, d));
        Ok(())
    }

    /// Drafts up to `k` tokens following `history` (prompt and output so far). Limited by the
    /// draft's context and vocabulary (`target_vocab`: ids the target can score).
    pub fn draft(
        &mut self,
        history: &[u32],
        k: usize,
        target_vocab: usize,
        sampler: &mut Sampler,
    ) -> Result<Draft> {
        let k = k.min(self.runner.n_ctx().saturating_sub(history.len()));
        let mut d = Draft::default();
        if k == 0 {
            return Ok(d);
        }
        if let Some((follows, mut ahead)) = self.ahead.take() {
            if follows == history {
                ahead.tokens.truncate(k);
                if let Some(q) = &mut ahead.q {
                    q.truncate(k);
                }
                self.ahead_used += 1;
                return Ok(ahead);
            }
        }
        self.runner.reuse_prefix(&mut self.seq, history);
        let t = std::time::Instant::now();
        let catchup = self.seq.tokens.len() - self.seq.n_cached;
        let mut logits = self.runner.compute(&mut self.seq)?;
        if catchup > PREFILL_TOKENS {
            d.setup_secs = t.elapsed().as_secs_f64();
        }
        loop {
            pick(sampler, &logits, &self.seq.tokens, &mut d);
            let x = *d.tokens.last().expect("just drafted");
            if x as usize >= target_vocab {
                // A special token the target does not have: it could never be accepted.
                d.tokens.pop();
                if let Some(q) = &mut d.q {
                    q.pop();
                }
                break;
            }
            if d.tokens.len() == k {
                break;
            }
            logits = self.runner.extend(&mut self.seq, &[x])?;
        }
        Ok(d)
    }

    /// Forgets the draft's sequence and any draft made ahead (between generations).
    pub fn reset(&mut self) {
        self.ahead = None;
        self.seq = Sequence::default();
    }
}

/// Self-speculative drafting: up to `k` tokens after `seq.tokens` from the first `layers` layers
/// of the target (see the module invariants). `seq.tokens` ends with uncached tokens (at least the
/// chosen one); on return it is unchanged.
pub fn self_draft<B: Backend>(
    runner: &mut Runner<B>,
    seq: &mut Sequence,
    layers: usize,
    k: usize,
    sampler: &mut Sampler,
) -> Result<Draft> {
    let base = seq.tokens.len();
    let k = k.min(runner.n_ctx().saturating_sub(base));
    let mut d = Draft::default();
    let mut from = seq.n_cached;
    while d.tokens.len() < k {
        let logits = runner.draft_logits(seq, from, layers);
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                seq.tokens.truncate(base);
                return Err(e);
            }
        };
        pick(sampler, &logits, &seq.tokens, &mut d);
        from = seq.tokens.len();
        seq.tokens.push(*d.tokens.last().expect("just drafted"));
    }
    seq.tokens.truncate(base);
    Ok(d)
}

/// Refuses a draft model whose vocabulary is not the target's: every id both have must be the
/// same token, except special (control) tokens; ids only one of them has must be special.
pub fn check_vocab(target: &Tokenizer, draft: &Tokenizer) -> Result<()> {
    let special = |t: &Tokenizer, id: u32| t.token_attr(id) & attr::CONTROL != 0;
    let (nt, nd) = (target.vocab_size(), draft.vocab_size());
    let mut differ = Vec::new();
    for id in 0..nt.max(nd) as u32 {
        let ok = if (id as usize) < nt.min(nd) {
            (special(target, id) && special(draft, id))
                || target.token_text(id) == draft.token_text(id)
        } else if (id as usize) < nt {
            special(target, id)
        } else {
            special(draft, id)
        };
        if !ok {
            differ.push(id);
        }
    }
    if let Some(&first) = differ.first() {
        bail!(
            "the draft model's vocabulary differs from the target's ({} of {} ids, first id {first}: \
             {:?} vs {:?}); a draft model must share the target's tokenizer \
             (e.g. a smaller or requantized model of the same family)",
            differ.len(),
            nt.max(nd),
            target.token_text(first),
            draft.token_text(first)
        );
    }
    Ok(())
}
