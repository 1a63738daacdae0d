//! The spine: one function runs a request's phases in order — route, inspect,
//! session, policy, upstream, tap, record — and one function maps every error
//! tidemark produces to a response in the API's own shape. The phases a
//! WebSocket turn shares with it are functions of their own: `identify`,
//! `estimate`, `project`, `decide`, `record`.

use std::convert::Infallible;
use std::future::Future;
use std::io::Read;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use bytes::Bytes;
use dashmap::{DashMap, DashSet};
use http::header::{
    HeaderMap, HeaderName, HeaderValue, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE,
};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;

use crate::config::{Config, OnOver, Upstream};
use crate::estimate::{Estimate, Estimator};
use crate::inspect::RequestView;
use crate::metrics;
use crate::otel;
use crate::provider::{self, Api, ErrorShape, Provider};
use crate::session::cache::Prefix;
use crate::session::identity::{self, asking, credential_hash, ContentOnce};
use crate::session::{
    decimal, Begun, KeySource, Outcome, Projection, RequestFacts, Ruler, SessionConfig, Store,
};
use crate::tap::usage::UsageReader;
use crate::tap::{Finish, ObservedBody, Watch};
use crate::trim::{self, Cut};
use crate::upstream::{self, Client, UpBody, UpstreamBody, UpstreamError};

/// Everything a request needs that outlives it.
pub struct State {
    pub config: Config,
    pub client: Client,
    pub estimator: Estimator,
    /// Sessions: this process's memory, or Redis shared with other replicas.
    pub store: Store,
    /// Upstreams (authorities) that answered 400 to `stream_options`: never inject there again.
    pub no_stream_options: DashSet<String>,
    /// Each trimmed session's last cut, so the next request is cut at the
    /// same place and provider prompt caches survive. Keyed by credential and
    /// session key; bounded by `--max-sessions`.
    pub cuts: DashMap<String, Cut>,
    /// OpenTelemetry export (`--otlp-endpoint`); `None`: off.
    pub otel: Option<crate::otel::Exporter>,
}

/// One worker thread's handle on the shared [`State`], cloned for each
/// request (by the service, and by the callback that records the response)
/// instead of the shared `Arc`: that `Arc`'s count is one cache line that
/// every worker's clones and drops would pull from core to core, twice per
/// request each. This handle's count is written by its own worker only.
#[derive(Clone)]
pub struct Local(Arc<Worker>);

/// What one worker thread holds: its handle on the shared state, and its
/// open WebSockets (which a graceful shutdown waits for).
struct Worker {
    state: Arc<State>,
    sockets: crate::ws::tunnel::Open,
}

impl Local {
    pub fn new(state: Arc<State>) -> Local {
        Local(Arc::new(Worker {
            state,
            sockets: Default::default(),
        }))
    }

    /// This worker's open WebSockets.
    pub fn sockets(&self) -> &crate::ws::tunnel::Open {
        &self.0.sockets
    }
}

impl std::ops::Deref for Local {
    type Target = State;
    fn deref(&self) -> &State {
        &self.0.state
    }
}

/// Per-message token cache budget for the estimator.
pub const ESTIMATE_CACHE_BYTES: usize = 64 << 20;

impl State {
    pub fn new(config: Config) -> Result<State, String> {
        let client = upstream::client(&config)?;
        let store = Store::new(
            SessionConfig {
                ttl: config.session_ttl,
                max_sessions: config.max_sessions,
            },
            &config.state,
        )?;
        // Its own client: the same TLS settings, a pool of its own.
        let otel = match config.otlp.clone() {
            Some(o) => Some(crate::otel::Exporter::start(o, upstream::client(&config)?)),
            None => None,
        };
        Ok(State {
            otel,
            client,
            estimator: Estimator::new(ESTIMATE_CACHE_BYTES),
            store,
            no_stream_options: DashSet::new(),
            cuts: DashMap::new(),
            config,
        })
    }
}

/// Errors tidemark itself answers, by the side they came from.
#[derive(Debug)]
pub enum ProxyError {
    /// The client's body is over `--max-body-bytes`.
    BodyTooLarge,
    /// The client's body could not be read (client gone or broken framing).
    ClientBody,
    /// The client stopped sending its body (silent past `--header-read-timeout`).
    ClientTimeout,
    /// The upstream could not be reached or failed before answering.
    Upstream(UpstreamError),
    /// The projection is over the line and the policy is reject (or a trim could not shrink enough).
    ContextBudget { projected: u64, window: u64 },
    /// The session spent its `--session-budget`.
    SessionBudget { spent: u64, budget: u64 },
}

impl ProxyError {
    pub(crate) fn status(&self) -> StatusCode {
        match self {
            ProxyError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ClientBody => StatusCode::BAD_REQUEST,
            ProxyError::ClientTimeout => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Upstream(UpstreamError::Timeout) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ProxyError::ContextBudget { .. } | ProxyError::SessionBudget { .. } => {
                StatusCode::BAD_REQUEST
            }
        }
    }
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            ProxyError::BodyTooLarge => "body-too-large",
            ProxyError::ClientBody => "client-body",
            ProxyError::ClientTimeout => "client-timeout",
            ProxyError::Upstream(u) => u.header_kind(),
            ProxyError::ContextBudget { .. } => "context-budget",
            ProxyError::SessionBudget { .. } => "session-budget",
        }
    }
    pub(crate) fn message(&self, max_body: usize) -> String {
        match self {
            ProxyError::BodyTooLarge => {
                format!("request body exceeds the proxy's limit of {max_body} bytes")
            }
            ProxyError::ClientBody => "the request body could not be read".to_string(),
            ProxyError::ClientTimeout => "the client stopped sending the request body".to_string(),
            ProxyError::Upstream(UpstreamError::Connect) => {
                "tidemark could not connect to the upstream".to_string()
            }
            ProxyError::Upstream(UpstreamError::Tls) => {
                "TLS handshake with the upstream failed".to_string()
            }
            ProxyError::Upstream(UpstreamError::Reset) => {
                "the upstream closed the connection before answering".to_string()
            }
            ProxyError::Upstream(UpstreamError::Timeout) => {
                "the upstream did not answer in time".to_string()
            }
            ProxyError::ContextBudget { projected, window } => {
                format!("projected prompt of {projected} tokens is over the budget for a {window}-token window")
            }
            ProxyError::SessionBudget { spent, budget } => {
                format!("session_budget_exceeded: this session spent {spent} tokens of its {budget}-token budget")
            }
        }
    }
}

/// The provider whose error shape fits a path: its own API, else a guess from
/// the path, else OpenAI's (the default upstream).
pub(crate) fn shape_provider(path: &str) -> &'static dyn Provider {
    if let Some(p) = provider::for_path(path) {
        return p;
    }
    if path.contains("/messages") {
        Api::Anthropic.provider()
    } else if path.contains("/api/") {
        Api::Ollama.provider()
    } else if path.contains(":") && path.contains("/models/") {
        Api::Gemini.provider()
    } else {
        Api::OpenAiChat.provider()
    }
}

