//! send: the request upstream — at once when no verdict can change it
//! (forward-first), else once decided — with the OpenAI chat usage option
//! injected, and once more without it when the upstream refuses it; and a
//! request tidemark does not read, forwarded untouched.
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Instant;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONTENT_LENGTH};
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};

use super::ctx::{Answer, Ctx, InFlight};
use super::respond::{refused, Ending};
use crate::config::Upstream;
use crate::json::RequestView;
use crate::metrics;
use crate::provider::{Api, Provider};
use crate::tap::{Finish, ObservedBody, Watch};
use crate::turn::outgoing::{build_upstream_request, full};
use crate::turn::phases::{learn_from_refusal, Identity};
use crate::turn::{ProxyError, State};
use crate::upstream::{self, UpBody, UpstreamBody, UpstreamError};

/// Forward-first: when no verdict can stop or change the request, it
/// takes its place in its session's order and goes upstream now; the
/// estimate and the session are worked out while the upstream thinks, off
/// the time to first byte. The first poll puts it on the wire (a pooled
/// connection) or starts the connect.
pub(super) async fn forward_first<'a>(
    cx: &mut Ctx<'a>,
    who: &Identity,
    view: &RequestView<'_>,
    json: &Bytes,
) {
    let (state, api) = (cx.state, cx.p.api());
    // Forwarded before it is projected, the request takes its place in the
    // session's order now, so two in flight keep the order they came in.
    // (With --state redis the order is Redis's, taken when it is asked.)
    let (key, continues) = (who.key.as_deref(), who.continues.as_deref());
    cx.order = state
        .store
        .reserve(key, who.source, &who.credential, api, continues);
    let edited = usage_injection(state, api, cx.stream, cx.upstream, json, view, None);
    let injected = edited.is_some();
    let headers = headers_to_send(&mut cx.parts.headers, injected);
    let Some(up) = outgoing(
        &cx.parts,
        headers,
        cx.upstream,
        &cx.body,
        edited.as_ref(),
        injected,
    ) else {
        return;
    };
    let sent = counted_sent(api, cx.start, injected);
    let mut sending: Pin<Box<dyn Future<Output = Answer> + Send + 'a>> =
        Box::pin(send_timed(state, up, sent));
    let first = std::future::poll_fn(|c| Poll::Ready(sending.as_mut().poll(c))).await;
    cx.in_flight = Some(InFlight {
        sending,
        first,
        edited,
        injected,
    });
}

/// send: the request upstream — the one already in flight, or now, as
/// decided (trimmed, the usage option injected) — and once more without
/// `stream_options` when the upstream refuses the option.
pub(super) async fn send(
    cx: &mut Ctx<'_>,
    view: &RequestView<'_>,
    json: &Bytes,
) -> Result<Response<UpstreamBody>, Ending> {
    let (state, api) = (cx.state, cx.p.api());
    let answer = match cx.in_flight.take() {
        Some(mut f) => {
            cx.edited = f.edited.take();
            cx.injected = f.injected;
            f.land().await
        }
        None => {
            let edited = cx.edited.as_ref();
            if let Some(b) = usage_injection(state, api, cx.stream, cx.upstream, json, view, edited)
            {
                cx.edited = Some(b);
                cx.injected = true;
            }
            let headers = headers_to_send(&mut cx.parts.headers, cx.injected);
            let edited = cx.edited.as_ref();
            let Some(up) = outgoing(
                &cx.parts,
                headers,
                cx.upstream,
                &cx.body,
                edited,
                cx.injected,
            ) else {
                return Err(Ending::Error(ProxyError::ClientBody));
            };
            let sent = counted_sent(api, cx.start, cx.injected);
            send_timed(state, up, sent).await
        }
    };
    let answer = match cx.injected {
        true => without_option(cx, answer).await?,
        false => answer,
    };
    answer.map_err(|e| {
        let m = metrics::get();
        m.upstream_errors
            .with_label_values(&[e.metric_kind()])
            .inc();
        Ending::Error(ProxyError::Upstream(e))
    })
}

/// An upstream that refuses `stream_options` gets the request again
/// without it, once (and never the option again). Any other 400 has been
/// read whole by then: it is answered as it came, what it teaches learned.
async fn without_option(cx: &mut Ctx<'_>, answer: Answer) -> Result<Answer, Ending> {
    let resp = match answer {
        Ok(r) if r.status() == StatusCode::BAD_REQUEST => r,
        other => return Ok(other),
    };
    let (rparts, rbody) = resp.into_parts();
    let bytes = Limited::new(rbody, 1 << 20)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let state = cx.state;
    if !crate::tap::inject::mentions_stream_options(&bytes) {
        let up = crate::window::learned::upstream_id(cx.upstream);
        let status = rparts.status.as_u16();
        let model = cx.model.as_deref();
        let refused_prompt = learn_from_refusal(state, cx.p, status, &bytes, &up, model);
        let mut resp = Response::from_parts(rparts, ObservedBody::full(bytes));
        resp.headers_mut().remove(CONTENT_LENGTH);
        return Err(Ending::Buffered {
            resp: Box::new(resp),
            refused_prompt,
        });
    }
    let authority = cx.upstream.authority.as_str().to_string();
    state.no_stream_options.insert(authority);
    cx.injected = false;
    cx.edited = cx.trimmed_body.clone();
    let retry = cx.edited.clone().unwrap_or_else(|| cx.body.clone());
    let headers = std::mem::take(&mut cx.parts.headers);
    let edited = cx.edited.is_some();
    match build_upstream_request(&cx.parts, headers, cx.upstream, full(retry), edited) {
        Some(up) => Ok(Box::pin(send_timed(state, up, Instant::now())).await),
        None => Err(Ending::Error(ProxyError::ClientBody)),
    }
}

/// A request tidemark does not read — off the APIs it knows, or a body
/// that is not JSON — forwarded untouched: its body streams through, its
/// response is counted under `api`, an error is answered in `shape`'s form.
pub(super) async fn untouched(
    state: &State,
    mut parts: http::request::Parts,
    body: UpBody,
    upstream: &Upstream,
    (shape, api): (&dyn Provider, &'static str),
    start: Instant,
) -> Response<ObservedBody> {
    let m = metrics::get();
    let headers = std::mem::take(&mut parts.headers);
    let Some(up) = build_upstream_request(&parts, headers, upstream, body, false) else {
        return refused(state, shape, api, ProxyError::ClientBody, start);
    };
    let sent = Instant::now();
    m.api(api)
        .proxy_overhead()
        .observe(sent.saturating_duration_since(start).as_secs_f64());
    match send_timed(state, up, sent).await {
        Ok(resp) => {
            let code = resp.status().as_u16();
            let (mut parts, body) = resp.into_parts();
            upstream::strip_hop_by_hop(&mut parts.headers);
            let mut watch = Watch::new(start);
            let series = m.series(api, None);
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
            refused(state, shape, api, ProxyError::Upstream(e), start)
        }
    }
}

/// Send upstream, bounded by `--upstream-timeout` from `sent` (now, as the
/// caller last read the clock) to the response headers.
async fn send_timed(
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
    let wanted = stream && state.config.inject_usage && api.provider().usage_on_request();
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
