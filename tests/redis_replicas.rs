//! `--state redis://`: two tidemark replicas in front of the simulated
//! provider share one session's anchor, order and budget through a real
//! `redis-server` that each test starts on a free port.

mod support;
use support::Sim;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::redis::Server;
use support::{client_h1, get, post, send, Proxy, TestClient};
use tidemark::sim::{self, SimConfig};

/// The simulated provider, its tokenizer loaded before any request waits on it.
async fn start_sim() -> Sim {
    // Load the sim's tokenizer before any request waits on it.
    tokio::task::spawn_blocking(|| sim::count_prompt(sim::SimApi::Anthropic, &turn(1)))
        .await
        .unwrap();
    support::sim(SimConfig::default()).await
}

async fn replicas(sim: &Sim, server: &Server, extra: &[&str]) -> (Proxy, Proxy) {
    let url = server.url();
    let route = format!("/v1/messages={}", sim.url);
    let mut args = vec!["--state", url.as_str(), "--route", route.as_str()];
    args.extend_from_slice(extra);
    let a = support::proxy(&sim.url, &args).await;
    let b = support::proxy(&sim.url, &args).await;
    let c = client_h1();
    for p in [&a, &b] {
        wait_ready(&c, p, 200).await;
    }
    (a, b)
}

/// Bounded polling of `/readyz` until it answers `status`; returns the body.
async fn wait_ready(c: &TestClient, p: &Proxy, status: u16) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (parts, body) = get(c, &p.admin_url("/readyz")).await;
        if parts.status.as_u16() == status {
            return String::from_utf8_lossy(&body).into_owned();
        }
        assert!(
            Instant::now() < deadline,
            "/readyz did not answer {status} within 15 s (last {})",
            parts.status
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Turn `t` of a conversation: every earlier turn plus a new user message of
/// uneven size (some small, some a big tool-result-like paste).
fn turn(t: u64) -> Value {
    let mut messages = Vec::new();
    for i in 1..=t {
        let words = 20 + (i * 7919) % 400;
        let text: String = (0..words)
            .map(|w| format!("w{}x{} ", (w * 31 + i * 17) % 997, i))
            .collect();
        messages.push(json!({"role": "user", "content": text}));
        if i < t {
            messages.push(json!({"role": "assistant", "content": format!("noted {i}: ok, continuing with the plan.")}));
        }
    }
    json!({"model": "claude-sonnet-4-5", "max_tokens": 64, "system": "You are terse.", "messages": messages})
}

struct Answer {
    status: u16,
    projection: String,
    /// The provider's real prompt count (input plus cache reads and writes).
    real: u64,
}

impl Answer {
    fn tokens(&self) -> u64 {
        self.projection
            .split(';')
            .next()
            .and_then(|n| n.parse().ok())
            .expect("projection tokens")
    }
    fn has(&self, param: &str) -> bool {
        self.projection.split(';').any(|p| p == param)
    }
}

async fn ask(c: &TestClient, p: &Proxy, session: &str, body: &Value) -> Answer {
    ask_as(c, p, session, "sk-ant-replica-test", body).await
}

async fn ask_as(c: &TestClient, p: &Proxy, session: &str, api_key: &str, body: &Value) -> Answer {
    let req = post(&p.url("/v1/messages"), body.to_string())
        .header("x-api-key", api_key)
        .header("anthropic-version", "2023-06-01")
        .header("x-session-id", session)
        .body(support::full(body.to_string()))
        .unwrap();
    let (parts, bytes) = send(c, req).await;
    let projection = parts
        .headers
        .get("x-context-projection")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if parts.status != 200 {
        eprintln!("{} {}", parts.status, String::from_utf8_lossy(&bytes));
    }
    let u = &v["usage"];
    let n = |k: &str| u[k].as_u64().unwrap_or(0);
    Answer {
        status: parts.status.as_u16(),
        projection,
        real: n("input_tokens") + n("cache_read_input_tokens") + n("cache_creation_input_tokens"),
    }
}

async fn raw(server: &Server) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection")
}

