//! Soak, bounded in time: 10,000 mixed requests (every fixture of the five
//! APIs, streaming and not, h1 and h2c) at concurrency 32, 10% of clients
//! leaving at a random point and 5% of upstream responses reset. Every
//! completed response must be byte-equal to its fixture, `/readyz` must
//! answer 200 throughout, and open descriptors and RSS must come back near
//! their baseline afterwards.
//!
//! Slack, and why: after the clients are dropped the proxy keeps its pooled
//! upstream connections (up to the peak concurrency, each two descriptors in
//! this process: the proxy's end and the test upstream's end), so the
//! descriptor baseline is taken after a warm-up at the same concurrency and
//! the check allows `FD_SLACK` more. RSS is allowed `RSS_SLACK_MIB` over the
//! baseline (the allocator keeps freed pages) and `RSS_PLATEAU_MIB` of growth
//! from the first half of the soak to the second: a leak of one request's
//! parts and body (about 2.7 KB) per request showed as +13 MiB per half when
//! the test upstream itself kept every request, so it is caught.

mod support;
use support::faults;

/// The allocator the binary ships with (src/main.rs), so the RSS bounds hold
/// for it.
#[path = "../src/alloc.rs"]
mod alloc;
#[global_allocator]
static GLOBAL: alloc::Mimalloc = alloc::Mimalloc;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use support::{full, within, TestClient};

const REQUESTS: usize = 10_000;
const WARMUP: usize = 320;
const CONCURRENCY: usize = 32;
const FD_SLACK: usize = 48;
const RSS_SLACK_MIB: u64 = 32;
/// Growth allowed from the first half of the soak to the second.
const RSS_PLATEAU_MIB: u64 = 16;

/// A fixture to replay: its bytes, content type, request path and body.
struct Fx {
    name: String,
    body: Bytes,
    ct: &'static str,
    path: String,
    req: String,
}

fn fixtures() -> Vec<Fx> {
    support::stream_fixtures()
        .into_iter()
        .filter(|(name, ..)| !name.ends_with(".gz"))
        .map(|(name, ct, path, req)| Fx {
            body: support::fixture(&name),
            name,
            ct,
            path,
            req,
        })
        .collect()
}

