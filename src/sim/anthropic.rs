//! Anthropic Messages (`/messages`, `/messages/count_tokens`): cache reads
//! and writes at the client's `cache_control` breakpoints, and server-side
//! context management (`context_management.edits`), which makes the count
//! drop while the body the client sends does not.

use serde_json::{json, Value};

use super::cache::{Outcome, Style};
use super::http;
use super::prompt::{elements, has_breakpoint, Builder, Prompt};
use super::reply::{self, content_text, tool_specs, Reply, Turn};
use super::tokens::Counting;
use super::{Call, SimApi};

const PER_REQUEST: u64 = 9;
const PER_MESSAGE: u64 = 5;
const PER_BLOCK: u64 = 3;
/// Anthropic documents a hidden tool-use system prompt of a few hundred tokens.
const TOOL_SYSTEM_PROMPT: u64 = 346;
/// What a cleared tool result is replaced with.
const CLEARED: &str = "[tool result cleared by context management]";

fn blocks(b: &Builder, c: &Value) -> u64 {
    match c {
        Value::String(s) => b.tok(s),
        Value::Array(bs) => bs
            .iter()
            .map(|x| {
                PER_BLOCK
                    + match x.get("type").and_then(Value::as_str) {
                        Some("text") => x.get("text").map(|t| b.tok_json(t)).unwrap_or(0),
                        Some("tool_use") => {
                            x.get("name").map(|t| b.tok_json(t)).unwrap_or(0)
                                + x.get("input").map(|t| b.tok_json(t)).unwrap_or(0)
                        }
                        Some("tool_result") => x.get("content").map(|t| blocks(b, t)).unwrap_or(0),
                        _ => b.tok_json(x),
                    }
            })
            .sum(),
        Value::Null => 0,
        other => b.tok_json(other),
    }
}

/// The prompt tokens of a Messages request: the request framing and tools,
/// then each system block, then each message.
pub(super) fn count(body: &Value, c: Counting) -> Prompt {
    let mut b = Builder::new(c);
    b.push_head(body, PER_REQUEST, |b, t| {
        TOOL_SYSTEM_PROMPT + b.tok(&Value::Array(t.to_vec()).to_string())
    });
    match body.get("system") {
        Some(Value::Array(bs)) => {
            for x in bs {
                let n = blocks(&b, &Value::Array(vec![x.clone()]));
                b.push(true, n, x, has_breakpoint(x));
            }
        }
        Some(s) => {
            let n = blocks(&b, s);
            b.push(true, n, s, false);
        }
        None => {}
    }
    for m in elements(body, "messages") {
        let n = PER_MESSAGE + m.get("content").map(|c| blocks(&b, c)).unwrap_or(0);
        b.push(false, n, m, has_breakpoint(m));
    }
    b.finish()
}

/// The user's turn: Claude Code follows it with a `role: "system"` message
/// (its environment) and opens it with `<system-reminder>` blocks, neither
/// of which is what the user asked.
pub(super) fn turn(body: &Value) -> Turn {
    let user_text = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| {
            m.iter()
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) != Some("system"))
        })
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .filter(|m| {
            !elements(m, "content")
                .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
        })
        .and_then(|m| match m.get("content") {
            Some(Value::Array(bs)) => content_text(Some(&Value::Array(
                bs.iter()
                    .filter(|b| {
                        !b.get("text")
                            .and_then(Value::as_str)
                            .is_some_and(|t| t.starts_with("<system-reminder>"))
                    })
                    .cloned()
                    .collect(),
            ))),
            c => content_text(c),
        });
    let tools = tool_specs(
        body.get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten(),
        |t| (t.get("name"), t.get("input_schema")),
    );
    // Structured outputs: `output_format` (beta structured-outputs-2025-11-13)
    // or `output_config.format`.
    let schema = body
        .get("output_format")
        .or_else(|| body.pointer("/output_config/format"))
        .filter(|f| f.get("type").and_then(Value::as_str) == Some("json_schema"))
        .and_then(|f| f.get("schema"))
        .cloned();
    Turn {
        user_text,
        tools,
        schema,
    }
}

fn request_id(n: u64) -> String {
    format!("req_sim{n:016}")
}

