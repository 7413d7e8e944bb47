//! Prompt-lookup drafting: propose the tokens that followed the most recent earlier occurrence of
//! the sequence's last n-gram (longest n first). A deterministic draft: its distribution is
//! one-hot, so verification keeps a token with the target's probability of it.

/// The n-gram matcher of `--lookup N`.
#[derive(Clone, Debug)]
pub struct PromptLookup {
    /// Longest n-gram matched (shorter ones are tried down to 1).
    pub ngram_max: usize,
}

impl PromptLookup {
    pub fn new(ngram_max: usize) -> PromptLookup {
        PromptLookup {
            ngram_max: ngram_max.max(1),
        }
    }

    /// The continuation (at most `max` tokens) of the most recent earlier occurrence of the last
    /// n-gram of `history`, longest n first; empty if no n-gram recurs.
    pub fn draft(&self, history: &[u32], max: usize) -> Vec<u32> {
        let len = history.len();
        for n in (1..=self.ngram_max.min(len.saturating_sub(1))).rev() {
            let tail = &history[len - n..];
            // Occurrences ending before the tail itself, most recent first.
            for start in (0..len - n).rev() {
                if &history[start..start + n] == tail {
                    let from = start + n;
                    let take = max.min(len - from);
                    if take > 0 {
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
        let l = PromptLookup::new(3);
        // "1 2 3 4 5 ... 1 2 3" → continue with "4 5".
        assert_eq!(l.draft(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // The most recent occurrence wins: "7 8" → "1" (second), not "2" (first).
        assert_eq!(l.draft(&[7, 8, 2, 7, 8, 1, 7, 8], 1), vec![1]);
        // Falls back to shorter n-grams; nothing recurs → empty.
        assert_eq!(l.draft(&[5, 6, 9, 6], 3), vec![9, 6]);
        assert!(l.draft(&[1, 2, 3], 4).is_empty());
        assert!(l.draft(&[], 4).is_empty());
    }
}
