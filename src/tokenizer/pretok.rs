//! Pre-tokenizers of byte-level BPE vocabularies: the word splitting llama.cpp applies (in
//! `unicode_regex_split`) before BPE merges, for the supported `tokenizer.ggml.pre` values.
//!
//! llama.cpp does not run the Hugging Face regexes as written: the GPT-2 and Llama-3 patterns have
//! hand-written splitters (`unicode_regex_split_custom_*`), and the others run through `std::regex`
//! on text whose non-ASCII code points are collapsed to one byte per Unicode category. This module
//! ports the hand-written splitters and expresses the collapsed regexes as the same scans over
//! per-code-point flags, so the result is llama.cpp's, not Hugging Face's (e.g. contractions are
//! matched case-sensitively as `'[sS]`, never through Unicode case folding).
//!
//! Invariants: [`PreTokenizer::split`] returns non-empty byte ranges, in order, that tile the input
//! exactly; every range starts and ends on a char boundary. Character classes are llama.cpp's own
//! (letter, number, punctuation, whitespace from its Unicode tables, see [`super::unicode_classes`]),
//! not those of Rust's Unicode version.

/// The splitting rules of one `tokenizer.ggml.pre` family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+` (GPT-2).
    Gpt2,
    /// `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+` (Llama 3).
    Llama3,
    /// The Llama-3 pattern with `\p{N}` instead of `\p{N}{1,3}`: digits are split one by one (Qwen2).
    Qwen2,
    /// llama.cpp's fallback for `pre = "default"`: `[\p{P}\$\+<=>\^~\|]+`, then the GPT-2 pattern,
    /// then `\p{N}+`, then `[0-9][0-9][0-9]`, each splitting the pieces of the one before.
    Default,
}

impl PreTokenizer {
    /// The family llama.cpp assigns to a `tokenizer.ggml.pre` value, if this crate supports it.
    pub fn from_name(name: &str) -> Option<PreTokenizer> {
        Some(match name {
            "default" => PreTokenizer::Default,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral"
            | "midm-2.0" | "lfm2" | "jina-v5-nano" | "dbrx" | "smaug-bpe" => PreTokenizer::Llama3,
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2"
            | "hunyuan" | "solar-open" => PreTokenizer::Qwen2,
            "gpt-2" | "gpt2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es"
            | "jina-v2-de" | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo"
            | "jais" | "trillion" | "granite-docling" => PreTokenizer::Gpt2,
            _ => return None,
        })
    }

    /// Splits `text` into words; see the module invariants.
    pub(crate) fn split(self, text: &str) -> Vec<(usize, usize)> {
        if text.is_empty() {
            return Vec::new();
        }
        let cpts = classify(text);
        let whole = vec![(0, cpts.len())];
        let ranges = match self {
            PreTokenizer::Gpt2 => split_gpt2(&cpts, &whole),
            PreTokenizer::Llama3 => split_llama3(&cpts, &whole, 3),
            PreTokenizer::Qwen2 => split_llama3(&cpts, &whole, 1),
            PreTokenizer::Default => {
                let r = split_runs(&cpts, &whole, |c| c.flags & DEFAULT_PUNCT != 0);
                let r = split_gpt2(&cpts, &r);
                let r = split_runs(&cpts, &r, |c| c.flags & NUMBER != 0);
                split_ascii_digit_triples(&cpts, &r)
            }
        };
        ranges
            .into_iter()
            .map(|(a, b)| (cpts.byte_offset(a), cpts.byte_offset(b)))
            .collect()
    }
}

const LETTER: u8 = 1;
const NUMBER: u8 = 2;
const WHITESPACE: u8 = 4;
const PUNCT: u8 = 8;
/// Matched by `[\p{P}\$\+<=>\^~\|]` in llama.cpp's collapsed regex (a whitespace code point is
/// collapsed to a whitespace stand-in first, so it never matches).
const DEFAULT_PUNCT: u8 = 16;
/// Set on every code point inside the range being split; llama.cpp's `as_uint() != 0`.
const DEFINED: u8 = 128;

/// One code point of the text being split.
#[derive(Clone, Copy)]
struct Cpt {
    ch: char,
    flags: u8,
}

/// The code points of a text with their class flags and byte offsets.
struct Cpts {
    cpts: Vec<Cpt>,
    /// Byte offset of each code point, plus the text length at the end.
    offsets: Vec<usize>,
}

impl Cpts {
    fn len(&self) -> usize {
        self.cpts.len()
    }

    fn byte_offset(&self, i: usize) -> usize {
        self.offsets[i]
    }
}

