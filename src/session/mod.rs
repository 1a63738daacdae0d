//! Sessions, anchors, calibration and the projection (SPEC §4, the session
//! object of §6). `begin` projects a request before it goes upstream;
//! `finish` hears what the provider counted and re-anchors.
//!
//! The projection is `anchor.real + (estimate - anchor.estimate) * calibration`
//! where the anchor is the last real prompt count of the session and
//! `calibration` the session's learned real/estimate ratio for new content.
//! Every projection is made by a [`Ruler`] `(base_real, base_estimate, ratio)`
//! so a trimmed body can be re-measured with the same ruler.
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use prometheus::IntGauge;
use serde::{Deserialize, Serialize};

use crate::metrics;
use crate::provider::{Api, Usage};

/// Ratios outside this range are measurement noise (a tiny delta, a
/// provider rounding), not a tokenizer difference.
const RATIO_MIN: f64 = 0.25;
const RATIO_MAX: f64 = 8.0;
/// Smallest estimate difference between two anchors that teaches a ratio.
const MIN_DELTA: u64 = 16;
/// How much of the session's earlier anchor differences survives each new
/// one: the marginal ratio is a decayed, size-weighted sum, so a turn of a
/// dozen tokens (all framing) moves it far less than a 5,000-token tool result.
const SESSION_DECAY: f64 = 0.5;
/// Weight of the newest sample in the per-model ratios learned across sessions.
const MODEL_ALPHA: f64 = 0.1;
/// Weight of the newest turn in the growth per turn.
const GROWTH_ALPHA: f64 = 0.5;
/// Per-model ratios kept; model names come from clients.
const MAX_MODELS: usize = 256;
/// Most `previous_response_id` links remembered.
const MAX_RESPONSE_LINKS: usize = 1 << 18;

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
    const ALL: [State; 4] = [State::New, State::Anchored, State::Calibrated, State::Lost];
    pub fn as_str(self) -> &'static str {
        match self {
            State::New => "new",
            State::Anchored => "anchored",
            State::Calibrated => "calibrated",
            State::Lost => "lost",
        }
    }
}

pub struct SessionConfig {
    /// Sessions idle longer than this are dropped by `sweep`.
    pub ttl: Duration,
    /// Most sessions held; the least recently seen go first.
    pub max_sessions: usize,
}

/// What the spine knows about a request when it asks for a projection.
pub struct RequestFacts {
    /// Header value or `fp:` fingerprint; `None`: project, store nothing.
    pub key: Option<String>,
    /// First 8 hex of the credential's SHA-256, or `none`: part of the identity.
    pub credential: String,
    pub api: Api,
    pub model: Option<String>,
    /// Local token estimate of what will be sent.
    pub estimate: u64,
    /// `x-context-reset: 1`.
    pub reset: bool,
    pub window: Option<u64>,
    /// A provider counting endpoint's answer (`--exact-cold-start`).
    pub counted: Option<u64>,
    /// OpenAI Responses `previous_response_id`.
    pub continues: Option<String>,
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

/// How a projection was measured: `base_real + (estimate - base_estimate) * ratio`.
/// A cold ruler has a zero base.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ruler {
    pub base_real: f64,
    pub base_estimate: f64,
    pub ratio: f64,
}

impl Ruler {
    pub fn measure(&self, estimate: u64) -> u64 {
        let t = self.base_real + (estimate as f64 - self.base_estimate) * self.ratio;
        if t.is_finite() && t > 0.0 {
            t.round() as u64
        } else {
            0
        }
    }
}

/// Carries a request from `begin` to `finish`.
#[derive(Debug)]
pub struct Ticket {
    /// (credential, key); `None` for key-less requests.
    id: Option<(Box<str>, Box<str>)>,
    /// The session's begin sequence: newer responses win.
    seq: u64,
    /// The estimate of what was sent (after trimming): anchors live in that space.
    estimate: u64,
    model: Option<Box<str>>,
    /// Projected without an anchor: its response teaches the model's cold ratio.
    cold: bool,
}

pub struct Begun {
    pub projection: Projection,
    pub ticket: Ticket,
    /// The session's cumulative real prompt (cached included) plus output.
    pub spent: u64,
    pub key: Option<String>,
    /// The ruler the projection was measured with.
    pub ruler: Ruler,
    /// The session's recent growth per turn, for `turns-left`.
    growth: Option<f64>,
}

impl Begun {
    /// Projected without an anchor (first request, shrink, reset, model
    /// change, after `DELETE`): where `--exact-cold-start` asks the provider
    /// to count and then calls [`Sessions::apply_count`].
    pub fn anchorless(&self) -> bool {
        self.ticket.cold
    }
}

