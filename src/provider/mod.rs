//! Provider knowledge behind one trait: which paths an API owns, what a request
//! looks like to the estimator, where usage sits in a response, and the error
//! shapes its SDKs understand. Adding an API is one file here and one line in
//! [`ALL`].

use std::borrow::Cow;
use std::ops::Range;

use serde_json::Value;

pub use crate::json::Node;
use crate::json::{Obj, RequestView};

mod anthropic;
mod gemini;
mod ollama;
mod openai_chat;
mod openai_responses;
mod walk;

pub use anthropic::Anthropic;
pub use gemini::Gemini;
pub use ollama::Ollama;
pub use openai_chat::OpenAiChat;
pub use openai_responses::{websocket as responses_websocket, OpenAiResponses};
pub use walk::{Count, Detail};

/// The APIs tidemark understands. The string form is the `api` metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    OpenAiChat,
    OpenAiResponses,
    Anthropic,
    Gemini,
    Ollama,
}

impl Api {
    pub const fn as_str(self) -> &'static str {
        match self {
            Api::OpenAiChat => "openai-chat",
            Api::OpenAiResponses => "openai-responses",
            Api::Anthropic => "anthropic-messages",
            Api::Gemini => "gemini",
            Api::Ollama => "ollama",
        }
    }
    /// The API whose [`Api::as_str`] is `s`.
    pub fn named(s: &str) -> Option<Api> {
        ALL.iter().map(|p| p.api()).find(|a| a.as_str() == s)
    }
    pub fn provider(self) -> &'static dyn Provider {
        match self {
            Api::OpenAiChat => &OpenAiChat,
            Api::OpenAiResponses => &OpenAiResponses,
            Api::Anthropic => &Anthropic,
            Api::Gemini => &Gemini,
            Api::Ollama => &Ollama,
        }
    }
}

/// Every provider, in the order paths are tried.
pub static ALL: &[&dyn Provider] = &[&OpenAiChat, &OpenAiResponses, &Anthropic, &Gemini, &Ollama];

/// The provider that owns `path` (without query), if any.
pub fn for_path(path: &str) -> Option<&'static dyn Provider> {
    ALL.iter().copied().find(|p| p.matches_path(path))
}

/// An API's names in the OpenTelemetry GenAI semantic conventions: the
/// operation (one of the conventions' well-known values) and the provider
/// (a well-known value where one fits, else the conventions allow our own).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenAi {
    pub operation: &'static str,
    pub provider: &'static str,
}

/// Token usage as one response reported it. `None` is "not reported", never 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// The provider's headline input figure as sent (Anthropic: uncached remainder only).
    pub input: Option<u64>,
    /// Tokens read from a prompt cache.
    pub cached_input: Option<u64>,
    /// Tokens written to a prompt cache (Anthropic); 0 where the API has no such concept.
    pub cache_creation: Option<u64>,
    /// Generated tokens, reasoning included.
    pub output: Option<u64>,
    /// The full prompt the model saw: the number anchors are made of.
    pub total_context: Option<u64>,
}

impl Usage {
    /// Whether the response reported the prompt size (what anchoring needs).
    pub fn has_context(&self) -> bool {
        self.total_context.is_some()
    }
}

/// How a response body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `text/event-stream`.
    Sse,
    /// One JSON object per line (Ollama native streams).
    Ndjson,
    /// One JSON document (non-stream bodies, Gemini's streamed array without `alt=sse`).
    Json,
}

/// Where a request's countable content lives: a top-level field, how the
/// estimator counts it, whether each element of it is a separate unit
/// (cached and counted on its own), and what it is to a conversation. One
/// table serves the estimator and the session identity, so the two never
/// disagree on what a request holds.
#[derive(Debug, Clone, Copy)]
pub struct CountedField {
    pub name: &'static str,
    pub unit: Unit,
    /// Array whose elements are messages/items (each framed and cached separately).
    pub per_element: bool,
    pub part: Part,
}

