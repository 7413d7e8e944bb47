// Attention over the paged f16 KV cache, flash-decoding style: each query's visible keys
// (positions lo..=pos) are cut into splits of ATTN_SPLIT keys; `attn_split` computes, for one
// (query, KV head, split), the unnormalised softmax-weighted sum of V for every query head that
// shares the KV head (GQA: K and V are read once per group, not once per head), with the split's
// max score m and sum of exp l; `attn_merge` combines a query head's splits (or, given arrival
// counters, the block that finishes a (query, KV head)'s last split does). A batch of prefill
// rows is the same call with one query per row (each row has its own pos), so causal masking is
// just the key range. Layouts: q rows of n_head * head_dim; cache slot s of a layer holds kv_dim
// values at s * kv_dim, head h at h * head_dim; slot = table[key / bs] * bs + key % bs; meta[i] =
// {offset of query i's block table in `tables`, pos, lo}; partials: (n_q, n_head, n_split) records
// of head_dim values then m, l.
#include "common.cuh"

#define ATTN_SPLIT 128  // keys per split
#define ATTN_MAX_G 16   // query heads per KV head
#define ATTN_MAX_HD 256 // head_dim
#define ATTN_THREADS 128

// A split's unnormalised sums `acc[g]` at value `d` for the G query heads of KV head `kvh`: with
// one split, normalised into `out` (what attn_merge would make of one split: e^0 = 1 exactly)
// and quantized into `q8` when given; else into the split's record in `part`.
__device__ __forceinline__ void split_store_values(const float (&acc)[ATTN_MAX_G], int d, int G,
                                                   int qi, int kvh, int n_head, int hd, int split,
                                                   int n_split, int n, const float* ml,
                                                   float* __restrict__ out,
                                                   float* __restrict__ part,
                                                   uint8_t* __restrict__ q8) {
#pragma unroll
  for (int g = 0; g < ATTN_MAX_G; g++) {
    if (g < G) {
      const int h = kvh * G + g;
      if (n_split == 1)
        out[((size_t)qi * n_head + h) * hd + d] = n > 0 ? acc[g] / ml[2 * g + 1] : 0.0f;
      else
        part[(((size_t)qi * n_head + h) * n_split + split) * (hd + 2) + d] = acc[g];
    }
  }
  if (n_split == 1 && q8) {
    // Each thread reads back only what it wrote; not unrolled (registers).
#pragma unroll 1
    for (int g = 0; g < G; g++) {
      const size_t o = ((size_t)qi * n_head + kvh * G + g) * hd + d;
      q8_1_warp(out[o], q8 + o / 32 * Q8_1_BYTES);
    }
  }
}

// The split's max score m and sum of exp l for each of its G query heads, by threads 0..G-1.
__device__ __forceinline__ void split_store_stats(int G, int qi, int kvh, int n_head, int hd,
                                                  int split, int n_split, int n, const float* ml,
                                                  float* __restrict__ part) {
  if ((int)threadIdx.x < G) {
    const int g = threadIdx.x, h = kvh * G + g;
    float* rec = part + (((size_t)qi * n_head + h) * n_split + split) * (hd + 2);
    rec[hd] = n > 0 ? ml[2 * g] : NEG_INF;
    rec[hd + 1] = n > 0 ? ml[2 * g + 1] : 0.0f;
  }
}

