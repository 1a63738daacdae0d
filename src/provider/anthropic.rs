//! Anthropic Messages (`/messages`): input and cache counts in
//! `message_start`, cumulative replacements in `message_delta`.

use std::ops::Range;

use std::borrow::Cow;

use serde_json::Value;

use super::walk::{type_of, Count};
use super::ImagePricing;
use super::{
    count, error_object, field, first_valued, has_member, number_after, session_budget_message,
    Api, ContextError, CountedField, ErrorShape, GenAi, Node, Observed, Part, PromptCache,
    Provider, Vocabulary, ERROR, USAGE,
};
use super::{Element, Unit};
use crate::json::text::{self as json, get, kind};
use crate::json::{Obj, RequestView};

pub struct Anthropic;

impl Provider for Anthropic {
    fn api(&self) -> Api {
        Api::Anthropic
    }
    // Messages is a chat API.
    fn genai(&self) -> GenAi {
        GenAi {
            operation: "chat",
            provider: "anthropic",
        }
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
        const FIELDS: &[CountedField] = &[
            field("tools", Unit::AnthTool, true, Part::Other),
            field("system", Unit::AnthSystem, false, Part::System),
            field("messages", Unit::AnthMessage, true, Part::History),
        ];
        FIELDS
    }
    /// The system prompt tool use adds, as Anthropic publishes it.
    fn block_framing(&self, unit: Unit) -> u64 {
        match unit {
            Unit::AnthTool => 346,
            _ => 0,
        }
    }
    fn image_pricing(&self) -> ImagePricing {
        ImagePricing::Anthropic
    }
    /// Claude's tokenizer is not public and counts more than o200k on the same text, closer to cl100k.
    fn default_vocabulary(&self) -> Vocabulary {
        Vocabulary::Cl100kBase
    }
    fn resembles_path(&self, path: &str) -> bool {
        path.contains("/messages")
    }
    fn walk(&self, unit: Unit, raw: &str, cx: &mut dyn Count) {
        match unit {
            Unit::AnthSystem => {
                cx.framing(PER_MESSAGE);
                content(cx, raw, 0);
            }
            Unit::AnthMessage => {
                cx.framing(PER_MESSAGE);
                match json::object(raw) {
                    Some(obj) => {
                        cx.role_field(&obj, "role");
                        if let Some(c) = get(&obj, "content") {
                            content(cx, c.get(), 0);
                        }
                    }
                    None => cx.generic(raw),
                }
            }
            Unit::AnthTool => {
                let obj = json::object(raw).unwrap_or_default();
                if get(&obj, "input_schema").is_some() {
                    cx.definition(&obj, &["name", "description", "input_schema"]);
                } else {
                    // Server tools (web search, code execution): their name and settings.
                    cx.json(raw);
                }
            }
            _ => {}
        }
    }
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64> {
        req.get("max_tokens")
    }
    fn agent_session_id<'a>(&self, req: &RequestView<'a>) -> Option<Cow<'a, str>> {
        // Claude Code: `metadata.user_id` names the conversation.
        #[derive(serde::Deserialize)]
        struct Metadata<'a> {
            #[serde(borrow)]
            user_id: Option<Cow<'a, str>>,
        }
        let raw = req.raw("metadata")?.get();
        let user_id = serde_json::from_str::<Metadata<'a>>(raw).ok()?.user_id?;
        match user_id {
            Cow::Borrowed(u) => session_of_user_id(u).map(Cow::Borrowed),
            Cow::Owned(u) => session_of_user_id(&u).map(|s| Cow::Owned(s.to_string())),
        }
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
            "context_management",
            "applied_edits",
            "cleared_input_tokens",
        ]
    }
    fn observe(&self, _event: Option<&str>, json: &Node, acc: &mut Observed) {
        let usage = match json.get("type").and_then(Node::as_str) {
            Some("message_start") => json.get("message").and_then(|m| m.get("usage")),
            Some("message_delta") | Some("message") => {
                // Server-side context editing (`clear_tool_uses_*`,
                // `clear_thinking_*`): on the message, or on the stream's
                // `message_delta`.
                if let Some(Node::Arr(edits)) = json
                    .get("context_management")
                    .and_then(|c| c.get("applied_edits"))
                {
                    if !edits.is_empty() {
                        let cleared = edits
                            .iter()
                            .filter_map(|e| count(e, "cleared_input_tokens"))
                            .sum();
                        acc.server_edit = Some(cleared);
                    }
                }
                json.get("usage")
            }
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
    /// "prompt is too long: P tokens > W maximum" (fixture
    /// anthropic-messages/error_prompt_too_long.json), or with the output
    /// reserve named: "input length and `max_tokens` exceed context limit:
    /// P + O > W, decrease input length or `max_tokens` and try again".
    fn context_error(&self, status: u16, body: &[u8]) -> Option<ContextError> {
        if !(400..500).contains(&status) {
            return None;
        }
        let e = error_object(body)?;
        let msg = e.get("message")?.as_str()?;
        let (prompt, window) = if let Some(p) = number_after(msg, "prompt is too long:") {
            (p, number_after(msg, "tokens >")?)
        } else {
            let p = number_after(msg, "exceed context limit:")?;
            (p, number_after(msg, ">")?)
        };
        Some(ContextError {
            window,
            prompt: Some(prompt),
            prompt_at_least: None,
        })
    }
    /// Prefixes are written only where a request puts `cache_control`;
    /// `cache_read_input_tokens` and `cache_creation_input_tokens` say
    /// what was read and written.
    fn prompt_cache(&self) -> PromptCache {
        PromptCache::Breakpoints
    }
    fn element(&self, b: &[u8], r: Range<usize>) -> Option<Element> {
        let o = Obj::parse(b, r)?;
        let (mut e, role) = Element::by_role(&o);
        let blocks = o
            .get("content")
            .filter(|r| b.get(r.start) == Some(&b'['))
            .and_then(|r| crate::json::elements(b, r))
            .unwrap_or_default();
        for r in blocks {
            let Some(blk) = Obj::parse(b, r) else {
                continue;
            };
            match blk.str("type").as_deref() {
                Some("tool_use") => e.calls.push(blk.str("id").unwrap_or_default()),
                Some("tool_result") => {
                    e.results.push(blk.str("tool_use_id"));
                    e.outputs.extend(blk.get("content"));
                }
                _ => {}
            }
        }
        e.turn_start = role.as_deref() == Some("user") && e.results.is_empty();
        Some(e)
    }
    /// Messages must alternate user / assistant: an assistant message says
    /// what was cut.
    fn gap_marker(&self, dropped: usize) -> Option<Vec<u8>> {
        let v = serde_json::json!({"role": "assistant", "content": super::gap_text(dropped)});
        serde_json::to_vec(&v).ok()
    }
    fn cache_breakpoints(&self) -> Option<(&'static str, usize)> {
        Some(("cache_control", 4))
    }
}

/// The conversation id in Claude Code's `metadata.user_id`: either
/// `user_<hex>_account_<uuid or empty>_session_<uuid>`, or (newer versions)
/// a JSON object encoded as a string with a `session_id` member. Anything
/// else, or an id of other characters than letters, digits, `-` and `_`,
/// is none.
pub(crate) fn session_of_user_id(user_id: &str) -> Option<&str> {
    let id = if user_id.starts_with('{') {
        #[derive(serde::Deserialize)]
        struct Ids<'a> {
            #[serde(borrow)]
            session_id: Option<&'a str>,
        }
        serde_json::from_str::<Ids>(user_id).ok()?.session_id?
    } else {
        let rest = user_id.strip_prefix("user_")?;
        let (_, after_account) = rest.split_once("_account_")?;
        after_account.rsplit_once("_session_").map_or_else(
            || after_account.strip_prefix("session_"),
            |(_, id)| Some(id),
        )?
    };
    let well_formed = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    well_formed.then_some(id)
}

