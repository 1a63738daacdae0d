//! The Redis state backend against a real `redis-server` that each test starts
//! on a free port: two `RedisState`s stand for two tidemark replicas.

mod support;

use std::io::Write;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::redis::{free_port, Server};
use tidemark::session::redis::{
    Begin, CalField, RedisState, StateError, Totals, Write as Change, OP_TIMEOUT, PROBE_INTERVAL,
    SLOW_OUTAGE,
};
use tidemark::session::MAX_LANES;

const TTL: Duration = Duration::from_secs(60);

async fn replica(server: &Server) -> RedisState {
    let st = RedisState::new(&server.url(), TTL).expect("valid url");
    assert!(st.ping().await, "redis-server answers PING");
    assert!(st.healthy());
    st
}

async fn raw(server: &Server) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection")
}

/// A write of one lane's record (session fields `{}`, nothing added).
fn lane<'a>(name: &'a str, record: &'a [u8]) -> Change<'a> {
    Change {
        lane: Some((name, record)),
        meta: b"{}",
        add: Totals::default(),
        key: "k",
        credential: "c",
    }
}

/// Store one lane's record; whether it was stored.
async fn put(st: &RedisState, sid: &str, seq: u64, name: &str, record: &[u8]) -> bool {
    st.store(sid, seq, lane(name, record)).await.expect("store")
}

/// A lane's stored record and the sequence it was stored at.
fn lane_of<'b>(b: &'b Begin, name: &str) -> Option<(u64, &'b [u8])> {
    b.stored
        .lanes
        .iter()
        .find(|(n, _, _)| n == name)
        .map(|(_, s, r)| (*s, r.as_slice()))
}

#[tokio::test]
async fn two_replicas_share_one_global_order() {
    let server = Server::start();
    let (a, b) = (replica(&server).await, replica(&server).await);
    let sid = "cred1234:session-a";
    let mut last = 0;
    for i in 0..20 {
        let r = if i % 2 == 0 { &a } else { &b };
        let begun = r.begin(sid, None).await.expect("begin");
        assert_eq!(begun.seq, last + 1, "one order across both replicas");
        last = begun.seq;
        assert!(
            put(
                r,
                sid,
                begun.seq,
                "main",
                format!("rec-{}", begun.seq).as_bytes()
            )
            .await
        );
        // The other replica sees what this one stored.
        let other = if i % 2 == 0 { &b } else { &a };
        let seen = other.begin(sid, None).await.expect("begin");
        let rec = format!("rec-{last}");
        assert_eq!(lane_of(&seen, "main"), Some((last, rec.as_bytes())));
        assert_eq!(seen.stored.top, last);
        last = seen.seq;
    }
    // Another session has its own order.
    assert_eq!(a.begin("cred1234:session-b", None).await.unwrap().seq, 1);
}

#[tokio::test]
async fn an_older_request_never_overwrites_a_newer_anchor() {
    let server = Server::start();
    let (a, b) = (replica(&server).await, replica(&server).await);
    let sid = "s-older";
    let old = a.begin(sid, None).await.unwrap();
    let new = b.begin(sid, None).await.unwrap();
    assert!(new.seq > old.seq);
    assert!(put(&b, sid, new.seq, "main", b"new").await);
    assert!(
        !put(&a, sid, old.seq, "main", b"old").await,
        "older seq refused"
    );
    assert!(
        !put(&a, sid, new.seq, "main", b"same").await,
        "equal seq refused"
    );
    let now = a.begin(sid, None).await.unwrap();
    assert_eq!(lane_of(&now, "main"), Some((new.seq, &b"new"[..])));
    assert!(now.seq > new.seq);
}

/// Lanes are compared each on its own: a newer request in lane B does not
/// make an older request's anchor in lane A stale.
#[tokio::test]
async fn a_newer_request_in_one_lane_never_discards_another_lanes() {
    let server = Server::start();
    let (a, b) = (replica(&server).await, replica(&server).await);
    let sid = "s-lanes";
    let older = a.begin(sid, None).await.unwrap();
    let newer = b.begin(sid, None).await.unwrap();
    assert!(put(&b, sid, newer.seq, "side", b"side-new").await);
    assert!(
        put(&a, sid, older.seq, "main", b"main-old").await,
        "the main lane's own sequence is what counts"
    );
    let now = a.begin(sid, None).await.unwrap();
    assert_eq!(lane_of(&now, "main"), Some((older.seq, &b"main-old"[..])));
    assert_eq!(lane_of(&now, "side"), Some((newer.seq, &b"side-new"[..])));
    assert_eq!(now.stored.top, newer.seq);
}

