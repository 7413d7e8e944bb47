//! The tiled flash-attention kernel ([`super::tiled`]) for up to [`ROWS`] query rows of one sequence
//! and head at once, with AVX2. Each row keeps exactly the single-row arithmetic (the same tiles,
//! score chains, softmax and V chains); what the rows share is the loads: every transposed-key
//! vector and every V row read from L2 feeds all the rows' FMAs, where one row alone is bound by
//! those loads (a 64-key tile of 128-256 dims does not fit L1).
//!
//! Rows may see different ranges (`lo..=pos`): scores are computed over the tile's union range and
//! each row keeps only its own; V runs over the union and each row's chain takes only its own
//! positions. A row with nothing visible in a tile skips the tile, as the single-row kernel does.

use std::arch::x86_64::*;

use super::{soft_max, GgmlIsa, Heads, FA_TILE_KV};

/// Query rows per call.
pub(super) const ROWS: usize = 4;

/// Whether [`tiled_rows`] takes a head of `hd` values on this CPU.
pub(super) fn applies(hd: usize) -> bool {
    hd.is_multiple_of(64)
        && crate::kernels::cpu::simd::current() != crate::kernels::cpu::simd::Level::Scalar
}

/// Rows `qs` (1..=ROWS) with visible ranges `ranges[r] = (lo, pos)` over the widened keys of one
/// head; row r's normalised result goes to `res[r]`. Panics unless [`applies`] holds.
/// Compiled with AVX2 and FMA, so the `mul_add`s of what it inlines (the softmax's exponential)
/// are instructions, not libm `fmaf` calls (the same results: exactly rounded either way).
///
/// # Safety
/// [`applies`] holds for the head size (a non-scalar SIMD level: AVX2 and FMA detected).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tiled_rows(
    qs: &[&[f32]],
    heads: &Heads<'_>,
    ranges: &[(usize, usize)],
    scale: f32,
    isa: GgmlIsa,
    res: &mut [Vec<f32>],
) {
    let n = qs.len();
    let hd = heads.hd;
    assert!((1..=ROWS).contains(&n) && ranges.len() == n && res.len() >= n && applies(hd));
    assert!(qs.iter().all(|q| q.len() == hd) && ranges.iter().all(|&(lo, pos)| lo <= pos));
    let mut m = [f32::NEG_INFINITY; ROWS];
    let mut sum = [0f32; ROWS];
    let mut acc: Vec<Vec<f32>> = (0..n).map(|_| vec![0f32; hd]).collect();
    let mut kq = [[f32::NEG_INFINITY; FA_TILE_KV]; ROWS];
    let t0 = ranges.iter().map(|r| r.0).min().unwrap_or(0) / FA_TILE_KV;
    let t1 = ranges.iter().map(|r| r.1).max().unwrap_or(0) / FA_TILE_KV;
    for t in t0..=t1 {
        let base = t * FA_TILE_KV;
        let ab: Vec<(usize, usize)> = ranges
            .iter()
            .map(|&(lo, pos)| (lo.max(base), pos.min(base + FA_TILE_KV - 1)))
            .collect();
        let active: Vec<usize> = (0..n).filter(|&r| ab[r].0 <= ab[r].1).collect();
        let Some(a) = active.iter().map(|&r| ab[r].0).min() else {
            continue;
        };
        let b = active.iter().map(|&r| ab[r].1).max().unwrap_or(a);
        for row in kq.iter_mut() {
            row.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        }
        // Scores of every row over the union's groups of eight keys, kept where visible.
        let (g_lo, g_hi) = (a / 8, b / 8);
        let mut g = g_lo;
        while g <= g_hi {
            let mut sc = [[[0f32; 8]; 8]; ROWS];
            let k = scores(qs, heads, g, g_hi + 1 - g, &mut sc);
            for &r in &active {
                let (ar, br) = ab[r];
                for (i, grp) in sc[r][..k].iter().enumerate() {
                    for (j, &s) in grp.iter().enumerate() {
                        let p = 8 * (g + i) + j;
                        if (ar..=br).contains(&p) {
                            kq[r][p - base] = s * scale;
                        }
                    }
                }
            }
            g += k;
        }
        // Each row's online softmax, exactly as the single-row kernel.
        for &r in &active {
            let (ar, br) = ab[r];
            let mut tile_max = f32::NEG_INFINITY;
            for &s in &kq[r][ar - base..=br - base] {
                tile_max = if tile_max > s { tile_max } else { s };
            }
            let m_new = m[r].max(tile_max);
            if m_new > m[r] {
                let ms = (m[r] - m_new).exp();
                acc[r].iter_mut().for_each(|v| *v *= ms);
                sum[r] *= ms;
            }
            m[r] = m_new;
            sum[r] = (sum[r] as f64 + soft_max(&mut kq[r], m_new, isa)) as f32;
        }
        // V over the union range, each row's chain over its own positions only.
        let ws: Vec<&[f32]> = active
            .iter()
            .map(|&r| &kq[r][a - base..=b - base])
            .collect();
        let spans: Vec<(usize, usize)> =
            active.iter().map(|&r| (ab[r].0 - a, ab[r].1 - a)).collect();
        let mut accs: Vec<&mut [f32]> = acc
            .iter_mut()
            .enumerate()
            .filter(|(r, _)| active.contains(r))
            .map(|(_, v)| v.as_mut_slice())
            .collect();
        accumulate_v(heads, a, b, &ws, &spans, &mut accs);
    }
    for r in 0..n {
        let inv = if sum[r] == 0.0 { 0.0 } else { 1.0 / sum[r] };
        for (o, &v) in res[r].iter_mut().zip(&acc[r]) {
            *o = v * inv;
        }
    }
}

