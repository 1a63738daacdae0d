//! tap: the response goes to the client as it arrives, watched — its usage
//! read on the way, or a refusal's body copied on the side — and at its
//! end the turn is recorded (`turn::phases::record`).
use http::header::{HeaderMap, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE};
use http::Response;
use http_body_util::BodyExt;

use super::ctx::Ctx;
use super::respond::add_policy_headers;
use crate::metrics;
use crate::provider::Api;
use crate::tap::usage::UsageReader;
use crate::tap::{Finish, ObservedBody, Watch};
use crate::turn::phases::{learn_from_refusal, record};
use crate::turn::{Local, Turn};
use crate::upstream::{self, UpstreamBody};

/// tap: watch the response go by; record the turn once it ends.
pub(super) fn tap(cx: Ctx<'_>, turn: Turn, resp: Response<UpstreamBody>) -> Response<ObservedBody> {
    let (state, cfg) = (cx.state, &cx.state.config);
    let status = resp.status();
    let (mut rparts, rbody) = resp.into_parts();
    upstream::strip_hop_by_hop(&mut rparts.headers);
    let trimmed = cx.trimmed.as_deref();
    add_policy_headers(&mut rparts.headers, &turn.begun, trimmed, cfg.warn_at);
    let mut watch = Watch::new(cx.start);
    let handles = metrics::get().api(cx.p.api().as_str());
    watch.ttfb = Some(handles.ttfb());
    watch.duration = Some(handles.request_duration());
    if status.is_success() && cfg.tap {
        read_usage(&cx, &mut rparts.headers, &mut watch);
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
        .then(|| crate::window::learned::upstream_id(cx.upstream));
    let api = cx.p.api();
    watch.on_finish = Some(recorder(
        state,
        api,
        status.as_u16(),
        (turn, cx.model),
        learn_at,
    ));
    let body = ObservedBody::watched(
        rbody.map_err(Into::into).boxed_unsync(),
        watch,
        cfg.idle_timeout,
    );
    Response::from_parts(rparts, body)
}

/// A 2xx's usage, read as it goes by. An injected stream loses on its way
/// what the option added, whatever the upstream's encoding: a stream
/// compressed though asked not to be is decoded and leaves uncompressed;
/// one in a coding tidemark cannot read goes as it came.
fn read_usage(cx: &Ctx<'_>, h: &mut HeaderMap, watch: &mut Watch) {
    let p = cx.p;
    let ct = h.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let ce = h.get(CONTENT_ENCODING).and_then(|v| v.to_str().ok());
    watch.reader = Some(UsageReader::new(p, p.framing(ct, cx.stream), ce));
    if !cx.injected {
        return;
    }
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
        h.remove(CONTENT_LENGTH);
    }
    if decoder.is_some() {
        h.remove(CONTENT_ENCODING);
        watch.decoder = decoder;
    }
}

/// The callback the tap fires once when the response ends: the response's
/// usage is recorded. `learn_at`: the upstream's name, where a refusal may
/// teach its window or an answer unteach it.
fn recorder(
    state: &Local,
    api: Api,
    status: u16,
    (turn, model): (Turn, Option<String>),
    learn_at: Option<String>,
) -> Box<dyn FnOnce(Finish) + Send> {
    // The callback outlives this request's borrow of the state.
    let state = state.clone();
    Box::new(move |f: Finish| {
        turn.series.count_request(status);
        let read = f.read.unwrap_or_default();
        if read.parse_errors > 0 {
            let m = metrics::get();
            m.usage_parse_errors
                .with_label_values(&[api.as_str()])
                .inc();
        }
        let mut observed = read.observed;
        if let Some(up) = learn_at.as_deref() {
            let model = model.as_deref();
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
        record(&state, turn, status, f.completed, observed);
    })
}
