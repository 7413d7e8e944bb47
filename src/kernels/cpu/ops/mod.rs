//! Element-wise and row-wise CPU operations (RMS norm, RoPE, gated activations), written to follow
//! llama.cpp's CPU arithmetic step for step (f64 sum of squares in RMS norm, iterative RoPE angles
//! with the multiply-adds GCC fuses, GELU through an f16 table, SiLU through ggml's vectorised
//! `ggml_v_expf`) so that greedy output matches llama.cpp token for token.
//!
//! Some of ggml-cpu's float arithmetic depends on the vector width it was compiled for (`-march=
//! native`): [`GgmlIsa`] names the two x86 builds this crate mimics, AVX2 and AVX-512. It selects
//! the `expf` approximation here and the summation orders of the attention kernels (the quantized
//! matmuls are the same in both builds). The reference this project matches is llama.cpp built on
//! a 2-core AVX-512 (VNNI/BF16) machine, so [`ggml_isa`] mimics the AVX-512 build by default,
//! whatever CPU runs the engine; `INFER_LLAMACPP_ISA=avx2` mimics a build for an AVX2-only CPU,
//! `INFER_LLAMACPP_ISA=native` the build `GGML_NATIVE` would make on this CPU ([`set_ggml_isa`]
//! sets it from code).

use std::sync::atomic::{AtomicU8, Ordering};

use half::f16;

use crate::model::config::{Activation, RopeStyle};

pub mod norm;
pub mod rope;

/// The x86 build of ggml-cpu whose float arithmetic the CPU kernels reproduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlIsa {
    /// Built with AVX2 + FMA + F16C (8-lane vectors).
    Avx2,
    /// Built with AVX-512 F/DQ (16-lane vectors; no AVX512-FP16).
    Avx512,
}

static ISA: AtomicU8 = AtomicU8::new(0);

/// The ggml build mimicked: [`set_ggml_isa`] if called, else `INFER_LLAMACPP_ISA` (`avx2`,
/// `avx512`, or `native`: what `GGML_NATIVE` would compile for on this CPU, AVX-512 when AVX512F
/// and AVX512DQ are available), else AVX-512 (the reference build).
pub fn ggml_isa() -> GgmlIsa {
    match ISA.load(Ordering::Relaxed) {
        1 => return GgmlIsa::Avx2,
        2 => return GgmlIsa::Avx512,
        _ => {}
    }
    let isa = match std::env::var("INFER_LLAMACPP_ISA").ok().as_deref() {
        Some("avx2") => GgmlIsa::Avx2,
        Some("native") => detect_isa(),
        _ => GgmlIsa::Avx512,
    };
    // A racing first call computes the same value.
    let _ = ISA.compare_exchange(0, isa_code(isa), Ordering::Relaxed, Ordering::Relaxed);
    isa
}

/// Makes every later kernel call mimic `isa` (for tests comparing against a given llama.cpp build).
pub fn set_ggml_isa(isa: GgmlIsa) {
    ISA.store(isa_code(isa), Ordering::Relaxed);
}

fn isa_code(isa: GgmlIsa) -> u8 {
    match isa {
        GgmlIsa::Avx2 => 1,
        GgmlIsa::Avx512 => 2,
    }
}

fn detect_isa() -> GgmlIsa {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
            return GgmlIsa::Avx512;
        }
    }
    GgmlIsa::Avx2
}

