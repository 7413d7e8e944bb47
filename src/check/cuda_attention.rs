//! The attention kernels' check (part of [`super::cuda_kernels::run_all`]): split-KV attention over a paged f16 cache with
//! scrambled block tables, against an f64 softmax over the same f16 keys and values, for plain
//! multi-head, GQA and MQA layouts, several splits and a sliding window; and the tiled prefill
//! kernel on batches of consecutive rows of two sequences (tiles cut at the sequence boundary).
//! Where the decode kernels also write the q8_1 blocks of their output, those are held bit for
//! bit to the reference quantizer applied to the kernel's own output. The same cases run over a
//! quantized cache (`cuda_quant_cache` picks them): K and V rows stored as the CPU stores them
//! (rotated, then ggml's reference q8_0/q4_0), the reference an f64 softmax over the dequantized
//! blocks with the query rotated (and, where the decode kernel rounds it, rounded to q8_0 by the
//! crate's quantizer) and each head's output rotated back.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;

use super::cuda_kernels::{floats, Check};
use crate::kernels::cpu::attention::rotate;
use crate::kernels::cuda::launch::{DevBuf, Launch};
use crate::kernels::cuda::ops::{self, AttnArgs};
use crate::model::backend::CacheType;
use crate::quant::dequantize_row;
use crate::quant::quantize::{quantize_row_f16, quantize_row_q4_0, quantize_row_q8_0};

const BLOCK: usize = 32;
const N_BLOCKS: usize = 16;

/// (pos, lo, table seed) per query: sequences are told apart by their table seed.
pub(super) type Queries = Vec<(u32, u32, usize)>;

/// The f16 cache's types.
const F16: (CacheType, CacheType) = (CacheType::F16, CacheType::F16);

/// `rows` (each `width` values, heads of `hd`) as a cache of type `ty` stores them: the bytes,
/// and the values the kernels read back (f16-rounded, or the blocks dequantized, still rotated).
pub(super) fn store_rows(ty: CacheType, x: &[f32], width: usize) -> (Vec<u8>, Vec<f32>) {
    let rb = ty.row_bytes(width);
    let mut bytes = vec![0u8; x.len() / width * rb];
    let mut back = vec![0f32; x.len()];
    for ((src, dst), out) in x
        .chunks_exact(width)
        .zip(bytes.chunks_exact_mut(rb))
        .zip(back.chunks_exact_mut(width))
    {
        let mut r = src.to_vec();
        if ty.is_quantized() {
            rotate::rotate(&mut r, 32);
        }
        match ty {
            CacheType::F16 => quantize_row_f16(&r, dst),
            CacheType::Q8_0 => quantize_row_q8_0(&r, dst),
            CacheType::Q4_0 => quantize_row_q4_0(&r, dst),
        }
        dequantize_row(ty.ggml(), dst, out).expect("whole blocks");
    }
    (bytes, back)
}

pub fn attention(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    // Decode-like: separate sequences, one row each, up to 4 splits, one with a window.
    let decode = decode_queries();
    // Prefill-like: 21 rows of one sequence from position 0, then 41 rows of another at positions
    // 100..=140 with a 64-key window.
    let prefill = prefill_queries();
    for shape in [
        (4, 4, 64),
        (8, 2, 128),
        (4, 1, 256),
        (12, 2, 16),
        (14, 2, 64),
    ] {
        case(l, out, shape, &decode, false, F16)?;
    }
    for shape in [(4, 4, 64), (8, 2, 128), (4, 1, 256), (6, 3, 16)] {
        case(l, out, shape, &prefill, true, F16)?;
        case(l, out, shape, &prefill[..3], true, F16)?;
    }
    case(l, out, (8, 2, 128), &prefill, false, F16)?;
    // Short decode rows: one split, so attn_split writes (and quantizes) the output itself.
    case(l, out, (8, 2, 128), &decode[..2], false, F16)?;
    case(l, out, (4, 1, 256), &decode[..2], false, F16)?;
    Ok(())
}

/// The decode rows of [`attention`]: separate sequences, up to 4 splits, one with a window.
pub(super) fn decode_queries() -> Queries {
    vec![
        (0, 0, 1),
        (37, 0, 3),
        (300, 0, 7),
        (300, 200, 2),
        (511, 0, 9),
    ]
}

