//! Chat templates: a model's Jinja `tokenizer.chat_template` rendered with minijinja the way
//! transformers' `apply_chat_template` renders it with Python jinja2 (trim_blocks, lstrip_blocks,
//! loop controls, Python string methods, Python-style printing, `tojson`, `raise_exception`,
//! `strftime_now`), and a plain fallback for models that ship no template.
//!
//! Invariants: a template compiles once, in [`ChatTemplate::new`]; rendering never mutates it. The
//! render context is transformers': `messages`, `tools` and `documents` (None),
//! `add_generation_prompt`, and `bos_token`/`eos_token` (undefined when the model has none).
//! Errors name the template line.
//!
//! A template comes from a file someone else wrote, so a render is bounded: at most
//! [`RENDER_FUEL`] template instructions (minijinja's fuel, which also ends any loop), at most
//! [`MAX_OUTPUT`] bytes written, minijinja's own recursion limit (500) and repetition limits; and
//! it reaches nothing outside: no loader is set, so `include`, `import` and `extends` of any name
//! but the template's own fail, and no function reads files, the environment or the network.

use anyhow::{anyhow, Result};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::Serde;
use minijinja::{Environment, Error, Value};

use crate::chat::python;
use crate::format::Gguf;
use crate::tokenizer::Tokenizer;

/// One message of a conversation, as in OpenAI's and transformers' chat format.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Message {
    /// `system`, `user`, `assistant` (templates may know others, such as `tool`).
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

const NAME: &str = "chat_template";

/// Template instructions one render may run. The real templates need about 60 per message
/// (Qwen2.5's with tools about 300), so this allows conversations of tens of thousands of
/// messages while a runaway template stops within about 0.3 s.
pub const RENDER_FUEL: u64 = 20_000_000;

/// The most bytes a render may produce (a prompt is far smaller: it must fit the context).
pub const MAX_OUTPUT: usize = 64 << 20;

/// A sink that fails once more than `limit` bytes were written to it.
struct Bounded<'a> {
    out: &'a mut Vec<u8>,
    limit: usize,
    over: &'a mut bool,
}

impl std::io::Write for Bounded<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + b.len() > self.limit {
            *self.over = true;
            return Err(std::io::Error::other("template output too large"));
        }
        self.out.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A compiled chat template with the special-token texts it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// "line N: detail" for a minijinja error (compile or render).
fn describe(e: &Error) -> String {
    let detail = e
        .detail()
        .map(str::to_string)
        .unwrap_or_else(|| e.kind().to_string());
    match e.line() {
        Some(line) => format!("line {line}: {detail}"),
        None => detail,
    }
}

