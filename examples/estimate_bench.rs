//! Estimator speed on a ~400 KB mixed history (prose, CJK, JSON, code,
//! base64, emoji): from scratch, and cached with one new turn appended; the
//! request view parse; and tokenizer throughput of bpe-openai against
//! tiktoken-rs on the same text.
//!
//!     cargo run --release --example estimate_bench

use std::time::{Duration, Instant};

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::json;
use tidemark::estimate::{Encoding, Estimator};
use tidemark::json::RequestView;
use tidemark::provider::Api;

fn prose(i: usize) -> String {
    format!(
        "Turn {i}. The proxy reads the provider's own count off every response and keeps it as \
         an anchor, so the estimator's error is confined to the few messages added since. \
         We should measure the drift on dense content before trusting a gate built on it. "
    )
    .repeat(3)
}
fn cjk(i: usize) -> String {
    format!(
        "第{i}轮：代理从每个响应中读取提供方自己的计数并保存为锚点，因此估算误差只限于新增的几条消息。\
         日本語の文章も混ぜます：トークン数は文字数の四分の一よりずっと多くなります。"
    )
    .repeat(3)
}
fn json_blob(i: usize) -> String {
    let rows: Vec<_> = (0..12)
        .map(|r| json!({"id": i * 100 + r, "name": format!("item-{r}"), "ok": r % 3 == 0, "score": r as f64 * 1.5, "tags": ["a", "b"]}))
        .collect();
    json!({"turn": i, "rows": rows}).to_string()
}
fn code(i: usize) -> String {
    format!(
        "```rust\nfn step_{i}(input: &[u8]) -> Result<Vec<u32>, Error> {{\n    let mut out = Vec::with_capacity(input.len() / 4);\n    for chunk in input.chunks(4) {{\n        out.push(u32::from_le_bytes(chunk.try_into()?));\n    }}\n    Ok(out)\n}}\n```\n"
    )
    .repeat(2)
}
fn base64_blob(i: usize) -> String {
    let bytes: Vec<u8> = (0..900u32)
        .map(|k| (k.wrapping_mul(2654435761).wrapping_add(i as u32) >> 13) as u8)
        .collect();
    B64.encode(bytes)
}
fn emoji(i: usize) -> String {
    format!("status {i}: 🚀✅🎉🔥🙂 done 👩‍💻🧪📦 next ➡️ 🇳🇴🇯🇵 ").repeat(8)
}