/// Map an error to its response: status, body in the API's shape, `x-tidemark-error`.
pub fn error_response(
    err: &ProxyError,
    p: &dyn Provider,
    max_body: usize,
) -> Response<ObservedBody> {
    let shape = match err {
        ProxyError::ContextBudget { projected, window } => ErrorShape::ContextLength {
            projected: *projected,
            window: *window,
        },
        ProxyError::SessionBudget { spent, budget } => ErrorShape::SessionBudget {
            spent: *spent,
            budget: *budget,
        },
        other => ErrorShape::Generic {
            status: other.status().as_u16(),
        },
    };
    let body = p.error_body(shape, err.kind(), &err.message(max_body));
    let mut resp = Response::new(ObservedBody::full(body));
    *resp.status_mut() = err.status();
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(X_TIDEMARK_ERROR, HeaderValue::from_static(err.kind()));
    if matches!(
        err,
        ProxyError::ContextBudget { .. } | ProxyError::SessionBudget { .. }
    ) {
        h.insert(X_SHOULD_RETRY, HeaderValue::from_static("false"));
    }
    resp
}

/// A response tidemark answers itself, before or instead of an upstream's:
/// counted in `tidemark_requests_total` and timed from `start` in the
/// duration histogram, as every request is (SPEC §7).
fn answered(api: &str, model: &str, status: StatusCode, start: Instant) {
    let m = metrics::get();
    m.requests
        .with_label_values(&[api, model, status.as_str()])
        .inc();
    m.api(api)
        .request_duration()
        .observe(start.elapsed().as_secs_f64());
}

pub const X_CONTEXT_PROJECTION: HeaderName = HeaderName::from_static("x-context-projection");
pub const X_CONTEXT_WARNING: HeaderName = HeaderName::from_static("x-context-warning");
pub const X_CONTEXT_TRIMMED: HeaderName = HeaderName::from_static("x-context-trimmed");
pub const X_CONTEXT_RESET: HeaderName = HeaderName::from_static("x-context-reset");
pub const X_TIDEMARK_ERROR: HeaderName = HeaderName::from_static("x-tidemark-error");
pub const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");

/// What the inspect phase learned about a request on a recognised API.
struct Inspected {
    /// This (api, model)'s metric series; `series.model` is the model label.
    series: &'static metrics::Series,
    stream: bool,
    estimate: Estimate,
    begun: Begun,
    max_output: Option<u64>,
    /// The body to send when tidemark edited it (usage injection, trim).
    edited: Option<Bytes>,
    injected: bool,
    /// The `x-context-trimmed` value when the request was trimmed.
    trimmed: Option<String>,
    /// The trimmed body before usage injection (what a retry without the option sends).
    trimmed_body: Option<Bytes>,
    /// A hash of the trim's cut (0: untrimmed): a cut that moves is a
    /// prompt-cache bust of its own cause.
    cut: u64,
    /// The model as the request names it (a learned window is its).
    model: Option<String>,
    /// When the request came in: tidemark's own answers are timed from here.
    start: Instant,
    /// Its OpenTelemetry span, when export is on.
    span: Option<Box<otel::Open>>,
}

/// The spine. Every request passes here, top to bottom.
pub async fn handle(
    state: Local,
    req: Request<Incoming>,
) -> Result<Response<ObservedBody>, Infallible> {
    let start = Instant::now();
    // route: which upstream, and is this an API tidemark understands?
    let path = req.uri().path();
    let upstream = state.config.upstream_for(path);
    if req.method() == http::Method::GET && crate::ws::tunnel::is_websocket(&req) {
        return Ok(crate::ws::tunnel::handle(&state, req, upstream, start).await);
    }
    let api = if req.method() == http::Method::POST {
        provider::for_path(path)
    } else {
        None
    };
    let Some(p) = api else {
        return Ok(passthrough(&state, req, upstream, start).await);
    };
    Ok(api_request(&state, req, p, upstream, start).await)
}

/// A request tidemark does not read: its body streams through.
async fn passthrough(
    state: &State,
    req: Request<Incoming>,
    upstream: &Upstream,
    start: Instant,
) -> Response<ObservedBody> {
    let (mut parts, body) = req.into_parts();
    let shape = shape_provider(parts.uri.path());
    let body: UpBody = body.boxed_unsync();
    let headers = std::mem::take(&mut parts.headers);
    let m = metrics::get();
    let up = match build_upstream_request(&parts, headers, upstream, body, false) {
        Some(r) => r,
        None => {
            let err = ProxyError::ClientBody;
            answered("other", &m.model_label(None), err.status(), start);
            return error_response(&err, shape, state.config.max_body_bytes);
        }
    };
    let sent = Instant::now();
    m.api("other")
        .proxy_overhead()
        .observe(sent.saturating_duration_since(start).as_secs_f64());
    match send(state, up, sent).await {
        Ok(resp) => {
            let code = resp.status().as_u16();
            let (mut parts, body) = resp.into_parts();
            upstream::strip_hop_by_hop(&mut parts.headers);
            let mut watch = Watch::new(start);
            let series = m.series("other", None);
            watch.on_finish = Some(Box::new(move |_f: Finish| series.count_request(code)));
            let body = ObservedBody::watched(
                body.map_err(Into::into).boxed_unsync(),
                watch,
                state.config.idle_timeout,
            );
            Response::from_parts(parts, body)
        }
        Err(e) => {
            m.upstream_errors
                .with_label_values(&[e.metric_kind()])
                .inc();
            let err = ProxyError::Upstream(e);
            answered("other", &m.model_label(None), err.status(), start);
            error_response(&err, shape, state.config.max_body_bytes)
        }
    }
}

/// Read a request body whole: at most `--max-body-bytes`, no silence longer
/// than `--header-read-timeout` between frames (a client trickling its body
/// cannot hold a connection forever), and all of it within `--upstream-timeout`.
async fn read_body(body: Incoming, cfg: &Config) -> Result<Bytes, ProxyError> {
    // Room for a declared Content-Length up front (no regrowing copies of a
    // long history); a body that comes in one frame is kept, not copied.
    let declared = http_body::Body::size_hint(&body)
        .lower()
        .min(cfg.max_body_bytes as u64) as usize;
    let mut body = Limited::new(body, cfg.max_body_bytes);
    let mut first: Option<Bytes> = None;
    let mut buf = bytes::BytesMut::new();
    // Set at the first wait (frames ready until then took no time to speak of).
    let mut deadline = None;
    loop {
        // A frame already here (a small body comes with its headers) is
        // taken without reading the clock or making a timer.
        let mut next = body.frame();
        let ready = std::future::poll_fn(|cx| match Pin::new(&mut next).poll(cx) {
            Poll::Ready(f) => Poll::Ready(Some(f)),
            Poll::Pending => Poll::Ready(None),
        })
        .await;
        let waited = match ready {
            Some(f) => Ok(f),
            None => {
                let now = tokio::time::Instant::now();
                let deadline = *deadline.get_or_insert(now + cfg.upstream_timeout);
                let silence = now + cfg.header_read_timeout;
                tokio::time::timeout_at(silence.min(deadline), next).await
            }
        };
        let frame = match waited {
            Err(_) => return Err(ProxyError::ClientTimeout),
            // `first` is held only while it is the sole frame.
            Ok(None) => return Ok(first.unwrap_or_else(|| buf.freeze())),
            Ok(Some(Err(e))) => {
                return Err(
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some()
                    {
                        ProxyError::BodyTooLarge
                    } else {
                        ProxyError::ClientBody
                    },
                )
            }
            Ok(Some(Ok(f))) => f,
        };
        if let Ok(d) = frame.into_data() {
            if d.is_empty() {
                continue;
            }
            if buf.is_empty() && first.is_none() {
                first = Some(d);
                continue;
            }
            if let Some(f) = first.take() {
                buf.reserve(declared.max(f.len() + d.len()));
                buf.extend_from_slice(&f);
            }
            buf.extend_from_slice(&d);
        }
    }
}

