//! The GGUF writer and reader together: every value type (nested and empty arrays included) and
//! several tensor types survive a write → read round trip; a file written by gguf-py
//! (`tests/fixtures/gguf/gguf_py_written.bin`, made by `make_py_fixture.py` next to it) reads back
//! with the values gguf-py put in; and our writer's output is byte-for-byte the committed golden file
//! `tests/fixtures/gguf/infer_written.bin` (regenerate with `INFER_BLESS=1`), which gguf-py reads.

use std::path::{Path, PathBuf};

use infer::format::{GgmlType, Gguf, GgufError, GgufWriter, Value};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Deterministic filler bytes.
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Metadata covering every value type, nested arrays and empty arrays.
fn all_values() -> Vec<(&'static str, Value)> {
    use Value::*;
    vec![
        ("general.architecture", String("llama".into())),
        ("t.u8", U8(255)),
        ("t.i8", I8(-128)),
        ("t.u16", U16(65535)),
        ("t.i16", I16(-32768)),
        ("t.u32", U32(u32::MAX)),
        ("t.i32", I32(i32::MIN)),
        ("t.u64", U64(u64::MAX)),
        ("t.i64", I64(i64::MIN)),
        ("t.f32", F32(-0.1)),
        ("t.f32_inf", F32(f32::INFINITY)),
        ("t.f64", F64(std::f64::consts::PI)),
        ("t.bool_t", Bool(true)),
        ("t.bool_f", Bool(false)),
        ("t.str", String("héllo ✓ \0 end".into())),
        ("t.str_empty", String("".into())),
        ("t.arr_u8", Array(vec![U8(0), U8(1), U8(255)])),
        ("t.arr_i8", Array(vec![I8(-1), I8(1)])),
        ("t.arr_u16", Array(vec![U16(7)])),
        ("t.arr_i16", Array(vec![I16(-7), I16(8)])),
        ("t.arr_u32", Array(vec![U32(1), U32(2), U32(3)])),
        ("t.arr_i32", Array(vec![I32(-1), I32(0), I32(1)])),
        ("t.arr_u64", Array(vec![U64(1 << 40)])),
        ("t.arr_i64", Array(vec![I64(-(1 << 40))])),
        ("t.arr_f32", Array(vec![F32(0.5), F32(-2.0), F32(1e-30)])),
        ("t.arr_f64", Array(vec![F64(1e300), F64(-0.25)])),
        (
            "t.arr_bool",
            Array(vec![Bool(true), Bool(false), Bool(true)]),
        ),
        (
            "t.arr_str",
            Array(vec![
                String("a".into()),
                String("".into()),
                String("日本".into()),
            ]),
        ),
        ("t.arr_empty", Array(vec![])),
        (
            "t.arr_nested",
            Array(vec![
                Array(vec![I32(1), I32(2)]),
                Array(vec![String("mixed inner types are fine".into())]),
                Array(vec![]),
                Array(vec![Array(vec![Array(vec![F64(9.5)])])]),
            ]),
        ),
    ]
}

/// (name, dims, type, data) for tensors of several types and ranks.
fn all_tensors() -> Vec<(&'static str, Vec<u64>, GgmlType, Vec<u8>)> {
    vec![
        (
            "f32.vec",
            vec![5],
            GgmlType::F32,
            f32_bytes(&[1.0, -2.0, 3.5, 0.0, 1e-3]),
        ),
        ("f16.mat", vec![4, 3], GgmlType::F16, pattern(4 * 3 * 2, 1)),
        ("bf16.mat", vec![2, 2], GgmlType::BF16, pattern(8, 2)),
        (
            "q4_0.mat",
            vec![64, 3],
            GgmlType::Q4_0,
            pattern(2 * 3 * 18, 3),
        ),
        (
            "q8_0.3d",
            vec![32, 2, 2],
            GgmlType::Q8_0,
            pattern(4 * 34, 4),
        ),
        ("q4_k.mat", vec![256, 2], GgmlType::Q4K, pattern(2 * 144, 5)),
        (
            "q6_k.4d",
            vec![256, 1, 2, 1],
            GgmlType::Q6K,
            pattern(2 * 210, 6),
        ),
        ("i8.vec", vec![3], GgmlType::I8, vec![1, 2, 3]),
        ("i32.vec", vec![2], GgmlType::I32, pattern(8, 7)),
    ]
}

