//! OpenAI chat completions (`/chat/completions`), and every server that speaks
//! it (vLLM, llama.cpp, Ollama's `/v1`, OpenRouter).

use std::ops::Range;

use super::walk::{detail_of, type_of, Count};
use super::ImagePricing;
use super::{
    count, error_object, field, first_valued, has_member, last_valued, number_after,
    openai_error_body, truthy, Api, ContextError, CountedField, ErrorShape, GenAi, Node, Observed,
    Part, PromptCache, Provider, Usage, Vocabulary, ERROR, USAGE,
};
use super::{Element, Unit};
use crate::json::text::{self as json, get, kind};
use crate::json::RequestView;

pub struct OpenAiChat;

impl Provider for OpenAiChat {
    fn api(&self) -> Api {
        Api::OpenAiChat
    }
    fn genai(&self) -> GenAi {
        GenAi {
            operation: "chat",
            provider: "openai",
        }
    }
    fn matches_path(&self, path: &str) -> bool {
        path.ends_with("/chat/completions")
    }
    fn model(&self, _path: &str, req: &RequestView<'_>) -> Option<String> {
        req.str("model").map(|s| s.into_owned())
    }
    fn is_stream(&self, _path: &str, _query: Option<&str>, req: &RequestView<'_>) -> bool {
        req.get::<bool>("stream").unwrap_or(false)
    }
    fn counted_fields(&self) -> &'static [CountedField] {
        const FIELDS: &[CountedField] = &[
            field("tools", Unit::ChatTool, true, Part::Other),
            field("functions", Unit::ChatFunction, true, Part::Other),
            field("messages", Unit::ChatMessage, true, Part::History),
        ];
        FIELDS
    }
    /// The cookbook's `num_tokens_for_tools`: 12 to close the tool block.
    fn block_framing(&self, unit: Unit) -> u64 {
        match unit {
            Unit::ChatTool | Unit::ChatFunction => 12,
            _ => 0,
        }
    }
    fn image_pricing(&self) -> ImagePricing {
        ImagePricing::OpenAi
    }
    /// Every current OpenAI model.
    fn default_vocabulary(&self) -> Vocabulary {
        Vocabulary::O200kBase
    }
    /// Its streams end without usage unless `stream_options.include_usage`.
    fn usage_on_request(&self) -> bool {
        true
    }
    fn walk(&self, unit: Unit, raw: &str, cx: &mut dyn Count) {
        match unit {
            Unit::ChatMessage => message(cx, raw),
            Unit::ChatTool => {
                cx.framing(PER_TOOL_DEF);
                tool(cx, raw);
            }
            Unit::ChatFunction => {
                cx.framing(PER_TOOL_DEF);
                let obj = json::object(raw).unwrap_or_default();
                cx.definition(&obj, &["name", "description", "parameters"]);
            }
            _ => {}
        }
    }
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64> {
        req.get("max_completion_tokens")
            .or_else(|| req.get("max_tokens"))
    }
    fn may_carry_usage(&self, _event: Option<&str>, data: &[u8]) -> bool {
        // With injection every chunk carries `"usage":null`: only a real object counts.
        has_member(data, &USAGE) || has_member(data, &ERROR)
    }
    fn sse_relevant_from(&self, raw: &[u8]) -> usize {
        // Usage is cumulative and `observe` keeps the last: of a burst only
        // the last valued one is read (one search from the end, where a
        // search from the front restarts at every `"usage":null`). Errors
        // are read wherever they are.
        last_valued(raw, &USAGE).min(first_valued(raw, &ERROR))
    }
    fn reads(&self) -> &'static [&'static str] {
        &[
            "usage",
            "error",
            "prompt_tokens",
            "completion_tokens",
            "prompt_tokens_details",
            "cached_tokens",
            "cache_write_tokens",
        ]
    }
    fn observe(&self, _event: Option<&str>, json: &Node, acc: &mut Observed) {
        if truthy(json.get("error")) {
            acc.stream_error = true;
        }
        if let Some(u) = json.get("usage").filter(|u| u.is_object()) {
            acc.usage = usage(u);
        }
    }
    fn error_body(&self, shape: ErrorShape, kind: &str, message: &str) -> Vec<u8> {
        openai_error_body(shape, kind, message)
    }
    fn context_error(&self, status: u16, body: &[u8]) -> Option<ContextError> {
        if !(400..500).contains(&status) {
            return None;
        }
        let e = error_object(body)?;
        // llama.cpp's llama-server puts both numbers in fields of their own
        // (tools/server `ERROR_TYPE_EXCEED_CONTEXT_SIZE`).
        if let Some(window) = e.get("n_ctx").and_then(serde_json::Value::as_u64) {
            return Some(ContextError {
                window,
                prompt: e.get("n_prompt_tokens").and_then(serde_json::Value::as_u64),
                prompt_at_least: None,
            });
        }
        context_message(e.get("message")?.as_str()?)
    }
    /// Automatic for prompts of 1024 tokens and more, hits in 128-token
    /// increments (platform.openai.com/docs/guides/prompt-caching); the
    /// OpenAI-compatible servers are taken to do the same.
    fn prompt_cache(&self) -> PromptCache {
        PromptCache::Automatic {
            min: 1024,
            granularity: 128,
        }
    }
    fn element(&self, b: &[u8], r: Range<usize>) -> Option<Element> {
        super::chat_element(b, r)
    }
}

