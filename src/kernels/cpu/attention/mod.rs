//! CPU attention over the paged f16 KV cache, reproducing llama.cpp's CPU flash attention
//! (`ggml_compute_forward_flash_attn_ext_f16`, on by default: `-fa auto` resolves to enabled on the
//! CPU backend) bit for bit. ggml picks one of three kernels per graph, and so does this module:
//!
//! - **tiled** (the forward holds at least [`FA_TILE_Q`] = 64 query rows, i.e. a prompt ubatch of
//!   64+ tokens): Q stays f32; keys are visited in tiles of 64 cells aligned to cell 0; within a
//!   tile each score is one FMA chain over the head dimension, scaled; the tile's softmax uses
//!   ggml's vectorised `ggml_v_expf` and sums the probabilities in f64 per vector of 8 (AVX2) or 16
//!   (AVX-512) lanes; V is accumulated in f32 with one FMA chain per output element.
//! - **one_chunk** (fewer rows, e.g. a short prompt or a decode step over fewer than 512 cells):
//!   Q is rounded to f16, each score is `ggml_vec_dot_f16` (its SIMD summation order), the online
//!   softmax uses libm `expf`, and the V accumulator is f16, rounded after every multiply-add.
//! - **split-KV** (exactly one query row and at least 512 KV cells): the cells are cut into one
//!   chunk per llama.cpp thread, each chunk runs one_chunk, and the partial results are merged.
//!
//! The KV length llama.cpp attends over (`n_kv`) is the used cells padded to 256; with one
//! sequence cell `p` holds position `p`, so keys are visited in position order. Masked cells
//! (outside the causal or sliding window) are skipped, as ggml skips `-inf` mask entries. Limits:
//! llama.cpp's sliding-window cache is a 1024-cell ring, so past 1024 positions its visiting order on
//! sliding-window layers differs from the one used here; several sequences in one batch are each
//! computed as if alone.
//!
//! The tiled kernel first widens the K/V rows its queries can see to f32 (exact), once per
//! sequence, and runs four query rows of a head per unit of work (`rows.rs`); the other
//! two read the f16 cache in place, one (query row, head) per unit (`decode.rs`).

use crate::kernels::cpu::SharedMut;
use half::f16;

mod decode;
pub mod f32_cache;
pub mod quant_cache;
pub mod rotate;
#[cfg(target_arch = "x86_64")]
mod rows;
use half::slice::HalfFloatSliceExt;

use crate::kernels::cpu::backend::{CpuAct, CpuKv};
use crate::kernels::cpu::matmul::STACK_THREADS;
use crate::kernels::cpu::ops::{ggml_isa, v_expf8, GgmlIsa};
use crate::kernels::cpu::threads::pool::{ThreadPool, FINE_CHUNKS};
use crate::model::backend::{AttnQuery, AttnShape};

/// Query rows from which ggml uses the tiled kernel (`GGML_FA_TILE_Q`).
pub const FA_TILE_Q: usize = 64;
/// KV cells per tile of the tiled kernel (`GGML_FA_TILE_KV`).
const FA_TILE_KV: usize = 64;
/// llama.cpp pads the attended KV length to a multiple of this.
const KV_PAD: usize = 256;
/// Minimum KV length of ggml's split-KV decode kernel.
const SPLIT_KV_MIN: usize = 512;

/// The thread count of the llama.cpp run being mimicked, which decides how ggml splits long decode
/// attention (one KV chunk per thread). The reference runs llama.cpp's default on a 2-core machine,
/// so this is 2 unless [`set_llamacpp_threads`] or `INFER_LLAMACPP_THREADS` says otherwise (`N`,
/// as with `llama-cli -t N`, or `native`: llama.cpp's default on this machine, its
/// `common_cpu_get_num_math`, the number of distinct `thread_siblings` sets).
pub fn llamacpp_threads() -> usize {
    use std::sync::atomic::Ordering;
    use std::sync::OnceLock;
    static DEFAULT: OnceLock<usize> = OnceLock::new();
    match THREADS.load(Ordering::Relaxed) {
        0 => *DEFAULT.get_or_init(default_threads),
        n => n,
    }
}

/// Makes the split-KV decode kernel cut the KV cells as llama.cpp running `n` threads does.
pub fn set_llamacpp_threads(n: usize) {
    THREADS.store(n.max(1), std::sync::atomic::Ordering::Relaxed);
}

static THREADS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn default_threads() -> usize {
    match std::env::var("INFER_LLAMACPP_THREADS")
        .ok()
        .as_deref()
        .map(str::trim)
    {
        Some("native") => native_threads(),
        Some(v) => v.parse::<usize>().ok().filter(|&n| n > 0).unwrap_or(2),
        None => 2,
    }
}

