//! Test support: start the real proxy and a real upstream on 127.0.0.1:0 and
//! talk HTTP to them. No sleeps: every wait is bounded by `within`.
//!
//! Submodules, each shared by the test files that need it:
//! - `faults`: an upstream whose bodies reset, stall or never come;
//! - `mixed`: mixed-content agent sessions through the proxy in front of the
//!   simulator (also `examples/drift.rs`, by path);
//! - `redis`: a real `redis-server` on a free port;
//! - `trim`: conversations for the trimmer and their per-API validators.
#![allow(dead_code)]

pub mod faults;
pub mod mixed;
pub mod redis;
pub mod trim;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

pub type Body = UnsyncBoxBody<Bytes, Infallible>;
pub type Handler = Arc<
    dyn Fn(Request<Bytes>) -> Pin<Box<dyn Future<Output = Response<Body>> + Send>> + Send + Sync,
>;

/// Fail the test instead of hanging.
pub async fn within<T>(secs: u64, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("timed out waiting")
}

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed_unsync()
}

/// A body fed from a channel: each message is one chunk on the wire.
pub fn channel_body() -> (mpsc::Sender<Bytes>, Body) {
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let s = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    (tx, StreamBody::new(s).boxed_unsync())
}

/// A body that sends the given chunks in order.
pub fn chunked(chunks: Vec<Bytes>) -> Body {
    let s = futures_util::stream::iter(
        chunks
            .into_iter()
            .map(|b| Ok::<_, Infallible>(Frame::data(b))),
    );
    StreamBody::new(s).boxed_unsync()
}

/// A hand-written test upstream: the `faults` server, answering with a
/// handler whose bodies cannot fail.
pub type Upstream = faults::Faulty;

/// Start a test upstream (HTTP/1.1 and h2c) that answers with `handler`.
pub async fn upstream(handler: Handler) -> Upstream {
    faults::start(Arc::new(move |req| {
        let h = Arc::clone(&handler);
        Box::pin(async move {
            h(req)
                .await
                .map(|b| b.map_err(|never| match never {}).boxed_unsync())
        })
    }))
    .await
}

/// The simulated provider (`tidemark::sim`) on a free port, stopped on
/// drop: the one upstream every test plays its provider with, with its
/// cache accounting and its count of requests abandoned mid-fault
/// (`x-sim-fault`).
pub struct Sim {
    pub url: String,
    pub addr: SocketAddr,
    pub acct: tidemark::sim::Accounting,
    pub abandoned: tidemark::sim::Abandoned,
    _stop: oneshot::Sender<()>,
}

pub async fn sim(cfg: tidemark::sim::SimConfig) -> Sim {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let s = tidemark::sim::Simulator::new(cfg);
    let (acct, abandoned) = (s.accounting(), s.abandoned());
    tokio::spawn(s.serve(l, async move {
        let _ = rx.await;
    }));
    Sim {
        url: format!("http://{addr}"),
        addr,
        acct,
        abandoned,
        _stop: tx,
    }
}

/// A handler from a plain closure returning a response.
pub fn handler<F>(f: F) -> Handler
where
    F: Fn(Request<Bytes>) -> Response<Body> + Send + Sync + 'static,
{
    let f = Arc::new(f);
    Arc::new(move |req| {
        let f = Arc::clone(&f);
        Box::pin(async move { f(req) })
    })
}

pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<()>>,
}

impl Proxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }
    /// Signal shutdown and wait (bounded) for `run` to return.
    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            within(30, t).await.unwrap();
        }
    }
}

/// Start the real proxy with flags (the upstream given as `--upstream`).
pub async fn proxy(upstream: &str, extra: &[&str]) -> Proxy {
    let mut args = vec!["tidemark", "--upstream", upstream];
    args.extend_from_slice(extra);
    let config = tidemark::Config::from_args(args).expect("valid flags");
    proxy_with(config).await
}

