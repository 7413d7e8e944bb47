//! The scheduler against the single-sequence generation loop (`generate`, whose output is held to
//! llama.cpp's by the parity tests): many requests at once must give each one exactly what it gets
//! alone — under preemption, cancellation of others, chunked prefill beside decoding and prefix
//! reuse — and leave the KV pool whole. The fast cases run on the tiny Qwen2 fixture (2 layers,
//! vocab 512, IQ4_NL weights, f16 KV); the batch-invariance case runs on the real Qwen2.5.

mod common;

use std::sync::atomic::AtomicBool;

use infer::engine::generate::{generate, GenParams, GenStats, StopReason};
use infer::engine::load::{load_cpu, open_tokenizer, LoadOptions};
use infer::engine::request::{Event, LookupSpec, RequestId, RequestSpec};
use infer::engine::runner::{Runner, Sequence};
use infer::engine::sampler::SamplerConfig;
use infer::engine::scheduler::{Scheduler, SchedulerConfig};
use infer::kernels::cpu::backend::CpuBackend;
use infer::tokenizer::Tokenizer;

/// The tiny model with a KV pool of `n_ctx` positions, which one sequence may fill (past the
/// model's 256 training positions: the math does not care, and prompts of several chunks fit).
fn tiny(n_ctx: usize) -> (Tokenizer, Runner<CpuBackend>) {
    let path = common::fixture("quant/iq4_nl/tiny-qwen2-iq4_nl.gguf");
    let (g, runner) = common::load_runner(&path, n_ctx);
    (open_tokenizer(&g, &path).unwrap(), runner)
}

fn greedy(max_tokens: usize) -> GenParams {
    GenParams {
        max_tokens,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        stop: Vec::new(),
        ignore_eos: false,
        constraint: None,
    }
}

fn spec(prompt: Vec<u32>, max_tokens: usize) -> RequestSpec {
    RequestSpec {
        prompt,
        params: greedy(max_tokens),
        logprobs: None,
        lookup: None,
    }
}

/// Pseudo-random prompts of the given lengths, each starting differently.
fn prompts(lens: &[usize], vocab: u32, seed: u32) -> Vec<Vec<u32>> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    lens.iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    // below the special tokens of the tiny vocabulary
                    x % (vocab - 16)
                })
                .collect()
        })
        .collect()
}

/// What one request produced.
#[derive(Debug, Default)]
struct Output {
    ids: Vec<u32>,
    text: String,
    stats: Option<GenStats>,
    error: Option<String>,
}

/// The request alone, through the single-sequence loop on a fresh sequence.
fn alone(runner: &mut Runner<CpuBackend>, tok: &Tokenizer, s: &RequestSpec) -> Output {
    let mut o = Output::default();
    let mut seq = Sequence::default();
    let cancel = AtomicBool::new(false);
    let stats = generate(
        runner,
        &mut seq,
        tok,
        &s.prompt,
        &s.params,
        &cancel,
        |id, text| {
            o.ids.extend(id);
            o.text.push_str(text);
            Ok(())
        },
    )
    .unwrap();
    o.stats = Some(stats);
    o
}

/// Each request alone on a fresh runner: no prefix cache, no other request's blocks.
fn alone_tiny(specs: &[RequestSpec]) -> Vec<Output> {
    specs
        .iter()
        .map(|s| {
            let (tok, mut runner) = tiny(4096);
            alone(&mut runner, &tok, s)
        })
        .collect()
}

/// Drives the scheduler until idle, calling `between(step, scheduler)` before each step.
fn drive(
    runner: &mut Runner<CpuBackend>,
    tok: &Tokenizer,
    sched: &mut Scheduler,
    n: usize,
    mut between: impl FnMut(usize, &mut Scheduler, &[Output]),
) -> Vec<Output> {
    let mut outs: Vec<Output> = (0..n).map(|_| Output::default()).collect();
    let mut events = Vec::new();
    let mut step = 0;
    while !sched.is_idle() {
        between(step, sched, &outs);
        sched.step(runner, tok, &mut events).unwrap();
        for (id, e) in events.drain(..) {
            let o = &mut outs[id as usize];
            assert!(
                o.stats.is_none() && o.error.is_none(),
                "request {id}: an event after its end"
            );
            match e {
                Event::Token { id, text, .. } => {
                    o.ids.push(id);
                    o.text.push_str(&text);
                }
                Event::Tail(t) => o.text.push_str(&t),
                Event::Done(s) => o.stats = Some(s),
                Event::Error(m) => o.error = Some(m),
            }
        }
        step += 1;
        assert!(step < 100_000, "the scheduler does not finish");
    }
    for (i, o) in outs.iter().enumerate() {
        assert!(
            o.stats.is_some() || o.error.is_some(),
            "request {i} never ended"
        );
    }
    outs
}

