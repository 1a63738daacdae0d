//! The WebSocket pass-through: the handshake proxied with its upgrade
//! headers, then the bytes of both directions pumped between the two
//! sockets, with bounded buffers, `--idle-timeout` and graceful shutdown.
//!
//! After `101` the pump forwards what each side sends as it arrives. A
//! [`Watch`] sees every read on its way and decides what goes on; the plain
//! one forwards it untouched, the Responses mode's (`responses.rs`) reads
//! the events and may answer or edit one when a policy acts.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderValue, CONNECTION, UPGRADE};
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::config::Upstream;
use crate::metrics;
use crate::provider::{self, Api};
use crate::tap::{Finish, ObservedBody, Watch as BodyWatch};
use crate::turn::outgoing::build_upstream_request;
use crate::turn::{error_response, shape_provider, Local, ProxyError};
use crate::upstream::Upgrade;
use crate::upstream::{self, UpstreamError};

/// Bytes a direction holds for its writer before it stops reading: a slow
/// reader on one side backs the other side's writer up through TCP rather
/// than growing this.
const QUEUE_LIMIT: usize = 64 * 1024;
/// Room made before each read.
const READ_ROOM: usize = 16 * 1024;

/// Whether a request asks to switch to WebSocket: HTTP/1.1, `Upgrade:
/// websocket`, and `Connection` naming `upgrade` (RFC 6455 §4.1).
pub fn is_websocket(req: &Request<Incoming>) -> bool {
    let h = req.headers();
    req.version() == http::Version::HTTP_11
        && lists(h, &UPGRADE, "websocket")
        && lists(h, &CONNECTION, "upgrade")
}

fn lists(h: &HeaderMap, name: &http::HeaderName, token: &str) -> bool {
    h.get_all(name).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
    })
}

/// A WebSocket handshake, on any path: sent upstream with its upgrade
/// headers on an HTTP/1.1 connection of its own; a `101` comes back as
/// sent and both sockets are then pumped (on the Responses path with the
/// Responses mode's watch); any other answer comes back as an ordinary
/// response; a failure before an answer is a 502/504 in the API's shape.
pub async fn handle(
    state: &Local,
    mut req: Request<Incoming>,
    upstream: &Upstream,
    start: Instant,
) -> Response<ObservedBody> {
    let m = metrics::get();
    let path = req.uri().path();
    let responses = provider::for_path(path).is_some_and(|p| p.api() == Api::OpenAiResponses);
    let api = if responses {
        Api::OpenAiResponses.as_str()
    } else {
        "other"
    };
    let shape = shape_provider(path);
    let on_upgrade = hyper::upgrade::on(&mut req);
    let (parts, _) = req.into_parts();
    let mut headers = parts.headers.clone();
    let upgrade = take_upgrade_headers(&mut headers);
    let empty = http_body_util::Empty::new()
        .map_err(|e| match e {})
        .boxed_unsync();
    let Some(mut up) = build_upstream_request(&parts, headers, upstream, empty, false) else {
        return error_response(&ProxyError::ClientBody, shape, state.config.max_body_bytes);
    };
    upgrade.put_back(up.headers_mut());
    // What the Responses mode reads of the handshake: who is asking.
    let handshake = responses.then(|| super::responses::Handshake::new(&parts));
    let sent = Instant::now();
    m.api(api)
        .proxy_overhead()
        .observe(sent.saturating_duration_since(start).as_secs_f64());
    let deadline = tokio::time::Instant::from_std(sent) + state.config.upstream_timeout;
    let answer = match tokio::time::timeout_at(deadline, state.client.upgrade(up)).await {
        Ok(r) => r,
        Err(_) => Err(UpstreamError::Timeout),
    };
    let series = m.series(api_label(api), None);
    match answer {
        Err(e) => {
            m.upstream_errors
                .with_label_values(&[e.metric_kind()])
                .inc();
            let err = ProxyError::Upstream(e);
            series.count_request(err.status().as_u16());
            error_response(&err, shape, state.config.max_body_bytes)
        }
        Ok(Upgrade::Refused(resp)) => {
            // Refused (400, 401, 426...): the answer as the upstream sent it.
            let code = resp.status().as_u16();
            let (mut rparts, body) = resp.into_parts();
            upstream::strip_hop_by_hop(&mut rparts.headers);
            let mut watch = BodyWatch::new(start);
            watch.on_finish = Some(Box::new(move |_f: Finish| series.count_request(code)));
            let body = ObservedBody::watched(
                body.map_err(Into::into).boxed_unsync(),
                watch,
                state.config.idle_timeout,
            );
            Response::from_parts(rparts, body)
        }
        Ok(Upgrade::Switched { head, io }) => {
            series.count_request(101);
            let mut rheaders = head.headers;
            let upgrade = take_upgrade_headers(&mut rheaders);
            upgrade.put_back(&mut rheaders);
            let ws_api = if responses { api } else { "none" };
            let held = state.sockets().enter(ws_api);
            let idle = state.config.idle_timeout;
            let watch = handshake.and_then(|h| h.watch(state, &rheaders));
            tokio::spawn(async move {
                let _held = held;
                // The client's side once hyper has written the 101.
                let Ok(client) = on_upgrade.await else {
                    return;
                };
                let client = TokioIo::new(client);
                let end = match watch {
                    Some(w) => pump(client, io, w, idle).await,
                    None => pump(client, io, Plain, idle).await,
                };
                if let Err(e) = end {
                    tracing::debug!(error = %e, "websocket ended");
                }
            });
            let mut resp = Response::new(ObservedBody::full(Bytes::new()));
            *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            *resp.headers_mut() = rheaders;
            resp
        }
    }
}

