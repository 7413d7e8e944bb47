//! Structured output and tool calls of `/v1/chat/completions`: `response_format` (`text`,
//! `json_object`, `json_schema`) and `tools` with `tool_choice` (`auto`, `none`, `required`, a
//! named function) become a [`ConstraintSpec`] and a [`ToolMode`]; a finished answer's
//! `<tool_call>` blocks become `message.tool_calls`.
//!
//! Tool calls use the Hermes/Qwen2.5 convention that the models' own templates render:
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call. The
//! template renders the `tools` (and, on later turns, the assistant's `tool_calls` and the `tool`
//! results); `required` or a named function constrains the answer to such blocks, with arguments
//! valid under the function's `parameters` schema.
//!
//! Invariants: a format or tool list that cannot be honoured is a 400 naming the field, never
//! ignored; with `auto` an answer is reported as tool calls only when every block parses as a
//! call of a declared function, otherwise as the text it is.

use serde_json::{json, Map, Value};

use crate::engine::constraint::{json_layout, ConstraintSpec};
use crate::server::error::ApiError;
use crate::server::params::ChatRequest;

/// How an answer's tool calls are handled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools: the answer is text.
    Off,
    /// The model may call tools; blocks found in the answer are tool calls.
    Auto,
    /// The answer is one or more calls (constrained).
    Required,
}

/// What a chat request asks of the output.
pub struct Plan {
    pub constraint: Option<ConstraintSpec>,
    pub tools: ToolMode,
    /// The tools the template renders (none for `tool_choice: "none"`).
    pub render_tools: Option<Vec<Value>>,
    /// Declared function names, for recognising calls.
    pub names: Vec<String>,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Reads `response_format`, `tools` and `tool_choice`.
pub fn plan(r: &ChatRequest) -> Result<Plan, ApiError> {
    let format = response_format(r.response_format.as_ref())?;
    let tools = r.tools.clone().unwrap_or_default();
    let mut functions = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        functions.push(function(t, i)?);
    }
    let names: Vec<String> = functions.iter().map(|(n, _)| n.clone()).collect();
    let choice = match &r.tool_choice {
        None => {
            if tools.is_empty() {
                "none".to_string()
            } else {
                "auto".to_string()
            }
        }
        Some(Value::String(s)) if matches!(s.as_str(), "none" | "auto" | "required") => s.clone(),
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::param(
                        "tool_choice",
                        "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::param(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not among the `tools`"),
                ));
            }
            format!("function:{name}")
        }
        Some(_) => {
            return Err(ApiError::param(
                "tool_choice",
                "`tool_choice` must be \"none\", \"auto\", \"required\" or a named function",
            ))
        }
    };
    if choice != "none" && tools.is_empty() {
        return Err(ApiError::param(
            "tool_choice",
            format!("`tool_choice` \"{choice}\" needs `tools`"),
        ));
    }
    let forced: Vec<&(String, Value)> = match choice.strip_prefix("function:") {
        Some(name) => functions.iter().filter(|(n, _)| n == name).collect(),
        None if choice == "required" => functions.iter().collect(),
        None => Vec::new(),
    };
    if !forced.is_empty() && format.is_some() {
        return Err(ApiError::param(
            "response_format",
            "`response_format` and a required tool call cannot both shape the answer",
        ));
    }
    let (constraint, mode) = if forced.is_empty() {
        let mode = if choice == "auto" {
            ToolMode::Auto
        } else {
            ToolMode::Off
        };
        (format, mode)
    } else {
        let parallel = r.parallel_tool_calls.unwrap_or(true);
        (Some(calls_grammar(&forced, parallel)), ToolMode::Required)
    };
    Ok(Plan {
        constraint,
        tools: mode,
        render_tools: (choice != "none" && !tools.is_empty()).then_some(tools),
        names,
    })
}

fn response_format(f: Option<&Value>) -> Result<Option<ConstraintSpec>, ApiError> {
    let Some(f) = f else { return Ok(None) };
    let bad = |m: &str| ApiError::param("response_format", m.to_string());
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(ConstraintSpec::JsonObject)),
        Some("json_schema") => {
            let js = f
                .get("json_schema")
                .ok_or_else(|| bad("`response_format.json_schema` is required"))?;
            let schema = js.get("schema").cloned().unwrap_or(json!({}));
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(bad(
                    "`response_format.json_schema.schema` must be an object",
                ));
            }
            Ok(Some(ConstraintSpec::JsonSchema(schema)))
        }
        Some(other) => Err(bad(&format!(
            "`response_format` type `{other}` is not one of text, json_object, json_schema"
        ))),
        None => Err(bad("`response_format` needs a `type`")),
    }
}

/// A tool's function name and parameters schema.
fn function(t: &Value, i: usize) -> Result<(String, Value), ApiError> {
    let param = format!("tools[{i}]");
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(ApiError::param(
            &param,
            "each tool must be {\"type\": \"function\", \"function\": {...}}",
        ));
    }
    let f = t
        .get("function")
        .ok_or_else(|| ApiError::param(&param, "a tool needs a `function`"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::param(&param, "a function needs a `name`"))?;
    let params = f
        .get("parameters")
        .cloned()
        .unwrap_or(json!({"type": "object", "properties": {}}));
    Ok((name.to_string(), params))
}

