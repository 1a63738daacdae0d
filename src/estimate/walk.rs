//! What the provider sees in one message (or system prompt, or tool
//! definition) of each API, turned into tokens: text is decoded and counted
//! as text, structured values (tool arguments, schemas) as compact JSON,
//! images by size, plus the framing each message costs.
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

use serde_json::value::RawValue;

use super::classes::{self, Class, Classes};
use super::images::{self, Detail};
use super::tokenizer::Encoding;
use crate::json::text::{self as json, get, kind};
use crate::provider::{Api, ImagePricing, Unit};

pub const OPENAI_PER_MESSAGE: u64 = 3;
pub const OPENAI_PER_NAME: u64 = 1;
pub const OPENAI_PER_TOOL_CALL: u64 = 3;
pub const OPENAI_PER_TOOL_DEF: u64 = 7;
pub const ANTHROPIC_PER_MESSAGE: u64 = 3;
pub const ANTHROPIC_PER_TOOL_USE: u64 = 3;
pub const GEMINI_PER_CONTENT: u64 = 3;
pub const GEMINI_PER_CALL: u64 = 3;
pub const OLLAMA_PER_MESSAGE: u64 = 4;
pub const OLLAMA_PER_CALL: u64 = 3;

/// A running count for one unit.
pub struct Ctx<'m> {
    pub enc: Encoding,
    pub api: Api,
    pub model: Option<&'m str>,
    /// Tokens by class; the unit's tokens are their sum.
    pub classes: Classes,
    pub chars: u64,
    /// Bytes handed to the tokenizer (what the incremental test watches).
    pub tokenized: u64,
}

