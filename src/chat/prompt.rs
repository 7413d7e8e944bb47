//! Prompts from conversations: the format a model's chat turns are written in ([`PromptFormat`]:
//! its own chat template, one from a file, or the plain fallback), rendering a conversation with
//! it, whether the tokens start with BOS, and the stop strings the format needs. `infer run
//! --chat`, the chat REPL and a server all build prompts here.
//!
//! Invariants: rendering is a pure function of the format, the messages and
//! `add_generation_prompt`; BOS is added exactly when the model asks for it and the rendered text
//! does not already begin with the BOS text.

use std::path::Path;

use anyhow::{Context, Result};

use super::{fallback_render, ChatTemplate, Conversation, Message, FALLBACK_STOPS};
use crate::format::Gguf;
use crate::tokenizer::Tokenizer;

/// How a model's chat turns are written: a chat template, or the fallback
/// `System:/User:/Assistant:` format when there is none.
#[derive(Debug)]
pub struct PromptFormat {
    template: Option<ChatTemplate>,
}

impl PromptFormat {
    /// The model's own chat template (`tokenizer.chat_template`), or the fallback format.
    pub fn from_model(g: &Gguf, tok: &Tokenizer) -> Result<PromptFormat> {
        let template =
            ChatTemplate::from_gguf(g, tok).context("in the model's tokenizer.chat_template")?;
        Ok(PromptFormat { template })
    }

    /// The template in the file at `path` (its BOS and EOS texts taken from the tokenizer).
    pub fn from_file(path: &Path, tok: &Tokenizer) -> Result<PromptFormat> {
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("reading the chat template {}", path.display()))?;
        let text = |id: Option<u32>| {
            id.map(|i| tok.token_text(i).to_string())
                .unwrap_or_default()
        };
        let t = ChatTemplate::new(&source, &text(tok.bos_id()), &text(tok.eos_id()))
            .with_context(|| format!("in {}", path.display()))?;
        Ok(PromptFormat { template: Some(t) })
    }

    /// `file`'s template when given, else the model's.
    pub fn resolve(g: &Gguf, tok: &Tokenizer, file: Option<&Path>) -> Result<PromptFormat> {
        match file {
            Some(path) => Self::from_file(path, tok),
            None => Self::from_model(g, tok),
        }
    }

    /// True for the fallback format (the model has no template and none was given): callers
    /// say so to the user once.
    pub fn is_fallback(&self) -> bool {
        self.template.is_none()
    }

    /// The conversation as prompt text, awaiting the assistant's answer when `gen_prompt`.
    pub fn render(&self, messages: &[Message], gen_prompt: bool) -> Result<String> {
        match &self.template {
            Some(t) => t.render(messages, gen_prompt),
            None => Ok(fallback_render(messages, gen_prompt)),
        }
    }

    /// [`PromptFormat::render`] for OpenAI-style JSON messages (whose `content` is text) and tool
    /// definitions; the fallback format prints each message's role and content only.
    pub fn render_json(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        gen_prompt: bool,
    ) -> Result<String> {
        match &self.template {
            Some(t) => t.render_json(messages, tools, gen_prompt),
            None => {
                let list: Vec<Message> = messages
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|m| {
                                let s = |k: &str| m.get(k).and_then(|v| v.as_str()).unwrap_or("");
                                Message::new(s("role"), s("content"))
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                Ok(fallback_render(&list, gen_prompt))
            }
        }
    }

    /// Whether the tokens of `text` start with BOS: when `allow`ed, the model asks for it and the
    /// template did not already write the BOS text.
    pub fn wants_bos(&self, tok: &Tokenizer, text: &str, allow: bool) -> bool {
        let printed = self
            .template
            .as_ref()
            .and_then(ChatTemplate::bos_token)
            .is_some_and(|b| text.starts_with(b));
        allow && tok.add_bos_default() && !printed
    }

    /// The stop strings the format needs (the fallback's turn markers; none with a template,
    /// whose end-of-turn token ends generation).
    pub fn stop_strings(&self) -> Vec<String> {
        match self.template {
            Some(_) => Vec::new(),
            None => FALLBACK_STOPS.iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The tokens of one chat turn (`user`, after `system`) awaiting the answer, and the stop
    /// strings it needs.
    pub fn single_turn(
        &self,
        tok: &Tokenizer,
        system: Option<&str>,
        user: &str,
        allow_bos: bool,
    ) -> Result<(Vec<u32>, Vec<String>)> {
        let mut conv = Conversation::new(system);
        conv.push("user", user);
        let text = self.render(&conv.messages, true)?;
        let bos = self.wants_bos(tok, &text, allow_bos);
        Ok((tok.encode(&text, bos, true)?, self.stop_strings()))
    }
}
