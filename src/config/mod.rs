//! Flags (clap, each also read from `TIDEMARK_<FLAG>`) parsed into a raw
//! struct, then validated into the [`Config`] the rest of the code reads.

pub mod otlp;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "tidemark",
    version,
    about = "A transparent LLM reverse proxy that knows how full every session's context window really is"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub flags: Flags,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run an embedded simulated provider and a scripted agent through the proxy (no API key).
    Demo {
        /// Turns per session.
        #[arg(long, default_value_t = 24)]
        turns: u32,
        /// Leave the simulated provider and proxy up afterwards, until Ctrl-C.
        #[arg(long)]
        keep_running: bool,
    },
    /// Serve the simulated provider alone, for real agents pointed at it
    /// (the agent tests and the capture of what agents send).
    #[command(hide = true)]
    Sim(SimArgs),
}

/// `tidemark sim`'s flags: the knobs of the simulator's `SimConfig` a real
/// agent's run needs (`SimConfig::from_args`).
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    #[arg(long, default_value = "127.0.0.1:8788")]
    pub listen: SocketAddr,
    /// The server the OpenAI chat path imitates: openai, vllm, llamacpp, ollama.
    #[arg(long, default_value = "openai")]
    pub flavour: Flavour,
    /// Write every request (credentials redacted) to this folder.
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Refuse prompts over this many tokens in each API's own words.
    #[arg(long)]
    pub context_window: Option<u64>,
    /// When the model calls tools: asked (only when the prompt names one),
    /// always, never.
    #[arg(long, default_value = "asked")]
    pub tools: String,
    /// Count as the sim first did (Anthropic as the estimator's own
    /// encoding times 1.15) rather than with the honest column of its
    /// counting table, the default.
    #[arg(long)]
    pub today_counting: bool,
    /// The default now; kept so scripts that pass it keep working.
    #[arg(long, hide = true)]
    pub honest: bool,
    /// Refuse the Responses WebSocket mode (426).
    #[arg(long)]
    pub no_websocket: bool,
}

/// Which server the simulator's OpenAI chat path imitates (`tidemark sim
/// --flavour`): its usage details and its context-length behaviour.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Flavour {
    #[default]
    OpenAi,
    Vllm,
    LlamaCpp,
    /// Ollama's OpenAI-compatible `/v1`: over the window it truncates.
    Ollama,
}

