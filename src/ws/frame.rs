//! RFC 6455 frames: the header parsed as its bytes arrive, masking that
//! resumes mid-payload, frame encoding, and a reader that turns a byte
//! stream into whole messages without ever holding one past its cap.

use bytes::{Bytes, BytesMut};

use super::deflate::Inflater;

/// A frame's opcode (RFC 6455 §5.2). The reserved values are errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opcode {
    Continuation,
    Text,
    Binary,
    Close,
    Ping,
    Pong,
}

impl Opcode {
    /// The opcode of a frame's low nibble; `None` for the reserved ones.
    pub fn from_u8(b: u8) -> Option<Opcode> {
        Some(match b {
            0x0 => Opcode::Continuation,
            0x1 => Opcode::Text,
            0x2 => Opcode::Binary,
            0x8 => Opcode::Close,
            0x9 => Opcode::Ping,
            0xA => Opcode::Pong,
            _ => return None,
        })
    }

    pub fn as_u8(self) -> u8 {
        match self {
            Opcode::Continuation => 0x0,
            Opcode::Text => 0x1,
            Opcode::Binary => 0x2,
            Opcode::Close => 0x8,
            Opcode::Ping => 0x9,
            Opcode::Pong => 0xA,
        }
    }

    /// Close, ping and pong: never fragmented, at most 125 bytes.
    pub fn is_control(self) -> bool {
        matches!(self, Opcode::Close | Opcode::Ping | Opcode::Pong)
    }
}

/// Largest payload a control frame may carry.
pub const MAX_CONTROL_PAYLOAD: u64 = 125;

/// Longest frame header: 2 bytes, 8 of extended length, 4 of mask.
pub const MAX_HEADER: usize = 14;

/// Why bytes are not a valid frame sequence. Each names the rule broken;
/// a proxy that sees one stops reading that direction and lets the bytes
/// through as they are (the endpoints judge their own protocol).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// Opcodes 0x3-0x7 and 0xB-0xF.
    ReservedOpcode(u8),
    /// A control frame without FIN.
    FragmentedControl,
    /// A control frame over 125 bytes.
    ControlTooLong(u64),
    /// A 64-bit length with its most significant bit set.
    LengthOverflow,
    /// A continuation frame with no message begun.
    UnexpectedContinuation,
    /// A text or binary frame while a fragmented message is unfinished.
    MessageInterrupted,
    /// RSV1 where it means nothing: without permessage-deflate, on a
    /// continuation or on a control frame (RFC 7692 §6); RSV2 or RSV3 at all.
    ReservedBits,
    /// A compressed message that does not inflate.
    Inflate,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::ReservedOpcode(o) => write!(f, "reserved opcode {o:#x}"),
            FrameError::FragmentedControl => f.write_str("fragmented control frame"),
            FrameError::ControlTooLong(n) => write!(f, "control frame of {n} bytes"),
            FrameError::LengthOverflow => f.write_str("frame length over 2^63"),
            FrameError::UnexpectedContinuation => f.write_str("continuation without a message"),
            FrameError::MessageInterrupted => f.write_str("new message inside a fragmented one"),
            FrameError::ReservedBits => f.write_str("reserved bits set"),
            FrameError::Inflate => f.write_str("compressed message does not inflate"),
        }
    }
}

impl std::error::Error for FrameError {}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub fin: bool,
    /// With permessage-deflate: the message (whose first frame this is) is compressed.
    pub rsv1: bool,
    pub rsv2: bool,
    pub rsv3: bool,
    pub opcode: Opcode,
    /// The masking key; every client-to-server frame has one.
    pub mask: Option<[u8; 4]>,
    /// Payload length.
    pub len: u64,
    /// Bytes the header itself took (2 to 14).
    pub header_len: usize,
}

