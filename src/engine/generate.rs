//! The generation loop: prefill a prompt, then sample, stream and stop. Text reaches the caller only
//! once it is whole UTF-8 and cannot be the start of a stop string; a stop string itself is never
//! emitted. The loop checks a cancel flag every token so Ctrl-C ends it cleanly.
//! [`generate_with`] adds optional per-token log-probabilities and prefill progress; neither
//! changes which tokens are sampled.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Result;

use crate::engine::constraint::Constraint;
use crate::engine::runner::{Runner, Sequence};
use crate::engine::sampler::{log_softmax_top, Sampler, SamplerConfig};
use crate::engine::speculative::Speculator;
use crate::engine::stop::StopMatcher;
use crate::model::backend::DeviceSampler;
use crate::model::Backend;
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Clone, Debug)]
pub struct GenParams {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (benchmarks that want `max_tokens` each).
    pub ignore_eos: bool,
    /// Structured output: the tokens the constraint allows are the only ones sampled, and the
    /// end of generation comes where the structure is complete (each run clones it fresh).
    pub constraint: Option<Box<Constraint>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    Eos,
    /// `max_tokens` were generated.
    Length,
    /// A stop string appeared in the output.
    StopString,
    /// The cancel flag was raised (Ctrl-C).
    Interrupted,
    /// The context window is full.
    ContextFull,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::Length => "length",
            StopReason::StopString => "stop_string",
            StopReason::Interrupted => "interrupted",
            StopReason::ContextFull => "context_full",
        }
    }
}

#[derive(Clone, Debug)]
pub struct GenStats {
    /// Prompt tokens computed (excludes a reused cached prefix).
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was reused from the cache.
    pub reused_tokens: usize,
    pub generated_tokens: usize,
    pub prompt_secs: f64,
    pub gen_secs: f64,
    pub stop: StopReason,
}

