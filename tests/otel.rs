//! OpenTelemetry export, end to end: the real proxy in front of the
//! simulated provider exports to a collector that decodes OTLP with the
//! official protobuf definitions (`tests/otel/collector.py`, PyPI's
//! `opentelemetry-proto`, which `scripts/test.sh` installs into
//! `target/venv`). Its spans and metrics carry the provider's own usage;
//! the client's `traceparent` is the span's parent and the upstream sees
//! tidemark's span as its own parent; a WebSocket turn is a span; a
//! collector that does not answer costs requests nothing.
mod support;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::Request;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tidemark::sim::{SimConfig, X_SIM_PROMPT_TOKENS};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::process::{Child, Command};

use support::*;

/// The interpreter with `opentelemetry-proto`: as tests/sdk_python.rs finds it.
fn python() -> String {
    if let Ok(p) = std::env::var("TIDEMARK_PYTHON") {
        return p;
    }
    let venv = format!("{}/target/venv/bin/python", env!("CARGO_MANIFEST_DIR"));
    match std::path::Path::new(&venv).exists() {
        true => venv,
        false => "python3".to_string(),
    }
}

/// The test collector: its port, and every export it decoded.
struct Collector {
    port: u16,
    seen: Arc<Mutex<Vec<Value>>>,
    _child: Child,
}

impl Collector {
    async fn start() -> Collector {
        let script = format!("{}/tests/otel/collector.py", env!("CARGO_MANIFEST_DIR"));
        let mut child = Command::new(python())
            .arg(script)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("a Python interpreter (scripts/test.sh makes target/venv)");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port = within(30, lines.next_line())
            .await
            .unwrap()
            .expect("the collector's port (is opentelemetry-proto installed? scripts/test.sh)")
            .trim()
            .parse()
            .unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let into = Arc::clone(&seen);
        tokio::spawn(async move {
            while let Ok(Some(l)) = lines.next_line().await {
                into.lock().unwrap().push(serde_json::from_str(&l).unwrap());
            }
        });
        Collector {
            port,
            seen,
            _child: child,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every span received so far.
    fn spans(&self) -> Vec<Value> {
        let seen = self.seen.lock().unwrap();
        let mut out = Vec::new();
        for e in seen.iter().filter(|e| e["signal"] == "traces") {
            for rs in e["body"]["resourceSpans"].as_array().unwrap() {
                for ss in rs["scopeSpans"].as_array().unwrap() {
                    out.extend(ss["spans"].as_array().unwrap().iter().cloned());
                }
            }
        }
        out
    }

    /// The latest export's metric of this name.
    fn metric(&self, name: &str) -> Option<Value> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .rev()
            .filter(|e| e["signal"] == "metrics")
            .flat_map(|e| e["body"]["resourceMetrics"].as_array().unwrap().clone())
            .flat_map(|rm| rm["scopeMetrics"].as_array().unwrap().clone())
            .flat_map(|sm| sm["metrics"].as_array().unwrap().clone())
            .find(|m| m["name"] == name)
    }

    /// Everything received, as text (to search for what must not be there).
    fn text(&self) -> String {
        serde_json::to_string(&*self.seen.lock().unwrap()).unwrap()
    }

    /// Wait (bounded) until `ok` holds of what was received.
    async fn wait_for(&self, what: &str, ok: impl Fn(&Collector) -> bool) {
        let done = tokio::time::timeout(Duration::from_secs(30), async {
            while !ok(self) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(
            done.is_ok(),
            "timed out waiting for {what}: {}",
            self.text()
        );
    }
}

/// A span's attribute, as the collector decoded it (ints come as strings).
fn attr(span: &Value, key: &str) -> Option<Value> {
    let a = span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)?;
    let v = &a["value"];
    Some(if let Some(i) = v.get("intValue") {
        json!(i.as_str().unwrap().parse::<u64>().unwrap())
    } else if let Some(s) = v.get("stringValue") {
        s.clone()
    } else {
        v["doubleValue"].clone()
    })
}

/// The hex of a base64 id (the JSON mapping of bytes fields).
fn hex_id(b64: &Value) -> String {
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64.as_str().unwrap_or(""))
        .unwrap();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

async fn sim(cfg: SimConfig) -> (String, support::Sim) {
    let s = support::sim(cfg).await;
    (s.url.clone(), s)
}

/// The proxy in front of `upstream`, exporting to `collector` quickly.
async fn exporting_proxy(upstream: &str, collector: &str) -> Proxy {
    let mut cfg = tidemark::Config::from_args([
        "tidemark",
        "--upstream",
        upstream,
        "--route",
        &format!("/v1/messages={upstream}"),
        "--otlp-endpoint",
        collector,
    ])
    .expect("valid flags");
    let otlp = cfg.otlp.as_mut().expect("export on");
    otlp.span_delay = Duration::from_millis(50);
    otlp.metric_interval = Duration::from_millis(200);
    proxy_with(cfg).await
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";
const BEARER: &str = "Bearer sk-otel-test-credential-0123456789";
const KEY: &str = "otel-session-raw-key-7e1f";

/// One request the session sent, and the usage the provider reported.
struct Sent {
    prompt: u64,
    output: Option<u64>,
    cached: Option<u64>,
}

/// POST `body` to `path` as the scripted agent (its credential and session
/// header, and `extra` headers); the provider's usage as it reported it:
/// its own prompt count (`x-sim-prompt-tokens`), and from a whole JSON
/// body the output and cache reads.
async fn call(proxy: &Proxy, path: &str, body: Value, extra: &[(&str, &str)]) -> Sent {
    let mut req = Request::post(proxy.url(path))
        .header("content-type", "application/json")
        .header("authorization", BEARER)
        .header("x-session-id", KEY);
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let (parts, bytes) = send(&client_h1(), req.body(full(body.to_string())).unwrap()).await;
    assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&bytes));
    let prompt = parts.headers[X_SIM_PROMPT_TOKENS]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64);
    Sent {
        prompt,
        output: n("/usage/completion_tokens")
            .or(n("/usage/output_tokens"))
            .or(n("/usageMetadata/candidatesTokenCount")),
        cached: n("/usage/prompt_tokens_details/cached_tokens")
            .or(n("/usage/cache_read_input_tokens"))
            .or(n("/usageMetadata/cachedContentTokenCount")),
    }
}

