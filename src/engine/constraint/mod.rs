//! Structured output: a constraint (JSON schema, GBNF grammar, Lark grammar or regex) that masks
//! the logits before every sampling step, greedy included, and advances with each accepted token.
//!
//! The engine is llguidance (an Earley parser over a derivative-based lexer, with toktrie walking
//! the vocabulary once per mask), built over infer's own vocabulary (`vocab`). [`Grammars`] is
//! made once per model (the trie of every token's bytes); [`Grammars::compile`] checks a spec and
//! gives a [`Constraint`], one per sequence.
//!
//! Invariants: a spec that cannot be compiled (unparsable grammar, unsupported schema keyword,
//! unsatisfiable schema) is an error with its reason, never a silent free-text fallback; after
//! [`Constraint::apply`] every token outside the constraint has logit `-inf`; the end of
//! generation (every end-of-generation id of the tokenizer) is allowed only where the structure
//! is complete, and is the only choice once nothing can follow; a token the constraint refuses
//! is an error at [`Constraint::commit`], so a bug cannot produce invalid output silently. JSON
//! constraints also close their structure inside the token budget ([`Constraint::apply_within`],
//! `closing`), writing the shortest completion of a string's `pattern` where one holds a string
//! open (`patterns`).

mod closing;
#[cfg(test)]
mod closing_tests;
pub mod gbnf;
mod patterns;
mod vocab;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::tokenizer::Tokenizer;
use closing::JsonScan;
use patterns::Patterns;

/// What the output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum ConstraintSpec {
    /// A JSON Schema (draft 4 to 2020-12 keywords that llguidance supports).
    JsonSchema(Value),
    /// Any JSON object (OpenAI's `{"type": "json_object"}`).
    JsonObject,
    /// A grammar in llama.cpp's GBNF.
    Gbnf(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A regular expression the whole output matches (Rust `regex` syntax).
    Regex(String),
}

impl ConstraintSpec {
    /// The llguidance grammar, or why the spec cannot be one.
    fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            ConstraintSpec::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(json_options(schema.clone())?)
            }
            ConstraintSpec::JsonObject => TopLevelGrammar::from_json_schema(json_options(
                serde_json::json!({"type": "object"}),
            )?),
            ConstraintSpec::Gbnf(text) => {
                TopLevelGrammar::from_lark(gbnf::to_lark(text).map_err(|e| e.to_string())?)
            }
            ConstraintSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
            ConstraintSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        })
    }

    /// What kind of constraint this is, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            ConstraintSpec::JsonSchema(_) => "JSON schema",
            ConstraintSpec::JsonObject => "JSON object",
            ConstraintSpec::Gbnf(_) => "grammar",
            ConstraintSpec::Lark(_) => "Lark grammar",
            ConstraintSpec::Regex(_) => "regex",
        }
    }
}

/// llguidance's options for JSON output (see [`json_options`]), for schemas embedded elsewhere
/// (a Lark grammar's `%json`).
pub fn json_layout() -> Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// JSON output is written compactly with one space after `:` and `,`: no free whitespace, so a
/// small model cannot wander into an endless run of spaces or newlines.
fn json_options(mut schema: Value) -> Result<Value, String> {
    match &mut schema {
        Value::Object(map) => {
            if map.contains_key("x-guidance") {
                return Err("the schema may not set 'x-guidance'".into());
            }
            map.insert("x-guidance".into(), json_layout());
        }
        Value::Bool(_) => {}
        other => {
            return Err(format!(
                "a JSON schema is an object or a boolean, not {}",
                json_kind(other)
            ))
        }
    }
    Ok(schema)
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A constraint that cannot be used: the reason, with its position where the spec has one.
#[derive(Debug, Clone)]
pub struct ConstraintError(pub String);

impl std::fmt::Display for ConstraintError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConstraintError {}

/// The per-model half of constraints: the vocabulary trie and llguidance's parser factory.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    /// End-of-generation ids, ascending.
    eog: Arc<[u32]>,
    n_logits: usize,
}

