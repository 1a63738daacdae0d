//! The estimator: exact tiktoken counts, framing, images from generated
//! headers, the per-message cache, every request shape of the five APIs.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use serde_json::{json, Value};
use tidemark::estimate::images::{self, Size};
use tidemark::estimate::{Encoding, Estimate, Estimator};
use tidemark::json::RequestView;
use tidemark::provider::Api;

fn est(api: Api, body: &Value) -> Estimate {
    Estimator::new(1 << 20)
        .estimate_body(api, body.to_string().as_bytes(), None)
        .expect("a JSON object")
}

fn tokens(api: Api, body: &Value) -> u64 {
    est(api, body).tokens
}

fn o200k(s: &str) -> u64 {
    Encoding::O200kBase.count(s) as u64
}

fn cl100k(s: &str) -> u64 {
    Encoding::Cl100kBase.count(s) as u64
}

// ---- tokenizers -----------------------------------------------------------

#[test]
fn counts_match_tiktoken_exactly() {
    // Published reference values (tiktoken README / cookbook).
    assert_eq!(cl100k("tiktoken is great!"), 6);
    assert_eq!(cl100k("hello world"), 2);
    assert_eq!(o200k("hello world"), 2);
    assert_eq!(cl100k(""), 0);

    let samples = [
        "The quick brown fox jumps over the lazy dog.",
        "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
        "日本語のテキストは、英語よりも多くのトークンになります。",
        "数据库连接失败：请检查配置文件中的主机名和端口。",
        "🙂🚀🎉👩‍👩‍👧‍👦 emoji 🇳🇴",
        "{\"id\":123,\"name\":\"alpha\",\"tags\":[\"x\",\"y\"],\"nested\":{\"ok\":true}}",
        "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==",
        "   leading and trailing spaces   \n\n\n\tand tabs\r\n",
        "<|endoftext|> is ordinary text here",
        "Ünïcödé façade naïve résumé — “quotes” and ‘apostrophes’ … ½ ∑ ∞",
        "I'm sure they'll've done it; we'd LOVE it's THEY'RE",
        "12345678901234567890 3.14159 -42 1e10",
    ];
    let o = tiktoken_rs::o200k_base_singleton();
    let c = tiktoken_rs::cl100k_base_singleton();
    for s in samples {
        assert_eq!(o200k(s), o.encode_ordinary(s).len() as u64, "o200k {s:?}");
        assert_eq!(cl100k(s), c.encode_ordinary(s).len() as u64, "cl100k {s:?}");
    }
}

#[test]
fn tokenizer_follows_the_model_family() {
    let f = |api, m| Encoding::for_model(api, Some(m));
    assert_eq!(f(Api::OpenAiChat, "gpt-4o"), Encoding::O200kBase);
    assert_eq!(f(Api::OpenAiResponses, "o4-mini"), Encoding::O200kBase);
    assert_eq!(f(Api::OpenAiChat, "gpt-4-0613"), Encoding::Cl100kBase);
    assert_eq!(f(Api::OpenAiChat, "gpt-3.5-turbo"), Encoding::Cl100kBase);
    assert_eq!(f(Api::Anthropic, "claude-opus-4-1"), Encoding::Cl100kBase);
    assert_eq!(f(Api::Gemini, "gemini-2.5-flash"), Encoding::O200kBase);
    assert_eq!(f(Api::Ollama, "qwen3:8b"), Encoding::Cl100kBase);
    // The same text costs differently under the two vocabularies.
    let body =
        json!({"messages":[{"role":"user","content":"日本語のテキスト、中文文本，한국어 텍스트"}]});
    let e = Estimator::new(1 << 20);
    let b = |m: &str| {
        let mut v = body.clone();
        v["model"] = json!(m);
        e.estimate_body(Api::OpenAiChat, v.to_string().as_bytes(), None)
            .map(|e| e.tokens)
    };
    assert!(b("gpt-4-0613") > b("gpt-4o"));
}

// ---- framing ----------------------------------------------------------------