/// One query head's merge of its splits' records (what `attn_merge`'s block (qi, h) computes), by
/// a block of 128 threads: out[qi][h] = sum_k e^(m_k - M) acc_k / sum_k e^(m_k - M) l_k, and its
/// q8_1 blocks to `q8` when given. `P` reads the records (volatile when other blocks of the
/// caller's launch just wrote them).
template <typename P>
__device__ __forceinline__ void merge_head(int qi, int h, P part, float* __restrict__ out,
                                           int n_head, int hd, int n_split,
                                           uint8_t* __restrict__ q8) {
  const P rec = part + ((size_t)qi * n_head + h) * n_split * (hd + 2);
  float M = NEG_INF;
  for (int k = 0; k < n_split; k++) M = fmaxf(M, rec[k * (hd + 2) + hd]);
  float L = 0.0f;
  for (int k = 0; k < n_split; k++) {
    const float m = rec[k * (hd + 2) + hd];
    if (m != NEG_INF) L += expf(m - M) * rec[k * (hd + 2) + hd + 1];
  }
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < n_split; k++) {
      const float m = rec[k * (hd + 2) + hd];
      if (m != NEG_INF) acc += expf(m - M) * rec[k * (hd + 2) + d];
    }
    const size_t o = ((size_t)qi * n_head + h) * hd + d;
    out[o] = L > 0.0f ? acc / L : 0.0f;
    if (q8) q8_1_warp(out[o], q8 + o / 32 * Q8_1_BYTES);
  }
}

/// The merge of a (query, KV head)'s splits by the block that finishes the last of them, when
/// `done` is given (counters, n_q × n_head_kv, zero between launches) and there are several:
/// each split's block counts its arrival after a fence and the block's barrier; the last merges
/// the group's G query heads (`merge_head`, reading the others' records through volatile loads)
/// and sets the counter back to zero. `last` is a shared int. Every thread of the block calls it.
/// Out of line: inlined, it raised attn_split's registers from 80 to 131 (sm_90), for a path
/// that one block in n_split takes.
__device__ NOINLINE void merge_if_last(int qi, int kvh, int G, int n_head_kv, const float* part,
                                       float* out, int n_head, int hd, int n_split, uint8_t* q8,
                                       int* done, int* last) {
  if (!done || n_split == 1) return;
  int* count = done + (size_t)qi * n_head_kv + kvh;
  if (!last_to_arrive(count, n_split, last)) return;
  const volatile float* p = part;
  for (int g = 0; g < G; g++)
    merge_head<const volatile float*>(qi, kvh * G + g, p, out, n_head, hd, n_split, q8);
  if (threadIdx.x == 0) *count = 0;
}

