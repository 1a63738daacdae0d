//! OpenAI chat completions (`/chat/completions`), and every server that speaks
//! it (vLLM, llama.cpp, Ollama's `/v1`, OpenRouter).

use super::{
    count, field, first_valued, has_member, last_valued, openai_error_body, truthy, Api,
    CountedField, ErrorShape, GenAi, Node, Observed, Part, Provider, Usage, ERROR, USAGE,
};
use crate::estimate::Unit;
use crate::inspect::RequestView;

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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

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
