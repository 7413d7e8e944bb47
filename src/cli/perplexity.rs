//! `infer perplexity`: perplexity of a model on a text file by llama.cpp's method (see
//! `infer::eval::perplexity`), with `--kl-divergence BASE` the KL divergence and top-1 agreement
//! against a base model run on the same windows (the base with an f16 KV cache whatever
//! `--cache-type-k/v` say, so a model against itself measures a quantized cache). The running estimate goes to stderr (a bar on a
//! terminal, one line per window otherwise); the final figures go to stdout, as text or `--json`.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::cli::args::{ModelArgs, PerplexityArgs};
use crate::cli::load::{load, Loaded};
use crate::cli::{note, progress, UsageError};
use infer::engine::runner::Runner;
use infer::eval::perplexity::{evaluate, first_scored, Options, Progress, Report};
use infer::eval::streaming::{sliding, streaming};
use infer::model::backend::CacheType;
use infer::tokenizer::Tokenizer;

/// Reads a UTF-8 text file (usage error when missing).
pub fn read_text(path: &Path) -> Result<String> {
    if !path.is_file() {
        return Err(UsageError(format!("--file {} does not exist", path.display())).into());
    }
    std::fs::read_to_string(path).with_context(|| format!("reading {} as UTF-8", path.display()))
}

/// The text's tokens as llama.cpp's tools take them (BOS when the model adds it, special-token
/// text left as text) and the BOS that starts each window.
pub fn text_tokens(tok: &Tokenizer, text: &str) -> Result<(Vec<u32>, Option<u32>)> {
    let add_bos = tok.add_bos_default();
    let bos = match (add_bos, tok.bos_id()) {
        (true, Some(b)) => Some(b),
        (true, None) => bail!("the model asks for BOS but names no BOS token"),
        (false, _) => None,
    };
    Ok((tok.encode(text, add_bos, false)?, bos))
}

fn load_quiet(m: &ModelArgs, ctx: usize) -> Result<Loaded> {
    let path = &m.model;
    let l = progress::with_spinner(format!("loading {}", path.display()), || load(m, Some(ctx)))?;
    note!(
        "infer: loaded {} in {:.2} s ({} threads)",
        path.display(),
        l.load_secs,
        l.threads
    );
    Ok(l)
}

pub fn perplexity(a: PerplexityArgs) -> Result<()> {
    if a.ctx < 4 {
        return Err(UsageError(format!("--ctx must be at least 4, got {}", a.ctx)).into());
    }
    if a.batch == 0 || a.chunks == Some(0) || a.model.threads == Some(0) {
        return Err(UsageError("--batch, --chunks and --threads must be at least 1".into()).into());
    }
    let text = read_text(&a.file)?;
    let loaded = load_quiet(&a.model, a.ctx)?;
    let (tokens, bos) = text_tokens(&loaded.tokenizer, &text)?;
    let train = loaded.runner.model.cfg.n_ctx_train;
    if a.ctx > train {
        note!(
            "infer: warning: --ctx {} is beyond the model's training context {train}",
            a.ctx
        );
    }
    if a.context_shift || a.sliding.is_some() {
        return moving_window(&a, loaded, &tokens, bos);
    }
    let base = match &a.kl_divergence {
        Some(p) => {
            // The base keeps the default f16 KV cache: `--kl-divergence` of a model against
            // itself then measures what `--cache-type-k/v` cost.
            let base = ModelArgs {
                model: p.clone(),
                cache_type_k: CacheType::F16,
                cache_type_v: CacheType::F16,
                ..a.model.clone()
            };
            Some(load_quiet(&base, a.ctx)?)
        }
        None => None,
    };
    let threads = loaded.threads;
    let Runner { model, .. } = loaded.runner;
    let base_model = base.map(|b| {
        let Runner { model, .. } = b.runner;
        model
    });
    let o = Options {
        ctx: a.ctx,
        batch: a.batch,
        chunks: a.chunks,
        bos,
        threads,
    };
    let n_windows = (tokens.len() / a.ctx).min(a.chunks.unwrap_or(usize::MAX));
    note!(
        "infer: {} tokens, {n_windows} windows of {}, scoring {} tokens each",
        tokens.len(),
        a.ctx,
        a.ctx - first_scored(a.ctx) - 1
    );
    let bar = progress::bar_over(n_windows, "windows");
    let t0 = Instant::now();
    let mut on_window = |p: &Progress| {
        let kl = p.kl.map(|k| format!(", KL {k:.5}")).unwrap_or_default();
        match &bar {
            Some(b) => {
                b.set_position(p.window as u64);
                b.set_message(format!("PPL {:.4} ± {:.4}{kl}", p.ppl, p.ppl_err));
            }
            None => note!(
                "infer: [{}/{}] PPL {:.4} ± {:.4}{kl}",
                p.window,
                p.windows,
                p.ppl,
                p.ppl_err
            ),
        }
    };
    let r = evaluate(&model, base_model.as_ref(), &tokens, &o, &mut on_window)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    note!(
        "infer: {} windows in {:.1} s",
        r.windows,
        t0.elapsed().as_secs_f64()
    );
    if a.json {
        println!("{}", json(&r));
    } else {
        print!("{}", text_report(&r));
    }
    Ok(())
}

