//! infer: a single-binary LLM inference engine for quantized GGUF models.
//!
//! Layers, each knowing only what it must (docs/architecture.md draws them):
//! `format` (GGUF bytes, no math) → `quant` (block layouts, one `QuantType` per weight type, the
//! scalar reference) → `model` (names, shapes, the forward loop and the `Backend` trait) ←
//! `kernels` (the CPU and CUDA backends, which implement `model::Backend` using `quant`'s layouts)
//! → `engine` (sequences, KV blocks, sampler, generation, speculative decoding) → interfaces (the
//! `infer` command in `src/cli`, a client of the engine). Beside them: `tokenizer`, `chat`
//! (templates and conversations), `eval` (perplexity, KL divergence, the importance matrix),
//! `convert` (Hugging Face checkpoints and requantization) and `check` (the CUDA backend held
//! against the CPU, for tests and `infer selftest`).

pub mod chat;
pub mod check;
pub mod convert;
pub mod engine;
pub mod eval;
pub mod format;
pub mod kernels;
pub mod model;
pub mod quant;
pub mod server;
pub mod tokenizer;
pub mod trace;
