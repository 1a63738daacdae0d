//! Incremental `text/event-stream` scanner (WHATWG rules) with a capped
//! buffer: it sees the stream in whatever chunks the network delivers and
//! hands complete events on, holding only the unfinished line and event.

use memchr::{memchr, memchr2, memrchr};

/// Most bytes one unfinished line plus one unfinished event may hold. A
/// Responses terminal event repeats the whole response (output, instructions,
/// tools), so this is generous; past it the scanner gives up on the response.
pub const MAX_EVENT_BYTES: usize = 4 << 20;

const BOM: &[u8; 3] = b"\xEF\xBB\xBF";

/// One dispatched event: its `event:` name (if any) and its `data` lines
/// joined with `\n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event<'a> {
    pub name: Option<&'a str>,
    pub data: &'a [u8],
}

/// Given a run of whole events, the offset of its first byte that may matter.
pub type RelevantFrom = dyn Fn(&[u8]) -> usize;

/// Splits a byte stream into SSE events.
#[derive(Debug, Default)]
pub struct SseScanner {
    /// The unfinished line carried over from the previous chunk.
    line: Vec<u8>,
    /// `data` of the event being built, each line followed by `\n`.
    data: Vec<u8>,
    /// `event` field of the event being built.
    name: Vec<u8>,
    /// How many bytes of a leading BOM were seen (3: decided, no more checks).
    bom: u8,
    /// The previous chunk ended in CR: an LF opening the next one belongs to it.
    after_cr: bool,
    /// The cap was hit; nothing more is read from this stream.
    overflowed: bool,
}

