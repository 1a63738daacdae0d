//! Which session a request belongs to (SPEC §4's precedence), through the
//! real proxy: a session header, the ids agents send of their own accord
//! (headers and body), the `previous_response_id` chain, the fingerprint;
//! `--no-agent-ids`; and a fingerprint made of content only.
mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use http::Request;
use serde_json::{json, Value};
use support::{client_h1, full, send, Proxy, TestClient};
use tidemark::sim::SimConfig;

/// A provider that answers every API with usage proportional to the body,
/// and numbers its Responses ids.
async fn scripted() -> support::Upstream {
    let n = Arc::new(AtomicU64::new(0));
    support::upstream(support::handler(move |req| {
        let path = req.uri().path().to_string();
        let tokens = 20 + req.body().len() as u64 / 4;
        let body = if path.ends_with("/responses") {
            let id = n.fetch_add(1, Ordering::Relaxed) + 1;
            json!({"id": format!("resp_{id}"), "object": "response", "status": "completed",
                "output": [], "usage": {"input_tokens": tokens, "output_tokens": 1, "total_tokens": tokens + 1}})
        } else if path.ends_with("/messages") {
            json!({"id": "msg_1", "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": "ok"}],
                "usage": {"input_tokens": tokens, "output_tokens": 1}})
        } else if path.contains(":generateContent") {
            json!({"candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]}}],
                "usageMetadata": {"promptTokenCount": tokens, "candidatesTokenCount": 1}})
        } else {
            json!({"id": "chatcmpl-1", "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": tokens, "completion_tokens": 1, "total_tokens": tokens + 1}})
        };
        http::Response::builder()
            .header("content-type", "application/json")
            .body(full(body.to_string()))
            .unwrap()
    }))
    .await
}

async fn call(
    c: &TestClient,
    px: &Proxy,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> String {
    let mut b = Request::post(px.url(path))
        .header("content-type", "application/json")
        .header("x-api-key", "sk-identity-test");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let (parts, _) = send(c, b.body(full(body.to_string())).unwrap()).await;
    assert_eq!(parts.status, 200, "{path} {body}");
    parts
        .headers
        .get("x-context-projection")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

/// Every session held: key -> (key_source, turns, lanes).
async fn sessions(c: &TestClient, px: &Proxy) -> Vec<(String, String, u64, usize)> {
    let (_, body) = support::get(c, &px.admin_url("/sessions?limit=1000")).await;
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["key"].as_str().unwrap().to_string(),
                s["key_source"].as_str().unwrap_or("missing").to_string(),
                s["turns"].as_u64().unwrap(),
                s["lanes"].as_array().map_or(0, Vec::len),
            )
        })
        .collect()
}

async fn session(c: &TestClient, px: &Proxy, key: &str) -> Option<Value> {
    let url = px.admin_url(&format!("/sessions/{}", key.replace(':', "%3A")));
    let (parts, body) = support::get(c, &url).await;
    (parts.status == 200).then(|| serde_json::from_slice(&body).unwrap())
}

fn anthropic(first: &str) -> Value {
    json!({"model": "claude-sonnet-4-5", "max_tokens": 16, "system": "You are terse.",
        "messages": [{"role": "user", "content": first}]})
}

fn responses(input: &str) -> Value {
    json!({"model": "gpt-5", "instructions": "Be brief.", "input": input})
}

const LEGACY_USER_ID: &str = "user_5dd07c33da27e6d2968d94ea20bf47a7b090b6b158b82328d54da2909a108e84_account__session_d2e70091-3007-41a3-a916-cb8b0d3098de";

/// (what, path, body, headers, key, source).
type Case = (
    &'static str,
    &'static str,
    Value,
    Vec<(&'static str, &'static str)>,
    Option<&'static str>,
    &'static str,
);

