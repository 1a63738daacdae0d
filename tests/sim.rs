//! The simulated provider: its counts are deterministic and its own (not
//! tidemark's tokenizer), its wire formats have the shape of the recorded
//! fixtures, and its faults look like the real APIs' faults.

use std::collections::BTreeSet;
use std::io::Read;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tidemark::sim::{self, count_prompt, SimApi, SimConfig, X_SIM_PROMPT_TOKENS};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// Fail the test instead of hanging.
async fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("timed out waiting")
}

const FIX: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

fn fixture(p: &str) -> String {
    std::fs::read_to_string(format!("{FIX}/{p}")).expect("fixture")
}

struct Sim {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

async fn start(cfg: SimConfig) -> Sim {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(sim::serve(l, cfg, async move {
        let _ = rx.await;
    }));
    Sim { addr, _stop: tx }
}

struct Resp {
    status: u16,
    headers: HeaderMap,
    body: Bytes,
}

impl Resp {
    fn sim_count(&self) -> u64 {
        self.headers
            .get(X_SIM_PROMPT_TOKENS)
            .expect("x-sim-prompt-tokens")
            .to_str()
            .unwrap()
            .parse()
            .unwrap()
    }
    fn text(&self) -> String {
        String::from_utf8(self.body.to_vec()).expect("utf-8 body")
    }
}

async fn post(addr: SocketAddr, path: &str, body: &Value, gzip: bool) -> Resp {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut req =
        Request::post(format!("http://{addr}{path}")).header("content-type", "application/json");
    if gzip {
        req = req.header("accept-encoding", "gzip");
    }
    let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
    within(20, async {
        let r = client.request(req).await.expect("request");
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let body = r.into_body().collect().await.expect("body").to_bytes();
        Resp {
            status,
            headers,
            body,
        }
    })
    .await
}

fn cl100k(s: &str) -> u64 {
    tiktoken_rs::cl100k_base().unwrap().encode_ordinary(s).len() as u64
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

/// `(event name, data JSON)` for every SSE event carrying JSON data.
fn sse_events(text: &str) -> Vec<(Option<String>, Value)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut ev = None;
        let mut data = None;
        for line in block.lines() {
            if let Some(e) = line.strip_prefix("event: ") {
                ev = Some(e.to_string());
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(d.to_string());
            }
        }
        if let Some(d) = data {
            if d != "[DONE]" {
                out.push((ev, serde_json::from_str(&d).expect("event data is JSON")));
            }
        }
    }
    out
}

fn openai_req(stream: bool, include_usage: bool) -> Value {
    let mut v = json!({"model":"gpt-4o","stream":stream,"messages":[
        {"role":"system","content":"You are terse."},
        {"role":"user","content":"Explain the failure 🚀 上下文窗口的大小决定了模型一次能看到多少内容。"}]});
    if include_usage {
        v["stream_options"] = json!({"include_usage": true});
    }
    v
}

fn anthropic_req(stream: bool) -> Value {
    json!({"model":"claude-sonnet-4-5","max_tokens":256,"stream":stream,"system":"You are terse.",
        "messages":[{"role":"user","content":"コンテキストが上限に近づいたら、古いターンを要約してください。 {\"a\":[1,2,3]}"}]})
}

#[test]
fn counts_are_deterministic_and_follow_the_documented_framing() {
    let text = "hello world, 日本語のテキスト 🚀";
    let oa = json!({"model":"gpt-4o","messages":[{"role":"user","content":text}]});
    let c = count_prompt(SimApi::OpenAiChat, &oa);
    // 3 per request, 4 per message, the role and the content.
    assert_eq!(c.total, 3 + 4 + cl100k("user") + cl100k(text));
    assert_eq!(c, count_prompt(SimApi::OpenAiChat, &oa));

    let an = json!({"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":text}]});
    let c = count_prompt(SimApi::Anthropic, &an);
    // 9 per request and 5 per message, then Anthropic's ratio (x1.15, rounded up).
    let scale = |n: u64| (n as f64 * 1.15).ceil() as u64;
    assert_eq!(c.total, scale(9) + scale(5 + cl100k(text)));

    // Tools add their JSON plus Anthropic's hidden tool-use system prompt.
    let mut with_tools = an.clone();
    with_tools["tools"] = json!([{"name":"t","input_schema":{"type":"object"}}]);
    let t = count_prompt(SimApi::Anthropic, &with_tools);
    assert!(t.total > c.total + 346, "{t:?} vs {c:?}");
}

