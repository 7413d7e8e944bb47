//! The HTTP routes: OpenAI's (`/v1/chat/completions`, `/v1/completions`, `/v1/models`),
//! llama.cpp's helpers (`/tokenize`, `/detokenize`, `/apply-template`), `/health`, `/metrics`
//! and the chat page at `/`. A middleware checks the API key (everything but `/` and `/health`),
//! answers CORS preflights, and counts every response by endpoint and status.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::server::error::ApiError;
use crate::server::params::{self, ChatRequest, CompletionRequest};
use crate::server::respond::{respond, Job, Kind};
use crate::server::tools::{self, ToolMode};
use crate::server::AppState;

type St = State<Arc<AppState>>;

const PAGE: &str = include_str!("page.html");

pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.cfg.body_limit;
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/models/{id}", get(model_one))
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), gate))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// `a == b` in time that depends only on their lengths.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0xff);
        diff |= usize::from(x ^ y);
    }
    diff == 0
}

/// The endpoint's name in `/metrics`.
fn endpoint_label(path: &str) -> &'static str {
    match path.trim_start_matches("/v1") {
        "/chat/completions" => "chat_completions",
        "/completions" => "completions",
        "/models" => "models",
        "/tokenize" => "tokenize",
        "/detokenize" => "detokenize",
        "/apply-template" => "apply_template",
        "/health" => "health",
        "/metrics" => "metrics",
        "/" => "page",
        p if p.starts_with("/models/") => "models",
        _ => "other",
    }
}

/// Authentication, CORS and the request counter around every route.
async fn gate(State(state): St, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let label = endpoint_label(&path);
    let mut resp = if req.method() == Method::OPTIONS {
        StatusCode::NO_CONTENT.into_response()
    } else {
        let open = path == "/" || path == "/health";
        let authorized = open
            || state.cfg.api_keys.is_empty()
            || req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .is_some_and(|k| {
                    // Every key is compared, whatever matches, so timing says nothing.
                    state.cfg.api_keys.iter().fold(false, |ok, key| {
                        same_key(k.trim().as_bytes(), key.as_bytes()) | ok
                    })
                });
        // A body declared larger than the limit is refused before any of it is read, so a
        // client that waits for the answer (`Expect: 100-continue`, or one reading while it
        // sends) gets the 413 instead of a connection closed under a half-sent body.
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if !authorized {
            ApiError::unauthorized().into_response()
        } else if declared.is_some_and(|n| n > state.cfg.body_limit as u64) {
            ApiError::too_large(state.cfg.body_limit).into_response()
        } else {
            next.run(req).await
        }
    };
    state.metrics.request(label, resp.status().as_u16());
    let h = resp.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_ORIGIN,
        HeaderValue::from_static("*"),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_HEADERS,
        HeaderValue::from_static("authorization, content-type"),
    );
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("GET, POST, OPTIONS"),
    );
    resp
}

/// The body's bytes, or 413 past the limit.
fn body(state: &AppState, b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(state.cfg.body_limit)
        } else {
            ApiError::bad_request(format!("cannot read the request body: {e}"))
        }
    })
}

/// The body parsed as `T` (413 past the limit, 400 naming a bad field).
fn read<T: serde::de::DeserializeOwned + Default>(
    state: &AppState,
    b: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    params::parse(&body(state, b)?)
}

/// Token ids from JSON numbers, each checked against the vocabulary.
fn token_ids(
    ready: &crate::server::Ready,
    values: &[Value],
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    let vocab = ready.tok.vocab_size();
    values
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .filter(|&x| (x as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::param(
                        param,
                        format!(
                            "token ids must be integers from 0 to {} (got {v})",
                            vocab - 1
                        ),
                    )
                })
        })
        .collect()
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !m.is_empty() && !state.is_our_model(m) => {
            Err(ApiError::model_not_found(m, &state.cfg.model_id))
        }
        _ => Ok(()),
    }
}

async fn page() -> Html<&'static str> {
    Html(PAGE)
}

