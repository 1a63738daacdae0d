//! Accuracy of tidemark's projection against a provider that counts its own way.
//!
//!     cargo run --release --example drift [-- TURNS]
//!
//! Starts the simulated provider (`tidemark::sim`: cl100k_base, hidden framing,
//! Anthropic's own ratio) and the real proxy in front of it, then drives one
//! scripted session per API (OpenAI chat streaming without asking for usage,
//! Anthropic streaming gzip'd) of dense content — CJK, JSON tool output, code,
//! base64, emoji — through the proxy. For every turn it compares with the
//! sim's real count (`x-sim-prompt-tokens` of the same response):
//!
//! - `chars/4`: the counted characters over four;
//! - `estimate`: tidemark's raw local estimate;
//! - `plain`: the anchored formula with calibration 1 (last real + estimate delta);
//! - `projection`: what the proxy sent in `x-context-projection`.
//!
//! and prints the median, mean and worst absolute error from turn 3.
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tidemark::estimate::Estimator;
use tidemark::provider::Api;
use tidemark::sim::{self, SimConfig, X_SIM_PROMPT_TOKENS};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

struct Gen(u64);
impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
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
];
const EMOJI: &[&str] = &["🚀", "🔥", "✅", "🧪", "📦", "🌊", "👩‍💻", "🇯🇵", "🤖", "🎉"];
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
];

/// One dense chunk; the kind rotates with `i`.
fn dense(g: &mut Gen, i: usize) -> String {
    let mut s = String::new();
    match i % 5 {
        0 => {
            for _ in 0..10 + g.below(10) {
                s.push_str(g.pick(CJK));
            }
        }
        1 => {
            let recs: Vec<Value> = (0..6 + g.below(8))
                .map(|k| {
                    json!({"id": g.next() % 100_000, "sku": format!("X-{:06x}", g.next() % 0xFF_FFFF),
                        "qty": k, "ok": g.below(2) == 0, "tags": [g.pick(WORDS), g.pick(WORDS)],
                        "price": (g.next() % 100_000) as f64 / 100.0, "note": g.pick(CJK)})
                })
                .collect();
            s = Value::Array(recs).to_string();
        }
        2 => {
            for _ in 0..2 + g.below(3) {
                let name = format!("{}_{}", g.pick(WORDS), g.pick(WORDS));
                s.push_str(&format!(
                    "fn {name}(buf: &[u8], limit: usize) -> Result<Vec<u32>, Error> {{\n    let mut out = Vec::with_capacity(limit);\n    for (i, b) in buf.iter().enumerate() {{\n        if i >= limit {{ return Err(Error::Limit {{ at: i }}); }}\n        out.push(u32::from(*b).wrapping_mul({}) ^ 0x{:04x});\n    }}\n    Ok(out)\n}}\n",
                    g.next() % 1000,
                    g.next() % 0xFFFF
                ));
            }
        }
        3 => {
            use base64::Engine;
            let raw: Vec<u8> = (0..300 + g.below(600)).map(|_| g.next() as u8).collect();
            s = base64::engine::general_purpose::STANDARD.encode(raw);
        }
        _ => {
            for k in 0..60 + g.below(60) {
                s.push_str(g.pick(WORDS));
                if k % 4 == 0 {
                    s.push_str(g.pick(EMOJI));
                }
                s.push(' ');
            }
        }
    }
    s
}

/// A growing conversation in one API's shape.
struct Conv {
    api: Api,
    model: &'static str,
    system: String,
    msgs: Vec<Value>,
    g: Gen,
    turn: usize,
}

impl Conv {
    fn new(api: Api, model: &'static str, seed: u64) -> Self {
        let mut g = Gen(seed);
        let system = format!(
            "You are a careful assistant. {}",
            (0..12)
                .map(|i| dense(&mut g, i))
                .collect::<Vec<_>>()
                .join("\n\n")
        );
        let first = dense(&mut g, 1);
        Conv {
            api,
            model,
            system,
            msgs: vec![json!({"role":"user","content":first})],
            g,
            turn: 1,
        }
    }

    fn path(&self) -> &'static str {
        match self.api {
            Api::Anthropic => "/v1/messages",
            _ => "/v1/chat/completions",
        }
    }

    fn body(&self) -> Value {
        match self.api {
            Api::Anthropic => json!({"model":self.model,"max_tokens":1024,"system":self.system,
                "messages":self.msgs,"stream":true}),
            _ => {
                let mut m = vec![json!({"role":"system","content":self.system})];
                m.extend(self.msgs.iter().cloned());
                json!({"model":self.model,"messages":m,"stream":true})
            }
        }
    }

    fn advance(&mut self) {
        self.turn += 1;
        let i = self.turn;
        let reply = dense(&mut self.g, i + 2);
        let next = dense(&mut self.g, i);
        let tool = i % 3 == 0;
        match (self.api, tool) {
            (Api::Anthropic, false) => {
                self.msgs
                    .push(json!({"role":"assistant","content":[{"type":"text","text":reply}]}));
                self.msgs.push(json!({"role":"user","content":next}));
            }
            (Api::Anthropic, true) => {
                let id = format!("toolu_{i}");
                self.msgs.push(json!({"role":"assistant","content":[{"type":"tool_use","id":id,"name":"lookup","input":{"q":reply}}]}));
                self.msgs.push(json!({"role":"user","content":[{"type":"tool_result","tool_use_id":id,"content":next}]}));
            }
            (_, false) => {
                self.msgs.push(json!({"role":"assistant","content":reply}));
                self.msgs.push(json!({"role":"user","content":next}));
            }
            (_, true) => {
                let id = format!("call_{i}");
                self.msgs.push(json!({"role":"assistant","content":null,"tool_calls":[{"id":id,"type":"function",
                    "function":{"name":"lookup","arguments":json!({"q":reply}).to_string()}}]}));
                self.msgs
                    .push(json!({"role":"tool","tool_call_id":id,"content":next}));
            }
        }
    }
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// Signed error in percent of the real count.
fn err(x: u64, real: u64) -> f64 {
    (x as f64 - real as f64) / real as f64 * 100.0
}