/// Scores of every row for up to `want` groups of eight keys from group `g`; returns how many
/// groups were computed (at least one, at most what keeps eight accumulators).
fn scores(
    qs: &[&[f32]],
    heads: &Heads<'_>,
    g: usize,
    want: usize,
    out: &mut [[[f32; 8]; 8]; ROWS],
) -> usize {
    let wide = wide();
    // Key groups per call: eight accumulator vectors where the rows allow.
    let groups = match (qs.len(), wide) {
        (1, _) | (2, true) => 8,
        (2, false) | (_, true) => 4,
        _ => 2,
    };
    let k = want.min(groups);
    let kts: [&[f32]; 8] = std::array::from_fn(|i| heads.kt(g + i.min(k - 1)));
    if wide {
        // SAFETY: `wide()` holds only at the AVX-512 level (its features detected); every `kt`
        // slice holds 8 values per element of each query row (`Heads::kt`, rows of `hd` values).
        unsafe {
            match qs.len() {
                1 => scores_avx512::<1, 4>(qs, &kts, out),
                2 => scores_avx512::<2, 4>(qs, &kts, out),
                3 => scores_avx512::<3, 2>(qs, &kts, out),
                _ => scores_avx512::<4, 2>(qs, &kts, out),
            }
        }
        return k;
    }
    // SAFETY: `applies` (asserted by the caller) means AVX2 and FMA were detected; every `kt`
    // slice holds 8 values per element of each query row (`Heads::kt`, rows of `hd` values).
    unsafe {
        match qs.len() {
            1 => scores_avx2::<1, 8>(qs, &kts, out),
            2 => scores_avx2::<2, 4>(qs, &kts, out),
            3 => scores_avx2::<3, 2>(qs, &kts, out),
            _ => scores_avx2::<4, 2>(qs, &kts, out),
        }
    }
    k
}

/// `R` rows × `G` groups of eight keys: `out[r][i][j] = Σ_d kt[i][8d + j] · q_r[d]`, one FMA chain
/// per score in `d` order (as `super::scores_avx2`), each key vector loaded once for all rows.
///
/// # Safety
/// AVX2 and FMA are available; `qs` has at least `R` rows of equal length and every `kt[i]`
/// (`i < G`) at least eight values per element of a row.
#[allow(clippy::needless_range_loop)] // rows, groups and positions index several arrays at once
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2<const R: usize, const G: usize>(
    qs: &[&[f32]],
    kt: &[&[f32]; 8],
    out: &mut [[[f32; 8]; 8]; ROWS],
) {
    let n = qs[0].len();
    assert!(R <= qs.len() && qs[..R].iter().all(|q| q.len() == n));
    assert!(G <= 8 && kt[..G].iter().all(|k| k.len() >= 8 * n));
    let mut c = [[_mm256_setzero_ps(); G]; R];
    for d in 0..n {
        let xs: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(qs[r][d]));
        for i in 0..G {
            let kv = _mm256_loadu_ps(kt[i].as_ptr().add(8 * d));
            for r in 0..R {
                c[r][i] = _mm256_fmadd_ps(kv, xs[r], c[r][i]);
            }
        }
    }
    for r in 0..R {
        for i in 0..G {
            _mm256_storeu_ps(out[r][i].as_mut_ptr(), c[r][i]);
        }
    }
}

