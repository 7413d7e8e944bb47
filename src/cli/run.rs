//! `infer run`: tokenize a prompt, generate, stream the continuation to stdout (only the new text),
//! and report load time and speeds on stderr (silent under `--quiet`). `--json` turns stdout into
//! JSON lines for machines, with per-token log-probabilities under `--logprobs N`. Ctrl-C stops
//! generation after the current token; a second Ctrl-C exits at once. `--batch-file` is
//! [`crate::cli::batch`].

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use serde_json::{json, Value};

use crate::cli::args::RunArgs;
use crate::cli::constraint;
use crate::cli::load::{load_cpu, load_for, Loaded};
use crate::cli::tokenize::read_stdin_text;
use crate::cli::{note, progress, UsageError};
use infer::engine::generate::{generate_with, GenHooks, GenParams, TokenEvent};
use infer::engine::prompt_cache::{self, CacheShape, Saved};
use infer::engine::request::{Event, RequestSpec};
use infer::engine::runner::{Sequence, BLOCK_SIZE, PREFILL_CHUNK};
use infer::engine::scheduler::run_one;
use infer::engine::speculative::{check_vocab, DraftModel, Method, Speculator};
use infer::tokenizer::Tokenizer;
/// Installs the Ctrl-C handler once and returns the flag it raises.
pub fn cancel_flag() -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&flag);
    // If a handler is already installed (tests, embedding), generation simply cannot be interrupted.
    let _ = ctrlc::set_handler(move || {
        if f.swap(true, Ordering::SeqCst) {
            // second Ctrl-C: the user wants out now
            std::process::exit(130);
        }
    });
    flag
}

/// Loads `--model` under a spinner (on a terminal) and says how it went (unless `--quiet`).
pub fn load_model(a: &RunArgs) -> Result<Loaded> {
    load_model_for(a, 1)
}

/// [`load_model`] with KV for `n_seq` sequences of `--ctx` positions each.
pub fn load_model_for(a: &RunArgs, n_seq: usize) -> Result<Loaded> {
    let loaded = progress::with_spinner(format!("loading {}", a.model.model.display()), || {
        load_for(&a.model, a.ctx, n_seq)
    })?;
    note!(
        "infer: loaded {} in {:.2} s ({} threads, context {})",
        a.model.model.display(),
        loaded.load_secs,
        loaded.threads,
        loaded.runner.n_ctx()
    );
    Ok(loaded)
}

/// The prompt tokens of `text` as `a` asks (`--chat`, `--system`, `--no-bos`), and the stop
/// strings the chat format needs. Usage errors for an empty prompt or one that fills the context.
pub fn prompt_tokens(loaded: &Loaded, a: &RunArgs, text: &str) -> Result<(Vec<u32>, Vec<String>)> {
    let tok = &loaded.tokenizer;
    let (ids, stops) = if a.chat {
        crate::cli::chat::prompt_format(&loaded.gguf, tok, None)?.single_turn(
            tok,
            a.system.as_deref(),
            text,
            !a.no_bos,
        )?
    } else {
        (
            tok.encode(text, tok.add_bos_default() && !a.no_bos, true)?,
            Vec::new(),
        )
    };
    check_fits(&ids, loaded.runner.n_ctx())?;
    Ok((ids, stops))
}

fn check_fits(prompt: &[u32], n_ctx: usize) -> Result<(), UsageError> {
    if prompt.is_empty() {
        return Err(UsageError("the prompt is empty".into()));
    }
    if prompt.len() >= n_ctx {
        return Err(UsageError(format!(
            "the prompt has {} tokens but the context holds {n_ctx} (raise --ctx)",
            prompt.len(),
        )));
    }
    Ok(())
}

