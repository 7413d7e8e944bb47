//! Model aliases: `models.toml` (compiled into the binary) names the known models; `--model ALIAS`
//! resolves to the file under `$INFER_MODELS`, `./models` or the source tree's `models/`, and
//! `infer models` lists them with whether each is present. A path that exists always wins over an alias.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Deserialize;

use crate::cli::UsageError;

const MODELS_TOML: &str = include_str!("../../models.toml");

#[derive(Deserialize, Debug)]
pub struct KnownModel {
    pub alias: String,
    pub file: String,
    pub arch: String,
    pub bytes: u64,
}

#[derive(Deserialize)]
struct ModelsFile {
    model: Vec<KnownModel>,
}

pub fn known() -> Vec<KnownModel> {
    toml::from_str::<ModelsFile>(MODELS_TOML)
        .expect("models.toml is checked by the tests")
        .model
}

/// Folders searched for model files, in order.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = std::env::var_os("INFER_MODELS") {
        dirs.push(PathBuf::from(d));
    }
    dirs.push(PathBuf::from("models"));
    dirs.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("models"));
    dirs
}

fn find_file(file: &str) -> Option<PathBuf> {
    search_dirs()
        .into_iter()
        .map(|d| d.join(file))
        .find(|p| p.exists())
}

/// Turns `--model` into a file path: an existing path as is, else a known alias (or file name).
pub fn resolve(arg: &Path) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let name = arg.to_string_lossy();
    if let Some(m) = known()
        .into_iter()
        .find(|m| m.alias == name || m.file == name)
    {
        return find_file(&m.file).ok_or_else(|| {
            UsageError(format!(
                "model `{}` ({}) is not downloaded: run scripts/fetch-models.sh {} (looked in {})",
                m.alias,
                m.file,
                m.alias,
                search_dirs()
                    .iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
            .into()
        });
    }
    Err(UsageError(format!(
        "model file {} does not exist and is not a known alias (known: {}; `infer models` lists them, scripts/fetch-models.sh fetches them)",
        arg.display(),
        known().iter().map(|m| m.alias.as_str()).collect::<Vec<_>>().join(", ")
    ))
    .into())
}

/// `infer models`: one line per known model.
pub fn list() -> Result<()> {
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for m in known() {
        let at = find_file(&m.file);
        writeln!(
            out,
            "{:<20} {:<8} {:>7.1} MB  {}",
            m.alias,
            m.arch,
            m.bytes as f64 / 1e6,
            match &at {
                Some(p) => p.display().to_string(),
                None => format!("not downloaded (scripts/fetch-models.sh {})", m.alias),
            }
        )
        .context("writing the model list")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_toml_parses_with_both_models() {
        let k = known();
        assert_eq!(k.len(), 2);
        assert_eq!(k[0].alias, "qwen2.5-coder-1.5b");
        assert_eq!(k[0].bytes, 1_117_320_768);
        assert_eq!(k[1].file, "gemma-3-270m-q4_k_m.gguf");
    }
}
