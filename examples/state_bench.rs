//! Added latency of `--state redis://` through the proxy: two tidemark
//! instances in this process, one with `--state memory` and one with
//! `--state redis://` (a `redis-server` this starts), in front of one
//! in-process upstream that answers at once with usage. One client sends the
//! same session-keyed requests to both, interleaved so drift hits both alike,
//! and reports p50/p99 of each and the difference, in one run.
//!
//! `cargo run --release --example state_bench [-- REQUESTS]` (default 4000 per backend).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

const NONSTREAM: &str = include_str!("../tests/fixtures/openai-chat/nonstream_basic.json");
/// Sessions the requests rotate over.
const SESSIONS: usize = 50;

/// `redis-server` on a free port, killed on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> (Server, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start redis-server ({e}): apt-get install -y redis-server")
        });
    let server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    (server, port)
}

/// The upstream: every request gets the OpenAI fixture (with usage) at once.
async fn upstream() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(NONSTREAM.as_bytes())))
                            .expect("response"),
                    )
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

/// A tidemark with these flags; returns its address and admin address.
async fn tidemark(upstream: SocketAddr, state: &str) -> (SocketAddr, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let admin = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let (addr, admin_addr) = (
        l.local_addr().expect("addr"),
        admin.local_addr().expect("addr"),
    );
    let up = format!("http://{upstream}");
    let config = tidemark::Config::from_args(["tidemark", "--upstream", &up, "--state", state])
        .expect("valid flags");
    tokio::spawn(async move {
        let _ = tidemark::run(l, admin, config, std::future::pending()).await;
    });
    (addr, admin_addr)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, mut d: Vec<Duration>) -> (Duration, Duration) {
    d.sort_unstable();
    let (p50, p99) = (pct(&d, 0.50), pct(&d, 0.99));
    println!(
        "{name:<14} n={:<6} p50={:>8.1} µs  p99={:>8.1} µs  max={:>8.1} µs",
        d.len(),
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        d[d.len() - 1].as_secs_f64() * 1e6,
    );
    (p50, p99)
}

fn body(turn: usize) -> String {
    let mut messages = vec![serde_json::json!({"role": "system", "content": "You are terse."})];
    for i in 0..=turn % 12 {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {i}: how large is this prompt now, roughly?")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {i}: a few hundred tokens.")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "and now?"}));
    serde_json::json!({"model": "gpt-4o", "messages": messages}).to_string()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4000);
    let (_redis, port) = start_redis();
    let up = upstream().await;
    let redis_url = format!("redis://127.0.0.1:{port}/0");
    let (mem, _) = tidemark(up, "memory").await;
    let (red, red_admin) = tidemark(up, &redis_url).await;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    // Bounded wait until the Redis replica is ready.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let req = Request::get(format!("http://{red_admin}/readyz"))
            .body(Full::new(Bytes::new()))
            .expect("request");
        if let Ok(r) = client.request(req).await {
            if r.status() == 200 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "redis replica not ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let send = |addr: SocketAddr, i: usize| {
        let client = client.clone();
        async move {
            let req = Request::post(format!("http://{addr}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("authorization", "Bearer sk-bench")
                .header("x-session-id", format!("bench-{}", i % SESSIONS))
                .body(Full::new(Bytes::from(body(i / SESSIONS))))
                .expect("request");
            let t = Instant::now();
            let resp = client.request(req).await.expect("proxy answers");
            assert_eq!(resp.status(), 200);
            let projection = resp
                .headers()
                .get("x-context-projection")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            let _ = resp.into_body().collect().await.expect("body");
            (t.elapsed(), projection)
        }
    };
    // Warm up both (connections, caches, scripts).
    for i in 0..200 {
        send(mem, i).await;
        send(red, i).await;
    }
    let (mut m, mut r) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut local = 0;
    for i in 0..n {
        // Alternate which goes first so neither always follows the other.
        let i = 200 + i;
        if i % 2 == 0 {
            m.push(send(mem, i).await.0);
            let (d, p) = send(red, i).await;
            local += usize::from(p.contains("state=local"));
            r.push(d);
        } else {
            let (d, p) = send(red, i).await;
            local += usize::from(p.contains("state=local"));
            r.push(d);
            m.push(send(mem, i).await.0);
        }
    }
    println!(
        "{} build, {n} sequential requests per backend, {SESSIONS} sessions, one client",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    );
    let (mp50, mp99) = report("state=memory", m);
    let (rp50, rp99) = report("state=redis", r);
    let us = |a: Duration, b: Duration| (a.as_secs_f64() - b.as_secs_f64()) * 1e6;
    println!(
        "added by redis: p50 {:+.1} µs, p99 {:+.1} µs ({local} of {n} requests fell back to local state)",
        us(rp50, mp50),
        us(rp99, mp99)
    );
}
