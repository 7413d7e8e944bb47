// The decode step's work between the big matrix products, fused so that each stretch is one launch
// instead of three or four: the residual add (with Gemma's norm of the sublayer output) + the RMS
// norm + the q8_1 quantization the next GEMV reads; the per-head q/k norms + RoPE of q and k + q's
// scale + the KV-cache write (f16, or rotated ggml blocks for a quantized cache); and the gated
// activation + q8_1. Each computes what the unfused kernels of ops.cu and gemv.cu compute, in the
// same order where the result depends on it (the norm's block sum, the RoPE angles, the
// activation), so that the backend may take either path.
#include "common.cuh"

/// Per row (grid (rows), block (256)), with n values a row:
///   y' = yw ? y / rms(y) * yw : y      (only when y is given; y itself is not written)
///   x += y'                            (only when y is given)
///   out = x / rms(x) * w
///   q8 = q8_1(out)                     (only when q8 is given; then n % 32 == 0)
/// The sums of squares are taken as rms_norm's (`block_sum` over 256 threads, thread i summing
/// elements i, i + 256, ...), so out equals rms_norm(x + y') bit for bit. out may not alias x or y.
extern "C" __global__ void __launch_bounds__(256)
    add_rms_norm_q8(float* x, const float* __restrict__ y, const float* __restrict__ yw,
                    const float* __restrict__ w, float* __restrict__ out,
                    uint8_t* __restrict__ q8, int n, float eps) {
  PDL_ENTRY();
  __shared__ float scratch[32];
  float* xr = x + (size_t)blockIdx.x * n;
  float* o = out + (size_t)blockIdx.x * n;
  if (y) {
    const float* yr = y + (size_t)blockIdx.x * n;
    float ys = 1.0f;
    if (yw) {
      float ss = 0.0f;
      for (int i = threadIdx.x; i < n; i += blockDim.x) ss += yr[i] * yr[i];
      ss = block_sum(ss, scratch);
      ys = 1.0f / sqrtf(ss / (float)n + eps);
    }
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const float v = yw ? (yr[i] * ys) * yw[i] : yr[i];
      xr[i] += v;  // each thread reads back only its own elements below
    }
  }
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / (float)n + eps);
  // With n % 32 == 0 a warp's 32 consecutive elements are one q8_1 block, and the loop condition
  // is the same for all its lanes.
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = (xr[i] * scale) * w[i];
    o[i] = v;
    if (q8) q8_1_warp(v, q8 + ((size_t)blockIdx.x * n + (i & ~31)) / 32 * Q8_1_BYTES);
  }
}
EMU_EXPORT(add_rms_norm_q8)

