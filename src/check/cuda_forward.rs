//! The whole-model CUDA check: one GGUF loaded twice, on the CPU backend and on the
//! CUDA backend over a given [`Launch`], runs a prompt (every position's logits) and then a few
//! greedy decode steps (tokens chosen by the CPU run, fed to both), and the logits are compared.
//! The two backends quantize activations differently (the CPU follows llama.cpp's CPU kernels:
//! q8_K/q8_0 activations, f32 KV for f32 models; CUDA uses q8_1 and an f16 KV cache), so the
//! difference is measured relative to the largest logit and judged by the caller.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};

use crate::engine::runner::{Runner, Sequence, BLOCK_SIZE};
use crate::format::Gguf;
use crate::kernels::cpu::backend::CpuBackend;
use crate::kernels::cuda::backend::CudaBackend;
use crate::kernels::cuda::launch::{Arg, Launch};
use crate::kernels::device::DeviceBackend;
use crate::model::backend::KvType;
use crate::model::{Backend, Model, ModelConfig, Weights};

#[derive(Clone, Debug)]
pub struct ForwardCheck {
    /// Logit rows compared (prompt positions + decode steps).
    pub rows: usize,
    /// Largest |cpu - cuda| over every logit.
    pub max_diff: f32,
    /// Largest |cpu logit|.
    pub scale: f32,
    /// Rows whose argmax differs.
    pub argmax_differs: usize,
    /// The largest gap, over the rows whose argmax differs, between the CPU's logit of its own
    /// argmax and its logit of the CUDA backend's (0 when none differs): how far from a tie the
    /// CPU saw the two tokens.
    pub worst_flip: f32,
    pub cpu_secs: f64,
    pub cuda_secs: f64,
}

fn runner<B: Backend>(g: &Arc<Gguf>, backend: B, n_ctx: usize) -> Result<Runner<B>> {
    runner_with(g, backend, n_ctx, None)
}

/// [`runner`] with the KV cache in `kv` instead of the model's own type.
fn runner_with<B: Backend>(
    g: &Arc<Gguf>,
    backend: B,
    n_ctx: usize,
    kv: Option<KvType>,
) -> Result<Runner<B>> {
    let mut cfg = ModelConfig::from_gguf(g)?;
    if let Some(kv) = kv {
        cfg.kv_type = kv;
    }
    let weights = Weights::load(g, &cfg, &backend)?;
    let model = Model {
        cfg,
        weights,
        backend,
        block_size: BLOCK_SIZE,
    };
    Runner::new(model, n_ctx)
}

fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best
}

/// Runs `prompt` plus `steps` greedy tokens through `r`; `forced` gives the decode tokens (else
/// the run's own greedy choices). Returns every logit row and the decode tokens.
fn run<B: Backend>(
    r: &mut Runner<B>,
    prompt: &[u32],
    steps: usize,
    forced: Option<&[u32]>,
) -> Result<(Vec<Vec<f32>>, Vec<u32>)> {
    let mut seq = Sequence {
        tokens: prompt.to_vec(),
        ..Sequence::default()
    };
    let mut rows = r.compute_all(&mut seq)?;
    let mut chosen = Vec::new();
    for i in 0..steps {
        let next = match forced {
            Some(f) => f[i],
            None => argmax(rows.last().expect("prompt is not empty")) as u32,
        };
        chosen.push(next);
        rows.push(r.extend(&mut seq, &[next])?);
    }
    Ok((rows, chosen))
}

/// The check on the model at `path` with every layer on the CUDA backend over `l` (prompt token
/// ids must be inside its vocabulary).
pub fn forward(
    l: Arc<dyn Launch>,
    path: &Path,
    prompt: &[u32],
    steps: usize,
) -> Result<ForwardCheck> {
    compare(path, prompt, steps, None, |_| Ok(CudaBackend::new(l)))
}

/// [`forward`] with the KV cache of both backends in `kv` (`--cache-type-k/-v`: a quantized
/// cache, which each backend stores in the same blocks).
pub fn forward_with_cache(
    l: Arc<dyn Launch>,
    path: &Path,
    prompt: &[u32],
    steps: usize,
    kv: KvType,
) -> Result<ForwardCheck> {
    compare(path, prompt, steps, Some(kv), |_| Ok(CudaBackend::new(l)))
}

