//! The exporter task: drains the request path's queue, batches spans,
//! aggregates metrics, and posts both on tidemark's own HTTP client. A
//! collector that does not answer costs a counter and one WARN per outage
//! (one INFO when it answers again); the request path never waits for it.

use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use futures_util::FutureExt;
use http::header::{CONTENT_TYPE, HOST, USER_AGENT};
use http::{HeaderName, HeaderValue, Request, Uri};
use http_body_util::{BodyExt, Full, Limited};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::encode::{self, GenAiMetrics};
use super::{Finished, OtlpConfig};
use crate::metrics;
use crate::upstream::Client;

/// Ends the exporter task after one last export of what it holds.
pub struct Stop(Mutex<Option<(oneshot::Sender<()>, JoinHandle<()>)>>);

impl Stop {
    /// Flush and end the task, waiting at most `bound`.
    pub async fn shutdown(&self, bound: Duration) {
        let taken = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((tx, done)) = taken {
            let _ = tx.send(());
            let _ = tokio::time::timeout(bound, done).await;
        }
    }
}

pub(super) fn spawn(cfg: OtlpConfig, client: Client, rx: Receiver<Box<Finished>>) -> Stop {
    tracing::info!(
        traces = cfg.traces.as_ref().map(|u| u.path()),
        metrics = cfg.metrics.as_ref().map(|u| u.path()),
        collector = cfg
            .traces
            .as_ref()
            .or(cfg.metrics.as_ref())
            .and_then(|u| u.authority())
            .map(|a| a.host()),
        "OpenTelemetry export on (OTLP/HTTP)"
    );
    let (tx, stop) = oneshot::channel();
    let now = unix_nanos();
    let task = Task {
        resource: encode::resource(&cfg.resource),
        genai: GenAiMetrics::new(now),
        start: now,
        pending: Vec::new(),
        last_spans: Instant::now(),
        down: [false; 2],
        refused: [None; 2],
        client,
        rx,
        cfg,
    };
    Stop(Mutex::new(Some((tx, tokio::spawn(task.run(stop))))))
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// The two signals, as `tidemark_otlp_dropped_total{signal}` names them.
#[derive(Clone, Copy)]
enum Signal {
    Spans = 0,
    Metrics = 1,
}

impl Signal {
    fn as_str(self) -> &'static str {
        match self {
            Signal::Spans => "spans",
            Signal::Metrics => "metrics",
        }
    }
}

/// An export's end: how many items it carried, and what went wrong.
struct Sent {
    signal: Signal,
    items: u64,
    result: Result<(), Failure>,
}

struct Task {
    cfg: OtlpConfig,
    client: Client,
    rx: Receiver<Box<Finished>>,
    resource: Resource,
    genai: GenAiMetrics,
    /// When the cumulative metrics started.
    start: u64,
    /// Spans waiting for their export, at most `max_queue`.
    pending: Vec<Span>,
    last_spans: Instant,
    /// Per signal: its last export found no collector (an outage, said once).
    down: [bool; 2],
    /// Per signal: the status its last export was refused with.
    refused: [Option<u16>; 2],
}

