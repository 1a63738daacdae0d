//! Sessions, lanes, anchors, calibration and the projection (SPEC §4, the
//! session object of §6). A [`Store`] begins a request (which session, which
//! lane, the projection) and finishes it (what the provider counted); the
//! spine never knows whether it is the process's own memory or Redis.
//!
//! The projection is `anchor.real + (estimate - anchor.estimate) * calibration`
//! where the anchor is the last real prompt count of the request's lane and
//! `calibration` the lane's learned real/estimate ratio for new content, one
//! per content class where the estimate says which classes its tokens are
//! (`calibration.rs`). Every projection is made by a [`Ruler`] `(base_real,
//! base_estimate, ratio, class ratios)` so a trimmed body can be re-measured
//! with the same ruler.
//!
//! - `identity.rs`: who is asking and which session: credential, session
//!   header, the ids agents send of their own accord, the fingerprint.
//! - `lane.rs`: a session's record and its lanes, and the lane rule.
//! - `calibration.rs`: a ratio per content class, fitted per lane and per model.
//! - `cache.rs`: a lane's prompt-cache economics (shared prefix, busts).
//! - `memory.rs`: the sessions this process holds.
//! - `redis.rs`: the same, shared between replicas through Redis.
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::estimate::{Classes, Estimate};
use crate::provider::{Api, Usage};

pub mod cache;
pub mod calibration;
pub mod identity;
pub mod lane;
mod memory;
pub mod redis;

pub use calibration::{ClassCal, ClassRuler};
pub use lane::{lane_hex, Lane, Session, MAX_LANES};
pub use memory::Sessions;

/// Where a projection came from (the `src` parameter of the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Src {
    Anchored,
    Counted,
    Calibrated,
    Estimate,
    Lost,
}

impl Src {
    pub fn as_str(self) -> &'static str {
        match self {
            Src::Anchored => "anchored",
            Src::Counted => "counted",
            Src::Calibrated => "calibrated",
            Src::Estimate => "estimate",
            Src::Lost => "lost",
        }
    }
}

/// The `state` of a session object and the label of `tidemark_sessions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Nothing learned yet.
    New,
    /// Has an anchor.
    Anchored,
    /// No anchor (dropped), but the session learned its ratio.
    Calibrated,
    /// In an anchor-loss episode.
    Lost,
}

impl State {
    pub(crate) const ALL: [State; 4] =
        [State::New, State::Anchored, State::Calibrated, State::Lost];
    pub fn as_str(self) -> &'static str {
        match self {
            State::New => "new",
            State::Anchored => "anchored",
            State::Calibrated => "calibrated",
            State::Lost => "lost",
        }
    }
}

/// How a session was named (`key_source` in `/sessions`), in SPEC §4's
/// order of precedence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeySource {
    /// A `--session-header`.
    Header,
    /// An id the agent sends of its own accord (see `identity.rs`).
    Agent,
    /// The `previous_response_id` chain.
    Chain,
    /// `fp:` + a hash of the conversation's start.
    Fingerprint,
}

impl KeySource {
    pub fn as_str(self) -> &'static str {
        match self {
            KeySource::Header => "header",
            KeySource::Agent => "agent",
            KeySource::Chain => "chain",
            KeySource::Fingerprint => "fingerprint",
        }
    }
}

pub struct SessionConfig {
    /// Sessions idle longer than this are gone (and dropped by `sweep`).
    pub ttl: Duration,
    /// Most sessions held; the least recently seen go first.
    pub max_sessions: usize,
}

/// Content hashes of where a conversation starts, markers that move from
/// turn to turn left out (`identity::content`): they make the fingerprint
/// and tell a session's lanes apart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Content {
    /// The system prompt, and the messages before the first user message.
    pub system: u64,
    /// The first user message.
    pub first: u64,
}

