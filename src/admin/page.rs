//! The live sessions page at the admin listener's `/` (SPEC §6): the
//! sessions of `GET /sessions` as a table rendered here, which the page's
//! own script (`page.html`, inline, like its CSS) then redraws from
//! `/sessions` every 1.5 s. Without JavaScript the table is the page.
//!
//! # The admin token in a browser
//!
//! A browser cannot put `Authorization: Bearer` on a page it navigates to,
//! so with `--admin-token` the page takes the token once, from the form on
//! its 401 page (a POST: the token stays out of the address bar and the
//! history) or as `/?token=...` (a link a script can print), and answers
//! with a cookie and a redirect to `/`. The cookie is then accepted on the
//! read-only views the page uses, `GET /` and `GET /sessions[/{key}]`,
//! beside the bearer token that everything else still needs.
//!
//! - The cookie holds a SHA-256 of the token, not the token: cookies are
//!   scoped to a host, not a port, so a browser would also send it to the
//!   proxy's own port (and from there upstream). What it carries opens
//!   these views and nothing else, and changing the token revokes it.
//! - `HttpOnly` (the page's script never reads it), `SameSite=Strict`
//!   (another site cannot make the browser send it), no `Max-Age` (it ends
//!   with the browser session). No `Secure`: the admin listener is plain HTTP.
//! - Compared in constant time, as the bearer token is.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::sync::OnceLock;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CACHE_CONTROL, CONTENT_TYPE, COOKIE, LOCATION};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{bearer_matches, constant_time_eq, percent_decode, query_param};
use crate::proxy::State;
use crate::tap::ObservedBody;

const TEMPLATE: &str = include_str!("page.html");
/// Sessions on the page, highest utilisation first (the script asks
/// `/sessions` for as many).
const LIMIT: usize = 100;
/// Columns of a lane row (the session row spans them).
const COLS: usize = 8;
/// The cookie that stands for the admin token (see the module doc).
const COOKIE_NAME: &str = "tidemark_admin";
/// Largest sign-in form body read.
const MAX_FORM: usize = 4096;

/// `GET /` (the page, or sign-in with `?token=`) and `POST /` (sign-in
/// from the form), with `--admin-token` checked here: a browser without
/// it gets a 401 page that explains, never session data.
pub async fn serve(state: &State, req: Request<Incoming>) -> Response<ObservedBody> {
    let (parts, body) = req.into_parts();
    let presented = match parts.method {
        Method::GET => query_param(parts.uri.query(), "token").map(percent_decode),
        Method::POST => Some(form_token(body).await.unwrap_or_default()),
        _ => {
            let mut r = page(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed\n".into(),
            );
            r.headers_mut()
                .insert(http::header::ALLOW, HeaderValue::from_static("GET, POST"));
            return r;
        }
    };
    if let Some(token) = state.config.admin_token.as_deref() {
        if let Some(given) = presented {
            if !constant_time_eq(given.as_bytes(), token.as_bytes()) {
                return unauthorized("That is not this proxy's admin token.");
            }
            return signed_in(token);
        }
        if !bearer_matches(&parts.headers, token) && !cookie_matches(&parts.headers, token) {
            return unauthorized("");
        }
    } else if presented.is_some() {
        // Nothing to sign in to: take the token out of the address bar.
        return see_other(None);
    }
    let list = state.store.list(LIMIT).await;
    page(
        StatusCode::OK,
        render(&list, state.config.warn_at, state.config.limit_at),
    )
}

/// Whether a request to another admin route is let in by the page's
/// cookie: only the reads the page makes, never a change.
pub fn cookie_grants<B>(req: &Request<B>, token: &str) -> bool {
    let p = req.uri().path();
    req.method() == Method::GET
        && (p == "/sessions" || p.starts_with("/sessions/"))
        && cookie_matches(req.headers(), token)
}

fn cookie_value(token: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"tidemark admin cookie\0");
    h.update(token.as_bytes());
    crate::session::hex(&h.finalize())
}

