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

use std::collections::BTreeSet;
use std::ops::Range;

use crate::json::{elements, skip_ws, Obj};
use crate::provider::Api;

/// Tool outputs at or below this many JSON bytes are not worth eliding: the
/// marker itself costs about fifty.
pub const ELIDE_MIN_BYTES: usize = 1024;

/// Anthropic accepts at most this many `cache_control` breakpoints per request.
pub const MAX_CACHE_BREAKPOINTS: usize = 4;

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
/// `count` is the caller's ruler (the session's anchored projection), `need`
/// the target (`trim-to * window`), `prior` the session's last cut. `None`
/// when the body is not a conversation this module understands (not JSON, a
/// Responses string `input`, no user message) or when nothing can be
/// removed. `Some` may still be over `need`: the caller re-projects and
/// rejects; but a returned body is always shorter than `body`.
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
    let conv = Conv::parse(api, body)?;
    let mut st = State {
        k: conv.head,
        elided: BTreeSet::new(),
    };
    let under = |st: &State| count(&conv.render(st)) <= need;

    if let Some(p) = prior {
        if p.prefix_hash == conv.head_hash
            && (p.dropped_until == conv.head
                || conv.cuts.contains(&p.dropped_until)
                || conv.step_cuts.contains(&p.dropped_until))
        {
            st.k = p.dropped_until;
            st.elided = p
                .elided
                .iter()
                .copied()
                .filter(|&i| i >= st.k && conv.elidable(i))
                .collect();
            if count(&conv.render(&st)) <= keep.max(need) {
                return conv.finish(st);
            }
        }
    }

    if !under(&st) {
        // Step 1: old oversized tool results, oldest first, outside the newest turn.
        let old: Vec<usize> = (st.k..conv.newest_turn)
            .filter(|&i| conv.elidable(i) && !st.elided.contains(&i))
            .collect();
        elide_until(&mut st, &old, &under);
    }
    if !under(&st) {
        // Step 2: drop the oldest complete turns.
        drop_until(&mut st, &conv.cuts, &under);
    }
    if !under(&st) {
        // Step 3: tool results of the newest turn the model has already acted
        // on (everything before its last tool step), oldest first.
        let recent: Vec<usize> = (st.k.max(conv.newest_turn)..conv.last_step)
            .filter(|&i| conv.elidable(i) && !st.elided.contains(&i))
            .collect();
        elide_until(&mut st, &recent, &under);
    }
    if !under(&st) {
        // Step 4: a single long agent loop (the first user message is the
        // only one) has no turns to drop; drop its oldest tool steps instead.
        drop_until(&mut st, &conv.step_cuts, &under);
    }

    conv.finish(st)
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
    turn_start: bool,
    /// A user message (tool results included): needs a gap marker before it
    /// where roles must alternate.
    user: bool,
    /// Produced by the model (assistant / model message, Responses output
    /// item): a tool step may start here.
    assistant: bool,
    /// A Responses reasoning item, which must stay with the item after it.
    reasoning: bool,
    /// Tool call ids this element issues.
    calls: Vec<String>,
    /// Tool call ids whose results this element carries (`None`: no id, as in
    /// Ollama or Gemini without ids; bound to the nearest preceding call).
    results: Vec<Option<String>>,
    /// Splices that elide this element's oversized tool outputs.
    elide: Vec<(Range<usize>, Vec<u8>)>,
    /// Anthropic `cache_control` breakpoints in the element, and how many of
    /// them sit inside the outputs that elision removes.
    breakpoints: usize,
    elided_breakpoints: usize,
}

struct Conv<'a> {
    api: Api,
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
    /// `cache_control` breakpoints outside the conversation array.
    fixed_breakpoints: usize,
}