/// The attention sublayer between the Q/K/V products and attention, for `rows` rows: grid (rows,
/// n_head + n_head_kv), block (128); block (r, h) takes query head h (h < n_head) or KV head
/// h - n_head. A head is first RMS-normed when its norm weights (qn, kn: head_dim) are given, then
/// rotated as the `rope` kernel rotates it (theta_i = pos * theta_scale^i by repeated
/// multiplication, divided by ff[i] when given); a query head is then multiplied by q_scale and
/// written back to q, a KV head is written to kc at cache slot slots[r], and the matching head of
/// v to vc (k itself is not written), each in its cache type (k_type, v_type: CACHE_*; as f16, or
/// rotated and rounded to ggml blocks by cache_store_warp, head_dim then a multiple of 32).
/// head_dim is even and at most 256.
extern "C" __global__ void __launch_bounds__(128)
    rope_kv(float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
            uint8_t* __restrict__ kc, uint8_t* __restrict__ vc, const int* __restrict__ slots,
            const int* __restrict__ pos, const float* __restrict__ ff,
            const float* __restrict__ qn, const float* __restrict__ kn, int n_head, int n_head_kv,
            int head_dim, float theta_scale, int neox, float q_scale, float eps, int k_type,
            int v_type) {
  PDL_ENTRY();
  __shared__ float scratch[32];
  __shared__ float kvh_buf[2][256];  // a quantized cache's K and V head, before its blocks
  const int r = blockIdx.x, h = blockIdx.y, half = head_dim / 2;
  const bool is_q = h < n_head;
  const int kvh = h - n_head, kv_dim = n_head_kv * head_dim;
  const float* src = is_q ? q + ((size_t)r * n_head + h) * head_dim
                          : k + (size_t)r * kv_dim + (size_t)kvh * head_dim;
  const float* nw = is_q ? qn : kn;
  // Each thread holds up to two pairs (head_dim <= 256 with 128 threads).
  float x0[2] = {0.0f, 0.0f}, x1[2] = {0.0f, 0.0f};
  float ss = 0.0f;
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i < half) {
      const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
      x0[j] = src[a];
      x1[j] = src[b];
      ss += x0[j] * x0[j] + x1[j] * x1[j];
    }
  }
  float nscale = 1.0f;
  if (nw) {
    ss = block_sum(ss, scratch);
    nscale = 1.0f / sqrtf(ss / (float)head_dim + eps);
  }
  const float p = (float)pos[r];
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const int i = threadIdx.x + j * blockDim.x;
    if (i >= half) continue;
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    float u0 = x0[j], u1 = x1[j];
    if (nw) {
      u0 = (u0 * nscale) * nw[a];
      u1 = (u1 * nscale) * nw[b];
    }
    float theta = p;
    for (int t = 0; t < i; t++) theta *= theta_scale;
    if (ff) theta = theta / ff[i];
    const float c = cosf(theta), s = sinf(theta);
    const float y0 = fmaf(u0, c, -(u1 * s)), y1 = fmaf(u0, s, u1 * c);
    if (is_q) {
      float* d = q + ((size_t)r * n_head + h) * head_dim;
      d[a] = y0 * q_scale;
      d[b] = y1 * q_scale;
    } else if (k_type == CACHE_F16 && v_type == CACHE_F16) {
      const size_t base = (size_t)slots[r] * kv_dim + (size_t)kvh * head_dim;
      const float* vr = v + (size_t)r * kv_dim + (size_t)kvh * head_dim;
      __half* kh = reinterpret_cast<__half*>(kc);
      __half* vh = reinterpret_cast<__half*>(vc);
      kh[base + a] = __float2half_rn(y0);
      kh[base + b] = __float2half_rn(y1);
      vh[base + a] = __float2half_rn(vr[a]);
      vh[base + b] = __float2half_rn(vr[b]);
    } else {
      const float* vr = v + (size_t)r * kv_dim + (size_t)kvh * head_dim;
      kvh_buf[0][a] = y0;
      kvh_buf[0][b] = y1;
      kvh_buf[1][a] = vr[a];
      kvh_buf[1][b] = vr[b];
    }
  }
  if (is_q || (k_type == CACHE_F16 && v_type == CACHE_F16)) return;  // block-uniform
  // A quantized cache: warp w takes the head's 32-value blocks w, w + 4, ... of K, then of V.
  __syncthreads();
  const int lane = threadIdx.x % 32, nb = head_dim / 32;
  for (int w = threadIdx.x / 32; w < 2 * nb; w += blockDim.x / 32) {  // warp-uniform
    const int side = w < nb ? 0 : 1, blk = w % nb, type = side ? v_type : k_type;
    uint8_t* row = (side ? vc : kc) + (size_t)slots[r] * cache_bytes(type, kv_dim) +
                   (size_t)cache_bytes(type, kvh * head_dim);
    cache_store_warp(kvh_buf[side][blk * 32 + lane], type, row, blk);
  }
}
EMU_EXPORT(rope_kv)

