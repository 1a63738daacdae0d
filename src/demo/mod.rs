//! `tidemark demo`: the embedded simulated provider ([`crate::sim`]), the real
//! proxy in front of it on loopback, and a scripted agent that drives one
//! growing session over each API and prints what tidemark saw.
//!
//! The agent behaves like an ordinary one: it streams, never asks for usage,
//! and learns the provider's true count only from the simulator's
//! `x-sim-prompt-tokens` header. With `TIDEMARK_DEMO_DUMP=DIR` every request
//! body the agent sends is also written to `DIR/<api>-<turn>.json`, so a test
//! can recount them independently.

use std::fmt::Write as _;
use std::io::{IsTerminal, Read};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::config::Flags;
use crate::estimate::Estimator;
use crate::json::RequestView;
use crate::provider::Api;
use crate::sim::{self, SimConfig, X_SIM_PROMPT_TOKENS};

mod story;

/// The APIs the demo's scripted agent speaks (the simulator speaks more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DemoApi {
    OpenAiChat,
    Anthropic,
}

/// The demo's models get a small window so a session fills it in a couple
/// of dozen turns (the simulator enforces the same window).
pub const DEMO_WINDOW: u64 = 32_000;
pub const OPENAI_MODEL: &str = "gpt-4o";
pub const ANTHROPIC_MODEL: &str = "claude-sonnet-4-5";

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One request of a session as the agent saw it.
#[derive(Debug, Clone)]
pub struct Row {
    pub turn: u32,
    pub status: u16,
    /// The provider's own count (`x-sim-prompt-tokens`); `None` when the
    /// request never reached it.
    pub real: Option<u64>,
    pub chars4: u64,
    pub estimate: u64,
    pub projection: Option<u64>,
    pub src: Option<String>,
    pub decision: &'static str,
}

/// A finished session: its rows and how it ended.
pub struct SessionRun {
    pub api: DemoApi,
    pub model: &'static str,
    pub key: String,
    pub window: u64,
    pub rows: Vec<Row>,
    /// Why the session stopped before its last turn, if it did.
    pub ended: Option<String>,
}

/// The running simulator and proxy.
struct Stack {
    proxy: SocketAddr,
    admin: SocketAddr,
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    warn_at: f64,
    limit_at: f64,
    /// `--admin-token` is set: the page asks for it.
    admin_token: bool,
}

impl Stack {
    async fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(3), t).await;
        }
    }
}

/// Was a flag given on the command line or through its environment variable?
fn flag_given(flag: &str, env: &str) -> bool {
    std::env::var_os(env).is_some()
        || std::env::args().any(|a| a == flag || a.starts_with(&format!("{flag}=")))
}

async fn start(flags: Flags, sim_cfg: SimConfig) -> Result<Stack, String> {
    let any = SocketAddr::from(([127, 0, 0, 1], 0));
    let sim_listener = TcpListener::bind(any)
        .await
        .map_err(|e| format!("binding the simulated provider: {e}"))?;
    let sim_addr = sim_listener
        .local_addr()
        .map_err(|e| format!("simulated provider address: {e}"))?;
    let sim_url = format!("http://{sim_addr}");

    let listen = if flag_given("--listen", "TIDEMARK_LISTEN") {
        flags.listen
    } else {
        any
    };
    let admin_listen = if flag_given("--admin-listen", "TIDEMARK_ADMIN_LISTEN") {
        flags.admin_listen
    } else {
        any
    };
    let mut f = flags;
    f.upstream = sim_url.clone();
    f.routes = vec![format!("/v1/messages={sim_url}")];
    f.upstream_ca = None;
    if f.context_windows.is_empty() {
        f.context_windows = vec![
            format!("{OPENAI_MODEL}*={DEMO_WINDOW}"),
            format!("{ANTHROPIC_MODEL}*={DEMO_WINDOW}"),
        ];
    }
    let config = f.resolve()?;
    let listener = TcpListener::bind(listen)
        .await
        .map_err(|e| format!("binding --listen {listen}: {e}"))?;
    let admin = TcpListener::bind(admin_listen)
        .await
        .map_err(|e| format!("binding --admin-listen {admin_listen}: {e}"))?;
    let proxy = listener
        .local_addr()
        .map_err(|e| format!("proxy address: {e}"))?;
    let admin_addr = admin
        .local_addr()
        .map_err(|e| format!("admin address: {e}"))?;
    let (warn_at, limit_at) = (config.warn_at, config.limit_at);
    let admin_token = config.admin_token.is_some();

    let (sim_stop, sim_rx) = oneshot::channel::<()>();
    let sim_task = tokio::spawn(sim::serve(sim_listener, sim_cfg, async move {
        let _ = sim_rx.await;
    }));
    let (proxy_stop, proxy_rx) = oneshot::channel::<()>();
    let proxy_task = tokio::spawn(async move {
        if let Err(e) = crate::run(listener, admin, config, async move {
            let _ = proxy_rx.await;
        })
        .await
        {
            tracing::error!(error = %e, "demo proxy stopped");
        }
    });
    Ok(Stack {
        proxy,
        admin: admin_addr,
        stops: vec![proxy_stop, sim_stop],
        tasks: vec![proxy_task, sim_task],
        warn_at,
        limit_at,
        admin_token,
    })
}