/// xorshift64*, deterministic per request.
struct Rng(u64);
impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Cut `b` into 1..=6 chunks at seeded points.
fn cut(b: &Bytes, rng: &mut Rng) -> Vec<Bytes> {
    let n = 1 + rng.below(6) as usize;
    let mut points: Vec<usize> = (0..n - 1)
        .map(|_| rng.below(b.len() as u64 + 1) as usize)
        .collect();
    points.push(b.len());
    points.sort_unstable();
    let mut out = Vec::new();
    let mut prev = 0;
    for p in points {
        if p > prev {
            out.push(b.slice(prev..p));
            prev = p;
        }
    }
    out
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Plan {
    Complete,
    /// The upstream resets the response after a random prefix.
    Reset,
    /// The client leaves while its request body is still going out.
    LeaveMidRequest,
    /// The client leaves once the response headers arrived.
    LeaveAfterHeaders,
    /// The client leaves after the first body frame.
    LeaveMidBody,
}

#[derive(Default)]
struct Tally {
    complete: AtomicUsize,
    reset_partial: AtomicUsize,
    reset_502: AtomicUsize,
    reset_closed: AtomicUsize,
    left: AtomicUsize,
}

async fn one(
    i: usize,
    fx: &[Fx],
    h1: &TestClient,
    h2: &TestClient,
    base: &str,
    tally: &Tally,
    soak: bool,
) {
    let mut rng = Rng::new(i as u64 + 1);
    let which = rng.below(fx.len() as u64) as usize;
    let f = &fx[which];
    let roll = rng.below(100);
    let plan = if !soak {
        Plan::Complete
    } else if roll < 5 {
        Plan::Reset
    } else if roll < 15 {
        match rng.below(3) {
            0 => Plan::LeaveMidRequest,
            1 => Plan::LeaveAfterHeaders,
            _ => Plan::LeaveMidBody,
        }
    } else {
        Plan::Complete
    };
    let client = if rng.below(2) == 0 { h1 } else { h2 };
    let url = format!("{base}{}", f.path);
    let builder = Request::post(url)
        .header("content-type", "application/json")
        .header("x-fixture", which.to_string())
        .header("x-seed", i.to_string());
    let builder = if plan == Plan::Reset {
        builder.header("x-test-reset", "1")
    } else {
        builder
    };

    if plan == Plan::LeaveMidRequest {
        let (tx, body) = support::channel_body();
        let req = builder.body(body).unwrap();
        let client = client.clone();
        let task = tokio::spawn(async move { client.request(req).await.map(|_| ()) });
        let half = f.req.len() / 2;
        let _ = tx
            .send(Bytes::copy_from_slice(&f.req.as_bytes()[..half]))
            .await;
        task.abort();
        let _ = within(30, task).await;
        tally.left.fetch_add(1, Ordering::Relaxed);
        return;
    }

    let req = builder.body(full(f.req.clone())).unwrap();
    let resp = match within(30, client.request(req)).await {
        Ok(r) => r,
        // An upstream reset before any byte arrived may close the connection
        // before the response head is written.
        Err(e) if plan == Plan::Reset => {
            let _ = e;
            tally.reset_closed.fetch_add(1, Ordering::Relaxed);
            return;
        }
        Err(e) => panic!("request {i} ({}, {plan:?}): {e}", f.name),
    };
    match plan {
        Plan::LeaveAfterHeaders => {
            drop(resp);
            tally.left.fetch_add(1, Ordering::Relaxed);
        }
        Plan::LeaveMidBody => {
            let mut body = resp.into_body();
            let _ = within(30, body.frame()).await;
            drop(body);
            tally.left.fetch_add(1, Ordering::Relaxed);
        }
        Plan::Reset => {
            let status = resp.status();
            let mut body = resp.into_body();
            let mut got = Vec::new();
            let mut errored = false;
            while let Some(fr) = within(30, body.frame()).await {
                match fr {
                    Ok(fr) => {
                        if let Ok(d) = fr.into_data() {
                            got.extend_from_slice(&d);
                        }
                    }
                    Err(_) => {
                        errored = true;
                        break;
                    }
                }
            }
            if status == 502 {
                tally.reset_502.fetch_add(1, Ordering::Relaxed);
            } else {
                assert_eq!(status, 200, "request {i}");
                assert!(
                    f.body.starts_with(&got),
                    "request {i} ({}): a reset response is a prefix of the fixture",
                    f.name
                );
                assert!(
                    errored || got.len() == f.body.len(),
                    "request {i} ({}): a reset stream ends in an error",
                    f.name
                );
                tally.reset_partial.fetch_add(1, Ordering::Relaxed);
            }
        }
        Plan::Complete | Plan::LeaveMidRequest => {
            assert_eq!(resp.status(), 200, "request {i} ({})", f.name);
            let got = within(30, resp.into_body().collect())
                .await
                .unwrap_or_else(|e| panic!("request {i} ({}): body: {e}", f.name))
                .to_bytes();
            assert!(
                got == f.body,
                "request {i} ({}): {} bytes back, fixture has {}",
                f.name,
                got.len(),
                f.body.len()
            );
            tally.complete.fetch_add(1, Ordering::Relaxed);
        }
    }
}

async fn run_batch(
    count: usize,
    offset: usize,
    fx: &Arc<Vec<Fx>>,
    base: &str,
    tally: &Arc<Tally>,
    soak: bool,
) {
    let h1: TestClient = Client::builder(TokioExecutor::new()).build_http();
    let h2: TestClient = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for _ in 0..CONCURRENCY {
        let (fx, h1, h2, next, tally) = (
            Arc::clone(fx),
            h1.clone(),
            h2.clone(),
            Arc::clone(&next),
            Arc::clone(tally),
        );
        let base = base.to_string();
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                one(offset + i, &fx, &h1, &h2, &base, &tally, soak).await;
            }
        }));
    }
    for w in workers {
        within(120, w)
            .await
            .expect("worker finished without a panic");
    }
}

