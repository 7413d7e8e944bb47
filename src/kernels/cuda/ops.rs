//! Typed launchers for the kernels of `cuda/*.cu`: each function states a kernel's grid, block and
//! argument order in one place (they must match the `extern "C"` signatures), so the backend and
//! the checks never spell raw launches. Pointers are device addresses from [`super::launch`]; a
//! weight is in its device layout ([`super::repack`]: Q6_K rows repacked), 16-byte aligned.

use anyhow::{bail, Result};

use super::launch::{Arg, Launch};
use crate::format::GgmlType;
use crate::model::backend::{CacheType, DeviceSampling, HeadCopy, DEVICE_SAMPLE_MAX_K};
use crate::model::config::{Activation, RopeStyle};

/// Keys per split of the attention kernel (`ATTN_SPLIT` in attention.cu).
pub const ATTN_SPLIT: usize = 128;
/// Most query heads per KV head the attention kernel takes (`ATTN_MAX_G`).
pub const ATTN_MAX_G: usize = 16;
/// Largest head size of the attention kernel (`ATTN_MAX_HD`).
pub const ATTN_MAX_HD: usize = 256;
/// Bytes of one q8_1 activation block (32 values).
pub const Q8_1_BYTES: usize = 36;

fn grid1(n: usize, per_block: usize) -> [u32; 3] {
    [n.div_ceil(per_block).max(1) as u32, 1, 1]
}

fn i32a(v: usize) -> Arg {
    Arg::I32(v as i32)
}

/// A cache type as the kernels name it (`CACHE_*` in common.cuh).
fn cache_arg(t: CacheType) -> Arg {
    Arg::I32(match t {
        CacheType::F16 => 0,
        CacheType::Q8_0 => 1,
        CacheType::Q4_0 => 2,
    })
}

/// A quantized cache's kernels take heads of whole 32-value blocks.
fn check_cache_heads(types: (CacheType, CacheType), head_dim: usize) -> Result<()> {
    let quantized = types.0.is_quantized() || types.1.is_quantized();
    if quantized && !head_dim.is_multiple_of(32) {
        bail!("a quantized KV cache needs heads of whole 32-value blocks, not {head_dim}");
    }
    Ok(())
}

/// The GEMV kernel of a weight type, and whether it takes q8_1 activations (else f32).
pub fn gemv_kernel(ty: GgmlType) -> Option<(&'static str, bool)> {
    Some(match ty {
        GgmlType::Q4_0 => ("gemv_q4_0", true),
        GgmlType::Q5_0 => ("gemv_q5_0", true),
        GgmlType::Q8_0 => ("gemv_q8_0", true),
        GgmlType::Q4K => ("gemv_q4_k", true),
        GgmlType::Q6K => ("gemv_q6_k", true),
        GgmlType::F16 => ("gemv_f16", false),
        GgmlType::F32 => ("gemv_f32", false),
        _ => return None,
    })
}

/// Weight rows per CTA of the tensor-core GEMM (`GEMM_M` in gemm.cu).
pub const GEMM_ROWS: usize = 64;
/// Tokens per CTA of the tensor-core GEMM (`GEMM_N`).
pub const GEMM_TOKENS: usize = 64;
/// Most tokens per GEMV pass (`GEMV_TOKENS` in gemv.cu): beyond this, [`gemm`] reads the weights
/// fewer times.
pub const GEMV_TOKENS: usize = 8;

/// The tensor-core GEMM of a weight type (q8_1 activations, as its GEMV); None for float weights.
pub fn gemm_kernel(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "gemm_q4_0",
        GgmlType::Q5_0 => "gemm_q5_0",
        GgmlType::Q8_0 => "gemm_q8_0",
        GgmlType::Q4K => "gemm_q4_k",
        GgmlType::Q6K => "gemm_q6_k",
        _ => return None,
    })
}

fn get_rows_kernel(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "get_rows_q4_0",
        GgmlType::Q5_0 => "get_rows_q5_0",
        GgmlType::Q8_0 => "get_rows_q8_0",
        GgmlType::Q4K => "get_rows_q4_k",
        GgmlType::Q6K => "get_rows_q6_k",
        GgmlType::F16 => "get_rows_f16",
        GgmlType::F32 => "get_rows_f32",
        _ => return None,
    })
}

/// q8_1 blocks of `n_values` f32 values (a multiple of 32) at `x`, written to `out`.
pub fn quantize_q8_1(l: &dyn Launch, x: u64, out: u64, n_values: usize) -> Result<()> {
    let nb = n_values / 32;
    let args = [Arg::Ptr(x), Arg::Ptr(out), i32a(nb)];
    l.launch("quantize_q8_1", grid1(nb, 4), [128, 1, 1], &args)
}