/// llama.cpp's default thread count on this machine (`common_cpu_get_num_math` on Linux x86 without
/// hybrid cores).
fn native_threads() -> usize {
    let mut siblings = std::collections::HashSet::new();
    for cpu in 0.. {
        let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings");
        match std::fs::read_to_string(path) {
            Ok(s) => {
                siblings.insert(s.lines().next().unwrap_or("").to_string());
            }
            Err(_) => break,
        }
    }
    if !siblings.is_empty() {
        return siblings.len();
    }
    let n = std::thread::available_parallelism().map_or(4, |n| n.get());
    if n <= 4 {
        n
    } else {
        n / 2
    }
}

/// Which ggml kernel a forward call's attention runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    OneChunk,
    Tiled,
    /// Split-KV decode: `chunk` cells per part, `n_kv` cells in all.
    Split {
        chunk: usize,
        n_kv: usize,
    },
}

/// The kernel a one-row forward runs for `qa`: split-KV from [`SPLIT_KV_MIN`] cells on.
fn one_row_path(qa: &AttnQuery<'_>) -> Path {
    let n_kv = (qa.pos as usize + 1).div_ceil(KV_PAD) * KV_PAD;
    if n_kv >= SPLIT_KV_MIN {
        Path::Split {
            chunk: n_kv.div_ceil(llamacpp_threads()),
            n_kv,
        }
    } else {
        Path::OneChunk
    }
}

/// One sequence's K and V rows of one layer for positions `base..base + n`, widened to f32 (exact)
/// once per call, position-major.
struct SeqKv {
    base: usize,
    k: Vec<f32>,
    v: Vec<f32>,
    /// For the tiled kernel only (else empty): the keys transposed in groups of eight positions
    /// aligned to multiples of 8, `[group][kv head][dim][8]` (groups from `base / 8`), so one
    /// vector load gives eight keys' values of one dimension.
    kt: Vec<f32>,
}

impl SeqKv {
    /// Widens positions `lo..=hi` of the sequence whose blocks are `table`.
    fn new(kv: &CpuKv, layer: usize, table: &[u32], lo: usize, hi: usize) -> SeqKv {
        let (bs, kvd) = (kv.block_size, kv.kv_dim);
        let n = hi + 1 - lo;
        let mut k = vec![0f32; n * kvd];
        let mut v = vec![0f32; n * kvd];
        for (i, p) in (lo..=hi).enumerate() {
            let slot = (table[p / bs] as usize * bs + p % bs) * kvd;
            let dst = i * kvd..(i + 1) * kvd;
            kv.k[layer][slot..slot + kvd].convert_to_f32_slice(&mut k[dst.clone()]);
            kv.v[layer][slot..slot + kvd].convert_to_f32_slice(&mut v[dst]);
        }
        SeqKv {
            base: lo,
            k,
            v,
            kt: Vec::new(),
        }
    }

    /// Builds `kt` for KV heads of `hd` values (`kvd / hd` of them).
    fn transpose_keys(&mut self, kvd: usize, hd: usize) {
        let n = self.k.len() / kvd;
        let (g0, g1) = (self.base / 8, (self.base + n).div_ceil(8));
        self.kt = vec![0f32; (g1 - g0) * 8 * kvd];
        for i in 0..n {
            let p = self.base + i;
            let (g, j) = (p / 8 - g0, p % 8);
            for h in 0..kvd / hd {
                let dst = (g * (kvd / hd) + h) * hd * 8;
                for (d, &x) in self.k[i * kvd + h * hd..i * kvd + (h + 1) * hd]
                    .iter()
                    .enumerate()
                {
                    self.kt[dst + 8 * d + j] = x;
                }
            }
        }
    }
}

/// Read access to one KV head's rows of a [`SeqKv`].
struct Heads<'a> {
    seq: &'a SeqKv,
    kvd: usize,
    off: usize,
    hd: usize,
}

impl Heads<'_> {
    /// The transposed keys of the group of eight positions `8g..8g + 8` (`[dim][8]`), zero where a
    /// position is outside the widened range.
    #[inline]
    fn kt(&self, g: usize) -> &[f32] {
        let heads = self.kvd / self.hd;
        let s = ((g - self.seq.base / 8) * heads + self.off / self.hd) * self.hd * 8;
        &self.seq.kt[s..s + self.hd * 8]
    }

    #[inline]
    fn v(&self, p: usize) -> &[f32] {
        let s = (p - self.seq.base) * self.kvd + self.off;
        &self.seq.v[s..s + self.hd]
    }
}

/// One KV head's rows read in place from the paged f16 cache (the one_chunk and split-KV kernels).
struct Paged<'a> {
    k: &'a [f16],
    v: &'a [f16],
    table: &'a [u32],
    bs: usize,
    kvd: usize,
    off: usize,
    hd: usize,
    /// Whether this thread has not read these rows yet in this call (the first of its units on
    /// this KV head), so they are prefetched as they are scored.
    cold: bool,
    /// A position whose key and value rows (this KV head's) are read from here, not from the
    /// cache: a fused decode step attends over its own new rows before they are stored
    /// (`fused::attention`).
    fresh: Option<Fresh<'a>>,
}

