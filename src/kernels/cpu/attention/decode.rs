//! The decode-shaped attention kernels over the paged f16 cache, read in place: ggml's
//! `one_chunk` (f16 Q, `ggml_vec_dot_f16` scores, libm `expf`, an f16 V accumulator rounded after
//! every multiply-add) and the split-KV decode that runs it per chunk and merges the partials.
//! Invariant: every kernel here reproduces ggml's arithmetic bit for bit; the AVX2 forms are held
//! to their scalar twins by the tests below.

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::{reduce16, GgmlIsa, Paged, Scratch};

/// Positions ahead whose K and V rows a cold scan asks for while it scores.
const PREFETCH: usize = 8;

impl Paged<'_> {
    /// The prefetches due before position `p` of a scan over `lo..=hi` is scored, where these
    /// rows are cold: the first [`PREFETCH`] positions at the start, then one position ahead.
    #[inline(always)]
    fn prefetch_ahead(&self, p: usize, lo: usize, hi: usize) {
        if !self.cold {
            return;
        }
        if p == lo {
            for q in lo..(lo + PREFETCH).min(hi + 1) {
                self.prefetch(q);
            }
        }
        if p + PREFETCH <= hi {
            self.prefetch(p + PREFETCH);
        }
    }
}

/// One online-softmax step of ggml's one_chunk for score `s`: updates the running max `m` and
/// denominator `sum`, returns the (accumulator scale, value weight) pair for the V pass.
#[inline(always)]
fn softmax_step(s: f32, m: &mut f32, sum: &mut f32) -> (f32, f32) {
    let (mut ms, mut vs) = (1.0f32, 1.0f32);
    if s > *m {
        ms = (*m - s).exp();
        *m = s;
    } else {
        vs = (s - *m).exp();
    }
    *sum = sum.mul_add(ms, vs);
    (ms, vs)
}

/// `ggml_compute_forward_flash_attn_ext_f16_one_chunk` for one head over the visible positions in
/// `lo..=hi` (cells = positions), with `scratch.q16` set: leaves the unnormalised V sum in
/// `scratch.acc` and returns (max score, softmax denominator) — (-inf, 0) if nothing is visible.
#[inline(always)]
pub(super) fn one_chunk(
    heads: &Paged<'_>,
    lo: usize,
    hi: usize,
    scale: f32,
    isa: GgmlIsa,
    scratch: &mut Scratch,
) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar
        && heads.hd.is_multiple_of(64)
    {
        // SAFETY: a non-scalar level means AVX2, FMA and F16C were detected; the head width is a
        // multiple of 64 (checked), which is all the kernel asks beyond its own bounds checks.
        return unsafe {
            f16c::one_chunk(
                heads,
                lo,
                hi,
                scale,
                isa,
                &scratch.q16,
                &mut scratch.steps,
                &mut scratch.acc,
            )
        };
    }
    one_chunk_scalar(heads, lo, hi, scale, isa, scratch)
}

/// [`one_chunk`] one position at a time through the f16 accumulator in memory, as ggml runs it
/// (the fallback, and the twin the two-pass kernel is tested against).
#[inline(always)]
fn one_chunk_scalar(
    heads: &Paged<'_>,
    lo: usize,
    hi: usize,
    scale: f32,
    isa: GgmlIsa,
    scratch: &mut Scratch,
) -> (f32, f32) {
    let mut m = f32::NEG_INFINITY;
    let mut sum = 0f32;
    scratch.acc16.iter_mut().for_each(|a| *a = f16::ZERO);
    for p in lo..=hi {
        let s = dot_f16(&scratch.q16, heads.k(p), isa) * scale;
        let (mut ms, mut vs) = (1.0f32, 1.0f32);
        if s > m {
            ms = (m - s).exp();
            m = s;
            scale_f16(&mut scratch.acc16, ms);
        } else {
            vs = (s - m).exp();
        }
        mad_f16(&mut scratch.acc16, heads.v(p), vs);
        // `S = S*ms + vs`, contracted to one FMA by GCC.
        sum = sum.mul_add(ms, vs);
    }
    scratch.acc16.convert_to_f32_slice(&mut scratch.acc);
    (m, sum)
}

