//! Tokenizer metadata for a converted model: `tokenizer.json`, `tokenizer_config.json` and
//! `config.json` of a Hugging Face checkpoint turned into the `tokenizer.*` keys llama.cpp's
//! converter writes.
//!
//! Two vocabulary kinds come out, chosen from the tokenizer itself rather than the architecture:
//! - byte-level BPE (GPT-2 style: a `ByteLevel` pre-tokenizer or decoder) → `tokenizer.ggml.model =
//!   "gpt2"` with tokens, token types, merges and `tokenizer.ggml.pre`, as `_set_vocab_gpt2` does.
//!   The pre-tokenizer name is recognised from the split regex (Qwen2, Llama 3, GPT-2), not from
//!   llama.cpp's hash of sample encodings; an unknown regex is an error naming it.
//! - SentencePiece-style BPE (`byte_fallback`, `▁` for spaces: Llama 2, Mistral, Gemma) →
//!   `"llama"` with tokens, token types and scores, as `_set_vocab_llama_hf` does, except that the
//!   scores are `-rank` of the merge that produces each token (llama.cpp's SentencePiece tokenizer
//!   merges by score, so this reproduces the BPE merge order; `LlamaHfVocab` writes -1000 for
//!   every token, which does not).
//!
//! Special token ids, `add_*_token` flags and the chat template follow gguf-py's `SpecialVocab`:
//! `tokenizer_config.json` first (token strings resolved through `added_tokens`), then the
//! post-processor template, then `*_token_id` in `config.json` for those still unset.
//!
//! Invariants: exactly `n_vocab` tokens are written (ids the tokenizer does not define become
//! `[PAD{id}]`, type UNUSED); every special id written is `< n_vocab`; a token id the tokenizer
//! defines at or past `n_vocab` is an error.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{Map, Value as Json};

use crate::format::Value;

/// llama.cpp's token types (`LLAMA_TOKEN_TYPE_*`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Known pre-tokenizer split regexes and the `tokenizer.ggml.pre` names llama.cpp gives them.
const KNOWN_PRE: [(&str, &str); 3] = [
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen2",
    ),
    (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "llama-bpe",
    ),
    (
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
        "gpt-2",
    ),
];

fn read_json(path: &Path) -> Result<Json> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn read_json_opt(path: &Path) -> Result<Option<Json>> {
    if path.is_file() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// One entry of `tokenizer.json`'s `added_tokens`.
#[derive(Clone, Debug)]
struct Added {
    id: usize,
    content: String,
    special: bool,
}

/// gguf-py's `does_token_look_special`.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

fn is_byte_token(t: &str) -> bool {
    let b = t.as_bytes();
    b.len() == 6
        && t.starts_with("<0x")
        && t.ends_with('>')
        && b[3].is_ascii_hexdigit()
        && b[4].is_ascii_hexdigit()
}

/// True when `v` (a pre-tokenizer or decoder) is, or contains, a `ByteLevel` step.
fn has_type(v: Option<&Json>, ty: &str) -> bool {
    let Some(v) = v else { return false };
    if v.get("type").and_then(Json::as_str) == Some(ty) {
        return true;
    }
    ["pretokenizers", "decoders", "normalizers"]
        .iter()
        .filter_map(|k| v.get(*k).and_then(Json::as_array))
        .flatten()
        .any(|x| has_type(Some(x), ty))
}

/// Every `Split` regex in a pre-tokenizer (in order).
fn split_regexes(v: Option<&Json>, out: &mut Vec<String>) {
    let Some(v) = v else { return };
    if v.get("type").and_then(Json::as_str) == Some("Split") {
        if let Some(r) = v.pointer("/pattern/Regex").and_then(Json::as_str) {
            out.push(r.to_owned());
        }
    }
    if let Some(list) = v.get("pretokenizers").and_then(Json::as_array) {
        for x in list {
            split_regexes(Some(x), out);
        }
    }
}

/// `tokenizer.ggml.pre` for a byte-level BPE tokenizer.
fn detect_pre(tok: &Json) -> Result<&'static str> {
    let pre = tok.get("pre_tokenizer").filter(|v| !v.is_null());
    let mut regexes = Vec::new();
    split_regexes(pre, &mut regexes);
    match regexes.as_slice() {
        [] => {
            // A bare ByteLevel pre-tokenizer applies the GPT-2 regex itself.
            let uses_regex = pre
                .map(|p| {
                    p.get("type").and_then(Json::as_str) == Some("ByteLevel")
                        && p.get("use_regex").and_then(Json::as_bool).unwrap_or(true)
                })
                .unwrap_or(false);
            if uses_regex {
                Ok("gpt-2")
            } else {
                bail!("tokenizer.json: unrecognised byte-level pre-tokenizer {pre:?}; supported: the GPT-2, Llama 3 and Qwen2 splitters")
            }
        }
        [one] => KNOWN_PRE
            .iter()
            .find(|(re, _)| re == one)
            .map(|&(_, name)| name)
            .with_context(|| {
                format!(
                    "tokenizer.json: unrecognised pre-tokenizer regex {one:?}; supported: the GPT-2, \
                     Llama 3 (llama-bpe) and Qwen2 splitters"
                )
            }),
        many => bail!(
            "tokenizer.json: {} chained pre-tokenizer regexes are not supported: {many:?}",
            many.len()
        ),
    }
}

