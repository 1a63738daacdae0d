//! The Responses API's WebSocket mode (`/v1/responses` upgraded): each
//! client `response.create` event is a turn, identified, estimated and
//! projected like a POST body (the phases a POST shares, `turn/phases.rs`), and
//! each server event that ends a response records it. A warm-up
//! (`generate: false`) is no turn: it only holds its place in line.
//!
//! No frame is altered unless a policy acts. With `--on-over pass` and no
//! session budget, client bytes are forwarded as they arrive and a copy is
//! read. Otherwise each client data message is held until it is whole and
//! decided: forwarded as it came, answered with the API's own `error`
//! event toward the client (at a boundary between the server's messages,
//! uncompressed) instead of being forwarded, or replaced by its trimmed
//! form (uncompressed). Under permessage-deflate with the client's context
//! takeover, a dropped or rewritten compressed message leaves the server's
//! inflater without that message's window, so from then on the client's
//! compressed messages are forwarded decompressed (RSV1 clear).
//!
//! The turn's two ends, [`begin_turn`] and [`end_turn`], are the one seam
//! to today's session API.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::SEC_WEBSOCKET_EXTENSIONS;
use http::HeaderMap;

use super::deflate::{self, Agreed, Inflater};
use super::frame::{encode_frame, parse_header, Event, Kind, MessageReader, Opcode};
use super::tunnel::{Out, Watch};
use crate::config::OnOver;
use crate::json::RequestView;
use crate::metrics;
use crate::policy::cut::{self, Trimming};
use crate::policy::{self, Refusal, Verdict};
use crate::provider::responses_websocket::{self as wire, Ended};
use crate::provider::{Api, Observed};
use crate::session::{Begun, RequestFacts};
use crate::turn::phases::{self as turn, Estimating};
use crate::turn::{Local, ProxyError};

/// Turns being begun at once on a socket before its client is read no
/// further (a client sending events faster than they are estimated).
const MAX_BEGINS: usize = 64;
/// Turns a socket keeps open waiting for their ends; past it the oldest
/// is given up (failed), so a server that never ends a response, or a
/// client naming endless streams, cannot grow the socket's state.
const MAX_OPEN: usize = 1024;

/// What the handshake tells of every turn on the socket: who is asking.
pub struct Handshake {
    headers: HeaderMap,
    query: Option<String>,
    path: String,
}

impl Handshake {
    pub fn new(parts: &http::request::Parts) -> Self {
        Handshake {
            headers: parts.headers.clone(),
            query: parts.uri.query().map(str::to_string),
            path: parts.uri.path().to_string(),
        }
    }

    /// The watch of a socket whose `101` carried `response`'s headers;
    /// `None` when it agreed an extension tidemark cannot read (its frames
    /// then pass unread).
    pub fn watch(self, state: &Local, response: &HeaderMap) -> Option<Responses> {
        let agreed = deflate::agreed(
            response
                .get_all(SEC_WEBSOCKET_EXTENSIONS)
                .iter()
                .map(|v| v.as_bytes()),
        );
        let (up, down, client_takeover) = match agreed {
            Agreed::Nothing => (None, None, false),
            Agreed::Deflate(p) => (
                Some(Inflater::client_to_server(&p)),
                Some(Inflater::server_to_client(&p)),
                !p.client_no_context_takeover,
            ),
            Agreed::Unknown => return None,
        };
        let cfg = &state.config;
        let cap = cfg.max_body_bytes;
        Some(Responses {
            state: state.clone(),
            hs: Arc::new(self),
            policy: cfg.on_over != OnOver::Pass || cfg.session_budget.is_some(),
            client: Some(MessageReader::new(cap, up)),
            server: Some(MessageReader::new(cap, down)),
            held: Vec::new(),
            deciding: None,
            backlog: VecDeque::new(),
            inject: VecDeque::new(),
            desync: false,
            client_takeover,
            jobs: VecDeque::new(),
            open: HashMap::new(),
        })
    }
}

