//! The forward loop: one pass of the transformer over a batch of (sequence, position, token) entries,
//! readable top to bottom and the same for every backend. Prefill, decode, batched decode and
//! speculative verification are all this one call. Invariants: every entry's position has a KV block
//! in its block table; entries of one sequence may appear in any number, and each sees the keys at
//! positions up to its own (those written by this very batch included). As llama.cpp does, the last
//! layer keeps only the rows that want logits once its attention output is projected (`inp_out_ids`):
//! the rest of that layer then runs on fewer rows, which selects the same (row-count dependent)
//! matmul kernels as llama.cpp.

use anyhow::{bail, Result};

use crate::model::backend::{
    AttnBatch, AttnBlock, AttnQuery, AttnScratch, AttnShape, Backend, DevicePick, DeviceSampler,
    Join, Rope,
};
use crate::model::config::ModelConfig;
use crate::model::weights::{Attn, Ffn, Weights};
use crate::model::{mla, moe};

/// One token to run through the model.
#[derive(Clone, Copy, Debug)]
pub struct BatchEntry<'a> {
    pub token: u32,
    pub pos: u32,
    /// The entry's sequence: rows of one sequence share its keys, and no two sequences in a
    /// batch share an id.
    pub seq: u32,
    /// Physical KV blocks of this entry's sequence (must cover `pos`).
    pub block_table: &'a [u32],
    /// Return logits for this entry.
    pub logits: bool,
}

/// What [`Model::forward_picked`] does with one logits row.
pub enum Pick<'a> {
    /// Brings the row back to the host.
    Host,
    /// Samples it where it is with this device sampler and penalty window.
    Device(&'a mut DeviceSampler, &'a [u32]),
}

/// One logits row's outcome in [`Model::forward_picked`]: the row, or the token sampled from it.
#[derive(Debug)]
pub enum Picked {
    Logits(Vec<f32>),
    Token(u32),
}

pub struct Model<B: Backend> {
    pub cfg: ModelConfig,
    pub weights: Weights<B>,
    pub backend: B,
    /// Positions per KV block.
    pub block_size: usize,
}