impl Task {
    async fn run(mut self, mut stop: oneshot::Receiver<()>) {
        // How often the queue is looked at: often enough that it does not
        // fill between two looks at a busy proxy's rate (the request path
        // never wakes this task: a wake per request would cost it a
        // cross-thread signal), and more often while a backlog of full
        // batches waits.
        let poll = self
            .cfg
            .span_delay
            .min(Duration::from_millis(50))
            .max(Duration::from_millis(5));
        let mut next_metrics = Instant::now() + self.cfg.metric_interval;
        let mut spans: Option<JoinHandle<Sent>> = None;
        let mut metrics: Option<JoinHandle<Sent>> = None;
        loop {
            let wait = match self.pending.len() >= self.cfg.max_batch {
                true => Duration::from_millis(5),
                false => poll,
            };
            let stopping = tokio::select! {
                _ = tokio::time::sleep(wait) => false,
                _ = &mut stop => true,
            };
            let open = self.drain();
            for h in [&mut spans, &mut metrics] {
                if h.as_ref().is_some_and(JoinHandle::is_finished) {
                    if let Some(Ok(sent)) = h.take().and_then(FutureExt::now_or_never) {
                        self.outcome(sent);
                    }
                }
            }
            if stopping || !open {
                break;
            }
            let due = self.pending.len() >= self.cfg.max_batch
                || self.last_spans.elapsed() >= self.cfg.span_delay;
            if spans.is_none() && !self.pending.is_empty() && due {
                spans = Some(tokio::spawn(self.export_spans()));
            }
            if metrics.is_none() && Instant::now() >= next_metrics {
                next_metrics = Instant::now() + self.cfg.metric_interval;
                if let Some(f) = self.export_metrics() {
                    metrics = Some(tokio::spawn(f));
                }
            }
        }
        // Shutting down: what is in flight ends (each bounded by its
        // timeout), then everything held goes out once.
        for h in [spans, metrics].into_iter().flatten() {
            if let Ok(sent) = h.await {
                self.outcome(sent);
            }
        }
        self.drain();
        while !self.pending.is_empty() {
            let sent = self.export_spans().await;
            self.outcome(sent);
        }
        if let Some(f) = self.export_metrics() {
            let sent = f.await;
            self.outcome(sent);
        }
    }

    /// Take what the request path queued. `false` once every sender is
    /// gone (the proxy stopped).
    fn drain(&mut self) -> bool {
        loop {
            match self.rx.try_recv() {
                Ok(f) => {
                    self.genai.add(&f);
                    if !f.export_span {
                        continue;
                    }
                    if self.pending.len() < self.cfg.max_queue {
                        self.pending.push(encode::span(&f));
                    } else {
                        dropped(Signal::Spans, "queue_full", 1);
                    }
                }
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => return false,
            }
        }
    }