/// One turn between its `response.create` and the event that ends it.
pub struct Turn {
    series: &'static metrics::Series,
    estimate: u64,
    begun: Begun,
    stream: Option<String>,
    max_output: Option<u64>,
    /// The trim's cut key (credential and session key) with `--on-over trim`.
    cut_key: Option<String>,
    /// Its OpenTelemetry span (parented by the handshake's `traceparent`).
    span: Option<Box<crate::otel::Open>>,
}

/// What a client `response.create` starts.
pub enum Create {
    Turn(Box<Turn>),
    /// A response that is no turn of the conversation: a warm-up
    /// (`generate: false`, Codex's prewarm before each process's first
    /// turn), which sends no conversation and generates nothing. It is
    /// neither projected nor recorded: begun in its session it would read
    /// as a shrink of the lane (a compaction on every resumed Codex run)
    /// and its small count would replace the conversation's anchor. It
    /// holds its place among its stream's open responses, so the end it
    /// gets is not taken for a turn's.
    Warmup {
        stream: Option<String>,
    },
}

/// begin: a client event, if it is a `response.create`, as a turn —
/// identified by the handshake's headers and the event's own members,
/// estimated, projected; logged (key, projection, src: never content).
pub async fn begin_turn(state: Local, hs: Arc<Handshake>, event: Bytes) -> Option<Create> {
    let p = Api::OpenAiResponses.provider();
    let view = RequestView::parse(&event)?;
    if !wire::is_response_create(&view) {
        return None;
    }
    if wire::is_warmup(&view) {
        return Some(Create::Warmup {
            stream: wire::stream_id(&view),
        });
    }
    let cfg = &state.config;
    let span = crate::otel::start(state.otel.as_ref(), &hs.headers, Api::OpenAiResponses, None);
    let model = p.model(&hs.path, &view);
    let mut id = turn::identify(cfg, &hs.headers, hs.query.as_deref(), p, &view);
    let estimate = match turn::estimate(&state, p, &view, Some(event.clone()), model.as_deref()) {
        Estimating::Done(e) => e,
        Estimating::Elsewhere(f) => match f.await {
            Some(e) => e,
            None => state.estimator.estimate(p, &view, model.as_deref()),
        },
    };
    let upstream = cfg.upstream_for(&hs.path);
    let (window, window_upstream) = turn::window_of(&state, upstream, model.as_deref());
    let series = metrics::get().series(Api::OpenAiResponses.as_str(), model.as_deref());
    let cut_key = cut::cut_key(cfg, &id.credential, id.key.as_deref());
    // Each stream of the multi-stream beta is a lane of its own.
    let stream = wire::stream_id(&view);
    let facts = RequestFacts {
        key: id.key,
        source: id.source,
        credential: id.credential,
        api: Api::OpenAiResponses,
        model,
        estimate: estimate.tokens,
        classes: estimate.classes,
        reset: id.reset,
        window,
        window_upstream,
        counted: None,
        continues: id.continues,
        content: id.content.get(p, &view).unwrap_or_default(),
        stream: stream.as_deref(),
    };
    let begun = turn::project(&state, series, facts, None).await;
    let proj = &begun.projection;
    // The session the turn went to: a chained turn's is the response's it
    // continues, not the key its own content would have given.
    tracing::info!(
        session = begun.key.as_deref().unwrap_or("none"),
        projection = proj.tokens,
        src = proj.src.as_str(),
        window = proj.window,
        util = proj.util(),
        stream = stream.as_deref(),
        "websocket turn"
    );
    Some(Create::Turn(Box::new(Turn {
        series,
        estimate: estimate.tokens,
        begun,
        stream,
        max_output: p.max_output_tokens(&view),
        cut_key,
        span,
    })))
}

/// end: a turn's outcome reaches the session and the metrics, as a
/// response's does at the end of its body.
pub fn end_turn(state: &Local, turn: Turn, status: u16, completed: bool, observed: Observed) {
    let recorded = crate::turn::Turn {
        series: turn.series,
        estimate: turn.estimate,
        begun: turn.begun,
        max_output: turn.max_output,
        span: turn.span,
    };
    turn::record(state, recorded, status, completed, observed);
}

