// Decode-path matmul straight from the quantized weights: activations are quantized once to q8_1
// (`quantize_q8_1`), then one warp per output row walks the row's 32-value sub-blocks (lane i takes
// sub-blocks i, i+32, ...: neighbouring lanes read neighbouring bytes), unpacks each sub-block's
// quants to signed bytes once and takes `dp4a` dot products with up to 8 activation rows (tokens)
// at a time, so a prefill of n tokens reads the weights n/8 times. A non-null `bias` is added to
// each output (bias[row]) as the result is stored, saving an add_bias launch. Also the row dequantizers used
// for embedding lookups. Launch: block (128) = 4 warps = 4 output rows; grid (ceil(rows/4),
// ceil(tokens/8)). Every weight row starts at a multiple of its block size (2-byte aligned), except
// Q6_K's, which are repacked at upload (`Q6_K` below, src/kernels/cuda/repack.rs). Q4_K, the bulk
// of a Q4_K_M file, and Q6_K have their own kernels with 128-bit loads (`gemv_q4_k`: its 144-byte
// blocks stay 16-byte aligned; `gemv_q6_k`: on the repacked rows).
#include "common.cuh"

/// One 32-value sub-block unpacked: value k = (k < 16 ? s0 : s1) * q_k - mn, with q_k the k-th
/// signed byte of q (little-endian within each int).
struct Sub {
  int q[8];
  float s0, s1, mn;
};

/// A row of whole blocks of `T` as stored in the file: `row_bytes` bytes, sub-block s (32 values)
/// unpacked by `T::load` from its block. The loaders below read rows through these two, so a type
/// that is laid out differently on the device (Q6_K) only defines them itself.
template <typename T>
struct Blocked {
  __device__ __forceinline__ static size_t row_bytes(int cols) {
    return (size_t)(cols / T::ELEMS) * T::BYTES;
  }
  __device__ __forceinline__ static void load_sub(const uint8_t* wrow, int, int s, Sub& u) {
    T::load(wrow + (s / T::SUB) * T::BYTES, s % T::SUB, u);
  }
};

/// Bytes b in [0, 127] minus `off` in [0, 32], per byte, without borrows between bytes.
__device__ __forceinline__ int sub_bytes(int v, int off) {
  return (int)((((uint32_t)v | 0x80808080u) - (uint32_t)off * 0x01010101u) ^ 0x80808080u);
}

struct Q4_0 : Blocked<Q4_0> {
  static constexpr int ELEMS = 32, BYTES = Q4_0_BYTES, SUB = 1;
  __device__ __forceinline__ static void load(const uint8_t* b, int, Sub& s) {
    float d = load_half(b);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      int v = load_i32_a2(b + 2 + 4 * i);
      s.q[i] = sub_bytes(v & 0x0F0F0F0F, 8);
      s.q[i + 4] = sub_bytes((v >> 4) & 0x0F0F0F0F, 8);
    }
    s.s0 = s.s1 = d;
    s.mn = 0.0f;
  }
};

struct Q5_0 : Blocked<Q5_0> {
  static constexpr int ELEMS = 32, BYTES = Q5_0_BYTES, SUB = 1;
  __device__ __forceinline__ static void load(const uint8_t* b, int, Sub& s) {
    float d = load_half(b);
    uint32_t qh = (uint32_t)load_i32_a2(b + 2);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      int v = load_i32_a2(b + 6 + 4 * i);
      int lo = 0, hi = 0;
#pragma unroll
      for (int k = 0; k < 4; k++) {
        lo |= (int)(((qh >> (4 * i + k)) & 1u) << (8 * k + 4));
        hi |= (int)(((qh >> (16 + 4 * i + k)) & 1u) << (8 * k + 4));
      }
      s.q[i] = sub_bytes((v & 0x0F0F0F0F) | lo, 16);
      s.q[i + 4] = sub_bytes(((v >> 4) & 0x0F0F0F0F) | hi, 16);
    }
    s.s0 = s.s1 = d;
    s.mn = 0.0f;
  }
};

