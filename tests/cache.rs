//! Cache economics: the prefix each request shares with its lane's
//! previous one, against the cache reads the provider reports. Through the
//! real proxy in front of the simulated provider, whose prompt cache keeps
//! its own accounting per credential: tidemark's busts and invalidated
//! tokens must be the provider's.
mod support;
use support::Sim;

use serde_json::{json, Value};
use support::{client_h1, get, send, Proxy};
use tidemark::sim::{CacheStats, SimConfig};

async fn sim() -> Sim {
    support::sim(SimConfig::default()).await
}

async fn proxy_for(s: &Sim, extra: &[&str]) -> Proxy {
    let route = format!("/v1/messages={}", s.url);
    let mut args = vec!["--route", route.as_str()];
    args.extend_from_slice(extra);
    support::proxy(&s.url, &args).await
}

/// How turn `t` of a conversation differs from the plain one.
#[derive(Clone, Copy, Default)]
struct Edits {
    /// The first assistant reply rewritten.
    early: bool,
    /// A tool's description reworded.
    tools: bool,
    /// The system prompt re-rendered.
    system: bool,
}

fn user(i: usize) -> String {
    format!("Step {i}: read the parser again, then check how the buffer is flushed. ").repeat(22)
}

fn reply(i: usize, e: Edits) -> String {
    if i == 1 && e.early {
        "Edited afterwards: the first reply, rewritten in place.".to_string()
    } else {
        format!("Checked step {i}; the buffer was not flushed before the write.")
    }
}

fn system(e: Edits) -> String {
    let mut s = "Follow every rule of the repository carefully and cite the file. ".repeat(110);
    if e.system {
        s.push_str("\nToday is Tuesday.");
    }
    s
}

/// Turn `t` (1-based) of an OpenAI chat conversation with a long system
/// prompt and two tools.
fn chat(model: &str, t: usize, e: Edits) -> Value {
    let describe = if e.tools {
        "Read a file from the repository (reworded)."
    } else {
        "Read a file from the repository."
    };
    let tools = json!([
        {"type":"function","function":{"name":"read_file","description":describe,
            "parameters":{"type":"object","properties":{"path":{"type":"string"}}}}},
        {"type":"function","function":{"name":"search","description":"Search the docs.",
            "parameters":{"type":"object","properties":{"q":{"type":"string"}}}}}
    ]);
    let mut m = vec![json!({"role":"system","content":system(e)})];
    for i in 1..=t {
        if i > 1 {
            m.push(json!({"role":"assistant","content":reply(i - 1, e)}));
        }
        m.push(json!({"role":"user","content":user(i)}));
    }
    json!({"model":model,"messages":m,"tools":tools,"tool_choice":"none"})
}

/// The same conversation in Anthropic's shape, cached Claude Code's way:
/// a breakpoint on the system prompt and one on the newest message.
fn anthropic(model: &str, t: usize, e: Edits) -> Value {
    let mut m = Vec::new();
    for i in 1..=t {
        if i > 1 {
            m.push(json!({"role":"assistant","content":[{"type":"text","text":reply(i - 1, e)}]}));
        }
        m.push(json!({"role":"user","content":[{"type":"text","text":user(i)}]}));
    }
    if let Some(last) = m.last_mut() {
        last["content"][0]["cache_control"] = json!({"type":"ephemeral"});
    }
    json!({"model":model,"max_tokens":64,
        "system":[{"type":"text","text":system(e),"cache_control":{"type":"ephemeral"}}],
        "messages":m})
}

struct Turn {
    status: u16,
    trimmed: bool,
}

async fn send_turn(px: &Proxy, path: &str, key: &str, session: &str, body: &Value) -> Turn {
    let req = http::Request::post(px.url(path))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .header("x-api-key", key)
        .header("x-session-id", session)
        .body(support::full(body.to_string()))
        .unwrap();
    let (parts, body) = send(&client_h1(), req).await;
    assert!(
        parts.status == 200 || parts.status == 400,
        "{}",
        String::from_utf8_lossy(&body)
    );
    Turn {
        status: parts.status.as_u16(),
        trimmed: parts.headers.contains_key("x-context-trimmed"),
    }
}