impl Ctx<'_> {
    pub fn text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        let n = self.enc.count(s) as u64;
        self.chars += classes::attribute(self.enc, s, n, &mut self.classes);
        self.tokenized += s.len() as u64;
    }

    /// Text that is the template's rather than the conversation's (a role).
    fn framing_text(&mut self, s: &str) {
        if s.is_empty() {
            return;
        }
        self.classes.add(Class::Framing, self.enc.count(s) as u64);
        self.chars += s.chars().count() as u64;
        self.tokenized += s.len() as u64;
    }

    /// The estimator's own framing constants.
    fn add(&mut self, n: u64) {
        self.classes.add(Class::Framing, n);
    }

    /// Images and documents, priced from their size.
    fn media(&mut self, n: u64) {
        self.classes.add(Class::Media, n);
    }

    /// A role string field, counted as framing.
    fn role_field(&mut self, obj: &[Member<'_>], key: &str) {
        if let Some(s) = get(obj, key).and_then(|v| json::string(v.get())) {
            self.framing_text(&s);
        }
    }

    /// A string counted as its text; anything else as compact JSON.
    fn value(&mut self, raw: &str) {
        match json::string(raw) {
            Some(s) => self.text(&s),
            None if kind(raw) == b'n' => {}
            None => self.json(raw),
        }
    }

    fn json(&mut self, raw: &str) {
        let c = json::compact(raw);
        self.text(&c);
    }

    fn str_field(&mut self, obj: &[Member<'_>], key: &str) {
        if let Some(s) = get(obj, key).and_then(|v| json::string(v.get())) {
            self.text(&s);
        }
    }

    fn image(&mut self, url: &str, detail: Detail) {
        let size = images::data_url_payload(url).and_then(images::sniff_base64);
        let n = match self.api.provider().image_pricing() {
            ImagePricing::Anthropic => images::anthropic_tokens(size),
            ImagePricing::Gemini => images::gemini_tokens(size),
            ImagePricing::Flat => images::OLLAMA_IMAGE,
            ImagePricing::OpenAi => images::openai_tokens(size, detail, self.model),
        };
        self.media(n);
    }

    /// Unknown shapes: every string leaf as text, except identifiers and
    /// opaque blobs the model never reads; data URLs as images.
    fn generic(&mut self, raw: &str) {
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
                        self.image(&s, Detail::High);
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

type Member<'a> = (std::borrow::Cow<'a, str>, &'a RawValue);

fn type_of(obj: &[Member<'_>]) -> Option<String> {
    get(obj, "type")
        .and_then(|v| json::string(v.get()))
        .map(|s| s.into_owned())
}

/// Count one unit (framing included).
pub fn count(cx: &mut Ctx<'_>, unit: Unit, raw: &str) {
    match unit {
        Unit::ChatMessage => chat_message(cx, raw),
        Unit::ChatTool => {
            cx.add(OPENAI_PER_TOOL_DEF);
            let obj = json::object(raw).unwrap_or_default();
            match get(&obj, "function").and_then(|f| json::object(f.get())) {
                Some(f) => definition(cx, &f, &["name", "description", "parameters"]),
                None => cx.json(raw),
            }
        }
        Unit::ChatFunction => {
            cx.add(OPENAI_PER_TOOL_DEF);
            let obj = json::object(raw).unwrap_or_default();
            definition(cx, &obj, &["name", "description", "parameters"]);
        }
        Unit::RespInstructions | Unit::RespInputText => {
            cx.add(OPENAI_PER_MESSAGE + 1);
            cx.value(raw);
        }
        Unit::RespItem => responses_item(cx, raw),
        Unit::RespTool => {
            let obj = json::object(raw).unwrap_or_default();
            if type_of(&obj).as_deref() == Some("function") {
                cx.add(OPENAI_PER_TOOL_DEF);
                definition(cx, &obj, &["name", "description", "parameters"]);
            } else {
                cx.json(raw);
            }
        }
        Unit::AnthSystem => {
            cx.add(ANTHROPIC_PER_MESSAGE);
            anthropic_content(cx, raw, 0);
        }
        Unit::AnthMessage => {
            cx.add(ANTHROPIC_PER_MESSAGE);
            match json::object(raw) {
                Some(obj) => {
                    cx.role_field(&obj, "role");
                    if let Some(c) = get(&obj, "content") {
                        anthropic_content(cx, c.get(), 0);
                    }
                }
                None => cx.generic(raw),
            }
        }
        Unit::AnthTool => {
            let obj = json::object(raw).unwrap_or_default();
            if get(&obj, "input_schema").is_some() {
                definition(cx, &obj, &["name", "description", "input_schema"]);
            } else {
                // Server tools (web search, code execution): their name and settings.
                cx.json(raw);
            }
        }
        Unit::GemSystem => {
            cx.add(GEMINI_PER_CONTENT);
            gemini_content(cx, raw);
        }
        Unit::GemContent => {
            cx.add(GEMINI_PER_CONTENT);
            gemini_content(cx, raw);
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
                        definition(
                            cx,
                            &d,
                            &[
                                "name",
                                "description",
                                "parameters",
                                "parametersJsonSchema",
                                "parameters_json_schema",
                                "response",
                            ],
                        );
                    }
                }
                None => cx.json(raw),
            }
        }
        Unit::OllamaMessage => ollama_message(cx, raw),
        Unit::OllamaTool => {
            let obj = json::object(raw).unwrap_or_default();
            match get(&obj, "function").and_then(|f| json::object(f.get())) {
                Some(f) => definition(cx, &f, &["name", "description", "parameters"]),
                None => cx.json(raw),
            }
        }
        Unit::OllamaText => {
            cx.add(OLLAMA_PER_MESSAGE);
            cx.value(raw);
        }
        Unit::OllamaImage => cx.media(images::OLLAMA_IMAGE),
    }
}

/// A tool definition as the compact JSON of the members that describe it, in
/// the order given.
fn definition(cx: &mut Ctx<'_>, obj: &[Member<'_>], keys: &[&str]) {
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
    cx.text(&s);
}

// ---- OpenAI chat ------------------------------------------------------

fn chat_message(cx: &mut Ctx<'_>, raw: &str) {
    cx.add(OPENAI_PER_MESSAGE);
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
                cx.add(OPENAI_PER_NAME);
            }
            "content" => openai_content(cx, v.get()),
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
                        function_call(cx, &f, OPENAI_PER_TOOL_CALL);
                    }
                }
            }
            "function_call" => {
                if let Some(f) = json::object(v.get()) {
                    function_call(cx, &f, OPENAI_PER_TOOL_CALL);
                }
            }
            _ => {}
        }
    }
}