// ---- the message walk ----------------------------------------------------

/// A chat template's role header and end marker (`provider/walk.rs`).
const PER_MESSAGE: u64 = 3;
const PER_TOOL_USE: u64 = 3;

/// A string, or content blocks (also the `content` of a `tool_result`).
fn content(cx: &mut dyn Count, raw: &str, depth: u32) {
    match kind(raw) {
        b'"' => {
            if let Some(s) = json::string(raw) {
                cx.text(&s);
            }
        }
        b'[' if depth < 8 => {
            for b in json::array(raw).unwrap_or_default() {
                block(cx, b.get(), depth);
            }
        }
        b'n' => {}
        _ => cx.generic(raw),
    }
}

fn block(cx: &mut dyn Count, raw: &str, depth: u32) {
    let Some(obj) = json::object(raw) else {
        cx.generic(raw);
        return;
    };
    match type_of(&obj).as_deref() {
        Some("text") => cx.str_field(&obj, "text"),
        Some("thinking") => cx.str_field(&obj, "thinking"),
        Some("redacted_thinking") => {}
        Some("image") => {
            let src = get(&obj, "source")
                .and_then(|s| json::object(s.get()))
                .unwrap_or_default();
            let data = get(&src, "data").and_then(|d| json::string(d.get()));
            cx.image_data(data.as_deref());
        }
        Some("document") => {
            let src = get(&obj, "source")
                .and_then(|s| json::object(s.get()))
                .unwrap_or_default();
            match type_of(&src).as_deref() {
                Some("text") => cx.str_field(&src, "data"),
                Some("content") => {
                    if let Some(c) = get(&src, "content") {
                        content(cx, c.get(), depth + 1);
                    }
                }
                _ => cx.document(),
            }
            cx.str_field(&obj, "title");
            cx.str_field(&obj, "context");
        }
        Some("tool_use" | "server_tool_use") => {
            cx.framing(PER_TOOL_USE);
            cx.str_field(&obj, "name");
            if let Some(i) = get(&obj, "input") {
                cx.value(i.get());
            }
        }
        Some("tool_result") => {
            cx.framing(PER_TOOL_USE);
            if let Some(c) = get(&obj, "content") {
                content(cx, c.get(), depth + 1);
            }
        }
        _ => cx.generic(raw),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_errors_teach_the_window_and_the_prompt() {
        let learned = |body: &str| {
            Anthropic
                .context_error(400, body.as_bytes())
                .map(|e| (e.window, e.prompt))
        };
        let fixture =
            include_str!("../../tests/fixtures/anthropic-messages/error_prompt_too_long.json");
        assert_eq!(learned(fixture), Some((200_000, Some(211_180))));
        let reserve = r#"{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` exceed context limit: 188240 + 21333 > 200000, decrease input length or `max_tokens` and try again"}}"#;
        assert_eq!(learned(reserve), Some((200_000, Some(188_240))));
        let overloaded =
            include_str!("../../tests/fixtures/anthropic-messages/error_overloaded.json");
        assert_eq!(learned(overloaded), None);
        assert_eq!(Anthropic.context_error(529, fixture.as_bytes()), None);
    }

    #[test]
    fn session_id_from_either_user_id_form_and_nothing_else() {
        let s = session_of_user_id;
        assert_eq!(
            s("user_5dd07c33da27e6d2968d94ea20bf47a7b090b6b158b82328d54da2909a108e84_account__session_d2e70091-3007-41a3-a916-cb8b0d3098de"),
            Some("d2e70091-3007-41a3-a916-cb8b0d3098de")
        );
        assert_eq!(
            s("user_abc_account_0a1b2c3d-0000-4000-8000-000000000000_session_7d0e2f61-4b5c"),
            Some("7d0e2f61-4b5c")
        );
        assert_eq!(
            s(
                r#"{"device_id":"3f4a","account_uuid":"","session_id":"2c4e1cf0-7a67-4d2e-9a4b-1d16d3f44752"}"#
            ),
            Some("2c4e1cf0-7a67-4d2e-9a4b-1d16d3f44752")
        );
        for bad in [
            "",
            "same-user-across-chats",
            "user_abc_session_0A1B",
            "user_abc_account__session_",
            "user_abc_account__session_has space",
            "user_abc_account__session_a\"b",
            r#"{"session_id":""}"#,
            r#"{"session_id":12}"#,
            r#"{"device_id":"x"}"#,
            r#"{"session_id":"x""#,
            "{",
        ] {
            assert_eq!(s(bad), None, "{bad:?}");
        }
        let long = format!("user_a_account__session_{}", "a".repeat(129));
        assert_eq!(s(&long), None);
    }

    #[test]
    fn agent_session_id_reads_metadata_only() {
        let v = RequestView::parse(
            br#"{"metadata":{"user_id":"user_ab_account__session_c31ac7cf-56a7"},"model":"m"}"#,
        )
        .unwrap();
        assert_eq!(
            Anthropic.agent_session_id(&v).as_deref(),
            Some("c31ac7cf-56a7")
        );
        // Escaped JSON in the string: decoded, then read.
        let v =
            RequestView::parse(br#"{"metadata":{"user_id":"{\"session_id\":\"s-1\"}"}}"#).unwrap();
        assert_eq!(Anthropic.agent_session_id(&v).as_deref(), Some("s-1"));
        for body in [
            &br#"{"model":"m"}"#[..],
            br#"{"metadata":{}}"#,
            br#"{"metadata":null}"#,
            br#"{"metadata":{"user_id":7}}"#,
            br#"{"metadata":"x"}"#,
        ] {
            let v = RequestView::parse(body).unwrap();
            assert_eq!(Anthropic.agent_session_id(&v), None);
        }
    }

    #[test]
    fn context_edits_are_read_from_the_message_and_the_delta() {
        let keep = Anthropic.reads();
        let read = |events: &[&str]| {
            let mut acc = Observed::default();
            for e in events {
                let node = crate::json::pick(e.as_bytes(), keep).unwrap();
                Anthropic.observe(None, &node, &mut acc);
            }
            acc
        };
        let body = r#"{"type":"message","usage":{"input_tokens":90},"context_management":{"applied_edits":[{"type":"clear_tool_uses_20250919","cleared_tool_uses":2,"cleared_input_tokens":300},{"type":"clear_thinking_20251015","cleared_thinking_turns":1,"cleared_input_tokens":50}]}}"#;
        assert_eq!(read(&[body]).server_edit, Some(350));
        let stream = [
            r#"{"type":"message_start","message":{"usage":{"input_tokens":90}}}"#,
            r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":4},"context_management":{"applied_edits":[{"type":"clear_tool_uses_20250919","cleared_input_tokens":120}]}}"#,
        ];
        let acc = read(&stream);
        assert_eq!(acc.server_edit, Some(120));
        assert_eq!(acc.usage.total_context, Some(90));
        let none = r#"{"type":"message_delta","usage":{"output_tokens":4},"context_management":{"applied_edits":[]}}"#;
        assert_eq!(read(&[none]).server_edit, None);
    }

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