/// out (ntok × rows) = x · Wᵀ for a `rows × cols` weight of type `ty`; `x` is q8_1 blocks or f32
/// rows as [`gemv_kernel`] says.
pub fn gemv(
    l: &dyn Launch,
    ty: GgmlType,
    w: u64,
    x: u64,
    out: u64,
    bias: Option<u64>,
    (rows, cols, ntok): (usize, usize, usize),
) -> Result<()> {
    let Some((name, _)) = gemv_kernel(ty) else {
        bail!("no CUDA matmul kernel for {}", ty.name());
    };
    if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) && !w.is_multiple_of(16) {
        bail!("{name} reads 16-byte-aligned weights (at {w:#x})");
    }
    let grid = [
        rows.div_ceil(4) as u32,
        ntok.div_ceil(GEMV_TOKENS) as u32,
        1,
    ];
    let args = [
        Arg::Ptr(w),
        Arg::Ptr(x),
        Arg::Ptr(out),
        i32a(rows),
        i32a(cols),
        i32a(ntok),
        Arg::Ptr(bias.unwrap_or(0)),
    ];
    l.launch(name, grid, [128, 1, 1], &args)
}

/// Most matrices one [`gemv_multi`] launch takes.
pub const GEMV_MULTI: usize = 3;

/// The kernel running up to [`GEMV_MULTI`] GEMVs of one quantized type in one launch.
pub fn gemv_multi_kernel(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "gemv_multi_q4_0",
        GgmlType::Q5_0 => "gemv_multi_q5_0",
        GgmlType::Q8_0 => "gemv_multi_q8_0",
        GgmlType::Q4K => "gemv_multi_q4_k",
        GgmlType::Q6K => "gemv_multi_q6_k",
        _ => return None,
    })
}

/// One matrix of a [`gemv_multi`] launch: weight, output, optional bias, rows.
pub type GemvPart = (u64, u64, Option<u64>, usize);

/// [`gemv`] of up to [`GEMV_MULTI`] `rows_j × cols` matrices of type `ty` with the same `ntok`
/// rows of q8_1 activations `xq`, in one launch.
pub fn gemv_multi(
    l: &dyn Launch,
    ty: GgmlType,
    xq: u64,
    parts: &[GemvPart],
    (cols, ntok): (usize, usize),
) -> Result<()> {
    let Some(name) = gemv_multi_kernel(ty) else {
        bail!("no multi-matrix CUDA GEMV for {}", ty.name());
    };
    if parts.is_empty() || parts.len() > GEMV_MULTI {
        bail!(
            "gemv_multi takes 1 to {GEMV_MULTI} matrices, not {}",
            parts.len()
        );
    }
    if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) && parts.iter().any(|p| !p.0.is_multiple_of(16))
    {
        bail!("{name} reads 16-byte-aligned weights");
    }
    let mut args = vec![Arg::Ptr(xq), i32a(cols), i32a(ntok)];
    let mut blocks = 0;
    for j in 0..GEMV_MULTI {
        let (w, out, bias, rows) = parts.get(j).copied().unwrap_or((0, 0, None, 0));
        args.extend([
            Arg::Ptr(w),
            Arg::Ptr(out),
            Arg::Ptr(bias.unwrap_or(0)),
            i32a(rows),
        ]);
        blocks += rows.div_ceil(4);
    }
    let grid = [blocks as u32, ntok.div_ceil(GEMV_TOKENS) as u32, 1];
    l.launch(name, grid, [128, 1, 1], &args)
}

/// The fused gate‖up GEMV + GLU kernel for weights of `ty` (`GEMV_GLU` in fused.cu).
pub fn gemv_glu_kernel(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "gemv_glu_q4_0",
        GgmlType::Q5_0 => "gemv_glu_q5_0",
        GgmlType::Q8_0 => "gemv_glu_q8_0",
        GgmlType::Q4K => "gemv_glu_q4_k",
        GgmlType::Q6K => "gemv_glu_q6_k",
        _ => return None,
    })
}

/// Bytes of the arrival counters [`gemv_glu`] needs for `ff` columns and `ntok` tokens (zeroed
/// once; every launch leaves them zero).
pub fn gemv_glu_done_bytes(ff: usize, ntok: usize) -> usize {
    4 * ff / 32 * ntok.div_ceil(GEMV_TOKENS)
}

/// A decode FFN's first half in one launch: gate = act(xq · Wgᵀ) * (xq · Wuᵀ) (n × ff, over
/// `gate`; `up` holds xq · Wuᵀ) and its q8_1 blocks into `q8`, exactly as [`gemv_multi`] of the
/// two then [`glu_q8`]. `ff` a multiple of 32; `done`: [`gemv_glu_done_bytes`] of zeros.
#[allow(clippy::too_many_arguments)]
pub fn gemv_glu(
    l: &dyn Launch,
    ty: GgmlType,
    xq: u64,
    (wg, gate): (u64, u64),
    (wu, up): (u64, u64),
    (ff, cols, ntok): (usize, usize, usize),
    (q8, done): (u64, u64),
    act: Activation,
) -> Result<()> {
    let Some(name) = gemv_glu_kernel(ty) else {
        bail!("no fused gate/up GLU kernel for {}", ty.name());
    };
    if !ff.is_multiple_of(32) || ff == 0 {
        bail!("{name}: {ff} columns are not whole q8_1 blocks");
    }
    if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) && !(wg | wu).is_multiple_of(16) {
        bail!("{name} reads 16-byte-aligned weights");
    }
    let args = [
        Arg::Ptr(xq),
        i32a(cols),
        i32a(ntok),
        Arg::Ptr(wg),
        Arg::Ptr(gate),
        Arg::Ptr(wu),
        Arg::Ptr(up),
        i32a(ff),
        Arg::Ptr(q8),
        Arg::Ptr(done),
        Arg::I32(act_code(act)),
    ];
    let grid = [(ff / 2) as u32, ntok.div_ceil(GEMV_TOKENS) as u32, 1];
    l.launch(name, grid, [128, 1, 1], &args)
}

