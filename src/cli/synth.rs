//! `infer synth`: synthetic model files with a real model's shapes (see
//! [`infer::convert::synthetic`]), for `scripts/gpu-check.sh` on machines the real files cannot
//! reach. `--skeleton-of REAL -o SKEL` keeps the header and tensor list (a few MiB);
//! `--from SKEL -o OUT` writes a full file with random weights.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::cli::{note, UsageError};
use infer::convert::synthetic;
use infer::format::Gguf;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Write the skeleton of this model file (its metadata and tensor list, no weights)
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "from",
        required_unless_present = "from"
    )]
    pub skeleton_of: Option<PathBuf>,
    /// Expand this skeleton into a full file with random weights
    #[arg(long, value_name = "SKELETON")]
    pub from: Option<PathBuf>,
    /// Output file
    #[arg(short, long, value_name = "FILE")]
    pub out: PathBuf,
    /// Seed of the random weights
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

pub fn synth(a: SynthArgs) -> Result<()> {
    let (input, what) = match (&a.skeleton_of, &a.from) {
        (Some(p), _) => (crate::cli::models::resolve(p)?, "skeleton"),
        (None, Some(p)) => (p.clone(), "synthetic model"),
        (None, None) => return Err(UsageError("give --skeleton-of or --from".into()).into()),
    };
    let g = Gguf::open(&input).with_context(|| format!("reading {}", input.display()))?;
    let w = if a.skeleton_of.is_some() {
        synthetic::skeleton(&g)?
    } else {
        synthetic::expand(&g, a.seed)?
    };
    w.write_file(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    note!("infer: wrote the {what} {}", a.out.display());
    Ok(())
}
