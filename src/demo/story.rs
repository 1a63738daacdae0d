//! The demo's second part: the scripted agent of the gate table again,
//! behind tidemark's policies, act by act — refused before the provider
//! would refuse it (`--on-over reject`), trimmed (`--on-over trim`), a
//! response without usage, an early edit — each act's line printed from
//! what the agent saw, tidemark's metrics and `/sessions`, and the
//! simulated provider's own accounting; then what the same agent without
//! tidemark would have seen, from the same agent sent straight to the
//! provider.

use std::fmt::Write as _;
use std::net::SocketAddr;

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use super::{
    error_pct, parse_projection, parse_stream, prose, Agent, DemoApi, HttpClient, Rng, DEMO_WINDOW,
    OPENAI_MODEL,
};
use crate::config::{Flags, OnOver};
use crate::estimate::Estimator;
use crate::json::RequestView;
use crate::provider::Api;
use crate::sim::{self, Accounting, SimConfig, Simulator, X_SIM_OMIT_USAGE, X_SIM_PROMPT_TOKENS};

/// The story's agent: the gate table's OpenAI session, same seed.
pub(super) const SEED: u64 = 0x7AD3;
/// No act takes the agent further than this.
const MAX_TURNS: u32 = 80;
/// Turns the trim's cut is watched holding before the next act.
const HOLD_TURNS: u32 = 3;

/// The simulated provider and the two tidemarks of the story.
struct Stack {
    sim: SocketAddr,
    counting: sim::CountingMode,
    acct: Accounting,
    reject: Tidemark,
    trim: Tidemark,
    stops: Vec<oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

#[derive(Clone, Copy)]
struct Tidemark {
    proxy: SocketAddr,
    admin: SocketAddr,
}

async fn bind() -> Result<(TcpListener, SocketAddr), String> {
    let l = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .map_err(|e| format!("binding the story's listeners: {e}"))?;
    let a = l.local_addr().map_err(|e| e.to_string())?;
    Ok((l, a))
}

impl Stack {
    async fn start(flags: &Flags, sim_cfg: SimConfig) -> Result<Stack, String> {
        let (sim_l, sim) = bind().await?;
        let counting = sim_cfg.counting;
        let simulator = Simulator::new(sim_cfg);
        let acct = simulator.accounting();
        let (sim_stop, rx) = oneshot::channel::<()>();
        let mut tasks = vec![tokio::spawn(simulator.serve(sim_l, async move {
            let _ = rx.await;
        }))];
        let mut stops = vec![sim_stop];
        let tidemark = |on_over: OnOver| {
            let mut f = flags.clone();
            f.upstream = format!("http://{sim}");
            f.routes = vec![format!("/v1/messages=http://{sim}")];
            f.upstream_ca = None;
            f.on_over = on_over;
            if f.context_windows.is_empty() {
                f.context_windows = vec![format!("{OPENAI_MODEL}*={DEMO_WINDOW}")];
            }
            f.resolve()
        };
        let configs = [tidemark(OnOver::Reject)?, tidemark(OnOver::Trim)?];
        let mut up = Vec::new();
        for config in configs {
            let (l, proxy) = bind().await?;
            let (admin_l, admin) = bind().await?;
            let (stop, rx) = oneshot::channel::<()>();
            tasks.push(tokio::spawn(async move {
                if let Err(e) = crate::run(l, admin_l, config, async move {
                    let _ = rx.await;
                })
                .await
                {
                    tracing::error!(error = %e, "demo story proxy stopped");
                }
            }));
            stops.push(stop);
            up.push(Tidemark { proxy, admin });
        }
        Ok(Stack {
            sim,
            counting,
            acct,
            reject: up[0],
            trim: up[1],
            stops,
            tasks,
        })
    }

    async fn stop(self) {
        for s in self.stops {
            let _ = s.send(());
        }
        for t in self.tasks {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(3), t).await;
        }
    }
}

impl Agent {
    /// Its own recovery from a context-length refusal: the history becomes
    /// one summary message (a new start, as Claude Code's and Codex's are).
    fn compact(&mut self) -> usize {
        let n = self.messages.len();
        let mut rng = Rng::new(0xC0FFEE);
        let summary = format!(
            "Summary of the work so far (the earlier turns were compacted): {}",
            prose(&mut rng, 260, false)
        );
        self.messages.clear();
        self.push_user(summary);
        n
    }

