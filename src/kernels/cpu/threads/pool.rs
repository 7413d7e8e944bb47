//! A persistent, low-latency thread pool for the forward pass's parallel regions.
//!
//! Owns `n_threads - 1` worker threads; the calling thread is thread 0 and does its share of the
//! work, so a pool of 1 runs everything inline. A parallel region is dispatched by publishing a
//! type-erased job and bumping an epoch counter; idle workers spin on that counter for a short
//! while ([`SPIN`]) and then park on a condition variable, so back-to-back regions cost well
//! under a microsecond while a pool that sits idle (or shares its cores with another process)
//! does not burn CPU or stall behind a descheduled spinner.
//!
//! Each thread index of a region is a task that must be *claimed* before it runs: worker `i`
//! claims index `i` when it sees the region, and the caller, once its own share is done, claims
//! and runs every index whose worker has not shown up yet. A worker that is descheduled (another
//! process holds its core) therefore never stalls a region it has not started; the caller only
//! waits for tasks that are actually running.
//!
//! Invariants:
//! - At most one region is in flight per pool: `broadcast` holds `dispatch` for its whole
//!   duration. It does not return (or unwind) until every index has been claimed and every
//!   claimed task has finished, so the erased closure pointer never outlives the closure.
//! - A claim for region `e` is a `fetch_max(e)` on the index's claim word that returns a value
//!   below `e`; exactly one thread wins it. A worker reads the job slot only after winning a
//!   claim, which proves region `e` is still in flight (it cannot end with an unclaimed index),
//!   so the slot still holds region `e`'s job.
//! - The job slot is written only by the dispatching thread between regions, and published by
//!   the epoch store (`SeqCst`, hence Release) that workers read with `Acquire`.
//! - A panic in any task is caught and re-raised on the caller once no task of the region is
//!   running (precedence: the caller's own share, then a task the caller ran, then a worker's).
//!   If the caller's own share panics, indices no worker has claimed yet are cancelled.
//! - A `broadcast` issued from inside a region (by the caller or a worker of any pool) runs all
//!   thread indices inline on that thread instead of deadlocking.
//! - A region may name, per worker, bytes to prefetch once that worker's task is done
//!   ([`ThreadPool::broadcast_then_prefetch`]): the worker reads them into its L2 cache after it
//!   has counted its task finished, while no new region has been dispatched. Prefetches are hints
//!   that never fault, so any address will do; the region's result does not depend on them.

use std::any::Any;
use std::cell::{Cell, UnsafeCell};
use std::ops::Range;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle thread spins on the epoch (or the caller on completion) before parking.
pub const SPIN: Duration = Duration::from_micros(50);

/// `for_range` cuts up to this many chunks per thread and hands them out dynamically, so a
/// thread that was descheduled for a while does not hold up the whole region.
pub const CHUNKS_PER_THREAD: usize = 4;

/// The chunks per thread of [`ThreadPool::for_range_with`] for compute-bound work (prefill's
/// GEMMs and attention): a vCPU the hypervisor deschedules mid-op then holds up a sixteenth of
/// its share, not a quarter. On a VM whose hypervisor took 3-15% of the CPU time (`vmstat`'s
/// steal), Gemma-3 270M's pp512 took 0.93 of the time with 16 chunks a thread against 4 (median
/// of five alternated `infer bench` pairs, 0.90-1.00); Qwen2.5-1.5B's 0.98 (four pairs,
/// 0.92-1.05). Streaming work (forwards over a few rows) keeps [`CHUNKS_PER_THREAD`]: each
/// chunk starts a stream that the prefetchers pick up late.
pub const FINE_CHUNKS: usize = 16;

thread_local! {
    /// True while this thread is running a pool job (always true on worker threads).
    static IN_REGION: Cell<bool> = const { Cell::new(false) };
}

/// Keeps hot atomics on their own cache lines.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

/// A type-erased `&F` where `F: Fn(usize, usize) + Sync`.
#[derive(Clone, Copy)]
struct Job {
    data: *const (),
    call: unsafe fn(*const (), usize, usize),
}

