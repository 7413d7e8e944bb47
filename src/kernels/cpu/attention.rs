//! CPU attention over the paged f16 KV cache. Each (query row, head) pair is one unit of work split
//! across the pool; a head reads the K/V rows of its KV group straight from the pages. The query is
//! rounded to f16 before the dot with the f16 keys, as ggml's CPU flash attention does.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kernels::cpu::backend::{CpuAct, CpuKv};
use crate::kernels::cpu::pool::ThreadPool;
use crate::model::backend::{AttnQuery, AttnShape};

#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: each (query, head) unit writes only its own head_dim slice of the output, and the pool joins
// all threads before the output is read.
unsafe impl Sync for SharedOut {}
unsafe impl Send for SharedOut {}

pub fn attention(
    pool: &ThreadPool,
    q: &CpuAct,
    kv: &CpuKv,
    layer: usize,
    queries: &[AttnQuery<'_>],
    shape: AttnShape,
    out: &mut CpuAct,
) {
    let hd = shape.head_dim;
    let group = shape.n_head / shape.n_head_kv;
    let (bs, kvd) = (kv.block_size, kv.kv_dim);
    let (kc, vc) = (&kv.k[layer], &kv.v[layer]);
    let out_cols = out.cols;
    let dst = SharedOut(out.data.as_mut_ptr());
    pool.for_range(queries.len() * shape.n_head, 1, |range| {
        let dst = dst;
        let mut acc16 = vec![f16::ZERO; hd];
        let dbg32 = std::env::var_os("DBG_F32").is_some();
        let nofa: Option<usize> = std::env::var("DBG_NOFA").ok().map(|v| v.parse().unwrap());
        let mut qh = vec![0f32; hd];
        let mut kf = vec![0f32; hd];
        let mut acc = vec![0f32; hd];
        for unit in range {
            let (i, h) = (unit / shape.n_head, unit % shape.n_head);
            let kvh = h / group;
            let qa = &queries[i];
            for (d, &s) in qh.iter_mut().zip(&q.row(i)[h * hd..(h + 1) * hd]) {
                *d = f16::from_f32(s).to_f32();
            }
            // Online softmax with the V accumulator held in f16, as ggml's CPU flash attention
            // (`flash_attn_ext_f16_one_chunk`) does for an f16 cache.
            let mut max = f32::NEG_INFINITY;
            let mut sum = 0f32;
            let mut sum32 = 0f32; let mut max32 = f32::NEG_INFINITY; let mut acc32 = vec![0f32; hd];
            acc16.iter_mut().for_each(|a| *a = f16::ZERO);
            for p in qa.lo..=qa.pos {
                let p = p as usize;
                let slot = qa.block_table[p / bs] as usize * bs + p % bs;
                let off = slot * kvd + kvh * hd;
                kc[off..off + hd].convert_to_f32_slice(&mut kf);
                let s = dot_f16_like_ggml(&qh, &kf) * shape.scale;
                let (mut ms, mut vs) = (1.0f32, 1.0f32);
                if s > max {
                    ms = (max - s).exp();
                    max = s;
                    for a in acc16.iter_mut() {
                        *a = f16::from_f32(a.to_f32() * ms);
                    }
                } else {
                    vs = (s - max).exp();
                }
                vc[off..off + hd].convert_to_f32_slice(&mut kf);
                for (a, &v) in acc16.iter_mut().zip(&kf) {
                    *a = f16::from_f32(v.mul_add(vs, a.to_f32()));
                }
                sum = sum * ms + vs;
                if dbg32 { let (mut ms2, mut vs2) = (1.0f32, 1.0f32); if s > max32 { ms2 = (max32 - s).exp(); max32 = s; acc32.iter_mut().for_each(|a| *a *= ms2); } else { vs2 = (s - max32).exp(); } for (a, &v) in acc32.iter_mut().zip(&kf) { *a += v * vs2; } sum32 = sum32 * ms2 + vs2; }
            }
            acc16.convert_to_f32_slice(&mut acc);
            if dbg32 { acc.copy_from_slice(&acc32); sum = sum32; }
            if let Some(pad) = nofa {
                // llama.cpp without flash attention: softmax in f32, probabilities rounded to f16,
                // then a dot over the (padded) KV length.
                let n = (qa.pos - qa.lo + 1) as usize;
                let npad = if pad == 0 { n } else { n.div_ceil(pad) * pad };
                let mut sc = vec![0f32; n];
                for (j, p) in (qa.lo..=qa.pos).enumerate() {
                    let p = p as usize;
                    let slot = qa.block_table[p / bs] as usize * bs + p % bs;
                    let off = slot * kvd + kvh * hd;
                    kc[off..off + hd].convert_to_f32_slice(&mut kf);
                    sc[j] = dot_f16_like_ggml(&qh, &kf) * shape.scale;
                }
                let m = sc.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let mut tot = 0f64;
                for v in sc.iter_mut() { *v = (*v - m).exp(); tot += *v as f64; }
                let inv = (1.0 / tot) as f32;
                let mut pv = vec![0f32; npad];
                for j in 0..n { pv[j] = f16::from_f32(sc[j] * inv).to_f32(); }
                let mut col = vec![0f32; npad];
                for d in 0..hd {
                    for (j, p) in (qa.lo..=qa.pos).enumerate() {
                        let p = p as usize;
                        let slot = qa.block_table[p / bs] as usize * bs + p % bs;
                        col[j] = vc[slot * kvd + kvh * hd + d].to_f32();
                    }
                    acc[d] = dot_f16_like_ggml(&pv, &col);
                }
                sum = 1.0;
            }
            let inv = 1.0 / sum;
            for (d, &a) in acc.iter().enumerate() {
                // SAFETY: i < out.rows and h * hd + d < out_cols; unit (i, h) is handled by exactly one
                // thread, so this element is written once.
                unsafe { *dst.0.add(i * out_cols + h * hd + d) = a * inv };
            }
        }
    });
}

/// q·k summed as ggml's AVX-512 `ggml_vec_dot_f16` sums: four 16-lane FMA accumulators over steps of
/// 64, folded pairwise, then the 16 lanes reduced as `_mm512_reduce_add_ps` does; a tail is added in
/// order. Matching the order keeps scores bit-identical to llama.cpp's.
fn dot_f16_like_ggml(q: &[f32], k: &[f32]) -> f32 {
    let n = q.len();
    let np = n - n % 64;
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            let base = i + j * 16;
            for l in 0..16 {
                a[l] = q[base + l].mul_add(k[base + l], a[l]);
            }
        }
    }
    for l in 0..16 {
        acc[0][l] += acc[2][l];
        acc[1][l] += acc[3][l];
    }
    for l in 0..16 {
        acc[0][l] += acc[1][l];
    }
    let a = &acc[0];
    let mut t3 = [0f32; 8];
    for i in 0..8 {
        t3[i] = a[i + 8] + a[i];
    }
    let mut t6 = [0f32; 4];
    for i in 0..4 {
        t6[i] = t3[i + 4] + t3[i];
    }
    let t8 = [t6[0] + t6[2], t6[1] + t6[3]];
    let mut sum = (t8[0] + t8[1]) as f64;
    for i in np..n {
        sum += (q[i] * k[i]) as f64;
    }
    sum as f32
}
