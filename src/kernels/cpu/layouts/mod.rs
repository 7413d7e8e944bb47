//! Weight matrices repacked once, on first use, into layouts the decode kernels (and Q4_K's GEMM)
//! stream faster than the file's, each kept beside the mapped file on huge pages for the life of
//! the model. One folder per (type, layout), named `<type>_x<rows>` by how many weight rows a
//! packed block interleaves:
//!
//! - `q4_k_x8`: Q4_K in groups of eight rows (llama.cpp's CPU_REPACK shape, GEMV and GEMM); at the
//!   AVX-512 level two groups are stored as one sixteen-row unit (`avx512_x16.rs`).
//! - `q6_k_x16`, `q5_0_x16`, `q8_0_x16`: sixteen-row units for the AVX-512 decode kernels; what
//!   they share lives in `x16`.
//! - `q6_k_x4`: Q6_K in groups of four rows for the AVX2 decode kernel.
//! - `pack_file`: the copies kept on disk between runs, so that a start needs no repacking.
//! - `prefetch`: whether these kernels prefetch their stream in software on this CPU.
//!
//! Invariant: every packed kernel is bit-identical to the per-row kernel of its type in `simd` (and
//! so to the scalar reference's arithmetic as documented there); each folder's tests hold it.

pub mod pack_file;
pub mod prefetch;
pub mod q4_k_x8;
pub mod q5_0_x16;
pub mod q6_k_x16;
pub mod q6_k_x4;
pub mod q8_0_x16;
pub mod x16;