#[tokio::test]
async fn a_session_keeps_its_most_recently_stored_lanes() {
    let server = Server::start();
    let a = replica(&server).await;
    let sid = "s-cap";
    let n = MAX_LANES + 5;
    for i in 0..n {
        let seq = a.begin(sid, None).await.unwrap().seq;
        assert!(put(&a, sid, seq, &format!("lane{i}"), b"r").await);
    }
    let now = a.begin(sid, None).await.unwrap();
    assert_eq!(now.stored.lanes.len(), MAX_LANES);
    for i in 0..5 {
        assert!(
            lane_of(&now, &format!("lane{i}")).is_none(),
            "lane{i} went first"
        );
    }
    assert!(lane_of(&now, &format!("lane{}", n - 1)).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_racing_stores_keep_the_newest() {
    let server = Server::start();
    let (a, b) = (replica(&server).await, replica(&server).await);
    let sid = "s-race";
    // Fifty requests begin (the order Redis hands out), then finish in any order.
    let mut seqs = Vec::new();
    for i in 0..50 {
        let r = if i % 2 == 0 { &a } else { &b };
        seqs.push(r.begin(sid, None).await.unwrap().seq);
    }
    let max = *seqs.iter().max().unwrap();
    // Finish newest first half the time so late, older stores must be refused.
    seqs.reverse();
    seqs.swap(0, 25);
    let barrier = Arc::new(tokio::sync::Barrier::new(seqs.len()));
    let mut tasks = Vec::new();
    for (i, seq) in seqs.into_iter().enumerate() {
        let r = if i % 2 == 0 { a.clone() } else { b.clone() };
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let rec = format!("rec-{seq}");
            r.store(sid, seq, lane("main", rec.as_bytes())).await
        }));
    }
    let mut stored = 0;
    for t in tasks {
        if t.await.unwrap().expect("store answered") {
            stored += 1;
        }
    }
    assert!(stored >= 1);
    let end = a.begin(sid, None).await.unwrap();
    let rec = format!("rec-{max}");
    assert_eq!(lane_of(&end, "main"), Some((max, rec.as_bytes())));
    assert_eq!(end.seq, max + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn totals_add_up_across_replicas() {
    let server = Server::start();
    let (a, b) = (replica(&server).await, replica(&server).await);
    let sid = "s-spend";
    let mut tasks = Vec::new();
    for i in 0..40u64 {
        let r = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            let w = Change {
                lane: None,
                meta: b"{}",
                add: Totals {
                    input: 100 + i,
                    cached_input: i,
                    output: 7,
                    turns: 1,
                    compactions: i % 2,
                },
                key: "k",
                credential: "c",
            };
            // Added whatever the sequence: increments are never refused.
            r.store(sid, 1, w).await
        }));
    }
    for t in tasks {
        t.await.unwrap().expect("store");
    }
    let t = b.begin(sid, None).await.unwrap().stored.totals;
    assert_eq!(t.input, (0..40).map(|i| 100 + i).sum::<u64>());
    assert_eq!(t.cached_input, (0..40).sum::<u64>());
    assert_eq!(t.output, 7 * 40);
    assert_eq!(t.turns, 40);
    assert_eq!(t.compactions, 20);
    // A fresh session has none.
    assert_eq!(
        b.begin("s-none", None).await.unwrap().stored.totals,
        Totals::default()
    );
}

#[tokio::test]
async fn model_calibration_is_shared_and_smoothed() {
    let server = Server::start();
    let (a, b) = (replica(&server).await, replica(&server).await);
    let m = "gpt-4o";
    assert_eq!(
        a.learn_model_calibration(m, CalField::Marginal, 1.2, 0.5)
            .await
            .unwrap(),
        1.2
    );
    let v = b
        .learn_model_calibration(m, CalField::Marginal, 1.0, 0.5)
        .await
        .unwrap();
    assert!((v - 1.1).abs() < 1e-12, "{v}");
    b.store_model_calibration(m, CalField::Cold, 1.05)
        .await
        .unwrap();
    let begun = a.begin("s-model", Some(m)).await.unwrap();
    assert!((begun.model.marginal.unwrap() - 1.1).abs() < 1e-12);
    assert_eq!(begun.model.cold, Some(1.05));
    let other = a.begin("s-model", Some("other-model")).await.unwrap();
    assert_eq!(other.model.marginal, None);
    assert_eq!(
        a.learn_model_calibration(m, CalField::Cold, f64::NAN, 0.5)
            .await,
        Err(StateError::Invalid("calibration sample or alpha"))
    );
}

