//! One session's record and its lanes: which lane a request belongs to, and
//! the anchor, calibration, loss episodes and projection of each lane.
//!
//! # Which lane
//!
//! A lane is matched by its signature: (model, content hash of the system
//! prompt and the messages before the first user message, content hash of
//! the first user message, and a caller's own discriminator such as a
//! Responses WebSocket `stream_id`). Content hashes leave out markers that
//! move from turn to turn (`cache_control`). In order:
//!
//! 1. A request that continues a response (`previous_response_id`) is in
//!    that response's lane.
//! 2. The lane with the same signature: the request continues, rewinds or
//!    shrinks it (a shrink inside a lane is a compaction, as ever).
//! 3. Otherwise a new lane. If a lane with the same model, system prompt
//!    and discriminator exists whose anchor is larger than this request,
//!    this is that conversation's own compaction (a summary as the new
//!    first message): the compaction counts against that lane, and the new
//!    lane starts from its calibration and growth (`src=calibrated`). The
//!    old lane keeps its anchor: if it ever continues, it was a sub-agent
//!    after all. A sub-agent (its own system prompt) or a side call on
//!    another model is a new lane and touches nothing else.
//!
//! A session holds at most [`MAX_LANES`] lanes, the least recently used
//! going first, and a lane idle longer than the session TTL is gone.
use serde::{Deserialize, Serialize};

use super::cache::{self, Answered, LaneCache, Prefix};
use super::calibration::{ClassCal, ModelClasses, Taught};
use super::{push_hex, rfc3339, wall_ms, Anchor, Content, KeySource, Outcome, Ruler, Src, State};
use crate::estimate::Classes;
use crate::metrics;
use crate::provider::Api;

/// Ratios outside this range are measurement noise (a tiny delta, a
/// provider rounding), not a tokenizer difference.
pub(super) const RATIO_MIN: f64 = 0.25;
pub(super) const RATIO_MAX: f64 = 8.0;
/// Smallest estimate difference between two anchors that teaches a ratio.
pub(super) const MIN_DELTA: u64 = 16;
/// How much of the lane's earlier anchor differences survives each new
/// one: the marginal ratio is a decayed, size-weighted sum, so a turn of a
/// dozen tokens (all framing) moves it far less than a 5,000-token tool result.
const SESSION_DECAY: f64 = 0.5;
/// Weight of the newest sample in the per-model ratios learned across sessions.
pub(super) const MODEL_ALPHA: f64 = 0.1;
/// Weight of the newest turn in the growth per turn.
const GROWTH_ALPHA: f64 = 0.5;
/// Most lanes one session holds: a client cannot grow memory by sending
/// ever new system prompts under one session id.
pub const MAX_LANES: usize = 16;

/// Ratios learned across sessions for one model.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct ModelCal {
    /// real/estimate of anchor-less requests (overhead included).
    pub cold: Option<f64>,
    /// Marginal ratio of new content.
    pub marginal: Option<f64>,
    /// Marginal ratio of each content class: where a class new to a lane starts.
    pub classes: ModelClasses,
}

/// What a recorded response taught, for the model's ratios.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Learned {
    pub marginal: Option<f64>,
    pub classes: Taught,
}

pub(super) fn ewma(old: Option<f64>, sample: f64, alpha: f64) -> f64 {
    match old {
        Some(o) => o + alpha * (sample - o),
        None => sample,
    }
}

/// A lane's identity within its session (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sig<'a> {
    pub model: Option<&'a str>,
    pub content: Content,
    /// xxh3 of the caller's discriminator; 0 without one.
    pub stream: u64,
}

impl Sig<'_> {
    /// The lane id: stable across replicas (it names the lane's field in
    /// a shared backend) and, rendered in hex, in `/sessions`.
    pub fn id(&self) -> u64 {
        use xxhash_rust::xxh3::Xxh3;
        let mut h = Xxh3::new();
        h.update(self.model.unwrap_or("").as_bytes());
        h.update(&[0]);
        h.update(&self.content.system.to_le_bytes());
        h.update(&self.content.first.to_le_bytes());
        h.update(&self.stream.to_le_bytes());
        h.digest()
    }
}

