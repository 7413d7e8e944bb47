// Kernels that break the rules on purpose, compiled into the emulator only (never by NVRTC): the
// tests check that the emulator reports each with its source line.
#include "../common.cuh"

/// Only the even lanes reach the shuffle: divergent.
extern "C" __global__ void emu_divergent_shfl(float* out) {
  float v = (float)threadIdx.x;
  if (threadIdx.x % 2 == 0) v = __shfl_xor_sync(FULL_MASK, v, 1);
  out[threadIdx.x] = v;
}
EMU_EXPORT(emu_divergent_shfl)

/// Warp 0 waits at one barrier, the others at another: a mismatch.
extern "C" __global__ void emu_barrier_mismatch(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}
EMU_EXPORT(emu_barrier_mismatch)

/// Shuffles and barriers used correctly: out[i] = sum over the block of the thread indices,
/// reversed within each warp via __shfl_sync.
extern "C" __global__ void emu_well_formed(float* out) {
  __shared__ float scratch[32];
  float v = __shfl_sync(FULL_MASK, (float)threadIdx.x, 31 - threadIdx.x % 32);
  float total = block_sum((float)threadIdx.x, scratch);
  out[threadIdx.x] = v + 1000.0f * total;
}
EMU_EXPORT(emu_well_formed)