/// The fused output product + residual join kernel for weights of `ty` (`GEMV_NORM` in fused.cu).
pub fn gemv_norm_kernel(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "gemv_norm_q4_0",
        GgmlType::Q5_0 => "gemv_norm_q5_0",
        GgmlType::Q8_0 => "gemv_norm_q8_0",
        GgmlType::Q4K => "gemv_norm_q4_k",
        GgmlType::Q6K => "gemv_norm_q6_k",
        _ => return None,
    })
}

/// Bytes of the arrival counters [`gemv_norm`] needs for `ntok` tokens (zeroed once; every launch
/// leaves them zero).
pub fn gemv_norm_done_bytes(ntok: usize) -> usize {
    4 * ntok.div_ceil(GEMV_TOKENS)
}

/// The residual join [`gemv_norm`] runs after its product: `x += y` (normed by `y_norm` first
/// when given), `out = rms_norm(x) * w` and its q8_1 blocks `q8` (device addresses).
#[derive(Clone, Copy, Debug)]
pub struct NormJoin {
    pub x: u64,
    pub y_norm: Option<u64>,
    pub w: u64,
    pub out: u64,
    pub q8: u64,
    pub eps: f32,
}

/// A sublayer's last product and the join after it in one launch: y (ntok × rows) = xq · Wᵀ, then
/// [`add_rms_norm_q8`] of `j` with y, exactly as those two launches compute them. `rows` a
/// multiple of 32; `done`: [`gemv_norm_done_bytes`] of zeros. For one or a few tokens: one block
/// runs the join of a tile's rows after the product.
pub fn gemv_norm(
    l: &dyn Launch,
    ty: GgmlType,
    (w, xq, y): (u64, u64, u64),
    (rows, cols, ntok): (usize, usize, usize),
    j: &NormJoin,
    done: u64,
) -> Result<()> {
    let Some(name) = gemv_norm_kernel(ty) else {
        bail!("no fused product + norm kernel for {}", ty.name());
    };
    if !rows.is_multiple_of(32) || rows == 0 {
        bail!("{name}: rows of {rows} are not whole q8_1 blocks");
    }
    if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) && !w.is_multiple_of(16) {
        bail!("{name} reads 16-byte-aligned weights");
    }
    let args = [
        Arg::Ptr(xq),
        i32a(cols),
        i32a(ntok),
        Arg::Ptr(w),
        Arg::Ptr(y),
        i32a(rows),
        Arg::Ptr(j.x),
        Arg::Ptr(j.y_norm.unwrap_or(0)),
        Arg::Ptr(j.w),
        Arg::Ptr(j.out),
        Arg::Ptr(j.q8),
        Arg::Ptr(done),
        Arg::F32(j.eps),
    ];
    let grid = [(rows / 4) as u32, ntok.div_ceil(GEMV_TOKENS) as u32, 1];
    l.launch(name, grid, [128, 1, 1], &args)
}

/// out (n × rows) = x · Wᵀ on the integer tensor cores for a `rows × cols` weight of type `ty`
/// (one of [`gemm_kernel`]) and `n` tokens of q8_1 blocks `xq`; the same sums as [`gemv`], for
/// prefill-sized `n`.
pub fn gemm(
    l: &dyn Launch,
    ty: GgmlType,
    w: u64,
    xq: u64,
    out: u64,
    (rows, cols, n): (usize, usize, usize),
) -> Result<()> {
    let Some(name) = gemm_kernel(ty) else {
        bail!("no CUDA GEMM kernel for {}", ty.name());
    };
    let grid = [
        rows.div_ceil(GEMM_ROWS) as u32,
        n.div_ceil(GEMM_TOKENS) as u32,
        1,
    ];
    let args = [
        Arg::Ptr(w),
        Arg::Ptr(xq),
        Arg::Ptr(out),
        i32a(rows),
        i32a(cols),
        i32a(n),
    ];
    l.launch(name, grid, [128, 1, 1], &args)
}

/// out[i] = dequant(W row ids[i]) * scale for `n` ids (device i32) of a `cols`-wide weight.
pub fn get_rows(
    l: &dyn Launch,
    ty: GgmlType,
    w: u64,
    ids: u64,
    out: u64,
    (n, cols): (usize, usize),
    scale: f32,
) -> Result<()> {
    let Some(name) = get_rows_kernel(ty) else {
        bail!("no CUDA row lookup for {}", ty.name());
    };
    let args = [
        Arg::Ptr(w),
        Arg::Ptr(ids),
        Arg::Ptr(out),
        i32a(cols),
        Arg::F32(scale),
    ];
    l.launch(name, [n as u32, 1, 1], [256, 1, 1], &args)
}

/// RMS norm of `n_groups` groups of `n` values (y may equal x).
pub fn rms_norm(
    l: &dyn Launch,
    x: u64,
    w: u64,
    y: u64,
    n_groups: usize,
    n: usize,
    eps: f32,
) -> Result<()> {
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(w),
        Arg::Ptr(y),
        i32a(n),
        Arg::F32(eps),
    ];
    l.launch("rms_norm", [n_groups as u32, 1, 1], [256, 1, 1], &args)
}

