//! Token sampling: repetition, frequency and presence penalties, top-k, top-p, min-p,
//! temperature and the seeded draw.
//!
//! Owns the sampler chain and its random state. The chain follows llama.cpp's default order and
//! definitions: penalties → DRY → top-k → (typical: off) → top-p → min-p → temperature → dist, so
//! top-p and min-p see the temperature-1 distribution of the penalised logits, and temperature
//! only reshapes what survives. `temperature <= 0` is greedy argmax over the penalised logits
//! with ties going to the lowest id.
//!
//! Invariants: candidate lists are ordered by descending logit with ties broken by ascending id
//! whenever they are sorted, so every result is a pure function of (config, logits, history,
//! RNG state); the RNG (xoshiro256**, seeded through splitmix64) advances exactly once per
//! non-greedy `sample`; non-finite logits are clamped (NaN and -inf to `f32::MIN`, +inf to
//! `f32::MAX`) so softmax never produces NaN; `sample` reuses buffers owned by the `Sampler`.

use std::cmp::Ordering;
use std::sync::Arc;

use crate::engine::dry::{Dry, DryScratch};

use crate::model::backend::{DeviceSampling, DEVICE_SAMPLE_MAX_K};

/// Sampling parameters. `Default` gives llama.cpp's defaults.
#[derive(Clone, Debug)]
pub struct SamplerConfig {
    /// Softmax temperature; `<= 0` selects greedy argmax.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-likely prefix whose probability mass is `>= top_p`; 1.0 = off.
    pub top_p: f32,
    /// Keep tokens with `p >= min_p * p_max`; 0.0 = off.
    pub min_p: f32,
    /// Divide positive / multiply negative logits of recently seen tokens; 1.0 = off.
    pub repeat_penalty: f32,
    /// How many of the most recent history tokens the penalties (repeat, frequency and
    /// presence) look at; 0 = off.
    pub repeat_last_n: usize,
    /// OpenAI-style presence penalty: subtracted once from the logit of every token that occurs
    /// in the penalty window (after the repeat penalty); 0.0 = off. Valid range [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI-style frequency penalty: subtracted `count` times from the logit of a token that
    /// occurs `count` times in the penalty window (after the repeat penalty); 0.0 = off. Valid
    /// range [-2, 2].
    pub frequency_penalty: f32,
    /// RNG seed; the same seed, config and inputs give the same tokens.
    pub seed: u64,
    /// The DRY repetition penalty (after the penalties above); `None` = off.
    pub dry: Option<Arc<Dry>>,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0x5eed,
            dry: None,
        }
    }
}

impl SamplerConfig {
    /// A seed drawn from the OS-seeded hasher keys and the clock, for callers that want a
    /// different sequence each run (the default seed is fixed, for reproducibility).
    pub fn entropy_seed() -> u64 {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        h.write_u128(now);
        h.finish()
    }
}

/// xoshiro256** (Blackman & Vigna), seeded with splitmix64.
#[derive(Clone, Debug)]
struct Rng {
    s: [u64; 4],
}

