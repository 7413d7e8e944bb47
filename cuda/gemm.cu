// Prefill matmul on the integer tensor cores: out[t][r] = sum over 32-value sub-blocks of
// (weight sub-block · q8_1 activation block), for many tokens at once. The weight sub-blocks are
// unpacked to signed bytes by the very `Sub` loaders of the GEMV (gemv.cu, on each type's device
// rows: Q6_K's repacked at upload), so the int8 quants and scales are the same; only the dot
// products move from `dp4a` to `mma_s8_16816` (common.cuh).
//
// Tiling: a CTA of 4 warps (block of 128) takes GEMM_M weight rows × GEMM_N tokens; every
// GEMM_KS sub-blocks it stages the unpacked weight bytes (with each sub-block's scales) and the
// q8_1 activation bytes (with d, and s where a min needs it) in shared memory, then each warp
// multiplies its 32 × 32 quarter: per sub-block and per 16-value half, 2 × 4 m16n8k16 tiles. The
// int32 results of one sub-block are scaled into f32 accumulators as the GEMV does:
// d_x * (s0 * dot(k < 16) + s1 * dot(k >= 16)) - mn * s_x. Only Q6_K has two scales per sub-block
// (then each half keeps its own int32 tile); only Q4_K has a min. Rows past `rows` and tokens past
// `ntok` are staged as zeros and never stored; `cols` is a multiple of the type's block (so of
// 32). Launch: block (128), grid (ceil(rows / GEMM_M), ceil(ntok / GEMM_N)).
#include "common.cuh"

#define GEMM_M 64  // weight rows per CTA
#define GEMM_N 64  // tokens per CTA
#define GEMM_KS 4  // 32-value sub-blocks staged per step
// ints per staged row: 8 per sub-block, plus 4 of padding so that the fragment loads (8 rows × 4
// consecutive ints per warp) fall in 32 different banks
#define GEMM_LD (GEMM_KS * 8 + 4)

/// Which scale terms a weight type's `Sub` uses.
template <typename T>
struct GemmTerms {
  static constexpr bool HALVES = false;  // s0 != s1 (a scale per 16 values)
  static constexpr bool MIN = false;     // mn != 0
};
template <>
struct GemmTerms<Q6_K> {
  static constexpr bool HALVES = true, MIN = false;
};
template <>
struct GemmTerms<Q4_K> {
  static constexpr bool HALVES = false, MIN = true;
};