/// Anthropic's error envelope (docs.claude.com/en/api/errors).
pub(super) fn error_body(kind: &str, message: &str, n: u64) -> Value {
    json!({"type":"error","error":{"type":kind,"message":message},"request_id":request_id(n)})
}

pub(super) fn error(status: u16, n: u64) -> Value {
    match status {
        529 => error_body("overloaded_error", "Overloaded", n),
        429 => error_body("rate_limit_error", "Rate limited", n),
        400 => error_body("invalid_request_error", "Invalid request", n),
        401 => error_body("authentication_error", "invalid x-api-key", n),
        404 => error_body("not_found_error", "Not found", n),
        _ => error_body("api_error", "Internal server error", n),
    }
}

/// "prompt is too long: P tokens > W maximum", HTTP 400
/// (boldsoftware/exe.dev#62, anthropics/claude-code#59696; fixture
/// anthropic-messages/error_prompt_too_long.json).
pub(super) fn over_window(prompt: u64, window: u64, n: u64) -> Value {
    error_body(
        "invalid_request_error",
        &format!("prompt is too long: {prompt} tokens > {window} maximum"),
        n,
    )
}

// ---------------------------------------------------------------------------
// Context management: `context_management.edits` (beta
// `context-management-2025-06-27`). The edits are applied server-side to the
// prompt the model sees; the client keeps its whole history. The response
// reports them in `context_management.applied_edits`, top level of the
// Message and of the stream's `message_delta` event (anthropic-sdk-python
// types/beta/beta_message.py, beta_raw_message_delta_event.py,
// beta_clear_tool_uses_20250919_edit_response.py,
// beta_clear_thinking_20251015_edit_response.py).

/// `{type, value}` of a trigger / keep / clear_at_least parameter.
fn param(edit: &Value, key: &str) -> Option<(String, u64)> {
    let p = edit.get(key)?;
    Some((
        p.get("type").and_then(Value::as_str)?.to_string(),
        p.get("value").and_then(Value::as_u64)?,
    ))
}

/// Apply `body.context_management.edits` to a copy of the body. Returns the
/// edited body and the `applied_edits` list, or `None` without edits.
pub(super) fn manage(body: &Value, c: Counting) -> Option<(Value, Vec<Value>)> {
    let edits = body
        .get("context_management")
        .and_then(|m| m.get("edits"))
        .and_then(Value::as_array)?;
    let mut cur = body.clone();
    let mut applied = Vec::new();
    for e in edits {
        let before = count(&cur, c).total();
        match e.get("type").and_then(Value::as_str) {
            Some("clear_thinking_20251015") => {
                let keep = match e.get("keep") {
                    Some(Value::String(s)) if s == "all" => usize::MAX,
                    _ => param(e, "keep").map_or(1, |(_, v)| v as usize),
                };
                let cleared = clear_thinking(&mut cur, keep);
                if cleared > 0 {
                    let after = count(&cur, c).total();
                    applied.push(json!({"type":"clear_thinking_20251015","cleared_thinking_turns":cleared,"cleared_input_tokens":before.saturating_sub(after)}));
                }
            }
            Some("clear_tool_uses_20250919") => {
                let fire = match param(e, "trigger") {
                    Some((t, v)) if t == "tool_uses" => tool_uses(&cur).len() as u64 > v,
                    Some((_, v)) => before > v,
                    None => before > 100_000,
                };
                if !fire {
                    continue;
                }
                let keep = param(e, "keep").map_or(3, |(_, v)| v as usize);
                let exclude: Vec<String> = e
                    .get("exclude_tools")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect();
                let inputs = e.get("clear_tool_inputs").and_then(Value::as_bool) == Some(true);
                let mut next = cur.clone();
                let cleared = clear_tool_uses(&mut next, keep, &exclude, inputs);
                let after = count(&next, c).total();
                let at_least = param(e, "clear_at_least").map_or(0, |(_, v)| v);
                if cleared > 0 && before.saturating_sub(after) >= at_least {
                    cur = next;
                    applied.push(json!({"type":"clear_tool_uses_20250919","cleared_tool_uses":cleared,"cleared_input_tokens":before.saturating_sub(after)}));
                }
            }
            _ => {}
        }
    }
    Some((cur, applied))
}

