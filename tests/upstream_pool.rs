//! tidemark's own upstream client (src/pool.rs), against a raw TCP upstream
//! that counts its connections and chooses exactly how bytes hit the wire:
//! keep-alive reuse (per worker thread), an idle connection the upstream closed, and a burst of
//! events written at once leaving the proxy together, byte for byte.

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::Request;
use http_body_util::BodyExt;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};

/// How the raw upstream behaves after each response.
#[derive(Clone, Copy)]
enum After {
    KeepAlive,
    /// Close the socket, without `Connection: close`, when the test says so
    /// (a server whose idle timeout fired): the proxy must not reuse it.
    Close,
}

/// A raw upstream, its connections counted; with `After::Close` the test
/// tells it when to close (`close_now`) and hears when it has (`closed`).
struct Raw {
    url: String,
    conns: Arc<AtomicUsize>,
    close_now: Arc<Semaphore>,
    closed: mpsc::UnboundedReceiver<()>,
}

/// Read one request (head plus `content-length` body); false at EOF.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                buf.drain(..end + 4 + len);
                return true;
            }
        }
        let mut chunk = [0u8; 16384];
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A raw upstream answering every request with `response` (written with one
/// `write_all`).
async fn raw_upstream(response: Vec<u8>, after: After) -> Raw {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let conns = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&conns);
    let response = Arc::new(response);
    let close_now = Arc::new(Semaphore::new(0));
    let permits = Arc::clone(&close_now);
    let (closed_tx, closed) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            let response = Arc::clone(&response);
            let permits = Arc::clone(&permits);
            let closed_tx = closed_tx.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while read_request(&mut s, &mut buf).await {
                    if s.write_all(&response).await.is_err() {
                        return;
                    }
                    if let After::Close = after {
                        permits.acquire().await.unwrap().forget();
                        // The FIN leaves with the close, before the signal.
                        drop(s);
                        let _ = closed_tx.send(());
                        return;
                    }
                }
            });
        }
    });
    Raw {
        url,
        conns,
        close_now,
        closed,
    }
}

const BODY: &str = r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#;