template <typename T>
__device__ __forceinline__ void gemm_q(const uint8_t* __restrict__ w, const uint8_t* __restrict__ xq,
                                       float* __restrict__ out, int rows, int cols, int ntok) {
  constexpr bool HALVES = GemmTerms<T>::HALVES, MIN = GemmTerms<T>::MIN;
  __shared__ int sw[GEMM_M * GEMM_LD];  // weight bytes, row-major (k contiguous)
  __shared__ int sx[GEMM_N * GEMM_LD];  // activation bytes, token-major (k contiguous)
  __shared__ float ws0[GEMM_KS * GEMM_M], ws1[HALVES ? GEMM_KS * GEMM_M : 1],
      wmn[MIN ? GEMM_KS * GEMM_M : 1];   // [sub][row]
  __shared__ float xd[GEMM_KS * GEMM_N], xs[MIN ? GEMM_KS * GEMM_N : 1];  // [sub][token]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane >> 2, t4 = lane & 3;
  const int wm = (warp & 1) * 32, wn = (warp >> 1) * 32;  // this warp's quarter of the tile
  const int r0 = blockIdx.x * GEMM_M, t0 = blockIdx.y * GEMM_N;
  const int nsub = cols / 32;
  const size_t row_bytes = T::row_bytes(cols);

  float acc[2][4][4];  // [m tile][n tile][fragment element]
#pragma unroll
  for (int m = 0; m < 2; m++)
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
      for (int i = 0; i < 4; i++) acc[m][n][i] = 0.0f;

  for (int s0 = 0; s0 < nsub; s0 += GEMM_KS) {
    const int ks = min(GEMM_KS, nsub - s0);
    // Stage: item i is (row or token i / GEMM_KS, sub-block i % GEMM_KS), so neighbouring threads
    // read neighbouring sub-blocks of one row. Sub-blocks past the last are not staged (nor read
    // below); rows and tokens past the end are zeros.
    for (int i = tid; i < GEMM_M * GEMM_KS; i += blockDim.x) {
      const int r = i / GEMM_KS, k = i % GEMM_KS;
      if (k >= ks) continue;
      Sub u;
      if (r0 + r < rows) {
        const int s = s0 + k;
        T::load_sub(w + (size_t)(r0 + r) * row_bytes, cols, s, u);
      } else {
#pragma unroll
        for (int j = 0; j < 8; j++) u.q[j] = 0;
        u.s0 = u.s1 = u.mn = 0.0f;
      }
      int* dst = sw + r * GEMM_LD + k * 8;
#pragma unroll
      for (int j = 0; j < 8; j++) dst[j] = u.q[j];
      ws0[k * GEMM_M + r] = u.s0;
      if constexpr (HALVES) ws1[k * GEMM_M + r] = u.s1;
      if constexpr (MIN) wmn[k * GEMM_M + r] = u.mn;
    }
    for (int i = tid; i < GEMM_N * GEMM_KS; i += blockDim.x) {
      const int t = i / GEMM_KS, k = i % GEMM_KS;
      if (k >= ks) continue;
      int* dst = sx + t * GEMM_LD + k * 8;
      if (t0 + t < ntok) {
        const uint8_t* xb = xq + ((size_t)(t0 + t) * nsub + s0 + k) * Q8_1_BYTES;
#pragma unroll
        for (int j = 0; j < 8; j++) dst[j] = load_i32_a4(xb + 4 + 4 * j);
        xd[k * GEMM_N + t] = load_half(xb);
        if constexpr (MIN) xs[k * GEMM_N + t] = load_half(xb + 2);
      } else {
#pragma unroll
        for (int j = 0; j < 8; j++) dst[j] = 0;
        xd[k * GEMM_N + t] = 0.0f;
        if constexpr (MIN) xs[k * GEMM_N + t] = 0.0f;
      }
    }
    __syncthreads();

    for (int k = 0; k < ks; k++) {
      // Fragments of both 16-value halves: A rows wm + 16m + g (+8), B tokens wn + 8n + g.
      int a[2][2][2], b[2][4];  // a[half][m tile][reg], b[half][n tile]
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int kk = k * 8 + h * 4 + t4;
#pragma unroll
        for (int m = 0; m < 2; m++) {
          a[h][m][0] = sw[(wm + 16 * m + g) * GEMM_LD + kk];
          a[h][m][1] = sw[(wm + 16 * m + g + 8) * GEMM_LD + kk];
        }
#pragma unroll
        for (int n = 0; n < 4; n++) b[h][n] = sx[(wn + 8 * n + g) * GEMM_LD + kk];
      }
      // This thread's rows wm + 16m + g + 8j and tokens wn + 8n + 2 * t4 + j (j = 0, 1).
      float rs0[2][2], rs1[2][2], rmn[2][2], cd[4][2], cs[4][2];
#pragma unroll
      for (int m = 0; m < 2; m++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
          const int r = k * GEMM_M + wm + 16 * m + g + 8 * j;
          rs0[m][j] = ws0[r];
          rs1[m][j] = rmn[m][j] = 0.0f;
          if constexpr (HALVES) rs1[m][j] = ws1[r];
          if constexpr (MIN) rmn[m][j] = wmn[r];
        }
#pragma unroll
      for (int n = 0; n < 4; n++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
          const int t = k * GEMM_N + wn + 8 * n + 2 * t4 + j;
          cd[n][j] = xd[t];
          cs[n][j] = 0.0f;
          if constexpr (MIN) cs[n][j] = xs[t];
        }
#pragma unroll
      for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < 4; n++) {
          int c0[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0};
          mma_s8_16816(c0, a[0][m][0], a[0][m][1], b[0][n]);
          if constexpr (HALVES) {
            mma_s8_16816(c1, a[1][m][0], a[1][m][1], b[1][n]);
          } else {
            mma_s8_16816(c0, a[1][m][0], a[1][m][1], b[1][n]);  // one scale: sum both halves
          }
#pragma unroll
          for (int i = 0; i < 4; i++) {
            const int j = i >> 1, jt = i & 1;
            float v = HALVES ? rs0[m][j] * (float)c0[i] + rs1[m][j] * (float)c1[i]
                             : rs0[m][j] * (float)c0[i];
            acc[m][n][i] += cd[n][jt] * v;
            if constexpr (MIN) acc[m][n][i] -= rmn[m][j] * cs[n][jt];
          }
        }
    }
    __syncthreads();  // the next step overwrites the staged tiles
  }

#pragma unroll
  for (int m = 0; m < 2; m++)
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
      for (int i = 0; i < 4; i++) {
        const int r = r0 + wm + 16 * m + g + 8 * (i >> 1);
        const int t = t0 + wn + 8 * n + 2 * t4 + (i & 1);
        if (r < rows && t < ntok) out[(size_t)t * rows + r] = acc[m][n][i];
      }
}

#define GEMM_Q(T, name)                                                                            \
  extern "C" __global__ void __launch_bounds__(128) name(const uint8_t* w, const uint8_t* xq,     \
                                                         float* out, int rows, int cols, int nt) { \
    PDL_ENTRY();                                                                                   \
    gemm_q<T>(w, xq, out, rows, cols, nt);                                                         \
  }                                                                                                \
  EMU_EXPORT(name)
GEMM_Q(Q4_0, gemm_q4_0)
GEMM_Q(Q5_0, gemm_q5_0)
GEMM_Q(Q8_0, gemm_q8_0)
GEMM_Q(Q4_K, gemm_q4_k)
GEMM_Q(Q6_K, gemm_q6_k)