/// What the spine knows about a request when it asks for a projection.
pub struct RequestFacts<'a> {
    /// Session header, agent id or `fp:` fingerprint; `None`: project,
    /// store nothing (unless a `previous_response_id` names a session).
    pub key: Option<String>,
    /// How `key` was found.
    pub source: KeySource,
    /// First 8 hex of the credential's SHA-256, or `none`: part of the identity.
    pub credential: String,
    pub api: Api,
    pub model: Option<String>,
    /// Local token estimate of what will be sent.
    pub estimate: u64,
    /// The same by content class (empty: projected with the single ratio).
    pub classes: Classes,
    /// `x-context-reset: 1`.
    pub reset: bool,
    pub window: Option<u64>,
    /// The upstream (`window::learned::upstream_id`) whose learned window
    /// for the model may replace `window`: a shared backend may know one
    /// this process has not learned yet. `None` when a `--context-window`
    /// rule set `window`.
    pub window_upstream: Option<String>,
    /// A provider counting endpoint's answer (`--exact-cold-start`).
    pub counted: Option<u64>,
    /// OpenAI Responses `previous_response_id`.
    pub continues: Option<String>,
    /// Where the conversation starts: with the model, the lane.
    pub content: Content,
    /// A caller's own lane discriminator: each Responses WebSocket
    /// `stream_id` on one socket is its own lane.
    pub stream: Option<&'a str>,
}

impl Default for RequestFacts<'_> {
    fn default() -> Self {
        RequestFacts {
            key: None,
            source: KeySource::Header,
            credential: "none".into(),
            api: Api::OpenAiChat,
            model: None,
            estimate: 0,
            classes: Classes::default(),
            reset: false,
            window: None,
            window_upstream: None,
            counted: None,
            continues: None,
            content: Content::default(),
            stream: None,
        }
    }
}

/// The projected prompt size of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Projection {
    pub tokens: u64,
    pub src: Src,
    pub window: Option<u64>,
    pub turns_left: Option<u64>,
}

impl Projection {
    pub fn util(&self) -> Option<f64> {
        self.window
            .filter(|w| *w > 0)
            .map(|w| self.tokens as f64 / w as f64)
    }

    /// The `x-context-projection` RFC 8941 item.
    pub fn header_value(&self) -> String {
        let mut s = String::with_capacity(64);
        push_u64(&mut s, self.tokens);
        s.push_str(";src=");
        s.push_str(self.src.as_str());
        if let Some(w) = self.window.filter(|w| *w > 0) {
            s.push_str(";window=");
            push_u64(&mut s, w);
            if let Some(u) = self.util() {
                s.push_str(";util=");
                push_decimal(&mut s, u);
            }
        }
        if let Some(t) = self.turns_left {
            s.push_str(";turns-left=");
            push_u64(&mut s, t);
        }
        s
    }
}

/// Lower-case hex, without a `format!` per byte (session keys, hashed ids).
pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    push_hex(&mut s, bytes);
    s
}

/// [`hex`] appended to `out`.
pub fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
}

/// An RFC 8941 decimal: at most three fractional digits, trailing zeros dropped.
pub fn decimal(v: f64) -> String {
    let mut s = String::new();
    push_decimal(&mut s, v);
    s
}

/// `n` in decimal appended to `out`, without `core::fmt`.
pub fn push_u64(out: &mut String, n: u64) {
    out.push_str(itoa::Buffer::new().format(n));
}

/// [`decimal`] appended to `out`.
pub fn push_decimal(out: &mut String, v: f64) {
    use std::fmt::Write;
    let start = out.len();
    // Integer formatting where rounding to three places is unambiguous (it
    // runs for every response's projection header, into the header's own
    // buffer); float formatting for ties and the unusual.
    let x = v * 1000.0;
    if v.is_finite() && (0.0..1e15).contains(&x) && (x.fract() - 0.5).abs() > 1e-6 {
        let m = x.round() as u64;
        push_u64(out, m / 1000);
        out.push('.');
        let f = (m % 1000) as u32;
        for d in [f / 100, f / 10 % 10, f % 10] {
            out.push(char::from_digit(d, 10).unwrap_or('0'));
        }
    } else {
        let _ = write!(out, "{v:.3}");
    }
    // Trailing zeros dropped, one kept after the point.
    let mut end = start + out[start..].trim_end_matches('0').len();
    if out[..end].ends_with('.') {
        end += 1;
    }
    out.truncate(end);
}

/// [`decimal`] by float formatting alone: the definition the fast path follows.
#[cfg(test)]
fn decimal_by_format(v: f64) -> String {
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0');
    if s.ends_with('.') {
        format!("{s}0")
    } else {
        s.to_string()
    }
}

