//! `infer quantize`: convert a Hugging Face checkpoint to GGUF (`--from-hf DIR`) or re-quantize a
//! GGUF file (`--in FILE`), writing `--out` atomically. The work lives in `infer::convert`; this
//! file checks the invocation and reports what was written (on stderr; nothing goes to stdout).

use anyhow::{Context, Result};

use crate::cli::args::QuantizeArgs;
use crate::cli::UsageError;
use infer::convert::{self, Options, Target};
use infer::eval::imatrix::Imatrix;
use infer::kernels::cpu::threads::pool::physical_cores;

pub fn quantize(a: QuantizeArgs) -> Result<()> {
    let target = Target::parse(&a.ty).map_err(|e| UsageError(e.to_string()))?;
    let threads = match a.threads {
        Some(0) => return Err(UsageError("-t/--threads must be at least 1".into()).into()),
        Some(n) => n,
        None => physical_cores(),
    };
    let imatrix = match &a.imatrix {
        Some(p) if !p.is_file() => {
            return Err(UsageError(format!("--imatrix {} does not exist", p.display())).into())
        }
        Some(p) => Some(std::sync::Arc::new(Imatrix::load(p)?)),
        None => None,
    };
    let opts = Options {
        target,
        threads,
        imatrix: imatrix.clone(),
    };
    let (source, report) = match (&a.from_hf, &a.input) {
        (Some(dir), None) => {
            if !dir.is_dir() {
                return Err(UsageError(format!("{} is not a directory", dir.display())).into());
            }
            let r = convert::convert_hf(dir, &a.out, &opts)
                .with_context(|| format!("converting {}", dir.display()))?;
            (dir, r)
        }
        (None, Some(file)) => {
            if !file.is_file() {
                return Err(UsageError(format!("{} does not exist", file.display())).into());
            }
            let r = convert::requantize(file, &a.out, &opts)
                .with_context(|| format!("re-quantizing {}", file.display()))?;
            (file, r)
        }
        _ => {
            return Err(UsageError("give exactly one of --from-hf DIR and --in FILE".into()).into())
        }
    };
    let s = &report.summary;
    crate::cli::note!(
        "infer: {} → {} ({target}): {} tensors, {:.2} MiB, {:.2} bits/weight, {:.2} s [{}]",
        source.display(),
        a.out.display(),
        s.n_tensors,
        s.bytes_out as f64 / (1024.0 * 1024.0),
        s.bytes_out as f64 * 8.0 / (s.n_elements.max(1) as f64),
        s.seconds,
        report.type_counts()
    );
    if let Some(m) = &imatrix {
        crate::cli::note!(
            "infer: {} tensors quantized with the importance matrix ({} entries, {} chunks of {})",
            s.with_imatrix,
            m.entries.len(),
            m.chunks,
            if m.dataset.is_empty() {
                "?"
            } else {
                &m.dataset
            }
        );
    }
    Ok(())
}
