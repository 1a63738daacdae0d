//! HTTP/1.1 to the upstream, spoken by tidemark itself: the request written
//! in one go, the response head parsed with httparse, and the body decoded
//! straight out of the connection's read buffer by the task that forwards it.
//!
//! hyper's client hands each chunk of a response body from its connection
//! to the body through a channel that holds one chunk: every SSE event of a
//! burst cost a shared-buffer split, a channel send and receive, two waker
//! operations and a dispatcher poll, about a quarter of tidemark's CPU on a
//! 20-event stream. Here the chunked framing of everything that has arrived
//! is taken apart in one pass over the buffer and its payload copied out as
//! one piece; a body with a length is handed on without a copy.
//!
//! The rules are RFC 9112's, as strict as hyper's: CRLF line ends in the
//! chunked framing, one `Content-Length` (repeats must agree), a
//! `Transfer-Encoding` whose last coding is not `chunked` read to the close,
//! 1xx interim responses skipped, no body after HEAD, 204 or 304.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Version};
use http_body::Body;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::io::poll_read_buf;

use super::UpBody;

/// Largest response head (status line and headers) accepted.
const MAX_HEAD: usize = 256 * 1024;
/// Most response headers accepted (hyper's default is 100).
const MAX_HEADERS: usize = 128;
/// Largest trailer section of a chunked body.
const MAX_TRAILERS: usize = 64 * 1024;
/// Room made in the read buffer before each read.
const READ_ROOM: usize = 16 * 1024;

/// One HTTP/1.1 connection: the socket, the bytes read but not yet used,
/// and the request being written (its head, then body pieces), whose
/// buffers are kept for the connection's next request.
pub struct Conn<T> {
    io: T,
    buf: BytesMut,
    head: BytesMut,
    /// How much of `head` has been written.
    head_at: usize,
    queue: VecDeque<Bytes>,
}

fn bad(msg: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

impl<T: AsyncRead + AsyncWrite + Unpin> Conn<T> {
    pub fn new(io: T) -> Self {
        Conn {
            io,
            buf: BytesMut::new(),
            head: BytesMut::new(),
            head_at: 0,
            queue: VecDeque::new(),
        }
    }

    /// For a connection that sat idle: still open, with nothing unread (a
    /// close, an error or bytes nobody asked for all mean it is done).
    pub fn poll_idle_ok(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        self.buf.reserve(64);
        poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf).is_pending()
    }

    /// Read more into the buffer; `Ok(0)` at the close.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_ROOM / 4 {
            self.buf.reserve(READ_ROOM);
        }
        poll_read_buf(Pin::new(&mut self.io), cx, &mut self.buf)
    }

    /// The response head, parsed once it has all arrived. Interim (1xx)
    /// responses other than 101 are read past.
    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Head>> {
        loop {
            if !self.buf.is_empty() {
                match parse_head(&mut self.buf)? {
                    Some(h) if h.status.is_informational() && h.status.as_u16() != 101 => continue,
                    Some(h) => return Poll::Ready(Ok(h)),
                    None if self.buf.len() > MAX_HEAD => {
                        return Poll::Ready(Err(bad("response head too large")))
                    }
                    None => {}
                }
            }
            if ready!(self.poll_fill(cx))? == 0 {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "upstream closed before the response head",
                )));
            }
        }
    }
}

/// A parsed response head.
pub struct Head {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
}

/// The head at the front of `buf`, taken off it; `None` while incomplete.
fn parse_head(buf: &mut BytesMut) -> io::Result<Option<Head>> {
    // Header positions as offsets into the head, so that the values can be
    // slices of it rather than copies.
    let mut spans = [(0u32, 0u32, 0u32, 0u32); MAX_HEADERS];
    let (len, status, version, n) = {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        let len = match resp.parse(buf) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => return Err(bad("too many response headers")),
            Err(_) => return Err(bad("malformed response head")),
        };
        let base = buf.as_ptr() as usize;
        let n = resp.headers.len();
        for (span, h) in spans.iter_mut().zip(resp.headers.iter()) {
            let name = (h.name.as_ptr() as usize - base) as u32;
            let value = (h.value.as_ptr() as usize - base) as u32;
            *span = (
                name,
                name + h.name.len() as u32,
                value,
                value + h.value.len() as u32,
            );
        }
        let status = StatusCode::from_u16(resp.code.unwrap_or(0))
            .map_err(|_| bad("malformed response status"))?;
        let version = match resp.version {
            Some(0) => Version::HTTP_10,
            _ => Version::HTTP_11,
        };
        (len, status, version, n)
    };
    let head = buf.split_to(len).freeze();
    // Room for the headers the proxy adds (projection, warning, trim)
    // without the map growing.
    let mut headers = HeaderMap::with_capacity(n + 4);
    for &(ns, ne, vs, ve) in &spans[..n] {
        let (ns, ne, vs, ve) = (ns as usize, ne as usize, vs as usize, ve as usize);
        let name = HeaderName::from_bytes(&head[ns..ne]).map_err(|_| bad("bad header name"))?;
        let value = HeaderValue::from_maybe_shared(head.slice(vs..ve))
            .map_err(|_| bad("bad header value"))?;
        headers.append(name, value);
    }
    Ok(Some(Head {
        status,
        version,
        headers,
    }))
}

