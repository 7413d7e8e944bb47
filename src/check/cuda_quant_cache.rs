//! The quantized KV cache's kernels' check (part of [`super::cuda_kernels::run_all`]): the KV
//! writes (`kv_write_q`, and `rope_kv` into a quantized cache) against the CPU's store (each
//! 32-value block rotated by `rotate.rs`, then ggml's reference q8_0/q4_0, as
//! `attention/quant_cache.rs` writes a row), and the attention kernels that read the blocks in
//! place (`attn_split_q` + `attn_merge`, `attn_prefill_q`) through `cuda_attention`'s cases with
//! the cache in every mix of types the CLI takes (q8_0/q8_0, q4_0/q4_0, q8_0/f16, f16/q8_0,
//! q4_0/q8_0), at ragged shapes: several splits, a window, GQA groups of 1 to 7 and MQA, one-split
//! decode rows (whose q8_1 output is held bit for bit), tiles cut at a sequence boundary.
//!
//! `kv_write_q` is held bit for bit to the CPU's bytes (rows with an all-zero block, a lone
//! outlier and a tie of magnitudes of both signs, where q4_0 takes the first). `rope_kv`'s V
//! blocks are too (V is not rotated by RoPE, so the kernel quantizes the same f32 values); its K
//! blocks come from the kernel's own RoPE, whose f32 values may differ from the CPU's in the last
//! bit, so they are held to within one quantization step of the CPU's.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;

use super::cuda_attention::{case, decode_queries, prefill_queries, store_rows};
use super::cuda_kernels::{floats, Check};
use crate::kernels::cpu::ops as cpu;
use crate::kernels::cuda::launch::{DevBuf, Launch};
use crate::kernels::cuda::ops::{self, RopeKv};
use crate::model::backend::CacheType;
use crate::model::config::RopeStyle;
use crate::quant::dequantize_row;

const Q8: CacheType = CacheType::Q8_0;
const Q4: CacheType = CacheType::Q4_0;
const F16: CacheType = CacheType::F16;

pub fn quant_cache(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    for types in [(Q8, Q8), (Q4, Q4), (Q8, F16), (F16, Q4)] {
        kv_write(l, out, types, 64)?;
    }
    kv_write(l, out, (Q4, Q8), 256)?;
    rope_kv(l, out)?;
    let (decode, prefill) = (decode_queries(), prefill_queries());
    // Decode: up to 4 splits and a window.
    case(l, out, (8, 2, 128), &decode, false, (Q8, Q8))?;
    case(l, out, (4, 1, 256), &decode, false, (Q4, Q4))?;
    case(l, out, (14, 2, 64), &decode, false, (Q8, F16))?;
    case(l, out, (4, 4, 32), &decode, false, (F16, Q8))?;
    // One split: attn_split_q writes the output and its q8_1 blocks itself.
    case(l, out, (8, 2, 128), &decode[..2], false, (Q4, Q8))?;
    // Prefill: tiles of two sequences, one windowed.
    case(l, out, (8, 2, 128), &prefill, true, (Q8, Q8))?;
    case(l, out, (6, 3, 64), &prefill, true, (Q4, Q4))?;
    case(l, out, (4, 1, 256), &prefill[..3], true, (Q8, F16))?;
    case(l, out, (4, 2, 32), &prefill[..3], true, (F16, Q4))?;
    Ok(())
}

fn push(out: &mut Vec<Check>, kernel: &str, shape: String, err: f64, tol: f64, secs: f64) {
    out.push(Check {
        kernel: kernel.into(),
        shape,
        err,
        tol,
        secs,
    });
}

/// Slots the rows are written to (scattered, out of order).
const SLOTS: [i32; 3] = [5, 0, 3];
const N_SLOTS: usize = 6;

