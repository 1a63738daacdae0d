//! What tidemark answers itself for a request it read: an error before the
//! request is projected, or, once it is, an answer that is no response to
//! tap (a tidemark error, an upstream error already read whole); and the
//! headers every projected request's answer carries.
use std::time::Instant;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::Response;

use super::ctx::Ctx;
use crate::metrics;
use crate::otel;
use crate::provider::Provider;
use crate::session::{decimal, Begun, Outcome, Projection};
use crate::tap::ObservedBody;
use crate::turn::error::answered;
use crate::turn::{error_response, ProxyError, State, Turn};
use crate::turn::{X_CONTEXT_PROJECTION, X_CONTEXT_TRIMMED, X_CONTEXT_WARNING};
use crate::upstream;

/// A request tidemark answers before any session hears of it, counted
/// under `api` (its error body in `shape`'s form).
pub(super) fn refused(
    state: &State,
    shape: &dyn Provider,
    api: &str,
    err: ProxyError,
    start: Instant,
) -> Response<ObservedBody> {
    answered(api, &metrics::get().model_label(None), err.status(), start);
    error_response(&err, shape, state.config.max_body_bytes)
}

/// How a projected request ends without a response to tap.
pub(super) enum Ending {
    /// A tidemark error, answered in the API's shape.
    Error(ProxyError),
    /// An upstream's error response, already read whole (the usage
    /// injection's retry check); `refused_prompt`: the prompt size it named.
    Buffered {
        resp: Box<Response<ObservedBody>>,
        refused_prompt: Option<u64>,
    },
}

/// Answer a projected request without a response to tap: the session hears
/// a failed request (it neither anchors nor loses), the projection header
/// stays.
pub(super) fn end(cx: Ctx<'_>, turn: Turn, ending: Ending) -> Response<ObservedBody> {
    let state = cx.state;
    let (mut resp, error, refused_prompt) = match ending {
        Ending::Error(err) => {
            let resp = error_response(&err, cx.p, state.config.max_body_bytes);
            (resp, Some(err.kind()), None)
        }
        Ending::Buffered {
            mut resp,
            refused_prompt,
        } => {
            upstream::strip_hop_by_hop(resp.headers_mut());
            (*resp, None, refused_prompt)
        }
    };
    let (trimmed, warn_at) = (cx.trimmed.as_deref(), state.config.warn_at);
    add_policy_headers(resp.headers_mut(), &turn.begun, trimmed, warn_at);
    let code = resp.status().as_u16();
    answered(
        cx.p.api().as_str(),
        &turn.series.model,
        resp.status(),
        cx.start,
    );
    let failed = otel::Outcome {
        begun: &turn.begun,
        max_output: turn.max_output,
        usage: &Default::default(),
        status: code,
        failed: true,
        error,
    };
    otel::end(state.otel.as_ref(), turn.span, failed);
    let outcome = Outcome {
        status: code,
        completed: true,
        refused_prompt,
        ..Default::default()
    };
    state.store.finish(turn.begun.ticket, outcome);
    resp
}

/// RFC 8941 dictionary for `x-context-warning`.
fn warning_value(util: f64, at: f64) -> String {
    format!("util={}, at={}", decimal(util), decimal(at))
}

/// The projection headers plus `x-context-trimmed` when the request was trimmed.
pub(super) fn add_policy_headers(
    h: &mut HeaderMap,
    begun: &Begun,
    trimmed: Option<&str>,
    warn_at: f64,
) {
    // Room for the projection, warning and trimmed headers in one step.
    h.reserve(3);
    add_projection_headers(h, &begun.projection, warn_at);
    if begun.local_state {
        mark_local_state(h);
    }
    if let Some(t) = trimmed.and_then(|t| HeaderValue::from_str(t).ok()) {
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