impl<'a> Conv<'a> {
    fn parse(api: Api, body: &'a [u8]) -> Option<Conv<'a>> {
        // serde's `from_slice` skips strings without checking their UTF-8,
        // so a body with a stray byte inside a string would pass and be
        // trimmed; it must be refused and forwarded untouched.
        let text = simdutf8::basic::from_utf8(body).ok()?;
        serde_json::from_str::<serde::de::IgnoredAny>(text).ok()?;
        let top = Obj::parse(body, 0..body.len())?;
        let key = match api {
            Api::OpenAiChat | Api::Ollama | Api::Anthropic => "messages",
            Api::OpenAiResponses => "input",
            Api::Gemini => "contents",
        };
        let arr = top.get(key)?;
        let ranges = elements(body, arr)?;
        let mut elems = Vec::with_capacity(ranges.len());
        for r in ranges {
            elems.push(Elem::parse(api, body, r)?);
        }
        let n = elems.len();
        let first_user = elems.iter().position(|e| e.turn_start)?;
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
            .filter(|&k| elems[k].turn_start && whole(k))
            .collect();
        // Steps are only dropped from the first user's turn: a later user
        // message is never dropped while the work it asked for is kept.
        let first_turn_end = cuts_end(&elems, head);
        let step_cuts = (head + 1..first_turn_end.min(n))
            .filter(|&k| elems[k].assistant && !elems[k - 1].reasoning && whole(k))
            .collect();
        let newest_turn = (0..n)
            .rev()
            .find(|&i| elems[i].turn_start)
            .unwrap_or(0)
            .max(head);
        let last_step = (newest_turn..n)
            .rev()
            .find(|&i| !elems[i].calls.is_empty())
            .unwrap_or(n.saturating_sub(1));
        let fixed_breakpoints = if api == Api::Anthropic {
            ["system", "tools"]
                .iter()
                .filter_map(|k| top.get(k))
                .map(|r| breakpoints(&body[r]))
                .sum()
        } else {
            0
        };
        Some(Conv {
            api,
            body,
            elems,
            head,
            head_hash: h.0,
            cuts,
            step_cuts,
            newest_turn,
            last_step,
            fixed_breakpoints,
        })
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
        let partial = st.k > self.head && !self.elems[self.head].turn_start;
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
        self.elems[r].iter().filter(|e| e.turn_start).count()
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
        // Anthropic: breakpoints beyond four go, oldest kept blocks first.
        let mut extra = (self.fixed_breakpoints + kept.clone().map(bp).sum::<usize>())
            .saturating_sub(MAX_CACHE_BREAKPOINTS);
        let mut out = Vec::with_capacity(b.len());
        out.extend_from_slice(&b[..self.elems[0].range.start]);
        let mut prev: Option<usize> = None;
        for i in kept {
            match prev {
                Some(p) if p + 1 == i => {
                    out.extend_from_slice(&b[self.elems[p].range.end..self.elems[i].range.start])
                }
                Some(p) => {
                    out.push(b',');
                    if let Some(m) = self.gap_marker(i - p - 1).filter(|_| self.elems[i].user) {
                        out.extend_from_slice(&m);
                        out.push(b',');
                    }
                }
                None => {}
            }
            prev = Some(i);
            let have = bp(i);
            if extra > 0 && have > 0 {
                let mut own = Vec::new();
                self.write_elem(&mut own, i, st);
                if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(&own) {
                    let removed = strip_breakpoints(&mut v, extra.min(have));
                    if let Ok(s) = serde_json::to_vec(&v) {
                        out.extend_from_slice(&s);
                        extra -= removed;
                        continue;
                    }
                }
            }
            self.write_elem(&mut out, i, st);
        }
        out.extend_from_slice(&b[self.elems[n - 1].range.end..]);
        out
    }

    /// The synthetic message that keeps role alternation across a gap of
    /// `dropped` elements before a user message, for the APIs that need it.
    fn gap_marker(&self, dropped: usize) -> Option<Vec<u8>> {
        let text = format!("[tidemark: {dropped} earlier messages omitted]");
        let v = match self.api {
            Api::Anthropic => serde_json::json!({"role": "assistant", "content": text}),
            Api::Gemini => serde_json::json!({"role": "model", "parts": [{"text": text}]}),
            _ => return None,
        };
        serde_json::to_vec(&v).ok()
    }
}

/// The marker that replaces an elided tool output, as a JSON string.
fn marker(bytes: usize) -> Vec<u8> {
    format!("\"[tidemark: elided {bytes} bytes of tool output]\"").into_bytes()
}

impl Elem {
    fn parse(api: Api, b: &[u8], range: Range<usize>) -> Option<Elem> {
        let o = Obj::parse(b, range.clone())?;
        let role = o.str("role");
        let mut e = Elem {
            range,
            turn_start: false,
            user: role.as_deref() == Some("user"),
            assistant: role.as_deref() == Some("assistant"),
            reasoning: false,
            calls: Vec::new(),
            results: Vec::new(),
            elide: Vec::new(),
            breakpoints: 0,
            elided_breakpoints: 0,
        };
        let oversized = |r: &Range<usize>| r.len() > ELIDE_MIN_BYTES;
        match api {
            Api::OpenAiChat | Api::Ollama => {
                e.turn_start = role.as_deref() == Some("user");
                if let Some(tc) = o.get("tool_calls") {
                    for r in elements(b, tc).unwrap_or_default() {
                        let id = Obj::parse(b, r).and_then(|c| c.str("id"));
                        e.calls.push(id.unwrap_or_default());
                    }
                }
                if role.as_deref() == Some("tool") {
                    e.results.push(o.str("tool_call_id"));
                    if let Some(c) = o.get("content").filter(oversized) {
                        e.elide.push((c.clone(), marker(c.len())));
                    }
                }
            }
            Api::Anthropic => {
                let blocks = o
                    .get("content")
                    .filter(|r| b.get(r.start) == Some(&b'['))
                    .and_then(|r| elements(b, r))
                    .unwrap_or_default();
                for r in blocks {
                    let Some(blk) = Obj::parse(b, r) else {
                        continue;
                    };
                    match blk.str("type").as_deref() {
                        Some("tool_use") => e.calls.push(blk.str("id").unwrap_or_default()),
                        Some("tool_result") => {
                            e.results.push(blk.str("tool_use_id"));
                            if let Some(c) = blk.get("content").filter(oversized) {
                                e.elide.push((c.clone(), marker(c.len())));
                            }
                        }
                        _ => {}
                    }
                }
                e.turn_start = role.as_deref() == Some("user") && e.results.is_empty();
                e.breakpoints = breakpoints(&b[e.range.clone()]);
                e.elided_breakpoints = e
                    .elide
                    .iter()
                    .map(|(r, _)| breakpoints(&b[r.clone()]))
                    .sum();
            }
            Api::OpenAiResponses => {
                let ty = o.str("type");
                let is_msg = ty.as_deref().map_or(true, |t| t == "message");
                e.turn_start = is_msg && role.as_deref() == Some("user");
                e.reasoning = ty.as_deref() == Some("reasoning");
                e.assistant = match ty.as_deref() {
                    None | Some("message") => role.as_deref() == Some("assistant"),
                    Some(t) => {
                        t == "reasoning" || (t.ends_with("_call") && !t.ends_with("_output"))
                    }
                };
                if let (Some(id), Some(t)) = (o.str("call_id"), ty.as_deref()) {
                    if t.ends_with("_output") {
                        e.results.push(Some(id));
                        if t == "function_call_output" || t == "custom_tool_call_output" {
                            if let Some(c) = o.get("output").filter(oversized) {
                                e.elide.push((c.clone(), marker(c.len())));
                            }
                        }
                    } else {
                        e.calls.push(id);
                    }
                }
            }
            Api::Gemini => {
                let parts = o
                    .get("parts")
                    .and_then(|r| elements(b, r))
                    .unwrap_or_default();
                for r in parts {
                    let Some(p) = Obj::parse(b, r) else { continue };
                    if let Some(fc) = p.get("functionCall") {
                        let id = Obj::parse(b, fc).and_then(|f| f.str("id"));
                        e.calls.push(id.unwrap_or_default());
                    }
                    if let Some(fr) = p.get("functionResponse") {
                        let f = Obj::parse(b, fr);
                        e.results.push(f.as_ref().and_then(|f| f.str("id")));
                        if let Some(c) = f.and_then(|f| f.get("response")).filter(oversized) {
                            let text =
                                format!("[tidemark: elided {} bytes of tool output]", c.len());
                            let rep = serde_json::to_vec(&serde_json::json!({ "content": text }))
                                .unwrap_or_default();
                            e.elide.push((c, rep));
                        }
                    }
                }
                // Gemini's role is optional and defaults to user.
                e.user = role.as_deref().map_or(true, |r| r == "user");
                e.assistant = role.as_deref() == Some("model");
                e.turn_start =
                    role.as_deref().map_or(true, |r| r == "user") && e.results.is_empty();
            }
        }
        Some(e)
    }
}

/// Index of the first turn start at or after `from` (`elems.len()` if none).
fn cuts_end(elems: &[Elem], from: usize) -> usize {
    (from..elems.len())
        .find(|&i| elems[i].turn_start)
        .unwrap_or(elems.len())
}

/// (call element, result element) pairs: by id where the id is found among
/// earlier calls, else bound to the nearest earlier element issuing calls.
fn pairs(elems: &[Elem]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (b, e) in elems.iter().enumerate() {
        for id in &e.results {
            let by_id = id.as_ref().and_then(|id| {
                (0..b)
                    .rev()
                    .find(|&a| elems[a].calls.iter().any(|c| c == id))
            });
            let a = by_id.or_else(|| (0..b).rev().find(|&a| !elems[a].calls.is_empty()));
            if let Some(a) = a {
                out.push((a, b));
            }
        }
    }
    out
}

/// `cache_control` members with a non-null value in a JSON text. The byte
/// sequence `"cache_control"` followed by `:` can only be a key: inside a
/// string every quote is escaped.
fn breakpoints(json: &[u8]) -> usize {
    const PAT: &[u8] = b"\"cache_control\"";
    memchr::memmem::find_iter(json, PAT)
        .filter(|&at| {
            let i = skip_ws(json, at + PAT.len());
            json.get(i) == Some(&b':') && !json[skip_ws(json, i + 1)..].starts_with(b"null")
        })
        .count()
}

/// Remove up to `n` `cache_control` members, depth first in document order;
/// returns how many were removed.
fn strip_breakpoints(v: &mut serde_json::Value, n: usize) -> usize {
    use serde_json::Value;
    let mut removed = 0;
    match v {
        Value::Object(m) => {
            if n > 0 && m.get("cache_control").is_some_and(|c| !c.is_null()) {
                m.remove("cache_control");
                removed += 1;
            }
            for (_, c) in m.iter_mut() {
                if removed == n {
                    break;
                }
                removed += strip_breakpoints(c, n - removed);
            }
        }
        Value::Array(a) => {
            for c in a.iter_mut() {
                if removed == n {
                    break;
                }
                removed += strip_breakpoints(c, n - removed);
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
        assert_eq!(breakpoints(j), 1);
    }
}
