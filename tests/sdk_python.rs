//! The official Python SDKs as clients: a rejection raises their own
//! `BadRequestError` with the provider's code/message, and they do not retry
//! (the upstream sees nothing, the proxy sees each request once). With
//! `--on-over trim` a long tool-using conversation goes through, the SDK
//! parses the answer, and the upstream receives a valid, smaller request.
//! `scripts/test.sh` installs `openai` and `anthropic` from PyPI into
//! `target/venv`.

mod support;

use std::process::Command;

use serde_json::{json, Value};
use tidemark::provider::Api;
use tidemark::sim::{count_prompt, SimApi};

use support::*;

/// The interpreter with the SDKs: `TIDEMARK_PYTHON` (scripts/test.sh sets
/// it), else the project's virtual environment that script makes, else
/// `python3`.
fn python() -> String {
    if let Ok(p) = std::env::var("TIDEMARK_PYTHON") {
        return p;
    }
    let venv = format!("{}/target/venv/bin/python", env!("CARGO_MANIFEST_DIR"));
    match std::path::Path::new(&venv).exists() {
        true => venv,
        false => "python3".to_string(),
    }
}

/// Run `tests/sdk/NAME` against `base`; panic with its output unless it prints OK.
async fn run_script(name: &str, base: String) {
    let script = format!("{}/tests/sdk/{name}", env!("CARGO_MANIFEST_DIR"));
    let out = within(120, async move {
        tokio::task::spawn_blocking(move || Command::new(python()).arg(script).arg(base).output())
            .await
            .expect("join")
    })
    .await
    .expect("a Python interpreter (scripts/test.sh makes target/venv with the SDKs)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("OK"),
        "SDK script {name} failed (run scripts/test.sh to install openai/anthropic):\n{stdout}\n{stderr}"
    );
}

/// Sum of the samples of `name` whose labels include every pair.
async fn metric(proxy: &Proxy, name: &str, labels: &[(&str, &str)]) -> f64 {
    let (_, body) = get(&client_h1(), &proxy.admin_url("/metrics")).await;
    String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn sdks_see_rejections_as_their_own_errors_and_do_not_retry() {
    let up = upstream(handler(|_req| http::Response::new(full("{}")))).await;
    let proxy = proxy(
        &up.url(),
        &[
            "--route",
            &format!("/v1/messages={}", up.url()),
            "--context-window",
            "gpt-4o=2000,claude-*=2000",
            "--on-over",
            "reject",
        ],
    )
    .await;
    run_script("reject.py", proxy.url("")).await;
    // Counted at the proxy: an SDK that retried would show more than one
    // request per API.
    for (api, model) in [
        ("openai-chat", "gpt-4o"),
        ("openai-responses", "gpt-4o"),
        ("anthropic-messages", "claude-sonnet-4-5"),
    ] {
        let n = metric(
            &proxy,
            "tidemark_requests_total",
            &[("api", api), ("model", model)],
        )
        .await;
        assert_eq!(n, 1.0, "{api}: the SDK sent {n} requests (a retry?)");
    }
    assert_eq!(
        up.seen.count(),
        0,
        "a rejected request must never reach the upstream"
    );
}

/// Chat and Anthropic answers with usage from the simulated provider's own count.
fn answer(req: http::Request<bytes::Bytes>) -> http::Response<Body> {
    let v: Value = serde_json::from_slice(req.body()).unwrap_or(Value::Null);
    let model = v["model"].as_str().unwrap_or("m").to_string();
    let body = if req.uri().path().ends_with("/messages") {
        let n = count_prompt(SimApi::Anthropic, &v).total;
        json!({"id":"msg_t","type":"message","role":"assistant","model":model,
            "content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn",
            "stop_sequence":null,"usage":{"input_tokens":n,"output_tokens":1}})
    } else {
        let n = count_prompt(SimApi::OpenAiChat, &v).total;
        json!({"id":"chatcmpl-t","object":"chat.completion","created":1,"model":model,
            "choices":[{"index":0,"message":{"role":"assistant","content":"ok"},
            "finish_reason":"stop"}],
            "usage":{"prompt_tokens":n,"completion_tokens":1,"total_tokens":n + 1}})
    };
    let mut r = http::Response::new(full(body.to_string()));
    r.headers_mut().insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    r
}

#[tokio::test]
async fn sdks_send_long_tool_conversations_through_trim() {
    const WINDOW: u64 = 4000;
    let up = upstream(handler(answer)).await;
    let windows = format!("gpt-4o-sdktrim={WINDOW},claude-sdktrim={WINDOW}");
    let proxy = proxy(
        &up.url(),
        &[
            "--route",
            &format!("/v1/messages={}", up.url()),
            "--context-window",
            &windows,
            "--on-over",
            "trim",
        ],
    )
    .await;
    run_script("trim.py", proxy.url("")).await;
    let seen = up.seen.requests.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "one forwarded request per SDK");
    for (parts, body) in seen {
        let (api, sim) = if parts.uri.path().ends_with("/messages") {
            (Api::Anthropic, SimApi::Anthropic)
        } else {
            (Api::OpenAiChat, SimApi::OpenAiChat)
        };
        if let Err(e) = support::trim::validate(api, &body) {
            panic!("{api:?}: forwarded body invalid: {e}");
        }
        let v: Value = serde_json::from_slice(&body).unwrap();
        let n = count_prompt(sim, &v).total;
        assert!(
            n as f64 <= 0.95 * WINDOW as f64,
            "{api:?}: the upstream counts {n} tokens, over the line"
        );
        if api == Api::Anthropic {
            assert!(support::trim::cache_controls(&v) <= 4);
        }
    }
}
