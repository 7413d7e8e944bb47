//! `infer serve`'s request parsing on arbitrary bodies: parsing, the chat messages' checks and the
//! sampling settings answer a value or an `ApiError` (a 4xx), never panic.
#![no_main]

use infer::server::params::{self, ChatRequest, CompletionRequest, Defaults};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let defaults = Defaults {
        sampler: Default::default(),
        seed: Some(1),
        max_tokens: None,
    };
    if let Ok(r) = params::parse::<ChatRequest>(data) {
        let _ = params::check_chat_support(&r);
        if let Some(m) = &r.messages {
            let _ = params::template_messages(m);
        }
        let _ = r.sampling.settings(&defaults, data.len() % 300, 256, &[]);
    }
    if let Ok(r) = params::parse::<CompletionRequest>(data) {
        let _ = r
            .sampling
            .settings(&defaults, 1, 4096, &["</s>".to_string()]);
    }
});