/// `{name, arguments}` (OpenAI: arguments is a JSON string; Ollama: an object).
fn function_call(cx: &mut Ctx<'_>, f: &[Member<'_>], framing: u64) {
    cx.add(framing);
    cx.str_field(f, "name");
    for key in ["arguments", "input", "args"] {
        if let Some(a) = get(f, key) {
            cx.value(a.get());
            break;
        }
    }
}

/// Chat `content`: a string, or parts (`text`, `image_url`, audio, files).
fn openai_content(cx: &mut Ctx<'_>, raw: &str) {
    match kind(raw) {
        b'"' => {
            if let Some(s) = json::string(raw) {
                cx.text(&s);
            }
        }
        b'[' => {
            for part in json::array(raw).unwrap_or_default() {
                openai_part(cx, part.get());
            }
        }
        b'n' => {}
        _ => cx.generic(raw),
    }
}

/// One content part of either OpenAI API.
fn openai_part(cx: &mut Ctx<'_>, raw: &str) {
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
            cx.image(url.as_deref().unwrap_or(""), detail_of(detail.as_deref()));
        }
        Some("input_image") => {
            let url = get(&obj, "image_url").and_then(|u| json::string(u.get()));
            let detail = get(&obj, "detail").and_then(|d| json::string(d.get()));
            cx.image(url.as_deref().unwrap_or(""), detail_of(detail.as_deref()));
        }
        Some("file" | "input_file") => cx.media(images::DOCUMENT_DEFAULT),
        _ => cx.generic(raw),
    }
}

fn detail_of(d: Option<&str>) -> Detail {
    match d {
        Some("low") => Detail::Low,
        _ => Detail::High,
    }
}

// ---- OpenAI Responses ---------------------------------------------------

fn responses_item(cx: &mut Ctx<'_>, raw: &str) {
    let Some(obj) = json::object(raw) else {
        cx.add(OPENAI_PER_MESSAGE);
        cx.generic(raw);
        return;
    };
    let ty = type_of(&obj);
    match ty.as_deref() {
        None | Some("message") => {
            cx.add(OPENAI_PER_MESSAGE);
            cx.role_field(&obj, "role");
            if let Some(c) = get(&obj, "content") {
                openai_content(cx, c.get());
            }
        }
        Some("function_call" | "custom_tool_call") => {
            function_call(cx, &obj, OPENAI_PER_MESSAGE);
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            cx.add(OPENAI_PER_MESSAGE);
            if let Some(o) = get(&obj, "output") {
                match kind(o.get()) {
                    b'[' => openai_content(cx, o.get()),
                    _ => cx.value(o.get()),
                }
            }
        }
        Some("reasoning") => {
            // The visible summary; the encrypted chain of thought is opaque.
            for key in ["summary", "content"] {
                for part in get(&obj, key)
                    .and_then(|s| json::array(s.get()))
                    .unwrap_or_default()
                {
                    openai_part(cx, part.get());
                }
            }
        }
        Some("item_reference") => {}
        Some(_) => {
            cx.add(OPENAI_PER_MESSAGE);
            cx.generic(raw);
        }
    }
}

// ---- Anthropic ----------------------------------------------------------

/// A string, or content blocks (also the `content` of a `tool_result`).
fn anthropic_content(cx: &mut Ctx<'_>, raw: &str, depth: u32) {
    match kind(raw) {
        b'"' => {
            if let Some(s) = json::string(raw) {
                cx.text(&s);
            }
        }
        b'[' if depth < 8 => {
            for block in json::array(raw).unwrap_or_default() {
                anthropic_block(cx, block.get(), depth);
            }
        }
        b'n' => {}
        _ => cx.generic(raw),
    }
}

