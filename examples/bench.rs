//! Throughput and latency of tidemark against a direct connection and nginx
//! (a pass-through proxy that parses nothing: the floor for any proxy), all
//! measured in one run on this machine.
//!
//!     cargo run --release --example bench [-- --secs 3] [--only tidemark,tap-off,otel-on] [--scenario stream] [--repeat 5] [--warmup 0.3] [--session-per-conn] [--workers N] [--nginx-one-process]
//!
//! Columns: `direct`; `nginx`; `tidemark`; `hyper`, a bare hyper proxy on
//! hyper's own pooled client (what a proxy built the obvious way with hyper
//! reaches); `tap-off`, tidemark with the hidden `--no-tap` on the two API
//! rows, so the tap's cost is measured in the same run; `otel-on`, tidemark
//! exporting OpenTelemetry spans and metrics (`--otlp-endpoint`) to an
//! in-process collector that reads and discards them, on the two API rows. `proxy us/req` is
//! the proxy's own CPU time per request (its threads or nginx's worker
//! processes, from /proc): steadier than requests/s on a shared machine.
//! `of: user` is its user-space part: the kernel's part (sockets, wakeups)
//! is much the same for any proxy, so this is where proxies differ.
//! Each cell follows `--warmup SECS` (0.3) of the same load, unmeasured.
//! `--repeat N` takes N rounds, targets in turn (each round starting one
//! target further along), and reports medians, and
//! tidemark's ratio to nginx round by round (the two cells of a round ran
//! seconds apart, so the machine's drift moves both alike). On the
//! 32-connection rows it also prints the share of request time spent in
//! requests over 1 ms: requests/s is connections over mean latency, so a
//! tail the p50 does not show costs throughput. The
//! last section (`--scenario beside`) runs slow streams beside cold 2 MB
//! histories and reports the streams' time to first byte.
//!
//! The upstream, tidemark (its `--workers` threads, and a runtime for its
//! accept loop) and the load generator each get their own threads; nginx (Debian package, `proxy_buffering off`) runs as its own
//! process when `nginx` is on PATH, and is skipped with a note otherwise.

/// The allocator the binary ships with (src/main.rs).
#[path = "../src/alloc.rs"]
mod alloc;
#[global_allocator]
static GLOBAL: alloc::Mimalloc = alloc::Mimalloc;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

type Body = UnsyncBoxBody<Bytes, Infallible>;

const NONSTREAM: &str = include_str!("../tests/fixtures/openai-chat/nonstream_basic.json");

fn stream_chunks(n: usize) -> Vec<Bytes> {
    let mut v: Vec<Bytes> = (0..n)
        .map(|i| Bytes::from(format!("data: {{\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"token {i} \"}},\"finish_reason\":null}}],\"usage\":null}}\n\n")))
        .collect();
    v.push(Bytes::from_static(b"data: {\"id\":\"chatcmpl-b\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":1000,\"completion_tokens\":20,\"total_tokens\":1020}}\n\ndata: [DONE]\n\n"));
    v
}

/// An idle OTLP collector: every export is read whole and answered 200
/// with nothing, as a collector that keeps up does.
async fn idle_collector() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