/// One position's new key and value rows, not yet in the cache (see [`Paged::fresh`]).
#[derive(Clone, Copy)]
struct Fresh<'a> {
    pos: usize,
    k: &'a [f16],
    v: &'a [f16],
}

impl Paged<'_> {
    #[inline]
    fn slot(&self, p: usize) -> usize {
        // Block sizes are powers of two in practice: a shift and a mask, not a division.
        let (b, r) = if self.bs.is_power_of_two() {
            (p >> self.bs.trailing_zeros(), p & (self.bs - 1))
        } else {
            (p / self.bs, p % self.bs)
        };
        (self.table[b] as usize * self.bs + r) * self.kvd + self.off
    }
    /// Asks for position `p`'s key and value rows to be brought into L1 (a hint, no effect on
    /// results): the cache of a layer is cold when its attention starts, each row a miss.
    #[inline]
    fn prefetch(&self, p: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let s = self.slot(p);
            let (k, v) = (self.k[s..].as_ptr(), self.v[s..].as_ptr());
            for b in (0..self.hd * 2).step_by(64) {
                // SAFETY: prefetching has no architectural effect; the addresses are row bytes
                // of the cache slices (wrapping_add only forms them).
                unsafe {
                    _mm_prefetch::<_MM_HINT_T0>(k.cast::<i8>().wrapping_add(b));
                    _mm_prefetch::<_MM_HINT_T0>(v.cast::<i8>().wrapping_add(b));
                }
            }
        }
    }
    #[inline]
    fn k(&self, p: usize) -> &[f16] {
        match self.fresh {
            Some(f) if f.pos == p => f.k,
            _ => {
                let s = self.slot(p);
                &self.k[s..s + self.hd]
            }
        }
    }
    #[inline]
    fn v(&self, p: usize) -> &[f16] {
        match self.fresh {
            Some(f) if f.pos == p => f.v,
            _ => {
                let s = self.slot(p);
                &self.v[s..s + self.hd]
            }
        }
    }
}

/// What a unit reads: the widened copies (tiled path only) and the cache itself.
struct KvView<'a> {
    wide: Option<Heads<'a>>,
    paged: Paged<'a>,
}

