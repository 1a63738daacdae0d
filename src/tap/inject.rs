//! Usage injection for OpenAI chat streams: ask the upstream for
//! `stream_options.include_usage`, then take back out of the stream exactly
//! what the option added, so the client gets the bytes it would have got.

use bytes::BytesMut;
use memchr::memmem;

use super::sse::MAX_EVENT_BYTES;
use crate::json::{skip_ws, RequestView};
use crate::provider::{CHOICES, USAGE};

/// The request body with `stream_options.include_usage: true` set by a
/// minimal edit (every other byte unchanged): added when absent, its value
/// replaced when `false` or `null` (an opt-out is treated as absent, SPEC
/// §2: the client still gets the stream it asked for, since what the option
/// adds is stripped). `None` when the client asked for usage itself or
/// `stream_options` is not an object.
pub fn inject_include_usage(body: &[u8], req: &RequestView<'_>) -> Option<Vec<u8>> {
    let (at, text): (usize, &[u8]) = match req.raw("stream_options") {
        None => match req.fields().last() {
            Some((_, last)) => (
                req.span(last).end,
                b",\"stream_options\":{\"include_usage\":true}",
            ),
            None => (
                memchr::memchr(b'{', body)? + 1,
                b"\"stream_options\":{\"include_usage\":true}",
            ),
        },
        Some(raw) if raw.get() == "null" => {
            let span = req.span(raw);
            let mut out = Vec::with_capacity(body.len() + 24);
            out.extend_from_slice(&body[..span.start]);
            out.extend_from_slice(b"{\"include_usage\":true}");
            out.extend_from_slice(&body[span.end..]);
            return Some(out);
        }
        // What SDKs send when the client asked itself: nothing to add, no parse.
        Some(raw) if raw.get() == r#"{"include_usage":true}"# => return None,
        Some(raw) => {
            let inner = RequestView::parse(raw.get().as_bytes())?;
            let base = req.span(raw).start;
            if let Some(v) = inner.raw("include_usage") {
                if !matches!(v.get(), "false" | "null") {
                    return None;
                }
                // The opt-out's value becomes `true`, nothing else moves.
                let at = inner.span(v);
                let mut out = Vec::with_capacity(body.len() + 1);
                out.extend_from_slice(&body[..base + at.start]);
                out.extend_from_slice(b"true");
                out.extend_from_slice(&body[base + at.end..]);
                return Some(out);
            }
            match inner.fields().last() {
                Some((_, last)) => (base + inner.span(last).end, b",\"include_usage\":true"),
                None => (base + 1, b"\"include_usage\":true"),
            }
        }
    };
    let mut out = Vec::with_capacity(body.len() + text.len());
    out.extend_from_slice(&body[..at]);
    out.extend_from_slice(text);
    out.extend_from_slice(&body[at..]);
    Some(out)
}

/// Did an upstream's 400 body complain about `stream_options`?
pub fn mentions_stream_options(body: &[u8]) -> bool {
    memmem::find(body, b"stream_options").is_some()
}

/// Removes from an injected stream the usage-only event and the
/// `"usage":null` member of every other chunk. It holds back at most one
/// unfinished event; complete events leave as soon as their blank line is in.
#[derive(Default)]
pub struct UsageStripper {
    /// The unfinished event (starts at an event boundary).
    pending: Vec<u8>,
    /// How far `pending` has been scanned for line ends.
    scanned: usize,
    /// Where the current line starts in `pending`.
    line_begin: usize,
    /// The last line end seen was a CR: an LF right after it belongs to it.
    after_cr: bool,
    /// An event outgrew the cap: everything is forwarded untouched from here.
    passthrough: bool,
}

impl UsageStripper {
    pub fn new() -> Self {
        Self::default()
    }

