//! Mixed-content agent sessions for every API, driven through a running
//! proxy in front of the simulated provider, turn by turn: the accuracy
//! test (`tests/accuracy.rs`) and the accuracy table (`examples/drift.rs`)
//! share them.
//!
//! Each turn's row holds the provider's real count (`x-sim-prompt-tokens`
//! of the same response) and what each way of guessing it said:
//! - `chars4`: the counted characters over four;
//! - `estimate`: tidemark's raw local estimate;
//! - `single`: the anchored projection with one learned ratio for all
//!   content (tidemark's own session code, fed the estimate without its
//!   classes: a shadow store beside the proxy);
//! - `projection`: what the proxy sent in `x-context-projection`, class by class.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tidemark::estimate::{Class, Classes, Estimator, CLASSES};
use tidemark::provider::{Api, Usage};
use tidemark::session::{Outcome, RequestFacts, SessionConfig, Sessions};
use tidemark::sim::X_SIM_PROMPT_TOKENS;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// The five APIs and the model each session uses.
pub const APIS: [(Api, &str); 5] = [
    (Api::OpenAiChat, "gpt-4o"),
    (Api::OpenAiResponses, "gpt-5"),
    (Api::Anthropic, "claude-sonnet-4-5"),
    (Api::Gemini, "gemini-2.5-flash"),
    (Api::Ollama, "llama3.2"),
];

// ---------------------------------------------------------------------------
// Content

pub struct Gen(pub u64);
impl Gen {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

const CJK: &[&str] = &[
    "上下文窗口的大小决定了模型一次能看到多少内容。",
    "日本語のテキストはトークン数が多くなりがちです。",
    "한국어 문장도 토큰화 방식에 따라 길이가 달라집니다.",
    "这个函数返回一个包含所有结果的列表，并且不会修改输入。",
    "請在部署之前檢查所有的設定檔與環境變數。",
    "東京の天気は晴れ、最高気温は二十八度の予報です。",
    "서버를 다시 시작하기 전에 설정 파일을 확인하세요.",
    "如果请求超过了上下文窗口，提供方会直接拒绝它。",
];
const CYRILLIC: &[&str] = &[
    "Размер контекстного окна определяет, сколько текста модель видит за один раз.",
    "Проверьте настройки перед развертыванием сервиса.",
    "Η απάντηση του διακομιστή περιέχει τον πραγματικό αριθμό των διακριτικών.",
    "Запрос был отклонён, потому что превысил лимит токенов.",
];
const EMOJI: &[&str] = &[
    "🚀",
    "🔥",
    "✅",
    "🧪",
    "📦",
    "🌊",
    "👩‍💻",
    "🇯🇵",
    "🤖",
    "🎉",
    "😅",
    "👍",
    "❤️",
    "✨",
];
const WORDS: &[&str] = &[
    "the",
    "window",
    "tokens",
    "anchor",
    "session",
    "budget",
    "provider",
    "stream",
    "cache",
    "request",
    "deploy",
    "latency",
    "projection",
    "compaction",
    "gateway",
    "retry",
    "and",
    "of",
    "a",
    "to",
    "we",
    "should",
    "check",
    "before",
    "after",
    "each",
    "turn",
];
const LEVELS: &[&str] = &["INFO", "WARN", "DEBUG", "ERROR"];
const MODULES: &[&str] = &[
    "gateway::upstream",
    "gateway::retry",
    "proxy::tap",
    "store::redis",
    "worker::pool",
];

/// A kind of content an agent's conversation carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Prose,
    Logs,
    Json,
    Code,
    Cjk,
    Base64,
    Emoji,
    Cyrillic,
}

pub const KINDS: [Kind; 8] = [
    Kind::Prose,
    Kind::Logs,
    Kind::Json,
    Kind::Code,
    Kind::Cjk,
    Kind::Base64,
    Kind::Emoji,
    Kind::Cyrillic,
];