/// The context-length refusals of OpenAI and the servers that copy its
/// wording, each with the numbers it names:
///
/// - OpenAI: "This model's maximum context length is W tokens. However,
///   your messages resulted in P tokens." (fixture
///   openai-chat/error_context_length_exceeded.json), or with a completion
///   asked for, "However, you requested T tokens (P in the messages, O in
///   the completion)."
/// - vLLM >= 0.10: "... maximum context length is W tokens. However, you
///   requested O output tokens and your prompt contains at least S input
///   tokens ..." — it stops tokenizing one past what fits, so S is a
///   lower bound (vllm/entrypoints/openai/serving_engine.py); with
///   `max_tokens` too large: "... maximum context length is W tokens and
///   your request has P input tokens (O > W - P)".
/// - llama.cpp's llama-server: "request (P tokens) exceeds the available
///   context size (W tokens), try increasing it" (and the fields read above).
pub(crate) fn context_message(msg: &str) -> Option<ContextError> {
    if let Some(window) = number_after(msg, "available context size") {
        return Some(ContextError {
            window,
            prompt: number_after(msg, "request"),
            prompt_at_least: None,
        });
    }
    let window = number_after(msg, "maximum context length is")?;
    let exact = number_after(msg, "your messages resulted in")
        .or_else(|| {
            // "(P in the messages, O in the completion)"
            let at = msg.find(" in the messages")?;
            let open = msg[..at].rfind('(')?;
            msg[open + 1..at].trim().replace(',', "").parse().ok()
        })
        .or_else(|| number_after(msg, "your request has"));
    Some(ContextError {
        window,
        prompt: exact,
        prompt_at_least: match exact {
            Some(_) => None,
            None => number_after(msg, "your prompt contains at least"),
        },
    })
}

/// `CompletionUsage`: `prompt_tokens` already includes the cached part.
fn usage(u: &Node) -> Usage {
    let details = u.get("prompt_tokens_details");
    let input = count(u, "prompt_tokens");
    Usage {
        input,
        cached_input: details.and_then(|d| count(d, "cached_tokens")),
        cache_creation: Some(
            details
                .and_then(|d| count(d, "cache_write_tokens"))
                .unwrap_or(0),
        ),
        output: count(u, "completion_tokens"),
        total_context: input,
    }
}

// ---- the message walk ----------------------------------------------------

/// The cookbook's framing (`provider/walk.rs`), shared with Responses.
pub(super) const PER_MESSAGE: u64 = 3;
const PER_NAME: u64 = 1;
const PER_TOOL_CALL: u64 = 3;
pub(super) const PER_TOOL_DEF: u64 = 7;

fn message(cx: &mut dyn Count, raw: &str) {
    cx.framing(PER_MESSAGE);
    let Some(obj) = json::object(raw) else {
        cx.generic(raw);
        return;
    };
    for (k, v) in &obj {
        match k.as_ref() {
            "role" => match json::string(v.get()) {
                Some(r) => cx.framing_text(&r),
                None => cx.value(v.get()),
            },
            "name" => {
                cx.value(v.get());
                cx.framing(PER_NAME);
            }
            "content" => content(cx, v.get()),
            "refusal" => {
                if let Some(s) = json::string(v.get()) {
                    cx.text(&s);
                }
            }
            "tool_calls" => {
                for call in json::array(v.get()).unwrap_or_default() {
                    let call = json::object(call.get()).unwrap_or_default();
                    let f = get(&call, "function")
                        .or_else(|| get(&call, "custom"))
                        .and_then(|f| json::object(f.get()));
                    if let Some(f) = f {
                        cx.function_call(&f, PER_TOOL_CALL);
                    }
                }
            }
            "function_call" => {
                if let Some(f) = json::object(v.get()) {
                    cx.function_call(&f, PER_TOOL_CALL);
                }
            }
            _ => {}
        }
    }
}

/// A `{type: "function", function: {name, description, parameters}}`
/// tool (the Ollama tool too); any other tool as its JSON.
pub(super) fn tool(cx: &mut dyn Count, raw: &str) {
    let obj = json::object(raw).unwrap_or_default();
    match get(&obj, "function").and_then(|f| json::object(f.get())) {
        Some(f) => cx.definition(&f, &["name", "description", "parameters"]),
        None => cx.json(raw),
    }
}

/// Chat `content`: a string, or parts (`text`, `image_url`, audio, files);
/// also Responses content and Ollama's.
pub(super) fn content(cx: &mut dyn Count, raw: &str) {
    match kind(raw) {
        b'"' => {
            if let Some(s) = json::string(raw) {
                cx.text(&s);
            }
        }
        b'[' => {
            for part in json::array(raw).unwrap_or_default() {
                self::part(cx, part.get());
            }
        }
        b'n' => {}
        _ => cx.generic(raw),
    }
}

