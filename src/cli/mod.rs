//! Command-line interface: clap definitions and the subcommands. The CLI is a client of the engine:
//! it resolves models, reads prompts, and prints; results go to stdout, diagnostics to stderr.

mod args;
mod batch;
mod bench;
mod bench_concurrency;
mod bench_structured;
mod chat;
mod constraint;
mod imatrix;
mod load;
mod models;
mod perplexity;
mod progress;
mod pull;
mod quantize;
mod run;
mod selftest;
mod serve;
mod synth;
mod tokenize;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Parser;

pub use args::{Cli, Command, DeviceFlags};

/// An error that is the user's to fix in the invocation (exit code 2).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

static QUIET: AtomicBool = AtomicBool::new(false);

/// True under `--quiet`: stderr carries errors only (no notes, warnings or progress).
pub fn quiet() -> bool {
    QUIET.load(Ordering::Relaxed)
}

/// `eprintln!` for everything on stderr that is not an error: silent under `--quiet`.
macro_rules! note {
    ($($arg:tt)*) => {
        if !$crate::cli::quiet() {
            eprintln!($($arg)*);
        }
    };
}
pub(crate) use note;

/// True when the error chain holds a broken pipe (stdout closed by the reader).
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

pub fn main() -> ExitCode {
    infer::trace::mark("main");
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            // clap prints help/version to stdout with exit 0, usage errors to stderr with 2
            let _ = e.print();
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    QUIET.store(cli.quiet, Ordering::Relaxed);
    let device = DeviceFlags {
        device: cli.device,
        gpu_layers: cli.gpu_layers,
    };
    let mut command = cli.command;
    match &mut command {
        Command::Run(a) => a.model.device = device,
        Command::Chat(a) => a.model.device = device,
        Command::Serve(a) => a.model.device = device,
        Command::Bench(a) => a.model.device = device,
        Command::Perplexity(a) => a.model.device = device,
        _ => {}
    }
    let result = match command {
        Command::Run(a) if a.batch_file.is_some() => batch::batch(a),
        Command::Run(a) => run::run(a),
        Command::Tokenize(a) => tokenize::tokenize(a),
        Command::Chat(a) => chat::chat(a),
        Command::Serve(a) => serve::serve(a),
        Command::Bench(a) => bench::bench(a),
        Command::Models => models::list(),
        Command::Pull(a) => pull::pull(&a.aliases, a.all),
        Command::Rm(a) => models::remove(&a.aliases),
        Command::Quantize(a) => quantize::quantize(a),
        Command::Selftest(a) => selftest::selftest(a),
        Command::Perplexity(a) => perplexity::perplexity(a),
        Command::Imatrix(a) => imatrix::imatrix(a),
        Command::Synth(a) => synth::synth(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("infer: {e:#}");
            if e.downcast_ref::<UsageError>().is_some()
                || e.downcast_ref::<infer::engine::load::CacheTypeError>()
                    .is_some()
            {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