// ---------------------------------------------------------------------------
// Deterministic content: prose, CJK, minified JSON, code, base64, emoji.

/// splitmix64: small, seeded, the same on every machine.
#[derive(Clone)]
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len() as u64) as usize]
    }
}

const WORDS: &[&str] = &[
    "the",
    "agent",
    "reads",
    "a",
    "file",
    "and",
    "then",
    "calls",
    "tool",
    "with",
    "context",
    "window",
    "budget",
    "stream",
    "parser",
    "handles",
    "every",
    "edge",
    "case",
    "before",
    "after",
    "request",
    "response",
    "cache",
    "token",
    "count",
    "session",
    "limit",
    "retry",
    "failure",
    "build",
    "test",
    "module",
    "function",
    "returns",
    "error",
    "value",
    "config",
    "should",
    "never",
    "always",
    "update",
    "check",
    "refactor",
    "deploy",
    "latency",
    "throughput",
    "user",
    "provider",
    "header",
    "compaction",
    "history",
    "summary",
    "message",
    "branch",
    "commit",
];
const CJK: &[&str] = &[
    "上下文窗口的大小决定了模型一次能看到多少内容。",
    "请在提交之前运行所有测试，并确认没有新的警告。",
    "这个函数在解析失败时会返回错误，而不是直接崩溃。",
    "代理服务器必须逐字节转发响应，不能缓冲整个流。",
    "令牌计数在不同的分词器之间差异很大，尤其是中文。",
    "会话的锚点来自上一次响应中提供商报告的真实用量。",
    "設定ファイルを読み込んでから、サーバーを起動します。",
    "このテストは、ストリームの途中で接続が切れた場合を確認します。",
    "コンテキストが上限に近づいたら、古いターンを要約してください。",
    "日本語のテキストは、英語よりも多くのトークンを消費します。",
    "요청 본문이 너무 크면 프록시는 413을 반환합니다。",
    "토큰 추정치는 실제 값과 크게 다를 수 있습니다。",
];
const EMOJI: &[&str] = &[
    "🚀", "✅", "🔥", "🙂", "🤔", "📦", "🐛", "🎉", "⚠️", "💡", "👍", "🧪", "🦀", "📈", "🙏",
];

fn prose(rng: &mut Rng, words: usize, emoji: bool) -> String {
    let mut s = String::new();
    let mut sentence = 0;
    for i in 0..words {
        let w = rng.pick(WORDS);
        if sentence == 0 {
            let mut c = w.chars();
            if let Some(f) = c.next() {
                s.extend(f.to_uppercase());
                s.push_str(c.as_str());
            }
        } else {
            s.push_str(w);
        }
        sentence += 1;
        if sentence > 6 && rng.below(5) == 0 || i + 1 == words {
            s.push('.');
            if emoji && rng.below(3) == 0 {
                s.push(' ');
                s.push_str(rng.pick(EMOJI));
            }
            sentence = 0;
        }
        s.push(' ');
    }
    s.trim_end().to_string()
}

fn cjk(rng: &mut Rng, sentences: usize) -> String {
    (0..sentences).map(|_| rng.pick(CJK)).collect()
}

fn json_records(rng: &mut Rng, n: usize) -> String {
    let items: Vec<Value> = (0..n)
        .map(|i| {
            json!({
                "id": format!("{:08x}-{:04x}", rng.next() as u32, rng.below(0xffff)),
                "seq": i,
                "name": format!("{}_{}", rng.pick(WORDS), rng.pick(WORDS)),
                "ok": rng.below(2) == 0,
                "latency_ms": rng.below(5000) as f64 / 10.0,
                "tags": [rng.pick(WORDS), rng.pick(WORDS)],
                "owner": {"team": rng.pick(WORDS), "region": format!("eu-{}", rng.below(4))},
            })
        })
        .collect();
    json!({"status":"ok","page":rng.below(40),"items":items}).to_string()
}

