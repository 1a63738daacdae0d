//! The request body read whole, capped, and decoded for inspection.
use std::future::Future;
use std::io::Read;
use std::pin::Pin;
use std::task::Poll;

use bytes::Bytes;
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use crate::config::Config;
use crate::turn::ProxyError;

/// Read a request body whole: at most `--max-body-bytes`, no silence longer
/// than `--header-read-timeout` between frames (a client trickling its body
/// cannot hold a connection forever), and all of it within `--upstream-timeout`.
pub(super) async fn read_body(body: Incoming, cfg: &Config) -> Result<Bytes, ProxyError> {
    // Room for a declared Content-Length up front (no regrowing copies of a
    // long history); a body that comes in one frame is kept, not copied.
    let declared = http_body::Body::size_hint(&body)
        .lower()
        .min(cfg.max_body_bytes as u64) as usize;
    let mut body = Limited::new(body, cfg.max_body_bytes);
    let mut first: Option<Bytes> = None;
    let mut buf = bytes::BytesMut::new();
    // Set at the first wait (frames ready until then took no time to speak of).
    let mut deadline = None;
    loop {
        // A frame already here (a small body comes with its headers) is
        // taken without reading the clock or making a timer.
        let mut next = body.frame();
        let ready = std::future::poll_fn(|cx| match Pin::new(&mut next).poll(cx) {
            Poll::Ready(f) => Poll::Ready(Some(f)),
            Poll::Pending => Poll::Ready(None),
        })
        .await;
        let waited = match ready {
            Some(f) => Ok(f),
            None => {
                let now = tokio::time::Instant::now();
                let deadline = *deadline.get_or_insert(now + cfg.upstream_timeout);
                let silence = now + cfg.header_read_timeout;
                tokio::time::timeout_at(silence.min(deadline), next).await
            }
        };
        let frame = match waited {
            Err(_) => return Err(ProxyError::ClientTimeout),
            // `first` is held only while it is the sole frame.
            Ok(None) => return Ok(first.unwrap_or_else(|| buf.freeze())),
            Ok(Some(Err(e))) => {
                return Err(
                    if e.downcast_ref::<http_body_util::LengthLimitError>()
                        .is_some()
                    {
                        ProxyError::BodyTooLarge
                    } else {
                        ProxyError::ClientBody
                    },
                )
            }
            Ok(Some(Ok(f))) => f,
        };
        if let Ok(d) = frame.into_data() {
            if d.is_empty() {
                continue;
            }
            if buf.is_empty() && first.is_none() {
                first = Some(d);
                continue;
            }
            if let Some(f) = first.take() {
                buf.reserve(declared.max(f.len() + d.len()));
                buf.extend_from_slice(&f);
            }
            buf.extend_from_slice(&d);
        }
    }
}

/// Decode a compressed request body for inspection only (it is forwarded as it came).
pub(super) fn decode_request(encoding: Option<&str>, body: &Bytes, cap: usize) -> Option<Bytes> {
    let enc = match encoding.map(|e| e.trim().to_ascii_lowercase()) {
        None => return Some(body.clone()),
        Some(e) if e.is_empty() || e == "identity" => return Some(body.clone()),
        Some(e) => e,
    };
    let mut out = Vec::new();
    let limit = cap as u64 + 1;
    let ok = match enc.as_str() {
        "gzip" | "x-gzip" => flate2::read::MultiGzDecoder::new(&body[..])
            .take(limit)
            .read_to_end(&mut out)
            .is_ok(),
        "deflate" => flate2::read::ZlibDecoder::new(&body[..])
            .take(limit)
            .read_to_end(&mut out)
            .is_ok(),
        "br" => brotli_decompressor::Decompressor::new(&body[..], 4096)
            .take(limit)
            .read_to_end(&mut out)
            .is_ok(),
        "zstd" => match zstd::stream::read::Decoder::new(&body[..]) {
            Ok(d) => d.take(limit).read_to_end(&mut out).is_ok(),
            Err(_) => false,
        },
        _ => false,
    };
    (ok && out.len() <= cap).then(|| Bytes::from(out))
}
