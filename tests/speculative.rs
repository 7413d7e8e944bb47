//! Prompt-lookup speculative decoding against plain decoding on the real models: greedy output
//! (token ids and text) must be identical, with drafts actually accepted, also when the generation
//! stops at a stop string or at max_tokens in the middle of a verified run.

mod common;

use std::sync::atomic::AtomicBool;

use common::{load_runner, model, GEMMA, QWEN};
use infer::engine::generate::{generate_with, GenHooks, GenParams};
use infer::engine::runner::{Runner, Sequence};
use infer::engine::sampler::SamplerConfig;
use infer::engine::speculative::PromptLookup;
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
    lookup: Option<&mut PromptLookup>,
) -> (Vec<u32>, String) {
    let mut seq = Sequence::default();
    let (mut ids, mut text) = (Vec::new(), String::new());
    let hooks = GenHooks {
        lookup,
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
    runner.release(&mut seq);
    (ids, text)
}

fn check(file: &str, max_tokens: usize, stop: &[&str]) {
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
    };
    let plain = run(&mut runner, &tok, &prompt, &params, None);
    let mut lookup = PromptLookup::new(3, 8);
    let spec = run(&mut runner, &tok, &prompt, &params, Some(&mut lookup));
    assert_eq!(
        spec, plain,
        "{file}: speculative output differs from plain decoding"
    );
    assert!(
        lookup.stats.accepted > 0,
        "{file}: no draft accepted ({:?})",
        lookup.stats
    );
    assert!(lookup.stats.produced >= plain.0.len().saturating_sub(1));
}

#[test]
fn qwen_greedy_lookup_equals_plain() {
    check(QWEN, 60, &[]);
}

#[test]
fn gemma_greedy_lookup_equals_plain_with_stop_string() {
    check(GEMMA, 48, &[]);
    check(GEMMA, 48, &["count"]);
}