impl std::str::FromStr for Flavour {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "openai" => Ok(Flavour::OpenAi),
            "vllm" => Ok(Flavour::Vllm),
            "llamacpp" | "llama.cpp" | "llama-server" => Ok(Flavour::LlamaCpp),
            "ollama" => Ok(Flavour::Ollama),
            other => Err(format!(
                "unknown flavour {other:?} (openai, vllm, llamacpp, ollama)"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnOver {
    Pass,
    Reject,
    Trim,
}

impl OnOver {
    pub fn as_str(self) -> &'static str {
        match self {
            OnOver::Pass => "pass",
            OnOver::Reject => "reject",
            OnOver::Trim => "trim",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The flags as typed, before validation.
#[derive(Debug, Clone, Args)]
pub struct Flags {
    /// Proxy listener (HTTP/1.1 and h2c).
    #[arg(long, env = "TIDEMARK_LISTEN", default_value = "127.0.0.1:8787")]
    pub listen: SocketAddr,
    /// Admin listener: /metrics, /healthz, /readyz, /sessions.
    #[arg(long, env = "TIDEMARK_ADMIN_LISTEN", default_value = "127.0.0.1:9787")]
    pub admin_listen: SocketAddr,
    /// If set, admin endpoints other than /healthz require `Authorization: Bearer TOKEN`.
    #[arg(long, env = "TIDEMARK_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Allow a non-loopback --admin-listen without --admin-token (otherwise
    /// tidemark refuses to start): the admin API lists sessions and drops anchors.
    #[arg(long, env = "TIDEMARK_ADMIN_INSECURE")]
    pub admin_insecure: bool,
    /// Default upstream; may carry a path prefix.
    #[arg(
        long,
        env = "TIDEMARK_UPSTREAM",
        default_value = "https://api.openai.com"
    )]
    pub upstream: String,
    /// Extra route PREFIX=URL, longest path prefix wins; repeatable.
    #[arg(long = "route", env = "TIDEMARK_ROUTE", value_delimiter = ',')]
    pub routes: Vec<String>,
    /// Extra CA certificate (PEM) to trust for upstream TLS, for private CAs.
    #[arg(long, env = "TIDEMARK_UPSTREAM_CA")]
    pub upstream_ca: Option<PathBuf>,
    /// Header(s) that name a session; repeatable, first present wins.
    #[arg(
        long = "session-header",
        env = "TIDEMARK_SESSION_HEADER",
        value_delimiter = ','
    )]
    pub session_headers: Vec<String>,
    /// Ignore the session identities that agents send on their own.
    #[arg(long, env = "TIDEMARK_NO_AGENT_IDS")]
    pub no_agent_ids: bool,
    /// Do not derive a session key when no session identity is present.
    #[arg(long, env = "TIDEMARK_NO_FINGERPRINT")]
    pub no_fingerprint: bool,
    /// Model context size GLOB=TOKENS; repeatable; overrides the built-in table.
    #[arg(
        long = "context-window",
        env = "TIDEMARK_CONTEXT_WINDOW",
        value_delimiter = ','
    )]
    pub context_windows: Vec<String>,
    /// Utilisation at which responses carry x-context-warning.
    #[arg(long, env = "TIDEMARK_WARN_AT", default_value_t = 0.8)]
    pub warn_at: f64,
    /// What happens to a request whose projection exceeds --limit-at.
    #[arg(long, env = "TIDEMARK_ON_OVER", value_enum, default_value_t = OnOver::Pass)]
    pub on_over: OnOver,
    /// The over-budget line, as a fraction of the window.
    #[arg(long, env = "TIDEMARK_LIMIT_AT", default_value_t = 0.95)]
    pub limit_at: f64,
    /// Target utilisation after a trim.
    #[arg(long, env = "TIDEMARK_TRIM_TO", default_value_t = 0.7)]
    pub trim_to: f64,
    /// Count the request's max output tokens into the projection.
    #[arg(long, env = "TIDEMARK_RESERVE_OUTPUT")]
    pub reserve_output: bool,
    /// Cumulative real input+output tokens a session may spend.
    #[arg(long, env = "TIDEMARK_SESSION_BUDGET")]
    pub session_budget: Option<u64>,
    /// Never add stream_options.include_usage to OpenAI chat streams.
    #[arg(long, env = "TIDEMARK_NO_INJECT_USAGE")]
    pub no_inject_usage: bool,
    /// Measurement only: forward API responses without reading their usage
    /// (no anchors, no drift). The benchmark's tap-off column.
    #[arg(long, hide = true)]
    pub no_tap: bool,
    /// With no anchor, ask the provider's counting endpoint instead of estimating.
    #[arg(long, env = "TIDEMARK_EXACT_COLD_START")]
    pub exact_cold_start: bool,
    /// Upstream TCP+TLS connect timeout.
    #[arg(long, env = "TIDEMARK_CONNECT_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub connect_timeout: Duration,
    /// Request sent to response headers received.
    #[arg(long, env = "TIDEMARK_UPSTREAM_TIMEOUT", default_value = "600s", value_parser = parse_duration)]
    pub upstream_timeout: Duration,
    /// Longest silence inside a response stream.
    #[arg(long, env = "TIDEMARK_IDLE_TIMEOUT", default_value = "300s", value_parser = parse_duration)]
    pub idle_timeout: Duration,
    /// Idle sessions are forgotten after this.
    #[arg(long, env = "TIDEMARK_SESSION_TTL", default_value = "2h", value_parser = parse_duration)]
    pub session_ttl: Duration,
    /// Least-recently-used sessions are evicted beyond this.
    #[arg(long, env = "TIDEMARK_MAX_SESSIONS", default_value_t = 100_000)]
    pub max_sessions: usize,
    /// Larger request bodies are refused with 413.
    #[arg(long, env = "TIDEMARK_MAX_BODY_BYTES", default_value_t = 33_554_432)]
    pub max_body_bytes: usize,
    /// Largest total size of a request's headers.
    #[arg(long, env = "TIDEMARK_MAX_HEADER_BYTES", default_value_t = 65_536)]
    pub max_header_bytes: usize,
    /// Concurrent client connections; more wait in the accept queue.
    #[arg(long, env = "TIDEMARK_MAX_CONNECTIONS", default_value_t = 10_000)]
    pub max_connections: usize,
    /// Threads serving client connections, each with its own event loop and
    /// upstream connections; 0: one per CPU core.
    #[arg(long, env = "TIDEMARK_WORKERS", default_value_t = 0)]
    pub workers: usize,
    /// Time a client has to send its request headers (slowloris guard).
    #[arg(long, env = "TIDEMARK_HEADER_READ_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub header_read_timeout: Duration,
    /// How long in-flight requests may run after a shutdown signal.
    #[arg(long, env = "TIDEMARK_SHUTDOWN_GRACE", default_value = "30s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
    /// `memory`, or `redis://host:port/db` to share sessions between replicas.
    #[arg(long, env = "TIDEMARK_STATE", default_value = "memory")]
    pub state: String,
    /// Log format; logs never contain bodies, credentials or session content.
    #[arg(long, env = "TIDEMARK_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Export OpenTelemetry GenAI metrics and spans over OTLP/HTTP to this
    /// collector (base URL, e.g. http://localhost:4318); without it,
    /// OTEL_EXPORTER_OTLP_ENDPOINT and the other OTEL_* variables are read.
    #[arg(long, env = "TIDEMARK_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// Parse `500ms`, `10s`, `5m`, `2h`, `1d` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration `{s}`: expected e.g. 500ms, 10s, 2h"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        _ => {
            return Err(format!(
                "invalid duration unit in `{s}`: use ms, s, m, h or d"
            ))
        }
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("invalid duration `{s}`"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// An upstream base: scheme, authority and optional path prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
    /// Path prefix without a trailing slash (`/api` for `https://openrouter.ai/api`), or empty.
    pub prefix: String,
    /// The `Host` header for HTTP/1.1, made once rather than per request.
    pub host: http::HeaderValue,
}