/// `ggml_vec_scale_f16`: `y = f16(y · s)` per element (round to nearest even).
#[inline(always)]
fn scale_f16(y: &mut [f16], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar {
        // SAFETY: a non-scalar level means AVX2, FMA and F16C were detected.
        unsafe { f16c::scale(y, s) };
        return;
    }
    for a in y.iter_mut() {
        *a = f16::from_f32(a.to_f32() * s);
    }
}

/// `ggml_vec_mad_f16`: `y = f16(fma(x, v, y))` per element (round to nearest even).
#[inline(always)]
fn mad_f16(y: &mut [f16], x: &[f16], v: f32) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar {
        // SAFETY: a non-scalar level means AVX2, FMA and F16C were detected.
        unsafe { f16c::mad(y, x, v) };
        return;
    }
    for (a, &xv) in y.iter_mut().zip(x) {
        *a = f16::from_f32(xv.to_f32().mul_add(v, a.to_f32()));
    }
}

/// The f16 accumulator steps eight lanes at a time with F16C conversions, which round exactly as
/// the scalar `f16::from_f32` does (IEEE round to nearest even).
#[cfg(target_arch = "x86_64")]
mod f16c {
    use half::f16;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2, FMA and F16C are available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scale(y: &mut [f16], s: f32) {
        let n8 = y.len() - y.len() % 8;
        let sv = _mm256_set1_ps(s);
        for i in (0..n8).step_by(8) {
            let p = y.as_mut_ptr().add(i).cast::<__m128i>();
            let a = _mm256_cvtph_ps(_mm_loadu_si128(p));
            let r = _mm256_mul_ps(a, sv);
            _mm_storeu_si128(p, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
        }
        for a in &mut y[n8..] {
            *a = f16::from_f32(a.to_f32() * s);
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C are available; `x.len() >= y.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn mad(y: &mut [f16], x: &[f16], v: f32) {
        assert!(x.len() >= y.len());
        let n8 = y.len() - y.len() % 8;
        let vv = _mm256_set1_ps(v);
        for i in (0..n8).step_by(8) {
            let p = y.as_mut_ptr().add(i).cast::<__m128i>();
            let a = _mm256_cvtph_ps(_mm_loadu_si128(p));
            let xv = _mm256_cvtph_ps(_mm_loadu_si128(x.as_ptr().add(i).cast()));
            let r = _mm256_fmadd_ps(xv, vv, a);
            _mm_storeu_si128(p, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r));
        }
        for (a, &xv) in y[n8..].iter_mut().zip(&x[n8..]) {
            *a = f16::from_f32(xv.to_f32().mul_add(v, a.to_f32()));
        }
    }

    /// [`super::one_chunk`] in two passes with the same arithmetic: first every score and its
    /// online-softmax factors `(ms, vs)` (scalar `expf`, as ggml), then the f16 V accumulator 64
    /// values at a time in registers over all positions, each step rounded to f16 as
    /// `ggml_vec_scale_f16` / `ggml_vec_mad_f16` round it (a scale by exactly 1 is the identity on
    /// f16 values, so it is skipped). Leaves the V sum in `acc`, returns (max, sum).
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn one_chunk(
        heads: &super::Paged<'_>,
        lo: usize,
        hi: usize,
        scale: f32,
        isa: super::GgmlIsa,
        q16: &[f32],
        steps: &mut Vec<(f32, f32)>,
        acc: &mut [f32],
    ) -> (f32, f32) {
        let hd = heads.hd;
        assert!(hd.is_multiple_of(64) && q16.len() == hd && acc.len() == hd);
        let mut m = f32::NEG_INFINITY;
        let mut sum = 0f32;
        steps.clear();
        for p in lo..=hi {
            heads.prefetch_ahead(p, lo, hi);
            let s = dot(q16, heads.k(p), isa) * scale;
            steps.push(super::softmax_step(s, &mut m, &mut sum));
        }
        type VPass = unsafe fn(&super::Paged<'_>, usize, [&[(f32, f32)]; 1], [&mut [f32]; 1]);
        let wide: Option<VPass> = match hd {
            64 => Some(super::avx512::v_pass::<4, 1>),
            128 => Some(super::avx512::v_pass::<8, 1>),
            256 => Some(super::avx512::v_pass::<16, 1>),
            _ => None,
        };
        use crate::kernels::cpu::simd::{current, Level};
        if let Some(v_pass) = wide.filter(|_| current() >= Level::Avx512) {
            // SAFETY: the AVX-512 level was detected; `acc` holds `hd` floats (asserted above),
            // `hd` is the kernel's 16 * N, and `steps` has one entry per position from `lo`.
            v_pass(heads, lo, [steps], [acc]);
            return (m, sum);
        }
        let r16 = |x: __m256| _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
        for d0 in (0..hd).step_by(64) {
            let mut a = [_mm256_setzero_ps(); 8];
            for (p, &(ms, vs)) in (lo..=hi).zip(steps.iter()) {
                if ms != 1.0 {
                    let mv = _mm256_set1_ps(ms);
                    for x in a.iter_mut() {
                        *x = r16(_mm256_mul_ps(*x, mv));
                    }
                }
                let v = heads.v(p)[d0..d0 + 64].as_ptr();
                let vv = _mm256_set1_ps(vs);
                for (j, x) in a.iter_mut().enumerate() {
                    let w = _mm256_cvtph_ps(_mm_loadu_si128(v.add(8 * j).cast()));
                    *x = r16(_mm256_fmadd_ps(w, vv, *x));
                }
            }
            for (j, x) in a.iter().enumerate() {
                _mm256_storeu_ps(acc.as_mut_ptr().add(d0 + 8 * j), *x);
            }
        }
        (m, sum)
    }

    /// [`super::dot_f16`] with the second row in f16, widened eight lanes at a time (exact): the
    /// same FMA chains, folds and reductions.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; `y.len() >= x.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(x: &[f32], y: &[f16], isa: super::GgmlIsa) -> f32 {
        let n = x.len();
        assert!(y.len() >= n);
        let lx = |i: usize| _mm256_loadu_ps(x.as_ptr().add(i));
        let ly = |i: usize| _mm256_cvtph_ps(_mm_loadu_si128(y.as_ptr().add(i).cast()));
        let fold =
            |a: &[__m256; 4]| _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
        let (np, mut sum) = match isa {
            super::GgmlIsa::Avx2 => {
                let np = n - n % 32;
                let mut acc = [_mm256_setzero_ps(); 4];
                for i in (0..np).step_by(32) {
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(lx(i + 8 * j), ly(i + 8 * j), *a);
                    }
                }
                let s = fold(&acc);
                let t0 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
                let t: [f32; 4] = std::mem::transmute(t0);
                (np, ((t[0] + t[1]) + (t[2] + t[3])) as f64)
            }
            super::GgmlIsa::Avx512 => {
                // 16-lane accumulators as (low, high) halves
                let np = n - n % 64;
                let mut lo = [_mm256_setzero_ps(); 4];
                let mut hi = [_mm256_setzero_ps(); 4];
                for i in (0..np).step_by(64) {
                    for j in 0..4 {
                        let b = i + 16 * j;
                        lo[j] = _mm256_fmadd_ps(lx(b), ly(b), lo[j]);
                        hi[j] = _mm256_fmadd_ps(lx(b + 8), ly(b + 8), hi[j]);
                    }
                }
                // reduce16: t3 = high + low halves, t6 = folded again, (t6[0]+t6[2]) + (t6[1]+t6[3])
                let t3 = _mm256_add_ps(fold(&hi), fold(&lo));
                let t6 = _mm_add_ps(_mm256_extractf128_ps::<1>(t3), _mm256_castps256_ps128(t3));
                let t: [f32; 4] = std::mem::transmute(t6);
                (np, ((t[0] + t[2]) + (t[1] + t[3])) as f64)
            }
        };
        for i in np..n {
            sum += (x[i] * y[i].to_f32()) as f64;
        }
        sum as f32
    }
}

/// The V pass of `f16c::one_chunk` with sixteen lanes per vector and every value of the head in
/// registers at once (the AVX2 form runs 64 values at a time), so the positions' rounding chains
/// of all the head's values overlap. Lane for lane the same operations: the same f16 results.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// `super::f16c::one_chunk` (ggml's AVX-512 build) for every head of `group` at once: key row
    /// `p` is widened to `N` vectors once, then each head's score is its `ggml_vec_dot_f16` (four
    /// accumulators over the vectors in turn, folded pairwise, `reduce16`'s lane order) times
    /// `scale`, and its online softmax steps as there (libm `expf`). Then each head's V pass.
    ///
    /// # Safety
    /// The AVX-512 level is available; `heads.hd == 16 * N`; every scratch holds `16 * N` values.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn one_chunk_group<const N: usize>(
        heads: &super::Paged<'_>,
        lo: usize,
        hi: usize,
        scale: f32,
        group: &mut [super::Scratch],
        ms: &mut [(f32, f32)],
    ) {
        // At most MAX_GROUP heads: their scores sit in a fixed array below.
        assert!(heads.hd == 16 * N && group.len() <= super::MAX_GROUP && ms.len() >= group.len());
        // An aligned local in memory aligns the frame: whatever is spilled around the
        // `softmax_step` calls then sits on whole lines (`Aligned`).
        let mut frame = crate::kernels::cpu::Aligned(0u8);
        std::hint::black_box(&mut frame);
        for (s, m) in group.iter_mut().zip(ms.iter_mut()) {
            assert!(s.q16.len() == 16 * N && s.acc.len() == 16 * N);
            s.steps.clear();
            *m = (f32::NEG_INFINITY, 0.0);
        }
        for p in lo..=hi {
            heads.prefetch_ahead(p, lo, hi);
            let k = heads.k(p)[..16 * N].as_ptr();
            // SAFETY: k points at 16 * N f16 values (the slice above), j < N.
            let kf: [__m512; N] = std::array::from_fn(|j| {
                _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(k.add(16 * j).cast()) })
            });
            // The scores first, the softmax steps (libm `expf` calls) after: a call clobbers every
            // vector register, so between scores it would spill and reload the widened key row.
            let mut sc = [0f32; super::MAX_GROUP];
            for (s, sc) in group.iter().zip(sc.iter_mut()) {
                let q = s.q16.as_ptr();
                let mut acc = [_mm512_setzero_ps(); 4];
                for (j, kj) in kf.iter().enumerate() {
                    // SAFETY: q16 holds 16 * N floats (asserted), j < N.
                    let qj = unsafe { _mm512_loadu_ps(q.add(16 * j)) };
                    acc[j % 4] = _mm512_fmadd_ps(qj, *kj, acc[j % 4]);
                }
                let f = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
                // reduce16: t3 = high + low halves, t6 = folded again, (t6[0]+t6[2]) + (t6[1]+t6[3])
                let hi8 = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(f)));
                let t3 = _mm256_add_ps(hi8, _mm512_castps512_ps256(f));
                let t6 = _mm_add_ps(_mm256_extractf128_ps::<1>(t3), _mm256_castps256_ps128(t3));
                let mut t = [0f32; 4];
                // SAFETY: t holds four floats.
                unsafe { _mm_storeu_ps(t.as_mut_ptr(), t6) };
                *sc = ((t[0] + t[2]) + (t[1] + t[3])) * scale;
            }
            for ((s, m), &sc) in group.iter_mut().zip(ms.iter_mut()).zip(&sc) {
                s.steps.push(super::softmax_step(sc, &mut m.0, &mut m.1));
            }
        }
        // The V passes three or two heads at a time (a group of four as two and two).
        let mut rest = group;
        while !rest.is_empty() {
            let take = match rest.len() {
                1 | 2 | 4 => rest.len().min(2),
                _ => 3,
            };
            let (now, later) = rest.split_at_mut(take);
            rest = later;
            // SAFETY (each arm): as this function's contract (the AVX-512 level; hd == 16 * N and
            // every scratch holds 16 * N values); each head's steps have one entry per position.
            match now {
                [a] => unsafe { v_pass::<N, 1>(heads, lo, [&a.steps], [&mut a.acc]) },
                [a, b] => unsafe {
                    v_pass::<N, 2>(heads, lo, [&a.steps, &b.steps], [&mut a.acc, &mut b.acc])
                },
                [a, b, c] => unsafe {
                    let steps = [&a.steps[..], &b.steps, &c.steps];
                    v_pass::<N, 3>(heads, lo, steps, [&mut a.acc, &mut b.acc, &mut c.acc])
                },
                _ => unreachable!("at most three heads at a time"),
            }
        }
    }

    /// Accumulates `heads.v(lo + i)` by `steps[h][i] = (ms, vs)` into `acc[h]` (`16 * N` values
    /// each) as the AVX2 V pass does, for `H` heads of one KV head at once: each value row is
    /// widened once for all of them, and their f16 rounding chains (one per position) overlap.
    /// In cache, with Qwen2.5-1.5B's shape (six heads of 128 per KV head, 69 positions), the
    /// twelve heads' attention took 11.2-12.7 µs on one core three or two at a time against
    /// 12.3-13.5 one at a time. Its decode step, alternated in one process (paired ratios, one
    /// head at a time over two): 1.0050 and 1.0027 in the high-bandwidth state (726 and 561
    /// pairs), 0.9994 and 1.0010 in the low (774 and 439); two over three, 1.0010 and 1.0042 (796
    /// and 204). Each head's operations are the one-head pass's, in its order: the same f16
    /// results.
    ///
    /// # Safety
    /// The AVX-512 level is available; `heads.hd == 16 * N`; every `acc[h]` holds `16 * N` values
    /// and every `steps[h]` as many entries as `steps[0]`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn v_pass<const N: usize, const H: usize>(
        heads: &super::Paged<'_>,
        lo: usize,
        steps: [&[(f32, f32)]; H],
        acc: [&mut [f32]; H],
    ) {
        assert!(heads.hd == 16 * N && acc.iter().all(|a| a.len() == 16 * N));
        assert!(steps.iter().all(|s| s.len() == steps[0].len()));
        let r16 = |x: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
        let mut a = [[_mm512_setzero_ps(); N]; H];
        for (i, p) in (lo..lo + steps[0].len()).enumerate() {
            for (ah, st) in a.iter_mut().zip(&steps) {
                let ms = st[i].0;
                if ms != 1.0 {
                    let mv = _mm512_set1_ps(ms);
                    for x in ah.iter_mut() {
                        *x = r16(_mm512_mul_ps(*x, mv));
                    }
                }
            }
            let v = heads.v(p)[..16 * N].as_ptr();
            let vs: [__m512; H] = std::array::from_fn(|h| _mm512_set1_ps(steps[h][i].1));
            for j in 0..N {
                // SAFETY: v points at 16 * N f16 values (the slice above), j < N.
                let w = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(v.add(16 * j).cast()) });
                for (ah, vh) in a.iter_mut().zip(&vs) {
                    ah[j] = r16(_mm512_fmadd_ps(w, *vh, ah[j]));
                }
            }
        }
        for (ah, out) in a.iter().zip(acc) {
            for (j, x) in ah.iter().enumerate() {
                // SAFETY: out holds 16 * N floats (asserted), j < N.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(16 * j), *x) };
            }
        }
    }
}