/// One lane of ggml's `ggml_v_expf` (`vec.h`, adapted from ARM's optimized routines: maximum error
/// 1.5 ulp, 0 below about -104, +inf above about 88.4) for the chosen build. The AVX2 and AVX-512
/// versions round differently (`k + k·j` vs `scalef(1 + …, n)`).
#[inline(always)]
pub fn v_expf(x: f32, isa: GgmlIsa) -> f32 {
    const R: f32 = 12_582_912.0; // 0x1.8p23
    let c = |bits: u32| f32::from_bits(bits);
    let z = x.mul_add(c(0x3fb8_aa3b), R);
    let n = z - R;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    let u = b * b;
    let poly = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)));
    match isa {
        GgmlIsa::Avx2 => {
            let e = z.to_bits() << 23;
            let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits()));
            let j = poly.mul_add(u, c(0x3f7f_fff6) * b);
            if n.abs() <= 126.0 {
                return j.mul_add(k, k);
            }
            let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
            let s1 = f32::from_bits(g.wrapping_add(0x7f00_0000));
            let s2 = f32::from_bits(e.wrapping_sub(g));
            if n.abs() > 192.0 {
                s1 * s1
            } else {
                s2.mul_add(j, s2) * s1
            }
        }
        GgmlIsa::Avx512 => {
            if n.abs() > 192.0 {
                return if n <= 0.0 { 0.0 } else { f32::INFINITY };
            }
            let j = poly.mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
            // _mm512_scalef_ps: j·2^n rounded once (n is an integer in -192..=192 here, so 2^n is
            // an exact f64 built from its exponent bits).
            let pow2 = f64::from_bits(((n as i64 + 1023) as u64) << 52);
            (j as f64 * pow2) as f32
        }
    }
}

/// [`v_expf`] of eight values in place, bit for bit: the vector form of ggml's kernel when every
/// lane is in the common range (`|n| <= 126`, where 2^n is a normal f32 and both builds' results
/// are `k·j` products the scalar form rounds the same way), else lane by lane through [`v_expf`].
#[inline(always)]
pub fn v_expf8(x: &mut [f32; 8], isa: GgmlIsa) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar {
        // SAFETY: a non-scalar level means AVX2, FMA and F16C were detected.
        if unsafe { expf_x86::v_expf8(x, isa) } {
            return;
        }
    }
    for v in x.iter_mut() {
        *v = v_expf(*v, isa);
    }
}

#[cfg(target_arch = "x86_64")]
mod expf_x86 {
    use super::GgmlIsa;
    use std::arch::x86_64::*;

