//! The sim's HTTP plumbing: whole bodies, paced event streams, and the
//! response header that carries the sim's own count.

use std::convert::Infallible;
use std::io::Write;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_ENCODING, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use serde_json::Value;

use super::{Call, X_SIM_PROMPT_TOKENS};

pub type SimBody = BoxBody<Bytes, std::io::Error>;

pub const SSE: &str = "text/event-stream; charset=utf-8";
pub const JSON: &str = "application/json";
pub const NDJSON: &str = "application/x-ndjson";

/// A whole JSON body.
pub fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<SimBody> {
    let mut r = Response::new(
        Full::new(body.into())
            .map_err(|never: Infallible| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(JSON));
    r
}

pub fn json(status: u16, v: &Value) -> Response<SimBody> {
    full(
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        v.to_string(),
    )
}

pub fn text(
    status: StatusCode,
    content_type: &'static str,
    body: &'static str,
) -> Response<SimBody> {
    let mut r = full(status, body);
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// Mark a response with the sim's own prompt count.
pub fn with_count(mut r: Response<SimBody>, n: u64) -> Response<SimBody> {
    if let Ok(v) = HeaderValue::from_str(&n.to_string()) {
        r.headers_mut().insert(X_SIM_PROMPT_TOKENS, v);
    }
    r
}

/// Send `events` as separate body frames, paced, optionally gzipped (each
/// event flushed so the stream stays a stream), optionally cut short or
/// stalled (the request's faults laid over the sim's settings).
pub fn stream_response(
    call: &Call<'_>,
    events: Vec<String>,
    content_type: &'static str,
    gzip: bool,
) -> Response<SimBody> {
    let delay = call.cfg.chunk_delay;
    let abort = call.cfg.abort_after_events;
    // A stream that will be cut holds one event at a time, so the sim knows
    // when the last event before the cut has been taken.
    let depth = if abort.is_some() { 1 } else { 8 };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(depth);
    let stall = call.cfg.stall_after_events;
    let abandoned = call.sim.abandoned.clone();
    tokio::spawn(async move {
        let mut gz =
            gzip.then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()));
        for (i, e) in events.iter().enumerate() {
            if abort.is_some_and(|a| i >= a) {
                // The events before the cut go out first: once the last one
                // is taken, give the server a few turns to write it, as a
                // provider's bytes are on the wire before its connection dies.
                let Ok(permit) = tx.reserve().await else {
                    return;
                };
                for _ in 0..8 {
                    tokio::task::yield_now().await;
                }
                permit.send(Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "sim: stream aborted",
                )));
                return;
            }
            if stall.is_some_and(|s| i >= s) {
                let _left = abandoned.on_drop();
                tx.closed().await;
                return;
            }
            if i > 0 && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let chunk = match gz.as_mut() {
                Some(enc) => {
                    if enc.write_all(e.as_bytes()).is_err() || enc.flush().is_err() {
                        return;
                    }
                    Bytes::from(std::mem::take(enc.get_mut()))
                }
                None => Bytes::from(e.clone()),
            };
            if tx.send(Ok(chunk)).await.is_err() {
                return;
            }
        }
        if let Some(enc) = gz {
            if let Ok(rest) = enc.finish() {
                let _ = tx.send(Ok(Bytes::from(rest))).await;
            }
        }
    });
    let s = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|r| (r.map(Frame::data), rx))
    });
    let mut r = Response::new(StreamBody::new(s).boxed());
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    if gzip {
        r.headers_mut()
            .insert(CONTENT_ENCODING, HeaderValue::from_static("gzip"));
    }
    r
}

pub type Resp = Response<SimBody>;
