//! `infer bench`: prompt processing (pp) and token generation (tg) speed in the manner of llama-bench,
//! with the machine's memory read bandwidth measured in the same run, interleaved with the runs
//! (before each repetition and after every [`READ_EVERY`] generated tokens), so decode speed can be
//! held against its roofline (tokens/s × bytes read per token ÷ bandwidth), the bytes being the
//! weights a token reads and the KV cache it attends over.

use std::io::Write;
use std::time::Instant;

use anyhow::Result;
use serde_json::json;

use crate::cli::args::BenchArgs;
use crate::cli::load::load;
use crate::cli::{note, UsageError};
use infer::engine::load::{cache_type, LoadOptions};
use infer::engine::runner::Sequence;
use infer::kernels::cpu::memory::bandwidth::BandwidthBuffer;
use infer::kernels::cuda::launch::DevBuf;
use infer::kernels::cuda::profile::{summarize, KernelProfile};
use infer::kernels::device::DeviceBackend;
use infer::model::backend::KvType;
use infer::model::weights::bytes_per_token;
use infer::model::Backend;

/// Deterministic pseudo-random token ids (xorshift), as llama-bench feeds random tokens.
struct Tokens(u64);

impl Tokens {
    fn next(&mut self, vocab: usize) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % vocab as u64) as u32
    }
}

struct Summary {
    name: String,
    runs: Vec<f64>,
}

/// One KV cache type's tests.
struct Timed {
    kv: KvType,
    pp: Summary,
    tg: Summary,
    /// Per tg repetition: tokens/s × bytes per token ÷ the bandwidth around it.
    efficiency: Summary,
    /// KV bytes a generated token reads, and the cache's bytes per position.
    kv_bpt: f64,
    kv_pos: u64,
}

impl Timed {
    fn eff(&self) -> Option<f64> {
        (!self.efficiency.runs.is_empty()).then(|| self.efficiency.median())
    }
}

/// The median of some runs (at least one).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

impl Summary {
    fn sorted(&self) -> Vec<f64> {
        let mut v = self.runs.clone();
        v.sort_by(f64::total_cmp);
        v
    }
    fn median(&self) -> f64 {
        median(self.runs.clone())
    }
    fn min(&self) -> f64 {
        self.sorted()[0]
    }
    fn max(&self) -> f64 {
        *self.sorted().last().expect("at least one run")
    }
}

