//! Conversations for the trimmer tests: an API-neutral script rendered into
//! each API's request shape, and per-API structural validators that hold a
//! trimmed request to the rules its provider enforces.
#![allow(dead_code)]

use serde_json::value::RawValue;
use serde_json::{json, Value};
use tidemark::provider::Api;

/// Every API the trimmer understands.
pub const APIS: [Api; 5] = [
    Api::OpenAiChat,
    Api::Anthropic,
    Api::OpenAiResponses,
    Api::Gemini,
    Api::Ollama,
];

/// One step of a conversation, API-neutral.
#[derive(Debug, Clone)]
pub enum Step {
    User(String),
    Assistant(String),
    /// The assistant calls tools (name, output) and the outputs come back.
    Tools(Vec<(String, String)>),
}

/// A conversation: a system prompt and steps in the order a real client
/// produces them (user, tool steps..., assistant text, user, ...).
#[derive(Debug, Clone)]
pub struct Script {
    pub system: String,
    pub steps: Vec<Step>,
    /// Anthropic only: put `cache_control` on this many blocks, newest first.
    pub breakpoints: usize,
}

/// Text with quotes, backslashes, newlines and non-ASCII, so the splicer
/// has escapes to get wrong.
pub fn text(seed: usize, len: usize) -> String {
    let words = [
        "tide ",
        "\"quoted\" ",
        "back\\slash ",
        "line\n",
        "ünïcødé ",
        "🚀 ",
        "{brace} ",
        "[bracket] ",
        "comma, ",
    ];
    let mut s = String::new();
    let mut i = seed;
    while s.len() < len {
        s.push_str(words[i % words.len()]);
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    s
}

/// A realistic agent session: `turns` user turns, each with `steps` tool
/// steps whose outputs are `out_len` bytes, then an answer; the newest turn
/// is a user question.
pub fn agent_script(turns: usize, steps: usize, out_len: usize) -> Script {
    let mut v = Vec::new();
    for t in 0..turns {
        v.push(Step::User(format!("turn {t}: {}", text(t, 200))));
        for s in 0..steps {
            let calls = 1 + (t + s) % 2;
            v.push(Step::Tools(
                (0..calls)
                    .map(|c| (format!("read_file_{c}"), text(t * 7 + s + c, out_len)))
                    .collect(),
            ));
        }
        v.push(Step::Assistant(format!("answer {t}: {}", text(t + 3, 300))));
    }
    v.push(Step::User(format!("newest question: {}", text(99, 100))));
    Script {
        system: format!("You are a careful coding agent. {}", text(5, 400)),
        steps: v,
        breakpoints: 0,
    }
}

fn call_id(step: usize, c: usize) -> String {
    format!("call_{step}_{c}")
}

/// The request body of `script` for `api`.
pub fn render(api: Api, s: &Script, pretty: bool) -> Vec<u8> {
    let v = match api {
        Api::OpenAiChat | Api::Ollama => chat(api, s),
        Api::Anthropic => anthropic(s),
        Api::OpenAiResponses => responses(s),
        Api::Gemini => gemini(s),
    };
    if pretty {
        serde_json::to_vec_pretty(&v).unwrap()
    } else {
        serde_json::to_vec(&v).unwrap()
    }
}

fn chat(api: Api, s: &Script) -> Value {
    let ollama = api == Api::Ollama;
    let mut m = vec![json!({"role": "system", "content": s.system})];
    for (i, st) in s.steps.iter().enumerate() {
        match st {
            Step::User(t) => m.push(json!({"role": "user", "content": t})),
            Step::Assistant(t) => m.push(json!({"role": "assistant", "content": t})),
            Step::Tools(calls) => {
                let tc: Vec<Value> = calls
                    .iter()
                    .enumerate()
                    .map(|(c, (name, _))| {
                        if ollama {
                            json!({"function": {"name": name, "arguments": {"path": "src/lib.rs"}}})
                        } else {
                            json!({"id": call_id(i, c), "type": "function",
                                   "function": {"name": name, "arguments": "{\"path\":\"src/lib.rs\"}"}})
                        }
                    })
                    .collect();
                m.push(json!({"role": "assistant", "content": null, "tool_calls": tc}));
                for (c, (name, out)) in calls.iter().enumerate() {
                    if ollama {
                        m.push(json!({"role": "tool", "tool_name": name, "content": out}));
                    } else {
                        m.push(
                            json!({"role": "tool", "tool_call_id": call_id(i, c), "content": out}),
                        );
                    }
                }
            }
        }
    }
    json!({"model": "gpt-4o", "stream": true, "messages": m})
}

fn anthropic(s: &Script) -> Value {
    let mut m: Vec<Value> = Vec::new();
    for (i, st) in s.steps.iter().enumerate() {
        match st {
            Step::User(t) => {
                m.push(json!({"role": "user", "content": [{"type": "text", "text": t}]}))
            }
            Step::Assistant(t) => m.push(json!({"role": "assistant", "content": t})),
            Step::Tools(calls) => {
                let mut uses = vec![json!({"type": "text", "text": "Let me look."})];
                let mut results = Vec::new();
                for (c, (name, out)) in calls.iter().enumerate() {
                    uses.push(
                        json!({"type": "tool_use", "id": call_id(i, c), "name": name,
                                     "input": {"path": "src/lib.rs"}}),
                    );
                    let content = if c % 2 == 0 {
                        json!(out)
                    } else {
                        json!([{"type": "text", "text": out}])
                    };
                    results.push(json!({"type": "tool_result", "tool_use_id": call_id(i, c),
                                        "content": content}));
                }
                m.push(json!({"role": "assistant", "content": uses}));
                m.push(json!({"role": "user", "content": results}));
            }
        }
    }
    // Breakpoints on the newest blocks, one per message, as agents place them.
    let mut left = s.breakpoints;
    for msg in m.iter_mut().rev() {
        if left == 0 {
            break;
        }
        if let Some(Value::Array(blocks)) = msg.get_mut("content") {
            if let Some(Value::Object(b)) = blocks.last_mut() {
                b.insert("cache_control".into(), json!({"type": "ephemeral"}));
                left -= 1;
            }
        }
    }
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 4096,
        "system": [{"type": "text", "text": s.system}],
        "tools": [{"name": "read_file", "description": "read", "input_schema": {"type": "object"}}],
        "messages": m,
    })
}

