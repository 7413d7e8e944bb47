//! Op-by-op comparison of the CPU forward pass with tensors dumped from llama.cpp (a debugging aid,
//! ignored by default). Set `PARITY_DUMP=/path/prefix` (files `prefix.idx` / `prefix.bin` written
//! by a llama.cpp eval callback: one line `name op ne0 ne1 ne2 ne3 offset type` per tensor, data as
//! f32), `PARITY_MODEL=qwen|gemma` and `PARITY_IDS=1,2,3` (the prompt ids of the dumped ubatch), then
//! `cargo test --release --test parity_debug -- --ignored --nocapture`.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{model, GEMMA, QWEN};
use infer::format::Gguf;
use infer::kernels::cpu::backend::{CpuAct, CpuBackend};
use infer::model::backend::{AttnQuery, AttnShape, Backend, Rope};
use infer::model::{ModelConfig, Weights};

struct Dump {
    entries: Vec<(String, String, Vec<usize>, usize)>,
    data: Vec<f32>,
}

impl Dump {
    fn load(prefix: &str) -> Dump {
        let idx = std::fs::read_to_string(format!("{prefix}.idx")).unwrap();
        let bytes = std::fs::read(format!("{prefix}.bin")).unwrap();
        let data = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let mut entries = Vec::new();
        for line in idx.lines() {
            // names may contain spaces ("Kcur-0 (view)"): parse from the right.
            let parts: Vec<&str> = line.split(' ').collect();
            let n = parts.len();
            let off: usize = parts[n - 2].parse().unwrap();
            let ne: Vec<usize> = parts[n - 6..n - 2].iter().map(|s| s.parse().unwrap()).collect();
            let op = parts[n - 7].to_string();
            let name = parts[..n - 7].join(" ");
            entries.push((name, op, ne, off));
        }
        Dump { entries, data }
    }

    fn get(&self, name: &str, op: &str) -> Option<&[f32]> {
        self.entries
            .iter()
            .find(|e| e.0 == name && e.1 == op)
            .map(|e| {
                let n: usize = e.2.iter().product();
                &self.data[e.3..e.3 + n]
            })
    }
}

fn cmp(stats: &mut HashMap<String, (usize, usize, f32)>, what: &str, ours: &[f32], theirs: Option<&[f32]>) {
    let Some(t) = theirs else {
        eprintln!("  {what}: not in dump");
        return;
    };
    // llama.cpp keeps only the output rows after the last layer's attention: compare the tail.
    let ours = &ours[ours.len() - t.len().min(ours.len())..];
    let mut ndiff = 0;
    let mut maxd = 0f32;
    let mut first = None;
    for (i, (a, b)) in ours.iter().zip(t).enumerate() {
        if a.to_bits() != b.to_bits() {
            ndiff += 1;
            maxd = maxd.max((a - b).abs());
            if first.is_none() {
                first = Some((i, *a, *b));
            }
        }
    }
    let s = stats.entry(what.to_string()).or_insert((0, 0, 0.0));
    s.0 += ndiff;
    s.1 += ours.len();
    s.2 = s.2.max(maxd);
    if ndiff > 0 && std::env::var_os("PARITY_ROWS").is_some() {
        let cols: usize = std::env::var("PARITY_ROWS").unwrap().parse().unwrap();
        let rows: Vec<usize> = (0..ours.len() / cols)
            .map(|r| (0..cols).filter(|&c| ours[r * cols + c].to_bits() != t[r * cols + c].to_bits()).count())
            .collect();
        eprintln!("  {what}: per-row diffs {rows:?}");
    }
    if ndiff > 0 {
        let (i, a, b) = first.unwrap();
        eprintln!(
            "  {what}: {ndiff}/{} differ, max {maxd:e}; first [{i}] ours {a:e} theirs {b:e}",
            ours.len()
        );
    }
}

