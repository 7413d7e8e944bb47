//! Structured output end to end, through the real binary: llama.cpp's example grammars constrain
//! Gemma-3-270M and every output is checked by an independent GBNF recognizer
//! (tests/structured/gbnf_check.py); real-world JSON schemas (tests/fixtures/schemastore) give
//! instances that Python's `jsonschema` accepts or are refused with a reason; speculative decoding
//! and batching leave constrained greedy output unchanged; bad constraints exit 2 with where and
//! why.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

fn gemma() -> String {
    common::model(common::GEMMA).to_str().unwrap().to_string()
}

/// Whether `text` is in `grammar`'s language (or, with `prefix`, starts a text that is).
fn gbnf_accepts(grammar: &std::path::Path, text: &str, prefix: bool) -> bool {
    let mut cmd = Command::new("python3");
    cmd.arg(common::root().join("tests/structured/gbnf_check.py"));
    if prefix {
        cmd.arg("--prefix");
    }
    let mut child = cmd
        .arg(grammar)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap().status.success()
}

#[test]
fn llama_cpp_grammars_constrain_every_output() {
    let cases = [
        ("arithmetic", "Some sums:\n"),
        ("chess", "A chess game:\n"),
        ("json", "A JSON object:\n"),
        ("json_arr", "A JSON list:\n"),
        ("list", "A shopping list:\n"),
        ("c", "A C program:\n"),
        ("english", "An English sentence:\n"),
        // infer's own: a structure that ends by itself, so the full-match check always runs.
        ("date_verdict", "The date, and whether it was a holiday:\n"),
    ];
    let mut finished = 0;
    for (name, prompt) in cases {
        let grammar = common::fixture(&format!("gbnf/{name}.gbnf"));
        for seed in ["1", "2"] {
            let o = common::infer(
                &[
                    "run",
                    "-m",
                    &gemma(),
                    "-p",
                    prompt,
                    "--grammar",
                    grammar.to_str().unwrap(),
                    "--temp",
                    "0.8",
                    "--seed",
                    seed,
                    "-n",
                    "96",
                ],
                None,
            );
            let err = common::stderr(&o);
            assert!(o.status.success(), "{name}: {err}");
            let text = common::stdout(&o);
            let complete = err.contains("stop: eos");
            finished += usize::from(complete);
            assert!(
                gbnf_accepts(&grammar, &text, !complete),
                "{name} (seed {seed}, complete: {complete}): {text:?} is not in the grammar's language"
            );
        }
    }
    // The llama.cpp grammars end where the model chooses (often past the budget); date_verdict
    // always ends, so complete outputs are always among those checked.
    assert!(
        finished >= 2,
        "only {finished} outputs ended inside the budget"
    );
}