fn build_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    for (k, v) in all_values() {
        w.add_kv(k, v);
    }
    for (name, dims, ty, data) in all_tensors() {
        w.add_tensor(name, &dims, ty, data).unwrap();
    }
    w
}

#[test]
fn writer_round_trip_preserves_every_value_and_tensor() {
    let bytes = build_writer().to_bytes();
    assert_eq!(&bytes[..4], b"GGUF");
    assert_eq!(u32::from_le_bytes(bytes[4..8].try_into().unwrap()), 3);
    let g = Gguf::from_bytes(bytes.clone()).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.alignment, 32);
    assert_eq!(g.file_size(), bytes.len());
    assert_eq!(g.data_offset() % 32, 0);

    let expected = all_values();
    assert_eq!(g.metadata().len(), expected.len());
    for ((k, v), (ek, ev)) in g.metadata().iter().zip(&expected) {
        assert_eq!(k, ek);
        assert_eq!(v, ev, "{k}");
        assert_eq!(v.type_id(), ev.type_id(), "{k}");
        assert_eq!(g.get(k), Some(ev));
    }
    assert_eq!(g.get_f32("t.f32"), Some(-0.1));
    assert_eq!(g.get_u64("t.u64"), Some(u64::MAX));
    assert_eq!(g.get("t.i64").and_then(Value::as_i64), Some(i64::MIN));
    assert_eq!(g.get_u64("t.i64"), None);
    assert_eq!(g.get_str("t.str"), Some("héllo ✓ \0 end"));
    assert_eq!(g.get_bool("t.bool_t"), Some(true));
    assert_eq!(g.architecture(), Some("llama"));

    let expected = all_tensors();
    assert_eq!(g.tensors.len(), expected.len());
    let mut end = 0;
    for (t, (name, dims, ty, data)) in g.tensors.iter().zip(&expected) {
        assert_eq!(&t.name, name);
        assert_eq!(&t.dims, dims);
        assert_eq!(t.ty, *ty);
        assert_eq!(t.offset % 32, 0, "{name}");
        assert_eq!(
            t.offset,
            (end as u64).next_multiple_of(32),
            "{name} packed after the previous one"
        );
        assert_eq!(t.size_bytes, data.len());
        assert_eq!(g.tensor_data(t), &data[..], "{name}");
        end = t.offset as usize + t.size_bytes;
    }
    assert_eq!(g.file_size(), g.data_offset() + end.next_multiple_of(32));
    let q8 = g.tensor("q8_0.3d").unwrap();
    assert_eq!((q8.row_len(), q8.n_rows(), q8.n_elements()), (32, 4, 128));
    let f32v = g.tensor_data(g.tensor("f32.vec").unwrap());
    assert_eq!(f32::from_le_bytes(f32v[8..12].try_into().unwrap()), 3.5);
}