/// A kind of content: its name and a maker of the `i`th sample.
type Kind = (&'static str, fn(usize) -> String);

const KINDS: [Kind; 6] = [
    ("prose", prose),
    ("cjk", cjk),
    ("json", json_blob),
    ("code", code),
    ("base64", base64_blob),
    ("emoji", emoji),
];

fn history(target_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut size = 0;
    let mut i = 0;
    while size < target_bytes {
        let (_, f) = KINDS[i % KINDS.len()];
        let role = if i % 2 == 0 { "user" } else { "assistant" };
        let m = json!({"role": role, "content": f(i)}).to_string();
        size += m.len() + 1;
        out.push(m);
        i += 1;
    }
    out
}

fn body(messages: &[String], extra: Option<&str>) -> String {
    let mut s = String::from(r#"{"model":"gpt-4o","stream":true,"messages":["#);
    s.push_str(&messages.join(","));
    if let Some(e) = extra {
        s.push(',');
        s.push_str(e);
    }
    s.push_str("]}");
    s
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

fn mbps(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e6
}

fn main() {
    let t = Instant::now();
    Encoding::O200kBase.warm();
    Encoding::Cl100kBase.warm();
    let bpe_init = t.elapsed();
    let t = Instant::now();
    let tk_o = tiktoken_rs::o200k_base_singleton();
    let tk_c = tiktoken_rs::cl100k_base_singleton();
    let _ = tk_o.encode_ordinary("warm").len() + tk_c.encode_ordinary("warm").len();
    let tk_init = t.elapsed();
    println!(
        "tokenizer init: bpe-openai {bpe_init:?} (both vocabularies), tiktoken-rs {tk_init:?}"
    );

    let hist = history(400 * 1024);
    let base = body(&hist, None);
    println!("history: {} messages, {} bytes", hist.len(), base.len());

    // RequestView::parse.
    let mut parse = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let v = RequestView::parse(base.as_bytes()).expect("object");
        std::hint::black_box(&v);
        parse.push(t.elapsed());
    }
    println!(
        "RequestView::parse (400 KB): p50 {} p99 {}",
        us(pct(&mut parse, 0.5)),
        us(pct(&mut parse, 0.99))
    );

    let view = RequestView::parse(base.as_bytes()).expect("object");
    // What a cached estimate is made of past the parse (which also finds
    // the messages): hashing each message.
    let els = view.elements("messages").expect("messages");
    let mut hash = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let h: u128 = els
            .iter()
            .map(|el| xxhash_rust::xxh3::xxh3_128(el.get().as_bytes()))
            .fold(0, |a, b| a ^ b);
        std::hint::black_box(h);
        hash.push(t.elapsed());
    }
    println!(
        "cached-path parts: xxh3 of every message p50 {}",
        us(pct(&mut hash, 0.5))
    );

    // From scratch: a fresh cache each time.
    let p = Api::OpenAiChat.provider();
    let mut scratch = Vec::new();
    let mut est = None;
    for _ in 0..10 {
        let e = Estimator::new(64 << 20);
        let t = Instant::now();
        est = Some(e.estimate(p, &view, Some("gpt-4o")));
        scratch.push(t.elapsed());
    }
    let est = est.expect("ran");
    println!(
        "estimate from scratch: p50 {} (tokens {}, chars {}, chars/4 {})",
        us(pct(&mut scratch, 0.5)),
        est.tokens,
        est.chars,
        est.chars / 4
    );

    // Cached history + one new turn, each turn new.
    let e = Estimator::new(64 << 20);
    e.estimate(p, &view, Some("gpt-4o"));
    let mut cached = Vec::new();
    let mut with_parse = Vec::new();
    for i in 0..300 {
        let (_, f) = KINDS[i % KINDS.len()];
        let turn = json!({"role":"user","content": format!("new turn {i}: {}", f(i))}).to_string();
        let b = body(&hist, Some(&turn));
        let t0 = Instant::now();
        let v = RequestView::parse(b.as_bytes()).expect("object");
        let t1 = Instant::now();
        let r = e.estimate(p, &v, Some("gpt-4o"));
        let t2 = Instant::now();
        std::hint::black_box(r);
        cached.push(t2 - t1);
        with_parse.push(t2 - t0);
    }
    let s = e.stats();
    println!(
        "estimate cached + 1 new turn: p50 {} p99 {}; with parse p50 {} p99 {}",
        us(pct(&mut cached, 0.5)),
        us(pct(&mut cached, 0.99)),
        us(pct(&mut with_parse, 0.5)),
        us(pct(&mut with_parse, 0.99))
    );
    println!(
        "cache: {} hits, {} misses, {} entries, {} bytes",
        s.hits, s.misses, s.cache_entries, s.cache_bytes
    );

    // Tokenizer throughput, per kind of content and all together.
    println!("\ntokenizer throughput (MB/s), same text, counts checked equal:");
    println!(
        "{:<8} {:>10} {:>12} {:>10} {:>12} {:>9}",
        "content", "bpe o200k", "tiktoken o200k", "bpe cl100k", "tiktoken cl100k", "speedup"
    );
    let mut all = String::new();
    for (name, f) in KINDS {
        let text: String = (0..60).map(f).collect();
        all.push_str(&text);
        row(name, &text, tk_o, tk_c);
    }
    row("mixed", &all, tk_o, tk_c);
}

fn row(name: &str, text: &str, tk_o: &tiktoken_rs::CoreBPE, tk_c: &tiktoken_rs::CoreBPE) {
    let reps = 3;
    let time = |f: &dyn Fn() -> usize| {
        let mut best = Duration::MAX;
        let mut n = 0;
        for _ in 0..reps {
            let t = Instant::now();
            n = std::hint::black_box(f());
            best = best.min(t.elapsed());
        }
        (n, best)
    };
    let (bo, tbo) = time(&|| Encoding::O200kBase.count(text));
    let (to, tto) = time(&|| tk_o.encode_ordinary(text).len());
    let (bc, tbc) = time(&|| Encoding::Cl100kBase.count(text));
    let (tc, ttc) = time(&|| tk_c.encode_ordinary(text).len());
    assert_eq!(bo, to, "o200k counts differ on {name}");
    assert_eq!(bc, tc, "cl100k counts differ on {name}");
    let n = text.len();
    println!(
        "{:<8} {:>10.1} {:>12.1} {:>10.1} {:>12.1} {:>8.1}x",
        name,
        mbps(n, tbo),
        mbps(n, tto),
        mbps(n, tbc),
        mbps(n, ttc),
        (tto.as_secs_f64() + ttc.as_secs_f64()) / (tbo.as_secs_f64() + tbc.as_secs_f64())
    );
}