fn code(rng: &mut Rng, functions: usize) -> String {
    let mut s = String::from("use std::collections::HashMap;\n\n");
    for _ in 0..functions {
        let name = format!("{}_{}", rng.pick(WORDS), rng.pick(WORDS));
        let arg = rng.pick(WORDS);
        let _ = write!(
            s,
            "/// {}\npub fn {name}({arg}: &[u8], limit: usize) -> Result<Vec<u32>, Error> {{\n    let mut out = Vec::with_capacity(limit);\n    for (i, b) in {arg}.iter().enumerate() {{\n        if i >= limit {{\n            return Err(Error::Limit {{ at: i, max: {} }});\n        }}\n        out.push(u32::from(*b).wrapping_mul({}) ^ 0x{:04x});\n    }}\n    Ok(out)\n}}\n\n",
            prose(rng, 8, false),
            rng.below(4096),
            rng.below(97) + 3,
            rng.below(0xffff)
        );
    }
    s
}

fn base64_blob(rng: &mut Rng, bytes: usize) -> String {
    use base64::Engine;
    let raw: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
    base64::engine::general_purpose::STANDARD.encode(raw)
}

fn system_prompt() -> String {
    let mut rng = Rng::new(7);
    let mut s = String::from(
        "You are a careful software engineering agent working in a large repository. \
         Follow the rules below exactly.\n\n",
    );
    for i in 1..=90 {
        let _ = writeln!(s, "{i}. {}", prose(&mut rng, 45, false));
    }
    s.push_str("\nTeam glossary (用語集 / 术语表):\n");
    for _ in 0..12 {
        let _ = writeln!(s, "- {} {}", cjk(&mut rng, 3), rng.pick(EMOJI));
    }
    s.push_str("\nExample of the expected code style:\n\n");
    s.push_str(&code(&mut rng, 3));
    s
}

struct ToolDef {
    name: &'static str,
    arg: &'static str,
    description: &'static str,
}

const TOOLS: &[ToolDef] = &[
    ToolDef { name: "read_file", arg: "path", description: "Read a source file from the repository and return its full contents. Use this before editing any file." },
    ToolDef { name: "search_docs", arg: "query", description: "Search the team's design documents (written in Chinese, Japanese and English) and return the matching sections." },
    ToolDef { name: "http_get", arg: "url", description: "Fetch a JSON API endpoint of the staging environment and return the raw response body." },
    ToolDef { name: "fetch_attachment", arg: "id", description: "Download a binary attachment from the ticket tracker and return it base64-encoded." },
];

/// What a tool returns: each kind of content the estimators disagree on.
fn run_tool(name: &str, rng: &mut Rng) -> String {
    let k = rng.below(1000) as usize;
    match name {
        "read_file" => code(rng, 15 + k % 8),
        "search_docs" => {
            let a = cjk(rng, 4 + k % 4);
            let b = prose(rng, 420, false);
            format!("{a}\n\n{b}\n\n{}", cjk(rng, 3))
        }
        "http_get" => json_records(rng, 26 + k % 12),
        "fetch_attachment" => {
            let data = base64_blob(rng, 2800 + k);
            json!({"id": format!("att_{k:04}"), "mime": "image/png", "name": format!("{}.png", rng.pick(WORDS)),
                "size": 2800 + k, "data": data}).to_string()
        }
        _ => prose(rng, 200, false),
    }
}

fn user_message(rng: &mut Rng) -> String {
    let k = rng.below(1000) as usize;
    let mut s = prose(rng, 140 + k % 120, true);
    if k % 2 == 0 {
        s.push_str("\n\n");
        s.push_str(&cjk(rng, 1 + k % 3));
    }
    s.push(' ');
    s.push_str(rng.pick(EMOJI));
    s
}

// ---------------------------------------------------------------------------
// The agent.

/// A parsed model reply.
enum Reply {
    Text(String),
    Tool {
        id: String,
        name: String,
        input: String,
    },
}

/// A scripted agent: it keeps a growing history in its API's shape.
#[derive(Clone)]
pub struct Agent {
    api: DemoApi,
    model: &'static str,
    system: String,
    messages: Vec<Value>,
    rng: Rng,
}

impl Agent {
    pub fn new(api: DemoApi, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let first = user_message(&mut rng);
        let mut a = Agent {
            api,
            model: match api {
                DemoApi::OpenAiChat => OPENAI_MODEL,
                DemoApi::Anthropic => ANTHROPIC_MODEL,
            },
            system: system_prompt(),
            messages: Vec::new(),
            rng,
        };
        a.push_user(first);
        a
    }