#[tokio::test]
async fn keys_are_namespaced_and_expire_with_the_session() {
    let server = Server::start();
    let a = replica(&server).await;
    let sid = "abcd1234:s-ttl";
    let begun = a.begin(sid, Some("m1")).await.unwrap();
    let mut w = lane("main", b"r");
    w.add.input = 1;
    assert!(a.store(sid, begun.seq, w).await.unwrap());
    a.learn_model_calibration("m1", CalField::Cold, 1.0, 0.1)
        .await
        .unwrap();
    let mut raw = raw(&server).await;
    for key in [
        format!("tidemark:v2:{{{sid}}}:seq"),
        format!("tidemark:v2:{{{sid}}}:rec"),
        format!("tidemark:v2:{{{sid}}}:spend"),
        "tidemark:v2:key:{k}".to_string(),
    ] {
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut raw)
            .await
            .unwrap();
        assert!(
            pttl > 0 && pttl <= TTL.as_millis() as i64,
            "{key}: pttl {pttl}"
        );
    }
    let pttl: i64 = redis::cmd("PTTL")
        .arg("tidemark:v2:model:{m1}")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(
        pttl > TTL.as_millis() as i64,
        "model key outlives sessions: {pttl}"
    );
    // The listing index holds the session, and what was written within the TTL only.
    assert_eq!(a.sessions(10).await.unwrap(), vec![sid.to_string()]);
    assert_eq!(a.credentials("k").await.unwrap(), vec!["c".to_string()]);
    // A huge client-controlled id becomes a digest, not a huge key.
    let long = "x".repeat(10_000);
    a.begin(&long, None).await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("tidemark:v2:{h:*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert!(keys[0].len() < 100);
}

#[tokio::test]
async fn delete_leaves_a_tombstone_that_fences_requests_in_flight() {
    let server = Server::start();
    let (a, b) = (replica(&server).await, replica(&server).await);
    let sid = "s-del";
    let first = a.begin(sid, None).await.unwrap();
    let mut w = lane("main", b"anchored");
    w.add.input = 10;
    w.add.output = 5;
    assert!(a.store(sid, first.seq, w).await.unwrap());
    let in_flight = b.begin(sid, None).await.unwrap();
    let (at, existed) = a.delete(sid).await.unwrap();
    assert!(existed);
    assert!(at > in_flight.seq);
    assert!(
        !put(&b, sid, in_flight.seq, "main", b"stale").await,
        "a request begun before the delete cannot bring the anchor back"
    );
    let after = b.begin(sid, None).await.unwrap();
    assert_eq!(after.stored.deleted, at);
    assert!(after.seq > at);
    assert_eq!(after.stored.totals.input, 10, "the budget keeps counting");
    assert!(put(&b, sid, after.seq, "main", b"fresh").await);
    // A session that never stored anything did not exist.
    assert!(!a.delete("s-never").await.unwrap().1);
}

#[test]
fn bad_urls_are_refused_without_echoing_them() {
    assert!(RedisState::new("memory", TTL).is_err());
    assert!(RedisState::new("http://127.0.0.1:6379", TTL).is_err());
    let e = RedisState::new("redis://:hunter2@127.0.0.1:notaport/0", TTL).unwrap_err();
    assert!(!e.contains("hunter2"), "{e}");
    // TLS URLs are understood.
    let st = RedisState::new("rediss://:hunter2@127.0.0.1:6380/2", TTL).unwrap();
    assert_eq!(st.target(), "127.0.0.1:6380/2");
    assert!(!format!("{st:?}").contains("hunter2"));
}

#[tokio::test]
async fn down_at_start_then_up() {
    let port = free_port();
    let st = RedisState::new(&format!("redis://127.0.0.1:{port}/0"), TTL)
        .expect("a Redis that is down is not a configuration error");
    assert!(!st.ping().await);
    assert!(!st.healthy());
    let t = Instant::now();
    assert!(st.begin("s", None).await.is_err());
    assert!(t.elapsed() < OP_TIMEOUT + Duration::from_millis(200));
    let _server = Server::start_on(port, None);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !st.healthy() {
        assert!(
            Instant::now() < deadline,
            "not healthy 5 s after Redis came up"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(st.begin("s", None).await.unwrap().seq, 1);
}

/// Every log line of this test binary: one global subscriber (a scoped one
/// can miss callsites first hit on another test's thread). A test reads the
/// lines that name its own Redis port.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn global() -> &'static Logs {
        static LOGS: std::sync::OnceLock<Logs> = std::sync::OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Logs::default();
            let writer = logs.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .with_writer(move || writer.clone())
                .finish();
            tracing::subscriber::set_global_default(subscriber).expect("one global subscriber");
            logs
        })
    }
    fn all(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
    /// Lines about the backend at `port`.
    fn about(&self, port: u16) -> Vec<String> {
        let tag = format!("127.0.0.1:{port}/");
        self.all()
            .lines()
            .filter(|l| l.contains(&tag))
            .map(str::to_owned)
            .collect()
    }
    fn count(&self, port: u16, level: &str, needle: &str) -> usize {
        self.about(port)
            .iter()
            .filter(|l| l.contains(level) && l.contains(needle))
            .count()
    }
}

