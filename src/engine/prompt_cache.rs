//! The prompt cache file (`infer run --prompt-cache FILE`): the K/V a prompt left in the cache and
//! the logits after its last token, so that a later run whose prompt starts the same way loads
//! them instead of computing them.
//!
//! Layout (little-endian):
//!
//! ```text
//! magic "INFERKV\0", version u32
//! model fingerprint u64 (Gguf::fingerprint), KV type u8 (0 f16, 1 f32, 32.. quantized), n_layer u32, kv_dim u32, block_size u32
//! n_tokens u32, tokens [u32; n_tokens]
//! n_logits u32, logits [f32; n_logits]            (after the last token)
//! n_kv u64, K/V bytes [u8; n_kv]                   (Backend::kv_export of the prompt's blocks)
//! checksum u64                                     (of every byte before it)
//! ```
//!
//! Invariants: a file is trusted only when every field matches this run (the model's fingerprint,
//! the cache's type and shape) and the checksum holds; anything else is a [`Refusal`] that says
//! what differs, and the caller recomputes. Files are written whole to a temporary name beside
//! the target and renamed over it, so a reader never sees half a file.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

use crate::format::checksum;
use crate::model::backend::{CacheType, KvType};

const MAGIC: &[u8; 8] = b"INFERKV\0";
const VERSION: u32 = 1;

/// The shape of this run's cache, which a file must match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheShape {
    pub model: u64,
    pub kv_type: KvType,
    pub n_layer: usize,
    pub kv_dim: usize,
    pub block_size: usize,
}

/// A prompt's saved state.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    pub tokens: Vec<u32>,
    /// The logits after the last token.
    pub logits: Vec<f32>,
    /// [`crate::model::Backend::kv_export`] of the blocks holding `tokens`.
    pub kv: Vec<u8>,
}

/// Why a file was not used.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("it cannot be read: {0}")]
    Io(#[from] std::io::Error),
    #[error("it is not an infer prompt cache (or of another version)")]
    NotACache,
    #[error("it was saved from another model file")]
    OtherModel,
    #[error("it holds a {file} KV cache, and this run's is {run}")]
    OtherType {
        file: &'static str,
        run: &'static str,
    },
    #[error("its KV cache has another shape (layers, width or block size)")]
    OtherShape,
    #[error("it is truncated or has bytes past its end")]
    Length,
    #[error("its checksum does not match: the file is damaged")]
    Checksum,
}

/// The K/V types of quantized ids (`32 + 3 * k + v` in [`CacheType::ALL`]'s order), as named.
/// Ids 16..=24, the same types written before quantized rows were rotated
/// (`attention::rotate`), are another type: their bytes mean other values.
const QUANT_NAMES: [&str; 9] = [
    "f16/f16",
    "f16/q8_0",
    "f16/q4_0",
    "q8_0/f16",
    "q8_0/q8_0",
    "q8_0/q4_0",
    "q4_0/f16",
    "q4_0/q8_0",
    "q4_0/q4_0",
];

fn type_id(t: KvType) -> u8 {
    let index = |c: CacheType| CacheType::ALL.iter().position(|&x| x == c).expect("listed") as u8;
    match t {
        KvType::F16 => 0,
        KvType::F32 => 1,
        KvType::Quant { k, v } => 32 + 3 * index(k) + index(v),
    }
}

fn type_name(id: u8) -> &'static str {
    match id {
        0 => "f16",
        1 => "f32",
        16..=24 => "pre-rotation quantized",
        32..=40 => QUANT_NAMES[(id - 32) as usize],
        _ => "unknown",
    }
}

/// The bytes of a file holding `s` for a cache of `shape`.
pub fn encode(shape: &CacheShape, s: &Saved) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + 4 * (s.tokens.len() + s.logits.len()) + s.kv.len());
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&shape.model.to_le_bytes());
    b.push(type_id(shape.kv_type));
    for v in [
        shape.n_layer,
        shape.kv_dim,
        shape.block_size,
        s.tokens.len(),
    ] {
        b.extend_from_slice(&(v as u32).to_le_bytes());
    }
    s.tokens
        .iter()
        .for_each(|t| b.extend_from_slice(&t.to_le_bytes()));
    b.extend_from_slice(&(s.logits.len() as u32).to_le_bytes());
    s.logits
        .iter()
        .for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
    b.extend_from_slice(&(s.kv.len() as u64).to_le_bytes());
    b.extend_from_slice(&s.kv);
    let sum = checksum(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    b
}

