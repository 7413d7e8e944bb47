//! The GGUF reader on malformed input: every defect gives its own error variant whose message names
//! the byte offset (and the limit, where one applies); no input panics — every prefix of a valid
//! file and thousands of randomly corrupted copies included.

use infer::format::{GgmlType, Gguf, GgufError, GgufWriter, Value};

/// Hand-assembles GGUF bytes, so that fields can hold values the writer would refuse.
#[derive(Default)]
struct B(Vec<u8>);

impl B {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> B {
        let mut b = B::default();
        b.0.extend_from_slice(b"GGUF");
        b.u32(version).u64(n_tensors).u64(n_kv);
        b
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    /// A u32 key/value pair.
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(type_id).u64(offset)
    }
    /// Pads to `align` and appends `n` data bytes.
    fn data(&mut self, align: usize, n: usize) -> &mut Self {
        let padded = self.0.len().next_multiple_of(align);
        self.0.resize(padded + n, 0xAB);
        self
    }
    fn pos(&self) -> u64 {
        self.0.len() as u64
    }
    fn parse(&self) -> Result<Gguf, GgufError> {
        Gguf::from_bytes(self.0.clone())
    }
}

/// Asserts `r` failed, that its message mentions every needle, and returns the error.
#[track_caller]
fn err(r: Result<Gguf, GgufError>, needles: &[&str]) -> GgufError {
    let e = match r {
        Ok(g) => panic!("expected an error, parsed {g:?}"),
        Err(e) => e,
    };
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "message {msg:?} lacks {n:?}");
    }
    e
}

/// A small valid file: a few metadata values including arrays, and tensors whose last one ends
/// exactly at the end of the file (so that every proper prefix is invalid).
fn small_valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("llama".into()));
    w.add_kv("llama.block_count", Value::U32(2));
    w.add_kv("rope", Value::F32(10000.0));
    w.add_kv(
        "tokens",
        Value::Array(vec![Value::String("<s>".into()), Value::String("a".into())]),
    );
    w.add_kv(
        "nested",
        Value::Array(vec![
            Value::Array(vec![Value::I16(-1), Value::I16(2)]),
            Value::Array(vec![]),
        ]),
    );
    w.add_kv("flag", Value::Bool(true));
    w.add_tensor("a", &[5], GgmlType::F32, vec![1; 20]).unwrap();
    w.add_tensor("b", &[32, 2], GgmlType::Q8_0, vec![2; 68])
        .unwrap();
    w.add_tensor("c", &[8, 2], GgmlType::F32, vec![3; 64])
        .unwrap();
    let bytes = w.to_bytes();
    let g = Gguf::from_bytes(bytes.clone()).unwrap();
    let last = g.tensor("c").unwrap();
    assert_eq!(
        g.data_offset() + last.offset as usize + last.size_bytes,
        bytes.len()
    );
    bytes
}

#[test]
fn every_prefix_of_a_valid_file_is_an_error() {
    let bytes = small_valid_file();
    for len in 0..bytes.len() {
        let e = match Gguf::from_bytes(bytes[..len].to_vec()) {
            Ok(_) => panic!("prefix of {len} of {} bytes parsed", bytes.len()),
            Err(e) => e,
        };
        let msg = e.to_string();
        assert!(msg.contains("offset"), "len {len}: {msg}");
        assert!(
            matches!(
                e,
                GgufError::Truncated { .. }
                    | GgufError::StringTooLong { .. }
                    | GgufError::ArrayTooLong { .. }
                    | GgufError::TensorOutOfBounds { .. }
            ),
            "len {len}: unexpected {e:?}"
        );
        if let GgufError::Truncated {
            offset, remaining, ..
        } = e
        {
            assert!(offset <= len as u64 && remaining < 8, "len {len}: {msg}");
        }
    }
    assert!(Gguf::from_bytes(bytes).is_ok());
}

