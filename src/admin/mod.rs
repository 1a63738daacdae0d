//! The admin listener's answers: `/healthz`, `/readyz`, `/metrics`,
//! `/sessions`, `/sessions/{key}` and the sessions page at `/` (`page.rs`).
//! `server.rs` accepts the connections and hands each request here.

pub mod page;

use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::metrics;
use crate::proxy::State;
use crate::tap::ObservedBody;

fn json(status: StatusCode, v: &serde_json::Value) -> Response<ObservedBody> {
    let mut r = Response::new(ObservedBody::full(
        serde_json::to_vec(v).unwrap_or_default(),
    ));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn text(status: StatusCode, s: &'static str) -> Response<ObservedBody> {
    let mut r = Response::new(ObservedBody::full(Bytes::from_static(s.as_bytes())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Compare without leaking the position of the first difference through timing.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | ((a.len() ^ b.len()) >> 8) as u8;
    for (i, x) in a.iter().enumerate() {
        let y = b.get(i % b.len().max(1)).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    diff == 0 && a.len() == b.len()
}

pub(crate) fn percent_decode(s: &str) -> String {
    fn hex(c: u8) -> Option<u8> {
        (c as char).to_digit(16).map(|d| d as u8)
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while let Some(&c) = b.get(i) {
        if c == b'%' {
            if let (Some(h), Some(l)) = (
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            ) {
                out.push(h << 4 | l);
                i += 3;
                continue;
            }
        }
        out.push(c);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(crate) fn query_param<'a>(query: Option<&'a str>, name: &str) -> Option<&'a str> {
    query?.split('&').find_map(|kv| {
        kv.split_once('=')
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| v)
    })
}

/// `Authorization: Bearer TOKEN` with the `--admin-token`.
pub(crate) fn bearer_matches(headers: &http::HeaderMap, token: &str) -> bool {
    let given = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    constant_time_eq(given.as_bytes(), token.as_bytes())
}

/// The admin API: `/healthz`, `/readyz`, `/metrics`, `/sessions`,
/// `/sessions/{key}`, and the sessions page at `/` (`admin/page.rs`, which
/// checks the token its own way: a browser gets a page, not JSON).
pub async fn handle(state: &State, req: Request<Incoming>) -> Response<ObservedBody> {
    let path = req.uri().path();
    if path == "/healthz" {
        return text(StatusCode::OK, "ok\n");
    }
    if path == "/" {
        return page::serve(state, req).await;
    }
    if let Some(token) = &state.config.admin_token {
        if !bearer_matches(req.headers(), token) && !page::cookie_grants(&req, token) {
            let mut r = json(
                StatusCode::UNAUTHORIZED,
                &serde_json::json!({"error": "admin token required"}),
            );
            r.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer"),
            );
            return r;
        }
    }
    let query = req.uri().query();
    match (req.method(), path) {
        (&Method::GET, "/readyz") => match state.store.backend() {
            Some(r) if !r.healthy() => {
                let mut resp = Response::new(ObservedBody::full(format!(
                    "not ready: state backend redis {} unreachable (serving from local state)\n",
                    r.target()
                )));
                *resp.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
                resp.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; charset=utf-8"),
                );
                resp
            }
            _ => text(StatusCode::OK, "ready\n"),
        },
        (&Method::GET, "/metrics") => {
            let mut r = Response::new(ObservedBody::full(metrics::get().render()));
            r.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            r
        }
        (&Method::GET, "/sessions") => {
            let limit = query_param(query, "limit")
                .and_then(|v| v.parse().ok())
                .unwrap_or(100usize)
                .min(10_000);
            json(StatusCode::OK, &state.store.list(limit).await)
        }
        (m, p) if p.starts_with("/sessions/") => {
            let key = percent_decode(&p["/sessions/".len()..]);
            let credential = query_param(query, "credential");
            match *m {
                Method::GET => match state.store.get(&key, credential).await {
                    Some(v) => json(StatusCode::OK, &v),
                    None => json(
                        StatusCode::NOT_FOUND,
                        &serde_json::json!({"error": "no such session"}),
                    ),
                },
                // With `?credential=HASH`, only that credential's session;
                // with --state redis, in Redis too.
                Method::DELETE => match state.store.delete(&key, credential).await {
                    true => json(StatusCode::OK, &serde_json::json!({"reset": true})),
                    false => json(
                        StatusCode::NOT_FOUND,
                        &serde_json::json!({"error": "no such session"}),
                    ),
                },
                _ => text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n"),
            }
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_works() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("fp%3Aabc"), "fp:abc");
        assert_eq!(percent_decode("a%2"), "a%2");
        assert_eq!(percent_decode("plain"), "plain");
    }
}
