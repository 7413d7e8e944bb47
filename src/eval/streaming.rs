//! Perplexity of a text longer than the context, read through a window that moves, in the two
//! ways a model can do it (StreamingLLM's comparison):
//!
//! - [`streaming`]: one sequence computed once, `step` tokens a forward call; before a call that
//!   would not fit, the oldest blocks after the kept start (the attention sinks) are dropped and
//!   the later keys re-rotated in place ([`Runner::shift`]), never recomputed. With `keep` 0 no
//!   sink is kept: the plain "window attention" the paper shows failing.
//! - [`sliding`]: every `stride` tokens, the `window` tokens ending there are computed from
//!   scratch (BOS first when the model adds one) and the last `stride` are scored: the costly
//!   reference.
//!
//! Both score exactly the tokens from position `window` on, each predicted from the logits of
//! the token before it.

use anyhow::{bail, Result};

use crate::engine::runner::{Runner, Sequence, BLOCK_SIZE};
use crate::eval::stats::{nll, Mean};
use crate::model::Backend;

/// Mean negative log-likelihood and its perplexity over the scored tokens.
#[derive(Clone, Copy, Debug)]
pub struct StreamReport {
    pub nll: f64,
    /// Standard error of `nll`.
    pub nll_err: f64,
    pub ppl: f64,
    pub tokens: usize,
}

fn report(m: &Mean) -> StreamReport {
    StreamReport {
        nll: m.mean(),
        nll_err: m.stderr(),
        ppl: m.mean().exp(),
        tokens: m.n as usize,
    }
}

/// [`streaming`] perplexity: `runner`'s context is the window.
pub fn streaming<B: Backend>(
    runner: &mut Runner<B>,
    tokens: &[u32],
    keep: usize,
    step: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<StreamReport> {
    let window = runner.n_ctx();
    let kept = keep.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    if step == 0 || kept + step + BLOCK_SIZE > window || tokens.len() <= window {
        bail!("streaming needs 0 < step, kept blocks + step + a block within the window, and a text longer than the window");
    }
    let mut seq = Sequence::default();
    let mut mean = Mean::default();
    let mut pos = 0; // tokens of the text fed so far
    while pos + 1 < tokens.len() {
        let end = (pos + step).min(tokens.len() - 1);
        let need = end - pos;
        if seq.tokens.len() + need > window {
            let over = seq.tokens.len() + need - window;
            runner.shift(&mut seq, keep, over.div_ceil(BLOCK_SIZE))?;
        }
        seq.tokens.extend_from_slice(&tokens[pos..end]);
        let rows = runner.compute_all(&mut seq)?;
        for (i, row) in rows.iter().enumerate() {
            let target = pos + i + 1;
            if target >= window {
                mean.add(nll(row, tokens[target] as usize));
            }
        }
        pos = end;
        progress(pos, tokens.len());
    }
    Ok(report(&mean))
}

/// [`sliding`] perplexity over windows of `runner.n_ctx()` tokens, recomputed every `stride`.
pub fn sliding<B: Backend>(
    runner: &mut Runner<B>,
    tokens: &[u32],
    stride: usize,
    bos: Option<u32>,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<StreamReport> {
    let window = runner.n_ctx();
    if stride == 0 || stride >= window || tokens.len() <= window {
        bail!("sliding needs 0 < stride < window and a text longer than the window");
    }
    let mut mean = Mean::default();
    // Scores targets `next ..= end` with the window of tokens ending at `end`.
    let mut end = (window - 1 + stride).min(tokens.len() - 1);
    let mut next = window;
    while end < tokens.len() {
        let first_target = next;
        let start = end + 1 - window;
        let mut w = tokens[start..end].to_vec();
        if let (Some(b), true) = (bos, start > 0) {
            w[0] = b;
        }
        let mut seq = Sequence::new(w);
        let rows = runner.compute_all(&mut seq)?;
        for target in first_target..=end {
            mean.add(nll(&rows[target - 1 - start], tokens[target] as usize));
        }
        next = end + 1;
        progress(end + 1, tokens.len());
        if end + 1 == tokens.len() {
            break;
        }
        end = (end + stride).min(tokens.len() - 1);
    }
    Ok(report(&mean))
}