#[test]
fn truncation_errors_name_offset_and_field() {
    let bytes = small_valid_file();
    let e = err(
        Gguf::from_bytes(bytes[..2].to_vec()),
        &["magic", "offset 0", "needs 4 bytes", "only 2"],
    );
    assert!(matches!(
        e,
        GgufError::Truncated {
            offset: 0,
            needed: 4,
            remaining: 2,
            ..
        }
    ));
    let e = err(
        Gguf::from_bytes(bytes[..20].to_vec()),
        &["kv_count", "offset 16", "needs 8", "only 4"],
    );
    assert!(matches!(e, GgufError::Truncated { offset: 16, .. }));
    // Cut inside the first key's bytes: the declared length exceeds what remains.
    let e = err(
        Gguf::from_bytes(bytes[..40].to_vec()),
        &["metadata key", "offset 24", "length 20", "limit of 8"],
    );
    assert!(matches!(
        e,
        GgufError::StringTooLong {
            offset: 24,
            len: 20,
            remaining: 8,
            limit: 8,
            ..
        }
    ));
    // Cut inside the last tensor's data.
    let e = err(
        Gguf::from_bytes(bytes[..bytes.len() - 1].to_vec()),
        &["tensor \"c\"", "+ 64 bytes"],
    );
    assert!(matches!(e, GgufError::TensorOutOfBounds { size: 64, .. }));
    assert!(matches!(
        Gguf::from_bytes(Vec::new()),
        Err(GgufError::Truncated { offset: 0, .. })
    ));
}

#[test]
fn bad_magic_and_versions() {
    let mut b = B::header(3, 0, 0);
    b.0[..4].copy_from_slice(b"GGML");
    let e = err(b.parse(), &["not a GGUF file", "offset 0", "47 47 55 46"]);
    assert!(matches!(e, GgufError::BadMagic { found } if &found == b"GGML"));

    for v in [0, 1, 4, 99] {
        let e = err(
            B::header(v, 0, 0).parse(),
            &[&format!("version {v}"), "offset 4", "supported: 2 and 3"],
        );
        assert!(matches!(e, GgufError::UnsupportedVersion { version } if version == v));
    }
    err(B::header(1, 0, 0).parse(), &["v1 is obsolete"]);
    err(B::header(3u32.swap_bytes(), 0, 0).parse(), &["big-endian"]);

    for v in [2, 3] {
        let g = B::header(v, 0, 0).parse().unwrap();
        assert_eq!(g.version, v);
        assert!(g.tensors.is_empty() && g.metadata().is_empty());
    }
}

#[test]
fn absurd_counts_hit_the_caps() {
    let e = err(
        B::header(3, (1 << 20) + 1, 0).parse(),
        &["tensor_count 1048577", "offset 8", "limit of 1048576"],
    );
    assert!(matches!(
        e,
        GgufError::TooMany {
            offset: 8,
            limit: 1_048_576,
            ..
        }
    ));
    let e = err(
        B::header(3, 0, u64::MAX).parse(),
        &[
            "kv_count 18446744073709551615",
            "offset 16",
            "limit of 1048576",
        ],
    );
    assert!(matches!(e, GgufError::TooMany { offset: 16, .. }));
    // Within the caps but far more than the bytes can hold: a truncation error, not an allocation.
    let e = err(B::header(3, 1 << 20, 1 << 20).parse(), &["offset 24"]);
    assert!(matches!(e, GgufError::Truncated { offset: 24, .. }));
}

#[test]
fn absurd_string_lengths() {
    let mut b = B::header(3, 0, 1);
    b.u64(u64::MAX).0.extend_from_slice(&[0; 40]);
    let e = err(
        b.parse(),
        &[
            "metadata key",
            "offset 24",
            "length 18446744073709551615",
            "limit of 40",
        ],
    );
    assert!(matches!(
        e,
        GgufError::StringTooLong {
            offset: 24,
            limit: 40,
            ..
        }
    ));

    // A length above the 1 GiB cap is rejected even before comparing with the bytes remaining.
    let mut b = B::header(3, 0, 1);
    b.str("k").u32(8).u64((1 << 30) + 1);
    let e = err(
        b.parse(),
        &["string value", "offset 37", "length 1073741825"],
    );
    assert!(matches!(
        e,
        GgufError::StringTooLong {
            offset: 37,
            len: 1_073_741_825,
            limit: 0,
            ..
        }
    ));

    let mut b = B::header(3, 1, 0);
    b.u64(1 << 40);
    let e = err(b.parse(), &["tensor name", "offset 24"]);
    assert!(matches!(e, GgufError::StringTooLong { offset: 24, .. }));

    let mut b = B::header(3, 0, 1);
    b.u64(2).0.extend_from_slice(&[0xff, 0xfe]);
    b.u32(4).u32(0);
    let e = err(b.parse(), &["not valid UTF-8", "offset 32"]);
    assert!(matches!(e, GgufError::InvalidUtf8 { offset: 32, .. }));
}