fn run_all(
    runner: &mut Runner<CpuBackend>,
    tok: &Tokenizer,
    specs: &[RequestSpec],
    cfg: SchedulerConfig,
) -> (Vec<Output>, Scheduler) {
    let mut sched = Scheduler::new(cfg);
    for (i, s) in specs.iter().enumerate() {
        sched.submit(i as RequestId, s.clone()).unwrap();
    }
    let outs = drive(runner, tok, &mut sched, specs.len(), |_, _, _| {});
    (outs, sched)
}

fn same_as_alone(got: &[Output], want: &[Output]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.error, None, "request {i} failed");
        assert_eq!(g.ids, w.ids, "request {i}: tokens differ from its lone run");
        assert_eq!(
            g.text, w.text,
            "request {i}: text differs from its lone run"
        );
        let (gs, ws) = (g.stats.as_ref().unwrap(), w.stats.as_ref().unwrap());
        assert_eq!(gs.stop, ws.stop, "request {i}: stop reason");
        assert_eq!(gs.generated_tokens, ws.generated_tokens);
    }
}

fn whole(runner: &Runner<CpuBackend>) {
    runner.pool().check_whole(true).unwrap();
}

#[test]
fn concurrent_requests_equal_their_lone_runs() {
    let (tok, mut runner) = tiny(4096);
    let lens = [5, 17, 33, 64, 70, 1, 40, 100, 9, 31];
    let specs: Vec<RequestSpec> = prompts(&lens, 512, 1)
        .into_iter()
        .enumerate()
        .map(|(i, p)| spec(p, 12 + 3 * i))
        .collect();
    let want = alone_tiny(&specs);
    assert!(want.iter().all(|o| o.ids.len() >= 2), "lone runs generate");
    let cfg = SchedulerConfig {
        max_running: 4,
        ..SchedulerConfig::default()
    };
    let (got, sched) = run_all(&mut runner, &tok, &specs, cfg);
    same_as_alone(&got, &want);
    assert!(
        sched.stats().decode_rows > sched.stats().steps,
        "rows were batched"
    );
    whole(&runner);
}

#[test]
fn preemption_under_kv_pressure_keeps_outputs() {
    // 8 blocks of 32 positions for 6 requests that grow to 2-3 blocks each.
    let (tok, mut runner) = tiny(256);
    let lens = [20, 30, 45, 25, 50, 35];
    let specs: Vec<RequestSpec> = prompts(&lens, 512, 2)
        .into_iter()
        .map(|p| spec(p, 40))
        .collect();
    let want = alone_tiny(&specs);
    let cfg = SchedulerConfig {
        max_running: 6,
        seq_len: 128,
        ..SchedulerConfig::default()
    };
    let (got, sched) = run_all(&mut runner, &tok, &specs, cfg);
    assert!(
        sched.stats().preemptions > 0,
        "the pool was meant to run out"
    );
    same_as_alone(&got, &want);
    whole(&runner);
}

#[test]
fn cancelling_mid_prefill_and_mid_decode_loses_nothing_of_the_others() {
    let (tok, mut runner) = tiny(4096);
    // request 0 has a prompt of three chunks; 1 and 2 decode beside it
    let ps = prompts(&[1300, 10, 40, 24], 512, 3);
    let specs: Vec<RequestSpec> = ps.into_iter().map(|p| spec(p, 30)).collect();
    let want = alone_tiny(&specs);
    let mut sched = Scheduler::new(SchedulerConfig::default());
    for (i, s) in specs.iter().enumerate() {
        sched.submit(i as RequestId, s.clone()).unwrap();
    }
    let got = drive(
        &mut runner,
        &tok,
        &mut sched,
        specs.len(),
        |step, s, outs| {
            if step == 1 {
                s.cancel(0); // its prompt is one chunk in
            }
            if outs[1].ids.len() == 5 {
                s.cancel(1);
            }
        },
    );
    for i in [0, 1] {
        let st = got[i]
            .stats
            .as_ref()
            .expect("a cancelled request ends with Done");
        assert_eq!(st.stop, StopReason::Interrupted);
    }
    assert!(got[0].ids.is_empty());
    assert_eq!(got[1].ids, want[1].ids[..5], "request 1 until cancelled");
    same_as_alone(&got[2..], &want[2..]);
    whole(&runner);
}

