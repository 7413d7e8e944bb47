//! A decode step's sublayers fused into fewer parallel regions, for one query row: the attention
//! sublayer (`attention`: Q/K/V, RoPE, attention and `wo` in two regions instead of three) and the
//! dense feed-forward (`ffn`: gate/up and down in two regions). Each computes exactly what the
//! unfused ops compute, bit for bit (their tests hold them to it); they exist because a region's
//! dispatch and its threads' stream restarts cost a measurable share of a small model's step.

pub(crate) mod attention;
pub mod ffn;
