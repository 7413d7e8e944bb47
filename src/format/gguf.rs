//! The GGUF reader: parses the header, metadata and tensor infos of a GGUF v2/v3 file and hands out
//! tensor bytes zero-copy from a read-only memory map (or an owned buffer, for tests).
//!
//! Invariants once [`Gguf::open`] / [`Gguf::from_bytes`] returns `Ok`:
//! * the file is little-endian GGUF version 2 or 3; metadata keys and tensor names are unique, valid
//!   UTF-8 strings; `alignment` is a non-zero power of two (`general.alignment`, default 32);
//! * every tensor has 1..=4 dimensions, each ≥ 1, a known [`GgmlType`], a row length (`dims[0]`)
//!   that is a whole number of blocks, an element count and byte size that fit `u64`/`usize`, an
//!   offset that is a multiple of `alignment`, and data that lies entirely inside the file — so
//!   [`Gguf::tensor_data`] is a plain slice that cannot fail for a `TensorInfo` of this file.
//!
//! Untrusted input never panics and never drives an allocation larger than the bytes that back it:
//! every count is checked against the bytes remaining (and a hard cap) before anything is reserved,
//! and all offset arithmetic is checked. Every error names the byte offset of the offending field
//! and, where one applies, the limit it broke. Metadata values are copied out (typed arrays in the
//! file are unaligned, so nothing is ever cast in place); tensor data is never copied.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::types::GgmlType;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor offset when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// Most tensors a file may declare.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata key/value pairs a file may declare.
pub const MAX_KV: u64 = 1 << 20;
/// Longest string (key, name or value) in bytes.
pub const MAX_STRING_LEN: u64 = 1 << 30;
/// Most elements in one metadata array (the largest real vocabularies are ~10⁶ entries). Besides
/// this cap, an array may not declare more elements than the bytes remaining could hold.
pub const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Deepest nesting of metadata arrays (an array of scalars has depth 1).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;

/// GGUF metadata value type numbers.
pub mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Smallest encoded size of one value of GGUF type `type_id`, or `None` for an unknown type.
fn min_encoded_size(type_id: u32) -> Option<usize> {
    use value_type::*;
    Some(match type_id {
        U8 | I8 | BOOL => 1,
        U16 | I16 => 2,
        U32 | I32 | F32 => 4,
        U64 | I64 | F64 => 8,
        STRING => 8,    // u64 length, possibly no bytes
        ARRAY => 4 + 8, // element type + count, possibly no elements
        _ => return None,
    })
}

/// Human name of a GGUF value type, for error messages.
fn value_type_name(type_id: u32) -> &'static str {
    use value_type::*;
    match type_id {
        U8 => "u8",
        I8 => "i8",
        U16 => "u16",
        I16 => "i16",
        U32 => "u32",
        I32 => "i32",
        F32 => "f32",
        BOOL => "bool",
        STRING => "string",
        ARRAY => "array",
        U64 => "u64",
        I64 => "i64",
        F64 => "f64",
        _ => "unknown",
    }
}

/// A metadata value, copied out of the file. Each variant is exactly one GGUF value type, so a
/// value read from a file is written back with the same type (see [`Value::type_id`]). A bool byte
/// other than 0 reads as `true`. An empty array does not remember its element type.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// Any integer type holding a non-negative value.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer type whose value fits `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => i64::try_from(v).ok(),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Any numeric type, converted to `f32` (rounding where `f32` cannot hold it exactly).
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v as f32),
            Value::U64(v) => Some(v as f32),
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v as f32),
            Value::I64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF value type number (see [`value_type`]).
    pub fn type_id(&self) -> u32 {
        use value_type::*;
        match self {
            Value::U8(_) => U8,
            Value::I8(_) => I8,
            Value::U16(_) => U16,
            Value::I16(_) => I16,
            Value::U32(_) => U32,
            Value::I32(_) => I32,
            Value::F32(_) => F32,
            Value::Bool(_) => BOOL,
            Value::String(_) => STRING,
            Value::Array(_) => ARRAY,
            Value::U64(_) => U64,
            Value::I64(_) => I64,
            Value::F64(_) => F64,
        }
    }
}

/// One tensor's description. `dims` are in ggml order: `dims[0]` is the contiguous row length.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the data section (as stored in the file).
    pub offset: u64,
    /// Exact number of data bytes: `ty.row_bytes(row_len) * n_rows`.
    pub size_bytes: usize,
}