/// Send upstream, bounded by `--upstream-timeout` from `sent` (now, as the
/// caller last read the clock) to the response headers.
async fn send(
    state: &State,
    req: Request<UpBody>,
    sent: Instant,
) -> Result<Response<UpstreamBody>, UpstreamError> {
    let deadline = tokio::time::Instant::from_std(sent) + state.config.upstream_timeout;
    match tokio::time::timeout_at(deadline, state.client.request(req)).await {
        Ok(r) => r,
        Err(_) => Err(UpstreamError::Timeout),
    }
}

/// The upstream request: same method, path under the upstream's prefix, query
/// kept, headers minus hop-by-hop and `Host` (the client sets the upstream's).
pub(crate) fn build_upstream_request(
    parts: &http::request::Parts,
    mut headers: HeaderMap,
    upstream: &Upstream,
    body: UpBody,
    edited: bool,
) -> Option<Request<UpBody>> {
    let pq = match parts.uri.path_and_query() {
        // No prefix: the client's own (shared, already validated) bytes.
        Some(pq) if upstream.prefix.is_empty() => pq.clone(),
        pq => format!("{}{}", upstream.prefix, pq.map_or("/", |pq| pq.as_str()))
            .parse()
            .ok()?,
    };
    let uri = http::Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(pq)
        .build()
        .ok()?;
    upstream::strip_hop_by_hop(&mut headers);
    // The upstream's own `Host` (an HTTP/2 upstream gets `:authority`).
    headers.insert(http::header::HOST, upstream.host.clone());
    headers.remove(X_CONTEXT_RESET);
    if edited {
        // The body changed length; the client sets it from the new body.
        headers.remove(CONTENT_LENGTH);
        headers.remove(CONTENT_ENCODING);
    }
    let mut req = Request::new(body);
    *req.method_mut() = parts.method.clone();
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    Some(req)
}

fn full(b: Bytes) -> UpBody {
    Full::new(b).map_err(|e| match e {}).boxed_unsync()
}

/// Decode a compressed request body for inspection only (it is forwarded as it came).
fn decode_request(encoding: Option<&str>, body: &Bytes, cap: usize) -> Option<Bytes> {
    let enc = match encoding.map(|e| e.trim().to_ascii_lowercase()) {
        None => return Some(body.clone()),
        Some(e) if e.is_empty() || e == "identity" => return Some(body.clone()),
        Some(e) => e,
    };
    let mut out = Vec::new();
    let limit = cap as u64 + 1;
    let ok = match enc.as_str() {
        "gzip" | "x-gzip" => flate2::read::MultiGzDecoder::new(&body[..])
            .take(limit)
            .read_to_end(&mut out)
            .is_ok(),
        "deflate" => flate2::read::ZlibDecoder::new(&body[..])
            .take(limit)
            .read_to_end(&mut out)
            .is_ok(),
        "br" => brotli_decompressor::Decompressor::new(&body[..], 4096)
            .take(limit)
            .read_to_end(&mut out)
            .is_ok(),
        "zstd" => match zstd::stream::read::Decoder::new(&body[..]) {
            Ok(d) => d.take(limit).read_to_end(&mut out).is_ok(),
            Err(_) => false,
        },
        _ => false,
    };
    (ok && out.len() <= cap).then(|| Bytes::from(out))
}

/// RFC 8941 dictionary for `x-context-warning`.
fn warning_value(util: f64, at: f64) -> String {
    format!("util={}, at={}", decimal(util), decimal(at))
}

/// The projection headers plus `x-context-trimmed` when the request was trimmed.
fn add_policy_headers(h: &mut HeaderMap, ins: &Inspected, warn_at: f64) {
    // Room for the projection, warning and trimmed headers in one step.
    h.reserve(3);
    add_projection_headers(h, &ins.begun.projection, warn_at);
    if ins.begun.local_state {
        mark_local_state(h);
    }
    if let Some(t) = ins
        .trimmed
        .as_deref()
        .and_then(|t| HeaderValue::from_str(t).ok())
    {
        h.insert(X_CONTEXT_TRIMMED, t);
    }
}

fn add_projection_headers(h: &mut HeaderMap, proj: &Projection, warn_at: f64) {
    // The header's text becomes its value without another copy.
    if let Ok(v) = HeaderValue::from_maybe_shared(Bytes::from(proj.header_value())) {
        h.insert(X_CONTEXT_PROJECTION, v);
    }
    if let Some(u) = proj.util() {
        if u >= warn_at {
            if let Ok(v) = HeaderValue::from_str(&warning_value(u, warn_at)) {
                h.insert(X_CONTEXT_WARNING, v);
            }
        }
    }
}

