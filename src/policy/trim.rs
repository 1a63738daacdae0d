//! Turn-aware trimming of an over-budget request (SPEC §5 `trim`): elide old
//! oversized tool results, then drop the oldest complete turns after the head,
//! splicing the client's own JSON text so that every kept byte is unchanged.
//!
//! # Shape of a cut
//!
//! The conversation array (`messages`, Responses `input`, Gemini `contents`)
//! is split into the *head* (everything up to and including the first user
//! message: chat system prompts live there), then elements
//! `[head_len, dropped_until)` that are dropped, then the kept tail, which
//! always ends with the newest element. A *turn* starts at a user message that
//! is not a tool result. The steps, each taken only while still over:
//!
//! 1. elide oversized tool outputs before the newest turn, oldest first;
//! 2. drop the oldest turns (the cut lands on a turn start);
//! 3. elide outputs of the newest turn that the model has already acted on
//!    (all but its last tool step);
//! 4. for one long agent loop under the first user message (no later user
//!    message), drop its oldest tool steps (the cut lands on an assistant
//!    message).
//!
//! A cut that would separate a tool call from its result is never taken.
//! Anthropic requires strict user/assistant alternation starting with a user
//! message. When the kept tail starts with a user message, tidemark inserts one
//! synthetic assistant message after the head
//! (`[tidemark: N earlier messages omitted]`): the head's bytes stay
//! untouched, the gap is visible to the model, and alternation holds. Gemini
//! gets the same marker as a `model` content.
//!
//! # Stickiness
//!
//! A [`Cut`] from the session's previous trim is applied first when the head
//! bytes hash the same and the cut is still a legal cut in the new body; the
//! trimmer cuts further only if that is not enough. A growing conversation
//! thus keeps its forwarded prefix byte-identical and provider prompt caches
//! survive.

use std::cell::OnceCell;
use std::collections::BTreeSet;
use std::ops::Range;

use crate::estimate::{Estimate, Estimator, Part, Parts};
use crate::json::{skip_ws, RequestView};
use crate::provider::{Api, Element, Provider};

/// Tool outputs at or below this many JSON bytes are not worth eliding: the
/// marker itself costs about fifty.
pub const ELIDE_MIN_BYTES: usize = 1024;

/// Where a session's conversation was cut, remembered so the next request is
/// cut at the same place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    /// Index into the conversation array: elements `[head_len, dropped_until)`
    /// are dropped (`dropped_until == head_len`: nothing dropped).
    pub dropped_until: usize,
    /// Element indices whose tool results were elided, ascending; all kept.
    pub elided: Vec<usize>,
    /// Hash of the head elements' original bytes, so that a cut is only ever
    /// re-applied to the conversation it was made for.
    pub prefix_hash: u64,
}

/// A trimmed request body and what was done to it.
#[derive(Debug, Clone)]
pub struct Trimmed {
    pub body: Vec<u8>,
    pub cut: Cut,
    /// Turns dropped (the `turns` of `x-context-trimmed`): the user turns
    /// dropped, plus one for the tail of the first user's turn when it goes.
    pub turns: u32,
    /// Tool results elided among the kept elements (`tool-results`).
    pub tool_results: u32,
}

/// Trim `body` (a request of `api`) until `count(body) <= need`.
///
/// `count` is any ruler of whole bodies, `need` the target, `prior` the
/// session's last cut. `None` when the body is not a conversation this
/// module understands (not JSON, a Responses string `input`, no user
/// message) or when nothing can be removed. `Some` may still be over
/// `need`: the caller re-projects and rejects; but a returned body is
/// always shorter than `body`. Each cut weighed is rendered and handed to
/// `count`; the proxy weighs cuts by their parts instead
/// ([`trim_estimated`]).
pub fn trim(
    api: Api,
    body: &[u8],
    count: &dyn Fn(&[u8]) -> u64,
    need: u64,
    prior: Option<&Cut>,
) -> Option<Trimmed> {
    trim_sticky(api, body, count, need, need, prior)
}

/// [`trim`] with hysteresis: when `prior` alone brings the body to `keep` or
/// below (`keep >= need`, typically `limit-at * window`), nothing more is cut,
/// so a growing conversation keeps the same cut — and its forwarded prefix —
/// until it overflows the limit again; only then is it cut further, down to
/// `need`. With `keep == need` every trimmed request lands just under `need`
/// and the next one cuts a little further.
pub fn trim_sticky(
    api: Api,
    body: &[u8],
    count: &dyn Fn(&[u8]) -> u64,
    need: u64,
    keep: u64,
    prior: Option<&Cut>,
) -> Option<Trimmed> {
    let view = RequestView::parse(body)?;
    let conv = Conv::new(api.provider(), &view)?;
    let st = conv.search(&|st| count(&conv.render(st)), need, keep, prior);
    conv.finish(st)
}