/// The Redis key of `session` with this suffix (`seq`, `rec`, `spend`), if
/// it exists yet (write-backs land off the response path).
async fn find_key(
    conn: &mut redis::aio::MultiplexedConnection,
    session: &str,
    part: &str,
) -> Option<String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("tidemark:v2:{{*:{session}}}:{part}"))
        .query_async(conn)
        .await
        .expect("KEYS");
    assert!(keys.len() <= 1, "one {part} key for {session}: {keys:?}");
    keys.into_iter().next()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alternating_replicas_stay_anchored_and_continuous() {
    let server = Server::start();
    let sim = start_sim().await;
    let (a, b) = replicas(&sim, &server, &[]).await;
    // One process with memory state: what the replicas together must match.
    let route = format!("/v1/messages={}", sim.url);
    let single = support::proxy(&sim.url, &["--route", &route]).await;
    let c = client_h1();
    let mut conn = raw(&server).await;
    for t in 1..=14u64 {
        let p = if t % 2 == 1 { &a } else { &b };
        let r = ask(&c, p, "alt-1", &turn(t)).await;
        // The write-back is off the response path: the next turn, on the
        // other replica, starts once this one's record is in Redis.
        written_back(&mut conn, "alt-1").await;
        let one = ask(&c, &single, "alt-1", &turn(t)).await;
        assert_eq!(r.status, 200, "turn {t}");
        assert!(!r.has("state=local"), "turn {t}: {}", r.projection);
        assert_eq!(
            r.tokens(),
            one.tokens(),
            "turn {t}: two replicas project as one process does"
        );
        if t >= 2 {
            assert!(r.has("src=anchored"), "turn {t}: {}", r.projection);
        }
        if t >= 3 {
            // Turn 2 has learned no ratio yet (one process neither).
            let err = (r.tokens() as f64 - r.real as f64).abs() / r.real as f64;
            assert!(
                err < 0.01,
                "turn {t}: projected {} real {} ({:.2}%)",
                r.tokens(),
                r.real,
                err * 100.0
            );
        }
    }
    // A replica that never saw the session before projects it anchored too.
    let route = format!("/v1/messages={}", sim.url);
    let fresh = support::proxy(&sim.url, &["--state", &server.url(), "--route", &route]).await;
    wait_ready(&c, &fresh, 200).await;
    let r = ask(&c, &fresh, "alt-1", &turn(15)).await;
    assert!(r.has("src=anchored"), "{}", r.projection);
    written_back(&mut conn, "alt-1").await;

    // DELETE on one replica drops the anchor for the other too.
    let del = http::Request::delete(a.admin_url("/sessions/alt-1"))
        .body(support::full(""))
        .unwrap();
    let (parts, _) = send(&c, del).await;
    assert_eq!(parts.status, 200);
    let r = ask(&c, &b, "alt-1", &turn(16)).await;
    assert!(!r.has("src=anchored"), "after DELETE: {}", r.projection);
    written_back(&mut conn, "alt-1").await;
    let r = ask(&c, &a, "alt-1", &turn(17)).await;
    assert!(r.has("src=anchored"), "re-anchored: {}", r.projection);
    for p in [a, b, fresh, single] {
        p.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_mid_session_serves_locally_then_shares_again() {
    let mut server = Server::start();
    let sim = start_sim().await;
    let (a, b) = replicas(&sim, &server, &[]).await;
    let c = client_h1();
    let mut t = 0;
    let next = |t: &mut u64| {
        *t += 1;
        turn(*t)
    };
    for _ in 0..4 {
        let p = if t % 2 == 0 { &a } else { &b };
        let r = ask(&c, p, "restart-1", &next(&mut t)).await;
        assert_eq!(r.status, 200);
        assert!(!r.has("state=local"), "{}", r.projection);
    }
    let errors_before = tidemark::metrics::get().state_errors.get();

    server.kill();
    for i in 0..4 {
        let p = if i % 2 == 0 { &a } else { &b };
        let r = ask(&c, p, "restart-1", &next(&mut t)).await;
        assert_eq!(r.status, 200, "requests still proxy while Redis is down");
        assert!(r.has("state=local"), "{}", r.projection);
        assert!(r.has("src=anchored"), "local anchor: {}", r.projection);
        // SPEC-compatible order: the tokens, src, then the state parameter.
        let parts: Vec<&str> = r.projection.split(';').collect();
        assert!(parts[1].starts_with("src="), "{}", r.projection);
        assert_eq!(parts[2], "state=local", "{}", r.projection);
    }
    for p in [&a, &b] {
        let body = wait_ready(&c, p, 503).await;
        assert!(body.contains("state backend"), "{body}");
        assert!(
            body.contains(&format!("127.0.0.1:{}", server.port)),
            "{body}"
        );
    }
    assert!(tidemark::metrics::get().state_errors.get() > errors_before);

    server.spawn();
    for p in [&a, &b] {
        wait_ready(&c, p, 200).await;
    }
    for i in 0..4 {
        let p = if i % 2 == 0 { &a } else { &b };
        let r = ask(&c, p, "restart-1", &next(&mut t)).await;
        assert_eq!(r.status, 200);
        assert!(!r.has("state=local"), "{}", r.projection);
        assert!(r.has("src=anchored"), "{}", r.projection);
        let err = (r.tokens() as f64 - r.real as f64).abs() / r.real as f64;
        assert!(err < 0.01, "projected {} real {}", r.tokens(), r.real);
    }
    // And the record is back in Redis.
    let mut conn = raw(&server).await;
    written_back(&mut conn, "restart-1").await;
    for p in [a, b] {
        p.stop().await;
    }
}

/// Bounded wait until the session's newest request has its record in Redis
/// (the record's sequence is the session's counter). The record is the last
/// thing a write-back stores, so that response's spend and the model's
/// calibration are in too.
async fn written_back(conn: &mut redis::aio::MultiplexedConnection, session: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, anchor, counter) = stored(conn, session).await;
        if s == counter && anchor > 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{session}: record s={s} (anchor of {anchor}) not the newest request's ({counter}) within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The sequence the newest lane was stored at, that lane's anchor's
/// sequence, and the session's counter. All zero while the keys are not
/// there yet.
async fn stored(conn: &mut redis::aio::MultiplexedConnection, session: &str) -> (u64, u64, u64) {
    let (Some(rec), Some(seq)) = (
        find_key(conn, session, "rec").await,
        find_key(conn, session, "seq").await,
    ) else {
        return (0, 0, 0);
    };
    let fields: std::collections::HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(&rec)
        .query_async(conn)
        .await
        .unwrap();
    let counter: u64 = redis::cmd("GET").arg(&seq).query_async(conn).await.unwrap();
    let newest = fields
        .iter()
        .filter_map(|(k, v)| {
            let lane = k.strip_prefix("s:")?;
            let s: u64 = std::str::from_utf8(v).ok()?.parse().ok()?;
            Some((s, lane.to_string()))
        })
        .max();
    let Some((s, lane)) = newest else {
        return (0, 0, counter);
    };
    let v: Value = fields
        .get(&format!("l:{lane}"))
        .and_then(|d| serde_json::from_slice(d).ok())
        .unwrap_or(Value::Null);
    (s, v["anchor"]["seq"].as_u64().unwrap_or(0), counter)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_requests_keep_the_newest_anchor() {
    let server = Server::start();
    let sim = start_sim().await;
    let (a, b) = replicas(&sim, &server, &[]).await;
    let c = client_h1();
    let mut conn = raw(&server).await;
    for round in 0..3u64 {
        let body = turn(3 + round);
        let mut tasks = Vec::new();
        for i in 0..16 {
            let url = if i % 2 == 0 { a.url("") } else { b.url("") };
            let (c, body) = (c.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                let req = post(&format!("{url}/v1/messages"), body.to_string())
                    .header("x-api-key", "sk-ant-replica-test")
                    .header("anthropic-version", "2023-06-01")
                    .header("x-session-id", "race-1")
                    .body(support::full(body.to_string()))
                    .unwrap();
                send(&c, req).await.0.status.as_u16()
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 200);
        }
        // The stores land off the response path: bounded polling until the
        // newest request's record is the stored one.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (s, anchor, counter) = stored(&mut conn, "race-1").await;
            if s == counter && anchor == counter {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: stored record s={s} anchor seq={anchor}, newest request {counter}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // And both replicas project from it.
        for p in [&a, &b] {
            let r = ask(&c, p, "race-1", &body).await;
            assert!(r.has("src=anchored"), "{}", r.projection);
            assert_eq!(r.tokens(), r.real, "same body: the anchor itself");
        }
    }
    for p in [a, b] {
        p.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_budget_counts_spend_from_every_replica() {
    let server = Server::start();
    let sim = start_sim().await;
    // What one request of this body costs, asked of the sim directly.
    let c = client_h1();
    let body = turn(4);
    let req = post(&format!("{}/v1/messages", sim.url), body.to_string())
        .header("x-api-key", "sk-ant-replica-test")
        .header("anthropic-version", "2023-06-01")
        .body(support::full(body.to_string()))
        .unwrap();
    let (_, bytes) = send(&c, req).await;
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    let u = &v["usage"];
    let n = |k: &str| u[k].as_u64().unwrap_or(0);
    let one = n("input_tokens")
        + n("cache_read_input_tokens")
        + n("cache_creation_input_tokens")
        + n("output_tokens");
    assert!(one > 100);
    // Eight requests fit; the ninth, on either replica, does not.
    let budget = (8 * one - 1).to_string();
    let (a, b) = replicas(&sim, &server, &["--session-budget", &budget]).await;
    let mut tasks = Vec::new();
    for i in 0..8 {
        let url = if i % 2 == 0 { a.url("") } else { b.url("") };
        let (c, body) = (c.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let req = post(&format!("{url}/v1/messages"), body.to_string())
                .header("x-api-key", "sk-ant-replica-test")
                .header("anthropic-version", "2023-06-01")
                .header("x-session-id", "budget-1")
                .body(support::full(body.to_string()))
                .unwrap();
            send(&c, req).await.0.status.as_u16()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200, "under the budget");
    }
    let mut conn = raw(&server).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let k = find_key(&mut conn, "budget-1", "spend").await;
        let (i, o): (Option<u64>, Option<u64>) = redis::cmd("HMGET")
            .arg(k.as_deref().unwrap_or("tidemark:v2:none"))
            .arg("i")
            .arg("o")
            .query_async(&mut conn)
            .await
            .unwrap();
        if i.unwrap_or(0) + o.unwrap_or(0) == 8 * one {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "spend in Redis: {i:?} + {o:?}, want {}",
            8 * one
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for p in [&a, &b] {
        let r = ask(&c, p, "budget-1", &body).await;
        assert_eq!(r.status, 400, "over the shared budget: {}", r.projection);
    }
    // Another session is not affected.
    let r = ask(&c, &a, "budget-2", &body).await;
    assert_eq!(r.status, 200);
    for p in [a, b] {
        p.stop().await;
    }
}

/// A TCP relay in front of `redis-server` that holds back what tidemark
/// sends while its gate is closed (`false`); the replies pass freely.
async fn gated_relay(server: &Server) -> (String, tokio::sync::watch::Sender<bool>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("redis://{}/0", l.local_addr().unwrap());
    let target = ("127.0.0.1", server.port);
    let (gate, open) = tokio::sync::watch::channel(true);
    tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            let Ok(redis) = tokio::net::TcpStream::connect(target).await else {
                continue;
            };
            let ((mut cr, mut cw), (mut rr, mut rw)) = (client.into_split(), redis.into_split());
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut rr, &mut cw).await;
            });
            let mut open = open.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n @ 1..) = cr.read(&mut buf).await {
                    if open.wait_for(|o| *o).await.is_err()
                        || rw.write_all(&buf[..n]).await.is_err()
                    {
                        break;
                    }
                }
            });
        }
    });
    (url, gate)
}