impl Grammars {
    /// Builds the trie of `tok`'s vocabulary, `n_logits` wide (the model's output row).
    pub fn new(tok: &Tokenizer, n_logits: usize) -> Result<Grammars> {
        let eog: Arc<[u32]> = tok.eog_ids().into();
        let eos = tok
            .eos_id()
            .or_else(|| eog.first().copied())
            .ok_or_else(|| anyhow!("the model names no end-of-generation token"))?;
        let env: TokEnv = Arc::new(vocab::Vocab::new(tok, n_logits, eos));
        let mut factory = ParserFactory::new_simple(&env)?;
        factory.quiet();
        factory.limits_mut().verbose_errors = false;
        Ok(Grammars {
            factory: Arc::new(factory),
            eog,
            n_logits,
        })
    }

    /// Checks `spec` and starts a constraint for one sequence.
    pub fn compile(&self, spec: &ConstraintSpec) -> Result<Constraint, ConstraintError> {
        let grammar = spec
            .grammar()
            .map_err(|e| ConstraintError(format!("invalid {}: {e}", spec.kind())))?;
        let parser = self.factory.create_parser(grammar).map_err(|e| {
            ConstraintError(format!(
                "invalid {}: {}",
                spec.kind(),
                clean(&e.to_string())
            ))
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError(format!(
                "invalid {}: {}",
                spec.kind(),
                clean(&e)
            )));
        }
        let json = matches!(
            spec,
            ConstraintSpec::JsonSchema(_) | ConstraintSpec::JsonObject
        );
        let patterns = match spec {
            ConstraintSpec::JsonSchema(schema) => Some(patterns::collect(schema)),
            _ => None,
        };
        Ok(Constraint {
            matcher,
            env: self.factory.tok_env().clone(),
            json: json.then(JsonScan::default),
            text: Vec::new(),
            patterns: patterns
                .filter(|p| !p.is_empty())
                .map(|p| Arc::new(Patterns::new(p))),
            prefix: Vec::new(),
            closing_from: None,
            closed_by_budget: false,
            mask: None,
            eog: self.eog.clone(),
            trie_eos: self.factory.tok_env().tok_trie().eos_token(),
            n_logits: self.n_logits,
            mask_time: Duration::ZERO,
            masks: 0,
        })
    }
}

/// llguidance's messages, without its internal prefixes.
fn clean(msg: &str) -> String {
    msg.trim().trim_start_matches("Error: ").to_string()
}

/// One sequence's constraint: the parser state after the tokens committed so far. A clone is
/// independent (its own parser state).
pub struct Constraint {
    matcher: Matcher,
    env: TokEnv,
    /// JSON constraints: where the output is (for closing inside the budget).
    json: Option<JsonScan>,
    /// JSON constraints: the bytes committed.
    text: Vec<u8>,
    /// The schema's string patterns, if any.
    patterns: Option<Arc<Patterns>>,
    /// A hash of each prefix of the committed tokens (`prefix[i]` covers tokens `..=i`).
    prefix: Vec<u64>,
    /// Closing started after this prefix (its length and hash): it holds while the committed
    /// tokens still start with that prefix, whichever path (a verified draft, one token at a
    /// time) committed them.
    closing_from: Option<(usize, u64)>,
    /// The budget decided a token (the answer was shortened to fit).
    closed_by_budget: bool,
    /// The mask for the next token, computed once per position.
    mask: Option<SimpleVob>,
    eog: Arc<[u32]>,
    trie_eos: u32,
    n_logits: usize,
    mask_time: Duration,
    masks: u64,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint {
            matcher: self.matcher.deep_clone(),
            env: self.env.clone(),
            json: self.json,
            text: self.text.clone(),
            patterns: self.patterns.clone(),
            prefix: self.prefix.clone(),
            closing_from: self.closing_from,
            closed_by_budget: self.closed_by_budget,
            mask: self.mask.clone(),
            eog: self.eog.clone(),
            trie_eos: self.trie_eos,
            n_logits: self.n_logits,
            mask_time: self.mask_time,
            masks: self.masks,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.is_finished())
            .field("masks", &self.masks)
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Computes the mask for the next position (if not yet computed); callers may run this while
    /// the forward pass computes the logits it will be applied to.
    pub fn prepare(&mut self) -> Result<()> {
        if self.mask.is_none() {
            let t = Instant::now();
            let mask = if self.matcher.is_stopped() {
                let mut m = SimpleVob::alloc(self.n_logits.max(self.trie_eos as usize + 1));
                m.allow_token(self.trie_eos);
                m
            } else {
                self.matcher
                    .compute_mask()
                    .map_err(|e| anyhow!("constraint: {}", clean(&e.to_string())))?
            };
            self.mask_time += t.elapsed();
            self.masks += 1;
            self.mask = Some(mask);
        }
        Ok(())
    }