/// RoPE in place over `rows × cols` (positions: device i32 per row; ff: optional factors).
#[allow(clippy::too_many_arguments)]
pub fn rope(
    l: &dyn Launch,
    x: u64,
    pos: u64,
    ff: Option<u64>,
    (rows, cols): (usize, usize),
    head_dim: usize,
    base: f32,
    style: RopeStyle,
) -> Result<()> {
    let theta_scale = base.powf(-2.0 / head_dim as f32);
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(pos),
        Arg::Ptr(ff.unwrap_or(0)),
        i32a(rows),
        i32a(cols),
        i32a(head_dim),
        Arg::F32(theta_scale),
        Arg::I32((style == RopeStyle::Neox) as i32),
    ];
    l.launch("rope", grid1(rows * cols / 2, 256), [256, 1, 1], &args)
}

/// One row-wise stretch of `add_rms_norm_q8` (fused.cu): with `y = Some((y, yw))`, `x += y`
/// (y RMS-normed by `yw` first when given); then `out = rms_norm(x) * w` over rows of `n`, and its
/// q8_1 blocks into `q8` when given (`n` a multiple of 32).
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm_q8(
    l: &dyn Launch,
    x: u64,
    y: Option<(u64, Option<u64>)>,
    w: u64,
    out: u64,
    q8: Option<u64>,
    (rows, n): (usize, usize),
    eps: f32,
) -> Result<()> {
    if q8.is_some() && !n.is_multiple_of(32) {
        bail!("add_rms_norm_q8: rows of {n} cannot be quantized to q8_1");
    }
    let (y, yw) = match y {
        Some((y, yw)) => (y, yw.unwrap_or(0)),
        None => (0, 0),
    };
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(y),
        Arg::Ptr(yw),
        Arg::Ptr(w),
        Arg::Ptr(out),
        Arg::Ptr(q8.unwrap_or(0)),
        i32a(n),
        Arg::F32(eps),
    ];
    l.launch("add_rms_norm_q8", [rows as u32, 1, 1], [256, 1, 1], &args)
}

/// What [`rope_kv`] does to each head besides rotating it.
#[derive(Clone, Copy, Debug)]
pub struct RopeKv {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub base: f32,
    pub style: RopeStyle,
    /// Frequency factors (head_dim / 2), device f32.
    pub ff: Option<u64>,
    /// Per-head RMS norm weights of q and of k (head_dim), device f32.
    pub q_norm: Option<u64>,
    pub k_norm: Option<u64>,
    pub eps: f32,
    /// Multiplies q after RoPE (1.0: none).
    pub q_scale: f32,
}

/// The fused `rope_kv` (fused.cu) over `rows` rows: q (rows × n_head·head_dim) normed, rotated
/// and scaled in place; k normed and rotated and v copied, both as f16, into the caches at device
/// i32 `slots` (k is not written). `pos`: device i32 per row.
pub fn rope_kv(
    l: &dyn Launch,
    qkv: (u64, u64, u64),
    caches: (u64, u64),
    idx: (u64, u64),
    rows: usize,
    r: &RopeKv,
) -> Result<()> {
    let f16 = (CacheType::F16, CacheType::F16);
    rope_kv_typed(l, qkv, caches, f16, idx, rows, r)
}

/// `rope_kv`'s arguments after q, k and v (the fused Q/K/V kernel's after its own): the caches,
/// the row tables, then what is done to each head.
fn rope_kv_args(
    (kc, vc): (u64, u64),
    types: (CacheType, CacheType),
    (slots, pos): (u64, u64),
    r: &RopeKv,
) -> [Arg; 16] {
    let theta_scale = r.base.powf(-2.0 / r.head_dim as f32);
    [
        Arg::Ptr(kc),
        Arg::Ptr(vc),
        Arg::Ptr(slots),
        Arg::Ptr(pos),
        Arg::Ptr(r.ff.unwrap_or(0)),
        Arg::Ptr(r.q_norm.unwrap_or(0)),
        Arg::Ptr(r.k_norm.unwrap_or(0)),
        i32a(r.n_head),
        i32a(r.n_head_kv),
        i32a(r.head_dim),
        Arg::F32(theta_scale),
        Arg::I32((r.style == RopeStyle::Neox) as i32),
        Arg::F32(r.q_scale),
        Arg::F32(r.eps),
        cache_arg(types.0),
        cache_arg(types.1),
    ]
}

/// [`rope_kv`] into caches whose K and V rows are of `types` (a quantized side's rows are
/// rotated and rounded to ggml blocks, as the CPU's `quant_cache.rs` stores them).
pub fn rope_kv_typed(
    l: &dyn Launch,
    (q, k, v): (u64, u64, u64),
    (kc, vc): (u64, u64),
    types: (CacheType, CacheType),
    (slots, pos): (u64, u64),
    rows: usize,
    r: &RopeKv,
) -> Result<()> {
    check_cache_heads(types, r.head_dim)?;
    if !r.head_dim.is_multiple_of(2) || r.head_dim > ATTN_MAX_HD {
        bail!(
            "rope_kv: head_dim {} (even, at most {ATTN_MAX_HD})",
            r.head_dim
        );
    }
    let mut args = vec![Arg::Ptr(q), Arg::Ptr(k), Arg::Ptr(v)];
    args.extend(rope_kv_args((kc, vc), types, (slots, pos), r));
    let grid = [rows as u32, (r.n_head + r.n_head_kv) as u32, 1];
    l.launch("rope_kv", grid, [128, 1, 1], &args)
}