struct Q8_0 : Blocked<Q8_0> {
  static constexpr int ELEMS = 32, BYTES = Q8_0_BYTES, SUB = 1;
  __device__ __forceinline__ static void load(const uint8_t* b, int, Sub& s) {
    float d = load_half(b);
#pragma unroll
    for (int i = 0; i < 8; i++) s.q[i] = load_i32_a2(b + 2 + 4 * i);
    s.s0 = s.s1 = d;
    s.mn = 0.0f;
  }
};

struct Q4_K : Blocked<Q4_K> {
  static constexpr int ELEMS = QK_K, BYTES = Q4_K_BYTES, SUB = 8;
  __device__ __forceinline__ static void load(const uint8_t* b, int sub, Sub& s) {
    float d = load_half(b), dmin = load_half(b + 2);
    int sc, m;
    scale_min_k4(sub, b + 4, &sc, &m);
    const uint8_t* qs = b + 16 + 32 * (sub / 2);
    int shift = (sub & 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) s.q[i] = (load_i32_a2(qs + 4 * i) >> shift) & 0x0F0F0F0F;
    s.s0 = s.s1 = d * (float)sc;
    s.mn = dmin * (float)m;
  }
};

/// Q6_K as repacked at upload (src/kernels/cuda/repack.rs): a row of nb = cols / 256 blocks is
/// four planes, each 16-byte aligned when the row is (the row's size, 208 nb + pad16(2 nb), is a
/// multiple of 16 and matrices start 256-byte aligned):
///   ql     nb × 128 bytes at 0        the file's ql[128] of each block, as is
///   qh     nb × 64 bytes at 128 nb    the file's qh[64], as is
///   scales nb × 16 bytes at 192 nb    the file's int8 scales, reordered: byte 8 n + 4 h + t is
///                                     scales[8 n + 2 t + h] (so a lane's four are one int)
///   d      nb × 2 bytes at 208 nb     the f16 super-block scales, then zeros to a multiple of 16
/// Value 128 n + 32 t + 16 h + i of a block (n, h in 0..1, t in 0..3, i in 0..15) is q - 32 times
/// d · scales[8 n + 2 t + h], where q's low 4 bits are ql[64 n + 32 (t & 1) + 16 h + i] >> 4 (t >> 1)
/// and its high 2 bits qh[32 n + 16 h + i] >> 2 t, as in ggml's layout. The sub-block loader
/// (GEMM, embedding lookup) unpacks the very same bytes as the file's loader did.
struct Q6_K {
  static constexpr int ELEMS = QK_K, SUB = 8;
  __device__ __forceinline__ static size_t row_bytes(int cols) {
    const int nb = cols / QK_K;
    return (size_t)208 * nb + ((2 * nb + 15) & ~15);
  }
  __device__ __forceinline__ static void load_sub(const uint8_t* wrow, int cols, int s, Sub& u) {
    const int nb = cols / QK_K, b = s / 8, n = s % 8 / 4, t = s % 4;
    const uint8_t* ql = wrow + 128 * b + 64 * n + (t & 1) * 32;
    const uint8_t* qh = wrow + 128 * nb + 64 * b + 32 * n;
    const int8_t* sc = reinterpret_cast<const int8_t*>(wrow + 192 * nb + 16 * b + 8 * n + t);
    int lshift = (t >> 1) * 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      int lo = (load_i32_a4(ql + 4 * i) >> lshift) & 0x0F0F0F0F;
      int hi = ((load_i32_a4(qh + 4 * i) >> (2 * t)) & 0x03030303) << 4;
      u.q[i] = sub_bytes(lo | hi, 32);
    }
    float d = load_half(wrow + 208 * nb + 2 * b);
    u.s0 = d * (float)sc[0];
    u.s1 = d * (float)sc[4];
    u.mn = 0.0f;
  }
};

#define GEMV_ROWS 4   // output rows per block (one warp each)
#define GEMV_TOKENS 8 // activation rows per block