/// Flags of the ASCII code points, as llama.cpp's tables give them.
fn ascii_flags(b: u8) -> u8 {
    let mut f = DEFINED;
    match b {
        b'A'..=b'Z' | b'a'..=b'z' => f |= LETTER,
        b'0'..=b'9' => f |= NUMBER,
        b'\t'..=b'\r' | b' ' => f |= WHITESPACE,
        b'!'..=b'#'
        | b'%'..=b'*'
        | b','..=b'/'
        | b':'
        | b';'
        | b'?'
        | b'@'
        | b'['..=b']'
        | b'_'
        | b'{'
        | b'}' => f |= PUNCT | DEFAULT_PUNCT,
        b'$' | b'+' | b'<' | b'=' | b'>' | b'^' | b'~' | b'|' => f |= DEFAULT_PUNCT,
        _ => {}
    }
    f
}

/// The flags of a non-ASCII code point, from llama.cpp's tables.
fn table_flags(ch: char) -> u8 {
    use super::unicode_classes::{L, N, P, RANGES, W};
    let c = u32::from(ch);
    let i = RANGES.partition_point(|&(start, _)| start <= c);
    let class = RANGES[i.saturating_sub(1)].1;
    DEFINED
        | match class {
            L => LETTER,
            N => NUMBER,
            P => PUNCT | DEFAULT_PUNCT,
            W => WHITESPACE,
            _ => 0,
        }
}

/// The code points of `text` with their flags.
fn classify(text: &str) -> Cpts {
    let mut cpts = Vec::with_capacity(text.len());
    let mut offsets = Vec::with_capacity(text.len() + 1);
    for (i, ch) in text.char_indices() {
        let flags = if ch.is_ascii() {
            ascii_flags(ch as u8)
        } else {
            table_flags(ch)
        };
        cpts.push(Cpt { ch, flags });
        offsets.push(i);
    }
    offsets.push(text.len());
    Cpts { cpts, offsets }
}

/// Reads code points of one range `[ini, end)`; positions outside it read as "out of range"
/// (no flags, no char), as llama.cpp's `_get_cpt` / `_get_flags` do.
struct Window<'a> {
    cpts: &'a [Cpt],
    ini: usize,
    end: usize,
}

impl Window<'_> {
    fn cpt(&self, pos: usize) -> Option<char> {
        (self.ini <= pos && pos < self.end).then(|| self.cpts[pos].ch)
    }

    fn flags(&self, pos: usize) -> u8 {
        if self.ini <= pos && pos < self.end {
            self.cpts[pos].flags
        } else {
            0
        }
    }
}

fn is(flags: u8, f: u8) -> bool {
    flags & f != 0
}

/// Collects the pieces of one range, dropping empty ones, as llama.cpp's `_add_token`.
struct Pieces<'a> {
    out: &'a mut Vec<(usize, usize)>,
    prev_end: usize,
}

impl Pieces<'_> {
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push((self.prev_end, end));
        }
        self.prev_end = end;
        len
    }
}

