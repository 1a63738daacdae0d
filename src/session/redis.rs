//! Shared session state in Redis (`--state redis://host:port/db`, `rediss://`):
//! one pipelined round trip per request, compare-and-set stores per lane,
//! and an outage that is loud once and never stops the proxy.
//!
//! [`Shared`] is the store the spine sees: it keeps this replica's own copy
//! of its sessions ([`Sessions`]), takes in what Redis holds before a
//! request is projected, and writes back what the response changed.
//! [`RedisState`] is the backend underneath it.
//!
//! # Keys
//!
//! Every key of one session carries the session id (`credential:key`) in a
//! hash tag, so a Redis Cluster keeps them on one slot and the Lua scripts
//! may touch them together:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `tidemark:v2:{SID}:seq` | string | the session's request counter: one global order across replicas |
//! | `tidemark:v2:{SID}:rec` | hash | per lane `l:<lane>` its record and `s:<lane>` the sequence it was stored at; `m` the session's own fields and `ms` their sequence; `del` a `DELETE`'s tombstone; `top` the highest sequence stored |
//! | `tidemark:v2:{SID}:spend` | hash | `i`, `c`, `o`: cumulative input, cached input and output tokens; `t` turns; `k` compactions |
//! | `tidemark:v2:model:{MODEL}` | hash | per-model calibration fields (`cold`, `marginal`, and `c:<class>` per content class) |
//! | `tidemark:v2:sessions` | sorted set | session ids by when they were last written: `/sessions` |
//! | `tidemark:v2:key:{KEY}` | sorted set | the credentials a key is held under, by when: `/sessions/{key}` |
//!
//! Session keys expire after the session TTL of inactivity; model keys after
//! [`MODEL_TTL`]. Ids longer than [`MAX_ID_BYTES`] are replaced by their SHA-256.
//!
//! # Monotonic, per lane
//!
//! [`RedisState::begin`] hands out the next sequence, never at or below the
//! highest one stored (so a counter lost to an expiry or a Redis restart
//! cannot go back under a record that survived or was re-stored by a request
//! in flight); [`RedisState::store`] writes a lane only at a sequence above
//! the one that lane was stored at, and above a `DELETE`'s tombstone. An
//! older request never overwrites a newer one's lane, and a request in lane
//! B never discards lane A: each lane has its own compare-and-set, while
//! spend and turns are increments summed over the session.
//!
//! # Outages
//!
//! Every operation is bounded by [`OP_TIMEOUT`]. A connection error, or
//! [`SLOW_OUTAGE`] timeouts in a row, start an outage: one WARN, and the
//! backend is unhealthy; from then on
//! operations fail at once (the caller falls back to local state) while one
//! background probe PINGs every [`PROBE_INTERVAL`] until Redis answers, then
//! logs one INFO `state backend recovered`. Each failed operation counts in
//! `tidemark_state_backend_errors_total`.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script, Value};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;

use super::lane::{api_name, Lane, Session, MAX_LANES};
use super::memory::SharedView;
use super::{
    Beginning, Begun, KeySource, Outcome, Pending, RequestFacts, SessionConfig, Sessions, Ticket,
};
use crate::estimate::{Class, CLASSES};
use crate::provider::Api;

/// Bound on one operation on the hot path, connection wait included.
pub const OP_TIMEOUT: Duration = Duration::from_millis(100);
/// Timeouts in a row that make an outage; a connection error makes one at once.
pub const SLOW_OUTAGE: u32 = 3;
/// Pause between two PINGs of the background probe during an outage.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(200);
/// Bound on one TCP (and TLS) connect to Redis.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);
/// How long per-model calibration outlives its last update: it is learned
/// across sessions, so it should outlive them.
pub const MODEL_TTL: Duration = Duration::from_secs(30 * 24 * 3600);
/// Session ids and model names longer than this are keyed by their SHA-256,
/// so a client-controlled string cannot make a huge key.
pub const MAX_ID_BYTES: usize = 256;
/// Sessions one `/sessions` listing reads from Redis at most.
const MAX_LISTED: usize = 10_000;
/// Sessions read per round trip when listing.
const LIST_BATCH: usize = 128;

/// Hot-path script: next sequence (kept above the highest stored), the
/// session's record and its totals; refreshes the session TTL on all three keys.
const BEGIN_LUA: &str = r#"
local seq = redis.call('INCR', KEYS[1])
local top = tonumber(redis.call('HGET', KEYS[2], 'top')) or 0
if seq <= top then
  seq = top + 1
  redis.call('SET', KEYS[1], string.format('%d', seq))
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
return {seq, redis.call('HGETALL', KEYS[2]), redis.call('HMGET', KEYS[3], 'i', 'c', 'o', 't', 'k')}
"#;

/// A response's write-back: its lane if its sequence is above that lane's
/// and any tombstone (compare-and-set), the session's fields if above
/// theirs, its tokens, turn and compaction added; at most ARGV[11] lanes,
/// the least recently stored going first; the counter kept at or above it.
/// Returns whether the lane was stored.
const STORE_LUA: &str = r#"
local s = tonumber(ARGV[1])
local del = tonumber(redis.call('HGET', KEYS[1], 'del')) or 0
local stored = 0
if ARGV[2] ~= '' and s > del then
  local cur = tonumber(redis.call('HGET', KEYS[1], 's:' .. ARGV[2])) or 0
  if s > cur then
    redis.call('HSET', KEYS[1], 's:' .. ARGV[2], ARGV[1], 'l:' .. ARGV[2], ARGV[3])
    stored = 1
  end
end
local ms = tonumber(redis.call('HGET', KEYS[1], 'ms')) or 0
if s > ms then redis.call('HSET', KEYS[1], 'ms', ARGV[1], 'm', ARGV[4]) end
local top = tonumber(redis.call('HGET', KEYS[1], 'top')) or 0
if s > top then redis.call('HSET', KEYS[1], 'top', ARGV[1]) end
local cap = tonumber(ARGV[11])
if redis.call('HLEN', KEYS[1]) > 2 * cap + 4 then
  local all = redis.call('HGETALL', KEYS[1])
  local lanes = {}
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 's:' then
      table.insert(lanes, {tonumber(all[i + 1]) or 0, string.sub(all[i], 3)})
    end
  end
  table.sort(lanes, function(a, b) return a[1] < b[1] end)
  for i = 1, #lanes - cap do
    redis.call('HDEL', KEYS[1], 's:' .. lanes[i][2], 'l:' .. lanes[i][2])
  end
end
local fields = {'i', 'c', 'o', 't', 'k'}
for j = 1, 5 do
  if ARGV[5 + j] ~= '0' then redis.call('HINCRBY', KEYS[3], fields[j], ARGV[5 + j]) end
end
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
local c = tonumber(redis.call('GET', KEYS[2])) or 0
if c < s then redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[5]) end
return stored
"#;