impl TensorInfo {
    /// Product of all dimensions.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// `dims[0]`, the number of elements in one contiguous row.
    pub fn row_len(&self) -> usize {
        self.dims.first().map_or(0, |&d| d as usize)
    }

    /// Product of `dims[1..]` (1 for a vector).
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }
}

/// Why a GGUF file could not be read (or, for [`GgufError::InvalidTensor`], why the writer refused a
/// tensor). Every parse error names the byte offset of the field at fault.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read GGUF file {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "truncated GGUF file: {what} at byte offset {offset} needs {needed} bytes but only {remaining} remain"
    )]
    Truncated {
        offset: u64,
        what: &'static str,
        needed: u64,
        remaining: u64,
    },
    #[error(
        "not a GGUF file: bytes at offset 0 are {found:02x?}, expected \"GGUF\" (47 47 55 46)"
    )]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {version} at byte offset 4 (supported: 2 and 3){}", version_hint(*.version))]
    UnsupportedVersion { version: u32 },
    #[error("{what} {count} at byte offset {offset} exceeds the limit of {limit}")]
    TooMany {
        offset: u64,
        what: &'static str,
        count: u64,
        limit: u64,
    },
    #[error(
        "{what} at byte offset {offset} has length {len}, exceeding the limit of {limit} bytes \
         (the smaller of the {remaining} bytes remaining and the maximum of {MAX_STRING_LEN})"
    )]
    StringTooLong {
        offset: u64,
        what: &'static str,
        len: u64,
        remaining: u64,
        limit: u64,
    },
    #[error("{what} at byte offset {offset} is not valid UTF-8")]
    InvalidUtf8 { offset: u64, what: &'static str },
    #[error("unknown GGUF value type {type_id} at byte offset {offset} (valid types are 0..=12)")]
    BadValueType { offset: u64, type_id: u32 },
    #[error(
        "array length {count} at byte offset {offset} exceeds the limit of {limit} {} elements \
         (bytes remaining / minimum element size, capped at {MAX_ARRAY_LEN})",
        value_type_name(*.elem_type)
    )]
    ArrayTooLong {
        offset: u64,
        elem_type: u32,
        count: u64,
        limit: u64,
    },
    #[error("array nesting depth {depth} at byte offset {offset} exceeds the limit of {limit}")]
    TooDeep {
        offset: u64,
        depth: usize,
        limit: usize,
    },
    #[error("duplicate metadata key {key:?} at byte offset {offset}")]
    DuplicateKey { offset: u64, key: String },
    #[error(
        "general.alignment at byte offset {offset} is {value}; it must be a non-zero power of two \
         no larger than {}",
        u32::MAX
    )]
    BadAlignment { offset: u64, value: String },
    #[error("tensor {tensor:?}: n_dims {n_dims} at byte offset {offset} is outside 1..={limit}")]
    BadDimCount {
        offset: u64,
        tensor: String,
        n_dims: u32,
        limit: u32,
    },
    #[error(
        "tensor {tensor:?}: dimension {index} at byte offset {offset} is {dim}; every dimension must be at least 1"
    )]
    BadDim {
        offset: u64,
        tensor: String,
        index: usize,
        dim: u64,
    },
    #[error(
        "tensor {tensor:?}: dims {dims:?} at byte offset {offset} give an element count or byte size \
         that overflows the limit of {}", u64::MAX
    )]
    TooLarge {
        offset: u64,
        tensor: String,
        dims: Vec<u64>,
    },
    #[error("tensor {tensor:?}: unknown ggml type id {id} at byte offset {offset}")]
    UnknownType {
        offset: u64,
        tensor: String,
        id: u32,
    },
    #[error(
        "tensor {tensor:?}: row length {row_len} (dims[0] at byte offset {offset}) is not a multiple \
         of the {ty} block size {block_size}"
    )]
    PartialBlock {
        offset: u64,
        tensor: String,
        ty: GgmlType,
        row_len: u64,
        block_size: usize,
    },
    #[error("duplicate tensor name {name:?} at byte offset {offset}")]
    DuplicateTensor { offset: u64, name: String },
    #[error(
        "tensor {tensor:?}: data offset {tensor_offset} at byte offset {offset} is not a multiple of \
         the alignment {alignment}"
    )]
    MisalignedTensor {
        offset: u64,
        tensor: String,
        tensor_offset: u64,
        alignment: usize,
    },
    #[error(
        "tensor {tensor:?}: data offset {tensor_offset} (at byte offset {offset}) + {size} bytes runs \
         past the end of the data section, which holds {data_len} bytes (file bytes {data_start}..{file_size})"
    )]
    TensorOutOfBounds {
        offset: u64,
        tensor: String,
        tensor_offset: u64,
        size: u64,
        data_start: u64,
        data_len: u64,
        file_size: u64,
    },
    #[error("cannot add tensor {name:?} to the GGUF writer: {reason}")]
    InvalidTensor { name: String, reason: String },
}

