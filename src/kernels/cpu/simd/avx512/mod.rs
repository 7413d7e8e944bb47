//! The AVX-512 level (AVX-512 F/BW/VL + VNNI, on top of the AVX2 level's AVX2 + FMA + F16C):
//! kernels that do on 16-lane vectors, with `vpdpbusd`, exactly what their AVX2 twins do on 8.
//!
//! Every kernel is compiled with `avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni`.
//!
//! Invariants: every kernel here is reachable only after [`detected`] (through `simd::kernels`,
//! `simd::dot_rows` or a caller that checked `simd::current() >= Level::Avx512`), so the
//! `#[target_feature]` code never runs where it cannot. Each keeps the float operations of the
//! AVX2 kernel it stands beside, lane for lane, so results are bit-identical whichever level runs
//! (the tests hold every kernel here to its scalar twin). Integer sums are exact: `vpdpbusd`
//! multiplies unsigned by signed bytes and adds four products into an i32 lane, which cannot
//! overflow for ggml's value ranges.

use std::arch::x86_64::*;

use super::Kernels;
use crate::format::GgmlType;

pub(crate) use super::avx2::{blocks, entries, rows_dispatch, wrows_entry, x4_entry};

pub(crate) mod kquants;
pub(crate) mod legacy;
pub(crate) mod quantize;

/// Whether this CPU has everything the AVX-512 kernels use (and the AVX2 level's features, which
/// they fall back on).
pub(crate) fn detected() -> bool {
    super::avx2::detected()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// The AVX-512 kernels for `ty`, or `None` where this level has none of its own (the caller then
/// takes the AVX2 ones).
pub(super) fn kernels(ty: GgmlType) -> Option<Kernels> {
    if !detected() {
        return None;
    }
    let (dot, tile, name): (super::DotFn, super::DotTileFn, &'static str) = match ty {
        GgmlType::Q6K => (kquants::q6k_dot, kquants::q6k_tile, "avx512/q6_K"),
        _ => return None,
    };
    Some(Kernels { dot, tile, name })
}

/// The AVX-512 decode kernel over many weight rows for `ty`, or `None` where this level has none
/// of its own.
pub(super) fn dot_rows(ty: GgmlType) -> Option<super::DotRowsFn> {
    if !detected() {
        return None;
    }
    match ty {
        GgmlType::Q6K => Some(kquants::q6k_dot_rows),
        GgmlType::Q8_0 => Some(legacy::q8_0_dot_rows),
        GgmlType::Q5_0 => Some(legacy::q5_0_dot_rows),
        _ => None,
    }
}

/// The x4-layout decode kernel for `ty` (see [`super::DotX4Fn`]) where one exists at this level.
pub(super) fn dot_x4(ty: GgmlType) -> Option<super::DotX4Fn> {
    if !detected() {
        return None;
    }
    match ty {
        GgmlType::Q6K => Some(kquants::q6k_dot_x4),
        _ => None,
    }
}

/// The 64 bytes at `p` (unaligned), written as two 256-bit loads. On a Xeon VM two 32-byte loads
/// per line instead of one 64-byte load had made Qwen's Q4_K decode matmuls 3-4% faster
/// (alternated, three pairs), and the bandwidth probe's loop read 35.1 GB/s with 32-byte loads
/// and 29.1 GB/s with 64-byte ones. In today's kernels LLVM merges the two halves back into one
/// 64-byte load (no `vinserti64x4` from memory in the release binary, 2026-11-27); forcing two
/// loads (the first through an empty `asm!`) left Qwen2.5-1.5B's decode step at 0.998-1.002 of
/// the time on Zen 4 (paired, both bandwidth states), so the kernels keep this form, which
/// compiles to what they were measured with.
///
/// # Safety
/// The AVX-512 level is available; `p` points at 64 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn ld2x256(p: *const u8) -> __m512i {
    _mm512_inserti64x4::<1>(
        _mm512_castsi256_si512(_mm256_loadu_si256(p.cast())),
        _mm256_loadu_si256(p.add(32).cast()),
    )
}

/// The 4 bytes at `p` (unaligned) broadcast to all sixteen dwords.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn bcast32x16(p: *const u8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}
