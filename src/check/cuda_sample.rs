//! The device sampler (`cuda/sample.cu`) against the CPU [`Sampler`]: for each configuration
//! (greedy, temperature alone, top-k, top-p, min-p, the three penalties, the default chain) and
//! each kind of logits row (spread, full of ties, one peak, NaN/±inf/±0), both samplers start
//! from the same seed and pick `steps` consecutive tokens from fresh rows, each appended to the
//! history both penalise; every id must be the same, and the device's RNG state must end where
//! the CPU's is (advanced once per non-greedy step). A wrong pick is a failing check (err = the
//! number of steps that differ, tolerance 0).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;

use super::cuda_kernels::{floats, Check};
use crate::engine::sampler::{Sampler, SamplerConfig};
use crate::kernels::cuda::launch::{DevBuf, Launch};
use crate::kernels::cuda::ops;

/// The sampler configurations checked: (name, temperature, top_k, top_p, min_p, repeat,
/// frequency, presence, repeat_last_n).
type Cfg = (&'static str, f32, usize, f32, f32, f32, f32, f32, usize);
const CONFIGS: [Cfg; 12] = [
    ("greedy", 0.0, 40, 0.95, 0.05, 1.0, 0.0, 0.0, 64),
    ("greedy+pen", 0.0, 0, 1.0, 0.0, 1.3, 0.5, 0.5, 64),
    ("temp", 0.7, 40, 1.0, 0.0, 1.0, 0.0, 0.0, 64),
    ("top-k 5", 1.0, 5, 1.0, 0.0, 1.0, 0.0, 0.0, 64),
    ("top-k 1", 1.5, 1, 1.0, 0.0, 1.0, 0.0, 0.0, 64),
    ("default", 0.8, 40, 0.95, 0.05, 1.0, 0.0, 0.0, 64),
    ("top-p", 1.0, 1000, 0.9, 0.0, 1.0, 0.0, 0.0, 64),
    ("min-p", 1.2, 200, 1.0, 0.1, 1.0, 0.0, 0.0, 64),
    ("penalties", 0.9, 64, 0.9, 0.05, 1.2, 0.3, -0.4, 32),
    ("repeat only", 1.0, 100, 1.0, 0.0, 1.5, 0.0, 0.0, 500),
    ("hot", 3.0, 1024, 0.99, 0.0, 1.0, 0.0, 0.0, 64),
    ("cold", 0.05, 20, 0.95, 0.0, 1.0, 0.0, 0.0, 64),
];

/// Kinds of logits rows: spread values, values on a 0.5 grid (many ties), one peak over noise,
/// and NaN / ±inf / ±0 sprinkled in.
const ROWS: [&str; 4] = ["spread", "ties", "peak", "special"];

fn row(kind: &str, n: usize, seed: u64) -> Vec<f32> {
    let mut x: Vec<f32> = floats(n, seed).iter().map(|v| v * 8.0).collect();
    match kind {
        "ties" => x.iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0),
        "peak" => x[(seed as usize * 7919) % n] = 14.0,
        "special" => {
            for (i, v) in x.iter_mut().enumerate() {
                match (i + seed as usize) % 97 {
                    0 => *v = f32::NAN,
                    1 => *v = f32::NEG_INFINITY,
                    2 => *v = 0.0,
                    3 => *v = -0.0,
                    _ => {}
                }
            }
            if seed.is_multiple_of(5) {
                x[n / 3] = f32::INFINITY;
            }
        }
        _ => {}
    }
    x
}

fn u64s(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One configuration on one kind of row: the steps whose ids differ, plus one if the RNG state
/// ends elsewhere than the CPU's.
fn run_one(l: &Arc<dyn Launch>, c: &Cfg, kind: &str, n: usize, steps: usize) -> Result<usize> {
    let &(_, temperature, top_k, top_p, min_p, repeat_penalty, frequency, presence, last_n) = c;
    let seed = 1000 + n as u64 + top_k as u64;
    let mut cpu = Sampler::new(SamplerConfig {
        temperature,
        top_k,
        top_p,
        min_p,
        repeat_penalty,
        repeat_last_n: last_n,
        presence_penalty: presence,
        frequency_penalty: frequency,
        seed,
        dry: None,
    });
    let ds = cpu
        .device_sampling(n)
        .ok_or_else(|| anyhow::anyhow!("configuration not sampled on the device"))?;
    let rng = DevBuf::from_bytes(l, &u64s(&ds.rng))?;
    let out = DevBuf::new(l, 4)?;
    let xd = DevBuf::new(l, n * 4)?;
    let wd = DevBuf::new(l, (last_n.max(1)) * 4)?;
    // A history that repeats a few ids (and names one outside the vocabulary).
    let mut history: Vec<u32> = (0..40).map(|i| (i * 37 % 13) as u32 * 3).collect();
    history.push(n as u32 + 5);
    let mut wrong = 0;
    for step in 0..steps {
        let x = row(kind, n, seed * 131 + step as u64);
        let want = cpu.sample(&x, &history);
        l.upload(xd.ptr, &crate::kernels::cuda::launch::f32_bytes(&x))?;
        let window = cpu.penalty_window(&history);
        let wb: Vec<u8> = window.iter().flat_map(|v| v.to_le_bytes()).collect();
        if !wb.is_empty() {
            l.upload(wd.ptr, &wb)?;
        }
        ops::sample(
            &**l,
            xd.ptr,
            (wd.ptr, window.len()),
            &ds,
            rng.ptr,
            out.ptr,
            1,
            n,
        )?;
        let b = out.to_bytes()?;
        let got = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        wrong += (got != want) as usize;
        history.push(want);
    }
    let state: Vec<u64> = rng
        .to_bytes()?
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect();
    let cpu_state = cpu.device_sampling(n).map(|d| d.rng.to_vec());
    if Some(state) != cpu_state {
        wrong += 1;
    }
    Ok(wrong)
}

/// Every configuration on every kind of row at each vocabulary size in `sizes`, `steps` tokens
/// each; one [`Check`] per (size, configuration).
pub fn sample(
    l: &Arc<dyn Launch>,
    sizes: &[usize],
    steps: usize,
    out: &mut Vec<Check>,
) -> Result<()> {
    for &n in sizes {
        for c in &CONFIGS {
            let t = Instant::now();
            let mut wrong = 0;
            for kind in ROWS {
                wrong += run_one(l, c, kind, n, steps)?;
            }
            out.push(Check {
                kernel: "sample".into(),
                shape: format!(
                    "n={n}, {}, {steps} steps x {} rows (ids wrong)",
                    c.0,
                    ROWS.len()
                ),
                err: wrong as f64,
                tol: 0.0,
                secs: t.elapsed().as_secs_f64(),
            });
        }
    }
    Ok(())
}