/// `x` as the shortest decimal that reads back as the same f32 (`-1.6706803`, not the f64
/// expansion `-1.670680284500122`).
fn short(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// A `--json` token line: `{"id","text"}` plus `"logprob"` and `"top_logprobs"` when asked for.
fn token_line(tok: &Tokenizer, e: &TokenEvent<'_>) -> Value {
    let mut v = json!({"id": e.id, "text": e.text});
    if e.id.is_none() {
        v.as_object_mut().expect("object").remove("id");
    }
    if let Some(lp) = &e.logprobs {
        v["logprob"] = json!(short(lp.logprob));
        let top: Vec<Value> = lp
            .top
            .iter()
            .map(|&(id, logprob)| {
                let text = String::from_utf8_lossy(&tok.token_bytes(id)).into_owned();
                json!({"id": id, "text": text, "logprob": short(logprob)})
            })
            .collect();
        v["top_logprobs"] = Value::Array(top);
    }
    v
}

pub fn run(a: RunArgs) -> Result<()> {
    let mut sampler = a.sampling.config()?;
    let prompt_text = match (&a.prompt, &a.prompt_ids) {
        (_, Some(_)) => None,
        (Some(p), None) if p != "-" => Some(p.clone()),
        _ => Some(read_stdin_text("prompt")?),
    };
    let constraint = constraint::spec(&a.constraint)?;
    let loaded = load_model(&a)?;
    let (prompt, chat_stops) = match (&a.prompt_ids, &prompt_text) {
        (Some(ids), _) => {
            let vocab = loaded.runner.vocab_size();
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(UsageError(format!(
                    "--prompt-ids: id {bad} is outside the vocabulary (size {vocab})"
                ))
                .into());
            }
            check_fits(ids, loaded.runner.n_ctx())?;
            (ids.clone(), Vec::new())
        }
        (None, Some(text)) => prompt_tokens(&loaded, &a, text)?,
        (None, None) => unreachable!("one of prompt or ids is set above"),
    };
    sampler.dry = a.sampling.dry(&loaded.tokenizer);
    infer::trace::mark("prompt tokenized");
    let (tok, mut runner, gguf) = (loaded.tokenizer, loaded.runner, loaded.gguf);
    let params = GenParams {
        max_tokens: a.max_tokens,
        sampler,
        stop: [a.stop.clone(), chat_stops].concat(),
        ignore_eos: a.ignore_eos,
        constraint: constraint::compile(constraint, &tok, runner.vocab_size())?,
    };
    let tty = std::io::stdout().is_terminal();
    let cancel = cancel_flag();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let bar = progress::prefill(prompt.len());
    let mut on_prefill = |done: usize, _total: usize| {
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    };
    let mut spec = speculator(&a, &tok, runner.model.cfg.n_layer)?;
    if let Some(s) = spec.as_mut() {
        // A draft model on the CPU drafts ahead while a GPU target verifies.
        s.overlap = runner.model.backend.gpu_layers > 0;
    }
    let mut first = true;
    let mut emit = |e: TokenEvent<'_>| -> Result<()> {
        if std::mem::take(&mut first) {
            infer::trace::mark("first token");
            if let Some(b) = &bar {
                b.finish_and_clear();
            }
        }
        if a.json {
            if e.id.is_some() || !e.text.is_empty() {
                writeln!(out, "{}", token_line(&tok, &e))?;
            }
        } else {
            out.write_all(e.text.as_bytes())?;
        }
        out.flush()?;
        Ok(())
    };
    let mut cache = match &a.prompt_cache {
        Some(path) => Some(PromptCacheRun::open(path, &gguf, &mut runner, &prompt)?),
        None => None,
    };
    let mut prefill_logits = Vec::new();
    let mut keep_logits = |l: &[f32]| prefill_logits = l.to_vec();
    let context_shift = context_shift(&a, &tok, runner.n_ctx(), spec.is_some())?;
    let stats = if spec.is_some() || cache.is_some() || context_shift.is_some() {
        // Speculative decoding drafts and verifies one sequence's tokens in its own loop; a
        // prompt cache hands it a sequence already holding the prompt's start.
        let (mut seq, prefilled) = match &mut cache {
            Some(c) => (std::mem::take(&mut c.seq), c.prefilled.take()),
            None => (Sequence::default(), None),
        };
        let hooks = GenHooks {
            logprobs: a.logprobs,
            prefill_progress: Some(&mut on_prefill),
            spec: spec.as_mut(),
            prefilled,
            on_prefill: cache
                .is_some()
                .then_some(&mut keep_logits as &mut dyn FnMut(&[f32])),
            context_shift,
        };
        let stats = generate_with(
            &mut runner,
            &mut seq,
            &tok,
            &prompt,
            &params,
            &cancel,
            hooks,
            emit,
        )?;
        if let Some(c) = &mut cache {
            c.seq = seq;
        }
        stats
    } else {
        // Through the scheduler, as a server's requests run.
        let request = RequestSpec {
            prompt: prompt.clone(),
            params,
            logprobs: a.logprobs,
            lookup: None,
        };
        run_one(
            &mut runner,
            &tok,
            &mut Sequence::default(),
            request,
            &cancel,
            &mut on_prefill,
            |e| match e {
                Event::Token { id, text, logprobs } => emit(TokenEvent {
                    id: Some(*id),
                    text,
                    logprobs: logprobs.clone(),
                }),
                Event::Tail(text) => emit(TokenEvent {
                    id: None,
                    text,
                    logprobs: None,
                }),
                Event::Done(_) | Event::Error(_) => Ok(()),
            },
        )?
    };
    drop(bar);
    if let Some(c) = cache {
        c.save(&runner, &prompt, prefill_logits)?;
    }
    if a.json {
        writeln!(
            out,
            "{}",
            json!({
                "done": true,
                "prompt_tokens": prompt.len(),
                "cached_prompt_tokens": stats.reused_tokens,
                "generated_tokens": stats.generated_tokens,
                "prompt_tps": round2(stats.prompt_tps()),
                "gen_tps": round2(stats.gen_tps()),
                "stop": stats.stop.as_str(),
                "speculative": spec.as_ref().map(|s| json!({
                    "method": s.method.name(),
                    "drafted": s.stats.drafted,
                    "accepted": s.stats.accepted,
                    "acceptance": round2(s.stats.acceptance()),
                    "target_forwards": s.stats.forwards,
                    "tokens_per_forward": round2(s.stats.tokens_per_forward()),
                    "draft_secs": round2(s.stats.draft_secs),
                })),
            })
        )?;
    } else if tty {
        // keep the shell prompt off the last line of output
        writeln!(out)?;
    }
    out.flush()?;
    let reused = match stats.reused_tokens {
        0 => String::new(),
        n => format!(" ({n} more reused)"),
    };
    note!(
        "infer: prompt {} tokens computed{reused}, {:.1} tokens/s; generated {} tokens, {:.1} tokens/s; stop: {}",
        stats.prompt_tokens,
        stats.prompt_tps(),
        stats.generated_tokens,
        stats.gen_tps(),
        stats.stop.as_str()
    );
    if let Some(s) = &spec {
        note!(
            "infer: {} drafted {} tokens, accepted {} ({:.0}%), {:.2} tokens per target forward \
             ({} forwards, {:.2} s drafting)",
            s.method.name(),
            s.stats.drafted,
            s.stats.accepted,
            100.0 * s.stats.acceptance(),
            s.stats.tokens_per_forward(),
            s.stats.forwards,
            s.stats.draft_secs
        );
        let k = s.draft_max + 1;
        if let (Some(one), Some(many)) = (s.cost.forward_cost(1), s.cost.forward_cost(k)) {
            note!(
                "infer: measured target forward: 1 row {:.1} ms, {k} rows {:.1} ms ({:.2} steps)",
                1e3 * one,
                1e3 * many,
                many / one
            );
        }
    }
    Ok(())
}

