//! `infer run`: tokenize a prompt, generate, stream the continuation to stdout (only the new text),
//! and report load time and speeds on stderr. `--json` turns stdout into JSON lines for machines.
//! Ctrl-C stops generation after the current token; a second Ctrl-C exits at once.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use serde_json::json;

use crate::cli::args::RunArgs;
use crate::cli::load::load;
use crate::cli::tokenize::read_stdin_text;
use crate::cli::UsageError;
use infer::engine::generate::{generate, GenParams};
use infer::engine::runner::Sequence;

/// Installs the Ctrl-C handler once and returns the flag it raises.
fn cancel_flag() -> Arc<AtomicBool> {
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

pub fn run(a: RunArgs) -> Result<()> {
    let sampler = a.sampling.config()?;
    let prompt_text = match (&a.prompt, &a.prompt_ids) {
        (_, Some(_)) => None,
        (Some(p), None) if p != "-" => Some(p.clone()),
        _ => Some(read_stdin_text("prompt")?),
    };
    let loaded = load(&a.model.model, a.model.threads, a.ctx)?;
    let (tok, mut runner) = (loaded.tokenizer, loaded.runner);
    // --chat: the fallback chat format needs stop strings
    let mut chat_stops: Vec<String> = Vec::new();
    let prompt: Vec<u32> = match (&a.prompt_ids, &prompt_text) {
        (Some(ids), _) => {
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= runner.vocab_size()) {
                return Err(UsageError(format!(
                    "--prompt-ids: id {bad} is outside the vocabulary (size {})",
                    runner.vocab_size()
                ))
                .into());
            }
            ids.clone()
        }
        (None, Some(text)) if a.chat => {
            let (ids, stops) = crate::cli::chat::single_turn_prompt(
                &loaded.gguf,
                &tok,
                a.system.as_deref(),
                text,
                !a.no_bos,
            )?;
            chat_stops = stops;
            ids
        }
        (None, Some(text)) => tok.encode(text, tok.add_bos_default() && !a.no_bos, true)?,
        (None, None) => unreachable!("one of prompt or ids is set above"),
    };
    if prompt.is_empty() {
        return Err(UsageError("the prompt is empty".into()).into());
    }
    if prompt.len() >= runner.n_ctx() {
        return Err(UsageError(format!(
            "the prompt has {} tokens but the context holds {} (raise --ctx)",
            prompt.len(),
            runner.n_ctx()
        ))
        .into());
    }
    let params = GenParams {
        max_tokens: a.max_tokens,
        sampler,
        stop: [a.stop.clone(), chat_stops].concat(),
    };
    let tty = std::io::stdout().is_terminal();
    eprintln!(
        "infer: loaded {} in {:.2} s ({} threads, context {})",
        a.model.model.display(),
        loaded.load_secs,
        loaded.threads,
        runner.n_ctx()
    );
    let cancel = cancel_flag();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut seq = Sequence::default();
    let stats = generate(
        &mut runner,
        &mut seq,
        &tok,
        &prompt,
        &params,
        &cancel,
        |id, text| {
            if a.json {
                if let Some(id) = id {
                    writeln!(out, "{}", json!({"id": id, "text": text}))?;
                } else if !text.is_empty() {
                    writeln!(out, "{}", json!({"text": text}))?;
                }
            } else {
                out.write_all(text.as_bytes())?;
            }
            out.flush()?;
            Ok(())
        },
    )?;
    if a.json {
        writeln!(
            out,
            "{}",
            json!({
                "done": true,
                "prompt_tokens": prompt.len(),
                "generated_tokens": stats.generated_tokens,
                "prompt_tps": round2(stats.prompt_tps()),
                "gen_tps": round2(stats.gen_tps()),
                "stop": stats.stop.as_str(),
            })
        )?;
    } else if tty {
        // keep the shell prompt off the last line of output
        writeln!(out)?;
    }
    out.flush()?;
    eprintln!(
        "infer: prompt {} tokens, {:.1} tokens/s; generated {} tokens, {:.1} tokens/s; stop: {}",
        stats.prompt_tokens,
        stats.prompt_tps(),
        stats.generated_tokens,
        stats.gen_tps(),
        stats.stop.as_str()
    );
    Ok(())
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
