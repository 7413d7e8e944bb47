//! Decode's matmuls: one activation row against one or several weight matrices in a single
//! parallel region. The region's output rows are cut into units of [`DECODE_UNIT`] rows; each
//! thread takes one contiguous range of units (cut by bytes, so a Q6_K unit weighs more than a
//! Q4_K one), and regions of [`SHARING`]'s size or more let a thread done early take chunks from
//! the end of another's range ([`Split`]). Every row is computed by the kernel a one-row
//! [`super::matmul`] uses for it, reading the weight's packed copy (`layouts`) where it has one,
//! so results are bit-identical to the unfused path.

use crate::format::GgmlType;
use crate::kernels::cpu::backend::{CpuAct, CpuWeight};
use crate::kernels::cpu::layouts::q6_k_x16::Layout;
use crate::kernels::cpu::simd;
use crate::kernels::cpu::threads::chain;
use crate::kernels::cpu::threads::pool::ThreadPool;
use crate::kernels::cpu::threads::split::Split;
use crate::kernels::cpu::SharedMut;

use super::TILE;

/// Output rows per unit of decode work: two x8-packed Q4_K groups (one unit of the wide layout).
pub(crate) const DECODE_UNIT: usize = 16;

/// How a decode region's units are shared between the threads.
#[derive(Clone, Copy)]
pub(crate) struct Sharing {
    /// Regions of this many bytes or more share their units through [`Split`] (a thread done
    /// with its range takes chunks from the end of another's); smaller ones split evenly.
    steal_from: usize,
    /// The fewest bytes of weights a [`Split`] chunk holds.
    min_chunk: usize,
}

/// Regions of 4 MiB or more through [`Split`], in chunks of 256 KiB or more: Qwen2.5-1.5B's
/// gate/up (`ffn`) and down projections and the output heads, not the smaller regions (Gemma-3
/// 270M's layers, `wo`), where the extra chunks cost more than balancing gains. On the
/// development VM the two cores' read bandwidths differ in its high-bandwidth state, often by
/// 15% and at times by 30% for a second or more (4 MB per core alternated with probe reads:
/// 34.5 against 40.8 GB/s over 300 reads), so an even split waits on the slower core. Alternated
/// step by step in one process against splitting only regions of 16 MiB or more (2026-11-26):
/// Qwen2.5-1.5B's step 2.8% shorter by the median pair and 4.2% by the mean while the bandwidth
/// probe read about 72 GB/s (960 pairs), 1.5% and 2.3% at 74 (961 pairs), and 0.996-0.997 by
/// the median in the low state (539-540 pairs); every region split this way cost Gemma-3 270M
/// 1.3% in the high state and 0.8% in the low. (An earlier session found the same sharing for
/// regions of 4 MB or more worth nothing, 0.998-1.003, in a high state whose cores read alike.)
/// Gemma's 178 MB head: 1.7-2.4% shorter step in the high state (three runs of 634-876 pairs),
/// 1.000-1.016 in the low; chunks of 64 KiB or 1 MiB did as well as 256 KiB.
const SHARING: Sharing = Sharing {
    steal_from: 4 << 20,
    min_chunk: 256 << 10,
};

impl Sharing {
    /// Whether a region of `bytes` of weights shares its units through [`Split`].
    fn shares(self, bytes: usize) -> bool {
        bytes >= self.steal_from
    }

    /// The fewest units of `unit_bytes` each a [`Split`] chunk holds.
    fn min_units(self, unit_bytes: usize) -> usize {
        self.min_chunk.div_ceil(unit_bytes.max(1))
    }
}

/// Whether a decode region of `bytes` of weights shares its units through [`Split`].
pub(crate) fn region_shares(bytes: usize) -> bool {
    SHARING.shares(bytes)
}

/// The fewest units of `unit_bytes` each a [`Split`] chunk of a decode region holds.
pub(crate) fn split_min_units(unit_bytes: usize) -> usize {
    SHARING.min_units(unit_bytes)
}

/// One activation row (`xq`) against every job's weight rows in one parallel region, units of
/// [`DECODE_UNIT`] rows handed out across the jobs; each row computed by the kernel a one-row
/// [`matmul`] uses for it (the GEMV flavour of packed Q4_K, `dot_rows` where a type has it, else
/// the type's tile kernel).
pub(crate) fn decode_many(
    pool: &ThreadPool,
    jobs: &mut [(&CpuWeight, &mut CpuAct)],
    biases: &[Option<&[f32]>],
    xq: &[u8],
) {
    decode_shared(pool, jobs, biases, xq, SHARING);
}