#[test]
fn absurd_array_lengths_and_types() {
    let mut b = B::header(3, 0, 1);
    b.str("arr").u32(9).u32(4).u64(u64::MAX).u32(1).u32(2);
    let e = err(
        b.parse(),
        &[
            "array length 18446744073709551615",
            "offset 43",
            "limit of 2 u32",
        ],
    );
    assert!(matches!(
        e,
        GgufError::ArrayTooLong {
            offset: 43,
            limit: 2,
            elem_type: 4,
            ..
        }
    ));

    // Many strings: each needs at least its 8-byte length.
    let mut b = B::header(3, 0, 1);
    b.str("arr").u32(9).u32(8).u64(3).str("a").str("b");
    let e = err(b.parse(), &["array length 3", "limit of 2 string"]);
    assert!(matches!(
        e,
        GgufError::ArrayTooLong {
            count: 3,
            limit: 2,
            ..
        }
    ));

    // The element cap applies even when the bytes would allow more.
    let mut b = B::header(3, 0, 1);
    b.str("arr").u32(9).u32(0).u64((1 << 24) + 1);
    b.0.resize(b.0.len() + (1 << 24) + 1, 0);
    let e = err(b.parse(), &["array length 16777217", "limit of 16777216"]);
    assert!(matches!(
        e,
        GgufError::ArrayTooLong {
            limit: 16_777_216,
            ..
        }
    ));

    let mut b = B::header(3, 0, 1);
    b.str("v").u32(13).u32(0);
    let e = err(b.parse(), &["unknown GGUF value type 13", "offset 33"]);
    assert!(matches!(
        e,
        GgufError::BadValueType {
            offset: 33,
            type_id: 13
        }
    ));

    let mut b = B::header(3, 0, 1);
    b.str("v").u32(9).u32(u32::MAX).u64(0);
    let e = err(
        b.parse(),
        &["unknown GGUF value type 4294967295", "offset 37"],
    );
    assert!(matches!(e, GgufError::BadValueType { offset: 37, .. }));
}

#[test]
fn nesting_depth_is_capped_at_eight() {
    let nested = |depth: usize| {
        let mut b = B::header(3, 0, 1);
        b.str("deep").u32(9);
        for _ in 1..depth {
            b.u32(9).u64(1);
        }
        b.u32(0).u64(1).0.push(42);
        b
    };
    let g = nested(8).parse().unwrap();
    let mut v = g.get("deep").unwrap();
    for _ in 0..7 {
        v = &v.as_array().unwrap()[0];
    }
    assert_eq!(v, &Value::Array(vec![Value::U8(42)]));

    // The ninth array is declared by the eighth one's element type field: 40 + 7 * 12.
    let e = err(
        nested(9).parse(),
        &["nesting depth 9", "offset 124", "limit of 8"],
    );
    assert!(matches!(
        e,
        GgufError::TooDeep {
            offset: 124,
            depth: 9,
            limit: 8
        }
    ));
    assert!(matches!(
        nested(1000).parse(),
        Err(GgufError::TooDeep { depth: 9, .. })
    ));
}

