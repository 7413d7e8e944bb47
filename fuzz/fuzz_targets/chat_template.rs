//! The chat template renderer on arbitrary templates and arbitrary messages, as a template read
//! from a model file or `--chat-template-file` and messages from a request would reach it. An
//! input is a template, a NUL byte, then the messages (JSON in OpenAI's form, or otherwise the
//! text of one user message). Compiling and rendering give a value or an error, never a panic,
//! and stay inside the renderer's budget (instructions, output size, recursion) so no input
//! takes more than libFuzzer's 1 s or 2 GiB.
#![no_main]

use infer::chat::{ChatTemplate, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (template, rest) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(template) = std::str::from_utf8(template) else {
        return;
    };
    let Ok(t) = ChatTemplate::new(template, "<s>", "</s>") else {
        return;
    };
    match serde_json::from_slice::<serde_json::Value>(rest) {
        Ok(v) => {
            let tools = v.get("tools");
            let messages = v.get("messages").unwrap_or(&v);
            let _ = t.render_json(messages, tools, true);
        }
        Err(_) => {
            let text = String::from_utf8_lossy(rest);
            let _ = t.render(&[Message::new("user", &text)], true);
            let _ = t.render(&[Message::new("system", &text)], false);
        }
    }
});
