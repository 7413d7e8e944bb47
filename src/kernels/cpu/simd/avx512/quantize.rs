//! AVX-512 twins of the activation quantizers, bit for bit:
//! - ggml's `quantize_row_q8_K_ref` (the activation format of the k-quants): the same first element
//!   of largest magnitude, the same `iscale = -127 / max` and products, round-to-nearest-even where
//!   the reference adds 1.5·2²³, the same clamp at 127, block sums and `d = 1 / iscale`. The tests
//!   hold it to `crate::quant::quantize::quantize_row_q8_k`.
//! - ggml-cpu's x86 `quantize_row_q8_0` (the activations of Q4_0/Q5_0/Q8_0 weights): `d = max/127`,
//!   `id = 127/max`, `v · id` rounded to nearest even and saturated to i8. The tests hold it to
//!   `quantize_row_q8_0_as(.., Q8Variant::X86Avx)` (on non-NaN input).

use std::arch::x86_64::*;

/// Bytes of one Q8_K block: `d` (f32), 256 `i8`, 16 `i16` block sums.
const BLOCK: usize = 292;

/// Quantizes `src` (a whole number of 256-value blocks) into `dst` (exactly that many Q8_K
/// blocks). Panics on other lengths or where the AVX-512 level is missing.
pub(crate) fn quantize_row_q8k(src: &[f32], dst: &mut [u8]) {
    assert!(super::detected(), "the AVX-512 level is not available");
    assert!(
        src.len().is_multiple_of(256),
        "Q8_K rows are whole 256-value blocks"
    );
    assert_eq!(dst.len(), src.len() / 256 * BLOCK, "Q8_K output bytes");
    for (x, o) in src.chunks_exact(256).zip(dst.chunks_exact_mut(BLOCK)) {
        // SAFETY: the AVX-512 level was detected (asserted); `x` holds 256 floats and `o` one
        // block's bytes, which is all `block` reads and writes.
        unsafe { block(x.as_ptr(), o.as_mut_ptr()) };
    }
}

/// # Safety
/// The AVX-512 level is available; `x` points at 256 floats, `o` at [`BLOCK`] writable bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block(x: *const f32, o: *mut u8) {
    let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
    let abs = |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask));
    let mut m = _mm512_setzero_ps();
    for k in 0..16 {
        // `vmaxps` returns its second operand when either is NaN: NaNs never win, as in the
        // reference's `ax > amax`.
        m = _mm512_max_ps(abs(_mm512_loadu_ps(x.add(16 * k))), m);
    }
    let amax = _mm512_reduce_max_ps(m);
    if amax == 0.0 {
        std::ptr::write_bytes(o, 0, BLOCK);
        return;
    }
    // The first element whose magnitude is `amax`, with its sign.
    let target = _mm512_set1_ps(amax);
    let mut max = 0.0f32;
    for k in 0..16 {
        let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(abs(_mm512_loadu_ps(x.add(16 * k))), target);
        if hit != 0 {
            max = *x.add(16 * k + hit.trailing_zeros() as usize);
            break;
        }
    }
    let iscale = -127.0 / max;
    let vs = _mm512_set1_ps(iscale);
    let c127 = _mm512_set1_epi32(127);
    for k in 0..16 {
        let q = _mm512_cvtps_epi32(_mm512_mul_ps(vs, _mm512_loadu_ps(x.add(16 * k))));
        let q = _mm512_min_epi32(q, c127);
        _mm_storeu_si128(o.add(4 + 16 * k).cast(), _mm512_cvtepi32_epi8(q));
        let s = _mm512_reduce_add_epi32(q) as i16;
        o.add(260 + 2 * k).cast::<i16>().write_unaligned(s);
    }
    o.cast::<f32>().write_unaligned(1.0 / iscale);
}

/// Bytes of one Q8_0 block: `d` (f16), 32 `i8`.
const BLOCK_Q8_0: usize = 34;

