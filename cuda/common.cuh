// Shared by every kernel file: integer types, ggml block layouts, warp reductions, and the wrappers
// around hardware-specific instructions (each with a portable fallback, which the CPU emulator uses).
// Built two ways: by NVRTC for the GPU (scripts/build-cuda-kernels.sh) and with -DINFER_CUDA_EMU by
// a host C++20 compiler for the tests (cuda/emu/cuda_emu.h).
#pragma once

#ifdef INFER_CUDA_EMU
#include "emu/cuda_emu.h"
#else
#include <cuda_fp16.h>
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int64_t;
typedef unsigned long long uint64_t;
#define DYN_SHARED(T, name) \
  extern __shared__ unsigned char name##_raw[]; \
  T* name = reinterpret_cast<T*>(name##_raw)
#define EMU_EXPORT(name)
#endif

#define FULL_MASK 0xffffffffu
#define QK 32    // elements per q8_1 activation block (and per Q4_0/Q5_0/Q8_0 block)
#define QK_K 256 // elements per k-quant super-block

// --- block layouts (ggml-common.h), sizes in bytes -----------------------------------------------
// q8_1: half d, half s (= d * sum(qs)), int8 qs[32]        36
// q4_0: half d, uint8 qs[16]                               18
// q5_0: half d, uint8 qh[4], uint8 qs[16]                  22
// q8_0: half d, int8 qs[32]                                34
// q4_K: half d, half dmin, uint8 scales[12], uint8 qs[128] 144
// q6_K: uint8 ql[128], uint8 qh[64], int8 scales[16], half d 210
#define Q8_1_BYTES 36
#define Q4_0_BYTES 18
#define Q5_0_BYTES 22
#define Q8_0_BYTES 34
#define Q4_K_BYTES 144
#define Q6_K_BYTES 210

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

/// Sum of the four signed byte products of a and b, plus c (`__dp4a` on sm_61+).
__device__ __forceinline__ int dp4a_s8(int a, int b, int c) {
#if !defined(INFER_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
  return __dp4a(a, b, c);
#else
  const int8_t* x = reinterpret_cast<const int8_t*>(&a);
  const int8_t* y = reinterpret_cast<const int8_t*>(&b);
  return c + x[0] * y[0] + x[1] * y[1] + x[2] * y[2] + x[3] * y[3];
#endif
}

/// Reads 4 bytes at a 2-byte-aligned address (ggml rows of Q4_0/Q5_0/Q8_0/Q6_K are 2-aligned).
__device__ __forceinline__ int load_i32_a2(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

/// Reads 4 bytes at a 4-byte-aligned address.
__device__ __forceinline__ int load_i32_a4(const uint8_t* p) {
  return *reinterpret_cast<const int*>(p);
}

__device__ __forceinline__ float load_half(const uint8_t* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}

/// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block.
__device__ __forceinline__ void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

/// Sum of `v` over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets
/// the result. `scratch` holds 32 floats of shared memory. Contains barriers: call from all threads.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

#define NEG_INF (-__int_as_float(0x7f800000))
