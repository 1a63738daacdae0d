//! Every wire fixture through the usage reader yields its expected.json usage:
//! whole, at every byte split, byte by byte, at the UTF-8 split offsets, in
//! random chunkings, and compressed with gzip, deflate, br and zstd.

use std::io::Write;
use std::path::PathBuf;

use base64::Engine;
use proptest::prelude::*;
use serde_json::Value;
use tidemark::provider::{Api, Framing, Observed, Provider, Usage};
use tidemark::tap::sse::{SseScanner, MAX_EVENT_BYTES};
use tidemark::tap::usage::{ReadOutcome, UsageReader};

struct Case {
    path: String,
    body: Vec<u8>,
    provider: &'static dyn Provider,
    framing: Framing,
    encoding: Option<&'static str>,
    usage: Usage,
    stream_error: bool,
    utf8_splits: Vec<usize>,
}

fn n(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Provider and framing a fixture's response is read with.
fn route(folder: &str, file: &str) -> Option<(Api, Framing)> {
    let framing = if file.ends_with(".sse") {
        Framing::Sse
    } else if file.ends_with(".ndjson") {
        Framing::Ndjson
    } else {
        Framing::Json
    };
    let api = match folder {
        "openai-chat" => Api::OpenAiChat,
        "openai-responses" => Api::OpenAiResponses,
        // count_tokens is proxied untapped (SPEC §3: it never anchors).
        "anthropic-messages" if file.starts_with("count_tokens") => return None,
        "anthropic-messages" => Api::Anthropic,
        "gemini" => Api::Gemini,
        "ollama" if file.starts_with("v1_") => Api::OpenAiChat,
        "ollama" => Api::Ollama,
        _ => return None,
    };
    Some((api, framing))
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for folder in [
        "openai-chat",
        "openai-responses",
        "anthropic-messages",
        "gemini",
        "ollama",
    ] {
        let exp: Value = serde_json::from_slice(
            &std::fs::read(dir().join(folder).join("expected.json")).unwrap(),
        )
        .unwrap();
        for (file, e) in exp["files"].as_object().unwrap() {
            let Some((api, framing)) = route(folder, file) else {
                continue;
            };
            let body = std::fs::read(dir().join(folder).join(file)).unwrap();
            let usage = Usage {
                input: n(e, "input_tokens"),
                cached_input: n(e, "cached_input_tokens"),
                cache_creation: n(e, "cache_creation_input_tokens"),
                output: n(e, "output_tokens"),
                total_context: n(e, "total_context_tokens"),
            };
            let err = &e["error"];
            out.push(Case {
                path: format!("{folder}/{file}"),
                body,
                provider: api.provider(),
                framing,
                encoding: file.ends_with(".gz").then_some("gzip"),
                usage,
                stream_error: err["in_stream"].as_bool() == Some(true),
                utf8_splits: e["utf8_split_offsets"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_u64)
                            .map(|x| x as usize)
                            .collect()
                    })
                    .unwrap_or_default(),
            });
        }
    }
    assert!(out.len() >= 30, "fixtures found: {}", out.len());
    out
}

fn read(c: &Case, body: &[u8], encoding: Option<&str>, cuts: &[usize]) -> ReadOutcome {
    let mut r = UsageReader::new(c.provider, c.framing, encoding);
    let mut at = 0;
    for &cut in cuts.iter().chain(std::iter::once(&body.len())) {
        let cut = cut.clamp(at, body.len());
        r.feed(&body[at..cut]);
        at = cut;
    }
    r.finish()
}

fn check(c: &Case, o: &ReadOutcome, how: &str) {
    assert_eq!(o.observed.usage, c.usage, "{} ({how})", c.path);
    assert_eq!(o.parse_errors, 0, "{} ({how})", c.path);
    if c.framing != Framing::Json {
        assert_eq!(
            o.observed.stream_error, c.stream_error,
            "{} ({how})",
            c.path
        );
    }
}