#[tokio::test]
async fn outage_is_loud_once_bounded_and_recovers() {
    let logs = Logs::global();
    let mut server = Server::start_on(free_port(), Some("s3cr3t-pw"));
    let port = server.port;
    let (a, b) = (replica(&server).await, replica(&server).await);
    let sid = "s-outage";
    let before = a.begin(sid, None).await.unwrap();
    assert!(put(&a, sid, before.seq, "main", b"pre").await);
    let errors_before = tidemark::metrics::get().state_errors.get();

    server.kill();
    let t = Instant::now();
    let err = a.begin(sid, None).await;
    let took = t.elapsed();
    assert!(err.is_err(), "begin during an outage fails: {err:?}");
    assert!(
        took < OP_TIMEOUT + Duration::from_millis(100),
        "bounded: took {took:?}"
    );
    assert!(!a.healthy());
    // While it lasts: fail at once, on both replicas, and keep quiet.
    let window = Instant::now() + PROBE_INTERVAL * 4;
    let mut tick = tokio::time::interval(Duration::from_millis(25));
    while Instant::now() < window {
        tick.tick().await;
        let t = Instant::now();
        assert!(a.begin(sid, None).await.is_err());
        assert!(t.elapsed() < OP_TIMEOUT + Duration::from_millis(100));
        let _ = b.store(sid, 99, lane("main", b"x")).await;
    }
    assert!(!a.healthy() && !b.healthy());
    assert!(tidemark::metrics::get().state_errors.get() > errors_before);
    // One WARN per backend: each `RedisState` here stands for one replica.
    let warns = logs.count(port, "WARN", "state backend unreachable");
    assert_eq!(
        warns,
        2,
        "one WARN per outage per replica:\n{:?}",
        logs.about(port)
    );

    // Redis comes back on the same port, empty (no persistence).
    server.spawn();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !(a.healthy() && b.healthy()) {
        assert!(
            Instant::now() < deadline,
            "not healthy 5 s after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A request begun before the outage still stores, and the order stays
    // monotonic even though Redis lost the counter.
    assert!(put(&a, sid, before.seq + 5, "main", b"late").await);
    let after = b.begin(sid, None).await.unwrap();
    assert_eq!(
        lane_of(&after, "main"),
        Some((before.seq + 5, &b"late"[..]))
    );
    assert!(after.seq > before.seq + 5);
    assert_eq!(logs.count(port, "INFO", "state backend recovered"), 2);
    assert_eq!(logs.count(port, "WARN", "state backend unreachable"), 2);
    assert!(!logs.all().contains("s3cr3t-pw"), "no credentials in logs");
    assert!(!logs.all().contains(sid), "no session ids in outage logs");
}

#[tokio::test]
async fn a_hung_redis_costs_at_most_the_bound_then_fails_fast() {
    let mut server = Server::start();
    let a = replica(&server).await;
    let pid = server.child.as_ref().expect("running").id().to_string();
    let signal = |sig: &str| {
        let ok = Command::new("kill")
            .args([sig, &pid])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    // Each call waits at most OP_TIMEOUT; a run of SLOW_OUTAGE of them is an outage.
    for i in 0..SLOW_OUTAGE {
        assert!(a.healthy(), "still healthy after {i} timeouts");
        let t = Instant::now();
        assert_eq!(a.begin("s-hung", None).await, Err(StateError::Timeout));
        assert!(
            t.elapsed() < OP_TIMEOUT + Duration::from_millis(100),
            "{:?}",
            t.elapsed()
        );
    }
    assert!(!a.healthy());
    let t = Instant::now();
    assert_eq!(a.begin("s-hung", None).await, Err(StateError::Unavailable));
    assert!(
        t.elapsed() < Duration::from_millis(5),
        "fails fast during an outage"
    );
    signal("-CONT");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !a.healthy() {
        assert!(
            Instant::now() < deadline,
            "not healthy 5 s after Redis resumed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(a.begin("s-hung", None).await.is_ok());
    server.kill();
}

#[tokio::test]
async fn a_lost_counter_never_goes_back_under_the_record() {
    let server = Server::start();
    let a = replica(&server).await;
    let sid = "s-lost-counter";
    let mut last = 0;
    for _ in 0..5 {
        last = a.begin(sid, None).await.unwrap().seq;
    }
    assert!(put(&a, sid, last, "main", b"r5").await);
    // The counter alone expires (its TTL is refreshed at begin, the record's
    // at store) or is evicted.
    let mut raw = raw(&server).await;
    let n: i64 = redis::cmd("DEL")
        .arg(format!("tidemark:v2:{{{sid}}}:seq"))
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(n, 1);
    let next = a.begin(sid, None).await.unwrap();
    assert_eq!(next.seq, last + 1, "above the stored record's sequence");
    assert!(put(&a, sid, next.seq, "main", b"r6").await);
}
