//! Every session this process holds: a concurrent map from key to the
//! sessions of that key (one per credential), the per-model ratios learned
//! across sessions, and the `previous_response_id` links. With `--state
//! memory` it is the store; with `redis://` it is the replica's own copy.
use std::borrow::Cow;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use dashmap::DashMap;
use prometheus::IntGauge;

use super::calibration::{Fit, Prior, MODEL_DECAY};
use super::lane::{
    apply_counted, cold_ruler, ewma, turns_left, LaneRequest, ModelCal, Session, Sig, MIN_DELTA,
    MODEL_ALPHA, RATIO_MAX, RATIO_MIN,
};
use super::{
    wall_ms, Begun, KeySource, Outcome, Projection, RequestFacts, SessionConfig, Src, State, Ticket,
};
use crate::estimate::{Estimate, CLASSES};
use crate::metrics;
use crate::provider::Api;

/// Per-model ratios kept; model names come from clients.
const MAX_MODELS: usize = 256;
/// Most `previous_response_id` links remembered.
const MAX_RESPONSE_LINKS: usize = 1 << 18;

/// `previous_response_id` -> the session and lane that produced it, bounded FIFO.
#[derive(Default)]
struct Links {
    map: HashMap<Box<str>, (Box<str>, Box<str>, u64)>,
    order: VecDeque<Box<str>>,
}

/// The maps' hasher: seeded per process, as std's SipHash is, so clients
/// cannot aim collisions, and much cheaper on the short keys looked up
/// several times a request.
type Hasher = foldhash::fast::RandomState;

/// The session a request belongs to: its key, how it was named, and the
/// lane a `previous_response_id` points at.
pub(super) struct Resolved<'k> {
    pub key: Cow<'k, str>,
    pub source: KeySource,
    pub hint: Option<u64>,
}

/// Every session this process holds.
pub struct Sessions {
    /// key -> the sessions of that key, one per credential (almost always one).
    map: DashMap<Box<str>, Vec<Session>, Hasher>,
    models: DashMap<Box<str>, ModelState, Hasher>,
    links: Mutex<Links>,
    links_cap: usize,
    count: AtomicUsize,
    clock: AtomicU64,
    evicting: AtomicBool,
    epoch: Instant,
    ttl_ms: u64,
    cap: usize,
    gauges: [IntGauge; 4],
    lanes_gauge: IntGauge,
    /// Lanes this store holds (its share of the process-wide gauge).
    lanes: AtomicI64,
    /// Windows upstreams taught, by (upstream, model).
    windows: crate::window::learned::Learned,
}

/// What this process learned of one model across sessions.
#[derive(Default)]
struct ModelState {
    /// What its lanes start from.
    cal: ModelCal,
    /// Every lane's per-class samples, pooled: its ratios are `cal.classes`.
    fit: Fit,
}

/// What a shared backend holds of one session, handed to [`Sessions::merge`].
#[derive(Debug, Default)]
pub(super) struct SharedView {
    pub api: Option<Api>,
    pub source: Option<KeySource>,
    /// The newest response's id and lane.
    pub link: Option<(String, u64)>,
    pub lanes: Vec<super::lane::Lane>,
    /// `DELETE /sessions/{key}`'s tombstone: the sequence it was made at; 0 if none.
    pub deleted: u64,
    /// Totals summed over every replica.
    pub turns: u64,
    pub compactions: u32,
    pub spend: (u64, u64, u64),
    /// The model's calibration learned by every replica: (cold, marginal).
    pub model: (Option<f64>, Option<f64>),
    /// The same, per content class.
    pub model_classes: [Option<f64>; CLASSES],
}

