//! KV block bookkeeping and the prefix cache: a fixed pool of physical blocks, each holding
//! `block_size` positions of every layer's K and V, shared between sequences through block tables.
//!
//! Invariants:
//! - Every block is in exactly one state: *free* (on the free list, content meaningless),
//!   *referenced* (`refs > 0`: held by that many [`BlockTable`]s), or *cached* (`refs == 0` but its
//!   content is a full block registered under a chained hash, evictable least-recently-used).
//! - A block registered under a hash is never written again: a table that would write into a
//!   block that is shared (`refs > 1`) or registered copies it first ([`BlockTable::prepare_write`]
//!   says which; the runner copies the K/V).
//! - A table gives its references back when it is dropped or truncated; nothing else releases
//!   blocks, so no call site can leak one. [`BlockPool::check_whole`] verifies the books.
//!
//! The chained hash of full block `i` covers the block's token ids and block `i - 1`'s hash, so
//! equal hashes mean equal whole prefixes; the registered token ids are compared as well, so a
//! hash collision can never hand out another prefix's K/V.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{bail, Result};

/// The chained hash of a full block: its parent's hash and its token ids.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    // `DefaultHasher::new()` is the same hash for every instance of a process, which is all a
    // cache in memory needs.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// What a registered block holds, to confirm a hash match.
struct Entry {
    hash: u64,
    parent: Option<u64>,
    tokens: Vec<u32>,
}

/// Counters of the prefix cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prompt positions whose K/V were already cached (the prefix cache, or the sequence's own
    /// earlier turn).
    pub reused_tokens: u64,
    /// Prompt positions that had to be computed.
    pub computed_tokens: u64,
    /// Blocks taken back from the cache for new content.
    pub evicted_blocks: u64,
    /// Blocks copied before a write (copy-on-write).
    pub copied_blocks: u64,
}

struct State {
    block_size: usize,
    refs: Vec<u32>,
    free: Vec<u32>,
    /// Registered content per block (`None`: not registered).
    entry: Vec<Option<Entry>>,
    by_hash: HashMap<u64, u32>,
    /// Unreferenced registered blocks by the tick they were released at (oldest first).
    lru: BTreeMap<u64, u32>,
    /// The tick under which a block sits in `lru`.
    lru_tick: Vec<u64>,
    tick: u64,
    stats: CacheStats,
}

impl State {
    fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    /// A block for new content: a free one, else the least recently used cached one.
    fn take(&mut self) -> u32 {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.lru.pop_first().expect("checked by available()");
                let e = self.entry[b as usize]
                    .take()
                    .expect("cached blocks are registered");
                self.by_hash.remove(&e.hash);
                self.stats.evicted_blocks += 1;
                b
            }
        };
        self.refs[b as usize] = 1;
        b
    }

    fn incref(&mut self, b: u32) {
        if self.refs[b as usize] == 0 {
            let t = self.lru_tick[b as usize];
            self.lru.remove(&t);
        }
        self.refs[b as usize] += 1;
    }

    fn decref(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        assert!(*r > 0, "block {b} released more often than taken");
        *r -= 1;
        if *r == 0 {
            if self.entry[b as usize].is_some() {
                self.tick += 1;
                self.lru.insert(self.tick, b);
                self.lru_tick[b as usize] = self.tick;
            } else {
                self.free.push(b);
            }
        }
    }
}

/// The pool: a cheap handle, cloned into every table that holds its blocks.
#[derive(Clone)]
pub struct BlockPool(Arc<Mutex<State>>);

