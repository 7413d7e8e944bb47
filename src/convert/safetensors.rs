//! Hugging Face safetensors checkpoints, single-file or sharded, read through read-only memory maps.
//!
//! Owns: finding the shard files of a checkpoint folder (`model.safetensors`, or the files named by
//! `model.safetensors.index.json`, or every `*.safetensors` file), parsing their headers (with the
//! `safetensors` crate, which validates offsets against the file size), and decoding F32 / F16 /
//! BF16 elements to `f32`.
//!
//! Invariants: every [`HfTensor::data`] is exactly `product(shape) * element size` bytes inside its
//! shard's data section; a tensor name appears in exactly one shard (duplicates are an error); the
//! maps live as long as the [`Checkpoint`], so the borrowed views never dangle.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};

/// The element types a tensor may have to be converted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SrcDtype {
    F32,
    F16,
    BF16,
}

impl SrcDtype {
    pub fn size(self) -> usize {
        match self {
            SrcDtype::F32 => 4,
            SrcDtype::F16 | SrcDtype::BF16 => 2,
        }
    }

    /// Decodes `out.len()` little-endian elements from `src` (which holds at least that many).
    pub fn decode(self, src: &[u8], out: &mut [f32]) {
        match self {
            SrcDtype::F32 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            SrcDtype::F16 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            SrcDtype::BF16 => {
                for (o, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }
}

struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Offset of the data section (8-byte length + JSON header).
    data_start: usize,
}

#[derive(Clone, Debug)]
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// One tensor of the checkpoint, borrowed from its shard's map.
#[derive(Clone, Copy, Debug)]
pub struct HfTensor<'a> {
    pub name: &'a str,
    pub dtype: SrcDtype,
    /// Row-major (PyTorch) shape.
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl HfTensor<'_> {
    pub fn n_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Decodes elements `start..start + out.len()` (row-major order) into `out`.
    pub fn read(&self, start: usize, out: &mut [f32]) {
        let size = self.dtype.size();
        self.dtype.decode(&self.data[start * size..], out);
    }
}

/// An opened checkpoint folder.
pub struct Checkpoint {
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
    /// Tensor names, in shard order then header order.
    names: Vec<String>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field(
                "shards",
                &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .field("n_tensors", &self.names.len())
            .finish()
    }
}

/// The shard files of the checkpoint in `dir`.
fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("reading {}", index.display()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{} has no \"weight_map\" object", index.display()))?;
        let mut files: Vec<String> = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().with_context(|| {
                format!(
                    "{}: weight_map entry for {tensor} is not a file name",
                    index.display()
                )
            })?;
            if !files.iter().any(|f| f == file) {
                files.push(file.to_owned());
            }
        }
        files.sort();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("listing {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    found.sort();
    if found.is_empty() {
        bail!(
            "no model.safetensors, model.safetensors.index.json or *.safetensors file in {} \
             (PyTorch .bin checkpoints are not supported)",
            dir.display()
        );
    }
    Ok(found)
}

impl Checkpoint {
    /// Maps and indexes every shard of the checkpoint in `dir`.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let mut shards = Vec::new();
        let mut entries: HashMap<String, Entry> = HashMap::new();
        let mut names = Vec::new();
        for path in shard_paths(dir)? {
            let file = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: the map is read-only and private to this `Checkpoint`; the checkpoint files
            // must not be truncated or rewritten while a conversion reads them (as for any
            // mmap-based reader, including the safetensors Python library).
            let map = unsafe { memmap2::Mmap::map(&file) }
                .with_context(|| format!("mapping {}", path.display()))?;
            let (header_len, meta) = SafeTensors::read_metadata(&map)
                .with_context(|| format!("{} is not a valid safetensors file", path.display()))?;
            let shard = shards.len();
            let mut infos: Vec<(String, &safetensors::tensor::TensorInfo)> =
                meta.tensors().into_iter().collect();
            infos.sort_by_key(|(_, info)| info.data_offsets.0);
            for (name, info) in infos {
                let entry = Entry {
                    shard,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: info.data_offsets.0,
                    end: info.data_offsets.1,
                };
                if let Some(prev) = entries.insert(name.clone(), entry) {
                    bail!(
                        "tensor {name} appears in both {} and {}",
                        shards_path(&shards, prev.shard, &path).display(),
                        path.display()
                    );
                }
                names.push(name);
            }
            shards.push(Shard {
                path,
                map,
                data_start: 8 + header_len,
            });
        }
        Ok(Checkpoint {
            shards,
            entries,
            names,
        })
    }

    /// Every tensor name, in file order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The tensor `name`, or an error naming it when it is missing or of an unsupported dtype.
    pub fn tensor(&self, name: &str) -> Result<HfTensor<'_>> {
        let (key, e) = self
            .entries
            .get_key_value(name)
            .with_context(|| format!("tensor {name} is missing from the checkpoint"))?;
        let dtype = match e.dtype {
            Dtype::F32 => SrcDtype::F32,
            Dtype::F16 => SrcDtype::F16,
            Dtype::BF16 => SrcDtype::BF16,
            other => bail!(
                "tensor {name} has dtype {other:?}; only F32, F16 and BF16 checkpoints can be converted"
            ),
        };
        let shard = &self.shards[e.shard];
        let data = &shard.map[shard.data_start + e.start..shard.data_start + e.end];
        Ok(HfTensor {
            name: key,
            dtype,
            shape: &e.shape,
            data,
        })
    }
}

fn shards_path<'a>(shards: &'a [Shard], i: usize, current: &'a Path) -> &'a Path {
    shards.get(i).map_or(current, |s| &s.path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_f16_and_bf16() {
        let mut out = [0f32; 2];
        SrcDtype::F16.decode(&[0x00, 0x3c, 0x00, 0xc0], &mut out);
        assert_eq!(out, [1.0, -2.0]);
        SrcDtype::BF16.decode(&[0x80, 0x3f, 0x40, 0x40], &mut out);
        assert_eq!(out, [1.0, 3.0]);
        SrcDtype::F32.decode(&0.5f32.to_le_bytes(), &mut out[..1]);
        assert_eq!(out[0], 0.5);
    }
}
