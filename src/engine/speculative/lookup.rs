//! Prompt-lookup drafting: propose the tokens that followed the most recent earlier occurrence of
//! the sequence's last n-gram (longest n first). A deterministic draft: its distribution is
//! one-hot, so verification keeps a token with the target's probability of it.
//!
//! While the output copies a passage the drafter stays on it: it remembers where its last draft
//! was taken from, and if the tokens appended since then are exactly that source's next tokens
//! (the copy held), the next draft continues from the same place instead of searching again,
//! where the most recent occurrence of a common n-gram (`) {`, an indent) would often be another
//! passage. Invariant: a draft only ever depends on the history, never on the target's choices
//! still to come.

/// The n-gram matcher of `--lookup N`.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    /// Longest n-gram matched (shorter ones are tried down to 1).
    pub ngram_max: usize,
    /// Where the last draft came from: `(history length then, index of its first token)`.
    source: Option<(usize, usize)>,
}

impl PromptLookup {
    pub fn new(ngram_max: usize) -> PromptLookup {
        PromptLookup {
            ngram_max: ngram_max.max(1),
            source: None,
        }
    }

    /// The continuation (at most `max` tokens) of the passage the last draft copied, if the tokens
    /// appended since are that passage's; else of the most recent earlier occurrence of the last
    /// n-gram of `history`, longest n first; empty if no n-gram recurs.
    pub fn draft(&mut self, history: &[u32], max: usize) -> Vec<u32> {
        let len = history.len();
        if let Some((then, from)) = self.source {
            // The source's position for the next token if everything appended since copied it.
            let next = from + len.saturating_sub(then);
            if len > then && next < len && history[from..next] == history[then..len] {
                let take = max.min(len - next);
                self.source = Some((len, next));
                return history[next..next + take].to_vec();
            }
        }
        self.source = None;
        for n in (1..=self.ngram_max.min(len.saturating_sub(1))).rev() {
            let tail = &history[len - n..];
            // Occurrences ending before the tail itself, most recent first.
            for start in (0..len - n).rev() {
                if &history[start..start + n] == tail {
                    let from = start + n;
                    let take = max.min(len - from);
                    if take > 0 {
                        self.source = Some((len, from));
                        return history[from..from + take].to_vec();
                    }
                }
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_continues_the_latest_longest_match() {
        let mut l = PromptLookup::new(3);
        // "1 2 3 4 5 ... 1 2 3" → continue with "4 5".
        assert_eq!(l.draft(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // The most recent occurrence wins: "7 8" → "1" (second), not "2" (first).
        assert_eq!(l.draft(&[7, 8, 2, 7, 8, 1, 7, 8], 1), vec![1]);
        // Falls back to shorter n-grams; nothing recurs → empty.
        assert_eq!(l.draft(&[5, 6, 9, 6], 3), vec![9, 6]);
        assert!(l.draft(&[1, 2, 3], 4).is_empty());
        assert!(l.draft(&[], 4).is_empty());
    }

    #[test]
    fn a_held_copy_keeps_its_source() {
        // Source passage A = 10 11 12 13 14 15; a later "12 13" (passage B) is followed by 99.
        let passage = [10, 11, 12, 13, 14, 15, 7, 12, 13, 99, 8, 10, 11];
        let mut l = PromptLookup::new(2);
        // "10 11" matches passage A: draft "12 13".
        assert_eq!(l.draft(&passage, 2), vec![12, 13]);
        // Both were kept: the copy held, so the draft goes on from A ("14 15"), although the most
        // recent "12 13" (passage B) continues with 99.
        let mut h = passage.to_vec();
        h.extend([12, 13]);
        assert_eq!(l.draft(&h, 2), vec![14, 15]);
        // A token that is not the source's next one breaks the copy: back to the n-gram search
        // ("13 50" never occurred, "50" neither).
        h.extend([14, 50]);
        assert!(l.draft(&h, 2).is_empty());
        // Without history of a draft the search picks the most recent "12 13" (passage B).
        let mut fresh = PromptLookup::new(2);
        assert_eq!(fresh.draft(&passage[..9], 1), vec![14]);
        let mut h2 = passage.to_vec();
        h2.extend([12, 13]);
        assert_eq!(PromptLookup::new(2).draft(&h2, 1), vec![99]);
    }
}