/// One `<tool_call>` block (or, with `parallel`, several), each a call of one of `functions` with
/// valid arguments.
fn calls_grammar(functions: &[&(String, Value)], parallel: bool) -> ConstraintSpec {
    let calls: Vec<Value> = functions
        .iter()
        .map(|(name, params)| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    let mut call = if calls.len() == 1 {
        calls.into_iter().next().expect("one call")
    } else {
        json!({"anyOf": calls})
    };
    call["x-guidance"] = json_layout();
    let start = if parallel {
        "start: call (\"\\n\" call)*"
    } else {
        "start: call"
    };
    ConstraintSpec::Lark(format!(
        "{start}\ncall: {open} \"\\n\" %json {call} \"\\n\" {close}\n",
        open = serde_json::to_string(OPEN).expect("a string"),
        close = serde_json::to_string(CLOSE).expect("a string"),
    ))
}

/// A call found in an answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as compact JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// Splits an answer into its text before the first block and its tool calls; `None` when it has
/// no block, or a block is not a call of one of `names` (then the answer is plain text).
pub fn parse_calls(text: &str, names: &[String]) -> Option<(String, Vec<ToolCall>)> {
    let start = text.find(OPEN)?;
    let content = text[..start].trim().to_string();
    let mut calls = Vec::new();
    let mut rest = &text[start..];
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let body = rest.strip_prefix(OPEN)?;
        let end = body.find(CLOSE)?;
        let v: Value = serde_json::from_str(body[..end].trim()).ok()?;
        let name = v.get("name")?.as_str()?;
        if !names.iter().any(|n| n == name) {
            return None;
        }
        let args = match v.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(a @ Value::Object(_)) => a.to_string(),
            None => "{}".to_string(),
            Some(_) => return None,
        };
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: args,
        });
        rest = &body[end + CLOSE.len()..];
    }
    Some((content, calls))
}

/// Whether `text` (an answer so far) may still turn out to be tool calls: it is a prefix of a
/// block's opening, or has one. Streaming holds such text back.
pub fn may_be_calls(text: &str) -> bool {
    let t = text.trim_start();
    t.contains(OPEN) || (!t.is_empty() && OPEN.starts_with(t))
}

/// OpenAI's `tool_calls` array; `ids` names each call (`call_<hex>`).
pub fn tool_calls_json(calls: &[ToolCall], id_base: &str) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "index": i,
                    "id": format!("call_{id_base}_{i}"),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                })
            })
            .collect(),
    )
}

/// Assistant messages with `tool_calls` as the templates read them: each call's `arguments` as
/// an object (OpenAI sends a JSON string), so Qwen's template writes it as JSON, not a quoted
/// string.
pub fn template_tool_calls(m: &mut Map<String, Value>) {
    if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
        for c in calls {
            if let Some(f) = c.get_mut("function") {
                if let Some(Value::String(s)) = f.get("arguments") {
                    if let Ok(v @ Value::Object(_)) = serde_json::from_str::<Value>(s) {
                        f["arguments"] = v;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        vec!["get_weather".into()]
    }

    #[test]
    fn calls_parse_back() {
        let t = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
        let (content, calls) = parse_calls(t, &names()).unwrap();
        assert_eq!(content, "");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].arguments, "{\"city\":\"Rome\"}");
        assert!(parse_calls("no calls here", &names()).is_none());
        assert!(
            parse_calls("<tool_call>\n{\"name\": \"other\"}\n</tool_call>", &names()).is_none()
        );
        assert!(parse_calls("<tool_call>\n{\"name\": \"get_wea", &names()).is_none());
        assert!(may_be_calls("  <tool_"));
        assert!(!may_be_calls("Hello"));
    }

    #[test]
    fn plans_follow_tool_choice() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
        let req = |choice: Value| ChatRequest {
            tools: Some(tools.as_array().unwrap().clone()),
            tool_choice: (!choice.is_null()).then_some(choice),
            ..ChatRequest::default()
        };
        let p = plan(&req(Value::Null)).unwrap();
        assert_eq!(p.tools, ToolMode::Auto);
        assert!(p.constraint.is_none());
        let p = plan(&req(json!("required"))).unwrap();
        assert_eq!(p.tools, ToolMode::Required);
        assert!(
            matches!(p.constraint, Some(ConstraintSpec::Lark(ref g)) if g.contains("get_weather"))
        );
        let mut one = req(json!("required"));
        one.parallel_tool_calls = Some(false);
        let p = plan(&one).unwrap();
        assert!(
            matches!(p.constraint, Some(ConstraintSpec::Lark(ref g)) if g.starts_with("start: call\n"))
        );
        let p = plan(&req(json!("none"))).unwrap();
        assert_eq!(p.tools, ToolMode::Off);
        assert!(p.render_tools.is_none());
        assert!(plan(&req(
            json!({"type": "function", "function": {"name": "nope"}})
        ))
        .is_err());
        assert!(plan(&req(json!("sometimes"))).is_err());
    }
}
