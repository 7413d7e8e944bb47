//! Tokenizers built from GGUF metadata alone, reproducing llama.cpp's `llama-vocab.cpp` exactly.
//!
//! Owns: reading the `tokenizer.*` keys, token attributes and special ids (including llama.cpp's
//! text-based detection of end-of-generation and fill-in-the-middle tokens), encoding
//! (special-token partition → pre-tokenizer → BPE / SentencePiece merges), and decoding ids to
//! bytes as `llama_token_to_piece(special = false)` does. Two vocabulary kinds are supported:
//! `gpt2` (byte-level BPE with a merge list, module `bpe`, split into words by one of llama.cpp's
//! pre-tokenizers, module `pretok`) and `llama` (SentencePiece-style, merging by score, module
//! `spm`). [`StreamDecoder`] turns token bytes into text incrementally.
//!
//! Invariants: every id `encode` returns is `< vocab_size()`; encoding is deterministic and
//! thread-safe (`Tokenizer` is immutable after loading); `decode(encode(s, false, false)) == s`
//! for every `s` with a byte-level BPE vocabulary, and with a byte-fallback SentencePiece one when
//! `add_space_prefix` is off and `s` has no literal `▁` (which, as in llama.cpp, reads as a
//! space). Loading fails with an error naming the missing or invalid `tokenizer.*` key.

mod bpe;
mod hash;
mod pretok;
mod special;
mod spm;
mod stream;
mod unicode_classes;

use anyhow::{anyhow, bail, Result};

use crate::format::{Gguf, Value};
use hash::Vocab;
pub use pretok::PreTokenizer;
use special::{Fragment, SpecialMatcher, SpecialToken};
pub use stream::StreamDecoder;

/// llama.cpp's token attributes (`llama_token_attr`), derived from `tokenizer.ggml.token_type`.
pub mod attr {
    pub const UNDEFINED: u16 = 0;
    pub const UNKNOWN: u16 = 1 << 0;
    pub const UNUSED: u16 = 1 << 1;
    pub const NORMAL: u16 = 1 << 2;
    pub const CONTROL: u16 = 1 << 3;
    pub const USER_DEFINED: u16 = 1 << 4;
    pub const BYTE: u16 = 1 << 5;
    pub const LSTRIP: u16 = 1 << 7;
    pub const RSTRIP: u16 = 1 << 8;

    /// The attribute of a `tokenizer.ggml.token_type` value (llama.cpp's `LLAMA_TOKEN_TYPE_*`).
    pub fn from_token_type(t: i64) -> u16 {
        match t {
            1 => NORMAL,
            2 => UNKNOWN,
            3 => CONTROL,
            4 => USER_DEFINED,
            5 => UNUSED,
            6 => BYTE,
            _ => UNDEFINED,
        }
    }
}

/// Everything the tokenizer reads from a model file, as plain data. [`Tokenizer::from_gguf`]
/// fills it from the `tokenizer.*` keys, with the texts borrowed from the file (`S = &str`);
/// tests can build one by hand.
#[derive(Clone, Debug, Default)]
pub struct TokenizerSpec<S = String> {
    /// `tokenizer.ggml.model`: `"gpt2"` or `"llama"`.
    pub model: String,
    /// `tokenizer.ggml.pre` (gpt2 only; absent means `"default"`, as in llama.cpp).
    pub pre: Option<String>,
    pub tokens: Vec<S>,
    pub scores: Option<Vec<f32>>,
    pub token_types: Option<Vec<i64>>,
    pub merges: Option<Vec<S>>,
    /// `(key suffix, id)` for the special-token id keys present, e.g. `("bos_token_id", 2)`.
    pub special_ids: Vec<(String, u64)>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    /// `general.name`: llama.cpp adjusts token attributes for some model names.
    pub model_name: Option<String>,
}

#[derive(Debug)]
enum Kind {
    Spm {
        byte_tokens: Box<[Option<u32>; 256]>,
        add_space_prefix: bool,
    },
    Bpe {
        bpe: Box<bpe::Bpe>,
        char_to_byte: Vec<Option<u8>>,
    },
}