fn chat(turns: usize, stream: bool) -> Value {
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    for i in 0..turns {
        messages.push(
            json!({"role": "user", "content": format!("question {i}: what is {i} squared?")}),
        );
        if i + 1 < turns {
            messages.push(json!({"role": "assistant", "content": format!("{}", i * i)}));
        }
    }
    json!({"model": "gpt-4o-mini", "messages": messages, "max_tokens": 64, "stream": stream})
}

/// The first 16 hex of the SHA-256 of `credential:key`, the credential its
/// own 8-hex SHA-256 prefix (docs/design.md, OpenTelemetry).
fn conversation_id(key: &str) -> String {
    let cred: String = Sha256::digest(BEARER.as_bytes())[..4]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Sha256::digest(format!("{cred}:{key}").as_bytes())[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_session_exports_spans_and_metrics_with_the_providers_usage() {
    let record = std::env::temp_dir().join(format!("tidemark-otel-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&record);
    let (up, _sim) = sim(SimConfig {
        record: Some(record.clone()),
        ..SimConfig::default()
    })
    .await;
    let collector = Collector::start().await;
    let proxy = exporting_proxy(&up, &collector.url()).await;

    let traceparent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let mut sent = Vec::new();
    // An agent's session: three chat turns (the first in the client's
    // trace), a streamed one, then a Messages and a Gemini call.
    sent.push(
        call(
            &proxy,
            "/v1/chat/completions",
            chat(1, false),
            &[("traceparent", &traceparent), ("tracestate", "vendor=abc")],
        )
        .await,
    );
    for turns in [2, 3] {
        sent.push(call(&proxy, "/v1/chat/completions", chat(turns, false), &[]).await);
    }
    sent.push(call(&proxy, "/v1/chat/completions", chat(4, true), &[]).await);
    let messages = json!({"model": "claude-sonnet-4-5", "max_tokens": 100,
        "messages": [{"role": "user", "content": "Name three rivers."}]});
    sent.push(call(&proxy, "/v1/messages", messages, &[]).await);
    let gemini = json!({"contents": [{"role": "user", "parts": [{"text": "Name a mountain."}]}]});
    sent.push(
        call(
            &proxy,
            "/v1beta/models/gemini-2.0-flash:generateContent",
            gemini,
            &[],
        )
        .await,
    );

    collector
        .wait_for("a span per request", |c| c.spans().len() >= sent.len())
        .await;
    let spans = collector.spans();
    assert_eq!(spans.len(), sent.len(), "{spans:#?}");
    // In the order they were sent: each span's usage is the provider's.
    let mut spans = spans;
    spans.sort_by_key(|s| {
        s["startTimeUnixNano"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    });
    let want_names = [
        "chat gpt-4o-mini",
        "chat gpt-4o-mini",
        "chat gpt-4o-mini",
        "chat gpt-4o-mini",
        "chat claude-sonnet-4-5",
        "generate_content gemini-2.0-flash",
    ];
    let providers = [
        "openai",
        "openai",
        "openai",
        "openai",
        "anthropic",
        "gcp.gemini",
    ];
    for (i, (span, s)) in spans.iter().zip(&sent).enumerate() {
        assert_eq!(span["name"], want_names[i], "{span:#}");
        assert_eq!(span["kind"], "SPAN_KIND_CLIENT");
        assert_eq!(
            attr(span, "gen_ai.provider.name"),
            Some(json!(providers[i]))
        );
        assert_eq!(
            attr(span, "gen_ai.usage.input_tokens"),
            Some(json!(s.prompt)),
            "span {i}: {span:#}"
        );
        if let Some(o) = s.output {
            assert_eq!(
                attr(span, "gen_ai.usage.output_tokens"),
                Some(json!(o)),
                "{span:#}"
            );
        }
        assert!(
            attr(span, "gen_ai.usage.output_tokens").is_some(),
            "{span:#}"
        );
        if let Some(c) = s.cached.filter(|c| *c > 0) {
            assert_eq!(
                attr(span, "gen_ai.usage.cache_read.input_tokens"),
                Some(json!(c))
            );
        }
        assert_eq!(
            attr(span, "gen_ai.conversation.id"),
            Some(json!(conversation_id(KEY)))
        );
        assert!(attr(span, "tidemark.projection").is_some());
        assert!(attr(span, "tidemark.projection.src").is_some());
    }
    assert_eq!(
        attr(&spans[0], "gen_ai.request.max_tokens"),
        Some(json!(64))
    );
    // The lane, as the session object names it.
    let (_, body) = get(&client_h1(), &proxy.admin_url(&format!("/sessions/{KEY}"))).await;
    let session: Value = serde_json::from_slice(&body).unwrap();
    let lane_of = |model: &str| {
        session["lanes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["model"] == model)
            .map(|l| l["id"].clone())
    };
    assert!(lane_of("gpt-4o-mini").is_some(), "{session:#}");
    assert_eq!(attr(&spans[0], "tidemark.lane"), lane_of("gpt-4o-mini"));
    assert_eq!(
        attr(&spans[4], "tidemark.lane"),
        lane_of("claude-sonnet-4-5")
    );
    assert_ne!(
        attr(&spans[0], "tidemark.lane"),
        attr(&spans[4], "tidemark.lane")
    );
    assert_eq!(
        attr(&spans[0], "tidemark.session.key_source"),
        Some(json!("header"))
    );
    assert_eq!(
        attr(&spans[0], "tidemark.projection.src"),
        Some(json!("estimate"))
    );
    assert_eq!(
        attr(&spans[2], "tidemark.projection.src"),
        Some(json!("anchored"))
    );

    // The client's traceparent is the first span's parent, its tracestate kept.
    let first = &spans[0];
    assert_eq!(hex_id(&first["traceId"]), CLIENT_TRACE);
    assert_eq!(hex_id(&first["parentSpanId"]), CLIENT_SPAN);
    assert_eq!(first["traceState"], "vendor=abc");
    // The others began traces of their own.
    assert!(spans[1].get("parentSpanId").is_none(), "{:#}", spans[1]);
    assert_ne!(hex_id(&spans[1]["traceId"]), CLIENT_TRACE);
    // And the upstream saw tidemark's span as its parent, tracestate as sent.
    let mut recorded: Vec<Value> = std::fs::read_dir(&record)
        .unwrap()
        .map(|e| serde_json::from_slice(&std::fs::read(e.unwrap().path()).unwrap()).unwrap())
        .collect();
    recorded.sort_by_key(|r: &Value| r["path"].as_str().unwrap_or("").to_string());
    let parents: Vec<String> = recorded
        .iter()
        .filter_map(|r| r["headers"]["traceparent"].as_str().map(str::to_string))
        .collect();
    assert_eq!(
        parents.len(),
        sent.len(),
        "every upstream request: {recorded:#?}"
    );
    let ours = format!("00-{CLIENT_TRACE}-{}-01", hex_id(&first["spanId"]));
    assert!(parents.contains(&ours), "{ours} among {parents:?}");
    for span in &spans {
        let p = format!(
            "00-{}-{}-01",
            hex_id(&span["traceId"]),
            hex_id(&span["spanId"])
        );
        assert!(parents.contains(&p), "{p} among {parents:?}");
    }
    assert!(recorded
        .iter()
        .any(|r| r["headers"]["tracestate"] == "vendor=abc"));

    // The metrics: token usage by the conventions, its sums the provider's.
    collector
        .wait_for("gen_ai.client.token.usage with every request", |c| {
            let Some(m) = c.metric("gen_ai.client.token.usage") else {
                return false;
            };
            let points = m["histogram"]["dataPoints"].as_array().unwrap();
            points
                .iter()
                .filter(|p| p.to_string().contains("\"input\""))
                .map(|p| p["count"].as_str().unwrap().parse::<usize>().unwrap())
                .sum::<usize>()
                == sent.len()
        })
        .await;
    let usage = collector.metric("gen_ai.client.token.usage").unwrap();
    assert_eq!(usage["unit"], "{token}");
    let sum_for = |model: &str, kind: &str| -> f64 {
        usage["histogram"]["dataPoints"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| {
                let a = p["attributes"].to_string();
                a.contains(&format!("\"{model}\"")) && a.contains(&format!("\"{kind}\""))
            })
            .map(|p| p["sum"].as_f64().unwrap())
            .sum()
    };
    let chat_input: u64 = sent[..4].iter().map(|s| s.prompt).sum();
    assert_eq!(sum_for("gpt-4o-mini", "input"), chat_input as f64);
    assert_eq!(sum_for("claude-sonnet-4-5", "input"), sent[4].prompt as f64);
    assert_eq!(sum_for("gemini-2.0-flash", "input"), sent[5].prompt as f64);
    let chat_output: u64 = sent[..3].iter().filter_map(|s| s.output).sum();
    assert!(sum_for("gpt-4o-mini", "output") >= chat_output as f64);
    let point = &usage["histogram"]["dataPoints"][0];
    for key in [
        "gen_ai.operation.name",
        "gen_ai.provider.name",
        "gen_ai.request.model",
        "gen_ai.token.type",
    ] {
        assert!(
            point["attributes"].to_string().contains(key),
            "{key} in {point:#}"
        );
    }
    let duration = collector
        .metric("gen_ai.client.operation.duration")
        .unwrap();
    assert_eq!(duration["unit"], "s");
    for own in [
        "tidemark.projection.error",
        "tidemark.context.utilization",
        "tidemark.sessions",
    ] {
        assert!(collector.metric(own).is_some(), "{own}");
    }
    // Resource: the service.
    assert!(collector.text().contains("\"service.name\""));

    // Never the key, the credential or the conversation.
    let all = collector.text();
    for secret in [
        KEY,
        "sk-otel-test-credential",
        "squared",
        "rivers",
        "mountain",
    ] {
        assert!(!all.contains(secret), "{secret} was exported");
    }
    proxy.stop().await;
    let _ = std::fs::remove_dir_all(&record);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_responses_websocket_turn_is_a_span_with_its_usage() {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    use tokio_tungstenite::tungstenite::Message;
    let (up, _sim) = sim(SimConfig::default()).await;
    let collector = Collector::start().await;
    let proxy = exporting_proxy(&up, &collector.url()).await;
    let mut req = format!("ws://{}/v1/responses", proxy.addr)
        .into_client_request()
        .unwrap();
    let h = req.headers_mut();
    h.insert("authorization", BEARER.parse().unwrap());
    h.insert("x-session-id", KEY.parse().unwrap());
    h.insert(
        "traceparent",
        format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
            .parse()
            .unwrap(),
    );
    let s = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut ws, _) = within(10, tokio_tungstenite::client_async(req, s))
        .await
        .unwrap();
    let event = json!({"type": "response.create", "model": "gpt-4.1",
        "input": [{"role": "user", "content": "Say hello."}], "max_output_tokens": 50});
    ws.send(Message::text(event.to_string())).await.unwrap();
    let completed = loop {
        let m = within(10, ws.next())
            .await
            .expect("open")
            .expect("a message");
        if let Message::Text(t) = m {
            let v: Value = serde_json::from_str(&t).unwrap();
            if v["type"] == "response.completed" {
                break v;
            }
        }
    };
    let input = completed["response"]["usage"]["input_tokens"]
        .as_u64()
        .unwrap();
    let output = completed["response"]["usage"]["output_tokens"]
        .as_u64()
        .unwrap();
    collector
        .wait_for("the turn's span", |c| !c.spans().is_empty())
        .await;
    let spans = collector.spans();
    assert_eq!(spans.len(), 1, "{spans:#?}");
    let span = &spans[0];
    assert_eq!(span["name"], "chat gpt-4.1");
    assert_eq!(attr(span, "tidemark.api"), Some(json!("openai-responses")));
    assert_eq!(attr(span, "gen_ai.usage.input_tokens"), Some(json!(input)));
    assert_eq!(
        attr(span, "gen_ai.usage.output_tokens"),
        Some(json!(output))
    );
    assert_eq!(attr(span, "gen_ai.request.max_tokens"), Some(json!(50)));
    assert_eq!(hex_id(&span["parentSpanId"]), CLIENT_SPAN);
    assert_eq!(hex_id(&span["traceId"]), CLIENT_TRACE);
    drop(ws);
    proxy.stop().await;
}

/// A free port on loopback.
async fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A collector that accepts connections and never answers (its listener
/// is never accepted from: the kernel completes the handshakes): every
/// export times out. Requests are served as fast as without export, the
/// drops are counted, one WARN says so; once it answers, one INFO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_does_not_answer_costs_a_counter_and_one_warn() {
    let (up, _sim) = sim(SimConfig::default()).await;
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let collector = format!("http://{}", silent.local_addr().unwrap());
    let listen = free_port().await;
    let admin = free_port().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args([
            "--listen",
            &format!("127.0.0.1:{listen}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
            "--upstream",
            &up,
        ])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &collector)
        .env("OTEL_BSP_SCHEDULE_DELAY", "20")
        .env("OTEL_METRIC_EXPORT_INTERVAL", "50")
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "200")
        .env("TIDEMARK_LOG", "info,tidemark::otel=debug")
        .env_remove("TIDEMARK_OTLP_ENDPOINT")
        .env_remove("TIDEMARK_ADMIN_TOKEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let logs = Arc::new(Mutex::new(String::new()));
    let reader = {
        let logs = Arc::clone(&logs);
        let mut err = child.stderr.take().unwrap();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                logs.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    let c = client_h1();
    let admin_url = |p: &str| format!("http://127.0.0.1:{admin}{p}");
    within(30, async {
        loop {
            let r = Request::get(admin_url("/healthz")).body(full("")).unwrap();
            if let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), c.request(r)).await {
                if resp.status() == 200 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let dropped = |text: &str, signal: &str| -> f64 {
        text.lines()
            .filter(|l| {
                l.starts_with("tidemark_otlp_dropped_total{")
                    && l.contains(&format!("signal=\"{signal}\""))
                    && l.contains("export_failed")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let metrics = || async {
        let (_, b) = get(&c, &admin_url("/metrics")).await;
        String::from_utf8(b.to_vec()).unwrap()
    };
    // Requests while every export hangs: answered, and promptly.
    let mut slowest = Duration::ZERO;
    for i in 0..20 {
        let t = Instant::now();
        let req = Request::post(format!("http://127.0.0.1:{listen}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-session-id", "silent-collector")
            .body(full(chat(1 + i % 3, false).to_string()))
            .unwrap();
        let (parts, body) = send(&c, req).await;
        assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&body));
        slowest = slowest.max(t.elapsed());
    }
    assert!(
        slowest < Duration::from_secs(2),
        "a request took {slowest:?}"
    );
    // Every span and metric export failed and was counted, over several
    // timed-out exports (one span batch at a time, each 200 ms)...
    within(30, async {
        loop {
            let text = metrics().await;
            if dropped(&text, "spans") >= 20.0 && dropped(&text, "metrics") > 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    // ...and said once.
    let warns = |logs: &str| {
        logs.lines()
            .filter(|l| l.contains("WARN") && l.contains("OTLP"))
            .count()
    };
    let text = logs.lock().unwrap().clone();
    assert_eq!(warns(&text), 1, "{text}");
    assert!(!text.contains("answers again"), "{text}");

    // The collector answers from now on: one INFO, and no new WARN.
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = silent.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(full("")))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                    .await;
            });
        }
    });
    let back = tokio::time::timeout(Duration::from_secs(30), async {
        while !logs.lock().unwrap().contains("answers again") {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    if back.is_err() {
        let text = logs.lock().unwrap().clone();
        panic!("no INFO after the collector answered:\n{text}");
    }
    let text = logs.lock().unwrap().clone();
    assert_eq!(warns(&text), 1, "{text}");
    assert_eq!(text.matches("answers again").count(), 1, "{text}");
    let _ = child.kill().await;
    let _ = reader.await;
}
