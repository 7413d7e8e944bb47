//! Whether the AVX-512 decode kernels of Q4_K, Q6_K and Q8_0 prefetch their weight stream in
//! software, chosen once per process for this CPU.
//!
//! These kernels stream each weight matrix once per token, and whether software prefetches ahead
//! of the stream pay depends on the core's own hardware prefetchers:
//! - AMD family 26 (Zen 5): they pay. The x16 Q6_K kernel read 64 GB/s without them and 74-75
//!   GB/s with them, Q4_K's decode matmuls 19.7 GB/s issued in one burst and 24.9 spread (earlier
//!   sessions' measurements, recorded at each kernel's prefetch).
//! - AMD family 25 (Zen 4, EPYC 9004; of that family only Zen 4 has AVX-512): they cost. Decode
//!   steps alternated with and without them in one process (paired step times, 2026-11-26):
//!   Qwen2.5-1.5B's step 5.7% shorter without them while the bandwidth probe read about 36 GB/s
//!   and 15% at about 55; Gemma-3 270M's 37% (its Q8_0 output head is most of its bytes).
//! - Other CPUs (an Intel Xeon VM in earlier sessions): on, as the kernels were tuned.
//!
//! `INFER_PREFETCH=0` or `1` overrides the choice (for measuring); [`set`] changes it at run
//! time (benchmarks, tests). Invariant: a prefetch is a hint, so results never depend on the
//! choice (the kernels' tests run both ways). The Q5_0 kernel prefetches on every CPU: on Zen 4
//! Gemma-3's step was 0.9-1.7% shorter with them. Where the choice is off, Q4_K's GEMV flavour
//! (one or two rows) still asks for one line per unit block far ahead, a seed for the hardware
//! prefetcher rather than the stream (`SEED_AHEAD` in `q4_k_x8`); with three or four rows it asks
//! for every line that far ahead into L2, as do Q6_K's kernel for two to four rows and Q8_0's for
//! three and four (`rows_m` in `q6_k_x16`, `Q8_0::fold_block` in `q8_0_x16`): slower per byte
//! than one row, they leave the hardware prefetcher behind.

use std::sync::atomic::{AtomicU8, Ordering};

const UNSET: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNSET);

/// Whether the streaming decode kernels issue software prefetches.
#[inline]
pub fn on() -> bool {
    match STATE.load(Ordering::Relaxed) {
        UNSET => {
            let v = choose(std::env::var("INFER_PREFETCH").ok().as_deref(), detect());
            STATE.store(v as u8, Ordering::Relaxed);
            v
        }
        s => s == 1,
    }
}

/// `streaming` where the decode kernels prefetch their stream ([`on`]), else `seeded`: how a
/// caller picks between the two builds of a kernel compiled for one choice each (a flag tested
/// inside the kernels' loops had cost decode a taken branch a cache line).
#[inline]
pub fn pick<T>(streaming: T, seeded: T) -> T {
    if on() {
        streaming
    } else {
        seeded
    }
}

/// Sets the choice for the rest of the process (or until set again).
pub fn set(on: bool) {
    STATE.store(on as u8, Ordering::Relaxed);
}

/// Runs `f` with the prefetches off, then on, and leaves the choice as it found it: for tests that
/// hold both paths to the same truth (serialized, so two such tests never interleave their
/// settings; other tests may see either, which by the invariant changes nothing for them).
#[cfg(test)]
pub(crate) fn each(mut f: impl FnMut(bool)) {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let was = on();
    for stream in [false, true] {
        set(stream);
        f(stream);
    }
    set(was);
}

/// The choice: the environment's `0`/`1` where given, else what the CPU calls for.
fn choose(env: Option<&str>, detected: bool) -> bool {
    match env.map(str::trim) {
        Some("0") | Some("off") => false,
        Some("1") | Some("on") => true,
        _ => detected,
    }
}

/// Software prefetch everywhere but on AMD family 25, where it was measured to cost.
fn detect() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        let v = __cpuid(0);
        let mut vendor = [0u8; 12];
        for (i, r) in [v.ebx, v.edx, v.ecx].iter().enumerate() {
            vendor[4 * i..4 * i + 4].copy_from_slice(&r.to_le_bytes());
        }
        wants(&vendor, family(__cpuid(1).eax))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The display family of a CPUID leaf-1 signature (`eax`): the base family, plus the extended
/// family where the base is 15.
fn family(sig: u32) -> u32 {
    let base = (sig >> 8) & 0xF;
    if base == 0xF {
        base + ((sig >> 20) & 0xFF)
    } else {
        base
    }
}

/// Whether a CPU of this vendor string and family gets software prefetches.
fn wants(vendor: &[u8; 12], family: u32) -> bool {
    !(vendor == b"AuthenticAMD" && family == 0x19)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn environment_overrides_detection() {
        assert!(!choose(Some("0"), true));
        assert!(!choose(Some("off"), true));
        assert!(choose(Some("1"), false));
        assert!(choose(Some(" on "), false));
        assert!(choose(None, true));
        assert!(!choose(Some("maybe"), false));
    }

    #[test]
    fn families_of_known_signatures() {
        // Leaf-1 signatures as these CPUs report them: EPYC 9004 (Zen 4), EPYC 9005 (Zen 5),
        // Xeon Sapphire Rapids, Ryzen 5000 (Zen 3).
        assert_eq!(family(0x00A1_0F11), 0x19);
        assert_eq!(family(0x00B0_0F21), 0x1A);
        assert_eq!(family(0x0008_06F8), 6);
        assert_eq!(family(0x00A2_0F10), 0x19);
        assert!(wants(b"AuthenticAMD", 0x1A));
        assert!(!wants(b"AuthenticAMD", 0x19));
        assert!(wants(b"GenuineIntel", 6));
    }
}
