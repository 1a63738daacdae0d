//! OpenAI Responses (`/responses`): usage on the terminal event, and the
//! response id a later request continues with `previous_response_id`.

use std::borrow::Cow;

use serde_json::Value;

use super::{
    count, field, has_member, openai_error_body, Api, CountedField, ErrorShape, Node, Observed,
    Part, Provider, Usage, ERROR, RESPONSE_CREATED, USAGE,
};
use crate::estimate::Unit;
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
        const FIELDS: &[CountedField] = &[
            field("tools", Unit::RespTool, true, Part::Other),
            field("instructions", Unit::RespInstructions, false, Part::System),
            // A string, or a list of items.
            field("input", Unit::RespItem, true, Part::History),
        ];
        FIELDS
    }
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64> {
        req.get("max_output_tokens")
    }
    fn continues(&self, req: &RequestView<'_>) -> Option<String> {
        req.str("previous_response_id").map(|s| s.into_owned())
    }
    fn agent_session_id<'a>(&self, req: &RequestView<'a>) -> Option<Cow<'a, str>> {
        // Codex CLI sends its thread id here (the same as its `session-id`
        // header), and a prompt cache is per conversation by design.
        req.str("prompt_cache_key").filter(|k| !k.is_empty())
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
            "output",
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
        // Server-side compaction (`context_management`): a `compaction`
        // item among the output. It says nothing of how much it cleared.
        if let Some(Node::Arr(items)) = r.get("output") {
            let compacted = items
                .iter()
                .any(|i| i.get("type").and_then(Node::as_str) == Some("compaction"));
            if compacted {
                acc.server_edit = Some(0);
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_cache_key_is_the_agent_session_id() {
        let v = RequestView::parse(br#"{"prompt_cache_key":"019a-thread","input":"hi"}"#).unwrap();
        assert_eq!(
            OpenAiResponses.agent_session_id(&v).as_deref(),
            Some("019a-thread")
        );
        for body in [
            &br#"{"prompt_cache_key":""}"#[..],
            br#"{"prompt_cache_key":3}"#,
            b"{}",
        ] {
            let v = RequestView::parse(body).unwrap();
            assert_eq!(OpenAiResponses.agent_session_id(&v), None);
        }
    }

    #[test]
    fn a_compaction_item_is_a_server_edit() {
        let keep = OpenAiResponses.reads();
        let read = |e: &str| {
            let mut acc = Observed::default();
            let node = crate::pick::pick(e.as_bytes(), keep).unwrap();
            OpenAiResponses.observe(None, &node, &mut acc);
            acc
        };
        let done = r#"{"type":"response.completed","response":{"id":"resp_1","output":[{"type":"compaction","id":"cmp_1","encrypted_content":"xyz"},{"type":"message","content":[{"type":"output_text","text":"compaction"}]}],"usage":{"input_tokens":500,"output_tokens":3}}}"#;
        let acc = read(done);
        assert_eq!(acc.server_edit, Some(0));
        assert_eq!(acc.usage.total_context, Some(500));
        let plain = r#"{"object":"response","id":"resp_2","output":[{"type":"message","content":[{"type":"output_text","text":"compaction"}]}],"usage":{"input_tokens":5,"output_tokens":1}}"#;
        assert_eq!(read(plain).server_edit, None);
    }
}