/// The tiktoken cookbook's `num_tokens_from_messages` example, whose totals
/// it checked against the API's `usage.prompt_tokens`: 129 for
/// gpt-3.5-turbo-0613 and gpt-4-0613 (cl100k), 124 for gpt-4o (o200k).
#[test]
fn openai_chat_cookbook_example() {
    let messages = json!([
        {"role": "system", "content": "You are a helpful, pattern-following assistant that translates corporate jargon into plain English."},
        {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
        {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
        {"role": "system", "name": "example_user", "content": "Let's circle back when we have more bandwidth to touch base on opportunities for increased leverage."},
        {"role": "system", "name": "example_assistant", "content": "Let's talk later when we're less busy about how to do better."},
        {"role": "user", "content": "This late pivot means we don't have time to boil the ocean for the client deliverable."},
    ]);
    for (model, want) in [
        ("gpt-3.5-turbo-0613", 129),
        ("gpt-4-0613", 129),
        ("gpt-4o", 124),
    ] {
        let body = json!({"model": model, "messages": messages});
        assert_eq!(tokens(Api::OpenAiChat, &body), want, "{model}");
    }
}

#[test]
fn framing_constants() {
    let one = |api, body: Value| tokens(api, &body);
    // OpenAI: 3 per message + role + content, 3 priming the reply; a name costs 1 more.
    assert_eq!(
        one(
            Api::OpenAiChat,
            json!({"model":"gpt-4o","messages":[{"role":"user","content":""}]})
        ),
        3 + o200k("user") + 3
    );
    assert_eq!(
        one(
            Api::OpenAiChat,
            json!({"model":"gpt-4o","messages":[{"role":"user","name":"bob","content":"hi"}]})
        ),
        3 + o200k("user") + o200k("bob") + 1 + o200k("hi") + 3
    );
    // Responses: instructions and a string input are each one message.
    assert_eq!(
        one(
            Api::OpenAiResponses,
            json!({"model":"gpt-5","instructions":"Be brief.","input":"hi"})
        ),
        (3 + 1 + o200k("Be brief.")) + (3 + 1 + o200k("hi")) + 3
    );
    // Anthropic: 3 per message + role, 3 for the reply; tools add the 346-token tool system prompt.
    let m = "claude-sonnet-4-5";
    assert_eq!(
        one(
            Api::Anthropic,
            json!({"model":m,"system":"sys","messages":[{"role":"user","content":"hello"}]})
        ),
        (3 + cl100k("sys")) + (3 + cl100k("user") + cl100k("hello")) + 3
    );
    let tool = json!({"name":"t","description":"d","input_schema":{"type":"object"}});
    assert_eq!(
        one(
            Api::Anthropic,
            json!({"model":m,"tools":[tool],"messages":[]})
        ),
        346 + cl100k(r#"{"name":"t","description":"d","input_schema":{"type":"object"}}"#) + 3
    );
    // Gemini: 3 per content + role.
    assert_eq!(
        one(
            Api::Gemini,
            json!({"contents":[{"role":"user","parts":[{"text":"hello"}]}]})
        ),
        3 + o200k("user") + o200k("hello") + 3
    );
    // Ollama (Llama 3 template): 4 per message + role, 5 for the reply.
    assert_eq!(
        one(
            Api::Ollama,
            json!({"model":"llama3.1","messages":[{"role":"user","content":"hello"}]})
        ),
        4 + cl100k("user") + cl100k("hello") + 5
    );
}

#[test]
fn json_escapes_are_decoded_before_counting() {
    let escaped = br#"{"model":"gpt-4o","messages":[{"role":"user","content":"\u65e5\u672c\u8a9e \"quoted\"\n\ttab"}]}"#;
    let plain = "{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\",\"content\":\"日本語 \\\"quoted\\\"\\n\\ttab\"}]}";
    let e = Estimator::new(1 << 20);
    let a = e.estimate_body(Api::OpenAiChat, escaped, None).unwrap();
    let b = e
        .estimate_body(Api::OpenAiChat, plain.as_bytes(), None)
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(
        a.tokens,
        3 + o200k("user") + o200k("日本語 \"quoted\"\n\ttab") + 3
    );
    assert_eq!(
        a.chars,
        4 + "日本語 \"quoted\"\n\ttab".chars().count() as u64
    );
}

// ---- every part the provider sees -------------------------------------------

/// `with` minus `without`: what one addition costs.
fn diff(api: Api, with: Value, without: Value) -> u64 {
    tokens(api, &with) - tokens(api, &without)
}

#[test]
fn openai_chat_parts() {
    let base = json!({"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]});
    let mut with_call = base.clone();
    with_call["messages"].as_array_mut().unwrap().push(json!({
        "role":"assistant","content":null,
        "tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}}]
    }));
    assert_eq!(
        diff(Api::OpenAiChat, with_call.clone(), base.clone()),
        3 + o200k("assistant") + 3 + o200k("get_weather") + o200k("{\"city\":\"Oslo\"}")
    );
    let mut with_result = with_call.clone();
    with_result["messages"].as_array_mut().unwrap().push(json!({
        "role":"tool","tool_call_id":"call_1","content":"{\"temp\": 21}"
    }));
    assert_eq!(
        diff(Api::OpenAiChat, with_result, with_call),
        3 + o200k("tool") + o200k("{\"temp\": 21}")
    );
    let mut with_parts = base.clone();
    with_parts["messages"] = json!([{"role":"user","content":[
        {"type":"text","text":"look"},
        {"type":"image_url","image_url":{"url":"https://example.com/a.png","detail":"low"}}
    ]}]);
    assert_eq!(
        diff(Api::OpenAiChat, with_parts, base.clone()),
        o200k("look") + 85 - o200k("hi")
    );
    let mut with_tools = base.clone();
    let params = json!({"type":"object","properties":{"city":{"type":"string"}}});
    with_tools["tools"] = json!([{"type":"function","function":{
        "name":"get_weather","description":"Weather now",
        "parameters":params,"strict":true}}]);
    // Serialized as the body carries it (serde_json may order the keys).
    let params = serde_json::to_string(&params).unwrap();
    assert_eq!(
        diff(Api::OpenAiChat, with_tools, base),
        7 + o200k(&format!(
            r#"{{"name":"get_weather","description":"Weather now","parameters":{params}}}"#
        )) + 12
    );
}

#[test]
fn openai_responses_items() {
    let base = json!({"model":"gpt-5","input":[{"role":"user","content":"hi"}]});
    let mut more = base.clone();
    more["input"].as_array_mut().unwrap().extend([
        json!({"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"Think about weather."}],"encrypted_content":"gAAAAABo"}),
        json!({"type":"function_call","id":"fc_1","call_id":"call_1","name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}),
        json!({"type":"function_call_output","call_id":"call_1","output":"21 degrees"}),
        json!({"type":"message","role":"assistant","content":[{"type":"output_text","text":"It is 21."}]}),
    ]);
    assert_eq!(
        diff(Api::OpenAiResponses, more, base),
        o200k("Think about weather.")
            + (3 + o200k("get_weather") + o200k("{\"city\":\"Oslo\"}"))
            + (3 + o200k("21 degrees"))
            + (3 + o200k("assistant") + o200k("It is 21."))
    );
}

#[test]
fn anthropic_blocks() {
    let base = json!({"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"hi"}]});
    let mut more = base.clone();
    more["messages"].as_array_mut().unwrap().extend([
        json!({"role":"assistant","content":[
            {"type":"thinking","thinking":"The user wants weather.","signature":"EqQBCgIYAhIM"},
            {"type":"text","text":"Checking."},
            {"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Oslo"}}
        ]}),
        json!({"role":"user","content":[
            {"type":"tool_result","tool_use_id":"toolu_1","content":[{"type":"text","text":"21 degrees"}]}
        ]}),
    ]);
    assert_eq!(
        diff(Api::Anthropic, more, base),
        (3 + cl100k("assistant")
            + cl100k("The user wants weather.")
            + cl100k("Checking.")
            + 3
            + cl100k("get_weather")
            + cl100k(r#"{"city":"Oslo"}"#))
            + (3 + cl100k("user") + 3 + cl100k("21 degrees"))
    );
    // A system prompt as blocks counts its text.
    let sys = json!({"model":"claude-sonnet-4-5","system":[{"type":"text","text":"Be terse.","cache_control":{"type":"ephemeral"}}],"messages":[]});
    assert_eq!(tokens(Api::Anthropic, &sys), 3 + cl100k("Be terse.") + 3);
}

#[test]
fn gemini_parts() {
    let base = json!({"contents":[{"role":"user","parts":[{"text":"hi"}]}]});
    let mut more = base.clone();
    more["systemInstruction"] = json!({"parts":[{"text":"Be terse."}]});
    more["contents"].as_array_mut().unwrap().extend([
        json!({"role":"model","parts":[{"functionCall":{"name":"get_weather","args":{"city":"Oslo"}}}]}),
        json!({"role":"user","parts":[{"functionResponse":{"name":"get_weather","response":{"temp":21}}}]}),
    ]);
    more["tools"] = json!([{"functionDeclarations":[{"name":"get_weather","description":"Weather","parameters":{"type":"OBJECT"}}]}]);
    assert_eq!(
        diff(Api::Gemini, more, base),
        (3 + o200k("Be terse."))
            + (3 + o200k("model") + 3 + o200k("get_weather") + o200k(r#"{"city":"Oslo"}"#))
            + (3 + o200k("user") + 3 + o200k("get_weather") + o200k(r#"{"temp":21}"#))
            + o200k(
                r#"{"name":"get_weather","description":"Weather","parameters":{"type":"OBJECT"}}"#
            )
    );
}

#[test]
fn ollama_chat_and_generate() {
    let m = "llama3.1";
    let base = json!({"model":m,"messages":[{"role":"user","content":"hi"}]});
    let mut more = base.clone();
    more["messages"].as_array_mut().unwrap().extend([
        json!({"role":"assistant","content":"","tool_calls":[{"function":{"name":"get_weather","arguments":{"city":"Oslo"}}}]}),
        json!({"role":"tool","tool_name":"get_weather","content":"21 degrees","images":["iVBORw0KGgo="]}),
    ]);
    assert_eq!(
        diff(Api::Ollama, more, base),
        (4 + cl100k("assistant") + 3 + cl100k("get_weather") + cl100k(r#"{"city":"Oslo"}"#))
            + (4 + cl100k("tool") + cl100k("21 degrees") + cl100k("get_weather") + 576)
    );
    let generate = json!({"model":m,"system":"Be terse.","prompt":"Why is the sky blue?"});
    assert_eq!(
        tokens(Api::Ollama, &generate),
        (4 + cl100k("Be terse.")) + (4 + cl100k("Why is the sky blue?")) + 5
    );
}

// ---- images -----------------------------------------------------------------

fn png(w: u32, h: u32) -> Vec<u8> {
    let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
    b.extend(w.to_be_bytes());
    b.extend(h.to_be_bytes());
    b.extend([8, 6, 0, 0, 0, 0x12, 0x34, 0x56, 0x78]);
    b
}

fn gif(w: u16, h: u16) -> Vec<u8> {
    let mut b = b"GIF89a".to_vec();
    b.extend(w.to_le_bytes());
    b.extend(h.to_le_bytes());
    b.extend([0xf7, 0, 0]);
    b
}

/// JFIF, then a large EXIF segment (skipped by its length), a quantisation
/// table, and the baseline start of frame.
fn jpeg(w: u16, h: u16) -> Vec<u8> {
    let mut b = vec![0xff, 0xd8];
    b.extend([0xff, 0xe0, 0, 16]);
    b.extend(b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0");
    let exif_len: u16 = 30_000;
    b.extend([0xff, 0xe1]);
    b.extend(exif_len.to_be_bytes());
    b.extend(b"Exif\0\0");
    b.resize(b.len() + exif_len as usize - 2 - 6, 0xab);
    b.extend([0xff, 0xdb, 0, 67, 0]);
    b.resize(b.len() + 64, 1);
    b.extend([0xff, 0xc0, 0, 17, 8]);
    b.extend(h.to_be_bytes());
    b.extend(w.to_be_bytes());
    b.extend([3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1]);
    b
}

fn webp_vp8(w: u16, h: u16) -> Vec<u8> {
    let mut b = b"RIFF\0\0\0\0WEBPVP8 \0\0\0\0".to_vec();
    b.extend([0x50, 0x2a, 0x00, 0x9d, 0x01, 0x2a]);
    b.extend(w.to_le_bytes());
    b.extend(h.to_le_bytes());
    b
}

fn webp_vp8l(w: u32, h: u32) -> Vec<u8> {
    let mut b = b"RIFF\0\0\0\0WEBPVP8L\0\0\0\0\x2f".to_vec();
    b.extend(((w - 1) | ((h - 1) << 14)).to_le_bytes());
    b.extend([0; 8]);
    b
}

fn webp_vp8x(w: u32, h: u32) -> Vec<u8> {
    let mut b = b"RIFF\0\0\0\0WEBPVP8X\x0a\0\0\0\x10\0\0\0".to_vec();
    b.extend(&(w - 1).to_le_bytes()[..3]);
    b.extend(&(h - 1).to_le_bytes()[..3]);
    b.extend([0; 8]);
    b
}

/// Base64 of the header, then garbage that is not base64 at all: the size
/// must come from the header alone, never from decoding the pixels.
fn payload(header: &[u8]) -> String {
    let mut h = header.to_vec();
    // Real images go on past the header: some valid bytes, then the garbage.
    h.resize(h.len() + 96, 0);
    while h.len() % 3 != 0 {
        h.push(0);
    }
    let mut s = B64.encode(&h);
    s.push_str(&"!*".repeat(50_000));
    s
}

#[test]
fn image_sizes_from_headers_only() {
    let cases: Vec<(&str, Vec<u8>, u32, u32)> = vec![
        ("png", png(1024, 1024), 1024, 1024),
        ("gif", gif(300, 200), 300, 200),
        ("jpeg", jpeg(4096, 2048), 4096, 2048),
        ("webp-vp8", webp_vp8(640, 480), 640, 480),
        ("webp-vp8l", webp_vp8l(1000, 1000), 1000, 1000),
        ("webp-vp8x", webp_vp8x(2000, 1500), 2000, 1500),
    ];
    for (name, header, w, h) in &cases {
        let got = images::sniff_base64(&payload(header));
        assert_eq!(got, Some(Size { w: *w, h: *h }), "{name}");
    }
    assert_eq!(images::sniff_base64("bm90IGFuIGltYWdl"), None);
    assert_eq!(images::sniff_base64(""), None);
    assert_eq!(images::sniff_base64("!!!!"), None);
    // Truncated headers are unknown, not a panic.
    for (_, header, _, _) in &cases {
        for cut in 0..header.len().min(40) {
            let _ = images::sniff_base64(&B64.encode(&header[..cut]));
        }
    }
}

fn data_url(mime: &str, header: &[u8]) -> String {
    format!("data:{mime};base64,{}", payload(header))
}

#[test]
fn image_tokens_per_provider() {
    let chat = |url: String, detail: &str| {
        let with = json!({"model":"gpt-4o","messages":[{"role":"user","content":[
            {"type":"image_url","image_url":{"url":url,"detail":detail}}]}]});
        let without = json!({"model":"gpt-4o","messages":[{"role":"user","content":[]}]});
        diff(Api::OpenAiChat, with, without)
    };
    // OpenAI's documented examples: 1024x1024 high = 765, 2048x4096 high = 1105.
    assert_eq!(chat(data_url("image/png", &png(1024, 1024)), "high"), 765);
    assert_eq!(
        chat(data_url("image/jpeg", &jpeg(2048, 4096)), "auto"),
        1105
    );
    assert_eq!(
        chat(data_url("image/gif", &gif(300, 200)), "high"),
        85 + 170
    );
    assert_eq!(
        chat(data_url("image/webp", &webp_vp8(640, 480)), "high"),
        85 + 2 * 170
    );
    assert_eq!(chat(data_url("image/png", &png(4000, 4000)), "low"), 85);
    // Remote URL: size unknown, the documented default.
    assert_eq!(chat("https://example.com/cat.png".into(), "high"), 765);

    // Responses input_image.
    let resp = json!({"model":"gpt-4o","input":[{"role":"user","content":[
        {"type":"input_image","image_url":data_url("image/png", &png(512, 512))}]}]});
    let resp0 = json!({"model":"gpt-4o","input":[{"role":"user","content":[]}]});
    assert_eq!(diff(Api::OpenAiResponses, resp, resp0), 85 + 170);

    // Anthropic: w*h/750 after the long edge is scaled to 1568, at most ~1600.
    let anth = |header: &[u8], mime: &str| {
        let with = json!({"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[
            {"type":"image","source":{"type":"base64","media_type":mime,"data":payload(header)}}]}]});
        let without =
            json!({"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[]}]});
        diff(Api::Anthropic, with, without)
    };
    assert_eq!(anth(&png(200, 200), "image/png"), 54);
    assert_eq!(anth(&webp_vp8l(1000, 1000), "image/webp"), 1334);
    assert_eq!(anth(&jpeg(4096, 2048), "image/jpeg"), 1600);
    let url_img = json!({"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[
        {"type":"image","source":{"type":"url","url":"https://example.com/a.jpg"}}]}]});
    let none = json!({"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[]}]});
    assert_eq!(diff(Api::Anthropic, url_img, none), 1600);

    // Gemini: 258 up to 384x384, else 258 per tile.
    let gem = |header: &[u8]| {
        let with = json!({"contents":[{"role":"user","parts":[
            {"inlineData":{"mimeType":"image/png","data":payload(header)}}]}]});
        let without = json!({"contents":[{"role":"user","parts":[]}]});
        diff(Api::Gemini, with, without)
    };
    assert_eq!(gem(&png(300, 300)), 258);
    assert_eq!(gem(&png(1024, 1024)), 4 * 258);
}

// ---- the cache --------------------------------------------------------------

fn mixed_message(i: usize) -> Value {
    let content = match i % 5 {
        0 => format!("Turn {i}: please refactor the parser so it streams; keep the API stable. "),
        1 => format!("第{i}轮：请把解析器改成流式处理，并保持接口稳定。日本語も少し。"),
        2 => format!(
            "{{\"turn\":{i},\"rows\":[{{\"id\":1,\"ok\":true}},{{\"id\":2,\"ok\":false}}]}}"
        ),
        3 => format!("fn step_{i}(x: u64) -> u64 {{ x.wrapping_mul(31).rotate_left(7) }} 🚀🎉"),
        _ => B64.encode(format!("binary-ish payload {i} ").repeat(8)),
    };
    let role = if i % 2 == 0 { "user" } else { "assistant" };
    json!({"role": role, "content": content.repeat(6)})
}

#[test]
fn appending_a_turn_tokenizes_only_that_turn() {
    let e = Estimator::new(64 << 20);
    let mut messages: Vec<Value> = (0..400).map(mixed_message).collect();
    let body = |m: &[Value]| {
        json!({"model":"gpt-4o","tools":[{"type":"function","function":{"name":"f","parameters":{}}}],"messages":m})
            .to_string()
    };
    let b1 = body(&messages);
    assert!(b1.len() > 100_000, "history is {} bytes", b1.len());
    let first = e
        .estimate_body(Api::OpenAiChat, b1.as_bytes(), None)
        .unwrap();
    let s1 = e.stats();
    assert_eq!(s1.misses, 401);

    let new_msg = json!({"role":"user","content":"One more question about 日本語 and 🚀."});
    messages.push(new_msg.clone());
    let b2 = body(&messages);
    let second = e
        .estimate_body(Api::OpenAiChat, b2.as_bytes(), None)
        .unwrap();
    let s2 = e.stats();
    assert_eq!(s2.misses - s1.misses, 1, "only the new message is counted");
    assert_eq!(s2.hits - s1.hits, 401);
    let new_len = new_msg.to_string().len() as u64;
    let tokenized = s2.tokenized_bytes - s1.tokenized_bytes;
    assert!(
        tokenized > 0 && tokenized <= new_len,
        "{tokenized} > {new_len}"
    );
    assert_eq!(
        second.tokens - first.tokens,
        3 + o200k("user") + o200k("One more question about 日本語 and 🚀.")
    );

    // The cached answer is the answer from scratch.
    let fresh = Estimator::new(64 << 20);
    assert_eq!(
        fresh.estimate_body(Api::OpenAiChat, b2.as_bytes(), None),
        Some(second)
    );
    // A different tokenizer does not reuse these counts.
    let b3 = b2.replacen("gpt-4o", "gpt-4-0613", 1);
    let before = e.stats().misses;
    e.estimate_body(Api::OpenAiChat, b3.as_bytes(), None)
        .unwrap();
    assert_eq!(e.stats().misses - before, 402);
}

/// A long history is looked up in a batch past its first elements; equal
/// messages in it are still counted once and each counts whole, as one by one.
#[test]
fn a_long_history_with_repeated_messages_counts_each_and_tokenizes_once() {
    let one = json!({"role":"user","content":"the same tool result, again: 日本語 🚀"});
    let body = |n: usize| json!({"model":"gpt-4o","messages": vec![one.clone(); n]}).to_string();
    let e = Estimator::new(64 << 20);
    let single = e
        .estimate_body(Api::OpenAiChat, body(1).as_bytes(), None)
        .unwrap();
    let before = e.stats();
    let many = e
        .estimate_body(Api::OpenAiChat, body(100).as_bytes(), None)
        .unwrap();
    let after = e.stats();
    assert_eq!(
        after.misses, before.misses,
        "every copy was already counted"
    );
    assert_eq!(after.hits - before.hits, 100);
    assert_eq!(after.tokenized_bytes, before.tokenized_bytes);
    let per_message = single.tokens - 3; // less the reply's priming
    assert_eq!(many.tokens, 100 * per_message + 3);
    // From scratch, the copies past the first are found, not tokenized.
    let fresh = Estimator::new(64 << 20);
    assert_eq!(
        fresh.estimate_body(Api::OpenAiChat, body(100).as_bytes(), None),
        Some(many)
    );
    let s = fresh.stats();
    assert_eq!((s.misses, s.hits), (1, 99));
}

#[test]
fn a_bounded_estimate_stops_before_a_cold_history_and_agrees_once_warm() {
    let e = Estimator::new(64 << 20);
    let p = Api::OpenAiChat.provider();
    let messages: Vec<Value> = (0..200).map(mixed_message).collect();
    let body = json!({"model":"gpt-4o","messages":messages}).to_string();
    let view = RequestView::parse(body.as_bytes()).unwrap();
    let whole = Estimator::new(64 << 20).estimate(p, &view, Some("gpt-4o"));

    // Cold: it gives up before tokenizing past 16 KiB of it.
    assert_eq!(e.estimate_bounded(p, &view, Some("gpt-4o"), 16 << 10), None);
    let tokenized = e.stats().tokenized_bytes;
    assert!(
        tokenized <= 16 << 10 && tokenized > 0,
        "tokenized {tokenized} bytes"
    );
    // What it counted is kept; the rest is counted by an unbounded estimate
    // (on the blocking pool, in the proxy), after which the bounded one
    // answers in place, with the same figure.
    assert_eq!(e.estimate(p, &view, Some("gpt-4o")), whole);
    assert_eq!(
        e.estimate_bounded(p, &view, Some("gpt-4o"), 16 << 10),
        Some(whole)
    );
    assert_eq!(e.estimate_bounded(p, &view, Some("gpt-4o"), 0), Some(whole));
}

#[test]
fn cache_budget_holds_under_100k_distinct_messages() {
    let budget = 1 << 20;
    let e = Estimator::new(budget);
    for i in 0..100_000u32 {
        let body = format!(
            r#"{{"model":"gpt-4o","messages":[{{"role":"user","content":"message number {i}"}}]}}"#
        );
        let est = e
            .estimate_body(Api::OpenAiChat, body.as_bytes(), None)
            .unwrap();
        assert!(est.tokens > 7);
        if i % 5_000 == 0 {
            assert!(e.stats().cache_bytes <= budget, "at {i}: {:?}", e.stats());
        }
    }
    let s = e.stats();
    assert!(s.cache_bytes <= budget, "{s:?}");
    assert!(s.cache_entries > 10_000, "the budget is used: {s:?}");
    assert!(s.cache_entries < 100_000, "old entries were evicted: {s:?}");
    // Recent messages are still cached.
    let before = e.stats().misses;
    let body =
        r#"{"model":"gpt-4o","messages":[{"role":"user","content":"message number 99999"}]}"#;
    e.estimate_body(Api::OpenAiChat, body.as_bytes(), None)
        .unwrap();
    assert_eq!(e.stats().misses, before);
}

// ---- fixtures, density, robustness ------------------------------------------

fn api_of_dir(dir: &str) -> Option<Api> {
    Some(match dir {
        "openai-chat" => Api::OpenAiChat,
        "openai-responses" => Api::OpenAiResponses,
        "anthropic-messages" => Api::Anthropic,
        "gemini" => Api::Gemini,
        "ollama" => Api::Ollama,
        _ => return None,
    })
}

#[test]
fn every_request_fixture_has_a_nonzero_estimate() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut seen = 0;
    for dir in std::fs::read_dir(&root).unwrap() {
        let dir = dir.unwrap().path();
        let Some(api) = dir
            .file_name()
            .and_then(|d| d.to_str())
            .and_then(api_of_dir)
        else {
            continue;
        };
        for f in std::fs::read_dir(&dir).unwrap() {
            let f = f.unwrap().path();
            let name = f.file_name().unwrap().to_string_lossy().into_owned();
            if !(name.contains("request") && name.ends_with(".json")) {
                continue;
            }
            let body = std::fs::read(&f).unwrap();
            let e = Estimator::new(1 << 20)
                .estimate_body(api, &body, None)
                .unwrap_or_else(|| panic!("{name} is not a JSON object"));
            assert!(e.tokens > 0 && e.chars > 0, "{name}: {e:?}");
            seen += 1;
        }
    }
    assert!(seen >= 1, "no request fixtures found under {root:?}");
}

#[test]
fn dense_text_costs_more_than_chars_over_4() {
    let samples = [
        "数据库连接失败：请检查配置文件中的主机名和端口，然后重新启动服务。".repeat(20),
        "東京都の天気は晴れのち曇り、最高気温は二十五度の予報です。".repeat(20),
        "🙂🚀🎉🔥✨🥳😅🤖🧠💡".repeat(40),
        B64.encode((0u8..=255).cycle().take(3000).collect::<Vec<u8>>()),
    ];
    for s in samples {
        let body = json!({"model":"gpt-4o","messages":[{"role":"user","content":s}]});
        let e = est(Api::OpenAiChat, &body);
        assert!(
            e.tokens > e.chars / 4,
            "{} tokens vs {} chars: {}",
            e.tokens,
            e.chars,
            &s[..24]
        );
    }
}

#[test]
fn malformed_elements_do_not_panic() {
    let odd = json!([
        1, "bare string", null, true, [], [[["deep"]]], {},
        {"role": 5, "content": {"weird": [1, {"x": null}]}},
        {"role": "user", "content": [1, null, {"type": 3}, {"type":"image_url"}, {"type":"image_url","image_url":7},
            {"type":"image_url","image_url":{"url":"data:image/png;base64,!!!"}},
            {"type":"input_image","image_url":"data:image/jpeg;base64,/9j/"},
            {"type":"text"}, {"type":"text","text":{"nested":"obj"}}]},
        {"role":"assistant","tool_calls":[1, {"function": 3}, {"function":{"name":7,"arguments":{"a":1}}}]},
        {"type":"function_call","arguments":null},
        {"type":"reasoning","summary":"not a list"},
        {"parts":"nope"}, {"parts":[{"inlineData":{"data":5}}, {"functionCall":7}]},
        {"content":[{"type":"image","source":null},{"type":"tool_result","content":{"type":"text"}},{"type":"document","source":{"type":"base64"}}]},
        {"images": "x", "tool_calls": {"a":1}}
    ]);
    for api in [
        Api::OpenAiChat,
        Api::OpenAiResponses,
        Api::Anthropic,
        Api::Gemini,
        Api::Ollama,
    ] {
        for field in [
            "messages",
            "input",
            "contents",
            "tools",
            "functions",
            "system",
            "systemInstruction",
            "instructions",
            "prompt",
            "images",
        ] {
            let mut body = json!({"model":"m"});
            body[field] = odd.clone();
            let _ = est(api, &body);
            body[field] = json!({"role":"user","parts":{"text":1}});
            let _ = est(api, &body);
            body[field] = json!(42);
            let _ = est(api, &body);
        }
    }
    // Not an object at all.
    let e = Estimator::new(1024);
    assert!(e.estimate_body(Api::OpenAiChat, b"[1,2]", None).is_none());
    assert!(e
        .estimate_body(Api::OpenAiChat, b"{\"messages\":", None)
        .is_none());
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            "\\PC{0,20}".prop_map(Value::String),
            prop_oneof![
                Just("text"),
                Just("image_url"),
                Just("tool_use"),
                Just("tool_result"),
                Just("function_call"),
                Just("input_image"),
                Just("image"),
                Just("reasoning")
            ]
            .prop_map(|s| Value::String(s.into())),
        ];
        leaf.prop_recursive(5, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec(
                    (
                        prop_oneof![
                            Just("type".to_string()),
                            Just("text".to_string()),
                            Just("content".to_string()),
                            Just("role".to_string()),
                            Just("parts".to_string()),
                            Just("image_url".to_string()),
                            Just("source".to_string()),
                            Just("input".to_string()),
                            Just("function".to_string()),
                            "[a-z]{1,6}"
                        ],
                        inner
                    ),
                    0..6
                )
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn any_shape_is_counted_without_panic(v in any_json(), api in 0usize..5) {
            let api = [Api::OpenAiChat, Api::OpenAiResponses, Api::Anthropic, Api::Gemini, Api::Ollama][api];
            let e = Estimator::new(1 << 16);
            for field in ["messages", "input", "contents", "system", "tools"] {
                let mut body = json!({});
                body[field] = json!([v.clone()]);
                let a = e.estimate_body(api, body.to_string().as_bytes(), None);
                prop_assert!(a.is_some());
                // Cached and uncached answers agree.
                let b = e.estimate_body(api, body.to_string().as_bytes(), None);
                prop_assert_eq!(a, b);
            }
        }

        #[test]
        fn sniffing_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..80)) {
            let _ = images::sniff_base64(&B64.encode(&bytes));
            let mut jpeg_like = vec![0xff, 0xd8];
            jpeg_like.extend(&bytes);
            let _ = images::sniff_base64(&B64.encode(&jpeg_like));
        }
    }
}

// ---- one table of counted fields --------------------------------------------

/// A value for a counted field, `text` in every place its kind of unit
/// reads text, `n` elements when it is an array.
fn field_value(per_element: bool, text: &str, n: usize) -> Value {
    if !per_element {
        return json!(text);
    }
    let el = json!({
        "role": "user",
        "content": text,
        "parts": [{"text": text}],
        "name": "t",
        "description": text,
        "function": {"name": "t", "description": text},
        "input_schema": {"type": "object"},
        "functionDeclarations": [{"name": "t", "description": text}],
    });
    Value::Array(vec![el; n])
}

/// The estimator and the session fingerprint read one table of counted
/// fields (`Provider::counted_fields`): changing any field in it changes
/// the estimate, and the fingerprint's content exactly when the field is
/// part of the conversation (system prompt or history, not tools); a field
/// outside it changes neither. A field one of them reads and the other does
/// not (Gemini's `system_instruction`, once) fails here.
#[test]
fn estimator_and_fingerprint_read_one_table_of_counted_fields() {
    use tidemark::provider::{Part, ALL};
    use tidemark::session::identity;
    let e = Estimator::new(1 << 20);
    for p in ALL {
        let api = p.api();
        let fields = p.counted_fields();
        // A request holds one history (Ollama: `messages` or `prompt`); the
        // fingerprint stops at its first user message.
        let body = |changed: Option<&str>, history: &str| {
            let mut m = serde_json::Map::new();
            m.insert("model".into(), json!("m"));
            m.insert("outside_the_table".into(), json!("x"));
            for f in fields {
                if f.part == Part::History && f.name != history {
                    continue;
                }
                let (text, n) = match changed {
                    Some(c) if c == f.name => ("a longer text than the other one", 2),
                    _ => ("short text", 1),
                };
                m.insert(f.name.into(), field_value(f.per_element, text, n));
            }
            if changed == Some("outside_the_table") {
                m.insert("outside_the_table".into(), json!("a longer text entirely"));
            }
            Value::Object(m).to_string()
        };
        let read = |b: &str| {
            let view = RequestView::parse(b.as_bytes()).expect("object");
            let est = e.estimate(*p, &view, Some("m")).tokens;
            (est, identity::content(*p, &view))
        };
        let histories: Vec<&str> = fields
            .iter()
            .filter(|f| f.part == Part::History)
            .map(|f| f.name)
            .collect();
        let (est0, content0) = read(&body(None, histories[0]));
        assert!(content0.is_some(), "{api:?}");
        for f in fields {
            let history = if f.part == Part::History {
                f.name
            } else {
                histories[0]
            };
            let (est0, content0) = read(&body(None, history));
            let (est, content) = read(&body(Some(f.name), history));
            assert!(est > est0, "{api:?} {}: the estimator reads it", f.name);
            assert_eq!(
                content != content0,
                f.part != Part::Other,
                "{api:?} {}: the fingerprint reads it as {:?}",
                f.name,
                f.part
            );
        }
        let (est, content) = read(&body(Some("outside_the_table"), histories[0]));
        assert_eq!(
            (est, content),
            (est0, content0),
            "{api:?}: neither reads it"
        );
    }
}