/// Whether the AVX-512 kernels run (the AVX-512 level): sixteen lanes, the same per-lane chains.
fn wide() -> bool {
    crate::kernels::cpu::simd::current() >= crate::kernels::cpu::simd::Level::Avx512
}

/// [`scores_avx2`] with sixteen lanes: vector `i` holds key groups `2i` and `2i + 1` (`P` pairs),
/// each score still one FMA chain in `d` order, so the scores are bit-identical.
///
/// # Safety
/// The AVX-512 level is available; as [`scores_avx2`] with `G = 2P` groups.
#[allow(clippy::needless_range_loop)] // rows, groups and positions index several arrays at once
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn scores_avx512<const R: usize, const P: usize>(
    qs: &[&[f32]],
    kt: &[&[f32]; 8],
    out: &mut [[[f32; 8]; 8]; ROWS],
) {
    let n = qs[0].len();
    assert!(R <= qs.len() && qs[..R].iter().all(|q| q.len() == n));
    assert!(2 * P <= 8 && kt[..2 * P].iter().all(|k| k.len() >= 8 * n));
    let mut c = [[_mm512_setzero_ps(); P]; R];
    for d in 0..n {
        let xs: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(qs[r][d]));
        for i in 0..P {
            let lo = _mm256_loadu_ps(kt[2 * i].as_ptr().add(8 * d));
            let hi = _mm256_loadu_ps(kt[2 * i + 1].as_ptr().add(8 * d));
            let kv = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
                _mm256_castps_pd(hi),
            ));
            for r in 0..R {
                c[r][i] = _mm512_fmadd_ps(kv, xs[r], c[r][i]);
            }
        }
    }
    for r in 0..R {
        for i in 0..P {
            let mut both = [0f32; 16];
            _mm512_storeu_ps(both.as_mut_ptr(), c[r][i]);
            out[r][2 * i].copy_from_slice(&both[..8]);
            out[r][2 * i + 1].copy_from_slice(&both[8..]);
        }
    }
}

/// `acc_r[d] = fma(v[p][d], ws[r][p - a], acc_r[d])` for p = a + spans[r].0 ..= a + spans[r].1,
/// one chain per element in position order, each V vector loaded once for all rows.
fn accumulate_v(
    heads: &Heads<'_>,
    a: usize,
    b: usize,
    ws: &[&[f32]],
    spans: &[(usize, usize)],
    accs: &mut [&mut [f32]],
) {
    let hd = heads.hd;
    assert!(ws.len() == accs.len() && spans.len() == ws.len() && (1..=ROWS).contains(&ws.len()));
    assert!(spans.iter().all(|&(x, y)| x <= y && y <= b - a));
    assert!(ws.iter().all(|w| w.len() == b + 1 - a) && accs.iter().all(|x| x.len() == hd));
    // Rows a..=b lie `kvd` values apart in one buffer (`Heads::v`): the first and last rows'
    // bounds cover every read.
    let (first, last) = (heads.v(a).as_ptr(), heads.v(b).as_ptr());
    assert_eq!(last as usize - first as usize, (b - a) * heads.kvd * 4);
    // Positions every row sees run shared; a row's own leading and trailing positions run alone
    // before and after them, so each row's chain stays in position order.
    let cs = spans.iter().map(|s| s.0).max().unwrap_or(0);
    let ce = spans.iter().map(|s| s.1).min().unwrap_or(0);
    let kvd = heads.kvd;
    let wide = wide();
    let one = |r: usize, i0: usize, i1: usize, accs: &mut [&mut [f32]]| {
        // SAFETY: as for the shared call below, for one row.
        unsafe {
            if wide {
                v_avx512::<1, 4>(first, kvd, hd, &ws[r..=r], i0, i1, &mut accs[r..=r])
            } else {
                v_avx2::<1, 8>(first, kvd, hd, &ws[r..=r], i0, i1, &mut accs[r..=r])
            }
        }
    };
    if cs > ce {
        for (r, &(lo, hi)) in spans.iter().enumerate() {
            one(r, lo, hi, accs);
        }
        return;
    }
    for (r, &(lo, _)) in spans.iter().enumerate() {
        if lo < cs {
            one(r, lo, cs - 1, accs);
        }
    }
    // SAFETY: `applies` (asserted by `tiled_rows`) means AVX2 and FMA were detected; rows a..=b
    // of `hd` values start at `first + (p - a) * kvd` inside the buffer (checked just above), every
    // position index used is at most b - a, and each accumulator has `hd` values, a multiple of
    // 64.
    // At the AVX-512 level the same with sixteen lanes (`wide()` only after its detection).
    unsafe {
        match (ws.len(), wide) {
            (1, true) => v_avx512::<1, 4>(first, kvd, hd, ws, cs, ce, accs),
            (2, true) => v_avx512::<2, 4>(first, kvd, hd, ws, cs, ce, accs),
            (3, true) => v_avx512::<3, 2>(first, kvd, hd, ws, cs, ce, accs),
            (_, true) => v_avx512::<4, 2>(first, kvd, hd, ws, cs, ce, accs),
            (1, _) => v_avx2::<1, 8>(first, kvd, hd, ws, cs, ce, accs),
            (2, _) => v_avx2::<2, 4>(first, kvd, hd, ws, cs, ce, accs),
            (3, _) => v_avx2::<3, 2>(first, kvd, hd, ws, cs, ce, accs),
            _ => v_avx2::<4, 2>(first, kvd, hd, ws, cs, ce, accs),
        }
    }
    for (r, &(_, hi)) in spans.iter().enumerate() {
        if hi > ce {
            one(r, ce + 1, hi, accs);
        }
    }
}