    /// The next batch of spans, sent.
    fn export_spans(&mut self) -> impl std::future::Future<Output = Sent> + Send + 'static {
        self.last_spans = Instant::now();
        let n = self.pending.len().min(self.cfg.max_batch);
        let batch: Vec<Span> = self.pending.drain(..n).collect();
        let body = encode::traces(&self.resource, batch).encode_to_vec();
        let post = self.post(Signal::Spans, body);
        async move {
            Sent {
                signal: Signal::Spans,
                items: n as u64,
                result: post.await,
            }
        }
    }

    /// Every metric as it stands, sent; `None` when there is nothing to
    /// send or nowhere to send it.
    fn export_metrics(
        &mut self,
    ) -> Option<impl std::future::Future<Output = Sent> + Send + 'static> {
        self.cfg.metrics.as_ref()?;
        let now = unix_nanos();
        let mut all = self.genai.metrics(now);
        all.extend(encode::own_metrics(
            &metrics::get().registry.gather(),
            self.start,
            now,
        ));
        if all.is_empty() {
            return None;
        }
        let items = encode::points(&all);
        let body = encode::metrics(&self.resource, all).encode_to_vec();
        let post = self.post(Signal::Metrics, body);
        Some(async move {
            Sent {
                signal: Signal::Metrics,
                items,
                result: post.await,
            }
        })
    }

    fn post(
        &self,
        signal: Signal,
        body: Vec<u8>,
    ) -> impl std::future::Future<Output = Result<(), Failure>> + Send + 'static {
        let (url, headers) = match signal {
            Signal::Spans => (self.cfg.traces.clone(), &self.cfg.trace_headers),
            Signal::Metrics => (self.cfg.metrics.clone(), &self.cfg.metric_headers),
        };
        let headers = headers.clone();
        let client = self.client.clone();
        let timeout = self.cfg.timeout;
        async move {
            let url = url.ok_or(Failure::Unreachable("no endpoint"))?;
            tokio::time::timeout(timeout, post(client, url, headers, body))
                .await
                .unwrap_or(Err(Failure::Unreachable("timeout")))
        }
    }

    /// An export's end. An outage (the collector not answering) is said
    /// once, however many exports and signals fail in it: a WARN when the
    /// first fails while the collector was answering, an INFO when one
    /// gets through again (the signals that share its collector are back
    /// with it). An answer that refuses an export is not an outage: a WARN
    /// when a signal's refusal changes, DEBUG while it repeats.
    fn outcome(&mut self, s: Sent) {
        let i = s.signal as usize;
        let urls = [self.cfg.traces.as_ref(), self.cfg.metrics.as_ref()];
        let authority = |u: Option<&Uri>| u.and_then(|u| u.authority()).cloned();
        // Where, without any userinfo or query a URL may carry.
        let at = urls[i].map(|u| {
            format!(
                "{}://{}{}",
                u.scheme_str().unwrap_or("http"),
                u.authority().map_or("", |a| a.host()),
                u.port().map(|p| format!(":{p}")).unwrap_or_default()
            ) + u.path()
        });
        let was_down = self.down.iter().any(|d| *d);
        match s.result {
            Ok(()) => {
                self.refused[i] = None;
                for (j, d) in self.down.iter_mut().enumerate() {
                    if j == i || authority(urls[j]) == authority(urls[i]) {
                        *d = false;
                    }
                }
                if was_down && !self.down.iter().any(|d| *d) {
                    tracing::info!(
                        collector = at.as_deref(),
                        "OTLP collector answers again; export resumed"
                    );
                }
            }
            Err(Failure::Refused(status)) => {
                dropped(s.signal, "export_failed", s.items);
                self.down[i] = false;
                if self.refused[i].replace(status) == Some(status) {
                    tracing::debug!(signal = s.signal.as_str(), status, "OTLP export refused");
                } else {
                    tracing::warn!(
                        signal = s.signal.as_str(),
                        collector = at.as_deref(),
                        status,
                        "the OTLP collector refuses exports; telemetry is dropped \
                         (tidemark_otlp_dropped_total)"
                    );
                }
            }
            Err(Failure::Unreachable(e)) => {
                dropped(s.signal, "export_failed", s.items);
                self.down[i] = true;
                if was_down {
                    tracing::debug!(signal = s.signal.as_str(), error = e, "OTLP export failed");
                } else {
                    tracing::warn!(
                        signal = s.signal.as_str(),
                        collector = at.as_deref(),
                        error = e,
                        "OTLP collector unreachable; telemetry is dropped \
                         (tidemark_otlp_dropped_total) until it answers"
                    );
                }
            }
        }
    }
}

/// Why an export failed.
enum Failure {
    /// No answer: connect, TLS, reset or timeout.
    Unreachable(&'static str),
    /// An answer, not 2xx.
    Refused(u16),
}

fn dropped(signal: Signal, reason: &str, n: u64) {
    metrics::get()
        .otlp_dropped
        .with_label_values(&[signal.as_str(), reason])
        .inc_by(n);
}

/// One OTLP/HTTP request: protobuf in, any 2xx is success (a partial
/// success is still accepted data).
async fn post(
    client: Client,
    url: Uri,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Vec<u8>,
) -> Result<(), Failure> {
    let mut req = Request::new(
        Full::new(Bytes::from(body))
            .map_err(|e| match e {})
            .boxed_unsync(),
    );
    *req.method_mut() = http::Method::POST;
    let h = req.headers_mut();
    if let Some(a) = url
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    {
        h.insert(HOST, a);
    }
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/x-protobuf"),
    );
    h.insert(
        USER_AGENT,
        HeaderValue::from_static(concat!("tidemark/", env!("CARGO_PKG_VERSION"))),
    );
    for (k, v) in headers {
        h.insert(k, v);
    }
    *req.uri_mut() = url;
    let resp = client
        .request(req)
        .await
        .map_err(|e| Failure::Unreachable(e.metric_kind()))?;
    let status = resp.status();
    // Read to its end, so the connection is reused; an answer is small.
    let _ = Limited::new(resp.into_body(), 64 * 1024).collect().await;
    match status.is_success() {
        true => Ok(()),
        false => Err(Failure::Refused(status.as_u16())),
    }
}
