//! The real coding agents through tidemark (issue 30): Claude Code, Codex
//! CLI, opencode and Gemini CLI, pinned in `tests/agents/package.json` and
//! installed by `scripts/agents.sh` into `target/agents`, each run as a
//! child process against the simulated provider, once through tidemark and
//! once direct. The official Python SDK's Responses WebSocket client too.
//!
//! Every CLI gets a throwaway HOME and working directory outside any git
//! repository (Claude Code puts a repository's `git status` into its
//! prompt), an environment of its own (nothing inherited but what is set
//! here), and the quiet settings of `tests/fixtures/agents/README.md`, so
//! no outside host is ever contacted. A child that outlives its bound is
//! killed with its process group, and the test fails with its stderr.
//!
//! A CLI never shows tidemark's response headers, so a recording relay
//! stands between the CLI and what it talks to (tidemark, or the sim for a
//! direct run): it keeps each request's path, model, identity headers and
//! status, and the `x-context-projection` the CLI received. The Responses
//! WebSocket mode has no per-turn header: its turns are read from
//! tidemark's `websocket turn` log lines and from `/sessions`.
//!
//! The tests take turns (`SERIAL`): their run times are compared, and the
//! logs and metrics they read are the process's.
mod support;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tidemark::sim::{SimConfig, ToolCalls};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

use support::{client_h1, get, within, Proxy};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// How long one CLI command may take before it is killed (opencode and
/// Gemini CLI spend seconds of CPU starting up; far more under load).
const COMMAND_LIMIT: Duration = Duration::from_secs(120);

/// One agent test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

// ---------------------------------------------------------------------------
// The installed CLIs.

struct Agents {
    /// PATH as `target/agents/env.sh` sets it: the CLIs, then Node.
    path: String,
    bin: PathBuf,
}

/// What `scripts/agents.sh` installed. A CLI that is missing, or a lock
/// that differs from the pinned one, fails the test: no silent skip.
fn agents() -> &'static Agents {
    static A: OnceLock<Agents> = OnceLock::new();
    A.get_or_init(|| {
        let prefix = Path::new(ROOT).join("target/agents");
        let env_sh = prefix.join("env.sh");
        let text = std::fs::read_to_string(&env_sh).unwrap_or_else(|e| {
            panic!(
                "{}: {e}: the agent CLIs are not installed; run scripts/agents.sh",
                env_sh.display()
            )
        });
        let path = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("export PATH=\"")?.strip_suffix('"'))
            .unwrap_or_else(|| panic!("{} sets no PATH; run scripts/agents.sh", env_sh.display()))
            .replace("$PATH", &std::env::var("PATH").unwrap_or_default());
        let pinned = std::fs::read(Path::new(ROOT).join("tests/agents/package-lock.json"))
            .expect("tests/agents/package-lock.json");
        let installed = std::fs::read(prefix.join("package-lock.json")).unwrap_or_default();
        assert!(
            pinned == installed,
            "target/agents does not hold the versions tests/agents/package-lock.json pins; run scripts/agents.sh"
        );
        Agents {
            path,
            bin: prefix.join("node_modules/.bin"),
        }
    })
}

fn cli(name: &str) -> PathBuf {
    let p = agents().bin.join(name);
    assert!(
        p.exists(),
        "{name} is not installed at {}; run scripts/agents.sh",
        p.display()
    );
    p
}

/// The Python with the official SDKs: `TIDEMARK_PYTHON` (scripts/test.sh
/// exports it), else the project's venv that script makes, else `python3`.
fn python() -> String {
    if let Ok(p) = std::env::var("TIDEMARK_PYTHON") {
        return p;
    }
    let venv = format!("{ROOT}/target/venv/bin/python");
    match Path::new(&venv).exists() {
        true => venv,
        false => "python3".to_string(),
    }
}

// ---------------------------------------------------------------------------
// Throwaway directories and child processes.

