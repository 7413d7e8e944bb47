//! Compute kernels: the CPU thread pool and SIMD dot products.
pub mod cpu;
