//! What every request needs that outlives it, and one worker's handle on it.
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use dashmap::DashSet;
use tokio::sync::Notify;

use crate::config::Config;
use crate::estimate::Estimator;
use crate::metrics;
use crate::policy::Cuts;
use crate::session::{SessionConfig, Store};
use crate::upstream::{self, Client};

/// Everything a request needs that outlives it.
pub struct State {
    pub config: Config,
    pub client: Client,
    pub estimator: Estimator,
    /// Sessions: this process's memory, or Redis shared with other replicas.
    pub store: Box<dyn Store>,
    /// Upstreams (authorities) that answered 400 to `stream_options`: never inject there again.
    pub no_stream_options: DashSet<String>,
    /// Each trimmed session's last cut, so the next request is cut at the
    /// same place and provider prompt caches survive.
    pub cuts: Cuts,
    /// OpenTelemetry export (`--otlp-endpoint`); `None`: off.
    pub otel: Option<crate::otel::Exporter>,
}

/// Per-message token cache budget for the estimator.
pub const ESTIMATE_CACHE_BYTES: usize = 64 << 20;

impl State {
    pub fn new(config: Config) -> Result<State, String> {
        let client = upstream::client(&config)?;
        let store = crate::session::open(
            SessionConfig {
                ttl: config.session_ttl,
                max_sessions: config.max_sessions,
            },
            &config.state,
        )?;
        // Its own client: the same TLS settings, a pool of its own.
        let otel = match config.otlp.clone() {
            Some(o) => Some(crate::otel::Exporter::start(o, upstream::client(&config)?)),
            None => None,
        };
        Ok(State {
            otel,
            client,
            estimator: Estimator::new(ESTIMATE_CACHE_BYTES),
            store,
            no_stream_options: DashSet::new(),
            cuts: Cuts::new(config.max_sessions),
            config,
        })
    }
}

/// One worker thread's handle on the shared [`State`], cloned for each
/// request (by the service, and by the callback that records the response)
/// instead of the shared `Arc`: that `Arc`'s count is one cache line that
/// every worker's clones and drops would pull from core to core, twice per
/// request each. This handle's count is written by its own worker only.
#[derive(Clone)]
pub struct Local(Arc<Worker>);

/// What one worker thread holds: its handle on the shared state, and its
/// open WebSockets (which a graceful shutdown waits for).
struct Worker {
    state: Arc<State>,
    sockets: Open,
}

impl Local {
    pub fn new(state: Arc<State>) -> Local {
        Local(Arc::new(Worker {
            state,
            sockets: Default::default(),
        }))
    }

    /// This worker's open WebSockets.
    pub fn sockets(&self) -> &Open {
        &self.0.sockets
    }
}

impl std::ops::Deref for Local {
    type Target = State;
    fn deref(&self) -> &State {
        &self.0.state
    }
}

/// The open WebSockets of one worker, so that a graceful shutdown waits
/// for them (hyper's own watcher lets go of a connection once it upgrades).
#[derive(Clone, Default)]
pub struct Open(Arc<OpenInner>);

#[derive(Default)]
struct OpenInner {
    n: AtomicUsize,
    zero: Notify,
}

/// One open socket; dropping it (the pump ended, or its worker's loop was
/// dropped at the end of the grace period) counts it closed.
pub struct Held {
    open: Open,
    gauge: prometheus::IntGauge,
}

impl Open {
    /// A socket of `api` opened.
    pub fn enter(&self, api: &str) -> Held {
        self.0.n.fetch_add(1, Ordering::AcqRel);
        let gauge = metrics::get().websockets.with_label_values(&[api]);
        gauge.inc();
        Held {
            open: self.clone(),
            gauge,
        }
    }

    /// How many are open.
    pub fn count(&self) -> usize {
        self.0.n.load(Ordering::Acquire)
    }

    /// Resolves once none is open.
    pub async fn closed(&self) {
        loop {
            // Made before the count is read: a close between the two still
            // wakes it.
            let woken = self.0.zero.notified();
            if self.count() == 0 {
                return;
            }
            woken.await;
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauge.dec();
        if self.open.0.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.open.0.zero.notify_waiters();
        }
    }
}
