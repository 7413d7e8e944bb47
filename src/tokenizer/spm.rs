//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`): llama.cpp's
//! `llm_tokenizer_spm_session`, which merges by token score with no merge list.
//!
//! The text arrives with spaces already escaped to `▁`. Symbols start as single UTF-8 chars; the
//! pair whose concatenation is the vocabulary token with the highest score is merged first (ties
//! to the leftmost), until no adjacent pair forms a token. A final symbol that is not a token is
//! emitted byte by byte as `<0xXX>` tokens.
//!
//! Invariants: merged symbols are always vocabulary tokens; the emitted bytes/tokens cover the
//! input exactly; no synthetic merge table is built, so loading costs nothing beyond the vocab.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::hash::Vocab;

/// What the SPM merge loop needs from the vocabulary.
pub(crate) struct SpmVocab<'a> {
    pub vocab: &'a Vocab,
    pub scores: &'a [f32],
    /// Token of each byte (`<0xXX>`, else the one-char token), if any.
    pub byte_tokens: &'a [Option<u32>; 256],
    pub unk: Option<u32>,
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge; the heap pops the highest score, then the leftmost.
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Pair {}

impl Ord for Pair {
    fn cmp(&self, other: &Self) -> Ordering {
        // llama.cpp compares with `<` and `==`; scores are normalised at load (no NaN, no -0.0)
        // so `total_cmp` orders them identically.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Appends the tokens of `text` (spaces already escaped).
pub(crate) fn encode(vocab: &SpmVocab<'_>, text: &str, out: &mut Vec<u32>) {
    if text.is_empty() {
        return;
    }
    let mut syms: Vec<Symbol> = Vec::with_capacity(text.len());
    for (i, (start, ch)) in text.char_indices().enumerate() {
        let end = start + ch.len_utf8();
        syms.push(Symbol {
            start,
            len: ch.len_utf8(),
            prev: i.checked_sub(1),
            next: (end < text.len()).then_some(i + 1),
        });
    }
    let mut queue = BinaryHeap::with_capacity(syms.len());
    for i in 1..syms.len() {
        push_pair(vocab, text, &syms, i - 1, i, &mut queue);
    }
    while let Some(pair) = queue.pop() {
        let (l, r) = (pair.left, pair.right);
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != pair.size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        let right_next = syms[r].next;
        syms[l].next = right_next;
        if let Some(nx) = right_next {
            syms[nx].prev = Some(l);
        }
        if let Some(pv) = syms[l].prev {
            push_pair(vocab, text, &syms, pv, l, &mut queue);
        }
        if let Some(nx) = right_next {
            push_pair(vocab, text, &syms, l, nx, &mut queue);
        }
    }
    let mut i = Some(0);
    while let Some(k) = i {
        let s = syms[k];
        let piece = &text[s.start..s.start + s.len];
        match vocab.vocab.get(piece) {
            Some(id) => out.push(id),
            None => {
                for &b in piece.as_bytes() {
                    if let Some(t) = vocab.byte_tokens[usize::from(b)].or(vocab.unk) {
                        out.push(t);
                    }
                }
            }
        }
        i = s.next;
    }
}

fn push_pair(
    vocab: &SpmVocab<'_>,
    text: &str,
    syms: &[Symbol],
    l: usize,
    r: usize,
    queue: &mut BinaryHeap<Pair>,
) {
    let start = syms[l].start;
    let size = syms[l].len + syms[r].len;
    if let Some(id) = vocab.vocab.get(&text[start..start + size]) {
        queue.push(Pair {
            score: vocab.scores.get(id as usize).copied().unwrap_or(0.0),
            left: l,
            right: r,
            size,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn highest_score_merges_first_and_unknown_chars_become_bytes() {
        let toks = ["a", "b", "c", "ab", "bc", "<0xC3>", "<0xA9>"];
        let scores = [0.0, 0.0, 0.0, -1.0, -0.5, 0.0, 0.0];
        let lookup = Vocab::new(toks.len(), toks.iter()).unwrap();
        let mut byte_tokens = [None; 256];
        byte_tokens[0xC3] = Some(5);
        byte_tokens[0xA9] = Some(6);
        let v = SpmVocab {
            vocab: &lookup,
            scores: &scores,
            byte_tokens: &byte_tokens,
            unk: None,
        };
        let mut out = Vec::new();
        encode(&v, "abcé", &mut out);
        // "bc" (-0.5) beats "ab" (-1.0); "é" is not a token: its two UTF-8 bytes.
        assert_eq!(out, [0, 4, 5, 6]);
    }
}
