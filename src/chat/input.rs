//! What the chat REPL does with a line of input before any model sees it: multi-line rules and
//! `/` commands. Pure functions; the terminal side (rustyline) lives in the CLI.
//!
//! Multi-line input: a line ending in `\` continues on the next line (the `\` is dropped, the
//! newline kept); `"""` opens a block that runs until the next `"""` (the markers and the newlines
//! right inside them are dropped). A line that starts with `/` and a letter is a command.

use std::path::PathBuf;

const FENCE: &str = "\"\"\"";

/// True when `input` is a whole message: every `"""` block is closed and it does not end in `\`.
pub fn is_complete(input: &str) -> bool {
    input.matches(FENCE).count().is_multiple_of(2) && !input.ends_with('\\')
}

/// The message text of a complete input: blocks unwrapped, continuations joined.
pub fn normalize(input: &str) -> String {
    let mut out = String::new();
    for (i, part) in input.split(FENCE).enumerate() {
        if i % 2 == 1 {
            let part = part.strip_prefix('\n').unwrap_or(part);
            out.push_str(part.strip_suffix('\n').unwrap_or(part));
        } else {
            out.push_str(&part.replace("\\\n", "\n"));
        }
    }
    out
}

/// A sampling setting that `/set` changes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Setting {
    Temp(f32),
    TopK(usize),
    TopP(f32),
    MinP(f32),
    Seed(u64),
    MaxTokens(usize),
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Setting::Temp(v) => write!(f, "temp = {v}"),
            Setting::TopK(v) => write!(f, "top-k = {v}"),
            Setting::TopP(v) => write!(f, "top-p = {v}"),
            Setting::MinP(v) => write!(f, "min-p = {v}"),
            Setting::Seed(v) => write!(f, "seed = {v}"),
            Setting::MaxTokens(v) => write!(f, "max-tokens = {v}"),
        }
    }
}

/// A REPL command.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    Help,
    Clear,
    /// `/system TEXT` (empty: remove the system prompt).
    System(String),
    Set(Setting),
    Stats,
    Save(PathBuf),
    Load(PathBuf),
    Exit,
}

/// The help text of the REPL.
pub const HELP: &str = "\
Type a message and press Enter. A line ending in \\ continues; \"\"\" opens and closes a block.
Ctrl-C stops an answer (or clears the line); Ctrl-D or /exit leaves.
Commands:
  /help                  this text
  /clear                 forget the conversation (keeps the system prompt)
  /system TEXT           set the system prompt (no TEXT: remove it)
  /set temp|top-k|top-p|min-p|seed|max-tokens VALUE
                         change sampling
  /stats                 tokens computed and reused per turn, speed, context used
  /save FILE             write the conversation as JSON
  /load FILE             read a conversation saved by /save and prefill it
  /exit                  leave";

fn parse_set(rest: &str) -> Result<Setting, String> {
    let mut it = rest.split_whitespace();
    let (Some(key), Some(value), None) = (it.next(), it.next(), it.next()) else {
        return Err("usage: /set temp|top-k|top-p|min-p|seed|max-tokens VALUE".into());
    };
    let bad = |what: &str| format!("/set {key}: {what}, got {value:?}");
    let unit = |v: &str| -> Result<f32, String> {
        v.parse::<f32>()
            .ok()
            .filter(|x| (0.0..=1.0).contains(x))
            .ok_or_else(|| bad("expected a number within 0..1"))
    };
    Ok(match key {
        "temp" | "temperature" => Setting::Temp(
            value
                .parse::<f32>()
                .ok()
                .filter(|x| x.is_finite() && *x >= 0.0)
                .ok_or_else(|| bad("expected a number ≥ 0"))?,
        ),
        "top-k" | "top_k" => {
            Setting::TopK(value.parse().map_err(|_| bad("expected a whole number"))?)
        }
        "top-p" | "top_p" => Setting::TopP(unit(value)?),
        "min-p" | "min_p" => Setting::MinP(unit(value)?),
        "seed" => Setting::Seed(value.parse().map_err(|_| bad("expected a whole number"))?),
        "max-tokens" | "max_tokens" | "n" => {
            Setting::MaxTokens(value.parse().map_err(|_| bad("expected a whole number"))?)
        }
        _ => {
            return Err(format!(
                "/set: unknown setting {key:?} (temp, top-k, top-p, min-p, seed, max-tokens)"
            ))
        }
    })
}

/// `None` when `line` is a message; otherwise the command, or why it is not a valid one.
pub fn parse_command(line: &str) -> Option<Result<Command, String>> {
    let body = line.trim().strip_prefix('/')?;
    if !body.starts_with(|c: char| c.is_ascii_alphabetic()) {
        return None;
    }
    let (name, rest) = body.split_once(char::is_whitespace).unwrap_or((body, ""));
    let rest = rest.trim();
    let need_file = |c: fn(PathBuf) -> Command| {
        if rest.is_empty() {
            Err(format!("usage: /{name} FILE"))
        } else {
            Ok(c(PathBuf::from(rest)))
        }
    };
    Some(match name {
        "help" | "?" => Ok(Command::Help),
        "clear" => Ok(Command::Clear),
        "system" => Ok(Command::System(rest.to_string())),
        "set" => parse_set(rest).map(Command::Set),
        "stats" => Ok(Command::Stats),
        "save" => need_file(Command::Save),
        "load" => need_file(Command::Load),
        "exit" | "quit" | "bye" => Ok(Command::Exit),
        _ => Err(format!("unknown command /{name} (try /help)")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuation_and_blocks() {
        assert!(is_complete("hello"));
        assert!(!is_complete("hello \\"));
        assert!(is_complete("hello \\\nworld"));
        assert_eq!(normalize("hello \\\nworld"), "hello \nworld");
        assert!(!is_complete("\"\"\"\nfn main() {}"));
        assert!(is_complete("\"\"\"\nfn main() {}\n\"\"\""));
        assert_eq!(
            normalize("\"\"\"\nfn main() {}\n  x \\\n\"\"\""),
            "fn main() {}\n  x \\"
        );
        assert_eq!(
            normalize("Explain: \"\"\"\na\nb\n\"\"\" thanks"),
            "Explain: a\nb thanks"
        );
    }

    #[test]
    fn commands() {
        assert_eq!(parse_command("hello"), None);
        assert_eq!(parse_command("/ not a command"), None);
        assert_eq!(parse_command(" /help "), Some(Ok(Command::Help)));
        assert_eq!(
            parse_command("/system Be brief."),
            Some(Ok(Command::System("Be brief.".into())))
        );
        assert_eq!(
            parse_command("/system"),
            Some(Ok(Command::System(String::new())))
        );
        assert_eq!(
            parse_command("/set temp 0.5"),
            Some(Ok(Command::Set(Setting::Temp(0.5))))
        );
        assert_eq!(
            parse_command("/set top-k 7"),
            Some(Ok(Command::Set(Setting::TopK(7))))
        );
        assert_eq!(
            parse_command("/set seed 42"),
            Some(Ok(Command::Set(Setting::Seed(42))))
        );
        assert!(matches!(parse_command("/set top-p 1.5"), Some(Err(_))));
        assert!(matches!(parse_command("/set temp -1"), Some(Err(_))));
        assert!(matches!(parse_command("/set color red"), Some(Err(_))));
        assert_eq!(
            parse_command("/save a b.json"),
            Some(Ok(Command::Save("a b.json".into())))
        );
        assert!(matches!(parse_command("/load"), Some(Err(_))));
        assert!(matches!(parse_command("/frobnicate"), Some(Err(e)) if e.contains("/help")));
    }
}
