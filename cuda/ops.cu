// Element-wise and row-wise kernels: RMS norm, RoPE (normal and NEOX pairings, optional frequency
// factors), gated activations, residual and bias adds, scaling, row gathers/scatters, head copies,
// KV-cache writes into paged f16 blocks, argmax and top-k. Each follows the arithmetic of the CPU backend
// (src/kernels/cpu/ops.rs) where it can (RoPE angles by repeated multiplication with the same
// host-computed ratio, fused multiply-adds in the same places, GELU rounded through f16).
#include "common.cuh"

/// y = x / rms(x) * w over groups of n values; grid (n_groups), block (256). y may be x.
extern "C" __global__ void __launch_bounds__(256)
    rms_norm(const float* x, const float* __restrict__ w, float* y, int n, float eps) {
  PDL_ENTRY();
  __shared__ float scratch[32];
  const float* xr = x + (size_t)blockIdx.x * n;
  float* yr = y + (size_t)blockIdx.x * n;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = block_sum(ss, scratch);
  const float scale = 1.0f / sqrtf(ss / (float)n + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (xr[i] * scale) * w[i];
}
EMU_EXPORT(rms_norm)

/// Rotates every head of every row in place: one thread per rotated pair. theta_i =
/// pos * theta_scale^i by repeated multiplication (as ggml), divided by ff[i] when ff is given.
/// grid (ceil(rows * cols / 2 / 256)), block (256).
extern "C" __global__ void __launch_bounds__(256)
    rope(float* x, const int* __restrict__ pos, const float* __restrict__ ff, int rows, int cols,
         int head_dim, float theta_scale, int neox) {
  PDL_ENTRY();
  const int half = head_dim / 2, pairs_per_row = cols / 2;
  const long long p = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (p >= (long long)rows * pairs_per_row) return;
  const int row = (int)(p / pairs_per_row), r = (int)(p % pairs_per_row);
  const int head = r / half, i = r % half;
  float theta = (float)pos[row];
  for (int k = 0; k < i; k++) theta *= theta_scale;
  if (ff) theta = theta / ff[i];
  const float c = cosf(theta), s = sinf(theta);
  float* h = x + (size_t)row * cols + (size_t)head * head_dim;
  const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
  const float x0 = h[a], x1 = h[b];
  h[a] = fmaf(x0, c, -(x1 * s));
  h[b] = fmaf(x0, s, x1 * c);
}
EMU_EXPORT(rope)

__device__ __forceinline__ float gelu_tanh(float x) {
  const float inner = fmaf(0.044715f * x, x, 1.0f);
  return (0.5f * x) * (1.0f + tanhf(0.7978846f * x * inner));
}

/// act(g) for the gated activations: 0 = SiLU, 1 = GELU-tanh through f16 (ggml's table), 2 =
/// GELU-tanh in f32.
__device__ __forceinline__ float glu_act(float g, int act) {
  if (act == 0) return g / (1.0f + expf(-g));
  if (act == 1) {
    if (g <= -10.0f) return 0.0f;
    if (g >= 10.0f) return g;
    return __half2float(__float2half_rn(gelu_tanh(__half2float(__float2half_rn(g)))));
  }
  const float inner = 0.7978846f * (g + 0.044715f * g * g * g);
  return 0.5f * g * (1.0f + tanhf(inner));
}

/// gate = act(gate) * up over n values (`glu_act`). grid (ceil(n / 256)), block (256).
extern "C" __global__ void __launch_bounds__(256)
    glu(float* gate, const float* __restrict__ up, long long n, int act) {
  PDL_ENTRY();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  gate[i] = glu_act(gate[i], act) * up[i];
}
EMU_EXPORT(glu)

/// x += y over n values. grid (ceil(n / 256)), block (256).
extern "C" __global__ void add(float* x, const float* __restrict__ y, long long n) {
  PDL_ENTRY();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}
EMU_EXPORT(add)

/// x *= s over n values.
extern "C" __global__ void scale(float* x, float s, long long n) {
  PDL_ENTRY();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] *= s;
}
EMU_EXPORT(scale)

/// out[r][c] += bias[c] for rows × cols.
extern "C" __global__ void add_bias(float* out, const float* __restrict__ bias, int rows, int cols) {
  PDL_ENTRY();
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < (long long)rows * cols) out[i] += bias[i % cols];
}
EMU_EXPORT(add_bias)

/// x[rows[i]] += scales[i] * y[i]; grid (n), block (256). Distinct rows[i] are required only if
/// the caller wants a deterministic result (duplicate rows race).
extern "C" __global__ void add_rows_scaled(float* x, const float* __restrict__ y,
                                           const int* __restrict__ rows,
                                           const float* __restrict__ scales, int cols) {
  PDL_ENTRY();
  float* xr = x + (size_t)rows[blockIdx.x] * cols;
  const float* yr = y + (size_t)blockIdx.x * cols;
  const float s = scales[blockIdx.x];
  for (int c = threadIdx.x; c < cols; c += blockDim.x) xr[c] += s * yr[c];
}
EMU_EXPORT(add_rows_scaled)

/// out[i] = x[idx[i]], rows of `cols`; grid (n), block (256).
extern "C" __global__ void gather_rows(const float* __restrict__ x, const int* __restrict__ idx,
                                       float* __restrict__ out, int cols) {
  PDL_ENTRY();
  const float* xr = x + (size_t)idx[blockIdx.x] * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) out[(size_t)blockIdx.x * cols + c] = xr[c];
}
EMU_EXPORT(gather_rows)

