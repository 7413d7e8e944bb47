//! Ending JSON inside the token budget: when the tokens left would barely close what is open,
//! each step takes the allowed token that closes the most.
//!
//! A JSON constraint keeps a scan of its output (containers open, inside a string or not).
//! Closing starts once the budget left is at most [`margin`] of the open depth, or at a
//! checkpoint ([`is_checkpoint`]) where the measured cost of closing says waiting would not fit
//! ([`must_start`]; the constraint measures by closing a copy of itself). Then the masked logits
//! are cut to one token: end of generation where the schema allows it, else the allowed token
//! that leaves the least open (a string counts as one level), then by how it ends: a value closed
//! (`"`, `}` or `]`), a key (`:`), a separator (`,`, which asks for more), anything else (inside
//! a number or a word), then the higher logit, then inside a word the longer token (fewer steps:
//! a key in one token, not spelled byte by byte) and otherwise the shorter (no filler in a value
//! it ends), then the lower id. The constraint passes every allowed token
//! at the same logit, so length and id decide: the order its measurement follows, so closing
//! takes the tokens it measured. The schema's mask still decides what is
//! allowed, so the output stays valid; what this changes is that a model running on in a long
//! string or a deep object ends with a shorter instance instead of being cut mid-structure.
//!
//! Invariants: the scan follows exactly the bytes of the committed tokens; nothing changes
//! before the budget gets close, so outputs that end on their own are untouched.

/// Where a JSON text is: open containers and whether inside a string (and after a backslash).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct JsonScan {
    containers: u32,
    in_string: bool,
    escaped: bool,
    /// Bytes scanned.
    len: usize,
    /// Where the open string's content starts (just past its quote).
    string_start: usize,
}

impl JsonScan {
    /// The scan after `bytes`.
    pub fn after(mut self, bytes: &[u8]) -> JsonScan {
        for &b in bytes {
            self.len += 1;
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
            } else {
                match b {
                    b'"' => (self.in_string, self.string_start) = (true, self.len),
                    b'{' | b'[' => self.containers += 1,
                    b'}' | b']' => self.containers = self.containers.saturating_sub(1),
                    _ => {}
                }
            }
        }
        self
    }

    /// The open string's content in `text` (the bytes this scan followed), if inside one.
    pub fn open_string<'t>(&self, text: &'t [u8]) -> Option<&'t [u8]> {
        self.in_string
            .then(|| &text[self.string_start.min(text.len())..])
    }

    /// Levels left open: containers, and the string if inside one.
    pub fn depth(&self) -> u32 {
        self.containers + u32::from(self.in_string)
    }
}

/// Closing starts when at most this many tokens are left for a text open `depth` levels deep.
pub fn margin(depth: u32) -> usize {
    4 * depth as usize + 24
}

/// Budgets left at which the cost of closing is measured (by closing a copy of the constraint
/// without the model): every [`CHECK_EVERY`] tokens from [`CHECK_FROM`] down. The margin alone
/// cannot see what an object still owes (its required members), which can take far more tokens
/// than its depth suggests.
pub const CHECK_FROM: usize = 128;
pub const CHECK_EVERY: usize = 16;

/// Tokens of slack for the model's own choices while closing (a key it spells in several
/// tokens where the measurement took one).
const SLACK: usize = 8;

/// Whether `remaining` tokens left is a checkpoint.
pub fn is_checkpoint(remaining: usize) -> bool {
    remaining <= CHECK_FROM && remaining.is_multiple_of(CHECK_EVERY)
}

/// At a checkpoint, whether closing must start now: closing takes `cost` tokens, and waiting for
/// the next checkpoint could leave too few. The cost may grow while the model writes on (a new
/// object owes its required members), by half again is allowed for.
pub fn must_start(remaining: usize, cost: usize) -> bool {
    cost + cost / 2 + CHECK_EVERY + SLACK > remaining
}