/// Jobs a decode region holds without allocating (Q/K/V: three); more are run as several regions.
const MAX_JOBS: usize = 4;

/// One job of a decode region as its threads read it. The region's jobs sit in an array on the
/// caller's stack and each thread computes its cut points from them: a worker's first reads are
/// then a few cache lines the caller just wrote, not six freshly allocated lists. Alternated step
/// by step in one process with the lists: Gemma-3 270M's step 1.6% shorter in the high-bandwidth
/// state (941 pairs), where each of those lines crosses between chiplets, and 0.3% in the low
/// (1059); Qwen2.5-1.5B's 0.3% and 0.0% (452 and 548 pairs).
#[derive(Clone, Copy)]
struct DecodeJob<'a> {
    w: &'a CpuWeight,
    /// The packed copy decode reads, if the weight has one.
    packed: Option<&'a [u8]>,
    /// The job's output row (`w.rows` values).
    out: SharedMut<f32>,
    bias: Option<&'a [f32]>,
    /// The job's units are `start..start + units` of the region's.
    start: usize,
    units: usize,
    /// Bytes of one unit of [`DECODE_UNIT`] rows.
    unit_bytes: usize,
}

impl DecodeJob<'_> {
    fn bytes(&self) -> usize {
        self.units * self.unit_bytes
    }

    /// Where decode reads this job's unit `u` (of the region's numbering, `u >= start`) from.
    fn addr(&self, u: usize) -> usize {
        let base = self.packed.unwrap_or_else(|| self.w.bytes()).as_ptr() as usize;
        base + (u - self.start) * self.unit_bytes
    }
}