/// Causal attention of each query row (`q`: rows × n_head·head_dim, already rotated and, for
/// gemma, scaled) over its sequence's cached keys `lo..=pos`, written to `out` (same shape), with
/// the kernel llama.cpp would use for a forward of `queries.len()` rows — or, with `invariant`,
/// for each row the kernel a one-row forward would use.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    pool: &ThreadPool,
    q: &CpuAct,
    kv: &CpuKv,
    layer: usize,
    queries: &[AttnQuery<'_>],
    shape: AttnShape,
    out: &mut CpuAct,
    invariant: bool,
) {
    let hd = shape.head_dim;
    let group = shape.n_head / shape.n_head_kv;
    let isa = ggml_isa();
    let path = match queries {
        _ if queries.len() >= FA_TILE_Q => Path::Tiled,
        [qa] => one_row_path(qa),
        _ => Path::OneChunk,
    };
    // Row-invariant mode: each query takes the path a one-row call for it alone would take.
    let path_of = |qa: &AttnQuery<'_>| if invariant { one_row_path(qa) } else { path };
    let tiled = !invariant && path == Path::Tiled;
    // The tiled kernel reads widened copies: each sequence's keys and values once (queries of one
    // sequence share a block table). The other paths read the f16 cache in place.
    let mut seqs: Vec<(usize, SeqKv)> = Vec::new();
    let mut seq_of = Vec::with_capacity(if tiled { queries.len() } else { 0 });
    for qa in queries.iter().filter(|_| tiled) {
        let id = qa.seq as usize;
        let idx = match seqs.iter().position(|(t, _)| *t == id) {
            Some(i) => i,
            None => {
                let same = || queries.iter().filter(|o| o.seq as usize == id);
                let lo = same().map(|o| o.lo as usize).min().unwrap_or(0);
                let hi = same().map(|o| o.pos as usize).max().unwrap_or(0);
                let mut seq = SeqKv::new(kv, layer, qa.block_table, lo, hi);
                if tiled {
                    seq.transpose_keys(kv.kv_dim, hd);
                }
                seqs.push((id, seq));
                seqs.len() - 1
            }
        };
        seq_of.push(idx);
    }
    let kvd = kv.kv_dim;
    let out_cols = out.cols;
    let dst = SharedMut(out.data.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if tiled && rows::applies(hd) {
        // Units of up to ROWS consecutive query rows of one sequence and one head.
        let mut blocks: Vec<std::ops::Range<usize>> = Vec::new();
        for i in 0..queries.len() {
            match blocks.last_mut() {
                Some(b) if b.len() < rows::ROWS && seq_of[b.start] == seq_of[i] => b.end = i + 1,
                _ => blocks.push(i..i + 1),
            }
        }
        pool.for_range_with(blocks.len() * shape.n_head, 1, FINE_CHUNKS, |range| {
            let mut res: Vec<Vec<f32>> = (0..rows::ROWS).map(|_| vec![0f32; hd]).collect();
            for unit in range {
                let (blk, h) = (&blocks[unit / shape.n_head], unit % shape.n_head);
                let heads = Heads {
                    seq: &seqs[seq_of[blk.start]].1,
                    kvd,
                    off: (h / group) * hd,
                    hd,
                };
                let qs: Vec<&[f32]> = blk
                    .clone()
                    .map(|i| &q.row(i)[h * hd..(h + 1) * hd])
                    .collect();
                let ranges: Vec<(usize, usize)> = blk
                    .clone()
                    .map(|i| (queries[i].lo as usize, queries[i].pos as usize))
                    .collect();
                // SAFETY: `rows::applies(hd)` was checked before this region.
                unsafe { rows::tiled_rows(&qs, &heads, &ranges, shape.scale, isa, &mut res) };
                for (r, i) in blk.clone().enumerate() {
                    // SAFETY: i < out.rows and (h + 1) * hd <= out_cols; unit (block, h) is
                    // handled by exactly one thread and row i is in one block only, so this slice
                    // is written once.
                    let o = unsafe {
                        std::slice::from_raw_parts_mut(dst.ptr().add(i * out_cols + h * hd), hd)
                    };
                    o.copy_from_slice(&res[r]);
                }
            }
        });
        return;
    }
    // One contiguous run of (query row, head) units per thread, not dynamic chunks: a thread's
    // heads then share their KV heads (GQA groups are consecutive heads), so each core brings a
    // KV row into its own caches once instead of both cores missing on the same rows. The runs
    // are cut where the visible positions, the work, are split evenly (rows of a prompt see more
    // positions the later they are).
    let units = queries.len() * shape.n_head;
    let cost = |u: usize| {
        let qa = &queries[u / shape.n_head];
        (qa.pos + 1).saturating_sub(qa.lo) as usize
    };
    let threads = pool.n_threads();
    let total: usize = (0..units).map(cost).sum();
    // On the stack for up to STACK_THREADS threads: no allocation between two decode regions.
    let mut stack = [units; STACK_THREADS + 1];
    let mut heap = Vec::new();
    let cuts: &mut [usize] = if threads < stack.len() {
        &mut stack[..=threads]
    } else {
        heap.resize(threads + 1, units);
        &mut heap
    };
    cuts[0] = 0;
    let (mut behind, mut t) = (0, 1);
    for u in 0..units {
        while t < threads && behind >= total * t / threads {
            cuts[t] = u;
            t += 1;
        }
        behind += cost(u);
    }
    let (k, v) = (&kv.k[layer][..], &kv.v[layer][..]);
    pool.broadcast(|t, _| {
        let range = cuts[t]..cuts[t + 1];
        let mut last = None;
        let mut unit = range.start;
        while unit < range.end {
            // This thread's heads of query row i.
            let i = unit / shape.n_head;
            let end = range.end.min((i + 1) * shape.n_head);
            let qa = &queries[i];
            let job = HeadsJob {
                qa,
                path: path_of(qa),
                kv: (k, v),
                bs: kv.block_size,
                kvd,
                group,
                shape,
                isa,
                wide: tiled.then(|| &seqs[seq_of[i]].1),
                fresh: None,
            };
            let row = q.row(i);
            let heads = unit - i * shape.n_head..end - i * shape.n_head;
            run_heads(
                &job,
                heads,
                |h| &row[h * hd..(h + 1) * hd],
                // SAFETY: i < out.rows and h < n_head, so the slice lies inside `out`; units
                // (i, h) are handled by exactly one thread and each once, so these slices are
                // written once and do not overlap.
                |h| unsafe {
                    std::slice::from_raw_parts_mut(dst.ptr().add(i * out_cols + h * hd), hd)
                },
                &mut last,
            );
            unit = end;
        }
    });
}

/// One query row's attention as [`run_heads`] reads it.
pub(crate) struct HeadsJob<'a> {
    qa: &'a AttnQuery<'a>,
    path: Path,
    /// The layer's K and V cache planes.
    kv: (&'a [f16], &'a [f16]),
    bs: usize,
    kvd: usize,
    /// Query heads per KV head.
    group: usize,
    shape: AttnShape,
    isa: GgmlIsa,
    /// The widened rows (the tiled path only).
    wide: Option<&'a SeqKv>,
    /// The query's own new K and V rows, not yet in the cache: `(first KV head, k, v)`, the rows
    /// of KV heads `first..first + k.len() / head_dim`.
    fresh: Option<(usize, &'a [f16], &'a [f16])>,
}

