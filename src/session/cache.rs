//! Cache economics of a lane: the prefix a request shares with the lane's
//! previous one, against what the provider reported reading from its
//! prompt cache.
//!
//! A request is seen as its units in the provider's order — each tool
//! definition, the system prompt, each message — each with a content hash
//! (markers that move from turn to turn, `cache_control`, left out) and its
//! estimated tokens. A lane keeps of its previous request at most
//! [`MAX_MARKS`] checkpoints: the chain hash of every unit up to one, and
//! their cumulative tokens, always one at the end of each part (tools,
//! system, history), so a difference is placed in its part.
//!
//! When a response comes back, the request is compared with the previous
//! one. The first checkpoint whose chain differs bounds the shared prefix;
//! its tokens are estimated and calibrated from the previous request's real
//! count, `real - (estimate after it) * ratio`, as a projection is. A
//! **bust** is a change that leaves less shared than the previous request
//! left cached (C: every prompt past the minimum where caching is
//! automatic, reads plus writes where it is not), confirmed by the
//! provider's own report: it read less than C. The bust invalidated
//! `C - read` cached tokens (the simulated provider's own accounting, the
//! reuse estimated where an API reports none), and is blamed on the part
//! that changed, or on `trim` when tidemark's own cut moved. A request that
//! is a shortened copy of the previous one (a rewind) is no bust, nor is a
//! compaction (a new start on purpose).
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::estimate::Estimator;
use crate::json::RequestView;
use crate::metrics;
use crate::provider::{Api, Part, PromptCache, Provider, Usage};

/// Checkpoints kept of a lane's previous request.
pub const MAX_MARKS: usize = 64;

/// What changed in a bust: the `cause` label of `tidemark_cache_busts_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    Tools,
    System,
    History,
    /// tidemark's own trim moved its cut.
    Trim,
}

impl Cause {
    pub const ALL: [Cause; 4] = [Cause::Tools, Cause::System, Cause::History, Cause::Trim];
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Tools => "tools",
            Cause::System => "system",
            Cause::History => "history",
            Cause::Trim => "trim",
        }
    }
    fn code(self) -> u8 {
        self as u8
    }
    fn from_code(c: u8) -> Cause {
        match c {
            0 => Cause::Tools,
            1 => Cause::System,
            _ => Cause::History,
        }
    }
}

/// One unit of a request, or a checkpoint of a kept one: the chain hash of
/// every unit up to and including unit `idx`, and their estimated tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    pub chain: u64,
    pub end: u32,
    pub idx: u32,
    /// The part the unit belongs to ([`Cause::code`]).
    part: u8,
}

/// A request as the prompt cache sees it: every unit, in order.
#[derive(Debug, Clone, Default)]
pub struct Prefix {
    units: Vec<Mark>,
    /// tidemark's trim cut this request was sent with (a hash; 0: untrimmed).
    pub cut: u64,
    /// Its begin detected a compaction: compared with nothing.
    pub(super) compacted: bool,
}

impl Prefix {
    /// The units of `req` for `p`, their tokens from the estimator (which
    /// has just counted them). `cut`: a hash of the trim cut it was sent
    /// with, 0 if none.
    pub fn of(
        p: &dyn Provider,
        req: &RequestView<'_>,
        estimator: &Estimator,
        model: Option<&str>,
        cut: u64,
    ) -> Prefix {
        let mut units = Vec::new();
        let (mut chain, mut end) = (0u64, 0u64);
        // Messages before the first user message are the system prompt (a
        // chat's system and developer messages), as for the lane.
        let mut before_user = true;
        let mut content = Vec::new();
        estimator.each_unit(p, req, model, |field, raw, tokens, key, rekey| {
            let part = match field.part {
                Part::Other => Cause::Tools,
                Part::System => Cause::System,
                Part::History => {
                    if before_user && super::identity::is_user_message(raw.get()) {
                        before_user = false;
                    }
                    if before_user && field.per_element {
                        Cause::System
                    } else {
                        before_user = false;
                        Cause::History
                    }
                }
            };
            // The estimator's key is a hash of the unit's bytes; one that
            // carries a moving marker is hashed without it.
            let key = match super::identity::content_without_markers(raw, &mut content) {
                true => rekey(&content),
                false => key,
            };
            chain = xxh3_64_with_seed(&key.to_le_bytes(), chain);
            end = end.saturating_add(tokens);
            units.push(Mark {
                chain,
                end: u32::try_from(end).unwrap_or(u32::MAX),
                idx: u32::try_from(units.len()).unwrap_or(u32::MAX),
                part: part.code(),
            });
        });
        Prefix {
            units,
            cut,
            compacted: false,
        }
    }