/// grid (n_q, n_head_kv, n_split), block (128). With one split the normalised result goes
/// straight to `out` (no merge launch), and its q8_1 blocks to `q8` when given (head_dim a
/// multiple of 32: a warp's 32 consecutive values of a head are one block). With several and
/// `done` given, the last split's block merges them (`merge_if_last`; no merge launch either).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attn_split(const float* __restrict__ q, const __half* __restrict__ kc,
               const __half* __restrict__ vc, const int* __restrict__ tables,
               const int* __restrict__ meta, float* __restrict__ part, int n_head, int n_head_kv,
               int head_dim, int block_size, int kv_dim, float scale, int n_split,
               float* __restrict__ out, uint8_t* __restrict__ q8, int* done) {
  PDL_ENTRY();
  __shared__ float qs[ATTN_MAX_G * ATTN_MAX_HD];
  __shared__ float sc[ATTN_MAX_G * ATTN_SPLIT];
  __shared__ int last;
  __shared__ int slot[ATTN_SPLIT];
  __shared__ float ml[ATTN_MAX_G * 2];
  const int qi = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int G = n_head / n_head_kv, hd = head_dim;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = ATTN_THREADS / 32;
  const int* table = tables + meta[3 * qi];
  const int pos = meta[3 * qi + 1], lo = meta[3 * qi + 2];
  const int start = lo + split * ATTN_SPLIT;
  const int n = max(0, min(ATTN_SPLIT, pos + 1 - start));  // keys in this split (may be 0)

  for (int i = threadIdx.x; i < G * hd; i += ATTN_THREADS)
    qs[i] = q[(size_t)qi * n_head * hd + (size_t)kvh * G * hd + i];
  for (int j = threadIdx.x; j < n; j += ATTN_THREADS) {
    const int key = start + j;
    slot[j] = table[key / block_size] * block_size + key % block_size;
  }
  __syncthreads();

  // scores: warp w takes keys w, w + 4, ...; lane holds K elements lane, lane + 32, ...
  for (int j = warp; j < n; j += nwarps) {
    const __half* k = kc + (size_t)slot[j] * kv_dim + (size_t)kvh * hd;
    float kr[ATTN_MAX_HD / 32];
#pragma unroll
    for (int e = 0; e < ATTN_MAX_HD / 32; e++) {
      const int d = lane + 32 * e;
      kr[e] = d < hd ? __half2float(k[d]) : 0.0f;
    }
    for (int g = 0; g < G; g++) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < ATTN_MAX_HD / 32; e++) {
        const int d = lane + 32 * e;
        if (d < hd) dot += qs[g * hd + d] * kr[e];
      }
      dot = warp_sum(dot);
      if (lane == 0) sc[g * ATTN_SPLIT + j] = dot * scale;
    }
  }
  __syncthreads();

  // softmax pieces: warp w takes heads w, w + 4, ...
  for (int g = warp; g < G; g += nwarps) {
    float m = NEG_INF;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[g * ATTN_SPLIT + j]);
    m = warp_max(m);
    float l = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float p = expf(sc[g * ATTN_SPLIT + j] - m);
      sc[g * ATTN_SPLIT + j] = p;
      l += p;
    }
    l = warp_sum(l);
    if (lane == 0) {
      ml[2 * g] = m;
      ml[2 * g + 1] = l;
    }
  }
  __syncthreads();

  // weighted V: thread d accumulates every head of the group at once
  for (int d = threadIdx.x; d < hd; d += ATTN_THREADS) {
    float acc[ATTN_MAX_G];
#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; g++) acc[g] = 0.0f;
    for (int j = 0; j < n; j++) {
      const float v = __half2float(vc[(size_t)slot[j] * kv_dim + (size_t)kvh * hd + d]);
#pragma unroll
      for (int g = 0; g < ATTN_MAX_G; g++)
        if (g < G) acc[g] += sc[g * ATTN_SPLIT + j] * v;
    }
    split_store_values(acc, d, G, qi, kvh, n_head, hd, split, n_split, n, ml, out, part, q8);
  }
  split_store_stats(G, qi, kvh, n_head, hd, split, n_split, n, ml, part);
  merge_if_last(qi, kvh, G, n_head_kv, part, out, n_head, hd, n_split, q8, done, &last);
}
EMU_EXPORT(attn_split)

/// The merge of each query head's splits (`merge_head`): grid (n_q, n_head), block (128).
extern "C" __global__ void __launch_bounds__(128)
    attn_merge(const float* __restrict__ part, float* __restrict__ out, int n_head, int head_dim,
               int n_split, uint8_t* __restrict__ q8) {
  PDL_ENTRY();
  merge_head<const float*>(blockIdx.x, blockIdx.y, part, out, n_head, head_dim, n_split, q8);
}
EMU_EXPORT(attn_merge)