/// [`trim_sticky`] with the estimator as the ruler, on the request's
/// scanned view: each cut weighed is the sum of its elements' cached
/// counts (`Estimator::parts`), not a body rendered and estimated again;
/// the body is rendered once, at the end. `measure` turns an estimate into
/// the caller's tokens (the session's anchored projection). Returns the
/// trim and its estimate, which is what estimating the trimmed body gives.
#[allow(clippy::too_many_arguments)]
pub fn trim_estimated(
    est: &Estimator,
    api: Api,
    view: &RequestView<'_>,
    model: Option<&str>,
    measure: &dyn Fn(&Estimate) -> u64,
    need: u64,
    keep: u64,
    prior: Option<&Cut>,
) -> Option<(Trimmed, Estimate)> {
    let p = api.provider();
    let conv = Conv::new(p, view)?;
    // The model as `Estimator::estimate_body` finds it.
    let named = view.str("model");
    let parts = est.parts(p, view, model.or(named.as_deref()))?;
    let counts = Counts {
        elided: (0..conv.elems.len()).map(|_| OnceCell::new()).collect(),
        parts,
    };
    let st = conv.search(
        &|st| measure(&conv.estimate(st, &counts)),
        need,
        keep,
        prior,
    );
    let e = conv.estimate(&st, &counts);
    Some((conv.finish(st)?, e))
}

/// Move the cut to the first of `cuts` beyond the current one that gets
/// under; the last one if none does.
fn drop_until(st: &mut State, cuts: &[usize], under: &dyn Fn(&State) -> bool) {
    let ks: Vec<usize> = cuts.iter().copied().filter(|&c| c > st.k).collect();
    if ks.is_empty() {
        return;
    }
    let at = |j: usize| State {
        k: ks[j],
        elided: st.elided.range(ks[j]..).copied().collect(),
    };
    let j = first_true(ks.len(), |j| under(&at(j))).unwrap_or(ks.len() - 1);
    *st = at(j);
}

/// Elide the shortest oldest-first prefix of `cands` that gets under; all of
/// them if none does.
fn elide_until(st: &mut State, cands: &[usize], under: &dyn Fn(&State) -> bool) {
    if cands.is_empty() {
        return;
    }
    let with = |j: usize| {
        let mut s = st.clone();
        s.elided.extend(cands[..=j].iter().copied());
        s
    };
    let j = first_true(cands.len(), |j| under(&with(j))).unwrap_or(cands.len() - 1);
    *st = with(j);
}

/// Smallest `j < n` with `f(j)`, assuming `f` is monotone; `None` if none.
fn first_true(n: usize, f: impl Fn(usize) -> bool) -> Option<usize> {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if f(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    (lo < n).then_some(lo)
}

#[derive(Clone)]
struct State {
    /// `dropped_until`.
    k: usize,
    elided: BTreeSet<usize>,
}

/// One element of the conversation array.
struct Elem {
    range: Range<usize>,
    /// What it is to a conversation, as its provider reads it.
    e: Element,
    /// Splices that elide this element's oversized tool outputs.
    elide: Vec<(Range<usize>, Vec<u8>)>,
    /// Prompt-cache breakpoints in the element (`Provider::cache_breakpoints`),
    /// and how many of them sit inside the outputs that elision removes.
    breakpoints: usize,
    elided_breakpoints: usize,
}

/// A piece of a trimmed body, in order: bytes of the original between
/// elements, a kept element as the state has it, or text the original did
/// not hold (a gap marker, an element without some breakpoints).
enum Piece<'b> {
    Glue(&'b [u8]),
    Elem(usize),
    New(Vec<u8>),
}

/// The estimator's counts of a conversation's elements, for weighing cuts.
struct Counts<'e> {
    parts: Parts<'e>,
    /// Element `i` with its outputs elided, counted when first weighed.
    elided: Vec<OnceCell<Part>>,
}