/// How a message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Empty,
    Length(u64),
    Chunked,
    /// Read to the close of the connection.
    Close,
}

/// The one `Content-Length` of `headers` (repeats must agree), if any.
fn content_length(headers: &HeaderMap) -> io::Result<Option<u64>> {
    let mut len = None;
    for v in headers.get_all(CONTENT_LENGTH) {
        add_content_length(&mut len, v.as_bytes())?;
    }
    Ok(len)
}

/// One `Content-Length` value (a list of lengths) into the length so far.
fn add_content_length(len: &mut Option<u64>, value: &[u8]) -> io::Result<()> {
    for t in value.split(|&b| b == b',') {
        let t = t.trim_ascii();
        if t.is_empty() || t.len() > 19 || !t.iter().all(u8::is_ascii_digit) {
            return Err(bad("malformed content-length"));
        }
        let n: u64 = t.iter().fold(0, |n, d| n * 10 + u64::from(d - b'0'));
        if len.is_some_and(|l| l != n) {
            return Err(bad("conflicting content-lengths"));
        }
        *len = Some(n);
    }
    Ok(())
}

/// Whether a comma-separated header value lists `token` (any case).
fn lists_token(value: &[u8], token: &str) -> bool {
    value
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// A response's framing (RFC 9112 §6.3) and whether the connection can
/// take another request once it has been read.
fn response_framing(request: &Method, head: &Head) -> io::Result<(Framing, bool)> {
    // One pass over the headers for all three framing headers, not a
    // lookup per header.
    let (mut close, mut keep_alive, mut transfer, mut lengths) = (false, false, None, false);
    let mut length = Ok(None);
    for (name, value) in &head.headers {
        if *name == CONNECTION {
            close |= lists_token(value.as_bytes(), "close");
            keep_alive |= lists_token(value.as_bytes(), "keep-alive");
        } else if *name == TRANSFER_ENCODING {
            transfer = Some(value);
        } else if *name == CONTENT_LENGTH {
            lengths = true;
            if let Ok(len) = &mut length {
                if let Err(e) = add_content_length(len, value.as_bytes()) {
                    length = Err(e);
                }
            }
        }
    }
    let mut reusable = match head.version {
        Version::HTTP_10 => keep_alive,
        _ => !close,
    };
    let s = head.status.as_u16();
    if *request == Method::HEAD || head.status.is_informational() || s == 204 || s == 304 {
        return Ok((Framing::Empty, reusable && s != 101));
    }
    if let Some(last) = transfer {
        let chunked = last
            .as_bytes()
            .rsplit(|&b| b == b',')
            .next()
            .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        // Both framings named: the length is ignored, and the connection,
        // whose next message's start is now in doubt, is not reused.
        reusable &= !lengths;
        return Ok(if chunked {
            (Framing::Chunked, reusable)
        } else {
            (Framing::Close, false)
        });
    }
    match length? {
        Some(0) => Ok((Framing::Empty, reusable)),
        Some(n) => Ok((Framing::Length(n), reusable)),
        None => Ok((Framing::Close, false)),
    }
}

/// The request head, origin form, with the framing header tidemark chose.
fn encode_head(parts: &http::request::Parts, framing: Framing, out: &mut BytesMut) {
    out.clear();
    out.reserve(256 + parts.headers.len() * 48);
    out.extend_from_slice(parts.method.as_str().as_bytes());
    out.extend_from_slice(b" ");
    out.extend_from_slice(
        parts
            .uri
            .path_and_query()
            .map_or("/", |pq| pq.as_str())
            .as_bytes(),
    );
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in &parts.headers {
        if name == CONTENT_LENGTH || name == TRANSFER_ENCODING {
            continue;
        }
        put_header(out, name.as_str(), value.as_bytes());
    }
    match framing {
        Framing::Length(n) => {
            // The digits of `n`, written backwards into a stack buffer.
            let (mut digits, mut at, mut n) = ([0u8; 20], 20, n);
            loop {
                at -= 1;
                digits[at] = b'0' + (n % 10) as u8;
                n /= 10;
                if n == 0 {
                    break;
                }
            }
            put_header(out, "content-length", &digits[at..]);
        }
        Framing::Chunked => put_header(out, "transfer-encoding", b"chunked"),
        Framing::Empty | Framing::Close => {}
    }
    out.extend_from_slice(b"\r\n");
}

fn put_header(out: &mut BytesMut, name: &str, value: &[u8]) {
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// The request's framing: its body's exact length when known, else the
/// length the client declared, else chunked.
fn request_framing(parts: &http::request::Parts, body: &UpBody) -> io::Result<Framing> {
    if body.is_end_stream() {
        let declared = parts.headers.contains_key(CONTENT_LENGTH);
        let carries = matches!(parts.method, Method::POST | Method::PUT | Method::PATCH);
        return Ok(if declared || carries {
            Framing::Length(0)
        } else {
            Framing::Empty
        });
    }
    if let Some(n) = body.size_hint().exact() {
        return Ok(Framing::Length(n));
    }
    Ok(match content_length(&parts.headers)? {
        Some(n) => Framing::Length(n),
        None => Framing::Chunked,
    })
}

/// What came of sending a request.
pub enum Sent {
    /// The connection had closed (or was not fit) before anything was
    /// written: the request, untouched, to send elsewhere.
    NotSent(Request<UpBody>),
    Response(Response),
}

/// A response head and the reader of its body.
pub struct Response {
    pub head: Head,
    pub body: Reader,
}

/// Writes `req` on `conn` (origin form, its headers as they are: the caller
/// sets `Host`) and reads the response head. `reused`: the connection served a request
/// before, so it is checked first and, if done, the request comes back.
pub async fn send<T: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut Conn<T>,
    req: Request<UpBody>,
    reused: bool,
) -> io::Result<Sent> {
    if reused && !std::future::poll_fn(|cx| Poll::Ready(conn.poll_idle_ok(cx))).await {
        return Ok(Sent::NotSent(req));
    }
    let (parts, mut body) = req.into_parts();
    let framing = request_framing(&parts, &body)?;
    let mut out = Out {
        chunked: framing == Framing::Chunked,
        left: match framing {
            Framing::Length(n) => n,
            _ => 0,
        },
        done: matches!(framing, Framing::Empty | Framing::Length(0)),
    };
    encode_head(&parts, framing, &mut conn.head);
    conn.head_at = 0;
    conn.queue.clear();
    let head = std::future::poll_fn(|cx| loop {
        {
            let Conn {
                io,
                head,
                head_at,
                queue,
                ..
            } = &mut *conn;
            out.fill(&mut body, queue, cx)?;
            if *head_at < head.len() || !queue.is_empty() {
                match poll_write_queue(io, cx, head, head_at, queue) {
                    Poll::Ready(Ok(())) => continue,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {}
                }
            }
        }
        // All written, the socket full, or the body waiting for its client:
        // the response may already be here (an early error reply).
        return conn.poll_head(cx);
    })
    .await?;
    let (framing, reusable) = response_framing(&parts.method, &head)?;
    // A reply that came before the whole request was written leaves the
    // connection mid-message.
    let written = conn.head_at == conn.head.len() && conn.queue.is_empty();
    let reusable = reusable && out.done && written;
    conn.queue.clear();
    Ok(Sent::Response(Response {
        head,
        body: Reader::new(framing, reusable),
    }))
}

/// How the request body is framed as it goes out.
struct Out {
    chunked: bool,
    /// Bytes a fixed-length body still owes.
    left: u64,
    done: bool,
}

impl Out {
    /// Queues what the request body has ready, framed.
    fn fill(
        &mut self,
        body: &mut UpBody,
        queue: &mut VecDeque<Bytes>,
        cx: &mut Context<'_>,
    ) -> io::Result<()> {
        while !self.done && queue.len() < 16 {
            match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) => {
                        if self.chunked {
                            queue.push_back(Bytes::from(format!("{:x}\r\n", data.len())));
                            queue.push_back(data);
                            queue.push_back(Bytes::from_static(b"\r\n"));
                        } else {
                            if data.len() as u64 > self.left {
                                return Err(bad("request body longer than its length"));
                            }
                            self.left -= data.len() as u64;
                            queue.push_back(data);
                            self.done = self.left == 0;
                        }
                    }
                    Err(frame) => {
                        // Trailers end the body; only chunked framing carries them.
                        if let (true, Ok(trailers)) = (self.chunked, frame.into_trailers()) {
                            let mut t = BytesMut::from(&b"0\r\n"[..]);
                            for (name, value) in &trailers {
                                put_header(&mut t, name.as_str(), value.as_bytes());
                            }
                            t.extend_from_slice(b"\r\n");
                            queue.push_back(t.freeze());
                            self.done = true;
                        }
                    }
                },
                Poll::Ready(Some(Err(e))) => return Err(io::Error::other(e)),
                Poll::Ready(None) => {
                    if self.chunked {
                        queue.push_back(Bytes::from_static(b"0\r\n\r\n"));
                    } else if self.left > 0 {
                        return Err(bad("request body shorter than its length"));
                    }
                    self.done = true;
                }
                Poll::Pending => break,
            }
        }
        Ok(())
    }
}

