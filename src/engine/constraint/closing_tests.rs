//! Closing inside the budget against a stubborn "model": logits that always favour one digit, so
//! a string with a pattern is never finished by the model and an object's required members are
//! never written by it. Outputs are checked with serde_json and the `regex` crate, and the
//! speculative path (`mask_rows` over drafts, some wrong) must give the same bytes as one token
//! at a time.

use super::*;
use crate::tokenizer::TokenizerSpec;

/// Control tokens, then every printable ASCII byte as a token (`▁` for the space), then two
/// multi-byte pieces.
fn tokenizer() -> Tokenizer {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    tokens.push("▁".into());
    tokens.extend((b'!'..=b'~').map(|b| (b as char).to_string()));
    tokens.extend(["77", "\": \""].map(String::from));
    let mut types = vec![1i64; tokens.len()];
    types[..3].copy_from_slice(&[2, 3, 3]);
    Tokenizer::from_spec(TokenizerSpec {
        model: "llama".into(),
        tokens,
        token_types: Some(types),
        special_ids: vec![("eos_token_id".into(), 2), ("bos_token_id".into(), 1)],
        add_space_prefix: Some(false),
        ..TokenizerSpec::default()
    })
    .unwrap()
}

const SEMVER: &str = r"^[0-9]+\.[0-9]+\.[0-9]+$";

/// An object whose first member is a version string, then `members` more required strings.
fn schema(members: usize) -> Value {
    let mut props = serde_json::Map::new();
    props.insert(
        "v".into(),
        serde_json::json!({"type": "string", "pattern": SEMVER}),
    );
    for i in 0..members {
        props.insert(format!("m{i}"), serde_json::json!({"type": "string"}));
    }
    let required: Vec<&String> = props.keys().collect();
    serde_json::json!({"type": "object", "properties": props, "required": required})
}

/// The stubborn model's logits: `7` and `77` high, everything else 0.
fn logits(tok: &Tokenizer, n: usize) -> Vec<f32> {
    let mut l = vec![0.0f32; n];
    for piece in ["7", "77"] {
        l[id(tok, piece) as usize] = 5.0;
    }
    l
}

fn id(tok: &Tokenizer, piece: &str) -> u32 {
    (0..tok.vocab_size() as u32)
        .find(|&i| tok.token_text(i) == piece)
        .unwrap()
}

fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in l.iter().enumerate() {
        if x > l[best] {
            best = i;
        }
    }
    best as u32
}

/// One token at a time: the ids, and whether an end-of-generation id ended it.
fn plain(c: &mut Constraint, tok: &Tokenizer, n: usize, budget: usize) -> (Vec<u32>, bool) {
    let mut ids = Vec::new();
    for step in 0..budget {
        let mut l = logits(tok, n);
        c.apply_within(&mut l, budget - step).unwrap();
        let id = argmax(&l);
        assert!(l[id as usize].is_finite(), "nothing allowed after {ids:?}");
        c.commit(id).unwrap();
        if id == 2 {
            return (ids, true);
        }
        ids.push(id);
    }
    (ids, false)
}

fn text(tok: &Tokenizer, ids: &[u32]) -> String {
    tok.decode(ids)
}

#[test]
fn a_pattern_and_required_members_close_inside_the_budget() {
    let tok = tokenizer();
    let n = tok.vocab_size();
    let g = Grammars::new(&tok, n).unwrap();
    let semver = regex::Regex::new(SEMVER).unwrap();
    // 6 more members need about 60 one-byte tokens: more than the depth's margin (32). With a
    // budget of 100 closing starts at once (the first checkpoint, 96 left); with 200 the model
    // writes its digits until the checkpoint at 112.
    for (members, budget, kept) in [
        (0, 40, "7"),
        (0, 100, "7777"),
        (6, 100, ""),
        (6, 200, "7777"),
    ] {
        let mut c = g
            .compile(&ConstraintSpec::JsonSchema(schema(members)))
            .unwrap();
        let (ids, ended) = plain(&mut c, &tok, n, budget);
        let out = text(&tok, &ids);
        assert!(ended, "{members} members, budget {budget}: cut: {out}");
        assert!(c.closed_by_budget());
        let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        let version = v["v"].as_str().unwrap();
        assert!(semver.is_match(version), "{version}");
        assert!(
            version.starts_with(kept),
            "the model's digits are kept: {out}"
        );
        for i in 0..members {
            assert!(v[format!("m{i}")].is_string(), "{out}");
        }
    }
}

#[test]
fn verified_drafts_close_as_one_token_at_a_time() {
    let tok = tokenizer();
    let n = tok.vocab_size();
    let g = Grammars::new(&tok, n).unwrap();
    let spec = ConstraintSpec::JsonSchema(schema(6));
    let budget = 120;
    let (want, _) = plain(&mut g.compile(&spec).unwrap(), &tok, n, budget);
    let want: Vec<u32> = want.into_iter().chain([2]).collect();
    let seven = id(&tok, "7");
    // Drafts of 4 from the plain answer, every third one wrong in its last token.
    let mut c = g.compile(&spec).unwrap();
    let mut got: Vec<u32> = Vec::new();
    let mut round = 0;
    while got.last() != Some(&2) {
        let at = got.len();
        let mut draft: Vec<u32> = want[at..(at + 4).min(want.len())].to_vec();
        round += 1;
        if round % 3 == 0 && draft.len() > 1 {
            *draft.last_mut().unwrap() = seven;
        }
        let draft = &draft[..c.accepted_prefix(&draft)];
        let mut rows = vec![logits(&tok, n); draft.len() + 1];
        c.mask_rows(draft, &mut rows, budget - at).unwrap();
        for (i, row) in rows.iter().enumerate() {
            let id = argmax(row);
            c.commit(id).unwrap();
            got.push(id);
            if id == 2 || draft.get(i) != Some(&id) {
                break;
            }
        }
        assert!(got.len() <= budget + 1, "{}", text(&tok, &got));
    }
    assert_eq!(text(&tok, &got), text(&tok, &want));
}
