//! Google Gemini (`models/{m}:generateContent`, `:streamGenerateContent`
//! with and without `alt=sse`, `:countTokens`, `models`): cumulative
//! `usageMetadata` on every chunk, CRLF event framing and Google's JSON
//! spacing, implicit prompt caching reported as `cachedContentTokenCount`.

use std::io;

use serde_json::{json, Value};

use super::cache::{Outcome, Style};
use super::http;
use super::prompt::{Builder, Prompt};
use super::reply::{self, content_text, tool_specs, Reply, Rng, Turn};
use super::tokens::Counting;
use super::{Call, SimApi};

const PER_REQUEST: u64 = 1;
const PER_CONTENT: u64 = 3;
const PER_PART: u64 = 1;
const SYSTEM_FRAMING: u64 = 4;
const TOOLS_FRAMING: u64 = 9;
const PER_DECLARATION: u64 = 4;
const PER_CALL: u64 = 5;
/// Gemini's flat price of an image.
const IMAGE: u64 = 258;

/// A field under its proto3 JSON name or its snake_case one (the REST API
/// takes both).
fn field<'a>(v: &'a Value, camel: &str, snake: &str) -> Option<&'a Value> {
    v.get(camel).or_else(|| v.get(snake))
}

fn part_tokens(b: &Builder, p: &Value) -> u64 {
    PER_PART
        + if let Some(t) = p.get("text") {
            b.tok_json(t)
        } else if let Some(fc) = field(p, "functionCall", "function_call") {
            PER_CALL
                + fc.get("name").map(|v| b.tok_json(v)).unwrap_or(0)
                + fc.get("args").map(|v| b.tok_json(v)).unwrap_or(0)
        } else if let Some(fr) = field(p, "functionResponse", "function_response") {
            PER_CALL
                + fr.get("name").map(|v| b.tok_json(v)).unwrap_or(0)
                + fr.get("response").map(|v| b.tok_json(v)).unwrap_or(0)
        } else if field(p, "inlineData", "inline_data").is_some()
            || field(p, "fileData", "file_data").is_some()
        {
            IMAGE
        } else {
            b.tok_json(p)
        }
}

fn parts_tokens(b: &Builder, c: &Value) -> u64 {
    match c.get("parts") {
        Some(Value::Array(ps)) => ps.iter().map(|p| part_tokens(b, p)).sum(),
        _ => match c {
            Value::String(s) => b.tok(s),
            _ => 0,
        },
    }
}

/// A `generateContent` body, or a `countTokens` body that wraps one.
fn request(body: &Value) -> &Value {
    field(body, "generateContentRequest", "generate_content_request").unwrap_or(body)
}

/// System instruction and tools as the head, then each content.
pub(super) fn count(body: &Value, c: Counting) -> Prompt {
    let body = request(body);
    let mut b = Builder::new(c);
    let decls: Vec<&Value> = declarations(body).collect();
    let tools_raw = if decls.is_empty() {
        0
    } else {
        TOOLS_FRAMING
            + decls
                .iter()
                .map(|d| PER_DECLARATION + b.tok(&d.to_string()))
                .sum::<u64>()
    };
    b.push(
        true,
        PER_REQUEST + tools_raw,
        body.get("tools").unwrap_or(&Value::Null),
        false,
    );
    if let Some(s) = field(body, "systemInstruction", "system_instruction") {
        let n = SYSTEM_FRAMING + parts_tokens(&b, s);
        b.push(true, n, s, false);
    }
    for ct in body
        .get("contents")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let role = ct.get("role").and_then(Value::as_str).unwrap_or("user");
        let n = PER_CONTENT + b.tok(role) + parts_tokens(&b, ct);
        b.push(false, n, ct, false);
    }
    b.finish()
}