/// How a projection was measured: `base_real + (estimate - base_estimate) * ratio`,
/// or class by class when the lane knows the base's classes. A cold ruler
/// has a zero base.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ruler {
    pub base_real: f64,
    pub base_estimate: f64,
    /// The single ratio.
    pub ratio: f64,
    /// Each content class's ratio and the base's estimate per class.
    pub classes: Option<ClassRuler>,
}

impl Ruler {
    /// With the single ratio.
    pub fn measure(&self, estimate: u64) -> u64 {
        let t = self.base_real + (estimate as f64 - self.base_estimate) * self.ratio;
        rounded(t)
    }

    /// Class by class when both the ruler and the request know their
    /// classes (any part of the estimate outside them goes by the single
    /// ratio); else [`Ruler::measure`].
    pub fn measure_classes(&self, estimate: u64, classes: &Classes) -> u64 {
        let Some(c) = self.classes.filter(|_| !classes.is_empty()) else {
            return self.measure(estimate);
        };
        let unclassed = |total: f64, classes: &Classes| total - classes.sum() as f64;
        let rest = unclassed(estimate as f64, classes) - unclassed(self.base_estimate, &c.base);
        rounded(self.base_real + c.delta(classes) + rest * self.ratio)
    }

    /// [`Ruler::measure_classes`] of an estimate.
    pub fn measure_estimate(&self, e: &Estimate) -> u64 {
        self.measure_classes(e.tokens, &e.classes)
    }

    /// The same ratios from a new base: `real` tokens for an estimate of
    /// `estimate` with these classes.
    pub fn rebased(&self, real: u64, estimate: u64, classes: &Classes) -> Ruler {
        Ruler {
            base_real: real as f64,
            base_estimate: estimate as f64,
            ratio: self.ratio,
            classes: self.classes.map(|c| ClassRuler {
                base: *classes,
                ..c
            }),
        }
    }
}

fn rounded(t: f64) -> u64 {
    if t.is_finite() && t > 0.0 {
        t.round() as u64
    } else {
        0
    }
}
/// Carries a request from `begin` to `finish`.
#[derive(Debug)]
pub struct Ticket {
    /// (credential, key); `None` for key-less requests.
    id: Option<(Box<str>, Box<str>)>,
    /// The lane the request was placed in.
    lane: u64,
    /// The session's begin sequence: newer responses win.
    seq: u64,
    /// The estimate of what was sent (after trimming): anchors live in that space.
    estimate: u64,
    /// What the request was projected at (after a count or a trim): its
    /// response's real count over this is the lane's `drift`.
    projection: u64,
    /// The estimate by content class.
    classes: Classes,
    model: Option<Box<str>>,
    /// Projected without an anchor: its response teaches the model's cold ratio.
    cold: bool,
    /// Its begin detected a compaction (a shared backend adds them up).
    compacted: bool,
    /// Begun with a shared backend's record: its outcome is written back.
    shared: bool,
    /// What was sent, as the prompt cache sees it (`cache.rs`).
    prefix: Option<Box<cache::Prefix>>,
}

impl Ticket {
    /// (credential, key) of the session, `None` for key-less requests.
    pub fn session(&self) -> Option<(&str, &str)> {
        self.id.as_ref().map(|(c, k)| (&**c, &**k))
    }

    /// The request's sequence in its session.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// The lane's id (see [`lane_hex`]).
    pub fn lane(&self) -> u64 {
        self.lane
    }

    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// What was sent, as the prompt cache sees it: compared, when its
    /// response comes, with the lane's previous request.
    pub fn set_prefix(&mut self, mut p: cache::Prefix) {
        p.compacted = self.compacted;
        self.prefix = Some(Box::new(p));
    }
}

pub struct Begun {
    pub projection: Projection,
    pub ticket: Ticket,
    /// The session's cumulative real prompt (cached included) plus output,
    /// all lanes.
    pub spent: u64,
    pub key: Option<String>,
    pub source: Option<KeySource>,
    /// The ruler the projection was measured with.
    pub ruler: Ruler,
    /// The lane's recent growth per turn, for `turns-left`.
    growth: Option<f64>,
    /// A shared backend is configured but did not answer: projected from
    /// this process's state only (`state=local` on the projection header).
    pub local_state: bool,
}

