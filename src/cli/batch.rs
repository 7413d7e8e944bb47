//! `infer run --batch-file FILE`: many requests against one loaded model, for offline jobs.
//!
//! Each non-blank line of FILE (`-` = stdin) is one request, a JSON object
//! `{"prompt": "..", "max_tokens": N}` with optional `"temperature"`, `"seed"` and `"stop"` (a string
//! or an array of strings); absent fields take the command line's values (`-n`, `--temp`, `--seed`,
//! `--stop`), and the other flags (`--chat`, `--system`, `--top-k`, ...) apply to every request.
//! Unknown fields are errors, so that a misspelt `max_token` does not silently run 256 tokens.
//!
//! One JSON line per request goes to stdout, in input order, as soon as the request is done:
//! `{"index","text","prompt_tokens","generated_tokens","stop"}`, or `{"index","line","error"}` for
//! a line that is not a valid request or a request that failed; the others still run, and the exit
//! code is then 1. `index` counts requests (non-blank lines) from 0, `line` counts file lines from 1.
//!
//! Every request starts from a fresh sequence (no KV reuse between requests), so its text is
//! byte-identical to `infer run` of the same prompt and settings: computing a shared prefix once
//! would change the batch shapes of the forward passes, which the kernels do not promise to be
//! bit-invariant to.

use std::io::{Read, Write};
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Deserialize;
use serde_json::json;

use crate::cli::args::RunArgs;
use crate::cli::load::Loaded;
use crate::cli::run::{cancel_flag, load_model, prompt_tokens};
use crate::cli::{note, progress, UsageError};
use infer::engine::generate::{generate, GenParams, StopReason};
use infer::engine::runner::Sequence;
use infer::engine::sampler::SamplerConfig;

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Request {
    prompt: String,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stops>,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
enum Stops {
    One(String),
    Many(Vec<String>),
}

/// A request as read: its file line (1-based) and the request or why it is not one.
struct Entry {
    line: usize,
    request: Result<Request, String>,
}

fn read_entries(path: &std::path::Path) -> Result<Vec<Entry>> {
    let mut text = String::new();
    if path.as_os_str() == "-" {
        std::io::stdin()
            .lock()
            .read_to_string(&mut text)
            .context("reading the batch from stdin (it must be UTF-8)")?;
    } else {
        text = std::fs::read_to_string(path).map_err(|e| {
            UsageError(format!("--batch-file: cannot read {}: {e}", path.display()))
        })?;
    }
    Ok(text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| Entry {
            line: i + 1,
            request: serde_json::from_str::<Request>(l)
                .map_err(|e| format!("invalid request: {e}")),
        })
        .collect())
}

/// Generation settings of one request: the command line's, with the request's overrides.
fn params_for(
    r: &Request,
    a: &RunArgs,
    base: &SamplerConfig,
    chat_stops: Vec<String>,
) -> Result<GenParams, String> {
    let mut sampler = base.clone();
    if let Some(t) = r.temperature {
        if t < 0.0 || !t.is_finite() {
            return Err(format!("\"temperature\" must be ≥ 0, got {t}"));
        }
        sampler.temperature = t;
    }
    if let Some(s) = r.seed {
        sampler.seed = s;
    }
    let stop = match &r.stop {
        None => a.stop.clone(),
        Some(Stops::One(s)) => vec![s.clone()],
        Some(Stops::Many(v)) => v.clone(),
    };
    Ok(GenParams {
        max_tokens: r.max_tokens.unwrap_or(a.max_tokens),
        sampler,
        stop: [stop, chat_stops].concat(),
    })
}

/// What one request produced, before it is written.
struct Outcome {
    text: String,
    prompt_tokens: usize,
    generated_tokens: usize,
    stop: StopReason,
}

fn run_one(
    loaded: &mut Loaded,
    a: &RunArgs,
    base: &SamplerConfig,
    r: &Request,
    cancel: &std::sync::atomic::AtomicBool,
) -> Result<Outcome> {
    let (prompt, chat_stops) = prompt_tokens(loaded, a, &r.prompt)?;
    let params = params_for(r, a, base, chat_stops).map_err(UsageError)?;
    let mut seq = Sequence::default();
    let mut text = String::new();
    let result = generate(
        &mut loaded.runner,
        &mut seq,
        &loaded.tokenizer,
        &prompt,
        &params,
        cancel,
        |_, piece| {
            text.push_str(piece);
            Ok(())
        },
    );
    loaded.runner.release(&mut seq);
    let stats = result?;
    Ok(Outcome {
        text,
        prompt_tokens: prompt.len(),
        generated_tokens: stats.generated_tokens,
        stop: stats.stop,
    })
}

pub fn batch(a: RunArgs) -> Result<()> {
    let base = a.sampling.config()?;
    let path = a.batch_file.clone().expect("dispatched on --batch-file");
    let entries = read_entries(&path)?;
    let mut loaded = load_model(&a)?;
    let cancel = cancel_flag();
    let bar = progress::requests(entries.len());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let t0 = Instant::now();
    let (mut failed, mut n_prompt, mut n_gen) = (0usize, 0usize, 0usize);
    for (index, e) in entries.iter().enumerate() {
        let result = e.request.as_ref().map_err(|m| m.clone()).and_then(|r| {
            run_one(&mut loaded, &a, &base, r, &cancel).map_err(|e| format!("{e:#}"))
        });
        let line = match &result {
            Ok(o) => {
                n_prompt += o.prompt_tokens;
                n_gen += o.generated_tokens;
                json!({
                    "index": index,
                    "text": o.text,
                    "prompt_tokens": o.prompt_tokens,
                    "generated_tokens": o.generated_tokens,
                    "stop": o.stop.as_str(),
                })
            }
            Err(msg) => {
                failed += 1;
                json!({"index": index, "line": e.line, "error": msg})
            }
        };
        let write = |out: &mut std::io::StdoutLock<'_>| -> std::io::Result<()> {
            writeln!(out, "{line}")?;
            out.flush()
        };
        match &bar {
            Some(b) => {
                b.suspend(|| write(&mut out))?;
                b.inc(1);
            }
            None => write(&mut out)?,
        }
        if matches!(&result, Ok(o) if o.stop == StopReason::Interrupted) {
            anyhow::bail!(
                "interrupted: {} of {} requests done",
                index + 1,
                entries.len()
            );
        }
    }
    drop(bar);
    let secs = t0.elapsed().as_secs_f64();
    note!(
        "infer: batch of {} requests ({failed} failed) in {secs:.1} s: {n_prompt} prompt tokens, {n_gen} generated ({:.1} tokens/s)",
        entries.len(),
        if secs > 0.0 { n_gen as f64 / secs } else { 0.0 }
    );
    if failed > 0 {
        anyhow::bail!(
            "{failed} of {} requests failed (their result lines hold \"error\")",
            entries.len()
        );
    }
    Ok(())
}
