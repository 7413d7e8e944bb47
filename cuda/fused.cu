// The decode step's work between the big matrix products, fused so that each stretch is one launch
// instead of three or four: the residual add (with Gemma's norm of the sublayer output) + the RMS
// norm + the q8_1 quantization the next GEMV reads; the per-head q/k norms + RoPE of q and k + q's
// scale + the KV-cache write (f16, or rotated ggml blocks for a quantized cache); the gated
// activation + q8_1, alone or in the gate/up GEMV's launch; and a sublayer's last GEMV with the
// residual join after it. Each computes what the unfused kernels of ops.cu and gemv.cu compute, in the
// same order where the result depends on it (the norm's block sum, the RoPE angles, the
// activation), so that the backend may take either path.
#include "common.cuh"

/// `block_sum` as a block of 256 threads takes it, in a block of 256 / V threads that each hold
/// the partial sums of V of those 256 (thread t those of t + j * blockDim.x, j < V): the same
/// butterflies within each of the 8 virtual warps, then the same one over their 8 sums, so the
/// result is bit for bit what 256 threads would get.
template <int V>
__device__ __forceinline__ float block_sum256(const float (&v)[V], float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  float s[V];
#pragma unroll
  for (int j = 0; j < V; j++) s[j] = warp_sum(v[j]);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < V; j++) scratch[warp + j * nwarps] = s[j];
  }
  __syncthreads();
  return warp_sum(lane < 8 ? scratch[lane] : 0.0f);
}

/// One row of `add_rms_norm_q8` (below) by a block of 256 / V threads, each doing the work of V
/// of the 256 (virtual thread t + j * blockDim.x, j < V), so every sum is taken in the 256-thread
/// order whatever the block's size. `yr` may be null (no residual add); `YP` lets a caller read
/// it through a volatile pointer (values other blocks of its launch just wrote). q8: the row's
/// q8_1 blocks, or null.
template <int V, typename YP>
__device__ __forceinline__ void add_rms_norm_row(float* xr, YP yr, const float* yw,
                                                 const float* w, float* o, uint8_t* q8, int n,
                                                 float eps, float* scratch) {
  if (yr) {
    float ys = 1.0f;
    if (yw) {
      float ss[V];
#pragma unroll
      for (int j = 0; j < V; j++) {
        ss[j] = 0.0f;
        for (int i = threadIdx.x + j * blockDim.x; i < n; i += 256) ss[j] += yr[i] * yr[i];
      }
      ys = 1.0f / sqrtf(block_sum256<V>(ss, scratch) / (float)n + eps);
    }
#pragma unroll
    for (int j = 0; j < V; j++) {
      for (int i = threadIdx.x + j * blockDim.x; i < n; i += 256) {
        const float y = yr[i];
        const float v = yw ? (y * ys) * yw[i] : y;
        xr[i] += v;  // each thread reads back only its own elements below
      }
    }
  }
  float ss[V];
#pragma unroll
  for (int j = 0; j < V; j++) {
    ss[j] = 0.0f;
    for (int i = threadIdx.x + j * blockDim.x; i < n; i += 256) ss[j] += xr[i] * xr[i];
  }
  const float scale = 1.0f / sqrtf(block_sum256<V>(ss, scratch) / (float)n + eps);
  // With n % 32 == 0 a warp's 32 consecutive elements are one q8_1 block, and the loop condition
  // is the same for all its lanes.
#pragma unroll
  for (int j = 0; j < V; j++) {
    for (int i = threadIdx.x + j * blockDim.x; i < n; i += 256) {
      const float v = (xr[i] * scale) * w[i];
      o[i] = v;
      if (q8) q8_1_warp(v, q8 + (i & ~31) / 32 * Q8_1_BYTES);
    }
  }
}

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
  const size_t r = blockIdx.x;
  add_rms_norm_row<1>(x + r * n, y ? y + r * n : nullptr, yw, w, out + r * n,
                      q8 ? q8 + r * n / 32 * Q8_1_BYTES : nullptr, n, eps, scratch);
}
EMU_EXPORT(add_rms_norm_q8)