struct Conv<'a> {
    p: &'static dyn Provider,
    body: &'a [u8],
    elems: Vec<Elem>,
    /// `head_len`: elements `[0, head)` are always kept.
    head: usize,
    head_hash: u64,
    /// Legal values of `dropped_until` beyond `head` at a turn start, ascending.
    cuts: Vec<usize>,
    /// Legal values of `dropped_until` at the start of a tool step, ascending.
    step_cuts: Vec<usize>,
    /// Index of the newest turn's start (elements from here are not elided in step 1).
    newest_turn: usize,
    /// Index of the newest turn's last tool step (never elided).
    last_step: usize,
    /// Prompt-cache breakpoints outside the conversation array, and the
    /// member and most of them (`Provider::cache_breakpoints`).
    fixed_breakpoints: usize,
    breakpoint: Option<(&'static str, usize)>,
}

impl<'a> Conv<'a> {
    /// The conversation of a scanned request: its history's elements as
    /// the view found them, read by the provider.
    fn new(p: &'static dyn Provider, view: &RequestView<'a>) -> Option<Conv<'a>> {
        let body = view.body;
        let history = crate::provider::history(p)?;
        let raws = view.elements(history.name)?;
        let breakpoint = p.cache_breakpoints();
        let count_bp = |json: &[u8]| breakpoint.map_or(0, |(m, _)| breakpoints(m, json));
        let mut elems = Vec::with_capacity(raws.len());
        for raw in raws {
            let range = view.span(*raw);
            let e = p.element(body, range.clone())?;
            let elide: Vec<(Range<usize>, Vec<u8>)> = e
                .outputs
                .iter()
                .filter(|r| r.len() > ELIDE_MIN_BYTES)
                .map(|r| (r.clone(), p.elided(r.len())))
                .collect();
            elems.push(Elem {
                breakpoints: count_bp(&body[range.clone()]),
                elided_breakpoints: elide.iter().map(|(r, _)| count_bp(&body[r.clone()])).sum(),
                range,
                e,
                elide,
            });
        }
        let n = elems.len();
        let first_user = elems.iter().position(|e| e.e.turn_start)?;
        let head = first_user + 1;
        let mut h = Fnv::new();
        for e in &elems[..head] {
            h.write(&body[e.range.clone()]);
            h.write(b"\x1e");
        }
        let pairs = pairs(&elems);
        let whole = |k: usize| {
            pairs
                .iter()
                .all(|&(a, b)| (head..k).contains(&a) == (head..k).contains(&b))
        };
        let cuts = (head + 1..n)
            .filter(|&k| elems[k].e.turn_start && whole(k))
            .collect();
        // Steps are only dropped from the first user's turn: a later user
        // message is never dropped while the work it asked for is kept.
        let first_turn_end = cuts_end(&elems, head);
        let step_cuts = (head + 1..first_turn_end.min(n))
            .filter(|&k| elems[k].e.assistant && !elems[k - 1].e.reasoning && whole(k))
            .collect();
        let newest_turn = (0..n)
            .rev()
            .find(|&i| elems[i].e.turn_start)
            .unwrap_or(0)
            .max(head);
        let last_step = (newest_turn..n)
            .rev()
            .find(|&i| !elems[i].e.calls.is_empty())
            .unwrap_or(n.saturating_sub(1));
        // The other counted fields (system prompt, tools) hold the rest.
        let fixed_breakpoints = p
            .counted_fields()
            .iter()
            .filter(|f| f.name != history.name)
            .filter_map(|f| view.raw(f.name))
            .map(|r| count_bp(r.get().as_bytes()))
            .sum();
        Some(Conv {
            p,
            body,
            elems,
            head,
            head_hash: h.0,
            cuts,
            step_cuts,
            newest_turn,
            last_step,
            fixed_breakpoints,
            breakpoint,
        })
    }

    /// The cut for `need` (and `keep`, see [`trim_sticky`]): `prior` first,
    /// then each step while `size` is still over.
    fn search(
        &self,
        size: &dyn Fn(&State) -> u64,
        need: u64,
        keep: u64,
        prior: Option<&Cut>,
    ) -> State {
        let mut st = State {
            k: self.head,
            elided: BTreeSet::new(),
        };
        let under = |st: &State| size(st) <= need;

        if let Some(p) = prior {
            if p.prefix_hash == self.head_hash
                && (p.dropped_until == self.head
                    || self.cuts.contains(&p.dropped_until)
                    || self.step_cuts.contains(&p.dropped_until))
            {
                st.k = p.dropped_until;
                st.elided = p
                    .elided
                    .iter()
                    .copied()
                    .filter(|&i| i >= st.k && self.elidable(i))
                    .collect();
                if size(&st) <= keep.max(need) {
                    return st;
                }
            }
        }

        if !under(&st) {
            // Step 1: old oversized tool results, oldest first, outside the newest turn.
            let old: Vec<usize> = (st.k..self.newest_turn)
                .filter(|&i| self.elidable(i) && !st.elided.contains(&i))
                .collect();
            elide_until(&mut st, &old, &under);
        }
        if !under(&st) {
            // Step 2: drop the oldest complete turns.
            drop_until(&mut st, &self.cuts, &under);
        }
        if !under(&st) {
            // Step 3: tool results of the newest turn the model has already acted
            // on (everything before its last tool step), oldest first.
            let recent: Vec<usize> = (st.k.max(self.newest_turn)..self.last_step)
                .filter(|&i| self.elidable(i) && !st.elided.contains(&i))
                .collect();
            elide_until(&mut st, &recent, &under);
        }
        if !under(&st) {
            // Step 4: a single long agent loop (the first user message is the
            // only one) has no turns to drop; drop its oldest tool steps instead.
            drop_until(&mut st, &self.step_cuts, &under);
        }
        st
    }

    /// May element `i` have its tool outputs elided? Never the head, never the
    /// newest element.
    fn elidable(&self, i: usize) -> bool {
        i >= self.head && i + 1 < self.elems.len() && !self.elems[i].elide.is_empty()
    }

    /// The result for state `st`, or `None` if it removes nothing.
    fn finish(&self, st: State) -> Option<Trimmed> {
        if st.k == self.head && st.elided.is_empty() {
            return None;
        }
        let out = self.render(&st);
        if out.len() >= self.body.len() {
            return None;
        }
        // The rest of the first user's turn counts as one when it goes.
        let partial = st.k > self.head && !self.elems[self.head].e.turn_start;
        let turns = (self.turn_starts_in(self.head..st.k) + usize::from(partial)) as u32;
        let tool_results = st
            .elided
            .iter()
            .map(|&i| self.elems[i].elide.len())
            .sum::<usize>() as u32;
        Some(Trimmed {
            body: out,
            cut: Cut {
                dropped_until: st.k,
                elided: st.elided.into_iter().collect(),
                prefix_hash: self.head_hash,
            },
            turns,
            tool_results,
        })
    }

    fn turn_starts_in(&self, r: Range<usize>) -> usize {
        self.elems[r].iter().filter(|e| e.e.turn_start).count()
    }

    /// Append element `i` as `st` has it: its own bytes, outputs elided.
    fn write_elem(&self, out: &mut Vec<u8>, i: usize, st: &State) {
        let e = &self.elems[i];
        if !st.elided.contains(&i) {
            out.extend_from_slice(&self.body[e.range.clone()]);
            return;
        }
        let mut at = e.range.start;
        for (r, rep) in &e.elide {
            out.extend_from_slice(&self.body[at..r.start]);
            out.extend_from_slice(rep);
            at = r.end;
        }
        out.extend_from_slice(&self.body[at..e.range.end]);
    }

    /// The request with state `st` applied, spliced from the original text.
    fn render(&self, st: &State) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.body.len());
        self.layout(st, &mut |piece| match piece {
            Piece::Glue(b) => out.extend_from_slice(b),
            Piece::Elem(i) => self.write_elem(&mut out, i, st),
            Piece::New(b) => out.extend_from_slice(&b),
        });
        out
    }

    /// The estimate of the request with state `st` applied, from the
    /// elements' counts: what estimating [`Conv::render`]'s body gives.
    fn estimate(&self, st: &State, counts: &Counts<'_>) -> Estimate {
        let mut kept = Vec::with_capacity(self.elems.len() + 1);
        self.layout(st, &mut |piece| match piece {
            Piece::Glue(_) => {}
            Piece::Elem(i) if st.elided.contains(&i) => {
                kept.push(*counts.elided[i].get_or_init(|| {
                    let mut own = Vec::new();
                    self.write_elem(&mut own, i, st);
                    counts.parts.count(&String::from_utf8_lossy(&own))
                }))
            }
            Piece::Elem(i) => kept.push(counts.parts.element(i)),
            Piece::New(b) => kept.push(counts.parts.count(&String::from_utf8_lossy(&b))),
        });
        counts.parts.total(kept)
    }

    /// The pieces of the request with state `st` applied, in order.
    fn layout(&self, st: &State, emit: &mut dyn FnMut(Piece<'a>)) {
        let b = self.body;
        let n = self.elems.len();
        let kept = (0..self.head).chain(st.k.max(self.head)..n);
        let bp = |i: usize| {
            let e = &self.elems[i];
            e.breakpoints
                - if st.elided.contains(&i) {
                    e.elided_breakpoints
                } else {
                    0
                }
        };
        // Breakpoints beyond what the API accepts go, oldest kept blocks first.
        let mut extra = self.breakpoint.map_or(0, |(_, most)| {
            (self.fixed_breakpoints + kept.clone().map(bp).sum::<usize>()).saturating_sub(most)
        });
        emit(Piece::Glue(&b[..self.elems[0].range.start]));
        let mut prev: Option<usize> = None;
        for i in kept {
            match prev {
                Some(p) if p + 1 == i => emit(Piece::Glue(
                    &b[self.elems[p].range.end..self.elems[i].range.start],
                )),
                Some(p) => {
                    emit(Piece::Glue(b","));
                    if let Some(m) = self
                        .p
                        .gap_marker(i - p - 1)
                        .filter(|_| self.elems[i].e.user)
                    {
                        emit(Piece::New(m));
                        emit(Piece::Glue(b","));
                    }
                }
                None => {}
            }
            prev = Some(i);
            let have = bp(i);
            if let Some((member, _)) = self.breakpoint.filter(|_| extra > 0 && have > 0) {
                let mut own = Vec::new();
                self.write_elem(&mut own, i, st);
                if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(&own) {
                    let removed = strip_breakpoints(&mut v, member, extra.min(have));
                    if let Ok(s) = serde_json::to_vec(&v) {
                        emit(Piece::New(s));
                        extra -= removed;
                        continue;
                    }
                }
            }
            emit(Piece::Elem(i));
        }
        emit(Piece::Glue(&b[self.elems[n - 1].range.end..]));
    }
}

