//! SIMD dot-product kernels for quantized weight rows, chosen once per process for this CPU.
//!
//! This module owns the run-time choice of instruction set ([`level`]) and hands out, per weight
//! type, a pair of kernels ([`Kernels`]): `dot` (one weight row · one activation row, the decode
//! path) and `tile` (one weight row · `m` activation rows, the prefill / verification path, which
//! unpacks each weight block once for all `m` rows). Both take the same raw, unaligned GGUF bytes as
//! the scalar reference [`crate::quant::vec_dot`] — weights in their file layout, activations in
//! [`crate::quant::vec_dot_type`] of the weight type — and that reference is the scalar twin of
//! every kernel: [`kernels`] returns `None` where only it exists, and [`reference()`] wraps it in the
//! same shape. Q4_K has a second flavour, [`q4k_gemm_kernels`], for the activation rows llama.cpp
//! multiplies with its GEMM rather than its GEMV (scalar twin: [`q4_k_gemm`]).
//!
//! Invariants every kernel keeps (and the tests check):
//! - Integer parts are exact, as in ggml. The float accumulation follows the ggml-cpu x86 kernel
//!   llama.cpp itself runs for that type on an AVX2 machine, operation for operation (including
//!   where ggml fuses a multiply-add): the repacked `gemv` structure for Q4_0 and Q4_K (one exact
//!   integer sum per block, `acc = fma(isum, d_w * d_a, acc)`), and the AVX2 `ggml_vec_dot_*`
//!   structure (eight f32 lanes, `hsum_float_8`) for the other types. Results therefore differ
//!   from the scalar reference (ggml's generic C) only by float rounding: within `1e-5 * Σ|w·a|`.
//! - `tile` is batch-invariant: `out[j]` is bit-identical to `dot` of the same weight row with
//!   activation row `j`, whatever `m` and wherever row `j` falls in the tile. (llama.cpp itself is
//!   not: for Q4_K it uses the GEMM flavour on whole groups of four rows.)
//! - Activations must come from ggml's quantizers (`quantize_activations`): like ggml's x86 kernels
//!   (`_mm256_sign_epi8`), the kernels assume no activation byte is -128.
//! - Nothing here runs an instruction the CPU lacks: a level is used only after run-time detection,
//!   and `INFER_SIMD` can lower the level but never raise it above what was detected.
//!
//! Levels: `avx512` (AVX-512 F/BW/VL + VNNI on top of AVX2 + FMA + F16C: `vpdpbusd` on 16-lane
//! vectors), `avx2` (AVX2 + FMA + F16C, `vpmaddubsw`) on x86-64, else `scalar`. A level includes
//! everything below it: where the AVX-512 level has no kernel of its own for a shape, the AVX2
//! one runs (the two are bit-identical wherever both exist, which the tests check).
//! `INFER_SIMD=scalar` forces the reference; `avx2` and `avx512` ask for at most that level;
//! `level()` always reports what is really used. Throughput is measured by `benches/kernels.rs`.

use std::sync::OnceLock;

use crate::format::GgmlType;

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub mod q4_k_gemm;
#[cfg(test)]
mod tests;

/// Dot of one weight row (`n` elements of the weight type, exactly its bytes) with one activation
/// row (exactly `n` elements in the weight type's `vec_dot_type`).
pub type DotFn = fn(n: usize, w: &[u8], a: &[u8]) -> f32;

/// Dot of ONE weight row with `m` activation rows (a GEMM tile: the weight row's blocks are loaded
/// once for all m rows, which is what makes prefill and speculative verification compute-bound
/// instead of memory-bound). `acts` holds m rows of `act_stride` bytes (each row's first
/// `activation_row_bytes` bytes are used); `out[j] = dot(w, act row j)` for `j < m`.
pub type DotTileFn =
    fn(n: usize, w: &[u8], acts: &[u8], act_stride: usize, m: usize, out: &mut [f32]);

/// Dot of `out.len()` weight rows, `row_bytes` apart in `w`, with ONE activation row: the decode
/// shape, which runs several rows' independent accumulation chains side by side. `out[r]` is
/// bit-identical to `dot` of weight row `r`.
pub type DotRowsFn = fn(n: usize, w: &[u8], row_bytes: usize, a: &[u8], out: &mut [f32]);

