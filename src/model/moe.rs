//! Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE, DeepSeek): the router scores every expert
//! for each token, the `n_used` best are kept with their softmax (or, for DeepSeek-V3, sigmoid)
//! weights, renormalized to sum to 1 when the model says so and times a scale, and each expert runs
//! only on the tokens routed to it; its outputs are added to those tokens' rows times their
//! weights. Shared experts run on every token. Routing is decided on the host (it chooses which
//! rows each expert sees); the expert matmuls go through the backend.

use anyhow::{bail, Result};

use crate::model::backend::Backend;
use crate::model::config::{Gating, ModelConfig, MoeConfig};
use crate::model::weights::Mlp;

/// The tokens (rows) routed to one expert and their routing weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Route {
    pub rows: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Routes each row of `logits` (`rows × n_expert` router scores, row-major) to its `n_used` best
/// experts: softmax over all experts (or a sigmoid of each), top `n_used` by that plus
/// `select_bias` if given (ties to the lower index), their unbiased probabilities renormalized
/// when `norm_weights`, times `weights_scale`. Returns one [`Route`] per expert.
pub fn route(logits: &[f32], moe: &MoeConfig, select_bias: Option<&[f32]>) -> Vec<Route> {
    let ne = moe.n_expert;
    let mut routes = vec![Route::default(); ne];
    let mut probs = vec![0f32; ne];
    let mut choice = vec![0f32; ne];
    let mut order: Vec<usize> = Vec::with_capacity(ne);
    for (t, row) in logits.chunks_exact(ne).enumerate() {
        match moe.gating {
            Gating::Softmax => {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for (p, &x) in probs.iter_mut().zip(row) {
                    *p = (x - max).exp();
                    sum += *p;
                }
                probs.iter_mut().for_each(|p| *p /= sum);
            }
            Gating::Sigmoid => {
                for (p, &x) in probs.iter_mut().zip(row) {
                    *p = 1.0 / (1.0 + (-x).exp());
                }
            }
        }
        choice.copy_from_slice(&probs);
        if let Some(b) = select_bias {
            choice.iter_mut().zip(b).for_each(|(c, b)| *c += b);
        }
        order.clear();
        order.extend(0..ne);
        // Stable: equal scores keep the lower expert first.
        order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]));
        let chosen = &order[..moe.n_used];
        let total: f32 = chosen.iter().map(|&e| probs[e]).sum();
        for &e in chosen {
            let w = if moe.norm_weights {
                probs[e] / total
            } else {
                probs[e]
            };
            let w = w * moe.weights_scale;
            routes[e].rows.push(t);
            routes[e].weights.push(w);
        }
    }
    routes
}

/// The mixture-of-experts feed-forward of the normed input `h` (rows × n_embd): a new activation of
/// the same shape.
pub fn ffn<B: Backend>(
    be: &B,
    cfg: &ModelConfig,
    router: &B::Weight,
    select_bias: Option<&[f32]>,
    experts: &[Mlp<B>],
    shared: Option<&Mlp<B>>,
    h: &B::Act,
) -> Result<B::Act> {
    let Some(moe) = cfg.moe else {
        bail!("a layer has experts but the model metadata has no expert_count");
    };
    let n = be.rows(h);
    let mut scores = be.act(n, moe.n_expert);
    be.matmul(router, h, None, &mut scores);
    let routes = route(&be.to_host(&scores), &moe, select_bias);
    let mut out = be.act(n, cfg.n_embd);
    for (mlp, r) in experts.iter().zip(&routes) {
        if r.rows.is_empty() {
            continue;
        }
        let y = run_mlp(be, cfg, mlp, &be.gather_rows(h, &r.rows), moe.n_ff);
        be.add_rows_scaled(&mut out, &y, &r.rows, &r.weights);
    }
    if let Some(s) = shared {
        be.add(&mut out, &run_mlp(be, cfg, s, h, moe.n_ff * moe.n_shared));
    }
    Ok(out)
}

/// down(act(gate · x) * (up · x)) for an MLP `ff` wide.
fn run_mlp<B: Backend>(be: &B, cfg: &ModelConfig, mlp: &Mlp<B>, x: &B::Act, ff: usize) -> B::Act {
    let m = be.rows(x);
    let mut gate = be.act(m, ff);
    let mut up = be.act(m, ff);
    be.matmul(&mlp.gate, x, None, &mut gate);
    be.matmul(&mlp.up, x, None, &mut up);
    be.glu(&mut gate, &up, cfg.activation);
    let mut y = be.act(m, cfg.n_embd);
    be.matmul(&mlp.down, &gate, None, &mut y);
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_top_k_with_normalized_softmax_weights() {
        let moe = MoeConfig {
            n_expert: 4,
            n_used: 2,
            n_ff: 8,
            norm_weights: true,
            gating: Gating::Softmax,
            weights_scale: 1.0,
            n_shared: 0,
        };
        // Row 0 prefers experts 2 then 0; row 1 prefers 3 then 2.
        let logits = [1.0, 0.0, 2.0, -1.0, 0.0, -3.0, 1.0, 2.0];
        let r = route(&logits, &moe, None);
        assert_eq!(r[0].rows, vec![0]);
        assert_eq!(r[1].rows, Vec::<usize>::new());
        assert_eq!(r[2].rows, vec![0, 1]);
        assert_eq!(r[3].rows, vec![1]);
        // Renormalized over the two chosen: softmax of (2, 1) = (e/(e+1), 1/(e+1)).
        let e = std::f32::consts::E;
        assert!((r[2].weights[0] - e / (e + 1.0)).abs() < 1e-6);
        assert!((r[0].weights[0] - 1.0 / (e + 1.0)).abs() < 1e-6);
        let unnorm = route(
            &logits,
            &MoeConfig {
                norm_weights: false,
                ..moe
            },
            None,
        );
        let total: f32 = [1.0f32, 0.0, 2.0, -1.0].iter().map(|x| x.exp()).sum();
        assert!((unnorm[2].weights[0] - 2f32.exp() / total).abs() < 1e-6);
    }

    #[test]
    fn sigmoid_gating_chooses_with_the_bias_but_weighs_without_it() {
        let moe = MoeConfig {
            n_expert: 3,
            n_used: 1,
            n_ff: 8,
            norm_weights: false,
            gating: Gating::Sigmoid,
            weights_scale: 2.0,
            n_shared: 0,
        };
        let r = route(&[1.0, 0.0, -1.0], &moe, Some(&[0.0, 0.0, 5.0]));
        assert_eq!(r[2].rows, vec![0]);
        let sig = 1.0 / (1.0 + 1f32.exp());
        assert!((r[2].weights[0] - 2.0 * sig).abs() < 1e-6);
    }
}
