//! Listeners: the proxy (HTTP/1.1 and h2c on one port) and the admin
//! endpoints, connection limits, and graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

use crate::config::Config;
use crate::metrics;
use crate::proxy::{self, State};

/// Why `run` could not start.
#[derive(Debug)]
pub enum StartError {
    Config(String),
    Io(std::io::Error),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Config(s) => write!(f, "configuration: {s}"),
            StartError::Io(e) => write!(f, "listener: {e}"),
        }
    }
}
impl std::error::Error for StartError {}

/// Serve the proxy on `listener` and the admin API on `admin` until `shutdown`
/// resolves, then stop accepting and let in-flight requests finish for up to
/// `--shutdown-grace`.
pub async fn run(
    listener: TcpListener,
    admin: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StartError> {
    let grace = config.shutdown_grace;
    let state = Arc::new(State::new(config).map_err(StartError::Config)?);
    let (stop_tx, stop_rx) = watch::channel(false);

    let admin_task = tokio::spawn(serve_admin(admin, Arc::clone(&state), stop_rx.clone()));
    let sweeper = {
        let state = Arc::clone(&state);
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tick.tick() => state.store.sweep(Instant::now()),
                    _ = stop.changed() => break,
                }
            }
        })
    };

    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(state.config.header_read_timeout)
        .max_buf_size(state.config.max_header_bytes.max(8192))
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(state.config.max_header_bytes.min(u32::MAX as usize) as u32)
        .max_concurrent_streams(256);
    let limit = Arc::new(Semaphore::new(state.config.max_connections));
    tokio::pin!(shutdown);

    let mut workers = Vec::new();
    for i in 0..state.config.workers.max(1) {
        let w = Worker::start(i, Arc::clone(&state), builder.clone(), grace).await;
        workers.push(w.map_err(StartError::Io)?);
    }
    let mut next = 0;
    loop {
        let permit = match Arc::clone(&limit).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // At --max-connections: the next client waits in the accept queue.
                metrics::get()
                    .limits_hit
                    .with_label_values(&["connections"])
                    .inc();
                tokio::select! {
                    p = Arc::clone(&limit).acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                    _ = &mut shutdown => break,
                }
            }
        };
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    // Out of descriptors and the like: back off briefly, keep serving.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        // Round robin: connections are long-lived (an agent keeps its
        // keep-alive connection), so turns spread them evenly.
        match stream.into_std() {
            Ok(s) => workers[next % workers.len()].hand(s, permit),
            Err(e) => tracing::warn!(error = %e, "accepted socket unusable"),
        }
        next += 1;
    }

    drop(listener);
    tracing::info!("shutting down: draining in-flight requests");
    // Every worker's queue closes first; then each drains its connections
    // for up to the grace period, all at the same time.
    let draining: Vec<_> = workers.into_iter().map(Worker::stop).collect();
    let mut over = false;
    for done in draining {
        over |= done.await.unwrap_or(false);
    }
    if over {
        tracing::warn!("shutdown grace period over; closed the remaining connections");
    }
    // What the last requests recorded goes to the collector before the
    // process ends (bounded: a collector that does not answer waits no more).
    if let Some(otel) = &state.otel {
        otel.shutdown(Duration::from_secs(5)).await;
    }
    let _ = stop_tx.send(true);
    let _ = sweeper.await;
    let _ = admin_task.await;
    Ok(())
}

/// A thread that serves the connections handed to it on a single-threaded
/// event loop of its own.
///
/// Why not tokio's multi-thread scheduler: it wakes an idle thread to steal
/// work whenever a task is woken, so nearly every request crossed threads
/// (futex wakes, inter-processor interrupts, cold caches). One loop per
/// thread serves each connection start to finish where it was accepted, and
/// its upstream connections are made and pooled there too (see
/// [`crate::upstream`]), so a request stays on one core, with warm caches
/// and no cross-thread wakeups. State shared by all (sessions, metrics, caches) stays shared.
///
/// The cost: work that holds a thread holds its other connections too; the
/// one such step, estimating a large uncached request, runs on tokio's
/// blocking pool (see `proxy`).
struct Worker {
    queue: tokio::sync::mpsc::UnboundedSender<(std::net::TcpStream, OwnedSemaphorePermit)>,
    done: tokio::sync::oneshot::Receiver<bool>,
}