/// The same with only the first `gpu_layers` layers on CUDA and the rest on the CPU
/// (`--gpu-layers`: the residual stream crosses devices inside the forward pass).
pub fn forward_split(
    l: Arc<dyn Launch>,
    path: &Path,
    prompt: &[u32],
    steps: usize,
    gpu_layers: usize,
) -> Result<ForwardCheck> {
    compare(path, prompt, steps, None, |cfg| {
        let cuda = CudaBackend::new(l);
        Ok(DeviceBackend::hybrid(
            CpuBackend::new(2),
            cuda,
            gpu_layers,
            cfg.n_layer,
        ))
    })
}

/// A greedy choice may differ from the CPU's only where the CPU saw a near tie: its logits of the
/// two tokens within this fraction of its largest |logit| (the backends' numerics differ, see the
/// module docs).
pub const NEAR_TIE: f32 = 0.01;

/// Both backends decoding greedily on their own (each feeding back its own choices).
#[derive(Clone, Debug)]
pub struct GreedyCheck {
    pub steps: usize,
    /// Steps whose tokens agree before the first that differs (`steps` when none does).
    pub agreed: usize,
    /// At the first differing step: the CPU's logit of its token minus its logit of the CUDA
    /// backend's, over its largest |logit| (0 when none differs).
    pub gap: f32,
}

impl GreedyCheck {
    /// Every token agrees, or the first that differs was a near tie for the CPU.
    pub fn pass(&self) -> bool {
        self.agreed == self.steps || self.gap <= NEAR_TIE
    }
}

/// `steps` greedy tokens after `prompt` on the CPU backend and on the CUDA backend over `l`, each
/// from its own choices, compared token by token.
pub fn greedy(
    l: Arc<dyn Launch>,
    path: &Path,
    prompt: &[u32],
    steps: usize,
) -> Result<GreedyCheck> {
    let g = Arc::new(Gguf::open(path).with_context(|| format!("reading {}", path.display()))?);
    let n_ctx = (prompt.len() + steps + 1).next_multiple_of(BLOCK_SIZE);
    let mut cpu = runner(&g, CpuBackend::new(2), n_ctx)?;
    let (rows, want) = run(&mut cpu, prompt, steps, None)?;
    let mut gpu = runner(&g, CudaBackend::new(l), n_ctx)?;
    let (_, got) = run(&mut gpu, prompt, steps, None)?;
    let agreed = want.iter().zip(&got).take_while(|(a, b)| a == b).count();
    let gap = match (want.get(agreed), got.get(agreed)) {
        (Some(&w), Some(&c)) => {
            let row = &rows[prompt.len() - 1 + agreed];
            let scale = row.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
            (row[w as usize] - row[c as usize]) / scale
        }
        _ => 0.0,
    };
    Ok(GreedyCheck { steps, agreed, gap })
}

/// Row invariance on the CUDA backend: a prompt's logits computed as one batch, against the same
/// prompt one token a forward.
#[derive(Clone, Debug)]
pub struct InvarianceCheck {
    /// Rows compared (the prompt's tokens).
    pub rows: usize,
    /// Rows of the batch with `set_row_invariant(true)` that are not bit for bit the one-token
    /// forwards' (what speculative verification relies on: must be 0).
    pub differ_on: usize,
    /// The same without it (the tensor-core GEMM and tiled attention take other sums, so
    /// usually all of them with more than 8 rows).
    pub differ_off: usize,
}

/// [`InvarianceCheck`] for the model at `path` on the CUDA backend over `l`, with the KV cache in
/// `kv` when given (else the model's own type).
pub fn row_invariance(
    l: Arc<dyn Launch>,
    path: &Path,
    prompt: &[u32],
    kv: Option<KvType>,
) -> Result<InvarianceCheck> {
    let g = Arc::new(Gguf::open(path).with_context(|| format!("reading {}", path.display()))?);
    let n_ctx = (3 * prompt.len() + 1).next_multiple_of(BLOCK_SIZE);
    let mut r = runner_with(&g, CudaBackend::new(l), n_ctx, kv)?;
    let mut seq = Sequence::new(prompt[..1].to_vec());
    let mut alone = r.compute_all(&mut seq)?;
    for &t in &prompt[1..] {
        alone.push(r.extend(&mut seq, &[t])?);
    }
    let mut batch = |invariant: bool| -> Result<usize> {
        r.model.backend.set_row_invariant(invariant);
        let rows = r.compute_all(&mut Sequence::new(prompt.to_vec()));
        r.model.backend.set_row_invariant(false);
        let same =
            |a: &Vec<f32>, b: &Vec<f32>| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        Ok(rows?
            .iter()
            .zip(&alone)
            .filter(|(a, b)| !same(a, b))
            .count())
    };
    let differ_on = batch(true)?;
    let differ_off = batch(false)?;
    Ok(InvarianceCheck {
        rows: prompt.len(),
        differ_on,
        differ_off,
    })
}

