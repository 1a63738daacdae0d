//! The sessions page at the admin listener's `/`, in a real browser:
//! Debian's Chromium driven by playwright-core (`tests/page/probe.cjs`,
//! installed by `scripts/browser.sh` into target/browser), against the real
//! proxy in front of the simulated provider.

mod support;

use std::process::Stdio;

use bytes::Bytes;
use http::Request;
use serde_json::{json, Value};
use tidemark::sim::{self, SimConfig};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use support::{full, send, within, Proxy, TestClient};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

// ---------------------------------------------------------------------------
// The browser.

/// `tests/page/probe.cjs` under Node: one JSON command, one JSON answer.
struct Probe {
    child: Child,
    stdin: ChildStdin,
    out: Lines<BufReader<ChildStdout>>,
}

fn node() -> String {
    if let Ok(n) = std::env::var("TIDEMARK_NODE") {
        return n;
    }
    let local = format!("{ROOT}/target/browser/bin/node");
    if std::path::Path::new(&local).exists() {
        return local;
    }
    "node".to_string()
}

impl Probe {
    async fn start() -> Probe {
        let module = format!("{ROOT}/target/browser/node_modules/playwright-core");
        assert!(
            std::path::Path::new(&module).exists() && std::path::Path::new("/usr/bin/chromium").exists(),
            "the page test needs Debian's chromium and playwright-core in target/browser: run `bash scripts/browser.sh` (scripts/test.sh does)"
        );
        let mut child = Command::new(node())
            .arg(format!("{ROOT}/tests/page/probe.cjs"))
            .env("PLAYWRIGHT_CORE", &module)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start node tests/page/probe.cjs (run `bash scripts/browser.sh`)");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap()).lines();
        Probe { child, stdin, out }
    }

    /// The answer, `{"error": ...}` included.
    async fn raw(&mut self, c: Value) -> Value {
        let mut line = c.to_string();
        line.push('\n');
        within(60, self.stdin.write_all(line.as_bytes()))
            .await
            .expect("probe takes a command");
        let answer = within(60, self.out.next_line())
            .await
            .expect("probe answers")
            .unwrap_or_else(|| panic!("the probe ended before answering {c}"));
        serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"))
    }

    async fn cmd(&mut self, c: Value) -> Value {
        let a = self.raw(c.clone()).await;
        assert!(a.get("error").is_none(), "{c} -> {a}");
        a
    }

    /// A fresh browser (new profile), with JavaScript on or off.
    async fn launch(&mut self, js: bool) {
        self.cmd(json!({"cmd": "launch", "js": js})).await;
    }

    /// (status, final URL)
    async fn goto(&mut self, url: &str) -> (u64, String) {
        let a = self.cmd(json!({"cmd": "goto", "url": url})).await;
        (
            a["status"].as_u64().unwrap(),
            a["url"].as_str().unwrap().to_string(),
        )
    }

    async fn eval(&mut self, js: &str) -> Value {
        self.cmd(json!({"cmd": "eval", "js": js})).await["value"].take()
    }

    /// The value of `js` once it is truthy, within 15 s.
    async fn wait(&mut self, js: &str) -> Value {
        let a = self
            .raw(json!({"cmd": "wait", "js": js, "timeout": 15000}))
            .await;
        if let Some(e) = a.get("error") {
            let page = self
                .eval("document.body ? document.body.innerText.slice(0, 3000) : ''")
                .await;
            panic!(
                "waiting for {js}: {e}\npage text:\n{}",
                page.as_str().unwrap_or("")
            );
        }
        a["value"].clone()
    }

    async fn quit(mut self) {
        let _ = self.raw(json!({"cmd": "quit"})).await;
        let _ = within(30, self.child.wait()).await;
    }
}

/// JS that finds a session's `<tbody>` by its key.
fn session_js(key: &str) -> String {
    format!(
        "[...document.querySelectorAll('tbody.session')].find(t => t.dataset.key === {})",
        serde_json::to_string(key).unwrap()
    )
}