/// One conversation of a session: its own anchor, calibration, loss
/// episodes and projection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lane {
    pub id: u64,
    pub model: Option<Box<str>>,
    /// Content hash of the system prompt (and what comes before the first
    /// user message).
    pub system: u64,
    /// Content hash of the first user message.
    pub first: u64,
    /// The caller's discriminator, hashed; 0 without one.
    pub stream: u64,
    pub anchor: Option<Anchor>,
    /// Responses of requests begun before this sequence may not anchor: a
    /// newer anchor or a drop fences them off.
    pub fence: u64,
    /// The last anchor ever made in this lane, kept across drops: the base
    /// for projecting anchor-less requests and for learning ratios.
    pub reference: Option<(u64, u64)>,
    /// The reference came from a response the provider had edited on its
    /// side: the difference to the next one teaches nothing.
    #[serde(default)]
    pub edited: bool,
    /// Learned real/estimate ratio for new content:
    /// `marginal_real / marginal_estimate` once enough was seen.
    pub marginal: Option<f64>,
    /// Decayed sums of real and estimated growth between consecutive anchors.
    pub marginal_real: f64,
    pub marginal_estimate: f64,
    /// Recent real growth per turn.
    pub growth: Option<f64>,
    /// The ratio of each content class, and the reference's estimate per class.
    #[serde(default)]
    pub classes: ClassCal,
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
    /// real / projection of the newest answered request that carried
    /// usage: how far off the lane's last projection was
    /// (`tidemark_projection_drift_ratio`, per lane, for `/sessions`).
    #[serde(default)]
    pub drift: Option<f64>,
    pub window: Option<u64>,
    pub anchor_losses: u32,
    /// Wall clock, milliseconds since the Unix epoch.
    pub last_seen_ms: u64,
    /// Sequence of the newest request begun in this lane (which lane goes
    /// first at the cap).
    pub begun: u64,
    /// Sequence of the newest response heard in this lane: the version a
    /// shared backend compares, so an older request never overwrites it.
    pub ver: u64,
    /// Process-local idle clock (ms since the store was made), for the TTL.
    #[serde(skip)]
    pub(super) idle_ms: u64,
    /// The prompt cache's view of the lane: its previous request, its
    /// busts (`cache.rs`).
    #[serde(default)]
    pub cache: LaneCache,
}

impl Lane {
    fn new(id: u64, sig: &Sig<'_>) -> Lane {
        Lane {
            id,
            model: sig.model.map(Into::into),
            system: sig.content.system,
            first: sig.content.first,
            stream: sig.stream,
            anchor: None,
            fence: 0,
            reference: None,
            edited: false,
            marginal: None,
            marginal_real: 0.0,
            marginal_estimate: 0.0,
            growth: None,
            classes: ClassCal::default(),
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
            drift: None,
            window: None,
            anchor_losses: 0,
            last_seen_ms: 0,
            begun: 0,
            ver: 0,
            idle_ms: 0,
            cache: LaneCache::default(),
        }
    }

    pub(super) fn derive_state(&self) -> State {
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

    fn matches(&self, sig: &Sig<'_>) -> bool {
        self.system == sig.content.system
            && self.first == sig.content.first
            && self.stream == sig.stream
            && self.model.as_deref() == sig.model
    }

    /// `DELETE /sessions/{key}` (or another replica's, at sequence `at`):
    /// the anchor goes, and the next request is a legitimate anchor-less one.
    pub(super) fn reset(&mut self, at: u64) {
        self.anchor = None;
        self.fence = self.fence.max(at + 1);
        self.reset_pending = true;
        self.state = self.derive_state();
    }

    /// The id as `/sessions` shows it.
    pub fn id_hex(&self) -> String {
        lane_hex(self.id)
    }

    pub(super) fn utilization(&self) -> Option<f64> {
        self.window
            .filter(|w| *w > 0)
            .map(|w| self.projection as f64 / w as f64)
    }
}

/// A lane id as 16 hex digits.
pub fn lane_hex(id: u64) -> String {
    let mut s = String::with_capacity(16);
    push_hex(&mut s, &id.to_be_bytes());
    s
}

/// One session, as a plain record a shared backend can store pieces of
/// (the key is stored beside it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Session {
    pub credential: Box<str>,
    #[serde(with = "api_name")]
    pub api: Api,
    /// How the latest request named the session.
    pub source: KeySource,
    /// Requests begun so far, all lanes: each request's ticket carries its
    /// number, and newer responses win by it.
    pub seq: u64,
    /// 2xx responses, all lanes.
    pub turns: u64,
    /// Compactions detected, all lanes.
    pub compactions: u32,
    pub cum_input: u64,
    pub cum_cached: u64,
    pub cum_output: u64,
    /// Wall clock, milliseconds since the Unix epoch.
    pub last_seen_ms: u64,
    /// The lane that served the latest request.
    pub latest: u64,
    /// Most recently used first is not kept: see [`Lane::begun`].
    pub lanes: Vec<Lane>,
    /// Process-local LRU order among sessions.
    #[serde(skip)]
    pub(super) touch: u64,
    /// Process-local idle clock (ms since the store was made), for the TTL.
    #[serde(skip)]
    pub(super) idle_ms: u64,
}

