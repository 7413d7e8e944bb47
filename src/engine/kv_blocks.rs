//! KV block bookkeeping: a fixed pool of physical blocks, each holding `block_size` positions of every
//! layer's K and V, handed out to sequences through block tables. Invariant: a block is either on the
//! free list or owned by exactly one sequence; `can_allocate` is checked before `allocate`.

use anyhow::{bail, Result};

pub struct BlockManager {
    block_size: usize,
    n_blocks: usize,
    free: Vec<u32>,
}

impl BlockManager {
    pub fn new(n_blocks: usize, block_size: usize) -> BlockManager {
        assert!(block_size > 0, "block size must be positive");
        BlockManager {
            block_size,
            n_blocks,
            // pop() hands out low block ids first
            free: (0..n_blocks as u32).rev().collect(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.n_blocks
    }

    pub fn n_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks needed to hold `n_positions` positions.
    pub fn blocks_for(&self, n_positions: usize) -> usize {
        n_positions.div_ceil(self.block_size)
    }

    pub fn can_allocate(&self, n: usize) -> bool {
        self.free.len() >= n
    }

    /// Grows `table` so it covers `n_positions` positions.
    pub fn allocate(&mut self, table: &mut Vec<u32>, n_positions: usize) -> Result<()> {
        let need = self.blocks_for(n_positions).saturating_sub(table.len());
        if !self.can_allocate(need) {
            bail!(
                "KV cache is full: {} more blocks of {} positions needed, {} free (raise --ctx)",
                need,
                self.block_size,
                self.free.len()
            );
        }
        for _ in 0..need {
            table.push(self.free.pop().expect("checked by can_allocate"));
        }
        Ok(())
    }

    /// Shrinks `table` to cover `n_positions` positions, returning the rest to the free list.
    pub fn truncate(&mut self, table: &mut Vec<u32>, n_positions: usize) {
        let keep = self.blocks_for(n_positions);
        while table.len() > keep {
            self.free.push(table.pop().expect("len > keep"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_truncate_round_trip() {
        let mut m = BlockManager::new(4, 16);
        let mut t = Vec::new();
        m.allocate(&mut t, 17).unwrap();
        assert_eq!(t, vec![0, 1]);
        assert_eq!(m.n_free(), 2);
        m.allocate(&mut t, 32).unwrap(); // already covered
        assert_eq!(t.len(), 2);
        assert!(m.allocate(&mut t, 16 * 5).is_err());
        assert_eq!(t.len(), 2, "a failed allocation takes nothing");
        m.truncate(&mut t, 16);
        assert_eq!(t, vec![0]);
        assert_eq!(m.n_free(), 3);
        m.truncate(&mut t, 0);
        assert!(t.is_empty() && m.n_free() == 4);
    }
}