/// gate = act(gate) * up (ops.cu's `glu`) and its q8_1 blocks into q8: grid (ceil(n / 128)),
/// block (128); n % 32 == 0.
extern "C" __global__ void __launch_bounds__(128)
    glu_q8(float* gate, const float* __restrict__ up, uint8_t* __restrict__ q8, long long n,
           int act) {
  PDL_ENTRY();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;  // whole warps: n % 32 == 0
  const float y = glu_act(gate[i], act) * up[i];
  gate[i] = y;
  q8_1_warp(y, q8 + (size_t)(i / 32) * Q8_1_BYTES);
}
EMU_EXPORT(glu_q8)

/// A decode FFN's gate‖up GEMV and its GLU in one launch (what `gemv_multi` of gate and up, then
/// `glu_q8`, compute, bit for bit): blocks [0, ff / 4) take 4 gate rows each and blocks
/// [ff / 4, ff / 2) the same 4 rows of up, as `gemv_multi` does (ff % 32 == 0, so no warp leaves
/// early). The 16 blocks holding a 32-column group's gate and up values count their arrivals on the
/// group's counter in `done` ((ff / 32) a token tile, zero between launches); the last to arrive
/// computes gate = act(gate) * up for those columns of each token and their q8_1 blocks into `q8`
/// (`glu_q8`'s arithmetic), then sets the counter back to zero. The usual last-block pattern: each
/// writer fences before the barrier that precedes the count, and the last block fences before it
/// reads the others' values. grid (ff / 2, ceil(tokens / 8)), block (128). q8 may not alias xq.
#define GEMV_GLU(FN, name)                                                                         \
  extern "C" __global__ void __launch_bounds__(128)                                                \
      name(const uint8_t* xq, int cols, int nt, const uint8_t* wg, float* gate,                    \
           const uint8_t* wu, float* up, int ff, uint8_t* q8, int* done, int act) {                \
    PDL_ENTRY();                                                                                   \
    __shared__ int last;                                                                           \
    const int nb = ff / GEMV_ROWS, rb = blockIdx.x;                                                \
    if (rb < nb) {                                                                                 \
      FN(wg, xq, gate, ff, cols, nt, nullptr, rb);                                                 \
    } else {                                                                                       \
      FN(wu, xq, up, ff, cols, nt, nullptr, rb - nb);                                              \
    }                                                                                              \
    __threadfence();                                                                               \
    __syncthreads();                                                                               \
    const int group = rb % nb / (32 / GEMV_ROWS);                                                  \
    int* count = done + (size_t)blockIdx.y * (ff / 32) + group;                                    \
    if (threadIdx.x == 0) last = atomicAdd(count, 1) == 2 * (32 / GEMV_ROWS) - 1;                  \
    __syncthreads();                                                                               \
    if (!last) return;                                                                             \
    __threadfence();                                                                               \
    const int t0 = blockIdx.y * GEMV_TOKENS, ntt = min(GEMV_TOKENS, nt - t0);                      \
    const volatile float* g = gate;                                                                \
    const volatile float* u = up;                                                                  \
    for (int t = threadIdx.x / 32; t < ntt; t += 4) {                                              \
      const size_t i = (size_t)(t0 + t) * ff + group * 32 + threadIdx.x % 32;                      \
      const float y = glu_act(g[i], act) * u[i];                                                   \
      gate[i] = y;                                                                                 \
      q8_1_warp(y, q8 + i / 32 * Q8_1_BYTES);                                                      \
    }                                                                                              \
    if (threadIdx.x == 0) *count = 0;                                                              \
  }                                                                                                \
  EMU_EXPORT(name)
GEMV_GLU(gemv_q<Q4_0>, gemv_glu_q4_0)
GEMV_GLU(gemv_q<Q5_0>, gemv_glu_q5_0)
GEMV_GLU(gemv_q<Q8_0>, gemv_glu_q8_0)
GEMV_GLU(gemv_q4k, gemv_glu_q4_k)
GEMV_GLU(gemv_q6k, gemv_glu_q6_k)