/// A directory under the system's temporary directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tidemark-agents-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("home")).unwrap();
        std::fs::create_dir_all(dir.join("work")).unwrap();
        if let Some(repo) = dir.ancestors().find(|a| a.join(".git").exists()) {
            panic!(
                "{} is inside the git repository {}: the agents would read it; point TMPDIR elsewhere",
                dir.display(),
                repo.display()
            );
        }
        Scratch(dir)
    }
    fn home(&self) -> PathBuf {
        self.0.join("home")
    }
    fn work(&self) -> PathBuf {
        self.0.join("work")
    }
    fn write(&self, rel: &str, text: &str) {
        let p = self.0.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One finished command.
struct Ran {
    secs: f64,
}

fn tail(s: &str) -> &str {
    let cut = s.len().saturating_sub(3000);
    let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(0);
    &s[cut..]
}

/// SIGKILL to a process group this test started (whatever a CLI left
/// running behind it: Codex's and Gemini CLI's Node launchers start the
/// real process as a child). The shell's own `kill`, which every machine
/// has, procps or not.
fn kill_group(pgid: u32) {
    let _ = std::process::Command::new("sh")
        .args(["-c", &format!("kill -9 -- -{pgid} 2>/dev/null")])
        .status();
}

async fn read_pipe(p: Option<impl tokio::io::AsyncRead + Unpin>) -> String {
    let mut buf = Vec::new();
    if let Some(mut p) = p {
        let _ = p.read_to_end(&mut buf).await;
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Run `program args` in `cwd` with only `env` (plus PATH, HOME and a
/// locale), in a process group of its own; fail with its stderr tail on a
/// non-zero exit or past `COMMAND_LIMIT`.
async fn run(program: &Path, args: &[&str], cwd: &Path, env: &[(String, String)]) -> Ran {
    let shown = format!(
        "{} {}",
        program.file_name().unwrap().to_string_lossy(),
        args.join(" ")
    );
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", &agents().path)
        .env("LANG", "C.UTF-8")
        .env("TERM", "dumb")
        .env("NO_COLOR", "1")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{shown}: {e}; run scripts/agents.sh"));
    let pgid = child.id().expect("a running child has an id");
    let out = tokio::spawn(read_pipe(child.stdout.take()));
    let err = tokio::spawn(read_pipe(child.stderr.take()));
    let status = tokio::time::timeout(COMMAND_LIMIT, child.wait()).await;
    let secs = start.elapsed().as_secs_f64();
    kill_group(pgid);
    let _ = child.kill().await;
    let stdout = within(10, out).await.unwrap_or_default();
    let stderr = within(10, err).await.unwrap_or_default();
    let status = match status {
        Ok(s) => s.expect("wait for the child"),
        Err(_) => panic!(
            "{shown} did not finish within {COMMAND_LIMIT:?}; killed. stderr tail:\n{}",
            tail(&stderr)
        ),
    };
    assert!(
        status.success(),
        "{shown} exited with {status}. stdout tail:\n{}\nstderr tail:\n{}",
        tail(&stdout),
        tail(&stderr)
    );
    assert!(
        !stdout.trim().is_empty(),
        "{shown} printed no answer. stderr tail:\n{}",
        tail(&stderr)
    );
    Ran { secs }
}

// ---------------------------------------------------------------------------
// tidemark's log lines.

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

/// tidemark's INFO lines and above, from every proxy of this process (the
/// proxy's worker threads log to the global subscriber).
fn logs() -> &'static Captured {
    static L: OnceLock<Captured> = OnceLock::new();
    L.get_or_init(|| {
        let c = Captured::default();
        let sub = tracing_subscriber::fmt()
            .with_writer(c.clone())
            .with_ansi(false)
            .with_env_filter(tracing_subscriber::EnvFilter::new("tidemark=info"))
            .finish();
        let _ = tracing::subscriber::set_global_default(sub);
        c
    })
}

fn log_len() -> usize {
    logs().0.lock().unwrap().len()
}

fn log_since(mark: usize) -> String {
    String::from_utf8_lossy(&logs().0.lock().unwrap()[mark..]).into_owned()
}

/// A field of a tracing line, quotes taken off.
fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let at = line.find(&format!(" {name}="))? + name.len() + 2;
    let rest = &line[at..];
    Some(match rest.strip_prefix('"') {
        Some(q) => &q[..q.find('"')?],
        None => rest.split_whitespace().next()?,
    })
}

/// One Responses WebSocket turn as tidemark logged it.
#[derive(Debug, Clone)]
struct WsTurn {
    session: String,
    src: String,
    projection: u64,
}

fn ws_turns(mark: usize) -> Vec<WsTurn> {
    log_since(mark)
        .lines()
        .filter(|l| l.contains("websocket turn") && !l.contains("trimmed"))
        .map(|l| WsTurn {
            session: field(l, "session").unwrap_or("").to_string(),
            src: field(l, "src").unwrap_or("").to_string(),
            projection: field(l, "projection")
                .and_then(|p| p.parse().ok())
                .unwrap_or(0),
        })
        .collect()
}

// ---------------------------------------------------------------------------
// The recording relay.

/// One request as the CLI sent it and the answer's head as it received it.
#[derive(Debug, Clone)]
struct Exchange {
    method: String,
    /// Path and query.
    target: String,
    headers: HeaderMap,
    model: Option<String>,
    status: u16,
    projection: Option<String>,
}

impl Exchange {
    fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    fn upgrade(&self) -> bool {
        self.headers.contains_key(http::header::UPGRADE)
    }
    /// `src` of the `x-context-projection` the CLI received.
    fn src(&self) -> Option<&str> {
        self.projection
            .as_deref()?
            .split(';')
            .find_map(|p| p.strip_prefix("src="))
    }
    fn projected(&self) -> Option<u64> {
        self.projection.as_deref()?.split(';').next()?.parse().ok()
    }
}

type RelayBody = BoxBody<Bytes, hyper::Error>;
type Upstream = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

struct Relay {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Exchange>>>,
    _stop: oneshot::Sender<()>,
}

impl Relay {
    fn exchanges(&self) -> Vec<Exchange> {
        self.seen.lock().unwrap().clone()
    }
}

async fn connect(to: SocketAddr) -> std::io::Result<Upstream> {
    let tcp = TcpStream::connect(to).await?;
    tcp.set_nodelay(true)?;
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(conn.with_upgrades());
    Ok(send)
}

/// A relay to `to`: each client connection gets one upstream connection
/// of its own (a WebSocket handshake a fresh one), response bodies stream
/// through as they come, and an upgrade is spliced both ways after `101`.
async fn relay(to: SocketAddr) -> Relay {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<Mutex<Vec<Exchange>>> = Arc::default();
    let (stop, mut stopped) = oneshot::channel::<()>();
    let s2 = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let stream = tokio::select! {
                r = listener.accept() => match r { Ok((s, _)) => s, Err(_) => continue },
                _ = &mut stopped => break,
            };
            let _ = stream.set_nodelay(true);
            let pooled: Arc<tokio::sync::Mutex<Option<Upstream>>> = Arc::default();
            let seen = Arc::clone(&s2);
            let svc = service_fn(move |req| {
                let (pooled, seen) = (Arc::clone(&pooled), Arc::clone(&seen));
                async move {
                    Ok::<_, std::convert::Infallible>(
                        match forward(to, pooled, Arc::clone(&seen), req).await {
                            Ok(r) => r,
                            Err(e) => {
                                let mut r = Response::new(full_body(e.to_string()));
                                *r.status_mut() = StatusCode::BAD_GATEWAY;
                                r
                            }
                        },
                    )
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .with_upgrades(),
            );
        }
    });
    Relay {
        addr,
        seen,
        _stop: stop,
    }
}

fn full_body(s: String) -> RelayBody {
    Full::new(Bytes::from(s))
        .map_err(|never| match never {})
        .boxed()
}

async fn forward(
    to: SocketAddr,
    pooled: Arc<tokio::sync::Mutex<Option<Upstream>>>,
    seen: Arc<Mutex<Vec<Exchange>>>,
    mut req: Request<Incoming>,
) -> std::io::Result<Response<RelayBody>> {
    let upgrade = req.headers().contains_key(http::header::UPGRADE);
    let client_side = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    let model = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| Some(v.get("model")?.as_str()?.to_string()));
    let target = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_string();
    let mut out = Request::new(Full::new(bytes));
    *out.method_mut() = parts.method.clone();
    *out.uri_mut() = target.parse().map_err(std::io::Error::other)?;
    *out.headers_mut() = parts.headers.clone();
    let sent = if upgrade {
        connect(to).await?.send_request(out).await
    } else {
        let mut slot = pooled.lock().await;
        let ready = match slot.as_mut() {
            Some(s) => s.ready().await.is_ok(),
            None => false,
        };
        if !ready {
            *slot = Some(connect(to).await?);
        }
        slot.as_mut().expect("connected").send_request(out).await
    };
    let mut resp = sent.map_err(std::io::Error::other)?;
    seen.lock().unwrap().push(Exchange {
        method: parts.method.to_string(),
        target,
        headers: parts.headers,
        model,
        status: resp.status().as_u16(),
        projection: resp
            .headers()
            .get("x-context-projection")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string),
    });
    if let (Some(client_side), StatusCode::SWITCHING_PROTOCOLS) = (client_side, resp.status()) {
        let server_side = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            if let (Ok(a), Ok(b)) = (client_side.await, server_side.await) {
                let _ =
                    tokio::io::copy_bidirectional(&mut TokioIo::new(a), &mut TokioIo::new(b)).await;
            }
        });
        let mut r = Response::new(Empty::new().map_err(|never| match never {}).boxed());
        *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        *r.headers_mut() = resp.headers().clone();
        return Ok(r);
    }
    let (p, b) = resp.into_parts();
    Ok(Response::from_parts(p, b.boxed()))
}