/// Rows of `kv_dim` values with the quantizers' edge cases: an all-zero block, a lone outlier, and
/// (in the last row) a block whose largest magnitude appears first negative then positive.
fn edge_rows(kv_dim: usize, seed: u64) -> Vec<f32> {
    let mut x = floats(SLOTS.len() * kv_dim, seed);
    x[..32].iter_mut().for_each(|v| *v = 0.0);
    x[kv_dim + 7] = 40.0;
    let last = 2 * kv_dim + 32;
    x[last + 3] = -1.5;
    x[last + 20] = 1.5;
    x
}

/// What the CPU stores for `rows` at [`SLOTS`] in a plane of [`N_SLOTS`] rows of type `ty`.
fn cpu_plane(ty: CacheType, rows: &[f32], kv_dim: usize) -> Vec<u8> {
    let rb = ty.row_bytes(kv_dim);
    let (bytes, _) = store_rows(ty, rows, kv_dim);
    let mut plane = vec![0u8; N_SLOTS * rb];
    for (i, &s) in SLOTS.iter().enumerate() {
        plane[s as usize * rb..][..rb].copy_from_slice(&bytes[i * rb..][..rb]);
    }
    plane
}

fn differing(a: &[u8], b: &[u8]) -> f64 {
    (a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())) as f64
}

fn kv_write(
    l: &Arc<dyn Launch>,
    out: &mut Vec<Check>,
    (kt, vt): (CacheType, CacheType),
    kv_dim: usize,
) -> Result<()> {
    let (k, v) = (edge_rows(kv_dim, 51), edge_rows(kv_dim, 52));
    let (kd, vd) = (DevBuf::from_f32(l, &k)?, DevBuf::from_f32(l, &v)?);
    let kc = DevBuf::new(l, N_SLOTS * kt.row_bytes(kv_dim))?;
    let vc = DevBuf::new(l, N_SLOTS * vt.row_bytes(kv_dim))?;
    let sd = DevBuf::from_i32(l, &SLOTS)?;
    l.sync()?;
    let t = Instant::now();
    let caches = (kc.ptr, vc.ptr);
    let n = SLOTS.len();
    ops::kv_write_q(&**l, caches, (kd.ptr, vd.ptr), sd.ptr, n, kv_dim, (kt, vt))?;
    l.sync()?;
    let secs = t.elapsed().as_secs_f64();
    let err = differing(&kc.to_bytes()?, &cpu_plane(kt, &k, kv_dim))
        + differing(&vc.to_bytes()?, &cpu_plane(vt, &v, kv_dim));
    let shape = format!(
        "{n} rows of {kv_dim}, {}/{}: bytes differing from the CPU's",
        kt.name(),
        vt.name()
    );
    push(out, "kv_write_q", shape, err, 0.0, secs);
    Ok(())
}

/// The largest difference between two planes' values (dequantized, still rotated) in units of
/// the CPU block's quantization step (`d`, the block's f16 scale).
fn steps_apart(ty: CacheType, got: &[u8], want: &[u8]) -> Result<f64> {
    let bb = ty.row_bytes(32);
    let (mut g, mut w) = ([0f32; 32], [0f32; 32]);
    let mut worst = 0f64;
    for (a, b) in got.chunks_exact(bb).zip(want.chunks_exact(bb)) {
        dequantize_row(ty.ggml(), a, &mut g)?;
        dequantize_row(ty.ggml(), b, &mut w)?;
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32().abs() as f64;
        for (x, y) in g.iter().zip(&w) {
            let diff = (x - y).abs() as f64;
            worst = worst.max(if d > 0.0 { diff / d } else { diff * 1e9 });
        }
    }
    Ok(worst)
}