fn json_response() -> Vec<u8> {
    let body = r#"{"id":"c1","object":"chat.completion","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}"#;
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_requests_reuse_one_upstream_connection() {
    let Raw { url, conns, .. } = raw_upstream(json_response(), After::KeepAlive).await;
    // One worker: the client may open a second connection (its pool races
    // the next request), which another worker would serve from its own pool.
    let px = proxy(&url, &["--workers", "1"]).await;
    let client = client_h1();
    for _ in 0..5 {
        let (parts, body) = post_json(&client, &px.url("/v1/chat/completions"), BODY).await;
        assert_eq!(parts.status, 200);
        assert!(body.ends_with(b"\"total_tokens\":10}}"));
    }
    // Passthrough paths share the pool too.
    let (parts, _) = post_json(&client, &px.url("/v1/other"), BODY).await;
    assert_eq!(parts.status, 200);
    assert_eq!(conns.load(Ordering::SeqCst), 1, "one keep-alive connection");
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_worker_thread_reuses_upstream_connections_of_its_own() {
    let Raw { url, conns, .. } = raw_upstream(json_response(), After::KeepAlive).await;
    let px = proxy(&url, &["--workers", "2"]).await;
    // Two client connections: handed to the two workers in turn.
    let clients = [client_h1(), client_h1()];
    for round in 0..3 {
        for c in &clients {
            let (parts, _) = post_json(c, &px.url("/v1/chat/completions"), BODY).await;
            assert_eq!(parts.status, 200, "round {round}");
        }
    }
    // A socket is watched by the event loop of the thread that opened it,
    // so each worker pools its own: one upstream connection each, each
    // reused. (One shared pool would have lent the first to both.)
    assert_eq!(conns.load(Ordering::SeqCst), 2);
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_upstream_closed_while_idle_is_not_reused() {
    let mut up = raw_upstream(json_response(), After::Close).await;
    // One worker, so every request meets the pooled connection it closed.
    let px = proxy(&up.url, &["--workers", "1"]).await;
    let client = client_h1();
    for i in 0..5 {
        let (parts, body) = post_json(&client, &px.url("/v1/chat/completions"), BODY).await;
        assert_eq!(parts.status, 200, "request {i}");
        assert!(body.ends_with(b"\"total_tokens\":10}}"));
        // The response is through, so the proxy has pooled the connection.
        // Now the upstream closes it, idle (as after a server's keep-alive
        // timeout), and the next request comes only after that. (A request
        // that crosses the close in flight is a race no HTTP/1.1 client can
        // win for a POST, which must not be sent twice.)
        up.close_now.add_permits(1);
        within(30, up.closed.recv()).await.expect("upstream closed");
    }
    assert_eq!(up.conns.load(Ordering::SeqCst), 5);
    px.stop().await;
}

/// 50 events and a usage event as one chunked response written with a
/// single write; returns it and the body bytes the client must receive.
fn burst() -> (Vec<u8>, Vec<u8>) {
    let mut events = Vec::new();
    for i in 0..50 {
        events.push(format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{i}\"}}}}]}}\n\n"
        ));
    }
    events.push("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":50,\"total_tokens\":57}}\n\ndata: [DONE]\n\n".to_string());
    let mut response =
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            .to_vec();
    for ev in &events {
        response.extend_from_slice(format!("{:x}\r\n{ev}\r\n", ev.len()).as_bytes());
    }
    response.extend_from_slice(b"0\r\n\r\n");
    (response, events.concat().into_bytes())
}

/// Stream the burst through a proxy started with `flags`: the bytes the
/// client got, in how many frames, and the proxy's metrics text.
/// `model` names the request's model, so that this test's line of the
/// process-wide metrics is its own.
async fn through_proxy(flags: &[&str], model: &str) -> (Vec<u8>, usize, Vec<u8>, String) {
    let (response, expected) = burst();
    let up = raw_upstream(response, After::KeepAlive).await;
    let px = proxy(&up.url, flags).await;
    let client = client_h1();
    let req = Request::post(px.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(full(Bytes::from(format!(
            r#"{{"model":"{model}","stream":true,"stream_options":{{"include_usage":true}},"messages":[]}}"#
        ))))
        .unwrap();
    let resp = within(30, client.request(req)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let (mut got, mut frames) = (Vec::new(), 0);
    while let Some(f) = within(30, body.frame()).await {
        if let Ok(d) = f.unwrap().into_data() {
            frames += 1;
            got.extend_from_slice(&d);
        }
    }
    let (_, metrics) = get(&client, &px.admin_url("/metrics")).await;
    px.stop().await;
    (
        got,
        frames,
        expected,
        String::from_utf8_lossy(&metrics).into_owned(),
    )
}

fn real_prompt_tokens<'m>(metrics: &'m str, model: &str) -> Option<&'m str> {
    let label = format!("model=\"{model}\"");
    metrics
        .lines()
        .find(|l| l.starts_with("tidemark_prompt_tokens_real_total") && l.contains(&label))
        .and_then(|l| l.rsplit(' ').next())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_that_arrive_together_leave_together_byte_for_byte() {
    let (got, frames, expected, metrics) = through_proxy(&[], "gpt-4o-burst").await;
    assert_eq!(
        got, expected,
        "the client gets exactly the upstream's bytes"
    );
    // hyper's own pooled client would hand these over, and write them, one
    // event at a time (51 frames).
    assert!(frames <= 5, "{frames} frames for one burst");
    // And the tap read the usage event inside the burst.
    assert_eq!(
        real_prompt_tokens(&metrics, "gpt-4o-burst"),
        Some("7"),
        "usage read from the burst"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_tap_forwards_the_same_bytes_and_reads_no_usage() {
    let (got, _, expected, metrics) = through_proxy(&["--no-tap"], "gpt-4o-notap").await;
    assert_eq!(got, expected);
    assert_eq!(
        real_prompt_tokens(&metrics, "gpt-4o-notap"),
        None,
        "--no-tap reads nothing"
    );
}
