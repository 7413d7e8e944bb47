//! `infer imatrix`: runs a model over a calibration text (windows of `--ctx` tokens, BOS first as
//! `infer perplexity` does, every position computed) on the CPU with its matmul inputs observed
//! (`infer::eval::observe`), and writes the importance matrix in llama.cpp's legacy imatrix.dat
//! layout (`infer::eval::imatrix`). The perplexity of the text comes along on stderr.

use std::time::Instant;

use anyhow::{Context, Result};

use crate::cli::args::ImatrixArgs;
use crate::cli::perplexity::{read_text, text_tokens};
use crate::cli::{load, models, note, progress, UsageError};
use infer::engine::runner::BLOCK_SIZE;
use infer::eval::observe::Observed;
use infer::eval::perplexity::{first_scored, windows, Evaluator, Options};
use infer::eval::stats::{score_rows, Mean};
use infer::kernels::cpu::backend::CpuBackend;
use infer::kernels::cpu::threads::pool::physical_cores;
use infer::model::{Model, ModelConfig, Weights};

/// Tokens per forward call.
const BATCH: usize = 512;

pub fn imatrix(a: ImatrixArgs) -> Result<()> {
    if a.ctx < 4 {
        return Err(UsageError(format!("--ctx must be at least 4, got {}", a.ctx)).into());
    }
    if a.chunks == Some(0) || a.model.threads == Some(0) {
        return Err(UsageError("--chunks and --threads must be at least 1".into()).into());
    }
    let text = read_text(&a.file)?;
    let t0 = Instant::now();
    let path = models::resolve(&a.model.model)?;
    let g = load::open_gguf(&path)?;
    let tok = load::open_tokenizer(&g, &path)?;
    let cfg = ModelConfig::from_gguf(&g).with_context(|| format!("reading {}", path.display()))?;
    let threads = a.model.threads.unwrap_or_else(physical_cores);
    let backend = Observed::new(CpuBackend::new(threads));
    let weights = progress::with_spinner(format!("loading {}", path.display()), || {
        Weights::load(&g, &cfg, &backend)
    })
    .with_context(|| format!("loading {}", path.display()))?;
    let model = Model {
        cfg,
        weights,
        backend,
        block_size: BLOCK_SIZE,
    };
    note!(
        "infer: loaded {} in {:.2} s ({threads} threads)",
        path.display(),
        t0.elapsed().as_secs_f64()
    );

    let (tokens, bos) = text_tokens(&tok, &text)?;
    let o = Options {
        ctx: a.ctx,
        batch: BATCH,
        chunks: a.chunks,
        bos,
        threads,
    };
    let wins = windows(&tokens, &o);
    if wins.is_empty() {
        anyhow::bail!(
            "the text has {} tokens, fewer than one window of {} (use a longer text or a smaller --ctx)",
            tokens.len(),
            a.ctx
        );
    }
    note!(
        "infer: {} tokens, {} windows of {}",
        tokens.len(),
        wins.len(),
        a.ctx
    );
    let first = first_scored(a.ctx);
    let mut ev = Evaluator::new(&model, a.ctx)?;
    let mut nll = Mean::default();
    let bar = progress::bar_over(wins.len(), "windows");
    let t1 = Instant::now();
    for (i, w) in wins.iter().enumerate() {
        for lo in (0..a.ctx).step_by(BATCH) {
            let hi = (lo + BATCH).min(a.ctx);
            // every position: the last layer then runs every token, as llama.cpp's imatrix does
            let rows = ev.forward(w, lo, hi, |_| true)?;
            let (from, to) = (lo.max(first), hi.min(a.ctx - 1));
            if from < to {
                let scored = &rows[from - lo..to - lo];
                let targets = &w[from + 1..from + 1 + scored.len()];
                for s in score_rows(scored, None, targets, threads) {
                    nll.add(s.nll);
                }
            }
        }
        let ppl = nll.mean().exp();
        match &bar {
            Some(b) => {
                b.set_position(i as u64 + 1);
                b.set_message(format!("PPL {ppl:.4}"));
            }
            None => note!("infer: [{}/{}] PPL {ppl:.4}", i + 1, wins.len()),
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let dataset = a.file.to_string_lossy();
    let m = model.backend.finish(a.ctx, wins.len() as u32, &dataset);
    m.save(&a.out)?;
    note!(
        "infer: {} windows in {:.1} s (PPL {:.4} ± {:.4}); wrote {} entries to {}",
        wins.len(),
        t1.elapsed().as_secs_f64(),
        nll.mean().exp(),
        nll.stderr() * nll.mean().exp(),
        m.entries.len(),
        a.out.display()
    );
    Ok(())
}
