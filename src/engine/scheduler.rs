//! The scheduler: many requests through one runner with continuous batching. Each [`Scheduler::step`]
//! admits waiting requests while the KV pool allows, runs one forward with a decode row for every
//! running sequence, and computes one prefill chunk of the oldest request still reading its prompt
//! (so a long prompt holds the others' decoding up for one chunk at most).
//!
//! Invariants:
//! - A request's output does not depend on what runs beside it: decode rows are computed
//!   row-invariant (each as a one-row forward would), and a prompt is computed in the chunks a
//!   lone run would use (boundaries every [`PREFILL_CHUNK`] from where its prefill started), in
//!   forward calls of its own.
//! - Under KV pressure the newest running request is preempted: its blocks go back (full ones stay
//!   in the prefix cache), and it resumes later from its tokens so far, recomputing what was lost
//!   in the same chunks, so its output is unchanged. A request that cannot fit the whole pool
//!   fails with an error; nothing else does.
//! - A cancelled request ends (`Interrupted`) at the next step and its blocks return at once.
//! - A request shares K/V computed by another only when they have at least a whole block of
//!   prompt in common (the prefix cache, or a running sequence's blocks past it); a request that
//!   shares no block with any other is computed exactly as it would be alone.
//! - Every submitted request gets exactly one `Done` or `Error`, in `step`'s output.

use std::collections::{HashSet, VecDeque};

use anyhow::Result;

use crate::engine::generate::StopReason;
use crate::engine::request::{Event, Request, RequestId, RequestSpec};
use crate::engine::runner::{Runner, Sequence, Stepped, BLOCK_SIZE, PREFILL_CHUNK};
use crate::model::Backend;
use crate::tokenizer::Tokenizer;

/// How many requests run at once.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Requests running (holding KV) at once; the rest wait.
    pub max_running: usize,
    /// The longest a sequence may grow (prompt and output), at most the runner's KV positions;
    /// 0: the runner's KV positions.
    pub seq_len: usize,
    /// Prompt tokens computed per step, over all prefilling requests (at least one chunk of
    /// one request runs each step while any is waiting for its prompt).
    pub prefill_budget: usize,
    /// How the prefix cache may be used (see [`Reuse`]).
    pub reuse: Reuse,
}

/// How much K/V a request may take from the prefix cache and from running sequences.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reuse {
    /// As much as is cached (whole blocks, and a running sequence's partly filled block), with
    /// prompts computed in [`PREFILL_CHUNK`]-token chunks as llama.cpp computes them: a request
    /// that finds part of its prompt cached computes the rest in other forward calls than a
    /// lone run would, which can move the last bits of its logits (and so a sampled token).
    #[default]
    Most,
    /// Only K/V computed exactly as the request would compute it alone, so its output never
    /// depends on what ran before or beside it: whole [`PREFILL_CHUNK`]s of prompt from the
    /// start, each computed in one forward call of that many tokens (a lone run's first chunks);
    /// blocks computed otherwise (a prompt's last, shorter chunk; generated tokens) are not
    /// offered to other requests. Only prompts sharing at least one whole chunk gain.
    Exact,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_running: 8,
            seq_len: 0,
            prefill_budget: PREFILL_CHUNK,
            reuse: Reuse::Most,
        }
    }
}

/// A request and its sequence.
struct Slot {
    req: Request,
    seq: Sequence,
    /// Where the prompt's prefill chunks start (see the module invariants).
    origin: usize,
    /// Has not computed any of its prompt yet (it may still find more of it cached).
    fresh: bool,
    /// Its sequence is kept when it ends ([`Scheduler::take_sequence`]).
    keep: bool,
    /// Admission order: the highest is preempted first.
    order: u64,
}

impl Slot {
    fn prompt_len(&self) -> usize {
        self.req.spec.prompt.len()
    }
    fn prefilling(&self) -> bool {
        self.seq.n_cached < self.prompt_len()
    }
}

/// Counters over the scheduler's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub steps: u64,
    pub preemptions: u64,
    /// Rows of the decode forwards (one per request a step, plus draft rows).
    pub decode_rows: u64,
    pub prefill_tokens: u64,
    /// Prompt-lookup tokens drafted and kept.
    pub drafted: u64,
    pub accepted: u64,
}