    fn push_user(&mut self, text: String) {
        self.messages.push(json!({"role":"user","content":text}));
    }

    /// The request body, in the API's official shape.
    pub fn body(&self) -> Value {
        match self.api {
            DemoApi::OpenAiChat => {
                let tools: Vec<Value> = TOOLS
                    .iter()
                    .map(|t| json!({"type":"function","function":{"name":t.name,"description":t.description,
                        "parameters":{"type":"object","properties":{t.arg:{"type":"string","description":format!("The {} to use.", t.arg)}},"required":[t.arg],"additionalProperties":false}}}))
                    .collect();
                let mut msgs = vec![json!({"role":"system","content":self.system})];
                msgs.extend(self.messages.iter().cloned());
                json!({"model":self.model,"messages":msgs,"tools":tools,"stream":true,"temperature":0.2})
            }
            DemoApi::Anthropic => {
                let tools: Vec<Value> = TOOLS
                    .iter()
                    .map(|t| json!({"name":t.name,"description":t.description,
                        "input_schema":{"type":"object","properties":{t.arg:{"type":"string","description":format!("The {} to use.", t.arg)}},"required":[t.arg]}}))
                    .collect();
                json!({"model":self.model,"max_tokens":4096,"system":[{"type":"text","text":self.system,"cache_control":{"type":"ephemeral"}}],
                    "tools":tools,"messages":self.messages,"stream":true})
            }
        }
    }

    /// Record the model's reply and act on it: run the tool it asked for, or
    /// write the next user message.
    fn advance(&mut self, reply: Reply) {
        match (self.api, reply) {
            (DemoApi::OpenAiChat, Reply::Text(t)) => {
                self.messages.push(json!({"role":"assistant","content":t}));
                let u = user_message(&mut self.rng);
                self.push_user(u);
            }
            (DemoApi::OpenAiChat, Reply::Tool { id, name, input }) => {
                self.messages.push(json!({"role":"assistant","content":null,
                    "tool_calls":[{"id":id,"type":"function","function":{"name":name,"arguments":input}}]}));
                let out = run_tool(&name, &mut self.rng);
                self.messages
                    .push(json!({"role":"tool","tool_call_id":id,"content":out}));
            }
            (DemoApi::Anthropic, Reply::Text(t)) => {
                self.messages
                    .push(json!({"role":"assistant","content":[{"type":"text","text":t}]}));
                let u = user_message(&mut self.rng);
                self.push_user(u);
            }
            (DemoApi::Anthropic, Reply::Tool { id, name, input }) => {
                let input: Value = serde_json::from_str(&input).unwrap_or_else(|_| json!({}));
                self.messages.push(json!({"role":"assistant","content":[{"type":"tool_use","id":id,"name":name,"input":input}]}));
                let out = run_tool(&name, &mut self.rng);
                self.messages.push(json!({"role":"user","content":[{"type":"tool_result","tool_use_id":id,"content":out}]}));
            }
        }
    }
}

/// Reassemble the reply from an SSE body in either API's format.
fn parse_stream(api: DemoApi, body: &str) -> Option<Reply> {
    let mut text = String::new();
    let (mut id, mut name, mut args) = (String::new(), String::new(), String::new());
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data:") else {
            continue;
        };
        let data = data.trim_start();
        if data == "[DONE]" {
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            continue;
        };
        match api {
            DemoApi::OpenAiChat => {
                let Some(d) = v.pointer("/choices/0/delta") else {
                    continue;
                };
                if let Some(t) = d.get("content").and_then(Value::as_str) {
                    text.push_str(t);
                }
                if let Some(tc) = d.pointer("/tool_calls/0") {
                    if let Some(i) = tc.get("id").and_then(Value::as_str) {
                        id = i.to_string();
                    }
                    if let Some(n) = tc.pointer("/function/name").and_then(Value::as_str) {
                        name = n.to_string();
                    }
                    if let Some(a) = tc.pointer("/function/arguments").and_then(Value::as_str) {
                        args.push_str(a);
                    }
                }
            }
            DemoApi::Anthropic => match v.get("type").and_then(Value::as_str) {
                Some("content_block_start") => {
                    if let Some(b) = v.get("content_block") {
                        if b.get("type").and_then(Value::as_str) == Some("tool_use") {
                            id = b
                                .get("id")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string();
                            name = b
                                .get("name")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string();
                        }
                    }
                }
                Some("content_block_delta") => {
                    if let Some(t) = v.pointer("/delta/text").and_then(Value::as_str) {
                        text.push_str(t);
                    }
                    if let Some(p) = v.pointer("/delta/partial_json").and_then(Value::as_str) {
                        args.push_str(p);
                    }
                }
                _ => {}
            },
        }
    }
    if !name.is_empty() {
        Some(Reply::Tool {
            id,
            name,
            input: args,
        })
    } else if !text.is_empty() {
        Some(Reply::Text(text))
    } else {
        None
    }
}

