//! The shared back half of `infer quantize`: given the output tensors (where each row comes from)
//! and their chosen types, convert every tensor row by row on the thread pool and write the GGUF
//! file atomically.
//!
//! Invariants: a tensor whose chosen type equals its stored GGUF type is copied byte for byte;
//! every other tensor is decoded to f32 one row at a time and re-encoded with
//! [`quant::quantize_row`], so the output bytes do not depend on the thread count. Nothing is
//! written under the output name until the whole file is ready ([`GgufWriter::write_file`] writes
//! a temporary file and renames it).

use std::io::IsTerminal;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::safetensors::HfTensor;
use crate::eval::imatrix::Imatrix;
use crate::format::{GgmlType, GgufWriter, Value};
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::quant;

/// llama.cpp's `LlamaModel.permute` for one Q or K projection: within each of `n_head` heads, the
/// rows `[first half | second half]` (Hugging Face's rotate-half layout) become interleaved pairs
/// (the GGML "normal" RoPE layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopePermute {
    pub n_head: usize,
}

impl RopePermute {
    /// The source index (along the permuted axis, of length `len`) of output index `o`.
    pub fn source(self, o: usize, len: usize) -> usize {
        let half = len / self.n_head / 2;
        let (h, rem) = (o / (2 * half), o % (2 * half));
        let (j, k) = (rem / 2, rem % 2);
        h * 2 * half + k * half + j
    }
}

/// Where the rows of an output tensor come from.
pub enum Rows<'a> {
    /// Safetensors tensors stacked along their first axis (one part, or one per expert), with an
    /// optional RoPE row permutation of each part's first axis and a constant added to every value
    /// (Gemma's `norm + 1`). Rows past the output's row count are dropped.
    Hf {
        parts: Vec<HfTensor<'a>>,
        permute: Option<RopePermute>,
        add: f32,
    },
    /// Values computed by the converter (e.g. Llama 3 `rope_freqs`).
    Values(Vec<f32>),
    /// A tensor of an existing GGUF file, stored as `ty`.
    Gguf { ty: GgmlType, data: &'a [u8] },
}

/// One tensor of the output file.
pub struct PlannedTensor<'a> {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    /// The type this tensor has before quantization: F32 for converted tensors, the stored type
    /// for a GGUF input. Tensors that may not be quantized keep it.
    pub src_type: GgmlType,
    pub rows: Rows<'a>,
}

impl PlannedTensor<'_> {
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }

    pub fn n_rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }

    pub fn n_elements(&self) -> usize {
        self.row_len() * self.n_rows()
    }

    /// Decodes row `r` into `out` (`row_len()` values).
    fn read_row(&self, r: usize, out: &mut [f32]) -> Result<()> {
        match &self.rows {
            Rows::Values(v) => {
                let n = out.len();
                out.copy_from_slice(&v[r * n..(r + 1) * n]);
            }
            Rows::Gguf { ty, data } => {
                let rb = ty.row_bytes(out.len()).context("row length")?;
                quant::dequantize_row(*ty, &data[r * rb..(r + 1) * rb], out)?;
            }
            Rows::Hf {
                parts,
                permute,
                add,
            } => {
                let n = out.len();
                let part = &parts[0];
                let part_elems = part.n_elements();
                if part.shape.len() == 1 {
                    // A vector: the permutation (if any) reorders its elements.
                    match permute {
                        Some(p) => {
                            let mut tmp = vec![0f32; n];
                            part.read(0, &mut tmp);
                            for (o, x) in out.iter_mut().enumerate() {
                                *x = tmp[p.source(o, n)];
                            }
                        }
                        None => part.read(0, out),
                    }
                } else {
                    let rows_per_part = part_elems / n;
                    let (p_idx, local) = (r / rows_per_part, r % rows_per_part);
                    let src_row = permute.map_or(local, |p| p.source(local, rows_per_part));
                    parts[p_idx].read(src_row * n, out);
                }
                if *add != 0.0 {
                    out.iter_mut().for_each(|x| *x += *add);
                }
            }
        }
        Ok(())
    }
}

/// What [`write_gguf`] did.
#[derive(Clone, Debug)]
pub struct Summary {
    pub n_tensors: usize,
    pub n_elements: u64,
    /// Size of the tensor data written.
    pub bytes_out: u64,
    pub seconds: f64,
    /// Tensors quantized with an importance-matrix entry.
    pub with_imatrix: usize,
}

