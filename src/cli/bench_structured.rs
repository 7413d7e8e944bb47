//! `infer bench --json-schema SCHEMA`: what structured output costs. In one run, on the same
//! prompt: decode tokens/s without a constraint and with the schema (through the scheduler, as
//! `infer run` and the server decode, masks computed while the forward runs), and the mask time
//! per token, measured by replaying each constrained output through a fresh constraint and timing
//! every mask alone (no forward running beside it).

use std::io::Write;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use crate::cli::args::{BenchArgs, ConstraintArgs};
use crate::cli::bench::median;
use crate::cli::constraint;
use crate::cli::load::load;
use crate::cli::{note, UsageError};
use infer::engine::constraint::Grammars;
use infer::engine::generate::{GenParams, GenStats};
use infer::engine::request::RequestSpec;
use infer::engine::runner::Sequence;
use infer::engine::sampler::SamplerConfig;
use infer::engine::scheduler::run_one;

const PROMPT: &str = "Here is an example JSON document:\n";

pub fn bench(a: BenchArgs, schema: &str) -> Result<()> {
    let flags = ConstraintArgs {
        json_schema: Some(schema.to_string()),
        ..ConstraintArgs::default()
    };
    let (_, spec) = constraint::spec(&flags)?.expect("a schema was given");
    let loaded = load(&a.model, Some(1024))?;
    let (tok, mut runner) = (loaded.tokenizer, loaded.runner);
    let t = Instant::now();
    let grammars = Grammars::new(&tok, runner.vocab_size())?;
    let vocab_secs = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let constraint = grammars
        .compile(&spec)
        .map_err(|e| UsageError(format!("--json-schema: {e}")))?;
    let compile_secs = t.elapsed().as_secs_f64();
    let prompt = tok.encode(PROMPT, tok.add_bos_default(), false)?;
    let cancel = AtomicBool::new(false);
    let mut decode = |constrained: bool| -> Result<(GenStats, Vec<u32>)> {
        let params = GenParams {
            max_tokens: a.n_gen,
            sampler: SamplerConfig {
                temperature: 0.0,
                ..SamplerConfig::default()
            },
            stop: Vec::new(),
            ignore_eos: !constrained,
            constraint: constrained.then(|| Box::new(constraint.clone())),
        };
        let spec = RequestSpec {
            prompt: prompt.clone(),
            params,
            logprobs: None,
            lookup: None,
        };
        let mut ids = Vec::new();
        let stats = run_one(
            &mut runner,
            &tok,
            &mut Sequence::default(),
            spec,
            &cancel,
            &mut |_, _| {},
            |e| {
                if let infer::engine::request::Event::Token { id, .. } = e {
                    ids.push(*id);
                }
                Ok(())
            },
        )?;
        Ok((stats, ids))
    };
    decode(false)?; // warm-up
    let (mut free, mut held, mut mask_us, mut tokens) = (vec![], vec![], vec![], 0);
    for rep in 0..a.reps {
        let (s, _) = decode(false)?;
        free.push(s.gen_tps());
        let (s, ids) = decode(true)?;
        held.push(s.gen_tps());
        tokens = ids.len();
        // The masks of this output, each computed alone.
        let mut c = constraint.clone();
        for &id in &ids {
            c.prepare()?;
            c.commit(id)?;
        }
        let (secs, n) = c.mask_stats();
        mask_us.push(secs.as_secs_f64() * 1e6 / n.max(1) as f64);
        if !a.json && crate::cli::progress::enabled() {
            eprint!("\rinfer: bench repetition {}/{}", rep + 1, a.reps);
        }
    }
    if !a.json && crate::cli::progress::enabled() {
        eprintln!();
    }
    if tokens < 2 {
        note!("infer: the constrained answer is {tokens} tokens long; its speed is not measured");
    }
    let (free, held, mask) = (median(free), median(held), median(mask_us));
    let slower = if free > 0.0 { 1.0 - held / free } else { 0.0 };
    let mut out = std::io::stdout().lock();
    if a.json {
        writeln!(
            out,
            "{}",
            json!({
                "model": a.model.model.display().to_string(),
                "vocab": runner.vocab_size(),
                "reps": a.reps,
                "vocab_trie_secs": vocab_secs,
                "schema_compile_secs": compile_secs,
                "constrained_tokens": tokens,
                "tg_tps_median": free,
                "tg_json_schema_tps_median": held,
                "slowdown": slower,
                "mask_us_per_token_median": mask,
            })
        )?;
        return Ok(());
    }
    writeln!(out, "| model | vocab | test | t/s (median of {}) |", a.reps)?;
    writeln!(out, "|---|---|---|---|")?;
    let name = a.model.model.display();
    let v = runner.vocab_size();
    writeln!(out, "| {name} | {v} | tg{} free | {free:.2} |", a.n_gen)?;
    writeln!(
        out,
        "| {name} | {v} | tg json-schema ({tokens} tokens) | {held:.2} |"
    )?;
    writeln!(
        out,
        "\njson-schema decode: {:.1}% slower; mask {mask:.0} µs a token (median, computed \
         alone); vocabulary trie {:.0} ms, schema compile {:.1} ms",
        slower * 100.0,
        vocab_secs * 1e3,
        compile_secs * 1e3
    )?;
    Ok(())
}
