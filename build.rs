//! Build script: tells the tests which SIMD levels the machine that builds them has, so a kernel
//! test for a level this CPU lacks is compiled as `#[ignore]` with the reason (visible in `cargo
//! test`'s output as "ignored") instead of returning early and counting as passed. It sets
//! `infer_host_avx2` (AVX2 + FMA + F16C) and `infer_host_avx512` (those plus AVX-512 F, BW, VL and
//! VNNI), the same tests as `kernels::cpu::simd`'s runtime detection, and only when the target is
//! the machine building (a cross build marks them all ignored). Nothing here affects the library:
//! the binary still chooses its kernels at run time.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(infer_host_avx2)");
    println!("cargo::rustc-check-cfg=cfg(infer_host_avx512)");
    println!("cargo::rerun-if-changed=build.rs");
    let native = std::env::var("TARGET").ok() == std::env::var("HOST").ok();
    #[cfg(target_arch = "x86_64")]
    if native {
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        let avx512 = avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512vnni");
        if avx2 {
            println!("cargo::rustc-cfg=infer_host_avx2");
        }
        if avx512 {
            println!("cargo::rustc-cfg=infer_host_avx512");
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = native;
}
