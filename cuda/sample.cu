// Token sampling on the device: the CPU sampler's chain (src/engine/sampler.rs) for one row of
// logits per block, each row with its own sampler (the rows of a batched decode step are different
// requests'), so that only the chosen ids come back to the host. Penalties from the row's
// penalty window, then greedy argmax, or an exact top-k (4-pass radix select, ties by ascending id)
// sorted as the CPU sorts it, top-p and min-p on the temperature-1 weights, temperature, and the
// draw from a xoshiro256** state kept in device memory and advanced once per non-greedy sample.
// Every float and double operation the CPU does is done here in the same order with explicitly
// rounded intrinsics (no fused multiply-adds), so the same logits and state give the same token.
#include "common.cuh"

/// Threads per block of `sample` (a multiple of 32).
#define SAMPLE_THREADS 512
/// Largest top-k the device samples (the candidate list lives in shared memory); the host
/// samples larger or disabled top-k itself.
#define SAMPLE_MAX_K 1024

/// NaN and -inf to -FLT_MAX, +inf to FLT_MAX (the CPU's `sanitize`: fmaxf/fminf return the
/// non-NaN operand).
__device__ __forceinline__ float sample_sanitize(float x) {
  return fminf(fmaxf(x, -3.40282347e+38f), 3.40282347e+38f);
}

/// The CPU sampler's `exp_neg` operation for operation: e^x for x <= 0 (clamped), 0 below -87.
__device__ __forceinline__ float sample_exp_neg(float x) {
  const float LOG2E = 1.44269504088896340736f, LN2_HI = 0.6933594f, LN2_LO = -2.1219444e-4f;
  const float ROUND = 12582912.0f;
  const bool flush = x < -87.0f;
  if (x < -87.0f) x = -87.0f;
  if (x > 0.0f) x = 0.0f;
  const float t = __fadd_rn(__fmul_rn(x, LOG2E), ROUND);
  const float n = __fsub_rn(t, ROUND);
  const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
  float p = 1.9875691e-4f;
  p = __fadd_rn(__fmul_rn(p, r), 1.3982e-3f);
  p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
  p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
  p = __fadd_rn(__fmul_rn(p, r), 0.16666665f);
  p = __fadd_rn(__fmul_rn(p, r), 0.5f);
  float y = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
  const unsigned e = (unsigned)(__float_as_int(t) - __float_as_int(ROUND) + 127);
  y = __fmul_rn(y, __int_as_float((int)(e << 23)));
  return flush ? 0.0f : y;
}