/// `DELETE /sessions/{key}`: a tombstone at the newest sequence handed out,
/// so a request begun before it cannot bring an anchor back, and every
/// lane stored before it is read without its anchor. Lanes keep their
/// calibration, the totals keep counting. Returns {tombstone, whether the
/// session had a record}.
const DELETE_LUA: &str = r#"
local existed = redis.call('HEXISTS', KEYS[2], 'm')
local c = redis.call('INCR', KEYS[1])
local top = tonumber(redis.call('HGET', KEYS[2], 'top')) or 0
if c <= top then
  c = top + 1
  redis.call('SET', KEYS[1], string.format('%d', c))
end
redis.call('HSET', KEYS[2], 'del', string.format('%d', c), 'top', string.format('%d', c))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return {c, existed}
"#;

/// Exponentially weighted mean of one calibration field, shared by replicas.
const LEARN_LUA: &str = r#"
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]))
local s = tonumber(ARGV[2])
local v = s
if old then v = old + tonumber(ARGV[3]) * (s - old) end
local out = string.format('%.17g', v)
redis.call('HSET', KEYS[1], ARGV[1], out)
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return out
"#;

/// Why a state operation did not happen. The caller falls back to local state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateError {
    /// The backend is in an outage; the operation was not attempted.
    Unavailable,
    /// No answer within [`OP_TIMEOUT`].
    Timeout,
    /// Redis answered with an error, or the connection failed. The text holds
    /// no key content and no credentials.
    Redis(String),
    /// Redis answered something the scripts never return.
    Protocol(&'static str),
    /// The caller passed a value that cannot be stored (a non-finite ratio).
    Invalid(&'static str),
}

impl std::fmt::Display for StateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateError::Unavailable => f.write_str("state backend unavailable"),
            StateError::Timeout => write!(f, "state backend timed out after {OP_TIMEOUT:?}"),
            StateError::Redis(e) => write!(f, "state backend error: {e}"),
            StateError::Protocol(e) => write!(f, "state backend protocol error: {e}"),
            StateError::Invalid(e) => write!(f, "state backend: invalid value: {e}"),
        }
    }
}

impl std::error::Error for StateError {}

/// A session's totals, summed over every replica: increments, not a
/// compare-and-set, so none is lost to a race.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    /// Real prompt tokens, cached included.
    pub input: u64,
    pub cached_input: u64,
    pub output: u64,
    /// 2xx responses.
    pub turns: u64,
    /// Compactions detected.
    pub compactions: u64,
}

/// Calibration learned across sessions for one model (see `lane.rs`'s
/// `ModelCal`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ModelCalibration {
    /// real/estimate of anchor-less requests (overhead included).
    pub cold: Option<f64>,
    /// Marginal ratio of new content.
    pub marginal: Option<f64>,
    /// Marginal ratio of each content class.
    pub classes: [Option<f64>; CLASSES],
}

/// Which [`ModelCalibration`] field an observation feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalField {
    Cold,
    Marginal,
    Class(Class),
}

impl CalField {
    fn as_str(self) -> &'static str {
        match self {
            CalField::Cold => "cold",
            CalField::Marginal => "marginal",
            CalField::Class(c) => class_field(c),
        }
    }
}

/// A content class's field in the model's hash.
fn class_field(c: Class) -> &'static str {
    match c {
        Class::Prose => "c:prose",
        Class::Code => "c:code",
        Class::Json => "c:json",
        Class::Escaped => "c:escaped",
        Class::Binary => "c:binary",
        Class::Han => "c:han",
        Class::Kana => "c:kana",
        Class::Hangul => "c:hangul",
        Class::Script => "c:script",
        Class::Emoji => "c:emoji",
        Class::Media => "c:media",
        Class::Framing => "c:framing",
    }
}

/// What Redis holds of one session's record, as bytes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stored {
    /// The session's own fields, if any response was stored.
    pub meta: Option<Vec<u8>>,
    /// Each lane: (lane field name, the sequence it was stored at, its record).
    pub lanes: Vec<(String, u64, Vec<u8>)>,
    /// A `DELETE`'s tombstone sequence; 0 if none.
    pub deleted: u64,
    /// The highest sequence stored (or tombstone).
    pub top: u64,
    pub totals: Totals,
}

/// What a request learns from Redis before it is projected.
#[derive(Debug, Clone, PartialEq)]
pub struct Begin {
    /// This request's place in the session's global order: pass it to
    /// [`RedisState::store`]. Always above `stored.top`.
    pub seq: u64,
    pub stored: Stored,
    /// Empty when `begin` was given no model.
    pub model: ModelCalibration,
    /// The window an upstream taught for the model, when asked for.
    pub window: Option<u64>,
}

/// What one response changes in Redis ([`RedisState::store`]).
#[derive(Debug, Clone, Default)]
pub struct Write<'a> {
    /// The lane's field name ([`super::lane_hex`]) and record, if any.
    pub lane: Option<(&'a str, &'a [u8])>,
    /// The session's own fields.
    pub meta: &'a [u8],
    /// Added to the session's totals.
    pub add: Totals,
    /// The session key and credential, for the listing indexes.
    pub key: &'a str,
    pub credential: &'a str,
}

/// A Redis state backend. Cheap to clone: clones share one multiplexed,
/// reconnecting connection and one health state.
#[derive(Clone)]
pub struct RedisState {
    inner: Arc<Inner>,
}

struct Inner {
    client: redis::Client,
    conn: OnceCell<ConnectionManager>,
    ttl_ms: u64,
    /// Redis answered the last operation; false during an outage and until
    /// the first PING answers.
    healthy: AtomicBool,
    /// The current outage has been logged (one WARN per outage).
    warned: AtomicBool,
    /// A non-connection error has been logged (a misconfigured server fails
    /// every request; say so once, not per request).
    warned_reply: AtomicBool,
    /// One background probe at a time.
    probing: AtomicBool,
    /// Operations in a row that timed out.
    slow: AtomicU32,
    /// `host:port/db`, for logs: never the password.
    target: String,
    begin: Script,
    store: Script,
    delete: Script,
    learn: Script,
}

impl std::fmt::Debug for RedisState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisState")
            .field("target", &self.inner.target)
            .field("healthy", &self.healthy())
            .finish()
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// The id as a key part: itself, or its SHA-256 if it is long.
fn id_part(id: &str) -> std::borrow::Cow<'_, str> {
    if id.len() <= MAX_ID_BYTES {
        return id.into();
    }
    format!("h:{}", super::hex(&Sha256::digest(id.as_bytes()))).into()
}

/// The three keys of one session: counter, record, totals.
fn session_keys(session_id: &str) -> [String; 3] {
    let id = id_part(session_id);
    [
        format!("tidemark:v2:{{{id}}}:seq"),
        format!("tidemark:v2:{{{id}}}:rec"),
        format!("tidemark:v2:{{{id}}}:spend"),
    ]
}

