//! `infer serve`: an OpenAI-compatible HTTP server on the batching engine. The HTTP side (tokio
//! and axum, in `routes`) parses and checks requests, renders chat prompts and streams answers;
//! the engine thread (`engine`) owns the model and the scheduler and runs the step loop. They
//! meet only through channels, so neither ever waits on the other.
//!
//! Life of the process: bind (an error names the address), serve `/health` as 503 while the
//! model loads on the engine thread, then serve everything; SIGINT/SIGTERM stops accepting,
//! cancels the requests in flight (each stream gets its final chunk and `[DONE]`), and returns
//! once the connections are closed (at most [`DRAIN_SECS`] later).
//!
//! Invariants: a handler never panics on input and never leaves a connection hanging (every
//! request gets a response or a stream that ends); every request accepted counts in
//! `in_flight` until its [`respond::Ticket`] drops.

pub mod engine;
pub mod error;
pub mod metrics;
pub mod params;
pub mod respond;
mod routes;
pub mod tools;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{Context, Result};

use crate::chat::PromptFormat;
use crate::engine::constraint::{Constraint, ConstraintSpec, Grammars};
use crate::engine::dry::DryBreakers;
use crate::engine::load::Loaded;
use crate::engine::request::LookupSpec;
use crate::engine::scheduler::{Reuse, SchedulerConfig};
use crate::server::engine::{Command, EngineHandle};
use crate::server::params::Defaults;
use crate::tokenizer::Tokenizer;

/// Seconds the server waits for streams to end after a stop signal.
pub const DRAIN_SECS: u64 = 10;

/// How to serve.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Bearer keys accepted (none: no authentication).
    pub api_keys: Vec<String>,
    /// The model's name in the API (`/v1/models`, the `model` field).
    pub model_id: String,
    /// Other names a request's `model` may use for it (the file name, its alias).
    pub model_aliases: Vec<String>,
    /// Requests computed at once.
    pub parallel: usize,
    /// Requests that may wait beyond those (then 429).
    pub queue: usize,
    /// Largest request body, in bytes (then 413).
    pub body_limit: usize,
    pub defaults: Defaults,
    pub lookup: Option<LookupSpec>,
    /// How requests use the prefix cache ([`Reuse::Exact`]: outputs never depend on it).
    pub reuse: Reuse,
}

/// What exists once the model is loaded.
pub struct Ready {
    pub tok: Arc<Tokenizer>,
    pub format: PromptFormat,
    /// The longest a sequence may be (prompt and answer): the context, at most the KV pool.
    pub seq_len: usize,
    pub n_ctx_train: usize,
    pub engine: EngineHandle,
    /// The vocabulary trie constraints compile against (built at the first structured request).
    pub grammars: OnceLock<Result<Grammars, String>>,
    /// The model's output row width.
    pub n_logits: usize,
    /// DRY's breaker set for the server's default breakers (built at the first request that
    /// uses it).
    pub dry_breakers: OnceLock<Arc<DryBreakers>>,
}

impl Ready {
    /// A constraint for one request (every choice clones it).
    pub fn constraint(&self, spec: &ConstraintSpec) -> anyhow::Result<Constraint> {
        let grammars = self.grammars.get_or_init(|| {
            tokio::task::block_in_place(|| {
                Grammars::new(&self.tok, self.n_logits).map_err(|e| format!("{e:#}"))
            })
        });
        let g = grammars.as_ref().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(g.compile(spec)?)
    }

    /// DRY's breaker set for `strings`: the shared one when they are the server's defaults.
    pub fn dry_breakers(&self, strings: &[String], defaults: &[String]) -> Arc<DryBreakers> {
        let build = || tokio::task::block_in_place(|| DryBreakers::of(strings.to_vec(), &self.tok));
        if strings == defaults {
            self.dry_breakers.get_or_init(|| Arc::new(build())).clone()
        } else {
            Arc::new(build())
        }
    }
}

/// Everything the handlers share.
pub struct AppState {
    pub cfg: ServeConfig,
    ready: OnceLock<Ready>,
    pub metrics: metrics::Metrics,
    /// Generation requests (choices) accepted and not yet answered.
    pub in_flight: AtomicUsize,
    pub next_id: AtomicU64,
    pub stopping: AtomicBool,
}

impl AppState {
    /// The loaded model, or 503 while it loads (or once the server stops).
    pub fn ready(&self) -> Result<&Ready, error::ApiError> {
        if self.stopping.load(Ordering::Relaxed) {
            return Err(error::ApiError::unavailable("the server is shutting down"));
        }
        self.ready
            .get()
            .ok_or_else(|| error::ApiError::unavailable("the model is still loading"))
    }