#[test]
fn counts_differ_from_tidemarks_tokenizer() {
    // The drift the demo shows comes from a different real tokenizer.
    let cjk = "会话的锚点来自上一次响应中提供商报告的真实用量。".repeat(20);
    let o200k = tiktoken_rs::o200k_base()
        .unwrap()
        .encode_ordinary(&cjk)
        .len() as u64;
    let body = json!({"messages":[{"role":"user","content":cjk}]});
    let sim = count_prompt(SimApi::OpenAiChat, &body).total;
    assert!(
        sim as f64 > o200k as f64 * 1.15,
        "sim {sim} vs o200k {o200k}"
    );
}

#[tokio::test]
async fn openai_stream_without_usage_option_sends_no_usage() {
    let s = start(SimConfig::default()).await;
    let req = openai_req(true, false);
    let r = post(s.addr, "/v1/chat/completions", &req, false).await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(r.sim_count(), count_prompt(SimApi::OpenAiChat, &req).total);
    let text = r.text();
    assert!(text.ends_with("data: [DONE]\n\n"));
    let evs = sse_events(&text);
    assert!(evs.len() >= 3);
    // Same member set as the recorded stream without usage.
    let fx = sse_events(&fixture("openai-chat/stream_no_usage.sse"));
    for (_, e) in &evs {
        assert_eq!(keys(e), keys(&fx[0].1), "{e}");
        assert_eq!(e["object"], "chat.completion.chunk");
    }
    let content: String = evs
        .iter()
        .filter_map(|(_, e)| e.pointer("/choices/0/delta/content")?.as_str())
        .collect();
    assert!(!content.is_empty());
    assert_eq!(
        evs.last().unwrap().1.pointer("/choices/0/finish_reason"),
        Some(&json!("stop"))
    );
}

#[tokio::test]
async fn openai_stream_with_usage_matches_the_fixture_shape() {
    let s = start(SimConfig::default()).await;
    let req = openai_req(true, true);
    let r = post(s.addr, "/v1/chat/completions", &req, false).await;
    let evs = sse_events(&r.text());
    let fx = sse_events(&fixture("openai-chat/stream_basic_with_usage.sse"));
    let ((_, last), rest) = evs.split_last().unwrap();
    for (_, e) in rest {
        assert_eq!(e["usage"], Value::Null, "every other chunk has usage:null");
        assert!(e.as_object().unwrap().contains_key("usage"));
    }
    assert_eq!(last["choices"], json!([]));
    let fu = &fx.last().unwrap().1["usage"];
    assert_eq!(keys(&last["usage"]), keys(fu));
    assert_eq!(
        keys(&last["usage"]["prompt_tokens_details"]),
        keys(&fu["prompt_tokens_details"])
    );
    assert_eq!(last["usage"]["prompt_tokens"], json!(r.sim_count()));
    let u = &last["usage"];
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );
}

#[tokio::test]
async fn openai_non_stream_body() {
    let s = start(SimConfig::default()).await;
    let req = openai_req(false, false);
    let r = post(s.addr, "/v1/chat/completions", &req, false).await;
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let fx: Value = serde_json::from_str(&fixture("openai-chat/nonstream_basic.json")).unwrap();
    assert_eq!(keys(&v), keys(&fx));
    assert_eq!(keys(&v["usage"]), keys(&fx["usage"]));
    assert_eq!(v["usage"]["prompt_tokens"], json!(r.sim_count()));
    assert_eq!(v["object"], "chat.completion");
    assert!(v.pointer("/choices/0/message/content").unwrap().is_string());
}