/// What a cached unit is: the same bytes count differently in another slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Unit {
    ChatMessage = 1,
    ChatTool,
    ChatFunction,
    RespInstructions,
    RespInputText,
    RespItem,
    RespTool,
    AnthSystem,
    AnthMessage,
    AnthTool,
    GemSystem,
    GemContent,
    GemTool,
    OllamaMessage,
    OllamaTool,
    OllamaText,
    OllamaImage,
}

impl Unit {
    /// The unit a per-element field's value is counted as when it is not
    /// an array (Responses `input` is a string or a list of items).
    pub fn whole(self) -> Unit {
        match self {
            Unit::RespItem => Unit::RespInputText,
            u => u,
        }
    }
}

/// How an API prices an image in a prompt (the rules are the estimator's,
/// `estimate/images.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImagePricing {
    /// 512px tiles by `detail`, a base and a per-tile cost by model.
    OpenAi,
    /// Pixels over 750, the long edge scaled to 1568.
    Anthropic,
    /// 258 per tile of two thirds of the shorter side.
    Gemini,
    /// One figure whatever the size (local models vary).
    Flat,
}

/// A public tokenizer vocabulary (the estimator's `Encoding` counts with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vocabulary {
    O200kBase,
    Cl100kBase,
}

/// What a counted field is to a conversation's identity (the fingerprint
/// and the lane): its system prompt, its history, or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Instructions before any message.
    System,
    /// The messages; those before the first user message belong to the
    /// system prompt (OpenAI's system and developer messages).
    History,
    /// Tool definitions and the like: they change with the agent's
    /// configuration, not with the conversation.
    Other,
}

/// A [`CountedField`] in one line: `field(name, unit, per_element, part)`.
pub(crate) const fn field(
    name: &'static str,
    unit: Unit,
    per_element: bool,
    part: Part,
) -> CountedField {
    CountedField {
        name,
        unit,
        per_element,
        part,
    }
}

/// The conversation array of an API's table: the history counted element
/// by element (`messages`, Responses `input`, Gemini `contents`), the one
/// a trimmer cuts.
pub fn history(p: &dyn Provider) -> Option<&'static CountedField> {
    p.counted_fields()
        .iter()
        .find(|f| f.part == Part::History && f.per_element)
}

/// One element of the conversation array as a trimmer sees it.
#[derive(Debug, Clone, Default)]
pub struct Element {
    /// A user message that is not a tool result: a turn starts here.
    pub turn_start: bool,
    /// A user message (tool results included): needs a gap marker before it
    /// where roles must alternate.
    pub user: bool,
    /// Produced by the model (assistant / model message, Responses output
    /// item): a tool step may start here.
    pub assistant: bool,
    /// A Responses reasoning item, which must stay with the item after it.
    pub reasoning: bool,
    /// Tool call ids this element issues.
    pub calls: Vec<String>,
    /// Tool call ids whose results this element carries (`None`: no id, as in
    /// Ollama or Gemini without ids; bound to the nearest preceding call).
    pub results: Vec<Option<String>>,
    /// Byte ranges (in the body) of tool outputs a trimmer may elide.
    pub outputs: Vec<Range<usize>>,
}

impl Element {
    /// An element by its `role` alone (`user`, `assistant`), and the role.
    pub(crate) fn by_role(o: &Obj<'_>) -> (Element, Option<String>) {
        let role = o.str("role");
        let e = Element {
            user: role.as_deref() == Some("user"),
            assistant: role.as_deref() == Some("assistant"),
            ..Element::default()
        };
        (e, role)
    }
}

/// The text that replaces an elided tool output.
pub(crate) fn elided_text(bytes: usize) -> String {
    format!("[tidemark: elided {bytes} bytes of tool output]")
}

/// The text of a gap marker.
pub(crate) fn gap_text(dropped: usize) -> String {
    format!("[tidemark: {dropped} earlier messages omitted]")
}

/// Chat-shaped elements (OpenAI chat, Ollama): `tool_calls` issue calls, a
/// `tool` message carries one result and its `content` is the output.
pub(crate) fn chat_element(b: &[u8], r: Range<usize>) -> Option<Element> {
    let o = Obj::parse(b, r)?;
    let (mut e, role) = Element::by_role(&o);
    e.turn_start = role.as_deref() == Some("user");
    if let Some(tc) = o.get("tool_calls") {
        for r in crate::json::elements(b, tc).unwrap_or_default() {
            let id = Obj::parse(b, r).and_then(|c| c.str("id"));
            e.calls.push(id.unwrap_or_default());
        }
    }
    if role.as_deref() == Some("tool") {
        e.results.push(o.str("tool_call_id"));
        e.outputs.extend(o.get("content"));
    }
    Some(e)
}