template <typename T>
__device__ __forceinline__ void gemv_q(const uint8_t* __restrict__ w, const uint8_t* __restrict__ xq,
                                       float* __restrict__ out, int rows, int cols, int ntok,
                                       const float* __restrict__ bias, int rb) {
  const int lane = threadIdx.x % 32, row = rb * GEMV_ROWS + threadIdx.x / 32;
  if (row >= rows) return;  // a whole warp leaves together; no block-wide barrier follows
  const int t0 = blockIdx.y * GEMV_TOKENS;
  const int nt = min(GEMV_TOKENS, ntok - t0);
  const int nsub = cols / 32;
  const uint8_t* wrow = w + (size_t)row * T::row_bytes(cols);
  float acc[GEMV_TOKENS];
#pragma unroll
  for (int t = 0; t < GEMV_TOKENS; t++) acc[t] = 0.0f;
  for (int s = lane; s < nsub; s += 32) {
    Sub u;
    T::load_sub(wrow, cols, s, u);
#pragma unroll
    for (int t = 0; t < GEMV_TOKENS; t++) {
      if (t < nt) {
        const uint8_t* xb = xq + ((size_t)(t0 + t) * nsub + s) * Q8_1_BYTES;
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) s0 = dp4a_s8(u.q[i], load_i32_a4(xb + 4 + 4 * i), s0);
#pragma unroll
        for (int i = 4; i < 8; i++) s1 = dp4a_s8(u.q[i], load_i32_a4(xb + 4 + 4 * i), s1);
        acc[t] += load_half(xb) * (u.s0 * (float)s0 + u.s1 * (float)s1) - u.mn * load_half(xb + 2);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < GEMV_TOKENS; t++) {
    float v = warp_sum(acc[t]);
    if (lane == 0 && t < nt) out[(size_t)(t0 + t) * rows + row] = bias ? v + bias[row] : v;
  }
}

/// out[t][r] for weights stored as f16 (`half`) or f32, with f32 activations (no quantization).
template <typename W>
__device__ __forceinline__ void gemv_float(const W* __restrict__ w, const float* __restrict__ x,
                                           float* __restrict__ out, int rows, int cols, int ntok,
                                       const float* __restrict__ bias) {
  const int lane = threadIdx.x % 32, row = blockIdx.x * GEMV_ROWS + threadIdx.x / 32;
  if (row >= rows) return;
  const int t0 = blockIdx.y * GEMV_TOKENS;
  const int nt = min(GEMV_TOKENS, ntok - t0);
  const W* wrow = w + (size_t)row * cols;
  float acc[GEMV_TOKENS];
#pragma unroll
  for (int t = 0; t < GEMV_TOKENS; t++) acc[t] = 0.0f;
  for (int c = lane; c < cols; c += 32) {
    float wv = to_float(wrow[c]);
#pragma unroll
    for (int t = 0; t < GEMV_TOKENS; t++)
      if (t < nt) acc[t] += wv * x[(size_t)(t0 + t) * cols + c];
  }
#pragma unroll
  for (int t = 0; t < GEMV_TOKENS; t++) {
    float v = warp_sum(acc[t]);
    if (lane == 0 && t < nt) out[(size_t)(t0 + t) * rows + row] = bias ? v + bias[row] : v;
  }
}

#define GEMV_Q(T, name)                                                                            \
  extern "C" __global__ void __launch_bounds__(128)                                                \
      name(const uint8_t* w, const uint8_t* xq, float* out, int rows, int cols, int nt,            \
           const float* bias) {                                                                    \
    PDL_ENTRY();                                                                                   \
    gemv_q<T>(w, xq, out, rows, cols, nt, bias, blockIdx.x);                                       \
  }                                                                                                \
  EMU_EXPORT(name)
GEMV_Q(Q4_0, gemv_q4_0)
GEMV_Q(Q5_0, gemv_q5_0)
GEMV_Q(Q8_0, gemv_q8_0)

/// Byte k (0..11) of a k-quant super-block's scales held in hd[1..3] (read as ints), without
/// indexing a register array at run time.
__device__ __forceinline__ int scale_byte(const int (&hd)[4], int k) {
  const uint32_t w = (uint32_t)(k < 4 ? hd[1] : k < 8 ? hd[2] : hd[3]);
  return (int)((w >> (8 * (k % 4))) & 0xff);
}

/// `scale_min_k4` from the scales in registers (hd as `scale_byte` reads it).
__device__ __forceinline__ void scale_min_k4_regs(int j, const int (&hd)[4], int* sc, int* m) {
  if (j < 4) {
    *sc = scale_byte(hd, j) & 63;
    *m = scale_byte(hd, j + 4) & 63;
  } else {
    *sc = (scale_byte(hd, j + 4) & 0xF) | ((scale_byte(hd, j - 4) >> 6) << 4);
    *m = (scale_byte(hd, j + 4) >> 4) | ((scale_byte(hd, j) >> 6) << 4);
  }
}

/// Q4_K with 128-bit loads (a Q4_K row is 144-byte blocks, so with a 16-byte-aligned matrix every
/// block's 128 quant bytes are 16-byte aligned): lane task k of a row takes block k / 8 and its
/// quant bytes 16 (k % 8) .. 16 (k % 8) + 15, whose low nibbles are values 16 h .. 16 h + 15 of
/// sub-block 2 j and whose high nibbles the same of sub-block 2 j + 1 (j = k % 8 / 2, h = k % 2).
/// Eight neighbouring lanes read one block's 128 contiguous bytes in eight loads (and its 16-byte
/// header in one each), where the generic kernel's lane read 32 bytes for 32 values as sixteen
/// 2-byte loads. Each sub-block's min term (dmin · m · the q8_1 block's sum) is taken by its h = 0
/// lane. Same launch as every gemv_* kernel.
__device__ __forceinline__ void gemv_q4k(const uint8_t* __restrict__ w,
                                         const uint8_t* __restrict__ xq, float* __restrict__ out,
                                         int rows, int cols, int ntok,
                                         const float* __restrict__ bias, int rb) {
  const int lane = threadIdx.x % 32, row = rb * GEMV_ROWS + threadIdx.x / 32;
  if (row >= rows) return;  // a whole warp leaves together; no block-wide barrier follows
  const int t0 = blockIdx.y * GEMV_TOKENS;
  const int nt = min(GEMV_TOKENS, ntok - t0);
  const int nblk = cols / QK_K, nsub = cols / 32;
  const uint8_t* wrow = w + (size_t)row * nblk * Q4_K_BYTES;
  float acc[GEMV_TOKENS];
#pragma unroll
  for (int t = 0; t < GEMV_TOKENS; t++) acc[t] = 0.0f;
  for (int task = lane; task < nblk * 8; task += 32) {
    const int b = task / 8, part = task % 8, j = part / 2, h = part % 2;
    const uint8_t* blk = wrow + (size_t)b * Q4_K_BYTES;
    int q[4], hd[4];
    load_i32x4_a16(blk + 16 + 16 * part, q);
    load_i32x4_a16(blk, hd);  // d, dmin, scales[12]: one load, the same for 8 lanes
    const float d = __half2float(__ushort_as_half((unsigned short)(hd[0] & 0xffff)));
    const float dmin = __half2float(__ushort_as_half((unsigned short)((uint32_t)hd[0] >> 16)));
    int sc0, m0, sc1, m1;
    scale_min_k4_regs(2 * j, hd, &sc0, &m0);
    scale_min_k4_regs(2 * j + 1, hd, &sc1, &m1);
    const float ds0 = d * (float)sc0, ds1 = d * (float)sc1;
    const float mn0 = h == 0 ? dmin * (float)m0 : 0.0f, mn1 = h == 0 ? dmin * (float)m1 : 0.0f;
#pragma unroll
    for (int t = 0; t < GEMV_TOKENS; t++) {
      if (t < nt) {
        const uint8_t* x0 = xq + ((size_t)(t0 + t) * nsub + b * 8 + 2 * j) * Q8_1_BYTES;
        const uint8_t* x1 = x0 + Q8_1_BYTES;
        int sl = 0, sh = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
          sl = dp4a_s8(q[k] & 0x0F0F0F0F, load_i32_a4(x0 + 4 + 16 * h + 4 * k), sl);
          sh = dp4a_s8((q[k] >> 4) & 0x0F0F0F0F, load_i32_a4(x1 + 4 + 16 * h + 4 * k), sh);
        }
        acc[t] += ds0 * load_half(x0) * (float)sl + ds1 * load_half(x1) * (float)sh -
                  (mn0 * load_half(x0 + 2) + mn1 * load_half(x1 + 2));
      }
    }
  }
#pragma unroll
  for (int t = 0; t < GEMV_TOKENS; t++) {
    float v = warp_sum(acc[t]);
    if (lane == 0 && t < nt) out[(size_t)(t0 + t) * rows + row] = bias ? v + bias[row] : v;
  }
}