/// The in-process upstream: `/fast` non-stream, `/stream` 20 chunks at once,
/// `/slow` one chunk after 20 ms (time to first byte), `/think` after 100 ms.
async fn upstream() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let svc = service_fn(|req: Request<Incoming>| async move {
                    let path = req.uri().path().to_string();
                    let _ = req.into_body().collect().await;
                    let resp: Response<Body> = if path.contains("/stream/") {
                        let s = futures_util::stream::iter(
                            stream_chunks(20)
                                .into_iter()
                                .map(|b| Ok::<_, Infallible>(Frame::data(b))),
                        );
                        Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(StreamBody::new(s).boxed_unsync())
                            .unwrap()
                    } else if path.contains("/slow/") || path.contains("/think/") {
                        // `/think/`: a model that thinks 100 ms before its first token.
                        let wait = if path.contains("/think/") { 100 } else { 20 };
                        let s = futures_util::stream::unfold(0u8, move |i| async move {
                            match i {
                                0 => {
                                    tokio::time::sleep(Duration::from_millis(wait)).await;
                                    Some((
                                        Ok::<_, Infallible>(Frame::data(
                                            stream_chunks(1).remove(0),
                                        )),
                                        1,
                                    ))
                                }
                                _ => None,
                            }
                        });
                        Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(StreamBody::new(s).boxed_unsync())
                            .unwrap()
                    } else {
                        Response::builder()
                            .header("content-type", "application/json")
                            .body(
                                Full::new(Bytes::from_static(NONSTREAM.as_bytes())).boxed_unsync(),
                            )
                            .unwrap()
                    };
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

fn history_body(bytes: usize) -> String {
    let mut msgs =
        vec![serde_json::json!({"role":"system","content":"You are a careful coding agent."})];
    let mut i = 0;
    let mut size = 0;
    while size < bytes {
        let text = match i % 4 {
            0 => format!("Please refactor module {i}: the parser reads tokens, then builds a tree of nodes for every statement."),
            1 => format!("{{\"tool\":\"read_file\",\"path\":\"src/m{i}.rs\",\"lines\":[{i},{},{}],\"ok\":true}}", i + 1, i + 2),
            2 => "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n    println!(\"{:?}\", v);\n}\n".repeat(3),
            _ => "日本語のテキストと絵文字 🚀✨ も含まれています。".repeat(3),
        };
        size += text.len() + 40;
        msgs.push(
            serde_json::json!({"role": if i % 2 == 0 {"user"} else {"assistant"}, "content": text}),
        );
        i += 1;
    }
    serde_json::json!({"model":"gpt-4o","messages":msgs}).to_string()
}

struct Stats {
    rps: f64,
    /// Requests completed (for CPU per request).
    n: usize,
    p50: Duration,
    p99: Duration,
    /// The share of all request time spent in requests over 1 ms: with a
    /// fixed number of connections requests/s is connections over mean
    /// latency, so a tail the p50 does not show still costs throughput.
    slow: f64,
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

/// `conc` clients send `body` to `url` for `secs`; full responses are read.
/// `body` with a number unique to this request at the start of every
/// message's content, so no message is in the estimator's cache: a history
/// tidemark has never seen (after a restart, or a compaction rewrote it).
fn fresh(body: &[u8], n: u64) -> Bytes {
    let mark = b"\"content\":\"";
    let mut out = Vec::with_capacity(body.len() + body.len() / 8);
    let mut rest = body;
    while let Some(i) = memchr::memmem::find(rest, mark) {
        out.extend_from_slice(&rest[..i + mark.len()]);
        out.extend_from_slice(format!("r{n} ").as_bytes());
        rest = &rest[i + mark.len()..];
    }
    out.extend_from_slice(rest);
    Bytes::from(out)
}

async fn load(url: String, body: Bytes, conc: usize, secs: f64, ttfb: bool) -> Stats {
    load_with(url, body, conc, secs, ttfb, false).await
}

async fn load_with(
    url: String,
    body: Bytes,
    conc: usize,
    secs: f64,
    ttfb: bool,
    cold: bool,
) -> Stats {
    static REQUEST: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(conc * 2)
        .build_http();
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut tasks = Vec::new();
    // `--session-per-conn`: each connection is its own agent session
    // (`x-session-id`), instead of all of them being one session.
    let per_conn = std::env::args().any(|a| a == "--session-per-conn");
    for conn in 0..conc {
        let (client, url, body, stop) =
            (client.clone(), url.clone(), body.clone(), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let session = format!("bench-{conn}");
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let mut req = Request::post(&url).header("content-type", "application/json");
                if per_conn {
                    req = req.header("x-session-id", &session);
                }
                let body = if cold {
                    fresh(&body, REQUEST.fetch_add(1, Ordering::Relaxed))
                } else {
                    body.clone()
                };
                let req = req.body(Full::new(body)).unwrap();
                let Ok(resp) = client.request(req).await else {
                    continue;
                };
                let mut b = resp.into_body();
                let mut first = None;
                while let Some(f) = b.frame().await {
                    if first.is_none() {
                        first = Some(t.elapsed());
                    }
                    if f.is_err() {
                        break;
                    }
                }
                lat.push(if ttfb {
                    first.unwrap_or_else(|| t.elapsed())
                } else {
                    t.elapsed()
                });
            }
            lat
        }));
    }
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let elapsed = start.elapsed().as_secs_f64();
    let n = all.len();
    let total: Duration = all.iter().sum();
    let slow: Duration = all.iter().filter(|d| d.as_micros() > 1000).sum();
    Stats {
        rps: n as f64 / elapsed,
        n,
        p50: pct(&mut all, 0.5),
        p99: pct(&mut all, 0.99),
        slow: slow.as_secs_f64() / total.as_secs_f64().max(f64::MIN_POSITIVE),
    }
}

