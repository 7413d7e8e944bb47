//! Which decode region comes next. A decode step dispatches its matmul regions in the same order
//! every step, so the region that followed this one last time is the one that will follow it
//! now; its worker's first weight bytes can be prefetched by that worker while the caller does
//! the serial work in between ([`ThreadPool::broadcast_then_prefetch`]).
//!
//! Invariant: a guess only picks bytes to prefetch, never what is computed, so a wrong one (the
//! first step, a changed order, two models decoding on one thread) costs bandwidth, not results.
//!
//! [`ThreadPool::broadcast_then_prefetch`]: crate::kernels::cpu::threads::pool::ThreadPool::broadcast_then_prefetch

use std::cell::RefCell;

/// An address and a length in bytes.
pub(crate) type Span = (usize, usize);

/// Threads whose starts are kept (a fixed array, so recording allocates nothing); the threads of
/// a larger pool past these prefetch nothing.
pub(crate) const THREADS: usize = 8;

/// Each thread's start, by thread index (length 0 past the pool's threads).
pub(crate) type Starts = [Span; THREADS];

/// How many of its first bytes a worker prefetches of the next region (at most; the prefetch
/// stops when the next region starts). Qwen2.5-1.5B's decode step, alternated step by step in one
/// process against no prefetch in a first version (paired ratios; the high bandwidth state, then
/// the low): 64 KiB 1.003/1.003, 192 KiB 1.005/0.998, 512 KiB 1.010/1.005, 768 KiB 1.007/1.007,
/// 1 MiB 1.006/1.005. This one, at 512 KiB: Qwen 1.006-1.008 (three runs of 636-838 pairs) and
/// 1.004-1.007 (three of 162-900), Gemma-3 270M 1.010-1.021 (four runs of 495-898) and 1.007 (92
/// pairs). With the starts in a vector per region instead of this array (two allocations a
/// region) it did the same for Qwen and 0.978-1.011 for Gemma.
pub(crate) const NEXT_BYTES: usize = 512 << 10;

/// Slots of a [`Chain`]'s table: a direct-mapped pair per hash, far more than the regions of a
/// step (Qwen2.5-1.5B: 113).
const SLOTS: usize = 1024;

/// What a region learned about the one that followed it.
#[derive(Clone, Copy, Default)]
struct Entry {
    key: usize,
    /// The key of the region that followed it last time (0: none yet).
    next_key: usize,
    /// What each thread of that region read first.
    next: Starts,
}

/// The regions seen on one thread: each one's successor's worker starts. A table the recorder
/// indexes by hash, not a `HashMap`: between two decode regions every lookup's lines come cold
/// from memory (a step streams the weights through the caches in between), and the map's two
/// hashed lookups took about 0.5 µs of each gap. Each entry also names its successor, whose
/// entry is requested at once, so the next region's lookup finds it in cache.
#[derive(Default)]
pub(crate) struct Chain {
    /// `SLOTS` entries once a region is recorded; key `k` lives in slot `slot(k)` or the other
    /// one of its pair (a third key of a pair evicts one: a lost guess costs a prefetch).
    table: Vec<Entry>,
    /// The last region recorded.
    last: Option<usize>,
}

/// The first slot of `key`'s pair.
fn slot(key: usize) -> usize {
    ((key as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as usize & (SLOTS - 2)
}

impl Chain {
    /// The index of `key`'s entry, if it has one.
    fn find(&self, key: usize) -> Option<usize> {
        let s = slot(key);
        [s, s + 1].into_iter().find(|&i| self.table[i].key == key)
    }

    /// Records region `key`, whose thread `t` reads `starts[t]` first; returns what each thread
    /// of the region that followed `key` last time read first (all empty if none did yet).
    pub(crate) fn record(&mut self, key: usize, starts: Starts) -> Starts {
        if self.table.is_empty() {
            self.table = vec![Entry::default(); SLOTS];
        }
        if let Some(prev) = self.last.replace(key) {
            let i = self.find(prev).unwrap_or_else(|| {
                // A new key takes the emptier slot of its pair (the second on a tie of two).
                let s = slot(prev);
                if self.table[s].key == 0 {
                    s
                } else {
                    s + 1
                }
            });
            self.table[i] = Entry {
                key: prev,
                next_key: key,
                next: starts,
            };
        }
        let Some(i) = self.find(key) else {
            return Starts::default();
        };
        let e = self.table[i];
        if e.next_key != 0 {
            // Both slots of the successor's pair: its lookup reads them.
            let s = slot(e.next_key);
            crate::kernels::cpu::prefetch_l1(&self.table[s..s + 2]);
        }
        e.next
    }
}

thread_local! {
    /// The decode regions dispatched from this thread.
    static CHAIN: RefCell<Chain> = RefCell::new(Chain::default());
}

/// [`Chain::record`] on this thread's chain. `key` names the region (its first weight's address),
/// `starts[t]` is where thread `t` starts reading (at most [`NEXT_BYTES`] of each are kept).
pub(crate) fn record(key: usize, starts: impl Iterator<Item = Span>) -> Starts {
    let mut kept = Starts::default();
    for (k, (addr, len)) in kept.iter_mut().zip(starts) {
        *k = (addr, len.min(NEXT_BYTES));
    }
    CHAIN.with_borrow_mut(|c| c.record(key, kept))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_region_learns_its_successor_from_the_step_before() {
        let mut c = Chain::default();
        let s = |k: usize| {
            let mut s = Starts::default();
            s[1] = (k * 10, k);
            s
        };
        // First step: nothing is known yet.
        for k in [10, 20, 30] {
            assert_eq!(c.record(k, s(k)), Starts::default());
        }
        // Next step: each region gets the starts of the one after it; the last one (the head)
        // gets the first region's, as the next step begins with it.
        assert_eq!(c.record(10, s(10)), s(20));
        assert_eq!(c.record(20, s(20)), s(30));
        assert_eq!(c.record(30, s(30)), s(10));
        // An order change is learned at once.
        assert_eq!(c.record(10, s(10)), s(20));
        assert_eq!(c.record(30, s(30)), s(10));
        assert_eq!(c.record(10, s(10)), s(30));
    }
}