/// Poll until `f` holds (bounded), returning the last observation.
async fn settle<T: Copy + std::fmt::Debug>(
    secs: u64,
    mut observe: impl FnMut() -> T,
    ok: impl Fn(T) -> bool,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tick.tick().await;
        let v = observe();
        if ok(v) || Instant::now() > deadline {
            return v;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_mixed_requests_with_disconnects_and_resets() {
    let started = Instant::now();
    let fx = Arc::new(fixtures());
    assert!(fx.len() >= 20, "fixtures of all five APIs");
    let up_fx = Arc::clone(&fx);
    let up = faults::start_with(
        faults::handler(move |req| {
            let which: usize = req
                .headers()
                .get("x-fixture")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let seed: u64 = req
                .headers()
                .get("x-seed")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let f = &up_fx[which % up_fx.len()];
            let mut rng = Rng::new(seed ^ 0xABCD);
            let chunks = cut(&f.body, &mut rng);
            let body = if req.headers().contains_key("x-test-reset") {
                let keep = rng.below(chunks.len() as u64) as usize;
                if rng.below(2) == 0 {
                    faults::then_reset_flushed(chunks[..keep].to_vec())
                } else {
                    faults::then_reset(chunks[..keep].to_vec())
                }
            } else {
                faults::chunks(chunks)
            };
            Response::builder()
                .status(200)
                .header("content-type", f.ct)
                .body(body)
                .unwrap()
        }),
        false,
    )
    .await;
    let px = support::proxy(
        &up.url(),
        &["--route", &format!("/v1/messages={}", up.url())],
    )
    .await;
    let base = format!("http://{}", px.addr);

    // Warm up at full concurrency, then take the baseline.
    let warm = Arc::new(Tally::default());
    run_batch(WARMUP, 1_000_000, &fx, &base, &warm, false).await;
    assert_eq!(warm.complete.load(Ordering::Relaxed), WARMUP);
    let mut last = usize::MAX;
    let fd_base = settle(
        10,
        || {
            let v = open_fds();
            let stable = v == last;
            last = v;
            (v, stable)
        },
        |(_, stable)| stable,
    )
    .await
    .0;
    let rss_base = rss_kib();

    // /readyz, polled throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let ready_polls = Arc::new(AtomicUsize::new(0));
    let poller = {
        let stop = Arc::clone(&stop);
        let polls = Arc::clone(&ready_polls);
        let url = px.admin_url("/readyz");
        tokio::spawn(async move {
            let c: TestClient = Client::builder(TokioExecutor::new()).build_http();
            let mut tick = tokio::time::interval(Duration::from_millis(25));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let t = Instant::now();
                let (parts, _) = support::get(&c, &url).await;
                assert_eq!(parts.status, 200, "/readyz during the soak");
                assert!(
                    t.elapsed() < Duration::from_secs(2),
                    "/readyz answered slowly: {:?}",
                    t.elapsed()
                );
                polls.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    let tally = Arc::new(Tally::default());
    let soak_start = Instant::now();
    // In two halves: memory that keeps growing in the second half is a leak.
    run_batch(REQUESTS / 2, 0, &fx, &base, &tally, true).await;
    let rss_mid = rss_kib();
    run_batch(
        REQUESTS - REQUESTS / 2,
        REQUESTS / 2,
        &fx,
        &base,
        &tally,
        true,
    )
    .await;
    let rss_end = rss_kib();
    let soak_time = soak_start.elapsed();
    stop.store(true, Ordering::Relaxed);
    within(10, poller).await.expect("/readyz stayed 200");

    let complete = tally.complete.load(Ordering::Relaxed);
    let resets = tally.reset_partial.load(Ordering::Relaxed)
        + tally.reset_502.load(Ordering::Relaxed)
        + tally.reset_closed.load(Ordering::Relaxed);
    let left = tally.left.load(Ordering::Relaxed);
    assert_eq!(complete + resets + left, REQUESTS);
    assert!(resets >= REQUESTS * 3 / 100, "about 5% reset: {resets}");
    assert!(left >= REQUESTS * 7 / 100, "about 10% left: {left}");
    assert!(ready_polls.load(Ordering::Relaxed) > 0);

    // Still serving, byte for byte.
    let after = Arc::new(Tally::default());
    run_batch(fx.len() * 2, 2_000_000, &fx, &base, &after, false).await;
    assert_eq!(after.complete.load(Ordering::Relaxed), fx.len() * 2);

    // Descriptors and memory come back.
    let fds = settle(15, open_fds, |v| v <= fd_base + FD_SLACK).await;
    let rss = rss_kib();
    eprintln!(
        "soak: {REQUESTS} requests in {soak_time:?} ({:.0} req/s): {complete} complete and byte-equal, \
         {} reset after a prefix, {} reset before headers (502), {} closed before a response head, {left} clients left early; \
         /readyz polled {} times; fds {fd_base} -> {fds} (slack {FD_SLACK}); \
         RSS {} MiB -> {} MiB at half -> {} MiB at end -> {} MiB after (slack {RSS_SLACK_MIB} MiB); total {:?}",
        REQUESTS as f64 / soak_time.as_secs_f64(),
        tally.reset_partial.load(Ordering::Relaxed),
        tally.reset_502.load(Ordering::Relaxed),
        tally.reset_closed.load(Ordering::Relaxed),
        ready_polls.load(Ordering::Relaxed),
        rss_base / 1024,
        rss_mid / 1024,
        rss_end / 1024,
        rss / 1024,
        started.elapsed()
    );
    assert!(
        fds <= fd_base + FD_SLACK,
        "open descriptors {fds}, baseline {fd_base}: a leak"
    );
    assert!(
        rss_end <= rss_mid + RSS_PLATEAU_MIB * 1024,
        "RSS still growing: {rss_mid} KiB at half, {rss_end} KiB at the end"
    );
    assert!(
        rss <= rss_base + RSS_SLACK_MIB * 1024,
        "RSS {} KiB, baseline {} KiB",
        rss,
        rss_base
    );
    let (parts, _) = support::get(&support::client_h1(), &px.admin_url("/readyz")).await;
    assert_eq!(parts.status, 200);
    px.stop().await;
    // About 27 s in debug on an idle 2-core machine, 52 s with the machine
    // under a load of 20; the bound catches a hang, not a slow machine.
    assert!(
        started.elapsed() < Duration::from_secs(150),
        "the soak is bounded: {:?}",
        started.elapsed()
    );
}
