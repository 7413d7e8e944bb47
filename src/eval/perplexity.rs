//! Perplexity and KL divergence over a token stream, llama.cpp's `llama-perplexity` method: the
//! stream is cut into non-overlapping windows of `ctx` tokens (a partial tail is dropped), the
//! first token of each window is replaced by BOS when the model adds BOS, each window is computed
//! from position 0 with nothing before it, and only the second half is scored: the logits at
//! positions `ctx/2 ..= ctx-2` predict tokens `ctx/2+1 ..= ctx-1`, so every scored token has at
//! least `ctx/2` tokens of context. A window is run in forward calls of at most `batch` tokens.
//!
//! With a base model, both run window by window in the same process (no logits file): each
//! forward chunk goes through the base and then the model, and only that chunk's scored rows are
//! held (2 × rows × vocab floats), so memory does not grow with the text.

use anyhow::{bail, Result};

use crate::eval::stats::{quantile, score_rows, Mean};
use crate::model::{Backend, BatchEntry, Model};

/// How a text is cut and run.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Tokens per window.
    pub ctx: usize,
    /// Most tokens per forward call.
    pub batch: usize,
    /// Score at most this many windows (None: every whole window).
    pub chunks: Option<usize>,
    /// The BOS id when the model adds BOS: it replaces each window's first token.
    pub bos: Option<u32>,
    /// Threads for turning logits into scores.
    pub threads: usize,
}

/// The windows of `tokens` as scored: whole windows only, BOS first when given.
pub fn windows(tokens: &[u32], o: &Options) -> Vec<Vec<u32>> {
    let n = (tokens.len() / o.ctx).min(o.chunks.unwrap_or(usize::MAX));
    (0..n)
        .map(|i| {
            let mut w = tokens[i * o.ctx..(i + 1) * o.ctx].to_vec();
            if let Some(b) = o.bos {
                w[0] = b;
            }
            w
        })
        .collect()
}

/// The first scored position of a window of `ctx` tokens (its logits predict the next token).
pub fn first_scored(ctx: usize) -> usize {
    ctx / 2
}

/// A model with KV storage for one window; every window overwrites it from position 0.
pub struct Evaluator<'m, B: Backend> {
    model: &'m Model<B>,
    kv: B::Kv,
    table: Vec<u32>,
}

impl<'m, B: Backend> Evaluator<'m, B> {
    pub fn new(model: &'m Model<B>, ctx: usize) -> Result<Evaluator<'m, B>> {
        let cfg = &model.cfg;
        let n_blocks = ctx.div_ceil(model.block_size);
        let kv = model.backend.alloc_kv(
            cfg.n_layer,
            n_blocks,
            model.block_size,
            cfg.kv_dim(),
            cfg.head_dim,
            cfg.kv_type,
        )?;
        Ok(Evaluator {
            model,
            kv,
            table: (0..n_blocks as u32).collect(),
        })
    }

    /// Runs positions `lo..hi` of `window` (those before `lo` must have been run) and returns the
    /// logits of the positions in `lo..hi` that are scored (`first..window.len()-1`).
    pub fn chunk(
        &mut self,
        window: &[u32],
        lo: usize,
        hi: usize,
        first: usize,
    ) -> Result<Vec<Vec<f32>>> {
        self.forward(window, lo, hi, |pos| pos >= first && pos + 1 < window.len())
    }

    /// Runs positions `lo..hi` of `window` and returns the logits of the positions `want`s.
    pub fn forward(
        &mut self,
        window: &[u32],
        lo: usize,
        hi: usize,
        want: impl Fn(usize) -> bool,
    ) -> Result<Vec<Vec<f32>>> {
        let batch: Vec<BatchEntry<'_>> = (lo..hi)
            .map(|pos| BatchEntry {
                token: window[pos],
                pos: pos as u32,
                seq: 0,
                block_table: &self.table,
                logits: want(pos),
            })
            .collect();
        self.model.forward(&mut self.kv, &batch)
    }
}

/// The running figures after each window.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    pub window: usize,
    pub windows: usize,
    pub ppl: f64,
    pub ppl_err: f64,
    /// Mean KL so far, with a base model.
    pub kl: Option<f64>,
}

/// Comparison with the base model.
#[derive(Clone, Copy, Debug)]
pub struct KlReport {
    pub mean: f64,
    pub err: f64,
    pub median: f64,
    pub p99: f64,
    pub max: f64,
    /// Fraction of scored positions where both models rank the same token first.
    pub top1: f64,
    pub top1_err: f64,
    pub base_ppl: f64,
    pub base_ppl_err: f64,
    /// Mean of `nll(model) - nll(base)` per scored token, `ln(PPL / base PPL)`, and its standard
    /// error: the paired comparison, far tighter than the two perplexities' own errors.
    pub ln_ratio: f64,
    pub ln_ratio_err: f64,
}

