//! `infer chat` driven in a pseudo-terminal (rexpect) with the real Qwen2.5-Coder model, greedy
//! and with short answers: two turns (the second computing only its new tokens), a `"""` block,
//! Ctrl-C at the prompt and during an answer, `/stats`, `/save` then `/clear` + `/load`
//! reproducing the conversation, Ctrl-D, and the history file; then `/load` in a fresh process
//! (real prefill, stdin piped) and `infer run --chat`. Token counts are checked against
//! `infer tokenize` of ChatML spelled out by hand.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use infer::chat::{Conversation, Message};
use regex::Regex;
use rexpect::process::WaitStatus;
use rexpect::reader::Options;
use rexpect::session::{spawn_with_options, PtySession};

/// The model tests share two cores: run them one at a time.
static MODEL: Mutex<()> = Mutex::new(());

const SYSTEM: &str = "Be brief.";
const Q1: &str = "What is the capital of France?";
const Q2: &str = "And of Italy?";
const Q3: &str = "Write a very long story about a dragon.";

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("infer-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn model() -> String {
    common::model(common::QWEN).display().to_string()
}

/// Token count of `text` by `infer tokenize` (special tokens parsed, the model's BOS rule).
fn n_tokens(text: &str) -> usize {
    let out = infer_ok!(None; "tokenize", "-m", &model(), text);
    let ids: Vec<u32> = serde_json::from_str(out.trim()).expect("tokenize prints a JSON array");
    ids.len()
}

fn chatml(messages: &[(&str, &str)], gen_prompt: bool) -> String {
    let mut s: String = messages
        .iter()
        .map(|(r, c)| format!("<|im_start|>{r}\n{c}<|im_end|>\n"))
        .collect();
    if gen_prompt {
        s.push_str("<|im_start|>assistant\n");
    }
    s
}

/// Parsed `/stats` line: `LABEL: prompt C computed, R reused (...)[; generated G (..., STOP)]`.
#[derive(Debug)]
struct StatLine {
    label: String,
    computed: usize,
    reused: usize,
    generated: Option<usize>,
    stop: Option<String>,
}

fn stat_lines(text: &str) -> Vec<StatLine> {
    let re = Regex::new(
        r"(?m)^(turn \d+|prefill): prompt (\d+) computed, (\d+) reused \([\d.]+ tokens/s\)(?:; generated (\d+) \([\d.]+ tokens/s, (\w+)\))?",
    )
    .unwrap();
    re.captures_iter(text)
        .map(|c| StatLine {
            label: c[1].to_string(),
            computed: c[2].parse().unwrap(),
            reused: c[3].parse().unwrap(),
            generated: c.get(4).map(|m| m.as_str().parse().unwrap()),
            stop: c.get(5).map(|m| m.as_str().to_string()),
        })
        .collect()
}

fn spawn_chat(data: &Path, extra: &[&str]) -> PtySession {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_infer"));
    cmd.args([
        "chat",
        "-m",
        &model(),
        "--temp",
        "0",
        "-n",
        "8",
        "--ctx",
        "1024",
    ])
    .args(["--system", SYSTEM])
    .args(extra)
    .env("XDG_DATA_HOME", data)
    .env("TERM", "xterm");
    let opts = Options::new()
        .timeout_ms(Some(300_000))
        .strip_ansi_escape_codes(true);
    spawn_with_options(cmd, opts).expect("spawn infer chat in a pty")
}

/// Sends a line and waits until its Enter has been echoed (so later output is the program's).
fn send(p: &mut PtySession, line: &str) -> String {
    p.send_line(line).unwrap();
    p.exp_string("\n").unwrap()
}

/// Waits for the next prompt; returns everything printed before it.
fn prompt(p: &mut PtySession) -> String {
    let out = p.exp_string(">>> ").unwrap();
    eprintln!("[screen] {out:?}"); // the transcript, shown when a test fails
    out
}

