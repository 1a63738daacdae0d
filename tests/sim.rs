//! The simulated provider: its counts are deterministic and its own (not
//! tidemark's tokenizer), its wire formats have the shape of the recorded
//! fixtures, and its faults look like the real APIs' faults. The tests
//! that name the proxy run the real proxy in front of it.
mod support;

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
use tidemark::sim::{count_prompt, Accounting, Flavour, SimApi, SimConfig, X_SIM_PROMPT_TOKENS};

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
    _sim: support::Sim,
}

async fn start(cfg: SimConfig) -> Sim {
    start_counted(cfg).await.0
}

/// A sim and its cache accounting.
async fn start_counted(cfg: SimConfig) -> (Sim, Accounting) {
    let s = support::sim(cfg).await;
    let acct = s.acct.clone();
    (
        Sim {
            addr: s.addr,
            _sim: s,
        },
        acct,
    )
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
    let h: &[(&str, &str)] = if gzip {
        &[("accept-encoding", "gzip")]
    } else {
        &[]
    };
    post_with(addr, path, body, h).await
}

async fn post_with(addr: SocketAddr, path: &str, body: &Value, headers: &[(&str, &str)]) -> Resp {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut req =
        Request::post(format!("http://{addr}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
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

fn p50k(s: &str) -> u64 {
    tiktoken_rs::p50k_base().unwrap().encode_ordinary(s).len() as u64
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
    // 9 per request and 5 per message, in p50k_base (the honest column).
    assert_eq!(c.total, 9 + 5 + p50k(text));
    // The column first written: cl100k_base times 1.15, rounded up.
    let today = tidemark::sim::count_prompt_with(
        SimApi::Anthropic,
        &an,
        tidemark::sim::CountingMode::Today,
    );
    let scale = |n: u64| (n as f64 * 1.15).ceil() as u64;
    assert_eq!(today.total, scale(9) + scale(5 + cl100k(text)));

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
    // One request asks for a response without usage.
    let s = start(SimConfig::default()).await;
    let h = [(tidemark::sim::X_SIM_OMIT_USAGE, "1")];
    let asked = sse_events(&post_with(s.addr, "/v1/messages", &req, &h).await.text());
    assert!(asked[0].1["message"].get("usage").is_none());
    assert!(asked.iter().all(|(_, e)| e.get("usage").is_none()));
    let next = sse_events(&post(s.addr, "/v1/messages", &req, false).await.text());
    assert!(next[0].1["message"].get("usage").is_some());

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

/// `x-sim-fault` breaks one request of a well-behaved sim: a reset after N
/// events, a stall after N events (counted as abandoned once the client
/// leaves), a hang before the headers, a paced stream; the next request
/// without the header is whole, and every fault keeps the sim's own count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_request_faults_reset_stall_hang_and_pace() {
    let s = support::sim(SimConfig::default()).await;
    let req = anthropic_req(true);
    let whole = post(s.addr, "/v1/messages", &req, false).await;
    let events = whole.text().matches("\n\n").count();
    assert!(events > 4, "a stream with events to cut");
    let open = |fault: &'static str| {
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
        let req = Request::post(format!("{}/v1/messages", s.url))
            .header(tidemark::sim::X_SIM_FAULT, fault)
            .body(Full::new(Bytes::from(req.to_string())))
            .unwrap();
        async move { client.request(req).await }
    };
    // Reset after two events: the first two events, then an error.
    let resp = within(20, open("reset-after=2")).await.unwrap();
    assert_eq!(
        resp.headers()[X_SIM_PROMPT_TOKENS],
        whole.sim_count().to_string()
    );
    let mut body = resp.into_body();
    let mut got = Vec::new();
    let errored = within(20, async {
        loop {
            match body.frame().await {
                Some(Ok(f)) => got.extend_from_slice(f.data_ref().map_or(&[][..], |d| &d[..])),
                Some(Err(_)) => break true,
                None => break false,
            }
        }
    })
    .await;
    assert!(errored, "a reset stream does not end cleanly");
    // The same events as the whole stream's first two (its own message id).
    let got = String::from_utf8(got).unwrap();
    let want: String = whole.text().split_inclusive("\n\n").take(2).collect();
    assert_eq!(got.matches("\n\n").count(), 2, "{got}");
    assert_eq!(
        got.replace("msg_sim0000000000000002", "msg_sim0000000000000001"),
        want,
        "the events before the reset"
    );
    // Stall after one event: the event comes, then silence; leaving counts.
    let resp = within(20, open("stall-after=1")).await.unwrap();
    let mut body = resp.into_body();
    let first = within(20, body.frame()).await.unwrap().unwrap();
    assert!(first.is_data());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), body.frame())
            .await
            .is_err(),
        "silence after the first event"
    );
    assert_eq!(s.abandoned.count(), 0);
    drop(body);
    within(10, s.abandoned.reach(1)).await;
    // Hang: no headers at all; the client giving up counts.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), open("hang"))
            .await
            .is_err()
    );
    within(10, s.abandoned.reach(2)).await;
    // Pace: the whole stream, each event after the pause.
    let t = std::time::Instant::now();
    let paced = post_with(
        s.addr,
        "/v1/messages",
        &req,
        &[(tidemark::sim::X_SIM_FAULT, "pace=40")],
    )
    .await;
    assert!(t.elapsed() >= Duration::from_millis(40 * (events as u64 - 1)));
    assert_eq!(paced.sim_count(), whole.sim_count());
    assert_eq!(paced.text().matches("\n\n").count(), events);
    // The next request without the header is whole.
    let next = post(s.addr, "/v1/messages", &req, false).await;
    assert_eq!(next.text().matches("\n\n").count(), events);
}

// ---------------------------------------------------------------------------
// The other three APIs, straight from the sim.

