//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the GPT-2 byte↔char alphabet, the merge
//! table and the merge loop of llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! Every byte of a word stands for one char of the byte-level alphabet, so a word's symbols are
//! its bytes and a symbol is identified by the id of its text. Merge rules may name strings that
//! are not in the vocabulary; those get synthetic ids at or above the vocabulary size, so merging
//! on ids ranks exactly as llama.cpp's merging on strings does.
//!
//! Invariants: merges are applied lowest rank first, ties to the leftmost pair; a symbol whose
//! text is not a vocabulary token is emitted as the tokens of its single-byte chars that are in
//! the vocabulary (and dropped otherwise), as llama.cpp does. Ids returned are always `< n_vocab`.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::hash::{map_with_capacity, FxHashMap, Vocab};
use super::pretok::PreTokenizer;

/// No id: a byte-level char that is neither a token nor named by any merge.
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
    /// `(left, right)` → `(rank, merged)`; ids at or above `n_vocab` are synthetic.
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    /// Id of the one-char symbol of each byte (or [`NONE`]).
    byte_sym: [u32; 256],
    /// Token of each byte whose byte-level char is ASCII and a token on its own: llama.cpp's
    /// per-byte fallback for a symbol that is not a token.
    byte_fallback: [u32; 256],
    byte_chars: [char; 256],
    n_vocab: u32,
    pub(crate) pre: PreTokenizer,
    /// llama.cpp's `ignore_merges`: a word that is a token as a whole is emitted directly.
    ignore_merges: bool,
}

impl Bpe {
    /// Builds the merge table from `merges` (`"left right"` strings, rank = index) over `vocab`.
    pub(crate) fn new(
        merges: &[String],
        vocab: &Vocab,
        pre: PreTokenizer,
        ignore_merges: bool,
    ) -> Bpe {
        let n_vocab = vocab.len() as u32;
        let mut extra: FxHashMap<String, u32> = map_with_capacity(0);
        let intern = |s: &str, extra: &mut FxHashMap<String, u32>| -> u32 {
            if let Some(id) = vocab.get(s) {
                return id;
            }
            if let Some(&id) = extra.get(s) {
                return id;
            }
            let id = n_vocab.saturating_add(extra.len() as u32);
            extra.insert(s.to_string(), id);
            id
        };
        let mut table = map_with_capacity(merges.len());
        let mut joined = String::new();
        for (rank, m) in merges.iter().enumerate() {
            // llama.cpp: `word.find(' ', 1)`; a rule without a separator pairs two empty strings,
            // which no symbol can ever match.
            let Some(sep) = m.as_bytes().iter().skip(1).position(|&b| b == b' ') else {
                continue;
            };
            let (left, right) = (&m[..sep + 1], &m[sep + 2..]);
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            let l = intern(left, &mut extra);
            let r = intern(right, &mut extra);
            let merged = intern(&joined, &mut extra);
            let rank = u32::try_from(rank).unwrap_or(u32::MAX);
            table.entry((l, r)).or_insert((rank, merged));
        }
        let byte_chars = byte_to_char_table();
        let mut byte_sym = [NONE; 256];
        let mut byte_fallback = [NONE; 256];
        let mut buf = [0u8; 4];
        for b in 0..256 {
            let s: &str = byte_chars[b].encode_utf8(&mut buf);
            byte_sym[b] = vocab
                .get(s)
                .or_else(|| extra.get(s).copied())
                .unwrap_or(NONE);
            if byte_chars[b].is_ascii() {
                byte_fallback[b] = vocab.get(s).unwrap_or(NONE);
            }
        }
        Bpe {
            merges: table,
            byte_sym,
            byte_fallback,
            byte_chars,
            n_vocab,
            pre,
            ignore_merges,
        }
    }

    /// Appends the tokens of one pre-tokenized word (raw bytes, before byte-level encoding).
    pub(crate) fn encode_word(&self, word: &[u8], vocab: &Vocab, out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if self.ignore_merges {
            let encoded: String = word
                .iter()
                .map(|&b| self.byte_chars[usize::from(b)])
                .collect();
            if let Some(id) = vocab.get(&encoded) {
                out.push(id);
                return;
            }
        }
        let n = word.len();
        let mut syms: Vec<Symbol> = word
            .iter()
            .enumerate()
            .map(|(i, &b)| Symbol {
                id: self.byte_sym[usize::from(b)],
                start: i,
                len: 1,
                prev: i.checked_sub(1),
                next: (i + 1 < n).then_some(i + 1),
            })
            .collect();
        let mut queue = BinaryHeap::new();
        for i in 1..n {
            self.push_pair(&syms, i - 1, i, &mut queue);
        }
        while let Some(pair) = queue.pop() {
            let (l, r) = (pair.left, pair.right);
            if syms[l].len == 0
                || syms[r].len == 0
                || syms[l].id != pair.left_id
                || syms[r].id != pair.right_id
            {
                continue; // outdated
            }
            let right_len = syms[r].len;
            let right_next = syms[r].next;
            syms[l].len += right_len;
            syms[l].id = pair.merged;
            syms[r].len = 0;
            syms[l].next = right_next;
            if let Some(nx) = right_next {
                syms[nx].prev = Some(l);
            }
            if let Some(pv) = syms[l].prev {
                self.push_pair(&syms, pv, l, &mut queue);
            }
            if let Some(nx) = right_next {
                self.push_pair(&syms, l, nx, &mut queue);
            }
        }
        for s in syms.iter().filter(|s| s.len > 0) {
            if s.id < self.n_vocab {
                out.push(s.id);
            } else {
                for &b in &word[s.start..s.start + s.len] {
                    let t = self.byte_fallback[usize::from(b)];
                    if t != NONE {
                        out.push(t);
                    }
                }
            }
        }
    }

    fn push_pair(&self, syms: &[Symbol], l: usize, r: usize, queue: &mut BinaryHeap<Pair>) {
        let (a, b) = (syms[l].id, syms[r].id);
        if a == NONE || b == NONE {
            return;
        }
        if let Some(&(rank, merged)) = self.merges.get(&(a, b)) {
            queue.push(Pair {
                rank,
                left: l,
                right: r,
                left_id: a,
                right_id: b,
                merged,
            });
        }
    }
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
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
    left_id: u32,
    right_id: u32,
    merged: u32,
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
        Vocab::new(tokens.iter().map(|t| t.to_string()).collect()).unwrap()
    }

    #[test]
    fn merges_apply_by_rank_not_position() {
        // "abc": rank 0 is "b c", so "a" + "bc" wins over "ab" + "c".
        let toks = ["a", "b", "c", "ab", "bc", "abc"];
        let lookup = vocab(&toks);
        let merges = ["b c", "a b", "a bc"].map(String::from);
        let bpe = Bpe::new(&merges, &lookup, PreTokenizer::Gpt2, false);
        let mut out = Vec::new();
        bpe.encode_word(b"abc", &lookup, &mut out);
        assert_eq!(out, [5]);
        out.clear();
        bpe.encode_word(b"abab", &lookup, &mut out);
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
        bpe.encode_word(b"xyz", &lookup, &mut out);
        assert_eq!(out, [0, 1, 2]);
    }
}