/// Writes the rest of `head`, then from the front of `queue`, until all is
/// written or the socket is full.
fn poll_write_queue<T: AsyncWrite + Unpin>(
    io: &mut T,
    cx: &mut Context<'_>,
    head: &[u8],
    head_at: &mut usize,
    queue: &mut VecDeque<Bytes>,
) -> Poll<io::Result<()>> {
    while *head_at < head.len() || !queue.is_empty() {
        let rest = &head[*head_at..];
        let n = if io.is_write_vectored() {
            let mut slices = [io::IoSlice::new(&[]); 32];
            slices[0] = io::IoSlice::new(rest);
            let mut k = 1;
            for (s, b) in slices[1..].iter_mut().zip(queue.iter()) {
                *s = io::IoSlice::new(b);
                k += 1;
            }
            ready!(Pin::new(&mut *io).poll_write_vectored(cx, &slices[..k]))?
        } else if queue.len() + usize::from(!rest.is_empty()) > 1
            && rest.len() + queue[0].len() < 16 * 1024
        {
            // One write (one TLS record) for the small pieces at the front;
            // the count below takes the head first, then the queue in order.
            let mut joined = BytesMut::from(rest);
            for b in queue.iter() {
                if joined.len() + b.len() > 64 * 1024 {
                    break;
                }
                joined.extend_from_slice(b);
            }
            ready!(Pin::new(&mut *io).poll_write(cx, &joined))?
        } else if !rest.is_empty() {
            ready!(Pin::new(&mut *io).poll_write(cx, rest))?
        } else {
            ready!(Pin::new(&mut *io).poll_write(cx, &queue[0]))?
        };
        if n == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        let from_head = n.min(rest.len());
        *head_at += from_head;
        let mut n = n - from_head;
        while n > 0 {
            let front = &mut queue[0];
            if n >= front.len() {
                n -= front.len();
                queue.pop_front();
            } else {
                front.advance(n);
                n = 0;
            }
        }
    }
    Poll::Ready(Ok(()))
}

