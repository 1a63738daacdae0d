//! Lanes (SPEC §4): one agent session carries its main loop, side calls on
//! another model and sub-agents with their own system prompt; each is a
//! lane with its own anchor, calibration and projection, and none disturbs
//! another. Through the real proxy in front of the simulated provider (its
//! own tokenizer, so the drift is real), or a scripted one.
mod support;

use std::collections::HashMap;

use http::Request;
use serde_json::{json, Value};
use support::{client_h1, full, send, Proxy, TestClient};
use tidemark::sim::{self, SimApi, SimConfig, X_SIM_PROMPT_TOKENS};

async fn proxy(upstream: &str, extra: &[&str]) -> Proxy {
    let route = format!("/v1/messages={upstream}");
    let mut flags = vec!["--route", route.as_str()];
    flags.extend_from_slice(extra);
    support::proxy(upstream, &flags).await
}

/// The answer as a client sees it.
#[derive(Debug, Clone)]
struct Answer {
    tokens: u64,
    src: String,
    real: u64,
}

impl Answer {
    fn err_pct(&self) -> f64 {
        (self.tokens as f64 - self.real as f64).abs() / self.real as f64 * 100.0
    }
}

async fn ask(c: &TestClient, px: &Proxy, session: &str, body: &Value) -> Answer {
    let req = Request::post(px.url("/v1/messages"))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-ant-lanes")
        .header("x-session-id", session)
        .body(full(body.to_string()))
        .unwrap();
    let (parts, bytes) = send(c, req).await;
    assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&bytes));
    let h = |n: &str| {
        parts
            .headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let projection = h("x-context-projection");
    let tokens = projection
        .split(';')
        .next()
        .and_then(|t| t.parse().ok())
        .expect("projection tokens");
    let src = projection
        .split(';')
        .find_map(|p| p.strip_prefix("src="))
        .expect("src")
        .to_string();
    let real = h(X_SIM_PROMPT_TOKENS).parse().expect("the sim's count");
    Answer { tokens, src, real }
}

async fn session(c: &TestClient, px: &Proxy, key: &str) -> Value {
    let (parts, body) = support::get(c, &px.admin_url(&format!("/sessions/{key}"))).await;
    assert_eq!(parts.status, 200);
    serde_json::from_slice(&body).unwrap()
}

/// Words of uneven length, `n` of them, told apart by `salt`.
fn words(n: u64, salt: u64) -> String {
    (0..n)
        .map(|w| format!("w{}x{salt} ", (w * 31 + salt * 17) % 997))
        .collect()
}

/// A conversation of `model` under `system`, opened by `first`, at turn
/// `t`: every earlier turn plus a new user message of uneven size.
fn conversation(model: &str, system: &str, first: &str, t: u64, scale: u64) -> Value {
    let mut messages = vec![json!({"role": "user", "content": first})];
    for i in 1..t {
        messages.push(json!({"role": "assistant", "content": format!("noted {i}: continuing.")}));
        let n = scale + (i * 7919) % (4 * scale);
        messages.push(json!({"role": "user", "content": words(n, i)}));
    }
    json!({"model": model, "max_tokens": 64, "system": system, "messages": messages})
}

const MAIN: &str = "claude-sonnet-4-5";
const SIDE: &str = "claude-haiku-4-5";

fn main_loop(t: u64) -> Value {
    conversation(
        MAIN,
        "You are the main coding agent. Use tools carefully.",
        "Refactor the session store, please.",
        t,
        100,
    )
}

/// A short side call on another model: titles and summaries.
fn side_call(t: u64) -> Value {
    conversation(
        SIDE,
        "You write a five-word title for a conversation.",
        "Title this: refactor the session store.",
        t,
        10,
    )
}

/// A sub-agent on the main model with a system prompt of its own.
fn sub_agent(t: u64) -> Value {
    conversation(
        MAIN,
        "You are a search sub-agent. Find files and report their paths.",
        "Find where anchors are stored.",
        t,
        60,
    )
}