// ---------------------------------------------------------------------------
// A stage: the sim, tidemark or not, and the relay the CLI talks to.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Direct,
    Tidemark,
}

struct Stage {
    scratch: Scratch,
    relay: Relay,
    proxy: Option<Proxy>,
    /// Where the sim writes every request and WebSocket frame it receives.
    record: PathBuf,
    /// Where this stage's log lines begin.
    log_mark: usize,
    _sim: support::Sim,
}

async fn stage(via: Via, tag: &str) -> Stage {
    let log_mark = {
        logs();
        log_len()
    };
    let scratch = Scratch::new(tag);
    let record = scratch.0.join("sim-record");
    let sim = support::sim(SimConfig {
        // As `tidemark sim` serves agents: a tool call only when asked.
        tool_calls: ToolCalls::WhenAsked,
        record: Some(record.clone()),
        ..SimConfig::default()
    })
    .await;
    let sim_url = sim.url.clone();
    let proxy = match via {
        Via::Direct => None,
        // Every API to the sim: Anthropic's default route replaced.
        Via::Tidemark => {
            Some(support::proxy(&sim_url, &["--route", &format!("/v1/messages={sim_url}")]).await)
        }
    };
    let relay = relay(proxy.as_ref().map_or(sim.addr, |p| p.addr)).await;
    Stage {
        scratch,
        relay,
        proxy,
        record,
        log_mark,
        _sim: sim,
    }
}