/// Calls the `F` behind `data`.
///
/// # Safety
/// `data` must point to a live `F`.
unsafe fn call_erased<F: Fn(usize, usize) + Sync>(data: *const (), index: usize, n: usize) {
    // SAFETY: the caller guarantees `data` came from a `&F` that is still alive.
    let f = unsafe { &*data.cast::<F>() };
    f(index, n);
}

fn noop_job(_: *const (), _: usize, _: usize) {}

/// State shared between the owner and the workers.
struct Shared {
    n_threads: usize,
    /// Bumped (after the job is written) to start a region; workers remember the last one seen.
    epoch: Padded<AtomicU64>,
    /// The current region's job; see the module invariants for who may touch it when.
    job: UnsafeCell<Job>,
    /// `claims[i]`: the last region whose index `i` was claimed (index 0 unused).
    claims: Vec<Padded<AtomicU64>>,
    /// Tasks of the current region (indices 1..n) not yet finished or cancelled.
    remaining: Padded<AtomicUsize>,
    /// Set (with an epoch bump) when the pool is dropped.
    shutdown: AtomicBool,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    wake_lock: Mutex<()>,
    wake: Condvar,
    /// Whether the dispatcher is parked (or about to park) on `done`.
    caller_sleeping: AtomicBool,
    done_lock: Mutex<()>,
    done: Condvar,
    /// First panic payload raised by a worker in the current region.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// `after[i]`: the address and length worker `i` prefetches after its task in the current
    /// region (length 0: none), written with the job and published by the epoch store.
    after: Vec<Padded<[AtomicUsize; 2]>>,
    /// Tests only: while set, workers wait before claiming, so they are late for certain.
    #[cfg(test)]
    hold: AtomicBool,
}

// SAFETY: every field but `job` is Sync on its own; `job` is accessed under the epoch / claim
// protocol described in the module docs (written only between regions, read by a worker only
// after it acquired the epoch and won a claim for the region in flight), and the `data` pointer
// it holds refers to an `F: Sync`, which may be shared across threads.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer in `job` is only dereferenced under that protocol.
unsafe impl Send for Shared {}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Spins until `ready()` or [`SPIN`] has passed; returns whether `ready()` became true.
#[inline]
fn spin_until(ready: impl Fn() -> bool) -> bool {
    // Most waits end within a few hundred nanoseconds: only read the clock after that.
    for _ in 0..256 {
        if ready() {
            return true;
        }
        std::hint::spin_loop();
    }
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() >= SPIN {
            return ready();
        }
    }
}