/// Whether a SentencePiece-style tokenizer prepends `▁` to the text (`add_space_prefix`).
fn spm_adds_space_prefix(tok: &Json) -> bool {
    fn prepends(v: &Json) -> bool {
        match v.get("type").and_then(Json::as_str) {
            Some("Prepend") => v.get("prepend").and_then(Json::as_str) == Some("▁"),
            Some("Metaspace") => {
                v.get("add_prefix_space").and_then(Json::as_bool) == Some(true)
                    || matches!(
                        v.get("prepend_scheme").and_then(Json::as_str),
                        Some("always" | "first")
                    )
            }
            Some("Sequence") => ["normalizers", "pretokenizers"]
                .iter()
                .filter_map(|k| v.get(*k).and_then(Json::as_array))
                .flatten()
                .any(prepends),
            _ => false,
        }
    }
    ["normalizer", "pre_tokenizer"]
        .iter()
        .filter_map(|k| tok.get(*k))
        .any(prepends)
}

/// gguf-py's `SpecialVocab`, as ordered `(key, value)` pairs.
struct Specials {
    ids: Vec<(&'static str, u64)>,
    add: Vec<(&'static str, bool)>,
}

impl Specials {
    fn set_id(&mut self, typ: &'static str, id: Option<i64>, n_vocab: Option<usize>) {
        let Some(id) = id.filter(|&i| i >= 0) else {
            return;
        };
        if n_vocab.is_some_and(|n| id as usize >= n) || self.ids.iter().any(|(t, _)| *t == typ) {
            return;
        }
        self.ids.push((typ, id as u64));
    }

    fn set_add(&mut self, typ: &'static str, v: bool) {
        match self.add.iter_mut().find(|(t, _)| *t == typ) {
            Some((_, old)) => *old = v,
            None => self.add.push((typ, v)),
        }
    }
}

const SPECIAL_TYPES: [&str; 7] = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];

fn special_key(typ: &str) -> Option<&'static str> {
    Some(match typ {
        "bos" => "tokenizer.ggml.bos_token_id",
        "eos" => "tokenizer.ggml.eos_token_id",
        "unk" => "tokenizer.ggml.unknown_token_id",
        "sep" => "tokenizer.ggml.seperator_token_id",
        "pad" => "tokenizer.ggml.padding_token_id",
        "mask" => "tokenizer.ggml.mask_token_id",
        "eot" => "tokenizer.ggml.eot_token_id",
        "eom" => "tokenizer.ggml.eom_token_id",
        _ => return None,
    })
}