#[test]
fn repl_two_turns_interrupt_stats_save_load() {
    let _guard = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("chat-repl");
    let data = dir.0.join("data");
    let mut p = spawn_chat(&data, &[]);
    let banner = prompt(&mut p);
    assert!(banner.contains("/help lists commands"), "{banner}");

    // Turn 1.
    send(&mut p, Q1);
    let a1_screen = prompt(&mut p);
    assert!(a1_screen.contains("Paris"), "turn 1 answer: {a1_screen:?}");

    // Ctrl-C at the prompt discards the line being typed.
    p.send("garbage that must never be sent").unwrap();
    p.flush().unwrap();
    p.exp_string("never be sent").unwrap();
    p.send_control('c').unwrap();
    prompt(&mut p);

    // Turn 2, typed as a """ block over three lines.
    send(&mut p, "\"\"\"");
    send(&mut p, Q2);
    send(&mut p, "\"\"\"");
    let a2_screen = prompt(&mut p);
    assert!(a2_screen.contains("Rome"), "turn 2 answer: {a2_screen:?}");

    send(&mut p, "/stats");
    let stats = prompt(&mut p);
    let lines = stat_lines(&stats);
    assert_eq!(lines.len(), 2, "{stats}");
    let conv1 = chatml(&[("system", SYSTEM), ("user", Q1)], true);
    assert_eq!(lines[0].computed, n_tokens(&conv1), "{stats}");
    assert_eq!(lines[0].reused, 0);
    // Turn 2 reuses turn 1's prompt and answer and computes only the new text. An answer that
    // ended with EOS has all its tokens computed (the EOS came from the last one's logits); one
    // cut at -n has its last token uncached, so turn 2 computes it too.
    let g1 = lines[0].generated.unwrap();
    assert!((1..=8).contains(&g1), "{stats}");
    let uncached = usize::from(lines[0].stop.as_deref() != Some("eos"));
    assert_eq!(
        lines[1].reused,
        lines[0].computed + g1 - uncached,
        "{stats}"
    );
    let tail = "<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(lines[1].computed, uncached + n_tokens(tail), "{stats}");
    assert!(
        lines[1].computed * 2 < lines[1].computed + lines[1].reused,
        "{stats}"
    );

    // Turn 3: Ctrl-C once the answer has started.
    p.send_line("/set max-tokens 200").unwrap();
    p.exp_string("max-tokens = 200").unwrap();
    prompt(&mut p);
    send(&mut p, Q3);
    loop {
        match p.try_read() {
            Some(c) if c.is_alphanumeric() => break,
            Some(_) => {}
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    p.send_control('c').unwrap();
    p.exp_string("[interrupted]").unwrap();
    prompt(&mut p);

    send(&mut p, "/stats");
    let stats = prompt(&mut p);
    let lines = stat_lines(&stats);
    assert_eq!(lines.len(), 3, "{stats}");
    assert_eq!(lines[2].stop.as_deref(), Some("interrupted"), "{stats}");
    let g3 = lines[2].generated.unwrap();
    assert!((1..200).contains(&g3), "{stats}");

    // /save: the conversation as shown, the partial answer kept, the discarded line absent.
    let a_json = dir.0.join("a.json");
    send(&mut p, &format!("/save {}", a_json.display()));
    p.exp_string("saved 7 messages").unwrap();
    prompt(&mut p);
    let saved = Conversation::from_json(&std::fs::read_to_string(&a_json).unwrap()).unwrap();
    let roles: Vec<&str> = saved.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(
        roles,
        [
            "system",
            "user",
            "assistant",
            "user",
            "assistant",
            "user",
            "assistant"
        ]
    );
    assert_eq!(saved.messages[0], Message::new("system", SYSTEM));
    assert_eq!(saved.messages[1], Message::new("user", Q1));
    assert_eq!(saved.messages[3], Message::new("user", Q2));
    assert_eq!(saved.messages[5], Message::new("user", Q3));
    for (i, screen) in [(2, &a1_screen), (4, &a2_screen)] {
        let a = &saved.messages[i].content;
        assert!(
            !a.is_empty() && screen.contains(a.as_str()),
            "{a:?} not in {screen:?}"
        );
    }
    assert!(!saved.messages[6].content.is_empty());

    // /clear + /load restore it (the cached KV is reused), /save writes the same file.
    send(&mut p, "/clear");
    p.exp_string("conversation cleared").unwrap();
    prompt(&mut p);
    send(&mut p, &format!("/load {}", a_json.display()));
    let (_, loaded) = p
        .exp_regex(r"loaded 7 messages from .* \((\d+) tokens prefilled, (\d+) reused\)")
        .unwrap();
    prompt(&mut p);
    let nums: Vec<usize> = Regex::new(r"\d+")
        .unwrap()
        .find_iter(loaded.split(" from ").nth(1).unwrap())
        .map(|m| m.as_str().parse().unwrap())
        .collect();
    let n = nums.len();
    let (prefilled, reused) = (nums[n - 2], nums[n - 1]);
    assert!(reused > prefilled, "{loaded}");
    let b_json = dir.0.join("b.json");
    send(&mut p, &format!("/save {}", b_json.display()));
    p.exp_string("saved 7 messages").unwrap();
    prompt(&mut p);
    assert_eq!(
        std::fs::read_to_string(&a_json).unwrap(),
        std::fs::read_to_string(&b_json).unwrap()
    );

    // Ctrl-D leaves cleanly and the history was written.
    p.send_control('d').unwrap();
    p.exp_eof().unwrap();
    let status = p.process().wait().unwrap();
    assert!(matches!(status, WaitStatus::Exited(_, 0)), "{status:?}");
    let history = std::fs::read_to_string(data.join("infer/history.txt")).expect("history file");
    assert!(
        history.contains(Q1) && history.contains("/stats"),
        "{history}"
    );
    assert!(!history.contains("garbage"), "{history}");
}

#[test]
fn load_in_a_fresh_process_prefills_the_conversation() {
    let _guard = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("chat-load");
    let file = dir.0.join("c.json");
    let conv = [("system", SYSTEM), ("user", "Hi"), ("assistant", "Hello!")];
    let mut c = Conversation::new(None);
    for (r, t) in conv {
        c.push(r, t);
    }
    std::fs::write(&file, c.to_json()).unwrap();
    // Piped stdin (no terminal): the same REPL, reading lines.
    let stdin = format!("/load {}\n/stats\n", file.display());
    let o = common::infer(
        &["chat", "-m", &model(), "--temp", "0", "--no-history"],
        Some(&stdin),
    );
    let (out, err) = (common::stdout(&o), common::stderr(&o));
    assert!(o.status.success(), "{err}");
    assert!(out.contains("user: Hi\nassistant: Hello!\n"), "{out}");
    let want = n_tokens(&chatml(&conv, false));
    let lines = stat_lines(&out);
    assert_eq!(lines.len(), 1, "{out}");
    assert_eq!(
        (lines[0].label.as_str(), lines[0].computed, lines[0].reused),
        ("prefill", want, 0)
    );
    assert!(
        out.contains(&format!("context: {want} / 4096 tokens")),
        "{out}"
    );
}

#[test]
fn run_chat_applies_the_template() {
    let _guard = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let o = common::infer(
        &[
            "run",
            "-m",
            &model(),
            "--chat",
            "--system",
            SYSTEM,
            "-p",
            Q1,
            "--temp",
            "0",
            "-n",
            "6",
        ],
        None,
    );
    let (out, err) = (common::stdout(&o), common::stderr(&o));
    assert!(o.status.success(), "{err}");
    assert!(out.contains("Paris"), "{out}");
    let want = n_tokens(&chatml(&[("system", SYSTEM), ("user", Q1)], true));
    assert!(err.contains(&format!("prompt {want} tokens")), "{err}");
}

#[test]
fn missing_model_names_infer_pull() {
    let o = common::infer(&["chat", "-m", "/nonexistent/model.gguf"], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(common::stderr(&o).contains("infer pull"));
}

#[test]
fn context_full_drops_the_oldest_turns() {
    let _guard = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("chat-full");
    let (file, out_file) = (dir.0.join("long.json"), dir.0.join("kept.json"));
    let pairs = [
        ("What is 1+1?", "2"),
        ("What is 2+2?", "4"),
        ("What is 3+3?", "6"),
    ];
    let mut c = Conversation::new(Some(SYSTEM));
    for (q, a) in pairs {
        c.push("user", q);
        c.push("assistant", a);
    }
    std::fs::write(&file, c.to_json()).unwrap();
    // --ctx 64 -n 40: a prompt must leave min(40, 64/2) = 32 tokens for the answer, so at most
    // 32 prompt tokens; drop the oldest pairs until the hand-spelled ChatML fits.
    let mut kept = pairs.len();
    let spelled = |k: usize| {
        let mut m = vec![("system", SYSTEM)];
        for (q, a) in &pairs[pairs.len() - k..] {
            m.push(("user", q));
            m.push(("assistant", a));
        }
        chatml(&m, false)
    };
    while n_tokens(&spelled(kept)) > 32 {
        kept -= 1;
    }
    assert!(
        kept >= 1 && kept < pairs.len(),
        "the fixture must force a drop"
    );
    let huge = "word ".repeat(100);
    let stdin = format!(
        "/load {}\n{huge}\n/save {}\n/stats\n",
        file.display(),
        out_file.display()
    );
    let o = common::infer(
        &[
            "chat",
            "-m",
            &model(),
            "--temp",
            "0",
            "--ctx",
            "64",
            "-n",
            "40",
            "--no-history",
        ],
        Some(&stdin),
    );
    let (out, err) = (common::stdout(&o), common::stderr(&o));
    assert!(o.status.success(), "{err}");
    assert!(err.contains("context full"), "{err}");
    // The oversized message is refused with the numbers, and the conversation is kept as it was.
    assert!(
        err.contains("tokens but the context holds 64 (start infer chat with a larger --ctx)"),
        "{err}"
    );
    let saved = Conversation::from_json(&std::fs::read_to_string(&out_file).unwrap()).unwrap();
    assert_eq!(saved.messages.len(), 1 + 2 * kept, "{out}");
    assert_eq!(saved.messages[0], Message::new("system", SYSTEM));
    assert_eq!(
        saved.messages[1],
        Message::new("user", pairs[pairs.len() - kept].0)
    );
    let lines = stat_lines(&out);
    assert_eq!(lines.len(), 1, "{out}");
    assert_eq!(lines[0].computed, n_tokens(&spelled(kept)), "{out}");
}

fn gemma() -> String {
    common::model(common::GEMMA).display().to_string()
}

#[test]
fn model_without_template_uses_the_fallback_format() {
    let _guard = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let o = common::infer(
        &[
            "run",
            "-m",
            &gemma(),
            "--chat",
            "-p",
            "Hi",
            "--temp",
            "0",
            "-n",
            "3",
        ],
        None,
    );
    let err = common::stderr(&o);
    assert!(o.status.success(), "{err}");
    assert_eq!(err.matches("has no chat template").count(), 1, "{err}");
    // "User: Hi\nAssistant:" with the model's BOS, as `infer tokenize` counts it.
    let ids = infer_ok!(None; "tokenize", "-m", &gemma(), "User: Hi\nAssistant:");
    let ids: Vec<u32> = serde_json::from_str(ids.trim()).unwrap();
    assert_eq!(ids[0], 2, "Gemma adds BOS");
    assert!(
        err.contains(&format!("prompt {} tokens", ids.len())),
        "{err}"
    );
}

#[test]
fn template_file_that_prints_bos_gets_no_second_bos() {
    let _guard = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = TempDir::new("chat-tmpl");
    let tmpl = dir.0.join("t.jinja");
    std::fs::write(
        &tmpl,
        "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}",
    )
    .unwrap();
    let conv = dir.0.join("c.json");
    std::fs::write(
        &conv,
        r#"[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"}]"#,
    )
    .unwrap();
    // A data dir that cannot be created: history fails with a warning, not an error.
    let not_a_dir = dir.0.join("file");
    std::fs::write(&not_a_dir, "").unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_infer"));
    cmd.args(["chat", "-m", &gemma(), "--temp", "0"])
        .arg("--chat-template")
        .arg(&tmpl)
        .env("XDG_DATA_HOME", &not_a_dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    {
        use std::io::Write;
        let mut w = child.stdin.take().unwrap();
        writeln!(w, "/load {}\n/stats", conv.display()).unwrap();
    }
    let o = child.wait_with_output().unwrap();
    let (out, err) = (common::stdout(&o), common::stderr(&o));
    assert!(o.status.success(), "{err}");
    assert!(err.contains("warning: cannot write history"), "{err}");
    assert!(!err.contains("has no chat template"), "{err}");
    let text = "<bos><user>Hi\n<assistant>Hello\n";
    let with_rule = infer_ok!(None; "tokenize", "-m", &gemma(), "--no-bos", text);
    let with_rule: Vec<u32> = serde_json::from_str(with_rule.trim()).unwrap();
    assert_eq!(with_rule[0], 2);
    assert_ne!(with_rule[1], 2, "exactly one BOS");
    let lines = stat_lines(&out);
    assert_eq!(lines.len(), 1, "{out}");
    assert_eq!(lines[0].computed, with_rule.len(), "{out}");
}

/// `--context-shift`: an answer longer than the context goes on (the oldest block after the kept
/// start is dropped, keys re-rotated) instead of being cut when the context is full.
#[test]
fn context_shift_lets_an_answer_outgrow_the_context() {
    let _guard = MODEL.lock().unwrap_or_else(|e| e.into_inner());
    let stdin = "Write a very long story about a dragon who loves to count numbers.\n/stats\n";
    let args = [
        "chat",
        "-m",
        &gemma(),
        "--ctx",
        "128",
        "-n",
        "400",
        "--temp",
        "0",
    ];
    let o = common::infer(
        &[&args[..], &["--no-history", "--context-shift"]].concat(),
        Some(stdin),
    );
    let (out, err) = (common::stdout(&o), common::stderr(&o));
    assert!(o.status.success(), "{err}");
    assert!(out.contains("generated 400 "), "{out}");
    assert!(!err.contains("the context is full"), "{err}");
    // Without the flag the same answer stops at the context.
    let o = common::infer(&[&args[..], &["--no-history"]].concat(), Some(stdin));
    let out = common::stdout(&o);
    assert!(
        o.status.success() && !out.contains("generated 400 "),
        "{out}"
    );
}
