//! The importance matrix: for every weight matrix of the transformer blocks, the mean of the
//! squared input activation per input channel (column), over all tokens that went through it
//! (llama.cpp's `imatrix`). Quantizers weight each column's rounding error by it, so channels that
//! carry large activations keep more precision.
//!
//! [`Collector`] accumulates `Σ x²` (f64) and the row count per (tensor, slot); a slot is an
//! expert of a 3-D expert tensor (each expert sees only the tokens routed to it), else 0 (fused
//! q/k/v or gate/up parts that share one input add to the same slot, which leaves the mean
//! unchanged). [`Imatrix`] is the result, read and written in llama.cpp's legacy `imatrix.dat`
//! layout (little-endian): `i32 n_entries`, then per entry `i32 name_len, name, i32 ncall,
//! i32 nval, f32 values[nval]` with `values = mean · ncall`, then `i32 chunks, i32 len, dataset`.
//! llama-quantize reads our files and we read its legacy ones (values divided by `ncall`).
//! Entries are sorted by name; only `blk.*` tensors are collected (as llama.cpp without
//! `--process-output`).

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};

/// Sums of one tensor being collected.
struct Entry {
    name: String,
    cols: usize,
    sums: Vec<f64>,
    counts: Vec<u64>,
}

/// Accumulates squared activations of tagged weights.
#[derive(Default)]
pub struct Collector {
    entries: Vec<Entry>,
    by_name: HashMap<String, usize>,
    /// tag → (entry, slot)
    tags: Vec<(usize, usize)>,
}

/// Whether a tensor's inputs are collected (the transformer blocks' matrices only).
pub fn collects(name: &str) -> bool {
    name.starts_with("blk.")
}

impl Collector {
    /// A tag for slot `slot` of `n_slots` of tensor `name` with `cols` inputs per row.
    pub fn tag(&mut self, name: &str, cols: usize, slot: usize, n_slots: usize) -> usize {
        let e = match self.by_name.get(name) {
            Some(&e) => e,
            None => {
                self.entries.push(Entry {
                    name: name.to_owned(),
                    cols,
                    sums: vec![0.0; n_slots * cols],
                    counts: vec![0; n_slots],
                });
                self.by_name.insert(name.to_owned(), self.entries.len() - 1);
                self.entries.len() - 1
            }
        };
        assert!(slot < self.entries[e].counts.len() && cols == self.entries[e].cols);
        self.tags.push((e, slot));
        self.tags.len() - 1
    }

    /// Adds the rows of `x` (row-major, `cols` wide) to the tagged slot.
    pub fn add(&mut self, tag: usize, x: &[f32]) {
        let (e, slot) = self.tags[tag];
        let entry = &mut self.entries[e];
        let cols = entry.cols;
        let sums = &mut entry.sums[slot * cols..(slot + 1) * cols];
        for row in x.chunks_exact(cols) {
            for (s, &v) in sums.iter_mut().zip(row) {
                *s += (v as f64) * (v as f64);
            }
        }
        entry.counts[slot] += (x.len() / cols) as u64;
    }

    /// The means, with `ncall` as llama.cpp counts it (rows seen / `chunk_size`, rounded up).
    /// Slots that saw no token get 1 (llama.cpp's value for partial data); entries that saw
    /// nothing are left out.
    pub fn finish(self, chunk_size: usize, chunks: u32, dataset: &str) -> Imatrix {
        let mut entries = BTreeMap::new();
        for e in self.entries {
            let Some(&max) = e.counts.iter().max() else {
                continue;
            };
            if max == 0 {
                continue;
            }
            let ncall = max.div_ceil(chunk_size.max(1) as u64) as i32;
            let values = e
                .sums
                .chunks_exact(e.cols)
                .zip(&e.counts)
                .flat_map(|(s, &c)| {
                    s.iter()
                        .map(move |&v| if c == 0 { 1.0 } else { (v / c as f64) as f32 })
                })
                .collect();
            entries.insert(e.name, ImEntry { values, ncall });
        }
        Imatrix {
            entries,
            chunks,
            dataset: dataset.to_owned(),
        }
    }
}

/// One tensor's importance: the mean squared activation of each input channel, slot after slot.
#[derive(Clone, Debug, PartialEq)]
pub struct ImEntry {
    pub values: Vec<f32>,
    pub ncall: i32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Imatrix {
    pub entries: BTreeMap<String, ImEntry>,
    /// Windows of calibration text it was computed on.
    pub chunks: u32,
    /// The calibration file's name.
    pub dataset: String,
}

impl Imatrix {
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        let i32le = |b: &mut Vec<u8>, v: i32| b.extend_from_slice(&v.to_le_bytes());
        i32le(&mut b, self.entries.len() as i32);
        for (name, e) in &self.entries {
            i32le(&mut b, name.len() as i32);
            b.extend_from_slice(name.as_bytes());
            i32le(&mut b, e.ncall);
            i32le(&mut b, e.values.len() as i32);
            for &v in &e.values {
                b.extend_from_slice(&(v * e.ncall.max(1) as f32).to_le_bytes());
            }
        }
        i32le(&mut b, self.chunks as i32);
        i32le(&mut b, self.dataset.len() as i32);
        b.extend_from_slice(self.dataset.as_bytes());
        b
    }