/// About `size` characters of one kind of content.
pub fn content(g: &mut Gen, kind: Kind, size: usize) -> String {
    let mut s = String::new();
    while s.chars().count() < size {
        match kind {
            Kind::Prose => {
                let n = 8 + g.below(12);
                for k in 0..n {
                    let w = g.pick(WORDS);
                    if k == 0 {
                        let mut c = w.chars();
                        if let Some(f) = c.next() {
                            s.extend(f.to_uppercase());
                            s.push_str(c.as_str());
                        }
                    } else {
                        s.push(' ');
                        s.push_str(w);
                    }
                }
                s.push_str(". ");
            }
            Kind::Logs => {
                s.push_str(&format!(
                    "2025-11-03T14:{:02}:{:02}.{:03}Z {:<5} {} request_id={:08x} status={} latency_ms={} path=/v1/{}/{}\n",
                    g.below(60),
                    g.below(60),
                    g.below(1000),
                    g.pick(LEVELS),
                    g.pick(MODULES),
                    g.next() as u32,
                    [200, 200, 200, 429, 502][g.below(5)],
                    g.below(2000),
                    g.pick(WORDS),
                    g.pick(WORDS),
                ));
            }
            Kind::Json => {
                let recs: Vec<Value> = (0..3 + g.below(4))
                    .map(|k| {
                        json!({"id": g.next() % 100_000, "sku": format!("X-{:06x}", g.next() % 0xFF_FFFF),
                            "qty": k, "ok": g.below(2) == 0, "tags": [g.pick(WORDS), g.pick(WORDS)],
                            "price": (g.next() % 100_000) as f64 / 100.0, "note": format!("{} {}", g.pick(WORDS), g.pick(WORDS))})
                    })
                    .collect();
                s.push_str(&Value::Array(recs).to_string());
                s.push('\n');
            }
            Kind::Code => {
                let name = format!("{}_{}", g.pick(WORDS), g.pick(WORDS));
                if g.below(2) == 0 {
                    s.push_str(&format!(
                        "fn {name}(buf: &[u8], limit: usize) -> Result<Vec<u32>, Error> {{\n    let mut out = Vec::with_capacity(limit);\n    for (i, b) in buf.iter().enumerate() {{\n        if i >= limit {{\n            return Err(Error::Limit {{ at: i }});\n        }}\n        out.push(u32::from(*b).wrapping_mul({}) ^ 0x{:04x});\n    }}\n    Ok(out)\n}}\n\n",
                        g.below(1000),
                        g.below(0xFFFF)
                    ));
                } else {
                    s.push_str(&format!(
                        "def {name}(records, limit={}):\n    out = []\n    for i, r in enumerate(records):\n        if i >= limit:\n            raise ValueError(f\"too many: {{i}}\")\n        if r.get(\"ok\"):\n            out.append(r[\"id\"] * {})\n    return out\n\n",
                        g.below(100),
                        g.below(1000)
                    ));
                }
            }
            Kind::Cjk => s.push_str(g.pick(CJK)),
            Kind::Base64 => {
                let raw: Vec<u8> = (0..600).map(|_| g.next() as u8).collect();
                s.push_str(&base64::engine::general_purpose::STANDARD.encode(raw));
            }
            Kind::Emoji => {
                for k in 0..12 {
                    s.push_str(g.pick(WORDS));
                    if k % 2 == 0 {
                        s.push(' ');
                        s.push_str(g.pick(EMOJI));
                        if g.below(3) == 0 {
                            s.push_str(g.pick(EMOJI));
                        }
                    }
                    s.push(' ');
                }
                s.push('\n');
            }
            Kind::Cyrillic => {
                s.push_str(g.pick(CYRILLIC));
                s.push(' ');
            }
        }
    }
    s
}

// ---------------------------------------------------------------------------
// Conversations

