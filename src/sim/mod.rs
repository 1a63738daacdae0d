//! A simulated provider for the demo, the tests and real agents: OpenAI chat
//! (as OpenAI, vLLM, llama.cpp or Ollama serve it), OpenAI Responses (over
//! HTTP and its WebSocket mode), Anthropic Messages, Gemini and Ollama, each
//! in its official wire format, streaming and not, with its counting
//! endpoint, its context-length error in its own words, server-side
//! context management, and a prompt cache.
//!
//! It counts prompt tokens its own way — a vocabulary per API chosen in
//! [`tokens::COUNTING`], hidden per-request, per-message and per-tool
//! framing — so the drift tidemark measures against it is real tokenizer
//! drift, not a scripted number. Every response carries the count in
//! `x-sim-prompt-tokens`, errors included. One file per API holds what the
//! sim knows of it.

use std::borrow::Cow;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::http::{Method, Request};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{json, Value};
use tokio::net::TcpListener;

mod anthropic;
mod cache;
mod fault;
mod gemini;
mod http;
mod ollama;
mod openai_chat;
mod prompt;
mod record;
mod reply;
mod responses;
mod tokens;
mod ws;

pub use crate::config::Flavour;
use crate::config::SimArgs;
pub use crate::provider::Api as SimApi;
pub use cache::{Accounting, CacheEvent, CacheStats};
pub use fault::{Abandoned, X_SIM_FAULT};
pub use tokens::{counting, Counting, CountingMode, SimEncoding, COUNTING};

use self::http::Resp;
use cache::{Outcome, PrefixCache, Style};
use reply::Reply;

/// Response header carrying the sim's own prompt count.
pub const X_SIM_PROMPT_TOKENS: &str = "x-sim-prompt-tokens";

/// Request header `x-sim-omit-usage: 1`: this one response reports no
/// usage, as a provider's sometimes does (the demo's anchor-loss act).
pub const X_SIM_OMIT_USAGE: &str = "x-sim-omit-usage";

/// When the simulated model calls one of the request's tools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ToolCalls {
    /// Whenever the last message is the user's text and tools exist (the
    /// demo's agent plays its tool loop on this).
    #[default]
    Always,
    /// Only when that text asks for a tool by name ("use Bash", "call
    /// read_file"): real agents' one-shot runs end after one text answer.
    WhenAsked,
    /// Text only.
    Never,
}

/// Knobs for tests and fault injection. `Default` is a well-behaved provider.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Prompts above this many tokens get the provider's own refusal (Ollama
    /// truncates instead; `options.num_ctx` overrides it there).
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
    /// Fall silent after this many events, until the client leaves.
    pub stall_after_events: Option<usize>,
    /// Which column of [`COUNTING`] to count with.
    pub counting: CountingMode,
    /// Which server the OpenAI chat path imitates.
    pub flavour: Flavour,
    /// When the model calls tools.
    pub tool_calls: ToolCalls,
    /// The smallest prompt a cache reads or writes (OpenAI and Anthropic
    /// document 1024 tokens for most models).
    pub cache_min_tokens: u64,
    /// Write each request (credentials redacted) to this folder.
    pub record: Option<PathBuf>,
    /// Serve the Responses WebSocket mode; off, the handshake gets 426.
    pub websocket: bool,
}

impl SimConfig {
    /// `tidemark sim`'s flags, checked.
    pub fn from_args(args: &SimArgs) -> Result<SimConfig, String> {
        Ok(SimConfig {
            context_window: args.context_window,
            counting: if args.today_counting {
                CountingMode::Today
            } else {
                CountingMode::Honest
            },
            flavour: args.flavour,
            tool_calls: match args.tools.as_str() {
                "asked" => ToolCalls::WhenAsked,
                "always" => ToolCalls::Always,
                "never" => ToolCalls::Never,
                t => return Err(format!("--tools {t}: asked, always or never")),
            },
            record: args.record.clone(),
            websocket: !args.no_websocket,
            gzip: true,
            ..SimConfig::default()
        })
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            context_window: None,
            omit_usage_every: None,
            fail_status: None,
            first_byte_delay: Duration::ZERO,
            chunk_delay: Duration::ZERO,
            gzip: false,
            abort_after_events: None,
            stall_after_events: None,
            counting: CountingMode::default(),
            flavour: Flavour::OpenAi,
            tool_calls: ToolCalls::Always,
            cache_min_tokens: 1024,
            record: None,
            websocket: true,
        }
    }
}

/// The sim's prompt count split into the head (tools and system) and the whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    pub prefix: u64,
    pub total: u64,
}

/// The prompt tokens the sim charges for a request body, counted as a
/// default sim counts. Deterministic. For Responses the body is taken as the whole
/// conversation (no stored `previous_response_id`); for Gemini, a
/// `generateContent` or `countTokens` body; server-side context management
/// is applied.
pub fn count_prompt(api: SimApi, body: &Value) -> Count {
    count_prompt_with(api, body, CountingMode::default())
}