/// A usage error when the test needs `ctx` positions and a sequence holds `n_ctx`.
pub(crate) fn fits(n_ctx: usize, ctx: usize, what: &str) -> Result<(), UsageError> {
    if n_ctx < ctx {
        return Err(UsageError(format!(
            "{what} = {ctx} exceeds the model's context of {n_ctx}"
        )));
    }
    Ok(())
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.reps == 0 {
        return Err(UsageError("-r/--reps must be at least 1".into()).into());
    }
    if !a.concurrency.is_empty() {
        return crate::cli::bench_concurrency::bench(a);
    }
    if let Some(schema) = a.json_schema.clone() {
        return crate::cli::bench_structured::bench(a, &schema);
    }
    let n_prompt = a.n_prompt.unwrap_or(512);
    if n_prompt == 0 && a.n_gen == 0 {
        return Err(UsageError("nothing to measure: -p and -n are both 0".into()).into());
    }
    // The warm-up extends a fresh sequence by five tokens, --profile by PROFILE_STEPS + 1.
    let profiled = if a.profile { PROFILE_STEPS + 1 } else { 0 };
    let ctx = a.depth + n_prompt.max(a.n_gen).max(5).max(profiled) + 1;
    let loaded = load(&a.model, Some(ctx))?;
    let mut runner = loaded.runner;
    fits(runner.n_ctx(), ctx, "depth + tokens")?;
    let vocab = runner.vocab_size();
    let weight_bytes = bytes_per_token(&loaded.gguf);
    let bpt = weight_bytes as f64;
    // The KV cache types timed: each of --kv-types in every repetition, else the run's own.
    let mut kv_types: Vec<KvType> = Vec::new();
    for &(k, v) in &a.kv_types {
        let opts = LoadOptions {
            cache_type_k: k,
            cache_type_v: v,
            ..LoadOptions::default()
        };
        let t = cache_type(&runner.model.cfg, &opts)?;
        if !kv_types.contains(&t) {
            kv_types.push(t);
        }
    }
    if kv_types.is_empty() {
        kv_types.push(runner.model.cfg.kv_type);
    }
    let model_bytes = loaded.gguf.file_size();
    // What the cache stores per position with f16 (each type's own is in its `Timed`).
    let kv_pos_f16 = {
        let cfg = &runner.model.cfg;
        let (k, v) = KvType::F16.row_bytes(cfg.kv_dim());
        (cfg.n_layer * (k + v)) as u64
    };
    let mut rng = Tokens(0x9E37_79B9_7F4A_7C15);
    let backend = runner.model.backend.name();
    // All on the GPU: the roofline is the device's memory (read + write of a 1 GiB buffer);
    // otherwise the host's (a read of 512 MiB by every thread).
    let gpu = match &runner.model.backend.cuda {
        Some(c) if backend == "cuda" => Some(DevBuf::new(c.launcher(), 1 << 30)?),
        _ => None,
    };
    let buf = BandwidthBuffer::new(if gpu.is_some() { 4096 } else { 512 << 20 });
    let measure_bandwidth = |runner: &infer::engine::runner::Runner<DeviceBackend>| -> Result<f64> {
        let be = &runner.model.backend;
        Ok(match (&gpu, &be.cuda) {
            (Some(b), Some(c)) => c.stream_bandwidth(b)?,
            _ => buf.read_once(&be.cpu.pool),
        } / 1e9)
    };
    measure_bandwidth(&runner)?; // warm the pages
                                 // The copies a fast start leaves to a background thread: measure the steady state.
    runner.model.backend.cpu.wait_copies();
    let mut bandwidth = Summary {
        name: "bandwidth".into(),
        runs: Vec::new(),
    };

    // a fresh sequence at `depth`: prefill the depth tokens, return the sequence
    let fresh =
        |runner: &mut infer::engine::runner::Runner<_>, rng: &mut Tokens| -> Result<Sequence> {
            let mut seq = Sequence::default();
            if a.depth > 0 {
                let toks: Vec<u32> = (0..a.depth).map(|_| rng.next(vocab)).collect();
                runner.extend(&mut seq, &toks)?;
            }
            Ok(seq)
        };
    let depth_tag = if a.depth > 0 {
        format!(" @ d{}", a.depth)
    } else {
        String::new()
    };
    let kv_tag = |t: KvType| {
        if kv_types.len() > 1 {
            format!(" kv {}", t.name())
        } else {
            String::new()
        }
    };
    let mut timed: Vec<Timed> = Vec::new();
    for &t in &kv_types {
        runner.set_kv_type(t)?;
        // warm-up: a short prefill and two decode steps
        let mut seq = fresh(&mut runner, &mut rng)?;
        let toks: Vec<u32> = (0..4).map(|_| rng.next(vocab)).collect();
        runner.extend(&mut seq, &toks)?;
        runner.extend(&mut seq, &[rng.next(vocab)])?;
        drop(seq);
        let cfg = &runner.model.cfg;
        timed.push(Timed {
            kv: t,
            pp: Summary {
                name: format!("pp{}{depth_tag}{}", n_prompt, kv_tag(t)),
                runs: Vec::new(),
            },
            tg: Summary {
                name: format!("tg{}{depth_tag}{}", a.n_gen, kv_tag(t)),
                runs: Vec::new(),
            },
            efficiency: Summary {
                name: "decode efficiency".into(),
                runs: Vec::new(),
            },
            // A generated token also reads the KV cache: at the mean over a repetition's
            // positions.
            kv_bpt: (a.depth..a.depth + a.n_gen)
                .map(|p| cfg.kv_read_bytes(p) as f64)
                .sum::<f64>()
                / a.n_gen.max(1) as f64,
            kv_pos: cfg.kv_bytes_per_position(),
        });
    }
    let progress = !a.json && crate::cli::progress::enabled();
    for rep in 0..a.reps {
        for Timed {
            kv,
            pp,
            tg,
            efficiency,
            kv_bpt,
            ..
        } in timed.iter_mut()
        {
            runner.set_kv_type(*kv)?;
            let kv_bpt = *kv_bpt;
            if n_prompt > 0 {
                let mut seq = fresh(&mut runner, &mut rng)?;
                let toks: Vec<u32> = (0..n_prompt).map(|_| rng.next(vocab)).collect();
                let t0 = Instant::now();
                runner.extend(&mut seq, &toks)?;
                pp.runs.push(n_prompt as f64 / t0.elapsed().as_secs_f64());
                drop(seq);
            }
            let mut before = measure_bandwidth(&runner)?;
            bandwidth.runs.push(before);
            if a.n_gen > 0 {
                // Decoded in stretches of `READ_EVERY` tokens with a bandwidth read after each, held
                // against the reads around it (`rep_efficiency`): the machine's bandwidth can move
                // within a repetition (a shared VM's switched states within seconds), and two reads
                // around a whole repetition would hold all of it against those two moments.
                let mut seq = fresh(&mut runner, &mut rng)?;
                let mut stretches = Vec::new();
                let mut left = a.n_gen;
                while left > 0 {
                    let tokens = left.min(READ_EVERY);
                    let t0 = Instant::now();
                    for _ in 0..tokens {
                        // As a generation loop does: the step's logits go back once they are used.
                        let logits = runner.extend(&mut seq, &[rng.next(vocab)])?;
                        runner.recycle(logits);
                    }
                    let secs = t0.elapsed().as_secs_f64();
                    let after = measure_bandwidth(&runner)?;
                    bandwidth.runs.push(after);
                    stretches.push(Stretch {
                        tokens,
                        secs,
                        gbs: (before + after) / 2.0,
                    });
                    before = after;
                    left -= tokens;
                }
                drop(seq);
                let secs: f64 = stretches.iter().map(|s| s.secs).sum();
                tg.runs.push(a.n_gen as f64 / secs);
                efficiency
                    .runs
                    .push(rep_efficiency(&stretches, (bpt + kv_bpt) / 1e9));
            }
        }
        if progress {
            eprint!("\rinfer: bench repetition {}/{}", rep + 1, a.reps);
        }
    }
    if progress {
        eprintln!();
    }
    let launcher = runner
        .model
        .backend
        .cuda
        .as_ref()
        .map(|c| c.launcher().clone());
    let profile = match (a.profile, &gpu, launcher) {
        (true, Some(_), Some(l)) => {
            let mut seq = fresh(&mut runner, &mut rng)?;
            profile_decode(&mut runner, &mut seq, &l, &mut rng)?
        }
        (true, ..) => {
            note!("infer: --profile times GPU kernels; this run is on the {backend} backend");
            Vec::new()
        }
        _ => Vec::new(),
    };
    let tests: Vec<(&Timed, &Summary)> = timed
        .iter()
        .flat_map(|t| [(t, &t.pp), (t, &t.tg)])
        .filter(|(_, s)| !s.runs.is_empty())
        .collect();
    let bw = bandwidth.median();
    if let Some(n) = unsteady(&bandwidth.runs) {
        note!("{n}");
    }
    let name = a.model.model.display().to_string();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if a.json {
        let rows: Vec<_> = tests
            .iter()
            .map(|(t, s)| {
                json!({"test": s.name, "kv_cache_type": t.kv.name(), "tps_median": s.median(), "tps_min": s.min(), "tps_max": s.max(), "runs": s.runs})
            })
            .collect();
        writeln!(
            out,
            "{}",
            json!({
                "model": name,
                "model_bytes": model_bytes,
                "bytes_per_token": weight_bytes,
                "kv_bytes_per_token": timed[0].kv_bpt.round() as u64,
                "kv_cache_type": timed[0].kv.name(),
                "kv_cache_bytes_per_position": timed[0].kv_pos,
                "kv_cache_bytes_per_position_f16": kv_pos_f16,
                "kv_caches": timed.iter().map(|t| json!({
                    "type": t.kv.name(),
                    "bytes_per_position": t.kv_pos,
                    "kv_bytes_per_token": t.kv_bpt.round() as u64,
                    "decode_efficiency": t.eff(),
                })).collect::<Vec<_>>(),
                "threads": loaded.threads,
                "backend": backend,
                "reps": a.reps,
                "tests": rows,
                "bandwidth_gbs": {"median": bw, "min": bandwidth.min(), "max": bandwidth.max(), "runs": bandwidth.runs},
                "decode_efficiency": timed[0].eff(),
                "decode_efficiency_runs": timed[0].efficiency.runs,
                "profile": profile_json(&profile),
            })
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "| model | size | backend | threads | test | t/s (median) | min – max |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|")?;
    for (_, s) in &tests {
        writeln!(
            out,
            "| {} | {:.2} GiB | {} | {} | {} | {:.2} | {:.2} – {:.2} |",
            name,
            model_bytes as f64 / (1u64 << 30) as f64,
            backend,
            loaded.threads,
            s.name,
            s.median(),
            s.min(),
            s.max()
        )?;
    }
    writeln!(
        out,
        "\n{} bandwidth (same run, {} reads): median {:.1} GB/s (min {:.1}, max {:.1})",
        if gpu.is_some() {
            "GPU memory read+write"
        } else {
            "memory read"
        },
        bandwidth.runs.len(),
        bw,
        bandwidth.min(),
        bandwidth.max()
    )?;
    for t in &timed {
        writeln!(
            out,
            "KV cache: {} keys/values, {} bytes per position ({:.1}% of f16's {})",
            t.kv.name(),
            t.kv_pos,
            100.0 * t.kv_pos as f64 / kv_pos_f16 as f64,
            kv_pos_f16
        )?;
        if let Some(e) = t.eff() {
            writeln!(
                out,
                "decode efficiency{}: {:.0}% of the bandwidth roofline (median over {} repetitions \
                 of tg t/s × ({:.3} GB of weights + {:.3} GB of KV cache) a token ÷ the bandwidth \
                 read around every {} tokens; {:.0}-{:.0}%)",
                kv_tag(t.kv),
                e * 100.0,
                t.efficiency.runs.len(),
                bpt / 1e9,
                t.kv_bpt / 1e9,
                READ_EVERY,
                t.efficiency.min() * 100.0,
                t.efficiency.max() * 100.0
            )?;
        }
    }
    if !profile.is_empty() {
        write_profile(&mut out, &profile)?;
    }
    Ok(())
}

/// Decode steps timed kernel by kernel (`--profile`).
const PROFILE_STEPS: usize = 16;

/// [`PROFILE_STEPS`] decode steps of `seq` with every launch timed on the device, per kernel.
fn profile_decode(
    runner: &mut infer::engine::runner::Runner<DeviceBackend>,
    seq: &mut Sequence,
    l: &std::sync::Arc<dyn infer::kernels::cuda::launch::Launch>,
    rng: &mut Tokens,
) -> Result<Vec<KernelProfile>> {
    let vocab = runner.vocab_size();
    // One untimed step first: the first sighting of a shape allocates its scratch.
    let logits = runner.extend(seq, &[rng.next(vocab)])?;
    runner.recycle(logits);
    if !l.profile_start() {
        return Ok(Vec::new());
    }
    let run = (0..PROFILE_STEPS).try_for_each(|_| -> Result<()> {
        let logits = runner.extend(seq, &[rng.next(vocab)])?;
        runner.recycle(logits);
        Ok(())
    });
    let timed = l.profile_stop()?;
    run?;
    Ok(summarize(&timed, PROFILE_STEPS))
}

fn profile_json(p: &[KernelProfile]) -> serde_json::Value {
    if p.is_empty() {
        return serde_json::Value::Null;
    }
    let rows: Vec<_> = p
        .iter()
        .map(|k| {
            json!({"kernel": k.name, "launches_per_token": k.launches, "us_per_token": k.secs * 1e6,
                   "bytes_per_token": k.bytes, "gbs": k.bandwidth().map(|b| b / 1e9)})
        })
        .collect();
    json!({"steps": PROFILE_STEPS, "kernels": rows})
}

fn write_profile(out: &mut impl Write, p: &[KernelProfile]) -> Result<()> {
    let total: f64 = p.iter().map(|k| k.secs).sum();
    writeln!(
        out,
        "\nkernels of {PROFILE_STEPS} decode steps, each launch timed alone (CUDA events, no graphs): \
         {:.1} µs a token in kernels, {:.0} launches",
        total * 1e6,
        p.iter().map(|k| k.launches).sum::<f64>()
    )?;
    writeln!(
        out,
        "| kernel | launches/token | µs/token | share | MB/token | GB/s |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|")?;
    for k in p {
        let (mb, gbs) = match (k.bytes, k.bandwidth()) {
            (Some(b), Some(bw)) => (format!("{:.3}", b / 1e6), format!("{:.0}", bw / 1e9)),
            _ => ("-".into(), "-".into()),
        };
        writeln!(
            out,
            "| {} | {:.1} | {:.1} | {:.1}% | {mb} | {gbs} |",
            k.name,
            k.launches,
            k.secs * 1e6,
            100.0 * k.secs / total.max(1e-12)
        )?;
    }
    Ok(())
}

/// Tokens a tg repetition decodes between two bandwidth reads. A read passes over 512 MiB twice,
/// about 20-40 ms at the development machine's 27-55 GB/s, while 32 tokens take 0.3-1 s there;
/// the reads' time is not the decode's.
const READ_EVERY: usize = 32;

/// A stretch of a tg repetition: `tokens` decoded in `secs`, between two bandwidth reads whose
/// mean is `gbs` (GB/s).
struct Stretch {
    tokens: usize,
    secs: f64,
    gbs: f64,
}

/// A repetition's decode efficiency: the time its tokens take at the roofline (each stretch's
/// `gb_per_token` bytes a token at that stretch's bandwidth) over the time they took. One stretch
/// gives tokens/s × bytes a token ÷ bandwidth.
fn rep_efficiency(stretches: &[Stretch], gb_per_token: f64) -> f64 {
    let roofline: f64 = stretches
        .iter()
        .map(|s| s.tokens as f64 * gb_per_token / s.gbs)
        .sum();
    roofline / stretches.iter().map(|s| s.secs).sum::<f64>()
}

/// Bandwidth reads whose largest is this many times their smallest mean the machine's memory
/// was not steady during the run (on a quiet machine the reads stay within 10-20%).
const UNSTEADY: f64 = 1.3;

/// The warning for a run whose bandwidth reads (GB/s) moved more than [`UNSTEADY`] allows: the
/// speeds, and the efficiency held against those reads, are then only as steady as the machine.
fn unsteady(reads: &[f64]) -> Option<String> {
    let min = reads.iter().copied().fold(f64::INFINITY, f64::min);
    let max = reads.iter().copied().fold(0.0, f64::max);
    (min > 0.0 && max > UNSTEADY * min).then(|| {
        format!(
            "infer: the memory bandwidth moved from {min:.1} to {max:.1} GB/s during this run \
             (other load on the machine, or a VM whose bandwidth changes): its speeds and \
             efficiency are only as steady as that; rerun when it is quiet, or with more -r"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{rep_efficiency, unsteady, Stretch};

    #[test]
    fn efficiency_holds_each_stretch_against_its_own_reads() {
        let s = |tokens, secs, gbs| Stretch { tokens, secs, gbs };
        // One stretch: 32 tokens in 1 s at 1 GB a token against 40 GB/s is 32/40.
        let one = rep_efficiency(&[s(32, 1.0, 40.0)], 1.0);
        assert!((one - 0.8).abs() < 1e-12, "{one}");
        // 32 tokens in 1.0 s at 32 GB/s, then 32 in 0.6 s at 64: at the roofline they take 1.0 +
        // 0.5 s, so 1.5 / 1.6. Two reads around the whole repetition (a mean of 48 GB/s) would
        // have said 64 tokens / 1.6 s ÷ 48 = 0.833.
        let two = rep_efficiency(&[s(32, 1.0, 32.0), s(32, 0.6, 64.0)], 1.0);
        assert!((two - 1.5 / 1.6).abs() < 1e-12, "{two}");
        // A stretch decoding at the roofline counts 1, whatever the other's bandwidth.
        let at = rep_efficiency(&[s(16, 0.5, 32.0), s(16, 0.25, 64.0)], 1.0);
        assert!((at - 1.0).abs() < 1e-12, "{at}");
    }

    #[test]
    fn warns_only_when_the_bandwidth_moved() {
        assert_eq!(unsteady(&[29.2, 26.6, 31.1]), None);
        assert_eq!(unsteady(&[30.0, 39.0]), None);
        let w = unsteady(&[30.1, 21.4, 50.2, 33.0]).expect("a 2.3x spread warns");
        assert!(w.contains("from 21.4 to 50.2 GB/s"), "{w}");
        // No reads, or a read of zero (a failed measurement): nothing to judge.
        assert_eq!(unsteady(&[]), None);
        assert_eq!(unsteady(&[0.0, 30.0]), None);
    }
}