#[derive(Default)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    waiting: VecDeque<Slot>,
    running: Vec<Slot>,
    cancelled: HashSet<RequestId>,
    kept: std::collections::HashMap<RequestId, Sequence>,
    next_order: u64,
    stats: SchedulerStats,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Scheduler {
        Scheduler {
            cfg: SchedulerConfig {
                max_running: cfg.max_running.max(1),
                prefill_budget: cfg.prefill_budget.max(1),
                ..cfg
            },
            ..Scheduler::default()
        }
    }

    /// Queues a request; its events come out of later steps. An empty prompt is refused at once.
    pub fn submit(&mut self, id: RequestId, spec: RequestSpec) -> Result<()> {
        anyhow::ensure!(
            !spec.prompt.is_empty(),
            "the prompt is empty: give at least one token"
        );
        self.waiting.push_back(Slot {
            req: Request::new(id, spec),
            seq: Sequence::default(),
            origin: 0,
            fresh: true,
            keep: false,
            order: 0,
        });
        Ok(())
    }

    /// [`Scheduler::submit`] on an existing sequence: the longest prefix of the prompt it holds
    /// cached is reused (beside what the prefix cache has), and the sequence, holding the prompt
    /// and the generated tokens, is kept when the request ends, for
    /// [`Scheduler::take_sequence`] (a conversation's next turn). A request that fails or is
    /// preempted loses the sequence's K/V, not its correctness.
    pub fn submit_on(&mut self, id: RequestId, spec: RequestSpec, seq: Sequence) -> Result<()> {
        self.submit(id, spec)?;
        let s = self.waiting.back_mut().expect("just queued");
        s.seq = seq;
        s.keep = true;
        Ok(())
    }

    /// The sequence of an ended request submitted with [`Scheduler::submit_on`].
    pub fn take_sequence(&mut self, id: RequestId) -> Option<Sequence> {
        self.kept.remove(&id)
    }

    /// A request has ended: its sequence is kept if asked for, else dropped (blocks back).
    fn retire(&mut self, s: Slot) {
        if s.keep {
            self.kept.insert(s.req.id, s.seq);
        }
    }

    /// Asks for a request to end; it reports `Done` (`Interrupted`) at the next step.
    pub fn cancel(&mut self, id: RequestId) {
        self.cancelled.insert(id);
    }

    /// Nothing waits or runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn n_running(&self) -> usize {
        self.running.len()
    }

    pub fn n_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn stats(&self) -> SchedulerStats {
        self.stats
    }

    /// [`Runner::reuse_prefix`], in [`Reuse::Exact`] cut back to a whole chunk (a boundary a lone
    /// run has there).
    fn reuse_aligned<B: Backend>(
        reuse: Reuse,
        runner: &mut Runner<B>,
        seq: &mut Sequence,
        tokens: &[u32],
    ) -> usize {
        let n = runner.reuse_prefix(seq, tokens);
        if reuse == Reuse::Most || n.is_multiple_of(PREFILL_CHUNK) {
            return n;
        }
        let aligned = n / PREFILL_CHUNK * PREFILL_CHUNK;
        runner.truncate(seq, aligned);
        seq.tokens.extend_from_slice(&tokens[aligned..]);
        aligned
    }

    fn seq_len<B: Backend>(&self, runner: &Runner<B>) -> usize {
        match self.cfg.seq_len {
            0 => runner.n_ctx(),
            n => n.min(runner.n_ctx()),
        }
    }

    /// One step; the events it produced are appended to `out` as `(request, event)`. An error
    /// is the model's (a backend failure): the requests in flight are then ended with it.
    pub fn step<B: Backend>(
        &mut self,
        runner: &mut Runner<B>,
        tok: &Tokenizer,
        out: &mut Vec<(RequestId, Event)>,
    ) -> Result<()> {
        self.stats.steps += 1;
        self.cancel_marked(out);
        self.admit(runner, out);
        let result = self
            .decode(runner, tok, out)
            .and_then(|()| self.prefill(runner, tok, out));
        if let Err(e) = &result {
            for s in self.running.drain(..).chain(self.waiting.drain(..)) {
                out.push((s.req.id, Event::Error(format!("{e:#}"))));
            }
        }
        result
    }

    fn cancel_marked(&mut self, out: &mut Vec<(RequestId, Event)>) {
        if self.cancelled.is_empty() {
            return;
        }
        let cancelled = std::mem::take(&mut self.cancelled);
        let mut gone = extract(&mut self.running, |s| cancelled.contains(&s.req.id));
        let waiting: Vec<Slot> = self.waiting.drain(..).collect();
        let (more, kept): (Vec<Slot>, Vec<Slot>) = waiting
            .into_iter()
            .partition(|s| cancelled.contains(&s.req.id));
        self.waiting = kept.into();
        gone.extend(more);
        for mut s in gone {
            let mut ev = Vec::new();
            s.req.finish(StopReason::Interrupted, &mut ev);
            out.extend(ev.into_iter().map(|e| (s.req.id, e)));
            self.retire(s);
        }
    }

    /// Moves waiting requests to running, oldest first, while there is room: a running slot,
    /// and blocks for the whole prompt plus one block per running request to grow into.
    fn admit<B: Backend>(&mut self, runner: &mut Runner<B>, out: &mut Vec<(RequestId, Event)>) {
        while self.running.len() < self.cfg.max_running {
            let Some(mut s) = self.waiting.pop_front() else {
                break;
            };
            let pool = runner.pool().clone();
            // A preempted request resumes with everything it had; a new one has its prompt
            // (its sequence may hold an earlier conversation turn to reuse).
            let all: Vec<u32> = if s.fresh {
                s.req.spec.prompt.clone()
            } else {
                s.seq.tokens.clone()
            };
            let seq_len = self.seq_len(runner);
            if all.len() + 1 > seq_len {
                let mut ev = Vec::new();
                if s.req.generated() > 0 {
                    // Only generated tokens made it too long: it ends as a lone run would.
                    s.req.finish(StopReason::ContextFull, &mut ev);
                    out.extend(ev.into_iter().map(|e| (s.req.id, e)));
                } else {
                    out.push((
                        s.req.id,
                        Event::Error(format!(
                            "the prompt has {} tokens and a sequence may hold {seq_len} (raise --ctx)",
                            s.prompt_len(),
                        )),
                    ));
                }
                continue;
            }
            // Reuse what is cached, then see whether the rest fits beside the running requests.
            let reused = Self::reuse_aligned(self.cfg.reuse, runner, &mut s.seq, &all);
            let need = pool
                .blocks_for(all.len() + 1)
                .saturating_sub(s.seq.blocks.len())
                + self.running.len();
            if !self.running.is_empty() && !pool.can_allocate(need) {
                s.seq = Sequence {
                    tokens: all,
                    ..Sequence::default()
                };
                self.waiting.push_front(s);
                break;
            }
            if s.fresh {
                s.origin = reused;
            } else {
                // Resuming after preemption: recompute the prompt in the chunks it had.
                let n = s.seq.n_cached;
                if n < s.prompt_len() {
                    if n >= s.origin {
                        let keep = s.origin + (n - s.origin) / PREFILL_CHUNK * PREFILL_CHUNK;
                        runner.truncate(&mut s.seq, keep);
                        s.seq.tokens = all;
                    } else {
                        s.origin = n;
                    }
                }
            }
            s.order = self.next_order;
            self.next_order += 1;
            self.running.push(s);
        }
    }

    /// Frees the newest running request's blocks and puts it back at the head of the queue.
    /// Returns false when none but `keep` runs.
    fn preempt_newest(&mut self, keep: Option<u64>) -> bool {
        let Some(i) = (0..self.running.len())
            .filter(|&i| Some(self.running[i].order) != keep)
            .max_by_key(|&i| self.running[i].order)
        else {
            return false;
        };
        let mut s = self.running.remove(i);
        let tokens = std::mem::take(&mut s.seq.tokens);
        // Dropping the old sequence gives its blocks back (full ones stay cached).
        s.seq = Sequence {
            tokens,
            ..Sequence::default()
        };
        self.waiting.push_front(s);
        self.stats.preemptions += 1;
        true
    }

    /// One row-invariant forward over every running sequence past its prompt.
    fn decode<B: Backend>(
        &mut self,
        runner: &mut Runner<B>,
        tok: &Tokenizer,
        out: &mut Vec<(RequestId, Event)>,
    ) -> Result<()> {
        let mut need;
        loop {
            need = self
                .running
                .iter()
                .filter(|s| !s.prefilling())
                .map(|s| {
                    s.seq
                        .tokens
                        .len()
                        .div_ceil(BLOCK_SIZE)
                        .saturating_sub(s.seq.blocks.len())
                })
                .sum::<usize>();
            if need == 0 || runner.pool().can_allocate(need) {
                break;
            }
            if !self.preempt_newest(None) {
                break;
            }
        }
        let seq_len = self.seq_len(runner);
        let mut rows: Vec<&mut Slot> = self
            .running
            .iter_mut()
            .filter(|s| !s.prefilling())
            .collect();
        if rows.is_empty() {
            return Ok(());
        }
        // Prompt-lookup drafts ride along as more rows of their sequence, where the pool has room.
        let mut spare = runner.pool().n_available().saturating_sub(need);
        let mut drafts = Vec::with_capacity(rows.len());
        for s in rows.iter_mut() {
            let base = s.seq.tokens.len();
            let room = (s.req.spec.params.max_tokens)
                .saturating_sub(s.req.generated() + 1)
                .min(seq_len.saturating_sub(base + 1));
            let mut d = match &mut s.req.lookup {
                Some(l) => l.draft(&s.seq.tokens, room),
                None => Vec::new(),
            };
            if let Some(c) = &mut s.req.constraint {
                // Only drafts the constraint accepts are worth verifying.
                d.truncate(c.accepted_prefix(&d));
            }
            let held = s.seq.blocks.len().max(base.div_ceil(BLOCK_SIZE));
            let extra = (base + d.len()).div_ceil(BLOCK_SIZE).saturating_sub(held);
            if extra > spare {
                d.clear();
            } else {
                spare -= extra;
            }
            s.seq.tokens.extend_from_slice(&d);
            drafts.push(d);
        }
        // A decode row without drafts samples on the device where the backend and its request
        // allow it (every such row of the step in one go: only their ids come back); rows with
        // drafts sample on the host, so a request sampled on the device takes its RNG state
        // back first.
        for (s, d) in rows.iter_mut().zip(&drafts) {
            let single = d.is_empty() && s.seq.tokens.len() == s.seq.n_cached + 1;
            if single && s.req.device.is_none() {
                if let Some(ds) = s.req.device_sampling(runner.vocab_size()) {
                    s.req.device = runner.model.backend.device_sampler(&ds);
                    if s.req.device.is_none() {
                        s.req.refuse_device();
                    }
                }
            }
            if !single {
                if let Some(d) = &s.req.device {
                    let rng = runner.model.backend.device_sampler_rng(d)?;
                    s.req.leave_device(rng);
                }
            }
        }
        // Logits from the last chosen token on: one row, or one per draft plus one.
        let from: Vec<usize> = rows
            .iter()
            .zip(&drafts)
            .map(|(s, d)| s.seq.tokens.len() - d.len() - 1)
            .collect();
        let stepped = {
            let windows: Vec<Vec<u32>> = rows
                .iter()
                .map(|s| match s.req.device {
                    Some(_) => s.req.penalty_window(&s.seq.tokens),
                    None => Vec::new(),
                })
                .collect();
            let mut seqs = Vec::with_capacity(rows.len());
            let mut devices = Vec::with_capacity(rows.len());
            let mut constraints = Vec::new();
            for (s, w) in rows.iter_mut().zip(&windows) {
                seqs.push(&mut s.seq);
                devices.push(s.req.device.as_mut().map(|d| (d, &w[..])));
                constraints.extend(s.req.constraint.as_deref_mut());
            }
            self.stats.decode_rows += seqs
                .iter()
                .map(|s| s.tokens.len() - s.n_cached)
                .sum::<usize>() as u64;
            let reuse = self.cfg.reuse == Reuse::Most;
            if constraints.is_empty() {
                runner.step_sampled(&mut seqs, &from, &mut devices, true, reuse)?
            } else {
                // Each constrained sequence's next mask is computed while the forward runs;
                // a failure shows again (as the request's error) when the mask is applied.
                std::thread::scope(|scope| {
                    let masks = scope.spawn(move || {
                        for c in constraints {
                            let _ = c.prepare();
                        }
                    });
                    let stepped = runner.step_sampled(&mut seqs, &from, &mut devices, true, reuse);
                    if let Err(panic) = masks.join() {
                        std::panic::resume_unwind(panic);
                    }
                    stepped
                })?
            }
        };
        let mut done = Vec::new();
        for ((s, stepped), d) in rows.iter_mut().zip(stepped).zip(drafts) {
            let rows = match stepped {
                Stepped::Logits(rows) => rows,
                Stepped::Token(id) => {
                    let room = s.seq.tokens.len() + 1 < seq_len;
                    let mut ev = Vec::new();
                    let (next, alive) = s.req.on_device_token(id, tok, room, &mut ev);
                    out.extend(ev.into_iter().map(|e| (s.req.id, e)));
                    s.seq.tokens.extend(next);
                    if !alive {
                        done.push(s.req.id);
                    }
                    continue;
                }
            };
            let base = s.seq.tokens.len() - d.len();
            let (mut accepted, mut alive) = (0, true);
            for (j, l) in rows.iter().enumerate() {
                // The rows verify the drafts in order: a draft stays if the request's own
                // sampler picks it after the tokens before it, as plain decoding would.
                s.seq.tokens.truncate(base + j);
                alive = feed(s, l, tok, seq_len, out);
                let kept = j < d.len() && s.seq.tokens.get(base + j) == Some(&d[j]);
                if !alive || !kept {
                    break;
                }
                accepted += 1;
            }
            if !d.is_empty() {
                // K/V hold the chosen token and the kept drafts; the token after them is new.
                let next = s.seq.tokens.get(base + accepted).copied();
                runner.truncate(&mut s.seq, base + accepted);
                s.seq.tokens.extend(next);
            }
            if !alive {
                done.push(s.req.id);
            }
            if let Some(l) = &mut s.req.lookup {
                if !d.is_empty() {
                    l.verdict(d.len(), accepted);
                    self.stats.drafted += d.len() as u64;
                    self.stats.accepted += accepted as u64;
                }
            }
            rows.into_iter().for_each(|l| runner.recycle(l));
        }
        for s in extract(&mut self.running, |s| done.contains(&s.req.id)) {
            self.retire(s);
        }
        Ok(())
    }

    /// Prompt chunks of the requests still computing their prompts, oldest first, up to the
    /// step's token budget (at least one chunk). Each chunk is its own forward call.
    fn prefill<B: Backend>(
        &mut self,
        runner: &mut Runner<B>,
        tok: &Tokenizer,
        out: &mut Vec<(RequestId, Event)>,
    ) -> Result<()> {
        let mut budget = self.cfg.prefill_budget;
        let mut first = true;
        loop {
            let Some(order) = self
                .running
                .iter()
                .filter(|s| s.prefilling())
                .map(|s| s.order)
                .min()
            else {
                return Ok(());
            };
            let at = |v: &Vec<Slot>| v.iter().position(|s| s.order == order).unwrap();
            let i = at(&self.running);
            let s = &mut self.running[i];
            if s.fresh {
                // Requests ahead of it may have cached more of its prompt since it was admitted.
                let prompt = s.req.spec.prompt.clone();
                let mut reused = Self::reuse_aligned(self.cfg.reuse, runner, &mut s.seq, &prompt);
                // A running sequence may hold more of it, past the last full block: share its
                // blocks up to there (the partly shared block is copied on the first write).
                // Only past a whole block in common: below that the request shares nothing,
                // so its numerics stay a lone run's (see the module invariants).
                let limit = prompt.len() - 1;
                let best = self
                    .running
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| j != i)
                    .map(|(j, o)| {
                        let held = &o.seq.tokens[..o.seq.n_cached];
                        (
                            j,
                            held.iter().zip(&prompt).take_while(|(a, b)| a == b).count(),
                        )
                    })
                    .max_by_key(|&(_, n)| n);
                let partial = self.cfg.reuse == Reuse::Most;
                if let Some((j, n)) =
                    best.filter(|&(_, n)| partial && n >= BLOCK_SIZE && n.min(limit) > reused)
                {
                    let n = n.min(limit);
                    let mut table = self.running[j].seq.blocks.share();
                    table.truncate(n);
                    let s = &mut self.running[i];
                    s.seq.blocks = table;
                    s.seq.tokens = prompt.clone();
                    s.seq.n_cached = n;
                    reused = n;
                }
                let s = &mut self.running[i];
                runner.pool().count(reused, prompt.len() - reused);
                s.req.reused = reused;
                s.origin = reused;
                s.fresh = false;
            }
            let s = &mut self.running[i];
            let end = s.prompt_len();
            let stop = (s.seq.n_cached + PREFILL_CHUNK).min(end);
            if !first && stop - s.seq.n_cached > budget {
                return Ok(());
            }
            let need = stop.div_ceil(BLOCK_SIZE).saturating_sub(s.seq.blocks.len());
            while !runner.pool().can_allocate(need) {
                if !self.preempt_newest(Some(order)) {
                    let s = self.running.remove(at(&self.running));
                    let msg = "the KV cache cannot hold this prompt (raise --ctx)";
                    out.push((s.req.id, Event::Error(msg.into())));
                    return Ok(());
                }
            }
            let i = at(&self.running);
            let s = &mut self.running[i];
            let before = s.seq.n_cached;
            // In `Reuse::Exact` only whole chunks from the start are offered to others.
            let register = self.cfg.reuse == Reuse::Most
                || (stop - before == PREFILL_CHUNK && before.is_multiple_of(PREFILL_CHUNK));
            let logits = runner.prefill_chunk(&mut s.seq, s.origin, end, register)?;
            let done = s.seq.n_cached - before;
            self.stats.prefill_tokens += done as u64;
            budget = budget.saturating_sub(done);
            first = false;
            // A resumed request already has its next tokens: its logits here are not needed.
            if let Some(l) = logits.filter(|_| s.seq.tokens.len() == end) {
                let seq_len = self.seq_len(runner);
                let s = &mut self.running[i];
                let alive = feed(s, &l, tok, seq_len, out);
                runner.recycle(l);
                if !alive {
                    let s = self.running.remove(i);
                    self.retire(s);
                }
            }
            if budget == 0 {
                return Ok(());
            }
        }
    }
}