/// [`accumulate_v`] for `R` rows all taking positions `i0..=i1` (indices from `a`), `V` vectors
/// (8·V values) of each row's accumulator in registers at a time.
///
/// # Safety
/// AVX2 and FMA are available; `v0 + i * step` points at `hd` readable f32 for every `i` in
/// `i0..=i1`; `hd % (8 * V) == 0`; `ws` and `accs` hold at least `R` rows, `ws[r]` longer than
/// `i1`, `accs[r]` of `hd` values.
#[allow(clippy::needless_range_loop)] // rows, groups and positions index several arrays at once
#[target_feature(enable = "avx2,fma")]
unsafe fn v_avx2<const R: usize, const V: usize>(
    v0: *const f32,
    step: usize,
    hd: usize,
    ws: &[&[f32]],
    i0: usize,
    i1: usize,
    accs: &mut [&mut [f32]],
) {
    for d0 in (0..hd).step_by(8 * V) {
        let mut c: [[__m256; V]; R] = std::array::from_fn(|r| {
            std::array::from_fn(|j| _mm256_loadu_ps(accs[r].as_ptr().add(d0 + 8 * j)))
        });
        for i in i0..=i1 {
            let v = v0.add(i * step + d0);
            let wv: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(ws[r][i]));
            for j in 0..V {
                let x = _mm256_loadu_ps(v.add(8 * j));
                for r in 0..R {
                    c[r][j] = _mm256_fmadd_ps(x, wv[r], c[r][j]);
                }
            }
        }
        for r in 0..R {
            for j in 0..V {
                _mm256_storeu_ps(accs[r].as_mut_ptr().add(d0 + 8 * j), c[r][j]);
            }
        }
    }
}

/// [`v_avx2`] with sixteen lanes (`V` vectors, 16·V values, at a time): each element's chain is
/// the same, so the results are bit-identical.
///
/// # Safety
/// The AVX-512 level is available; as [`v_avx2`] with `hd % (16 * V) == 0`.
#[allow(clippy::needless_range_loop)] // rows, groups and positions index several arrays at once
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn v_avx512<const R: usize, const V: usize>(
    v0: *const f32,
    step: usize,
    hd: usize,
    ws: &[&[f32]],
    i0: usize,
    i1: usize,
    accs: &mut [&mut [f32]],
) {
    for d0 in (0..hd).step_by(16 * V) {
        let mut c: [[__m512; V]; R] = std::array::from_fn(|r| {
            std::array::from_fn(|j| _mm512_loadu_ps(accs[r].as_ptr().add(d0 + 16 * j)))
        });
        for i in i0..=i1 {
            let v = v0.add(i * step + d0);
            let wv: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(ws[r][i]));
            for j in 0..V {
                let x = _mm512_loadu_ps(v.add(16 * j));
                for r in 0..R {
                    c[r][j] = _mm512_fmadd_ps(x, wv[r], c[r][j]);
                }
            }
        }
        for r in 0..R {
            for j in 0..V {
                _mm512_storeu_ps(accs[r].as_mut_ptr().add(d0 + 16 * j), c[r][j]);
            }
        }
    }
}
