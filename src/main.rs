//! The `infer` command: parses arguments, runs a subcommand, and maps the outcome to an exit code
//! (0 success, 1 runtime error, 2 usage error). Errors go to stderr prefixed `infer: ` with their
//! context chain; a closed stdout (`infer run ... | head`) ends quietly with 0.

mod cli;

use std::process::ExitCode;

fn main() -> ExitCode {
    cli::main()
}