impl Upstream {
    pub fn parse(s: &str) -> Result<Self, String> {
        let uri: http::Uri = s
            .parse()
            .map_err(|e| format!("invalid upstream URL `{s}`: {e}"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| format!("upstream `{s}` needs http:// or https://"))?;
        if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
            return Err(format!("upstream `{s}`: only http and https are supported"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("upstream `{s}` has no host"))?;
        if uri.query().is_some() {
            return Err(format!("upstream `{s}` must not carry a query"));
        }
        let prefix = uri.path().trim_end_matches('/').to_string();
        // Every request clones the authority and `Host`. Made from a static
        // string (leaked once per configured upstream, a few bytes) they
        // clone without a reference count, which all workers would share.
        let text: &'static str = Box::leak(authority.as_str().into());
        let statik = || bytes::Bytes::from_static(text.as_bytes());
        let host = http::HeaderValue::from_maybe_shared(statik())
            .map_err(|_| format!("upstream `{s}`: its host is not a valid header value"))?;
        let authority = http::uri::Authority::from_maybe_shared(statik())
            .map_err(|_| format!("upstream `{s}`: invalid host"))?;
        Ok(Upstream {
            scheme,
            authority,
            prefix,
            host,
        })
    }
}

/// A `--route`: requests whose path starts with `prefix` go to `upstream`.
#[derive(Debug, Clone)]
pub struct Route {
    pub prefix: String,
    pub upstream: Upstream,
}

/// A `--context-window` entry: a model glob and its window.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowRule {
    pub glob: String,
    pub tokens: u64,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub admin_token: Option<String>,
    pub upstream: Upstream,
    /// Sorted longest prefix first, so the first match wins.
    pub routes: Vec<Route>,
    pub upstream_ca: Option<PathBuf>,
    /// Lower-cased header names, in order of preference.
    pub session_headers: Vec<http::HeaderName>,
    /// Session ids that agents send of their own accord name sessions
    /// (off with `--no-agent-ids`).
    pub agent_ids: bool,
    pub fingerprint: bool,
    pub context_windows: Vec<WindowRule>,
    pub warn_at: f64,
    pub on_over: OnOver,
    pub limit_at: f64,
    pub trim_to: f64,
    pub reserve_output: bool,
    pub session_budget: Option<u64>,
    pub inject_usage: bool,
    /// Read usage off responses (off only with the hidden `--no-tap`).
    pub tap: bool,
    pub exact_cold_start: bool,
    pub connect_timeout: Duration,
    pub upstream_timeout: Duration,
    pub idle_timeout: Duration,
    pub session_ttl: Duration,
    pub max_sessions: usize,
    pub max_body_bytes: usize,
    pub max_header_bytes: usize,
    pub max_connections: usize,
    /// Connection-serving threads (resolved: at least 1).
    pub workers: usize,
    pub header_read_timeout: Duration,
    pub shutdown_grace: Duration,
    pub state: String,
    pub log_format: LogFormat,
    /// OTLP export, when an endpoint is configured (`--otlp-endpoint` or
    /// the `OTEL_*` variables).
    pub otlp: Option<otlp::OtlpConfig>,
}

/// The routes every install starts with; `--route` adds to them, and a route
/// with the same prefix replaces one of these.
pub const DEFAULT_ROUTES: &[(&str, &str)] = &[("/v1/messages", "https://api.anthropic.com")];

impl Flags {
    /// Validate the typed flags into a [`Config`].
    pub fn resolve(self) -> Result<Config, String> {
        let upstream = Upstream::parse(&self.upstream)?;
        let mut routes: Vec<Route> = Vec::new();
        let mut add = |prefix: &str, url: &str| -> Result<(), String> {
            if !prefix.starts_with('/') {
                return Err(format!("route prefix `{prefix}` must start with /"));
            }
            let r = Route {
                prefix: prefix.trim_end_matches('/').to_string(),
                upstream: Upstream::parse(url)?,
            };
            routes.retain(|x| x.prefix != r.prefix);
            routes.push(r);
            Ok(())
        };
        for (p, u) in DEFAULT_ROUTES {
            add(p, u)?;
        }
        for r in &self.routes {
            let (p, u) = r
                .split_once('=')
                .ok_or_else(|| format!("route `{r}` must be PREFIX=URL"))?;
            add(p.trim(), u.trim())?;
        }
        routes.sort_by_key(|r| std::cmp::Reverse(r.prefix.len()));

        let mut session_headers: Vec<String> = self
            .session_headers
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect();
        if session_headers.is_empty() {
            session_headers.push("x-session-id".to_string());
        }
        // Parsed once here, so a request's lookup does not parse the name.
        let session_headers = session_headers
            .iter()
            .map(|h| {
                http::HeaderName::from_bytes(h.as_bytes())
                    .map_err(|_| format!("invalid session header name `{h}`"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut context_windows = Vec::new();
        for w in &self.context_windows {
            let (g, t) = w
                .split_once('=')
                .ok_or_else(|| format!("context window `{w}` must be GLOB=TOKENS"))?;
            let tokens: u64 = t
                .trim()
                .replace('_', "")
                .parse()
                .map_err(|_| format!("context window `{w}`: TOKENS must be a whole number"))?;
            if tokens == 0 {
                return Err(format!("context window `{w}`: TOKENS must be positive"));
            }
            context_windows.push(WindowRule {
                glob: g.trim().to_string(),
                tokens,
            });
        }
        for (name, v) in [
            ("--warn-at", self.warn_at),
            ("--limit-at", self.limit_at),
            ("--trim-to", self.trim_to),
        ] {
            if !(v > 0.0 && v <= 2.0) {
                return Err(format!("{name} must be a fraction in (0, 2], got {v}"));
            }
        }
        if self.on_over == OnOver::Trim && self.trim_to >= self.limit_at {
            return Err(format!(
                "--trim-to ({}) must be below --limit-at ({})",
                self.trim_to, self.limit_at
            ));
        }
        if self.max_sessions == 0 || self.max_connections == 0 || self.max_body_bytes == 0 {
            return Err(
                "--max-sessions, --max-connections and --max-body-bytes must be positive"
                    .to_string(),
            );
        }
        let admin_token = self.admin_token.filter(|t| !t.is_empty());
        if !self.admin_listen.ip().is_loopback() && admin_token.is_none() && !self.admin_insecure {
            return Err(format!(
                "--admin-listen {} is not a loopback address and --admin-token is not set: \
                 anyone who reaches it could list sessions and drop anchors; \
                 set --admin-token (TIDEMARK_ADMIN_TOKEN) or acknowledge with --admin-insecure \
                 (TIDEMARK_ADMIN_INSECURE=true)",
                self.admin_listen
            ));
        }
        if self.state != "memory"
            && !self.state.starts_with("redis://")
            && !self.state.starts_with("rediss://")
        {
            return Err(format!(
                "--state must be `memory` or a redis:// URL, got `{}`",
                self.state
            ));
        }
        let otlp = otlp::OtlpConfig::resolve(self.otlp_endpoint.as_deref(), &otlp::process_env)?;
        Ok(Config {
            otlp,
            listen: self.listen,
            admin_listen: self.admin_listen,
            admin_token,
            upstream,
            routes,
            upstream_ca: self.upstream_ca,
            session_headers,
            agent_ids: !self.no_agent_ids,
            fingerprint: !self.no_fingerprint,
            context_windows,
            warn_at: self.warn_at,
            on_over: self.on_over,
            limit_at: self.limit_at,
            trim_to: self.trim_to,
            reserve_output: self.reserve_output,
            session_budget: self.session_budget,
            inject_usage: !self.no_inject_usage && !self.no_tap,
            tap: !self.no_tap,
            exact_cold_start: self.exact_cold_start,
            connect_timeout: self.connect_timeout,
            upstream_timeout: self.upstream_timeout,
            idle_timeout: self.idle_timeout,
            session_ttl: self.session_ttl,
            max_sessions: self.max_sessions,
            max_body_bytes: self.max_body_bytes,
            max_header_bytes: self.max_header_bytes,
            max_connections: self.max_connections,
            workers: match self.workers {
                0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
                n => n,
            },
            header_read_timeout: self.header_read_timeout,
            shutdown_grace: self.shutdown_grace,
            state: self.state,
            log_format: self.log_format,
        })
    }
}

impl Config {
    /// A configuration with every default and the given upstream, for tests and the demo.
    pub fn for_upstream(upstream: &str) -> Result<Config, String> {
        let mut flags = Flags::try_parse_from(["tidemark"]).map_err(|e| e.to_string())?;
        flags.upstream = upstream.to_string();
        flags.resolve()
    }

    /// Parse flags from an argument list (the first element is the program name).
    pub fn from_args<I, T>(args: I) -> Result<Config, String>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        Flags::try_parse_from(args)
            .map_err(|e| e.to_string())?
            .resolve()
    }

    /// The upstream for a request path: the longest matching route, else the default.
    pub fn upstream_for(&self, path: &str) -> &Upstream {
        for r in &self.routes {
            if path == r.prefix
                || (path.starts_with(&r.prefix)
                    && path.as_bytes().get(r.prefix.len()) == Some(&b'/'))
            {
                return &r.upstream;
            }
        }
        &self.upstream
    }
}

impl Flags {
    fn try_parse_from<I, T>(args: I) -> Result<Flags, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        #[derive(Parser)]
        struct Only {
            #[command(flatten)]
            flags: Flags,
        }
        Only::try_parse_from(args).map(|o| o.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert!(parse_duration("5y").is_err());
        assert!(parse_duration("abc").is_err());
    }

    #[test]
    fn routes_longest_prefix_wins_and_defaults_replaceable() {
        let c = Config::from_args([
            "tidemark",
            "--upstream",
            "https://openrouter.ai/api",
            "--route",
            "/v1/messages=http://127.0.0.1:9/anth",
            "--route",
            "/v1=http://127.0.0.1:8",
        ])
        .unwrap();
        assert_eq!(c.upstream.prefix, "/api");
        assert_eq!(
            c.upstream_for("/v1/messages").authority.as_str(),
            "127.0.0.1:9"
        );
        assert_eq!(c.upstream_for("/v1/messages/count_tokens").prefix, "/anth");
        assert_eq!(
            c.upstream_for("/v1/chat/completions").authority.as_str(),
            "127.0.0.1:8"
        );
        assert_eq!(c.upstream_for("/v10/x").authority.as_str(), "openrouter.ai");
        assert_eq!(c.routes.len(), 2);
    }

    #[test]
    fn rejects_bad_values() {
        assert!(Config::from_args(["tidemark", "--upstream", "ftp://x"]).is_err());
        assert!(Config::from_args(["tidemark", "--route", "nope"]).is_err());
        assert!(Config::from_args(["tidemark", "--context-window", "gpt-*=abc"]).is_err());
        assert!(Config::from_args(["tidemark", "--on-over", "trim", "--trim-to", "0.99"]).is_err());
    }
}
