//! GGUF container format: reading (zero-copy over mmap) and writing. No math lives here.
//!
//! `types` names the ggml tensor types and their block geometry; `gguf` parses and validates a file
//! so that every tensor's bytes can be borrowed without further checks; `writer` produces files the
//! reader (and ggml / gguf-py) accept; `checksum` is the stable hash files are fingerprinted
//! with. Only little-endian GGUF v2 and v3 are supported.

pub mod checksum;
pub mod gguf;
pub mod types;
pub mod writer;

pub use checksum::checksum;
pub use gguf::{Gguf, GgufError, TensorInfo, Value};
pub use types::GgmlType;
pub use writer::GgufWriter;