fn json(r: &Report) -> serde_json::Value {
    let mut v = serde_json::json!({
        "ppl": r.ppl,
        "ppl_err": r.ppl_err,
        "nll": r.nll,
        "windows": r.windows,
        "ctx": r.ctx,
        "tokens_scored": r.scored,
    });
    if let Some(k) = &r.kl {
        v["kl"] = serde_json::json!({
            "mean": k.mean,
            "err": k.err,
            "median": k.median,
            "p99": k.p99,
            "max": k.max,
            "top1": k.top1,
            "top1_err": k.top1_err,
            "base_ppl": k.base_ppl,
            "base_ppl_err": k.base_ppl_err,
            "ln_ppl_ratio": k.ln_ratio,
            "ln_ppl_ratio_err": k.ln_ratio_err,
        });
    }
    v
}

fn text_report(r: &Report) -> String {
    let mut s = format!(
        "PPL = {:.4} +/- {:.5}  ({} windows of {} tokens, {} tokens scored, mean NLL {:.6})\n",
        r.ppl, r.ppl_err, r.windows, r.ctx, r.scored, r.nll
    );
    if let Some(k) = &r.kl {
        s += &format!(
            "base PPL = {:.4} +/- {:.5}\nln(PPL / base PPL) = {:.5} +/- {:.5}  (paired; PPL / base PPL = {:.4})\nmean KL(base || model) = {:.6} +/- {:.6}  (median {:.6}, 99th percentile {:.6}, max {:.6})\nsame top-1 token = {:.3} +/- {:.3} %\n",
            k.base_ppl, k.base_ppl_err, k.ln_ratio, k.ln_ratio_err, k.ln_ratio.exp(), k.mean, k.err, k.median, k.p99, k.max, 100.0 * k.top1, 100.0 * k.top1_err
        );
    }
    s
}

/// `--context-shift` / `--sliding STRIDE`: perplexity of the whole text through a moving window
/// of `--ctx` tokens (see `infer::eval::streaming`).
fn moving_window(
    a: &PerplexityArgs,
    loaded: Loaded,
    tokens: &[u32],
    bos: Option<u32>,
) -> Result<()> {
    let mut runner = loaded.runner;
    if tokens.len() <= a.ctx {
        return Err(UsageError(format!(
            "the text has {} tokens: a moving window needs more than --ctx {}",
            tokens.len(),
            a.ctx
        ))
        .into());
    }
    let bar = progress::bar_over(tokens.len(), "tokens");
    let mut on_progress = |done: usize, _: usize| {
        if let Some(b) = &bar {
            b.set_position(done as u64);
        }
    };
    let t0 = Instant::now();
    let (mode, r) = if a.context_shift {
        let keep = a.keep + usize::from(bos.is_some() && a.keep > 0);
        let need = (keep.div_ceil(32) + 2) * 32;
        if a.ctx < need {
            return Err(
                UsageError(format!("--context-shift needs --ctx of at least {need}")).into(),
            );
        }
        let r = streaming(&mut runner, tokens, keep, 32, &mut on_progress)?;
        (format!("context shift, {keep} tokens kept"), r)
    } else {
        let stride = a.sliding.expect("checked by the caller");
        if stride == 0 || stride >= a.ctx {
            return Err(UsageError(format!(
                "--sliding must be between 1 and --ctx - 1, got {stride}"
            ))
            .into());
        }
        let r = sliding(&mut runner, tokens, stride, bos, &mut on_progress)?;
        (
            format!("sliding window recomputed every {stride} tokens"),
            r,
        )
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    note!(
        "infer: {} tokens in {:.1} s",
        tokens.len(),
        t0.elapsed().as_secs_f64()
    );
    let ppl_err = r.ppl * r.nll_err;
    if a.json {
        let v = serde_json::json!({
            "ppl": r.ppl,
            "ppl_err": ppl_err,
            "nll": r.nll,
            "ctx": a.ctx,
            "tokens_scored": r.tokens,
            "mode": mode,
        });
        println!("{v}");
    } else {
        println!(
            "PPL = {:.4} +/- {:.5}  ({mode}, window {}, {} tokens scored, mean NLL {:.6})",
            r.ppl, ppl_err, a.ctx, r.tokens, r.nll
        );
    }
    Ok(())
}
