//! The transparent core: bytes in equal bytes out, chunk by chunk, over
//! HTTP/1.1 and h2c; headers; tidemark's own errors; cancellation; TLS.

mod support;

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use support::*;

/// Deterministic pseudo-random chunk sizes (xorshift), 1..=max.
fn random_cuts(len: usize, seed: u64, max: usize) -> Vec<usize> {
    let mut x = seed | 1;
    let mut cuts = Vec::new();
    let mut at = 0;
    while at < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let step = 1 + (x as usize % max);
        at = (at + step).min(len);
        cuts.push(at);
    }
    cuts
}

fn split(b: &Bytes, cuts: &[usize]) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut prev = 0;
    for &c in cuts {
        out.push(b.slice(prev..c));
        prev = c;
    }
    out
}

fn replay_upstream(body: Bytes, ct: &'static str, gz: bool, cuts: Vec<usize>) -> Handler {
    handler(move |_req| {
        let mut r = Response::builder()
            .status(200)
            .header("content-type", ct)
            .header("x-upstream-custom", "kept");
        if gz {
            r = r.header("content-encoding", "gzip");
        }
        r.body(chunked(split(&body, &cuts))).unwrap()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fixture_arrives_byte_for_byte_in_every_chunking_over_h1_and_h2c() {
    let mut checked = 0;
    for (name, ct, path, req_body) in stream_fixtures() {
        let body = fixture(&name);
        let gz = name.ends_with(".gz");
        let mut chunkings: Vec<(String, Vec<usize>)> = vec![
            ("whole".into(), vec![body.len()]),
            (
                "random".into(),
                random_cuts(body.len(), name.len() as u64 * 7919, 97),
            ),
        ];
        if body.len() <= 8192 {
            chunkings.push(("bytewise".into(), (1..=body.len()).collect()));
        }
        for (label, cuts) in chunkings {
            let up = upstream(replay_upstream(body.clone(), ct, gz, cuts)).await;
            let px = proxy(
                &up.url(),
                &["--route", &format!("/v1/messages={}", up.url())],
            )
            .await;
            for (proto, client) in [("h1", client_h1()), ("h2c", client_h2c())] {
                let req = Request::post(px.url(&path))
                    .header("content-type", "application/json")
                    .body(full(req_body.clone()))
                    .unwrap();
                let (parts, got) = send(&client, req).await;
                assert_eq!(parts.status, StatusCode::OK, "{name} {label} {proto}");
                assert_eq!(got, body, "{name} {label} {proto}: body differs");
                assert_eq!(parts.headers.get("x-upstream-custom").unwrap(), "kept");
                if gz {
                    assert_eq!(parts.headers.get("content-encoding").unwrap(), "gzip");
                }
                checked += 1;
            }
            px.stop().await;
        }
    }
    assert!(checked >= 100, "only {checked} cases ran");
}

/// The upstream sends chunk k+1 only after the client has received chunk k:
/// a proxy that buffers anything deadlocks here (bounded by `within`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_not_buffered() {
    for proto in ["h1", "h2c"] {
        let (tx_slot, rx_slot) = tokio::sync::oneshot::channel();
        let tx_slot = std::sync::Mutex::new(Some(tx_slot));
        let up = upstream(handler(move |_req| {
            let (tx, body) = channel_body();
            if let Some(s) = tx_slot.lock().unwrap().take() {
                let _ = s.send(tx);
            }
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(body)
                .unwrap()
        }))
        .await;
        let px = proxy(&up.url(), &[]).await;
        let client = if proto == "h1" {
            client_h1()
        } else {
            client_h2c()
        };
        let req = Request::post(px.url("/v1/chat/completions"))
            .body(full(r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#))
            .unwrap();
        let resp_fut = client.request(req);
        let resp = within(10, resp_fut).await.unwrap();
        let tx = within(10, rx_slot).await.unwrap();
        let mut body = resp.into_body();
        for k in 0..20 {
            let chunk = Bytes::from(format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"tok{k}\"}}}}]}}\n\n"
            ));
            within(10, tx.send(chunk.clone())).await.unwrap();
            let mut got = Vec::new();
            while got.len() < chunk.len() {
                let frame = within(10, body.frame())
                    .await
                    .expect("frame")
                    .expect("no error");
                if let Ok(d) = frame.into_data() {
                    got.extend_from_slice(&d);
                }
            }
            assert_eq!(got, chunk.to_vec(), "{proto} chunk {k}");
        }
        drop(tx);
        // h2 may close the stream with an empty DATA frame carrying END_STREAM.
        while let Some(f) = within(10, body.frame()).await {
            let d = f.expect("clean end").into_data().unwrap_or_default();
            assert!(d.is_empty(), "{proto}: nothing after the last chunk");
        }
        px.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_pass_both_ways_hop_by_hop_dropped_host_rewritten() {
    let up = upstream(handler(|_req| {
        Response::builder()
            .status(429)
            .header("content-type", "application/json")
            .header("retry-after", "7")
            .header("x-ratelimit-remaining-requests", "0")
            .header("anthropic-ratelimit-tokens-reset", "2026-12-02T00:00:00Z")
            .header("x-unknown-response", "v")
            .header("keep-alive", "timeout=5")
            .header("connection", "x-hop-resp")
            .header("x-hop-resp", "gone")
            .header("proxy-authenticate", "Basic realm=\"egress\"")
            .body(full(r#"{"error":{"message":"slow down","type":"rate_limit_error","param":null,"code":null}}"#))
            .unwrap()
    }))
    .await;
    let px = proxy(&up.url(), &[]).await;
    let client = client_h1();
    let req = Request::post(px.url("/v1/chat/completions?api-version=2024"))
        .header("authorization", "Bearer sk-test-123")
        .header("x-unknown-request", "u")
        .header("connection", "x-hop-req")
        .header("x-hop-req", "gone")
        .header("proxy-authorization", "Basic abc")
        .header("x-context-reset", "1")
        .header("host", "tidemark.local")
        .body(full(
            r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#,
        ))
        .unwrap();
    let (parts, body) = send(&client, req).await;
    assert_eq!(parts.status, 429);
    assert_eq!(parts.headers.get("retry-after").unwrap(), "7");
    assert_eq!(
        parts.headers.get("x-ratelimit-remaining-requests").unwrap(),
        "0"
    );
    assert_eq!(
        parts
            .headers
            .get("anthropic-ratelimit-tokens-reset")
            .unwrap(),
        "2026-12-02T00:00:00Z"
    );
    assert_eq!(parts.headers.get("x-unknown-response").unwrap(), "v");
    assert!(parts.headers.get("x-hop-resp").is_none());
    assert!(parts.headers.get("keep-alive").is_none());
    // tidemark authenticates no proxy hop: the challenge is the client's.
    assert_eq!(
        parts.headers.get("proxy-authenticate").unwrap(),
        "Basic realm=\"egress\""
    );
    assert!(
        parts.headers.get("x-context-projection").is_some(),
        "projection on upstream errors too"
    );
    assert!(std::str::from_utf8(&body).unwrap().contains("slow down"));

    let (seen, _) = up.seen.last();
    assert_eq!(
        seen.headers.get("authorization").unwrap(),
        "Bearer sk-test-123"
    );
    assert_eq!(seen.headers.get("x-unknown-request").unwrap(), "u");
    assert!(seen.headers.get("x-hop-req").is_none());
    // Not hop-by-hop for tidemark (SPEC §2): a credential, passed like the others.
    assert_eq!(
        seen.headers.get("proxy-authorization").unwrap(),
        "Basic abc"
    );
    assert!(
        seen.headers.get("x-context-reset").is_none(),
        "x-context-reset is consumed"
    );
    assert_eq!(
        seen.headers.get("host").unwrap().to_str().unwrap(),
        up.addr.to_string()
    );
    assert_eq!(
        seen.uri.path_and_query().unwrap().as_str(),
        "/v1/chat/completions?api-version=2024"
    );
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_path_prefix_and_routes() {
    let a = upstream(handler(|_r| Response::new(full("A")))).await;
    let b = upstream(handler(|_r| Response::new(full("B")))).await;
    let px = proxy(
        &format!("{}/api", a.url()),
        &["--route", &format!("/v1/messages={}/anthropic", b.url())],
    )
    .await;
    let c = client_h1();
    let (_, body) = get(&c, &px.url("/v1/models?x=1")).await;
    assert_eq!(body, "A");
    assert_eq!(
        a.seen.last().0.uri.path_and_query().unwrap().as_str(),
        "/api/v1/models?x=1"
    );
    let (_, body) = post_json(&c, &px.url("/v1/messages/count_tokens"), "{}").await;
    assert_eq!(body, "B");
    assert_eq!(
        b.seen.last().0.uri.path(),
        "/anthropic/v1/messages/count_tokens"
    );
    px.stop().await;
}

async fn closed_port() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_upstream_is_502_in_the_apis_own_shape() {
    let dead = closed_port().await;
    let px = proxy(&dead, &["--route", &format!("/v1/messages={dead}")]).await;
    let c = client_h1();
    let (parts, body) = post_json(
        &c,
        &px.url("/v1/chat/completions"),
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await;
    assert_eq!(parts.status, 502);
    assert_eq!(
        parts.headers.get("x-tidemark-error").unwrap(),
        "upstream-connect"
    );
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    for k in ["message", "type", "param", "code"] {
        assert!(v["error"].get(k).is_some(), "OpenAI error has {k}: {v}");
    }
    let (parts, body) = post_json(&c, &px.url("/v1/messages"), r#"{"model":"claude-sonnet-4-5","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}"#).await;
    assert_eq!(parts.status, 502);
    assert_eq!(
        parts.headers.get("x-tidemark-error").unwrap(),
        "upstream-connect"
    );
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["type"], "error");
    assert!(
        v["error"]["type"].is_string() && v["error"]["message"].is_string(),
        "{v}"
    );
    // Paths tidemark does not read get a 502 too.
    let (parts, _) = get(&c, &px.url("/v1/models")).await;
    assert_eq!(parts.status, 502);
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_is_413_in_the_apis_own_shape_and_never_forwarded() {
    let up = upstream(handler(|_r| Response::new(full("{}")))).await;
    let px = proxy(
        &up.url(),
        &[
            "--max-body-bytes",
            "200",
            "--route",
            &format!("/v1/messages={}", up.url()),
        ],
    )
    .await;
    let big = format!(
        r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}"}}]}}"#,
        "x".repeat(500)
    );
    let c = client_h1();
    let (parts, body) = post_json(&c, &px.url("/v1/chat/completions"), &big).await;
    assert_eq!(parts.status, 413);
    assert_eq!(
        parts.headers.get("x-tidemark-error").unwrap(),
        "body-too-large"
    );
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(v["error"]["message"].is_string());
    let (parts, body) = post_json(&c, &px.url("/v1/messages"), &big).await;
    assert_eq!(parts.status, 413);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "request_too_large");
    // Without a content-length (h2c, streamed) the cap still holds.
    let (tx, b) = channel_body();
    let req = Request::post(px.url("/v1/chat/completions"))
        .body(b)
        .unwrap();
    let h2 = client_h2c();
    let fut = tokio::spawn(async move { send(&h2, req).await });
    for _ in 0..10 {
        tx.send(Bytes::from("x".repeat(50))).await.unwrap();
    }
    drop(tx);
    let (parts, _) = within(10, fut).await.unwrap();
    assert_eq!(parts.status, 413);
    assert_eq!(up.seen.count(), 0, "nothing reached the upstream");
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_the_upstream_request() {
    for proto in ["h1", "h2c"] {
        let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
        let closed_tx = Arc::new(std::sync::Mutex::new(Some(closed_tx)));
        let up = upstream(handler(move |_req| {
            let (tx, body) = channel_body();
            let closed_tx = Arc::clone(&closed_tx);
            tokio::spawn(async move {
                let _ = tx
                    .send(Bytes::from_static(b"data: {\"choices\":[]}\n\n"))
                    .await;
                // Resolves when the proxy drops the upstream body.
                tx.closed().await;
                if let Some(s) = closed_tx.lock().unwrap().take() {
                    let _ = s.send(());
                }
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(body)
                .unwrap()
        }))
        .await;
        let px = proxy(&up.url(), &[]).await;
        let client = if proto == "h1" {
            client_h1()
        } else {
            client_h2c()
        };
        let req = Request::post(px.url("/v1/chat/completions")).body(full(r#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[]}"#)).unwrap();
        let resp = within(10, client.request(req)).await.unwrap();
        let mut body = resp.into_body();
        let _first = within(10, body.frame()).await.unwrap().unwrap();
        drop(body);
        drop(client);
        within(10, closed_rx)
            .await
            .expect("upstream saw the cancel");
        px.stop().await;
    }
}

/// An API request body is read whole however it arrives: one frame, a few,
/// byte by byte, with or without a declared length, over HTTP/1.1 and h2c.
/// The upstream gets exactly its bytes and the response its projection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_in_any_framing_are_read_whole_and_forwarded_exactly() {
    let answer = fixture("openai-chat/nonstream_basic.json");
    let up = upstream(handler(move |_r| {
        Response::builder()
            .header("content-type", "application/json")
            .body(full(answer.clone()))
            .unwrap()
    }))
    .await;
    let px = proxy(&up.url(), &[]).await;
    let body = Bytes::from_static(
        r#"{"model":"gpt-4o","messages":[{"role":"system","content":"Be terse."},{"role":"user","content":"naïve café 日本語 🦀"}]}"#
            .as_bytes(),
    );
    let n = body.len();
    let framings: Vec<(&str, Vec<usize>)> = vec![
        ("one frame", vec![n]),
        ("three frames", vec![7, n / 2, n]),
        // Cuts inside the multi-byte characters too.
        ("byte by byte", (1..=n).collect()),
    ];
    for (label, cuts) in framings {
        for declared in [false, true] {
            for (proto, client) in [("h1", client_h1()), ("h2c", client_h2c())] {
                let mut req = Request::post(px.url("/v1/chat/completions"))
                    .header("content-type", "application/json");
                if declared {
                    req = req.header("content-length", n);
                }
                let req = req.body(chunked(split(&body, &cuts))).unwrap();
                let (parts, _) = send(&client, req).await;
                let what = format!("{label}, declared {declared}, {proto}");
                assert_eq!(parts.status, StatusCode::OK, "{what}");
                assert!(
                    parts.headers.contains_key("x-context-projection"),
                    "{what}: the body was read"
                );
                assert_eq!(up.seen.last().1, body, "{what}: forwarded exactly");
            }
        }
    }
    px.stop().await;
}
