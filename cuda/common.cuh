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

// A device function kept out of line: its registers are not added to its caller's (a kernel's
// rarely taken epilogue), at the cost of a call. Inline in the emulator.
#ifdef INFER_CUDA_EMU
#define NOINLINE inline
#else
#define NOINLINE __noinline__
#endif

// Programmatic dependent launch (sm_90+; src/kernels/cuda/graphs.rs, INFER_CUDA_PDL=1): the next
// kernel of a decode step may start while this one finishes. Every kernel opens with PDL_ENTRY():
// it waits until the kernel before it has completed and its writes are visible, then lets the next
// one launch. The rule that makes this safe: nothing before the wait reads an activation or writes
// anything, so a kernel never overwrites what its predecessor still reads nor reads what it has not
// written; and since every thread of every kernel waits before it can exit, no grid completes
// before its predecessor has, so the dependency is transitive (a kernel may read what any earlier
// one wrote). Launched without the attribute (and on older GPUs and the emulator) both are no-ops.
#if !defined(INFER_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTRY()                                   \
  do {                                                \
    asm volatile("griddepcontrol.wait;" ::: "memory"); \
    asm volatile("griddepcontrol.launch_dependents;"); \
  } while (0)
#else
#define PDL_ENTRY() \
  do {              \
  } while (0)
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
// q6_K: uint8 ql[128], uint8 qh[64], int8 scales[16], half d 210 (in the file; repacked into
//       16-byte-aligned planes per row on the device, see Q6_K in gemv.cu)
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

/// c += A·B for one 16×8×16 tile of signed bytes on the integer tensor cores
/// (`mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32`, sm_80+), in the PTX fragment layout (PTX
/// ISA, "Matrix Fragments for mma.m16n8k16 with integer type"), with g = lane / 4, t = lane % 4:
/// a0 / a1 hold A[g][4t..4t+3] / A[g+8][4t..4t+3] (byte 0 lowest), b holds B[4t..4t+3][g] (the
/// column of B is a row of the k-contiguous B^T), and c[i] is C[g + 8 * (i / 2)][2t + i % 2].
/// Called by all 32 lanes of a warp together. The fallback (CPU emulator, pre-sm_80) gathers the
/// same elements with warp shuffles and `dp4a`, so both give exactly the same int32 results.
__device__ __forceinline__ void mma_s8_16816(int (&c)[4], int a0, int a1, int b) {
#if !defined(INFER_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(b));
#else
  const int lane = (int)((threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x) % 32;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < 4; q++) {
    // k = 4q..4q+3: row g (g+8) of A from lane 4g+q; columns 2t, 2t+1 of B from lanes 8t+q, 8t+4+q.
    const int x0 = __shfl_sync(FULL_MASK, a0, 4 * g + q);
    const int x1 = __shfl_sync(FULL_MASK, a1, 4 * g + q);
    const int y0 = __shfl_sync(FULL_MASK, b, 8 * t + q);
    const int y1 = __shfl_sync(FULL_MASK, b, 8 * t + 4 + q);
    c[0] = dp4a_s8(x0, y0, c[0]);
    c[1] = dp4a_s8(x0, y1, c[1]);
    c[2] = dp4a_s8(x1, y0, c[2]);
    c[3] = dp4a_s8(x1, y1, c[3]);
  }
#endif
}

/// Reads 4 bytes at a 2-byte-aligned address (ggml rows of Q4_0/Q5_0/Q8_0 are 2-aligned).
__device__ __forceinline__ int load_i32_a2(const uint8_t* p) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(p);
  return (int)((uint32_t)h[0] | ((uint32_t)h[1] << 16));
}

/// Reads 4 bytes at a 4-byte-aligned address.
__device__ __forceinline__ int load_i32_a4(const uint8_t* p) {
  return *reinterpret_cast<const int*>(p);
}