pub async fn proxy_with(config: tidemark::Config) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let admin_addr = admin.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        tidemark::run(listener, admin, config, async {
            let _ = stopped.await;
        })
        .await
        .expect("proxy runs");
    });
    Proxy {
        addr,
        admin: admin_addr,
        stop: Some(stop),
        task: Some(task),
    }
}

pub type TestClient = Client<hyper_util::client::legacy::connect::HttpConnector, Body>;

pub fn client_h1() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn client_h2c() -> TestClient {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

pub fn post(url: &str, body: impl Into<Bytes>) -> http::request::Builder {
    let _ = body;
    Request::post(url).header("content-type", "application/json")
}

/// Send and collect: (status, headers, body, chunk sizes as received).
pub async fn send(client: &TestClient, req: Request<Body>) -> (http::response::Parts, Bytes) {
    let resp = within(30, client.request(req))
        .await
        .expect("proxy answers");
    let (parts, body) = resp.into_parts();
    let bytes = within(30, body.collect())
        .await
        .expect("body reads")
        .to_bytes();
    (parts, bytes)
}

pub async fn get(client: &TestClient, url: &str) -> (http::response::Parts, Bytes) {
    send(client, Request::get(url).body(full(Bytes::new())).unwrap()).await
}

pub async fn post_json(
    client: &TestClient,
    url: &str,
    body: &str,
) -> (http::response::Parts, Bytes) {
    let req = Request::post(url)
        .header("content-type", "application/json")
        .body(full(body.to_string()))
        .unwrap();
    send(client, req).await
}

pub fn fixture(rel: &str) -> Bytes {
    let p = format!("{}/tests/fixtures/{rel}", env!("CARGO_MANIFEST_DIR"));
    Bytes::from(std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}")))
}

/// Every response-body fixture: (folder/file, content-type, request path, request body).
pub fn stream_fixtures() -> Vec<(String, &'static str, String, String)> {
    let dir = format!("{}/tests/fixtures", env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for folder in [
        "openai-chat",
        "openai-responses",
        "anthropic-messages",
        "gemini",
        "ollama",
    ] {
        let mut names: Vec<String> = std::fs::read_dir(format!("{dir}/{folder}"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        for n in names {
            if n == "expected.json" || n.ends_with("_request.json") {
                continue;
            }
            let ct = if n.ends_with(".sse") {
                "text/event-stream"
            } else if n.ends_with(".ndjson") {
                "application/x-ndjson"
            } else {
                "application/json"
            };
            let (path, body) = request_for(folder, &n);
            out.push((format!("{folder}/{n}"), ct, path, body));
        }
    }
    out
}

/// A plausible request for a fixture's API.
pub fn request_for(folder: &str, name: &str) -> (String, String) {
    let stream = name.contains("stream");
    match folder {
        "openai-chat" => (
            "/v1/chat/completions".into(),
            format!(
                r#"{{"model":"gpt-4o","stream":{stream},"stream_options":{{"include_usage":true}},"messages":[{{"role":"user","content":"hello"}}]}}"#
            ),
        ),
        "openai-responses" => (
            "/v1/responses".into(),
            format!(r#"{{"model":"gpt-4o","stream":{stream},"input":"hello"}}"#),
        ),
        "anthropic-messages" => (
            "/v1/messages".into(),
            format!(
                r#"{{"model":"claude-sonnet-4-5","max_tokens":100,"stream":{stream},"messages":[{{"role":"user","content":"hello"}}]}}"#
            ),
        ),
        "gemini" => (
            if stream {
                "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse".into()
            } else {
                "/v1beta/models/gemini-2.5-flash:generateContent".into()
            },
            r#"{"contents":[{"role":"user","parts":[{"text":"hello"}]}]}"#.into(),
        ),
        _ => {
            if name.starts_with("v1_") {
                (
                    "/v1/chat/completions".into(),
                    r#"{"model":"llama3.2","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hello"}]}"#
                        .to_string(),
                )
            } else {
                (
                    "/api/chat".into(),
                    format!(
                        r#"{{"model":"llama3.2","stream":{stream},"messages":[{{"role":"user","content":"hello"}}]}}"#
                    ),
                )
            }
        }
    }
}