/// JS: `{p, w}` of the first lane's bar of a session (projection, fill
/// width in %), or null while the session is not on the page.
fn bar_js(key: &str) -> String {
    format!(
        "(() => {{ const t = {}; if (!t) return null; const b = t.querySelector('tr.lane .bar'); \
         return {{ p: Number(b.dataset.projection), w: parseFloat(b.querySelector('.fill').style.width) }}; }})()",
        session_js(key)
    )
}

/// The page's script has drawn the table from `/sessions` at least once.
const LIVE: &str = "document.getElementById('status').textContent.includes('live')";

// ---------------------------------------------------------------------------
// A scripted conversation.

struct Chat {
    key: String,
    /// A `--route` prefix (`/omit`) or "".
    prefix: &'static str,
    messages: Vec<Value>,
    turn: u64,
}

impl Chat {
    fn new(key: &str, prefix: &'static str) -> Chat {
        let mut c = Chat {
            key: key.to_string(),
            prefix,
            messages: vec![json!({"role": "system", "content": "You are a test agent."})],
            turn: 0,
        };
        c.user();
        c
    }

    /// A user message of a few thousand tokens, different every turn, with
    /// text the provider's tokenizer counts differently from tidemark's
    /// (so the drift is not 1).
    fn user(&mut self) {
        let mut text: Vec<String> = (0..900)
            .map(|i| format!("w{}x{}", (i * 7 + self.turn * 13) % 97, i % 11))
            .collect();
        for _ in 0..(self.turn % 3 + 1) * 20 {
            text.push("上下文窗口的大小决定了模型一次能看到多少内容。🚀".to_string());
        }
        self.messages
            .push(json!({"role": "user", "content": text.join(" ")}));
    }