/// [`count_prompt`] under a chosen column of [`COUNTING`].
pub fn count_prompt_with(api: SimApi, body: &Value, mode: CountingMode) -> Count {
    let c = counting(api, mode);
    let p = match api {
        SimApi::OpenAiChat => openai_chat::count(body, c),
        SimApi::Anthropic => match anthropic::manage(body, c) {
            Some((b, _)) => anthropic::count(&b, c),
            None => anthropic::count(body, c),
        },
        SimApi::OpenAiResponses => {
            let items = match body.get("input") {
                Some(Value::Array(a)) => a.clone(),
                Some(Value::String(s)) => vec![
                    json!({"type":"message","role":"user","content":[{"type":"input_text","text":s}]}),
                ],
                _ => Vec::new(),
            };
            responses::count_items(body, &items, c)
        }
        SimApi::Gemini => gemini::count(body, c),
        SimApi::Ollama => ollama::count(body, c),
    };
    Count {
        prefix: p.head(),
        total: p.total(),
    }
}

/// A running simulator's shared state.
pub(crate) struct Sim {
    cfg: SimConfig,
    requests: AtomicU64,
    cache: Arc<PrefixCache>,
    /// Responses kept for `previous_response_id`.
    stored: Mutex<HashMap<String, responses::Stored>>,
    recorder: Option<record::Recorder>,
    abandoned: Abandoned,
}

impl Sim {
    fn stored(&self, id: &str) -> Option<responses::Stored> {
        self.stored.lock().ok()?.get(id).cloned()
    }
    fn store(&self, id: &str, s: responses::Stored) {
        if let Ok(mut m) = self.stored.lock() {
            if m.len() > 20_000 {
                m.clear();
            }
            m.insert(id.to_string(), s);
        }
    }
}

/// One request being answered.
pub(crate) struct Call<'a> {
    sim: &'a Sim,
    /// The sim's settings with this request's `x-sim-fault` laid over them.
    cfg: Cow<'a, SimConfig>,
    path: &'a str,
    query: Option<&'a str>,
    credential: String,
    gzip: bool,
    /// 1-based number of this completion request.
    n: u64,
    with_usage: bool,
}

impl<'a> Call<'a> {
    /// Completion request number `n` (1-based), no query, not gzipped.
    fn new(sim: &'a Sim, path: &'a str, credential: String, n: u64) -> Self {
        Call {
            sim,
            cfg: Cow::Borrowed(&sim.cfg),
            path,
            query: None,
            credential,
            gzip: false,
            n,
            with_usage: !sim
                .cfg
                .omit_usage_every
                .is_some_and(|k| k > 0 && n % k == 0),
        }
    }
    fn counting(&self, api: SimApi) -> Counting {
        counting(api, self.sim.cfg.counting)
    }
    fn model(&self, body: &Value) -> String {
        body.get("model")
            .and_then(Value::as_str)
            .unwrap_or("sim-model")
            .to_string()
    }
    fn cache(&self, model: &str, p: &prompt::Prompt, style: Style) -> Outcome {
        self.sim.cache.serve(
            &self.credential,
            model,
            p,
            style,
            self.sim.cfg.cache_min_tokens,
        )
    }
    /// Generated tokens, in the API's vocabulary (unscaled).
    fn output_tokens(&self, api: SimApi, r: &Reply) -> u64 {
        let enc = self.counting(api).encoding;
        match r {
            Reply::Text(t) => tokens::tok(enc, t),
            Reply::Tool { name, input, .. } => {
                10 + tokens::tok(enc, name) + tokens::tok(enc, &input.to_string())
            }
        }
    }
}

/// The credential a request carries: a bearer token or an API key header
/// (or Gemini's `key=` query parameter); `""` without one.
fn credential(req: &Request<Incoming>) -> String {
    let h = |n: &str| {
        req.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    if let Some(a) = h("authorization") {
        return a
            .strip_prefix("Bearer ")
            .or_else(|| a.strip_prefix("bearer "))
            .unwrap_or(&a)
            .to_string();
    }
    h("x-api-key")
        .or_else(|| h("x-goog-api-key"))
        .or_else(|| h("api-key"))
        .or_else(|| {
            req.uri().query().and_then(|q| {
                q.split('&')
                    .find_map(|kv| kv.strip_prefix("key=").map(str::to_string))
            })
        })
        .unwrap_or_default()
}

/// A simulated provider, built before it serves so a test can hold its
/// cache accounting.
pub struct Simulator {
    sim: Arc<Sim>,
}

impl Simulator {
    pub fn new(cfg: SimConfig) -> Self {
        let recorder = cfg
            .record
            .as_ref()
            .map(|d| record::Recorder::new(d.clone()));
        Simulator {
            sim: Arc::new(Sim {
                cfg,
                requests: AtomicU64::new(0),
                cache: Arc::new(PrefixCache::default()),
                stored: Mutex::new(HashMap::new()),
                recorder,
                abandoned: Abandoned::default(),
            }),
        }
    }

    /// A read-only handle on the prompt cache's accounting.
    pub fn accounting(&self) -> Accounting {
        Accounting(Arc::clone(&self.sim.cache))
    }

    /// A handle on the count of requests whose client left while the sim
    /// was hanging or stalling them (`x-sim-fault`).
    pub fn abandoned(&self) -> Abandoned {
        self.sim.abandoned.clone()
    }

    /// Serve on `listener` until `shutdown` resolves.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()> + Send) {
        let sim = self.sim;
        // Load the tokenizers before the first request needs them.
        for (api, _, _) in COUNTING {
            counting(api, sim.cfg.counting).encoding.warm();
        }
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
                    .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                    .await;
            });
        }
    }
}