/// Order-preserving key of a (finite) float: a larger float has a larger key; -0 is below +0
/// (Rust's `total_cmp`, the order the CPU sorts candidates in).
__device__ __forceinline__ unsigned sample_key(float v) {
  const unsigned b = (unsigned)__float_as_int(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float sample_key_value(unsigned k) {
  return __int_as_float((int)((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k));
}

/// The key top-k selects by: -0 and +0 equal (the CPU's heap compares with `<` and `==`).
__device__ __forceinline__ unsigned sample_select_key(float v) {
  return sample_key(v == 0.0f ? 0.0f : v);
}

__device__ __forceinline__ unsigned long long sample_rotl(unsigned long long x, int k) {
  return (x << k) | (x >> (64 - k));
}

/// xoshiro256** step (the CPU's `Rng::next_u64`).
__device__ __forceinline__ unsigned long long sample_next_u64(unsigned long long* s) {
  const unsigned long long result = sample_rotl(s[1] * 5ull, 7) * 9ull;
  const unsigned long long t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = sample_rotl(s[3], 45);
  return result;
}

/// One row to sample (`ops::SampleRow` on the host writes it, 72 bytes): where its logits, RNG
/// state and penalty window are, and its sampler's parameters. Rows of one launch may belong to
/// different requests, so each carries its own.
struct SampleRow {
  unsigned long long row;     // its row of x (n floats), penalised in place
  unsigned long long rng;     // u64[4]: its xoshiro256** state
  unsigned long long win;     // int[wlen]: its penalty window
  int wlen, pen, k, pad;
  float repeat_penalty, frequency_penalty, presence_penalty, top_p, min_p, ln_min_p, inv_temp, pad2;
};

/// One token for each row of `rows` (rows of n logits in `x`), as the CPU `Sampler::sample` picks
/// it. The table holds no activation address, so a step whose rows, RNG states and windows are the
/// last step's (greedy without penalties, say) launches on the table already uploaded.
/// - Penalties: `win` holds the row's penalty window (the last repeat_last_n history tokens, ids
///   outside the vocabulary ignored); each distinct id's logit is penalised once, in place in
///   the logits (the row is not the model's output any more afterwards).
/// - `k == 0`: greedy, the lowest id of the largest penalised logit; the RNG is not touched.
/// - `1 <= k <= SAMPLE_MAX_K`, `k < n`: the k best (descending logit, ties by ascending id),
///   then top-p (`top_p < 1`), min-p (`min_p > 0`, with `ln_min_p = ln(min_p)` from the host,
///   whose `ln` the device does not have bit for bit), weights at temperature 1 / `inv_temp`,
///   and a draw with the row's `rng` (advanced once).
/// `pen` = 1 when any penalty is on (the CPU skips the subtraction when frequency and presence
/// are both 0). grid (rows), block (SAMPLE_THREADS); out: one int a row.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample(const SampleRow* __restrict__ rows, float* x, int n, int* __restrict__ out) {
  PDL_ENTRY();
  __shared__ unsigned long long cand[SAMPLE_MAX_K];
  __shared__ float w1[SAMPLE_MAX_K];
  __shared__ float wt[SAMPLE_MAX_K];
  __shared__ unsigned hist[256];
  __shared__ int counts[SAMPLE_THREADS];
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ unsigned sel_prefix, sel_mask, sel_need, n_above;
  const int tid = threadIdx.x;
  const SampleRow row = rows[blockIdx.x];
  float* xr = x + (size_t)row.row * n;
  const int* win = reinterpret_cast<const int*>(row.win);
  const int wlen = row.wlen, pen = row.pen, k = row.k;
  const float repeat_penalty = row.repeat_penalty, frequency_penalty = row.frequency_penalty;
  const float presence_penalty = row.presence_penalty, top_p = row.top_p, min_p = row.min_p;
  const float ln_min_p = row.ln_min_p, inv_temp = row.inv_temp;

  // Penalties: thread i takes window position i if it is its id's first occurrence.
  if (pen && wlen > 0) {
    const int* w = win;
    for (int i = tid; i < wlen; i += blockDim.x) {
      const int id = w[i];
      if (id < 0 || id >= n) continue;
      bool first = true;
      for (int j = 0; j < i && first; j++) first = w[j] != id;
      if (!first) continue;
      int count = 0;
      for (int j = 0; j < wlen; j++) count += w[j] == id;
      const float l = sample_sanitize(xr[id]);
      float v = l <= 0.0f ? __fmul_rn(l, repeat_penalty) : __fdiv_rn(l, repeat_penalty);
      if (frequency_penalty != 0.0f || presence_penalty != 0.0f)
        v = __fsub_rn(v, __fadd_rn(__fmul_rn((float)count, frequency_penalty), presence_penalty));
      xr[id] = sample_sanitize(v);
    }
    __syncthreads();
  }

  if (k <= 0) {
    // Greedy: ties (±0 included) to the lowest id.
    float best = -3.40282347e+38f;
    int bi = 0x7fffffff;
    for (int i = tid; i < n; i += blockDim.x) {
      const float v = sample_sanitize(xr[i]);
      if (v > best || (v == best && i < bi)) {
        best = v;
        bi = i;
      }
    }
    block_argmax(best, bi, sv, si);
    if (tid == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
    return;
  }

  // Radix select (8 bits a pass, most significant first) of the k-th largest select key: after
  // four passes sel_prefix is that key and sel_need how many of the values equal to it are kept
  // (the lowest ids).
  if (tid == 0) {
    sel_prefix = 0;
    sel_mask = 0;
    sel_need = (unsigned)k;
    n_above = 0;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const unsigned prefix = sel_prefix, mask = sel_mask;
    for (int i = tid; i < n; i += blockDim.x) {
      const unsigned key = sample_select_key(sample_sanitize(xr[i]));
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      unsigned above = 0, need = sel_need;
      int b = 255;
      for (; b > 0; b--) {
        if (above + hist[b] >= need) break;
        above += hist[b];
      }
      sel_need = need - above;
      sel_prefix = prefix | ((unsigned)b << shift);
      sel_mask = mask | (255u << shift);
    }
    __syncthreads();
  }
  const unsigned threshold = sel_prefix, need = sel_need;
  const unsigned n_gt = (unsigned)k - need;

  // Gather: every value above the threshold (any order), then the `need` lowest ids equal to it
  // (each thread scans a contiguous run of ids, ranked by a scan of the per-thread counts).
  for (int i = tid; i < n; i += blockDim.x) {
    const float v = sample_sanitize(xr[i]);
    if (sample_select_key(v) > threshold) {
      const unsigned slot = atomicAdd(&n_above, 1u);
      cand[slot] = ((unsigned long long)sample_key(v) << 32) | (unsigned)~i;
    }
  }
  const int chunk = (n + (int)blockDim.x - 1) / (int)blockDim.x;
  const int lo = tid * chunk, hi = min(n, lo + chunk);
  int eq = 0;
  for (int i = lo; i < hi; i++) eq += sample_select_key(sample_sanitize(xr[i])) == threshold;
  counts[tid] = eq;
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int t = 0; t < (int)blockDim.x; t++) {
      const int c = counts[t];
      counts[t] = run;
      run += c;
    }
  }
  __syncthreads();
  {
    unsigned rank = (unsigned)counts[tid];
    for (int i = lo; i < hi && rank < need; i++) {
      const float v = sample_sanitize(xr[i]);
      if (sample_select_key(v) == threshold) {
        cand[n_gt + rank] = ((unsigned long long)sample_key(v) << 32) | (unsigned)~i;
        rank++;
      }
    }
  }
  int p2 = 1;
  while (p2 < k) p2 <<= 1;
  for (int i = k + tid; i < p2; i += blockDim.x) cand[i] = 0ull;  // below every real key
  __syncthreads();

  // Bitonic sort, descending: value (total order) first, then ascending id (the low word is ~id).
  for (int size = 2; size <= p2; size <<= 1) {
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      for (int i = tid; i < p2; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long a = cand[i], b = cand[j];
          const bool desc = (i & size) == 0;
          if (desc ? a < b : a > b) {
            cand[i] = b;
            cand[j] = a;
          }
        }
      }
      __syncthreads();
    }
  }

  // Weights at temperature 1 (top-p) and at the sampling temperature, in parallel; the sums over
  // them are sequential in candidate order below, as on the CPU.
  const float max_logit = sample_key_value((unsigned)(cand[0] >> 32));
  for (int i = tid; i < k; i += blockDim.x) {
    const float d = __fsub_rn(sample_key_value((unsigned)(cand[i] >> 32)), max_logit);
    w1[i] = sample_exp_neg(d);
    wt[i] = sample_exp_neg(__fmul_rn(d, inv_temp));
  }
  __syncthreads();
  if (tid != 0) return;
  int len = k;
  if (top_p < 1.0f && len > 1) {
    double sum = 0.0;
    for (int i = 0; i < len; i++) sum = __dadd_rn(sum, (double)w1[i]);
    const double target = __dmul_rn((double)top_p, sum);
    double cum = 0.0;
    for (int i = 0; i < len; i++) {
      cum = __dadd_rn(cum, (double)w1[i]);
      if (cum >= target) {
        len = i + 1;
        break;
      }
    }
  }
  if (min_p > 0.0f && len > 1) {
    const float min_logit = __fadd_rn(max_logit, ln_min_p);
    int keep = 0;
    while (keep < len && sample_key_value((unsigned)(cand[keep] >> 32)) >= min_logit) keep++;
    len = max(keep, 1);
  }
  double sum = 0.0;
  for (int i = 0; i < len; i++) sum = __dadd_rn(sum, (double)wt[i]);
  unsigned long long* s = reinterpret_cast<unsigned long long*>(row.rng);
  unsigned long long st[4] = {s[0], s[1], s[2], s[3]};
  const double u = __dmul_rn((double)(sample_next_u64(st) >> 11), 1.0 / 9007199254740992.0);
  s[0] = st[0];
  s[1] = st[1];
  s[2] = st[2];
  s[3] = st[3];
  const double target = __dmul_rn(u, sum);
  double cum = 0.0;
  int pick = -1;
  for (int i = 0; i < len; i++) {
    cum = __dadd_rn(cum, (double)wt[i]);
    if (cum > target) {
      pick = i;
      break;
    }
  }
  if (pick < 0) {
    // Only through rounding with the target just under the sum: the last positive weight.
    pick = 0;
    for (int i = len - 1; i >= 0; i--)
      if (wt[i] > 0.0f) {
        pick = i;
        break;
      }
  }
  out[blockIdx.x] = (int)~(unsigned)(cand[pick] & 0xffffffffull);
}
EMU_EXPORT(sample)
