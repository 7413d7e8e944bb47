//! Context shift (StreamingLLM): when a sequence's oldest positions after its first few are
//! dropped, the positions after them move `delta` places earlier, and every layer's keys there
//! are rotated back by `delta` (RoPE by `-delta`, each layer with its own base), so they are what
//! the model would have cached at their new positions, up to the cache's rounding. Values carry
//! no position and stay as they are. Latent attention (DeepSeek's MLA) caches keys partly
//! unrotated and is refused.

use anyhow::{bail, Result};

use crate::model::backend::{Backend, Rope};
use crate::model::Model;

impl<B: Backend> Model<B> {
    /// Rotates the keys of the cache `slots`, every layer, back by `delta` positions.
    pub fn shift_kv(&self, kv: &mut B::Kv, slots: &[usize], delta: u32) -> Result<()> {
        let cfg = &self.cfg;
        if cfg.mla.is_some() {
            bail!("shifting the context is not supported for latent attention (MLA) models");
        }
        for (il, lc) in cfg.layers.iter().enumerate() {
            let rope = Rope {
                style: cfg.rope_style,
                base: lc.rope_base,
                head_dim: cfg.head_dim,
            };
            let ff = self.weights.rope_freqs.as_ref();
            self.backend.kv_shift(kv, il, slots, delta, rope, ff)?;
        }
        Ok(())
    }
}