    /// Take the next upstream chunk; append to `out` what the client gets now.
    pub fn push(&mut self, chunk: &[u8], out: &mut BytesMut) {
        if self.passthrough {
            out.extend_from_slice(chunk);
            return;
        }
        if self.pending.is_empty() {
            // Common case: whole events inside the chunk, no copy.
            let used = self.process(chunk, out);
            self.pending.extend_from_slice(&chunk[used..]);
        } else {
            self.pending.extend_from_slice(chunk);
            let buf = std::mem::take(&mut self.pending);
            let used = self.process(&buf, out);
            self.pending = buf;
            self.pending.drain(..used);
        }
        if self.pending.len() > MAX_EVENT_BYTES {
            self.passthrough = true;
            out.extend_from_slice(&self.pending);
            self.pending = Vec::new();
        }
    }

    /// The stream ended: what is held back goes out (still without what the option added).
    pub fn finish(&mut self, out: &mut BytesMut) {
        emit(&self.pending, out);
        self.pending.clear();
        self.scanned = 0;
        self.line_begin = 0;
        self.after_cr = false;
    }

    /// Emit every complete event in `buf` (whose unscanned part starts at
    /// `self.scanned`); returns how many bytes were emitted or dropped. Scan
    /// state is left relative to the first unconsumed byte.
    fn process(&mut self, buf: &[u8], out: &mut BytesMut) -> usize {
        let mut start = 0; // first byte of the current event
        let mut pos = self.scanned;
        let mut waiting = false;
        while let Some(off) = memchr::memchr2(b'\n', b'\r', &buf[pos..]) {
            let i = pos + off;
            if buf[i] == b'\n' && self.after_cr && i == self.line_begin {
                // The LF of a CRLF whose CR was the previous terminator.
                self.after_cr = false;
                self.line_begin = i + 1;
                pos = i + 1;
                continue;
            }
            self.after_cr = false;
            if i == self.line_begin {
                // A blank line: the event ends after its terminator.
                let end = if buf[i] == b'\r' {
                    match buf.get(i + 1) {
                        Some(b'\n') => i + 2,
                        Some(_) => i + 1,
                        None => {
                            // Cannot tell CR from CRLF yet: wait for the next byte.
                            pos = i;
                            waiting = true;
                            break;
                        }
                    }
                } else {
                    i + 1
                };
                emit(&buf[start..end], out);
                start = end;
                self.line_begin = end;
                pos = end;
                continue;
            }
            self.after_cr = buf[i] == b'\r';
            self.line_begin = i + 1;
            pos = i + 1;
        }
        if !waiting {
            pos = buf.len();
        }
        self.scanned = pos - start;
        self.line_begin -= start;
        start
    }
}

/// One complete event (its blank line included), minus what the option added.
fn emit(ev: &[u8], out: &mut BytesMut) {
    // One pass over the `"usage"` keys: the first with a null or object value decides.
    for k in USAGE.find_iter(ev) {
        let i = skip_ws(ev, k + USAGE.needle().len());
        if ev.get(i) != Some(&b':') {
            continue;
        }
        let v = skip_ws(ev, i + 1);
        if ev[v..].starts_with(b"null") {
            match null_member_span(ev, k, v + 4) {
                Some((a, b)) => {
                    out.extend_from_slice(&ev[..a]);
                    out.extend_from_slice(&ev[b..]);
                }
                None => out.extend_from_slice(ev),
            }
            return;
        }
        if ev.get(v) == Some(&b'{') {
            // A usage object: the chunk the option added when `choices` is empty.
            if !empty_choices(ev) {
                out.extend_from_slice(ev);
            }
            return;
        }
    }
    out.extend_from_slice(ev);
}

/// `"choices":[]`, whitespace allowed.
fn empty_choices(ev: &[u8]) -> bool {
    CHOICES.find_iter(ev).any(|at| {
        let i = skip_ws(ev, at + CHOICES.needle().len());
        if ev.get(i) != Some(&b':') {
            return false;
        }
        let i = skip_ws(ev, i + 1);
        if ev.get(i) != Some(&b'[') {
            return false;
        }
        let i = skip_ws(ev, i + 1);
        ev.get(i) == Some(&b']')
    })
}

