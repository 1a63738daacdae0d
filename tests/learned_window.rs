//! Windows learned from the provider: a context-length refusal, in each
//! provider's own words, teaches the window the endpoint enforces; it
//! replaces the table's value in `window=`, `util`, the policies and
//! `tidemark_context_window_tokens`, and the prompt size it names anchors
//! the lane. Through the real proxy in front of the simulated provider,
//! which refuses in each server's real wording.
mod support;
use support::{sim, Sim};

use serde_json::{json, Value};
use support::{client_h1, get, send, Proxy};
use tidemark::sim::{count_prompt, Flavour, SimApi, SimConfig, X_SIM_PROMPT_TOKENS};

/// The window every simulated server enforces here.
const W: u64 = 2000;

fn small(flavour: Flavour) -> SimConfig {
    SimConfig {
        context_window: Some(W),
        flavour,
        ..SimConfig::default()
    }
}

async fn proxy_for(s: &Sim, extra: &[&str]) -> Proxy {
    let route = format!("/v1/messages={}", s.url);
    let mut args = vec!["--route", route.as_str()];
    args.extend_from_slice(extra);
    support::proxy(&s.url, &args).await
}

/// A user message of about `words` words, the same every time.
fn long_text(words: usize) -> String {
    (0..words)
        .map(|i| format!("w{} ", i % 97))
        .collect::<String>()
}

/// One request of each shape, about 3,000 tokens (over [`W`]).
fn request(api: &str, model: &str) -> (String, Value, SimApi) {
    let text = long_text(1500);
    match api {
        "anthropic" => (
            "/v1/messages".into(),
            json!({"model":model,"max_tokens":64,"messages":[{"role":"user","content":text}]}),
            SimApi::Anthropic,
        ),
        "gemini" => (
            format!("/v1beta/models/{model}:generateContent"),
            json!({"contents":[{"role":"user","parts":[{"text":text}]}]}),
            SimApi::Gemini,
        ),
        "responses" => (
            "/v1/responses".into(),
            json!({"model":model,"input":text,"store":false}),
            SimApi::OpenAiResponses,
        ),
        "ollama" => (
            "/api/chat".into(),
            json!({"model":model,"stream":false,"options":{"num_ctx":W},"messages":[{"role":"user","content":"an early question"},{"role":"assistant","content":"an answer"},{"role":"user","content":text}]}),
            SimApi::Ollama,
        ),
        _ => (
            "/v1/chat/completions".into(),
            json!({"model":model,"messages":[{"role":"user","content":text}]}),
            SimApi::OpenAiChat,
        ),
    }
}

struct Answer {
    status: u16,
    headers: http::HeaderMap,
    body: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// `x-context-projection` as (tokens, src, window, util).
    fn projection(&self) -> (u64, String, Option<u64>, Option<f64>) {
        let h = self
            .header("x-context-projection")
            .expect("projection header");
        let mut parts = h.split(';');
        let tokens = parts.next().unwrap().parse().unwrap();
        let (mut src, mut window, mut util) = (String::new(), None, None);
        for p in parts {
            match p.split_once('=') {
                Some(("src", v)) => src = v.to_string(),
                Some(("window", v)) => window = v.parse().ok(),
                Some(("util", v)) => util = v.parse().ok(),
                _ => {}
            }
        }
        (tokens, src, window, util)
    }
    fn message(&self) -> String {
        self.body
            .pointer("/error/message")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    }
}

async fn call(px: &Proxy, path: &str, body: &Value, session: &str) -> Answer {
    let c = client_h1();
    let req = http::Request::post(px.url(path))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-window")
        .header("x-api-key", "sk-window")
        .header("x-session-id", session)
        .body(support::full(body.to_string()))
        .unwrap();
    let (parts, bytes) = send(&c, req).await;
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    }
}

