//! How a decode region's units of work are shared between the pool's threads: each thread owns
//! one contiguous range (a single stream for the prefetchers) and claims it front to back in
//! shrinking chunks; a thread done with its own range takes chunks from the back of another's.
//!
//! A thread's claims touch only its own range's word until another thread comes to take from it,
//! so in a balanced region no cache line crosses between cores; when one core streams slower
//! (on the development VM, a core whose chiplet is busy), the other takes over the end of its
//! range instead of waiting for it.
//!
//! Invariant: every unit of `0..cuts.last()` is handed out exactly once per region (each range's
//! `front..back` word only shrinks, by compare-and-swap), and no thread waits for another, so a
//! region stays correct when the pool's caller runs a late worker's index itself.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::kernels::cpu::matmul::STACK_THREADS;
use crate::kernels::cpu::threads::pool::Padded;

/// The unclaimed units `front..back` of one range, packed as `front << 32 | back`.
fn pack(front: usize, back: usize) -> u64 {
    ((front as u64) << 32) | back as u64
}

fn unpack(w: u64) -> (usize, usize) {
    ((w >> 32) as usize, (w & 0xffff_ffff) as usize)
}

/// Ranges a [`Split`] keeps inline, without allocating.
const INLINE: usize = STACK_THREADS;

/// The ranges of one region; see the module docs.
pub struct Split {
    /// Each range's unclaimed units, on its own cache lines: inline for up to [`INLINE`] ranges
    /// (an allocation aligned to a cache line pair took about a microsecond between two decode
    /// regions), in `heap` beyond.
    inline: [Padded<AtomicU64>; INLINE],
    heap: Vec<Padded<AtomicU64>>,
    n: usize,
    /// The smallest chunk a claim takes (unless less is left), so a chunk is long enough for
    /// its stream to be worth starting.
    min: usize,
}

impl Split {
    /// Thread `t` owns units `cuts[t]..cuts[t + 1]`; chunks are at least `min_chunk` units.
    pub fn new(cuts: &[usize], min_chunk: usize) -> Split {
        assert!(
            cuts.windows(2).all(|w| w[0] <= w[1]) && cuts.last() < Some(&(1 << 32)),
            "cuts ascend and fit 32 bits"
        );
        let word = |w: &[usize]| Padded(AtomicU64::new(pack(w[0], w[1])));
        let n = cuts.len().saturating_sub(1);
        let mut inline: [Padded<AtomicU64>; INLINE] = Default::default();
        let mut heap = Vec::new();
        if n <= INLINE {
            for (r, w) in inline.iter_mut().zip(cuts.windows(2)) {
                *r = word(w);
            }
        } else {
            heap = cuts.windows(2).map(word).collect();
        }
        Split {
            inline,
            heap,
            n,
            min: min_chunk.max(1),
        }
    }

    /// The ranges' words.
    fn ranges(&self) -> &[Padded<AtomicU64>] {
        if self.n <= INLINE {
            &self.inline[..self.n]
        } else {
            &self.heap
        }
    }

    /// Runs `f` on every chunk thread `t` gets: its own range's, in order, then chunks taken from
    /// the back of the other ranges. Returns when nothing is left that it may take.
    pub fn run(&self, t: usize, mut f: impl FnMut(Range<usize>)) {
        let n = self.ranges().len();
        if t >= n {
            return;
        }
        // Own range: a quarter of what is left at a time (at least `min`), so the chunk a slow
        // owner is stuck in shrinks as the other threads run out of work.
        while let Some(r) = self.claim(t, |left| (left / 4).max(self.min), true) {
            f(r);
        }
        for v in (1..n).map(|k| (t + k) % n) {
            // Half of what the owner has left, from the end it reaches last.
            while let Some(r) = self.claim(v, |left| (left / 2).max(self.min), false) {
                f(r);
            }
        }
    }

    /// Takes `size(left)` units (at most what is left) from the front or the back of range `r`.
    /// A thief takes nothing from a remainder shorter than `min`: its owner is about to.
    fn claim(&self, r: usize, size: impl Fn(usize) -> usize, front: bool) -> Option<Range<usize>> {
        let word = &self.ranges()[r].0;
        let mut cur = word.load(Ordering::Relaxed);
        loop {
            let (f, b) = unpack(cur);
            let left = b.saturating_sub(f);
            if left == 0 || (!front && left < self.min) {
                return None;
            }
            let take = size(left).min(left);
            let (next, got) = if front {
                (pack(f + take, b), f..f + take)
            } else {
                (pack(f, b - take), b - take..b)
            };
            match word.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(got),
                Err(now) => cur = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::threads::pool::ThreadPool;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    #[test]
    fn every_unit_once_and_owners_claim_in_order() {
        // One thread alone takes its own range front to back, then the others' from the back.
        let s = Split::new(&[0, 100, 103, 160], 8);
        let mut got = vec![];
        s.run(1, |r| got.push(r));
        assert_eq!(
            got[0],
            100..103,
            "the owner's range first, whole (less than min left)"
        );
        // Then range 2 (57 units: halves from the back, at least min) until fewer than min
        // are left for its owner, then range 0.
        assert_eq!(got[1..5], [132..160, 118..132, 110..118, 50..100]);
        let mut all: Vec<usize> = got.iter().flat_map(|r| r.clone()).collect();
        s.run(2, |r| all.extend(r));
        s.run(0, |r| all.extend(r));
        all.sort_unstable();
        assert_eq!(all, (0..160).collect::<Vec<_>>());
    }

    #[test]
    fn more_ranges_than_kept_inline_hand_out_each_unit_once() {
        let cuts: Vec<usize> = (0..=INLINE + 3).map(|t| t * 10).collect();
        let s = Split::new(&cuts, 3);
        let mut all = vec![];
        for t in (0..INLINE + 3).rev() {
            s.run(t, |r| all.extend(r));
        }
        all.sort_unstable();
        assert_eq!(all, (0..10 * (INLINE + 3)).collect::<Vec<_>>());
    }

    #[test]
    fn a_slow_owner_loses_the_end_of_its_range() {
        let s = Split::new(&[0, 64, 128], 4);
        let mut own = vec![];
        // Thread 1 claims one chunk, then stalls while thread 0 does everything else.
        let first = s.claim(1, |left| (left / 4).max(4), true).unwrap();
        assert_eq!(first, 64..80);
        s.run(0, |r| own.push(r));
        let mut rest = vec![];
        s.run(1, |r| rest.push(r));
        let mut all: Vec<usize> = own.iter().chain(&rest).flat_map(|r| r.clone()).collect();
        all.extend(first);
        all.sort_unstable();
        assert_eq!(all, (0..128).collect::<Vec<_>>());
        assert!(
            own.iter().any(|r| r.start >= 80),
            "thread 0 took from range 1: {own:?}"
        );
    }

    #[test]
    fn threads_racing_hand_out_each_unit_once() {
        let pool = ThreadPool::new(3);
        for round in 0..300 {
            let total = 1000 + round;
            let cuts = [0, total / 5, total * 3 / 5, total];
            let counts: Vec<AtomicUsize> = (0..total).map(|_| AtomicUsize::new(0)).collect();
            let s = Split::new(&cuts, 1 + round % 7);
            let chunks = Mutex::new(0usize);
            pool.broadcast(|t, _| {
                s.run(t, |r| {
                    *chunks.lock().unwrap() += 1;
                    r.for_each(|u| {
                        counts[u].fetch_add(1, Ordering::Relaxed);
                    })
                })
            });
            assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
            assert!(*chunks.lock().unwrap() >= 3);
        }
    }
}