/// model::backend::HeadCopy: grid (rows, dst_cols / dst_hd), block (128).
extern "C" __global__ void copy_heads(const float* __restrict__ src, float* __restrict__ dst,
                                      int src_cols, int dst_cols, int src_hd, int src_off,
                                      int dst_hd, int dst_off, int width) {
  PDL_ENTRY();
  const int row = blockIdx.x, h = blockIdx.y, src_heads = src_cols / src_hd;
  const float* s = src + (size_t)row * src_cols + (h % src_heads) * src_hd + src_off;
  float* d = dst + (size_t)row * dst_cols + h * dst_hd + dst_off;
  for (int c = threadIdx.x; c < width; c += blockDim.x) d[c] = s[c];
}
EMU_EXPORT(copy_heads)

/// Writes row i of k and v (f32, kv_dim wide) as f16 at cache slot slots[i] (block * block_size +
/// offset in the paged cache). grid (n), block (256).
extern "C" __global__ void kv_write(__half* __restrict__ kc, __half* __restrict__ vc,
                                    const float* __restrict__ k, const float* __restrict__ v,
                                    const int* __restrict__ slots, int kv_dim) {
  PDL_ENTRY();
  const size_t dst = (size_t)slots[blockIdx.x] * kv_dim, src = (size_t)blockIdx.x * kv_dim;
  for (int c = threadIdx.x; c < kv_dim; c += blockDim.x) {
    kc[dst + c] = __float2half_rn(k[src + c]);
    vc[dst + c] = __float2half_rn(v[src + c]);
  }
}
EMU_EXPORT(kv_write)

/// Rows of k and v (kv_dim f32 values each, kv_dim a multiple of 32) into a cache whose K and V
/// rows are of types k_type and v_type (CACHE_*; see cache_store_warp) at slots[r]. grid (rows),
/// block (128): a warp a 32-value block.
extern "C" __global__ void __launch_bounds__(128)
    kv_write_q(uint8_t* __restrict__ kc, uint8_t* __restrict__ vc, const float* __restrict__ k,
               const float* __restrict__ v, const int* __restrict__ slots, int kv_dim, int k_type,
               int v_type) {
  PDL_ENTRY();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nb = kv_dim / 32;
  const size_t slot = (size_t)slots[blockIdx.x], src = (size_t)blockIdx.x * kv_dim;
  for (int w = warp; w < 2 * nb; w += blockDim.x / 32) {  // warp-uniform
    const bool is_k = w < nb;
    const int b = is_k ? w : w - nb, type = is_k ? k_type : v_type;
    uint8_t* row = (is_k ? kc : vc) + slot * cache_bytes(type, kv_dim);
    cache_store_warp((is_k ? k : v)[src + b * 32 + lane], type, row, b);
  }
}
EMU_EXPORT(kv_write_q)

/// out[r] = the index of the largest value of row r (the lowest such index on ties; NaN is never
/// chosen over a number). grid (rows), block (256).
extern "C" __global__ void __launch_bounds__(256)
    argmax(const float* __restrict__ x, int* __restrict__ out, int cols) {
  PDL_ENTRY();
  __shared__ float sv[32];
  __shared__ int si[32];
  const float* xr = x + (size_t)blockIdx.x * cols;
  float best = NEG_INF;
  int bi = 0x7fffffff;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float v = xr[c];
    if (v > best) {
      best = v;
      bi = c;
    }
  }
  block_argmax(best, bi, sv, si);
  if (threadIdx.x == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
}
EMU_EXPORT(argmax)

/// The k largest values of each row with their indices, largest first, ties by the lower index
/// (the CPU sampler's order); NaN is never chosen, and a row with fewer than k numbers ends with
/// index -1. Round r takes the largest (value, -index) pair strictly below round r-1's pick, so
/// scratch stays O(1) for any k; k rounds read the row k times (from L2 for vocabulary rows).
/// grid (rows), block (256); out_idx and out_val are rows x k.
extern "C" __global__ void __launch_bounds__(256)
    top_k(const float* __restrict__ x, int* __restrict__ out_idx, float* __restrict__ out_val,
          int cols, int k) {
  PDL_ENTRY();
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ float picked_v;
  __shared__ int picked_i;
  const float* xr = x + (size_t)blockIdx.x * cols;
  float prev_v = -NEG_INF;
  int prev_i = -1;  // (INFINITY, -1): every number is below it
  for (int r = 0; r < k; r++) {
    float best = NEG_INF;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = xr[c];
      const bool below = v < prev_v || (v == prev_v && c > prev_i);
      if (below && (v > best || (v == best && c < bi))) {
        best = v;
        bi = c;
      }
    }
    block_argmax(best, bi, sv, si);
    if (threadIdx.x == 0) {
      const bool found = bi != 0x7fffffff;
      out_idx[(size_t)blockIdx.x * k + r] = found ? bi : -1;
      out_val[(size_t)blockIdx.x * k + r] = found ? best : NEG_INF;
      picked_v = best;
      picked_i = found ? bi : 0x7fffffff;
    }
    __syncthreads();
    prev_v = picked_v;
    prev_i = picked_i;
  }
}
EMU_EXPORT(top_k)
