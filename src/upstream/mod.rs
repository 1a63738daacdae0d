//! The one pooled upstream client (rustls, HTTP/2 by ALPN), hop-by-hop header
//! handling, and the classification of upstream failures.

mod h1;
mod pool;

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION};
use http_body_util::combinators::UnsyncBoxBody;
use hyper_rustls::{HttpsConnector, MaybeHttpsStream};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use crate::config::Config;

/// The error of a response body, upstream's or the tap's around it.
pub type BoxError = Box<dyn StdError + Send + Sync>;

/// Request bodies sent upstream: the inspected bytes, or the client's stream.
pub type UpBody = UnsyncBoxBody<Bytes, hyper::Error>;

pub use pool::{set_worker, Client, Upgrade, UpstreamBody};

/// Why an upstream exchange failed; each maps to a status and an
/// `x-tidemark-error` kind in `proxy.rs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamError {
    Connect,
    Tls,
    Reset,
    Timeout,
}

impl UpstreamError {
    /// The `tidemark_upstream_errors_total{kind}` label.
    pub fn metric_kind(self) -> &'static str {
        match self {
            UpstreamError::Connect => "connect",
            UpstreamError::Tls => "tls",
            UpstreamError::Reset => "reset",
            UpstreamError::Timeout => "timeout",
        }
    }
    /// The `x-tidemark-error` value.
    pub fn header_kind(self) -> &'static str {
        match self {
            UpstreamError::Connect => "upstream-connect",
            UpstreamError::Tls => "upstream-tls",
            UpstreamError::Reset => "upstream-reset",
            UpstreamError::Timeout => "upstream-timeout",
        }
    }

    /// Classify a failed exchange by walking its error's source chain
    /// (through the errors that `io::Error`s wrap, which `source()` skips):
    /// TLS, a timeout, a refused connect, or else a failed connect (while
    /// `connecting`) or a reset.
    pub fn classify(e: &(dyn StdError + 'static), connecting: bool) -> UpstreamError {
        fn walk(
            e: &(dyn StdError + 'static),
            tls: &mut bool,
            timeout: &mut bool,
            connect: &mut bool,
            depth: u8,
        ) {
            if depth > 16 {
                return;
            }
            if e.downcast_ref::<rustls::Error>().is_some() {
                *tls = true;
            }
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                use std::io::ErrorKind::*;
                match io.kind() {
                    TimedOut => *timeout = true,
                    ConnectionRefused | AddrNotAvailable | HostUnreachable | NetworkUnreachable => {
                        *connect = true
                    }
                    _ => {}
                }
                if let Some(inner) = io.get_ref() {
                    walk(inner, tls, timeout, connect, depth + 1);
                }
            }
            if let Some(s) = e.source() {
                walk(s, tls, timeout, connect, depth + 1);
            }
        }
        let (mut tls, mut timeout, mut connect) = (false, false, false);
        walk(e, &mut tls, &mut timeout, &mut connect, 0);
        if tls {
            UpstreamError::Tls
        } else if timeout {
            UpstreamError::Timeout
        } else if connect || connecting {
            UpstreamError::Connect
        } else {
            UpstreamError::Reset
        }
    }
}

/// Wraps the HTTPS connector so that TCP connect plus TLS handshake together
/// respect `--connect-timeout`.
#[derive(Clone)]
pub struct TimedConnector {
    inner: HttpsConnector<HttpConnector>,
    timeout: Duration,
}

impl tower_service::Service<http::Uri> for TimedConnector {
    type Response = MaybeHttpsStream<TokioIo<TcpStream>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let fut = self.inner.call(uri);
        let t = self.timeout;
        Box::pin(async move {
            match tokio::time::timeout(t, fut).await {
                Ok(r) => r,
                Err(_) => Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "upstream connect timed out",
                )) as BoxError),
            }
        })
    }
}

/// Build the shared client: webpki roots plus `--upstream-ca`, HTTP/1.1 and
/// HTTP/2 offered by ALPN, keep-alive pooling.
pub fn client(config: &Config) -> Result<Client, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &config.upstream_ca {
        let pem =
            std::fs::read(path).map_err(|e| format!("--upstream-ca {}: {e}", path.display()))?;
        let mut n = 0;
        for cert in rustls_pemfile::certs(&mut pem.as_slice()) {
            let cert = cert.map_err(|e| format!("--upstream-ca {}: {e}", path.display()))?;
            roots
                .add(cert)
                .map_err(|e| format!("--upstream-ca {}: {e}", path.display()))?;
            n += 1;
        }
        if n == 0 {
            return Err(format!(
                "--upstream-ca {}: no PEM certificate found",
                path.display()
            ));
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(config.connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(60)));
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls.clone())
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http.clone());
    let connector = TimedConnector {
        inner: https,
        timeout: config.connect_timeout,
    };
    // Upgrades (WebSocket) speak HTTP/1.1 whatever the upstream prefers.
    let https_h1 = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    let connector_h1 = TimedConnector {
        inner: https_h1,
        timeout: config.connect_timeout,
    };
    Ok(Client::new(
        connector,
        connector_h1,
        config.workers,
        256,
        Duration::from_secs(90),
    ))
}

/// Whether `name` is hop-by-hop (RFC 9110 §7.6.1 and the classic RFC 2616
/// list): one match on the name's text (its length, then its bytes), so a
/// header that is not hop-by-hop is told so in a comparison or two, not
/// one per listed name.
///
/// `Proxy-Authorization` and `Proxy-Authenticate` are not on it: they are
/// meant for the proxy that consumes them, and tidemark authenticates no
/// one, so they pass like every other credential (an egress gateway behind
/// tidemark may be the proxy that reads them).
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// Remove hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass over the names, no removals (each
    // of which would hash and probe the map).
    if !headers.keys().any(is_hop_by_hop) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        headers.remove(n);
    }
    let hop: Vec<HeaderName> = headers
        .keys()
        .filter(|k| is_hop_by_hop(k))
        .cloned()
        .collect();
    for h in hop {
        headers.remove(h);
    }
}

/// `Host` for an upstream authority.
pub fn host_value(authority: &http::uri::Authority) -> Option<HeaderValue> {
    HeaderValue::from_str(authority.as_str()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_match_names_exactly_the_hop_by_hop_list() {
        let list = [
            "connection",
            "keep-alive",
            "proxy-connection",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
        ];
        for h in list {
            assert!(is_hop_by_hop(&HeaderName::from_static(h)), "{h}");
        }
        for h in [
            "content-length",
            "authorization",
            "x-te",
            "tee",
            "keep-alive2",
            "connectio",
            "proxy-authorization",
            "proxy-authenticate",
            "retry-after",
            "x-ratelimit-remaining-requests",
        ] {
            let h = HeaderName::from_static(h);
            assert_eq!(is_hop_by_hop(&h), list.contains(&h.as_str()), "{h}");
        }
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named() {
        let mut h = HeaderMap::new();
        h.insert(
            "connection",
            HeaderValue::from_static("keep-alive, x-private"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-private", HeaderValue::from_static("1"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        h.insert("retry-after", HeaderValue::from_static("3"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 2);
        assert!(h.contains_key("authorization") && h.contains_key("retry-after"));
    }
}