impl GenStats {
    pub fn prompt_tps(&self) -> f64 {
        rate(self.prompt_tokens, self.prompt_secs)
    }
    /// Decode speed: tokens after the first (whose logits came from the prefill) over decode time.
    pub fn gen_tps(&self) -> f64 {
        rate(self.generated_tokens.saturating_sub(1), self.gen_secs)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

/// Log-probabilities of a generated token (see [`log_softmax_top`]: the log-softmax of the raw
/// logits at temperature 1, whatever the sampling settings).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// `ln p` of the generated token.
    pub logprob: f32,
    /// The most likely tokens as `(id, ln p)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// What [`generate_with`] reports per step: a generated token (`id` set) with the text it
/// releases (possibly empty), or (`id` unset) the text held back until the end.
#[derive(Clone, Debug)]
pub struct TokenEvent<'a> {
    pub id: Option<u32>,
    pub text: &'a str,
    /// Set for generated tokens when [`GenHooks::logprobs`] asks for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// A callback given a row of logits.
pub type LogitsHook<'a> = dyn FnMut(&[f32]) + 'a;

/// Optional extras of [`generate_with`]; `Default` asks for none.
#[derive(Default)]
pub struct GenHooks<'a> {
    /// `Some(n)`: each generated token carries its log-probability and the `n` most likely tokens.
    pub logprobs: Option<usize>,
    /// Called with `(computed, total)` prompt tokens after each prefill chunk.
    pub prefill_progress: Option<&'a mut dyn FnMut(usize, usize)>,
    /// Speculative decoding (see `speculative`); its counters are updated.
    pub spec: Option<&'a mut Speculator>,
    /// The logits after the prompt's last token when `seq` already caches the whole prompt (a
    /// prompt cache hit): nothing is computed before the first token.
    pub prefilled: Option<Vec<f32>>,
    /// Called once with the logits after the prompt (computed or prefilled), before sampling.
    pub on_prefill: Option<&'a mut LogitsHook<'a>>,
    /// `Some(keep)`: when the context is full, drop the oldest block of positions after the
    /// blocks holding the first `keep` and go on ([`Runner::shift`], StreamingLLM's attention
    /// sinks) instead of stopping. Not with speculation.
    pub context_shift: Option<usize>,
}

/// Generates a continuation of `prompt` in `seq` (whose cached prefix is reused where it matches).
/// `on_token(Some(id), text)` receives each generated token and the text it releases (possibly empty);
/// `on_token(None, text)` the text held back until the end.
pub fn generate<B: Backend>(
    runner: &mut Runner<B>,
    seq: &mut Sequence,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenParams,
    cancel: &AtomicBool,
    mut on_token: impl FnMut(Option<u32>, &str) -> Result<()>,
) -> Result<GenStats> {
    let hooks = GenHooks::default();
    generate_with(runner, seq, tok, prompt, params, cancel, hooks, |e| {
        on_token(e.id, e.text)
    })
}

/// [`generate`] with [`GenHooks`]: per-token log-probabilities and prefill progress.
#[allow(clippy::too_many_arguments)]
pub fn generate_with<B: Backend>(
    runner: &mut Runner<B>,
    seq: &mut Sequence,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenParams,
    cancel: &AtomicBool,
    hooks: GenHooks<'_>,
    mut on_token: impl FnMut(TokenEvent<'_>) -> Result<()>,
) -> Result<GenStats> {
    anyhow::ensure!(
        !prompt.is_empty(),
        "the prompt is empty: give at least one token"
    );
    anyhow::ensure!(
        hooks.context_shift.is_none() || hooks.spec.is_none(),
        "shifting the context does not work with speculative decoding"
    );
    let context_shift = hooks.context_shift;
    // Tokens a context shift dropped from `seq` (they stay emitted).
    let mut shifted = 0;
    let t0 = Instant::now();
    let (reused, mut logits) = match hooks.prefilled {
        Some(l) => {
            anyhow::ensure!(
                seq.tokens == prompt && seq.n_cached == prompt.len(),
                "prefilled logits need the whole prompt cached"
            );
            (prompt.len(), l)
        }
        None => {
            let reused = runner.reuse_prefix(seq, prompt);
            let logits = match hooks.prefill_progress {
                Some(p) => runner.compute_progress(seq, p)?,
                None => runner.compute(seq)?,
            };
            (reused, logits)
        }
    };
    runner.pool().count(reused, prompt.len() - reused);
    if let Some(f) = hooks.on_prefill {
        f(&logits);
    }
    let prompt_secs = t0.elapsed().as_secs_f64();

    let mut sampler = Sampler::new(params.sampler.clone());
    let mut constraint = params.constraint.clone();
    let mut stops = StopMatcher::new(params.stop.clone());
    let mut utf8 = StreamDecoder::new();
    let t1 = Instant::now();
    let mut generated = 0;
    let mut spec = hooks.spec;
    // Speculation: verified tokens (already in `seq`, cached) with the logits after each, and the
    // token decided where verification stopped.
    let mut verified: std::collections::VecDeque<(u32, Vec<f32>)> = Default::default();
    let mut decided: Option<u32> = None;
    let emitted_base = seq.tokens.len();
    // Sampling on the device: after the first token (sampled here from the prompt's logits), the
    // backend picks each token where the logits are and only its id comes back, when it can
    // (CUDA with the output head on the GPU), the configuration is one it samples exactly as the
    // host would (`Sampler::device_sampling`), and nothing else needs the logits on the host
    // (structured output, log-probabilities, speculation). Its RNG continues from the host
    // sampler's, so the tokens are the host path's. `INFER_DEVICE_SAMPLING=0` turns it off.
    let mut device_ok = hooks.logprobs.is_none()
        && constraint.is_none()
        && spec.is_none()
        && crate::engine::request::device_sampling_allowed();
    let mut device: Option<DeviceSampler> = None;
    let stop = loop {
        if cancel.load(Ordering::Relaxed) {
            break StopReason::Interrupted;
        }
        if generated >= params.max_tokens {
            break StopReason::Length;
        }
        let next_verified = verified.pop_front();
        // The decided token comes after every verified one: take it only once they are out.
        let id = match &next_verified {
            Some((d, _)) => *d,
            None => match decided.take() {
                Some(d) => d,
                None => {
                    if let Some(c) = &mut constraint {
                        c.apply_within(&mut logits, params.max_tokens - generated)?;
                    }
                    sampler.sample(&logits, &seq.tokens[..emitted_base + generated - shifted])
                }
            },
        };
        if let Some(c) = &mut constraint {
            c.commit(id)?;
        }
        if tok.is_eog(id) && (!params.ignore_eos || constraint.is_some()) {
            break structure_end(constraint.as_deref());
        }
        let logprobs = hooks.logprobs.map(|n| {
            let (logprob, top) = log_softmax_top(&logits, id, n);
            TokenLogprobs { logprob, top }
        });
        generated += 1;
        if next_verified.is_none() {
            seq.tokens.push(id);
        }
        let text = utf8.push(&tok.token_bytes(id));
        let (emit, hit) = stops.push(&text);
        on_token(TokenEvent {
            id: Some(id),
            text: &emit,
            logprobs,
        })?;
        if hit {
            break StopReason::StopString;
        }
        if constraint.as_deref().is_some_and(Constraint::is_finished) {
            // The structure is complete and nothing may follow: end as the model would.
            break structure_end(constraint.as_deref());
        }
        if generated >= params.max_tokens {
            break StopReason::Length;
        }
        if seq.tokens.len() >= runner.n_ctx() {
            match context_shift {
                Some(keep) => shifted += runner.shift(seq, keep, 1)?,
                None => break StopReason::ContextFull,
            }
        }
        logits = match (next_verified, spec.as_deref_mut()) {
            (Some((_, after)), _) => after,
            (None, Some(s)) => {
                let room = params.max_tokens - generated;
                let step = s.step(runner, seq, room, &mut sampler, constraint.as_deref_mut())?;
                verified = step.accepted;
                decided = step.rejected_with;
                step.logits
            }
            (None, None) if device_ok => {
                if !logits.is_empty() {
                    runner.recycle(std::mem::take(&mut logits));
                }
                if device.is_none() {
                    device = sampler
                        .device_sampling(runner.vocab_size())
                        .and_then(|s| runner.model.backend.device_sampler(&s));
                    device_ok = device.is_some();
                }
                match device.as_mut() {
                    Some(d) => {
                        let history = &seq.tokens[..emitted_base + generated - shifted];
                        let window = sampler.penalty_window(history).to_vec();
                        decided = Some(runner.compute_sampled(seq, d, &window, true)?);
                        Vec::new()
                    }
                    None => runner.compute(seq)?,
                }
            }
            (None, None) => {
                runner.recycle(std::mem::take(&mut logits));
                match constraint.as_deref_mut() {
                    // The next mask is computed while the forward runs (an error shows again
                    // when it is applied).
                    Some(c) => std::thread::scope(|scope| {
                        let mask = scope.spawn(move || {
                            let _ = c.prepare();
                        });
                        let l = runner.compute(seq);
                        if let Err(panic) = mask.join() {
                            std::panic::resume_unwind(panic);
                        }
                        l
                    })?,
                    None => runner.compute(seq)?,
                }
            }
        };
    };
    // Verified tokens past where generation stopped were never emitted: forget them.
    runner.truncate(seq, emitted_base + generated - shifted);
    if stop != StopReason::StopString {
        let mut tail = utf8.flush();
        tail = stops.push(&tail).0 + &stops.finish();
        if !tail.is_empty() {
            on_token(TokenEvent {
                id: None,
                text: &tail,
                logprobs: None,
            })?;
        }
    }
    Ok(GenStats {
        prompt_tokens: prompt.len() - reused,
        reused_tokens: reused,
        generated_tokens: generated,
        prompt_secs,
        gen_secs: t1.elapsed().as_secs_f64(),
        stop,
    })
}

/// Why generation ends at the end of the structure (or at an end token): `Length` when the
/// budget made the constraint close it early.
fn structure_end(c: Option<&Constraint>) -> StopReason {
    if c.is_some_and(Constraint::closed_by_budget) {
        StopReason::Length
    } else {
        StopReason::Eos
    }
}