/// Parse the frame header at the start of `buf`. `Ok(None)`: not all of it
/// has arrived. Checks what the header alone can tell: reserved opcodes,
/// fragmented or oversized control frames, a length past 2^63.
pub fn parse_header(buf: &[u8]) -> Result<Option<Header>, FrameError> {
    let [b0, b1, ..] = *buf else {
        return Ok(None);
    };
    let opcode = Opcode::from_u8(b0 & 0x0F).ok_or(FrameError::ReservedOpcode(b0 & 0x0F))?;
    let fin = b0 & 0x80 != 0;
    let masked = b1 & 0x80 != 0;
    let (len, mut at) = match b1 & 0x7F {
        126 => match buf.get(2..4) {
            Some(b) => (u64::from(u16::from_be_bytes([b[0], b[1]])), 4),
            None => return Ok(None),
        },
        127 => match buf.get(2..10) {
            Some(b) => {
                let mut n = [0u8; 8];
                n.copy_from_slice(b);
                let n = u64::from_be_bytes(n);
                if n >> 63 != 0 {
                    return Err(FrameError::LengthOverflow);
                }
                (n, 10)
            }
            None => return Ok(None),
        },
        n => (u64::from(n), 2),
    };
    if opcode.is_control() {
        if !fin {
            return Err(FrameError::FragmentedControl);
        }
        if len > MAX_CONTROL_PAYLOAD {
            return Err(FrameError::ControlTooLong(len));
        }
    }
    let mask = if masked {
        let Some(m) = buf.get(at..at + 4) else {
            return Ok(None);
        };
        at += 4;
        Some([m[0], m[1], m[2], m[3]])
    } else {
        None
    };
    Ok(Some(Header {
        fin,
        rsv1: b0 & 0x40 != 0,
        rsv2: b0 & 0x20 != 0,
        rsv3: b0 & 0x10 != 0,
        opcode,
        mask,
        len,
        header_len: at,
    }))
}

/// XOR `data` with `mask`, `data` being the payload's bytes from `offset`
/// on: a payload that arrives in pieces is unmasked piece by piece, each
/// with the offset it starts at. Masking and unmasking are the same.
pub fn apply_mask(mask: [u8; 4], offset: u64, data: &mut [u8]) {
    let mut key = mask;
    key.rotate_left((offset % 4) as usize);
    // Eight bytes a step: the key repeats every four, so twice over is a
    // word that lines up with every eight-byte step.
    let word = u64::from_ne_bytes([
        key[0], key[1], key[2], key[3], key[0], key[1], key[2], key[3],
    ]);
    let mut chunks = data.chunks_exact_mut(8);
    for c in &mut chunks {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        c.copy_from_slice(&(u64::from_ne_bytes(w) ^ word).to_ne_bytes());
    }
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b ^= key[i % 4];
    }
}

/// Append a frame header to `out`.
pub fn encode_header(
    out: &mut BytesMut,
    fin: bool,
    rsv1: bool,
    opcode: Opcode,
    mask: Option<[u8; 4]>,
    len: u64,
) {
    let b0 = (u8::from(fin) << 7) | (u8::from(rsv1) << 6) | opcode.as_u8();
    let m = if mask.is_some() { 0x80 } else { 0 };
    out.reserve(MAX_HEADER);
    out.extend_from_slice(&[b0]);
    if len < 126 {
        out.extend_from_slice(&[m | len as u8]);
    } else if len <= u64::from(u16::MAX) {
        out.extend_from_slice(&[m | 126]);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.extend_from_slice(&[m | 127]);
        out.extend_from_slice(&len.to_be_bytes());
    }
    if let Some(k) = mask {
        out.extend_from_slice(&k);
    }
}

/// Append a whole frame to `out`: its header, then `payload`, masked with
/// `mask` when given (a client's frames), as it is otherwise (a server's).
/// `rsv1`: the payload is a permessage-deflate message (first frame only).
pub fn encode_frame(
    out: &mut BytesMut,
    fin: bool,
    rsv1: bool,
    opcode: Opcode,
    mask: Option<[u8; 4]>,
    payload: &[u8],
) {
    encode_header(out, fin, rsv1, opcode, mask, payload.len() as u64);
    let start = out.len();
    out.extend_from_slice(payload);
    if let Some(k) = mask {
        apply_mask(k, 0, &mut out[start..]);
    }
}

/// A close frame's payload: the status code, then the UTF-8 reason.
pub fn close_payload(code: u16, reason: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(2 + reason.len());
    p.extend_from_slice(&code.to_be_bytes());
    p.extend_from_slice(reason.as_bytes());
    p
}

/// A data message's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Text,
    Binary,
}