impl Begun {
    /// Projected without an anchor (first request, shrink, reset, a new
    /// lane, after `DELETE`): where `--exact-cold-start` asks the provider
    /// to count and then calls [`Store::apply_count`].
    pub fn anchorless(&self) -> bool {
        self.ticket.cold
    }
}

/// What the provider said of one request, heard once its response ended.
#[derive(Debug, Default)]
pub struct Outcome {
    pub status: u16,
    pub usage: Usage,
    pub response_id: Option<String>,
    /// The response ended normally (not reset mid-stream).
    pub completed: bool,
    /// The provider edited the context on its side (its count dropped
    /// while the request did not): re-anchor, learn nothing from it.
    pub server_edit: Option<u64>,
    /// The provider refused the request as over its window and named the
    /// prompt's size: a real count, which anchors the lane as usage would.
    pub refused_prompt: Option<u64>,
}

/// An anchor: the real prompt count of a response and the estimate of the
/// request that produced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anchor {
    pub real: u64,
    pub estimate: u64,
    /// Wall clock, milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// Begin sequence of the request whose response made it.
    pub seq: u64,
}

pub(crate) fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// RFC 3339 UTC with milliseconds, from Unix milliseconds.
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}
/// A [`Store::begin`] under way: done with memory (no future to drive,
/// nothing allocated), a round trip to Redis otherwise.
// The memory arm is the one nearly every request takes: it holds its
// answer in place rather than in a box of its own.
#[allow(clippy::large_enum_variant)]
pub enum Beginning<'a> {
    Ready(Option<Begun>),
    Waiting(std::pin::Pin<Box<dyn std::future::Future<Output = Begun> + Send + 'a>>),
}

impl std::future::Future for Beginning<'_> {
    type Output = Begun;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Begun> {
        match self.get_mut() {
            // Taken once; a poll after that has nothing more to give.
            Beginning::Ready(b) => b
                .take()
                .map_or(std::task::Poll::Pending, std::task::Poll::Ready),
            Beginning::Waiting(f) => f.as_mut().poll(cx),
        }
    }
}

/// A future the admin API awaits: a shared backend's round trip (this
/// process's memory answers at once).
pub type Pending<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Where sessions live (`--state`): this process's memory ([`Sessions`]),
/// or Redis shared with other replicas ([`redis::Shared`]). Each owns its
/// begin and finish; the spine calls the same methods on either and never
/// knows which it has. The memory store never awaits and allocates no
/// future: its [`Store::begin`] is [`Beginning::Ready`].
pub trait Store: Send + Sync {
    /// This process's sessions (all of them with `memory`, its copy with Redis).
    fn sessions(&self) -> &Sessions;

    /// The request's place in its session's order, taken on arrival, when
    /// it is forwarded before it is projected ([`Sessions::reserve`]).
    /// With Redis the order is Redis's, taken when it is asked: `None`.
    fn reserve(
        &self,
        key: Option<&str>,
        source: KeySource,
        credential: &str,
        api: Api,
        continues: Option<&str>,
    ) -> Option<u64>;

    /// Project a request and open its ticket, at the place `order` that
    /// [`Store::reserve`] took (`None`: the next place now). With memory the
    /// answer is there when this returns; await it either way.
    fn begin<'a>(&'a self, facts: RequestFacts<'a>, order: Option<u64>) -> Beginning<'a>;

    /// The response of a ticket's request ended.
    fn finish(&self, ticket: Ticket, outcome: Outcome);

    /// A window learned (or, `None`, dropped) for the other replicas.
    fn share_window(&self, _upstream: &str, _model: &str, _window: Option<u64>) {}

    /// `GET /sessions/{key}`: the session of that key under `credential`,
    /// or the most recently seen one; with Redis, the shared record.
    fn get<'a>(
        &'a self,
        key: &'a str,
        credential: Option<&'a str>,
    ) -> Pending<'a, Option<serde_json::Value>>;

    /// `GET /sessions?limit=N`.
    fn list(&self, limit: usize) -> Pending<'_, serde_json::Value>;

    /// `DELETE /sessions/{key}[?credential=HASH]`: drop the anchors of
    /// that credential's session, or of every credential's. Whether there
    /// was one.
    fn delete<'a>(&'a self, key: &'a str, credential: Option<&'a str>) -> Pending<'a, bool>;

    /// The shared backend, if any: for `/readyz`.
    fn backend(&self) -> Option<&redis::RedisState> {
        None
    }
}