/// Reading a file and writing every value and tensor back reproduces the file byte for byte: value
/// types are preserved (empty arrays go back with the element type the writer uses, STRING).
#[test]
fn read_then_rewrite_is_byte_identical() {
    let original = build_writer().to_bytes();
    let g = Gguf::from_bytes(original.clone()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in g.metadata() {
        w.add_kv(k, v.clone());
    }
    for t in &g.tensors {
        w.add_tensor(&t.name, &t.dims, t.ty, g.tensor_data(t).to_vec())
            .unwrap();
    }
    assert_eq!(w.to_bytes(), original);
}

#[test]
fn empty_writer_and_metadata_only_files() {
    let bytes = GgufWriter::new().to_bytes();
    assert_eq!(bytes.len(), 32, "24-byte header padded to the alignment");
    let g = Gguf::from_bytes(bytes).unwrap();
    assert!(g.metadata().is_empty() && g.tensors.is_empty());

    let mut w = GgufWriter::new();
    w.add_kv("general.name", Value::String("x".into()));
    let bytes = w.to_bytes();
    // Header 24 + key (8 + 12) + type 4 + string (8 + 1) = 57 bytes, padded to 64.
    assert_eq!(bytes.len(), 64);
    for len in [57, 58, 63, 64] {
        let g =
            Gguf::from_bytes(bytes[..len].to_vec()).unwrap_or_else(|e| panic!("len {len}: {e}"));
        assert_eq!(g.get_str("general.name"), Some("x"));
        assert_eq!(g.file_size(), len);
    }
}

#[test]
fn writer_honours_general_alignment() {
    let mut w = GgufWriter::new();
    w.add_kv("general.alignment", Value::U32(256));
    w.add_tensor("a", &[3], GgmlType::F32, f32_bytes(&[1.0, 2.0, 3.0]))
        .unwrap();
    w.add_tensor("b", &[1], GgmlType::F32, f32_bytes(&[4.0]))
        .unwrap();
    let g = Gguf::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(g.alignment, 256);
    assert_eq!(g.data_offset(), 256);
    assert_eq!(g.tensor("a").unwrap().offset, 0);
    assert_eq!(g.tensor("b").unwrap().offset, 256);
    assert_eq!(g.tensor_data(g.tensor("b").unwrap()), &4.0f32.to_le_bytes());
    assert_eq!(g.file_size(), 768);

    for bad in [Value::U32(0), Value::U32(48), Value::U64(64)] {
        let mut w = GgufWriter::new();
        w.add_kv("general.alignment", bad.clone());
        let mut out = Vec::new();
        let err = w.write_to(&mut out).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{bad:?}");
        assert!(err.to_string().contains("general.alignment"), "{err}");
        assert!(out.is_empty(), "nothing written for {bad:?}");
    }
}

#[test]
fn add_kv_replaces_in_place() {
    let mut w = GgufWriter::new();
    w.add_kv("a", Value::U32(1));
    w.add_kv("b", Value::U32(2));
    w.add_kv("a", Value::String("one".into()));
    let g = Gguf::from_bytes(w.to_bytes()).unwrap();
    let keys: Vec<&str> = g.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["a", "b"]);
    assert_eq!(g.get_str("a"), Some("one"));
}

#[test]
fn add_tensor_rejects_what_the_reader_would() {
    let mut w = GgufWriter::new();
    w.add_tensor("ok", &[32], GgmlType::Q8_0, vec![0; 34])
        .unwrap();
    let cases: Vec<(&str, Vec<u64>, GgmlType, usize, &str)> = vec![
        ("ok", vec![32], GgmlType::Q8_0, 34, "already added"),
        ("short", vec![32], GgmlType::Q8_0, 33, "need 34"),
        ("long", vec![4, 2], GgmlType::F32, 33, "need 32"),
        ("nodims", vec![], GgmlType::F32, 0, "0 dimensions"),
        ("fivedims", vec![1; 5], GgmlType::F32, 4, "5 dimensions"),
        ("zero", vec![4, 0], GgmlType::F32, 0, "dimension 1 is 0"),
        ("partial", vec![100], GgmlType::Q4K, 144, "block size 256"),
        ("huge", vec![u64::MAX, 2], GgmlType::F32, 0, "representable"),
    ];
    for (name, dims, ty, len, msg) in cases {
        match w.add_tensor(name, &dims, ty, vec![0; len]) {
            Err(e @ GgufError::InvalidTensor { .. }) => {
                let s = e.to_string();
                assert!(s.contains(name) && s.contains(msg), "{name}: {s}");
            }
            other => panic!("{name}: expected InvalidTensor, got {other:?}"),
        }
    }
    assert_eq!(Gguf::from_bytes(w.to_bytes()).unwrap().tensors.len(), 1);
}