/// The value of `tidemark_context_window_tokens{api,model}`.
async fn window_gauge(px: &Proxy, api: &str, model: &str) -> Option<f64> {
    let (_, body) = get(&client_h1(), &px.admin_url("/metrics")).await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    let want = format!("tidemark_context_window_tokens{{api=\"{api}\",model=\"{model}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(want.as_str()))
        .map(|v| v.parse().unwrap())
}

async fn session(px: &Proxy, key: &str) -> Value {
    let (parts, body) = get(&client_h1(), &px.admin_url(&format!("/sessions/{key}"))).await;
    assert_eq!(parts.status, 200, "{key}");
    serde_json::from_slice(&body).unwrap()
}

/// The refusal teaches W; the prompt it names anchors the lane, so the same
/// body sent again is projected at exactly the provider's count and, over
/// the learned window, refused by tidemark in the provider's own words
/// before the provider sees it.
async fn learns(
    api: &str,
    metric_api: &str,
    flavour: Flavour,
    model: &str,
    table: u64,
    exact: bool,
) {
    let s = sim(small(flavour)).await;
    let px = proxy_for(&s, &["--on-over", "reject"]).await;
    let (path, body, sim_api) = request(api, model);
    let real = count_prompt(sim_api, &body).total;
    assert!(real > W, "{api}: the body must be over the window ({real})");
    let key = format!("learn-{api}-{flavour:?}");

    // The table's window: tidemark lets it through, the provider refuses.
    let first = call(&px, &path, &body, &key).await;
    assert_eq!(first.status, 400, "{api}: {:?}", first.body);
    assert!(
        first.header(X_SIM_PROMPT_TOKENS).is_some(),
        "{api}: the provider's"
    );
    assert_eq!(first.projection().2, Some(table), "{api}");
    assert_eq!(
        window_gauge(&px, metric_api, model).await,
        Some(table as f64),
        "{api}"
    );

    // Learned: the same body is refused by tidemark, never sent.
    let second = call(&px, &path, &body, &key).await;
    let (tokens, src, window, util) = second.projection();
    assert_eq!(window, Some(W), "{api}: the learned window");
    assert_eq!(second.status, 400, "{api}");
    assert_eq!(
        second.header("x-tidemark-error"),
        Some("context-budget"),
        "{api}"
    );
    assert!(
        second.header(X_SIM_PROMPT_TOKENS).is_none(),
        "{api}: not sent"
    );
    assert_eq!(
        window_gauge(&px, metric_api, model).await,
        Some(W as f64),
        "{api}"
    );
    let lane = session(&px, &key).await;
    assert_eq!(lane["window"], json!(W), "{api}: {lane}");
    if exact {
        // The refusal's count anchored the lane: the projection is the
        // provider's own number, and so is the refusal's.
        assert_eq!((tokens, src.as_str()), (real, "anchored"), "{api}");
        assert_eq!(lane["anchor"]["real"], json!(real), "{api}: {lane}");
        let u = util.unwrap();
        assert!((u - real as f64 / W as f64).abs() < 0.001, "{api}: {u}");
        let msg = second.message();
        assert!(
            msg.contains(&real.to_string()) && msg.contains(&W.to_string()),
            "{api}: {msg}"
        );
    } else {
        // vLLM names a lower bound only: no anchor from it.
        assert_ne!(src, "anchored", "{api}");
        assert!(lane["anchor"].is_null(), "{api}: {lane}");
    }
    px.stop().await;
}

#[tokio::test]
async fn openai_chat_refusal_teaches_window_and_prompt() {
    learns(
        "chat",
        "openai-chat",
        Flavour::OpenAi,
        "gpt-4o",
        128_000,
        true,
    )
    .await;
}

#[tokio::test]
async fn anthropic_refusal_teaches_window_and_prompt() {
    learns(
        "anthropic",
        "anthropic-messages",
        Flavour::OpenAi,
        "claude-sonnet-4-5",
        200_000,
        true,
    )
    .await;
}

#[tokio::test]
async fn gemini_refusal_teaches_window_and_prompt() {
    learns(
        "gemini",
        "gemini",
        Flavour::OpenAi,
        "gemini-2.5-flash",
        1_048_576,
        true,
    )
    .await;
}

#[tokio::test]
async fn llama_cpp_refusal_teaches_window_and_prompt() {
    learns(
        "chat",
        "openai-chat",
        Flavour::LlamaCpp,
        "llama3.2",
        131_072,
        true,
    )
    .await;
}

#[tokio::test]
async fn vllm_refusal_teaches_the_window_its_lower_bound_anchors_nothing() {
    learns(
        "chat",
        "openai-chat",
        Flavour::Vllm,
        "qwen3-8b",
        40_960,
        false,
    )
    .await;
}

/// The Responses API's refusal names no numbers: nothing is learned, over
/// HTTP (a 400) or in a stream (`response.failed` after a 200).
#[tokio::test]
async fn responses_refusal_teaches_nothing() {
    let s = sim(small(Flavour::OpenAi)).await;
    let px = proxy_for(&s, &["--on-over", "reject"]).await;
    let (path, body, _) = request("responses", "gpt-5");
    for round in 0..2 {
        let r = call(&px, &path, &body, "learn-responses").await;
        assert_eq!(r.status, 400, "round {round}: {:?}", r.body);
        assert!(
            r.header(X_SIM_PROMPT_TOKENS).is_some(),
            "the provider's, again"
        );
        assert_eq!(r.projection().2, Some(400_000), "round {round}");
        assert!(r.message().contains("exceeds the context window"));
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = call(&px, &path, &streamed, "learn-responses").await;
    assert_eq!(r.status, 200);
    let r = call(&px, &path, &body, "learn-responses").await;
    assert_eq!(r.projection().2, Some(400_000));
    assert_eq!(
        window_gauge(&px, "openai-responses", "gpt-5").await,
        Some(400_000.0)
    );
    px.stop().await;
}

/// Ollama refuses nothing: over `num_ctx` it drops the oldest messages and
/// counts what it kept. The window stays the table's; the count the lane
/// anchors on is the truncated prompt's.
#[tokio::test]
async fn ollama_truncates_and_teaches_nothing() {
    let s = sim(SimConfig::default()).await;
    let px = proxy_for(&s, &[]).await;
    let (path, body, sim_api) = request("ollama", "llama3.2");
    let full = count_prompt(sim_api, &body).total;
    assert!(full > W);
    let r = call(&px, &path, &body, "learn-ollama").await;
    assert_eq!(r.status, 200);
    let kept = r.body["prompt_eval_count"].as_u64().unwrap();
    assert!(kept <= W && kept < full, "{kept} of {full}");
    let again = call(&px, &path, &body, "learn-ollama").await;
    assert_eq!(again.projection().2, Some(131_072));
    let lane = session(&px, "learn-ollama").await;
    assert_eq!(lane["anchor"]["real"], json!(kept), "{lane}");
    px.stop().await;
}

/// An explicit `--context-window` is the operator's word: a refusal is
/// still remembered, but the flag's window is the one in use.
#[tokio::test]
async fn a_flag_wins_over_what_was_learned() {
    let s = sim(small(Flavour::OpenAi)).await;
    let px = proxy_for(&s, &["--context-window", "gpt-4o*=64000"]).await;
    let (path, body, sim_api) = request("chat", "gpt-4o");
    for _ in 0..2 {
        let r = call(&px, &path, &body, "learn-flag").await;
        assert_eq!(r.status, 400);
        assert_eq!(r.projection().2, Some(64_000));
    }
    // The refusal's count still anchored the lane.
    let real = count_prompt(sim_api, &body).total;
    assert_eq!(
        session(&px, "learn-flag").await["anchor"]["real"],
        json!(real)
    );
    assert_eq!(
        window_gauge(&px, "openai-chat", "gpt-4o").await,
        Some(64_000.0)
    );
    px.stop().await;
}

/// A window learned for one upstream does not apply to another upstream
/// serving the same model, and a compressed refusal teaches as a plain one.
#[tokio::test]
async fn learned_per_upstream_from_a_gzipped_refusal() {
    use std::io::Write;
    let refusal = r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 2345 tokens > 2000 maximum"},"request_id":"req_1"}"#;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(refusal.as_bytes()).unwrap();
    let gz = bytes::Bytes::from(gz.finish().unwrap());
    let gateway = support::upstream(support::handler(move |_req| {
        http::Response::builder()
            .status(400)
            .header("content-type", "application/json")
            .header("content-encoding", "gzip")
            .body(support::full(gz.clone()))
            .unwrap()
    }))
    .await;
    let other = sim(SimConfig::default()).await;
    let route = format!("/v1/messages={}", gateway.url());
    let px = support::proxy(&other.url, &["--route", &route]).await;
    let body = json!({"model":"claude-sonnet-4-5","max_tokens":64,
        "messages":[{"role":"user","content":"hello"}]});
    let first = call(&px, "/v1/messages", &body, "learn-gzip").await;
    assert_eq!(first.status, 400);
    assert_eq!(
        first.body,
        Value::Null,
        "the client got the compressed bytes"
    );
    let again = call(&px, "/v1/messages", &body, "learn-gzip").await;
    assert_eq!(again.projection().2, Some(2000));
    assert_eq!(
        session(&px, "learn-gzip").await["anchor"]["real"],
        json!(2345)
    );
    // The default upstream serves Claude through the chat path: its own window.
    let chat = json!({"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hi"}]});
    let r = call(&px, "/v1/chat/completions", &chat, "learn-gzip-other").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.projection().2, Some(200_000));
    px.stop().await;
}