/// The string content of a `tokenizer_config.json` `*_token` entry (a string or `{content}`).
fn token_content(v: Option<&Json>) -> Option<&str> {
    match v? {
        Json::String(s) => Some(s),
        Json::Object(o) => o.get("content").and_then(Json::as_str),
        _ => None,
    }
}

fn load_specials(
    tok: &Json,
    added: &[Added],
    tcfg: Option<&Map<String, Json>>,
    config: &Map<String, Json>,
    n_vocab: Option<usize>,
) -> Specials {
    let mut s = Specials {
        ids: Vec::new(),
        add: Vec::new(),
    };
    let cfg_str = |k: &str| token_content(tcfg.and_then(|c| c.get(k)));
    let special_bos = cfg_str("bos_token").or(cfg_str("cls_token"));
    let special_eos = cfg_str("eos_token").or(cfg_str("sep_token"));
    let special_cls = cfg_str("cls_token");
    if let Some(pp) = tok.get("post_processor").filter(|p| !p.is_null()) {
        let procs: Vec<&Json> = match pp.get("processors").and_then(Json::as_array) {
            Some(list) => list.iter().collect(),
            None => vec![pp],
        };
        for p in procs {
            match p.get("type").and_then(Json::as_str) {
                Some("RobertaProcessing") => {
                    s.set_add("bos", true);
                    s.set_add("eos", true);
                    s.set_add("sep", true);
                }
                Some("TemplateProcessing") => {
                    let single = p.get("single").and_then(Json::as_array);
                    let Some(single) = single.filter(|v| v.len() > 1) else {
                        continue;
                    };
                    let special_id = |x: &Json| {
                        x.pointer("/SpecialToken/id")
                            .and_then(Json::as_str)
                            .map(str::to_owned)
                    };
                    if let Some(first) = special_id(&single[0]) {
                        let bos = if tcfg.is_none() {
                            Some(first.as_str())
                        } else {
                            special_bos
                        };
                        s.set_add(
                            "bos",
                            Some(first.as_str()) == bos || Some(first.as_str()) == special_cls,
                        );
                    }
                    if let Some(last) = single.last().and_then(special_id) {
                        let eos = if tcfg.is_none() {
                            Some(last.as_str())
                        } else {
                            special_eos
                        };
                        s.set_add("eos", Some(last.as_str()) == eos);
                    }
                }
                _ => {}
            }
        }
    }
    if let Some(tc) = tcfg {
        for typ in SPECIAL_TYPES {
            if let Some(b) = tc.get(&format!("add_{typ}_token")).and_then(Json::as_bool) {
                s.set_add(typ, b);
            }
            let content = match typ {
                "bos" => special_bos,
                "eos" => special_eos,
                _ => token_content(tc.get(&format!("{typ}_token"))),
            };
            let id =
                content.and_then(|c| added.iter().find(|a| a.content == c).map(|a| a.id as i64));
            s.set_id(typ, id, n_vocab);
        }
    }
    let text_config = config.get("text_config").and_then(Json::as_object);
    for typ in SPECIAL_TYPES {
        let key = format!("{typ}_token_id");
        let v = config
            .get(&key)
            .filter(|v| !v.is_null())
            .or_else(|| text_config.and_then(|t| t.get(&key)));
        // A list of ids (e.g. several EOS tokens in generation configs) is not a single id.
        s.set_id(typ, v.and_then(Json::as_i64), n_vocab);
    }
    s
}