/// Reads 16 bytes at a 16-byte-aligned address as four ints: one 128-bit load on the GPU.
__device__ __forceinline__ void load_i32x4_a16(const uint8_t* p, int (&v)[4]) {
#ifdef INFER_CUDA_EMU
  memcpy(v, p, 16);
#else
  const int4 q = *reinterpret_cast<const int4*>(p);
  v[0] = q.x;
  v[1] = q.y;
  v[2] = q.z;
  v[3] = q.w;
#endif
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

/// The last-block pattern: every block of a launch that shares `count` (an int in global memory,
/// zero between launches) calls this once its results are written; true, in every thread, in the
/// block that arrives `need`-th, after which the others' writes are visible to it (read them
/// through volatile loads: they may be in no cache of this SM). Each block fences its writes and
/// passes the block's barrier before it counts, so nothing waits and no block is assumed to run
/// before another. The last block must set `count` back to zero. `last`: a shared int.
__device__ __forceinline__ bool last_to_arrive(int* count, int need, int* last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last = atomicAdd(count, 1) == need - 1;
  __syncthreads();
  if (!*last) return false;
  __threadfence();
  return true;
}

/// One q8_1 block from the 32 lanes of a warp, lane i holding value i: ggml's
/// quantize_row_q8_1_ref (d = amax / 127, q = roundf(v / d), s = d * sum(q)) into the 36 bytes at
/// `ob`. Called by all 32 lanes together.
__device__ __forceinline__ void q8_1_warp(float v, uint8_t* ob) {
  const int lane = threadIdx.x % 32;
  const float amax = warp_max(fabsf(v));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const int q = (int)roundf(v * id);
  const float sum = warp_sum((float)q);  // exact: |sum| <= 32 * 127
  reinterpret_cast<int8_t*>(ob + 4)[lane] = (int8_t)q;
  if (lane == 0) {
    reinterpret_cast<__half*>(ob)[0] = __float2half_rn(d);
    reinterpret_cast<__half*>(ob)[1] = __float2half_rn(sum * d);
  }
}

#define NEG_INF (-__int_as_float(0x7f800000))

/// The block's largest (value, index) pair, ties by the lower index (NaN never wins), from each
/// thread's candidate: thread 0 ends with it. Every thread of the block (a multiple of 32, at most
/// 1024) calls this; sv/si are 32-entry shared scratch, free again once it returns to thread 0.
__device__ __forceinline__ void block_argmax(float& best, int& bi, float* sv, int* si) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int round = 0; round < 2; round++) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(FULL_MASK, best, o);
      const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
      if (ov > best || (ov == best && oi < bi)) {
        best = ov;
        bi = oi;
      }
    }
    if (round == 1) break;
    if (lane == 0) {
      sv[warp] = best;
      si[warp] = bi;
    }
    __syncthreads();
    const bool have = lane < (int)(blockDim.x / 32);
    best = have ? sv[lane] : NEG_INF;
    bi = have ? si[lane] : 0x7fffffff;
  }
}

// --- the quantized KV cache (src/kernels/cpu/attention/quant_cache.rs, rotate.rs) ---------------
// A cache row of K or V is kv_dim values in one of these types; a quantized row is ggml blocks
// (block_q8_0 / block_q4_0) of its values rotated by T = H·D/√32 per 32-value block, an f16 row
// the values as they are.
#define CACHE_F16 0
#define CACHE_Q8_0 1
#define CACHE_Q4_0 2

/// Bytes of n values (a multiple of 32 for the quantized types) of a cache type.
__device__ __forceinline__ int cache_bytes(int type, int n) {
  return type == CACHE_Q8_0 ? n / 32 * Q8_0_BYTES : type == CACHE_Q4_0 ? n / 32 * Q4_0_BYTES : 2 * n;
}

/// 1/√32 as Rust's `1.0f32 / 32f32.sqrt()` rounds it.
#define KV_ROT_SCALE __int_as_float(0x3e3504f3)

/// Whether value i of a 32-value run is negated by D (rotate.rs `negated`).
__device__ __forceinline__ bool kv_rot_negated(int i) { return ((uint32_t)i * 0x9E3779B9u) >> 31; }

/// The unnormalised Walsh–Hadamard transform of the warp's 32 values (lane i holding value i),
/// with exactly rotate.rs `fwht`'s additions. Called by all 32 lanes together.
__device__ __forceinline__ float fwht_warp(float x) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int h = 1; h < 32; h <<= 1) {
    const float o = __shfl_xor_sync(FULL_MASK, x, h);
    x = (lane & h) ? __fsub_rn(o, x) : __fadd_rn(x, o);
  }
  return x;
}

