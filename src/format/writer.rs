//! The GGUF writer: collects metadata and tensors in memory and serialises them as a GGUF v3 file
//! that [`Gguf`](super::Gguf), ggml and gguf-py read back unchanged.
//!
//! Layout written: header, metadata in insertion order, tensor infos in insertion order, zero padding
//! to the alignment, then each tensor's data followed by zero padding to the alignment (so every
//! tensor offset is aligned, as ggml and gguf-py lay files out). The alignment is 32 unless a
//! `general.alignment` u32 is added, which must then be a non-zero power of two.
//!
//! Invariants: `add_tensor` accepts only tensors the reader would accept (unique name, 1..=4 dims each
//! ≥ 1, whole blocks per row, `data.len()` exactly the type's byte size); nothing is written unless
//! the whole file is valid — `write_to` checks every metadata value (homogeneous arrays, nesting
//! depth, string lengths) before emitting its first byte. Every `Value` variant is written as its own
//! GGUF type, so a read→write round trip keeps each value's type. An empty `Value::Array` carries no
//! element type; it is written with element type STRING (8) — readers ignore the element type of an
//! empty array, and gguf-py itself refuses to write empty arrays, so nothing better can be preserved.

use std::fmt;
use std::fs;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use super::gguf::{
    value_type, GgufError, Value, DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN,
    MAX_DIMS, MAX_KV, MAX_STRING_LEN, MAX_TENSORS,
};
use super::types::GgmlType;

/// Element type written for an empty array (see the module docs).
pub const EMPTY_ARRAY_ELEM_TYPE: u32 = value_type::STRING;

/// The GGUF version this writer emits.
pub const WRITE_VERSION: u32 = 3;