/// With nothing to decide before forwarding (`--on-over pass`, no budget),
/// the request leaves before tidemark waits on its state backend: here the
/// backend answers only once the upstream has the request, and still in
/// time. With `--on-over reject` the projection must come first, so the
/// same backend times out and the answer says `state=local`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_nothing_to_decide_the_request_leaves_before_the_state_lookup() {
    let server = Server::start();
    let (relay, gate) = gated_relay(&server).await;
    let opener = gate.clone();
    let up = support::upstream(support::handler(move |_req| {
        // The upstream has the request: let tidemark's state lookup through.
        opener.send_replace(true);
        http::Response::builder()
            .header("content-type", "application/json")
            .body(support::full(support::fixture(
                "anthropic-messages/nonstream_basic.json",
            )))
            .unwrap()
    }))
    .await;
    let route = format!("/v1/messages={}", up.url());
    let c = client_h1();
    for (on_over, leaves_first) in [("pass", true), ("reject", false)] {
        let p = support::proxy(
            &up.url(),
            &["--state", &relay, "--route", &route, "--on-over", on_over],
        )
        .await;
        wait_ready(&c, &p, 200).await;
        gate.send_replace(false);
        let r = support::within(10, ask(&c, &p, &format!("s-{on_over}"), &turn(1))).await;
        assert_eq!(r.status, 200);
        assert_eq!(
            !r.has("state=local"),
            leaves_first,
            "--on-over {on_over}: {}",
            r.projection
        );
        assert!(*gate.borrow(), "the upstream saw the request");
    }
}

