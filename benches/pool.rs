//! Dispatch-cost benchmark for `kernels::cpu::threads::pool::ThreadPool` (plain `main`, `harness = false`).
//!
//! Measures, per parallel region: an empty `broadcast` on hot (spinning) workers (which the caller
//! may finish alone by running late workers' indices itself), a round trip in which every
//! worker must run its own index, a trivial `for_range`, and the cost when the workers have
//! parked. Each figure is the
//! median over many individually timed calls (`Instant` overhead, ~20-40 ns, is included and
//! printed separately). Run with `cargo bench --bench pool [-- THREADS]` (default 2 threads).

use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use infer::kernels::cpu::threads::pool::{physical_cores, ThreadPool, SPIN};

struct Stats {
    median: f64,
    p10: f64,
    p90: f64,
    p99: f64,
}

fn stats(mut ns: Vec<f64>) -> Stats {
    ns.sort_by(f64::total_cmp);
    let q = |f: f64| ns[((ns.len() - 1) as f64 * f).round() as usize];
    Stats {
        median: q(0.5),
        p10: q(0.1),
        p90: q(0.9),
        p99: q(0.99),
    }
}

/// Times `iters` calls of `f` individually, after `warmup` untimed ones.
fn time_each(warmup: usize, iters: usize, mut f: impl FnMut()) -> Stats {
    for _ in 0..warmup {
        f();
    }
    let mut ns = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        f();
        ns.push(t.elapsed().as_nanos() as f64);
    }
    stats(ns)
}

fn report(name: &str, s: &Stats) {
    println!(
        "{name:<44} median {:>9.2} us   p10 {:>9.2}   p90 {:>9.2}   p99 {:>9.2}",
        s.median / 1e3,
        s.p10 / 1e3,
        s.p90 / 1e3,
        s.p99 / 1e3
    );
}

fn main() {
    let threads: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2);
    println!(
        "pool dispatch benchmark: {threads} threads (physical cores here: {}), spin window {:?}",
        physical_cores(),
        SPIN
    );
    let pool = ThreadPool::new(threads);

    report(
        "Instant::now + elapsed (timer overhead)",
        &time_each(1000, 100_000, || {
            black_box(());
        }),
    );

    report(
        "broadcast(empty), hot workers",
        &time_each(10_000, 200_000, || {
            pool.broadcast(|i, n| {
                black_box((i, n));
            })
        }),
    );

    // Batched: no timer inside the loop, mean per region over batches of 1000.
    let mut batch_means = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        for _ in 0..1000 {
            pool.broadcast(|i, n| {
                black_box((i, n));
            });
        }
        batch_means.push(t.elapsed().as_nanos() as f64 / 1000.0);
    }
    report("broadcast(empty), hot, batch means", &stats(batch_means));

    // Round trip with the worker forced to take part: index 0 waits until every other index
    // has started, so the caller can never run them itself. This is the cost a real kernel pays
    // when its share is long enough for the workers to show up (the usual case).
    report(
        "broadcast round trip (all threads run)",
        &time_each(10_000, 200_000, || {
            let arrived = AtomicUsize::new(0);
            pool.broadcast(|i, n| {
                if i == 0 {
                    while arrived.load(Ordering::Acquire) != n - 1 {
                        std::hint::spin_loop();
                    }
                } else {
                    arrived.fetch_add(1, Ordering::Release);
                }
            })
        }),
    );

    let sink = AtomicUsize::new(0);
    report(
        "for_range(n=4096, min_chunk=64, sum)",
        &time_each(10_000, 100_000, || {
            pool.for_range(4096, 64, |r| {
                sink.fetch_add(r.sum::<usize>(), Ordering::Relaxed);
            })
        }),
    );

    // Workers parked: sleep well past the spin window before each region.
    let mut parked = Vec::new();
    for _ in 0..300 {
        std::thread::sleep(SPIN * 4 + Duration::from_micros(200));
        let t = Instant::now();
        pool.broadcast(|i, n| {
            black_box((i, n));
        });
        parked.push(t.elapsed().as_nanos() as f64);
    }
    report("broadcast(empty), workers parked (wake-up)", &stats(parked));

    let inline = ThreadPool::new(1);
    report(
        "broadcast(empty), 1 thread (inline baseline)",
        &time_each(10_000, 100_000, || {
            inline.broadcast(|i, n| {
                black_box((i, n));
            })
        }),
    );
    black_box(sink.load(Ordering::Relaxed));
}