    /// Whether `name` (a request's `model`) names the served model.
    pub fn is_our_model(&self, name: &str) -> bool {
        name == self.cfg.model_id || self.cfg.model_aliases.iter().any(|a| a == name)
    }
}

/// Lines for the operator (stderr, through the CLI).
pub type Log = Arc<dyn Fn(&str) + Send + Sync>;

/// Serves until a stop signal. `load` runs on the engine thread (which then runs the step loop)
/// and must print its own progress; `log` gets the server's lines (listening, stopping, engine
/// failures). Errors: the address cannot be bound, or the model fails to load.
pub fn serve(
    cfg: ServeConfig,
    load: Box<dyn FnOnce() -> Result<Loaded> + Send>,
    log: Log,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    rt.block_on(serve_async(cfg, load, log))
}

async fn serve_async(
    cfg: ServeConfig,
    load: Box<dyn FnOnce() -> Result<Loaded> + Send>,
    log: Log,
) -> Result<()> {
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| {
            format!("cannot listen on {addr} (is another server using the port? try --port)")
        })?;
    let local: SocketAddr = listener.local_addr()?;
    let (parallel, reuse) = (cfg.parallel, cfg.reuse);
    let state = Arc::new(AppState {
        cfg,
        ready: OnceLock::new(),
        metrics: metrics::Metrics::default(),
        in_flight: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
        stopping: AtomicBool::new(false),
    });
    log(&format!("listening on http://{local} (loading the model)"));

    // The engine thread: load, publish, then run the step loop until shut down.
    let (handle, rx) = engine::channel();
    // A model that fails to load is reported here (a dropped sender: it loaded).
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    let engine_thread = {
        let state = state.clone();
        let handle = handle.clone();
        let log = log.clone();
        std::thread::Builder::new()
            .name("infer-engine".into())
            .spawn(move || {
                let started = load().and_then(|l| {
                    let format = PromptFormat::from_model(&l.gguf, &l.tokenizer)?;
                    Ok((l, format))
                });
                let (
                    Loaded {
                        tokenizer,
                        mut runner,
                        ..
                    },
                    format,
                ) = match started {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = failed_tx.send(e);
                        return;
                    }
                };
                drop(failed_tx);
                let pool = runner.pool();
                let seq_len = runner.n_ctx().min(pool.n_blocks() * pool.block_size());
                let n_ctx_train = runner.model.cfg.n_ctx_train;
                let tok = Arc::new(tokenizer);
                let _ = state.ready.set(Ready {
                    tok: tok.clone(),
                    format,
                    seq_len,
                    n_ctx_train,
                    engine: handle.clone(),
                    grammars: OnceLock::new(),
                    n_logits: runner.vocab_size(),
                    dry_breakers: OnceLock::new(),
                });
                log(&format!(
                    "ready: http://{local}/ (chat page), http://{local}/v1"
                ));
                let cfg = SchedulerConfig {
                    max_running: parallel,
                    reuse,
                    ..SchedulerConfig::default()
                };
                engine::run(&mut runner, &tok, cfg, &handle, rx, &|m| log(m));
            })
            .context("starting the engine thread")?
    };

    let app = routes::router(state.clone());
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let server = axum::serve(listener, app).with_graceful_shutdown(async {
        let _ = shutdown_rx.await;
    });
    let server = tokio::spawn(async move { server.await });
    // Until a stop signal, or the model failing to load.
    let failed = tokio::select! {
        why = signal() => {
            log(&format!("{why}: stopping (ending the requests in flight)"));
            state.stopping.store(true, Ordering::Relaxed);
            handle.send(Command::Shutdown);
            None
        }
        Ok(e) = failed_rx => Some(e),
    };
    let _ = shutdown_tx.send(());
    // Streams end once the engine has cancelled their requests; do not wait forever.
    let drained = tokio::time::timeout(std::time::Duration::from_secs(DRAIN_SECS), server).await;
    if drained.is_err() {
        log(&format!(
            "connections still open after {DRAIN_SECS} s: closing them"
        ));
    }
    drop(handle);
    drop(state);
    if let Some(e) = failed {
        return Err(e).context("loading the model");
    }
    let _ = tokio::task::spawn_blocking(move || engine_thread.join()).await;
    Ok(())
}

/// Waits for SIGINT (Ctrl-C) or SIGTERM; says which.
async fn signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
                return "interrupted";
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => "interrupted",
            _ = term.recv() => "terminated",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "interrupted"
    }
}
