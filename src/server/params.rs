//! The OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) as the server reads
//! them, and their checks: every field is optional at the parsing stage, so a field of the wrong
//! type is named in the 400 it causes; unknown fields are ignored (clients send many), except
//! those whose meaning the server cannot honour yet, which are refused rather than silently
//! dropped. Sampling fields left out take the server's defaults (`infer serve`'s flags).

use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use crate::engine::dry::{DryBreakers, DryParams};
use crate::engine::generate::GenParams;
use crate::engine::sampler::SamplerConfig;
use crate::server::error::ApiError;

/// `stop`: one string or several.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug, Clone, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling and length fields both endpoints share (OpenAI's, then llama.cpp's extras).
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct Sampling {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub dry_multiplier: Option<f32>,
    pub dry_base: Option<f32>,
    pub dry_allowed_length: Option<u64>,
    pub dry_penalty_last_n: Option<i64>,
    pub dry_sequence_breakers: Option<Vec<String>>,
    pub ignore_eos: Option<bool>,
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct ChatRequest {
    pub messages: Option<Vec<Value>>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `false`: at most one tool call per answer.
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// `POST /v1/completions`.
#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct CompletionRequest {
    pub prompt: Option<Value>,
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// Parses a JSON body into `T`, naming the offending field when one has the wrong type.
pub fn parse<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    let Value::Object(map) = &value else {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    };
    serde_json::from_value::<T>(value.clone()).map_err(|e| {
        // Find the field: the first one that fails on its own.
        for (k, v) in map {
            let one = Value::Object([(k.clone(), v.clone())].into_iter().collect());
            if let Err(fe) = serde_json::from_value::<T>(one) {
                return ApiError::param(k, format!("`{k}`: {fe}"));
            }
        }
        ApiError::bad_request(format!("invalid request: {e}"))
    })
}

/// The server's generation defaults (`infer serve`'s sampling flags).
#[derive(Clone, Debug)]
pub struct Defaults {
    pub sampler: SamplerConfig,
    /// `--dry-*`: the DRY penalty of requests that set none of its fields.
    pub dry: DryParams,
    /// `--seed`: used by requests that give none (else each request draws its own).
    pub seed: Option<u64>,
    /// `--max-tokens`: the length limit of requests that give none (else up to the context).
    pub max_tokens: Option<usize>,
}

/// One request's settings, checked.
#[derive(Clone, Debug)]
pub struct Settings {
    /// For each of the `n` choices (choice i's seed is the request's seed + i).
    pub params: Vec<GenParams>,
    pub stream: bool,
    pub include_usage: bool,
}

impl Sampling {
    /// The request's DRY fields over the server's defaults, checked.
    fn dry(&self, d: &DryParams) -> Result<DryParams, ApiError> {
        let mut p = d.clone();
        if let Some(x) = self.dry_multiplier {
            p.multiplier = x;
        }
        if let Some(x) = self.dry_base {
            p.base = x;
        }
        if let Some(x) = self.dry_allowed_length {
            p.allowed_length = usize::try_from(x).unwrap_or(usize::MAX);
        }
        if let Some(x) = self.dry_penalty_last_n {
            p.penalty_last_n = x;
        }
        if let Some(b) = &self.dry_sequence_breakers {
            p.breakers = b.clone();
        }
        p.check(|f| format!("`dry_{f}`"))
            .map_err(|(field, e)| ApiError::param(&format!("dry_{field}"), e))?;
        Ok(p)
    }
}

fn range(name: &str, v: Option<f32>, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(x.is_finite() && (lo..=hi).contains(&x)) => Err(ApiError::param(
            name,
            format!("`{name}` must be between {lo} and {hi}, got {x}"),
        )),
        v => Ok(v),
    }
}