/// One message of a conversation, before it takes an API's shape.
#[derive(Debug, Clone)]
enum Msg {
    User(String),
    Assistant(String),
    Call {
        id: String,
        name: String,
        args: Value,
    },
    Result {
        id: String,
        name: String,
        text: String,
    },
}

/// One turn of a script: what the assistant answered, then what came back.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    /// The assistant's answer: text of this kind, or (with `tool`) a tool call.
    pub reply: Kind,
    /// The user's next message, or the tool's result, of this kind.
    pub next: Kind,
    pub size: usize,
    pub tool: bool,
}

/// A session script: turn `t` (1-based, from 2) appends `steps[t - 2]`.
pub struct Script {
    pub name: &'static str,
    pub steps: Vec<Step>,
}

const TOOLS: [(&str, &str); 3] = [
    (
        "read_file",
        "Read a file of the repository and return its contents.",
    ),
    (
        "run_command",
        "Run a shell command in the sandbox and return its output.",
    ),
    (
        "search",
        "Search the project and the web; returns matching records.",
    ),
];

/// The classes one by one, as issue 33 tells it: logs and JSON first, then
/// a large CJK tool result, then base64, then emoji-heavy text, then another
/// script; then everything mixed.
pub fn one_by_one(seed: u64) -> Script {
    use Kind::*;
    let mut g = Gen(seed);
    let mut steps = Vec::new();
    let mut push = |reply, next, size, tool| {
        steps.push(Step {
            reply,
            next,
            size,
            tool,
        })
    };
    // Turns 2-8: logs and JSON from tools, prose and code from the assistant.
    for t in 0..7 {
        let next = if t % 2 == 0 { Logs } else { Json };
        push(
            if t % 3 == 2 { Code } else { Prose },
            next,
            900 + 150 * t,
            true,
        );
    }
    // Turn 9: a large CJK tool result.
    push(Prose, Cjk, 3000, true);
    for t in 0..4 {
        push(Prose, [Logs, Json, Code, Prose][t], 800, t % 2 == 0);
    }
    // Turn 14: base64.
    push(Prose, Base64, 2400, true);
    for t in 0..4 {
        push(Prose, [Json, Logs, Cjk, Code][t], 700, t % 2 == 1);
    }
    // Turn 19: emoji-heavy text from the user.
    push(Prose, Emoji, 1500, false);
    for t in 0..5 {
        push(Code, [Json, Cjk, Logs, Emoji, Base64][t], 700, t % 2 == 0);
    }
    // Turn 25: another script.
    push(Prose, Cyrillic, 1500, true);
    // Then everything, at random.
    while steps.len() < 35 {
        let next = KINDS[g.below(KINDS.len())];
        let reply = if g.below(3) == 0 { Code } else { Prose };
        steps.push(Step {
            reply,
            next,
            size: 400 + g.below(1200),
            tool: g.below(2) == 0,
        });
    }
    Script {
        name: "one by one",
        steps,
    }
}

/// Every kind in turn from the first turn on: the session that, before the
/// other, teaches a model its ratios.
pub fn rotating(seed: u64) -> Script {
    let mut g = Gen(seed);
    let steps = (0..35)
        .map(|t| Step {
            reply: if t % 3 == 1 { Kind::Code } else { Kind::Prose },
            next: KINDS[(t + 1) % KINDS.len()],
            size: 500 + g.below(900),
            tool: t % 2 == 0,
        })
        .collect();
    Script {
        name: "rotating",
        steps,
    }
}

/// A growing conversation in one API's shape.
pub struct Conv {
    pub api: Api,
    pub model: &'static str,
    system: String,
    msgs: Vec<Msg>,
    g: Gen,
    calls: usize,
}

impl Conv {
    pub fn new(api: Api, model: &'static str, seed: u64) -> Conv {
        let mut g = Gen(seed);
        let system = format!(
            "You are a careful coding agent. {}\n\nExamples:\n{}",
            content(&mut g, Kind::Prose, 2500),
            content(&mut g, Kind::Code, 1500)
        );
        let first = content(&mut g, Kind::Prose, 400);
        Conv {
            api,
            model,
            system,
            msgs: vec![Msg::User(first)],
            g,
            calls: 0,
        }
    }