/// Serve the simulated provider on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    cfg: SimConfig,
    shutdown: impl Future<Output = ()> + Send,
) {
    Simulator::new(cfg).serve(listener, shutdown).await
}

/// What a path asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Chat,
    Messages,
    MessagesCount,
    Responses,
    ResponsesInputTokens,
    ResponsesCompact,
    Generate,
    GeminiCount,
    OllamaChat,
}

fn route(method: &Method, path: &str) -> Option<Route> {
    if method != Method::POST {
        return None;
    }
    let r = if path.ends_with("/chat/completions") {
        Route::Chat
    } else if path.ends_with("/messages") {
        Route::Messages
    } else if path.ends_with("/messages/count_tokens") {
        Route::MessagesCount
    } else if path.ends_with("/responses") {
        Route::Responses
    } else if path.ends_with("/responses/input_tokens") {
        Route::ResponsesInputTokens
    } else if path.ends_with("/responses/compact") {
        Route::ResponsesCompact
    } else if path.ends_with(":generateContent") || path.ends_with(":streamGenerateContent") {
        Route::Generate
    } else if path.ends_with(":countTokens") {
        Route::GeminiCount
    } else if path.ends_with("/api/chat") {
        Route::OllamaChat
    } else {
        return None;
    };
    Some(r)
}

/// The models the sim lists.
const MODELS: &[&str] = &[
    "gpt-4o",
    "gpt-5",
    "gpt-5-codex",
    "claude-sonnet-4-5",
    "claude-haiku-4-5",
    "gemini-2.5-flash",
    "gemini-2.5-pro",
    "llama3.2",
];

/// Answers that are not model calls: model lists, Ollama's side endpoints,
/// and 404s in the shape of the API the path belongs to.
fn side(sim: &Sim, req: &Request<Incoming>) -> Resp {
    let path = req.uri().path();
    let get = req.method() == Method::GET || req.method() == Method::HEAD;
    let anthropic =
        req.headers().contains_key("anthropic-version") || req.headers().contains_key("x-api-key");
    if get && path.contains("/models") && (path.starts_with("/v1beta") || path.contains(":")) {
        return http::json(200, &gemini::models(path, MODELS));
    }
    if get && path.ends_with("/models") {
        return if anthropic {
            http::json(200, &anthropic::models(MODELS))
        } else {
            http::json(200, &openai_chat::models(MODELS))
        };
    }
    if get && path.contains("/models/") && !anthropic {
        let id = path.rsplit('/').next().unwrap_or("");
        return http::json(
            200,
            &json!({"id":id,"object":"model","created":1_715_367_049u64,"owned_by":"system"}),
        );
    }
    match (get, path) {
        (true, "/") => {
            return http::text(
                ::http::StatusCode::OK,
                "text/plain; charset=utf-8",
                "Ollama is running",
            )
        }
        (true, "/api/tags") => return http::json(200, &ollama::tags(MODELS)),
        (true, "/api/version") => return http::json(200, &json!({"version":"0.12.6"})),
        (false, "/api/show") => return http::json(200, &ollama::show(sim.cfg.context_window)),
        _ => {}
    }
    let body = if path.starts_with("/api/") {
        json!({"error": "404 page not found"})
    } else if path.starts_with("/v1beta") || path.contains(':') {
        gemini::error(404)
    } else if anthropic || path.contains("/messages") {
        anthropic::error_body("not_found_error", "Not found", 0)
    } else {
        json!({"error":{"message":format!("Invalid URL ({} {path})", req.method()),"type":"invalid_request_error","param":null,"code":null}})
    };
    http::json(404, &body)
}