/// CPU time (user, system) of this process's threads whose name starts
/// with `prefix`, or of every process whose parent is `ppid` (nginx's
/// workers), from /proc. Clock ticks are 10 ms; cells run for seconds.
fn cpu_secs(prefix: &str, ppid: Option<u32>) -> (f64, f64) {
    let tick = 100.0; // sysconf(_SC_CLK_TCK) on Linux
    let fields = |stat: &str| -> Option<(u32, u64, u64)> {
        // comm may hold spaces: fields start after the last ')'.
        let rest = stat.get(stat.rfind(')')? + 2..)?;
        let f: Vec<&str> = rest.split_whitespace().collect();
        Some((
            f.get(1)?.parse().ok()?,
            f.get(11)?.parse::<u64>().ok()?,
            f.get(12)?.parse::<u64>().ok()?,
        ))
    };
    let (mut user, mut sys) = (0u64, 0u64);
    if let Some(ppid) = ppid {
        for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            if let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) {
                if let Some((pp, u, s)) = fields(&stat) {
                    if pp == ppid {
                        user += u;
                        sys += s;
                    }
                }
            }
        }
    } else {
        for e in std::fs::read_dir("/proc/self/task")
            .into_iter()
            .flatten()
            .flatten()
        {
            let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
            if comm.starts_with(prefix) {
                if let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) {
                    if let Some((_, u, s)) = fields(&stat) {
                        user += u;
                        sys += s;
                    }
                }
            }
        }
    }
    (user as f64 / tick, sys as f64 / tick)
}