/// The prefill rows of [`attention`]: 21 rows of one sequence from position 0, then 41 rows of
/// another at positions 100..=140 with a 64-key window.
pub(super) fn prefill_queries() -> Queries {
    let mut prefill: Queries = (0..=20).map(|p| (p, 0, 1)).collect();
    prefill.extend((100..=140).map(|p| (p, p - 63, 4)));
    prefill
}

/// One attention case: `nh`/`nkv` heads of `hd`, the cache's K and V rows of `types`, through
/// the tiled prefill kernel or split-KV decoding.
pub(super) fn case(
    l: &Arc<dyn Launch>,
    out: &mut Vec<Check>,
    (nh, nkv, hd): (usize, usize, usize),
    queries: &[(u32, u32, usize)],
    tiled: bool,
    types: (CacheType, CacheType),
) -> Result<()> {
    {
        let kv_dim = nkv * hd;
        let slots = N_BLOCKS * BLOCK;
        let (k_bytes, k) = store_rows(types.0, &floats(slots * kv_dim, 21), kv_dim);
        let (v_bytes, v) = store_rows(types.1, &floats(slots * kv_dim, 22), kv_dim);
        // Each query's table: the blocks in a scrambled order (block i of the sequence is at
        // physical block (5 i + seed) % 16).
        let tables: Vec<Vec<u32>> = queries
            .iter()
            .map(|&(_, _, seed)| {
                (0..N_BLOCKS)
                    .map(|i| ((5 * i + seed) % N_BLOCKS) as u32)
                    .collect()
            })
            .collect();
        let n_q = queries.len();
        let q = floats(n_q * nh * hd, 23);
        let scale = 1.0 / (hd as f32).sqrt();

        let mut flat = Vec::new();
        let mut meta = Vec::new();
        for (i, &(pos, lo, _)) in queries.iter().enumerate() {
            meta.extend([flat.len() as i32, pos as i32, lo as i32]);
            flat.extend(tables[i].iter().map(|&b| b as i32));
        }
        let (kd, vd) = (
            DevBuf::from_bytes(l, &k_bytes)?,
            DevBuf::from_bytes(l, &v_bytes)?,
        );
        let (td, md, qd) = (
            DevBuf::from_i32(l, &flat)?,
            DevBuf::from_i32(l, &meta)?,
            DevBuf::from_f32(l, &q)?,
        );
        let n_split = queries
            .iter()
            .map(|&(p, lo, _)| (p + 1 - lo) as usize)
            .max()
            .unwrap_or(1)
            .div_ceil(ops::ATTN_SPLIT);
        let part = DevBuf::new(l, ops::attn_part_bytes(n_q, nh, hd, n_split))?;
        let od = DevBuf::new(l, n_q * nh * hd * 4)?;
        // The decode path also quantizes its output where heads are whole q8_1 blocks.
        let with_q8 = !tiled && hd.is_multiple_of(32);
        let q8 = DevBuf::new(l, n_q * nh * hd / 32 * ops::Q8_1_BYTES + 4)?;
        let a = AttnArgs {
            q: qd.ptr,
            k_cache: kd.ptr,
            v_cache: vd.ptr,
            tables: td.ptr,
            meta: md.ptr,
            part: part.ptr,
            out: od.ptr,
            q8: if with_q8 { q8.ptr } else { 0 },
            n_q,
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            block_size: BLOCK,
            kv_dim,
            k_type: types.0,
            v_type: types.1,
            scale,
            n_split,
            done: 0,
        };
        let tiles = ops::prefill_tiles(n_q, |i, j| queries[i].2 == queries[j].2);
        let tiles_d = DevBuf::from_i32(l, &tiles)?;
        l.sync()?;
        let t = Instant::now();
        match tiled {
            true => ops::attention_prefill(&**l, &a, tiles_d.ptr, tiles.len() / 2)?,
            false => ops::attention(&**l, &a)?,
        }
        l.sync()?;
        let secs = t.elapsed().as_secs_f64();
        let got = od.to_f32()?;

        let mut err = 0f64;
        for (i, &(pos, lo, _)) in queries.iter().enumerate() {
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                // The query as the kernel multiplies it: rotated with a quantized K, and the
                // decode kernel rounds it to q8_0 (blocks of the rotated values).
                let mut qh = q[(i * nh + h) * hd..][..hd].to_vec();
                if types.0.is_quantized() {
                    rotate::rotate(&mut qh, 32);
                    if !tiled {
                        let mut b = vec![0u8; CacheType::Q8_0.row_bytes(hd)];
                        quantize_row_q8_0(&qh, &mut b);
                        dequantize_row(CacheType::Q8_0.ggml(), &b, &mut qh)?;
                    }
                }
                let keys: Vec<usize> = (lo..=pos)
                    .map(|p| tables[i][p as usize / BLOCK] as usize * BLOCK + p as usize % BLOCK)
                    .collect();
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&slot| {
                        let kr = &k[slot * kv_dim + kvh * hd..][..hd];
                        qh.iter()
                            .zip(kr)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let sum: f64 = p.iter().sum();
                let mut want: Vec<f32> = (0..hd)
                    .map(|d| {
                        let acc = keys
                            .iter()
                            .zip(&p)
                            .map(|(&slot, &pj)| pj * v[slot * kv_dim + kvh * hd + d] as f64)
                            .sum::<f64>();
                        (acc / sum) as f32
                    })
                    .collect();
                if types.1.is_quantized() {
                    rotate::unrotate(&mut want, 32);
                }
                for (d, &w) in want.iter().enumerate() {
                    err = err.max((got[(i * nh + h) * hd + d] - w).abs() as f64);
                }
            }
        }
        let quant = types.0.is_quantized() || types.1.is_quantized();
        let cache = match quant {
            true => format!(", {}/{}", types.0.name(), types.1.name()),
            false => String::new(),
        };
        let (kernel, shape) = match tiled {
            true => {
                let n_tiles = tiles.len() / 2;
                let s =
                    format!("{n_q} rows, {n_tiles} tiles, {nh}/{nkv} heads, hd {hd}{cache} (abs)");
                (
                    if quant {
                        "attn_prefill_q"
                    } else {
                        "attn_prefill"
                    },
                    s,
                )
            }
            false => {
                let s = format!(
                    "{n_q} queries, {nh}/{nkv} heads, hd {hd}, {n_split} splits{cache} (abs)"
                );
                let k = if quant {
                    "attn_split_q+merge"
                } else {
                    "attn_split+merge"
                };
                (k, s)
            }
        };
        if !tiled && n_split > 1 {
            // The merge in the last split's block, against attn_merge's launch: the output and its
            // q8_1 blocks bit for bit (launched twice: a counter left set would show).
            let want = (od.to_bytes()?, q8.to_bytes()?);
            let done = DevBuf::new(l, ops::attn_done_bytes(n_q, nkv))?;
            for round in 1..=2 {
                let (o2, q2) = (
                    DevBuf::new(l, n_q * nh * hd * 4)?,
                    DevBuf::new(l, q8.bytes)?,
                );
                let b = AttnArgs {
                    out: o2.ptr,
                    q8: if with_q8 { q2.ptr } else { 0 },
                    done: done.ptr,
                    ..a
                };
                ops::attention(&**l, &b)?;
                let (g, gq) = (o2.to_bytes()?, q2.to_bytes()?);
                let differ = g.iter().zip(&want.0).filter(|(x, y)| x != y).count()
                    + match with_q8 {
                        true => gq.iter().zip(&want.1).filter(|(x, y)| x != y).count(),
                        false => 0,
                    };
                out.push(Check {
                    kernel: if quant { "attn_split_q" } else { "attn_split" }.into(),
                    shape: format!("{n_q} queries, {nh}/{nkv}x{hd}, {n_split} splits{cache}: merged in the last split's block #{round} (bytes differing from attn_merge)"),
                    err: differ as f64,
                    tol: 0.0,
                    secs: 0.0,
                });
            }
        }
        if with_q8 {
            let mut want = vec![0u8; got.len() / 32 * ops::Q8_1_BYTES];
            crate::quant::quantize::quantize_row_q8_1(&got, &mut want);
            let bytes = q8.to_bytes()?;
            let diff = want.iter().zip(&bytes).filter(|(a, b)| a != b).count();
            out.push(Check {
                kernel: kernel.into(),
                shape: format!("{n_q} queries, {nh}/{nkv}x{hd}, {n_split} splits{cache}: q8_1 of its output (bytes differing)"),
                err: diff as f64,
                tol: 0.0,
                secs: 0.0,
            });
        }
        out.push(Check {
            kernel: kernel.into(),
            shape,
            err,
            tol: 1e-5,
            secs,
        });
    }
    Ok(())
}
