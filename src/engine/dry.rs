//! DRY ("don't repeat yourself"): a penalty on tokens that would extend a repeat of text already
//! in the history, as llama.cpp's `dry` sampler defines it (`--dry-multiplier` and friends).
//!
//! For every candidate token `t`, the penalty looks at the earlier places in the last
//! `last_n` history tokens where `t` followed a run of tokens equal to the history's current
//! suffix. If the longest such run has `n >= allowed_length` tokens, `t`'s logit loses
//! `multiplier * base^(n - allowed_length)`. A run never reaches back past the most recent
//! sequence breaker (by default a newline, `:`, `"` or `*`), and a token that is itself a breaker
//! is never penalised, so structure (new lines, JSON punctuation) stays free while a loop inside
//! a line or a string is pushed out ever harder.
//!
//! Breakers are strings; a token is a breaker when its output text contains one of them (exact
//! for one-character breakers such as the defaults; a longer breaker split across tokens is not
//! seen). The breaker set is a bitset over the vocabulary, built once per breaker list by
//! [`DryBreakers::new`] from the tokenizer and shared by every sampler that uses it.
//!
//! Invariants: the penalty is a pure function of (parameters, history, breaker set); it touches
//! only ids that occur in the window; the repeat lengths come from one Z-function pass over the
//! reversed window, so a step costs O(last_n) whatever the text.

use std::sync::Arc;

use crate::tokenizer::Tokenizer;

/// llama.cpp's default sequence breakers.
pub const DEFAULT_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

/// The DRY parameters of a sampler (off unless `multiplier > 0`).
#[derive(Clone, Debug)]
pub struct Dry {
    /// Penalty scale; 0 = off.
    pub multiplier: f32,
    /// Growth of the penalty per token of repeat past `allowed_length` (≥ 1).
    pub base: f32,
    /// Repeats shorter than this are free.
    pub allowed_length: usize,
    /// How many of the most recent history tokens are searched; `None` = all of them.
    pub last_n: Option<usize>,
    /// The tokens that break a repeat.
    pub breakers: Arc<DryBreakers>,
}

/// The sequence breakers: their strings and the vocabulary ids whose text contains one.
#[derive(Debug, Default)]
pub struct DryBreakers {
    pub strings: Vec<String>,
    bits: Vec<u64>,
}

impl DryBreakers {
    /// The breaker set of `strings` over a vocabulary of `n_vocab` ids whose output bytes
    /// `token_bytes` gives.
    pub fn new(strings: Vec<String>, n_vocab: usize, token_bytes: impl Fn(u32) -> Vec<u8>) -> Self {
        let mut bits = vec![0u64; n_vocab.div_ceil(64)];
        let needles: Vec<&[u8]> = strings
            .iter()
            .map(|s| s.as_bytes())
            .filter(|s| !s.is_empty())
            .collect();
        if !needles.is_empty() {
            for id in 0..n_vocab as u32 {
                let b = token_bytes(id);
                if needles.iter().any(|n| b.windows(n.len()).any(|w| w == *n)) {
                    bits[id as usize / 64] |= 1 << (id % 64);
                }
            }
        }
        DryBreakers { strings, bits }
    }

    /// The breaker set of `strings` over `tok`'s vocabulary.
    pub fn of(strings: Vec<String>, tok: &Tokenizer) -> Self {
        DryBreakers::new(strings, tok.vocab_size(), |id| tok.token_bytes(id))
    }

    /// Whether `id` is a breaker.
    pub fn contains(&self, id: u32) -> bool {
        self.bits
            .get(id as usize / 64)
            .is_some_and(|w| w >> (id % 64) & 1 == 1)
    }
}

/// DRY as a user sets it (flags, request fields), before the breakers are matched against a
/// vocabulary. `Default` gives llama.cpp's defaults (off).
#[derive(Clone, Debug, PartialEq)]
pub struct DryParams {
    pub multiplier: f32,
    pub base: f32,
    pub allowed_length: usize,
    /// Tokens searched: `-1` = the whole history, `0` = off (llama.cpp's convention).
    pub penalty_last_n: i64,
    pub breakers: Vec<String>,
}

impl Default for DryParams {
    fn default() -> Self {
        DryParams {
            multiplier: 0.0,
            base: 1.75,
            allowed_length: 2,
            penalty_last_n: 64,
            breakers: DEFAULT_BREAKERS.iter().map(|s| s.to_string()).collect(),
        }
    }
}

