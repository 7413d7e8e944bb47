//! A small, fast, non-cryptographic hasher for the tokenizer's lookup tables.
//!
//! Owns nothing but the hashing function (the multiply-rotate scheme of rustc's `FxHasher`).
//! Invariant: deterministic across runs, so table layouts and load times do not vary. The keys it
//! hashes come from the model file and the text being encoded; neither is attacker-chosen in a way
//! that matters to a local inference engine, so collision resistance is not a goal.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

/// The Fx hash: fold each word into the state with a rotate, xor and multiply.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher {
    hash: u64,
}

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i.into());
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i.into());
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.hash
    }
}

/// A `HashMap` using [`FxHasher`].
pub(crate) type FxHashMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

/// An empty [`FxHashMap`] with room for `n` entries.
pub(crate) fn map_with_capacity<K, V>(n: usize) -> FxHashMap<K, V> {
    HashMap::with_capacity_and_hasher(n, BuildHasherDefault::default())
}

/// The Fx hash of a string's bytes.
fn hash_str(s: &str) -> u64 {
    let mut h = FxHasher::default();
    h.write(s.as_bytes());
    h.finish()
}

/// The vocabulary: token texts by id, and an open-addressing index from text to id that borrows
/// the texts instead of copying them (262 144 fewer allocations for Gemma).
///
/// Invariant: every token text is in the index exactly once (duplicates are rejected at build),
/// and the table is at most half full, so probing always ends at an empty slot.
#[derive(Debug)]
pub(crate) struct Vocab {
    tokens: Vec<String>,
    /// Token id per slot, `u32::MAX` when empty.
    slots: Vec<u32>,
    /// `64 - log2(slots.len())`: the slot of a hash is its top bits.
    shift: u32,
}

impl Vocab {
    /// Indexes `tokens`; on a duplicate text returns `Err((first id, second id))`.
    pub(crate) fn new(tokens: Vec<String>) -> Result<Vocab, (u32, u32)> {
        let size = (tokens.len() * 2).next_power_of_two().max(2);
        let mut v = Vocab {
            slots: vec![u32::MAX; size],
            shift: 64 - size.trailing_zeros(),
            tokens,
        };
        let mask = size - 1;
        for (id, t) in v.tokens.iter().enumerate() {
            let mut i = (hash_str(t) >> v.shift) as usize;
            loop {
                let s = v.slots[i];
                if s == u32::MAX {
                    v.slots[i] = id as u32;
                    break;
                }
                if v.tokens[s as usize] == *t {
                    return Err((s, id as u32));
                }
                i = (i + 1) & mask;
            }
        }
        Ok(v)
    }

    /// The id of the token whose text is `s`.
    #[inline]
    pub(crate) fn get(&self, s: &str) -> Option<u32> {
        let mask = self.slots.len() - 1;
        let mut i = (hash_str(s) >> self.shift) as usize;
        loop {
            let id = self.slots[i];
            if id == u32::MAX {
                return None;
            }
            if self.tokens[id as usize] == s {
                return Some(id);
            }
            i = (i + 1) & mask;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn tokens(&self) -> &[String] {
        &self.tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_index_finds_every_token_and_rejects_duplicates() {
        let toks: Vec<String> = (0..1000).map(|i| format!("t{i}")).collect();
        let v = Vocab::new(toks).unwrap();
        for i in 0..1000u32 {
            assert_eq!(v.get(&format!("t{i}")), Some(i));
        }
        assert_eq!(v.get("t1000"), None);
        assert_eq!(v.get(""), None);
        let dup = vec!["a".to_string(), "b".to_string(), "a".to_string()];
        assert_eq!(Vocab::new(dup).unwrap_err(), (0, 2));
    }
}