/// A tidemark-made error, to be rendered in the API's own shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// Generic error: (HTTP status, OpenAI `type` / Anthropic `error.type` hint, code).
    Generic { status: u16 },
    /// The context-length rejection, P projected tokens against window W.
    ContextLength { projected: u64, window: u64 },
    /// The session budget rejection.
    SessionBudget { spent: u64, budget: u64 },
}

/// What a provider's context-length refusal says: the window the endpoint
/// really enforces for the model (a gateway, a tier, a local server's
/// `n_ctx` often enforce less than the model's published window) and, where
/// the message names it, the prompt's size as the provider counted it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextError {
    pub window: u64,
    /// The prompt's real size: a count as good as a response's usage.
    pub prompt: Option<u64>,
    /// Only a lower bound on the prompt (vLLM stops counting one token past
    /// what fits): proof that it did not fit, not a count.
    pub prompt_at_least: Option<u64>,
}

/// How an API caches prompt prefixes, for the cache economics of a lane
/// (`session/cache.rs`): what a request leaves cached and what a reuse is
/// reported as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptCache {
    /// Every prompt of at least `min` tokens is cached whole, and reads
    /// come in multiples of `granularity` (OpenAI: 1024 and 128).
    Automatic { min: u64, granularity: u64 },
    /// Only prefixes that end at a client's breakpoint are written, and the
    /// response reports reads and writes apart (Anthropic `cache_control`).
    Breakpoints,
}

impl PromptCache {
    /// Tokens a request of `real` prompt tokens left in the cache, from
    /// what its response reported.
    pub fn extent(&self, real: u64, usage: &Usage) -> u64 {
        match *self {
            PromptCache::Automatic { .. } => self.reusable(real),
            PromptCache::Breakpoints => usage
                .cached_input
                .unwrap_or(0)
                .saturating_add(usage.cache_creation.unwrap_or(0)),
        }
    }

    /// Of a prefix of `tokens`, what a cache read of it is reported as
    /// (rounded down to the block, nothing under the minimum).
    pub fn reusable(&self, tokens: u64) -> u64 {
        match *self {
            PromptCache::Automatic { min, granularity } => {
                let g = granularity.max(1);
                if tokens >= min {
                    tokens / g * g
                } else {
                    0
                }
            }
            PromptCache::Breakpoints => tokens,
        }
    }
}

/// What the tap learned from one response.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Observed {
    pub usage: Usage,
    /// The response's id, where a later request can continue it (Responses
    /// `previous_response_id`).
    pub response_id: Option<String>,
    /// The stream carried an error event after a 2xx status.
    pub stream_error: bool,
    /// The provider edited the context on its side before counting it
    /// (Anthropic `context_management` edits, a Responses compaction): the
    /// tokens it says it cleared, 0 when it does not say. The count then
    /// dropped while the request did not.
    pub server_edit: Option<u64>,
    /// The provider refused the request as over its window and named the
    /// prompt's real size (`Provider::context_error`).
    pub refused_prompt: Option<u64>,
}

