//! The phases of a request on a recognised API, over its [`Ctx`]: read,
//! identify, estimate, project, decide (route is `mod.rs::handle`; send,
//! tap and record are `send.rs` and `tap.rs`).
use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH};
use hyper::body::Incoming;

use super::body::{decode_request, read_body};
use super::ctx::{meanwhile, Ctx};
use crate::config::OnOver;
use crate::estimate::Estimate;
use crate::json::RequestView;
use crate::metrics;
use crate::otel;
use crate::policy::cut::{self, cut_hash, Trimming};
use crate::policy::{self, Over, Refusal, Verdict};
use crate::session::cache::Prefix;
use crate::session::RequestFacts;
use crate::turn::phases::{self as turn, observe_projection, window_of, Estimating, Identity};
use crate::turn::{ProxyError, Turn};

/// read: the body whole, capped at `--max-body-bytes` (413 beyond), kept in
/// `cx.body` as it came. Returns it as JSON would be read: decoded when it
/// came compressed (`None`: in a coding tidemark cannot read).
pub(super) async fn read(cx: &mut Ctx<'_>, body: Incoming) -> Result<Option<Bytes>, ProxyError> {
    let (cfg, m) = (&cx.state.config, metrics::get());
    let too_large = cx
        .parts
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .is_some_and(|n| n > cfg.max_body_bytes as u64);
    if too_large {
        m.limits_hit.with_label_values(&["body"]).inc();
        return Err(ProxyError::BodyTooLarge);
    }
    cx.body = read_body(body, cfg).await.inspect_err(|err| match err {
        ProxyError::BodyTooLarge => m.limits_hit.with_label_values(&["body"]).inc(),
        ProxyError::ClientTimeout => m.limits_hit.with_label_values(&["body_timeout"]).inc(),
        _ => {}
    })?;
    let encoding = cx
        .parts
        .headers
        .get(CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok());
    let cap = cfg.max_body_bytes.saturating_mul(8);
    Ok(decode_request(encoding, &cx.body, cap))
}

/// identify: who is asking, cheaply (a hash of the credential, and of the
/// messages up to the first user message), so it comes before a request
/// forwarded first leaves; and what the request is (model, stream).
pub(super) fn identify(cx: &mut Ctx<'_>, view: &RequestView<'_>) -> Identity {
    // Every upstream request made from here on (the request, a retry, a
    // count) names tidemark's span as its parent.
    otel::inject(&cx.span, &mut cx.parts.headers);
    let cfg = &cx.state.config;
    let (path, query) = (cx.parts.uri.path(), cx.parts.uri.query());
    cx.stream = cx.p.is_stream(path, query, view);
    cx.model = cx.p.model(path, view);
    let who = turn::identify(cfg, &cx.parts.headers, query, cx.p, view);
    cx.chained = who.continues.is_some();
    cx.cut_key = cut::cut_key(cfg, &who.credential, who.key.as_deref());
    who
}

/// estimate: the request's tokens; a cold long history is estimated on the
/// blocking pool while a request already sent is driven.
pub(super) async fn estimate(cx: &mut Ctx<'_>, view: &RequestView<'_>, json: &Bytes) -> Estimate {
    let (state, p, model) = (cx.state, cx.p, cx.model.as_deref());
    match turn::estimate(state, p, view, Some(json.clone()), model) {
        Estimating::Done(e) => e,
        Estimating::Elsewhere(elsewhere) => meanwhile(&mut cx.in_flight, elsewhere)
            .await
            .unwrap_or_else(|| state.estimator.estimate(p, view, model)),
    }
}

