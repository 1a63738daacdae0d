//! RFC 7692 permessage-deflate: the parameters the handshake agreed, and
//! the inflate (and, for tests and simulators, deflate) of whole messages.

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

/// The tail every compressed message had before its sender took it off
/// (RFC 7692 §7.2.1), put back before inflating.
const TAIL: [u8; 4] = [0x00, 0x00, 0xff, 0xff];

/// The permessage-deflate parameters a server's handshake response agreed.
/// Window bits matter only to a compressor: an inflater with the full 32 KiB
/// window reads any smaller one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// The server resets its compressor after each message.
    pub server_no_context_takeover: bool,
    /// The client resets its compressor after each message.
    pub client_no_context_takeover: bool,
    pub server_max_window_bits: u8,
    pub client_max_window_bits: u8,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            server_no_context_takeover: false,
            client_no_context_takeover: false,
            server_max_window_bits: 15,
            client_max_window_bits: 15,
        }
    }
}

/// What the `Sec-WebSocket-Extensions` of a `101` response agreed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agreed {
    /// No extension: frames carry no RSV bits.
    Nothing,
    Deflate(Params),
    /// An extension (or a parameter) tidemark does not know: the RSV bits
    /// mean something it cannot read.
    Unknown,
}

/// The extensions a server's handshake response agreed, from every value of
/// its `Sec-WebSocket-Extensions` header (RFC 6455 §9.1 grammar: a comma
/// list of `name; param[=value]`, values possibly quoted).
pub fn agreed<'a>(values: impl IntoIterator<Item = &'a [u8]>) -> Agreed {
    let mut found = Agreed::Nothing;
    for v in values {
        let Ok(v) = std::str::from_utf8(v) else {
            return Agreed::Unknown;
        };
        for ext in v.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let mut parts = ext.split(';').map(str::trim);
            let name = parts.next().unwrap_or("");
            if !name.eq_ignore_ascii_case("permessage-deflate") || found != Agreed::Nothing {
                return Agreed::Unknown;
            }
            let mut p = Params::default();
            for param in parts.filter(|p| !p.is_empty()) {
                let (k, val) = match param.split_once('=') {
                    Some((k, v)) => (k.trim(), Some(v.trim().trim_matches('"'))),
                    None => (param, None),
                };
                let bits = |val: Option<&str>| -> Option<u8> {
                    match val {
                        None => Some(15),
                        Some(s) => s.parse::<u8>().ok().filter(|b| (8..=15).contains(b)),
                    }
                };
                match k.to_ascii_lowercase().as_str() {
                    "server_no_context_takeover" if val.is_none() => {
                        p.server_no_context_takeover = true
                    }
                    "client_no_context_takeover" if val.is_none() => {
                        p.client_no_context_takeover = true
                    }
                    "server_max_window_bits" => match bits(val) {
                        Some(b) if val.is_some() => p.server_max_window_bits = b,
                        _ => return Agreed::Unknown,
                    },
                    "client_max_window_bits" => match bits(val) {
                        Some(b) => p.client_max_window_bits = b,
                        None => return Agreed::Unknown,
                    },
                    _ => return Agreed::Unknown,
                }
            }
            found = Agreed::Deflate(p);
        }
    }
    found
}

/// Why a message did not inflate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InflateError;

impl std::fmt::Display for InflateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("invalid deflate data")
    }
}
impl std::error::Error for InflateError {}

/// One direction's decompressor. With context takeover its window carries
/// from message to message, so it must see every compressed message of its
/// direction, in order, including those nobody wants to read.
pub struct Inflater {
    d: Decompress,
    reset_each: bool,
}

impl std::fmt::Debug for Inflater {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inflater")
            .field("reset_each", &self.reset_each)
            .finish()
    }
}

impl Inflater {
    /// `no_context_takeover`: the sender resets its compressor after each
    /// message, so this resets too.
    pub fn new(no_context_takeover: bool) -> Self {
        Inflater {
            d: Decompress::new(false),
            reset_each: no_context_takeover,
        }
    }

    /// The inflater of the client's messages (to the server) under `p`.
    pub fn client_to_server(p: &Params) -> Self {
        Inflater::new(p.client_no_context_takeover)
    }

    /// The inflater of the server's messages (to the client) under `p`.
    pub fn server_to_client(p: &Params) -> Self {
        Inflater::new(p.server_no_context_takeover)
    }

    /// Inflate a piece of a compressed message's payload, handing what
    /// comes out to `out` as it comes.
    pub fn inflate(
        &mut self,
        input: &[u8],
        out: &mut dyn FnMut(&[u8]),
    ) -> Result<(), InflateError> {
        let mut buf = [0u8; 8192];
        let mut input = input;
        loop {
            let (in0, out0) = (self.d.total_in(), self.d.total_out());
            let status = self
                .d
                .decompress(input, &mut buf, FlushDecompress::Sync)
                .map_err(|_| InflateError)?;
            let used = (self.d.total_in() - in0) as usize;
            let made = (self.d.total_out() - out0) as usize;
            input = &input[used..];
            if made > 0 {
                out(&buf[..made]);
            }
            if status == Status::StreamEnd {
                // A block with BFINAL ends the deflate stream; whatever
                // follows starts a new one, with no window.
                self.d.reset(false);
                if input.is_empty() {
                    return Ok(());
                }
                continue;
            }
            if input.is_empty() && made < buf.len() {
                return Ok(());
            }
            if used == 0 && made == 0 {
                return Err(InflateError);
            }
        }
    }