/// One request for each way of naming a session, and the key and source
/// each must get: (what, path, body, headers, key, source). `None` key: a
/// fingerprint.
fn cases() -> Vec<Case> {
    let with_user_id = |id: &str, first: &str| {
        let mut b = anthropic(first);
        b["metadata"] = json!({"user_id": id});
        b
    };
    let json_user_id =
        json!({"device_id": "3f4a", "account_uuid": "", "session_id": "2c4e1cf0-7a67-4d2e"})
            .to_string();
    let mut cached = responses("cache key");
    cached["prompt_cache_key"] = json!("019a-codex-thread");
    vec![
        (
            "session header",
            "/v1/messages",
            anthropic("a"),
            vec![("x-session-id", "hdr-1")],
            Some("hdr-1"),
            "header",
        ),
        (
            "claude code header",
            "/v1/messages",
            anthropic("b"),
            vec![("x-claude-code-session-id", "cc-3f1e")],
            Some("cc-3f1e"),
            "agent",
        ),
        (
            "codex header",
            "/v1/responses",
            responses("c"),
            vec![("session-id", "codex-77aa")],
            Some("codex-77aa"),
            "agent",
        ),
        (
            "codex header, older spelling",
            "/v1/responses",
            responses("c2"),
            vec![("session_id", "codex-old-1")],
            Some("codex-old-1"),
            "agent",
        ),
        (
            "metadata.user_id",
            "/v1/messages",
            with_user_id(LEGACY_USER_ID, "f"),
            vec![],
            Some("d2e70091-3007-41a3-a916-cb8b0d3098de"),
            "agent",
        ),
        (
            "metadata.user_id as JSON",
            "/v1/messages",
            with_user_id(&json_user_id, "g"),
            vec![],
            Some("2c4e1cf0-7a67-4d2e"),
            "agent",
        ),
        (
            "prompt_cache_key",
            "/v1/responses",
            cached,
            vec![],
            Some("019a-codex-thread"),
            "agent",
        ),
        (
            "header before agent",
            "/v1/messages",
            anthropic("d"),
            vec![
                ("x-claude-code-session-id", "cc-loses"),
                ("x-session-id", "hdr-wins"),
            ],
            Some("hdr-wins"),
            "header",
        ),
        (
            "agent header before body",
            "/v1/messages",
            with_user_id(LEGACY_USER_ID, "h"),
            vec![("x-claude-code-session-id", "cc-header-wins")],
            Some("cc-header-wins"),
            "agent",
        ),
        (
            "nothing",
            "/v1/messages",
            anthropic("e"),
            vec![],
            None,
            "fingerprint",
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_identity_names_its_session_and_says_how() {
    let up = scripted().await;
    let c = client_h1();
    for no_agent_ids in [false, true] {
        let route = format!("/v1/messages={}", up.url());
        let mut flags = vec!["--route", route.as_str()];
        if no_agent_ids {
            flags.push("--no-agent-ids");
        }
        let px = support::proxy(&up.url(), &flags).await;
        for (what, path, body, headers, key, source) in cases() {
            let before = sessions(&c, &px).await;
            call(&c, &px, path, &body, &headers).await;
            let after = sessions(&c, &px).await;
            let new: Vec<_> = after
                .iter()
                .filter(|s| !before.contains(s) && s.2 == 1)
                .collect();
            assert_eq!(new.len(), 1, "{what}: one new session: {after:?}");
            let (got_key, got_source, _, lanes) = new[0];
            // --no-agent-ids: what an agent sends of its own accord names nothing.
            let (key, source) = match (no_agent_ids, source) {
                (true, "agent") => (None, "fingerprint"),
                _ => (key, source),
            };
            assert_eq!(got_source, source, "{what} (--no-agent-ids {no_agent_ids})");
            match key {
                Some(k) => assert_eq!(got_key, k, "{what}"),
                None => assert!(got_key.starts_with("fp:"), "{what}: {got_key}"),
            }
            let obj = session(&c, &px, got_key)
                .await
                .expect("GET /sessions/{key}");
            assert_eq!(obj["key_source"], source, "{what}");
            assert_eq!(*lanes, 1, "{what}");
        }
        px.stop().await;
    }
}

/// Without any other id, a `previous_response_id` continues the session
/// (and lane) of the response it names; with a session header, the header
/// names the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chain_continues_its_responses_session() {
    let up = scripted().await;
    let c = client_h1();
    let px = support::proxy(&up.url(), &[]).await;
    let first = call(
        &c,
        &px,
        "/v1/responses",
        &responses("start of a chain"),
        &[],
    )
    .await;
    assert!(first.contains("src="), "{first}");
    let listed = sessions(&c, &px).await;
    assert_eq!(listed.len(), 1);
    let fp = listed[0].0.clone();
    assert!(fp.starts_with("fp:"));
    // resp_1 answered it; the next turn carries only its new input.
    let mut next =
        json!({"model": "gpt-5", "input": "and then?", "previous_response_id": "resp_1"});
    let p = call(&c, &px, "/v1/responses", &next, &[]).await;
    assert!(p.contains("src=anchored"), "chained turn: {p}");
    let s = session(&c, &px, &fp).await.unwrap();
    assert_eq!(s["key_source"], "chain");
    assert_eq!(s["turns"], 2);
    assert_eq!(s["lanes"].as_array().unwrap().len(), 1, "{s}");
    assert_eq!(sessions(&c, &px).await.len(), 1);
    // A session header names its own session, chain or not.
    next["previous_response_id"] = json!("resp_2");
    call(
        &c,
        &px,
        "/v1/responses",
        &next,
        &[("x-session-id", "named")],
    )
    .await;
    let s = session(&c, &px, "named")
        .await
        .expect("the header's session");
    assert_eq!(s["key_source"], "header");
    assert_eq!(session(&c, &px, &fp).await.unwrap()["turns"], 2);
    px.stop().await;
}

/// An agent's own id is capped like a header's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_ids_are_capped_like_header_keys() {
    let up = scripted().await;
    let c = client_h1();
    let route = format!("/v1/messages={}", up.url());
    let px = support::proxy(&up.url(), &["--route", &route]).await;
    let mut b = responses("long key");
    b["prompt_cache_key"] = json!("a".repeat(1_000));
    call(&c, &px, "/v1/responses", &b, &[]).await;
    let long = "b".repeat(1_000);
    call(
        &c,
        &px,
        "/v1/messages",
        &anthropic("long header"),
        &[("x-claude-code-session-id", &long)],
    )
    .await;
    let listed = sessions(&c, &px).await;
    assert_eq!(listed.len(), 2, "{listed:?}");
    for (key, source, _, _) in listed {
        assert_eq!(source, "agent");
        assert_eq!(key.len(), tidemark::session::identity::MAX_SESSION_KEY);
    }
    px.stop().await;
}

/// Anthropic agents move `cache_control` to the newest message each turn:
/// the first user message's bytes change between turns 1 and 2, its
/// content does not. One conversation stays one fingerprinted session
/// with one lane, anchored from turn 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moving_cache_control_keeps_one_fingerprint() {
    let sim = support::sim(SimConfig::default()).await;
    let sim_url = sim.url.clone();
    let route = format!("/v1/messages={sim_url}");
    let px = support::proxy(&sim_url, &["--route", &route]).await;
    let c = client_h1();
    let marker = json!({"type": "ephemeral"});
    let text = |t: &str| json!({"type": "text", "text": t});
    let mut messages: Vec<Value> = Vec::new();
    for turn in 1..=3 {
        // The marker leaves every earlier message and sits on the newest.
        for m in messages.iter_mut() {
            if let Some(blocks) = m["content"].as_array_mut() {
                for b in blocks {
                    b.as_object_mut().unwrap().remove("cache_control");
                }
            }
        }
        let mut last = text(&format!("turn {turn}: please look at file {turn}.rs"));
        last["cache_control"] = marker.clone();
        messages.push(json!({"role": "user", "content": [last]}));
        let mut system = text("You are a careful coding agent.");
        system["cache_control"] = marker.clone();
        let body = json!({"model": "claude-sonnet-4-5", "max_tokens": 32,
            "system": [system], "messages": messages});
        let p = call(&c, &px, "/v1/messages", &body, &[]).await;
        if turn >= 2 {
            assert!(p.contains("src=anchored"), "turn {turn}: {p}");
        }
        messages.push(json!({"role": "assistant", "content": [text(&format!("done {turn}"))]}));
    }
    let listed = sessions(&c, &px).await;
    assert_eq!(listed.len(), 1, "one conversation, one session: {listed:?}");
    let (key, source, turns, lanes) = &listed[0];
    assert!(key.starts_with("fp:"), "{key}");
    assert_eq!((source.as_str(), *turns, *lanes), ("fingerprint", 3, 1));
    px.stop().await;
}

/// Gemini takes `system_instruction` as well as `systemInstruction`; the
/// fingerprint reads the same table of counted fields as the estimator, so
/// two conversations that differ only there are two sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_system_instruction_is_part_of_the_fingerprint() {
    let up = scripted().await;
    let c = client_h1();
    let px = support::proxy(&up.url(), &[]).await;
    let path = "/v1beta/models/gemini-2.5-flash:generateContent";
    for system in ["You answer in French.", "You answer in German."] {
        let body = json!({"system_instruction": {"parts": [{"text": system}]},
            "contents": [{"role": "user", "parts": [{"text": "Hello"}]}]});
        call(&c, &px, path, &body, &[]).await;
    }
    let listed = sessions(&c, &px).await;
    assert_eq!(
        listed.len(),
        2,
        "two system prompts, two sessions: {listed:?}"
    );
    px.stop().await;
}

#[test]
fn no_agent_ids_turns_agent_ids_off() {
    let on = tidemark::Config::from_args(["tidemark", "--no-agent-ids"]).unwrap();
    assert!(!on.agent_ids);
    let off = tidemark::Config::from_args(["tidemark"]).unwrap();
    assert!(off.agent_ids);
}