impl Rng {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut splitmix = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        Rng {
            s: [splitmix(), splitmix(), splitmix(), splitmix()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct Cand {
    id: u32,
    logit: f32,
}

/// Descending logit, ties by ascending id. Logits are finite here (see `sanitize`).
fn better_first(a: &Cand, b: &Cand) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// `a` ranks strictly below `b` (lower logit, or equal logit and higher id).
fn worse(a: &Cand, b: &Cand) -> bool {
    a.logit < b.logit || (a.logit == b.logit && a.id > b.id)
}

/// Maps NaN and -inf to `f32::MIN`, +inf to `f32::MAX`; finite values are unchanged.
/// (`f32::clamp` would keep NaN; `max`/`min` return the non-NaN operand, and vectorise.)
#[inline]
#[allow(clippy::manual_clamp)]
fn sanitize(x: f32) -> f32 {
    x.max(f32::MIN).min(f32::MAX)
}

/// `e^x` for `x <= 0` (larger inputs are clamped to 0), within ~2 ulp of `f32::exp`; results
/// for inputs below -87 flush to 0. Branch-free so that the loops over the vocabulary vectorise.
#[inline]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in a part exact in f32 and the rest (Cody-Waite), as in Cephes' expf.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to the nearest integer (kept in the low mantissa bits).
    const ROUND: f32 = 12_582_912.0;
    let flush = x < -87.0;
    let x = x.clamp(-87.0, 0.0);
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_2e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // n is in [-126, 0]: build 2^n from its exponent bits.
    let e = (t.to_bits() as i32 - ROUND.to_bits() as i32 + 127) as u32;
    let y = y * f32::from_bits(e << 23);
    if flush {
        0.0
    } else {
        y
    }
}

/// Reusable working memory for one pass of the chain.
#[derive(Default)]
struct Scratch {
    /// Penalised, sanitised logits (one per vocabulary entry).
    work: Vec<f32>,
    /// The penalty window's ids, sorted (runs of equal ids give the counts).
    recent: Vec<u32>,
    /// Surviving candidates.
    cands: Vec<Cand>,
    /// Unnormalised draw weights of `cands`.
    weights: Vec<f32>,
    /// Top-p histogram mass per bucket.
    mass: Vec<f64>,
    /// Top-p candidates of the bucket holding the cut.
    boundary: Vec<Cand>,
    dry: DryScratch,
}

/// What the chain leaves to draw from.
enum Chain {
    /// Greedy (temperature <= 0): the chosen id.
    Greedy(u32),
    /// `scratch.cands` holds the survivors, sorted by `better_first` iff `sorted`; `max_logit` is
    /// their largest logit.
    Cands { sorted: bool, max_logit: f32 },
}

/// Sift `heap[i]` down in a min-heap ordered by `worse` (root = worst candidate kept).
fn sift_down(heap: &mut [Cand], mut i: usize) {
    loop {
        let l = 2 * i + 1;
        if l >= heap.len() {
            return;
        }
        let r = l + 1;
        let c = if r < heap.len() && worse(&heap[r], &heap[l]) {
            r
        } else {
            l
        };
        if worse(&heap[c], &heap[i]) {
            heap.swap(c, i);
            i = c;
        } else {
            return;
        }
    }
}

/// Lanes for the vectorisable scans below.
const LANES: usize = 16;

/// The largest value of `x` (finite values only, see `sanitize`); `f32::MIN` if empty.
fn max_value(x: &[f32]) -> f32 {
    let mut m = [f32::MIN; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in m.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    tail.iter().chain(&m).fold(f32::MIN, |a, &b| a.max(b))
}

/// Index of the first maximum of `x` (ties to the lowest index).
fn argmax(x: &[f32]) -> usize {
    let m = max_value(x);
    let chunks = x.chunks_exact(LANES);
    let tail_start = x.len() - chunks.remainder().len();
    for (ci, c) in chunks.enumerate() {
        if c.iter().fold(false, |hit, &v| hit | (v == m)) {
            return ci * LANES + c.iter().position(|&v| v == m).unwrap_or(0);
        }
    }
    tail_start + x[tail_start..].iter().position(|&v| v == m).unwrap_or(0)
}

/// The `k` best of `work` into `out`, sorted best first. One pass over the vocabulary; a block
/// of `LANES` logits is only looked at one by one if one of them beats the current k-th best.
fn select_top_k(work: &[f32], k: usize, out: &mut Vec<Cand>) {
    out.clear();
    for (id, &logit) in work.iter().enumerate().take(k) {
        out.push(Cand {
            id: id as u32,
            logit,
        });
    }
    for i in (0..out.len() / 2).rev() {
        sift_down(out, i);
    }
    let mut threshold = out[0].logit;
    let mut offer = |id: usize, logit: f32, threshold: &mut f32| {
        // Ids arrive in ascending order, so an equal logit never beats the kept one.
        if logit > *threshold {
            out[0] = Cand {
                id: id as u32,
                logit,
            };
            sift_down(out, 0);
            *threshold = out[0].logit;
        }
    };
    let rest = &work[k..];
    let chunks = rest.chunks_exact(LANES);
    let tail_start = k + rest.len() - chunks.remainder().len();
    for (ci, c) in chunks.enumerate() {
        if c.iter().fold(false, |any, &v| any | (v > threshold)) {
            let base = k + ci * LANES;
            for (j, &logit) in c.iter().enumerate() {
                offer(base + j, logit, &mut threshold);
            }
        }
    }
    for (id, &logit) in work.iter().enumerate().skip(tail_start) {
        offer(id, logit, &mut threshold);
    }
    out.sort_unstable_by(better_first);
}

/// Above this many unsorted candidates, top-p cuts with a histogram instead of a sort.
const TOP_P_SORT_MAX: usize = 1024;
/// Histogram resolution for the unsorted top-p cut.
const TOP_P_BUCKETS: usize = 4096;
/// Logits this far below the maximum (weight < 1e-27) share the last histogram bucket.
const TOP_P_RANGE: f32 = 64.0;

/// Top-p on a sorted candidate list: keep the smallest prefix with mass >= `p` (at least one).
fn top_p_sorted(cands: &mut Vec<Cand>, max_logit: f32, p: f32) {
    let sum: f64 = cands
        .iter()
        .map(|c| f64::from(exp_neg(c.logit - max_logit)))
        .sum();
    let target = f64::from(p) * sum;
    let mut cum = 0.0f64;
    let mut keep = cands.len();
    for (i, c) in cands.iter().enumerate() {
        cum += f64::from(exp_neg(c.logit - max_logit));
        if cum >= target {
            keep = i + 1;
            break;
        }
    }
    cands.truncate(keep);
}

/// Top-p over the whole vocabulary `work`, without sorting it: bucket every logit by its
/// distance to the maximum (monotonically, best bucket first) accumulating the buckets' mass,
/// find the bucket where the cumulative mass reaches `p`, and sort only that bucket to place the
/// exact cut. Gives the same set as sorting and cutting; the survivors go to `out`, unsorted.
fn top_p_unsorted(
    work: &[f32],
    max_logit: f32,
    p: f32,
    mass: &mut Vec<f64>,
    boundary: &mut Vec<Cand>,
    out: &mut Vec<Cand>,
) {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
    let scale = (TOP_P_BUCKETS - 1) as f32 / TOP_P_RANGE;
    // Rounds (max - l) * scale, clamped to the last bucket; monotone in l, branch-free.
    let bucket = |l: f32| {
        let f = ((max_logit - l) * scale).min((TOP_P_BUCKETS - 1) as f32);
        ((f + ROUND).to_bits() - ROUND.to_bits()) as usize
    };
    // Four interleaved histograms (bucket-major) break the store-to-load dependency between
    // neighbouring tokens that land in the same bucket; weights and bucket indices are computed
    // a block at a time so that part vectorises.
    const WAYS: usize = 4;
    const BLOCK: usize = 64;
    mass.clear();
    mass.resize(TOP_P_BUCKETS * WAYS, 0.0);
    let mut w = [0.0f32; BLOCK];
    let mut bk = [0usize; BLOCK];
    for block in work.chunks(BLOCK) {
        for ((w, bk), &l) in w.iter_mut().zip(bk.iter_mut()).zip(block) {
            *w = exp_neg(l - max_logit);
            *bk = bucket(l);
        }
        for (j, (&w, &b)) in w.iter().zip(&bk).take(block.len()).enumerate() {
            mass[b * WAYS + j % WAYS] += f64::from(w);
        }
    }
    for b in 0..TOP_P_BUCKETS {
        mass[b] = mass[b * WAYS..(b + 1) * WAYS].iter().sum();
    }
    mass.truncate(TOP_P_BUCKETS);
    let target = f64::from(p) * mass.iter().sum::<f64>();
    let mut cum = 0.0f64;
    let mut cut = TOP_P_BUCKETS - 1;
    for (b, &m) in mass.iter().enumerate() {
        if cum + m >= target {
            cut = b;
            break;
        }
        cum += m;
    }
    out.clear();
    boundary.clear();
    for (id, &logit) in work.iter().enumerate() {
        let b = bucket(logit);
        if b <= cut {
            let c = Cand {
                id: id as u32,
                logit,
            };
            if b < cut {
                out.push(c);
            } else {
                boundary.push(c);
            }
        }
    }
    boundary.sort_unstable_by(better_first);
    let mut keep = boundary.len();
    for (i, c) in boundary.iter().enumerate() {
        cum += f64::from(exp_neg(c.logit - max_logit));
        if cum >= target {
            keep = i + 1;
            break;
        }
    }
    out.extend_from_slice(&boundary[..keep.max(1)]);
}

/// Runs the chain up to (not including) the draw.
fn run_chain(cfg: &SamplerConfig, logits: &[f32], history: &[u32], s: &mut Scratch) -> Chain {
    assert!(!logits.is_empty(), "sampler: empty logits");
    let n_vocab = logits.len();

    // Penalties, as llama.cpp's `penalties` sampler (`llama_sampler_penalties_apply`): for each
    // id occurring `count > 0` times in the last `repeat_last_n` history tokens, first the
    // repetition penalty (once, whatever the count), then
    // `logit -= count * frequency_penalty + presence_penalty`.
    s.work.clear();
    s.work.extend(logits.iter().map(|&x| sanitize(x)));
    let penalised =
        cfg.repeat_penalty != 1.0 || cfg.frequency_penalty != 0.0 || cfg.presence_penalty != 0.0;
    if penalised && cfg.repeat_last_n > 0 {
        let window = &history[history.len().saturating_sub(cfg.repeat_last_n)..];
        s.recent.clear();
        s.recent.extend_from_slice(window);
        s.recent.sort_unstable();
        for run in s.recent.chunk_by(|a, b| a == b) {
            let Some(l) = s.work.get_mut(run[0] as usize) else {
                continue;
            };
            let mut v = if *l <= 0.0 {
                *l * cfg.repeat_penalty
            } else {
                *l / cfg.repeat_penalty
            };
            if cfg.frequency_penalty != 0.0 || cfg.presence_penalty != 0.0 {
                v -= run.len() as f32 * cfg.frequency_penalty + cfg.presence_penalty;
            }
            *l = sanitize(v);
        }
    }
    if let Some(d) = &cfg.dry {
        d.apply(&mut s.work, history, &mut s.dry);
    }

    if cfg.temperature <= 0.0 {
        return Chain::Greedy(argmax(&s.work) as u32);
    }

    // Top-k.
    let mut sorted = false;
    let mut top_p_done = false;
    let max_logit;
    if cfg.top_k > 0 && cfg.top_k < n_vocab {
        select_top_k(&s.work, cfg.top_k, &mut s.cands);
        sorted = true;
        max_logit = s.cands[0].logit;
    } else {
        max_logit = max_value(&s.work);
        if cfg.top_p < 1.0 && n_vocab > TOP_P_SORT_MAX {
            top_p_unsorted(
                &s.work,
                max_logit,
                cfg.top_p,
                &mut s.mass,
                &mut s.boundary,
                &mut s.cands,
            );
            top_p_done = true;
        } else {
            // Top-p and min-p both keep a best-first prefix, and top-p's cut depends only on
            // the full distribution, so min-p may filter first when top-p is off.
            let min_logit = if cfg.top_p >= 1.0 && cfg.min_p > 0.0 {
                max_logit + cfg.min_p.ln()
            } else {
                f32::MIN
            };
            s.cands.clear();
            for (id, &logit) in s.work.iter().enumerate() {
                if logit >= min_logit {
                    s.cands.push(Cand {
                        id: id as u32,
                        logit,
                    });
                }
            }
        }
    }

    // Top-p over the temperature-1 distribution: smallest best-first prefix with mass >= p.
    if cfg.top_p < 1.0 && !top_p_done && s.cands.len() > 1 {
        if !sorted {
            s.cands.sort_unstable_by(better_first);
            sorted = true;
        }
        top_p_sorted(&mut s.cands, max_logit, cfg.top_p);
    }

    // Min-p: keep p >= min_p * p_max, i.e. logit >= max_logit + ln(min_p) (the max always stays).
    if cfg.min_p > 0.0 && s.cands.len() > 1 {
        let min_logit = max_logit + cfg.min_p.ln();
        if sorted {
            let keep = s.cands.partition_point(|c| c.logit >= min_logit).max(1);
            s.cands.truncate(keep);
        } else {
            s.cands.retain(|c| c.logit >= min_logit);
        }
    }
    // Top-p and min-p always keep the best candidate, so `max_logit` is still the maximum.
    Chain::Cands { sorted, max_logit }
}

/// Temperature-scaled softmax weight `exp((logit - max) / temp)`, given `inv_temp = 1 / temp`.
#[inline]
fn weight(c: &Cand, max_logit: f32, inv_temp: f32) -> f32 {
    exp_neg((c.logit - max_logit) * inv_temp)
}

/// A seeded sampler; keeps its buffers between calls.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    scratch: Scratch,
}

impl Sampler {
    /// A sampler whose RNG starts from `cfg.seed`.
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = Rng::new(cfg.seed);
        Sampler {
            cfg,
            rng,
            scratch: Scratch::default(),
        }
    }

