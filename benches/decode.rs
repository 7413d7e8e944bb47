//! Where decode time goes, against the memory-bandwidth roofline (plain `main`, `harness = false`).
//!
//! Loads a real GGUF (default: the Qwen model `scripts/fetch-models.sh` fetches) on the CPU backend
//! and, interleaved over repetitions, times: the machine's read bandwidth (as `infer bench`), every
//! weight matrix of one decode step multiplied by a one-row activation in model order (the matmuls
//! alone, per weight type and per shape), and a whole decode step at a short context. It prints the best of the repetitions
//! (the machine is shared: noise only ever adds time, so the best is the steadiest figure), the
//! matmuls' GB/s against the bandwidth, the share of the step that is not matmul, and what a
//! row-invariant forward over k tokens (a speculative verify) costs in decode steps.
//!
//! Run: `cargo bench --bench decode [-- MODEL.gguf [THREADS]]`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use infer::engine::runner::{Runner, Sequence, BLOCK_SIZE};
use infer::format::Gguf;
use infer::kernels::cpu::backend::{CpuAct, CpuBackend, CpuWeight};
use infer::kernels::cpu::memory::bandwidth::BandwidthBuffer;
use infer::model::backend::Backend;
use infer::model::weights::{Attn, Ffn, Mlp};
use infer::model::{Model, ModelConfig, Weights};

const REPS: usize = 15;

fn min(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// Every matrix one decode step multiplies, in model order.
fn step_weights(w: &Weights<CpuBackend>) -> Vec<&CpuWeight> {
    fn mlp(m: &Mlp<CpuBackend>) -> [&CpuWeight; 3] {
        [&m.gate, &m.up, &m.down]
    }
    let mut out = Vec::new();
    for l in &w.layers {
        if let Attn::Mha(q) = &l.attn {
            out.extend([&q.wq, &q.wk, &q.wv]);
        }
        out.push(&l.wo);
        match &l.ffn {
            Ffn::Dense(m) => out.extend(mlp(m)),
            Ffn::Moe { shared, .. } => out.extend(shared.iter().flat_map(mlp)),
        }
    }
    out.push(w.output.as_ref().unwrap_or(&w.token_embd));
    out
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let path = args.first().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    });
    let threads: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    if !path.exists() {
        eprintln!("{} is missing: run scripts/fetch-models.sh", path.display());
        return;
    }
    let g = Arc::new(Gguf::open(&path).expect("opening the model"));
    let cfg = ModelConfig::from_gguf(&g).expect("reading the config");
    let backend = CpuBackend::new(threads);
    let weights = Weights::load(&g, &cfg, &backend).expect("loading weights");
    let model = Model {
        cfg,
        weights,
        backend,
        block_size: BLOCK_SIZE,
    };
    let mut runner = Runner::new(model, 512).expect("runner");
    let mut seq = Sequence::default();
    runner.extend(&mut seq, &[1, 2, 3, 4]).expect("prefill");

    let (mut bw, mut mm, mut step) = (vec![], vec![], vec![]);
    let mut per_type: BTreeMap<String, (usize, usize, Vec<f64>)> = BTreeMap::new();
    let mut total_bytes = 0;
    let mut shapes: Shapes = BTreeMap::new();
    let buf = BandwidthBuffer::new(1 << 30);
    for rep in 0..REPS + 1 {
        let b = buf.read_once(&runner.model.backend.pool);
        let (m, types, sh) = matmul_pass(&runner);
        let t = Instant::now();
        runner.extend(&mut seq, &[5]).expect("decode step");
        let s = t.elapsed().as_secs_f64();
        if seq.tokens.len() > 400 {
            runner.truncate(&mut seq, 4);
        }
        if rep > 0 {
            bw.push(b);
            mm.push(m);
            step.push(s);
            total_bytes = 0;
            for (k, (n, bytes, t)) in sh {
                let e = shapes.entry(k).or_insert((n, bytes, f64::INFINITY));
                e.2 = e.2.min(t);
            }
            for (name, bytes, n, t) in types {
                total_bytes += bytes;
                let e = per_type.entry(name).or_default();
                (e.0, e.1) = (bytes, n);
                e.2.push(t);
            }
        }
    }
    let (bw, mm, step) = (-min(bw.iter().map(|b| -b).collect()), min(mm), min(step));
    let gb = |bytes: usize| bytes as f64 / 1e9;
    println!(
        "{} ({threads} threads, best of {REPS}, interleaved)",
        path.display()
    );
    println!("memory read bandwidth       {:8.1} GB/s", bw / 1e9);
    println!(
        "matmuls of one step         {:8.2} ms  {:6.3} GB  {:6.1} GB/s  {:5.1}% of bandwidth",
        mm * 1e3,
        gb(total_bytes),
        gb(total_bytes) / mm,
        100.0 * gb(total_bytes) / mm / (bw / 1e9)
    );
    for (name, (bytes, n, ts)) in per_type {
        let t = min(ts);
        println!(
            "  {name:<6} x{n:<4}              {:8.2} ms  {:6.3} GB  {:6.1} GB/s",
            t * 1e3,
            gb(bytes),
            gb(bytes) / t
        );
    }
    for ((ty, rows, cols), (n, bytes, t)) in &shapes {
        println!(
            "    {ty:<6} {rows:>6}x{cols:<5} x{n:<3}  {:8.1} us each       {:6.1} GB/s",
            t / *n as f64 * 1e6,
            (bytes * n) as f64 / t / 1e9
        );
    }
    println!(
        "whole decode step           {:8.2} ms  ({:.1} t/s; {:.1}% of it outside the matmuls; roofline {:.1} t/s)",
        step * 1e3,
        1.0 / step,
        100.0 * (step - mm).max(0.0) / step,
        bw / 1e9 / gb(total_bytes)
    );
    verify_costs(&mut runner, &mut seq, step);
}

