//! The request as it goes upstream: same method, the path under the
//! upstream's prefix, the client's headers minus hop-by-hop ones.
use bytes::Bytes;
use http::header::{HeaderMap, CONTENT_ENCODING, CONTENT_LENGTH};
use http::Request;
use http_body_util::{BodyExt, Full};

use super::X_CONTEXT_RESET;
use crate::config::Upstream;
use crate::upstream::{self, UpBody};

/// The upstream request: same method, path under the upstream's prefix, query
/// kept, headers minus hop-by-hop and `Host` (the client sets the upstream's).
pub fn build_upstream_request(
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

/// A body tidemark holds whole.
pub fn full(b: Bytes) -> UpBody {
    Full::new(b).map_err(|e| match e {}).boxed_unsync()
}