    /// Rewrite its first text reply in place (an agent that tidies its own
    /// history): everything after it is a new prefix to the provider.
    fn edit_early(&mut self) -> bool {
        let first_text = self.messages.iter_mut().find(|m| {
            m.get("role").and_then(Value::as_str) == Some("assistant")
                && m.get("content").is_some_and(Value::is_string)
        });
        match first_text {
            Some(m) => {
                m["content"] = json!("(Revised.) The file reads cleanly; the buffer is flushed before the write, as the tests expect.");
                true
            }
            None => false,
        }
    }
}

/// One turn as the agent saw it.
#[derive(Debug, Clone, Default)]
struct Turn {
    n: u32,
    status: u16,
    /// The provider's count (`x-sim-prompt-tokens`); `None` when the
    /// request never reached it.
    real: Option<u64>,
    /// The agent's own local estimate of the body.
    estimate: u64,
    projection: Option<(u64, String, Option<u64>)>,
    trimmed: Option<String>,
    tidemark_error: Option<String>,
    /// The error body's message, if any.
    message: Option<String>,
}

impl Turn {
    fn src(&self) -> &str {
        self.projection.as_ref().map_or("-", |p| p.1.as_str())
    }
    fn tokens(&self) -> u64 {
        self.projection.as_ref().map_or(0, |p| p.0)
    }
    /// (projection - real) / real, as the table prints it.
    fn error(&self) -> String {
        match (self.projection.as_ref(), self.real) {
            (Some(p), Some(r)) if r > 0 => format!("{:+.2}%", error_pct(p.0, r)),
            _ => "-".into(),
        }
    }
}

/// Where a turn goes and as whom.
struct Route<'a> {
    client: &'a HttpClient,
    addr: SocketAddr,
    credential: &'a str,
    session: &'a str,
    estimator: &'a Estimator,
}

impl Route<'_> {
    /// Send the agent's next request; on a 200, the agent takes the reply.
    async fn turn(&self, agent: &mut Agent, n: u32, omit_usage: bool) -> Result<Turn, String> {
        let body = serde_json::to_vec(&agent.body()).map_err(|e| e.to_string())?;
        let estimate = RequestView::parse(&body)
            .map(|v| {
                self.estimator
                    .estimate(Api::OpenAiChat.provider(), &v, Some(agent.model))
            })
            .unwrap_or_default()
            .tokens;
        let mut req = Request::post(format!("http://{}/v1/chat/completions", self.addr))
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", self.credential))
            .header("x-session-id", self.session);
        if omit_usage {
            req = req.header(X_SIM_OMIT_USAGE, "1");
        }
        let req = req
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let wait = std::time::Duration::from_secs(60);
        let resp = tokio::time::timeout(wait, self.client.request(req))
            .await
            .map_err(|_| format!("turn {n} timed out"))?
            .map_err(|e| format!("turn {n}: {e}"))?;
        let (parts, body) = resp.into_parts();
        let hdr = |h: &str| {
            parts
                .headers
                .get(h)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let bytes = tokio::time::timeout(wait, body.collect())
            .await
            .map_err(|_| format!("turn {n}: body timed out"))?
            .map_err(|e| format!("turn {n}: {e}"))?
            .to_bytes();
        let text = String::from_utf8_lossy(&bytes);
        let status = parts.status.as_u16();
        let message = serde_json::from_slice::<Value>(&bytes).ok().and_then(|v| {
            v.pointer("/error/message")
                .and_then(Value::as_str)
                .map(str::to_string)
        });
        if status == 200 {
            let reply = parse_stream(DemoApi::OpenAiChat, &text)
                .ok_or_else(|| format!("turn {n}: the response carried no reply"))?;
            agent.advance(reply);
        }
        Ok(Turn {
            n,
            status,
            real: hdr(X_SIM_PROMPT_TOKENS).and_then(|v| v.parse().ok()),
            estimate,
            projection: hdr("x-context-projection").and_then(|h| parse_projection(&h)),
            trimmed: hdr("x-context-trimmed"),
            tidemark_error: hdr("x-tidemark-error"),
            message,
        })
    }
}