impl BlockPool {
    pub fn new(n_blocks: usize, block_size: usize) -> BlockPool {
        assert!(block_size > 0, "block size must be positive");
        BlockPool(Arc::new(Mutex::new(State {
            block_size,
            refs: vec![0; n_blocks],
            // pop() hands out low block ids first
            free: (0..n_blocks as u32).rev().collect(),
            entry: (0..n_blocks).map(|_| None).collect(),
            by_hash: HashMap::new(),
            lru: BTreeMap::new(),
            lru_tick: vec![0; n_blocks],
            tick: 0,
            stats: CacheStats::default(),
        })))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent books (every mutation is a few
        // infallible steps), so a poisoned lock is still usable.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn block_size(&self) -> usize {
        self.lock().block_size
    }

    pub fn n_blocks(&self) -> usize {
        self.lock().refs.len()
    }

    /// Blocks that can be handed out now (free plus evictable cached ones).
    pub fn n_available(&self) -> usize {
        self.lock().available()
    }

    /// Blocks held by some table.
    pub fn n_referenced(&self) -> usize {
        self.lock().refs.iter().filter(|&&r| r > 0).count()
    }

    /// Blocks kept for the prefix cache without an owner.
    pub fn n_cached_idle(&self) -> usize {
        self.lock().lru.len()
    }

    pub fn stats(&self) -> CacheStats {
        self.lock().stats
    }

    /// Counts a prompt: `reused` positions found cached, `computed` to compute.
    pub fn count(&self, reused: usize, computed: usize) {
        let mut s = self.lock();
        s.stats.reused_tokens += reused as u64;
        s.stats.computed_tokens += computed as u64;
    }

    /// Blocks needed to hold `n_positions` positions.
    pub fn blocks_for(&self, n_positions: usize) -> usize {
        n_positions.div_ceil(self.block_size())
    }

    pub fn can_allocate(&self, n: usize) -> bool {
        self.lock().available() >= n
    }

    /// A new, empty table on this pool.
    pub fn table(&self) -> BlockTable {
        BlockTable {
            pool: Some(self.clone()),
            blocks: Vec::new(),
            hashes: Vec::new(),
        }
    }

    fn same(&self, other: &BlockPool) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Checks the books: every block is in exactly one state, the cache maps agree, and (with
    /// `idle`) no block is referenced. Returns what is wrong.
    pub fn check_whole(&self, idle: bool) -> std::result::Result<(), String> {
        let s = self.lock();
        let n = s.refs.len();
        let mut seen = vec![0u8; n];
        for &b in &s.free {
            seen[b as usize] += 1;
            if s.refs[b as usize] != 0 || s.entry[b as usize].is_some() {
                return Err(format!("free block {b} is referenced or registered"));
            }
        }
        for &b in s.lru.values() {
            seen[b as usize] += 1;
            if s.refs[b as usize] != 0 || s.entry[b as usize].is_none() {
                return Err(format!("cached block {b} is referenced or unregistered"));
            }
        }
        for (b, seen) in seen.iter_mut().enumerate() {
            if s.refs[b] > 0 {
                *seen += 1;
            }
            if *seen != 1 {
                return Err(format!("block {b} is in {seen} states"));
            }
            if idle && s.refs[b] > 0 {
                return Err(format!("block {b} is still referenced {} times", s.refs[b]));
            }
            if let Some(e) = &s.entry[b] {
                if s.by_hash.get(&e.hash) != Some(&(b as u32)) {
                    return Err(format!("block {b}'s hash does not map back to it"));
                }
            }
        }
        if s.by_hash.len() != s.entry.iter().flatten().count() {
            return Err("the hash map holds blocks that are not registered".into());
        }
        Ok(())
    }
}

impl std::fmt::Debug for BlockTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.blocks()).finish()
    }
}

/// A sequence's blocks, in position order, with references on them. Dropping or truncating it
/// gives them back. `Default` is an empty table not yet tied to a pool.
#[derive(Default)]
pub struct BlockTable {
    pool: Option<BlockPool>,
    blocks: Vec<u32>,
    /// Chained hashes of the leading full blocks registered (or found) so far.
    hashes: Vec<u64>,
}

/// A block to copy before writing: `(from, to)` physical ids.
pub type BlockCopy = (u32, u32);

