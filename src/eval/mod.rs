//! Quality evaluation of a model on a text: perplexity the way llama.cpp's `llama-perplexity`
//! computes it, KL divergence and top-1 agreement against a base model's distributions, and the
//! importance matrix (`imatrix`: mean squared activation per weight input channel) that
//! activation-aware quantization weights its error by.
//!
//! `stats` is the math on logit rows (log-softmax, NLL, KL) and the running sums with their
//! standard errors; `perplexity` cuts the token stream into windows and drives the model (and an
//! optional base model) over them; `observe` is a [`crate::model::Backend`] wrapper that sees every
//! matmul input, which `imatrix` turns into per-channel statistics and reads/writes in llama.cpp's
//! legacy `imatrix.dat` layout; `streaming` reads a text longer than the context through a moving
//! window (context shift with attention sinks, or recomputed sliding windows). Nothing here changes how a model computes: a model evaluated here
//! gives the logits `infer run` would give for the same tokens at the same positions.

pub mod imatrix;
pub mod observe;
pub mod perplexity;
pub mod stats;
pub mod streaming;