fn cookie_matches(headers: &HeaderMap, token: &str) -> bool {
    let want = cookie_value(token);
    headers
        .get_all(COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .any(|(k, v)| k == COOKIE_NAME && constant_time_eq(v.as_bytes(), want.as_bytes()))
}

/// The `token` field of an `application/x-www-form-urlencoded` body.
async fn form_token(body: Incoming) -> Option<String> {
    let bytes = Limited::new(body, MAX_FORM)
        .collect()
        .await
        .ok()?
        .to_bytes();
    let form = std::str::from_utf8(&bytes).ok()?;
    let v = query_param(Some(form), "token")?;
    Some(percent_decode(&v.replace('+', "%20")))
}

fn signed_in(token: &str) -> Response<ObservedBody> {
    let cookie = format!(
        "{COOKIE_NAME}={}; Path=/; HttpOnly; SameSite=Strict",
        cookie_value(token)
    );
    see_other(HeaderValue::from_str(&cookie).ok())
}

fn see_other(cookie: Option<HeaderValue>) -> Response<ObservedBody> {
    let mut r = Response::new(ObservedBody::full(Bytes::new()));
    *r.status_mut() = StatusCode::SEE_OTHER;
    let h = r.headers_mut();
    h.insert(LOCATION, HeaderValue::from_static("/"));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if let Some(c) = cookie {
        h.insert(http::header::SET_COOKIE, c);
    }
    r
}

fn unauthorized(why: &str) -> Response<ObservedBody> {
    let mut s = String::from(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <meta name=\"referrer\" content=\"no-referrer\">\
         <title>tidemark · admin token required</title>\
         <style>body{font:15px/1.5 system-ui,sans-serif;max-width:36em;margin:3em auto;padding:0 1em;color:#1d2430}\
         code{background:#f3f5f8;padding:0 3px}input{font:inherit;padding:4px 6px;width:20em}\
         .why{color:#8f1f1f}</style></head><body>\n\
         <h1>Admin token required</h1>\n",
    );
    if !why.is_empty() {
        let _ = writeln!(s, "<p class=\"why\">{}</p>", esc(why));
    }
    s.push_str(
        "<p>This tidemark runs with <code>--admin-token</code>: its sessions page shows \
         nothing without that token.</p>\n\
         <form method=\"post\" action=\"/\"><label>Admin token <input type=\"password\" \
         name=\"token\" autocomplete=\"off\" autofocus></label> <button>Open</button></form>\n\
         <p>Or open <code>/?token=TOKEN</code> once. Either sets a cookie for this browser \
         session (it opens this page and <code>GET /sessions</code> only); scripts send \
         <code>Authorization: Bearer TOKEN</code>.</p>\n</body></html>\n",
    );
    let mut r = page(StatusCode::UNAUTHORIZED, s);
    r.headers_mut().insert(
        http::header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer"),
    );
    r
}

/// An HTML answer. The policy lets in only the page's own inline script
/// (by its hash) and connections back to this listener: a value that
/// escaped its escaping still could not run or send anything away.
fn page(status: StatusCode, html: String) -> Response<ObservedBody> {
    let mut r = Response::new(ObservedBody::full(html));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    if let Ok(v) = HeaderValue::from_str(csp()) {
        h.insert("content-security-policy", v);
    }
    r
}

fn csp() -> &'static str {
    static CSP: OnceLock<String> = OnceLock::new();
    CSP.get_or_init(|| {
        use base64::Engine;
        let script = fill(TEMPLATE, &[("@LIMIT@", &LIMIT.to_string())]);
        let inline = script
            .rsplit_once("<script>")
            .and_then(|(_, s)| s.split_once("</script>"))
            .map_or("", |(s, _)| s);
        let hash = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(inline));
        format!(
            "default-src 'none'; script-src 'sha256-{hash}'; style-src 'unsafe-inline'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
        )
    })
}