impl<'a> HeadsJob<'a> {
    /// A decode step's job (one query row, the f16 cache), with the kernel a one-row call takes.
    pub(crate) fn decode(
        qa: &'a AttnQuery<'a>,
        kv: (&'a [f16], &'a [f16]),
        (bs, kvd): (usize, usize),
        shape: AttnShape,
        fresh: Option<(usize, &'a [f16], &'a [f16])>,
    ) -> HeadsJob<'a> {
        HeadsJob {
            qa,
            path: one_row_path(qa),
            kv,
            bs,
            kvd,
            group: shape.n_head / shape.n_head_kv,
            shape,
            isa: ggml_isa(),
            wide: None,
            fresh,
        }
    }
}

/// Heads `heads` of one query row, on the calling thread: head `h`'s q row is `q_of(h)` and its
/// result goes to `out_of(h)` (called once per head). Heads that share a KV head run as one
/// group (up to `MAX_GROUP`), so each key and value row is widened once for all of them.
/// `last` is the KV head this thread read last (its rows are warm; a new one is prefetched).
pub(crate) fn run_heads<'q>(
    job: &HeadsJob<'_>,
    heads: std::ops::Range<usize>,
    q_of: impl Fn(usize) -> &'q [f32],
    out_of: impl Fn(usize) -> &'q mut [f32],
    last: &mut Option<(usize, usize)>,
) {
    let (hd, group) = (job.shape.head_dim, job.group);
    SCRATCH.with_borrow_mut(|scratch| {
        if scratch.first().is_some_and(|s| s.q16.len() != hd) {
            scratch.clear();
        }
        let mut h = heads.start;
        while h < heads.end {
            // The next heads that read the same KV head (a GQA group).
            let g = h / group;
            let end = heads.end.min((g + 1) * group).min(h + decode::MAX_GROUP);
            let ng = end - h;
            let off = g * hd;
            let rows = (job.qa.seq as usize, off);
            let cold = *last != Some(rows);
            *last = Some(rows);
            let fresh = job.fresh.map(|(g0, k, v)| {
                let at = (g - g0) * hd..(g - g0 + 1) * hd;
                Fresh {
                    pos: job.qa.pos as usize,
                    k: &k[at.clone()],
                    v: &v[at],
                }
            });
            let view = KvView {
                wide: job.wide.map(|seq| Heads {
                    seq,
                    kvd: job.kvd,
                    off,
                    hd,
                }),
                paged: Paged {
                    k: job.kv.0,
                    v: job.kv.1,
                    table: job.qa.block_table,
                    bs: job.bs,
                    kvd: job.kvd,
                    off,
                    hd,
                    cold,
                    fresh,
                },
            };
            // The group's rows in fixed arrays (no allocation per group), `ng` of them used.
            let qrows: [&[f32]; decode::MAX_GROUP] =
                std::array::from_fn(|i| if i < ng { q_of(h + i) } else { &[] });
            let mut res: [&mut [f32]; decode::MAX_GROUP] =
                std::array::from_fn(|i| if i < ng { out_of(h + i) } else { &mut [] });
            let unit = Unit {
                path: job.path,
                lo: job.qa.lo as usize,
                pos: job.qa.pos as usize,
                scale: job.shape.scale,
                isa: job.isa,
            };
            while scratch.len() < ng {
                scratch.push(Scratch::new(hd));
            }
            run_units(
                &unit,
                &qrows[..ng],
                &view,
                &mut scratch[..ng],
                &mut res[..ng],
            );
            h = end;
        }
    });
}

thread_local! {
    /// Each thread's per-head buffers, kept between calls (a decode step calls attention once
    /// per layer; allocating a group's buffers each time showed in its time at short contexts).
    static SCRATCH: std::cell::RefCell<Vec<Scratch>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One (query row, head) problem.
struct Unit {
    path: Path,
    lo: usize,
    pos: usize,
    scale: f32,
    isa: GgmlIsa,
}

/// Computes one unit per head of `qs` (heads of one query row that share a KV head; a scratch
/// and a result row each) into `res`, with hardware FMA where the CPU has it (the results are the
/// same either way: `mul_add` is exactly rounded; without the feature it is a slow library call).
fn run_units(
    u: &Unit,
    qs: &[&[f32]],
    heads: &KvView<'_>,
    scratch: &mut [Scratch],
    res: &mut [&mut [f32]],
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has FMA (checked just above).
        unsafe { run_units_fma(u, qs, heads, scratch, res) };
        return;
    }
    run_units_impl(u, qs, heads, scratch, res);
}

/// [`run_units_impl`] compiled with FMA.
///
/// # Safety
/// The CPU supports FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn run_units_fma(
    u: &Unit,
    qs: &[&[f32]],
    heads: &KvView<'_>,
    scratch: &mut [Scratch],
    res: &mut [&mut [f32]],
) {
    run_units_impl(u, qs, heads, scratch, res);
}