async fn health(State(state): St) -> Response {
    match state.ready() {
        Ok(r) if r.engine.is_dead() => {
            ApiError::internal("the engine has failed; restart the server").into_response()
        }
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn metrics(State(state): St) -> Response {
    let snap = state
        .ready()
        .map(|r| r.engine.snapshot())
        .unwrap_or_default();
    let text = state
        .metrics
        .render(&snap, state.in_flight.load(Ordering::Relaxed));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

fn model_object(state: &AppState) -> Value {
    let mut m = json!({
        "id": state.cfg.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "infer",
    });
    if let Some(r) = state.ready.get() {
        m["meta"] = json!({"n_ctx": r.seq_len, "n_ctx_train": r.n_ctx_train, "n_vocab": r.tok.vocab_size()});
    }
    m
}

async fn models(State(state): St) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&state)]}))
}

async fn model_one(State(state): St, Path(id): Path<String>) -> Response {
    if state.is_our_model(&id) {
        Json(model_object(&state)).into_response()
    } else {
        ApiError::model_not_found(&id, &state.cfg.model_id).into_response()
    }
}

async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route {} {} (see /v1/models, /v1/chat/completions, /v1/completions)",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::bad_request(format!(
            "{} is not allowed on {}",
            req.method(),
            req.uri().path()
        ))
    }
}

/// The rendered prompt text of chat messages (and tools).
fn render_chat(
    ready: &crate::server::Ready,
    messages: &[Value],
    tools: Option<&Vec<Value>>,
) -> Result<String, ApiError> {
    let msgs = params::template_messages(messages)?;
    let tools = tools.map(|t| Value::Array(t.clone()));
    ready
        .format
        .render_json(&msgs, tools.as_ref(), true)
        .map_err(|e| ApiError::param("messages", format!("{e:#}")))
}

async fn chat(State(state): St, b: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let r: ChatRequest = read(&state, b)?;
    check_model(&state, r.sampling.model.as_deref())?;
    let ready = state.ready()?;
    let plan = tools::plan(&r)?;
    let Some(messages) = &r.messages else {
        return Err(ApiError::param("messages", "`messages` is required"));
    };
    let text = render_chat(ready, messages, plan.render_tools.as_ref())?;
    let bos = ready.format.wants_bos(&ready.tok, &text, true);
    let prompt = ready
        .tok
        .encode(&text, bos, true)
        .map_err(|e| ApiError::internal(format!("tokenizing the prompt: {e:#}")))?;
    let defaults = &state.cfg.defaults;
    let mut settings = r.sampling.settings(
        defaults,
        prompt.len(),
        ready.seq_len,
        &ready.format.stop_strings(),
        |b| ready.dry_breakers(b, &defaults.dry.breakers),
    )?;
    if let Some(spec) = &plan.constraint {
        let field = if plan.tools == ToolMode::Required {
            "tool_choice"
        } else {
            "response_format"
        };
        let c = ready
            .constraint(spec)
            .map_err(|e| ApiError::param(field, format!("{e:#}")))?;
        for p in &mut settings.params {
            p.constraint = Some(Box::new(c.clone()));
        }
    }
    let logprobs = match (r.logprobs.unwrap_or(false), r.top_logprobs) {
        (_, Some(k)) if k > 20 => {
            return Err(ApiError::param(
                "top_logprobs",
                "`top_logprobs` must be 0 to 20",
            ))
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
        (false, Some(_)) => {
            return Err(ApiError::param(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ))
        }
        (false, None) => None,
    };
    let job = Job {
        kind: Kind::Chat,
        prompt,
        settings,
        logprobs,
        lookup: state.cfg.lookup,
        tools: plan.tools,
        tool_names: plan.names,
    };
    respond(state.clone(), ready, job).await
}

/// A completions `prompt`: text, or token ids (one prompt only).
fn completion_prompt(ready: &crate::server::Ready, p: &Value) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::param(
            "prompt",
            "`prompt` must be a string or an array of token ids (one prompt per request)",
        )
    };
    let text = |s: &str| {
        ready
            .tok
            .encode(s, ready.tok.add_bos_default(), true)
            .map_err(|e| ApiError::internal(format!("tokenizing the prompt: {e:#}")))
    };
    let prompt = match p {
        Value::String(s) => text(s)?,
        Value::Array(a) if a.len() == 1 && a[0].is_string() => text(a[0].as_str().unwrap_or(""))?,
        Value::Array(a) if a.len() == 1 && a[0].is_array() => token_ids(
            ready,
            a[0].as_array().map_or(&[][..], |v| v.as_slice()),
            "prompt",
        )?,
        Value::Array(a) if a.iter().all(Value::is_number) => token_ids(ready, a, "prompt")?,
        _ => return Err(bad()),
    };
    if prompt.is_empty() {
        return Err(ApiError::param("prompt", "the prompt is empty"));
    }
    Ok(prompt)
}