/// What the policy made of a held `response.create`.
enum Decision {
    /// Not a turn (another event, or not JSON): forwarded as it came.
    NotATurn,
    Forward(Create),
    /// Answered with this `error` event; the turn failed with `status`.
    Reject {
        event: Vec<u8>,
        status: u16,
        turn: Turn,
    },
    /// Forwarded as this (trimmed) event instead.
    Replace {
        event: Vec<u8>,
        turn: Turn,
    },
}

/// decide: the HTTP policy, applied to one event.
async fn decide_turn(state: Local, hs: Arc<Handshake>, event: Bytes) -> Decision {
    let mut turn = match begin_turn(state.clone(), hs, event.clone()).await {
        None => return Decision::NotATurn,
        Some(w @ Create::Warmup { .. }) => return Decision::Forward(w),
        Some(Create::Turn(t)) => *t,
    };
    let cfg = &state.config;
    let api = Api::OpenAiResponses.as_str();
    let reject = |turn: Turn, err: ProxyError| {
        let status = err.status().as_u16();
        let message = err.message(cfg.max_body_bytes);
        let stream = turn.stream.as_deref();
        Decision::Reject {
            event: wire::error_event(err.shape(), status, err.kind(), &message, stream),
            status,
            turn,
        }
    };
    let over = match policy::decide(cfg, &turn.begun, turn.max_output) {
        Verdict::Pass { over } => {
            if let Some(o) = over {
                o.count(api, &turn.series.model, OnOver::Pass);
            }
            return Decision::Forward(Create::Turn(Box::new(turn)));
        }
        Verdict::Reject(r) => {
            if let Refusal::Context(o) = r {
                o.count(api, &turn.series.model, OnOver::Reject);
            }
            return reject(turn, r.into());
        }
        Verdict::Trim(o) => o,
    };
    let model = turn.begun.ticket.model().map(str::to_string);
    let asked = Trimming {
        api: Api::OpenAiResponses,
        body: &event,
        model: model.as_deref(),
        cut_key: turn.cut_key.as_deref(),
        ruler: turn.begun.ruler,
        over,
    };
    let Some((t, est)) = cut::trim_request(cfg, &state.estimator, &state.cuts, &asked) else {
        over.count(api, &turn.series.model, OnOver::Reject);
        return reject(turn, Refusal::Context(over).into());
    };
    let series = turn.series;
    let labels = (api, series.model.as_str());
    let key = turn.cut_key.clone();
    let after = cut::forwarded(
        &*state.store,
        &state.cuts,
        &mut turn.begun,
        labels,
        key,
        (&t, est, over),
    );
    turn.estimate = est.tokens;
    tracing::info!(
        before = over.projected,
        after,
        turns = t.turns,
        tool_results = t.tool_results,
        "websocket turn trimmed"
    );
    Decision::Replace {
        event: t.body,
        turn,
    }
}

/// A held client message waiting for its decision.
struct Deciding {
    decision: Pin<Box<dyn Future<Output = Decision> + Send>>,
    raw: Vec<Bytes>,
    compressed: bool,
    payload: Bytes,
}

/// Work on turns, done in the order its causes arrived on the socket.
enum Job {
    /// A turn being begun (estimated on a copy, the event already forwarded).
    Begin(Pin<Box<dyn Future<Output = Option<Create>> + Send>>),
    /// A server event that ends a response, waiting for the begins before it.
    End(Ended),
}

/// The watch of one Responses WebSocket.
pub struct Responses {
    state: Local,
    hs: Arc<Handshake>,
    /// A policy may stop or change an event: client messages are held
    /// whole until decided.
    policy: bool,
    /// The client's messages; `None` once they stopped parsing (the bytes
    /// then pass unread).
    client: Option<MessageReader>,
    /// The server's messages.
    server: Option<MessageReader>,
    /// The wire bytes of the client message being gathered (policy).
    held: Vec<Bytes>,
    deciding: Option<Deciding>,
    /// Client bytes read while a decision was pending: after it, in order.
    backlog: VecDeque<Bytes>,
    /// Frames tidemark sends the client, waiting for a boundary between the
    /// server's messages.
    inject: VecDeque<Bytes>,
    /// A compressed client message was dropped or rewritten under the
    /// client's context takeover: compressed ones now go decompressed.
    desync: bool,
    client_takeover: bool,
    jobs: VecDeque<Job>,
    /// Turns begun and not yet ended, per stream, oldest first.
    open: OpenTurns,
}

