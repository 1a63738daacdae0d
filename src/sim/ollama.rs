//! Ollama's native API (`/api/chat` NDJSON, `/api/tags`, `/api/show`,
//! `/api/version`), counted as a Llama 3 chat template would render the
//! conversation. Over its window (`num_ctx`) Ollama does not refuse: it
//! drops the oldest messages, then truncates, and counts what is left.

use serde_json::{json, Value};

use super::cache::Style;
use super::http;
use super::prompt::{elements, Builder, Prompt};
use super::reply::{self, Reply, Turn};
use super::tokens::Counting;
use super::{Call, SimApi};

/// `<|begin_of_text|>` and the assistant header that primes the reply.
const PER_REQUEST: u64 = 5;
/// `<|start_header_id|>`, `<|end_header_id|>`, the blank line, `<|eot_id|>`.
const PER_MESSAGE: u64 = 4;
/// Llama 3.1's tool-calling instructions around the tool list.
const TOOLS_PREAMBLE: u64 = 58;
const PER_TOOL: u64 = 2;
const PER_TOOL_CALL: u64 = 3;
const PER_IMAGE: u64 = 768;

pub(super) fn count(body: &Value, c: Counting) -> Prompt {
    let mut b = Builder::new(c);
    b.push_head(body, PER_REQUEST, |b, t| {
        TOOLS_PREAMBLE
            + t.iter()
                .map(|x| PER_TOOL + b.tok(&x.to_string()))
                .sum::<u64>()
    });
    let mut head = true;
    for m in elements(body, "messages") {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let mut n = PER_MESSAGE + b.tok(role);
        n += m.get("content").map(|v| b.tok_json(v)).unwrap_or(0);
        n += m
            .get("images")
            .and_then(Value::as_array)
            .map_or(0, |i| i.len() as u64 * PER_IMAGE);
        for tc in elements(m, "tool_calls") {
            let f = tc.get("function").unwrap_or(&Value::Null);
            let call = json!({"name": f.get("name"), "parameters": f.get("arguments")});
            n += PER_TOOL_CALL + b.tok(&call.to_string());
        }
        head = head && role == "system";
        b.push(head, n, m, false);
    }
    b.finish()
}

/// What Ollama evaluates of a prompt larger than its window: the oldest
/// non-system messages dropped until it fits (the latest is always kept,
/// server/prompt.go `chatPrompt`), then the runner's truncation to the
/// window ("truncating input prompt" limit=… prompt=…, runner.go). No
/// error reaches the client (ollama/ollama#4967 "API Silently Truncates
/// Conversation", #8099).
pub(super) fn fit(prompt: &Prompt, window: u64) -> u64 {
    let mut total = prompt.total();
    let last = prompt.segs.len().saturating_sub(1);
    for (i, s) in prompt.segs.iter().enumerate() {
        if total <= window {
            break;
        }
        if !s.head && i != last {
            total -= s.tokens;
        }
    }
    total.min(window)
}

/// Native chat names messages and tools as OpenAI chat does.
pub(super) fn turn(body: &Value) -> Turn {
    super::openai_chat::turn(body)
}

/// Ollama's error shape: `{"error": "<string>"}` (docs/api/errors.mdx).
pub(super) fn error(status: u16) -> Value {
    json!({ "error": match status {
        404 => "model not found, try pulling it first",
        400 => "invalid request",
        _ => "an error was encountered while running the model",
    }})
}

fn created_at(n: u64, step: u64) -> String {
    format!(
        "2025-08-12T10:15:{:02}.{:09}Z",
        (n % 60),
        (step * 11_000_000) % 1_000_000_000
    )
}

pub(super) fn complete(call: &Call<'_>, body: &Value) -> (http::Resp, u64) {
    let cfg = &*call.cfg;
    let prompt = count(body, call.counting(SimApi::Ollama));
    let mut total = prompt.total();
    if let Some(st) = cfg.fail_status {
        return (http::json(st, &error(st)), total);
    }
    let num_ctx = body
        .pointer("/options/num_ctx")
        .and_then(Value::as_u64)
        .or(cfg.context_window);
    if let Some(w) = num_ctx {
        total = fit(&prompt, w);
    }
    let model = call.model(body);
    // Ollama reuses its KV cache but reports no cache field; the accounting
    // still sees the reuse.
    call.cache(&model, &prompt, Style::Automatic { granularity: 1 });
    let stream = body.get("stream").and_then(Value::as_bool) != Some(false);
    let reply = reply::decide(
        &turn(body),
        cfg.tool_calls,
        total.wrapping_mul(0x2545_F491_4F6C_DD1D),
        "call_",
    );
    let output = call.output_tokens(SimApi::Ollama, &reply);
    let n = call.n;
    let line = |step: u64, message: Value| json!({"model":model,"created_at":created_at(n, step),"message":message,"done":false});
    let mut lines = Vec::new();
    let mut whole = json!({"role":"assistant","content":""});
    match &reply {
        Reply::Text(t) => {
            for (i, p) in reply::pieces(t).into_iter().enumerate() {
                lines.push(line(i as u64, json!({"role":"assistant","content":p})));
            }
            whole["content"] = json!(t);
        }
        Reply::Tool { id, name, input } => {
            let calls = json!([{"id":id,"function":{"index":0,"name":name,"arguments":input}}]);
            lines.push(line(
                0,
                json!({"role":"assistant","content":"","tool_calls":calls}),
            ));
            whole["tool_calls"] = calls;
        }
    }
    let mut done = json!({"model":model,"created_at":created_at(n, lines.len() as u64 + 1),
        "message":{"role":"assistant","content":""},"done":true,"done_reason":"stop",
        "total_duration":174_560_334u64 + total * 1000,"load_duration":20_871_500u64});
    if call.with_usage {
        // prompt_eval_count is `omitempty`: a response without usage lacks it.
        done["prompt_eval_count"] = json!(total);
        done["eval_count"] = json!(output);
    }
    done["prompt_eval_duration"] = json!(total * 400_000);
    done["eval_duration"] = json!(output * 20_000_000);
    let events = if stream {
        lines.push(done);
        lines.iter().map(|l| format!("{l}\n")).collect()
    } else {
        done["message"] = whole;
        vec![done.to_string()]
    };
    let ct = if stream { http::NDJSON } else { http::JSON };
    (http::stream_response(call, events, ct, call.gzip), total)
}

/// `GET /api/tags`.
pub(super) fn tags(ids: &[&str]) -> Value {
    let models: Vec<Value> = ids
        .iter()
        .map(|id| {
            let name = if id.contains(':') {
                id.to_string()
            } else {
                format!("{id}:latest")
            };
            json!({"name":name,"model":name,"modified_at":"2025-08-12T10:00:00.000000000Z",
                "size":2_019_393_189u64,"digest":"a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72",
                "details":{"parent_model":"","format":"gguf","family":"llama","families":["llama"],
                    "parameter_size":"3.2B","quantization_level":"Q4_K_M"}})
        })
        .collect();
    json!({ "models": models })
}

/// `POST /api/show`.
pub(super) fn show(window: Option<u64>) -> Value {
    json!({"modelfile":"FROM sim\n","parameters":"","template":"{{ .Prompt }}",
        "details":{"parent_model":"","format":"gguf","family":"llama","families":["llama"],
            "parameter_size":"3.2B","quantization_level":"Q4_K_M"},
        "model_info":{"general.architecture":"llama","llama.context_length":window.unwrap_or(131_072)},
        "capabilities":["completion","tools"]})
}