async fn completions(
    State(state): St,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: CompletionRequest = read(&state, b)?;
    check_model(&state, r.sampling.model.as_deref())?;
    let ready = state.ready()?;
    if r.echo == Some(true) {
        return Err(ApiError::param("echo", "`echo` is not supported"));
    }
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::param("suffix", "`suffix` is not supported"));
    }
    if r.best_of.is_some_and(|b| b > 1) {
        return Err(ApiError::param("best_of", "`best_of` is not supported"));
    }
    let Some(p) = &r.prompt else {
        return Err(ApiError::param("prompt", "`prompt` is required"));
    };
    let prompt = completion_prompt(ready, p)?;
    let defaults = &state.cfg.defaults;
    let settings = r
        .sampling
        .settings(defaults, prompt.len(), ready.seq_len, &[], |b| {
            ready.dry_breakers(b, &defaults.dry.breakers)
        })?;
    let logprobs = match r.logprobs {
        Some(k) if k > 20 => return Err(ApiError::param("logprobs", "`logprobs` must be 0 to 20")),
        k => k.map(|k| k as usize),
    };
    let job = Job {
        kind: Kind::Text,
        prompt,
        settings,
        logprobs,
        lookup: state.cfg.lookup,
        tools: ToolMode::Off,
        tool_names: Vec::new(),
    };
    respond(state.clone(), ready, job).await
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct TokenizeRequest {
    content: Option<String>,
    add_special: Option<bool>,
    with_pieces: Option<bool>,
}

async fn tokenize(
    State(state): St,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: TokenizeRequest = read(&state, b)?;
    let ready = state.ready()?;
    let Some(content) = &r.content else {
        return Err(ApiError::param("content", "`content` is required"));
    };
    let bos = r.add_special.unwrap_or(false) && ready.tok.add_bos_default();
    let ids = ready
        .tok
        .encode(content, bos, true)
        .map_err(|e| ApiError::internal(format!("{e:#}")))?;
    let tokens: Vec<Value> = if r.with_pieces.unwrap_or(false) {
        ids.iter()
            .map(|&id| {
                let b = ready.tok.token_bytes(id);
                let piece = match String::from_utf8(b) {
                    Ok(s) => Value::from(s),
                    Err(e) => Value::from(e.into_bytes()),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| Value::from(id)).collect()
    };
    Ok(Json(json!({"tokens": tokens})).into_response())
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct DetokenizeRequest {
    tokens: Option<Vec<Value>>,
}

async fn detokenize(
    State(state): St,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: DetokenizeRequest = read(&state, b)?;
    let ready = state.ready()?;
    let ids = token_ids(ready, &r.tokens.unwrap_or_default(), "tokens")?;
    Ok(Json(json!({"content": ready.tok.decode(&ids)})).into_response())
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct TemplateRequest {
    messages: Option<Vec<Value>>,
    tools: Option<Vec<Value>>,
}

async fn apply_template(
    State(state): St,
    b: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: TemplateRequest = read(&state, b)?;
    let ready = state.ready()?;
    let Some(messages) = &r.messages else {
        return Err(ApiError::param("messages", "`messages` is required"));
    };
    let prompt = render_chat(ready, messages, r.tools.as_ref())?;
    Ok(Json(json!({"prompt": prompt})).into_response())
}

#[cfg(test)]
mod tests {
    use super::same_key;

    #[test]
    fn keys_compare_exactly() {
        assert!(same_key(b"secret", b"secret"));
        assert!(!same_key(b"secret", b"secreT"));
        assert!(!same_key(b"secret", b"secret2"));
        assert!(!same_key(b"", b"x"));
        assert!(same_key(b"", b""));
    }
}