pub trait Provider: Send + Sync + 'static {
    fn api(&self) -> Api;

    /// How the OpenTelemetry GenAI conventions name this API's calls
    /// (`gen_ai.operation.name`, `gen_ai.provider.name`).
    fn genai(&self) -> GenAi;

    /// Does a request path (no query) belong to this API?
    fn matches_path(&self, path: &str) -> bool;

    // ---- request side -------------------------------------------------

    /// The model the request names (body field, or the path for Gemini).
    fn model(&self, path: &str, req: &RequestView<'_>) -> Option<String>;

    /// Whether the response will be streamed.
    fn is_stream(&self, path: &str, query: Option<&str>, req: &RequestView<'_>) -> bool;

    /// Top-level fields holding what the provider will count, in the order
    /// the provider sees them (system first).
    fn counted_fields(&self) -> &'static [CountedField];

    /// How the API prices an image in a prompt.
    fn image_pricing(&self) -> ImagePricing;

    /// Whether its streams carry usage only when the request asks for it
    /// (`stream_options.include_usage`), an option tidemark may add and then
    /// strip from the stream (`tap/inject.rs`).
    fn usage_on_request(&self) -> bool {
        false
    }

    /// Whether a path no API owns still looks like this API's (a version or
    /// route tidemark does not serve), so that an error answered for it
    /// comes in this API's shape. Tried in [`ALL`]'s order; when none
    /// does, OpenAI's shape.
    fn resembles_path(&self, _path: &str) -> bool {
        false
    }

    /// Walk one unit of this API's request (a message, a system prompt, a
    /// tool definition; framing included), reporting what the model sees to
    /// `cx` (`provider/walk.rs`). Units of other APIs are not this walk's.
    fn walk(&self, unit: Unit, raw: &str, cx: &mut dyn Count);

    /// The vocabulary that stands in for the API's tokenizer when the model
    /// name does not say which family it is (or there is none).
    fn default_vocabulary(&self) -> Vocabulary;

    /// Tokens the provider's template adds to every request to open the
    /// model's reply (the framing of `provider/walk.rs`).
    fn reply_framing(&self) -> u64 {
        3
    }

    /// Tokens a block of this API's `unit`s costs once (a tool block's
    /// wrapper), when the request holds any.
    fn block_framing(&self, _unit: Unit) -> u64 {
        0
    }

    /// The request's cap on output tokens, for `--reserve-output`.
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64>;

    /// The response this request continues (Responses `previous_response_id`).
    fn continues(&self, _req: &RequestView<'_>) -> Option<String> {
        None
    }

    /// A conversation id the agent put in the body of its own accord
    /// (SPEC §4's agent identities that live in the API's request shape).
    fn agent_session_id<'a>(&self, _req: &RequestView<'a>) -> Option<Cow<'a, str>> {
        None
    }

    /// `--exact-cold-start`: the provider's own counting endpoint for this
    /// request, as (path, body); `None` where the API has none.
    fn count_request(&self, _path: &str, _req: &RequestView<'_>) -> Option<(String, Vec<u8>)> {
        None
    }

    /// The prompt size in a counting endpoint's answer.
    fn count_response(&self, _json: &Value) -> Option<u64> {
        None
    }

    // ---- response side ------------------------------------------------

    /// Framing of a response body, given its content type and whether the
    /// request asked for a stream.
    fn framing(&self, content_type: Option<&str>, _stream: bool) -> Framing {
        match content_type {
            Some(ct) if ct.starts_with("text/event-stream") => Framing::Sse,
            Some(ct) if ct.starts_with("application/x-ndjson") => Framing::Ndjson,
            _ => Framing::Json,
        }
    }

    /// Cheap check before any JSON parse: could this event's data carry usage,
    /// a response id or an error? `event` is the SSE `event:` name.
    fn may_carry_usage(&self, event: Option<&str>, data: &[u8]) -> bool;

    /// Given a run of whole SSE events as raw bytes (`event:`/`data:` lines
    /// and all), the offset of the first byte that may matter: every event
    /// that ends before it is skipped unread. Only events
    /// [`may_carry_usage`](Self::may_carry_usage) would say no to, whatever
    /// their lines hold, may lie before it, and events whose every value
    /// [`observe`](Self::observe) would take a later event of the run
    /// replaces (cumulative usage: the last wins); when unsure, earlier. The
    /// default, 0, reads every event.
    fn sse_relevant_from(&self, _raw: &[u8]) -> usize {
        0
    }

    /// The JSON members [`observe`](Self::observe) reads, at any depth: the
    /// tap builds only these (objects among them filtered by the same list)
    /// and steps over everything else checking its syntax only; generated
    /// content is most of a response's bytes. Top-level arrays are read
    /// element by element.
    fn reads(&self) -> &'static [&'static str];

    /// Fold one parsed event (or NDJSON line, or a whole JSON body) into `acc`,
    /// holding only the members [`reads`](Self::reads) names. Later values
    /// replace earlier ones: repeated usage is cumulative.
    fn observe(&self, event: Option<&str>, json: &Node, acc: &mut Observed);

    // ---- errors -------------------------------------------------------

    /// The body of an error tidemark itself produces, in this API's shape.
    /// `kind` is the `x-tidemark-error` value.
    fn error_body(&self, shape: ErrorShape, kind: &str, message: &str) -> Vec<u8>;

    /// What a refusal (`status`, the body as sent, decoded) says of the
    /// window, when it is this API's context-length error; `None` for
    /// every other error, and where the API's refusal names no numbers.
    fn context_error(&self, _status: u16, _body: &[u8]) -> Option<ContextError> {
        None
    }

    // ---- trimming -----------------------------------------------------

    /// What element `b[r]` of the conversation array is to a trimmer
    /// (`trim.rs`): turn starts, roles, tool calls and results, outputs
    /// that may be elided. `None`: not an element this API's trimmer
    /// understands (the request is then left whole).
    fn element(&self, b: &[u8], r: Range<usize>) -> Option<Element>;

    /// What an elided tool output of `bytes` JSON bytes is replaced with,
    /// as a JSON value.
    fn elided(&self, bytes: usize) -> Vec<u8> {
        serde_json::to_vec(&elided_text(bytes)).unwrap_or_default()
    }

    /// The message that stands for `dropped` elements cut before a user
    /// message, where the API requires roles to alternate; `None`: a gap
    /// needs none.
    fn gap_marker(&self, _dropped: usize) -> Option<Vec<u8>> {
        None
    }

    /// The member that marks a prompt-cache breakpoint and how many a
    /// request may hold, where the client places them (Anthropic
    /// `cache_control`, 4): a trim that elides must keep within it.
    fn cache_breakpoints(&self) -> Option<(&'static str, usize)> {
        None
    }

    // ---- prompt cache -------------------------------------------------

    /// How this API caches prompt prefixes.
    fn prompt_cache(&self) -> PromptCache {
        PromptCache::Automatic {
            min: 1024,
            granularity: 1,
        }
    }
}