/// attn_split over a cache whose K and V rows are of types k_type and v_type (CACHE_*, not both
/// f16; head_dim a multiple of 32), read in place: kc/vc rows of cache_bytes(type, kv_dim) bytes
/// a slot, a head's blocks at cache_bytes(type, kvh * head_dim). A quantized K: each query head is
/// rotated and rounded to q8_0 once per block (as the CPU's quant_cache.rs does), and a score is
/// the sum over blocks of the integer dot product of the two blocks' bytes (dp4a; a q4_0 block's
/// nibbles minus 8) times the two scales. A quantized V: the weighted sum is accumulated from the
/// blocks (still rotated) and each head's result rotated back (Tᵀ) before it is written; the
/// merge of splits is linear, so attn_merge takes these records as they are. An f16 side is read
/// as attn_split reads it. grid (n_q, n_head_kv, n_split), block (128).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attn_split_q(const float* __restrict__ q, const uint8_t* __restrict__ kc,
                 const uint8_t* __restrict__ vc, const int* __restrict__ tables,
                 const int* __restrict__ meta, float* __restrict__ part, int n_head, int n_head_kv,
                 int head_dim, int block_size, int kv_dim, float scale, int n_split,
                 float* __restrict__ out, uint8_t* __restrict__ q8, int* done, int k_type,
                 int v_type) {
  PDL_ENTRY();
  __shared__ int last;
  __shared__ float qs[ATTN_MAX_G * ATTN_MAX_HD];           // f16 K: the group's query heads
  __shared__ int qq[ATTN_MAX_G * ATTN_MAX_HD / 4];         // quantized K: their q8_0 bytes
  __shared__ float qd[ATTN_MAX_G * ATTN_MAX_HD / 32];      // and block scales
  __shared__ float sc[ATTN_MAX_G * ATTN_SPLIT];
  __shared__ int slot[ATTN_SPLIT];
  __shared__ float ml[ATTN_MAX_G * 2];
  const int qi = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  const int G = n_head / n_head_kv, hd = head_dim, nb = hd / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = ATTN_THREADS / 32;
  const int* table = tables + meta[3 * qi];
  const int pos = meta[3 * qi + 1], lo = meta[3 * qi + 2];
  const int start = lo + split * ATTN_SPLIT;
  const int n = max(0, min(ATTN_SPLIT, pos + 1 - start));  // keys in this split (may be 0)
  const size_t k_row = cache_bytes(k_type, kv_dim), v_row = cache_bytes(v_type, kv_dim);
  const size_t k_head = cache_bytes(k_type, kvh * hd), v_head = cache_bytes(v_type, kvh * hd);
  const float* qg = q + (size_t)qi * n_head * hd + (size_t)kvh * G * hd;

  if (k_type == CACHE_F16) {
    for (int i = threadIdx.x; i < G * hd; i += ATTN_THREADS) qs[i] = qg[i];
  } else {
    // warp w takes the (head, block) pairs w, w + 4, ...: rotated, then rounded to q8_0
    for (int w = warp; w < G * nb; w += nwarps) {  // warp-uniform
      float d;
      const int v = q8_0_round_warp(rotate_warp(qg[w * 32 + lane]), &d);
      reinterpret_cast<int8_t*>(qq)[w * 32 + lane] = (int8_t)v;
      if (lane == 0) qd[w] = __half2float(__float2half_rn(d));
    }
  }
  for (int j = threadIdx.x; j < n; j += ATTN_THREADS) {
    const int key = start + j;
    slot[j] = table[key / block_size] * block_size + key % block_size;
  }
  __syncthreads();

  // scores: warp w takes keys w, w + 4, ...
  for (int j = warp; j < n; j += nwarps) {
    const uint8_t* k = kc + (size_t)slot[j] * k_row + k_head;
    if (k_type == CACHE_F16) {
      // lane holds K elements lane, lane + 32, ...
      float kr[ATTN_MAX_HD / 32];
#pragma unroll
      for (int e = 0; e < ATTN_MAX_HD / 32; e++) {
        const int d = lane + 32 * e;
        kr[e] = d < hd ? __half2float(reinterpret_cast<const __half*>(k)[d]) : 0.0f;
      }
      for (int g = 0; g < G; g++) {
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < ATTN_MAX_HD / 32; e++) {
          const int d = lane + 32 * e;
          if (d < hd) dot += qs[g * hd + d] * kr[e];
        }
        dot = warp_sum(dot);
        if (lane == 0) sc[g * ATTN_SPLIT + j] = dot * scale;
      }
      continue;
    }
    // lane holds the 4-byte groups s = lane + 32 e of the head: block s / 8, values
    // 4 (s % 8) .. 4 (s % 8) + 3 (a q4_0 block's values i and i + 16 share byte i)
    int kv4[ATTN_MAX_HD / 128];
    float dk[ATTN_MAX_HD / 128];
#pragma unroll
    for (int e = 0; e < ATTN_MAX_HD / 128; e++) {
      const int s = lane + 32 * e, b = s / 8, w = s % 8;
      kv4[e] = 0;
      dk[e] = 0.0f;
      if (s < nb * 8) {
        if (k_type == CACHE_Q8_0) {
          const uint8_t* blk = k + b * Q8_0_BYTES;
          dk[e] = load_half(blk);
          kv4[e] = load_i32_a2(blk + 2 + 4 * w);
        } else {
          const uint8_t* blk = k + b * Q4_0_BYTES;
          dk[e] = load_half(blk);
          kv4[e] = (load_i32_a2(blk + 2 + 4 * (w % 4)) >> (4 * (w / 4))) & 0x0F0F0F0F;
        }
      }
    }
    for (int g = 0; g < G; g++) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < ATTN_MAX_HD / 128; e++) {
        const int s = lane + 32 * e;
        const int qv = s < nb * 8 ? qq[g * nb * 8 + s] : 0;
        int isum = dp4a_s8(kv4[e], qv, 0);
        if (k_type == CACHE_Q4_0) isum -= 8 * dp4a_s8(0x01010101, qv, 0);
        isum += __shfl_xor_sync(FULL_MASK, isum, 1);
        isum += __shfl_xor_sync(FULL_MASK, isum, 2);
        isum += __shfl_xor_sync(FULL_MASK, isum, 4);  // the block's exact integer sum
        if (s < nb * 8 && s % 8 == 0) dot += (dk[e] * qd[g * nb + s / 8]) * (float)isum;
      }
      dot = warp_sum(dot);
      if (lane == 0) sc[g * ATTN_SPLIT + j] = dot * scale;
    }
  }
  __syncthreads();

  // softmax pieces: warp w takes heads w, w + 4, ...
  for (int g = warp; g < G; g += nwarps) {
    float m = NEG_INF;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[g * ATTN_SPLIT + j]);
    m = warp_max(m);
    float l = 0.0f;
    for (int j = lane; j < n; j += 32) {
      const float p = expf(sc[g * ATTN_SPLIT + j] - m);
      sc[g * ATTN_SPLIT + j] = p;
      l += p;
    }
    l = warp_sum(l);
    if (lane == 0) {
      ml[2 * g] = m;
      ml[2 * g + 1] = l;
    }
  }
  __syncthreads();

  // weighted V: thread d accumulates every head of the group at once; with head_dim a multiple
  // of 32 a warp holds one whole block of each head (value d % 32 in lane d % 32)
  for (int d = threadIdx.x; d < hd; d += ATTN_THREADS) {  // warp-uniform
    float acc[ATTN_MAX_G];
#pragma unroll
    for (int g = 0; g < ATTN_MAX_G; g++) acc[g] = 0.0f;
    for (int j = 0; j < n; j++) {
      const float v = cache_value(v_type, vc + (size_t)slot[j] * v_row + v_head, d);
#pragma unroll
      for (int g = 0; g < ATTN_MAX_G; g++)
        if (g < G) acc[g] += sc[g * ATTN_SPLIT + j] * v;
    }
    if (v_type != CACHE_F16) {
#pragma unroll
      for (int g = 0; g < ATTN_MAX_G; g++)
        if (g < G) acc[g] = unrotate_warp(acc[g]);
    }
    split_store_values(acc, d, G, qi, kvh, n_head, hd, split, n_split, n, ml, out, part, q8);
  }
  split_store_stats(G, qi, kvh, n_head, hd, split, n_split, n, ml, part);
  merge_if_last(qi, kvh, G, n_head_kv, part, out, n_head, hd, n_split, q8, done, &last);
}
EMU_EXPORT(attn_split_q)

