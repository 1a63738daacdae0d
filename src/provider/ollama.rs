//! Ollama native chat (`/api/chat`): NDJSON, usage on the `done` line.

use std::ops::Range;

use serde_json::Value;

use super::openai_chat::{content, tool};
use super::walk::Count;
use super::ImagePricing;
use super::{
    count, field, has_member, truthy, Api, CountedField, ErrorShape, Framing, GenAi, Node,
    Observed, Part, PromptCache, Provider, Usage, Vocabulary, ERROR, EVAL_COUNT,
};
use super::{Element, Unit};
use crate::json::text::{self as json, get};
use crate::json::RequestView;

pub struct Ollama;

impl Provider for Ollama {
    fn api(&self) -> Api {
        Api::Ollama
    }
    // Not among the well-known providers: its own name.
    fn genai(&self) -> GenAi {
        GenAi {
            operation: "chat",
            provider: "ollama",
        }
    }
    fn matches_path(&self, path: &str) -> bool {
        path.ends_with("/api/chat")
    }
    fn model(&self, _path: &str, req: &RequestView<'_>) -> Option<String> {
        req.str("model").map(|s| s.into_owned())
    }
    fn is_stream(&self, _path: &str, _query: Option<&str>, req: &RequestView<'_>) -> bool {
        // Ollama streams unless told not to.
        req.get::<bool>("stream").unwrap_or(true)
    }
    fn counted_fields(&self) -> &'static [CountedField] {
        const FIELDS: &[CountedField] = &[
            field("tools", Unit::OllamaTool, true, Part::Other),
            field("system", Unit::OllamaText, false, Part::System),
            field("messages", Unit::OllamaMessage, true, Part::History),
            // `/api/generate`'s prompt and images.
            field("prompt", Unit::OllamaText, false, Part::History),
            field("images", Unit::OllamaImage, true, Part::Other),
        ];
        FIELDS
    }
    /// The Llama 3 template opens the reply with 5.
    fn image_pricing(&self) -> ImagePricing {
        ImagePricing::Flat
    }
    /// Llama 3 is cl100k plus 28k tokens; Qwen, Mistral, DeepSeek and unknown local models are nearest it too.
    fn default_vocabulary(&self) -> Vocabulary {
        Vocabulary::Cl100kBase
    }
    fn resembles_path(&self, path: &str) -> bool {
        path.contains("/api/")
    }
    fn walk(&self, unit: Unit, raw: &str, cx: &mut dyn Count) {
        match unit {
            Unit::OllamaMessage => message(cx, raw),
            Unit::OllamaTool => tool(cx, raw),
            Unit::OllamaText => {
                cx.framing(PER_MESSAGE);
                cx.value(raw);
            }
            Unit::OllamaImage => cx.image_data(None),
            _ => {}
        }
    }
    fn reply_framing(&self) -> u64 {
        5
    }
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64> {
        // num_predict: -1 (and -2) mean "no limit".
        let options: Value = req.get("options")?;
        count(&options, "num_predict")
    }
    /// A native stream is NDJSON whatever its content type says.
    fn framing(&self, content_type: Option<&str>, stream: bool) -> Framing {
        match content_type {
            Some(ct) if ct.starts_with("text/event-stream") => Framing::Sse,
            Some(ct) if ct.starts_with("application/x-ndjson") => Framing::Ndjson,
            _ if stream => Framing::Ndjson,
            _ => Framing::Json,
        }
    }
    fn may_carry_usage(&self, _event: Option<&str>, data: &[u8]) -> bool {
        EVAL_COUNT.find(data).is_some() || has_member(data, &ERROR)
    }
    fn reads(&self) -> &'static [&'static str] {
        &["error", "done", "prompt_eval_count", "eval_count"]
    }
    fn observe(&self, _event: Option<&str>, json: &Node, acc: &mut Observed) {
        if truthy(json.get("error")) {
            acc.stream_error = true;
        }
        if json.get("done").and_then(Node::as_bool) != Some(true) {
            return;
        }
        // prompt_eval_count is omitempty: absent is unknown, not 0.
        let input = count(json, "prompt_eval_count");
        acc.usage = Usage {
            input,
            cached_input: None,
            cache_creation: Some(0),
            output: count(json, "eval_count"),
            total_context: input,
        };
    }
    fn error_body(&self, shape: ErrorShape, kind: &str, message: &str) -> Vec<u8> {
        let msg = match shape {
            ErrorShape::ContextLength { projected, window } => format!(
                "prompt is too long: {projected} tokens exceed the {window}-token context window ({kind})"
            ),
            ErrorShape::SessionBudget { spent, budget } => {
                super::session_budget_message(spent, budget, message)
            }
            ErrorShape::Generic { .. } => format!("{message} ({kind})"),
        };
        serde_json::to_vec(&serde_json::json!({ "error": msg })).unwrap_or_default()
    }
    // No `context_error`: over its window (`num_ctx`) Ollama does not
    // refuse, it drops the oldest messages and truncates, and reports the
    // count of what it kept (ollama/ollama#4967).

    /// Ollama keeps its KV cache of the previous prompt and reuses any
    /// prefix of it, reported nowhere.
    fn prompt_cache(&self) -> PromptCache {
        PromptCache::Automatic {
            min: 0,
            granularity: 1,
        }
    }
    fn element(&self, b: &[u8], r: Range<usize>) -> Option<Element> {
        super::chat_element(b, r)
    }
}

// ---- the message walk ----------------------------------------------------

/// The Llama 3 template's header and end marker (`provider/walk.rs`).
const PER_MESSAGE: u64 = 4;
const PER_CALL: u64 = 3;

fn message(cx: &mut dyn Count, raw: &str) {
    cx.framing(PER_MESSAGE);
    let Some(obj) = json::object(raw) else {
        cx.generic(raw);
        return;
    };
    cx.role_field(&obj, "role");
    if let Some(c) = get(&obj, "content") {
        content(cx, c.get());
    }
    cx.str_field(&obj, "tool_name");
    // Attached images are priced flat: their bytes are not read.
    let attached = get(&obj, "images")
        .and_then(|i| json::array(i.get()))
        .map_or(0, |a| a.len());
    for _ in 0..attached {
        cx.image_data(None);
    }
    for call in get(&obj, "tool_calls")
        .and_then(|c| json::array(c.get()))
        .unwrap_or_default()
    {
        let call = json::object(call.get()).unwrap_or_default();
        if let Some(f) = get(&call, "function").and_then(|f| json::object(f.get())) {
            cx.function_call(&f, PER_CALL);
        }
    }
}