/// Each lane's answers, alone in a process and interleaved with the
/// others under one session id: the main loop is anchored from its second
/// turn and projects exactly as it does alone, and so does the side call
/// (another model). The sub-agent, on the main model, starts each content
/// class from the ratio the main loop taught the model, which alone it did
/// not have; that prior stays part of its fit, so from its third turn it
/// projects as it does alone within a token or two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn side_calls_and_a_sub_agent_leave_the_main_lane_as_it_is_alone() {
    // Load the sim's tokenizer before any request waits on it.
    tokio::task::spawn_blocking(|| sim::count_prompt(SimApi::Anthropic, &main_loop(1)))
        .await
        .unwrap();
    let sim = support::sim(SimConfig::default()).await;
    let c = client_h1();
    let turns = 8u64;
    let sub_turns = 4u64;
    let mut alone: HashMap<&str, Vec<Answer>> = HashMap::new();
    for (lane, n) in [("main", turns), ("side", turns), ("sub", sub_turns)] {
        let px = proxy(&sim.url, &[]).await;
        let mut answers = Vec::new();
        for t in 1..=n {
            let body = match lane {
                "main" => main_loop(t),
                "side" => side_call(t),
                _ => sub_agent(t),
            };
            answers.push(ask(&c, &px, &format!("alone-{lane}"), &body).await);
        }
        alone.insert(lane, answers);
        px.stop().await;
    }

    let px = proxy(&sim.url, &[]).await;
    let mut mixed: HashMap<&str, Vec<Answer>> = HashMap::new();
    for t in 1..=turns {
        let key = "agent-1";
        let a = ask(&c, &px, key, &main_loop(t)).await;
        mixed.entry("main").or_default().push(a);
        let a = ask(&c, &px, key, &side_call(t)).await;
        mixed.entry("side").or_default().push(a);
        if (3..3 + sub_turns).contains(&t) {
            let a = ask(&c, &px, key, &sub_agent(t - 2)).await;
            mixed.entry("sub").or_default().push(a);
        }
    }
    for (lane, from) in [("main", 1), ("side", 1), ("sub", 3)] {
        for (i, (m, a)) in mixed[lane].iter().zip(&alone[lane]).enumerate() {
            let t = i + 1;
            if t >= 2 {
                assert_eq!(m.src, "anchored", "{lane} turn {t}: {m:?}");
            }
            if t >= from && lane != "sub" {
                assert_eq!(
                    (m.tokens, m.real),
                    (a.tokens, a.real),
                    "{lane} turn {t}: projected as alone ({:.2}% against {:.2}%)",
                    m.err_pct(),
                    a.err_pct()
                );
            }
            if t >= from && lane == "sub" {
                assert_eq!(m.real, a.real, "{lane} turn {t}: the same request");
                let off = m.tokens.abs_diff(a.tokens);
                assert!(
                    off <= 2.max(m.real / 1000),
                    "{lane} turn {t}: {} projected, {} alone, {} real",
                    m.tokens,
                    a.tokens,
                    m.real
                );
            }
            if t >= 3 {
                assert!(m.err_pct() < 1.0, "{lane} turn {t}: {m:?}");
            }
        }
    }

    let s = session(&c, &px, "agent-1").await;
    let lanes = s["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 3, "{s}");
    assert_eq!(s["turns"], 2 * turns + sub_turns, "turns add up over lanes");
    assert_eq!(s["compactions"], 0, "{s}");
    let mut lane_turns: Vec<u64> = lanes.iter().map(|l| l["turns"].as_u64().unwrap()).collect();
    lane_turns.sort();
    assert_eq!(lane_turns, vec![sub_turns, turns, turns]);
    for l in lanes {
        assert_eq!(l["state"], "anchored", "{l}");
        assert_eq!(l["anchor_losses"], 0, "{l}");
    }
    // The top is the lane that served the latest request: the side call.
    assert_eq!(s["model"], SIDE);
    assert_eq!(s["lane"], lanes[0]["id"]);
    let (_, metrics) = support::get(&c, &px.admin_url("/metrics")).await;
    let held = String::from_utf8_lossy(&metrics)
        .lines()
        .find_map(|l| l.strip_prefix("tidemark_lanes "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .expect("tidemark_lanes exported");
    assert!(held >= 3.0, "tidemark_lanes {held}");
    px.stop().await;
}

/// The main loop's own compaction (a summary as the new first message,
/// same model and system prompt, smaller than where the loop stood) is
/// counted against the main lane and starts the new lane from its ratio;
/// a sub-agent that starts small is not a compaction, and the old lane
/// keeps its anchor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_main_loops_compaction_is_told_apart_from_a_sub_agent() {
    tokio::task::spawn_blocking(|| sim::count_prompt(SimApi::Anthropic, &main_loop(1)))
        .await
        .unwrap();
    let sim = support::sim(SimConfig::default()).await;
    let c = client_h1();
    let px = proxy(&sim.url, &[]).await;
    let key = "agent-2";
    for t in 1..=6 {
        let a = ask(&c, &px, key, &main_loop(t)).await;
        if t >= 2 {
            assert_eq!(a.src, "anchored", "turn {t}");
        }
    }
    // A sub-agent, small and on the same model: a lane of its own.
    let a = ask(&c, &px, key, &sub_agent(1)).await;
    assert_ne!(a.src, "lost");
    assert_eq!(session(&c, &px, key).await["compactions"], 0);

    // The compaction: the same system prompt, a summary first.
    let summary = format!(
        "This session continues an earlier one. Summary: {}",
        words(80, 99)
    );
    let compacted = |t: u64| {
        conversation(
            MAIN,
            "You are the main coding agent. Use tools carefully.",
            &summary,
            t,
            100,
        )
    };
    let a = ask(&c, &px, key, &compacted(2)).await;
    assert_eq!(
        a.src, "calibrated",
        "starts from the main lane's ratio: {a:?}"
    );
    assert!(a.err_pct() < 3.0, "{a:?}");
    let s = session(&c, &px, key).await;
    assert_eq!(s["compactions"], 1, "{s}");
    let a = ask(&c, &px, key, &compacted(3)).await;
    assert_eq!(a.src, "anchored");
    assert!(a.err_pct() < 1.0, "{a:?}");

    let s = session(&c, &px, key).await;
    let lanes = s["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 3, "old main, sub-agent, compacted main: {s}");
    // The old main lane still holds its anchor: had it been a sub-agent
    // after all, it would go on anchored.
    let a = ask(&c, &px, key, &main_loop(7)).await;
    assert_eq!(a.src, "anchored", "{a:?}");
    assert_eq!(session(&c, &px, key).await["compactions"], 1);
    px.stop().await;
}

/// A provider that edits the context on its side (Anthropic
/// `clear_tool_uses`): from turn 5 on it clears a fixed part of the
/// history and says so in `message_delta`, so its count drops while the
/// body keeps growing. It counts with the simulated provider's tokenizer.
async fn editing_upstream(cleared: u64, from_turn: usize) -> support::Upstream {
    support::upstream(support::handler(move |req| {
        let body: Value = serde_json::from_slice(req.body()).unwrap();
        let turn = body["messages"]
            .as_array()
            .map_or(1, |m| m.len().div_ceil(2));
        let full_count = sim::count_prompt(SimApi::Anthropic, &body).total;
        let edit = turn >= from_turn;
        let real = if edit {
            full_count - cleared
        } else {
            full_count
        };
        let edits = match edit {
            true => json!({"applied_edits": [{"type": "clear_tool_uses_20250919",
                "cleared_tool_uses": 2, "cleared_input_tokens": cleared}]}),
            false => json!({"applied_edits": []}),
        };
        let events = [
            (
                "message_start",
                json!({"type": "message_start", "message": {"id": "msg_1",
                "type": "message", "role": "assistant", "content": [], "model": MAIN,
                "usage": {"input_tokens": real, "output_tokens": 1}}}),
            ),
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}}),
            ),
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": "ok"}}),
            ),
            (
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ),
            (
                "message_delta",
                json!({"type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                "usage": {"output_tokens": 3}, "context_management": edits}),
            ),
            ("message_stop", json!({"type": "message_stop"})),
        ];
        let sse: String = events
            .iter()
            .map(|(e, d)| format!("event: {e}\ndata: {d}\n\n"))
            .collect();
        http::Response::builder()
            .header("content-type", "text/event-stream")
            .header(X_SIM_PROMPT_TOKENS, real.to_string())
            .body(full(sse))
            .unwrap()
    }))
    .await
}

