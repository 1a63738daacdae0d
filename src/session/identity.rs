//! Who is asking, and which session a request belongs to (SPEC §4): the
//! credential, the session key and how it was found, and the content hashes
//! of where the conversation starts (the fingerprint and the lane).
//!
//! The agent identities are agent knowledge, kept here in one table
//! ([`AGENT_HEADERS`]), each with the agent and version it was seen from;
//! ids an agent puts in the body are API knowledge and live in the
//! provider files ([`Provider::agent_session_id`]).
use http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3;

use super::{Content, KeySource};
use crate::json::{Raw, RequestView};
use crate::provider::{Part, Provider};

/// Longest session key taken from a header or an agent's id; longer values are cut.
pub const MAX_SESSION_KEY: usize = 256;

/// Headers in which agents name their conversation of their own accord,
/// first found wins: (header, who sends it). Add one here when a capture
/// of a real agent's traffic shows it.
pub const AGENT_HEADERS: &[(&str, &str)] = &[
    // The same value across `claude -c` (resumed conversations).
    ("x-claude-code-session-id", "Claude Code 2.1"),
    // Codex CLI 0.169 (also sends `thread-id`, the same value, and the
    // same id as the Responses `prompt_cache_key`).
    ("session-id", "Codex CLI 0.169"),
    // The spelling other proxies accept for Codex CLI as well (not in a
    // capture here yet).
    ("session_id", "Codex CLI, other releases"),
];

/// A bit per length of the names in [`AGENT_HEADERS`]: most headers are
/// told apart from them by their length alone.
const AGENT_NAME_LENGTHS: u64 = {
    let mut bits = 0u64;
    let mut i = 0;
    while i < AGENT_HEADERS.len() {
        let len = AGENT_HEADERS[i].0.len();
        bits |= 1 << if len < 63 { len } else { 63 };
        i += 1;
    }
    bits
};

/// The member that Anthropic agents move to the newest message each turn:
/// left out of content hashes.
const MOVING_MARKER: &[u8] = b"cache_control";

/// The marker as a member name, searched for before any walk: most values
/// do not hold it and are hashed as they are.
static MARKER_NAME: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
    std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"cache_control\""));

/// First 8 hex of the SHA-256 of the credential the request carries, or `none`.
pub fn credential_hash(header: Option<&[u8]>, query: Option<&str>) -> String {
    let cred = header.or_else(|| {
        query.and_then(|q| {
            q.split('&')
                .find_map(|kv| kv.strip_prefix("key=").map(str::as_bytes))
        })
    });
    match cred {
        Some(c) if !c.is_empty() => known_credential_hash(c),
        _ => "none".to_string(),
    }
}

/// What a request's headers say about who is asking: the credential (the
/// first of `authorization`, `x-api-key`, `x-goog-api-key`, `api-key`
/// present), the first `--session-header` present with a usable value,
/// the first of [`AGENT_HEADERS`] present with one, and `x-context-reset:
/// 1`. Found in one pass over the headers: a `HeaderMap::get` of a name
/// outside http's own set hashes the name, and these had been five such
/// lookups a request. Of a name sent twice, the first value counts, as
/// `get` gives it.
#[derive(Default)]
pub struct Asking<'a> {
    pub credential: Option<&'a [u8]>,
    pub session: Option<&'a str>,
    pub agent: Option<&'a str>,
    pub reset: bool,
}

/// A header value that can name a session: text, not blank.
fn usable(v: &http::HeaderValue) -> Option<&str> {
    v.to_str().ok().map(str::trim).filter(|v| !v.is_empty())
}

pub fn asking<'a>(headers: &'a HeaderMap, session_headers: &[HeaderName]) -> Asking<'a> {
    let mut a = Asking::default();
    // Ranks taken so far (lower wins); names whose first value was seen.
    let (mut credential_rank, mut session_rank, mut agent_rank) =
        (usize::MAX, usize::MAX, usize::MAX);
    let (mut reset_seen, mut session_seen, mut agent_seen) = (false, 0u64, 0u64);
    for (name, value) in headers {
        let rank = match name.as_str() {
            "authorization" => 0,
            "x-api-key" => 1,
            "x-goog-api-key" => 2,
            "api-key" => 3,
            "x-context-reset" => {
                if !reset_seen {
                    reset_seen = true;
                    a.reset = value.as_bytes().trim_ascii() == b"1";
                }
                usize::MAX
            }
            _ => usize::MAX,
        };
        if rank < credential_rank {
            credential_rank = rank;
            a.credential = Some(value.as_bytes());
        }
        for (k, h) in session_headers.iter().enumerate().take(64) {
            if k >= session_rank || h != name || session_seen >> k & 1 == 1 {
                continue;
            }
            session_seen |= 1 << k;
            if let Some(v) = usable(value) {
                session_rank = k;
                a.session = Some(v);
            }
        }
        let agent = match AGENT_NAME_LENGTHS >> name.as_str().len().min(63) & 1 {
            1 => AGENT_HEADERS.iter().position(|(n, _)| *n == name.as_str()),
            _ => None,
        };
        if let Some(k) = agent {
            if k < agent_rank && agent_seen >> k & 1 == 0 {
                agent_seen |= 1 << k;
                if let Some(v) = usable(value) {
                    agent_rank = k;
                    a.agent = Some(v);
                }
            }
        }
    }
    a
}

