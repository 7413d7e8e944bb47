//! The GGUF reader on arbitrary bytes: it must return a value or an error, never panic, hang or
//! allocate without bound; for a file it accepts, every metadata value and every tensor's data
//! range is read.
#![no_main]

use infer::format::Gguf;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::from_bytes(data.to_vec()) else {
        return;
    };
    let mut n = 0usize;
    for (k, v) in g.metadata() {
        n += k.len() + v.type_id() as usize;
        if let Some(a) = v.as_array() {
            n += a.len();
        }
    }
    for t in &g.tensors {
        let d = g.tensor_data(t);
        n += d.first().copied().unwrap_or(0) as usize + d.last().copied().unwrap_or(0) as usize;
        n += t.n_elements() as usize + t.row_len() + t.n_rows();
    }
    std::hint::black_box(n);
});
