//! `infer chat`: an interactive conversation with a model, and the choice of prompt format
//! (with its note on stderr) behind `infer run --chat`.
//!
//! Each turn renders the whole conversation with the model's prompt format
//! ([`infer::chat::PromptFormat`]) and tokenizes it with special-token parsing; the sequence keeps
//! the KV of everything said so far, so a turn computes only its new tokens. Where the new prompt
//! text extends the text the cached tokens spell (the usual case), only the new text is tokenized
//! and appended to those exact tokens, as llama.cpp does; otherwise the whole prompt is tokenized
//! and the longest common token prefix is reused.
//!
//! Invariants: `seq.tokens` spells `seq_text` whenever `seq_text` is non-empty; a failed turn
//! (template error, context too small, engine error) leaves the conversation as it was before the
//! user's message and returns to the prompt; answers go to stdout, diagnostics to stderr.
//! Ctrl-C during an answer raises a flag checked per token (the partial answer is kept); at the
//! prompt it clears the line; Ctrl-D or `/exit` leaves. `--quiet` keeps only errors on stderr (no
//! banner, notes or confirmations of commands).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use rustyline::error::ReadlineError;
use rustyline::history::DefaultHistory;
use rustyline::validate::{ValidationContext, ValidationResult, Validator};
use rustyline::{Completer, Editor, Helper, Highlighter, Hinter};

use crate::cli::args::ChatArgs;
use crate::cli::constraint;
use crate::cli::load::load;
use crate::cli::{note, progress};
use infer::chat::input::{self, Command, Setting, HELP};
use infer::chat::{Conversation, PromptFormat};
use infer::engine::generate::{generate_with, GenHooks, GenParams, StopReason};
use infer::engine::request::{Event, RequestSpec};
use infer::engine::runner::{Runner, Sequence, BLOCK_SIZE};
use infer::engine::scheduler::run_one;
use infer::format::Gguf;
use infer::kernels::device::DeviceBackend;
use infer::tokenizer::Tokenizer;

/// The prompt format to use: `--chat-template FILE`, else the model's template, else the plain
/// fallback (said once on stderr).
pub fn prompt_format(g: &Gguf, tok: &Tokenizer, file: Option<&Path>) -> Result<PromptFormat> {
    let f = PromptFormat::resolve(g, tok, file)?;
    if f.is_fallback() {
        note!(
            "infer: the model has no chat template; using the plain \"User: ...\\nAssistant:\" format \
             (--chat-template FILE gives one)"
        );
    }
    Ok(f)
}

/// Multi-line rules of [`infer::chat::input`] for rustyline.
#[derive(Completer, Helper, Highlighter, Hinter)]
struct InputHelper;

impl Validator for InputHelper {
    fn validate(&self, ctx: &mut ValidationContext) -> rustyline::Result<ValidationResult> {
        Ok(if input::is_complete(ctx.input()) {
            ValidationResult::Valid(None)
        } else {
            ValidationResult::Incomplete
        })
    }
}

/// What one turn (or a `/load` prefill) cost.
struct TurnStats {
    label: String,
    computed: usize,
    reused: usize,
    generated: usize,
    prompt_secs: f64,
    gen_secs: f64,
    stop: Option<StopReason>,
}

struct Session {
    runner: Runner<DeviceBackend>,
    tok: Tokenizer,
    format: PromptFormat,
    conv: Conversation,
    seq: Sequence,
    /// The text `seq.tokens` spells; empty when unknown.
    seq_text: String,
    params: GenParams,
    turns: Vec<TurnStats>,
    cancel: Arc<AtomicBool>,
    /// `--context-shift`: positions kept at the start when an answer fills the context.
    context_shift: Option<usize>,
}

fn rate(n: usize, secs: f64) -> f64 {
    if secs > 0.0 {
        n as f64 / secs
    } else {
        0.0
    }
}

impl Session {
    fn render(&self, gen_prompt: bool) -> Result<String> {
        self.format.render(&self.conv.messages, gen_prompt)
    }

