//! The tap-side reader: decompress a view of the response as it passes,
//! frame it (SSE, NDJSON or one JSON document) and let the provider read the
//! few events that can carry usage. It never touches what the client gets.

use std::io::Write;

use bytes::Bytes;

use super::sse::{Event, SseScanner, MAX_EVENT_BYTES};
use crate::json::Node;
use crate::provider::{Framing, Observed, Provider};

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
    decode: Decode<Sink>,
}

/// An HTTP content coding undone as the bytes pass: what is written in
/// encoded leaves decoded into `W`, chunk by chunk, never held whole.
pub enum Decode<W: StandIn> {
    Identity(W),
    Gzip(Box<flate2::write::MultiGzDecoder<W>>),
    /// HTTP `deflate` before its first two bytes tell zlib from raw deflate.
    DeflateSniff(Vec<u8>, W),
    Zlib(Box<flate2::write::ZlibDecoder<W>>),
    RawDeflate(Box<flate2::write::DeflateDecoder<W>>),
    Brotli(Box<brotli_decompressor::DecompressorWriter<W>>),
    Zstd(Box<zstd::stream::write::Decoder<'static, W>>),
    /// An encoding tidemark cannot read.
    Unreadable(W),
}

/// A writer that can leave a stand-in in its place for the moment a
/// [`Decode`] changes shape (`deflate`, once its first bytes are in).
pub trait StandIn: Write {
    fn stand_in(&self) -> Self;
}

impl<W: StandIn> Decode<W> {
    /// The decoder for a `Content-Encoding` value (none, `identity`, `gzip`,
    /// `x-gzip`, `deflate`, `br`, `zstd`); any other is [`Decode::Unreadable`].
    pub fn new(content_encoding: Option<&str>, w: W) -> Self {
        let enc = content_encoding
            .map(|e| e.trim().to_ascii_lowercase())
            .unwrap_or_default();
        match enc.as_str() {
            "" | "identity" => Decode::Identity(w),
            "gzip" | "x-gzip" => Decode::Gzip(Box::new(flate2::write::MultiGzDecoder::new(w))),
            "deflate" => Decode::DeflateSniff(Vec::new(), w),
            "br" => Decode::Brotli(Box::new(brotli_decompressor::DecompressorWriter::new(
                w, 8192,
            ))),
            // RFC 8878: 8 MiB windows suffice for HTTP; a larger one would
            // let an upstream make the tap allocate up to 128 MiB.
            "zstd" => match zstd::stream::raw::Decoder::new().and_then(|mut d| {
                d.set_parameter(zstd::stream::raw::DParameter::WindowLogMax(
                    ZSTD_WINDOW_LOG_MAX,
                ))
                .map(|()| d)
            }) {
                Ok(d) => Decode::Zstd(Box::new(zstd::stream::write::Decoder::with_decoder(w, d))),
                Err(_) => Decode::Unreadable(w),
            },
            _ => Decode::Unreadable(w),
        }
    }

    /// The coding is one tidemark decodes (identity included).
    pub fn readable(&self) -> bool {
        !matches!(self, Decode::Unreadable(_))
    }

    /// Decode the next chunk into the writer; false when it is not valid
    /// in its coding (or the writer refused it). Unreadable: nothing written.
    pub fn write(&mut self, chunk: &[u8]) -> bool {
        match self {
            Decode::Identity(w) => w.write_all(chunk).is_ok(),
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
        }
    }

    /// The body ended: push out what the decoder holds. False when the
    /// body was cut short or broken (what was decoded is in the writer).
    pub fn finish(&mut self) -> bool {
        match self {
            Decode::Identity(_) | Decode::Unreadable(_) => true,
            // One byte of a deflate body: not a whole one.
            Decode::DeflateSniff(head, _) => head.is_empty(),
            Decode::Gzip(d) => d.try_finish().is_ok(),
            Decode::Brotli(d) => d.flush().is_ok(),
            Decode::Zstd(d) => d.flush().is_ok(),
            Decode::Zlib(d) => d.try_finish().is_ok(),
            Decode::RawDeflate(d) => d.try_finish().is_ok(),
        }
    }

    pub fn get_ref(&self) -> &W {
        match self {
            Decode::Identity(w) | Decode::Unreadable(w) => w,
            Decode::Gzip(d) => d.get_ref(),
            Decode::Brotli(d) => d.get_ref(),
            Decode::Zstd(d) => d.get_ref(),
            Decode::Zlib(d) => d.get_ref(),
            Decode::RawDeflate(d) => d.get_ref(),
            Decode::DeflateSniff(_, w) => w,
        }
    }

    pub fn get_mut(&mut self) -> &mut W {
        match self {
            Decode::Identity(w) | Decode::Unreadable(w) => w,
            Decode::Gzip(d) => d.get_mut(),
            Decode::Brotli(d) => d.get_mut(),
            Decode::Zstd(d) => d.get_mut(),
            Decode::Zlib(d) => d.get_mut(),
            Decode::RawDeflate(d) => d.get_mut(),
            Decode::DeflateSniff(_, w) => w,
        }
    }

