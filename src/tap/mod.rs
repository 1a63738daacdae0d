//! The response body wrapper: forwards every frame untouched and at once,
//! lets the usage reader watch the bytes go by, and fires one callback when
//! the body ends, fails or is dropped.

pub mod inject;
pub mod sse;
pub mod usage;

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use pin_project_lite::pin_project;
use prometheus::Histogram;
use tokio::time::Sleep;

pub use crate::upstream::BoxError;
use crate::upstream::UpstreamError;
use inject::UsageStripper;
use usage::{BodyDecoder, BrokenBody, ReadOutcome, UsageReader};

pub type InnerBody = UnsyncBoxBody<Bytes, BoxError>;

/// How a response body ended.
#[derive(Debug)]
pub struct Finish {
    /// What the usage reader saw, if the response was tapped.
    pub read: Option<ReadOutcome>,
    /// The body reached its end (false: upstream error, idle timeout or client gone).
    pub completed: bool,
    /// Why it did not complete, when it failed on the upstream side.
    pub upstream_failed: bool,
    pub idle_timeout: bool,
    /// Body bytes forwarded to the client.
    pub bytes: u64,
    /// An error response's body (decoded, at most [`MAX_ERROR_BODY`]
    /// bytes), when it was captured: what a refusal says.
    pub error_body: Option<Vec<u8>>,
}

/// Most bytes of an error body kept (error bodies are small; one that is
/// not is no refusal tidemark reads).
pub const MAX_ERROR_BODY: usize = 64 << 10;

/// An error response's body, copied as it goes by (the client's bytes are
/// not held back), up to [`MAX_ERROR_BODY`].
pub struct ErrorCapture {
    raw: Vec<u8>,
    /// The response's content coding, decoded at the end.
    coding: Option<String>,
    over: bool,
}

impl ErrorCapture {
    pub fn new(content_encoding: Option<&str>) -> Self {
        ErrorCapture {
            raw: Vec::new(),
            coding: content_encoding
                .map(str::trim)
                .filter(|e| !e.is_empty() && !e.eq_ignore_ascii_case("identity"))
                .map(str::to_string),
            over: false,
        }
    }

    fn push(&mut self, chunk: &[u8]) {
        if self.raw.len() + chunk.len() > MAX_ERROR_BODY {
            self.over = true;
            return;
        }
        self.raw.extend_from_slice(chunk);
    }

    /// The whole body, decoded; `None` when it was too long or undecodable.
    fn finish(self) -> Option<Vec<u8>> {
        if self.over {
            return None;
        }
        let Some(coding) = self.coding else {
            return Some(self.raw);
        };
        let mut d = BodyDecoder::new(&coding)?;
        let mut out = Vec::new();
        // Piece by piece, so a small body that inflates hugely stops early.
        for piece in self.raw.chunks(1024) {
            d.push(piece, &mut out).ok()?;
            if out.len() > MAX_ERROR_BODY {
                return None;
            }
        }
        d.finish(&mut out).ok()?;
        (out.len() <= MAX_ERROR_BODY).then_some(out)
    }
}

/// Per-response observation state; dropped (and the callback fired) once.
pub struct Watch {
    pub start: Instant,
    pub ttfb: Option<&'static Histogram>,
    pub duration: Option<&'static Histogram>,
    pub reader: Option<UsageReader>,
    pub stripper: Option<UsageStripper>,
    /// With the stripper, on a compressed upstream body: the client gets
    /// it decoded (the stripper must see the stream as sent).
    pub decoder: Option<BodyDecoder>,
    /// An error response's body being copied for its refusal.
    pub capture: Option<ErrorCapture>,
    pub on_finish: Option<Box<dyn FnOnce(Finish) + Send>>,
    first_byte: bool,
    bytes: u64,
}

impl Watch {
    pub fn new(start: Instant) -> Self {
        Watch {
            start,
            ttfb: None,
            duration: None,
            reader: None,
            stripper: None,
            decoder: None,
            capture: None,
            on_finish: None,
            first_byte: false,
            bytes: 0,
        }
    }

    /// What the client gets of an upstream chunk when tidemark rewrites the
    /// body (a stripper, perhaps behind a decoder); `ended`: it is the
    /// last. A broken coding ends the body: what decoded before it is
    /// returned with the error.
    fn rewrite(&mut self, chunk: &[u8], ended: bool) -> (BytesMut, Option<BrokenBody>) {
        let mut broken = None;
        let mut decoded = Vec::new();
        let plain: &[u8] = match self.decoder.as_mut() {
            Some(d) => {
                let r = d.push(chunk, &mut decoded).and_then(|()| {
                    if ended {
                        d.finish(&mut decoded)
                    } else {
                        Ok(())
                    }
                });
                broken = r.err();
                &decoded
            }
            None => chunk,
        };
        let mut out = BytesMut::new();
        match self.stripper.as_mut() {
            Some(s) => {
                s.push(plain, &mut out);
                if ended || broken.is_some() {
                    s.finish(&mut out);
                }
            }
            None => out.extend_from_slice(plain),
        }
        (out, broken)
    }