#[test]
#[ignore]
fn parity_debug_ops() {
    let prefix = std::env::var("PARITY_DUMP").expect("PARITY_DUMP");
    let which = std::env::var("PARITY_MODEL").unwrap_or_else(|_| "gemma".into());
    let ids: Vec<u32> = std::env::var("PARITY_IDS")
        .expect("PARITY_IDS")
        .split(',')
        .map(|s| s.parse().unwrap())
        .collect();
    // Use llama.cpp's tensors as inputs of each op (isolates each op) unless PARITY_CHAIN is set.
    let chain = std::env::var_os("PARITY_CHAIN").is_some();
    let dump = Dump::load(&prefix);
    let g = Arc::new(Gguf::open(&model(if which == "qwen" { QWEN } else { GEMMA })).unwrap());
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let be = CpuBackend::new(2);
    let w = Weights::load(&g, &cfg, &be).unwrap();
    let n = ids.len();
    let bs = 32;
    let n_blocks = n.div_ceil(bs);
    let table: Vec<u32> = (0..n_blocks as u32).collect();
    let mut kv = be.alloc_kv(cfg.n_layer, n_blocks, bs, cfg.kv_dim()).unwrap();
    let positions: Vec<u32> = (0..n as u32).collect();
    let slots: Vec<usize> = (0..n).collect();
    let (d, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
    let mut stats = HashMap::new();
    let mut x = be.act(n, d);
    be.embed(&w.token_embd, &ids, cfg.embd_scale, &mut x);
    let set = |a: &mut CpuAct, t: Option<&[f32]>| {
        if !chain {
            if let Some(t) = t {
                let n = a.data.len();
                a.data[n - t.len()..].copy_from_slice(t);
            }
        }
    };
    let gemma = which != "qwen";
    cmp(&mut stats, "embd", &x.data, dump.get(if gemma { "inp_scaled" } else { "inp_embd" }, if gemma { "SCALE" } else { "GET_ROWS" }));
    let nl: usize = std::env::var("PARITY_LAYERS").ok().map(|s| s.parse().unwrap()).unwrap_or(cfg.n_layer);
    for (il, (lw, lc)) in w.layers.iter().zip(&cfg.layers).enumerate().take(nl) {
        eprintln!("layer {il}");
        let mut h = be.act(n, d);
        be.rms_norm(&x, &lw.attn_norm, cfg.norm_eps, &mut h);
        cmp(&mut stats, "attn_norm", &h.data, dump.get(&format!("attn_norm-{il}"), "MUL"));
        set(&mut h, dump.get(&format!("attn_norm-{il}"), "MUL"));
        let mut q = be.act(n, qd);
        let mut k = be.act(n, kvd);
        let mut v = be.act(n, kvd);
        be.matmul(&lw.wq, &h, lw.bq.as_ref(), &mut q);
        be.matmul(&lw.wk, &h, lw.bk.as_ref(), &mut k);
        be.matmul(&lw.wv, &h, lw.bv.as_ref(), &mut v);
        let (qop, kop, vop) = if gemma { ("MUL_MAT", "MUL_MAT", "MUL_MAT") } else { ("ADD", "ADD", "ADD") };
        cmp(&mut stats, "q", &q.data, dump.get(&format!("Qcur-{il}"), qop));
        cmp(&mut stats, "k", &k.data, dump.get(&format!("Kcur-{il}"), kop));
        cmp(&mut stats, "v", &v.data, dump.get(&format!("Vcur-{il}"), vop));
        set(&mut q, dump.get(&format!("Qcur-{il}"), qop));
        set(&mut k, dump.get(&format!("Kcur-{il}"), kop));
        set(&mut v, dump.get(&format!("Vcur-{il}"), vop));
        if let Some(qn) = &lw.q_norm {
            be.rms_norm_inplace(&mut q, qn, cfg.norm_eps);
            cmp(&mut stats, "q_norm", &q.data, dump.get(&format!("Qcur_normed-{il}"), "MUL"));
            set(&mut q, dump.get(&format!("Qcur_normed-{il}"), "MUL"));
        }
        if let Some(kn) = &lw.k_norm {
            be.rms_norm_inplace(&mut k, kn, cfg.norm_eps);
            cmp(&mut stats, "k_norm", &k.data, dump.get(&format!("Kcur_normed-{il}"), "MUL"));
            set(&mut k, dump.get(&format!("Kcur_normed-{il}"), "MUL"));
        }
        let rope = Rope { style: cfg.rope_style, base: lc.rope_base, head_dim: cfg.head_dim };
        be.rope(&mut q, &positions, rope);
        be.rope(&mut k, &positions, rope);
        cmp(&mut stats, "q_rope", &q.data, dump.get(&format!("Qcur-{il}"), "ROPE"));
        cmp(&mut stats, "k_rope", &k.data, dump.get(&format!("Kcur-{il}"), "ROPE"));
        set(&mut q, dump.get(&format!("Qcur-{il}"), "ROPE"));
        set(&mut k, dump.get(&format!("Kcur-{il}"), "ROPE"));
        if cfg.scale_q_first {
            be.scale(&mut q, cfg.attn_scale);
            // the SCALE node after this layer's Q rope
            let pos = dump.entries.iter().position(|e| e.0 == format!("Qcur-{il}") && e.1 == "ROPE").unwrap();
            let e = dump.entries[pos..].iter().find(|e| e.1 == "SCALE").unwrap();
            let t = &dump.data[e.3..e.3 + q.data.len()];
            cmp(&mut stats, "q_scale", &q.data, Some(t));
            set(&mut q, Some(t));
        }
        be.kv_write(&mut kv, il, &k, &v, &slots);
        let queries: Vec<AttnQuery<'_>> = positions
            .iter()
            .map(|&p| AttnQuery {
                block_table: &table,
                pos: p,
                lo: match lc.window {
                    Some(win) => (p + 1).saturating_sub(win),
                    None => 0,
                },
            })
            .collect();
        let shape = AttnShape {
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            scale: if cfg.scale_q_first { 1.0 } else { cfg.attn_scale },
        };
        let mut attn = be.act(n, qd);
        be.attention(&q, &kv, il, &queries, shape, &mut attn);
        let fas: Vec<_> = dump.entries.iter().filter(|e| e.1 == "FLASH_ATTN_EXT").collect();
        let t = fas.get(il).map(|e| &dump.data[e.3..e.3 + attn.data.len()]);
        cmp(&mut stats, "attn", &attn.data, t);
        set(&mut attn, t);
        let mut o = be.act(n, d);
        be.matmul(&lw.wo, &attn, None, &mut o);
        let wo_name = format!("attn_out-{il}");
        let wo_t = dump.get(&wo_name, "MUL_MAT").or_else(|| {
            // gemma: unnamed MUL_MAT right after the il-th FLASH_ATTN_EXT
            let fa = *fas.get(il)?;
            let pos = dump.entries.iter().position(|e| std::ptr::eq(e, fa))?;
            let e = dump.entries[pos..].iter().find(|e| e.1 == "MUL_MAT")?;
            Some(&dump.data[e.3..e.3 + o.data.len()])
        });
        cmp(&mut stats, "wo", &o.data, wo_t);
        set(&mut o, wo_t);
        if let Some(pn) = &lw.post_attn_norm {
            be.rms_norm_inplace(&mut o, pn, cfg.norm_eps);
            cmp(&mut stats, "post_attn_norm", &o.data, dump.get(&format!("attn_post_norm-{il}"), "MUL"));
            set(&mut o, dump.get(&format!("attn_post_norm-{il}"), "MUL"));
        }
        be.add(&mut x, &o);
        let sa = if gemma { format!("sa_out-{il}") } else { format!("ffn_inp-{il}") };
        cmp(&mut stats, "sa_out", &x.data, dump.get(&sa, "ADD"));
        set(&mut x, dump.get(&sa, "ADD"));
        be.rms_norm(&x, &lw.ffn_norm, cfg.norm_eps, &mut h);
        cmp(&mut stats, "ffn_norm", &h.data, dump.get(&format!("ffn_norm-{il}"), "MUL"));
        set(&mut h, dump.get(&format!("ffn_norm-{il}"), "MUL"));
        let mut gate = be.act(n, ff);
        let mut up = be.act(n, ff);
        be.matmul(&lw.w_gate, &h, None, &mut gate);
        be.matmul(&lw.w_up, &h, None, &mut up);
        cmp(&mut stats, "gate", &gate.data, dump.get(&format!("ffn_gate-{il}"), "MUL_MAT"));
        cmp(&mut stats, "up", &up.data, dump.get(&format!("ffn_up-{il}"), "MUL_MAT"));
        set(&mut gate, dump.get(&format!("ffn_gate-{il}"), "MUL_MAT"));
        set(&mut up, dump.get(&format!("ffn_up-{il}"), "MUL_MAT"));
        be.glu(&mut gate, &up, cfg.activation);
        let gname = if gemma { format!("ffn_geglu-{il}") } else { format!("ffn_swiglu-{il}") };
        let gop = if gemma { "GEGLU" } else { "SWIGLU" };
        cmp(&mut stats, "glu", &gate.data, dump.get(&gname, gop));
        set(&mut gate, dump.get(&gname, gop));
        be.matmul(&lw.w_down, &gate, None, &mut o);
        cmp(&mut stats, "down", &o.data, dump.get(&format!("ffn_out-{il}"), "MUL_MAT"));
        set(&mut o, dump.get(&format!("ffn_out-{il}"), "MUL_MAT"));
        if let Some(pn) = &lw.post_ffn_norm {
            be.rms_norm_inplace(&mut o, pn, cfg.norm_eps);
            cmp(&mut stats, "post_ffn_norm", &o.data, dump.get(&format!("ffn_post_norm-{il}"), "MUL"));
            set(&mut o, dump.get(&format!("ffn_post_norm-{il}"), "MUL"));
        }
        be.add(&mut x, &o);
        cmp(&mut stats, "l_out", &x.data, dump.get(&format!("l_out-{il}"), "ADD"));
        set(&mut x, dump.get(&format!("l_out-{il}"), "ADD"));
    }
    if nl == cfg.n_layer {
        let last = be.gather_rows(&x, &[n - 1]);
        let mut hs = be.act(1, d);
        be.rms_norm(&last, &w.output_norm, cfg.norm_eps, &mut hs);
        let rn = dump.get("result_norm", "MUL");
        cmp(&mut stats, "result_norm", &hs.data, rn);
        set(&mut hs, rn);
        let mut logits = be.act(1, cfg.vocab_size);
        be.matmul(w.output.as_ref().unwrap_or(&w.token_embd), &hs, None, &mut logits);
        cmp(&mut stats, "logits", &logits.data, dump.get("result_output", "MUL_MAT"));
    }
    let mut keys: Vec<_> = stats.iter().collect();
    keys.sort_by(|a, b| a.0.cmp(b.0));
    for (k, (nd, tot, maxd)) in keys {
        eprintln!("{k:>16}: {nd}/{tot} elements differ, max |diff| {maxd:e}");
    }
}

#[test]
#[ignore]
fn parity_debug_rope_variants() {
    let prefix = std::env::var("PARITY_DUMP").expect("PARITY_DUMP");
    let dump = Dump::load(&prefix);
    let src = dump.get("Qcur_normed-0", "MUL").unwrap();
    let want = dump.get("Qcur-0", "ROPE").unwrap();
    let hd = 256;
    let base: f32 = 10000.0;
    let n_rows = src.len() / hd;
    let heads = 4;
    let theta_scale = base.powf(-2.0 / hd as f32);
    type F = fn(f32, f32, f32, f32) -> (f32, f32);
    let variants: Vec<(&str, F)> = vec![
        ("plain", |x0, x1, c, s| (x0 * c - x1 * s, x0 * s + x1 * c)),
        ("fma_a", |x0, x1, c, s| (x0.mul_add(c, -(x1 * s)), x1.mul_add(c, x0 * s))),
        ("fma_b", |x0, x1, c, s| ((-x1).mul_add(s, x0 * c), x0.mul_add(s, x1 * c))),
        ("fma_c", |x0, x1, c, s| (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c))),
        ("fma_d", |x0, x1, c, s| ((-x1).mul_add(s, x0 * c), x1.mul_add(c, x0 * s))),
    ];
    for (name, f) in variants {
        let mut bad = 0;
        for r in 0..n_rows {
            let pos = (r / heads) as f32;
            let x = &src[r * hd..(r + 1) * hd];
            let w = &want[r * hd..(r + 1) * hd];
            let mut theta = pos;
            for i in 0..hd / 2 {
                let (c, s) = (theta.cos(), theta.sin());
                let (a, b) = f(x[i], x[i + hd / 2], c, s);
                if a.to_bits() != w[i].to_bits() { bad += 1; }
                if b.to_bits() != w[i + hd / 2].to_bits() { bad += 1; }
                theta *= theta_scale;
            }
        }
        eprintln!("{name}: {bad} differ");
    }
}