fn responses_req(stream: bool) -> Value {
    json!({"model":"gpt-5","stream":stream,"instructions":"You are terse.",
        "input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"Explain the failure 🚀 上下文窗口的大小决定了模型一次能看到多少内容。"}]}]})
}

fn gemini_req() -> Value {
    json!({"systemInstruction":{"parts":[{"text":"You are terse."}]},
        "contents":[{"role":"user","parts":[{"text":"コンテキストが上限に近づいたら、古いターンを要約してください。"}]}]})
}

fn ollama_req(stream: bool) -> Value {
    json!({"model":"llama3.2","stream":stream,"messages":[
        {"role":"system","content":"You are terse."},
        {"role":"user","content":"Explain the failure 🚀 {\"a\":[1,2,3]}"}]})
}

/// The event types of a stream, deltas folded into one.
fn event_types(evs: &[(Option<String>, Value)]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (_, e) in evs {
        let t = e["type"].as_str().unwrap().to_string();
        if out.last() != Some(&t) {
            out.push(t);
        }
    }
    out
}

#[tokio::test]
async fn responses_stream_and_body_match_the_fixture_shape() {
    let s = start(SimConfig::default()).await;
    let req = responses_req(true);
    let r = post(s.addr, "/v1/responses", &req, false).await;
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = r.text();
    assert!(!text.contains("[DONE]"));
    let evs = sse_events(&text);
    let fx = sse_events(&fixture("openai-responses/stream_basic.sse"));
    assert_eq!(event_types(&evs), event_types(&fx));
    for (i, (name, e)) in evs.iter().enumerate() {
        assert_eq!(
            name.as_deref(),
            e["type"].as_str(),
            "event name = data.type"
        );
        assert_eq!(e["sequence_number"], json!(i));
        assert_eq!(
            keys(e),
            keys(&fx.iter().find(|f| f.1["type"] == e["type"]).unwrap().1)
        );
    }
    let done = &evs.last().unwrap().1["response"];
    let fdone = &fx.last().unwrap().1["response"];
    assert_eq!(keys(done), keys(fdone));
    assert_eq!(keys(&done["usage"]), keys(&fdone["usage"]));
    assert_eq!(done["usage"]["input_tokens"], json!(r.sim_count()));
    assert_eq!(
        r.sim_count(),
        count_prompt(SimApi::OpenAiResponses, &req).total
    );
    assert_eq!(evs[0].1["response"]["usage"], Value::Null);

    let r = post(s.addr, "/v1/responses", &responses_req(false), false).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let fx: Value =
        serde_json::from_str(&fixture("openai-responses/nonstream_basic.json")).unwrap();
    assert_eq!(keys(&v), keys(&fx));
    assert_eq!(v["status"], "completed");
    assert_eq!(v["usage"]["input_tokens"], json!(r.sim_count()));
    assert!(v.pointer("/output/0/content/0/text").unwrap().is_string());

    // The counting endpoint agrees.
    let c = post(
        s.addr,
        "/v1/responses/input_tokens",
        &responses_req(false),
        false,
    )
    .await;
    let cv: Value = serde_json::from_slice(&c.body).unwrap();
    assert_eq!(cv["object"], "response.input_tokens");
    assert_eq!(cv["input_tokens"], json!(r.sim_count()));
}

#[tokio::test]
async fn responses_continue_a_stored_conversation() {
    let s = start(SimConfig::default()).await;
    let first = responses_req(false);
    let r = post(s.addr, "/v1/responses", &first, false).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let id = v["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("resp_"));
    let next = json!({"type":"message","role":"user","content":[{"type":"input_text","text":"And then?"}]});
    let cont = json!({"model":"gpt-5","instructions":"You are terse.","previous_response_id":id,"input":[next]});
    let r2 = post(s.addr, "/v1/responses", &cont, false).await;
    assert_eq!(r2.status, 200, "{}", r2.text());
    // The provider counts the whole conversation: first input, its output, the new input.
    let mut items = first["input"].as_array().unwrap().clone();
    items.extend(v["output"].as_array().unwrap().iter().cloned());
    items.push(next.clone());
    let whole = json!({"model":"gpt-5","instructions":"You are terse.","input":items});
    assert_eq!(
        r2.sim_count(),
        count_prompt(SimApi::OpenAiResponses, &whole).total
    );
    assert!(r2.sim_count() > r.sim_count());

    // store:false is not kept.
    let mut unstored = responses_req(false);
    unstored["store"] = json!(false);
    let r = post(s.addr, "/v1/responses", &unstored, false).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let gone = json!({"model":"gpt-5","previous_response_id":v["id"],"input":[next]});
    let r = post(s.addr, "/v1/responses", &gone, false).await;
    assert_eq!(r.status, 400);
    let e: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(e["error"]["code"], "previous_response_not_found");
    assert_eq!(e["error"]["param"], "previous_response_id");
}

#[tokio::test]
async fn gemini_sse_array_and_body_match_the_fixture_shape() {
    let s = start(SimConfig::default()).await;
    let req = gemini_req();
    let n = count_prompt(SimApi::Gemini, &req).total;
    let path = "/v1beta/models/gemini-2.5-flash";
    let r = post(
        s.addr,
        &format!("{path}:streamGenerateContent?alt=sse"),
        &req,
        false,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.sim_count(), n);
    let text = r.text();
    assert!(
        text.ends_with("\r\n\r\n") && !text.contains("[DONE]"),
        "CRLF framing"
    );
    assert!(text.contains("\"promptTokenCount\": "), "Google's spacing");
    let evs = sse_events(&text.replace("\r\n", "\n"));
    let fx = sse_events(&fixture("gemini/stream_basic.sse").replace("\r\n", "\n"));
    assert!(evs.len() > 1);
    let mut candidates = 0;
    for (_, e) in &evs {
        assert_eq!(keys(e), keys(&fx[0].1));
        let u = &e["usageMetadata"];
        assert_eq!(u["promptTokenCount"], json!(n));
        let c = u["candidatesTokenCount"].as_u64().unwrap();
        assert!(c >= candidates, "cumulative");
        candidates = c;
    }
    assert_eq!(
        evs.last().unwrap().1.pointer("/candidates/0/finishReason"),
        Some(&json!("STOP"))
    );

    // Without alt=sse: one JSON array.
    let r = post(
        s.addr,
        &format!("{path}:streamGenerateContent"),
        &req,
        false,
    )
    .await;
    let arr: Value = serde_json::from_slice(&r.body).expect("a JSON array");
    assert_eq!(arr.as_array().unwrap().len(), evs.len());

    let r = post(s.addr, &format!("{path}:generateContent"), &req, false).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let fx: Value = serde_json::from_str(&fixture("gemini/nonstream_basic.json")).unwrap();
    assert_eq!(keys(&v), keys(&fx));
    assert_eq!(keys(&v["usageMetadata"]), keys(&fx["usageMetadata"]));
    assert_eq!(v["usageMetadata"]["promptTokenCount"], json!(n));

    let wrapped = json!({"generateContentRequest":{"model":"models/gemini-2.5-flash","contents":req["contents"],"systemInstruction":req["systemInstruction"]}});
    let c = post(s.addr, &format!("{path}:countTokens"), &wrapped, false).await;
    let cv: Value = serde_json::from_slice(&c.body).unwrap();
    assert_eq!(cv["totalTokens"], json!(n));
}

#[tokio::test]
async fn ollama_ndjson_and_body_match_the_fixture_shape() {
    let s = start(SimConfig::default()).await;
    let req = ollama_req(true);
    let n = count_prompt(SimApi::Ollama, &req).total;
    let r = post(s.addr, "/api/chat", &req, false).await;
    assert_eq!(r.headers["content-type"], "application/x-ndjson");
    assert_eq!(r.sim_count(), n);
    let lines: Vec<Value> = r
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object a line"))
        .collect();
    let fx: Vec<Value> = fixture("ollama/api_chat_stream.ndjson")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (last, rest) = lines.split_last().unwrap();
    for l in rest {
        assert_eq!(keys(l), keys(&fx[0]));
        assert_eq!(l["done"], false);
    }
    assert_eq!(keys(last), keys(fx.last().unwrap()));
    assert_eq!(last["prompt_eval_count"], json!(n));

    let r = post(s.addr, "/api/chat", &ollama_req(false), false).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let fx: Value = serde_json::from_str(&fixture("ollama/api_chat_nonstream.json")).unwrap();
    assert_eq!(keys(&v), keys(&fx));
    assert!(v["message"]["content"].as_str().unwrap().len() > 10);
}

#[test]
fn the_honest_column_never_uses_the_estimators_encoding() {
    use tidemark::sim::{counting, CountingMode, COUNTING};
    for (api, today, honest) in COUNTING {
        let estimator = tidemark::estimate::Encoding::for_model(api, None).name();
        assert_ne!(honest.encoding.name(), estimator, "{api:?}");
        assert_eq!(honest.ratio, 1.0, "never a scaled copy: {api:?}");
        assert_eq!(counting(api, CountingMode::Honest), honest);
        assert_eq!(counting(api, CountingMode::Today), today);
        if !matches!(api, SimApi::OpenAiChat | SimApi::Anthropic) {
            assert_eq!(today, honest, "new APIs count honestly already: {api:?}");
        }
    }
    // The honest column is what a sim, the demo and the accuracy table count with.
    assert_eq!(SimConfig::default().counting, CountingMode::Honest);
    let body = serde_json::json!({"model":"claude-sonnet-4-5","max_tokens":8,
        "messages":[{"role":"user","content":"上下文窗口的大小决定了模型一次能看到多少内容。"}]});
    assert_eq!(
        tidemark::sim::count_prompt(SimApi::Anthropic, &body),
        tidemark::sim::count_prompt_with(SimApi::Anthropic, &body, CountingMode::Honest)
    );
}

// ---------------------------------------------------------------------------
// Through the real proxy: what tidemark anchors on is the sim's own count.

/// (api, path, body) of one turn of each API, streamed or not.
fn one_turn_of_each(stream: bool) -> Vec<(&'static str, String, Value)> {
    let g = "/v1beta/models/gemini-2.5-flash";
    let gemini_path = if stream {
        format!("{g}:streamGenerateContent?alt=sse")
    } else {
        format!("{g}:generateContent")
    };
    vec![
        (
            "openai-chat",
            "/v1/chat/completions".into(),
            openai_req(stream, false),
        ),
        ("anthropic", "/v1/messages".into(), anthropic_req(stream)),
        ("responses", "/v1/responses".into(), responses_req(stream)),
        ("gemini", gemini_path, gemini_req()),
        ("ollama", "/api/chat".into(), ollama_req(stream)),
    ]
}

async fn admin(url: &str) -> Value {
    let c = support::client_h1();
    let (parts, body) = support::get(&c, url).await;
    assert_eq!(parts.status, 200, "{url}");
    serde_json::from_slice(&body).expect("admin JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_proxy_every_api_anchors_on_the_sims_count() {
    let s = start(SimConfig::default()).await;
    let url = format!("http://{}", s.addr);
    let route = format!("/v1/messages={url}");
    let px = support::proxy(&url, &["--route", &route]).await;
    for stream in [false, true] {
        for (name, path, body) in one_turn_of_each(stream) {
            let key = format!("anchor-{name}-{stream}");
            let r = post_with(
                px.addr,
                &path,
                &body,
                &[("x-session-id", &key), ("authorization", "Bearer sk-test")],
            )
            .await;
            assert_eq!(r.status, 200, "{name} {stream}: {}", r.text());
            let sess = admin(&px.admin_url(&format!("/sessions/{key}"))).await;
            assert_eq!(
                sess["anchor"]["real"],
                json!(r.sim_count()),
                "{name} stream={stream}: {sess}"
            );
        }
    }
    // Gemini's streamed array (no alt=sse) too.
    let key = "anchor-gemini-array";
    let r = post_with(
        px.addr,
        "/v1beta/models/gemini-2.5-flash:streamGenerateContent",
        &gemini_req(),
        &[("x-session-id", key)],
    )
    .await;
    let sess = admin(&px.admin_url(&format!("/sessions/{key}"))).await;
    assert_eq!(sess["anchor"]["real"], json!(r.sim_count()), "{sess}");
    px.stop().await;
}

// ---------------------------------------------------------------------------
// Context-length errors, in each provider's words.

#[tokio::test]
async fn context_length_errors_in_each_providers_words() {
    let small = |flavour| SimConfig {
        context_window: Some(20),
        flavour,
        ..SimConfig::default()
    };
    let body = |v: &Resp| -> Value { serde_json::from_slice(&v.body).unwrap() };

    // vLLM: prompt + max_tokens against max_model_len; the prompt it names
    // is the tokenizer's cut-off, a lower bound.
    let s = start(small(Flavour::Vllm)).await;
    let mut req = openai_req(false, false);
    req["max_tokens"] = json!(10);
    let r = post(s.addr, "/v1/chat/completions", &req, false).await;
    assert_eq!(r.status, 400);
    let e = body(&r);
    assert_eq!(
        keys(&e["error"]),
        keys(&json!({"message":0,"type":0,"param":0,"code":0}))
    );
    assert_eq!(e["error"]["type"], "BadRequestError");
    assert_eq!(e["error"]["code"], 400, "vLLM's code is the HTTP status");
    assert_eq!(e["error"]["param"], "input_tokens");
    assert_eq!(
        e["error"]["message"],
        "This model's maximum context length is 20 tokens. However, you requested 10 output tokens and your prompt contains at least 11 input tokens, for a total of at least 21 tokens. Please reduce the length of the input prompt or the number of requested output tokens. (parameter=input_tokens, value=11)"
    );

    // llama.cpp's llama-server: both counts, as fields and in the message.
    let s = start(small(Flavour::LlamaCpp)).await;
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &openai_req(false, false),
        false,
    )
    .await;
    assert_eq!(r.status, 400);
    let e = body(&r);
    let n = r.sim_count();
    assert_eq!(
        e,
        json!({"error":{"code":400,"type":"exceed_context_size_error","n_prompt_tokens":n,"n_ctx":20,
            "message":format!("request ({n} tokens) exceeds the available context size (20 tokens), try increasing it")}})
    );

    // Ollama (its /v1 and its own API): no error, the prompt is cut to fit.
    let s = start(small(Flavour::Ollama)).await;
    let r = post(
        s.addr,
        "/v1/chat/completions",
        &openai_req(false, false),
        false,
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(body(&r)["usage"]["prompt_tokens"], 20);
    assert!(count_prompt(SimApi::OpenAiChat, &openai_req(false, false)).total > 20);
    let s = start(SimConfig::default()).await;
    let mut long = ollama_req(false);
    long["messages"].as_array_mut().unwrap().insert(
        1,
        json!({"role":"user","content":"an old question ".repeat(40)}),
    );
    let full_n = count_prompt(SimApi::Ollama, &long).total;
    let kept = count_prompt(SimApi::Ollama, &ollama_req(false)).total;
    long["options"] = json!({"num_ctx": kept + 5});
    let r = post(s.addr, "/api/chat", &long, false).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        body(&r)["prompt_eval_count"],
        json!(kept),
        "the oldest message dropped ({full_n} did not fit)"
    );

    // Responses: no numbers; 400 without a stream, response.failed with one.
    let s = start(SimConfig {
        context_window: Some(20),
        ..SimConfig::default()
    })
    .await;
    let r = post(s.addr, "/v1/responses", &responses_req(false), false).await;
    assert_eq!(r.status, 400);
    let fx: Value = serde_json::from_str(&fixture(
        "openai-responses/error_context_length_exceeded.json",
    ))
    .unwrap();
    assert_eq!(body(&r), fx);
    let r = post(s.addr, "/v1/responses", &responses_req(true), false).await;
    assert_eq!(r.status, 200);
    let evs = sse_events(&r.text());
    let fx = sse_events(&fixture(
        "openai-responses/stream_failed_context_length.sse",
    ));
    assert_eq!(event_types(&evs), event_types(&fx));
    let failed = &evs.last().unwrap().1["response"];
    assert_eq!(failed["error"], fx.last().unwrap().1["response"]["error"]);
    assert_eq!(failed["usage"], Value::Null);

    // Gemini: INVALID_ARGUMENT with both numbers.
    let r = post(
        s.addr,
        "/v1beta/models/gemini-2.5-flash:generateContent",
        &gemini_req(),
        false,
    )
    .await;
    assert_eq!(r.status, 400);
    let e = body(&r);
    let fx: Value =
        serde_json::from_str(&fixture("gemini/error_input_token_count_exceeded.json")).unwrap();
    assert_eq!(keys(&e["error"]), keys(&fx["error"]));
    assert_eq!(e["error"]["status"], "INVALID_ARGUMENT");
    assert_eq!(
        e["error"]["message"],
        json!(format!(
            "The input token count ({}) exceeds the maximum number of tokens allowed (20).",
            r.sim_count()
        ))
    );
}

// ---------------------------------------------------------------------------
// Server-side context management: the count drops, the body does not.

/// An Anthropic conversation of `n` tool rounds with large results.
fn tool_rounds(n: usize) -> Value {
    let mut msgs = vec![json!({"role":"user","content":"Look through the logs."})];
    for i in 0..n {
        let id = format!("toolu_{i:04}");
        msgs.push(json!({"role":"assistant","content":[{"type":"tool_use","id":id,"name":"read_log","input":{"file":format!("log-{i}")}}]}));
        msgs.push(json!({"role":"user","content":[{"type":"tool_result","tool_use_id":id,
            "content":format!("line {i}: request took 312 ms, status 200, cache miss\n").repeat(40)}]}));
    }
    json!({"model":"claude-sonnet-4-5","max_tokens":256,"system":"You read logs.",
        "tools":[{"name":"read_log","input_schema":{"type":"object","properties":{"file":{"type":"string"}}}}],
        "messages":msgs})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_context_editing_drops_the_count_not_the_body() {
    let s = start(SimConfig::default()).await;
    let url = format!("http://{}", s.addr);
    let route = format!("/v1/messages={url}");
    let px = support::proxy(&url, &["--route", &route]).await;
    let h = [("x-session-id", "ctx-edit"), ("x-api-key", "sk-ant-edit")];
    let edits = json!({"edits":[{"type":"clear_tool_uses_20250919",
        "trigger":{"type":"input_tokens","value":3000},"keep":{"type":"tool_uses","value":1}}]});

    let mut t1 = tool_rounds(3);
    t1["context_management"] = edits.clone();
    let r1 = post_with(px.addr, "/v1/messages", &t1, &h).await;
    let v1: Value = serde_json::from_slice(&r1.body).unwrap();
    let plain1 = count_prompt(SimApi::Anthropic, &{
        let mut b = t1.clone();
        b.as_object_mut().unwrap().remove("context_management");
        b
    })
    .total;
    assert_eq!(r1.sim_count(), plain1, "under the trigger: nothing cleared");
    assert_eq!(v1["context_management"], json!({"applied_edits":[]}));

    let mut t2 = tool_rounds(6);
    t2["context_management"] = edits;
    t2["stream"] = json!(true);
    let r2 = post_with(px.addr, "/v1/messages", &t2, &h).await;
    let plain2 = count_prompt(SimApi::Anthropic, &tool_rounds(6)).total;
    assert!(plain2 > 3000);
    assert!(
        r2.sim_count() < r1.sim_count(),
        "{} then {}: the body grew, the count fell",
        r1.sim_count(),
        r2.sim_count()
    );
    let evs = sse_events(&r2.text());
    let delta = &evs
        .iter()
        .find(|(n, _)| n.as_deref() == Some("message_delta"))
        .unwrap()
        .1;
    let applied = &delta["context_management"]["applied_edits"][0];
    assert_eq!(applied["type"], "clear_tool_uses_20250919");
    assert_eq!(applied["cleared_tool_uses"], 5, "all but the newest one");
    assert_eq!(
        applied["cleared_input_tokens"],
        json!(plain2 - r2.sim_count())
    );
    let u = &evs[0].1["message"]["usage"];
    let reported = u["input_tokens"].as_u64().unwrap()
        + u["cache_read_input_tokens"].as_u64().unwrap()
        + u["cache_creation_input_tokens"].as_u64().unwrap();
    assert_eq!(reported, r2.sim_count());
    let sess = admin(&px.admin_url("/sessions/ctx-edit")).await;
    assert_eq!(sess["anchor"]["real"], json!(r2.sim_count()), "{sess}");
    // The provider's own edit re-anchors: no loss, no client compaction.
    assert_eq!(sess["state"], "anchored", "{sess}");
    assert_eq!(sess["compactions"], 0, "{sess}");
    assert_eq!(sess["anchor_losses"], 0, "{sess}");

    // count_tokens applies the same edits.
    let mut ct = t2.clone();
    ct.as_object_mut().unwrap().remove("stream");
    let c = post(s.addr, "/v1/messages/count_tokens", &ct, false).await;
    let cv: Value = serde_json::from_slice(&c.body).unwrap();
    assert_eq!(cv["input_tokens"], json!(r2.sim_count()));
    px.stop().await;
}

#[tokio::test]
async fn anthropic_clears_old_thinking_when_asked() {
    let s = start(SimConfig::default()).await;
    let think = |i: usize| {
        json!({"role":"assistant","content":[
        {"type":"thinking","thinking":"Let me think about the buffer. ".repeat(30),"signature":format!("sig{i}")},
        {"type":"text","text":"Done."}]})
    };
    let mut req = json!({"model":"claude-sonnet-4-5","max_tokens":256,"messages":[
        {"role":"user","content":"one"}, think(1), {"role":"user","content":"two"}, think(2),
        {"role":"user","content":"three"}]});
    let plain = count_prompt(SimApi::Anthropic, &req).total;
    req["context_management"] = json!({"edits":[{"type":"clear_thinking_20251015","keep":{"type":"thinking_turns","value":1}}]});
    let r = post(s.addr, "/v1/messages", &req, false).await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let a = &v["context_management"]["applied_edits"][0];
    assert_eq!(a["type"], "clear_thinking_20251015");
    assert_eq!(a["cleared_thinking_turns"], 1);
    assert_eq!(a["cleared_input_tokens"], json!(plain - r.sim_count()));
    assert!(r.sim_count() < plain);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_compaction_drops_the_count_not_the_body() {
    let s = start(SimConfig::default()).await;
    let url = format!("http://{}", s.addr);
    let px = support::proxy(&url, &[]).await;
    let h = [
        ("x-session-id", "compaction"),
        ("authorization", "Bearer sk-cmp"),
    ];
    let big = "Every request logs its latency and cache status. ".repeat(150);
    let cm = json!([{"type":"compaction","compact_threshold":1000}]);
    let t1 = json!({"model":"gpt-5","instructions":"You are terse.","store":false,"context_management":cm,
        "input":[{"type":"message","role":"user","content":[{"type":"input_text","text":big}]}]});
    let r1 = post_with(px.addr, "/v1/responses", &t1, &h).await;
    assert_eq!(r1.status, 200, "{}", r1.text());
    let v1: Value = serde_json::from_slice(&r1.body).unwrap();
    assert!(r1.sim_count() > 1000);
    assert_eq!(v1["output"][0]["type"], "compaction", "{v1}");
    assert!(v1["output"][0]["encrypted_content"].is_string());
    assert_eq!(v1["output"][1]["type"], "message");

    // Stateless chaining: the client sends everything back, compaction item included.
    let mut items = t1["input"].as_array().unwrap().clone();
    items.extend(v1["output"].as_array().unwrap().iter().cloned());
    items.push(json!({"type":"message","role":"user","content":[{"type":"input_text","text":"Summarise."}]}));
    let mut t2 = t1.clone();
    t2["input"] = Value::Array(items);
    t2["stream"] = json!(true);
    assert!(t2.to_string().len() > t1.to_string().len());
    let r2 = post_with(px.addr, "/v1/responses", &t2, &h).await;
    assert!(
        r2.sim_count() < r1.sim_count() / 2,
        "{} then {}",
        r1.sim_count(),
        r2.sim_count()
    );
    let done = sse_events(&r2.text()).last().unwrap().1.clone();
    assert_eq!(
        done["response"]["usage"]["input_tokens"],
        json!(r2.sim_count())
    );
    let sess = admin(&px.admin_url("/sessions/compaction")).await;
    assert_eq!(sess["anchor"]["real"], json!(r2.sim_count()), "{sess}");
    // The provider's compaction re-anchors: no loss, no client compaction.
    assert_eq!(sess["state"], "anchored", "{sess}");
    assert_eq!(sess["compactions"], 0, "{sess}");
    assert_eq!(sess["anchor_losses"], 0, "{sess}");
    px.stop().await;
}

// ---------------------------------------------------------------------------
// The prompt cache: what each API reports is what the accounting holds.

/// Turn `t` (1-based) of a conversation with a long system prompt, in one
/// API's shape; `edit` rewrites the first user message.
fn cached_turn(api: &str, t: usize, edit: bool) -> (String, Value) {
    let system = "Follow every rule of the repository carefully and cite the file. ".repeat(120);
    let first = if edit {
        "Read the logs, then fix it."
    } else {
        "Read the logs."
    };
    let mut users: Vec<String> = vec![first.to_string()];
    users.extend((2..=t).map(|i| format!("Next step {i}: check the parser. ").repeat(30)));
    let reply = "Checked; the buffer was not flushed.";
    match api {
        "openai-chat" => {
            let mut m = vec![json!({"role":"system","content":system})];
            for (i, u) in users.iter().enumerate() {
                if i > 0 {
                    m.push(json!({"role":"assistant","content":reply}));
                }
                m.push(json!({"role":"user","content":u}));
            }
            (
                "/v1/chat/completions".into(),
                json!({"model":"gpt-4o","messages":m}),
            )
        }
        "responses" => {
            let mut m = Vec::new();
            for (i, u) in users.iter().enumerate() {
                if i > 0 {
                    m.push(json!({"type":"message","role":"assistant","content":[{"type":"output_text","text":reply}]}));
                }
                m.push(json!({"type":"message","role":"user","content":[{"type":"input_text","text":u}]}));
            }
            (
                "/v1/responses".into(),
                json!({"model":"gpt-5","instructions":system,"input":m,"store":false}),
            )
        }
        "gemini" => {
            let mut m = Vec::new();
            for (i, u) in users.iter().enumerate() {
                if i > 0 {
                    m.push(json!({"role":"model","parts":[{"text":reply}]}));
                }
                m.push(json!({"role":"user","parts":[{"text":u}]}));
            }
            (
                "/v1beta/models/gemini-2.5-flash:generateContent".into(),
                json!({"systemInstruction":{"parts":[{"text":system}]},"contents":m}),
            )
        }
        _ => {
            // Claude Code's way: the breakpoint on the system and on the newest message.
            let mut m = Vec::new();
            for (i, u) in users.iter().enumerate() {
                if i > 0 {
                    m.push(json!({"role":"assistant","content":[{"type":"text","text":reply}]}));
                }
                m.push(json!({"role":"user","content":[{"type":"text","text":u}]}));
            }
            if let Some(last) = m.last_mut() {
                last["content"][0]["cache_control"] = json!({"type":"ephemeral"});
            }
            (
                "/v1/messages".into(),
                json!({"model":"claude-sonnet-4-5","max_tokens":256,
                    "system":[{"type":"text","text":system,"cache_control":{"type":"ephemeral"}}],"messages":m}),
            )
        }
    }
}

/// The cache read a response reports, in its API's field.
fn reported_read(api: &str, v: &Value) -> u64 {
    let p = match api {
        "openai-chat" => "/usage/prompt_tokens_details/cached_tokens",
        "responses" => "/usage/input_tokens_details/cached_tokens",
        "gemini" => "/usageMetadata/cachedContentTokenCount",
        _ => "/usage/cache_read_input_tokens",
    };
    v.pointer(p).and_then(Value::as_u64).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_reads_reported_equal_the_accounting() {
    let (s, acct) = start_counted(SimConfig::default()).await;
    let url = format!("http://{}", s.addr);
    let route = format!("/v1/messages={url}");
    let px = support::proxy(&url, &["--route", &route]).await;
    for api in ["openai-chat", "responses", "gemini", "anthropic"] {
        let key = format!("sk-cache-{api}");
        let cred_header = if api == "anthropic" {
            "x-api-key"
        } else {
            "authorization"
        };
        let cred_value = if api == "anthropic" {
            key.clone()
        } else {
            format!("Bearer {key}")
        };
        let sid = format!("cache-{api}");
        let h = [
            ("x-session-id", sid.as_str()),
            (cred_header, cred_value.as_str()),
        ];
        let mut reads = Vec::new();
        for (t, edit) in [(1, false), (2, false), (3, false), (4, true)] {
            let (path, body) = cached_turn(api, t, edit);
            let r = post_with(px.addr, &path, &body, &h).await;
            assert_eq!(r.status, 200, "{api}: {}", r.text());
            let v: Value = serde_json::from_slice(&r.body).unwrap();
            reads.push(reported_read(api, &v));
        }
        let st = acct.credential(&key);
        assert_eq!(st.requests, 4, "{api}");
        assert_eq!(reads[0], 0, "{api}: a cold cache");
        assert!(reads[1] >= 1024 && reads[2] > reads[1], "{api}: {reads:?}");
        assert_eq!(st.read_tokens, reads.iter().sum::<u64>(), "{api}: {st:?}");
        assert_eq!(
            st.events.iter().map(|e| e.read).collect::<Vec<_>>(),
            reads,
            "{api}"
        );
        // The early edit leaves only the system prompt cached: one bust.
        assert_eq!(st.busts, 1, "{api}: {st:?}");
        assert!(reads[3] < reads[2]);
        assert_eq!(
            st.invalidated_tokens,
            st.events[2].read + st.events[2].write - reads[3],
            "{api}"
        );
        // tidemark's own sum of cache reads is the provider's.
        let sess = admin(&px.admin_url(&format!("/sessions/{sid}"))).await;
        assert_eq!(
            sess["cumulative"]["cached_input"],
            json!(st.read_tokens),
            "{api}: {sess}"
        );
    }
    px.stop().await;
}

// ---------------------------------------------------------------------------
// The Responses WebSocket mode.

type Ws = tokio_tungstenite::WebSocketStream<tokio::net::TcpStream>;

async fn ws_connect(addr: SocketAddr) -> Ws {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (ws, resp) = within(
        10,
        tokio_tungstenite::client_async(format!("ws://{addr}/v1/responses"), tcp),
    )
    .await
    .expect("handshake");
    assert_eq!(resp.status(), 101);
    ws
}

/// Send one client event and read the server's events up to a terminal one.
async fn ws_turn(ws: &mut Ws, event: &Value) -> Vec<Value> {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    ws.send(Message::text(event.to_string())).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = within(10, ws.next())
            .await
            .expect("an event")
            .expect("a frame");
        let Message::Text(t) = m else {
            panic!("text frames only: {m:?}")
        };
        let v: Value = serde_json::from_str(t.as_str()).expect("JSON event");
        let t = v["type"].as_str().unwrap().to_string();
        out.push(v);
        if matches!(
            t.as_str(),
            "response.completed" | "response.failed" | "response.incomplete" | "error"
        ) {
            return out;
        }
    }
}

/// The `response.create` event for a POST body.
fn create(mut body: Value) -> Value {
    let o = body.as_object_mut().unwrap();
    o.remove("stream");
    o.insert("type".into(), json!("response.create"));
    body
}

/// An event with the values that differ from response to response (ids,
/// times, padding) blanked.
fn blank(v: &Value) -> Value {
    match v {
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, x)| {
                    let x = if matches!(k.as_str(), "id" | "item_id" | "created_at" | "obfuscation")
                    {
                        json!("")
                    } else {
                        blank(x)
                    };
                    (k.clone(), x)
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(blank).collect()),
        other => other.clone(),
    }
}

#[tokio::test]
async fn websocket_mode_sends_the_sse_events_one_frame_each() {
    let s = start(SimConfig::default()).await;
    let req = responses_req(true);
    let sse: Vec<Value> = sse_events(&post(s.addr, "/v1/responses", &req, false).await.text())
        .into_iter()
        .map(|(_, v)| v)
        .collect();
    let mut ws = ws_connect(s.addr).await;
    let evs = ws_turn(&mut ws, &create(req.clone())).await;
    assert_eq!(
        evs.iter().map(blank).collect::<Vec<_>>(),
        sse.iter().map(blank).collect::<Vec<_>>()
    );
    let done = &evs.last().unwrap()["response"];
    assert_eq!(
        done["usage"]["input_tokens"],
        json!(count_prompt(SimApi::OpenAiResponses, &req).total)
    );

    // The connection keeps its responses, stored or not.
    let id = done["id"].clone();
    let next = json!({"type":"message","role":"user","content":[{"type":"input_text","text":"And then?"}]});
    let cont = json!({"type":"response.create","model":"gpt-5","instructions":"You are terse.",
        "store":false,"previous_response_id":id,"input":[next]});
    let evs2 = ws_turn(&mut ws, &cont).await;
    let mut items = req["input"].as_array().unwrap().clone();
    items.extend(done["output"].as_array().unwrap().iter().cloned());
    items.push(next.clone());
    let whole = json!({"instructions":"You are terse.","input":items});
    let done2 = &evs2.last().unwrap()["response"];
    assert_eq!(
        done2["usage"]["input_tokens"],
        json!(count_prompt(SimApi::OpenAiResponses, &whole).total)
    );
    let unstored = done2["id"].clone();
    let third = json!({"type":"response.create","model":"gpt-5","previous_response_id":unstored,"input":[next]});
    assert_eq!(
        ws_turn(&mut ws, &third).await.last().unwrap()["type"],
        "response.completed"
    );

    // Codex's prewarm: nothing generated, its id continued by the real turn.
    let mut ws = ws_connect(s.addr).await;
    let warm =
        json!({"type":"response.create","model":"gpt-5","store":false,"input":[],"generate":false});
    let evs = ws_turn(&mut ws, &warm).await;
    let done = &evs.last().unwrap()["response"];
    assert_eq!(done["output"], json!([]));
    assert_eq!(done["usage"]["output_tokens"], 0);
    let mut turn = create(responses_req(false));
    turn["previous_response_id"] = done["id"].clone();
    turn["store"] = json!(false);
    let evs = ws_turn(&mut ws, &turn).await;
    assert_eq!(evs.last().unwrap()["type"], "response.completed");

    // Another connection knows none of them: the API's error event.
    let mut other = ws_connect(s.addr).await;
    let evs = ws_turn(&mut other, &third).await;
    assert_eq!(evs.len(), 1);
    assert_eq!(evs[0]["type"], "error");
    assert_eq!(evs[0]["status"], 400);
    assert_eq!(evs[0]["error"]["code"], "previous_response_not_found");
}

#[tokio::test]
async fn websocket_streams_run_at_once_and_say_which_they_are() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let s = start(SimConfig {
        chunk_delay: Duration::from_millis(2),
        ..SimConfig::default()
    })
    .await;
    let mut ws = ws_connect(s.addr).await;
    for sid in ["main", "side"] {
        let mut e = create(responses_req(false));
        e["stream_id"] = json!(sid);
        ws.send(Message::text(e.to_string())).await.unwrap();
    }
    let mut done = BTreeSet::new();
    let mut order = Vec::new();
    let mut first_done = None;
    while done.len() < 2 {
        let Message::Text(t) = within(10, ws.next()).await.unwrap().unwrap() else {
            panic!("text")
        };
        let v: Value = serde_json::from_str(t.as_str()).unwrap();
        let sid = v["stream_id"]
            .as_str()
            .expect("every event names its stream")
            .to_string();
        if v["type"] == "response.completed" {
            done.insert(sid.clone());
            first_done.get_or_insert(order.len());
        }
        order.push(sid);
    }
    // Both streams had begun before either finished.
    let first = |s: &str| order.iter().position(|x| x == s).unwrap();
    assert!(
        first("main").max(first("side")) < first_done.unwrap(),
        "interleaved: {order:?}"
    );
}

#[tokio::test]
async fn websocket_compresses_when_the_client_offers_deflate() {
    use tidemark::ws::deflate::{Inflater, Params};
    use tidemark::ws::frame::{encode_frame, Event, MessageReader, Opcode};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start(SimConfig::default()).await;
    let mut tcp = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let hs = format!("GET /v1/responses HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Extensions: permessage-deflate; client_max_window_bits\r\n\r\n", s.addr);
    tcp.write_all(hs.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 1 << 16];
    let mut got = Vec::new();
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = within(10, tcp.read(&mut buf)).await.unwrap();
        assert!(n > 0);
        got.extend_from_slice(&buf[..n]);
    }
    let end = got.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="));
    assert!(head.contains("sec-websocket-extensions: permessage-deflate"));
    let mut frame = bytes::BytesMut::new();
    let ev = create(responses_req(false)).to_string();
    encode_frame(
        &mut frame,
        true,
        false,
        Opcode::Text,
        Some([7, 1, 2, 3]),
        ev.as_bytes(),
    );
    tcp.write_all(&frame).await.unwrap();
    let mut reader = MessageReader::new(
        1 << 24,
        Some(Inflater::server_to_client(&Params::default())),
    );
    let mut pending = got[end..].to_vec();
    let mut compressed = 0;
    loop {
        let (used, e) = reader.feed(&pending).unwrap();
        pending.drain(..used);
        match e {
            Some(Event::Message {
                compressed: c,
                payload,
                ..
            }) => {
                compressed += usize::from(c);
                let v: Value = serde_json::from_slice(&payload).unwrap();
                if v["type"] == "response.completed" {
                    break;
                }
            }
            Some(_) => {}
            None => {
                let n = within(10, tcp.read(&mut buf)).await.unwrap();
                assert!(n > 0, "connection open until the response completes");
                pending.extend_from_slice(&buf[..n]);
            }
        }
    }
    assert!(compressed > 3, "the server's frames are deflated");
}

// ---------------------------------------------------------------------------
// What the real agents need beyond the basics.

#[tokio::test]
async fn codex_remote_compaction_and_custom_tools() {
    let s = start(SimConfig {
        tool_calls: tidemark::sim::ToolCalls::WhenAsked,
        ..SimConfig::default()
    })
    .await;
    let dev = json!({"type":"message","role":"developer","content":[{"type":"input_text","text":"You are Codex. ".repeat(200)}]});
    let tools = json!({"type":"additional_tools","role":"developer","tools":[{"type":"namespace","name":"functions",
        "tools":[{"type":"custom","name":"exec","description":"Run JavaScript."}]}]});
    let user = |t: &str| json!({"type":"message","role":"user","content":[{"type":"input_text","text":t}]});
    // A prompt that names the tool gets a custom tool call, streamed as Codex reads it.
    let turn = json!({"model":"gpt-5","stream":true,"store":false,"input":[tools, dev, user("Please use exec to list files.")]});
    let r = post(s.addr, "/v1/responses", &turn, false).await;
    let evs = sse_events(&r.text());
    let types = event_types(&evs);
    assert!(
        types.contains(&"response.custom_tool_call_input.delta".to_string()),
        "{types:?}"
    );
    let done = &evs.last().unwrap().1["response"];
    let call = &done["output"][0];
    assert_eq!(call["type"], "custom_tool_call");
    assert_eq!(call["name"], "exec");
    assert!(call["input"].as_str().unwrap().starts_with("text("));
    // Not asked: text.
    let plain = json!({"model":"gpt-5","store":false,"input":[tools, dev, user("say hi")]});
    let v: Value =
        serde_json::from_slice(&post(s.addr, "/v1/responses", &plain, false).await.body).unwrap();
    assert_eq!(v["output"][0]["type"], "message");

    // The trigger: exactly one compaction item.
    let history = vec![
        tools.clone(),
        dev.clone(),
        user("say hi"),
        json!({"type":"message","role":"assistant","content":[{"type":"output_text","text":"hi ".repeat(300)}]}),
    ];
    let mut with_trigger = history.clone();
    with_trigger.push(json!({"type":"compaction_trigger"}));
    let req = json!({"model":"gpt-5","store":false,"input":with_trigger});
    let v: Value =
        serde_json::from_slice(&post(s.addr, "/v1/responses", &req, false).await.body).unwrap();
    let out = v["output"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{v}");
    assert_eq!(out[0]["type"], "compaction");
    // Codex rebuilds its history around it: instructions and first message
    // before the item count; the assistant's long answer is gone.
    let rebuilt = json!({"model":"gpt-5","store":false,"input":[tools, dev, user("say hi"), out[0], user("again")]});
    let r = post(s.addr, "/v1/responses/input_tokens", &rebuilt, false).await;
    let mut full = history.clone();
    full.push(user("again"));
    let before = count_prompt(SimApi::OpenAiResponses, &json!({"input":full})).total;
    let dropped = count_prompt(
        SimApi::OpenAiResponses,
        &json!({"input":[out[0], user("again")]}),
    )
    .total;
    assert!(r.sim_count() < before, "{} < {before}", r.sim_count());
    assert!(
        r.sim_count() > dropped + 400,
        "the resent instructions still count"
    );
    // Appended as stateless chaining does: what it replaced is left out.
    let mut chained = with_trigger[..4].to_vec();
    chained.push(out[0].clone());
    chained.push(user("again"));
    let r = post(
        s.addr,
        "/v1/responses/input_tokens",
        &json!({"model":"gpt-5","input":chained}),
        false,
    )
    .await;
    assert_eq!(r.sim_count(), dropped);
}

#[tokio::test]
async fn structured_answers_follow_their_schema() {
    let s = start(SimConfig::default()).await;
    // Gemini CLI's model router.
    let router = json!({"systemInstruction":{"parts":[{"text":"You are a specialized Task Routing AI."}]},
        "contents":[{"role":"user","parts":[{"text":"say hi"}]}],
        "generationConfig":{"responseMimeType":"application/json","responseJsonSchema":{"type":"OBJECT",
            "properties":{"complexity_reasoning":{"type":"STRING"},"complexity_score":{"type":"INTEGER"}},
            "required":["complexity_reasoning","complexity_score"]}}});
    let r = post(
        s.addr,
        "/v1beta/models/gemini-3.5-flash-lite:generateContent",
        &router,
        false,
    )
    .await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    let answer: Value = serde_json::from_str(
        v.pointer("/candidates/0/content/parts/0/text")
            .unwrap()
            .as_str()
            .unwrap(),
    )
    .expect("the text is JSON");
    let score = answer["complexity_score"].as_i64().expect("an integer");
    assert!((1..=100).contains(&score));
    assert!(answer["complexity_reasoning"].is_string());

    let schema = json!({"type":"object","properties":{"title":{"type":"string"},"n":{"type":"integer","minimum":3},
        "tags":{"type":"array","items":{"enum":["a","b"]}}},"required":["title","n","tags"],"additionalProperties":false});
    let check = |text: &str| {
        let a: Value = serde_json::from_str(text).expect("JSON");
        assert!(
            a["title"].is_string() && a["n"] == 3 && a["tags"] == json!(["a"]),
            "{a}"
        );
    };
    let mut chat = openai_req(false, false);
    chat["response_format"] =
        json!({"type":"json_schema","json_schema":{"name":"t","schema":schema}});
    let v: Value = serde_json::from_slice(
        &post(s.addr, "/v1/chat/completions", &chat, false)
            .await
            .body,
    )
    .unwrap();
    check(
        v.pointer("/choices/0/message/content")
            .unwrap()
            .as_str()
            .unwrap(),
    );
    let mut resp = responses_req(false);
    resp["text"] = json!({"format":{"type":"json_schema","name":"t","schema":schema}});
    let v: Value =
        serde_json::from_slice(&post(s.addr, "/v1/responses", &resp, false).await.body).unwrap();
    check(
        v.pointer("/output/0/content/0/text")
            .unwrap()
            .as_str()
            .unwrap(),
    );
    let mut msg = anthropic_req(false);
    msg["output_format"] = json!({"type":"json_schema","schema":schema});
    let v: Value =
        serde_json::from_slice(&post(s.addr, "/v1/messages", &msg, false).await.body).unwrap();
    check(v.pointer("/content/0/text").unwrap().as_str().unwrap());
}

#[tokio::test]
async fn a_tool_asked_for_by_name_gets_arguments_its_schema_accepts() {
    let s = start(SimConfig {
        tool_calls: tidemark::sim::ToolCalls::WhenAsked,
        ..SimConfig::default()
    })
    .await;
    let agent = json!({"name":"Agent","input_schema":{"type":"object","properties":{
        "description":{"type":"string"},"prompt":{"type":"string"},
        "subagent_type":{"type":"string","enum":["general-purpose","Explore"]}},
        "required":["description","prompt","subagent_type"]}});
    let mut req = anthropic_req(false);
    req["tools"] = json!([agent]);
    req["messages"] = json!([{"role":"user","content":"say hi"}]);
    let v: Value =
        serde_json::from_slice(&post(s.addr, "/v1/messages", &req, false).await.body).unwrap();
    assert_eq!(v["content"][0]["type"], "text", "not asked: no tool");
    req["messages"] = json!([{"role":"user","content":"Use the Agent tool to count to three."}]);
    let v: Value =
        serde_json::from_slice(&post(s.addr, "/v1/messages", &req, false).await.body).unwrap();
    let call = &v["content"][0];
    assert_eq!(call["type"], "tool_use");
    assert_eq!(call["name"], "Agent");
    let input = &call["input"];
    assert!(
        input["description"].is_string() && input["prompt"].is_string(),
        "{input}"
    );
    assert_eq!(input["subagent_type"], "general-purpose");
    // Arguments spelled out after the name are the ones used; a trailing
    // system-role message and reminder blocks (Claude Code's) are not the ask.
    req["messages"] = json!([
        {"role":"user","content":[{"type":"text","text":"<system-reminder>use Agent</system-reminder>"},
            {"type":"text","text":"Use Agent {\"description\":\"Count\",\"prompt\":\"count to three\",\"subagent_type\":\"Explore\"}"}]},
        {"role":"system","content":"Environment: use Agent freely."}]);
    let v: Value =
        serde_json::from_slice(&post(s.addr, "/v1/messages", &req, false).await.body).unwrap();
    assert_eq!(
        v["content"][0]["input"],
        json!({"description":"Count","prompt":"count to three","subagent_type":"Explore"})
    );
    req["messages"] = json!([
        {"role":"user","content":[{"type":"text","text":"<system-reminder>use Agent</system-reminder>"},{"type":"text","text":"say hi"}]},
        {"role":"system","content":"Environment: use Agent freely."}]);
    let v: Value =
        serde_json::from_slice(&post(s.addr, "/v1/messages", &req, false).await.body).unwrap();
    assert_eq!(v["content"][0]["type"], "text");
}

#[tokio::test]
async fn tool_calls_in_each_apis_own_shape() {
    let s = start(SimConfig::default()).await;
    let params = json!({"type":"object","properties":{"location":{"type":"string"}},"required":["location"]});
    // Responses: a function_call item, arguments streamed as the fixture's.
    let mut req = responses_req(true);
    req["tools"] = json!([{"type":"function","name":"get_weather","parameters":params}]);
    let evs = sse_events(&post(s.addr, "/v1/responses", &req, false).await.text());
    let fx = sse_events(&fixture("openai-responses/stream_function_call.sse"));
    let skip_reasoning = |v: &[(Option<String>, Value)]| {
        v.iter()
            .filter(|(_, e)| e.pointer("/item/type") != Some(&json!("reasoning")))
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(event_types(&evs), event_types(&skip_reasoning(&fx)));
    let call = &evs.last().unwrap().1["response"]["output"][0];
    assert_eq!(
        keys(call),
        keys(&fx.last().unwrap().1["response"]["output"][1])
    );
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["location"].is_string());

    // Gemini: a functionCall part with object args.
    let mut g = gemini_req();
    g["tools"] = json!([{"functionDeclarations":[{"name":"getWeather","parameters":params}]}]);
    let r = post(
        s.addr,
        "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
        &g,
        false,
    )
    .await;
    let evs = sse_events(&r.text().replace("\r\n", "\n"));
    let part = &evs[0].1["candidates"][0]["content"]["parts"][0];
    assert_eq!(part["functionCall"]["name"], "getWeather");
    assert!(part["functionCall"]["args"]["location"].is_string());
    // The function's answer goes back as a user functionResponse: text then.
    g["contents"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role":"model","parts":[part]}));
    g["contents"].as_array_mut().unwrap().push(json!({"role":"user","parts":[{"functionResponse":{"name":"getWeather","response":{"t":21}}}]}));
    let r = post(
        s.addr,
        "/v1beta/models/gemini-2.5-flash:generateContent",
        &g,
        false,
    )
    .await;
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert!(v["candidates"][0]["content"]["parts"][0]["text"].is_string());

    // Ollama: tool_calls with object arguments, then the done line.
    let mut o = ollama_req(true);
    o["tools"] = json!([{"type":"function","function":{"name":"get_weather","parameters":params}}]);
    let r = post(s.addr, "/api/chat", &o, false).await;
    let lines: Vec<Value> = r
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let fx: Vec<Value> = fixture("ollama/api_chat_stream_tool_calls.ndjson")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    let tc = &lines[0]["message"]["tool_calls"][0];
    assert_eq!(keys(tc), keys(&fx[0]["message"]["tool_calls"][0]));
    assert!(
        tc["function"]["arguments"]["location"].is_string(),
        "an object, not a string"
    );
    assert_eq!(lines[1]["done"], true);
}
