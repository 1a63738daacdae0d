//! Faults: slow and silent clients, upstreams that reset, hang or stall,
//! clients that leave at every phase, malformed and oversized requests,
//! conflicting headers, HTTP/2 resets and graceful shutdown. The real proxy
//! and real upstreams on 127.0.0.1:0; every wait is bounded, none is a sleep.

mod support;
use support::faults;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use faults::metric;
use support::{client_h1, client_h2c, full, get, post_json, send, within, TestClient};
use tidemark::sim::{SimConfig, X_SIM_FAULT};

const CHAT: &str = "/v1/chat/completions";

fn chat_body(stream: bool) -> String {
    format!(
        r#"{{"model":"gpt-4o","stream":{stream},"stream_options":{{"include_usage":true}},"messages":[{{"role":"user","content":"hello"}}]}}"#
    )
}

/// A client that closes each connection after its response, so that idle
/// pooled connections do not hold the proxy's connection permits.
fn fresh_client() -> TestClient {
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http()
}

async fn metrics_page(px: &support::Proxy) -> String {
    let (parts, body) = get(&client_h1(), &px.admin_url("/metrics")).await;
    assert_eq!(parts.status, 200);
    String::from_utf8_lossy(&body).into_owned()
}

async fn limits_hit(px: &support::Proxy, limit: &str) -> f64 {
    metric(
        &metrics_page(px).await,
        "tidemark_limits_hit_total",
        &[("limit", limit)],
    )
}

async fn assert_ready(px: &support::Proxy) {
    let (parts, _) = get(&fresh_client(), &px.admin_url("/readyz")).await;
    assert_eq!(parts.status, 200, "/readyz");
}

fn ok_json() -> Response<support::Body> {
    Response::builder()
        .header("content-type", "application/json")
        .body(full(support::fixture("openai-chat/nonstream_basic.json")))
        .unwrap()
}

