// CPU emulation of the CUDA subset that infer's kernels use, so the very same .cu sources run on
// the host in tests (compiled with -DINFER_CUDA_EMU by tests/common/cuda_emu.rs, never shipped).
//
// Model: a launch runs its blocks one after another on the calling OS thread. A block's threads are
// fibers (ucontext) that run until they finish or reach a synchronisation point:
//  - __syncthreads(): the fiber waits at a barrier; when every live thread of the block waits at the
//    same source line, all are released. Threads waiting at different lines, or some threads exited
//    while others wait, is a barrier mismatch (reported with file:line, the launch fails).
//  - warp shuffles / ballot / any / all: the lane writes its value into the warp's exchange buffer and
//    waits; when all 32 lanes (or the live lanes named by the mask) wait at the same line, the results
//    are computed for every lane at once. Lanes at different lines, or at a barrier, is a divergent
//    shuffle (reported with file:line).
// __shared__ variables are `static thread_local` (one copy per OS thread, i.e. per running block);
// dynamic shared memory comes from DYN_SHARED. Atomics use std::atomic_ref. __half is a 16-bit host
// type with round-to-nearest-even conversion. Only what infer's kernels use is provided.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static thread_local

namespace emu {

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

/// Fiber state, read by the macros below.
struct ThreadCtx {
  dim3 tid;
  unsigned lane = 0, warp = 0;
};

extern thread_local ThreadCtx* cur_thread;
extern thread_local dim3 cur_block, cur_grid_dim, cur_block_dim;
extern thread_local unsigned char* cur_dyn_smem;

void syncthreads(const char* file, int line);
/// Deposits `v` (8 bytes) and waits for the warp; returns the value of lane `src_of(lane)`.
enum class ShflKind { Xor, Idx, Down, Up };
uint64_t shfl(unsigned mask, uint64_t v, int arg, ShflKind kind, const char* file, int line);
unsigned ballot(unsigned mask, bool pred, const char* file, int line);

/// One 16-bit float (IEEE binary16), converted with round-to-nearest-even.
struct half_t {
  uint16_t bits = 0;
};
half_t f2h(float f);
float h2f(half_t h);

template <typename T>
inline T shfl_t(unsigned mask, T v, int arg, ShflKind kind, const char* file, int line) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = shfl(mask, bits, arg, kind, file, line);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

/// The registry of kernels callable by name (the emulator's cuModuleGetFunction).
using Invoke = void (*)(void** args);
struct Registrar {
  Registrar(const char* name, Invoke f);
};

template <auto F>
struct Invoker;
template <typename... A, void (*F)(A...)>
struct Invoker<F> {
  template <size_t... I>
  static void call_impl(void** a, std::index_sequence<I...>) {
    F(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(a[I])...);
  }
  static void call(void** a) { call_impl(a, std::index_sequence_for<A...>{}); }
};

}  // namespace emu

using dim3 = emu::dim3;
using __half = emu::half_t;
struct __half2 {
  __half x, y;
};

#define threadIdx (emu::cur_thread->tid)
#define blockIdx (emu::cur_block)
#define blockDim (emu::cur_block_dim)
#define gridDim (emu::cur_grid_dim)
#define warpSize 32

#define __syncthreads() emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ((void)emu::ballot(0xffffffffu, false, __FILE__, __LINE__))
#define __shfl_xor_sync(mask, v, arg) \
  emu::shfl_t((mask), (v), (arg), emu::ShflKind::Xor, __FILE__, __LINE__)
#define __shfl_sync(mask, v, arg) \
  emu::shfl_t((mask), (v), (arg), emu::ShflKind::Idx, __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, arg) \
  emu::shfl_t((mask), (v), (arg), emu::ShflKind::Down, __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, arg) \
  emu::shfl_t((mask), (v), (arg), emu::ShflKind::Up, __FILE__, __LINE__)
#define __ballot_sync(mask, pred) emu::ballot((mask), (pred), __FILE__, __LINE__)
#define __any_sync(mask, pred) (emu::ballot((mask), (pred), __FILE__, __LINE__) != 0u)
#define __all_sync(mask, pred) (emu::ballot((mask), (pred), __FILE__, __LINE__) == ((mask) & emu_live_mask()))

/// Dynamic shared memory: `DYN_SHARED(float, buf)` declares `float* buf` (CUDA: extern __shared__).
#define DYN_SHARED(T, name) T* name = reinterpret_cast<T*>(emu::cur_dyn_smem)

/// Registers an extern "C" kernel under its own name (CUDA build: nothing).
#define EMU_EXPORT(name) static emu::Registrar emu_reg_##name(#name, &emu::Invoker<&name>::call);

unsigned emu_live_mask();

inline __half __float2half(float f) { return emu::f2h(f); }
inline __half __float2half_rn(float f) { return emu::f2h(f); }
inline float __half2float(__half h) { return emu::h2f(h); }
inline __half2 __floats2half2_rn(float a, float b) { return {emu::f2h(a), emu::f2h(b)}; }
inline float __low2float(__half2 h) { return emu::h2f(h.x); }
inline float __high2float(__half2 h) { return emu::h2f(h.y); }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline int __float2int_rn(float x) { return (int)std::nearbyint(x); }
// Explicitly rounded arithmetic (never contracted into a fused multiply-add on the GPU; the host
// build targets SSE2 without FMA, so plain operators round the same).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
using std::fabs;
using std::max;
using std::min;

// Blocks run one after another: a fence orders nothing more than program order already does.
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
inline int atomicAdd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return std::atomic_ref<unsigned>(*p).fetch_add(v);
}
inline int atomicMax(int* p, int v) {
  std::atomic_ref<int> a(*p);
  int old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
