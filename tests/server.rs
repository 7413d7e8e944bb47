//! `infer serve` end to end: the real binary on loopback, driven by the official `openai` Python
//! client (tests/server/openai_client.py; structured output and tool calls in
//! tests/server/structured_client.py), a load and fault test with more clients than KV
//! (tests/server/load.py), the chat page in headless Chromium (tests/server/chat_page.py), and
//! a stop signal in the middle of a stream. The truth for greedy outputs is `infer run` alone.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{json, Value};

/// A running `infer serve` on a free port; stopped with SIGTERM when dropped.
struct Server {
    child: Child,
    url: String,
    /// The server's stderr lines after "ready".
    log: mpsc::Receiver<String>,
}

impl Server {
    fn start(model: &str, args: &[&str]) -> Server {
        let path = common::model(model);
        let mut child = Command::new(env!("CARGO_BIN_EXE_infer"))
            .args(["serve", "-m", path.to_str().unwrap(), "--port", "0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn infer serve");
        let (tx, rx) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                eprintln!("[server] {line}");
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut url = None;
        while let Ok(line) = rx.recv_timeout(Duration::from_secs(120)) {
            if let Some(rest) = line.strip_prefix("infer: ready: ") {
                url = rest
                    .split(' ')
                    .next()
                    .map(|u| u.trim_end_matches('/').to_string());
                break;
            }
        }
        let url = url.expect("the server said it is ready");
        Server {
            child,
            url,
            log: rx,
        }
    }

    fn addr(&self) -> String {
        self.url.trim_start_matches("http://").to_string()
    }

    /// SIGTERM, then the exit status.
    fn stop(mut self) -> std::process::ExitStatus {
        terminate(&self.child);
        let status = self.child.wait().expect("wait for the server");
        std::mem::forget(self);
        status
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        terminate(&self.child);
        let _ = self.child.wait();
    }
}

fn terminate(child: &Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
}

/// Runs a Python test script; fails with its output unless it exits 0.
fn python(script: &str, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(common::root().join("tests/server").join(script))
        .args(args)
        .output()
        .expect("python3 runs (scripts/test.sh installs what the tests need)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Writes the truth a Python test checks against to a temporary file.
fn expect_file(tag: &str, v: &Value) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("infer-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("expect.json");
    std::fs::write(&path, v.to_string()).unwrap();
    path
}

/// What `infer run` prints alone for a prompt (greedy).
fn solo(model: &str, chat: bool, prompt: &str, n: usize) -> String {
    let path = common::model(model);
    let n = n.to_string();
    let mut args = vec![
        "run",
        "-q",
        "-m",
        path.to_str().unwrap(),
        "--temp",
        "0",
        "-n",
        &n,
        "-p",
        prompt,
    ];
    if chat {
        args.push("--chat");
    }
    let o = common::infer(&args, None);
    assert!(o.status.success(), "{}", common::stderr(&o));
    common::stdout(&o)
}

#[test]
fn openai_client_chat_completions_errors_and_metrics() {
    let ctx = 1024;
    let chat_prompt = "Write a haiku about the sea.";
    let completion_prompt = "def fibonacci(n):";
    let tok_text = "Hello, world! Ünïcödé and code: fn main() {}";
    let ids = common::stdout(&common::infer(
        &[
            "tokenize",
            "-m",
            common::model(common::QWEN).to_str().unwrap(),
            tok_text,
        ],
        None,
    ));
    let ids: Value = serde_json::from_str(ids.trim()).expect("tokenize prints a JSON array");
    let expect = json!({
        "chat": {"prompt": chat_prompt, "max_tokens": 24, "text": solo(common::QWEN, true, chat_prompt, 24)},
        "completion": {"prompt": completion_prompt, "max_tokens": 24,
                       "text": solo(common::QWEN, false, completion_prompt, 24)},
        "tokenize": {"text": tok_text, "ids": ids},
        "ctx": ctx,
    });
    let expect_path = expect_file("server", &expect);
    let ctx = ctx.to_string();
    let server = Server::start(
        common::QWEN,
        &[
            "--api-key",
            "test-key",
            "--parallel",
            "2",
            "--queue",
            "1",
            "--temp",
            "0",
            "--ctx",
            &ctx,
            "--lookup",
            "2",
        ],
    );
    python(
        "openai_client.py",
        &[
            "--url",
            &server.url,
            "--api-key",
            "test-key",
            "--expect",
            expect_path.to_str().unwrap(),
        ],
    );
    assert!(server.stop().success(), "the server exits 0 on SIGTERM");
}

/// Structured output and tool calls through the official client (tests/server/structured_client.py):
/// `response_format` json_schema/json_object checked with `jsonschema`, refused schemas, and a
/// weather tool with `tool_choice` required/named, streamed, and its result rendered next turn.
#[test]
fn openai_client_structured_output_and_tool_calls() {
    let server = Server::start(common::QWEN, &["--temp", "0", "--ctx", "2048"]);
    python("structured_client.py", &["--url", &server.url]);
    assert!(server.stop().success(), "the server exits 0 on SIGTERM");
}

#[test]
fn load_and_faults_with_a_small_kv_pool() {
    // 32 prompts of their own (short: no two share a KV block, so each is computed as alone).
    let prompts: Vec<String> = (0..32)
        .map(|i| format!("Fact {i}: the number {} is", 7 * i + 3))
        .collect();
    let max_tokens = 24;
    let batch: String = prompts
        .iter()
        .map(|p| json!({"prompt": p, "max_tokens": max_tokens}).to_string() + "\n")
        .collect();
    let path = common::model(common::GEMMA);
    let o = common::infer(
        &[
            "run",
            "-q",
            "-m",
            path.to_str().unwrap(),
            "--temp",
            "0",
            "--batch-file",
            "-",
            "--parallel",
            "1",
        ],
        Some(&batch),
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    let solo: Vec<String> = common::stdout(&o)
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(solo.len(), prompts.len());
    let expect_path = expect_file(
        "load",
        &json!({"prompts": prompts, "texts": solo, "max_tokens": max_tokens}),
    );
    // 8 at once in a pool of 256 positions: 8 sequences of ~40 positions need more, so the
    // scheduler preempts and recomputes.
    let server = Server::start(
        common::GEMMA,
        &[
            "--parallel",
            "8",
            "--ctx",
            "128",
            "--kv-size",
            "256",
            "--temp",
            "0",
            "--queue",
            "64",
        ],
    );
    let out = python(
        "load.py",
        &[
            "--url",
            &server.url,
            "--expect",
            expect_path.to_str().unwrap(),
        ],
    );
    eprintln!("{out}");
    assert!(server.stop().success(), "the server exits 0 on SIGTERM");
}

#[test]
fn chat_page_streams_an_answer_in_chromium() {
    let server = Server::start(common::QWEN, &["--parallel", "1", "--temp", "0"]);
    let shot = std::env::var("INFER_SCREENSHOT").unwrap_or_else(|_| {
        std::env::temp_dir()
            .join("infer-chat-page.png")
            .to_string_lossy()
            .into_owned()
    });
    let out = python(
        "chat_page.py",
        &[
            "--url",
            &server.url,
            "--screenshot",
            &shot,
            // Greedy, and an answer of 20 tokens: the page's own temperature (0.7) once gave a
            // one-token "Hello" that could not be seen streaming.
            "--temperature",
            "0",
            "--message",
            "Count from one to ten in words.",
        ],
    );
    let result: Value = serde_json::from_str(out.lines().last().unwrap_or("{}")).unwrap();
    assert_eq!(result["ok"], true, "{out}");
}

/// SIGTERM while a stream runs: the stream still gets a final chunk and `[DONE]`, and the
/// server exits 0.
#[test]
fn sigterm_ends_streams_cleanly() {
    let server = Server::start(common::GEMMA, &["--temp", "0"]);
    let mut s = TcpStream::connect(server.addr()).unwrap();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 2000, "stream": true,
                      "ignore_eos": true})
    .to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Wait for some tokens, then stop the server.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.windows(6).filter(|w| w == b"data: ").count() < 5 {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&buf[..n]);
    }
    terminate(&server.child);
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.read_to_end(&mut got).unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.contains("\"finish_reason\":\"length\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]\r\n\r\n0") || text.contains("data: [DONE]"));
    let lines: Vec<String> = server.log.try_iter().collect();
    assert!(server.stop().success(), "exit status 0; log: {lines:?}");
}
