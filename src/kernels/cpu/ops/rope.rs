//! RoPE's cos/sin tables, kept between calls. A forward pass rotates Q and K of every layer at the
//! same positions with, per model, one or two bases, so the table for a (positions, base, head
//! size, frequency factors) key is computed once and reused by every later call with that key
//! (the next layers, and K after Q) instead of `head_dim` `cos`/`sin` per position and call.
//!
//! Invariant: a table holds exactly what `ops::rope_cache` / `ops::rope_cache_scaled` return for
//! its key, so a cached rotation is bit-identical to an uncached one.

use std::sync::{Arc, Mutex};

use crate::kernels::cpu::ops;
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::kernels::cpu::SharedMut;

/// Tables kept at once: enough for models that alternate bases across layers (Gemma-3's local
/// and global layers) and for Q/K at different positions in one pass.
const ENTRIES: usize = 4;

/// The tables last used, most recent first.
#[derive(Default)]
pub struct RopeTables {
    entries: Mutex<Vec<Entry>>,
}

struct Entry {
    positions: Vec<u32>,
    base: u32,
    head_dim: usize,
    factors: Option<Vec<f32>>,
    /// (positions.len(), head_dim): row i is `rope_cache(positions[i], ..)`.
    table: Arc<Vec<f32>>,
}

impl Entry {
    fn matches(&self, positions: &[u32], base: f32, head_dim: usize, ff: Option<&[f32]>) -> bool {
        self.base == base.to_bits()
            && self.head_dim == head_dim
            && self.factors.as_deref() == ff
            && self.positions == positions
    }
}

impl RopeTables {
    /// The (positions.len(), head_dim) cos/sin table for these positions, computed (rows split
    /// across `pool`) unless a recent call asked for the same one.
    pub fn get(
        &self,
        pool: &ThreadPool,
        positions: &[u32],
        base: f32,
        head_dim: usize,
        ff: Option<&[f32]>,
    ) -> Arc<Vec<f32>> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = entries
            .iter()
            .position(|e| e.matches(positions, base, head_dim, ff))
        {
            let e = entries.remove(i);
            let table = Arc::clone(&e.table);
            entries.insert(0, e);
            return table;
        }
        let mut table = vec![0f32; positions.len() * head_dim];
        let dst = SharedMut(table.as_mut_ptr());
        let min_rows = if positions.len() >= 64 {
            16
        } else {
            positions.len()
        };
        pool.for_range(positions.len(), min_rows.max(1), |range| {
            for i in range {
                // SAFETY: row i (head_dim values from i * head_dim) lies inside `table` and
                // belongs to this chunk only; the pool joins before `table` is read.
                let row = unsafe {
                    std::slice::from_raw_parts_mut(dst.ptr().add(i * head_dim), head_dim)
                };
                match ff {
                    Some(ff) => ops::rope_cache_scaled(positions[i], base, head_dim, ff, row),
                    None => ops::rope_cache(positions[i], base, head_dim, row),
                }
            }
        });
        let table = Arc::new(table);
        entries.truncate(ENTRIES - 1);
        entries.insert(
            0,
            Entry {
                positions: positions.to_vec(),
                base: base.to_bits(),
                head_dim,
                factors: ff.map(<[f32]>::to_vec),
                table: Arc::clone(&table),
            },
        );
        table
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tables_equal_fresh_ones_for_every_key() {
        let pool = ThreadPool::new(2);
        let tables = RopeTables::default();
        let ff: Vec<f32> = (0..32).map(|i| 1.0 + i as f32 / 8.0).collect();
        let positions: Vec<Vec<u32>> = vec![vec![7], (0..100).collect(), vec![3, 900, 12]];
        // Two rounds over more keys than the cache keeps: hits and evictions both.
        for _ in 0..2 {
            for pos in &positions {
                for (base, ff) in [(10_000.0, None), (1e6, None), (5e5, Some(&ff[..]))] {
                    let t = tables.get(&pool, pos, base, 64, ff);
                    for (i, &p) in pos.iter().enumerate() {
                        let mut want = vec![0f32; 64];
                        match ff {
                            Some(ff) => ops::rope_cache_scaled(p, base, 64, ff, &mut want),
                            None => ops::rope_cache(p, base, 64, &mut want),
                        }
                        assert_eq!(&t[i * 64..(i + 1) * 64], &want[..], "pos {p} base {base}");
                    }
                }
            }
        }
    }
}