/// A JSON document from an admin endpoint, or a metric's value.
async fn admin_get(client: &HttpClient, admin: SocketAddr, path: &str) -> String {
    let Ok(req) = Request::get(format!("http://{admin}{path}")).body(Full::new(Bytes::new()))
    else {
        return String::new();
    };
    let wait = std::time::Duration::from_secs(10);
    let Ok(Ok(resp)) = tokio::time::timeout(wait, client.request(req)).await else {
        return String::new();
    };
    match tokio::time::timeout(wait, resp.into_body().collect()).await {
        Ok(Ok(b)) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
        _ => String::new(),
    }
}

/// The sum of a family's series whose labels include each of `labels`.
fn metric(text: &str, family: &str, labels: &[(&str, &str)]) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(family) && l[family.len()..].starts_with('{'))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// `1234567` as `1,234,567`.
fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn pct(n: u64, of: u64) -> String {
    format!("{:.1}%", n as f64 / of.max(1) as f64 * 100.0)
}

/// Run the story and return its text.
pub(super) async fn run(
    flags: &Flags,
    client: &HttpClient,
    estimator: &Estimator,
    sim_cfg: SimConfig,
) -> Result<String, String> {
    let stack = Stack::start(flags, sim_cfg).await?;
    let out = acts(&stack, client, estimator).await;
    stack.stop().await;
    out
}

/// Act 1: --on-over reject. The agent replays the gate table's session
/// until tidemark refuses a turn. Returns what the same agent met without
/// tidemark, for the closing comparison: its turns up to the provider's
/// own refusal, and that refusal.
async fn act_reject(
    s: &Stack,
    client: &HttpClient,
    estimator: &Estimator,
    out: &mut String,
) -> Result<(Vec<Turn>, Turn), String> {
    let w = DEMO_WINDOW;
    let r = Route {
        client,
        addr: s.reject.proxy,
        credential: "sk-demo-story-reject",
        session: "demo-story-reject",
        estimator,
    };
    let mut agent = Agent::new(DemoApi::OpenAiChat, SEED);
    let mut n = 0;
    let refused = loop {
        n += 1;
        if n > MAX_TURNS {
            return Err("act 1: tidemark never refused a turn".into());
        }
        let t = r.turn(&mut agent, n, false).await?;
        if t.status != 200 {
            break t;
        }
    };
    if refused.tidemark_error.as_deref() != Some("context-budget") {
        return Err(format!(
            "act 1: turn {n} was refused by the provider, not by tidemark ({})",
            refused.status
        ));
    }
    // What the provider would have counted, had it been sent.
    let would = sim::count_prompt_with(sim::SimApi::OpenAiChat, &agent.body(), s.counting).total;
    // Without tidemark: the same agent, straight to the provider, until it refuses.
    let direct = Route {
        addr: s.sim,
        credential: "sk-demo-story-direct",
        session: "demo-story-direct",
        ..r
    };
    let mut alone = agent.clone();
    let mut alone_turns = Vec::new();
    let mut k = n;
    let wall = loop {
        let t = direct.turn(&mut alone, k, false).await?;
        if t.status != 200 || k > n + 20 {
            break t;
        }
        alone_turns.push(t);
        k += 1;
    };
    let msg = refused.message.clone().unwrap_or_default();
    let _ = writeln!(
        *out,
        "reject  turn {n} refused by tidemark, never sent: 400 context_length_exceeded (x-tidemark-error: {}) \"{}\" The provider's own count of it: {} ({} of the window): it would have taken it.",
        refused.tidemark_error.as_deref().unwrap_or("-"),
        msg.split(". Please").next().unwrap_or(&msg).trim_end_matches('.').to_string() + ".",
        thousands(would),
        pct(would, w),
    );
    let messages = agent.compact();
    let after1 = r.turn(&mut agent, n + 1, false).await?;
    let after2 = r.turn(&mut agent, n + 2, false).await?;
    let _ = writeln!(
        *out,
        "        the agent compacted ({messages} messages -> 1 summary) and carried on: turn {} projected {}, counted {} (src={}, {}); turn {} src={} ({})",
        after1.n,
        thousands(after1.tokens()),
        thousands(after1.real.unwrap_or(0)),
        after1.src(),
        after1.error(),
        after2.n,
        after2.src(),
        after2.error(),
    );
    Ok((alone_turns, wall))
}