    /// At most [`MAX_MARKS`] checkpoints: every unit of a short request;
    /// of a long one, the last unit of each part and evenly spaced ones.
    fn marks(&self) -> Vec<Mark> {
        let u = &self.units;
        if u.len() <= MAX_MARKS {
            return u.clone();
        }
        let last_of_part = |i: usize| i + 1 == u.len() || u[i + 1].part != u[i].part;
        let fixed = (0..u.len()).filter(|&i| last_of_part(i)).count();
        let room = MAX_MARKS.saturating_sub(fixed).max(1);
        let stride = u.len().div_ceil(room);
        u.iter()
            .enumerate()
            .filter(|&(i, _)| last_of_part(i) || (i + 1) % stride == 0)
            .map(|(_, m)| *m)
            .take(MAX_MARKS)
            .collect()
    }
}

/// Where two requests part: the estimated tokens before it, and the part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Divergence {
    shared: u64,
    part: Cause,
}

/// The first checkpoint of `prev` that `cur` does not share. `None`: all
/// shared, or `cur` ends before the first difference the checkpoints show
/// (a rewind).
fn diverge(prev: &[Mark], cur: &[Mark]) -> Option<Divergence> {
    let mut shared = 0;
    for m in prev {
        let c = cur.get(m.idx as usize)?;
        if c.chain != m.chain {
            return Some(Divergence {
                shared,
                part: Cause::from_code(m.part),
            });
        }
        shared = u64::from(m.end);
    }
    None
}

/// The last request of a lane the provider answered, as the cache saw it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Seen {
    #[serde(with = "packed")]
    marks: Vec<Mark>,
    /// Its real prompt tokens (the projection where the response said none).
    real: u64,
    /// What it left in the provider's cache.
    extent: u64,
    cut: u64,
    seq: u64,
}

/// A lane's prompt-cache record.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LaneCache {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prev: Option<Seen>,
    /// Cache reads: reported, or where the API reports none, the reuse
    /// tidemark worked out.
    read: u64,
    /// Real prompt tokens of the same responses.
    input: u64,
    busts: u32,
    invalidated: u64,
}

/// A bust: what changed and the cached tokens it cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bust {
    pub cause: Cause,
    pub invalidated: u64,
}

/// What one answered request tells the lane's cache record.
pub(super) struct Answered<'a> {
    pub prefix: &'a Prefix,
    pub seq: u64,
    /// Its real prompt tokens, or `None` when the response said none.
    pub real: Option<u64>,
    /// The projection it was sent with (stands in for a missing count).
    pub projection: u64,
    pub usage: &'a Usage,
    pub rule: PromptCache,
    /// The lane's real/estimate ratio for new content, if learned.
    pub ratio: Option<f64>,
}

