//! The upstream client: pooled connections, HTTP/1.1 driven by the response
//! body that reads them, HTTP/2 shared by ALPN.
//!
//! An HTTP/1.1 connection has no task of its own, and tidemark speaks the
//! protocol itself (`h1.rs`). The request is written and its response head
//! read by the request's task; the response body ([`UpstreamBody`]) then
//! carries the connection and reads it whenever it runs dry, in the task
//! that writes to the client. Every chunk that has already arrived is
//! decoded in that one pass and leaves as one frame, the way nginx forwards
//! with `proxy_buffering off`; nothing waits for bytes that have not
//! arrived. A token stream whose events arrive one by one is forwarded event
//! by event. Only chunk boundaries change, which HTTP/1.1 and HTTP/2 leave
//! to each hop.
//!
//! When the body has been read to its end, the connection goes back to the
//! pool; when the body is dropped early (the client left), the connection is
//! closed, which is how the upstream learns of the cancel. An idle connection
//! is checked before reuse (closed by the server, or not ready for another
//! request: dropped), and a request that a reused connection could not take
//! is sent again on a fresh one; nothing is ever sent twice. A request
//! already written when the server's close crosses it fails (502
//! `upstream-reset`): it may have been delivered, and a POST is not repeated.
//! The server's close must arrive in the instant before the request leaves;
//! one that came earlier is seen by the check.
//!
//! Idle HTTP/1.1 connections are pooled per worker thread
//! (`server::Worker`): a socket is watched by the event loop of the thread
//! that opened it, so it is only ever reused there.
//!
//! An upstream that offers HTTP/2 by ALPN gets one multiplexed connection
//! (hyper's own task, as h2 needs) shared by all requests to it.

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::HOST;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Request, Response, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_rustls::MaybeHttpsStream;
use hyper_util::client::legacy::connect::Connection as _;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpStream;
use tower_service::Service;

use super::h1::{self, Decoded, Sent, Sink};
use super::{BoxError, TimedConnector, UpBody, UpstreamError};

/// An HTTP/1.1 connection: the (maybe TLS) socket, seen through tokio's
/// read and write traits, and its read buffer. Boxed once when it is made:
/// handing it between the pool, a request and its response body then moves
/// a pointer, not its TLS state.
type H1 = h1::Conn<TokioIo<MaybeHttpsStream<TokioIo<TcpStream>>>>;

/// Bytes that leave as one frame at most.
const MAX_PIECE: usize = 64 * 1024;

#[derive(Clone, PartialEq, Eq)]
struct Key(Scheme, Authority);

impl std::hash::Hash for Key {
    /// One write per key. `http` hashes an authority a byte at a time
    /// (`write_u8` each, to fold case), which made hashing the key the
    /// dearest part of the two pool lookups every request makes.
    /// Folded here into one FNV-1a word, case-insensitive as `Authority`'s
    /// `Eq` is (equal keys hash alike); the keys come from the
    /// configuration, not from clients, so the weaker mixing before SipHash
    /// is no exposure.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let bytes = self.0.as_str().bytes().chain([b':']);
        let h = bytes
            .chain(self.1.as_str().bytes())
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b.to_ascii_lowercase())).wrapping_mul(0x0100_0000_01b3)
            });
        state.write_u64(h);
    }
}

impl Key {
    /// The key of an absolute URI.
    fn of(uri: &Uri) -> Result<Key, UpstreamError> {
        match (uri.scheme(), uri.authority()) {
            (Some(s), Some(a)) => Ok(Key(s.clone(), a.clone())),
            _ => Err(UpstreamError::Connect),
        }
    }

    /// `Host` for a request that has none: this key's authority.
    fn host(&self, req: &mut Request<UpBody>) {
        if !req.headers().contains_key(HOST) {
            if let Some(v) = super::host_value(&self.1) {
                req.headers_mut().insert(HOST, v);
            }
        }
    }
}

struct Idle {
    h1: Box<H1>,
    since: Instant,
}