/// A request on a recognised API.
async fn api_request(
    state: &Local,
    req: Request<Incoming>,
    p: &'static dyn Provider,
    upstream: &Upstream,
    start: Instant,
) -> Response<ObservedBody> {
    let m = metrics::get();
    let api = p.api();
    let cfg = &state.config;
    let (mut parts, body) = req.into_parts();
    let span = otel::start(state.otel.as_ref(), &parts.headers, api, Some(start));

    // inspect: read the body whole, capped.
    let too_large = parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > cfg.max_body_bytes as u64);
    if too_large {
        m.limits_hit.with_label_values(&["body"]).inc();
        let err = ProxyError::BodyTooLarge;
        answered(api.as_str(), &m.model_label(None), err.status(), start);
        return error_response(&err, p, cfg.max_body_bytes);
    }
    let body = match read_body(body, cfg).await {
        Ok(b) => b,
        Err(err) => {
            match err {
                ProxyError::BodyTooLarge => m.limits_hit.with_label_values(&["body"]).inc(),
                ProxyError::ClientTimeout => {
                    m.limits_hit.with_label_values(&["body_timeout"]).inc()
                }
                _ => {}
            }
            answered(api.as_str(), &m.model_label(None), err.status(), start);
            return error_response(&err, p, cfg.max_body_bytes);
        }
    };
    // Owned (rarely there): the request's headers may go upstream before
    // it is used again.
    let encoding = parts
        .headers
        .get(CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let encoding = encoding.as_deref();
    let decoded = decode_request(encoding, &body, cfg.max_body_bytes.saturating_mul(8));
    let view = decoded.as_deref().and_then(RequestView::parse);
    let Some(view) = view else {
        // Not JSON we can read: forward untouched, no projection.
        return Box::pin(forward_unread(state, parts, body, upstream, p, start)).await;
    };

    // Every upstream request made from here on (the request, a retry, a
    // count) names tidemark's span as its parent.
    otel::inject(&span, &mut parts.headers);
    let path = parts.uri.path();
    let query = parts.uri.query();
    let stream = p.is_stream(path, query, &view);

    // forward first: when nothing below can stop or change the request
    // (no --on-over reject or trim, no --session-budget, no
    // --exact-cold-start), it goes upstream now and the estimate and the
    // session are worked out while the upstream thinks, off the time to
    // first byte. The first poll puts it on the wire (a pooled connection)
    // or starts the connect.
    let forward_first =
        cfg.on_over == OnOver::Pass && cfg.session_budget.is_none() && !cfg.exact_cold_start;
    // Who is asking: cheap (a hash of the credential, and of the messages up
    // to the first user message), so it comes before the request leaves.
    let model = p.model(path, &view);
    let Identity {
        credential,
        key,
        source,
        reset,
        mut content,
    } = identify(cfg, &parts.headers, query, p, &view);
    let continues = p.continues(&view);
    let chained = continues.is_some();
    // Forwarded before it is projected, the request takes its place in the
    // session's order now, so two in flight keep the order they came in.
    // (With --state redis the order is Redis's, taken when it is asked.)
    let order = match forward_first {
        true => state.store.reserve(
            key.as_deref(),
            source,
            &credential,
            api,
            continues.as_deref(),
        ),
        false => None,
    };
    let mut early = None;
    // The body as JSON: the client's, or its decoding when it came compressed.
    let plain = decoded.as_ref().unwrap_or(&body);
    if forward_first {
        let edited = usage_injection(state, api, stream, upstream, plain, &view, None);
        let injected = edited.is_some();
        let headers = headers_to_send(&mut parts.headers, injected);
        if let Some(up) = outgoing(&parts, headers, upstream, &body, edited.as_ref(), injected) {
            let sent = counted_sent(api, start, injected);
            let mut sending = Box::pin(send(state, up, sent));
            let first = std::future::poll_fn(|cx| Poll::Ready(sending.as_mut().poll(cx))).await;
            early = Some((sending, first, edited, injected));
        }
    }

    let series = m.series(api.as_str(), model.as_deref());
    // A worker thread serves many connections: a cold long history (8 ms
    // for 400 KB, 43 ms for 2 MB on the README's 2-core box) is estimated
    // on the blocking pool, so the others' streams do not wait behind it.
    let estimate = match estimate(state, p, &view, decoded.clone(), model.as_deref()) {
        Estimating::Done(e) => e,
        Estimating::Elsewhere(elsewhere) => {
            let e = match early.as_mut() {
                Some((sending, first, _, _)) => alongside(elsewhere, sending, first).await,
                None => elsewhere.await,
            };
            e.unwrap_or_else(|| state.estimator.estimate(p, &view, model.as_deref()))
        }
    };
    let (window, window_upstream) = window_of(state, upstream, model.as_deref());
    // Only a trim reads or remembers cuts.
    let cut_key = match cfg.on_over {
        OnOver::Trim => key.as_ref().map(|k| format!("{credential}\u{0}{k}")),
        _ => None,
    };
    let facts = RequestFacts {
        key,
        source,
        credential,
        api,
        model: model.clone(),
        estimate: estimate.tokens,
        classes: estimate.classes,
        reset,
        window,
        window_upstream,
        counted: None,
        continues,
        content: content.get(p, &view).unwrap_or_default(),
        stream: None,
    };
    // Memory: ready at once. --state redis: one round trip for the
    // session's record, order, totals and the model's calibration; a
    // request already sent is driven meanwhile (its connect, the rest of a
    // long body), or it would wait for this lookup.
    let begin = state.store.begin(facts, order);
    let mut begun = match early.as_mut() {
        Some((sending, first, _, _)) => alongside(begin, sending, first).await,
        None => begin.await,
    };
    observe_projection(series, &begun);
    // --exact-cold-start: no anchor, so ask the provider's own counter.
    if cfg.exact_cold_start && begun.anchorless() {
        if let Some((cpath, cbody)) = p.count_request(path, &view) {
            let counting = Box::pin(count_exact(state, &parts, upstream, p, &cpath, cbody));
            if let Some(n) = counting.await {
                state.store.apply_count(&mut begun, n);
            }
        }
    }
    let max_output = p.max_output_tokens(&view);
    let mut ins = Inspected {
        series,
        stream,
        estimate,
        begun,
        max_output,
        edited: None,
        injected: false,
        trimmed: None,
        trimmed_body: None,
        cut: 0,
        model,
        start,
        span,
    };

    // policy: session budget, then the context budget.
    match decide(cfg, &ins.begun, ins.max_output) {
        Verdict::Pass => {}
        Verdict::SessionBudget(err) => return reject(state, p, ins, &err),
        Verdict::Over {
            projected,
            window: w,
            limit,
            reserve,
        } => {
            let over_budget = |action: OnOver| {
                m.over_budget
                    .with_label_values(&[api.as_str(), &ins.series.model, action.as_str()])
                    .inc()
            };
            let over = ProxyError::ContextBudget {
                projected,
                window: w,
            };
            match cfg.on_over {
                OnOver::Pass => over_budget(OnOver::Pass),
                OnOver::Reject => {
                    over_budget(OnOver::Reject);
                    return reject(state, p, ins, &over);
                }
                OnOver::Trim => {
                    let trimmed = decoded.as_ref().and_then(|src| {
                        trim_request(
                            state,
                            api,
                            src,
                            ins.model.as_deref(),
                            cut_key.as_deref(),
                            ins.begun.ruler,
                            reserve,
                            w,
                        )
                    });
                    // Re-projected with the same anchored ruler; a trim that
                    // did not shrink below the line is never forwarded, and
                    // the client hears about the request it sent.
                    let Some((t, est)) = trimmed.filter(|(_, est)| {
                        (ins.begun.ruler.measure_estimate(est) + reserve) as f64 <= limit
                    }) else {
                        over_budget(OnOver::Reject);
                        return reject(state, p, ins, &over);
                    };
                    over_budget(OnOver::Trim);
                    state.store.reproject(&mut ins.begun, est);
                    let after = ins.begun.projection.tokens + reserve;
                    ins.cut = cut_hash(&t.cut);
                    // Only a cut that was forwarded is remembered.
                    if let Some(k) = cut_key {
                        remember_cut(state, k, t.cut.clone());
                    }
                    m.trimmed_tokens
                        .with_label_values(&[api.as_str(), &ins.series.model])
                        .inc_by(projected.saturating_sub(after));
                    ins.trimmed = Some(format!(
                        "before={projected}, after={after}, turns={}, tool-results={}",
                        t.turns, t.tool_results
                    ));
                    let b = Bytes::from(t.body);
                    ins.trimmed_body = Some(b.clone());
                    ins.edited = Some(b);
                }
            }
        }
    }

    // What is sent, as the provider's prompt cache will see it: compared
    // with the lane's previous request when the response comes back. A
    // chained request (`previous_response_id`) carries only its new input.
    if ins.begun.ticket.session().is_some() && !chained {
        let sent = match &ins.trimmed_body {
            Some(b) => RequestView::parse(b),
            None => None,
        };
        let sent = sent.as_ref().unwrap_or(&view);
        let prefix = Prefix::of(p, sent, &state.estimator, ins.model.as_deref(), ins.cut);
        ins.begun.ticket.set_prefix(prefix);
    }

    let mut result = match early {
        Some((sending, first, edited, injected)) => {
            ins.edited = edited;
            ins.injected = injected;
            match first {
                Poll::Ready(r) => r,
                Poll::Pending => sending.await,
            }
        }
        None => {
            if let Some(b) = usage_injection(
                state,
                api,
                stream,
                upstream,
                plain,
                &view,
                ins.edited.as_ref(),
            ) {
                ins.edited = Some(b);
                ins.injected = true;
            }
            let headers = headers_to_send(&mut parts.headers, ins.injected);
            let edited = ins.edited.as_ref();
            let Some(up) = outgoing(&parts, headers, upstream, &body, edited, ins.injected) else {
                return reject(state, p, ins, &ProxyError::ClientBody);
            };
            let sent = counted_sent(api, start, ins.injected);
            send(state, up, sent).await
        }
    };

    // An upstream that refuses stream_options gets the request again without it, once.
    if ins.injected {
        if let Ok(resp) = result {
            if resp.status() == StatusCode::BAD_REQUEST {
                let (rparts, rbody) = resp.into_parts();
                let bytes = Limited::new(rbody, 1 << 20)
                    .collect()
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                if crate::tap::inject::mentions_stream_options(&bytes) {
                    state
                        .no_stream_options
                        .insert(upstream.authority.as_str().to_string());
                    ins.injected = false;
                    ins.edited = ins.trimmed_body.clone();
                    let retry = ins.edited.clone().unwrap_or_else(|| body.clone());
                    let headers = std::mem::take(&mut parts.headers);
                    match build_upstream_request(
                        &parts,
                        headers,
                        upstream,
                        full(retry),
                        ins.edited.is_some(),
                    ) {
                        Some(up) => result = Box::pin(send(state, up, Instant::now())).await,
                        None => return reject(state, p, ins, &ProxyError::ClientBody),
                    }
                } else {
                    let up = crate::window_learned::upstream_id(upstream);
                    let status = rparts.status.as_u16();
                    let refused =
                        learn_from_refusal(state, p, status, &bytes, &up, ins.model.as_deref());
                    let mut resp = Response::from_parts(rparts, ObservedBody::full(bytes));
                    resp.headers_mut().remove(CONTENT_LENGTH);
                    return respond_buffered(state, p, ins, resp, refused);
                }
            } else {
                result = Ok(resp);
            }
        }
    }

    let resp = match result {
        Ok(r) => r,
        Err(e) => {
            m.upstream_errors
                .with_label_values(&[e.metric_kind()])
                .inc();
            return reject(state, p, ins, &ProxyError::Upstream(e));
        }
    };

    // tap: watch the response go by.
    let status = resp.status();
    let (mut rparts, rbody) = resp.into_parts();
    upstream::strip_hop_by_hop(&mut rparts.headers);
    add_policy_headers(&mut rparts.headers, &ins, cfg.warn_at);
    let mut watch = Watch::new(start);
    let handles = m.api(api.as_str());
    watch.ttfb = Some(handles.ttfb());
    watch.duration = Some(handles.request_duration());
    if status.is_success() && cfg.tap {
        let ct = rparts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok());
        let ce = rparts
            .headers
            .get(CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok());
        watch.reader = Some(UsageReader::new(p, p.framing(ct, ins.stream), ce));
        if ins.injected {
            // The client never sees what the option added, whatever the
            // upstream's encoding: a stream compressed though asked not to
            // be is decoded and leaves uncompressed. One in a coding
            // tidemark cannot read goes as it came.
            let (strip, decoder) = match ce.map(str::trim) {
                None | Some("") => (true, None),
                Some(e) if e.eq_ignore_ascii_case("identity") => (true, None),
                Some(e) => {
                    let d = crate::tap::usage::BodyDecoder::new(e);
                    (d.is_some(), d)
                }
            };
            if strip {
                watch.stripper = Some(crate::tap::inject::UsageStripper::new());
                rparts.headers.remove(CONTENT_LENGTH);
            }
            if decoder.is_some() {
                rparts.headers.remove(CONTENT_ENCODING);
                watch.decoder = decoder;
            }
        }
    } else if status.is_client_error() && cfg.tap {
        // A refusal may name the window the upstream enforces.
        let ce = rparts
            .headers
            .get(CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok());
        watch.capture = Some(crate::tap::ErrorCapture::new(ce));
    }
    // Where a window can be learned (a refusal) or unlearned (more accepted
    // than one said fits), the upstream it belongs to.
    let learn_at = (status.is_client_error() || !state.store.windows().is_empty())
        .then(|| crate::window_learned::upstream_id(upstream));
    watch.on_finish = Some(recorder(state, api, status.as_u16(), ins, learn_at));
    let body = ObservedBody::watched(
        rbody.map_err(Into::into).boxed_unsync(),
        watch,
        cfg.idle_timeout,
    );
    Response::from_parts(rparts, body)
}

