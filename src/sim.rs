//! A simulated provider for the demo and tests: OpenAI chat and Anthropic
//! messages, streaming and not, in each API's official wire format.
//!
//! It counts prompt tokens its own way — `cl100k_base` (tidemark estimates
//! with `o200k_base`), hidden per-message and per-request framing, Anthropic's
//! hidden tool-use system prompt and a per-API ratio — so the drift tidemark
//! measures against it is real tokenizer drift, not a scripted number. Every
//! response carries the count in `x-sim-prompt-tokens`, errors included.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_ENCODING, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// Response header carrying the sim's own prompt count.
pub const X_SIM_PROMPT_TOKENS: &str = "x-sim-prompt-tokens";

/// The API a request speaks, by path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimApi {
    OpenAiChat,
    Anthropic,
}

/// Knobs for tests and fault injection. `Default` is a well-behaved provider.
#[derive(Debug, Clone, Default)]
pub struct SimConfig {
    /// Prompts above this many tokens get the provider's own 400.
    pub context_window: Option<u64>,
    /// Every Nth completion request (1-based) reports no usage at all.
    pub omit_usage_every: Option<u64>,
    /// Answer every completion request with this status and the API's error body.
    pub fail_status: Option<u16>,
    /// Delay before the response headers.
    pub first_byte_delay: Duration,
    /// Delay between stream events.
    pub chunk_delay: Duration,
    /// Gzip streams and bodies when the client accepts it (Anthropic does this).
    pub gzip: bool,
    /// Cut the stream (connection reset) after this many events.
    pub abort_after_events: Option<usize>,
}

/// Hidden framing the sim adds, like real providers do.
const OPENAI_PER_REQUEST: u64 = 3;
const OPENAI_PER_MESSAGE: u64 = 4;
const OPENAI_PER_TOOL_CALL: u64 = 7;
const OPENAI_TOOLS_FRAMING: u64 = 12;
const ANTHROPIC_PER_REQUEST: u64 = 9;
const ANTHROPIC_PER_MESSAGE: u64 = 5;
const ANTHROPIC_PER_BLOCK: u64 = 3;
/// Anthropic documents a hidden tool-use system prompt of a few hundred tokens.
const ANTHROPIC_TOOL_SYSTEM_PROMPT: u64 = 346;
/// Anthropic's tokenizer counts more than cl100k on the same text.
const ANTHROPIC_RATIO: f64 = 1.15;

fn bpe() -> &'static tiktoken_rs::CoreBPE {
    static BPE: OnceLock<tiktoken_rs::CoreBPE> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::cl100k_base().expect("cl100k_base is built in"))
}

/// Token counts of text pieces, cached by content hash: a growing history
/// costs only its new messages.
fn tok(s: &str) -> u64 {
    static CACHE: OnceLock<Mutex<HashMap<u64, u64>>> = OnceLock::new();
    if s.len() < 64 {
        return bpe().encode_ordinary(s).len() as u64;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    s.hash(&mut h);
    let k = h.finish();
    let cache = CACHE.get_or_init(|| Mutex::new(HashMap::new()));
    if let Some(n) = cache.lock().ok().and_then(|c| c.get(&k).copied()) {
        return n;
    }
    let n = bpe().encode_ordinary(s).len() as u64;
    if let Ok(mut c) = cache.lock() {
        if c.len() > 100_000 {
            c.clear();
        }
        c.insert(k, n);
    }
    n
}

fn tok_json(v: &Value) -> u64 {
    match v {
        Value::String(s) => tok(s),
        Value::Null => 0,
        other => tok(&other.to_string()),
    }
}

/// The sim's prompt count split into the cacheable prefix (tools and system)
/// and the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    pub prefix: u64,
    pub total: u64,
}

/// The prompt tokens the sim charges for a request body. Deterministic.
pub fn count_prompt(api: SimApi, body: &Value) -> Count {
    match api {
        SimApi::OpenAiChat => count_openai(body),
        SimApi::Anthropic => count_anthropic(body),
    }
}

fn openai_content(c: &Value) -> u64 {
    match c {
        Value::String(s) => tok(s),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p.get("text") {
                Some(t) => tok_json(t),
                None => tok_json(p),
            })
            .sum(),
        Value::Null => 0,
        other => tok_json(other),
    }
}