    pub fn from_bytes(b: &[u8]) -> Result<Imatrix> {
        let mut at = 0usize;
        let mut take = |n: usize, what: &str| -> Result<&[u8]> {
            if b.len() - at < n {
                bail!("truncated at byte {at} (reading {what})");
            }
            at += n;
            Ok(&b[at - n..at])
        };
        let int = |s: &[u8]| i32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        let n = int(take(4, "the entry count")?);
        if n < 1 {
            bail!("no entries (count {n})");
        }
        let mut entries = BTreeMap::new();
        for i in 0..n {
            let len = int(take(4, "a name length")?);
            if !(0..=4096).contains(&len) {
                bail!("entry {i}: bad name length {len}");
            }
            let name = String::from_utf8(take(len as usize, "a name")?.to_vec())
                .with_context(|| format!("entry {i}: name is not UTF-8"))?;
            let ncall = int(take(4, "ncall")?);
            let nval = int(take(4, "nval")?);
            if nval < 1 {
                bail!("entry `{name}`: {nval} values");
            }
            let raw = take(4 * nval as usize, "values")?;
            let div = if ncall > 0 { ncall as f32 } else { 1.0 };
            let values = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) / div)
                .collect();
            entries.insert(name, ImEntry { values, ncall });
        }
        // the trailer is optional
        let (mut chunks, mut dataset) = (0, String::new());
        if let Ok(c) = take(4, "chunks") {
            chunks = int(c).max(0) as u32;
            if let Ok(l) = take(4, "dataset length") {
                let l = int(l).max(0) as usize;
                if let Ok(d) = take(l, "dataset") {
                    dataset = String::from_utf8_lossy(d).into_owned();
                }
            }
        }
        Ok(Imatrix {
            entries,
            chunks,
            dataset,
        })
    }

    /// Writes the file atomically (temporary file + rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("tmp-imatrix");
        let mut f =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        f.write_all(&self.to_bytes())
            .and_then(|()| f.sync_all())
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
    }

    pub fn load(path: &Path) -> Result<Imatrix> {
        let b = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        Imatrix::from_bytes(&b).with_context(|| {
            format!(
                "{} is not an imatrix file (llama.cpp's legacy imatrix.dat layout)",
                path.display()
            )
        })
    }

    /// The importance of tensor `name` with `cols` inputs per row and `n_slots` experts (1 for a
    /// plain matrix): `n_slots × cols` values, or None when the file has no entry for it.
    pub fn weights_for(&self, name: &str, cols: usize, n_slots: usize) -> Result<Option<&[f32]>> {
        let Some(e) = self.entries.get(name) else {
            return Ok(None);
        };
        if e.values.len() != cols * n_slots {
            bail!(
                "the imatrix entry of `{name}` has {} values, the tensor needs {} ({n_slots} × {cols}): \
                 was it computed for another model?",
                e.values.len(),
                cols * n_slots
            );
        }
        Ok(Some(&e.values))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collects_means_per_slot_and_round_trips() {
        let mut c = Collector::default();
        let a = c.tag("blk.0.ffn_up.weight", 2, 0, 1);
        let e1 = c.tag("blk.0.ffn_up_exps.weight", 2, 1, 2);
        let a2 = c.tag("blk.0.ffn_up.weight", 2, 0, 1); // a fused part sharing the input
        c.add(a, &[1.0, 2.0, 3.0, 4.0]); // rows (1,2), (3,4)
        c.add(a2, &[1.0, 0.0]);
        c.add(e1, &[2.0, -2.0]);
        let m = c.finish(2, 1, "calib.txt");
        let up = &m.entries["blk.0.ffn_up.weight"];
        // (1 + 9 + 1) / 3, (4 + 16 + 0) / 3; 3 rows in chunks of 2 → ncall 2
        assert_eq!(up.values, vec![11.0 / 3.0, 20.0 / 3.0]);
        assert_eq!(up.ncall, 2);
        // expert 0 saw nothing: 1 as llama.cpp stores partial data
        assert_eq!(
            m.entries["blk.0.ffn_up_exps.weight"].values,
            vec![1.0, 1.0, 4.0, 4.0]
        );
        let b = m.to_bytes();
        // first entry by name: "blk.0.ffn_up.weight", values stored times ncall
        assert_eq!(&b[0..4], &2i32.to_le_bytes());
        assert_eq!(&b[4..8], &19i32.to_le_bytes());
        assert_eq!(&b[27..31], &2i32.to_le_bytes());
        assert_eq!(&b[35..39], &(11.0f32 / 3.0 * 2.0).to_le_bytes());
        let back = Imatrix::from_bytes(&b).unwrap();
        assert_eq!(back.entries.len(), 2);
        assert_eq!(back.dataset, "calib.txt");
        for (k, v) in &m.entries {
            let w = &back.entries[k];
            for (x, y) in v.values.iter().zip(&w.values) {
                assert!((x - y).abs() <= 1e-6 * x.abs());
            }
        }
        assert!(back.weights_for("blk.0.ffn_up.weight", 3, 1).is_err());
        assert!(back
            .weights_for("blk.9.ffn_up.weight", 2, 1)
            .unwrap()
            .is_none());
        assert!(Imatrix::from_bytes(&b[..b.len() - 30]).is_err());
    }
}