/// Index of the first turn start at or after `from` (`elems.len()` if none).
fn cuts_end(elems: &[Elem], from: usize) -> usize {
    (from..elems.len())
        .find(|&i| elems[i].e.turn_start)
        .unwrap_or(elems.len())
}

/// (call element, result element) pairs: by id where the id is found among
/// earlier calls, else bound to the nearest earlier element issuing calls.
fn pairs(elems: &[Elem]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (b, e) in elems.iter().enumerate() {
        for id in &e.e.results {
            let by_id = id.as_ref().and_then(|id| {
                (0..b)
                    .rev()
                    .find(|&a| elems[a].e.calls.iter().any(|c| c == id))
            });
            let a = by_id.or_else(|| (0..b).rev().find(|&a| !elems[a].e.calls.is_empty()));
            if let Some(a) = a {
                out.push((a, b));
            }
        }
    }
    out
}

/// Members named `member` with a non-null value in a JSON text. The byte
/// sequence `"member"` followed by `:` can only be a key: inside a string
/// every quote is escaped.
fn breakpoints(member: &str, json: &[u8]) -> usize {
    let pat = format!("\"{member}\"");
    let pat = pat.as_bytes();
    memchr::memmem::find_iter(json, pat)
        .filter(|&at| {
            let i = skip_ws(json, at + pat.len());
            json.get(i) == Some(&b':') && !json[skip_ws(json, i + 1)..].starts_with(b"null")
        })
        .count()
}

/// Remove up to `n` `member` members, depth first in document order;
/// returns how many were removed.
fn strip_breakpoints(v: &mut serde_json::Value, member: &str, n: usize) -> usize {
    use serde_json::Value;
    let mut removed = 0;
    match v {
        Value::Object(m) => {
            if n > 0 && m.get(member).is_some_and(|c| !c.is_null()) {
                m.remove(member);
                removed += 1;
            }
            for (_, c) in m.iter_mut() {
                if removed == n {
                    break;
                }
                removed += strip_breakpoints(c, member, n - removed);
            }
        }
        Value::Array(a) => {
            for c in a.iter_mut() {
                if removed == n {
                    break;
                }
                removed += strip_breakpoints(c, member, n - removed);
            }
        }
        _ => {}
    }
    removed
}

/// 64-bit FNV-1a: a stable, dependency-free hash for [`Cut::prefix_hash`].
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &x in bytes {
            self.0 ^= u64::from(x);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breakpoints_ignore_strings_and_nulls() {
        let j = br#"[{"cache_control":{"type":"ephemeral"}},{"cache_control" : null},{"t":"\"cache_control\": x"}]"#;
        assert_eq!(breakpoints("cache_control", j), 1);
    }
}