/// The sum of a family's series whose labels include every `(name, value)`.
async fn metric(px: &Proxy, family: &str, labels: &[(&str, &str)]) -> u64 {
    let (_, body) = get(&client_h1(), &px.admin_url("/metrics")).await;
    let text = String::from_utf8(body.to_vec()).unwrap();
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

async fn lane_cache(px: &Proxy, session: &str) -> Value {
    let (parts, body) = get(&client_h1(), &px.admin_url(&format!("/sessions/{session}"))).await;
    assert_eq!(parts.status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["cache"].clone()
}

/// tidemark's metrics and lane against the provider's own accounting.
async fn agree(px: &Proxy, api: &str, model: &str, session: &str, st: &CacheStats) -> Value {
    let busts = metric(
        px,
        "tidemark_cache_busts_total",
        &[("api", api), ("model", model)],
    )
    .await;
    let invalidated = metric(
        px,
        "tidemark_cache_invalidated_tokens_total",
        &[("api", api), ("model", model)],
    )
    .await;
    assert_eq!(busts, st.busts, "busts: {st:?}");
    assert_eq!(invalidated, st.invalidated_tokens, "invalidated: {st:?}");
    let cache = lane_cache(px, session).await;
    assert_eq!(cache["busts"], json!(st.busts), "{cache}");
    assert_eq!(cache["invalidated_tokens"], json!(st.invalidated_tokens));
    let prompt: u64 = st.events.iter().map(|e| e.prompt).sum();
    let ratio = (st.read_tokens as f64 / prompt as f64 * 1000.0).round() / 1000.0;
    assert_eq!(cache["hit_ratio"], json!(ratio), "{cache} vs {st:?}");
    cache
}

/// One agent's conversation through the proxy: its model (a metric label
/// of its own), credential (the provider's accounting is per credential)
/// and session.
struct Agent<'a> {
    px: &'a Proxy,
    path: &'static str,
    shape: fn(&str, usize, Edits) -> Value,
    model: &'static str,
    key: &'static str,
    session: &'static str,
}

impl Agent<'_> {
    fn chat<'a>(px: &'a Proxy, model: &'static str, key: &'static str) -> Agent<'a> {
        Agent {
            px,
            path: "/v1/chat/completions",
            shape: chat,
            model,
            key,
            session: key,
        }
    }

    /// Turns `from..=to`, each with `e`; how many were trimmed.
    async fn turns(&self, from: usize, to: usize, e: Edits) -> usize {
        let mut trimmed = 0;
        for t in from..=to {
            let body = (self.shape)(self.model, t, e);
            let r = send_turn(self.px, self.path, self.key, self.session, &body).await;
            assert_eq!(r.status, 200, "turn {t}");
            trimmed += usize::from(r.trimmed);
        }
        trimmed
    }

    fn api(&self) -> &'static str {
        match self.path {
            "/v1/messages" => "anthropic-messages",
            _ => "openai-chat",
        }
    }

    /// `tidemark_cache_busts_total` of this model and `cause`.
    async fn busts(&self, cause: &str) -> u64 {
        let labels = [("model", self.model), ("cause", cause)];
        metric(self.px, "tidemark_cache_busts_total", &labels).await
    }

    /// tidemark against the provider's accounting of this credential.
    async fn agree(&self, s: &Sim) -> (CacheStats, Value) {
        let st = s.acct.credential(self.key);
        let cache = agree(self.px, self.api(), self.model, self.session, &st).await;
        (st, cache)
    }
}

const EARLY: Edits = Edits {
    early: true,
    tools: false,
    system: false,
};