/// Read a raw HTTP/1.1 answer until the server closes or the head and a
/// short body arrived (bounded).
async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = within(5, TcpStream::connect(addr)).await.unwrap();
    // The server may answer (and close) before it has read everything.
    let _ = s.write_all(request).await;
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match within(10, s.read(&mut buf)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
        if out.windows(4).any(|w| w == b"\r\n\r\n") && out.len() > 12 {
            // Head complete; read what is already there and stop.
            let text = String::from_utf8_lossy(&out).into_owned();
            if !text.to_ascii_lowercase().contains("content-length: ")
                || text.ends_with('}')
                || text.ends_with('\n')
            {
                break;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Collect a response body frame by frame: the bytes that arrived, and
/// whether it ended with an error (true) or a clean end (false).
async fn drain(mut body: hyper::body::Incoming) -> (Vec<u8>, bool) {
    let mut got = Vec::new();
    loop {
        match within(15, body.frame()).await {
            None => return (got, false),
            Some(Err(_)) => return (got, true),
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    got.extend_from_slice(&d);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Slowloris
// ---------------------------------------------------------------------------

/// What a slow client does until the server closes it.
#[derive(Clone, Copy, Debug)]
enum Slow {
    Silent,
    /// Request headers, one byte per tick.
    TrickleH1,
    /// The HTTP/2 preface, one byte per tick (stalls protocol detection).
    TricklePreface,
}

/// Connect and misbehave; resolves with how long the server let us hang on.
async fn slow_client(mut s: TcpStream, start: Instant, how: Slow) -> Duration {
    let bytes: &[u8] = match how {
        Slow::Silent => b"",
        Slow::TrickleH1 => b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nx-pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n",
        Slow::TricklePreface => b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    };
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let mut at = 0;
    let mut buf = [0u8; 256];
    loop {
        tokio::select! {
            r = s.read(&mut buf) => match r {
                Ok(0) | Err(_) => return start.elapsed(),
                // A 408 or similar before the close is fine; keep reading to the close.
                Ok(_) => {}
            },
            _ = tick.tick() => {
                if let Some(b) = bytes.get(at) {
                    at += 1;
                    if s.write_all(std::slice::from_ref(b)).await.is_err() {
                        return start.elapsed();
                    }
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_clients_are_cut_off_and_the_server_recovers() {
    let up = support::upstream(support::handler(|_r| ok_json())).await;
    let px = support::proxy(
        &up.url(),
        &["--header-read-timeout", "1s", "--max-connections", "4"],
    )
    .await;
    let timeouts_before = limits_hit(&px, "header_timeout").await;
    let full_before = limits_hit(&px, "connections").await;

    // A normal request works.
    let (parts, _) = post_json(&fresh_client(), &px.url(CHAT), &chat_body(false)).await;
    assert_eq!(parts.status, 200);

    // Four slow clients take every connection permit.
    let kinds = [
        Slow::Silent,
        Slow::Silent,
        Slow::TrickleH1,
        Slow::TricklePreface,
    ];
    let (closed_tx, mut closed_rx) = mpsc::unbounded_channel::<(Slow, Duration, Instant)>();
    let slow_start = Instant::now();
    for how in kinds {
        // Connected here, in order, so that they queue before the fifth client.
        let start = Instant::now();
        let s = TcpStream::connect(px.addr).await.unwrap();
        let tx = closed_tx.clone();
        tokio::spawn(async move {
            let held = slow_client(s, start, how).await;
            let _ = tx.send((how, held, Instant::now()));
        });
    }
    drop(closed_tx);

    // The fifth client, connecting after them, waits for a permit.
    let url = px.url(CHAT);
    let fifth = tokio::spawn(async move {
        let r = post_json(&fresh_client(), &url, &chat_body(false)).await;
        (r.0.status, Instant::now())
    });

    let mut first_close: Option<Instant> = None;
    let mut closed = 0;
    while let Some((how, held, at)) = within(10, closed_rx.recv()).await {
        assert!(
            held >= Duration::from_millis(900),
            "{how:?} closed after {held:?}, before the 1s header-read timeout"
        );
        assert!(
            held < Duration::from_secs(5),
            "{how:?} held its connection for {held:?}"
        );
        first_close = Some(first_close.map_or(at, |f: Instant| f.min(at)));
        closed += 1;
    }
    assert_eq!(closed, kinds.len(), "every slow client was closed");

    let (status, done_at) = within(15, fifth).await.unwrap();
    assert_eq!(
        status, 200,
        "the waiting client is served once permits free"
    );
    assert!(first_close.is_some());
    // It could only be served once a slow client was cut off (1s after it connected).
    let waited = done_at - slow_start;
    assert!(
        waited >= Duration::from_millis(900),
        "the fifth connection was served after {waited:?}, while every permit was held"
    );

    // Recovered: more requests go through at once.
    for _ in 0..6 {
        let (parts, _) = post_json(&fresh_client(), &px.url(CHAT), &chat_body(false)).await;
        assert_eq!(parts.status, 200);
    }
    assert!(
        limits_hit(&px, "header_timeout").await - timeouts_before >= kinds.len() as f64,
        "header-read timeouts are counted"
    );
    assert!(
        limits_hit(&px, "connections").await > full_before,
        "waiting for a connection permit is counted"
    );
    assert_ready(&px).await;
    px.stop().await;
}

/// Read one HTTP/1.1 response with a Content-Length body off `s`; its head.
async fn read_one_response(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = within(10, s.read(&mut buf)).await.unwrap();
        assert!(n > 0, "closed before the response was whole");
        out.extend_from_slice(&buf[..n]);
        let Some(end) = out.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&out[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .expect("a content-length")
            .trim()
            .parse()
            .unwrap();
        if out.len() >= end + 4 + len {
            assert_eq!(out.len(), end + 4 + len, "nothing after the response");
            return head;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_connection_slow_with_its_next_request_head_is_cut_off() {
    let up = support::upstream(support::handler(|_r| ok_json())).await;
    let px = support::proxy(&up.url(), &["--header-read-timeout", "1s"]).await;
    let before = limits_hit(&px, "header_timeout").await;
    let mut s = within(5, TcpStream::connect(px.addr)).await.unwrap();
    let body = chat_body(false);
    let req = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    // Two requests on the connection are served, each head sent whole.
    for _ in 0..2 {
        s.write_all(req.as_bytes()).await.unwrap();
        let head = read_one_response(&mut s).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
    }
    // The third head starts, then nothing more: the connection is closed
    // once the header-read timeout has run from the head's first bytes'
    // wait, not before.
    let start = Instant::now();
    s.write_all(format!("POST {CHAT} HTTP/1.1\r\nhost: x\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let mut rest = Vec::new();
    loop {
        match within(10, s.read(&mut buf)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => rest.extend_from_slice(&buf[..n]),
        }
    }
    let held = start.elapsed();
    assert!(
        held >= Duration::from_millis(900),
        "closed after {held:?}, before the 1s header-read timeout"
    );
    assert!(held < Duration::from_secs(5), "held for {held:?}");
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.is_empty() || rest.starts_with("HTTP/1.1 408"),
        "answered: {rest}"
    );
    // Counted when the server's connection task ends, which can be just
    // after the client saw the close: polled, with a bound.
    let counted = within(10, async {
        loop {
            let n = limits_hit(&px, "header_timeout").await;
            if n > before {
                break n;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(counted, before + 1.0);
    assert_eq!(up.seen.count(), 2, "the cut-off request is never forwarded");
    assert_ready(&px).await;
    px.stop().await;
}

// ---------------------------------------------------------------------------
// Upstream faults
// ---------------------------------------------------------------------------

/// The events in an SSE body.
fn events(b: &[u8]) -> usize {
    b.windows(2).filter(|w| *w == b"\n\n").count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_reset_mid_stream_gives_the_bytes_so_far_then_an_error_and_no_anchor_loss() {
    let up = support::sim(SimConfig::default()).await;
    // A complete stream's first three events: what the client must get
    // before the reset (same model; the sim's ids have a fixed width).
    let body = chat_body(true).replace("\"gpt-4o\"", "\"gpt-4o-fault-reset\"");
    let (_, direct) = post_json(&client_h1(), &format!("{}{CHAT}", up.url), &body).await;
    let prefix_len = direct
        .windows(2)
        .enumerate()
        .filter(|(_, w)| *w == b"\n\n")
        .map(|(i, _)| i + 2)
        .nth(2)
        .expect("three events");
    // Ids, timestamps and padding aside, the same events.
    let shape = |b: &[u8]| -> Vec<serde_json::Value> {
        String::from_utf8_lossy(b)
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(|d| {
                serde_json::from_str::<serde_json::Value>(d).expect("whole events")["choices"]
                    .clone()
            })
            .collect()
    };
    let prefix = shape(&direct[..prefix_len]);
    assert!(
        events(&direct) > 4,
        "a reset after three events is mid-stream"
    );
    let px = support::proxy(&up.url, &[]).await;
    // Metrics are global to the test binary: compare a control session (two
    // complete streams) with one that also loses a stream to a reset, each
    // under a model name no other test uses.
    let ctl = [("api", "openai-chat"), ("model", "gpt-4o-fault-control")];
    let rst = [("api", "openai-chat"), ("model", "gpt-4o-fault-reset")];
    let counters = |page: &str| {
        ["tidemark_anchor_lost_total", "tidemark_usage_missing_total"]
            .map(|n| (metric(page, n, &ctl), metric(page, n, &rst)))
    };
    let before = counters(&metrics_page(&px).await);

    for (proto, client) in [("h1", client_h1()), ("h2c", client_h2c())] {
        let req = |model: &str, reset: bool| {
            let body = chat_body(true).replace("\"gpt-4o\"", &format!("\"{model}\""));
            let mut b = Request::post(px.url(CHAT))
                .header("content-type", "application/json")
                .header("x-session-id", format!("{model}-{proto}"));
            if reset {
                b = b.header(X_SIM_FAULT, "reset-after=3");
            }
            b.body(full(body)).unwrap()
        };
        // Control: two complete streams.
        let complete = |got: &Bytes| events(got) == events(&direct) && got.ends_with(b"[DONE]\n\n");
        for _ in 0..2 {
            let (parts, got) = send(&client, req("gpt-4o-fault-control", false)).await;
            assert_eq!(parts.status, 200);
            assert!(complete(&got), "{proto}: a whole stream");
        }
        // Anchor the session, lose a stream midway, then carry on.
        let (parts, got) = send(&client, req("gpt-4o-fault-reset", false)).await;
        assert_eq!(parts.status, 200);
        assert!(complete(&got), "{proto}: a whole stream");

        let resp = within(10, client.request(req("gpt-4o-fault-reset", true)))
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{proto}");
        let (got, errored) = drain(resp.into_body()).await;
        assert_eq!(events(&got), 3, "{proto}");
        assert!(got.ends_with(b"\n\n"), "{proto}");
        assert!(got.ends_with(b"\n\n"), "{proto}");
        assert_eq!(
            shape(&got),
            prefix,
            "{proto}: the client got every byte sent so far"
        );
        assert!(
            errored,
            "{proto}: a reset upstream must not look like a complete response"
        );

        let (parts, got) = send(&client, req("gpt-4o-fault-reset", false)).await;
        assert_eq!(parts.status, 200);
        assert!(complete(&got), "{proto}: a whole stream");
    }
    let after = counters(&metrics_page(&px).await);
    for (i, name) in ["anchor losses", "usage-missing counts"].iter().enumerate() {
        let d_ctl = after[i].0 - before[i].0;
        let d_rst = after[i].1 - before[i].1;
        assert_eq!(
            d_rst, d_ctl,
            "{name}: a reset stream adds nothing over two complete ones"
        );
    }
    assert_ready(&px).await;
    px.stop().await;
}

/// Stays on `support::faults`: the chunk and the failure must leave the
/// upstream back to back, a race the sim's `reset-after` avoids on purpose
/// (it lets its events reach the wire before cutting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_that_arrive_just_before_an_upstream_reset_still_reach_the_client() {
    let (senders_tx, mut senders_rx) = mpsc::unbounded_channel();
    let up = faults::start(faults::handler(move |_req| {
        let (tx, body) = faults::channel();
        let _ = senders_tx.send(tx);
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(body)
            .unwrap()
    }))
    .await;
    let px = support::proxy(&up.url(), &[]).await;
    let last =
        Bytes::from_static(b"data: {\"choices\":[{\"delta\":{\"content\":\"last words\"}}]}\n\n");
    for round in 0..20 {
        for (proto, client) in [("h1", client_h1()), ("h2c", client_h2c())] {
            let req = Request::post(px.url(CHAT))
                .header("content-type", "application/json")
                .body(full(chat_body(true)))
                .unwrap();
            let resp = within(10, client.request(req)).await.unwrap();
            assert_eq!(resp.status(), 200);
            let tx: mpsc::Sender<_> = within(10, senders_rx.recv()).await.unwrap();
            // The chunk and the failure back to back, as a dying upstream sends them.
            tx.send(Ok(last.clone())).await.unwrap();
            tx.send(Err(Box::new(faults::Injected))).await.unwrap();
            let (got, errored) = drain(resp.into_body()).await;
            assert_eq!(
                got, last,
                "round {round} {proto}: the last chunk was delivered"
            );
            assert!(errored, "round {round} {proto}");
        }
    }
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_hanging_before_headers_is_a_504_within_the_upstream_timeout() {
    let up = support::sim(SimConfig::default()).await;
    let px = support::proxy(
        &up.url,
        &[
            "--upstream-timeout",
            "500ms",
            "--route",
            &format!("/v1/messages={}", up.url),
        ],
    )
    .await;
    let mut sent = 0;
    for (path, body) in [
        (CHAT, chat_body(true)),
        (
            "/v1/messages",
            r#"{"model":"claude-sonnet-4-5","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}"#
                .to_string(),
        ),
    ] {
        for client in [client_h1(), client_h2c()] {
            let t = Instant::now();
            let req = Request::post(px.url(path))
                .header("content-type", "application/json")
                .header(X_SIM_FAULT, "hang")
                .body(full(body.clone()))
                .unwrap();
            let (parts, body) = send(&client, req).await;
            let took = t.elapsed();
            sent += 1;
            assert_eq!(parts.status, StatusCode::GATEWAY_TIMEOUT, "{path}");
            assert_eq!(
                parts.headers.get("x-tidemark-error").unwrap(),
                "upstream-timeout"
            );
            assert!(
                took >= Duration::from_millis(450) && took < Duration::from_secs(5),
                "answered after {took:?}"
            );
            let v: serde_json::Value = serde_json::from_slice(&body).expect("JSON error body");
            assert!(v.get("error").is_some(), "error in the API's shape: {v}");
        }
    }
    // The proxy gave up on each upstream request: the upstream sees them go.
    within(10, up.abandoned.reach(sent)).await;
    // Passthrough paths time out too.
    let req = Request::get(px.url("/v1/models"))
        .header(X_SIM_FAULT, "hang")
        .body(full(Bytes::new()))
        .unwrap();
    let (parts, _) = send(&fresh_client(), req).await;
    assert_eq!(parts.status, StatusCode::GATEWAY_TIMEOUT);
    assert_ready(&px).await;
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_stalling_mid_stream_is_ended_by_the_idle_timeout() {
    let up = support::sim(SimConfig::default()).await;
    let px = support::proxy(&up.url, &["--idle-timeout", "500ms"]).await;
    for (i, (proto, client)) in [("h1", client_h1()), ("h2c", client_h2c())]
        .into_iter()
        .enumerate()
    {
        let t = Instant::now();
        let req = Request::post(px.url(CHAT))
            .header("content-type", "application/json")
            .header(X_SIM_FAULT, "stall-after=2")
            .body(full(chat_body(true)))
            .unwrap();
        let resp = within(10, client.request(req)).await.unwrap();
        assert_eq!(resp.status(), 200);
        let (got, errored) = drain(resp.into_body()).await;
        let took = t.elapsed();
        assert_eq!(events(&got), 2, "{proto}: the events before the stall");
        assert!(
            errored,
            "{proto}: an idle-timed-out stream ends in an error"
        );
        assert!(
            took >= Duration::from_millis(450) && took < Duration::from_secs(5),
            "{proto}: ended after {took:?}"
        );
        // The proxy let go of the stalled upstream stream.
        within(10, up.abandoned.reach(i as u64 + 1)).await;
    }
    assert_ready(&px).await;
    px.stop().await;
}

/// The idle timeout bounds each silence, not the stream: a stream whose
/// events keep coming, each well within the timeout, runs past it whole
/// (the timer is re-armed from the last frame rather than fired).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_keeps_coming_outlasts_the_idle_timeout() {
    let up = support::sim(SimConfig::default()).await;
    // The whole stream, unpaced, straight from the sim.
    let (_, whole) = post_json(&client_h1(), &format!("{}{CHAT}", up.url), &chat_body(true)).await;
    assert!(events(&whole) >= 6, "the stream has events to space out");
    let timeout = Duration::from_millis(400);
    let px = support::proxy(&up.url, &["--idle-timeout", "400ms"]).await;
    // The pace of the stream is what is under test: each gap well within
    // the timeout, the whole well past it.
    let req = Request::post(px.url(CHAT))
        .header("content-type", "application/json")
        .header(X_SIM_FAULT, "pace=150")
        .body(full(chat_body(true)))
        .unwrap();
    let t = Instant::now();
    let resp = within(10, client_h1().request(req)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let (got, errored) = drain(resp.into_body()).await;
    assert!(t.elapsed() > timeout * 2, "the stream ran past the timeout");
    assert!(!errored, "a stream with no long silence is not cut");
    assert_eq!(events(&got), events(&whole), "every event arrived");
    assert!(got.ends_with(b"data: [DONE]\n\n"), "to the end");
    px.stop().await;
}

async fn closed_port() -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_refused_is_a_502_in_each_apis_shape() {
    let dead = closed_port().await;
    let px = support::proxy(
        &dead,
        &[
            "--route",
            &format!("/v1/messages={dead}"),
            "--connect-timeout",
            "5s",
        ],
    )
    .await;
    let c = client_h1();
    for folder in [
        "openai-chat",
        "openai-responses",
        "anthropic-messages",
        "gemini",
        "ollama",
    ] {
        let (path, body) = support::request_for(folder, "nonstream_basic.json");
        let t = Instant::now();
        let (parts, body) = post_json(&c, &px.url(&path), &body).await;
        assert_eq!(parts.status, StatusCode::BAD_GATEWAY, "{folder}");
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(
            parts.headers.get("x-tidemark-error").unwrap(),
            "upstream-connect",
            "{folder}"
        );
        assert_eq!(
            parts.headers.get("content-type").unwrap(),
            "application/json"
        );
        let v: serde_json::Value = serde_json::from_slice(&body).expect("JSON error body");
        assert!(v.get("error").is_some(), "{folder}: {v}");
    }
    let (parts, _) = get(&c, &px.url("/v1/models")).await;
    assert_eq!(parts.status, StatusCode::BAD_GATEWAY);
    assert_ready(&px).await;
    px.stop().await;
}

// ---------------------------------------------------------------------------
// Clients that leave
// ---------------------------------------------------------------------------

/// Stays on `support::faults`: the test holds each upstream stream open
/// and watches its sender close, phase by phase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnects_at_every_phase_cancel_upstream_and_leave_the_proxy_healthy() {
    let (senders_tx, mut senders_rx) = mpsc::unbounded_channel();
    let up = faults::start(faults::handler(move |req| {
        if req.method() == http::Method::GET {
            return Response::new(faults::full("{}"));
        }
        let (tx, body) = faults::channel();
        let senders_tx = senders_tx.clone();
        tokio::spawn(async move {
            let _ = tx
                .send(Ok(Bytes::from_static(b"data: {\"choices\":[]}\n\n")))
                .await;
            let _ = senders_tx.send(tx);
        });
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(body)
            .unwrap()
    }))
    .await;
    let px = support::proxy(&up.url(), &[]).await;

    // 1. Before the request body is complete, on an API path: nothing is sent upstream.
    {
        let mut s = TcpStream::connect(px.addr).await.unwrap();
        s.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":\"gpt-4o\",",
        )
        .await
        .unwrap();
        drop(s);
    }
    // 2. Before the request body is complete, on a streamed (passthrough) path:
    //    the upstream's body read fails.
    {
        let mut s = TcpStream::connect(px.addr).await.unwrap();
        s.write_all(
            b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: application/octet-stream\r\ncontent-length: 100000\r\n\r\nabcdefgh",
        )
        .await
        .unwrap();
        // Wait (bounded) until the upstream has the request, then leave.
        within(10, async {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while up.seen.heads() == 0 {
                tick.tick().await;
            }
        })
        .await;
        drop(s);
        within(10, async {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while up.seen.body_errors() == 0 {
                tick.tick().await;
            }
        })
        .await;
    }
    // 3. After the response headers, 4. mid-stream: over h1 and h2c.
    for (proto, read_first) in [("h1", false), ("h1", true), ("h2c", false), ("h2c", true)] {
        let client = if proto == "h1" {
            client_h1()
        } else {
            client_h2c()
        };
        let req = Request::post(px.url(CHAT))
            .header("content-type", "application/json")
            .body(full(chat_body(true)))
            .unwrap();
        let resp = within(10, client.request(req)).await.unwrap();
        assert_eq!(resp.status(), 200);
        let mut body = resp.into_body();
        if read_first {
            let f = within(10, body.frame()).await.unwrap().unwrap();
            assert!(f.is_data());
        }
        let tx: mpsc::Sender<_> = within(10, senders_rx.recv()).await.unwrap();
        drop(body);
        let client = (proto == "h2c").then_some(client);
        // The upstream's body sender sees the cancellation.
        within(10, tx.closed()).await;
        assert!(tx.send(Ok(Bytes::from_static(b"more"))).await.is_err());
        if let Some(client) = client {
            // 5. An HTTP/2 reset of one stream leaves the connection usable.
            let req = Request::get(px.url("/v1/models")).body(full("")).unwrap();
            let resp = within(10, client.request(req)).await.unwrap();
            assert_eq!(resp.status(), 200);
        }
    }
    // The partial API-path request never reached the upstream: only the
    // streamed path and the four full requests (plus the h2c follow-ups) did.
    let paths: Vec<String> = up
        .seen
        .all()
        .iter()
        .map(|(p, _)| p.uri.path().to_string())
        .collect();
    assert_eq!(
        paths.iter().filter(|p| p.as_str() == CHAT).count(),
        4,
        "{paths:?}"
    );
    assert_ready(&px).await;
    let (parts, _) = get(&fresh_client(), &px.url("/v1/models")).await;
    assert_eq!(parts.status, 200, "the proxy still serves");
    px.stop().await;
}

// ---------------------------------------------------------------------------
// Malformed, odd and oversized requests
// ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_and_invalid_utf8_are_forwarded_untouched_without_projection() {
    let answer: Bytes = Bytes::from_static(b"{\"odd\":\"\xff\xfe bytes\"}");
    let up = support::upstream(support::handler({
        let answer = answer.clone();
        move |_r| {
            Response::builder()
                .header("content-type", "application/json")
                .body(full(answer.clone()))
                .unwrap()
        }
    }))
    .await;
    let px = support::proxy(&up.url(), &[]).await;
    let c = client_h1();
    // Control: a well-formed request does get a projection.
    let (parts, _) = post_json(&c, &px.url(CHAT), &chat_body(false)).await;
    assert!(
        parts.headers.contains_key("x-context-projection"),
        "a readable request is projected"
    );
    let bodies: Vec<Bytes> = vec![
        Bytes::from_static(b"{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\""),
        Bytes::from_static(b"not json at all"),
        Bytes::from_static(b"[1,2,3]"),
        Bytes::from_static(b""),
        Bytes::from_static(
            b"{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\xc3\"}]}",
        ),
        Bytes::from_static(b"\xef\xbb\xbf{\"model\":\"gpt-4o\",\"messages\":[]}"),
    ];
    for (i, b) in bodies.iter().enumerate() {
        for client in [client_h1(), client_h2c()] {
            let req = Request::post(px.url(CHAT))
                .header("content-type", "application/json")
                .body(full(b.clone()))
                .unwrap();
            let (parts, got) = send(&client, req).await;
            assert_eq!(parts.status, 200, "body {i}");
            assert!(
                !parts.headers.contains_key("x-context-projection"),
                "body {i}: no projection for an unreadable request"
            );
            assert_eq!(got, answer, "body {i}: response bytes untouched");
            let (_, sent) = up.seen.last();
            assert_eq!(&sent, b, "body {i}: forwarded byte for byte");
        }
    }
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_content_lengths_are_refused_and_duplicate_credentials_pass_as_sent() {
    let up = support::upstream(support::handler(|_r| ok_json())).await;
    let px = support::proxy(&up.url(), &[]).await;
    let answer = raw_exchange(
        px.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ncontent-length: 7\r\n\r\n{\"a\":1}",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    // Both content-length and transfer-encoding: refused or the length ignored, never smuggled.
    let answer = raw_exchange(
        px.addr,
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n",
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 400") || answer.starts_with("HTTP/1.1 200"),
        "{answer}"
    );
    assert!(
        up.seen
            .requests
            .lock()
            .unwrap()
            .iter()
            .all(|(p, _)| p.uri.path() != "/smuggled"),
        "no request smuggled through"
    );

    for client in [client_h1(), client_h2c()] {
        let before = up.seen.count();
        let req = Request::post(px.url(CHAT))
            .header("content-type", "application/json")
            .header("x-api-key", "first-key")
            .header("x-api-key", "second-key")
            .header("x-custom", "a")
            .header("x-custom", "b")
            .body(full(chat_body(false)))
            .unwrap();
        let (parts, _) = send(&client, req).await;
        assert_eq!(parts.status, 200);
        assert_eq!(up.seen.count(), before + 1);
        let (p, _) = up.seen.last();
        let keys: Vec<_> = p.headers.get_all("x-api-key").iter().collect();
        assert_eq!(keys, ["first-key", "second-key"], "duplicates pass as sent");
        let custom: Vec<_> = p.headers.get_all("x-custom").iter().collect();
        assert_eq!(custom, ["a", "b"]);
    }
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_over_the_limit_are_413_in_shape_and_counted() {
    let up = support::upstream(support::handler(|_r| ok_json())).await;
    let px = support::proxy(
        &up.url(),
        &[
            "--max-body-bytes",
            "1000",
            "--route",
            &format!("/v1/messages={}", up.url()),
        ],
    )
    .await;
    let before = limits_hit(&px, "body").await;
    let big = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(2000)
    );
    let mut refused = 0;
    for path in [CHAT, "/v1/messages", "/v1/responses", "/api/chat"] {
        // With a content-length.
        let (parts, body) = post_json(&client_h1(), &px.url(path), &big).await;
        assert_eq!(parts.status, StatusCode::PAYLOAD_TOO_LARGE, "{path}");
        assert_eq!(
            parts.headers.get("x-tidemark-error").unwrap(),
            "body-too-large"
        );
        let v: serde_json::Value = serde_json::from_slice(&body).expect("JSON error body");
        assert!(v.get("error").is_some(), "{path}: {v}");
        refused += 1;
        // Streamed without a length.
        let chunks: Vec<Bytes> = big
            .as_bytes()
            .chunks(300)
            .map(Bytes::copy_from_slice)
            .collect();
        let req = Request::post(px.url(path))
            .header("content-type", "application/json")
            .body(support::chunked(chunks))
            .unwrap();
        let (parts, _) = send(&client_h2c(), req).await;
        assert_eq!(parts.status, StatusCode::PAYLOAD_TOO_LARGE, "{path} h2c");
        refused += 1;
    }
    assert_eq!(up.seen.count(), 0, "nothing oversized reached the upstream");
    assert!(limits_hit(&px, "body").await - before >= refused as f64);
    // A body at the limit passes.
    let ok = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(900)
    );
    assert!(ok.len() <= 1000);
    let (parts, _) = post_json(&client_h1(), &px.url(CHAT), &ok).await;
    assert_eq!(parts.status, 200);
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_over_the_limit_are_431_and_counted() {
    let up = support::upstream(support::handler(|_r| ok_json())).await;
    let px = support::proxy(&up.url(), &["--max-header-bytes", "16384"]).await;
    let before = limits_hit(&px, "headers").await;
    let big = "a".repeat(40_000);
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    let answer = raw_exchange(px.addr, req.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // Over h2c: the request is refused, never forwarded.
    let req = Request::post(px.url(CHAT))
        .header("x-big", big.as_str())
        .body(full(chat_body(false)))
        .unwrap();
    // (h2 refuses it with a 431 or resets the stream, depending on where the limit trips.)
    if let Ok(resp) = within(10, client_h2c().request(req)).await {
        assert_eq!(resp.status(), StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    }
    assert_eq!(up.seen.count(), 0);
    // Just under the limit passes.
    let req = Request::post(px.url(CHAT))
        .header("x-big", "a".repeat(8_000))
        .body(full(chat_body(false)))
        .unwrap();
    let (parts, _) = send(&client_h1(), req).await;
    assert_eq!(parts.status, 200);
    assert!(
        limits_hit(&px, "headers").await > before,
        "the 431 is counted"
    );
    px.stop().await;
}

// ---------------------------------------------------------------------------
// Graceful shutdown
// ---------------------------------------------------------------------------

/// A proxy (`run`, started with `flags`) holding one SSE stream open: its
/// first chunk has reached the client; the rest is sent through `tx`.
/// The upstream answers paths ending in `/idle` with a small body.
struct HeldStream {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    run: tokio::task::JoinHandle<Result<(), tidemark::server::StartError>>,
    tx: mpsc::Sender<Result<Bytes, faults::BoxError>>,
    body: hyper::body::Incoming,
    _up: faults::Faulty,
}

const FIRST: &[u8] = b"data: {\"n\":1}\n\n";

/// On `support::faults`: the test decides when each byte of the held
/// stream goes, around the shutdown signal.
async fn proxy_holding_a_stream(flags: &[&str]) -> HeldStream {
    let (senders_tx, mut senders_rx) = mpsc::unbounded_channel();
    let up = faults::start(faults::handler(move |req| {
        if req.uri().path().ends_with("/idle") {
            return Response::new(faults::full("ok"));
        }
        let (tx, body) = faults::channel();
        let _ = senders_tx.send(tx);
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(body)
            .unwrap()
    }))
    .await;
    let url = up.url();
    let mut args = vec!["tidemark", "--upstream", &url];
    args.extend_from_slice(flags);
    let config = tidemark::Config::from_args(args).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stop_rx) = oneshot::channel::<()>();
    let run = tokio::spawn(tidemark::run(listener, admin, config, async {
        let _ = stop_rx.await;
    }));

    let client = client_h1();
    let req = Request::post(format!("http://{addr}{CHAT}"))
        .header("content-type", "application/json")
        .body(full(chat_body(true)))
        .unwrap();
    let resp = within(10, client.request(req)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let tx: mpsc::Sender<_> = within(10, senders_rx.recv()).await.unwrap();
    tx.send(Ok(Bytes::from_static(FIRST))).await.unwrap();
    let mut body = resp.into_body();
    let first = within(10, body.frame()).await.unwrap().unwrap();
    assert_eq!(first.into_data().unwrap(), FIRST);
    HeldStream {
        addr,
        stop,
        run,
        tx,
        body,
        _up: up,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_an_in_flight_stream_and_refuses_new_connections() {
    let held = proxy_holding_a_stream(&[]).await;
    let (addr, stop_tx, run, tx, body) = (held.addr, held.stop, held.run, held.tx, held.body);
    let parts = [
        Bytes::from_static(FIRST),
        Bytes::from_static(b"data: {\"n\":2}\n\n"),
        Bytes::from_static(b"data: [DONE]\n\n"),
    ];

    // Shut down while the stream is open.
    stop_tx.send(()).unwrap();
    within(10, async {
        let mut tick = tokio::time::interval(Duration::from_millis(10));
        loop {
            tick.tick().await;
            if TcpStream::connect(addr).await.is_err() {
                break;
            }
        }
    })
    .await;
    assert!(!run.is_finished(), "run waits for the in-flight stream");

    // The stream carries on to its end.
    let feeder = tokio::spawn({
        let rest = parts[1..].to_vec();
        async move {
            for p in rest {
                tx.send(Ok(p)).await.unwrap();
            }
        }
    });
    let (got, errored) = drain(body).await;
    assert!(!errored, "the drained stream ends cleanly");
    assert_eq!(got, [&parts[1][..], &parts[2][..]].concat());
    within(10, feeder).await.unwrap();
    within(15, run)
        .await
        .unwrap()
        .expect("run returns after draining");
    // Still refused after run returned.
    assert!(TcpStream::connect(addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_starts_draining_at_the_signal() {
    // The first connection (worker 0) holds a stream that does not end; the
    // second (worker 1) is idle after one request. At the signal both
    // workers drain at once: the idle one is closed while the stream is
    // still open, not after it ends.
    let held = proxy_holding_a_stream(&["--workers", "2"]).await;
    let (addr, stop_tx, run, tx, body) = (held.addr, held.stop, held.run, held.tx, held.body);

    let mut idle = within(10, TcpStream::connect(addr)).await.unwrap();
    idle.write_all(b"GET /v1/idle HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = within(10, idle.read(&mut buf)).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );

    stop_tx.send(()).unwrap();
    // The idle connection is closed (EOF) while the stream is held open.
    let closed = within(10, async {
        loop {
            match idle.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    let () = closed;
    assert!(!run.is_finished(), "the stream still holds the shutdown");

    // The stream ends; then run returns.
    let last = Bytes::from_static(b"data: [DONE]\n\n");
    tx.send(Ok(last.clone())).await.unwrap();
    drop(tx);
    let (rest, errored) = drain(body).await;
    assert!(!errored);
    assert_eq!(rest, last.to_vec());
    within(15, run)
        .await
        .unwrap()
        .expect("run returns after draining");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trickling_its_body_gets_408_and_nothing_is_forwarded() {
    let up = support::upstream(support::handler(|_r| ok_json())).await;
    let px = support::proxy(&up.url(), &["--header-read-timeout", "1s"]).await;
    let before = limits_hit(&px, "body_timeout").await;
    let start = Instant::now();
    // The head promises 200 bytes; ten arrive, then silence.
    let req = format!(
        "POST {CHAT} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 200\r\n\r\n{{\"model\":"
    );
    let answer = raw_exchange(px.addr, req.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "got: {answer}");
    assert!(
        answer.contains("x-tidemark-error: client-timeout"),
        "{answer}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "cut off by the silence bound"
    );
    assert_eq!(up.seen.count(), 0, "a partial body is never forwarded");
    assert_eq!(limits_hit(&px, "body_timeout").await, before + 1.0);
    assert_ready(&px).await;
}