/// Act 2: --on-over trim. The same agent from its first turn, behind a
/// tidemark that trims; the first trim, then the cut holding. Returns the
/// tokens the trim's new cut cost the cache.
async fn act_trim(
    s: &Stack,
    t: &Route<'_>,
    agent: &mut Agent,
    n: &mut u32,
    out: &mut String,
) -> Result<u64, String> {
    let model = [("model", OPENAI_MODEL)];
    let first_trim = loop {
        *n += 1;
        if *n > MAX_TURNS {
            return Err("act 2: no turn was trimmed".into());
        }
        let turn = t.turn(agent, *n, false).await?;
        if turn.status != 200 {
            return Err(format!("act 2: turn {n} answered {}", turn.status));
        }
        if turn.trimmed.is_some() {
            break turn;
        }
    };
    let metrics = admin_get(t.client, s.trim.admin, "/metrics").await;
    let trim_busts = metric(
        &metrics,
        "tidemark_cache_busts_total",
        &[model[0], ("cause", "trim")],
    );
    let trim_lost = metric(&metrics, "tidemark_cache_invalidated_tokens_total", &model);
    let held_from = *n + 1;
    let before = s.acct.credential(t.credential);
    for _ in 0..HOLD_TURNS {
        *n += 1;
        t.turn(agent, *n, false).await?;
    }
    let held = s.acct.credential(t.credential);
    let new = &held.events[before.events.len().min(held.events.len())..];
    let (read, prompt) = new
        .iter()
        .fold((0, 0), |(r, p), e| (r + e.read, p + e.prompt));
    let held_busts = new.iter().filter(|e| e.invalidated > 0).count();
    let _ = writeln!(
        *out,
        "trim    turn {} behind --on-over trim: trimmed and sent (x-context-trimmed: {}); the provider counted {}.",
        first_trim.n,
        first_trim.trimmed.as_deref().unwrap_or("-"),
        thousands(first_trim.real.unwrap_or(0)),
    );
    let _ = writeln!(
        *out,
        "        the new cut cost the prompt cache {} tokens (tidemark_cache_busts_total{{cause=\"trim\"}} {trim_busts}); then it held: turns {held_from}-{n} read {} of their prompts from the cache, {held_busts} busts.",
        thousands(trim_lost),
        pct(read, prompt),
    );
    Ok(trim_lost)
}

/// Act 3: one response without usage. Returns the turn after it and the
/// provider's count of the agent's whole (untrimmed) body there.
async fn act_loss(
    s: &Stack,
    t: &Route<'_>,
    agent: &mut Agent,
    n: &mut u32,
    out: &mut String,
) -> Result<(Turn, u64), String> {
    let model = [("model", OPENAI_MODEL)];
    *n += 1;
    t.turn(agent, *n, true).await?;
    let no_usage = *n;
    *n += 1;
    // The agent's own body, as the provider would count it untrimmed.
    let whole = sim::count_prompt_with(sim::SimApi::OpenAiChat, &agent.body(), s.counting).total;
    let lost = t.turn(agent, *n, false).await?;
    let metrics = admin_get(t.client, s.trim.admin, "/metrics").await;
    let lost_total = metric(&metrics, "tidemark_anchor_lost_total", &model);
    let session: Value =
        serde_json::from_str(&admin_get(t.client, s.trim.admin, "/sessions/demo-story-trim").await)
            .unwrap_or(Value::Null);
    let losses = session["anchor_losses"].as_u64().unwrap_or(0);
    *n += 1;
    let back = t.turn(agent, *n, false).await?;
    let _ = writeln!(
        *out,
        "loss    turn {no_usage}: the provider's response carried no usage. turn {}: src={} ({}), tidemark_anchor_lost_total {lost_total}, anchor_losses {losses} in /sessions, one WARN in the log; turn {}: src={} again.",
        lost.n,
        lost.src(),
        lost.error(),
        back.n,
        back.src(),
    );
    Ok((lost, whole))
}