/// What a request needs to be placed in its lane and projected.
pub(super) struct LaneRequest<'a> {
    pub key: &'a str,
    pub api: Api,
    pub sig: Sig<'a>,
    /// The lane a `previous_response_id` names.
    pub hint: Option<u64>,
    pub estimate: u64,
    /// The estimate by content class.
    pub classes: Classes,
    pub reset: bool,
    pub window: Option<u64>,
    pub counted: Option<u64>,
    /// The request carries only its new input after a stored response.
    pub chained: bool,
    pub seq: u64,
    /// Process-local idle clock now, and the TTL, both in ms.
    pub idle_ms: u64,
    pub ttl_ms: u64,
    /// Wall clock now, ms since the Unix epoch.
    pub wall_ms: u64,
}

/// What [`Session::begin`] worked out.
pub(super) struct LaneBegun {
    pub lane: u64,
    /// The estimate anchors live in (a chained request's includes the stored part).
    pub estimate: u64,
    /// The same by content class.
    pub classes: Classes,
    pub tokens: u64,
    pub src: Src,
    pub ruler: Ruler,
    pub cold: bool,
    pub growth: Option<f64>,
    pub compacted: bool,
    /// Lanes made and dropped (the `tidemark_lanes` gauge).
    pub lanes_added: i64,
    pub lanes_removed: i64,
}

impl Session {
    pub(super) fn new(credential: &str, api: Api, source: KeySource) -> Self {
        Session {
            credential: credential.into(),
            api,
            source,
            seq: 0,
            turns: 0,
            compactions: 0,
            cum_input: 0,
            cum_cached: 0,
            cum_output: 0,
            last_seen_ms: 0,
            latest: 0,
            // Most sessions have one lane, or two with a side call.
            lanes: Vec::with_capacity(1),
            touch: 0,
            idle_ms: 0,
        }
    }

    /// The lane that served the latest request.
    pub fn lane(&self) -> Option<&Lane> {
        self.lanes
            .iter()
            .find(|l| l.id == self.latest)
            .or_else(|| self.lanes.iter().max_by_key(|l| l.begun))
    }

    /// The state of the latest lane: the session's in `tidemark_sessions`.
    pub fn state(&self) -> State {
        self.lane().map_or(State::New, |l| l.state)
    }

    /// Cumulative real prompt (cached included) plus output, all lanes.
    pub fn spent(&self) -> u64 {
        self.cum_input.saturating_add(self.cum_output)
    }

    /// Anchor losses over every lane held.
    pub fn anchor_losses(&self) -> u32 {
        self.lanes.iter().map(|l| l.anchor_losses).sum()
    }

    pub(super) fn utilization(&self) -> Option<f64> {
        self.lane().and_then(Lane::utilization)
    }