/// Every function declaration of a request's tools.
fn declarations(body: &Value) -> impl Iterator<Item = &Value> {
    body.get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .flat_map(|t| {
            field(t, "functionDeclarations", "function_declarations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
        })
}

pub(super) fn turn(body: &Value) -> Turn {
    let user_text = body
        .get("contents")
        .and_then(Value::as_array)
        .and_then(|c| c.last())
        .filter(|c| c.get("role").and_then(Value::as_str).unwrap_or("user") == "user")
        .filter(|c| {
            !c.get("parts")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .any(|p| field(p, "functionResponse", "function_response").is_some())
        })
        .and_then(|c| content_text(c.get("parts")));
    let tools = tool_specs(declarations(body), |d| {
        (
            d.get("name"),
            d.get("parameters")
                .or_else(|| field(d, "parametersJsonSchema", "parameters_json_schema")),
        )
    });
    let schema = field(body, "generationConfig", "generation_config").and_then(|g| {
        field(g, "responseJsonSchema", "response_json_schema")
            .or_else(|| field(g, "responseSchema", "response_schema"))
            .cloned()
    });
    Turn {
        user_text,
        tools,
        schema,
    }
}

/// Google's error envelope.
pub(super) fn error_body(code: u16, message: &str, status: &str) -> Value {
    json!({"error":{"code":code,"message":message,"status":status}})
}

pub(super) fn error(status: u16) -> Value {
    match status {
        429 => error_body(
            429,
            "Resource has been exhausted (e.g. check quota).",
            "RESOURCE_EXHAUSTED",
        ),
        503 => error_body(
            503,
            "The model is overloaded. Please try again later.",
            "UNAVAILABLE",
        ),
        400 => error_body(400, "Invalid JSON payload received.", "INVALID_ARGUMENT"),
        404 => error_body(404, "Requested entity was not found.", "NOT_FOUND"),
        s => error_body(s, "An internal error has occurred.", "INTERNAL"),
    }
}

/// HTTP 400 INVALID_ARGUMENT, "The input token count (P) exceeds the maximum
/// number of tokens allowed (W)." (google-gemini/gemini-cli#4231, #6678,
/// #11248, #12098; fixture gemini/error_input_token_count_exceeded.json).
pub(super) fn over_window(prompt: u64, window: u64) -> Value {
    error_body(
        400,
        &format!(
            "The input token count ({prompt}) exceeds the maximum number of tokens allowed ({window})."
        ),
        "INVALID_ARGUMENT",
    )
}

/// The model a path names (`…/models/{model}:method`).
pub(super) fn model_of(path: &str) -> String {
    let tail = path.rsplit("/models/").next().unwrap_or(path);
    tail.split(':').next().unwrap_or(tail).to_string()
}

/// serde_json output with Google's spacing: `"key": value`, no space after
/// commas (what the fixtures show Gemini sending).
fn google_json(v: &Value) -> String {
    struct Google;
    impl serde_json::ser::Formatter for Google {
        fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Google);
    if serde::Serialize::serialize(v, &mut ser).is_err() {
        return v.to_string();
    }
    String::from_utf8(out).unwrap_or_else(|_| v.to_string())
}

struct Usage {
    prompt: u64,
    cached: Outcome,
}

impl Usage {
    fn json(&self, candidates: u64) -> Value {
        let mut u = json!({"promptTokenCount":self.prompt,"candidatesTokenCount":candidates,
            "totalTokenCount":self.prompt + candidates,
            "promptTokensDetails":[{"modality":"TEXT","tokenCount":self.prompt}]});
        // proto3 JSON leaves zero counts out.
        if self.cached.read > 0 {
            u["cachedContentTokenCount"] = json!(self.cached.read);
            u["cacheTokensDetails"] = json!([{"modality":"TEXT","tokenCount":self.cached.read}]);
        }
        u
    }
}

pub(super) fn complete(call: &Call<'_>, body: &Value) -> (http::Resp, u64) {
    let cfg = &*call.cfg;
    let prompt = count(body, call.counting(SimApi::Gemini));
    let total = prompt.total();
    if let Some(st) = cfg.fail_status {
        return (http::json(st, &error(st)), total);
    }
    if let Some(w) = cfg.context_window {
        if total > w {
            return (http::json(400, &over_window(total, w)), total);
        }
    }
    let model = model_of(call.path);
    let cached = call.cache(&model, &prompt, Style::Automatic { granularity: 1 });
    let stream = call.path.ends_with(":streamGenerateContent");
    let sse = call
        .query
        .is_some_and(|q| q.split('&').any(|kv| kv == "alt=sse"));
    let reply = reply::decide(
        &turn(body),
        cfg.tool_calls,
        total.wrapping_mul(0x2545_F491_4F6C_DD1D),
        "",
    );
    let usage = Usage {
        prompt: total,
        cached,
    };
    let mut rng = Rng(total ^ 0x6e);
    let response_id: String = {
        const A: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz0123456789";
        (0..22)
            .map(|_| char::from(A[(rng.next() % A.len() as u64) as usize]))
            .collect()
    };
    let chunk = |parts: Value, finish: bool, candidates: u64| {
        let mut cand = json!({"content":{"parts":parts,"role":"model"},"index":0});
        if finish {
            cand["finishReason"] = json!("STOP");
        }
        let mut v = json!({"candidates":[cand]});
        if call.with_usage {
            v["usageMetadata"] = usage.json(candidates);
        }
        v["modelVersion"] = json!(model);
        v["responseId"] = json!(response_id);
        v
    };
    let enc = call.counting(SimApi::Gemini).encoding;
    let chunks: Vec<Value> = match &reply {
        Reply::Text(t) => {
            let ps = reply::pieces(t);
            // Three or so chunks, usage cumulative on each.
            let per = ps.len().div_ceil(3).max(1);
            let groups: Vec<String> = ps.chunks(per).map(|g| g.concat()).collect();
            let mut so_far = String::new();
            let last = groups.len().saturating_sub(1);
            groups
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    so_far.push_str(g);
                    chunk(
                        json!([{ "text": g }]),
                        i == last,
                        super::tokens::tok(enc, &so_far),
                    )
                })
                .collect()
        }
        Reply::Tool { name, input, .. } => vec![chunk(
            json!([{"functionCall":{"name":name,"args":input}}]),
            true,
            call.output_tokens(SimApi::Gemini, &reply),
        )],
    };
    let resp = if !stream {
        // One body: the parts joined, the final usage.
        let mut whole = chunks.last().cloned().unwrap_or(Value::Null);
        if let Reply::Text(t) = &reply {
            whole["candidates"][0]["content"]["parts"] = json!([{ "text": t }]);
        }
        http::stream_response(call, vec![google_json(&whole)], http::JSON, call.gzip)
    } else if sse {
        let events = chunks
            .iter()
            .map(|c| format!("data: {}\r\n\r\n", google_json(c)))
            .collect();
        http::stream_response(call, events, http::SSE, call.gzip)
    } else {
        // Without alt=sse: a JSON array, streamed element by element.
        let n = chunks.len();
        let events = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let open = if i == 0 { "[" } else { ",\r\n" };
                let close = if i + 1 == n { "]" } else { "" };
                format!("{open}{}{close}", google_json(c))
            })
            .collect();
        http::stream_response(call, events, http::JSON, call.gzip)
    };
    (resp, total)
}

/// `:countTokens` (python-genai `CountTokensResponse`).
pub(super) fn count_tokens(call: &Call<'_>, body: &Value) -> (http::Resp, u64) {
    let n = count(body, call.counting(SimApi::Gemini)).total();
    (
        http::json(
            200,
            &json!({"totalTokens":n,"promptTokensDetails":[{"modality":"TEXT","tokenCount":n}]}),
        ),
        n,
    )
}

fn model_json(id: &str) -> Value {
    json!({"name":format!("models/{id}"),"version":"001","displayName":id,
        "description":"A model of the simulated provider.","inputTokenLimit":1_048_576u64,
        "outputTokenLimit":65_536,"supportedGenerationMethods":["generateContent","countTokens"],
        "temperature":1.0,"topP":0.95,"topK":64,"maxTemperature":2.0,"thinking":true})
}

/// `GET models` and `GET models/{m}`.
pub(super) fn models(path: &str, ids: &[&str]) -> Value {
    if !path.ends_with("/models") {
        return model_json(&model_of(path));
    }
    json!({"models": ids.iter().map(|id| model_json(id)).collect::<Vec<_>>()})
}