fn compare<B: Backend>(
    path: &Path,
    prompt: &[u32],
    steps: usize,
    kv: Option<KvType>,
    make: impl FnOnce(&ModelConfig) -> Result<B>,
) -> Result<ForwardCheck> {
    let g = Arc::new(Gguf::open(path).with_context(|| format!("reading {}", path.display()))?);
    let n_ctx = (prompt.len() + steps + 1).next_multiple_of(BLOCK_SIZE);
    let mut cpu = runner_with(&g, CpuBackend::new(2), n_ctx, kv)?;
    let t = Instant::now();
    let (want, tokens) = run(&mut cpu, prompt, steps, None)?;
    let cpu_secs = t.elapsed().as_secs_f64();
    let backend = make(&ModelConfig::from_gguf(&g)?)?;
    let mut gpu = runner_with(&g, backend, n_ctx, kv)?;
    let t = Instant::now();
    let (got, _) = run(&mut gpu, prompt, steps, Some(&tokens))?;
    // Reading the logits back waited for every kernel.
    let cuda_secs = t.elapsed().as_secs_f64();
    let (mut max_diff, mut scale, mut argmax_differs, mut worst_flip) = (0f32, 0f32, 0, 0f32);
    for (a, b) in want.iter().zip(&got) {
        for (x, y) in a.iter().zip(b) {
            let d = if y.is_nan() {
                f32::INFINITY
            } else {
                (x - y).abs()
            };
            max_diff = max_diff.max(d);
            scale = scale.max(x.abs());
        }
        let (ca, ga) = (argmax(a), argmax(b));
        if ca != ga {
            argmax_differs += 1;
            worst_flip = worst_flip.max(a[ca] - a[ga]);
        }
    }
    Ok(ForwardCheck {
        rows: want.len(),
        max_diff,
        scale,
        argmax_differs,
        worst_flip,
        cpu_secs,
        cuda_secs,
    })
}

/// The engine's device sampling on a whole model (every layer on the CUDA backend over `l`).
#[derive(Clone, Debug)]
pub struct SampledCheck {
    /// Tokens from the same backend's logits sampled on the host by `Sampler`.
    pub host: Vec<u32>,
    /// Tokens `generate` produced (after the first, picked on the device).
    pub engine: Vec<u32>,
    /// Launches of the `sample` kernel during `generate`.
    pub device_samples: usize,
    /// Tokens of the same request through the scheduler (`scheduler::run_one`, as `infer run`
    /// and the server's lone requests decode).
    pub scheduler: Vec<u32>,
    /// Launches of the `sample` kernel during that run.
    pub scheduler_device_samples: usize,
    /// The same request's tokens through a scheduler where a second (greedy) request joins it
    /// after half of them: both then decode in the same steps, sampled on the device together.
    pub joined: Vec<u32>,
    /// The second request's tokens in that run.
    pub other: Vec<u32>,
    /// The second request alone, sampled on the host from the same backend's logits.
    pub other_host: Vec<u32>,
    /// Rows the `sample` kernel took in launches of two rows or more during the joined run.
    pub batched_rows: usize,
}