#[tokio::test]
async fn an_unchanged_history_busts_nothing() {
    let s = sim().await;
    let px = proxy_for(&s, &[]).await;
    let a = Agent::chat(&px, "gpt-4o-cache-unchanged", "sk-cache-unchanged");
    a.turns(1, 5, Edits::default()).await;
    let (st, cache) = a.agree(&s).await;
    assert_eq!((st.requests, st.busts), (5, 0), "{st:?}");
    assert!(st.read_tokens > 0);
    assert!(cache["hit_ratio"].as_f64().unwrap() > 0.5, "{cache}");
    px.stop().await;
}

#[tokio::test]
async fn an_early_edit_is_a_history_bust_of_what_the_provider_lost() {
    let s = sim().await;
    let px = proxy_for(&s, &[]).await;
    let a = Agent::chat(&px, "gpt-4o-cache-edit", "sk-cache-edit");
    a.turns(1, 4, Edits::default()).await;
    // The edit, then two turns that keep it: one bust, not three.
    a.turns(5, 7, EARLY).await;
    let (st, _) = a.agree(&s).await;
    assert_eq!(st.busts, 1, "{st:?}");
    assert!(st.invalidated_tokens > 1000, "{st:?}");
    assert_eq!(a.busts("history").await, 1);
    px.stop().await;
}

#[tokio::test]
async fn a_tools_change_is_a_tools_bust() {
    let s = sim().await;
    let px = proxy_for(&s, &[]).await;
    let a = Agent::chat(&px, "gpt-4o-cache-tools", "sk-cache-tools");
    a.turns(1, 3, Edits::default()).await;
    let tools = Edits {
        tools: true,
        ..Edits::default()
    };
    a.turns(4, 4, tools).await;
    let (st, _) = a.agree(&s).await;
    assert_eq!(st.busts, 1, "{st:?}");
    // Everything after the tools was lost: nothing before them to read.
    assert_eq!(st.events[3].read, 0, "{st:?}");
    assert_eq!(a.busts("tools").await, 1);
    px.stop().await;
}

/// Anthropic's breakpoints: what a request left cached is its reads plus
/// writes. An early edit costs everything past it up to the newest
/// breakpoint; a re-rendered system prompt (a lane of its own, the same
/// conversation) costs all of it.
#[tokio::test]
async fn anthropic_breakpoints_an_early_edit_and_a_new_system_prompt() {
    let s = sim().await;
    let px = proxy_for(&s, &[]).await;
    let a = Agent {
        path: "/v1/messages",
        shape: anthropic,
        ..Agent::chat(&px, "claude-sonnet-4-5-cache", "sk-ant-cache")
    };
    a.turns(1, 4, Edits::default()).await;
    a.turns(5, 5, EARLY).await;
    let (st, _) = a.agree(&s).await;
    assert_eq!(st.busts, 1, "{st:?}");
    let system = Edits {
        system: true,
        ..EARLY
    };
    a.turns(6, 6, system).await;
    let st = s.acct.credential(a.key);
    assert_eq!(st.busts, 2, "{st:?}");
    assert_eq!(a.busts("system").await, 1);
    let labels = [("model", a.model)];
    let invalidated = metric(&px, "tidemark_cache_invalidated_tokens_total", &labels).await;
    assert_eq!(invalidated, st.invalidated_tokens, "{st:?}");
    px.stop().await;
}

/// `--on-over trim`: each time the cut moves the prefix changes after the
/// head, and the bust is counted as the trim's; while the cut holds, the
/// cache is read whole.
#[tokio::test]
async fn a_trim_that_moves_its_cut_counts_its_bust() {
    let s = sim().await;
    let model = "gpt-4o-cache-trim";
    let window = format!("{model}=6000");
    let px = proxy_for(&s, &["--on-over", "trim", "--context-window", &window]).await;
    let a = Agent::chat(&px, model, "sk-cache-trim");
    let trims = a.turns(1, 16, Edits::default()).await;
    let (st, _) = a.agree(&s).await;
    assert!(trims >= 3, "{trims} trimmed turns");
    assert!(st.busts >= 2, "{st:?}");
    assert!(
        st.busts < trims as u64,
        "a cut that holds busts nothing: {st:?}"
    );
    assert_eq!(a.busts("trim").await, st.busts);
    px.stop().await;
}