    /// Place a request in its lane and project it.
    pub(super) fn begin(
        &mut self,
        r: &LaneRequest<'_>,
        model_cal: impl Fn(Option<&str>) -> ModelCal,
    ) -> LaneBegun {
        let (idx, compacted, added, removed) = self.choose(r);
        let mcal = model_cal(r.sig.model);
        let lane = &mut self.lanes[idx];
        lane.begun = lane.begun.max(r.seq);
        lane.idle_ms = r.idle_ms;
        lane.last_seen_ms = r.wall_ms;
        lane.window = r.window;
        self.latest = lane.id;
        // A request chained with `previous_response_id` carries only its new
        // input: the provider prepends the stored conversation, so its size
        // is the anchored request's plus this one, not a shrink.
        let (estimate, classes) = match lane.anchor {
            Some(a) if r.chained && r.hint == Some(lane.id) => {
                let mut classes = r.classes;
                if lane.classes.based_at(a.estimate) {
                    classes.add_all(&lane.classes.at);
                }
                (a.estimate.saturating_add(r.estimate), classes)
            }
            _ => (r.estimate, r.classes),
        };
        let model = lane.model.as_deref();
        // A shrink is a compaction only against an anchor of an earlier
        // request: one that arrived before the anchor's request but is
        // projected after it (forward-first) is just the smaller, older body.
        let shrink = lane
            .anchor
            .is_some_and(|a| a.seq < r.seq && estimate < a.estimate);
        if shrink {
            count_compaction(r.api, model);
        }
        // The legitimate anchor-less requests drop the anchor on purpose.
        let dropped = r.reset || lane.reset_pending || shrink;
        if dropped {
            lane.anchor = None;
            lane.reset_pending = false;
            lane.fence = lane.fence.max(r.seq);
        }
        let lost = !dropped && lane.had_ok && !lane.last_ok_usage;
        // Before the lane has learned its own marginal ratio, the model's
        // (marginal, else whole-request cold) ratio is a better guess for new
        // content than 1: after a trim the gap to the next body can be large.
        let ratio = lane.marginal.or(mcal.marginal).or(mcal.cold).unwrap_or(1.0);
        let (tokens, mut src, ruler, cold) = match lane.anchor {
            Some(a) => {
                let ruler = Ruler {
                    base_real: a.real as f64,
                    base_estimate: a.estimate as f64,
                    ratio,
                    classes: lane.classes.ruler_at(a.estimate, &mcal.classes, ratio),
                };
                (
                    ruler.measure_classes(estimate, &classes),
                    Src::Anchored,
                    ruler,
                    false,
                )
            }
            None => {
                let (mut ruler, src) = cold_ruler(lane.reference, lane.marginal, &mcal);
                if let Some((_, e)) = lane.reference {
                    ruler.classes = lane.classes.ruler_at(e, &mcal.classes, ratio);
                }
                let (tokens, src, ruler) = apply_counted(ruler, src, r.counted, estimate, &classes);
                (tokens, src, ruler, true)
            }
        };
        if lost {
            src = Src::Lost;
            if !lane.losing {
                lane.losing = true;
                lane.anchor_losses = lane.anchor_losses.saturating_add(1);
                let m = metrics::get();
                m.anchor_lost
                    .with_label_values(&[r.api.as_str(), &m.model_label(model)])
                    .inc();
                tracing::warn!(
                    session = %r.key,
                    credential = %self.credential,
                    lane = %lane_hex(lane.id),
                    estimate,
                    last_real = ?lane.last_real,
                    "anchor lost: the last successful response carried no usage; projecting from the last anchor"
                );
            }
        }
        lane.projection = tokens;
        lane.src = src;
        lane.state = lane.derive_state();
        let (lane_id, growth) = (lane.id, lane.growth);
        let compacted = compacted || shrink;
        if compacted {
            self.compactions = self.compactions.saturating_add(1);
        }
        LaneBegun {
            lane: lane_id,
            estimate,
            classes,
            tokens,
            src,
            ruler,
            cold,
            growth,
            compacted,
            lanes_added: added,
            lanes_removed: removed,
        }
    }