// foldhash: the key is hashed twice a request (checkout and return), and
// std's SipHash of its folded u64 cost more than the rest of the lookup.
type HashMap<K, V> = foldhash::HashMap<K, V>;

type IdlePool = Mutex<HashMap<Key, Vec<Idle>>>;

struct Shared {
    connector: TimedConnector,
    /// The same, offering only HTTP/1.1 by ALPN: an upgrade (WebSocket)
    /// needs an HTTP/1.1 connection of its own.
    connector_h1: TimedConnector,
    /// Idle connections, one pool per worker thread (`server::Worker`): a
    /// socket is watched by the event loop of the thread that opened it, so
    /// one used from another thread would cross threads on every read.
    idle: Box<[IdlePool]>,
    h2: Mutex<HashMap<Key, http2::SendRequest<UpBody>>>,
    max_idle_per_host: usize,
    idle_timeout: Duration,
}

/// The shared upstream client (cheap to clone).
#[derive(Clone)]
pub struct Client(Arc<Shared>);

/// An HTTP/1.1 connection travelling with its response body.
struct Driven {
    h1: Box<H1>,
    reader: h1::Reader,
    key: Key,
    pool: Arc<Shared>,
}

impl Client {
    /// `workers`: how many worker threads keep pools of their own.
    pub fn new(
        connector: TimedConnector,
        connector_h1: TimedConnector,
        workers: usize,
        max_idle_per_host: usize,
        idle_timeout: Duration,
    ) -> Self {
        Client(Arc::new(Shared {
            connector,
            connector_h1,
            idle: (0..workers.max(1))
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
            h2: Mutex::new(HashMap::default()),
            max_idle_per_host,
            idle_timeout,
        }))
    }

    /// Send `req` (absolute URI) and wait for the response head.
    pub async fn request(
        &self,
        req: Request<UpBody>,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        let uri = req.uri().clone();
        let key = Key::of(&uri)?;
        let mut req = req;
        if let Some(h2) = self.h2_for(&key) {
            match send_h2(h2, &key, req).await {
                Ok(r) => return Ok(r),
                Err(Retry::Again(r)) => {
                    self.0.h2.lock().unwrap().remove(&key);
                    req = r;
                }
                Err(Retry::Failed(e)) => return Err(e),
            }
        }
        // Idle HTTP/1.1 connections first; a request they could not take is
        // sent again, at most once per idle connection, then on a new one.
        while let Some(idle) = self.checkout(&key) {
            match self.send_h1(idle.h1, &key, req, true).await {
                Ok(r) => return Ok(r),
                Err(Retry::Again(r)) => req = r,
                Err(Retry::Failed(e)) => return Err(e),
            }
        }
        // A new connection: its connect and handshake futures (kilobytes,
        // TLS state included) live in a box of their own, so the future of
        // every request that reuses a connection stays small.
        Box::pin(self.fresh(uri, key, req)).await
    }

