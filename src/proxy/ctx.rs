//! The per-request context: what the phases of one request on a
//! recognised API learn and hand on, from its route to its tap.
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Instant;

use bytes::Bytes;
use http::Response;

use crate::config::Upstream;
use crate::otel;
use crate::provider::Provider;
use crate::tap::ObservedBody;
use crate::turn::{Local, ProxyError};
use crate::upstream::{UpstreamBody, UpstreamError};

/// What the upstream answered, or why it could not.
pub(super) type Answer = Result<Response<UpstreamBody>, UpstreamError>;

/// One request on a recognised API.
pub(super) struct Ctx<'a> {
    // route
    pub state: &'a Local,
    pub p: &'static dyn Provider,
    pub upstream: &'a Upstream,
    /// The request's head; its headers go upstream with it.
    pub parts: http::request::Parts,
    /// When the request came in: tidemark's own answers are timed from here.
    pub start: Instant,
    /// Its OpenTelemetry span, when export is on (the turn's once projected).
    pub span: Option<Box<otel::Open>>,
    // read
    /// The body as it came: what is forwarded unless tidemark edits it.
    pub body: Bytes,
    // identify
    pub stream: bool,
    /// The model as the request names it (a learned window is its).
    pub model: Option<String>,
    /// It continues a response (`previous_response_id`): it carries only
    /// its new input.
    pub chained: bool,
    /// The request's place in its session's order, when it was taken on
    /// arrival (forward-first).
    pub order: Option<u64>,
    /// Where a trim keeps the session's cut (`--on-over trim` only).
    pub cut_key: Option<String>,
    // send
    /// Sent before it was projected (forward-first), and still in flight.
    pub in_flight: Option<InFlight<'a>>,
    /// The body to send when tidemark edited it (usage injection, trim).
    pub edited: Option<Bytes>,
    pub injected: bool,
    // decide
    /// The `x-context-trimmed` value when the request was trimmed.
    pub trimmed: Option<String>,
    /// The trimmed body before usage injection (what a retry without the option sends).
    pub trimmed_body: Option<Bytes>,
    /// A hash of the trim's cut (0: untrimmed).
    pub cut: u64,
}

impl<'a> Ctx<'a> {
    pub fn new(
        state: &'a Local,
        p: &'static dyn Provider,
        upstream: &'a Upstream,
        parts: http::request::Parts,
        start: Instant,
    ) -> Ctx<'a> {
        let span = otel::start(state.otel.as_ref(), &parts.headers, p.api(), Some(start));
        Ctx {
            state,
            p,
            upstream,
            parts,
            start,
            span,
            body: Bytes::new(),
            stream: false,
            model: None,
            chained: false,
            order: None,
            cut_key: None,
            in_flight: None,
            edited: None,
            injected: false,
            trimmed: None,
            trimmed_body: None,
            cut: 0,
        }
    }

    /// An error before the request is projected: no session hears of it.
    pub fn refuse(&self, err: ProxyError) -> Response<ObservedBody> {
        let api = self.p.api().as_str();
        super::respond::refused(self.state, self.p, api, err, self.start)
    }
}

/// A request sent before it was projected: its send, polled once to put
/// it on the wire (or start the connect), and the body it went with.
pub(super) struct InFlight<'a> {
    pub sending: Pin<Box<dyn Future<Output = Answer> + Send + 'a>>,
    /// Its answer, once a poll had one (it is not polled after).
    pub first: Poll<Answer>,
    pub edited: Option<Bytes>,
    pub injected: bool,
}

impl InFlight<'_> {
    /// The upstream's answer.
    pub async fn land(self) -> Answer {
        match self.first {
            Poll::Ready(r) => r,
            Poll::Pending => self.sending.await,
        }
    }
}

/// Forward-first, the one combinator: await `f` while the request already
/// sent (if any) is driven too — its connect, the rest of a long body —
/// or it would wait for `f`.
pub(super) async fn meanwhile<T>(
    in_flight: &mut Option<InFlight<'_>>,
    f: impl Future<Output = T>,
) -> T {
    let Some(s) = in_flight.as_mut() else {
        return f.await;
    };
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(|cx| {
        // `f` first: one that is ready at once (a memory store's begin)
        // costs the request in flight no extra poll.
        if let Poll::Ready(t) = f.as_mut().poll(cx) {
            return Poll::Ready(t);
        }
        if s.first.is_pending() {
            s.first = s.sending.as_mut().poll(cx);
        }
        Poll::Pending
    })
    .await
}