    /// The common-range path of [`super::v_expf8`]; returns false (leaving `x` untouched) when a
    /// lane needs the scalar form.
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn v_expf8(x: &mut [f32; 8], isa: GgmlIsa) -> bool {
        let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
        let xv = _mm256_loadu_ps(x.as_ptr());
        let r = _mm256_set1_ps(12_582_912.0);
        let z = _mm256_fmadd_ps(xv, c(0x3fb8_aa3b), r);
        let n = _mm256_sub_ps(z, r);
        let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), xv));
        let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
        // NaN lanes also leave the fast path (the comparison is ordered).
        let ok = _mm256_cmp_ps::<_CMP_LE_OQ>(abs_n, _mm256_set1_ps(126.0));
        if _mm256_movemask_ps(ok) != 0xFF {
            return false;
        }
        let k = _mm256_castsi256_ps(_mm256_add_epi32(
            _mm256_slli_epi32::<23>(_mm256_castps_si256(z)),
            _mm256_castps_si256(_mm256_set1_ps(1.0)),
        ));
        let u = _mm256_mul_ps(b, b);
        let poly = _mm256_fmadd_ps(
            _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
            u,
            _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
        );
        let out = match isa {
            GgmlIsa::Avx2 => {
                let j = _mm256_fmadd_ps(poly, u, _mm256_mul_ps(c(0x3f7f_fff6), b));
                _mm256_fmadd_ps(j, k, k)
            }
            GgmlIsa::Avx512 => {
                // scalef(j, n) = j·2^n rounded once; k = 2^n exactly here, so one multiply.
                let j =
                    _mm256_fmadd_ps(poly, u, _mm256_fmadd_ps(c(0x3f7f_fff6), b, c(0x3f80_0000)));
                _mm256_mul_ps(j, k)
            }
        };
        _mm256_storeu_ps(x.as_mut_ptr(), out);
        true
    }

    /// `g = (g / (1 + v_expf(0 - g))) * u` over whole 16-value vectors (`g.len()` a multiple of 16,
    /// `u` as long), ggml's AVX-512 `ggml_vec_swiglu_f32` lane for lane: the same operations as
    /// [`v_expf8`] (`GgmlIsa::Avx512`) and the scalar division and product, on 16 lanes; a vector
    /// with a lane outside the common range goes through [`super::v_expf`] lane by lane.
    ///
    /// # Safety
    /// AVX-512F, AVX2 and FMA are available.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn silu_glu16(g: &mut [f32], u: &[f32]) {
        debug_assert!(g.len().is_multiple_of(16) && u.len() == g.len());
        let c = |bits: u32| _mm512_set1_ps(f32::from_bits(bits));
        let one = _mm512_set1_ps(1.0);
        for (gc, uc) in g.chunks_exact_mut(16).zip(u.chunks_exact(16)) {
            // SAFETY: both chunks hold 16 f32 (unaligned loads and stores).
            let (gv, uv) = unsafe { (_mm512_loadu_ps(gc.as_ptr()), _mm512_loadu_ps(uc.as_ptr())) };
            let x = _mm512_sub_ps(_mm512_setzero_ps(), gv);
            let r = _mm512_set1_ps(12_582_912.0);
            let z = _mm512_fmadd_ps(x, c(0x3fb8_aa3b), r);
            let n = _mm512_sub_ps(z, r);
            let b = _mm512_fnmadd_ps(n, c(0x35bf_be8e), _mm512_fnmadd_ps(n, c(0x3f31_7200), x));
            let abs_n = _mm512_abs_ps(n);
            // NaN lanes also leave the fast path (the comparison is ordered).
            let ok = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(abs_n, _mm512_set1_ps(126.0));
            if ok != 0xFFFF {
                for (gi, &ui) in gc.iter_mut().zip(uc) {
                    *gi = (*gi / (1.0 + super::v_expf(0.0 - *gi, GgmlIsa::Avx512))) * ui;
                }
                continue;
            }
            let k = _mm512_castsi512_ps(_mm512_add_epi32(
                _mm512_slli_epi32::<23>(_mm512_castps_si512(z)),
                _mm512_castps_si512(one),
            ));
            let uu = _mm512_mul_ps(b, b);
            let poly = _mm512_fmadd_ps(
                _mm512_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                uu,
                _mm512_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
            );
            let j = _mm512_fmadd_ps(poly, uu, _mm512_fmadd_ps(c(0x3f7f_fff6), b, one));
            let e = _mm512_mul_ps(j, k);
            let out = _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv);
            // SAFETY: `gc` holds 16 f32.
            unsafe { _mm512_storeu_ps(gc.as_mut_ptr(), out) };
        }
    }
}

/// ggml's vectorised SiLU: `x / (1 + v_expf(0 - x))`.
#[inline(always)]
pub fn silu(x: f32, isa: GgmlIsa) -> f32 {
    x / (1.0 + v_expf(0.0 - x, isa))
}

/// [`rms_norm`] of `x` into `x` itself (each value depends only on itself and the mean square,
/// which is taken before any is written).
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let scale = rms_scale(x, w, eps);
    crate::kernels::cpu::ops::norm::scale_in_place(x, scale, w);
}

/// y = x / rms(x) * w, over one group of `w.len()` values.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let scale = rms_scale(x, w, eps);
    crate::kernels::cpu::ops::norm::scale_into(x, scale, w, y);
}

