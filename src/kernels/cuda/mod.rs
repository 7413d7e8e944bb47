//! The CUDA backend. Kernels live in `cuda/*.cu` at the repository root, compiled ahead of time to
//! PTX and cubins (`scripts/build-cuda-kernels.py`, outputs in `cuda/build/`, embedded by
//! [`module`]). The host side is written against [`launch::Launch`], a small interface
//! (allocate, copy, launch a kernel by name) with two implementations: [`driver::CudaDriver`] over
//! cudarc for a real GPU, and the CPU emulator of the tests (`tests/cuda_emu/`), which runs the
//! same `.cu` sources on the host. [`backend::CudaBackend`] implements `model::Backend` on top of
//! it, uploading Q6_K weights in the layout of [`repack`]. The checks that compare each kernel and a whole forward pass with the CPU backend live above
//! the engine, in `crate::check` (used by the tests and by `infer selftest`). Nothing here needs CUDA to build: the driver library is loaded
//! at run time, and only after [`driver::probe`] has found it.

pub mod backend;
pub mod driver;
mod graphs;
pub mod launch;
pub mod module;
pub mod ops;
pub mod profile;
pub mod repack;
mod sublayers;
pub mod vram;
