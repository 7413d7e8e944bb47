//! The vocabulary as llguidance sees it: every token id's bytes in a [`TokTrie`], built once per
//! model from infer's own tokenizer.
//!
//! Invariants: the trie has one entry per logit (the model's row width, which may exceed the
//! tokenizer's list); a token that writes text (normal, user-defined, byte) is its output bytes
//! exactly as [`Tokenizer::token_bytes`] gives them, so what the grammar sees is what the user
//! reads; every other token (control, unknown, unused, padding, ids past the list) is a special
//! word, `0xFF` followed by its name, which no grammar terminal can match, so a constraint never
//! allows it except as the end of generation (see `Constraint::apply`).

use llguidance::toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;

/// infer's tokenizer behind llguidance's [`TokenizerEnv`].
pub struct Vocab {
    trie: TokTrie,
}

impl Vocab {
    /// The trie of `tok`'s vocabulary padded to `n_logits` ids; `eos` is the id llguidance uses
    /// for "the grammar may end here" (any end-of-generation id of the tokenizer).
    pub fn new(tok: &Tokenizer, n_logits: usize, eos: u32) -> Vocab {
        let n = n_logits.max(tok.vocab_size());
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tok.token_bytes(id);
                let text = tok.token_attr(id) & crate::tokenizer::attr::CONTROL == 0;
                if text && !bytes.is_empty() {
                    bytes
                } else {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    match tok.token_text(id) {
                        "" => w.extend_from_slice(format!("[{id}]").as_bytes()),
                        name => w.extend_from_slice(name.as_bytes()),
                    }
                    w
                }
            })
            .collect();
        let info = TokRxInfo {
            vocab_size: n as u32,
            tok_eos: eos,
            tok_bos: tok.bos_id(),
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        Vocab {
            trie: TokTrie::from(&info, &words),
        }
    }
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The trie's greedy split. llguidance tokenizes only to force tokens, which infer does not
    /// ask for: every token is sampled through the mask.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    /// The greedy split is not the model's: never force tokens from it.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}
