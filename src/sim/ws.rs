//! The Responses API's WebSocket mode (`GET /v1/responses`, `Upgrade:
//! websocket`): the client sends `response.create` events (the POST body's
//! fields, `"type":"response.create"`, no `stream`), the server answers with
//! the same events the SSE stream carries, one JSON text frame each
//! (developers.openai.com/api/docs/guides/websocket-mode).
//!
//! - `previous_response_id` continues any response of this connection
//!   (kept here even with `store: false`) or a stored one; an unknown id is
//!   an `error` event with code `previous_response_not_found`.
//! - `"generate": false` is Codex's prewarm: `response.created` and
//!   `response.completed` with no output, whose id the first real turn then
//!   continues (observed from Codex CLI 0.169, /work/coord/agents-findings.md).
//! - `stream_id` (the multi-stream beta): requests of one stream are served
//!   first in, first out, those of different streams at once, and every event
//!   of a response echoes its `stream_id`; `previous_response_id` may name a
//!   response of another stream (a fork). (openai-python 3.63
//!   types/responses/responses_client_event_param.py, responses_server_event.py.)
//! - permessage-deflate when the client offers it (Codex does), with the
//!   frame codec of `crate::ws`.
//! - Errors before a response starts are `{"type":"error","status":N,
//!   "error":{type,code,message,param}}`: the SDK's `ResponseWsError`, and
//!   the shape Codex maps to an HTTP status (openai/codex
//!   codex-api/src/endpoint/responses_websocket.rs).
//!
//! Checked against Codex CLI 0.169 and openai-python 3.63's
//! `client.responses.connect()`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ::http::{HeaderValue, Request, StatusCode};
use bytes::BytesMut;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::http::{self, Resp};
use super::responses::{self, Refusal};
use super::{Call, Sim};
use crate::ws::deflate::{self, Agreed, Deflater, Inflater};
use crate::ws::frame::{
    close_payload, encode_frame, Event, FrameError, Kind, MessageReader, Opcode,
};

/// The largest client message read (a whole conversation resent).
const MAX_MESSAGE: usize = 64 << 20;

/// Is this request the Responses WebSocket handshake?
pub(super) fn is_upgrade(req: &Request<Incoming>) -> bool {
    let has = |name: &str, token: &str| {
        req.headers().get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    req.method() == ::http::Method::GET
        && req.uri().path().ends_with("/responses")
        && has("upgrade", "websocket")
        && has("connection", "upgrade")
}

/// Answer the handshake with 101 and serve the connection in a task.
pub(super) fn upgrade(sim: Arc<Sim>, mut req: Request<Incoming>, credential: String) -> Resp {
    let Some(key) = req.headers().get("sec-websocket-key").cloned() else {
        return http::json(
            400,
            &responses::error_body(
                "Missing Sec-WebSocket-Key",
                "invalid_request_error",
                None,
                None,
            ),
        );
    };
    let offered = req
        .headers()
        .get_all("sec-websocket-extensions")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| {
            v.split(',')
                .any(|e| e.trim().starts_with("permessage-deflate"))
        });
    // Both sides keep their window (the defaults), the client its 15 bits.
    let agreed = if offered {
        deflate::agreed([b"permessage-deflate".as_slice()])
    } else {
        Agreed::Nothing
    };
    if let Some(rec) = &sim.recorder {
        rec.request(req.method(), req.uri(), req.headers(), b"");
    }
    let path = req.uri().path().to_string();
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let Ok(io) = on_upgrade.await else {
            return;
        };
        serve(sim, TokioIo::new(io), agreed, credential, path).await;
    });
    let mut r = http::full(StatusCode::SWITCHING_PROTOCOLS, "");
    let h = r.headers_mut();
    h.remove(::http::header::CONTENT_TYPE);
    h.insert(
        ::http::header::UPGRADE,
        HeaderValue::from_static("websocket"),
    );
    h.insert(
        ::http::header::CONNECTION,
        HeaderValue::from_static("Upgrade"),
    );
    if let Ok(v) = HeaderValue::from_str(&crate::ws::accept_key(key.as_bytes())) {
        h.insert("sec-websocket-accept", v);
    }
    if matches!(agreed, Agreed::Deflate(_)) {
        h.insert(
            "sec-websocket-extensions",
            HeaderValue::from_static("permessage-deflate"),
        );
    }
    r
}