    /// The request's lane (the module doc's rule): its index, whether
    /// choosing it detected a compaction, and lanes made and dropped.
    fn choose(&mut self, r: &LaneRequest<'_>) -> (usize, bool, i64, i64) {
        // Lanes idle past the TTL are gone, as sessions are.
        let before = self.lanes.len();
        let stale = |l: &Lane| r.idle_ms.saturating_sub(l.idle_ms) > r.ttl_ms;
        if self.lanes.iter().any(stale) {
            self.lanes.retain(|l| !stale(l));
        }
        let mut removed = (before - self.lanes.len()) as i64;
        let found = r
            .hint
            .and_then(|h| self.lanes.iter().position(|l| l.id == h))
            .or_else(|| self.lanes.iter().position(|l| l.matches(&r.sig)));
        if let Some(i) = found {
            return (i, false, 0, removed);
        }
        let id = r.sig.id();
        let mut lane = Lane::new(id, &r.sig);
        // The same conversation (model, system prompt, stream) with a new
        // first message, smaller than where it stood: its own compaction.
        let parent = self
            .lanes
            .iter()
            .filter(|l| {
                l.model.as_deref() == r.sig.model
                    && l.system == r.sig.content.system
                    && l.stream == r.sig.stream
            })
            .filter(|l| {
                l.anchor
                    .map(|a| a.estimate)
                    .or(l.reference.map(|(_, e)| e))
                    .is_some_and(|e| r.estimate < e)
            })
            .max_by_key(|l| l.begun);
        let compacted = parent.is_some();
        if parent.is_none() {
            // The same conversation (model, stream, first message) under
            // another system prompt: the prompt cache compares it with
            // that one's last request, so the change shows as a bust.
            if let Some(s) = self
                .lanes
                .iter()
                .filter(|l| {
                    l.model.as_deref() == r.sig.model
                        && l.first == r.sig.content.first
                        && l.stream == r.sig.stream
                        && r.sig.content.first != 0
                })
                .max_by_key(|l| l.begun)
            {
                lane.cache = s.cache.continued();
            }
        }
        if let Some(p) = parent {
            count_compaction(r.api, r.sig.model);
            lane.reference = p.reference;
            lane.edited = p.edited;
            lane.marginal = p.marginal;
            lane.marginal_real = p.marginal_real;
            lane.marginal_estimate = p.marginal_estimate;
            lane.growth = p.growth;
            lane.classes = p.classes.clone();
            lane.state = lane.derive_state();
        }
        if self.lanes.len() >= MAX_LANES {
            if let Some(oldest) = self
                .lanes
                .iter()
                .enumerate()
                .min_by_key(|(_, l)| l.begun)
                .map(|(i, _)| i)
            {
                self.lanes.swap_remove(oldest);
                removed += 1;
            }
        }
        self.lanes.push(lane);
        (self.lanes.len() - 1, compacted, 1, removed)
    }

    /// The response of a ticket's request ended: anchor its lane, learn, or
    /// note a loss. `projection` is what that request was projected at.
    /// Returns the ratios it taught, for the model.
    pub(super) fn finish(
        &mut self,
        lane_id: u64,
        seq: u64,
        (estimate, projection, classes): (u64, u64, &Classes),
        outcome: &Outcome,
        model_cal: impl Fn(Option<&str>) -> ModelCal,
        prefix: Option<&Prefix>,
    ) -> Learned {
        let ok = (200..300).contains(&outcome.status);
        let usage = &outcome.usage;
        let answered = ok && outcome.completed;
        let real = usage.total_context.filter(|_| answered);
        self.cum_input = self
            .cum_input
            .saturating_add(usage.total_context.unwrap_or(0));
        self.cum_cached = self
            .cum_cached
            .saturating_add(usage.cached_input.unwrap_or(0));
        self.cum_output = self.cum_output.saturating_add(usage.output.unwrap_or(0));
        if answered {
            self.turns += 1;
        }
        let api = self.api;
        let Some(lane) = self.lanes.iter_mut().find(|l| l.id == lane_id) else {
            return Learned::default();
        };
        lane.ver = lane.ver.max(seq);
        if let Some(prefix) = prefix.filter(|_| answered) {
            // Before the anchor moves: the shared prefix is measured from
            // the previous request's real count with the ratio as it was.
            let bust = lane.cache.answered(Answered {
                prefix,
                seq,
                real,
                projection,
                usage,
                rule: api.provider().prompt_cache(),
                ratio: lane.marginal,
            });
            if let Some(b) = bust {
                cache::count(api, lane.model.as_deref(), b);
            }
        }
        let mut learned = Learned::default();
        if answered {
            lane.turns += 1;
            lane.had_ok = true;
            if seq >= lane.last_ok_seq {
                lane.last_ok_seq = seq;
                lane.last_ok_usage = real.is_some();
                if let Some(r) = real {
                    lane.last_real = real;
                    lane.drift = (projection > 0).then(|| r as f64 / projection as f64);
                }
            }
            if real.is_some() {
                // A response with usage ends a loss episode.
                lane.losing = false;
            }
        }
        // The provider's count: of a response, or of a refusal that named
        // it (the window exceeded; no turn, but a real count all the same).
        let counted = real.or(outcome.refused_prompt.filter(|_| !ok));
        if let Some(real) = counted.filter(|_| seq >= lane.fence) {
            // The provider cleared part of the context itself: its count
            // dropped while the body did not. It re-anchors; it is no
            // sample of the tokenizer nor of growth.
            let edited = outcome.server_edit.is_some();
            if let Some((r0, e0)) = lane.reference.filter(|_| !edited && !lane.edited) {
                // Differences cancel the provider's fixed overhead.
                let mut dr = real as f64 - r0 as f64;
                let mut de = estimate as f64 - e0 as f64;
                if de < 0.0 {
                    (dr, de) = (-dr, -de);
                }
                if de > 0.0 && dr > 0.0 {
                    let mcal = model_cal(lane.model.as_deref());
                    let single = lane.marginal.or(mcal.marginal).unwrap_or(dr / de);
                    learned.classes = lane.classes.learn_anchor(
                        (e0, classes),
                        real as f64 - r0 as f64,
                        (&mcal.classes, single),
                        (api, lane.model.as_deref()),
                    );
                    lane.marginal_real = lane.marginal_real * SESSION_DECAY + dr;
                    lane.marginal_estimate = lane.marginal_estimate * SESSION_DECAY + de;
                    if lane.marginal_estimate >= MIN_DELTA as f64 {
                        lane.marginal = Some(
                            (lane.marginal_real / lane.marginal_estimate)
                                .clamp(RATIO_MIN, RATIO_MAX),
                        );
                    }
                    if de >= MIN_DELTA as f64 {
                        learned.marginal = Some((dr / de).clamp(RATIO_MIN, RATIO_MAX));
                    }
                }
            }
            if let Some(a) = lane.anchor.filter(|_| !edited) {
                // Consecutive anchors: growth per turn between them.
                let turns = seq.saturating_sub(a.seq).max(1) as f64;
                let g = (real as f64 - a.real as f64) / turns;
                if g > 0.0 {
                    lane.growth = Some(ewma(lane.growth, g, GROWTH_ALPHA));
                }
            }
            lane.anchor = Some(Anchor {
                real,
                estimate,
                at_ms: wall_ms(),
                seq,
            });
            lane.reference = Some((real, estimate));
            lane.classes.rebase(*classes, estimate);
            lane.edited = edited;
            lane.fence = seq + 1;
        }
        lane.state = lane.derive_state();
        learned
    }

