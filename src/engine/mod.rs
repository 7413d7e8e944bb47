//! Sequences, KV cache blocks, sampling and the generation loop: everything between the model's
//! forward pass and the user interfaces. `kv_blocks` hands out KV pages, `runner` drives sequences
//! through the model, `sampler` and `stop` pick tokens and end generation, `generate` is the loop.

pub mod generate;
pub mod kv_blocks;
pub mod runner;

pub mod sampler;
pub mod speculative;
pub mod stop;