/// What a [`MessageReader`] yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A whole data message, its fragments joined, unmasked and, if it came
    /// compressed, inflated. `compressed`: it had RSV1 on the wire.
    Message {
        kind: Kind,
        compressed: bool,
        payload: Bytes,
    },
    /// A data message past the reader's cap, stepped over without being
    /// held: `len` is its size on the wire (compressed, if it was).
    TooLarge {
        kind: Kind,
        compressed: bool,
        len: u64,
    },
    /// A control frame, unmasked.
    Control { opcode: Opcode, payload: Bytes },
}

/// Where a reader is in the current frame.
#[derive(Debug)]
enum At {
    /// Gathering a header's bytes.
    Header,
    /// Inside a payload: its header, and how much of it has been read.
    Payload { h: Header, read: u64 },
}

/// The data message being gathered.
#[derive(Debug)]
struct Gathering {
    kind: Kind,
    compressed: bool,
    /// The payload so far (inflated, if compressed); dropped once the
    /// message is past the cap.
    payload: Option<BytesMut>,
    /// Bytes of it on the wire so far.
    wire: u64,
}

/// Reads one direction of a WebSocket connection: bytes in as they arrive,
/// whole messages out. Messages up to `cap` bytes (after inflation) are
/// yielded whole; larger ones are stepped over as they pass, never held,
/// and reported by size. Control frames in the middle of a fragmented
/// message come out as they arrive.
///
/// [`feed`](Self::feed) stops after each frame that completes something, so
/// a caller that forwards the same bytes knows exactly where each frame and
/// each message ends in them.
#[derive(Debug)]
pub struct MessageReader {
    cap: usize,
    at: At,
    /// A header's bytes while it is incomplete (at most 14).
    head: Vec<u8>,
    msg: Option<Gathering>,
    /// The control frame being gathered.
    control: BytesMut,
    inflater: Option<Inflater>,
}

impl MessageReader {
    /// A reader for messages up to `cap` bytes. `inflater`: this
    /// direction's permessage-deflate state when the extension was agreed
    /// (a compressed message without one is an error).
    pub fn new(cap: usize, inflater: Option<Inflater>) -> Self {
        MessageReader {
            cap,
            at: At::Header,
            head: Vec::with_capacity(MAX_HEADER),
            msg: None,
            control: BytesMut::new(),
            inflater,
        }
    }

    /// True between frames (no header or payload half-read).
    pub fn at_frame_boundary(&self) -> bool {
        matches!(self.at, At::Header) && self.head.is_empty()
    }

    /// True between messages: at a frame boundary with no fragmented data
    /// message unfinished. A frame injected here splits nothing.
    pub fn at_message_boundary(&self) -> bool {
        self.at_frame_boundary() && self.msg.is_none()
    }

    /// Read from `data` until a frame completes a message, a control frame
    /// or a stepped-over message, or `data` runs out. Returns the bytes
    /// used (a prefix of `data`) and what completed, if anything: call
    /// again with the rest.
    pub fn feed(&mut self, data: &[u8]) -> Result<(usize, Option<Event>), FrameError> {
        let mut used = 0;
        loop {
            match &mut self.at {
                At::Header => {
                    let h = if self.head.is_empty() {
                        match parse_header(&data[used..])? {
                            Some(h) => {
                                used += h.header_len;
                                h
                            }
                            None => {
                                self.head.extend_from_slice(&data[used..]);
                                return Ok((data.len(), None));
                            }
                        }
                    } else {
                        // A header split across reads: its bytes one at a
                        // time into `head` until it parses (at most 14).
                        loop {
                            if let Some(h) = parse_header(&self.head)? {
                                self.head.clear();
                                break h;
                            }
                            match data.get(used) {
                                Some(&b) => {
                                    self.head.push(b);
                                    used += 1;
                                }
                                None => return Ok((used, None)),
                            }
                        }
                    };
                    self.begin(h)?;
                    self.at = At::Payload { h, read: 0 };
                    // An empty payload completes at once.
                }
                At::Payload { h, read } => {
                    let h = *h;
                    let take = ((h.len - *read).min((data.len() - used) as u64)) as usize;
                    let offset = *read;
                    *read += take as u64;
                    let done = *read == h.len;
                    let piece = &data[used..used + take];
                    used += take;
                    self.payload(&h, offset, piece)?;
                    if !done {
                        return Ok((used, None));
                    }
                    self.at = At::Header;
                    if let Some(ev) = self.end(&h)? {
                        return Ok((used, Some(ev)));
                    }
                }
            }
            if used == data.len() && !matches!(self.at, At::Payload { h, read } if h.len == read) {
                return Ok((used, None));
            }
        }
    }