#[test]
fn every_fixture_whole_and_at_every_split() {
    for c in cases() {
        check(&c, &read(&c, &c.body, c.encoding, &[]), "whole");
        for i in 0..=c.body.len() {
            check(
                &c,
                &read(&c, &c.body, c.encoding, &[i]),
                &format!("split at {i}"),
            );
        }
        let bytes: Vec<usize> = (1..c.body.len()).collect();
        check(&c, &read(&c, &c.body, c.encoding, &bytes), "byte by byte");
        if !c.utf8_splits.is_empty() {
            for &s in &c.utf8_splits {
                assert!(
                    std::str::from_utf8(&c.body[..s]).is_err(),
                    "{}: offset {s} is inside a character",
                    c.path
                );
            }
            check(
                &c,
                &read(&c, &c.body, c.encoding, &c.utf8_splits),
                "utf8 splits",
            );
        }
    }
}

#[test]
fn responses_streams_carry_their_id() {
    let c = cases();
    let c = c
        .iter()
        .find(|c| c.path == "openai-responses/stream_basic.sse")
        .unwrap();
    let o = read(c, &c.body, None, &[]);
    let id = o.observed.response_id.expect("response id");
    assert!(id.starts_with("resp_"), "{id}");
}

/// A tiny xorshift, so random chunkings are reproducible without a crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn cuts(&mut self, len: usize) -> Vec<usize> {
        let mut at = 0;
        let mut v = Vec::new();
        while at < len {
            at += 1 + (self.next() % 97) as usize;
            v.push(at.min(len));
        }
        v
    }
}

#[test]
fn every_fixture_in_random_chunkings() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for c in cases() {
        for _ in 0..200 {
            let cuts = rng.cuts(c.body.len());
            check(
                &c,
                &read(&c, &c.body, c.encoding, &cuts),
                &format!("cuts {cuts:?}"),
            );
        }
    }
}

// ---- compressed bodies -------------------------------------------------

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}
fn zlib(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}
fn raw_deflate(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::best());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}
fn zstd(b: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(b, 3).unwrap()
}

/// A valid brotli stream of uncompressed meta-blocks (RFC 7932 §9.2), so
/// every fixture can be sent as `br` without a brotli encoder crate.
fn brotli_stored(b: &[u8]) -> Vec<u8> {
    struct Bits {
        out: Vec<u8>,
        acc: u64,
        n: u32,
    }
    impl Bits {
        fn put(&mut self, v: u64, bits: u32) {
            self.acc |= v << self.n;
            self.n += bits;
            while self.n >= 8 {
                self.out.push(self.acc as u8);
                self.acc >>= 8;
                self.n -= 8;
            }
        }
        fn align(&mut self) {
            if self.n > 0 {
                self.put(0, 8 - self.n);
            }
        }
    }
    let mut w = Bits {
        out: Vec::new(),
        acc: 0,
        n: 0,
    };
    w.put(0, 1); // WBITS = 16
    for block in b.chunks(1000) {
        w.put(0, 1); // ISLAST = 0
        w.put(0, 2); // MNIBBLES = 4
        w.put(block.len() as u64 - 1, 16);
        w.put(1, 1); // ISUNCOMPRESSED
        w.align();
        w.out.extend_from_slice(block);
    }
    w.put(1, 1); // ISLAST
    w.put(1, 1); // ISLASTEMPTY
    w.align();
    w.out
}

type Encoder = fn(&[u8]) -> Vec<u8>;
const ENCODINGS: &[(&str, Encoder)] = &[
    ("gzip", gzip),
    ("deflate", zlib),
    ("deflate", raw_deflate),
    ("zstd", zstd),
    ("br", brotli_stored),
];

#[test]
fn compressed_bodies_are_decoded_as_they_arrive() {
    let mut rng = Rng(7);
    for c in cases().iter().filter(|c| c.encoding.is_none()) {
        for (name, enc) in ENCODINGS {
            let z = enc(&c.body);
            let how = name.to_string();
            check(c, &read(c, &z, Some(name), &[]), &how);
            // Every split for gzip (what Anthropic streams use); the rest sampled.
            let step = if *name == "gzip" { 1 } else { 7 };
            for i in (0..=z.len()).step_by(step) {
                check(
                    c,
                    &read(c, &z, Some(name), &[i]),
                    &format!("{how} split at {i}"),
                );
            }
            let bytes: Vec<usize> = (1..z.len()).collect();
            check(
                c,
                &read(c, &z, Some(name), &bytes),
                &format!("{how} byte by byte"),
            );
            for _ in 0..20 {
                let cuts = rng.cuts(z.len());
                check(
                    c,
                    &read(c, &z, Some(name), &cuts),
                    &format!("{how} {cuts:?}"),
                );
            }
        }
    }
}