/// `1 / sqrt(mean square of x + eps)`, with the weights `w` the product will read requested
/// meanwhile.
fn rms_scale(x: &[f32], w: &[f32], eps: f32) -> f32 {
    debug_assert_eq!(x.len(), w.len());
    // All the weight lines requested at once. In decode they come cold from memory (a region has
    // just streamed megabytes of weights through the caches), and the product loop waited on them
    // line after line: Gemma-3 270M's decode step (about six norms a layer) 0.55-0.62% shorter in
    // the low-bandwidth state and 0.27-1.9% in the high (two runs of 1000 pairs); Qwen2.5-1.5B's
    // unchanged (0.9993).
    crate::kernels::cpu::prefetch_l1(w);
    1.0 / (crate::kernels::cpu::ops::norm::mean_square(x) + eps).sqrt()
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

/// [`rope_cache`] with each pair's angle divided by its frequency factor, as ggml applies
/// `rope_freqs` (`theta / ff` per pair, before cos/sin).
pub fn rope_cache_scaled(pos: u32, base: f32, head_dim: usize, factors: &[f32], cache: &mut [f32]) {
    let theta_scale = base.powf(-2.0 / head_dim as f32);
    let mut theta = pos as f32;
    for (i, &ff) in (0..head_dim).step_by(2).zip(factors) {
        cache[i] = (theta / ff).cos();
        cache[i + 1] = (theta / ff).sin();
        theta *= theta_scale;
    }
}

/// Rotate one head in place with a cache from `rope_cache`. The products are fused as GCC compiles
/// ggml's `rotate_pairs` (`-ffp-contract=fast` with FMA): `x0·cos - x1·sin` is
/// `fma(x0, cos, -(x1·sin))` and `x0·sin + x1·cos` is `fma(x0, sin, x1·cos)` (checked against
/// llama.cpp's tensors for NEOX; the NORMAL style is assumed to fuse the same way).
pub fn rope_head(x: &mut [f32], cache: &[f32], style: RopeStyle) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked just above).
        return unsafe { rope_head_fma(x, cache, style) };
    }
    rope_head_impl(x, cache, style)
}

/// [`rope_head_impl`] compiled with FMA, so `mul_add` is one instruction, not a libm call (a
/// closure handed to a `target_feature` function is compiled without the feature).
///
/// # Safety
/// The CPU supports FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn rope_head_fma(x: &mut [f32], cache: &[f32], style: RopeStyle) {
    rope_head_impl(x, cache, style)
}

#[inline(always)]
fn rope_head_impl(x: &mut [f32], cache: &[f32], style: RopeStyle) {
    let d = x.len();
    match style {
        RopeStyle::Normal => {
            for i in (0..d).step_by(2) {
                let (c, s) = (cache[i], cache[i + 1]);
                let (x0, x1) = (x[i], x[i + 1]);
                x[i] = x0.mul_add(c, -(x1 * s));
                x[i + 1] = x0.mul_add(s, x1 * c);
            }
        }
        RopeStyle::Neox => {
            let half = d / 2;
            for i in (0..d).step_by(2) {
                let (c, s) = (cache[i], cache[i + 1]);
                let j = i / 2;
                let (x0, x1) = (x[j], x[j + half]);
                x[j] = x0.mul_add(c, -(x1 * s));
                x[j + half] = x0.mul_add(s, x1 * c);
            }
        }
    }
}

/// ggml's `ggml_gelu_f32` as GCC compiles it into the table initialisation of `ggml_cpu_init`
/// (the inner `1 + a·x·x` contracted to `fma(a·x, x, 1)`).
fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    let inner = (COEF_A * x).mul_add(x, 1.0);
    (0.5 * x) * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh())
}

/// PyTorch's `gelu(x, approximate="tanh")` in f32: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
fn gelu_tanh_f32(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    0.5 * x * (1.0 + inner.tanh())
}

/// GELU as ggml's CPU backend computes it: the input rounded to f16, looked up in a table of
/// f16-rounded results; identity above 10 and zero below -10.
fn gelu_table() -> &'static [f16] {
    &gelu_table_padded()[..1 << 16]
}

/// [`gelu_table`] and one zero entry past its end, so a 32-bit gather at any index stays inside.
fn gelu_table_padded() -> &'static [f16] {
    use std::sync::OnceLock;
    static TABLE: OnceLock<Vec<f16>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|bits| f16::from_f32(gelu_tanh(f16::from_bits(bits).to_f32())))
            .chain([f16::ZERO])
            .collect()
    })
}