pub struct Outcome {
    pub status: u16,
    pub usage: Usage,
    pub response_id: Option<String>,
    /// The response ended normally (not reset mid-stream).
    pub completed: bool,
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

/// One session, as a plain record a shared backend can store (the key is
/// stored beside it). `seq` is monotonic per session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    pub credential: Box<str>,
    #[serde(with = "api_name")]
    pub api: Api,
    pub model: Option<Box<str>>,
    /// Requests begun so far; each request's ticket carries its number.
    pub seq: u64,
    pub anchor: Option<Anchor>,
    /// Responses of requests begun before this sequence may not anchor: a
    /// newer anchor or a drop fences them off.
    pub fence: u64,
    /// The last anchor ever made under the current model, kept across drops:
    /// the base for projecting anchor-less requests and for learning ratios.
    pub reference: Option<(u64, u64)>,
    /// Learned real/estimate ratio for new content:
    /// `marginal_real / marginal_estimate` once enough was seen.
    pub marginal: Option<f64>,
    /// Decayed sums of real and estimated growth between consecutive anchors.
    pub marginal_real: f64,
    pub marginal_estimate: f64,
    /// Recent real growth per turn.
    pub growth: Option<f64>,
    /// `DELETE /sessions/{key}` happened: the next request is anchor-less.
    pub reset_pending: bool,
    /// Has had a 2xx response.
    pub had_ok: bool,
    /// Sequence of the newest 2xx response heard.
    pub last_ok_seq: u64,
    /// Whether that response carried usage.
    pub last_ok_usage: bool,
    /// In an anchor-loss episode (warned once).
    pub losing: bool,
    pub state: State,
    pub turns: u64,
    pub last_real: Option<u64>,
    pub projection: u64,
    pub src: Src,
    pub window: Option<u64>,
    pub compactions: u32,
    pub anchor_losses: u32,
    pub cum_input: u64,
    pub cum_cached: u64,
    pub cum_output: u64,
    /// Wall clock, milliseconds since the Unix epoch.
    pub last_seen_ms: u64,
    /// Process-local LRU order.
    #[serde(skip)]
    touch: u64,
    /// Process-local idle clock (ms since the store was made), for the TTL.
    #[serde(skip)]
    idle_ms: u64,
}

impl Record {
    fn new(credential: &str, api: Api, model: Option<&str>) -> Self {
        Record {
            credential: credential.into(),
            api,
            model: model.map(Into::into),
            seq: 0,
            anchor: None,
            fence: 0,
            reference: None,
            marginal: None,
            marginal_real: 0.0,
            marginal_estimate: 0.0,
            growth: None,
            reset_pending: false,
            had_ok: false,
            last_ok_seq: 0,
            last_ok_usage: false,
            losing: false,
            state: State::New,
            turns: 0,
            last_real: None,
            projection: 0,
            src: Src::Estimate,
            window: None,
            compactions: 0,
            anchor_losses: 0,
            cum_input: 0,
            cum_cached: 0,
            cum_output: 0,
            last_seen_ms: 0,
            touch: 0,
            idle_ms: 0,
        }
    }

    fn derive_state(&self) -> State {
        if self.losing {
            State::Lost
        } else if self.anchor.is_some() {
            State::Anchored
        } else if self.reference.is_some() || self.marginal.is_some() {
            State::Calibrated
        } else {
            State::New
        }
    }

    fn spent(&self) -> u64 {
        self.cum_input.saturating_add(self.cum_output)
    }
}

/// Ratios learned across sessions for one model.
#[derive(Debug, Default, Clone, Copy)]
struct ModelCal {
    /// real/estimate of anchor-less requests (overhead included).
    cold: Option<f64>,
    /// Marginal ratio of new content.
    marginal: Option<f64>,
}

/// `previous_response_id` -> the session that produced it, bounded FIFO.
#[derive(Default)]
struct Links {
    map: HashMap<Box<str>, (Box<str>, Box<str>)>,
    order: VecDeque<Box<str>>,
}

/// The maps' hasher: seeded per process, as std's SipHash is, and about a
/// fifth of its instructions on a 19-byte key (three lookups a request).
type Hasher = foldhash::fast::RandomState;

/// Every session this process holds.
pub struct Sessions {
    /// key -> the sessions of that key, one per credential (almost always one).
    map: DashMap<Box<str>, Vec<Record>, Hasher>,
    models: DashMap<Box<str>, ModelCal, Hasher>,
    links: Mutex<Links>,
    links_cap: usize,
    count: AtomicUsize,
    clock: AtomicU64,
    evicting: AtomicBool,
    epoch: Instant,
    ttl: Duration,
    cap: usize,
    gauges: [IntGauge; 4],
}

fn ewma(old: Option<f64>, sample: f64, alpha: f64) -> f64 {
    match old {
        Some(o) => o + alpha * (sample - o),
        None => sample,
    }
}