#[tokio::test]
async fn openai_tool_call_streams_as_deltas() {
    let s = start(SimConfig::default()).await;
    let mut req = openai_req(true, false);
    req["tools"] = json!([{"type":"function","function":{"name":"read_file","parameters":{"type":"object","properties":{"path":{"type":"string"}},"required":["path"]}}}]);
    let r = post(s.addr, "/v1/chat/completions", &req, false).await;
    let evs = sse_events(&r.text());
    let first = evs[0].1.pointer("/choices/0/delta/tool_calls/0").unwrap();
    assert_eq!(first["function"]["name"], "read_file");
    assert!(first["id"].as_str().unwrap().starts_with("call_"));
    let args: String = evs
        .iter()
        .filter_map(|(_, e)| {
            e.pointer("/choices/0/delta/tool_calls/0/function/arguments")?
                .as_str()
        })
        .collect();
    let args: Value = serde_json::from_str(&args).expect("arguments assemble to JSON");
    assert!(args["path"].is_string());
    assert_eq!(
        evs.last().unwrap().1.pointer("/choices/0/finish_reason"),
        Some(&json!("tool_calls"))
    );
}

#[tokio::test]
async fn anthropic_stream_matches_the_fixture_shape() {
    let s = start(SimConfig::default()).await;
    let req = anthropic_req(true);
    let r = post(s.addr, "/v1/messages", &req, false).await;
    assert_eq!(r.status, 200);
    let evs = sse_events(&r.text());
    let fx = sse_events(&fixture("anthropic-messages/stream_basic.sse"));
    let names: Vec<_> = evs.iter().map(|(n, _)| n.clone().unwrap()).collect();
    assert_eq!(names.first().map(String::as_str), Some("message_start"));
    assert_eq!(
        &names[names.len() - 2..],
        ["message_delta".to_string(), "message_stop".to_string()]
    );
    for (n, e) in &evs {
        assert_eq!(e["type"].as_str(), n.as_deref(), "event name = data.type");
    }
    let u = &evs[0].1["message"]["usage"];
    assert_eq!(keys(u), keys(&fx[0].1["message"]["usage"]));
    assert_eq!(keys(&evs[0].1["message"]), keys(&fx[0].1["message"]));
    let total = u["input_tokens"].as_u64().unwrap()
        + u["cache_creation_input_tokens"].as_u64().unwrap()
        + u["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(total, r.sim_count());
    assert_eq!(total, count_prompt(SimApi::Anthropic, &req).total);
    let delta = &evs[evs.len() - 2].1;
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
}

#[tokio::test]
async fn anthropic_cache_writes_at_the_breakpoint_then_reads_it() {
    let s = start(SimConfig::default()).await;
    let mut req = anthropic_req(false);
    let long = "Follow every rule of the repository carefully. ".repeat(200);
    req["system"] = json!([{"type":"text","text":long,"cache_control":{"type":"ephemeral"}}]);
    let r = post(s.addr, "/v1/messages", &req, false).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let fx: Value =
        serde_json::from_str(&fixture("anthropic-messages/nonstream_basic.json")).unwrap();
    assert_eq!(keys(&v), keys(&fx));
    let sum = |u: &Value| {
        u["input_tokens"].as_u64().unwrap()
            + u["cache_creation_input_tokens"].as_u64().unwrap()
            + u["cache_read_input_tokens"].as_u64().unwrap()
    };
    let u = &v["usage"];
    let written = u["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(written > 1024, "{u}");
    assert_eq!(u["cache_read_input_tokens"], 0, "nothing cached yet");
    assert_eq!(sum(u), r.sim_count(), "the real prompt is the sum");

    // The next turn reads what the first wrote.
    req["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role":"assistant","content":"Done."}));
    req["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role":"user","content":"And now?"}));
    let r = post(s.addr, "/v1/messages", &req, false).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let u = &v["usage"];
    assert_eq!(u["cache_read_input_tokens"], json!(written), "{u}");
    assert_eq!(
        u["cache_creation_input_tokens"], 0,
        "no breakpoint after the system"
    );
    assert_eq!(sum(u), r.sim_count());
}