extern "C" __global__ void __launch_bounds__(128)
    gemv_q4_k(const uint8_t* w, const uint8_t* xq, float* out, int rows, int cols, int nt,
              const float* bias) {
  PDL_ENTRY();
  gemv_q4k(w, xq, out, rows, cols, nt, bias, blockIdx.x);
}
EMU_EXPORT(gemv_q4_k)

/// Q6_K with 128-bit loads on the repacked rows (see `Q6_K`): lane task k of a row takes block
/// b = k / 4 and its values 128 n + 32 t + 16 h + i for t in 0..3, i in 0..15 (n = k / 2 % 2,
/// h = k % 2): 64 values from 32 ql bytes (two loads: t = 0, 2 in the low and high nibbles of the
/// first 16, t = 1, 3 of the second) and 16 qh bytes (one load, all four 2-bit fields used), with
/// their four scales as one int and d. Four neighbouring lanes read a block's 128 ql and 64 qh
/// bytes whole, where the generic kernel's lane read 32 values as thirty-two 2-byte loads. Each
/// 16-value half is scaled on its own (d_x · d · scale · dot), so the sums are the generic
/// kernel's in another order. Same launch as every gemv_* kernel.
__device__ __forceinline__ void gemv_q6k(const uint8_t* __restrict__ w,
                                         const uint8_t* __restrict__ xq, float* __restrict__ out,
                                         int rows, int cols, int ntok,
                                         const float* __restrict__ bias, int rb) {
  const int lane = threadIdx.x % 32, row = rb * GEMV_ROWS + threadIdx.x / 32;
  if (row >= rows) return;  // a whole warp leaves together; no block-wide barrier follows
  const int t0 = blockIdx.y * GEMV_TOKENS;
  const int nt = min(GEMV_TOKENS, ntok - t0);
  const int nblk = cols / QK_K, nsub = cols / 32;
  const uint8_t* wrow = w + (size_t)row * Q6_K::row_bytes(cols);
  const uint8_t* qhp = wrow + 128 * nblk;
  const uint8_t* scp = wrow + 192 * nblk;
  const uint8_t* dp = wrow + 208 * nblk;
  float acc[GEMV_TOKENS];
#pragma unroll
  for (int t = 0; t < GEMV_TOKENS; t++) acc[t] = 0.0f;
  for (int task = lane; task < nblk * 4; task += 32) {
    const int b = task / 4, n = task / 2 % 2, h = task % 2;
    int ql0[4], ql1[4], qh[4];  // ql0: t = 0 (low nibbles), 2 (high); ql1: t = 1, 3
    load_i32x4_a16(wrow + 128 * b + 64 * n + 16 * h, ql0);
    load_i32x4_a16(wrow + 128 * b + 64 * n + 32 + 16 * h, ql1);
    load_i32x4_a16(qhp + 64 * b + 32 * n + 16 * h, qh);
    const int sc = load_i32_a4(scp + 16 * b + 8 * n + 4 * h);
    const float d = load_half(dp + 2 * b);
    // One sub-block (4 n + t) at a time: its 16 values unpacked, then its dot product with each
    // token's q8_1 block (few registers live: the raw quants, 4 unpacked ints, the accumulators).
#pragma unroll
    for (int t = 0; t < 4; t++) {
      const float ds = d * (float)(int8_t)((sc >> (8 * t)) & 0xff);
      int q[4];
#pragma unroll
      for (int k = 0; k < 4; k++) {
        const int lo = (((t & 1) ? ql1[k] : ql0[k]) >> (4 * (t >> 1))) & 0x0F0F0F0F;
        const int hi = ((qh[k] >> (2 * t)) & 0x03030303) << 4;
        q[k] = sub_bytes(lo | hi, 32);
      }
#pragma unroll
      for (int tok = 0; tok < GEMV_TOKENS; tok++) {
        if (tok < nt) {
          const uint8_t* xb =
              xq + ((size_t)(t0 + tok) * nsub + b * 8 + 4 * n + t) * Q8_1_BYTES + 16 * h;
          int s = 0;
#pragma unroll
          for (int k = 0; k < 4; k++) s = dp4a_s8(q[k], load_i32_a4(xb + 4 + 4 * k), s);
          acc[tok] += load_half(xb - 16 * h) * (ds * (float)s);
        }
      }
    }
  }
#pragma unroll
  for (int t = 0; t < GEMV_TOKENS; t++) {
    float v = warp_sum(acc[t]);
    if (lane == 0 && t < nt) out[(size_t)(t0 + t) * rows + row] = bias ? v + bias[row] : v;
  }
}

