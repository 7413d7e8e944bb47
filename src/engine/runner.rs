//! The runner: a model, its KV storage and the block pool, driving sequences through the forward
//! pass. A `Sequence` is the token history whose KV is cached; positions `0..n_cached` have valid
//! K/V. Rolling back (speculation, chat edits) is truncating the sequence; no K/V is copied.
//! Sequences hold their blocks through a [`BlockTable`], which gives them back when the sequence
//! is dropped; full blocks enter the prefix cache as soon as they are computed, and a sequence
//! that starts with a cached prefix takes those blocks instead of computing them
//! ([`Runner::reuse_prefix`]). A write into a shared or cached block copies it first.

use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{bail, Result};

use crate::engine::kv_blocks::{BlockPool, BlockTable};
use crate::model::backend::{DeviceSampler, KvType};
use crate::model::forward::{Pick, Picked};
use crate::model::{Backend, BatchEntry, Model};

/// A sequence's outcome of [`Runner::step_sampled`]: its logits rows, or the token the device
/// sampled.
#[derive(Debug)]
pub enum Stepped {
    Logits(Vec<Vec<f32>>),
    Token(u32),
}

/// Positions per KV block.
pub const BLOCK_SIZE: usize = 32;
/// Tokens per forward call during prefill.
pub const PREFILL_CHUNK: usize = 512;

static NEXT_ID: AtomicU32 = AtomicU32::new(1);

/// A sequence: its tokens and the KV blocks holding the cached ones. Every sequence has its own
/// id (attention groups a batch's rows by it); dropping it releases its blocks.
#[derive(Debug)]
pub struct Sequence {
    pub id: u32,
    /// Every token of the sequence, cached or not yet.
    pub tokens: Vec<u32>,
    pub blocks: BlockTable,
    /// Tokens whose K/V are in the cache.
    pub n_cached: usize,
}

impl Default for Sequence {
    fn default() -> Sequence {
        Sequence {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            tokens: Vec::new(),
            blocks: BlockTable::default(),
            n_cached: 0,
        }
    }
}

impl Sequence {
    /// A sequence holding `tokens`, none cached yet.
    pub fn new(tokens: Vec<u32>) -> Sequence {
        Sequence {
            tokens,
            ..Sequence::default()
        }
    }
}

pub struct Runner<B: Backend> {
    pub model: Model<B>,
    kv: B::Kv,
    pool: BlockPool,
    n_ctx: usize,
    /// KV storage of other types, kept by [`Runner::set_kv_type`].
    stash: Vec<(KvType, B::Kv)>,
}

impl<B: Backend> Runner<B> {
    /// KV storage for one sequence of up to `n_ctx` positions.
    pub fn new(model: Model<B>, n_ctx: usize) -> Result<Runner<B>> {
        Runner::shared(model, n_ctx, 1)
    }

    /// KV storage for `n_seq` sequences of up to `n_ctx` positions each: one pool of
    /// `n_ctx * n_seq` positions that every sequence draws on (a sequence may use more than its
    /// share while others use less; none may grow past `n_ctx`).
    pub fn shared(model: Model<B>, n_ctx: usize, n_seq: usize) -> Result<Runner<B>> {
        if n_ctx == 0 {
            bail!("context size must be at least 1");
        }
        let n_blocks = n_ctx.div_ceil(BLOCK_SIZE) * n_seq.max(1);
        let cfg = &model.cfg;
        let kv = model.backend.alloc_kv(
            cfg.n_layer,
            n_blocks,
            BLOCK_SIZE,
            cfg.kv_dim(),
            cfg.head_dim,
            cfg.kv_type,
        )?;
        Ok(Runner {
            model,
            kv,
            pool: BlockPool::new(n_blocks, BLOCK_SIZE),
            n_ctx,
            stash: Vec::new(),
        })
    }