/// The multi-row decode kernel for `ty` at the current level, where one exists.
pub fn dot_rows(ty: GgmlType) -> Option<DotRowsFn> {
    dot_rows_at(current(), ty)
}

/// [`dot_rows`] at exactly `level` (`None` where this CPU lacks it). For tests and benchmarks.
pub fn dot_rows_at(level: Level, ty: GgmlType) -> Option<DotRowsFn> {
    if !level.available() {
        return None;
    }
    match level {
        Level::Scalar => None,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => avx2::dot_rows(ty),
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => avx512::dot_rows(ty).or_else(|| avx2::dot_rows(ty)),
        #[cfg(not(target_arch = "x86_64"))]
        _ => None,
    }
}

/// `out.len()` weight rows (a multiple of four) stored in the x4 layout (`q6_k_x4`: four rows'
/// blocks interleaved) times one activation row `a`; each output bit-identical to the level's
/// [`DotRowsFn`] on the same rows in file layout.
pub type DotX4Fn = fn(n: usize, w: &[u8], a: &[u8], out: &mut [f32]);

/// The decode kernel over x4-layout rows for `ty` at the selected level, if there is one.
pub fn dot_x4(ty: GgmlType) -> Option<DotX4Fn> {
    dot_x4_at(current(), ty)
}

/// [`dot_x4`] at exactly `level` (`None` where this CPU lacks it). For tests and benchmarks.
pub fn dot_x4_at(level: Level, ty: GgmlType) -> Option<DotX4Fn> {
    if !level.available() {
        return None;
    }
    match level {
        Level::Scalar => None,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => avx2::dot_x4(ty),
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => avx512::dot_x4(ty).or_else(|| avx2::dot_x4(ty)),
        #[cfg(not(target_arch = "x86_64"))]
        _ => None,
    }
}

/// The kernels for one weight type at one level.
#[derive(Clone, Copy, Debug)]
pub struct Kernels {
    pub dot: DotFn,
    pub tile: DotTileFn,
    /// `"<level>/<type>"`, e.g. `"avx2/q4_K"`, for logs and benchmarks.
    pub name: &'static str,
}

/// An instruction-set level, lowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The scalar reference (`crate::quant::vec_dot`).
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// Avx2 plus AVX-512 F, BW, VL and VNNI.
    Avx512,
}

impl Level {
    /// Every level, lowest first.
    pub const ALL: [Level; 3] = [Level::Scalar, Level::Avx2, Level::Avx512];

    /// The name `level()` reports and `INFER_SIMD` accepts.
    pub fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    /// Whether this CPU can run the level's kernels.
    pub fn available(self) -> bool {
        match self {
            Level::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => avx2::detected(),
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => avx512::detected(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// The best level this CPU supports.
pub fn detect() -> Level {
    Level::ALL
        .into_iter()
        .rev()
        .find(|l| l.available())
        .unwrap_or(Level::Scalar)
}

/// The level `INFER_SIMD` (its value `requested`) selects on a CPU whose best level is `detected`:
/// the requested ceiling clamped to `detected`. `None`, empty or `auto` mean `detected`; an unknown
/// value is reported in the error and otherwise treated as `auto`.
pub fn select_level(requested: Option<&str>, detected: Level) -> (Level, Option<String>) {
    let ceiling = match requested.map(|s| s.trim().to_ascii_lowercase()) {
        None => return (detected, None),
        Some(s) => match s.as_str() {
            "" | "auto" => return (detected, None),
            "scalar" | "none" | "off" => Level::Scalar,
            "avx2" => Level::Avx2,
            "avx512" | "avx512vnni" => Level::Avx512,
            other => {
                return (
                    detected,
                    Some(format!(
                        "INFER_SIMD={other:?} is not one of auto, scalar, avx2, avx512; using {}",
                        detected.name()
                    )),
                )
            }
        },
    };
    (ceiling.min(detected), None)
}

/// The level in use, detected once per process and capped by `INFER_SIMD`.
pub fn current() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let requested = std::env::var("INFER_SIMD").ok();
        let (level, warning) = select_level(requested.as_deref(), detect());
        if let Some(w) = warning {
            eprintln!("warning: {w}");
        }
        level
    })
}

/// For a test of `level`'s kernels: panics unless the level is in use. Such a test is compiled
/// as ignored where the building CPU lacks the level (`build.rs`), so it never returns early and
/// counts as passed; this catches a run capped below it by `INFER_SIMD`.
#[cfg(test)]
pub(crate) fn require(level: Level) {
    assert!(
        current() >= level,
        "this test needs the {} level, but {} is in use (the CPU lacks it, or INFER_SIMD caps it)",
        level.name(),
        current().name()
    );
}

/// The name of the level in use: `"avx512"`, `"avx2"` or `"scalar"`.
pub fn level() -> &'static str {
    current().name()
}

