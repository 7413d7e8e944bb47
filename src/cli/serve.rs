//! `infer serve`: the command line of the OpenAI-compatible server ([`infer::server`]). It
//! resolves the model, reads the API key, warns about exposing an unauthenticated server, and
//! hands the library a loader that prints as `infer run` does.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use clap::Args;

use crate::cli::args::{ModelArgs, SamplingArgs};
use crate::cli::{note, UsageError};
use infer::engine::request::LookupSpec;
use infer::engine::scheduler::Reuse;
use infer::server::params::Defaults;
use infer::server::{serve as run_server, ServeConfig};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (loopback by default; anything else should have an API key)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start)
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests computed at once (continuous batching); more wait in a queue
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=256))]
    pub parallel: u64,
    /// Requests that may wait beyond --parallel before new ones get 429 (Retry-After)
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub queue: usize,
    /// Context size of one request in tokens, prompt and answer (default: 4096, at most the
    /// model's training context)
    #[arg(short, long)]
    pub ctx: Option<usize>,
    /// KV cache positions shared by all requests (default: --parallel × --ctx); smaller pools
    /// preempt and recompute requests under pressure instead of failing
    #[arg(long, value_name = "TOKENS")]
    pub kv_size: Option<usize>,
    /// Require `Authorization: Bearer KEY` on every endpoint but / and /health
    #[arg(long, value_name = "KEY", conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key(s) from a file, one per line
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// The model's name in the API (default: the file name without .gguf)
    #[arg(long, value_name = "NAME")]
    pub alias: Option<String>,
    /// Prompt-lookup speculation: draft from n-grams up to N tokens long, verified in the batch
    /// (output unchanged; fastest on code edits and quoting)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub lookup: usize,
    /// Largest draft of --lookup
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub draft_max: usize,
    /// Default answer length of requests that give no max_tokens (default: up to the context)
    #[arg(short = 'n', long = "max-tokens")]
    pub max_tokens: Option<usize>,
    /// Largest request body in bytes (then 413)
    #[arg(long, value_name = "BYTES", default_value_t = 8 << 20)]
    pub body_limit: usize,
    /// How requests reuse the prefix cache: `exact` only where the output stays what the request
    /// gives alone (prompts computed in block-sized chunks: slower prompts, reproducible
    /// answers), `most` wherever it is cached (llama.cpp's chunks: a cache hit can change the
    /// last bits of the logits, and so a sampled token)
    #[arg(long, value_enum, default_value_t = CacheReuse::Exact)]
    pub cache_reuse: CacheReuse,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheReuse {
    Exact,
    Most,
}

fn api_keys(a: &ServeArgs) -> Result<Vec<String>> {
    if let Some(k) = &a.api_key {
        if k.trim().is_empty() {
            return Err(UsageError("--api-key must not be empty".into()).into());
        }
        return Ok(vec![k.trim().to_string()]);
    }
    let Some(path) = &a.api_key_file else {
        return Ok(Vec::new());
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        UsageError(format!(
            "--api-key-file: cannot read {}: {e}",
            path.display()
        ))
    })?;
    let keys: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_string)
        .collect();
    if keys.is_empty() {
        return Err(UsageError(format!("--api-key-file: {} holds no key", path.display())).into());
    }
    Ok(keys)
}

fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let keys = api_keys(&a)?;
    if !is_loopback(&a.host) && keys.is_empty() {
        note!(
            "infer: warning: listening on {} without an API key: anyone who can reach this \
             machine can use the model (set --api-key or --api-key-file)",
            a.host
        );
    }
    let sampler = a.sampling.config()?;
    let path = crate::cli::models::resolve(&a.model.model)?;
    let stem = path
        .file_name()
        .map(|f| f.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".into());
    let given = a.model.model.to_string_lossy().to_string();
    let model_id = a.alias.clone().unwrap_or_else(|| stem.clone());
    let aliases = [stem, given, path.to_string_lossy().to_string()]
        .into_iter()
        .filter(|n| *n != model_id)
        .collect();
    let parallel = a.parallel as usize;
    let ctx = a.ctx;
    // KV for `n_seq` whole contexts: --kv-size rounded up to whole contexts.
    let n_ctx_guess = ctx.unwrap_or(infer::engine::load::DEFAULT_CTX);
    let n_seq = match a.kv_size {
        Some(0) => return Err(UsageError("--kv-size must be at least 1".into()).into()),
        Some(kv) => kv.div_ceil(n_ctx_guess).max(1),
        None => parallel,
    };
    let cfg = ServeConfig {
        host: a.host.clone(),
        port: a.port,
        api_keys: keys,
        model_id,
        model_aliases: aliases,
        parallel,
        queue: a.queue,
        body_limit: a.body_limit,
        defaults: Defaults {
            sampler,
            dry: a.sampling.dry_params(),
            seed: a.sampling.seed,
            max_tokens: a.max_tokens,
        },
        lookup: (a.lookup > 0).then_some(LookupSpec {
            ngram: a.lookup,
            draft_max: a.draft_max,
        }),
        reuse: match a.cache_reuse {
            CacheReuse::Exact => Reuse::Exact,
            CacheReuse::Most => Reuse::Most,
        },
    };
    let model = a.model.clone();
    let load = Box::new(move || {
        let l = crate::cli::load::load_for(&model, ctx, n_seq)?;
        note!(
            "infer: loaded {} in {:.2} s ({} threads, context {}, KV for {} positions)",
            model.model.display(),
            l.load_secs,
            l.threads,
            l.runner.n_ctx(),
            l.runner.pool().n_blocks() * l.runner.pool().block_size()
        );
        Ok(l)
    });
    let log: infer::server::Log = Arc::new(|m: &str| note!("infer: {m}"));
    run_server(cfg, load, log)
}