    /// Tokens of a rendered prompt, extending the cached tokens when the text extends theirs.
    fn tokens_for(&self, text: &str) -> Result<Vec<u32>> {
        if !self.seq_text.is_empty() && !self.seq.tokens.is_empty() {
            if let Some(rest) = text.strip_prefix(self.seq_text.as_str()) {
                let mut ids = self.seq.tokens.clone();
                ids.extend(self.tok.encode(rest, false, true)?);
                return Ok(ids);
            }
        }
        let bos = self.format.wants_bos(&self.tok, text, true);
        self.tok.encode(text, bos, true)
    }

    /// Room kept for an answer when fitting a prompt into the context.
    fn answer_room(&self) -> usize {
        self.params.max_tokens.min(self.runner.n_ctx() / 2)
    }

    /// Renders the conversation and drops its oldest turns until the prompt and an answer fit.
    /// `Err` when even the newest message alone does not fit.
    fn fit(&mut self, gen_prompt: bool) -> Result<(String, Vec<u32>)> {
        let n_ctx = self.runner.n_ctx();
        loop {
            let text = self.render(gen_prompt)?;
            let tokens = self.tokens_for(&text)?;
            if tokens.len() + self.answer_room() <= n_ctx {
                return Ok((text, tokens));
            }
            let dropped = self.conv.drop_oldest_turn();
            if dropped == 0 {
                if tokens.len() < n_ctx {
                    return Ok((text, tokens)); // the answer gets what room is left
                }
                anyhow::bail!(
                    "the conversation needs {} tokens but the context holds {n_ctx} (start infer chat with a larger --ctx)",
                    tokens.len()
                );
            }
            note!(
                "infer: context full ({} + {} answer tokens > {n_ctx}): dropped the oldest {dropped} messages",
                tokens.len(),
                self.answer_room()
            );
        }
    }

    /// One user message and the streamed answer.
    fn turn(&mut self, user: String) -> Result<()> {
        let before = self.conv.clone();
        self.conv.push("user", &user);
        let (text, tokens) = match self.fit(true) {
            Ok(p) => p,
            Err(e) => {
                self.conv = before;
                return Err(e);
            }
        };
        self.cancel.store(false, Ordering::SeqCst);
        let mut answer = String::new();
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let mut show = |piece: &str| -> Result<()> {
            answer.push_str(piece);
            out.write_all(piece.as_bytes())?;
            out.flush()?;
            Ok(())
        };
        let result = match self.context_shift {
            // The single-sequence loop shifts the context when an answer fills it.
            Some(keep) => {
                let hooks = GenHooks {
                    context_shift: Some(keep),
                    ..GenHooks::default()
                };
                generate_with(
                    &mut self.runner,
                    &mut self.seq,
                    &self.tok,
                    &tokens,
                    &self.params,
                    &self.cancel,
                    hooks,
                    |e| show(e.text),
                )
            }
            None => {
                let request = RequestSpec {
                    prompt: tokens.clone(),
                    params: self.params.clone(),
                    logprobs: None,
                    lookup: None,
                };
                run_one(
                    &mut self.runner,
                    &self.tok,
                    &mut self.seq,
                    request,
                    &self.cancel,
                    &mut |_, _| {},
                    |e| match e {
                        Event::Token { text: piece, .. } | Event::Tail(piece) => show(piece),
                        _ => Ok(()),
                    },
                )
            }
        };
        writeln!(out)?;
        out.flush()?;
        let stats = match result {
            Ok(s) => s,
            Err(e) => {
                // the KV state is unknown: start the cache over next turn
                self.seq = Sequence::default();
                self.seq_text.clear();
                self.conv = before;
                return Err(e);
            }
        };
        match stats.stop {
            StopReason::Interrupted => note!("infer: [interrupted]"),
            StopReason::Length => note!(
                "infer: [answer cut at {} tokens; /set max-tokens N changes that]",
                stats.generated_tokens
            ),
            StopReason::ContextFull => note!("infer: [the context is full]"),
            _ => {}
        }
        if stats.stop == StopReason::Interrupted && stats.generated_tokens == 0 {
            note!("infer: nothing was generated; the message was withdrawn");
            self.conv = before;
            self.seq_text.clear();
        } else {
            self.conv.push("assistant", &answer);
            // A stop string is withheld from the text but not from the tokens; a context shift
            // dropped part of what the text spells.
            if stats.stop == StopReason::StopString || !self.seq.tokens.starts_with(&tokens) {
                self.seq_text.clear();
            } else {
                self.seq_text = text + &answer;
            }
        }
        self.turns.push(TurnStats {
            label: format!(
                "turn {}",
                self.turns.iter().filter(|t| t.stop.is_some()).count() + 1
            ),
            computed: stats.prompt_tokens,
            reused: stats.reused_tokens,
            generated: stats.generated_tokens,
            prompt_secs: stats.prompt_secs,
            gen_secs: stats.gen_secs,
            stop: Some(stats.stop),
        });
        Ok(())
    }