/// The `api` label of a socket's request counts (the five APIs' names, or
/// `other` off them, as HTTP requests are counted).
fn api_label(api: &str) -> &'static str {
    match api {
        "openai-responses" => "openai-responses",
        _ => "other",
    }
}

/// The upgrade headers of a handshake, kept aside while the rest of the
/// hop-by-hop headers are dropped, and put back as they were.
struct UpgradeHeaders {
    connection: Vec<HeaderValue>,
    upgrade: Vec<HeaderValue>,
}

fn take_upgrade_headers(h: &mut HeaderMap) -> UpgradeHeaders {
    let connection = h.get_all(CONNECTION).iter().cloned().collect();
    let upgrade = h.get_all(UPGRADE).iter().cloned().collect();
    upstream::strip_hop_by_hop(h);
    UpgradeHeaders {
        connection,
        upgrade,
    }
}

impl UpgradeHeaders {
    fn put_back(self, h: &mut HeaderMap) {
        for v in self.connection {
            h.append(CONNECTION, v);
        }
        for v in self.upgrade {
            h.append(UPGRADE, v);
        }
    }
}

/// Where the pump's directions put bytes to be written.
#[derive(Default)]
pub struct Out {
    queue: VecDeque<Bytes>,
    queued: usize,
}

impl Out {
    /// Queue bytes for this direction's writer.
    pub fn push(&mut self, b: Bytes) {
        if !b.is_empty() {
            self.queued += b.len();
            self.queue.push_back(b);
        }
    }

    /// Bytes waiting to be written.
    pub fn queued(&self) -> usize {
        self.queued
    }
}

/// What sees the bytes of a socket on their way. Each read of one side is
/// handed over whole; what should reach the other side is pushed to its
/// [`Out`] (the bytes themselves, untouched, unless a policy acts), and
/// anything tidemark itself answers to the client is pushed toward it.
pub trait Watch: Send {
    /// Bytes the client sent.
    fn client_sent(&mut self, data: Bytes, to_server: &mut Out, to_client: &mut Out);
    /// Bytes the server sent.
    fn server_sent(&mut self, data: Bytes, to_client: &mut Out);
    /// Work of the watch's own that came due (a decision on a held
    /// message): what it releases is pushed as above. True if anything was.
    fn poll(&mut self, _cx: &mut Context<'_>, _to_server: &mut Out, _to_client: &mut Out) -> bool {
        false
    }
    /// Stop reading the client while true (a held message is being
    /// decided; what follows it waits in the client's socket).
    fn hold_client(&self) -> bool {
        false
    }
    /// The socket ended (either side closed, an error, the idle timeout).
    fn end(&mut self) {}
}

/// Forward everything untouched.
pub struct Plain;

impl Watch for Plain {
    fn client_sent(&mut self, data: Bytes, to_server: &mut Out, _: &mut Out) {
        to_server.push(data);
    }
    fn server_sent(&mut self, data: Bytes, to_client: &mut Out) {
        to_client.push(data);
    }
}

/// Why a pump ended other than by both sides closing.
#[derive(Debug)]
pub enum PumpEnd {
    Idle,
    Io(std::io::Error),
}

impl std::fmt::Display for PumpEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PumpEnd::Idle => f.write_str("no bytes either way for --idle-timeout"),
            PumpEnd::Io(e) => write!(f, "{e}"),
        }
    }
}

/// One direction: what it read and has to write, and how far it is.
#[derive(Default)]
struct Dir {
    out: Out,
    buf: BytesMut,
    /// Its reader reached the end.
    eof: bool,
    /// The end has been passed on (the writer shut down).
    shut: bool,
}