    /// The configuration this sampler was built with.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token from `logits` (one per vocabulary entry). `history` is every id so
    /// far (prompt + generated), used by the penalties. `temperature <= 0` is greedy.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let max_logit = match run_chain(&self.cfg, logits, history, &mut self.scratch) {
            Chain::Greedy(id) => return id,
            Chain::Cands { max_logit, .. } => max_logit,
        };
        let t = 1.0 / self.cfg.temperature;
        let Scratch { cands, weights, .. } = &mut self.scratch;
        weights.clear();
        weights.extend(cands.iter().map(|c| weight(c, max_logit, t)));
        let sum: f64 = weights.iter().map(|&w| f64::from(w)).sum();
        // Inverse CDF with u in [0, 1): the first candidate whose running sum exceeds u * sum.
        let target = self.rng.next_f64() * sum;
        let mut cum = 0.0f64;
        for (c, &w) in cands.iter().zip(weights.iter()) {
            cum += f64::from(w);
            if cum > target {
                return c.id;
            }
        }
        // Only reachable through rounding with target just under sum: the last positive weight.
        let last = weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        cands[last].id
    }

    /// The distribution `sample` draws from (after penalties, top-k, top-p, min-p and
    /// temperature) as `(id, prob)` sorted by descending probability (ties by ascending id).
    /// Greedy configurations give a single `(argmax, 1.0)`.
    pub fn distribution(&self, logits: &[f32], history: &[u32]) -> Vec<(u32, f32)> {
        let mut s = Scratch::default();
        let (sorted, max_logit) = match run_chain(&self.cfg, logits, history, &mut s) {
            Chain::Greedy(id) => return vec![(id, 1.0)],
            Chain::Cands { sorted, max_logit } => (sorted, max_logit),
        };
        if !sorted {
            s.cands.sort_unstable_by(better_first);
        }
        let t = 1.0 / self.cfg.temperature;
        let sum: f64 = s
            .cands
            .iter()
            .map(|c| f64::from(weight(c, max_logit, t)))
            .sum();
        s.cands
            .iter()
            .map(|c| (c.id, (f64::from(weight(c, max_logit, t)) / sum) as f32))
            .collect()
    }
}