/// Reads fields off the front of a byte slice; running out is [`Refusal::Length`].
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Refusal> {
        if n > self.0.len() {
            return Err(Refusal::Length);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, Refusal> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, Refusal> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

/// The saved state in `bytes`, if it was written for a cache of `shape`, whole and undamaged.
pub fn decode(shape: &CacheShape, bytes: &[u8]) -> Result<Saved, Refusal> {
    let mut f = Fields(bytes);
    if f.take(8).ok() != Some(&MAGIC[..]) || f.u32().ok() != Some(VERSION) {
        return Err(Refusal::NotACache);
    }
    if f.u64()? != shape.model {
        return Err(Refusal::OtherModel);
    }
    let ty = f.take(1)?[0];
    if ty != type_id(shape.kv_type) {
        return Err(Refusal::OtherType {
            file: type_name(ty),
            run: type_name(type_id(shape.kv_type)),
        });
    }
    let dims = [f.u32()?, f.u32()?, f.u32()?];
    if dims.map(|d| d as usize) != [shape.n_layer, shape.kv_dim, shape.block_size] {
        return Err(Refusal::OtherShape);
    }
    let n_tokens = f.u32()? as usize;
    let tokens = f
        .take(n_tokens.checked_mul(4).ok_or(Refusal::Length)?)?
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
        .collect();
    let n_logits = f.u32()? as usize;
    let logits = f
        .take(n_logits.checked_mul(4).ok_or(Refusal::Length)?)?
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
        .collect();
    let n_kv = usize::try_from(f.u64()?).map_err(|_| Refusal::Length)?;
    let kv = f.take(n_kv)?.to_vec();
    let body = bytes.len() - f.0.len();
    let sum = f.u64()?;
    if !f.0.is_empty() {
        return Err(Refusal::Length);
    }
    if sum != checksum(&bytes[..body]) {
        return Err(Refusal::Checksum);
    }
    Ok(Saved { tokens, logits, kv })
}

/// Reads `path`: `Ok(None)` when there is no such file.
pub fn load(path: &Path, shape: &CacheShape) -> Result<Option<Saved>, Refusal> {
    match std::fs::read(path) {
        Ok(bytes) => decode(shape, &bytes).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Refusal::Io(e)),
    }
}

/// Writes `s` to `path` atomically: a temporary file beside it, synced, then renamed over it.
pub fn save(path: &Path, shape: &CacheShape, s: &Saved) -> Result<()> {
    let bytes = encode(shape, s);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .context("the prompt cache path names no file")?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write()
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
        .with_context(|| format!("writing the prompt cache {}", path.display()))
}

/// How many of `saved`'s positions a prompt may take: the common prefix of `saved` and `prompt`,
/// cut back to whole prefill chunks of `chunk` tokens (so the rest is computed in the same
/// forward calls as without the cache, and the output is the same), or all of it when the prompt
/// is exactly the saved one (its logits are then the first token's).
pub fn usable(saved: &[u32], prompt: &[u32], chunk: usize) -> usize {
    if saved == prompt {
        return prompt.len();
    }
    let common = saved
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count()
        .min(prompt.len().saturating_sub(1));
    common / chunk * chunk
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> CacheShape {
        CacheShape {
            model: 0x1234_5678_9abc_def0,
            kv_type: KvType::F16,
            n_layer: 2,
            kv_dim: 8,
            block_size: 32,
        }
    }

    fn saved() -> Saved {
        Saved {
            tokens: vec![1, 2, 3, 500],
            logits: vec![0.5, -1.25, 3.0],
            kv: (0..2 * 2 * 32 * 8 * 2).map(|i| (i * 7) as u8).collect(),
        }
    }

    #[test]
    fn round_trips_and_refuses_what_differs() {
        let (sh, s) = (shape(), saved());
        let b = encode(&sh, &s);
        assert_eq!(decode(&sh, &b).unwrap(), s);
        let other = CacheShape { model: 1, ..sh };
        assert!(matches!(decode(&other, &b), Err(Refusal::OtherModel)));
        let f32s = CacheShape {
            kv_type: KvType::F32,
            ..sh
        };
        let e = decode(&f32s, &b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "it holds a f16 KV cache, and this run's is f32"
        );
        let q8 = CacheShape {
            kv_type: KvType::of(CacheType::Q8_0, CacheType::Q8_0),
            ..sh
        };
        let e = decode(&q8, &b).unwrap_err();
        assert_eq!(
            e.to_string(),
            "it holds a f16 KV cache, and this run's is q8_0/q8_0"
        );
        let q4 = CacheShape {
            kv_type: KvType::of(CacheType::Q8_0, CacheType::Q4_0),
            ..sh
        };
        let bq = encode(&q8, &s);
        assert_eq!(decode(&q8, &bq).unwrap(), s);
        let e = decode(&q4, &bq).unwrap_err();
        assert_eq!(
            e.to_string(),
            "it holds a q8_0/q8_0 KV cache, and this run's is q8_0/q4_0"
        );
        // A quantized file of the unrotated convention (type ids 16..=24) is another type.
        let mut old = bq.clone();
        old[20] = 16 + 4;
        let e = decode(&q8, &old).unwrap_err();
        assert_eq!(
            e.to_string(),
            "it holds a pre-rotation quantized KV cache, and this run's is q8_0/q8_0"
        );
        let wide = CacheShape { kv_dim: 16, ..sh };
        assert!(matches!(decode(&wide, &b), Err(Refusal::OtherShape)));
        assert!(matches!(decode(&sh, b"GGUF"), Err(Refusal::NotACache)));
        // Every truncation, and one extra byte, is a length error or (for a cut inside the
        // magic) not a cache; never a value.
        for n in 0..b.len() {
            assert!(decode(&sh, &b[..n]).is_err(), "prefix {n}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(matches!(decode(&sh, &long), Err(Refusal::Length)));
        // A flipped bit anywhere past the checked header fields fails the checksum.
        for i in (40..b.len()).step_by(7) {
            let mut bad = b.clone();
            bad[i] ^= 0x10;
            assert!(decode(&sh, &bad).is_err(), "byte {i}");
        }
    }

    #[test]
    fn usable_prefix_is_whole_chunks_or_the_exact_prompt() {
        let saved: Vec<u32> = (0..2000).collect();
        assert_eq!(usable(&saved, &saved, 512), 2000);
        let mut longer = saved.clone();
        longer.extend([7, 8, 9]);
        assert_eq!(usable(&saved, &longer, 512), 1536);
        assert_eq!(usable(&saved, &saved[..1200], 512), 1024);
        let mut changed = saved.clone();
        changed[600] = 99_999;
        assert_eq!(usable(&saved, &changed, 512), 512);
        assert_eq!(usable(&saved, &[5, 6], 512), 0);
        // A prompt that is a whole-chunk prefix keeps its last token to compute.
        assert_eq!(usable(&saved, &saved[..1024], 512), 512);
    }
}