/// `GET /sessions/{path}` on a replica: status and body.
async fn admin(c: &TestClient, p: &Proxy, path: &str) -> (u16, Value) {
    let (parts, body) = get(c, &p.admin_url(&format!("/sessions/{path}"))).await;
    (
        parts.status.as_u16(),
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}

/// Bounded polling until `GET /sessions/{path}` on every replica answers
/// with `turns`; returns what each said. Write-backs land off the
/// response path.
async fn until_turns(c: &TestClient, replicas: &[&Proxy], path: &str, turns: u64) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut all = Vec::new();
        for p in replicas {
            all.push(admin(c, p, path).await.1);
        }
        if all.iter().all(|v| v["turns"] == turns) {
            return all;
        }
        assert!(
            Instant::now() < deadline,
            "{path}: not {turns} turns on every replica within 10 s: {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The `credential` a session object shows for an API key.
fn hash(api_key: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(api_key.as_bytes())[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Every replica answers `/sessions` with the shared record, not its own
/// view: after 12 turns alternating between two replicas, both say 12
/// turns and the same anchor, and both list the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_answers_with_the_shared_record() {
    let server = Server::start();
    let sim = start_sim().await;
    let (a, b) = replicas(&sim, &server, &[]).await;
    let c = client_h1();
    let mut last = 0;
    for t in 1..=12u64 {
        let p = if t % 2 == 1 { &a } else { &b };
        let r = ask(&c, p, "shared-view", &turn(t)).await;
        assert_eq!(r.status, 200);
        last = r.real;
        // Each turn waits for the last one's record (as an agent waits for
        // its answer): the replicas' own views stay one turn apart.
        until_turns(&c, &[&a, &b], "shared-view", t).await;
    }
    let both = until_turns(&c, &[&a, &b], "shared-view", 12).await;
    for v in &both {
        assert_eq!(v["anchor"]["real"], last, "{v}");
        assert_eq!(v["state"], "anchored");
        assert_eq!(v["key_source"], "header");
        assert_eq!(v["lanes"].as_array().unwrap().len(), 1, "{v}");
    }
    assert_eq!(both[0], both[1]);
    for p in [&a, &b] {
        let (parts, body) = get(&c, &p.admin_url("/sessions")).await;
        assert_eq!(parts.status, 200);
        let list: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(list["total"], 1, "{list}");
        assert_eq!(list["sessions"][0]["turns"], 12);
    }
    for p in [a, b] {
        p.stop().await;
    }
}

/// A provider that answers like the simulated one (its count) and holds
/// back every request whose last message says `slow` until `release`
/// fires; each held request is announced on `held`.
async fn holding_upstream(
    held: tokio::sync::mpsc::Sender<()>,
    release: std::sync::Arc<tokio::sync::Notify>,
) -> support::Upstream {
    let handler: support::Handler = std::sync::Arc::new(move |req: http::Request<bytes::Bytes>| {
        let (held, release) = (held.clone(), release.clone());
        Box::pin(async move {
            let body: Value = serde_json::from_slice(req.body()).unwrap();
            let slow = body["messages"]
                .as_array()
                .and_then(|m| m.last())
                .is_some_and(|m| m["content"].as_str().is_some_and(|c| c.contains("slow")));
            if slow {
                let wait = release.notified();
                let _ = held.send(()).await;
                wait.await;
            }
            let real = sim::count_prompt(sim::SimApi::Anthropic, &body).total;
            let out = json!({"id": "msg_1", "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": "ok"}],
                "usage": {"input_tokens": real, "output_tokens": 2}});
            http::Response::builder()
                .header("content-type", "application/json")
                .body(support::full(out.to_string()))
                .unwrap()
        })
    });
    support::upstream(handler).await
}

/// Two requests of one session at once, the older slow on replica A, the
/// newer fast on replica B: both replicas end up showing the newer one's
/// anchor; A's older response anchors nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_leave_the_newer_anchor_on_every_replica() {
    let server = Server::start();
    let (held_tx, mut held) = tokio::sync::mpsc::channel(4);
    let release = std::sync::Arc::new(tokio::sync::Notify::new());
    let up = holding_upstream(held_tx, release.clone()).await;
    let route = format!("/v1/messages={}", up.url());
    let args = ["--state", &server.url(), "--route", &route];
    let a = support::proxy(&up.url(), &args).await;
    let b = support::proxy(&up.url(), &args).await;
    let c = client_h1();
    for p in [&a, &b] {
        wait_ready(&c, p, 200).await;
    }
    let key = "race-2";
    ask(&c, &a, key, &turn(1)).await;
    until_turns(&c, &[&a, &b], key, 1).await;
    // The older request: on A, held by the provider.
    let mut older_body = turn(2);
    let n = older_body["messages"].as_array().unwrap().len();
    older_body["messages"][n - 1]["content"] = json!("slow: what is in turn two?");
    let older = {
        let (c, url) = (c.clone(), a.url("/v1/messages"));
        tokio::spawn(async move {
            let req = post(&url, older_body.to_string())
                .header("x-api-key", "sk-ant-replica-test")
                .header("x-session-id", key)
                .body(support::full(older_body.to_string()))
                .unwrap();
            send(&c, req).await.0.status.as_u16()
        })
    };
    support::within(10, held.recv())
        .await
        .expect("the provider holds the older request");
    // The newer one: on B, answered at once, written back.
    let newer = ask(&c, &b, key, &turn(3)).await;
    assert_eq!(newer.status, 200);
    until_turns(&c, &[&a, &b], key, 2).await;
    release.notify_one();
    assert_eq!(support::within(10, older).await.unwrap(), 200);
    // The older response's write-back has landed too (its turn counts).
    let both = until_turns(&c, &[&a, &b], key, 3).await;
    for v in &both {
        assert_eq!(
            v["anchor"]["real"], newer.real,
            "the newer anchor stays: {v}"
        );
    }
    // And the next request on A projects from it.
    let r = ask(&c, &a, key, &turn(3)).await;
    assert!(r.has("src=anchored"), "{}", r.projection);
    assert_eq!(
        r.tokens(),
        newer.real,
        "the same body as the newer: its anchor"
    );
    for p in [a, b] {
        p.stop().await;
    }
}