extern "C" __global__ void __launch_bounds__(128)
    gemv_q6_k(const uint8_t* w, const uint8_t* xq, float* out, int rows, int cols, int nt,
              const float* bias) {
  PDL_ENTRY();
  gemv_q6k(w, xq, out, rows, cols, nt, bias, blockIdx.x);
}
EMU_EXPORT(gemv_q6_k)

/// Up to three matrices of one type and width that read the same q8_1 activations (Q, K and V;
/// gate and up) in one launch: grid (sum of ceil(rows_j / 4), ceil(tokens / 8)), block (128);
/// block x takes the rows of matrix 0, then 1, then 2, each as its gemv_* kernel would (a matrix
/// of 0 rows takes no blocks).
#define GEMV_MULTI(FN, name)                                                                       \
  extern "C" __global__ void __launch_bounds__(128)                                                \
      name(const uint8_t* xq, int cols, int nt, const uint8_t* w0, float* out0, const float* b0,   \
           int rows0, const uint8_t* w1, float* out1, const float* b1, int rows1,                  \
           const uint8_t* w2, float* out2, const float* b2, int rows2) {                           \
    PDL_ENTRY();                                                                                   \
    const int n0 = (rows0 + GEMV_ROWS - 1) / GEMV_ROWS, n1 = (rows1 + GEMV_ROWS - 1) / GEMV_ROWS;  \
    const int rb = blockIdx.x;                                                                     \
    if (rb < n0) {                                                                                 \
      FN(w0, xq, out0, rows0, cols, nt, b0, rb);                                                   \
    } else if (rb < n0 + n1) {                                                                     \
      FN(w1, xq, out1, rows1, cols, nt, b1, rb - n0);                                              \
    } else {                                                                                       \
      FN(w2, xq, out2, rows2, cols, nt, b2, rb - n0 - n1);                                         \
    }                                                                                              \
  }                                                                                                \
  EMU_EXPORT(name)
