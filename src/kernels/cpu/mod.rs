//! CPU kernels: persistent thread pool, quantized matmul, attention over the paged KV cache, and the
//! element-wise ops, gathered behind `CpuBackend`.

pub mod attention;
pub mod attention_f32;
pub mod backend;
pub mod matmul;
pub mod membw;
pub mod ops;
pub mod pool;
pub mod q4k_x8;
pub mod q6k_x8;
pub mod q80_gemm;
pub mod simd;