/// The chat template(s): `tokenizer_config.json`'s `chat_template`, else `chat_template.jinja`,
/// else `chat_template.json`, as gguf-py's `add_chat_template` writes them.
fn chat_template_kvs(dir: &Path, tcfg: Option<&Map<String, Json>>) -> Result<Vec<(String, Value)>> {
    let mut tmpl = tcfg.and_then(|c| c.get("chat_template")).cloned();
    if tmpl.is_none() {
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            tmpl = Some(Json::String(
                std::fs::read_to_string(&jinja)
                    .with_context(|| format!("reading {}", jinja.display()))?,
            ));
        } else if let Some(j) = read_json_opt(&dir.join("chat_template.json"))? {
            tmpl = j.get("chat_template").cloned();
        }
    }
    let mut out = Vec::new();
    match tmpl {
        Some(Json::String(s)) => out.push(("tokenizer.chat_template".to_owned(), Value::String(s))),
        Some(Json::Array(list)) => {
            let mut default = None;
            let mut names = Vec::new();
            for choice in list {
                let name: String = choice
                    .get("name")
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                    .collect();
                let Some(t) = choice.get("template").and_then(Json::as_str) else {
                    continue;
                };
                if name.is_empty() {
                    continue;
                }
                if name == "default" {
                    default = Some(t.to_owned());
                } else {
                    out.push((
                        format!("tokenizer.chat_template.{name}"),
                        Value::String(t.to_owned()),
                    ));
                    names.push(Value::String(name));
                }
            }
            if !names.is_empty() {
                out.push(("tokenizer.chat_templates".to_owned(), Value::Array(names)));
            }
            if let Some(d) = default {
                out.push(("tokenizer.chat_template".to_owned(), Value::String(d)));
            }
        }
        _ => {}
    }
    Ok(out)
}

/// A parsed `tokenizer.json` plus its companions.
pub struct HfTokenizer {
    dir: std::path::PathBuf,
    tok: Json,
    tcfg: Option<Map<String, Json>>,
    vocab: Vec<(String, usize)>,
    added: Vec<Added>,
}