/// `steps` tokens after `prompt` sampled with `cfg` twice on the CUDA backend: by `generate`
/// (which samples on the device where it can) and by a host loop downloading each step's logits
/// into the CPU [`Sampler`](crate::engine::sampler::Sampler), and through the scheduler; all
/// three must be the same tokens.
pub fn sampled(
    l: Arc<dyn Launch>,
    path: &Path,
    prompt: &[u32],
    steps: usize,
    cfg: crate::engine::sampler::SamplerConfig,
) -> Result<SampledCheck> {
    use crate::engine::generate::{generate, GenParams};
    use crate::engine::sampler::Sampler;
    let g = Arc::new(Gguf::open(path).with_context(|| format!("reading {}", path.display()))?);
    let n_ctx = (prompt.len() + steps + 1).next_multiple_of(BLOCK_SIZE);
    let n_layer = ModelConfig::from_gguf(&g)?.n_layer;
    let counting = Arc::new(CountSamples {
        inner: l,
        n: Default::default(),
        batched: Default::default(),
    });
    let l: Arc<dyn Launch> = counting.clone();
    let backend = || {
        DeviceBackend::hybrid(
            CpuBackend::new(2),
            CudaBackend::new(l.clone()),
            n_layer,
            n_layer,
        )
    };

    // `steps` tokens of `prompt` sampled on the host from the backend's downloaded logits.
    let host_tokens = |prompt: &[u32], cfg: &crate::engine::sampler::SamplerConfig, steps| {
        let mut r = runner(&g, backend(), n_ctx)?;
        let mut seq = Sequence::new(prompt.to_vec());
        let mut sampler = Sampler::new(cfg.clone());
        let mut logits = r.compute(&mut seq)?;
        let mut host = Vec::new();
        for _ in 0..steps {
            let id = sampler.sample(&logits, &seq.tokens);
            host.push(id);
            seq.tokens.push(id);
            logits = r.compute(&mut seq)?;
        }
        anyhow::Ok(host)
    };
    let host = host_tokens(prompt, &cfg, steps)?;
    let other_prompt: Vec<u32> = prompt.iter().rev().copied().collect();
    let mut other_params = GenParams {
        max_tokens: steps / 4,
        sampler: cfg.clone(),
        stop: Vec::new(),
        ignore_eos: true,
        constraint: None,
    };
    other_params.sampler.temperature = 0.0;
    let other_host = host_tokens(&other_prompt, &other_params.sampler, steps / 4)?;
    let device_before = counting.n.load(std::sync::atomic::Ordering::Relaxed);

    let mut r = runner(&g, backend(), n_ctx)?;
    let tok = crate::tokenizer::Tokenizer::from_gguf(&g)?;
    let params = GenParams {
        max_tokens: steps,
        sampler: cfg,
        stop: Vec::new(),
        ignore_eos: true,
        constraint: None,
    };
    let mut engine = Vec::new();
    let cancel = std::sync::atomic::AtomicBool::new(false);
    let mut seq = Sequence::default();
    generate(&mut r, &mut seq, &tok, prompt, &params, &cancel, |id, _| {
        engine.extend(id);
        Ok(())
    })?;
    let device_samples = counting.n.load(std::sync::atomic::Ordering::Relaxed) - device_before;

    let mut r = runner(&g, backend(), n_ctx)?;
    let spec = spec_of(prompt, &params);
    let mut scheduler = Vec::new();
    crate::engine::scheduler::run_one(
        &mut r,
        &tok,
        &mut Sequence::default(),
        spec,
        &cancel,
        &mut |_, _| {},
        |e| {
            if let crate::engine::request::Event::Token { id, .. } = e {
                scheduler.push(*id);
            }
            Ok(())
        },
    )?;
    let scheduler_device_samples =
        counting.n.load(std::sync::atomic::Ordering::Relaxed) - device_before - device_samples;

    // The same request decoding alone (on the device) until a greedy one joins it halfway; from
    // then on both decode in the same steps, their rows sampled on the device in one launch.
    let batched_before = counting.batched.load(std::sync::atomic::Ordering::Relaxed);
    let model = runner(&g, backend(), n_ctx)?.model;
    let mut r = Runner::shared(model, n_ctx, 2)?;
    let mut sched =
        crate::engine::scheduler::Scheduler::new(crate::engine::scheduler::SchedulerConfig {
            max_running: 2,
            ..Default::default()
        });
    sched.submit(0, spec_of(prompt, &params))?;
    let mut joined = Vec::new();
    let mut other = Vec::new();
    let mut events = Vec::new();
    let mut done = 0;
    let mut submitted = false;
    while done < 2 {
        if !submitted && joined.len() >= steps / 2 {
            sched.submit(1, spec_of(&other_prompt, &other_params))?;
            submitted = true;
        }
        sched.step(&mut r, &tok, &mut events)?;
        for (id, e) in events.drain(..) {
            match e {
                crate::engine::request::Event::Token { id: t, .. } if id == 0 => joined.push(t),
                crate::engine::request::Event::Token { id: t, .. } => other.push(t),
                crate::engine::request::Event::Done(_) => done += 1,
                crate::engine::request::Event::Error(m) => anyhow::bail!("{m}"),
                _ => {}
            }
        }
        if !submitted && done == 1 {
            anyhow::bail!("the first request ended before the second joined");
        }
    }
    let batched_rows = counting.batched.load(std::sync::atomic::Ordering::Relaxed) - batched_before;
    Ok(SampledCheck {
        joined,
        other,
        other_host,
        batched_rows,
        host,
        engine,
        device_samples,
        scheduler,
        scheduler_device_samples,
    })
}

