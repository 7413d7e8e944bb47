//! Speculative decoding against plain decoding on the real models: with each drafter (prompt
//! lookup, a separate draft model, the model's own first layers) greedy output (token ids and
//! text) must be identical, with drafts actually accepted, also when the generation stops at a
//! stop string or at max_tokens in the middle of a verified run.
//!
//! Draft models: Gemma's is Gemma requantized to q4_0 by `infer quantize` here (seconds; it
//! disagrees with the target often enough to exercise rejection). Qwen's is Qwen itself:
//! requantizing the 1.5B model takes too long for CI (see the note in the test), and a draft equal
//! to the target still tests the draft's KV bookkeeping and a full-acceptance run.

mod common;

use std::sync::atomic::AtomicBool;

use common::{infer, load_runner, model, stderr, GEMMA, QWEN};
use infer::engine::generate::{generate_with, GenHooks, GenParams};
use infer::engine::runner::{Runner, Sequence};
use infer::engine::sampler::SamplerConfig;
use infer::engine::speculative::{check_vocab, DraftModel, Method, Speculator};
use infer::kernels::cpu::backend::CpuBackend;
use infer::tokenizer::Tokenizer;

/// A code-editing request: the answer repeats most of the prompt, which lookup drafts from.
const PROMPT: &str = "Rename the variable `total` to `sum` in this function and print the whole \
function again.\n\ndef mean(values):\n    total = 0\n    count = 0\n    for v in values:\n        \
total += v\n        count += 1\n    if count == 0:\n        return 0.0\n    return total / count\n\n\
Renamed:\n\ndef mean(values):\n";

fn run(
    runner: &mut Runner<CpuBackend>,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenParams,
    spec: Option<&mut Speculator>,
) -> (Vec<u32>, String) {
    let mut seq = Sequence::default();
    let (mut ids, mut text) = (Vec::new(), String::new());
    let hooks = GenHooks {
        spec,
        ..GenHooks::default()
    };
    generate_with(
        runner,
        &mut seq,
        tok,
        prompt,
        params,
        &AtomicBool::new(false),
        hooks,
        |e| {
            ids.extend(e.id);
            text.push_str(e.text);
            Ok(())
        },
    )
    .unwrap();
    // The sequence holds exactly the prompt and the emitted tokens.
    assert_eq!(seq.tokens.len(), prompt.len() + ids.len());
    drop(seq);
    (ids, text)
}

