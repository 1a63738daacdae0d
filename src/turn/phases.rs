//! The phases of a turn that an HTTP request (`proxy/`) and a WebSocket
//! `response.create` (`ws/responses.rs`) both run: `identify`, `estimate`,
//! `project`, `record`.
use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use http::HeaderMap;

use super::{Local, State};
use crate::config::{Config, Upstream};
use crate::estimate::Estimate;
use crate::json::RequestView;
use crate::metrics;
use crate::otel;
use crate::provider::{Observed, Provider};
use crate::session::identity::{self, asking, credential_hash, ContentOnce};
use crate::session::{Begun, KeySource, Outcome, RequestFacts};

/// identify: who is asking, from a request's headers (and query) and body —
/// the credential's hash and the session key. A WebSocket turn is
/// identified by its handshake's headers and its event's body.
pub struct Identity {
    pub credential: String,
    pub key: Option<String>,
    /// How `key` was found (SPEC §6 `key_source`).
    pub source: KeySource,
    /// `x-context-reset: 1`.
    pub reset: bool,
    /// Where the conversation starts, worked out once when first needed
    /// (the fingerprint, or the lane).
    pub content: ContentOnce,
    /// The response this request continues (`previous_response_id`).
    pub continues: Option<String>,
}

pub fn identify(
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
        continues: p.continues(view),
    }
}

/// What the estimate phase came to: done in place, or (a long uncached
/// history) on the blocking pool, to be awaited; `None` there means it
/// failed and is done in place after all.
pub enum Estimating<'a> {
    Done(Estimate),
    Elsewhere(Pin<Box<dyn Future<Output = Option<Estimate>> + Send + 'a>>),
}

/// Uncached bytes a request may have tokenized on a worker thread: a
/// fraction of a millisecond, which the worker's other connections can
/// afford to wait; more goes to the blocking pool.
const INLINE_ESTIMATE_BYTES: usize = 16 * 1024;

/// estimate: the request's tokens, on this worker when little of it is new
/// to the cache, else on tokio's blocking pool (`decoded` is the body the
/// view was parsed from): a worker thread serves many connections, and
/// the others' streams do not wait behind a cold long history.
pub fn estimate<'a>(
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

/// project: the session's projection of the request (at its place in the
/// session's order), its utilisation exported. With memory nothing is
/// awaited; with Redis, one round trip.
pub async fn project(
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
pub fn observe_projection(series: &metrics::Series, begun: &Begun) {
    if let Some(u) = begun.projection.util() {
        series.utilization().observe(u);
    }
    if let Some(w) = begun.projection.window {
        series.context_window().set(w as f64);
    }
}

/// The window a request is measured against: a `--context-window` rule,
/// else what its upstream taught (`window/learned.rs`), else the table.
/// With it, the upstream whose learned window a shared backend may still
/// supply (`None` when a rule decided, or nothing can be learned for it).
pub fn window_of(
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
    let shared = state.store.backend().is_some();
    if !shared && learned.is_empty() {
        return (crate::window::table_window(m), None);
    }
    let up = crate::window::learned::upstream_id(upstream);
    let w = learned
        .get(&up, m)
        .or_else(|| crate::window::table_window(m));
    (w, Some(up))
}

/// What an upstream's refusal of one request teaches: the window it
/// enforces for the model (learned for that upstream), and the prompt's
/// real size when it names it (which anchors the lane).
pub fn learn_from_refusal(
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

/// A projected turn, as `record` needs it once the provider has answered.
pub struct Turn {
    /// This (api, model)'s metric series; `series.model` is the model label.
    pub series: &'static metrics::Series,
    /// The estimate the drift is measured against.
    pub estimate: u64,
    pub begun: Begun,
    pub max_output: Option<u64>,
    /// Its OpenTelemetry span, when export is on.
    pub span: Option<Box<otel::Open>>,
}

/// record: what the provider reported of one request (a response, or a
/// WebSocket turn's terminal event) — the drift exported, the session told
/// (anchored, or the loss made loud), the span ended. `completed`: the
/// response ran to its end (a 2xx that ends without usage is then counted
/// missing).
pub fn record(state: &State, turn: Turn, status: u16, completed: bool, observed: Observed) {
    let (s, est, begun) = (turn.series, turn.estimate, turn.begun);
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
        drift(s, est, begun.projection.tokens, real);
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
        max_output: turn.max_output,
        usage: &usage,
        status,
        failed: !completed,
        error: None,
    };
    otel::end(state.otel.as_ref(), turn.span, outcome);
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

/// The estimate's and the projection's drift from the real count.
fn drift(s: &metrics::Series, est: u64, proj: u64, real: u64) {
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
