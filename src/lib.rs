//! infer: a single-binary LLM inference engine for quantized GGUF models.
//!
//! Layers, each knowing only what it must:
//! `format` (GGUF bytes, no math) → `quant` (block layouts, scalar reference) → `kernels` (CPU SIMD,
//! thread pool) → `model` (names, shapes, the forward loop) → `engine` (sequences, KV blocks, sampler,
//! generation) → `cli` (the `infer` command, a client of the engine).

pub mod chat;
pub mod check;
pub mod convert;
pub mod engine;
pub mod eval;
pub mod format;
pub mod kernels;
pub mod model;
pub mod quant;
pub mod tokenizer;
