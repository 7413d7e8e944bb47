//! The prompt cache file reader (`infer run --prompt-cache`) on arbitrary bytes: a saved prompt
//! or a refusal, never a panic or an allocation larger than the input; what it accepts encodes
//! back to the same bytes.
#![no_main]

use infer::engine::prompt_cache::{decode, encode, CacheShape};
use infer::model::backend::KvType;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The shape of the seed files (the tiny Qwen2 fixture as q8_0: an f16 cache).
    let shape = CacheShape {
        model: data
            .get(12..20)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap())),
        kv_type: KvType::F16,
        n_layer: 2,
        kv_dim: 32,
        block_size: 32,
    };
    if let Ok(s) = decode(&shape, data) {
        assert_eq!(encode(&shape, &s), data);
    }
});