/// One head of one row of the attention sublayer between the Q/K/V products and attention, by a
/// block of 128 threads: query head h (h < n_head) or KV head h - n_head of row r. A head is first RMS-normed when its norm weights (qn, kn: head_dim) are given, then
/// rotated as the `rope` kernel rotates it (theta_i = pos * theta_scale^i by repeated
/// multiplication, divided by ff[i] when given); a query head is then multiplied by q_scale and
/// written back to q, a KV head is written to kc at cache slot slots[r], and the matching head of
/// v to vc (k itself is not written), each in its cache type (k_type, v_type: CACHE_*; as f16, or
/// rotated and rounded to ggml blocks by cache_store_warp, head_dim then a multiple of 32).
/// head_dim is even and at most 256.
/// q, k and v are read through `P` (a volatile pointer when other blocks of the caller's launch
/// just wrote them); q is written back through `q_out` (the same rows). scratch (32 floats) and
/// kvh (2 × 256) are the block's shared memory. Every thread of the block calls it.
template <typename P>
__device__ __forceinline__ void rope_kv_head(
    int r, int h, P q_in, float* q, P k, P v, uint8_t* __restrict__ kc, uint8_t* __restrict__ vc,
    const int* __restrict__ slots, const int* __restrict__ pos, const float* __restrict__ ff,
    const float* __restrict__ qn, const float* __restrict__ kn, int n_head, int n_head_kv,
    int head_dim, float theta_scale, int neox, float q_scale, float eps, int k_type, int v_type,
    float* scratch, float (*kvh_buf)[256]) {
  const int half = head_dim / 2;
  const bool is_q = h < n_head;
  const int kvh = h - n_head, kv_dim = n_head_kv * head_dim;
  const P src = is_q ? q_in + ((size_t)r * n_head + h) * head_dim
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
      const P vr = v + (size_t)r * kv_dim + (size_t)kvh * head_dim;
      __half* kh = reinterpret_cast<__half*>(kc);
      __half* vh = reinterpret_cast<__half*>(vc);
      kh[base + a] = __float2half_rn(y0);
      kh[base + b] = __float2half_rn(y1);
      vh[base + a] = __float2half_rn(vr[a]);
      vh[base + b] = __float2half_rn(vr[b]);
    } else {
      const P vr = v + (size_t)r * kv_dim + (size_t)kvh * head_dim;
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

/// The attention sublayer between the Q/K/V products and attention, for `rows` rows: grid (rows,
/// n_head + n_head_kv), block (128); block (r, h) runs `rope_kv_head` for row r, head h.
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
  rope_kv_head<const float*>(blockIdx.x, blockIdx.y, q, q, k, v, kc, vc, slots, pos, ff, qn, kn,
                             n_head, n_head_kv, head_dim, theta_scale, neox, q_scale, eps, k_type,
                             v_type, scratch, kvh_buf);
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
    const int group = rb % nb / (32 / GEMV_ROWS);                                                  \
    int* count = done + (size_t)blockIdx.y * (ff / 32) + group;                                    \
    if (!last_to_arrive(count, 2 * (32 / GEMV_ROWS), &last)) return;                               \
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

/// A decode sublayer's output product and the residual join after it in one launch (what
/// `gemv_<type>` into y, then `add_rms_norm_q8(x, y, yw, w, out, q8)` compute, bit for bit):
/// blocks as `gemv_<type>`'s (4 rows of y = xq · Wᵀ each), each counting its arrival on its token
/// tile's counter done[blockIdx.y] (zero between launches) after a fence and the block's barrier;
/// the last of the tile's gridDim.x blocks to arrive runs `add_rms_norm_q8`'s row for each of the
/// tile's tokens (its 128 threads taking the sums as that kernel's 256 do) and sets the counter
/// back to zero. rows % 32 == 0 (no warp leaves early; the output rows are whole q8_1 blocks).
/// grid (rows / 4, ceil(tokens / 8)), block (128). Meant for one token: the last block then
/// normalises one row, what `add_rms_norm_q8` would do in a launch of its own.
#define GEMV_NORM(FN, name)                                                                        \
  extern "C" __global__ void __launch_bounds__(128)                                                \
      name(const uint8_t* xq, int cols, int nt, const uint8_t* w, float* y, int rows, float* x,    \
           const float* yw, const float* nw, float* out, uint8_t* q8, int* done, float eps) {      \
    PDL_ENTRY();                                                                                   \
    __shared__ int last;                                                                           \
    __shared__ float scratch[32];                                                                  \
    FN(w, xq, y, rows, cols, nt, nullptr, blockIdx.x);                                             \
    if (!last_to_arrive(done + blockIdx.y, (int)gridDim.x, &last)) return;                         \
    const int t0 = blockIdx.y * GEMV_TOKENS, ntt = min(GEMV_TOKENS, nt - t0);                      \
    for (int t = t0; t < t0 + ntt; t++) {                                                          \
      const size_t r = (size_t)t * rows;                                                           \
      const volatile float* yr = y + r;                                                            \
      add_rms_norm_row<2>(x + r, yr, yw, nw, out + r, q8 + r / 32 * Q8_1_BYTES, rows, eps,         \
                          scratch);                                                                \
    }                                                                                              \
    if (threadIdx.x == 0) done[blockIdx.y] = 0;                                                    \
  }                                                                                                \
  EMU_EXPORT(name)
GEMV_NORM(gemv_q<Q4_0>, gemv_norm_q4_0)
GEMV_NORM(gemv_q<Q5_0>, gemv_norm_q5_0)
GEMV_NORM(gemv_q<Q8_0>, gemv_norm_q8_0)
GEMV_NORM(gemv_q4k, gemv_norm_q4_k)
GEMV_NORM(gemv_q6k, gemv_norm_q6_k)

/// A decode step's Q/K/V products (with their biases) and `rope_kv` in one launch (what the
/// products' GEMVs then `rope_kv` compute, bit for bit): blocks as the products' (4 rows of one
/// matrix each, Q's then K's then V's, each by the GEMV of its type), each counting its arrival
/// on its head's counter in `done` ((n_head + n_head_kv) a token tile, zero between launches; a
/// KV head's counter takes its K and its V blocks) after a fence and the block's barrier; the
/// last block of a head runs `rope_kv_head` for it on each of the tile's tokens and sets the
/// counter back to zero. head_dim % 4 == 0 (a block's rows are one head's), so no warp leaves
/// early. grid ((n_head + 2 n_head_kv) · head_dim / 4, ceil(tokens / 8)), block (128).
#define GEMV_QKV(FQ, FK, FV, name)                                                                 \
  extern "C" __global__ void __launch_bounds__(128)                                                \
      name(const uint8_t* xq, int cols, int nt, const uint8_t* wq, const float* bq,                \
           const uint8_t* wk, const float* bk, const uint8_t* wv, const float* bv, float* q,       \
           float* k, float* v, int* done, uint8_t* kc, uint8_t* vc, const int* slots,              \
           const int* pos, const float* ff, const float* qn, const float* kn, int n_head,          \
           int n_head_kv, int head_dim, float theta_scale, int neox, float q_scale, float eps,     \
           int k_type, int v_type) {                                                               \
    PDL_ENTRY();                                                                                   \
    __shared__ int last;                                                                           \
    __shared__ float scratch[32];                                                                  \
    __shared__ float kvh_buf[2][256];                                                              \
    const int hb = head_dim / GEMV_ROWS, nq = n_head * hb, nk = n_head_kv * hb;                    \
    const int rb = blockIdx.x, kv_dim = n_head_kv * head_dim;                                      \
    int head;                                                                                      \
    if (rb < nq) {                                                                                 \
      FQ(wq, xq, q, n_head * head_dim, cols, nt, bq, rb);                                          \
      head = rb / hb;                                                                              \
    } else if (rb < nq + nk) {                                                                     \
      FK(wk, xq, k, kv_dim, cols, nt, bk, rb - nq);                                                \
      head = n_head + (rb - nq) / hb;                                                              \
    } else {                                                                                       \
      FV(wv, xq, v, kv_dim, cols, nt, bv, rb - nq - nk);                                           \
      head = n_head + (rb - nq - nk) / hb;                                                         \
    }                                                                                              \
    int* count = done + (size_t)blockIdx.y * (n_head + n_head_kv) + head;                          \
    if (!last_to_arrive(count, head < n_head ? hb : 2 * hb, &last)) return; /* a KV head: K, V */  \
    const int t0 = blockIdx.y * GEMV_TOKENS, ntt = min(GEMV_TOKENS, nt - t0);                      \
    const volatile float *qv = q, *kv = k, *vv = v;                                                \
    for (int t = t0; t < t0 + ntt; t++) {                                                          \
      rope_kv_head<const volatile float*>(t, head, qv, q, kv, vv, kc, vc, slots, pos, ff, qn, kn,  \
                                          n_head, n_head_kv, head_dim, theta_scale, neox,          \
                                          q_scale, eps, k_type, v_type, scratch, kvh_buf);         \
      __syncthreads(); /* shared memory is reused by the next token */                             \
    }                                                                                              \
    if (threadIdx.x == 0) *count = 0;                                                              \
  }                                                                                                \
  EMU_EXPORT(name)
GEMV_QKV(gemv_q<Q4_0>, gemv_q<Q4_0>, gemv_q<Q4_0>, gemv_qkv_q4_0)
GEMV_QKV(gemv_q<Q5_0>, gemv_q<Q5_0>, gemv_q<Q5_0>, gemv_qkv_q5_0)
GEMV_QKV(gemv_q<Q8_0>, gemv_q<Q8_0>, gemv_q<Q8_0>, gemv_qkv_q8_0)
GEMV_QKV(gemv_q4k, gemv_q4k, gemv_q4k, gemv_qkv_q4_k)
GEMV_QKV(gemv_q6k, gemv_q6k, gemv_q6k, gemv_qkv_q6_k)
// Q4_K_M files: Q and K in Q4_K, V in Q6_K in some layers (Qwen2.5-1.5B: 14 of 28); or Q and K
// in Q5_0, V in Q8_0 (Gemma-3-270M: 9 of 18).
GEMV_QKV(gemv_q4k, gemv_q4k, gemv_q6k, gemv_qkv_q4_k_v_q6_k)
GEMV_QKV(gemv_q<Q5_0>, gemv_q<Q5_0>, gemv_q<Q8_0>, gemv_qkv_q5_0_v_q8_0)