#[derive(Clone)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF v3 file in memory; see the module docs for the layout and the checks.
#[derive(Clone, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl fmt::Debug for GgufWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufWriter")
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufWriter {
    /// An empty GGUF v3 file with alignment 32.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata pair. Adding a key again replaces its value in place (the key keeps its
    /// original position). Array elements must all have the same type; that, nesting depth and string
    /// lengths are checked when writing.
    pub fn add_kv(&mut self, key: &str, value: Value) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key.to_owned(), value)),
        }
    }

    /// Adds a tensor with `dims` in ggml order (`dims[0]` is the row length) and its raw data, which
    /// must be exactly `ty.row_bytes(dims[0]) * product(dims[1..])` bytes.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<(), GgufError> {
        let invalid = |reason: String| GgufError::InvalidTensor {
            name: name.to_owned(),
            reason,
        };
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(invalid("a tensor with this name was already added".into()));
        }
        if name.len() as u64 > MAX_STRING_LEN {
            return Err(invalid(format!(
                "name is {} bytes, more than the limit of {MAX_STRING_LEN}",
                name.len()
            )));
        }
        if self.tensors.len() as u64 >= MAX_TENSORS {
            return Err(invalid(format!(
                "a GGUF file holds at most {MAX_TENSORS} tensors"
            )));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS as usize {
            return Err(invalid(format!(
                "{} dimensions, expected 1..={MAX_DIMS}",
                dims.len()
            )));
        }
        if let Some(i) = dims.iter().position(|&d| d == 0) {
            return Err(invalid(format!(
                "dimension {i} is 0; every dimension must be at least 1"
            )));
        }
        let expected = usize::try_from(dims[0])
            .ok()
            .and_then(|row_len| ty.row_bytes(row_len))
            .and_then(|row| {
                dims[1..]
                    .iter()
                    .try_fold(row, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
            });
        let Some(expected) = expected else {
            return Err(invalid(format!(
                "dims {dims:?} do not make whole {ty} rows (block size {}) of a representable size",
                ty.block_size()
            )));
        };
        if data.len() != expected {
            return Err(invalid(format!(
                "{} data bytes given, but dims {dims:?} of type {ty} need {expected}",
                data.len()
            )));
        }
        self.tensors.push(PendingTensor {
            name: name.to_owned(),
            dims: dims.to_vec(),
            ty,
            data,
        });
        Ok(())
    }

    /// Serialises the file into `w`. Fails with `InvalidInput` before writing anything if a metadata
    /// value cannot be encoded (mixed-type array, nesting deeper than 8, oversized string or array,
    /// bad `general.alignment`).
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let alignment = self.validate()?;
        let mut head = Vec::with_capacity(self.header_len_hint());
        head.extend_from_slice(&MAGIC);
        head.extend_from_slice(&WRITE_VERSION.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_str(&mut head, key);
            head.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut head, value);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&(offset as u64).to_le_bytes());
            offset = align_up(offset + t.data.len(), alignment);
        }
        head.resize(align_up(head.len(), alignment), 0);
        w.write_all(&head)?;
        let zeros = vec![0u8; alignment];
        for t in &self.tensors {
            w.write_all(&t.data)?;
            let pad = align_up(t.data.len(), alignment) - t.data.len();
            w.write_all(&zeros[..pad])?;
        }
        w.flush()
    }

    /// The serialised file.
    ///
    /// # Panics
    /// If the metadata cannot be encoded (see [`GgufWriter::write_to`], which returns that as an
    /// error instead).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        if let Err(e) = self.write_to(&mut out) {
            panic!("GgufWriter::to_bytes: {e}");
        }
        out
    }

    /// Writes the file atomically: into a temporary file in the same directory, synced, then renamed
    /// over `path`. On failure the temporary file is removed and `path` is untouched.
    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        self.validate()?;
        let file_name = path.file_name().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} has no file name", path.display()),
            )
        })?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let tmp = dir.join(format!(
            ".{}.tmp-{}-{}",
            file_name.to_string_lossy(),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let result = (|| {
            let mut out = BufWriter::with_capacity(1 << 20, fs::File::create(&tmp)?);
            self.write_to(&mut out)?;
            let file = out.into_inner().map_err(io::IntoInnerError::into_error)?;
            file.sync_all()?;
            drop(file);
            fs::rename(&tmp, path)
        })();
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result.map_err(|e| io::Error::new(e.kind(), format!("writing {}: {e}", path.display())))
    }

    /// Checks everything `write_to` relies on and returns the alignment to use.
    fn validate(&self) -> io::Result<usize> {
        let bad = |msg: String| io::Error::new(io::ErrorKind::InvalidInput, msg);
        if self.metadata.len() as u64 > MAX_KV {
            return Err(bad(format!(
                "{} metadata pairs, more than the limit of {MAX_KV}",
                self.metadata.len()
            )));
        }
        for (key, value) in &self.metadata {
            if key.len() as u64 > MAX_STRING_LEN {
                return Err(bad(format!(
                    "metadata key of {} bytes exceeds the limit of {MAX_STRING_LEN}",
                    key.len()
                )));
            }
            check_value(value, 0).map_err(|e| bad(format!("metadata {key:?}: {e}")))?;
        }
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, Value::U32(a))) if a.is_power_of_two() => Ok(*a as usize),
            Some((_, v)) => Err(bad(format!(
                "general.alignment must be a u32 non-zero power of two, got {v:?}"
            ))),
        }
    }

    fn header_len_hint(&self) -> usize {
        24 + self.metadata.len() * 32 + self.tensors.len() * 96
    }
}

/// Checks that `v` (enclosed by `depth` arrays) can be encoded and read back.
fn check_value(v: &Value, depth: usize) -> Result<(), String> {
    match v {
        Value::String(s) if s.len() as u64 > MAX_STRING_LEN => Err(format!(
            "string of {} bytes exceeds the limit of {MAX_STRING_LEN}",
            s.len()
        )),
        Value::Array(items) => {
            let depth = depth + 1;
            if depth > MAX_ARRAY_DEPTH {
                return Err(format!(
                    "arrays nested {depth} deep, more than the limit of {MAX_ARRAY_DEPTH}"
                ));
            }
            if items.len() as u64 > MAX_ARRAY_LEN {
                return Err(format!(
                    "array of {} elements exceeds the limit of {MAX_ARRAY_LEN}",
                    items.len()
                ));
            }
            if let Some(first) = items.first() {
                let ty = first.type_id();
                if let Some((i, odd)) = items.iter().enumerate().find(|(_, x)| x.type_id() != ty) {
                    return Err(format!(
                        "array elements must share one type: element 0 has type {ty}, element {i} has type {}",
                        odd.type_id()
                    ));
                }
            }
            items.iter().try_for_each(|x| check_value(x, depth))
        }
        _ => Ok(()),
    }
}

fn align_up(n: usize, alignment: usize) -> usize {
    n.next_multiple_of(alignment)
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Appends the encoding of `v` without its type field (the caller wrote that, or it is an array's
/// shared element type).
fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            let elem = items.first().map_or(EMPTY_ARRAY_ELEM_TYPE, Value::type_id);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for x in items {
                put_value(out, x);
            }
        }
    }
}
