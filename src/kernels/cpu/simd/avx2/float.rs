//! AVX2 kernels for the half-precision float types: F16 × F16 and BF16 × BF16.
//!
//! Both follow ggml-cpu's AVX2 `ggml_vec_dot_f16` / `ggml_vec_dot_bf16`: 32 values per step in
//! four 8-lane f32 accumulators (F16: `fma(w, a, acc)`; BF16: `acc + w * a`, unfused, as ggml
//! writes it), ggml's reduction order, then the leftover `n % 32` products added in f64. Each row
//! of a tile keeps its own four accumulators, so a tile takes at most two rows per pass (16 ymm
//! registers).

use std::arch::x86_64::*;

use super::{entries, f16_at, ld128, prefetch_ahead};

entries!(f16_dot, f16_tile, f16_rows, 1, 2, 2, 2);
entries!(bf16_dot, bf16_tile, bf16_rows, 1, 2, 2, 2);

/// F16 × F16: `n` values (here `nb`) of f16 in both rows.
///
/// # Safety
/// AVX2, FMA and F16C are available; `w` points at `n` f16 values, `a + r * stride` for `r < M`
/// at `n` f16 values each; `out` at `M` writable f32 slots.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_rows<const M: usize>(
    n: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    let np = n & !31;
    let mut sum = [[_mm256_setzero_ps(); 4]; M];
    let mut i = 0;
    while i < np {
        let x = w.add(2 * i);
        prefetch_ahead(x, 1);
        let wx = [
            _mm256_cvtph_ps(ld128(x)),
            _mm256_cvtph_ps(ld128(x.add(16))),
            _mm256_cvtph_ps(ld128(x.add(32))),
            _mm256_cvtph_ps(ld128(x.add(48))),
        ];
        for (r, s) in sum.iter_mut().enumerate() {
            let y = a.add(r * stride + 2 * i);
            for (j, (sj, wj)) in s.iter_mut().zip(wx.iter()).enumerate() {
                *sj = _mm256_fmadd_ps(*wj, _mm256_cvtph_ps(ld128(y.add(16 * j))), *sj);
            }
        }
        i += 32;
    }
    for (r, s) in sum.iter().enumerate() {
        // GGML_F32x8_REDUCE: (s0 + s2) + (s1 + s3), halves, then two horizontal adds.
        let x = _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3]));
        let t0 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let t1 = _mm_hadd_ps(t0, t0);
        let mut sumf = _mm_cvtss_f32(_mm_hadd_ps(t1, t1)) as f64;
        let y = a.add(r * stride);
        for k in np..n {
            sumf += (f16_at(w.add(2 * k)) * f16_at(y.add(2 * k))) as f64;
        }
        *out.add(r) = sumf as f32;
    }
}

/// Eight bf16 at `p` widened to f32 (exact: shifted into the high half).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16x8(p: *const u8) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(p))))
}

/// The bf16 at `p` widened to f32.
#[inline]
unsafe fn bf16_at(p: *const u8) -> f32 {
    f32::from_bits((p.cast::<u16>().read_unaligned() as u32) << 16)
}

/// BF16 × BF16: `n` values (here `nb`) of bf16 in both rows.
///
/// # Safety
/// As [`f16_rows`], with bf16 values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bf16_rows<const M: usize>(
    n: usize,
    w: *const u8,
    a: *const u8,
    stride: usize,
    out: *mut f32,
) {
    let np = n & !31;
    let mut sum = [[_mm256_setzero_ps(); 4]; M];
    let mut i = 0;
    while i < np {
        let x = w.add(2 * i);
        prefetch_ahead(x, 1);
        let wx = [
            bf16x8(x),
            bf16x8(x.add(16)),
            bf16x8(x.add(32)),
            bf16x8(x.add(48)),
        ];
        for (r, s) in sum.iter_mut().enumerate() {
            let y = a.add(r * stride + 2 * i);
            for (j, (sj, wj)) in s.iter_mut().zip(wx.iter()).enumerate() {
                *sj = _mm256_add_ps(_mm256_mul_ps(*wj, bf16x8(y.add(16 * j))), *sj);
            }
        }
        i += 32;
    }
    for (r, s) in sum.iter().enumerate() {
        let c = _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3]));
        let mut g = _mm_add_ps(_mm256_extractf128_ps::<1>(c), _mm256_castps256_ps128(c));
        g = _mm_add_ps(g, _mm_movehl_ps(g, g));
        g = _mm_add_ss(g, _mm_movehdup_ps(g));
        let mut sumf = _mm_cvtss_f32(g) as f64;
        let y = a.add(r * stride);
        for k in np..n {
            sumf += (bf16_at(w.add(2 * k)) * bf16_at(y.add(2 * k))) as f64;
        }
        *out.add(r) = sumf as f32;
    }
}
