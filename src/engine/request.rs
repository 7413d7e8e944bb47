//! A generation request: its prompt, parameters, and everything that turns logits into output —
//! the sampler, the stop-string matcher and the UTF-8 stream decoder. The scheduler feeds it the
//! logits after its sequence's last token; it answers with the token to append (or none: it is
//! finished) and emits [`Event`]s. Invariants: text is emitted only once it is whole UTF-8 and
//! cannot be the start of a stop string, a stop string itself is never emitted, and exactly one
//! `Done` ends every request's events.

use std::time::Instant;

use crate::engine::constraint::Constraint;
use crate::engine::generate::{GenParams, GenStats, StopReason, TokenLogprobs};
use crate::engine::sampler::{log_softmax_top, Sampler};
use crate::engine::speculative::{next_draft_len, PromptLookup};
use crate::engine::stop::StopMatcher;
use crate::model::backend::{DeviceSampler, DeviceSampling};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// Identifies a request to its submitter.
pub type RequestId = u64;

/// What a request reports.
#[derive(Clone, Debug)]
pub enum Event {
    /// A generated token and the text it releases (possibly empty).
    Token {
        id: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    /// Text held back until the end (a partial stop string that never completed, an unfinished
    /// UTF-8 sequence).
    Tail(String),
    /// The request is over; nothing follows.
    Done(GenStats),
    /// The request failed; nothing follows.
    Error(String),
}

/// A request's prompt and settings.
#[derive(Clone, Debug)]
pub struct RequestSpec {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    /// `Some(n)`: each token carries its log-probability and the `n` most likely tokens.
    pub logprobs: Option<usize>,
    /// Prompt-lookup speculation: n-grams up to `ngram`, drafts of up to `draft_max` tokens,
    /// verified as more rows of the scheduler's batch. The output is unchanged by it.
    pub lookup: Option<LookupSpec>,
}

/// See [`RequestSpec::lookup`].
#[derive(Clone, Copy, Debug)]
pub struct LookupSpec {
    pub ngram: usize,
    pub draft_max: usize,
}

/// A request's prompt-lookup drafter and its counters.
pub struct Lookup {
    drafter: PromptLookup,
    /// The next draft's length ([`next_draft_len`], as `engine::speculative` adapts it).
    k: usize,
    max: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl Lookup {
    /// Up to `room` tokens to verify after `history` (empty when no n-gram recurs).
    pub fn draft(&mut self, history: &[u32], room: usize) -> Vec<u32> {
        let n = self.k.min(room);
        if n == 0 {
            return Vec::new();
        }
        self.drafter.draft(history, n)
    }

    /// Records how many of `drafted` tokens the target kept.
    pub fn verdict(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted;
        self.accepted += accepted;
        self.k = next_draft_len(self.k, drafted, accepted, self.max);
    }
}

pub struct Request {
    pub id: RequestId,
    pub spec: RequestSpec,
    sampler: Sampler,
    stops: StopMatcher,
    utf8: StreamDecoder,
    generated: usize,
    /// Prompt tokens found cached when first admitted.
    pub reused: usize,
    arrived: Instant,
    first_token: Option<Instant>,
    pub lookup: Option<Lookup>,
    /// Structured output (taken from the spec's parameters): masks every step's logits.
    pub constraint: Option<Box<Constraint>>,
    /// The constrained copy of a step's logits (reused from step to step).
    masked: Vec<f32>,
    /// The request's sampler on the device, while its tokens are sampled there (see
    /// `Scheduler::decode`).
    pub device: Option<DeviceSampler>,
    /// The backend offered no device sampler for it.
    device_refused: bool,
}

impl Request {
    pub fn new(id: RequestId, mut spec: RequestSpec) -> Request {
        Request {
            constraint: spec.params.constraint.take(),
            masked: Vec::new(),
            device: None,
            device_refused: false,
            id,
            sampler: Sampler::new(spec.params.sampler.clone()),
            stops: StopMatcher::new(spec.params.stop.clone()),
            utf8: StreamDecoder::new(),
            lookup: spec.lookup.map(|l| Lookup {
                drafter: PromptLookup::new(l.ngram),
                k: l.draft_max.clamp(1, 4),
                max: l.draft_max.max(1),
                drafted: 0,
                accepted: 0,
            }),
            spec,
            generated: 0,
            reused: 0,
            arrived: Instant::now(),
            first_token: None,
        }
    }

    pub fn generated(&self) -> usize {
        self.generated
    }

    /// Why generation ends at the end of the structure (or at an end token): `Length` when the
    /// budget made the constraint close it early.
    fn structure_end(&self) -> StopReason {
        if self
            .constraint
            .as_deref()
            .is_some_and(Constraint::closed_by_budget)
        {
            StopReason::Length
        } else {
            StopReason::Eos
        }
    }

    /// Takes the logits after the last token of `history` (prompt and generated tokens), samples
    /// the next token and reports it. Returns the token to append to the sequence (none for an
    /// end-of-generation token) and whether the request goes on; once it does not, its `Done` is
    /// in `out`. `room` says whether the context has space for another token.
    pub fn on_logits(
        &mut self,
        logits: &[f32],
        history: &[u32],
        tok: &Tokenizer,
        room: bool,
        out: &mut Vec<Event>,
    ) -> (Option<u32>, bool) {
        if self.out_of_budget(out) {
            return (None, false);
        }
        let logits = match &mut self.constraint {
            Some(c) => {
                self.masked.clear();
                self.masked.extend_from_slice(logits);
                let remaining = self.spec.params.max_tokens - self.generated;
                if let Err(e) = c.apply_within(&mut self.masked, remaining) {
                    out.push(Event::Error(format!("{e:#}")));
                    return (None, false);
                }
                &self.masked[..]
            }
            None => logits,
        };
        let id = self.sampler.sample(logits, history);
        if let Some(c) = &mut self.constraint {
            if let Err(e) = c.commit(id) {
                out.push(Event::Error(format!("{e:#}")));
                return (None, false);
            }
        }
        // A token that ends the request is not reported: no log-probabilities for it.
        let logprobs = self
            .spec
            .logprobs
            .filter(|_| !self.ends_on(id, tok))
            .map(|n| {
                let (logprob, top) = log_softmax_top(logits, id, n);
                TokenLogprobs { logprob, top }
            });
        self.accept(id, logprobs, tok, room, out)
    }

