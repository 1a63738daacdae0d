//! `--record DIR`: every request the sim receives written as one JSON file
//! (method, path, query, headers with credentials redacted, body), so what a
//! real agent sends can be read back after a run against the sim.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use ::http::{HeaderMap, Method, Uri};
use serde_json::{json, Map, Value};

pub(crate) struct Recorder {
    dir: PathBuf,
    seq: AtomicU64,
}

/// Header names whose values are never written.
fn secret(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    ["auth", "key", "token", "cookie", "secret", "signature"]
        .iter()
        .any(|s| n.contains(s))
}

/// A query string with `key=` (Gemini's API key) redacted.
fn redact_query(q: &str) -> String {
    q.split('&')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if secret(k) => format!("{k}=REDACTED"),
            _ => kv.to_string(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

impl Recorder {
    pub fn new(dir: PathBuf) -> Self {
        let _ = std::fs::create_dir_all(&dir);
        Recorder {
            dir,
            seq: AtomicU64::new(0),
        }
    }

    fn write(&self, tag: &str, v: &Value) {
        let n = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let safe: String = tag
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .take(80)
            .collect();
        let path = self.dir.join(format!("{n:05}-{safe}.json"));
        if let Ok(text) = serde_json::to_string_pretty(v) {
            let _ = std::fs::write(path, text);
        }
    }

    fn headers(h: &HeaderMap) -> Value {
        let mut m = Map::new();
        for (k, v) in h {
            let val = if secret(k.as_str()) {
                "REDACTED".to_string()
            } else {
                String::from_utf8_lossy(v.as_bytes()).into_owned()
            };
            m.insert(k.as_str().to_string(), Value::String(val));
        }
        Value::Object(m)
    }

    fn body(bytes: &[u8]) -> Value {
        if bytes.is_empty() {
            return Value::Null;
        }
        serde_json::from_slice(bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned()))
    }

    /// One HTTP request.
    pub fn request(&self, method: &Method, uri: &Uri, headers: &HeaderMap, body: &[u8]) {
        let v = json!({"method": method.as_str(), "path": uri.path(),
            "query": uri.query().map(redact_query), "headers": Self::headers(headers),
            "body": Self::body(body)});
        self.write(&format!("{}-{}", method.as_str(), uri.path()), &v);
    }

    /// One client frame of a WebSocket connection.
    #[allow(dead_code)]
    pub fn frame(&self, path: &str, conn: u64, text: &[u8]) {
        let v = json!({"websocket": path, "connection": conn, "frame": Self::body(text)});
        self.write(&format!("WS-{path}"), &v);
    }
}
