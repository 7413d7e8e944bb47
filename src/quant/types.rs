//! One trait, [`QuantType`], that every weight type implements once: what its bytes mean
//! (dequantize), how to write them (ggml's reference quantizer, and its importance-weighted
//! search where ggml has one), its scalar reference dot product against the activation format it
//! multiplies with, and the llama.cpp file type it names. The registry [`ops`] finds a type's
//! implementation by its [`GgmlType`], so the rest of the crate (the matmul fallback, the model
//! loader, `infer quantize`) handles any registered type without naming it.
//!
//! Adding a type: a file of its own in `quant` with its block layout and arithmetic, one `impl
//! QuantType`, one line in `REGISTERED` (what [`TYPES`] holds), and its test vectors. Block
//! geometry (values and bytes per block) and the type's name live in `format::GgmlType`; SIMD
//! kernels, where speed matters, register against the same `GgmlType` in `kernels::cpu::simd`.
//! The activation formats (Q8_0 as an activation, Q8_1, Q8_K) are not weight types here:
//! `super::quantize_activations` writes them.
//!
//! Invariants: every entry of [`TYPES`] is a distinct type whose `dequantize`, `quantize` and
//! `vec_dot` take exactly the bytes of whole blocks of it (they panic otherwise: the public
//! functions in `quant` check lengths first), and its `VEC_DOT_TYPE` is one of F32, F16, BF16,
//! Q8_0, Q8_1, Q8_K.

use super::blocks::{
    BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0,
};
use super::iq4_nl::BlockIQ4NL;
use super::{dequant, dot, kquantize, quantize, weighted};
use crate::format::GgmlType;

/// A weight type: its layout and its scalar reference arithmetic, bit for bit as ggml's C.
pub trait QuantType {
    /// The type (its id, name and block geometry are `GgmlType`'s).
    const TYPE: GgmlType;
    /// The format the dot product reads activations in (ggml-cpu's `vec_dot_type`).
    const VEC_DOT_TYPE: GgmlType;
    /// The `general.file_type` (`llama_ftype`) llama.cpp writes for a file of this type.
    const FILE_TYPE: u32;
    /// Whether [`QuantType::quantize_weighted`] uses the importance (ggml's `quantize_*_impl`
    /// searches); where it does not, it is [`QuantType::quantize`].
    const WEIGHTED: bool = false;

    /// Values of whole blocks from exactly their bytes (`dst.len()` values).
    fn dequantize(src: &[u8], dst: &mut [f32]);

    /// Whole blocks from `src.len()` values, by ggml's deterministic reference quantizer
    /// (`quantize_row_*_ref`); `dst` is exactly their bytes.
    fn quantize(src: &[f32], dst: &mut [u8]);

    /// [`QuantType::quantize`] with an importance per value (`qw`, as long as `src`), as
    /// `llama-quantize --imatrix` does for the types whose search uses one.
    fn quantize_weighted(src: &[f32], qw: &[f32], dst: &mut [u8]) {
        let _ = qw;
        Self::quantize(src, dst)
    }

    /// The dot product of `n` values of this type (`w`, exactly their bytes) with `n` activations
    /// in [`QuantType::VEC_DOT_TYPE`] (`a`, exactly their bytes): ggml's generic
    /// `ggml_vec_dot_*`, the scalar twin of every SIMD kernel for the type.
    fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32;
}

/// Dot of one weight row with `m` activation rows `act_stride` bytes apart (`out[j]` for `j < m`).
pub type TileFn = fn(n: usize, w: &[u8], acts: &[u8], act_stride: usize, m: usize, out: &mut [f32]);

/// A registered type's implementation, as function pointers (what [`ops`] hands out).
#[derive(Clone, Copy, Debug)]
pub struct TypeOps {
    pub ty: GgmlType,
    pub vec_dot_type: GgmlType,
    pub file_type: u32,
    pub weighted: bool,
    pub dequantize: fn(&[u8], &mut [f32]),
    pub quantize: fn(&[f32], &mut [u8]),
    pub quantize_weighted: fn(&[f32], &[f32], &mut [u8]),
    pub vec_dot: fn(usize, &[u8], &[u8]) -> f32,
    /// `vec_dot` of one weight row with several activation rows, one after another (the scalar
    /// reference in the shape of a GEMM tile).
    pub vec_dot_tile: TileFn,
}

