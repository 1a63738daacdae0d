//! OpenAI chat completions (`/chat/completions`), as OpenAI serves it or as
//! one of the OpenAI-compatible local servers does ([`Flavour`]): the same
//! stream, each server's own usage details and context-length error.

use serde_json::{json, Value};

use super::cache::{Outcome, Style};
use super::http;
use super::prompt::{elements, Builder, Prompt};
use super::reply::{self, content_text, tool_specs, Reply, Rng, Turn};
use super::tokens::Counting;
use super::{Call, Flavour, SimApi};

/// Hidden framing, as OpenAI's cookbook counts it (3 per request for the
/// reply's priming, 4 per message) plus a tools preamble.
const PER_REQUEST: u64 = 3;
const PER_MESSAGE: u64 = 4;
const PER_TOOL_CALL: u64 = 7;
const TOOLS_FRAMING: u64 = 12;

fn content_tokens(b: &Builder, c: &Value) -> u64 {
    match c {
        Value::String(s) => b.tok(s),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p.get("text") {
                Some(t) => b.tok_json(t),
                None => b.tok_json(p),
            })
            .sum(),
        Value::Null => 0,
        other => b.tok_json(other),
    }
}

/// The prompt tokens of a chat request: tools and leading system messages
/// are the head, each message a segment.
pub(super) fn count(body: &Value, c: Counting) -> Prompt {
    let mut b = Builder::new(c);
    b.push_head(body, PER_REQUEST, |b, t| {
        TOOLS_FRAMING + b.tok(&Value::Array(t.to_vec()).to_string())
    });
    let mut head = true;
    for m in elements(body, "messages") {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let mut n = PER_MESSAGE + b.tok(role);
        n += m.get("content").map(|c| content_tokens(&b, c)).unwrap_or(0);
        if let Some(name) = m.get("name") {
            n += 1 + b.tok_json(name);
        }
        for tc in elements(m, "tool_calls") {
            let f = tc.get("function").unwrap_or(&Value::Null);
            n += PER_TOOL_CALL
                + f.get("name").map(|v| b.tok_json(v)).unwrap_or(0)
                + f.get("arguments").map(|v| b.tok_json(v)).unwrap_or(0);
        }
        if let Some(id) = m.get("tool_call_id") {
            n += b.tok_json(id);
        }
        head = head && (role == "system" || role == "developer");
        b.push(head, n, m, false);
    }
    b.finish()
}

/// The last message is the user's own text (not a tool result)?
pub(super) fn turn(body: &Value) -> Turn {
    let user_text = body
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|m| m.last())
        .filter(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .and_then(|m| content_text(m.get("content")));
    let tools = tool_specs(
        body.get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten(),
        |t| {
            let f = t.get("function");
            (
                f.and_then(|f| f.get("name")),
                f.and_then(|f| f.get("parameters")),
            )
        },
    );
    let schema =
        body.get("response_format")
            .and_then(|f| match f.get("type").and_then(Value::as_str) {
                Some("json_schema") => f.pointer("/json_schema/schema").cloned(),
                Some("json_object") => {
                    Some(json!({"type":"object","properties":{"answer":{"type":"string"}}}))
                }
                _ => None,
            });
    Turn {
        user_text,
        tools,
        schema,
    }
}

