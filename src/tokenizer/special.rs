//! Splitting text at special tokens before tokenization: llama.cpp's `tokenizer_st_partition`.
//!
//! llama.cpp walks its special tokens (control, user-defined and unknown) from the longest text to
//! the shortest, and for each one cuts every remaining text fragment at its leftmost
//! non-overlapping occurrences. Scanning every fragment once per special token costs
//! O(tokens × text) (Gemma has 6 414 of them), so this module finds all occurrences of all
//! special tokens in one pass with a byte trie, then replays llama.cpp's loop over only the tokens
//! that occur. The result is the same fragment list.
//!
//! Invariants: fragments are in text order; text fragments are non-empty byte ranges on char
//! boundaries; with `parse_special = false` control and unknown tokens are never cut out (user-
//! defined ones still are). Tokens with the `lstrip` / `rstrip` attribute eat the ASCII whitespace
//! beside them, as in llama.cpp.

use super::hash::{map_with_capacity, FxHashMap};

/// One piece of the partitioned text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    /// A byte range of the text, still to be tokenized.
    Text(usize, usize),
    /// A special token cut out of the text.
    Token(u32),
}

/// A special token as the partition sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SpecialToken {
    pub id: u32,
    /// Control or unknown: only cut out when special tokens are parsed.
    pub parse_only: bool,
    pub lstrip: bool,
    pub rstrip: bool,
}

/// The special tokens in llama.cpp's processing order, and a trie over their texts.
#[derive(Debug, Default)]
pub(crate) struct SpecialMatcher {
    /// In processing order: longest text first, ties by id.
    tokens: Vec<SpecialToken>,
    lens: Vec<usize>,
    /// Trie edges: (node, byte) → node. Node 0 is the root.
    edges: FxHashMap<(u32, u8), u32>,
    /// The processing-order index of the token ending at each node, if any.
    terminal: Vec<Option<u32>>,
}

impl SpecialMatcher {
    /// `tokens` in processing order, each with its text.
    pub(crate) fn new(tokens: Vec<(SpecialToken, &str)>) -> SpecialMatcher {
        let mut edges = map_with_capacity(tokens.iter().map(|(_, t)| t.len()).sum());
        let mut terminal = vec![None];
        let mut list = Vec::with_capacity(tokens.len());
        let mut lens = Vec::with_capacity(tokens.len());
        for (rank, (tok, text)) in tokens.into_iter().enumerate() {
            let mut node = 0u32;
            for &b in text.as_bytes() {
                let next = terminal.len() as u32;
                node = *edges.entry((node, b)).or_insert_with(|| {
                    terminal.push(None);
                    next
                });
            }
            // Two tokens with one text: the first processed takes every occurrence.
            if node != 0 && terminal[node as usize].is_none() {
                terminal[node as usize] = Some(rank as u32);
            }
            list.push(tok);
            lens.push(text.len());
        }
        SpecialMatcher {
            tokens: list,
            lens,
            edges,
            terminal,
        }
    }

    /// Partitions `text`; see the module invariants.
    pub(crate) fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let bytes = text.as_bytes();
        // Every occurrence of every usable special token: (processing rank, start).
        let mut occ: Vec<(u32, usize)> = Vec::new();
        if !self.tokens.is_empty() {
            for start in 0..bytes.len() {
                let mut node = 0u32;
                for &b in &bytes[start..] {
                    match self.edges.get(&(node, b)) {
                        Some(&n) => node = n,
                        None => break,
                    }
                    if let Some(rank) = self.terminal[node as usize] {
                        if parse_special || !self.tokens[rank as usize].parse_only {
                            occ.push((rank, start));
                        }
                    }
                }
            }
        }
        let mut frags = vec![Fragment::Text(0, bytes.len())];
        if occ.is_empty() {
            return frags;
        }
        occ.sort_unstable();
        let mut rest = &occ[..];
        while let Some(&(rank, _)) = rest.first() {
            let n = rest.iter().take_while(|o| o.0 == rank).count();
            let starts: Vec<usize> = rest[..n].iter().map(|o| o.1).collect();
            rest = &rest[n..];
            let tok = self.tokens[rank as usize];
            frags = cut(&frags, &starts, self.lens[rank as usize], tok, bytes);
        }
        frags
    }
}

/// C's `isspace` in the "C" locale, which llama.cpp's strip uses.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

/// One round of llama.cpp's loop: cut every text fragment at the leftmost non-overlapping
/// occurrences (`starts`, sorted) of one token of byte length `len`.
fn cut(
    frags: &[Fragment],
    starts: &[usize],
    len: usize,
    tok: SpecialToken,
    bytes: &[u8],
) -> Vec<Fragment> {
    let mut out = Vec::with_capacity(frags.len() + 2 * starts.len());
    for &f in frags {
        let Fragment::Text(a, b) = f else {
            out.push(f);
            continue;
        };
        let mut cursor = a;
        let mut i = starts.partition_point(|&s| s < a);
        while i < starts.len() && starts[i] + len <= b {
            let m = starts[i];
            if m < cursor {
                i += 1;
                continue;
            }
            let mut left_end = m;
            if tok.lstrip {
                while left_end > cursor && is_c_space(bytes[left_end - 1]) {
                    left_end -= 1;
                }
            }
            if left_end > cursor {
                out.push(Fragment::Text(cursor, left_end));
            }
            out.push(Fragment::Token(tok.id));
            cursor = m + len;
            if tok.rstrip {
                while cursor < b && is_c_space(bytes[cursor]) {
                    cursor += 1;
                }
            }
            i += 1;
        }
        if cursor < b {
            out.push(Fragment::Text(cursor, b));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(id: u32, parse_only: bool) -> SpecialToken {
        SpecialToken {
            id,
            parse_only,
            lstrip: false,
            rstrip: false,
        }
    }

    #[test]
    fn longest_token_is_cut_first_and_control_tokens_need_parse_special() {
        let m = SpecialMatcher::new(vec![
            (tok(10, true), "<|im_end|>"),
            (tok(11, false), "\n\n"),
            (tok(12, false), "\n"),
        ]);
        let text = "a<|im_end|>\n\n\nb";
        assert_eq!(
            m.partition(text, true),
            [
                Fragment::Text(0, 1),
                Fragment::Token(10),
                Fragment::Token(11),
                Fragment::Token(12),
                Fragment::Text(14, 15),
            ]
        );
        assert_eq!(
            m.partition(text, false),
            [
                Fragment::Text(0, 11),
                Fragment::Token(11),
                Fragment::Token(12),
                Fragment::Text(14, 15),
            ]
        );
    }

    #[test]
    fn occurrences_do_not_overlap_and_rstrip_eats_spaces() {
        let mut t = tok(7, false);
        t.rstrip = true;
        let m = SpecialMatcher::new(vec![(t, "aa")]);
        assert_eq!(
            m.partition("aaa  aa x", true),
            [
                Fragment::Token(7),
                Fragment::Text(2, 5),
                Fragment::Token(7),
                Fragment::Text(8, 9),
            ]
        );
    }
}