    async fn fresh(
        &self,
        uri: Uri,
        key: Key,
        req: Request<UpBody>,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        let io = self
            .0
            .connector
            .clone()
            .call(uri)
            .await
            .map_err(|e| UpstreamError::classify(&*e, true))?;
        if io.connected().is_negotiated_h2() {
            let (send, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(io)
                .await
                .map_err(|e| UpstreamError::classify(&e, true))?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            self.0.h2.lock().unwrap().insert(key.clone(), send.clone());
            return on_fresh(send_h2(send, &key, req).await);
        }
        let h1 = Box::new(h1::Conn::new(TokioIo::new(io)));
        on_fresh(self.send_h1(h1, &key, req, false).await)
    }

    fn h2_for(&self, key: &Key) -> Option<http2::SendRequest<UpBody>> {
        let mut map = self.0.h2.lock().unwrap();
        match map.get(key) {
            Some(s) if !s.is_closed() => Some(s.clone()),
            Some(_) => {
                map.remove(key);
                None
            }
            None => None,
        }
    }

    /// The most recently used idle connection that has not timed out
    /// (`send_h1` checks that it is still open).
    fn checkout(&self, key: &Key) -> Option<Idle> {
        let mut map = self.0.idle().lock().unwrap();
        let list = map.get_mut(key)?;
        let now = Instant::now();
        let found = loop {
            let idle = list.pop()?;
            if now.duration_since(idle.since) <= self.0.idle_timeout {
                break idle;
            }
        };
        if list.is_empty() {
            map.remove(key);
        }
        Some(found)
    }

    /// Sends on an HTTP/1.1 connection. `reused`: it sat idle, so it is
    /// checked first, and if the server closed it the request comes back.
    async fn send_h1(
        &self,
        mut h1: Box<H1>,
        key: &Key,
        mut req: Request<UpBody>,
        reused: bool,
    ) -> Result<Response<UpstreamBody>, Retry> {
        key.host(&mut req);
        match h1::send(&mut h1, req, reused).await {
            Ok(Sent::NotSent(req)) => Err(Retry::Again(req)),
            Ok(Sent::Response(r)) => Ok(self.h1_response(h1, key, r)),
            Err(e) => Err(Retry::Failed(UpstreamError::classify(&e, false))),
        }
    }

    /// A response on an HTTP/1.1 connection, its body reading the connection.
    fn h1_response(&self, h1: Box<H1>, key: &Key, r: h1::Response) -> Response<UpstreamBody> {
        let driven = Driven {
            h1,
            reader: r.body,
            key: key.clone(),
            pool: Arc::clone(&self.0),
        };
        let mut resp = Response::new(UpstreamBody::new(Src::H1(driven)));
        *resp.status_mut() = r.head.status;
        *resp.version_mut() = r.head.version;
        *resp.headers_mut() = r.head.headers;
        resp
    }

    /// Send an upgrade request (`Connection: upgrade`, a WebSocket
    /// handshake) on HTTP/1.1, whatever the upstream offers by ALPN, and
    /// wait for the response head. A `101` hands the connection over: it
    /// never goes back to the pool. Any other answer is an ordinary
    /// response (and its connection may be reused after it).
    pub async fn upgrade(&self, req: Request<UpBody>) -> Result<Upgrade, UpstreamError> {
        let uri = req.uri().clone();
        let key = Key::of(&uri)?;
        let mut req = req;
        while let Some(idle) = self.checkout(&key) {
            match self.send_upgrade(idle.h1, &key, req, true).await {
                Ok(u) => return Ok(u),
                Err(Retry::Again(r)) => req = r,
                Err(Retry::Failed(e)) => return Err(e),
            }
        }
        let io = self
            .0
            .connector_h1
            .clone()
            .call(uri)
            .await
            .map_err(|e| UpstreamError::classify(&*e, true))?;
        let h1 = Box::new(h1::Conn::new(TokioIo::new(io)));
        self.send_upgrade(h1, &key, req, false)
            .await
            .map_err(|e| match e {
                Retry::Again(_) => UpstreamError::Reset,
                Retry::Failed(e) => e,
            })
    }

    async fn send_upgrade(
        &self,
        mut h1: Box<H1>,
        key: &Key,
        mut req: Request<UpBody>,
        reused: bool,
    ) -> Result<Upgrade, Retry> {
        key.host(&mut req);
        match h1::send(&mut h1, req, reused).await {
            Ok(Sent::NotSent(req)) => Err(Retry::Again(req)),
            Ok(Sent::Response(r)) if r.head.status == http::StatusCode::SWITCHING_PROTOCOLS => {
                let (io, read) = h1.into_parts();
                Ok(Upgrade::Switched {
                    head: r.head,
                    io: UpgradedIo {
                        io: Box::new(io),
                        read,
                    },
                })
            }
            Ok(Sent::Response(r)) => Ok(Upgrade::Refused(self.h1_response(h1, key, r))),
            Err(e) => Err(Retry::Failed(UpstreamError::classify(&e, false))),
        }
    }
}

/// What an upgrade request came to.
#[allow(clippy::large_enum_variant)] // moved once per handshake, never stored
pub enum Upgrade {
    /// `101 Switching Protocols`: its head, and the connection, now raw.
    Switched { head: h1::Head, io: UpgradedIo },
    /// Any other answer, as an ordinary response.
    Refused(Response<UpstreamBody>),
}

/// An upstream connection after `101`: the bytes that came with the head
/// first, then the socket (TLS for an https upstream: `wss`).
pub struct UpgradedIo {
    /// Boxed as the pool boxes it: the TLS state is kilobytes.
    io: Box<TokioIo<MaybeHttpsStream<TokioIo<TcpStream>>>>,
    read: BytesMut,
}

impl tokio::io::AsyncRead for UpgradedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.read.is_empty() {
            let n = self.read.len().min(buf.remaining());
            buf.put_slice(&self.read.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut *self.io).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for UpgradedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.io).poll_shutdown(cx)
    }
}