/// Responses begun and not yet ended, per stream, oldest first: turns,
/// and warm-ups (`None`).
type OpenTurns = HashMap<Option<String>, VecDeque<Option<Turn>>>;

/// A server event ended the oldest open response of its stream: a turn's
/// is recorded.
fn close_turn(state: &Local, open: &mut OpenTurns, e: Ended) {
    let turn = open.get_mut(&e.stream_id).and_then(VecDeque::pop_front);
    if let Some(Some(turn)) = turn {
        end_turn(state, turn, e.status, true, e.observed);
    }
}

/// A response begun; past [`MAX_OPEN`] the oldest open one (a warm-up
/// first) is given up.
fn opened(state: &Local, open: &mut OpenTurns, create: Create) {
    let (stream, turn) = match create {
        Create::Turn(t) => (t.stream.clone(), Some(*t)),
        Create::Warmup { stream } => (stream, None),
    };
    if open.values().map(VecDeque::len).sum::<usize>() >= MAX_OPEN {
        let oldest = open
            .iter_mut()
            .filter_map(|(k, q)| {
                let seq = q.front()?.as_ref().map_or(0, |t| t.begun.ticket.seq());
                Some((seq, k.clone()))
            })
            .min();
        let given_up = oldest.and_then(|(_, k)| {
            let q = open.get_mut(&k)?;
            let t = q.pop_front();
            if q.is_empty() {
                open.remove(&k);
            }
            t
        });
        if let Some(Some(t)) = given_up {
            end_turn(state, t, 502, false, Observed::default());
        }
    }
    open.entry(stream).or_default().push_back(turn);
}

/// The turns a socket ended before their response did: failed, as an
/// HTTP request the upstream reset (no anchor, no loss).
fn fail_open(state: &Local, open: OpenTurns) {
    for turn in open.into_values().flatten().flatten() {
        end_turn(state, turn, 502, false, Observed::default());
    }
}

/// The masking key of the first frame in `raw` (a client's frames all
/// have one).
fn first_mask(raw: &[Bytes]) -> Option<[u8; 4]> {
    let mut head = Vec::with_capacity(14);
    for b in raw {
        head.extend_from_slice(&b[..b.len().min(14 - head.len())]);
        if head.len() == 14 {
            break;
        }
    }
    parse_header(&head).ok().flatten().and_then(|h| h.mask)
}

/// One unfragmented, uncompressed frame.
fn frame(opcode: Opcode, mask: Option<[u8; 4]>, payload: &[u8]) -> Bytes {
    let mut b = BytesMut::with_capacity(payload.len() + 14);
    encode_frame(&mut b, true, false, opcode, mask, payload);
    b.freeze()
}

impl Responses {
    /// A whole client data message (held in policy mode): decided, or
    /// forwarded.
    fn message(
        &mut self,
        kind: Kind,
        compressed: bool,
        payload: Option<Bytes>,
        to_server: &mut Out,
    ) {
        let raw = std::mem::take(&mut self.held);
        match payload {
            Some(p)
                if kind == Kind::Text && memchr::memmem::find(&p, b"response.create").is_some() =>
            {
                self.deciding = Some(Deciding {
                    decision: Box::pin(decide_turn(
                        self.state.clone(),
                        Arc::clone(&self.hs),
                        p.clone(),
                    )),
                    raw,
                    compressed,
                    payload: p,
                });
            }
            p => self.forward(raw, kind, compressed, p.as_ref(), to_server),
        }
    }

    /// A client message on to the server: as it came, or, once the
    /// server's inflater lost a window, decompressed.
    fn forward(
        &self,
        raw: Vec<Bytes>,
        kind: Kind,
        compressed: bool,
        payload: Option<&Bytes>,
        to_server: &mut Out,
    ) {
        if let (true, true, Some(p)) = (self.desync, compressed, payload) {
            let op = match kind {
                Kind::Text => Opcode::Text,
                Kind::Binary => Opcode::Binary,
            };
            to_server.push(frame(op, first_mask(&raw), p));
            return;
        }
        for b in raw {
            to_server.push(b);
        }
    }

