//! The tap-side reader: decompress a view of the response as it passes,
//! frame it (SSE, NDJSON or one JSON document) and let the provider read the
//! few events that can carry usage. It never touches what the client gets.

use std::io::Write;

use bytes::Bytes;

use crate::provider::{Framing, Node, Observed, Provider};
use crate::sse::{Event, SseScanner, MAX_EVENT_BYTES};

/// Largest non-stream body copied for parsing at the end.
pub const MAX_JSON_BYTES: usize = 8 << 20;

/// Most decoded bytes looked at per response; beyond it (a decompression
/// bomb, or an endless stream) reading stops.
pub const MAX_DECODED_BYTES: u64 = 1 << 30;

/// Largest zstd window the tap decodes (2^23 = 8 MiB).
const ZSTD_WINDOW_LOG_MAX: u32 = 23;

/// What a finished reader knows.
#[derive(Debug, Clone, Default)]
pub struct ReadOutcome {
    pub observed: Observed,
    /// Malformed events, undecodable bytes or a buffer cap hit.
    pub parse_errors: u32,
}

/// Watches one response body go by.
pub struct UsageReader {
    decode: Decode,
}

/// The content decoder in front of the framing sink.
enum Decode {
    Identity(Sink),
    Gzip(Box<flate2::write::MultiGzDecoder<Sink>>),
    /// HTTP `deflate` before its first two bytes tell zlib from raw deflate.
    DeflateSniff(Vec<u8>, Sink),
    Zlib(Box<flate2::write::ZlibDecoder<Sink>>),
    RawDeflate(Box<flate2::write::DeflateDecoder<Sink>>),
    Brotli(Box<brotli_decompressor::DecompressorWriter<Sink>>),
    Zstd(Box<zstd::stream::write::Decoder<'static, Sink>>),
    /// An encoding tidemark cannot read: the body is forwarded, usage unknown.
    Unreadable(Sink),
}

/// Decoded bytes land here: framing, provider, accumulated observation.
struct Sink {
    p: &'static dyn Provider,
    frame: Frame,
    observed: Observed,
    parse_errors: u32,
    decoded: u64,
    /// Reading stopped (cap hit or undecodable); forwarding is unaffected.
    stopped: bool,
}

enum Document {
    Empty,
    One(Bytes),
    Joined(Vec<u8>),
}

impl Document {
    fn len(&self) -> usize {
        match self {
            Document::Empty => 0,
            Document::One(b) => b.len(),
            Document::Joined(v) => v.len(),
        }
    }
}

enum Frame {
    Sse(SseScanner),
    /// NDJSON: the unfinished line.
    Lines(Vec<u8>),
    /// One JSON document, up to [`MAX_JSON_BYTES`]: a body that arrives in
    /// one frame is held as it came; one in several is joined into a copy.
    Json(Document),
}

impl UsageReader {
    pub fn new(p: &'static dyn Provider, framing: Framing, content_encoding: Option<&str>) -> Self {
        let sink = Sink {
            p,
            frame: match framing {
                Framing::Sse => Frame::Sse(SseScanner::new()),
                Framing::Ndjson => Frame::Lines(Vec::new()),
                Framing::Json => Frame::Json(Document::Empty),
            },
            observed: Observed::default(),
            parse_errors: 0,
            decoded: 0,
            stopped: false,
        };
        let enc = content_encoding
            .map(|e| e.trim().to_ascii_lowercase())
            .unwrap_or_default();
        let decode = match enc.as_str() {
            "" | "identity" => Decode::Identity(sink),
            "gzip" | "x-gzip" => Decode::Gzip(Box::new(flate2::write::MultiGzDecoder::new(sink))),
            "deflate" => Decode::DeflateSniff(Vec::new(), sink),
            "br" => Decode::Brotli(Box::new(brotli_decompressor::DecompressorWriter::new(
                sink, 8192,
            ))),
            "zstd" => match zstd::stream::write::Decoder::new(sink) {
                Ok(mut d) => {
                    // RFC 8878: 8 MiB windows suffice for HTTP; a larger one would
                    // let an upstream make the tap allocate up to 128 MiB.
                    match d.window_log_max(ZSTD_WINDOW_LOG_MAX) {
                        Ok(()) => Decode::Zstd(Box::new(d)),
                        Err(_) => Decode::Unreadable(unreadable_sink(p)),
                    }
                }
                Err(_) => Decode::Unreadable(unreadable_sink(p)),
            },
            _ => Decode::Unreadable(unreadable_sink(p)),
        };
        UsageReader { decode }
    }