/// Converts `tensors[i]` to `types[i]` (in parallel over rows) and writes them with `metadata` to
/// `out`, atomically. Tensors with an entry in `imatrix` are quantized with their importance
/// (see [`quant::quantize_row_weighted`]); an entry of the wrong size is an error.
pub fn write_gguf(
    out: &Path,
    metadata: Vec<(String, Value)>,
    tensors: &[PlannedTensor],
    types: &[GgmlType],
    threads: usize,
    imatrix: Option<&Imatrix>,
) -> Result<Summary> {
    let start = Instant::now();
    let pool = ThreadPool::new(threads.max(1));
    let total: u64 = tensors.iter().map(|t| t.n_elements() as u64).sum();
    let bar = if std::io::stderr().is_terminal() {
        let b = ProgressBar::new(total);
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% {msg}",
        ) {
            b.set_style(style);
        }
        b
    } else {
        ProgressBar::hidden()
    };

    let mut w = GgufWriter::new();
    for (k, v) in metadata {
        w.add_kv(&k, v);
    }
    let mut bytes_out = 0u64;
    let mut with_imatrix = 0;
    for (t, &ty) in tensors.iter().zip(types) {
        bar.set_message(format!("{} → {}", t.name, ty.name()));
        let slots = if t.dims.len() >= 3 {
            t.dims[2] as usize
        } else {
            1
        };
        let qw = match imatrix {
            Some(m) if ty.block_size() > 1 => m.weights_for(&t.name, t.row_len(), slots)?,
            _ => None,
        };
        with_imatrix += qw.is_some() as usize;
        let data = convert_tensor(&pool, t, ty, &bar, qw)
            .with_context(|| format!("converting tensor {} to {}", t.name, ty.name()))?;
        bytes_out += data.len() as u64;
        w.add_tensor(&t.name, &t.dims, ty, data)?;
    }
    bar.set_message(format!("writing {}", out.display()));
    w.write_file(out)?;
    bar.finish_and_clear();
    Ok(Summary {
        n_tensors: tensors.len(),
        n_elements: total,
        bytes_out,
        seconds: start.elapsed().as_secs_f64(),
        with_imatrix,
    })
}

/// The bytes of `t` as type `ty`, with importance `qw` (`slots × row_len` values, a slot being
/// an expert of a 3-D tensor) when given.
fn convert_tensor(
    pool: &ThreadPool,
    t: &PlannedTensor,
    ty: GgmlType,
    bar: &ProgressBar,
    qw: Option<&[f32]>,
) -> Result<Vec<u8>> {
    if let Rows::Gguf { ty: src, data } = &t.rows {
        if *src == ty {
            bar.inc(t.n_elements() as u64);
            return Ok(data.to_vec());
        }
    }
    let (row_len, n_rows) = (t.row_len(), t.n_rows());
    let Some(row_bytes) = ty.row_bytes(row_len) else {
        bail!(
            "rows of {row_len} values do not split into {}-value {} blocks",
            ty.block_size(),
            ty.name()
        );
    };
    let mut out = vec![0u8; row_bytes * n_rows];
    if out.is_empty() {
        return Ok(out);
    }
    let rows_per_slot = if t.dims.len() >= 3 {
        t.dims[1] as usize
    } else {
        n_rows
    }
    .max(1);
    // About 16K values per chunk (llama.cpp's quantize chunk), whole rows only.
    let rows_per_chunk = (16_384 / row_len.max(1)).max(1);
    let chunks: Vec<Mutex<&mut [u8]>> = out
        .chunks_mut(rows_per_chunk * row_bytes)
        .map(Mutex::new)
        .collect();
    let failure: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    pool.for_range(chunks.len(), 1, |range| {
        let mut row = vec![0f32; row_len];
        let mut q = Vec::with_capacity(row_bytes);
        for c in range {
            let mut guard = chunks[c].lock().unwrap_or_else(|e| e.into_inner());
            let dst: &mut [u8] = &mut guard;
            for (j, dst_row) in dst.chunks_mut(row_bytes).enumerate() {
                let r = c * rows_per_chunk + j;
                let result = t.read_row(r, &mut row).and_then(|()| match qw {
                    Some(w) => {
                        let slot = r / rows_per_slot;
                        let w = &w[slot * row_len..(slot + 1) * row_len];
                        quant::quantize_row_weighted(ty, &row, w, &mut q)
                    }
                    None => quant::quantize_row(ty, &row, &mut q),
                });
                if let Err(e) = result {
                    let mut f = failure.lock().unwrap_or_else(|e| e.into_inner());
                    f.get_or_insert(e.context(format!("row {r}")));
                    return;
                }
                dst_row.copy_from_slice(&q);
            }
            bar.inc((dst.len() / row_bytes * row_len) as u64);
        }
    });
    if let Some(e) = failure.into_inner().map_err(|_| anyhow!("poisoned"))? {
        return Err(e);
    }
    drop(chunks);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_permute_interleaves_halves_per_head() {
        // 2 heads of 4 rows: [a0 a1 b0 b1 | c0 c1 d0 d1] → [a0 b0 a1 b1 | c0 d0 c1 d1]
        let p = RopePermute { n_head: 2 };
        let got: Vec<usize> = (0..8).map(|o| p.source(o, 8)).collect();
        assert_eq!(got, [0, 2, 1, 3, 4, 6, 5, 7]);
        // One head of 6: [x0 x1 x2 y0 y1 y2] → [x0 y0 x1 y1 x2 y2]
        let p = RopePermute { n_head: 1 };
        let got: Vec<usize> = (0..6).map(|o| p.source(o, 6)).collect();
        assert_eq!(got, [0, 3, 1, 4, 2, 5]);
    }
}