/// identify: who is asking, from a request's headers (and query) and body —
/// the credential's hash and the session key. A WebSocket turn is
/// identified by its handshake's headers and its event's body.
pub(crate) struct Identity {
    pub credential: String,
    pub key: Option<String>,
    /// How `key` was found (SPEC §6 `key_source`).
    pub source: KeySource,
    /// `x-context-reset: 1`.
    pub reset: bool,
    /// Where the conversation starts, worked out once when first needed
    /// (the fingerprint, or the lane).
    pub content: ContentOnce,
}

pub(crate) fn identify(
    cfg: &Config,
    headers: &HeaderMap,
    query: Option<&str>,
    p: &dyn Provider,
    view: &RequestView<'_>,
) -> Identity {
    let asked = asking(headers, &cfg.session_headers);
    let credential = credential_hash(asked.credential, query);
    let mut content = ContentOnce::default();
    let (key, source) = identity::session_key(
        &asked,
        cfg.agent_ids,
        cfg.fingerprint,
        p,
        view,
        &credential,
        &mut content,
    );
    Identity {
        credential,
        key,
        source,
        reset: asked.reset,
        content,
    }
}

/// What the estimate phase came to: done in place, or (a long uncached
/// history) on the blocking pool, to be awaited; `None` there means it
/// failed and is done in place after all.
pub(crate) enum Estimating<'a> {
    Done(Estimate),
    Elsewhere(Pin<Box<dyn Future<Output = Option<Estimate>> + Send + 'a>>),
}