/// The fused Q/K/V products + `rope_kv` kernel for Q, K and V weights of these types
/// (`GEMV_QKV` in fused.cu): one type for all three, or the mixes of Q4_K_M files (Q4_K Q and K
/// with a Q6_K V; Q5_0 Q and K with a Q8_0 V).
pub fn gemv_qkv_kernel(types: (GgmlType, GgmlType, GgmlType)) -> Option<&'static str> {
    use GgmlType::*;
    Some(match types {
        (Q4_0, Q4_0, Q4_0) => "gemv_qkv_q4_0",
        (Q5_0, Q5_0, Q5_0) => "gemv_qkv_q5_0",
        (Q8_0, Q8_0, Q8_0) => "gemv_qkv_q8_0",
        (Q4K, Q4K, Q4K) => "gemv_qkv_q4_k",
        (Q6K, Q6K, Q6K) => "gemv_qkv_q6_k",
        (Q4K, Q4K, Q6K) => "gemv_qkv_q4_k_v_q6_k",
        (Q5_0, Q5_0, Q8_0) => "gemv_qkv_q5_0_v_q8_0",
        _ => return None,
    })
}

/// Bytes of the arrival counters [`gemv_qkv`] needs for `heads` (query and KV) heads and `ntok`
/// tokens (zeroed once; every launch leaves them zero).
pub fn gemv_qkv_done_bytes(heads: usize, ntok: usize) -> usize {
    4 * heads * ntok.div_ceil(GEMV_TOKENS)
}

/// One of [`gemv_qkv`]'s three products: weight, its type, its optional bias, the output.
pub type QkvPart = (u64, GgmlType, Option<u64>, u64);

/// A decode step's Q, K and V products (`ntok` rows of q8_1 activations `xq`, `cols` wide) and
/// [`rope_kv_typed`] in one launch, exactly as those launches compute them (q rotated in place,
/// k and v as the products left them, the cache written at `slots`). head_dim a multiple of 4;
/// `done`: [`gemv_qkv_done_bytes`] of zeros.
#[allow(clippy::too_many_arguments)]
pub fn gemv_qkv(
    l: &dyn Launch,
    xq: u64,
    (q, k, v): (QkvPart, QkvPart, QkvPart),
    (cols, ntok): (usize, usize),
    (kc, vc): (u64, u64),
    types: (CacheType, CacheType),
    (slots, pos): (u64, u64),
    r: &RopeKv,
    done: u64,
) -> Result<()> {
    let Some(name) = gemv_qkv_kernel((q.1, k.1, v.1)) else {
        bail!(
            "no fused Q/K/V + RoPE kernel for {}, {}, {}",
            q.1.name(),
            k.1.name(),
            v.1.name()
        );
    };
    check_cache_heads(types, r.head_dim)?;
    let hd = r.head_dim;
    if !hd.is_multiple_of(4) || hd > ATTN_MAX_HD {
        bail!("{name}: head_dim {hd} (a multiple of 4, at most {ATTN_MAX_HD})");
    }
    for (w, ty, _, _) in [q, k, v] {
        if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) && !w.is_multiple_of(16) {
            bail!("{name} reads 16-byte-aligned weights");
        }
    }
    let mut args = vec![
        Arg::Ptr(xq),
        i32a(cols),
        i32a(ntok),
        Arg::Ptr(q.0),
        Arg::Ptr(q.2.unwrap_or(0)),
        Arg::Ptr(k.0),
        Arg::Ptr(k.2.unwrap_or(0)),
        Arg::Ptr(v.0),
        Arg::Ptr(v.2.unwrap_or(0)),
        Arg::Ptr(q.3),
        Arg::Ptr(k.3),
        Arg::Ptr(v.3),
        Arg::Ptr(done),
    ];
    args.extend(rope_kv_args((kc, vc), types, (slots, pos), r));
    let blocks = (r.n_head + 2 * r.n_head_kv) * hd / 4;
    let grid = [blocks as u32, ntok.div_ceil(GEMV_TOKENS) as u32, 1];
    l.launch(name, grid, [128, 1, 1], &args)
}

/// `gate = act(gate) * up` over `n` values (a multiple of 32) and its q8_1 blocks into `q8`.
pub fn glu_q8(
    l: &dyn Launch,
    gate: u64,
    up: u64,
    q8: u64,
    n: usize,
    act: Activation,
) -> Result<()> {
    if !n.is_multiple_of(32) {
        bail!("glu_q8: {n} values cannot be quantized to q8_1");
    }
    let args = [
        Arg::Ptr(gate),
        Arg::Ptr(up),
        Arg::Ptr(q8),
        Arg::I64(n as i64),
        Arg::I32(act_code(act)),
    ];
    l.launch("glu_q8", grid1(n, 128), [128, 1, 1], &args)
}

fn act_code(act: Activation) -> i32 {
    match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::GeluTanhF32 => 2,
    }
}

