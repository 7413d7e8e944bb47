//! `infer run --batch-file FILE`: many requests against one loaded model, for offline jobs.
//!
//! Each non-blank line of FILE (`-` = stdin) is one request, a JSON object
//! `{"prompt": "..", "max_tokens": N}` with optional `"temperature"`, `"seed"`, `"stop"` (a string
//! or an array of strings) and one of `"json_schema"` (a schema), `"grammar"` (GBNF text) or
//! `"regex"` (structured output; a constraint that does not compile is that line's error); absent fields take the command line's values (`-n`, `--temp`, `--seed`,
//! `--stop`), and the other flags (`--chat`, `--system`, `--top-k`, ...) apply to every request.
//! Unknown fields are errors, so that a misspelt `max_token` does not silently run 256 tokens.
//!
//! One JSON line per request goes to stdout, in input order, as soon as the request is done:
//! `{"index","text","prompt_tokens","cached_prompt_tokens","generated_tokens","stop"}`, or
//! `{"index","line","error"}` for a line that is not a valid request or a request that failed; the
//! others still run, and the exit code is then 1. `index` counts requests (non-blank lines) from 0, `line` counts file lines from 1.
//!
//! Up to `--parallel N` requests (default 8) run at once through the scheduler, with continuous
//! batching: a request's text is byte-identical to running it alone (`infer run`), because
//! decode rows are computed row-invariant and prompts in the chunks a lone run uses. Prompts that
//! share full KV blocks with an earlier or running request take them from the prefix cache; the
//! reused part was then computed in another request's forward calls, which can move the last
//! bits of a logit (as llama.cpp's server with its prompt cache).

use std::io::{Read, Write};
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Deserialize;
use serde_json::json;

use crate::cli::args::RunArgs;
use crate::cli::load::Loaded;
use crate::cli::run::{cancel_flag, load_model_for, prompt_tokens};
use crate::cli::{constraint, note, progress, UsageError};
use infer::engine::constraint::{Constraint, ConstraintSpec, Grammars};
use infer::engine::generate::{GenParams, StopReason};
use infer::engine::request::{Event, LookupSpec, RequestId, RequestSpec};
use infer::engine::sampler::SamplerConfig;
use infer::engine::scheduler::{Scheduler, SchedulerConfig};

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Request {
    prompt: String,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stops>,
    /// Structured output for this request (overrides the command line's constraint flag).
    json_schema: Option<serde_json::Value>,
    /// A GBNF grammar (the text itself).
    grammar: Option<String>,
    regex: Option<String>,
}

impl Request {
    fn has_constraint(&self) -> bool {
        self.json_schema.is_some() || self.grammar.is_some() || self.regex.is_some()
    }

    fn constraint(&self) -> Result<Option<ConstraintSpec>, String> {
        Ok(match (&self.json_schema, &self.grammar, &self.regex) {
            (None, None, None) => None,
            (Some(s), None, None) => Some(ConstraintSpec::JsonSchema(s.clone())),
            (None, Some(g), None) => Some(ConstraintSpec::Gbnf(g.clone())),
            (None, None, Some(r)) => Some(ConstraintSpec::Regex(r.clone())),
            _ => return Err("give at most one of \"json_schema\", \"grammar\", \"regex\"".into()),
        })
    }
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
        ignore_eos: false,
        constraint: None,
    })
}

/// What one request produced, before it is written.
struct Outcome {
    text: String,
    prompt_tokens: usize,
    /// Prompt tokens found cached (not computed).
    cached_tokens: usize,
    generated_tokens: usize,
    stop: StopReason,
}

/// The prompt and settings of one request line.
fn spec_for(
    loaded: &Loaded,
    a: &RunArgs,
    base: &SamplerConfig,
    r: &Request,
    constraints: &Constraints,
) -> Result<RequestSpec, String> {
    let (prompt, chat_stops) = prompt_tokens(loaded, a, &r.prompt).map_err(|e| format!("{e:#}"))?;
    let mut params = params_for(r, a, base, chat_stops)?;
    params.constraint = constraints.for_request(r)?;
    Ok(RequestSpec {
        prompt,
        params,
        logprobs: None,
        lookup: (a.spec.lookup > 0).then_some(LookupSpec {
            ngram: a.spec.lookup,
            draft_max: a.spec.draft_max as usize,
        }),
    })
}

/// The constraints of a batch: the command line's (for every request without its own) and the
/// vocabulary they compile against, built once when some request needs one.
struct Constraints {
    default: Option<ConstraintSpec>,
    grammars: Option<Grammars>,
}

impl Constraints {
    fn for_request(&self, r: &Request) -> Result<Option<Box<Constraint>>, String> {
        let Some(spec) = r.constraint()?.or_else(|| self.default.clone()) else {
            return Ok(None);
        };
        let grammars = self
            .grammars
            .as_ref()
            .expect("built when a request has a constraint");
        let c = grammars.compile(&spec).map_err(|e| e.to_string())?;
        Ok(Some(Box::new(c)))
    }
}

