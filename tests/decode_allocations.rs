//! A decode step allocates a fixed handful of buffers per forward, never per layer, region or
//! operation: between two parallel regions an allocation's lines come cold from memory, and the
//! thread pool's work split promises no per-op allocation. Counted by this test binary's own
//! global allocator over real decode steps of both real models (one test in this file, so no
//! other test allocates meanwhile).
//!
//! Before the work split went allocation-free, a step allocated 190-250 times at the AVX-512
//! level (Gemma-3 270M, Qwen2.5-1.5B; 57 of them cache-line aligned), 100-138 at AVX2 and up to
//! 4,300 at the scalar level; now 22-27 at every level.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use common::{load_runner, model, GEMMA, QWEN};
use infer::engine::runner::Sequence;

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; only a counter is added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(l) }
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: `p` came from `alloc`/`realloc` above, i.e. from `System`, with layout `l`.
        unsafe { System.dealloc(p, l) }
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Relaxed);
        // SAFETY: as `dealloc`; `n` is the caller's new size.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// The most allocations a decode step may make: its forward's activation buffers and lists (about
/// 25), with room to spare, and well under one per layer of Qwen2.5-1.5B's 28.
const PER_STEP: f64 = 32.0;

fn per_step(file: &str) -> (f64, usize) {
    let (_, mut runner) = load_runner(&model(file), 256);
    let layers = runner.model.cfg.n_layer;
    let mut seq = Sequence::default();
    let lg = runner.extend(&mut seq, &[1, 2, 3, 4]).unwrap();
    runner.recycle(lg);
    // Warm: first-use packing, scratch growth, the chain of regions.
    for t in 0..3 {
        let lg = runner.extend(&mut seq, &[5 + t]).unwrap();
        runner.recycle(lg);
    }
    let steps = 8;
    let before = ALLOCATIONS.load(Relaxed);
    for t in 0..steps {
        let lg = runner.extend(&mut seq, &[10 + t]).unwrap();
        runner.recycle(lg);
    }
    let n = ALLOCATIONS.load(Relaxed) - before;
    (n as f64 / steps as f64, layers)
}

#[test]
fn a_decode_step_allocates_per_forward_not_per_layer() {
    for file in [QWEN, GEMMA] {
        let (n, layers) = per_step(file);
        assert!(
            n <= PER_STEP,
            "{file}: {n} allocations per decode step ({layers} layers), more than {PER_STEP}"
        );
    }
}
