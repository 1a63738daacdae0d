//! SPEC §5 end to end through the real proxy: reject in each provider's own
//! words without forwarding, trim to a valid and smaller request that is under
//! the line by the upstream's own count with a sticky cut, the session budget,
//! the warning line, and trim together with usage injection on a chat stream.
//!
//! The test upstream counts prompts its own way: the simulated provider's
//! counter (`tidemark::sim::count_prompt`, cl100k plus hidden framing) for
//! OpenAI chat and Anthropic, and a cl100k counter of its own for Responses.
//! Every answer carries that count in `x-sim-prompt-tokens` and as usage.

mod support;

use std::sync::OnceLock;

use bytes::Bytes;
use http::Request;
use serde_json::{json, Value};
use support::trim::{agent_script, cache_controls, check_trimmed, raw_elements, render, validate};
use support::trim::{Script, Step};
use tidemark::provider::Api;
use tidemark::sim::{count_prompt, SimApi, X_SIM_PROMPT_TOKENS};

use support::*;

const OUTPUT_TOKENS: u64 = 2;

fn cl100k(s: &str) -> u64 {
    static BPE: OnceLock<tiktoken_rs::CoreBPE> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::cl100k_base().expect("cl100k"))
        .encode_ordinary(s)
        .len() as u64
}

fn text_of(v: &Value) -> u64 {
    match v {
        Value::String(s) => cl100k(s),
        Value::Array(a) => a.iter().map(text_of).sum(),
        Value::Object(o) => o
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "type" | "id" | "status"))
            .map(|(_, v)| text_of(v))
            .sum(),
        Value::Null => 0,
        other => cl100k(&other.to_string()),
    }
}

/// The test upstream's own Responses counter: cl100k over every string in
/// `instructions`, `tools` and `input`, plus 5 tokens of framing per item.
fn count_responses(v: &Value) -> u64 {
    let mut n = 3;
    n += v.get("instructions").map(text_of).unwrap_or(0);
    n += v.get("tools").map(text_of).unwrap_or(0);
    match v.get("input") {
        Some(Value::Array(items)) => n += items.iter().map(|i| 5 + text_of(i)).sum::<u64>(),
        Some(other) => n += 5 + text_of(other),
        None => {}
    }
    n
}

/// The upstream's own prompt count of a body it received.
fn upstream_count(path: &str, body: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(body).ok()?;
    if path.ends_with("/chat/completions") {
        Some(count_prompt(SimApi::OpenAiChat, &v).total)
    } else if path.ends_with("/messages") {
        Some(count_prompt(SimApi::Anthropic, &v).total)
    } else if path.ends_with("/responses") {
        Some(count_responses(&v))
    } else {
        None
    }
}

fn sse(events: &[Value]) -> String {
    let mut s = String::new();
    for e in events {
        s.push_str(&format!("data: {e}\n\n"));
    }
    s.push_str("data: [DONE]\n\n");
    s
}