/// `183211;src=anchored;window=...` -> (tokens, src, window).
pub fn parse_projection(h: &str) -> Option<(u64, String, Option<u64>)> {
    let mut parts = h.split(';');
    let tokens = parts.next()?.trim().parse().ok()?;
    let mut src = String::from("?");
    let mut window = None;
    for p in parts {
        match p.trim().split_once('=') {
            Some(("src", v)) => src = v.trim_matches('"').to_string(),
            Some(("window", v)) => window = v.parse().ok(),
            _ => {}
        }
    }
    Some((tokens, src, window))
}

/// One demo request: the agent's body with its session and the API's
/// (made-up) credentials.
fn demo_request(
    api: DemoApi,
    proxy: SocketAddr,
    path: &str,
    key: &str,
    body: Vec<u8>,
) -> Result<Request<Full<Bytes>>, String> {
    let req = Request::post(format!("http://{proxy}{path}"))
        .header("content-type", "application/json")
        .header("x-session-id", key);
    let req = match api {
        DemoApi::OpenAiChat => req.header("authorization", "Bearer sk-demo-not-a-real-key"),
        DemoApi::Anthropic => req
            .header("x-api-key", "sk-ant-demo-not-a-real-key")
            .header("anthropic-version", "2023-06-01")
            .header("accept-encoding", "gzip"),
    };
    req.body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("could not build the request: {e}"))
}

/// Send and read the whole response (gunzipped), each step bounded.
async fn exchange(
    client: &HttpClient,
    req: Result<Request<Full<Bytes>>, String>,
) -> Result<(http::response::Parts, String), String> {
    let resp = match tokio::time::timeout(Duration::from_secs(60), client.request(req?)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return Err(format!("request failed: {e}")),
        Err(_) => return Err("request timed out".to_string()),
    };
    let (parts, incoming) = resp.into_parts();
    let gzip = header(&parts.headers, "content-encoding").is_some_and(|e| e.contains("gzip"));
    let bytes = match tokio::time::timeout(Duration::from_secs(60), incoming.collect()).await {
        Ok(Ok(c)) => c.to_bytes(),
        _ => Bytes::new(),
    };
    let text = if gzip {
        let mut s = String::new();
        let _ = flate2::read::GzDecoder::new(&bytes[..]).read_to_string(&mut s);
        s
    } else {
        String::from_utf8_lossy(&bytes).into_owned()
    };
    Ok((parts, text))
}

fn header(h: &http::HeaderMap, n: &str) -> Option<String> {
    h.get(n).and_then(|v| v.to_str().ok()).map(str::to_string)
}

/// The table's decision column: what tidemark did, else where the
/// projection stands against the warn and limit lines.
fn decision(
    h: &http::HeaderMap,
    util: Option<f64>,
    (warn_at, limit_at): (f64, f64),
) -> &'static str {
    if header(h, "x-tidemark-error").as_deref() == Some("context-budget") {
        "reject"
    } else if header(h, "x-context-trimmed").is_some() {
        "trim"
    } else if util.is_some_and(|u| u > limit_at) {
        "over"
    } else if header(h, "x-context-warning").is_some() || util.is_some_and(|u| u >= warn_at) {
        "warn"
    } else {
        "pass"
    }
}

/// Why a session ended on a non-200.
fn refused(status: StatusCode, tidemark_error: Option<String>, turn: u32, window: u64) -> String {
    if let Some(kind) = tidemark_error {
        format!(
            "tidemark answered {} ({kind}) at turn {turn}",
            status.as_u16()
        )
    } else if status == StatusCode::BAD_REQUEST {
        format!("the provider rejected turn {turn}: the prompt no longer fits the {window}-token window")
    } else {
        format!("the provider answered {} at turn {turn}", status.as_u16())
    }
}