/// The special ids llama.cpp tracks.
#[derive(Clone, Copy, Debug, Default)]
struct Specials {
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    sep: Option<u32>,
    pad: Option<u32>,
    mask: Option<u32>,
    fim_pre: Option<u32>,
    fim_suf: Option<u32>,
    fim_mid: Option<u32>,
    fim_pad: Option<u32>,
    fim_rep: Option<u32>,
    fim_sep: Option<u32>,
}

/// A tokenizer for one model's vocabulary.
#[derive(Debug)]
pub struct Tokenizer {
    kind: Kind,
    vocab: Vocab,
    scores: Vec<f32>,
    attrs: Vec<u16>,
    specials: Specials,
    add_bos: bool,
    add_eos: bool,
    eog: Vec<u32>,
    matcher: SpecialMatcher,
}

const KEY_PREFIX: &str = "tokenizer.ggml.";

/// Texts llama.cpp takes as end-of-turn tokens when `eot_token_id` is absent.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
/// Texts llama.cpp always treats as end of generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

fn key(suffix: &str) -> String {
    format!("{KEY_PREFIX}{suffix}")
}

/// The strings of an array-of-strings key, borrowed from the file.
fn string_array<'a>(g: &'a Gguf, suffix: &str) -> Result<Option<Vec<&'a str>>> {
    let k = key(suffix);
    let Some(strings) = g.strings(&k) else {
        return match g.get(&k) {
            None => Ok(None),
            Some(_) => Err(anyhow!("{k}: expected an array of strings")),
        };
    };
    strings
        .iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| anyhow!("{k}[{i}]: expected a string")))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn bool_key(g: &Gguf, suffix: &str) -> Result<Option<bool>> {
    let k = key(suffix);
    match g.get(&k) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| anyhow!("{k}: expected a bool")),
    }
}

const SPECIAL_ID_KEYS: &[&str] = &[
    "bos_token_id",
    "eos_token_id",
    "eot_token_id",
    "eom_token_id",
    "unknown_token_id",
    "seperator_token_id",
    "padding_token_id",
    "mask_token_id",
    "fim_pre_token_id",
    "fim_suf_token_id",
    "fim_mid_token_id",
    "fim_pad_token_id",
    "fim_rep_token_id",
    "fim_sep_token_id",
    "prefix_token_id",
    "suffix_token_id",
    "middle_token_id",
];

impl TokenizerSpec {
    /// Reads the `tokenizer.*` keys of a GGUF file.
    pub fn from_gguf(g: &Gguf) -> Result<TokenizerSpec> {
        let b = TokenizerSpec::borrowed(g)?;
        Ok(TokenizerSpec {
            tokens: b.tokens.into_iter().map(str::to_string).collect(),
            merges: b
                .merges
                .map(|m| m.into_iter().map(str::to_string).collect()),
            model: b.model,
            pre: b.pre,
            scores: b.scores,
            token_types: b.token_types,
            special_ids: b.special_ids,
            add_bos: b.add_bos,
            add_eos: b.add_eos,
            add_space_prefix: b.add_space_prefix,
            model_name: b.model_name,
        })
    }
}