/// What the writer task sends.
enum Out {
    Text(String),
    Pong(Vec<u8>),
    Close(Vec<u8>),
    /// Drop the connection without a close frame (a cut stream).
    Reset,
}

static CONNECTIONS: AtomicU64 = AtomicU64::new(0);

async fn serve<IO>(sim: Arc<Sim>, io: IO, agreed: Agreed, credential: String, path: String)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let conn = CONNECTIONS.fetch_add(1, Ordering::Relaxed) + 1;
    let (mut rd, mut wr) = tokio::io::split(io);
    let params = match agreed {
        Agreed::Deflate(p) => Some(p),
        _ => None,
    };
    // A slow reader backs the sender up: the queue is bounded.
    let (tx, mut rx) = mpsc::channel::<Out>(64);
    let writer = tokio::spawn(async move {
        let mut deflater = params.map(|p| Deflater::new(p.server_no_context_takeover));
        let mut buf = BytesMut::new();
        while let Some(o) = rx.recv().await {
            buf.clear();
            let last = match o {
                Out::Text(t) => {
                    match deflater.as_mut() {
                        Some(d) => {
                            let z = d.compress(t.as_bytes());
                            encode_frame(&mut buf, true, true, Opcode::Text, None, &z);
                        }
                        None => {
                            encode_frame(&mut buf, true, false, Opcode::Text, None, t.as_bytes())
                        }
                    }
                    false
                }
                Out::Pong(p) => {
                    encode_frame(&mut buf, true, false, Opcode::Pong, None, &p);
                    false
                }
                Out::Close(p) => {
                    encode_frame(&mut buf, true, false, Opcode::Close, None, &p);
                    true
                }
                Out::Reset => return,
            };
            if wr.write_all(&buf).await.is_err() || wr.flush().await.is_err() {
                return;
            }
            if last {
                let _ = wr.shutdown().await;
                return;
            }
        }
    });
    let inflater = params.map(|p| Inflater::client_to_server(&p));
    let mut reader = MessageReader::new(MAX_MESSAGE, inflater);
    let local: Arc<Mutex<responses::Local>> = Arc::default();
    let mut streams: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    let mut pending = BytesMut::new();
    let mut chunk = vec![0u8; 64 * 1024];
    'read: loop {
        let n = match rd.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        pending.extend_from_slice(&chunk[..n]);
        loop {
            let (used, ev) = match reader.feed(&pending) {
                Ok(x) => x,
                Err(e) => {
                    let _ = tx.send(Out::Close(close_payload(close_code(&e), ""))).await;
                    break 'read;
                }
            };
            let _ = pending.split_to(used);
            let Some(ev) = ev else {
                break;
            };
            match ev {
                Event::Message {
                    kind: Kind::Text,
                    payload,
                    ..
                } => {
                    if let Some(rec) = &sim.recorder {
                        rec.frame(&path, conn, &payload);
                    }
                    let body: Value = match serde_json::from_slice(&payload) {
                        Ok(v) => v,
                        Err(_) => {
                            let e = error_event(
                                400,
                                "invalid_request_error",
                                None,
                                "Invalid JSON in client event.",
                                None,
                            );
                            let _ = tx.send(Out::Text(e.to_string())).await;
                            continue;
                        }
                    };
                    if body.get("type").and_then(Value::as_str) != Some("response.create") {
                        // Acknowledgements and other client events need no answer.
                        continue;
                    }
                    let stream = body
                        .get("stream_id")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string();
                    let before = streams.remove(&stream);
                    let job = tokio::spawn(respond(
                        Arc::clone(&sim),
                        body,
                        credential.clone(),
                        path.clone(),
                        Arc::clone(&local),
                        tx.clone(),
                        before,
                    ));
                    streams.insert(stream, job);
                }
                Event::Message { .. } | Event::TooLarge { .. } => {
                    let e = error_event(
                        400,
                        "invalid_request_error",
                        None,
                        "Client events are JSON text frames.",
                        None,
                    );
                    let _ = tx.send(Out::Text(e.to_string())).await;
                }
                Event::Control { opcode, payload } => match opcode {
                    Opcode::Ping => {
                        let _ = tx.send(Out::Pong(payload.to_vec())).await;
                    }
                    Opcode::Close => {
                        let _ = tx
                            .send(Out::Close(
                                payload.get(..2).map(<[u8]>::to_vec).unwrap_or_default(),
                            ))
                            .await;
                        break 'read;
                    }
                    _ => {}
                },
            }
        }
    }
    for (_, j) in streams {
        j.abort();
    }
    drop(tx);
    let _ = writer.await;
}