    /// Send the client a frame of tidemark's own, between two of the
    /// server's messages.
    fn inject(&mut self, event: &[u8], to_client: &mut Out) {
        let f = frame(Opcode::Text, None, event);
        let now = self.inject.is_empty()
            && self
                .server
                .as_ref()
                .map_or(true, MessageReader::at_message_boundary);
        match now {
            true => to_client.push(f),
            false => self.inject.push_back(f),
        }
    }

    /// A server event ended a response: its turn is recorded, once the
    /// turns begun before it have been.
    fn ended(&mut self, e: Ended) {
        if self.jobs.is_empty() {
            self.close_turn(e);
        } else {
            self.jobs.push_back(Job::End(e));
        }
    }

    fn close_turn(&mut self, e: Ended) {
        close_turn(&self.state, &mut self.open, e);
    }

    fn opened(&mut self, create: Create) {
        opened(&self.state, &mut self.open, create);
    }

    fn client_bytes(&mut self, data: Bytes, to_server: &mut Out, to_client: &mut Out) {
        if self.deciding.is_some() {
            self.backlog.push_back(data);
            return;
        }
        let Some(reader) = self.client.as_mut() else {
            to_server.push(data);
            return;
        };
        if !self.policy {
            // Forward first; the turn is worked out on a copy.
            to_server.push(data.clone());
            let mut at = 0;
            while at < data.len() {
                match reader.feed(&data[at..]) {
                    Err(_) => {
                        self.client = None;
                        return;
                    }
                    Ok((n, ev)) => {
                        at += n;
                        if let Some(Event::Message {
                            kind: Kind::Text,
                            payload,
                            ..
                        }) = ev
                        {
                            if memchr::memmem::find(&payload, b"response.create").is_some() {
                                let begin =
                                    begin_turn(self.state.clone(), Arc::clone(&self.hs), payload);
                                self.jobs.push_back(Job::Begin(Box::pin(begin)));
                            }
                        }
                    }
                }
            }
            return;
        }
        let mut at = 0;
        while at < data.len() {
            let Some(reader) = self.client.as_mut() else {
                return;
            };
            let (n, ev) = match reader.feed(&data[at..]) {
                Ok(r) => r,
                Err(_) => {
                    // Not a frame sequence tidemark reads: what is held and
                    // the rest go on untouched.
                    self.client = None;
                    for b in self.held.drain(..) {
                        to_server.push(b);
                    }
                    to_server.push(data.slice(at..));
                    return;
                }
            };
            let in_message = !reader.at_message_boundary();
            let piece = data.slice(at..at + n);
            at += n;
            match ev {
                Some(Event::Message {
                    kind,
                    compressed,
                    payload,
                }) => {
                    self.held.push(piece);
                    self.message(kind, compressed, Some(payload), to_server);
                }
                Some(Event::TooLarge {
                    kind, compressed, ..
                }) => {
                    self.held.push(piece);
                    self.message(kind, compressed, None, to_server);
                }
                // A control frame between messages: what is held is its
                // own first bytes.
                Some(Event::Control { .. }) if !in_message => {
                    for b in self.held.drain(..) {
                        to_server.push(b);
                    }
                    to_server.push(piece);
                }
                _ => self.held.push(piece),
            }
            if self.deciding.is_some() {
                if at < data.len() {
                    self.backlog.push_back(data.slice(at..));
                }
                return;
            }
        }
        let _ = to_client;
    }
}

impl Watch for Responses {
    fn client_sent(&mut self, data: Bytes, to_server: &mut Out, to_client: &mut Out) {
        self.client_bytes(data, to_server, to_client);
    }