impl<'a> TokenizerSpec<&'a str> {
    /// [`TokenizerSpec::from_gguf`] with the token and merge texts borrowed from `g`.
    pub fn borrowed(g: &'a Gguf) -> Result<TokenizerSpec<&'a str>> {
        let model_key = key("model");
        let model = g
            .get(&model_key)
            .ok_or_else(|| anyhow!("{model_key}: missing"))?
            .as_str()
            .ok_or_else(|| anyhow!("{model_key}: expected a string"))?
            .to_string();
        let pre_key = key("pre");
        let pre = match g.get(&pre_key) {
            None => None,
            Some(v) => Some(
                v.as_str()
                    .ok_or_else(|| anyhow!("{pre_key}: expected a string"))?
                    .to_string(),
            ),
        };
        let tokens =
            string_array(g, "tokens")?.ok_or_else(|| anyhow!("{}: missing", key("tokens")))?;
        let scores = match g.contains_key(&key("scores")) {
            false => None,
            true => {
                let k = key("scores");
                let arr = g
                    .values(&k)
                    .ok_or_else(|| anyhow!("{k}: expected an array"))?;
                Some(
                    arr.enumerate()
                        .map(|(i, v)| match v {
                            Value::F32(_) | Value::I32(_) => v
                                .as_f32()
                                .ok_or_else(|| anyhow!("{k}[{i}]: expected a number")),
                            _ => Err(anyhow!("{k}[{i}]: expected f32 or i32")),
                        })
                        .collect::<Result<Vec<_>>>()?,
                )
            }
        };
        let token_types = match g.contains_key(&key("token_type")) {
            false => None,
            true => {
                let k = key("token_type");
                let arr = g
                    .values(&k)
                    .ok_or_else(|| anyhow!("{k}: expected an array"))?;
                Some(
                    arr.enumerate()
                        .map(|(i, v)| {
                            v.as_i64()
                                .ok_or_else(|| anyhow!("{k}[{i}]: expected an integer"))
                        })
                        .collect::<Result<Vec<_>>>()?,
                )
            }
        };
        let merges = string_array(g, "merges")?;
        let mut special_ids = Vec::new();
        for &suffix in SPECIAL_ID_KEYS {
            let k = key(suffix);
            if let Some(v) = g.get(&k) {
                match v.as_i64() {
                    Some(id) if id >= 0 => special_ids.push((suffix.to_string(), id as u64)),
                    Some(_) => {} // a negative id means "none"
                    None => bail!("{k}: expected an integer token id"),
                }
            }
        }
        let model_name = g.get_str("general.name").map(str::to_string);
        Ok(TokenizerSpec {
            model,
            pre,
            tokens,
            scores,
            token_types,
            merges,
            special_ids,
            add_bos: bool_key(g, "add_bos_token")?,
            add_eos: bool_key(g, "add_eos_token")?,
            add_space_prefix: bool_key(g, "add_space_prefix")?,
            model_name,
        })
    }
}

impl Tokenizer {
    /// Builds the tokenizer of a GGUF model; errors name the missing or invalid key.
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer> {
        Tokenizer::from_spec(TokenizerSpec::borrowed(g)?)
    }