/// The best kernels for `ty` at the level in use ([`current`]), or `None` if only the scalar
/// reference exists (the caller then uses `crate::quant::vec_dot`, or [`reference()`]).
pub fn kernels(ty: GgmlType) -> Option<Kernels> {
    kernels_at(current(), ty)
}

/// The kernels for `ty` at exactly `level`, or `None` if this CPU lacks the level, the level is
/// `Scalar`, or no kernel for `ty` exists at that level. For tests and benchmarks.
pub fn kernels_at(level: Level, ty: GgmlType) -> Option<Kernels> {
    if !level.available() {
        return None;
    }
    match level {
        Level::Scalar => None,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => avx2::kernels(ty),
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => avx512::kernels(ty).or_else(|| avx2::kernels(ty)),
        #[cfg(not(target_arch = "x86_64"))]
        _ => None,
    }
}

/// The scalar reference `crate::quant::vec_dot` for `ty` in the [`Kernels`] shape (its tile is a
/// loop of dots), or `None` if `ty` is not a registered weight type (`crate::quant::types`).
pub fn reference(ty: GgmlType) -> Option<Kernels> {
    let o = crate::quant::ops(ty)?;
    Some(Kernels {
        dot: o.vec_dot,
        tile: o.vec_dot_tile,
        name: reference_name(ty),
    })
}

/// `"scalar/<type>"` for a registered type (ggml's spelling: `q4_K`, `iq4_nl`), made once per type.
fn reference_name(ty: GgmlType) -> &'static str {
    static NAMES: OnceLock<Vec<(GgmlType, &'static str)>> = OnceLock::new();
    let names = NAMES.get_or_init(|| {
        crate::quant::types::TYPES
            .iter()
            .map(|o| {
                let ggml = o.ty.name().to_ascii_lowercase().replace("_k", "_K");
                let name: &'static str = format!("scalar/{ggml}").leak();
                (o.ty, name)
            })
            .collect()
    });
    names
        .iter()
        .find(|(t, _)| *t == ty)
        .map_or("scalar", |(_, n)| n)
}

/// Q4_K kernels that accumulate like llama.cpp's repacked Q4_K **GEMM** (one `fma` per pair of
/// sub-blocks; see [`q4_k_gemm`]) rather than its GEMV (one per super-block, which is what
/// `kernels(Q4K)` does). llama.cpp uses the GEMM for whole groups of four activation rows of a
/// matrix with a multiple of 8 rows, the GEMV for the rest. The best level in use, else the scalar
/// twin [`q4_k_gemm::dot`] / [`q4_k_gemm::tile`] (name `"scalar/q4_K-gemm"`).
pub fn q4k_gemm_kernels() -> Kernels {
    q4k_gemm_kernels_at(current()).unwrap_or(Kernels {
        dot: q4_k_gemm::dot,
        tile: q4_k_gemm::tile,
        name: "scalar/q4_K-gemm",
    })
}

/// [`q4k_gemm_kernels`] at exactly `level`, or `None` where [`kernels_at`] would give `None`.
pub fn q4k_gemm_kernels_at(level: Level) -> Option<Kernels> {
    if !level.available() {
        return None;
    }
    match level {
        Level::Scalar => None,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => avx2::q4k_gemm(),
        #[cfg(not(target_arch = "x86_64"))]
        _ => None,
    }
}

/// Panics unless `m` activation rows of `row` bytes at `stride` fit in `acts_len` bytes and `out`
/// has room for `m` results. Shared by every tile kernel.
fn check_tile(row: usize, acts_len: usize, stride: usize, m: usize, out_len: usize) {
    assert!(out_len >= m, "tile output has {out_len} slots for {m} rows");
    if m > 0 {
        assert!(
            stride >= row,
            "activation stride {stride} is shorter than a row ({row} bytes)"
        );
        assert!(
            acts_len >= (m - 1) * stride + row,
            "{m} activation rows of {row} bytes at stride {stride} need more than {acts_len} bytes"
        );
    }
}