impl SseScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// True once an event or line outgrew [`MAX_EVENT_BYTES`].
    pub fn overflowed(&self) -> bool {
        self.overflowed
    }

    /// Feed the next bytes; `on_event` is called for each event completed by them.
    pub fn feed(&mut self, chunk: &[u8], on_event: &mut dyn FnMut(Event<'_>)) {
        self.feed_inner(chunk, None, on_event)
    }

    /// [`feed`](Self::feed), except that whole events at an event boundary
    /// (LF line ends, each ending in a blank line) that come before the first
    /// byte that may matter are stepped over unread: no line splitting, no
    /// copy, no callback. `relevant_from` is given a run of whole events and
    /// returns the offset of its first byte that may matter (its length when
    /// none does); it must never point past a byte of an event `on_event`
    /// would act on, unless a later event of the run replaces all it would
    /// learn, and it errs early. One call covers a whole burst of
    /// events, so the cost is a few long scans rather than a few per event.
    pub fn feed_skipping(
        &mut self,
        chunk: &[u8],
        relevant_from: &RelevantFrom,
        on_event: &mut dyn FnMut(Event<'_>),
    ) {
        self.feed_inner(chunk, Some(relevant_from), on_event)
    }

    fn feed_inner(
        &mut self,
        mut chunk: &[u8],
        relevant_from: Option<&RelevantFrom>,
        on_event: &mut dyn FnMut(Event<'_>),
    ) {
        if self.overflowed {
            return;
        }
        if self.bom < 3 {
            while self.bom < 3 {
                let Some((&b, rest)) = chunk.split_first() else {
                    return;
                };
                if b == BOM[self.bom as usize] {
                    self.bom += 1;
                    chunk = rest;
                } else {
                    // Not a BOM after all: what matched so far is line content.
                    self.line.extend_from_slice(&BOM[..self.bom as usize]);
                    self.bom = 3;
                }
            }
        }
        if self.after_cr && !chunk.is_empty() {
            self.after_cr = false;
            if chunk.first() == Some(&b'\n') {
                chunk = &chunk[1..];
            }
        }
        // Where the run of whole events skippable at once ends: at the last
        // blank line before the next CR (lines with one take the slow path).
        // Kept as an offset from the chunk's end, since `chunk` only ever
        // shrinks from the front; searched again only once passed.
        let run_end = |c: &[u8]| {
            let before_cr = &c[..memchr(b'\r', c).unwrap_or(c.len())];
            if before_cr.len() == c.len() && c.ends_with(b"\n\n") {
                // The common frame: whole LF events, nothing after them.
                return 0;
            }
            c.len() - last_blank_line(before_cr).map_or(0, |e| e + 2)
        };
        let mut run_from_end = relevant_from.map_or(0, |_| run_end(chunk));
        loop {
            if let Some(relevant_from) = relevant_from.filter(|_| self.at_boundary()) {
                if run_from_end >= chunk.len() {
                    run_from_end = run_end(chunk);
                }
                let run = &chunk[..chunk.len() - run_from_end];
                if !run.is_empty() {
                    let from = relevant_from(run).min(run.len());
                    // Skip the events that end before it (all of the run,
                    // which ends at a blank line, when nothing is relevant).
                    if from == run.len() {
                        chunk = &chunk[run.len()..];
                    } else if let Some(end) = last_blank_line(&run[..from]) {
                        chunk = &chunk[end + 2..];
                    }
                }
            }
            if chunk.is_empty() {
                return;
            }
            if self.at_boundary() {
                // The common event, one `data:` line and a blank line, is
                // handed over in place: no line buffer, no copy.
                if let Some((data, rest)) = single_data_line(chunk) {
                    on_event(Event { name: None, data });
                    chunk = rest;
                    continue;
                }
            }
            match self.feed_lines(chunk, on_event) {
                Some(rest) if !rest.is_empty() => chunk = rest,
                _ => return,
            }
        }
    }

    /// Nothing carried over: the next byte starts a line of a new event.
    fn at_boundary(&self) -> bool {
        self.line.is_empty()
            && self.data.is_empty()
            && self.name.is_empty()
            && !self.after_cr
            && !self.overflowed
    }

    /// Lines of `chunk` up to and including the next blank line; returns
    /// what follows it, or `None` when the chunk ran out (its tail kept).
    fn feed_lines<'c>(
        &mut self,
        mut chunk: &'c [u8],
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Option<&'c [u8]> {
        while let Some(i) = memchr2(b'\n', b'\r', chunk) {
            let blank = i == 0 && self.line.is_empty();
            if self.line.is_empty() {
                self.line_done(&chunk[..i], on_event);
            } else {
                self.line.extend_from_slice(&chunk[..i]);
                let line = std::mem::take(&mut self.line);
                self.line_done(&line, on_event);
                self.line = line;
                self.line.clear();
            }
            let mut next = i + 1;
            if chunk[i] == b'\r' {
                match chunk.get(next) {
                    Some(b'\n') => next += 1,
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            chunk = &chunk[next..];
            if self.overflowed {
                return None;
            }
            if blank {
                return Some(chunk);
            }
        }
        self.line.extend_from_slice(chunk);
        self.check_cap();
        None
    }

    /// The stream ended. Per the standard an unfinished event is discarded;
    /// it is returned here so a caller may still look at it.
    pub fn finish(&mut self) -> Option<Event<'_>> {
        if self.overflowed {
            return None;
        }
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_done(&line, &mut |_| {});
        }
        if self.data.is_empty() {
            return None;
        }
        self.data.pop();
        Some(Event {
            name: event_name(&self.name),
            data: &self.data,
        })
    }

    fn line_done(&mut self, line: &[u8], on_event: &mut dyn FnMut(Event<'_>)) {
        if line.is_empty() {
            if !self.data.is_empty() {
                self.data.pop();
                on_event(Event {
                    name: event_name(&self.name),
                    data: &self.data,
                });
            }
            self.data.clear();
            self.name.clear();
            return;
        }
        if line[0] == b':' {
            return;
        }
        let (field, value) = match memchr(b':', line) {
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match field {
            b"data" => {
                self.data.extend_from_slice(value);
                self.data.push(b'\n');
                self.check_cap();
            }
            b"event" => {
                self.name.clear();
                self.name.extend_from_slice(value);
            }
            _ => {}
        }
    }

    fn check_cap(&mut self) {
        if self.line.len() + self.data.len() > MAX_EVENT_BYTES {
            self.overflowed = true;
            self.line = Vec::new();
            self.data = Vec::new();
            self.name = Vec::new();
        }
    }
}

/// `data:<value>\n\n` (LF only, `value` without a line break) at the start
/// of `chunk`: the event's data, as [`SseScanner::line_done`] would build
/// it, and what follows. Lines near [`MAX_EVENT_BYTES`] are left to the
/// line path, which owns the cap.
fn single_data_line(chunk: &[u8]) -> Option<(&[u8], &[u8])> {
    let rest = chunk.strip_prefix(b"data:")?;
    let end = memchr2(b'\n', b'\r', rest)?;
    if rest[end] != b'\n' || rest.get(end + 1) != Some(&b'\n') || end >= MAX_EVENT_BYTES {
        return None;
    }
    let value = &rest[..end];
    Some((value.strip_prefix(b" ").unwrap_or(value), &rest[end + 2..]))
}

fn event_name(name: &[u8]) -> Option<&str> {
    if name.is_empty() {
        None
    } else {
        std::str::from_utf8(name).ok()
    }
}

/// Where the last blank line (`\n\n`) in `c` starts. memchr's reverse
/// substring search has no SIMD path; its reverse byte search does, and an
/// event stream's newlines are few (one or two an event), so this steps
/// newline to newline from the end.
fn last_blank_line(c: &[u8]) -> Option<usize> {
    let mut end = c.len();
    while let Some(i) = memrchr(b'\n', &c[..end]) {
        if i > 0 && c[i - 1] == b'\n' {
            return Some(i - 1);
        }
        end = i;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use memchr::memmem;

    /// The same answer as memchr's reverse substring search, on every
    /// string of up to 10 bytes from `a`, `\n` and `\r`.
    #[test]
    fn last_blank_line_is_the_last_double_newline() {
        let mut checked = 0;
        for len in 0..=10u32 {
            for n in 0..3usize.pow(len) {
                let c: Vec<u8> = (0..len).map(|k| b"a\n\r"[n / 3usize.pow(k) % 3]).collect();
                assert_eq!(last_blank_line(&c), memmem::rfind(&c, b"\n\n"), "{c:?}");
                checked += 1;
            }
        }
        assert_eq!(checked, (0..=10).map(|l| 3usize.pow(l)).sum::<usize>());
    }

    fn scan(chunks: &[&[u8]]) -> Vec<(Option<String>, String)> {
        let mut s = SseScanner::new();
        let mut out = Vec::new();
        for c in chunks {
            s.feed(c, &mut |e| {
                out.push((
                    e.name.map(str::to_string),
                    String::from_utf8_lossy(e.data).into_owned(),
                ))
            });
        }
        out
    }

    #[test]
    fn line_endings_comments_and_fields() {
        let text = b"\xEF\xBB\xBF: comment\r\ndata:a\r\ndata: b\r\n\r\nevent: x\rdata\r\rdata: c\n\nid: 3\nretry: 5\n\n";
        let want = vec![
            (None, "a\nb".to_string()),
            (Some("x".to_string()), String::new()),
            (None, "c".to_string()),
        ];
        assert_eq!(scan(&[text]), want);
        for i in 0..=text.len() {
            assert_eq!(scan(&[&text[..i], &text[i..]]), want, "split at {i}");
        }
        let bytes: Vec<&[u8]> = text.chunks(1).collect();
        assert_eq!(scan(&bytes), want);
    }

    #[test]
    fn an_empty_chunk_between_cr_and_lf_changes_nothing() {
        assert_eq!(
            scan(&[b"data: a\r", b"", b"\n\r\n"]),
            vec![(None, "a".to_string())]
        );
    }

    #[test]
    fn bom_only_at_start_and_partial_bom_is_content() {
        assert_eq!(scan(&[b"\xEF\xBBdata: x\n\n"]).len(), 0);
        assert_eq!(
            scan(&[b"\xEF", b"\xBB", b"\xBF", b"data: x\n\n"]),
            vec![(None, "x".to_string())]
        );
    }

    #[test]
    fn cap_stops_reading() {
        let mut s = SseScanner::new();
        let big = vec![b'a'; MAX_EVENT_BYTES / 2];
        let mut n = 0;
        s.feed(b"data: ", &mut |_| n += 1);
        for _ in 0..3 {
            s.feed(&big, &mut |_| n += 1);
        }
        s.feed(b"\n\ndata: y\n\n", &mut |_| n += 1);
        assert!(s.overflowed());
        assert_eq!(n, 0);
        assert!(s.line.capacity() == 0 && s.data.capacity() == 0);
    }

    #[test]
    fn inert_events_are_stepped_over_and_the_rest_still_arrive_at_every_split() {
        // `skip 2` has CRLF line ends: read the slow way, so handed over.
        let text = b"data: skip 1\n\ndata: keep 1\n\n: c\ndata: skip 2\r\n\r\nevent: e\ndata: keep 2\n\ndata: skip 3\n\n";
        let relevant = |raw: &[u8]| memmem::find(raw, b"keep").unwrap_or(raw.len());
        for i in 0..=text.len() {
            let (mut s, mut seen) = (SseScanner::new(), Vec::new());
            for part in [&text[..i], &text[i..]] {
                s.feed_skipping(part, &relevant, &mut |e| {
                    seen.push(String::from_utf8_lossy(e.data).into_owned())
                });
            }
            // Every event that matters arrives, whole and in order...
            let kept: Vec<&String> = seen.iter().filter(|d| d.starts_with("keep")).collect();
            assert_eq!(kept, ["keep 1", "keep 2"], "split at {i}");
            // ...and unsplit, the inert ones are never handed over.
            if i == 0 || i == text.len() {
                assert_eq!(seen, ["keep 1", "skip 2", "keep 2"]);
            }
        }
    }

    #[test]
    fn unfinished_event_is_offered_at_finish() {
        let mut s = SseScanner::new();
        s.feed(b"event: e\ndata: {\"a\":1}", &mut |_| {
            panic!("not complete")
        });
        let e = s.finish().expect("pending event");
        assert_eq!(e.name, Some("e"));
        assert_eq!(e.data, b"{\"a\":1}");
    }
}