    /// Computes the KV of the whole conversation (after `/load`).
    fn prefill(&mut self) -> Result<()> {
        self.seq_text.clear();
        if self.conv.messages.is_empty() {
            self.seq = Sequence::default();
            return Ok(());
        }
        let (text, tokens) = self.fit(false)?;
        let t0 = Instant::now();
        let reused = self.runner.reuse_prefix(&mut self.seq, &tokens);
        if let Err(e) = self.runner.compute(&mut self.seq) {
            self.seq = Sequence::default();
            return Err(e);
        }
        self.seq_text = text;
        self.turns.push(TurnStats {
            label: "prefill".into(),
            computed: tokens.len() - reused,
            reused,
            generated: 0,
            prompt_secs: t0.elapsed().as_secs_f64(),
            gen_secs: 0.0,
            stop: None,
        });
        Ok(())
    }

    fn stats(&self) -> String {
        let mut s = String::new();
        let n_turns = self.turns.iter().filter(|t| t.stop.is_some()).count();
        s.push_str(&format!("turns: {n_turns}\n"));
        for t in &self.turns {
            s.push_str(&format!(
                "{}: prompt {} computed, {} reused ({:.1} tokens/s)",
                t.label,
                t.computed,
                t.reused,
                rate(t.computed, t.prompt_secs)
            ));
            if let Some(stop) = t.stop {
                s.push_str(&format!(
                    "; generated {} ({:.1} tokens/s, {})",
                    t.generated,
                    rate(t.generated.saturating_sub(1), t.gen_secs),
                    stop.as_str()
                ));
            }
            s.push('\n');
        }
        let sum = |f: fn(&TurnStats) -> usize| self.turns.iter().map(f).sum::<usize>();
        s.push_str(&format!(
            "total: {} prompt tokens computed, {} reused, {} generated\n",
            sum(|t| t.computed),
            sum(|t| t.reused),
            sum(|t| t.generated)
        ));
        s.push_str(&format!(
            "context: {} / {} tokens",
            self.seq.tokens.len(),
            self.runner.n_ctx()
        ));
        s
    }

    /// Handles a command; `Ok(false)` means leave.
    fn command(&mut self, cmd: Command) -> Result<bool> {
        match cmd {
            Command::Help => println!("{HELP}"),
            Command::Exit => return Ok(false),
            Command::Clear => {
                self.conv.clear();
                self.seq_text.clear();
                note!("infer: conversation cleared");
            }
            Command::System(text) => {
                let text = text.trim();
                self.conv.set_system((!text.is_empty()).then_some(text));
                self.seq_text.clear();
                if text.is_empty() {
                    note!("infer: system prompt removed");
                } else {
                    note!("infer: system prompt set");
                }
            }
            Command::Set(s) => {
                let c = &mut self.params.sampler;
                match s {
                    Setting::Temp(v) => c.temperature = v,
                    Setting::TopK(v) => c.top_k = v,
                    Setting::TopP(v) => c.top_p = v,
                    Setting::MinP(v) => c.min_p = v,
                    Setting::Seed(v) => c.seed = v,
                    Setting::MaxTokens(v) => self.params.max_tokens = v,
                }
                note!("infer: {s}");
            }
            Command::Stats => println!("{}", self.stats()),
            Command::Save(path) => {
                std::fs::write(&path, self.conv.to_json())
                    .with_context(|| format!("writing {}", path.display()))?;
                note!(
                    "infer: saved {} messages to {}",
                    self.conv.messages.len(),
                    path.display()
                );
            }
            Command::Load(path) => {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let conv = Conversation::from_json(&text)
                    .with_context(|| format!("reading {}", path.display()))?;
                let before = std::mem::replace(&mut self.conv, conv);
                if let Err(e) = self.prefill() {
                    self.conv = before;
                    self.seq_text.clear();
                    return Err(e);
                }
                for m in &self.conv.messages {
                    println!("{}: {}", m.role, m.content);
                }
                let t = self.turns.last().expect("prefill records itself");
                note!(
                    "infer: loaded {} messages from {} ({} tokens prefilled, {} reused)",
                    self.conv.messages.len(),
                    path.display(),
                    t.computed,
                    t.reused
                );
            }
        }
        Ok(true)
    }
}