/// The token to take while closing: among `allowed` ids (finite logits in `logits`) with their
/// bytes from `bytes`, the one that leaves `scan` least open (see the module doc).
pub fn closing_choice<'a>(
    scan: JsonScan,
    logits: &[f32],
    bytes: impl Fn(u32) -> &'a [u8],
) -> Option<u32> {
    let mut best: Option<(u32, u8, f32, usize, u32)> = None;
    for (id, &l) in logits.iter().enumerate() {
        if !l.is_finite() {
            continue;
        }
        let b = bytes(id as u32);
        if b.is_empty() {
            continue;
        }
        let next = scan.after(b);
        let ends = match b.last() {
            _ if next.in_string => 3u8,
            Some(b'"' | b'}' | b']') => 0,
            Some(b':') => 1,
            Some(b',') => 2,
            _ => 3,
        };
        // Inside a word (a key's name, a number) the longer token is more progress; a token that
        // ends something is best short (no filler in the value it ends).
        let size = if ends == 3 {
            b.len()
        } else {
            usize::MAX - b.len()
        };
        let key = (next.depth(), ends, l, size, id as u32);
        let better = match best {
            None => true,
            Some((d, s, bl, bn, _)) => {
                (key.0, key.1) < (d, s)
                    || ((key.0, key.1) == (d, s) && (l > bl || (l == bl && key.3 > bn)))
            }
        };
        if better {
            best = Some(key);
        }
    }
    best.map(|b| b.4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_follows_strings_escapes_and_containers() {
        let s = JsonScan::default().after(br#"{"a": ["x\"}", {"#);
        assert_eq!((s.containers, s.in_string), (3, false));
        let s = s.after(br#""b\\"#);
        assert!(s.in_string && !s.escaped);
        assert_eq!(s.depth(), 4);
        let s = s.after(br#"\""#);
        assert!(s.in_string, "an escaped quote does not close");
        assert_eq!(s.after(br#""}]}"#).depth(), 0);
    }

    #[test]
    fn choice_closes_first_then_prefers_structure_then_the_model() {
        let vocab: Vec<&[u8]> = vec![b"abc", b"\"", b"\"}", b"1", b",", b"}", b" \"\",", b" \"\""];
        let bytes = |id: u32| vocab[id as usize];
        let inf = f32::NEG_INFINITY;
        // Inside a string in an object: `"}` closes both.
        let s = JsonScan::default().after(b"{\"k\": \"v");
        assert_eq!(
            closing_choice(s, &[9.0, 1.0, 0.5, 0.0, 0.0, 0.0, inf, inf], bytes),
            Some(2)
        );
        // `"}` forbidden: `"` still beats the model's favourite.
        assert_eq!(
            closing_choice(s, &[9.0, 1.0, inf, 0.0, 0.0, 0.0, inf, inf], bytes),
            Some(1)
        );
        // In a number where `}` is not allowed: `,` over more digits, whatever the logits.
        let s = JsonScan::default().after(b"{\"k\": 1");
        assert_eq!(
            closing_choice(s, &[inf, inf, inf, 5.0, 1.0, inf, inf, inf], bytes),
            Some(4)
        );
        // After a key: an empty string value over one that asks for another member.
        let s = JsonScan::default().after(b"{\"k\":");
        assert_eq!(
            closing_choice(s, &[inf, inf, inf, inf, inf, inf, 9.0, 1.0], bytes),
            Some(7)
        );
        // Equal logits: inside a word the longer token, then the lower id; a value ended short.
        let words: Vec<&[u8]> = vec![b"a", b"abc", b"xyz", b" \"abc\"", b" \"\""];
        let in_key = JsonScan::default().after(b"{\"");
        let inf3 = [0.0, 0.0, 0.0, inf, inf];
        assert_eq!(
            closing_choice(in_key, &inf3, |id| words[id as usize]),
            Some(1)
        );
        let value = JsonScan::default().after(b"{\"k\":");
        let l = [inf, inf, inf, 0.0, 0.0];
        assert_eq!(closing_choice(value, &l, |id| words[id as usize]), Some(4));
        // Nothing allowed: no choice.
        assert_eq!(closing_choice(s, &[inf; 8], bytes), None);
    }
}