#[test]
fn real_world_schemas_validate_or_are_refused() {
    let out = Command::new("python3")
        .arg(common::root().join("tests/structured/schema_corpus.py"))
        .args(["--infer", env!("CARGO_BIN_EXE_infer"), "--model", &gemma()])
        .args(["--every", "10"])
        .output()
        .expect("python3 runs (scripts/test.sh installs jsonschema)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 20 schemas: both outcomes occur (the last full run: docs/structured-output.md).
    assert!(
        stdout.contains("valid: ") && !stdout.contains("valid: 0;"),
        "{stdout}"
    );
    assert!(stdout.contains("refused"), "{stdout}");
}

/// Greedy constrained output is the same through the scheduler, with prompt lookup, with
/// self-speculation (drafts checked against the constraint, rows masked before verification),
/// through the single-sequence loop (masks computed beside its forward) and in a batch.
#[test]
fn speculation_and_batching_keep_constrained_greedy_output() {
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":30},"tags":{"type":"array","items":{"type":"string","maxLength":12},"maxItems":4},"ok":{"type":"boolean"}},"required":["name","tags","ok"],"additionalProperties":false}"#;
    let prompt = "A JSON record of a library book, with tags:\n";
    let base = [
        "run",
        "-m",
        &gemma(),
        "-p",
        prompt,
        "--json-schema",
        schema,
        "--temp",
        "0",
        "-n",
        "80",
    ];
    let run = |extra: &[&str]| {
        let o = common::infer(&[&base[..], extra].concat(), None);
        assert!(o.status.success(), "{}", common::stderr(&o));
        common::stdout(&o)
    };
    let plain = run(&[]);
    let v: serde_json::Value = serde_json::from_str(&plain).expect("the output is JSON");
    assert!(v["tags"].is_array() && v["ok"].is_boolean(), "{plain}");
    assert_eq!(run(&["--lookup", "3"]), plain, "prompt lookup");
    assert_eq!(run(&["--self-draft", "6"]), plain, "self-speculation");
    assert_eq!(run(&["--context-shift"]), plain, "the single-sequence loop");
    let dir = common::scratch("structured_batch");
    let batch = dir.join("batch.jsonl");
    let line = serde_json::json!({"prompt": prompt, "json_schema": serde_json::from_str::<serde_json::Value>(schema).unwrap(), "max_tokens": 80, "temperature": 0});
    let other = serde_json::json!({"prompt": "Once upon a time", "max_tokens": 20});
    std::fs::write(&batch, format!("{other}\n{line}\n{other}\n")).unwrap();
    let o = common::infer(
        &[
            "run",
            "-m",
            &gemma(),
            "--batch-file",
            batch.to_str().unwrap(),
        ],
        None,
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    let lines: Vec<serde_json::Value> = common::stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[1]["text"], plain.as_str(), "in a batch");
}

/// A JSON answer cut short by its token budget still parses and validates: near the end of the
/// budget the constraint closes what is open (stop reason `length`), in a batch and through the
/// single-sequence loop with and without self-speculation, with the same greedy tokens.
#[test]
fn json_closes_inside_the_token_budget() {
    let schema = serde_json::json!({"type": "object", "properties": {
        "title": {"type": "string"},
        "chapters": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "text": {"type": "string"}}, "required": ["name", "text"]}}},
        "required": ["title", "chapters"]});
    let prompt = "A very long novel as JSON, every chapter in full:\n";
    let model = gemma();
    let dir = common::scratch("structured_budget");
    let batch = dir.join("batch.jsonl");
    let budgets = [16usize, 40, 64];
    let lines: String = budgets
        .iter()
        .map(|n| {
            let l = serde_json::json!({"prompt": prompt, "json_schema": schema, "max_tokens": n, "temperature": 0});
            format!("{l}\n")
        })
        .collect();
    std::fs::write(&batch, lines).unwrap();
    let o = common::infer(
        &["run", "-m", &model, "--batch-file", batch.to_str().unwrap()],
        None,
    );
    assert!(o.status.success(), "{}", common::stderr(&o));
    let results: Vec<serde_json::Value> = common::stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (n, r) in budgets.iter().zip(&results) {
        let text = r["text"].as_str().unwrap();
        let v: serde_json::Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("budget {n}: not JSON ({e}): {text}"));
        assert!(
            v["title"].is_string() && v["chapters"].is_array(),
            "budget {n}: {text}"
        );
        for c in v["chapters"].as_array().unwrap() {
            assert!(
                c["name"].is_string() && c["text"].is_string(),
                "budget {n}: {text}"
            );
        }
        assert!(r["generated_tokens"].as_u64().unwrap() <= *n as u64, "{r}");
        assert_eq!(r["stop"], "length", "budget {n}: {r}");
        // The single-sequence loop, plain and self-speculating, closes the same way.
        if *n != 40 {
            continue;
        }
        let n = n.to_string();
        let schema = schema.to_string();
        for extra in [&["--context-shift"][..], &["--self-draft", "4"]] {
            let args = [
                &[
                    "run",
                    "-m",
                    &model,
                    "-p",
                    prompt,
                    "--json-schema",
                    &schema,
                    "--temp",
                    "0",
                    "-n",
                    &n,
                ][..],
                extra,
            ]
            .concat();
            let o = common::infer(&args, None);
            assert!(o.status.success(), "{}", common::stderr(&o));
            assert_eq!(common::stdout(&o), text, "budget {n}, {extra:?}");
        }
    }
}

#[test]
fn bad_constraints_exit_2_saying_where_and_why() {
    let dir = common::scratch("structured_bad");
    let bad = dir.join("bad.gbnf");
    std::fs::write(&bad, "root ::= item+\nitem ::= \"a\" | missing\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--grammar".into(), bad.to_str().unwrap().into()],
            "line 2, column 16: rule 'missing' is not defined",
        ),
        (
            vec![
                "--json-schema".into(),
                r#"{"type":"array","uniqueItems":true}"#.into(),
            ],
            "uniqueItems",
        ),
        (
            vec!["--json-schema".into(), "{not json".into()],
            "--json-schema {not json: not JSON",
        ),
        (
            vec!["--regex".into(), "(ab".into()],
            "--regex: invalid regex",
        ),
        (
            vec![
                "--grammar".into(),
                dir.join("absent.gbnf").to_str().unwrap().into(),
            ],
            "absent.gbnf",
        ),
    ];
    for (flags, want) in cases {
        let mut args = vec![
            "run".to_string(),
            "-m".into(),
            gemma(),
            "-p".into(),
            "x".into(),
        ];
        args.extend(flags);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = common::infer(&args, None);
        let err = common::stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: wanted {want:?} in {err}");
        assert!(
            common::stdout(&o).is_empty(),
            "no output on a refused constraint"
        );
    }
}
