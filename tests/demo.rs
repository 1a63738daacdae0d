//! `tidemark demo` end to end: the built binary, no TTY, its printed table
//! checked against the simulated provider's own counts of the very request
//! bodies the agent sent (dumped with `TIDEMARK_DEMO_DUMP`).

use std::process::Stdio;
use std::time::Duration;

use http_body_util::BodyExt;
use serde_json::Value;
use tidemark::estimate::Estimator;
use tidemark::json::RequestView;
use tidemark::provider::Api;
use tidemark::sim::{count_prompt, SimApi};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tidemark");

#[derive(Debug)]
struct Row {
    turn: u32,
    real: Option<u64>,
    chars4: u64,
    estimate: u64,
    projection: Option<u64>,
    error: Option<f64>,
    src: String,
    decision: String,
    line: String,
}

fn num(s: &str) -> Option<u64> {
    (s != "-").then(|| s.parse().expect("a number or -"))
}

/// Sessions by API name, in printed order.
fn parse(out: &str) -> Vec<(String, Vec<Row>)> {
    let mut sessions: Vec<(String, Vec<Row>)> = Vec::new();
    for line in out.lines() {
        if line.starts_with("== the same agent") {
            // The story after the tables (checked on its own).
            break;
        }
        if let Some(h) = line.strip_prefix("== ") {
            let api = h.split_whitespace().next().unwrap().to_string();
            sessions.push((api, Vec::new()));
            continue;
        }
        let cols: Vec<&str> = line.split_whitespace().collect();
        let Some(turn) = cols.first().and_then(|c| c.parse::<u32>().ok()) else {
            continue;
        };
        assert!(cols.len() >= 8, "short row: {line}");
        let error = (cols[5] != "-").then(|| {
            cols[5]
                .trim_end_matches('%')
                .parse::<f64>()
                .expect("error column")
        });
        sessions
            .last_mut()
            .expect("a row before any session header")
            .1
            .push(Row {
                turn,
                real: num(cols[1]),
                chars4: cols[2].parse().unwrap(),
                estimate: cols[3].parse().unwrap(),
                projection: num(cols[4]),
                error,
                src: cols[6].to_string(),
                decision: cols[7].to_string(),
                line: line.to_string(),
            });
    }
    sessions
}

#[tokio::test]
async fn demo_table_matches_the_simulated_providers_counts() {
    let dump = std::env::temp_dir().join(format!("tidemark-demo-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dump);
    let child = Command::new(BIN)
        .args(["demo", "--turns", "8"])
        .env("TIDEMARK_DEMO_DUMP", &dump)
        .env("TIDEMARK_LOG", "warn")
        .env_remove("TIDEMARK_LISTEN")
        .env_remove("TIDEMARK_ADMIN_LISTEN")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn tidemark demo");
    let out = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("demo finished within 120 s")
        .expect("demo output");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 stdout");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed: {stderr}\n{stdout}");
    assert!(!stdout.contains('\x1b'), "no colour without a terminal");
    assert!(
        !stderr.contains('\x1b'),
        "no progress bar without a terminal"
    );

    let sessions = parse(&stdout);
    let names: Vec<&str> = sessions.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["openai-chat", "anthropic-messages"], "{stdout}");
    assert_eq!(
        stdout.matches("gate line:").count(),
        2,
        "one summary per session"
    );

    let estimator = Estimator::new(16 << 20);
    for (name, rows) in &sessions {
        let (sim_api, api, model) = match name.as_str() {
            "openai-chat" => (SimApi::OpenAiChat, Api::OpenAiChat, "gpt-4o"),
            _ => (SimApi::Anthropic, Api::Anthropic, "claude-sonnet-4-5"),
        };
        assert_eq!(rows.len(), 8, "{name}: 8 turns\n{stdout}");
        for r in rows {
            let ctx = format!("{name} turn {}: {}", r.turn, r.line);
            let body = std::fs::read(dump.join(format!("{name}-{:03}.json", r.turn)))
                .unwrap_or_else(|e| panic!("{ctx}: dumped body: {e}"));
            let v: Value = serde_json::from_slice(&body).unwrap();

            // real is the simulated provider's own count of what the agent sent.
            let real = r.real.unwrap_or_else(|| panic!("{ctx}: no real count"));
            assert_eq!(real, count_prompt(sim_api, &v).total, "{ctx}");

            // estimate and chars/4 are tidemark's estimator on the same body.
            let view = RequestView::parse(&body).unwrap();
            let est = estimator.estimate(api.provider(), &view, Some(model));
            assert_eq!(r.estimate, est.tokens, "{ctx}");
            assert_eq!(r.chars4, est.chars / 4, "{ctx}");

            // error is (projection - real) / real of the printed numbers.
            let p = r
                .projection
                .unwrap_or_else(|| panic!("{ctx}: no projection"));
            let want = (p as f64 - real as f64) / real as f64 * 100.0;
            let got = r.error.unwrap_or_else(|| panic!("{ctx}: no error"));
            assert!(
                (got - want).abs() < 0.006,
                "{ctx}: printed {got}, computed {want}"
            );
            assert!(
                ["pass", "warn", "over"].contains(&r.decision.as_str()),
                "{ctx}"
            );
        }
    }

    // The behaviour the demo exists to show. These need the real usage tap,
    // estimator and sessions (not the placeholder stubs).
    for (name, rows) in &sessions {
        for r in rows.iter().filter(|r| r.turn >= 2) {
            assert_eq!(r.src, "anchored", "{name} turn {}: {}", r.turn, r.line);
        }
        for r in rows.iter().filter(|r| r.turn >= 3) {
            let e = r.error.unwrap();
            assert!(
                e.abs() < 2.0,
                "{name} turn {}: projection error {e}% (want < 2%)\n{stdout}",
                r.turn
            );
        }
    }
    story_acts_say_what_happened(&stdout, &stderr);
    let _ = std::fs::remove_dir_all(&dump);
}