pub fn batch(a: RunArgs) -> Result<()> {
    let mut base = a.sampling.config()?;
    let path = a.batch_file.clone().expect("dispatched on --batch-file");
    let entries = read_entries(&path)?;
    let default = constraint::spec(&a.constraint)?.map(|(_, s)| s);
    let parallel = (a.parallel as usize).min(entries.len()).max(1);
    let loaded = load_model_for(&a, parallel)?;
    base.dry = a.sampling.dry(&loaded.tokenizer);
    let constrained = default.is_some()
        || entries
            .iter()
            .any(|e| e.request.as_ref().is_ok_and(Request::has_constraint));
    let constraints = Constraints {
        default,
        grammars: if constrained {
            Some(Grammars::new(
                &loaded.tokenizer,
                loaded.runner.vocab_size(),
            )?)
        } else {
            None
        },
    };
    let cancel = cancel_flag();
    let bar = progress::requests(entries.len());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let t0 = Instant::now();

    let n = entries.len();
    let mut results: Vec<Option<Result<Outcome, String>>> = (0..n).map(|_| None).collect();
    let mut texts = vec![String::new(); n];
    let mut prompt_lens = vec![0; n];
    let mut sched = Scheduler::new(SchedulerConfig {
        max_running: parallel,
        ..SchedulerConfig::default()
    });
    for (i, e) in entries.iter().enumerate() {
        let spec = e
            .request
            .as_ref()
            .map_err(Clone::clone)
            .and_then(|r| spec_for(&loaded, &a, &base, r, &constraints));
        match spec {
            Ok(s) => {
                prompt_lens[i] = s.prompt.len();
                sched.submit(i as RequestId, s)?;
            }
            Err(m) => results[i] = Some(Err(m)),
        }
    }
    let (tok, mut runner) = (loaded.tokenizer, loaded.runner);
    let (mut failed, mut n_prompt, mut n_gen, mut interrupted) = (0usize, 0usize, 0usize, 0usize);
    let mut next = 0;
    let mut events = Vec::new();
    let mut cancelled = false;
    loop {
        // Lines go out in input order, each as soon as it and all before it are done.
        while next < n {
            let Some(result) = results[next].take() else {
                break;
            };
            let line = match &result {
                Ok(o) => {
                    n_prompt += o.prompt_tokens;
                    n_gen += o.generated_tokens;
                    interrupted += usize::from(o.stop == StopReason::Interrupted);
                    json!({
                        "index": next,
                        "text": o.text,
                        "prompt_tokens": o.prompt_tokens,
                        "cached_prompt_tokens": o.cached_tokens,
                        "generated_tokens": o.generated_tokens,
                        "stop": o.stop.as_str(),
                    })
                }
                Err(msg) => {
                    failed += 1;
                    json!({"index": next, "line": entries[next].line, "error": msg})
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
            next += 1;
        }
        if sched.is_idle() {
            break;
        }
        if !cancelled && cancel.load(Ordering::Relaxed) {
            cancelled = true;
            (0..n as RequestId).for_each(|i| sched.cancel(i));
        }
        sched.step(&mut runner, &tok, &mut events)?;
        for (id, e) in events.drain(..) {
            let i = id as usize;
            match e {
                Event::Token { text, .. } | Event::Tail(text) => texts[i].push_str(&text),
                Event::Done(stats) => {
                    results[i] = Some(Ok(Outcome {
                        text: std::mem::take(&mut texts[i]),
                        prompt_tokens: prompt_lens[i],
                        cached_tokens: stats.reused_tokens,
                        generated_tokens: stats.generated_tokens,
                        stop: stats.stop,
                    }))
                }
                Event::Error(m) => results[i] = Some(Err(m)),
            }
        }
    }
    drop(bar);
    let secs = t0.elapsed().as_secs_f64();
    let cache = runner.pool().stats();
    note!(
        "infer: batch of {n} requests ({failed} failed) in {secs:.1} s, up to {parallel} at once: \
         {n_prompt} prompt tokens ({} found in the prefix cache), {n_gen} generated ({:.1} tokens/s)",
        cache.reused_tokens,
        if secs > 0.0 { n_gen as f64 / secs } else { 0.0 }
    );
    let st = sched.stats();
    if st.drafted > 0 {
        note!(
            "infer: lookup drafted {} tokens, accepted {} ({:.0}%)",
            st.drafted,
            st.accepted,
            100.0 * st.accepted as f64 / st.drafted as f64
        );
    }
    if cancelled {
        anyhow::bail!(
            "interrupted: {} of {n} requests done",
            n - interrupted - failed
        );
    }
    if failed > 0 {
        anyhow::bail!("{failed} of {n} requests failed (their result lines hold \"error\")");
    }
    Ok(())
}