#[derive(Clone, Copy, Debug)]
pub struct Report {
    pub windows: usize,
    pub ctx: usize,
    /// Tokens scored (`windows × (ctx - ctx/2 - 1)`).
    pub scored: u64,
    /// Mean negative log-likelihood per scored token (nats).
    pub nll: f64,
    pub ppl: f64,
    /// Standard error of the perplexity (that of the mean NLL times the perplexity).
    pub ppl_err: f64,
    pub kl: Option<KlReport>,
}

/// Evaluates `model` (and compares it with `base`) on `tokens`; `on_window` gets the running
/// figures after each window.
pub fn evaluate<B: Backend, C: Backend>(
    model: &Model<B>,
    base: Option<&Model<C>>,
    tokens: &[u32],
    o: &Options,
    on_window: &mut dyn FnMut(&Progress),
) -> Result<Report> {
    if o.ctx < 4 {
        bail!("a window must hold at least 4 tokens, got {}", o.ctx);
    }
    if o.batch == 0 {
        bail!("the batch must hold at least 1 token");
    }
    if let Some(b) = base {
        if b.cfg.vocab_size != model.cfg.vocab_size {
            bail!(
                "the base model's vocabulary has {} tokens, the model's {}: KL divergence needs \
                 the same vocabulary",
                b.cfg.vocab_size,
                model.cfg.vocab_size
            );
        }
    }
    let wins = windows(tokens, o);
    if wins.is_empty() {
        bail!(
            "the text has {} tokens, fewer than one window of {} (use a longer text or a smaller --ctx)",
            tokens.len(),
            o.ctx
        );
    }
    let first = first_scored(o.ctx);
    let mut ev = Evaluator::new(model, o.ctx)?;
    let mut base_ev = base.map(|b| Evaluator::new(b, o.ctx)).transpose()?;
    let (mut nll, mut base_nll, mut kl, mut same, mut diff) = (
        Mean::default(),
        Mean::default(),
        Mean::default(),
        Mean::default(),
        Mean::default(),
    );
    let mut kls = Vec::new();
    for (wi, w) in wins.iter().enumerate() {
        for lo in (0..o.ctx).step_by(o.batch) {
            let hi = (lo + o.batch).min(o.ctx);
            let rows = ev.chunk(w, lo, hi, first)?;
            let base_rows = match &mut base_ev {
                Some(b) => Some(b.chunk(w, lo, hi, first)?),
                None => None,
            };
            let from = lo.max(first);
            let targets = &w[from + 1..from + 1 + rows.len()];
            for s in score_rows(&rows, base_rows.as_deref(), targets, o.threads) {
                nll.add(s.nll);
                if let Some(b) = s.base {
                    base_nll.add(b.nll);
                    diff.add(s.nll - b.nll);
                    kl.add(b.kl);
                    kls.push(b.kl);
                    same.add(if b.same_top1 { 1.0 } else { 0.0 });
                }
            }
        }
        let ppl = nll.mean().exp();
        on_window(&Progress {
            window: wi + 1,
            windows: wins.len(),
            ppl,
            ppl_err: nll.stderr() * ppl,
            kl: base.map(|_| kl.mean()),
        });
    }
    let ppl = nll.mean().exp();
    let kl = base.map(|_| {
        let base_ppl = base_nll.mean().exp();
        KlReport {
            mean: kl.mean(),
            err: kl.stderr(),
            median: quantile(&mut kls, 0.5),
            p99: quantile(&mut kls, 0.99),
            max: quantile(&mut kls, 1.0),
            top1: same.mean(),
            top1_err: same.stderr(),
            base_ppl,
            base_ppl_err: base_nll.stderr() * base_ppl,
            ln_ratio: diff.mean(),
            ln_ratio_err: diff.stderr(),
        }
    });
    Ok(Report {
        windows: wins.len(),
        ctx: o.ctx,
        scored: nll.n,
        nll: nll.mean(),
        ppl,
        ppl_err: nll.stderr() * ppl,
        kl,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(ctx: usize, chunks: Option<usize>, bos: Option<u32>) -> Options {
        Options {
            ctx,
            batch: 512,
            chunks,
            bos,
            threads: 1,
        }
    }

    #[test]
    fn windows_are_whole_and_start_with_bos() {
        let t: Vec<u32> = (10..21).collect(); // 11 tokens
        assert_eq!(
            windows(&t, &opts(4, None, Some(1))),
            vec![vec![1, 11, 12, 13], vec![1, 15, 16, 17]]
        );
        assert_eq!(
            windows(&t, &opts(4, None, None)),
            vec![vec![10, 11, 12, 13], vec![14, 15, 16, 17]]
        );
        assert_eq!(windows(&t, &opts(4, Some(1), None)).len(), 1);
        assert!(windows(&t, &opts(12, None, None)).is_empty());
        // ctx 512 scores positions 256..=510: 255 tokens per window, as llama.cpp counts
        assert_eq!(512 - first_scored(512) - 1, 255);
    }
}