/// Teacher-forced logits against `PARITY_DUMP.logits` (prompt `PARITY_IDS`, then `PARITY_GEN`
/// one token at a time, as lcpdump evaluated them).
#[test]
#[ignore]
fn parity_debug_logits() {
    use infer::engine::runner::{Runner, Sequence, BLOCK_SIZE};
    use infer::model::Model;
    let prefix = std::env::var("PARITY_DUMP").expect("PARITY_DUMP");
    let which = std::env::var("PARITY_MODEL").unwrap_or_else(|_| "gemma".into());
    let parse = |v: &str| -> Vec<u32> {
        std::env::var(v).unwrap_or_default().split(',').filter(|s| !s.is_empty()).map(|s| s.parse().unwrap()).collect()
    };
    let ids = parse("PARITY_IDS");
    let gen = parse("PARITY_GEN");
    let bytes = std::fs::read(format!("{prefix}.logits")).unwrap();
    let all: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let g = Arc::new(Gguf::open(&model(if which == "qwen" { QWEN } else { GEMMA })).unwrap());
    let cfg = ModelConfig::from_gguf(&g).unwrap();
    let nv = cfg.vocab_size;
    let backend = CpuBackend::new(2);
    let weights = Weights::load(&g, &cfg, &backend).unwrap();
    let model = Model { cfg, weights, backend, block_size: BLOCK_SIZE };
    let mut runner = Runner::new(model, ids.len() + gen.len() + 8).unwrap();
    let mut seq = Sequence::default();
    let mut logits = runner.extend(&mut seq, &ids).unwrap();
    for step in 0..=gen.len() {
        let want = &all[step * nv..(step + 1) * nv];
        let nd = logits.iter().zip(want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        let maxd = logits.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let am = |v: &[f32]| (0..v.len()).max_by(|&a, &b| v[a].total_cmp(&v[b])).unwrap();
        eprintln!("step {step} (pos {}): {nd} differ, max {maxd:e}, argmax ours {} theirs {}", ids.len() + step - 1, am(&logits), am(want));
        if step < gen.len() {
            logits = runner.extend(&mut seq, &[gen[step]]).unwrap();
        }
    }
}
