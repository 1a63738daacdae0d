//! SPEC §7: every metric is exported with its type and labels after mixed
//! traffic, the model label is capped, and a real Prometheus scraping a live
//! tidemark answers every query of the Grafana dashboard.

mod support;
use support::faults;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use support::*;
use tidemark::sim::{SimConfig, X_SIM_FAULT};

/// (name, type, labels) exactly as SPEC §7 lists them.
const SPEC: &[(&str, &str, &[&str])] = &[
    (
        "tidemark_requests_total",
        "counter",
        &["api", "model", "code"],
    ),
    ("tidemark_request_duration_seconds", "histogram", &["api"]),
    ("tidemark_time_to_first_byte_seconds", "histogram", &["api"]),
    ("tidemark_proxy_overhead_seconds", "histogram", &["api"]),
    (
        "tidemark_prompt_tokens_real_total",
        "counter",
        &["api", "model"],
    ),
    (
        "tidemark_prompt_tokens_estimated_total",
        "counter",
        &["api", "model"],
    ),
    (
        "tidemark_cached_prompt_tokens_total",
        "counter",
        &["api", "model"],
    ),
    ("tidemark_output_tokens_total", "counter", &["api", "model"]),
    ("tidemark_estimate_drift_ratio", "gauge", &["api", "model"]),
    (
        "tidemark_projection_drift_ratio",
        "gauge",
        &["api", "model"],
    ),
    (
        "tidemark_class_drift_ratio",
        "gauge",
        &["api", "model", "class"],
    ),
    (
        "tidemark_estimate_error_ratio",
        "histogram",
        &["api", "model"],
    ),
    (
        "tidemark_projection_error_ratio",
        "histogram",
        &["api", "model"],
    ),
    (
        "tidemark_context_utilization",
        "histogram",
        &["api", "model"],
    ),
    ("tidemark_sessions", "gauge", &["state"]),
    ("tidemark_lanes", "gauge", &[]),
    ("tidemark_anchor_lost_total", "counter", &["api", "model"]),
    ("tidemark_usage_missing_total", "counter", &["api", "model"]),
    (
        "tidemark_compactions_detected_total",
        "counter",
        &["api", "model"],
    ),
    (
        "tidemark_over_budget_total",
        "counter",
        &["api", "model", "action"],
    ),
    (
        "tidemark_trimmed_tokens_total",
        "counter",
        &["api", "model"],
    ),
    ("tidemark_usage_injected_total", "counter", &["api"]),
    ("tidemark_upstream_errors_total", "counter", &["kind"]),
    ("tidemark_usage_parse_errors_total", "counter", &["api"]),
    ("tidemark_limits_hit_total", "counter", &["limit"]),
    ("tidemark_state_backend_errors_total", "counter", &[]),
    ("tidemark_up", "gauge", &[]),
    ("tidemark_websockets", "gauge", &["api"]),
    ("tidemark_context_window_tokens", "gauge", &["api", "model"]),
    (
        "tidemark_cache_invalidated_tokens_total",
        "counter",
        &["api", "model"],
    ),
    (
        "tidemark_cache_busts_total",
        "counter",
        &["api", "model", "cause"],
    ),
];

/// The values each single label of SPEC §7 takes, all exported from start-up.
const LABEL_VALUES: &[(&str, &[&str])] = &[
    (
        "api",
        &[
            "openai-chat",
            "openai-responses",
            "anthropic-messages",
            "gemini",
            "ollama",
            "other",
        ],
    ),
    ("kind", &["connect", "timeout", "reset", "tls"]),
    ("state", &["new", "anchored", "calibrated", "lost"]),
    (
        "limit",
        &[
            "body",
            "body_timeout",
            "header_timeout",
            "headers",
            "connections",
        ],
    ),
];