fn model_key(model: &str) -> String {
    format!("tidemark:v2:model:{{{}}}", id_part(model))
}

/// The field of a model's hash that holds the window `upstream` taught.
fn window_field(upstream: &str) -> String {
    format!("w:{}", id_part(upstream))
}

/// Every session id, by when it was last written.
const SESSIONS_INDEX: &str = "tidemark:v2:sessions";

/// The credentials a session key is held under, by when.
fn key_index(key: &str) -> String {
    format!("tidemark:v2:key:{{{}}}", id_part(key))
}

/// The shared backend's id of a session: the credential hash and the key.
pub fn session_id(credential: &str, key: &str) -> String {
    format!("{credential}:{key}")
}

/// A connection-level failure (the outage kind), as opposed to an error reply.
fn is_outage(e: &RedisError) -> bool {
    e.is_io_error()
        || e.is_connection_refusal()
        || e.is_connection_dropped()
        || e.is_timeout()
        || e.is_unrecoverable_error()
}

/// Error text without any argument of the command: the redis crate's
/// messages name the error kind and the server's reply, not our keys.
fn describe(e: &RedisError) -> String {
    let mut s = e.to_string();
    s.truncate(200);
    s
}

fn u64_of(v: &Value) -> Result<u64, StateError> {
    match v {
        Value::Nil => Ok(0),
        Value::Int(i) => u64::try_from(*i).map_err(|_| StateError::Protocol("negative integer")),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or(StateError::Protocol("not an unsigned integer")),
        _ => Err(StateError::Protocol("expected an integer")),
    }
}

fn f64_of(v: &Value) -> Result<Option<f64>, StateError> {
    match v {
        Value::Nil => Ok(None),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<f64>().ok())
            .filter(|f| f.is_finite())
            .map(Some)
            .ok_or(StateError::Protocol("not a number")),
        _ => Err(StateError::Protocol("expected a number")),
    }
}

fn bytes_of(v: &Value) -> Result<&[u8], StateError> {
    match v {
        Value::BulkString(b) => Ok(b),
        Value::SimpleString(s) => Ok(s.as_bytes()),
        _ => Err(StateError::Protocol("expected bytes")),
    }
}

/// A record hash (HGETALL, a flat list or a RESP3 map) and its totals.
fn parse_stored(rec: &Value, totals: &Value) -> Result<Stored, StateError> {
    let pairs: Vec<(&Value, &Value)> = match rec {
        Value::Array(items) => items.chunks_exact(2).map(|p| (&p[0], &p[1])).collect(),
        Value::Map(m) => m.iter().map(|(k, v)| (k, v)).collect(),
        Value::Nil => Vec::new(),
        _ => return Err(StateError::Protocol("record: expected a hash")),
    };
    let mut st = Stored::default();
    let mut seqs: Vec<(&[u8], u64)> = Vec::new();
    let mut lanes: Vec<(&[u8], &[u8])> = Vec::new();
    for (k, v) in pairs {
        let k = bytes_of(k)?;
        match k {
            b"m" => st.meta = Some(bytes_of(v)?.to_vec()),
            b"del" => st.deleted = u64_of(v)?,
            b"top" => st.top = u64_of(v)?,
            b"ms" => {}
            _ if k.starts_with(b"s:") => seqs.push((&k[2..], u64_of(v)?)),
            _ if k.starts_with(b"l:") => lanes.push((&k[2..], bytes_of(v)?)),
            _ => {}
        }
    }
    for (name, record) in lanes {
        let seq = seqs.iter().find(|(n, _)| *n == name).map_or(0, |(_, s)| *s);
        let name = String::from_utf8_lossy(name).into_owned();
        st.lanes.push((name, seq, record.to_vec()));
    }
    let field = |items: &[Value], i: usize| items.get(i).map(u64_of).unwrap_or(Ok(0));
    st.totals = match totals {
        Value::Array(items) => Totals {
            input: field(items, 0)?,
            cached_input: field(items, 1)?,
            output: field(items, 2)?,
            turns: field(items, 3)?,
            compactions: field(items, 4)?,
        },
        Value::Nil => Totals::default(),
        _ => return Err(StateError::Protocol("totals: expected an array")),
    };
    Ok(st)
}

fn parse_begin(script: Value, model: Option<Value>) -> Result<Begin, StateError> {
    let mut window = None;
    let model = match model {
        Some(Value::Array(mut m)) if m.len() == 3 + CLASSES => {
            window = m.pop().as_ref().map(u64_of).transpose()?.filter(|w| *w > 0);
            Some(Value::Array(m))
        }
        m => m,
    };
    let Value::Array(items) = script else {
        return Err(StateError::Protocol("begin: expected an array"));
    };
    let [seq, rec, totals] = items.as_slice() else {
        return Err(StateError::Protocol("begin: expected three parts"));
    };
    let seq = u64_of(seq)?;
    let stored = parse_stored(rec, totals)?;
    let model = match model {
        None => ModelCalibration::default(),
        Some(Value::Array(m)) if m.len() == 2 + CLASSES => {
            let mut classes = [None; CLASSES];
            for (c, v) in classes.iter_mut().zip(&m[2..]) {
                *c = f64_of(v)?;
            }
            ModelCalibration {
                cold: f64_of(&m[0])?,
                marginal: f64_of(&m[1])?,
                classes,
            }
        }
        Some(_) => return Err(StateError::Protocol("begin: model calibration shape")),
    };
    Ok(Begin {
        seq,
        stored,
        model,
        window,
    })
}