    /// A frame's header has been read: check it against the message state.
    fn begin(&mut self, h: Header) -> Result<(), FrameError> {
        if h.rsv2 || h.rsv3 {
            return Err(FrameError::ReservedBits);
        }
        if h.opcode.is_control() {
            if h.rsv1 {
                return Err(FrameError::ReservedBits);
            }
            self.control.clear();
            return Ok(());
        }
        let kind = match h.opcode {
            Opcode::Continuation => {
                if self.msg.is_none() {
                    return Err(FrameError::UnexpectedContinuation);
                }
                if h.rsv1 {
                    return Err(FrameError::ReservedBits);
                }
                return Ok(());
            }
            Opcode::Text => Kind::Text,
            _ => Kind::Binary,
        };
        if self.msg.is_some() {
            return Err(FrameError::MessageInterrupted);
        }
        if h.rsv1 && self.inflater.is_none() {
            return Err(FrameError::ReservedBits);
        }
        self.msg = Some(Gathering {
            kind,
            compressed: h.rsv1,
            payload: Some(BytesMut::new()),
            wire: 0,
        });
        Ok(())
    }

    /// A piece of a frame's payload, from `offset` in it.
    fn payload(&mut self, h: &Header, offset: u64, piece: &[u8]) -> Result<(), FrameError> {
        if piece.is_empty() {
            return Ok(());
        }
        let owned;
        let plain: &[u8] = match h.mask {
            Some(k) => {
                let mut v = piece.to_vec();
                apply_mask(k, offset, &mut v);
                owned = v;
                &owned
            }
            None => piece,
        };
        if h.opcode.is_control() {
            self.control.extend_from_slice(plain);
            return Ok(());
        }
        let Some(msg) = self.msg.as_mut() else {
            return Ok(());
        };
        msg.wire += plain.len() as u64;
        if msg.compressed {
            let inflater = self.inflater.as_mut().ok_or(FrameError::Inflate)?;
            let cap = self.cap;
            let out = &mut msg.payload;
            inflater
                .inflate(plain, &mut |b: &[u8]| keep(out, b, cap))
                .map_err(|_| FrameError::Inflate)?;
        } else {
            keep(&mut msg.payload, plain, self.cap);
        }
        Ok(())
    }

    /// A frame's payload is complete: what it completed, if anything.
    fn end(&mut self, h: &Header) -> Result<Option<Event>, FrameError> {
        if h.opcode.is_control() {
            return Ok(Some(Event::Control {
                opcode: h.opcode,
                payload: self.control.split().freeze(),
            }));
        }
        if !h.fin {
            return Ok(None);
        }
        let Some(mut msg) = self.msg.take() else {
            return Ok(None);
        };
        if msg.compressed {
            if let Some(inflater) = self.inflater.as_mut() {
                let cap = self.cap;
                let out = &mut msg.payload;
                inflater
                    .finish(&mut |b: &[u8]| keep(out, b, cap))
                    .map_err(|_| FrameError::Inflate)?;
            }
        }
        Ok(Some(match msg.payload {
            Some(p) => Event::Message {
                kind: msg.kind,
                compressed: msg.compressed,
                payload: p.freeze(),
            },
            None => Event::TooLarge {
                kind: msg.kind,
                compressed: msg.compressed,
                len: msg.wire,
            },
        }))
    }
}

