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

/// The vocabulary: token texts by id, all in one buffer, and an open-addressing index from text
/// to id. One allocation for all the texts rather than one each (151 936 for Qwen2.5, 262 144 for
/// Gemma-3), and each slot keeps the low half of its text's hash, so a probe compares texts only
/// when the hashes agree: building BPE's merge table looks up about 450 000 strings, and with
/// the texts behind pointers that cost more than the rest of the tokenizer's construction.
///
/// Invariant: every token text is in the index exactly once (duplicates are rejected at build),
/// and the table is at most half full, so probing always ends at an empty slot.
#[derive(Debug)]
pub(crate) struct Vocab {
    /// Every token's text, in id order.
    text: String,
    /// End of token `i`'s text in `text` (it starts where token `i - 1` ends).
    ends: Vec<u32>,
    /// Per slot: token id in the high 32 bits and the low 32 bits of its text's hash, or
    /// [`EMPTY`].
    slots: Vec<u64>,
    /// `64 - log2(slots.len())`: the slot of a hash is its top bits.
    shift: u32,
}

const EMPTY: u64 = u64::MAX;

impl Vocab {
    /// Indexes `tokens` (`n` of them, in id order); on a duplicate text returns
    /// `Err((first id, second id))`.
    pub(crate) fn new<S: AsRef<str>>(
        n: usize,
        tokens: impl IntoIterator<Item = S>,
    ) -> Result<Vocab, (u32, u32)> {
        Self::build(n, tokens, false)
    }

    /// Indexes `texts` (`n` of them) where a text may come more than once: [`Self::get`] then
    /// finds the first.
    pub(crate) fn first_wins<S: AsRef<str>>(n: usize, texts: impl IntoIterator<Item = S>) -> Vocab {
        Self::build(n, texts, true).unwrap_or_else(|_| unreachable!("duplicates are kept"))
    }

    fn build<S: AsRef<str>>(
        n: usize,
        tokens: impl IntoIterator<Item = S>,
        keep_first: bool,
    ) -> Result<Vocab, (u32, u32)> {
        let size = (n.max(1) * 2).next_power_of_two();
        let mut v = Vocab {
            text: String::new(),
            ends: Vec::with_capacity(n),
            slots: vec![EMPTY; size],
            shift: 64 - size.trailing_zeros(),
        };
        let mask = size - 1;
        for t in tokens {
            let t = t.as_ref();
            let id = v.ends.len() as u32;
            assert!(
                (id as usize) < size / 2,
                "more texts than the {n} announced"
            );
            v.text.push_str(t);
            v.ends.push(v.text.len() as u32);
            let h = hash_str(t);
            let mut i = (h >> v.shift) as usize;
            loop {
                let s = v.slots[i];
                if s == EMPTY {
                    v.slots[i] = (u64::from(id) << 32) | (h & 0xffff_ffff);
                    break;
                }
                if s as u32 == h as u32 && v.token((s >> 32) as usize) == t {
                    if keep_first {
                        break;
                    }
                    return Err(((s >> 32) as u32, id));
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
        let h = hash_str(s);
        let mut i = (h >> self.shift) as usize;
        loop {
            let slot = self.slots[i];
            if slot == EMPTY {
                return None;
            }
            let id = (slot >> 32) as usize;
            if slot as u32 == h as u32 && self.token(id) == s {
                return Some(id as u32);
            }
            i = (i + 1) & mask;
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    /// The text of token `id`.
    ///
    /// # Panics
    /// If `id` is not below [`Self::len`].
    #[inline]
    pub(crate) fn token(&self, id: usize) -> &str {
        let start = if id == 0 {
            0
        } else {
            self.ends[id - 1] as usize
        };
        &self.text[start..self.ends[id] as usize]
    }

    /// The text of token `id`, `None` outside the vocabulary.
    pub(crate) fn try_token(&self, id: usize) -> Option<&str> {
        (id < self.len()).then(|| self.token(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_index_finds_every_token_and_rejects_duplicates() {
        let toks: Vec<String> = (0..1000).map(|i| format!("t{i}")).collect();
        let v = Vocab::new(toks.len(), &toks).unwrap();
        for i in 0..1000u32 {
            assert_eq!(v.get(&format!("t{i}")), Some(i));
        }
        assert_eq!(v.get("t1000"), None);
        assert_eq!(v.get(""), None);
        assert_eq!(v.token(7), "t7");
        assert_eq!(v.try_token(1000), None);
        let dup = ["a", "b", "a"];
        assert_eq!(Vocab::new(3, dup).unwrap_err(), (0, 2));
    }
}
