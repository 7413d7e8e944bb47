//! `infer bench --concurrency 1,2,4,8,16`: the serving test. At each level, that many requests
//! arrive at once (distinct random prompts of `-p` tokens, `-n` tokens each, greedy, end of text
//! ignored so every request generates all of them) and run through the scheduler on one loaded
//! model; `-r` rounds a level. Reported per level: aggregate generated tokens/s (all tokens over the
//! wall time from the arrival to the last token), time to first token and inter-token latency
//! (p50, p99 over every request of every round), and the decode step cost against one request's.
//! The shared-prefix case: 8 requests whose prompts share a `--shared-prefix`-token prefix; the
//! first runs alone until its first token, then the other seven arrive at once; it reports their
//! times to first token against the first's and the prefix cache's reused/computed counts. Each
//! round uses fresh random tokens, so no round finds another's blocks cached.

use std::io::Write;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use crate::cli::args::BenchArgs;
use crate::cli::load::load_for;
use crate::cli::note;
use infer::engine::generate::GenParams;
use infer::engine::request::{Event, RequestSpec};
use infer::engine::runner::Runner;
use infer::engine::sampler::SamplerConfig;
use infer::engine::scheduler::{Scheduler, SchedulerConfig};
use infer::kernels::device::DeviceBackend;
use infer::model::Backend;
use infer::tokenizer::Tokenizer;

/// Requests of the shared-prefix case.
const SHARED_REQUESTS: usize = 8;
/// Tokens after the shared prefix, different for each request.
const SUFFIX: usize = 16;

/// Deterministic pseudo-random token ids (xorshift).
struct Rng(u64);

impl Rng {
    fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                (self.0 % vocab as u64) as u32
            })
            .collect()
    }
}

/// What one request's events looked like in time.
#[derive(Default, Clone)]
struct Timing {
    arrived: Option<Instant>,
    tokens: Vec<Instant>,
}

impl Timing {
    fn ttft(&self) -> f64 {
        let (a, f) = (self.arrived.unwrap(), self.tokens[0]);
        (f - a).as_secs_f64()
    }
}

fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[i.min(s.len() - 1)]
}

fn median(v: &[f64]) -> f64 {
    percentile(v, 50.0)
}

/// Runs `prompts` through a fresh scheduler; `later` of them arrive once request 0 has its first
/// token. Returns each request's timing and the wall time from the first arrival to the end.
fn run_requests(
    runner: &mut Runner<DeviceBackend>,
    tok: &Tokenizer,
    prompts: &[Vec<u32>],
    n_gen: usize,
    later: bool,
) -> Result<(Vec<Timing>, f64)> {
    let params = GenParams {
        max_tokens: n_gen,
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
        stop: Vec::new(),
        ignore_eos: true,
        constraint: None,
    };
    let spec = |p: &Vec<u32>| RequestSpec {
        prompt: p.clone(),
        params: params.clone(),
        logprobs: None,
        lookup: None,
    };
    let mut sched = Scheduler::new(SchedulerConfig {
        max_running: prompts.len(),
        ..SchedulerConfig::default()
    });
    let mut timing = vec![Timing::default(); prompts.len()];
    let t0 = Instant::now();
    let first = if later { 1 } else { prompts.len() };
    for (i, p) in prompts.iter().enumerate().take(first) {
        sched.submit(i as u64, spec(p))?;
        timing[i].arrived = Some(Instant::now());
    }
    let mut events = Vec::new();
    let mut pending_later = later;
    while !sched.is_idle() {
        sched.step(runner, tok, &mut events)?;
        let now = Instant::now();
        for (id, e) in events.drain(..) {
            match e {
                Event::Token { .. } => timing[id as usize].tokens.push(now),
                Event::Error(m) => anyhow::bail!("request {id} failed: {m}"),
                Event::Tail(_) | Event::Done(_) => {}
            }
        }
        if pending_later && !timing[0].tokens.is_empty() {
            pending_later = false;
            for (i, p) in prompts.iter().enumerate().skip(1) {
                sched.submit(i as u64, spec(p))?;
                timing[i].arrived = Some(Instant::now());
            }
        }
    }
    Ok((timing, t0.elapsed().as_secs_f64()))
}

