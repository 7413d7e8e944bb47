//! Sequences, KV cache blocks, sampling and the generation loop: everything between the model's
//! forward pass and the user interfaces. `load` opens a model on the device a caller chooses,
//! `kv_blocks` hands out KV pages, `runner` drives sequences through the model, `sampler` and
//! `stop` pick tokens and end generation, `generate` is the loop, `speculative` drafts and
//! verifies several tokens per step.

pub mod generate;
pub mod kv_blocks;
pub mod load;
pub mod runner;
pub mod sampler;
pub mod speculative;
pub mod stop;