fn responses(s: &Script) -> Value {
    let mut items = Vec::new();
    for (i, st) in s.steps.iter().enumerate() {
        match st {
            Step::User(t) => items.push(json!({"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": t}]})),
            Step::Assistant(t) => items.push(json!({"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": t}]})),
            Step::Tools(calls) => {
                items.push(json!({"type": "reasoning", "id": format!("rs_{i}"), "summary": []}));
                for (c, (name, _)) in calls.iter().enumerate() {
                    items.push(json!({"type": "function_call", "call_id": call_id(i, c),
                        "name": name, "arguments": "{}"}));
                }
                for (c, (_, out)) in calls.iter().enumerate() {
                    items.push(
                        json!({"type": "function_call_output", "call_id": call_id(i, c),
                        "output": out}),
                    );
                }
            }
        }
    }
    json!({"model": "gpt-5", "instructions": s.system, "input": items, "stream": true})
}

fn gemini(s: &Script) -> Value {
    let mut c = Vec::new();
    for st in &s.steps {
        match st {
            Step::User(t) => c.push(json!({"role": "user", "parts": [{"text": t}]})),
            Step::Assistant(t) => c.push(json!({"role": "model", "parts": [{"text": t}]})),
            Step::Tools(calls) => {
                let fc: Vec<Value> = calls
                    .iter()
                    .map(|(n, _)| json!({"functionCall": {"name": n, "args": {"path": "a"}}}))
                    .collect();
                let fr: Vec<Value> = calls
                    .iter()
                    .map(|(n, out)| json!({"functionResponse": {"name": n, "response": {"content": out}}}))
                    .collect();
                c.push(json!({"role": "model", "parts": fc}));
                c.push(json!({"role": "user", "parts": fr}));
            }
        }
    }
    json!({"systemInstruction": {"parts": [{"text": s.system}]}, "contents": c})
}