/// The page for a `GET /sessions` answer.
fn render(list: &Value, warn_at: f64, limit_at: f64) -> String {
    let sessions = list
        .get("sessions")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    let total = list.get("total").and_then(Value::as_u64).unwrap_or(0);
    let mut body = String::with_capacity(1024 + sessions.len() * 2048);
    if sessions.is_empty() {
        let _ = write!(
            body,
            "<tbody class=\"none\"><tr class=\"empty\"><td colspan=\"{COLS}\">No sessions yet: \
             send a request through the proxy.</td></tr></tbody>"
        );
    }
    for s in sessions {
        session_body(&mut body, s, warn_at, limit_at);
    }
    let now = crate::session::rfc3339(crate::session::wall_ms());
    let status = format!(
        "{} of {total} session{} · as of {}",
        sessions.len(),
        if total == 1 { "" } else { "s" },
        clock(&now)
    );
    fill(
        TEMPLATE,
        &[
            ("@WARN_AT@", &warn_at.to_string()),
            ("@LIMIT_AT@", &limit_at.to_string()),
            ("@WARN_PCT@", &pct(warn_at)),
            ("@LIMIT_PCT@", &pct(limit_at)),
            ("@STATUS@", &esc(&status)),
            ("@SESSIONS@", &body),
            ("@LIMIT@", &LIMIT.to_string()),
        ],
    )
}