impl RedisState {
    /// Parses the URL (`redis://[user:password@]host:port/db`, `rediss://` for
    /// TLS). Does not connect: a Redis that is down now only makes the backend
    /// unhealthy until it answers. The error names the problem, never the URL
    /// (it may hold a password).
    pub fn new(url: &str, ttl: Duration) -> Result<Self, String> {
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            return Err("--state must be `memory`, `redis://...` or `rediss://...`".into());
        }
        let client = redis::Client::open(url)
            .map_err(|e| format!("invalid --state URL ({:?})", e.kind()))?;
        let info = client.get_connection_info();
        let target = format!("{}/{}", info.addr, info.redis.db);
        let st = RedisState {
            inner: Arc::new(Inner {
                client,
                conn: OnceCell::new(),
                ttl_ms: ms(ttl),
                healthy: AtomicBool::new(false),
                warned: AtomicBool::new(false),
                warned_reply: AtomicBool::new(false),
                probing: AtomicBool::new(false),
                slow: AtomicU32::new(0),
                target,
                begin: Script::new(BEGIN_LUA),
                store: Script::new(STORE_LUA),
                delete: Script::new(DELETE_LUA),
                learn: Script::new(LEARN_LUA),
            }),
        };
        // Start learning whether Redis is up, if there is a runtime to do it
        // on; otherwise the first operation starts the probe.
        st.start_probe();
        Ok(st)
    }

    /// `host:port/db` of the backend, without credentials.
    pub fn target(&self) -> &str {
        &self.inner.target
    }

    /// One round trip: the session's next sequence, its stored record and
    /// totals, and the model's calibration.
    pub async fn begin(&self, session_id: &str, model: Option<&str>) -> Result<Begin, StateError> {
        self.begin_with_window(session_id, model, None).await
    }

    /// [`RedisState::begin`], and in the same round trip the window
    /// `upstream` taught for the model, if any replica learned one.
    pub async fn begin_with_window(
        &self,
        session_id: &str,
        model: Option<&str>,
        upstream: Option<&str>,
    ) -> Result<Begin, StateError> {
        let keys = session_keys(session_id);
        let mkey = model.map(model_key);
        let wfield = upstream.filter(|_| model.is_some()).map(window_field);
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let mut pipe = redis::pipe();
            pipe.cmd("EVALSHA")
                .arg(inner.begin.get_hash())
                .arg(3)
                .arg(&keys[..])
                .arg(inner.ttl_ms);
            if let Some(k) = &mkey {
                let cmd = pipe.cmd("HMGET").arg(k).arg("cold").arg("marginal");
                for c in Class::ALL {
                    cmd.arg(class_field(c));
                }
                // The learned window last: present only when asked for.
                if let Some(f) = &wfield {
                    cmd.arg(f);
                }
            }
            let mut out: Vec<Value> = match pipe.query_async(&mut conn).await {
                Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                    inner.load_scripts(&mut conn).await?;
                    pipe.query_async(&mut conn).await?
                }
                r => r?,
            };
            let m = if mkey.is_some() { out.pop() } else { None };
            let s = out.pop().ok_or(StateError::Protocol("begin: no reply"))?;
            Ok(parse_begin(s, m)?)
        })
        .await
    }

    /// What Redis holds of a session, read only (`GET /sessions/{key}`);
    /// `None` when no response of it was stored.
    pub async fn read(&self, session_id: &str) -> Result<Option<Stored>, StateError> {
        Ok(self.read_many(&[session_id]).await?.pop().flatten())
    }

    /// [`RedisState::read`] of several sessions in one round trip.
    pub async fn read_many(&self, session_ids: &[&str]) -> Result<Vec<Option<Stored>>, StateError> {
        self.run(|mut conn| async move {
            let mut pipe = redis::pipe();
            for sid in session_ids {
                let keys = session_keys(sid);
                pipe.cmd("HGETALL").arg(&keys[1]);
                pipe.cmd("HMGET")
                    .arg(&keys[2])
                    .arg("i")
                    .arg("c")
                    .arg("o")
                    .arg("t")
                    .arg("k");
            }
            let out: Vec<Value> = pipe.query_async(&mut conn).await?;
            let mut read = Vec::with_capacity(session_ids.len());
            for pair in out.chunks_exact(2) {
                let st = parse_stored(&pair[0], &pair[1])?;
                read.push(st.meta.is_some().then_some(st));
            }
            Ok(read)
        })
        .await
    }

    /// Writes back what one response changed, for the request that begun at
    /// `seq` ([`begin`]): its lane (compare-and-set, see the module doc),
    /// the session's own fields, its totals, and the listing indexes; then
    /// refreshes the TTL. Returns whether the lane was stored: false means
    /// a newer request of that lane (or a delete) got there first.
    ///
    /// [`begin`]: RedisState::begin
    pub async fn store(
        &self,
        session_id: &str,
        seq: u64,
        w: Write<'_>,
    ) -> Result<bool, StateError> {
        let keys = session_keys(session_id);
        let kidx = key_index(w.key);
        let inner = &*self.inner;
        let now = super::wall_ms();
        let (lane, record) = w.lane.unwrap_or(("", b""));
        self.run(|mut conn| async move {
            let mut inv = inner.store.key(&keys[1]);
            inv.key(&keys[0])
                .key(&keys[2])
                .arg(seq)
                .arg(lane)
                .arg(record)
                .arg(w.meta)
                .arg(inner.ttl_ms);
            for n in [
                w.add.input,
                w.add.cached_input,
                w.add.output,
                w.add.turns,
                w.add.compactions,
            ] {
                // HINCRBY takes a signed 64-bit increment.
                inv.arg(n.min(i64::MAX as u64));
            }
            inv.arg(MAX_LANES);
            let stored: i64 = inv.invoke_async(&mut conn).await?;
            // The indexes: not on the session's slot, so not in its script.
            let mut pipe = redis::pipe();
            let stale = now.saturating_sub(inner.ttl_ms);
            pipe.cmd("ZADD")
                .arg(SESSIONS_INDEX)
                .arg(now)
                .arg(session_id)
                .ignore();
            pipe.cmd("ZREMRANGEBYSCORE")
                .arg(SESSIONS_INDEX)
                .arg("-inf")
                .arg(format!("({stale}"))
                .ignore();
            pipe.cmd("ZADD")
                .arg(&kidx)
                .arg(now)
                .arg(w.credential)
                .ignore();
            pipe.cmd("PEXPIRE").arg(&kidx).arg(inner.ttl_ms).ignore();
            pipe.query_async::<()>(&mut conn).await?;
            Ok(stored == 1)
        })
        .await
    }

    /// Feeds one observed ratio into the model's shared calibration field:
    /// `new = old + alpha * (sample - old)` (the sample alone if none yet),
    /// atomically in Redis so replicas' observations all count. Returns the
    /// new value.
    pub async fn learn_model_calibration(
        &self,
        model: &str,
        field: CalField,
        sample: f64,
        alpha: f64,
    ) -> Result<f64, StateError> {
        if !sample.is_finite() || !(0.0..=1.0).contains(&alpha) {
            return Err(StateError::Invalid("calibration sample or alpha"));
        }
        let key = model_key(model);
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let mut inv = inner.learn.key(&key);
            inv.arg(field.as_str())
                .arg(sample)
                .arg(alpha)
                .arg(ms(MODEL_TTL));
            let v: Value = inv.invoke_async(&mut conn).await?;
            Ok(f64_of(&v)?.ok_or(StateError::Protocol("learn: no value"))?)
        })
        .await
    }

    /// Sets the model's shared calibration field (no smoothing): for a caller
    /// that smooths locally.
    pub async fn store_model_calibration(
        &self,
        model: &str,
        field: CalField,
        ratio: f64,
    ) -> Result<(), StateError> {
        self.learn_model_calibration(model, field, ratio, 1.0)
            .await
            .map(|_| ())
    }

    /// Sets several of the model's shared calibration fields at once (no
    /// smoothing), in one round trip: what one response changed.
    pub async fn store_model_fields(
        &self,
        model: &str,
        fields: &[(CalField, f64)],
    ) -> Result<(), StateError> {
        if fields.is_empty() {
            return Ok(());
        }
        if fields.iter().any(|(_, v)| !v.is_finite()) {
            return Err(StateError::Invalid("calibration value"));
        }
        let key = model_key(model);
        self.run(|mut conn| async move {
            let mut pipe = redis::pipe();
            let hset = pipe.cmd("HSET").arg(&key);
            for (f, v) in fields {
                hset.arg(f.as_str()).arg(format!("{v:?}"));
            }
            pipe.ignore();
            pipe.cmd("PEXPIRE").arg(&key).arg(ms(MODEL_TTL)).ignore();
            pipe.query_async::<()>(&mut conn).await?;
            Ok(())
        })
        .await
    }

    /// Share (or, `None`, drop) the window `upstream` taught for `model`:
    /// a field of the model's hash, beside its calibration.
    pub async fn set_window(
        &self,
        model: &str,
        upstream: &str,
        window: Option<u64>,
    ) -> Result<(), StateError> {
        let key = model_key(model);
        let field = window_field(upstream);
        self.run(|mut conn| async move {
            let mut pipe = redis::pipe();
            match window {
                Some(w) => pipe.cmd("HSET").arg(&key).arg(&field).arg(w).ignore(),
                None => pipe.cmd("HDEL").arg(&key).arg(&field).ignore(),
            };
            pipe.cmd("PEXPIRE").arg(&key).arg(ms(MODEL_TTL)).ignore();
            pipe.query_async::<()>(&mut conn).await?;
            Ok(())
        })
        .await
    }

    /// `DELETE /sessions/{key}`: a tombstone at the newest sequence handed
    /// out; a request begun before it cannot store its lane, and every lane
    /// stored before it reads without its anchor. Returns its sequence and
    /// whether a response of the session had been stored.
    pub async fn delete(&self, session_id: &str) -> Result<(u64, bool), StateError> {
        let keys = session_keys(session_id);
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let mut inv = inner.delete.key(&keys[0]);
            inv.key(&keys[1]).arg(inner.ttl_ms);
            let v: Value = inv.invoke_async(&mut conn).await?;
            match v {
                Value::Array(a) if a.len() == 2 => Ok((u64_of(&a[0])?, u64_of(&a[1])? == 1)),
                _ => Err(StateError::Protocol("delete: expected two values").into()),
            }
        })
        .await
    }

    /// The session ids written within the TTL, most recent first, at most `max`.
    pub async fn sessions(&self, max: usize) -> Result<Vec<String>, StateError> {
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let stale = super::wall_ms().saturating_sub(inner.ttl_ms);
            let mut pipe = redis::pipe();
            pipe.cmd("ZREMRANGEBYSCORE")
                .arg(SESSIONS_INDEX)
                .arg("-inf")
                .arg(format!("({stale}"))
                .ignore();
            pipe.cmd("ZREVRANGE")
                .arg(SESSIONS_INDEX)
                .arg(0)
                .arg(max.saturating_sub(1));
            let (ids,): (Vec<String>,) = pipe.query_async(&mut conn).await?;
            Ok(ids)
        })
        .await
    }

    /// The credentials `key` was written under within the TTL, most recent first.
    pub async fn credentials(&self, key: &str) -> Result<Vec<String>, StateError> {
        let kidx = key_index(key);
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let stale = super::wall_ms().saturating_sub(inner.ttl_ms);
            let mut pipe = redis::pipe();
            pipe.cmd("ZREMRANGEBYSCORE")
                .arg(&kidx)
                .arg("-inf")
                .arg(format!("({stale}"))
                .ignore();
            pipe.cmd("ZREVRANGE").arg(&kidx).arg(0).arg(-1);
            let (creds,): (Vec<String>,) = pipe.query_async(&mut conn).await?;
            Ok(creds)
        })
        .await
    }

    /// False during an outage and until Redis first answers. `/readyz` reports it.
    pub fn healthy(&self) -> bool {
        self.inner.healthy.load(Ordering::Acquire)
    }

    /// PINGs Redis now (bounded by [`OP_TIMEOUT`] plus a connect), even
    /// during an outage, and updates the health state with the answer.
    pub async fn ping(&self) -> bool {
        let ok = self.inner.ping_once().await;
        if ok {
            self.inner.recovered();
        } else {
            self.inner.outage("ping failed");
        }
        ok
    }

    /// Runs one operation under the outage rules: fail at once while
    /// unhealthy, else bound it by [`OP_TIMEOUT`] and turn a connection-level
    /// failure into an outage.
    async fn run<T, F, Fut>(&self, op: F) -> Result<T, StateError>
    where
        F: FnOnce(ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = Result<T, OpError>>,
    {
        if !self.inner.healthy.load(Ordering::Acquire) {
            crate::metrics::get().state_errors.inc();
            self.start_probe();
            return Err(StateError::Unavailable);
        }
        let attempt = async {
            let conn = self
                .inner
                .connection()
                .await
                .map_err(|e| Failure::Outage(StateError::Redis(describe(&e))))?;
            op(conn).await.map_err(|e| match e {
                OpError::Redis(e) if is_outage(&e) => {
                    Failure::Outage(StateError::Redis(describe(&e)))
                }
                OpError::Redis(e) => Failure::Reply(StateError::Redis(describe(&e))),
                OpError::State(e) => Failure::Reply(e),
            })
        };
        let failure = match tokio::time::timeout(OP_TIMEOUT, attempt).await {
            Ok(Ok(v)) => {
                self.inner.slow.store(0, Ordering::Relaxed);
                return Ok(v);
            }
            Ok(Err(f)) => f,
            // One late answer is a hiccup (a busy host); a run of them is an outage.
            Err(_) if self.inner.slow.fetch_add(1, Ordering::AcqRel) + 1 < SLOW_OUTAGE => {
                Failure::Slow(StateError::Timeout)
            }
            Err(_) => Failure::Outage(StateError::Timeout),
        };
        crate::metrics::get().state_errors.inc();
        match failure {
            Failure::Slow(e) => Err(e),
            Failure::Outage(e) => {
                self.inner.outage(&e.to_string());
                self.start_probe();
                Err(e)
            }
            Failure::Reply(e) => {
                if !self.inner.warned_reply.swap(true, Ordering::AcqRel) {
                    tracing::warn!(target_redis = %self.inner.target, error = %e, "state backend answered with an error; falling back to local state (logged once)");
                }
                Err(e)
            }
        }
    }

    /// Starts the background probe unless one runs (or there is no runtime
    /// yet: the first operation starts it then). It holds the state weakly,
    /// so dropping the last `RedisState` ends it.
    fn start_probe(&self) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.inner.probing.swap(true, Ordering::AcqRel) {
            return;
        }
        rt.spawn(probe_loop(Arc::downgrade(&self.inner)));
    }
}