/// [`decode_many`], its units shared as `sharing` says.
fn decode_shared(
    pool: &ThreadPool,
    jobs: &mut [(&CpuWeight, &mut CpuAct)],
    biases: &[Option<&[f32]>],
    xq: &[u8],
    sharing: Sharing,
) {
    if jobs.len() > MAX_JOBS {
        let (a, b) = jobs.split_at_mut(MAX_JOBS);
        let (ba, bb) = biases.split_at(MAX_JOBS.min(biases.len()));
        decode_shared(pool, a, ba, xq, sharing);
        decode_shared(pool, b, bb, xq, sharing);
        return;
    }
    let mut table: [Option<DecodeJob<'_>>; MAX_JOBS] = [None; MAX_JOBS];
    let mut total = 0;
    for ((slot, (w, out)), i) in table.iter_mut().zip(jobs.iter_mut()).zip(0..) {
        let w: &CpuWeight = w;
        let units = w.rows.div_ceil(DECODE_UNIT);
        // Packing happens here, on the calling thread, not inside the region.
        *slot = Some(DecodeJob {
            w,
            packed: packed_for_decode(pool, w),
            out: SharedMut(out.data.as_mut_ptr()),
            bias: biases.get(i).copied().flatten(),
            start: total,
            units,
            unit_bytes: DECODE_UNIT * w.row_bytes,
        });
        total += units;
    }
    let Some(first) = table[0] else {
        return;
    };
    let table = &table;
    let jobs = || table.iter().flatten();
    // One contiguous range per thread, not the pool's dynamic chunks: every chunk start is a
    // new stream that the prefetchers pick up late, and with one stream per thread Qwen's decode
    // step took 2-3% less time (Gemma-3 270M's about 2-4%), alternated in one process.
    // Cut points by bytes, not units: a Q6_K unit is half again a Q4_K unit, and Qwen's QKV
    // region mixes them (its V projection is Q6_K in half the layers).
    let total_bytes: usize = jobs().map(DecodeJob::bytes).sum();
    let threads = pool.n_threads();
    let cut = |t: usize| -> usize {
        // The first unit at which `t / threads` of the bytes are behind.
        let mut want = total_bytes * t / threads;
        for j in jobs() {
            if want < j.bytes() {
                return j.start + want.div_ceil(j.unit_bytes);
            }
            want -= j.bytes();
        }
        total
    };
    let chunk = |range: std::ops::Range<usize>| {
        for j in jobs() {
            let (lo, hi) = (range.start.max(j.start), range.end.min(j.start + j.units));
            if lo >= hi {
                continue;
            }
            let r0 = (lo - j.start) * DECODE_UNIT;
            let r1 = ((hi - j.start) * DECODE_UNIT).min(j.w.rows);
            // SAFETY: rows r0..r1 of the job's output (one activation row of `w.rows` values) are
            // inside it and belong to this chunk's units only, so no other thread writes them.
            let o = unsafe { std::slice::from_raw_parts_mut(j.out.ptr().add(r0), r1 - r0) };
            decode_rows_of(j.w, j.packed, xq, r0, o);
            if let Some(b) = j.bias {
                o.iter_mut().zip(&b[r0..r1]).for_each(|(o, b)| *o += b);
            }
        }
    };
    // Each thread's first bytes of this region; each worker prefetches its first bytes of the
    // region that followed this one last time once done here (module `chain`).
    let start = |t: usize| {
        let u = cut(t);
        jobs().find(|j| u < j.start + j.units).map_or((0, 0), |j| {
            (j.addr(u), (j.start + j.units - u) * j.unit_bytes)
        })
    };
    let key = first.w as *const CpuWeight as usize;
    let after = chain::record(key, (0..threads).map(start));
    if !sharing.shares(total_bytes) {
        pool.broadcast_then_prefetch(|t, _| chunk(cut(t)..cut(t + 1)), &after);
        return;
    }
    // A region this long gives a core that streams slower for a while time to fall behind: the
    // other takes over the end of its range.
    let min_units = sharing.min_units(total_bytes / total.max(1));
    let split = with_cuts(threads, cut, |cuts| Split::new(cuts, min_units));
    pool.broadcast_then_prefetch(|t, _| split.run(t, chunk), &after);
}

/// Threads whose per-region bookkeeping (cut points, `Split`'s ranges) stays on the stack; a
/// larger pool allocates it per region.
pub(crate) const STACK_THREADS: usize = 16;

/// `body` of the cut points `cut(0..=threads)`, on the stack for up to [`STACK_THREADS`] threads.
pub(crate) fn with_cuts<R>(
    threads: usize,
    cut: impl Fn(usize) -> usize,
    body: impl FnOnce(&[usize]) -> R,
) -> R {
    let mut a = [0; STACK_THREADS + 1];
    if threads < a.len() {
        for (t, c) in a.iter_mut().enumerate().take(threads + 1) {
            *c = cut(t);
        }
        body(&a[..=threads])
    } else {
        body(&(0..=threads).map(cut).collect::<Vec<_>>())
    }
}

/// How many of its first bytes a decode call requests before its kernel starts. A kernel's own
/// prefetches run a few KB ahead of its loads from its second block on, so its first unit waited
/// on cold lines one after another: Gemma-3 270M's Q5_0 calls read their first 7 KB unit at 6.4-7
/// GB/s against 25-28 for the units after it (one core, the low-bandwidth state), 8.6-9.5 with
/// these requests. Alternated step by step in one process (paired ratios of step times, the low
/// state then the high): Gemma-3 1.0019 and 1.0004 (1094 and 406 pairs), 1.0036 and 1.0064 (1153
/// and 347); Qwen2.5-1.5B 1.0016 and 1.0049 (543 and 257), 1.0008 and 1.0009 (459 and 241). 16
/// KiB did no better (Qwen 1.0010 and 1.0025). Bit-identical: prefetches are hints.
const START_PREFETCH: usize = 4 << 10;

/// The packed copy decode reads for `w`, if it has one (packing it on first use).
pub(crate) fn packed_for_decode<'a>(pool: &ThreadPool, w: &'a CpuWeight) -> Option<&'a [u8]> {
    w.packed_q4k(pool)
        .or_else(|| w.packed_q6k(pool))
        .or_else(|| w.packed_q5_0(pool))
        .or_else(|| w.packed_q8_0(pool))
}

