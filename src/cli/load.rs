//! Opening a model for the CLI: `--model` resolved to a file (a path or an alias, see
//! `infer models`), loaded through [`infer::engine::load`] with the command's `--threads`,
//! `--ctx`, `--device`, `--gpu-layers` and `--cache-type-k/v`, and the loader's notes printed
//! on stderr.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;

use crate::cli::args::ModelArgs;
use infer::engine::load::{self as engine_load, LoadOptions};
use infer::format::Gguf;
use infer::kernels::cpu::backend::CpuBackend;
use infer::tokenizer::Tokenizer;

pub use infer::engine::load::Loaded;

/// Opens `--model` (a path or a known alias).
pub fn open_gguf(arg: &Path) -> Result<Arc<Gguf>> {
    engine_load::open_gguf(&crate::cli::models::resolve(arg)?)
}

pub fn open_tokenizer(g: &Gguf, path: &Path) -> Result<Tokenizer> {
    engine_load::open_tokenizer(g, path)
}

/// The loader's options for a command's model flags, `--ctx` and the sequences run at once.
fn options(m: &ModelArgs, ctx: Option<usize>, n_seq: usize) -> LoadOptions {
    LoadOptions {
        threads: m.threads,
        n_ctx: ctx,
        n_seq: Some(n_seq),
        device: m.device.device.map(Into::into),
        gpu_layers: m.device.gpu_layers,
        pack_dir: crate::cli::models::pack_dir(),
        cache_type_k: m.cache_type_k,
        cache_type_v: m.cache_type_v,
    }
}

/// Loads `m.model` on the device the flags choose, with KV for one sequence of `ctx` positions.
pub fn load(m: &ModelArgs, ctx: Option<usize>) -> Result<Loaded> {
    load_for(m, ctx, 1)
}

/// [`load`] with KV for `n_seq` sequences of `ctx` positions each (requests run at once).
pub fn load_for(m: &ModelArgs, ctx: Option<usize>, n_seq: usize) -> Result<Loaded> {
    let opts = options(m, ctx, n_seq);
    let l = engine_load::load(&crate::cli::models::resolve(&m.model)?, &opts)?;
    for n in &l.notes {
        crate::cli::note!("infer: {n}");
    }
    Ok(l)
}

/// Loads `path` on the CPU whatever the flags say (a speculative draft model), with `m`'s threads.
pub fn load_cpu(path: &Path, m: &ModelArgs, ctx: Option<usize>) -> Result<Loaded<CpuBackend>> {
    engine_load::load_cpu(&crate::cli::models::resolve(path)?, &options(m, ctx, 1))
}
