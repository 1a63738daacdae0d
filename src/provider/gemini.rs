//! Google Gemini (`:generateContent`, `:streamGenerateContent`): cumulative
//! `usageMetadata` on every chunk; the model is named in the path.

use std::ops::Range;

use serde_json::Value;

use super::walk::Count;
use super::ImagePricing;
use super::{
    count, field, has_member, Api, ContextError, CountedField, ErrorShape, GenAi, Node, Observed,
    Part, PromptCache, Provider, Usage, Vocabulary, ERROR, USAGE_METADATA,
};
use super::{Element, Unit};
use crate::json::text::{self as json, get, kind};
use crate::json::{Obj, RequestView};

pub struct Gemini;

impl Provider for Gemini {
    fn api(&self) -> Api {
        Api::Gemini
    }
    // `generateContent` on the Gemini (AI Studio) API.
    fn genai(&self) -> GenAi {
        GenAi {
            operation: "generate_content",
            provider: "gcp.gemini",
        }
    }
    fn matches_path(&self, path: &str) -> bool {
        path.ends_with(":generateContent") || path.ends_with(":streamGenerateContent")
    }
    fn model(&self, path: &str, req: &RequestView<'_>) -> Option<String> {
        // `/v1beta/models/{model}:generateContent`, or a Vertex path ending the same way.
        let tail = &path[path.rfind("/models/")? + "/models/".len()..];
        let model = tail.split(':').next().unwrap_or(tail);
        if model.is_empty() {
            req.str("model").map(|s| s.into_owned())
        } else {
            Some(model.to_string())
        }
    }
    fn is_stream(&self, path: &str, _query: Option<&str>, _req: &RequestView<'_>) -> bool {
        path.ends_with(":streamGenerateContent")
    }
    fn counted_fields(&self) -> &'static [CountedField] {
        const FIELDS: &[CountedField] = &[
            field("tools", Unit::GemTool, true, Part::Other),
            // Gemini takes both spellings.
            field("systemInstruction", Unit::GemSystem, false, Part::System),
            field("system_instruction", Unit::GemSystem, false, Part::System),
            field("contents", Unit::GemContent, true, Part::History),
        ];
        FIELDS
    }
    fn image_pricing(&self) -> ImagePricing {
        ImagePricing::Gemini
    }
    /// A 256k SentencePiece vocabulary: o200k's large multilingual vocabulary is the nearer density, CJK in particular.
    fn default_vocabulary(&self) -> Vocabulary {
        Vocabulary::O200kBase
    }
    /// `…/models/{model}:{method}`; Ollama's `/api/` paths are Ollama's.
    fn resembles_path(&self, path: &str) -> bool {
        path.contains(':') && path.contains("/models/") && !path.contains("/api/")
    }
    fn walk(&self, unit: Unit, raw: &str, cx: &mut dyn Count) {
        match unit {
            Unit::GemSystem | Unit::GemContent => {
                cx.framing(PER_CONTENT);
                content(cx, raw);
            }
            Unit::GemTool => {
                let obj = json::object(raw).unwrap_or_default();
                let decls = get(&obj, "functionDeclarations")
                    .or_else(|| get(&obj, "function_declarations"))
                    .and_then(|d| json::array(d.get()));
                match decls {
                    Some(decls) => {
                        for d in decls {
                            let d = json::object(d.get()).unwrap_or_default();
                            cx.definition(&d, DECLARATION);
                        }
                    }
                    None => cx.json(raw),
                }
            }
            _ => {}
        }
    }
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64> {
        let cfg: Value = req.get("generationConfig")?;
        count(&cfg, "maxOutputTokens")
    }
    fn count_request(&self, path: &str, req: &RequestView<'_>) -> Option<(String, Vec<u8>)> {
        // `models/{m}:generateContent` -> `models/{m}:countTokens`, the whole
        // request wrapped as `generateContentRequest` so system and tools count.
        let colon = path.rfind(':')?;
        let model = path[..colon].rsplit('/').next()?;
        let inner = super::subset_object(
            req,
            &[
                "contents",
                "systemInstruction",
                "tools",
                "toolConfig",
                "generationConfig",
            ],
        );
        let mut body = Vec::with_capacity(inner.len() + 64);
        body.extend_from_slice(b"{\"generateContentRequest\":");
        let mut inner = inner;
        inner.pop(); // the closing brace: add the model inside
        body.extend_from_slice(&inner);
        if inner.len() > 1 {
            body.push(b',');
        }
        body.extend_from_slice(
            format!(
                "\"model\":{}}}}}",
                serde_json::to_string(&format!("models/{model}")).ok()?
            )
            .as_bytes(),
        );
        Some((format!("{}:countTokens", &path[..colon]), body))
    }
    fn count_response(&self, json: &Value) -> Option<u64> {
        count(json, "totalTokens")
    }
    fn may_carry_usage(&self, _event: Option<&str>, data: &[u8]) -> bool {
        has_member(data, &USAGE_METADATA) || has_member(data, &ERROR)
    }
    fn reads(&self) -> &'static [&'static str] {
        &[
            "usageMetadata",
            "error",
            "promptTokenCount",
            "candidatesTokenCount",
            "thoughtsTokenCount",
            "cachedContentTokenCount",
            "toolUsePromptTokenCount",
        ]
    }
    fn observe(&self, _event: Option<&str>, json: &Node, acc: &mut Observed) {
        if json.get("error").is_some_and(|e| !e.is_null()) {
            acc.stream_error = true;
        }
        let Some(u) = json.get("usageMetadata").filter(|u| u.is_object()) else {
            return;
        };
        // proto3 JSON leaves zero counts out: within usageMetadata absent means 0.
        let prompt = count(u, "promptTokenCount");
        let candidates = count(u, "candidatesTokenCount");
        let thoughts = count(u, "thoughtsTokenCount");
        let output = match (candidates, thoughts) {
            (None, None) => None,
            (c, t) => Some(c.unwrap_or(0) + t.unwrap_or(0)),
        };
        acc.usage = Usage {
            input: prompt,
            cached_input: Some(count(u, "cachedContentTokenCount").unwrap_or(0)),
            cache_creation: Some(0),
            output,
            total_context: prompt.map(|p| p + count(u, "toolUsePromptTokenCount").unwrap_or(0)),
        };
    }
    fn error_body(&self, shape: ErrorShape, kind: &str, message: &str) -> Vec<u8> {
        let (code, status, msg) = match shape {
            ErrorShape::ContextLength { projected, window } => (
                400,
                "INVALID_ARGUMENT",
                format!("The input token count ({projected}) exceeds the maximum number of tokens allowed ({window})."),
            ),
            ErrorShape::SessionBudget { spent, budget } => (
                400,
                "INVALID_ARGUMENT",
                super::session_budget_message(spent, budget, message),
            ),
            ErrorShape::Generic { status } => (
                status,
                match status {
                    400 | 413 => "INVALID_ARGUMENT",
                    429 => "RESOURCE_EXHAUSTED",
                    504 => "DEADLINE_EXCEEDED",
                    502 | 503 => "UNAVAILABLE",
                    s if (400..500).contains(&s) => "FAILED_PRECONDITION",
                    _ => "INTERNAL",
                },
                format!("{message} ({kind})"),
            ),
        };
        serde_json::to_vec(&serde_json::json!({
            "error": {"code": code, "message": msg, "status": status}
        }))
        .unwrap_or_default()
    }
    /// 400 INVALID_ARGUMENT, "The input token count (P) exceeds the maximum
    /// number of tokens allowed (W)." (fixture
    /// gemini/error_input_token_count_exceeded.json).
    fn context_error(&self, status: u16, body: &[u8]) -> Option<ContextError> {
        if !(400..500).contains(&status) {
            return None;
        }
        let e = super::error_object(body)?;
        let msg = e.get("message")?.as_str()?;
        let window = super::number_after(msg, "maximum number of tokens allowed")?;
        Some(ContextError {
            window,
            prompt: super::number_after(msg, "input token count"),
            prompt_at_least: None,
        })
    }
    /// Implicit caching: automatic from 1024 tokens (2.5 Flash; Pro's
    /// minimum is larger), reported to the token in
    /// `cachedContentTokenCount`.
    fn prompt_cache(&self) -> PromptCache {
        PromptCache::Automatic {
            min: 1024,
            granularity: 1,
        }
    }
    fn element(&self, b: &[u8], r: Range<usize>) -> Option<Element> {
        let o = Obj::parse(b, r)?;
        let (mut e, role) = Element::by_role(&o);
        let parts = o
            .get("parts")
            .and_then(|r| crate::json::elements(b, r))
            .unwrap_or_default();
        for r in parts {
            let Some(p) = Obj::parse(b, r) else { continue };
            if let Some(fc) = p.get("functionCall") {
                let id = Obj::parse(b, fc).and_then(|f| f.str("id"));
                e.calls.push(id.unwrap_or_default());
            }
            if let Some(fr) = p.get("functionResponse") {
                let f = Obj::parse(b, fr);
                e.results.push(f.as_ref().and_then(|f| f.str("id")));
                e.outputs.extend(f.and_then(|f| f.get("response")));
            }
        }
        // The role is optional and defaults to user.
        e.user = role.as_deref().map_or(true, |r| r == "user");
        e.assistant = role.as_deref() == Some("model");
        e.turn_start = e.user && e.results.is_empty();
        Some(e)
    }
    /// A function response is an object: the marker goes in one.
    fn elided(&self, bytes: usize) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({ "content": super::elided_text(bytes) }))
            .unwrap_or_default()
    }
    /// Contents must alternate user / model: a model content says what was cut.
    fn gap_marker(&self, dropped: usize) -> Option<Vec<u8>> {
        let v = serde_json::json!({"role": "model", "parts": [{"text": super::gap_text(dropped)}]});
        serde_json::to_vec(&v).ok()
    }
}