/// A provider that answers every API in its own shape with usage equal to
/// its own count.
fn provider() -> Handler {
    handler(|req| {
        let path = req.uri().path().to_string();
        let Some(n) = upstream_count(&path, req.body()) else {
            let mut r = http::Response::new(full(r#"{"error":{"message":"bad"}}"#));
            *r.status_mut() = http::StatusCode::BAD_REQUEST;
            return r;
        };
        let v: Value = serde_json::from_slice(req.body()).unwrap_or(Value::Null);
        let model = v["model"].as_str().unwrap_or("m").to_string();
        let stream = v["stream"].as_bool().unwrap_or(false);
        let (ct, body) = if path.ends_with("/chat/completions") {
            if stream {
                let chunk = |delta: Value, fin: Value| {
                    json!({"id":"chatcmpl-t","object":"chat.completion.chunk","created":1,
                       "model":model,"choices":[{"index":0,"delta":delta,"finish_reason":fin}]})
                };
                let mut ev = vec![
                    chunk(json!({"role":"assistant","content":"ok"}), Value::Null),
                    chunk(json!({}), json!("stop")),
                ];
                if v["stream_options"]["include_usage"] == true {
                    ev.push(json!({"id":"chatcmpl-t","object":"chat.completion.chunk",
                        "created":1,"model":model,"choices":[],
                        "usage":{"prompt_tokens":n,"completion_tokens":OUTPUT_TOKENS,
                                 "total_tokens":n + OUTPUT_TOKENS}}));
                }
                ("text/event-stream", sse(&ev))
            } else {
                (
                    "application/json",
                    json!({"id":"chatcmpl-t","object":"chat.completion","created":1,
                    "model":model,"choices":[{"index":0,"message":{"role":"assistant",
                    "content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":n,
                    "completion_tokens":OUTPUT_TOKENS,"total_tokens":n + OUTPUT_TOKENS}})
                    .to_string(),
                )
            }
        } else if path.ends_with("/messages") {
            (
                "application/json",
                json!({"id":"msg_t","type":"message","role":"assistant","model":model,
                "content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn",
                "stop_sequence":null,"usage":{"input_tokens":n,"output_tokens":OUTPUT_TOKENS}})
                .to_string(),
            )
        } else {
            (
                "application/json",
                json!({"id":"resp_t","object":"response","status":"completed","model":model,
                "output":[{"type":"message","id":"msg_t","role":"assistant","status":"completed",
                "content":[{"type":"output_text","text":"ok","annotations":[]}]}],
                "usage":{"input_tokens":n,"input_tokens_details":{"cached_tokens":0},
                "output_tokens":OUTPUT_TOKENS,"output_tokens_details":{"reasoning_tokens":0},
                "total_tokens":n + OUTPUT_TOKENS}})
                .to_string(),
            )
        };
        let mut r = http::Response::new(full(body));
        r.headers_mut()
            .insert("content-type", http::HeaderValue::from_static(ct));
        r.headers_mut().insert(
            X_SIM_PROMPT_TOKENS,
            http::HeaderValue::from_str(&n.to_string()).expect("digits"),
        );
        r
    })
}

async fn post_session(
    client: &TestClient,
    url: &str,
    session: &str,
    body: impl Into<Bytes>,
) -> (http::response::Parts, Bytes) {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-policy-test")
        .header("x-api-key", "sk-ant-policy-test")
        .header("x-session-id", session)
        .body(full(body.into()))
        .unwrap();
    send(client, req).await
}

fn hdr<'a>(p: &'a http::response::Parts, name: &str) -> Option<&'a str> {
    p.headers.get(name).and_then(|v| v.to_str().ok())
}

/// Sum of the samples of `name` whose labels include every `labels` pair.
async fn metric(proxy: &Proxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    let (_, body) = get(&client_h1(), &proxy.admin_url("/metrics")).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The real proxy in front of `up` for every API (Anthropic's default route replaced).
async fn proxy(up: &str, extra: &[&str]) -> Proxy {
    let route = format!("/v1/messages={up}");
    let mut args = vec!["--route", route.as_str()];
    args.extend_from_slice(extra);
    support::proxy(up, &args).await
}

async fn over_budget(proxy: &Proxy, api: &str, model: &str, action: &str) -> f64 {
    metric(
        proxy,
        "tidemark_over_budget_total",
        &[("api", api), ("model", model), ("action", action)],
    )
    .await
}

/// The first bare integer of a header value (`183211;src=...` -> 183211).
fn lead_int(s: &str) -> u64 {
    s.split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no leading integer in {s:?}"))
}

/// `x-context-trimmed: before=B, after=A, turns=T, tool-results=R`.
fn trimmed_fields(s: &str) -> [u64; 4] {
    let mut out = [None; 4];
    for kv in s.split(',') {
        let (k, v) = kv.trim().split_once('=').expect("key=value");
        let i = ["before", "after", "turns", "tool-results"]
            .iter()
            .position(|x| *x == k)
            .unwrap_or_else(|| panic!("unexpected key {k} in {s:?}"));
        out[i] = Some(v.parse::<u64>().expect("integer"));
    }
    out.map(|x| x.unwrap_or_else(|| panic!("missing key in {s:?}")))
}

// ---------------------------------------------------------------- reject

fn assert_reject_headers(p: &http::response::Parts, window: u64) -> u64 {
    assert_eq!(p.status, 400);
    assert_eq!(hdr(p, "x-tidemark-error"), Some("context-budget"));
    assert_eq!(hdr(p, "x-should-retry"), Some("false"));
    let proj = hdr(p, "x-context-projection").expect("x-context-projection");
    assert!(
        proj.contains(&format!("window={window}")),
        "projection header {proj}"
    );
    lead_int(proj)
}

fn openai_reject_numbers(body: &[u8]) -> (u64, u64) {
    let v: Value = serde_json::from_slice(body).expect("json error body");
    let e = &v["error"];
    assert_eq!(e["type"], "invalid_request_error", "{v}");
    assert_eq!(e["code"], "context_length_exceeded", "{v}");
    assert_eq!(e["param"], "messages", "{v}");
    let msg = e["message"].as_str().expect("message");
    let rest = msg
        .strip_prefix("This model's maximum context length is ")
        .unwrap_or_else(|| panic!("message {msg:?}"));
    let (w, rest) = rest
        .split_once(" tokens. However, your messages resulted in ")
        .expect(msg);
    let (p, _) = rest.split_once(" tokens.").expect(msg);
    (p.parse().expect(msg), w.parse().expect(msg))
}

#[tokio::test]
async fn reject_answers_in_each_providers_words_and_forwards_nothing() {
    let up = upstream(provider()).await;
    let proxy = proxy(
        &up.url(),
        &[
            "--context-window",
            "gpt-4o-rej=1000,claude-rej=1000,gemini-rej=1000",
            "--on-over",
            "reject",
        ],
    )
    .await;
    let c = client_h1();
    let big = "tidemark ".repeat(3000);

    // OpenAI chat.
    let body = json!({"model":"gpt-4o-rej","messages":[{"role":"user","content":big}]});
    let (p, b) = post_session(
        &c,
        &proxy.url("/v1/chat/completions"),
        "rej-chat",
        body.to_string(),
    )
    .await;
    let proj = assert_reject_headers(&p, 1000);
    let (pp, w) = openai_reject_numbers(&b);
    assert_eq!((pp, w), (proj, 1000));
    assert!(pp > 1000);

    // OpenAI Responses: the same shape.
    let body = json!({"model":"gpt-4o-rej","input":big});
    let (p, b) = post_session(
        &c,
        &proxy.url("/v1/responses"),
        "rej-resp",
        body.to_string(),
    )
    .await;
    let proj = assert_reject_headers(&p, 1000);
    assert_eq!(openai_reject_numbers(&b), (proj, 1000));

    // Anthropic.
    let body = json!({"model":"claude-rej","max_tokens":64,
        "messages":[{"role":"user","content":big}]});
    let (p, b) = post_session(&c, &proxy.url("/v1/messages"), "rej-ant", body.to_string()).await;
    let proj = assert_reject_headers(&p, 1000);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert_eq!(
        v["error"]["message"],
        format!("prompt is too long: {proj} tokens > 1000 maximum")
    );

    // Gemini.
    let body = json!({"contents":[{"role":"user","parts":[{"text":big}]}]});
    let (p, b) = post_session(
        &c,
        &proxy.url("/v1beta/models/gemini-rej:generateContent"),
        "rej-gem",
        body.to_string(),
    )
    .await;
    let proj = assert_reject_headers(&p, 1000);
    let v: Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["error"]["code"], 400, "{v}");
    assert_eq!(v["error"]["status"], "INVALID_ARGUMENT", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains(&proj.to_string()) && msg.contains("1000"),
        "{msg}"
    );

    assert_eq!(
        up.seen.count(),
        0,
        "a rejected request reached the upstream"
    );

    // Under the line: forwarded.
    let body = json!({"model":"gpt-4o-rej","messages":[{"role":"user","content":"hello"}]});
    let (p, _) = post_session(
        &c,
        &proxy.url("/v1/chat/completions"),
        "rej-ok",
        body.to_string(),
    )
    .await;
    assert_eq!(p.status, 200);
    assert_eq!(up.seen.count(), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn reserve_output_counts_max_tokens_in_the_projection() {
    let up = upstream(provider()).await;
    let args = |reserve: bool| {
        let mut a = vec![
            "--context-window",
            "gpt-4o-res=1000",
            "--on-over",
            "reject",
            "--limit-at",
            "0.9",
        ];
        if reserve {
            a.push("--reserve-output");
        }
        a
    };
    let with = proxy(&up.url(), &args(true)).await;
    let without = proxy(&up.url(), &args(false)).await;
    let c = client_h1();
    // About 300 prompt tokens plus 800 of output: over 900 only with the reserve.
    let body = json!({"model":"gpt-4o-res","max_tokens":800,
        "messages":[{"role":"user","content":"tidemark ".repeat(300)}]})
    .to_string();
    let (p, _) = post_session(
        &c,
        &without.url("/v1/chat/completions"),
        "res-a",
        body.clone(),
    )
    .await;
    assert_eq!(p.status, 200, "without --reserve-output the request passes");
    assert_eq!(up.seen.count(), 1);
    let (p, b) = post_session(&c, &with.url("/v1/chat/completions"), "res-b", body).await;
    let proj = assert_reject_headers(&p, 1000);
    let (pp, w) = openai_reject_numbers(&b);
    assert_eq!(w, 1000);
    assert_eq!(pp, proj + 800, "P is the projection plus max_tokens");
    assert_eq!(
        up.seen.count(),
        1,
        "the reserved-over request was forwarded"
    );
    with.stop().await;
    without.stop().await;
}

#[tokio::test]
async fn warning_header_at_the_line() {
    let up = upstream(provider()).await;
    let proxy = proxy(
        &up.url(),
        &["--context-window", "gpt-4o-warn=1000", "--warn-at", "0.5"],
    )
    .await;
    let c = client_h1();
    let small = json!({"model":"gpt-4o-warn","messages":[{"role":"user","content":"hello"}]});
    let (p, _) = post_session(
        &c,
        &proxy.url("/v1/chat/completions"),
        "warn-a",
        small.to_string(),
    )
    .await;
    assert_eq!(p.status, 200);
    assert!(hdr(&p, "x-context-projection").is_some());
    assert!(
        hdr(&p, "x-context-warning").is_none(),
        "warned far below the line"
    );
    let big = json!({"model":"gpt-4o-warn",
        "messages":[{"role":"user","content":"tidemark ".repeat(350)}]});
    let (p, _) = post_session(
        &c,
        &proxy.url("/v1/chat/completions"),
        "warn-b",
        big.to_string(),
    )
    .await;
    assert_eq!(p.status, 200);
    let w = hdr(&p, "x-context-warning").expect("x-context-warning over the line");
    assert!(w.ends_with(", at=0.5"), "{w}");
    let util: f64 = w
        .strip_prefix("util=")
        .and_then(|r| r.split(',').next())
        .and_then(|u| u.parse().ok())
        .expect(w);
    assert!((0.5..1.0).contains(&util), "{w}");
    proxy.stop().await;
}

// ---------------------------------------------------------------- trim

#[derive(Clone, Copy)]
struct TrimCase {
    api: Api,
    path: &'static str,
    model: &'static str,
}

const CASES: [TrimCase; 3] = [
    TrimCase {
        api: Api::OpenAiChat,
        path: "/v1/chat/completions",
        model: "gpt-4o-trim",
    },
    TrimCase {
        api: Api::Anthropic,
        path: "/v1/messages",
        model: "claude-trim",
    },
    TrimCase {
        api: Api::OpenAiResponses,
        path: "/v1/responses",
        model: "gpt-5-trim",
    },
];

/// The script's request for the case's API and model, not streaming.
fn request(case: &TrimCase, s: &Script) -> Vec<u8> {
    let mut v: Value = serde_json::from_slice(&render(case.api, s, false)).unwrap();
    v["model"] = json!(case.model);
    v["stream"] = json!(false);
    serde_json::to_vec(&v).unwrap()
}

const LIMIT_AT: f64 = 0.9;
const TRIM_TO: f64 = 0.6;

async fn trim_case(case: &TrimCase) {
    let s1 = agent_script(24, 1, 600);
    let b1 = request(case, &s1);
    let full_count = upstream_count(case.path, &b1).unwrap();
    // The whole conversation is about 3 windows: eliding tool results is
    // not enough, whole turns must go too.
    let window = full_count / 3;
    let limit = (LIMIT_AT * window as f64) as u64;
    let up = upstream(provider()).await;
    let windows = format!("{}={window}", case.model);
    let (lim, to) = (LIMIT_AT.to_string(), TRIM_TO.to_string());
    let proxy = proxy(
        &up.url(),
        &[
            "--context-window",
            &windows,
            "--on-over",
            "trim",
            "--limit-at",
            &lim,
            "--trim-to",
            &to,
        ],
    )
    .await;
    let c = client_h1();
    let api = case.api.as_str();
    let labels = [("api", api), ("model", case.model)];
    let trims0 = metric(
        &proxy,
        "tidemark_over_budget_total",
        &[labels[0], labels[1], ("action", "trim")],
    )
    .await;
    let tokens0 = metric(&proxy, "tidemark_trimmed_tokens_total", &labels).await;

    // First request: trimmed, valid, smaller, under the line by the upstream's count.
    let session = format!("trim-{api}");
    let (p, _) = post_session(&c, &proxy.url(case.path), &session, b1.clone()).await;
    assert_eq!(p.status, 200, "{api}: trimmed request answered");
    assert_eq!(up.seen.count(), 1);
    let (_, f1) = up.seen.last();
    if let Err(e) = check_trimmed(case.api, &b1, &f1) {
        panic!("{api}: forwarded body invalid: {e}");
    }
    let n1: u64 = hdr(&p, X_SIM_PROMPT_TOKENS).unwrap().parse().unwrap();
    assert!(
        n1 <= limit,
        "{api}: upstream counts {n1} > limit {limit} (window {window}, full {full_count})"
    );
    let t = hdr(&p, "x-context-trimmed").expect("x-context-trimmed");
    let [before, after, turns, _tool_results] = trimmed_fields(t);
    assert!(before > after, "{api}: {t}");
    assert!(turns > 0, "{api}: {t}");
    assert!(after as f64 <= LIMIT_AT * window as f64, "{api}: {t}");
    if case.api == Api::Anthropic {
        let v: Value = serde_json::from_slice(&f1).unwrap();
        assert!(cache_controls(&v) <= 4);
    }
    let trims1 = metric(
        &proxy,
        "tidemark_over_budget_total",
        &[labels[0], labels[1], ("action", "trim")],
    )
    .await;
    let tokens1 = metric(&proxy, "tidemark_trimmed_tokens_total", &labels).await;
    assert_eq!(trims1 - trims0, 1.0, "{api}: over_budget{{action=trim}}");
    assert_eq!(
        tokens1 - tokens0,
        (before - after) as f64,
        "{api}: trimmed tokens"
    );

    // Next request: the conversation plus an answer and a new question. The
    // cut is sticky: everything forwarded before is forwarded again, byte for byte.
    let mut s2 = s1.clone();
    s2.steps.push(Step::Assistant(format!(
        "answer: {}",
        support::trim::text(41, 300)
    )));
    s2.steps.push(Step::User(format!(
        "next: {}",
        support::trim::text(42, 200)
    )));
    let b2 = request(case, &s2);
    let (p2, _) = post_session(&c, &proxy.url(case.path), &session, b2.clone()).await;
    assert_eq!(p2.status, 200);
    assert_eq!(up.seen.count(), 2);
    let (_, f2) = up.seen.last();
    if let Err(e) = check_trimmed(case.api, &b2, &f2) {
        panic!("{api}: second forwarded body invalid: {e}");
    }
    let n2: u64 = hdr(&p2, X_SIM_PROMPT_TOKENS).unwrap().parse().unwrap();
    assert!(n2 <= limit, "{api}: second request counts {n2} > {limit}");
    assert!(
        hdr(&p2, "x-context-trimmed").is_some(),
        "{api}: second not trimmed"
    );
    let e1 = raw_elements(case.api, &f1);
    let (off, last) = e1.last().unwrap();
    let end = off + last.len();
    assert!(
        f2.len() > end && f1[..end] == f2[..end],
        "{api}: the second trimmed request does not start with the first one's bytes"
    );
    assert_eq!(
        raw_elements(case.api, &f2)[..e1.len()],
        e1[..],
        "{api}: elements moved"
    );

    // Untrimmable: one huge user message is rejected, not forwarded.
    let huge = Script {
        system: "short".into(),
        steps: vec![Step::User(support::trim::text(7, (window as usize) * 8))],
        breakpoints: 0,
    };
    let (trims, rejects) = (
        over_budget(&proxy, api, case.model, "trim").await,
        over_budget(&proxy, api, case.model, "reject").await,
    );
    let (p3, b3) = post_session(
        &c,
        &proxy.url(case.path),
        &format!("huge-{api}"),
        request(case, &huge),
    )
    .await;
    let proj = assert_reject_headers(&p3, window);
    assert!(proj > limit);
    let v: Value = serde_json::from_slice(&b3).unwrap();
    if case.api == Api::Anthropic {
        assert_eq!(
            v["error"]["message"],
            format!("prompt is too long: {proj} tokens > {window} maximum")
        );
    } else {
        assert_eq!(openai_reject_numbers(&b3), (proj, window));
    }
    assert_eq!(
        over_budget(&proxy, api, case.model, "trim").await,
        trims,
        "{api}: a failed trim counted as a trim"
    );
    assert_eq!(
        over_budget(&proxy, api, case.model, "reject").await,
        rejects + 1.0,
        "{api}: a failed trim is a reject"
    );
    assert!(hdr(&p3, "x-context-trimmed").is_none());
    assert_eq!(
        up.seen.count(),
        2,
        "{api}: an untrimmable request was forwarded"
    );

    // The same in the trimmed session: the conversation plus a huge paste
    // is rejected, and the rejected attempt does not move the session's cut.
    let mut s3 = s2.clone();
    s3.steps.push(Step::Assistant("ok".into()));
    s3.steps
        .push(Step::User(support::trim::text(8, (window as usize) * 8)));
    let (p4, _) = post_session(&c, &proxy.url(case.path), &session, request(case, &s3)).await;
    assert_reject_headers(&p4, window);
    assert_eq!(up.seen.count(), 2, "{api}: the huge paste was forwarded");
    let mut s4 = s2.clone();
    s4.steps.push(Step::Assistant("ok".into()));
    s4.steps.push(Step::User("a short question instead".into()));
    let b4 = request(case, &s4);
    let (p5, _) = post_session(&c, &proxy.url(case.path), &session, b4.clone()).await;
    assert_eq!(p5.status, 200);
    let (_, f4) = up.seen.last();
    if let Err(e) = check_trimmed(case.api, &b4, &f4) {
        panic!("{api}: third forwarded body invalid: {e}");
    }
    let e2 = raw_elements(case.api, &f2);
    let (off, last) = e2.last().unwrap();
    let end = off + last.len();
    assert!(
        f4.len() > end && f2[..end] == f4[..end],
        "{api}: a rejected trim moved the sticky cut"
    );
    proxy.stop().await;
}

#[tokio::test]
async fn trim_openai_chat_end_to_end() {
    trim_case(&CASES[0]).await;
}

#[tokio::test]
async fn trim_anthropic_end_to_end() {
    trim_case(&CASES[1]).await;
}

#[tokio::test]
async fn trim_responses_end_to_end() {
    trim_case(&CASES[2]).await;
}

/// Big old tool outputs go first: elided with a visible marker, the turns
/// kept, and the result valid and under the line by the upstream's count.
#[tokio::test]
async fn trim_elides_oversized_tool_results_first() {
    let s = agent_script(10, 2, 1200);
    let cases: Vec<TrimCase> = CASES
        .iter()
        .zip(["gpt-4o-el", "claude-el", "gpt-5-el"])
        .map(|(c, model)| TrimCase { model, ..*c })
        .collect();
    let mut windows = Vec::new();
    for c in &cases {
        let w = upstream_count(c.path, &request(c, &s)).unwrap() * 2 / 3;
        windows.push(format!("{}={w}", c.model));
    }
    let up = upstream(provider()).await;
    let windows = windows.join(",");
    let proxy = proxy(
        &up.url(),
        &["--context-window", &windows, "--on-over", "trim"],
    )
    .await;
    for c in &cases {
        let b = request(c, &s);
        let window = upstream_count(c.path, &b).unwrap() * 2 / 3;
        let (p, _) = post_session(&client_h1(), &proxy.url(c.path), c.model, b.clone()).await;
        let api = c.api.as_str();
        assert_eq!(p.status, 200, "{api}");
        let t = hdr(&p, "x-context-trimmed").expect("trimmed");
        let [before, after, _, tool_results] = trimmed_fields(t);
        assert!(tool_results > 0 && before > after, "{api}: {t}");
        let (_, f) = up.seen.last();
        if let Err(e) = check_trimmed(c.api, &b, &f) {
            panic!("{api}: {e}");
        }
        assert!(
            memchr::memmem::find(&f, b"[tidemark: elided ").is_some(),
            "{api}: no marker"
        );
        let n: u64 = hdr(&p, X_SIM_PROMPT_TOKENS).unwrap().parse().unwrap();
        assert!(
            n as f64 <= 0.95 * window as f64,
            "{api}: upstream counts {n}, window {window}"
        );
    }
    proxy.stop().await;
}

/// Anthropic with the client's four breakpoints: the trimmed request keeps at most four.
#[tokio::test]
async fn trim_anthropic_keeps_at_most_four_breakpoints() {
    let case = &TrimCase {
        model: "claude-bp",
        ..CASES[1]
    };
    let mut s = agent_script(24, 1, 600);
    s.breakpoints = 4;
    let b = request(case, &s);
    let window = upstream_count(case.path, &b).unwrap() * 2 / 3;
    let up = upstream(provider()).await;
    let windows = format!("{}={window}", case.model);
    let proxy = proxy(
        &up.url(),
        &["--context-window", &windows, "--on-over", "trim"],
    )
    .await;
    let (p, body) = post_session(&client_h1(), &proxy.url(case.path), "bp", b.clone()).await;
    assert_eq!(p.status, 200, "{p:?} {}", String::from_utf8_lossy(&body));
    let (_, f) = up.seen.last();
    validate(case.api, &f).unwrap();
    assert!(f.len() < b.len());
    let v: Value = serde_json::from_slice(&f).unwrap();
    assert!(
        cache_controls(&v) <= 4,
        "{} breakpoints",
        cache_controls(&v)
    );
    proxy.stop().await;
}

// ---------------------------------------------------------------- session budget

/// Wait (bounded) until the session has recorded `turns` responses.
async fn wait_turns(proxy: &Proxy, key: &str, turns: u64) {
    within(10, async {
        loop {
            let (p, b) = get(&client_h1(), &proxy.admin_url(&format!("/sessions/{key}"))).await;
            if p.status == 200 {
                let v: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
                if v["turns"].as_u64().unwrap_or(0) >= turns {
                    return;
                }
            }
            tokio::task::yield_now().await;
        }
    })
    .await
}

#[tokio::test]
async fn session_budget_rejects_once_spent() {
    let up = upstream(provider()).await;
    let proxy = proxy(
        &up.url(),
        &[
            "--context-window",
            "gpt-4o-sb=100000,claude-sb=100000",
            "--session-budget",
            "300",
        ],
    )
    .await;
    let c = client_h1();
    // ~210 tokens a request in both APIs' counting ("tidemark" is three
    // tokens in Anthropic's p50k_base, one in cl100k_base).
    let prompt = "the proxy ".repeat(100);
    for (path, key, body) in [
        (
            "/v1/chat/completions",
            "sb-chat",
            json!({"model":"gpt-4o-sb","messages":[{"role":"user","content":prompt}]}),
        ),
        (
            "/v1/messages",
            "sb-ant",
            json!({"model":"claude-sb","max_tokens":16,"messages":[{"role":"user","content":prompt}]}),
        ),
    ] {
        let seen = up.seen.count();
        // Two requests fit: spend 0 then ~200 is not over 300.
        for turn in 1..=2 {
            let (p, _) = post_session(&c, &proxy.url(path), key, body.to_string()).await;
            assert_eq!(p.status, 200, "{key}: request {turn}");
            wait_turns(&proxy, key, turn).await;
        }
        let (p, b) = post_session(&c, &proxy.url(path), key, body.to_string()).await;
        assert_eq!(p.status, 400, "{key}: over the session budget");
        assert_eq!(hdr(&p, "x-tidemark-error"), Some("session-budget"));
        assert_eq!(hdr(&p, "x-should-retry"), Some("false"));
        let v: Value = serde_json::from_slice(&b).unwrap();
        if path == "/v1/messages" {
            assert_eq!(v["type"], "error", "{v}");
            let m = v["error"]["message"].as_str().unwrap();
            assert!(m.starts_with("session_budget_exceeded:"), "{m}");
        } else {
            assert_eq!(v["error"]["code"], "session_budget_exceeded", "{v}");
        }
        assert_eq!(
            up.seen.count(),
            seen + 2,
            "{key}: over-budget request forwarded"
        );
    }
    proxy.stop().await;
}

// ---------------------------------------------------------------- trim + injection

#[tokio::test]
async fn trim_then_inject_usage_on_a_chat_stream() {
    let s = agent_script(24, 1, 600);
    let mut v: Value = serde_json::from_slice(&render(Api::OpenAiChat, &s, false)).unwrap();
    v["model"] = json!("gpt-4o-ti");
    v["stream"] = json!(true);
    let b = serde_json::to_vec(&v).unwrap();
    let window = upstream_count("/v1/chat/completions", &b).unwrap() / 3;
    let up = upstream(provider()).await;
    let windows = format!("gpt-4o-ti={window}");
    let proxy = proxy(
        &up.url(),
        &["--context-window", &windows, "--on-over", "trim"],
    )
    .await;
    let (p, body) = post_session(
        &client_h1(),
        &proxy.url("/v1/chat/completions"),
        "ti",
        b.clone(),
    )
    .await;
    assert_eq!(p.status, 200);
    assert!(hdr(&p, "x-context-trimmed").is_some(), "not trimmed");
    let (_, f) = up.seen.last();
    let fv: Value = serde_json::from_slice(&f).unwrap();
    assert_eq!(
        fv["stream_options"]["include_usage"], true,
        "usage not injected"
    );
    // The trimmed body is what carries the option: strip it and it is a valid trim.
    let mut plain = fv.clone();
    plain.as_object_mut().unwrap().remove("stream_options");
    validate(Api::OpenAiChat, &f).unwrap();
    assert!(plain["messages"].as_array().unwrap().len() < v["messages"].as_array().unwrap().len());
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("\"content\":\"ok\""), "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(
        !text.contains("prompt_tokens"),
        "the client did not ask for usage but received it: {text}"
    );
    let n: u64 = hdr(&p, X_SIM_PROMPT_TOKENS).unwrap().parse().unwrap();
    assert!(n as f64 <= 0.95 * window as f64);
    // The session learned the real count from the injected usage.
    wait_turns(&proxy, "ti", 1).await;
    let (_, sb) = get(&client_h1(), &proxy.admin_url("/sessions/ti")).await;
    let sv: Value = serde_json::from_slice(&sb).unwrap();
    assert_eq!(sv["last_real"], n, "{sv}");
    proxy.stop().await;
}

/// An upstream that refuses `stream_options` gets the trimmed body again,
/// without the option: the retry never resends the untrimmed request.
#[tokio::test]
async fn trim_survives_the_stream_options_retry() {
    let s = agent_script(24, 1, 600);
    let mut v: Value = serde_json::from_slice(&render(Api::OpenAiChat, &s, false)).unwrap();
    v["model"] = json!("gpt-4o-retry");
    v["stream"] = json!(true);
    let b = serde_json::to_vec(&v).unwrap();
    let window = upstream_count("/v1/chat/completions", &b).unwrap() / 3;
    let inner = provider();
    let up = upstream(std::sync::Arc::new(move |req: Request<Bytes>| {
        let inner = std::sync::Arc::clone(&inner);
        Box::pin(async move {
            if memchr::memmem::find(req.body(), b"stream_options").is_some() {
                let mut r = http::Response::new(full(
                    r#"{"error":{"message":"Unrecognized request argument supplied: stream_options","type":"invalid_request_error","param":null,"code":null}}"#,
                ));
                *r.status_mut() = http::StatusCode::BAD_REQUEST;
                return r;
            }
            inner(req).await
        }) as std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>
    }))
    .await;
    let windows = format!("gpt-4o-retry={window}");
    let proxy = proxy(
        &up.url(),
        &["--context-window", &windows, "--on-over", "trim"],
    )
    .await;
    let (p, body) = post_session(
        &client_h1(),
        &proxy.url("/v1/chat/completions"),
        "retry",
        b.clone(),
    )
    .await;
    assert_eq!(p.status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(hdr(&p, "x-context-trimmed").is_some());
    let seen = up.seen.requests.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "one refused attempt, one retry");
    let (first, retry) = (&seen[0].1, &seen[1].1);
    assert!(memchr::memmem::find(retry, b"stream_options").is_none());
    check_trimmed(Api::OpenAiChat, &b, retry).unwrap();
    let fv: Value = serde_json::from_slice(first).unwrap();
    let rv: Value = serde_json::from_slice(retry).unwrap();
    assert_eq!(fv["messages"], rv["messages"], "the retry is the same trim");
    proxy.stop().await;
}

/// A gzip-encoded request is trimmed from its decoded body and forwarded
/// as plain JSON without `content-encoding`.
#[tokio::test]
async fn trim_a_gzip_request() {
    use std::io::Write;
    let case = &TrimCase {
        model: "gpt-4o-gz",
        ..CASES[0]
    };
    let s = agent_script(24, 1, 600);
    let b = request(case, &s);
    let window = upstream_count(case.path, &b).unwrap() / 3;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&b).unwrap();
    let gz = gz.finish().unwrap();
    let up = upstream(provider()).await;
    let windows = format!("{}={window}", case.model);
    let proxy = proxy(
        &up.url(),
        &["--context-window", &windows, "--on-over", "trim"],
    )
    .await;
    let req = Request::post(proxy.url(case.path))
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .header("x-session-id", "gz")
        .body(full(gz))
        .unwrap();
    let (p, _) = send(&client_h1(), req).await;
    assert_eq!(p.status, 200);
    assert!(hdr(&p, "x-context-trimmed").is_some());
    let (parts, f) = up.seen.last();
    assert!(parts.headers.get("content-encoding").is_none());
    check_trimmed(case.api, &b, &f).unwrap();
    proxy.stop().await;
}
