//! Memory read bandwidth of this machine, measured the way decode reads weights: every thread of the
//! pool streams its share of a buffer much larger than the caches once. The figure is the roofline that
//! `infer bench` holds decode speed against. The buffer is a [`HugeBuf`], on 2 MiB pages where the
//! kernel grants them, as the repacked weights are: in a virtual machine 4 KiB pages read less
//! (10-25% on the development VM), and the roofline is what the machine can do at best. For the same
//! reason a read passes over the buffer twice, with two prefetch patterns, and keeps the faster: on
//! the development VM neither is best in both of its bandwidth states (a `prefetchnta` 8 KiB ahead
//! read 3-4% more than `T0` 2 KiB ahead at about 45 GB/s and 2.6% less at about 80).

use std::time::Instant;

use crate::kernels::cpu::memory::hugebuf::HugeBuf;
use crate::kernels::cpu::threads::pool::ThreadPool;

/// A buffer for bandwidth runs (`bytes` rounded down to whole 64-byte lines), touched once so its pages
/// are resident.
pub struct BandwidthBuffer {
    data: HugeBuf,
}

impl BandwidthBuffer {
    pub fn new(bytes: usize) -> BandwidthBuffer {
        let n = (bytes / 64).max(1) * 64;
        let mut data = HugeBuf::zeroed(n);
        // Distinct words: pages of equal content could be merged by the host and then served
        // from a cache.
        for (i, w) in data.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(i as u64).to_le_bytes());
        }
        BandwidthBuffer { data }
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Reads the whole buffer across the pool once with each prefetch pattern (once in all where
    /// the plain loop reads, which has none); returns the faster pass's bytes per second.
    pub fn read_once(&self, pool: &ThreadPool) -> f64 {
        let patterns: &[Pattern] = if simd_read() {
            &[Pattern::Near, Pattern::FarNta]
        } else {
            &[Pattern::Near]
        };
        patterns
            .iter()
            .map(|&p| self.read_with(pool, p))
            .fold(0.0, f64::max)
    }

    fn read_with(&self, pool: &ThreadPool, pattern: Pattern) -> f64 {
        let data = &self.data;
        let sums: Vec<std::sync::atomic::AtomicU64> = (0..pool.n_threads())
            .map(|_| std::sync::atomic::AtomicU64::new(0))
            .collect();
        let t0 = Instant::now();
        pool.broadcast(|i, n| {
            let chunk = (data.len() / 8).div_ceil(n) * 8;
            let lo = (i * chunk).min(data.len());
            let hi = ((i + 1) * chunk).min(data.len());
            let s = sum_words(&data[lo..hi], pattern);
            sums[i].store(s, std::sync::atomic::Ordering::Relaxed);
        });
        let secs = t0.elapsed().as_secs_f64();
        std::hint::black_box(&sums);
        self.bytes() as f64 / secs
    }
}

/// Whether reads take the SIMD loop (which prefetches), not the plain one.
fn simd_read() -> bool {
    cfg!(target_arch = "x86_64")
        && crate::kernels::cpu::simd::current() >= crate::kernels::cpu::simd::Level::Avx2
}

/// How a read prefetches ahead of its loads.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Pattern {
    /// `T0` hints 2 KiB ahead.
    Near,
    /// Non-temporal (`prefetchnta`) hints 8 KiB ahead.
    FarNta,
}

/// The wrapping sum of `words`, read the way the decode kernels read weights: with the widest
/// loads the SIMD level has and software prefetches ahead (`pattern`), so the figure is what those
/// kernels can reach, not what a plain loop does.
fn sum_words(words: &[u8], pattern: Pattern) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if simd_read() {
        // SAFETY: the AVX2 level (or higher) is selected only after AVX2 was detected; the
        // kernel reads `words` only (prefetches past its end are hints and never fault).
        return unsafe { sum_words_avx2(words, pattern) };
    }
    let _ = pattern;
    // Eight independent accumulators let the compiler keep several loads in flight.
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("eight bytes"));
    let mut acc = [0u64; 8];
    let lines = words.chunks_exact(64);
    let tail = lines.remainder();
    for line in lines {
        for (a, v) in acc.iter_mut().zip(line.chunks_exact(8)) {
            *a = a.wrapping_add(word(v));
        }
    }
    tail.chunks_exact(8)
        .map(word)
        .chain(acc)
        .fold(0u64, |x, y| x.wrapping_add(y))
}

/// [`sum_words`] with 256-bit loads, four lines per step and `pattern`'s prefetches.
///
/// # Safety
/// AVX2 is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_words_avx2(words: &[u8], pattern: Pattern) -> u64 {
    use std::arch::x86_64::*;
    let p = words.as_ptr();
    let steps = words.len() / 256; // 256 bytes a step
    let mut acc = [_mm256_setzero_si256(); 8];
    for k in 0..steps {
        let at = p.add(256 * k);
        for l in 0..4 {
            match pattern {
                Pattern::Near => _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(2048 + 64 * l).cast()),
                Pattern::FarNta => {
                    _mm_prefetch::<_MM_HINT_NTA>(at.wrapping_add(8192 + 64 * l).cast())
                }
            }
        }
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_add_epi64(*a, _mm256_loadu_si256(at.add(32 * j).cast()));
        }
    }
    let mut lanes = [0u64; 4];
    let total = acc
        .iter()
        .fold(_mm256_setzero_si256(), |x, &y| _mm256_add_epi64(x, y));
    _mm256_storeu_si256(lanes.as_mut_ptr().cast(), total);
    words[steps * 256..]
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("eight bytes")))
        .chain(lanes)
        .fold(0u64, |x, y| x.wrapping_add(y))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_is_positive_and_buffer_rounded() {
        let b = BandwidthBuffer::new(1 << 20);
        assert_eq!(b.bytes(), 1 << 20);
        let pool = ThreadPool::new(2);
        let bw = b.read_once(&pool);
        assert!(bw.is_finite() && bw > 0.0);
    }

    #[test]
    fn simd_sum_equals_plain_sum() {
        for n in [0usize, 7, 32, 100, 1000] {
            let w: Vec<u64> = (0..n as u64)
                .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
                .collect();
            let want = w.iter().fold(0u64, |x, &y| x.wrapping_add(y));
            let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            for p in [Pattern::Near, Pattern::FarNta] {
                assert_eq!(sum_words(&bytes, p), want, "n={n} {p:?}");
            }
        }
    }
}
