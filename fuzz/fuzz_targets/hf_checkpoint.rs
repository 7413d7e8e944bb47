//! `infer quantize`'s reading of a Hugging Face checkpoint folder on arbitrary `config.json` and
//! `model.safetensors` bytes (with a fixed tiny tokenizer): the architecture check, the
//! safetensors index and every tensor's data, and the conversion plan (hyperparameters, tensor
//! names and shapes) give a value or an error, never a panic, a read outside the file or an
//! allocation the file's size does not justify. An input is a 4-byte little-endian length, that
//! many bytes of `config.json`, then the safetensors file. The folder is written to a
//! per-process directory under the system's temporary directory, as the reader maps real files.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use infer::convert::{hf, safetensors::Checkpoint, target::Target};
use libfuzzer_sys::fuzz_target;

fn dir() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("infer-fuzz-hf-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let tok = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/hf_tokenizer");
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(format!("{tok}/{f}"), d.join(f)).unwrap();
        }
        d
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((len, rest)) = data.split_first_chunk::<4>() else {
        return;
    };
    let len = (u32::from_le_bytes(*len) as usize).min(rest.len());
    let (config, weights) = rest.split_at(len);
    let d = dir();
    std::fs::write(d.join("config.json"), config).unwrap();
    std::fs::write(d.join("model.safetensors"), weights).unwrap();
    let _ = hf::check_supported(d);
    let Ok(ckpt) = Checkpoint::open(d) else {
        return;
    };
    let mut buf = vec![0f32; 4096];
    for name in ckpt.names() {
        if let Ok(t) = ckpt.tensor(name) {
            let n = t.n_elements().min(buf.len());
            t.read(0, &mut buf[..n]);
        }
    }
    let _ = hf::plan(d, &ckpt, Target::parse("q8_0").unwrap());
});