/// Port of llama.cpp's `unicode_regex_split_custom_gpt2`.
fn split_gpt2(cpts: &Cpts, ranges: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(ranges.len());
    for &(ini, end) in ranges {
        let w = Window {
            cpts: &cpts.cpts,
            ini,
            end,
        };
        let mut p = Pieces {
            out: &mut out,
            prev_end: ini,
        };
        let mut pos = ini;
        while pos < end {
            let cpt = w.cpt(pos);
            let flags = w.flags(pos);
            // 's|'t|'re|'ve|'m|'ll|'d
            if cpt == Some('\'') && pos + 1 < end {
                let next = w.cpt(pos + 1);
                if matches!(next, Some('s' | 't' | 'm' | 'd')) {
                    pos += p.add(pos + 2);
                    continue;
                }
                if pos + 2 < end {
                    let nn = w.cpt(pos + 2);
                    if matches!(
                        (next, nn),
                        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
                    ) {
                        pos += p.add(pos + 3);
                        continue;
                    }
                }
            }
            let space = usize::from(cpt == Some(' '));
            let mut flags2 = if space == 1 { w.flags(pos + 1) } else { flags };
            // <space>?\p{L}+
            if is(flags2, LETTER) {
                pos += space;
                while is(flags2, LETTER) {
                    pos += 1;
                    flags2 = w.flags(pos);
                }
                p.add(pos);
                continue;
            }
            // <space>?\p{N}+
            if is(flags2, NUMBER) {
                pos += space;
                while is(flags2, NUMBER) {
                    pos += 1;
                    flags2 = w.flags(pos);
                }
                p.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+
            let other = |f: u8| !is(f, WHITESPACE | LETTER | NUMBER) && f != 0;
            if other(flags2) {
                pos += space;
                while other(flags2) {
                    pos += 1;
                    flags2 = w.flags(pos);
                }
                p.add(pos);
                continue;
            }
            let mut num_ws = 0;
            while is(w.flags(pos + num_ws), WHITESPACE) {
                num_ws += 1;
            }
            // \s+(?!\S)
            if num_ws > 1 && w.cpt(pos + num_ws).is_some() {
                pos += num_ws - 1;
                p.add(pos);
                continue;
            }
            // \s+
            if num_ws > 0 {
                pos += num_ws;
                p.add(pos);
                continue;
            }
            pos += 1;
            p.add(pos);
        }
    }
    out
}

/// Port of llama.cpp's `unicode_regex_split_custom_llama3`, with the digit-run length as a
/// parameter: 3 is the Llama-3 pattern, 1 the Qwen2 one (`\p{N}` alone).
fn split_llama3(cpts: &Cpts, ranges: &[(usize, usize)], max_digits: usize) -> Vec<(usize, usize)> {
    let lower = |c: Option<char>| c.map(|c| c.to_ascii_lowercase());
    let mut out = Vec::with_capacity(ranges.len());
    for &(ini, end) in ranges {
        let w = Window {
            cpts: &cpts.cpts,
            ini,
            end,
        };
        let mut p = Pieces {
            out: &mut out,
            prev_end: ini,
        };
        let mut pos = ini;
        while pos < end {
            let cpt = w.cpt(pos);
            let flags = w.flags(pos);
            // (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])
            if cpt == Some('\'') && pos + 1 < end {
                let next = lower(w.cpt(pos + 1));
                if matches!(next, Some('s' | 't' | 'm' | 'd')) {
                    pos += p.add(pos + 2);
                    continue;
                }
                if pos + 2 < end {
                    let nn = lower(w.cpt(pos + 2));
                    if matches!(
                        (next, nn),
                        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
                    ) {
                        pos += p.add(pos + 3);
                        continue;
                    }
                }
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(cpt == Some('\r') || cpt == Some('\n') || is(flags, NUMBER))
                && (is(flags, LETTER) || is(w.flags(pos + 1), LETTER))
            {
                pos += 1;
                while is(w.flags(pos), LETTER) {
                    pos += 1;
                }
                p.add(pos);
                continue;
            }
            // \p{N}{1,max_digits}
            if is(flags, NUMBER) {
                let mut run_start = pos;
                while is(w.flags(pos), NUMBER) {
                    pos += 1;
                    if pos - run_start >= max_digits {
                        p.add(pos);
                        run_start = pos;
                    }
                }
                p.add(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+[\r\n]*
            let space = usize::from(cpt == Some(' '));
            let mut flags2 = if space == 1 { w.flags(pos + 1) } else { flags };
            if !is(flags2, WHITESPACE | LETTER | NUMBER) && flags != 0 {
                pos += space;
                while !is(flags2, WHITESPACE | LETTER | NUMBER) && flags2 != 0 {
                    pos += 1;
                    flags2 = w.flags(pos);
                }
                while matches!(w.cpt(pos), Some('\r' | '\n')) {
                    pos += 1;
                }
                p.add(pos);
                continue;
            }
            let mut num_ws = 0;
            let mut last_end_r_or_n = 0;
            while is(w.flags(pos + num_ws), WHITESPACE) {
                if matches!(w.cpt(pos + num_ws), Some('\r' | '\n')) {
                    last_end_r_or_n = pos + num_ws + 1;
                }
                num_ws += 1;
            }
            // \s*[\r\n]+
            if last_end_r_or_n > 0 {
                pos = last_end_r_or_n;
                p.add(pos);
                continue;
            }
            // \s+(?!\S)
            if num_ws > 1 && w.cpt(pos + num_ws).is_some() {
                pos += num_ws - 1;
                p.add(pos);
                continue;
            }
            // \s+
            if num_ws > 0 {
                pos += num_ws;
                p.add(pos);
                continue;
            }
            pos += 1;
            p.add(pos);
        }
    }
    out
}

/// Splits each range at the maximal runs of code points satisfying `pred`, keeping both the runs
/// and the text between them: `std::regex` iteration of `[class]+` in llama.cpp.
fn split_runs(
    cpts: &Cpts,
    ranges: &[(usize, usize)],
    pred: impl Fn(&Cpt) -> bool,
) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(ranges.len());
    for &(ini, end) in ranges {
        let mut start = ini;
        let mut pos = ini;
        while pos < end {
            if pred(&cpts.cpts[pos]) {
                let run = pos;
                while pos < end && pred(&cpts.cpts[pos]) {
                    pos += 1;
                }
                if run > start {
                    out.push((start, run));
                }
                out.push((run, pos));
                start = pos;
            } else {
                pos += 1;
            }
        }
        if start < end {
            out.push((start, end));
        }
    }
    out
}

/// Splits each range at the leftmost non-overlapping matches of `[0-9][0-9][0-9]`.
fn split_ascii_digit_triples(cpts: &Cpts, ranges: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let digit = |i: usize| cpts.cpts[i].ch.is_ascii_digit();
    let mut out = Vec::with_capacity(ranges.len());
    for &(ini, end) in ranges {
        let mut start = ini;
        let mut pos = ini;
        while pos + 3 <= end {
            if digit(pos) && digit(pos + 1) && digit(pos + 2) {
                if pos > start {
                    out.push((start, pos));
                }
                out.push((pos, pos + 3));
                pos += 3;
                start = pos;
            } else {
                pos += 1;
            }
        }
        if start < end {
            out.push((start, end));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, text: &str) -> Vec<String> {
        pre.split(text)
            .into_iter()
            .map(|(a, b)| text[a..b].to_string())
            .collect()
    }

    #[test]
    fn qwen2_splits_digits_one_by_one_and_keeps_contractions() {
        assert_eq!(
            words(PreTokenizer::Qwen2, "I'M 2024!\n\n  x"),
            ["I", "'M", " ", "2", "0", "2", "4", "!\n\n", " ", " x"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three() {
        assert_eq!(words(PreTokenizer::Llama3, "1234567"), ["123", "456", "7"]);
        assert_eq!(words(PreTokenizer::Llama3, "a  \n b"), ["a", "  \n", " b"]);
    }

    #[test]
    fn gpt2_contractions_are_lowercase_only_and_spaces_attach_forward() {
        assert_eq!(
            words(PreTokenizer::Gpt2, "it's IT'S   ok"),
            ["it", "'s", " IT", "'", "S", "  ", " ok"]
        );
    }

    #[test]
    fn default_splits_punctuation_runs_then_numbers() {
        assert_eq!(
            words(PreTokenizer::Default, "x+=12345;"),
            ["x", "+=", "123", "45", ";"]
        );
    }

    #[test]
    fn non_ascii_classes_follow_unicode_categories() {
        // é is a letter, ٣ (Arabic-Indic three) a number, U+3000 whitespace, « punctuation.
        assert_eq!(
            words(PreTokenizer::Qwen2, "café ٣٣\u{3000}«x»"),
            ["café", " ", "٣", "٣", "\u{3000}", "«x", "»"]
        );
    }

    #[test]
    fn classes_come_from_llama_cpp_tables() {
        assert_eq!(table_flags('é'), DEFINED | LETTER);
        assert_eq!(table_flags('٣'), DEFINED | NUMBER);
        assert_eq!(table_flags('«'), DEFINED | PUNCT | DEFAULT_PUNCT);
        assert_eq!(table_flags('\u{3000}'), DEFINED | WHITESPACE);
        assert_eq!(table_flags('€'), DEFINED);
        assert_eq!(table_flags('\u{10FFFF}'), DEFINED);
        // Kirat Rai (Unicode 16) is a letter to Rust but unassigned in llama.cpp's tables.
        assert!('\u{16D43}'.is_alphabetic());
        assert_eq!(table_flags('\u{16D43}'), DEFINED);
        for ch in (0u8..128).map(char::from) {
            assert_eq!(
                ascii_flags(ch as u8) & !DEFAULT_PUNCT,
                table_flags(ch) & !DEFAULT_PUNCT
            );
        }
    }

    #[test]
    fn pieces_tile_the_input() {
        let text = "fn main() {\r\n\tlet x = \"héllo\"; // 🦀 ok\u{a0}\n}\n\n\n   ";
        for pre in [
            PreTokenizer::Gpt2,
            PreTokenizer::Llama3,
            PreTokenizer::Qwen2,
            PreTokenizer::Default,
        ] {
            let r = pre.split(text);
            assert_eq!(r.first().unwrap().0, 0);
            assert_eq!(r.last().unwrap().1, text.len());
            for w in r.windows(2) {
                assert_eq!(w[0].1, w[1].0);
            }
            assert!(r.iter().all(|&(a, b)| a < b));
        }
    }
}