/// (id, name) of every `tool_use` block, oldest first.
fn tool_uses(body: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for m in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        for b in m
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if b.get("type").and_then(Value::as_str) == Some("tool_use") {
                out.push((
                    b.get("id")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                    b.get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                ));
            }
        }
    }
    out
}

/// Replace the results of all but the newest `keep` tool uses (and of no
/// excluded tool) with a placeholder, oldest first. Returns how many.
fn clear_tool_uses(body: &mut Value, keep: usize, exclude: &[String], inputs: bool) -> u64 {
    let uses = tool_uses(body);
    let clear: Vec<&String> = uses
        .iter()
        .take(uses.len().saturating_sub(keep))
        .filter(|(_, name)| !exclude.contains(name))
        .map(|(id, _)| id)
        .collect();
    let mut n = 0;
    for m in body
        .get_mut("messages")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
    {
        for b in m
            .get_mut("content")
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            let id_of = |k: &str| b.get(k).and_then(Value::as_str).map(str::to_string);
            let typ = b.get("type").and_then(Value::as_str);
            if typ == Some("tool_result")
                && id_of("tool_use_id").is_some_and(|id| clear.contains(&&id))
                && b.get("content") != Some(&Value::String(CLEARED.into()))
            {
                b["content"] = Value::String(CLEARED.into());
                n += 1;
            } else if typ == Some("tool_use")
                && inputs
                && id_of("id").is_some_and(|id| clear.contains(&&id))
            {
                b["input"] = json!({});
            }
        }
    }
    n
}

/// Drop thinking blocks from all but the newest `keep` assistant turns
/// that have any. Returns how many turns lost theirs.
fn clear_thinking(body: &mut Value, keep: usize) -> u64 {
    let is_thinking = |b: &Value| {
        matches!(
            b.get("type").and_then(Value::as_str),
            Some("thinking" | "redacted_thinking")
        )
    };
    let Some(msgs) = body.get_mut("messages").and_then(Value::as_array_mut) else {
        return 0;
    };
    let with: Vec<usize> = msgs
        .iter()
        .enumerate()
        .filter(|(_, m)| {
            m.get("role").and_then(Value::as_str) == Some("assistant")
                && m.get("content")
                    .and_then(Value::as_array)
                    .is_some_and(|bs| bs.iter().any(is_thinking))
        })
        .map(|(i, _)| i)
        .collect();
    let clear = with.len().saturating_sub(keep);
    for &i in &with[..clear] {
        if let Some(bs) = msgs[i].get_mut("content").and_then(Value::as_array_mut) {
            bs.retain(|b| !is_thinking(b));
        }
    }
    clear as u64
}

// ---------------------------------------------------------------------------

pub(super) fn complete(call: &Call<'_>, body: &Value) -> (http::Resp, u64) {
    let cfg = &*call.cfg;
    let c = call.counting(SimApi::Anthropic);
    let managed = manage(body, c);
    let seen = managed.as_ref().map_or(body, |(b, _)| b);
    let prompt = count(seen, c);
    let total = prompt.total();
    if let Some(st) = cfg.fail_status {
        return (http::json(st, &error(st, call.n)), total);
    }
    if let Some(w) = cfg.context_window {
        if total > w {
            return (http::json(400, &over_window(total, w, call.n)), total);
        }
    }
    let model = call.model(body);
    let cached = call.cache(&model, &prompt, Style::Breakpoints);
    let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
    let reply = reply::decide(
        &turn(body),
        cfg.tool_calls,
        total.wrapping_mul(0x2545_F491_4F6C_DD1D),
        "toolu_",
    );
    let output = call.output_tokens(SimApi::Anthropic, &reply);
    let msg = Msg {
        model: &model,
        n: call.n,
        reply: &reply,
        usage: (total, cached),
        output,
        with_usage: call.with_usage,
        applied: managed.map(|(_, a)| json!({ "applied_edits": a })),
    };
    let events = if stream {
        msg.stream()
    } else {
        vec![msg.body()]
    };
    let ct = if stream { http::SSE } else { http::JSON };
    (http::stream_response(call, events, ct, call.gzip), total)
}