    fn finish(&mut self, completed: bool, upstream_failed: bool, idle_timeout: bool) {
        self.finish_at(None, completed, upstream_failed, idle_timeout)
    }

    /// `finish` with the clock already read (`now`) by the caller.
    fn finish_at(
        &mut self,
        now: Option<Instant>,
        completed: bool,
        upstream_failed: bool,
        idle_timeout: bool,
    ) {
        let Some(cb) = self.on_finish.take() else {
            return;
        };
        if let Some(h) = &self.duration {
            let now = now.unwrap_or_else(Instant::now);
            h.observe(now.saturating_duration_since(self.start).as_secs_f64());
        }
        let read = self.reader.as_mut().map(|r| r.finish());
        let error_body = match self.capture.take() {
            Some(c) if completed => c.finish(),
            _ => None,
        };
        cb(Finish {
            read,
            completed,
            upstream_failed,
            idle_timeout,
            bytes: self.bytes,
            error_body,
        });
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // The client went away (or the server dropped the response) mid-body.
        self.finish(false, false, false);
    }
}

pin_project! {
    /// A response body on its way to the client.
    pub struct ObservedBody {
        #[pin]
        inner: InnerBody,
        // Armed at the first wait, not before: a body that is all there
        // when first polled (a small response) makes no timer and reads no
        // clock for it.
        #[pin]
        idle: Option<Sleep>,
        // None: not watched for silence (tidemark's own responses).
        idle_timeout: Option<Duration>,
        // When the current silence began: the first wait after a frame
        // (None until then). The idle timer is not reset per frame (a
        // timer-wheel operation under a lock); when it fires early it is
        // re-armed from here.
        quiet_since: Option<tokio::time::Instant>,
        watch: Option<Box<Watch>>,
        done: bool,
        // An upstream error held back for one poll (see `poll_frame`).
        deferred: Option<BoxError>,
    }
}

/// How long an upstream error waits behind the bytes that preceded it: the
/// server writes them out (h2 frames are written by the connection task,
/// after the stream handed them over) before the reset discards its queue.
const ERROR_FLUSH_DELAY: Duration = Duration::from_millis(25);

/// An upstream body that failed mid-stream: reset (or TLS), or silent past
/// `--idle-timeout`, counted by kind as failures before the headers are.
fn upstream_failed(e: UpstreamError) {
    crate::metrics::get()
        .upstream_errors
        .with_label_values(&[e.metric_kind()])
        .inc();
}

#[derive(Debug)]
struct IdleTimeout;
impl std::fmt::Display for IdleTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("upstream stream idle timeout")
    }
}
impl std::error::Error for IdleTimeout {}

impl ObservedBody {
    /// A body with nothing to watch (tidemark's own responses, admin).
    pub fn plain(inner: InnerBody) -> Self {
        ObservedBody {
            inner,
            idle: None,
            idle_timeout: None,
            quiet_since: None,
            watch: None,
            done: false,
            deferred: None,
        }
    }

    pub fn watched(inner: InnerBody, watch: Watch, idle_timeout: Duration) -> Self {
        ObservedBody {
            inner,
            idle: None,
            idle_timeout: Some(idle_timeout),
            quiet_since: None,
            watch: Some(Box::new(watch)),
            done: false,
            deferred: None,
        }
    }