impl LaneCache {
    /// Compare an answered request with the lane's previous one, count a
    /// bust if it made one, and keep it as the new previous one.
    pub(super) fn answered(&mut self, a: Answered<'_>) -> Option<Bust> {
        if self.prev.as_ref().is_some_and(|p| a.seq < p.seq) {
            // An older request answered after a newer one: the newer one
            // is what the next request is compared with.
            return None;
        }
        let real = a.real.unwrap_or(a.projection);
        let mut reused = None;
        let mut bust = None;
        if let Some(prev) = self.prev.as_ref().filter(|_| !a.prefix.compacted) {
            let shared = match diverge(&prev.marks, &a.prefix.units) {
                None => prev.real,
                Some(d) => {
                    let total = prev.marks.last().map_or(0, |m| u64::from(m.end));
                    let ratio = a
                        .ratio
                        .filter(|r| r.is_finite() && *r > 0.0)
                        .unwrap_or_else(|| prev.real as f64 / total.max(1) as f64);
                    let after = total.saturating_sub(d.shared) as f64 * ratio;
                    let shared = (prev.real as f64 - after).clamp(0.0, prev.real as f64) as u64;
                    if shared < prev.extent {
                        let read = a
                            .usage
                            .cached_input
                            .unwrap_or_else(|| a.rule.reusable(shared.min(prev.extent)));
                        if read < prev.extent {
                            let cause = match d.part {
                                Cause::History if a.prefix.cut != prev.cut => Cause::Trim,
                                c => c,
                            };
                            bust = Some(Bust {
                                cause,
                                invalidated: prev.extent - read,
                            });
                        }
                    }
                    shared
                }
            };
            reused = Some(a.rule.reusable(shared.min(prev.extent).min(real)));
        }
        self.read = self
            .read
            .saturating_add(a.usage.cached_input.or(reused).unwrap_or(0));
        self.input = self.input.saturating_add(real);
        if let Some(b) = bust {
            self.busts = self.busts.saturating_add(1);
            self.invalidated = self.invalidated.saturating_add(b.invalidated);
        }
        self.prev = Some(Seen {
            marks: a.prefix.marks(),
            real,
            extent: a.rule.extent(real, a.usage),
            cut: a.prefix.cut,
            seq: a.seq,
        });
        bust
    }

    /// A new lane that continues this one's conversation (another system
    /// prompt): its next request is compared with this one's last; the
    /// counts start afresh.
    pub(super) fn continued(&self) -> LaneCache {
        LaneCache {
            prev: self.prev.clone(),
            ..LaneCache::default()
        }
    }

    /// `cache` in a lane of `/sessions`.
    pub fn render(&self) -> serde_json::Value {
        let ratio = (self.input > 0)
            .then(|| (self.read as f64 / self.input as f64 * 1000.0).round() / 1000.0);
        serde_json::json!({
            "hit_ratio": ratio,
            "busts": self.busts,
            "invalidated_tokens": self.invalidated,
        })
    }
}

/// A bust into `tidemark_cache_busts_total` and
/// `tidemark_cache_invalidated_tokens_total`.
pub(super) fn count(api: Api, model: Option<&str>, b: Bust) {
    let m = metrics::get();
    let model = m.model_label(model);
    m.cache_busts
        .with_label_values(&[api.as_str(), &model, b.cause.as_str()])
        .inc();
    m.cache_invalidated
        .with_label_values(&[api.as_str(), &model])
        .inc_by(b.invalidated);
}

/// Checkpoints stored as one base64 string of packed little-endian
/// records (a lane is written to a shared backend on every response).
mod packed {
    use super::*;

    const RECORD: usize = 8 + 4 + 4 + 1;

