//! The `--type` a user asks for: one plain tensor type for every quantizable tensor, or one of
//! llama.cpp's k-quant mixes (`q3_k_m`, `q4_k_m`, `q5_k_m`) whose per-tensor choices live in
//! [`super::policy`].
//!
//! Invariants: every [`Target`] names a type `quant::quantize_row` can produce (a plain target is
//! any registered weight type), and [`Target::file_type`] is the `general.file_type`
//! (`llama_ftype`) llama.cpp writes for it: the mix's, or the plain type's own
//! (`quant::QuantType::FILE_TYPE`; a plain k-quant is recorded as the "small" member of its
//! family, `q4_k` → `MOSTLY_Q4_K_S`, since llama.cpp has no "pure Q4_K" file type).

use std::fmt;

use anyhow::{bail, Result};

use crate::format::GgmlType;

/// A llama.cpp k-quant mix: a default type, with some tensors given more bits (see
/// [`super::policy`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mix {
    Q3KM,
    Q4KM,
    Q5KM,
}

/// What `--type` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Every tensor that may be quantized gets this type (falling back where its rows do not
    /// split into whole blocks); the others keep theirs.
    Plain(GgmlType),
    /// llama.cpp's per-tensor policy for this mix.
    Mix(Mix),
}

/// The plain types `--type` accepts, in the order help text lists them: every weight type
/// `quant` registers.
pub fn plain_types() -> impl Iterator<Item = GgmlType> {
    crate::quant::types::TYPES.iter().map(|o| o.ty)
}

/// Every name `--type` accepts, lower case, for messages.
pub fn supported_names() -> String {
    let mut names: Vec<String> = plain_types()
        .map(|t| t.name().to_ascii_lowercase())
        .collect();
    names.extend(["q3_k_m", "q4_k_m", "q5_k_m"].map(String::from));
    names.join(", ")
}

impl Target {
    /// Parses a `--type` value, case-insensitively (`q4_k_m`, `Q8_0`, `bf16`, ...).
    pub fn parse(s: &str) -> Result<Target> {
        let lower = s.trim().to_ascii_lowercase();
        let mix = match lower.as_str() {
            "q3_k_m" => Some(Mix::Q3KM),
            "q4_k_m" => Some(Mix::Q4KM),
            "q5_k_m" => Some(Mix::Q5KM),
            _ => None,
        };
        if let Some(m) = mix {
            return Ok(Target::Mix(m));
        }
        match GgmlType::from_name(&lower) {
            Some(t) if plain_types().any(|p| p == t) => Ok(Target::Plain(t)),
            _ => bail!(
                "unsupported quantization type '{s}' (supported: {})",
                supported_names()
            ),
        }
    }

    /// The type tensors get unless the mix policy or a fallback says otherwise
    /// (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        match self {
            Target::Plain(t) => t,
            Target::Mix(Mix::Q3KM) => GgmlType::Q3K,
            Target::Mix(Mix::Q4KM) => GgmlType::Q4K,
            Target::Mix(Mix::Q5KM) => GgmlType::Q5K,
        }
    }

    /// `general.file_type`: llama.cpp's `llama_ftype` value.
    pub fn file_type(self) -> u32 {
        match self {
            Target::Mix(Mix::Q3KM) => 12,
            Target::Mix(Mix::Q4KM) => 15,
            Target::Mix(Mix::Q5KM) => 17,
            Target::Plain(t) => {
                crate::quant::ops(t)
                    .expect("`parse` accepts only registered types")
                    .file_type
            }
        }
    }

    /// True for the types whose blocks hold more than one value (everything but F32/F16/BF16).
    pub fn is_quantized(self) -> bool {
        self.default_type().block_size() > 1
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Plain(t) => f.write_str(&t.name().to_ascii_lowercase()),
            Target::Mix(Mix::Q3KM) => f.write_str("q3_k_m"),
            Target::Mix(Mix::Q4KM) => f.write_str("q4_k_m"),
            Target::Mix(Mix::Q5KM) => f.write_str("q5_k_m"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_supported_name() {
        for t in plain_types() {
            let name = t.name().to_ascii_lowercase();
            assert_eq!(Target::parse(&name).unwrap(), Target::Plain(t));
            assert_eq!(Target::parse(&name).unwrap().to_string(), name);
        }
        assert_eq!(Target::parse("Q4_K_M").unwrap(), Target::Mix(Mix::Q4KM));
        assert_eq!(
            Target::parse("q5_k_m").unwrap().default_type(),
            GgmlType::Q5K
        );
        let e = Target::parse("iq2_xxs").unwrap_err().to_string();
        assert!(e.contains("iq2_xxs") && e.contains("q4_k_m"), "{e}");
    }

    #[test]
    fn file_types_match_gguf_py() {
        // gguf-py LlamaFileType values.
        let cases = [
            ("f32", 0),
            ("f16", 1),
            ("q4_0", 2),
            ("q4_1", 3),
            ("q8_0", 7),
            ("q5_0", 8),
            ("q5_1", 9),
            ("q2_k", 10),
            ("q3_k", 11),
            ("q3_k_m", 12),
            ("q4_k", 14),
            ("q4_k_m", 15),
            ("q5_k", 16),
            ("q5_k_m", 17),
            ("q6_k", 18),
            ("bf16", 32),
            ("iq4_nl", 25),
        ];
        for (name, ft) in cases {
            assert_eq!(Target::parse(name).unwrap().file_type(), ft, "{name}");
        }
    }
}
