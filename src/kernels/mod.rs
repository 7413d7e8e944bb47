//! The backends: everything that implements `model::Backend`. `cpu` is the CPU backend (thread
//! pool, quantized matmul, attention, SIMD kernels); `cuda` the CUDA backend (launch interface,
//! driver, kernel launchers); `device` the backend the engine runs, the CPU one plus optionally
//! the CUDA one for the first layers of a model. `cpu` and `cuda` know nothing of each other.

pub mod cpu;
pub mod cuda;
pub mod device;
