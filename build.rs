//! Build script: tells the tests which SIMD levels the machine that builds them has, so a kernel
//! test for a level this CPU lacks is compiled as `#[ignore]` with the reason (visible in `cargo
//! test`'s output as "ignored") instead of returning early and counting as passed. It sets
//! `infer_host_avx2` (AVX2 + FMA + F16C) and `infer_host_avx512` (those plus AVX-512 F, BW, VL and
//! VNNI), the same tests as `kernels::cpu::simd`'s runtime detection, and only when the target is
//! the machine building (a cross build marks them all ignored). Nothing here affects the library's
//! choices: the binary still chooses its kernels at run time.
//!
//! It also sets `INFER_LAYOUT_HASH`, a checksum of the sources that decide the bytes of the
//! repacked weight layouts (`src/kernels/cpu/layouts/`, the backend that picks them, ggml's block
//! helpers), which keys the pack files of `kernels::cpu::layouts::pack_file`: a build that changes
//! a layout never reads a pack file an older build wrote.

/// The sources whose contents decide the repacked layouts' bytes.
const LAYOUT_SOURCES: [&str; 4] = [
    "src/kernels/cpu/layouts",
    "src/kernels/cpu/backend.rs",
    "src/kernels/cpu/simd/mod.rs",
    "src/quant/blocks.rs",
];

fn files(path: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    if path.is_dir() {
        for e in std::fs::read_dir(path).into_iter().flatten().flatten() {
            files(&e.path(), out);
        }
    } else {
        out.push(path.to_path_buf());
    }
}

fn layout_hash() {
    let mut all = Vec::new();
    for src in LAYOUT_SOURCES {
        println!("cargo::rerun-if-changed={src}");
        files(std::path::Path::new(src), &mut all);
    }
    all.sort();
    // FNV-1a over each path and its contents.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in all {
        let bytes = std::fs::read(&p).unwrap_or_default();
        for b in p.to_string_lossy().bytes().chain(bytes) {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    println!("cargo::rustc-env=INFER_LAYOUT_HASH={h:016x}");
}

fn main() {
    layout_hash();
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