/// `POST /messages/count_tokens`: `{"input_tokens": N}`, edits applied.
pub(super) fn count_tokens(call: &Call<'_>, body: &Value) -> (http::Resp, u64) {
    let c = call.counting(SimApi::Anthropic);
    let managed = manage(body, c);
    let total = count(managed.as_ref().map_or(body, |(b, _)| b), c).total();
    (http::json(200, &json!({ "input_tokens": total })), total)
}

struct Msg<'a> {
    model: &'a str,
    n: u64,
    reply: &'a Reply,
    /// (total prompt, cache outcome)
    usage: (u64, Outcome),
    output: u64,
    with_usage: bool,
    applied: Option<Value>,
}

impl Msg<'_> {
    fn usage(&self, output: u64) -> Value {
        let (total, c) = self.usage;
        let input = total.saturating_sub(c.read + c.write);
        json!({"input_tokens":input,"cache_creation_input_tokens":c.write,"cache_read_input_tokens":c.read,
            "cache_creation":{"ephemeral_5m_input_tokens":c.write,"ephemeral_1h_input_tokens":0},
            "output_tokens":output,"service_tier":"standard"})
    }

    fn id(&self) -> String {
        format!("msg_sim{:016}", self.n)
    }

    fn stream(&self) -> Vec<String> {
        let ev = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
        let mut msg = json!({"model":self.model,"id":self.id(),"type":"message","role":"assistant",
            "content":[],"stop_reason":null,"stop_sequence":null});
        if self.with_usage {
            msg["usage"] = self.usage(1);
        }
        let mut out = vec![ev(
            "message_start",
            json!({"type":"message_start","message":msg}),
        )];
        let stop = match self.reply {
            Reply::Text(t) => {
                out.push(ev("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}})));
                out.push("event: ping\ndata: {\"type\": \"ping\"}\n\n".to_string());
                for p in reply::pieces(t) {
                    out.push(ev("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":p}})));
                }
                out.push(ev(
                    "content_block_stop",
                    json!({"type":"content_block_stop","index":0}),
                ));
                "end_turn"
            }
            Reply::Tool { id, name, input } => {
                out.push(ev("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":id,"name":name,"input":{}}})));
                out.push("event: ping\ndata: {\"type\": \"ping\"}\n\n".to_string());
                out.push(ev("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":""}})));
                for s in reply::arg_pieces(&input.to_string()) {
                    out.push(ev("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":s}})));
                }
                out.push(ev(
                    "content_block_stop",
                    json!({"type":"content_block_stop","index":0}),
                ));
                "tool_use"
            }
        };
        let mut delta =
            json!({"type":"message_delta","delta":{"stop_reason":stop,"stop_sequence":null}});
        if self.with_usage {
            delta["usage"] = json!({ "output_tokens": self.output });
        }
        if let Some(a) = &self.applied {
            delta["context_management"] = a.clone();
        }
        out.push(ev("message_delta", delta));
        out.push(ev("message_stop", json!({"type":"message_stop"})));
        out
    }

    fn body(&self) -> String {
        let (content, stop) = match self.reply {
            Reply::Text(t) => (json!([{"type":"text","text":t}]), "end_turn"),
            Reply::Tool { id, name, input } => (
                json!([{"type":"tool_use","id":id,"name":name,"input":input}]),
                "tool_use",
            ),
        };
        let mut v = json!({"model":self.model,"id":self.id(),"type":"message","role":"assistant",
            "content":content,"stop_reason":stop,"stop_sequence":null});
        if self.with_usage {
            v["usage"] = self.usage(self.output);
        }
        if let Some(a) = &self.applied {
            v["context_management"] = a.clone();
        }
        v.to_string()
    }
}

/// `GET /v1/models` in Anthropic's page shape.
pub(super) fn models(ids: &[&str]) -> Value {
    let data: Vec<Value> = ids
        .iter()
        .map(|id| json!({"type":"model","id":id,"display_name":id,"created_at":"2025-09-29T00:00:00Z"}))
        .collect();
    json!({"data":data,"has_more":false,"first_id":ids.first(),"last_id":ids.last()})
}