#[test]
fn write_rejects_mixed_arrays_and_deep_nesting_before_writing() {
    let mixed = Value::Array(vec![Value::U32(1), Value::I32(2)]);
    let mixed_inner = Value::Array(vec![Value::Array(vec![
        Value::U8(1),
        Value::String("x".into()),
    ])]);
    let scalar_and_array = Value::Array(vec![Value::U8(1), Value::Array(vec![])]);
    let mut deep = Value::Array(vec![Value::U8(1)]);
    for _ in 0..8 {
        deep = Value::Array(vec![deep]);
    }
    for (value, msg) in [
        (mixed, "element 1 has type 5"),
        (mixed_inner, "element 1 has type 8"),
        (scalar_and_array, "element 1 has type 9"),
        (deep, "nested 9 deep"),
    ] {
        let mut w = GgufWriter::new();
        w.add_kv("bad", value);
        let mut out = Vec::new();
        let err = w.write_to(&mut out).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
        assert!(
            err.to_string().contains(msg) && err.to_string().contains("\"bad\""),
            "{err}"
        );
        assert!(out.is_empty());
    }

    // Eight levels is the limit and still fine.
    let mut deep = Value::Array(vec![Value::U8(1)]);
    for _ in 0..7 {
        deep = Value::Array(vec![deep]);
    }
    let mut w = GgufWriter::new();
    w.add_kv("deep", deep.clone());
    let g = Gguf::from_bytes(w.to_bytes()).unwrap();
    assert_eq!(g.get("deep"), Some(&deep));
}

#[test]
#[should_panic(expected = "must share one type")]
fn to_bytes_panics_on_unencodable_metadata() {
    let mut w = GgufWriter::new();
    w.add_kv("bad", Value::Array(vec![Value::F32(1.0), Value::F64(1.0)]));
    w.to_bytes();
}

