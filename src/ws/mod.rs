//! WebSocket (RFC 6455) as tidemark reads it: frames and messages
//! (`frame.rs`), permessage-deflate (`deflate.rs`), and the handshake's
//! accept key.
//!
//! A reader of one direction of a connection:
//!
//! ```
//! use tidemark::ws::frame::{encode_frame, Event, MessageReader, Opcode};
//! let mut wire = bytes::BytesMut::new();
//! encode_frame(&mut wire, true, false, Opcode::Text, Some([1, 2, 3, 4]), b"hi");
//! let mut r = MessageReader::new(1 << 20, None);
//! let (used, event) = r.feed(&wire).unwrap();
//! assert_eq!(used, wire.len());
//! assert!(matches!(event, Some(Event::Message { payload, .. }) if &payload[..] == b"hi"));
//! ```

pub mod deflate;
pub mod frame;

use base64::Engine as _;

/// The GUID RFC 6455 §1.3 appends to a client's key.
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// `Sec-WebSocket-Accept` for a client's `Sec-WebSocket-Key`: base64 of the
/// SHA-1 of the key and the protocol's GUID.
pub fn accept_key(sec_websocket_key: &[u8]) -> String {
    let mut h = sha1_smol::Sha1::new();
    h.update(sec_websocket_key);
    h.update(GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(h.digest().bytes())
}

#[cfg(test)]
mod tests {
    #[test]
    fn accept_key_of_rfc_6455() {
        // §1.3's example.
        assert_eq!(
            super::accept_key(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
        assert_eq!(
            super::accept_key(b"x3JJHMbDL1EzLkh9GBhXDw=="),
            tokio_tungstenite::tungstenite::handshake::derive_accept_key(
                b"x3JJHMbDL1EzLkh9GBhXDw=="
            )
        );
    }
}
