//! OpenTelemetry export (OTLP over HTTP/protobuf, off unless an endpoint is
//! configured): a span per request on a recognised API and per Responses
//! WebSocket turn, GenAI metrics, and tidemark's own metrics.
//!
//! Three hooks on the request's phases, each a no-op (no allocation, no
//! clock read) when export is off: [`start`] when a request comes in (the
//! client's `traceparent` read), [`inject`] on the upstream request (ours
//! written), and [`end`] in the record phase. `end` pushes one record onto
//! a bounded queue without waiting; a full queue drops it and counts
//! (`tidemark_otlp_dropped_total`). One exporter task per process drains
//! the queue, aggregates the GenAI metrics, builds the messages
//! (`encode.rs`) and sends them on tidemark's own HTTP client
//! (`export.rs`).
//!
//! Never a body, a credential or conversation text: a span names the
//! session by a hash, and its attributes are counts and names.

pub mod context;
mod encode;
mod export;

use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::time::{Instant, SystemTime};

use http::HeaderMap;

pub use crate::config::otlp::OtlpConfig;
use export::Stop;

use crate::provider::{Api, Usage};
use crate::session::Begun;

/// The request path's end of the export queue. Cheap to share: the sender
/// is all it holds.
pub struct Exporter {
    queue: SyncSender<Box<Finished>>,
    /// Spans are exported (an endpoint for them is configured).
    spans: bool,
    stop: Stop,
}

impl Exporter {
    /// The queue and its exporter task, spawned on the current runtime;
    /// `client` is tidemark's own upstream client (its TLS settings, no
    /// second HTTP stack).
    pub fn start(cfg: OtlpConfig, client: crate::upstream::Client) -> Exporter {
        let (queue, rx) = sync_channel(cfg.max_queue);
        let spans = cfg.traces.is_some();
        let stop = export::spawn(cfg, client, rx);
        Exporter { queue, spans, stop }
    }

    /// Export what is held and end the exporter task (at shutdown), waiting
    /// at most `bound` for the collector.
    pub async fn shutdown(&self, bound: std::time::Duration) {
        self.stop.shutdown(bound).await
    }

    fn push(&self, f: Box<Finished>) {
        match self.queue.try_send(f) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => crate::metrics::get()
                .otlp_dropped
                .with_label_values(&["spans", "queue_full"])
                .inc(),
            // The task is gone (shutting down): nothing to count against.
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

/// A request's span while it runs: its ids, where it continues a trace, and
/// when it began.
pub struct Open {
    api: Api,
    trace_id: [u8; 16],
    span_id: [u8; 8],
    parent: Option<[u8; 8]>,
    /// Spans are exported: the upstream is told of this one.
    traced: bool,
    /// Exported only when sampled: the client's `traceparent` says so (a
    /// trace it does not record is not recorded here either); a new trace is.
    sampled: bool,
    trace_state: Option<Box<str>>,
    start_unix_nano: u64,
    start: Instant,
}

/// start: a request on a recognised API (or a WebSocket turn) comes in;
/// `None` when export is off. `start` is when the request came in (the
/// duration runs from there), `None` for now (read only when export is on).
pub fn start(
    otel: Option<&Exporter>,
    headers: &HeaderMap,
    api: Api,
    start: Option<Instant>,
) -> Option<Box<Open>> {
    let otel = otel?;
    let start = start.unwrap_or_else(Instant::now);
    let parent = context::parent(headers);
    let (trace_id, parent_id, sampled) = match &parent {
        Some(p) => (p.trace_id, Some(p.span_id), p.sampled),
        None => {
            let mut t = [0u8; 16];
            t[..8].copy_from_slice(&context::random_u64().to_be_bytes());
            t[8..].copy_from_slice(&context::random_u64().to_be_bytes());
            (t, None, true)
        }
    };
    let now = SystemTime::now();
    let since = start.elapsed();
    let start_unix_nano = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.saturating_sub(since).as_nanos() as u64);
    Some(Box::new(Open {
        api,
        trace_id,
        span_id: context::random_u64().to_be_bytes(),
        parent: parent_id,
        traced: otel.spans,
        sampled,
        trace_state: parent.and_then(|_| context::tracestate(headers)),
        start_unix_nano,
        start,
    }))
}

/// inject: the upstream request names tidemark's span as its parent (the
/// client's `tracestate` goes on as it came, with the other headers).
pub fn inject(span: &Option<Box<Open>>, headers: &mut HeaderMap) {
    if let Some(s) = span.as_ref().filter(|s| s.traced) {
        headers.insert(
            context::TRACEPARENT,
            context::header(&s.trace_id, &s.span_id, s.sampled),
        );
    }
}

/// What the record phase knows of a request when it ends.
pub struct Outcome<'a> {
    pub begun: &'a Begun,
    /// The request's max output tokens, when it set them.
    pub max_output: Option<u64>,
    pub usage: &'a Usage,
    pub status: u16,
    /// The response ended in the provider's own error event, or was cut.
    pub failed: bool,
    /// tidemark's own answer (`x-tidemark-error` kind), when it gave one.
    pub error: Option<&'static str>,
}