impl Sampling {
    /// The settings, for a prompt of `prompt_len` tokens in sequences of `seq_len` positions.
    /// `breakers` matches DRY's sequence breakers against the vocabulary.
    pub fn settings(
        &self,
        d: &Defaults,
        prompt_len: usize,
        seq_len: usize,
        extra_stops: &[String],
        breakers: impl FnOnce(&[String]) -> Arc<DryBreakers>,
    ) -> Result<Settings, ApiError> {
        let mut s = d.sampler.clone();
        let dry = self.dry(&d.dry)?;
        if dry.active() {
            s.dry = dry.with_breakers(breakers(&dry.breakers));
        }
        if let Some(t) = range("temperature", self.temperature, 0.0, 2.0)? {
            s.temperature = t;
        }
        if let Some(p) = range("top_p", self.top_p, 0.0, 1.0)? {
            s.top_p = p;
        }
        if let Some(p) = range("min_p", self.min_p, 0.0, 1.0)? {
            s.min_p = p;
        }
        if let Some(p) = range("repeat_penalty", self.repeat_penalty, 0.0, 10.0)? {
            s.repeat_penalty = p;
        }
        if let Some(p) = range("presence_penalty", self.presence_penalty, -2.0, 2.0)? {
            s.presence_penalty = p;
        }
        if let Some(p) = range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)? {
            s.frequency_penalty = p;
        }
        if let Some(k) = self.top_k {
            // llama.cpp: 0 or less keeps every token.
            s.top_k = usize::try_from(k).unwrap_or(0);
        }
        let n = self.n.unwrap_or(1);
        if !(1..=16).contains(&n) {
            return Err(ApiError::param(
                "n",
                format!("`n` must be 1 to 16, got {n}"),
            ));
        }
        let room = seq_len.saturating_sub(prompt_len);
        if prompt_len >= seq_len {
            return Err(ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::param(
                    "messages",
                    format!(
                        "the prompt has {prompt_len} tokens and this server's context holds \
                         {seq_len} (including the answer): shorten the prompt, or restart the \
                         server with a larger --ctx"
                    ),
                )
            });
        }
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            Some(0) => {
                return Err(ApiError::param(
                    "max_tokens",
                    "`max_tokens` must be at least 1",
                ))
            }
            Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
            None => d.max_tokens.unwrap_or(room),
        };
        let mut stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 16 || stop.iter().any(String::is_empty) {
            return Err(ApiError::param(
                "stop",
                "`stop` takes at most 16 non-empty strings",
            ));
        }
        stop.extend(extra_stops.iter().cloned());
        let seed = self
            .seed
            .map(|x| x as u64)
            .or(d.seed)
            .unwrap_or_else(SamplerConfig::entropy_seed);
        let params = (0..u64::from(n))
            .map(|i| GenParams {
                max_tokens,
                sampler: SamplerConfig {
                    seed: seed.wrapping_add(i),
                    ..s.clone()
                },
                stop: stop.clone(),
                ignore_eos: self.ignore_eos.unwrap_or(false),
                constraint: None,
            })
            .collect();
        let stream = self.stream.unwrap_or(false);
        Ok(Settings {
            params,
            stream,
            include_usage: stream
                && self
                    .stream_options
                    .as_ref()
                    .is_some_and(|o| o.include_usage),
        })
    }
}

/// A chat message's `content` as the template reads it: text, the text parts of an array
/// joined, or empty for `null` (an assistant turn that only called tools).
pub fn message_text(m: &Value, i: usize) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match m.get("content") {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut out = Vec::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => out.push(t.as_str()),
                    (Some(other), _) if other != "text" => {
                        return Err(ApiError::param(
                            &param,
                            format!(
                                "content parts of type `{other}` are not supported (text only)"
                            ),
                        ))
                    }
                    _ => {
                        return Err(ApiError::param(
                            &param,
                            "a content part must be {\"type\": \"text\", \"text\": \"...\"}",
                        ))
                    }
                }
            }
            Ok(out.join("\n"))
        }
        Some(_) => Err(ApiError::param(
            &param,
            "`content` must be a string, an array of text parts, or null",
        )),
    }
}

/// The messages as the chat template gets them: each an object with a `role` string and text
/// `content` (OpenAI's `developer` role is the templates' `system`), other fields kept.
pub fn template_messages(messages: &[Value]) -> Result<Value, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::param("messages", "`messages` must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let Value::Object(obj) = m else {
            return Err(ApiError::param(
                &format!("messages[{i}]"),
                "each message must be an object",
            ));
        };
        let role = match obj.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(r) => r,
            None => {
                return Err(ApiError::param(
                    &format!("messages[{i}].role"),
                    "each message needs a `role` string",
                ))
            }
        };
        let mut o = obj.clone();
        crate::server::tools::template_tool_calls(&mut o);
        o.insert("role".into(), Value::from(role));
        o.insert("content".into(), Value::from(message_text(m, i)?));
        out.push(Value::Object(o));
    }
    Ok(Value::Array(out))
}