/// What a speculative verify costs: one forward over k new tokens with row-invariant numerics (as
/// `--lookup` verifies), against one decode step, best of the repetitions.
fn verify_costs(runner: &mut Runner<CpuBackend>, seq: &mut Sequence, step: f64) {
    runner.model.backend.set_row_invariant(true);
    let mut line = String::from("verify forward (row-invariant), cost in decode steps:");
    for k in [2usize, 4, 8] {
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let len = seq.tokens.len();
            seq.tokens.extend((0..k as u32).map(|i| 7 + i));
            let t = Instant::now();
            runner.compute_all(seq).expect("verify forward");
            best = best.min(t.elapsed().as_secs_f64());
            runner.truncate(seq, len);
        }
        line += &format!("  k={k}: {:.2}", best / step);
    }
    runner.model.backend.set_row_invariant(false);
    println!("{line}");
}

/// Times every matmul of one step (1-row activations) in model order, then each weight type's
/// matrices on their own: (whole pass seconds, [(type, bytes, matrices, seconds)]).
fn matmul_pass(runner: &Runner<CpuBackend>) -> (f64, Vec<PerType>, Shapes) {
    let be = &runner.model.backend;
    let ws = step_weights(&runner.model.weights);
    let maxc = ws.iter().map(|w| w.cols).max().unwrap_or(1);
    let x: Vec<f32> = (0..maxc)
        .map(|i| ((i * 7919) % 113) as f32 / 57.0 - 1.0)
        .collect();
    let xs: BTreeMap<usize, CpuAct> = ws
        .iter()
        .map(|w| {
            let mut a = be.act(1, w.cols);
            a.data.copy_from_slice(&x[..w.cols]);
            (w.cols, a)
        })
        .collect();
    let mut outs: BTreeMap<usize, CpuAct> =
        ws.iter().map(|w| (w.rows, be.act(1, w.rows))).collect();
    // The whole pass, each matmul timed on its own too (per weight type and shape).
    let mut shapes: Shapes = BTreeMap::new();
    let t0 = Instant::now();
    for w in &ws {
        let o = outs.get_mut(&w.rows).expect("an output per row count");
        let t = Instant::now();
        be.matmul(w, &xs[&w.cols], None, o);
        let e = shapes
            .entry((w.ty.name().to_string(), w.rows, w.cols))
            .or_default();
        (e.0, e.1, e.2) = (e.0 + 1, w.bytes().len(), e.2 + t.elapsed().as_secs_f64());
    }
    let whole = t0.elapsed().as_secs_f64();
    let mut run = |list: &[&CpuWeight]| {
        let t = Instant::now();
        for w in list {
            let o = outs.get_mut(&w.rows).expect("an output per row count");
            be.matmul(w, &xs[&w.cols], None, o);
        }
        t.elapsed().as_secs_f64()
    };
    let mut types: BTreeMap<&str, Vec<&CpuWeight>> = BTreeMap::new();
    for w in &ws {
        types.entry(w.ty.name()).or_default().push(w);
    }
    let per = types
        .into_iter()
        .map(|(name, list)| {
            let bytes = list.iter().map(|w| w.bytes().len()).sum();
            (name.to_string(), bytes, list.len(), run(&list))
        })
        .collect();
    (whole, per, shapes)
}

/// One weight type's matrices timed on their own: (type, bytes, matrices, seconds).
type PerType = (String, usize, usize, f64);

/// Per (type, rows, cols): (matrices, bytes of one, seconds of all of them in the pass).
type Shapes = BTreeMap<(String, usize, usize), (usize, usize, f64)>;