    /// Look at the next body chunk, exactly as the client receives it.
    pub fn feed(&mut self, chunk: &[u8]) {
        self.feed_frame(chunk, None);
    }

    /// [`feed`](Self::feed) with the chunk's own `Bytes`: an uncompressed
    /// JSON body that arrives whole is then held, not copied.
    pub fn feed_bytes(&mut self, chunk: &Bytes) {
        self.feed_frame(chunk, Some(chunk));
    }

    fn feed_frame(&mut self, chunk: &[u8], whole: Option<&Bytes>) {
        if chunk.is_empty() || self.sink().stopped {
            return;
        }
        let ok = match &mut self.decode {
            Decode::Identity(s) => {
                s.take_frame(chunk, whole);
                true
            }
            Decode::Gzip(d) => d.write_all(chunk).is_ok(),
            Decode::Brotli(d) => d.write_all(chunk).is_ok(),
            Decode::Zstd(d) => d.write_all(chunk).is_ok(),
            Decode::Zlib(d) => d.write_all(chunk).is_ok(),
            Decode::RawDeflate(d) => d.write_all(chunk).is_ok(),
            Decode::DeflateSniff(head, _) => {
                head.extend_from_slice(chunk);
                head.len() < 2 || self.sniffed()
            }
            Decode::Unreadable(_) => true,
        };
        if !ok {
            self.sink_mut().stop();
        }
    }

    /// The body ended (or was cut): flush the decoder, parse what is pending.
    pub fn finish(&mut self) -> ReadOutcome {
        if !self.sink().stopped {
            // Push out what the decoder holds. A body cut mid-stream fails
            // here; that is a short read, not a parse error, and what was
            // decoded still counts.
            let _ = match &mut self.decode {
                Decode::Identity(_) | Decode::Unreadable(_) | Decode::DeflateSniff(..) => Ok(()),
                Decode::Gzip(d) => d.try_finish(),
                Decode::Brotli(d) => d.flush(),
                Decode::Zstd(d) => d.flush(),
                Decode::Zlib(d) => d.try_finish(),
                Decode::RawDeflate(d) => d.try_finish(),
            };
            self.sink_mut().finish();
        }
        let s = self.sink_mut();
        let out = ReadOutcome {
            observed: s.observed.clone(),
            parse_errors: s.parse_errors,
        };
        s.stopped = true;
        out
    }

    fn sink(&self) -> &Sink {
        match &self.decode {
            Decode::Identity(s) | Decode::Unreadable(s) => s,
            Decode::Gzip(d) => d.get_ref(),
            Decode::Brotli(d) => d.get_ref(),
            Decode::Zstd(d) => d.get_ref(),
            Decode::Zlib(d) => d.get_ref(),
            Decode::RawDeflate(d) => d.get_ref(),
            Decode::DeflateSniff(_, s) => s,
        }
    }

    fn sink_mut(&mut self) -> &mut Sink {
        match &mut self.decode {
            Decode::Identity(s) | Decode::Unreadable(s) => s,
            Decode::Gzip(d) => d.get_mut(),
            Decode::Brotli(d) => d.get_mut(),
            Decode::Zstd(d) => d.get_mut(),
            Decode::Zlib(d) => d.get_mut(),
            Decode::RawDeflate(d) => d.get_mut(),
            Decode::DeflateSniff(_, s) => s,
        }
    }