#[tokio::test]
async fn anthropic_gzip_stream_and_count_tokens() {
    let s = start(SimConfig {
        gzip: true,
        ..SimConfig::default()
    })
    .await;
    let req = anthropic_req(true);
    let r = post(s.addr, "/v1/messages", &req, true).await;
    assert_eq!(r.headers["content-encoding"], "gzip");
    let mut text = String::new();
    flate2::read::GzDecoder::new(&r.body[..])
        .read_to_string(&mut text)
        .unwrap();
    assert!(sse_events(&text).len() > 4);
    // No gzip unless the client accepts it.
    let plain = post(s.addr, "/v1/messages", &req, false).await;
    assert!(plain.headers.get("content-encoding").is_none());

    let mut ct = anthropic_req(false);
    ct.as_object_mut().unwrap().remove("stream");
    ct.as_object_mut().unwrap().remove("max_tokens");
    let c = post(s.addr, "/v1/messages/count_tokens", &ct, false).await;
    let v: Value = serde_json::from_slice(&c.body).unwrap();
    let fx: Value =
        serde_json::from_str(&fixture("anthropic-messages/count_tokens_response.json")).unwrap();
    assert_eq!(keys(&v), keys(&fx));
    assert_eq!(v["input_tokens"], json!(r.sim_count()));
}

#[tokio::test]
async fn over_the_window_is_the_providers_own_400() {
    let s = start(SimConfig {
        context_window: Some(20),
        ..SimConfig::default()
    })
    .await;
    let req = openai_req(true, false);
    let r = post(s.addr, "/v1/chat/completions", &req, false).await;
    assert_eq!(r.status, 400);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let fx: Value =
        serde_json::from_str(&fixture("openai-chat/error_context_length_exceeded.json")).unwrap();
    assert_eq!(keys(&v["error"]), keys(&fx["error"]));
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let n = r.sim_count();
    assert!(v["error"]["message"].as_str().unwrap().contains(&format!(
        "maximum context length is 20 tokens. However, your messages resulted in {n} tokens"
    )));

    let r = post(s.addr, "/v1/messages", &anthropic_req(true), false).await;
    assert_eq!(r.status, 400);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let fx: Value =
        serde_json::from_str(&fixture("anthropic-messages/error_prompt_too_long.json")).unwrap();
    assert_eq!(v["type"], fx["type"]);
    assert_eq!(v["error"]["type"], fx["error"]["type"]);
    assert_eq!(
        v["error"]["message"],
        json!(format!(
            "prompt is too long: {} tokens > 20 maximum",
            r.sim_count()
        ))
    );
}

#[tokio::test]
async fn faults_omit_usage_fail_and_abort() {
    let s = start(SimConfig {
        omit_usage_every: Some(2),
        ..SimConfig::default()
    })
    .await;
    let req = anthropic_req(true);
    let first = sse_events(&post(s.addr, "/v1/messages", &req, false).await.text());
    assert!(first[0].1["message"].get("usage").is_some());
    let second = sse_events(&post(s.addr, "/v1/messages", &req, false).await.text());
    assert!(second[0].1["message"].get("usage").is_none());
    assert!(second.iter().all(|(_, e)| e.get("usage").is_none()));

    let s = start(SimConfig {
        fail_status: Some(529),
        ..SimConfig::default()
    })
    .await;
    let r = post(s.addr, "/v1/messages", &req, false).await;
    assert_eq!(r.status, 529);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let fx: Value =
        serde_json::from_str(&fixture("anthropic-messages/error_overloaded.json")).unwrap();
    assert_eq!(v["error"]["type"], fx["error"]["type"]);

    let s = start(SimConfig {
        abort_after_events: Some(2),
        chunk_delay: Duration::from_millis(1),
        ..SimConfig::default()
    })
    .await;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let r = within(20, async {
        let resp = client
            .request(
                Request::post(format!("http://{}/v1/messages", s.addr))
                    .body(Full::new(Bytes::from(req.to_string())))
                    .unwrap(),
            )
            .await
            .unwrap();
        resp.into_body().collect().await
    })
    .await;
    assert!(r.is_err(), "the stream is cut, not ended cleanly");
}