    /// Append one step: the assistant's answer and what came back.
    pub fn advance(&mut self, s: Step) {
        let g = &mut self.g;
        if s.tool {
            self.calls += 1;
            let (name, _) = TOOLS[self.calls % TOOLS.len()];
            let id = format!("call_{:04}", self.calls);
            let args = json!({"query": content(g, Kind::Prose, 60), "limit": 20 + g.below(50)});
            self.msgs.push(Msg::Call {
                id: id.clone(),
                name: name.to_string(),
                args,
            });
            let text = content(g, s.next, s.size);
            self.msgs.push(Msg::Result {
                id,
                name: name.to_string(),
                text,
            });
        } else {
            let n = 300 + g.below(500);
            let reply = content(g, s.reply, n);
            self.msgs.push(Msg::Assistant(reply));
            self.msgs.push(Msg::User(content(g, s.next, s.size)));
        }
    }

    pub fn path(&self) -> String {
        match self.api {
            Api::OpenAiChat => "/v1/chat/completions".into(),
            Api::OpenAiResponses => "/v1/responses".into(),
            Api::Anthropic => "/v1/messages".into(),
            Api::Gemini => format!(
                "/v1beta/models/{}:streamGenerateContent?alt=sse",
                self.model
            ),
            Api::Ollama => "/api/chat".into(),
        }
    }

    fn tools(&self) -> Value {
        let params = json!({"type":"object","properties":{"query":{"type":"string"},"limit":{"type":"integer"}},"required":["query"]});
        let t = TOOLS.iter().map(|(name, desc)| match self.api {
            Api::OpenAiChat | Api::Ollama => {
                json!({"type":"function","function":{"name":name,"description":desc,"parameters":params}})
            }
            Api::OpenAiResponses => {
                json!({"type":"function","name":name,"description":desc,"parameters":params})
            }
            Api::Anthropic => json!({"name":name,"description":desc,"input_schema":params}),
            Api::Gemini => json!({"name":name,"description":desc,"parameters":params}),
        });
        match self.api {
            Api::Gemini => json!([{"functionDeclarations": t.collect::<Vec<_>>()}]),
            _ => Value::Array(t.collect()),
        }
    }

