//! Checks that hold one backend against another, above the engine: every CUDA kernel against the
//! crate's scalar references (`cuda_kernels`, with the attention kernels in `cuda_attention` and
//! the fused ones in `cuda_fused`, those of the quantized KV cache in `cuda_quant_cache`), the device sampler against the CPU sampler (`cuda_sample`), and
//! a whole forward pass on the CUDA backend against the CPU backend (`cuda_forward`). They run on
//! any `kernels::cuda::launch::Launch`: the tests run them on the CPU emulator of the `.cu`
//! sources, `infer selftest` on a real GPU. Nothing on a user's inference path calls into here.

pub mod cuda_attention;
pub mod cuda_forward;
pub mod cuda_fused;
pub mod cuda_kernels;
pub mod cuda_quant_cache;
pub mod cuda_sample;