/// What a finished request changed, for a shared backend to store.
pub(super) struct Changed {
    pub lane: Option<super::lane::Lane>,
    pub api: Api,
    pub source: KeySource,
    pub credential: Box<str>,
    pub last_seen_ms: u64,
    pub latest: u64,
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
            ttl_ms: u64::try_from(cfg.ttl.as_millis()).unwrap_or(u64::MAX),
            cap,
            gauges: State::ALL.map(|s| m.sessions.with_label_values(&[s.as_str()])),
            lanes_gauge: m.lanes.clone(),
            lanes: AtomicI64::new(0),
            windows: Default::default(),
        }
    }

    /// The windows upstreams taught.
    pub fn windows(&self) -> &crate::window::learned::Learned {
        &self.windows
    }

    fn mono_ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// Idle longer than the TTL: gone, however lazily its memory goes.
    fn expired(&self, s: &Session, now_ms: u64) -> bool {
        now_ms.saturating_sub(s.idle_ms) > self.ttl_ms
    }

    pub(super) fn model_cal(&self, model: Option<&str>) -> ModelCal {
        self.models
            .get(model.unwrap_or(""))
            .map(|c| c.cal)
            .unwrap_or_default()
    }

    fn learn_model(&self, model: Option<&str>, f: impl FnOnce(&mut ModelState)) {
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

    /// Move a session between state gauges.
    fn transition(&self, from: State, to: State) {
        if from != to {
            self.gauges[from as usize].dec();
            self.gauges[to as usize].inc();
        }
    }

    fn lanes_moved(&self, added: i64, removed: i64) {
        let d = added - removed;
        if d != 0 {
            self.lanes_gauge.add(d);
            self.lanes.fetch_add(d, Ordering::Relaxed);
        }
    }

    /// The session a request belongs to (SPEC §4): a header or agent id
    /// names it (a `previous_response_id` then only picks the lane, if it
    /// is this session's); else the response it continues; else its
    /// fingerprint.
    pub(super) fn resolve<'k>(
        &self,
        key: Option<Cow<'k, str>>,
        source: KeySource,
        continues: Option<&str>,
        credential: &str,
    ) -> Option<Resolved<'k>> {
        let link = continues.and_then(|id| self.follow(id, credential));
        match (key, source) {
            (Some(key), KeySource::Header | KeySource::Agent) => {
                let hint = link.filter(|(k, _)| **k == *key).map(|(_, l)| l);
                Some(Resolved { key, source, hint })
            }
            (key, _) => match link {
                Some((k, lane)) => Some(Resolved {
                    key: Cow::Owned(k.into()),
                    source: KeySource::Chain,
                    hint: Some(lane),
                }),
                None => key.map(|key| Resolved {
                    key,
                    source,
                    hint: None,
                }),
            },
        }
    }

    /// Project a request and open its ticket.
    pub fn begin(&self, facts: RequestFacts<'_>) -> Begun {
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
        source: KeySource,
        credential: &str,
        api: Api,
        continues: Option<&str>,
    ) -> Option<u64> {
        let r = self.resolve(key.map(Cow::Borrowed), source, continues, credential)?;
        // No clock read here: an expired session is found out, and made
        // anew, when the request begins.
        let (mut slot, idx) = self.slot(&r.key, credential, None, || {
            Session::new(credential, api, r.source)
        });
        let s = &mut slot[idx];
        s.seq += 1;
        Some(s.seq)
    }

    /// The session of `key` and `credential`, made by `make` if new or
    /// idle past the TTL at `now_ms` (evicting at the cap, counted under
    /// its state). `None`: not checked for idleness.
    fn slot(
        &self,
        key: &str,
        credential: &str,
        now_ms: Option<u64>,
        make: impl FnOnce() -> Session,
    ) -> (
        dashmap::mapref::one::RefMut<'_, Box<str>, Vec<Session>>,
        usize,
    ) {
        // Only at the cap does it matter whether the session exists before
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
            Some(i) => {
                if let Some(now_ms) = now_ms.filter(|now| self.expired(&slot[i], *now)) {
                    // Idle past the TTL: its next request is a first request.
                    let old = std::mem::replace(&mut slot[i], make());
                    slot[i].idle_ms = now_ms;
                    self.transition(old.state(), slot[i].state());
                    self.lanes_moved(0, old.lanes.len() as i64);
                }
                (slot, i)
            }
            None => {
                let mut r = make();
                r.idle_ms = now_ms.unwrap_or_else(|| self.mono_ms(Instant::now()));
                self.count.fetch_add(1, Ordering::Relaxed);
                self.gauges[r.state() as usize].inc();
                slot.push(r);
                let i = slot.len() - 1;
                (slot, i)
            }
        }
    }

    /// [`Sessions::begin`] at the place `order` that [`Sessions::reserve`]
    /// took (`None`: the next place now).
    pub fn begin_in_order(&self, facts: RequestFacts<'_>, order: Option<u64>) -> Begun {
        let RequestFacts {
            key,
            source,
            credential,
            api,
            model,
            estimate,
            classes,
            reset,
            window,
            window_upstream: _,
            counted,
            continues,
            content,
            stream,
        } = facts;
        let chained = continues.is_some();
        let resolved = self.resolve(
            key.map(Cow::Owned),
            source,
            continues.as_deref(),
            &credential,
        );
        let Some(Resolved { key, source, hint }) = resolved else {
            // No session: a cold projection, nothing stored.
            let mcal = self.model_cal(model.as_deref());
            let (ruler, src) = cold_ruler(None, None, &mcal);
            let (tokens, src, ruler) = apply_counted(ruler, src, counted, estimate, &classes);
            return Begun {
                projection: Projection {
                    tokens,
                    src,
                    window,
                    turns_left: None,
                },
                ticket: Ticket {
                    id: None,
                    lane: 0,
                    seq: 0,
                    estimate,
                    projection: tokens,
                    classes,
                    model: model.map(Into::into),
                    cold: true,
                    compacted: false,
                    shared: false,
                    prefix: None,
                },
                spent: 0,
                key: None,
                source: None,
                ruler,
                growth: None,
                local_state: false,
            };
        };
        let touch = self.clock.fetch_add(1, Ordering::Relaxed);
        let now = self.mono_ms(Instant::now());
        let (mut slot, idx) = self.slot(&key, &credential, Some(now), || {
            Session::new(&credential, api, source)
        });
        let s = &mut slot[idx];
        let before = s.state();
        let seq = match order {
            // Taken on arrival; a later arrival may have begun already.
            Some(o) => {
                s.seq = s.seq.max(o);
                o
            }
            None => {
                s.seq += 1;
                s.seq
            }
        };
        s.touch = touch;
        s.idle_ms = now;
        let wall = wall_ms();
        s.last_seen_ms = wall;
        s.api = api;
        s.source = source;
        let stream = stream.map_or(0, |d| xxhash_rust::xxh3::xxh3_64(d.as_bytes()));
        let req = LaneRequest {
            key: &key,
            api,
            sig: Sig {
                model: model.as_deref(),
                content,
                stream,
            },
            hint,
            estimate,
            classes,
            reset,
            window,
            counted,
            chained,
            seq,
            idle_ms: now,
            ttl_ms: self.ttl_ms,
            wall_ms: wall,
        };
        let b = s.begin(&req, |m| self.model_cal(m));
        let after = s.state();
        let spent = s.spent();
        drop(slot);
        self.transition(before, after);
        self.lanes_moved(b.lanes_added, b.lanes_removed);
        Begun {
            projection: Projection {
                tokens: b.tokens,
                src: b.src,
                window,
                turns_left: turns_left(b.tokens, window, b.growth),
            },
            ticket: Ticket {
                id: Some((credential.into(), Box::from(&*key))),
                lane: b.lane,
                seq,
                estimate: b.estimate,
                projection: b.tokens,
                classes: b.classes,
                model: model.map(Into::into),
                cold: b.cold,
                compacted: b.compacted,
                shared: false,
                prefix: None,
            },
            spent,
            key: Some(key.into_owned()),
            source: Some(source),
            ruler: b.ruler,
            growth: b.growth,
            local_state: false,
        }
    }

    /// `--exact-cold-start`: the provider counted this anchor-less request.
    pub fn apply_count(&self, begun: &mut Begun, tokens: u64) {
        let t = &begun.ticket;
        begun.ruler = begun.ruler.rebased(tokens, t.estimate, &t.classes);
        begun.projection.tokens = tokens;
        begun.projection.src = Src::Counted;
        self.refresh(begun);
    }

    /// Trimming: measure the trimmed body with the same ruler, and let this
    /// request's response anchor against what was actually sent.
    pub fn reproject(&self, begun: &mut Begun, new_estimate: impl Into<Estimate>) {
        let new_estimate = new_estimate.into();
        begun.ticket.estimate = new_estimate.tokens;
        begun.ticket.classes = new_estimate.classes;
        begun.projection.tokens = begun.ruler.measure_estimate(&new_estimate);
        self.refresh(begun);
    }

    /// Recompute `turns-left` and the lane's last projection after a change.
    fn refresh(&self, begun: &mut Begun) {
        let p = &mut begun.projection;
        begun.ticket.projection = p.tokens;
        p.turns_left = turns_left(p.tokens, p.window, begun.growth);
        if let Some((cred, key)) = &begun.ticket.id {
            if let Some(mut slot) = self.map.get_mut(&**key) {
                if let Some(s) = slot.iter_mut().find(|r| r.credential == *cred) {
                    s.reprojected(begun.ticket.lane, begun.ticket.seq, p.tokens, p.src);
                }
            }
        }
    }

    /// The response of a ticket's request ended: anchor, learn, or note a loss.
    pub fn finish(&self, ticket: Ticket, outcome: Outcome) {
        self.finish_inner(ticket, &outcome, false);
    }

    /// [`Sessions::finish`], returning what a shared backend stores.
    pub(super) fn finish_changed(&self, ticket: Ticket, outcome: &Outcome) -> Option<Changed> {
        self.finish_inner(ticket, outcome, true)
    }

    fn finish_inner(&self, ticket: Ticket, outcome: &Outcome, changed: bool) -> Option<Changed> {
        let ok = (200..300).contains(&outcome.status);
        let real = outcome
            .usage
            .total_context
            .filter(|_| ok && outcome.completed);
        let edited = outcome.server_edit.is_some();
        if let Some(real) = real.filter(|_| !edited) {
            if ticket.cold && ticket.estimate >= MIN_DELTA && real > 0 {
                let r = (real as f64 / ticket.estimate as f64).clamp(RATIO_MIN, RATIO_MAX);
                self.learn_model(ticket.model.as_deref(), |m| {
                    m.cal.cold = Some(ewma(m.cal.cold, r, MODEL_ALPHA))
                });
            }
        }
        let (cred, key) = ticket.id?;
        let (learned, out) = {
            let mut slot = self.map.get_mut(&*key)?;
            let s = slot.iter_mut().find(|r| r.credential == cred)?;
            let before = s.state();
            let learned = s.finish(
                ticket.lane,
                ticket.seq,
                (ticket.estimate, ticket.projection, &ticket.classes),
                outcome,
                |m| self.model_cal(m),
                ticket.prefix.as_deref(),
            );
            let after = s.state();
            let out = changed.then(|| Changed {
                lane: s.lanes.iter().find(|l| l.id == ticket.lane).cloned(),
                api: s.api,
                source: s.source,
                credential: s.credential.clone(),
                last_seen_ms: s.last_seen_ms,
                latest: s.latest,
            });
            drop(slot);
            self.transition(before, after);
            (learned, out)
        };
        let sample = learned.classes.sample;
        if learned.marginal.is_some() || sample.is_some() {
            self.learn_model(ticket.model.as_deref(), |m| {
                if let Some(r) = learned.marginal {
                    m.cal.marginal = Some(ewma(m.cal.marginal, r, MODEL_ALPHA));
                }
                if let Some(s) = sample {
                    // The model's own prior: Latin text's ratio it knows,
                    // else its single ratio, with headroom.
                    let single = m.cal.marginal.or(m.cal.cold).unwrap_or(1.0);
                    let base = m.cal.classes.latin().unwrap_or(single);
                    let scripts = m.cal.classes.scripts();
                    let prior = Prior::new(&Default::default(), base, scripts);
                    m.fit.add(&s, MODEL_DECAY, &prior);
                    m.cal.classes = m.fit.model_classes();
                }
            });
        }
        if ok {
            if let Some(id) = outcome.response_id.as_deref().filter(|id| !id.is_empty()) {
                self.link(id, cred, key, ticket.lane);
            }
        }
        out
    }

    fn link(&self, id: &str, cred: Box<str>, key: Box<str>, lane: u64) {
        let mut l = self.links.lock().unwrap_or_else(|e| e.into_inner());
        let id: Box<str> = id.into();
        if l.map.insert(id.clone(), (cred, key, lane)).is_none() {
            l.order.push_back(id);
        }
        while l.order.len() > self.links_cap {
            if let Some(old) = l.order.pop_front() {
                l.map.remove(&old);
            }
        }
    }

    /// The session key and lane of response `id`, if it belongs to `credential`.
    fn follow(&self, id: &str, credential: &str) -> Option<(Box<str>, u64)> {
        let l = self.links.lock().unwrap_or_else(|e| e.into_inner());
        l.map
            .get(id)
            .filter(|(c, _, _)| **c == *credential)
            .map(|(_, k, lane)| (k.clone(), *lane))
    }

    /// Drop sessions idle longer than the TTL.
    pub fn sweep(&self, now: Instant) {
        let now = self.mono_ms(now);
        self.remove_where(|r| self.expired(r, now));
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

    fn remove_where(&self, pred: impl Fn(&Session) -> bool) {
        let mut removed = [0i64; 4];
        let mut lanes = 0i64;
        self.map.retain(|_, v| {
            v.retain(|r| {
                let gone = pred(r);
                if gone {
                    removed[r.state() as usize] += 1;
                    lanes += r.lanes.len() as i64;
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
        self.lanes_moved(0, lanes);
    }

    /// `GET /sessions?limit=N`: the `limit` sessions of highest utilisation.
    pub fn list(&self, limit: usize) -> serde_json::Value {
        let now = self.mono_ms(Instant::now());
        // Min-heap of the best `limit` (utilisation, order) seen; sessions with
        // no window sort last.
        let mut heap: BinaryHeap<Reverse<Candidate>> = BinaryHeap::new();
        let mut total = 0usize;
        for e in self.map.iter() {
            for r in e.value().iter().filter(|r| !self.expired(r, now)) {
                total += 1;
                if limit == 0 {
                    continue;
                }
                let u = OrdF64(r.utilization().unwrap_or(-1.0));
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
        let mut top = heap.into_sorted_vec();
        top.truncate(limit);
        let sessions: Vec<serde_json::Value> = top
            .into_iter()
            .filter_map(|Reverse((_, _, k, c))| self.get(&k, Some(&c)))
            .collect();
        serde_json::json!({"total": total, "sessions": sessions})
    }

    /// `GET /sessions/{key}`: the session of that key under `credential`, or
    /// the most recently seen one.
    pub fn get(&self, key: &str, credential: Option<&str>) -> Option<serde_json::Value> {
        let rec = self.record_of(key, credential)?;
        Some(self.render(key, &rec))
    }

    /// A copy of the live (not expired) session of `key` under
    /// `credential`, or the most recently seen one.
    fn record_of(&self, key: &str, credential: Option<&str>) -> Option<Session> {
        let now = self.mono_ms(Instant::now());
        let slot = self.map.get(key)?;
        let mut live = slot.iter().filter(|r| !self.expired(r, now));
        let rec = match credential {
            Some(c) => live.find(|r| *r.credential == *c)?,
            None => live.max_by_key(|r| r.touch)?,
        };
        Some(rec.clone())
    }

    /// A plain copy of a live session (for a shared backend or tests).
    pub fn record(&self, key: &str, credential: &str) -> Option<Session> {
        self.record_of(key, Some(credential))
    }

    pub(super) fn render(&self, key: &str, s: &Session) -> serde_json::Value {
        s.render(key, |m| self.model_cal(m))
    }

    /// `DELETE /sessions/{key}`: drop the anchor of every lane of the
    /// session of `key` under `credential` (every credential's when
    /// `None`); the next request of each lane is a legitimate anchor-less
    /// one. `at`: a shared backend's tombstone sequence, else this
    /// process's own. Whether there was such a live session.
    pub fn reset(&self, key: &str, credential: Option<&str>) -> bool {
        self.reset_at(key, credential, 0)
    }

    pub(super) fn reset_at(&self, key: &str, credential: Option<&str>, at: u64) -> bool {
        let now = self.mono_ms(Instant::now());
        let mut moves = Vec::new();
        {
            let Some(mut slot) = self.map.get_mut(key) else {
                return false;
            };
            for s in slot.iter_mut() {
                if credential.is_some_and(|c| *s.credential != *c) || self.expired(s, now) {
                    continue;
                }
                let before = s.state();
                let at = at.max(s.seq);
                s.seq = at;
                for l in s.lanes.iter_mut() {
                    l.reset(at);
                }
                moves.push((before, s.state()));
            }
        }
        for (a, b) in &moves {
            self.transition(*a, *b);
        }
        !moves.is_empty()
    }

    /// Take in what a shared backend holds of a session before a request
    /// of it is projected: each stored lane replaces this process's copy
    /// unless this process heard a newer response in it; a delete's
    /// tombstone drops the anchors that came before it; totals are the
    /// larger of the shared and local ones; the model's calibration is the
    /// shared one.
    pub(super) fn merge(&self, key: &str, credential: &str, model: Option<&str>, sh: SharedView) {
        let shared_classes = sh.model_classes.iter().any(Option::is_some);
        if sh.model.0.is_some() || sh.model.1.is_some() || shared_classes {
            self.learn_model(model, |m| {
                let c = &mut m.cal;
                c.cold = sh.model.0.or(c.cold);
                c.marginal = sh.model.1.or(c.marginal);
                for (mine, shared) in c.classes.ratio.iter_mut().zip(sh.model_classes) {
                    *mine = shared.or(*mine);
                }
            });
        }
        if let Some((id, lane)) = &sh.link {
            self.link(id, credential.into(), key.into(), *lane);
        }
        let now = self.mono_ms(Instant::now());
        let api = sh.api.unwrap_or(Api::OpenAiChat);
        let source = sh.source.unwrap_or(KeySource::Header);
        let (before, after, added, removed) = {
            let (mut slot, idx) = self.slot(key, credential, Some(now), || {
                Session::new(credential, api, source)
            });
            let s = &mut slot[idx];
            let before = s.state();
            let held = s.lanes.len() as i64;
            for mut shared in sh.lanes {
                shared.idle_ms = now;
                match s.lanes.iter().position(|l| l.id == shared.id) {
                    Some(i) if shared.ver > s.lanes[i].ver => {
                        shared.begun = shared.begun.max(s.lanes[i].begun);
                        s.lanes[i] = shared;
                    }
                    Some(_) => {}
                    None if s.lanes.len() < super::lane::MAX_LANES => s.lanes.push(shared),
                    None => {}
                }
            }
            if sh.deleted > 0 {
                for l in s.lanes.iter_mut().filter(|l| l.fence <= sh.deleted) {
                    l.reset(sh.deleted);
                }
                s.seq = s.seq.max(sh.deleted);
            }
            s.turns = s.turns.max(sh.turns);
            s.compactions = s.compactions.max(sh.compactions);
            s.cum_input = s.cum_input.max(sh.spend.0);
            s.cum_cached = s.cum_cached.max(sh.spend.1);
            s.cum_output = s.cum_output.max(sh.spend.2);
            let now_held = s.lanes.len() as i64;
            (before, s.state(), now_held - held, 0)
        };
        self.transition(before, after);
        self.lanes_moved(added.max(0), removed);
    }

    /// The credentials this process holds a live session of `key` under.
    pub fn credentials(&self, key: &str) -> Vec<String> {
        let now = self.mono_ms(Instant::now());
        self.map
            .get(key)
            .map(|v| {
                v.iter()
                    .filter(|r| !self.expired(r, now))
                    .map(|r| r.credential.to_string())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The model's calibration this process holds: (cold, marginal).
    pub fn model_calibration(&self, model: Option<&str>) -> (Option<f64>, Option<f64>) {
        let c = self.model_cal(model);
        (c.cold, c.marginal)
    }

    /// The model's ratio per content class this process holds.
    pub fn model_class_calibration(&self, model: Option<&str>) -> [Option<f64>; CLASSES] {
        self.model_cal(model).classes.ratio
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
                self.gauges[r.state() as usize].dec();
            }
        }
        self.lanes_gauge.sub(self.lanes.load(Ordering::Relaxed));
    }
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