impl Sampler {
    /// A uniform draw in `[0, 1)` from this sampler's RNG (speculative acceptance tests).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// Draws an id from `weights` (`(id, w)` with `w >= 0`, not necessarily normalised) by the
    /// same inverse CDF as [`Sampler::sample`]; advances the RNG once. Used for the residual
    /// distribution of speculative verification. Panics if every weight is zero.
    pub fn draw(&mut self, weights: &[(u32, f32)]) -> u32 {
        let sum: f64 = weights.iter().map(|&(_, w)| f64::from(w)).sum();
        assert!(sum > 0.0, "sampler: drawing from an all-zero distribution");
        let target = self.rng.next_f64() * sum;
        let mut cum = 0.0f64;
        for &(id, w) in weights {
            cum += f64::from(w);
            if cum > target {
                return id;
            }
        }
        let last = weights.iter().rposition(|&(_, w)| w > 0.0).unwrap_or(0);
        weights[last].0
    }

    /// Whether this sampler is greedy (its distribution is always one-hot).
    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature <= 0.0
    }

    /// The parameters for a device sampler that picks exactly the tokens this one would from
    /// here on (its RNG continues from this sampler's current state), or None where the device
    /// cannot: temperature > 0 with top-k off, at or above `n_vocab`, or above
    /// [`DEVICE_SAMPLE_MAX_K`] (the host's unsorted full-vocabulary paths sum their weights in
    /// an order a parallel kernel would have to serialise), a non-finite parameter, or DRY (on
    /// the host only).
    pub fn device_sampling(&self, n_vocab: usize) -> Option<DeviceSampling> {
        let c = &self.cfg;
        if c.dry.as_deref().is_some_and(Dry::active) {
            return None;
        }
        let greedy = c.temperature <= 0.0;
        let inv_temp = if greedy { 1.0 } else { 1.0 / c.temperature };
        let finite = [
            c.temperature,
            c.top_p,
            c.min_p,
            c.repeat_penalty,
            c.frequency_penalty,
            c.presence_penalty,
            inv_temp,
        ]
        .iter()
        .all(|x| x.is_finite());
        if !finite || (!greedy && !(1..n_vocab.min(DEVICE_SAMPLE_MAX_K + 1)).contains(&c.top_k)) {
            return None;
        }
        Some(DeviceSampling {
            top_k: if greedy { 0 } else { c.top_k },
            top_p: c.top_p,
            min_p: c.min_p,
            ln_min_p: if c.min_p > 0.0 { c.min_p.ln() } else { 0.0 },
            inv_temp,
            repeat_penalty: c.repeat_penalty,
            frequency_penalty: c.frequency_penalty,
            presence_penalty: c.presence_penalty,
            penalised: self.penalised(),
            rng: self.rng.s,
        })
    }

    /// Continues from RNG state `s` (a device sampler's, when sampling comes back to the host).
    pub fn set_rng_state(&mut self, s: [u64; 4]) {
        self.rng.s = s;
    }

    fn penalised(&self) -> bool {
        let c = &self.cfg;
        (c.repeat_penalty != 1.0 || c.frequency_penalty != 0.0 || c.presence_penalty != 0.0)
            && c.repeat_last_n > 0
    }

    /// The tokens of `history` the penalties look at: its last `repeat_last_n`, or none when
    /// no penalty is on.
    pub fn penalty_window<'a>(&self, history: &'a [u32]) -> &'a [u32] {
        match self.penalised() {
            true => &history[history.len().saturating_sub(self.cfg.repeat_last_n)..],
            false => &[],
        }
    }
}

