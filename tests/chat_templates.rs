//! Chat templates rendered by `infer::chat` against what Python jinja2 renders for the same
//! templates and conversations exactly as transformers' `apply_chat_template` does
//! (tests/fixtures/chat/cases.json, written by scripts/gen-chat-fixtures.py), including the
//! conversations a template rejects with `raise_exception`.

mod common;

use std::collections::HashMap;
use std::process::Command;

use infer::chat::pycompat::strftime_utc;
use infer::chat::{ChatTemplate, Message};
use serde::Deserialize;

#[derive(Deserialize)]
struct Template {
    name: String,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

#[derive(Deserialize)]
struct Case {
    template: String,
    conversation: String,
    add_generation_prompt: bool,
    expected: Option<String>,
    error: Option<String>,
}

#[derive(Deserialize)]
struct Fixtures {
    templates: Vec<Template>,
    conversations: HashMap<String, Vec<Message>>,
    cases: Vec<Case>,
}

fn fixtures() -> Fixtures {
    let text = std::fs::read_to_string(common::fixture("chat/cases.json")).expect("cases.json");
    serde_json::from_str(&text).expect("cases.json parses")
}

fn compile(t: &Template) -> ChatTemplate {
    ChatTemplate::new(
        &t.source,
        t.bos_token.as_deref().unwrap_or(""),
        t.eos_token.as_deref().unwrap_or(""),
    )
    .unwrap_or_else(|e| panic!("{}: {e:#}", t.name))
}

#[test]
fn renders_exactly_as_transformers() {
    let fx = fixtures();
    let templates: HashMap<&str, ChatTemplate> = fx
        .templates
        .iter()
        .map(|t| (t.name.as_str(), compile(t)))
        .collect();
    assert!(
        fx.templates.len() >= 14,
        "expected the Qwen, hf-tiny and extra templates"
    );
    let (mut rendered, mut raised, mut failures) = (0, 0, Vec::new());
    for c in &fx.cases {
        let t = &templates[c.template.as_str()];
        let msgs = &fx.conversations[&c.conversation];
        let label = format!(
            "{} / {} / add_generation_prompt={}",
            c.template, c.conversation, c.add_generation_prompt
        );
        match (
            t.render(msgs, c.add_generation_prompt),
            &c.expected,
            &c.error,
        ) {
            (Ok(got), Some(want), _) if &got == want => rendered += 1,
            (Ok(got), Some(want), _) => {
                failures.push(format!("{label}:\n  want {want:?}\n  got  {got:?}"))
            }
            (Err(e), None, Some(msg)) if format!("{e:#}").contains(msg.as_str()) => raised += 1,
            (Err(e), None, Some(msg)) => {
                failures.push(format!("{label}: error {e:#} lacks {msg:?}"))
            }
            (Ok(got), None, Some(msg)) => failures.push(format!(
                "{label}: Python raised {msg:?}, we rendered {got:?}"
            )),
            (Err(e), _, _) => failures.push(format!("{label}: unexpected error {e:#}")),
            (Ok(_), None, None) => failures.push(format!("{label}: fixture has neither result")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(rendered + raised, fx.cases.len());
    assert!(
        raised >= 10,
        "the fixtures must include raise_exception cases, got {raised}"
    );
}

#[test]
fn qwen_multi_turn_prompt_is_chatml() {
    // Spelled out by hand from Qwen2.5's documented ChatML format, independent of any renderer.
    let fx = fixtures();
    let qwen = fx
        .templates
        .iter()
        .find(|t| t.name == "qwen2.5-coder-gguf")
        .unwrap();
    let t = compile(qwen);
    let msgs = [
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello!"),
        Message::new("user", "Bye"),
    ];
    assert_eq!(
        t.render(&msgs, true).unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn template_from_the_real_gguf_matches_the_fixture() {
    let path = common::model(common::QWEN);
    let g = infer::format::Gguf::open(&path).expect("open the Qwen GGUF");
    let tok = infer::tokenizer::Tokenizer::from_gguf(&g).expect("tokenizer");
    let t = ChatTemplate::from_gguf(&g, &tok)
        .unwrap()
        .expect("Qwen ships a template");
    let fx = fixtures();
    let qwen = fx
        .templates
        .iter()
        .find(|t| t.name == "qwen2.5-coder-gguf")
        .unwrap();
    assert_eq!(t.source(), qwen.source);
    // The GGUF's BOS is <|endoftext|> (id 151643); the rendering does not use it.
    assert_eq!(t.bos_token(), Some("<|endoftext|>"));
    let msgs = &fx.conversations["multi_turn"];
    let want = fx
        .cases
        .iter()
        .find(|c| {
            c.template == qwen.name && c.conversation == "multi_turn" && c.add_generation_prompt
        })
        .and_then(|c| c.expected.clone())
        .unwrap();
    assert_eq!(t.render(msgs, true).unwrap(), want);
}

#[test]
fn template_errors_are_clear() {
    let e =
        ChatTemplate::new("{% if messages %}\n{{ messages[0].content }}\n", "", "").unwrap_err();
    let s = format!("{e:#}");
    assert!(s.contains("does not compile") && s.contains("line"), "{s}");
    let t = ChatTemplate::new("{{ messages[0].content.nonexistent_method() }}", "", "").unwrap();
    let s = format!(
        "{:#}",
        t.render(&[Message::new("user", "x")], false).unwrap_err()
    );
    assert!(s.contains("line 1"), "{s}");
}

/// A template is code from someone else's file: a render that loops without end stops on its
/// instruction budget, one whose output grows without end stops at the output limit, and one
/// that tries to read a file (through `include`, `import` or `extends`) fails; each an error
/// that says why, never a hang or an unbounded allocation.
#[test]
fn templates_are_bounded_and_sandboxed() {
    let user = [Message::new("user", "x")];
    let err = |src: &str| {
        let t = ChatTemplate::new(src, "", "").unwrap();
        format!("{:#}", t.render(&user, true).unwrap_err())
    };
    let s = err("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
    assert!(s.contains("more than 20000000 instructions"), "{s}");
    let s = err("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}");
    assert!(s.contains("output passed 64 MiB"), "{s}");
    for src in [
        "{% include '/etc/passwd' %}",
        "{% import '/etc/passwd' as p %}",
        "{% extends '/etc/hostname' %}",
    ] {
        let s = err(src);
        assert!(
            s.contains("non-existing template") || s.contains("does not exist"),
            "{src}: {s}"
        );
        assert!(!s.contains("root:"), "{src}: {s}");
    }
}

/// The budget is far above what real conversations need: 5,000 messages (with every role the
/// templates accept, alternating) render with each real template of the fixtures.
#[test]
fn long_conversations_fit_the_budget() {
    let fx = fixtures();
    let msgs: Vec<Message> = (0..5000)
        .map(|i| {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            Message::new(role, &format!("message {i}"))
        })
        .collect();
    for t in &fx.templates {
        let c = compile(t);
        let out = c
            .render(&msgs, true)
            .unwrap_or_else(|e| panic!("{}: {e:#}", t.name));
        assert!(out.contains("message 4999"), "{}", t.name);
    }
}

/// `date -u +FMT` (coreutils), the independent truth for `strftime_now`.
fn date_u(fmt: &str) -> String {
    let out = Command::new("date")
        .arg("-u")
        .arg(format!("+{fmt}"))
        .output()
        .expect("date");
    String::from_utf8(out.stdout)
        .unwrap()
        .trim_end_matches('\n')
        .to_string()
}

#[test]
fn strftime_now_matches_date() {
    let fmt = "%d %b %Y|%A %B %-d|%Y-%m-%d %H:%M";
    let t = ChatTemplate::new(&format!("{{{{ strftime_now('{fmt}') }}}}"), "", "").unwrap();
    // Retry once in case the minute turned between the two readings.
    for _ in 0..2 {
        let before = date_u(fmt);
        let got = t.render(&[], false).unwrap();
        if got == before || got == date_u(fmt) {
            return;
        }
    }
    panic!(
        "strftime_now disagrees with date -u: {} vs {}",
        t.render(&[], false).unwrap(),
        date_u(fmt)
    );
}

#[test]
fn strftime_matches_date_for_fixed_times() {
    for secs in [
        0i64,
        951_782_400,
        1_709_251_199,
        1_735_689_600,
        4_102_444_799,
    ] {
        let fmt = "%a %d %b %Y %j %I %p %u %w %y";
        let out = Command::new("date")
            .arg("-u")
            .arg("-d")
            .arg(format!("@{secs}"))
            .arg(format!("+{fmt}"))
            .output()
            .expect("date");
        let want = String::from_utf8(out.stdout).unwrap();
        assert_eq!(strftime_utc(fmt, secs), want.trim_end(), "{secs}");
    }
}