impl Stage {
    fn base(&self) -> String {
        format!("http://{}", self.relay.addr)
    }
    fn proxy(&self) -> &Proxy {
        self.proxy.as_ref().expect("a stage through tidemark")
    }
    /// The names of the sim's record files (`NNNNN-METHOD-path.json`).
    fn recorded(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.record)
            .map(|d| {
                d.filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }
}

async fn sessions(p: &Proxy) -> Vec<Value> {
    let (parts, body) = get(&client_h1(), &p.admin_url("/sessions?limit=1000")).await;
    assert_eq!(parts.status, 200);
    let v: Value = serde_json::from_slice(&body).expect("/sessions is JSON");
    v["sessions"].as_array().cloned().unwrap_or_default()
}

async fn session(p: &Proxy, key: &str) -> Value {
    let (parts, body) = get(&client_h1(), &p.admin_url(&format!("/sessions/{key}"))).await;
    assert_eq!(
        parts.status,
        200,
        "GET /sessions/{key}: {}; all sessions: {:#}",
        String::from_utf8_lossy(&body),
        Value::Array(sessions(p).await)
    );
    serde_json::from_slice(&body).expect("a session is JSON")
}

fn find<'a>(list: &'a [Value], key: &str) -> Option<&'a Value> {
    list.iter().find(|s| s["key"] == key)
}

/// A session's lanes (SPEC §6).
fn lanes(s: &Value) -> &Vec<Value> {
    s["lanes"]
        .as_array()
        .unwrap_or_else(|| panic!("the session object lists no lanes (SPEC §6): {s:#}"))
}

// ---------------------------------------------------------------------------
// The agents' scenarios.

#[derive(Debug, Clone, Copy)]
enum Agent {
    Claude,
    Codex,
    OpenCode,
    Gemini,
}

/// What a scenario left: its stage (tidemark still up), each command's run,
/// and `/sessions` after each command (through tidemark only).
struct Played {
    stage: Stage,
    runs: Vec<Ran>,
    after: Vec<Vec<Value>>,
}

impl Played {
    fn secs(&self) -> f64 {
        self.runs.iter().map(|r| r.secs).sum()
    }
}

/// An agent's CLI, the scenario's commands (their arguments) and the
/// environment they run in.
struct Setup {
    cli: &'static str,
    runs: Vec<Vec<&'static str>>,
    env: Vec<(String, String)>,
    /// Turns (over all sessions) tidemark has recorded once each command
    /// is done: a response's end is recorded as its last bytes go by,
    /// which may be just after the CLI has exited.
    turns: Vec<u64>,
}