/// `--context-shift`: the positions kept at the start (`--keep`, plus BOS when the model adds
/// one), checked against the context (the kept blocks and two more must fit).
fn context_shift(a: &RunArgs, tok: &Tokenizer, n_ctx: usize, spec: bool) -> Result<Option<usize>> {
    if !a.context_shift {
        return Ok(None);
    }
    if spec {
        return Err(UsageError(
            "--context-shift does not work with speculative decoding (--lookup, --draft-model, --self-draft)".into(),
        )
        .into());
    }
    let keep = a.keep + usize::from(tok.add_bos_default() && !a.no_bos);
    let need = (keep.div_ceil(BLOCK_SIZE) + 2) * BLOCK_SIZE;
    if n_ctx < need {
        return Err(UsageError(format!(
            "--context-shift with --keep {} needs a context of at least {need} (raise --ctx)",
            a.keep
        ))
        .into());
    }
    Ok(Some(keep))
}

/// The speculative decoder the flags ask for (`None`: plain decoding). Loads `--draft-model`
/// (on the CPU, same threads and context as the target) and checks its vocabulary.
fn speculator(a: &RunArgs, tok: &Tokenizer, n_layer: usize) -> Result<Option<Speculator>> {
    let s = &a.spec;
    let method = if s.lookup > 0 {
        Method::Lookup(infer::engine::speculative::PromptLookup::new(s.lookup))
    } else if let Some(path) = &s.draft_model {
        let loaded = progress::with_spinner(format!("loading {}", path.display()), || {
            load_cpu(path, &a.model, a.ctx)
        })?;
        check_vocab(tok, &loaded.tokenizer)
            .map_err(|e| UsageError(format!("--draft-model {}: {e:#}", path.display())))?;
        note!(
            "infer: loaded draft model {} in {:.2} s",
            path.display(),
            loaded.load_secs
        );
        Method::Model(Box::new(DraftModel::new(loaded.runner)))
    } else if let Some(layers) = s.self_draft {
        let layers = layers as usize;
        if layers >= n_layer {
            return Err(UsageError(format!(
                "--self-draft {layers}: the model has {n_layer} layers; draft with fewer \
                 (e.g. {})",
                (n_layer / 2).max(1)
            ))
            .into());
        }
        Method::SelfDraft { layers }
    } else {
        return Ok(None);
    };
    let mut spec = Speculator::new(method, s.draft_max as usize);
    spec.cost_based = !s.no_cost_k;
    Ok(Some(spec))
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// `--prompt-cache FILE` for one run: what the file gave (a sequence holding the reused start of
/// the prompt, and the logits when it held the whole prompt), and whether to write it back.
struct PromptCacheRun {
    path: std::path::PathBuf,
    shape: CacheShape,
    seq: Sequence,
    prefilled: Option<Vec<f32>>,
    /// The file already holds exactly this prompt: nothing to write.
    current: bool,
}

impl PromptCacheRun {
    /// Reads `path` (if it exists) and loads what `prompt` can use of it into a new sequence;
    /// a file that cannot be used is said on stderr, and replaced after this run.
    fn open<B: infer::model::Backend>(
        path: &std::path::Path,
        gguf: &infer::format::Gguf,
        runner: &mut infer::engine::runner::Runner<B>,
        prompt: &[u32],
    ) -> Result<PromptCacheRun> {
        let cfg = &runner.model.cfg;
        let shape = CacheShape {
            model: gguf.fingerprint(),
            kv_type: cfg.kv_type,
            n_layer: cfg.n_layer,
            kv_dim: cfg.kv_dim(),
            block_size: BLOCK_SIZE,
        };
        let mut run = PromptCacheRun {
            path: path.to_path_buf(),
            shape,
            seq: Sequence::default(),
            prefilled: None,
            current: false,
        };
        let shown = path.display();
        let saved = match prompt_cache::load(path, &shape) {
            Ok(Some(s)) => s,
            Ok(None) => {
                note!("infer: prompt cache {shown} does not exist yet: it will be written");
                return Ok(run);
            }
            Err(why) => {
                note!("infer: prompt cache {shown} not used: {why}; recomputing, and replacing it");
                return Ok(run);
            }
        };
        let mut n = prompt_cache::usable(&saved.tokens, prompt, PREFILL_CHUNK);
        if n == prompt.len() && saved.logits.len() != runner.vocab_size() {
            n = prompt_cache::usable(&saved.tokens, &prompt[..prompt.len() - 1], PREFILL_CHUNK);
        }
        if n > 0 {
            runner.import_kv(&mut run.seq, prompt, n, &saved.kv, saved.tokens.len())?;
        }
        if n == prompt.len() {
            run.prefilled = Some(saved.logits);
            run.current = true;
        }
        note!(
            "infer: prompt cache {shown}: {n} of the prompt's {} tokens loaded",
            prompt.len()
        );
        Ok(run)
    }

    /// Writes the prompt's K/V and the logits after it, unless the file already holds them.
    fn save<B: infer::model::Backend>(
        self,
        runner: &infer::engine::runner::Runner<B>,
        prompt: &[u32],
        logits: Vec<f32>,
    ) -> Result<()> {
        if self.current || logits.is_empty() || self.seq.n_cached < prompt.len() {
            return Ok(());
        }
        if !self.seq.tokens.starts_with(prompt) {
            // A context shift dropped part of the prompt: its K/V moved.
            note!(
                "infer: prompt cache {} not written: the context shifted into the prompt",
                self.path.display()
            );
            return Ok(());
        }
        let saved = Saved {
            tokens: prompt.to_vec(),
            logits,
            kv: runner.export_kv(&self.seq, prompt.len())?,
        };
        prompt_cache::save(&self.path, &self.shape, &saved)
    }
}