    /// The message's payload has all been given: inflate the tail its
    /// sender took off, and reset if the sender resets.
    pub fn finish(&mut self, out: &mut dyn FnMut(&[u8])) -> Result<(), InflateError> {
        let r = self.inflate(&TAIL, out);
        if self.reset_each || r.is_err() {
            self.d.reset(false);
        }
        r
    }

    /// Inflate a whole message's payload at once.
    pub fn message(&mut self, payload: &[u8]) -> Result<Vec<u8>, InflateError> {
        let mut v = Vec::with_capacity(payload.len() * 3);
        self.inflate(payload, &mut |b: &[u8]| v.extend_from_slice(b))?;
        self.finish(&mut |b: &[u8]| v.extend_from_slice(b))?;
        Ok(v)
    }
}

/// One direction's compressor, as a peer would run it: what tests and a
/// simulated provider send compressed.
pub struct Deflater {
    c: Compress,
    reset_each: bool,
}

impl Deflater {
    /// `no_context_takeover`: reset after every message.
    pub fn new(no_context_takeover: bool) -> Self {
        Deflater {
            c: Compress::new(Compression::default(), false),
            reset_each: no_context_takeover,
        }
    }

    /// A message compressed for the wire (RSV1 set on its first frame):
    /// deflated, flushed to a byte boundary, the `00 00 ff ff` tail removed.
    pub fn compress(&mut self, msg: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(msg.len() / 2 + 64);
        let mut input = msg;
        loop {
            if out.capacity() - out.len() < 64 {
                out.reserve(out.capacity().max(64));
            }
            let before = self.c.total_in();
            if self
                .c
                .compress_vec(input, &mut out, FlushCompress::Sync)
                .is_err()
            {
                break;
            }
            input = &input[(self.c.total_in() - before) as usize..];
            // Room left over: the flush is complete.
            if input.is_empty() && out.len() < out.capacity() {
                break;
            }
        }
        if out.ends_with(&TAIL) {
            out.truncate(out.len() - TAIL.len());
        }
        if self.reset_each {
            self.c.reset();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agree(v: &str) -> Agreed {
        agreed([v.as_bytes()])
    }

    #[test]
    fn handshake_parameters() {
        assert_eq!(agreed(std::iter::empty::<&[u8]>()), Agreed::Nothing);
        assert_eq!(
            agree("permessage-deflate"),
            Agreed::Deflate(Params::default())
        );
        assert_eq!(
            agree("permessage-deflate; server_no_context_takeover; client_max_window_bits=\"10\""),
            Agreed::Deflate(Params {
                server_no_context_takeover: true,
                client_max_window_bits: 10,
                ..Params::default()
            })
        );
        assert_eq!(
            agree("Permessage-Deflate;client_no_context_takeover;server_max_window_bits=9"),
            Agreed::Deflate(Params {
                client_no_context_takeover: true,
                server_max_window_bits: 9,
                ..Params::default()
            })
        );
        assert_eq!(agree("x-webkit-deflate-frame"), Agreed::Unknown);
        assert_eq!(agree("permessage-deflate; foo"), Agreed::Unknown);
        assert_eq!(
            agree("permessage-deflate; server_max_window_bits=16"),
            Agreed::Unknown
        );
        assert_eq!(
            agree("permessage-deflate; server_max_window_bits"),
            Agreed::Unknown
        );
        assert_eq!(
            agree("permessage-deflate, permessage-deflate"),
            Agreed::Unknown
        );
    }

    /// RFC 7692 §7.2.3.1: "Hello" compressed, and the same message again
    /// with context takeover (a back-reference into the first).
    #[test]
    fn rfc_7692_examples() {
        let mut i = Inflater::new(false);
        assert_eq!(
            i.message(&[0xf2, 0x48, 0xcd, 0xc9, 0xc9, 0x07, 0x00])
                .unwrap(),
            b"Hello"
        );
        assert_eq!(
            i.message(&[0xf2, 0x00, 0x11, 0x00, 0x00]).unwrap(),
            b"Hello"
        );
        // The same back-reference without the first message's window is
        // not "Hello".
        let cold = Inflater::new(false).message(&[0xf2, 0x00, 0x11, 0x00, 0x00]);
        assert_ne!(cold.ok().as_deref(), Some(&b"Hello"[..]));
        // §7.2.3.3: an uncompressed (stored) block.
        assert_eq!(
            Inflater::new(true)
                .message(&[0x00, 0x05, 0x00, 0xfa, 0xff, 0x48, 0x65, 0x6c, 0x6c, 0x6f, 0x00])
                .unwrap(),
            b"Hello"
        );
    }

    #[test]
    fn deflater_and_inflater_agree_message_after_message() {
        for reset in [false, true] {
            let mut d = Deflater::new(reset);
            let mut i = Inflater::new(reset);
            let big: Vec<u8> = (0..200_000u32)
                .map(|n| (n % 251) as u8 ^ (n / 7) as u8)
                .collect();
            for m in [&b"Hello"[..], b"Hello", b"", &big, &big[..1000]] {
                let c = d.compress(m);
                assert_eq!(i.message(&c).unwrap(), m, "reset {reset}");
            }
        }
    }
}