/// One content part of either OpenAI API.
pub(super) fn part(cx: &mut dyn Count, raw: &str) {
    let Some(obj) = json::object(raw) else {
        cx.generic(raw);
        return;
    };
    match type_of(&obj).as_deref() {
        Some("text" | "input_text" | "output_text" | "summary_text" | "reasoning_text") => {
            cx.str_field(&obj, "text")
        }
        Some("refusal") => cx.str_field(&obj, "refusal"),
        Some("image_url") => {
            let Some(iu) = get(&obj, "image_url") else {
                return;
            };
            let (url, detail) = match json::object(iu.get()) {
                Some(o) => (
                    get(&o, "url").and_then(|u| json::string(u.get())),
                    get(&o, "detail").and_then(|d| json::string(d.get())),
                ),
                None => (json::string(iu.get()), None),
            };
            cx.image_url(url.as_deref().unwrap_or(""), detail_of(detail.as_deref()));
        }
        Some("input_image") => {
            let url = get(&obj, "image_url").and_then(|u| json::string(u.get()));
            let detail = get(&obj, "detail").and_then(|d| json::string(d.get()));
            cx.image_url(url.as_deref().unwrap_or(""), detail_of(detail.as_deref()));
        }
        Some("file" | "input_file") => cx.document(),
        _ => cx.generic(raw),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn learned(status: u16, body: &str) -> Option<(u64, Option<u64>, Option<u64>)> {
        OpenAiChat
            .context_error(status, body.as_bytes())
            .map(|e| (e.window, e.prompt, e.prompt_at_least))
    }

    #[test]
    fn context_errors_teach_the_window_and_the_prompt() {
        let fixture =
            include_str!("../../tests/fixtures/openai-chat/error_context_length_exceeded.json");
        assert_eq!(learned(400, fixture), Some((128_000, Some(131_419), None)));
        // The request's own completion named beside the messages.
        let completion = r#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, you requested 8,503 tokens (7,503 in the messages, 1000 in the completion). Please reduce the length of the messages or completion.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
        assert_eq!(learned(400, completion), Some((8192, Some(7503), None)));
        // vLLM >= 0.10: the prompt is only a lower bound.
        let vllm = r#"{"error":{"message":"This model's maximum context length is 262144 tokens. However, you requested 0 output tokens and your prompt contains at least 262145 input tokens, for a total of at least 262145 tokens. Please reduce the length of the input prompt or the number of requested output tokens. (parameter=input_tokens, value=262145)","type":"BadRequestError","param":"input_tokens","code":400}}"#;
        assert_eq!(learned(400, vllm), Some((262_144, None, Some(262_145))));
        let too_many = r#"{"error":{"message":"'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 - 2778). None","type":"BadRequestError","param":null,"code":400}}"#;
        assert_eq!(learned(400, too_many), Some((4096, Some(2778), None)));
        // llama.cpp: the fields, or the message alone.
        let llama = r#"{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9000,"n_ctx":8192}}"#;
        assert_eq!(learned(400, llama), Some((8192, Some(9000), None)));
        let message_only = r#"{"error":{"code":400,"message":"request (9000 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error"}}"#;
        assert_eq!(learned(400, message_only), Some((8192, Some(9000), None)));
        // Not a context-length error, not a client error, not JSON: nothing.
        let quota = include_str!("../../tests/fixtures/openai-chat/error_insufficient_quota.json");
        assert_eq!(learned(429, quota), None);
        assert_eq!(learned(400, quota), None);
        assert_eq!(learned(500, fixture), None);
        assert_eq!(learned(400, "maximum context length is 5 tokens"), None);
        // Older llama.cpp said it without numbers.
        let old = r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"invalid_request_error"}}"#;
        assert_eq!(learned(400, old), None);
    }

    #[test]
    fn error_shapes() {
        let b = OpenAiChat.error_body(
            ErrorShape::ContextLength {
                projected: 130000,
                window: 128000,
            },
            "context-budget",
            "",
        );
        assert_eq!(
            std::str::from_utf8(&b).unwrap(),
            r#"{"error":{"code":"context_length_exceeded","message":"This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens. Please reduce the length of the messages.","param":"messages","type":"invalid_request_error"}}"#
        );
        let v: Value = serde_json::from_slice(&OpenAiChat.error_body(
            ErrorShape::SessionBudget {
                spent: 5,
                budget: 4,
            },
            "session-budget",
            "x",
        ))
        .unwrap();
        assert_eq!(v["error"]["code"], "session_budget_exceeded");
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("session_budget_exceeded:"));
        let v: Value = serde_json::from_slice(&OpenAiChat.error_body(
            ErrorShape::Generic { status: 502 },
            "upstream-connect",
            "down",
        ))
        .unwrap();
        assert_eq!(v["error"]["type"], "server_error");
        assert_eq!(v["error"]["code"], "upstream_connect");
        assert!(v["error"].get("param").is_some());
    }
}