/// Quantizes `src` (a whole number of 32-value blocks) into `dst` (exactly that many Q8_0 blocks),
/// as ggml-cpu's x86 `quantize_row_q8_0`. Panics on other lengths or where the AVX-512 level is
/// missing.
pub(crate) fn quantize_row_q8_0(src: &[f32], dst: &mut [u8]) {
    assert!(super::detected(), "the AVX-512 level is not available");
    assert!(
        src.len().is_multiple_of(32),
        "Q8_0 rows are whole 32-value blocks"
    );
    assert_eq!(dst.len(), src.len() / 32 * BLOCK_Q8_0, "Q8_0 output bytes");
    for (x, o) in src.chunks_exact(32).zip(dst.chunks_exact_mut(BLOCK_Q8_0)) {
        // SAFETY: the AVX-512 level was detected (asserted); `x` holds 32 floats and `o` one
        // block's 34 bytes, which is all `block_q8_0` reads and writes.
        let d = unsafe { block_q8_0(x.as_ptr(), o.as_mut_ptr().add(2)) };
        o[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    }
}

/// Writes the 32 quants of one Q8_0 block at `q` and returns its `d` (as f32).
///
/// # Safety
/// The AVX-512 level is available; `x` points at 32 floats, `q` at 32 writable bytes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_q8_0(x: *const f32, q: *mut u8) -> f32 {
    let abs_mask = _mm512_set1_epi32(0x7fff_ffff);
    let abs = |v: __m512| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask));
    let (v0, v1) = (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)));
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(abs(v0), abs(v1)));
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mul = _mm512_set1_ps(id);
    // `vcvtps2dq` rounds to nearest even (the default MXCSR mode), `vpmovsdb` saturates to i8.
    for (k, v) in [v0, v1].into_iter().enumerate() {
        let i = _mm512_cvtps_epi32(_mm512_mul_ps(v, mul));
        _mm_storeu_si128(q.add(16 * k).cast(), _mm512_cvtsepi32_epi8(i));
    }
    amax / 127.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform floats in [-1, 1) from a xorshift seeded with `seed`.
    fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
    }

    #[test]
    #[cfg_attr(
        not(infer_host_avx512),
        ignore = "needs AVX-512 F/BW/VL/VNNI, which the CPU that built the tests lacks"
    )]
    fn equals_the_scalar_reference() {
        assert!(super::super::detected(), "needs AVX-512");
        let mut next = uniform(0x2545_f491_4f6c_dd1d);
        let mut cases: Vec<Vec<f32>> = Vec::new();
        for scale in [1e-3f32, 1.0, 37.5, 1e4] {
            cases.push((0..512).map(|_| next() * scale).collect());
        }
        // Ties of magnitude (the first one decides the sign), all zeros, a NaN, halves that
        // round to even, a lone spike.
        let mut ties = vec![0.25f32; 256];
        ties[3] = -2.0;
        ties[200] = 2.0;
        cases.push(ties);
        cases.push(vec![0.0; 256]);
        let mut nan: Vec<f32> = (0..256).map(|i| i as f32 - 100.0).collect();
        nan[5] = f32::NAN;
        cases.push(nan);
        cases.push((0..256).map(|i| (i as f32 - 127.0) * 0.5).collect());
        let mut spike = vec![1e-6f32; 256];
        spike[255] = -3.0;
        cases.push(spike);
        for (i, src) in cases.iter().enumerate() {
            let mut want = vec![0u8; src.len() / 256 * BLOCK];
            crate::quant::quantize::quantize_row_q8_k(src, &mut want);
            let mut got = vec![0xAAu8; want.len()];
            quantize_row_q8k(src, &mut got);
            assert_eq!(got, want, "case {i}");
        }
    }

    #[test]
    #[cfg_attr(
        not(infer_host_avx512),
        ignore = "needs AVX-512 F/BW/VL/VNNI, which the CPU that built the tests lacks"
    )]
    fn q8_0_equals_the_x86_scalar_variant() {
        use crate::quant::quantize::{quantize_row_q8_0_as, Q8Variant};
        assert!(super::super::detected(), "needs AVX-512");
        let mut next = uniform(0x9e37_79b9_7f4a_7c15);
        let mut cases: Vec<Vec<f32>> = Vec::new();
        for scale in [1e-4f32, 1.0, 37.5, 1e5] {
            cases.push((0..640).map(|_| next() * scale).collect());
        }
        // All zeros, exact halves that round to even, a lone spike of either sign.
        cases.push(vec![0.0; 64]);
        cases.push((0..64).map(|i| (i as f32 - 32.0) * 0.5).collect());
        let mut spike = vec![1e-6f32; 32];
        spike[31] = -3.0;
        cases.push(spike);
        for (i, src) in cases.iter().enumerate() {
            let mut want = vec![0u8; src.len() / 32 * BLOCK_Q8_0];
            quantize_row_q8_0_as(src, &mut want, Q8Variant::X86Avx);
            let mut got = vec![0xAAu8; want.len()];
            quantize_row_q8_0(src, &mut got);
            assert_eq!(got, want, "case {i}");
        }
    }
}
