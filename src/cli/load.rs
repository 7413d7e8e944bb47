//! Opening a model for the CLI: map the file, read config and tokenizer, pick the device
//! (`--device`, `--gpu-layers`: see [`backend`]), hand weights to it, size the KV cache. Errors say
//! which file and what to do.

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use anyhow::{bail, Context, Result};

use infer::engine::runner::Runner;
use infer::format::Gguf;
use infer::kernels::cpu::backend::CpuBackend;
use infer::kernels::cpu::threads::pool::physical_cores;
use infer::kernels::cuda::backend::CudaBackend;
use infer::kernels::cuda::device::DeviceBackend;
use infer::kernels::cuda::launch::Launch;
use infer::kernels::cuda::{driver, vram};
use infer::model::{Backend, Model, ModelConfig, Weights};
use infer::tokenizer::Tokenizer;

use crate::cli::args::Device;

/// Opens `--model` (a path or a known alias, see `infer models`).
pub fn open_gguf(arg: &Path) -> Result<Arc<Gguf>> {
    let path = &crate::cli::models::resolve(arg)?;
    let g = Gguf::open(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Arc::new(g))
}

pub fn open_tokenizer(g: &Gguf, path: &Path) -> Result<Tokenizer> {
    Tokenizer::from_gguf(g).with_context(|| format!("building the tokenizer of {}", path.display()))
}

pub struct Loaded<B: Backend = DeviceBackend> {
    pub gguf: Arc<Gguf>,
    pub tokenizer: Tokenizer,
    pub runner: Runner<B>,
    pub load_secs: f64,
    pub threads: usize,
}

/// Loads a model on the device the flags choose (see [`set_device`]).
pub fn load(path: &Path, threads: Option<usize>, ctx: Option<usize>) -> Result<Loaded> {
    load_with(path, threads, ctx, backend)
}

/// Loads a model on the CPU whatever the flags say (a speculative draft model).
pub fn load_cpu(
    path: &Path,
    threads: Option<usize>,
    ctx: Option<usize>,
) -> Result<Loaded<CpuBackend>> {
    load_with(path, threads, ctx, |_, _, cpu, _| Ok(cpu))
}

fn load_with<B: Backend>(
    path: &Path,
    threads: Option<usize>,
    ctx: Option<usize>,
    make: impl FnOnce(&Gguf, &ModelConfig, CpuBackend, usize) -> Result<B>,
) -> Result<Loaded<B>> {
    let t0 = Instant::now();
    let path = &crate::cli::models::resolve(path)?;
    let g = open_gguf(path)?;
    let tokenizer = open_tokenizer(&g, path)?;
    let cfg = ModelConfig::from_gguf(&g).with_context(|| format!("reading {}", path.display()))?;
    let threads = threads.unwrap_or_else(physical_cores).max(1);
    let n_ctx = ctx.unwrap_or(4096).min(cfg.n_ctx_train.max(1));
    let backend = make(&g, &cfg, CpuBackend::new(threads), n_ctx)?;
    let weights =
        Weights::load(&g, &cfg, &backend).with_context(|| format!("loading {}", path.display()))?;
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

/// `--device` (None: not given, which is `auto` without the fallback note on machines with no
/// NVIDIA driver at all) and `--gpu-layers`.
static DEVICE: OnceLock<(Option<Device>, Option<usize>)> = OnceLock::new();

/// Records the device flags (once, before any load).
pub fn set_device(device: Option<Device>, gpu_layers: Option<usize>) {
    let _ = DEVICE.set((device, gpu_layers));
}

/// The backend the flags ask for: the CPU, or CUDA for all or the first `--gpu-layers` layers
/// after checking that they fit in the GPU's free memory.
fn backend(g: &Gguf, cfg: &ModelConfig, cpu: CpuBackend, n_ctx: usize) -> Result<DeviceBackend> {
    let (device, gpu_layers) = DEVICE.get().copied().unwrap_or((None, None));
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
                crate::cli::note!("infer: running on the CPU: {e:#}");
            }
            return Ok(DeviceBackend::cpu_only(cpu));
        }
    };
    let n_layer = cfg.n_layer;
    let want = gpu_layers.unwrap_or(n_layer).min(n_layer);
    let p = vram::plan(g, n_layer, want, n_ctx, cfg.kv_dim());
    if let Some((free, _)) = driver.mem_info() {
        if p.total() > free as u64 {
            let fit = vram::layers_that_fit(g, n_layer, n_ctx, cfg.kv_dim(), free as u64);
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
    crate::cli::note!(
        "infer: {} on {} ({})",
        if want == n_layer {
            format!("all {n_layer} layers")
        } else {
            format!("{want} of {n_layer} layers (the rest on the CPU)")
        },
        driver.describe(),
        vram::gib(p.weights + p.kv)
    );
    let cuda = CudaBackend::new(driver);
    Ok(DeviceBackend::hybrid(cpu, cuda, want, n_layer))
}
