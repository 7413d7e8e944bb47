//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the GPT-2 byte↔char alphabet, the merge
//! table and the merge loop of llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! Every byte of a word stands for one char of the byte-level alphabet, so a symbol is a span of
//! the word's bytes and its text is the byte-level encoding of that span. The merge table is
//! indexed by the rule's own text (`"left right"`, rank = index): a pair of adjacent symbols
//! merges with the rank of the rule that spells `left + " " + right`. Symbol texts never hold a
//! space (byte 0x20 is `Ġ` in the alphabet), so this is llama.cpp's lookup of the split rule,
//! and building the table reads each rule once rather than looking up its two halves and their
//! join in the vocabulary (Qwen2.5: 151 387 rules, about 450 000 lookups that took most of the
//! tokenizer's construction).
//!
//! Invariants: merges are applied lowest rank first, ties to the leftmost pair; a symbol whose
//! text is not a vocabulary token is emitted as the tokens of its single-byte chars that are in
//! the vocabulary (and dropped otherwise), as llama.cpp does. Ids returned are always `< n_vocab`.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::hash::Vocab;
use super::pretok::PreTokenizer;

/// No id: a byte that is not a token on its own.
const NONE: u32 = u32::MAX;

/// The GPT-2 byte→char table: printable Latin-1 bytes map to themselves, the other 68 bytes to
/// U+0100.. in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        table[usize::from(b)] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\u{FFFD}')
        };
    }
    table
}

/// The inverse of [`byte_to_char_table`] as a lookup by code point (all such chars are below
/// U+0144).
pub(crate) fn char_to_byte_table() -> Vec<Option<u8>> {
    let mut inv = vec![None; 0x144];
    for (b, c) in byte_to_char_table().iter().enumerate() {
        inv[*c as usize] = u8::try_from(b).ok();
    }
    inv
}

/// The merge table and pre-tokenizer of one byte-level BPE vocabulary.
#[derive(Debug)]
pub(crate) struct Bpe {
    /// The merge rules by text (`"left right"`), the first of equal ones; the id is the rank.
    merges: Vocab,
    /// Token of each byte whose byte-level char is ASCII and a token on its own: llama.cpp's
    /// per-byte fallback for a symbol that is not a token.
    byte_fallback: [u32; 256],
    byte_chars: [char; 256],
    pub(crate) pre: PreTokenizer,
    /// llama.cpp's `ignore_merges`: a word that is a token as a whole is emitted directly.
    ignore_merges: bool,
}

impl Bpe {
    /// Builds the merge table from `merges` (`"left right"` strings, rank = index) over `vocab`.
    pub(crate) fn new(
        merges: &[impl AsRef<str>],
        vocab: &Vocab,
        pre: PreTokenizer,
        ignore_merges: bool,
    ) -> Bpe {
        let byte_chars = byte_to_char_table();
        let mut byte_fallback = [NONE; 256];
        let mut buf = [0u8; 4];
        for b in 0..256 {
            if byte_chars[b].is_ascii() {
                byte_fallback[b] = vocab
                    .get(byte_chars[b].encode_utf8(&mut buf))
                    .unwrap_or(NONE);
            }
        }
        Bpe {
            merges: Vocab::first_wins(merges.len(), merges),
            byte_fallback,
            byte_chars,
            pre,
            ignore_merges,
        }
    }

    /// Appends the tokens of one pre-tokenized word (raw bytes, before byte-level encoding);
    /// `scratch` holds buffers reused from word to word.
    pub(crate) fn encode_word(
        &self,
        word: &[u8],
        vocab: &Vocab,
        scratch: &mut Scratch,
        out: &mut Vec<u32>,
    ) {
        if word.is_empty() {
            return;
        }
        let n = word.len();
        let Scratch {
            encoded,
            at,
            syms,
            key,
            queue,
        } = scratch;
        // The word in the byte-level alphabet, and where each byte's char starts in it.
        encoded.clear();
        at.clear();
        for &b in word {
            at.push(encoded.len());
            encoded.push(self.byte_chars[usize::from(b)]);
        }
        at.push(encoded.len());
        if self.ignore_merges {
            if let Some(id) = vocab.get(encoded) {
                out.push(id);
                return;
            }
        }
        syms.clear();
        syms.extend((0..n).map(|i| Symbol {
            start: i,
            len: 1,
            prev: i.checked_sub(1),
            next: (i + 1 < n).then_some(i + 1),
        }));
        let syms = &mut syms[..];
        let mut w = Words {
            encoded,
            at,
            key: std::mem::take(key),
        };
        queue.clear();
        for i in 1..n {
            self.push_pair(syms, i - 1, i, &mut w, queue);
        }
        while let Some(pair) = queue.pop() {
            let (l, r) = (pair.left, pair.right);
            if syms[l].len != pair.left_len || syms[r].len != pair.right_len {
                continue; // outdated: a symbol is a span from a fixed start, so its length is it
            }
            let right_next = syms[r].next;
            syms[l].len += pair.right_len;
            syms[r].len = 0;
            syms[l].next = right_next;
            if let Some(nx) = right_next {
                syms[nx].prev = Some(l);
            }
            if let Some(pv) = syms[l].prev {
                self.push_pair(syms, pv, l, &mut w, queue);
            }
            if let Some(nx) = right_next {
                self.push_pair(syms, l, nx, &mut w, queue);
            }
        }
        for s in syms.iter().filter(|s| s.len > 0) {
            if let Some(id) = vocab.get(w.text(s)) {
                out.push(id);
            } else {
                for &b in &word[s.start..s.start + s.len] {
                    let t = self.byte_fallback[usize::from(b)];
                    if t != NONE {
                        out.push(t);
                    }
                }
            }
        }
        *key = w.key;
    }