/// The body's not JSON: each API's own 400.
fn bad_json(r: Route) -> Value {
    let msg = "We could not parse the JSON body of your request.";
    match r {
        Route::Messages | Route::MessagesCount => {
            anthropic::error_body("invalid_request_error", msg, 0)
        }
        Route::Generate | Route::GeminiCount => gemini::error(400),
        Route::OllamaChat => json!({"error": "invalid character in request body"}),
        _ => {
            json!({"error":{"message":msg,"type":"invalid_request_error","param":null,"code":null}})
        }
    }
}

async fn handle(sim: Arc<Sim>, req: Request<Incoming>) -> Resp {
    let fault = req
        .headers()
        .get(X_SIM_FAULT)
        .and_then(|v| v.to_str().ok())
        .map(fault::Fault::parse)
        .unwrap_or_default();
    if fault.hang {
        let _left = sim.abandoned.on_drop();
        std::future::pending::<()>().await;
    }
    if ws::is_upgrade(&req) {
        if !sim.cfg.websocket {
            return ws::refuse();
        }
        let cred = credential(&req);
        return ws::upgrade(sim, req, cred);
    }
    let path = req.uri().path().to_string();
    let query = req.uri().query().map(str::to_string);
    let Some(r) = route(req.method(), &path) else {
        if let Some(rec) = &sim.recorder {
            rec.request(req.method(), req.uri(), req.headers(), b"");
        }
        return side(&sim, &req);
    };
    let gzip = sim.cfg.gzip
        && req
            .headers()
            .get(::http::header::ACCEPT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("gzip"));
    let cred = credential(&req);
    let (parts, body) = req.into_parts();
    let bytes = match body.collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => return http::full(::http::StatusCode::BAD_REQUEST, "{}"),
    };
    let bytes = match decode(&parts.headers, bytes) {
        Ok(b) => b,
        Err(_) => return http::json(400, &bad_json(r)),
    };
    if let Some(rec) = &sim.recorder {
        rec.request(&parts.method, &parts.uri, &parts.headers, &bytes);
    }
    let Ok(body) = serde_json::from_slice::<Value>(&bytes) else {
        return http::json(400, &bad_json(r));
    };
    let counting_only = matches!(
        r,
        Route::MessagesCount
            | Route::ResponsesInputTokens
            | Route::ResponsesCompact
            | Route::GeminiCount
    );
    let n = if counting_only {
        sim.requests.load(Ordering::Relaxed)
    } else {
        let n = sim.requests.fetch_add(1, Ordering::Relaxed) + 1;
        if !sim.cfg.first_byte_delay.is_zero() {
            tokio::time::sleep(sim.cfg.first_byte_delay).await;
        }
        n
    };
    let mut call = Call {
        query: query.as_deref(),
        gzip,
        ..Call::new(&sim, &path, cred, n)
    };
    if fault.shapes_stream() {
        call.cfg = Cow::Owned(fault.over(&sim.cfg));
    }
    if parts
        .headers
        .get(X_SIM_OMIT_USAGE)
        .is_some_and(|v| v.as_bytes() == b"1")
    {
        call.with_usage = false;
    }
    let (resp, count) = match r {
        Route::Chat => with(openai_chat::complete(&call, &body)),
        Route::Messages => with(anthropic::complete(&call, &body)),
        Route::MessagesCount => with(anthropic::count_tokens(&call, &body)),
        Route::Responses => responses::complete(&call, &body),
        Route::ResponsesInputTokens => responses::input_tokens(&call, &body),
        Route::ResponsesCompact => responses::compact(&call, &body),
        Route::Generate => with(gemini::complete(&call, &body)),
        Route::GeminiCount => with(gemini::count_tokens(&call, &body)),
        Route::OllamaChat => with(ollama::complete(&call, &body)),
    };
    match count {
        Some(n) => http::with_count(resp, n),
        None => resp,
    }
}

fn with((r, n): (Resp, u64)) -> (Resp, Option<u64>) {
    (r, Some(n))
}

/// Undo a request body's `Content-Encoding` (Codex zstd-compresses its
/// Responses bodies).
fn decode(headers: &::http::HeaderMap, bytes: bytes::Bytes) -> std::io::Result<bytes::Bytes> {
    use std::io::Read;
    let enc = headers
        .get(::http::header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    let mut out = Vec::new();
    match enc.as_str() {
        "" | "identity" => return Ok(bytes),
        "gzip" | "x-gzip" => {
            flate2::read::GzDecoder::new(&bytes[..]).read_to_end(&mut out)?;
        }
        "deflate" => {
            flate2::read::ZlibDecoder::new(&bytes[..]).read_to_end(&mut out)?;
        }
        "zstd" => {
            out = zstd::stream::decode_all(&bytes[..])?;
        }
        "br" => {
            brotli_decompressor::Decompressor::new(&bytes[..], 4096).read_to_end(&mut out)?;
        }
        _ => return Err(std::io::Error::other("unknown content-encoding")),
    }
    Ok(out.into())
}
