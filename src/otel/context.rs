//! W3C Trace Context: the client's `traceparent` read, tidemark's own
//! written for the upstream, and the ids of tidemark's spans.

use http::header::{HeaderMap, HeaderName, HeaderValue};

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The longest `tracestate` kept on a span (the spec's own limit).
const MAX_TRACESTATE: usize = 512;

/// The span a request continues, as the client's `traceparent` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub sampled: bool,
}

/// The client's `traceparent`, if it sent exactly one valid one (two are
/// invalid, as is an all-zero id or upper-case hex: the spec says start
/// a new trace then).
pub fn parent(headers: &HeaderMap) -> Option<Parent> {
    let mut all = headers.get_all(TRACEPARENT).iter();
    let v = all.next()?;
    if all.next().is_some() {
        return None;
    }
    parse(v.as_bytes())
}

/// `version-traceid-parentid-flags`. A version above 00 may carry more
/// after a dash; `ff` is invalid.
pub fn parse(v: &[u8]) -> Option<Parent> {
    let v = v.trim_ascii();
    if v.len() < 55 {
        return None;
    }
    let version = hex::<1>(&v[0..2])?[0];
    if version == 0xff || (version == 0 && v.len() != 55) || (v.len() > 55 && v[55] != b'-') {
        return None;
    }
    if v[2] != b'-' || v[35] != b'-' || v[52] != b'-' {
        return None;
    }
    let trace_id = hex::<16>(&v[3..35])?;
    let span_id = hex::<8>(&v[36..52])?;
    let flags = hex::<1>(&v[53..55])?[0];
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some(Parent {
        trace_id,
        span_id,
        sampled: flags & 1 == 1,
    })
}

/// Lower-case hex only, as the spec writes it.
fn hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let nib = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = nib(s[2 * i])? << 4 | nib(s[2 * i + 1])?;
    }
    Some(out)
}

/// The client's `tracestate` (every value, joined as the spec allows), kept
/// on the span; too long for the spec, left off.
pub fn tracestate(headers: &HeaderMap) -> Option<Box<str>> {
    let mut all = headers.get_all(TRACESTATE).iter();
    let first = all.next()?.to_str().ok()?;
    let mut s = first.trim().to_string();
    for v in all {
        s.push(',');
        s.push_str(v.to_str().ok()?.trim());
    }
    (!s.is_empty() && s.len() <= MAX_TRACESTATE).then(|| s.into_boxed_str())
}

/// The `traceparent` naming one of tidemark's spans.
pub fn header(trace_id: &[u8; 16], span_id: &[u8; 8], sampled: bool) -> HeaderValue {
    let mut s = String::with_capacity(55);
    s.push_str("00-");
    crate::session::push_hex(&mut s, trace_id);
    s.push('-');
    crate::session::push_hex(&mut s, span_id);
    s.push_str(if sampled { "-01" } else { "-00" });
    HeaderValue::from_maybe_shared(bytes::Bytes::from(s)).expect("hex and dashes")
}

/// A new random id: a per-thread xorshift generator seeded from the
/// process's hash seed and the thread, so ids are unique without a lock
/// or a shared counter. Never all zero.
pub fn random_u64() -> u64 {
    use std::cell::Cell;
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            use std::hash::{BuildHasher, Hash, Hasher};
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            std::thread::current().id().hash(&mut h);
            std::time::SystemTime::now().hash(&mut h);
            h.finish() | 1
        });
    }
    STATE.with(|s| {
        // xorshift64*: a full period over the non-zero states.
        let mut x = s.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        s.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn reads_the_spec_examples_and_refuses_the_invalid() {
        let p = parse(GOOD.as_bytes()).unwrap();
        assert_eq!(
            crate::session::hex(&p.trace_id),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(crate::session::hex(&p.span_id), "00f067aa0ba902b7");
        assert!(p.sampled);
        assert!(
            !parse(GOOD.replace("-01", "-00").as_bytes())
                .unwrap()
                .sampled
        );
        for bad in [
            GOOD.to_uppercase(),
            GOOD.replace("4bf92f3577b34da6a3ce929d0e0e4736", &"0".repeat(32)),
            GOOD.replace("00f067aa0ba902b7", &"0".repeat(16)),
            GOOD.replacen("00-", "ff-", 1),
            format!("{GOOD}-extra"),
            GOOD[..54].to_string(),
            GOOD.replacen('-', "_", 1),
        ] {
            assert_eq!(parse(bad.as_bytes()), None, "{bad}");
        }
        // A later version may append fields after a dash.
        assert!(parse(format!("01{}-what", &GOOD[2..]).as_bytes()).is_some());
        assert!(parse(format!("01{}x", &GOOD[2..]).as_bytes()).is_none());
    }

    #[test]
    fn two_traceparents_are_none_and_tracestates_join() {
        let mut h = HeaderMap::new();
        h.append(TRACEPARENT, HeaderValue::from_static(GOOD));
        assert!(parent(&h).is_some());
        h.append(TRACEPARENT, HeaderValue::from_static(GOOD));
        assert!(parent(&h).is_none());
        h.append(TRACESTATE, HeaderValue::from_static("a=1"));
        h.append(TRACESTATE, HeaderValue::from_static(" b=2 "));
        assert_eq!(tracestate(&h).as_deref(), Some("a=1,b=2"));
    }

    #[test]
    fn our_header_reads_back() {
        let (t, s) = ([7u8; 16], [9u8; 8]);
        let h = header(&t, &s, true);
        assert_eq!(
            parse(h.as_bytes()),
            Some(Parent {
                trace_id: t,
                span_id: s,
                sampled: true
            })
        );
        let ids: std::collections::HashSet<u64> = (0..1000).map(|_| random_u64()).collect();
        assert_eq!(ids.len(), 1000);
    }
}