    /// Whether `id` ends the request: an end-of-generation token, unless `ignore_eos` (which a
    /// constraint overrides: its structure ends there).
    fn ends_on(&self, id: u32, tok: &Tokenizer) -> bool {
        tok.is_eog(id) && (!self.spec.params.ignore_eos || self.constraint.is_some())
    }

    /// Ends the request (`Length`) if it has generated all it may; before sampling.
    fn out_of_budget(&mut self, out: &mut Vec<Event>) -> bool {
        let done = self.generated >= self.spec.params.max_tokens;
        if done {
            self.finish(StopReason::Length, out);
        }
        done
    }

    /// Takes the chosen token `id`: an end of generation ends the request (unless `ignore_eos`
    /// without a constraint), anything else is emitted with `logprobs`.
    fn accept(
        &mut self,
        id: u32,
        logprobs: Option<TokenLogprobs>,
        tok: &Tokenizer,
        room: bool,
        out: &mut Vec<Event>,
    ) -> (Option<u32>, bool) {
        self.first_token.get_or_insert_with(Instant::now);
        if self.ends_on(id, tok) {
            self.finish(self.structure_end(), out);
            return (None, false);
        }
        self.emit(id, logprobs, tok, room, out)
    }

    /// The parameters to sample this request on the device from now on, or None where it must
    /// stay on the host: structured output (its masks), log-probabilities and prompt-lookup
    /// drafts need the logits, some configurations are not sampled on the device
    /// (`Sampler::device_sampling`), or `INFER_DEVICE_SAMPLING=0`.
    pub fn device_sampling(&self, n_vocab: usize) -> Option<DeviceSampling> {
        if self.device_refused
            || self.constraint.is_some()
            || self.spec.logprobs.is_some()
            || self.lookup.is_some()
            || !device_sampling_allowed()
        {
            return None;
        }
        self.sampler.device_sampling(n_vocab)
    }

    /// Records that the backend offered no device sampler: the request stays on the host.
    pub fn refuse_device(&mut self) {
        self.device_refused = true;
    }

    /// The penalty window of the request's sampler over `history`.
    pub fn penalty_window(&self, history: &[u32]) -> Vec<u32> {
        self.sampler.penalty_window(history).to_vec()
    }

    /// Back to host sampling, the host RNG continuing from the device's state `rng`.
    pub fn leave_device(&mut self, rng: [u64; 4]) {
        self.sampler.set_rng_state(rng);
        self.device = None;
    }

    /// [`Request::on_logits`] for a token the device sampler picked (no constraint, no
    /// log-probabilities: see [`Request::device_sampling`]).
    pub fn on_device_token(
        &mut self,
        id: u32,
        tok: &Tokenizer,
        room: bool,
        out: &mut Vec<Event>,
    ) -> (Option<u32>, bool) {
        if self.out_of_budget(out) {
            return (None, false);
        }
        self.accept(id, None, tok, room, out)
    }

    /// Reports the sampled token `id` and decides whether the request goes on (the end of
    /// [`Request::accept`]).
    fn emit(
        &mut self,
        id: u32,
        logprobs: Option<TokenLogprobs>,
        tok: &Tokenizer,
        room: bool,
        out: &mut Vec<Event>,
    ) -> (Option<u32>, bool) {
        self.generated += 1;
        let text = self.utf8.push(&tok.token_bytes(id));
        let (text, hit) = self.stops.push(&text);
        out.push(Event::Token { id, text, logprobs });
        let reason = if hit {
            StopReason::StopString
        } else if self
            .constraint
            .as_deref()
            .is_some_and(Constraint::is_finished)
        {
            // The structure is complete and nothing may follow: end as the model would.
            self.structure_end()
        } else if self.generated >= self.spec.params.max_tokens {
            StopReason::Length
        } else if !room {
            StopReason::ContextFull
        } else {
            return (Some(id), true);
        };
        self.finish(reason, out);
        (Some(id), false)
    }

    /// Ends the request: releases held-back text (unless a stop string ended it) and reports
    /// `Done`.
    pub fn finish(&mut self, reason: StopReason, out: &mut Vec<Event>) {
        if reason != StopReason::StopString {
            let tail = self.utf8.flush();
            let tail = self.stops.push(&tail).0 + &self.stops.finish();
            if !tail.is_empty() {
                out.push(Event::Tail(tail));
            }
        }
        let now = Instant::now();
        let first = self.first_token.unwrap_or(now);
        let prompt = self.spec.prompt.len();
        out.push(Event::Done(GenStats {
            prompt_tokens: prompt - self.reused.min(prompt),
            reused_tokens: self.reused.min(prompt),
            generated_tokens: self.generated,
            prompt_secs: (first - self.arrived).as_secs_f64(),
            gen_secs: (now - first).as_secs_f64(),
            stop: reason,
        }));
    }
}

/// `INFER_DEVICE_SAMPLING=0` keeps sampling on the host (read once per process).
pub(crate) fn device_sampling_allowed() -> bool {
    static ALLOWED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ALLOWED.get_or_init(|| std::env::var("INFER_DEVICE_SAMPLING").map_or(true, |v| v != "0"))
}
