//! OpenAI Responses (`/responses`): usage on the terminal event, and the
//! response id a later request continues with `previous_response_id`.

use serde_json::Value;

use super::{
    count, has_member, openai_error_body, Api, CountedField, ErrorShape, Node, Observed, Provider,
    Usage, ERROR, RESPONSE_CREATED, USAGE,
};
use crate::inspect::RequestView;

pub struct OpenAiResponses;

/// Events whose `response` object carries an id or usage.
const RESPONSE_EVENTS: &[&str] = &[
    "response.created",
    "response.in_progress",
    "response.completed",
    "response.incomplete",
    "response.failed",
];

impl Provider for OpenAiResponses {
    fn api(&self) -> Api {
        Api::OpenAiResponses
    }
    fn matches_path(&self, path: &str) -> bool {
        path.ends_with("/responses")
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
                name: "instructions",
                per_element: false,
            },
            CountedField {
                name: "tools",
                per_element: false,
            },
            CountedField {
                name: "input",
                per_element: true,
            },
        ]
    }
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64> {
        req.get("max_output_tokens")
    }
    fn continues(&self, req: &RequestView<'_>) -> Option<String> {
        req.str("previous_response_id").map(|s| s.into_owned())
    }
    fn count_request(&self, path: &str, req: &RequestView<'_>) -> Option<(String, Vec<u8>)> {
        let body = super::subset_object(
            req,
            &[
                "model",
                "input",
                "instructions",
                "tools",
                "tool_choice",
                "parallel_tool_calls",
                "previous_response_id",
                "conversation",
                "reasoning",
                "text",
                "truncation",
            ],
        );
        Some((format!("{path}/input_tokens"), body))
    }
    fn count_response(&self, json: &Value) -> Option<u64> {
        super::count(json, "input_tokens")
    }
    fn may_carry_usage(&self, event: Option<&str>, data: &[u8]) -> bool {
        match event {
            // `in_progress` repeats what `created` said.
            Some(e) => e != "response.in_progress" && RESPONSE_EVENTS.contains(&e) || e == "error",
            None => {
                has_member(data, &USAGE)
                    || has_member(data, &ERROR)
                    || RESPONSE_CREATED.find(data).is_some()
            }
        }
    }
    fn reads(&self) -> &'static [&'static str] {
        &[
            "type",
            "object",
            "response",
            "id",
            "usage",
            "error",
            "input_tokens",
            "output_tokens",
            "input_tokens_details",
            "cached_tokens",
            "cache_write_tokens",
        ]
    }
    fn observe(&self, _event: Option<&str>, json: &Node, acc: &mut Observed) {
        let typ = json.get("type").and_then(Node::as_str).unwrap_or("");
        let response = if RESPONSE_EVENTS.contains(&typ) {
            json.get("response")
        } else if json.get("object").and_then(Node::as_str) == Some("response") {
            Some(json) // a non-stream body is the Response itself
        } else {
            None
        };
        if typ == "error" || typ == "response.failed" {
            acc.stream_error = true;
        }
        let Some(r) = response else {
            return;
        };
        if let Some(id) = r.get("id").and_then(Node::as_str) {
            acc.response_id = Some(id.to_string());
        }
        if let Some(u) = r.get("usage").filter(|u| u.is_object()) {
            let details = u.get("input_tokens_details");
            let input = count(u, "input_tokens");
            acc.usage = Usage {
                input,
                cached_input: details.and_then(|d| count(d, "cached_tokens")),
                cache_creation: Some(
                    details
                        .and_then(|d| count(d, "cache_write_tokens"))
                        .unwrap_or(0),
                ),
                output: count(u, "output_tokens"),
                total_context: input,
            };
        }
    }
    fn error_body(&self, shape: ErrorShape, kind: &str, message: &str) -> Vec<u8> {
        openai_error_body(shape, kind, message)
    }
}