/// estimate: the request's tokens, on this worker when little of it is new
/// to the cache, else on tokio's blocking pool (`decoded` is the body the
/// view was parsed from).
pub(crate) fn estimate<'a>(
    state: &'a Local,
    p: &'static dyn Provider,
    view: &RequestView<'_>,
    decoded: Option<Bytes>,
    model: Option<&str>,
) -> Estimating<'a> {
    match state
        .estimator
        .estimate_bounded(p, view, model, INLINE_ESTIMATE_BYTES)
    {
        Some(e) => Estimating::Done(e),
        None => Estimating::Elsewhere(Box::pin(estimate_blocking(
            state,
            p,
            decoded,
            model.map(str::to_string),
        ))),
    }
}

/// project: the session's projection of the request (at its place in the
/// session's order), its utilisation exported. With memory nothing is
/// awaited; with Redis, one round trip.
pub(crate) async fn project(
    state: &State,
    series: &metrics::Series,
    facts: RequestFacts<'_>,
    order: Option<u64>,
) -> Begun {
    let begun = state.store.begin(facts, order).await;
    observe_projection(series, &begun);
    begun
}

/// The projection's utilisation and the window in use, exported once per
/// request.
fn observe_projection(series: &metrics::Series, begun: &Begun) {
    if let Some(u) = begun.projection.util() {
        series.utilization().observe(u);
    }
    if let Some(w) = begun.projection.window {
        series.context_window().set(w as f64);
    }
}

/// The window a request is measured against: a `--context-window` rule,
/// else what its upstream taught (`window_learned.rs`), else the table.
/// With it, the upstream whose learned window a shared backend may still
/// supply (`None` when a rule decided, or nothing can be learned for it).
pub(crate) fn window_of(
    state: &State,
    upstream: &Upstream,
    model: Option<&str>,
) -> (Option<u64>, Option<String>) {
    let Some(m) = model else {
        return (None, None);
    };
    if let Some(w) = crate::window::flag_window(&state.config.context_windows, m) {
        return (Some(w), None);
    }
    let learned = state.store.windows();
    // The upstream's name is made only where it is looked up: a shared
    // backend, or once this process has learned anything.
    let shared = matches!(state.store, crate::session::Store::Redis(_));
    if !shared && learned.is_empty() {
        return (crate::window::table_window(m), None);
    }
    let up = crate::window_learned::upstream_id(upstream);
    let w = learned
        .get(&up, m)
        .or_else(|| crate::window::table_window(m));
    (w, Some(up))
}

/// What an upstream's refusal of one request teaches: the window it
/// enforces for the model (learned for that upstream), and the prompt's
/// real size when it names it (which anchors the lane).
pub(crate) fn learn_from_refusal(
    state: &State,
    p: &dyn Provider,
    status: u16,
    body: &[u8],
    upstream: &str,
    model: Option<&str>,
) -> Option<u64> {
    let e = p.context_error(status, body)?;
    if let Some(m) = model {
        state.store.learn_window(upstream, m, e.window);
    }
    e.prompt
}

/// A cut as a number: two requests sent with the same cut share it.
fn cut_hash(c: &Cut) -> u64 {
    use xxhash_rust::xxh3::Xxh3;
    let mut h = Xxh3::new();
    h.update(&(c.dropped_until as u64).to_le_bytes());
    for e in &c.elided {
        h.update(&(*e as u64).to_le_bytes());
    }
    h.update(&c.prefix_hash.to_le_bytes());
    h.digest().max(1)
}

/// What the policy makes of a projected request.
pub(crate) enum Verdict {
    Pass,
    /// The session spent its `--session-budget`.
    SessionBudget(ProxyError),
    /// Over `--limit-at`: P (`projected`, output reserve included) against
    /// the window; `limit` is the line in tokens. `--on-over` says what
    /// follows.
    Over {
        projected: u64,
        window: u64,
        limit: f64,
        reserve: u64,
    },
}

/// decide: session budget first, then the context budget.
pub(crate) fn decide(cfg: &Config, begun: &Begun, max_output: Option<u64>) -> Verdict {
    if let Some(budget) = cfg.session_budget {
        if begun.spent > budget {
            return Verdict::SessionBudget(ProxyError::SessionBudget {
                spent: begun.spent,
                budget,
            });
        }
    }
    let Some(window) = begun.projection.window else {
        return Verdict::Pass;
    };
    let reserve = match cfg.reserve_output {
        true => max_output.unwrap_or(0),
        false => 0,
    };
    let projected = begun.projection.tokens + reserve;
    let limit = cfg.limit_at * window as f64;
    if projected as f64 > limit {
        Verdict::Over {
            projected,
            window,
            limit,
            reserve,
        }
    } else {
        Verdict::Pass
    }
}

/// Uncached bytes a request may have tokenized on a worker thread (0.2 to
/// 0.3 ms on the README's machine); more goes to the blocking pool.
const INLINE_ESTIMATE_BYTES: usize = 16 * 1024;

/// The estimate of `body` on tokio's blocking pool; `None` if it failed
/// there (the caller then estimates in place).
async fn estimate_blocking(
    state: &Local,
    p: &'static dyn Provider,
    body: Option<Bytes>,
    model: Option<String>,
) -> Option<Estimate> {
    let state = state.clone();
    tokio::task::spawn_blocking(move || {
        let body = body?;
        let view = RequestView::parse(&body)?;
        Some(state.estimator.estimate(p, &view, model.as_deref()))
    })
    .await
    .ok()
    .flatten()
}

/// Await `f` while also driving `sending`, keeping its result in `done`
/// once it has one (and not polling it after).
async fn alongside<T, S: Future + Unpin>(
    f: impl Future<Output = T>,
    sending: &mut S,
    done: &mut Poll<S::Output>,
) -> T {
    let mut f = std::pin::pin!(f);
    std::future::poll_fn(|cx| {
        // `f` first: one that is ready at once (a memory store's begin)
        // costs the request in flight no extra poll.
        if let Poll::Ready(t) = f.as_mut().poll(cx) {
            return Poll::Ready(t);
        }
        if done.is_pending() {
            *done = Pin::new(&mut *sending).poll(cx);
        }
        Poll::Pending
    })
    .await
}

/// Usage injection: an OpenAI chat stream gets `include_usage` unless the
/// client asked for usage or the upstream refused the option. Returns the
/// edited body; `plain` is the body `view` reads (decoded, when it came
/// compressed: the edit leaves uncompressed, `build_upstream_request` drops
/// its `Content-Encoding`); `edited` is a body already changed (a trim),
/// which is new and parsed again. Untrimmed, the body is the one already
/// viewed: no second parse of a long history.
fn usage_injection(
    state: &State,
    api: Api,
    stream: bool,
    upstream: &Upstream,
    plain: &Bytes,
    view: &RequestView<'_>,
    edited: Option<&Bytes>,
) -> Option<Bytes> {
    let wanted = api == Api::OpenAiChat && stream && state.config.inject_usage;
    if !wanted {
        return None;
    }
    let injected = match edited {
        None => crate::tap::inject::inject_include_usage(plain, view),
        Some(t) => {
            RequestView::parse(t).and_then(|v| crate::tap::inject::inject_include_usage(t, &v))
        }
    }?;
    // Asked last: most clients ask for usage themselves (no edit), and the
    // lookup hashes the authority on every stream.
    if state
        .no_stream_options
        .contains(upstream.authority.as_str())
    {
        return None;
    }
    Some(Bytes::from(injected))
}