    /// Builds a tokenizer from metadata already read (see [`TokenizerSpec`]).
    pub fn from_spec<S: AsRef<str>>(spec: TokenizerSpec<S>) -> Result<Tokenizer> {
        let TokenizerSpec {
            model,
            pre,
            tokens,
            scores,
            token_types,
            merges,
            special_ids,
            add_bos: add_bos_key,
            add_eos: add_eos_key,
            add_space_prefix: add_space_prefix_key,
            model_name,
        } = spec;
        let n = tokens.len();
        if n == 0 {
            bail!("{}: empty vocabulary", key("tokens"));
        }
        let n_u32 = u32::try_from(n).map_err(|_| anyhow!("{}: too many tokens", key("tokens")))?;

        enum Model {
            Spm,
            Bpe(PreTokenizer, bool),
        }
        // Defaults by vocabulary kind, as llama.cpp's `llama_vocab::impl::load`.
        let mut sp = Specials::default();
        let (kind_model, mut add_bos, mut add_eos, mut add_space_prefix) = match model.as_str() {
            "llama" => {
                sp.bos = Some(1);
                sp.eos = Some(2);
                sp.unk = Some(0);
                (Model::Spm, true, false, true)
            }
            "gpt2" => {
                sp.bos = Some(11);
                sp.eos = Some(11);
                let name = pre.as_deref().unwrap_or("default");
                let p = PreTokenizer::from_name(name).ok_or_else(|| {
                    anyhow!(
                        "{}: unknown pre-tokenizer type '{name}' (supported: default, gpt-2, \
                         llama-bpe and the llama3 family, qwen2 and its family)",
                        key("pre")
                    )
                })?;
                let llama3_group =
                    p == PreTokenizer::Llama3 && !matches!(name, "dbrx" | "smaug-bpe");
                (Model::Bpe(p, llama3_group), llama3_group, false, false)
            }
            other => bail!(
                "{}: unsupported tokenizer model '{other}' (supported: gpt2, llama)",
                key("model")
            ),
        };
        if let Some(v) = add_space_prefix_key {
            add_space_prefix = v;
        }

        let texts = tokens.iter().enumerate().map(|(i, t)| match t.as_ref() {
            "" => std::borrow::Cow::Owned(format!("[EMPTY_{i}]")),
            t => std::borrow::Cow::Borrowed(t),
        });
        let vocab = Vocab::new(n, texts).map_err(|(a, b)| {
            anyhow!(
                "{}: token ids {a} and {b} have the same text",
                key("tokens")
            )
        })?;
        let lookup = |t: &str| vocab.get(t);

        let scores = match scores {
            Some(s) if s.len() < n => bail!("{}: {} scores for {n} tokens", key("scores"), s.len()),
            // No NaN or -0.0, so that ordering by `total_cmp` equals llama.cpp's `<`.
            Some(mut s) => {
                s.truncate(n);
                for x in &mut s {
                    if *x == 0.0 || x.is_nan() {
                        *x = 0.0;
                    }
                }
                s
            }
            None => vec![0.0; n],
        };
        let mut attrs = match token_types {
            Some(t) if t.len() < n => bail!(
                "{}: {} token types for {n} tokens",
                key("token_type"),
                t.len()
            ),
            Some(t) => t[..n].iter().map(|&x| attr::from_token_type(x)).collect(),
            None => vec![attr::NORMAL; n],
        };

        // Special ids: defaults out of range are disabled; keys in range override.
        for id in [&mut sp.bos, &mut sp.eos, &mut sp.unk] {
            if id.is_some_and(|i| i >= n_u32) {
                *id = None;
            }
        }
        for (suffix, id) in &special_ids {
            let Ok(id) = u32::try_from(*id) else { continue };
            if id >= n_u32 {
                continue; // llama.cpp: "bad special token", keeps the default
            }
            let slot = match suffix.as_str() {
                "bos_token_id" => &mut sp.bos,
                "eos_token_id" => &mut sp.eos,
                "eot_token_id" => &mut sp.eot,
                "eom_token_id" => &mut sp.eom,
                "unknown_token_id" => &mut sp.unk,
                "seperator_token_id" => &mut sp.sep,
                "padding_token_id" => &mut sp.pad,
                "mask_token_id" => &mut sp.mask,
                "fim_pre_token_id" | "prefix_token_id" => &mut sp.fim_pre,
                "fim_suf_token_id" | "suffix_token_id" => &mut sp.fim_suf,
                "fim_mid_token_id" | "middle_token_id" => &mut sp.fim_mid,
                "fim_pad_token_id" => &mut sp.fim_pad,
                "fim_rep_token_id" => &mut sp.fim_rep,
                "fim_sep_token_id" => &mut sp.fim_sep,
                _ => continue,
            };
            *slot = Some(id);
        }
        if let Some(v) = add_bos_key {
            add_bos = v;
        }
        if let Some(v) = add_eos_key {
            add_eos = v;
        }
        if add_bos && sp.bos.is_none() {
            bail!(
                "{} is true, but {} is not set",
                key("add_bos_token"),
                key("bos_token_id")
            );
        }
        if add_eos && sp.eos.is_none() {
            bail!(
                "{} is true, but {} is not set",
                key("add_eos_token"),
                key("eos_token_id")
            );
        }

        // Text-based detection of EOT/EOM/FIM tokens; a match becomes a control token.
        let detect: [(&mut Option<u32>, &[&str]); 8] = [
            (&mut sp.eot, EOT_TEXTS),
            (&mut sp.eom, EOM_TEXTS),
            (&mut sp.fim_pre, FIM_PRE_TEXTS),
            (&mut sp.fim_suf, FIM_SUF_TEXTS),
            (&mut sp.fim_mid, FIM_MID_TEXTS),
            (&mut sp.fim_pad, FIM_PAD_TEXTS),
            (&mut sp.fim_rep, FIM_REP_TEXTS),
            (&mut sp.fim_sep, FIM_SEP_TEXTS),
        ];
        for (slot, texts) in detect {
            if slot.is_some() {
                continue;
            }
            // llama.cpp takes the first hit of a hash-map walk (e.g. `<|im_end|>` over
            // `<|endoftext|>` for Qwen); the first text of the list is the stable equivalent.
            if let Some(id) = texts.iter().find_map(|t| lookup(t)) {
                *slot = Some(id);
                attrs[id as usize] |= attr::CONTROL;
            }
        }

        // End-of-generation set.
        let mut eog: Vec<u32> = [sp.fim_pad, sp.fim_rep, sp.fim_sep]
            .into_iter()
            .flatten()
            .collect();
        for t in EOG_TEXTS {
            if let Some(id) = lookup(t) {
                eog.push(id);
                attrs[id as usize] |= attr::CONTROL;
            }
        }
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = lookup(t) {
                attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        eog.extend([sp.eos, sp.eot, sp.eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();
        let text_of = |id: u32| vocab.token(id as usize);
        let has = |eog: &[u32], t: &str| eog.iter().copied().find(|&id| text_of(id) == t);
        if let Some(end) = has(&eog, "<|end|>") {
            let call = has(&eog, "<|call|>").or(has(&eog, "<|calls|>"));
            if (has(&eog, "<|return|>").is_some() && call.is_some())
                || (call.is_some() && has(&eog, "<|flush|>").is_some())
            {
                eog.retain(|&x| x != end);
                attrs[end as usize] = attr::USER_DEFINED;
            }
        }
        if has(&eog, "<|tool_response>").is_some() {
            if let Some(s) = has(&eog, "</s>") {
                eog.retain(|&x| x != s);
                attrs[s as usize] = attr::NORMAL;
            }
        }

        // Special tokens, longest first (ties by id), and model-specific strip attributes.
        let mut special_ids_sorted: Vec<u32> = (0..n_u32)
            .filter(|&i| {
                attrs[i as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .collect();
        special_ids_sorted.sort_by_key(|&i| std::cmp::Reverse(vocab.token(i as usize).len()));
        let name = model_name.unwrap_or_default().to_lowercase();
        if name.contains("phi-3") || name.contains("phi3") {
            for &id in &special_ids_sorted {
                attrs[id as usize] |= attr::RSTRIP;
            }
            if let Some(id) = lookup("</s>") {
                attrs[id as usize] |= attr::RSTRIP;
            }
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(id) = lookup(t) {
                    attrs[id as usize] &= !attr::RSTRIP;
                }
            }
        }
        let matcher = SpecialMatcher::new(
            special_ids_sorted
                .iter()
                .map(|&id| {
                    let a = attrs[id as usize];
                    (
                        SpecialToken {
                            id,
                            parse_only: a & (attr::CONTROL | attr::UNKNOWN) != 0,
                            lstrip: a & attr::LSTRIP != 0,
                            rstrip: a & attr::RSTRIP != 0,
                        },
                        vocab.token(id as usize),
                    )
                })
                .collect(),
        );

        let kind = match kind_model {
            Model::Spm => {
                let mut byte_tokens = Box::new([None; 256]);
                for (b, slot) in byte_tokens.iter_mut().enumerate() {
                    *slot = lookup(&format!("<0x{b:02X}>")).or_else(|| {
                        u8::try_from(b)
                            .ok()
                            .filter(u8::is_ascii)
                            .and_then(|b| lookup(&char::from(b).to_string()))
                    });
                }
                Kind::Spm {
                    byte_tokens,
                    add_space_prefix,
                }
            }
            Model::Bpe(pre, ignore_merges) => {
                let merges = merges.ok_or_else(|| anyhow!("{}: missing", key("merges")))?;
                Kind::Bpe {
                    bpe: Box::new(bpe::Bpe::new(&merges, &vocab, pre, ignore_merges)),
                    char_to_byte: bpe::char_to_byte_table(),
                }
            }
        };

        Ok(Tokenizer {
            kind,
            scores,
            attrs,
            vocab,
            specials: sp,
            add_bos,
            add_eos,
            eog,
            matcher,
        })
    }

    /// Encodes `text`. `add_bos` prepends the BOS token (an error if the model has none);
    /// `parse_special` lets control tokens written in the text (e.g. `<|im_start|>`) become those
    /// tokens, as llama.cpp's `parse_special`. User-defined tokens are always matched. EOS is never
    /// appended (llama.cpp appends it only for models with `add_eos_token`, see
    /// [`add_eos_default`](Self::add_eos_default)); `encode(s, add_bos_default(), true)` equals
    /// llama.cpp's `llama_tokenize(s, add_special = true, parse_special = true)` for such models.
    pub fn encode(&self, text: &str, add_bos: bool, parse_special: bool) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos {
            let bos = self
                .specials
                .bos
                .ok_or_else(|| anyhow!("this model has no BOS token ({})", key("bos_token_id")))?;
            out.push(bos);
        }
        let frags = self.matcher.partition(text, parse_special);
        match &self.kind {
            Kind::Spm {
                byte_tokens,
                add_space_prefix,
            } => {
                let vocab = spm::SpmVocab {
                    vocab: &self.vocab,
                    scores: &self.scores,
                    byte_tokens,
                    unk: self.specials.unk,
                };
                let mut prev_special = true;
                let mut buf = String::new();
                for f in frags {
                    match f {
                        Fragment::Text(a, b) => {
                            buf.clear();
                            if *add_space_prefix && prev_special {
                                buf.push('▁');
                            }
                            for ch in text[a..b].chars() {
                                buf.push(if ch == ' ' { '▁' } else { ch });
                            }
                            spm::encode(&vocab, &buf, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Kind::Bpe { bpe, .. } => {
                let mut scratch = bpe::Scratch::default();
                for f in frags {
                    match f {
                        Fragment::Text(a, b) => {
                            let frag = &text[a..b];
                            for (s, e) in bpe.pre.split(frag) {
                                let word = &frag.as_bytes()[s..e];
                                bpe.encode_word(word, &self.vocab, &mut scratch, &mut out);
                            }
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        Ok(out)
    }

    /// `tokenizer.ggml.add_bos_token`, or llama.cpp's default when absent (true for SentencePiece
    /// vocabularies and the llama3 pre-tokenizer family, false for other gpt2 ones).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos
    }

    /// `tokenizer.ggml.add_eos_token`, or llama.cpp's default (false).
    pub fn add_eos_default(&self) -> bool {
        self.add_eos
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.specials.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.specials.eos
    }

    /// The end-of-turn token (from the key, else detected by text like `<|im_end|>`).
    pub fn eot_id(&self) -> Option<u32> {
        self.specials.eot
    }

    /// Whether generation stops at `id`: EOS, EOT, EOM, FIM pad/repo/file-separator and every
    /// token whose text llama.cpp lists as end of generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The raw vocabulary string of `id` (`""` for an id outside the vocabulary).
    pub fn token_text(&self, id: u32) -> &str {
        self.vocab.try_token(id as usize).unwrap_or("")
    }

    /// The llama.cpp attributes of `id` (see [`attr`]); `UNDEFINED` outside the vocabulary.
    pub fn token_attr(&self, id: u32) -> u16 {
        self.attrs
            .get(id as usize)
            .copied()
            .unwrap_or(attr::UNDEFINED)
    }

    /// The bytes `id` contributes to output text, as llama.cpp's `token_to_piece` with
    /// `special = false`: control and unknown tokens give nothing, user-defined tokens their text,
    /// byte tokens their byte, normal tokens their text decoded (byte-level for gpt2, `▁` → space
    /// for SentencePiece).
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let mut out = Vec::new();
        self.append_token_bytes(id, &mut out);
        out
    }

    fn append_token_bytes(&self, id: u32, out: &mut Vec<u8>) {
        let Some(text) = self.vocab.try_token(id as usize) else {
            return;
        };
        let a = self.attrs[id as usize];
        if a & (attr::CONTROL | attr::UNKNOWN) != 0 {
            return;
        }
        if a & attr::USER_DEFINED != 0 {
            out.extend_from_slice(text.as_bytes());
        } else if a & attr::NORMAL != 0 {
            match &self.kind {
                Kind::Spm { .. } => {
                    let mut buf = [0u8; 4];
                    for ch in text.chars() {
                        let ch = if ch == '▁' { ' ' } else { ch };
                        out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                    }
                }
                Kind::Bpe { char_to_byte, .. } => {
                    for ch in text.chars() {
                        match char_to_byte.get(ch as usize).copied().flatten() {
                            Some(b) => out.push(b),
                            None => {
                                // llama.cpp's `llama_decode_text` for a char outside the alphabet.
                                out.extend_from_slice(b"[UNK_BYTE_0x");
                                let mut buf = [0u8; 4];
                                for b in ch.encode_utf8(&mut buf).bytes() {
                                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                                }
                                out.extend_from_slice(text.as_bytes());
                                out.push(b']');
                            }
                        }
                    }
                }
            }
        } else if a & attr::BYTE != 0 {
            out.push(byte_token_value(text));
        }
    }

    /// The text of `ids`: their [`token_bytes`](Self::token_bytes) concatenated, decoded as
    /// UTF-8 with invalid sequences replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            self.append_token_bytes(id, &mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The byte of a `<0xXX>` token (llama.cpp: `strtol(text.substr(3, 2), 16)`).
fn byte_token_value(text: &str) -> u8 {
    let hex = text.get(3..5).unwrap_or("");
    let digits: String = hex.chars().take_while(char::is_ascii_hexdigit).collect();
    u8::from_str_radix(&digits, 16).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(model: &str, tokens: &[&str], types: &[i64]) -> TokenizerSpec {
        TokenizerSpec {
            model: model.to_string(),
            tokens: tokens.iter().map(|s| s.to_string()).collect(),
            token_types: Some(types.to_vec()),
            ..TokenizerSpec::default()
        }
    }

    #[test]
    fn eog_set_mirrors_llama_cpp_text_rules() {
        // "</s>" is a normal token here; llama.cpp still makes it EOG and control.
        let mut s = spec(
            "llama",
            &["<unk>", "<s>", "<eos>", "a", "</s>", "<|im_end|>", "<0x61>"],
            &[2, 3, 3, 1, 1, 3, 6],
        );
        s.special_ids = vec![("eos_token_id".into(), 2), ("bos_token_id".into(), 1)];
        s.add_space_prefix = Some(false);
        let t = Tokenizer::from_spec(s).unwrap();
        assert_eq!(t.eog_ids(), [2, 4, 5]);
        assert!(t.is_eog(4) && !t.is_eog(3));
        assert_eq!(t.eot_id(), Some(5));
        assert_eq!(t.token_bytes(4), b"");
        assert_eq!(t.encode("a</s>a", false, true).unwrap(), [3, 4, 3]);
        assert_eq!(t.token_bytes(6), b"a");
        assert!(t.add_bos_default());
        assert_eq!(t.encode("a", true, true).unwrap(), [1, 3]);
    }

    #[test]
    fn load_errors_name_the_key() {
        let mut s = spec("gpt2", &["a"], &[1]);
        s.pre = Some("nonesuch".into());
        let e = Tokenizer::from_spec(s).unwrap_err().to_string();
        assert!(
            e.contains("tokenizer.ggml.pre") && e.contains("nonesuch"),
            "{e}"
        );
        let s = spec("gpt2", &["a"], &[1]);
        let e = Tokenizer::from_spec(s).unwrap_err().to_string();
        assert!(e.contains("tokenizer.ggml.merges"), "{e}");
        let s = spec("bert", &["a"], &[1]);
        let e = Tokenizer::from_spec(s).unwrap_err().to_string();
        assert!(
            e.contains("tokenizer.ggml.model") && e.contains("bert"),
            "{e}"
        );
        let mut s = spec("llama", &["a", "b"], &[1, 1]);
        s.scores = Some(vec![0.0]);
        let e = Tokenizer::from_spec(s).unwrap_err().to_string();
        assert!(e.contains("tokenizer.ggml.scores"), "{e}");
    }

    #[test]
    fn tokenizer_and_stream_decoder_can_be_shared_across_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<Tokenizer>();
        shareable::<StreamDecoder>();
    }

    #[test]
    fn byte_token_values_parse_as_hex() {
        assert_eq!(byte_token_value("<0x0A>"), 10);
        assert_eq!(byte_token_value("<0xFF>"), 255);
        assert_eq!(byte_token_value("<0x"), 0);
    }
}