// ---- helpers the provider files share ----------------------------------

/// A token count member; `None` when absent or not a non-negative integer.
pub(crate) fn count<V: Members>(v: &V, key: &str) -> Option<u64> {
    v.member_u64(key)
}

/// Objects [`count`] reads: a request's `Value`s and a response's [`Node`]s.
pub(crate) trait Members {
    fn member_u64(&self, key: &str) -> Option<u64>;
}
impl Members for Value {
    fn member_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }
}
impl Members for Node {
    fn member_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }
}

/// A byte pattern looked for in every event: its searcher is built once.
pub(crate) type Key = std::sync::LazyLock<memchr::memmem::Finder<'static>>;

macro_rules! keys {
    ($($name:ident = $lit:literal;)*) => {
        $(pub(crate) static $name: Key = Key::new(|| memchr::memmem::Finder::new($lit));)*
    };
}
keys! {
    USAGE = b"\"usage\"";
    ERROR = b"\"error\"";
    USAGE_METADATA = b"\"usageMetadata\"";
    EVAL_COUNT = b"eval_count";
    RESPONSE_CREATED = b"response.created";
    CHOICES = b"\"choices\"";
}

/// `f` of `model` lowercased (ASCII) with any router prefix stripped:
/// `OpenAI/GPT-4o` -> `gpt-4o`. A name of up to 128 bytes is lowercased on
/// the stack: this runs on every request, several times.
pub fn with_base_name<R>(model: &str, f: impl FnOnce(&str) -> R) -> R {
    let name = strip_prefix(model);
    let mut buf = [0u8; 128];
    match buf.get_mut(..name.len()) {
        Some(b) => {
            b.copy_from_slice(name.as_bytes());
            b.make_ascii_lowercase();
            // ASCII lowercasing keeps UTF-8 valid.
            f(std::str::from_utf8(b).unwrap_or(name))
        }
        None => f(&name.to_ascii_lowercase()),
    }
}

