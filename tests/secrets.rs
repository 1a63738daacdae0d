//! No secret leaves: run the real binary at debug level with JSON logs, send
//! requests that carry unique fake credentials (Authorization, x-api-key,
//! x-goog-api-key, ?key=) and unique conversation markers, on paths that
//! succeed and paths that fail, then search every log line and every admin
//! response for them.

mod support;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use tokio::process::Command;

use support::{client_h1, client_h2c, full, send, within, TestClient};

/// A port nobody listens on right now (bound, then released).
async fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap().port()
}

struct Markers {
    bearer: String,
    x_api_key: String,
    goog: String,
    query_key: String,
    user_text: String,
    system_text: String,
    reply_text: String,
    long_session: String,
}

impl Markers {
    fn new() -> Self {
        let n = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
            ^ (std::process::id() as u128) << 64;
        let id = format!("{n:x}");
        Markers {
            bearer: format!("sk-tmfake-bearer-{id}"),
            x_api_key: format!("sk-ant-tmfake-xapikey-{id}"),
            goog: format!("AIzaTmFakeGoog{id}"),
            query_key: format!("AIzaTmFakeQuery{id}"),
            user_text: format!("user-convo-marker-{id}"),
            system_text: format!("system-prompt-marker-{id}"),
            reply_text: format!("assistant-reply-marker-{id}"),
            long_session: format!("sess-{id}-{}", "s".repeat(1000)),
        }
    }
    fn all(&self) -> Vec<(&'static str, &str)> {
        vec![
            ("bearer credential", &self.bearer),
            ("x-api-key credential", &self.x_api_key),
            ("x-goog-api-key credential", &self.goog),
            ("?key= credential", &self.query_key),
            ("user message text", &self.user_text),
            ("system prompt text", &self.system_text),
            ("assistant reply text", &self.reply_text),
        ]
    }
}

/// The upstream answers every API with its fixture shape, the reply marker
/// inside; `/v1/unauthorized` answers 401 echoing the credential, as some
/// upstreams do.
fn upstream_handler(reply: String) -> support::Handler {
    support::handler(move |req: Request<Bytes>| {
        let path = req.uri().path().to_string();
        let stream = String::from_utf8_lossy(req.body()).contains("\"stream\":true")
            || path.contains("stream");
        let (ct, body) = if path.ends_with("/chat/completions") && stream {
            (
                "text/event-stream",
                format!(
                    "data: {{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{reply}\"}}}}]}}\n\n\
                     data: {{\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{{\"prompt_tokens\":31,\"completion_tokens\":5,\"total_tokens\":36}}}}\n\n\
                     data: [DONE]\n\n"
                ),
            )
        } else if path.ends_with("/chat/completions") {
            (
                "application/json",
                format!(
                    "{{\"id\":\"c2\",\"object\":\"chat.completion\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{reply}\"}},\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":31,\"completion_tokens\":5,\"total_tokens\":36}}}}"
                ),
            )
        } else if path.ends_with("/messages") {
            (
                "application/json",
                format!(
                    "{{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[{{\"type\":\"text\",\"text\":\"{reply}\"}}],\"model\":\"claude-sonnet-4-5\",\"stop_reason\":\"end_turn\",\"usage\":{{\"input_tokens\":40,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0,\"output_tokens\":5}}}}"
                ),
            )
        } else if path.contains(":generateContent") {
            (
                "application/json",
                format!(
                    "{{\"candidates\":[{{\"content\":{{\"role\":\"model\",\"parts\":[{{\"text\":\"{reply}\"}}]}},\"finishReason\":\"STOP\"}}],\"usageMetadata\":{{\"promptTokenCount\":22,\"candidatesTokenCount\":5,\"totalTokenCount\":27}}}}"
                ),
            )
        } else if path == "/api/chat" {
            (
                "application/json",
                format!(
                    "{{\"model\":\"llama3.2\",\"message\":{{\"role\":\"assistant\",\"content\":\"{reply}\"}},\"done\":true,\"prompt_eval_count\":26,\"eval_count\":5}}"
                ),
            )
        } else if path == "/v1/unauthorized" {
            let cred = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            return Response::builder()
                .status(401)
                .header("content-type", "application/json")
                .body(full(format!(
                    "{{\"error\":{{\"message\":\"Incorrect API key provided: {cred}\"}}}}"
                )))
                .unwrap();
        } else {
            ("application/json", format!("{{\"data\":\"{reply}\"}}"))
        };
        Response::builder()
            .status(200)
            .header("content-type", ct)
            .body(full(body))
            .unwrap()
    })
}

