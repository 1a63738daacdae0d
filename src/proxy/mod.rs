//! The spine: a request's life as named phases over one per-request
//! context ([`ctx::Ctx`]), in order — route ([`handle`]), read, identify,
//! estimate, project, decide (`phases.rs`), send (`send.rs`), tap and
//! record (`tap.rs`). What a WebSocket turn shares with it (identify,
//! estimate, project, record; errors mapped to responses; the state) sits
//! below both, in `turn/`.
//!
//! - `ctx.rs`: the context, and forward-first's one combinator
//!   ([`ctx::meanwhile`]).
//! - `body.rs`: the body read whole, capped, decoded for inspection.
//! - `count.rs`: `--exact-cold-start`.
//! - `respond.rs`: what tidemark answers itself, and the projection headers.
use std::convert::Infallible;
use std::time::Instant;

use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::config::Upstream;
use crate::json::RequestView;
use crate::provider::{self, Provider};
use crate::tap::ObservedBody;
use crate::turn::outgoing::full;
use crate::turn::shape_provider;

mod body;
mod count;
mod ctx;
mod phases;
mod respond;
mod send;
mod tap;

use ctx::Ctx;
use respond::Ending;

pub use crate::turn::{error_response, Local, ProxyError, State};

/// route: which upstream (the longest `--route` prefix), and is this an
/// API tidemark understands? Every request passes here.
pub async fn handle(
    state: Local,
    req: Request<Incoming>,
) -> Result<Response<ObservedBody>, Infallible> {
    let start = Instant::now();
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
        // Not read: its body streams through.
        let (parts, body) = req.into_parts();
        let shape = shape_provider(parts.uri.path());
        let body = body.boxed_unsync();
        let off = (shape, "other");
        return Ok(send::untouched(&state, parts, body, upstream, off, start).await);
    };
    Ok(api_request(&state, req, p, upstream, start).await)
}

/// A request on a recognised API: its phases, top to bottom.
async fn api_request(
    state: &Local,
    req: Request<Incoming>,
    p: &'static dyn Provider,
    upstream: &Upstream,
    start: Instant,
) -> Response<ObservedBody> {
    let (parts, body) = req.into_parts();
    let mut cx = Ctx::new(state, p, upstream, parts, start);
    let json = match phases::read(&mut cx, body).await {
        Ok(json) => json,
        Err(err) => return cx.refuse(err),
    };
    let view = json.as_deref().and_then(RequestView::parse);
    let (Some(json), Some(view)) = (json.as_ref(), view) else {
        // Not JSON we can read: forwarded untouched, no projection.
        let (parts, body, api) = (cx.parts, full(cx.body), (p, p.api().as_str()));
        return Box::pin(send::untouched(state, parts, body, upstream, api, start)).await;
    };
    let who = phases::identify(&mut cx, &view);
    if crate::policy::settled(&state.config) {
        send::forward_first(&mut cx, &who, &view, json).await;
    }
    let estimate = phases::estimate(&mut cx, &view, json).await;
    let mut turn = phases::project(&mut cx, who, estimate, &view).await;
    if let Err(err) = phases::decide(&mut cx, &mut turn, json) {
        return respond::end(cx, turn, Ending::Error(err));
    }
    phases::cache_view(&cx, &mut turn, &view);
    match send::send(&mut cx, &view, json).await {
        Ok(resp) => tap::tap(cx, turn, resp),
        Err(ending) => respond::end(cx, turn, ending),
    }
}