#[test]
fn duplicate_keys_and_bad_alignment() {
    let mut b = B::header(3, 0, 2);
    b.kv_u32("k", 1);
    let second = b.pos();
    b.kv_u32("k", 2);
    let e = err(
        b.parse(),
        &["duplicate metadata key \"k\"", &format!("offset {second}")],
    );
    assert!(matches!(e, GgufError::DuplicateKey { offset, .. } if offset == second));

    for a in [0u32, 3, 48] {
        let mut b = B::header(3, 0, 1);
        b.kv_u32("general.alignment", a);
        let e = err(
            b.parse(),
            &["general.alignment", "offset 53", "power of two"],
        );
        assert!(matches!(e, GgufError::BadAlignment { offset: 53, .. }));
    }
    let mut b = B::header(3, 0, 1);
    b.str("general.alignment").u32(8).str("32");
    err(b.parse(), &["general.alignment", "String(\"32\")"]);

    // A valid non-default alignment governs the data section and the tensor offsets.
    let mut b = B::header(3, 2, 1);
    b.kv_u32("general.alignment", 64);
    b.tensor("x", &[4], 0, 0)
        .tensor("y", &[4], 0, 64)
        .data(64, 80);
    let g = b.parse().unwrap();
    assert_eq!((g.alignment, g.data_offset()), (64, 128));
    assert_eq!(g.tensor_data(g.tensor("y").unwrap()), &[0xAB; 16]);
}

#[test]
fn bad_tensor_infos() {
    let at = |dims: &[u64], type_id: u32, offset: u64| {
        let mut b = B::header(3, 1, 0);
        b.tensor("w", dims, type_id, offset).data(32, 64);
        b.parse()
    };
    // Layout: header 24, name 8 + 1 → n_dims at 33, dims from 37.
    for n in [0u32, 5] {
        let mut b = B::header(3, 1, 0);
        b.str("w").u32(n);
        b.0.resize(200, 0);
        let e = err(
            b.parse(),
            &["tensor \"w\"", &format!("n_dims {n}"), "offset 33", "1..=4"],
        );
        assert!(matches!(
            e,
            GgufError::BadDimCount {
                offset: 33,
                limit: 4,
                ..
            }
        ));
    }
    let e = err(
        at(&[4, 0], 0, 0),
        &["tensor \"w\"", "dimension 1", "offset 45", "at least 1"],
    );
    assert!(matches!(
        e,
        GgufError::BadDim {
            offset: 45,
            index: 1,
            dim: 0,
            ..
        }
    ));

    let e = err(
        at(&[1 << 32, 1 << 32, 2], 0, 0),
        &["tensor \"w\"", "offset 37", "overflows"],
    );
    assert!(matches!(e, GgufError::TooLarge { offset: 37, .. }));
    // Element count fits u64 but the byte size does not.
    let e = err(at(&[1 << 32, 1 << 31], 0, 0), &["overflows"]);
    assert!(matches!(e, GgufError::TooLarge { .. }));

    for id in [4u32, 31, 40, 1000] {
        let e = err(
            at(&[4], id, 0),
            &[
                "tensor \"w\"",
                &format!("unknown ggml type id {id}"),
                "offset 45",
            ],
        );
        assert!(matches!(e, GgufError::UnknownType { offset: 45, id: i, .. } if i == id));
    }

    let e = err(
        at(&[100], 12, 0),
        &[
            "tensor \"w\"",
            "row length 100",
            "Q4_K block size 256",
            "offset 37",
        ],
    );
    assert!(matches!(
        e,
        GgufError::PartialBlock {
            block_size: 256,
            row_len: 100,
            ..
        }
    ));
    // A whole number of blocks overall is not enough: each row must be whole blocks.
    let e = err(at(&[16, 2], 8, 0), &["Q8_0 block size 32"]);
    assert!(matches!(e, GgufError::PartialBlock { .. }));

    let e = err(
        at(&[4], 0, 16),
        &[
            "tensor \"w\"",
            "data offset 16",
            "offset 49",
            "alignment 32",
        ],
    );
    assert!(matches!(
        e,
        GgufError::MisalignedTensor {
            offset: 49,
            tensor_offset: 16,
            alignment: 32,
            ..
        }
    ));

    // 64 data bytes at file offset 64: [4] F32 at 32 fits exactly, 48 floats do not.
    assert!(at(&[4], 0, 32).is_ok());
    let e = err(
        at(&[17], 0, 0),
        &[
            "tensor \"w\"",
            "+ 68 bytes",
            "offset 49",
            "holds 64 bytes",
            "64..128",
        ],
    );
    assert!(matches!(
        e,
        GgufError::TensorOutOfBounds {
            offset: 49,
            size: 68,
            data_len: 64,
            ..
        }
    ));
    err(at(&[4], 0, 64), &["data offset 64"]);
    let e = err(
        at(&[4], 0, u64::MAX - 31),
        &["data offset 18446744073709551584"],
    );
    assert!(matches!(e, GgufError::TensorOutOfBounds { .. }));
}