#[inline(always)]
fn run_units_impl(
    u: &Unit,
    qs: &[&[f32]],
    view: &KvView<'_>,
    scratch: &mut [Scratch],
    res: &mut [&mut [f32]],
) {
    let (lo, pos, scale, isa) = (u.lo, u.pos, u.scale, u.isa);
    let heads = &view.paged;
    if u.path != Path::Tiled {
        for (s, q) in scratch.iter_mut().zip(qs) {
            s.set_q16(q);
        }
    }
    match u.path {
        Path::Tiled => {
            let wide = view.wide.as_ref().expect("widened rows for the tiled path");
            for ((q, s), r) in qs.iter().zip(scratch.iter_mut()).zip(res.iter_mut()) {
                tiled(q, wide, lo, pos, scale, isa, s, r);
            }
        }
        Path::OneChunk => {
            let mut ms = [(0f32, 0f32); decode::MAX_GROUP];
            decode::one_chunk_heads(heads, lo, pos, scale, isa, scratch, &mut ms);
            for ((r, s), &(_, sum)) in res.iter_mut().zip(scratch.iter()).zip(&ms) {
                let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
                for (r, &a) in r.iter_mut().zip(&s.acc) {
                    *r = a * inv;
                }
            }
        }
        Path::Split { chunk, n_kv } => {
            decode::split_kv(heads, lo, pos, scale, isa, chunk, n_kv, scratch, res)
        }
    }
}

/// Per-thread buffers.
struct Scratch {
    /// Q rounded to f16 (one_chunk), widened back to f32.
    q16: Vec<f32>,
    /// The f16 V accumulator of one_chunk.
    acc16: Vec<f16>,
    /// An f32 accumulator (one_chunk's result, the tiled kernel's V accumulator).
    acc: Vec<f32>,
    /// Merged result of the split-KV kernel.
    merged: Vec<f32>,
    /// one_chunk's per-position softmax factors `(ms, vs)` between its two passes.
    steps: Vec<(f32, f32)>,
}

impl Scratch {
    fn new(hd: usize) -> Scratch {
        Scratch {
            q16: vec![0.0; hd],
            acc16: vec![f16::ZERO; hd],
            acc: vec![0.0; hd],
            merged: vec![0.0; hd],
            steps: Vec::new(),
        }
    }

    fn set_q16(&mut self, q: &[f32]) {
        self.acc16.convert_from_f32_slice(q);
        self.acc16.convert_to_f32_slice(&mut self.q16);
    }
}

/// `ggml_compute_forward_flash_attn_ext_tiled` for one query row and head.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tiled(
    q: &[f32],
    heads: &Heads<'_>,
    lo: usize,
    pos: usize,
    scale: f32,
    isa: GgmlIsa,
    scratch: &mut Scratch,
    res: &mut [f32],
) {
    let mut m = f32::NEG_INFINITY;
    let mut sum = 0f32;
    scratch.acc.iter_mut().for_each(|a| *a = 0.0);
    let mut kq = [f32::NEG_INFINITY; FA_TILE_KV];
    for t in lo / FA_TILE_KV..=pos / FA_TILE_KV {
        let base = t * FA_TILE_KV;
        let (a, b) = (lo.max(base), pos.min(base + FA_TILE_KV - 1));
        kq.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        // simd_gemm: one FMA chain over the head dimension per score, then the scale; eight
        // keys per vector from the transposed keys (groups of 8 aligned inside the tile).
        let (g_lo, g_hi) = (a / 8, b / 8);
        let mut g = g_lo;
        while g <= g_hi {
            let k = (g_hi + 1 - g).min(8);
            let mut acc = [[0f32; 8]; 8];
            scores8xk(q, heads, g, k, &mut acc);
            for (i, row) in acc[..k].iter().enumerate() {
                for (j, &sc) in row.iter().enumerate() {
                    let p = 8 * (g + i) + j;
                    if (a..=b).contains(&p) {
                        kq[p - base] = sc * scale;
                    }
                }
            }
            g += k;
        }
        let mut tile_max = f32::NEG_INFINITY;
        for &s in &kq[a - base..=b - base] {
            tile_max = if tile_max > s { tile_max } else { s };
        }
        let m_new = m.max(tile_max);
        if m_new > m {
            let ms = (m - m_new).exp();
            scratch.acc.iter_mut().for_each(|v| *v *= ms);
            sum *= ms;
        }
        m = m_new;
        sum = (sum as f64 + soft_max(&mut kq, m_new, isa)) as f32;
        accumulate_v(heads, a, b, &kq[a - base..=b - base], &mut scratch.acc);
    }
    let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
    for (r, &a) in res.iter_mut().zip(&scratch.acc) {
        *r = a * inv;
    }
}

/// V of one tile: `acc[d] = fma(v[p][d], pr[p - a], acc[d])` for p = a..=b, one FMA chain per
/// output element in position order.
#[inline(always)]
fn accumulate_v(heads: &Heads<'_>, a: usize, b: usize, pr: &[f32], acc: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar
        && acc.len().is_multiple_of(64)
    {
        // SAFETY: a non-scalar level means AVX2 and FMA were detected; the callee checks the
        // lengths it relies on.
        unsafe { accumulate_v_avx2(heads, a, b, pr, acc) };
        return;
    }
    for p in a..=b {
        let w = pr[p - a];
        for (x, &v) in acc.iter_mut().zip(heads.v(p)) {
            *x = v.mul_add(w, *x);
        }
    }
}