impl From<RedisError> for StateError {
    fn from(e: RedisError) -> Self {
        StateError::Redis(describe(&e))
    }
}

/// An operation's failure, split by whether it means Redis is unreachable.
enum Failure {
    Outage(StateError),
    Slow(StateError),
    Reply(StateError),
}

impl Inner {
    async fn connection(&self) -> Result<ConnectionManager, RedisError> {
        let cfg = ConnectionManagerConfig::new()
            .set_connection_timeout(CONNECT_TIMEOUT)
            .set_response_timeout(CONNECT_TIMEOUT)
            .set_number_of_retries(1)
            .set_factor(10)
            .set_max_delay(100);
        let c = self
            .conn
            .get_or_try_init(|| ConnectionManager::new_with_config(self.client.clone(), cfg))
            .await?;
        Ok(c.clone())
    }

    async fn load_scripts(&self, conn: &mut ConnectionManager) -> Result<(), RedisError> {
        let mut pipe = redis::pipe();
        for src in [BEGIN_LUA, STORE_LUA, DELETE_LUA, LEARN_LUA] {
            pipe.cmd("SCRIPT").arg("LOAD").arg(src).ignore();
        }
        pipe.query_async::<()>(conn).await
    }

    /// Marks an outage; the first failure of one logs the WARN.
    fn outage(&self, why: &str) {
        self.healthy.store(false, Ordering::Release);
        if !self.warned.swap(true, Ordering::AcqRel) {
            tracing::warn!(target_redis = %self.target, error = %why, "state backend unreachable: serving from local state until it is back");
        }
    }