impl DryParams {
    /// Why these parameters are invalid: the field at fault (`multiplier`, `base`,
    /// `penalty_last_n` or `sequence_breakers`) and a message naming it as `name(field)` spells it.
    pub fn check(&self, name: impl Fn(&str) -> String) -> Result<(), (&'static str, String)> {
        let (field, why) = if !(self.multiplier.is_finite() && self.multiplier >= 0.0) {
            (
                "multiplier",
                format!("must be ≥ 0, got {}", self.multiplier),
            )
        } else if !(self.base.is_finite() && self.base >= 1.0) {
            ("base", format!("must be ≥ 1, got {}", self.base))
        } else if self.penalty_last_n < -1 {
            let n = self.penalty_last_n;
            (
                "penalty_last_n",
                format!("must be -1 (everything), 0 (off) or more, got {n}"),
            )
        } else if self.breakers.len() > 64 || self.breakers.iter().any(|b| b.len() > 40) {
            (
                "sequence_breakers",
                "takes at most 64 strings of at most 40 bytes".into(),
            )
        } else {
            return Ok(());
        };
        Err((field, format!("{} {why}", name(field))))
    }

    /// Whether the penalty is on.
    pub fn active(&self) -> bool {
        self.multiplier > 0.0 && self.penalty_last_n != 0
    }

    /// The sampler's DRY over the breaker set `breakers` (built from `self.breakers`), or `None`
    /// when off.
    pub fn with_breakers(&self, breakers: Arc<DryBreakers>) -> Option<Arc<Dry>> {
        self.active().then(|| {
            Arc::new(Dry {
                multiplier: self.multiplier,
                base: self.base,
                allowed_length: self.allowed_length,
                last_n: usize::try_from(self.penalty_last_n).ok(),
                breakers,
            })
        })
    }
}

/// Working memory for [`Dry::apply`], kept by the sampler between steps.
#[derive(Default)]
pub struct DryScratch {
    z: Vec<usize>,
    hits: Vec<(u32, usize)>,
}

impl Dry {
    /// Whether the penalty can change anything.
    pub fn active(&self) -> bool {
        self.multiplier > 0.0 && self.base >= 1.0 && self.last_n != Some(0)
    }

