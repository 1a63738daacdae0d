//! A real TLS upstream with a private CA (`--upstream-ca`), spoken to over
//! HTTP/2 negotiated by ALPN, plus a TLS failure classified as such.

mod support;

use std::convert::Infallible;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::*;
use tokio::net::TcpListener;

async fn tls_upstream(
    alpn: Vec<Vec<u8>>,
) -> (
    u16,
    String,
    tokio::sync::mpsc::UnboundedReceiver<http::Version>,
) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cert_pem = ck.cert.pem();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![ck.cert.der().clone()], key)
    .unwrap();
    cfg.alpn_protocols = alpn;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (vtx, vrx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let acceptor = acceptor.clone();
            let vtx = vtx.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let svc = service_fn(move |req: Request<Incoming>| {
                    let _ = vtx.send(req.version());
                    async move { Ok::<_, Infallible>(Response::new(full("secure hello"))) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), svc)
                    .await;
            });
        }
    });
    (port, cert_pem, vrx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_ca_upstream_over_http2_by_alpn() {
    let (port, pem, mut versions) = tls_upstream(vec![b"h2".to_vec(), b"http/1.1".to_vec()]).await;
    let dir = std::env::temp_dir().join(format!("tidemark-ca-{port}"));
    std::fs::create_dir_all(&dir).unwrap();
    let ca = dir.join("ca.pem");
    std::fs::write(&ca, pem).unwrap();
    let px = proxy(
        &format!("https://localhost:{port}"),
        &["--upstream-ca", ca.to_str().unwrap()],
    )
    .await;
    let c = client_h1();
    let (parts, body) = post_json(
        &c,
        &px.url("/v1/chat/completions"),
        r#"{"model":"gpt-4o","messages":[]}"#,
    )
    .await;
    assert_eq!(parts.status, 200);
    assert_eq!(body, "secure hello");
    assert_eq!(
        within(5, versions.recv()).await.unwrap(),
        http::Version::HTTP_2
    );
    // A second request reuses the pooled connection and still works.
    let (_, body) = get(&c, &px.url("/v1/models")).await;
    assert_eq!(body, "secure hello");
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_only_tls_upstream_works() {
    let (port, pem, mut versions) = tls_upstream(vec![b"http/1.1".to_vec()]).await;
    let ca = std::env::temp_dir().join(format!("tidemark-ca1-{port}.pem"));
    std::fs::write(&ca, pem).unwrap();
    let px = proxy(
        &format!("https://localhost:{port}"),
        &["--upstream-ca", ca.to_str().unwrap()],
    )
    .await;
    let (parts, _) = post_json(&client_h1(), &px.url("/v1/chat/completions"), "{}").await;
    assert_eq!(parts.status, 200);
    assert_eq!(
        within(5, versions.recv()).await.unwrap(),
        http::Version::HTTP_11
    );
    px.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_certificate_is_502_upstream_tls() {
    let (port, _pem, _v) = tls_upstream(vec![b"h2".to_vec()]).await;
    let px = proxy(&format!("https://localhost:{port}"), &[]).await;
    let (parts, body) = post_json(
        &client_h1(),
        &px.url("/v1/chat/completions"),
        r#"{"model":"gpt-4o","messages":[]}"#,
    )
    .await;
    assert_eq!(parts.status, 502);
    assert_eq!(
        parts.headers.get("x-tidemark-error").unwrap(),
        "upstream-tls"
    );
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(v["error"]["message"].is_string());
    px.stop().await;
}