impl HfTokenizer {
    /// Reads `tokenizer.json` (required) and `tokenizer_config.json` (optional) from `dir`.
    pub fn load(dir: &Path) -> Result<HfTokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            bail!(
                "{} not found: only checkpoints with a Hugging Face fast tokenizer (tokenizer.json) \
                 can be converted",
                path.display()
            );
        }
        let tok = read_json(&path)?;
        let model = tok
            .get("model")
            .context("tokenizer.json has no \"model\"")?;
        let ty = model.get("type").and_then(Json::as_str).unwrap_or("?");
        if ty != "BPE" {
            bail!("tokenizer.json: tokenizer model type {ty:?} is not supported (only BPE)");
        }
        let vocab_map = model
            .get("vocab")
            .and_then(Json::as_object)
            .context("tokenizer.json: model.vocab is not an object")?;
        let mut vocab = Vec::with_capacity(vocab_map.len());
        for (t, id) in vocab_map {
            let id = id
                .as_u64()
                .with_context(|| format!("tokenizer.json: token {t:?} has a non-integer id"))?;
            vocab.push((t.clone(), id as usize));
        }
        let mut added = Vec::new();
        for a in tok
            .get("added_tokens")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
        {
            let (Some(id), Some(content)) = (
                a.get("id").and_then(Json::as_u64),
                a.get("content").and_then(Json::as_str),
            ) else {
                bail!("tokenizer.json: malformed added_tokens entry {a}");
            };
            added.push(Added {
                id: id as usize,
                content: content.to_owned(),
                special: a.get("special").and_then(Json::as_bool).unwrap_or(false),
            });
        }
        let tcfg =
            read_json_opt(&dir.join("tokenizer_config.json"))?.and_then(|v| v.as_object().cloned());
        Ok(HfTokenizer {
            dir: dir.to_path_buf(),
            tok,
            tcfg,
            vocab,
            added,
        })
    }

    /// Distinct token ids defined: base vocabulary plus added tokens (Gemma 3's converter trims
    /// the embedding to `len(vocab) + len(added_tokens)` rows).
    pub fn gemma_real_count(&self) -> usize {
        self.vocab.len() + self.added.len()
    }

    /// True for a SentencePiece-style (byte-fallback) BPE vocabulary.
    pub fn is_spm(&self) -> bool {
        self.tok
            .pointer("/model/byte_fallback")
            .and_then(Json::as_bool)
            == Some(true)
    }

    /// The `tokenizer.*` metadata for a model with `n_vocab` token embeddings. `config` is
    /// `config.json` (for `*_token_id`).
    pub fn metadata(
        &self,
        n_vocab: usize,
        config: &Map<String, Json>,
    ) -> Result<Vec<(String, Value)>> {
        let mut tokens: Vec<Option<String>> = vec![None; n_vocab];
        let mut put = |t: &str, id: usize| -> Result<()> {
            match tokens.get_mut(id) {
                Some(slot) => {
                    *slot = Some(t.to_owned());
                    Ok(())
                }
                None => bail!(
                    "tokenizer.json: token {t:?} has id {id}, outside the model's {n_vocab} token embeddings"
                ),
            }
        };
        for (t, id) in &self.vocab {
            put(t, *id)?;
        }
        for a in &self.added {
            put(&a.content, a.id)?;
        }
        let added_by_content: HashMap<&str, &Added> =
            self.added.iter().map(|a| (a.content.as_str(), a)).collect();

        let mut kv: Vec<(String, Value)> = Vec::new();
        let mut types = Vec::with_capacity(n_vocab);
        let mut texts = Vec::with_capacity(n_vocab);
        let spm = self.is_spm();
        if spm {
            let unk = self
                .tok
                .pointer("/model/unk_token")
                .and_then(Json::as_str)
                .and_then(|u| self.vocab.iter().find(|(t, _)| t == u).map(|&(_, id)| id));
            let merges = self.merges()?;
            let mut score_of: HashMap<String, f32> = HashMap::new();
            for (rank, m) in merges.iter().enumerate() {
                if let Some((a, b)) = m.split_once(' ') {
                    score_of.entry(format!("{a}{b}")).or_insert(-(rank as f32));
                }
            }
            let floor = -(merges.len() as f32) - 1.0;
            let mut scores = Vec::with_capacity(n_vocab);
            for (id, t) in tokens.iter().enumerate() {
                let Some(t) = t else {
                    texts.push(Value::String(format!("[PAD{id}]")));
                    types.push(Value::I32(token_type::UNUSED));
                    scores.push(Value::F32(floor));
                    continue;
                };
                let ty = if Some(id) == unk {
                    token_type::UNKNOWN
                } else if is_byte_token(t) {
                    token_type::BYTE
                } else if let Some(a) = added_by_content.get(t.as_str()) {
                    if a.special || looks_special(t) {
                        token_type::CONTROL
                    } else {
                        token_type::USER_DEFINED
                    }
                } else {
                    token_type::NORMAL
                };
                texts.push(Value::String(t.clone()));
                types.push(Value::I32(ty));
                scores.push(Value::F32(score_of.get(t).copied().unwrap_or(floor)));
            }
            kv.push(str_kv("tokenizer.ggml.model", "llama"));
            kv.push(str_kv("tokenizer.ggml.pre", "default"));
            kv.push(("tokenizer.ggml.tokens".into(), Value::Array(texts)));
            kv.push(("tokenizer.ggml.scores".into(), Value::Array(scores)));
            kv.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
        } else {
            if !has_type(self.tok.get("pre_tokenizer"), "ByteLevel")
                && !has_type(self.tok.get("decoder"), "ByteLevel")
            {
                bail!(
                    "tokenizer.json: a BPE tokenizer that is neither byte-level (GPT-2 style) nor \
                     byte-fallback (SentencePiece style) is not supported"
                );
            }
            let pre = detect_pre(&self.tok)?;
            for (id, t) in tokens.iter().enumerate() {
                let Some(t) = t else {
                    texts.push(Value::String(format!("[PAD{id}]")));
                    types.push(Value::I32(token_type::UNUSED));
                    continue;
                };
                let (text, ty) = match added_by_content.get(t.as_str()) {
                    Some(a) if a.special || looks_special(t) => (t.clone(), token_type::CONTROL),
                    Some(_) => (t.replace('▁', " "), token_type::USER_DEFINED),
                    None => (t.clone(), token_type::NORMAL),
                };
                texts.push(Value::String(text));
                types.push(Value::I32(ty));
            }
            kv.push(str_kv("tokenizer.ggml.model", "gpt2"));
            kv.push(str_kv("tokenizer.ggml.pre", pre));
            kv.push(("tokenizer.ggml.tokens".into(), Value::Array(texts)));
            kv.push(("tokenizer.ggml.token_type".into(), Value::Array(types)));
            let merges = self.merges()?;
            if !merges.is_empty() {
                kv.push((
                    "tokenizer.ggml.merges".into(),
                    Value::Array(merges.into_iter().map(Value::String).collect()),
                ));
            }
        }

        let specials = load_specials(
            &self.tok,
            &self.added,
            self.tcfg.as_ref(),
            config,
            spm.then_some(n_vocab),
        );
        for (typ, id) in &specials.ids {
            if let Some(key) = special_key(typ) {
                kv.push((key.to_owned(), Value::U32(*id as u32)));
            }
        }
        for (typ, v) in &specials.add {
            if matches!(*typ, "bos" | "eos" | "sep") {
                kv.push((format!("tokenizer.ggml.add_{typ}_token"), Value::Bool(*v)));
            }
        }
        if spm {
            let prefix = self
                .tcfg
                .as_ref()
                .and_then(|c| c.get("add_prefix_space"))
                .and_then(Json::as_bool)
                .unwrap_or_else(|| spm_adds_space_prefix(&self.tok));
            kv.push((
                "tokenizer.ggml.add_space_prefix".into(),
                Value::Bool(prefix),
            ));
        }
        kv.extend(chat_template_kvs(&self.dir, self.tcfg.as_ref())?);
        Ok(kv)
    }

    /// The merges as `"left right"` strings (spaces inside a part written as U+0120, as gguf-py).
    fn merges(&self) -> Result<Vec<String>> {
        let Some(list) = self.tok.pointer("/model/merges").and_then(Json::as_array) else {
            return Ok(Vec::new());
        };
        let enc = |s: &str| s.replace(' ', "\u{120}");
        list.iter()
            .map(|m| match m {
                Json::String(s) => Ok(s.clone()),
                Json::Array(pair) => match pair.as_slice() {
                    [Json::String(a), Json::String(b)] => Ok(format!("{} {}", enc(a), enc(b))),
                    _ => bail!("tokenizer.json: malformed merge {m}"),
                },
                _ => bail!("tokenizer.json: malformed merge {m}"),
            })
            .collect()
    }
}

fn str_kv(k: &str, v: &str) -> (String, Value) {
    (k.to_owned(), Value::String(v.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_special_and_byte_tokens() {
        assert!(looks_special("<|im_start|>"));
        assert!(looks_special("<unused12>"));
        assert!(!looks_special("<s>"));
        assert!(is_byte_token("<0x0A>"));
        assert!(!is_byte_token("<0xZZ>"));
        assert!(!is_byte_token("<0x0A0>"));
    }

    #[test]
    fn detects_pre_tokenizers_by_regex() {
        let qwen = serde_json::json!({"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": KNOWN_PRE[0].0}, "behavior": "Isolated"},
            {"type": "ByteLevel", "use_regex": false}]}});
        assert_eq!(detect_pre(&qwen).unwrap(), "qwen2");
        let gpt2 = serde_json::json!({"pre_tokenizer": {"type": "ByteLevel", "use_regex": true}});
        assert_eq!(detect_pre(&gpt2).unwrap(), "gpt-2");
        let odd =
            serde_json::json!({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": "x+"}}});
        let e = detect_pre(&odd).unwrap_err().to_string();
        assert!(e.contains("x+"), "{e}");
    }
}