/// A session idle past `--session-ttl` is gone on every replica: `GET`
/// answers 404 and its next request is a first request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_is_gone_on_every_replica() {
    let server = Server::start();
    let sim = start_sim().await;
    let (a, b) = replicas(&sim, &server, &["--session-ttl", "1s"]).await;
    let c = client_h1();
    let key = "idle-shared";
    ask(&c, &a, key, &turn(1)).await;
    // A's write-back is off the response path: B reads it once it landed.
    until_turns(&c, &[&a, &b], key, 1).await;
    let r = ask(&c, &b, key, &turn(2)).await;
    assert!(r.has("src=anchored"), "{}", r.projection);
    until_turns(&c, &[&a, &b], key, 2).await;
    // The TTL passing is the point here, not a wait for another task.
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    for p in [&a, &b] {
        let (status, v) = admin(&c, p, key).await;
        assert_eq!(status, 404, "{v}");
    }
    let r = ask(&c, &a, key, &turn(3)).await;
    assert!(
        !r.has("src=anchored") && !r.has("src=lost"),
        "{}",
        r.projection
    );
    until_turns(&c, &[&a, &b], key, 1).await;
    for p in [a, b] {
        p.stop().await;
    }
}

/// `DELETE /sessions/{key}?credential=HASH` on one replica drops that
/// credential's anchor for every replica, and only that credential's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_with_a_credential_drops_only_that_credentials_session_in_redis() {
    let server = Server::start();
    let sim = start_sim().await;
    let (a, b) = replicas(&sim, &server, &[]).await;
    let c = client_h1();
    let key = "two-creds";
    for t in 1..=2 {
        for (p, api_key) in [(&a, "sk-one"), (&b, "sk-two")] {
            ask_as(&c, p, key, api_key, &turn(t)).await;
        }
    }
    for api_key in ["sk-one", "sk-two"] {
        until_turns(
            &c,
            &[&a, &b],
            &format!("{key}?credential={}", hash(api_key)),
            2,
        )
        .await;
    }
    let del = http::Request::delete(
        a.admin_url(&format!("/sessions/{key}?credential={}", hash("sk-one"))),
    )
    .body(support::full(""))
    .unwrap();
    assert_eq!(send(&c, del).await.0.status, 200);
    let one = ask_as(&c, &b, key, "sk-one", &turn(3)).await;
    assert!(one.has("src=calibrated"), "dropped: {}", one.projection);
    let two = ask_as(&c, &b, key, "sk-two", &turn(3)).await;
    assert!(two.has("src=anchored"), "kept: {}", two.projection);
    for p in [a, b] {
        p.stop().await;
    }
}