impl ChatTemplate {
    /// Compiles `source`. An empty `bos_token`/`eos_token` means the model has none (the variable
    /// is then undefined, as transformers leaves it).
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| anyhow!("chat template syntax config: {e}"))?;
        env.set_syntax(syntax);
        env.set_fuel(Some(RENDER_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python::formatter);
        env.add_filter("tojson", python::tojson);
        env.add_function("raise_exception", python::raise_exception);
        env.add_function("strftime_now", python::strftime_now);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| anyhow!("the chat template does not compile: {}", describe(&e)))?;
        let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: some(bos_token),
            eos_token: some(eos_token),
        })
    }

    /// The model's template (`tokenizer.chat_template`), with the BOS/EOS texts of its tokenizer;
    /// `None` when the file has no template.
    pub fn from_gguf(g: &Gguf, tok: &Tokenizer) -> Result<Option<ChatTemplate>> {
        let Some(source) = g.get_str("tokenizer.chat_template") else {
            return Ok(None);
        };
        let text = |id: Option<u32>| {
            id.map(|i| tok.token_text(i).to_string())
                .unwrap_or_default()
        };
        ChatTemplate::new(source, &text(tok.bos_id()), &text(tok.eos_id())).map(Some)
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS text the template may print (None when the model has no BOS).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// Renders `messages`; `add_generation_prompt` appends the opening of an assistant turn.
    /// A template's `raise_exception(msg)` becomes an error whose text contains `msg`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_value(Value::from(Serde(messages)), None, add_generation_prompt)
    }

    /// [`ChatTemplate::render`] for messages given as JSON (OpenAI's form: a message may carry
    /// `tool_calls`, `tool_call_id`, `name`), with the tool definitions the template may print.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tools = tools.map(|t| Value::from(Serde(t)));
        self.render_value(Value::from(Serde(messages)), tools, add_generation_prompt)
    }

    fn render_value(
        &self,
        messages: Value,
        tools: Option<Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        let opt = |s: &Option<String>| {
            s.as_ref()
                .map_or(Value::UNDEFINED, |s| Value::from(s.as_str()))
        };
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools.unwrap_or(Value::from(())),
            documents => Value::from(()),
            add_generation_prompt => add_generation_prompt,
            bos_token => opt(&self.bos_token),
            eos_token => opt(&self.eos_token),
        };
        let (mut out, mut over) = (Vec::new(), false);
        let sink = Bounded {
            out: &mut out,
            limit: MAX_OUTPUT,
            over: &mut over,
        };
        match tmpl.render_captured_to(ctx, sink) {
            Ok(_) => String::from_utf8(out)
                .map_err(|_| anyhow!("the chat template failed: its output is not UTF-8")),
            Err(_) if over => Err(anyhow!(
                "the chat template failed: its output passed {} MiB",
                MAX_OUTPUT >> 20
            )),
            Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => Err(anyhow!(
                "the chat template failed: it ran more than {RENDER_FUEL} instructions \
                 (a loop that does not end, or a conversation far too long)"
            )),
            Err(e) => Err(anyhow!("the chat template failed: {}", describe(&e))),
        }
    }
}

/// Role name as the fallback format prints it: `System`, `User`, `Assistant`, other roles
/// capitalised.
fn fallback_role(role: &str) -> String {
    let mut c = role.chars();
    match c.next() {
        Some(f) => f.to_uppercase().chain(c).collect(),
        None => String::new(),
    }
}

/// The prompt for models without a template: one `Role: content` line per message, then
/// `Assistant:` when `add_generation_prompt`:
///
/// ```text
/// System: You are terse.
/// User: Hi
/// Assistant: Hello!
/// User: Bye
/// Assistant:
/// ```
///
/// A content that already starts with whitespace follows the colon directly (so a generated
/// answer " Hello!" renders the same as the text the model saw: `Assistant:` + ` Hello!`).
pub fn fallback_render(messages: &[Message], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(&fallback_role(&m.role));
        out.push(':');
        if !m.content.starts_with(char::is_whitespace) {
            out.push(' ');
        }
        out.push_str(&m.content);
        out.push('\n');
    }
    if add_generation_prompt {
        out.push_str("Assistant:");
    }
    out
}

/// Stop strings that end an answer in the fallback format (the model starting the next turn).
pub const FALLBACK_STOPS: [&str; 2] = ["\nUser:", "\nSystem:"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_format() {
        let m = [
            Message::new("system", "Be terse."),
            Message::new("user", "Hi"),
            Message::new("assistant", " Hello!"),
            Message::new("tool", "42"),
        ];
        assert_eq!(
            fallback_render(&m, true),
            "System: Be terse.\nUser: Hi\nAssistant: Hello!\nTool: 42\nAssistant:"
        );
        assert_eq!(
            fallback_render(&m[..2], false),
            "System: Be terse.\nUser: Hi\n"
        );
        assert_eq!(fallback_render(&[], true), "Assistant:");
    }

    #[test]
    fn compile_errors_name_the_line() {
        let e = ChatTemplate::new("ok\n{% for m in messages %}\n{{ m.content }\n", "", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 3"), "{e}");
        assert!(e.contains("does not compile"), "{e}");
    }

    #[test]
    fn raise_exception_reaches_the_caller() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("roles must alternate"), "{e}");
    }

    #[test]
    fn missing_tokens_are_undefined() {
        let t = ChatTemplate::new(
            "[{{ bos_token }}|{{ bos_token is defined }}|{{ eos_token }}]",
            "",
            "</s>",
        )
        .unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "[|False|</s>]");
    }
}