/// Greedy decoding on the CUDA backend with prompt-lookup drafts verified in the scheduler's
/// batches (row-invariant numerics), against the same request without drafts.
#[derive(Clone, Debug)]
pub struct SpeculativeCheck {
    pub plain: Vec<u32>,
    pub lookup: Vec<u32>,
    /// Draft tokens proposed and accepted in the lookup run.
    pub drafted: u64,
    pub accepted: u64,
}

/// [`SpeculativeCheck`] of `steps` tokens after `prompt` (which should repeat itself, so that the
/// n-gram drafter finds something), with drafts of up to `draft_max` tokens.
pub fn speculative(
    l: Arc<dyn Launch>,
    path: &Path,
    prompt: &[u32],
    steps: usize,
    draft_max: usize,
) -> Result<SpeculativeCheck> {
    use crate::engine::request::{Event, LookupSpec};
    use crate::engine::scheduler::{Scheduler, SchedulerConfig};
    let g = Arc::new(Gguf::open(path).with_context(|| format!("reading {}", path.display()))?);
    let n_ctx = (prompt.len() + steps + draft_max + 2).next_multiple_of(BLOCK_SIZE);
    let n_layer = ModelConfig::from_gguf(&g)?.n_layer;
    let tok = crate::tokenizer::Tokenizer::from_gguf(&g)?;
    let params = crate::engine::generate::GenParams {
        max_tokens: steps,
        sampler: crate::engine::sampler::SamplerConfig {
            temperature: 0.0,
            ..Default::default()
        },
        stop: Vec::new(),
        ignore_eos: true,
        constraint: None,
    };
    let run = |lookup: Option<LookupSpec>| -> Result<(Vec<u32>, u64, u64)> {
        let cuda = CudaBackend::new(l.clone());
        let backend = DeviceBackend::hybrid(CpuBackend::new(2), cuda, n_layer, n_layer);
        let mut r = runner(&g, backend, n_ctx)?;
        let mut sched = Scheduler::new(SchedulerConfig::default());
        let mut spec = spec_of(prompt, &params);
        spec.lookup = lookup;
        sched.submit(0, spec)?;
        let (mut tokens, mut events) = (Vec::new(), Vec::new());
        'run: loop {
            sched.step(&mut r, &tok, &mut events)?;
            for (_, e) in events.drain(..) {
                match e {
                    Event::Token { id, .. } => tokens.push(id),
                    Event::Done(_) => break 'run,
                    Event::Error(m) => anyhow::bail!("{m}"),
                    _ => {}
                }
            }
        }
        let st = sched.stats();
        Ok((tokens, st.drafted, st.accepted))
    };
    let (plain, _, _) = run(None)?;
    let (lookup, drafted, accepted) = run(Some(LookupSpec {
        ngram: 3,
        draft_max,
    }))?;
    Ok(SpeculativeCheck {
        plain,
        lookup,
        drafted,
        accepted,
    })
}

fn spec_of(
    prompt: &[u32],
    params: &crate::engine::generate::GenParams,
) -> crate::engine::request::RequestSpec {
    crate::engine::request::RequestSpec {
        prompt: prompt.to_vec(),
        params: params.clone(),
        logprobs: None,
        lookup: None,
    }
}

/// A [`Launch`] that counts launches of the `sample` kernel, and the rows of those that sample
/// several rows at once.
struct CountSamples {
    inner: Arc<dyn Launch>,
    n: std::sync::atomic::AtomicUsize,
    batched: std::sync::atomic::AtomicUsize,
}

impl Launch for CountSamples {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn alloc(&self, bytes: usize) -> Result<u64> {
        self.inner.alloc(bytes)
    }
    fn free(&self, ptr: u64) {
        self.inner.free(ptr)
    }
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.inner.upload(dst, src)
    }
    fn download(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.inner.download(src, dst)
    }
    fn launch(&self, name: &str, grid: [u32; 3], block: [u32; 3], args: &[Arg]) -> Result<()> {
        if name == "sample" {
            self.n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if grid[0] >= 2 {
                let rows = grid[0] as usize;
                self.batched
                    .fetch_add(rows, std::sync::atomic::Ordering::Relaxed);
            }
        }
        self.inner.launch(name, grid, block, args)
    }
    fn sync(&self) -> Result<()> {
        self.inner.sync()
    }
}