/// One concurrency level's figures over its rounds.
struct Level {
    concurrency: usize,
    /// Aggregate tokens/s of each round.
    rounds: Vec<f64>,
    ttft: Vec<f64>,
    itl: Vec<f64>,
}

pub fn bench(a: BenchArgs) -> Result<()> {
    let n_prompt = a.n_prompt.unwrap_or(32).max(1);
    let n_gen = a.n_gen.max(1);
    let levels: Vec<usize> = a.concurrency.iter().map(|&c| c as usize).collect();
    let most = levels.iter().copied().max().unwrap_or(1);
    let shared = a.shared_prefix;
    let ctx = n_prompt.max(if shared > 0 { shared + SUFFIX } else { 0 }) + n_gen + 1;
    let n_seq = most.max(if shared > 0 { SHARED_REQUESTS } else { 1 });
    let loaded = load_for(&a.model, Some(ctx), n_seq)?;
    let mut runner = loaded.runner;
    crate::cli::bench::fits(runner.n_ctx(), ctx, "prompt + tokens")?;
    let tok = loaded.tokenizer;
    let vocab = runner.vocab_size();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    // warm-up: two requests, a few tokens
    let warm: Vec<Vec<u32>> = (0..2).map(|_| rng.tokens(n_prompt, vocab)).collect();
    run_requests(&mut runner, &tok, &warm, 4, false)?;

    let progress = !a.json && crate::cli::progress::enabled();
    let mut results = Vec::new();
    for &c in &levels {
        let mut level = Level {
            concurrency: c,
            rounds: Vec::new(),
            ttft: Vec::new(),
            itl: Vec::new(),
        };
        for r in 0..a.reps {
            if progress {
                eprint!("\rinfer: concurrency {c}, round {}/{}   ", r + 1, a.reps);
            }
            let prompts: Vec<Vec<u32>> = (0..c).map(|_| rng.tokens(n_prompt, vocab)).collect();
            let (timing, wall) = run_requests(&mut runner, &tok, &prompts, n_gen, false)?;
            let total: usize = timing.iter().map(|t| t.tokens.len()).sum();
            level.rounds.push(total as f64 / wall);
            for t in &timing {
                level.ttft.push(t.ttft());
                level
                    .itl
                    .extend(t.tokens.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()));
            }
        }
        results.push(level);
    }
    // The shared-prefix case.
    let mut prefix_rounds = Vec::new();
    if shared > 0 {
        for r in 0..a.reps {
            if progress {
                eprint!("\rinfer: shared prefix, round {}/{}   ", r + 1, a.reps);
            }
            let prefix = rng.tokens(shared, vocab);
            let prompts: Vec<Vec<u32>> = (0..SHARED_REQUESTS)
                .map(|_| [prefix.clone(), rng.tokens(SUFFIX, vocab)].concat())
                .collect();
            let before = runner.pool().stats();
            let (timing, _) = run_requests(&mut runner, &tok, &prompts, n_gen, true)?;
            let after = runner.pool().stats();
            let first = timing[0].ttft();
            let rest: Vec<f64> = timing[1..].iter().map(Timing::ttft).collect();
            prefix_rounds.push((
                first,
                rest,
                after.reused_tokens - before.reused_tokens,
                after.computed_tokens - before.computed_tokens,
            ));
        }
    }
    if progress {
        eprintln!();
    }

    let base_itl = results
        .iter()
        .find(|l| l.concurrency == 1)
        .map(|l| median(&l.itl));
    let base_tps = results
        .iter()
        .find(|l| l.concurrency == 1)
        .map(|l| median(&l.rounds));
    let name = a.model.model.display().to_string();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if a.json {
        let rows: Vec<_> = results
            .iter()
            .map(|l| {
                json!({
                    "concurrency": l.concurrency,
                    "aggregate_tps_median": median(&l.rounds),
                    "aggregate_tps_rounds": l.rounds,
                    "speedup_vs_1": base_tps.map(|b| median(&l.rounds) / b),
                    "ttft_p50_s": percentile(&l.ttft, 50.0),
                    "ttft_p99_s": percentile(&l.ttft, 99.0),
                    "itl_p50_s": percentile(&l.itl, 50.0),
                    "itl_p99_s": percentile(&l.itl, 99.0),
                    "step_cost_vs_1": base_itl.map(|b| median(&l.itl) / b),
                })
            })
            .collect();
        let prefix: Vec<_> = prefix_rounds
            .iter()
            .map(|(first, rest, reused, computed)| {
                json!({
                    "first_ttft_s": first,
                    "others_ttft_s": rest,
                    "others_max_over_first": rest.iter().copied().fold(0.0, f64::max) / first,
                    "reused_tokens": reused,
                    "computed_tokens": computed,
                })
            })
            .collect();
        writeln!(
            out,
            "{}",
            json!({
                "model": name,
                "threads": loaded.threads,
                "backend": runner.model.backend.name(),
                "prompt_tokens": n_prompt,
                "gen_tokens": n_gen,
                "rounds": a.reps,
                "levels": rows,
                "shared_prefix": if shared > 0 { json!({"prefix_tokens": shared, "requests": SHARED_REQUESTS, "suffix_tokens": SUFFIX, "rounds": prefix}) } else { json!(null) },
            })
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "{name}, {} threads, {} backend: {} requests' prompts of {n_prompt} tokens, {n_gen} generated each, {} rounds a level\n",
        loaded.threads,
        runner.model.backend.name(),
        levels.iter().map(|c| c.to_string()).collect::<Vec<_>>().join("/"),
        a.reps
    )?;
    writeln!(
        out,
        "| concurrency | aggregate t/s (median) | vs 1 | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | step vs 1 |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|")?;
    let opt = |v: Option<f64>, unit: &str| v.map_or("-".into(), |x| format!("{x:.2}{unit}"));
    for l in &results {
        let tps = median(&l.rounds);
        writeln!(
            out,
            "| {} | {:.2} | {} | {:.2} / {:.2} | {:.1} / {:.1} | {} |",
            l.concurrency,
            tps,
            opt(base_tps.map(|b| tps / b), "x"),
            percentile(&l.ttft, 50.0),
            percentile(&l.ttft, 99.0),
            percentile(&l.itl, 50.0) * 1e3,
            percentile(&l.itl, 99.0) * 1e3,
            opt(base_itl.map(|b| median(&l.itl) / b), "x"),
        )?;
    }
    if !prefix_rounds.is_empty() {
        let firsts: Vec<f64> = prefix_rounds.iter().map(|r| r.0).collect();
        let ratios: Vec<f64> = prefix_rounds
            .iter()
            .map(|(f, rest, ..)| rest.iter().copied().fold(0.0, f64::max) / f)
            .collect();
        let (reused, computed) = prefix_rounds
            .iter()
            .fold((0, 0), |(r, c), p| (r + p.2, c + p.3));
        writeln!(
            out,
            "\nshared prefix ({shared} tokens, {SHARED_REQUESTS} requests, {SUFFIX} own tokens each): \
             request 1's TTFT {:.2} s (median of {}); requests 2-{SHARED_REQUESTS} reach their first \
             token in at most {:.0}% of it (median round); prefix cache: {reused} prompt tokens reused, \
             {computed} computed",
            median(&firsts),
            firsts.len(),
            median(&ratios) * 100.0
        )?;
    }
    if levels.len() > 1 && base_tps.is_none() {
        note!("infer: add 1 to --concurrency for the ratios against one request");
    }
    Ok(())
}