/// Installs the Ctrl-C handler (once per process) that raises `flag`.
fn install_cancel(flag: &Arc<AtomicBool>) {
    let f = Arc::clone(flag);
    if ctrlc::set_handler(move || f.store(true, Ordering::SeqCst)).is_err() {
        note!("infer: warning: cannot catch Ctrl-C; it will not stop answers");
    }
}

fn history_path() -> Option<PathBuf> {
    dirs::data_dir().map(|d| d.join("infer").join("history.txt"))
}

pub fn chat(a: ChatArgs) -> Result<()> {
    let mut sampler = a.sampling.config()?;
    let constraint = constraint::spec(&a.constraint)?;
    let loaded = progress::with_spinner(format!("loading {}", a.model.model.display()), || {
        load(&a.model, a.ctx)
    })?;
    let format = prompt_format(&loaded.gguf, &loaded.tokenizer, a.chat_template.as_deref())?;
    sampler.dry = a.sampling.dry(&loaded.tokenizer);
    let stop = format.stop_strings();
    let params = GenParams {
        max_tokens: a.max_tokens,
        sampler,
        stop,
        ignore_eos: false,
        // Every answer starts the constraint afresh.
        constraint: constraint::compile(constraint, &loaded.tokenizer, loaded.runner.vocab_size())?,
    };
    note!(
        "infer: loaded {} in {:.2} s ({} threads, context {}). /help lists commands; Ctrl-D leaves.",
        a.model.model.display(),
        loaded.load_secs,
        loaded.threads,
        loaded.runner.n_ctx()
    );
    let cancel = Arc::new(AtomicBool::new(false));
    install_cancel(&cancel);
    let mut s = Session {
        runner: loaded.runner,
        tok: loaded.tokenizer,
        format,
        conv: Conversation::new(a.system.as_deref()),
        seq: Sequence::default(),
        seq_text: String::new(),
        params,
        turns: Vec::new(),
        cancel,
        context_shift: None,
    };
    if a.context_shift {
        let keep = a.keep + usize::from(s.tok.add_bos_default());
        let need = (keep.div_ceil(BLOCK_SIZE) + 2) * BLOCK_SIZE;
        if s.runner.n_ctx() < need {
            return Err(crate::cli::UsageError(format!(
                "--context-shift with --keep {} needs a context of at least {need} (raise --ctx)",
                a.keep
            ))
            .into());
        }
        s.context_shift = Some(keep);
    }

    let config = rustyline::Config::builder().auto_add_history(false).build();
    let mut rl: Editor<InputHelper, DefaultHistory> = Editor::with_config(config)?;
    rl.set_helper(Some(InputHelper));
    let history = if a.no_history { None } else { history_path() };
    if let Some(h) = &history {
        if h.exists() {
            if let Err(e) = rl.load_history(h) {
                note!("infer: warning: cannot read history {}: {e}", h.display());
            }
        }
    }
    loop {
        let line = match rl.readline(">>> ") {
            Ok(l) => l,
            Err(ReadlineError::Interrupted) => continue,
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e.into()),
        };
        if line.trim().is_empty() {
            continue;
        }
        let _ = rl.add_history_entry(line.as_str());
        let outcome = match input::parse_command(&line) {
            Some(Ok(cmd)) => s.command(cmd),
            Some(Err(msg)) => {
                eprintln!("infer: {msg}");
                Ok(true)
            }
            None => s.turn(input::normalize(&line)).map(|()| true),
        };
        match outcome {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => eprintln!("infer: {e:#}"),
        }
    }
    if let Some(h) = &history {
        let saved = h
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .map_err(ReadlineError::from)
            .and_then(|()| rl.save_history(h));
        if let Err(e) = saved {
            note!("infer: warning: cannot write history {}: {e}", h.display());
        }
    }
    Ok(())
}
