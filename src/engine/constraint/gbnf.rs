//! GBNF, llama.cpp's grammar dialect, read and rewritten as the Lark dialect llguidance compiles.
//!
//! Accepted (llama.cpp's `grammars/README.md`): `name ::= body` rules, `root` first-class,
//! `#` comments, `"literals"` and `[^a-z]` classes with `\n \r \t \\ \" \[ \] \xHH \uHHHH
//! \UHHHHHHHH` escapes, `.` (any character), `( )` groups, `|`, `* + ?` and `{m}`, `{m,}`,
//! `{m,n}`. A rule ends at the end of its line unless a group is open. Token references
//! (`<[id]>`) are refused. Every rule stays a parser rule and every literal or class a
//! one-piece terminal, so the language is exactly the GBNF grammar's (no lexer greediness can
//! change it). Errors name the line and column.
//!
//! Invariants: names are rewritten to Lark's lowercase form, distinct names stay distinct, and
//! `root` becomes Lark's `start`; a reference to an undefined rule is an error here, not later.

use std::collections::HashMap;
use std::fmt::Write;

/// A GBNF grammar that cannot be read: where and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GbnfError {
    pub line: usize,
    pub column: usize,
    pub reason: String,
}

impl std::fmt::Display for GbnfError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "grammar line {}, column {}: {}",
            self.line, self.column, self.reason
        )
    }
}

impl std::error::Error for GbnfError {}

#[derive(Debug, Clone)]
enum Node {
    Literal(String),
    /// A character class: negated, and its items as inclusive ranges.
    Class(bool, Vec<(char, char)>),
    Any,
    Ref(String, usize),
    Seq(Vec<Node>),
    Alt(Vec<Node>),
    Repeat(Box<Node>, u32, Option<u32>),
}

/// The Lark text of a GBNF grammar.
pub fn to_lark(src: &str) -> Result<String, GbnfError> {
    let mut p = Parser { src, pos: 0 };
    let mut rules: Vec<(String, usize, Node)> = Vec::new();
    p.skip(true);
    while p.pos < src.len() {
        let at = p.pos;
        let name = p.name()?;
        p.skip(false);
        if !p.eat("::=") {
            return Err(p.err("expected '::=' after the rule name"));
        }
        p.skip(true);
        let body = p.alternatives(false)?;
        if !p.at_end_of_rule() {
            return Err(p.err("unexpected character"));
        }
        rules.push((name, at, body));
        p.skip(true);
    }
    let mut defined: HashMap<&str, usize> = HashMap::new();
    for (i, (name, _, _)) in rules.iter().enumerate() {
        // A later definition of the same name adds alternatives, as in llama.cpp.
        defined.entry(name.as_str()).or_insert(i);
    }
    let Some(_) = defined.get("root") else {
        return Err(GbnfError {
            line: 1,
            column: 1,
            reason: "the grammar has no 'root' rule".into(),
        });
    };
    for (_, _, body) in &rules {
        if let Some((name, at)) = undefined(body, &defined) {
            return Err(p.err_at(at, &format!("rule '{name}' is not defined")));
        }
    }
    let lark_names = lark_names(rules.iter().map(|(n, _, _)| n.as_str()));
    let mut merged: Vec<(&str, Vec<&Node>)> = Vec::new();
    for (name, _, body) in &rules {
        match merged.iter_mut().find(|(n, _)| *n == name) {
            Some((_, bodies)) => bodies.push(body),
            None => merged.push((name, vec![body])),
        }
    }
    let mut out = String::from("%llguidance {}\n\n");
    for (name, bodies) in merged {
        let _ = write!(out, "{}: ", lark_names[name]);
        for (i, b) in bodies.iter().enumerate() {
            if i > 0 {
                out.push_str(" | ");
            }
            emit(b, &lark_names, &mut out, true);
        }
        out.push('\n');
    }
    Ok(out)
}

fn undefined<'a>(n: &'a Node, defined: &HashMap<&str, usize>) -> Option<(&'a str, usize)> {
    match n {
        Node::Ref(name, at) if !defined.contains_key(name.as_str()) => Some((name, *at)),
        Node::Seq(v) | Node::Alt(v) => v.iter().find_map(|c| undefined(c, defined)),
        Node::Repeat(c, _, _) => undefined(c, defined),
        _ => None,
    }
}

/// GBNF names (letters, digits, `-`) as distinct Lark rule names (`[a-z][_a-z0-9-]*`).
fn lark_names<'a>(names: impl Iterator<Item = &'a str>) -> HashMap<&'a str, String> {
    let mut out: HashMap<&str, String> = HashMap::new();
    let mut taken: std::collections::HashSet<String> = ["start".to_string()].into();
    for name in names {
        if out.contains_key(name) {
            continue;
        }
        if name == "root" {
            out.insert(name, "start".into());
            continue;
        }
        let mut base: String = name.to_ascii_lowercase();
        if !base.starts_with(|c: char| c.is_ascii_lowercase()) {
            base.insert_str(0, "r_");
        }
        let mut candidate = base.clone();
        let mut k = 2;
        while taken.contains(&candidate) {
            candidate = format!("{base}_{k}");
            k += 1;
        }
        taken.insert(candidate.clone());
        out.insert(name, candidate);
    }
    out
}