#[test]
fn a_long_prompt_holds_decoding_up_for_one_chunk_at_most() {
    let (tok, mut runner) = tiny(4096);
    let ps = prompts(&[8, 2000], 512, 4);
    let mut sched = Scheduler::new(SchedulerConfig::default());
    sched.submit(0, spec(ps[0].clone(), 40)).unwrap();
    let mut events = Vec::new();
    sched.step(&mut runner, &tok, &mut events).unwrap();
    sched.submit(1, spec(ps[1].clone(), 4)).unwrap();
    // While request 1 reads its 2000-token prompt (four chunks), request 0 gets a token every step.
    for _ in 0..4 {
        events.clear();
        sched.step(&mut runner, &tok, &mut events).unwrap();
        let tokens_of_0 = events
            .iter()
            .filter(|(id, e)| *id == 0 && matches!(e, Event::Token { .. }))
            .count();
        assert_eq!(tokens_of_0, 1, "request 0 decodes every step");
    }
    assert!(sched.stats().prefill_tokens >= 2000);
}

#[test]
fn admission_keeps_at_most_max_running() {
    let (tok, mut runner) = tiny(4096);
    let specs: Vec<RequestSpec> = prompts(&[10, 20, 30, 40, 50], 512, 5)
        .into_iter()
        .map(|p| spec(p, 6))
        .collect();
    let want = alone_tiny(&specs);
    let mut sched = Scheduler::new(SchedulerConfig {
        max_running: 2,
        ..SchedulerConfig::default()
    });
    for (i, s) in specs.iter().enumerate() {
        sched.submit(i as RequestId, s.clone()).unwrap();
    }
    let mut most = 0;
    let got = drive(&mut runner, &tok, &mut sched, specs.len(), |_, s, _| {
        most = most.max(s.n_running());
    });
    assert!(most <= 2);
    same_as_alone(&got, &want);
    whole(&runner);
}

#[test]
fn a_shared_prefix_is_computed_once() {
    let (tok, mut runner) = tiny(8192);
    let prefix = prompts(&[200], 512, 6).remove(0);
    let specs: Vec<RequestSpec> = prompts(&[5, 6, 7, 8], 512, 7)
        .into_iter()
        .map(|s| spec([prefix.clone(), s].concat(), 8))
        .collect();
    let before = runner.pool().stats();
    let (got, _) = run_all(&mut runner, &tok, &specs, SchedulerConfig::default());
    let st: Vec<&GenStats> = got.iter().map(|o| o.stats.as_ref().unwrap()).collect();
    assert_eq!(st[0].reused_tokens, 0);
    for s in &st[1..] {
        // the whole prefix: six full blocks from the cache, the last eight tokens shared with
        // request 0's sequence (its half-full block, copied on the first write)
        assert_eq!(
            s.reused_tokens, 200,
            "later requests reuse the whole prefix"
        );
    }
    let after = runner.pool().stats();
    assert_eq!(after.reused_tokens - before.reused_tokens, 3 * 200);
    assert!(after.copied_blocks > before.copied_blocks);
    // Reused K/V gives the same tokens as computing the prompt afresh.
    let (tok2, mut fresh) = tiny(8192);
    for (s, g) in specs.iter().zip(&got) {
        assert_eq!(alone(&mut fresh, &tok2, s).ids, g.ids);
    }
    whole(&runner);
}

