//! `infer` in pipelines, with the real models: `--quiet` (nothing on stderr but errors),
//! `--logprobs N` checked against a log-softmax computed here from logits obtained through the
//! library, `--batch-file` against one `infer run` per request (byte-identical text) and its
//! handling of malformed lines, and progress bars drawn on a terminal (a pseudo-terminal) but
//! never into a pipe or under `--quiet`.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{model, stderr, stdout, GEMMA, QWEN};
use infer::engine::runner::{Runner, Sequence, BLOCK_SIZE};
use infer::format::Gguf;
use infer::kernels::cpu::backend::CpuBackend;
use infer::model::{Model, ModelConfig, Weights};
use infer::tokenizer::Tokenizer;
use serde_json::Value;

/// The model tests share two cores: run them one at a time.
static MODEL: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    MODEL.lock().unwrap_or_else(|e| e.into_inner())
}

fn gemma() -> String {
    model(GEMMA).display().to_string()
}

/// Runs `infer` (stdin closed), asserts success, returns stdout.
fn ok(args: &[&str]) -> String {
    let o = common::infer(args, None);
    assert!(o.status.success(), "infer {args:?} failed: {}", stderr(&o));
    stdout(&o)
}

fn json_lines(s: &str) -> Vec<Value> {
    s.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect()
}

struct TempDir(std::path::PathBuf);

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

