//! Shortest completions of a JSON string under its schema's `pattern`s: what closing inside the
//! budget (`closing`) writes when a string's closing quote is not allowed yet.
//!
//! A schema string with a `pattern` may not end until the pattern matches somewhere in it (JSON
//! Schema patterns search, they are not anchored unless they say `^`/`$`); a model that never
//! writes the match (a version `1.2.3` it keeps extending with digits, a namespaced id without
//! its `:`) would hold the string open until the budget cut it. Here each of the schema's
//! patterns is compiled as llguidance compiles it (`regex_to_lark` with JSON Schema's ASCII `\d`
//! and `\w`, a search regex in derivre, the lazy derivative DFA llguidance's own lexer uses), and
//! a breadth-first search over printable ASCII bytes from the state after the string's content
//! finds the fewest bytes that make the pattern match. Which pattern governs the string is not
//! known here: the caller tries each completion (shortest first) against the real constraint.
//!
//! The content is searched as written: llguidance matches a JSON string's escapes as the
//! characters they stand for, so a completion found here after an escape may not be one there;
//! which is why each is only a candidate, checked against the constraint before it is used.
//!
//! Invariants: a completion never contains `"`, `\` or a control byte, so it is the same bytes
//! inside a JSON string; the search is bounded ([`MAX_STATES`]); a pattern derivre cannot compile
//! is skipped, never an error (the constraint itself decides what is allowed).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use llguidance::derivre::{RegexAst, RegexBuilder, StateID};
use llguidance::regex_to_lark;
use serde_json::Value;

/// DFA states a search may visit before giving up.
pub const MAX_STATES: usize = 4096;

/// Derivative steps a pattern's DFA may take (llguidance's own bound for checking a pattern).
const FUEL: u64 = 10_000;

/// The bytes a completion is made of, in the order the search prefers them: digits, lower and
/// upper case letters, then the other printable ASCII bytes a JSON string takes unescaped.
fn alphabet() -> impl Iterator<Item = u8> {
    (b'0'..=b'9')
        .chain(b'a'..=b'z')
        .chain(b'A'..=b'Z')
        .chain((b' '..=b'~').filter(|b| !b.is_ascii_alphanumeric() && !matches!(b, b'"' | b'\\')))
}

/// Every `pattern` string in a schema (any depth), deduplicated, in order of appearance.
pub fn collect(schema: &Value) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, x) in m {
                    match (k.as_str(), x) {
                        ("pattern", Value::String(p)) if !out.contains(p) => out.push(p.clone()),
                        _ => walk(x, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(schema, &mut out);
    out
}

/// A schema's patterns, compiled on first use.
pub struct Patterns {
    sources: Vec<String>,
    compiled: Mutex<Option<Vec<llguidance::derivre::Regex>>>,
}

impl Patterns {
    pub fn new(sources: Vec<String>) -> Patterns {
        Patterns {
            sources,
            compiled: Mutex::new(None),
        }
    }

    /// For a string whose content so far is `content` (as written, escapes undecoded), each
    /// pattern's shortest completion, the shortest first (ties in pattern order), without
    /// repeats.
    pub fn completions(&self, content: &[u8]) -> Vec<Vec<u8>> {
        let mut compiled = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        let regexes = compiled.get_or_insert_with(|| {
            self.sources
                .iter()
                .filter_map(|p| {
                    let mut b = RegexBuilder::new();
                    let e = b.mk(&RegexAst::SearchRegex(regex_to_lark(p, "dw"))).ok()?;
                    b.to_regex_limited(e, FUEL).ok()
                })
                .collect()
        });
        let mut out: Vec<Vec<u8>> = Vec::new();
        for rx in regexes.iter_mut() {
            if let Some(c) = shortest(rx, content) {
                if !out.contains(&c) {
                    out.push(c);
                }
            }
        }
        out.sort_by_key(|c| c.len());
        out
    }
}

/// The fewest bytes after `content` that make `rx` accept (breadth-first over the DFA, bytes in
/// [`alphabet`] order); `None` if `content` already matches (nothing to add), cannot be
/// completed, or the search passes [`MAX_STATES`].
fn shortest(rx: &mut llguidance::derivre::Regex, content: &[u8]) -> Option<Vec<u8>> {
    let initial = rx.initial_state();
    let start = rx.transition_bytes(initial, content);
    if start.is_dead() || rx.is_accepting(start) {
        return None;
    }
    // state -> (the state it was reached from, the byte that reached it)
    let mut from: HashMap<StateID, (StateID, u8)> = HashMap::new();
    let mut queue = VecDeque::from([start]);
    let mut seen = 1;
    while let Some(s) = queue.pop_front() {
        for b in alphabet() {
            let n = rx.transition(s, b);
            if n.is_dead() || n == start || from.contains_key(&n) {
                continue;
            }
            from.insert(n, (s, b));
            if rx.is_accepting(n) {
                let mut bytes = vec![b];
                let mut at = s;
                while at != start {
                    let (prev, b) = from[&at];
                    bytes.push(b);
                    at = prev;
                }
                bytes.reverse();
                return Some(bytes);
            }
            seen += 1;
            if seen > MAX_STATES {
                return None;
            }
            queue.push_back(n);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(pattern: &str, content: &str) -> Option<String> {
        let p = Patterns::new(vec![pattern.into()]);
        p.completions(content.as_bytes())
            .first()
            .map(|c| String::from_utf8(c.clone()).unwrap())
    }

    #[test]
    fn completions_are_the_shortest_that_match() {
        let semver = r"^[0-9]+\.[0-9]+\.[0-9]+$";
        assert_eq!(one(semver, "7230650").as_deref(), Some(".0.0"));
        assert_eq!(one(semver, "1.2").as_deref(), Some(".0"));
        assert_eq!(one(semver, "1.2.3"), None, "already matches");
        assert_eq!(one(semver, "1.x"), None, "cannot match any more");
        // Unanchored: the match may start anywhere, and `.` is any byte.
        assert_eq!(one("1.1", "edge hub").as_deref(), Some("101"));
        assert_eq!(one("1.1", "version 1").as_deref(), Some("01"));
        assert_eq!(
            one(r"^#?[a-z0-9_.-]+:[a-z0-9_.-]+", "8251").as_deref(),
            Some(":0")
        );
        // JSON Schema's `\d` and `\w` are ASCII.
        assert_eq!(one(r"^\w+@\d$", "me").as_deref(), Some("@0"));
        // Content is taken as written, escapes and all.
        assert_eq!(one("x", r#"a\"b"#).as_deref(), Some("x"));
        assert_eq!(
            one(r"^a\\", "").as_deref(),
            None,
            "a completion has no backslash"
        );
    }

    #[test]
    fn completions_from_several_patterns_shortest_first() {
        let p = Patterns::new(vec![r"^a{3}$".into(), r"b$".into(), "[".into()]);
        assert_eq!(
            p.completions(b"a"),
            vec![b"b".to_vec(), b"aa".to_vec()],
            "an uncompilable pattern is skipped"
        );
    }

    #[test]
    fn patterns_are_collected_at_any_depth_once() {
        let s = serde_json::json!({
            "properties": {
                "pattern": {"type": "string", "pattern": "^a$"},
                "b": {"items": [{"pattern": "b"}, {"pattern": "^a$"}]}
            }
        });
        assert_eq!(collect(&s), ["^a$", "b"]);
    }
}
