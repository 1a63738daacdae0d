//! Per-content calibration with `--state redis://`: a lane's per-class
//! ratios travel in its record, so replicas that take turns project one
//! session class by class alike; the model's per-class ratios are shared,
//! so a replica that never saw a class starts a new session's first turn
//! of it from what the others learned.

mod support;
use support::mixed;

use std::time::{Duration, Instant};

use mixed::{err, Conv, Script};
use serde_json::Value;
use support::redis::Server;
use support::{client_h1, get, Proxy, TestClient};
use tidemark::estimate::Estimator;
use tidemark::provider::Api;
use tidemark::sim::{SimConfig, X_SIM_PROMPT_TOKENS};

const MODEL: &str = "claude-sonnet-4-5";

async fn start_sim() -> (String, support::Sim) {
    let s = support::sim(SimConfig::default()).await;
    (s.url.clone(), s)
}

async fn replica(sim: &str, state: Option<&str>) -> Proxy {
    let route = format!("/v1/messages={sim}");
    let mut args = vec!["--route", route.as_str()];
    if let Some(s) = state {
        args.extend(["--state", s]);
    }
    let p = support::proxy(sim, &args).await;
    let c = client_h1();
    let deadline = Instant::now() + Duration::from_secs(15);
    while get(&c, &p.admin_url("/readyz")).await.0.status != 200 {
        assert!(Instant::now() < deadline, "/readyz within 15 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    p
}

/// One turn through `p`: (projected, real).
async fn ask(c: &mixed::HttpClient, p: &Proxy, key: &str, conv: &Conv) -> (u64, u64) {
    let req = http::Request::post(p.url(&conv.path()))
        .header("content-type", "application/json")
        .header("x-session-id", key)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            conv.body().to_string(),
        )))
        .unwrap();
    let resp = support::within(30, c.request(req)).await.unwrap();
    let h = |n: &str| resp.headers().get(n).unwrap().to_str().unwrap().to_string();
    let real: u64 = h(X_SIM_PROMPT_TOKENS).parse().unwrap();
    let projected: u64 = h("x-context-projection")
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    use http_body_util::BodyExt;
    support::within(30, resp.into_body().collect())
        .await
        .unwrap();
    (projected, real)
}

/// The session's `turns` on `p`, polled until it reaches `turns` (the
/// record is written back after the response).
async fn session(c: &TestClient, p: &Proxy, key: &str, turns: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (parts, body) = get(c, &p.admin_url(&format!("/sessions/{key}"))).await;
        if parts.status == 200 {
            let v: Value = serde_json::from_slice(&body).unwrap();
            if v["turns"].as_u64() >= Some(turns) {
                return v;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{key}: {turns} turns within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Drive `script` for `turns` turns, turn `t` through `route(t)`; the
/// signed error of each anchored turn (from turn 2) and whether it brought
/// Han text for the first time.
async fn drive(
    c: &mixed::HttpClient,
    route: impl Fn(usize) -> &'static Proxy,
    key: &str,
    script: &Script,
    seed: u64,
    turns: usize,
) -> Vec<(f64, bool)> {
    let est = Estimator::new(16 << 20);
    let mut conv = Conv::new(Api::Anthropic, MODEL, seed);
    let mut out = Vec::new();
    let mut han = 0;
    let tc = client_h1();
    for t in 1..=turns {
        if t >= 2 {
            conv.advance(script.steps[t - 2]);
        }
        let e = est
            .estimate_body(
                Api::Anthropic,
                conv.body().to_string().as_bytes(),
                Some(MODEL),
            )
            .unwrap();
        let now = e.classes.get(tidemark::estimate::Class::Han);
        let p = route(t);
        let (projected, real) = ask(c, p, key, &conv).await;
        if t >= 2 {
            out.push((err(projected, real), han == 0 && now > 100));
        }
        han = now;
        // The next replica reads this turn's record: wait until it sees it.
        // Not through `p`: it answers from its own copy until its write-back
        // lands in Redis, and the next turn could begin before that.
        session(&tc, route(t + 1), key, t as u64).await;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn class_ratios_travel_in_the_lane_and_the_model_priors_are_shared() {
    let server = Server::start();
    let (sim, _stop) = start_sim().await;
    let url = server.url();
    // Leaked so the routing closures can hand them out; the test ends the process.
    let a: &'static Proxy = Box::leak(Box::new(replica(&sim, Some(&url)).await));
    let b: &'static Proxy = Box::leak(Box::new(replica(&sim, Some(&url)).await));
    let c = mixed::client();
    let tc = client_h1();

    // One session, replicas taking turns: each projects from the record
    // the other stored, class by class, as one proxy alone does.
    let script = mixed::rotating(7);
    let errs = drive(
        &c,
        |t| if t % 2 == 0 { a } else { b },
        "alternating",
        &script,
        7,
        16,
    )
    .await;
    let solo: &'static Proxy = Box::leak(Box::new(replica(&sim, None).await));
    let alone = drive(&c, |_| solo, "alternating", &script, 7, 16).await;
    for (t, ((e, _), (s, _))) in errs.iter().zip(&alone).enumerate() {
        assert!(
            (e - s).abs() <= 0.1,
            "turn {}: {e:.2}% through two replicas, {s:.2}% through one",
            t + 2
        );
    }
    let on_a = session(&tc, a, "alternating", 16).await;
    let on_b = session(&tc, b, "alternating", 16).await;
    let classes = &on_a["lanes"][0]["classes"];
    for k in ["prose", "json", "code", "han", "binary", "emoji", "script"] {
        assert!(classes[k].as_f64().is_some(), "{k} in {classes}");
    }
    assert_eq!(classes, &on_b["lanes"][0]["classes"], "the shared record");
    assert_eq!(
        on_a["classes"], on_a["lanes"][0]["classes"],
        "the top is the lane's"
    );

    // A replica that has served nothing takes a new session of the same
    // model: its first Han turn starts from the model's shared ratio. The
    // same session through a proxy of its own, which learned nothing,
    // starts from a prior.
    let fresh: &'static Proxy = Box::leak(Box::new(replica(&sim, Some(&url)).await));
    let alone: &'static Proxy = Box::leak(Box::new(replica(&sim, None).await));
    let script = mixed::one_by_one(11);
    let shared = drive(&c, |_| fresh, "new-session", &script, 11, 9).await;
    let own = drive(&c, |_| alone, "new-session", &script, 11, 9).await;
    let first_han = |v: &[(f64, bool)]| v.iter().find(|(_, h)| *h).map(|(e, _)| *e).unwrap();
    let (with, without) = (first_han(&shared), first_han(&own));
    assert!(
        with.abs() <= 3.0 && without.abs() > with.abs() + 2.0,
        "first Han turn: {with:.2}% from the shared model ratio, {without:.2}% from a prior"
    );
}
