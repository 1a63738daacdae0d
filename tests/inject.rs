//! Usage injection for OpenAI chat streams, end to end: the upstream gets
//! `stream_options.include_usage`, the client gets the bytes it would have
//! got without it, and the proxy still learns the real prompt size.

mod support;

use bytes::{Bytes, BytesMut};
use http::Response;
use serde_json::Value;
use support::*;
use tidemark::provider::{Api, Framing};
use tidemark::tap::inject::UsageStripper;
use tidemark::tap::usage::UsageReader;

const PROMPT_TOKENS: u64 = 777;

/// What the upstream sends when asked for usage, built from a stream that was
/// not: `"usage":null` after `choices` in every chunk (where OpenAI puts it),
/// and a usage-only chunk before `[DONE]`, using the stream's own line ends.
fn with_option(no_usage: &[u8]) -> Vec<u8> {
    let text = std::str::from_utf8(no_usage).unwrap();
    let nl = if text.contains("\r\n") { "\r\n" } else { "\n" };
    let mut out = String::new();
    let mut id = String::from("chatcmpl-x");
    for line in text.split_inclusive('\n') {
        let (body, end) = match line.strip_suffix(nl) {
            Some(b) => (b, nl),
            None => (line, ""),
        };
        if body == "data: [DONE]" {
            out.push_str(&format!(
                "data: {{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{PROMPT_TOKENS},\"completion_tokens\":5,\"total_tokens\":{}}}}}{nl}{nl}",
                PROMPT_TOKENS + 5
            ));
            out.push_str(line);
            continue;
        }
        match body.strip_prefix("data: {") {
            Some(_) => {
                let v: Value = serde_json::from_str(&body[6..]).unwrap();
                if let Some(i) = v["id"].as_str() {
                    id = i.to_string();
                }
                let at = body.rfind(",\"obfuscation\"").unwrap_or(body.len() - 1);
                out.push_str(&body[..at]);
                out.push_str(",\"usage\":null");
                out.push_str(&body[at..]);
                out.push_str(end);
            }
            None => out.push_str(line),
        }
    }
    out.into_bytes()
}

fn no_usage_streams() -> Vec<(&'static str, Vec<u8>)> {
    let chat = fixture("openai-chat/stream_no_usage.sse").to_vec();
    let crlf = String::from_utf8(chat.clone())
        .unwrap()
        .replace('\n', "\r\n")
        .replace(
            "\r\n\r\ndata: {\"id\"",
            "\r\n\r\n: OPENROUTER PROCESSING\r\n\r\ndata: {\"id\"",
        )
        .into_bytes();
    vec![
        ("openai-chat/stream_no_usage.sse", chat),
        (
            "ollama/v1_chat_stream_no_usage.sse",
            fixture("ollama/v1_chat_stream_no_usage.sse").to_vec(),
        ),
        ("crlf + comments", crlf),
    ]
}

fn strip(input: &[u8], cuts: &[usize]) -> Vec<u8> {
    let mut s = UsageStripper::new();
    let mut out = BytesMut::new();
    let mut at = 0;
    for &c in cuts.iter().chain(std::iter::once(&input.len())) {
        s.push(&input[at..c], &mut out);
        at = c;
    }
    s.finish(&mut out);
    out.to_vec()
}

#[test]
fn stripping_gives_back_the_stream_without_the_option_at_every_split() {
    for (name, plain) in no_usage_streams() {
        let with = with_option(&plain);
        assert_ne!(with, plain);
        assert_eq!(
            memchr::memmem::find_iter(&with, b"\"usage\":null").count(),
            memchr::memmem::find_iter(&plain, b"data: {").count(),
            "{name}: every chunk got its null"
        );
        assert_eq!(strip(&with, &[]), plain, "{name} whole");
        for i in 0..=with.len() {
            assert_eq!(strip(&with, &[i]), plain, "{name} cut at {i}");
        }
        for step in [1, 2, 3, 5, 64] {
            let cuts: Vec<usize> = (step..with.len()).step_by(step).collect();
            assert_eq!(strip(&with, &cuts), plain, "{name} in {step}-byte pieces");
        }
        // and the reader, watching the upstream's bytes, sees the usage.
        let mut r = UsageReader::new(Api::OpenAiChat.provider(), Framing::Sse, None);
        r.feed(&with);
        let o = r.finish();
        assert_eq!(
            o.observed.usage.total_context,
            Some(PROMPT_TOKENS),
            "{name}"
        );
        assert_eq!(o.parse_errors, 0);
    }
}

