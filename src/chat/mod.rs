//! Chat: conversations rendered into prompts with the model's own chat template (`prompt`:
//! [`PromptFormat`]), and the pieces of
//! the interactive REPL that need no terminal (input continuation rules, `/` commands, saving and
//! loading conversations). The REPL itself (terminal, generation, KV reuse) is `infer chat`, in the
//! CLI.
//!
//! Invariants: a [`Conversation`] keeps its system message, if any, first; rendering is a pure
//! function of the template, the messages and `add_generation_prompt`.

pub mod conversation;
pub mod input;
pub mod prompt;
mod python;
pub mod template;

pub use conversation::Conversation;
pub use prompt::PromptFormat;
pub use template::{fallback_render, ChatTemplate, Message, FALLBACK_STOPS};

/// Python-compatible helpers of the template environment, exposed for tests.
pub mod pycompat {
    pub use super::python::{py_float, strftime_utc};
}
