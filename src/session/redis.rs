//! Shared session state in Redis (`--state redis://host:port/db`, `rediss://`):
//! one pipelined round trip per request, monotonic compare-and-set stores, and
//! an outage that is loud once and never stops the proxy.
//!
//! # Keys
//!
//! Every key of one session carries the session id in a hash tag, so a Redis
//! Cluster keeps them on one slot and the Lua scripts may touch them together:
//!
//! | key | type | holds |
//! |---|---|---|
//! | `tidemark:v1:{SID}:seq` | string | the session's request counter: one global order across replicas |
//! | `tidemark:v1:{SID}:rec` | hash | `s` the record's sequence, `d` the record bytes (absent after [`RedisState::delete`]) |
//! | `tidemark:v1:{SID}:spend` | hash | `i`, `c`, `o`: cumulative input, cached input and output tokens |
//! | `tidemark:v1:model:{MODEL}` | hash | per-model calibration fields (`cold`, `marginal`) |
//!
//! Session keys expire after the session TTL of inactivity; model keys after
//! [`MODEL_TTL`]. Ids longer than [`MAX_ID_BYTES`] are replaced by their SHA-256.
//!
//! # Monotonic
//!
//! [`RedisState::begin`] hands out the next sequence, never at or below the
//! stored record's (so a counter lost to an expiry or a Redis restart cannot
//! go back under a record that survived or was re-stored by a request in
//! flight); [`RedisState::store`] writes only a sequence above the stored one.
//! An older request's record never overwrites a newer one's.
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
use sha2::{Digest, Sha256};
use tokio::sync::OnceCell;

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

/// Hot-path script: next sequence (kept above the stored record's), the
/// record, the spend totals; refreshes the session TTL on all three keys.
const BEGIN_LUA: &str = r#"
local seq = redis.call('INCR', KEYS[1])
local rec = redis.call('HMGET', KEYS[2], 's', 'd')
local rs = tonumber(rec[1]) or 0
if seq <= rs then
  seq = rs + 1
  redis.call('SET', KEYS[1], string.format('%d', seq))
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('PEXPIRE', KEYS[3], ARGV[1])
local sp = redis.call('HMGET', KEYS[3], 'i', 'c', 'o')
return {seq, rs, rec[2], sp[1], sp[2], sp[3]}
"#;

/// Compare-and-set: store only above the stored sequence; keep the counter
/// at or above it too.
const STORE_LUA: &str = r#"
local cur = tonumber(redis.call('HGET', KEYS[1], 's')) or 0
local s = tonumber(ARGV[1])
if s <= cur then return 0 end
redis.call('HSET', KEYS[1], 's', ARGV[1], 'd', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local c = tonumber(redis.call('GET', KEYS[2])) or 0
if c < s then redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[3]) end
return 1
"#;

/// Drop the record but leave a tombstone at the newest sequence handed out,
/// so a request begun before the delete cannot bring the old record back.
const DELETE_LUA: &str = r#"
local c = redis.call('INCR', KEYS[1])
redis.call('DEL', KEYS[2])
redis.call('HSET', KEYS[2], 's', string.format('%d', c))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[2], ARGV[1])
return c
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

/// Cumulative tokens of one session, summed over every replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spend {
    pub input: u64,
    pub cached_input: u64,
    pub output: u64,
}

/// Calibration learned across sessions for one model (see `session.rs`'s
/// `ModelCal`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ModelCalibration {
    /// real/estimate of anchor-less requests (overhead included).
    pub cold: Option<f64>,
    /// Marginal ratio of new content.
    pub marginal: Option<f64>,
}

/// Which [`ModelCalibration`] field an observation feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalField {
    Cold,
    Marginal,
}

impl CalField {
    fn as_str(self) -> &'static str {
        match self {
            CalField::Cold => "cold",
            CalField::Marginal => "marginal",
        }
    }
}

/// What a request learns from Redis before it is projected.
#[derive(Debug, Clone, PartialEq)]
pub struct Begin {
    /// This request's place in the session's global order: pass it to
    /// [`RedisState::store`]. Always above `record_seq`.
    pub seq: u64,
    /// The newest stored record, if any.
    pub record: Option<Vec<u8>>,
    /// The sequence the record was stored with (or a delete's tombstone); 0 if none.
    pub record_seq: u64,
    pub spend: Spend,
    /// Empty when `begin` was given no model.
    pub model: ModelCalibration,
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
    format!("h:{}", crate::session::hex(&Sha256::digest(id.as_bytes()))).into()
}

