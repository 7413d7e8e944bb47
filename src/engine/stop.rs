//! Stop strings over streamed text.
//!
//! Owns the text that has been decoded but not yet released. Invariants: the held-back tail is
//! always the longest suffix of the unreleased text that is a proper prefix of some stop string
//! (so a stop string can never straddle text that was already released); on a match, everything
//! before the earliest-starting stop string is released and nothing after it ever is; empty
//! stop strings are ignored. All cuts fall on `char` boundaries.

/// Incremental matcher for a set of stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are dropped).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has matched.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds newly decoded text; returns (text safe to emit now, stopped). Text that might be the
    /// start of a stop string is held back until disambiguated. On a match the returned text ends
    /// just before the stop string, and every later call returns `("", true)`.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        if self.stops.is_empty() {
            return (text.to_owned(), false);
        }
        self.held.push_str(text);

        // Earliest match of any stop string.
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s)).min() {
            self.held.truncate(at);
            self.stopped = true;
            return (std::mem::take(&mut self.held), true);
        }

        // Hold back the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| partial_suffix_len(&self.held, s))
            .max()
            .unwrap_or(0);
        let tail = self.held.split_off(self.held.len() - keep);
        (std::mem::replace(&mut self.held, tail), false)
    }

    /// End of generation: releases any held-back text (nothing once stopped).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        std::mem::take(&mut self.held)
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn partial_suffix_len(text: &str, stop: &str) -> usize {
    let max = (stop.len() - 1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|s| s.to_string()).collect())
    }

    /// Feeds `pieces`, returns (all emitted text, stopped after which piece index).
    fn run(m: &mut StopMatcher, pieces: &[&str]) -> (String, Option<usize>) {
        let mut out = String::new();
        let mut stopped_at = None;
        for (i, p) in pieces.iter().enumerate() {
            let (t, stop) = m.push(p);
            out.push_str(&t);
            if stop && stopped_at.is_none() {
                stopped_at = Some(i);
            }
        }
        out.push_str(&m.finish());
        (out, stopped_at)
    }

    #[test]
    fn empty_stop_list_passes_through() {
        let mut m = matcher(&[]);
        assert_eq!(m.push("hello "), ("hello ".to_string(), false));
        assert_eq!(m.push("world"), ("world".to_string(), false));
        assert_eq!(m.finish(), "");
        let mut m = matcher(&[""]);
        assert_eq!(m.push("abc"), ("abc".to_string(), false));
    }

    #[test]
    fn stop_split_across_many_pushes() {
        let mut m = matcher(&["<|end|>"]);
        assert_eq!(m.push("Hi there"), ("Hi there".to_string(), false));
        assert_eq!(m.push("<"), (String::new(), false));
        assert_eq!(m.push("|e"), (String::new(), false));
        assert_eq!(m.push("nd"), (String::new(), false));
        assert_eq!(m.push("|> trailing"), (String::new(), true));
        assert!(m.stopped());
        assert_eq!(m.push("more"), (String::new(), true));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn text_before_stop_in_same_push_is_emitted() {
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("abc ST"), ("abc ".to_string(), false));
        assert_eq!(m.push("OP def"), (String::new(), true));
        let mut m = matcher(&["STOP"]);
        assert_eq!(m.push("xySTOPz"), ("xy".to_string(), true));
    }

    #[test]
    fn false_prefix_is_released() {
        let mut m = matcher(&["</s>"]);
        assert_eq!(m.push("a </"), ("a ".to_string(), false));
        assert_eq!(m.push("b> c"), ("</b> c".to_string(), false));
        assert_eq!(m.push("<"), (String::new(), false));
        assert_eq!(m.finish(), "<");
        // Prefix that overlaps itself: "aab" inside "aaab".
        let mut m = matcher(&["aab"]);
        assert_eq!(
            run(&mut m, &["a", "a", "a", "b", "c"]),
            ("a".to_string(), Some(3))
        );
    }

    #[test]
    fn multiple_stop_strings_earliest_wins() {
        let mut m = matcher(&["World", "lo W", "xyz"]);
        assert_eq!(
            run(&mut m, &["Hel", "lo World"]),
            ("Hel".to_string(), Some(1))
        );
        let mut m = matcher(&["\n\n", "User:"]);
        let (out, at) = run(&mut m, &["Answer: 4", ".\nUs", "er: next"]);
        assert_eq!((out.as_str(), at), ("Answer: 4.\n", Some(2)));
        // One stop is a prefix of another: the shorter one matches first.
        let mut m = matcher(&["ab", "abc"]);
        assert_eq!(m.push("xa"), ("x".to_string(), false));
        assert_eq!(m.push("bc"), (String::new(), true));
    }

    #[test]
    fn unicode_is_cut_on_char_boundaries() {
        let mut m = matcher(&["终止", "é!"]);
        assert_eq!(m.push("日本語"), ("日本語".to_string(), false));
        assert_eq!(m.push("终"), (String::new(), false));
        assert_eq!(m.push("点é"), ("终点".to_string(), false));
        assert_eq!(m.push("x"), ("éx".to_string(), false));
        assert_eq!(m.push("🙂终"), ("🙂".to_string(), false));
        assert_eq!(m.push("止🙂"), (String::new(), true));
        // Stop with a multi-byte char whose bytes partially match must not split a char.
        let mut m = matcher(&["añb"]);
        let (out, at) = run(&mut m, &["xa", "ñ", "c", "añ", "b!"]);
        assert_eq!((out.as_str(), at), ("xañc", Some(4)));
    }

    #[test]
    fn finish_releases_partial_match() {
        let mut m = matcher(&["###"]);
        assert_eq!(m.push("done ##"), ("done ".to_string(), false));
        assert_eq!(m.finish(), "##");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn concatenated_output_is_prefix_of_input() {
        // Byte-by-byte (char-by-char) streaming gives the same result as one push.
        let text = "The answer is 42.<|im_end|>garbage";
        let stops = ["<|im_end|>", "<|endoftext|>"];
        let mut whole = matcher(&stops);
        let (one, _) = whole.push(text);
        let mut m = matcher(&stops);
        let pieces: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let (streamed, _) = run(&mut m, &refs);
        assert_eq!(one, "The answer is 42.");
        assert_eq!(streamed, one);
    }
}