/// `rope_kv` into a quantized cache: q as the f16 path computes it (held by `cuda_fused`), the
/// K and V blocks against the CPU's store of the CPU's RoPE of k and of v.
fn rope_kv(l: &Arc<dyn Launch>, out: &mut Vec<Check>) -> Result<()> {
    // (heads, KV heads, head_dim, pairing, q/k norms, K type, V type)
    let cases = [
        (4, 2, 64, RopeStyle::Neox, false, Q8, Q4),
        (4, 1, 128, RopeStyle::Normal, true, Q4, F16),
        (2, 2, 32, RopeStyle::Neox, false, F16, Q8),
    ];
    let (eps, base) = (1e-6, 10000.0);
    let rows = SLOTS.len();
    let pos = [7i32, 1000, 64];
    for (nh, nkv, hd, style, norms, kt, vt) in cases {
        let kv_dim = nkv * hd;
        let q = floats(rows * nh * hd, 61);
        let (k, v) = (edge_rows(kv_dim, 62), edge_rows(kv_dim, 63));
        let (qn, kn) = (floats(hd, 64), floats(hd, 65));
        let dev = |v: &[f32]| DevBuf::from_f32(l, v);
        let (qb, kb, vb, qnb, knb) = (dev(&q)?, dev(&k)?, dev(&v)?, dev(&qn)?, dev(&kn)?);
        let (sb, pb) = (DevBuf::from_i32(l, &SLOTS)?, DevBuf::from_i32(l, &pos)?);
        let kc = DevBuf::new(l, N_SLOTS * kt.row_bytes(kv_dim))?;
        let vc = DevBuf::new(l, N_SLOTS * vt.row_bytes(kv_dim))?;
        let r = RopeKv {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            base,
            style,
            ff: None,
            q_norm: norms.then_some(qnb.ptr),
            k_norm: norms.then_some(knb.ptr),
            eps,
            q_scale: 1.0,
        };
        l.sync()?;
        let t = Instant::now();
        ops::rope_kv_typed(
            &**l,
            (qb.ptr, kb.ptr, vb.ptr),
            (kc.ptr, vc.ptr),
            (kt, vt),
            (sb.ptr, pb.ptr),
            rows,
            &r,
        )?;
        l.sync()?;
        let secs = t.elapsed().as_secs_f64();
        // The CPU's K: per-head norm, RoPE.
        let mut wk = k.clone();
        let mut cache = vec![0f32; hd];
        for (row, &p) in pos.iter().enumerate() {
            cpu::rope_cache(p as u32, base, hd, &mut cache);
            for h in wk[row * kv_dim..(row + 1) * kv_dim].chunks_exact_mut(hd) {
                if norms {
                    cpu::rms_norm_inplace(h, &kn, eps);
                }
                cpu::rope_head(h, &cache, style);
            }
        }
        let shape = format!(
            "{rows}x{nh}/{nkv}x{hd} {style:?}, {}/{}",
            kt.name(),
            vt.name()
        );
        let got_v = vc.to_bytes()?;
        let err_v = differing(&got_v, &cpu_plane(vt, &v, kv_dim));
        push(
            out,
            "rope_kv",
            format!("{shape}: V bytes differing from the CPU's"),
            err_v,
            0.0,
            secs,
        );
        let (got_k, want_k) = (kc.to_bytes()?, cpu_plane(kt, &wk, kv_dim));
        let (err_k, what, tol) = match kt {
            // f16 values: a last-bit difference in f32 may round to the neighbouring f16.
            F16 => {
                let f = |b: &[u8]| -> Vec<f32> {
                    b.chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                        .collect()
                };
                let (g, w) = (f(&got_k), f(&want_k));
                let m = w.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
                let e = g
                    .iter()
                    .zip(&w)
                    .fold(0f64, |e, (a, b)| e.max((a - b).abs() as f64));
                (e / m, "f16 K (rel. to max)", 1e-3)
            }
            _ => (
                steps_apart(kt, &got_k, &want_k)?,
                "K blocks (steps from the CPU's)",
                1.0 + 1e-3,
            ),
        };
        push(out, "rope_kv", format!("{shape}: {what}"), err_k, tol, 0.0);
    }
    Ok(())
}