/// The SHA-256 prefix of a credential, made once per credential on each
/// worker thread: an agent sends the same key on every request, so its
/// SHA-256 is made once per thread, not once per request. The cache holds
/// no credential, only an xxh3-128 of it under a per-process random seed
/// (so no two credentials can be made to meet without knowing both), and
/// at most 256 of them.
fn known_credential_hash(c: &[u8]) -> String {
    use std::cell::RefCell;
    use std::sync::OnceLock;
    static SEED: OnceLock<u64> = OnceLock::new();
    thread_local! {
        static KNOWN: RefCell<foldhash::HashMap<u128, [u8; 4]>> = RefCell::default();
    }
    let seed = *SEED.get_or_init(|| {
        use std::hash::BuildHasher;
        std::collections::hash_map::RandomState::new().hash_one(0u8)
    });
    let id = xxhash_rust::xxh3::xxh3_128_with_seed(c, seed);
    KNOWN.with_borrow_mut(|known| {
        let prefix = *known.entry(id).or_insert_with(|| {
            let digest = Sha256::digest(c);
            [digest[0], digest[1], digest[2], digest[3]]
        });
        if known.len() > 256 {
            known.clear();
        }
        crate::session::hex(&prefix)
    })
}

/// How a request names its session, by SPEC §4's precedence, short of the
/// `previous_response_id` chain (the store follows that, knowing its
/// links): a `--session-header`; unless `agent_ids` is off, an id the
/// agent sent of its own accord (a header of [`AGENT_HEADERS`], then one in
/// the body); unless `fingerprint` is off, `fp:` + a hash of (credential,
/// API, content of the system prompt and the first user message). `None`:
/// nothing names it.
pub fn session_key(
    asked: &Asking<'_>,
    agent_ids: bool,
    fingerprint: bool,
    p: &dyn Provider,
    view: &RequestView<'_>,
    credential: &str,
    content: &mut ContentOnce,
) -> (Option<String>, KeySource) {
    if let Some(v) = asked.session {
        return (Some(capped(v)), KeySource::Header);
    }
    if agent_ids {
        if let Some(v) = asked.agent {
            return (Some(capped(v)), KeySource::Agent);
        }
        if let Some(v) = p.agent_session_id(view) {
            return (Some(capped(&v)), KeySource::Agent);
        }
    }
    let key = match fingerprint {
        true => content
            .get(p, view)
            .map(|c| fingerprint_key(credential, p, c)),
        false => None,
    };
    (key, KeySource::Fingerprint)
}

/// A request's [`content`], worked out when first asked for.
#[derive(Default)]
pub struct ContentOnce(Option<Option<Content>>);

impl ContentOnce {
    pub fn get(&mut self, p: &dyn Provider, view: &RequestView<'_>) -> Option<Content> {
        *self.0.get_or_insert_with(|| content(p, view))
    }
}

/// At most [`MAX_SESSION_KEY`] bytes, cut at a character boundary.
fn capped(v: &str) -> String {
    let mut end = v.len().min(MAX_SESSION_KEY);
    while !v.is_char_boundary(end) {
        end -= 1;
    }
    v[..end].to_string()
}