fn version_hint(version: u32) -> &'static str {
    if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
        "; this looks like a big-endian file, which is not supported"
    } else if version == 1 {
        "; GGUF v1 is obsolete, reconvert the model"
    } else {
        ""
    }
}

/// The bytes behind a [`Gguf`]: a read-only map of the file, or an owned buffer.
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// An open GGUF file: header, metadata and tensor infos parsed and validated, tensor data in place.
pub struct Gguf {
    pub version: u32,
    pub alignment: usize,
    pub tensors: Vec<TensorInfo>,
    /// Every pair, with an empty array in place of each lazy one (see [`LAZY_STRINGS`]).
    metadata: Vec<(String, Value)>,
    /// Metadata index → (offset of the first element, count, element type) of the lazy arrays.
    lazy: HashMap<usize, (usize, usize, u32)>,
    /// `metadata` with the lazy arrays read, made on first need ([`Gguf::metadata`]).
    full: OnceLock<Vec<(String, Value)>>,
    metadata_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
    bytes: Bytes,
    data_start: usize,
}

/// Top-level arrays of at least this many strings or numbers (a vocabulary's tokens, merges,
/// scores and token types: 151 936 tokens and 151 387 merges for Qwen2.5, 262 144 tokens for
/// Gemma-3) are checked at open but not copied: a `Value` each (and a `String` each for text) was
/// a third of the time to open such a file and build its tokenizer. [`Gguf::strings`] and
/// [`Gguf::values`] read them in place; [`Gguf::get`] and [`Gguf::metadata`] make the values on
/// first use.
pub const LAZY_ARRAY: usize = 1024;

/// The strings of an array-of-strings value, borrowed from the file (see [`Gguf::strings`]).
#[derive(Clone, Copy)]
pub enum Strings<'a> {
    /// `count` length-prefixed strings from `bytes[at..]`, checked at open.
    InPlace {
        bytes: &'a [u8],
        at: usize,
        count: usize,
    },
    Values(&'a [Value]),
}

impl<'a> Strings<'a> {
    pub fn len(&self) -> usize {
        match self {
            Strings::InPlace { count, .. } => *count,
            Strings::Values(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The strings in order; `None` for an element that is not a string.
    pub fn iter(self) -> impl Iterator<Item = Option<&'a str>> {
        let (bytes, mut at, count, values) = match self {
            Strings::InPlace { bytes, at, count } => (bytes, at, count, &[][..]),
            Strings::Values(v) => (&[][..], 0, 0, v),
        };
        let in_place = (0..count).map(move |_| {
            let len = bytes
                .get(at..at + 8)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_le_bytes) as usize;
            let s = bytes.get(at + 8..at + 8 + len).unwrap_or_default();
            at += 8 + len;
            // Checked at open: valid UTF-8 inside the file.
            Some(std::str::from_utf8(s).unwrap_or_default())
        });
        in_place.chain(values.iter().map(Value::as_str))
    }
}

impl fmt::Debug for Gguf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("architecture", &self.architecture())
            .field("n_metadata", &self.metadata.len())
            .field("lazy_arrays", &self.lazy.len())
            .field("n_tensors", &self.tensors.len())
            .field("data_start", &self.data_start)
            .field("file_size", &self.file_size())
            .finish()
    }
}

