//! Quantized block layouts as ggml defines them, with scalar reference dequantize, quantize and dot.
//!
//! This module owns the meaning of tensor bytes. Each weight type is one implementation of
//! [`types::QuantType`] (layout, dequantize, reference quantizer, importance-weighted quantizer,
//! scalar dot, llama.cpp file type), registered in [`types::TYPES`] and found by its `GgmlType`
//! ([`types::ops`]); the functions below dispatch through that registry. The arithmetic lives in
//! `blocks` (ggml's `#[repr(C)]` block structs and their safe little-endian codecs), `dequant`
//! (`dequantize_row_*`), `quantize` (activation Q8 quantizers and legacy/float weight quantizers),
//! `kquantize` (the k-quant `*_ref` weight quantizers), `weighted` (their importance-matrix twins,
//! ggml's `*_impl`) and `dot` (ggml's generic `ggml_vec_dot_*`); a type added later keeps its
//! block, arithmetic and `impl QuantType` in one file of its own (`iq4_nl`). Everything is scalar,
//! safe Rust operating on unaligned byte slices, and reproduces ggml's arithmetic bit-for-bit
//! (same rounding functions, same expression order, no fused multiply-add): it is the reference
//! the SIMD kernels are tested against. A matmul row is computed as ggml-cpu does: quantize the
//! f32 activations once to [`vec_dot_type`] of the weight type ([`quantize_activations`]), then
//! [`vec_dot`] each weight row with them.

pub mod blocks;
pub mod dequant;
pub mod dot;
pub mod iq4_nl;
pub mod kquantize;
pub mod quantize;
pub mod types;
pub mod weighted;

use anyhow::{bail, ensure, Result};

use crate::format::GgmlType;
use blocks::{Block, BlockQ8K, BlockQ8_0, BlockQ8_1};

pub use dequant::dequantize_row;
pub use quantize::{
    quantize_row_q8_0, quantize_row_q8_0_as, quantize_row_q8_1, quantize_row_q8_1_as,
    quantize_row_q8_k, Q8Variant,
};
pub use types::{ops, QuantType, TypeOps};

/// The activation format a weight type's dot product consumes (ggml-cpu's `vec_dot_type`): a
/// registered type's [`QuantType::VEC_DOT_TYPE`] (Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL, Q8_1 for
/// Q4_1/Q5_1, Q8_K for the k-quants, the type itself for F32, F16 and BF16), else ggml's for the
/// types not implemented here (Q8_0 for MXFP4, Q8_K for the other i-quants and the ternary types).
/// The activation formats Q8_1 and Q8_K map to themselves; integer and F64 types, which have no
/// dot product, to F32.
pub fn vec_dot_type(ty: GgmlType) -> GgmlType {
    use GgmlType::*;
    if let Some(o) = ops(ty) {
        return o.vec_dot_type;
    }
    match ty {
        MXFP4 => Q8_0,
        Q8_1 | Q8K => ty,
        IQ2XXS | IQ2XS | IQ3XXS | IQ1S | IQ3S | IQ2S | IQ4XS | IQ1M | TQ1_0 | TQ2_0 => Q8K,
        // I8..I64 / F64 (no dot product); also any type added to `GgmlType` later.
        _ => F32,
    }
}

/// Bytes one row of `n` activations takes in format `act` (one of F32, F16, BF16, Q8_0, Q8_1,
/// Q8_K), using ggml's block sizes. (Q8_1 blocks are 36 bytes in ggml; gguf-py's size table still
/// says 40, from an older f32 layout — Q8_1 never appears in files, so only this size matters.)
pub fn activation_row_bytes(act: GgmlType, n: usize) -> Result<usize> {
    let (elems, bytes) = match act {
        GgmlType::F32 => (1, 4),
        GgmlType::F16 | GgmlType::BF16 => (1, 2),
        GgmlType::Q8_0 => (BlockQ8_0::ELEMS, BlockQ8_0::BYTES),
        GgmlType::Q8_1 => (BlockQ8_1::ELEMS, BlockQ8_1::BYTES),
        GgmlType::Q8K => (BlockQ8K::ELEMS, BlockQ8K::BYTES),
        other => bail!("{} is not an activation format", other.name()),
    };
    ensure!(
        n.is_multiple_of(elems),
        "{} activations: {n} values is not a whole number of {elems}-value blocks",
        act.name()
    );
    Ok(n / elems * bytes)
}