    pub fn serialize<S: serde::Serializer>(marks: &[Mark], s: S) -> Result<S::Ok, S::Error> {
        let mut b = Vec::with_capacity(marks.len() * RECORD);
        for m in marks {
            b.extend_from_slice(&m.chain.to_le_bytes());
            b.extend_from_slice(&m.end.to_le_bytes());
            b.extend_from_slice(&m.idx.to_le_bytes());
            b.push(m.part);
        }
        s.serialize_str(&base64::engine::general_purpose::STANDARD_NO_PAD.encode(b))
    }

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<Mark>, D::Error> {
        use serde::de::Error;
        let s = String::deserialize(d)?;
        let b = base64::engine::general_purpose::STANDARD_NO_PAD
            .decode(s)
            .map_err(D::Error::custom)?;
        if b.len() % RECORD != 0 || b.len() / RECORD > MAX_MARKS {
            return Err(D::Error::custom("checkpoints of a wrong size"));
        }
        Ok(b.chunks_exact(RECORD)
            .map(|r| {
                let n8 = |a: usize| u64::from_le_bytes(r[a..a + 8].try_into().unwrap_or([0; 8]));
                let n4 = |a: usize| u32::from_le_bytes(r[a..a + 4].try_into().unwrap_or([0; 4]));
                Mark {
                    chain: n8(0),
                    end: n4(8),
                    idx: n4(12),
                    part: r[16],
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(parts: &[(u8, u64)]) -> Vec<Mark> {
        let mut end = 0u32;
        parts
            .iter()
            .enumerate()
            .map(|(i, &(part, h))| {
                end += 100;
                Mark {
                    chain: h,
                    end,
                    idx: i as u32,
                    part,
                }
            })
            .collect()
    }

    #[test]
    fn divergence_is_placed_at_the_first_differing_checkpoint() {
        let prev = units(&[(0, 1), (1, 2), (2, 3), (2, 4)]);
        assert_eq!(
            diverge(&prev, &units(&[(0, 1), (1, 2), (2, 3), (2, 4), (2, 5)])),
            None
        );
        // A rewind: shorter, the same as far as it goes.
        assert_eq!(diverge(&prev, &units(&[(0, 1), (1, 2)])), None);
        assert_eq!(
            diverge(&prev, &units(&[(0, 1), (1, 2), (2, 9), (2, 10)])),
            Some(Divergence {
                shared: 200,
                part: Cause::History
            })
        );
        assert_eq!(
            diverge(&prev, &units(&[(0, 7), (1, 8)])),
            Some(Divergence {
                shared: 0,
                part: Cause::Tools
            })
        );
    }

    #[test]
    fn a_long_request_keeps_its_part_ends_among_few_checkpoints() {
        let mut parts = vec![(0u8, 0u64); 3];
        parts.push((1, 0));
        parts.extend(std::iter::repeat_n((2, 0), 500));
        let p = Prefix {
            units: units(&parts)
                .into_iter()
                .enumerate()
                .map(|(i, mut m)| {
                    m.chain = i as u64 + 1;
                    m
                })
                .collect(),
            ..Default::default()
        };
        let marks = p.marks();
        assert!(marks.len() <= MAX_MARKS, "{}", marks.len());
        let idx: Vec<u32> = marks.iter().map(|m| m.idx).collect();
        for end_of_part in [2, 3, 503] {
            assert!(idx.contains(&end_of_part), "{idx:?}");
        }
        assert!(idx.windows(2).all(|w| w[0] < w[1]));
        // Packed and back.
        let seen = Seen {
            marks,
            real: 1,
            extent: 0,
            cut: 0,
            seq: 1,
        };
        let s = serde_json::to_string(&seen).unwrap();
        assert_eq!(serde_json::from_str::<Seen>(&s).unwrap(), seen);
    }

    fn prefix(hashes: &[(u8, u64)], cut: u64) -> Prefix {
        Prefix {
            units: {
                let mut chain = 0u64;
                units(hashes)
                    .into_iter()
                    .map(|mut m| {
                        chain = chain.wrapping_mul(31).wrapping_add(m.chain);
                        m.chain = chain;
                        m
                    })
                    .collect()
            },
            cut,
            compacted: false,
        }
    }

    fn ok(cached: Option<u64>) -> Usage {
        Usage {
            cached_input: cached,
            ..Default::default()
        }
    }

    #[test]
    fn a_bust_is_what_was_cached_less_what_was_read() {
        let rule = PromptCache::Automatic {
            min: 1024,
            granularity: 128,
        };
        let mut c = LaneCache::default();
        let turn = |c: &mut LaneCache, p: &Prefix, seq, real, cached| {
            c.answered(Answered {
                prefix: p,
                seq,
                real: Some(real),
                projection: real,
                usage: &ok(cached),
                rule,
                ratio: None,
            })
        };
        let h: Vec<(u8, u64)> = (0..30).map(|i| (if i < 2 { 1 } else { 2 }, i)).collect();
        assert_eq!(turn(&mut c, &prefix(&h[..20], 0), 1, 2000, Some(0)), None);
        assert_eq!(
            turn(&mut c, &prefix(&h[..25], 0), 2, 2500, Some(1920)),
            None
        );
        // An early edit: message 5 of 30 differs.
        let mut edited = h.clone();
        edited[5].1 = 99;
        let b = turn(&mut c, &prefix(&edited, 0), 3, 3000, Some(384)).unwrap();
        assert_eq!(
            b,
            Bust {
                cause: Cause::History,
                invalidated: 2432 - 384
            }
        );
        // The same change again is no new bust; a trim's cut moving is.
        assert_eq!(turn(&mut c, &prefix(&edited, 0), 4, 3000, Some(2944)), None);
        let b = turn(&mut c, &prefix(&h[..20], 7), 5, 2000, Some(384)).unwrap();
        assert_eq!(b.cause, Cause::Trim);
        // A provider that still read it all had lost nothing.
        let mut tools = h[..20].to_vec();
        tools[0].1 = 42;
        assert_eq!(turn(&mut c, &prefix(&tools, 7), 6, 2000, Some(1920)), None);
        // An answer older than the newest one heard teaches nothing.
        assert_eq!(turn(&mut c, &prefix(&h[..3], 0), 2, 300, Some(0)), None);
        let v = c.render();
        assert_eq!(v["busts"], 2);
        assert_eq!(v["invalidated_tokens"], 2048 + (2944 - 384));
    }

    #[test]
    fn a_moving_marker_is_no_change_a_real_edit_is() {
        let est = Estimator::new(1 << 20);
        let p = crate::provider::Api::Anthropic.provider();
        let body = |marked: bool, text: &str| {
            let mut last =
                serde_json::json!({"role":"user","content":[{"type":"text","text":text}]});
            if marked {
                last["content"][0]["cache_control"] = serde_json::json!({"type":"ephemeral"});
            }
            serde_json::json!({"model":"claude-sonnet-4-5","system":"Be terse.",
                "tools":[{"name":"t","input_schema":{"type":"object"}}],
                "messages":[{"role":"user","content":"first"},{"role":"assistant","content":"ok"},last]})
            .to_string()
        };
        let units = |b: String| {
            let v = RequestView::parse(b.as_bytes()).unwrap();
            Prefix::of(p, &v, &est, Some("claude-sonnet-4-5"), 0).units
        };
        let marked = units(body(true, "next"));
        let plain = units(body(false, "next"));
        assert_eq!(marked, plain);
        let parts: Vec<u8> = plain.iter().map(|m| m.part).collect();
        assert_eq!(parts, [0, 1, 2, 2, 2], "tools, system, three messages");
        let edited = units(body(false, "other"));
        assert_eq!(
            diverge(&plain, &edited).map(|d| d.part),
            Some(Cause::History)
        );
        assert_eq!(edited[..4], plain[..4]);
    }

    #[test]
    fn without_a_report_the_reuse_is_estimated() {
        let rule = PromptCache::Automatic {
            min: 0,
            granularity: 1,
        };
        let mut c = LaneCache::default();
        let h: Vec<(u8, u64)> = (0..10).map(|i| (2, i)).collect();
        let mut turn = |p: &Prefix, seq, real| {
            c.answered(Answered {
                prefix: p,
                seq,
                real: Some(real),
                projection: real,
                usage: &Usage::default(),
                rule,
                ratio: Some(1.0),
            })
        };
        assert_eq!(turn(&prefix(&h[..8], 0), 1, 800), None);
        let mut e = h.clone();
        e[2].1 = 50;
        // 800 cached, 200 of it shared (two units of 100 at ratio 1).
        let b = turn(&prefix(&e, 0), 2, 1000).unwrap();
        assert_eq!(b.invalidated, 600);
    }
}