    /// Switches the KV storage to type `t` (`infer bench --kv-types` timing several cache types in
    /// one run): one of that type used before, else a new one; the replaced storage is kept for a
    /// switch back. Every sequence must have been dropped: the block pool starts afresh and the
    /// prefix cache is emptied.
    pub fn set_kv_type(&mut self, t: KvType) -> Result<()> {
        let cur = self.model.cfg.kv_type;
        if t == cur {
            return Ok(());
        }
        let n_blocks = self.pool.n_blocks();
        let new = match self.stash.iter().position(|(k, _)| *k == t) {
            Some(i) => self.stash.swap_remove(i).1,
            None => {
                let cfg = &self.model.cfg;
                self.model.backend.alloc_kv(
                    cfg.n_layer,
                    n_blocks,
                    BLOCK_SIZE,
                    cfg.kv_dim(),
                    cfg.head_dim,
                    t,
                )?
            }
        };
        let old = std::mem::replace(&mut self.kv, new);
        self.stash.push((cur, old));
        self.model.cfg.kv_type = t;
        self.pool = BlockPool::new(n_blocks, BLOCK_SIZE);
        Ok(())
    }

    /// The most positions one sequence may hold.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
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
        let end = seq.tokens.len();
        self.compute_with(seq, end, |i| i + 1 == end, progress, true)
            .map(|mut l| l.pop().expect("last row always has logits"))
    }

    /// [`Runner::compute`] that picks the next token where the logits are instead of returning
    /// them ([`Model::forward_sample`]): only the id comes back. `register`: full blocks enter
    /// the prefix cache (as [`Runner::compute`] does).
    pub fn compute_sampled(
        &mut self,
        seq: &mut Sequence,
        sampler: &mut DeviceSampler,
        window: &[u32],
        register: bool,
    ) -> Result<u32> {
        let (start, end) = (seq.n_cached, seq.tokens.len());
        if start >= end {
            bail!("nothing to compute: every token of the sequence is cached");
        }
        self.prepare(seq, start, end)?;
        let mut id = None;
        for base in (start..end).step_by(PREFILL_CHUNK) {
            let stop = (base + PREFILL_CHUNK).min(end);
            let batch = entries(seq, base..stop, |pos| pos + 1 == end);
            if stop == end {
                id = Some(
                    self.model
                        .forward_sample(&mut self.kv, &batch, sampler, window)?,
                );
            } else {
                self.model.forward(&mut self.kv, &batch)?;
            }
            seq.n_cached = stop;
            if register {
                seq.blocks.register_full(&seq.tokens, stop);
            }
        }
        id.ok_or_else(|| anyhow::anyhow!("no chunk ended the sequence"))
    }

    /// Computes the uncached tokens and returns logits for every one of them (speculative verification).
    pub fn compute_all(&mut self, seq: &mut Sequence) -> Result<Vec<Vec<f32>>> {
        let end = seq.tokens.len();
        self.compute_with(seq, end, |_| true, &mut |_, _| {}, true)
    }

    /// Computes the next prefill chunk of `seq`: positions `n_cached` up to the next multiple of
    /// [`PREFILL_CHUNK`] past `origin` (where its prefill started), at most `end`. Returns the
    /// last position's logits when the chunk reaches `end`. Chunk boundaries depend only on
    /// `origin`, so a prompt is computed in the same forward calls whatever else runs beside it.
    /// With `register`, the full blocks it completes go into the prefix cache.
    pub fn prefill_chunk(
        &mut self,
        seq: &mut Sequence,
        origin: usize,
        end: usize,
        register: bool,
    ) -> Result<Option<Vec<f32>>> {
        let start = seq.n_cached;
        debug_assert!(start >= origin && (start - origin).is_multiple_of(PREFILL_CHUNK));
        let stop = (start + PREFILL_CHUNK).min(end);
        let mut rows = self.compute_with(seq, stop, |i| i + 1 == end, &mut |_, _| {}, register)?;
        Ok(rows.pop())
    }

    /// One forward over several sequences: each one's uncached tokens (usually one) are rows of
    /// the same batch. Sequence `i` gets the logits of its positions from `logits_from[i]` on
    /// (its last position's at least), in order. With `invariant`, every row is computed with the
    /// arithmetic a one-row forward uses, so a sequence's results do not depend on what else is in
    /// the batch. With `register`, blocks it fills go into the prefix cache. Takes nothing when
    /// the pool cannot hold every row.
    pub fn step(
        &mut self,
        seqs: &mut [&mut Sequence],
        logits_from: &[usize],
        invariant: bool,
        register: bool,
    ) -> Result<Vec<Vec<Vec<f32>>>> {
        let mut devices: Vec<Option<(&mut DeviceSampler, &[u32])>> =
            seqs.iter().map(|_| None).collect();
        let out = self.step_sampled(seqs, logits_from, &mut devices, invariant, register)?;
        Ok(out
            .into_iter()
            .map(|s| match s {
                Stepped::Logits(rows) => rows,
                Stepped::Token(_) => unreachable!("no sequence was sampled on the device"),
            })
            .collect())
    }

    /// [`Runner::step`] where sequence `i`'s next token is picked on the device when
    /// `devices[i]` holds a sampler from [`Backend::device_sampler`](crate::model::Backend) and
    /// its penalty window: such a sequence gets [`Stepped::Token`] (its `logits_from` is ignored:
    /// only its last position is sampled), the others their logits rows. The device rows are
    /// sampled in one go and only their ids come back.
    pub fn step_sampled(
        &mut self,
        seqs: &mut [&mut Sequence],
        logits_from: &[usize],
        devices: &mut [Option<(&mut DeviceSampler, &[u32])>],
        invariant: bool,
        register: bool,
    ) -> Result<Vec<Stepped>> {
        assert_eq!(seqs.len(), logits_from.len(), "a logits start per sequence");
        assert_eq!(seqs.len(), devices.len(), "a device choice per sequence");
        let bs = BLOCK_SIZE;
        let need: usize = seqs
            .iter()
            .map(|s| s.tokens.len().div_ceil(bs).saturating_sub(s.blocks.len()))
            .sum();
        if !self.pool.can_allocate(need) {
            bail!(
                "KV cache is full: {need} more blocks needed, {} available (raise --ctx)",
                self.pool.n_available()
            );
        }
        for s in seqs.iter_mut() {
            if s.n_cached >= s.tokens.len() {
                bail!("sequence {} has nothing to compute", s.id);
            }
            self.prepare(s, s.n_cached, s.tokens.len())?;
        }
        // Logits rows from `from` on (the last position's at least); a device sequence's last only.
        let from: Vec<usize> = seqs
            .iter()
            .zip(logits_from)
            .zip(devices.iter())
            .map(|((s, &from), d)| match d {
                Some(_) => s.tokens.len() - 1,
                None => from.clamp(s.n_cached, s.tokens.len() - 1),
            })
            .collect();
        let batch: Vec<BatchEntry<'_>> = seqs
            .iter()
            .zip(&from)
            .flat_map(|(s, &from)| {
                (s.n_cached..s.tokens.len()).map(move |pos| BatchEntry {
                    token: s.tokens[pos],
                    pos: pos as u32,
                    seq: s.id,
                    block_table: s.blocks.blocks(),
                    logits: pos >= from,
                })
            })
            .collect();
        let mut picks = Vec::with_capacity(batch.len());
        for ((s, &from), d) in seqs.iter().zip(&from).zip(devices.iter_mut()) {
            match d {
                Some((sampler, window)) => picks.push(Pick::Device(sampler, window)),
                None => picks.extend((from..s.tokens.len()).map(|_| Pick::Host)),
            }
        }
        let be = &self.model.backend;
        be.set_row_invariant(invariant);
        let out = self.model.forward_picked(&mut self.kv, &batch, &mut picks);
        be.set_row_invariant(false);
        drop(picks);
        let mut out = out?.into_iter();
        let mut per_seq = Vec::with_capacity(seqs.len());
        for (s, &from) in seqs.iter_mut().zip(&from) {
            let end = s.tokens.len();
            let rows: Vec<Picked> = out.by_ref().take(end - from).collect();
            per_seq.push(match rows[..] {
                [Picked::Token(id)] => Stepped::Token(id),
                _ => Stepped::Logits(
                    rows.into_iter()
                        .map(|r| match r {
                            Picked::Logits(l) => l,
                            Picked::Token(_) => unreachable!("a device pick has one row"),
                        })
                        .collect(),
                ),
            });
            s.n_cached = end;
            if register {
                s.blocks.register_full(&s.tokens, end);
            }
        }
        Ok(per_seq)
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
        self.prepare(seq, from, end)?;
        let batch = entries(seq, from..end, |pos| pos + 1 == end);
        let mut rows = self.model.forward_layers(&mut self.kv, &batch, layers)?;
        Ok(rows.pop().expect("the last row asked for logits"))
    }

    /// Appends `tokens` and returns the logits of the last one.
    pub fn extend(&mut self, seq: &mut Sequence, tokens: &[u32]) -> Result<Vec<f32>> {
        seq.tokens.extend_from_slice(tokens);
        self.compute(seq)
    }

    /// Makes positions `start..end` of `seq` writable: blocks allocated, shared or cached ones
    /// among them copied.
    fn prepare(&mut self, seq: &mut Sequence, start: usize, end: usize) -> Result<()> {
        if end > self.n_ctx {
            bail!(
                "context is full: {end} tokens needed, the context holds {} (raise --ctx)",
                self.n_ctx
            );
        }
        let copies = seq.blocks.prepare_write(&self.pool, start, end)?;
        if !copies.is_empty() {
            self.model.backend.kv_copy_blocks(&mut self.kv, &copies);
        }
        Ok(())
    }

    /// Positions `want(pos)` get logits; computes `n_cached..end`, the result is in position order.
    fn compute_with(
        &mut self,
        seq: &mut Sequence,
        end: usize,
        want: impl Fn(usize) -> bool,
        progress: &mut dyn FnMut(usize, usize),
        register: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let start = seq.n_cached;
        if start >= end {
            bail!("nothing to compute: every token of the sequence is cached");
        }
        self.prepare(seq, start, end)?;
        let mut out = Vec::new();
        for base in (start..end).step_by(PREFILL_CHUNK) {
            let stop = (base + PREFILL_CHUNK).min(end);
            let batch = entries(seq, base..stop, &want);
            let logits = self.model.forward(&mut self.kv, &batch)?;
            out.extend(logits);
            seq.n_cached = stop;
            if register {
                seq.blocks.register_full(&seq.tokens, stop);
            }
            progress(stop - start, end - start);
        }
        Ok(out)
    }

    /// Makes the sequence hold `tokens` with as much as possible already cached: the longest
    /// prefix shared with what the sequence has cached, or, if longer, the longest prefix of full
    /// blocks in the prefix cache. Returns how many tokens were reused. At least one token is
    /// left uncached so that `compute` has logits to return. (Callers count a prompt's reused and
    /// computed tokens into the pool's stats with [`BlockPool::count`].)
    pub fn reuse_prefix(&mut self, seq: &mut Sequence, tokens: &[u32]) -> usize {
        let limit = tokens.len().saturating_sub(1);
        let own = seq
            .tokens
            .iter()
            .zip(tokens)
            .take(seq.n_cached)
            .take_while(|(a, b)| a == b)
            .count()
            .min(limit);
        let mut fresh = BlockTable::default();
        let cached = fresh.adopt_cached(&self.pool, tokens).unwrap_or(0);
        if cached.min(limit) > own {
            // The cached blocks hold more: the sequence takes them instead of its own.
            seq.blocks = fresh;
            seq.tokens.clear();
            seq.tokens.extend_from_slice(tokens);
            seq.n_cached = cached.min(limit);
            seq.blocks.truncate(seq.n_cached);
            return seq.n_cached;
        }
        drop(fresh);
        self.truncate(seq, own);
        seq.tokens.extend_from_slice(&tokens[own..]);
        own
    }

    /// A new sequence sharing `seq`'s tokens and cached K/V (blocks are copied on first write).
    pub fn fork(&self, seq: &Sequence) -> Sequence {
        Sequence {
            tokens: seq.tokens.clone(),
            blocks: seq.blocks.share(),
            n_cached: seq.n_cached,
            ..Sequence::default()
        }
    }

    /// Forgets every position from `len` on.
    /// The K/V of `seq`'s first `n` positions (the blocks holding them, whole), as
    /// [`Backend::kv_export`] writes them, to save with the prompt cache.
    pub fn export_kv(&self, seq: &Sequence, n: usize) -> Result<Vec<u8>> {
        if n > seq.n_cached {
            bail!("only {} positions are cached, not {n}", seq.n_cached);
        }
        let blocks = &seq.blocks.blocks()[..n.div_ceil(BLOCK_SIZE)];
        self.model.backend.kv_export(&self.kv, blocks)
    }

    /// Makes the empty `seq` hold `tokens`, the first `n` of them cached with K/V from `kv`:
    /// [`Runner::export_kv`]'s bytes for `kv_positions >= n` positions of the same model, of
    /// which the blocks holding the first `n` are taken.
    pub fn import_kv(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        n: usize,
        kv: &[u8],
        kv_positions: usize,
    ) -> Result<()> {
        if !seq.tokens.is_empty() || n > tokens.len() || n > kv_positions {
            bail!("import_kv needs an empty sequence and at most the saved positions");
        }
        let (blocks, saved) = (n.div_ceil(BLOCK_SIZE), kv_positions.div_ceil(BLOCK_SIZE));
        if saved == 0 || !kv.len().is_multiple_of(saved) {
            bail!(
                "saved KV of {} bytes does not hold {saved} blocks",
                kv.len()
            );
        }
        if !self.pool.can_allocate(blocks) {
            bail!("the KV cache cannot hold the saved prompt (raise --ctx)");
        }
        seq.tokens = tokens[..n].to_vec();
        self.prepare(seq, 0, n)?;
        let ids = seq.blocks.blocks()[..blocks].to_vec();
        let bytes = &kv[..blocks * (kv.len() / saved)];
        self.model.backend.kv_import(&mut self.kv, &ids, bytes)?;
        seq.n_cached = n;
        seq.tokens.extend_from_slice(&tokens[n..]);
        Ok(())
    }

    /// Context shift: keeps the blocks holding `seq`'s first `keep` positions, drops the `n`
    /// blocks after them (their tokens leave `seq.tokens`), and re-rotates the keys of every
    /// later cached position to its new place, `n` blocks earlier. Returns how many tokens were
    /// dropped.
    pub fn shift(&mut self, seq: &mut Sequence, keep: usize, n: usize) -> Result<usize> {
        let bs = BLOCK_SIZE;
        let at = keep.div_ceil(bs);
        let (from, to) = (at * bs, (at + n) * bs);
        if n == 0 || to > seq.n_cached {
            bail!(
                "cannot drop {n} blocks after the first {keep} positions of {} cached",
                seq.n_cached
            );
        }
        seq.blocks.remove_blocks(at, n)?;
        seq.tokens.drain(from..to);
        seq.n_cached -= to - from;
        let slots: Vec<usize> = (from..seq.n_cached)
            .map(|p| seq.blocks.blocks()[p / bs] as usize * bs + p % bs)
            .collect();
        self.model
            .shift_kv(&mut self.kv, &slots, (to - from) as u32)?;
        Ok(to - from)
    }

    pub fn truncate(&mut self, seq: &mut Sequence, len: usize) {
        let len = len.min(seq.tokens.len());
        seq.tokens.truncate(len);
        seq.n_cached = seq.n_cached.min(len);
        seq.blocks.truncate(len);
    }
}

/// The forward-pass rows of `seq`'s positions `range`, asking logits where `logits(pos)`.
fn entries(
    seq: &Sequence,
    range: std::ops::Range<usize>,
    logits: impl Fn(usize) -> bool,
) -> Vec<BatchEntry<'_>> {
    range
        .map(|pos| BatchEntry {
            token: seq.tokens[pos],
            pos: pos as u32,
            seq: seq.id,
            block_table: seq.blocks.blocks(),
            logits: logits(pos),
        })
        .collect()
}