fn emit(n: &Node, names: &HashMap<&str, String>, out: &mut String, top: bool) {
    match n {
        Node::Literal(s) => {
            out.push_str(&serde_json::to_string(s).expect("a string serializes"));
        }
        Node::Class(negated, ranges) => {
            out.push_str("/[");
            if *negated {
                out.push('^');
            }
            for &(a, b) in ranges {
                class_char(a, out);
                if a != b {
                    out.push('-');
                    class_char(b, out);
                }
            }
            out.push_str("]/");
        }
        Node::Any => out.push_str("/(?s:.)/"),
        Node::Ref(name, _) => out.push_str(&names[name.as_str()]),
        Node::Seq(items) => {
            if items.is_empty() {
                out.push_str("\"\"");
            }
            for (i, c) in items.iter().enumerate() {
                if i > 0 {
                    out.push(' ');
                }
                emit(c, names, out, false);
            }
        }
        Node::Alt(alts) => {
            if !top {
                out.push('(');
            }
            for (i, c) in alts.iter().enumerate() {
                if i > 0 {
                    out.push_str(" | ");
                }
                emit(c, names, out, false);
            }
            if !top {
                out.push(')');
            }
        }
        Node::Repeat(c, min, max) => {
            out.push('(');
            emit(c, names, out, true);
            out.push(')');
            match (min, max) {
                (0, None) => out.push('*'),
                (1, None) => out.push('+'),
                (0, Some(1)) => out.push('?'),
                (m, None) => {
                    let _ = write!(out, "{{{m},}}");
                }
                (m, Some(n)) => {
                    let _ = write!(out, "{{{m},{n}}}");
                }
            }
        }
    }
}

/// A character inside a regex class: letters and digits as they are, anything else escaped.
fn class_char(c: char, out: &mut String) {
    if c.is_ascii_alphanumeric() {
        out.push(c);
    } else {
        let _ = write!(out, "\\x{{{:x}}}", c as u32);
    }
}