/// The function pointers of `Q`'s implementation.
pub const fn ops_of<Q: QuantType>() -> TypeOps {
    TypeOps {
        ty: Q::TYPE,
        vec_dot_type: Q::VEC_DOT_TYPE,
        file_type: Q::FILE_TYPE,
        weighted: Q::WEIGHTED,
        dequantize: Q::dequantize,
        quantize: Q::quantize,
        quantize_weighted: Q::quantize_weighted,
        vec_dot: Q::vec_dot,
        vec_dot_tile: vec_dot_tile::<Q>,
    }
}

/// `Q::vec_dot` of one weight row with `m` activation rows `act_stride` bytes apart.
fn vec_dot_tile<Q: QuantType>(
    n: usize,
    w: &[u8],
    acts: &[u8],
    act_stride: usize,
    m: usize,
    out: &mut [f32],
) {
    let row = super::activation_row_bytes(Q::VEC_DOT_TYPE, n)
        .expect("n is a whole number of activation blocks");
    assert!(
        out.len() >= m,
        "tile output has {} slots for {m} rows",
        out.len()
    );
    for (j, o) in out[..m].iter_mut().enumerate() {
        *o = Q::vec_dot(n, w, &acts[j * act_stride..j * act_stride + row]);
    }
}

/// Every registered weight type, in the order `infer quantize --type` lists them.
pub static TYPES: [TypeOps; REGISTERED.len()] = REGISTERED;

/// [`TYPES`] as a constant, so [`BY_ID`] can be built from it at compile time.
const REGISTERED: [TypeOps; 14] = [
    ops_of::<F32>(),
    ops_of::<F16>(),
    ops_of::<BF16>(),
    ops_of::<BlockQ8_0>(),
    ops_of::<BlockQ4_0>(),
    ops_of::<BlockQ4_1>(),
    ops_of::<BlockQ5_0>(),
    ops_of::<BlockQ5_1>(),
    ops_of::<BlockQ2K>(),
    ops_of::<BlockQ3K>(),
    ops_of::<BlockQ4K>(),
    ops_of::<BlockQ5K>(),
    ops_of::<BlockQ6K>(),
    ops_of::<BlockIQ4NL>(),
];

/// Each type id's index in [`TYPES`] (`u8::MAX`: not registered): the matmul asks for a weight's
/// activation format on every call, so [`ops`] is one load, not a search.
static BY_ID: [u8; 64] = {
    let mut by_id = [u8::MAX; 64];
    let mut i = 0;
    while i < REGISTERED.len() {
        by_id[REGISTERED[i].ty as usize] = i as u8;
        i += 1;
    }
    by_id
};

/// The implementation of `ty`, if it is a registered weight type.
pub fn ops(ty: GgmlType) -> Option<&'static TypeOps> {
    let i = *BY_ID.get(ty as usize)?;
    TYPES.get(i as usize)
}

/// F32 weights: the little-endian floats themselves.
pub struct F32;
/// F16 weights.
pub struct F16;
/// BF16 weights.
pub struct BF16;

/// Implements [`QuantType`] for a type whose functions already exist under these names.
macro_rules! quant_type {
    (@weighted) => { false };
    (@weighted $w:path) => { true };
    ($t:ty, $ty:ident, dot with $act:ident, file type $ft:expr, $deq:path, $quant:path, $dot:path
     $(, weighted $w:path)?) => {
        impl QuantType for $t {
            const TYPE: GgmlType = GgmlType::$ty;
            const VEC_DOT_TYPE: GgmlType = GgmlType::$act;
            const FILE_TYPE: u32 = $ft;
            const WEIGHTED: bool = quant_type!(@weighted $($w)?);
            fn dequantize(src: &[u8], dst: &mut [f32]) {
                $deq(src, dst)
            }
            fn quantize(src: &[f32], dst: &mut [u8]) {
                $quant(src, dst)
            }
            $(fn quantize_weighted(src: &[f32], qw: &[f32], dst: &mut [u8]) {
                $w(src, qw, dst)
            })?
            fn vec_dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
                $dot(n, w, a)
            }
        }
    };
}

