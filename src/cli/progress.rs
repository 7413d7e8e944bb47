//! Progress on stderr for a person watching: a spinner while a model loads, a bar while a long
//! prompt is prefilled, a bar over the requests of a batch. Drawn only when stderr is a terminal
//! and `--quiet` is off (never into a pipe or a log file), and cleared when done or dropped, so
//! that nothing of it stays between the lines of the output.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};

/// Prompts of at least this many uncached tokens get a prefill bar.
pub const PREFILL_BAR_MIN: usize = 256;

/// Whether progress may be drawn: stderr is a terminal and `--quiet` is off.
pub fn enabled() -> bool {
    !crate::cli::quiet() && std::io::stderr().is_terminal()
}

fn bar(len: Option<u64>, template: &str, msg: String) -> Option<ProgressBar> {
    if !enabled() {
        return None;
    }
    let pb = match len {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::new_spinner(),
    }
    .with_finish(ProgressFinish::AndClear);
    if let Ok(style) = ProgressStyle::with_template(template) {
        pb.set_style(style);
    }
    pb.set_message(msg);
    pb.enable_steady_tick(Duration::from_millis(100));
    Some(pb)
}

/// A spinner with `msg` and the elapsed time, e.g. while a model loads.
pub fn spinner(msg: String) -> Option<ProgressBar> {
    bar(None, "infer: {spinner} {msg} ({elapsed})", msg)
}

/// A bar over `total` prompt tokens, or `None` for short prompts.
pub fn prefill(total: usize) -> Option<ProgressBar> {
    if total < PREFILL_BAR_MIN {
        return None;
    }
    bar(
        Some(total as u64),
        "infer: {spinner} {msg} [{bar:30}] {pos}/{len} tokens ({elapsed})",
        "prefill".into(),
    )
}

/// A bar over `total` bytes (a download, a file being verified).
pub fn bytes(total: u64, msg: String) -> Option<ProgressBar> {
    bar(
        Some(total),
        "infer: {spinner} {msg} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
        msg,
    )
}

/// A bar over the `total` requests of a batch.
pub fn requests(total: usize) -> Option<ProgressBar> {
    bar(
        Some(total as u64),
        "infer: {spinner} {msg} [{bar:30}] {pos}/{len} requests ({elapsed}, eta {eta})",
        "batch".into(),
    )
}

/// A bar over `total` units named `unit` (windows, chunks), with a message for running figures.
pub fn bar_over(total: usize, unit: &str) -> Option<ProgressBar> {
    bar(
        Some(total as u64),
        &format!("infer: {{spinner}} [{{bar:30}}] {{pos}}/{{len}} {unit} {{msg}} ({{elapsed}}, eta {{eta}})"),
        String::new(),
    )
}

/// Runs `f` under a spinner saying `msg` (cleared afterwards).
pub fn with_spinner<T>(msg: String, f: impl FnOnce() -> T) -> T {
    let pb = spinner(msg);
    let out = f();
    if let Some(pb) = pb {
        pb.finish_and_clear();
    }
    out
}