/// GeGLU through [`gelu_table`] one value at a time: `gate = gelu(gate) * up`.
fn gelu_glu_scalar(gate: &mut [f32], up: &[f32]) {
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

/// [`gelu_glu_scalar`] eight values at a time: the inputs rounded to f16 by F16C (round to
/// nearest even, as `f16::from_f32`), the table entries gathered, widened (exact), multiplied by
/// `up`; the ±10 cases blended in as the scalar branches take them. The same results, NaN
/// payloads aside.
///
/// # Safety
/// AVX2 and F16C are available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn gelu_glu_f16c(gate: &mut [f32], up: &[f32]) {
    use std::arch::x86_64::*;
    let n = gate.len().min(up.len());
    let n8 = n - n % 8;
    let table = gelu_table_padded();
    let base = table.as_ptr().cast::<i32>();
    let (lo, hi) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
    // Each gathered dword's low half (bytes 0-1 of every dword) to the low 8 bytes of each
    // 128-bit lane, then the two lanes' halves together.
    let pick = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, 0, 1, 4, 5, 8, 9, 12, 13, -1, -1,
        -1, -1, -1, -1, -1, -1,
    );
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= n8 <= both lengths.
        let (x, u) = unsafe {
            (
                _mm256_loadu_ps(gate.as_ptr().add(i)),
                _mm256_loadu_ps(up.as_ptr().add(i)),
            )
        };
        let idx = _mm256_cvtepu16_epi32(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
        // SAFETY: every index is below 2^16 and the table has 2^16 + 1 two-byte entries, so the
        // four bytes read at `base + 2 * idx` lie inside it.
        let t = unsafe { _mm256_i32gather_epi32::<2>(base, idx) };
        let t = _mm256_permute4x64_epi64::<0b1000>(_mm256_shuffle_epi8(t, pick));
        let g = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(t)), u);
        let g = _mm256_blendv_ps(g, _mm256_mul_ps(x, u), _mm256_cmp_ps::<_CMP_GE_OQ>(x, hi));
        let g = _mm256_andnot_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(x, lo), g);
        // SAFETY: as for the loads.
        unsafe { _mm256_storeu_ps(gate.as_mut_ptr().add(i), g) };
    }
    gelu_glu_scalar(&mut gate[n8..n], &up[n8..n]);
}

/// gate = act(gate) * up, element-wise.
pub fn glu(gate: &mut [f32], up: &[f32], act: Activation) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked just above).
        return unsafe { glu_fma(gate, up, act) };
    }
    glu_impl(gate, up, act)
}

/// [`glu_impl`] compiled with FMA (same results: `mul_add` is exactly rounded either way).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn glu_fma(gate: &mut [f32], up: &[f32], act: Activation) {
    glu_impl(gate, up, act)
}

#[inline(always)]
fn glu_impl(gate: &mut [f32], up: &[f32], act: Activation) {
    match act {
        Activation::Silu => {
            // `ggml_vec_swiglu_f32`: whole vectors through `ggml_v_silu`, a tail (n not a multiple
            // of the vector width) through the scalar `ggml_silu_f32` with libm's expf.
            let isa = ggml_isa();
            let lanes = match isa {
                GgmlIsa::Avx2 => 8,
                GgmlIsa::Avx512 => 16,
            };
            let n = gate.len();
            let (gv, gt) = gate.split_at_mut(n - n % lanes);
            let (uv, ut) = up.split_at(n - n % lanes);
            if !silu_glu_wide(gv, uv, isa) {
                for (g, u) in gv.chunks_exact_mut(8).zip(uv.chunks_exact(8)) {
                    // silu: x / (1 + v_expf(0 - x)), eight lanes at a time (the same per lane)
                    let mut e: [f32; 8] = std::array::from_fn(|i| 0.0 - g[i]);
                    v_expf8(&mut e, isa);
                    for i in 0..8 {
                        g[i] = (g[i] / (1.0 + e[i])) * u[i];
                    }
                }
            }
            for (g, &u) in gt.iter_mut().zip(ut) {
                *g = (*g / (1.0 + (-*g).exp())) * u;
            }
        }
        Activation::GeluTanhF32 => {
            for (g, &u) in gate.iter_mut().zip(up) {
                *g = gelu_tanh_f32(*g) * u;
            }
        }
        Activation::GeluTanh => {
            #[cfg(target_arch = "x86_64")]
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
                // SAFETY: AVX2 and F16C were detected just above.
                return unsafe { gelu_glu_f16c(gate, up) };
            }
            gelu_glu_scalar(gate, up)
        }
    }
}