/// Real brotli output (the `brotli` tool, quality 11 and 5) of two fixtures.
const BR_PROMPT_CACHING: &str = "saAyAOE8sG0o+Sg/xLcsNB8hSadPv606JTEvw2IS0tqpfsQ05ivhcpLzNN2ExVOHpe/nL3dL6IwP6ND+ezcac+viMbZ+rA3AmUUUaIBhWEBsrtVG094NUNBDHrm1UNVr0iwz0TZR4pRJr5iVQ4Dch1hpWGHz9QHczO49ny2rvmVlVmBFXlR4nVcQYg+QtyHhhWOtf7r3UnsdxddCeey0j8m4OMgW4YlNmenwkaKtj5KvHwagWAgCbghFQQswrdh6X3E2zCRuylpQGeBpI5E0hKjkBF3mb0LDvHpUEmSR7wUMPdWvIj/3GzsjSt5rvY6cED3i91D2HTcqMgCJqYn9BoCbA3spCj91cswkAtpAsZVWGCGYKMAz1Q9NIWTCCE/7ALu0Ki5CQy4a/LHgG6ZLibpW44nMZj5pmppnjW83EZfP8rAj2j+CQPlx7P+/wT/UD4L8uZYPIh23hLkZtqWg/fflRdzN4Hjtajvh3HPA+tmorGi+rEjvS8+irUfSKO+H5425rAS/8Mh3JVtntPfdr+YJiC7I0j7C1pPUIIYMAA==";
const BR_CHAT_BASIC: &str = "0dimACAGrbV+JT2T9/7EtyGmZ/67r1ICluhQKqmRGDoX6gC4kmZnG842i4/CaqCzF/kGfH8QH35UYCS+4z/G1qPtMo3aYTeyGGljijwCBTEbE9a8Eje10Xq73J3YV0r0wOWjjjm4rdX7wNlrnccgeJ0AMZXYvMGgaM5azTDrt0oQLKk+UMUyDFlRNd0gqFkUV6BIeU/UmSijrqJsi7IJgrelObm9PO6AgrwSwboK7ltFMBTUBEXCXdmyLSVW/cheJCJjeRh3weMUKFJBZQIBlUGnIJkeFH63m985gs7a7U12EAUIfklf8SvQu1oKzQkqlvIOC7o9JQIpEty3NhBjgmcCipKJjgVJvxsy8t8PKM5rbXSFuSDg2A2h+b/sd2Jg8afFnUNtdGUOdROs+ZtWRz9B4AtobPrJ77e/cT2UqjcEfl9dXf6R3HbgCCo/78HEdWurJfj7fIu+XK0Na3CnVPhZqQ10xxXmQ9DnCLy87sd6R46HYPXqTVx7WYGbiNhAX1p946oNS/D/85VPXAcyFy5Bj7H00oq3tS40QVN1RLUKEGMszOKCAWwcW10L3DbcPAXvsJr3XFNQbRdU0XTVUItcYbeBQCcwMXQfPYdhknkIrlEgxsCQH2Zx5KuKoRKYbVL948nzxXnMBydYRt5KJ/MeFCPwwzDmvThyjb49Vp2VDeVQWvgzSsz5nO7QIVejczA8bp2ebD8LAg==";

#[test]
fn real_brotli_streams() {
    let all = cases();
    for (path, b64) in [
        (
            "anthropic-messages/stream_prompt_caching.sse",
            BR_PROMPT_CACHING,
        ),
        ("openai-chat/stream_basic_with_usage.sse", BR_CHAT_BASIC),
    ] {
        let c = all.iter().find(|c| c.path == path).unwrap();
        let z = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        for i in 0..=z.len() {
            check(
                c,
                &read(c, &z, Some("br"), &[i]),
                &format!("br split at {i}"),
            );
        }
        let bytes: Vec<usize> = (1..z.len()).collect();
        check(c, &read(c, &z, Some("br"), &bytes), "br byte by byte");
    }
}