/// Rows `r0..r0 + out.len()` of `w` against one quantized activation row (`r0` a multiple of
/// [`DECODE_UNIT`]).
pub(crate) fn decode_rows_of(
    w: &CpuWeight,
    packed: Option<&[u8]>,
    xq: &[u8],
    r0: usize,
    out: &mut [f32],
) {
    let r1 = r0 + out.len();
    if let Some(head) = packed.and_then(|p| p.get(r0 * w.row_bytes..r1 * w.row_bytes)) {
        crate::kernels::cpu::prefetch_l1(&head[..head.len().min(START_PREFETCH)]);
    }
    if let Some(p) = packed.filter(|_| w.q6k_layout() == Layout::X16) {
        // Whole units of sixteen rows (`DECODE_UNIT`) from byte r0 * row_bytes on.
        let p = &p[r0 * w.row_bytes..r1 * w.row_bytes];
        crate::kernels::cpu::layouts::q6_k_x16::gemv(w.cols, p, xq, out);
        return;
    }
    if let Some(p) = packed.filter(|_| w.ty == GgmlType::Q5_0) {
        // Whole units of sixteen rows (`DECODE_UNIT`) from byte r0 * row_bytes on.
        let p = &p[r0 * w.row_bytes..r1 * w.row_bytes];
        crate::kernels::cpu::layouts::q5_0_x16::gemv(w.cols, p, xq, out);
        return;
    }
    if let Some(p) = packed.filter(|_| w.ty == GgmlType::Q8_0) {
        // Whole units of sixteen rows (`DECODE_UNIT`) from byte r0 * row_bytes on.
        let p = &p[r0 * w.row_bytes..r1 * w.row_bytes];
        crate::kernels::cpu::layouts::q8_0_x16::gemv(w.cols, p, xq, out);
        return;
    }
    if let (Some(p), Some(x4)) = (packed, simd::dot_x4(w.ty)) {
        // The x4 layout: rows r0..r1 are whole groups of four from byte r0 * row_bytes on.
        x4(w.cols, &p[r0 * w.row_bytes..r1 * w.row_bytes], xq, out);
        return;
    }
    if let Some(p) = packed {
        use crate::kernels::cpu::layouts::q4_k_x8::GROUP;
        let groups = (r0 / GROUP, r1.div_ceil(GROUP));
        crate::kernels::cpu::layouts::q4_k_x8::gemv_groups(p, w.rows, w.cols, xq, groups, out);
        return;
    }
    let (wb, rb) = (w.bytes(), w.row_bytes);
    if let Some(dot_rows) = simd::dot_rows(w.ty) {
        dot_rows(w.cols, &wb[r0 * rb..r1 * rb], rb, xq, out);
        return;
    }
    let kern = simd::kernels(w.ty)
        .or_else(|| simd::reference(w.ty))
        .expect("supported weight type has a dot product");
    let mut res = [0f32; TILE];
    for (r, o) in (r0..r1).zip(out.iter_mut()) {
        (kern.tile)(w.cols, &wb[r * rb..(r + 1) * rb], xq, xq.len(), 1, &mut res);
        *o = res[0];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::matmul::quantize_rows;
    use crate::kernels::cpu::matmul::tests::{same_bits, test_weights};
    use crate::kernels::cpu::test_floats as data;

    #[test]
    fn shared_decode_region_equals_single_matmuls() {
        use crate::model::backend::Backend;
        let cols = 512;
        // Five jobs: more than a region holds (`MAX_JOBS`), so two regions.
        let specs = [
            (GgmlType::Q4K, 200), // x8-packed
            (GgmlType::Q6K, 77),  // x16-packed, a ragged last unit
            (GgmlType::Q5K, 160), // the row kernels
            (GgmlType::Q4K, 48),
            (GgmlType::Q6K, 32),
        ];
        let (be, ws) = test_weights(&specs, cols);
        let bias = data(ws[1].rows, 901);
        let bias4 = data(ws[4].rows, 902);
        let mut x = be.act(1, cols);
        x.data.copy_from_slice(&data(cols, 8));
        let mut want: Vec<Vec<f32>> = ws
            .iter()
            .map(|w| {
                let mut o = be.act(1, w.rows);
                be.matmul(w, &x, None, &mut o);
                o.data
            })
            .collect();
        want[1].iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
        want[4].iter_mut().zip(&bias4).for_each(|(v, b)| *v += b);
        let a_bytes = crate::quant::activation_row_bytes(GgmlType::Q8K, cols).unwrap();
        let mut xq = Vec::new();
        quantize_rows(&be.pool, GgmlType::Q4K, &x, a_bytes, &mut xq);
        let biases = [None, Some(&bias[..]), None, None, Some(&bias4[..])];
        for min_chunk in [1, 3000, 20_000] {
            let sharing = Sharing {
                steal_from: 0,
                min_chunk,
            };
            for round in 0..50 {
                let mut outs: Vec<_> = ws.iter().map(|w| be.act(1, w.rows)).collect();
                outs.iter_mut().for_each(|o| o.data.fill(f32::NAN));
                let mut jobs: Vec<_> = ws.iter().zip(outs.iter_mut()).collect();
                decode_shared(&be.pool, &mut jobs, &biases, &xq, sharing);
                for (i, o) in outs.iter().enumerate() {
                    assert!(
                        same_bits(&o.data, &want[i]),
                        "chunks of {min_chunk} bytes, round {round}: job {i}"
                    );
                }
            }
        }
    }
}