/// Where the chunked decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Hex digits of a chunk size (`digits` so far).
    Size {
        size: u64,
        digits: u8,
    },
    /// A chunk extension, skipped to the line's end.
    Ext {
        size: u64,
    },
    SizeLf {
        size: u64,
    },
    Data {
        left: u64,
    },
    DataCr,
    DataLf,
    /// The trailer section after the last chunk.
    Trailers,
}

/// Reads one response body out of a connection's buffer.
pub struct Reader {
    framing: Framing,
    /// Fixed length: bytes still to come.
    left: u64,
    chunk: Chunk,
    trailers: BytesMut,
    reusable: bool,
    done: bool,
}

/// What one decoding pass ended with.
pub enum Decoded {
    /// The buffer is used up; more must be read.
    More,
    /// The body is complete, with its trailers if it had any.
    End(Option<HeaderMap>),
}

/// Where decoded payload goes: the first piece kept as it is, later ones
/// joined to it.
pub trait Sink {
    fn bytes(&mut self, b: Bytes);
    fn slice(&mut self, b: &[u8]);
    fn held(&self) -> usize;
    /// About `n` more bytes are coming through `slice`.
    fn reserve(&mut self, n: usize);
}

impl Reader {
    fn new(framing: Framing, reusable: bool) -> Self {
        Reader {
            framing,
            left: match framing {
                Framing::Length(n) => n,
                _ => 0,
            },
            chunk: Chunk::Size { size: 0, digits: 0 },
            trailers: BytesMut::new(),
            reusable,
            done: framing == Framing::Empty,
        }
    }

    /// True once the whole body has been decoded.
    pub fn done(&self) -> bool {
        self.done
    }

    /// The body bytes still to come, when its length is known.
    pub fn left(&self) -> Option<u64> {
        match self.framing {
            Framing::Empty => Some(0),
            Framing::Length(_) => Some(self.left),
            _ => None,
        }
    }

    /// Whether the connection may take another request after this body.
    pub fn reusable(&self) -> bool {
        self.reusable
    }

    /// Decodes from `conn`'s buffer into `sink` until the buffer is used up,
    /// the body ends, or `sink` holds `limit` bytes.
    pub fn decode<T>(
        &mut self,
        conn: &mut Conn<T>,
        sink: &mut dyn Sink,
        limit: usize,
    ) -> io::Result<Decoded> {
        let buf = &mut conn.buf;
        if self.done {
            return Ok(Decoded::End(None));
        }
        match self.framing {
            Framing::Empty => {
                self.done = true;
                Ok(Decoded::End(None))
            }
            Framing::Close => {
                if !buf.is_empty() {
                    sink.bytes(buf.split().freeze());
                }
                Ok(Decoded::More)
            }
            Framing::Length(_) => {
                let n = (buf.len() as u64).min(self.left) as usize;
                if n > 0 {
                    sink.bytes(buf.split_to(n).freeze());
                    self.left -= n as u64;
                }
                if self.left == 0 {
                    self.done = true;
                    return Ok(Decoded::End(None));
                }
                Ok(Decoded::More)
            }
            Framing::Chunked => self.decode_chunked(buf, sink, limit),
        }
    }