    /// Two bytes of a `deflate` body are in: pick zlib or raw and replay them.
    fn sniffed(&mut self) -> bool {
        let p = self.sink().p;
        let Decode::DeflateSniff(head, sink) =
            std::mem::replace(&mut self.decode, Decode::Unreadable(unreadable_sink(p)))
        else {
            return false;
        };
        // RFC 1950: CM = 8 and the header checksum holds.
        let zlib = head[0] & 0x0f == 8 && (u16::from(head[0]) << 8 | u16::from(head[1])) % 31 == 0;
        if zlib {
            let mut d = Box::new(flate2::write::ZlibDecoder::new(sink));
            let ok = d.write_all(&head).is_ok();
            self.decode = Decode::Zlib(d);
            ok
        } else {
            let mut d = Box::new(flate2::write::DeflateDecoder::new(sink));
            let ok = d.write_all(&head).is_ok();
            self.decode = Decode::RawDeflate(d);
            ok
        }
    }
}

fn unreadable_sink(p: &'static dyn Provider) -> Sink {
    Sink {
        p,
        frame: Frame::Json(Document::Empty),
        observed: Observed::default(),
        parse_errors: 1,
        decoded: 0,
        stopped: true,
    }
}

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.take(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Sink {
    fn stop(&mut self) {
        if !self.stopped {
            self.stopped = true;
            self.parse_errors += 1;
            self.frame = Frame::Json(Document::Empty);
        }
    }

    /// Decoded bytes in.
    fn take(&mut self, buf: &[u8]) {
        self.take_frame(buf, None);
    }

    /// Decoded bytes in; `whole`: the same bytes as a `Bytes` that may be kept.
    fn take_frame(&mut self, buf: &[u8], whole: Option<&Bytes>) {
        if self.stopped {
            return;
        }
        self.decoded += buf.len() as u64;
        if self.decoded > MAX_DECODED_BYTES {
            self.stop();
            return;
        }
        let p = self.p;
        let observed = &mut self.observed;
        let errors = &mut self.parse_errors;
        let over = match &mut self.frame {
            Frame::Sse(sc) => {
                sc.feed_skipping(buf, &|raw| p.sse_relevant_from(raw), &mut |e: Event<'_>| {
                    event(p, e.name, e.data, observed, errors, true)
                });
                sc.overflowed()
            }
            Frame::Lines(line) => feed_lines(p, line, buf, observed, errors),
            Frame::Json(doc) => {
                if doc.len() + buf.len() > MAX_JSON_BYTES {
                    true
                } else {
                    *doc = match (std::mem::replace(doc, Document::Empty), whole) {
                        (Document::Empty, Some(b)) => Document::One(b.clone()),
                        (Document::Empty, None) => Document::Joined(buf.to_vec()),
                        (Document::One(first), _) => Document::Joined([&first[..], buf].concat()),
                        (Document::Joined(mut v), _) => {
                            v.extend_from_slice(buf);
                            Document::Joined(v)
                        }
                    };
                    false
                }
            }
        };
        if over {
            self.stop();
        }
    }

    fn finish(&mut self) {
        if self.stopped {
            return;
        }
        let p = self.p;
        let observed = &mut self.observed;
        let errors = &mut self.parse_errors;
        match &mut self.frame {
            Frame::Sse(sc) => {
                // An event the stream did not close: read it if it is whole JSON,
                // but a cut-off one is no parse error.
                if let Some(e) = sc.finish() {
                    let mut ignored = 0;
                    event(p, e.name, e.data, observed, &mut ignored, false);
                }
            }
            Frame::Lines(line) => {
                let line = std::mem::take(line);
                let mut ignored = 0;
                ndjson_line(p, &line, observed, &mut ignored);
            }
            Frame::Json(doc) => match std::mem::replace(doc, Document::Empty) {
                Document::Empty => {}
                Document::One(b) => json_document(p, &b, observed, errors),
                Document::Joined(v) => json_document(p, &v, observed, errors),
            },
        }
    }
}

/// One SSE event: cheap check, then parse, then the provider.
fn event(
    p: &'static dyn Provider,
    name: Option<&str>,
    data: &[u8],
    acc: &mut Observed,
    errors: &mut u32,
    complete: bool,
) {
    if data == b"[DONE]" || !p.may_carry_usage(name, data) {
        return;
    }
    match parse_read(p, data) {
        Some(v) => p.observe(name, &v, acc),
        None if complete => *errors += 1,
        None => {}
    }
}

/// Complete NDJSON lines out of `buf`, the unfinished one kept in `line`.
/// Returns true when the kept line outgrew the cap.
fn feed_lines(
    p: &'static dyn Provider,
    line: &mut Vec<u8>,
    mut buf: &[u8],
    acc: &mut Observed,
    errors: &mut u32,
) -> bool {
    while let Some(i) = memchr::memchr(b'\n', buf) {
        if line.is_empty() {
            ndjson_line(p, &buf[..i], acc, errors);
        } else {
            line.extend_from_slice(&buf[..i]);
            ndjson_line(p, line, acc, errors);
            line.clear();
        }
        buf = &buf[i + 1..];
    }
    if line.len() + buf.len() > MAX_EVENT_BYTES {
        *line = Vec::new();
        return true;
    }
    line.extend_from_slice(buf);
    false
}

fn ndjson_line(p: &'static dyn Provider, line: &[u8], acc: &mut Observed, errors: &mut u32) {
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.iter().all(u8::is_ascii_whitespace) || !p.may_carry_usage(None, line) {
        return;
    }
    match parse_read(p, line) {
        Some(v) => p.observe(None, &v, acc),
        None => *errors += 1,
    }
}

/// A whole JSON body; a top-level array (Gemini's stream without `alt=sse`)
/// is read element by element.
fn json_document(p: &'static dyn Provider, body: &[u8], acc: &mut Observed, errors: &mut u32) {
    if body.iter().all(u8::is_ascii_whitespace) || !p.may_carry_usage(None, body) {
        return;
    }
    match parse_read(p, body) {
        Some(Node::Arr(items)) => items.iter().for_each(|v| p.observe(None, v, acc)),
        Some(v) => p.observe(None, &v, acc),
        None => *errors += 1,
    }
}

/// Parse an event, line or body into a [`Node`] holding only the members the
/// provider [reads](Provider::reads); the rest is stepped over by its
/// structure without building anything (see [`crate::pick`]).
fn parse_read(p: &dyn Provider, bytes: &[u8]) -> Option<Node> {
    crate::pick::pick(bytes, p.reads())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::Api;

    #[test]
    fn a_json_body_reads_alike_held_whole_or_joined_from_pieces() {
        let body = include_bytes!("../tests/fixtures/openai-chat/nonstream_basic.json");
        let p = Api::OpenAiChat.provider();
        let read = |feed: &dyn Fn(&mut UsageReader)| {
            let mut r = UsageReader::new(p, Framing::Json, None);
            feed(&mut r);
            r.finish()
        };
        let whole = read(&|r| r.feed_bytes(&Bytes::from_static(body)));
        assert_eq!(whole.observed.usage.total_context, Some(2048));
        assert_eq!(whole.parse_errors, 0);
        for cut in [1, 100, body.len() - 1] {
            let (a, b) = body.split_at(cut);
            for joined in [
                read(&|r| {
                    r.feed_bytes(&Bytes::copy_from_slice(a));
                    r.feed_bytes(&Bytes::copy_from_slice(b));
                }),
                read(&|r| {
                    r.feed(a);
                    r.feed_bytes(&Bytes::copy_from_slice(b));
                }),
            ] {
                assert_eq!(format!("{joined:?}"), format!("{whole:?}"), "cut at {cut}");
            }
        }
        // Cut short: a parse error whether held or joined.
        let short = &body[..body.len() - 2];
        assert_eq!(
            read(&|r| r.feed_bytes(&Bytes::copy_from_slice(short))).parse_errors,
            1
        );
        assert_eq!(read(&|r| r.feed(short)).parse_errors, 1);
    }

    #[test]
    fn only_the_members_a_provider_reads_are_built() {
        let body = include_bytes!("../tests/fixtures/openai-chat/nonstream_basic.json");
        let node = parse_read(Api::OpenAiChat.provider(), body).unwrap();
        // No id, model, choices or completion_tokens_details: only usage
        // and the counts chat's observe reads.
        assert_eq!(
            node,
            Node::Obj(vec![(
                "usage",
                Node::Obj(vec![
                    ("prompt_tokens", Node::Count(2048)),
                    ("completion_tokens", Node::Count(584)),
                    (
                        "prompt_tokens_details",
                        Node::Obj(vec![("cached_tokens", Node::Count(1920))])
                    ),
                ])
            )])
        );
        // Skipped members are checked for structure: a body cut short fails.
        let broken = br#"{"choices":[{"x":1}],"usage":{"prompt_tokens":1}"#;
        assert!(parse_read(Api::OpenAiChat.provider(), broken).is_none());
    }
}