/// Gives a slot the logits after its last token; appends the sampled token. False once finished.
fn feed(
    s: &mut Slot,
    logits: &[f32],
    tok: &Tokenizer,
    n_ctx: usize,
    out: &mut Vec<(RequestId, Event)>,
) -> bool {
    let mut ev = Vec::new();
    let room = s.seq.tokens.len() + 1 < n_ctx;
    let (next, alive) = s.req.on_logits(logits, &s.seq.tokens, tok, room, &mut ev);
    out.extend(ev.into_iter().map(|e| (s.req.id, e)));
    s.seq.tokens.extend(next);
    alive
}

/// Removes and returns the elements `pick` chooses, keeping the others' order.
fn extract<T>(v: &mut Vec<T>, pick: impl Fn(&T) -> bool) -> Vec<T> {
    let mut taken = Vec::new();
    let mut i = 0;
    while i < v.len() {
        if pick(&v[i]) {
            taken.push(v.remove(i));
        } else {
            i += 1;
        }
    }
    taken
}

/// One request alone through a scheduler, as `infer run` and the chat REPL run it, on `seq`
/// (whose cached prefix is reused where it matches; afterwards it holds the prompt and the
/// generated tokens): its events go to `on_event` as they come, `cancel` is polled before every
/// step (the request then ends `Interrupted`), and `progress(done, total)` follows the prompt's
/// chunks. Returns the stats of its `Done`.
pub fn run_one<B: Backend>(
    runner: &mut Runner<B>,
    tok: &Tokenizer,
    seq: &mut Sequence,
    spec: RequestSpec,
    cancel: &std::sync::atomic::AtomicBool,
    progress: &mut dyn FnMut(usize, usize),
    mut on_event: impl FnMut(&Event) -> Result<()>,
) -> Result<crate::engine::generate::GenStats> {
    let total = spec.prompt.len();
    let mut sched = Scheduler::new(SchedulerConfig {
        max_running: 1,
        ..SchedulerConfig::default()
    });
    sched.submit_on(0, spec, std::mem::take(seq))?;
    let mut events = Vec::new();
    loop {
        if cancel.load(std::sync::atomic::Ordering::Relaxed) {
            sched.cancel(0);
        }
        sched.step(runner, tok, &mut events)?;
        if let Some(s) = sched.running.first().filter(|s| s.prefilling()) {
            progress(s.seq.n_cached - s.req.reused, total - s.req.reused);
        }
        for (_, e) in events.drain(..) {
            match e {
                Event::Done(stats) => {
                    *seq = sched.take_sequence(0).expect("kept for its submitter");
                    on_event(&Event::Done(stats.clone()))?;
                    return Ok(stats);
                }
                Event::Error(m) => anyhow::bail!("{m}"),
                e => on_event(&e)?,
            }
        }
    }
}