/// `models/gemini-2.5-pro` -> `gemini-2.5-pro`; `openai/gpt-4o` -> `gpt-4o`.
fn strip_prefix(model: &str) -> &str {
    // memchr's byte search: str::rfind goes through the general pattern
    // code even for one byte, and this runs several times a request.
    match memchr::memrchr(b'/', model.as_bytes()) {
        Some(i) => &model[i + 1..],
        None => model,
    }
}

/// A JSON object of the request's top-level members named in `keep`, their
/// raw bytes unchanged (a counting endpoint takes a subset of the request).
pub(crate) fn subset_object(req: &RequestView<'_>, keep: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(req.body.len());
    out.push(b'{');
    for (name, raw) in req.fields() {
        if keep.contains(&name) {
            if out.len() > 1 {
                out.push(b',');
            }
            out.extend_from_slice(serde_json::to_string(name).unwrap_or_default().as_bytes());
            out.push(b':');
            out.extend_from_slice(raw.get().as_bytes());
        }
    }
    out.push(b'}');
    out
}

/// Cheap byte check before any parse: does `data` hold the member `key`
/// (quotes included, e.g. [`USAGE`]) with a value other than `null`?
/// False positives only cost a parse; a truncated value counts as present.
pub(crate) fn has_member(data: &[u8], key: &Key) -> bool {
    let ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\r' | b'\n');
    let len = key.needle().len();
    key.find_iter(data)
        .any(|at| member_value(&data[at + len..], ws).is_some_and(|v| !v.starts_with(b"null")))
}

/// What follows `: ` after a key, whitespace as `ws` says; `None` without a colon.
fn member_value(rest: &[u8], ws: impl Fn(&u8) -> bool) -> Option<&[u8]> {
    let rest = &rest[rest.iter().take_while(|b| ws(b)).count()..];
    let rest = rest.strip_prefix(b":")?;
    Some(&rest[rest.iter().take_while(|b| ws(b)).count()..])
}

/// Where the first occurrence of `key` in `raw` that does not read
/// `key: null` (whitespace allowed) starts; `raw.len()` when every one
/// does. The conservative side of [`has_member`] for raw SSE bytes: a key
/// followed by anything else, a line break into another `data:` line
/// included, counts as a value.
pub(crate) fn first_valued(raw: &[u8], key: &Key) -> usize {
    valued(raw, key, 0, raw.len()).next().unwrap_or(raw.len())
}

/// Where the last occurrence of `key` in `raw` that does not read
/// `key: null` starts; `raw.len()` when every one does. [`first_valued`]'s
/// rules, searched from the end: for a member that is cumulative (the last
/// one wins), a burst of events that each carry it is searched only near
/// its end. (memchr's reverse searcher has no SIMD path and is several
/// times slower than a forward search over the tail.)
pub(crate) fn last_valued(raw: &[u8], key: &Key) -> usize {
    const TAIL: usize = 512;
    let tail = raw.len().saturating_sub(TAIL);
    valued(raw, key, tail, raw.len())
        .last()
        .or_else(|| valued(raw, key, 0, tail).last())
        .unwrap_or(raw.len())
}

/// The occurrences of `key` that start in `start..end` and do not read
/// `key: null` in `raw` ([`first_valued`]'s rules), in order.
fn valued<'r>(
    raw: &'r [u8],
    key: &'r Key,
    start: usize,
    end: usize,
) -> impl Iterator<Item = usize> + 'r {
    let ws = |b: &u8| matches!(b, b' ' | b'\t');
    let len = key.needle().len();
    let hay = &raw[start..(end + len - 1).min(raw.len())];
    // `find` in a loop, not `find_iter`: the iterator clones the searcher,
    // which costs more than the search on a 200-byte event.
    let mut from = 0;
    std::iter::from_fn(move || {
        while let Some(i) = key.find(&hay[from..]) {
            let at = start + from + i;
            from += i + len;
            if !member_value(&raw[at + len..], ws).is_some_and(|v| v.starts_with(b"null")) {
                return Some(at);
            }
        }
        None
    })
}

/// Whether a JSON value is set to something (not absent, null, false or "").
pub(crate) fn truthy(v: Option<&Node>) -> bool {
    match v {
        None | Some(Node::Null) | Some(Node::Bool(false)) => false,
        Some(Node::Str(s)) => !s.is_empty(),
        Some(_) => true,
    }
}