/// [`one_chunk`] for heads that read one KV head (a GQA group), each with its own scratch
/// (`q16` set), head `g`'s (max, sum) into `ms[g]`: the same arithmetic per head, but at the
/// AVX-512 level (and ggml's AVX-512 build mimicked) each key row is widened once for all heads.
pub(super) fn one_chunk_heads(
    heads: &Paged<'_>,
    lo: usize,
    hi: usize,
    scale: f32,
    isa: GgmlIsa,
    group: &mut [Scratch],
    ms: &mut [(f32, f32)],
) {
    #[cfg(target_arch = "x86_64")]
    if group.len() > 1
        && isa == GgmlIsa::Avx512
        && crate::kernels::cpu::simd::current() >= crate::kernels::cpu::simd::Level::Avx512
    {
        type Group = unsafe fn(&Paged<'_>, usize, usize, f32, &mut [Scratch], &mut [(f32, f32)]);
        let f: Option<Group> = match heads.hd {
            64 => Some(avx512::one_chunk_group::<4>),
            128 => Some(avx512::one_chunk_group::<8>),
            // At 256 (Gemma-3) two heads at a time were 10-16% slower than one (contexts
            // 128-400, in cache); the per-head kernel stays.
            _ => None,
        };
        if let Some(f) = f {
            // SAFETY: the AVX-512 level was detected and the head width is the kernel's 16 * N.
            unsafe { f(heads, lo, hi, scale, group, ms) };
            return;
        }
    }
    for (s, m) in group.iter_mut().zip(ms.iter_mut()) {
        *m = one_chunk(heads, lo, hi, scale, isa, s);
    }
}

/// ggml's split-KV decode: one_chunk per chunk of `chunk` cells of `0..n_kv`, then
/// `ggml_flash_attn_ext_reduce_partials` (its multiply-adds fused as GCC compiles them).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn split_kv(
    heads: &Paged<'_>,
    lo: usize,
    pos: usize,
    scale: f32,
    isa: GgmlIsa,
    chunk: usize,
    n_kv: usize,
    group: &mut [Scratch],
    res: &mut [&mut [f32]],
) {
    // Per head of the group (heads sharing one KV head, each with its scratch and result row).
    let ng = group.len();
    let mut m_final = [f32::NEG_INFINITY; MAX_GROUP];
    let mut s_final = [0f32; MAX_GROUP];
    let mut ms = [(0f32, 0f32); MAX_GROUP];
    assert!(ng <= MAX_GROUP && res.len() == ng);
    for s in group.iter_mut() {
        s.merged.iter_mut().for_each(|v| *v = 0.0);
    }
    for c0 in (0..n_kv).step_by(chunk) {
        let c1 = (c0 + chunk).min(n_kv) - 1;
        let (a, b) = (lo.max(c0), pos.min(c1));
        if a > b {
            continue; // nothing visible: S == 0, skipped by the reduction
        }
        one_chunk_heads(heads, a, b, scale, isa, group, &mut ms[..ng]);
        for (g, s) in group.iter_mut().enumerate() {
            let (m_c, s_c) = ms[g];
            if s_c == 0.0 {
                continue;
            }
            let m_new = m_final[g].max(m_c);
            let scale_old = (m_final[g] - m_new).exp();
            let scale_new = (m_c - m_new).exp();
            for (f, &v) in s.merged.iter_mut().zip(&s.acc) {
                *f = f.mul_add(scale_old, v * scale_new);
            }
            s_final[g] = s_final[g].mul_add(scale_old, s_c * scale_new);
            m_final[g] = m_new;
        }
    }
    for (g, (r, s)) in res.iter_mut().zip(group.iter()).enumerate() {
        let inv = if s_final[g] != 0.0 {
            1.0 / s_final[g]
        } else {
            1.0
        };
        for (r, &v) in r.iter_mut().zip(&s.merged) {
            *r = v * inv;
        }
    }
}

