//! One generation request from submission to response: its `n` choices go to the engine as `n`
//! requests sharing one event channel, and come back either as one JSON object or as a stream
//! of server-sent events in OpenAI's chunk format (`chat.completion.chunk` or
//! `text_completion`), ending with `data: [DONE]`.
//!
//! Invariants: a [`Ticket`] owns the request's place in the server; dropping it (response sent,
//! client gone, handler cancelled) cancels whatever of the request is still running, so its KV
//! blocks return within one engine step. A stream whose client disconnects stops at once, even
//! during a long prompt (the body channel's closing is watched, not only failed writes).

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::generate::{GenStats, StopReason, TokenLogprobs};
use crate::engine::request::{Event, LookupSpec, RequestId, RequestSpec};
use crate::server::engine::{Command, EngineHandle};
use crate::server::error::ApiError;
use crate::server::params::Settings;
use crate::server::tools::{may_be_calls, parse_calls, tool_calls_json, ToolMode};
use crate::server::{AppState, Ready};
use crate::tokenizer::Tokenizer;

/// Which endpoint's shapes to answer in.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Chat,
    Text,
}

impl Kind {
    pub fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "chat_completions",
            Kind::Text => "completions",
        }
    }
}

/// A checked generation request.
pub struct Job {
    pub kind: Kind,
    pub prompt: Vec<u32>,
    pub settings: Settings,
    /// `Some(k)`: every token's log-probability and its `k` most likely alternatives.
    pub logprobs: Option<usize>,
    pub lookup: Option<LookupSpec>,
    /// Whether (and how) the answer's `<tool_call>` blocks are tool calls.
    pub tools: ToolMode,
    /// The declared functions' names.
    pub tool_names: Vec<String>,
}

/// A request's place in the server (see the module invariants).
pub struct Ticket {
    state: Arc<AppState>,
    engine: EngineHandle,
    ids: Vec<RequestId>,
    finished: Vec<bool>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        for (id, done) in self.ids.iter().zip(&self.finished) {
            if !done {
                self.engine.send(Command::Cancel(*id));
            }
        }
        self.state
            .in_flight
            .fetch_sub(self.ids.len(), Ordering::Relaxed);
    }
}

/// `OpenAI`'s finish reason for how a choice ended. A request cut short by the server stopping
/// reports `length`: its text is incomplete, as with a length limit.
pub fn finish_reason(s: StopReason) -> &'static str {
    match s {
        StopReason::Eos | StopReason::StopString => "stop",
        StopReason::Length | StopReason::ContextFull | StopReason::Interrupted => "length",
    }
}

/// `x` as the shortest decimal that reads back as the same f32.
fn short(x: f32) -> Value {
    let v: f64 = x.to_string().parse().unwrap_or(f64::from(x));
    json!(v)
}

fn piece(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let b = tok.token_bytes(id);
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// A chat `logprobs.content` entry.
fn chat_logprob(tok: &Tokenizer, id: u32, lp: &TokenLogprobs) -> Value {
    let (text, bytes) = piece(tok, id);
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|&(t, l)| {
            let (text, bytes) = piece(tok, t);
            json!({"token": text, "logprob": short(l), "bytes": bytes})
        })
        .collect();
    json!({"token": text, "logprob": short(lp.logprob), "bytes": bytes, "top_logprobs": top})
}

/// Legacy completions' logprobs of some tokens, `offset` being the text length before them.
#[derive(Default)]
struct TextLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl TextLogprobs {
    fn push(&mut self, tok: &Tokenizer, id: u32, lp: &TokenLogprobs, offset: usize) {
        self.tokens.push(Value::from(piece(tok, id).0));
        self.token_logprobs.push(short(lp.logprob));
        let top: serde_json::Map<String, Value> = lp
            .top
            .iter()
            .map(|&(t, l)| (piece(tok, t).0, short(l)))
            .collect();
        self.top_logprobs.push(Value::Object(top));
        self.text_offset.push(offset);
    }

