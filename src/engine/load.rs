//! Opening a model: map the GGUF file, read its hyperparameters and tokenizer, choose where it
//! runs ([`Device`], [`LoadOptions`]: a value each caller passes, not process state), hand the
//! weights to that backend and size the KV cache. The CLI, the chat REPL and a server all load
//! through here; they resolve names to paths and print, this module does neither (what a user
//! should be told, such as a fallback to the CPU, comes back in [`Loaded::notes`]).
//!
//! Errors name the file and, where the fix is a setting, the setting (`--device`,
//! `--gpu-layers`, `--ctx`, as the command line spells them).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::engine::runner::{Runner, BLOCK_SIZE};
use crate::format::Gguf;
use crate::kernels::cpu::backend::CpuBackend;
use crate::kernels::cpu::layouts::pack_file::PackFile;
use crate::kernels::cpu::threads::pool::physical_cores;
use crate::kernels::cuda::backend::CudaBackend;
use crate::kernels::cuda::launch::Launch;
use crate::kernels::cuda::{driver, vram};
use crate::kernels::device::DeviceBackend;
use crate::model::backend::{CacheType, KvType};
use crate::model::{Backend, Model, ModelConfig, Weights};
use crate::tokenizer::Tokenizer;

/// Where a model computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// A CUDA GPU when one is usable, else the CPU.
    Auto,
    Cpu,
    /// A CUDA GPU, or an error.
    Cuda,
}

/// KV positions of one sequence when the caller does not say (at most the training context).
pub const DEFAULT_CTX: usize = 4096;

/// How to load a model. `Default` is what `infer run` does without flags.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Compute threads (default: the physical cores).
    pub threads: Option<usize>,
    /// KV positions of one sequence (default 4096, never more than the model was trained for).
    pub n_ctx: Option<usize>,
    /// Sequences that may run at once (default 1): the KV pool holds `n_ctx` positions for each.
    pub n_seq: Option<usize>,
    /// `None`: not asked for, which is [`Device::Auto`] without the note about falling back to
    /// the CPU on machines with no NVIDIA driver at all.
    pub device: Option<Device>,
    /// With CUDA, only the first N layers on the GPU (default: all).
    pub gpu_layers: Option<usize>,
    /// Where the CPU backend keeps its repacked weights between runs (see
    /// `kernels::cpu::layouts::pack_file`); `None`: repack at every load.
    pub pack_dir: Option<PathBuf>,
    /// The KV cache's key and value types (`--cache-type-k`, `--cache-type-v`; default f16 both).
    pub cache_type_k: CacheType,
    pub cache_type_v: CacheType,
}

/// A KV cache type this model or device cannot take (`--cache-type-k`/`--cache-type-v`): the
/// caller's usage error, not a failure of the run.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CacheTypeError(pub String);

/// The cache type of `cfg` with `opts`' key and value types: f16 both leaves the model's own
/// (f16, or f32 for a model computed in f32); a quantized one needs heads of whole 32-value blocks
/// and a model whose cache is f16.
pub fn cache_type(cfg: &ModelConfig, opts: &LoadOptions) -> Result<KvType, CacheTypeError> {
    let (k, v) = (opts.cache_type_k, opts.cache_type_v);
    if !k.is_quantized() && !v.is_quantized() {
        return Ok(cfg.kv_type);
    }
    let flags = format!("--cache-type-k {} --cache-type-v {}", k.name(), v.name());
    if cfg.kv_type != KvType::F16 {
        return Err(CacheTypeError(format!(
            "{flags}: this model computes in {} end to end; its KV cache is not quantized",
            cfg.kv_type.name()
        )));
    }
    let widths = [cfg.head_dim, cfg.kv_dim() / cfg.n_head_kv.max(1)];
    if let Some(w) = widths.iter().find(|w| !w.is_multiple_of(32)) {
        return Err(CacheTypeError(format!(
            "{flags}: the model's attention heads are {w} values wide, not a multiple of the \
             32-value blocks of q8_0 and q4_0"
        )));
    }
    Ok(KvType::of(k, v))
}

