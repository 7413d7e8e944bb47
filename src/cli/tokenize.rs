//! `infer tokenize`: ids of a text as llama-tokenize computes them (BOS as the model asks, special
//! tokens parsed unless --no-special), one JSON array; `--jsonl` for bulk checks.

use std::io::{BufRead, IsTerminal, Read, Write};

use anyhow::{Context, Result};

use crate::cli::args::TokenizeArgs;
use crate::cli::load::{open_gguf, open_tokenizer};
use crate::cli::UsageError;

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let g = open_gguf(&a.model.model)?;
    let tok = open_tokenizer(&g, &a.model.model)?;
    let add_bos = tok.add_bos_default() && !a.no_bos;
    let special = !a.no_special;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if a.jsonl {
        for (i, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.context("reading stdin")?;
            if line.trim().is_empty() {
                continue;
            }
            let text: String = serde_json::from_str(&line)
                .map_err(|e| UsageError(format!("stdin line {}: not a JSON string: {e}", i + 1)))?;
            let ids = tok.encode(&text, add_bos, special)?;
            writeln!(out, "{}", id_array(&ids))?;
        }
        return Ok(());
    }
    let text = match a.text.as_deref() {
        Some("-") | None => read_stdin_text("text")?,
        Some(t) => t.to_string(),
    };
    let ids = tok.encode(&text, add_bos, special)?;
    writeln!(out, "{}", id_array(&ids))?;
    Ok(())
}

/// Reads all of stdin as the `what` (prompt, text); one trailing newline (as `echo` adds) is dropped.
/// A terminal on stdin is a usage error rather than a silent wait.
pub fn read_stdin_text(what: &str) -> Result<String> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Err(UsageError(format!(
            "no {what} given: pass it as an argument, or pipe it on stdin"
        ))
        .into());
    }
    let mut s = String::new();
    stdin
        .lock()
        .read_to_string(&mut s)
        .with_context(|| format!("reading the {what} from stdin (it must be UTF-8)"))?;
    if s.ends_with('\n') {
        s.pop();
        if s.ends_with('\r') {
            s.pop();
        }
    }
    Ok(s)
}

/// `[9707, 1879]`: a JSON array spaced as Python and llama.cpp's tools print it.
fn id_array(ids: &[u32]) -> String {
    let items: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    format!("[{}]", items.join(", "))
}