// File types: llama.cpp's `llama_ftype` (`LLAMA_FTYPE_ALL_F32` = 0, `MOSTLY_F16` = 1, ...); a
// plain k-quant is recorded as the "small" member of its family (`MOSTLY_Q4_K_S`), since llama.cpp
// has no "pure Q4_K" file type.
quant_type!(F32, F32, dot with F32, file type 0,
    dequant::dequantize_row_f32, quantize::quantize_row_f32, dot::vec_dot_f32);
quant_type!(F16, F16, dot with F16, file type 1,
    dequant::dequantize_row_f16, quantize::quantize_row_f16, dot::vec_dot_f16);
quant_type!(BF16, BF16, dot with BF16, file type 32,
    dequant::dequantize_row_bf16, quantize::quantize_row_bf16, dot::vec_dot_bf16);
quant_type!(BlockQ4_0, Q4_0, dot with Q8_0, file type 2,
    dequant::dequantize_row_q4_0, quantize::quantize_row_q4_0, dot::vec_dot_q4_0_q8_0,
    weighted weighted::quantize_q4_0);
quant_type!(BlockQ4_1, Q4_1, dot with Q8_1, file type 3,
    dequant::dequantize_row_q4_1, quantize::quantize_row_q4_1, dot::vec_dot_q4_1_q8_1,
    weighted weighted::quantize_q4_1);
quant_type!(BlockQ5_0, Q5_0, dot with Q8_0, file type 8,
    dequant::dequantize_row_q5_0, quantize::quantize_row_q5_0, dot::vec_dot_q5_0_q8_0,
    weighted weighted::quantize_q5_0);
quant_type!(BlockQ5_1, Q5_1, dot with Q8_1, file type 9,
    dequant::dequantize_row_q5_1, quantize::quantize_row_q5_1, dot::vec_dot_q5_1_q8_1,
    weighted weighted::quantize_q5_1);
quant_type!(BlockQ8_0, Q8_0, dot with Q8_0, file type 7,
    dequant::dequantize_row_q8_0, quantize::quantize_row_q8_0, dot::vec_dot_q8_0_q8_0);
quant_type!(BlockQ2K, Q2K, dot with Q8K, file type 10,
    dequant::dequantize_row_q2k, kquantize::quantize_row_q2k, dot::vec_dot_q2k_q8k,
    weighted weighted::quantize_q2k);
quant_type!(BlockQ3K, Q3K, dot with Q8K, file type 11,
    dequant::dequantize_row_q3k, kquantize::quantize_row_q3k, dot::vec_dot_q3k_q8k,
    weighted weighted::quantize_q3k);
quant_type!(BlockQ4K, Q4K, dot with Q8K, file type 14,
    dequant::dequantize_row_q4k, kquantize::quantize_row_q4k, dot::vec_dot_q4k_q8k,
    weighted weighted::quantize_q4k);
quant_type!(BlockQ5K, Q5K, dot with Q8K, file type 16,
    dequant::dequantize_row_q5k, kquantize::quantize_row_q5k, dot::vec_dot_q5k_q8k,
    weighted weighted::quantize_q5k);
quant_type!(BlockQ6K, Q6K, dot with Q8K, file type 18,
    dequant::dequantize_row_q6k, kquantize::quantize_row_q6k, dot::vec_dot_q6k_q8k,
    weighted weighted::quantize_q6k_weighted);

#[cfg(test)]
mod tests {
    use super::*;

    /// Each entry is its own type's, found under it, and its geometry is the format's.
    #[test]
    fn registry_is_consistent() {
        for (i, o) in TYPES.iter().enumerate() {
            assert_eq!(ops(o.ty).map(|p| p.ty), Some(o.ty));
            assert!(TYPES[..i].iter().all(|p| p.ty != o.ty), "{:?} twice", o.ty);
            assert!(
                matches!(
                    o.vec_dot_type,
                    GgmlType::F32
                        | GgmlType::F16
                        | GgmlType::BF16
                        | GgmlType::Q8_0
                        | GgmlType::Q8_1
                        | GgmlType::Q8K
                ),
                "{:?}",
                o.ty
            );
            // Activation rows of one weight block's values are whole activation blocks.
            let n = o.ty.block_size().max(256);
            assert!(super::super::activation_row_bytes(o.vec_dot_type, n).is_ok());
        }
        assert!(ops(GgmlType::Q8K).is_none() && ops(GgmlType::Q8_1).is_none());
    }
}
