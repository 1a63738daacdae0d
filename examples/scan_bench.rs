//! Throughput of the tap's parts on a large stream: the SSE scanner alone,
//! the usage reader (plain and gzip), and the usage stripper; and what the
//! tap costs one typical streaming response.
//!
//!     cargo run --release --example scan_bench

use std::hint::black_box;
use std::io::Write;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tidemark::provider::{Api, Framing};
use tidemark::tap::inject::UsageStripper;
use tidemark::tap::sse::SseScanner;
use tidemark::tap::usage::UsageReader;

/// An injected OpenAI chat stream: `"usage":null` on every chunk, usage at the end.
fn chat_stream(chunks: usize) -> Vec<u8> {
    let mut s = Vec::new();
    for i in 0..chunks {
        write!(s, "data: {{\"id\":\"chatcmpl-C3xAqkGz8T1dZp0Lr6vWm2Yb9HnQe\",\"object\":\"chat.completion.chunk\",\"created\":1755012345,\"model\":\"gpt-4o-2024-08-06\",\"service_tier\":\"default\",\"system_fingerprint\":\"fp_07871e2ad8\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" token {i} — café\"}},\"logprobs\":null,\"finish_reason\":null}}],\"usage\":null,\"obfuscation\":\"p9K3xT6w\"}}\n\n").unwrap();
    }
    s.extend_from_slice(b"data: {\"id\":\"chatcmpl-C3xAqkGz8T1dZp0Lr6vWm2Yb9HnQe\",\"object\":\"chat.completion.chunk\",\"created\":1755012345,\"model\":\"gpt-4o-2024-08-06\",\"choices\":[],\"usage\":{\"prompt_tokens\":1342,\"completion_tokens\":14,\"total_tokens\":1356,\"prompt_tokens_details\":{\"cached_tokens\":1152}}}\n\ndata: [DONE]\n\n");
    s
}

/// An Anthropic stream: named events, usage only in message_start / message_delta.
fn anthropic_stream(deltas: usize) -> Vec<u8> {
    let mut s = Vec::new();
    s.extend_from_slice(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"claude-sonnet-4-5\",\"content\":[],\"usage\":{\"input_tokens\":25,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":9000,\"output_tokens\":1}}}\n\n");
    for i in 0..deltas {
        write!(s, "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"word {i} and some more text, 日本語\"}}}}\n\n").unwrap();
    }
    s.extend_from_slice(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":900}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    s
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

/// Best of five runs of `f` over `bytes` (counted as the decoded size), in MB/s.
fn mbps(bytes: usize, mut f: impl FnMut()) -> f64 {
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
    }
    bytes as f64 / 1e6 / best.as_secs_f64()
}

const CHUNK: usize = 16 * 1024;

fn main() {
    let chat = chat_stream(100_000);
    let anth = anthropic_stream(200_000);
    let anth_gz = gzip(&anth);
    println!(
        "inputs: chat {:.1} MB, anthropic {:.1} MB ({:.1} MB gzip), fed in {} KiB chunks",
        chat.len() as f64 / 1e6,
        anth.len() as f64 / 1e6,
        anth_gz.len() as f64 / 1e6,
        CHUNK / 1024
    );

    let v = mbps(chat.len(), || {
        let mut s = SseScanner::new();
        let mut n = 0usize;
        for c in chat.chunks(CHUNK) {
            s.feed(c, &mut |e| n += e.data.len());
        }
        black_box(n);
    });
    println!("scanner (chat SSE)               {v:>8.0} MB/s");

    let v = mbps(chat.len(), || {
        let mut r = UsageReader::new(Api::OpenAiChat.provider(), Framing::Sse, None);
        for c in chat.chunks(CHUNK) {
            r.feed(c);
        }
        let o = r.finish();
        assert_eq!(o.observed.usage.total_context, Some(1342));
    });
    println!("reader (chat, usage:null chunks) {v:>8.0} MB/s");

    let v = mbps(anth.len(), || {
        let mut r = UsageReader::new(Api::Anthropic.provider(), Framing::Sse, None);
        for c in anth.chunks(CHUNK) {
            r.feed(c);
        }
        assert_eq!(r.finish().observed.usage.total_context, Some(9025));
    });
    println!("reader (anthropic)               {v:>8.0} MB/s");

    let v = mbps(anth.len(), || {
        let mut r = UsageReader::new(Api::Anthropic.provider(), Framing::Sse, Some("gzip"));
        for c in anth_gz.chunks(CHUNK) {
            r.feed(c);
        }
        assert_eq!(r.finish().observed.usage.total_context, Some(9025));
    });
    println!("reader (anthropic, gzip)         {v:>8.0} MB/s (decoded bytes)");

    let mut out = BytesMut::with_capacity(CHUNK * 2);
    let v = mbps(chat.len(), || {
        let mut s = UsageStripper::new();
        for c in chat.chunks(CHUNK) {
            out.clear();
            s.push(c, &mut out);
            black_box(&out);
        }
        out.clear();
        s.finish(&mut out);
    });
    println!("stripper (chat)                  {v:>8.0} MB/s");

    // One typical streaming response as the proxy sees it: 20 small frames.
    let one = chat_stream(20);
    let frames: Vec<&[u8]> = one
        .split_inclusive(|&b| b == b'\n')
        .collect::<Vec<_>>()
        .chunks(2)
        .map(|p| &one[offset(&one, p[0])..offset(&one, p[p.len() - 1]) + p[p.len() - 1].len()])
        .collect();
    let reps = 20_000;
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            let mut r = UsageReader::new(Api::OpenAiChat.provider(), Framing::Sse, None);
            let mut s = UsageStripper::new();
            let mut out = BytesMut::new();
            for f in &frames {
                r.feed(f);
                s.push(f, &mut out);
            }
            s.finish(&mut out);
            black_box(r.finish());
            black_box(out);
        }
        best = best.min(t.elapsed());
    }
    let per = best.as_secs_f64() / reps as f64;
    println!(
        "tap per streaming response ({} frames, reader+stripper): {:.1} µs CPU = {:.0} responses/s on one core",
        frames.len(),
        per * 1e6,
        1.0 / per
    );

    // The reader alone on the same response, frame by frame and as the one
    // burst a fast upstream delivers (the proxy bench's case).
    let whole = [one.as_slice()];
    for (what, frames) in [("22 frames", &frames[..]), ("one burst", &whole[..])] {
        let mut best = Duration::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                let mut r = UsageReader::new(Api::OpenAiChat.provider(), Framing::Sse, None);
                for f in frames {
                    r.feed(f);
                }
                black_box(r.finish());
            }
            best = best.min(t.elapsed());
        }
        println!(
            "reader per streaming response ({what}): {:.2} µs CPU",
            best.as_secs_f64() / reps as f64 * 1e6
        );
    }

    // A whole (non-stream) chat completion, as the proxy bench's small rows.
    let body = include_bytes!("../tests/fixtures/openai-chat/nonstream_basic.json");
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..reps {
            let mut r = UsageReader::new(Api::OpenAiChat.provider(), Framing::Json, None);
            r.feed(body);
            black_box(r.finish());
        }
        best = best.min(t.elapsed());
    }
    println!(
        "reader per JSON response ({} bytes): {:.2} µs CPU",
        body.len(),
        best.as_secs_f64() / reps as f64 * 1e6
    );
}

fn offset(all: &[u8], part: &[u8]) -> usize {
    part.as_ptr() as usize - all.as_ptr() as usize
}