/// The store `--state` names: `memory` or a `redis://` URL.
pub fn open(cfg: SessionConfig, state: &str) -> Result<Box<dyn Store>, String> {
    Ok(match state {
        "memory" => Box::new(Sessions::new(cfg)),
        url => Box::new(redis::Shared::new(url, cfg)?),
    })
}

impl Store for Sessions {
    fn sessions(&self) -> &Sessions {
        self
    }

    fn reserve(
        &self,
        key: Option<&str>,
        source: KeySource,
        credential: &str,
        api: Api,
        continues: Option<&str>,
    ) -> Option<u64> {
        Sessions::reserve(self, key, source, credential, api, continues)
    }

    fn begin<'a>(&'a self, facts: RequestFacts<'a>, order: Option<u64>) -> Beginning<'a> {
        Beginning::Ready(Some(self.begin_in_order(facts, order)))
    }

    fn finish(&self, ticket: Ticket, outcome: Outcome) {
        Sessions::finish(self, ticket, outcome)
    }

    fn get<'a>(
        &'a self,
        key: &'a str,
        credential: Option<&'a str>,
    ) -> Pending<'a, Option<serde_json::Value>> {
        Box::pin(std::future::ready(Sessions::get(self, key, credential)))
    }

    fn list(&self, limit: usize) -> Pending<'_, serde_json::Value> {
        Box::pin(std::future::ready(Sessions::list(self, limit)))
    }

    fn delete<'a>(&'a self, key: &'a str, credential: Option<&'a str>) -> Pending<'a, bool> {
        Box::pin(std::future::ready(self.reset(key, credential)))
    }
}