/// `fp:` + 16 hex of a hash of (credential, API, content).
///
/// xxh3, not SHA-256: the fingerprint names a session, it hides nothing
/// (the credential in it is already its hash), and its content hashes run
/// over the system prompt on every request. Fixed seed: replicas sharing
/// --state redis must agree. Sessions of different credentials are apart
/// whatever the hash, so a crafted collision reaches only the sender's own
/// credential's sessions, which a session header reaches anyway.
fn fingerprint_key(credential: &str, p: &dyn Provider, c: Content) -> String {
    // One shot over a buffer on the stack: a streaming hasher's state is
    // more to set up than these few bytes are to hash.
    let api = p.api().as_str().as_bytes();
    let cred = credential.as_bytes();
    let mut buf = [0u8; 128];
    let n = cred.len() + api.len() + 18;
    let h = match buf.get_mut(..n) {
        Some(b) => {
            let (c_part, rest) = b.split_at_mut(cred.len());
            c_part.copy_from_slice(cred);
            let (a_part, rest) = rest[1..].split_at_mut(api.len());
            a_part.copy_from_slice(api);
            rest[1..9].copy_from_slice(&c.system.to_le_bytes());
            rest[9..17].copy_from_slice(&c.first.to_le_bytes());
            xxhash_rust::xxh3::xxh3_128(b)
        }
        // A credential of over a hundred bytes: never one of ours (it is
        // a hash), but hashed the same way.
        None => {
            let mut h = Xxh3::new();
            h.update(cred);
            h.update(&[0]);
            h.update(api);
            h.update(&[0]);
            h.update(&c.system.to_le_bytes());
            h.update(&c.first.to_le_bytes());
            h.digest128()
        }
    };
    let mut key = String::with_capacity(19);
    key.push_str("fp:");
    super::push_hex(&mut key, &h.to_be_bytes()[..8]);
    key
}

/// Content hashes of where the conversation starts: the system prompt
/// (with the messages before the first user message) and the first user
/// message, by the provider's table of counted fields. The
/// `cache_control` markers that agents move from turn to turn are left
/// out, and a long history is not hashed past its first user message.
/// `None`: the request holds neither.
pub fn content(p: &dyn Provider, view: &RequestView<'_>) -> Option<Content> {
    // One hasher: the system prompt comes first in every API's table, so
    // it is done (digested) when the first message starts.
    let mut h = Xxh3::new();
    let mut any = false;
    let mut system = None;
    'fields: for f in p.counted_fields() {
        let Some(raw) = view.raw(f.name) else {
            continue;
        };
        if f.part == Part::Other {
            continue;
        }
        any = true;
        if f.part == Part::System {
            h.update(f.name.as_bytes());
            h.update(&[0]);
            feed(&mut h, raw);
            continue;
        }
        let Some(elements) = view.elements(f.name).filter(|_| f.per_element) else {
            // A string input, a prompt: the first message itself.
            system = Some(h.digest());
            h.reset();
            feed(&mut h, raw);
            break;
        };
        for e in elements {
            if is_user_message(e.get()) {
                system = Some(h.digest());
                h.reset();
                feed(&mut h, *e);
                break 'fields;
            }
            h.update(&[0]);
            feed(&mut h, *e);
        }
    }
    if !any {
        return None;
    }
    Some(match system {
        Some(system) => Content {
            system,
            first: h.digest(),
        },
        // No first user message: all of it is where the conversation starts.
        None => Content {
            system: h.digest(),
            first: 0,
        },
    })
}

/// A value's content into `h` ([`crate::json::content`]); its raw bytes if
/// it cannot be stepped through.
/// A value's content without its moving markers into `buf`, when it has
/// any (false: its raw bytes are its content, `buf` untouched).
pub(super) fn content_without_markers(raw: Raw<'_>, buf: &mut Vec<u8>) -> bool {
    let b = raw.get().as_bytes();
    if MARKER_NAME.find(b).is_none() {
        return false;
    }
    buf.clear();
    crate::json::content(b, MOVING_MARKER, &mut |run: &[u8]| {
        buf.extend_from_slice(run)
    })
    .is_some()
}

fn feed(h: &mut Xxh3, raw: Raw<'_>) {
    let b = raw.get().as_bytes();
    if MARKER_NAME.find(b).is_none()
        || crate::json::content(b, MOVING_MARKER, &mut |run: &[u8]| h.update(run)).is_none()
    {
        h.update(b);
    }
}

pub(crate) fn is_user_message(raw: &str) -> bool {
    if let Some(user) = leading_role_is_user(raw.as_bytes()) {
        return user;
    }
    #[derive(serde::Deserialize)]
    struct Role<'a> {
        #[serde(borrow)]
        role: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_str::<Role>(raw)
        .ok()
        .and_then(|r| r.role)
        .is_some_and(|r| r == "user")
}