/// A loaded model, ready to generate.
pub struct Loaded<B: Backend = DeviceBackend> {
    pub gguf: Arc<Gguf>,
    pub tokenizer: Tokenizer,
    pub runner: Runner<B>,
    pub load_secs: f64,
    pub threads: usize,
    /// What the caller may want to tell a user about where the model runs (one line each).
    pub notes: Vec<String>,
}

/// Maps a GGUF file and checks its structure.
pub fn open_gguf(path: &Path) -> Result<Arc<Gguf>> {
    let g = Gguf::open(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Arc::new(g))
}

/// The tokenizer of a mapped GGUF file (`path` for messages).
pub fn open_tokenizer(g: &Gguf, path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_gguf(g).with_context(|| format!("building the tokenizer of {}", path.display()))
}

/// Loads a model on the device `opts` chooses.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<Loaded> {
    let mut notes = Vec::new();
    let mut l = load_with(path, opts, |g, cfg, cpu, n_ctx| {
        device_backend(g, cfg, cpu, n_ctx, opts, &mut notes)
    })?;
    notes.append(&mut l.notes);
    l.notes = notes;
    Ok(l)
}

/// Loads a model on the CPU whatever `opts.device` says (a speculative draft model).
pub fn load_cpu(path: &Path, opts: &LoadOptions) -> Result<Loaded<CpuBackend>> {
    load_with(path, opts, |_, _, cpu, _| Ok(cpu))
}

fn load_with<B: Backend>(
    path: &Path,
    opts: &LoadOptions,
    make: impl FnOnce(&Gguf, &ModelConfig, CpuBackend, usize) -> Result<B>,
) -> Result<Loaded<B>> {
    let t0 = Instant::now();
    let g = open_gguf(path)?;
    crate::trace::mark("gguf parsed");
    let tokenizer = open_tokenizer(&g, path)?;
    crate::trace::mark("tokenizer built");
    let mut cfg =
        ModelConfig::from_gguf(&g).with_context(|| format!("reading {}", path.display()))?;
    cfg.kv_type = cache_type(&cfg, opts)?;
    let threads = opts.threads.unwrap_or_else(physical_cores).max(1);
    let n_ctx = opts
        .n_ctx
        .unwrap_or(DEFAULT_CTX)
        .min(cfg.n_ctx_train.max(1));
    let n_seq = opts.n_seq.unwrap_or(1).max(1);
    let mut cpu = CpuBackend::new(threads);
    crate::trace::mark("cpu backend (thread pool)");
    let pack = opts
        .pack_dir
        .as_deref()
        .and_then(|dir| PackFile::open(dir, path, &g));
    let deferred = pack.as_ref().map(|pf| cpu.set_pack_file(Arc::clone(pf)));
    crate::trace::mark("pack file opened");
    let arena = cpu.arena();
    let backend = make(&g, &cfg, cpu, n_ctx * n_seq)?;
    crate::trace::mark("backend made");
    let weights =
        Weights::load(&g, &cfg, &backend).with_context(|| format!("loading {}", path.display()))?;
    crate::trace::mark("weights loaded");
    let notes = pack.and_then(|pf| pf.finish()).into_iter().collect();
    if let Some(d) = deferred {
        d.start(arena);
    }
    let model = Model {
        cfg,
        weights,
        backend,
        block_size: BLOCK_SIZE,
    };
    let runner = Runner::shared(model, n_ctx, n_seq)?;
    crate::trace::mark("runner (KV) made");
    Ok(Loaded {
        gguf: g,
        tokenizer,
        runner,
        load_secs: t0.elapsed().as_secs_f64(),
        threads,
        notes,
    })
}

