//! Trimmer speed on a ~400 KB agent history (chat completions, 40 turns of
//! tool calls with 4-10 KB outputs): trims to a half and a tenth of the estimate with the
//! estimator as the ruler, its cache warm as the proxy's is when it trims
//! (it has just estimated the request).
//!
//! Both ways: each cut weighed by estimating its body whole
//! (`trim::trim` with the estimator as the ruler), and by adding up its
//! elements' cached counts (`trim::trim_estimated`, what the proxy does).
//!
//!     cargo run --release --example trim_bench

use std::time::{Duration, Instant};

use serde_json::json;
use tidemark::estimate::{Estimate, Estimator};
use tidemark::json::RequestView;
use tidemark::policy::trim::Trimmed;
use tidemark::provider::Api;

fn body() -> Vec<u8> {
    let mut msgs =
        vec![json!({"role": "system", "content": "You are a coding agent. ".repeat(40)})];
    for t in 0..40 {
        msgs.push(json!({"role": "user", "content": format!("Turn {t}: fix the failing test in module {t}. ").repeat(6)}));
        for s in 0..3 {
            let id = format!("call_{t}_{s}");
            msgs.push(json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": "read_file", "arguments": format!("{{\"path\":\"src/m{t}/f{s}.rs\"}}")}}
            ]}));
            let out = format!(
                "fn step_{t}_{s}(x: u32) -> u32 {{ x.wrapping_mul({s}) }} // \"quoted\" ünïcødé\n"
            )
            .repeat(40 + 25 * s);
            msgs.push(json!({"role": "tool", "tool_call_id": id, "content": out}));
        }
        msgs.push(
            json!({"role": "assistant", "content": format!("Done with turn {t}. ").repeat(20)}),
        );
    }
    serde_json::to_vec(&json!({"model": "gpt-4o", "stream": true, "messages": msgs}))
        .unwrap_or_default()
}

fn main() {
    let body = body();
    let est = Estimator::new(64 << 20);
    let model = Some("gpt-4o");
    let full = est
        .estimate_body(Api::OpenAiChat, &body, model)
        .map_or(0, |e| e.tokens);
    println!("history: {} bytes, {full} tokens", body.len());
    for div in [2, 10] {
        run(&est, &body, full / div, div);
    }
}

fn run(est: &Estimator, body: &[u8], need: u64, div: u64) {
    let model = Some("gpt-4o");
    let measure = |b: &[u8]| -> u64 {
        est.estimate_body(Api::OpenAiChat, b, model)
            .map_or(u64::MAX, |e| e.tokens)
    };
    let whole = time(|| tidemark::policy::trim::trim(Api::OpenAiChat, body, &measure, need, None));
    let tokens = |e: &Estimate| e.tokens;
    let parts = time(|| {
        let view = RequestView::parse(body)?;
        let p = None;
        tidemark::policy::trim::trim_estimated(
            est,
            Api::OpenAiChat,
            &view,
            model,
            &tokens,
            need,
            need,
            p,
        )
        .map(|(t, _)| t)
    });
    for (name, (times, t)) in [("bodies estimated whole", whole), ("parts added up", parts)] {
        let Some(t) = t else {
            println!("trim to 1/{div}: nothing trimmed");
            continue;
        };
        let after = est
            .estimate_body(Api::OpenAiChat, &t.body, model)
            .map_or(0, |e| e.tokens);
        println!(
            "trim to 1/{div} ({need} tokens), {name}: p50 {:.2} ms, min {:.2} ms ({} bytes, {after} tokens, turns {}, tool results {})",
            times[times.len() / 2].as_secs_f64() * 1e3,
            times[0].as_secs_f64() * 1e3,
            t.body.len(),
            t.turns,
            t.tool_results
        );
    }
}

/// Twenty runs of `f`, sorted, and its last result.
fn time(f: impl Fn() -> Option<Trimmed>) -> (Vec<Duration>, Option<Trimmed>) {
    let mut times = Vec::new();
    let mut out = None;
    for _ in 0..20 {
        let t = Instant::now();
        out = f();
        times.push(t.elapsed());
    }
    times.sort();
    (times, out)
}
