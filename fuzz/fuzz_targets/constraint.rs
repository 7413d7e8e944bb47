//! Structured-output constraints from untrusted text: the first byte picks the reading (a JSON
//! schema, as `infer serve`'s `response_format` takes; a GBNF grammar, as `--grammar` and batch
//! lines take; a regex), the rest is the constraint. Compiling never panics or hangs; a compiled
//! constraint then drives up to 64 steps (mask, first allowed token, commit) over a small
//! vocabulary, and every committed token was allowed by the mask before it.
#![no_main]

use std::sync::OnceLock;

use infer::engine::constraint::{ConstraintSpec, Grammars};
use infer::tokenizer::{Tokenizer, TokenizerSpec};
use libfuzzer_sys::fuzz_target;

const N: usize = 48;

fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| {
        let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
        tokens.extend(
            [
                "{", "}", "[", "]", "\"", ":", ",", " ", "0", "1", "9", "-", ".", "e", "a", "b",
                "true", "false", "null", "\\", "n", "u", "x", "ab", "\":", "\", \"", "12", "▁",
            ]
            .map(String::from),
        );
        while tokens.len() < N {
            tokens.push(format!("t{}", tokens.len()));
        }
        let mut types = vec![2, 3, 3];
        types.resize(N, 1);
        let spec = TokenizerSpec {
            model: "llama".into(),
            tokens,
            token_types: Some(types),
            special_ids: vec![("eos_token_id".into(), 2), ("bos_token_id".into(), 1)],
            add_space_prefix: Some(false),
            ..TokenizerSpec::default()
        };
        Grammars::new(&Tokenizer::from_spec(spec).expect("tokenizer"), N).expect("grammars")
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let spec = match kind % 3 {
        0 => match serde_json::from_str(text) {
            Ok(v) => ConstraintSpec::JsonSchema(v),
            Err(_) => return,
        },
        1 => ConstraintSpec::Gbnf(text.to_string()),
        _ => ConstraintSpec::Regex(text.to_string()),
    };
    let Ok(mut c) = grammars().compile(&spec) else {
        return;
    };
    for _ in 0..64 {
        let mut logits = vec![0.0f32; N];
        if c.apply(&mut logits).is_err() {
            return;
        }
        let Some(id) = logits.iter().position(|&l| l == 0.0) else {
            return;
        };
        c.commit(id as u32).expect("a token the mask allowed is accepted");
        if id == 2 || c.is_finished() {
            return;
        }
    }
});
