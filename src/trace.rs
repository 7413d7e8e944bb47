//! Start-up phase marks for profiling the path from exec to the first token: with
//! `INFER_TRACE_START=1` in the environment, each [`mark`] prints the milliseconds since the
//! first mark (`main`'s first line) and the phase's name on stderr, and a mark on another thread
//! names its thread. Without it a mark is one relaxed atomic load.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);
static ORIGIN: OnceLock<Instant> = OnceLock::new();

fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var_os("INFER_TRACE_START").is_some_and(|v| v != "0");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        s => s == 2,
    }
}

/// Prints `phase` with the time since the first mark when `INFER_TRACE_START` is set.
pub fn mark(phase: &str) {
    if !enabled() {
        return;
    }
    let origin = *ORIGIN.get_or_init(Instant::now);
    let t = std::thread::current();
    let thread = t.name().filter(|&n| n != "main").unwrap_or("");
    eprintln!(
        "infer-trace: {:8.1} ms  {phase} {thread}",
        origin.elapsed().as_secs_f64() * 1e3
    );
}
