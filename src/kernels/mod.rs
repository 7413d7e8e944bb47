//! Compute kernels: the CPU thread pool and SIMD dot products, and the CUDA backend.
pub mod cpu;
pub mod cuda;