    fn decode_chunked(
        &mut self,
        buf: &mut BytesMut,
        sink: &mut dyn Sink,
        limit: usize,
    ) -> io::Result<Decoded> {
        // The payload of what is buffered, a little less than all of it.
        sink.reserve(buf.len().min(limit));
        let mut at = 0;
        let result = loop {
            if at == buf.len() || sink.held() >= limit {
                break Ok(Decoded::More);
            }
            let b = buf[at];
            self.chunk = match self.chunk {
                Chunk::Size { size, digits } => match b {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        if digits >= 15 {
                            break Err(bad("chunk size too large"));
                        }
                        let d = (b as char).to_digit(16).unwrap_or(0) as u64;
                        at += 1;
                        Chunk::Size {
                            size: size * 16 + d,
                            digits: digits + 1,
                        }
                    }
                    b';' | b' ' | b'\t' if digits > 0 => {
                        at += 1;
                        Chunk::Ext { size }
                    }
                    b'\r' if digits > 0 => {
                        at += 1;
                        Chunk::SizeLf { size }
                    }
                    _ => break Err(bad("malformed chunk size")),
                },
                Chunk::Ext { size } => {
                    // Skip to the CR; extensions carry nothing tidemark uses.
                    match memchr::memchr2(b'\r', b'\n', &buf[at..]) {
                        Some(i) if buf[at + i] == b'\r' => {
                            at += i + 1;
                            Chunk::SizeLf { size }
                        }
                        Some(_) => break Err(bad("bare LF in chunk extension")),
                        None => {
                            at = buf.len();
                            Chunk::Ext { size }
                        }
                    }
                }
                Chunk::SizeLf { size } => {
                    if b != b'\n' {
                        break Err(bad("malformed chunk size line"));
                    }
                    at += 1;
                    if size == 0 {
                        Chunk::Trailers
                    } else {
                        Chunk::Data { left: size }
                    }
                }
                Chunk::Data { left } => {
                    let n = ((buf.len() - at) as u64).min(left) as usize;
                    sink.slice(&buf[at..at + n]);
                    at += n;
                    if n as u64 == left {
                        Chunk::DataCr
                    } else {
                        Chunk::Data {
                            left: left - n as u64,
                        }
                    }
                }
                Chunk::DataCr => {
                    if b != b'\r' {
                        break Err(bad("chunk data longer than its size"));
                    }
                    at += 1;
                    Chunk::DataLf
                }
                Chunk::DataLf => {
                    if b != b'\n' {
                        break Err(bad("chunk data longer than its size"));
                    }
                    at += 1;
                    Chunk::Size { size: 0, digits: 0 }
                }
                Chunk::Trailers => {
                    // Lines up to an empty one; most bodies have none.
                    let t = &mut self.trailers;
                    let was = t.len();
                    t.extend_from_slice(&buf[at..]);
                    let end = if t.starts_with(b"\r\n") {
                        Some(2)
                    } else {
                        let from = was.saturating_sub(3);
                        memchr::memmem::find(&t[from..], b"\r\n\r\n").map(|i| from + i + 4)
                    };
                    let end = end.map(|end| {
                        t.truncate(end);
                        end - was
                    });
                    match end {
                        Some(used) => {
                            at += used;
                            self.done = true;
                            let trailers = std::mem::take(&mut self.trailers);
                            break parse_trailers(&trailers).map(Decoded::End);
                        }
                        None if self.trailers.len() > MAX_TRAILERS => {
                            break Err(bad("trailers too large"))
                        }
                        None => {
                            at = buf.len();
                            Chunk::Trailers
                        }
                    }
                }
            };
        };
        buf.advance(at);
        result
    }

    /// The connection has closed: the end of a body read to the close, else
    /// an error.
    pub fn at_close(&mut self) -> io::Result<()> {
        self.reusable = false;
        if self.framing == Framing::Close {
            self.done = true;
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "upstream closed mid-body",
        ))
    }
}