/// The numbers of a line, commas read through (`31,504` is one number).
fn numbers(line: &str) -> Vec<u64> {
    let mut out = Vec::new();
    let mut cur: Option<u64> = None;
    let b = line.as_bytes();
    for (i, &c) in b.iter().enumerate() {
        match c {
            b'0'..=b'9' => cur = Some(cur.unwrap_or(0) * 10 + u64::from(c - b'0')),
            b',' if cur.is_some() && b.get(i + 1).is_some_and(u8::is_ascii_digit) => {}
            _ => {
                if let Some(n) = cur.take() {
                    out.push(n);
                }
            }
        }
    }
    out.extend(cur);
    out
}

/// The number right after `after` in `line`.
fn after(line: &str, after: &str) -> u64 {
    let at = line
        .find(after)
        .unwrap_or_else(|| panic!("{after:?} in {line}"));
    numbers(&line[at + after.len()..])[0]
}

/// The story's act lines, each checked for what it claims.
fn story_acts_say_what_happened(stdout: &str, stderr: &str) {
    let story = stdout
        .split("== the same agent, continued")
        .nth(1)
        .unwrap_or_else(|| panic!("the story follows the tables:\n{stdout}"));
    let line = |tag: &str| -> &str {
        story
            .lines()
            .find(|l| l.starts_with(tag))
            .unwrap_or_else(|| panic!("a line starting {tag:?}:\n{story}"))
    };
    let w = 32_000u64;

    // Act 1: refused by tidemark, in the provider's words, before the
    // provider would have refused it.
    let reject = line("reject  turn ");
    let refused_at = after(reject, "reject  turn ");
    assert!(
        reject.contains("refused by tidemark, never sent"),
        "{reject}"
    );
    assert!(
        reject.contains("x-tidemark-error: context-budget"),
        "{reject}"
    );
    let p = after(reject, "your messages resulted in ");
    assert_eq!(after(reject, "maximum context length is "), w, "{reject}");
    assert!(p as f64 > 0.95 * w as f64, "over the limit line: {reject}");
    let provider = after(reject, "The provider's own count of it: ");
    assert!(provider < w, "the provider would have taken it: {reject}");
    let compacted = line("        the agent compacted");
    assert!(compacted.contains("-> 1 summary"), "{compacted}");
    assert!(compacted.contains(&format!("turn {} projected", refused_at + 1)));
    assert!(compacted.contains("src=calibrated"), "{compacted}");
    assert!(
        compacted.contains(&format!("turn {} src=anchored", refused_at + 2)),
        "{compacted}"
    );

    // Act 2: trimmed, the provider answered, the cut's bust counted, then
    // the cut held.
    let trim = line("trim    turn ");
    let before = after(trim, "before=");
    let after_trim = after(trim, "after=");
    assert!(
        after_trim < before && before as f64 > 0.95 * w as f64,
        "{trim}"
    );
    assert!(after(trim, "the provider counted ") < w, "{trim}");
    let held = line("        the new cut cost the prompt cache ");
    assert!(after(held, "cost the prompt cache ") > 0, "{held}");
    assert!(held.contains("{cause=\"trim\"} 1)"), "{held}");
    assert!(held.ends_with(", 0 busts."), "{held}");

    // Act 3: the loss is loud.
    let loss = line("loss    turn ");
    let silent = after(loss, "loss    turn ");
    assert!(
        loss.contains(&format!("turn {}: src=lost", silent + 1)),
        "{loss}"
    );
    assert!(loss.contains("tidemark_anchor_lost_total 1"), "{loss}");
    assert!(loss.contains("anchor_losses 1 in /sessions"), "{loss}");
    assert!(loss.contains("src=anchored again"), "{loss}");
    assert!(
        stderr.contains("anchor lost") && stderr.contains("demo-story-trim"),
        "one WARN naming the session:\n{stderr}"
    );

    // Act 4: the bust, in tidemark's metrics as in the provider's accounting.
    let bust = line("bust    turn ");
    let read = after(bust, "The provider read ");
    let cached = after(bust, " of the ");
    let invalidated = after(bust, "tokens it had cached: ");
    assert!(invalidated > 0 && read + invalidated == cached, "{bust}");
    assert!(bust.contains("{cause=\"history\"} 1"), "{bust}");
    assert_eq!(
        after(bust, "tidemark_cache_invalidated_tokens_total +"),
        invalidated
    );
    assert_eq!(after(bust, "the provider's own accounting: "), invalidated);

    // What the same agent saw without tidemark.
    let without = story
        .split("without tidemark:")
        .nth(1)
        .unwrap_or_else(|| panic!("the closing summary:\n{story}"));
    let wall = line("  reject: the provider's own 400 at turn ");
    let wall_at = after(wall, "400 at turn ");
    assert!(wall_at > refused_at, "tidemark refused first: {wall}");
    for tag in ["  reject:", "  trim:", "  loss:", "  bust:"] {
        assert!(
            without.lines().any(|l| l.starts_with(tag)),
            "{tag} in the summary:\n{without}"
        );
    }
    assert!(line("  trim:").contains(&format!("400 at turn {wall_at}")));
    assert!(line("  loss:").contains("no sign of it"));
}

