//! Sessions as the admin API and the next request see them (SPEC §4, §6),
//! with this process's memory as the store: idle expiry however lazily
//! memory is reclaimed, and `DELETE /sessions/{key}?credential=HASH`.
//! (The same with Redis and two replicas: `redis_replicas.rs`.)
mod support;

use std::time::Duration;

use http::Request;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use support::{client_h1, full, send, Proxy, TestClient};
use tidemark::sim::{self, SimApi, SimConfig};

async fn start_sim() -> (String, support::Sim) {
    tokio::task::spawn_blocking(|| sim::count_prompt(SimApi::Anthropic, &turn(1)))
        .await
        .unwrap();
    let s = support::sim(SimConfig::default()).await;
    (s.url.clone(), s)
}

fn turn(t: u64) -> Value {
    let mut messages = Vec::new();
    for i in 1..=t {
        let text: String = (0..40 + i * 13).map(|w| format!("w{w}x{i} ")).collect();
        messages.push(json!({"role": "user", "content": text}));
        if i < t {
            messages.push(json!({"role": "assistant", "content": format!("ok {i}")}));
        }
    }
    json!({"model": "claude-sonnet-4-5", "max_tokens": 32, "system": "Be terse.", "messages": messages})
}

/// The `src` of the projection.
async fn ask(c: &TestClient, px: &Proxy, key: &str, api_key: &str, body: &Value) -> String {
    let req = Request::post(px.url("/v1/messages"))
        .header("content-type", "application/json")
        .header("x-api-key", api_key)
        .header("x-session-id", key)
        .body(full(body.to_string()))
        .unwrap();
    let (parts, _) = send(c, req).await;
    assert_eq!(parts.status, 200);
    let h = parts.headers["x-context-projection"].to_str().unwrap();
    h.split(';')
        .find_map(|p| p.strip_prefix("src="))
        .unwrap()
        .to_string()
}

async fn admin(c: &TestClient, px: &Proxy, method: &str, path: &str) -> (u16, Value) {
    let req = Request::builder()
        .method(method)
        .uri(px.admin_url(path))
        .body(full(""))
        .unwrap();
    let (parts, body) = send(c, req).await;
    (
        parts.status.as_u16(),
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}

/// The `credential` a session object shows for an API key.
fn hash(api_key: &str) -> String {
    Sha256::digest(api_key.as_bytes())[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A session idle longer than `--session-ttl` is gone: `GET` answers 404
/// and its next request is a first request, although the sweeper (every
/// 5 s) has not run yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_is_gone_however_lazily_memory_is_reclaimed() {
    let (sim, _stop) = start_sim().await;
    let route = format!("/v1/messages={sim}");
    let px = support::proxy(&sim, &["--route", &route, "--session-ttl", "1s"]).await;
    let c = client_h1();
    let key = "idle-1";
    ask(&c, &px, key, "sk-idle", &turn(1)).await;
    assert_eq!(ask(&c, &px, key, "sk-idle", &turn(2)).await, "anchored");
    assert_eq!(admin(&c, &px, "GET", "/sessions/idle-1").await.0, 200);
    // The TTL passing is the point here, not a wait for another task.
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    let (status, body) = admin(&c, &px, "GET", "/sessions/idle-1").await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(admin(&c, &px, "GET", "/sessions").await.1["total"], 0);
    assert_eq!(admin(&c, &px, "DELETE", "/sessions/idle-1").await.0, 404);
    let src = ask(&c, &px, key, "sk-idle", &turn(3)).await;
    assert_ne!(src, "anchored", "a first request again");
    assert_ne!(src, "lost");
    let (_, s) = admin(&c, &px, "GET", "/sessions/idle-1").await;
    assert_eq!(s["turns"], 1, "{s}");
    px.stop().await;
}

/// The same key under two credentials is two sessions; a `DELETE` that
/// names one credential drops only that one's anchor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_with_a_credential_drops_only_that_credentials_session() {
    let (sim, _stop) = start_sim().await;
    let route = format!("/v1/messages={sim}");
    let px = support::proxy(&sim, &["--route", &route]).await;
    let c = client_h1();
    let key = "shared-key";
    for t in 1..=2 {
        for api_key in ["sk-one", "sk-two"] {
            ask(&c, &px, key, api_key, &turn(t)).await;
        }
    }
    let path = format!("/sessions/{key}?credential={}", hash("sk-one"));
    let (status, _) = admin(&c, &px, "DELETE", &path).await;
    assert_eq!(status, 200);
    let (_, one) = admin(&c, &px, "GET", &path).await;
    assert!(one["anchor"].is_null(), "{one}");
    let (_, two) = admin(
        &c,
        &px,
        "GET",
        &format!("/sessions/{key}?credential={}", hash("sk-two")),
    )
    .await;
    assert!(!two["anchor"].is_null(), "the other credential's: {two}");
    assert_eq!(ask(&c, &px, key, "sk-two", &turn(3)).await, "anchored");
    assert_eq!(ask(&c, &px, key, "sk-one", &turn(3)).await, "calibrated");
    // A credential the key is not held under: nothing to drop.
    let (status, _) = admin(
        &c,
        &px,
        "DELETE",
        &format!("/sessions/{key}?credential=00000000"),
    )
    .await;
    assert_eq!(status, 404);
    px.stop().await;
}