/// An upstream that answers like each provider, from the fixtures; a request
/// whose last user message says "no-usage" gets a response without usage,
/// "garbage" a malformed stream.
fn provider_upstream() -> Handler {
    let n = Arc::new(AtomicU64::new(0));
    handler(move |req: Request<Bytes>| {
        n.fetch_add(1, Ordering::Relaxed);
        let path = req.uri().path().to_string();
        let body = String::from_utf8_lossy(req.body()).to_string();
        let no_usage = body.contains("no-usage");
        let (ct, file) = if body.contains("garbage") {
            return Response::builder()
                .header("content-type", "text/event-stream")
                .body(full("data: {\"usage\": {broken\n\n"))
                .unwrap();
        } else if path.ends_with("/chat/completions") {
            if body.contains("\"stream\":true") {
                if no_usage || !body.contains("include_usage") {
                    ("text/event-stream", "openai-chat/stream_no_usage.sse")
                } else {
                    (
                        "text/event-stream",
                        "openai-chat/stream_basic_with_usage.sse",
                    )
                }
            } else {
                ("application/json", "openai-chat/nonstream_basic.json")
            }
        } else if path.ends_with("/messages") {
            (
                "text/event-stream",
                if no_usage {
                    "anthropic-messages/stream_error_overloaded.sse"
                } else {
                    "anthropic-messages/stream_prompt_caching.sse"
                },
            )
        } else if path.ends_with("/responses") {
            ("text/event-stream", "openai-responses/stream_basic.sse")
        } else if path.contains(":streamGenerateContent") {
            ("text/event-stream", "gemini/stream_cached_content.sse")
        } else if path.ends_with("/api/chat") {
            ("application/x-ndjson", "ollama/api_chat_stream.ndjson")
        } else {
            ("application/json", "openai-chat/nonstream_basic.json")
        };
        Response::builder()
            .header("content-type", ct)
            .body(full(fixture(file)))
            .unwrap()
    })
}

