//! The attention kernels' check (part of [`super::cuda_kernels::run_all`]): split-KV attention over a paged f16 cache with
//! scrambled block tables, against an f64 softmax over the same f16 keys and values, for plain
//! multi-head, GQA and MQA layouts, several splits and a sliding window; and the tiled prefill
//! kernel on batches of consecutive rows of two sequences (tiles cut at the sequence boundary).
//! Where the decode kernels also write the q8_1 blocks of their output, those are held bit for
//! bit to the reference quantizer applied to the kernel's own output.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use half::f16;

use super::cuda_kernels::{floats, Check};
use crate::kernels::cuda::launch::{DevBuf, Launch};
use crate::kernels::cuda::ops::{self, AttnArgs};

const BLOCK: usize = 32;
const N_BLOCKS: usize = 16;

/// (pos, lo, table seed) per query: sequences are told apart by their table seed.
type Queries = Vec<(u32, u32, usize)>;

pub fn attention(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    // Decode-like: separate sequences, one row each, up to 4 splits, one with a window.
    let decode: Queries = vec![
        (0, 0, 1),
        (37, 0, 3),
        (300, 0, 7),
        (300, 200, 2),
        (511, 0, 9),
    ];
    // Prefill-like: 21 rows of one sequence from position 0, then 41 rows of another at positions
    // 100..=140 with a 64-key window.
    let mut prefill: Queries = (0..=20).map(|p| (p, 0, 1)).collect();
    prefill.extend((100..=140).map(|p| (p, p - 63, 4)));
    for shape in [
        (4, 4, 64),
        (8, 2, 128),
        (4, 1, 256),
        (12, 2, 16),
        (14, 2, 64),
    ] {
        case(l, out, shape, &decode, false)?;
    }
    for shape in [(4, 4, 64), (8, 2, 128), (4, 1, 256), (6, 3, 16)] {
        case(l, out, shape, &prefill, true)?;
        case(l, out, shape, &prefill[..3], true)?;
    }
    case(l, out, (8, 2, 128), &prefill, false)?;
    // Short decode rows: one split, so attn_split writes (and quantizes) the output itself.
    case(l, out, (8, 2, 128), &decode[..2], false)?;
    case(l, out, (4, 1, 256), &decode[..2], false)?;
    Ok(())
}

fn case(
    l: &Arc<dyn Launch>,
    out: &mut Vec<Check>,
    (nh, nkv, hd): (usize, usize, usize),
    queries: &[(u32, u32, usize)],
    tiled: bool,
) -> Result<()> {
    {
        let kv_dim = nkv * hd;
        let slots = N_BLOCKS * BLOCK;
        let to16 = |v: Vec<f32>| -> Vec<f16> { v.into_iter().map(f16::from_f32).collect() };
        let (k, v) = (
            to16(floats(slots * kv_dim, 21)),
            to16(floats(slots * kv_dim, 22)),
        );
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
        let bytes = |h: &[f16]| -> Vec<u8> { h.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let (kd, vd) = (
            DevBuf::from_bytes(l, &bytes(&k))?,
            DevBuf::from_bytes(l, &bytes(&v))?,
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
            scale,
            n_split,
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
                let qh = &q[(i * nh + h) * hd..][..hd];
                let keys: Vec<usize> = (lo..=pos)
                    .map(|p| tables[i][p as usize / BLOCK] as usize * BLOCK + p as usize % BLOCK)
                    .collect();
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&slot| {
                        let kr = &k[slot * kv_dim + kvh * hd..][..hd];
                        qh.iter()
                            .zip(kr)
                            .map(|(&a, b)| a as f64 * b.to_f64())
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let sum: f64 = p.iter().sum();
                for d in 0..hd {
                    let want: f64 = keys
                        .iter()
                        .zip(&p)
                        .map(|(&slot, &pj)| pj * v[slot * kv_dim + kvh * hd + d].to_f64())
                        .sum::<f64>()
                        / sum;
                    err = err.max((got[(i * nh + h) * hd + d] as f64 - want).abs());
                }
            }
        }
        let (kernel, shape) = match tiled {
            true => {
                let n_tiles = tiles.len() / 2;
                let s = format!("{n_q} rows, {n_tiles} tiles, {nh}/{nkv} heads, hd {hd} (abs)");
                ("attn_prefill", s)
            }
            false => {
                let s = format!("{n_q} queries, {nh}/{nkv} heads, hd {hd}, {n_split} splits (abs)");
                ("attn_split+merge", s)
            }
        };
        if with_q8 {
            let mut want = vec![0u8; got.len() / 32 * ops::Q8_1_BYTES];
            crate::quant::quantize::quantize_row_q8_1(&got, &mut want);
            let bytes = q8.to_bytes()?;
            let diff = want.iter().zip(&bytes).filter(|(a, b)| a != b).count();
            out.push(Check {
                kernel: kernel.into(),
                shape: format!("{n_q} queries, {nh}/{nkv}x{hd}, {n_split} splits: q8_1 of its output (bytes differing)"),
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