/// What either store does through its own sessions.
impl dyn Store + '_ {
    /// `--exact-cold-start`: the provider counted this anchor-less request.
    pub fn apply_count(&self, begun: &mut Begun, tokens: u64) {
        self.sessions().apply_count(begun, tokens)
    }

    /// Trimming: the trimmed body, measured with the same ruler.
    pub fn reproject(&self, begun: &mut Begun, new_estimate: impl Into<Estimate>) {
        self.sessions().reproject(begun, new_estimate)
    }

    /// The windows upstreams taught (this process's, and what a shared
    /// backend handed it).
    pub fn windows(&self) -> &crate::window::learned::Learned {
        self.sessions().windows()
    }

    /// An upstream refused a prompt as over `window` tokens for `model`:
    /// remembered, and written to a shared backend for the other replicas.
    pub fn learn_window(&self, upstream: &str, model: &str, window: u64) {
        let before = self.windows().learn(upstream, model, window);
        if before != Some(window) {
            tracing::info!(
                upstream,
                model,
                window,
                before,
                "context window learned from the provider's refusal"
            );
        }
        self.share_window(upstream, model, Some(window));
    }

    /// The provider accepted a prompt larger than the window it had
    /// taught: the lesson is dropped (the table, or a flag, applies again).
    pub fn forget_window(&self, upstream: &str, model: &str) {
        if let Some(w) = self.windows().forget(upstream, model) {
            tracing::info!(
                upstream,
                model,
                window = w,
                "learned context window dropped: the provider accepted more"
            );
            self.share_window(upstream, model, None);
        }
    }

    /// Drop what is idle past the TTL from this process's memory.
    pub fn sweep(&self, now: std::time::Instant) {
        self.sessions().sweep(now)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::metrics;

    #[test]
    fn decimal_matches_float_formatting() {
        let slow = decimal_by_format;
        for v in [
            0.0, 0.5, 0.0625, 0.9995, 1.0, 1.25, 0.001, 0.0004, 0.85, 12.3456, 3e-9,
        ] {
            assert_eq!(decimal(v), slow(v), "{v}");
        }
        for i in 0..200_000u64 {
            let v = i as f64 / 131_072.0 + (i % 7) as f64 * 1e-4;
            assert_eq!(decimal(v), slow(v), "{v}");
        }
        for v in [f64::NAN, f64::INFINITY, -0.25, 1e20] {
            assert_eq!(decimal(v), slow(v), "{v}");
        }
        // Appended after what is there, which stays as it was.
        let mut s = String::from("util=10");
        push_decimal(&mut s, 0.5);
        assert_eq!(s, "util=100.5");
        let mut s = String::from("w=100.");
        push_decimal(&mut s, 2.0);
        assert_eq!(s, "w=100.2.0");
    }

    fn gauges() -> [i64; 4] {
        State::ALL.map(|st| {
            metrics::get()
                .sessions
                .with_label_values(&[st.as_str()])
                .get()
        })
    }

    fn delta(base: [i64; 4]) -> [i64; 4] {
        let now = gauges();
        [0, 1, 2, 3].map(|i| now[i] - base[i])
    }

    fn facts(key: &str, estimate: u64) -> RequestFacts<'static> {
        RequestFacts {
            key: Some(key.into()),
            api: Api::Anthropic,
            model: Some("gauge-model".into()),
            estimate,
            ..Default::default()
        }
    }

    fn outcome(real: Option<u64>) -> Outcome {
        Outcome {
            status: 200,
            usage: Usage {
                total_context: real,
                ..Default::default()
            },
            completed: true,
            ..Default::default()
        }
    }

    /// `tidemark_sessions{state}` follows every transition, sweep and drop.
    /// (The only test in the library that makes sessions, so the process-wide
    /// gauges are not moved by others while it runs.)
    #[test]
    fn state_gauges_follow_transitions() {
        let base = gauges();
        let s = Sessions::new(SessionConfig {
            ttl: Duration::from_secs(60),
            max_sessions: 10,
        });
        let lanes = || metrics::get().lanes.get();
        let lanes0 = lanes();
        let b = s.begin(facts("g1", 100));
        let b2 = s.begin(facts("g2", 100));
        assert_eq!(delta(base), [2, 0, 0, 0]);
        assert_eq!(lanes() - lanes0, 2);
        s.finish(b.ticket, outcome(Some(120)));
        assert_eq!(delta(base), [1, 1, 0, 0]);
        // A side call on another model: a lane more, the session's state
        // is its latest lane's.
        let mut side = facts("g1", 30);
        side.model = Some("gauge-side-model".into());
        let b = s.begin(side);
        assert_eq!(lanes() - lanes0, 3);
        assert_eq!(delta(base), [2, 0, 0, 0]);
        s.finish(b.ticket, outcome(Some(40)));
        assert_eq!(delta(base), [1, 1, 0, 0]);
        s.finish(b2.ticket, outcome(None));
        let b = s.begin(facts("g2", 110));
        assert_eq!(b.projection.src, Src::Lost);
        assert_eq!(delta(base), [0, 1, 0, 1]);
        assert!(s.reset("g1", None));
        assert_eq!(delta(base), [0, 0, 1, 1]);
        s.sweep(Instant::now() + Duration::from_secs(120));
        assert_eq!(s.len(), 0);
        assert_eq!(delta(base), [0, 0, 0, 0]);
        assert_eq!(lanes(), lanes0);
        s.begin(facts("g3", 100));
        assert_eq!(delta(base), [1, 0, 0, 0]);
        assert_eq!(lanes() - lanes0, 1);
        drop(s);
        assert_eq!(delta(base), [0, 0, 0, 0]);
        assert_eq!(lanes(), lanes0);
    }

    #[test]
    fn rfc3339_known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_700_000_000_123), "2023-11-14T22:13:20.123Z");
        assert_eq!(rfc3339(4_102_444_799_999), "2099-12-31T23:59:59.999Z");
    }

    #[test]
    fn header_renders_known_parts_only() {
        let p = Projection {
            tokens: 183_211,
            src: Src::Anchored,
            window: Some(200_000),
            turns_left: Some(7),
        };
        assert_eq!(
            p.header_value(),
            "183211;src=anchored;window=200000;util=0.916;turns-left=7"
        );
        let p = Projection {
            tokens: 10,
            src: Src::Estimate,
            window: None,
            turns_left: None,
        };
        assert_eq!(p.header_value(), "10;src=estimate");
    }

    #[test]
    fn ruler_never_negative() {
        let r = Ruler {
            base_real: 100.0,
            base_estimate: 1000.0,
            ratio: 2.0,
            classes: None,
        };
        assert_eq!(r.measure(0), 0);
        assert_eq!(r.measure(1000), 100);
        assert_eq!(r.measure(1010), 120);
    }
}