pub fn glu(l: &dyn Launch, gate: u64, up: u64, n: usize, act: Activation) -> Result<()> {
    let args = [
        Arg::Ptr(gate),
        Arg::Ptr(up),
        Arg::I64(n as i64),
        Arg::I32(act_code(act)),
    ];
    l.launch("glu", grid1(n, 256), [256, 1, 1], &args)
}

pub fn add(l: &dyn Launch, x: u64, y: u64, n: usize) -> Result<()> {
    let args = [Arg::Ptr(x), Arg::Ptr(y), Arg::I64(n as i64)];
    l.launch("add", grid1(n, 256), [256, 1, 1], &args)
}

pub fn scale(l: &dyn Launch, x: u64, s: f32, n: usize) -> Result<()> {
    let args = [Arg::Ptr(x), Arg::F32(s), Arg::I64(n as i64)];
    l.launch("scale", grid1(n, 256), [256, 1, 1], &args)
}

pub fn add_bias(l: &dyn Launch, out: u64, bias: u64, rows: usize, cols: usize) -> Result<()> {
    let args = [Arg::Ptr(out), Arg::Ptr(bias), i32a(rows), i32a(cols)];
    l.launch("add_bias", grid1(rows * cols, 256), [256, 1, 1], &args)
}

/// x[rows[i]] += scales[i] * y[i] for `n` rows of `cols` (rows, scales: device arrays).
pub fn add_rows_scaled(
    l: &dyn Launch,
    x: u64,
    y: u64,
    rows: u64,
    scales: u64,
    n: usize,
    cols: usize,
) -> Result<()> {
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(y),
        Arg::Ptr(rows),
        Arg::Ptr(scales),
        i32a(cols),
    ];
    l.launch("add_rows_scaled", [n as u32, 1, 1], [256, 1, 1], &args)
}

pub fn gather_rows(
    l: &dyn Launch,
    x: u64,
    idx: u64,
    out: u64,
    n: usize,
    cols: usize,
) -> Result<()> {
    let args = [Arg::Ptr(x), Arg::Ptr(idx), Arg::Ptr(out), i32a(cols)];
    l.launch("gather_rows", [n as u32, 1, 1], [256, 1, 1], &args)
}

pub fn copy_heads(
    l: &dyn Launch,
    src: u64,
    dst: u64,
    rows: usize,
    (src_cols, dst_cols): (usize, usize),
    c: HeadCopy,
) -> Result<()> {
    let args = [
        Arg::Ptr(src),
        Arg::Ptr(dst),
        i32a(src_cols),
        i32a(dst_cols),
        i32a(c.src_hd),
        i32a(c.src_off),
        i32a(c.dst_hd),
        i32a(c.dst_off),
        i32a(c.width),
    ];
    let grid = [rows as u32, (dst_cols / c.dst_hd) as u32, 1];
    l.launch("copy_heads", grid, [128, 1, 1], &args)
}

/// Rows of k and v (`n × kv_dim` f32) into the f16 caches at device i32 `slots`.
pub fn kv_write(
    l: &dyn Launch,
    (kc, vc): (u64, u64),
    (k, v): (u64, u64),
    slots: u64,
    n: usize,
    kv_dim: usize,
) -> Result<()> {
    let args = [
        Arg::Ptr(kc),
        Arg::Ptr(vc),
        Arg::Ptr(k),
        Arg::Ptr(v),
        Arg::Ptr(slots),
        i32a(kv_dim),
    ];
    l.launch("kv_write", [n as u32, 1, 1], [256, 1, 1], &args)
}

/// Rows of k and v (`n × kv_dim` f32, kv_dim a multiple of 32) into caches whose K and V rows
/// are of `types` at device i32 `slots` (a quantized side rotated and rounded to ggml blocks).
pub fn kv_write_q(
    l: &dyn Launch,
    (kc, vc): (u64, u64),
    (k, v): (u64, u64),
    slots: u64,
    n: usize,
    kv_dim: usize,
    types: (CacheType, CacheType),
) -> Result<()> {
    check_cache_heads(types, kv_dim)?;
    let args = [
        Arg::Ptr(kc),
        Arg::Ptr(vc),
        Arg::Ptr(k),
        Arg::Ptr(v),
        Arg::Ptr(slots),
        i32a(kv_dim),
        cache_arg(types.0),
        cache_arg(types.1),
    ];
    l.launch("kv_write_q", [n as u32, 1, 1], [128, 1, 1], &args)
}

/// Index of the largest value of each of `rows` rows (device i32 out).
pub fn argmax(l: &dyn Launch, x: u64, out: u64, rows: usize, cols: usize) -> Result<()> {
    let args = [Arg::Ptr(x), Arg::Ptr(out), i32a(cols)];
    l.launch("argmax", [rows as u32, 1, 1], [256, 1, 1], &args)
}

/// The `k` largest values of each of `rows` rows of `cols` floats at `x`, largest first (ties:
/// lower index first; NaN never chosen): indices (i32, -1 past the numbers) to `idx` and values
/// (f32) to `val`, each `rows * k`.
pub fn top_k(
    l: &dyn Launch,
    x: u64,
    (idx, val): (u64, u64),
    rows: usize,
    cols: usize,
    k: usize,
) -> Result<()> {
    if k == 0 || k > cols {
        bail!("top-k: k = {k} for rows of {cols} values");
    }
    let args = [
        Arg::Ptr(x),
        Arg::Ptr(idx),
        Arg::Ptr(val),
        i32a(cols),
        i32a(k),
    ];
    l.launch("top_k", [rows as u32, 1, 1], [256, 1, 1], &args)
}