    /// `--exact-cold-start` or a trim changed the projection of the
    /// request `seq` after it began: the lane shows the new one.
    pub(super) fn reprojected(&mut self, lane_id: u64, seq: u64, tokens: u64, src: Src) {
        if let Some(l) = self
            .lanes
            .iter_mut()
            .find(|l| l.id == lane_id && l.begun == seq)
        {
            l.projection = tokens;
            l.src = src;
        }
    }

    /// The session object of SPEC §6: the latest lane's fields at the top,
    /// the session's totals, and every lane.
    pub(super) fn render(
        &self,
        key: &str,
        model_cal: impl Fn(Option<&str>) -> ModelCal,
    ) -> serde_json::Value {
        let lane_fields = |l: Option<&Lane>| {
            let calibration = l.map_or(1.0, |l| {
                l.marginal
                    .or(model_cal(l.model.as_deref()).marginal)
                    .unwrap_or(1.0)
            });
            serde_json::json!({
                "model": l.and_then(|l| l.model.as_deref()),
                "state": l.map_or(State::New, |l| l.state).as_str(),
                "turns": l.map_or(0, |l| l.turns),
                "anchor": l.and_then(|l| l.anchor).map(|a| serde_json::json!({
                    "real": a.real,
                    "estimate": a.estimate,
                    "at": rfc3339(a.at_ms),
                })),
                "projection": l.map_or(0, |l| l.projection),
                "src": l.map_or(Src::Estimate, |l| l.src).as_str(),
                "last_real": l.and_then(|l| l.last_real),
                "drift": l.and_then(|l| l.drift).map(|d| (d * 10_000.0).round() / 10_000.0),
                "window": l.and_then(|l| l.window),
                "utilization": l.and_then(Lane::utilization).map(|u| (u * 1000.0).round() / 1000.0),
                "calibration": (calibration * 10_000.0).round() / 10_000.0,
                "classes": l.map_or_else(|| serde_json::json!({}), |l| l.classes.render()),
                "anchor_losses": l.map_or(0, |l| l.anchor_losses),
                "cache": l.map_or_else(|| LaneCache::default().render(), |l| l.cache.render()),
                "last_seen": rfc3339(l.map_or(self.last_seen_ms, |l| l.last_seen_ms)),
            })
        };
        let mut lanes: Vec<&Lane> = self.lanes.iter().collect();
        lanes.sort_by_key(|l| std::cmp::Reverse(l.begun));
        let lanes: Vec<serde_json::Value> = lanes
            .into_iter()
            .map(|l| {
                let mut v = lane_fields(Some(l));
                v["id"] = l.id_hex().into();
                v
            })
            .collect();
        let mut v = lane_fields(self.lane());
        let top = serde_json::json!({
            "key": key,
            "key_source": self.source.as_str(),
            "credential": &*self.credential,
            "api": self.api.as_str(),
            "turns": self.turns,
            "compactions": self.compactions,
            "cumulative": {
                "input": self.cum_input,
                "cached_input": self.cum_cached,
                "output": self.cum_output,
            },
            "last_seen": rfc3339(self.last_seen_ms),
            "lane": self.lane().map(Lane::id_hex),
            "lanes": lanes,
        });
        if let (Some(v), serde_json::Value::Object(top)) = (v.as_object_mut(), top) {
            v.extend(top);
        }
        v
    }
}