    fn recovered(&self) {
        self.slow.store(0, Ordering::Relaxed);
        self.healthy.store(true, Ordering::Release);
        if self.warned.swap(false, Ordering::AcqRel) {
            tracing::info!(target_redis = %self.target, "state backend recovered");
        }
    }

    async fn ping_once(&self) -> bool {
        let attempt = async {
            let mut conn = self.connection().await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await
        };
        matches!(
            tokio::time::timeout(OP_TIMEOUT + CONNECT_TIMEOUT, attempt).await,
            Ok(Ok(()))
        )
    }
}

/// What an operation body returns on failure.
enum OpError {
    Redis(RedisError),
    State(StateError),
}

impl From<RedisError> for OpError {
    fn from(e: RedisError) -> Self {
        OpError::Redis(e)
    }
}

impl From<StateError> for OpError {
    fn from(e: StateError) -> Self {
        OpError::State(e)
    }
}

async fn probe_loop(weak: Weak<Inner>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.ping_once().await {
            inner.probing.store(false, Ordering::Release);
            inner.recovered();
            return;
        }
        inner.outage("no answer to PING");
        drop(inner);
        tokio::time::sleep(PROBE_INTERVAL).await;
    }
}

/// The session's own fields in its record (`m`): what its lanes do not say.
#[derive(Debug, Serialize, Deserialize)]
struct Meta {
    credential: Box<str>,
    #[serde(with = "api_name")]
    api: Api,
    source: KeySource,
    last_seen_ms: u64,
    /// The lane that served the latest request stored.
    latest: u64,
    /// The newest response's id and lane: a replica that did not serve it
    /// still places a request that continues it (`previous_response_id`)
    /// in its lane.
    #[serde(default)]
    response: Option<(String, u64)>,
}

/// What Redis holds of a session, decoded for [`Sessions::merge`]. A lane
/// that does not decode (another version's) is left out.
fn shared_view(st: Stored, model: ModelCalibration) -> SharedView {
    let meta = st
        .meta
        .as_deref()
        .and_then(|m| serde_json::from_slice::<Meta>(m).ok());
    SharedView {
        api: meta.as_ref().map(|m| m.api),
        source: meta.as_ref().map(|m| m.source),
        link: meta.and_then(|m| m.response),
        lanes: lanes_of(&st),
        deleted: st.deleted,
        turns: st.totals.turns,
        compactions: u32::try_from(st.totals.compactions).unwrap_or(u32::MAX),
        spend: (st.totals.input, st.totals.cached_input, st.totals.output),
        model: (model.cold, model.marginal),
        model_classes: model.classes,
    }
}

fn lanes_of(st: &Stored) -> Vec<Lane> {
    st.lanes
        .iter()
        .filter_map(|(_, seq, bytes)| {
            let mut l = serde_json::from_slice::<Lane>(bytes).ok()?;
            l.ver = l.ver.max(*seq);
            Some(l)
        })
        .collect()
}

/// The shared record as a session object's source: every lane stored, the
/// anchors a `DELETE` came after dropped, the totals of every replica.
fn session_of(st: Stored) -> Option<Session> {
    let meta = serde_json::from_slice::<Meta>(st.meta.as_deref()?).ok()?;
    let mut s = Session::new(&meta.credential, meta.api, meta.source);
    s.lanes = lanes_of(&st);
    if st.deleted > 0 {
        for l in s.lanes.iter_mut().filter(|l| l.fence <= st.deleted) {
            l.reset(st.deleted);
        }
    }
    s.seq = st.top;
    s.turns = st.totals.turns;
    s.compactions = u32::try_from(st.totals.compactions).unwrap_or(u32::MAX);
    s.cum_input = st.totals.input;
    s.cum_cached = st.totals.cached_input;
    s.cum_output = st.totals.output;
    s.last_seen_ms = meta.last_seen_ms;
    s.latest = meta.latest;
    Some(s)
}

/// Sessions shared by every replica through Redis: the store the spine
/// sees with `--state redis://`. This replica keeps its own copy
/// ([`Sessions`]), which serves while Redis is away.
pub struct Shared {
    local: Sessions,
    backend: RedisState,
}

impl Shared {
    pub fn new(url: &str, cfg: SessionConfig) -> Result<Self, String> {
        let backend = RedisState::new(url, cfg.ttl)?;
        Ok(Shared {
            local: Sessions::new(cfg),
            backend,
        })
    }

    pub fn local(&self) -> &Sessions {
        &self.local
    }

    pub fn backend(&self) -> &RedisState {
        &self.backend
    }

    /// One round trip for the session's order, record, totals and the
    /// model's calibration; this replica's copy takes them in, then
    /// projects. Redis away: projected from the copy alone (`local_state`).
    pub async fn begin(&self, mut facts: RequestFacts<'_>) -> Begun {
        // The chain's links are this replica's: the session is found here.
        let resolved = self.local.resolve(
            facts.key.as_deref().map(std::borrow::Cow::Borrowed),
            facts.source,
            facts.continues.as_deref(),
            &facts.credential,
        );
        let Some(r) = resolved else {
            return self.local.begin_in_order(facts, None);
        };
        let sid = session_id(&facts.credential, &r.key);
        let begin = self.backend.begin_with_window(
            &sid,
            facts.model.as_deref(),
            facts.window_upstream.as_deref(),
        );
        match begin.await {
            Ok(b) => {
                // A window another replica learned from its upstream.
                if let (Some(w), Some(up), Some(m)) =
                    (b.window, &facts.window_upstream, &facts.model)
                {
                    if self.local.windows().learn(up, m, w) != Some(w) {
                        tracing::info!(upstream = %up, model = %m, window = w,
                            "context window learned by another replica");
                    }
                    facts.window = Some(w);
                }
                let (cred, model) = (facts.credential.clone(), facts.model.clone());
                self.local.merge(
                    &r.key,
                    &cred,
                    model.as_deref(),
                    shared_view(b.stored, b.model),
                );
                let mut begun = self.local.begin_in_order(facts, Some(b.seq));
                begun.ticket.shared = true;
                begun
            }
            Err(_) => {
                let mut begun = self.local.begin_in_order(facts, None);
                begun.local_state = true;
                begun
            }
        }
    }