#[test]
fn quiet_leaves_stderr_empty_but_errors() {
    let _g = lock();
    let m = gemma();
    let args = ["run", "-m", &m, "-p", "The capital of France is", "-n", "8"];
    let loud = common::infer(&[&args[..], &["--temp", "0"]].concat(), None);
    assert!(loud.status.success(), "{}", stderr(&loud));
    assert!(stderr(&loud).contains("infer: loaded"), "{}", stderr(&loud));
    for extra in [
        &["--temp", "0", "--quiet"][..],
        &["--temp", "0", "-q"][..],
        &["--temp", "0", "-q", "--json", "--logprobs", "2"][..],
    ] {
        let o = common::infer(&[&args[..], extra].concat(), None);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        assert_eq!(stderr(&o), "", "{extra:?}");
        if !extra.contains(&"--json") {
            assert_eq!(stdout(&o), stdout(&loud), "--quiet changes only stderr");
        }
    }
    // a global flag: before the subcommand too
    let o = common::infer(&[&["-q"][..], &args[..], &["--temp", "0"]].concat(), None);
    assert!(o.status.success());
    assert_eq!(stderr(&o), "");
    // the chat REPL with piped stdin, and bench
    let o = common::infer(
        &[
            "chat",
            "-q",
            "-m",
            &m,
            "--no-history",
            "-n",
            "4",
            "--temp",
            "0",
        ],
        Some("Hi\n/stats\n/exit\n"),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    assert!(stdout(&o).contains("turn 1: prompt"), "{}", stdout(&o));
    let o = common::infer(
        &["bench", "-q", "-m", &m, "-p", "8", "-n", "2", "-r", "1"],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    // The KV cache a token reads, from Gemma-3 270M's shape (18 layers, one KV head of 256, every
    // sixth layer global, the others a 512-token window; f16): at depth 600 the two steps see
    // 601 and 602 positions in the 3 global layers and 512 in the 15 others, K and V.
    let o = common::infer(
        &[
            "bench", "-m", &m, "-p", "0", "-n", "2", "-r", "1", "-d", "600", "--json",
        ],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let row = 2 * 256 * 2;
    assert_eq!(
        v["kv_bytes_per_token"].as_u64(),
        Some((15 * 512 * row) + (3 * (601 + 602) * row) / 2)
    );
    // errors still speak
    let o = common::infer(&["run", "-q", "-m", "/nonexistent.gguf", "-p", "x"], None);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).starts_with("infer: "), "{}", stderr(&o));
}

/// Logits after `prompt` and then after each of `gen`, through the library as `infer run` uses it.
fn library_logits(prompt: &[u32], gen: &[u32]) -> Vec<Vec<f32>> {
    let g = Arc::new(Gguf::open(&model(GEMMA)).unwrap());
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let backend = CpuBackend::new(2);
    let weights = Weights::load(&g, &cfg, &backend).unwrap();
    let m = Model {
        cfg,
        weights,
        backend,
        block_size: BLOCK_SIZE,
    };
    let mut runner = Runner::new(m, 256).unwrap();
    let mut seq = Sequence::default();
    let mut out = vec![runner.extend(&mut seq, prompt).unwrap()];
    for &id in &gen[..gen.len() - 1] {
        out.push(runner.extend(&mut seq, &[id]).unwrap());
    }
    out
}

/// ln softmax(logits) in f64, computed directly.
fn log_softmax(l: &[f32]) -> Vec<f64> {
    let m = l.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
    let lse = m + l
        .iter()
        .map(|&x| (f64::from(x) - m).exp())
        .sum::<f64>()
        .ln();
    l.iter().map(|&x| f64::from(x) - lse).collect()
}

/// Runs `infer run --json --logprobs n` and checks every token line against the library's logits.
fn check_logprobs(prompt: &[u32], sampling: &[&str], n: usize) -> Vec<u32> {
    let m = gemma();
    let ids: Vec<String> = prompt.iter().map(|i| i.to_string()).collect();
    let ids = ids.join(",");
    let n_str = n.to_string();
    let args = [
        &[
            "run",
            "-m",
            &m,
            "-t",
            "2",
            "--prompt-ids",
            &ids,
            "-n",
            "12",
            "--json",
            "--logprobs",
            &n_str,
        ][..],
        sampling,
    ]
    .concat();
    let out = ok(&args);
    let lines = json_lines(&out);
    let tokens: Vec<&Value> = lines.iter().filter(|v| v.get("id").is_some()).collect();
    assert!(!tokens.is_empty(), "{out}");
    let gen: Vec<u32> = tokens
        .iter()
        .map(|v| v["id"].as_u64().unwrap() as u32)
        .collect();
    let logits = library_logits(prompt, &gen);
    let greedy = sampling == ["--temp", "0"];
    for (step, (v, l)) in tokens.iter().zip(&logits).enumerate() {
        let id = gen[step];
        let lp = v["logprob"].as_f64().unwrap();
        let top = v["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), n, "{v}");
        let want = log_softmax(l);
        // the chosen token's log-probability under softmax(raw logits), whatever the temperature
        assert!(lp <= 0.0, "{v}");
        assert!(
            (lp - want[id as usize]).abs() < 1e-5,
            "step {step}: {lp} vs {}",
            want[id as usize]
        );
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        let mut prev = 0.0f64;
        let mut mass = 0.0f64;
        for (k, t) in top.iter().enumerate() {
            let (tid, tlp) = (
                t["id"].as_u64().unwrap() as usize,
                t["logprob"].as_f64().unwrap(),
            );
            assert_eq!(tid, order[k], "step {step}: rank {k}");
            assert!(tlp <= prev, "descending: {v}");
            assert!((tlp - want[tid]).abs() < 1e-5);
            assert!(t["text"].is_string());
            prev = tlp;
            mass += tlp.exp();
        }
        assert!(mass <= 1.0 + 1e-6, "step {step}: top-{n} mass {mass}");
        if greedy {
            assert_eq!(top[0]["id"].as_u64(), Some(u64::from(id)), "greedy = top-1");
            assert_eq!(top[0]["logprob"].as_f64(), Some(lp));
        }
    }
    gen
}

#[test]
fn logprobs_are_log_softmax_of_the_raw_logits() {
    let _g = lock();
    let g = Gguf::open(&model(GEMMA)).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let prompt = tok
        .encode("The capital of France is", tok.add_bos_default(), true)
        .unwrap();
    let greedy = check_logprobs(&prompt, &["--temp", "0"], 5);
    // same tokens as without --logprobs: the hook does not touch sampling
    let ids: Vec<String> = prompt.iter().map(|i| i.to_string()).collect();
    let m = gemma();
    let ids = ids.join(",");
    let plain = ok(&[
        "run",
        "-m",
        &m,
        "-t",
        "2",
        "--prompt-ids",
        &ids,
        "-n",
        "12",
        "--json",
        "--temp",
        "0",
    ]);
    let plain_ids: Vec<u32> = json_lines(&plain)
        .iter()
        .filter_map(|v| v.get("id").map(|i| i.as_u64().unwrap() as u32))
        .collect();
    assert_eq!(greedy, plain_ids);
    // sampled at another temperature: still the temperature-1 distribution of the raw logits
    check_logprobs(
        &prompt,
        &["--temp", "1.5", "--seed", "7", "--top-k", "0"],
        3,
    );
    // --logprobs without --json is a usage error
    let o = common::infer(&["run", "-m", &m, "-p", "x", "--logprobs", "2"], None);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--json"), "{}", stderr(&o));
}

/// `infer run` of one request: (text, prompt_tokens, generated_tokens, stop) from `--json`.
fn single(prompt: &str, n: usize, extra: &[&str]) -> (String, u64, u64, String) {
    let m = gemma();
    let n = n.to_string();
    let args = [&["run", "-m", &m, "-p", prompt, "-n", &n][..], extra].concat();
    let plain = ok(&args);
    let json = ok(&[&args[..], &["--json"]].concat());
    let done = json_lines(&json).pop().unwrap();
    (
        plain,
        done["prompt_tokens"].as_u64().unwrap(),
        done["generated_tokens"].as_u64().unwrap(),
        done["stop"].as_str().unwrap().to_string(),
    )
}

#[test]
fn batch_file_matches_single_runs() {
    let _g = lock();
    let dir = TempDir::new("batch");
    let requests = [
        (
            r#"{"prompt":"The capital of France is","max_tokens":16}"#,
            "The capital of France is",
            16,
            vec![],
        ),
        (
            r#"{"prompt":"def fibonacci(n):","max_tokens":40,"stop":"elif"}"#,
            "def fibonacci(n):",
            40,
            vec!["--stop", "elif"],
        ),
        (
            r#"{"prompt":"Un café, s'il vous plaît. 日本語","max_tokens":12,"stop":["。","!"]}"#,
            "Un café, s'il vous plaît. 日本語",
            12,
            vec!["--stop", "。", "--stop", "!"],
        ),
        (
            r#"{"prompt":"Once upon a time","max_tokens":20,"temperature":0.9,"seed":42}"#,
            "Once upon a time",
            20,
            vec!["--temp", "0.9", "--seed", "42"],
        ),
        (
            r#"{"prompt":"1, 2, 3,","max_tokens":3}"#,
            "1, 2, 3,",
            3,
            vec![],
        ),
    ];
    let file = dir.0.join("prompts.jsonl");
    let body: Vec<&str> = requests.iter().map(|r| r.0).collect();
    std::fs::write(&file, body.join("\n") + "\n").unwrap();
    let m = gemma();
    let o = common::infer(
        &[
            "run",
            "-m",
            &m,
            "--temp",
            "0",
            "--batch-file",
            file.to_str().unwrap(),
        ],
        None,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let results = json_lines(&stdout(&o));
    assert_eq!(results.len(), requests.len());
    for (i, (r, (_, prompt, n, extra))) in results.iter().zip(&requests).enumerate() {
        let temp0 = ["--temp", "0"];
        let extra = match extra.contains(&"--temp") {
            true => extra.clone(),
            false => [&temp0[..], &extra[..]].concat(),
        };
        let (text, pt, gt, stop) = single(prompt, *n, &extra);
        assert_eq!(r["index"].as_u64(), Some(i as u64));
        assert_eq!(r["text"].as_str(), Some(text.as_str()), "request {i}");
        assert_eq!(r["prompt_tokens"].as_u64(), Some(pt), "request {i}");
        assert_eq!(r["generated_tokens"].as_u64(), Some(gt), "request {i}");
        assert_eq!(r["stop"].as_str(), Some(stop.as_str()), "request {i}");
    }
    assert!(results.iter().any(|r| r["stop"] == "stop_string"));
    // the same batch from stdin, quietly
    let body = std::fs::read_to_string(&file).unwrap();
    let o = common::infer(
        &["run", "-q", "-m", &m, "--temp", "0", "--batch-file", "-"],
        Some(&body),
    );
    assert!(o.status.success());
    assert_eq!(stderr(&o), "");
    assert_eq!(json_lines(&stdout(&o)), results);
    // --chat and --system apply to every request, as to `infer run --chat`
    let chat = ["--temp", "0", "--chat", "--system", "Be brief."];
    let o = common::infer(
        &[&["run", "-q", "-m", &m, "--batch-file", "-"][..], &chat[..]].concat(),
        Some(r#"{"prompt":"Name a color.","max_tokens":12}"#),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let (text, pt, gt, _) = single("Name a color.", 12, &chat);
    let r = &json_lines(&stdout(&o))[0];
    assert_eq!(r["text"].as_str(), Some(text.as_str()));
    assert_eq!(
        (r["prompt_tokens"].as_u64(), r["generated_tokens"].as_u64()),
        (Some(pt), Some(gt))
    );
}

/// `--batch-file --parallel 8` on the real Qwen2.5: eight different prompts at once give, line for
/// line, what `infer run` gives each alone (the row-invariant decode rows and solo-shaped prefill
/// chunks); `--parallel 1` and `--lookup 2` give the same lines.
#[test]
fn qwen_batch_file_parallel_equals_single_runs() {
    let _g = lock();
    let dir = TempDir::new("batch-parallel");
    let prompts = [
        "def quicksort(arr):",
        "The three laws of thermodynamics are",
        "// Rust: a struct for a 2D point with a distance method\n",
        "SELECT customers.name, SUM(orders.total) FROM",
        "Once upon a time, in a small village by the sea,",
        "#!/bin/bash\n# Back up every .conf file in /etc\n",
        "The difference between TCP and UDP is",
        "function debounce(fn, ms) {",
    ];
    let body: Vec<String> = prompts
        .iter()
        .map(|p| serde_json::json!({"prompt": p, "max_tokens": 24}).to_string())
        .collect();
    let file = dir.0.join("prompts.jsonl");
    std::fs::write(&file, body.join("\n")).unwrap();
    let m = model(QWEN).display().to_string();
    let run = |extra: &[&str]| {
        let f = file.to_str().unwrap();
        let args = [
            &["run", "-m", &m, "--temp", "0", "--batch-file", f][..],
            extra,
        ]
        .concat();
        let o = common::infer(&args, None);
        assert!(o.status.success(), "{}", stderr(&o));
        json_lines(&stdout(&o))
    };
    let eight = run(&["--parallel", "8"]);
    assert_eq!(eight.len(), prompts.len());
    for (i, (r, p)) in eight.iter().zip(&prompts).enumerate() {
        let alone = ok(&["run", "-m", &m, "-p", p, "-n", "24", "--temp", "0"]);
        assert_eq!(r["index"].as_u64(), Some(i as u64));
        assert_eq!(r["text"].as_str(), Some(alone.as_str()), "request {i}");
    }
    assert_eq!(run(&["--parallel", "1"]), eight);
    // Prompt-lookup drafts verified as rows of the same batch change nothing.
    assert_eq!(run(&["--lookup", "2"]), eight);
}

#[test]
fn batch_file_reports_bad_lines_and_goes_on() {
    let _g = lock();
    let dir = TempDir::new("batch-bad");
    let file = dir.0.join("prompts.jsonl");
    let lines = [
        r#"{"prompt":"The capital of France is","max_tokens":4}"#, // line 1
        "not json",                                                // line 2
        "",                                                        // line 3: skipped
        r#"{"prompt":"x","max_token":3}"#,                         // line 4: misspelt field
        r#"{"max_tokens":3}"#,                                     // line 5: no prompt
        r#"{"prompt":"Hello","max_tokens":2,"temperature":-1}"#,   // line 6
        r#"{"prompt":"","max_tokens":2}"#,                         // line 7: empty (--no-bos)
        r#"{"prompt":"1, 2, 3,","max_tokens":3}"#,                 // line 8
    ];
    std::fs::write(&file, lines.join("\n")).unwrap();
    let m = gemma();
    let o = common::infer(
        &[
            "run",
            "-m",
            &m,
            "--temp",
            "0",
            "--no-bos",
            "--batch-file",
            file.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(e.contains("infer: 5 of 7 requests failed"), "{e}");
    let r = json_lines(&stdout(&o));
    assert_eq!(r.len(), 7, "one line per request, blank lines skipped");
    for (i, v) in r.iter().enumerate() {
        assert_eq!(v["index"].as_u64(), Some(i as u64));
    }
    let errors: Vec<(u64, &str)> = r
        .iter()
        .filter(|v| v.get("error").is_some())
        .map(|v| (v["line"].as_u64().unwrap(), v["error"].as_str().unwrap()))
        .collect();
    let lines_of: Vec<u64> = errors.iter().map(|e| e.0).collect();
    assert_eq!(lines_of, [2, 4, 5, 6, 7], "{errors:?}");
    assert!(errors[1].1.contains("max_token"), "{errors:?}");
    assert!(errors[2].1.contains("prompt"), "{errors:?}");
    assert!(errors[3].1.contains("temperature"), "{errors:?}");
    assert!(errors[4].1.contains("empty"), "{errors:?}");
    // the good requests around them ran
    assert_eq!(r[0]["generated_tokens"].as_u64(), Some(4));
    assert_eq!(r[6]["generated_tokens"].as_u64(), Some(3));
    // usage errors: a missing file, or a prompt as well
    let o = common::infer(
        &["run", "-m", &m, "--batch-file", "/nonexistent.jsonl"],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).starts_with("infer: --batch-file"),
        "{}",
        stderr(&o)
    );
    let o = common::infer(
        &[
            "run",
            "-m",
            &m,
            "-p",
            "x",
            "--batch-file",
            file.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(2));
}

/// A prompt of several hundred tokens, so that `infer run` draws a prefill bar.
fn long_prompt() -> String {
    "The quick brown fox jumps over the lazy dog. ".repeat(60)
}

#[test]
fn progress_only_on_a_terminal_and_never_quiet() {
    use rexpect::session::spawn_with_options;
    let _g = lock();
    let m = gemma();
    let prompt = long_prompt();
    let args = ["run", "-m", &m, "-p", &prompt, "-n", "4", "--temp", "0"];
    // stderr into a pipe: the two report lines and nothing else
    let o = common::infer(&args, None);
    assert!(o.status.success(), "{}", stderr(&o));
    let e = stderr(&o);
    assert_eq!(e.lines().count(), 2, "{e:?}");
    assert!(!e.contains('\r') && !e.contains('\x1b'), "{e:?}");
    let text = stdout(&o);

    let spawn = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_infer"));
        cmd.args(args).args(extra);
        let opts = rexpect::reader::Options::new()
            .timeout_ms(Some(120_000))
            .strip_ansi_escape_codes(false);
        spawn_with_options(cmd, opts).expect("spawn infer in a pty")
    };
    // on a terminal: the prefill bar, then the same text
    let mut p = spawn(&[]);
    p.exp_string("prefill").unwrap();
    let rest = p.exp_eof().unwrap();
    assert!(rest.contains("tokens"), "{rest:?}");
    assert!(rest.contains(text.trim_end()), "{rest:?}");
    // --quiet on a terminal: only the text (and the newline that keeps the shell prompt apart)
    let mut p = spawn(&["--quiet"]);
    let all = p.exp_eof().unwrap();
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(all.replace("\r\n", "\n"), format!("{text}\n"));
}