    /// Two bytes of a `deflate` body are in: pick zlib or raw and replay them.
    fn sniffed(&mut self) -> bool {
        let stand = Decode::Unreadable(self.get_ref().stand_in());
        let Decode::DeflateSniff(head, w) = std::mem::replace(self, stand) else {
            return false;
        };
        // RFC 1950: CM = 8 and the header checksum holds.
        let zlib = head[0] & 0x0f == 8 && (u16::from(head[0]) << 8 | u16::from(head[1])) % 31 == 0;
        if zlib {
            let mut d = Box::new(flate2::write::ZlibDecoder::new(w));
            let ok = d.write_all(&head).is_ok();
            *self = Decode::Zlib(d);
            ok
        } else {
            let mut d = Box::new(flate2::write::DeflateDecoder::new(w));
            let ok = d.write_all(&head).is_ok();
            *self = Decode::RawDeflate(d);
            ok
        }
    }
}

/// Most decoded bytes one upstream chunk may turn into for the client; a
/// chunk that decodes to more (a decompression bomb) breaks the body.
pub const MAX_DECODED_CHUNK: usize = 64 << 20;

/// A compressed response body decoded for the client: each upstream chunk
/// in, its decoded bytes out. For an injected stream that the upstream
/// compressed though asked not to (the option's additions must come out,
/// SPEC §2); the client then gets it uncompressed.
pub struct BodyDecoder(Decode<Collect>);

/// Decoded bytes waiting to leave, capped per chunk.
#[derive(Default)]
pub struct Collect(Vec<u8>);

impl Write for Collect {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_DECODED_CHUNK {
            return Err(std::io::Error::other("decoded chunk over the cap"));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl StandIn for Collect {
    fn stand_in(&self) -> Self {
        Collect::default()
    }
}

/// The upstream's compressed body could not be decoded.
#[derive(Debug)]
pub struct BrokenBody;

impl std::fmt::Display for BrokenBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("upstream response body is not valid in its content coding")
    }
}
impl std::error::Error for BrokenBody {}

impl BodyDecoder {
    /// A decoder for a content coding other than identity that tidemark
    /// reads; `None` otherwise.
    pub fn new(content_encoding: &str) -> Option<BodyDecoder> {
        match Decode::new(Some(content_encoding), Collect::default()) {
            Decode::Identity(_) | Decode::Unreadable(_) => None,
            d => Some(BodyDecoder(d)),
        }
    }

    /// Decode the next chunk; its decoded bytes are appended to `out`.
    pub fn push(&mut self, chunk: &[u8], out: &mut Vec<u8>) -> Result<(), BrokenBody> {
        let ok = self.0.write(chunk);
        out.append(&mut self.0.get_mut().0);
        ok.then_some(()).ok_or(BrokenBody)
    }

    /// The body ended: the decoder's last bytes are appended to `out`;
    /// an error when the body was cut short.
    pub fn finish(&mut self, out: &mut Vec<u8>) -> Result<(), BrokenBody> {
        let ok = self.0.finish();
        out.append(&mut self.0.get_mut().0);
        ok.then_some(()).ok_or(BrokenBody)
    }
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
        let mut decode = Decode::new(content_encoding, sink);
        if !decode.readable() {
            // The body is forwarded; its usage is unknown.
            decode.get_mut().stop();
        }
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
        if chunk.is_empty() || self.decode.get_ref().stopped {
            return;
        }
        let ok = match &mut self.decode {
            Decode::Identity(s) => {
                s.take_frame(chunk, whole);
                true
            }
            d => d.write(chunk),
        };
        if !ok {
            self.decode.get_mut().stop();
        }
    }

    /// The body ended (or was cut): flush the decoder, parse what is pending.
    pub fn finish(&mut self) -> ReadOutcome {
        if !self.decode.get_ref().stopped {
            // Push out what the decoder holds. A body cut mid-stream fails
            // here; that is a short read, not a parse error, and what was
            // decoded still counts.
            let _ = self.decode.finish();
            self.decode.get_mut().finish();
        }
        let s = self.decode.get_mut();
        let out = ReadOutcome {
            observed: s.observed.clone(),
            parse_errors: s.parse_errors,
        };
        s.stopped = true;
        out
    }
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

impl StandIn for Sink {
    /// A stopped sink: it reads nothing until the decoder is back in shape.
    fn stand_in(&self) -> Self {
        Sink {
            p: self.p,
            frame: Frame::Json(Document::Empty),
            observed: Observed::default(),
            parse_errors: 0,
            decoded: 0,
            stopped: true,
        }
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
/// structure without building anything (see [`crate::json::pick`]).
fn parse_read(p: &dyn Provider, bytes: &[u8]) -> Option<Node> {
    crate::json::pick(bytes, p.reads())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::Api;

    #[test]
    fn a_json_body_reads_alike_held_whole_or_joined_from_pieces() {
        let body = include_bytes!("../../tests/fixtures/openai-chat/nonstream_basic.json");
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
        let body = include_bytes!("../../tests/fixtures/openai-chat/nonstream_basic.json");
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
