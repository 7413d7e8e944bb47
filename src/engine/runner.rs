//! The runner: a model, its KV storage and the block manager, driving sequences through the forward
//! pass. A `Sequence` is the token history whose KV is cached; positions `0..n_cached` have valid K/V.
//! Rolling back (speculation, chat edits) is truncating the sequence; no K/V is copied.

use anyhow::{bail, Result};

use crate::engine::kv_blocks::BlockManager;
use crate::model::{Backend, BatchEntry, Model};

/// Positions per KV block.
pub const BLOCK_SIZE: usize = 32;
/// Tokens per forward call during prefill.
pub const PREFILL_CHUNK: usize = 512;

#[derive(Clone, Debug, Default)]
pub struct Sequence {
    /// Every token of the sequence, cached or not yet.
    pub tokens: Vec<u32>,
    pub block_table: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub n_cached: usize,
}

pub struct Runner<B: Backend> {
    pub model: Model<B>,
    kv: B::Kv,
    blocks: BlockManager,
    n_ctx: usize,
}

impl<B: Backend> Runner<B> {
    /// Allocates KV storage for `n_ctx` positions in total.
    pub fn new(model: Model<B>, n_ctx: usize) -> Result<Runner<B>> {
        if n_ctx == 0 {
            bail!("context size must be at least 1");
        }
        let n_blocks = n_ctx.div_ceil(BLOCK_SIZE);
        let cfg = &model.cfg;
        let kv =
            model
                .backend
                .alloc_kv(cfg.n_layer, n_blocks, BLOCK_SIZE, cfg.kv_dim(), cfg.kv_type)?;
        Ok(Runner {
            model,
            kv,
            blocks: BlockManager::new(n_blocks, BLOCK_SIZE),
            n_ctx,
        })
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Gives a logits row back once it is no longer needed, so the next step reuses its buffer
    /// instead of zeroing a fresh one ([`Backend::recycle`]).
    pub fn recycle(&self, logits: Vec<f32>) {
        self.model.backend.recycle(logits);
    }

    pub fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    /// Computes the sequence's uncached tokens and returns the logits of the last one.
    pub fn compute(&mut self, seq: &mut Sequence) -> Result<Vec<f32>> {
        self.compute_progress(seq, &mut |_, _| {})
    }

    /// [`Runner::compute`], calling `progress(done, total)` with the tokens computed so far after
    /// each forward call (one per [`PREFILL_CHUNK`] tokens), for progress bars.
    pub fn compute_progress(
        &mut self,
        seq: &mut Sequence,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        let n = seq.tokens.len();
        self.compute_with(seq, |i| i + 1 == n, progress)
            .map(|mut l| l.pop().expect("last row always has logits"))
    }

    /// Computes the uncached tokens and returns logits for every one of them (speculative verification).
    pub fn compute_all(&mut self, seq: &mut Sequence) -> Result<Vec<Vec<f32>>> {
        self.compute_with(seq, |_| true, &mut |_, _| {})
    }

    /// Early exit for self-speculative drafting: runs `seq.tokens[from..]` through the first
    /// `layers` layers plus the final norm and head and returns the last token's logits. Writes
    /// those layers' K/V at those positions but leaves `n_cached` alone: the positions stay
    /// uncached, and the full forward that verifies them rewrites every layer there.
    pub fn draft_logits(
        &mut self,
        seq: &mut Sequence,
        from: usize,
        layers: usize,
    ) -> Result<Vec<f32>> {
        let end = seq.tokens.len();
        if from >= end || from < seq.n_cached {
            bail!(
                "draft forward from position {from}: only uncached positions {}..{end} may run",
                seq.n_cached
            );
        }
        if end > self.n_ctx {
            bail!(
                "context is full: {} tokens needed, the context holds {} (raise --ctx)",
                end,
                self.n_ctx
            );
        }
        self.blocks.allocate(&mut seq.block_table, end)?;
        let batch: Vec<BatchEntry<'_>> = (from..end)
            .map(|pos| BatchEntry {
                token: seq.tokens[pos],
                pos: pos as u32,
                block_table: &seq.block_table,
                logits: pos + 1 == end,
            })
            .collect();
        let mut rows = self.model.forward_layers(&mut self.kv, &batch, layers)?;
        Ok(rows.pop().expect("the last row asked for logits"))
    }

    /// Appends `tokens` and returns the logits of the last one.
    pub fn extend(&mut self, seq: &mut Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
        seq.tokens.extend_from_slice(tokens);
        self.compute(seq)
    }

    /// Positions `want(pos)` get logits; the result is in position order.
    fn compute_with(
        &mut self,
        seq: &mut Sequence,
        want: impl Fn(usize) -> bool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<Vec<f32>>> {
        let (start, end) = (seq.n_cached, seq.tokens.len());
        if start >= end {
            bail!("nothing to compute: every token of the sequence is cached");
        }
        if end > self.n_ctx {
            bail!(
                "context is full: {} tokens needed, the context holds {} (raise --ctx)",
                end,
                self.n_ctx
            );
        }
        self.blocks.allocate(&mut seq.block_table, end)?;
        let mut out = Vec::new();
        for base in (start..end).step_by(PREFILL_CHUNK) {
            let stop = (base + PREFILL_CHUNK).min(end);
            let batch: Vec<BatchEntry<'_>> = (base..stop)
                .map(|pos| BatchEntry {
                    token: seq.tokens[pos],
                    pos: pos as u32,
                    block_table: &seq.block_table,
                    logits: want(pos),
                })
                .collect();
            let logits = self.model.forward(&mut self.kv, &batch)?;
            out.extend(logits);
            seq.n_cached = stop;
            progress(stop - start, end - start);
        }
        Ok(out)
    }

    /// Keeps the longest cached prefix shared with `tokens`, then makes the sequence hold `tokens`
    /// (the rest uncached). Returns how many tokens were reused. At least one token is left uncached so
    /// that `compute` has logits to return.
    pub fn reuse_prefix(&mut self, seq: &mut Sequence, tokens: &[u32]) -> usize {
        let common = seq
            .tokens
            .iter()
            .zip(tokens)
            .take(seq.n_cached)
            .take_while(|(a, b)| a == b)
            .count()
            .min(tokens.len().saturating_sub(1));
        self.truncate(seq, common);
        seq.tokens.extend_from_slice(&tokens[common..]);
        common
    }

    /// Forgets every position from `len` on.
    pub fn truncate(&mut self, seq: &mut Sequence, len: usize) {
        let len = len.min(seq.tokens.len());
        seq.tokens.truncate(len);
        seq.n_cached = seq.n_cached.min(len);
        self.blocks.truncate(&mut seq.block_table, len);
    }

    /// Releases all of a sequence's blocks.
    pub fn release(&mut self, seq: &mut Sequence) {
        self.truncate(seq, 0);
    }
}