impl Gguf {
    /// Maps `path` read-only and parses it. Tensor data is not copied or read until used.
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let len = file.metadata().map_err(io_err)?.len();
        if len == 0 {
            // Nothing to map; parsing reports the truncation.
            return Self::parse(Bytes::Owned(Vec::new()));
        }
        // SAFETY: the map is read-only and private to this `Gguf`; the file must not be truncated or
        // rewritten while it is open (as for every mmap-based GGUF reader) — `GgufWriter::write_file`
        // replaces files by rename, which leaves existing maps intact.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
        Self::parse(Bytes::Mapped(map))
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        Self::parse(Bytes::Owned(bytes))
    }

    fn parse(bytes: Bytes) -> Result<Gguf, GgufError> {
        let h = parse_header(bytes.as_slice())?;
        Ok(Gguf {
            version: h.version,
            alignment: h.alignment,
            tensors: h.tensors,
            metadata: h.metadata,
            lazy: h.lazy,
            full: OnceLock::new(),
            metadata_index: h.metadata_index,
            tensor_index: h.tensor_index,
            bytes,
            data_start: h.data_start,
        })
    }

    /// All metadata pairs, in file order (the first call reads the lazy string arrays).
    pub fn metadata(&self) -> &[(String, Value)] {
        if self.lazy.is_empty() {
            return &self.metadata;
        }
        self.full.get_or_init(|| {
            let mut all = self.metadata.clone();
            for &i in self.lazy.keys() {
                all[i].1 = Value::Array(self.lazy_values(i).collect());
            }
            all
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        let &i = self.metadata_index.get(key)?;
        if self.lazy.contains_key(&i) {
            return self.metadata().get(i).map(|(_, v)| v);
        }
        self.metadata.get(i).map(|(_, v)| v)
    }

    /// Whether the metadata has `key`.
    pub fn contains_key(&self, key: &str) -> bool {
        self.metadata_index.contains_key(key)
    }

    /// The strings of `key` without copying them: `None` when it is absent or not an array;
    /// elements that are not strings iterate as `None`.
    pub fn strings(&self, key: &str) -> Option<Strings<'_>> {
        let &i = self.metadata_index.get(key)?;
        match self.lazy.get(&i) {
            Some(&(at, count, value_type::STRING)) => {
                let bytes = self.bytes.as_slice();
                Some(Strings::InPlace { bytes, at, count })
            }
            Some(_) => None,
            None => self.metadata.get(i)?.1.as_array().map(Strings::Values),
        }
    }

    /// The elements of array `key`, read from the file one by one where it was left in place:
    /// `None` when it is absent or not an array.
    pub fn values(&self, key: &str) -> Option<Box<dyn Iterator<Item = Value> + '_>> {
        let &i = self.metadata_index.get(key)?;
        if self.lazy.contains_key(&i) {
            return Some(Box::new(self.lazy_values(i)));
        }
        let a = self.metadata.get(i)?.1.as_array()?;
        Some(Box::new(a.iter().cloned()))
    }

    /// The elements of lazy array `i` (checked at open, so reading them cannot fail).
    fn lazy_values(&self, i: usize) -> impl Iterator<Item = Value> + '_ {
        let (at, count, elem) = self.lazy[&i];
        let mut r = Reader {
            buf: self.bytes.as_slice(),
            pos: at,
        };
        (0..count).map(move |_| r.value(elem, 0, 1).unwrap_or(Value::U8(0)))
    }

    /// The value of `key` if it is a non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    /// The value of `key` if it is numeric, converted to `f32`.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }

    /// `general.architecture`, e.g. `"qwen2"`, `"gemma3"`.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        let &i = self.tensor_index.get(name)?;
        self.tensors.get(i).filter(|t| t.name == name)
    }

    /// Tells the kernel this process does not need the mapped pages that lie wholly inside `part`
    /// (a slice of this file's bytes) for now, so they leave its resident set; reading them again
    /// maps them back from the page cache or the file. For tensor data a caller has copied. A
    /// no-op for files held in memory, or if the kernel refuses.
    pub fn release(&self, part: &[u8]) {
        let Bytes::Mapped(map) = &self.bytes else {
            return;
        };
        let base = map.as_ptr() as usize;
        let Some(start) = (part.as_ptr() as usize).checked_sub(base) else {
            return;
        };
        let end = start + part.len();
        if end > map.len() {
            return;
        }
        const PAGE: usize = 4096;
        let (lo, hi) = (start.div_ceil(PAGE) * PAGE, end / PAGE * PAGE);
        if lo < hi {
            // SAFETY: `MADV_DONTNEED` on a read-only private file mapping only drops this
            // process's page mappings: the map is never written, so there are no private copies to
            // lose, and a later read maps the same file bytes back (the file must not change while
            // open, as `open` requires), so no live reference sees different contents.
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, lo, hi - lo)
            };
        }
    }

    /// The `size_bytes` bytes of `t`'s data, borrowed from the map.
    ///
    /// # Panics
    /// If `t` does not lie inside this file's data section — impossible for a `TensorInfo` taken
    /// from this `Gguf`, whose bounds were checked at open time.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let data = &self.bytes.as_slice()[self.data_start.min(self.file_size())..];
        usize::try_from(t.offset)
            .ok()
            .and_then(|start| data.get(start..start.checked_add(t.size_bytes)?))
            .unwrap_or_else(|| {
                panic!(
                    "tensor {:?} (offset {}, {} bytes) is not inside this GGUF data section of {} bytes",
                    t.name,
                    t.offset,
                    t.size_bytes,
                    data.len()
                )
            })
    }

    /// Byte offset in the file where the data section starts (tensor offsets are relative to it).
    /// May equal or exceed `file_size()` for a file without tensors.
    pub fn data_offset(&self) -> usize {
        self.data_start
    }

    /// Length of the whole file in bytes.
    pub fn file_size(&self) -> usize {
        self.bytes.as_slice().len()
    }

    /// What identifies this file cheaply (no full read): a checksum of its size, its header
    /// (metadata and tensor infos) and the first and last 64 KiB of its tensor data. Two model
    /// files with the same fingerprint are taken to be the same model (the prompt cache does).
    pub fn fingerprint(&self) -> u64 {
        const SAMPLE: usize = 64 << 10;
        let bytes = self.bytes.as_slice();
        let data = self.data_start.min(bytes.len());
        let first = &bytes[data..(data + SAMPLE).min(bytes.len())];
        let last = &bytes[bytes.len().saturating_sub(SAMPLE).max(data)..];
        let mut all = Vec::with_capacity(32);
        for h in [
            bytes.len() as u64,
            super::checksum(&bytes[..data]),
            super::checksum(first),
            super::checksum(last),
        ] {
            all.extend_from_slice(&h.to_le_bytes());
        }
        super::checksum(&all)
    }
}