/// The client's headers go with the request, not a copy of them, unless a
/// refused usage injection may send it again (`injected`).
fn headers_to_send(headers: &mut HeaderMap, injected: bool) -> HeaderMap {
    match injected {
        true => headers.clone(),
        false => std::mem::take(headers),
    }
}

/// The upstream request: the client's, or its edited body; an injected
/// stream is asked for uncompressed, since the stripper must see it as sent
/// to take the option's additions back out.
fn outgoing(
    parts: &http::request::Parts,
    headers: HeaderMap,
    upstream: &Upstream,
    body: &Bytes,
    edited: Option<&Bytes>,
    injected: bool,
) -> Option<Request<UpBody>> {
    let send_body = edited.unwrap_or(body).clone();
    let mut up =
        build_upstream_request(parts, headers, upstream, full(send_body), edited.is_some())?;
    if injected {
        up.headers_mut().insert(
            http::header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    Some(up)
}

/// What a request leaving for the upstream counts. Returns the time it
/// read: the upstream timeout runs from there (one clock read for both).
fn counted_sent(api: Api, start: Instant, injected: bool) -> Instant {
    let handles = metrics::get().api(api.as_str());
    let now = Instant::now();
    handles
        .proxy_overhead()
        .observe(now.saturating_duration_since(start).as_secs_f64());
    if injected {
        handles.usage_injected().inc();
    }
    now
}

/// `--on-over trim`: cut the request down to `--trim-to` with the session's
/// own anchored ruler, continuing the session's last cut. Returns the trim
/// and the estimate of the body it produced (the caller re-projects it and
/// decides); `None` when nothing can be trimmed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn trim_request(
    state: &State,
    api: Api,
    body: &[u8],
    model: Option<&str>,
    cut_key: Option<&str>,
    ruler: Ruler,
    reserve: u64,
    window: u64,
) -> Option<(trim::Trimmed, Estimate)> {
    let cfg = &state.config;
    let measure = |b: &[u8]| -> u64 {
        state
            .estimator
            .estimate_body(api, b, model)
            .map(|e| ruler.measure_estimate(&e))
            .unwrap_or(u64::MAX)
    };
    let need = ((cfg.trim_to * window as f64) as u64).saturating_sub(reserve);
    let keep = ((cfg.limit_at * window as f64) as u64).saturating_sub(reserve);
    let prior = cut_key.and_then(|k| state.cuts.get(k).map(|c| c.clone()));
    let t = trim::trim_sticky(api, body, &measure, need, keep, prior.as_ref())?;
    let est = state.estimator.estimate_body(api, &t.body, model)?;
    Some((t, est))
}

/// Remember a session's cut for its next request, bounded by `--max-sessions`.
pub(crate) fn remember_cut(state: &State, key: String, cut: Cut) {
    if state.cuts.len() >= state.config.max_sessions.max(1) && !state.cuts.contains_key(&key) {
        state.cuts.clear();
    }
    state.cuts.insert(key, cut);
}

/// `--exact-cold-start`: ask the provider's counting endpoint, with the
/// client's own credentials, how big this prompt is. Any failure falls back
/// to the estimate (a cold start is legitimately anchor-less).
async fn count_exact(
    state: &State,
    parts: &http::request::Parts,
    upstream: &Upstream,
    p: &dyn Provider,
    path: &str,
    body: Vec<u8>,
) -> Option<u64> {
    let uri = http::Uri::builder()
        .scheme(upstream.scheme.clone())
        .authority(upstream.authority.clone())
        .path_and_query(match parts.uri.query() {
            Some(q) => format!("{}{}?{}", upstream.prefix, path, q),
            None => format!("{}{}", upstream.prefix, path),
        })
        .build()
        .ok()?;
    let mut headers = parts.headers.clone();
    upstream::strip_hop_by_hop(&mut headers);
    for h in [
        http::header::HOST,
        CONTENT_LENGTH,
        CONTENT_ENCODING,
        http::header::ACCEPT_ENCODING,
    ] {
        headers.remove(h);
    }
    headers.remove(X_CONTEXT_RESET);
    let mut req = Request::new(full(Bytes::from(body)));
    *req.method_mut() = http::Method::POST;
    *req.uri_mut() = uri;
    *req.headers_mut() = headers;
    let bound = state
        .config
        .upstream_timeout
        .min(std::time::Duration::from_secs(10));
    let resp = tokio::time::timeout(bound, state.client.request(req))
        .await
        .ok()?
        .ok()?;
    if !resp.status().is_success() {
        tracing::debug!(
            status = resp.status().as_u16(),
            "counting endpoint refused; estimating"
        );
        return None;
    }
    let bytes = tokio::time::timeout(bound, Limited::new(resp.into_body(), 1 << 20).collect())
        .await
        .ok()?
        .ok()?
        .to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    p.count_response(&json)
}

/// Forward a request whose body tidemark could not read as JSON: untouched, no projection.
async fn forward_unread(
    state: &State,
    mut parts: http::request::Parts,
    body: Bytes,
    upstream: &Upstream,
    p: &dyn Provider,
    start: Instant,
) -> Response<ObservedBody> {
    let m = metrics::get();
    let api = p.api().as_str();
    let headers = std::mem::take(&mut parts.headers);
    let Some(up) = build_upstream_request(&parts, headers, upstream, full(body), false) else {
        let err = ProxyError::ClientBody;
        answered(api, &m.model_label(None), err.status(), start);
        return error_response(&err, p, state.config.max_body_bytes);
    };
    let sent = Instant::now();
    m.api(api)
        .proxy_overhead()
        .observe(sent.saturating_duration_since(start).as_secs_f64());
    match send(state, up, sent).await {
        Ok(resp) => {
            let code = resp.status().as_u16();
            let (mut parts, body) = resp.into_parts();
            upstream::strip_hop_by_hop(&mut parts.headers);
            let mut watch = Watch::new(start);
            let series = m.series(api, None);
            watch.on_finish = Some(Box::new(move |_f: Finish| series.count_request(code)));
            Response::from_parts(
                parts,
                ObservedBody::watched(
                    body.map_err(Into::into).boxed_unsync(),
                    watch,
                    state.config.idle_timeout,
                ),
            )
        }
        Err(e) => {
            m.upstream_errors
                .with_label_values(&[e.metric_kind()])
                .inc();
            let err = ProxyError::Upstream(e);
            answered(api, &m.model_label(None), err.status(), start);
            error_response(&err, p, state.config.max_body_bytes)
        }
    }
}

/// Answer a recognised-API request with a tidemark error: the session hears
/// a failed request (it neither anchors nor loses), the projection header stays.
fn reject(
    state: &State,
    p: &dyn Provider,
    ins: Inspected,
    err: &ProxyError,
) -> Response<ObservedBody> {
    let mut resp = error_response(err, p, state.config.max_body_bytes);
    add_policy_headers(resp.headers_mut(), &ins, state.config.warn_at);
    let code = resp.status().as_u16();
    answered(
        p.api().as_str(),
        &ins.series.model,
        resp.status(),
        ins.start,
    );
    otel::end(
        state.otel.as_ref(),
        ins.span,
        otel::Outcome {
            begun: &ins.begun,
            max_output: ins.max_output,
            usage: &Default::default(),
            status: code,
            failed: true,
            error: Some(err.kind()),
        },
    );
    state.store.finish(
        ins.begun.ticket,
        Outcome {
            status: code,
            completed: true,
            ..Default::default()
        },
    );
    resp
}

/// An upstream error response tidemark already read whole (the injection retry check).
fn respond_buffered(
    state: &State,
    p: &dyn Provider,
    ins: Inspected,
    mut resp: Response<ObservedBody>,
    refused_prompt: Option<u64>,
) -> Response<ObservedBody> {
    upstream::strip_hop_by_hop(resp.headers_mut());
    add_policy_headers(resp.headers_mut(), &ins, state.config.warn_at);
    let code = resp.status().as_u16();
    answered(
        p.api().as_str(),
        &ins.series.model,
        resp.status(),
        ins.start,
    );
    otel::end(
        state.otel.as_ref(),
        ins.span,
        otel::Outcome {
            begun: &ins.begun,
            max_output: ins.max_output,
            usage: &Default::default(),
            status: code,
            failed: true,
            error: None,
        },
    );
    state.store.finish(
        ins.begun.ticket,
        Outcome {
            status: code,
            completed: true,
            refused_prompt,
            ..Default::default()
        },
    );
    resp
}

/// The callback the tap fires once when the response ends: the response's
/// usage is recorded. `learn_at`: the upstream's name, where a refusal may
/// teach its window or an answer unteach it.
fn recorder(
    state: &Local,
    api: Api,
    status: u16,
    ins: Inspected,
    learn_at: Option<String>,
) -> Box<dyn FnOnce(Finish) + Send> {
    let a = api.as_str();
    // The callback outlives this request's borrow of the state.
    let state = state.clone();
    Box::new(move |f: Finish| {
        ins.series.count_request(status);
        let read = f.read.unwrap_or_default();
        if read.parse_errors > 0 {
            metrics::get()
                .usage_parse_errors
                .with_label_values(&[a])
                .inc();
        }
        let completed = f.completed;
        let mut observed = read.observed;
        if let Some(up) = learn_at.as_deref() {
            let model = ins.model.as_deref();
            if let Some(body) = f.error_body.as_deref() {
                observed.refused_prompt =
                    learn_from_refusal(&state, api.provider(), status, body, up, model);
            }
            // A window learned too small (a provider since raised it): the
            // answer shows more fits than it said.
            let real = observed.usage.total_context.unwrap_or(0);
            if let Some(m) = model.filter(|_| (200..300).contains(&status)) {
                if state.store.windows().get(up, m).is_some_and(|w| real > w) {
                    state.store.forget_window(up, m);
                }
            }
        }
        let span = (ins.span, ins.max_output);
        record(
            &state,
            ins.series,
            ins.estimate.tokens,
            ins.begun,
            status,
            completed,
            observed,
            span,
        );
    })
}

/// record: what the provider reported of one request (a response, or a
/// WebSocket turn's terminal event) — the drift exported, the session told
/// (anchored, or the loss made loud), the span ended. `completed`: the
/// response ran to its end (a 2xx that ends without usage is then counted
/// missing). `span`: the request's span and its max output tokens.
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    state: &State,
    s: &metrics::Series,
    est: u64,
    begun: Begun,
    status: u16,
    completed: bool,
    observed: crate::provider::Observed,
    (span, max_output): (Option<Box<otel::Open>>, Option<u64>),
) {
    let usage = observed.usage;
    let ok = (200..300).contains(&status);
    // A stream that ended in the provider's own error event (overloaded,
    // `response.failed`) without usage is a failed turn, as a reset is
    // (SPEC §4): it neither anchors nor loses, and is no missing usage.
    let failed = observed.stream_error && !usage.has_context();
    if ok && completed && !failed && !usage.has_context() {
        s.usage_missing().inc();
    }
    if let Some(real) = usage.total_context {
        let proj = begun.projection.tokens;
        s.prompt_real().inc_by(real);
        s.prompt_estimated().inc_by(est);
        if real > 0 {
            let r = real as f64;
            if est > 0 {
                s.estimate_drift().set(r / est as f64);
            }
            if proj > 0 {
                s.projection_drift().set(r / proj as f64);
            }
            s.estimate_error().observe((est as f64 - r) / r);
            s.projection_error().observe((proj as f64 - r) / r);
        }
    }
    if let Some(c) = usage.cached_input {
        s.cached_prompt().inc_by(c);
    }
    if let Some(o) = usage.output {
        s.output_tokens().inc_by(o);
    }
    let completed = (completed && !failed) || usage.has_context();
    let outcome = otel::Outcome {
        begun: &begun,
        max_output,
        usage: &usage,
        status,
        failed: !completed,
        error: None,
    };
    otel::end(state.otel.as_ref(), span, outcome);
    state.store.finish(
        begun.ticket,
        Outcome {
            status,
            usage,
            response_id: observed.response_id,
            completed,
            server_edit: observed.server_edit,
            refused_prompt: observed.refused_prompt,
        },
    );
}