fn anthropic_block(cx: &mut Ctx<'_>, raw: &str, depth: u32) {
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
            let size = get(&src, "data")
                .and_then(|d| json::string(d.get()))
                .and_then(|d| images::sniff_base64(&d));
            cx.media(images::anthropic_tokens(size));
        }
        Some("document") => {
            let src = get(&obj, "source")
                .and_then(|s| json::object(s.get()))
                .unwrap_or_default();
            match type_of(&src).as_deref() {
                Some("text") => cx.str_field(&src, "data"),
                Some("content") => {
                    if let Some(c) = get(&src, "content") {
                        anthropic_content(cx, c.get(), depth + 1);
                    }
                }
                _ => cx.media(images::DOCUMENT_DEFAULT),
            }
            cx.str_field(&obj, "title");
            cx.str_field(&obj, "context");
        }
        Some("tool_use" | "server_tool_use") => {
            cx.add(ANTHROPIC_PER_TOOL_USE);
            cx.str_field(&obj, "name");
            if let Some(i) = get(&obj, "input") {
                cx.value(i.get());
            }
        }
        Some("tool_result") => {
            cx.add(ANTHROPIC_PER_TOOL_USE);
            if let Some(c) = get(&obj, "content") {
                anthropic_content(cx, c.get(), depth + 1);
            }
        }
        _ => cx.generic(raw),
    }
}

// ---- Gemini -------------------------------------------------------------

/// A `Content` (`{role, parts}`); also accepts a bare string or part list.
fn gemini_content(cx: &mut Ctx<'_>, raw: &str) {
    match kind(raw) {
        b'{' => {
            let obj = json::object(raw).unwrap_or_default();
            cx.role_field(&obj, "role");
            match get(&obj, "parts") {
                Some(parts) => gemini_parts(cx, parts.get()),
                None => gemini_part(cx, raw),
            }
        }
        b'[' => gemini_parts(cx, raw),
        _ => cx.generic(raw),
    }
}

fn gemini_parts(cx: &mut Ctx<'_>, raw: &str) {
    match json::array(raw) {
        Some(parts) => {
            for p in parts {
                gemini_part(cx, p.get());
            }
        }
        None => gemini_part(cx, raw),
    }
}

fn gemini_part(cx: &mut Ctx<'_>, raw: &str) {
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
        let size = if mime.as_deref().is_some_and(|m| m.starts_with("image/")) {
            get(&d, "data")
                .and_then(|x| json::string(x.get()))
                .and_then(|x| images::sniff_base64(&x))
        } else {
            None
        };
        cx.media(images::gemini_tokens(size));
    } else if pick("fileData", "file_data").is_some() {
        cx.media(images::GEMINI_DEFAULT);
    } else if let Some(f) = pick("functionCall", "function_call") {
        let f = json::object(f.get()).unwrap_or_default();
        function_call(cx, &f, GEMINI_PER_CALL);
    } else if let Some(f) = pick("functionResponse", "function_response") {
        let f = json::object(f.get()).unwrap_or_default();
        cx.add(GEMINI_PER_CALL);
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

// ---- Ollama -------------------------------------------------------------

fn ollama_message(cx: &mut Ctx<'_>, raw: &str) {
    cx.add(OLLAMA_PER_MESSAGE);
    let Some(obj) = json::object(raw) else {
        cx.generic(raw);
        return;
    };
    cx.role_field(&obj, "role");
    if let Some(c) = get(&obj, "content") {
        openai_content(cx, c.get());
    }
    cx.str_field(&obj, "tool_name");
    let attached = get(&obj, "images")
        .and_then(|i| json::array(i.get()))
        .map_or(0, |a| a.len() as u64);
    cx.media(attached * images::OLLAMA_IMAGE);
    for call in get(&obj, "tool_calls")
        .and_then(|c| json::array(c.get()))
        .unwrap_or_default()
    {
        let call = json::object(call.get()).unwrap_or_default();
        if let Some(f) = get(&call, "function").and_then(|f| json::object(f.get())) {
            function_call(cx, &f, OLLAMA_PER_CALL);
        }
    }
}
