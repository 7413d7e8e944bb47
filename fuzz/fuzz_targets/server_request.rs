//! `infer serve`'s request parsing on arbitrary bodies: parsing, the chat messages' checks, the
//! `response_format`/`tools` plan (and tool-call parsing of the body's text) and the sampling
//! settings answer a value or an `ApiError` (a 4xx), never panic.
#![no_main]

use std::sync::Arc;

use infer::engine::dry::DryBreakers;
use infer::server::params::{self, ChatRequest, CompletionRequest, Defaults};
use infer::server::tools;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let defaults = Defaults {
        sampler: Default::default(),
        dry: Default::default(),
        seed: Some(1),
        max_tokens: None,
    };
    if let Ok(r) = params::parse::<ChatRequest>(data) {
        if let Ok(plan) = tools::plan(&r) {
            let _ = tools::parse_calls(&String::from_utf8_lossy(data), &plan.names);
        }
        if let Some(m) = &r.messages {
            let _ = params::template_messages(m);
        }
        let _ = r
            .sampling
            .settings(&defaults, data.len() % 300, 256, &[], |b| breakers(b));
    }
    if let Ok(r) = params::parse::<CompletionRequest>(data) {
        let _ = r
            .sampling
            .settings(&defaults, 1, 4096, &["</s>".to_string()], |b| breakers(b));
    }
});

/// A breaker set over a 300-token vocabulary whose token `i`'s text is `i` in decimal.
fn breakers(strings: &[String]) -> Arc<DryBreakers> {
    Arc::new(DryBreakers::new(strings.to_vec(), 300, |id| {
        id.to_string().into_bytes()
    }))
}