    fn json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

/// What one choice has produced so far.
#[derive(Default)]
struct Choice {
    text: String,
    chat_logprobs: Vec<Value>,
    text_logprobs: TextLogprobs,
    stats: Option<GenStats>,
    first: Option<Instant>,
    last: Option<Instant>,
    /// Bytes of `text` already streamed (text that may be a tool call is held back).
    sent: usize,
}

fn usage(prompt_len: usize, choices: &[Choice]) -> Value {
    let generated: usize = choices
        .iter()
        .filter_map(|c| c.stats.as_ref())
        .map(|s| s.generated_tokens)
        .sum();
    let cached = choices
        .first()
        .and_then(|c| c.stats.as_ref())
        .map_or(0, |s| s.reused_tokens);
    json!({
        "prompt_tokens": prompt_len,
        "completion_tokens": generated,
        "total_tokens": prompt_len + generated,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Ids, clock and model name every object of one response carries.
struct Head {
    id: String,
    created: u64,
    model: String,
}

impl Head {
    fn object(&self, kind: Kind, chunk: bool) -> Value {
        let object = match (kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("infer-", env!("CARGO_PKG_VERSION")),
        })
    }
}

/// Runs `job` and answers it (JSON or a stream).
pub async fn respond(state: Arc<AppState>, ready: &Ready, job: Job) -> Result<Response, ApiError> {
    if ready.engine.is_dead() {
        return Err(ApiError::internal(
            "the engine has failed; restart the server",
        ));
    }
    let n = job.settings.params.len();
    // A place in the queue, or 429.
    let cap = state.cfg.parallel + state.cfg.queue;
    let before = state.in_flight.fetch_add(n, Ordering::Relaxed);
    if before + n > cap {
        state.in_flight.fetch_sub(n, Ordering::Relaxed);
        return Err(ApiError::busy(before));
    }
    let mut ticket = Ticket {
        state: state.clone(),
        engine: ready.engine.clone(),
        ids: Vec::with_capacity(n),
        finished: vec![false; n],
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let arrived = Instant::now();
    for (tag, params) in job.settings.params.iter().enumerate() {
        let id = state.next_id.fetch_add(1, Ordering::Relaxed);
        ticket.ids.push(id);
        let spec = RequestSpec {
            prompt: job.prompt.clone(),
            params: params.clone(),
            logprobs: job.logprobs,
            lookup: job.lookup,
        };
        let sent = ready.engine.send(Command::Submit {
            id,
            spec,
            tag,
            events: tx.clone(),
        });
        if !sent {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
    }
    drop(tx);
    let prefix = if job.kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    let head = Head {
        id: format!(
            "{prefix}-{:016x}",
            crate::engine::sampler::SamplerConfig::entropy_seed()
        ),
        created: now_secs(),
        model: state.cfg.model_id.clone(),
    };
    let run = Run {
        state,
        tok: ready.tok.clone(),
        job,
        head,
        arrived,
        choices: (0..n).map(|_| Choice::default()).collect(),
    };
    if run.job.settings.stream {
        Ok(run.stream(rx, ticket))
    } else {
        run.collect(rx, ticket).await
    }
}

/// A request in progress.
struct Run {
    state: Arc<AppState>,
    tok: Arc<Tokenizer>,
    job: Job,
    head: Head,
    arrived: Instant,
    choices: Vec<Choice>,
}

/// What an event means for the response.
enum Step {
    /// New text (and the token's logprobs, for a token) for choice i.
    Text {
        i: usize,
        text: String,
        lp: Option<Value>,
    },
    Finished(usize),
    Failed(String),
}

impl Run {
    /// Books event `e` of choice `i` (text, logprobs, stats, latencies).
    fn absorb(&mut self, i: usize, e: Event) -> Step {
        let kind = self.job.kind;
        let Some(c) = self.choices.get_mut(i) else {
            return Step::Failed("an event for an unknown choice".into());
        };
        match e {
            Event::Token { id, text, logprobs } => {
                let t = Instant::now();
                match c.last {
                    None => self.state.metrics.ttft((t - self.arrived).as_secs_f64()),
                    Some(l) => self.state.metrics.itl((t - l).as_secs_f64()),
                }
                c.first.get_or_insert(t);
                c.last = Some(t);
                let lp = logprobs.map(|lp| match kind {
                    Kind::Chat => {
                        let v = chat_logprob(&self.tok, id, &lp);
                        c.chat_logprobs.push(v.clone());
                        json!({"content": [v]})
                    }
                    Kind::Text => {
                        let mut one = TextLogprobs::default();
                        one.push(&self.tok, id, &lp, c.text.len());
                        c.text_logprobs.push(&self.tok, id, &lp, c.text.len());
                        one.json()
                    }
                });
                c.text.push_str(&text);
                Step::Text { i, text, lp }
            }
            Event::Tail(text) => {
                c.text.push_str(&text);
                Step::Text { i, text, lp: None }
            }
            Event::Done(stats) => {
                self.state
                    .metrics
                    .tokens(stats.prompt_tokens, stats.generated_tokens);
                c.stats = Some(stats);
                Step::Finished(i)
            }
            Event::Error(m) => Step::Failed(m),
        }
    }

    async fn collect(
        mut self,
        mut rx: mpsc::UnboundedReceiver<(usize, Event)>,
        mut ticket: Ticket,
    ) -> Result<Response, ApiError> {
        let mut left = self.choices.len();
        while left > 0 {
            let Some((i, e)) = rx.recv().await else {
                return Err(ApiError::internal("the engine stopped"));
            };
            match self.absorb(i, e) {
                Step::Text { .. } => {}
                Step::Finished(i) => {
                    ticket.finished[i] = true;
                    left -= 1;
                }
                Step::Failed(m) => return Err(ApiError::internal(m)),
            }
        }
        let kind = self.job.kind;
        let want_lp = self.job.logprobs.is_some();
        let usage = usage(self.job.prompt.len(), &self.choices);
        let choices: Vec<Value> = std::mem::take(&mut self.choices)
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let mut reason = c.stats.as_ref().map(|s| finish_reason(s.stop));
                match kind {
                    Kind::Chat => {
                        let mut message = json!({"role": "assistant", "content": c.text});
                        if let Some((content, calls)) = self.calls(&c.text) {
                            message["content"] =
                                if content.is_empty() { Value::Null } else { content.into() };
                            message["tool_calls"] = tool_calls_json(&calls, &self.call_id(i));
                            reason = Some("tool_calls");
                        }
                        json!({
                            "index": i,
                            "message": message,
                            "logprobs": if want_lp { json!({"content": c.chat_logprobs}) } else { Value::Null },
                            "finish_reason": reason,
                        })
                    }
                    Kind::Text => json!({
                        "index": i,
                        "text": c.text,
                        "logprobs": if want_lp { c.text_logprobs.json() } else { Value::Null },
                        "finish_reason": reason,
                    }),
                }
            })
            .collect();
        let mut body = self.head.object(kind, false);
        body["choices"] = Value::from(choices);
        body["usage"] = usage;
        drop(ticket);
        Ok((StatusCode::OK, axum::Json(body)).into_response())
    }

    /// The tool calls an answer holds, when the request offered tools.
    fn calls(&self, text: &str) -> Option<(String, Vec<crate::server::tools::ToolCall>)> {
        if self.job.tools == ToolMode::Off {
            return None;
        }
        parse_calls(text, &self.job.tool_names)
    }

    /// The base of choice `i`'s call ids (unique per response).
    fn call_id(&self, i: usize) -> String {
        let id = self.head.id.rsplit('-').next().unwrap_or("0");
        format!("{id}{i}")
    }

    /// A chunk with one choice's `delta` (chat) or `text` (completions).
    fn chunk(
        &self,
        i: usize,
        text: Option<&str>,
        lp: Option<Value>,
        finish: Option<&str>,
    ) -> Value {
        let mut c = self.head.object(self.job.kind, true);
        let choice = match self.job.kind {
            Kind::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
            Kind::Text => json!({
                "index": i,
                "text": text.unwrap_or(""),
                "logprobs": lp,
                "finish_reason": finish,
            }),
        };
        c["choices"] = json!([choice]);
        c
    }

    fn stream(
        mut self,
        mut rx: mpsc::UnboundedReceiver<(usize, Event)>,
        mut ticket: Ticket,
    ) -> Response {
        let (body_tx, body_rx) = mpsc::channel::<Result<Bytes, Infallible>>(64);
        let sse = |v: &Value| Ok(Bytes::from(format!("data: {v}\n\n")));
        tokio::spawn(async move {
            // Opening chunks: the assistant role for every chat choice.
            if self.job.kind == Kind::Chat {
                for i in 0..self.choices.len() {
                    let mut c = self.chunk(i, None, None, None);
                    c["choices"][0]["delta"] = json!({"role": "assistant", "content": ""});
                    if body_tx.send(sse(&c)).await.is_err() {
                        return;
                    }
                }
            }
            let mut left = self.choices.len();
            while left > 0 {
                let event = tokio::select! {
                    _ = body_tx.closed() => return,
                    e = rx.recv() => e,
                };
                let Some((i, e)) = event else {
                    let err = ApiError::internal("the engine stopped");
                    let _ = body_tx.send(sse(&err.body())).await;
                    return;
                };
                let out = match self.absorb(i, e) {
                    Step::Text { i, text, lp } => {
                        let c = &self.choices[i];
                        if self.job.tools != ToolMode::Off && may_be_calls(&c.text) {
                            // Perhaps a tool call: sent as one when the answer is complete.
                            continue;
                        }
                        // Text held back before (a false start of a call) goes out with this.
                        let text = if c.sent + text.len() < c.text.len() {
                            c.text[c.sent..].to_string()
                        } else {
                            text
                        };
                        self.choices[i].sent = self.choices[i].text.len();
                        if text.is_empty() && lp.is_none() {
                            continue;
                        }
                        self.chunk(i, Some(&text), lp, None)
                    }
                    Step::Finished(i) => {
                        ticket.finished[i] = true;
                        left -= 1;
                        let mut reason = self.choices[i]
                            .stats
                            .as_ref()
                            .map(|s| finish_reason(s.stop));
                        let c = &self.choices[i];
                        let held = c.text[c.sent..].to_string();
                        let pending = match self.calls(&c.text) {
                            Some((_, calls)) => {
                                reason = Some("tool_calls");
                                let mut d = self.chunk(i, None, None, None);
                                d["choices"][0]["delta"] = json!({"tool_calls": tool_calls_json(&calls, &self.call_id(i))});
                                Some(d)
                            }
                            None if !held.is_empty() => {
                                Some(self.chunk(i, Some(&held), None, None))
                            }
                            None => None,
                        };
                        self.choices[i].sent = self.choices[i].text.len();
                        if let Some(d) = pending {
                            if body_tx.send(sse(&d)).await.is_err() {
                                return;
                            }
                        }
                        self.chunk(i, None, None, reason)
                    }
                    Step::Failed(m) => {
                        let _ = body_tx.send(sse(&ApiError::internal(m).body())).await;
                        let _ = body_tx.send(Ok(Bytes::from("data: [DONE]\n\n"))).await;
                        return;
                    }
                };
                if body_tx.send(sse(&out)).await.is_err() {
                    return;
                }
            }
            if self.job.settings.include_usage {
                let mut c = self.head.object(self.job.kind, true);
                c["choices"] = json!([]);
                c["usage"] = usage(self.job.prompt.len(), &self.choices);
                let _ = body_tx.send(sse(&c)).await;
            }
            let _ = body_tx.send(Ok(Bytes::from("data: [DONE]\n\n"))).await;
            drop(ticket);
        });
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(body_rx));
        (
            StatusCode::OK,
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response()
    }
}
