//! OpenAI Responses (`/responses`, `/responses/input_tokens`,
//! `/responses/compact`), over HTTP (SSE or one body) and over the WebSocket
//! mode (`ws.rs`), which sends the same events one frame each.
//!
//! Conversations continue server-side: `previous_response_id` prepends the
//! stored input and output of that response (stored unless `store: false`;
//! a WebSocket connection also keeps its own). Server-side compaction
//! (`context_management: [{"type":"compaction","compact_threshold":N}]`)
//! adds an opaque `compaction` item to the output once the prompt crosses
//! the threshold; from then on every item before the latest compaction item
//! is left out of the count, though the client may keep sending it
//! (developers.openai.com/api/docs/guides/compaction).

use std::collections::HashMap;

use base64::Engine as _;
use serde_json::{json, Value};

use super::cache::Style;
use super::http;
use super::prompt::{canonical_hash, elements, Builder, Prompt};
use super::reply::{self, content_text, tool_specs, Reply, Rng, ToolSpec, Turn};
use super::tokens::Counting;
use super::{Call, SimApi};

/// Reply priming and the instructions' message framing.
const PER_REQUEST: u64 = 5;
const PER_MESSAGE: u64 = 4;
const PER_FUNCTION_CALL: u64 = 7;
const PER_FUNCTION_OUTPUT: u64 = 5;
const TOOLS_FRAMING: u64 = 12;
const PER_TOOL: u64 = 4;
/// The prefix of the sim's own compaction payloads.
const COMPACTION_MAGIC: &str = "simcmp1:";

/// A finished response the server remembers for `previous_response_id`.
#[derive(Debug, Clone)]
pub(crate) struct Stored {
    /// The whole conversation it ended: earlier items, its input, its output.
    pub items: Vec<Value>,
}

/// Responses a WebSocket connection keeps for itself (ZDR and `store:false`
/// continue from these).
pub(crate) type Local = HashMap<String, Stored>;

/// The request's input as a list of items.
fn input_items(body: &Value) -> Vec<Value> {
    match body.get("input") {
        Some(Value::String(s)) => {
            vec![json!({"type":"message","role":"user","content":[{"type":"input_text","text":s}]})]
        }
        Some(Value::Array(a)) => a.clone(),
        _ => Vec::new(),
    }
}

fn content_tokens(b: &Builder, c: &Value) -> u64 {
    match c {
        Value::String(s) => b.tok(s),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p.get("text") {
                Some(t) => 1 + b.tok_json(t),
                None => 1 + b.tok_json(p),
            })
            .sum(),
        Value::Null => 0,
        other => b.tok_json(other),
    }
}

/// The summary size a compaction item stands for.
/// What one of the sim's compaction items says of itself: the size of its
/// summary, and the chain hash of the items it replaced.
fn compaction_payload(item: &Value) -> Option<(u64, u64)> {
    let enc = item.get("encrypted_content")?.as_str()?;
    let raw = base64::engine::general_purpose::STANDARD.decode(enc).ok()?;
    let s = String::from_utf8(raw).ok()?;
    let mut f = s.strip_prefix(COMPACTION_MAGIC)?.split(':');
    let summary = f.next()?.parse().ok()?;
    let replaced = u64::from_str_radix(f.next()?, 16).ok()?;
    Some((summary, replaced))
}

/// The summary size a compaction item stands for.
fn compaction_tokens(b: &Builder, item: &Value) -> u64 {
    compaction_payload(item).map_or_else(
        // Someone else's opaque payload: about a token per four characters.
        || b.tok_json(item.get("encrypted_content").unwrap_or(&Value::Null)) / 4,
        |(summary, _)| summary,
    )
}

/// The chain hashes of every prefix of `items` as the provider sees them
/// (ids and status aside): entry k covers `items[..k]`.
fn chains(items: &[Value]) -> Vec<u64> {
    let mut out = Vec::with_capacity(items.len() + 1);
    out.push(0u64);
    for it in items {
        let h = out[out.len() - 1];
        out.push(canonical_hash(&json!([h, canonical_hash(&strip_ids(it))])));
    }
    out
}