impl Worker {
    async fn start(
        index: usize,
        state: Arc<State>,
        builder: auto::Builder<TokioExecutor>,
        grace: Duration,
    ) -> std::io::Result<Worker> {
        let (queue, mut incoming) = tokio::sync::mpsc::unbounded_channel();
        let (done_tx, done) = tokio::sync::oneshot::channel();
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("tidemark-w{index}"))
            .spawn(move || {
                // Made here, and dropped here: a runtime may not be dropped
                // inside another's async context.
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                crate::upstream::set_worker(index);
                let state = proxy::Local::new(state);
                let over = rt.block_on(async move {
                    let graceful = GracefulShutdown::new();
                    while let Some((stream, permit)) = incoming.recv().await {
                        serve(&state, &builder, &graceful, stream, permit);
                    }
                    // hyper's watcher lets go of a connection once it
                    // upgrades: open WebSockets are waited for too.
                    let sockets = state.sockets().clone();
                    tokio::select! {
                        _ = async { graceful.shutdown().await; sockets.closed().await } => false,
                        _ = tokio::time::sleep(grace) => true,
                    }
                });
                // Dropping the loop closes what is left.
                drop(rt);
                let _ = done_tx.send(over);
            })?;
        ready
            .await
            .unwrap_or_else(|_| Err(std::io::Error::other("worker thread ended at start")))?;
        Ok(Worker { queue, done })
    }

    fn hand(&self, stream: std::net::TcpStream, permit: OwnedSemaphorePermit) {
        let _ = self.queue.send((stream, permit));
    }

    /// Close the queue; the worker then drains its connections. What is
    /// returned resolves when it has, to true when the grace period ran
    /// out first.
    fn stop(self) -> tokio::sync::oneshot::Receiver<bool> {
        drop(self.queue);
        self.done
    }
}

/// Serve one client connection on the current worker's loop.
fn serve(
    state: &proxy::Local,
    builder: &auto::Builder<TokioExecutor>,
    graceful: &GracefulShutdown,
    stream: std::net::TcpStream,
    permit: OwnedSemaphorePermit,
) {
    let stream = match TcpStream::from_std(stream) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "accepted socket unusable");
            return;
        }
    };
    let (io, served) = FirstRequestDeadline::new(stream, state.config.header_read_timeout);
    let st = state.clone();
    let svc = service_fn(move |req: Request<Incoming>| {
        served.store(true, Ordering::Relaxed);
        proxy::handle(st.clone(), req)
    });
    let conn = builder
        .serve_connection_with_upgrades(TokioIo::new(io), svc)
        .into_owned();
    let conn = graceful.watch(conn);
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            if let Some(limit) = connection_limit_hit(&*e) {
                metrics::get().limits_hit.with_label_values(&[limit]).inc();
            }
        }
        drop(permit);
    });
}

/// Header-read timeout on the admin listener.
const ADMIN_HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// An accepted socket whose reads fail once `deadline` passes, until the
/// connection's first request has been parsed. This bounds what hyper
/// leaves unbounded: the auto builder's protocol detection (it reads up
/// to the 24-byte h2 preface with no timeout), the first h1 request's
/// headers (hyper's own timer starts only after detection), and an h2c
/// client that sends the preface but no request. Later requests on a
/// keep-alive h1 connection fall under hyper's `header_read_timeout`.
struct FirstRequestDeadline {
    io: TcpStream,
    deadline: Pin<Box<Sleep>>,
    served: Arc<AtomicBool>,
}

impl FirstRequestDeadline {
    /// The wrapped socket and the flag the service sets on its first request.
    fn new(io: TcpStream, timeout: Duration) -> (Self, Arc<AtomicBool>) {
        let served = Arc::new(AtomicBool::new(false));
        let io = FirstRequestDeadline {
            io,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            served: Arc::clone(&served),
        };
        (io, served)
    }
}

impl AsyncRead for FirstRequestDeadline {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.served.load(Ordering::Relaxed) && this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                HeaderReadTimeout,
            )));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for FirstRequestDeadline {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// The error a connection ends with when its first request's headers did not arrive in time.
#[derive(Debug)]
struct HeaderReadTimeout;
impl std::fmt::Display for HeaderReadTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("request headers not received within --header-read-timeout")
    }
}
impl std::error::Error for HeaderReadTimeout {}

/// The `tidemark_limits_hit_total{limit}` label for a connection that ended on
/// a limit: headers too large (hyper answered 431) or not sent in time.
fn connection_limit_hit(e: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    let mut cur = Some(e);
    let mut depth = 0;
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_parse_too_large() {
                return Some("headers");
            }
            if h.is_timeout() {
                return Some("header_timeout");
            }
        }
        if err.downcast_ref::<HeaderReadTimeout>().is_some() {
            return Some("header_timeout");
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.get_ref().is_some_and(|i| i.is::<HeaderReadTimeout>()) {
                return Some("header_timeout");
            }
        }
        depth += 1;
        if depth > 8 {
            break;
        }
        cur = err.source();
    }
    None
}

async fn serve_admin(listener: TcpListener, state: Arc<State>, mut stop: watch::Receiver<bool>) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(ADMIN_HEADER_TIMEOUT);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r { Ok((s, _)) => s, Err(_) => { tokio::time::sleep(Duration::from_millis(50)).await; continue } },
            _ = stop.changed() => break,
        };
        let (io, served) = FirstRequestDeadline::new(stream, ADMIN_HEADER_TIMEOUT);
        let st = Arc::clone(&state);
        let svc = service_fn(move |req: Request<Incoming>| {
            served.store(true, Ordering::Relaxed);
            let st = Arc::clone(&st);
            async move { Ok::<_, Infallible>(crate::admin::handle(&st, req).await) }
        });
        let conn = builder.serve_connection(TokioIo::new(io), svc).into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
}