/// A persistent pool of `n_threads` threads (the caller included).
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises regions issued from different threads.
    dispatch: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` threads in total, the calling thread included (`n_threads - 1`
    /// workers are spawned). `n_threads` of 0 is treated as 1.
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            n_threads,
            epoch: Padded(AtomicU64::new(0)),
            job: UnsafeCell::new(Job {
                data: std::ptr::null(),
                call: noop_job,
            }),
            claims: (0..n_threads).map(|_| Padded(AtomicU64::new(0))).collect(),
            remaining: Padded(AtomicUsize::new(0)),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            wake_lock: Mutex::new(()),
            wake: Condvar::new(),
            caller_sleeping: AtomicBool::new(false),
            done_lock: Mutex::new(()),
            done: Condvar::new(),
            panic: Mutex::new(None),
            after: (0..n_threads).map(|_| Padded(Default::default())).collect(),
            #[cfg(test)]
            hold: AtomicBool::new(false),
        });
        let workers = (1..n_threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("infer-pool-{index}"))
                    .spawn(move || worker_loop(&shared, index))
                    .expect("failed to spawn a thread-pool worker")
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            dispatch: Mutex::new(()),
        }
    }

    /// Threads taking part in each region, the caller included.
    pub fn n_threads(&self) -> usize {
        self.shared.n_threads
    }

    /// Runs `f(index, n_threads)` once for every index in `0..n_threads` and returns when all
    /// have finished. Index 0 runs on the caller and index `i` normally on worker `i`; an index
    /// whose worker has not picked the region up by the time the caller has finished its own
    /// share is run by the caller instead, so rely on the index (e.g. for scratch buffers), not
    /// on thread identity. `f` may borrow from the caller's stack. A panic in any task is
    /// re-raised here once no task is running any more.
    pub fn broadcast<F: Fn(usize, usize) + Sync>(&self, f: F) {
        self.broadcast_then_prefetch(f, &[]);
    }

    /// [`ThreadPool::broadcast`], and worker `i` then prefetches `after[i]` (an address and a
    /// length in bytes) into its L2 cache, stopping when the next region is dispatched. For the
    /// weights a worker reads first in the next region, so they stream in while the caller does
    /// serial work between regions. Entries past `after`'s end, index 0 (the caller) and an index
    /// the caller runs itself prefetch nothing.
    pub fn broadcast_then_prefetch<F: Fn(usize, usize) + Sync>(
        &self,
        f: F,
        after: &[(usize, usize)],
    ) {
        let n = self.shared.n_threads;
        if n == 1 || IN_REGION.with(Cell::get) {
            // Inline: a single-thread pool, or a nested region (which would otherwise wait for
            // workers that are busy running the outer region).
            for index in 0..n {
                f(index, n);
            }
            return;
        }
        let region = lock(&self.dispatch);
        let shared = &*self.shared;
        // Only a dispatcher holding `dispatch` (or `drop`, which has `&mut self`) bumps the epoch.
        let e = shared.epoch.0.load(Ordering::Relaxed) + 1;
        // SAFETY: no worker reads `job` now: we hold `dispatch`, and the previous region ended
        // with every index claimed and `remaining == 0` (observed with Acquire), so no worker is
        // between a winning claim and the end of its task; a worker can only win a claim for
        // region `e` after the epoch store below. The pointer erases `f`'s lifetime; it stays
        // valid because this function does not return or unwind before every index is claimed
        // and `remaining` is back to 0, i.e. before every worker that claimed a task of region
        // `e` has returned from `call_erased`.
        unsafe {
            *shared.job.get() = Job {
                data: (&f as *const F).cast(),
                call: call_erased::<F>,
            };
        }
        shared.remaining.0.store(n - 1, Ordering::Relaxed);
        for (i, slot) in shared.after.iter().enumerate().skip(1) {
            let (addr, len) = after.get(i).copied().unwrap_or((0, 0));
            slot.0[0].store(addr, Ordering::Relaxed);
            slot.0[1].store(len, Ordering::Relaxed);
        }
        // SeqCst pairs with the worker's `sleepers` increment then epoch re-check (no lost wakeup).
        shared.epoch.0.store(e, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _g = lock(&shared.wake_lock);
            shared.wake.notify_all();
        }

        IN_REGION.with(|c| c.set(true));
        let own = panic::catch_unwind(AssertUnwindSafe(|| f(0, n)));
        // Claim the indices no worker has started yet: run them, or just cancel them when we
        // are going to re-raise our own panic anyway.
        let mut stolen_panic = None;
        for index in 1..n {
            if shared.claims[index].0.fetch_max(e, Ordering::AcqRel) < e {
                if own.is_ok() && stolen_panic.is_none() {
                    stolen_panic = panic::catch_unwind(AssertUnwindSafe(|| f(index, n))).err();
                }
                shared.remaining.0.fetch_sub(1, Ordering::Relaxed);
            }
        }
        IN_REGION.with(|c| c.set(false));

        // Wait for the tasks the workers claimed: spin, then park.
        let finished = || shared.remaining.0.load(Ordering::Acquire) == 0;
        if !spin_until(finished) {
            let mut g = lock(&shared.done_lock);
            shared.caller_sleeping.store(true, Ordering::SeqCst);
            while shared.remaining.0.load(Ordering::SeqCst) != 0 {
                g = shared.done.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            shared.caller_sleeping.store(false, Ordering::Relaxed);
        }

        let worker_panic = lock(&shared.panic).take();
        drop(region);
        // The caller's own panic first, then one from a task it ran, then a worker's.
        if let Some(payload) = own.err().or(stolen_panic).or(worker_panic) {
            panic::resume_unwind(payload);
        }
    }

    /// Splits `0..n` into contiguous chunks of at least `min_chunk` items (so tiny ops are not
    /// split) and runs `f(chunk)` exactly once per chunk across the threads. Chunks are handed out
    /// dynamically (up to a few per thread) to balance load; `n == 0` calls nothing.
    pub fn for_range<F: Fn(Range<usize>) + Sync>(&self, n: usize, min_chunk: usize, f: F) {
        self.for_range_with(n, min_chunk, CHUNKS_PER_THREAD, f);
    }

    /// [`Self::for_range`] with up to `per_thread` chunks a thread (at least one).
    pub fn for_range_with<F: Fn(Range<usize>) + Sync>(
        &self,
        n: usize,
        min_chunk: usize,
        per_thread: usize,
        f: F,
    ) {
        if n == 0 {
            return;
        }
        let max_chunks = (n / min_chunk.max(1)).max(1);
        let threads = self.shared.n_threads;
        if max_chunks == 1 || threads == 1 {
            f(0..n);
            return;
        }
        let chunks = max_chunks.min(threads * per_thread.max(1));
        let (base, extra) = (n / chunks, n % chunks);
        let chunk_range = |c: usize| {
            let start = c * base + c.min(extra);
            start..start + base + usize::from(c < extra)
        };
        if chunks <= threads {
            // One chunk per thread at most: no need to hand out work dynamically.
            self.broadcast(|t, _| {
                if t < chunks {
                    f(chunk_range(t));
                }
            });
            return;
        }
        let next = AtomicUsize::new(0);
        self.broadcast(|_, _| loop {
            let c = next.fetch_add(1, Ordering::Relaxed);
            if c >= chunks {
                break;
            }
            f(chunk_range(c));
        });
    }
}

fn worker_loop(shared: &Shared, index: usize) {
    IN_REGION.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        let changed = || shared.epoch.0.load(Ordering::Acquire) != seen;
        if !spin_until(changed) {
            let mut g = lock(&shared.wake_lock);
            shared.sleepers.fetch_add(1, Ordering::SeqCst);
            while shared.epoch.0.load(Ordering::SeqCst) == seen {
                g = shared.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            shared.sleepers.fetch_sub(1, Ordering::Relaxed);
        }
        let e = shared.epoch.0.load(Ordering::Acquire);
        seen = e;
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        #[cfg(test)]
        while shared.hold.load(Ordering::Acquire) {
            std::thread::yield_now();
        }
        if shared.claims[index].0.fetch_max(e, Ordering::AcqRel) >= e {
            // The caller already ran (or cancelled) this index: region `e` is or may be over.
            continue;
        }
        // SAFETY: we won the claim for region `e`, so `e` is still in flight (the dispatcher
        // cannot finish it with our index unclaimed) and the job slot holds its job, written
        // before the epoch store we acquired; it is not rewritten before we decrement
        // `remaining` below.
        let job = unsafe { *shared.job.get() };
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: `job.data` points to the `F` of the running `broadcast`, which keeps it
            // alive until `remaining` reaches 0, which cannot happen before this call returns.
            unsafe { (job.call)(job.data, index, shared.n_threads) }
        }));
        if let Err(payload) = result {
            let mut slot = lock(&shared.panic);
            if slot.is_none() {
                *slot = Some(payload);
            }
        }
        // Read before counting the task done: the region's dispatcher rewrites them after.
        let after = &shared.after[index].0;
        let (addr, len) = (
            after[0].load(Ordering::Relaxed),
            after[1].load(Ordering::Relaxed),
        );
        // SeqCst pairs with the caller's `caller_sleeping` store then `remaining` re-check.
        if shared.remaining.0.fetch_sub(1, Ordering::SeqCst) == 1
            && shared.caller_sleeping.load(Ordering::SeqCst)
        {
            let _g = lock(&shared.done_lock);
            shared.done.notify_one();
        }
        prefetch_l2(addr, len, || shared.epoch.0.load(Ordering::Relaxed) == e);
    }
}

/// Prefetches the `len` bytes from `addr` into L2, 64 bytes at a time, while `idle()` holds
/// (checked every 2 KiB).
fn prefetch_l2(addr: usize, len: usize, idle: impl Fn() -> bool) {
    for (k, at) in (addr..addr.saturating_add(len)).step_by(64).enumerate() {
        if k % 32 == 0 && !idle() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint with no architectural effect; it never faults, whatever
        // the address.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            _mm_prefetch::<_MM_HINT_T1>(at as *const i8);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = at;
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let shared = &*self.shared;
        shared.shutdown.store(true, Ordering::Release);
        shared.epoch.0.fetch_add(1, Ordering::SeqCst);
        {
            let _g = lock(&shared.wake_lock);
            shared.wake.notify_all();
        }
        for worker in self.workers.drain(..) {
            // Worker panics are caught inside the loop, so a join error cannot carry one of ours.
            let _ = worker.join();
        }
    }
}

/// Parses a CPU list such as `0-3,8,10-11`.
fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<usize>(), b.trim().parse::<usize>()) {
                    cpus.extend(a..=b);
                }
            }
            None => {
                if let Ok(c) = part.trim().parse() {
                    cpus.push(c);
                }
            }
        }
    }
    cpus
}

/// Physical cores in the CPUs this process may run on (hyper-threads counted once).
fn physical_cores_linux() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(parse_cpu_list)?;
    let mut cores: Vec<(u32, u32)> = Vec::new();
    for cpu in allowed {
        let topo = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let read = |f: &str| -> Option<u32> {
            std::fs::read_to_string(format!("{topo}/{f}"))
                .ok()?
                .trim()
                .parse()
                .ok()
        };
        // Offline CPUs have no topology directory: skip them.
        if let (Some(core), Some(pkg)) = (read("core_id"), read("physical_package_id")) {
            cores.push((pkg, core));
        }
    }
    cores.sort_unstable();
    cores.dedup();
    (!cores.is_empty()).then_some(cores.len())
}

/// Physical cores available to this process: distinct `(package, core)` pairs of the allowed
/// CPUs on Linux, capped by [`std::thread::available_parallelism`] (which also honours cgroup
/// quotas); elsewhere, or if sysfs is unreadable, just `available_parallelism`. At least 1.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    physical_cores_linux()
        .map_or(logical, |p| p.min(logical))
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected_sum(n: usize) -> u64 {
        (0..n as u64).map(|i| i * i + 1).sum()
    }

    #[test]
    fn for_range_sums_are_exact() {
        for threads in 1..=4 {
            let pool = ThreadPool::new(threads);
            assert_eq!(pool.n_threads(), threads);
            for n in [0, 1, 2, 3, 4, 5, 7, 16, 63, 64, 65, 1000, 4097] {
                for min_chunk in [0, 1, 3, 16, 100, 10_000] {
                    let sum = AtomicU64::new(0);
                    let items = AtomicUsize::new(0);
                    let calls = AtomicUsize::new(0);
                    pool.for_range(n, min_chunk, |r| {
                        assert!(r.start < r.end && r.end <= n, "bad chunk {r:?} for n={n}");
                        if n >= min_chunk.max(1) {
                            assert!(r.len() >= min_chunk, "chunk {r:?} under {min_chunk}");
                        }
                        calls.fetch_add(1, Ordering::Relaxed);
                        items.fetch_add(r.len(), Ordering::Relaxed);
                        let s: u64 = r.map(|i| (i * i + 1) as u64).sum();
                        sum.fetch_add(s, Ordering::Relaxed);
                    });
                    assert_eq!(sum.into_inner(), expected_sum(n), "t={threads} n={n}");
                    assert_eq!(items.into_inner(), n, "t={threads} n={n}");
                    let calls = calls.into_inner();
                    if n == 0 {
                        assert_eq!(calls, 0);
                    } else if min_chunk > n {
                        assert_eq!(calls, 1, "min_chunk > n must not split");
                    }
                }
            }
        }
    }

    #[test]
    fn for_range_chunks_are_disjoint_and_cover() {
        let pool = ThreadPool::new(3);
        let n = 1001;
        let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool.for_range(n, 7, |r| {
            for i in r {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn broadcast_runs_every_index_once_with_borrowed_state() {
        for threads in 1..=4 {
            let pool = ThreadPool::new(threads);
            let seen: Vec<AtomicUsize> = (0..threads).map(|_| AtomicUsize::new(0)).collect();
            let local = vec![10usize; threads]; // borrowed from this stack frame
            for _ in 0..50 {
                pool.broadcast(|i, n| {
                    assert_eq!(n, threads);
                    seen[i].fetch_add(local[i], Ordering::Relaxed);
                });
            }
            let counts: Vec<usize> = seen.iter().map(|s| s.load(Ordering::Relaxed)).collect();
            assert_eq!(counts, vec![500; threads]);
        }
    }

    #[test]
    fn many_broadcasts_do_not_deadlock() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        let rounds = 20_000;
        for r in 0..rounds {
            pool.broadcast(|i, _| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
            if r % 5000 == 0 {
                // Let the workers go past the spin window and park, then wake them again.
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        assert_eq!(total.into_inner(), rounds * 3);
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = ThreadPool::new(4);
        for _ in 0..5 {
            std::thread::sleep(SPIN * 4);
            let sum = AtomicUsize::new(0);
            pool.broadcast(|i, _| {
                sum.fetch_add(i, Ordering::Relaxed);
            });
            assert_eq!(sum.into_inner(), 1 + 2 + 3);
        }
    }

    #[test]
    fn worker_panic_propagates_and_pool_survives() {
        let pool = ThreadPool::new(3);
        let r = panic::catch_unwind(AssertUnwindSafe(|| {
            pool.broadcast(|i, _| {
                if i == 2 {
                    panic!("boom in worker");
                }
            })
        }));
        let payload = r.expect_err("worker panic must reach the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"boom in worker"));
        // The pool still works afterwards.
        let sum = AtomicUsize::new(0);
        pool.for_range(100, 1, |r| {
            sum.fetch_add(r.sum::<usize>(), Ordering::Relaxed);
        });
        assert_eq!(sum.into_inner(), 4950);
    }

    #[test]
    fn caller_panic_propagates_after_workers_finish() {
        let pool = ThreadPool::new(2);
        let started = AtomicUsize::new(0);
        let finished = AtomicUsize::new(0);
        let r = panic::catch_unwind(AssertUnwindSafe(|| {
            pool.broadcast(|i, _| {
                if i == 0 {
                    // Make sure the worker has claimed its task before we panic.
                    while started.load(Ordering::SeqCst) == 0 {
                        std::hint::spin_loop();
                    }
                    panic!("boom in caller");
                }
                started.store(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(5));
                finished.fetch_add(1, Ordering::SeqCst);
            })
        }));
        assert_eq!(
            r.unwrap_err().downcast_ref::<&str>(),
            Some(&"boom in caller")
        );
        // broadcast must not have unwound before the worker finished with the closure.
        assert_eq!(finished.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn every_index_runs_exactly_once_under_stealing() {
        let pool = ThreadPool::new(3);
        let counts: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
        let rounds = 5000;
        for r in 0..rounds {
            if r % 1000 == 0 {
                std::thread::sleep(SPIN * 4);
            }
            pool.broadcast(|i, _| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        let counts: Vec<usize> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        assert_eq!(counts, vec![rounds; 3]);
    }

    #[test]
    fn caller_runs_the_index_of_a_late_worker() {
        let pool = ThreadPool::new(2);
        let caller = std::thread::current().id();
        // Hold the worker back before it claims, so it is late in every region (without the
        // hold, whether it is late depends on the scheduler).
        pool.shared.hold.store(true, Ordering::Release);
        // If the caller waited for the held worker instead, a watchdog releases it after a
        // while, so the test fails below rather than hanging.
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let start = Instant::now();
                while !done.load(Ordering::Acquire) && start.elapsed() < Duration::from_secs(5) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                pool.shared.hold.store(false, Ordering::Release);
            });
            caller_runs_every_held_index(&pool, caller);
            done.store(true, Ordering::Release);
        });
        // Released, the worker skips the regions the caller ran and takes part again.
        let total = AtomicUsize::new(0);
        for _ in 0..100 {
            pool.broadcast(|i, _| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
        }
        assert_eq!(total.into_inner(), 300);
    }

    fn caller_runs_every_held_index(pool: &ThreadPool, caller: std::thread::ThreadId) {
        for round in 0..20 {
            if round % 4 == 0 {
                // Let the worker park too: the caller must not wait for it to wake.
                std::thread::sleep(SPIN * 4);
            }
            let ran_on = Mutex::new(Vec::new());
            pool.broadcast(|i, _| lock(&ran_on).push((i, std::thread::current().id())));
            let mut ran_on = ran_on.into_inner().unwrap();
            ran_on.sort_by_key(|&(i, _)| i);
            assert_eq!(ran_on, vec![(0, caller), (1, caller)], "round {round}");
        }
    }

    /// A worker's prefetch after its task stops when the next region is dispatched: with a
    /// length no prefetch could finish, the worker still takes part in later regions, and every
    /// region's result is right.
    #[test]
    fn prefetch_after_a_task_yields_to_the_next_region() {
        let pool = ThreadPool::new(2);
        let caller = std::thread::current().id();
        let huge = [(0, 0), (4096, usize::MAX / 2)];
        let buf = vec![0u8; 1 << 20];
        let near = [(0, 0), (buf.as_ptr() as usize, buf.len())];
        let mut worker_ran = false;
        for round in 0..500 {
            let total = AtomicUsize::new(0);
            let after = if round % 2 == 0 { &huge } else { &near };
            let on_worker = AtomicBool::new(false);
            pool.broadcast_then_prefetch(
                |i, _| {
                    total.fetch_add(i + 1, Ordering::Relaxed);
                    if i == 0 {
                        // Give a worker that is not stuck time to claim its index.
                        let t0 = Instant::now();
                        while t0.elapsed() < Duration::from_micros(200) {
                            std::hint::spin_loop();
                        }
                    } else if std::thread::current().id() != caller {
                        on_worker.store(true, Ordering::Relaxed);
                    }
                },
                after,
            );
            assert_eq!(total.into_inner(), 3, "round {round}");
            worker_ran |= on_worker.into_inner() && round > 0;
            if worker_ran && round > 20 {
                break;
            }
        }
        assert!(
            worker_ran,
            "the worker never ran a task after a huge prefetch"
        );
    }

    #[test]
    fn nested_broadcast_runs_inline() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        pool.broadcast(|_, _| {
            pool.for_range(10, 1, |r| {
                total.fetch_add(r.len(), Ordering::Relaxed);
            });
        });
        assert_eq!(total.into_inner(), 20);
    }

    #[test]
    fn concurrent_callers_are_serialised() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    for _ in 0..500 {
                        pool.broadcast(|i, _| {
                            total.fetch_add(i + 1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.into_inner(), 2 * 500 * 3);
    }

    #[test]
    fn cpu_list_parsing_and_core_count() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list("5"), vec![5]);
        assert!(parse_cpu_list("").is_empty());
        let cores = physical_cores();
        let logical = std::thread::available_parallelism().unwrap().get();
        assert!(cores >= 1 && cores <= logical, "{cores} vs {logical}");
    }
}