#define PF_T 8   // queries per tile (2 per warp)
#define PF_KC 32 // keys per chunk (one per lane)

/// Flash attention for a batch of prefill rows: a block takes a tile of up to PF_T consecutive
/// queries of one sequence (they share a block table; tiles[2 t] = first query, tiles[2 t + 1] =
/// count) and one query head, streams the tile's visible keys through shared memory PF_KC at a
/// time (K and V read once per tile instead of once per query), and keeps an online softmax per
/// query (running max m, sum l, rescaled accumulator). Causal and window masks come from each
/// query's pos and lo. grid (n_tiles, n_head), block (128).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attn_prefill(const float* __restrict__ q, const __half* __restrict__ kc,
                 const __half* __restrict__ vc, const int* __restrict__ tables,
                 const int* __restrict__ meta, const int* __restrict__ tiles,
                 float* __restrict__ out, int n_head, int n_head_kv, int head_dim,
                 int block_size, int kv_dim, float scale) {
  PDL_ENTRY();
  __shared__ float qs[PF_T * ATTN_MAX_HD];
  __shared__ __half ks[PF_KC * (ATTN_MAX_HD + 2)];
  __shared__ __half vs[PF_KC * ATTN_MAX_HD];
  __shared__ float ps[ATTN_THREADS / 32][32];
  const int h = blockIdx.y, hd = head_dim, kvh = h / (n_head / n_head_kv);
  const int kstride = hd + 2;  // padded rows: lanes reading different keys hit different banks
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int q0 = tiles[2 * blockIdx.x], nq = tiles[2 * blockIdx.x + 1];
  const int* table = tables + meta[3 * q0];
  int lo_min = 0x7fffffff, pos_max = -1;
  for (int i = 0; i < nq; i++) {
    lo_min = min(lo_min, meta[3 * (q0 + i) + 2]);
    pos_max = max(pos_max, meta[3 * (q0 + i) + 1]);
  }
  for (int x = threadIdx.x; x < nq * hd; x += ATTN_THREADS)
    qs[x] = q[(size_t)(q0 + x / hd) * n_head * hd + (size_t)h * hd + x % hd];

  float m[2], l[2], acc[2][ATTN_MAX_HD / 32];
#pragma unroll
  for (int a = 0; a < 2; a++) {
    m[a] = NEG_INF;
    l[a] = 0.0f;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_HD / 32; e++) acc[a][e] = 0.0f;
  }

  for (int k0 = lo_min; k0 <= pos_max; k0 += PF_KC) {
    const int n = min(PF_KC, pos_max + 1 - k0);
    __syncthreads();  // the previous chunk is no longer read
    for (int x = threadIdx.x; x < n * hd; x += ATTN_THREADS) {
      const int j = x / hd, d = x % hd, key = k0 + j;
      const size_t src = (size_t)(table[key / block_size] * block_size + key % block_size) * kv_dim +
                         (size_t)kvh * hd + d;
      ks[j * kstride + d] = kc[src];
      vs[j * hd + d] = vc[src];
    }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 2; a++) {
      const int i = warp + 4 * a;
      if (i >= nq) continue;  // warp-uniform
      const int pos = meta[3 * (q0 + i) + 1], lo = meta[3 * (q0 + i) + 2];
      const int key = k0 + lane;
      const bool valid = lane < n && key >= lo && key <= pos;
      float s = NEG_INF;
      if (valid) {
        float dot = 0.0f;
        for (int d = 0; d < hd; d++) dot += qs[i * hd + d] * __half2float(ks[lane * kstride + d]);
        s = dot * scale;
      }
      const float cm = warp_max(s);
      if (cm == NEG_INF) continue;  // warp-uniform: no visible key in this chunk
      const float m_new = fmaxf(m[a], cm);
      const float corr = expf(m[a] - m_new);  // 0 while m is -inf
      const float p = valid ? expf(s - m_new) : 0.0f;
      l[a] = l[a] * corr + warp_sum(p);
      ps[warp][lane] = p;
      __syncwarp();
#pragma unroll
      for (int e = 0; e < ATTN_MAX_HD / 32; e++) {
        const int d = lane + 32 * e;
        if (d < hd) {
          float v = acc[a][e] * corr;
          for (int j = 0; j < n; j++) v += ps[warp][j] * __half2float(vs[j * hd + d]);
          acc[a][e] = v;
        }
      }
      __syncwarp();  // ps is rewritten by the next query
      m[a] = m_new;
    }
  }