struct Parser<'a> {
    src: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn eat(&mut self, s: &str) -> bool {
        if self.src[self.pos..].starts_with(s) {
            self.pos += s.len();
            true
        } else {
            false
        }
    }

    fn err(&self, reason: &str) -> GbnfError {
        self.err_at(self.pos, reason)
    }

    fn err_at(&self, at: usize, reason: &str) -> GbnfError {
        let before = &self.src[..at];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        GbnfError {
            line,
            column,
            reason: reason.to_string(),
        }
    }

    /// Skips spaces, tabs and comments, and newlines too when `newlines`.
    fn skip(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.pos += 1,
                '\r' | '\n' if newlines => self.pos += 1,
                '#' => {
                    while let Some(c) = self.peek() {
                        if c == '\n' || c == '\r' {
                            break;
                        }
                        self.pos += c.len_utf8();
                    }
                }
                _ => break,
            }
        }
    }

    fn at_end_of_rule(&self) -> bool {
        matches!(self.peek(), None | Some('\n') | Some('\r'))
    }

    fn name(&mut self) -> Result<String, GbnfError> {
        let start = self.pos;
        while matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || c == '-') {
            self.pos += 1;
        }
        if self.pos == start {
            return Err(self.err("expected a rule name"));
        }
        Ok(self.src[start..self.pos].to_string())
    }

    fn alternatives(&mut self, nested: bool) -> Result<Node, GbnfError> {
        let mut alts = vec![self.sequence(nested)?];
        while self.eat("|") {
            self.skip(true);
            alts.push(self.sequence(nested)?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().expect("one alternative")
        } else {
            Node::Alt(alts)
        })
    }

    fn sequence(&mut self, nested: bool) -> Result<Node, GbnfError> {
        let mut items = Vec::new();
        loop {
            let at = self.pos;
            let item = match self.peek() {
                Some('"') => {
                    self.pos += 1;
                    let mut s = String::new();
                    loop {
                        match self.peek() {
                            None | Some('\n') => return Err(self.err("unterminated literal")),
                            Some('"') => {
                                self.pos += 1;
                                break;
                            }
                            _ => s.push(self.char()?),
                        }
                    }
                    Node::Literal(s)
                }
                Some('[') => {
                    self.pos += 1;
                    let negated = self.eat("^");
                    let mut ranges = Vec::new();
                    loop {
                        match self.peek() {
                            None => return Err(self.err("unterminated character class")),
                            Some(']') => {
                                self.pos += 1;
                                break;
                            }
                            _ => {
                                let a = self.char()?;
                                let b = if self.src[self.pos..].starts_with('-')
                                    && !self.src[self.pos + 1..].starts_with(']')
                                {
                                    self.pos += 1;
                                    self.char()?
                                } else {
                                    a
                                };
                                if b < a {
                                    return Err(self.err_at(at, "character range is backwards"));
                                }
                                ranges.push((a, b));
                            }
                        }
                    }
                    Node::Class(negated, ranges)
                }
                Some('.') => {
                    self.pos += 1;
                    Node::Any
                }
                Some('(') => {
                    self.pos += 1;
                    self.skip(true);
                    let inner = self.alternatives(true)?;
                    if !self.eat(")") {
                        return Err(self.err("expected ')'"));
                    }
                    inner
                }
                Some('<') => return Err(self.err("token references (<[id]>) are not supported")),
                Some(c) if c.is_ascii_alphanumeric() || c == '-' => Node::Ref(self.name()?, at),
                _ => break,
            };
            self.skip(nested);
            let item = self.repetition(item)?;
            items.push(item);
            self.skip(nested);
        }
        Ok(if items.len() == 1 {
            items.pop().expect("one item")
        } else {
            Node::Seq(items)
        })
    }

    fn repetition(&mut self, item: Node) -> Result<Node, GbnfError> {
        let (min, max) = match self.peek() {
            Some('*') => (0, None),
            Some('+') => (1, None),
            Some('?') => (0, Some(1)),
            Some('{') => {
                self.pos += 1;
                self.skip(true);
                let min = self.int()?;
                self.skip(true);
                let max = if self.eat(",") {
                    self.skip(true);
                    if matches!(self.peek(), Some(c) if c.is_ascii_digit()) {
                        Some(self.int()?)
                    } else {
                        None
                    }
                } else {
                    Some(min)
                };
                self.skip(true);
                if !self.eat("}") {
                    return Err(self.err("expected '}'"));
                }
                if max.is_some_and(|m| m < min) {
                    return Err(self.err("repetition maximum below its minimum"));
                }
                return Ok(Node::Repeat(Box::new(item), min, max));
            }
            _ => return Ok(item),
        };
        self.pos += 1;
        Ok(Node::Repeat(Box::new(item), min, max))
    }

    fn int(&mut self) -> Result<u32, GbnfError> {
        let start = self.pos;
        while matches!(self.peek(), Some(c) if c.is_ascii_digit()) {
            self.pos += 1;
        }
        self.src[start..self.pos]
            .parse()
            .map_err(|_| self.err_at(start, "expected a number"))
    }

    /// One character of a literal or class, escapes decoded.
    fn char(&mut self) -> Result<char, GbnfError> {
        let at = self.pos;
        let c = self.peek().ok_or_else(|| self.err("unexpected end"))?;
        self.pos += c.len_utf8();
        if c != '\\' {
            return Ok(c);
        }
        let e = self.peek().ok_or_else(|| self.err("unfinished escape"))?;
        self.pos += e.len_utf8();
        let hex = |p: &mut Self, n: usize| -> Result<char, GbnfError> {
            let digits = p.src.get(p.pos..p.pos + n).unwrap_or("");
            let v = u32::from_str_radix(digits, 16)
                .ok()
                .filter(|_| digits.len() == n)
                .and_then(char::from_u32)
                .ok_or_else(|| p.err_at(at, "bad hexadecimal escape"))?;
            p.pos += n;
            Ok(v)
        };
        match e {
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            't' => Ok('\t'),
            '\\' | '"' | '[' | ']' | '-' | '^' => Ok(e),
            'x' => hex(self, 2),
            'u' => hex(self, 4),
            'U' => hex(self, 8),
            _ => Err(self.err_at(at, &format!("unknown escape '\\{e}'"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_become_lark() {
        let g = "root ::= item+ # the list\nitem ::= \"- \" [^\\n]+ \"\\n\"\n";
        let lark = to_lark(g).unwrap();
        assert_eq!(
            lark,
            "%llguidance {}\n\nstart: (item)+\nitem: \"- \" (/[^\\x{a}]/)+ \"\\n\"\n"
        );
    }

    #[test]
    fn groups_span_lines_and_names_stay_distinct() {
        let g = "root ::= (\n  a-b |\n  A-B\n){2,3}\na-b ::= \"x\"\nA-B ::= [a-c] .\n";
        let lark = to_lark(g).unwrap();
        assert!(lark.contains("start: (a-b | a-b_2){2,3}"), "{lark}");
        assert!(lark.contains("a-b_2: /[a-c]/ /(?s:.)/"), "{lark}");
    }

    #[test]
    fn errors_say_where() {
        let e = to_lark("root ::= \"a\" missing\n").unwrap_err();
        assert_eq!((e.line, e.column), (1, 14));
        assert!(e.reason.contains("'missing' is not defined"));
        let e = to_lark("item ::= \"a\"\n").unwrap_err();
        assert!(e.reason.contains("no 'root'"));
        let e = to_lark("root ::= \"a\"\nx := \"b\"").unwrap_err();
        assert_eq!((e.line, e.column), (2, 3));
        let e = to_lark("root ::= [z-a]").unwrap_err();
        assert!(e.reason.contains("backwards"));
        let e = to_lark("root ::= \"a\" (\"b\"").unwrap_err();
        assert!(e.reason.contains("')'"));
        let e = to_lark("root ::= \"\\q\"").unwrap_err();
        assert!(e.reason.contains("unknown escape"), "{e}");
    }
}