impl BlockTable {
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    fn attach(&mut self, pool: &BlockPool) -> Result<()> {
        match &self.pool {
            Some(p) if !p.same(pool) => bail!("a sequence's blocks belong to another KV pool"),
            Some(_) => {}
            None => self.pool = Some(pool.clone()),
        }
        Ok(())
    }

    /// Makes positions `start..end` writable: grows the table to cover `end` positions and
    /// replaces each block in that range that is shared or registered by a fresh copy. Returns
    /// the copies the caller must make (old block's K/V into the new one) before writing. Takes
    /// nothing when the pool cannot supply every block needed.
    pub fn prepare_write(
        &mut self,
        pool: &BlockPool,
        start: usize,
        end: usize,
    ) -> Result<Vec<BlockCopy>> {
        self.attach(pool)?;
        let mut s = pool.lock();
        let bs = s.block_size;
        let first = start / bs;
        let grow = end.div_ceil(bs).saturating_sub(self.blocks.len());
        let cow: Vec<usize> = (first..self.blocks.len().min(end.div_ceil(bs)))
            .filter(|&i| {
                let b = self.blocks[i] as usize;
                s.refs[b] > 1 || s.entry[b].is_some()
            })
            .collect();
        if s.available() < grow + cow.len() {
            bail!(
                "KV cache is full: {} more blocks of {bs} positions needed, {} available (raise --ctx)",
                grow + cow.len(),
                s.available()
            );
        }
        let mut copies = Vec::with_capacity(cow.len());
        for i in cow {
            let old = self.blocks[i];
            self.blocks[i] = s.take();
            copies.push((old, self.blocks[i]));
            s.stats.copied_blocks += 1;
        }
        // A copied block is new content from its first written position on: it and everything
        // after it are no longer the registered blocks the hashes describe.
        self.hashes.truncate(first.min(self.hashes.len()));
        for _ in 0..grow {
            let b = s.take();
            self.blocks.push(b);
        }
        // Only now may the originals become evictable: none of them can have been handed out
        // above, so each still holds what its copy needs.
        for &(old, _) in &copies {
            s.decref(old);
        }
        Ok(copies)
    }

    /// Keeps the blocks covering `n_positions` positions and gives the rest back, last first (so
    /// that the cache evicts a chain's tail before its head).
    pub fn truncate(&mut self, n_positions: usize) {
        let Some(pool) = self.pool.clone() else {
            return;
        };
        let mut s = pool.lock();
        let keep = n_positions.div_ceil(s.block_size);
        while self.blocks.len() > keep {
            let b = self.blocks.pop().expect("len > keep");
            s.decref(b);
        }
        self.hashes.truncate(n_positions / s.block_size);
    }

    /// Gives back blocks `at..at + n` (a context shift drops them) and makes every later block
    /// private to this table: its registration in the prefix cache is forgotten, since its
    /// content is about to change (its keys are re-rotated) and it no longer follows the chain
    /// its hash describes. Fails, changing nothing, if a later block is shared with another
    /// table.
    pub fn remove_blocks(&mut self, at: usize, n: usize) -> Result<()> {
        let Some(pool) = self.pool.clone() else {
            bail!("an empty block table has no blocks to remove");
        };
        if at + n > self.blocks.len() {
            bail!("blocks {at}..{} of {} removed", at + n, self.blocks.len());
        }
        let mut s = pool.lock();
        if self.blocks[at + n..]
            .iter()
            .any(|&b| s.refs[b as usize] > 1)
        {
            bail!("a block after the dropped ones is shared with another sequence");
        }
        for &b in &self.blocks[at + n..] {
            if let Some(e) = s.entry[b as usize].take() {
                s.by_hash.remove(&e.hash);
            }
        }
        for b in self.blocks.drain(at..at + n).collect::<Vec<_>>() {
            s.decref(b);
        }
        self.hashes.truncate(at);
        Ok(())
    }