/// The SiLU GLU over whole 16-value vectors in one AVX-512 function, where ggml's AVX-512 build
/// is reproduced and the CPU has it; false (nothing done) otherwise. 4480 values (one thread's
/// share of Qwen2.5-1.5B's feed-forward) took 0.60 µs instead of 2.8 through `v_expf8`, a call per
/// eight lanes; that decode step 0.44% shorter in the high-bandwidth state (315 pairs), 0.07% in
/// the low (285).
fn silu_glu_wide(gv: &mut [f32], uv: &[f32], isa: GgmlIsa) -> bool {
    #[cfg(target_arch = "x86_64")]
    if isa == GgmlIsa::Avx512
        && crate::kernels::cpu::simd::current() >= crate::kernels::cpu::simd::Level::Avx512
    {
        // SAFETY: the AVX-512 level is selected only where AVX-512F, AVX2 and FMA were detected.
        unsafe { expf_x86::silu_glu16(gv, uv) };
        return true;
    }
    let _ = (gv, uv, isa);
    false
}

/// [`crate::model::backend::HeadCopy`] over row-major `src` (`src_cols` wide) and `dst`
/// (`dst_cols` wide) with the same row count.
pub fn copy_heads(
    src: &[f32],
    src_cols: usize,
    dst: &mut [f32],
    dst_cols: usize,
    c: crate::model::backend::HeadCopy,
) {
    let src_heads = src_cols / c.src_hd;
    for (s, d) in src
        .chunks_exact(src_cols)
        .zip(dst.chunks_exact_mut(dst_cols))
    {
        for h in 0..dst_cols / c.dst_hd {
            let from = (h % src_heads) * c.src_hd + c.src_off;
            let to = h * c.dst_hd + c.dst_off;
            d[to..to + c.width].copy_from_slice(&s[from..from + c.width]);
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
    #[cfg_attr(
        not(infer_host_avx2),
        ignore = "needs AVX2, FMA and F16C, which the CPU that built the tests lacks"
    )]
    fn gelu_glu_f16c_equals_the_scalar_loop() {
        assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c"));
        // Every f16 value (every table index, the ±10 edges, infinities), then random values
        // with halfway cases, over lengths with and without a tail.
        let mut x: Vec<f32> = (0..=u16::MAX)
            .map(|b| f16::from_bits(b).to_f32())
            .filter(|v| !v.is_nan())
            .collect();
        x.extend([
            -10.0, 10.0, -10.000001, 9.999999, 65519.0, 65520.0, -65520.0, 0.0, -0.0,
        ]);
        x.extend(
            crate::kernels::cpu::test_floats(20_003, 9)
                .iter()
                .map(|v| v * 7.0),
        );
        let up: Vec<f32> = (0..x.len())
            .map(|i| ((i * 37) % 101) as f32 / 25.0 - 2.0)
            .collect();
        for len in [x.len(), 7, 8, 13] {
            let (mut a, mut b) = (x[..len].to_vec(), x[..len].to_vec());
            gelu_glu_scalar(&mut a, &up[..len]);
            // SAFETY: AVX2 and F16C were detected above.
            unsafe { gelu_glu_f16c(&mut b, &up[..len]) };
            for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                assert_eq!(p.to_bits(), q.to_bits(), "x = {} (index {i})", x[i]);
            }
        }
    }

    #[test]
    fn gelu_table_is_llamacpps() {
        // FNV-1a (64-bit) and sum over the entries of llama.cpp's `ggml_table_gelu_f16`
        // (0c1e57098, x86 build with FMA, read from the library after `ggml_cpu_init`) for the
        // inputs the GELU actually looks up: finite f16 values in (-10, 10).
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let (mut sum, mut n) = (0u64, 0);
        for (i, v) in gelu_table().iter().enumerate() {
            let x = f16::from_bits(i as u16).to_f32();
            if !(x.is_finite() && x > -10.0 && x < 10.0) {
                continue;
            }
            h ^= v.to_bits() as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
            sum += v.to_bits() as u64;
            n += 1;
        }
        assert_eq!((n, sum), (37_376, 893_681_586));
        assert_eq!(h, 0xaa3b_2ea2_9546_12b3);
    }

    #[test]
    fn v_expf8_equals_v_expf_bit_for_bit() {
        let mut xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.0537).collect();
        xs.extend([
            f32::NEG_INFINITY,
            f32::INFINITY,
            f32::NAN,
            -0.0,
            -87.3,
            -87.4,
            -103.9,
            -104.0,
            88.3,
            88.8,
            1e-30,
            -1e-30,
        ]);
        // vectors mixing common-range and special lanes, and all-common ones
        xs.extend((0..64).map(|i| if i % 9 == 0 { -150.0 } else { -(i as f32) }));
        xs.resize(xs.len().div_ceil(8) * 8, 0.5);
        for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512] {
            for c in xs.chunks_exact(8) {
                let mut v: [f32; 8] = c.try_into().unwrap();
                v_expf8(&mut v, isa);
                for (i, (&got, &x)) in v.iter().zip(c).enumerate() {
                    let want = v_expf(x, isa);
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{isa:?} lane {i} x={x:e}: {got:e} vs {want:e}"
                    );
                }
            }
        }
    }

    #[test]
    fn v_expf_is_close_to_exp_and_saturates() {
        for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512] {
            // Normal results: within ggml's stated 1.5 ulp (plus libm's own error).
            for i in -790..=800 {
                let x = i as f32 * 0.11;
                let (got, want) = (v_expf(x, isa), x.exp());
                assert!(
                    (got - want).abs() <= 3e-7 * want,
                    "{isa:?} {x}: {got:e} {want:e}"
                );
            }
            assert_eq!(v_expf(f32::NEG_INFINITY, isa), 0.0);
            assert_eq!(v_expf(-200.0, isa), 0.0);
            assert_eq!(v_expf(200.0, isa), f32::INFINITY);
            assert_eq!(v_expf(0.0, isa), 1.0);
        }
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

    #[test]
    fn silu_glu_is_ggmls_lane_formula_bit_for_bit() {
        // ggml's AVX-512 swiglu lane by lane: `x / (1 + v_expf(0 - x))` times `u` over whole
        // 16-value vectors, libm's expf for the tail; whichever vector path `glu` takes.
        let isa = ggml_isa();
        let lanes = if isa == GgmlIsa::Avx512 { 16 } else { 8 };
        for (n, scale) in [
            (4480usize, 1.0f32),
            (4480, 30.0),
            (1027, 120.0),
            (77, 400.0),
        ] {
            let mut g: Vec<f32> = crate::kernels::cpu::test_floats(n, n as u32)
                .iter()
                .map(|v| v * scale)
                .collect();
            g[n / 3] = f32::INFINITY;
            g[n / 2] = f32::NEG_INFINITY;
            g[n / 5] = -0.0;
            let u = crate::kernels::cpu::test_floats(n, 7);
            let want: Vec<f32> = g
                .iter()
                .zip(&u)
                .enumerate()
                .map(|(i, (&x, &u))| {
                    let e = if i < n - n % lanes {
                        v_expf(0.0 - x, isa)
                    } else {
                        (-x).exp()
                    };
                    (x / (1.0 + e)) * u
                })
                .collect();
            glu(&mut g, &u, Activation::Silu);
            for (i, (a, b)) in g.iter().zip(&want).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "n {n} scale {scale} lane {i}: {a} != {b}"
                );
            }
        }
    }
}