fn nginx(upstream: SocketAddr) -> Option<(std::process::Child, u16, std::path::PathBuf)> {
    let bin = ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let dir = std::env::temp_dir().join(format!("tidemark-bench-nginx-{port}"));
    std::fs::create_dir_all(&dir).ok()?;
    let conf = format!(
        "{mp}worker_processes 2;\ndaemon off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\nevents {{ worker_connections 4096; }}\nhttp {{\n  access_log off;\n  client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fcgi; uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;\n  client_max_body_size 64m;\n  client_body_buffer_size 1m;\n  upstream up {{ server {u}; keepalive 256; }}\n  server {{\n    listen 127.0.0.1:{port};\n    location / {{\n      proxy_pass http://up;\n      proxy_http_version 1.1;\n      proxy_set_header Connection \"\";\n      proxy_buffering off;\n      proxy_request_buffering off;\n    }}\n  }}\n}}\n",
        d = dir.display(),
        // `--nginx-one-process`: nginx serves from its master process. For
        // callgrind (scripts/instructions.sh), which wrote no profile for
        // the forked workers.
        mp = if std::env::args().any(|a| a == "--nginx-one-process") {
            "master_process off;\n"
        } else {
            ""
        },
        u = upstream
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).ok()?;
    let child = std::process::Command::new(bin)
        .arg("-c")
        .arg(&path)
        .arg("-e")
        .arg(dir.join("error.log"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    for _ in 0..200 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Some((child, port, dir));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    None
}

/// A bare hyper proxy (http1 server, pooled legacy client, bodies passed
/// through untouched): the ceiling for any hyper-based proxy on this box.
async fn bare_proxy(upstream: SocketAddr) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.set_nodelay(true);
    let client: Client<_, Incoming> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build(http);
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let _ = s.set_nodelay(true);
            let client = client.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| {
                    let client = client.clone();
                    async move {
                        let (mut parts, body) = req.into_parts();
                        parts.uri = format!("http://{upstream}{}", parts.uri.path())
                            .parse()
                            .unwrap();
                        let resp = client.request(Request::from_parts(parts, body)).await?;
                        Ok::<_, hyper_util::client::legacy::Error>(resp)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    addr
}

fn runtime(threads: usize, name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap()
}

fn main() {
    let secs: f64 = std::env::args()
        .skip_while(|a| a != "--secs")
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    // `--only tidemark,tap-off` / `--scenario small`: run a subset.
    let arg = |name: &str| {
        std::env::args()
            .skip_while(|a| a != name)
            .nth(1)
            .unwrap_or_default()
    };
    let (only, scenario) = (arg("--only"), arg("--scenario"));
    let repeat: usize = arg("--repeat").parse().unwrap_or(1).max(1);
    // `--warmup SECS`: unmeasured load on a target right before each of its
    // cells. A cell that follows another target's ran slower for a moment
    // (a longer tail, 5-8% fewer requests/s, gone within a second), so
    // without it whichever target came second paid for the switch.
    let warmup: f64 = arg("--warmup").parse().unwrap_or(0.3);
    let up_rt = runtime(2, "bench-upstream");
    let up = up_rt.block_on(upstream());

    // `--proxy-rt multi2` (default: tokio's multi-thread scheduler, 2
    // workers, as `#[tokio::main]` gives it on this box), `multi1`, or
    // `current1` (one thread, tokio's current-thread scheduler): the runtime
    // of the bare hyper proxy and of tidemark's accept loop (tidemark serves
    // connections on worker threads of its own).
    let rt_kind = arg("--proxy-rt");
    // `--workers N`: tidemark's worker threads (default: one per core).
    let workers = arg("--workers");
    let current_thread = || {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("bench-tidemark".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                tx.send(rt.handle().clone()).unwrap();
                rt.block_on(std::future::pending::<()>());
            })
            .unwrap();
        rx.recv().unwrap()
    };
    let _px_rt;
    let px_rt: tokio::runtime::Handle = match rt_kind.as_str() {
        "current1" => current_thread(),
        "multi1" => {
            _px_rt = runtime(1, "bench-tidemark");
            _px_rt.handle().clone()
        }
        _ => {
            _px_rt = runtime(2, "bench-tidemark");
            _px_rt.handle().clone()
        }
    };
    let start_tidemark = |extra: &[&str]| {
        px_rt.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let a = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let (upstream, route) = (format!("http://{up}"), format!("/v1/messages=http://{up}"));
            let mut args = vec!["tidemark", "--upstream", &upstream, "--route", &route];
            args.extend_from_slice(extra);
            if !workers.is_empty() {
                args.extend_from_slice(&["--workers", &workers]);
            }
            let config = tidemark::Config::from_args(args).unwrap();
            tokio::spawn(tidemark::run(l, a, config, std::future::pending()));
            addr
        })
    };
    let px_addr = start_tidemark(&[]);
    // The same proxy with usage reading off (hidden `--no-tap`): what the tap costs.
    let notap_addr = start_tidemark(&["--no-tap"]);
    // The same proxy exporting spans and metrics to an idle collector: what
    // OpenTelemetry export costs.
    let collector = format!("http://{}", up_rt.block_on(idle_collector()));
    let otel_addr = start_tidemark(&["--otlp-endpoint", &collector]);
    let ngx = nginx(up);
    let bare = px_rt.block_on(bare_proxy(up));

    let gen = runtime(2, "bench-load");
    let small = Bytes::from_static(br#"{"model":"gpt-4o","messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Say hi."}]}"#);
    let stream = Bytes::from_static(br#"{"model":"gpt-4o","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"Count to twenty."}]}"#);
    let big = Bytes::from(history_body(400 * 1024));

    let mut targets: Vec<(&str, String)> = vec![
        ("direct", format!("http://{up}")),
        ("tidemark", format!("http://{px_addr}")),
    ];
    targets.push(("hyper", format!("http://{bare}")));
    targets.push(("tap-off", format!("http://{notap_addr}")));
    targets.push(("otel-on", format!("http://{otel_addr}")));
    if let Some((_, port, _)) = &ngx {
        targets.insert(1, ("nginx", format!("http://127.0.0.1:{port}")));
    } else {
        println!("note: nginx not found (apt-get install nginx-light); its column is skipped");
    }

    let scenarios: [(&str, &str, &Bytes, usize, bool); 7] = [
        (
            "small non-stream, 32 conc",
            "/v1/chat/completions",
            &small,
            32,
            false,
        ),
        (
            // A path tidemark does not read: the proxy alone.
            "small non-stream, untapped",
            "/v1/raw",
            &small,
            32,
            false,
        ),
        (
            "20-chunk stream, 32 conc",
            "/v1/stream/chat/completions",
            &stream,
            32,
            false,
        ),
        (
            // The same stream on a path tidemark does not read: no inspect,
            // no session, no tap. The difference to the row above is their cost.
            "20-chunk stream, untapped",
            "/v1/stream/raw",
            &stream,
            32,
            false,
        ),
        (
            "400 KB history, 8 conc",
            "/v1/chat/completions",
            &big,
            8,
            false,
        ),
        (
            "slow stream TTFB, 4 conc",
            "/v1/slow/chat/completions",
            &stream,
            4,
            true,
        ),
        (
            // Every request a 400 KB history never seen before, to a model
            // that thinks 100 ms: the estimate from scratch (tens of ms)
            // runs while the upstream thinks, or before it is asked.
            "cold 400 KB TTFB, 2 conc",
            "/v1/think/chat/completions",
            &big,
            2,
            true,
        ),
    ];
    println!("tidemark bench: {secs}s per cell (median of {repeat}), upstream and load on 2-thread runtimes of their own, tidemark on its --workers threads, {} cores", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    println!(
        "{:<28} {:<9} {:>10} {:>10} {:>10} {:>10} {:>9} {:>12} {:>8}",
        "scenario",
        "target",
        "req/s",
        "p50 ms",
        "p99 ms",
        "vs direct",
        "vs nginx",
        "proxy us/req",
        "of: user"
    );
    targets.retain(|(t, _)| *t == "direct" || only.split(',').any(|o| t.contains(o)));
    for (name, path, body, conc, ttfb) in scenarios {
        if !name.contains(scenario.as_str()) {
            continue;
        }
        // Every cell is preceded by `--warmup` seconds of the same load,
        // unmeasured (pools, the estimator's cache, and the switch from the
        // previous target). `--repeat N`: the targets take turns N times and
        // each reports its median cell, so a burst of load from a neighbour
        // on this shared machine lands on one cell of every target, not on
        // all of one; round r starts r targets further along, so no target
        // always follows the same one.
        // A cell's CPU per request: (user + system, user).
        type Cpu = Option<(f64, f64)>;
        type Cells = Vec<(Stats, Cpu)>;
        let mut runs: Vec<(&str, Cells)> = Vec::new();
        for round in 0..repeat {
            let mut order: Vec<_> = targets.iter().collect();
            let turn = round % order.len();
            order.rotate_left(turn);
            for (tname, base) in order {
                if matches!(*tname, "tap-off" | "otel-on") && !name.ends_with("32 conc") {
                    continue;
                }
                gen.block_on(load(
                    format!("{base}{path}"),
                    body.clone(),
                    conc,
                    warmup,
                    ttfb,
                ));
                // The proxy's own CPU: tidemark's worker threads and the
                // runtime that accepts for it (which also hosts the bare
                // hyper proxy; one target is loaded at a time), or nginx's
                // worker processes.
                // (user + system, user): the kernel's share of a proxy's
                // work is much the same for any proxy; user space is its own.
                let cpu = || match *tname {
                    "direct" => None,
                    "nginx" => ngx.as_ref().map(|(c, _, _)| cpu_secs("", Some(c.id()))),
                    _ => {
                        let (a, b) = (
                            cpu_secs("bench-tidemark", None),
                            cpu_secs("tidemark-w", None),
                        );
                        Some((a.0 + b.0, a.1 + b.1))
                    }
                };
                let before = cpu();
                let s = gen.block_on(load_with(
                    format!("{base}{path}"),
                    body.clone(),
                    conc,
                    secs,
                    ttfb,
                    name.starts_with("cold"),
                ));
                let n = s.n.max(1) as f64;
                let used = cpu()
                    .zip(before)
                    .map(|(a, b)| ((a.0 + a.1 - b.0 - b.1) / n, (a.0 - b.0) / n));
                match runs.iter_mut().find(|(t, _)| t == tname) {
                    Some((_, v)) => v.push((s, used)),
                    None => runs.push((*tname, vec![(s, used)])),
                }
            }
        }
        // Added time to first byte, round by round against direct's cell of
        // the same round, then the median: a lull or burst on this shared
        // machine moves both cells of a round alike.
        let added_ttfb: Vec<(&str, f64)> = match runs.iter().find(|(t, _)| *t == "direct") {
            Some((_, direct)) if ttfb => runs
                .iter()
                .filter(|(t, _)| *t != "direct")
                .map(|(t, cells)| {
                    let mut d: Vec<f64> = cells
                        .iter()
                        .zip(direct)
                        .map(|((s, _), (ds, _))| s.p50.as_secs_f64() - ds.p50.as_secs_f64())
                        .collect();
                    d.sort_by(f64::total_cmp);
                    (*t, d[d.len() / 2])
                })
                .collect(),
            _ => Vec::new(),
        };
        // The tap's cost, round by round (the two cells of a round ran back
        // to back), then the median: less moved by the machine's drift than
        // the two medians' ratio, printed next to it.
        let cells = |t: &str| runs.iter().find(|(n, _)| *n == t).map(|(_, c)| c);
        let paired = |with: &str, without: &str| {
            cells(with).zip(cells(without)).map(|(on, off)| {
                let mut lost: Vec<f64> = on
                    .iter()
                    .zip(off)
                    .map(|((a, _), (b, _))| 1.0 - a.rps / b.rps)
                    .collect();
                let mut cpu: Vec<f64> = on
                    .iter()
                    .zip(off)
                    .filter_map(|((_, a), (_, b))| Some(a.as_ref()?.0 - b.as_ref()?.0))
                    .collect();
                lost.sort_by(f64::total_cmp);
                cpu.sort_by(f64::total_cmp);
                (lost[lost.len() / 2], cpu.get(cpu.len() / 2).copied(), lost)
            })
        };
        // OpenTelemetry export's cost, the same way: `otel-on` against
        // `tidemark` (export off), round by round.
        let otel_paired = paired("otel-on", "tidemark");
        let tap_paired = cells("tidemark").zip(cells("tap-off")).map(|(on, off)| {
            let mut lost: Vec<f64> = on
                .iter()
                .zip(off)
                .map(|((a, _), (b, _))| 1.0 - a.rps / b.rps)
                .collect();
            let mut cpu: Vec<f64> = on
                .iter()
                .zip(off)
                .filter_map(|((_, a), (_, b))| Some(a.as_ref()?.0 - b.as_ref()?.0))
                .collect();
            lost.sort_by(f64::total_cmp);
            cpu.sort_by(f64::total_cmp);
            (lost[lost.len() / 2], cpu.get(cpu.len() / 2).copied(), lost)
        });
        // tidemark against nginx the same way: each round's two cells ran
        // within seconds of each other, so their ratio is steadier than the
        // ratio of the two medians when nginx itself drifts by a third.
        let vs_nginx = cells("tidemark").zip(cells("nginx")).map(|(t, n)| {
            let mut r: Vec<f64> = t
                .iter()
                .zip(n)
                .map(|((a, _), (b, _))| a.rps / b.rps)
                .collect();
            r.sort_by(f64::total_cmp);
            r
        });
        // The tail's share of request time, median over rounds (32-connection
        // rows only: elsewhere a millisecond is the normal latency).
        let mut tails: Vec<String> = Vec::new();
        if conc == 32 {
            for (t, cells) in &runs {
                let mut v: Vec<f64> = cells.iter().map(|(s, _)| s.slow).collect();
                v.sort_by(f64::total_cmp);
                tails.push(format!("{t} {:.1}%", v[v.len() / 2] * 100.0));
            }
        }
        let results: Vec<(&str, Stats, Cpu)> = runs
            .into_iter()
            .map(|(t, mut v)| {
                v.sort_by(|a, b| a.0.rps.total_cmp(&b.0.rps));
                let (s, cpu) = v.swap_remove(v.len() / 2);
                (t, s, cpu)
            })
            .collect();
        let nginx_rps = results
            .iter()
            .find(|(t, _, _)| *t == "nginx")
            .map(|(_, s, _)| s.rps);
        let direct_rps = results
            .iter()
            .find(|(t, _, _)| *t == "direct")
            .map(|(_, s, _)| s.rps)
            .unwrap_or(f64::NAN);
        for (tname, s, cpu) in &results {
            let vs = nginx_rps
                .map(|n| format!("{:.2}x", s.rps / n))
                .unwrap_or_else(|| "-".into());
            let (cpu, user) = match cpu {
                Some((c, u)) => (format!("{:.1}", c * 1e6), format!("{:.1}", u * 1e6)),
                None => ("-".into(), "-".into()),
            };
            println!(
                "{:<28} {:<9} {:>10.0} {:>10.3} {:>10.3} {:>9.2}x {:>9} {:>12} {:>8}",
                name,
                tname,
                s.rps,
                s.p50.as_secs_f64() * 1e3,
                s.p99.as_secs_f64() * 1e3,
                s.rps / direct_rps,
                vs,
                cpu,
                user
            );
        }
        let rps_of = |t: &str| {
            results
                .iter()
                .find(|(n, _, _)| *n == t)
                .map(|(_, s, _)| s.rps)
        };
        if let (Some(on), Some(off)) = (rps_of("tidemark"), rps_of("tap-off")) {
            println!(
                "{:<28} tap on vs off: {:.1}% fewer requests/s",
                "",
                (1.0 - on / off) * 100.0
            );
        }
        if let Some((lost, cpu, all)) = &tap_paired {
            let all: Vec<String> = all.iter().map(|l| format!("{:.1}", l * 100.0)).collect();
            println!(
                "{:<28} paired by round: median {:.1}% fewer requests/s, {} us more CPU per request (sorted: {})",
                "",
                lost * 100.0,
                cpu.map_or("-".into(), |c| format!("{:+.1}", c * 1e6)),
                all.join(" ")
            );
        }
        if let Some((lost, cpu, all)) = &otel_paired {
            let all: Vec<String> = all.iter().map(|l| format!("{:.1}", l * 100.0)).collect();
            let dropped = tidemark::metrics::get()
                .otlp_dropped
                .with_label_values(&["spans", "queue_full"])
                .get();
            println!(
                "{:<28} OpenTelemetry export on vs off, paired by round: median {:.1}% fewer requests/s, {} us more CPU per request (sorted: {}); spans dropped so far: {dropped}",
                "",
                lost * 100.0,
                cpu.map_or("-".into(), |c| format!("{:+.1}", c * 1e6)),
                all.join(" ")
            );
        }
        if let Some(r) = vs_nginx.filter(|r| r.len() > 1) {
            let mean = r.iter().sum::<f64>() / r.len() as f64;
            let all: Vec<String> = r.iter().map(|x| format!("{x:.2}")).collect();
            println!(
                "{:<28} tidemark / nginx paired by round: median {:.3}x, mean {:.3}x, {} of {} rounds at or above 1 (sorted: {})",
                "",
                r[r.len() / 2],
                mean,
                r.iter().filter(|x| **x >= 1.0).count(),
                r.len(),
                all.join(" ")
            );
        }
        if !tails.is_empty() {
            println!(
                "{:<28} time in requests over 1 ms (median over rounds): {}",
                "",
                tails.join(", ")
            );
        }
        for (tname, added) in added_ttfb {
            println!(
                "{:<28} {:<9} added TTFB p50 {:.3} ms (median over rounds of its p50 minus direct's)",
                "",
                tname,
                added * 1e3
            );
        }
    }
    // Slow streams sharing the proxy with cold 2 MB histories: their time
    // to first byte is what a connection pays for its neighbours' estimates
    // from scratch (a worker thread serves many connections; a cold history
    // is estimated on the blocking pool). This history tokenizes from
    // scratch in tens of milliseconds.
    let beside = "slow streams beside cold 2 MB";
    if beside.contains(scenario.as_str()) {
        let huge = Bytes::from(history_body(2 << 20));
        let mut cells: Vec<(&str, Vec<Stats>)> = Vec::new();
        for _ in 0..repeat {
            for (tname, base) in &targets {
                if !matches!(*tname, "direct" | "nginx" | "tidemark") {
                    continue;
                }
                let slow = load(
                    format!("{base}/v1/slow/chat/completions"),
                    stream.clone(),
                    4,
                    secs,
                    true,
                );
                let cold = load_with(
                    format!("{base}/v1/think/chat/completions"),
                    huge.clone(),
                    2,
                    secs,
                    true,
                    true,
                );
                let (s, _) = gen.block_on(async { tokio::join!(slow, cold) });
                match cells.iter_mut().find(|(t, _)| t == tname) {
                    Some((_, v)) => v.push(s),
                    None => cells.push((*tname, vec![s])),
                }
            }
        }
        for (tname, mut v) in cells {
            let mid = v.len() / 2;
            v.sort_by_key(|s| s.p50);
            let p50 = v[mid].p50;
            v.sort_by_key(|s| s.p99);
            let p99 = v[mid].p99;
            println!(
                "{:<28} {:<9} slow-stream TTFB p50 {:.3} ms, p99 {:.3} ms (medians over rounds)",
                beside,
                tname,
                p50.as_secs_f64() * 1e3,
                p99.as_secs_f64() * 1e3
            );
        }
    }
    if let Some((mut child, _, dir)) = ngx {
        // SIGQUIT: the master stops its workers (SIGKILL would orphan them).
        let _ = std::process::Command::new("kill")
            .args(["-QUIT", &child.id().to_string()])
            .status();
        let _ = child.wait();
        let _ = std::fs::remove_dir_all(dir);
    }
}
