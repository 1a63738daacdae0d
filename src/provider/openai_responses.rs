//! OpenAI Responses (`/responses`): usage on the terminal event, and the
//! response id a later request continues with `previous_response_id`.

use std::ops::Range;

use std::borrow::Cow;

use serde_json::Value;

use super::openai_chat::{content, part, PER_MESSAGE, PER_TOOL_DEF};
use super::walk::{type_of, Count};
use super::ImagePricing;
use super::{
    count, field, has_member, openai_error_body, Api, ContextError, CountedField, ErrorShape,
    GenAi, Node, Observed, OpenAiChat, Part, PromptCache, Provider, Usage, Vocabulary, ERROR,
    RESPONSE_CREATED, USAGE,
};
use super::{Element, Unit};
use crate::json::text::{self as json, get, kind};
use crate::json::{Obj, RequestView};

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
    // The conventions name no operation of its own for Responses.
    fn genai(&self) -> GenAi {
        GenAi {
            operation: "chat",
            provider: "openai",
        }
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
    /// As on chat completions: 12 to close the tool block.
    fn block_framing(&self, unit: Unit) -> u64 {
        match unit {
            Unit::RespTool => 12,
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
    fn walk(&self, unit: Unit, raw: &str, cx: &mut dyn Count) {
        match unit {
            Unit::RespInstructions | Unit::RespInputText => {
                cx.framing(PER_MESSAGE + 1);
                cx.value(raw);
            }
            Unit::RespItem => item(cx, raw),
            Unit::RespTool => {
                let obj = json::object(raw).unwrap_or_default();
                if type_of(&obj).as_deref() == Some("function") {
                    cx.framing(PER_TOOL_DEF);
                    cx.definition(&obj, &["name", "description", "parameters"]);
                } else {
                    cx.json(raw);
                }
            }
            _ => {}
        }
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
    /// OpenAI's own refusal names no numbers ("Your input exceeds the
    /// context window of this model.", fixture
    /// openai-responses/error_context_length_exceeded.json; after a 200 it
    /// is a `response.failed` event): nothing is learned from it. A server
    /// that answers `/responses` in the chat wording with numbers (vLLM)
    /// teaches as it does on chat.
    fn context_error(&self, status: u16, body: &[u8]) -> Option<ContextError> {
        if !(400..500).contains(&status) {
            return None;
        }
        let e = super::error_object(body)?;
        super::openai_chat::context_message(e.get("message")?.as_str()?)
    }
    fn prompt_cache(&self) -> PromptCache {
        OpenAiChat.prompt_cache()
    }
    fn element(&self, b: &[u8], r: Range<usize>) -> Option<Element> {
        let o = Obj::parse(b, r)?;
        let (mut e, role) = Element::by_role(&o);
        let ty = o.str("type");
        let is_msg = ty.as_deref().map_or(true, |t| t == "message");
        e.turn_start = is_msg && role.as_deref() == Some("user");
        e.reasoning = ty.as_deref() == Some("reasoning");
        e.assistant = match ty.as_deref() {
            None | Some("message") => role.as_deref() == Some("assistant"),
            Some(t) => t == "reasoning" || (t.ends_with("_call") && !t.ends_with("_output")),
        };
        if let (Some(id), Some(t)) = (o.str("call_id"), ty.as_deref()) {
            if t.ends_with("_output") {
                e.results.push(Some(id));
                if t == "function_call_output" || t == "custom_tool_call_output" {
                    e.outputs.extend(o.get("output"));
                }
            } else {
                e.calls.push(id);
            }
        }
        Some(e)
    }
}

/// The Responses API's WebSocket mode (`GET /v1/responses` upgraded): the
/// client sends `response.create` events whose members are a POST body's
/// (plus `stream_id` in the multi-stream beta, where one socket carries
/// several responses and every server event echoes its stream's id); the
/// server answers each with the streaming events of HTTP, one per text
/// message, and reports errors as an `error` event with the HTTP `status`
/// it stands for (what Codex CLI reads to recover).
pub mod websocket {
    use super::{Node, Observed, OpenAiResponses, Provider, RESPONSE_EVENTS};
    use crate::json::RequestView;
    use crate::provider::ErrorShape;

    /// The client event that starts a response.
    pub fn is_response_create(event: &RequestView<'_>) -> bool {
        event.str("type").as_deref() == Some("response.create")
    }

    /// A `response.create` that asks for no output (`"generate": false`):
    /// a warm-up of the connection and its prompt cache, no turn of the
    /// conversation. Codex CLI 0.169 sends one with an empty `input` as the
    /// first event of every socket, and continues it with the real turn's
    /// `previous_response_id` (tests/fixtures/agents/README.md).
    pub fn is_warmup(event: &RequestView<'_>) -> bool {
        event.get::<bool>("generate") == Some(false)
    }

    /// The stream a client event (or a server event) belongs to; `None` on
    /// a socket that carries one response at a time.
    pub fn stream_id(event: &RequestView<'_>) -> Option<String> {
        event.str("stream_id").map(|s| s.into_owned())
    }

    /// A server event that ends a response.
    #[derive(Debug, Default)]
    pub struct Ended {
        pub stream_id: Option<String>,
        /// The status the outcome stands for: 200 for a response that ran
        /// (completed, incomplete or failed, as HTTP streams them), an
        /// `error` event's own `status` (400 without one).
        pub status: u16,
        /// Usage and response id, when the event carries them.
        pub observed: Observed,
    }

    /// What a server event says beyond what the HTTP tap reads of it.
    const ENVELOPE: &[&str] = &["stream_id", "status"];

    /// The end of a response, if this server message is one
    /// (`response.completed`, `response.incomplete`, `response.failed`, or
    /// an `error` event). Checked cheaply first: the many delta events are
    /// never parsed.
    pub fn ended(message: &[u8]) -> Option<Ended> {
        let p = &OpenAiResponses;
        let terminal = memchr::memmem::find(message, b"response.completed").is_some()
            || memchr::memmem::find(message, b"response.incomplete").is_some()
            || memchr::memmem::find(message, b"response.failed").is_some()
            || memchr::memmem::find(message, b"\"error\"").is_some();
        if !terminal || !p.may_carry_usage(None, message) {
            return None;
        }
        let node = crate::json::pick(message, p.reads())?;
        let envelope = crate::json::pick(message, ENVELOPE)?;
        let typ = node.get("type").and_then(Node::as_str)?;
        let status = match typ {
            "error" => envelope
                .get("status")
                .and_then(Node::as_u64)
                .and_then(|s| u16::try_from(s).ok())
                .unwrap_or(400),
            t if t != "response.created"
                && t != "response.in_progress"
                && RESPONSE_EVENTS.contains(&t) =>
            {
                200
            }
            _ => return None,
        };
        let mut observed = Observed::default();
        p.observe(None, &node, &mut observed);
        Some(Ended {
            stream_id: envelope
                .get("stream_id")
                .and_then(Node::as_str)
                .map(str::to_string),
            status,
            observed,
        })
    }

    /// The `error` event tidemark answers a `response.create` with instead
    /// of forwarding it: the HTTP error body's `error` object (SPEC §5's
    /// message), the status it stands for, and the stream's id if the
    /// event had one.
    pub fn error_event(
        shape: ErrorShape,
        status: u16,
        kind: &str,
        message: &str,
        stream_id: Option<&str>,
    ) -> Vec<u8> {
        let body = OpenAiResponses.error_body(shape, kind, message);
        let error = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|mut v| v.get_mut("error").map(serde_json::Value::take))
            .unwrap_or_default();
        let mut event = serde_json::json!({
            "type": "error",
            "status": status,
            "error": error,
        });
        if let Some(id) = stream_id {
            event["stream_id"] = serde_json::Value::from(id);
        }
        serde_json::to_vec(&event).unwrap_or_default()
    }
}

// ---- the message walk ----------------------------------------------------

fn item(cx: &mut dyn Count, raw: &str) {
    let Some(obj) = json::object(raw) else {
        cx.framing(PER_MESSAGE);
        cx.generic(raw);
        return;
    };
    let ty = type_of(&obj);
    match ty.as_deref() {
        None | Some("message") => {
            cx.framing(PER_MESSAGE);
            cx.role_field(&obj, "role");
            if let Some(c) = get(&obj, "content") {
                content(cx, c.get());
            }
        }
        Some("function_call" | "custom_tool_call") => {
            cx.function_call(&obj, PER_MESSAGE);
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            cx.framing(PER_MESSAGE);
            if let Some(o) = get(&obj, "output") {
                match kind(o.get()) {
                    b'[' => content(cx, o.get()),
                    _ => cx.value(o.get()),
                }
            }
        }
        Some("reasoning") => {
            // The visible summary; the encrypted chain of thought is opaque.
            for key in ["summary", "content"] {
                for p in get(&obj, key)
                    .and_then(|s| json::array(s.get()))
                    .unwrap_or_default()
                {
                    part(cx, p.get());
                }
            }
        }
        Some("item_reference") => {}
        Some(_) => {
            cx.framing(PER_MESSAGE);
            cx.generic(raw);
        }
    }
}

#[cfg(test)]
mod websocket_tests {
    use super::websocket::{ended, error_event};
    use crate::provider::ErrorShape;

    #[test]
    fn the_events_that_end_a_response() {
        let done = br#"{"type":"response.completed","stream_id":"s1","response":{"id":"resp_9","status":"completed","usage":{"input_tokens":1200,"output_tokens":30,"input_tokens_details":{"cached_tokens":1000}}}}"#;
        let e = ended(done).unwrap();
        assert_eq!((e.status, e.stream_id.as_deref()), (200, Some("s1")));
        assert_eq!(e.observed.usage.total_context, Some(1200));
        assert_eq!(e.observed.usage.cached_input, Some(1000));
        assert_eq!(e.observed.response_id.as_deref(), Some("resp_9"));
        let err = br#"{"type":"error","status":404,"error":{"code":"previous_response_not_found","message":"gone","param":"previous_response_id"}}"#;
        let e = ended(err).unwrap();
        assert_eq!((e.status, e.stream_id), (404, None));
        assert_eq!(e.observed.usage.total_context, None);
        for other in [
            &br#"{"type":"response.output_text.delta","delta":"response.completed"}"#[..],
            br#"{"type":"response.created","response":{"id":"r","usage":null}}"#,
            b"not json response.completed",
        ] {
            assert!(ended(other).is_none(), "{}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn the_error_event_carries_the_http_error_and_the_stream() {
        let e = error_event(
            ErrorShape::ContextLength {
                projected: 190_000,
                window: 200_000,
            },
            400,
            "context-budget",
            "",
            Some("main"),
        );
        let v: serde_json::Value = serde_json::from_slice(&e).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["status"], 400);
        assert_eq!(v["stream_id"], "main");
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert_eq!(
            v["error"]["message"],
            "This model's maximum context length is 200000 tokens. However, your messages resulted in 190000 tokens. Please reduce the length of the messages."
        );
    }
}

#[cfg(test)]
mod identity_tests {
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
            let node = crate::json::pick(e.as_bytes(), keep).unwrap();
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