    fn server_sent(&mut self, data: Bytes, to_client: &mut Out) {
        let Some(reader) = self.server.as_mut() else {
            to_client.push(data);
            return;
        };
        // Split only where a frame of tidemark's must go in between.
        let whole = self.inject.is_empty();
        if whole {
            to_client.push(data.clone());
        }
        let mut at = 0;
        let mut ends = Vec::new();
        while at < data.len() {
            match reader.feed(&data[at..]) {
                Err(_) => {
                    self.server = None;
                    if !whole {
                        to_client.push(data.slice(at..));
                    }
                    break;
                }
                Ok((n, ev)) => {
                    if !whole {
                        to_client.push(data.slice(at..at + n));
                    }
                    at += n;
                    if let Some(Event::Message {
                        kind: Kind::Text,
                        payload,
                        ..
                    }) = ev
                    {
                        if let Some(e) = wire::ended(&payload) {
                            ends.push(e);
                        }
                    }
                    if !self.inject.is_empty() && reader.at_message_boundary() {
                        for f in self.inject.drain(..) {
                            to_client.push(f);
                        }
                    }
                }
            }
        }
        for e in ends {
            self.ended(e);
        }
    }

    fn poll(&mut self, cx: &mut Context<'_>, to_server: &mut Out, to_client: &mut Out) -> bool {
        let mut progressed = false;
        if let Some(d) = self.deciding.as_mut() {
            if let Poll::Ready(decision) = d.decision.as_mut().poll(cx) {
                progressed = true;
                let d = self.deciding.take().expect("polled above");
                // Dropping or rewriting a compressed message under the
                // client's context takeover costs the server that window.
                let lose_window = d.compressed && self.client_takeover;
                match decision {
                    Decision::NotATurn => {
                        self.forward(d.raw, Kind::Text, d.compressed, Some(&d.payload), to_server)
                    }
                    Decision::Forward(create) => {
                        self.forward(d.raw, Kind::Text, d.compressed, Some(&d.payload), to_server);
                        self.opened(create);
                    }
                    Decision::Reject {
                        event,
                        status,
                        turn,
                    } => {
                        self.desync |= lose_window;
                        self.inject(&event, to_client);
                        end_turn(&self.state, turn, status, true, Observed::default());
                    }
                    Decision::Replace { event, turn } => {
                        self.desync |= lose_window;
                        to_server.push(frame(Opcode::Text, first_mask(&d.raw), &event));
                        self.opened(Create::Turn(Box::new(turn)));
                    }
                }
                while self.deciding.is_none() {
                    let Some(b) = self.backlog.pop_front() else {
                        break;
                    };
                    self.client_bytes(b, to_server, to_client);
                }
            }
        }
        while let Some(job) = self.jobs.front_mut() {
            match job {
                Job::Begin(f) => match f.as_mut().poll(cx) {
                    Poll::Ready(create) => {
                        self.jobs.pop_front();
                        progressed = true;
                        if let Some(create) = create {
                            count_over_budget(&self.state, &create);
                            self.opened(create);
                        }
                    }
                    Poll::Pending => break,
                },
                Job::End(_) => {
                    if let Some(Job::End(e)) = self.jobs.pop_front() {
                        self.close_turn(e);
                    }
                }
            }
        }
        progressed
    }

    fn hold_client(&self) -> bool {
        self.deciding.is_some() || self.jobs.len() >= MAX_BEGINS
    }

    fn end(&mut self) {
        // Turns still being begun when the socket ended are finished in a
        // task of their own, and the ends heard after them applied: Codex
        // drops the connection as soon as its answer is complete, often
        // before the estimate of a cold history is.
        let jobs = std::mem::take(&mut self.jobs);
        let mut open = std::mem::take(&mut self.open);
        if jobs.is_empty() {
            fail_open(&self.state, open);
            return;
        }
        let state = self.state.clone();
        tokio::spawn(async move {
            for job in jobs {
                match job {
                    Job::Begin(f) => {
                        if let Some(create) = f.await {
                            count_over_budget(&state, &create);
                            opened(&state, &mut open, create);
                        }
                    }
                    Job::End(e) => close_turn(&state, &mut open, e),
                }
            }
            fail_open(&state, open);
        });
    }
}

/// `--on-over pass` forwards every event, but one over the line is still
/// counted, as an HTTP request is.
fn count_over_budget(state: &Local, create: &Create) {
    let Create::Turn(turn) = create else {
        return;
    };
    if policy::over(&state.config, &turn.begun, turn.max_output).is_some() {
        metrics::get()
            .over_budget
            .with_label_values(&[
                Api::OpenAiResponses.as_str(),
                &turn.series.model,
                OnOver::Pass.as_str(),
            ])
            .inc();
    }
}
