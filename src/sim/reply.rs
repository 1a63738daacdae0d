//! What the simulated model says: a deterministic function of the prompt,
//! text or a call to one of the request's tools.

use serde_json::{json, Value};

use super::ToolCalls;

/// Small deterministic generator (splitmix64).
pub(crate) struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[(self.next() % xs.len() as u64) as usize]
    }
    /// A random-looking lowercase hex id of `n` digits.
    pub fn hex(&mut self, n: usize) -> String {
        let mut s = String::with_capacity(n);
        while s.len() < n {
            s.push_str(&format!("{:016x}", self.next()));
        }
        s.truncate(n);
        s
    }
}

const REPLY_WORDS: &[&str] = &[
    "the", "change", "looks", "right", "but", "the", "test", "still", "misses", "one", "edge",
    "case", "so", "I", "will", "check", "the", "parser", "next", "and", "then", "update", "docs",
    "okay", "that", "explains", "the", "failure", "—", "the", "buffer", "was", "not", "flushed",
];

/// The model's reply.
#[derive(Debug, Clone)]
pub(crate) enum Reply {
    Text(String),
    Tool {
        /// The call id in the API's own style (`call_…`, `toolu_…`).
        id: String,
        name: String,
        input: Value,
    },
}

/// A tool the request offers: its name and the first property of its
/// parameter schema (the one the sim fills in).
#[derive(Debug, Clone)]
pub(crate) struct ToolSpec {
    pub name: String,
    pub arg: Option<String>,
    /// Its parameter schema.
    pub schema: Option<Value>,
    /// A freeform tool (Responses `custom`): its input is text, not JSON.
    pub custom: bool,
}

/// What the reply depends on, read from a request by its API's module.
#[derive(Debug, Clone, Default)]
pub(crate) struct Turn {
    /// The last message's text when it is the user's own words (not a tool
    /// result): the only moment the simulated model may call a tool.
    pub user_text: Option<String>,
    pub tools: Vec<ToolSpec>,
    /// The JSON schema the answer must follow (structured output), if any.
    pub schema: Option<Value>,
}

/// The first property name of a JSON schema.
pub(crate) fn first_property(schema: Option<&Value>) -> Option<String> {
    schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object)
        .and_then(|p| p.keys().next().cloned())
}

/// The tools a request offers; `spec` reads one entry's name and schema.
pub(crate) fn tool_specs<'a>(
    tools: impl IntoIterator<Item = &'a Value>,
    spec: impl Fn(&'a Value) -> (Option<&'a Value>, Option<&'a Value>),
) -> Vec<ToolSpec> {
    tools
        .into_iter()
        .map(|t| {
            let (name, schema) = spec(t);
            ToolSpec {
                name: name.and_then(Value::as_str).unwrap_or("tool").to_string(),
                arg: first_property(schema),
                schema: schema.cloned(),
                custom: false,
            }
        })
        .collect()
}

/// The text of a message's content: a string, or its parts' `text` joined.
pub(crate) fn content_text(c: Option<&Value>) -> Option<String> {
    match c? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    }
}

/// Does `text` ask for tool `name` ("call NAME", "use NAME", "use the NAME
/// tool")? The verbs are matched without case, the name exactly.
fn asks_for(text: &str, name: &str) -> bool {
    let lower = text.to_lowercase();
    ["call ", "use ", "use the ", "run "].iter().any(|verb| {
        let mut from = 0;
        while let Some(i) = lower[from..].find(verb) {
            let at = from + i + verb.len();
            if text.get(at..).is_some_and(|rest| {
                rest.starts_with(name) && !word_char(rest[name.len()..].chars().next())
            }) {
                return true;
            }
            from = from + i + 1;
        }
        false
    })
}

/// Arguments spelled out after the tool's name: "use Agent {\"prompt\": …}"
/// (a JSON object within a few characters of the name).
fn spelled_args(text: &str, name: &str) -> Option<Value> {
    let at = text.find(name)? + name.len();
    let rest = &text[at..];
    let brace = rest.find('{').filter(|&i| i <= 16)?;
    serde_json::Deserializer::from_str(&rest[brace..])
        .into_iter::<Value>()
        .next()?
        .ok()
        .filter(Value::is_object)
}

fn word_char(c: Option<char>) -> bool {
    c.is_some_and(|c| c.is_alphanumeric() || c == '_')
}