/// The bytes to cut for the member from key `k` to value end `end`, with
/// its separating comma: the one before it, or for a first member the one after.
fn null_member_span(ev: &[u8], k: usize, end: usize) -> Option<(usize, usize)> {
    let mut b = k;
    while b > 0 && matches!(ev[b - 1], b' ' | b'\t' | b'\r' | b'\n') {
        b -= 1;
    }
    match ev[..b].last() {
        Some(b',') => Some((b - 1, end)),
        Some(b'{') => {
            let a = skip_ws(ev, end);
            if ev.get(a) == Some(&b',') {
                Some((k, skip_ws(ev, a + 1)))
            } else {
                Some((k, a))
            }
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inject(body: &str) -> Option<String> {
        let v = RequestView::parse(body.as_bytes()).unwrap();
        inject_include_usage(body.as_bytes(), &v).map(|b| String::from_utf8(b).unwrap())
    }

    #[test]
    fn injection_is_a_minimal_edit() {
        assert_eq!(
            inject(r#"{"model":"m","stream":true}"#).as_deref(),
            Some(r#"{"model":"m","stream":true,"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            inject("{\n  \"stream\": true\n}\n").as_deref(),
            Some("{\n  \"stream\": true,\"stream_options\":{\"include_usage\":true}\n}\n")
        );
        assert_eq!(
            inject(r#"{"stream":true,"stream_options":{"include_obfuscation":false}}"#).as_deref(),
            Some(
                r#"{"stream":true,"stream_options":{"include_obfuscation":false,"include_usage":true}}"#
            )
        );
        assert_eq!(
            inject(r#"{"stream_options": { },"stream":true}"#).as_deref(),
            Some(r#"{"stream_options": {"include_usage":true },"stream":true}"#)
        );
        assert_eq!(
            inject(r#"{"stream_options":null}"#).as_deref(),
            Some(r#"{"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            inject(" { } ").as_deref(),
            Some(r#" {"stream_options":{"include_usage":true} } "#)
        );
        assert_eq!(
            inject(r#"{"stream_options":{"include_usage":false}}"#).as_deref(),
            Some(r#"{"stream_options":{"include_usage":true}}"#)
        );
        assert_eq!(
            inject("{\"stream\":true, \"stream_options\": {\"include_usage\" :  false ,\"x\":1}}")
                .as_deref(),
            Some("{\"stream\":true, \"stream_options\": {\"include_usage\" :  true ,\"x\":1}}")
        );
        assert_eq!(
            inject(r#"{"stream_options":{"x":[false],"include_usage":null}}"#).as_deref(),
            Some(r#"{"stream_options":{"x":[false],"include_usage":true}}"#)
        );
        assert_eq!(inject(r#"{"stream_options":{"include_usage":0}}"#), None);
        assert_eq!(inject(r#"{"stream_options":{"include_usage":true}}"#), None);
        assert_eq!(inject(r#"{"stream_options":7}"#), None);
    }

    fn strip(input: &[u8], cut: &[usize]) -> Vec<u8> {
        let mut s = UsageStripper::new();
        let mut out = BytesMut::new();
        let mut at = 0;
        for &c in cut.iter().chain(std::iter::once(&input.len())) {
            s.push(&input[at..c], &mut out);
            at = c;
        }
        s.finish(&mut out);
        out.to_vec()
    }

    #[test]
    fn strips_null_members_and_the_usage_chunk() {
        let with = b"data: {\"id\":\"a\",\"choices\":[{\"delta\":{}}],\"usage\":null,\"o\":\"x\"}\r\n\r\n: c\r\n\r\ndata: {\"usage\":null,\"choices\":[]}\n\ndata: {\"id\":\"a\",\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\r\rdata: [DONE]\n\n";
        let want = b"data: {\"id\":\"a\",\"choices\":[{\"delta\":{}}],\"o\":\"x\"}\r\n\r\n: c\r\n\r\ndata: {\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert_eq!(strip(with, &[]), want);
        for i in 0..=with.len() {
            assert_eq!(strip(with, &[i]), want, "cut at {i}");
        }
        let all: Vec<usize> = (1..with.len()).collect();
        assert_eq!(strip(with, &all), want);
    }
}