#[allow(clippy::large_enum_variant)] // moved once per attempt, never stored
enum Retry {
    /// The connection did not take the request; here it is back.
    Again(Request<UpBody>),
    Failed(UpstreamError),
}

/// A request a new connection did not take: nothing more to try.
fn on_fresh(
    r: Result<Response<UpstreamBody>, Retry>,
) -> Result<Response<UpstreamBody>, UpstreamError> {
    r.map_err(|e| match e {
        Retry::Again(_) => UpstreamError::Reset,
        Retry::Failed(e) => e,
    })
}

/// Point `req` at `key` in the form HTTP/2 wants: the absolute URI (its
/// `:scheme` and `:authority`) and no `Host`. HTTP/1.1 (`h1::send`) writes
/// the origin form and sets `Host` itself, so a request an HTTP/2
/// connection gave back can go out on HTTP/1.1 as it is.
fn target_h2(req: &mut Request<UpBody>, key: &Key) {
    let mut parts = std::mem::take(req.uri_mut()).into_parts();
    if parts.path_and_query.is_none() {
        parts.path_and_query = Some(PathAndQuery::from_static("/"));
    }
    parts.scheme = Some(key.0.clone());
    parts.authority = Some(key.1.clone());
    req.headers_mut().remove(HOST);
    *req.version_mut() = Version::HTTP_2;
    *req.uri_mut() = Uri::from_parts(parts).unwrap_or_default();
}

async fn send_h2(
    mut send: http2::SendRequest<UpBody>,
    key: &Key,
    mut req: Request<UpBody>,
) -> Result<Response<UpstreamBody>, Retry> {
    target_h2(&mut req, key);
    if poll_fn(|cx| send.poll_ready(cx)).await.is_err() {
        return Err(Retry::Again(req));
    }
    match send.try_send_request(req).await {
        Ok(resp) => Ok(resp.map(|body| UpstreamBody::new(Src::H2(body)))),
        Err(mut e) => match e.take_message() {
            Some(req) => Err(Retry::Again(req)),
            None => Err(Retry::Failed(UpstreamError::classify(e.error(), false))),
        },
    }
}