/// The reply to a turn. `id_prefix` is the API's tool-call id style.
///
/// With [`ToolCalls::Always`] a tool is called whenever the last message is
/// the user's text and tools exist (the demo's agent relies on it); with
/// [`ToolCalls::WhenAsked`] only when that text asks for a tool by name, so
/// a real CLI's one-shot prompt gets one text answer and stops.
pub(crate) fn decide(turn: &Turn, mode: ToolCalls, seed: u64, id_prefix: &str) -> Reply {
    let mut rng = Rng(seed);
    let chosen = match (mode, &turn.user_text) {
        (ToolCalls::Always, Some(_)) if !turn.tools.is_empty() => {
            Some((rng.next() % turn.tools.len() as u64) as usize)
        }
        (ToolCalls::WhenAsked, Some(text)) => {
            turn.tools.iter().position(|t| asks_for(text, &t.name))
        }
        _ => None,
    };
    if let Some(i) = chosen {
        let t = &turn.tools[i];
        let val = format!("{}-{}", rng.pick(REPLY_WORDS), rng.next() % 1000);
        // A freeform input that Codex's `exec` tool (JavaScript) runs; for
        // a tool asked for by name, arguments its schema accepts (Claude
        // Code validates them: its Agent tool needs three); otherwise the
        // first parameter alone, as the demo's agent has always had it.
        let spelled = match (mode, &turn.user_text) {
            (ToolCalls::WhenAsked, Some(text)) => spelled_args(text, &t.name),
            _ => None,
        };
        let input = match (spelled, &t.arg, t.custom, &t.schema) {
            (Some(v), ..) => v,
            (None, _, true, _) => Value::String(format!("text({val:?})")),
            (None, _, false, Some(s)) if mode == ToolCalls::WhenAsked => fill(s, &mut rng, 0),
            (None, Some(a), false, _) => json!({ a: val }),
            (None, None, false, _) => json!({}),
        };
        let id = format!("{id_prefix}{:016x}", rng.next());
        return Reply::Tool {
            id,
            name: t.name.clone(),
            input,
        };
    }
    if let Some(schema) = &turn.schema {
        return Reply::Text(fill(schema, &mut rng, 0).to_string());
    }
    let n = 12 + (rng.next() % 24) as usize;
    let mut s = String::new();
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(rng.pick(REPLY_WORDS));
    }
    s.push('.');
    Reply::Text(s)
}

/// A value that follows a JSON schema (JSON Schema, or the OpenAPI subset
/// Gemini takes with upper-case types): the required members and the
/// others, the first of an enum, numbers at their minimum. Agents validate
/// structured answers (Gemini CLI's model router retries until they do).
pub(crate) fn fill(schema: &Value, rng: &mut Rng, depth: usize) -> Value {
    if depth > 12 {
        return Value::Null;
    }
    if let Some(c) = schema.get("const") {
        return c.clone();
    }
    if let Some(e) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.first())
    {
        return e.clone();
    }
    for k in ["anyOf", "oneOf", "allOf"] {
        if let Some(first) = schema
            .get(k)
            .and_then(Value::as_array)
            .and_then(|a| a.first())
        {
            return fill(first, rng, depth + 1);
        }
    }
    let typ = match schema.get("type") {
        Some(Value::String(t)) => t.to_ascii_lowercase(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null")
            .to_ascii_lowercase(),
        _ if schema.get("properties").is_some() => "object".into(),
        _ if schema.get("items").is_some() => "array".into(),
        _ => "string".into(),
    };
    let bound = |k: &str| schema.get(k).and_then(Value::as_f64);
    match typ.as_str() {
        "object" => {
            let mut o = serde_json::Map::new();
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                for (k, v) in props {
                    o.insert(k.clone(), fill(v, rng, depth + 1));
                }
            }
            Value::Object(o)
        }
        "array" => {
            let n = schema
                .get("minItems")
                .and_then(Value::as_u64)
                .unwrap_or(1)
                .max(1);
            let item = schema.get("items").cloned().unwrap_or(json!({}));
            Value::Array((0..n).map(|_| fill(&item, rng, depth + 1)).collect())
        }
        "integer" => {
            let lo = bound("minimum").map_or(1, |m| m.ceil() as i64);
            json!(bound("maximum").map_or(lo, |m| lo.min(m.floor() as i64)))
        }
        "number" => json!(bound("minimum").unwrap_or(1.0)),
        "boolean" => json!(false),
        "null" => Value::Null,
        _ => {
            let n = 3 + (rng.next() % 5) as usize;
            let words: Vec<&str> = (0..n).map(|_| rng.pick(REPLY_WORDS)).collect();
            json!(words.join(" "))
        }
    }
}

/// Word-ish chunks, the way a model streams text.
pub(crate) fn pieces(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for ch in text.chars() {
        if ch == ' ' && !cur.is_empty() {
            out.push(std::mem::take(&mut cur));
        }
        cur.push(ch);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// A tool call's arguments in pieces of 8 characters.
pub(crate) fn arg_pieces(args: &str) -> Vec<String> {
    let chars: Vec<char> = args.chars().collect();
    chars.chunks(8).map(|c| c.iter().collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asked_by_name() {
        assert!(asks_for("please call read_file on it", "read_file"));
        assert!(asks_for("Use the Bash tool", "Bash"));
        assert!(!asks_for("use read_files", "read_file"));
        assert!(!asks_for("read the file", "read_file"));
        assert!(!asks_for("Bash is fine", "Bash"));
    }
}