/// project: the session's projection of the request, against its window.
/// Memory: ready at once. `--state redis`: one round trip for the
/// session's record, order, totals and the model's calibration, a request
/// already sent driven meanwhile. `--exact-cold-start` then asks the
/// provider to count an anchor-less one.
pub(super) async fn project(
    cx: &mut Ctx<'_>,
    mut who: Identity,
    estimate: Estimate,
    view: &RequestView<'_>,
) -> Turn {
    let (state, p, api) = (cx.state, cx.p, cx.p.api());
    let series = metrics::get().series(api.as_str(), cx.model.as_deref());
    let (window, window_upstream) = window_of(state, cx.upstream, cx.model.as_deref());
    let facts = RequestFacts {
        key: who.key,
        source: who.source,
        credential: who.credential,
        api,
        model: cx.model.clone(),
        estimate: estimate.tokens,
        classes: estimate.classes,
        reset: who.reset,
        window,
        window_upstream,
        counted: None,
        continues: who.continues,
        content: who.content.get(p, view).unwrap_or_default(),
        stream: None,
    };
    let begin = state.store.begin(facts, cx.order);
    let mut begun = meanwhile(&mut cx.in_flight, begin).await;
    observe_projection(series, &begun);
    if state.config.exact_cold_start && begun.anchorless() {
        super::count::exact(cx, view, &mut begun).await;
    }
    Turn {
        series,
        estimate: estimate.tokens,
        begun,
        max_output: p.max_output_tokens(view),
        span: cx.span.take(),
    }
}

/// decide: the policy's verdict (`policy/decide.rs`), carried out: pass,
/// reject (the error to answer), or trim (the body to send instead).
pub(super) fn decide(cx: &mut Ctx<'_>, turn: &mut Turn, json: &Bytes) -> Result<(), ProxyError> {
    let api = cx.p.api().as_str();
    match policy::decide(&cx.state.config, &turn.begun, turn.max_output) {
        Verdict::Pass { over } => {
            if let Some(o) = over {
                o.count(api, &turn.series.model, OnOver::Pass);
            }
            Ok(())
        }
        Verdict::Reject(r) => {
            if let Refusal::Context(o) = r {
                o.count(api, &turn.series.model, OnOver::Reject);
            }
            Err(r.into())
        }
        Verdict::Trim(o) => trim(cx, turn, json, o),
    }
}

/// `--on-over trim`: the request cut down and re-projected with the same
/// anchored ruler; a trim that does not bring it under the line is never
/// forwarded, and the client hears about the request it sent.
fn trim(cx: &mut Ctx<'_>, turn: &mut Turn, json: &Bytes, over: Over) -> Result<(), ProxyError> {
    let (state, api, series) = (cx.state, cx.p.api(), turn.series);
    let model = &series.model;
    let asked = Trimming {
        api,
        body: json,
        model: cx.model.as_deref(),
        cut_key: cx.cut_key.as_deref(),
        ruler: turn.begun.ruler,
        over,
    };
    let Some((t, est)) = cut::trim_request(&state.config, &state.estimator, &state.cuts, &asked)
    else {
        over.count(api.as_str(), model, OnOver::Reject);
        return Err(Refusal::Context(over).into());
    };
    cx.cut = cut_hash(&t.cut);
    let labels = (api.as_str(), model.as_str());
    let (store, key) = (&*state.store, cx.cut_key.take());
    let after = cut::forwarded(
        store,
        &state.cuts,
        &mut turn.begun,
        labels,
        key,
        (&t, est, over),
    );
    cx.trimmed = Some(format!(
        "before={}, after={after}, turns={}, tool-results={}",
        over.projected, t.turns, t.tool_results
    ));
    let b = Bytes::from(t.body);
    cx.trimmed_body = Some(b.clone());
    cx.edited = Some(b);
    Ok(())
}

/// What is sent, as the provider's prompt cache will see it: compared with
/// the lane's previous request when the response comes back. A chained
/// request (`previous_response_id`) carries only its new input.
pub(super) fn cache_view(cx: &Ctx<'_>, turn: &mut Turn, view: &RequestView<'_>) {
    if turn.begun.ticket.session().is_none() || cx.chained {
        return;
    }
    let sent = cx.trimmed_body.as_deref().and_then(RequestView::parse);
    let sent = sent.as_ref().unwrap_or(view);
    let prefix = Prefix::of(cx.p, sent, &cx.state.estimator, cx.model.as_deref(), cx.cut);
    turn.begun.ticket.set_prefix(prefix);
}
