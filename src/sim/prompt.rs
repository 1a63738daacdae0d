//! A request as the sim's provider renders it: an ordered list of segments
//! (tools, system, then each message), each with its token count and a hash
//! of its canonical content. The count is their sum; the prefix cache
//! compares the hash chains.

use std::hash::{Hash, Hasher};

use serde_json::Value;

use super::tokens::{Counting, SimEncoding};

/// One unit of a rendered prompt: the prefix cache's granularity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seg {
    /// Hash of the canonical content (markers such as `cache_control` left out).
    pub hash: u64,
    pub tokens: u64,
    /// The client marked the end of this segment as a cache breakpoint
    /// (Anthropic `cache_control`).
    pub breakpoint: bool,
    /// Part of the tools-and-system prefix rather than the conversation.
    pub head: bool,
}

/// A counted request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Prompt {
    pub segs: Vec<Seg>,
}

impl Prompt {
    pub fn total(&self) -> u64 {
        self.segs.iter().map(|s| s.tokens).sum()
    }
    pub fn head(&self) -> u64 {
        self.segs.iter().filter(|s| s.head).map(|s| s.tokens).sum()
    }
}

/// Builds a [`Prompt`] in one [`Counting`]: raw tokens in, the ratio applied
/// to the head and to the rest as two running sums rounded up, so a group's
/// total is exactly `ceil(raw * ratio)` however it is split.
pub(crate) struct Builder {
    pub enc: SimEncoding,
    ratio: f64,
    raw: [u64; 2],
    scaled: [u64; 2],
    segs: Vec<Seg>,
}

impl Builder {
    pub fn new(c: Counting) -> Self {
        Builder {
            enc: c.encoding,
            ratio: c.ratio,
            raw: [0; 2],
            scaled: [0; 2],
            segs: Vec::new(),
        }
    }

    pub fn tok(&self, s: &str) -> u64 {
        super::tokens::tok(self.enc, s)
    }

    pub fn tok_json(&self, v: &Value) -> u64 {
        super::tokens::tok_json(self.enc, v)
    }

    /// Add a segment of `raw` tokens whose canonical content is `content`.
    pub fn push(&mut self, head: bool, raw: u64, content: &Value, breakpoint: bool) {
        self.push_hashed(head, raw, canonical_hash(content), breakpoint);
    }

    pub fn push_hashed(&mut self, head: bool, raw: u64, hash: u64, breakpoint: bool) {
        let g = usize::from(!head);
        self.raw[g] += raw;
        let scaled = if self.ratio == 1.0 {
            self.raw[g]
        } else {
            (self.raw[g] as f64 * self.ratio).ceil() as u64
        };
        let tokens = scaled - self.scaled[g];
        self.scaled[g] = scaled;
        self.segs.push(Seg {
            hash,
            tokens,
            breakpoint,
            head,
        });
    }

    /// The first segment: the request's own framing plus, when the request
    /// has a non-empty `tools` array, what `cost` charges for it.
    pub fn push_head(
        &mut self,
        body: &Value,
        per_request: u64,
        cost: impl Fn(&Self, &[Value]) -> u64,
    ) {
        let tools = body
            .get("tools")
            .and_then(Value::as_array)
            .filter(|t| !t.is_empty());
        let raw = per_request + tools.map_or(0, |t| cost(self, t));
        let v = tools.map_or(&Value::Null, |_| &body["tools"]);
        self.push(true, raw, v, has_breakpoint(v));
    }

    pub fn finish(self) -> Prompt {
        Prompt { segs: self.segs }
    }
}

/// Hash of a JSON value with every `cache_control` member left out, so a
/// breakpoint that moves from turn to turn never changes the content.
pub(crate) fn canonical_hash(v: &Value) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    hash_value(v, &mut h);
    h.finish()
}

fn hash_value(v: &Value, h: &mut impl Hasher) {
    match v {
        Value::Null => 0u8.hash(h),
        Value::Bool(b) => (1u8, b).hash(h),
        Value::Number(n) => (2u8, n.to_string()).hash(h),
        Value::String(s) => (3u8, s).hash(h),
        Value::Array(a) => {
            (4u8, a.len()).hash(h);
            for x in a {
                hash_value(x, h);
            }
        }
        Value::Object(o) => {
            5u8.hash(h);
            for (k, x) in o {
                if k == "cache_control" {
                    continue;
                }
                k.hash(h);
                hash_value(x, h);
            }
        }
    }
}

/// The elements of `body[key]` when it is an array.
pub(crate) fn elements<'a>(body: &'a Value, key: &str) -> impl Iterator<Item = &'a Value> {
    body.get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
}

/// Does a JSON value carry `cache_control` anywhere among its blocks?
pub(crate) fn has_breakpoint(v: &Value) -> bool {
    match v {
        Value::Object(o) => o.contains_key("cache_control") || o.values().any(has_breakpoint),
        Value::Array(a) => a.iter().any(has_breakpoint),
        _ => false,
    }
}