GEMV_MULTI(gemv_q<Q4_0>, gemv_multi_q4_0)
GEMV_MULTI(gemv_q<Q5_0>, gemv_multi_q5_0)
GEMV_MULTI(gemv_q<Q8_0>, gemv_multi_q8_0)
GEMV_MULTI(gemv_q4k, gemv_multi_q4_k)
GEMV_MULTI(gemv_q6k, gemv_multi_q6_k)

extern "C" __global__ void __launch_bounds__(128)
    gemv_f16(const __half* w, const float* x, float* out, int rows, int cols, int nt,
             const float* bias) {
  PDL_ENTRY();
  gemv_float<__half>(w, x, out, rows, cols, nt, bias);
}
EMU_EXPORT(gemv_f16)

extern "C" __global__ void __launch_bounds__(128)
    gemv_f32(const float* w, const float* x, float* out, int rows, int cols, int nt,
             const float* bias) {
  PDL_ENTRY();
  gemv_float<float>(w, x, out, rows, cols, nt, bias);
}
EMU_EXPORT(gemv_f32)

/// q8_1 activations: one warp per 32-value block (x is rows × cols with cols % 32 == 0, so the
/// blocks are contiguous), as `q8_1_warp`. Block (128), grid (ceil(n_blocks / 4)).
extern "C" __global__ void __launch_bounds__(128)
    quantize_q8_1(const float* __restrict__ x, uint8_t* __restrict__ out, int n_blocks) {
  PDL_ENTRY();
  const int b = blockIdx.x * 4 + threadIdx.x / 32;
  if (b >= n_blocks) return;
  q8_1_warp(x[(size_t)b * 32 + threadIdx.x % 32], out + (size_t)b * Q8_1_BYTES);
}
EMU_EXPORT(quantize_q8_1)

