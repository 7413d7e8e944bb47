//! The kernels, compiled ahead of time by `scripts/build-cuda-kernels.py` (NVRTC 12.4 from the PyPI
//! wheels) and embedded here, so a GPU machine needs neither a toolkit nor network: cubins for
//! sm_80, sm_86, sm_89 and sm_90, and the PTX of the newest (the driver JIT-compiles it for a newer
//! GPU; an older one always has a cubin of its major version, so older PTX would never load). CI
//! regenerates `cuda/build/` and fails if it differs from what is committed.

/// (compute capability as major * 10 + minor, cubin, PTX) per shipped architecture, ascending; PTX
/// for the newest only.
pub const IMAGES: [(u32, &[u8], Option<&str>); 4] = [
    (
        80,
        include_bytes!("../../../cuda/build/kernels.sm_80.cubin"),
        None,
    ),
    (
        86,
        include_bytes!("../../../cuda/build/kernels.sm_86.cubin"),
        None,
    ),
    (
        89,
        include_bytes!("../../../cuda/build/kernels.sm_89.cubin"),
        None,
    ),
    (
        90,
        include_bytes!("../../../cuda/build/kernels.sm_90.cubin"),
        Some(include_str!("../../../cuda/build/kernels.sm_90.ptx")),
    ),
];

/// What to load on a GPU of compute capability `major.minor`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Image {
    /// A cubin built for `arch` (same major version, minor not above the device's).
    Cubin { arch: u32, bytes: &'static [u8] },
    /// PTX for `arch`, JIT-compiled by the driver (a GPU newer than every cubin).
    Ptx { arch: u32, text: &'static str },
}

/// The best image for the device, or None for GPUs older than sm_80.
pub fn select(major: u32, minor: u32) -> Option<Image> {
    let cc = major * 10 + minor;
    let cubin = IMAGES
        .iter()
        .rev()
        .find(|(arch, _, _)| arch / 10 == major && *arch <= cc);
    if let Some(&(arch, bytes, _)) = cubin {
        return Some(Image::Cubin { arch, bytes });
    }
    IMAGES
        .iter()
        .rev()
        .filter(|(arch, _, _)| *arch <= cc)
        .find_map(|&(arch, _, text)| Some(Image::Ptx { arch, text: text? }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selects_cubin_of_same_major_else_ptx() {
        let arch = |i: Option<Image>| match i {
            Some(Image::Cubin { arch, .. }) => format!("cubin{arch}"),
            Some(Image::Ptx { arch, .. }) => format!("ptx{arch}"),
            None => "none".into(),
        };
        assert_eq!(arch(select(8, 0)), "cubin80");
        assert_eq!(arch(select(8, 7)), "cubin86"); // Jetson Orin: sm_87 runs sm_86 code
        assert_eq!(arch(select(8, 9)), "cubin89");
        assert_eq!(arch(select(9, 0)), "cubin90");
        assert_eq!(arch(select(12, 0)), "ptx90");
        assert_eq!(arch(select(7, 5)), "none");
    }

    #[test]
    fn images_are_the_kernels() {
        for (arch, cubin, ptx) in IMAGES {
            assert_eq!(&cubin[..4], b"\x7fELF", "sm_{arch} cubin");
            if let Some(ptx) = ptx {
                assert!(ptx.contains(&format!(".target sm_{arch}")), "sm_{arch} ptx");
                assert!(ptx.contains(".entry gemv_q4_k("), "sm_{arch} ptx");
            }
        }
        assert!(
            IMAGES[3].2.is_some(),
            "the newest architecture's PTX is shipped"
        );
    }
}