/// (url, credential headers, session header, body).
type Case<'a> = (String, Vec<(&'a str, &'a str)>, Option<&'a str>, String);

fn req(
    url: &str,
    auth: &[(&str, &str)],
    session: Option<&str>,
    body: impl Into<Bytes>,
) -> Request<support::Body> {
    let mut b = Request::post(url).header("content-type", "application/json");
    for (k, v) in auth {
        b = b.header(*k, *v);
    }
    if let Some(s) = session {
        b = b.header("x-session-id", s);
    }
    b.body(full(body)).unwrap()
}

async fn admin_get(c: &TestClient, url: &str) -> (u16, String) {
    let (parts, body) = send(
        c,
        Request::get(url)
            .header("authorization", "Bearer admin-token-for-test")
            .body(full(Bytes::new()))
            .unwrap(),
    )
    .await;
    (
        parts.status.as_u16(),
        String::from_utf8_lossy(&body).into_owned(),
    )
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_log_line_or_admin_response_carries_a_credential_or_conversation_text() {
    let m = Markers::new();
    let up = support::upstream(upstream_handler(m.reply_text.clone())).await;
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let listen = free_port().await;
    let admin = free_port().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_tidemark"))
        .args([
            "--listen",
            &format!("127.0.0.1:{listen}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
            "--admin-token",
            "admin-token-for-test",
            "--upstream",
            &up.url(),
            "--route",
            &format!("/v1/messages={}", up.url()),
            "--route",
            &format!("/v1/responses=http://{dead}"),
            "--max-body-bytes",
            "8192",
            "--log-format",
            "json",
        ])
        .env("TIDEMARK_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the binary starts");
    let logs = Arc::new(Mutex::new(Vec::<u8>::new()));
    let mut readers = Vec::new();
    for mut pipe in [
        Box::new(child.stdout.take().unwrap()) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
        Box::new(child.stderr.take().unwrap()),
    ] {
        let logs = Arc::clone(&logs);
        readers.push(tokio::spawn(async move {
            let mut buf = [0u8; 8192];
            while let Ok(n) = pipe.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                logs.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        }));
    }

    let c = client_h1();
    let base = format!("http://127.0.0.1:{listen}");
    let admin_base = format!("http://127.0.0.1:{admin}");
    // Wait (bounded) for the admin listener.
    within(30, async {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        loop {
            tick.tick().await;
            let r = Request::get(format!("{admin_base}/healthz"))
                .body(full(Bytes::new()))
                .unwrap();
            if let Ok(Ok(resp)) = tokio::time::timeout(Duration::from_secs(2), c.request(r)).await {
                if resp.status() == 200 {
                    break;
                }
            }
        }
    })
    .await;

    let bearer = format!("Bearer {}", m.bearer);
    let chat = |stream: bool| {
        format!(
            r#"{{"model":"gpt-4o","stream":{stream},"messages":[{{"role":"system","content":"{}"}},{{"role":"user","content":"{}"}}]}}"#,
            m.system_text, m.user_text
        )
    };
    let mut statuses = Vec::new();
    for client in [client_h1(), client_h2c()] {
        // Successful requests on every API, fingerprinted and with session headers.
        let cases: Vec<Case> = vec![
            (
                format!("{base}/v1/chat/completions"),
                vec![("authorization", &bearer)],
                None,
                chat(false),
            ),
            (
                format!("{base}/v1/chat/completions"),
                vec![("authorization", &bearer)],
                Some(&m.long_session),
                chat(true),
            ),
            (
                format!("{base}/v1/messages"),
                vec![("x-api-key", &m.x_api_key)],
                None,
                format!(
                    r#"{{"model":"claude-sonnet-4-5","max_tokens":64,"system":"{}","messages":[{{"role":"user","content":"{}"}}]}}"#,
                    m.system_text, m.user_text
                ),
            ),
            (
                format!("{base}/v1beta/models/gemini-2.5-flash:generateContent"),
                vec![("x-goog-api-key", &m.goog)],
                None,
                format!(
                    r#"{{"systemInstruction":{{"parts":[{{"text":"{}"}}]}},"contents":[{{"role":"user","parts":[{{"text":"{}"}}]}}]}}"#,
                    m.system_text, m.user_text
                ),
            ),
            (
                format!(
                    "{base}/v1beta/models/gemini-2.5-flash:generateContent?key={}",
                    m.query_key
                ),
                vec![],
                None,
                format!(
                    r#"{{"contents":[{{"role":"user","parts":[{{"text":"{}"}}]}}]}}"#,
                    m.user_text
                ),
            ),
            (
                format!("{base}/api/chat"),
                vec![("authorization", &bearer)],
                None,
                format!(
                    r#"{{"model":"llama3.2","stream":false,"messages":[{{"role":"user","content":"{}"}}]}}"#,
                    m.user_text
                ),
            ),
            // Failing paths: upstream down, body too large, malformed JSON,
            // an upstream 401, and a passthrough with the key in the query.
            (
                format!("{base}/v1/responses"),
                vec![("authorization", &bearer)],
                None,
                format!(r#"{{"model":"gpt-4o","input":"{}"}}"#, m.user_text),
            ),
            (
                format!("{base}/v1/chat/completions"),
                vec![("authorization", &bearer)],
                None,
                format!(
                    r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{} {}"}}]}}"#,
                    m.user_text,
                    "pad ".repeat(4000)
                ),
            ),
            (
                format!("{base}/v1/chat/completions"),
                vec![("authorization", &bearer)],
                None,
                format!(
                    r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"{}""#,
                    m.user_text
                ),
            ),
            (
                format!("{base}/v1/unauthorized"),
                vec![("authorization", &bearer)],
                None,
                chat(false),
            ),
            (
                format!("{base}/v1/files?key={}", m.query_key),
                vec![("x-api-key", &m.x_api_key)],
                None,
                m.user_text.clone(),
            ),
        ];
        for (url, auth, session, body) in cases {
            let (parts, _) = send(&client, req(&url, &auth, session, body)).await;
            statuses.push(parts.status.as_u16());
        }
    }
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(statuses.contains(&502), "upstream down was exercised");
    assert!(statuses.contains(&413), "body too large was exercised");
    assert!(statuses.contains(&401), "upstream 401 was exercised");

    // Every admin response.
    let mut admin_text = String::new();
    let (code, unauth) = {
        let (parts, body) = support::get(&c, &format!("{admin_base}/metrics")).await;
        (
            parts.status.as_u16(),
            String::from_utf8_lossy(&body).into_owned(),
        )
    };
    assert_eq!(code, 401, "admin endpoints need the token");
    admin_text.push_str(&unauth);
    for path in ["/metrics", "/sessions?limit=1000", "/readyz", "/healthz"] {
        let (code, body) = admin_get(&c, &format!("{admin_base}{path}")).await;
        assert_eq!(code, 200, "{path}");
        admin_text.push_str(&body);
    }
    let (_, list) = admin_get(&c, &format!("{admin_base}/sessions?limit=1000")).await;
    let list: serde_json::Value = serde_json::from_str(&list).expect("sessions JSON");
    let sessions = list["sessions"].as_array().cloned().unwrap_or_default();
    assert!(
        !sessions.is_empty(),
        "requests with a session header or a fingerprint are held as sessions: {list}"
    );
    let mut saw_capped = false;
    let mut saw_fp = false;
    for s in &sessions {
        let key = s["key"].as_str().expect("a session has a key");
        assert!(
            key.len() <= 256,
            "session keys are capped at 256 bytes: {}",
            key.len()
        );
        if let Some(h) = key.strip_prefix("fp:") {
            assert!(
                !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()),
                "a fingerprint is shown as a hash: {key}"
            );
            saw_fp = true;
        } else {
            assert!(
                m.long_session.starts_with(key),
                "a header key is shown as given (cut): {key}"
            );
            saw_capped = key.len() == 256;
        }
        let (code, one) = admin_get(
            &c,
            &format!("{admin_base}/sessions/{}", percent_encode(key)),
        )
        .await;
        assert_eq!(code, 200, "/sessions/{key}");
        admin_text.push_str(&one);
    }
    assert!(saw_fp, "fingerprinted sessions are listed");
    assert!(saw_capped, "the 1000-byte session header was cut to 256");

    // Stop the binary with SIGTERM and collect everything it wrote.
    let pid = child.id().expect("running");
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let status = within(30, child.wait()).await.expect("exits");
    assert!(status.success(), "clean exit on SIGTERM: {status}");
    for r in readers {
        within(10, r).await.unwrap();
    }
    let logs = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    let lines: Vec<&str> = logs.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(
        !lines.is_empty(),
        "the binary logged something at debug level"
    );
    for l in &lines {
        assert!(
            serde_json::from_str::<serde_json::Value>(l).is_ok(),
            "every log line is JSON: {l}"
        );
    }
    for (what, marker) in m.all() {
        for (i, l) in lines.iter().enumerate() {
            assert!(!l.contains(marker), "log line {i} carries the {what}: {l}");
        }
        assert!(
            !admin_text.contains(marker),
            "an admin response carries the {what}"
        );
    }
    // The long session id is a session key, shown as given but never whole.
    assert!(!logs.contains(&m.long_session));
    assert!(!admin_text.contains(&m.long_session));
    eprintln!(
        "secrets: {} log lines, {} bytes of admin responses searched",
        lines.len(),
        admin_text.len()
    );
}

/// The binary with `args` and `env`, the admin settings' variables of this
/// environment cleared, stderr piped.
fn tidemark_with(args: &[&str], env: &[(&str, &str)]) -> tokio::process::Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tidemark"));
    cmd.args(args)
        .env_remove("TIDEMARK_ADMIN_TOKEN")
        .env_remove("TIDEMARK_ADMIN_INSECURE")
        .env_remove("TIDEMARK_ADMIN_LISTEN")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("the binary starts")
}

/// Run the binary; `None` if it is still running after `secs` (then
/// killed), else its exit status and stderr.
async fn run_briefly(args: &[&str], env: &[(&str, &str)], secs: u64) -> Option<(bool, String)> {
    let mut child = tidemark_with(args, env);
    let mut stderr = child.stderr.take().unwrap();
    match tokio::time::timeout(Duration::from_secs(secs), child.wait()).await {
        Ok(status) => {
            let mut err = String::new();
            let _ = stderr.read_to_string(&mut err).await;
            Some((status.expect("exit status").success(), err))
        }
        Err(_) => {
            let _ = child.kill().await;
            None
        }
    }
}

/// An admin listener anyone can reach serves session keys, credential
/// hashes and DELETE: without a token tidemark will not start there unless
/// told it is meant (SPEC §1 `--admin-insecure`), and says so in one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_loopback_admin_listener_needs_a_token_or_an_explicit_acknowledgement() {
    for exposed in ["0.0.0.0", "[::]"] {
        let listen = format!("127.0.0.1:{}", free_port().await);
        let admin = format!("{exposed}:{}", free_port().await);
        let (ok, err) = run_briefly(&["--listen", &listen, "--admin-listen", &admin], &[], 20)
            .await
            .expect("refuses at once, does not serve");
        assert!(!ok, "non-zero exit");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "one line: {err}");
        for says in [&admin[..], "loopback", "--admin-token", "--admin-insecure"] {
            assert!(lines[0].contains(says), "{says:?} in {err}");
        }
    }
    // A token, the flag, or its environment variable: it serves.
    let port = free_port().await;
    let admin = format!("0.0.0.0:{port}");
    let healthz = format!("http://127.0.0.1:{port}/healthz");
    let listen = format!("127.0.0.1:{}", free_port().await);
    type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)]);
    let cases: [Case; 3] = [
        (&["--admin-token", "t0ken"], &[]),
        (&["--admin-insecure"], &[]),
        (&[], &[("TIDEMARK_ADMIN_INSECURE", "true")]),
    ];
    for (extra, env) in cases {
        let mut args = vec!["--listen", &listen, "--admin-listen", &admin];
        args.extend_from_slice(extra);
        let mut child = tidemark_with(&args, env);
        let c = client_h1();
        let served = within(20, async {
            loop {
                if let Ok(Ok(resp)) = tokio::time::timeout(
                    Duration::from_secs(2),
                    c.request(
                        Request::get(&healthz)
                            .body(support::full(Bytes::new()))
                            .unwrap(),
                    ),
                )
                .await
                {
                    break resp.status().as_u16();
                }
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "{args:?} {env:?}: exited instead of serving"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        assert_eq!(served, 200, "{args:?} {env:?}");
        let _ = child.kill().await;
    }
    // Loopback needs neither.
    let admin = format!("127.0.0.1:{}", free_port().await);
    assert!(
        run_briefly(&["--listen", &listen, "--admin-listen", &admin], &[], 2)
            .await
            .is_none(),
        "a loopback admin listener starts without a token"
    );
}