fn item_tokens(b: &Builder, it: &Value) -> u64 {
    match it.get("type").and_then(Value::as_str).unwrap_or("message") {
        "message" => {
            PER_MESSAGE
                + it.get("role").map(|r| b.tok_json(r)).unwrap_or(0)
                + it.get("content").map(|c| content_tokens(b, c)).unwrap_or(0)
        }
        "function_call" | "custom_tool_call" => {
            PER_FUNCTION_CALL
                + it.get("name").map(|v| b.tok_json(v)).unwrap_or(0)
                + it.get("arguments")
                    .or_else(|| it.get("input"))
                    .map(|v| b.tok_json(v))
                    .unwrap_or(0)
        }
        "function_call_output" | "custom_tool_call_output" => {
            PER_FUNCTION_OUTPUT + it.get("output").map(|v| b.tok_json(v)).unwrap_or(0)
        }
        // Earlier reasoning is carried by its summary (the encrypted
        // chain of thought is not part of the prompt).
        "reasoning" => {
            2 + it
                .get("summary")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|s| s.get("text"))
                .map(|t| b.tok_json(t))
                .sum::<u64>()
        }
        "compaction" | "compaction_summary" => 4 + compaction_tokens(b, it),
        _ => 3 + b.tok_json(it),
    }
}

/// Index of the latest compaction item: items before it no longer count.
///
/// A compaction item replaces exactly the items it was made from: when they
/// still stand before it (stateless chaining appends output to input, and
/// `previous_response_id` does the same server-side), they are left out.
/// A client that rebuilt its history around the item (Codex's remote
/// compaction resends its instructions and first message before it) has
/// everything before it counted.
fn compacted_from(items: &[Value]) -> usize {
    let prefix = chains(items);
    items
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, it)| {
            matches!(
                it.get("type").and_then(Value::as_str),
                Some("compaction" | "compaction_summary")
            )
        })
        .find(|&(k, it)| compaction_payload(it).is_some_and(|(_, replaced)| replaced == prefix[k]))
        .map_or(0, |(k, _)| k)
}

/// The prompt of a request whose resolved conversation is `items`.
pub(super) fn count_items(body: &Value, items: &[Value], c: Counting) -> Prompt {
    let mut b = Builder::new(c);
    let instructions = body.get("instructions").filter(|v| !v.is_null());
    let ins = instructions
        .map(|i| PER_MESSAGE + b.tok_json(i))
        .unwrap_or(0);
    b.push_head(body, PER_REQUEST, |b, t| {
        TOOLS_FRAMING
            + t.iter()
                .map(|x| PER_TOOL + b.tok(&x.to_string()))
                .sum::<u64>()
    });
    if let Some(i) = instructions {
        b.push(true, ins, i, false);
    }
    for it in &items[compacted_from(items)..] {
        let n = item_tokens(&b, it);
        b.push(false, n, &strip_ids(it), false);
    }
    b.finish()
}

/// An item without the server-assigned `id` and `status`, which a client
/// may or may not echo back: the same content either way.
fn strip_ids(it: &Value) -> Value {
    let mut v = it.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("id");
        o.remove("status");
    }
    v
}