/// The error body each flavour sends for a status the sim was told to fail with.
pub(super) fn error(flavour: Flavour, status: u16) -> Value {
    match (flavour, status) {
        (Flavour::OpenAi, 429) => {
            json!({"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}})
        }
        (Flavour::OpenAi, 400) => {
            json!({"error":{"message":"We could not parse the JSON body of your request.","type":"invalid_request_error","param":null,"code":null}})
        }
        (Flavour::OpenAi, _) => {
            json!({"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}})
        }
        // vLLM: `ErrorResponse` with the HTTP status as an integer `code`.
        (Flavour::Vllm, s) => {
            json!({"error":{"message":"Internal server error","type":"InternalServerError","param":null,"code":s}})
        }
        (Flavour::LlamaCpp, s) => {
            json!({"error":{"code":s,"message":"Internal server error","type":"server_error"}})
        }
        // Ollama's /v1: invalid_request_error for 400, otherwise api_error, code null
        // (ollama/ollama openai/openai.go `NewError`).
        (Flavour::Ollama, 400) => {
            json!({"error":{"message":"invalid request","type":"invalid_request_error","param":null,"code":null}})
        }
        (Flavour::Ollama, _) => {
            json!({"error":{"message":"internal error","type":"api_error","param":null,"code":null}})
        }
    }
}

/// The request's output cap, where the server's window check counts it.
fn max_output(body: &Value) -> u64 {
    body.get("max_completion_tokens")
        .or_else(|| body.get("max_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

/// Each server's refusal of a prompt larger than its window, status and
/// body as it sends them; `None` when it serves the request (Ollama
/// truncates instead, see [`super::ollama::fit`]).
pub(super) fn over_window(
    flavour: Flavour,
    body: &Value,
    prompt: u64,
    window: u64,
) -> Option<Value> {
    match flavour {
        // OpenAI, the prompt alone over the window. Captured bodies:
        // shared/fixtures/openai-chat/error_context_length_exceeded.json
        // (mckaywrigley/chatbot-ui#102, chathub-dev/chathub#126).
        Flavour::OpenAi => (prompt > window).then(|| json!({"error":{
            "message": format!("This model's maximum context length is {window} tokens. However, your messages resulted in {prompt} tokens. Please reduce the length of the messages."),
            "type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}})),
        // vLLM >= 0.10 checks prompt + max_tokens against max_model_len after
        // tokenizing with truncation at the input limit + 1, so the prompt
        // it names is a lower bound ("at least"), not the real size.
        // Captured bodies: "This model's maximum context length is 262144
        // tokens. However, you requested 0 output tokens and your prompt
        // contains at least 262145 input tokens, for a total of at least
        // 262145 tokens. Please reduce the length of the input prompt or the
        // number of requested output tokens. (parameter=input_tokens,
        // value=262145)", type BadRequestError, param input_tokens, code 400
        // (public issue logs; vLLM's ErrorInfo has an integer code,
        // vllm/entrypoints/openai/engine/protocol.py).
        Flavour::Vllm => {
            let out = max_output(body);
            (prompt + out > window).then(|| {
                let seen = window.saturating_sub(out) + 1;
                json!({"error":{
                    "message": format!("This model's maximum context length is {window} tokens. However, you requested {out} output tokens and your prompt contains at least {seen} input tokens, for a total of at least {} tokens. Please reduce the length of the input prompt or the number of requested output tokens. (parameter=input_tokens, value={seen})", seen + out),
                    "type":"BadRequestError","param":"input_tokens","code":400}})
            })
        }
        // llama.cpp llama-server (context shift off, its default): a task of
        // n_tokens >= n_ctx is refused with ERROR_TYPE_EXCEED_CONTEXT_SIZE,
        // and the error carries both counts
        // (ggml-org/llama.cpp tools/server/server-context.cpp `send_error`,
        // server-task.cpp's error `to_json`).
        Flavour::LlamaCpp => (prompt >= window).then(|| json!({"error":{
            "code":400,
            "message": format!("request ({prompt} tokens) exceeds the available context size ({window} tokens), try increasing it"),
            "type":"exceed_context_size_error","n_prompt_tokens":prompt,"n_ctx":window}})),
        Flavour::Ollama => None,
    }
}

pub(super) fn complete(call: &Call<'_>, body: &Value) -> (http::Resp, u64) {
    let cfg = &*call.cfg;
    let prompt = count(body, call.counting(SimApi::OpenAiChat));
    let mut total = prompt.total();
    if let Some(st) = cfg.fail_status {
        return (http::json(st, &error(cfg.flavour, st)), total);
    }
    if let Some(w) = cfg.context_window {
        if cfg.flavour == Flavour::Ollama {
            total = super::ollama::fit(&prompt, w);
        } else if let Some(e) = over_window(cfg.flavour, body, total, w) {
            return (http::json(400, &e), total);
        }
    }
    let model = call.model(body);
    let cached = call.cache(&model, &prompt, Style::Automatic { granularity: 128 });
    let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
    // The reply depends on the prompt only, so a session replays the same
    // way whatever else the simulator served before it.
    let reply = reply::decide(
        &turn(body),
        cfg.tool_calls,
        total.wrapping_mul(0x2545_F491_4F6C_DD1D),
        "call_",
    );
    let output = call.output_tokens(SimApi::OpenAiChat, &reply);
    let usage = Usage {
        prompt: total,
        cached,
        output,
        flavour: cfg.flavour,
    };
    let events = if stream {
        let include = body
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true);
        stream_events(&model, call.n, &reply, &usage, include && call.with_usage)
    } else {
        vec![body_json(&model, call.n, &reply, &usage, call.with_usage)]
    };
    let ct = if stream { http::SSE } else { http::JSON };
    (http::stream_response(call, events, ct, call.gzip), total)
}

struct Usage {
    prompt: u64,
    cached: Outcome,
    output: u64,
    flavour: Flavour,
}

impl Usage {
    fn json(&self) -> Value {
        let (p, o) = (self.prompt, self.output);
        let mut u = json!({"prompt_tokens":p,"completion_tokens":o,"total_tokens":p+o});
        match self.flavour {
            Flavour::OpenAi => {
                u["prompt_tokens_details"] =
                    json!({"cached_tokens":self.cached.read,"audio_tokens":0});
                u["completion_tokens_details"] = json!({"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0});
            }
            Flavour::LlamaCpp => {
                u["prompt_tokens_details"] = json!({"cached_tokens":self.cached.read});
            }
            // vLLM sends details only with --enable-prompt-tokens-details;
            // Ollama's /v1 never does.
            Flavour::Vllm | Flavour::Ollama => {}
        }
        u
    }
}

fn stream_events(
    model: &str,
    n: u64,
    reply: &Reply,
    usage: &Usage,
    include_usage: bool,
) -> Vec<String> {
    let id = format!("chatcmpl-sim{n:08}");
    let openai = usage.flavour == Flavour::OpenAi;
    // OpenAI pads every chunk with a random `obfuscation` string (length hiding).
    let mut pad = Rng(n);
    let mut obfuscation = move || {
        let len = 3 + (pad.next() % 8) as usize;
        (0..len)
            .map(|_| {
                char::from(
                    b"abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"
                        [(pad.next() % 57) as usize],
                )
            })
            .collect::<String>()
    };
    let base = |choices: Value| {
        let mut v = json!({"id":id,"object":"chat.completion.chunk","created":1_755_012_345u64 + n,
            "model":model});
        if openai {
            v["service_tier"] = json!("default");
            v["system_fingerprint"] = json!("fp_sim0001");
        }
        v["choices"] = choices;
        v
    };
    let mut chunk = |choices: Value| {
        let mut v = base(choices);
        if include_usage && openai {
            v["usage"] = Value::Null;
        }
        if openai {
            v["obfuscation"] = Value::String(obfuscation());
        }
        format!("data: {v}\n\n")
    };
    let mut ev = Vec::new();
    let finish = match reply {
        Reply::Text(t) => {
            ev.push(chunk(json!([{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}])));
            for p in reply::pieces(t) {
                ev.push(chunk(
                    json!([{"index":0,"delta":{"content":p},"logprobs":null,"finish_reason":null}]),
                ));
            }
            "stop"
        }
        Reply::Tool {
            id: cid,
            name,
            input,
        } => {
            ev.push(chunk(json!([{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":cid,"type":"function","function":{"name":name,"arguments":""}}],"refusal":null},"logprobs":null,"finish_reason":null}])));
            for s in reply::arg_pieces(&input.to_string()) {
                ev.push(chunk(json!([{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":s}}]},"logprobs":null,"finish_reason":null}])));
            }
            "tool_calls"
        }
    };
    ev.push(chunk(
        json!([{"index":0,"delta":{},"logprobs":null,"finish_reason":finish}]),
    ));
    if include_usage {
        let mut v = base(json!([]));
        v["usage"] = usage.json();
        if openai {
            v["obfuscation"] = Value::String(obfuscation());
        }
        ev.push(format!("data: {v}\n\n"));
    }
    ev.push("data: [DONE]\n\n".to_string());
    ev
}

fn body_json(model: &str, n: u64, reply: &Reply, usage: &Usage, with_usage: bool) -> String {
    let (message, finish) = match reply {
        Reply::Text(t) => (
            json!({"role":"assistant","content":t,"refusal":null,"annotations":[]}),
            "stop",
        ),
        Reply::Tool { id, name, input } => (
            json!({"role":"assistant","content":null,"tool_calls":[{"id":id,"type":"function","function":{"name":name,"arguments":input.to_string()}}],"refusal":null,"annotations":[]}),
            "tool_calls",
        ),
    };
    let mut v = json!({"id":format!("chatcmpl-sim{n:08}"),"object":"chat.completion","created":1_755_012_345u64 + n,
        "model":model,"choices":[{"index":0,"message":message,"logprobs":null,"finish_reason":finish}],
        "service_tier":"default","system_fingerprint":"fp_sim0001"});
    if with_usage {
        v["usage"] = usage.json();
    }
    v.to_string()
}

/// `GET /v1/models` in OpenAI's list shape.
pub(super) fn models(ids: &[&str]) -> Value {
    let data: Vec<Value> = ids
        .iter()
        .map(|id| json!({"id":id,"object":"model","created":1_715_367_049u64,"owned_by":"system"}))
        .collect();
    json!({"object":"list","data":data})
}