/// Which drafter a check runs.
#[derive(Clone, Copy)]
enum Drafter<'a> {
    Lookup,
    SelfDraft(usize),
    Model(&'a std::path::Path),
    /// A draft model that drafts ahead on its own thread during each verify.
    ModelAhead(&'a std::path::Path),
}

fn check(file: &str, max_tokens: usize, stop: &[&str], drafter: Drafter<'_>) {
    let (g, mut runner) = load_runner(&model(file), 1024);
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let prompt = tok.encode(PROMPT, true, true).unwrap();
    let params = GenParams {
        max_tokens,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ignore_eos: false,
        constraint: None,
    };
    let plain = run(&mut runner, &tok, &prompt, &params, None);
    let method = match drafter {
        Drafter::Lookup => Method::Lookup(infer::engine::speculative::PromptLookup::new(3)),
        Drafter::SelfDraft(layers) => Method::SelfDraft { layers },
        Drafter::Model(path) | Drafter::ModelAhead(path) => {
            let (dg, draft) = load_runner(path, 1024);
            check_vocab(&tok, &Tokenizer::from_gguf(&dg).unwrap()).unwrap();
            Method::Model(Box::new(DraftModel::new(draft)))
        }
    };
    let name = method.name();
    let mut spec = Speculator::new(method, 8);
    // The draft length must not depend on timings here (the counters are asserted on).
    spec.cost_based = false;
    spec.overlap = matches!(drafter, Drafter::ModelAhead(_));
    let got = run(&mut runner, &tok, &prompt, &params, Some(&mut spec));
    assert_eq!(
        got, plain,
        "{file} {name}: speculative output differs from plain decoding"
    );
    if let (Drafter::ModelAhead(_), Method::Model(m)) = (drafter, &spec.method) {
        assert!(m.ahead_used > 0, "{file}: no draft made ahead was used");
        eprintln!("{file} {name}: {} drafts made ahead used", m.ahead_used);
    }
    let s = spec.stats;
    assert!(s.accepted > 0, "{file} {name}: no draft accepted ({s:?})");
    assert!(s.produced >= plain.0.len().saturating_sub(1));
    eprintln!("{file} {name}: {s:?}");
}

/// `file` requantized to `ty` in a scratch directory.
fn requantize(file: &str, ty: &str) -> std::path::PathBuf {
    let out =
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{file}.{ty}.gguf"));
    let src = model(file);
    let o = infer(
        &[
            "quantize",
            "--in",
            src.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--type",
            ty,
        ],
        None,
    );
    assert!(o.status.success(), "requantizing {file}: {}", stderr(&o));
    out
}

#[test]
fn qwen_greedy_lookup_equals_plain() {
    check(QWEN, 60, &[], Drafter::Lookup);
}

#[test]
fn gemma_greedy_lookup_equals_plain_with_stop_string() {
    check(GEMMA, 48, &[], Drafter::Lookup);
    check(GEMMA, 48, &["count"], Drafter::Lookup);
}

#[test]
fn qwen_greedy_self_draft_equals_plain() {
    check(QWEN, 40, &[], Drafter::SelfDraft(20));
}

#[test]
fn gemma_greedy_self_draft_equals_plain_with_stop_string() {
    check(GEMMA, 40, &["count"], Drafter::SelfDraft(12));
}

#[test]
fn qwen_greedy_draft_model_equals_plain() {
    check(QWEN, 40, &[], Drafter::Model(&model(QWEN)));
}

#[test]
fn gemma_greedy_draft_model_equals_plain_with_stop_string() {
    let draft = requantize(GEMMA, "q4_0");
    check(GEMMA, 48, &[], Drafter::Model(&draft));
    check(GEMMA, 48, &["count"], Drafter::Model(&draft));
    // Drafting ahead during each verify: some drafts made ahead follow a rejected verdict and
    // must be dropped.
    check(GEMMA, 48, &["count"], Drafter::ModelAhead(&draft));
}

#[test]
fn qwen_greedy_draft_model_ahead_equals_plain() {
    // The draft equals the target: every draft is accepted and the draft's own next token is the
    // target's, so drafts made ahead are used at every step.
    check(QWEN, 40, &[], Drafter::ModelAhead(&model(QWEN)));
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    let (q, g) = (model(QWEN), model(GEMMA));
    let args = [
        "run",
        "-m",
        q.to_str().unwrap(),
        "--draft-model",
        g.to_str().unwrap(),
        "-n",
        "4",
        "-p",
        "hello",
    ];
    let o = infer(&args, None);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("infer: ") && err.contains("vocabulary differs"),
        "{err}"
    );
    // Self-drafting with every layer (or more) is a usage error too.
    let o = infer(
        &[
            "run",
            "-m",
            q.to_str().unwrap(),
            "--self-draft",
            "28",
            "-p",
            "hi",
        ],
        None,
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the model has 28 layers"),
        "{}",
        stderr(&o)
    );
}

/// The CLI with each method: the text is plain greedy decoding's, and the `--json` summary carries
/// the method's counters.
#[test]
fn cli_json_reports_speculative_counters() {
    let g = model(GEMMA);
    let base = [
        "run",
        "-m",
        g.to_str().unwrap(),
        "--temp",
        "0",
        "-n",
        "32",
        "-p",
        PROMPT,
    ];
    let text = |o: &std::process::Output| -> String {
        assert!(o.status.success(), "{}", stderr(o));
        String::from_utf8(o.stdout.clone()).unwrap()
    };
    let plain = text(&infer(&base, None));
    let g_str = g.to_str().unwrap().to_string();
    for (name, extra) in [
        ("lookup", vec!["--lookup", "3"]),
        ("self-draft", vec!["--self-draft", "12", "--no-cost-k"]),
        ("draft-model", vec!["--draft-model", g_str.as_str()]),
    ] {
        let args: Vec<&str> = base.iter().copied().chain(extra.iter().copied()).collect();
        assert_eq!(text(&infer(&args, None)), plain, "{name}: text differs");
        let o = infer(&[&args[..], &["--json"]].concat(), None);
        let out = text(&o);
        let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        let s = &last["speculative"];
        assert_eq!(s["method"], name, "{last}");
        let (drafted, accepted) = (
            s["drafted"].as_u64().unwrap(),
            s["accepted"].as_u64().unwrap(),
        );
        let forwards = s["target_forwards"].as_u64().unwrap();
        let generated = last["generated_tokens"].as_u64().unwrap();
        assert!(accepted <= drafted && drafted > 0, "{name}: {s}");
        // Every forward yields one token plus its accepted drafts; the first token comes from
        // the prefill.
        assert!(forwards + accepted >= generated - 1, "{name}: {last}");
        assert!(stderr(&o).contains(&format!("infer: {name} drafted {drafted} tokens")));
    }
}