    /// Sets every logit the constraint forbids to `-inf`. End of generation is allowed (as every
    /// end-of-generation id) exactly where the structure may end.
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<()> {
        self.prepare()?;
        let mask = self.mask.as_ref().expect("prepared");
        let may_end = mask.is_allowed(self.trie_eos);
        // 32 ids a word: most words are all-allowed or all-forbidden.
        let words = mask.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            match words.get(w).copied().unwrap_or(0) {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                bits => {
                    for (b, l) in chunk.iter_mut().enumerate() {
                        if bits >> b & 1 == 0 {
                            *l = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        for &e in self.eog.iter() {
            if let Some(l) = logits.get_mut(e as usize) {
                if !may_end {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// [`apply`](Self::apply) for a step with `remaining` tokens of budget left (this one
    /// included): a JSON output that could not otherwise close in time keeps only the token that
    /// closes the most (`closing`).
    pub fn apply_within(&mut self, logits: &mut [f32], remaining: usize) -> Result<()> {
        self.apply(logits)?;
        let Some(scan) = self.json else {
            return Ok(());
        };
        if !self.closing_now(scan, remaining)? {
            return Ok(());
        }
        // Ties go by length and id, as in the measurement, so closing takes what it measured:
        // every allowed logit the same (one of them is kept below).
        for l in logits.iter_mut().filter(|l| l.is_finite()) {
            *l = 0.0;
        }
        if let Some(keep) = self.closing_token(scan, logits) {
            for (id, l) in logits.iter_mut().enumerate() {
                if id as u32 != keep {
                    *l = f32::NEG_INFINITY;
                }
            }
            self.closed_by_budget = true;
        }
        Ok(())
    }

    /// Whether closing has started at this step, `remaining` tokens left: by the margin of the
    /// open depth, or by the cost of closing measured at a checkpoint (now or on the way here).
    fn closing_now(&mut self, scan: JsonScan, remaining: usize) -> Result<bool> {
        let started = self
            .closing_from
            .is_some_and(|(n, h)| n == 0 || (self.prefix.len() >= n && self.prefix[n - 1] == h));
        if started || remaining <= closing::margin(scan.depth()) {
            return Ok(true);
        }
        if !closing::is_checkpoint(remaining) || !self.closing_cost_over(remaining)? {
            return Ok(false);
        }
        self.closing_from = Some((self.prefix.len(), self.prefix.last().copied().unwrap_or(0)));
        Ok(true)
    }

    /// At a checkpoint: closes a copy of this constraint without the model (every logit 0, so
    /// the closing order alone decides) and says whether that takes too long to wait for the
    /// next checkpoint (`closing::must_start`).
    fn closing_cost_over(&mut self, remaining: usize) -> Result<bool> {
        let mut sim = self.clone();
        sim.closing_from = Some((0, 0));
        let mut row = vec![0.0f32; self.n_logits];
        let mut cost = 0;
        let over = loop {
            if closing::must_start(remaining, cost) {
                break true;
            }
            if sim.is_finished() {
                break false;
            }
            row.fill(0.0);
            sim.apply(&mut row)?;
            let Some(scan) = sim.json else { break false };
            match sim.closing_token(scan, &row) {
                None => break true,
                Some(t) if self.eog.binary_search(&t).is_ok() => break false,
                Some(t) => sim.commit(t)?,
            }
            cost += 1;
        };
        self.mask_time = sim.mask_time; // the measurement is part of this step's cost
        Ok(over)
    }

    /// The one token to keep while closing, from the masked `logits`: the end where allowed,
    /// else a pattern's completion for a string nothing allowed can close, else
    /// `closing::closing_choice`.
    fn closing_token(&mut self, scan: JsonScan, logits: &[f32]) -> Option<u32> {
        let end = self
            .eog
            .iter()
            .copied()
            .find(|&e| logits.get(e as usize).is_some_and(|l| l.is_finite()));
        if end.is_some() {
            return end;
        }
        let env = self.env.clone();
        let trie = env.tok_trie();
        let bytes = |id: u32| {
            if self.eog.binary_search(&id).is_ok() || trie.is_special_token(id) {
                &[][..]
            } else {
                trie.token(id)
            }
        };
        let choice = closing::closing_choice(scan, logits, bytes);
        let closes = choice.is_some_and(|c| scan.after(bytes(c)).depth() < scan.depth());
        if closes {
            return choice;
        }
        let content = scan.open_string(&self.text).map(<[u8]>::to_vec);
        let patterns = self.patterns.clone();
        if let (Some(content), Some(patterns), Some(quote)) =
            (content, patterns, trie.token_id(b"\""))
        {
            for completion in patterns.completions(&content) {
                let ids: Option<Vec<u32>> = completion
                    .iter()
                    .map(|&b| trie.token_id(&[b]))
                    .chain([Some(quote)])
                    .collect();
                let Some(ids) = ids else { continue };
                if self.matcher.validate_tokens(&ids).ok() == Some(ids.len()) {
                    return Some(ids[0]);
                }
            }
        }
        choice
    }

    /// Whether the budget shortened the output (see [`apply_within`](Self::apply_within)).
    pub fn closed_by_budget(&self) -> bool {
        self.closed_by_budget
    }

    /// Whether `id` is allowed at the current position (for checking drafts).
    pub fn allows(&mut self, id: u32) -> Result<bool> {
        self.prepare()?;
        let mask = self.mask.as_ref().expect("prepared");
        Ok(if self.eog.binary_search(&id).is_ok() {
            mask.is_allowed(self.trie_eos)
        } else {
            (id as usize) < mask.len() && mask.is_allowed(id)
        })
    }

    /// Advances past `id`, which must be allowed. An end-of-generation id ends the constraint.
    pub fn commit(&mut self, id: u32) -> Result<()> {
        anyhow::ensure!(
            self.allows(id)?,
            "constraint: token {id} is not allowed here (a bug: sampling ignored the mask)"
        );
        self.mask = None;
        if self.eog.binary_search(&id).is_ok() {
            return Ok(());
        }
        if let Some(scan) = &mut self.json {
            let bytes = self.env.tok_trie().token(id);
            *scan = scan.after(bytes);
            self.text.extend_from_slice(bytes);
        }
        let h = self.prefix.last().copied().unwrap_or(0xcbf2_9ce4_8422_2325);
        self.prefix
            .push((h ^ u64::from(id)).wrapping_mul(0x0100_0000_01b3));
        self.matcher
            .consume_token(id)
            .map_err(|e| anyhow!("constraint: {}", clean(&e.to_string())))
    }

    /// The structure is complete and nothing may follow it: generation should end.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// How many of `draft`'s tokens the constraint accepts in order, without advancing.
    pub fn accepted_prefix(&mut self, draft: &[u32]) -> usize {
        let body = draft
            .iter()
            .position(|t| self.eog.binary_search(t).is_ok())
            .unwrap_or(draft.len());
        self.matcher.validate_tokens(&draft[..body]).unwrap_or(0)
    }

    /// Masks `rows` for verifying `draft` (which must be [`accepted_prefix`](Self::accepted_prefix)
    /// of itself): row `i` gets the mask after `draft[..i]`, with `remaining - i` tokens of budget
    /// left. The state is left as it was.
    pub fn mask_rows(
        &mut self,
        draft: &[u32],
        rows: &mut [Vec<f32>],
        remaining: usize,
    ) -> Result<()> {
        let (scan, closed) = (self.json, self.closed_by_budget);
        let (text, prefix) = (self.text.len(), self.prefix.len());
        let mut committed = 0;
        let mut result = Ok(());
        for (i, row) in rows.iter_mut().enumerate() {
            result = self.apply_within(row, remaining.saturating_sub(i).max(1));
            if result.is_err() || i == draft.len() {
                break;
            }
            result = self.commit(draft[i]);
            if result.is_err() {
                break;
            }
            committed += 1;
        }
        (self.json, self.closed_by_budget) = (scan, closed);
        self.text.truncate(text);
        self.prefix.truncate(prefix);
        if committed > 0 {
            self.mask = None;
            self.matcher
                .rollback(committed)
                .map_err(|e| anyhow!("constraint: {}", clean(&e.to_string())))?;
        }
        result
    }

    /// Total time spent computing masks, and how many.
    pub fn mask_stats(&self) -> (Duration, u64) {
        (self.mask_time, self.masks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::TokenizerSpec;

    /// A tiny SentencePiece-style vocabulary: control tokens, digits, and multi-byte pieces.
    fn tokenizer() -> Tokenizer {
        let tokens = [
            "<unk>", "<s>", "</s>", "0", "1", "2", "12", "a", "b", "ab", "{", "}", "\"", "▁",
        ];
        let types = [2, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1];
        let spec = TokenizerSpec {
            model: "llama".into(),
            tokens: tokens.iter().map(|s| s.to_string()).collect(),
            token_types: Some(types.to_vec()),
            special_ids: vec![("eos_token_id".into(), 2), ("bos_token_id".into(), 1)],
            add_space_prefix: Some(false),
            ..TokenizerSpec::default()
        };
        Tokenizer::from_spec(spec).unwrap()
    }

    fn allowed(c: &mut Constraint, n: usize) -> Vec<u32> {
        let mut l = vec![0.0f32; n];
        c.apply(&mut l).unwrap();
        (0..n as u32).filter(|&i| l[i as usize] == 0.0).collect()
    }

    #[test]
    fn masks_follow_a_regex_and_end_only_where_complete() {
        let tok = tokenizer();
        // Two more logits than tokens: padding ids are never allowed.
        let g = Grammars::new(&tok, 16).unwrap();
        let mut c = g.compile(&ConstraintSpec::Regex("[12]{2}".into())).unwrap();
        assert_eq!(
            allowed(&mut c, 16),
            [4, 5, 6],
            "a digit or '12', no end, no control"
        );
        c.commit(4).unwrap();
        assert!(!c.is_finished());
        assert_eq!(allowed(&mut c, 16), [4, 5]);
        assert!(c.commit(6).is_err(), "'12' would make three digits");
        c.commit(5).unwrap();
        assert!(c.is_finished());
        assert_eq!(
            allowed(&mut c, 16),
            [2],
            "only the end once the structure is whole"
        );
    }

    #[test]
    fn drafts_are_checked_and_rows_masked_without_moving_the_state() {
        let tok = tokenizer();
        let g = Grammars::new(&tok, 14).unwrap();
        let mut c = g
            .compile(&ConstraintSpec::Regex("a(b|ab)*".into()))
            .unwrap();
        assert_eq!(
            c.accepted_prefix(&[7, 8, 9, 7, 7]),
            4,
            "'abab' + 'a' fits, a second 'a' not"
        );
        let mut rows = vec![vec![0.0f32; 14]; 3];
        c.mask_rows(&[7, 9], &mut rows, 100).unwrap();
        let ok = |r: &Vec<f32>| (0..14).filter(|&i| r[i] == 0.0).collect::<Vec<_>>();
        assert_eq!(ok(&rows[0]), [7, 9], "first: 'a' or 'ab'");
        assert_eq!(
            ok(&rows[1]),
            [2, 7, 8, 9],
            "after 'a': the end, 'b', 'ab', or 'a'+'b'..."
        );
        assert_eq!(ok(&rows[2]), [2, 7, 8, 9]);
        assert_eq!(allowed(&mut c, 14), [7, 9], "the state is where it was");
    }

    #[test]
    fn bad_specs_are_errors_with_reasons() {
        let tok = tokenizer();
        let g = Grammars::new(&tok, 14).unwrap();
        let e = g
            .compile(&ConstraintSpec::JsonSchema(
                serde_json::json!({"type": "array", "uniqueItems": true}),
            ))
            .unwrap_err();
        assert!(e.0.contains("uniqueItems"), "{e}");
        let e = g
            .compile(&ConstraintSpec::Gbnf("root ::= x".into()))
            .unwrap_err();
        assert!(e.0.contains("'x' is not defined"), "{e}");
        let e = g
            .compile(&ConstraintSpec::JsonSchema(serde_json::json!([1])))
            .unwrap_err();
        assert!(e.0.contains("not an array"), "{e}");
    }
}