/// Server-side context editing makes the provider's count drop while the
/// body does not: the lane re-anchors on the edited count, and that is no
/// anchor loss, no compaction and no calibration sample (a sample across
/// the edit would teach a ratio far below the tokenizer's and throw the
/// next turns off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_providers_own_context_edit_re_anchors_and_teaches_nothing() {
    tokio::task::spawn_blocking(|| sim::count_prompt(SimApi::Anthropic, &main_loop(1)))
        .await
        .unwrap();
    let up = editing_upstream(300, 5).await;
    let c = client_h1();
    let px = proxy(&up.url(), &[]).await;
    let key = "edited";
    let stream = |t: u64| {
        let mut b = main_loop(t);
        b["stream"] = json!(true);
        b
    };
    let mut calibration_before = None;
    for t in 1..=9 {
        let a = ask(&c, &px, key, &stream(t)).await;
        if t >= 2 {
            assert_eq!(a.src, "anchored", "turn {t}: {a:?}");
        }
        // Turn 5 is the edit itself: nobody could have seen it coming.
        if t >= 3 && t != 5 {
            assert!(a.err_pct() < 1.0, "turn {t}: {a:?}");
        }
        let s = session(&c, &px, key).await;
        if t == 4 {
            calibration_before = s["calibration"].as_f64();
        }
        if t >= 5 {
            let cal = s["calibration"].as_f64().unwrap();
            let before = calibration_before.unwrap();
            assert!(
                (cal - before).abs() < 0.02,
                "turn {t}: calibration {cal} after the edit, {before} before"
            );
        }
    }
    let s = session(&c, &px, key).await;
    assert_eq!(s["anchor_losses"], 0, "{s}");
    assert_eq!(s["compactions"], 0, "{s}");
    assert_eq!(s["state"], "anchored");
    assert_eq!(s["lanes"].as_array().unwrap().len(), 1);
    px.stop().await;
}
