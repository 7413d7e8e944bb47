//! The `infer` binary as a user meets it: exit codes, error messages, tokenizer ids against
//! llama.cpp's (tests/fixtures/refs/tokenize.tsv), stdin prompts, JSON lines and a closed stdout.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};

use common::{fixture, model, stderr, stdout, GEMMA, QWEN};

#[test]
fn usage_errors_exit_2() {
    let o = common::infer(&["run", "--no-such-flag"], None);
    assert_eq!(o.status.code(), Some(2));
    let o = common::infer(&["run", "-m", "/nonexistent/model.gguf", "-p", "hi"], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.starts_with("infer: "), "{e}");
    assert!(e.contains("infer pull"), "{e}");
    // no prompt at all, stdin not piped
    let m = model(GEMMA);
    let o = common::infer(
        &[
            "run",
            "-m",
            m.to_str().unwrap(),
            "--prompt-ids",
            "999999999",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("outside the vocabulary"));
}

#[test]
fn malformed_model_exits_1_with_context() {
    let dir = std::env::temp_dir().join(format!("infer-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00\xff\xff").unwrap();
    let o = common::infer(&["run", "-m", bad.to_str().unwrap(), "-p", "hi"], None);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.starts_with("infer: reading "), "{e}");
    assert!(e.contains("bad.gguf"), "{e}");
    let o = common::infer(&["tokenize", "-m", bad.to_str().unwrap(), "hi"], None);
    assert_eq!(o.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Parses `[1, 2, 3]`.
fn ids(s: &str) -> Vec<u32> {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[test]
fn tokenize_matches_llama_cpp_probes() {
    let tsv = std::fs::read_to_string(fixture("refs/tokenize.tsv")).unwrap();
    let text_of = |probe: &str| match probe {
        "hello_world" => "Hello world",
        "leading_space" => " leading space",
        "chatml" => "<|im_start|>user\nhi<|im_end|>",
        other => panic!("unknown probe {other}"),
    };
    let mut checked = 0;
    for line in tsv.lines().filter(|l| !l.trim().is_empty()) {
        let cols: Vec<&str> = line.split('\t').collect();
        let file = if cols[0].starts_with("qwen") {
            QWEN
        } else {
            GEMMA
        };
        let m = model(file);
        let m = m.to_str().unwrap();
        let text = text_of(cols[1]);
        for (col, flags) in [
            (2, &[][..]),
            (3, &["--no-bos"][..]),
            (4, &["--no-special"][..]),
        ] {
            let want = ids(cols[col].rsplit_once('=').unwrap().1);
            let mut args = vec!["tokenize", "-m", m];
            args.extend_from_slice(flags);
            args.push(text);
            let o = common::infer(&args, None);
            assert!(o.status.success(), "{}", stderr(&o));
            assert_eq!(
                ids(&stdout(&o)),
                want,
                "{} {} {:?}",
                cols[0],
                cols[1],
                flags
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 18);
}

#[test]
fn tokenize_jsonl_matches_single_calls() {
    let m = model(QWEN);
    let m = m.to_str().unwrap();
    let input = "\"Hello world\"\n\" leading space\"\n\"<|im_start|>user\\nhi<|im_end|>\"\n";
    let out = infer_ok!(Some(input); "tokenize", "-m", m, "--jsonl");
    let lines: Vec<Vec<u32>> = out.lines().map(ids).collect();
    assert_eq!(
        lines,
        vec![
            vec![9707, 1879],
            vec![6388, 3550],
            vec![151644, 872, 198, 6023, 151645]
        ]
    );
}

#[test]
fn stdin_prompt_equals_flag_prompt_and_json_lines() {
    let m = model(GEMMA);
    let m = m.to_str().unwrap();
    let a = infer_ok!(None; "run", "-m", m, "-p", "def fibonacci(n):", "-n", "6", "--temp", "0");
    let b = infer_ok!(Some("def fibonacci(n):\n"); "run", "-m", m, "-n", "6", "--temp", "0");
    assert_eq!(a, b);
    assert!(!a.is_empty());
    let j = infer_ok!(None; "run", "-m", m, "-p", "def fibonacci(n):", "-n", "6", "--temp", "0", "--json");
    let lines: Vec<serde_json::Value> = j
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let text: String = lines
        .iter()
        .filter(|v| v.get("done").is_none())
        .map(|v| v["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, a);
    let done = lines.last().unwrap();
    assert_eq!(done["done"], true);
    assert_eq!(done["generated_tokens"], 6);
    assert_eq!(done["prompt_tokens"], 7);
    assert_eq!(done["stop"], "length");
}

#[test]
fn stop_string_cuts_output() {
    let m = model(GEMMA);
    let m = m.to_str().unwrap();
    // llama.cpp's greedy continuation: " the capital of the country of France. It is the largest ..."
    let j = infer_ok!(None; "run", "-m", m, "-p", "The capital of France is", "-n", "20", "--temp", "0", "--stop", ". It", "--json");
    let lines: Vec<serde_json::Value> = j
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let text: String = lines
        .iter()
        .filter(|v| v.get("done").is_none())
        .map(|v| v["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, " the capital of the country of France");
    assert_eq!(lines.last().unwrap()["stop"], "stop_string");
}

#[test]
fn closed_stdout_exits_0() {
    let m = model(GEMMA);
    let mut child = Command::new(env!("CARGO_BIN_EXE_infer"))
        .args([
            "run",
            "-m",
            m.to_str().unwrap(),
            "-p",
            "Once upon a time",
            "-n",
            "200",
            "--temp",
            "0",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut buf = [0u8; 5];
    out.read_exact(&mut buf).unwrap();
    drop(out);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
}
