//! `--json-schema`, `--grammar` and `--regex`: the flags read into a [`ConstraintSpec`] before the
//! model loads (a file that is missing or not JSON fails at once), then compiled against the
//! model's vocabulary. Every failure is a usage error (exit 2) that names the flag, the position
//! and the reason; nothing falls back to free text.

use std::time::Instant;

use anyhow::Result;

use crate::cli::args::ConstraintArgs;
use crate::cli::{note, UsageError};
use infer::engine::constraint::{Constraint, ConstraintSpec, Grammars};
use infer::tokenizer::Tokenizer;

/// The constraint the flags ask for, read and checked for syntax (none without a flag).
pub fn spec(a: &ConstraintArgs) -> Result<Option<(&'static str, ConstraintSpec)>, UsageError> {
    if let Some(arg) = &a.json_schema {
        let text = if arg.trim_start().starts_with('{') {
            arg.clone()
        } else {
            std::fs::read_to_string(arg)
                .map_err(|e| UsageError(format!("--json-schema {arg}: {e}")))?
        };
        let schema = serde_json::from_str(&text)
            .map_err(|e| UsageError(format!("--json-schema {arg}: not JSON: {e}")))?;
        return Ok(Some(("--json-schema", ConstraintSpec::JsonSchema(schema))));
    }
    if let Some(path) = &a.grammar {
        let text = std::fs::read_to_string(path)
            .map_err(|e| UsageError(format!("--grammar {}: {e}", path.display())))?;
        let spec = if path.extension().is_some_and(|e| e == "lark") {
            ConstraintSpec::Lark(text)
        } else {
            // Checked here, before the model loads, for a quick answer with the position.
            infer::engine::constraint::gbnf::to_lark(&text)
                .map_err(|e| UsageError(format!("--grammar {}: {e}", path.display())))?;
            ConstraintSpec::Gbnf(text)
        };
        return Ok(Some(("--grammar", spec)));
    }
    if let Some(rx) = &a.regex {
        return Ok(Some(("--regex", ConstraintSpec::Regex(rx.clone()))));
    }
    Ok(None)
}

/// Compiles the flags' constraint for the loaded model.
pub fn compile(
    spec: Option<(&'static str, ConstraintSpec)>,
    tok: &Tokenizer,
    n_logits: usize,
) -> Result<Option<Box<Constraint>>> {
    let Some((flag, spec)) = spec else {
        return Ok(None);
    };
    let t = Instant::now();
    let grammars = Grammars::new(tok, n_logits)?;
    let c = grammars
        .compile(&spec)
        .map_err(|e| UsageError(format!("{flag}: {e}")))?;
    note!(
        "infer: {} ready in {:.0} ms",
        spec.kind(),
        t.elapsed().as_secs_f64() * 1e3
    );
    Ok(Some(Box::new(c)))
}