/// Write what `d` holds to `w`; at the reader's end, once all is written,
/// shut the writer down. `Ready(Ok)` when nothing more can be done now.
fn flush<W: AsyncWrite + Unpin>(
    d: &mut Dir,
    w: &mut W,
    cx: &mut Context<'_>,
    active: &mut bool,
) -> Result<(), std::io::Error> {
    while let Some(front) = d.out.queue.front_mut() {
        match Pin::new(&mut *w).poll_write(cx, front) {
            Poll::Ready(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(n)) => {
                *active = true;
                d.out.queued -= n;
                if n == front.len() {
                    d.out.queue.pop_front();
                } else {
                    let _ = front.split_to(n);
                }
            }
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => return Ok(()),
        }
    }
    if d.eof && !d.shut {
        match Pin::new(&mut *w).poll_shutdown(cx) {
            Poll::Ready(_) => d.shut = true,
            Poll::Pending => return Ok(()),
        }
    }
    let _ = Pin::new(&mut *w).poll_flush(cx);
    Ok(())
}

/// What one read attempt of a direction came to.
enum Filled {
    Data(Bytes),
    /// The reader reached its end just now.
    Ended,
    /// Nothing: the queue is full, the reader ended before, or no bytes yet.
    Nothing,
}

/// Read from `r` while `d`'s queue is under the limit.
fn fill<R: AsyncRead + Unpin>(
    d: &mut Dir,
    r: &mut R,
    cx: &mut Context<'_>,
    active: &mut bool,
) -> Result<Filled, std::io::Error> {
    if d.eof || d.out.queued >= QUEUE_LIMIT {
        return Ok(Filled::Nothing);
    }
    if d.buf.capacity() - d.buf.len() < READ_ROOM / 4 {
        d.buf.reserve(READ_ROOM);
    }
    match tokio_util::io::poll_read_buf(Pin::new(r), cx, &mut d.buf) {
        Poll::Ready(Ok(0)) => {
            d.eof = true;
            Ok(Filled::Ended)
        }
        Poll::Ready(Ok(_)) => {
            *active = true;
            Ok(Filled::Data(d.buf.split().freeze()))
        }
        Poll::Ready(Err(e)) => Err(e),
        Poll::Pending => Ok(Filled::Nothing),
    }
}

/// Pump bytes between the client's socket and the upstream's until both
/// have closed, one fails, or neither has sent or taken a byte for `idle`.
/// Each direction holds at most about [`QUEUE_LIMIT`] bytes for its writer
/// (plus one read) and stops reading while it does.
pub async fn pump<C, S, W>(
    mut client: C,
    mut server: S,
    mut watch: W,
    idle: Duration,
) -> Result<(), PumpEnd>
where
    C: AsyncRead + AsyncWrite + Unpin,
    S: AsyncRead + AsyncWrite + Unpin,
    W: Watch,
{
    let mut up = Dir::default();
    let mut down = Dir::default();
    let mut timer = Box::pin(tokio::time::sleep(idle));
    let result = poll_fn(|cx| {
        let mut active = false;
        let step = (|| -> Result<bool, std::io::Error> {
            loop {
                flush(&mut up, &mut server, cx, &mut active)?;
                flush(&mut down, &mut client, cx, &mut active)?;
                let mut progressed = watch.poll(cx, &mut up.out, &mut down.out);
                let client_filled = match watch.hold_client() {
                    true => Filled::Nothing,
                    false => fill(&mut up, &mut client, cx, &mut active)?,
                };
                match client_filled {
                    Filled::Data(b) => {
                        watch.client_sent(b, &mut up.out, &mut down.out);
                        progressed = true;
                    }
                    Filled::Ended => progressed = true,
                    Filled::Nothing => {}
                }
                match fill(&mut down, &mut server, cx, &mut active)? {
                    Filled::Data(b) => {
                        watch.server_sent(b, &mut down.out);
                        progressed = true;
                    }
                    Filled::Ended => progressed = true,
                    Filled::Nothing => {}
                }
                if up.shut && down.shut {
                    return Ok(true);
                }
                if !progressed {
                    return Ok(false);
                }
            }
        })();
        match step {
            Err(e) => return Poll::Ready(Err(PumpEnd::Io(e))),
            Ok(true) => return Poll::Ready(Ok(())),
            Ok(false) => {}
        }
        if active {
            timer.as_mut().reset(tokio::time::Instant::now() + idle);
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(PumpEnd::Idle)),
            Poll::Pending => Poll::Pending,
        }
    })
    .await;
    watch.end();
    result
}