impl<B: Backend> Model<B> {
    /// Runs the batch and returns the logits of the entries that asked for them, in batch order.
    pub fn forward(&self, kv: &mut B::Kv, batch: &[BatchEntry<'_>]) -> Result<Vec<Vec<f32>>> {
        self.forward_layers(kv, batch, self.cfg.n_layer)
    }

    /// [`Model::forward`] through the first `layers` layers only, then the final norm and head
    /// (early exit, for self-speculative drafts). Writes K/V of those layers alone.
    pub fn forward_layers(
        &self,
        kv: &mut B::Kv,
        batch: &[BatchEntry<'_>],
        layers: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let Some(logits) = self.forward_logits(kv, batch, layers)? else {
            return Ok(Vec::new());
        };
        let rows = self.backend.rows(&logits);
        let flat = self.backend.take_host(logits);
        if rows == 1 {
            return Ok(vec![flat]); // decode: no copy of the one row
        }
        Ok(flat
            .chunks_exact(self.cfg.vocab_size)
            .map(|r| r.to_vec())
            .collect())
    }

    /// Runs the batch and picks the next token from the last entry's logits where they are, with
    /// a sampler from [`Backend::device_sampler`] (`window`: its penalty window); the logits
    /// never come back to the host. The last entry, and only it, must want logits.
    pub fn forward_sample(
        &self,
        kv: &mut B::Kv,
        batch: &[BatchEntry<'_>],
        sampler: &mut DeviceSampler,
        window: &[u32],
    ) -> Result<u32> {
        if !batch.last().is_some_and(|e| e.logits) {
            bail!("device sampling needs the last entry's logits");
        }
        match self.forward_picked(kv, batch, &mut [Pick::Device(sampler, window)])?[..] {
            [Picked::Token(id)] => Ok(id),
            _ => bail!("device sampling of one row gave no token"),
        }
    }

    /// Runs the batch and handles each logits row (the entries that want logits, in batch
    /// order; one [`Pick`] each) as its pick says: back to the host, or sampled where it is.
    /// The rows sampled on the device are sampled together and only their ids come back; the
    /// others are copied back alone.
    pub fn forward_picked(
        &self,
        kv: &mut B::Kv,
        batch: &[BatchEntry<'_>],
        picks: &mut [Pick<'_>],
    ) -> Result<Vec<Picked>> {
        let be = &self.backend;
        let want = batch.iter().filter(|e| e.logits).count();
        if picks.len() != want {
            bail!("{} picks for {want} logits rows", picks.len());
        }
        let Some(mut logits) = self.forward_logits(kv, batch, self.cfg.n_layer)? else {
            return Ok(Vec::new());
        };
        let host: Vec<usize> = (0..want)
            .filter(|&i| matches!(picks[i], Pick::Host))
            .collect();
        let mut device: Vec<DevicePick<'_>> = picks
            .iter_mut()
            .enumerate()
            .filter_map(|(row, p)| match p {
                Pick::Device(sampler, window) => Some(DevicePick {
                    row,
                    sampler,
                    window,
                }),
                Pick::Host => None,
            })
            .collect();
        let ids = match device.is_empty() {
            true => Vec::new(),
            false => be.sample_on_device(&mut logits, &mut device)?,
        };
        let flat = match host.len() {
            0 => Vec::new(),
            h if h == want => be.take_host(logits),
            _ => be.take_host(be.gather_rows(&logits, &host)),
        };
        let rows: Vec<Vec<f32>> = match host.len() {
            1 => vec![flat], // decode: no copy of the one row
            _ => flat
                .chunks_exact(self.cfg.vocab_size)
                .map(|r| r.to_vec())
                .collect(),
        };
        let mut rows = rows.into_iter();
        let mut ids = ids.into_iter();
        let mut out = Vec::with_capacity(want);
        for p in picks.iter() {
            out.push(match p {
                Pick::Host => Picked::Logits(rows.next().expect("a row per host pick")),
                Pick::Device(..) => Picked::Token(ids.next().expect("an id per device pick")),
            });
        }
        Ok(out)
    }

    /// The forward pass up to the logits of the entries that want them (a rows × vocabulary
    /// activation on the backend, in batch order), or None when none does.
    fn forward_logits(
        &self,
        kv: &mut B::Kv,
        batch: &[BatchEntry<'_>],
        layers: usize,
    ) -> Result<Option<B::Act>> {
        let (cfg, w, be) = (&self.cfg, &self.weights, &self.backend);
        let layers = layers.clamp(1, cfg.n_layer);
        let n = batch.len();
        if n == 0 {
            return Ok(None);
        }
        let bs = self.block_size;
        let mut slots = Vec::with_capacity(n);
        for e in batch {
            let b = e.pos as usize / bs;
            let Some(&block) = e.block_table.get(b) else {
                bail!(
                    "position {} has no KV block (table holds {})",
                    e.pos,
                    e.block_table.len()
                );
            };
            if e.token as usize >= cfg.vocab_size {
                bail!(
                    "token id {} is outside the vocabulary (size {})",
                    e.token,
                    cfg.vocab_size
                );
            }
            slots.push(block as usize * bs + e.pos as usize % bs);
        }
        let tokens: Vec<u32> = batch.iter().map(|e| e.token).collect();
        let positions: Vec<u32> = batch.iter().map(|e| e.pos).collect();

        let (d, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
        let mut x = be.act(n, d); // (n, n_embd) residual stream
        be.embed(&w.token_embd, &tokens, cfg.embd_scale, &mut x);
        let mut h = be.act(n, d); // (n, n_embd) normed input of an attention block
        let mut hf = be.act(n, d); // (n, n_embd) normed input of a feed-forward block
        let mut q = be.act(n, qd); // (n, n_head * head_dim)
        let mut k = be.act(n, kvd); // (n, n_head_kv * head_dim)
        let mut v = be.act(n, kvd);
        let mut attn = be.act(n, qd);
        let mut o = be.act(n, d);
        let want: Vec<usize> = (0..n).filter(|&i| batch[i].logits).collect();
        let mut gate = be.act(n, ff); // (n, n_ff)
        let mut up = be.act(n, ff);

        let mut by_window: Vec<(Option<u32>, Vec<AttnQuery<'_>>)> = Vec::new();
        be.rms_norm(&x, &w.layers[0].attn_norm, cfg.norm_eps, &mut h);
        for (il, (lw, lc)) in w.layers.iter().zip(&cfg.layers).take(layers).enumerate() {
            // attention block: h holds its normed input (each sublayer's output joins the residual
            // stream in one step with the next norm, which the sublayer is handed as its `Join`)
            // The queries of each distinct window, built once a forward (not once a layer).
            let wi = match by_window.iter().position(|(w, _)| *w == lc.window) {
                Some(i) => i,
                None => {
                    let qs = batch
                        .iter()
                        .map(|e| AttnQuery {
                            seq: e.seq,
                            block_table: e.block_table,
                            pos: e.pos,
                            lo: match lc.window {
                                Some(win) => (e.pos + 1).saturating_sub(win),
                                None => 0,
                            },
                        })
                        .collect();
                    by_window.push((lc.window, qs));
                    by_window.len() - 1
                }
            };
            let queries: &[AttnQuery<'_>] = &by_window[wi].1;
            let shape = AttnShape {
                n_head: cfg.n_head,
                n_head_kv: cfg.n_head_kv,
                head_dim: cfg.head_dim,
                scale: if cfg.scale_q_first {
                    1.0
                } else {
                    cfg.attn_scale
                },
            };
            // The last layer keeps only the rows that want logits from here on; then the join
            // runs after the rows are gathered.
            let gathers = il + 1 == layers && want.len() < n;
            let pn = lw.post_attn_norm.as_ref();
            match (&lw.attn, &cfg.mla) {
                (Attn::Mha(a), None) => {
                    let blk = AttnBlock {
                        wq: &a.wq,
                        wk: &a.wk,
                        wv: &a.wv,
                        bq: a.bq.as_ref(),
                        bk: a.bk.as_ref(),
                        bv: a.bv.as_ref(),
                        q_norm: a.q_norm.as_ref(),
                        k_norm: a.k_norm.as_ref(),
                        norm_eps: cfg.norm_eps,
                        rope: Rope {
                            style: cfg.rope_style,
                            base: lc.rope_base,
                            head_dim: cfg.head_dim,
                        },
                        rope_freqs: w.rope_freqs.as_ref(),
                        q_scale: cfg.scale_q_first.then_some(cfg.attn_scale),
                        wo: &lw.wo,
                    };
                    let at = AttnBatch {
                        positions: &positions,
                        slots: &slots,
                        queries,
                        shape,
                    };
                    let s = AttnScratch {
                        q: &mut q,
                        k: &mut k,
                        v: &mut v,
                        attn: &mut attn,
                    };
                    let join = (!gathers).then_some(Join {
                        x: &mut x,
                        y_norm: pn,
                        w: &lw.ffn_norm,
                        eps: cfg.norm_eps,
                        h: &mut hf,
                    });
                    be.attention_block(&h, &blk, kv, il, &at, s, &mut o, join);
                }
                (Attn::Mla(a), Some(m)) => {
                    (q, k, v) = mla::qkv(be, cfg, m, a, &h, &positions, lc.rope_base);
                    if cfg.scale_q_first {
                        be.scale(&mut q, cfg.attn_scale);
                    }
                    be.kv_write(kv, il, &k, &v, &slots);
                    be.attention(&q, kv, il, queries, shape, &mut attn);
                    be.matmul(&lw.wo, &mla::values(be, cfg, m, &attn), None, &mut o);
                    if !gathers {
                        be.add_rms_norm(&mut x, &mut o, pn, &lw.ffn_norm, cfg.norm_eps, &mut hf);
                    }
                }
                (Attn::Mha(_), Some(_)) => bail!("plain attention weights with MLA dimensions"),
                (Attn::Mla(_), None) => bail!("MLA weights without MLA dimensions"),
            }
            if gathers {
                // Only the rows that want logits go on (llama.cpp's `inp_out_ids`).
                if want.is_empty() {
                    return Ok(None);
                }
                o = be.gather_rows(&o, &want);
                x = be.gather_rows(&x, &want);
                h = be.act(want.len(), d);
                hf = be.act(want.len(), d);
                gate = be.act(want.len(), ff);
                up = be.act(want.len(), ff);
                be.add_rms_norm(&mut x, &mut o, pn, &lw.ffn_norm, cfg.norm_eps, &mut hf);
            }

            // feed-forward block: hf holds its normed input; its output joins the residual stream
            // with the next layer's norm, or after the last layer with the final norm
            let next_norm = match w.layers.get(il + 1).filter(|_| il + 1 < layers) {
                Some(next) => &next.attn_norm,
                None => &w.output_norm,
            };
            let join = Join {
                x: &mut x,
                y_norm: lw.post_ffn_norm.as_ref(),
                w: next_norm,
                eps: cfg.norm_eps,
                h: &mut h,
            };
            match &lw.ffn {
                Ffn::Dense(m) => {
                    let ws = (&m.gate, &m.up, &m.down);
                    let (act, join) = (cfg.activation, Some(join));
                    be.ffn_dense(&hf, ws, act, &mut gate, &mut up, &mut o, join);
                }
                Ffn::Moe {
                    router,
                    select_bias,
                    experts,
                    shared,
                } => {
                    let bias = select_bias.as_deref();
                    o = moe::ffn(be, cfg, router, bias, experts, shared.as_ref(), &hf)?;
                    join.run(be, &mut o);
                }
            }
        }

        // output head: h holds the final norm of the rows that want logits
        if want.is_empty() {
            return Ok(None);
        }
        let mut logits = be.act_for_overwrite(want.len(), cfg.vocab_size); // the head writes all
        be.matmul(
            w.output.as_ref().unwrap_or(&w.token_embd),
            &h,
            None,
            &mut logits,
        );
        Ok(Some(logits))
    }
}