    /// The request body of the next turn (streaming; OpenAI chat's without
    /// asking for usage, as agents do).
    pub fn body(&self) -> Value {
        let model = self.model;
        let tools = self.tools();
        match self.api {
            Api::OpenAiChat => {
                let mut m = vec![json!({"role":"system","content":self.system})];
                m.extend(self.msgs.iter().map(|x| match x {
                    Msg::User(t) => json!({"role":"user","content":t}),
                    Msg::Assistant(t) => json!({"role":"assistant","content":t}),
                    Msg::Call { id, name, args } => json!({"role":"assistant","content":null,
                        "tool_calls":[{"id":id,"type":"function","function":{"name":name,"arguments":args.to_string()}}]}),
                    Msg::Result { id, text, .. } => json!({"role":"tool","tool_call_id":id,"content":text}),
                }));
                json!({"model":model,"messages":m,"tools":tools,"stream":true})
            }
            Api::OpenAiResponses => {
                let input: Vec<Value> = self.msgs.iter().map(|x| match x {
                    Msg::User(t) => json!({"type":"message","role":"user","content":[{"type":"input_text","text":t}]}),
                    Msg::Assistant(t) => json!({"type":"message","role":"assistant","content":[{"type":"output_text","text":t}]}),
                    Msg::Call { id, name, args } => json!({"type":"function_call","call_id":id,"name":name,"arguments":args.to_string()}),
                    Msg::Result { id, text, .. } => json!({"type":"function_call_output","call_id":id,"output":text}),
                }).collect();
                json!({"model":model,"instructions":self.system,"input":input,"tools":tools,"store":false,"stream":true})
            }
            Api::Anthropic => {
                let m: Vec<Value> = self.msgs.iter().map(|x| match x {
                    Msg::User(t) => json!({"role":"user","content":t}),
                    Msg::Assistant(t) => json!({"role":"assistant","content":[{"type":"text","text":t}]}),
                    Msg::Call { id, name, args } => json!({"role":"assistant","content":[{"type":"tool_use","id":id,"name":name,"input":args}]}),
                    Msg::Result { id, text, .. } => json!({"role":"user","content":[{"type":"tool_result","tool_use_id":id,"content":text}]}),
                }).collect();
                json!({"model":model,"max_tokens":1024,"system":self.system,"messages":m,"tools":tools,"stream":true})
            }
            Api::Gemini => {
                let c: Vec<Value> = self.msgs.iter().map(|x| match x {
                    Msg::User(t) => json!({"role":"user","parts":[{"text":t}]}),
                    Msg::Assistant(t) => json!({"role":"model","parts":[{"text":t}]}),
                    Msg::Call { name, args, .. } => json!({"role":"model","parts":[{"functionCall":{"name":name,"args":args}}]}),
                    Msg::Result { name, text, .. } => json!({"role":"user","parts":[{"functionResponse":{"name":name,"response":{"content":text}}}]}),
                }).collect();
                json!({"systemInstruction":{"parts":[{"text":self.system}]},"contents":c,"tools":tools})
            }
            Api::Ollama => {
                let mut m = vec![json!({"role":"system","content":self.system})];
                m.extend(self.msgs.iter().map(|x| match x {
                    Msg::User(t) => json!({"role":"user","content":t}),
                    Msg::Assistant(t) => json!({"role":"assistant","content":t}),
                    Msg::Call { name, args, .. } => json!({"role":"assistant","content":"",
                        "tool_calls":[{"function":{"name":name,"arguments":args}}]}),
                    Msg::Result { name, text, .. } => {
                        json!({"role":"tool","content":text,"tool_name":name})
                    }
                }));
                json!({"model":model,"messages":m,"tools":tools,"stream":true})
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Driving a session

/// One turn as measured.
#[derive(Debug, Clone)]
pub struct Row {
    pub turn: usize,
    pub real: u64,
    pub src: String,
    pub chars4: u64,
    pub estimate: u64,
    /// The single-ratio projection (anchored from turn 2).
    pub single: u64,
    pub projection: u64,
    /// Classes this turn brought that no earlier turn of the session had.
    pub new_classes: Vec<&'static str>,
}

/// Signed error in percent of the real count.
pub fn err(x: u64, real: u64) -> f64 {
    (x as f64 - real as f64) / real as f64 * 100.0
}

/// Median and worst absolute error of a column over the rows.
pub fn stats(rows: &[Row], f: impl Fn(&Row) -> u64) -> (f64, f64) {
    let mut a: Vec<f64> = rows.iter().map(|r| err(f(r), r.real).abs()).collect();
    if a.is_empty() {
        return (0.0, 0.0);
    }
    a.sort_by(f64::total_cmp);
    let median = if a.len() % 2 == 1 {
        a[a.len() / 2]
    } else {
        (a[a.len() / 2 - 1] + a[a.len() / 2]) / 2.0
    };
    (median, a[a.len() - 1])
}

/// The single-ratio path, run beside the proxy: tidemark's own sessions fed
/// each estimate without its classes.
pub fn shadow() -> Sessions {
    Sessions::new(SessionConfig {
        ttl: Duration::from_secs(3600),
        max_sessions: 100,
    })
}

/// A class is new in a turn when the turn adds at least this many of its
/// tokens and no earlier turn added half as many.
const NEW_CLASS_TOKENS: u64 = 100;

/// Drive one scripted session of `turns` turns through the proxy at `proxy`.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    client: &HttpClient,
    proxy: SocketAddr,
    estimator: &Estimator,
    shadow: &Sessions,
    api: Api,
    model: &'static str,
    script: &Script,
    seed: u64,
    turns: usize,
) -> Result<Vec<Row>, String> {
    let mut conv = Conv::new(api, model, seed);
    let key = format!("mixed-{}-{model}-{seed}", script.name.replace(' ', "-"));
    let mut rows = Vec::new();
    let mut prev = Classes::default();
    let mut seen = [0u64; CLASSES];
    for turn in 1..=turns {
        if turn >= 2 {
            let step = script
                .steps
                .get(turn - 2)
                .copied()
                .ok_or("script shorter than the session")?;
            conv.advance(step);
        }
        let body = conv.body().to_string();
        let est = estimator
            .estimate_body(api, body.as_bytes(), Some(model))
            .ok_or("the request is JSON")?;
        let single = shadow.begin(RequestFacts {
            key: Some(key.clone()),
            api,
            model: Some(model.to_string()),
            estimate: est.tokens,
            ..Default::default()
        });
        let req = Request::post(format!("http://{proxy}{}", conv.path()))
            .header("content-type", "application/json")
            .header("x-session-id", &key)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(60), client.request(req))
            .await
            .map_err(|_| "proxy timed out")?
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let h = |n: &str| {
            resp.headers()
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let real: u64 = h(X_SIM_PROMPT_TOKENS)
            .and_then(|v| v.parse().ok())
            .ok_or(format!("turn {turn}: no {X_SIM_PROMPT_TOKENS} ({status})"))?;
        let proj = h("x-context-projection").ok_or("x-context-projection")?;
        tokio::time::timeout(Duration::from_secs(60), resp.into_body().collect())
            .await
            .map_err(|_| "body timed out")?
            .map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("turn {turn}: status {status}"));
        }
        let mut parts = proj.split(';');
        let projection: u64 = parts
            .next()
            .and_then(|t| t.parse().ok())
            .ok_or("projection tokens")?;
        let src = parts
            .find_map(|p| p.strip_prefix("src="))
            .unwrap_or("?")
            .to_string();
        shadow.finish(
            single.ticket,
            Outcome {
                status: 200,
                usage: Usage {
                    total_context: Some(real),
                    ..Default::default()
                },
                completed: true,
                ..Default::default()
            },
        );
        let mut new_classes = Vec::new();
        if turn >= 2 {
            for c in Class::ALL {
                let i = c as usize;
                let added = est.classes.get(c).saturating_sub(prev.get(c));
                if added >= NEW_CLASS_TOKENS && seen[i] < NEW_CLASS_TOKENS / 2 {
                    new_classes.push(c.name());
                }
                seen[i] = seen[i].max(added);
            }
        }
        prev = est.classes;
        rows.push(Row {
            turn,
            real,
            src,
            chars4: est.chars / 4,
            estimate: est.tokens,
            single: single.projection.tokens,
            projection,
            new_classes,
        });
    }
    Ok(rows)
}

/// The rows as a table, one line a turn.
pub fn table(rows: &[Row]) -> String {
    let mut s = format!(
        "{:>4} {:>7} {:>10} {:>8} {:>8} {:>8} {:>9}  new\n",
        "turn", "real", "src", "chars/4", "estimate", "single", "per-class"
    );
    for r in rows {
        s.push_str(&format!(
            "{:>4} {:>7} {:>10} {:>+7.2}% {:>+7.2}% {:>+7.2}% {:>+8.2}%  {}\n",
            r.turn,
            r.real,
            r.src,
            err(r.chars4, r.real),
            err(r.estimate, r.real),
            err(r.single, r.real),
            err(r.projection, r.real),
            r.new_classes.join(",")
        ));
    }
    s
}
