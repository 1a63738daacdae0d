//! `--exact-cold-start`: an anchor-less request's size, as the provider counts it.
use bytes::Bytes;
use http::header::{CONTENT_ENCODING, CONTENT_LENGTH};
use http::Request;
use http_body_util::{BodyExt, Limited};

use super::ctx::Ctx;
use crate::config::Upstream;
use crate::json::RequestView;
use crate::provider::Provider;
use crate::session::Begun;
use crate::turn::outgoing::full;
use crate::turn::{State, X_CONTEXT_RESET};
use crate::upstream;

/// No anchor: ask the provider's own counter, and project from its count.
/// (Not `&Ctx` across the await: a request in flight is no `Sync`.)
pub(super) async fn exact(cx: &mut Ctx<'_>, view: &RequestView<'_>, begun: &mut Begun) {
    let (state, parts, upstream, p) = (cx.state, &cx.parts, cx.upstream, cx.p);
    let Some((path, body)) = p.count_request(parts.uri.path(), view) else {
        return;
    };
    let counting = Box::pin(count_exact(state, parts, upstream, p, &path, body));
    if let Some(n) = counting.await {
        state.store.apply_count(begun, n);
    }
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