/// Log-probabilities under the model's own distribution: the log-softmax of the raw `logits` at
/// temperature 1, before penalties, truncation or temperature (as llama.cpp's server and OpenAI
/// report them), computed in f64. Returns `ln p(chosen)` and the `n` most likely tokens as
/// `(id, ln p)`, most likely first, ties by ascending id. Non-finite logits are sanitized as
/// for sampling, so every value is finite and `<= 0`.
pub fn log_softmax_top(logits: &[f32], chosen: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::MIN, |m, &x| m.max(sanitize(x)));
    let sum: f64 = logits
        .iter()
        .map(|&x| (f64::from(sanitize(x)) - f64::from(max)).exp())
        .sum();
    let lse = f64::from(max) + sum.ln();
    let lp = |id: u32| (f64::from(sanitize(logits[id as usize])) - lse).min(0.0) as f32;
    let n = n.min(logits.len());
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| {
        sanitize(logits[*b as usize])
            .total_cmp(&sanitize(logits[*a as usize]))
            .then(a.cmp(b))
    };
    if n > 0 && n < ids.len() {
        ids.select_nth_unstable_by(n - 1, order);
    }
    ids.truncate(n);
    ids.sort_unstable_by(order);
    (lp(chosen), ids.into_iter().map(|id| (id, lp(id))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 1234,
            dry: None,
        }
    }

    #[test]
    fn dry_runs_after_the_penalties_and_before_greedy() {
        use crate::engine::dry::{DryBreakers, DryParams};
        // Ids 0..4 with no breakers; the history repeats `0 1 2` and ends in `0 1`: 2 would extend
        // a repeat of length 2 and loses multiplier * base^0 = 0.8.
        let breakers = std::sync::Arc::new(DryBreakers::new(Vec::new(), 4, |_| b"x".to_vec()));
        let p = DryParams {
            multiplier: 0.8,
            ..DryParams::default()
        };
        let mut c = cfg(0.0, 0, 1.0, 0.0);
        let logits = [0.0, 0.0, 1.0, 0.5];
        let history = [0, 1, 2, 3, 0, 1];
        assert_eq!(Sampler::new(c.clone()).sample(&logits, &history), 2);
        c.dry = p.with_breakers(breakers);
        assert_eq!(Sampler::new(c.clone()).sample(&logits, &history), 3);
        // The distribution sees the same penalised logits.
        c.temperature = 1.0;
        let d = Sampler::new(c).distribution(&logits, &history);
        let p2 = d.iter().find(|x| x.0 == 2).unwrap().1;
        let p3 = d.iter().find(|x| x.0 == 3).unwrap().1;
        assert!((p3 / p2 - (0.5f32 - 0.2).exp()).abs() < 1e-4, "{d:?}");
    }

    /// Deterministic pseudo-random logits in [-8, 8).
    fn random_logits(n: usize, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed);
        (0..n).map(|_| (r.next_f64() * 16.0 - 8.0) as f32).collect()
    }

    fn softmax(l: &[f32]) -> Vec<f64> {
        let m = l.iter().cloned().fold(f32::MIN, f32::max);
        let e: Vec<f64> = l.iter().map(|&x| f64::from(x - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|x| x / s).collect()
    }

    #[test]
    fn defaults_match_llama_cpp() {
        let c = SamplerConfig::default();
        assert_eq!(
            (c.temperature, c.top_k, c.top_p, c.min_p),
            (0.8, 40, 0.95, 0.05)
        );
        assert_eq!((c.repeat_penalty, c.repeat_last_n), (1.0, 64));
        assert_eq!((c.presence_penalty, c.frequency_penalty), (0.0, 0.0));
    }

    #[test]
    fn rng_matches_reference_vectors() {
        // splitmix64(0) first outputs, from the reference implementation.
        let mut x = 0u64;
        let mut sm = || {
            x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        assert_eq!(sm(), 0xe220_a839_7b1d_cdaf);
        // xoshiro256** from state [1, 2, 3, 4]: reference outputs.
        let mut r = Rng { s: [1, 2, 3, 4] };
        let got: Vec<u64> = (0..3).map(|_| r.next_u64()).collect();
        assert_eq!(got, vec![11520, 0, 1509978240]);
        let mut r = Rng::new(7);
        for _ in 0..1000 {
            let u = r.next_f64();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn greedy_is_argmax_with_lowest_id_on_ties() {
        let mut s = Sampler::new(cfg(0.0, 40, 0.95, 0.05));
        assert_eq!(s.sample(&[0.1, 2.0, -1.0, 1.9], &[]), 1);
        assert_eq!(s.sample(&[0.5, 3.0, 3.0, 3.0, 1.0], &[]), 1);
        assert_eq!(s.sample(&[7.0, 7.0], &[]), 0);
        let neg = Sampler::new(cfg(-1.0, 0, 1.0, 0.0));
        let l = random_logits(5000, 3);
        let arg = (0..l.len())
            .max_by(|&a, &b| l[a].total_cmp(&l[b]).then(b.cmp(&a)))
            .unwrap() as u32;
        assert_eq!(neg.distribution(&l, &[]), vec![(arg, 1.0)]);
        // NaN never wins; +inf does.
        assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NEG_INFINITY], &[]), 1);
        assert_eq!(s.sample(&[1.0, f32::INFINITY, 2.0], &[]), 1);
    }

    #[test]
    fn penalties_apply_before_greedy() {
        let mut c = cfg(0.0, 0, 1.0, 0.0);
        c.repeat_penalty = 2.0;
        c.repeat_last_n = 2;
        let mut s = Sampler::new(c);
        // Token 0 (logit 3) is in the window: 3 / 2 = 1.5 < 2.0, so token 1 wins.
        assert_eq!(s.sample(&[3.0, 2.0, 1.0], &[0]), 1);
        // Token 0 is outside the last-2 window: no penalty.
        assert_eq!(s.sample(&[3.0, 2.0, 1.0], &[0, 2, 2]), 0);
    }

    #[test]
    fn fixed_seed_repeats_and_different_seeds_differ() {
        let l = random_logits(1000, 9);
        let c = SamplerConfig {
            temperature: 1.5,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..SamplerConfig::default()
        };
        let run = |seed: u64| {
            let mut s = Sampler::new(SamplerConfig { seed, ..c.clone() });
            (0..200).map(|_| s.sample(&l, &[])).collect::<Vec<u32>>()
        };
        let a = run(42);
        assert_eq!(a, run(42));
        assert_ne!(a, run(43));
        // With flat-ish logits many distinct tokens appear.
        let mut distinct = a.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 30, "{}", distinct.len());
    }

    #[test]
    fn draw_follows_the_weights() {
        let mut s = Sampler::new(cfg(1.0, 0, 1.0, 0.0));
        let w = [(7u32, 3.0f32), (2, 0.0), (9, 1.0)];
        let mut counts = [0usize; 3];
        let n = 40_000;
        for _ in 0..n {
            match s.draw(&w) {
                7 => counts[0] += 1,
                9 => counts[2] += 1,
                other => panic!("drew {other}, which has weight 0"),
            }
        }
        // 0.75 and 0.25 within 4.5 standard deviations (sd = sqrt(n * 0.75 * 0.25) ~ 87).
        assert!(
            (counts[0] as f64 - 0.75 * n as f64).abs() < 390.0,
            "{counts:?}"
        );
        let u = s.uniform();
        assert!((0.0..1.0).contains(&u));
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let greedy = Sampler::new(cfg(0.0, 0, 1.0, 0.0));
        let mut k1 = Sampler::new(cfg(5.0, 1, 1.0, 0.0));
        let mut g = Sampler::new(cfg(0.0, 0, 1.0, 0.0));
        for seed in 0..20 {
            let l = random_logits(3000, seed);
            let want = g.sample(&l, &[]);
            assert_eq!(k1.sample(&l, &[]), want);
            assert_eq!(greedy.distribution(&l, &[]), vec![(want, 1.0)]);
        }
    }

    #[test]
    fn top_k_selects_the_k_largest_in_order() {
        let l = random_logits(10_000, 5);
        let s = Sampler::new(cfg(1.0, 40, 1.0, 0.0));
        let d = s.distribution(&l, &[]);
        let mut ids: Vec<u32> = (0..l.len() as u32).collect();
        ids.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        let want: Vec<u32> = ids[..40].to_vec();
        assert_eq!(d.iter().map(|p| p.0).collect::<Vec<_>>(), want);
        let total: f32 = d.iter().map(|p| p.1).sum();
        assert!((total - 1.0).abs() < 1e-5);
        // Probabilities are the softmax restricted to the kept set.
        let kept: Vec<f32> = want.iter().map(|&i| l[i as usize]).collect();
        for (p, q) in d.iter().zip(softmax(&kept)) {
            assert!((f64::from(p.1) - q).abs() < 1e-6);
        }
        // Ties in top-k resolve to lower ids.
        let d = Sampler::new(cfg(1.0, 2, 1.0, 0.0)).distribution(&[1.0, 5.0, 5.0, 5.0], &[]);
        assert_eq!(d.iter().map(|p| p.0).collect::<Vec<_>>(), vec![1, 2]);
    }

    #[test]
    fn sampling_matches_softmax_chi_square() {
        // logits chosen so probabilities are ~[0.5, 0.25, 0.125, 0.0625, 0.0625]
        let l: Vec<f32> = [0.5f64, 0.25, 0.125, 0.0625, 0.0625]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        let want = softmax(&l);
        let mut s = Sampler::new(SamplerConfig {
            seed: 77,
            ..cfg(1.0, 0, 1.0, 0.0)
        });
        let n = 20_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[s.sample(&l, &[]) as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(&want)
            .map(|(&o, &p)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum();
        // 4 degrees of freedom: the 99.9% quantile is 18.47.
        assert!(chi2 < 18.47, "chi2 = {chi2}, counts = {counts:?}");
        // And the distribution reports the same probabilities.
        let d = s.distribution(&l, &[]);
        for (id, p) in d {
            assert!((f64::from(p) - want[id as usize]).abs() < 1e-6);
        }
    }

    #[test]
    fn temperature_scales_logits() {
        let l = [2.0f32, 1.0, 0.0];
        let d = Sampler::new(cfg(0.5, 0, 1.0, 0.0)).distribution(&l, &[]);
        let want = softmax(&[4.0, 2.0, 0.0]);
        for (i, (id, p)) in d.iter().enumerate() {
            assert_eq!(*id, i as u32);
            assert!((f64::from(*p) - want[i]).abs() < 1e-6);
        }
    }

    #[test]
    fn top_p_keeps_smallest_prefix_reaching_p() {
        // probs: 0.5, 0.25, 0.125, 0.0625, 0.0625
        let l: Vec<f32> = [0.0625f64, 0.5, 0.125, 0.25, 0.0625]
            .iter()
            .map(|p| p.ln() as f32)
            .collect();
        let ids = |top_p: f32, top_k: usize| {
            Sampler::new(cfg(1.0, top_k, top_p, 0.0))
                .distribution(&l, &[])
                .iter()
                .map(|p| p.0)
                .collect::<Vec<u32>>()
        };
        for k in [0, 4] {
            assert_eq!(ids(0.45, k), vec![1]);
            assert_eq!(ids(0.6, k), vec![1, 3]);
            assert_eq!(ids(0.74, k), vec![1, 3]);
            assert_eq!(ids(0.8, k), vec![1, 3, 2]);
            assert_eq!(ids(0.1, k), vec![1]); // at least one
        }
        assert_eq!(ids(0.99, 0), vec![1, 3, 2, 0, 4]);
        // Renormalised over the kept set.
        let d = Sampler::new(cfg(1.0, 0, 0.8, 0.0)).distribution(&l, &[]);
        let p: Vec<f32> = d.iter().map(|x| x.1).collect();
        for (got, want) in p.iter().zip([4.0 / 7.0, 2.0 / 7.0, 1.0 / 7.0]) {
            assert!((got - want).abs() < 1e-6, "{p:?}");
        }
    }

    #[test]
    fn top_p_on_a_large_unsorted_vocabulary() {
        // Mass spread wide enough that the 256-candidate head is not enough.
        let l = random_logits(5000, 11);
        let d = Sampler::new(cfg(1.0, 0, 0.9, 0.0)).distribution(&l, &[]);
        let p = softmax(&l);
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        let mut cum = 0.0;
        let mut keep = 0;
        for &i in &order {
            cum += p[i];
            keep += 1;
            if cum >= 0.9 {
                break;
            }
        }
        assert!(keep > 256, "test needs a wide distribution, got {keep}");
        assert_eq!(d.len(), keep);
        assert!(d.iter().zip(&order).all(|(a, &b)| a.0 == b as u32));
        // A peaked one resolved within the head.
        let mut peaked = random_logits(5000, 12);
        peaked[4321] = 30.0;
        let d = Sampler::new(cfg(1.0, 0, 0.9, 0.0)).distribution(&peaked, &[]);
        assert_eq!(d, vec![(4321, 1.0)]);
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let want = f64::from(x).exp();
            let got = f64::from(exp_neg(x));
            worst = worst.max((got - want).abs() / want);
        }
        assert!(worst < 4e-7, "max relative error {worst}");
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(-100.0), 0.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_neg(5.0), 1.0); // clamped to 0
    }

    #[test]
    fn histogram_top_p_matches_sorting() {
        // Reference: sort everything, cut the smallest prefix reaching p.
        fn reference(l: &[f32], p: f32) -> Vec<u32> {
            let m = l.iter().cloned().fold(f32::MIN, f32::max);
            let mut c: Vec<Cand> = l
                .iter()
                .enumerate()
                .map(|(id, &logit)| Cand {
                    id: id as u32,
                    logit,
                })
                .collect();
            c.sort_by(better_first);
            top_p_sorted(&mut c, m, p);
            let mut ids: Vec<u32> = c.iter().map(|c| c.id).collect();
            ids.sort_unstable();
            ids
        }
        let mut cases: Vec<Vec<f32>> = vec![
            random_logits(20_000, 1),
            vec![0.5; 3000],
            random_logits(3000, 2).iter().map(|x| x * 0.01).collect(),
        ];
        let mut masked = random_logits(5000, 3);
        for (i, l) in masked.iter_mut().enumerate() {
            if i % 3 == 0 {
                *l = f32::MIN;
            }
        }
        cases.push(masked);
        let mut peaked = random_logits(5000, 4);
        peaked[17] = 12.0;
        peaked[4000] = 11.5;
        cases.push(peaked);
        let mut quantised: Vec<f32> = random_logits(4000, 5).iter().map(|x| x.round()).collect();
        quantised[0] = 9.0;
        cases.push(quantised);
        let mut s = Scratch::default();
        for (ci, l) in cases.iter().enumerate() {
            for p in [0.05f32, 0.5, 0.9, 0.95, 0.999] {
                let m = max_value(l);
                top_p_unsorted(l, m, p, &mut s.mass, &mut s.boundary, &mut s.cands);
                let mut got: Vec<u32> = s.cands.iter().map(|c| c.id).collect();
                got.sort_unstable();
                assert_eq!(got, reference(l, p), "case {ci}, p {p}");
            }
        }
    }

    #[test]
    fn argmax_and_max_value_on_odd_lengths() {
        for n in [1usize, 15, 16, 17, 33, 100] {
            let mut l = vec![0.0f32; n];
            l[n - 1] = 1.0;
            assert_eq!(argmax(&l), n - 1);
            assert_eq!(max_value(&l), 1.0);
            l[n / 2] = 1.0;
            assert_eq!(argmax(&l), n / 2);
        }
        assert_eq!(argmax(&[f32::MIN, f32::MIN]), 0);
    }

    #[test]
    fn min_p_cuts_relative_to_the_max() {
        // probs ∝ 1, 0.5, 0.1, 0.04 (relative to the max).
        let l: Vec<f32> = [0.04f32, 1.0, 0.1, 0.5].iter().map(|p| p.ln()).collect();
        let ids = |min_p: f32, top_k: usize| {
            Sampler::new(cfg(1.0, top_k, 1.0, min_p))
                .distribution(&l, &[])
                .iter()
                .map(|p| p.0)
                .collect::<Vec<u32>>()
        };
        for k in [0, 3, 4] {
            assert_eq!(ids(0.05, k), vec![1, 3, 2]);
            assert_eq!(ids(0.09, k), vec![1, 3, 2]);
            assert_eq!(ids(0.2, k), vec![1, 3]);
            assert_eq!(ids(0.6, k), vec![1]);
            assert_eq!(ids(1.0, k), vec![1]);
        }
        assert_eq!(ids(0.03, 0), vec![1, 3, 2, 0]);
    }

    #[test]
    fn temperature_applies_after_min_p() {
        // Relative probs at T=1: 1, 0.5, 0.1. min_p = 0.2 cuts id 2 even though a high temperature
        // would have lifted it above 0.2 * p_max.
        let l: Vec<f32> = [1.0f32, 0.5, 0.1].iter().map(|p| p.ln()).collect();
        let d = Sampler::new(cfg(10.0, 0, 1.0, 0.2)).distribution(&l, &[]);
        assert_eq!(d.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn penalty_changes_exactly_the_right_logits() {
        let l = [2.0f32, -2.0, 4.0, -1.0, 0.0, 3.0];
        let mut c = cfg(1.0, 0, 1.0, 0.0);
        c.repeat_penalty = 2.0;
        c.repeat_last_n = 4;
        // Window = last 4 = [1, 2, 2, 4]; token 0 is older and 5 absent. Each token once.
        let history = [0u32, 5, 1, 2, 2, 4, 999];
        let mut scratch = Scratch::default();
        let window_history = &history[..6];
        run_chain(&c, &l, window_history, &mut scratch);
        assert_eq!(scratch.work, vec![2.0, -4.0, 2.0, -1.0, 0.0, 3.0]);
        // Out-of-vocabulary ids in the history are ignored.
        run_chain(&c, &l, &history, &mut scratch);
        assert_eq!(scratch.work, vec![2.0, -2.0, 2.0, -1.0, 0.0, 3.0]);
        // And the distribution follows the penalised logits.
        let d = Sampler::new(c).distribution(&l, window_history);
        let want = softmax(&[2.0, -4.0, 2.0, -1.0, 0.0, 3.0]);
        for (id, p) in d {
            assert!((f64::from(p) - want[id as usize]).abs() < 1e-6);
        }
    }

    /// The penalised logits `run_chain` leaves in `scratch.work`.
    fn penalised(c: &SamplerConfig, l: &[f32], history: &[u32]) -> Vec<f32> {
        let mut scratch = Scratch::default();
        run_chain(c, l, history, &mut scratch);
        scratch.work
    }

    #[test]
    fn frequency_and_presence_penalties_subtract_count_and_presence() {
        let l = [1.0f32, -1.0, 0.5, 2.0, -3.0, 4.0, 0.0, 1.5];
        let mut c = cfg(1.0, 0, 1.0, 0.0);
        c.frequency_penalty = 0.5;
        c.presence_penalty = 0.25;
        // Token 5 twice: 4 - (2 * 0.5 + 0.25) = 2.75; token 7 once: 1.5 - (0.5 + 0.25) = 0.75.
        let want = [1.0f32, -1.0, 0.5, 2.0, -3.0, 2.75, 0.0, 0.75];
        assert_eq!(penalised(&c, &l, &[5, 5, 7]), want);
        // Only the last `repeat_last_n` tokens count: of [1, 5, 5, 5, 7] the last 3 are [5, 5, 7].
        c.repeat_last_n = 3;
        assert_eq!(penalised(&c, &l, &[1, 5, 5, 5, 7]), want);
        // A count of 3: 4 - (3 * 0.5 + 0.25) = 2.25; id 1 (now in the window): -1 - 0.75.
        c.repeat_last_n = 5;
        assert_eq!(
            penalised(&c, &l, &[1, 5, 5, 5, 7]),
            [1.0, -1.75, 0.5, 2.0, -3.0, 2.25, 0.0, 0.75]
        );
        // Negative penalties raise the logits: 4 + (2 * 0.5 + 0.25), 1.5 + 0.75.
        c.repeat_last_n = 64;
        c.frequency_penalty = -0.5;
        c.presence_penalty = -0.25;
        assert_eq!(
            penalised(&c, &l, &[5, 5, 7]),
            [1.0, -1.0, 0.5, 2.0, -3.0, 5.25, 0.0, 2.25]
        );
        // `repeat_last_n = 0` turns every penalty off, as in llama.cpp.
        c.repeat_last_n = 0;
        assert_eq!(penalised(&c, &l, &[5, 5, 7]), l);
        // Out-of-vocabulary ids are ignored; -inf - penalty stays clamped to f32::MIN.
        c.repeat_last_n = 64;
        c.frequency_penalty = 2.0;
        c.presence_penalty = 2.0;
        let w = penalised(&c, &[f32::NEG_INFINITY, 1.0], &[0, 0, 99]);
        assert_eq!(w, [f32::MIN, 1.0]);
    }

    #[test]
    fn repeat_penalty_applies_before_frequency_and_presence() {
        // llama.cpp's order: logit / r (or * r if <= 0), then -= count * f + p.
        let l = [3.0f32, -1.0, 2.0, 1.0];
        let mut c = cfg(1.0, 0, 1.0, 0.0);
        c.repeat_penalty = 2.0;
        c.frequency_penalty = 0.5;
        c.presence_penalty = 0.25;
        // Subtracting first would give (3 - 1.25) / 2 = 0.875, (-1 - 0.75) * 2 = -3.5 and
        // (1 - 0.75) / 2 = 0.125.
        assert_eq!(
            penalised(&c, &l, &[0, 1, 0, 3]),
            [
                0.25,  // twice in the window: 3 / 2 - (2 * 0.5 + 0.25)
                -2.75, // -1 * 2 - (0.5 + 0.25)
                2.0,   // not in the window
                -0.25, // 1 / 2 - (0.5 + 0.25): the penalty flips the sign
            ]
        );
        // Against an independent scalar reference on random inputs (bit-exact: same operations).
        for (seed, rp, f, p, last_n) in [
            (1u64, 1.3f32, 0.4f32, 0.7f32, 16usize),
            (2, 1.0, -0.3, 1.1, 64),
            (3, 0.8, 2.0, -2.0, 5),
            (4, 1.7, 0.0, 0.5, 1000),
        ] {
            let n = 300;
            let l = random_logits(n, seed);
            let mut r = Rng::new(seed + 100);
            // Ids from a small range so that many repeat; some beyond the vocabulary.
            let history: Vec<u32> = (0..200).map(|_| (r.next_u64() % 40) as u32 * 8).collect();
            let mut c = cfg(1.0, 0, 1.0, 0.0);
            (c.repeat_penalty, c.frequency_penalty, c.presence_penalty) = (rp, f, p);
            c.repeat_last_n = last_n;
            let window = &history[history.len().saturating_sub(last_n)..];
            let mut want = l.clone();
            for (id, x) in want.iter_mut().enumerate() {
                let count = window.iter().filter(|&&t| t as usize == id).count();
                if count > 0 {
                    *x = if *x <= 0.0 { *x * rp } else { *x / rp };
                    *x -= count as f32 * f + p;
                }
            }
            assert_eq!(penalised(&c, &l, &history), want, "seed {seed}");
        }
    }

    #[test]
    fn presence_and_frequency_penalties_change_the_greedy_pick() {
        let l = [3.0f32, 2.0, 1.0];
        let mut c = cfg(0.0, 0, 1.0, 0.0);
        assert_eq!(Sampler::new(c.clone()).sample(&l, &[0, 2]), 0);
        c.presence_penalty = 1.5;
        // 3 - 1.5 = 1.5 < 2: token 1.
        assert_eq!(Sampler::new(c.clone()).sample(&l, &[0, 2]), 1);
        // Frequency counts occurrences: once, 3 - 0.6 = 2.4 keeps token 0; twice, 1.8 loses.
        c.presence_penalty = 0.0;
        c.frequency_penalty = 0.6;
        assert_eq!(Sampler::new(c.clone()).sample(&l, &[0]), 0);
        assert_eq!(Sampler::new(c.clone()).sample(&l, &[0, 0]), 1);
        // And the sampled distribution follows the penalised logits.
        c.temperature = 1.0;
        let d = Sampler::new(c).distribution(&l, &[0, 0]);
        let want = softmax(&[3.0 - 1.2, 2.0, 1.0]);
        for (id, p) in d {
            assert!((f64::from(p) - want[id as usize]).abs() < 1e-6);
        }
    }

    #[test]
    fn zero_frequency_and_presence_leave_logits_bit_identical() {
        let mut l = random_logits(4096, 11);
        l[0] = -0.0;
        l[1] = 0.0;
        l[2] = f32::MIN;
        l[3] = f32::MAX;
        let mut r = Rng::new(5);
        let mut history: Vec<u32> = (0..300).map(|_| (r.next_u64() % 64) as u32).collect();
        history.extend([0, 1, 2, 3, 0, 1]);
        let same_bits = |got: &[f32], want: &[f32]| {
            assert_eq!(got.len(), want.len());
            let bad = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits());
            assert!(
                bad.is_none(),
                "id {bad:?}: {got:?} vs {want:?}",
                got = bad.map(|i| got[i]),
                want = bad.map(|i| want[i])
            );
        };
        let mut c = cfg(1.0, 0, 1.0, 0.0);
        // Everything off: the logits pass through untouched.
        same_bits(&penalised(&c, &l, &history), &l);
        // Repeat penalty only: each distinct id in the window once, whatever its count.
        c.repeat_penalty = 1.3;
        let window = &history[history.len() - 64..];
        let mut want = l.clone();
        for (id, x) in want.iter_mut().enumerate() {
            if window.contains(&(id as u32)) {
                // f32::MIN * 1.3 overflows to -inf, which the sampler clamps back to f32::MIN.
                *x = (if *x <= 0.0 { *x * 1.3 } else { *x / 1.3 }).max(f32::MIN);
            }
        }
        same_bits(&penalised(&c, &l, &history), &want);
    }

    #[test]
    fn default_chain_samples_only_from_distribution() {
        let l = random_logits(50_000, 21);
        let hist: Vec<u32> = (0..100).collect();
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 1.3,
            ..SamplerConfig::default()
        });
        let d = s.distribution(&l, &hist);
        assert!(!d.is_empty() && d.len() <= 40);
        assert!(d.windows(2).all(|w| w[0].1 >= w[1].1));
        let allowed: Vec<u32> = d.iter().map(|p| p.0).collect();
        for _ in 0..500 {
            assert!(allowed.contains(&s.sample(&l, &hist)));
        }
    }

    #[test]
    fn log_softmax_top_matches_direct_softmax() {
        let mut l = random_logits(1000, 7);
        l[3] = f32::NEG_INFINITY;
        l[5] = l[9]; // a tie: the lower id first
        let p = softmax(&l);
        let (chosen, top) = log_softmax_top(&l, 42, 10);
        assert!((f64::from(chosen) - p[42].ln()).abs() < 1e-5);
        assert_eq!(top.len(), 10);
        let mut want: Vec<u32> = (0..1000).collect();
        want.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]).then(a.cmp(&b)));
        for (&(id, lp), &w) in top.iter().zip(&want) {
            assert_eq!(id, w);
            assert!((f64::from(lp) - p[w as usize].ln()).abs() < 1e-5);
        }
        let mass: f64 = top.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
        assert!(mass <= 1.0 + 1e-9);
        let (lp3, all) = log_softmax_top(&l, 3, 5000);
        assert!(lp3.is_finite() && lp3 < -1e30);
        assert_eq!(all.len(), 1000);
        let total: f64 = all.iter().map(|&(_, lp)| f64::from(lp).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        assert!(log_softmax_top(&l, 0, 0).1.is_empty());
    }
}
