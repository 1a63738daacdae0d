//! A test upstream that can misbehave: its response bodies may fail midway
//! (the proxy sees a reset), stall, or never come. Shared by the fault and
//! soak tests, and under `support::upstream` (whose bodies never fail).
#![allow(dead_code)]

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub type FBody = UnsyncBoxBody<Bytes, BoxError>;
pub type FHandler = Arc<
    dyn Fn(Request<Bytes>) -> Pin<Box<dyn Future<Output = Response<FBody>> + Send>> + Send + Sync,
>;

/// The error a faulty body ends with.
#[derive(Debug)]
pub struct Injected;
impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected upstream fault")
    }
}
impl std::error::Error for Injected {}

pub fn full(b: impl Into<Bytes>) -> FBody {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// A body that sends `chunks` and then fails: the upstream connection is
/// aborted (HTTP/1.1) or the stream reset (HTTP/2) before the body ends.
pub fn then_reset(chunks: Vec<Bytes>) -> FBody {
    let s = futures_util::stream::iter(
        chunks
            .into_iter()
            .map(|b| Ok::<_, BoxError>(Frame::data(b)))
            .chain(std::iter::once(Err(Box::new(Injected) as BoxError))),
    );
    StreamBody::new(s).boxed_unsync()
}

/// Like [`then_reset`], but the body pauses (yields once) before each chunk
/// and before failing, so the upstream server flushes the response head and
/// every chunk first: the proxy sees a reset after a prefix, not before headers.
pub fn then_reset_flushed(chunks: Vec<Bytes>) -> FBody {
    let items: Vec<Result<Bytes, BoxError>> = chunks
        .into_iter()
        .map(Ok)
        .chain(std::iter::once(Err(Box::new(Injected) as BoxError)))
        .collect();
    let s = futures_util::stream::unfold(items.into_iter(), |mut it| async move {
        let item = it.next()?;
        // Give the server's write path a turn: what was sent so far goes out.
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        Some((item.map(Frame::data), it))
    });
    StreamBody::new(s).boxed_unsync()
}

/// A body that sends `chunks` in order and ends.
pub fn chunks(chunks: Vec<Bytes>) -> FBody {
    let s = futures_util::stream::iter(
        chunks
            .into_iter()
            .map(|b| Ok::<_, BoxError>(Frame::data(b))),
    );
    StreamBody::new(s).boxed_unsync()
}

/// A body fed from a channel. `Sender::closed` resolves once the upstream
/// server dropped the body: the proxy went away. Every item is flushed to
/// the wire before the next one is taken, errors included.
pub fn channel() -> (mpsc::Sender<Result<Bytes, BoxError>>, FBody) {
    let (tx, rx) = mpsc::channel::<Result<Bytes, BoxError>>(16);
    let s = futures_util::stream::unfold(rx, |mut rx| async move {
        let item = rx.recv().await?;
        // Pause once so the server writes out what it has before this item
        // (an error aborts the connection, dropping unwritten bytes).
        tokio::task::yield_now().await;
        Some((item.map(Frame::data), rx))
    });
    (tx, StreamBody::new(s).boxed_unsync())
}

/// What the upstream saw.
#[derive(Clone, Default)]
pub struct Seen {
    pub requests: Arc<Mutex<Vec<(http::request::Parts, Bytes)>>>,
    /// Requests whose body failed to arrive whole (the client went away).
    pub body_errors: Arc<AtomicUsize>,
    /// Request heads received (before their bodies).
    pub heads: Arc<AtomicUsize>,
}

impl Seen {
    pub fn count(&self) -> usize {
        self.requests.lock().map(|r| r.len()).unwrap_or(0)
    }
    pub fn last(&self) -> (http::request::Parts, Bytes) {
        self.all().pop().expect("upstream saw a request")
    }
    pub fn all(&self) -> Vec<(http::request::Parts, Bytes)> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
    pub fn body_errors(&self) -> usize {
        self.body_errors.load(Ordering::SeqCst)
    }
    pub fn heads(&self) -> usize {
        self.heads.load(Ordering::SeqCst)
    }
}

pub struct Faulty {
    pub addr: SocketAddr,
    pub seen: Seen,
    _stop: oneshot::Sender<()>,
}

impl Faulty {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Start a faulty upstream (HTTP/1.1 and h2c). Requests whose body fails are
/// counted and not passed to the handler.
pub async fn start(handler: FHandler) -> Faulty {
    start_with(handler, true).await
}

/// As [`start`]; with `record` false the requests are counted but not kept
/// (a soak would otherwise measure the test upstream's own memory).
pub async fn start_with(handler: FHandler, record: bool) -> Faulty {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let (stop, mut stopped) = oneshot::channel::<()>();
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                r = listener.accept() => match r { Ok(s) => s, Err(_) => continue },
                _ = &mut stopped => break,
            };
            let h = Arc::clone(&handler);
            let seen = s2.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let h = Arc::clone(&h);
                    let seen = seen.clone();
                    async move {
                        let (parts, body) = req.into_parts();
                        seen.heads.fetch_add(1, Ordering::SeqCst);
                        let bytes = match body.collect().await {
                            Ok(c) => c.to_bytes(),
                            Err(_) => {
                                seen.body_errors.fetch_add(1, Ordering::SeqCst);
                                return Ok::<_, Infallible>(Response::new(full("")));
                            }
                        };
                        if record {
                            if let Ok(mut r) = seen.requests.lock() {
                                r.push((parts.clone(), bytes.clone()));
                            }
                        }
                        Ok::<_, Infallible>(h(Request::from_parts(parts, bytes)).await)
                    }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Faulty {
        addr,
        seen,
        _stop: stop,
    }
}

/// A handler from a plain closure.
pub fn handler<F>(f: F) -> FHandler
where
    F: Fn(Request<Bytes>) -> Response<FBody> + Send + Sync + 'static,
{
    let f = Arc::new(f);
    Arc::new(move |req| {
        let f = Arc::clone(&f);
        Box::pin(async move { f(req) })
    })
}

/// A handler from an async closure.
pub fn async_handler<F, Fut>(f: F) -> FHandler
where
    F: Fn(Request<Bytes>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<FBody>> + Send + 'static,
{
    let f = Arc::new(f);
    Arc::new(move |req| Box::pin(f(req)))
}

/// Sum of every sample of `name` in a Prometheus text page whose labels
/// include all of `labels` (absent = 0).
pub fn metric(page: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut sum = 0.0;
    for line in page.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (lbl, value) = if let Some(r) = rest.strip_prefix('{') {
            match r.split_once('}') {
                Some((l, v)) => (l, v),
                None => continue,
            }
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            continue;
        };
        let ok = labels
            .iter()
            .all(|(k, v)| lbl.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
        if ok {
            sum += value.trim().parse::<f64>().unwrap_or(0.0);
        }
    }
    sum
}