    /// This replica's copy hears the outcome; what it changed (the lane,
    /// the session's fields, the totals, a changed model calibration) is
    /// written back off the response path.
    pub fn finish(&self, ticket: Ticket, outcome: Outcome) {
        if !ticket.shared {
            self.local.finish(ticket, outcome);
            return;
        }
        let Some((credential, key)) = ticket
            .session()
            .map(|(c, k)| (c.to_string(), k.to_string()))
        else {
            return;
        };
        let seq = ticket.seq;
        let model = ticket.model.as_deref().map(str::to_string);
        let compacted = ticket.compacted;
        let cal_before = self.local.model_calibration(model.as_deref());
        let classes_before = self.local.model_class_calibration(model.as_deref());
        let ok = (200..300).contains(&outcome.status) && outcome.completed;
        let u = &outcome.usage;
        let add = Totals {
            input: u.total_context.unwrap_or(0),
            cached_input: u.cached_input.unwrap_or(0),
            output: u.output.unwrap_or(0),
            turns: u64::from(ok),
            compactions: u64::from(compacted),
        };
        let response = outcome
            .response_id
            .clone()
            .filter(|id| ok && !id.is_empty() && id.len() <= MAX_ID_BYTES);
        let Some(changed) = self.local.finish_changed(ticket, &outcome) else {
            return;
        };
        let cal_after = self.local.model_calibration(model.as_deref());
        let classes_after = self.local.model_class_calibration(model.as_deref());
        let lane = changed
            .lane
            .as_ref()
            .and_then(|l| Some((super::lane_hex(l.id), serde_json::to_vec(l).ok()?)));
        let meta = serde_json::to_vec(&Meta {
            credential: changed.credential,
            api: changed.api,
            source: changed.source,
            last_seen_ms: changed.last_seen_ms,
            latest: changed.latest,
            response: response.map(|id| (id, changed.lane.as_ref().map_or(0, |l| l.id))),
        })
        .unwrap_or_default();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = self.backend.clone();
        rt.spawn(async move {
            // Failures are counted and logged by the backend; this replica
            // already has this response. The calibration goes first: once
            // the record is stored, a replica that reads it reads that too.
            if let Some(m) = model {
                let classes = Class::ALL.into_iter().map(|c| {
                    let i = c as usize;
                    (CalField::Class(c), classes_before[i], classes_after[i])
                });
                let changed: Vec<(CalField, f64)> = [
                    (CalField::Cold, cal_before.0, cal_after.0),
                    (CalField::Marginal, cal_before.1, cal_after.1),
                ]
                .into_iter()
                .chain(classes)
                .filter_map(|(f, before, after)| Some((f, after.filter(|v| Some(*v) != before)?)))
                .collect();
                let _ = backend.store_model_fields(&m, &changed).await;
            }
            let sid = session_id(&credential, &key);
            let write = Write {
                lane: lane.as_ref().map(|(n, b)| (n.as_str(), b.as_slice())),
                meta: &meta,
                add,
                key: &key,
                credential: &credential,
            };
            let _ = backend.store(&sid, seq, write).await;
        });
    }

    /// Write a learned window (or its removal) for the other replicas, off
    /// the response path.
    pub fn share_window(&self, upstream: &str, model: &str, window: Option<u64>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (backend, upstream, model) = (
            self.backend.clone(),
            upstream.to_string(),
            model.to_string(),
        );
        rt.spawn(async move {
            // Failures are counted and logged by the backend.
            let _ = backend.set_window(&model, &upstream, window).await;
        });
    }

    /// `GET /sessions/{key}`: the shared record, whichever replica served
    /// the session; this replica's copy if Redis holds none or is away.
    pub async fn get(&self, key: &str, credential: Option<&str>) -> Option<serde_json::Value> {
        let creds = match credential {
            Some(c) => vec![c.to_string()],
            None => match self.backend.credentials(key).await {
                Ok(c) => c,
                Err(_) => return self.local.get(key, None),
            },
        };
        for c in &creds {
            match self.backend.read(&session_id(c, key)).await {
                Ok(Some(st)) => {
                    if let Some(s) = session_of(st) {
                        return Some(self.local.render(key, &s));
                    }
                }
                Ok(None) => {}
                Err(_) => return self.local.get(key, credential),
            }
        }
        self.local.get(key, credential)
    }

    /// `GET /sessions?limit=N` over the shared records.
    pub async fn list(&self, limit: usize) -> serde_json::Value {
        let Ok(ids) = self.backend.sessions(MAX_LISTED).await else {
            return self.local.list(limit);
        };
        let mut found: Vec<(String, Session)> = Vec::new();
        for chunk in ids.chunks(LIST_BATCH) {
            let refs: Vec<&str> = chunk.iter().map(String::as_str).collect();
            let Ok(read) = self.backend.read_many(&refs).await else {
                return self.local.list(limit);
            };
            for (sid, st) in chunk.iter().zip(read) {
                let (Some(st), Some((_, key))) = (st, sid.split_once(':')) else {
                    continue;
                };
                if let Some(s) = session_of(st) {
                    found.push((key.to_string(), s));
                }
            }
        }
        let total = found.len();
        let util = |s: &Session| s.utilization().unwrap_or(-1.0);
        found.sort_by(|a, b| {
            util(&b.1)
                .total_cmp(&util(&a.1))
                .then(b.1.last_seen_ms.cmp(&a.1.last_seen_ms))
        });
        found.truncate(limit);
        let sessions: Vec<serde_json::Value> =
            found.iter().map(|(k, s)| self.local.render(k, s)).collect();
        serde_json::json!({"total": total, "sessions": sessions})
    }

    /// `DELETE /sessions/{key}[?credential=HASH]`: a tombstone in Redis for
    /// that credential's session (every credential's the key is known
    /// under, here or in Redis, without one), and the anchors dropped here.
    pub async fn delete(&self, key: &str, credential: Option<&str>) -> bool {
        let creds = match credential {
            Some(c) => vec![c.to_string()],
            None => {
                let mut c = self.backend.credentials(key).await.unwrap_or_default();
                for l in self.local.credentials(key) {
                    if !c.contains(&l) {
                        c.push(l);
                    }
                }
                c
            }
        };
        let mut any = false;
        for c in &creds {
            any |= match self.backend.delete(&session_id(c, key)).await {
                Ok((at, existed)) => self.local.reset_at(key, Some(c), at) | existed,
                Err(_) => self.local.reset(key, Some(c)),
            };
        }
        any
    }
}