/// Threads per block of the `sample` kernel (`SAMPLE_THREADS` in sample.cu).
pub const SAMPLE_THREADS: u32 = 512;

/// One row for the `sample` kernel: its logits, its RNG state (4 u64) and penalty window on the
/// device, and its sampler.
#[derive(Clone, Copy, Debug)]
pub struct SampleRow<'a> {
    /// The row of the logits (`n` floats at `x + 4 n row`; penalised in place).
    pub row: usize,
    /// Address of its xoshiro256** state (advanced once unless greedy).
    pub rng: u64,
    /// Its penalty window (read only when `s.penalised`).
    pub window: &'a [u32],
    pub s: &'a DeviceSampling,
}

/// Bytes of one row's record in a sample table (`SampleRow` in sample.cu).
pub const SAMPLE_ROW_BYTES: usize = 72;

/// Bytes [`sample`] writes at `table` for `rows`: the records, then the penalty windows of the
/// penalised rows.
pub fn sample_table_bytes(rows: &[SampleRow<'_>]) -> usize {
    let windows = rows.iter().filter(|r| r.s.penalised);
    rows.len() * SAMPLE_ROW_BYTES + windows.map(|r| 4 * r.window.len()).sum::<usize>()
}

/// Samples one token from each row of `rows` (rows of `n` logits at `x`, each with its own
/// sampler) into `out` (i32 a row) in one launch, as `Sampler::sample` would for each: uploads the
/// rows' records and windows to `table` (device memory of [`sample_table_bytes`]) unless they
/// equal `last` (what the caller last uploaded there, updated here), then launches `sample` with
/// one block a row. See `cuda/sample.cu`.
#[allow(clippy::too_many_arguments)]
pub fn sample(
    l: &dyn Launch,
    rows: &[SampleRow<'_>],
    table: u64,
    last: &mut Vec<u8>,
    x: u64,
    n: usize,
    out: u64,
) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    let mut bytes = Vec::with_capacity(sample_table_bytes(rows));
    let mut win = table + (rows.len() * SAMPLE_ROW_BYTES) as u64;
    for r in rows {
        let s = r.s;
        if s.top_k > DEVICE_SAMPLE_MAX_K || (s.top_k > 0 && s.top_k >= n) {
            bail!("sample: top-k {} for rows of {n}", s.top_k);
        }
        let wlen = if s.penalised { r.window.len() } else { 0 };
        bytes.extend((r.row as u64).to_le_bytes());
        bytes.extend(r.rng.to_le_bytes());
        bytes.extend(win.to_le_bytes());
        for v in [wlen, s.penalised as usize, s.top_k, 0] {
            bytes.extend((v as i32).to_le_bytes());
        }
        for v in [
            s.repeat_penalty,
            s.frequency_penalty,
            s.presence_penalty,
            s.top_p,
            s.min_p,
            s.ln_min_p,
            s.inv_temp,
            0.0,
        ] {
            bytes.extend(v.to_le_bytes());
        }
        win += 4 * wlen as u64;
    }
    debug_assert_eq!(bytes.len(), rows.len() * SAMPLE_ROW_BYTES);
    for r in rows.iter().filter(|r| r.s.penalised) {
        bytes.extend(r.window.iter().flat_map(|v| v.to_le_bytes()));
    }
    debug_assert_eq!(bytes.len(), sample_table_bytes(rows));
    if *last != bytes {
        l.upload(table, &bytes)?;
        *last = bytes;
    }
    let args = [Arg::Ptr(table), Arg::Ptr(x), i32a(n), Arg::Ptr(out)];
    l.launch(
        "sample",
        [rows.len() as u32, 1, 1],
        [SAMPLE_THREADS, 1, 1],
        &args,
    )
}

/// The attention problem for [`attention`]: buffers and sizes.
#[derive(Clone, Copy, Debug)]
pub struct AttnArgs {
    pub q: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    /// Every query's block table, concatenated (device i32).
    pub tables: u64,
    /// Per query: offset of its table in `tables`, pos, lo (device i32 × 3).
    pub meta: u64,
    /// Scratch of at least [`attn_part_bytes`].
    pub part: u64,
    pub out: u64,
    /// Where the decode path also writes the q8_1 blocks of `out` (0: not; head_dim a multiple
    /// of 32). The tiled prefill kernel does not.
    pub q8: u64,
    pub n_q: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub kv_dim: usize,
    /// The types of the cache's K and V rows: both f16 for the f16 kernels, else the `_q` ones
    /// (`attn_split_q`, `attn_prefill_q`) read the blocks in place.
    pub k_type: CacheType,
    pub v_type: CacheType,
    pub scale: f32,
    /// Splits per query: ceil(longest visible key range / ATTN_SPLIT).
    pub n_split: usize,
    /// Arrival counters (n_q × n_head_kv i32, zero between launches: [`attn_done_bytes`]): the
    /// block finishing a (query, KV head)'s last split merges the splits, and no `attn_merge`
    /// is launched. 0: `attn_merge` merges.
    pub done: u64,
}

/// Bytes of [`AttnArgs::done`] for `n_q` queries of `n_head_kv` KV heads.
pub fn attn_done_bytes(n_q: usize, n_head_kv: usize) -> usize {
    4 * n_q * n_head_kv
}

pub fn attn_part_bytes(n_q: usize, n_head: usize, head_dim: usize, n_split: usize) -> usize {
    n_q * n_head * n_split * (head_dim + 2) * 4
}

/// Split-KV attention then the merge of the splits.
pub fn attention(l: &dyn Launch, a: &AttnArgs) -> Result<()> {
    check_attn_shape(a)?;
    attention_split(l, a)
}

fn check_attn_shape(a: &AttnArgs) -> Result<()> {
    if !a.n_head.is_multiple_of(a.n_head_kv)
        || a.n_head / a.n_head_kv > ATTN_MAX_G
        || a.head_dim > ATTN_MAX_HD
    {
        bail!(
            "CUDA attention takes up to {ATTN_MAX_G} query heads per KV head and head_dim up to \
             {ATTN_MAX_HD} (model: {} / {} heads, head_dim {})",
            a.n_head,
            a.n_head_kv,
            a.head_dim
        );
    }
    if a.q8 != 0 && !a.head_dim.is_multiple_of(32) {
        bail!(
            "attention: q8_1 output needs head_dim a multiple of 32, not {}",
            a.head_dim
        );
    }
    check_cache_heads((a.k_type, a.v_type), a.head_dim)
}

impl AttnArgs {
    /// Whether the cache holds quantized rows (the `_q` kernels).
    fn quantized(&self) -> bool {
        self.k_type.is_quantized() || self.v_type.is_quantized()
    }
}

fn attention_split(l: &dyn Launch, a: &AttnArgs) -> Result<()> {
    let mut args = vec![
        Arg::Ptr(a.q),
        Arg::Ptr(a.k_cache),
        Arg::Ptr(a.v_cache),
        Arg::Ptr(a.tables),
        Arg::Ptr(a.meta),
        Arg::Ptr(a.part),
        i32a(a.n_head),
        i32a(a.n_head_kv),
        i32a(a.head_dim),
        i32a(a.block_size),
        i32a(a.kv_dim),
        Arg::F32(a.scale),
        i32a(a.n_split),
        Arg::Ptr(a.out),
        Arg::Ptr(a.q8),
        Arg::Ptr(a.done),
    ];
    let grid = [a.n_q as u32, a.n_head_kv as u32, a.n_split as u32];
    let kernel = match a.quantized() {
        true => {
            args.extend([cache_arg(a.k_type), cache_arg(a.v_type)]);
            "attn_split_q"
        }
        false => "attn_split",
    };
    l.launch(kernel, grid, [128, 1, 1], &args)?;
    if a.n_split == 1 || a.done != 0 {
        return Ok(()); // attn_split wrote (or merged) the output
    }
    let args = [
        Arg::Ptr(a.part),
        Arg::Ptr(a.out),
        i32a(a.n_head),
        i32a(a.head_dim),
        i32a(a.n_split),
        Arg::Ptr(a.q8),
    ];
    l.launch(
        "attn_merge",
        [a.n_q as u32, a.n_head as u32, 1],
        [128, 1, 1],
        &args,
    )
}

/// Queries per tile of `attn_prefill` (`PF_T` in attention.cu).
pub const PREFILL_TILE: usize = 8;

/// Tiles of consecutive queries for [`attention_prefill`]: (first, count) pairs, flattened; a tile
/// holds up to [`PREFILL_TILE`] queries and only queries of one sequence (`same_seq(i - 1, i)`).
pub fn prefill_tiles(n_q: usize, same_seq: impl Fn(usize, usize) -> bool) -> Vec<i32> {
    let mut tiles: Vec<i32> = Vec::new();
    for i in 0..n_q {
        let extend = i > 0 && same_seq(i - 1, i) && tiles[tiles.len() - 1] < PREFILL_TILE as i32;
        if extend {
            *tiles.last_mut().expect("a tile is open") += 1;
        } else {
            tiles.extend([i as i32, 1]);
        }
    }
    tiles
}

/// Tiled flash attention for many query rows (`a.part` and `a.n_split` unused); `tiles` from
/// [`prefill_tiles`] on the device.
pub fn attention_prefill(l: &dyn Launch, a: &AttnArgs, tiles: u64, n_tiles: usize) -> Result<()> {
    check_attn_shape(a)?;
    let mut args = vec![
        Arg::Ptr(a.q),
        Arg::Ptr(a.k_cache),
        Arg::Ptr(a.v_cache),
        Arg::Ptr(a.tables),
        Arg::Ptr(a.meta),
        Arg::Ptr(tiles),
        Arg::Ptr(a.out),
        i32a(a.n_head),
        i32a(a.n_head_kv),
        i32a(a.head_dim),
        i32a(a.block_size),
        i32a(a.kv_dim),
        Arg::F32(a.scale),
    ];
    let grid = [n_tiles as u32, a.n_head as u32, 1];
    let kernel = match a.quantized() {
        true => {
            args.extend([cache_arg(a.k_type), cache_arg(a.v_type)]);
            "attn_prefill_q"
        }
        false => "attn_prefill",
    };
    l.launch(kernel, grid, [128, 1, 1], &args)
}