/// The integer that follows `after` in `text` (spaces, `(` and `$` skipped,
/// thousands separators read through); `None` when `after` is absent or no
/// digit follows it.
pub(crate) fn number_after(text: &str, after: &str) -> Option<u64> {
    let at = text.find(after)? + after.len();
    let rest = text[at..].trim_start_matches([' ', '(', '$']);
    let mut n: u64 = 0;
    let mut digits = 0;
    for c in rest.chars() {
        match c {
            '0'..='9' => {
                n = n.checked_mul(10)?.checked_add(u64::from(c as u8 - b'0'))?;
                digits += 1;
            }
            ',' if digits > 0 => {}
            _ => break,
        }
    }
    (digits > 0).then_some(n)
}

/// The `error` object of an error body: `{"error":{...}}`, or the first
/// element of a JSON array of them (Gemini's streamed array form).
pub(crate) fn error_object(body: &[u8]) -> Option<Value> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let v = match v {
        Value::Array(mut a) if !a.is_empty() => a.swap_remove(0),
        v => v,
    };
    match v {
        Value::Object(mut o) => o.remove("error").filter(Value::is_object),
        _ => None,
    }
}

/// The OpenAI error object (chat completions, Responses), all four keys present.
pub(crate) fn openai_error_body(shape: ErrorShape, kind: &str, message: &str) -> Vec<u8> {
    let (msg, typ, param, code): (String, &str, Value, Value) = match shape {
        ErrorShape::ContextLength { projected, window } => (
            format!(
                "This model's maximum context length is {window} tokens. However, your messages resulted in {projected} tokens. Please reduce the length of the messages."
            ),
            "invalid_request_error",
            Value::from("messages"),
            Value::from("context_length_exceeded"),
        ),
        ErrorShape::SessionBudget { spent, budget } => (
            session_budget_message(spent, budget, message),
            "invalid_request_error",
            Value::Null,
            Value::from("session_budget_exceeded"),
        ),
        ErrorShape::Generic { status } => (
            message.to_string(),
            match status {
                400..=499 => "invalid_request_error",
                _ => "server_error",
            },
            Value::Null,
            Value::from(kind.replace('-', "_")),
        ),
    };
    serde_json::to_vec(&serde_json::json!({
        "error": {"message": msg, "type": typ, "param": param, "code": code}
    }))
    .unwrap_or_default()
}

/// A session budget message that always opens with `session_budget_exceeded:`.
pub(crate) fn session_budget_message(spent: u64, budget: u64, message: &str) -> String {
    if message.starts_with("session_budget_exceeded:") {
        message.to_string()
    } else {
        format!("session_budget_exceeded: this session spent {spent} tokens of its {budget}-token budget")
    }
}

#[cfg(test)]
mod helper_tests {
    use super::*;

    #[test]
    fn numbers_after_a_phrase() {
        assert_eq!(
            number_after("count (1200293) exceeds", "count"),
            Some(1_200_293)
        );
        assert_eq!(number_after("is 128,000 tokens", "is"), Some(128_000));
        assert_eq!(number_after("size, try", "size"), None);
        assert_eq!(number_after("no phrase", "size"), None);
        assert_eq!(number_after("is 99999999999999999999999", "is"), None);
    }

    #[test]
    fn responses_refusal_names_no_numbers() {
        let fx = include_str!(
            "../../tests/fixtures/openai-responses/error_context_length_exceeded.json"
        );
        assert_eq!(OpenAiResponses.context_error(400, fx.as_bytes()), None);
        // A server answering /responses in the chat wording teaches as on chat.
        let vllm = r#"{"error":{"message":"This model's maximum context length is 4096 tokens. However, your messages resulted in 5000 tokens.","type":"BadRequestError","param":null,"code":400}}"#;
        assert_eq!(
            OpenAiResponses.context_error(400, vllm.as_bytes()),
            Some(ContextError {
                window: 4096,
                prompt: Some(5000),
                prompt_at_least: None
            })
        );
        // Ollama never refuses: it truncates.
        assert_eq!(Ollama.context_error(400, vllm.as_bytes()), None);
    }