/// The three keys of one session: counter, record, spend.
fn session_keys(session_id: &str) -> [String; 3] {
    let id = id_part(session_id);
    [
        format!("tidemark:v1:{{{id}}}:seq"),
        format!("tidemark:v1:{{{id}}}:rec"),
        format!("tidemark:v1:{{{id}}}:spend"),
    ]
}

fn model_key(model: &str) -> String {
    format!("tidemark:v1:model:{{{}}}", id_part(model))
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

fn parse_begin(script: Value, model: Option<Value>) -> Result<Begin, StateError> {
    let Value::Array(items) = script else {
        return Err(StateError::Protocol("begin: expected an array"));
    };
    if items.len() < 3 {
        return Err(StateError::Protocol("begin: short array"));
    }
    let seq = u64_of(&items[0])?;
    let record_seq = u64_of(&items[1])?;
    let record = match &items[2] {
        Value::BulkString(b) => Some(b.clone()),
        Value::Nil => None,
        _ => return Err(StateError::Protocol("begin: record is not bytes")),
    };
    // Lua stops an array at its first nil: missing spend fields are zero.
    let field = |i: usize| items.get(i).map(u64_of).unwrap_or(Ok(0));
    let spend = Spend {
        input: field(3)?,
        cached_input: field(4)?,
        output: field(5)?,
    };
    let model = match model {
        None => ModelCalibration::default(),
        Some(Value::Array(m)) if m.len() == 2 => ModelCalibration {
            cold: f64_of(&m[0])?,
            marginal: f64_of(&m[1])?,
        },
        Some(_) => return Err(StateError::Protocol("begin: model calibration shape")),
    };
    Ok(Begin {
        seq,
        record,
        record_seq,
        spend,
        model,
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
    /// spend, and the model's calibration.
    pub async fn begin(&self, session_id: &str, model: Option<&str>) -> Result<Begin, StateError> {
        let keys = session_keys(session_id);
        let mkey = model.map(model_key);
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let mut pipe = redis::pipe();
            pipe.cmd("EVALSHA")
                .arg(inner.begin.get_hash())
                .arg(3)
                .arg(&keys[..])
                .arg(inner.ttl_ms);
            if let Some(k) = &mkey {
                pipe.cmd("HMGET").arg(k).arg("cold").arg("marginal");
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

    /// Stores `record` as the session's record if `seq` (from [`begin`]) is
    /// above the stored one, and refreshes the TTL. Returns whether it was
    /// stored: false means a newer request (or a delete) got there first.
    ///
    /// [`begin`]: RedisState::begin
    pub async fn store(
        &self,
        session_id: &str,
        seq: u64,
        record: &[u8],
    ) -> Result<bool, StateError> {
        let keys = session_keys(session_id);
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let mut inv = inner.store.key(&keys[1]);
            inv.key(&keys[0]).arg(seq).arg(record).arg(inner.ttl_ms);
            let stored: i64 = inv.invoke_async(&mut conn).await?;
            Ok(stored == 1)
        })
        .await
    }

    /// Adds to the session's cumulative token counters. Increments, not a
    /// compare-and-set: every replica's spend counts, none is lost to a race.
    pub async fn add_spend(
        &self,
        session_id: &str,
        input: u64,
        cached: u64,
        output: u64,
    ) -> Result<(), StateError> {
        let keys = session_keys(session_id);
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let k = &keys[2];
            let mut pipe = redis::pipe();
            pipe.atomic();
            // HINCRBY takes a signed 64-bit increment.
            for (field, n) in [("i", input), ("c", cached), ("o", output)] {
                let n = i64::try_from(n).unwrap_or(i64::MAX);
                pipe.cmd("HINCRBY").arg(k).arg(field).arg(n).ignore();
            }
            pipe.cmd("PEXPIRE").arg(k).arg(inner.ttl_ms).ignore();
            pipe.query_async::<()>(&mut conn).await?;
            Ok(())
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

    /// Drops the session's record (anchor and all). The sequence counter and
    /// the spend stay: requests begun before the delete cannot store the old
    /// record back, and the budget keeps counting.
    pub async fn delete(&self, session_id: &str) -> Result<(), StateError> {
        let keys = session_keys(session_id);
        let inner = &*self.inner;
        self.run(|mut conn| async move {
            let mut inv = inner.delete.key(&keys[0]);
            inv.key(&keys[1]).arg(inner.ttl_ms);
            let _: i64 = inv.invoke_async(&mut conn).await?;
            Ok(())
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