/// Embedding lookup: out[i] = dequant(w row ids[i]) * scale. Block (256): thread j dequantizes
/// sub-blocks j, j+256, ... of the row; grid (n_ids).
template <typename T>
__device__ __forceinline__ void get_rows_q(const uint8_t* w, const int* ids, float* out, int cols,
                                           float scale) {
  const uint8_t* wrow = w + (size_t)ids[blockIdx.x] * T::row_bytes(cols);
  float* o = out + (size_t)blockIdx.x * cols;
  for (int s = threadIdx.x; s < cols / 32; s += blockDim.x) {
    Sub u;
    T::load_sub(wrow, cols, s, u);
#pragma unroll
    for (int k = 0; k < 32; k++) {
      int q = (int)(int8_t)((u.q[k / 4] >> (8 * (k % 4))) & 0xff);
      o[s * 32 + k] = ((k < 16 ? u.s0 : u.s1) * (float)q - u.mn) * scale;
    }
  }
}

#define GET_ROWS_Q(T, name)                                                                       \
  extern "C" __global__ void name(const uint8_t* w, const int* ids, float* out, int cols,         \
                                  float scale) {                                                  \
    PDL_ENTRY();                                                                                  \
    get_rows_q<T>(w, ids, out, cols, scale);                                                      \
  }                                                                                               \
  EMU_EXPORT(name)
GET_ROWS_Q(Q4_0, get_rows_q4_0)
GET_ROWS_Q(Q5_0, get_rows_q5_0)
GET_ROWS_Q(Q8_0, get_rows_q8_0)
GET_ROWS_Q(Q4_K, get_rows_q4_k)
GET_ROWS_Q(Q6_K, get_rows_q6_k)

template <typename W>
__device__ __forceinline__ void get_rows_float(const W* w, const int* ids, float* out, int cols,
                                               float scale) {
  const W* wrow = w + (size_t)ids[blockIdx.x] * cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x)
    out[(size_t)blockIdx.x * cols + c] = to_float(wrow[c]) * scale;
}

extern "C" __global__ void get_rows_f16(const __half* w, const int* ids, float* out, int cols,
                                        float scale) {
  PDL_ENTRY();
  get_rows_float<__half>(w, ids, out, cols, scale);
}
EMU_EXPORT(get_rows_f16)

extern "C" __global__ void get_rows_f32(const float* w, const int* ids, float* out, int cols,
                                        float scale) {
  PDL_ENTRY();
  get_rows_float<float>(w, ids, out, cols, scale);
}
EMU_EXPORT(get_rows_f32)