#[derive(Default)]
struct Errors {
    chars4: Vec<f64>,
    estimate: Vec<f64>,
    plain: Vec<f64>,
    projection: Vec<f64>,
}

fn summary(name: &str, xs: &[f64]) -> String {
    let mut a: Vec<f64> = xs.iter().map(|e| e.abs()).collect();
    a.sort_by(f64::total_cmp);
    if a.is_empty() {
        return format!("  {name:<11} (no turns)");
    }
    let median = if a.len() % 2 == 1 {
        a[a.len() / 2]
    } else {
        (a[a.len() / 2 - 1] + a[a.len() / 2]) / 2.0
    };
    let mean = a.iter().sum::<f64>() / a.len() as f64;
    let worst = a[a.len() - 1];
    format!("  {name:<11} median {median:6.2}%   mean {mean:6.2}%   worst {worst:6.2}%")
}

async fn session(
    client: &HttpClient,
    proxy: SocketAddr,
    estimator: &Estimator,
    api: Api,
    model: &'static str,
    turns: usize,
) -> Result<(), String> {
    let mut conv = Conv::new(api, model, 0x5eed);
    let key = format!("drift-{model}");
    println!("\n{} ({model}), {turns} turns, dense content", api.as_str());
    println!(
        "{:>4} {:>8} {:>11} {:>8} {:>8} {:>8} {:>10}",
        "turn", "real", "src", "chars/4", "estimate", "plain", "projection"
    );
    let mut prev: Option<(u64, u64)> = None; // (real, estimate) of the last turn
    let mut errs = Errors::default();
    for turn in 1..=turns {
        let body = conv.body().to_string();
        let est = estimator
            .estimate_body(api, body.as_bytes(), Some(model))
            .ok_or("the request is JSON")?;
        let req = Request::post(format!("http://{proxy}{}", conv.path()))
            .header("content-type", "application/json")
            .header("accept-encoding", "gzip")
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
            .ok_or("x-sim-prompt-tokens")?;
        let proj = h("x-context-projection").ok_or("x-context-projection")?;
        let mut parts = proj.split(';');
        let projection: u64 = parts
            .next()
            .and_then(|t| t.parse().ok())
            .ok_or("projection tokens")?;
        let src = parts
            .find_map(|p| p.strip_prefix("src="))
            .unwrap_or("?")
            .to_string();
        tokio::time::timeout(Duration::from_secs(60), resp.into_body().collect())
            .await
            .map_err(|_| "body timed out")?
            .map_err(|e| e.to_string())?;
        if !status.is_success() {
            return Err(format!("turn {turn}: status {status}"));
        }
        let chars4 = est.chars / 4;
        let plain = prev.map(|(r, e)| (r as i64 + est.tokens as i64 - e as i64).max(0) as u64);
        let cell = |x: Option<u64>| match x {
            Some(x) => format!("{:+7.2}%", err(x, real)),
            None => format!("{:>8}", "-"),
        };
        println!(
            "{turn:>4} {real:>8} {src:>11} {} {} {} {:>9}",
            cell(Some(chars4)),
            cell(Some(est.tokens)),
            cell(plain),
            cell(Some(projection)),
        );
        if turn >= 3 {
            errs.chars4.push(err(chars4, real));
            errs.estimate.push(err(est.tokens, real));
            if let Some(p) = plain {
                errs.plain.push(err(p, real));
            }
            errs.projection.push(err(projection, real));
        }
        prev = Some((real, est.tokens));
        conv.advance();
    }
    println!("absolute error from turn 3:");
    println!("{}", summary("chars/4", &errs.chars4));
    println!("{}", summary("estimate", &errs.estimate));
    println!("{}", summary("plain", &errs.plain));
    println!("{}", summary("projection", &errs.projection));
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), String> {
    let turns: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(30);
    let sim_l = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let sim_url = format!("http://{}", sim_l.local_addr().map_err(|e| e.to_string())?);
    let (sim_stop, sim_stopped) = oneshot::channel::<()>();
    tokio::spawn(sim::serve(
        sim_l,
        SimConfig {
            gzip: true,
            ..Default::default()
        },
        async move {
            let _ = sim_stopped.await;
        },
    ));

    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let admin = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let proxy = listener.local_addr().map_err(|e| e.to_string())?;
    let route = format!("/v1/messages={sim_url}");
    let config = tidemark::Config::from_args([
        "tidemark",
        "--upstream",
        sim_url.as_str(),
        "--route",
        route.as_str(),
    ])?;
    let (stop, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(tidemark::run(listener, admin, config, async move {
        let _ = stopped.await;
    }));

    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let estimator = Estimator::new(64 << 20);
    let mut result = Ok(());
    for (api, model) in [
        (Api::OpenAiChat, "gpt-4o"),
        (Api::Anthropic, "claude-sonnet-4-5"),
    ] {
        if let Err(e) = session(&client, proxy, &estimator, api, model, turns).await {
            result = Err(format!("{}: {e}", api.as_str()));
            break;
        }
    }
    let _ = stop.send(());
    let _ = server.await;
    let _ = sim_stop.send(());
    result
}