/// [`accumulate_v`] with the accumulator in registers, 64 values (eight vectors of independent
/// chains) at a time over all the tile's positions.
///
/// # Safety
/// AVX2 and FMA are available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_v_avx2(heads: &Heads<'_>, a: usize, b: usize, pr: &[f32], acc: &mut [f32]) {
    use std::arch::x86_64::*;
    // Rows a..=b are `heads.kvd` values apart in one buffer (`Heads::v`); checking the first and
    // the last row's bounds covers every read below.
    assert!(pr.len() == b + 1 - a && acc.len().is_multiple_of(64) && heads.hd == acc.len());
    let (first, last) = (heads.v(a).as_ptr(), heads.v(b).as_ptr());
    assert_eq!(last as usize - first as usize, (b - a) * heads.kvd * 4);
    let base = first;
    let step = heads.kvd; // values between consecutive positions' rows
    for d0 in (0..acc.len()).step_by(64) {
        let mut r: [__m256; 8] =
            std::array::from_fn(|i| _mm256_loadu_ps(acc.as_ptr().add(d0 + 8 * i)));
        for (i, &w) in pr.iter().enumerate() {
            let wv = _mm256_set1_ps(w);
            let v = base.add(i * step + d0);
            for (j, x) in r.iter_mut().enumerate() {
                *x = _mm256_fmadd_ps(_mm256_loadu_ps(v.add(8 * j)), wv, *x);
            }
        }
        for (j, x) in r.iter().enumerate() {
            _mm256_storeu_ps(acc.as_mut_ptr().add(d0 + 8 * j), *x);
        }
    }
}

/// The scores of the `k` (1..=8) groups of eight keys from group `g` on: `acc[i][j] = Σ_d
/// key[8(g + i) + j][d] · q[d]`, each one FMA chain in `d` order (`acc = fma(k, q, acc)`), read
/// from the transposed keys.
#[inline(always)]
fn scores8xk(q: &[f32], heads: &Heads<'_>, g: usize, k: usize, acc: &mut [[f32; 8]; 8]) {
    let kts: [&[f32]; 8] = std::array::from_fn(|i| heads.kt(g + i.min(k - 1)));
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar {
        // SAFETY: a non-scalar level means AVX2 and FMA were detected; each `kt` slice holds
        // 8 values per element of `q` (`Heads::kt`).
        unsafe {
            if k > 4 {
                scores_avx2::<8>(q, &kts, acc)
            } else {
                scores_avx2::<4>(q, &kts, acc)
            }
        };
        return;
    }
    for (kt, a) in kts.iter().zip(acc.iter_mut()).take(k) {
        for (d, &x) in q.iter().enumerate() {
            for j in 0..8 {
                a[j] = kt[8 * d + j].mul_add(x, a[j]);
            }
        }
    }
}

/// [`scores8xk`] with AVX2 for `N` groups at once (independent chains, enough of them to cover the
/// FMA latency; lane `j` of vector `i` is key `8(g + i) + j`).
///
/// # Safety
/// AVX2 and FMA are available; every `kt[i].len() >= 8 * q.len()` for `i < N`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2<const N: usize>(q: &[f32], kt: &[&[f32]; 8], acc: &mut [[f32; 8]; 8]) {
    use std::arch::x86_64::*;
    let n = q.len();
    assert!(N <= 8 && kt[..N].iter().all(|k| k.len() >= 8 * n));
    let mut c = [_mm256_setzero_ps(); N];
    for (d, &x) in q.iter().enumerate() {
        let xv = _mm256_set1_ps(x);
        for i in 0..N {
            c[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kt[i].as_ptr().add(8 * d)), xv, c[i]);
        }
    }
    for i in 0..N {
        _mm256_storeu_ps(acc[i].as_mut_ptr(), c[i]);
    }
}

/// `ggml_vec_soft_max_f32` over one tile: `x = v_expf(x - max)` in place, returning the sum in f64
/// accumulated one vector at a time (each vector reduced in ggml's lane order).
#[inline(always)]
fn soft_max(x: &mut [f32; FA_TILE_KV], max: f32, isa: GgmlIsa) -> f64 {
    for c in x.chunks_exact_mut(8) {
        let c: &mut [f32; 8] = c.try_into().expect("8 lanes");
        c.iter_mut().for_each(|v| *v -= max);
        v_expf8(c, isa);
    }
    let mut sum = 0f64;
    match isa {
        GgmlIsa::Avx2 => {
            for c in x.chunks_exact(8) {
                sum += hsum8(c.try_into().expect("8 lanes")) as f64;
            }
        }
        GgmlIsa::Avx512 => {
            for c in x.chunks_exact(16) {
                sum += reduce16(c.try_into().expect("16 lanes")) as f64;
            }
        }
    }
    sum
}