#[test]
fn duplicate_tensor_names() {
    let mut b = B::header(3, 2, 0);
    b.tensor("w", &[8], 0, 0);
    let second = b.pos();
    b.tensor("w", &[8], 0, 32).data(32, 64);
    let e = err(
        b.parse(),
        &["duplicate tensor name \"w\"", &format!("offset {second}")],
    );
    assert!(matches!(e, GgufError::DuplicateTensor { offset, .. } if offset == second));
}

#[test]
fn zero_tensors_without_trailing_padding_is_accepted() {
    let mut b = B::header(3, 0, 1);
    b.kv_u32("general.alignment", 4096);
    assert_eq!(b.0.len(), 57);
    let g = b.parse().unwrap();
    assert_eq!(g.alignment, 4096);
    assert_eq!(g.file_size(), 57);
    assert_eq!(g.data_offset(), 4096);
    assert!(g.tensors.is_empty());
}

/// Fixed-seed xorshift64*: no dependencies, same sequence on every run.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Corrupts copies of `valid` (1–4 byte changes, three quarters of them inside the header and
/// tensor infos — the first `header_len` bytes — and every eighth copy also truncated) and opens
/// each: no panic, every error names an offset, and whatever opens hands out every tensor's data
/// with exactly its size. Returns (opened, rejected).
fn fuzz(valid: &[u8], header_len: usize, seed: u64, rounds: usize) -> (usize, usize) {
    let mut rng = XorShift(seed);
    let (mut ok, mut failed) = (0usize, 0usize);
    for round in 0..rounds {
        let mut bytes = valid.to_vec();
        for _ in 0..1 + rng.below(4) {
            let span = if rng.below(4) == 0 {
                bytes.len()
            } else {
                header_len
            };
            let i = rng.below(span);
            bytes[i] = match rng.below(4) {
                0 => bytes[i] ^ (1 << rng.below(8)),
                1 => 0xff,
                2 => 0,
                _ => rng.next() as u8,
            };
        }
        if round % 8 == 0 {
            let cut = rng.below(bytes.len() + 1);
            bytes.truncate(cut);
        }
        match Gguf::from_bytes(bytes) {
            Ok(g) => {
                ok += 1;
                for t in &g.tensors {
                    assert_eq!(g.tensor_data(t).len(), t.size_bytes);
                    assert_eq!(t.offset % g.alignment as u64, 0);
                    assert!(g.tensor(&t.name).is_some());
                }
            }
            Err(e) => {
                failed += 1;
                assert!(e.to_string().contains("offset"), "{e}");
            }
        }
    }
    (ok, failed)
}

#[test]
fn random_corruption_never_panics() {
    let valid = small_valid_file();
    let header_len = Gguf::from_bytes(valid.clone()).unwrap().data_offset();
    let (ok, failed) = fuzz(&valid, header_len, 0x9E37_79B9_7F4A_7C15, 20_000);
    eprintln!("small file: {ok} opened, {failed} rejected");
    // Both outcomes occur: the loop exercises the checks, not just the magic test.
    assert!(ok > 1000 && failed > 5000, "ok {ok}, failed {failed}");

    let py = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gguf/gguf_py_written.bin"),
    )
    .unwrap();
    let (ok, failed) = fuzz(&py, 800, 0xDEAD_BEEF_CAFE_F00D, 20_000);
    eprintln!("gguf-py file: {ok} opened, {failed} rejected");
    assert!(ok > 1000 && failed > 5000, "ok {ok}, failed {failed}");
}
