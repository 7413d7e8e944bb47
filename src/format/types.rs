//! `GgmlType`: the tensor element types a GGUF file can name, with ggml's numeric ids, names and block
//! geometry (elements per block, bytes per block).
//!
//! Invariants: every id, name, block size and type size matches gguf-py's `GGMLQuantizationType` and
//! `GGML_QUANT_SIZES`; ids ggml has retired (4, 5: Q4_2/Q4_3; 31–33: the Q4_0_4_4 family; 36–38: the
//! IQ4_NL_4_4 family) and ids this enum does not know map to `None` in [`GgmlType::from_id`], so callers
//! report them as unknown instead of guessing a layout. This module knows only sizes, never block
//! contents — decoding lives in `quant`.

/// A ggml tensor element type. The discriminants are ggml's type ids as stored in GGUF tensor infos.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    IQ2XXS = 16,
    IQ2XS = 17,
    IQ3XXS = 18,
    IQ1S = 19,
    IQ4NL = 20,
    IQ3S = 21,
    IQ2S = 22,
    IQ4XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
}

impl GgmlType {
    /// Every type, in id order.
    pub const ALL: [GgmlType; 32] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::IQ2XXS,
        GgmlType::IQ2XS,
        GgmlType::IQ3XXS,
        GgmlType::IQ1S,
        GgmlType::IQ4NL,
        GgmlType::IQ3S,
        GgmlType::IQ2S,
        GgmlType::IQ4XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
    ];

    /// The type with ggml id `id`, or `None` for ids that are retired or unknown here.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// ggml's numeric id (the value stored in a GGUF tensor info).
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The name ggml and gguf-py use: `"F32"`, `"Q4_K"`, `"IQ2_XXS"`, `"TQ1_0"`, ...
    pub fn name(self) -> &'static str {
        self.geometry().0
    }

    /// Parses a type name case-insensitively: the ggml spelling (`"q4_k"`, `"IQ4_NL"`) or the same
    /// without underscores (`"q4k"`, the Rust variant name). Returns `None` for anything else.
    pub fn from_name(s: &str) -> Option<GgmlType> {
        let squash = |x: &str| -> String {
            x.chars()
                .filter(|c| *c != '_')
                .map(|c| c.to_ascii_uppercase())
                .collect()
        };
        if let Some(t) = Self::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(s))
        {
            return Some(t);
        }
        let wanted = squash(s);
        Self::ALL
            .iter()
            .copied()
            .find(|t| squash(t.name()) == wanted)
    }

    /// Elements per block: 1 for the plain types (F32, F16, BF16, I8..I64, F64), 32 for the legacy
    /// quants, IQ4_NL and MXFP4, 256 for the k-quants and most i-quants.
    pub fn block_size(self) -> usize {
        self.geometry().1
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.geometry().2
    }

    /// Bytes needed for `n` elements, or `None` when `n` is not a whole number of blocks or the size
    /// overflows `usize`.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return None;
        }
        (n / bs).checked_mul(self.type_size())
    }

    /// (name, block size, type size) — the one table every accessor reads.
    fn geometry(self) -> (&'static str, usize, usize) {
        use GgmlType::*;
        match self {
            F32 => ("F32", 1, 4),
            F16 => ("F16", 1, 2),
            Q4_0 => ("Q4_0", 32, 18),
            Q4_1 => ("Q4_1", 32, 20),
            Q5_0 => ("Q5_0", 32, 22),
            Q5_1 => ("Q5_1", 32, 24),
            Q8_0 => ("Q8_0", 32, 34),
            Q8_1 => ("Q8_1", 32, 40),
            Q2K => ("Q2_K", 256, 84),
            Q3K => ("Q3_K", 256, 110),
            Q4K => ("Q4_K", 256, 144),
            Q5K => ("Q5_K", 256, 176),
            Q6K => ("Q6_K", 256, 210),
            Q8K => ("Q8_K", 256, 292),
            IQ2XXS => ("IQ2_XXS", 256, 66),
            IQ2XS => ("IQ2_XS", 256, 74),
            IQ3XXS => ("IQ3_XXS", 256, 98),
            IQ1S => ("IQ1_S", 256, 50),
            IQ4NL => ("IQ4_NL", 32, 18),
            IQ3S => ("IQ3_S", 256, 110),
            IQ2S => ("IQ2_S", 256, 82),
            IQ4XS => ("IQ4_XS", 256, 136),
            I8 => ("I8", 1, 1),
            I16 => ("I16", 1, 2),
            I32 => ("I32", 1, 4),
            I64 => ("I64", 1, 8),
            F64 => ("F64", 1, 8),
            IQ1M => ("IQ1_M", 256, 56),
            BF16 => ("BF16", 1, 2),
            TQ1_0 => ("TQ1_0", 256, 54),
            TQ2_0 => ("TQ2_0", 256, 66),
            MXFP4 => ("MXFP4", 32, 17),
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::GgmlType;

    /// The table from gguf-py (`GGMLQuantizationType`, `GGML_QUANT_SIZES`), copied verbatim:
    /// (name, id, block size, type size).
    const GGUF_PY: [(&str, u32, usize, usize); 32] = [
        ("F32", 0, 1, 4),
        ("F16", 1, 1, 2),
        ("Q4_0", 2, 32, 18),
        ("Q4_1", 3, 32, 20),
        ("Q5_0", 6, 32, 22),
        ("Q5_1", 7, 32, 24),
        ("Q8_0", 8, 32, 34),
        ("Q8_1", 9, 32, 40),
        ("Q2_K", 10, 256, 84),
        ("Q3_K", 11, 256, 110),
        ("Q4_K", 12, 256, 144),
        ("Q5_K", 13, 256, 176),
        ("Q6_K", 14, 256, 210),
        ("Q8_K", 15, 256, 292),
        ("IQ2_XXS", 16, 256, 66),
        ("IQ2_XS", 17, 256, 74),
        ("IQ3_XXS", 18, 256, 98),
        ("IQ1_S", 19, 256, 50),
        ("IQ4_NL", 20, 32, 18),
        ("IQ3_S", 21, 256, 110),
        ("IQ2_S", 22, 256, 82),
        ("IQ4_XS", 23, 256, 136),
        ("I8", 24, 1, 1),
        ("I16", 25, 1, 2),
        ("I32", 26, 1, 4),
        ("I64", 27, 1, 8),
        ("F64", 28, 1, 8),
        ("IQ1_M", 29, 256, 56),
        ("BF16", 30, 1, 2),
        ("TQ1_0", 34, 256, 54),
        ("TQ2_0", 35, 256, 66),
        ("MXFP4", 39, 32, 17),
    ];

    #[test]
    fn table_matches_gguf_py() {
        for (i, &(name, id, bs, ts)) in GGUF_PY.iter().enumerate() {
            let t = GgmlType::from_id(id).unwrap_or_else(|| panic!("id {id} ({name}) unknown"));
            assert_eq!(t, GgmlType::ALL[i]);
            assert_eq!(t.id(), id);
            assert_eq!(t.name(), name);
            assert_eq!(t.block_size(), bs, "{name}");
            assert_eq!(t.type_size(), ts, "{name}");
            assert_eq!(GgmlType::from_name(name), Some(t));
            assert_eq!(GgmlType::from_name(&name.to_lowercase()), Some(t));
        }
    }

    #[test]
    fn retired_and_unknown_ids_are_none() {
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 40, 41, 1000, u32::MAX] {
            assert_eq!(GgmlType::from_id(id), None, "id {id}");
        }
    }

    #[test]
    fn names_parse_case_insensitively() {
        assert_eq!(GgmlType::from_name("q4_k"), Some(GgmlType::Q4K));
        assert_eq!(GgmlType::from_name("Q4K"), Some(GgmlType::Q4K));
        assert_eq!(GgmlType::from_name("iq2_xxs"), Some(GgmlType::IQ2XXS));
        assert_eq!(GgmlType::from_name("bf16"), Some(GgmlType::BF16));
        assert_eq!(GgmlType::from_name("tq1_0"), Some(GgmlType::TQ1_0));
        assert_eq!(GgmlType::from_name("q4_2"), None);
        assert_eq!(GgmlType::from_name(""), None);
        assert_eq!(GgmlType::Q6K.to_string(), "Q6_K");
    }

    #[test]
    fn row_bytes_checks_blocks_and_overflow() {
        assert_eq!(GgmlType::F32.row_bytes(1536), Some(6144));
        assert_eq!(GgmlType::Q4K.row_bytes(1536), Some(6 * 144));
        assert_eq!(GgmlType::Q6K.row_bytes(1536), Some(6 * 210));
        assert_eq!(GgmlType::Q8_0.row_bytes(640), Some(20 * 34));
        assert_eq!(GgmlType::Q8_0.row_bytes(0), Some(0));
        assert_eq!(GgmlType::Q4K.row_bytes(100), None);
        assert_eq!(GgmlType::Q4_0.row_bytes(33), None);
        assert_eq!(GgmlType::F64.row_bytes(usize::MAX), None);
        assert_eq!(GgmlType::I8.row_bytes(usize::MAX), Some(usize::MAX));
    }
}