// ---- the message walk ----------------------------------------------------

/// A chat template's role header and end marker (`provider/walk.rs`).
const PER_CONTENT: u64 = 3;
const PER_CALL: u64 = 3;

/// The members of a function declaration the model reads, in order.
const DECLARATION: &[&str] = &[
    "name",
    "description",
    "parameters",
    "parametersJsonSchema",
    "parameters_json_schema",
    "response",
];

/// A `Content` (`{role, parts}`); also accepts a bare string or part list.
fn content(cx: &mut dyn Count, raw: &str) {
    match kind(raw) {
        b'{' => {
            let obj = json::object(raw).unwrap_or_default();
            cx.role_field(&obj, "role");
            match get(&obj, "parts") {
                Some(ps) => parts(cx, ps.get()),
                None => part(cx, raw),
            }
        }
        b'[' => parts(cx, raw),
        _ => cx.generic(raw),
    }
}

fn parts(cx: &mut dyn Count, raw: &str) {
    match json::array(raw) {
        Some(ps) => {
            for p in ps {
                part(cx, p.get());
            }
        }
        None => part(cx, raw),
    }
}

fn part(cx: &mut dyn Count, raw: &str) {
    let Some(obj) = json::object(raw) else {
        cx.generic(raw);
        return;
    };
    let pick = |a: &str, b: &str| get(&obj, a).or_else(|| get(&obj, b));
    if let Some(t) = get(&obj, "text") {
        cx.value(t.get());
    } else if let Some(d) = pick("inlineData", "inline_data") {
        let d = json::object(d.get()).unwrap_or_default();
        let mime = get(&d, "mimeType")
            .or_else(|| get(&d, "mime_type"))
            .and_then(|m| json::string(m.get()));
        // Only an image's header says its size; other media at the default.
        let data = if mime.as_deref().is_some_and(|m| m.starts_with("image/")) {
            get(&d, "data").and_then(|x| json::string(x.get()))
        } else {
            None
        };
        cx.image_data(data.as_deref());
    } else if pick("fileData", "file_data").is_some() {
        cx.image_data(None);
    } else if let Some(f) = pick("functionCall", "function_call") {
        let f = json::object(f.get()).unwrap_or_default();
        cx.function_call(&f, PER_CALL);
    } else if let Some(f) = pick("functionResponse", "function_response") {
        let f = json::object(f.get()).unwrap_or_default();
        cx.framing(PER_CALL);
        cx.str_field(&f, "name");
        if let Some(r) = get(&f, "response") {
            cx.value(r.get());
        }
    } else if let Some(c) = pick("executableCode", "executable_code") {
        let c = json::object(c.get()).unwrap_or_default();
        cx.str_field(&c, "code");
    } else if let Some(c) = pick("codeExecutionResult", "code_execution_result") {
        let c = json::object(c.get()).unwrap_or_default();
        cx.str_field(&c, "output");
    } else {
        cx.generic(raw);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_errors_teach_the_window_and_the_prompt() {
        let fixture =
            include_str!("../../tests/fixtures/gemini/error_input_token_count_exceeded.json");
        let e = Gemini.context_error(400, fixture.as_bytes()).unwrap();
        assert_eq!((e.window, e.prompt), (1_048_576, Some(1_200_293)));
        // The streamed array form carries the error as its one element.
        let arr = format!("[{fixture}]");
        assert_eq!(Gemini.context_error(400, arr.as_bytes()), Some(e));
        let quota = r#"{"error":{"code":429,"message":"Resource has been exhausted (e.g. check quota).","status":"RESOURCE_EXHAUSTED"}}"#;
        assert_eq!(Gemini.context_error(429, quota.as_bytes()), None);
    }

    #[test]
    fn model_and_stream_from_path() {
        let v = RequestView::parse(b"{}").unwrap();
        let p = "/v1beta/models/gemini-2.5-flash:streamGenerateContent";
        assert!(Gemini.matches_path(p));
        assert_eq!(Gemini.model(p, &v).as_deref(), Some("gemini-2.5-flash"));
        assert!(Gemini.is_stream(p, Some("alt=sse"), &v));
        let p =
            "/v1/projects/x/locations/us/publishers/google/models/gemini-2.5-pro:generateContent";
        assert_eq!(Gemini.model(p, &v).as_deref(), Some("gemini-2.5-pro"));
        assert!(!Gemini.is_stream(p, None, &v));
        let v = RequestView::parse(br#"{"generationConfig":{"maxOutputTokens":512}}"#).unwrap();
        assert_eq!(Gemini.max_output_tokens(&v), Some(512));
    }

    #[test]
    fn context_error_shape() {
        let v: Value = serde_json::from_slice(&Gemini.error_body(
            ErrorShape::ContextLength {
                projected: 5,
                window: 4,
            },
            "context-budget",
            "",
        ))
        .unwrap();
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["status"], "INVALID_ARGUMENT");
    }
}
