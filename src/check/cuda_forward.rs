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
use crate::kernels::cuda::launch::Launch;
use crate::kernels::device::DeviceBackend;
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
    let cfg = ModelConfig::from_gguf(g)?;
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
    compare(path, prompt, steps, |_| Ok(CudaBackend::new(l)))
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
    compare(path, prompt, steps, |cfg| {
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

fn compare<B: Backend>(
    path: &Path,
    prompt: &[u32],
    steps: usize,
    make: impl FnOnce(&ModelConfig) -> Result<B>,
) -> Result<ForwardCheck> {
    let g = Arc::new(Gguf::open(path).with_context(|| format!("reading {}", path.display()))?);
    let n_ctx = (prompt.len() + steps + 1).next_multiple_of(BLOCK_SIZE);
    let mut cpu = runner(&g, CpuBackend::new(2), n_ctx)?;
    let t = Instant::now();
    let (want, tokens) = run(&mut cpu, prompt, steps, None)?;
    let cpu_secs = t.elapsed().as_secs_f64();
    let backend = make(&ModelConfig::from_gguf(&g)?)?;
    let mut gpu = runner(&g, backend, n_ctx)?;
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