/// The conversation array of a body.
pub fn array_key(api: Api) -> &'static str {
    match api {
        Api::OpenAiChat | Api::Ollama | Api::Anthropic => "messages",
        Api::OpenAiResponses => "input",
        Api::Gemini => "contents",
    }
}

/// The conversation array's elements as (byte offset in `body`, raw text).
pub fn raw_elements(api: Api, body: &[u8]) -> Vec<(usize, String)> {
    #[derive(serde::Deserialize)]
    struct Top<'a> {
        #[serde(borrow, default)]
        messages: Option<Vec<&'a RawValue>>,
        #[serde(borrow, default)]
        input: Option<Vec<&'a RawValue>>,
        #[serde(borrow, default)]
        contents: Option<Vec<&'a RawValue>>,
    }
    let s = std::str::from_utf8(body).expect("utf-8 body");
    let top: Top = serde_json::from_str(s).expect("body parses");
    let arr = match api {
        Api::OpenAiChat | Api::Ollama | Api::Anthropic => top.messages,
        Api::OpenAiResponses => top.input,
        Api::Gemini => top.contents,
    }
    .expect("conversation array");
    arr.iter()
        .map(|r| {
            let off = r.get().as_ptr() as usize - s.as_ptr() as usize;
            (off, r.get().to_string())
        })
        .collect()
}

/// Elements through the first user message.
pub fn head_len(api: Api, body: &[u8]) -> usize {
    raw_elements(api, body)
        .iter()
        .position(|(_, s)| is_turn_start(api, &serde_json::from_str(s).unwrap()))
        .unwrap()
        + 1
}

/// Is element `v` a user turn start (a user message that carries no tool result)?
pub fn is_turn_start(api: Api, v: &Value) -> bool {
    let role = v["role"].as_str();
    match api {
        Api::OpenAiChat | Api::Ollama => role == Some("user"),
        Api::Anthropic => {
            role == Some("user")
                && !v["content"]
                    .as_array()
                    .is_some_and(|b| b.iter().any(|b| b["type"] == "tool_result"))
        }
        Api::OpenAiResponses => {
            v["type"].as_str().map_or(true, |t| t == "message") && role == Some("user")
        }
        Api::Gemini => {
            role == Some("user")
                && !v["parts"]
                    .as_array()
                    .is_some_and(|p| p.iter().any(|p| p.get("functionResponse").is_some()))
        }
    }
}

/// `Err(reason)` if `body` is not a request `api`'s provider would accept,
/// judged on the rules the trimmer must keep.
pub fn validate(api: Api, body: &[u8]) -> Result<(), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("not JSON: {e}"))?;
    let arr = v[array_key(api)]
        .as_array()
        .ok_or("no conversation array")?
        .clone();
    if arr.is_empty() {
        return Err("empty conversation".into());
    }
    match api {
        Api::OpenAiChat => validate_chat(&arr, true),
        Api::Ollama => validate_chat(&arr, false),
        Api::Anthropic => validate_anthropic(&v, &arr),
        Api::OpenAiResponses => validate_responses(&arr),
        Api::Gemini => validate_gemini(&arr),
    }
}

fn validate_chat(m: &[Value], ids: bool) -> Result<(), String> {
    let mut i = 0;
    while i < m.len() {
        let msg = &m[i];
        match msg["role"].as_str() {
            Some("tool") => {
                return Err(format!("tool message {i} without its assistant tool_calls"))
            }
            Some("assistant") if msg.get("tool_calls").is_some() => {
                let calls = msg["tool_calls"]
                    .as_array()
                    .ok_or("tool_calls not an array")?;
                let mut want: Vec<String> = calls
                    .iter()
                    .map(|c| c["id"].as_str().unwrap_or("").to_string())
                    .collect();
                let mut got = Vec::new();
                let mut j = i + 1;
                while j < m.len() && m[j]["role"] == "tool" {
                    got.push(m[j]["tool_call_id"].as_str().unwrap_or("").to_string());
                    j += 1;
                }
                if ids {
                    want.sort();
                    got.sort();
                    if want != got {
                        return Err(format!("assistant {i}: calls {want:?}, results {got:?}"));
                    }
                } else if want.len() != got.len() {
                    return Err(format!(
                        "assistant {i}: {} calls, {} results",
                        want.len(),
                        got.len()
                    ));
                }
                i = j;
                continue;
            }
            Some("system" | "developer" | "user" | "assistant") => {}
            r => return Err(format!("message {i}: role {r:?}")),
        }
        i += 1;
    }
    Ok(())
}

