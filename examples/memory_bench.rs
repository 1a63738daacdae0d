//! Memory under a flood of sessions: push N distinct session ids
//! (`x-session-id`, default 1,000,000) through the release binary over
//! loopback to a trivial in-process upstream (small non-stream responses with
//! usage), and report the proxy's RSS before, during and after, the sessions
//! it holds (capped by `--max-sessions`) and the request rate.
//!
//!     cargo build --release --bin tidemark
//!     cargo run --release --example memory_bench [-- --requests 1000000 --max-sessions 100000 --concurrency 64]
//!
//! The proxy runs as its own process (`target/release/tidemark`, or
//! `--bin PATH`), so its RSS is read alone from `/proc/PID/status`.

use std::convert::Infallible;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Body = UnsyncBoxBody<Bytes, Infallible>;

const ANSWER: &str = r#"{"id":"chatcmpl-m","object":"chat.completion","created":1,"model":"gpt-4o","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41}}"#;

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

async fn upstream() -> std::net::SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind upstream");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(ANSWER.as_bytes())))
                            .expect("response"),
                    )
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

async fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    l.local_addr().expect("addr").port()
}

#[tokio::main]
async fn main() {
    let requests: usize = arg("--requests")
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let max_sessions: usize = arg("--max-sessions")
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let concurrency: usize = arg("--concurrency")
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let bin = arg("--bin").unwrap_or_else(|| {
        let me = std::env::current_exe().expect("own path");
        // target/release/examples/memory_bench -> target/release/tidemark
        me.parent()
            .and_then(|p| p.parent())
            .map(|p| p.join("tidemark").to_string_lossy().into_owned())
            .expect("target dir")
    });

    let up = upstream().await;
    let listen = free_port().await;
    let admin = free_port().await;
    let mut child = tokio::process::Command::new(&bin)
        .args([
            "--listen",
            &format!("127.0.0.1:{listen}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
            "--upstream",
            &format!("http://{up}"),
            "--max-sessions",
            &max_sessions.to_string(),
        ])
        .env("TIDEMARK_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{bin}: {e} (cargo build --release --bin tidemark first)"));
    let pid = child.id().expect("proxy pid");

    let client: Client<_, Body> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .build_http();
    let admin_url = format!("http://127.0.0.1:{admin}");
    let get = |path: &str| {
        let client = client.clone();
        let url = format!("{admin_url}{path}");
        async move {
            let req = Request::get(url)
                .body(Full::new(Bytes::new()).boxed_unsync())
                .expect("request");
            match tokio::time::timeout(Duration::from_secs(10), client.request(req)).await {
                Ok(Ok(r)) => {
                    let status = r.status().as_u16();
                    let b = r
                        .into_body()
                        .collect()
                        .await
                        .map(|c| c.to_bytes())
                        .unwrap_or_default();
                    Some((status, String::from_utf8_lossy(&b).into_owned()))
                }
                _ => None,
            }
        }
    };
    let t = Instant::now();
    while get("/readyz").await.map(|r| r.0) != Some(200) {
        if t.elapsed() > Duration::from_secs(20) {
            panic!("the proxy did not come up");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rss_start = rss_kib(pid);

    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let url = format!("http://127.0.0.1:{listen}/v1/chat/completions");
    let start = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let (client, next, done, failed, url) = (
            client.clone(),
            Arc::clone(&next),
            Arc::clone(&done),
            Arc::clone(&failed),
            url.clone(),
        );
        workers.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= requests {
                    break;
                }
                let body = format!(
                    r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"turn of session {i}"}}]}}"#
                );
                let req = Request::post(url.as_str())
                    .header("content-type", "application/json")
                    .header("x-session-id", format!("bench-session-{i:08}"))
                    .body(Full::new(Bytes::from(body)).boxed_unsync())
                    .expect("request");
                let ok = match client.request(req).await {
                    Ok(r) => {
                        let s = r.status().is_success();
                        s && r.into_body().collect().await.is_ok()
                    }
                    Err(_) => false,
                };
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let mut peak = rss_start;
    let step = (requests / 10).max(1);
    let mut next_report = step;
    println!(
        "memory_bench: {requests} distinct session ids, --max-sessions {max_sessions}, concurrency {concurrency}"
    );
    println!("  start: RSS {:.1} MiB", rss_start as f64 / 1024.0);
    while workers.iter().any(|w| !w.is_finished()) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let rss = rss_kib(pid);
        peak = peak.max(rss);
        let d = done.load(Ordering::Relaxed);
        if d >= next_report {
            println!(
                "  {d:>9} requests: RSS {:.1} MiB, {:.0} req/s",
                rss as f64 / 1024.0,
                d as f64 / start.elapsed().as_secs_f64()
            );
            next_report += step;
        }
    }
    for w in workers {
        let _ = w.await;
    }
    let took = start.elapsed();
    let rss_end = rss_kib(pid);
    let held = get("/sessions?limit=0")
        .await
        .and_then(|(_, b)| serde_json::from_str::<serde_json::Value>(&b).ok())
        .and_then(|v| v["total"].as_u64());
    let metrics = get("/metrics").await.map(|(_, b)| b).unwrap_or_default();
    let gauge: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("tidemark_sessions{") || l.starts_with("tidemark_sessions "))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum();
    println!(
        "  end: {} requests ({} failed) in {:.1}s = {:.0} req/s",
        requests,
        failed.load(Ordering::Relaxed),
        took.as_secs_f64(),
        requests as f64 / took.as_secs_f64()
    );
    println!(
        "  RSS: start {:.1} MiB, peak {:.1} MiB, end {:.1} MiB ({:.0} bytes per held session)",
        rss_start as f64 / 1024.0,
        peak as f64 / 1024.0,
        rss_end as f64 / 1024.0,
        match held {
            Some(h) if h > 0 => (rss_end.saturating_sub(rss_start) * 1024) as f64 / h as f64,
            _ => 0.0,
        }
    );
    println!(
        "  sessions held: {} (/sessions total), {} (tidemark_sessions gauge), cap {max_sessions}",
        held.map(|h| h.to_string()).unwrap_or_else(|| "?".into()),
        gauge
    );
    if let Some(h) = held {
        if h as usize > max_sessions {
            eprintln!("  FAIL: more sessions held than --max-sessions");
            std::process::exit(1);
        }
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
}