/// The trailer section (lines ending in an empty line) as headers; `None`
/// when there were none.
fn parse_trailers(section: &[u8]) -> io::Result<Option<HeaderMap>> {
    if section.len() <= 2 {
        return Ok(None);
    }
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    match httparse::parse_headers(section, &mut headers) {
        Ok(httparse::Status::Complete((_, hs))) => {
            let mut map = HeaderMap::with_capacity(hs.len());
            for h in hs {
                let name =
                    HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| bad("bad trailer"))?;
                let value = HeaderValue::from_bytes(h.value).map_err(|_| bad("bad trailer"))?;
                map.append(name, value);
            }
            Ok(Some(map))
        }
        _ => Err(bad("malformed trailers")),
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> Conn<T> {
    /// Reads more for a body; see [`Reader::at_close`] for `Ok(0)`.
    pub fn poll_body_read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        self.poll_fill(cx)
    }

    /// Nothing left over after a body: the next response will start clean.
    pub fn clean(&self) -> bool {
        self.buf.is_empty()
    }

    /// The socket, and what was read past the response head: after a
    /// `101`, the first bytes of the protocol switched to.
    pub fn into_parts(self) -> (T, BytesMut) {
        (self.io, self.buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Frame;
    use http_body_util::{BodyExt, Full, StreamBody};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[derive(Default)]
    struct Collect(Vec<u8>);
    impl Sink for Collect {
        fn bytes(&mut self, b: Bytes) {
            self.0.extend_from_slice(&b);
        }
        fn slice(&mut self, b: &[u8]) {
            self.0.extend_from_slice(b);
        }
        fn held(&self) -> usize {
            self.0.len()
        }
        fn reserve(&mut self, n: usize) {
            self.0.reserve(n);
        }
    }

    /// Feeds `wire` to a chunked reader in pieces of `step` bytes: the
    /// payload, the trailers, and what was left in the buffer.
    fn decode_in_steps(
        wire: &[u8],
        step: usize,
    ) -> io::Result<(Vec<u8>, Option<HeaderMap>, Vec<u8>)> {
        let mut conn = Conn {
            io: (),
            buf: BytesMut::new(),
            head: BytesMut::new(),
            head_at: 0,
            queue: VecDeque::new(),
        };
        let mut reader = Reader::new(Framing::Chunked, true);
        let mut out = Collect::default();
        for piece in wire.chunks(step) {
            conn.buf.extend_from_slice(piece);
            if let Decoded::End(t) = reader.decode(&mut conn, &mut out, usize::MAX)? {
                return Ok((out.0, t, conn.buf.to_vec()));
            }
        }
        Err(io::ErrorKind::UnexpectedEof.into())
    }

    #[test]
    fn chunked_bodies_decode_the_same_however_they_arrive() {
        let wire = b"5\r\nhello\r\n1;name=\"v\"\r\n \r\nA\r\n0123456789\r\n0\r\nx-checksum: abc\r\nx-more: 1\r\n\r\nNEXT";
        for step in 1..wire.len() + 1 {
            let (body, trailers, rest) = decode_in_steps(wire, step).unwrap();
            assert_eq!(body, b"hello 0123456789", "step {step}");
            let t = trailers.expect("trailers");
            assert_eq!(t["x-checksum"], "abc");
            assert_eq!(t["x-more"], "1");
            // Only what belongs to the body is taken off the buffer.
            let end = wire.len() - 4;
            let fed = end.div_ceil(step) * step;
            let expect_rest = &wire[end..fed.min(wire.len())];
            assert_eq!(rest, expect_rest, "step {step}");
        }
        let plain = b"3\r\nabc\r\n0\r\n\r\n";
        for step in 1..plain.len() + 1 {
            let (body, trailers, rest) = decode_in_steps(plain, step).unwrap();
            assert_eq!((body.as_slice(), trailers.is_none()), (&b"abc"[..], true));
            assert!(rest.is_empty());
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]
        /// Any payload, cut into any chunks (hex in either case, with or
        /// without extensions), with or without trailers, fed in any
        /// pieces: the same payload and trailers come out, and nothing
        /// after the body is taken.
        #[test]
        fn any_chunked_body_in_any_pieces_decodes_to_its_payload(
            payload in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..3000),
            cuts in proptest::collection::vec(1usize..700, 0..12),
            upper in proptest::prelude::any::<bool>(),
            ext in proptest::prelude::any::<bool>(),
            trailer in proptest::prelude::any::<bool>(),
            step in 1usize..400,
        ) {
            let mut wire = Vec::new();
            let mut rest = &payload[..];
            let mut cuts = cuts.into_iter();
            while !rest.is_empty() {
                let n = cuts.next().unwrap_or(rest.len()).min(rest.len());
                let size = if upper { format!("{n:X}") } else { format!("{n:x}") };
                wire.extend_from_slice(size.as_bytes());
                if ext {
                    wire.extend_from_slice(b";a=b");
                }
                wire.extend_from_slice(b"\r\n");
                wire.extend_from_slice(&rest[..n]);
                wire.extend_from_slice(b"\r\n");
                rest = &rest[n..];
            }
            wire.extend_from_slice(b"0\r\n");
            if trailer {
                wire.extend_from_slice(b"x-t: 1\r\n");
            }
            wire.extend_from_slice(b"\r\nHTTP/1.1 200 OK\r\n");
            let (body, trailers, left) = decode_in_steps(&wire, step).unwrap();
            proptest::prop_assert_eq!(body, payload);
            proptest::prop_assert_eq!(trailers.is_some(), trailer);
            proptest::prop_assert!(b"HTTP/1.1 200 OK\r\n".starts_with(&left));
        }
    }

    #[test]
    fn malformed_chunked_framing_is_an_error() {
        for wire in [
            &b"zz\r\nab\r\n0\r\n\r\n"[..],
            b"\r\n",
            b"2\nab\r\n0\r\n\r\n",
            b"2\r\nabc\r\n0\r\n\r\n",
            b"2\r\nab\n0\r\n\r\n",
            b"1000000000000000\r\n",
            b"2;ext\nab\r\n0\r\n\r\n",
            b"0\r\nnot a header line\r\n\r\n",
        ] {
            assert!(decode_in_steps(wire, wire.len()).is_err(), "{wire:?}");
        }
    }

    fn head(status: u16, version: Version, headers: &[(&str, &str)]) -> Head {
        let mut map = HeaderMap::new();
        for (n, v) in headers {
            map.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        Head {
            status: StatusCode::from_u16(status).unwrap(),
            version,
            headers: map,
        }
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        use Framing::*;
        let v11 = Version::HTTP_11;
        type Case = (
            Method,
            u16,
            Version,
            &'static [(&'static str, &'static str)],
            Option<(Framing, bool)>,
        );
        let cases: &[Case] = &[
            (
                Method::POST,
                200,
                v11,
                &[("content-length", "12")],
                Some((Length(12), true)),
            ),
            (
                Method::POST,
                200,
                v11,
                &[("content-length", "12, 12")],
                Some((Length(12), true)),
            ),
            (
                Method::POST,
                200,
                v11,
                &[("content-length", "12"), ("content-length", "13")],
                None,
            ),
            (Method::POST, 200, v11, &[("content-length", "-1")], None),
            (
                Method::POST,
                200,
                v11,
                &[("content-length", "0")],
                Some((Empty, true)),
            ),
            (
                Method::POST,
                200,
                v11,
                &[("transfer-encoding", "chunked")],
                Some((Chunked, true)),
            ),
            (
                Method::POST,
                200,
                v11,
                &[("transfer-encoding", "gzip, Chunked")],
                Some((Chunked, true)),
            ),
            (
                Method::POST,
                200,
                v11,
                &[("transfer-encoding", "chunked"), ("content-length", "3")],
                Some((Chunked, false)),
            ),
            (
                Method::POST,
                200,
                v11,
                &[("transfer-encoding", "chunked, gzip")],
                Some((Close, false)),
            ),
            (Method::POST, 200, v11, &[], Some((Close, false))),
            (
                Method::POST,
                200,
                v11,
                &[("content-length", "5"), ("connection", "keep-alive, Close")],
                Some((Length(5), false)),
            ),
            (
                Method::POST,
                200,
                Version::HTTP_10,
                &[("content-length", "5")],
                Some((Length(5), false)),
            ),
            (
                Method::POST,
                200,
                Version::HTTP_10,
                &[("content-length", "5"), ("connection", "keep-alive")],
                Some((Length(5), true)),
            ),
            (
                Method::HEAD,
                200,
                v11,
                &[("content-length", "99")],
                Some((Empty, true)),
            ),
            (Method::GET, 204, v11, &[], Some((Empty, true))),
            (
                Method::GET,
                304,
                v11,
                &[("content-length", "99")],
                Some((Empty, true)),
            ),
            (Method::GET, 101, v11, &[], Some((Empty, false))),
        ];
        for (method, status, version, headers, want) in cases {
            let got = response_framing(method, &head(*status, *version, headers)).ok();
            assert_eq!(got, *want, "{method} {status} {headers:?}");
        }
    }

    fn body_of(b: &'static [u8]) -> UpBody {
        Full::new(Bytes::from_static(b))
            .map_err(|e| match e {})
            .boxed_unsync()
    }

    fn streamed(pieces: &[&'static [u8]]) -> UpBody {
        let frames: Vec<Result<Frame<Bytes>, hyper::Error>> = pieces
            .iter()
            .map(|p| Ok(Frame::data(Bytes::from_static(p))))
            .collect();
        StreamBody::new(futures_util::stream::iter(frames)).boxed_unsync()
    }

    /// Sends `req` to a peer that reads up to the end of what `req` should
    /// put on the wire (`until`), then answers `reply`: what the peer read,
    /// the response status and body, and whether the connection is reusable.
    async fn exchange(
        req: Request<UpBody>,
        until: &'static [u8],
        reply: &'static [u8],
    ) -> (Vec<u8>, u16, Vec<u8>, bool) {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let peer = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut b = [0u8; 1024];
            while !got.ends_with(until) {
                let n = theirs.read(&mut b).await.unwrap();
                assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&b[..n]);
            }
            // The reply a byte at a time: the head parser sees every split.
            for byte in reply {
                theirs.write_all(&[*byte]).await.unwrap();
            }
            // Closing ends a body read to the close.
            got
        });
        let mut conn = Conn::new(ours);
        let Sent::Response(resp) = send(&mut conn, req, false).await.unwrap() else {
            panic!("not sent")
        };
        let mut reader = resp.body;
        let mut body = Collect::default();
        loop {
            if let Decoded::End(_) = reader.decode(&mut conn, &mut body, usize::MAX).unwrap() {
                break;
            }
            let n = std::future::poll_fn(|cx| conn.poll_body_read(cx))
                .await
                .unwrap();
            if n == 0 {
                reader.at_close().unwrap();
                break;
            }
        }
        let got = peer.await.unwrap();
        (
            got,
            resp.head.status.as_u16(),
            body.0,
            reader.reusable() && conn.clean(),
        )
    }

    fn request(
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: UpBody,
    ) -> Request<UpBody> {
        let mut req = Request::new(body);
        *req.method_mut() = method;
        *req.uri_mut() = path.parse().unwrap();
        for (n, v) in headers {
            req.headers_mut().append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        req
    }

    #[tokio::test]
    async fn requests_are_framed_by_what_their_body_is() {
        // A whole body: its length, replacing the client's framing headers.
        let (wire, status, body, reuse) = exchange(
            request(Method::POST, "/v1/chat/completions?x=1", &[("host", "up"), ("transfer-encoding", "chunked"), ("x-k", "v")], body_of(b"{}")),
            b"{}",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Ratelimit-Remaining: 9\r\n\r\nok",
        )
        .await;
        assert_eq!(
            String::from_utf8(wire).unwrap(),
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: up\r\nx-k: v\r\ncontent-length: 2\r\n\r\n{}"
        );
        assert_eq!((status, body.as_slice(), reuse), (200, &b"ok"[..], true));

        // A body of unknown length: chunked, ended by the last chunk.
        let (wire, _, body, reuse) = exchange(
            request(
                Method::POST,
                "/p",
                &[("host", "up")],
                streamed(&[b"ab", b"", b"cde"]),
            ),
            b"0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nxyz\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(
            String::from_utf8(wire).unwrap(),
            "POST /p HTTP/1.1\r\nhost: up\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n3\r\ncde\r\n0\r\n\r\n"
        );
        assert_eq!((body.as_slice(), reuse), (&b"xyz"[..], true));

        // A streamed body with a declared length keeps it.
        let (wire, _, _, _) = exchange(
            request(
                Method::PUT,
                "/p",
                &[("host", "up"), ("content-length", "5")],
                streamed(&[b"ab", b"cde"]),
            ),
            b"abcde",
            b"HTTP/1.1 204 No Content\r\n\r\n",
        )
        .await;
        assert!(String::from_utf8(wire)
            .unwrap()
            .ends_with("content-length: 5\r\n\r\nabcde"));

        // No body: GET says nothing, POST says its length is 0.
        let (wire, _, _, _) = exchange(
            request(Method::GET, "/m", &[("host", "up")], body_of(b"")),
            b"\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        )
        .await;
        assert_eq!(
            String::from_utf8(wire).unwrap(),
            "GET /m HTTP/1.1\r\nhost: up\r\n\r\n"
        );
        let (wire, _, _, _) = exchange(
            request(Method::POST, "/m", &[("host", "up")], body_of(b"")),
            b"\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        )
        .await;
        assert!(String::from_utf8(wire)
            .unwrap()
            .ends_with("content-length: 0\r\n\r\n"));

        // Read to the close: the body is everything, the connection is done.
        let (_, _, body, reuse) = exchange(
            request(Method::GET, "/m", &[("host", "up")], body_of(b"")),
            b"\r\n\r\n",
            b"HTTP/1.1 200 OK\r\n\r\nall of it",
        )
        .await;
        assert_eq!((body.as_slice(), reuse), (&b"all of it"[..], false));
    }

    /// The upstream answers before it has read the request body (here a
    /// 413 to a body too big for the pipe): the answer is returned, and the
    /// connection, left mid-request, is not reused.
    #[tokio::test]
    async fn an_early_reply_is_read_while_the_request_is_still_going_out() {
        let (ours, mut theirs) = tokio::io::duplex(256);
        let big: &'static [u8] = Box::leak(vec![b'x'; 1 << 20].into_boxed_slice());
        let peer = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut b = [0u8; 64];
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = theirs.read(&mut b).await.unwrap();
                got.extend_from_slice(&b[..n]);
            }
            theirs
                .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig")
                .await
                .unwrap();
            theirs
        });
        let mut conn = Conn::new(ours);
        let req = request(Method::POST, "/p", &[("host", "up")], body_of(big));
        let sent = tokio::time::timeout(Duration::from_secs(10), send(&mut conn, req, false))
            .await
            .expect("the reply was not read while writing");
        let Sent::Response(resp) = sent.unwrap() else {
            panic!("not sent")
        };
        assert_eq!(resp.head.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(!resp.body.reusable());
        drop(peer);
    }

    /// A reused connection the server closed while it sat idle gives the
    /// request back untouched instead of writing it.
    #[tokio::test]
    async fn a_closed_idle_connection_hands_the_request_back() {
        let (ours, theirs) = tokio::io::duplex(1024);
        drop(theirs);
        let mut conn = Conn::new(ours);
        let req = request(Method::POST, "/p", &[("host", "up")], body_of(b"{}"));
        match send(&mut conn, req, true).await.unwrap() {
            Sent::NotSent(back) => {
                let body = back.into_body().collect().await.unwrap().to_bytes();
                assert_eq!(&body[..], b"{}");
            }
            Sent::Response(_) => panic!("a response from a closed connection"),
        }
    }

    use std::time::Duration;
}