#[test]
fn forks_share_blocks_and_copy_on_write() {
    let (_tok, mut runner) = tiny(1024);
    let p = prompts(&[45], 512, 8).remove(0);
    let mut a = Sequence::new(p.clone());
    runner.compute(&mut a).unwrap();
    let mut b = runner.fork(&a);
    assert_eq!(a.blocks.blocks(), b.blocks.blocks());
    // b diverges inside the shared half-full block: it gets its own copy, a keeps its K/V.
    let lb = runner.extend(&mut b, &[7]).unwrap();
    assert_ne!(a.blocks.blocks()[1], b.blocks.blocks()[1]);
    assert_eq!(a.blocks.blocks()[0], b.blocks.blocks()[0]);
    assert_eq!(runner.pool().stats().copied_blocks, 1);
    let la = runner.extend(&mut a, &[9]).unwrap();
    // each equals a fresh computation of its tokens
    for (seq, l) in [(&a, la), (&b, lb)] {
        let mut fresh = Sequence::new(seq.tokens.clone());
        let (_t, mut r2) = tiny(1024);
        assert_eq!(r2.compute(&mut fresh).unwrap(), l);
    }
    drop((a, b));
    whole(&runner);
}

#[test]
fn a_prompt_longer_than_a_sequence_may_hold_is_an_error_for_that_request_alone() {
    let (tok, mut runner) = tiny(1024);
    let ps = prompts(&[300, 10], 512, 9);
    let specs = vec![spec(ps[0].clone(), 4), spec(ps[1].clone(), 4)];
    let cfg = SchedulerConfig {
        seq_len: 256,
        ..SchedulerConfig::default()
    };
    let (got, _) = run_all(&mut runner, &tok, &specs, cfg);
    assert!(got[0].error.as_deref().unwrap().contains("raise --ctx"));
    assert_eq!(got[1].ids.len(), 4);
    whole(&runner);
}

#[test]
fn qwen_eight_different_prompts_at_once_equal_each_alone() {
    let l = load_cpu(
        &common::model(common::QWEN),
        &LoadOptions {
            threads: Some(2),
            n_ctx: Some(4096),
            ..LoadOptions::default()
        },
    )
    .unwrap();
    let (tok, mut runner) = (l.tokenizer, l.runner);
    let (_, mut solo) = common::load_runner(&common::model(common::QWEN), 4096);
    let texts = [
        "def fibonacci(n):",
        "The capital of France is",
        "// A C function that reverses a string in place\n",
        "SELECT name, COUNT(*) FROM",
        "Once upon a time, in a small village by the sea,",
        "fn main() {\n    let v: Vec<u32> =",
        "The three primary colors are",
        "#!/bin/bash\n# Print every file larger than 1 MB\n",
    ];
    let specs: Vec<RequestSpec> = texts
        .iter()
        .map(|t| spec(tok.encode(t, true, false).unwrap(), 24))
        .collect();
    // Alone, one after another on their own runner (the prompts share no full block).
    let want: Vec<Output> = specs.iter().map(|s| alone(&mut solo, &tok, s)).collect();
    let (got, sched) = run_all(&mut runner, &tok, &specs, SchedulerConfig::default());
    same_as_alone(&got, &want);
    assert!(sched.stats().decode_rows >= 8 * 20);
    whole(&runner);
}

#[test]
fn lookup_drafts_verified_in_the_batch_change_no_output() {
    let (tok, mut runner) = tiny(4096);
    // Prompts that repeat themselves, so the n-gram drafter finds something to propose.
    // Half greedy, half sampled (seeded); no two share a prompt block (see the prefix cache).
    let specs: Vec<RequestSpec> = prompts(&[12, 20, 7, 30, 15, 9, 24, 11], 512, 10)
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let mut s = spec([p.clone(), p.clone(), p].concat(), 40);
            s.lookup = Some(LookupSpec {
                ngram: 3,
                draft_max: 8,
            });
            if i % 2 == 1 {
                s.params.sampler.temperature = 0.9;
                s.params.sampler.seed = 7 + i as u64;
            }
            s
        })
        .collect();
    // The truth: each request alone, plain decoding (no drafts).
    let want = alone_tiny(&specs);
    let (got, sched) = run_all(&mut runner, &tok, &specs, SchedulerConfig::default());
    same_as_alone(&got, &want);
    let st = sched.stats();
    assert!(st.drafted > 0 && st.accepted > 0, "{st:?}");
    assert!(
        st.decode_rows > st.steps,
        "draft rows rode in the decode forwards"
    );
    whole(&runner);
}