fn chat(model: &str, turns: usize, extra: &str, stream: bool) -> String {
    let mut msgs = vec![r#"{"role":"system","content":"You are terse."}"#.to_string()];
    for i in 0..turns {
        msgs.push(format!(
            r#"{{"role":"user","content":"question {i} {extra} 日本語 🚀 {{\"k\":[1,2,3]}}"}}"#
        ));
        if i + 1 < turns {
            msgs.push(format!(r#"{{"role":"assistant","content":"answer {i}"}}"#));
        }
    }
    let so = if stream { r#","stream":true"# } else { "" };
    format!(
        r#"{{"model":"{model}"{so},"messages":[{}]}}"#,
        msgs.join(",")
    )
}

async fn post_with(
    c: &TestClient,
    url: &str,
    body: String,
    headers: &[(&str, &str)],
) -> (http::response::Parts, Bytes) {
    let mut b = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    send(c, b.body(full(body)).unwrap()).await
}

/// Traffic that touches every metric family.
async fn mixed_traffic(px: &Proxy, trim_px: &Proxy, reject_px: &Proxy) {
    let c = client_h1();
    let u = |p: &str| px.url(p);
    // Sessions over several turns on every API, with a compaction and a loss.
    for s in 0..3 {
        let sid = format!("metrics-s{s}");
        for t in 1..=4 {
            post_with(
                &c,
                &u("/v1/chat/completions"),
                chat("gpt-4o", t, "", false),
                &[("x-session-id", &sid)],
            )
            .await;
        }
        // shrink: a compaction
        post_with(
            &c,
            &u("/v1/chat/completions"),
            chat("gpt-4o", 1, "", false),
            &[("x-session-id", &sid)],
        )
        .await;
        // stream without include_usage: injected
        post_with(
            &c,
            &u("/v1/chat/completions"),
            chat("gpt-4o", 2, "", true),
            &[("x-session-id", &sid)],
        )
        .await;
        // no usage twice: anchor lost (the marker in the last message
        // only: the conversation, and so its lane, stays the same)
        post_with(
            &c,
            &u("/v1/chat/completions"),
            chat("gpt-4o", 3, "", true)
                .replace("question 2 ", "question 2 no-usage ")
                .replace(
                    "\"stream\":true",
                    "\"stream\":true,\"stream_options\":{\"include_usage\":true}",
                ),
            &[("x-session-id", &sid)],
        )
        .await;
        post_with(
            &c,
            &u("/v1/chat/completions"),
            chat("gpt-4o", 4, "", false),
            &[("x-session-id", &sid)],
        )
        .await;
    }
    let anth = |t: usize| {
        format!(
            r#"{{"model":"claude-sonnet-4-5","max_tokens":64,"stream":true,"system":"be brief","messages":[{}]}}"#,
            (0..t)
                .map(|i| format!(
                    r#"{{"role":"user","content":"q{i}"}},{{"role":"assistant","content":"a{i}"}}"#
                ))
                .collect::<Vec<_>>()
                .join(",")
                + r#",{"role":"user","content":"next"}"#
        )
    };
    for t in 0..3 {
        post_with(
            &c,
            &u("/v1/messages"),
            anth(t),
            &[("x-session-id", "metrics-anth")],
        )
        .await;
    }
    post_with(
        &c,
        &u("/v1/responses"),
        r#"{"model":"gpt-4o","stream":true,"input":"hello"}"#.into(),
        &[],
    )
    .await;
    post_with(
        &c,
        &u("/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"),
        r#"{"contents":[{"role":"user","parts":[{"text":"hi"}]}]}"#.into(),
        &[],
    )
    .await;
    post_with(
        &c,
        &u("/api/chat"),
        r#"{"model":"llama3.2","messages":[{"role":"user","content":"hi"}]}"#.into(),
        &[],
    )
    .await;
    // A malformed stream: a usage parse error.
    post_with(
        &c,
        &u("/v1/chat/completions"),
        chat("gpt-4o", 1, "garbage", true).replace(
            "\"stream\":true",
            "\"stream\":true,\"stream_options\":{\"include_usage\":true}",
        ),
        &[],
    )
    .await;
    // Over budget on a tiny window: pass here, reject and trim on the others.
    for p in [px, reject_px, trim_px] {
        let body = chat("tiny-model", 12, &"long words here ".repeat(20), false);
        post_with(
            &c,
            &p.url("/v1/chat/completions"),
            body,
            &[("x-session-id", "metrics-tiny")],
        )
        .await;
    }
}

fn parse_exposition(text: &str) -> (BTreeMap<String, String>, BTreeMap<String, BTreeSet<String>>) {
    let mut types = BTreeMap::new();
    let mut labels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut it = rest.split_whitespace();
            if let (Some(n), Some(t)) = (it.next(), it.next()) {
                types.insert(n.to_string(), t.to_string());
            }
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name, rest) = match line.find('{') {
            Some(i) => (&line[..i], &line[i + 1..]),
            None => continue,
        };
        let set = labels.entry(name.to_string()).or_default();
        for kv in rest.split("\",") {
            if let Some((k, _)) = kv.split_once("=\"") {
                set.insert(k.trim().to_string());
            }
        }
    }
    (types, labels)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_spec_metric_has_its_type_and_labels_and_prometheus_answers_the_dashboard() {
    let up = upstream(provider_upstream()).await;
    let dead = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        drop(l);
        a
    };
    let route = format!("/v1/messages={}", up.url());
    let win = "tiny-*=300";
    let px = proxy(
        &up.url(),
        &[
            "--route",
            &route,
            "--route",
            &format!("/dead=http://{dead}"),
            "--context-window",
            win,
        ],
    )
    .await;
    let reject_px = proxy(
        &up.url(),
        &[
            "--route",
            &route,
            "--context-window",
            win,
            "--on-over",
            "reject",
        ],
    )
    .await;
    let trim_px = proxy(
        &up.url(),
        &[
            "--route",
            &route,
            "--context-window",
            win,
            "--on-over",
            "trim",
            "--trim-to",
            "0.5",
        ],
    )
    .await;
    mixed_traffic(&px, &trim_px, &reject_px).await;
    // An unreachable upstream: upstream_errors{kind="connect"}.
    let c = client_h1();
    get(&c, &px.url("/dead/v1/models")).await;

    let (_, text) = get(&c, &px.admin_url("/metrics")).await;
    let text = String::from_utf8(text.to_vec()).unwrap();
    let (types, labels) = parse_exposition(&text);
    let mut problems = Vec::new();
    for (name, ty, want) in SPEC {
        match types.get(*name) {
            None => problems.push(format!("{name}: not exported")),
            Some(t) if t != ty => problems.push(format!("{name}: type {t}, want {ty}")),
            _ => {}
        }
        let series = if *ty == "histogram" {
            format!("{name}_bucket")
        } else {
            name.to_string()
        };
        let mut got: BTreeSet<String> = labels.get(&series).cloned().unwrap_or_default();
        got.remove("le");
        let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
        if got != want {
            problems.push(format!("{name}: labels {got:?}, want {want:?}"));
        }
    }
    assert!(
        problems.is_empty(),
        "metric problems:\n{}",
        problems.join("\n")
    );

    // A real Prometheus scrapes this live tidemark and answers every dashboard query.
    let script = format!("{}/scripts/check-prometheus.sh", env!("CARGO_MANIFEST_DIR"));
    let traffic = {
        let url = px.url("/v1/chat/completions");
        tokio::spawn(async move {
            let c = client_h1();
            for i in 0..100_000u64 {
                post_with(
                    &c,
                    &url,
                    chat("gpt-4o", (i % 5 + 1) as usize, "", false),
                    &[("x-session-id", "metrics-live")],
                )
                .await;
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        })
    };
    let out = within(
        300,
        tokio::process::Command::new("bash")
            .arg(&script)
            .arg(px.admin.to_string())
            .output(),
    )
    .await
    .expect("check-prometheus.sh runs");
    traffic.abort();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "check-prometheus.sh failed:\n{stdout}\n{stderr}"
    );

    px.stop().await;
    reject_px.stop().await;
    trim_px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_random_models_leave_at_most_201_model_label_values() {
    let up = upstream(provider_upstream()).await;
    let px = proxy(&up.url(), &[]).await;
    let c = client_h1();
    let mut x: u64 = 0x9e3779b97f4a7c15;
    for _ in 0..1000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let body =
            format!(r#"{{"model":"m-{x:016x}","messages":[{{"role":"user","content":"hi"}}]}}"#);
        post_json(&c, &px.url("/v1/chat/completions"), &body).await;
    }
    let (_, text) = get(&c, &px.admin_url("/metrics")).await;
    let text = String::from_utf8(text.to_vec()).unwrap();
    let models: BTreeSet<&str> = text
        .lines()
        .filter(|l| l.starts_with("tidemark_requests_total{"))
        .filter_map(|l| l.split("model=\"").nth(1).and_then(|r| r.split('"').next()))
        .collect();
    assert!(models.len() <= 201, "{} model label values", models.len());
    assert!(models.contains("other"), "overflow collapses into other");
    px.stop().await;
}

/// A port nobody listens on right now (bound, then released).
async fn free_port() -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().port()
}

/// Write a raw request, then read what comes back until the server closes
/// or `secs` pass.
async fn raw(addr: &str, request: &[u8], half_close: bool, secs: u64) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = within(5, tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();
    let _ = s.write_all(request).await;
    if half_close {
        let _ = s.shutdown().await;
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// SPEC §7, read off a process of its own right after it starts (the
/// metrics of a test binary are shared by its tests): every family is
/// exported, and each series labelled by `api`, `kind`, `state` or `limit`
/// alone is there at zero for every value. Then the requests tidemark
/// answers itself (413, 408, 400 on an API path; 502 on a path it does not
/// read) are counted and timed like every other, and an upstream that
/// resets or goes silent mid-stream is counted by kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_family_is_exported_from_start_up_and_tidemarks_own_answers_are_counted() {
    // The sim plays the provider; each mid-stream fault is asked for by header.
    let up = support::sim(SimConfig::default()).await;
    let dead = format!("127.0.0.1:{}", free_port().await);
    let (listen, admin) = (
        format!("127.0.0.1:{}", free_port().await),
        format!("127.0.0.1:{}", free_port().await),
    );
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args([
            "--listen",
            &listen,
            "--admin-listen",
            &admin,
            "--upstream",
            &up.url,
            "--route",
            &format!("/dead=http://{dead}"),
            "--max-body-bytes",
            "1000",
            "--header-read-timeout",
            "500ms",
            "--idle-timeout",
            "300ms",
        ])
        .env_remove("TIDEMARK_ADMIN_TOKEN")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let c = client_h1();
    let metrics_url = format!("http://{admin}/metrics");
    let page = within(20, async {
        loop {
            let req = Request::get(&metrics_url).body(full("")).unwrap();
            if let Ok(Ok(resp)) =
                tokio::time::timeout(std::time::Duration::from_secs(2), c.request(req)).await
            {
                let body = http_body_util::BodyExt::collect(resp.into_body())
                    .await
                    .unwrap()
                    .to_bytes();
                break String::from_utf8(body.to_vec()).unwrap();
            }
            assert!(child.try_wait().unwrap().is_none(), "exited at start");
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    })
    .await;

    // Right after start-up: every family, and every single-label value at 0.
    let (types, _) = parse_exposition(&page);
    let mut problems = Vec::new();
    for (name, ty, labels) in SPEC {
        match types.get(*name) {
            None => problems.push(format!("{name}: not exported at start-up")),
            Some(t) if t != ty => problems.push(format!("{name}: type {t}, want {ty}")),
            _ => {}
        }
        let [label] = labels else { continue };
        let Some(&(_, mut values)) = LABEL_VALUES.iter().find(|(l, _)| l == label) else {
            continue;
        };
        // Its `api` is the Responses API or `none` (SPEC §7).
        if *name == "tidemark_websockets" {
            values = &["openai-responses", "none"];
        }
        let series = match *ty {
            "histogram" => format!("{name}_count"),
            _ => name.to_string(),
        };
        for v in values {
            let line = format!("{series}{{{label}=\"{v}\"}} 0");
            if !page.lines().any(|l| l == line) {
                problems.push(format!("no `{line}` at start-up"));
            }
        }
    }
    assert!(problems.is_empty(), "{}\n\n{page}", problems.join("\n"));

    // tidemark's own answers.
    let chat =
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n";
    let a = raw(
        &listen,
        format!("{chat}content-length: 5000\r\n\r\n").as_bytes(),
        false,
        10,
    )
    .await;
    assert!(a.starts_with("HTTP/1.1 413"), "{a}");
    let big = format!(
        "{chat}transfer-encoding: chunked\r\n\r\n7d0\r\n{}\r\n0\r\n\r\n",
        "x".repeat(2000)
    );
    let a = raw(&listen, big.as_bytes(), false, 10).await;
    assert!(a.starts_with("HTTP/1.1 413"), "{a}");
    let a = raw(
        &listen,
        format!("{chat}content-length: 200\r\n\r\n{{\"model\":").as_bytes(),
        false,
        10,
    )
    .await;
    assert!(a.starts_with("HTTP/1.1 408"), "{a}");
    // The body ends short of its length: a body that cannot be read.
    let a = raw(
        &listen,
        format!("{chat}content-length: 200\r\n\r\n{{\"model\":").as_bytes(),
        true,
        10,
    )
    .await;
    assert!(a.is_empty() || a.starts_with("HTTP/1.1 400"), "{a}");
    let a = raw(
        &listen,
        b"GET /dead/v1/models HTTP/1.1\r\nhost: x\r\n\r\n",
        false,
        10,
    )
    .await;
    assert!(a.starts_with("HTTP/1.1 502"), "{a}");

    // Mid-stream: a reset, then a stream silent past --idle-timeout.
    for reset in [true, false] {
        let mut b = Request::post(format!("http://{listen}/v1/chat/completions"))
            .header("content-type", "application/json");
        b = b.header(
            X_SIM_FAULT,
            if reset {
                "reset-after=2"
            } else {
                "stall-after=2"
            },
        );
        let body = r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#;
        let resp = within(20, client_h1().request(b.body(full(body)).unwrap()))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        let got = within(20, http_body_util::BodyExt::collect(resp.into_body())).await;
        assert!(got.is_err(), "reset {reset}: the body fails");
    }

    let (_, page) = get(&c, &metrics_url).await;
    let page = String::from_utf8(page.to_vec()).unwrap();
    let n = |name: &str, labels: &[(&str, &str)]| faults::metric(&page, name, labels);
    let chat_api = ("api", "openai-chat");
    for (code, want) in [("413", 2.0), ("408", 1.0), ("400", 1.0), ("200", 2.0)] {
        assert_eq!(
            n("tidemark_requests_total", &[chat_api, ("code", code)]),
            want,
            "requests {code}\n{page}"
        );
    }
    assert_eq!(
        n(
            "tidemark_requests_total",
            &[("api", "other"), ("code", "502")]
        ),
        1.0
    );
    assert_eq!(
        n("tidemark_request_duration_seconds_count", &[chat_api]),
        6.0,
        "every chat request timed"
    );
    assert_eq!(
        n(
            "tidemark_request_duration_seconds_count",
            &[("api", "other")]
        ),
        1.0,
        "the 502 timed"
    );
    assert_eq!(
        n("tidemark_upstream_errors_total", &[("kind", "connect")]),
        1.0
    );
    assert_eq!(
        n("tidemark_upstream_errors_total", &[("kind", "reset")]),
        1.0,
        "a reset mid-stream"
    );
    assert_eq!(
        n("tidemark_upstream_errors_total", &[("kind", "timeout")]),
        1.0,
        "silent past --idle-timeout"
    );
    assert_eq!(n("tidemark_limits_hit_total", &[("limit", "body")]), 2.0);
    assert_eq!(
        n("tidemark_limits_hit_total", &[("limit", "body_timeout")]),
        1.0
    );
    let _ = child.kill().await;
}