/// Drive one session through the proxy.
#[allow(clippy::too_many_arguments)]
async fn run_session(
    client: &HttpClient,
    proxy: SocketAddr,
    estimator: &Estimator,
    api: DemoApi,
    key: String,
    turns: u32,
    seed: u64,
    (warn_at, limit_at): (f64, f64),
    progress: &indicatif::ProgressBar,
    dump: Option<&std::path::Path>,
    pace: Duration,
) -> SessionRun {
    let mut agent = Agent::new(api, seed);
    let (path, tapi) = match api {
        DemoApi::OpenAiChat => ("/v1/chat/completions", Api::OpenAiChat),
        DemoApi::Anthropic => ("/v1/messages", Api::Anthropic),
    };
    let mut run = SessionRun {
        api,
        model: agent.model,
        key: key.clone(),
        window: DEMO_WINDOW,
        rows: Vec::new(),
        ended: None,
    };
    for turn in 1..=turns {
        progress.set_message(format!("{} turn {turn}", tapi.as_str()));
        let body = match serde_json::to_vec(&agent.body()) {
            Ok(b) => b,
            Err(e) => {
                run.ended = Some(format!("could not serialise the request: {e}"));
                break;
            }
        };
        if let Some(dir) = dump {
            let _ = std::fs::write(dir.join(format!("{}-{turn:03}.json", tapi.as_str())), &body);
        }
        let est = RequestView::parse(&body)
            .map(|v| estimator.estimate(tapi.provider(), &v, Some(agent.model)))
            .unwrap_or_default();
        let (parts, text) = match exchange(client, demo_request(api, proxy, path, &key, body)).await
        {
            Ok(r) => r,
            Err(e) => {
                run.ended = Some(e);
                break;
            }
        };
        let hdr = |n: &str| header(&parts.headers, n);
        let real = hdr(X_SIM_PROMPT_TOKENS).and_then(|v| v.parse::<u64>().ok());
        let proj = hdr("x-context-projection").and_then(|h| parse_projection(&h));
        if let Some(w) = proj.as_ref().and_then(|p| p.2) {
            run.window = w;
        }
        let tidemark_error = hdr("x-tidemark-error");
        let util = proj.as_ref().map(|p| p.0 as f64 / run.window.max(1) as f64);
        let decision = decision(&parts.headers, util, (warn_at, limit_at));
        run.rows.push(Row {
            turn,
            status: parts.status.as_u16(),
            real,
            chars4: est.chars / 4,
            estimate: est.tokens,
            projection: proj.as_ref().map(|p| p.0),
            src: proj.map(|p| p.1),
            decision,
        });
        progress.inc(1);
        if parts.status != StatusCode::OK {
            run.ended = Some(refused(parts.status, tidemark_error, turn, run.window));
            break;
        }
        match parse_stream(api, &text) {
            Some(r) => agent.advance(r),
            None => {
                run.ended = Some(format!("turn {turn}: the response carried no reply"));
                break;
            }
        }
        if !pace.is_zero() {
            tokio::time::sleep(pace).await;
        }
    }
    run
}

// ---------------------------------------------------------------------------
// Output.

struct Paint(bool);
impl Paint {
    fn c(&self, code: &str, s: &str) -> String {
        if self.0 {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }
}

fn opt(n: Option<u64>) -> String {
    n.map_or_else(|| "-".to_string(), |v| v.to_string())
}

/// (projection - real) / real, in percent.
pub fn error_pct(projection: u64, real: u64) -> f64 {
    (projection as f64 - real as f64) / real as f64 * 100.0
}

fn table(run: &SessionRun, paint: &Paint) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n{}",
        paint.c(
            "1",
            &format!(
                "== {} · model {} · window {} · session {}",
                api_name(run.api),
                run.model,
                run.window,
                run.key
            )
        )
    );
    // Column widths match the rows below.
    s.push_str("turn     real  chars/4  estimate  projection     error  src         decision\n");
    for r in &run.rows {
        let err = match (r.projection, r.real) {
            (Some(p), Some(real)) if real > 0 => Some(error_pct(p, real)),
            _ => None,
        };
        let err_s = format!(
            "{:>8}",
            err.map_or_else(|| "-".to_string(), |e| format!("{e:+.2}%"))
        );
        let err_s = match err {
            Some(e) if e.abs() < 2.0 => paint.c("32", &err_s),
            Some(e) if e.abs() < 10.0 => paint.c("33", &err_s),
            Some(_) => paint.c("31", &err_s),
            None => err_s,
        };
        let dec = match r.decision {
            "pass" => r.decision.to_string(),
            "warn" => paint.c("33", r.decision),
            _ => paint.c("31", r.decision),
        };
        let _ = writeln!(
            s,
            "{:>4}  {:>7}  {:>7}  {:>8}  {:>10}  {}  {:<10}  {}{}",
            r.turn,
            opt(r.real),
            r.chars4,
            r.estimate,
            opt(r.projection),
            err_s,
            r.src.as_deref().unwrap_or("-"),
            dec,
            if r.status == 200 {
                String::new()
            } else {
                format!(" (HTTP {})", r.status)
            }
        );
    }
    s
}

