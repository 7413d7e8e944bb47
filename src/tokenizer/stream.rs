//! Incremental UTF-8 decoding of generated tokens.
//!
//! A token's bytes can end in the middle of a character (byte-fallback tokens, or byte-level BPE
//! pieces of emoji and CJK). [`StreamDecoder`] holds such a tail back until the bytes completing
//! it arrive, so each character is printed once, whole.
//!
//! Invariants: the concatenation of everything `push` and `flush` return equals
//! `String::from_utf8_lossy` of all bytes pushed; the held-back tail is always a proper prefix of
//! a UTF-8 sequence (at most 3 bytes).

/// Streams text as tokens arrive: holds back an incomplete UTF-8 sequence split across tokens.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `bytes` and returns the complete characters now available; invalid sequences come
    /// out as U+FFFD, an incomplete one at the end waits for the next push.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // `valid` is UTF-8 by construction of `valid_up_to`.
                    out.push_str(&String::from_utf8_lossy(valid));
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &after[n..];
                        }
                        None => {
                            rest = after; // incomplete: hold back
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let len = self.pending.len();
        self.pending.drain(..len - keep);
        out
    }

    /// Returns whatever is held back, as U+FFFD, and empties the decoder.
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_char_split_across_pushes_comes_out_once_whole() {
        let crab = "🦀".as_bytes(); // F0 9F A6 80
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(b"a"), "a");
        assert_eq!(d.push(&crab[..1]), "");
        assert_eq!(d.push(&crab[1..3]), "");
        assert_eq!(d.push(&[crab[3], b'b']), "🦀b");
        assert_eq!(d.flush(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_chars_and_a_dangling_tail_flushes_as_one() {
        let mut d = StreamDecoder::new();
        assert_eq!(d.push(&[b'x', 0xFF, b'y', 0xE2, 0x82]), "x\u{FFFD}y");
        assert_eq!(d.flush(), "\u{FFFD}");
        assert_eq!(d.flush(), "");
    }

    #[test]
    fn output_equals_lossy_decoding_of_everything() {
        let bytes: Vec<u8> = "né 日本 🦀\u{301}"
            .bytes()
            .chain([0xC3, b'z', 0xF0, 0x9F])
            .collect();
        for split in 1..6 {
            let mut d = StreamDecoder::new();
            let mut s: String = bytes.chunks(split).map(|c| d.push(c)).collect();
            s.push_str(&d.flush());
            assert_eq!(s, String::from_utf8_lossy(&bytes));
        }
    }
}
