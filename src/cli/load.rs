//! Opening a model for the CLI: map the file, read config and tokenizer, hand weights to the CPU
//! backend, size the KV cache. Errors say which file and what to do.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};

use infer::engine::runner::Runner;
use infer::format::Gguf;
use infer::kernels::cpu::backend::CpuBackend;
use infer::kernels::cpu::pool::physical_cores;
use infer::model::{Model, ModelConfig, Weights};
use infer::tokenizer::Tokenizer;

/// Opens `--model` (a path or a known alias, see `infer models`).
pub fn open_gguf(arg: &Path) -> Result<Arc<Gguf>> {
    let path = &crate::cli::models::resolve(arg)?;
    let g = Gguf::open(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Arc::new(g))
}

pub fn open_tokenizer(g: &Gguf, path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_gguf(g).with_context(|| format!("building the tokenizer of {}", path.display()))
}

pub struct Loaded {
    pub gguf: Arc<Gguf>,
    pub tokenizer: Tokenizer,
    pub runner: Runner<CpuBackend>,
    pub load_secs: f64,
    pub threads: usize,
}

pub fn load(path: &Path, threads: Option<usize>, ctx: Option<usize>) -> Result<Loaded> {
    let t0 = Instant::now();
    let path = &crate::cli::models::resolve(path)?;
    let g = open_gguf(path)?;
    let tokenizer = open_tokenizer(&g, path)?;
    let cfg = ModelConfig::from_gguf(&g).with_context(|| format!("reading {}", path.display()))?;
    let threads = threads.unwrap_or_else(physical_cores).max(1);
    let backend = CpuBackend::new(threads);
    let weights =
        Weights::load(&g, &cfg, &backend).with_context(|| format!("loading {}", path.display()))?;
    let n_ctx = ctx.unwrap_or(4096).min(cfg.n_ctx_train.max(1));
    let model = Model {
        cfg,
        weights,
        backend,
        block_size: infer::engine::runner::BLOCK_SIZE,
    };
    let runner = Runner::new(model, n_ctx)?;
    Ok(Loaded {
        gguf: g,
        tokenizer,
        runner,
        load_secs: t0.elapsed().as_secs_f64(),
        threads,
    })
}