/// end: the request is recorded; its span and metric points go onto the
/// export queue.
pub fn end(otel: Option<&Exporter>, span: Option<Box<Open>>, o: Outcome<'_>) {
    let (Some(otel), Some(open)) = (otel, span) else {
        return;
    };
    let b = o.begun;
    let duration = open.start.elapsed();
    let conversation = conversation(b);
    let error = match (o.error, o.status) {
        (Some(kind), _) => Some(ErrorType::Own(kind)),
        (None, s) if s >= 400 => Some(ErrorType::Status(s)),
        (None, _) if o.failed => Some(ErrorType::Own("stream_error")),
        _ => None,
    };
    otel.push(Box::new(Finished {
        export_span: open.traced && open.sampled,
        end_unix_nano: open.start_unix_nano + duration.as_nanos() as u64,
        duration: duration.as_secs_f64(),
        model: b.ticket.model().map(Into::into),
        lane: conversation.as_ref().map(|_| b.ticket.lane()),
        key_source: b.source.map(|s| s.as_str()),
        conversation,
        projection: b.projection.tokens,
        src: b.projection.src.as_str(),
        window: b.projection.window,
        max_output: o.max_output,
        usage: *o.usage,
        status: o.status,
        error,
        open,
    }));
}

/// The session a span names: the session key with its credential's hash
/// (`credential:key`), to be hashed on the exporter's side (never the key
/// itself on the wire).
fn conversation(b: &Begun) -> Option<Box<str>> {
    b.ticket
        .session()
        .map(|(credential, key)| format!("{credential}:{key}").into_boxed_str())
}

/// Why a span is an error (`error.type`).
#[derive(Debug, Clone, Copy)]
enum ErrorType {
    /// tidemark's own (`x-tidemark-error` kinds, `stream_error`).
    Own(&'static str),
    /// The upstream's status.
    Status(u16),
}

/// One finished request, as the exporter task receives it.
struct Finished {
    open: Box<Open>,
    /// A span goes out for it (spans exported, and sampled).
    export_span: bool,
    end_unix_nano: u64,
    duration: f64,
    model: Option<Box<str>>,
    /// `credential:key`, hashed before it leaves.
    conversation: Option<Box<str>>,
    /// The lane's id in its session (as `GET /sessions` shows it).
    lane: Option<u64>,
    /// How the session key was found (`header`, `agent`, `chain`, `fingerprint`).
    key_source: Option<&'static str>,
    projection: u64,
    src: &'static str,
    window: Option<u64>,
    max_output: Option<u64>,
    usage: Usage,
    status: u16,
    error: Option<ErrorType>,
}