fn api_name(api: DemoApi) -> &'static str {
    match api {
        DemoApi::OpenAiChat => "openai-chat",
        DemoApi::Anthropic => "anthropic-messages",
    }
}

/// The first turn whose value reaches `line`.
fn first_at(rows: &[Row], line: f64, f: impl Fn(&Row) -> Option<u64>) -> Option<u32> {
    rows.iter()
        .find(|r| f(r).is_some_and(|v| v as f64 >= line))
        .map(|r| r.turn)
}

fn summary(run: &SessionRun, warn_at: f64, paint: &Paint) -> String {
    let line = warn_at * run.window as f64;
    let real = first_at(&run.rows, line, |r| r.real);
    let last = run.rows.last().map_or(0, |r| r.turn);
    // The run stopped on a context-length 400 (the provider's or tidemark's).
    let hit_wall = run.rows.last().is_some_and(|r| r.status == 400);
    let verdict = |t: Option<u32>| -> String {
        match (t, real) {
            (None, Some(r)) if hit_wall => paint.c(
                "31",
                &format!("never: the session hit the wall at turn {last} first (the real count crossed at turn {r})"),
            ),
            (None, Some(r)) => paint.c(
                "31",
                &format!("never within {last} turns (the real count crossed at turn {r})"),
            ),
            (None, None) => format!("not within {last} turns"),
            (Some(t), Some(r)) if t > r => {
                paint.c("31", &format!("turn {t}: {} turns late", t - r))
            }
            (Some(t), Some(r)) if t < r => {
                paint.c("33", &format!("turn {t}: {} turns early", r - t))
            }
            (Some(t), Some(_)) => paint.c("32", &format!("turn {t}: on time")),
            (Some(t), None) => format!("turn {t}"),
        }
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "   gate line: {:.0}% of {} = {:.0} tokens",
        warn_at * 100.0,
        run.window,
        line
    );
    let _ = writeln!(
        s,
        "   the real count crossed it:             {}",
        real.map_or_else(
            || format!("not within {last} turns"),
            |t| format!("turn {t}")
        )
    );
    let _ = writeln!(
        s,
        "   a gate on chars/4 would fire:          {}",
        verdict(first_at(&run.rows, line, |r| Some(r.chars4)))
    );
    let _ = writeln!(
        s,
        "   a gate on the raw estimate would fire: {}",
        verdict(first_at(&run.rows, line, |r| Some(r.estimate)))
    );
    let _ = writeln!(
        s,
        "   a gate on tidemark's projection fires: {}",
        verdict(first_at(&run.rows, line, |r| r.projection))
    );
    if let Some(e) = &run.ended {
        let _ = writeln!(s, "   session ended: {e}");
    }
    s
}

// ---------------------------------------------------------------------------

async fn wait_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// The simulated provider the tables run against: paced like a real one
/// when it stays up for a person to watch, at full speed otherwise.
fn demo_sim(keep_running: bool) -> SimConfig {
    let pace = |d| if keep_running { d } else { Duration::ZERO };
    SimConfig {
        context_window: Some(DEMO_WINDOW),
        gzip: true,
        first_byte_delay: pace(Duration::from_millis(40)),
        chunk_delay: pace(Duration::from_millis(4)),
        ..SimConfig::default()
    }
}

/// A bar on a terminal's stderr, nothing when it is piped.
fn progress_bar(turns: u32) -> indicatif::ProgressBar {
    if !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(u64::from(turns) * 2);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests  {msg}",
    ) {
        pb.set_style(style);
    }
    pb
}

