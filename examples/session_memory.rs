//! Memory per session and behaviour at the cap.
//!
//!     cargo run --release --example session_memory [-- SESSIONS CAP]
//!
//! Without arguments it runs two scenarios, each in a fresh child process so
//! one's freed memory does not hide the other's: 1,000,000 distinct sessions
//! under a cap of 1,000,000, and the same 1,000,000 under a cap of 100,000.
//! Every session makes one anchored round trip (begin, a 2xx with usage),
//! keyed like a fingerprint (`fp:` + 16 hex). Prints the RSS delta per session,
//! the part of it that is the key string, and the time per round trip.
use std::process::Command;
use std::time::{Duration, Instant};

use tidemark::provider::{Api, Usage};
use tidemark::session::{Lane, Outcome, RequestFacts, Session, SessionConfig, Sessions};

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

fn run(n: usize, cap: usize) {
    let rss0 = rss_bytes();
    let sessions = Sessions::new(SessionConfig {
        ttl: Duration::from_secs(3600),
        max_sessions: cap,
    });
    let start = Instant::now();
    let mut key_bytes = 0usize;
    for i in 0..n {
        let key = format!("fp:{:016x}", (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        key_bytes += key.len();
        let est = 1_000 + (i as u64 % 5_000);
        let begun = sessions.begin(RequestFacts {
            key: Some(key),
            credential: "cafebabe".into(),
            api: Api::OpenAiChat,
            model: Some("gpt-4o".into()),
            estimate: est,
            reset: false,
            window: Some(128_000),
            ..Default::default()
        });
        sessions.finish(
            begun.ticket,
            Outcome {
                status: 200,
                usage: Usage {
                    total_context: Some(est + est / 10),
                    input: Some(est + est / 10),
                    cached_input: Some(0),
                    output: Some(200),
                    cache_creation: None,
                },
                completed: true,
                ..Default::default()
            },
        );
        assert!(sessions.len() <= cap, "cap exceeded: {}", sessions.len());
    }
    let elapsed = start.elapsed();
    let rss1 = rss_bytes();
    let held = sessions.len();
    let delta = rss1.saturating_sub(rss0);
    let per = delta as f64 / held.max(1) as f64;
    // The key is held once, as a boxed str (allocation rounded to 16 bytes).
    let key_heap = (key_bytes / n).div_ceil(16) * 16;
    println!(
        "sessions={n} cap={cap} held={held} rss_delta={:.1}MiB per_session={per:.0}B \
         key_heap~{key_heap}B per_session_without_key~{:.0}B round_trip={:.2}us",
        delta as f64 / (1 << 20) as f64,
        per - key_heap as f64,
        elapsed.as_secs_f64() * 1e6 / n as f64,
    );
    // Spot checks: the newest sessions are held, the oldest evicted at the cap.
    let newest = format!(
        "fp:{:016x}",
        ((n - 1) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    );
    let oldest = format!("fp:{:016x}", 0u64);
    println!(
        "  newest held: {}, oldest held: {}, list(5) in {:?}",
        sessions.get(&newest, None).is_some(),
        sessions.get(&oldest, None).is_some(),
        {
            let t = Instant::now();
            let _ = sessions.list(5);
            t.elapsed()
        }
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [n, cap] = args.as_slice() {
        let n = n.parse().expect("SESSIONS is a number");
        let cap = cap.parse().expect("CAP is a number");
        run(n, cap);
        return;
    }
    println!(
        "size_of::<Session>() = {} bytes, size_of::<Lane>() = {} bytes (a lane each, on the heap; plus key, credential and model strings)",
        std::mem::size_of::<Session>(),
        std::mem::size_of::<Lane>()
    );
    let exe = std::env::current_exe().expect("own path");
    for (n, cap) in [(1_000_000usize, 1_000_000usize), (1_000_000, 100_000)] {
        let status = Command::new(&exe)
            .args([n.to_string(), cap.to_string()])
            .status()
            .expect("child runs");
        assert!(status.success(), "scenario {n}/{cap} failed");
    }
}