/// The close code for a client's broken frames (RFC 6455 §7.4.1).
fn close_code(e: &FrameError) -> u16 {
    match e {
        FrameError::Inflate => 1007,
        _ => 1002,
    }
}

/// An `error` event in the shape Codex reads (HTTP status, then the error
/// object of the HTTP API).
fn error_event(
    status: u16,
    typ: &str,
    code: Option<&str>,
    message: &str,
    param: Option<&str>,
) -> Value {
    json!({"type":"error","status":status,"error":{"type":typ,"code":code,"message":message,"param":param}})
}

/// Answer one `response.create`, after the stream's previous response.
async fn respond(
    sim: Arc<Sim>,
    mut body: Value,
    credential: String,
    path: String,
    local: Arc<Mutex<responses::Local>>,
    tx: mpsc::Sender<Out>,
    before: Option<tokio::task::JoinHandle<()>>,
) {
    if let Some(b) = before {
        let _ = b.await;
    }
    let stream_id = body.get("stream_id").cloned();
    if let Some(o) = body.as_object_mut() {
        o.remove("type");
        o.remove("stream_id");
        o.insert("stream".into(), Value::Bool(true));
    }
    let n = sim.requests.fetch_add(1, Ordering::Relaxed) + 1;
    if !sim.cfg.first_byte_delay.is_zero() {
        tokio::time::sleep(sim.cfg.first_byte_delay).await;
    }
    let call = Call::new(&sim, &path, credential, n);
    let snapshot = local.lock().map(|l| l.clone()).unwrap_or_default();
    let events = match responses::run(&call, &body, Some(&snapshot)) {
        Ok(r) => {
            if let Ok(mut l) = local.lock() {
                l.insert(r.id.clone(), r.stored.clone());
            }
            if r.store {
                sim.store(&r.id, r.stored);
            }
            r.events
        }
        Err((Refusal::Http(st, e), _)) => {
            let err = &e["error"];
            vec![error_event(
                st,
                err["type"].as_str().unwrap_or("invalid_request_error"),
                err["code"].as_str(),
                err["message"].as_str().unwrap_or(""),
                err["param"].as_str(),
            )]
        }
        Err((Refusal::Failed(e), _)) => responses::failed_events(&call, &body, e),
    };
    let delay = sim.cfg.chunk_delay;
    for (i, mut e) in events.into_iter().enumerate() {
        if sim.cfg.abort_after_events.is_some_and(|a| i >= a) {
            let _ = tx.send(Out::Reset).await;
            return;
        }
        if i > 0 && !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if let Some(s) = &stream_id {
            e["stream_id"] = s.clone();
        }
        if tx.send(Out::Text(e.to_string())).await.is_err() {
            return;
        }
    }
}

/// 426 Upgrade Required, the sim told to refuse the WebSocket mode: what
/// makes Codex fall back to HTTPS at once instead of retrying the handshake
/// (a 404 costs it seven attempts, about 6.5 s).
pub(super) fn refuse() -> Resp {
    let mut r = http::json(
        426,
        &responses::error_body("Upgrade Required", "invalid_request_error", None, None),
    );
    r.headers_mut().insert(
        ::http::header::UPGRADE,
        HeaderValue::from_static("websocket"),
    );
    r
}