/// A wildcard listen address (0.0.0.0 in a container) is not a URL to
/// copy: show loopback, which is also what a published port maps to.
fn shown(mut a: SocketAddr) -> SocketAddr {
    if a.ip().is_unspecified() {
        a.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    a
}

/// What runs where, printed before the scripted sessions.
fn print_banner(stack: &Stack, keep_running: bool) {
    if keep_running {
        // First, so the page can be open while the scripted sessions run.
        println!(
            "tidemark demo: live sessions page at http://{}/{}",
            shown(stack.admin),
            if stack.admin_token {
                " (it asks for the --admin-token)"
            } else {
                ""
            }
        );
    }
    println!(
        "tidemark demo: simulated provider (OpenAI counted in cl100k_base, Anthropic in p50k_base, + hidden framing) behind the real proxy at http://{}",
        stack.proxy
    );
}

/// Where to point an agent, a browser and curl while the demo stays up.
fn print_live_help(stack: &Stack) {
    let base = format!("http://{}", shown(stack.proxy));
    let admin_shown = shown(stack.admin);
    println!("\ntidemark is up in front of the simulated provider (Ctrl-C to stop):");
    println!("  sessions page:       http://{admin_shown}/");
    println!("  OpenAI base URL:     {base}/v1");
    println!("  Anthropic base URL:  {base}");
    println!("  metrics:             http://{admin_shown}/metrics");
    println!("  sessions:            http://{admin_shown}/sessions");
    if stack.proxy.ip().is_unspecified() {
        println!("  (listening on all interfaces: from another host or a container's host, use its address and the published port)");
    }
    println!("\n  curl -sN {base}/v1/chat/completions -H 'authorization: Bearer sk-demo' -H 'content-type: application/json' -H 'x-session-id: try-1' -d '{{\"model\":\"gpt-4o\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hello 👋\"}}]}}' -D - -o /dev/null");
    println!("  curl -sN {base}/v1/messages -H 'x-api-key: sk-ant-demo' -H 'anthropic-version: 2023-06-01' -H 'content-type: application/json' -d '{{\"model\":\"claude-sonnet-4-5\",\"max_tokens\":256,\"messages\":[{{\"role\":\"user\",\"content\":\"こんにちは\"}}]}}' -D -");
    println!("  curl -s http://{admin_shown}/metrics | grep tidemark_projection");
}

/// Light traffic for the live page: new sessions on both APIs, paced,
/// until the task is aborted.
fn keep_traffic(
    client: HttpClient,
    estimator: Estimator,
    proxy: SocketAddr,
    turns: u32,
    gates: (f64, f64),
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let hidden = indicatif::ProgressBar::hidden();
        for round in 2u64.. {
            for (i, api) in [DemoApi::OpenAiChat, DemoApi::Anthropic]
                .into_iter()
                .enumerate()
            {
                let key = format!("demo-{}-{round}", api_name(api));
                let _ = run_session(
                    &client,
                    proxy,
                    &estimator,
                    api,
                    key,
                    turns.max(30),
                    0x7AD3 + round * 2 + i as u64,
                    gates,
                    &hidden,
                    None,
                    Duration::from_millis(400),
                )
                .await;
            }
        }
    })
}

/// `tidemark demo`: start the simulated provider and the proxy, run the
/// scripted sessions, print the tables and the story; with `keep_running`,
/// stay up with light traffic until Ctrl-C.
pub async fn main(flags: Flags, turns: u32, keep_running: bool) -> Result<(), String> {
    if turns == 0 {
        return Err("--turns must be at least 1".to_string());
    }
    let story_flags = flags.clone();
    let story_sim = SimConfig {
        context_window: Some(DEMO_WINDOW),
        ..SimConfig::default()
    };
    let stack = start(flags, demo_sim(keep_running)).await?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let estimator = Estimator::new(64 << 20);
    let dump = std::env::var_os("TIDEMARK_DEMO_DUMP").map(std::path::PathBuf::from);
    if let Some(d) = &dump {
        std::fs::create_dir_all(d).map_err(|e| format!("TIDEMARK_DEMO_DUMP: {e}"))?;
    }
    let paint = Paint(std::io::stdout().is_terminal());
    let progress = progress_bar(turns);
    print_banner(&stack, keep_running);
    let gates = (stack.warn_at, stack.limit_at);
    let mut runs = Vec::new();
    for (i, api) in [DemoApi::OpenAiChat, DemoApi::Anthropic]
        .into_iter()
        .enumerate()
    {
        let key = format!("demo-{}-1", api_name(api));
        runs.push(
            run_session(
                &client,
                stack.proxy,
                &estimator,
                api,
                key,
                turns,
                0x7AD3 + i as u64,
                gates,
                &progress,
                dump.as_deref(),
                Duration::ZERO,
            )
            .await,
        );
    }
    progress.finish_and_clear();
    for run in &runs {
        print!("{}", table(run, &paint));
        print!("{}", summary(run, stack.warn_at, &paint));
    }
    println!(
        "\nreal = the provider's own count; chars/4 and estimate = what an agent could compute locally;\nprojection = tidemark's x-context-projection (anchored on the last real count); error = (projection - real) / real."
    );
    match story::run(&story_flags, &client, &estimator, story_sim).await {
        Ok(text) => print!("{text}"),
        Err(e) => println!("\nthe story stopped: {e}"),
    }

    if keep_running {
        print_live_help(&stack);
        let traffic = keep_traffic(client, estimator, stack.proxy, turns, gates);
        wait_signal().await;
        traffic.abort();
        let _ = traffic.await;
    } else {
        drop(client);
    }
    stack.stop().await;
    Ok(())
}
