//! Memory read bandwidth of this machine, measured the way decode reads weights: every thread of the
//! pool streams its share of a buffer much larger than the caches once. The figure is the roofline that
//! `infer bench` holds decode speed against.

use std::time::Instant;

use crate::kernels::cpu::pool::ThreadPool;

/// A buffer for bandwidth runs (`bytes` rounded down to whole 64-byte lines), touched once so its pages
/// are resident.
pub struct BandwidthBuffer {
    data: Vec<u64>,
}

impl BandwidthBuffer {
    pub fn new(bytes: usize) -> BandwidthBuffer {
        let n = (bytes / 64).max(1) * 8;
        BandwidthBuffer {
            data: (0..n as u64).collect(),
        }
    }

    pub fn bytes(&self) -> usize {
        self.data.len() * 8
    }

    /// Reads the whole buffer once across the pool; returns bytes per second.
    pub fn read_once(&self, pool: &ThreadPool) -> f64 {
        let data = &self.data;
        let sums: Vec<std::sync::atomic::AtomicU64> = (0..pool.n_threads())
            .map(|_| std::sync::atomic::AtomicU64::new(0))
            .collect();
        let t0 = Instant::now();
        pool.broadcast(|i, n| {
            let chunk = data.len().div_ceil(n);
            let lo = (i * chunk).min(data.len());
            let hi = ((i + 1) * chunk).min(data.len());
            // eight independent accumulators let the compiler keep several loads in flight
            let mut acc = [0u64; 8];
            for line in data[lo..hi].chunks_exact(8) {
                for (a, &v) in acc.iter_mut().zip(line) {
                    *a = a.wrapping_add(v);
                }
            }
            let s = acc.iter().fold(0u64, |x, &y| x.wrapping_add(y));
            sums[i].store(s, std::sync::atomic::Ordering::Relaxed);
        });
        let secs = t0.elapsed().as_secs_f64();
        std::hint::black_box(&sums);
        self.bytes() as f64 / secs
    }
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
}