// ---- malformed input ---------------------------------------------------

fn reader(api: Api, framing: Framing, enc: Option<&str>) -> UsageReader {
    UsageReader::new(api.provider(), framing, enc)
}

#[test]
fn malformed_events_count_a_parse_error_and_keep_reading() {
    let broken = b"data: {\"usage\": {\"prompt_tokens\": 5,\n\n".as_slice();
    let good = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9}}\n\n".as_slice();
    let mut r = reader(Api::OpenAiChat, Framing::Sse, None);
    r.feed(broken);
    r.feed(good);
    let o = r.finish();
    assert_eq!(o.parse_errors, 1);
    assert_eq!(o.observed.usage.total_context, Some(9));
    // Chat usage is cumulative, so of the events that arrived together only
    // the last one with usage is read: a broken one before it is not.
    let mut r = reader(Api::OpenAiChat, Framing::Sse, None);
    r.feed(&[broken, good].concat());
    let o = r.finish();
    assert_eq!(
        (o.parse_errors, o.observed.usage.total_context),
        (0, Some(9))
    );
    // A broken last one is counted, and what came before it in its burst is
    // not read: the response has no usage, which is loud.
    let mut r = reader(Api::OpenAiChat, Framing::Sse, None);
    r.feed(&[good, broken].concat());
    let o = r.finish();
    assert_eq!((o.parse_errors, o.observed.usage.total_context), (1, None));

    let mut r = reader(Api::Ollama, Framing::Ndjson, None);
    r.feed(b"{\"done\":true,\"eval_count\":\n{\"done\":true,\"prompt_eval_count\":4,\"eval_count\":2}\n");
    let o = r.finish();
    assert_eq!(o.parse_errors, 1);
    assert_eq!(o.observed.usage.input, Some(4));

    let mut r = reader(Api::Anthropic, Framing::Json, None);
    r.feed(b"{\"usage\":{\"input_tokens\":");
    assert_eq!(r.finish().parse_errors, 1);

    let mut r = reader(Api::OpenAiChat, Framing::Sse, Some("gzip"));
    r.feed(b"definitely not gzip");
    let o = r.finish();
    assert_eq!(o.parse_errors, 1);
    assert_eq!(o.observed, Observed::default());

    let mut r = reader(Api::OpenAiChat, Framing::Sse, Some("compress"));
    r.feed(b"data: {}\n\n");
    assert_eq!(r.finish().parse_errors, 1);
}

#[test]
fn an_event_past_the_cap_stops_reading_with_one_error() {
    let mut r = reader(Api::OpenAiChat, Framing::Sse, None);
    r.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: \"");
    let filler = vec![b'x'; 64 * 1024];
    for _ in 0..(MAX_EVENT_BYTES / filler.len() + 2) {
        r.feed(&filler);
    }
    r.feed(b"\"\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":99}}\n\n");
    let o = r.finish();
    assert_eq!(o.parse_errors, 1);
    assert_eq!(
        o.observed.usage.total_context,
        Some(3),
        "usage before the cap is kept"
    );
}

#[test]
fn a_stream_cut_mid_event_keeps_what_it_had() {
    // Anthropic reports input first: a disconnect after message_start still anchors.
    let body = std::fs::read(dir().join("anthropic-messages/stream_basic.sse")).unwrap();
    let cut = memchr::memmem::find(&body, b"event: content_block_delta").unwrap() + 30;
    let mut r = reader(Api::Anthropic, Framing::Sse, None);
    r.feed(&body[..cut]);
    let o = r.finish();
    assert_eq!(o.observed.usage.total_context, Some(25));
    assert_eq!(o.parse_errors, 0);
}

#[test]
fn a_gzip_bomb_is_not_read_past_the_cap() {
    // 64 MiB of one repeated data line costs ~64 KiB compressed; memory stays at one line.
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    let line = b"data: {\"choices\":[{\"delta\":{\"content\":\"aaaa\"}}]}\n\n";
    for _ in 0..(64 << 20) / line.len() {
        e.write_all(line).unwrap();
    }
    e.write_all(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":11}}\n\n")
        .unwrap();
    let z = e.finish().unwrap();
    let mut r = reader(Api::OpenAiChat, Framing::Sse, Some("gzip"));
    for c in z.chunks(16 * 1024) {
        r.feed(c);
    }
    let o = r.finish();
    assert_eq!(o.parse_errors, 0);
    assert_eq!(o.observed.usage.total_context, Some(11));
}