/// `state=local` right after `src` in `x-context-projection`: the shared
/// backend is configured but did not answer, so the projection comes from
/// this replica's own state. A parameter, not a new `src` value, so clients
/// that read `src` per SPEC keep working.
fn mark_local_state(h: &mut HeaderMap) {
    let Some(v) = h.get(X_CONTEXT_PROJECTION).and_then(|v| v.to_str().ok()) else {
        return;
    };
    let mut s = v.to_string();
    let at = s
        .find(";src=")
        .map(|i| s[i + 1..].find(';').map_or(s.len(), |j| i + 1 + j))
        .unwrap_or(s.len());
    s.insert_str(at, ";state=local");
    if let Ok(v) = HeaderValue::from_str(&s) {
        h.insert(X_CONTEXT_PROJECTION, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marked(v: &str) -> String {
        let mut h = HeaderMap::new();
        h.insert(X_CONTEXT_PROJECTION, HeaderValue::from_str(v).unwrap());
        mark_local_state(&mut h);
        h[X_CONTEXT_PROJECTION].to_str().unwrap().to_string()
    }

    #[test]
    fn local_state_goes_right_after_src() {
        assert_eq!(
            marked("1234;src=anchored;window=200000;util=0.006"),
            "1234;src=anchored;state=local;window=200000;util=0.006"
        );
        assert_eq!(marked("10;src=estimate"), "10;src=estimate;state=local");
        let mut h = HeaderMap::new();
        mark_local_state(&mut h);
        assert!(h.is_empty());
    }
}