#[test]
fn stripping_a_real_usage_stream_leaves_no_usage_key() {
    for f in [
        "openai-chat/stream_basic_with_usage.sse",
        "openai-chat/stream_tool_calls_with_usage.sse",
    ] {
        let with = fixture(f);
        let out = strip(&with, &[with.len() / 3]);
        assert!(memchr::memmem::find(&out, b"usage").is_none(), "{f}");
        assert!(out.ends_with(b"data: [DONE]\n\n"), "{f}");
        // Only the usage member, its comma and the usage chunk went.
        let events = |b: &[u8]| memchr::memmem::find_iter(b, b"\n\n").count();
        assert_eq!(events(&out) + 1, events(&with), "{f}");
    }
}

fn sse(chunks: Vec<Bytes>) -> Response<Body> {
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(chunked(chunks))
        .unwrap()
}

/// The upstream's bytes cut at odd places, so the stripper works across chunks.
fn pieces(b: &[u8]) -> Vec<Bytes> {
    b.chunks(97).map(Bytes::copy_from_slice).collect()
}

fn asked_for_usage(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["stream_options"]["include_usage"].as_bool())
        == Some(true)
}

/// The value of one counter series in the admin `/metrics` text.
async fn metric(p: &Proxy, name: &str, model: &str) -> u64 {
    let (_, body) = get(&client_h1(), &p.admin_url("/metrics")).await;
    let text = String::from_utf8_lossy(&body).into_owned();
    let label = format!("model=\"{model}\"");
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// Bounded poll: the tap records when the body ends, just before the client sees the end.
async fn metric_reaches(p: &Proxy, name: &str, model: &str, want: u64) -> u64 {
    let mut got = 0;
    for _ in 0..200 {
        got = metric(p, name, model).await;
        if got >= want {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gets_the_plain_stream_and_the_proxy_gets_usage() {
    let plain = fixture("openai-chat/stream_no_usage.sse");
    let with = Bytes::from(with_option(&plain));
    let (p2, w2) = (plain.clone(), with.clone());
    let up = upstream(handler(move |req| {
        if asked_for_usage(req.body()) {
            sse(pieces(&w2))
        } else {
            sse(pieces(&p2))
        }
    }))
    .await;
    let proxy = proxy(&up.url(), &[]).await;
    let c = client_h1();

    // A client that did not ask: identical bytes to the no-option stream.
    let req =
        r#"{"model":"gpt-4o-inject-a","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let (parts, body) = post_json(&c, &proxy.url("/v1/chat/completions"), req).await;
    assert_eq!(parts.status, 200);
    assert_eq!(
        body, plain,
        "client bytes equal the stream without the option"
    );
    let (_, sent) = up.seen.last();
    assert_eq!(
        sent,
        Bytes::from(req.replace("}]}", "}],\"stream_options\":{\"include_usage\":true}}")),
        "the request was edited, not re-serialised"
    );
    assert_eq!(
        metric_reaches(
            &proxy,
            "tidemark_prompt_tokens_real_total",
            "gpt-4o-inject-a",
            PROMPT_TOKENS
        )
        .await,
        PROMPT_TOKENS
    );

    // A client that asked itself: its body untouched, the usage chunk delivered.
    let req = r#"{"model":"gpt-4o-inject-b","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#;
    let (parts, body) = post_json(&c, &proxy.url("/v1/chat/completions"), req).await;
    assert_eq!(parts.status, 200);
    assert_eq!(body, with, "a client that asked gets everything");
    assert_eq!(up.seen.last().1, Bytes::from(req));
    assert_eq!(
        metric_reaches(
            &proxy,
            "tidemark_prompt_tokens_real_total",
            "gpt-4o-inject-b",
            PROMPT_TOKENS
        )
        .await,
        PROMPT_TOKENS
    );

    // --no-inject-usage: forwarded as sent, no usage learned.
    let proxy2 = support::proxy(&up.url(), &["--no-inject-usage"]).await;
    let req = r#"{"model":"gpt-4o-inject-c","stream":true,"messages":[]}"#;
    let (_, body) = post_json(&c, &proxy2.url("/v1/chat/completions"), req).await;
    assert_eq!(body, plain);
    assert_eq!(up.seen.last().1, Bytes::from(req));
    proxy2.stop().await;
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_refuses_stream_options_is_retried_once_and_remembered() {
    let plain = fixture("openai-chat/stream_no_usage.sse");
    let p2 = plain.clone();
    let up = upstream(handler(move |req| {
        if memchr::memmem::find(req.body(), b"stream_options").is_some() {
            Response::builder()
                .status(400)
                .header("content-type", "application/json")
                .body(full(
                    r#"{"error":{"message":"Unrecognized request argument supplied: stream_options","type":"invalid_request_error","param":null,"code":null}}"#,
                ))
                .unwrap()
        } else {
            sse(pieces(&p2))
        }
    }))
    .await;
    let proxy = proxy(&up.url(), &[]).await;
    let c = client_h1();
    let req =
        r#"{"model":"gpt-4o-inject-d","stream":true,"messages":[{"role":"user","content":"hi"}]}"#;

    // The client's headers go with both tries (the first is sent with a
    // copy of them, the retry with them).
    let with_headers = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-inject-retry")
        .header("x-trace-id", "t-42")
        .body(full(req.to_string()))
        .unwrap();
    let (parts, body) = send(&c, with_headers).await;
    assert_eq!(parts.status, 200);
    assert_eq!(body, plain);
    assert_eq!(up.seen.count(), 2, "one refused try, one retry");
    assert!(asked_for_usage(&up.seen.requests.lock().unwrap()[0].1));
    assert_eq!(
        up.seen.last().1,
        Bytes::from(req),
        "the retry is the client's body"
    );
    for (i, (seen, _)) in up.seen.requests.lock().unwrap().iter().enumerate() {
        assert_eq!(
            seen.headers["authorization"], "Bearer sk-inject-retry",
            "try {i}"
        );
        assert_eq!(seen.headers["x-trace-id"], "t-42", "try {i}");
        assert_eq!(seen.headers["content-type"], "application/json", "try {i}");
    }

    let (parts, body) = post_json(&c, &proxy.url("/v1/chat/completions"), req).await;
    assert_eq!(parts.status, 200);
    assert_eq!(body, plain);
    assert_eq!(up.seen.count(), 3, "remembered: no second injection");
    assert_eq!(up.seen.last().1, Bytes::from(req));
    proxy.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrelated_400_reaches_the_client_unchanged() {
    let err = r#"{"error":{"message":"bad model","type":"invalid_request_error","param":"model","code":null}}"#;
    let up = upstream(handler(move |_req| {
        Response::builder()
            .status(400)
            .header("content-type", "application/json")
            .body(full(err))
            .unwrap()
    }))
    .await;
    let proxy = proxy(&up.url(), &[]).await;
    let req = r#"{"model":"gpt-4o-inject-e","stream":true,"messages":[]}"#;
    let (parts, body) = post_json(&client_h1(), &proxy.url("/v1/chat/completions"), req).await;
    assert_eq!(parts.status, 400);
    assert_eq!(body, Bytes::from(err));
    assert_eq!(up.seen.count(), 1, "not retried");
    proxy.stop().await;
}

/// `body` in `coding` (gzip, deflate, zstd), as an upstream would send it.
fn encode(coding: &str, body: &[u8]) -> Vec<u8> {
    use std::io::Write;
    match coding {
        "gzip" => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(body).unwrap();
            e.finish().unwrap()
        }
        "deflate" => {
            let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
            e.write_all(body).unwrap();
            e.finish().unwrap()
        }
        "zstd" => zstd::encode_all(body, 3).unwrap(),
        other => panic!("no encoder for {other}"),
    }
}

/// An upstream that answers an OpenAI chat stream as asked (with the
/// option's additions when the request has `include_usage: true`),
/// compressed in the coding the request's `x-test-answer-in` names,
/// whatever the request's `accept-encoding` says.
fn compressing_upstream(plain: Bytes) -> Handler {
    let with = Bytes::from(with_option(&plain));
    handler(move |req| {
        let body = if asked_for_usage(req.body()) {
            &with
        } else {
            &plain
        };
        match req
            .headers()
            .get("x-test-answer-in")
            .map(|v| v.to_str().unwrap().to_string())
        {
            None => sse(pieces(body)),
            Some(coding) => {
                let mut z = encode(&coding, body);
                if req.headers().contains_key("x-test-cut") {
                    z.truncate(z.len() * 2 / 3);
                }
                Response::builder()
                    .header("content-type", "text/event-stream")
                    .header("content-encoding", coding)
                    .body(chunked(pieces(&z)))
                    .unwrap()
            }
        }
    })
}

fn projection_src(parts: &http::response::Parts) -> String {
    let h = parts.headers["x-context-projection"].to_str().unwrap();
    h.split(';')
        .find_map(|p| p.strip_prefix("src="))
        .unwrap()
        .to_string()
}

/// SPEC §2: `include_usage: false` is treated as absent. The upstream gets
/// `true` by an edit of that one value, the client gets byte for byte the
/// stream it asked for (no usage), and the session anchors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_opt_out_is_injected_stripped_and_anchors() {
    let plain = fixture("openai-chat/stream_no_usage.sse");
    let up = upstream(compressing_upstream(plain.clone())).await;
    let proxy = proxy(&up.url(), &[]).await;
    let c = client_h1();
    let h = [("x-session-id", "opt-out")];
    for (turn, (req, sent)) in [
        (
            r#"{"model":"gpt-4o-opt-out","stream":true,"stream_options":{"include_usage":false},"messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"gpt-4o-opt-out","stream":true,"stream_options":{"include_usage":true},"messages":[{"role":"user","content":"hi"}]}"#,
        ),
        (
            r#"{"model":"gpt-4o-opt-out","stream":true,"stream_options": { "include_usage" : false }, "messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"more"}]}"#,
            r#"{"model":"gpt-4o-opt-out","stream":true,"stream_options": { "include_usage" : true }, "messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"more"}]}"#,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let mut b = http::Request::post(proxy.url("/v1/chat/completions"))
            .header("content-type", "application/json");
        for (k, v) in h {
            b = b.header(k, v);
        }
        let (parts, body) = send(&c, b.body(full(req)).unwrap()).await;
        assert_eq!(parts.status, 200);
        assert_eq!(body, plain, "turn {turn}: the stream the client asked for");
        assert_eq!(up.seen.last().1, Bytes::from(sent), "turn {turn}: one value edited");
        if turn == 1 {
            assert_eq!(projection_src(&parts), "anchored", "the opt-out session anchors");
        }
    }
    assert_eq!(
        metric_reaches(
            &proxy,
            "tidemark_prompt_tokens_real_total",
            "gpt-4o-opt-out",
            2 * PROMPT_TOKENS
        )
        .await,
        2 * PROMPT_TOKENS
    );
    proxy.stop().await;
}

/// SPEC §2, whatever the encodings: a compressed request body is decoded,
/// injected and sent uncompressed; an upstream that compresses its answer
/// although asked not to has it decoded for the client, which never sees a
/// byte the injection added.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injection_works_through_compressed_requests_and_responses() {
    let plain = fixture("openai-chat/stream_no_usage.sse");
    let up = upstream(compressing_upstream(plain.clone())).await;
    let proxy = proxy(&up.url(), &[]).await;
    let c = client_h1();
    let json = |turns: usize| {
        let msgs: Vec<String> = (0..turns)
            .map(|i| format!(r#"{{"role":"user","content":"question {i}"}},{{"role":"assistant","content":"answer {i}"}}"#))
            .collect();
        format!(
            r#"{{"model":"gpt-4o-inject-z","stream":true,"stream_options":{{"include_usage":false}},"messages":[{}{{"role":"user","content":"next"}}]}}"#,
            msgs.iter().map(|m| format!("{m},")).collect::<String>()
        )
    };
    let mut turn = 0;
    for request_coding in [None, Some("gzip"), Some("zstd")] {
        for answer in [None, Some("gzip"), Some("deflate"), Some("zstd")] {
            turn += 1;
            let sid = format!("z-{request_coding:?}-{answer:?}");
            let mut srcs = Vec::new();
            for t in 1..=2 {
                let body = json(turn * 2 + t);
                let mut b = http::Request::post(proxy.url("/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .header("accept-encoding", "gzip, br, zstd")
                    .header("x-session-id", &sid);
                let wire = match request_coding {
                    Some(cod) => {
                        b = b.header("content-encoding", cod);
                        Bytes::from(encode(cod, body.as_bytes()))
                    }
                    None => Bytes::from(body.clone()),
                };
                if let Some(a) = answer {
                    b = b.header("x-test-answer-in", a);
                }
                let (parts, got) = send(&c, b.body(full(wire)).unwrap()).await;
                let case = format!("request {request_coding:?}, answer {answer:?}, turn {t}");
                assert_eq!(parts.status, 200, "{case}");
                assert_eq!(
                    got, plain,
                    "{case}: the client's bytes, decoded, without the option's"
                );
                assert!(parts.headers.get("content-encoding").is_none(), "{case}");
                let (seen, sent) = up.seen.last();
                assert!(
                    seen.headers.get("content-encoding").is_none(),
                    "{case}: sent decoded"
                );
                assert_eq!(
                    sent,
                    Bytes::from(body.replace("\"include_usage\":false", "\"include_usage\":true")),
                    "{case}: the decoded body, one value edited"
                );
                assert_eq!(
                    seen.headers["content-length"],
                    sent.len().to_string(),
                    "{case}"
                );
                srcs.push(projection_src(&parts));
            }
            assert_eq!(
                srcs[1], "anchored",
                "request {request_coding:?}, answer {answer:?}"
            );
        }
    }

    // A compressed answer cut short: the client gets what decoded, then a
    // broken body, never the raw bytes.
    let b = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-test-answer-in", "gzip")
        .header("x-test-cut", "1")
        .body(full(json(1)))
        .unwrap();
    let resp = within(30, c.request(b)).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("content-encoding").is_none());
    let got = within(30, http_body_util::BodyExt::collect(resp.into_body())).await;
    assert!(got.is_err(), "an undecodable body fails, as a reset does");
    proxy.stop().await;
}
