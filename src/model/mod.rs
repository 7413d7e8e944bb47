//! Model hyperparameters, weights and the forward loop, written once for every backend.
//! `config` reads hyperparameters from GGUF metadata, `weights` finds tensors by name and checks
//! shapes, `backend` is the trait every compute backend implements, `forward` is the loop, `moe`
//! routes tokens to experts, `mla` is DeepSeek's latent attention, `shift` re-rotates cached keys
//! after a context shift.

pub mod backend;
pub mod config;
pub mod forward;
pub mod mla;
pub mod moe;
pub mod shift;
pub mod weights;

pub use backend::Backend;
pub use config::{Arch, ModelConfig};
pub use forward::{BatchEntry, Model};
pub use weights::Weights;