/// A Responses provider that stores its responses: a request that
/// continues one (`previous_response_id`) is counted with it.
async fn responses_upstream() -> support::Upstream {
    let stored = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u64>::new()));
    support::upstream(support::handler(move |req| {
        let body: Value = serde_json::from_slice(req.body()).unwrap();
        let mut stored = stored.lock().unwrap();
        let before = body["previous_response_id"]
            .as_str()
            .and_then(|id| id.strip_prefix("resp_")?.parse::<usize>().ok())
            .and_then(|i| stored.get(i - 1).copied())
            .unwrap_or(0);
        let real = before + 12 + req.body().len() as u64 / 4;
        stored.push(real);
        let out = json!({"id": format!("resp_{}", stored.len()), "object": "response",
            "status": "completed", "output": [],
            "usage": {"input_tokens": real, "output_tokens": 1, "total_tokens": real + 1}});
        http::Response::builder()
            .header("content-type", "application/json")
            .body(support::full(out.to_string()))
            .unwrap()
    }))
    .await
}

/// An agent that chains its turns with `previous_response_id` and names
/// its session (Codex sends `prompt_cache_key`): a turn served by another
/// replica than the one before it stays in that turn's lane, anchored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chained_turn_on_another_replica_stays_in_its_lane() {
    let server = Server::start();
    let up = responses_upstream().await;
    let args = ["--state", &server.url()];
    let a = support::proxy(&up.url(), &args).await;
    let b = support::proxy(&up.url(), &args).await;
    let c = client_h1();
    for p in [&a, &b] {
        wait_ready(&c, p, 200).await;
    }
    let ask = |p: &Proxy, body: Value| {
        let (c, url) = (c.clone(), p.url("/v1/responses"));
        async move {
            let req = post(&url, body.to_string())
                .header("authorization", "Bearer sk-chain")
                .body(support::full(body.to_string()))
                .unwrap();
            let (parts, _) = send(&c, req).await;
            assert_eq!(parts.status, 200);
            parts.headers["x-context-projection"]
                .to_str()
                .unwrap()
                .to_string()
        }
    };
    let key = "019a-thread";
    let first = json!({"model": "gpt-5", "instructions": "Be brief.", "prompt_cache_key": key,
        "input": [{"role": "user", "content": "start the work"}]});
    ask(&a, first).await;
    until_turns(&c, &[&a, &b], key, 1).await;
    for (i, p) in [&b, &a, &b].into_iter().enumerate() {
        let next = json!({"model": "gpt-5", "prompt_cache_key": key,
            "previous_response_id": format!("resp_{}", i + 1),
            "input": [{"role": "user", "content": format!("and then step {i}")}]});
        let projection = ask(p, next).await;
        assert!(
            projection.contains("src=anchored"),
            "turn {}: {projection}",
            i + 2
        );
        until_turns(&c, &[&a, &b], key, i as u64 + 2).await;
    }
    let (_, s) = admin(&c, &a, key).await;
    assert_eq!(s["key_source"], "agent");
    assert_eq!(s["lanes"].as_array().unwrap().len(), 1, "{s}");
    for p in [a, b] {
        p.stop().await;
    }
}