/// The template with each marker replaced, in one pass over the template
/// only: what a value holds is never searched for markers.
fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let mut out =
        String::with_capacity(template.len() + values.iter().map(|v| v.1.len()).sum::<usize>());
    let mut rest = template;
    while let Some(i) = rest.find('@') {
        out.push_str(&rest[..i]);
        let tail = &rest[i..];
        match values.iter().find(|(m, _)| tail.starts_with(m)) {
            Some((m, v)) => {
                out.push_str(v);
                rest = &tail[m.len()..];
            }
            None => {
                out.push('@');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// One session: a row of its own figures, then a row per lane. The script
/// in `page.html` builds the same markup from the same JSON.
fn session_body(out: &mut String, s: &Value, warn_at: f64, limit_at: f64) {
    let cum = s.get("cumulative").unwrap_or(&Value::Null);
    let _ = write!(
        out,
        "<tbody class=\"session\" data-key=\"{key}\" data-credential=\"{cred}\">\
         <tr class=\"head\"><th colspan=\"{COLS}\" scope=\"rowgroup\">\
         <span class=\"key\">{key}</span> <span class=\"tag\">key {source}</span> \
         <span class=\"api\">{api}</span> <span class=\"cred\">credential {cred}</span> \
         <span class=\"turns\">turns {turns}</span> \
         <span class=\"compactions\">compactions {compactions}</span> \
         <span class=\"spend\">spend in {input} · cached {cached} · out {output}</span> \
         <span class=\"seen\">seen {seen}</span></th></tr>",
        key = esc(text(s, "key")),
        cred = esc(text(s, "credential")),
        source = esc(text(s, "key_source")),
        api = esc(text(s, "api")),
        turns = group(uint(s, "turns").unwrap_or(0)),
        compactions = group(uint(s, "compactions").unwrap_or(0)),
        input = group(uint(cum, "input").unwrap_or(0)),
        cached = group(uint(cum, "cached_input").unwrap_or(0)),
        output = group(uint(cum, "output").unwrap_or(0)),
        seen = esc(&clock(text(s, "last_seen"))),
    );
    for lane in s
        .get("lanes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        lane_row(out, lane, warn_at, limit_at);
    }
    out.push_str("</tbody>\n");
}

fn lane_row(out: &mut String, lane: &Value, warn_at: f64, limit_at: f64) {
    let id = text(lane, "id");
    let state = lane.get("state").and_then(Value::as_str).unwrap_or("new");
    let state_class: String = state.chars().filter(char::is_ascii_lowercase).collect();
    let _ = write!(
        out,
        "<tr class=\"lane\" data-lane=\"{id}\" data-state=\"{st}\"><td class=\"model\"><b>{model}</b>",
        id = esc(id),
        st = esc(state),
        model = esc(lane
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("(no model)")),
    );
    if !id.is_empty() {
        let short: String = id.chars().take(8).collect();
        let _ = write!(out, "<br><small>lane {}</small>", esc(&short));
    }
    let _ = write!(
        out,
        "</td><td class=\"state\"><span class=\"badge {state_class}\">{}</span>",
        esc(state)
    );
    if state == "lost" {
        out.push_str("<span class=\"marker lost\">anchor lost</span>");
    }
    out.push_str("</td>");
    bar(out, lane, warn_at, limit_at);
    let _ = write!(out, "<td class=\"src\">{}</td>", esc(text(lane, "src")));
    match float(lane, "drift") {
        Some(d) => {
            let off = (d - 1.0).abs();
            let class = if off > 0.1 {
                " drift-bad"
            } else if off > 0.02 {
                " drift-off"
            } else {
                ""
            };
            let _ = write!(out, "<td class=\"drift{class}\">{d:.3}</td>");
        }
        None => out.push_str("<td class=\"drift\">–</td>"),
    }
    out.push_str("<td class=\"anchor\">");
    match lane.get("anchor").and_then(|a| uint(a, "real")) {
        Some(real) => {
            let _ = write!(out, "real {}", group(real));
        }
        None => out.push_str("none"),
    }
    let losses = uint(lane, "anchor_losses").unwrap_or(0);
    if losses > 0 {
        let _ = write!(
            out,
            "<span class=\"marker losses\" title=\"{losses} anchor loss{}: responses without usage\">⚓ {losses} lost</span>",
            if losses == 1 { "" } else { "es" }
        );
    }
    out.push_str("</td><td class=\"cache\">");
    if let Some(c) = lane.get("cache").filter(|c| c.is_object()) {
        if let Some(h) = float(c, "hit_ratio") {
            let _ = write!(out, "hit {}", pct(h));
        }
        let busts = uint(c, "busts").unwrap_or(0);
        if busts > 0 {
            let _ = write!(
                out,
                "<span class=\"marker bust\" title=\"cache busts; tokens invalidated\">✖ {busts} bust{}",
                if busts == 1 { "" } else { "s" }
            );
            if let Some(inv) = uint(c, "invalidated_tokens").filter(|n| *n > 0) {
                let _ = write!(out, " · {} tok", group(inv));
            }
            out.push_str("</span>");
        }
    }
    let _ = writeln!(
        out,
        "</td><td class=\"turns\">{}</td></tr>",
        uint(lane, "turns").map(group).unwrap_or_default()
    );
}

/// Projection against the window, with the `--warn-at` and `--limit-at` lines.
fn bar(out: &mut String, lane: &Value, warn_at: f64, limit_at: f64) {
    let p = uint(lane, "projection").unwrap_or(0);
    let (class, width, max, label) = match uint(lane, "window").filter(|w| *w > 0) {
        Some(w) => {
            let u = p as f64 / w as f64;
            let class = if u > limit_at {
                "bar over"
            } else if u >= warn_at {
                "bar warn"
            } else {
                "bar"
            };
            let label = format!("{} / {} · {}", group(p), group(w), pct(u));
            (class, u.min(1.0) * 100.0, w, label)
        }
        None => (
            "bar nowindow",
            if p > 0 { 100.0 } else { 0.0 },
            p,
            format!("{} / window unknown", group(p)),
        ),
    };
    let window_attr = match uint(lane, "window").filter(|w| *w > 0) {
        Some(w) => format!(" data-window=\"{w}\""),
        None => String::new(),
    };
    let _ = write!(
        out,
        "<td class=\"ctx\"><div class=\"{class}\" role=\"meter\" aria-valuemin=\"0\" \
         aria-valuemax=\"{max}\" aria-valuenow=\"{p}\" data-projection=\"{p}\"{window_attr}>\
         <span class=\"fill\" style=\"width:{width:.2}%\" data-to=\"{width:.2}%\"></span>\
         <span class=\"line warn\" style=\"left:{:.2}%\" title=\"--warn-at\"></span>\
         <span class=\"line limit\" style=\"left:{:.2}%\" title=\"--limit-at\"></span></div>\
         <span class=\"num\">{label}</span></td>",
        warn_at * 100.0,
        limit_at * 100.0,
    );
}

fn text<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

fn uint(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

fn float(v: &Value, k: &str) -> Option<f64> {
    v.get(k).and_then(Value::as_f64).filter(|f| f.is_finite())
}

/// `12,345`, as the script writes it.
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `43.2%`, as the script writes it.
fn pct(x: f64) -> String {
    format!("{:.1}%", (x * 1000.0).round() / 10.0)
}

/// `12:34:56Z` of an RFC 3339 time.
fn clock(rfc: &str) -> String {
    match rfc.get(11..19) {
        Some(t) if rfc.len() >= 19 => format!("{t}Z"),
        _ => String::new(),
    }
}

/// Text as HTML: session keys and models come from clients.
fn esc(s: &str) -> Cow<'_, str> {
    if !s.contains(['&', '<', '>', '"', '\'']) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 16);
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_what_html_would_read() {
        assert_eq!(esc("plain key"), "plain key");
        assert_eq!(
            esc("<img src=x onerror='a(\"b\")'>&"),
            "&lt;img src=x onerror=&#39;a(&quot;b&quot;)&#39;&gt;&amp;"
        );
    }

    #[test]
    fn fill_never_reads_markers_in_values() {
        let out = fill("<p>@A@ @B@ @ x@</p>", &[("@A@", "@B@"), ("@B@", "two")]);
        assert_eq!(out, "<p>@B@ two @ x@</p>");
    }

    #[test]
    fn numbers_as_the_script_writes_them() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(1_234_567), "1,234,567");
        assert_eq!(pct(0.4327), "43.3%");
        assert_eq!(pct(0.85), "85.0%");
        assert_eq!(clock("2026-11-01T12:34:56.789Z"), "12:34:56Z");
        assert_eq!(clock("bad"), "");
    }

    /// The server's table marks what the script marks (tests/page.rs
    /// checks the script's in a browser).
    #[test]
    fn lane_rows_mark_losses_and_cache_busts() {
        let lane = serde_json::json!({
            "id": "00000000000000aa", "model": "m<1>", "state": "lost", "turns": 3,
            "projection": 900, "window": 1000, "src": "lost", "drift": 1.23456,
            "anchor": null, "anchor_losses": 2,
            "cache": {"hit_ratio": 0.5, "busts": 1, "invalidated_tokens": 2048},
        });
        let mut out = String::new();
        lane_row(&mut out, &lane, 0.8, 0.95);
        for want in [
            "data-state=\"lost\"",
            "<b>m&lt;1&gt;</b>",
            "<span class=\"marker lost\">anchor lost</span>",
            "⚓ 2 lost</span>",
            "<td class=\"drift drift-bad\">1.235</td>",
            "class=\"bar warn\"",
            "style=\"width:90.00%\"",
            "style=\"left:80.00%\"",
            "style=\"left:95.00%\"",
            "900 / 1,000 · 90.0%",
            "<td class=\"cache\">hit 50.0%<span class=\"marker bust\" title=\"cache busts; tokens invalidated\">✖ 1 bust · 2,048 tok</span></td>",
        ] {
            assert!(out.contains(want), "{want} in {out}");
        }
        let mut plain = lane.clone();
        plain["state"] = "anchored".into();
        plain["anchor_losses"] = 0.into();
        plain.as_object_mut().unwrap().remove("cache");
        let mut out = String::new();
        lane_row(&mut out, &plain, 0.8, 0.95);
        assert!(out.contains("<td class=\"cache\"></td>"), "{out}");
        assert!(!out.contains("marker"), "{out}");
    }

    #[test]
    fn the_policy_hashes_the_inline_script() {
        let c = csp();
        assert!(c.contains("script-src 'sha256-"), "{c}");
        assert!(
            !c.contains("sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU="),
            "hash of an empty script: {c}"
        );
    }

    #[test]
    fn cookie_is_the_tokens_hash_not_the_token() {
        let v = cookie_value("s3cret");
        assert_eq!(v.len(), 64);
        assert!(!v.contains("s3cret"));
        assert_ne!(v, cookie_value("s3cret2"));
        let mut h = HeaderMap::new();
        h.append(COOKIE, HeaderValue::from_static("a=b"));
        h.append(
            COOKIE,
            HeaderValue::from_str(&format!("x=1; {COOKIE_NAME}={v}")).unwrap(),
        );
        assert!(cookie_matches(&h, "s3cret"));
        assert!(!cookie_matches(&h, "other"));
        let mut raw = HeaderMap::new();
        raw.insert(
            COOKIE,
            HeaderValue::from_str(&format!("{COOKIE_NAME}=s3cret")).unwrap(),
        );
        assert!(
            !cookie_matches(&raw, "s3cret"),
            "the token itself is no cookie"
        );
    }
}
