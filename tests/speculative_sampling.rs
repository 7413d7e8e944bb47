//! The speculative acceptance rule keeps the target's sampling distribution: chi-square tests over
//! many seeds.
//!
//! 1. The rule alone (`speculative::verify`) on a synthetic logits source: target and draft logits
//!    are fixed pseudo-random functions of the history over a 6-token vocabulary; two tokens are
//!    produced per trial through a 2-token draft, and the joint distribution of the pair is
//!    compared with the exact one computed from the target's own `Sampler::distribution`
//!    (temperature, top-k and the repetition penalty included). Negative control: the same
//!    harness with the verifier told a wrong draft distribution is rejected.
//! 2. The whole engine (`generate_with` with a `Speculator`) on tiny random-weight Qwen2 (f32,
//!    converted from tests/fixtures/convert/hf-tiny): with a separate draft model (the same
//!    checkpoint in q4_0: close to the target, not equal) and with a one-layer self-draft, the
//!    first three generated tokens are distributed as the target's exact joint distribution
//!    (enumerated with plain forwards); the drafts run up to 2 tokens (cost model off), so
//!    rejections after accepted drafts occur (this test found the generation loop dropping the
//!    token decided at such a rejection). With prompt lookup (one-hot drafts) every seed gives plain decoding's tokens.
//!    Negative control: the target sampled at a slightly different temperature fails the same
//!    test, so the test has the power to see a distribution close to, but not, the target's.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use common::{infer, load_runner, root, stderr};
use infer::engine::generate::{generate_with, GenHooks, GenParams};
use infer::engine::runner::{Runner, Sequence};
use infer::engine::sampler::{Sampler, SamplerConfig};
use infer::engine::speculative::verify::{verify, Dist};
use infer::engine::speculative::{DraftModel, Method, Speculator};
use infer::kernels::cpu::backend::CpuBackend;
use infer::tokenizer::Tokenizer;

/// Pearson's statistic of `counts` (over `n` trials) against `expected` probabilities, with the
/// cells expected below 5 pooled into one; returns (statistic, degrees of freedom).
fn chi_square(
    counts: &BTreeMap<Vec<u32>, usize>,
    expected: &BTreeMap<Vec<u32>, f64>,
) -> (f64, usize) {
    let n: usize = counts.values().sum();
    let n = n as f64;
    for k in counts.keys() {
        assert!(
            expected.contains_key(k),
            "outcome {k:?} has probability 0 under the target"
        );
    }
    let (mut stat, mut cells) = (0.0, 0usize);
    let (mut pooled_e, mut pooled_o) = (0.0, 0.0);
    for (k, &p) in expected {
        let e = p * n;
        let o = counts.get(k).copied().unwrap_or(0) as f64;
        if e < 5.0 {
            pooled_e += e;
            pooled_o += o;
        } else {
            stat += (o - e) * (o - e) / e;
            cells += 1;
        }
    }
    if pooled_e > 0.0 {
        stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e.max(1e-9);
        cells += 1;
    }
    (stat, cells.saturating_sub(1))
}