#pragma unroll
  for (int a = 0; a < 2; a++) {
    const int i = warp + 4 * a;
    if (i >= nq) continue;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_HD / 32; e++) {
      const int d = lane + 32 * e;
      if (d < hd)
        out[(size_t)(q0 + i) * n_head * hd + (size_t)h * hd + d] = l[a] > 0.0f ? acc[a][e] / l[a] : 0.0f;
    }
  }
}
EMU_EXPORT(attn_prefill)

#define PFQ_ROW_WORDS (ATTN_MAX_HD / 2 + 1)  // a head's row in shared memory, f16 at most

/// attn_prefill over a cache whose K and V rows are of types k_type and v_type (CACHE_*, as
/// attn_split_q's; head_dim a multiple of 32). A chunk's K and V heads are copied to shared memory
/// as stored (a q8_0 head of 128 values is 136 bytes where f16 takes 256) and each value is
/// dequantized where it is used, in f32 (no rounding beyond the cache's own). With a quantized K
/// the tile's query heads are rotated once (T per block: (Tq)·(Tk) = q·k) and kept in f32: every
/// key is read by up to 8 queries here, so rounding them to q8_0 for integer dot products would
/// save little and cost accuracy. With a quantized V each output head is rotated back (Tᵀ).
/// grid (n_tiles, n_head), block (128).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS)
    attn_prefill_q(const float* __restrict__ q, const uint8_t* __restrict__ kc,
                   const uint8_t* __restrict__ vc, const int* __restrict__ tables,
                   const int* __restrict__ meta, const int* __restrict__ tiles,
                   float* __restrict__ out, int n_head, int n_head_kv, int head_dim,
                   int block_size, int kv_dim, float scale, int k_type, int v_type) {
  PDL_ENTRY();
  __shared__ float qs[PF_T * ATTN_MAX_HD];
  __shared__ int ks[PF_KC * PFQ_ROW_WORDS];
  __shared__ int vs[PF_KC * PFQ_ROW_WORDS];
  __shared__ float ps[ATTN_THREADS / 32][32];
  const int h = blockIdx.y, hd = head_dim, kvh = h / (n_head / n_head_kv);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = ATTN_THREADS / 32;
  const int kb = cache_bytes(k_type, hd), vb = cache_bytes(v_type, hd);  // bytes of a head
  // Row strides in words, odd: lanes reading different keys hit different banks.
  const int kw = ((kb + 3) / 4) | 1, vw = ((vb + 3) / 4) | 1;
  const size_t k_row = cache_bytes(k_type, kv_dim), v_row = cache_bytes(v_type, kv_dim);
  const size_t k_head = cache_bytes(k_type, kvh * hd), v_head = cache_bytes(v_type, kvh * hd);
  const int q0 = tiles[2 * blockIdx.x], nq = tiles[2 * blockIdx.x + 1];
  const int* table = tables + meta[3 * q0];
  int lo_min = 0x7fffffff, pos_max = -1;
  for (int i = 0; i < nq; i++) {
    lo_min = min(lo_min, meta[3 * (q0 + i) + 2]);
    pos_max = max(pos_max, meta[3 * (q0 + i) + 1]);
  }
  for (int x = threadIdx.x; x < nq * hd; x += ATTN_THREADS)
    qs[x] = q[(size_t)(q0 + x / hd) * n_head * hd + (size_t)h * hd + x % hd];
  if (k_type != CACHE_F16) {
    __syncthreads();
    for (int w = warp; w < nq * (hd / 32); w += nwarps) {  // warp-uniform; own values only
      const float x = rotate_warp(qs[w * 32 + lane]);
      qs[w * 32 + lane] = x;
    }
  }

  float m[2], l[2], acc[2][ATTN_MAX_HD / 32];
#pragma unroll
  for (int a = 0; a < 2; a++) {
    m[a] = NEG_INF;
    l[a] = 0.0f;
#pragma unroll
    for (int e = 0; e < ATTN_MAX_HD / 32; e++) acc[a][e] = 0.0f;
  }

  for (int k0 = lo_min; k0 <= pos_max; k0 += PF_KC) {
    const int n = min(PF_KC, pos_max + 1 - k0);
    __syncthreads();  // the previous chunk (and the query's rotation) is done
    // Heads are whole 2-byte units (f16 values, 34- or 18-byte blocks): copied as such.
    for (int x = threadIdx.x; x < n * (kb / 2); x += ATTN_THREADS) {
      const int j = x / (kb / 2), t = x % (kb / 2), key = k0 + j;
      const size_t s = (size_t)(table[key / block_size] * block_size + key % block_size);
      reinterpret_cast<uint16_t*>(ks + j * kw)[t] =
          reinterpret_cast<const uint16_t*>(kc + s * k_row + k_head)[t];
    }
    for (int x = threadIdx.x; x < n * (vb / 2); x += ATTN_THREADS) {
      const int j = x / (vb / 2), t = x % (vb / 2), key = k0 + j;
      const size_t s = (size_t)(table[key / block_size] * block_size + key % block_size);
      reinterpret_cast<uint16_t*>(vs + j * vw)[t] =
          reinterpret_cast<const uint16_t*>(vc + s * v_row + v_head)[t];
    }
    __syncthreads();
#pragma unroll
    for (int a = 0; a < 2; a++) {
      const int i = warp + 4 * a;
      if (i >= nq) continue;  // warp-uniform
      const int pos = meta[3 * (q0 + i) + 1], lo = meta[3 * (q0 + i) + 2];
      const int key = k0 + lane;
      const bool valid = lane < n && key >= lo && key <= pos;
      float s = NEG_INF;
      if (valid) {
        const uint8_t* kr = reinterpret_cast<const uint8_t*>(ks + lane * kw);
        float dot = 0.0f;
        if (k_type == CACHE_F16) {
          for (int d = 0; d < hd; d++) dot += qs[i * hd + d] * cache_value(CACHE_F16, kr, d);
        } else {
#pragma unroll 1
          for (int b = 0; b < hd / 32; b++) {
            float bs = 0.0f;
            const uint8_t* blk = kr + b * (k_type == CACHE_Q8_0 ? Q8_0_BYTES : Q4_0_BYTES);
#pragma unroll 4
            for (int t = 0; t < 32; t++) {
              const int qv = k_type == CACHE_Q8_0
                                 ? (int)reinterpret_cast<const int8_t*>(blk + 2)[t]
                                 : (t < 16 ? blk[2 + t] & 15 : blk[2 + t - 16] >> 4) - 8;
              bs += qs[i * hd + b * 32 + t] * (float)qv;
            }
            dot += load_half(blk) * bs;
          }
        }
        s = dot * scale;
      }
      const float cm = warp_max(s);
      if (cm == NEG_INF) continue;  // warp-uniform: no visible key in this chunk
      const float m_new = fmaxf(m[a], cm);
      const float corr = expf(m[a] - m_new);  // 0 while m is -inf
      const float p = valid ? expf(s - m_new) : 0.0f;
      l[a] = l[a] * corr + warp_sum(p);
      ps[warp][lane] = p;
      __syncwarp();
#pragma unroll
      for (int e = 0; e < ATTN_MAX_HD / 32; e++) acc[a][e] *= corr;
      // Key by key (not unrolled: code size), a lane's values lane, lane + 32, ... of each.
#pragma unroll 1
      for (int j = 0; j < n; j++) {
        const float pj = ps[warp][j];
        const uint8_t* vr = reinterpret_cast<const uint8_t*>(vs + j * vw);
#pragma unroll
        for (int e = 0; e < ATTN_MAX_HD / 32; e++) {
          const int d = lane + 32 * e;
          if (d < hd) acc[a][e] += pj * cache_value(v_type, vr, d);
        }
      }
      __syncwarp();  // ps is rewritten by the next query
      m[a] = m_new;
    }
  }
#pragma unroll
  for (int a = 0; a < 2; a++) {
    const int i = warp + 4 * a;
    if (i >= nq) continue;  // warp-uniform
#pragma unroll
    for (int e = 0; e < ATTN_MAX_HD / 32; e++) {
      const int d = lane + 32 * e;
      if (d < hd) {  // warp-uniform: head_dim is a multiple of 32
        const float x = v_type != CACHE_F16 ? unrotate_warp(acc[a][e]) : acc[a][e];
        out[(size_t)(q0 + i) * n_head * hd + (size_t)h * hd + d] = l[a] > 0.0f ? x / l[a] : 0.0f;
      }
    }
  }
}
EMU_EXPORT(attn_prefill_q)