/// `tidemark_compactions_detected_total` +1.
fn count_compaction(api: Api, model: Option<&str>) {
    let m = metrics::get();
    m.compactions
        .with_label_values(&[api.as_str(), &m.model_label(model)])
        .inc();
}

/// Project without an anchor: from the lane's reference point with its
/// ratio, else the model's cold ratio, else the raw estimate.
pub(super) fn cold_ruler(
    reference: Option<(u64, u64)>,
    marginal: Option<f64>,
    m: &ModelCal,
) -> (Ruler, Src) {
    if let Some((real, est)) = reference {
        let ratio = marginal.or(m.marginal).or(m.cold).unwrap_or(1.0);
        return (
            Ruler {
                base_real: real as f64,
                base_estimate: est as f64,
                ratio,
                classes: None,
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
                classes: None,
            },
            Src::Calibrated,
        ),
        None => (
            Ruler {
                base_real: 0.0,
                base_estimate: 0.0,
                ratio: 1.0,
                classes: None,
            },
            Src::Estimate,
        ),
    }
}

/// A provider count replaces a cold projection and becomes the ruler's base.
pub(super) fn apply_counted(
    ruler: Ruler,
    src: Src,
    counted: Option<u64>,
    estimate: u64,
    classes: &Classes,
) -> (u64, Src, Ruler) {
    match counted {
        Some(n) => (n, Src::Counted, ruler.rebased(n, estimate, classes)),
        None => (ruler.measure_classes(estimate, classes), src, ruler),
    }
}

pub(super) fn turns_left(tokens: u64, window: Option<u64>, growth: Option<f64>) -> Option<u64> {
    let w = window.filter(|w| *w > 0)?;
    let g = growth.filter(|g| g.is_finite() && *g >= 1.0)?;
    Some((w.saturating_sub(tokens) as f64 / g).floor() as u64)
}

/// `Api` as its label string in stored records.
pub(super) mod api_name {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};

    use crate::provider::Api;

    pub fn serialize<S: Serializer>(api: &Api, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(api.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Api, D::Error> {
        let s = String::deserialize(d)?;
        Api::named(&s).ok_or_else(|| D::Error::custom(format!("unknown api {s}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_left_from_growth() {
        assert_eq!(turns_left(100, Some(1000), Some(100.0)), Some(9));
        assert_eq!(turns_left(2000, Some(1000), Some(100.0)), Some(0));
        assert_eq!(turns_left(100, None, Some(100.0)), None);
        assert_eq!(turns_left(100, Some(1000), None), None);
    }

    #[test]
    fn lane_ids_differ_by_every_part_of_the_signature() {
        let c = |system, first| Content { system, first };
        let base = Sig {
            model: Some("m"),
            content: c(1, 2),
            stream: 0,
        };
        let others = [
            Sig {
                model: Some("n"),
                ..base
            },
            Sig {
                model: None,
                ..base
            },
            Sig {
                content: c(3, 2),
                ..base
            },
            Sig {
                content: c(1, 3),
                ..base
            },
            Sig { stream: 9, ..base },
        ];
        for o in others {
            assert_ne!(base.id(), o.id(), "{o:?}");
        }
        assert_eq!(base.id(), Sig { ..base }.id());
    }
}