    pub fn full(bytes: impl Into<Bytes>) -> Self {
        use http_body_util::BodyExt;
        Self::plain(
            http_body_util::Full::new(bytes.into())
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
    }
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        if this.deferred.is_some() {
            if let Some(idle) = this.idle.as_mut().as_pin_mut() {
                if idle.poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            return Poll::Ready(this.deferred.take().map(Err));
        }
        if *this.done {
            return Poll::Ready(None);
        }
        loop {
            match this.inner.as_mut().poll_frame(cx) {
                Poll::Pending => {
                    let Some(timeout) = *this.idle_timeout else {
                        return Poll::Pending;
                    };
                    let since = *this
                        .quiet_since
                        .get_or_insert_with(tokio::time::Instant::now);
                    let due = since + timeout;
                    if this.idle.is_none() {
                        this.idle.set(Some(tokio::time::sleep_until(due)));
                    }
                    if let Some(mut idle) = this.idle.as_mut().as_pin_mut() {
                        if idle.as_mut().poll(cx).is_ready() && idle.deadline() < due {
                            // Frames came since it was armed: wait from the last one.
                            idle.as_mut().reset(due);
                        }
                        if idle.deadline() >= due && idle.poll(cx).is_ready() {
                            *this.done = true;
                            if let Some(mut w) = this.watch.take() {
                                upstream_failed(UpstreamError::Timeout);
                                w.finish(false, true, true);
                            }
                            return Poll::Ready(Some(Err(Box::new(IdleTimeout))));
                        }
                    }
                    return Poll::Pending;
                }
                Poll::Ready(None) => {
                    *this.done = true;
                    if let Some(mut w) = this.watch.take() {
                        if w.stripper.is_some() {
                            let (out, broken) = w.rewrite(&[], true);
                            w.bytes += out.len() as u64;
                            w.finish(broken.is_none(), broken.is_some(), false);
                            if let Some(e) = broken {
                                *this.deferred = Some(Box::new(e));
                                let at = tokio::time::Instant::now() + ERROR_FLUSH_DELAY;
                                this.idle.set(Some(tokio::time::sleep_until(at)));
                                if out.is_empty() {
                                    cx.waker().wake_by_ref();
                                    return Poll::Pending;
                                }
                            }
                            if !out.is_empty() {
                                return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                            }
                        }
                        w.finish(true, false, false);
                    }
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => {
                    *this.done = true;
                    if let Some(mut w) = this.watch.take() {
                        upstream_failed(UpstreamError::classify(&*e, false));
                        w.finish(false, true, false);
                    }
                    // The error makes the server abort the connection (h1) or
                    // reset the stream (h2), dropping whatever it has buffered
                    // but not yet written. Hold the error back a moment so the
                    // bytes received before it reach the client first.
                    *this.deferred = Some(e);
                    if this.idle_timeout.is_none() {
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    let at = tokio::time::Instant::now() + ERROR_FLUSH_DELAY;
                    match this.idle.as_mut().as_pin_mut() {
                        Some(idle) => idle.reset(at),
                        None => this.idle.set(Some(tokio::time::sleep_until(at))),
                    }
                    if let Some(idle) = this.idle.as_mut().as_pin_mut() {
                        if idle.poll(cx).is_ready() {
                            return Poll::Ready(this.deferred.take().map(Err));
                        }
                    }
                    return Poll::Pending;
                }
                Poll::Ready(Some(Ok(frame))) => {
                    let Some(w) = this.watch.as_mut() else {
                        return Poll::Ready(Some(Ok(frame)));
                    };
                    *this.quiet_since = None;
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            if let Some(r) = w.reader.as_mut() {
                                r.feed_bytes(&data);
                            }
                            if let Some(c) = w.capture.as_mut() {
                                c.push(&data);
                            }
                            let ended = this.inner.is_end_stream();
                            let data = match w.stripper.is_some() {
                                true => {
                                    let (out, broken) = w.rewrite(&data, ended);
                                    if let Some(e) = broken {
                                        // Undecodable: what came before it
                                        // goes out, then the body fails as
                                        // on an upstream error.
                                        *this.done = true;
                                        w.bytes += out.len() as u64;
                                        if let Some(mut w) = this.watch.take() {
                                            w.finish(false, true, false);
                                        }
                                        *this.deferred = Some(Box::new(e));
                                        let at = tokio::time::Instant::now() + ERROR_FLUSH_DELAY;
                                        match this.idle.as_mut().as_pin_mut() {
                                            Some(idle) => idle.reset(at),
                                            None => {
                                                this.idle.set(Some(tokio::time::sleep_until(at)))
                                            }
                                        }
                                        if out.is_empty() {
                                            cx.waker().wake_by_ref();
                                            return Poll::Pending;
                                        }
                                        return Poll::Ready(Some(Ok(Frame::data(out.freeze()))));
                                    }
                                    if out.is_empty() && !ended {
                                        continue;
                                    }
                                    out.freeze()
                                }
                                false => data,
                            };
                            // One clock read serves the first byte and the
                            // end (a small response is both at once).
                            let first = !w.first_byte && !data.is_empty();
                            let now = (first || ended).then(Instant::now);
                            if first {
                                w.first_byte = true;
                                if let (Some(h), Some(now)) = (&w.ttfb, now) {
                                    let waited = now.saturating_duration_since(w.start);
                                    h.observe(waited.as_secs_f64());
                                }
                            }
                            w.bytes += data.len() as u64;
                            if ended {
                                *this.done = true;
                                if let Some(mut w) = this.watch.take() {
                                    w.finish_at(now, true, false, false);
                                }
                            }
                            Frame::data(data)
                        }
                        Err(other) => other,
                    };
                    return Poll::Ready(Some(Ok(frame)));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        if self.deferred.is_some() {
            return false;
        }
        self.done || (self.watch.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        match &self.watch {
            Some(w) if w.stripper.is_some() => SizeHint::default(),
            _ => self.inner.size_hint(),
        }
    }
}