    /// Subtracts the DRY penalty from `logits` (one per vocabulary id) given the `history`.
    pub fn apply(&self, logits: &mut [f32], history: &[u32], s: &mut DryScratch) {
        if !self.active() {
            return;
        }
        let n = self.last_n.map_or(history.len(), |l| l.min(history.len()));
        if n <= self.allowed_length {
            return;
        }
        let w = &history[history.len() - n..];
        // A repeat may not reach back past the most recent breaker.
        let rep_limit = w
            .iter()
            .rev()
            .position(|&t| self.breakers.contains(t))
            .unwrap_or(n);
        if rep_limit < self.allowed_length {
            return;
        }
        // Z-function of the reversed window: z[k] = the length of the common suffix of `w` and
        // `w[..n - k]`, i.e. how many tokens before position n - k repeat the current suffix.
        let rev = |i: usize| w[n - 1 - i];
        s.z.clear();
        s.z.resize(n, 0);
        let (mut l, mut r) = (0usize, 0usize);
        for k in 1..n {
            let mut m = if k < r { (r - k).min(s.z[k - l]) } else { 0 };
            while k + m < n && rev(m) == rev(k + m) {
                m += 1;
            }
            s.z[k] = m;
            if k + m > r {
                (l, r) = (k, k + m);
            }
        }
        // The token that followed each earlier repeat would extend it.
        s.hits.clear();
        for k in 1..n {
            let len = s.z[k].min(rep_limit);
            if len >= self.allowed_length {
                s.hits.push((w[n - k], len));
            }
        }
        s.hits.sort_unstable();
        let max_exp = if self.base > 1.000_001 {
            (88.722_84 / self.base.ln()) as usize
        } else {
            usize::MAX
        };
        for run in s.hits.chunk_by(|a, b| a.0 == b.0) {
            let (id, len) = run[run.len() - 1];
            if self.breakers.contains(id) {
                continue;
            }
            let Some(x) = logits.get_mut(id as usize) else {
                continue;
            };
            let e = (len - self.allowed_length).min(max_exp);
            let penalty = self.multiplier * self.base.powi(e.min(i32::MAX as usize) as i32);
            *x = (*x - penalty).max(f32::MIN);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Breakers over a toy vocabulary where id `i`'s text is `texts[i]`.
    fn breakers(texts: &[&str], strings: &[&str]) -> Arc<DryBreakers> {
        let owned: Vec<Vec<u8>> = texts.iter().map(|t| t.as_bytes().to_vec()).collect();
        Arc::new(DryBreakers::new(
            strings.iter().map(|s| s.to_string()).collect(),
            texts.len(),
            |id| owned[id as usize].clone(),
        ))
    }

    fn dry(b: Arc<DryBreakers>, last_n: Option<usize>) -> Dry {
        Dry {
            multiplier: 0.8,
            base: 1.75,
            allowed_length: 2,
            last_n,
            breakers: b,
        }
    }

    /// The definition, by brute force: for each earlier position, how far back the tokens before
    /// it match the history's suffix (within the window and after the last breaker).
    fn reference(d: &Dry, n_vocab: usize, history: &[u32]) -> Vec<f32> {
        let mut out = vec![0f32; n_vocab];
        let n = d.last_n.map_or(history.len(), |l| l.min(history.len()));
        if !d.active() || n <= d.allowed_length {
            return out;
        }
        let w = &history[history.len() - n..];
        let limit = (0..n)
            .find(|&i| d.breakers.contains(w[n - 1 - i]))
            .unwrap_or(n);
        if limit < d.allowed_length {
            return out;
        }
        let mut best = vec![0usize; n_vocab];
        for j in 0..n - 1 {
            let mut m = 0;
            while m <= j && w[j - m] == w[n - 1 - m] {
                m += 1;
            }
            let m = m.min(limit);
            if m >= d.allowed_length {
                let t = w[j + 1] as usize;
                best[t] = best[t].max(m);
            }
        }
        for (t, &m) in best.iter().enumerate() {
            if m >= d.allowed_length && !d.breakers.contains(t as u32) {
                out[t] = -d.multiplier * d.base.powi((m - d.allowed_length) as i32);
            }
        }
        out
    }

    fn penalties(d: &Dry, n_vocab: usize, history: &[u32]) -> Vec<f32> {
        let mut l = vec![0f32; n_vocab];
        d.apply(&mut l, history, &mut DryScratch::default());
        l
    }

    #[test]
    fn llama_cpp_example() {
        // llama.cpp's comment: last tokens `a b c c b c y a b c`; emitting c would make `a b c`
        // (3) into 4, b extends `c` (1: free), y extends `b c` (2).
        let b = breakers(&["a", "b", "c", "y"], &[]);
        let d = dry(b, None);
        let h = [0, 1, 2, 2, 1, 2, 3, 0, 1, 2];
        let p = penalties(&d, 4, &h);
        assert_eq!(p[0], 0.0);
        assert_eq!(p[1], 0.0);
        assert!((p[2] + 0.8 * 1.75).abs() < 1e-6, "{p:?}");
        assert!((p[3] + 0.8).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn breakers_limit_the_repeat_and_are_never_penalised() {
        // id 4 is "\n": the repeat `a b c` cannot reach back past it.
        let b = breakers(&["a", "b", "c", "d", "x\ny"], &DEFAULT_BREAKERS);
        assert!(b.contains(4) && !b.contains(0));
        let d = dry(b, None);
        // a b c d a b c 4 a b → next c would extend `a b` (2) only, not `c d a b`.
        let h = [0, 1, 2, 3, 0, 1, 2, 4, 0, 1];
        let p = penalties(&d, 5, &h);
        assert!((p[2] + 0.8).abs() < 1e-6, "{p:?}");
        // The breaker itself follows `a b c` but stays free.
        let h = [0, 1, 2, 4, 0, 1, 2];
        assert_eq!(penalties(&d, 5, &h)[4], 0.0);
    }

    #[test]
    fn matches_the_brute_force_definition() {
        // Random histories over small alphabets (many repeats), windows and breakers.
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let texts = ["a", "b", "c", "d", "e", ":", "f"];
        for case in 0..400 {
            let alphabet = 2 + next(5);
            let with_breakers = case % 3 == 0;
            let b = breakers(&texts, if with_breakers { &[":"] } else { &[] });
            let len = 1 + next(80) as usize;
            let h: Vec<u32> = (0..len)
                .map(|_| {
                    if with_breakers && next(9) == 0 {
                        5
                    } else {
                        next(alphabet) as u32
                    }
                })
                .collect();
            let last_n = [None, Some(5), Some(16), Some(64)][case % 4];
            let mut d = dry(b, last_n);
            d.allowed_length = 1 + case % 3;
            let got = penalties(&d, texts.len(), &h);
            let want = reference(&d, texts.len(), &h);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-5 * w.abs().max(1.0),
                    "case {case}: {got:?} vs {want:?} for {h:?}"
                );
            }
        }
    }

    #[test]
    fn off_and_huge_repeats() {
        let b = breakers(&["a", "b"], &[]);
        let mut d = dry(b, None);
        let h = vec![0u32; 5000];
        // A 5,000-token loop: the exponent is clamped, so the penalty stays finite.
        let p = penalties(&d, 2, &h);
        assert!(p[0].is_finite() && p[0] < -1e30, "{p:?}");
        d.multiplier = 0.0;
        assert_eq!(penalties(&d, 2, &h), vec![0.0, 0.0]);
    }
}