#[test]
fn write_file_is_atomic_and_leaves_no_temp_files() {
    let dir = std::env::temp_dir().join(format!("infer-gguf-write-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");

    let w = build_writer();
    w.write_file(&path).unwrap();
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.tensors.len(), all_tensors().len());
    assert_eq!(std::fs::read(&path).unwrap(), w.to_bytes());

    // A failing write leaves the old file in place (and the open map valid) and no temp file.
    let mut bad = GgufWriter::new();
    bad.add_kv("bad", Value::Array(vec![Value::U8(1), Value::I8(1)]));
    assert!(bad.write_file(&path).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), w.to_bytes());

    // Replacing the file while it is mapped does not disturb the open reader.
    let mut small = GgufWriter::new();
    small.add_kv("general.name", Value::String("replaced".into()));
    small.write_file(&path).unwrap();
    let t = g.tensor("f32.vec").unwrap();
    assert_eq!(
        g.tensor_data(t),
        &f32_bytes(&[1.0, -2.0, 3.5, 0.0, 1e-3])[..]
    );
    assert_eq!(
        Gguf::open(&path).unwrap().get_str("general.name"),
        Some("replaced")
    );

    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["model.gguf"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn open_missing_file_names_the_path() {
    let path = Path::new("/nonexistent/dir/missing.gguf");
    match Gguf::open(path) {
        Err(e @ GgufError::Io { .. }) => assert!(
            e.to_string().contains("/nonexistent/dir/missing.gguf"),
            "{e}"
        ),
        other => panic!("expected Io, got {other:?}"),
    }
}

/// A file written by gguf-py's `GGUFWriter` (see `make_py_fixture.py`) reads back with its values.
#[test]
fn reads_file_written_by_gguf_py() {
    let g = Gguf::open(&fixture("gguf_py_written.bin")).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.file_size(), 992);
    assert_eq!(g.data_offset(), 800);
    assert_eq!(g.metadata().len(), 18);
    assert_eq!(g.architecture(), Some("testarch"));
    use Value::*;
    let expected = [
        ("t.u8", U8(200)),
        ("t.i8", I8(-100)),
        ("t.u16", U16(60000)),
        ("t.i16", I16(-30000)),
        ("t.u32", U32(4_000_000_000)),
        ("t.i32", I32(-2_000_000_000)),
        ("t.f32", F32(0.15625)),
        ("t.bool", Bool(true)),
        ("t.str", String("héllo, wörld".into())),
        ("t.u64", U64(18_000_000_000_000_000_000)),
        ("t.i64", I64(-9_000_000_000_000_000_000)),
        ("t.f64", F64(-2.5e-300)),
        ("t.arr_i32", Array(vec![I32(1), I32(-2), I32(3)])),
        (
            "t.arr_str",
            Array(vec![
                String("a".into()),
                String("".into()),
                String("ccc".into()),
            ]),
        ),
        ("t.arr_f32", Array(vec![F32(0.5), F32(-1.25)])),
        (
            "t.arr_nested",
            Array(vec![Array(vec![I32(1), I32(2)]), Array(vec![I32(3)])]),
        ),
        ("t.arr_u8", Array(vec![U8(7), U8(8), U8(9)])),
    ];
    for (i, (k, v)) in expected.iter().enumerate() {
        assert_eq!(&g.metadata()[i + 1].0, k);
        assert_eq!(g.get(k), Some(v), "{k}");
    }

    let expect = [
        (
            "f32.weight",
            vec![3, 2],
            GgmlType::F32,
            0,
            24,
            "000000000000003f0000803f0000c03f",
        ),
        (
            "f16.weight",
            vec![4],
            GgmlType::F16,
            32,
            8,
            "003c00c00038ff7b",
        ),
        (
            "q8.weight",
            vec![32, 2],
            GgmlType::Q8_0,
            64,
            68,
            "000102030405060708090a0b0c0d0e0f",
        ),
        (
            "i32.idx",
            vec![3],
            GgmlType::I32,
            160,
            12,
            "07000000f9ffffff40e20100",
        ),
    ];
    assert_eq!(g.tensors.len(), expect.len());
    for (t, (name, dims, ty, offset, size, head)) in g.tensors.iter().zip(expect) {
        assert_eq!(
            (t.name.as_str(), &t.dims, t.ty, t.offset, t.size_bytes),
            (name, &dims, ty, offset, size)
        );
        let data = g.tensor_data(t);
        let hex: std::string::String = data.iter().take(16).map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, head, "{name}");
    }
    let q8 = g.tensor_data(g.tensor("q8.weight").unwrap());
    assert_eq!(q8, (0..68).map(|i| i as u8).collect::<Vec<u8>>());
    let f32w = g.tensor_data(g.tensor("f32.weight").unwrap());
    let vals: Vec<f32> = f32w
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(vals, [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
}

/// The writer's output for a fixed input is stable: it equals the committed golden file, which
/// gguf-py reads (checked when it was generated). `INFER_BLESS=1` regenerates it.
#[test]
fn writer_output_matches_golden_file() {
    let bytes = build_writer().to_bytes();
    let path = fixture("infer_written.bin");
    if std::env::var_os("INFER_BLESS").is_some() {
        std::fs::write(&path, &bytes).unwrap();
    }
    let golden = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(bytes.len(), golden.len());
    assert!(
        bytes == golden,
        "writer output differs from {}",
        path.display()
    );
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.tensors.len(), 9);
    assert_eq!(g.metadata().len(), 30);
}

/// A `Gguf` (and the writer) can be shared across threads, e.g. by a model holding borrowed weights.
#[test]
fn reader_and_writer_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Gguf>();
    assert_send_sync::<GgufWriter>();
    assert_send_sync::<GgufError>();
}