/// Add `b` to a message's payload while it stays within `cap`; past the
/// cap the payload is let go, and the message will be reported as too large.
fn keep(payload: &mut Option<BytesMut>, b: &[u8], cap: usize) {
    if let Some(p) = payload {
        if p.len() + b.len() > cap {
            *payload = None;
        } else {
            p.extend_from_slice(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ws::deflate::{Deflater, Inflater};

    fn frame(fin: bool, rsv1: bool, op: Opcode, mask: Option<[u8; 4]>, p: &[u8]) -> Vec<u8> {
        let mut b = BytesMut::new();
        encode_frame(&mut b, fin, rsv1, op, mask, p);
        b.to_vec()
    }

    /// Every event a reader yields from `wire` fed in pieces of `step` bytes.
    fn read_all(
        wire: &[u8],
        step: usize,
        cap: usize,
        inflater: Option<Inflater>,
    ) -> Result<Vec<Event>, FrameError> {
        let mut r = MessageReader::new(cap, inflater);
        let mut out = Vec::new();
        for piece in wire.chunks(step.max(1)) {
            let mut at = 0;
            while at < piece.len() {
                let (n, ev) = r.feed(&piece[at..])?;
                assert!(n > 0 || ev.is_some(), "no progress");
                at += n;
                out.extend(ev);
            }
        }
        assert!(r.at_message_boundary());
        Ok(out)
    }

    #[test]
    fn headers_parse_incrementally_and_match_tungstenite() {
        use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
        use tokio_tungstenite::tungstenite::protocol::frame::{Frame, FrameHeader};
        for len in [0usize, 1, 125, 126, 127, 65535, 65536, 70000] {
            for mask in [None, Some([1u8, 2, 3, 4])] {
                let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
                let mine = frame(true, false, Opcode::Binary, mask, &payload);
                // tungstenite writes the same frame byte for byte.
                let mut theirs = Vec::new();
                let mut f = Frame::message(payload.clone(), OpCode::Data(Data::Binary), true);
                if let Some(m) = mask {
                    f.header_mut().mask = Some(m);
                }
                f.format(&mut theirs).unwrap();
                assert_eq!(mine, theirs, "len {len} mask {mask:?}");
                let h = parse_header(&mine).unwrap().unwrap();
                assert_eq!(
                    (h.len, h.mask, h.opcode),
                    (len as u64, mask, Opcode::Binary)
                );
                // Every prefix shorter than the header is "need more".
                for cut in 0..h.header_len {
                    assert_eq!(parse_header(&mine[..cut]), Ok(None), "cut {cut}");
                }
                // tungstenite reads the header we read.
                let mut c = std::io::Cursor::new(&mine[..]);
                let (th, tlen) = FrameHeader::parse(&mut c).unwrap().unwrap();
                assert_eq!((tlen, th.mask), (len as u64, mask));
                assert_eq!(c.position() as usize, h.header_len);
            }
        }
    }

    /// A real client's frames (tungstenite, random masks, its own
    /// fragmentation of nothing) read as the messages it sent, and frames
    /// written here read in tungstenite as what was written.
    #[test]
    fn tungstenite_reads_ours_and_we_read_tungstenites() {
        use std::io::Cursor;
        use tokio_tungstenite::tungstenite::protocol::{Role, WebSocket};
        use tokio_tungstenite::tungstenite::Message;
        let big: Vec<u8> = (0..70_000u32).map(|i| (i % 253) as u8).collect();
        let mut client = WebSocket::from_raw_socket(Cursor::new(Vec::new()), Role::Client, None);
        client.send(Message::text("hello")).unwrap();
        client.send(Message::Ping(b"p".to_vec().into())).unwrap();
        client.send(Message::binary(big.clone())).unwrap();
        let wire = client.get_ref().get_ref().clone();
        for step in [1, 3, 1000, wire.len()] {
            let got = read_all(&wire, step, 1 << 20, None).unwrap();
            assert_eq!(
                got,
                [
                    Event::Message {
                        kind: Kind::Text,
                        compressed: false,
                        payload: Bytes::from_static(b"hello")
                    },
                    Event::Control {
                        opcode: Opcode::Ping,
                        payload: Bytes::from_static(b"p")
                    },
                    Event::Message {
                        kind: Kind::Binary,
                        compressed: false,
                        payload: Bytes::from(big.clone())
                    },
                ]
            );
        }
        let mut ours = Vec::new();
        ours.extend(frame(
            false,
            false,
            Opcode::Text,
            Some([5, 6, 7, 8]),
            b"hel",
        ));
        ours.extend(frame(
            true,
            false,
            Opcode::Continuation,
            Some([9, 9, 9, 9]),
            b"lo",
        ));
        ours.extend(frame(true, false, Opcode::Binary, Some([1, 1, 2, 2]), &big));
        let mut server = WebSocket::from_raw_socket(Cursor::new(ours), Role::Server, None);
        assert_eq!(server.read().unwrap(), Message::text("hello"));
        assert_eq!(server.read().unwrap(), Message::binary(big));
    }

    #[test]
    fn header_errors() {
        assert_eq!(
            parse_header(&[0x83, 0x00]),
            Err(FrameError::ReservedOpcode(3))
        );
        assert_eq!(
            parse_header(&[0x8B, 0x00]),
            Err(FrameError::ReservedOpcode(0xB))
        );
        // A ping without FIN.
        assert_eq!(
            parse_header(&[0x09, 0x00]),
            Err(FrameError::FragmentedControl)
        );
        // A close of 126 bytes.
        assert_eq!(
            parse_header(&[0x88, 126, 0, 126]),
            Err(FrameError::ControlTooLong(126))
        );
        assert_eq!(
            parse_header(&[0x82, 127, 0x80, 0, 0, 0, 0, 0, 0, 0]),
            Err(FrameError::LengthOverflow)
        );
    }

    #[test]
    fn masking_resumes_at_any_offset() {
        let key = [0x37, 0xfa, 0x21, 0x3d];
        let plain: Vec<u8> = (0..100u8).collect();
        let mut whole = plain.clone();
        apply_mask(key, 0, &mut whole);
        for i in 0..plain.len() {
            assert_eq!(whole[i], plain[i] ^ key[i % 4]);
        }
        for split in 0..plain.len() {
            for split2 in split..plain.len() {
                let mut p = plain.clone();
                let (a, rest) = p.split_at_mut(split);
                let (b, c) = rest.split_at_mut(split2 - split);
                apply_mask(key, 0, a);
                apply_mask(key, split as u64, b);
                apply_mask(key, split2 as u64, c);
                assert_eq!(p, whole);
            }
        }
        // RFC 6455 §5.7: "Hello", masked.
        let mut hello = *b"Hello";
        apply_mask(key, 0, &mut hello);
        assert_eq!(hello, [0x7f, 0x9f, 0x4d, 0x51, 0x58]);
    }

    #[test]
    fn rfc_6455_examples_read() {
        // §5.7: unmasked and masked "Hello", fragmented "Hel" + "lo",
        // an unmasked ping and a 256-byte binary message.
        let unmasked = [0x81, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f];
        let masked = [
            0x81, 0x85, 0x37, 0xfa, 0x21, 0x3d, 0x7f, 0x9f, 0x4d, 0x51, 0x58,
        ];
        let frag = [0x01, 0x03, 0x48, 0x65, 0x6c, 0x80, 0x02, 0x6c, 0x6f];
        let ping = [0x89, 0x05, 0x48, 0x65, 0x6c, 0x6c, 0x6f];
        let hello = Event::Message {
            kind: Kind::Text,
            compressed: false,
            payload: Bytes::from_static(b"Hello"),
        };
        for wire in [&unmasked[..], &masked, &frag] {
            for step in 1..=wire.len() {
                assert_eq!(
                    read_all(wire, step, 1 << 20, None).unwrap(),
                    std::slice::from_ref(&hello)
                );
            }
        }
        assert_eq!(
            read_all(&ping, 1, 16, None).unwrap(),
            [Event::Control {
                opcode: Opcode::Ping,
                payload: Bytes::from_static(b"Hello")
            }]
        );
    }

    #[test]
    fn fragments_with_controls_between_and_the_cap() {
        let key = Some([9, 8, 7, 6]);
        let mut wire = Vec::new();
        wire.extend(frame(false, false, Opcode::Text, key, b"{\"a\":"));
        wire.extend(frame(true, false, Opcode::Ping, key, b"p"));
        wire.extend(frame(false, false, Opcode::Continuation, key, b""));
        wire.extend(frame(true, false, Opcode::Continuation, key, b"1}"));
        wire.extend(frame(true, false, Opcode::Binary, key, &[7u8; 300]));
        wire.extend(frame(
            true,
            false,
            Opcode::Close,
            key,
            &close_payload(1000, "bye"),
        ));
        for step in [1, 2, 3, 7, 64, wire.len()] {
            let got = read_all(&wire, step, 100, None).unwrap();
            assert_eq!(
                got,
                [
                    Event::Control {
                        opcode: Opcode::Ping,
                        payload: Bytes::from_static(b"p")
                    },
                    Event::Message {
                        kind: Kind::Text,
                        compressed: false,
                        payload: Bytes::from_static(b"{\"a\":1}")
                    },
                    Event::TooLarge {
                        kind: Kind::Binary,
                        compressed: false,
                        len: 300
                    },
                    Event::Control {
                        opcode: Opcode::Close,
                        payload: Bytes::from(close_payload(1000, "bye"))
                    },
                ],
                "step {step}"
            );
        }
    }

    #[test]
    fn sequence_errors() {
        let cont = frame(true, false, Opcode::Continuation, None, b"x");
        assert_eq!(
            read_all(&cont, 1, 10, None),
            Err(FrameError::UnexpectedContinuation)
        );
        let mut two = frame(false, false, Opcode::Text, None, b"a");
        two.extend(frame(true, false, Opcode::Text, None, b"b"));
        assert_eq!(
            read_all(&two, 64, 10, None),
            Err(FrameError::MessageInterrupted)
        );
        let rsv1 = frame(true, true, Opcode::Text, None, b"a");
        assert_eq!(read_all(&rsv1, 64, 10, None), Err(FrameError::ReservedBits));
    }

    #[test]
    fn the_reader_stops_after_each_completing_frame() {
        let mut wire = frame(true, false, Opcode::Text, None, b"one");
        let first = wire.len();
        wire.extend(frame(true, false, Opcode::Text, None, b"two"));
        let mut r = MessageReader::new(64, None);
        let (n, ev) = r.feed(&wire).unwrap();
        assert_eq!(n, first);
        assert!(matches!(ev, Some(Event::Message { .. })));
        assert!(r.at_message_boundary());
        let (n, ev) = r.feed(&wire[first..]).unwrap();
        assert_eq!(n, wire.len() - first);
        assert!(matches!(ev, Some(Event::Message { payload, .. }) if &payload[..] == b"two"));
        // Half a frame: not at a boundary.
        let (n, ev) = r.feed(&wire[..2]).unwrap();
        assert_eq!((n, ev), (2, None));
        assert!(!r.at_frame_boundary());
    }

    /// Compressed messages with context takeover: the second refers back to
    /// the first, so it inflates only after the first did.
    #[test]
    fn compressed_messages_inflate_with_and_without_context_takeover() {
        for takeover in [true, false] {
            let mut d = Deflater::new(!takeover);
            let msgs: [&[u8]; 3] = [
                b"{\"type\":\"response.create\",\"input\":\"hello hello hello\"}",
                b"{\"type\":\"response.create\",\"input\":\"hello hello hello\"}",
                b"tiny",
            ];
            let mut wire = Vec::new();
            for m in msgs {
                let c = d.compress(m);
                // Split across two fragments to check piecewise inflation.
                let (a, b) = c.split_at(c.len() / 2);
                wire.extend(frame(false, true, Opcode::Text, Some([1, 2, 3, 4]), a));
                wire.extend(frame(
                    true,
                    false,
                    Opcode::Continuation,
                    Some([1, 2, 3, 4]),
                    b,
                ));
            }
            for step in [1, 5, wire.len()] {
                let got = read_all(&wire, step, 1024, Some(Inflater::new(!takeover))).unwrap();
                let payloads: Vec<_> = got
                    .iter()
                    .map(|e| match e {
                        Event::Message {
                            compressed: true,
                            payload,
                            ..
                        } => payload.to_vec(),
                        other => panic!("{other:?}"),
                    })
                    .collect();
                assert_eq!(payloads, msgs.map(<[u8]>::to_vec), "takeover {takeover}");
            }
        }
    }

    /// A compressed message over the cap is stepped over, yet still
    /// inflated, so the next message (which refers back to it) reads.
    #[test]
    fn a_compressed_message_over_the_cap_keeps_the_window() {
        let mut d = Deflater::new(false);
        let big = "abcdefghij".repeat(50);
        let mut wire = frame(true, true, Opcode::Text, None, &d.compress(big.as_bytes()));
        wire.extend(frame(
            true,
            true,
            Opcode::Text,
            None,
            &d.compress(&big.as_bytes()[..100]),
        ));
        let got = read_all(&wire, 7, 200, Some(Inflater::new(false))).unwrap();
        assert!(matches!(
            got[0],
            Event::TooLarge {
                compressed: true,
                ..
            }
        ));
        assert!(
            matches!(&got[1], Event::Message { payload, .. } if payload[..] == big.as_bytes()[..100])
        );
    }
}