fn wall_ms() -> u64 {
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

fn turns_left(tokens: u64, window: Option<u64>, growth: Option<f64>) -> Option<u64> {
    let w = window.filter(|w| *w > 0)?;
    let g = growth.filter(|g| g.is_finite() && *g >= 1.0)?;
    Some((w.saturating_sub(tokens) as f64 / g).floor() as u64)
}

impl Sessions {
    pub fn new(cfg: SessionConfig) -> Self {
        let m = metrics::get();
        let cap = cfg.max_sessions.max(1);
        Sessions {
            map: DashMap::with_hasher(Hasher::default()),
            models: DashMap::with_hasher(Hasher::default()),
            links: Mutex::new(Links::default()),
            links_cap: cap.clamp(16, MAX_RESPONSE_LINKS),
            count: AtomicUsize::new(0),
            clock: AtomicU64::new(1),
            evicting: AtomicBool::new(false),
            epoch: Instant::now(),
            ttl: cfg.ttl,
            cap,
            gauges: State::ALL.map(|s| m.sessions.with_label_values(&[s.as_str()])),
        }
    }

    fn mono_ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    fn model_cal(&self, model: Option<&str>) -> ModelCal {
        self.models
            .get(model.unwrap_or(""))
            .map(|c| *c)
            .unwrap_or_default()
    }

    fn learn_model(&self, model: Option<&str>, f: impl FnOnce(&mut ModelCal)) {
        let name = model.unwrap_or("");
        if let Some(mut c) = self.models.get_mut(name) {
            f(&mut c);
            return;
        }
        if self.models.len() >= MAX_MODELS {
            return;
        }
        f(self.models.entry(name.into()).or_default().value_mut());
    }

    /// Move a record between state gauges.
    fn transition(&self, from: State, to: State) {
        if from != to {
            self.gauges[from as usize].dec();
            self.gauges[to as usize].inc();
        }
    }

    /// Project a request and open its ticket.
    pub fn begin(&self, facts: RequestFacts) -> Begun {
        self.begin_in_order(facts, None)
    }

    /// Take the request's place in its session's order now, before it is
    /// projected: a request forwarded before its estimate is worked out
    /// (forward-first) keeps the order in which requests arrived, so of two
    /// in flight at once the later one's response still wins. The session
    /// is the one [`Sessions::begin`] will find (the same key, credential
    /// and `previous_response_id` link), made here if it is new. `None`
    /// without a session key. Pass the answer to [`Sessions::begin_in_order`].
    pub fn reserve(
        &self,
        key: Option<&str>,
        credential: &str,
        api: Api,
        model: Option<&str>,
        continues: Option<&str>,
    ) -> Option<u64> {
        let linked = continues.and_then(|id| self.follow(id, credential));
        let key = linked.as_deref().or(key)?;
        let (mut slot, idx, _) = self.slot(key, credential, || Record::new(credential, api, model));
        let rec = &mut slot[idx];
        rec.seq += 1;
        Some(rec.seq)
    }

    /// The session's record of `key` and `credential`, made by `make` if
    /// new (evicting at the cap, counted under its state); whether it was.
    fn slot(
        &self,
        key: &str,
        credential: &str,
        make: impl FnOnce() -> Record,
    ) -> (
        dashmap::mapref::one::RefMut<'_, Box<str>, Vec<Record>>,
        usize,
        bool,
    ) {
        // Only at the cap does it matter whether the record exists before
        // the lookup below (a second lookup, hash and shard lock each).
        if self.count.load(Ordering::Relaxed) >= self.cap {
            let exists = self
                .map
                .get(key)
                .is_some_and(|v| v.iter().any(|r| *r.credential == *credential));
            if !exists {
                self.evict();
            }
        }
        let mut slot = match self.map.get_mut(key) {
            Some(s) => s,
            // Capacity 1: a `Vec` of large elements would otherwise start at 4.
            None => self
                .map
                .entry(Box::from(key))
                .or_insert_with(|| Vec::with_capacity(1)),
        };
        match slot.iter().position(|r| *r.credential == *credential) {
            Some(i) => (slot, i, false),
            None => {
                let r = make();
                self.count.fetch_add(1, Ordering::Relaxed);
                self.gauges[r.state as usize].inc();
                slot.push(r);
                let i = slot.len() - 1;
                (slot, i, true)
            }
        }
    }

    /// [`Sessions::begin`] at the place `order` that [`Sessions::reserve`]
    /// took (`None`: the next place now).
    pub fn begin_in_order(&self, facts: RequestFacts, order: Option<u64>) -> Begun {
        let RequestFacts {
            key,
            credential,
            api,
            model,
            estimate,
            reset,
            window,
            counted,
            continues,
        } = facts;
        let linked = continues.and_then(|id| self.follow(&id, &credential));
        let chained = linked.is_some();
        let key = linked.or(key);
        let mcal = self.model_cal(model.as_deref());
        let Some(key) = key else {
            // No session: a cold projection, nothing stored.
            let (ruler, src) = cold_ruler(None, None, &mcal);
            let (tokens, src, ruler) = apply_counted(ruler, src, counted, estimate);
            return Begun {
                projection: Projection {
                    tokens,
                    src,
                    window,
                    turns_left: None,
                },
                ticket: Ticket {
                    id: None,
                    seq: 0,
                    estimate,
                    model: model.map(Into::into),
                    cold: true,
                },
                spent: 0,
                key: None,
                ruler,
                growth: None,
            };
        };

        let touch = self.clock.fetch_add(1, Ordering::Relaxed);
        let idle = self.mono_ms(Instant::now());
        let (mut slot, idx, _) = self.slot(&key, &credential, || {
            Record::new(&credential, api, model.as_deref())
        });
        let rec = &mut slot[idx];
        // A request chained with `previous_response_id` carries only its new
        // input: the provider prepends the stored conversation, so its size
        // is the anchored request's plus this one, not a shrink.
        let estimate = match rec.anchor {
            Some(a) if chained => a.estimate.saturating_add(estimate),
            _ => estimate,
        };
        let before = rec.state;
        let seq = match order {
            // Taken on arrival; a later arrival may have begun already.
            Some(s) => {
                rec.seq = rec.seq.max(s);
                s
            }
            None => {
                rec.seq += 1;
                rec.seq
            }
        };
        rec.touch = touch;
        rec.idle_ms = idle;
        rec.last_seen_ms = wall_ms();
        rec.window = window;
        rec.api = api;

        // The legitimate anchor-less requests drop the anchor on purpose.
        let model_changed = seq > 1 && rec.model.as_deref() != model.as_deref();
        if model_changed {
            rec.model = model.as_deref().map(Into::into);
            rec.reference = None;
            rec.marginal = None;
            rec.marginal_real = 0.0;
            rec.marginal_estimate = 0.0;
            rec.growth = None;
        }
        // A shrink is a compaction only against an anchor of an earlier
        // request: one that arrived before the anchor's request but is
        // projected after it (forward-first) is just the smaller, older body.
        let shrink = !model_changed
            && rec
                .anchor
                .is_some_and(|a| a.seq < seq && estimate < a.estimate);
        if shrink {
            rec.compactions = rec.compactions.saturating_add(1);
            let m = metrics::get();
            m.compactions
                .with_label_values(&[api.as_str(), &m.model_label(model.as_deref())])
                .inc();
        }
        let dropped = reset || rec.reset_pending || model_changed || shrink;
        if dropped {
            rec.anchor = None;
            rec.reset_pending = false;
            rec.fence = rec.fence.max(seq);
        }
        let lost = !dropped && rec.had_ok && !rec.last_ok_usage;

        let mcal = if model_changed {
            self.model_cal(model.as_deref())
        } else {
            mcal
        };
        // Before the session has learned its own marginal ratio, the model's
        // (marginal, else whole-request cold) ratio is a better guess for new
        // content than 1: after a trim the gap to the next body can be large.
        let ratio = rec.marginal.or(mcal.marginal).or(mcal.cold).unwrap_or(1.0);
        let (ruler, mut src, cold) = match rec.anchor {
            Some(a) => (
                Ruler {
                    base_real: a.real as f64,
                    base_estimate: a.estimate as f64,
                    ratio,
                },
                Src::Anchored,
                false,
            ),
            None => {
                let (r, s) = cold_ruler(rec.reference, rec.marginal, &mcal);
                (r, s, true)
            }
        };
        let (tokens, s2, ruler) = if cold {
            apply_counted(ruler, src, counted, estimate)
        } else {
            (ruler.measure(estimate), src, ruler)
        };
        src = s2;
        if lost {
            src = Src::Lost;
            if !rec.losing {
                rec.losing = true;
                rec.anchor_losses = rec.anchor_losses.saturating_add(1);
                let m = metrics::get();
                m.anchor_lost
                    .with_label_values(&[api.as_str(), &m.model_label(model.as_deref())])
                    .inc();
                tracing::warn!(
                    session = %key,
                    credential = %rec.credential,
                    estimate,
                    last_real = ?rec.last_real,
                    "anchor lost: the last successful response carried no usage; projecting from the last anchor"
                );
            }
        }
        rec.projection = tokens;
        rec.src = src;
        rec.state = rec.derive_state();
        let after = rec.state;
        let growth = rec.growth;
        let spent = rec.spent();
        drop(slot);
        self.transition(before, after);
        Begun {
            projection: Projection {
                tokens,
                src,
                window,
                turns_left: turns_left(tokens, window, growth),
            },
            ticket: Ticket {
                id: Some((credential.into(), Box::from(key.as_str()))),
                seq,
                estimate,
                model: model.map(Into::into),
                cold,
            },
            spent,
            key: Some(key),
            ruler,
            growth,
        }
    }

    /// `--exact-cold-start`: the provider counted this anchor-less request.
    pub fn apply_count(&self, begun: &mut Begun, tokens: u64) {
        begun.ruler = Ruler {
            base_real: tokens as f64,
            base_estimate: begun.ticket.estimate as f64,
            ratio: begun.ruler.ratio,
        };
        begun.projection.tokens = tokens;
        begun.projection.src = Src::Counted;
        self.refresh(begun);
    }

    /// Trimming: measure the trimmed body with the same ruler, and let this
    /// request's response anchor against what was actually sent.
    pub fn reproject(&self, begun: &mut Begun, new_estimate: u64) {
        begun.ticket.estimate = new_estimate;
        begun.projection.tokens = begun.ruler.measure(new_estimate);
        self.refresh(begun);
    }

    /// Recompute `turns-left` and the session's last projection after a change.
    fn refresh(&self, begun: &mut Begun) {
        let p = &mut begun.projection;
        p.turns_left = turns_left(p.tokens, p.window, begun.growth);
        if let Some((cred, key)) = &begun.ticket.id {
            if let Some(mut slot) = self.map.get_mut(&**key) {
                if let Some(r) = slot.iter_mut().find(|r| r.credential == *cred) {
                    if r.seq == begun.ticket.seq {
                        r.projection = p.tokens;
                        r.src = p.src;
                    }
                }
            }
        }
    }

    /// The response of a ticket's request ended: anchor, learn, or note a loss.
    pub fn finish(&self, ticket: Ticket, outcome: Outcome) {
        let ok = (200..300).contains(&outcome.status);
        let usage = &outcome.usage;
        let real = usage.total_context.filter(|_| ok && outcome.completed);
        if let Some(real) = real {
            if ticket.cold && ticket.estimate >= MIN_DELTA && real > 0 {
                let r = (real as f64 / ticket.estimate as f64).clamp(RATIO_MIN, RATIO_MAX);
                self.learn_model(ticket.model.as_deref(), |c| {
                    c.cold = Some(ewma(c.cold, r, MODEL_ALPHA))
                });
            }
        }
        let Some((cred, key)) = ticket.id else {
            return;
        };
        let mut learned_marginal = None;
        {
            let Some(mut slot) = self.map.get_mut(&*key) else {
                return;
            };
            let Some(rec) = slot.iter_mut().find(|r| r.credential == cred) else {
                return;
            };
            let before = rec.state;
            rec.cum_input = rec
                .cum_input
                .saturating_add(usage.total_context.unwrap_or(0));
            rec.cum_cached = rec
                .cum_cached
                .saturating_add(usage.cached_input.unwrap_or(0));
            rec.cum_output = rec.cum_output.saturating_add(usage.output.unwrap_or(0));
            if ok && outcome.completed {
                rec.turns += 1;
                rec.had_ok = true;
                if ticket.seq >= rec.last_ok_seq {
                    rec.last_ok_seq = ticket.seq;
                    rec.last_ok_usage = real.is_some();
                    if real.is_some() {
                        rec.last_real = real;
                    }
                }
                if let Some(real) = real {
                    // A response with usage ends a loss episode.
                    rec.losing = false;
                    let same_model = rec.model.as_deref() == ticket.model.as_deref();
                    if ticket.seq >= rec.fence && same_model {
                        let est = ticket.estimate;
                        if let Some((r0, e0)) = rec.reference {
                            // Differences cancel the provider's fixed overhead.
                            let mut dr = real as f64 - r0 as f64;
                            let mut de = est as f64 - e0 as f64;
                            if de < 0.0 {
                                (dr, de) = (-dr, -de);
                            }
                            if de > 0.0 && dr > 0.0 {
                                rec.marginal_real = rec.marginal_real * SESSION_DECAY + dr;
                                rec.marginal_estimate = rec.marginal_estimate * SESSION_DECAY + de;
                                if rec.marginal_estimate >= MIN_DELTA as f64 {
                                    rec.marginal = Some(
                                        (rec.marginal_real / rec.marginal_estimate)
                                            .clamp(RATIO_MIN, RATIO_MAX),
                                    );
                                }
                                if de >= MIN_DELTA as f64 {
                                    learned_marginal = Some((dr / de).clamp(RATIO_MIN, RATIO_MAX));
                                }
                            }
                        }
                        if let Some(a) = rec.anchor {
                            // Consecutive anchors: growth per turn between them.
                            let turns = ticket.seq.saturating_sub(a.seq).max(1) as f64;
                            let g = (real as f64 - a.real as f64) / turns;
                            if g > 0.0 {
                                rec.growth = Some(ewma(rec.growth, g, GROWTH_ALPHA));
                            }
                        }
                        rec.anchor = Some(Anchor {
                            real,
                            estimate: est,
                            at_ms: wall_ms(),
                            seq: ticket.seq,
                        });
                        rec.reference = Some((real, est));
                        rec.fence = ticket.seq + 1;
                    }
                }
            }
            rec.state = rec.derive_state();
            let after = rec.state;
            drop(slot);
            self.transition(before, after);
        }
        if let Some(r) = learned_marginal {
            self.learn_model(ticket.model.as_deref(), |c| {
                c.marginal = Some(ewma(c.marginal, r, MODEL_ALPHA))
            });
        }
        if ok {
            if let Some(id) = outcome.response_id.filter(|id| !id.is_empty()) {
                self.link(id, cred, key);
            }
        }
    }

    fn link(&self, id: String, cred: Box<str>, key: Box<str>) {
        let mut l = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let id: Box<str> = id.into();
        if l.map.insert(id.clone(), (cred, key)).is_none() {
            l.order.push_back(id);
        }
        while l.order.len() > self.links_cap {
            if let Some(old) = l.order.pop_front() {
                l.map.remove(&old);
            }
        }
    }

    /// The key of the session that produced response `id`, if it belongs to `credential`.
    fn follow(&self, id: &str, credential: &str) -> Option<String> {
        let l = self.links.lock().unwrap_or_else(|e| e.into_inner());
        l.map
            .get(id)
            .filter(|(c, _)| **c == *credential)
            .map(|(_, k)| k.to_string())
    }

    /// Drop sessions idle longer than the TTL.
    pub fn sweep(&self, now: Instant) {
        let ttl = self.ttl.as_millis() as u64;
        let Some(cutoff) = self.mono_ms(now).checked_sub(ttl) else {
            return;
        };
        self.remove_where(|r| r.idle_ms < cutoff);
    }

    /// Evict the least recently seen sixteenth of the cap (at least one), so
    /// the scan is paid once per `cap/16` new sessions.
    fn evict(&self) {
        if self.evicting.swap(true, Ordering::AcqRel) {
            return;
        }
        let n = self.count.load(Ordering::Relaxed);
        if n >= self.cap {
            let keep = self.cap - (self.cap / 16).max(1);
            let remove = n - keep;
            let mut touches: Vec<u64> = Vec::with_capacity(n + 64);
            for e in self.map.iter() {
                touches.extend(e.value().iter().map(|r| r.touch));
            }
            if remove > 0 && !touches.is_empty() {
                let threshold = if remove >= touches.len() {
                    u64::MAX
                } else {
                    *touches.select_nth_unstable(remove - 1).1
                };
                drop(touches);
                self.remove_where(|r| r.touch <= threshold);
            }
        }
        self.evicting.store(false, Ordering::Release);
    }

    fn remove_where(&self, pred: impl Fn(&Record) -> bool) {
        let mut removed = [0i64; 4];
        self.map.retain(|_, v| {
            v.retain(|r| {
                let gone = pred(r);
                if gone {
                    removed[r.state as usize] += 1;
                }
                !gone
            });
            !v.is_empty()
        });
        let total: i64 = removed.iter().sum();
        self.count.fetch_sub(total as usize, Ordering::Relaxed);
        for (g, n) in self.gauges.iter().zip(removed) {
            g.sub(n);
        }
    }

    /// `GET /sessions?limit=N`: the `limit` sessions of highest utilisation.
    pub fn list(&self, limit: usize) -> serde_json::Value {
        // Min-heap of the best `limit` (utilisation, order) seen; sessions with
        // no window sort last.
        let mut heap: BinaryHeap<Reverse<Candidate>> = BinaryHeap::new();
        if limit > 0 {
            for e in self.map.iter() {
                for r in e.value() {
                    let u = OrdF64(utilization(r).unwrap_or(-1.0));
                    if heap.len() < limit {
                        heap.push(Reverse((u, r.touch, e.key().clone(), r.credential.clone())));
                    } else if heap
                        .peek()
                        .is_some_and(|Reverse(m)| (u, r.touch) > (m.0, m.1))
                    {
                        heap.pop();
                        heap.push(Reverse((u, r.touch, e.key().clone(), r.credential.clone())));
                    }
                }
            }
        }
        let mut top = heap.into_sorted_vec();
        top.truncate(limit);
        let sessions: Vec<serde_json::Value> = top
            .into_iter()
            .filter_map(|Reverse((_, _, k, c))| self.get(&k, Some(&c)))
            .collect();
        serde_json::json!({"total": self.len(), "sessions": sessions})
    }

    /// `GET /sessions/{key}`: the session of that key under `credential`, or
    /// the most recently seen one.
    pub fn get(&self, key: &str, credential: Option<&str>) -> Option<serde_json::Value> {
        let slot = self.map.get(key)?;
        let rec = match credential {
            Some(c) => slot.iter().find(|r| *r.credential == *c)?,
            None => slot.iter().max_by_key(|r| r.touch)?,
        };
        let rec = rec.clone();
        drop(slot);
        Some(self.render(key, &rec))
    }

    /// A plain copy of a session's record (for a shared backend or tests).
    pub fn record(&self, key: &str, credential: &str) -> Option<Record> {
        let slot = self.map.get(key)?;
        slot.iter().find(|r| *r.credential == *credential).cloned()
    }

    fn render(&self, key: &str, r: &Record) -> serde_json::Value {
        let mcal = self.model_cal(r.model.as_deref());
        let calibration = r.marginal.or(mcal.marginal).unwrap_or(1.0);
        serde_json::json!({
            "key": key,
            "credential": &*r.credential,
            "api": r.api.as_str(),
            "model": r.model.as_deref(),
            "state": r.state.as_str(),
            "turns": r.turns,
            "anchor": r.anchor.map(|a| serde_json::json!({
                "real": a.real,
                "estimate": a.estimate,
                "at": rfc3339(a.at_ms),
            })),
            "projection": r.projection,
            "last_real": r.last_real,
            "window": r.window,
            "utilization": utilization(r).map(|u| (u * 1000.0).round() / 1000.0),
            "calibration": (calibration * 10_000.0).round() / 10_000.0,
            "compactions": r.compactions,
            "anchor_losses": r.anchor_losses,
            "cumulative": {
                "input": r.cum_input,
                "cached_input": r.cum_cached,
                "output": r.cum_output,
            },
            "last_seen": rfc3339(r.last_seen_ms),
        })
    }

    /// `DELETE /sessions/{key}`: drop the anchor of every session of `key`;
    /// the next request of each is a legitimate anchor-less one.
    pub fn reset(&self, key: &str) -> bool {
        let mut moves = Vec::new();
        {
            let Some(mut slot) = self.map.get_mut(key) else {
                return false;
            };
            for r in slot.iter_mut() {
                let before = r.state;
                r.anchor = None;
                r.fence = r.seq + 1;
                r.reset_pending = true;
                r.state = r.derive_state();
                moves.push((before, r.state));
            }
        }
        for (a, b) in moves {
            self.transition(a, b);
        }
        true
    }

    /// Sessions held.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for Sessions {
    fn drop(&mut self) {
        // The gauges are process-wide; take this store's sessions back out.
        for e in self.map.iter() {
            for r in e.value() {
                self.gauges[r.state as usize].dec();
            }
        }
    }
}

/// Project without an anchor: from the session's reference point with its
/// ratio, else the model's cold ratio, else the raw estimate.
fn cold_ruler(reference: Option<(u64, u64)>, marginal: Option<f64>, m: &ModelCal) -> (Ruler, Src) {
    if let Some((real, est)) = reference {
        let ratio = marginal.or(m.marginal).or(m.cold).unwrap_or(1.0);
        return (
            Ruler {
                base_real: real as f64,
                base_estimate: est as f64,
                ratio,
            },
            Src::Calibrated,
        );
    }
    match m.cold.or(m.marginal) {
        Some(ratio) => (
            Ruler {
                base_real: 0.0,
                base_estimate: 0.0,
                ratio,
            },
            Src::Calibrated,
        ),
        None => (
            Ruler {
                base_real: 0.0,
                base_estimate: 0.0,
                ratio: 1.0,
            },
            Src::Estimate,
        ),
    }
}

/// A provider count replaces a cold projection and becomes the ruler's base.
fn apply_counted(ruler: Ruler, src: Src, counted: Option<u64>, estimate: u64) -> (u64, Src, Ruler) {
    match counted {
        Some(n) => (
            n,
            Src::Counted,
            Ruler {
                base_real: n as f64,
                base_estimate: estimate as f64,
                ratio: ruler.ratio,
            },
        ),
        None => (ruler.measure(estimate), src, ruler),
    }
}

fn utilization(r: &Record) -> Option<f64> {
    r.window
        .filter(|w| *w > 0)
        .map(|w| r.projection as f64 / w as f64)
}

/// A `list` candidate: (utilisation, LRU order, key, credential).
type Candidate = (OrdF64, u64, Box<str>, Box<str>);

/// `f64` with a total order, for sorting by utilisation.
#[derive(Debug, Clone, Copy, PartialEq)]
struct OrdF64(f64);
impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// `Api` as its label string in stored records.
mod api_name {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    use crate::provider::Api;

    const ALL: [Api; 5] = [
        Api::OpenAiChat,
        Api::OpenAiResponses,
        Api::Anthropic,
        Api::Gemini,
        Api::Ollama,
    ];

    pub fn serialize<S: Serializer>(api: &Api, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(api.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Api, D::Error> {
        let s = String::deserialize(d)?;
        ALL.iter()
            .copied()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| D::Error::custom(format!("unknown api {s}")))
    }
}

/// What a shared state backend (`--state redis://`) knows about a session
/// before it is projected: handed to [`Sessions::begin_shared`].
#[derive(Debug, Clone, Default)]
pub struct Shared {
    /// The request's place in the session's global order (the backend's
    /// counter); the ticket gets it unless this process is already past it.
    pub seq: u64,
    /// The newest stored record, if any.
    pub record: Option<Record>,
    /// The sequence that record was stored with, or a delete's tombstone
    /// (`record` is `None` then); 0 if none.
    pub record_seq: u64,
    /// Cumulative tokens summed over every replica: input (cached
    /// included), cached input, output.
    pub spend: (u64, u64, u64),
    /// The model's calibration learned by every replica: (cold, marginal).
    pub model: (Option<f64>, Option<f64>),
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

    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }
}

impl Sessions {
    /// [`Sessions::begin`] after taking in what a shared backend holds: the
    /// stored record replaces the local one unless this process heard a
    /// newer response; a delete's tombstone drops the local anchor; spend is
    /// the larger of the shared and local sums; the model's calibration is
    /// the shared one. `None` (no backend, or it is down): [`Sessions::begin`].
    pub fn begin_shared(&self, facts: RequestFacts, shared: Option<Shared>) -> Begun {
        let Some(sh) = shared else {
            return self.begin(facts);
        };
        let Some(key) = facts.key.as_deref() else {
            return self.begin(facts);
        };
        if sh.model.0.is_some() || sh.model.1.is_some() {
            self.learn_model(facts.model.as_deref(), |c| {
                c.cold = sh.model.0.or(c.cold);
                c.marginal = sh.model.1.or(c.marginal);
            });
        }
        let cred = facts.credential.as_str();
        let (before, after) = {
            let (mut slot, idx, created) = self.slot(key, cred, || match &sh.record {
                Some(r) if *r.credential == *cred => r.clone(),
                _ => Record::new(cred, facts.api, facts.model.as_deref()),
            });
            let rec = &mut slot[idx];
            let before = rec.state;
            if !created {
                match &sh.record {
                    Some(r) if *r.credential == *cred && r.last_ok_seq >= rec.last_ok_seq => {
                        let (touch, idle) = (rec.touch, rec.idle_ms);
                        let seq = rec.seq;
                        *rec = r.clone();
                        rec.touch = touch;
                        rec.idle_ms = idle;
                        rec.seq = rec.seq.max(seq);
                    }
                    None if sh.record_seq > 0
                        && rec.fence <= sh.record_seq
                        && rec.last_ok_seq < sh.record_seq =>
                    {
                        // Another replica answered `DELETE /sessions/{key}`.
                        rec.anchor = None;
                        rec.fence = sh.record_seq + 1;
                        rec.reset_pending = true;
                    }
                    _ => {}
                }
            }
            rec.cum_input = rec.cum_input.max(sh.spend.0);
            rec.cum_cached = rec.cum_cached.max(sh.spend.1);
            rec.cum_output = rec.cum_output.max(sh.spend.2);
            if rec.seq < sh.seq {
                rec.seq = sh.seq - 1;
            }
            rec.state = rec.derive_state();
            (before, rec.state)
        };
        self.transition(before, after);
        self.begin(facts)
    }

    /// The credentials this process holds a session of `key` under.
    pub fn credentials(&self, key: &str) -> Vec<String> {
        self.map
            .get(key)
            .map(|v| v.iter().map(|r| r.credential.to_string()).collect())
            .unwrap_or_default()
    }

    /// The model's calibration this process holds: (cold, marginal).
    pub fn model_calibration(&self, model: Option<&str>) -> (Option<f64>, Option<f64>) {
        let c = self.model_cal(model);
        (c.cold, c.marginal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn facts(key: &str, estimate: u64) -> RequestFacts {
        RequestFacts {
            key: Some(key.into()),
            credential: "none".into(),
            api: Api::Anthropic,
            model: Some("gauge-model".into()),
            estimate,
            reset: false,
            window: None,
            counted: None,
            continues: None,
        }
    }

    fn outcome(real: Option<u64>) -> Outcome {
        Outcome {
            status: 200,
            usage: Usage {
                total_context: real,
                ..Default::default()
            },
            response_id: None,
            completed: true,
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
        let b = s.begin(facts("g1", 100));
        let b2 = s.begin(facts("g2", 100));
        assert_eq!(delta(base), [2, 0, 0, 0]);
        s.finish(b.ticket, outcome(Some(120)));
        assert_eq!(delta(base), [1, 1, 0, 0]);
        s.finish(b2.ticket, outcome(None));
        let b = s.begin(facts("g2", 110));
        assert_eq!(b.projection.src, Src::Lost);
        assert_eq!(delta(base), [0, 1, 0, 1]);
        assert!(s.reset("g1"));
        assert_eq!(delta(base), [0, 0, 1, 1]);
        s.sweep(Instant::now() + Duration::from_secs(120));
        assert_eq!(s.len(), 0);
        assert_eq!(delta(base), [0, 0, 0, 0]);
        s.begin(facts("g3", 100));
        assert_eq!(delta(base), [1, 0, 0, 0]);
        drop(s);
        assert_eq!(delta(base), [0, 0, 0, 0]);
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
        };
        assert_eq!(r.measure(0), 0);
        assert_eq!(r.measure(1000), 100);
        assert_eq!(r.measure(1010), 120);
    }

    #[test]
    fn turns_left_from_growth() {
        assert_eq!(turns_left(100, Some(1000), Some(100.0)), Some(9));
        assert_eq!(turns_left(2000, Some(1000), Some(100.0)), Some(0));
        assert_eq!(turns_left(100, None, Some(100.0)), None);
        assert_eq!(turns_left(100, Some(1000), None), None);
    }
}
