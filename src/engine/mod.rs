//! Sequences, KV cache blocks, sampling and the generation loop: everything between the model's
//! forward pass and the user interfaces. `load` opens a model on the device a caller chooses,
//! `kv_blocks` shares KV pages between sequences and keeps the prefix cache, `runner` drives
//! sequences through the model, `request` turns one request's logits into tokens, text and
//! events (sampler with its DRY penalty, stop strings), `scheduler` runs many requests at once with continuous
//! batching, `generate` is the single-sequence loop, `speculative` drafts and verifies several
//! tokens per step.

pub mod constraint;
pub mod dry;
pub mod generate;
pub mod kv_blocks;
pub mod load;
pub mod prompt_cache;
pub mod request;
pub mod runner;
pub mod sampler;
pub mod scheduler;
pub mod speculative;
pub mod stop;
