//! Both real tokenizers on arbitrary text, special-token parsing on and off: encoding never
//! panics, every id is in the vocabulary, and decoding the ids of text encoded without special
//! tokens gives the text back (what llama.cpp's byte-level BPE and byte-fallback SentencePiece
//! promise, except that SentencePiece writes spaces as U+2581, so for Gemma a text holding that
//! character comes back with a space there, as in llama.cpp).
//! The models come from `INFER_MODELS` or `models/` (scripts/fetch-models.sh).
#![no_main]

use std::sync::OnceLock;

use infer::format::Gguf;
use infer::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

fn tokenizers() -> &'static [Tokenizer] {
    static T: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = std::env::var("INFER_MODELS").unwrap_or_else(|_| "../models".into());
        [
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "gemma-3-270m-q4_k_m.gguf",
        ]
        .iter()
        .map(|f| {
            let path = std::path::Path::new(&dir).join(f);
            let g = Gguf::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            Tokenizer::from_gguf(&g).expect("tokenizer")
        })
        .collect()
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for (i, tok) in tokenizers().iter().enumerate() {
        let spm_marker = i == 1 && text.contains('\u{2581}');
        for special in [false, true] {
            let ids = tok
                .encode(&text, false, special)
                .expect("encode never fails on text");
            assert!(ids.iter().all(|&i| (i as usize) < tok.vocab_size()));
            if !special && !spm_marker {
                assert_eq!(tok.decode(&ids), text, "decode(encode(x)) == x");
            }
        }
    }
});