impl super::Store for Shared {
    fn sessions(&self) -> &Sessions {
        &self.local
    }

    /// The order is Redis's, taken when it is asked.
    fn reserve(
        &self,
        _key: Option<&str>,
        _source: KeySource,
        _credential: &str,
        _api: Api,
        _continues: Option<&str>,
    ) -> Option<u64> {
        None
    }

    fn begin<'a>(&'a self, facts: RequestFacts<'a>, _order: Option<u64>) -> Beginning<'a> {
        Beginning::Waiting(Box::pin(Shared::begin(self, facts)))
    }

    fn finish(&self, ticket: Ticket, outcome: Outcome) {
        Shared::finish(self, ticket, outcome)
    }

    fn share_window(&self, upstream: &str, model: &str, window: Option<u64>) {
        Shared::share_window(self, upstream, model, window)
    }

    fn get<'a>(
        &'a self,
        key: &'a str,
        credential: Option<&'a str>,
    ) -> Pending<'a, Option<serde_json::Value>> {
        Box::pin(Shared::get(self, key, credential))
    }

    fn list(&self, limit: usize) -> Pending<'_, serde_json::Value> {
        Box::pin(Shared::list(self, limit))
    }

    fn delete<'a>(&'a self, key: &'a str, credential: Option<&'a str>) -> Pending<'a, bool> {
        Box::pin(Shared::delete(self, key, credential))
    }

    fn backend(&self) -> Option<&RedisState> {
        Some(&self.backend)
    }
}

/// What a replica does with what Redis handed it, without Redis.
#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::provider::Usage;
    use crate::session::Src;

    const CRED: &str = "c0ffee00";

    fn store() -> Sessions {
        Sessions::new(SessionConfig {
            ttl: Duration::from_secs(600),
            max_sessions: 100,
        })
    }

    fn facts(estimate: u64) -> RequestFacts<'static> {
        RequestFacts {
            key: Some("k".into()),
            credential: CRED.into(),
            model: Some("m".into()),
            estimate,
            ..Default::default()
        }
    }

    fn ok(real: u64) -> Outcome {
        Outcome {
            status: 200,
            usage: Usage {
                total_context: Some(real),
                output: Some(10),
                ..Default::default()
            },
            completed: true,
            ..Default::default()
        }
    }

    /// What Redis would hand back of `s`'s session after its stores.
    fn view_of(s: &Sessions, deleted: u64) -> SharedView {
        let r = s.record("k", CRED).unwrap();
        SharedView {
            api: Some(r.api),
            source: Some(r.source),
            link: None,
            lanes: r.lanes.clone(),
            deleted,
            turns: r.turns,
            compactions: r.compactions,
            spend: (r.cum_input, r.cum_cached, r.cum_output),
            model: (None, None),
            model_classes: Default::default(),
        }
    }

    fn begin(s: &Sessions, f: RequestFacts<'static>, seq: u64, view: SharedView) -> Begun {
        s.merge("k", CRED, Some("m"), view);
        s.begin_in_order(f, Some(seq))
    }

    #[test]
    fn another_replicas_record_anchors_and_takes_the_global_sequence() {
        let (a, b) = (store(), store());
        let begun = begin(&a, facts(1000), 1, SharedView::default());
        assert_eq!(begun.ticket.seq(), 1);
        a.finish(begun.ticket, ok(1200));
        let mut view = view_of(&a, 0);
        view.spend = (5_000, 0, 300);
        view.model = (None, Some(1.2));
        let begun = begin(&b, facts(1100), 7, view);
        assert_eq!(begun.projection.src, Src::Anchored);
        assert_eq!(begun.ticket.seq(), 7, "the global order, not a local count");
        // 1200 + 100 * 1.2: the anchor and the shared model ratio.
        assert_eq!(begun.projection.tokens, 1320);
        assert_eq!(
            begun.spent, 5_300,
            "the shared spend, larger than the record's"
        );
    }

    #[test]
    fn a_newer_local_response_beats_an_older_stored_lane() {
        let a = store();
        let b1 = begin(&a, facts(1000), 1, SharedView::default());
        a.finish(b1.ticket, ok(1200));
        let old = view_of(&a, 0);
        let b2 = begin(&a, facts(2000), 2, SharedView::default());
        a.finish(b2.ticket, ok(2300));
        // Redis still holds the lane of request 1 (request 2's store in flight).
        let b3 = begin(&a, facts(2100), 3, old);
        assert_eq!(b3.projection.src, Src::Anchored);
        // 2300 + 100 * 1.1 (the ratio request 2 taught); the old lane would
        // give 1200 + 1100 * 1.0.
        assert_eq!(b3.projection.tokens, 2410, "anchored on request 2's 2300");
    }

    #[test]
    fn a_delete_tombstone_drops_the_local_anchor_once() {
        let a = store();
        let b1 = begin(&a, facts(1000), 1, SharedView::default());
        a.finish(b1.ticket, ok(1200));
        let tomb = |a: &Sessions| view_of(a, 2);
        let b = begin(&a, facts(1100), 3, tomb(&a));
        assert_ne!(b.projection.src, Src::Anchored, "another replica's DELETE");
        assert_ne!(b.projection.src, Src::Lost);
        a.finish(b.ticket, ok(1300));
        // Its store has not landed yet: the same tombstone again does not
        // drop the new anchor.
        let b = begin(&a, facts(1200), 4, tomb(&a));
        assert_eq!(b.projection.src, Src::Anchored);
    }

    #[test]
    fn a_stored_record_reads_back_as_the_session_with_its_tombstone() {
        let a = store();
        let b1 = begin(&a, facts(1000), 1, SharedView::default());
        a.finish(b1.ticket, ok(1200));
        let r = a.record("k", CRED).unwrap();
        let lane = &r.lanes[0];
        let meta = serde_json::to_vec(&Meta {
            credential: r.credential.clone(),
            api: r.api,
            source: r.source,
            last_seen_ms: r.last_seen_ms,
            latest: r.latest,
            response: None,
        })
        .unwrap();
        let mut st = Stored {
            meta: Some(meta),
            lanes: vec![(lane.id_hex(), 1, serde_json::to_vec(lane).unwrap())],
            deleted: 0,
            top: 1,
            totals: Totals {
                input: 1200,
                turns: 1,
                ..Default::default()
            },
        };
        let v = a.render("k", &session_of(st.clone()).unwrap());
        assert_eq!(v["anchor"]["real"], 1200);
        assert_eq!(v["turns"], 1);
        assert_eq!(v["lanes"][0]["id"], lane.id_hex());
        st.deleted = 2;
        let v = a.render("k", &session_of(st).unwrap());
        assert!(v["anchor"].is_null(), "{v}");
        assert_eq!(v["state"], "calibrated");
    }
}