/// Whether a message whose first member is `"role"` is the user's: most
/// open that way, and the role decides it without parsing the rest (the
/// message's whole content). Read byte by byte: JSON's whitespace is
/// ASCII, so str's Unicode-aware trims are not needed, and this runs on
/// every message. `None`: another first member, or a role with an escape, which
/// only a parse reads right.
fn leading_role_is_user(b: &[u8]) -> Option<bool> {
    let mut i = 0;
    // Past whitespace, then past `token`, if it is there.
    let mut past = |token: &[u8]| {
        while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            i += 1;
        }
        b[i..].starts_with(token).then(|| i += token.len())
    };
    past(b"{")?;
    past(b"\"role\"")?;
    past(b":")?;
    past(b"\"")?;
    let role = &b[i..];
    if role.starts_with(b"user\"") {
        return Some(true);
    }
    let end = memchr::memchr2(b'"', b'\\', role)?;
    (role[end] == b'"').then_some(false)
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    const X_CONTEXT_RESET: HeaderName = HeaderName::from_static("x-context-reset");

    #[test]
    fn user_message_from_first_member_or_parse() {
        assert!(is_user_message(r#"{"role":"user","content":"hi"}"#));
        assert!(is_user_message(r#"{ "role" : "user" }"#));
        assert!(!is_user_message(
            r#"{"role":"system","content":"\"role\":\"user\""}"#
        ));
        // Not first, or escaped: the full parse decides.
        assert!(is_user_message(r#"{"content":"x","role":"user"}"#));
        assert!(!is_user_message(
            r#"{"content":"{\"role\":\"user\"}","role":"tool"}"#
        ));
        assert!(is_user_message(r#"{"role":"us\u0065r"}"#));
        assert!(!is_user_message(r#"{"type":"function_call"}"#));
        assert!(is_user_message("{\r\n\t \"role\" \n:\t\"user\" }"));
        assert!(!is_user_message(r#"{"role":"users"}"#));
        assert!(!is_user_message(r#"{"role":"use"}"#));
        assert!(!is_user_message(r#"{"role":"user\"x"}"#));
        assert!(!is_user_message(
            r#"{"role":"assistant","x":"\"role\":\"user\""}"#
        ));
        assert!(!is_user_message(r#"{"role":"#));
        assert!(!is_user_message(""));
    }

    #[test]
    fn credential_hash_is_the_sha256_prefix_first_time_and_after() {
        // Past the cache's 256 entries and round again: every answer is
        // the SHA-256 prefix, whether made now or remembered.
        for round in 0..2 {
            for i in 0..300 {
                let c = format!("Bearer sk-test-{i}");
                let want = crate::session::hex(&Sha256::digest(c.as_bytes())[..4]);
                let mut h = HeaderMap::new();
                h.insert(http::header::AUTHORIZATION, c.parse().unwrap());
                let cred = asking(&h, &[]).credential;
                assert_eq!(credential_hash(cred, None), want, "round {round}, {c}");
                assert_eq!(
                    credential_hash(cred, None),
                    want,
                    "round {round}, {c} again"
                );
            }
        }
        assert_eq!(credential_hash(None, Some("a=1&key=k")), {
            crate::session::hex(&Sha256::digest(b"k")[..4])
        });
        assert_eq!(credential_hash(None, None), "none");
    }

    /// The one pass over the headers finds what a `get` per name found:
    /// the credential by the names' order, the first session header with a
    /// usable value, the reset flag; a name's first value, whatever the
    /// order the headers came in.
    #[test]
    fn one_pass_over_the_headers_reads_as_a_get_per_name() {
        let names = ["authorization", "x-api-key", "x-goog-api-key", "api-key"];
        let session_headers = [
            HeaderName::from_static("x-session-id"),
            HeaderName::from_static("x-conversation"),
        ];
        let reference = |h: &HeaderMap| {
            let credential = names
                .iter()
                .find_map(|n| h.get(*n).map(HeaderValue::as_bytes).map(<[u8]>::to_vec));
            let session = session_headers.iter().find_map(|n| {
                let v = h.get(n)?.to_str().ok()?.trim();
                (!v.is_empty()).then(|| v.to_string())
            });
            let reset = h
                .get(X_CONTEXT_RESET)
                .is_some_and(|v| v.as_bytes().trim_ascii() == b"1");
            let agent = AGENT_HEADERS.iter().find_map(|(n, _)| {
                let v = h.get(*n)?.to_str().ok()?.trim();
                (!v.is_empty()).then(|| v.to_string())
            });
            (credential, session, agent, reset)
        };
        // Every subset, in two orders, of headers that compete.
        let pool: [(&str, &[u8]); 15] = [
            ("x-api-key", b"k-one"),
            ("authorization", b"Bearer a"),
            ("api-key", b""),
            ("x-goog-api-key", b"g"),
            ("x-conversation", b" conv "),
            ("x-session-id", b"  "),
            ("x-session-id", b"sess-2"),
            ("x-conversation", b"\xff"),
            ("x-context-reset", b" 1 "),
            ("x-context-reset", b"0"),
            ("authorization", b"Bearer second"),
            ("content-type", b"application/json"),
            ("session-id", b" "),
            ("x-claude-code-session-id", b"cc-1"),
            ("session-id", b"codex-1"),
        ];
        let mut checked = 0;
        for mask in 0u32..1 << pool.len() {
            for reversed in [false, true] {
                let mut h = HeaderMap::new();
                let mut picked: Vec<_> = (0..pool.len()).filter(|i| mask >> i & 1 == 1).collect();
                if reversed {
                    picked.reverse();
                }
                for i in picked {
                    let (n, v) = pool[i];
                    let v = HeaderValue::from_bytes(v).unwrap();
                    h.append(HeaderName::from_static(n), v);
                }
                let a = asking(&h, &session_headers);
                let got = (
                    a.credential.map(<[u8]>::to_vec),
                    a.session.map(str::to_string),
                    a.agent.map(str::to_string),
                    a.reset,
                );
                assert_eq!(got, reference(&h), "{h:?}");
                checked += 1;
            }
        }
        assert_eq!(checked, 2 << 15);
    }
}

#[cfg(test)]
mod content_tests {
    use super::*;
    use crate::provider::Api;

    fn of(api: Api, body: &str) -> Option<Content> {
        content(
            api.provider(),
            &RequestView::parse(body.as_bytes()).unwrap(),
        )
    }

    #[test]
    fn content_ignores_markers_tools_and_what_follows_the_first_message() {
        let a = of(
            Api::Anthropic,
            r#"{"model":"m","system":[{"type":"text","text":"S","cache_control":{"type":"ephemeral"}}],"tools":[{"name":"t"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}]}"#,
        );
        let b = of(
            Api::Anthropic,
            r#"{"system":[{"type":"text","text":"S"}],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]},{"role":"assistant","content":[{"type":"text","text":"more","cache_control":{"type":"ephemeral"}}]}],"tools":[]}"#,
        );
        assert!(a.is_some());
        assert_eq!(a, b);
        let other_first = of(
            Api::Anthropic,
            r#"{"system":[{"type":"text","text":"S"}],"messages":[{"role":"user","content":"bye"}]}"#,
        )
        .unwrap();
        assert_eq!(other_first.system, a.unwrap().system);
        assert_ne!(other_first.first, a.unwrap().first);
    }

    #[test]
    fn system_messages_before_the_first_user_message_are_the_system_prompt() {
        let chat = |sys: &str, first: &str| {
            of(
                Api::OpenAiChat,
                &format!(
                    r#"{{"messages":[{{"role":"system","content":"{sys}"}},{{"role":"user","content":"{first}"}}]}}"#
                ),
            )
            .unwrap()
        };
        assert_eq!(chat("A", "x").system, chat("A", "y").system);
        assert_ne!(chat("A", "x").system, chat("B", "x").system);
        assert_eq!(chat("A", "x").first, chat("B", "x").first);
        // Responses `input` as a string is the first message itself.
        let r = |i: &str| {
            of(
                Api::OpenAiResponses,
                &format!(r#"{{"instructions":"I","input":"{i}"}}"#),
            )
            .unwrap()
        };
        assert_eq!(r("a").system, r("b").system);
        assert_ne!(r("a").first, r("b").first);
        // Nothing countable: no content.
        assert_eq!(of(Api::OpenAiChat, r#"{"model":"m"}"#), None);
        // No user message at all: the whole start is the system part.
        let only = of(
            Api::OpenAiChat,
            r#"{"messages":[{"role":"system","content":"s"}]}"#,
        )
        .unwrap();
        assert_eq!(only.first, 0);
    }
}

#[cfg(test)]
mod fingerprint_tests {
    use super::*;
    use crate::provider::Api;

    /// The buffer and the streaming hasher agree, so a long credential
    /// (never one of tidemark's own hashes) is keyed the same way.
    #[test]
    fn both_ways_of_hashing_the_fingerprint_agree() {
        let c = Content {
            system: 0x0123_4567_89ab_cdef,
            first: 42,
        };
        let p = Api::Anthropic.provider();
        for cred in ["none", "cafebabe", &"x".repeat(100), &"y".repeat(200)] {
            let mut h = Xxh3::new();
            h.update(cred.as_bytes());
            h.update(&[0]);
            h.update(p.api().as_str().as_bytes());
            h.update(&[0]);
            h.update(&c.system.to_le_bytes());
            h.update(&c.first.to_le_bytes());
            let mut want = String::from("fp:");
            crate::session::push_hex(&mut want, &h.digest128().to_be_bytes()[..8]);
            assert_eq!(fingerprint_key(cred, p, c), want, "{}", cred.len());
        }
    }
}
