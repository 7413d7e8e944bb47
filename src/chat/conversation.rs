//! A conversation: the list of messages a chat session renders each turn, with its system prompt
//! first. Owns the JSON file format of `/save` and `/load` and the rule for making room when the
//! context is full (drop the oldest user turn with its answers, never the system prompt nor the
//! newest message).
//!
//! File format (what `/save` writes; `/load` also takes a bare array of messages):
//! `{"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}, ...]}`

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::chat::template::Message;

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    pub messages: Vec<Message>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FileForm {
    Object { messages: Vec<Message> },
    Array(Vec<Message>),
}

impl Conversation {
    /// An empty conversation, with a system message when `system` is given.
    pub fn new(system: Option<&str>) -> Conversation {
        let mut c = Conversation::default();
        c.set_system(system);
        c
    }

    pub fn system(&self) -> Option<&str> {
        self.messages
            .first()
            .filter(|m| m.role == "system")
            .map(|m| m.content.as_str())
    }

    /// Replaces, adds (`Some`) or removes (`None`) the system message.
    pub fn set_system(&mut self, system: Option<&str>) {
        let has = self.system().is_some();
        match (system, has) {
            (Some(s), true) => self.messages[0].content = s.to_string(),
            (Some(s), false) => self.messages.insert(0, Message::new("system", s)),
            (None, true) => {
                self.messages.remove(0);
            }
            (None, false) => {}
        }
    }

    /// Forgets every message but the system prompt.
    pub fn clear(&mut self) {
        let keep = usize::from(self.system().is_some());
        self.messages.truncate(keep);
    }

    pub fn push(&mut self, role: &str, content: &str) {
        self.messages.push(Message::new(role, content));
    }

    /// Messages other than the system prompt.
    pub fn turns(&self) -> &[Message] {
        &self.messages[usize::from(self.system().is_some())..]
    }

    /// Drops the oldest turn after the system prompt: its first message and everything up to the
    /// next `user` message. The newest message is never dropped. Returns how many messages went.
    pub fn drop_oldest_turn(&mut self) -> usize {
        let start = usize::from(self.system().is_some());
        if self.messages.len() <= start + 1 {
            return 0;
        }
        let end = self.messages[start + 1..]
            .iter()
            .position(|m| m.role == "user")
            .map_or(self.messages.len(), |p| start + 1 + p)
            .min(self.messages.len() - 1);
        self.messages.drain(start..end);
        end - start
    }

    /// The `/save` file text (pretty JSON, newline-terminated).
    pub fn to_json(&self) -> String {
        let mut s = serde_json::to_string_pretty(self).expect("messages always serialize");
        s.push('\n');
        s
    }

    /// Parses a `/save` file, or a bare JSON array of messages. A system message may only come
    /// first; roles must be non-empty.
    pub fn from_json(text: &str) -> Result<Conversation> {
        let form: FileForm = serde_json::from_str(text)
            .context("expected {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}")?;
        let messages = match form {
            FileForm::Object { messages } | FileForm::Array(messages) => messages,
        };
        for (i, m) in messages.iter().enumerate() {
            if m.role.is_empty() {
                bail!("message {} has an empty role", i + 1);
            }
            if m.role == "system" && i > 0 {
                bail!(
                    "message {} is a system message; only the first may be",
                    i + 1
                );
            }
        }
        Ok(Conversation { messages })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(c: &Conversation) -> Vec<&str> {
        c.messages.iter().map(|m| m.role.as_str()).collect()
    }

    #[test]
    fn system_prompt_edits() {
        let mut c = Conversation::new(None);
        c.push("user", "hi");
        c.set_system(Some("be nice"));
        assert_eq!(roles(&c), ["system", "user"]);
        c.set_system(Some("be terse"));
        assert_eq!(c.system(), Some("be terse"));
        c.clear();
        assert_eq!(roles(&c), ["system"]);
        c.set_system(None);
        assert!(c.messages.is_empty());
    }

    #[test]
    fn dropping_turns_keeps_system_and_newest() {
        let mut c = Conversation::new(Some("sys"));
        for r in ["user", "assistant", "user", "assistant", "user"] {
            c.push(r, r);
        }
        assert_eq!(c.drop_oldest_turn(), 2);
        assert_eq!(roles(&c), ["system", "user", "assistant", "user"]);
        assert_eq!(c.drop_oldest_turn(), 2);
        assert_eq!(roles(&c), ["system", "user"]);
        assert_eq!(c.drop_oldest_turn(), 0);
        let mut c = Conversation::new(None);
        c.push("user", "a");
        c.push("assistant", "b");
        assert_eq!(c.drop_oldest_turn(), 1);
        assert_eq!(roles(&c), ["assistant"]);
    }

    #[test]
    fn json_round_trip() {
        let mut c = Conversation::new(Some("sys \"q\""));
        c.push("user", "héllo\n");
        c.push("assistant", "ok");
        let text = c.to_json();
        assert!(text.starts_with("{\n  \"messages\": ["), "{text}");
        assert_eq!(Conversation::from_json(&text).unwrap(), c);
        let bare = r#"[{"role":"user","content":"x"}]"#;
        assert_eq!(
            Conversation::from_json(bare).unwrap().messages,
            [Message::new("user", "x")]
        );
        assert!(Conversation::from_json(
            r#"[{"role":"user","content":"x"},{"role":"system","content":"y"}]"#
        )
        .is_err());
        assert!(Conversation::from_json("{}").is_err());
    }
}