    fn push_pair(
        &self,
        syms: &[Symbol],
        l: usize,
        r: usize,
        w: &mut Words<'_>,
        queue: &mut BinaryHeap<Pair>,
    ) {
        let (a, b) = (&syms[l], &syms[r]);
        let mut key = std::mem::take(&mut w.key);
        key.clear();
        key.push_str(w.text(a));
        key.push(' ');
        key.push_str(w.text(b));
        if let Some(rank) = self.merges.get(&key) {
            queue.push(Pair {
                rank,
                left: l,
                right: r,
                left_len: a.len,
                right_len: b.len,
            });
        }
        w.key = key;
    }
}

/// Buffers [`Bpe::encode_word`] reuses from one word to the next.
#[derive(Default)]
pub(crate) struct Scratch {
    encoded: String,
    at: Vec<usize>,
    syms: Vec<Symbol>,
    key: String,
    queue: BinaryHeap<Pair>,
}

/// One word being merged: its byte-level text, where each byte's char starts, and a buffer for
/// the rule texts looked up.
struct Words<'a> {
    encoded: &'a str,
    at: &'a [usize],
    key: String,
}

impl Words<'_> {
    /// The byte-level text of symbol `s`.
    fn text(&self, s: &Symbol) -> &str {
        &self.encoded[self.at[s.start]..self.at[s.start + s.len]]
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge; the heap pops the lowest rank, then the leftmost.
#[derive(PartialEq, Eq)]
struct Pair {
    rank: u32,
    left: usize,
    right: usize,
    left_len: usize,
    right_len: usize,
}

impl Ord for Pair {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_matches_gpt2() {
        let t = byte_to_char_table();
        assert_eq!(t[usize::from(b'a')], 'a');
        assert_eq!(t[usize::from(b' ')], 'Ġ'); // U+0120
        assert_eq!(t[usize::from(b'\n')], 'Ċ'); // U+010A
        assert_eq!(t[0], 'Ā'); // U+0100
        assert_eq!(t[0xAD], 'Ń'); // U+0143, the last one
        let inv = char_to_byte_table();
        for (b, c) in t.iter().enumerate() {
            assert_eq!(inv[*c as usize], Some(b as u8));
        }
    }

    fn vocab(tokens: &[&str]) -> Vocab {
        Vocab::new(tokens.len(), tokens).unwrap()
    }

    #[test]
    fn merges_apply_by_rank_not_position() {
        // "abc": rank 0 is "b c", so "a" + "bc" wins over "ab" + "c".
        let toks = ["a", "b", "c", "ab", "bc", "abc"];
        let lookup = vocab(&toks);
        let merges = ["b c", "a b", "a bc"].map(String::from);
        let bpe = Bpe::new(&merges, &lookup, PreTokenizer::Gpt2, false);
        let mut out = Vec::new();
        let mut sc = Scratch::default();
        bpe.encode_word(b"abc", &lookup, &mut sc, &mut out);
        assert_eq!(out, [5]);
        out.clear();
        bpe.encode_word(b"abab", &lookup, &mut sc, &mut out);
        assert_eq!(out, [3, 3]);
    }

    #[test]
    fn a_merge_outside_the_vocab_falls_back_to_single_byte_tokens() {
        // "x y" produces "xy", which is not a token: llama.cpp emits "x", "y".
        let toks = ["x", "y", "z"];
        let lookup = vocab(&toks);
        let merges = ["x y".to_string()];
        let bpe = Bpe::new(&merges, &lookup, PreTokenizer::Gpt2, false);
        let mut out = Vec::new();
        bpe.encode_word(b"xyz", &lookup, &mut Scratch::default(), &mut out);
        assert_eq!(out, [0, 1, 2]);
    }
}