/// Heads a group may hold ([`split_kv`], [`one_chunk_heads`]).
pub(super) const MAX_GROUP: usize = 8;

/// `ggml_vec_dot_f16` of two f16-valued rows (given widened to f32): per step of 4 vectors, one FMA
/// accumulator per vector (8 lanes on AVX2, 16 on AVX-512), accumulators folded pairwise, lanes
/// reduced as that build does; a tail past the last whole step is added in f64, in order.
#[inline(always)]
fn dot_f16(x: &[f32], y: &[f16], isa: GgmlIsa) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar {
        // SAFETY: a non-scalar level means AVX2, FMA and F16C were detected; `y` is a cache row
        // as long as the query row `x`.
        return unsafe { f16c::dot(x, y, isa) };
    }
    // Widened on the stack for heads up to 512 values (no allocation per scored position).
    let mut buf = [0f32; 512];
    if let Some(w) = buf.get_mut(..y.len()) {
        w.iter_mut().zip(y).for_each(|(w, v)| *w = v.to_f32());
        return dot_f16_wide(x, w, isa);
    }
    let y: Vec<f32> = y.iter().map(|v| v.to_f32()).collect();
    dot_f16_wide(x, &y, isa)
}

/// [`dot_f16`] of two rows given widened to f32 (the scalar form, and the twin the tests hold the
/// F16C kernel to).
#[inline(always)]
fn dot_f16_wide(x: &[f32], y: &[f32], isa: GgmlIsa) -> f32 {
    let n = x.len();
    match isa {
        GgmlIsa::Avx2 => {
            let np = n - n % 32;
            let mut acc = [[0f32; 8]; 4];
            for i in (0..np).step_by(32) {
                for (j, a) in acc.iter_mut().enumerate() {
                    let b = i + 8 * j;
                    for l in 0..8 {
                        a[l] = x[b + l].mul_add(y[b + l], a[l]);
                    }
                }
            }
            let s: [f32; 8] =
                std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
            // GGML_F32x8_REDUCE: 128-bit halves added, then two horizontal adds.
            let t0: [f32; 4] = std::array::from_fn(|i| s[i] + s[i + 4]);
            let mut sum = ((t0[0] + t0[1]) + (t0[2] + t0[3])) as f64;
            for i in np..n {
                sum += (x[i] * y[i]) as f64;
            }
            sum as f32
        }
        GgmlIsa::Avx512 => {
            let np = n - n % 64;
            let mut acc = [[0f32; 16]; 4];
            for i in (0..np).step_by(64) {
                for (j, a) in acc.iter_mut().enumerate() {
                    let b = i + 16 * j;
                    for l in 0..16 {
                        a[l] = x[b + l].mul_add(y[b + l], a[l]);
                    }
                }
            }
            let s: [f32; 16] =
                std::array::from_fn(|l| (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]));
            let mut sum = reduce16(&s) as f64;
            for i in np..n {
                sum += (x[i] * y[i]) as f64;
            }
            sum as f32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_f16_matches_plain_sum_on_exact_values() {
        // Small integers: every order gives the exact result, for both builds and with a tail.
        let x: Vec<f32> = (0..70).map(|i| (i % 7) as f32 - 3.0).collect();
        let y: Vec<f32> = (0..70).map(|i| (i % 5) as f32 - 2.0).collect();
        let want: f32 = x.iter().zip(&y).map(|(a, b)| a * b).sum();
        assert_eq!(dot_f16_wide(&x, &y, GgmlIsa::Avx2), want);
        assert_eq!(dot_f16_wide(&x, &y, GgmlIsa::Avx512), want);
    }

    #[test]
    fn two_pass_one_chunk_equals_the_scalar_twin() {
        // 192 takes the AVX2 V pass everywhere; the others the AVX-512 one where it runs.
        for hd in [64, 128, 192, 256] {
            for cold in [false, true] {
                two_pass_case(hd, cold);
            }
        }
    }

    /// K and V for `n` positions of two KV heads of `hd` in blocks of `bs` (random f16 values),
    /// and a block table that hands the blocks out in reverse, as a paged cache may.
    fn test_cache(hd: usize, bs: usize, n: usize, seed: u32) -> (Vec<f16>, Vec<f16>, Vec<u32>) {
        let f = |seed: u32, k: usize, mul: f32| -> Vec<f16> {
            crate::kernels::cpu::test_floats(k, seed)
                .iter()
                .map(|&v| f16::from_f32(v * mul))
                .collect()
        };
        let cells = n.div_ceil(bs) * bs;
        let (k, v) = (
            f(seed, cells * 2 * hd, 1.5),
            f(seed + 1, cells * 2 * hd, 2.0),
        );
        (k, v, (0..n.div_ceil(bs) as u32).rev().collect())
    }

    /// The second of the two KV heads `test_cache` lays out.
    fn second_head<'a>(
        k: &'a [f16],
        v: &'a [f16],
        table: &'a [u32],
        bs: usize,
        hd: usize,
        cold: bool,
    ) -> Paged<'a> {
        Paged {
            k,
            v,
            table,
            bs,
            kvd: 2 * hd,
            off: hd,
            hd,
            cold,
            fresh: None,
        }
    }

    fn two_pass_case(hd: usize, cold: bool) {
        let (bs, n): (usize, usize) = (32, 300);
        let (k, v, table) = test_cache(hd, bs, n, 3);
        let heads = second_head(&k, &v, &table, bs, hd, cold);
        let q = crate::kernels::cpu::test_floats(hd, 7);
        for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512] {
            for (lo, hi) in [(0, 0), (0, 299), (17, 140), (250, 299)] {
                let mut a = Scratch::new(hd);
                a.set_q16(&q);
                let mut b = Scratch::new(hd);
                b.set_q16(&q);
                let want = one_chunk_scalar(&heads, lo, hi, 0.09, isa, &mut a);
                let got = one_chunk(&heads, lo, hi, 0.09, isa, &mut b);
                assert_eq!(
                    (got.0.to_bits(), got.1.to_bits()),
                    (want.0.to_bits(), want.1.to_bits())
                );
                for (x, y) in b.acc.iter().zip(&a.acc) {
                    assert_eq!(x.to_bits(), y.to_bits(), "{isa:?} hd {hd} {lo}..={hi}");
                }
            }
        }
    }

    #[test]
    fn grouped_heads_equal_one_head_at_a_time() {
        for hd in [64, 128, 256, 192] {
            let (bs, n): (usize, usize) = (16, 200);
            let (k, v, table) = test_cache(hd, bs, n, 5);
            let heads = second_head(&k, &v, &table, bs, hd, true);
            for ng in 1..=MAX_GROUP {
                let qs: Vec<Vec<f32>> = (0..ng)
                    .map(|g| crate::kernels::cpu::test_floats(hd, 40 + g as u32))
                    .collect();
                let fresh = || -> Vec<Scratch> {
                    qs.iter()
                        .map(|q| {
                            let mut s = Scratch::new(hd);
                            s.set_q16(q);
                            s
                        })
                        .collect()
                };
                for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512] {
                    for (lo, hi) in [(0, 0), (0, 199), (33, 150)] {
                        let (mut a, mut b) = (fresh(), fresh());
                        let mut ms = vec![(0f32, 0f32); ng];
                        one_chunk_heads(&heads, lo, hi, 0.07, isa, &mut b, &mut ms);
                        for g in 0..ng {
                            let want = one_chunk(&heads, lo, hi, 0.07, isa, &mut a[g]);
                            let at = format!("hd {hd} heads {ng} {isa:?} {lo}..={hi} head {g}");
                            assert_eq!(
                                (ms[g].0.to_bits(), ms[g].1.to_bits()),
                                (want.0.to_bits(), want.1.to_bits()),
                                "{at}"
                            );
                            let bits =
                                |s: &Scratch| s.acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(&b[g]), bits(&a[g]), "{at}");
                        }
                        // The split-KV merge over chunks, grouped, against one head at a time.
                        let (mut a, mut b) = (fresh(), fresh());
                        let mut rb = vec![vec![0f32; hd]; ng];
                        let mut rbs: Vec<&mut [f32]> = rb.iter_mut().map(|r| &mut r[..]).collect();
                        split_kv(&heads, lo, hi, 0.07, isa, 64, 256, &mut b, &mut rbs);
                        for g in 0..ng {
                            let mut ra = vec![0f32; hd];
                            split_kv(
                                &heads,
                                lo,
                                hi,
                                0.07,
                                isa,
                                64,
                                256,
                                &mut a[g..g + 1],
                                &mut [&mut ra[..]],
                            );
                            let same = ra
                                .iter()
                                .zip(&rb[g])
                                .all(|(x, y)| x.to_bits() == y.to_bits());
                            assert!(
                                same,
                                "split: hd {hd} heads {ng} {isa:?} {lo}..={hi} head {g}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn dot_f16_on_cache_rows_equals_widened_twin() {
        let xs = crate::kernels::cpu::test_floats(300, 5);
        let ys: Vec<f16> = crate::kernels::cpu::test_floats(300, 9)
            .iter()
            .map(|&v| f16::from_f32(v * 3.0))
            .collect();
        for n in [128, 256, 70, 300, 8] {
            // q rounded to f16 as the kernel sees it
            let x: Vec<f32> = xs[..n].iter().map(|&v| f16::from_f32(v).to_f32()).collect();
            let yw: Vec<f32> = ys[..n].iter().map(|v| v.to_f32()).collect();
            for isa in [GgmlIsa::Avx2, GgmlIsa::Avx512] {
                let (got, want) = (dot_f16(&x, &ys[..n], isa), dot_f16_wide(&x, &yw, isa));
                assert_eq!(got.to_bits(), want.to_bits(), "{isa:?} n={n}: {got} {want}");
            }
        }
    }
}