/// A window one replica learned from its upstream's refusal is the window
/// every replica measures against: the lesson is a field of the model's
/// shared record, read in the same round trip as the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_learned_by_one_replica_is_every_replicas() {
    const W: u64 = 3000;
    let server = Server::start();
    let small_sim = support::sim(SimConfig {
        context_window: Some(W),
        ..SimConfig::default()
    })
    .await;
    let (a, b) = replicas(&small_sim, &server, &["--on-over", "reject"]).await;
    let c = client_h1();
    let big = turn(14);
    assert!(sim::count_prompt(sim::SimApi::Anthropic, &big).total > W);

    let r = ask(&c, &b, "window-b", &turn(1)).await;
    assert_eq!(r.status, 200);
    assert!(r.has("window=200000"), "the table's: {}", r.projection);
    // Replica A sends the big body; the provider refuses it in its words.
    let r = ask(&c, &a, "window-a", &big).await;
    assert_eq!(r.status, 400);
    assert!(r.has("window=200000"), "{}", r.projection);
    // Replica B, another session, measures against the learned window (the
    // write-back lands off A's response path: bounded polling).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = ask(&c, &b, "window-b", &turn(1)).await;
        if r.has(&format!("window={W}")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "replica B never learned: {}",
            r.projection
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut conn = raw(&server).await;
    let fields: Vec<String> = redis::cmd("HKEYS")
        .arg("tidemark:v2:model:{claude-sonnet-4-5}")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        fields.iter().any(|f| f.starts_with("w:127.0.0.1:")),
        "{fields:?}"
    );
    a.stop().await;
    b.stop().await;
}