fn count_openai(body: &Value) -> Count {
    let mut prefix = OPENAI_PER_REQUEST;
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        if !tools.is_empty() {
            prefix += OPENAI_TOOLS_FRAMING + tok(&Value::Array(tools.clone()).to_string());
        }
    }
    let mut total = prefix;
    let mut in_prefix = true;
    for m in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let mut n = OPENAI_PER_MESSAGE + tok(role);
        n += m.get("content").map(openai_content).unwrap_or(0);
        if let Some(name) = m.get("name") {
            n += 1 + tok_json(name);
        }
        for tc in m
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let f = tc.get("function").unwrap_or(&Value::Null);
            n += OPENAI_PER_TOOL_CALL
                + f.get("name").map(tok_json).unwrap_or(0)
                + f.get("arguments").map(tok_json).unwrap_or(0);
        }
        if let Some(id) = m.get("tool_call_id") {
            n += tok_json(id);
        }
        total += n;
        if in_prefix && (role == "system" || role == "developer") {
            prefix += n;
        } else {
            in_prefix = false;
        }
    }
    Count { prefix, total }
}

fn anthropic_blocks(c: &Value) -> u64 {
    match c {
        Value::String(s) => tok(s),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| {
                ANTHROPIC_PER_BLOCK
                    + match b.get("type").and_then(Value::as_str) {
                        Some("text") => b.get("text").map(tok_json).unwrap_or(0),
                        Some("tool_use") => {
                            b.get("name").map(tok_json).unwrap_or(0)
                                + b.get("input").map(tok_json).unwrap_or(0)
                        }
                        Some("tool_result") => b.get("content").map(anthropic_blocks).unwrap_or(0),
                        _ => tok_json(b),
                    }
            })
            .sum(),
        Value::Null => 0,
        other => tok_json(other),
    }
}

fn scale(n: u64) -> u64 {
    (n as f64 * ANTHROPIC_RATIO).ceil() as u64
}

fn count_anthropic(body: &Value) -> Count {
    let mut prefix = ANTHROPIC_PER_REQUEST;
    if let Some(tools) = body.get("tools").and_then(Value::as_array) {
        if !tools.is_empty() {
            prefix += ANTHROPIC_TOOL_SYSTEM_PROMPT + tok(&Value::Array(tools.clone()).to_string());
        }
    }
    if let Some(s) = body.get("system") {
        prefix += anthropic_blocks(s);
    }
    let mut rest = 0;
    for m in body
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        rest += ANTHROPIC_PER_MESSAGE + m.get("content").map(anthropic_blocks).unwrap_or(0);
    }
    let prefix = scale(prefix);
    Count {
        prefix,
        total: prefix + scale(rest),
    }
}

/// Does any block of the Anthropic request carry `cache_control`?
fn anthropic_cached(body: &Value) -> bool {
    let has = |v: Option<&Value>| {
        v.and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|b| b.get("cache_control").is_some()))
    };
    has(body.get("system")) || has(body.get("tools"))
}

/// A running simulator's shared state.
struct Sim {
    cfg: SimConfig,
    requests: AtomicU64,
}

type SimBody = BoxBody<Bytes, std::io::Error>;