/// An AVX `__m256` summed as ggml's `hsum_float_8`: `((x0+x4)+(x2+x6)) + ((x1+x5)+(x3+x7))`.
#[inline(always)]
fn hsum8(x: &[f32; 8]) -> f32 {
    let w: [f32; 4] = std::array::from_fn(|i| x[i + 4] + x[i]);
    (w[0] + w[2]) + (w[1] + w[3])
}

/// GCC's `_mm512_reduce_add_ps`: halves folded 16 → 8 → 4, then `(t0+t2) + (t1+t3)`.
#[inline(always)]
fn reduce16(x: &[f32; 16]) -> f32 {
    let t3: [f32; 8] = std::array::from_fn(|i| x[i + 8] + x[i]);
    let t6: [f32; 4] = std::array::from_fn(|i| t3[i + 4] + t3[i]);
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_follow_ggml_lane_order() {
        // Values whose sum depends on the order: large cancelling terms and small ones.
        let x: [f32; 16] = std::array::from_fn(|i| if i % 3 == 0 { 1e8 } else { 1.0 + i as f32 });
        let mut y = x;
        y[8] = -1e8;
        let h = hsum8(&x[..8].try_into().unwrap());
        let w: Vec<f32> = (0..4).map(|i| x[i + 4] + x[i]).collect();
        assert_eq!(h, (w[0] + w[2]) + (w[1] + w[3]));
        let r = reduce16(&y);
        let t3: Vec<f32> = (0..8).map(|i| y[i + 8] + y[i]).collect();
        let t6: Vec<f32> = (0..4).map(|i| t3[i + 4] + t3[i]).collect();
        assert_eq!(r, (t6[0] + t6[2]) + (t6[1] + t6[3]));
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    #[cfg_attr(
        not(infer_host_avx2),
        ignore = "needs AVX2, FMA and F16C, which the CPU that built the tests lacks"
    )]
    fn tiled_rows_equal_the_single_row_kernel() {
        let (hd, heads_kv, n) = (128usize, 2usize, 300usize);
        let kvd = hd * heads_kv;
        let rnd = |seed: u32, k: usize| -> Vec<f32> {
            crate::kernels::cpu::test_floats(k, seed)
                .iter()
                .map(|&v| f16::from_f32(v * 2.0).to_f32())
                .collect()
        };
        let base = 5; // positions base..base + n are widened
        let mut seq = SeqKv {
            base,
            k: rnd(11, n * kvd),
            v: rnd(12, n * kvd),
            kt: Vec::new(),
        };
        seq.transpose_keys(kvd, hd);
        let heads = Heads {
            seq: &seq,
            kvd,
            off: hd,
            hd,
        };
        assert!(
            rows::applies(hd),
            "the tiled kernel applies at head width {hd}"
        );
        let qs: Vec<Vec<f32>> = (0..4)
            .map(|r| crate::kernels::cpu::test_floats(hd, 30 + r))
            .collect();
        // consecutive prompt rows, a tile boundary between rows, sliding-window-like starts, one,
        // two and three rows
        let cases: [&[(usize, usize)]; 6] = [
            &[(5, 200), (5, 201), (5, 202), (5, 203)],
            &[(5, 126), (5, 127), (5, 128), (5, 129)],
            &[(70, 190), (71, 191), (140, 192), (150, 303)],
            &[(9, 9)],
            &[(5, 100), (5, 101)],
            &[(5, 50), (20, 51), (5, 130)],
        ];
        for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512] {
            for ranges in cases {
                let qr: Vec<&[f32]> = qs[..ranges.len()].iter().map(|q| q.as_slice()).collect();
                let mut got: Vec<Vec<f32>> = (0..4).map(|_| vec![0f32; hd]).collect();
                // SAFETY: the test returns early unless `rows::applies(hd)`.
                unsafe { rows::tiled_rows(&qr, &heads, ranges, 0.07, isa, &mut got) };
                for (r, &(lo, pos)) in ranges.iter().enumerate() {
                    let mut scratch = Scratch::new(hd);
                    let mut want = vec![0f32; hd];
                    tiled(qr[r], &heads, lo, pos, 0.07, isa, &mut scratch, &mut want);
                    for (d, (x, y)) in got[r].iter().zip(&want).enumerate() {
                        assert_eq!(
                            x.to_bits(),
                            y.to_bits(),
                            "{isa:?} {ranges:?} row {r} dim {d}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn soft_max_masks_and_sums() {
        let mut x = [f32::NEG_INFINITY; FA_TILE_KV];
        x[3] = 0.0;
        x[40] = -1.0;
        for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512] {
            let mut y = x;
            let s = soft_max(&mut y, 0.0, isa);
            assert_eq!(y[3], 1.0);
            assert!((y[40] - (-1f32).exp()).abs() < 1e-6);
            assert_eq!(y.iter().filter(|&&v| v != 0.0).count(), 2);
            assert!((s - (1.0 + (-1f64).exp())).abs() < 1e-6);
        }
    }
}