/// Upper 1e-4 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty).
fn critical(df: usize) -> f64 {
    let df = df as f64;
    let z = 3.719; // standard normal upper 1e-4 quantile
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

// ---- 1. the rule on synthetic logits ----

const V: usize = 6;

/// A fixed pseudo-random function of the history: logits in [-2, 2) (`salt` picks the model).
fn logits(history: &[u32], salt: u64) -> Vec<f32> {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ salt;
    for &t in history {
        h = (h ^ u64::from(t)).wrapping_mul(0x100_0000_01b3);
    }
    (0..V)
        .map(|i| {
            let mut z = h.wrapping_add(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z ^= z >> 29;
            z = z.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z ^= z >> 32;
            ((z >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0) as f32
        })
        .collect()
}

fn target(h: &[u32]) -> Vec<f32> {
    logits(h, 1)
}

fn draft(h: &[u32]) -> Vec<f32> {
    logits(h, 2)
}

fn config(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: 0.9,
        top_k: 5,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.3,
        repeat_last_n: 8,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed,
        dry: None,
    }
}

/// One trial: two tokens after `prompt`, through a two-token draft from `draft` (drawn at
/// `draft_temp`) verified with `told_temp` as the draft's temperature (equal for the real rule).
fn trial(prompt: &[u32], seed: u64, draft_temp: f32, told_temp: f32, one_hot: bool) -> Vec<u32> {
    let mut s = Sampler::new(config(seed));
    let mut ds = Sampler::new(SamplerConfig {
        temperature: draft_temp,
        ..config(seed ^ 0xabcd)
    });
    let told = Sampler::new(SamplerConfig {
        temperature: told_temp,
        ..config(0)
    });
    let mut h = prompt.to_vec();
    let (mut drafts, mut q): (Vec<u32>, Vec<Dist>) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let l = draft(&h);
        let x = if one_hot {
            // A deterministic draft: the draft logits' argmax.
            (0..V).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32
        } else {
            ds.draw(&ds.distribution(&l, &h))
        };
        q.push(told.distribution(&l, &h));
        drafts.push(x);
        h.push(x);
    }
    let base = prompt.len();
    let rows: Vec<Vec<f32>> = (0..=2).map(|i| target(&h[..base + i])).collect();
    let v = verify(
        &mut s,
        &h,
        base,
        &rows,
        &drafts,
        (!one_hot).then_some(&q[..]),
    );
    let mut out = drafts[..v.accepted].to_vec();
    if let Some(y) = v.rejected_with {
        out.push(y);
    }
    if out.len() < 2 {
        let mut hh = prompt.to_vec();
        hh.extend(&out);
        out.push(s.sample(&target(&hh), &hh));
    }
    out.truncate(2);
    out
}

fn exact_pairs(prompt: &[u32]) -> BTreeMap<Vec<u32>, f64> {
    let s = Sampler::new(config(0));
    let mut m = BTreeMap::new();
    for (a, pa) in s.distribution(&target(prompt), prompt) {
        let mut h = prompt.to_vec();
        h.push(a);
        for (b, pb) in s.distribution(&target(&h), &h) {
            *m.entry(vec![a, b]).or_insert(0.0) += f64::from(pa) * f64::from(pb);
        }
    }
    m
}

fn rule_statistic(draft_temp: f32, told_temp: f32, one_hot: bool) -> (f64, usize) {
    let prompt = [3u32, 1, 3];
    let mut counts = BTreeMap::new();
    for seed in 0..40_000 {
        *counts
            .entry(trial(&prompt, seed, draft_temp, told_temp, one_hot))
            .or_insert(0) += 1;
    }
    chi_square(&counts, &exact_pairs(&prompt))
}

#[test]
fn rule_keeps_the_target_distribution_on_synthetic_logits() {
    for (what, dt, one_hot) in [("sampled draft", 1.5, false), ("one-hot draft", 1.5, true)] {
        let (stat, df) = rule_statistic(dt, dt, one_hot);
        eprintln!(
            "{what}: chi-square {stat:.1}, {df} df (critical {:.1})",
            critical(df)
        );
        assert!(df >= 15, "{what}: too few cells ({df})");
        assert!(
            stat < critical(df),
            "{what}: chi-square {stat:.1} with {df} df exceeds {:.1}",
            critical(df)
        );
    }
    // Negative control: the verifier is told the draft drew at temperature 0.5 while it drew at
    // 1.5 (a wrong min(1, p/q) and a wrong residual); the test must see it.
    let (stat, df) = rule_statistic(1.5, 0.5, false);
    eprintln!(
        "wrong rule: chi-square {stat:.1}, {df} df (critical {:.1})",
        critical(df)
    );
    assert!(
        stat > 3.0 * critical(df),
        "wrong rule not detected: chi-square {stat:.1} with {df} df (critical {:.1})",
        critical(df)
    );
}

// ---- 2. the engine on tiny models ----

/// Converts a tiny checkpoint to a GGUF of type `ty` in a scratch directory.
fn convert(name: &str, ty: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("spec-sampling-{name}-{ty}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(format!("{name}.{ty}.gguf"));
    let src = root().join("tests/fixtures/convert/hf-tiny").join(name);
    let o = infer(
        &[
            "quantize",
            "--from-hf",
            src.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--type",
            ty,
        ],
        None,
    );
    assert!(
        o.status.success(),
        "{name}: conversion failed: {}",
        stderr(&o)
    );
    out
}

const TOKENS: usize = 3;
const TRIALS: u64 = 6000;
/// Random tiny weights give flat logits: a low temperature makes the distribution uneven enough
/// for the test to have power.
const TEMP: f32 = 0.4;

fn engine_config(seed: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: TEMP,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        repeat_penalty: 1.0,
        repeat_last_n: 0,
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed,
        dry: None,
    }
}

/// The first `TOKENS` generated ids (fewer if an end-of-generation token came first).
fn generate(
    runner: &mut Runner<CpuBackend>,
    tok: &Tokenizer,
    prompt: &[u32],
    seed: u64,
    spec: Option<&mut Speculator>,
) -> Vec<u32> {
    generate_with_config(runner, tok, prompt, engine_config(seed), spec)
}

/// Plain sampling at another temperature (the negative control).
fn generate_at(
    runner: &mut Runner<CpuBackend>,
    tok: &Tokenizer,
    prompt: &[u32],
    seed: u64,
    temperature: f32,
) -> Vec<u32> {
    let cfg = SamplerConfig {
        temperature,
        ..engine_config(seed)
    };
    generate_with_config(runner, tok, prompt, cfg, None)
}

fn generate_with_config(
    runner: &mut Runner<CpuBackend>,
    tok: &Tokenizer,
    prompt: &[u32],
    sampler: SamplerConfig,
    spec: Option<&mut Speculator>,
) -> Vec<u32> {
    let mut seq = Sequence::default();
    let params = GenParams {
        max_tokens: TOKENS,
        sampler,
        stop: Vec::new(),
        ignore_eos: false,
        constraint: None,
    };
    let hooks = GenHooks {
        spec,
        ..GenHooks::default()
    };
    let mut ids = Vec::new();
    let cancel = AtomicBool::new(false);
    generate_with(
        runner,
        &mut seq,
        tok,
        prompt,
        &params,
        &cancel,
        hooks,
        |e| {
            ids.extend(e.id);
            Ok(())
        },
    )
    .unwrap();
    drop(seq);
    ids
}

/// The target's exact distribution of the first `TOKENS` ids, by plain forwards over every
/// prefix the sampler can reach.
fn exact(
    runner: &mut Runner<CpuBackend>,
    tok: &Tokenizer,
    prompt: &[u32],
) -> BTreeMap<Vec<u32>, f64> {
    let s = Sampler::new(engine_config(0));
    let mut out = BTreeMap::new();
    let mut frontier = vec![(Vec::<u32>::new(), 1.0f64)];
    while let Some((ids, p)) = frontier.pop() {
        if ids.len() == TOKENS || ids.last().is_some_and(|&t| tok.is_eog(t)) {
            let mut key = ids;
            if key.last().is_some_and(|&t| tok.is_eog(t)) {
                key.pop(); // the eog token itself is not emitted
            }
            *out.entry(key).or_insert(0.0) += p;
            continue;
        }
        let mut seq = Sequence::default();
        let h = [prompt, &ids].concat();
        seq.tokens = h.clone();
        let logits = runner.compute(&mut seq).unwrap();
        drop(seq);
        for (t, pt) in s.distribution(&logits, &h) {
            frontier.push(([&ids[..], &[t]].concat(), p * f64::from(pt)));
        }
    }
    out
}

#[test]
fn engine_sampling_keeps_the_target_distribution_with_each_drafter() {
    let (g, mut runner) = load_runner(&convert("qwen2", "f32"), 64);
    let tok = Tokenizer::from_gguf(&g).unwrap();
    // The draft: the same checkpoint in 4 bits (close to the target, not equal).
    let (dg, draft_runner) = load_runner(&convert("qwen2", "q4_0"), 64);
    let dtok = Tokenizer::from_gguf(&dg).unwrap();
    infer::engine::speculative::check_vocab(&tok, &dtok).unwrap();
    let prompt = tok.encode("the quick brown fox", false, true).unwrap();
    let want = exact(&mut runner, &tok, &prompt);

    let mut draft_model =
        Speculator::new(Method::Model(Box::new(DraftModel::new(draft_runner))), 4);
    let mut self_draft = Speculator::new(Method::SelfDraft { layers: 1 }, 4);
    // Draft lengths independent of timings (the counters are asserted on).
    draft_model.cost_based = false;
    self_draft.cost_based = false;
    for (name, spec) in [
        ("draft model", &mut draft_model),
        ("self-draft", &mut self_draft),
    ] {
        let mut counts = BTreeMap::new();
        for seed in 0..TRIALS {
            let ids = generate(&mut runner, &tok, &prompt, seed, Some(&mut *spec));
            *counts.entry(ids).or_insert(0) += 1;
        }
        let (stat, df) = chi_square(&counts, &want);
        eprintln!("{name}: chi-square {stat:.1}, {df} df, {:?}", spec.stats);
        assert!(df >= 10, "{name}: too few cells ({df})");
        assert!(
            stat < critical(df),
            "{name}: chi-square {stat:.1} with {df} df exceeds {:.1} ({:?})",
            critical(df),
            spec.stats
        );
        // Drafts were really made, and some rejected: the rule had work to do.
        let s = spec.stats;
        assert!(
            s.drafted > 0 && s.accepted > 0 && s.accepted < s.drafted,
            "{name}: {s:?}"
        );
    }

    // Prompt lookup drafts one-hot, verified by sampling with the target's own sampler and
    // comparing: the RNG is spent exactly as in plain decoding, so every seed gives plain
    // decoding's tokens (a stronger property than equal distributions).
    let rep = tok
        .encode(
            "the quick brown fox the quick brown fox the quick",
            false,
            true,
        )
        .unwrap();
    let mut lookup = Speculator::lookup(2, 4);
    lookup.cost_based = false;
    for seed in 0..500 {
        let plain = generate(&mut runner, &tok, &rep, seed, None);
        let spec = generate(&mut runner, &tok, &rep, seed, Some(&mut lookup));
        assert_eq!(
            spec, plain,
            "seed {seed}: lookup changed the sampled tokens"
        );
    }
    let s = lookup.stats;
    eprintln!("lookup: {s:?}");
    assert!(
        s.drafted > 0 && s.accepted > 0 && s.accepted < s.drafted,
        "lookup: {s:?}"
    );

    // Negative control: the target sampled at temperature 0.55 instead of 0.4 (same top-4 support)
    // is a distribution close to the target's but not equal; the test must tell them apart.
    let mut counts = BTreeMap::new();
    for seed in 0..TRIALS {
        let ids = generate_at(&mut runner, &tok, &prompt, seed, 0.55);
        *counts.entry(ids).or_insert(0) += 1;
    }
    let (stat, df) = chi_square(&counts, &want);
    eprintln!(
        "control: chi-square {stat:.1}, {df} df (critical {:.1})",
        critical(df)
    );
    assert!(
        stat > critical(df),
        "a wrong distribution passed as the target's: chi-square {stat:.1}, {df} df"
    );
}
