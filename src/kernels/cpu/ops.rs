//! Element-wise and row-wise CPU operations (RMS norm, RoPE, gated activations), written to follow
//! ggml's CPU arithmetic step for step (f64 sum of squares in RMS norm, iterative RoPE angles, GELU
//! through an f16 table) so that greedy output matches llama.cpp token for token.

use half::f16;

use crate::model::config::{Activation, RopeStyle};

/// y = x / rms(x) * w, over one group of `w.len()` values.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let n = w.len();
    let mut sum = 0f64;
    for &v in x {
        sum += (v * v) as f64;
    }
    let mean = (sum / n as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for ((yi, &xi), &wi) in y.iter_mut().zip(x).zip(w) {
        *yi = (xi * scale) * wi;
    }
}

/// Cos/sin table for one position: `cache[2i] = cos θ_i`, `cache[2i+1] = sin θ_i`, θ_i = pos·base^(-2i/d),
/// computed by repeated multiplication as ggml does.
pub fn rope_cache(pos: u32, base: f32, head_dim: usize, cache: &mut [f32]) {
    let theta_scale = base.powf(-2.0 / head_dim as f32);
    let mut theta = pos as f32;
    for i in (0..head_dim).step_by(2) {
        cache[i] = theta.cos();
        cache[i + 1] = theta.sin();
        theta *= theta_scale;
    }
}

/// Rotate one head in place with a cache from `rope_cache`.
pub fn rope_head(x: &mut [f32], cache: &[f32], style: RopeStyle) {
    let d = x.len();
    match style {
        RopeStyle::Normal => {
            for i in (0..d).step_by(2) {
                let (c, s) = (cache[i], cache[i + 1]);
                let (x0, x1) = (x[i], x[i + 1]);
                x[i] = x0 * c - x1 * s;
                x[i + 1] = x0 * s + x1 * c;
            }
        }
        RopeStyle::Neox => {
            let half = d / 2;
            for i in (0..d).step_by(2) {
                let (c, s) = (cache[i], cache[i + 1]);
                let j = i / 2;
                let (x0, x1) = (x[j], x[j + half]);
                x[j] = x0 * c - x1 * s;
                x[j + half] = x0 * s + x1 * c;
            }
        }
    }
}

fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + COEF_A * x * x)).tanh())
}

/// GELU as ggml's CPU backend computes it: the input rounded to f16, looked up in a table of
/// f16-rounded results; identity above 10 and zero below -10.
fn gelu_table() -> &'static [f16] {
    use std::sync::OnceLock;
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_tanh(f16::from_bits(bits).to_f32())))
            .collect()
    })
}

/// gate = act(gate) * up, element-wise.
pub fn glu(gate: &mut [f32], up: &[f32], act: Activation) {
    match act {
        Activation::Silu => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = (*g / (1.0 + (-*g).exp())) * u;
            }
        }
        Activation::GeluTanh => {
            let table = gelu_table();
            for (g, &u) in gate.iter_mut().zip(up) {
                let x = *g;
                *g = if x <= -10.0 {
                    0.0
                } else if x >= 10.0 {
                    x * u
                } else {
                    table[f16::from_f32(x).to_bits() as usize].to_f32() * u
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_weights_gives_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 5.0];
        let mut y = [0f32; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut y);
        let rms = (y.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6, "{rms}");
        // 3 / sqrt(50/4)
        assert!((y[0] - 3.0 / 12.5f32.sqrt()).abs() < 1e-6);
    }

    #[test]
    fn rope_position_zero_is_identity_and_norm_preserving() {
        let mut cache = [0f32; 8];
        rope_cache(0, 10000.0, 8, &mut cache);
        let orig = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let mut x = orig;
        rope_head(&mut x, &cache, RopeStyle::Neox);
        assert_eq!(x, orig);
        rope_cache(7, 10000.0, 8, &mut cache);
        for style in [RopeStyle::Neox, RopeStyle::Normal] {
            let mut x = orig;
            rope_head(&mut x, &cache, style);
            let n0: f32 = orig.iter().map(|v| v * v).sum();
            let n1: f32 = x.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-3);
            assert_ne!(x, orig);
        }
        // Neox pairs (0, 4): first angle is pos * 1 = 7 rad.
        let mut x = [1.0f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        rope_head(&mut x, &cache, RopeStyle::Neox);
        assert!((x[0] - 7f32.cos()).abs() < 1e-6 && (x[4] - 7f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn glu_matches_formulas() {
        let mut g = [-1.0f32, 0.5, 2.0, 20.0, -20.0];
        let u = [2.0f32; 5];
        glu(&mut g, &u, Activation::Silu);
        for (x, y) in [-1.0f32, 0.5, 2.0, 20.0].iter().zip(g) {
            let want = x / (1.0 + (-x).exp()) * 2.0;
            assert!((y - want).abs() < 1e-5, "{y} {want}");
        }
        let mut g = [-1.0f32, 0.5, 2.0, 20.0, -20.0];
        glu(&mut g, &u, Activation::GeluTanh);
        // exact GELU(0.5) = 0.345714 (tanh approx 0.345714); f16 table rounding allows ~1e-3
        assert!((g[1] - 2.0 * 0.345714).abs() < 2e-3, "{}", g[1]);
        assert!((g[0] - 2.0 * -0.158808).abs() < 2e-3, "{}", g[0]);
        assert_eq!(g[3], 40.0);
        assert_eq!(g[4], 0.0);
    }
}