    #[test]
    fn what_a_request_leaves_cached() {
        let openai = OpenAiChat.prompt_cache();
        assert_eq!(openai.extent(1023, &Usage::default()), 0);
        assert_eq!(openai.extent(1300, &Usage::default()), 1280);
        let u = Usage {
            cached_input: Some(2000),
            cache_creation: Some(300),
            ..Default::default()
        };
        assert_eq!(Anthropic.prompt_cache().extent(9000, &u), 2300);
        assert_eq!(Gemini.prompt_cache().reusable(1030), 1030);
        assert_eq!(Ollama.prompt_cache().reusable(10), 10);
    }

    #[test]
    fn has_member_skips_null() {
        assert!(has_member(br#"{"usage": {"a":1}}"#, &USAGE));
        assert!(has_member(br#"{"usage":null,"x":{"usage" :{}}}"#, &USAGE));
        assert!(!has_member(br#"{"usage":null}"#, &USAGE));
        assert!(!has_member(br#"{"text":"usage"}"#, &USAGE));
        assert!(!has_member(br#"{"text":"\"usage\" is"}"#, &USAGE));
        assert!(has_member(br#"{"usage":"#, &USAGE));
    }

    #[test]
    fn first_valued_errs_towards_a_value() {
        let only_null = |raw: &[u8]| first_valued(raw, &USAGE) == raw.len();
        assert!(only_null(b"data: {\"usage\":null,\"x\":1}\n\n"));
        assert!(only_null(b"data: {\"choices\":[]}\n\n"));
        assert!(!only_null(b"data: {\"usage\": {\"a\":1}}\n\n"));
        assert!(!only_null(b"data: {\"usage\":null,\"usage\":{}}\n\n"));
        // Split over two data lines: joined it reads `"usage":\n{`.
        assert!(!only_null(b"data: {\"usage\":\ndata: {}}\n\n"));
        assert!(!only_null(b"data: {\"usage\"\ndata: :{}}\n\n"));
        // The offset is the first valued one's, across events.
        let run = b"data: {\"usage\":null}\n\ndata: {\"usage\":{}}\n\n";
        assert_eq!(first_valued(run, &USAGE), 29);
    }

    #[test]
    fn last_valued_is_the_last_one_not_null() {
        let last = |raw: &[u8]| last_valued(raw, &USAGE);
        let run = b"data: {\"usage\":{\"a\":1}}\n\ndata: {\"usage\":{\"a\":2}}\n\ndata: {\"usage\":null}\n\n";
        assert_eq!(last(run), 32);
        let none = |raw: &[u8]| last(raw) == raw.len();
        assert!(none(b"data: {\"usage\":null}\n\n"));
        assert!(none(b"data: {\"usage\" : null}\n\n"));
        assert!(none(b"data: {\"choices\":[]}\n\n"));
        // The same rules as first_valued: a line break counts as a value.
        assert_eq!(last(b"data: {\"usage\":\ndata: null}\n\n"), 7);
        // Agrees with first_valued when there is one valued occurrence.
        let one = b"data: {\"usage\":null}\n\ndata: {\"usage\" : {}}\n\ndata: {\"usage\":null}\n\n";
        assert_eq!(last(one), first_valued(one, &USAGE));
        // Far from the end, and at every place around where the search of
        // the tail begins.
        let null = b"data: {\"usage\":null}\n\n";
        for pad in 0..40 {
            let mut raw = vec![b' '; pad];
            raw.extend_from_slice(b"data: {\"usage\":{}}\n\n");
            let at = pad + 7;
            for _ in 0..30 {
                raw.extend_from_slice(null);
            }
            assert_eq!(last(&raw), at);
            assert_eq!(last(&raw), first_valued(&raw, &USAGE));
            // A valued one that starts just before the tail is found too.
            let mut raw = vec![b' '; 600 - pad];
            raw.extend_from_slice(b"{\"usage\":1}");
            raw.extend_from_slice(&vec![b' '; 490]);
            assert_eq!(last(&raw), 600 - pad + 1);
        }
    }
}