    /// Registers the full blocks among the first `n_cached` positions of `tokens` in the prefix
    /// cache (those not yet registered). A block whose hash is already registered elsewhere stays
    /// private (the other copy serves later requests).
    pub fn register_full(&mut self, tokens: &[u32], n_cached: usize) {
        let Some(pool) = self.pool.clone() else {
            return;
        };
        let mut s = pool.lock();
        let bs = s.block_size;
        let full = (n_cached / bs).min(self.blocks.len());
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let parent = i.checked_sub(1).map(|p| self.hashes[p]);
            let toks = &tokens[i * bs..(i + 1) * bs];
            let h = block_hash(parent, toks);
            let b = self.blocks[i];
            if s.entry[b as usize].is_none() && !s.by_hash.contains_key(&h) {
                s.by_hash.insert(h, b);
                s.entry[b as usize] = Some(Entry {
                    hash: h,
                    parent,
                    tokens: toks.to_vec(),
                });
            }
            self.hashes.push(h);
        }
    }

    /// For an empty table: takes references on the cached blocks holding the longest prefix of
    /// `tokens` made of full blocks, and returns how many positions they cover.
    pub fn adopt_cached(&mut self, pool: &BlockPool, tokens: &[u32]) -> Result<usize> {
        self.attach(pool)?;
        assert!(self.blocks.is_empty(), "adopt_cached needs an empty table");
        let mut s = pool.lock();
        let bs = s.block_size;
        let mut parent = None;
        for toks in tokens.chunks_exact(bs) {
            let h = block_hash(parent, toks);
            let Some(&b) = s.by_hash.get(&h) else { break };
            let e = s.entry[b as usize]
                .as_ref()
                .expect("mapped blocks are registered");
            if e.parent != parent || e.tokens != toks {
                break; // a hash collision: not this prefix
            }
            s.incref(b);
            self.blocks.push(b);
            self.hashes.push(h);
            parent = Some(h);
        }
        Ok(self.blocks.len() * bs)
    }

    /// Another table holding references on the same blocks (a fork): the first write into a
    /// shared block copies it.
    pub fn share(&self) -> BlockTable {
        if let Some(pool) = &self.pool {
            let mut s = pool.lock();
            for &b in &self.blocks {
                s.incref(b);
            }
        }
        BlockTable {
            pool: self.pool.clone(),
            blocks: self.blocks.clone(),
            hashes: self.hashes.clone(),
        }
    }
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.truncate(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(p: &BlockPool) {
        p.check_whole(true).unwrap();
    }

    #[test]
    fn allocate_truncate_drop() {
        let p = BlockPool::new(4, 16);
        let mut t = p.table();
        assert!(t.prepare_write(&p, 0, 17).unwrap().is_empty());
        assert_eq!(t.blocks(), &[0, 1]);
        assert_eq!(p.n_available(), 2);
        t.prepare_write(&p, 17, 32).unwrap(); // already covered
        assert_eq!(t.len(), 2);
        assert!(t.prepare_write(&p, 32, 16 * 5).is_err());
        assert_eq!(t.len(), 2, "a failed allocation takes nothing");
        p.check_whole(false).unwrap();
        t.truncate(16);
        assert_eq!(t.blocks(), &[0]);
        assert_eq!(p.n_available(), 3);
        drop(t);
        assert_eq!(p.n_available(), 4);
        whole(&p);
    }

    #[test]
    fn shared_blocks_copy_on_write_and_refcount() {
        let p = BlockPool::new(6, 4);
        let mut a = p.table();
        a.prepare_write(&p, 0, 6).unwrap(); // blocks 0 (full) and 1 (half)
        let mut b = a.share();
        assert_eq!(p.n_referenced(), 2);
        // b appends at position 6: block 1 is shared, so b gets a copy of it
        let copies = b.prepare_write(&p, 6, 7).unwrap();
        assert_eq!(copies, vec![(1, 2)]);
        assert_eq!(b.blocks(), &[0, 2]);
        // a is now the only owner of block 1 and writes in place
        assert!(a.prepare_write(&p, 6, 8).unwrap().is_empty());
        assert_eq!(a.blocks(), &[0, 1]);
        drop(a);
        // block 0 is still b's
        assert_eq!(p.n_referenced(), 2);
        p.check_whole(false).unwrap();
        drop(b);
        whole(&p);
        assert_eq!(p.stats().copied_blocks, 1);
    }

    #[test]
    fn prefix_cache_reuses_full_blocks_only() {
        let p = BlockPool::new(8, 4);
        let toks: Vec<u32> = (0..10).collect();
        let mut a = p.table();
        a.prepare_write(&p, 0, 10).unwrap();
        a.register_full(&toks, 10); // blocks 0, 1 full; block 2 half
        drop(a);
        assert_eq!(p.n_cached_idle(), 2);
        whole(&p);

        // same first 9 tokens, different 10th: both full blocks match
        let mut other = toks.clone();
        other[9] = 99;
        let mut b = p.table();
        assert_eq!(b.adopt_cached(&p, &other).unwrap(), 8);
        assert_eq!(p.n_cached_idle(), 0);
        // a different second block: only the first matches (chained hashes)
        let mut c = p.table();
        let mut third = toks.clone();
        third[5] = 77;
        assert_eq!(c.adopt_cached(&p, &third).unwrap(), 4);
        assert_eq!(c.blocks(), &b.blocks()[..1]);
        // writing into a registered block copies it even with a single owner
        drop(b);
        let copies = c.prepare_write(&p, 3, 5).unwrap();
        assert_eq!(copies.len(), 1);
        drop(c);
        whole(&p);
    }

    #[test]
    fn lru_evicts_the_oldest_tail_first() {
        let p = BlockPool::new(4, 2);
        let a_toks = [1, 2, 3, 4];
        let b_toks = [5, 6];
        let mut a = p.table();
        a.prepare_write(&p, 0, 4).unwrap();
        a.register_full(&a_toks, 4);
        let mut b = p.table();
        b.prepare_write(&p, 0, 2).unwrap();
        b.register_full(&b_toks, 2);
        drop(a); // a's tail block goes first, then its head
        drop(b);
        assert_eq!(p.n_cached_idle(), 3);
        assert_eq!(p.n_available(), 4);
        // two new blocks: the free one, then a's tail (the oldest released)
        let mut c = p.table();
        c.prepare_write(&p, 0, 4).unwrap();
        assert_eq!(p.stats().evicted_blocks, 1);
        let mut d = p.table();
        assert_eq!(d.adopt_cached(&p, &a_toks).unwrap(), 2, "a's head survives");
        let mut e = p.table();
        assert_eq!(e.adopt_cached(&p, &b_toks).unwrap(), 2);
        p.check_whole(false).unwrap();
        drop((c, d, e));
        whole(&p);
    }

    #[test]
    fn duplicate_content_stays_private() {
        let p = BlockPool::new(4, 2);
        let toks = [7, 8];
        let mut a = p.table();
        a.prepare_write(&p, 0, 2).unwrap();
        a.register_full(&toks, 2);
        let mut b = p.table();
        b.prepare_write(&p, 0, 2).unwrap();
        b.register_full(&toks, 2);
        drop(b); // unregistered: straight back to the free list
        assert_eq!(p.n_cached_idle(), 0);
        drop(a);
        assert_eq!(p.n_cached_idle(), 1);
        whole(&p);
    }

    #[test]
    fn tables_of_another_pool_are_refused() {
        let (p, q) = (BlockPool::new(2, 2), BlockPool::new(2, 2));
        let mut t = p.table();
        t.prepare_write(&p, 0, 1).unwrap();
        assert!(t.prepare_write(&q, 1, 2).is_err());
        drop(t);
        whole(&p);
        whole(&q);
    }
}
