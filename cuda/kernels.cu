// The one translation unit that is compiled, both by NVRTC (one module per architecture, see
// scripts/build-cuda-kernels.py) and by the host compiler for the CPU emulator.
#include "gemv.cu"
#include "gemm.cu"
#include "ops.cu"
#include "fused.cu"
#include "attention.cu"
#include "sample.cu"