/// Everything parsed from the bytes before the data section.
struct Header {
    version: u32,
    alignment: usize,
    metadata: Vec<(String, Value)>,
    lazy: HashMap<usize, (usize, usize, u32)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: usize,
}

fn parse_header(buf: &[u8]) -> Result<Header, GgufError> {
    let mut r = Reader { buf, pos: 0 };

    let magic: [u8; 4] = r.array("magic")?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = r.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let tensor_count_off = r.offset();
    let tensor_count = r.u64("tensor_count")?;
    if tensor_count > MAX_TENSORS {
        return Err(GgufError::TooMany {
            offset: tensor_count_off,
            what: "tensor_count",
            count: tensor_count,
            limit: MAX_TENSORS,
        });
    }
    let kv_count_off = r.offset();
    let kv_count = r.u64("kv_count")?;
    if kv_count > MAX_KV {
        return Err(GgufError::TooMany {
            offset: kv_count_off,
            what: "kv_count",
            count: kv_count,
            limit: MAX_KV,
        });
    }

    // Smallest key/value: empty key (8) + type (4) + one-byte value. Reserve no more than could fit.
    let mut metadata = Vec::with_capacity(r.capacity_for(kv_count, 8 + 4 + 1));
    let mut metadata_index = HashMap::with_capacity(metadata.capacity());
    let mut lazy = HashMap::new();
    let mut alignment_off = 0;
    for _ in 0..kv_count {
        let key_off = r.offset();
        let key = r.string("metadata key")?;
        let type_off = r.offset();
        let type_id = r.u32("metadata value type")?;
        let value_off = r.offset();
        let value = match r.lazy_array(type_id)? {
            Some(span) => {
                lazy.insert(metadata.len(), span);
                Value::Array(Vec::new())
            }
            None => r.value(type_id, type_off, 0)?,
        };
        if metadata_index.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                offset: key_off,
                key,
            });
        }
        if key == "general.alignment" {
            alignment_off = value_off;
        }
        metadata_index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
    }

    let alignment = match metadata_index.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(&i) => {
            let v = &metadata[i].1;
            match v.as_u64() {
                Some(a) if a.is_power_of_two() && a <= u64::from(u32::MAX) => a as usize,
                _ => {
                    return Err(GgufError::BadAlignment {
                        offset: alignment_off,
                        value: format!("{v:?}"),
                    })
                }
            }
        }
    };

    // Smallest tensor info: empty name (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(r.capacity_for(tensor_count, 32));
    let mut tensor_index = HashMap::with_capacity(tensors.capacity());
    let mut offset_fields = Vec::with_capacity(tensors.capacity());
    for _ in 0..tensor_count {
        let name_off = r.offset();
        let name = r.string("tensor name")?;

        let n_dims_off = r.offset();
        let n_dims = r.u32("tensor n_dims")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::BadDimCount {
                offset: n_dims_off,
                tensor: name,
                n_dims,
                limit: MAX_DIMS,
            });
        }
        let dims_off = r.offset();
        let mut dims = Vec::with_capacity(n_dims as usize);
        for index in 0..n_dims as usize {
            let dim_off = r.offset();
            let dim = r.u64("tensor dimension")?;
            if dim == 0 {
                return Err(GgufError::BadDim {
                    offset: dim_off,
                    tensor: name,
                    index,
                    dim,
                });
            }
            dims.push(dim);
        }
        let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));

        let type_off = r.offset();
        let type_id = r.u32("tensor type")?;
        let Some(ty) = GgmlType::from_id(type_id) else {
            return Err(GgufError::UnknownType {
                offset: type_off,
                tensor: name,
                id: type_id,
            });
        };
        let block_size = ty.block_size();
        if dims[0] % block_size as u64 != 0 {
            return Err(GgufError::PartialBlock {
                offset: dims_off,
                tensor: name,
                ty,
                row_len: dims[0],
                block_size,
            });
        }
        let size_bytes = n_elements
            .and_then(|n| (n / block_size as u64).checked_mul(ty.type_size() as u64))
            .and_then(|s| usize::try_from(s).ok());
        let Some(size_bytes) = size_bytes else {
            return Err(GgufError::TooLarge {
                offset: dims_off,
                tensor: name,
                dims,
            });
        };

        let offset_off = r.offset();
        let offset = r.u64("tensor data offset")?;
        if offset % alignment as u64 != 0 {
            return Err(GgufError::MisalignedTensor {
                offset: offset_off,
                tensor: name,
                tensor_offset: offset,
                alignment,
            });
        }
        if tensor_index.contains_key(&name) {
            return Err(GgufError::DuplicateTensor {
                offset: name_off,
                name,
            });
        }
        tensor_index.insert(name.clone(), tensors.len());
        offset_fields.push(offset_off);
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            size_bytes,
        });
    }

    // The data section starts at the next multiple of the alignment. A file without tensors may end
    // before that point (no trailing padding); then the data section is simply empty.
    let file_size = buf.len() as u64;
    let data_start = r
        .pos
        .checked_next_multiple_of(alignment)
        .unwrap_or(usize::MAX);
    let data_len = file_size.saturating_sub(data_start as u64);
    for (t, &offset_off) in tensors.iter().zip(&offset_fields) {
        let end = t.offset.checked_add(t.size_bytes as u64);
        if end.is_none_or(|end| end > data_len) {
            return Err(GgufError::TensorOutOfBounds {
                offset: offset_off,
                tensor: t.name.clone(),
                tensor_offset: t.offset,
                size: t.size_bytes as u64,
                data_start: data_start as u64,
                data_len,
                file_size,
            });
        }
    }

    Ok(Header {
        version,
        alignment,
        metadata,
        lazy,
        metadata_index,
        tensors,
        tensor_index,
        data_start,
    })
}