/// Act 4: an early edit. Returns the tokens the provider read from its
/// cache before the edit and after it.
async fn act_bust(
    s: &Stack,
    t: &Route<'_>,
    agent: &mut Agent,
    n: &mut u32,
    trim_lost: u64,
    out: &mut String,
) -> Result<(u64, u64), String> {
    let model = [("model", OPENAI_MODEL)];
    let before = s.acct.credential(t.credential);
    let cached = before.events.last().map_or(0, |e| e.read + e.write);
    if !agent.edit_early() {
        return Err("act 4: no reply to edit".into());
    }
    *n += 1;
    let edited = t.turn(agent, *n, false).await?;
    let after = s.acct.credential(t.credential);
    let ev = after
        .events
        .last()
        .cloned()
        .unwrap_or_else(|| sim::CacheEvent {
            model: String::new(),
            prompt: 0,
            read: 0,
            write: 0,
            invalidated: 0,
        });
    let metrics = admin_get(t.client, s.trim.admin, "/metrics").await;
    let history = metric(
        &metrics,
        "tidemark_cache_busts_total",
        &[model[0], ("cause", "history")],
    );
    let invalidated = metric(&metrics, "tidemark_cache_invalidated_tokens_total", &model);
    let _ = writeln!(
        *out,
        "bust    turn {}: the agent rewrote its first reply. The provider read {} of the {} tokens it had cached: {} invalidated (tidemark_cache_busts_total{{cause=\"history\"}} {history}; tidemark_cache_invalidated_tokens_total +{}; the provider's own accounting: {}).",
        edited.n,
        thousands(ev.read),
        thousands(cached),
        thousands(ev.invalidated),
        thousands(invalidated.saturating_sub(trim_lost)),
        thousands(after.invalidated_tokens - before.invalidated_tokens),
    );
    Ok((before.events.last().map_or(0, |e| e.read), ev.read))
}

async fn acts(s: &Stack, client: &HttpClient, estimator: &Estimator) -> Result<String, String> {
    let w = DEMO_WINDOW;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n== the same agent, continued behind tidemark's policies (openai-chat · model {OPENAI_MODEL} · window {w})"
    );

    let (alone_turns, wall) = act_reject(s, client, estimator, &mut out).await?;

    // Acts 2 to 4: one agent, behind the tidemark that trims.
    let t = Route {
        client,
        addr: s.trim.proxy,
        credential: "sk-demo-story-trim",
        session: "demo-story-trim",
        estimator,
    };
    let mut agent = Agent::new(DemoApi::OpenAiChat, SEED);
    let mut n = 0;
    let trim_lost = act_trim(s, &t, &mut agent, &mut n, &mut out).await?;
    let (lost, whole) = act_loss(s, &t, &mut agent, &mut n, &mut out).await?;
    let (read_before, read_after) =
        act_bust(s, &t, &mut agent, &mut n, trim_lost, &mut out).await?;

    // What the same agent saw without tidemark.
    let _ = writeln!(out, "without tidemark:");
    let run_up: Vec<String> = alone_turns
        .iter()
        .filter_map(|t| t.real.map(|r| format!("turn {} at {}", t.n, pct(r, w))))
        .collect();
    let _ = writeln!(
        out,
        "  reject: the provider's own 400 at turn {} (\"{}\"), after {} of the window, paid for.",
        wall.n,
        wall.message
            .as_deref()
            .and_then(|m| m.split(". However").next())
            .unwrap_or("-"),
        if run_up.is_empty() {
            "no turn".to_string()
        } else {
            run_up.join(", ")
        },
    );
    let _ = writeln!(
        out,
        "  trim:   the same 400 at turn {}, and at every turn after it until the agent gives up its history.",
        wall.n
    );
    let _ = writeln!(
        out,
        "  loss:   no sign of it: the agent goes on with its own estimate, {:+.2}% off the provider's count at turn {} (tidemark's projection from its last anchor: {}).",
        error_pct(lost.estimate, whole),
        lost.n,
        lost.error(),
    );
    let _ = writeln!(
        out,
        "  bust:   nothing either: its usage (had it asked) shows cached tokens falling from {} to {}, and says nothing of why.",
        thousands(read_before),
        thousands(read_after),
    );
    Ok(out)
}