#[test]
fn a_zstd_frame_asking_for_a_huge_window_is_refused() {
    // A 128 MiB window would make the tap allocate that much: refused, one error.
    let mut e = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
    e.window_log(27).unwrap();
    e.long_distance_matching(true).unwrap();
    e.write_all(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5}}\n\n")
        .unwrap();
    let z = e.finish().unwrap();
    let mut r = reader(Api::OpenAiChat, Framing::Sse, Some("zstd"));
    r.feed(&z);
    let o = r.finish();
    assert_eq!(o.parse_errors, 1);
    assert_eq!(o.observed.usage.total_context, None);
}

// ---- property tests ----------------------------------------------------

fn cases_from_env(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// An event as (name, data), owned.
type Owned = (Option<String>, Vec<u8>);

/// Events dispatched, and the unfinished one offered at the end.
fn scan_all(chunks: &[&[u8]]) -> (Vec<Owned>, Option<Owned>) {
    let mut s = SseScanner::new();
    let mut out = Vec::new();
    for c in chunks {
        s.feed(c, &mut |e| {
            out.push((e.name.map(str::to_string), e.data.to_vec()))
        });
    }
    let tail = s
        .finish()
        .map(|e| (e.name.map(str::to_string), e.data.to_vec()));
    (out, tail)
}

/// SSE-shaped bytes: the pieces that matter to the scanner, plus any byte.
fn sse_bytes() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"data:".to_vec()),
        Just(b"data: ".to_vec()),
        Just(b"event: x".to_vec()),
        Just(b": c".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\r".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"\xEF\xBB\xBF".to_vec()),
        Just("é☕".as_bytes().to_vec()),
        Just(b"{\"usage\":{\"prompt_tokens\":1}}".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..8),
    ];
    proptest::collection::vec(piece, 0..40).prop_map(|v| v.concat())
}

fn split_at_cuts(b: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (b.len() + 1)).collect();
    cuts.sort_unstable();
    let mut at = 0;
    let mut out = Vec::new();
    for c in cuts.into_iter().chain(std::iter::once(b.len())) {
        out.push(b[at..c].to_vec());
        at = c;
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases_from_env(2000)))]

    #[test]
    fn scanner_random_chunking_equals_whole(b in sse_bytes(), cuts in proptest::collection::vec(any::<usize>(), 0..12)) {
        let parts = split_at_cuts(&b, &cuts);
        let parts: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        prop_assert_eq!(scan_all(&parts), scan_all(&[&b]));
    }

    #[test]
    fn fixtures_in_proptest_chunkings(i in 0usize..64, cuts in proptest::collection::vec(any::<usize>(), 0..40)) {
        static ALL: std::sync::OnceLock<Vec<Case>> = std::sync::OnceLock::new();
        let all = ALL.get_or_init(cases);
        let c = &all[i % all.len()];
        let mut cuts: Vec<usize> = cuts.iter().map(|x| x % (c.body.len() + 1)).collect();
        cuts.sort_unstable();
        check(c, &read(c, &c.body, c.encoding, &cuts), "proptest");
    }

    /// Fuzz: any bytes through every provider, framing and encoding: no panic.
    #[test]
    fn readers_never_panic(b in sse_bytes(), raw in proptest::collection::vec(any::<u8>(), 0..256), api in 0usize..5, fr in 0usize..3, enc in 0usize..6) {
        let api = [Api::OpenAiChat, Api::OpenAiResponses, Api::Anthropic, Api::Gemini, Api::Ollama][api];
        let framing = [Framing::Sse, Framing::Ndjson, Framing::Json][fr];
        let enc = [None, Some("gzip"), Some("deflate"), Some("br"), Some("zstd"), Some("identity")][enc];
        for body in [&b, &raw] {
            let mut r = reader(api, framing, enc);
            for c in body.chunks(7) {
                r.feed(c);
            }
            let _ = r.finish();
        }
    }
}