/// The request's function and custom tools: top-level `tools`, and those
/// Codex sends as an `additional_tools` input item, namespaces opened.
fn tools(body: &Value, items: &[Value]) -> Vec<ToolSpec> {
    fn walk<'a>(ts: impl Iterator<Item = &'a Value>, out: &mut Vec<ToolSpec>) {
        for t in ts {
            match t.get("type").and_then(Value::as_str) {
                Some("namespace") => walk(elements(t, "tools"), out),
                Some(k @ ("function" | "custom")) => out.extend(
                    tool_specs([t], |t| (t.get("name"), t.get("parameters")))
                        .into_iter()
                        .map(|s| ToolSpec {
                            custom: k == "custom",
                            ..s
                        }),
                ),
                _ => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(elements(body, "tools"), &mut out);
    for it in items
        .iter()
        .filter(|it| it.get("type").and_then(Value::as_str) == Some("additional_tools"))
    {
        walk(elements(it, "tools"), &mut out);
    }
    out
}

pub(super) fn turn(body: &Value, items: &[Value]) -> Turn {
    let user_text = items
        .last()
        .filter(|m| {
            m.get("type").and_then(Value::as_str).unwrap_or("message") == "message"
                && m.get("role").and_then(Value::as_str) == Some("user")
        })
        .and_then(|m| content_text(m.get("content")));
    let tools = tools(body, items);
    let schema = body
        .pointer("/text/format")
        .filter(|f| f.get("type").and_then(Value::as_str) == Some("json_schema"))
        .and_then(|f| f.get("schema"))
        .cloned();
    Turn {
        user_text,
        tools,
        schema,
    }
}

/// An OpenAI-shaped error object (`{"error":{message,type,param,code}}`).
pub(super) fn error_body(
    message: &str,
    typ: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Value {
    json!({"error":{"message":message,"type":typ,"param":param,"code":code}})
}

/// The Responses API's context-length refusal. It names neither the window
/// nor the prompt size (the-open-agent/openagent#2344,
/// james-6-23/codex2api#415; fixture
/// openai-responses/error_context_length_exceeded.json): as a 400 body
/// without streaming, as `response.failed` after 200 with it (openai/codex
/// codex-rs/codex-api/src/sse/responses.rs, `context_window_error_is_fatal`).
pub(super) const CONTEXT_MESSAGE: &str =
    "Your input exceeds the context window of this model. Please adjust your input and try again.";

/// Why a response could not be made.
pub(super) enum Refusal {
    /// An HTTP error before any event (status, body).
    Http(u16, Value),
    /// A response that starts and then fails (context length): its error.
    Failed(Value),
}

/// A response being made: the request resolved against stored state.
pub(super) struct Run {
    pub id: String,
    pub prompt: u64,
    pub events: Vec<Value>,
    pub response: Value,
    /// What to remember under `id`.
    pub stored: Stored,
    pub store: bool,
}

/// Resolve, count, check and answer one `response.create` body (the POST
/// body, or a WebSocket client event). `local` is a WebSocket connection's
/// own store.
pub(super) fn run(
    call: &Call<'_>,
    body: &Value,
    local: Option<&Local>,
) -> Result<Run, (Refusal, Option<u64>)> {
    let cfg = &*call.cfg;
    let c = call.counting(SimApi::OpenAiResponses);
    let mut items = Vec::new();
    if let Some(prev) = body.get("previous_response_id").and_then(Value::as_str) {
        let found = local
            .and_then(|l| l.get(prev).cloned())
            .or_else(|| call.sim.stored(prev));
        match found {
            Some(s) => items = s.items,
            None => {
                return Err((
                    Refusal::Http(
                        400,
                        error_body(
                            &format!("Previous response with id '{prev}' not found."),
                            "invalid_request_error",
                            Some("previous_response_id"),
                            Some("previous_response_not_found"),
                        ),
                    ),
                    None,
                ))
            }
        }
    }
    items.extend(input_items(body));
    let prompt = count_items(body, &items, c);
    let total = prompt.total();
    if let Some(st) = cfg.fail_status {
        let (typ, msg) = match st {
            429 => ("requests", "Rate limit reached"),
            400 => ("invalid_request_error", "Invalid request"),
            _ => (
                "server_error",
                "The server had an error while processing your request.",
            ),
        };
        return Err((
            Refusal::Http(st, error_body(msg, typ, None, None)),
            Some(total),
        ));
    }
    let model = call.model(body);
    let mut rng = Rng(total ^ call.n.rotate_left(32));
    let id = format!("resp_{}", rng.hex(48));
    let base = response_base(&id, &model, body, call.n);
    if cfg.context_window.is_some_and(|w| total > w) {
        return Err((
            Refusal::Failed(json!({"code":"context_length_exceeded","message":CONTEXT_MESSAGE})),
            Some(total),
        ));
    }
    let cached = call.cache(&model, &prompt, Style::Automatic { granularity: 128 });
    // `"generate": false` (Codex's prewarm over the WebSocket): the prompt is
    // taken in, nothing is generated.
    let generate = body.get("generate").and_then(Value::as_bool) != Some(false);
    let reply = reply::decide(
        &turn(body, &items),
        cfg.tool_calls,
        total.wrapping_mul(0x2545_F491_4F6C_DD1D),
        "call_",
    );
    let output_tokens = if generate {
        call.output_tokens(SimApi::OpenAiResponses, &reply)
    } else {
        0
    };
    let mut output = Vec::new();
    // Remote compaction (Codex's `responses_compaction_v2`): an input that
    // ends in a `compaction_trigger` item gets exactly one compaction item.
    let trigger = items
        .last()
        .is_some_and(|it| it.get("type").and_then(Value::as_str) == Some("compaction_trigger"));
    if trigger {
        output.push(compaction_item(&items[..items.len() - 1], c, &mut rng));
    } else if compact_threshold(body).is_some_and(|t| total > t) {
        output.push(compaction_item(&items, c, &mut rng));
    }
    output.extend((generate && !trigger).then(|| match &reply {
        Reply::Text(t) => json!({"id":format!("msg_{}", rng.hex(48)),"type":"message","status":"completed",
            "content":[{"type":"output_text","annotations":[],"logprobs":[],"text":t}],"role":"assistant"}),
        // A freeform (custom) tool's input is text.
        Reply::Tool { id, name, input: Value::String(s) } => json!({"id":format!("ctc_{}", rng.hex(48)),
            "type":"custom_tool_call","status":"completed","call_id":id,"name":name,"input":s}),
        Reply::Tool { id, name, input } => json!({"id":format!("fc_{}", rng.hex(48)),"type":"function_call",
            "status":"completed","arguments":input.to_string(),"call_id":id,"name":name}),
    }));
    let usage = json!({"input_tokens":total,"input_tokens_details":{"cached_tokens":cached.read},
        "output_tokens":output_tokens,"output_tokens_details":{"reasoning_tokens":0},
        "total_tokens":total+output_tokens});
    let mut done = base.clone();
    done["status"] = json!("completed");
    done["service_tier"] = json!("default");
    done["output"] = Value::Array(output.clone());
    if call.with_usage {
        done["usage"] = usage;
    }
    let events = events(&base, &done, &output);
    items.extend(output);
    Ok(Run {
        id,
        prompt: total,
        events,
        response: done,
        stored: Stored { items },
        store: body.get("store").and_then(Value::as_bool) != Some(false),
    })
}

fn compact_threshold(body: &Value) -> Option<u64> {
    body.get("context_management")
        .and_then(Value::as_array)?
        .iter()
        .find(|e| e.get("type").and_then(Value::as_str) == Some("compaction"))
        .map(|e| {
            e.get("compact_threshold")
                .and_then(Value::as_u64)
                .unwrap_or(200_000)
        })
}

/// An opaque compaction item standing for everything in `items`: a tenth of
/// their tokens, at least 32.
fn compaction_item(items: &[Value], c: Counting, rng: &mut Rng) -> Value {
    let b = Builder::new(c);
    let summarised: u64 = items[compacted_from(items)..]
        .iter()
        .map(|it| item_tokens(&b, it))
        .sum();
    let summary = (summarised / 10).max(32);
    let replaced = chains(items).last().copied().unwrap_or(0);
    let payload = format!("{COMPACTION_MAGIC}{summary}:{replaced:x}:{}", rng.hex(64));
    json!({"id":format!("cmp_{}", rng.hex(48)),"type":"compaction",
        "encrypted_content":base64::engine::general_purpose::STANDARD.encode(payload)})
}

/// The Response object as `response.created` carries it.
fn response_base(id: &str, model: &str, body: &Value, n: u64) -> Value {
    let get = |k: &str| body.get(k).cloned().unwrap_or(Value::Null);
    json!({"id":id,"object":"response","created_at":1_755_013_100u64 + n,"status":"in_progress",
        "background":false,"error":null,"incomplete_details":null,"instructions":get("instructions"),
        "max_output_tokens":get("max_output_tokens"),"max_tool_calls":null,"model":model,"output":[],
        "parallel_tool_calls":body.get("parallel_tool_calls").cloned().unwrap_or(json!(true)),
        "previous_response_id":get("previous_response_id"),"prompt_cache_key":get("prompt_cache_key"),
        "reasoning":body.get("reasoning").cloned().unwrap_or(json!({"effort":null,"summary":null})),
        "safety_identifier":null,"service_tier":"auto",
        "store":body.get("store").cloned().unwrap_or(json!(true)),"temperature":1.0,
        "text":body.get("text").cloned().unwrap_or(json!({"format":{"type":"text"},"verbosity":"medium"})),
        "tool_choice":body.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "tools":body.get("tools").cloned().unwrap_or(json!([])),"top_logprobs":0,"top_p":1.0,
        "truncation":"disabled","usage":null,"user":null,"metadata":{}})
}

/// The stream of a completed response, each event with its sequence number.
fn events(base: &Value, done: &Value, output: &[Value]) -> Vec<Value> {
    let mut ev = Vec::new();
    let mut push = |mut v: Value| {
        v["sequence_number"] = json!(ev.len());
        ev.push(v);
    };
    push(json!({"type":"response.created","response":base}));
    push(json!({"type":"response.in_progress","response":base}));
    let mut pad = Rng(output.len() as u64 ^ 0x5eed);
    for (i, item) in output.iter().enumerate() {
        let item_id = item["id"].clone();
        match item.get("type").and_then(Value::as_str) {
            Some("message") => {
                let text = item
                    .pointer("/content/0/text")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                let mut open = item.clone();
                open["status"] = json!("in_progress");
                open["content"] = json!([]);
                push(json!({"type":"response.output_item.added","output_index":i,"item":open}));
                push(
                    json!({"type":"response.content_part.added","item_id":item_id,"output_index":i,"content_index":0,
                    "part":{"type":"output_text","annotations":[],"logprobs":[],"text":""}}),
                );
                for p in reply::pieces(text) {
                    let ob = pad.hex(3 + (pad.0 % 8) as usize);
                    push(
                        json!({"type":"response.output_text.delta","item_id":item_id,"output_index":i,"content_index":0,
                        "delta":p,"logprobs":[],"obfuscation":ob}),
                    );
                }
                push(
                    json!({"type":"response.output_text.done","item_id":item_id,"output_index":i,"content_index":0,
                    "text":text,"logprobs":[]}),
                );
                push(
                    json!({"type":"response.content_part.done","item_id":item_id,"output_index":i,"content_index":0,
                    "part":{"type":"output_text","annotations":[],"logprobs":[],"text":text}}),
                );
                push(json!({"type":"response.output_item.done","output_index":i,"item":item}));
            }
            Some(kind @ ("function_call" | "custom_tool_call")) => {
                // (the field holding the call's input, the events' stem)
                let (field, stem) = if kind == "function_call" {
                    ("arguments", "response.function_call_arguments")
                } else {
                    ("input", "response.custom_tool_call_input")
                };
                let args = item.get(field).and_then(Value::as_str).unwrap_or("");
                let mut open = item.clone();
                open["status"] = json!("in_progress");
                open[field] = json!("");
                push(json!({"type":"response.output_item.added","output_index":i,"item":open}));
                for p in reply::arg_pieces(args) {
                    let ob = pad.hex(4);
                    push(
                        json!({"type":format!("{stem}.delta"),"item_id":item_id,"output_index":i,
                        "delta":p,"obfuscation":ob}),
                    );
                }
                push(
                    json!({"type":format!("{stem}.done"),"item_id":item_id,"output_index":i,field:args}),
                );
                push(json!({"type":"response.output_item.done","output_index":i,"item":item}));
            }
            // Compaction items have no deltas: added, then done.
            _ => {
                push(json!({"type":"response.output_item.added","output_index":i,"item":item}));
                push(json!({"type":"response.output_item.done","output_index":i,"item":item}));
            }
        }
    }
    push(json!({"type":"response.completed","response":done}));
    ev
}

/// The events of a response that failed after it started.
pub(super) fn failed_events(call: &Call<'_>, body: &Value, error: Value) -> Vec<Value> {
    let model = call.model(body);
    let mut rng = Rng(call.n ^ 0xfa11);
    let id = format!("resp_{}", rng.hex(48));
    let base = response_base(&id, &model, body, call.n);
    let mut failed = base.clone();
    failed["status"] = json!("failed");
    failed["error"] = error;
    vec![
        json!({"type":"response.created","sequence_number":0,"response":base}),
        json!({"type":"response.in_progress","sequence_number":1,"response":base}),
        json!({"type":"response.failed","sequence_number":2,"response":failed}),
    ]
}

/// SSE framing: `event: <type>` and the JSON, no `[DONE]`.
pub(super) fn sse(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            format!(
                "event: {}\ndata: {e}\n\n",
                e.get("type").and_then(Value::as_str).unwrap_or("message")
            )
        })
        .collect()
}

pub(super) fn complete(call: &Call<'_>, body: &Value) -> (http::Resp, Option<u64>) {
    let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
    match run(call, body, None) {
        Ok(r) => {
            if r.store {
                call.sim.store(&r.id, r.stored.clone());
            }
            let resp = if stream {
                http::stream_response(call, sse(&r.events), http::SSE, call.gzip)
            } else {
                http::stream_response(call, vec![r.response.to_string()], http::JSON, call.gzip)
            };
            (resp, Some(r.prompt))
        }
        Err((Refusal::Http(st, b), n)) => (http::json(st, &b), n),
        Err((Refusal::Failed(e), n)) => {
            let resp = if stream {
                http::stream_response(call, sse(&failed_events(call, body, e)), http::SSE, false)
            } else {
                http::json(
                    400,
                    &error_body(
                        CONTEXT_MESSAGE,
                        "invalid_request_error",
                        Some("input"),
                        Some("context_length_exceeded"),
                    ),
                )
            };
            (resp, n)
        }
    }
}

/// The conversation a counting or compaction request names.
fn resolve(call: &Call<'_>, body: &Value) -> Vec<Value> {
    let mut items = body
        .get("previous_response_id")
        .and_then(Value::as_str)
        .and_then(|p| call.sim.stored(p))
        .map(|s| s.items)
        .unwrap_or_default();
    items.extend(input_items(body));
    items
}

/// `POST /responses/input_tokens` (openai-python
/// resources/responses/input_tokens.py).
pub(super) fn input_tokens(call: &Call<'_>, body: &Value) -> (http::Resp, Option<u64>) {
    let items = resolve(call, body);
    let n = count_items(body, &items, call.counting(SimApi::OpenAiResponses)).total();
    (
        http::json(
            200,
            &json!({"object":"response.input_tokens","input_tokens":n}),
        ),
        Some(n),
    )
}

/// `POST /responses/compact`: the user's messages kept as they were, the
/// rest replaced by one compaction item (`{"output": [...]}`, as openai/codex
/// codex-api/src/endpoint/compact.rs reads it).
pub(super) fn compact(call: &Call<'_>, body: &Value) -> (http::Resp, Option<u64>) {
    let c = call.counting(SimApi::OpenAiResponses);
    let items = resolve(call, body);
    let n = count_items(body, &items, c).total();
    let mut rng = Rng(n ^ 0xc0ac7);
    let mut output: Vec<Value> = items
        .iter()
        .filter(|it| {
            it.get("type").and_then(Value::as_str).unwrap_or("message") == "message"
                && it.get("role").and_then(Value::as_str) == Some("user")
        })
        .cloned()
        .collect();
    output.push(compaction_item(&items, c, &mut rng));
    let id = format!("resp_{}", rng.hex(48));
    let v = json!({"id":id,"object":"response.compaction","created_at":1_755_013_100u64 + call.n,
        "output":output,"usage":{"input_tokens":n,"input_tokens_details":{"cached_tokens":0},
        "output_tokens":0,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":n}});
    (http::json(200, &v), Some(n))
}