/// The quiet settings of tests/fixtures/agents/README.md, per agent, and
/// the scenario's commands.
fn setup(agent: Agent, st: &Stage) -> Setup {
    let base = st.base();
    let home = st.scratch.home().to_string_lossy().into_owned();
    let mut env = vec![("HOME".to_string(), home.clone())];
    let mut set = |k: &str, v: &str| env.push((k.to_string(), v.to_string()));
    match agent {
        Agent::Claude => {
            set("ANTHROPIC_BASE_URL", &base);
            set("ANTHROPIC_API_KEY", "sk-ant-agents-test");
            set("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
            set("DISABLE_TELEMETRY", "1");
            set("DISABLE_ERROR_REPORTING", "1");
            set("DISABLE_AUTOUPDATER", "1");
            let runs = vec![
                vec!["-p", "say hi"],
                vec!["-c", "-p", "again"],
                vec!["-c", "-p", "again"],
            ];
            Setup {
                cli: "claude",
                runs,
                env,
                turns: vec![1, 2, 3],
            }
        }
        Agent::Codex => {
            st.scratch.write(
                "home/.codex/config.toml",
                &format!(
                    "openai_base_url = \"{base}/v1\"\n\
                     check_for_update_on_startup = false\n\
                     [analytics]\nenabled = false\n\
                     [features]\nplugins = false\nremote_plugin = false\napps = false\n"
                ),
            );
            set("CODEX_HOME", &format!("{home}/.codex"));
            set("CODEX_API_KEY", "sk-codex-agents-test");
            let runs = vec![
                vec!["exec", "--skip-git-repo-check", "say hi"],
                vec!["exec", "resume", "--last", "--skip-git-repo-check", "again"],
            ];
            Setup {
                cli: "codex",
                runs,
                env,
                turns: vec![1, 2],
            }
        }
        Agent::OpenCode => {
            st.scratch.write(
                "home/.config/opencode/opencode.json",
                &serde_json::json!({
                    "model": "anthropic/claude-sonnet-4-5",
                    "small_model": "anthropic/claude-haiku-4-5",
                    "autoupdate": false,
                    "share": "disabled",
                    "provider": {"anthropic": {"options": {
                        "baseURL": format!("{base}/v1"), "apiKey": "sk-ant-opencode-test"}}}
                })
                .to_string(),
            );
            set("OPENCODE_DISABLE_MODELS_FETCH", "1");
            // Its plugin install at start-up fails at once on a dead port.
            set("npm_config_registry", "http://127.0.0.1:9/");
            for k in [
                "OPENCODE_DISABLE_AUTOUPDATE",
                "OPENCODE_DISABLE_SHARE",
                "OPENCODE_DISABLE_LSP_DOWNLOAD",
                "OPENCODE_DISABLE_DEFAULT_PLUGINS",
                "OPENCODE_DISABLE_CLAUDE_CODE",
                "OPENCODE_DISABLE_EXTERNAL_SKILLS",
            ] {
                set(k, "1");
            }
            let runs = vec![vec!["run", "say hi"], vec!["run", "--continue", "again"]];
            Setup {
                cli: "opencode",
                runs,
                env,
                turns: vec![2, 3],
            }
        }
        Agent::Gemini => {
            st.scratch.write(
                "home/.gemini/settings.json",
                &serde_json::json!({
                    "security": {"auth": {"selectedType": "gemini-api-key"}},
                    "privacy": {"usageStatisticsEnabled": false},
                    "telemetry": {"enabled": false},
                    "general": {"disableAutoUpdate": true, "disableUpdateNag": true}
                })
                .to_string(),
            );
            set("GOOGLE_GEMINI_BASE_URL", &base);
            set("GEMINI_API_KEY", "gemini-agents-test");
            set("GEMINI_CLI_TRUST_WORKSPACE", "true");
            let runs = vec![
                vec!["-p", "say hi"],
                vec!["--resume", "latest", "-p", "again"],
            ];
            Setup {
                cli: "gemini",
                runs,
                env,
                turns: vec![2, 4],
            }
        }
    }
}

/// `/sessions` once it counts `turns` turns in all, or as it is after a
/// few seconds (the test's assertions then say what is missing).
async fn recorded(p: &Proxy, turns: u64) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let list = sessions(p).await;
        let n: u64 = list.iter().filter_map(|s| s["turns"].as_u64()).sum();
        if n >= turns || Instant::now() > deadline {
            return list;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Play an agent's scenario on a fresh stage.
async fn play(agent: Agent, via: Via) -> Played {
    let st = stage(via, &format!("{agent:?}").to_lowercase()).await;
    let Setup {
        cli: name,
        runs: commands,
        env,
        turns,
    } = setup(agent, &st);
    let program = cli(name);
    let mut runs = Vec::new();
    let mut after = Vec::new();
    for (args, turns) in commands.iter().zip(turns) {
        runs.push(run(&program, args, &st.scratch.work(), &env).await);
        if let Some(p) = &st.proxy {
            after.push(recorded(p, turns).await);
        }
    }
    Played {
        stage: st,
        runs,
        after,
    }
}

/// A run through tidemark takes at most 1.5x the direct run + 0.5 s (the
/// scenario's commands summed). `through` is the first run's time; on a
/// miss both are run again, direct and through in turn, up to three rounds,
/// and the best of each counts: a shared machine's noise is seconds for the
/// CLIs that start up on CPU.
async fn within_budget(agent: Agent, through: f64) {
    let mut t = vec![through];
    let mut d = Vec::new();
    let best = |v: &[f64]| v.iter().cloned().fold(f64::INFINITY, f64::min);
    for round in 0..3 {
        if round > 0 {
            t.push(play(agent, Via::Tidemark).await.secs());
        }
        d.push(play(agent, Via::Direct).await.secs());
        if best(&t) <= 1.5 * best(&d) + 0.5 {
            break;
        }
    }
    let (bt, bd) = (best(&t), best(&d));
    eprintln!(
        "timing {agent:?}: through tidemark {t:.2?} s, direct {d:.2?} s (best {bt:.2} vs {bd:.2})"
    );
    assert!(
        bt <= 1.5 * bd + 0.5,
        "{agent:?} through tidemark took {bt:.2} s against {bd:.2} s direct (best of {t:.2?} and {d:.2?}): over 1.5x + 0.5 s"
    );
}

/// After a scenario's assertions: no anchor was lost, and the time
/// through tidemark is within budget of the direct run's.
async fn then_timed(agent: Agent, p: Played) {
    no_anchor_lost(p.stage.log_mark);
    let through = p.secs();
    drop(p);
    within_budget(agent, through).await;
}

/// No anchor-loss warning since `mark`.
fn no_anchor_lost(mark: usize) {
    let lost: Vec<String> = log_since(mark)
        .lines()
        .filter(|l| l.contains("anchor lost"))
        .map(str::to_string)
        .collect();
    assert!(lost.is_empty(), "anchor lost: {lost:#?}");
}

// ---------------------------------------------------------------------------
// The tests.

/// `claude -p` then `claude -c -p` twice: one session keyed by Claude Code's
/// own `x-claude-code-session-id` (`key_source: agent`), one main lane, 3
/// turns, each turn after the first projected `src=anchored`, and the
/// session object after each run shows that run's turn and projection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_continue_is_one_session_one_lane_anchored_from_turn_two() {
    let _one = SERIAL.lock().await;
    let p = play(Agent::Claude, Via::Tidemark).await;
    let ex = p.stage.relay.exchanges();
    // Quiet: the three turns and nothing else (no HEAD /api/hello, no count_tokens).
    assert_eq!(ex.len(), 3, "{ex:#?}");
    for e in &ex {
        assert_eq!(
            (e.method.as_str(), e.path(), e.status),
            ("POST", "/v1/messages", 200),
            "{e:#?}"
        );
    }
    let id = ex[0]
        .header("x-claude-code-session-id")
        .expect("Claude Code sends x-claude-code-session-id")
        .to_string();
    for e in &ex {
        assert_eq!(e.header("x-claude-code-session-id"), Some(id.as_str()));
    }
    let srcs: Vec<Option<&str>> = ex.iter().map(Exchange::src).collect();
    assert!(srcs[0].is_some(), "turn 1 has a projection header: {ex:#?}");
    assert_eq!(srcs[1..], [Some("anchored"); 2], "turns 2 and 3 anchored");
    for (k, list) in p.after.iter().enumerate() {
        let s = find(list, &id).unwrap_or_else(|| {
            panic!(
                "after run {}: no session keyed {id} (Claude Code's own id): {list:#?}",
                k + 1
            )
        });
        assert_eq!(s["turns"], k as u64 + 1, "after run {}: {s:#}", k + 1);
        assert_eq!(
            s["projection"].as_u64(),
            ex[k].projected(),
            "after run {}: {s:#}",
            k + 1
        );
        assert_eq!(s["state"], "anchored", "after run {}: {s:#}", k + 1);
    }
    let proxy = p.stage.proxy();
    let s = session(proxy, &id).await;
    assert_eq!(s["key_source"], "agent", "{s:#}");
    assert_eq!(s["turns"], 3);
    let l = lanes(&s);
    assert_eq!(l.len(), 1, "one main lane: {s:#}");
    assert_eq!(l[0]["turns"], 3);
    assert_eq!(l[0]["state"], "anchored");
    assert_eq!(sessions(proxy).await.len(), 1, "one session in all");
    then_timed(Agent::Claude, p).await;
}

/// `codex exec` then `codex exec resume --last`: both over the Responses
/// WebSocket mode through tidemark (a `101` each, no `POST /v1/responses`
/// fallback at the CLI or at the sim), every turn taken by tidemark's
/// WebSocket tap into one session keyed by Codex's thread id, the resumed
/// turn projected `src=anchored`, and the sockets released afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn codex_exec_and_resume_ride_the_websocket_as_one_anchored_session() {
    let _one = SERIAL.lock().await;
    let p = play(Agent::Codex, Via::Tidemark).await;
    let ex = p.stage.relay.exchanges();
    let posts: Vec<&Exchange> = ex.iter().filter(|e| e.method == "POST").collect();
    assert!(posts.is_empty(), "Codex fell back to HTTPS: {posts:#?}");
    assert_eq!(ex.len(), 2, "one handshake per process: {ex:#?}");
    for e in &ex {
        assert!(e.upgrade() && e.path() == "/v1/responses", "{e:#?}");
        assert_eq!(e.status, 101, "{e:#?}");
    }
    let recorded = p.stage.recorded();
    assert!(
        !recorded.iter().any(|f| f.contains("POST")),
        "the sim got HTTP requests: {recorded:#?}"
    );
    let frames = recorded.iter().filter(|f| f.contains("-WS-")).count();
    assert_eq!(frames, 4, "a prewarm and a turn per process: {recorded:#?}");
    let thread = ex[0]
        .header("session-id")
        .expect("Codex sends session-id")
        .to_string();
    assert_eq!(ex[1].header("session-id"), Some(thread.as_str()));
    // Every turn taken by tidemark's WebSocket tap (a warm-up is none), in
    // one session keyed by the thread.
    let turns = ws_turns(p.stage.log_mark);
    assert_eq!(turns.len(), 2, "{turns:#?}");
    for t in &turns {
        assert_eq!(t.session, thread, "{turns:#?}");
    }
    assert_eq!(turns[1].src, "anchored", "the resumed turn: {turns:#?}");
    let proxy = p.stage.proxy();
    for (k, list) in p.after.iter().enumerate() {
        let s = find(list, &thread)
            .unwrap_or_else(|| panic!("after run {}: no session keyed {thread}: {list:#?}", k + 1));
        assert_eq!(s["api"], "openai-responses");
        assert_eq!(s["turns"], k as u64 + 1, "after run {}: {s:#}", k + 1);
        assert_eq!(s["state"], "anchored", "after run {}: {s:#}", k + 1);
        assert_eq!(s["projection"].as_u64(), Some(turns[k].projection), "{s:#}");
    }
    let s = session(proxy, &thread).await;
    assert_eq!(s["key_source"], "agent", "{s:#}");
    assert_eq!(s["compactions"], 0, "a resumed run is no compaction: {s:#}");
    let l = lanes(&s);
    assert_eq!(l.len(), 1, "one main lane: {s:#}");
    assert_eq!(l[0]["turns"], 2);
    assert_eq!(sessions(proxy).await.len(), 1, "one session in all");
    // The sockets Codex dropped without a close frame are let go.
    within(10, async {
        loop {
            let (_, m) = get(&client_h1(), &proxy.admin_url("/metrics")).await;
            let open = String::from_utf8_lossy(&m)
                .lines()
                .find(|l| l.starts_with("tidemark_websockets{api=\"openai-responses\"}"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
            if open == Some(0.0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    then_timed(Agent::Codex, p).await;
}

/// `opencode run` then `opencode run --continue`: the title call (on the
/// small model) and the main loop carry the same `x-session-id`, and are
/// two lanes of that one session; the main lane's second turn is projected
/// `src=anchored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opencode_title_call_and_main_loop_are_two_lanes_of_one_session() {
    let _one = SERIAL.lock().await;
    let p = play(Agent::OpenCode, Via::Tidemark).await;
    let ex = p.stage.relay.exchanges();
    for e in &ex {
        assert_eq!(
            (e.method.as_str(), e.path(), e.status),
            ("POST", "/v1/messages", 200),
            "{e:#?}"
        );
    }
    let title: Vec<&Exchange> = ex
        .iter()
        .filter(|e| e.model.as_deref() == Some("claude-haiku-4-5"))
        .collect();
    let main: Vec<&Exchange> = ex
        .iter()
        .filter(|e| e.model.as_deref() == Some("claude-sonnet-4-5"))
        .collect();
    assert_eq!((title.len(), main.len(), ex.len()), (1, 2, 3), "{ex:#?}");
    let id = ex[0]
        .header("x-session-id")
        .expect("opencode sends x-session-id")
        .to_string();
    for e in &ex {
        assert_eq!(e.header("x-session-id"), Some(id.as_str()));
    }
    assert_eq!(
        main[1].src(),
        Some("anchored"),
        "the main lane's second turn: {ex:#?}"
    );
    let proxy = p.stage.proxy();
    let s = session(proxy, &id).await;
    assert_eq!(s["key_source"], "header", "{s:#}");
    assert_eq!(s["turns"], 3, "{s:#}");
    let l = lanes(&s);
    assert_eq!(l.len(), 2, "a title lane and a main lane: {s:#}");
    let lane = |m: &str| {
        l.iter()
            .find(|x| x["model"] == m)
            .unwrap_or_else(|| panic!("no lane on {m}: {s:#}"))
    };
    assert_eq!(lane("claude-haiku-4-5")["turns"], 1);
    assert_eq!(lane("claude-sonnet-4-5")["turns"], 2);
    assert_eq!(lane("claude-sonnet-4-5")["state"], "anchored");
    assert_eq!(
        lane("claude-sonnet-4-5")["projection"].as_u64(),
        main[1].projected(),
        "{s:#}"
    );
    assert_eq!(sessions(proxy).await.len(), 1, "one session in all");
    then_timed(Agent::OpenCode, p).await;
}

/// `gemini -p` then `gemini --resume latest -p`: Gemini CLI sends no
/// session identity, so its main loop is one fingerprinted session
/// (`key_source: fingerprint`), anchored on its second turn. Its router
/// calls (another model, another system prompt) pass through too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gemini_cli_resume_is_one_fingerprinted_session_anchored() {
    let _one = SERIAL.lock().await;
    let p = play(Agent::Gemini, Via::Tidemark).await;
    let ex = p.stage.relay.exchanges();
    for e in &ex {
        assert_eq!((e.method.as_str(), e.status), ("POST", 200), "{e:#?}");
        assert!(e.projection.is_some(), "{e:#?}");
    }
    let main: Vec<&Exchange> = ex
        .iter()
        .filter(|e| e.path().ends_with(":streamGenerateContent"))
        .collect();
    assert_eq!(main.len(), 2, "{ex:#?}");
    let model = main[0]
        .path()
        .rsplit('/')
        .next()
        .unwrap()
        .trim_end_matches(":streamGenerateContent");
    assert_eq!(main[1].src(), Some("anchored"), "the resumed turn: {ex:#?}");
    let proxy = p.stage.proxy();
    let all = sessions(proxy).await;
    let ours: Vec<&Value> = all
        .iter()
        .filter(|s| lanes(s).iter().any(|l| l["model"] == model))
        .collect();
    assert_eq!(ours.len(), 1, "the main loop is one session: {all:#?}");
    let s = ours[0];
    assert!(s["key"].as_str().unwrap().starts_with("fp:"), "{s:#}");
    assert_eq!(s["key_source"], "fingerprint", "{s:#}");
    let main_lane = lanes(s).iter().find(|l| l["model"] == model).unwrap();
    assert_eq!(main_lane["turns"], 2, "{s:#}");
    assert_eq!(main_lane["state"], "anchored", "{s:#}");
    then_timed(Agent::Gemini, p).await;
}

/// The official Python SDK's Responses WebSocket client
/// (`client.responses.connect()`): two turns over one socket through
/// tidemark, the second continuing the first by `previous_response_id`,
/// are one session; the second is projected `src=anchored` on the first's
/// real count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_sdk_responses_websocket_turns_anchor_a_session() {
    let _one = SERIAL.lock().await;
    let st = stage(Via::Tidemark, "python").await;
    let proxy = st.proxy();
    let script = format!("{ROOT}/tests/sdk/responses_ws.py");
    let base = format!("http://{}", proxy.addr);
    let py = python();
    let out = within(
        120,
        tokio::process::Command::new(&py)
            .arg(&script)
            .arg(&base)
            .output(),
    )
    .await
    .unwrap_or_else(|e| panic!("{py}: {e}; scripts/test.sh makes target/venv with the SDKs"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("OK"),
        "{script} failed (scripts/test.sh installs openai[realtime] into target/venv):\n{stdout}\n{}",
        tail(&stderr)
    );
    let reals: Vec<Value> =
        serde_json::from_str(stdout.lines().next().unwrap_or("")).expect("turns");
    let turns = ws_turns(st.log_mark);
    assert_eq!(turns.len(), 2, "{turns:#?}");
    assert_eq!(turns[0].session, turns[1].session, "{turns:#?}");
    assert_eq!(turns[1].src, "anchored", "{turns:#?}");
    let all = sessions(proxy).await;
    assert_eq!(all.len(), 1, "{all:#?}");
    let s = &all[0];
    assert_eq!(s["key"], turns[0].session.as_str());
    assert_eq!(s["turns"], 2, "{s:#}");
    assert_eq!(s["state"], "anchored");
    assert_eq!(s["anchor"]["real"], reals[1]["input_tokens"], "{s:#}");
    no_anchor_lost(st.log_mark);
}