thread_local! {
    /// The worker thread this is, if it is one.
    static WORKER: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Called once by each worker thread as it starts: its pool is `index`.
pub fn set_worker(index: usize) {
    WORKER.with(|w| w.set(index));
}

impl Shared {
    /// This thread's idle connections (other threads share the first pool).
    fn idle(&self) -> &IdlePool {
        &self.idle[WORKER.with(|w| w.get()) % self.idle.len()]
    }

    fn put(&self, d: Driven) {
        if !d.reader.reusable() || !d.h1.clean() {
            return;
        }
        let mut map = self.idle().lock().unwrap();
        let list = map.entry(d.key).or_default();
        let now = Instant::now();
        // Pushed in time order (and taken from the end), so the oldest is
        // first: only when it has timed out is the list swept.
        let expired = |i: &Idle| now.duration_since(i.since) > self.idle_timeout;
        if list.first().is_some_and(expired) {
            list.retain(|i| !expired(i));
        }
        if list.len() < self.max_idle_per_host {
            list.push(Idle {
                h1: d.h1,
                since: now,
            });
        }
    }
}

/// What ended the gathering, handed out after the held bytes.
enum After {
    Nothing,
    /// Boxed (trailers are rare): a response body is moved several times
    /// on its way to the client, and a HeaderMap in place made every body
    /// 88 bytes larger (312 against 240).
    Trailers(Box<HeaderMap>),
    Error(BoxError),
    End,
}

/// Where a response body comes from.
enum Src {
    /// An HTTP/2 stream (hyper's connection task feeds it).
    H2(Incoming),
    /// An HTTP/1.1 connection this body reads and decodes itself.
    H1(Driven),
    /// The HTTP/1.1 body was read to its end and its connection let go.
    Done,
}

/// The piece being gathered: the first bytes as they came, and the piece
/// once more joined them.
#[derive(Default)]
struct Held {
    first: Option<Bytes>,
    joined: BytesMut,
}

impl Sink for Held {
    fn bytes(&mut self, data: Bytes) {
        if self.first.is_none() && self.joined.is_empty() {
            self.first = Some(data);
        } else {
            self.slice(&data);
        }
    }

    fn slice(&mut self, data: &[u8]) {
        if let Some(first) = self.first.take() {
            self.joined.reserve(first.len() + data.len());
            self.joined.extend_from_slice(&first);
        }
        self.joined.extend_from_slice(data);
    }

    fn held(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.joined.len()
    }

    fn reserve(&mut self, n: usize) {
        let first = self.first.as_ref().map_or(0, Bytes::len);
        self.joined.reserve(first + n);
    }
}

impl Held {
    fn take(&mut self) -> Option<Frame<Bytes>> {
        match self.first.take() {
            Some(b) => Some(Frame::data(b)),
            None if !self.joined.is_empty() => Some(Frame::data(self.joined.split().freeze())),
            None => None,
        }
    }

    fn is_empty(&self) -> bool {
        self.first.is_none() && self.joined.is_empty()
    }
}

/// A response body from upstream: the bytes that have arrived, each time as
/// one frame.
pub struct UpstreamBody {
    src: Src,
    held: Held,
    after: After,
    ended: bool,
}

impl UpstreamBody {
    fn new(src: Src) -> Self {
        let mut b = UpstreamBody {
            src,
            held: Held::default(),
            after: After::Nothing,
            ended: false,
        };
        if let Src::H1(d) = &b.src {
            if d.reader.done() {
                // No body to read (204, HEAD, Content-Length: 0): the
                // connection is free again now.
                b.release();
            }
        }
        b
    }

    /// The HTTP/1.1 body was read to its end: the connection can serve
    /// another request, if it is fit to.
    fn release(&mut self) {
        if let Src::H1(_) = self.src {
            if let Src::H1(d) = std::mem::replace(&mut self.src, Src::Done) {
                let pool = Arc::clone(&d.pool);
                pool.put(d);
            }
        }
    }

    /// Hand out what is held, then `then`.
    fn emit(&mut self, then: After) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match then {
            After::End | After::Trailers(_) => self.release(),
            // Not reused: dropping the connection closes it.
            After::Error(_) if matches!(self.src, Src::H1(_)) => self.src = Src::Done,
            _ => {}
        }
        match self.held.take() {
            Some(f) => {
                self.after = then;
                Poll::Ready(Some(Ok(f)))
            }
            None => self.finish(then),
        }
    }

    fn finish(&mut self, then: After) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match then {
            After::Nothing => Poll::Pending,
            After::Trailers(t) => {
                // Trailers are a body's last frame.
                self.ended = true;
                Poll::Ready(Some(Ok(Frame::trailers(*t))))
            }
            After::Error(e) => {
                self.ended = true;
                Poll::Ready(Some(Err(e)))
            }
            After::End => {
                self.ended = true;
                Poll::Ready(None)
            }
        }
    }

    fn poll_h2(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let Src::H2(body) = &mut self.src else {
            return self.emit(After::End);
        };
        loop {
            match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if !data.is_empty() {
                            self.held.bytes(data);
                        }
                        if body.is_end_stream() {
                            return self.emit(After::End);
                        }
                        if self.held.held() >= MAX_PIECE {
                            return self.emit(After::Nothing);
                        }
                    }
                    Err(frame) => match frame.into_trailers() {
                        Ok(t) => return self.emit(After::Trailers(Box::new(t))),
                        Err(_) => continue,
                    },
                },
                Poll::Ready(Some(Err(e))) => return self.emit(After::Error(Box::new(e))),
                Poll::Ready(None) => return self.emit(After::End),
                Poll::Pending => {
                    return match self.held.take() {
                        Some(f) => Poll::Ready(Some(Ok(f))),
                        None => Poll::Pending,
                    }
                }
            }
        }
    }

    fn poll_h1(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            let Src::H1(d) = &mut self.src else {
                return self.emit(After::End);
            };
            // Everything that has arrived, decoded in one pass.
            match d.reader.decode(&mut d.h1, &mut self.held, MAX_PIECE) {
                Err(e) => return self.emit(After::Error(Box::new(e))),
                Ok(Decoded::End(None)) => return self.emit(After::End),
                Ok(Decoded::End(Some(t))) => return self.emit(After::Trailers(Box::new(t))),
                Ok(Decoded::More) if self.held.held() >= MAX_PIECE => {
                    return self.emit(After::Nothing)
                }
                Ok(Decoded::More) => {}
            }
            match d.h1.poll_body_read(cx) {
                Poll::Ready(Ok(0)) => {
                    return match d.reader.at_close() {
                        Ok(()) => {
                            // Read to the close: nothing to reuse.
                            self.src = Src::Done;
                            self.emit(After::End)
                        }
                        Err(e) => self.emit(After::Error(Box::new(e))),
                    };
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return self.emit(After::Error(Box::new(e))),
                // Nothing more yet: send what is held, or wait.
                Poll::Pending => {
                    return match self.held.take() {
                        Some(f) => Poll::Ready(Some(Ok(f))),
                        None => Poll::Pending,
                    }
                }
            }
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match std::mem::replace(&mut this.after, After::Nothing) {
            After::Nothing => {}
            then => return this.finish(then),
        }
        if this.ended {
            return Poll::Ready(None);
        }
        match this.src {
            Src::H2(_) => this.poll_h2(cx),
            _ => this.poll_h1(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended
            || (self.held.is_empty()
                && match self.after {
                    After::End => true,
                    After::Nothing => match &self.src {
                        Src::H2(b) => b.is_end_stream(),
                        Src::H1(d) => d.reader.done(),
                        Src::Done => true,
                    },
                    _ => false,
                })
    }

    fn size_hint(&self) -> SizeHint {
        let held = self.held.held() as u64;
        match &self.src {
            Src::H2(b) => {
                let inner = b.size_hint();
                let mut h = SizeHint::new();
                h.set_lower(inner.lower() + held);
                if let Some(u) = inner.upper() {
                    h.set_upper(u + held);
                }
                h
            }
            Src::H1(d) => match d.reader.left() {
                Some(left) => SizeHint::with_exact(left + held),
                None => {
                    let mut h = SizeHint::new();
                    h.set_lower(held);
                    h
                }
            },
            Src::Done => SizeHint::with_exact(held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::oneshot;

    fn post(addr: std::net::SocketAddr) -> Request<UpBody> {
        Request::post(format!("http://{addr}/v1/chat/completions"))
            .body(
                Full::new(Bytes::from_static(b"{}"))
                    .map_err(|e| match e {})
                    .boxed_unsync(),
            )
            .unwrap()
    }

    #[test]
    fn keys_equal_in_any_case_hash_alike_and_others_apart() {
        use std::hash::BuildHasher;
        let key = |scheme: &str, authority: &str| {
            Key(
                Scheme::try_from(scheme).unwrap(),
                Authority::try_from(authority).unwrap(),
            )
        };
        let s = std::collections::hash_map::RandomState::new();
        let a = key("https", "API.openai.com:443");
        let b = key("https", "api.OpenAI.com:443");
        assert!(a == b);
        assert_eq!(s.hash_one(&a), s.hash_one(&b));
        for other in [
            key("http", "api.openai.com:443"),
            key("https", "api.openai.com:444"),
            key("https", "api.openai.com"),
        ] {
            assert!(a != other);
            assert_ne!(s.hash_one(&a), s.hash_one(&other));
        }
    }

    /// A client with the default configuration and a raw upstream's
    /// listener, with its address.
    async fn client_and_listener() -> (Client, TcpListener, std::net::SocketAddr) {
        let config =
            crate::Config::from_args(["tidemark", "--upstream", "http://127.0.0.1:1"]).unwrap();
        let client = crate::upstream::client(&config).unwrap();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        (client, l, addr)
    }

    /// Reads one request of [`post`] (its body is `{}`) off the socket.
    async fn read_post(s: &mut tokio::net::TcpStream) {
        let mut buf = [0u8; 4096];
        let mut got = Vec::new();
        while !got.ends_with(b"{}") {
            let n = s.read(&mut buf).await.unwrap();
            got.extend_from_slice(&buf[..n]);
        }
    }

    /// A chunked response's trailers reach the body's reader as its last
    /// frame, after the data, and the connection goes back to the pool.
    #[tokio::test]
    async fn trailers_are_the_last_frame() {
        let (client, l, addr) = client_and_listener().await;
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            read_post(&mut s).await;
            s.write_all(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
                  3\r\nabc\r\n0\r\nx-checksum: 42\r\n\r\n",
            )
            .await
            .unwrap();
            // Held open: the body must end at its last chunk, not the close.
            let _ = s.read(&mut [0u8; 16]).await;
        });
        let read = async {
            let resp = client.request(post(addr)).await.unwrap();
            resp.into_body().collect().await.unwrap()
        };
        let got = tokio::time::timeout(Duration::from_secs(10), read)
            .await
            .expect("the body ends at its trailers");
        assert_eq!(
            got.trailers().map(|t| &t["x-checksum"]),
            Some(&http::HeaderValue::from_static("42"))
        );
        assert_eq!(&got.to_bytes()[..], b"abc");
        let key = Key(Scheme::HTTP, Authority::try_from(addr.to_string()).unwrap());
        assert!(client
            .0
            .idle()
            .lock()
            .unwrap()
            .get(&key)
            .is_some_and(|l| !l.is_empty()));
    }

    /// The server closed an idle connection after `checkout` looked at it
    /// and before the request went out: the request comes back to be sent
    /// on another connection, rather than waiting forever in the queue of
    /// one that has finished.
    #[tokio::test]
    async fn a_request_a_finished_connection_never_took_comes_back() {
        let (client, l, addr) = client_and_listener().await;
        let (close, close_now) = oneshot::channel::<()>();
        let (closed_tx, closed) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            read_post(&mut s).await;
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            let _ = close_now.await;
            drop(s);
            let _ = closed_tx.send(());
        });
        // One exchange, read to its end: the connection is idle in the pool.
        let first = client.request(post(addr)).await.unwrap();
        let body = first.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
        let key = Key(Scheme::HTTP, Authority::try_from(addr.to_string()).unwrap());
        let idle = client.0.idle().lock().unwrap().get_mut(&key).unwrap().pop();
        let idle = idle.expect("pooled");
        // The server closes it; the request is sent without a fresh check.
        close.send(()).unwrap();
        closed.await.unwrap();
        let sent = client.send_h1(idle.h1, &key, post(addr), true);
        match tokio::time::timeout(Duration::from_secs(10), sent).await {
            Ok(Err(Retry::Again(back))) => assert_eq!(back.uri().path(), "/v1/chat/completions"),
            Ok(Err(Retry::Failed(e))) => panic!("failed instead of handed back: {e:?}"),
            Ok(Ok(_)) => panic!("a response from a closed connection"),
            Err(_) => panic!("the request waited in a finished connection's queue"),
        }
    }
}
