//! `/metrics`: counters and latency histograms kept by the HTTP side, and the engine's gauges
//! (queue, running sequences, KV blocks, prefix cache) from its last [`Snapshot`], written in
//! Prometheus' text format (version 0.0.4). All names start with `infer_`.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use crate::server::engine::Snapshot;

/// Upper bounds (seconds) of the time-to-first-token histogram's buckets.
const TTFT_BUCKETS: [f64; 11] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0];
/// Upper bounds (seconds) of the inter-token latency histogram's buckets.
const ITL_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5,
];

#[derive(Default)]
struct Histogram {
    /// Counts per bucket (not cumulative; the last is +Inf).
    counts: Vec<u64>,
    sum: f64,
    n: u64,
}

impl Histogram {
    fn observe(&mut self, bounds: &[f64], x: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; bounds.len() + 1];
        }
        let i = bounds.iter().position(|&b| x <= b).unwrap_or(bounds.len());
        self.counts[i] += 1;
        self.sum += x;
        self.n += 1;
    }

    fn write(&self, out: &mut String, name: &str, help: &str, bounds: &[f64]) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, b) in bounds.iter().enumerate() {
            cum += self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.n);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.n);
    }
}

#[derive(Default)]
struct Inner {
    /// Requests answered, by (endpoint, HTTP status).
    requests: BTreeMap<(String, u16), u64>,
    prompt_tokens: u64,
    generated_tokens: u64,
    ttft: Histogram,
    itl: Histogram,
}

#[derive(Default)]
pub struct Metrics(Mutex<Inner>);

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn request(&self, endpoint: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    pub fn tokens(&self, prompt: usize, generated: usize) {
        let mut m = self.lock();
        m.prompt_tokens += prompt as u64;
        m.generated_tokens += generated as u64;
    }

    pub fn ttft(&self, secs: f64) {
        self.lock().ttft.observe(&TTFT_BUCKETS, secs);
    }

    pub fn itl(&self, secs: f64) {
        self.lock().itl.observe(&ITL_BUCKETS, secs);
    }

    /// The whole exposition, with the engine's gauges from `s` and `in_flight` requests.
    pub fn render(&self, s: &Snapshot, in_flight: usize) -> String {
        let m = self.lock();
        let mut out = String::new();
        let seen = s.reused_tokens + s.computed_tokens;
        let hit_rate = if seen == 0 {
            0.0
        } else {
            s.reused_tokens as f64 / seen as f64
        };
        let free = s.kv_blocks_total - s.kv_blocks_used.min(s.kv_blocks_total);
        // (name, type, help, value)
        let simple: [(&str, &str, &str, String); 17] = [
            (
                "infer_prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests.",
                m.prompt_tokens.to_string(),
            ),
            (
                "infer_generated_tokens_total",
                "counter",
                "Tokens generated.",
                m.generated_tokens.to_string(),
            ),
            (
                "infer_requests_in_flight",
                "gauge",
                "Generation requests accepted and not yet answered.",
                in_flight.to_string(),
            ),
            (
                "infer_queue_length",
                "gauge",
                "Requests waiting for a running slot.",
                s.waiting.to_string(),
            ),
            (
                "infer_running_sequences",
                "gauge",
                "Sequences being computed.",
                s.running.to_string(),
            ),
            (
                "infer_kv_blocks_total",
                "gauge",
                "KV cache blocks in the pool.",
                s.kv_blocks_total.to_string(),
            ),
            (
                "infer_kv_blocks_used",
                "gauge",
                "KV cache blocks held by sequences.",
                s.kv_blocks_used.to_string(),
            ),
            (
                "infer_kv_blocks_free",
                "gauge",
                "KV cache blocks not held by a sequence (free, or kept only for the prefix cache).",
                free.to_string(),
            ),
            (
                "infer_kv_blocks_cached",
                "gauge",
                "Free KV cache blocks still holding a cached prefix.",
                s.kv_blocks_cached.to_string(),
            ),
            (
                "infer_prefix_cache_reused_tokens_total",
                "counter",
                "Prompt tokens found in the prefix cache.",
                s.reused_tokens.to_string(),
            ),
            (
                "infer_prefix_cache_computed_tokens_total",
                "counter",
                "Prompt tokens computed.",
                s.computed_tokens.to_string(),
            ),
            (
                "infer_prefix_cache_hit_rate",
                "gauge",
                "Share of prompt tokens found in the prefix cache.",
                format!("{hit_rate:.6}"),
            ),
            (
                "infer_preemptions_total",
                "counter",
                "Sequences preempted under KV pressure (and later recomputed).",
                s.preemptions.to_string(),
            ),
            (
                "infer_engine_steps_total",
                "counter",
                "Batched forward steps.",
                s.steps.to_string(),
            ),
            (
                "infer_lookup_drafted_tokens_total",
                "counter",
                "Prompt-lookup draft tokens verified (--lookup).",
                s.drafted.to_string(),
            ),
            (
                "infer_lookup_accepted_tokens_total",
                "counter",
                "Prompt-lookup draft tokens kept.",
                s.accepted.to_string(),
            ),
            (
                "infer_kv_evicted_blocks_total",
                "counter",
                "Cached KV blocks evicted to make room.",
                s.evicted_blocks.to_string(),
            ),
        ];
        for (name, ty, help, v) in simple {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {ty}\n{name} {v}");
        }
        let _ = writeln!(
            out,
            "# HELP infer_requests_total Requests answered, by endpoint and HTTP status.\n\
             # TYPE infer_requests_total counter"
        );
        for ((ep, status), n) in &m.requests {
            let _ = writeln!(
                out,
                "infer_requests_total{{endpoint=\"{ep}\",status=\"{status}\"}} {n}"
            );
        }
        m.ttft.write(
            &mut out,
            "infer_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            &TTFT_BUCKETS,
        );
        m.itl.write(
            &mut out,
            "infer_inter_token_latency_seconds",
            "Time between a request's successive generated tokens.",
            &ITL_BUCKETS,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        for x in [0.004, 0.02, 0.02, 3.0] {
            m.itl(x);
        }
        let text = m.render(&Snapshot::default(), 0);
        assert!(text.contains("infer_inter_token_latency_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("infer_inter_token_latency_seconds_bucket{le=\"0.025\"} 3\n"));
        assert!(text.contains("infer_inter_token_latency_seconds_bucket{le=\"2.5\"} 3\n"));
        assert!(text.contains("infer_inter_token_latency_seconds_bucket{le=\"+Inf\"} 4\n"));
        assert!(text.contains("infer_inter_token_latency_seconds_count 4\n"));
    }
}