fn ids_of(blocks: &Value, ty: &str, key: &str) -> Vec<String> {
    let mut v: Vec<String> = blocks
        .as_array()
        .map(|b| {
            b.iter()
                .filter(|b| b["type"] == ty)
                .map(|b| b[key].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Count of non-null `cache_control` members anywhere in `v`.
pub fn cache_controls(v: &Value) -> usize {
    match v {
        Value::Object(m) => {
            usize::from(m.get("cache_control").is_some_and(|c| !c.is_null()))
                + m.values().map(cache_controls).sum::<usize>()
        }
        Value::Array(a) => a.iter().map(cache_controls).sum(),
        _ => 0,
    }
}

fn validate_anthropic(top: &Value, m: &[Value]) -> Result<(), String> {
    for (i, msg) in m.iter().enumerate() {
        let want = if i % 2 == 0 { "user" } else { "assistant" };
        if msg["role"] != want {
            return Err(format!("message {i} is {}, want {want}", msg["role"]));
        }
        if let Some(s) = msg["content"].as_str() {
            if s.is_empty() {
                return Err(format!("message {i}: empty content"));
            }
        }
        let results = ids_of(&msg["content"], "tool_result", "tool_use_id");
        let uses = ids_of(&msg["content"], "tool_use", "id");
        if want == "user" {
            if !uses.is_empty() {
                return Err(format!("user message {i} with tool_use"));
            }
            let prev = if i > 0 {
                ids_of(&m[i - 1]["content"], "tool_use", "id")
            } else {
                Vec::new()
            };
            if results != prev {
                return Err(format!(
                    "message {i}: results {results:?} for uses {prev:?}"
                ));
            }
        } else {
            if !results.is_empty() {
                return Err(format!("assistant message {i} with tool_result"));
            }
            let next = m
                .get(i + 1)
                .map(|n| ids_of(&n["content"], "tool_result", "tool_use_id"))
                .unwrap_or_default();
            if i + 1 < m.len() && uses != next {
                return Err(format!("message {i}: uses {uses:?} answered by {next:?}"));
            }
        }
    }
    let n = cache_controls(&top["system"])
        + cache_controls(&top["tools"])
        + cache_controls(&top["messages"]);
    if n > 4 {
        return Err(format!("{n} cache_control breakpoints"));
    }
    Ok(())
}

fn validate_responses(items: &[Value]) -> Result<(), String> {
    let mut open: Vec<String> = Vec::new();
    let mut answered: Vec<String> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        match it["type"].as_str() {
            Some("function_call") => open.push(it["call_id"].as_str().unwrap_or("").into()),
            Some("function_call_output") => {
                let id = it["call_id"].as_str().unwrap_or("").to_string();
                if !open.contains(&id) {
                    return Err(format!("item {i}: output for unknown call {id}"));
                }
                answered.push(id);
            }
            // A reasoning item must be followed by the item it produced.
            Some("reasoning")
                if items
                    .get(i + 1)
                    .map_or(true, |n| n["type"] != "function_call") =>
            {
                return Err(format!("reasoning item {i} without its function_call"));
            }
            _ => {}
        }
    }
    for id in open {
        if !answered.contains(&id) {
            return Err(format!("call {id} has no output"));
        }
    }
    Ok(())
}

fn validate_gemini(c: &[Value]) -> Result<(), String> {
    let count = |v: &Value, k: &str| {
        v["parts"]
            .as_array()
            .map_or(0, |p| p.iter().filter(|p| p.get(k).is_some()).count())
    };
    for (i, msg) in c.iter().enumerate() {
        let want = if i % 2 == 0 { "user" } else { "model" };
        if msg["role"] != want {
            return Err(format!("content {i} is {}, want {want}", msg["role"]));
        }
        let calls = count(msg, "functionCall");
        let next = c.get(i + 1).map_or(0, |n| count(n, "functionResponse"));
        if calls > 0 && i + 1 < c.len() && calls != next {
            return Err(format!("content {i}: {calls} calls, {next} responses"));
        }
        let resp = count(msg, "functionResponse");
        if resp > 0 && (i == 0 || count(&c[i - 1], "functionCall") != resp) {
            return Err(format!("content {i}: responses without calls"));
        }
    }
    Ok(())
}

/// A stand-in for the session ruler: four bytes a token.
pub fn count(b: &[u8]) -> u64 {
    b.len() as u64 / 4
}

/// Replace every tool output in an element with null, so an elided element
/// can be matched with its original.
pub fn strip_outputs(api: Api, v: &Value) -> Value {
    let mut v = v.clone();
    match api {
        Api::OpenAiChat | Api::Ollama => {
            if v["role"] == "tool" {
                v["content"] = Value::Null;
            }
        }
        Api::Anthropic => {
            if let Some(b) = v["content"].as_array_mut() {
                for b in b.iter_mut().filter(|b| b["type"] == "tool_result") {
                    b["content"] = Value::Null;
                }
            }
        }
        Api::OpenAiResponses => {
            if v.get("output").is_some() {
                v["output"] = Value::Null;
            }
        }
        Api::Gemini => {
            if let Some(p) = v["parts"].as_array_mut() {
                for p in p.iter_mut().filter(|p| p.get("functionResponse").is_some()) {
                    p["functionResponse"]["response"] = Value::Null;
                }
            }
        }
    }
    v
}

/// Everything a trimmed body must satisfy against its original: valid for
/// its API, shorter, the head (everything through the first user message)
/// and the newest element kept byte for byte, the rest a subsequence of the
/// original in order (elided elements matching with their outputs blanked,
/// `cache_control` aside), plus at most one synthetic gap marker.
pub fn check_trimmed(api: Api, orig: &[u8], out: &[u8]) -> Result<(), String> {
    validate(api, out)?;
    if out.len() >= orig.len() {
        return Err(format!("not smaller: {} >= {}", out.len(), orig.len()));
    }
    let o = raw_elements(api, orig);
    let t = raw_elements(api, out);
    let ov: Vec<Value> = o
        .iter()
        .map(|(_, s)| serde_json::from_str(s).unwrap())
        .collect();
    let head = ov
        .iter()
        .position(|v| is_turn_start(api, v))
        .ok_or("original has no user message")?
        + 1;
    let bp = |s: &str| s.contains("cache_control");
    for (i, (_, oi)) in o.iter().enumerate().take(head) {
        if t.get(i).map(|x| &x.1) != Some(oi) && !bp(oi) {
            return Err(format!("head element {i} changed"));
        }
    }
    if t.last().map(|x| &x.1) != o.last().map(|x| &x.1) && !bp(&o.last().unwrap().1) {
        return Err("newest element changed".into());
    }
    let mut j = 0;
    let mut markers = 0;
    for (i, (_, s)) in t.iter().enumerate() {
        let tv: Value = serde_json::from_str(s).unwrap();
        let mut tn = tv.clone();
        strip_cc(&mut tn);
        let found = (j..o.len()).find(|&k| {
            if o[k].1 == *s {
                return true;
            }
            let mut on = ov[k].clone();
            strip_cc(&mut on);
            on == tn
                || (s.contains("[tidemark: elided ")
                    && strip_outputs(api, &on) == strip_outputs(api, &tn))
        });
        match found {
            Some(k) => j = k + 1,
            None if s.contains("earlier messages omitted]") && i == head => markers += 1,
            None => {
                return Err(format!(
                "output element {i} not in the original in order: {s:.300} (next original {:.300})",
                o.get(j).map_or("", |x| x.1.as_str())
            ))
            }
        }
    }
    if markers > 1 {
        return Err("more than one gap marker".into());
    }
    Ok(())
}

fn strip_cc(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.remove("cache_control");
            m.values_mut().for_each(strip_cc);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_cc),
        _ => {}
    }
}
