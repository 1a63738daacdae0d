//! tidemark: a transparent LLM reverse proxy that knows how full every
//! session's context window really is.
//!
//! # The life of one request
//!
//! 1. **Accept** (`server.rs`): one listener speaks HTTP/1.1 and h2c; a
//!    semaphore caps connections, and each connection is handed, in turn, to
//!    one of `--workers` threads (one per core), each a single-threaded event
//!    loop that serves it start to finish with upstream connections of its
//!    own. hyper's header-read timeout guards against slowloris, and a
//!    graceful-shutdown watcher per worker drains in-flight streams.
//! 2. **Route** (`proxy/mod.rs::handle`, the spine: named phases over one
//!    per-request context, `proxy/ctx.rs::Ctx`, run in order by
//!    `proxy/mod.rs::api_request`): the longest `--route` prefix
//!    picks the upstream (`config/`); `provider::for_path` decides whether the
//!    path is an API tidemark understands (`provider/`, one file per API).
//!    Anything else streams through untouched (`proxy/send.rs::untouched`).
//!    A WebSocket handshake (any path) goes to `ws/tunnel.rs`: sent upstream
//!    on an HTTP/1.1 connection of its own with its upgrade headers, and
//!    after `101` the two sockets are pumped with bounded buffers. On the
//!    Responses API's WebSocket mode (`ws/responses.rs`) the frames are
//!    read (`ws/frame.rs`, `ws/deflate.rs`) and each `response.create`
//!    event is a turn through the same phases as a POST (`turn/phases.rs`:
//!    `identify`, `estimate`, `project`, `record`; `policy/decide.rs`:
//!    `decide`), except a warm-up (`generate: false`, Codex's first event
//!    on every socket). What both sides share sits in `turn/`, below both:
//!    the state, the phases, errors mapped to responses (`turn/error.rs`).
//! 3. **Read** (`proxy/phases.rs::read`) and **inspect** (`json/view.rs`):
//!    the body is read whole, capped at
//!    `--max-body-bytes` (413 beyond), decoded if compressed, and scanned
//!    once, strictly as serde_json would validate it, into a borrowed view of
//!    raw top-level JSON slices and the elements of the arrays among them (a
//!    history's messages). Not JSON: forwarded as it came, with no projection.
//! 4. **Estimate** (`estimate/`): each API walks its own messages
//!    (`Provider::walk` in its `provider/*.rs`) and reports what the model
//!    sees to the estimator (`estimate/count.rs`); each message is
//!    tokenized once (bpe-openai, the model family's encoding) and cached by
//!    an xxh3 of its bytes, so a new turn costs only its own tokens (a long
//!    history is looked up a cache shard at a time); images are sized from their headers. Each message's
//!    tokens are shared among content classes (`estimate/classes.rs`: prose,
//!    code, JSON, base64, CJK and other scripts, emoji, ...) by cheap
//!    statistics of its text, cached with its count.
//!    More than 16 KiB not yet tokenized goes to tokio's blocking pool, so a
//!    worker's other connections do not wait behind a cold history.
//! 5. **Session** (`session/`, `window/`): who is asking and which
//!    session (`session/identity.rs`: a session header, else the id the
//!    agent sends of its own accord, else the `previous_response_id` chain,
//!    else a fingerprint of the conversation's start, content only), the
//!    request's lane within it (`session/lane.rs`: the main loop, a
//!    sub-agent, a side call on another model), and that lane's anchor,
//!    calibration and projection
//!    `anchor.real + (estimate - anchor.estimate) * calibration`, the
//!    delta measured class by class with a ratio each, fitted from the
//!    lane's consecutive anchors against the model's ratios learned across
//!    sessions (`session/calibration.rs`), against the window a
//!    `--context-window` rule gives, else the one the upstream's own
//!    refusal taught (`window/learned.rs`), else the table (`window/mod.rs`).
//!    What is sent is also seen as the provider's prompt cache sees it
//!    (`session/cache.rs`), to be compared with the lane's previous request
//!    when the response comes back. One store
//!    trait (`session/mod.rs::Store`), whose implementations own begin and
//!    finish: this process's memory
//!    (`session/memory.rs`), or Redis shared by replicas
//!    (`session/redis.rs`); `--exact-cold-start` asks the provider's counter
//!    (`proxy/count.rs`). The phases: `proxy/phases.rs::identify`,
//!    `estimate`, `project`.
//! 6. **Decide** (`policy/decide.rs::decide`, carried out by
//!    `proxy/phases.rs::decide`): session budget, then a `Verdict`: pass /
//!    reject (in the provider's own error shape, `turn/error.rs`) / trim
//!    (`policy/cut.rs`, `policy/trim.rs`: turn-aware, sticky cut, each cut
//!    weighed by its elements' cached counts, re-projected with the same
//!    ruler, rejected if still over).
//! 7. **Send** (`proxy/send.rs::send`; `upstream/`): hop-by-hop headers
//!    dropped, the OpenAI chat usage option injected (`tap/inject.rs`),
//!    connect and response-header timeouts. tidemark's own pooled client
//!    (rustls, HTTP/2 by ALPN, `upstream/pool.rs`) speaks HTTP/1.1 itself
//!    (`upstream/h1.rs`) and has no task per connection: the response body
//!    reads and decodes its connection, so bytes that arrived together leave
//!    together. When no policy can stop or change the request
//!    (`policy::settled`: `--on-over pass`, no session budget, no exact cold
//!    start: the defaults), it leaves right after identify
//!    (`proxy/send.rs::forward_first`), having taken its place in its
//!    session's order (so two in flight keep the order they came in), and
//!    steps 4-6 run while the upstream works (`proxy/ctx.rs::meanwhile`,
//!    the one combinator).
//! 8. **Tap** (`proxy/tap.rs::tap`, `tap/`): the response body is wrapped,
//!    never buffered: every frame goes to the client as it arrives while
//!    `tap/usage.rs` decompresses a copy's view, frames it (`tap/sse.rs`,
//!    NDJSON, JSON), steps over the events that cannot carry usage, and
//!    builds for the provider only the members it reads (`Provider::reads`),
//!    stepping over the rest by structure alone (`json/pick.rs`). An
//!    injected stream loses on its way what the option added
//!    (`tap/inject.rs`), decoded first when the upstream compressed it
//!    anyway (`tap/usage.rs::BodyDecoder`).
//!    An error response's body is copied on the side, bounded, for what
//!    its refusal says (`Provider::context_error`).
//! 9. **Record** (`turn/phases.rs::record`, fired by
//!    `proxy/tap.rs::recorder`): once, at end of stream, error or client
//!    hang-up, the session is anchored (or the loss is made loud), a
//!    refusal's window is learned and its prompt count anchors, a change
//!    of the cached prefix is counted as a bust, and the drift is exported
//!    (`metrics.rs`, every metric name in one file). With
//!    `--otlp-endpoint`, the request's span (begun at step 2 from the
//!    client's `traceparent`, named as the parent in the upstream request's)
//!    is pushed onto a bounded queue that one exporter task drains into
//!    OTLP spans and GenAI metrics (`otel/`, its settings in `config/otlp.rs`).
//!
//! The admin listener (`server.rs` accepts, `admin/mod.rs` answers)
//! serves `/metrics` and `/sessions`, and at `/` a live sessions page
//! (`admin/page.rs`, `admin/page.html`).
//!
//! `tidemark demo` (`demo/`) runs all of this against a simulated provider
//! (`sim/`, one file per API it speaks) that counts with tokenizers the
//! estimator never uses for that API, so the drift is real; `tidemark sim`
//! serves it alone, for real agents.
#![forbid(unsafe_code)]

pub mod admin;
pub mod config;
pub mod demo;
pub mod estimate;
pub mod json;
pub mod metrics;
pub mod otel;
pub mod policy;
pub mod provider;
pub mod proxy;
pub mod server;
pub mod session;
pub mod sim;
pub mod tap;
pub mod turn;
pub mod upstream;
pub mod window;
pub mod ws;

pub use config::Config;
pub use server::run;
