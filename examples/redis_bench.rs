//! Added latency of `--state redis://` on the hot path: `begin` + `store` per
//! request against a local `redis-server` this starts, next to the in-memory
//! equivalent (a DashMap doing the same sequence / compare-and-set work), in
//! one run.
//!
//! `cargo run --release --example redis_bench [-- REQUESTS]` (default 20000).

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use tidemark::session::redis::{RedisState, Totals, Write};

/// `redis-server` on a free port, killed on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> (Server, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start redis-server ({e}): apt-get install -y redis-server")
        });
    let server = Server(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    (server, port)
}

/// The in-memory state doing what the Redis scripts do.
#[derive(Default)]
struct Memory {
    seq: DashMap<String, u64>,
    rec: DashMap<String, (u64, Vec<u8>)>,
    spend: DashMap<String, [u64; 3]>,
}

impl Memory {
    fn begin(&self, sid: &str) -> (u64, Option<Vec<u8>>, [u64; 3]) {
        let rec = self.rec.get(sid).map(|r| r.clone());
        let rs = rec.as_ref().map(|r| r.0).unwrap_or(0);
        let mut s = self.seq.entry(sid.to_owned()).or_insert(0);
        *s = (*s + 1).max(rs + 1);
        let spend = self.spend.get(sid).map(|s| *s).unwrap_or_default();
        (*s, rec.map(|r| r.1), spend)
    }
    fn store(&self, sid: &str, seq: u64, record: &[u8]) -> bool {
        let mut e = self.rec.entry(sid.to_owned()).or_insert((0, Vec::new()));
        if seq <= e.0 {
            return false;
        }
        *e = (seq, record.to_vec());
        true
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn report(name: &str, mut d: Vec<Duration>) -> (Duration, Duration) {
    d.sort_unstable();
    let (p50, p99) = (pct(&d, 0.50), pct(&d, 0.99));
    println!(
        "{name:<8} n={:<6} p50={:>8.1} µs  p99={:>8.1} µs  max={:>8.1} µs",
        d.len(),
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        d[d.len() - 1].as_secs_f64() * 1e6,
    );
    (p50, p99)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20_000);
    let (_server, port) = start_redis();
    let redis = RedisState::new(
        &format!("redis://127.0.0.1:{port}/0"),
        Duration::from_secs(3600),
    )
    .expect("url");
    assert!(redis.ping().await, "redis answers");
    let memory = Memory::default();
    // A realistic record: a serialised session is a few hundred bytes.
    let record = vec![b'x'; 600];
    let sessions = 64;
    let failures = AtomicU64::new(0);

    // Warm up both (connections, scripts, allocator).
    for i in 0..1000 {
        let sid = format!("cred:{}", i % sessions);
        let b = redis.begin(&sid, Some("gpt-4o")).await.expect("begin");
        let _ = redis.store(&sid, b.seq, write(&record)).await;
        let (s, _, _) = memory.begin(&sid);
        memory.store(&sid, s, &record);
    }

    let (mut mem_t, mut red_t) = (Vec::with_capacity(n), Vec::with_capacity(n));
    // `begin` alone: the part before the request goes upstream.
    let mut begin_t = Vec::with_capacity(n);
    // Interleaved so both see the same machine load.
    for i in 0..n {
        let sid = format!("cred:{}", i % sessions);
        let t = Instant::now();
        let (s, rec, _) = memory.begin(&sid);
        std::hint::black_box(rec);
        memory.store(&sid, s, &record);
        mem_t.push(t.elapsed());

        let t = Instant::now();
        let begun = redis.begin(&sid, Some("gpt-4o")).await;
        begin_t.push(t.elapsed());
        match begun {
            Ok(b) => {
                std::hint::black_box(&b.stored);
                if redis.store(&sid, b.seq, write(&record)).await.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(_) => {
                failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        red_t.push(t.elapsed());
    }
    println!("begin+store per request, {n} requests over {sessions} sessions, record {} B, one client task", record.len());
    let (m50, m99) = report("memory", mem_t);
    let (r50, r99) = report("redis", red_t);
    report("(begin)", begin_t);
    println!(
        "added by redis: p50 {:.1} µs, p99 {:.1} µs (goal: p50 under 500 µs); failures {}",
        (r50.saturating_sub(m50)).as_secs_f64() * 1e6,
        (r99.saturating_sub(m99)).as_secs_f64() * 1e6,
        failures.load(Ordering::Relaxed)
    );
}

/// One lane's record and a turn's tokens: what a response writes back.
fn write(record: &[u8]) -> Write<'_> {
    Write {
        lane: Some(("0123456789abcdef", record)),
        meta: b"{}",
        add: Totals {
            input: 1000,
            output: 20,
            turns: 1,
            ..Default::default()
        },
        key: "k",
        credential: "cred",
    }
}