/// Serve the simulated provider on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    cfg: SimConfig,
    shutdown: impl Future<Output = ()> + Send,
) {
    let sim = Arc::new(Sim {
        cfg,
        requests: AtomicU64::new(0),
    });
    // Load the tokenizer before the first request needs it.
    let _ = bpe();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let sim = Arc::clone(&sim);
        tokio::spawn(async move {
            let svc = service_fn(move |req: Request<Incoming>| {
                let sim = Arc::clone(&sim);
                async move { Ok::<_, Infallible>(handle(sim, req).await) }
            });
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<SimBody> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn not_found(api: Option<SimApi>) -> Response<SimBody> {
    let body = match api {
        Some(SimApi::Anthropic) => {
            json!({"type":"error","error":{"type":"not_found_error","message":"Not found"}})
        }
        _ => {
            json!({"error":{"message":"Unknown request URL","type":"invalid_request_error","param":null,"code":"unknown_url"}})
        }
    };
    full(StatusCode::NOT_FOUND, body.to_string())
}

async fn handle(sim: Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let path = req.uri().path().to_string();
    let api = if path.ends_with("/chat/completions") {
        Some(SimApi::OpenAiChat)
    } else if path.ends_with("/messages") || path.ends_with("/messages/count_tokens") {
        Some(SimApi::Anthropic)
    } else {
        None
    };
    let Some(api) = api.filter(|_| req.method() == Method::POST) else {
        return not_found(api);
    };
    let gzip_ok = sim.cfg.gzip
        && req
            .headers()
            .get(http::header::ACCEPT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("gzip"));
    let bytes = match req.into_body().collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => return full(StatusCode::BAD_REQUEST, "{}"),
    };
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        let msg = "We could not parse the JSON body of your request.";
        let b = match api {
            SimApi::Anthropic => {
                json!({"type":"error","error":{"type":"invalid_request_error","message":msg}})
            }
            SimApi::OpenAiChat => {
                json!({"error":{"message":msg,"type":"invalid_request_error","param":null,"code":null}})
            }
        };
        return full(StatusCode::BAD_REQUEST, b.to_string());
    };
    let count = count_prompt(api, &body);
    let mut resp = if path.ends_with("/count_tokens") {
        full(
            StatusCode::OK,
            json!({"input_tokens": count.total}).to_string(),
        )
    } else {
        let n = sim.requests.fetch_add(1, Ordering::Relaxed) + 1;
        if !sim.cfg.first_byte_delay.is_zero() {
            tokio::time::sleep(sim.cfg.first_byte_delay).await;
        }
        complete(&sim.cfg, api, &body, count, n, gzip_ok)
    };
    if let Ok(v) = HeaderValue::from_str(&count.total.to_string()) {
        resp.headers_mut().insert(X_SIM_PROMPT_TOKENS, v);
    }
    resp
}

fn error_response(api: SimApi, status: u16) -> Response<SimBody> {
    let st = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = match (api, status) {
        (SimApi::Anthropic, 529) => {
            json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}})
        }
        (SimApi::Anthropic, 429) => {
            json!({"type":"error","error":{"type":"rate_limit_error","message":"Rate limited"}})
        }
        (SimApi::Anthropic, _) => {
            json!({"type":"error","error":{"type":"api_error","message":"Internal server error"}})
        }
        (SimApi::OpenAiChat, 429) => {
            json!({"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}})
        }
        (SimApi::OpenAiChat, _) => {
            json!({"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}})
        }
    };
    full(st, body.to_string())
}

/// The provider's own context-length 400.
fn over_window(api: SimApi, prompt: u64, window: u64) -> Response<SimBody> {
    let body = match api {
        SimApi::OpenAiChat => json!({"error":{
            "message": format!("This model's maximum context length is {window} tokens. However, your messages resulted in {prompt} tokens. Please reduce the length of the messages."),
            "type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}),
        SimApi::Anthropic => json!({"type":"error","error":{"type":"invalid_request_error",
            "message": format!("prompt is too long: {prompt} tokens > {window} maximum")}}),
    };
    full(StatusCode::BAD_REQUEST, body.to_string())
}

/// Small deterministic generator (splitmix64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[(self.next() % xs.len() as u64) as usize]
    }
}

const REPLY_WORDS: &[&str] = &[
    "the", "change", "looks", "right", "but", "the", "test", "still", "misses", "one", "edge",
    "case", "so", "I", "will", "check", "the", "parser", "next", "and", "then", "update", "docs",
    "okay", "that", "explains", "the", "failure", "—", "the", "buffer", "was", "not", "flushed",
];

/// What the simulated model says: text, or a call to one of the request's tools.
enum Reply {
    Text(String),
    Tool {
        id: String,
        name: String,
        input: Value,
    },
}

fn tool_schema_arg(api: SimApi, tool: &Value) -> (String, Option<String>) {
    let (name, schema) = match api {
        SimApi::OpenAiChat => {
            let f = tool.get("function").unwrap_or(&Value::Null);
            (f.get("name"), f.get("parameters"))
        }
        SimApi::Anthropic => (tool.get("name"), tool.get("input_schema")),
    };
    let arg = schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object)
        .and_then(|p| p.keys().next().cloned());
    (
        name.and_then(Value::as_str).unwrap_or("tool").to_string(),
        arg,
    )
}

/// Call a tool when the last message is the user's own text and tools exist;
/// otherwise answer in text.
fn decide(api: SimApi, body: &Value, seed: u64) -> Reply {
    let mut rng = Rng(seed);
    let msgs = body.get("messages").and_then(Value::as_array);
    let last = msgs.and_then(|m| m.last());
    let user_text = last.is_some_and(|m| {
        m.get("role").and_then(Value::as_str) == Some("user")
            && match m.get("content") {
                Some(Value::String(_)) => true,
                Some(Value::Array(b)) => !b
                    .iter()
                    .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result")),
                _ => false,
            }
    });
    let tools = body
        .get("tools")
        .and_then(Value::as_array)
        .filter(|t| !t.is_empty());
    if let (true, Some(tools)) = (user_text, tools) {
        let t = &tools[(rng.next() % tools.len() as u64) as usize];
        let (name, arg) = tool_schema_arg(api, t);
        let val = format!("{}-{}", rng.pick(REPLY_WORDS), rng.next() % 1000);
        let input = match arg {
            Some(a) => json!({ a: val }),
            None => json!({}),
        };
        let id = match api {
            SimApi::OpenAiChat => format!("call_{:016x}", rng.next()),
            SimApi::Anthropic => format!("toolu_{:016x}", rng.next()),
        };
        return Reply::Tool { id, name, input };
    }
    let n = 12 + (rng.next() % 24) as usize;
    let mut s = String::new();
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(rng.pick(REPLY_WORDS));
    }
    s.push('.');
    Reply::Text(s)
}

fn complete(
    cfg: &SimConfig,
    api: SimApi,
    body: &Value,
    count: Count,
    n: u64,
    gzip: bool,
) -> Response<SimBody> {
    if let Some(st) = cfg.fail_status {
        return error_response(api, st);
    }
    if let Some(w) = cfg.context_window {
        if count.total > w {
            return over_window(api, count.total, w);
        }
    }
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("sim-model")
        .to_string();
    let stream = body.get("stream").and_then(Value::as_bool) == Some(true);
    let with_usage = !cfg.omit_usage_every.is_some_and(|k| k > 0 && n % k == 0);
    // The reply depends on the prompt only, so a session replays the same
    // way whatever else the simulator served before it.
    let reply = decide(api, body, count.total.wrapping_mul(0x2545_F491_4F6C_DD1D));
    let output = match &reply {
        Reply::Text(t) => tok(t),
        Reply::Tool { name, input, .. } => 10 + tok(name) + tok(&input.to_string()),
    };
    let events = match (api, stream) {
        (SimApi::OpenAiChat, true) => {
            let include = body
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                == Some(true);
            openai_stream(&model, n, &reply, count, output, include && with_usage)
        }
        (SimApi::OpenAiChat, false) => {
            vec![openai_body(&model, n, &reply, count, output, with_usage)]
        }
        (SimApi::Anthropic, true) => anthropic_stream(
            &model,
            n,
            &reply,
            anthropic_usage(body, count),
            output,
            with_usage,
        ),
        (SimApi::Anthropic, false) => vec![anthropic_body(
            &model,
            n,
            &reply,
            anthropic_usage(body, count),
            output,
            with_usage,
        )],
    };
    let ct = if stream {
        "text/event-stream; charset=utf-8"
    } else {
        "application/json"
    };
    stream_response(cfg, events, ct, gzip)
}

/// Anthropic's split: cache reads (tools + system, when marked) and the uncached rest.
fn anthropic_usage(body: &Value, c: Count) -> (u64, u64) {
    if anthropic_cached(body) && c.prefix >= 1024 {
        (c.total - c.prefix, c.prefix)
    } else {
        (c.total, 0)
    }
}

fn openai_cached(c: Count) -> u64 {
    if c.prefix >= 1024 {
        c.prefix / 128 * 128
    } else {
        0
    }
}

fn openai_usage(c: Count, output: u64) -> Value {
    json!({"prompt_tokens":c.total,"completion_tokens":output,"total_tokens":c.total+output,
        "prompt_tokens_details":{"cached_tokens":openai_cached(c),"audio_tokens":0},
        "completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}})
}

fn pieces(text: &str) -> Vec<String> {
    // Split into word-ish chunks the way a model streams.
    let mut out = Vec::new();
    let mut cur = String::new();
    for ch in text.chars() {
        if ch == ' ' && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(ch);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn openai_stream(
    model: &str,
    n: u64,
    reply: &Reply,
    c: Count,
    output: u64,
    include_usage: bool,
) -> Vec<String> {
    let id = format!("chatcmpl-sim{n:08}");
    // OpenAI pads every chunk with a random `obfuscation` string (length hiding).
    let mut pad = Rng(n);
    let mut obfuscation = move || {
        let len = 3 + (pad.next() % 8) as usize;
        (0..len)
            .map(|_| {
                char::from(
                    b"abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"
                        [(pad.next() % 57) as usize],
                )
            })
            .collect::<String>()
    };
    let mut chunk = |choices: Value| {
        let mut v = json!({"id":id,"object":"chat.completion.chunk","created":1_755_012_345u64 + n,
            "model":model,"service_tier":"default","system_fingerprint":"fp_sim0001","choices":choices});
        if include_usage {
            v["usage"] = Value::Null;
        }
        v["obfuscation"] = Value::String(obfuscation());
        format!("data: {v}\n\n")
    };
    let mut ev = Vec::new();
    let finish = match reply {
        Reply::Text(t) => {
            ev.push(chunk(json!([{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}])));
            for p in pieces(t) {
                ev.push(chunk(
                    json!([{"index":0,"delta":{"content":p},"logprobs":null,"finish_reason":null}]),
                ));
            }
            "stop"
        }
        Reply::Tool {
            id: cid,
            name,
            input,
        } => {
            ev.push(chunk(json!([{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":cid,"type":"function","function":{"name":name,"arguments":""}}],"refusal":null},"logprobs":null,"finish_reason":null}])));
            let args = input.to_string();
            let chars: Vec<char> = args.chars().collect();
            for part in chars.chunks(8) {
                let s: String = part.iter().collect();
                ev.push(chunk(json!([{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":s}}]},"logprobs":null,"finish_reason":null}])));
            }
            "tool_calls"
        }
    };
    ev.push(chunk(
        json!([{"index":0,"delta":{},"logprobs":null,"finish_reason":finish}]),
    ));
    if include_usage {
        let v = json!({"id":id,"object":"chat.completion.chunk","created":1_755_012_345u64 + n,
            "model":model,"service_tier":"default","system_fingerprint":"fp_sim0001","choices":[],
            "usage":openai_usage(c, output),"obfuscation":obfuscation()});
        ev.push(format!("data: {v}\n\n"));
    }
    ev.push("data: [DONE]\n\n".to_string());
    ev
}

fn openai_body(
    model: &str,
    n: u64,
    reply: &Reply,
    c: Count,
    output: u64,
    with_usage: bool,
) -> String {
    let (message, finish) = match reply {
        Reply::Text(t) => (
            json!({"role":"assistant","content":t,"refusal":null,"annotations":[]}),
            "stop",
        ),
        Reply::Tool { id, name, input } => (
            json!({"role":"assistant","content":null,"tool_calls":[{"id":id,"type":"function","function":{"name":name,"arguments":input.to_string()}}],"refusal":null,"annotations":[]}),
            "tool_calls",
        ),
    };
    let mut v = json!({"id":format!("chatcmpl-sim{n:08}"),"object":"chat.completion","created":1_755_012_345u64 + n,
        "model":model,"choices":[{"index":0,"message":message,"logprobs":null,"finish_reason":finish}],
        "service_tier":"default","system_fingerprint":"fp_sim0001"});
    if with_usage {
        v["usage"] = openai_usage(c, output);
    }
    v.to_string()
}

fn anthropic_usage_json(input: u64, cache_read: u64, output: u64) -> Value {
    json!({"input_tokens":input,"cache_creation_input_tokens":0,"cache_read_input_tokens":cache_read,
        "cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":0},
        "output_tokens":output,"service_tier":"standard"})
}

fn anthropic_stream(
    model: &str,
    n: u64,
    reply: &Reply,
    (input, cache_read): (u64, u64),
    output: u64,
    with_usage: bool,
) -> Vec<String> {
    let ev = |name: &str, data: Value| format!("event: {name}\ndata: {data}\n\n");
    let mut msg = json!({"model":model,"id":format!("msg_sim{n:016}"),"type":"message","role":"assistant",
        "content":[],"stop_reason":null,"stop_sequence":null});
    if with_usage {
        msg["usage"] = anthropic_usage_json(input, cache_read, 1);
    }
    let mut out = vec![ev(
        "message_start",
        json!({"type":"message_start","message":msg}),
    )];
    let stop = match reply {
        Reply::Text(t) => {
            out.push(ev("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}})));
            out.push("event: ping\ndata: {\"type\": \"ping\"}\n\n".to_string());
            for p in pieces(t) {
                out.push(ev("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":p}})));
            }
            out.push(ev(
                "content_block_stop",
                json!({"type":"content_block_stop","index":0}),
            ));
            "end_turn"
        }
        Reply::Tool { id, name, input } => {
            out.push(ev("content_block_start", json!({"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":id,"name":name,"input":{}}})));
            out.push("event: ping\ndata: {\"type\": \"ping\"}\n\n".to_string());
            out.push(ev("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":""}})));
            let args = input.to_string();
            let chars: Vec<char> = args.chars().collect();
            for part in chars.chunks(8) {
                let s: String = part.iter().collect();
                out.push(ev("content_block_delta", json!({"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":s}})));
            }
            out.push(ev(
                "content_block_stop",
                json!({"type":"content_block_stop","index":0}),
            ));
            "tool_use"
        }
    };
    let mut delta =
        json!({"type":"message_delta","delta":{"stop_reason":stop,"stop_sequence":null}});
    if with_usage {
        delta["usage"] = json!({ "output_tokens": output });
    }
    out.push(ev("message_delta", delta));
    out.push(ev("message_stop", json!({"type":"message_stop"})));
    out
}

fn anthropic_body(
    model: &str,
    n: u64,
    reply: &Reply,
    (input, cache_read): (u64, u64),
    output: u64,
    with_usage: bool,
) -> String {
    let (content, stop) = match reply {
        Reply::Text(t) => (json!([{"type":"text","text":t}]), "end_turn"),
        Reply::Tool { id, name, input } => (
            json!([{"type":"tool_use","id":id,"name":name,"input":input}]),
            "tool_use",
        ),
    };
    let mut v = json!({"model":model,"id":format!("msg_sim{n:016}"),"type":"message","role":"assistant",
        "content":content,"stop_reason":stop,"stop_sequence":null});
    if with_usage {
        v["usage"] = anthropic_usage_json(input, cache_read, output);
    }
    v.to_string()
}

/// Send `events` as separate body frames, paced, optionally gzipped (each
/// event flushed so the stream stays a stream), optionally cut short.
fn stream_response(
    cfg: &SimConfig,
    events: Vec<String>,
    content_type: &'static str,
    gzip: bool,
) -> Response<SimBody> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    let delay = cfg.chunk_delay;
    let abort = cfg.abort_after_events;
    tokio::spawn(async move {
        let mut gz =
            gzip.then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        for (i, e) in events.iter().enumerate() {
            if abort.is_some_and(|a| i >= a) {
                let _ = tx
                    .send(Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        "sim: stream aborted",
                    )))
                    .await;
                return;
            }
            if i > 0 && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let chunk = match gz.as_mut() {
                Some(enc) => {
                    if enc.write_all(e.as_bytes()).is_err() || enc.flush().is_err() {
                        return;
                    }
                    Bytes::from(std::mem::take(enc.get_mut()))
                }
                None => Bytes::from(e.clone()),
            };
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
        if let Some(enc) = gz {
            if let Ok(rest) = enc.finish() {
                let _ = tx.send(Ok(Bytes::from(rest))).await;
            }
        }
    });
    let s = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|r| (r.map(Frame::data), rx))
    });
    let mut r = Response::new(StreamBody::new(s).boxed());
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    if gzip {
        r.headers_mut()
            .insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    r
}
