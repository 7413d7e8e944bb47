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

/// `cases` (a configuration and a kind of row each) as the rows of one `sample` launch per step,
/// each row with its own sampler, RNG state, penalty window and logits: per case, the steps whose
/// ids differ from its CPU sampler's, plus one if its RNG state ends elsewhere than the CPU's.
fn run_rows(
    l: &Arc<dyn Launch>,
    cases: &[(&Cfg, &str)],
    n: usize,
    steps: usize,
) -> Result<Vec<usize>> {
    let m = cases.len();
    let mut cpus = Vec::with_capacity(m);
    let mut rngs = Vec::with_capacity(m);
    let mut seeds = Vec::with_capacity(m);
    for (i, &(c, _)) in cases.iter().enumerate() {
        let &(_, temperature, top_k, top_p, min_p, repeat_penalty, frequency, presence, last_n) = c;
        let seed = 1000 + n as u64 + top_k as u64 + 7 * i as u64;
        let cpu = Sampler::new(SamplerConfig {
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
        rngs.push(DevBuf::from_bytes(l, &u64s(&ds.rng))?);
        cpus.push(cpu);
        seeds.push(seed);
    }
    let xd = DevBuf::new(l, m * n * 4)?;
    let max_window = cases.iter().map(|(c, _)| c.8).sum::<usize>();
    let table = DevBuf::new(l, m * ops::SAMPLE_ROW_BYTES + 4 * max_window + 4 * m)?;
    let out = table.ptr + (m * ops::SAMPLE_ROW_BYTES + 4 * max_window) as u64;
    // Histories that repeat a few ids (and name one outside the vocabulary), one per row.
    let mut histories: Vec<Vec<u32>> = (0..m)
        .map(|r| {
            let mut h: Vec<u32> = (0..40).map(|i| ((i + r) * 37 % 13) as u32 * 3).collect();
            h.push(n as u32 + 5);
            h
        })
        .collect();
    let mut wrong = vec![0; m];
    let mut last = Vec::new(); // the table last uploaded (greedy rows reuse it)
    for step in 0..steps {
        let mut want = Vec::with_capacity(m);
        let mut x = Vec::with_capacity(m * n);
        for (r, &(_, kind)) in cases.iter().enumerate() {
            let row = row(kind, n, seeds[r] * 131 + step as u64);
            want.push(cpus[r].sample(&row, &histories[r]));
            x.extend(row);
        }
        l.upload(xd.ptr, &crate::kernels::cuda::launch::f32_bytes(&x))?;
        let windows: Vec<Vec<u32>> = (0..m)
            .map(|r| cpus[r].penalty_window(&histories[r]).to_vec())
            .collect();
        let samplings: Vec<_> = cpus.iter().map(|c| c.device_sampling(n)).collect();
        let rows: Vec<ops::SampleRow<'_>> = (0..m)
            .map(|r| ops::SampleRow {
                row: r,
                rng: rngs[r].ptr,
                window: &windows[r],
                s: samplings[r].as_ref().expect("checked above"),
            })
            .collect();
        ops::sample(&**l, &rows, table.ptr, &mut last, xd.ptr, n, out)?;
        let mut b = vec![0u8; 4 * m];
        l.download(out, &mut b)?;
        for r in 0..m {
            let got = u32::from_le_bytes(b[4 * r..4 * r + 4].try_into().expect("4 bytes"));
            wrong[r] += (got != want[r]) as usize;
            histories[r].push(want[r]);
        }
    }
    for r in 0..m {
        let state: Vec<u64> = rngs[r]
            .to_bytes()?
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        let cpu_state = cpus[r].device_sampling(n).map(|d| d.rng.to_vec());
        if Some(state) != cpu_state {
            wrong[r] += 1;
        }
    }
    Ok(wrong)
}

/// Every configuration on every kind of row at each vocabulary size in `sizes`, `steps` tokens
/// each, the four kinds of row of a configuration sampled together (one [`Check`] per (size,
/// configuration)); then every configuration at once, one row each (one launch a step, as a
/// batched decode step samples its requests' rows).
pub fn sample(
    l: &Arc<dyn Launch>,
    sizes: &[usize],
    steps: usize,
    out: &mut Vec<Check>,
) -> Result<()> {
    for &n in sizes {
        for c in &CONFIGS {
            let t = Instant::now();
            let cases: Vec<_> = ROWS.iter().map(|&k| (c, k)).collect();
            let wrong: usize = run_rows(l, &cases, n, steps)?.iter().sum();
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
        let t = Instant::now();
        let cases: Vec<_> = CONFIGS
            .iter()
            .enumerate()
            .map(|(i, c)| (c, ROWS[i % ROWS.len()]))
            .collect();
        let wrong: usize = run_rows(l, &cases, n, steps)?.iter().sum();
        out.push(Check {
            kernel: "sample".into(),
            shape: format!(
                "n={n}, {} configurations in one launch, {steps} steps (ids wrong)",
                CONFIGS.len()
            ),
            err: wrong as f64,
            tol: 0.0,
            secs: t.elapsed().as_secs_f64(),
        });
    }
    Ok(())
}