    /// One request through the proxy: (real prompt tokens, projection).
    async fn turn(&mut self, c: &TestClient, px: &Proxy) -> (Option<u64>, u64) {
        let body = json!({"model": "gpt-4o", "messages": self.messages}).to_string();
        let req = Request::post(px.url(&format!("{}/v1/chat/completions", self.prefix)))
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk-page-test")
            .header("x-session-id", &self.key)
            .body(full(Bytes::from(body)))
            .unwrap();
        let (parts, bytes) = send(c, req).await;
        assert_eq!(parts.status, 200, "{}", String::from_utf8_lossy(&bytes));
        let h = |n: &str| {
            parts
                .headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let real = h(sim::X_SIM_PROMPT_TOKENS).and_then(|v| v.parse().ok());
        let projection = h("x-context-projection")
            .and_then(|v| v.split(';').next()?.parse().ok())
            .expect("x-context-projection");
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        let answer = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or("ok")
            .to_string();
        self.messages
            .push(json!({"role": "assistant", "content": answer}));
        self.turn += 1;
        self.user();
        (real, projection)
    }
}

async fn sessions(c: &TestClient, px: &Proxy, auth: Option<&str>) -> Value {
    let mut req = Request::get(px.admin_url("/sessions"));
    if let Some(t) = auth {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let (parts, body) = send(c, req.body(full(Bytes::new())).unwrap()).await;
    assert_eq!(parts.status, 200);
    serde_json::from_slice(&body).unwrap()
}

fn keys(list: &Value) -> Vec<String> {
    list["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["key"].as_str().unwrap().to_string())
        .collect()
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

// ---------------------------------------------------------------------------

/// Sessions appear, their bars move as the session grows without the page
/// reloading, a lost anchor shows, and the lines sit at the flags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_follows_sessions_live() {
    let good = support::sim(SimConfig::default()).await;
    let omit = support::sim(SimConfig {
        omit_usage_every: Some(1),
        ..Default::default()
    })
    .await;
    let route = format!("/omit={}", omit.url);
    let px = support::proxy(
        &good.url,
        &[
            "--route",
            &route,
            "--context-window",
            "gpt-4o*=30000",
            "--warn-at",
            "0.5",
            "--limit-at",
            "0.9",
        ],
    )
    .await;
    let c = support::client_h1();
    let mut grow = Chat::new("page-grow", "");
    grow.turn(&c, &px).await;
    grow.turn(&c, &px).await;

    let mut b = Probe::start().await;
    b.launch(true).await;
    let (status, _) = b.goto(&px.admin_url("/")).await;
    assert_eq!(status, 200);
    b.wait(LIVE).await;
    let before = b.wait(&bar_js("page-grow")).await;
    let (p1, w1) = (before["p"].as_u64().unwrap(), before["w"].as_f64().unwrap());
    assert!(p1 > 0 && w1 > 0.0, "{before}");
    b.eval("window.__sameDocument = true").await;

    // More turns, and a session whose responses carry no usage.
    let mut last = (None, 0);
    for _ in 0..3 {
        last = grow.turn(&c, &px).await;
    }
    let mut lost = Chat::new("page-lost", "/omit");
    lost.turn(&c, &px).await;
    lost.turn(&c, &px).await;

    let after = b
        .wait(&format!(
            "(() => {{ const v = {}; return v && v.p > {p1} ? v : null; }})()",
            bar_js("page-grow")
        ))
        .await;
    let (p2, w2) = (after["p"].as_u64().unwrap(), after["w"].as_f64().unwrap());
    assert!(p2 > p1 && w2 > w1, "the bar moved: {before} -> {after}");
    assert_eq!(
        b.eval("window.__sameDocument === true").await,
        true,
        "redrawn in place, not reloaded"
    );
    // The bar shows what /sessions says, to the token.
    let list = sessions(&c, &px, None).await;
    let g = list["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["key"] == "page-grow")
        .unwrap();
    assert_eq!(g["lanes"][0]["projection"].as_u64(), Some(p2), "{g}");

    // The lost anchor: the lane's state and its loss count, marked.
    let marked = b
        .wait(&format!(
            "(() => {{ const t = {}; const r = t && t.querySelector('tr.lane'); \
             if (!r || r.dataset.state !== 'lost') return null; \
             const m = r.querySelector('.marker.lost'), n = r.querySelector('.marker.losses'); \
             return m && n ? [m.textContent, n.textContent] : null; }})()",
            session_js("page-lost")
        ))
        .await;
    assert_eq!(marked, json!(["anchor lost", "⚓ 1 lost"]));

    // src and the last drift (real / projection of the last answered request).
    let (real, projection) = last;
    let lane = &g["lanes"][0];
    let drift = lane["drift"].as_f64().expect("lane drift");
    let want = real.unwrap() as f64 / projection as f64;
    assert!(
        (drift - want).abs() < 1e-4,
        "drift {drift}, real/projection {want}"
    );
    assert_ne!(
        format!("{drift:.3}"),
        "1.000",
        "a drift that shows: {real:?} / {projection}"
    );
    let cells = b
        .eval(&format!(
            "(() => {{ const r = {}.querySelector('tr.lane'); \
             return [r.querySelector('.src').textContent, r.querySelector('.drift').textContent]; }})()",
            session_js("page-grow")
        ))
        .await;
    assert_eq!(cells, json!(["anchored", format!("{drift:.3}")]));

    // The warn and limit lines sit at --warn-at and --limit-at.
    let lines = b
        .eval("(() => { const b = document.querySelector('tr.lane .bar'); return [b.querySelector('.line.warn').style.left, b.querySelector('.line.limit').style.left]; })()")
        .await;
    assert_eq!(lines, json!(["50%", "90%"]));

    // Sorted by utilisation, as /sessions.
    let order = b
        .eval("[...document.querySelectorAll('tbody.session')].map(t => t.dataset.key)")
        .await;
    assert_eq!(order, json!(keys(&list)));

    // The bars at rest (their width eases in), then a picture to look at.
    b.wait("document.getAnimations().length === 0").await;
    let shot = format!("{ROOT}/target/page-screenshot.png");
    b.cmd(json!({"cmd": "screenshot", "path": shot})).await;
    b.quit().await;
    px.stop().await;
}

/// Without JavaScript the page is a table of the same sessions, in the same
/// order; every value a client chose is text, never markup; cache markers
/// show when a lane has them and nothing when it has none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_without_javascript_and_escaping() {
    let good = support::sim(SimConfig::default()).await;
    let px = support::proxy(&good.url, &["--context-window", "gpt-4o*=40000"]).await;
    let c = support::client_h1();
    let evil = "<img src=x onerror=\"window.__xss=1\">&amp;'";
    for (key, turns) in [("page-a", 3), ("page-b", 1), (evil, 2)] {
        let mut chat = Chat::new(key, "");
        for _ in 0..turns {
            chat.turn(&c, &px).await;
        }
    }
    let list = sessions(&c, &px, None).await;
    let want = keys(&list);
    assert_eq!(want.len(), 3);

    // Plain HTTP: the table is there, keys escaped.
    let (parts, body) = support::get(&c, &px.admin_url("/")).await;
    assert_eq!(parts.status, 200);
    assert!(parts.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    let html = String::from_utf8(body.to_vec()).unwrap();
    assert!(!html.contains("<img src=x"), "a key was written as markup");
    let served: Vec<String> = html
        .split("<tbody class=\"session\" data-key=\"")
        .skip(1)
        .map(|s| unescape(&s[..s.find('"').unwrap()]))
        .collect();
    assert_eq!(served, want);

    // A browser with JavaScript off: the same sessions, bars and all.
    let mut b = Probe::start().await;
    b.launch(false).await;
    b.goto(&px.admin_url("/")).await;
    let seen = b
        .eval(
            "[...document.querySelectorAll('tbody.session')].map(t => [t.dataset.key, \
             Number(t.querySelector('tr.lane .bar').dataset.projection), \
             t.querySelector('.key').textContent])",
        )
        .await;
    let expect: Vec<Value> = list["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| json!([s["key"], s["lanes"][0]["projection"], s["key"]]))
        .collect();
    assert_eq!(seen, json!(expect));
    assert_eq!(b.eval(LIVE).await, false, "the script did not run");
    assert_eq!(b.eval("document.querySelectorAll('img').length").await, 0);

    // With JavaScript: the script's table holds the key as text too.
    b.launch(true).await;
    b.goto(&px.admin_url("/")).await;
    b.wait(LIVE).await;
    let key_text = b
        .eval(&format!(
            "{}.querySelector('.key').textContent",
            session_js(evil)
        ))
        .await;
    assert_eq!(key_text, evil);
    assert_eq!(
        b.eval("[document.querySelectorAll('img').length, typeof window.__xss]")
            .await,
        json!([0, "undefined"])
    );

    // Cache markers, from a lane that has them (a /sessions answer made up
    // here: which lanes have them is another part's business).
    let mut fake = list.clone();
    let s0 = &mut fake["sessions"][0];
    s0["key"] = "page-cache".into();
    let mut busted = s0["lanes"][0].clone();
    busted["id"] = "00000000000000aa".into();
    busted["cache"] = json!({"hit_ratio": 0.873, "busts": 2, "invalidated_tokens": 14203});
    let mut plain = s0["lanes"][0].clone();
    plain["id"] = "00000000000000bb".into();
    // A lane the provider has reported no cache reads for yet.
    plain["cache"] = json!({"hit_ratio": null, "busts": 0, "invalidated_tokens": 0});
    s0["lanes"] = json!([busted, plain]);
    b.cmd(json!({"cmd": "route", "pattern": "**/sessions?*", "body": fake.to_string()}))
        .await;
    let cache = b
        .wait(&format!(
            "(() => {{ const t = {}; if (!t) return null; \
             return [...t.querySelectorAll('tr.lane td.cache')].map(td => td.textContent); }})()",
            session_js("page-cache")
        ))
        .await;
    assert_eq!(cache, json!(["hit 87.3%✖ 2 busts · 14,203 tok", ""]));
    b.quit().await;
    px.stop().await;
}

/// With `--admin-token` the page needs it: 401 and an explanation without
/// it, never session data; given once (link or form) it sets a cookie that
/// opens the page and its refreshes, and nothing that changes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_needs_the_admin_token() {
    let token = "page-s3cret";
    let good = support::sim(SimConfig::default()).await;
    let px = support::proxy(&good.url, &["--admin-token", token]).await;
    let c = support::client_h1();
    let mut chat = Chat::new("page-secret-session", "");
    chat.turn(&c, &px).await;

    // Plain HTTP without the token: a page that explains, no data.
    for path in ["/", "/?token=wrong", "/sessions"] {
        let (parts, body) = support::get(&c, &px.admin_url(path)).await;
        assert_eq!(parts.status, 401, "{path}");
        let body = String::from_utf8_lossy(&body);
        assert!(!body.contains("page-secret-session"), "{path}: {body}");
    }
    let (parts, body) = support::get(&c, &px.admin_url("/")).await;
    assert!(parts.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(String::from_utf8_lossy(&body).contains("--admin-token"));
    // The bearer token opens it as it opens /sessions.
    let req = Request::get(px.admin_url("/"))
        .header("authorization", format!("Bearer {token}"))
        .body(full(Bytes::new()))
        .unwrap();
    let (parts, body) = send(&c, req).await;
    assert_eq!(parts.status, 200);
    assert!(String::from_utf8_lossy(&body).contains("page-secret-session"));

    // A browser without it.
    let mut b = Probe::start().await;
    b.launch(true).await;
    let (status, _) = b.goto(&px.admin_url("/")).await;
    assert_eq!(status, 401);
    let text = b.eval("document.body.innerText").await;
    let text = text.as_str().unwrap();
    assert!(text.contains("Admin token required"), "{text}");
    assert!(!text.contains("page-secret-session"));
    // The wrong token in the form.
    let a = b
        .cmd(json!({"cmd": "submit", "selector": "input[name=token]", "value": "nope", "button": "button"}))
        .await;
    assert_eq!(a["status"], 401);
    assert!(b
        .eval("document.body.innerText")
        .await
        .as_str()
        .unwrap()
        .contains("not this proxy's admin token"));
    // The right one: back at /, the table, and the script's refreshes let in.
    let a = b
        .cmd(json!({"cmd": "submit", "selector": "input[name=token]", "value": token, "button": "button"}))
        .await;
    assert_eq!(a["status"], 200, "{a}");
    assert_eq!(a["url"], px.admin_url("/"));
    b.wait(LIVE).await;
    b.wait(&session_js("page-secret-session")).await;
    assert_eq!(
        b.eval("document.cookie").await,
        "",
        "HttpOnly: the page's script never sees it"
    );

    // Once as a link, in a fresh browser: the token leaves the address bar.
    b.launch(true).await;
    let (status, url) = b.goto(&px.admin_url(&format!("/?token={token}"))).await;
    assert_eq!((status, url.as_str()), (200, px.admin_url("/").as_str()));
    b.wait(LIVE).await;
    b.wait(&session_js("page-secret-session")).await;
    b.quit().await;

    // The cookie opens the page's reads only.
    let req = Request::get(px.admin_url(&format!("/?token={token}")))
        .body(full(Bytes::new()))
        .unwrap();
    let (parts, _) = send(&c, req).await;
    assert_eq!(parts.status, 303);
    let set = parts.headers["set-cookie"].to_str().unwrap().to_string();
    assert!(!set.contains(token), "the cookie is not the token: {set}");
    for attr in ["HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(set.contains(attr), "{set}");
    }
    let cookie = set.split(';').next().unwrap().to_string();
    let with_cookie = |method: http::Method, path: &str| {
        Request::builder()
            .method(method)
            .uri(px.admin_url(path))
            .header("cookie", &cookie)
            .body(full(Bytes::new()))
            .unwrap()
    };
    for (method, path, want) in [
        (http::Method::GET, "/", 200),
        (http::Method::GET, "/sessions", 200),
        (http::Method::GET, "/sessions/page-secret-session", 200),
        (http::Method::DELETE, "/sessions/page-secret-session", 401),
        (http::Method::GET, "/metrics", 401),
    ] {
        let (parts, _) = send(&c, with_cookie(method.clone(), path)).await;
        assert_eq!(parts.status, want, "{method} {path} with the cookie");
    }
    px.stop().await;
}