/// The backend `opts` asks for: the CPU, or CUDA for all or the first `gpu_layers` layers after
/// checking that they fit in the GPU's free memory.
fn device_backend(
    g: &Gguf,
    cfg: &ModelConfig,
    cpu: CpuBackend,
    n_ctx: usize,
    opts: &LoadOptions,
    notes: &mut Vec<String>,
) -> Result<DeviceBackend> {
    let device = opts.device;
    if device == Some(Device::Cpu) {
        return Ok(DeviceBackend::cpu_only(cpu));
    }
    let driver = match driver::probe() {
        Ok(d) => d,
        Err(e) if device == Some(Device::Cuda) => {
            bail!("--device cuda: no usable CUDA device: {e:#} (use --device cpu or auto)")
        }
        Err(e) => {
            if device.is_some() || driver::library_present() {
                notes.push(format!("running on the CPU: {e:#}"));
            }
            return Ok(DeviceBackend::cpu_only(cpu));
        }
    };
    let n_layer = cfg.n_layer;
    let want = opts.gpu_layers.unwrap_or(n_layer).min(n_layer);
    // The GPU keeps an f32 model's cache in f16.
    let kv_row = match cfg.kv_type {
        KvType::F32 => KvType::F16,
        t => t,
    }
    .row_bytes(cfg.kv_dim());
    let p = vram::plan(g, n_layer, want, n_ctx, kv_row);
    if let Some((free, _)) = driver.mem_info() {
        if p.total() > free as u64 {
            let fit = vram::layers_that_fit(g, n_layer, n_ctx, kv_row, free as u64);
            bail!(
                "{want} of {n_layer} layers on {} need {} of GPU memory (weights {}, KV cache {} \
                 for context {n_ctx}, {} working space) but {} is free; use --gpu-layers {fit} \
                 (the rest runs on the CPU), a smaller --ctx, or --device cpu",
                driver.describe(),
                vram::gib(p.total()),
                vram::gib(p.weights),
                vram::gib(p.kv),
                vram::gib(vram::MARGIN),
                vram::gib(free as u64)
            );
        }
    }
    notes.push(format!(
        "{} on {} ({})",
        if want == n_layer {
            format!("all {n_layer} layers")
        } else {
            format!("{want} of {n_layer} layers (the rest on the CPU)")
        },
        driver.describe(),
        vram::gib(p.weights + p.kv)
    ));
    let cuda = CudaBackend::new(driver);
    Ok(DeviceBackend::hybrid(cpu, cuda, want, n_layer))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/quant/iq4_nl/tiny-qwen2-f32.gguf")
    }

    /// The options are values: two loads in one process with different devices, threads and
    /// contexts each get what they asked for.
    #[test]
    fn each_load_takes_its_own_options() {
        let cpu = LoadOptions {
            threads: Some(1),
            n_ctx: Some(64),
            n_seq: Some(3),
            device: Some(Device::Cpu),
            gpu_layers: None,
            ..LoadOptions::default()
        };
        let l = load(&tiny(), &cpu).unwrap();
        assert_eq!((l.threads, l.runner.n_ctx()), (1, 64));
        // three sequences' worth of 64 positions in blocks of 32
        assert_eq!(l.runner.pool().n_blocks(), 6);
        assert!(l.notes.is_empty(), "{:?}", l.notes);
        assert_eq!(l.runner.model.backend.name(), "cpu");
        let two = LoadOptions {
            threads: Some(2),
            n_ctx: Some(100_000),
            n_seq: None,
            ..cpu.clone()
        };
        let l = load_cpu(&tiny(), &two).unwrap();
        // The context never exceeds what the model was trained for.
        let train = l.runner.model.cfg.n_ctx_train;
        assert_eq!((l.threads, l.runner.n_ctx()), (2, train.min(100_000)));
        if !driver::library_present() {
            let cuda = LoadOptions {
                device: Some(Device::Cuda),
                ..cpu.clone()
            };
            let e = load(&tiny(), &cuda)
                .err()
                .expect("no CUDA here")
                .to_string();
            assert!(
                e.contains("--device cuda") && e.contains("--device cpu"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = load(Path::new("/nonexistent/x.gguf"), &LoadOptions::default())
            .err()
            .unwrap();
        assert!(format!("{e:#}").contains("/nonexistent/x.gguf"), "{e:#}");
    }
}