#[cfg(unix)]
#[tokio::test]
async fn keep_running_serves_until_sigterm() {
    let mut child = Command::new(BIN)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "demo",
            "--turns",
            "2",
            "--keep-running",
        ])
        .env("TIDEMARK_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn tidemark demo --keep-running");
    let stdout = child.stdout.take().unwrap();
    let mut lines = BufReader::new(stdout).lines();
    let (mut base, mut metrics, mut page) = (None, None, None);
    tokio::time::timeout(Duration::from_secs(120), async {
        // The sessions page first, to open while the scripted sessions run.
        let first = lines.next_line().await.unwrap().unwrap_or_default();
        page = first
            .strip_prefix("tidemark demo: live sessions page at ")
            .map(|u| u.trim().to_string());
        while let Some(l) = lines.next_line().await.unwrap() {
            let l = l.trim();
            if let Some(u) = l.strip_prefix("OpenAI base URL:") {
                base = Some(u.trim().to_string());
            }
            if let Some(u) = l.strip_prefix("metrics:") {
                metrics = Some(u.trim().to_string());
                break;
            }
        }
    })
    .await
    .expect("the URLs are printed");
    let page = page.expect("the sessions page's address on the first line");
    let base = base.expect("OpenAI base URL line");
    let metrics = metrics.expect("metrics line");
    assert!(base.ends_with("/v1") && !base.contains(":0/"), "{base}");

    // The printed URLs work: one request through the proxy, then the metrics.
    let client: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let req = http::Request::post(format!("{base}/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-test")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            br#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#,
        )))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("x-context-projection"));
    assert!(resp.headers().contains_key("x-sim-prompt-tokens"));
    let m = tokio::time::timeout(
        Duration::from_secs(20),
        client.get(metrics.parse().unwrap()),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(m.status(), 200);
    let p = tokio::time::timeout(Duration::from_secs(20), client.get(page.parse().unwrap()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.status(), 200, "{page}");
    assert!(p.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let html = tokio::time::timeout(Duration::from_secs(20), p.into_body().collect())
        .await
        .unwrap()
        .unwrap()
        .to_bytes();
    let html = String::from_utf8_lossy(&html);
    assert!(
        html.contains("data-key=\"demo-openai-chat-1\""),
        "the demo's sessions on the page"
    );

    let pid = child.id().expect("running").to_string();
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(st.success());
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("exits after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}