/// Quantizes an f32 activation row into `vec_dot_type(ty)` bytes, replacing `dst`'s contents,
/// with ggml's reference rounding ([`Q8Variant::Reference`]). F32 gives the values' little-endian
/// bytes, F16/BF16 their round-to-nearest-even conversions.
pub fn quantize_activations(ty: GgmlType, src: &[f32], dst: &mut Vec<u8>) -> Result<()> {
    quantize_activations_as(ty, src, dst, Q8Variant::Reference)
}

/// [`quantize_activations`] reproducing a specific ggml-cpu build's Q8_0/Q8_1 quantizer
/// (`variant` does not affect the other formats: ggml has a single Q8_K/F16/BF16 path).
pub fn quantize_activations_as(
    ty: GgmlType,
    src: &[f32],
    dst: &mut Vec<u8>,
    variant: Q8Variant,
) -> Result<()> {
    let act = vec_dot_type(ty);
    if !supports_vec_dot(ty) {
        bail!("no dot product for weight type {}", ty.name());
    }
    dst.clear();
    dst.resize(activation_row_bytes(act, src.len())?, 0);
    match act {
        GgmlType::F32 => quantize::quantize_row_f32(src, dst),
        GgmlType::F16 => quantize::quantize_row_f16(src, dst),
        GgmlType::BF16 => quantize::quantize_row_bf16(src, dst),
        GgmlType::Q8_0 => quantize_row_q8_0_as(src, dst, variant),
        GgmlType::Q8_1 => quantize_row_q8_1_as(src, dst, variant),
        GgmlType::Q8K => quantize_row_q8_k(src, dst),
        other => bail!("{} is not an activation format", other.name()),
    }
    Ok(())
}

/// Whether [`vec_dot`] handles weight type `ty`: every registered type ([`types::TYPES`]).
pub fn supports_vec_dot(ty: GgmlType) -> bool {
    ops(ty).is_some()
}

/// Scalar reference: the dot of one weight row (`n` elements of `ty`, exactly its bytes) with
/// activations already in `vec_dot_type(ty)` (exactly `n` of them).
///
/// Panics if `ty` is not [`supports_vec_dot`] or a length is wrong — this is the reference the
/// kernels are checked against, and callers validate shapes when they load the model.
pub fn vec_dot(ty: GgmlType, n: usize, w: &[u8], act: &[u8]) -> f32 {
    match ops(ty) {
        Some(o) => (o.vec_dot)(n, w, act),
        None => panic!("no scalar dot product for weight type {}", ty.name()),
    }
}

/// [`quantize_row`] with an importance per column (`qw`, one imatrix entry: as long as the row):
/// the types whose ggml search uses one ([`QuantType::WEIGHTED`]: Q2_K..Q6_K, Q4_0, Q4_1, Q5_0,
/// Q5_1, IQ4_NL) minimise the importance-weighted error as `llama-quantize --imatrix` does; the
/// other types ignore it, as ggml's do.
pub fn quantize_row_weighted(
    ty: GgmlType,
    src: &[f32],
    qw: &[f32],
    dst: &mut Vec<u8>,
) -> Result<()> {
    ensure!(
        qw.len() == src.len(),
        "importance of {} values for a row of {}",
        qw.len(),
        src.len()
    );
    let o = quantizer(ty, src.len(), dst)?;
    (o.quantize_weighted)(src, qw, dst);
    Ok(())
}

/// Quantizes f32 weights into `ty` (replacing `dst`'s contents) with ggml's deterministic
/// reference quantizers (`quantize_row_*_ref`, no importance matrix), for every registered type
/// ([`types::TYPES`]). Errors for other types or a length that is not a whole number of blocks.
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut Vec<u8>) -> Result<()> {
    let o = quantizer(ty, src.len(), dst)?;
    (o.quantize)(src, dst);
    Ok(())
}

/// The registered type `ty`, with `dst` sized to the bytes of a row of `n` values of it.
fn quantizer(ty: GgmlType, n: usize, dst: &mut Vec<u8>) -> Result<&'static TypeOps> {
    let Some(o) = ops(ty) else {
        bail!("quantization to {} is not supported", ty.name());
    };
    let Some(bytes) = ty.row_bytes(n) else {
        bail!(
            "{} row of {} values is not a whole number of {}-value blocks",
            ty.name(),
            n,
            ty.block_size()
        );
    };
    dst.clear();
    dst.resize(bytes, 0);
    Ok(o)
}
