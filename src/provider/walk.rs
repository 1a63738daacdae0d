//! The shared half of the message walk: what a provider sees in one message
//! (or system prompt, or tool definition) is reported to a [`Count`] — text
//! as text, structured values (tool arguments, schemas) as compact JSON,
//! images and documents by what sizes them, and the framing each message
//! costs. Each API's own walk (`Provider::walk`) lives in its file; the
//! estimator implements [`Count`] (tokenizing, pricing images), so this room
//! never needs it.
//!
//! Framing constants. OpenAI documents its chat format as 3 tokens per
//! message, 1 more for a `name`, and 3 priming the reply (the tiktoken
//! cookbook's `num_tokens_from_messages`, checked against the API); each
//! function definition costs 7 and a tool block 12 more (the cookbook's
//! `num_tokens_for_tools`). The other providers publish no per-message figure;
//! their chat templates have about the same shape (a role header and an end
//! marker), so 3 per message is used for Anthropic and Gemini, and the Llama 3
//! template's 4 (+ the role) for Ollama, with 5 to open the reply. Anthropic
//! does publish the system prompt that tool use adds: 346 tokens. Any residue
//! is fixed per request and cancels out of an anchored projection. The
//! per-request costs (opening the reply, a tool block) are the providers'
//! (`Provider::reply_framing`, `Provider::block_framing`).

use std::borrow::Cow;

use serde_json::value::RawValue;

use crate::json::text::{self as json, get, kind};

/// What a walk reports; the estimator turns it into tokens.
pub trait Count {
    /// Conversation text.
    fn text(&mut self, s: &str);
    /// Text that is the template's rather than the conversation's (a role).
    fn framing_text(&mut self, s: &str);
    /// Framing tokens the walk knows as a number.
    fn framing(&mut self, n: u64);
    /// An image named by a URL (a `data:` URL is sized from its header),
    /// priced by the API's rule.
    fn image_url(&mut self, url: &str, detail: Detail);
    /// An image given as base64 bytes (`None`: its size is unknown or not
    /// read), priced by the API's rule.
    fn image_data(&mut self, base64: Option<&str>);
    /// A document (PDF, file) whose pages are not counted.
    fn document(&mut self);
}

/// OpenAI image detail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detail {
    Low,
    High,
}

/// The value of `"detail"` as a [`Detail`] (`high` unless it says `low`).
pub(super) fn detail_of(d: Option<&str>) -> Detail {
    match d {
        Some("low") => Detail::Low,
        _ => Detail::High,
    }
}

pub(super) type Member<'a> = (Cow<'a, str>, &'a RawValue);

/// The walks' vocabulary over any [`Count`].
impl dyn Count + '_ {
    /// A role string field, counted as framing.
    pub(super) fn role_field(&mut self, obj: &[Member<'_>], key: &str) {
        if let Some(s) = get(obj, key).and_then(|v| json::string(v.get())) {
            self.framing_text(&s);
        }
    }

    /// A string counted as its text; anything else as compact JSON.
    pub(super) fn value(&mut self, raw: &str) {
        match json::string(raw) {
            Some(s) => self.text(&s),
            None if kind(raw) == b'n' => {}
            None => self.json(raw),
        }
    }

    pub(super) fn json(&mut self, raw: &str) {
        let c = json::compact(raw);
        self.text(&c);
    }

    pub(super) fn str_field(&mut self, obj: &[Member<'_>], key: &str) {
        if let Some(s) = get(obj, key).and_then(|v| json::string(v.get())) {
            self.text(&s);
        }
    }

    /// Unknown shapes: every string leaf as text, except identifiers and
    /// opaque blobs the model never reads; data URLs as images.
    pub(super) fn generic(&mut self, raw: &str) {
        self.generic_depth(raw, 0);
    }

    fn generic_depth(&mut self, raw: &str, depth: u32) {
        if depth > 32 {
            self.json(raw);
            return;
        }
        match kind(raw) {
            b'"' => {
                if let Some(s) = json::string(raw) {
                    if s.starts_with("data:") && s.contains(";base64,") {
                        self.image_url(&s, Detail::High);
                    } else {
                        self.text(&s);
                    }
                }
            }
            b'{' => {
                for (k, v) in json::object(raw).unwrap_or_default() {
                    if !SKIP_KEYS.contains(&k.as_ref()) {
                        self.generic_depth(v.get(), depth + 1);
                    }
                }
            }
            b'[' => {
                for v in json::array(raw).unwrap_or_default() {
                    self.generic_depth(v.get(), depth + 1);
                }
            }
            b'n' => {}
            _ => self.text(raw.trim()),
        }
    }

    /// A tool definition as the compact JSON of the members that describe
    /// it, in the order given.
    pub(super) fn definition(&mut self, obj: &[Member<'_>], keys: &[&str]) {
        let mut s = String::from("{");
        for k in keys {
            if let Some(v) = get(obj, k) {
                if s.len() > 1 {
                    s.push(',');
                }
                s.push('"');
                s.push_str(k);
                s.push_str("\":");
                s.push_str(&json::compact(v.get()));
            }
        }
        s.push('}');
        self.text(&s);
    }

    /// `{name, arguments}` (OpenAI: arguments is a JSON string; Ollama: an
    /// object; Gemini: `args`).
    pub(super) fn function_call(&mut self, f: &[Member<'_>], framing: u64) {
        self.framing(framing);
        self.str_field(f, "name");
        for key in ["arguments", "input", "args"] {
            if let Some(a) = get(f, key) {
                self.value(a.get());
                break;
            }
        }
    }
}

/// Keys whose values are identifiers, markers or ciphertext, not prompt text.
const SKIP_KEYS: &[&str] = &[
    "id",
    "type",
    "call_id",
    "tool_call_id",
    "tool_use_id",
    "status",
    "signature",
    "thoughtSignature",
    "thought_signature",
    "encrypted_content",
    "encrypted_index",
    "cache_control",
    "detail",
    "mime_type",
    "mimeType",
    "media_type",
    "index",
    "annotations",
    "logprobs",
    "citations",
];

/// An object's `type`.
pub(super) fn type_of(obj: &[Member<'_>]) -> Option<String> {
    get(obj, "type")
        .and_then(|v| json::string(v.get()))
        .map(|s| s.into_owned())
}
