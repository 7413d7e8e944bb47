//! `infer run --prompt-cache FILE`, run as a user runs it: a later run whose prompt is the saved
//! one, or starts with it, prints exactly what a run without the cache prints (greedy), having
//! computed only what the file did not hold; a file it cannot trust (another model, truncated,
//! damaged) is named on stderr, recomputed, and replaced by a good one.

mod common;

use std::path::{Path, PathBuf};

use common::{infer, model, stderr, stdout, GEMMA};
use serde_json::Value;

fn scratch(test: &str) -> PathBuf {
    common::scratch(&format!("prompt-cache-{test}"))
}

/// A long public-domain-licensed text (the GPL's own words), `chars` characters of it.
fn text(chars: usize) -> String {
    let t = std::fs::read_to_string("/usr/share/common-licenses/GPL-3").expect("GPL-3 text");
    t.chars().take(chars).collect()
}

/// `infer run --temp 0 --json` on `prompt` (stdin), with `--prompt-cache cache` if given:
/// the generated ids, the final line, and stderr.
fn run(m: &Path, prompt: &str, cache: Option<&Path>) -> (Vec<u64>, Value, String) {
    let mut args = vec!["run", "-m", m.to_str().unwrap(), "-p", "-"];
    args.extend(["-n", "12", "--temp", "0", "--json"]);
    if let Some(c) = cache {
        args.extend(["--prompt-cache", c.to_str().unwrap()]);
    }
    let o = infer(&args, Some(prompt));
    assert!(o.status.success(), "{}", stderr(&o));
    let mut ids = Vec::new();
    let mut done = Value::Null;
    for line in stdout(&o).lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        match v.get("id") {
            Some(id) => ids.push(id.as_u64().unwrap()),
            None if v.get("done").is_some() => done = v,
            None => {}
        }
    }
    (ids, done, stderr(&o))
}

fn cached(done: &Value) -> u64 {
    done["cached_prompt_tokens"].as_u64().unwrap()
}

#[test]
fn reused_prompts_print_what_uncached_runs_print() {
    let m = model(GEMMA);
    let dir = scratch("gemma");
    let cache = dir.join("prompt.cache");
    let prompt = text(5200);
    let (plain, done, _) = run(&m, &prompt, None);
    let n = done["prompt_tokens"].as_u64().unwrap();
    assert!(n > 1024 + 32, "a prompt of more than two chunks: {n}");

    // First run: nothing to load; computes and writes the file.
    let (ids, done, err) = run(&m, &prompt, Some(&cache));
    assert!(err.contains("does not exist yet"), "{err}");
    assert_eq!((ids, cached(&done)), (plain.clone(), 0));
    assert!(cache.is_file());

    // The same prompt: everything loaded, nothing computed, the same tokens.
    let (ids, done, _) = run(&m, &prompt, Some(&cache));
    assert_eq!((ids, cached(&done)), (plain, n));

    // A longer prompt: the saved prompt's whole 512-token chunks are loaded, the rest computed
    // in the chunks a run without the cache uses, so again the same tokens.
    let longer = format!("{prompt} In short, the licence says");
    let (want, _, _) = run(&m, &longer, None);
    let (ids, done, _) = run(&m, &longer, Some(&cache));
    assert_eq!(ids, want);
    assert_eq!(cached(&done), n / 512 * 512);
}

/// The tiny Qwen2 checkpoint as a GGUF file in `dir`.
fn tiny(dir: &Path) -> PathBuf {
    common::convert_tiny(dir, "qwen2", "q8_0")
}

#[test]
fn untrusted_files_are_named_recomputed_and_replaced() {
    let dir = scratch("refusals");
    let m = tiny(&dir);
    let prompt = "a b c d e f g h i j k l m n o p q r s t u v w x y z ".repeat(3);
    let (plain, _, _) = run(&m, &prompt, None);
    let good = dir.join("good.cache");
    run(&m, &prompt, Some(&good));
    let (ids, done, _) = run(&m, &prompt, Some(&good));
    assert!(cached(&done) > 0);
    assert_eq!(ids, plain);
    let bytes = std::fs::read(&good).unwrap();

    // A file saved by another model (Gemma), one cut short, one with a flipped byte in its K/V
    // and one that is not a cache at all.
    let other = dir.join("other.cache");
    run(&model(GEMMA), "Hello there", Some(&other));
    let cut = dir.join("cut.cache");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let flipped = dir.join("flipped.cache");
    let mut f = bytes.clone();
    let at = f.len() - 1000;
    f[at] ^= 0x04;
    std::fs::write(&flipped, &f).unwrap();
    let junk = dir.join("junk.cache");
    std::fs::write(&junk, b"GGUF not a prompt cache").unwrap();
    for (file, why) in [
        (&other, "saved from another model file"),
        (&cut, "truncated"),
        (&flipped, "checksum does not match"),
        (&junk, "not an infer prompt cache"),
    ] {
        let (ids, done, err) = run(&m, &prompt, Some(file));
        assert!(
            err.contains("not used") && err.contains(why),
            "{why}: {err}"
        );
        assert_eq!((ids, cached(&done)), (plain.clone(), 0), "{why}");
        // Replaced by a good file: the next run loads it.
        let (ids, done, err) = run(&m, &prompt, Some(file));
        assert!(cached(&done) > 0, "{why}: {err}");
        assert_eq!(ids, plain, "{why}");
    }
}