/// T·x for a 32-value block held one value a lane (rotate.rs `rotate`, bit for bit).
__device__ __forceinline__ float rotate_warp(float x) {
  const int lane = threadIdx.x % 32;
  return __fmul_rn(fwht_warp(kv_rot_negated(lane) ? -x : x), KV_ROT_SCALE);
}

/// Tᵀ·x for a 32-value block held one value a lane (rotate.rs `unrotate`).
__device__ __forceinline__ float unrotate_warp(float x) {
  const int lane = threadIdx.x % 32;
  return __fmul_rn(fwht_warp(x), kv_rot_negated(lane) ? -KV_ROT_SCALE : KV_ROT_SCALE);
}

/// The q8_0 rounding of a 32-value block held one value a lane (ggml's quantize_row_q8_0_ref:
/// d = amax / 127, q = roundf(v / d)): lane's q, and d through its f16 in `d_out`.
__device__ __forceinline__ int q8_0_round_warp(float v, float* d_out) {
  const float amax = warp_max(fabsf(v));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  *d_out = d;
  return (int)roundf(v * id);
}

/// One block_q8_0 (34 bytes at `ob`, 2-byte aligned) from a warp's 32 values.
__device__ __forceinline__ void q8_0_warp(float v, uint8_t* ob) {
  float d;
  const int q = q8_0_round_warp(v, &d);
  reinterpret_cast<int8_t*>(ob + 2)[threadIdx.x % 32] = (int8_t)q;
  if (threadIdx.x % 32 == 0) reinterpret_cast<__half*>(ob)[0] = __float2half_rn(d);
}

/// One block_q4_0 (18 bytes at `ob`) from a warp's 32 values, as ggml's quantize_row_q4_0_ref:
/// the first value of the largest magnitude (0 for an all-zero block) over -8 is d, and value i
/// is MIN(15, (int8_t)(v / d + 8.5f)), i and i + 16 sharing byte i (low and high nibble).
__device__ __forceinline__ void q4_0_warp(float v, uint8_t* ob) {
  const int lane = threadIdx.x % 32;
  float a = fabsf(v);
  int who = lane;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float oa = __shfl_xor_sync(FULL_MASK, a, o);
    const int ow = __shfl_xor_sync(FULL_MASK, who, o);
    if (oa > a || (oa == a && ow < who)) {
      a = oa;
      who = ow;
    }
  }
  const float mx0 = __shfl_sync(FULL_MASK, v, who);
  const float mx = a > 0.0f ? mx0 : 0.0f;  // ggml keeps max = 0 when no |v| exceeds 0
  const float d = mx / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  const int q = min(15, (int)__fadd_rn(__fmul_rn(v, id), 8.5f));
  const int hi = __shfl_sync(FULL_MASK, q, (lane + 16) & 31);
  if (lane < 16) ob[2 + lane] = (uint8_t)(q | (hi << 4));
  if (lane == 0) reinterpret_cast<__half*>(ob)[0] = __float2half_rn(d);
}

/// Block `blk` of a cache row (`row`: its first byte) from a warp's 32 values: rotated and
/// rounded to the row's quantized type, or as f16. Called by all 32 lanes together.
__device__ __forceinline__ void cache_store_warp(float v, int type, uint8_t* row, int blk) {
  if (type == CACHE_F16) {
    reinterpret_cast<__half*>(row)[blk * 32 + threadIdx.x % 32] = __float2half_rn(v);
  } else if (type == CACHE_Q8_0) {
    q8_0_warp(rotate_warp(v), row + blk * Q8_0_BYTES);
  } else {
    q4_0_warp(rotate_warp(v), row + blk * Q4_0_BYTES);
  }
}

/// Value d of a cache row (`row`: a head's first byte) as stored: an f16, or a quantized block's
/// value (still rotated).
__device__ __forceinline__ float cache_value(int type, const uint8_t* row, int d) {
  if (type == CACHE_F16) return __half2float(reinterpret_cast<const __half*>(row)[d]);
  const int b = d / 32, i = d % 32;
  if (type == CACHE_Q8_0) {
    const uint8_t* blk = row + b * Q8_0_BYTES;
    return load_half(blk) * (float)reinterpret_cast<const int8_t*>(blk + 2)[i];
  }
  const uint8_t* blk = row + b * Q4_0_BYTES;
  const int byte = blk[2 + (i & 15)];
  return load_half(blk) * (float)((i < 16 ? byte & 15 : byte >> 4) - 8);
}