/// A bounds-checked little-endian cursor over the file bytes.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// How many items of at least `min_size` bytes each to reserve for a declared `count`: never
    /// more than the remaining bytes could hold.
    fn capacity_for(&self, count: u64, min_size: usize) -> usize {
        count.min((self.remaining() / min_size) as u64) as usize
    }

    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                offset: self.offset(),
                what,
                needed: n as u64,
                remaining: self.remaining() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        self.str(what).map(str::to_owned)
    }

    /// The next string, borrowed.
    fn str(&mut self, what: &'static str) -> Result<&'a str, GgufError> {
        let len_off = self.offset();
        let len = self.u64(what)?;
        let remaining = self.remaining() as u64;
        let limit = remaining.min(MAX_STRING_LEN);
        if len > limit {
            return Err(GgufError::StringTooLong {
                offset: len_off,
                what,
                len,
                remaining,
                limit,
            });
        }
        let bytes_off = self.offset();
        let bytes = self.take(len as usize, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s),
            Err(_) => Err(GgufError::InvalidUtf8 {
                offset: bytes_off,
                what,
            }),
        }
    }

    /// An array's element type and length, checked: a known element type, and no more elements
    /// than the rest of the file can hold at that type's smallest encoding. Returns the type, that
    /// smallest size and the length.
    fn array_header(&mut self) -> Result<(u32, usize, u64), GgufError> {
        let elem_off = self.offset();
        let elem_type = self.u32("array element type")?;
        let Some(min_size) = min_encoded_size(elem_type) else {
            return Err(GgufError::BadValueType {
                offset: elem_off,
                type_id: elem_type,
            });
        };
        let count_off = self.offset();
        let count = self.u64("array length")?;
        let limit = ((self.remaining() / min_size) as u64).min(MAX_ARRAY_LEN);
        if count > limit {
            return Err(GgufError::ArrayTooLong {
                offset: count_off,
                elem_type,
                count,
                limit,
            });
        }
        Ok((elem_type, min_size, count))
    }

    /// A top-level array of at least [`LAZY_ARRAY`] strings or numbers: checked as
    /// [`Self::value`] checks it (the same errors), but not copied. Returns where its first
    /// element starts, how many there are and their type; `None`, having read nothing, for any
    /// other value.
    fn lazy_array(&mut self, type_id: u32) -> Result<Option<(usize, usize, u32)>, GgufError> {
        use value_type as vt;
        let head = |at: usize, n: usize| self.buf.get(self.pos + at..self.pos + at + n);
        let (Some(elem), Some(count)) = (head(0, 4), head(4, 8)) else {
            return Ok(None);
        };
        let elem = u32::from_le_bytes(elem.try_into().expect("4 bytes"));
        let count = u64::from_le_bytes(count.try_into().expect("8 bytes"));
        if type_id != vt::ARRAY || elem == vt::ARRAY || count < LAZY_ARRAY as u64 {
            return Ok(None);
        }
        if min_encoded_size(elem).is_none() {
            return Ok(None); // a bad element type: `value` reports it
        }
        let (elem_type, size, count) = self.array_header()?;
        let at = self.pos;
        if elem_type == vt::STRING {
            for _ in 0..count {
                self.str("string value")?;
            }
        } else {
            // Fixed-size numbers: the limit above leaves room for all of them.
            self.pos += count as usize * size;
        }
        Ok(Some((at, count as usize, elem_type)))
    }

    /// Reads one value of GGUF type `type_id` (whose type field was at `type_off`); `depth` is the
    /// number of arrays enclosing it.
    fn value(&mut self, type_id: u32, type_off: u64, depth: usize) -> Result<Value, GgufError> {
        use value_type as vt;
        Ok(match type_id {
            vt::U8 => Value::U8(u8::from_le_bytes(self.array("u8 value")?)),
            vt::I8 => Value::I8(i8::from_le_bytes(self.array("i8 value")?)),
            vt::U16 => Value::U16(u16::from_le_bytes(self.array("u16 value")?)),
            vt::I16 => Value::I16(i16::from_le_bytes(self.array("i16 value")?)),
            vt::U32 => Value::U32(u32::from_le_bytes(self.array("u32 value")?)),
            vt::I32 => Value::I32(i32::from_le_bytes(self.array("i32 value")?)),
            vt::F32 => Value::F32(f32::from_le_bytes(self.array("f32 value")?)),
            vt::BOOL => Value::Bool(self.array::<1>("bool value")?[0] != 0),
            vt::STRING => Value::String(self.string("string value")?),
            vt::U64 => Value::U64(u64::from_le_bytes(self.array("u64 value")?)),
            vt::I64 => Value::I64(i64::from_le_bytes(self.array("i64 value")?)),
            vt::F64 => Value::F64(f64::from_le_bytes(self.array("f64 value")?)),
            vt::ARRAY => {
                let depth = depth + 1;
                if depth > MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooDeep {
                        offset: type_off,
                        depth,
                        limit: MAX_ARRAY_DEPTH,
                    });
                }
                let elem_off = self.offset();
                let (elem_type, _, count) = self.array_header()?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem_type, elem_off, depth)?);
                }
                Value::Array(items)
            }
            _ => {
                return Err(GgufError::BadValueType {
                    offset: type_off,
                    type_id,
                })
            }
        })
    }
}
