//! Anthropic Messages (`/messages`): input and cache counts in
//! `message_start`, cumulative replacements in `message_delta`.

use serde_json::Value;

use super::{
    count, first_valued, has_member, session_budget_message, Api, CountedField, ErrorShape, Node,
    Observed, Provider, ERROR, USAGE,
};
use crate::inspect::RequestView;

pub struct Anthropic;

impl Provider for Anthropic {
    fn api(&self) -> Api {
        Api::Anthropic
    }
    fn matches_path(&self, path: &str) -> bool {
        path.ends_with("/messages")
    }
    fn model(&self, _path: &str, req: &RequestView<'_>) -> Option<String> {
        req.str("model").map(|s| s.into_owned())
    }
    fn is_stream(&self, _path: &str, _query: Option<&str>, req: &RequestView<'_>) -> bool {
        req.get::<bool>("stream").unwrap_or(false)
    }
    fn counted_fields(&self) -> &'static [CountedField] {
        &[
            CountedField {
                name: "system",
                per_element: false,
            },
            CountedField {
                name: "tools",
                per_element: false,
            },
            CountedField {
                name: "messages",
                per_element: true,
            },
        ]
    }
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64> {
        req.get("max_tokens")
    }
    fn count_request(&self, path: &str, req: &RequestView<'_>) -> Option<(String, Vec<u8>)> {
        let body = super::subset_object(
            req,
            &[
                "model",
                "messages",
                "system",
                "tools",
                "tool_choice",
                "thinking",
                "mcp_servers",
            ],
        );
        Some((format!("{path}/count_tokens"), body))
    }
    fn count_response(&self, json: &Value) -> Option<u64> {
        super::count(json, "input_tokens")
    }
    fn may_carry_usage(&self, event: Option<&str>, data: &[u8]) -> bool {
        match event {
            Some(e) => matches!(e, "message_start" | "message_delta" | "error"),
            // No event names (a non-stream body, or a proxy that dropped them).
            None => has_member(data, &USAGE) || has_member(data, &ERROR),
        }
    }
    fn sse_relevant_from(&self, raw: &[u8]) -> usize {
        // Named or not, an event that can matter says one of these.
        static MATTERS: std::sync::LazyLock<[memchr::memmem::Finder<'static>; 3]> =
            std::sync::LazyLock::new(|| {
                [b"message_start".as_slice(), b"message_delta", b"error"]
                    .map(memchr::memmem::Finder::new)
            });
        MATTERS
            .iter()
            .filter_map(|f| f.find(raw))
            .fold(first_valued(raw, &USAGE), usize::min)
    }
    fn reads(&self) -> &'static [&'static str] {
        &[
            "type",
            "message",
            "usage",
            "error",
            "input_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
            "output_tokens",
        ]
    }
    fn observe(&self, _event: Option<&str>, json: &Node, acc: &mut Observed) {
        let usage = match json.get("type").and_then(Node::as_str) {
            Some("message_start") => json.get("message").and_then(|m| m.get("usage")),
            Some("message_delta") | Some("message") => json.get("usage"),
            Some("error") => {
                acc.stream_error = true;
                None
            }
            _ => None,
        };
        let Some(u) = usage.filter(|u| u.is_object()) else {
            return;
        };
        // Cumulative: a value present replaces the earlier one, an absent one keeps it.
        let a = &mut acc.usage;
        a.input = count(u, "input_tokens").or(a.input);
        a.cache_creation = count(u, "cache_creation_input_tokens").or(a.cache_creation);
        a.cached_input = count(u, "cache_read_input_tokens").or(a.cached_input);
        a.output = count(u, "output_tokens").or(a.output);
        a.total_context = a
            .input
            .map(|i| i + a.cache_creation.unwrap_or(0) + a.cached_input.unwrap_or(0));
    }
    fn error_body(&self, shape: ErrorShape, kind: &str, message: &str) -> Vec<u8> {
        let (typ, msg) = match shape {
            ErrorShape::ContextLength { projected, window } => (
                "invalid_request_error",
                format!("prompt is too long: {projected} tokens > {window} maximum"),
            ),
            ErrorShape::SessionBudget { spent, budget } => (
                "invalid_request_error",
                session_budget_message(spent, budget, message),
            ),
            ErrorShape::Generic { status } => (
                match status {
                    401 => "authentication_error",
                    403 => "permission_error",
                    404 => "not_found_error",
                    413 => "request_too_large",
                    429 => "rate_limit_error",
                    s if (400..500).contains(&s) => "invalid_request_error",
                    504 => "timeout_error",
                    _ => "api_error",
                },
                format!("{message} ({kind})"),
            ),
        };
        serde_json::to_vec(&serde_json::json!({
            "type": "error",
            "error": {"type": typ, "message": msg}
        }))
        .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_shapes() {
        let b = Anthropic.error_body(
            ErrorShape::ContextLength {
                projected: 211180,
                window: 200000,
            },
            "context-budget",
            "",
        );
        assert_eq!(
            std::str::from_utf8(&b).unwrap(),
            r#"{"error":{"message":"prompt is too long: 211180 tokens > 200000 maximum","type":"invalid_request_error"},"type":"error"}"#
        );
        let v: Value = serde_json::from_slice(&Anthropic.error_body(
            ErrorShape::SessionBudget {
                spent: 9,
                budget: 8,
            },
            "session-budget",
            "over",
        ))
        .unwrap();
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("session_budget_exceeded:"));
        let v: Value = serde_json::from_slice(&Anthropic.error_body(
            ErrorShape::Generic { status: 413 },
            "body-too-large",
            "too big",
        ))
        .unwrap();
        assert_eq!(v["error"]["type"], "request_too_large");
    }
}
