//! Every metric tidemark exports, registered once. Label values come from small
//! fixed sets; the one client-controlled label, `model`, is capped.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use prometheus::{
    Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Distinct `model` label values kept before the rest collapse into `other`.
pub const MAX_MODEL_LABELS: usize = 200;

pub struct Metrics {
    pub registry: Registry,
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub ttfb: HistogramVec,
    pub proxy_overhead: HistogramVec,
    pub prompt_real: IntCounterVec,
    pub prompt_estimated: IntCounterVec,
    pub cached_prompt: IntCounterVec,
    pub output_tokens: IntCounterVec,
    pub estimate_drift: GaugeVec,
    pub projection_drift: GaugeVec,
    /// real / estimate per content class, the lanes' recent fits.
    pub class_drift: GaugeVec,
    pub estimate_error: HistogramVec,
    pub projection_error: HistogramVec,
    pub utilization: HistogramVec,
    pub sessions: IntGaugeVec,
    /// Lanes held across all sessions (`tidemark_lanes`).
    pub lanes: IntGauge,
    pub anchor_lost: IntCounterVec,
    pub usage_missing: IntCounterVec,
    pub compactions: IntCounterVec,
    pub over_budget: IntCounterVec,
    pub trimmed_tokens: IntCounterVec,
    /// The window each (api, model) is measured against: flag, learned or table.
    pub context_window: GaugeVec,
    /// Cached tokens lost to prefix changes, and the changes by cause.
    pub cache_invalidated: IntCounterVec,
    pub cache_busts: IntCounterVec,
    pub usage_injected: IntCounterVec,
    pub upstream_errors: IntCounterVec,
    pub usage_parse_errors: IntCounterVec,
    /// Requests refused by a tidemark limit, by limit (`body`, `headers`, `connections`, ...).
    pub limits_hit: IntCounterVec,
    /// Redis state backend outages (`--state redis://`).
    pub state_errors: IntCounter,
    /// Kept so the registry is not empty of process info on platforms without it.
    pub up: Gauge,
    /// Open proxied WebSockets, by `api` (`openai-responses`, or `none`).
    pub websockets: IntGaugeVec,
    /// OpenTelemetry items not delivered, by `signal` (`spans`, `metrics`)
    /// and `reason` (`queue_full`, `export_failed`): what an unreachable
    /// or slow collector costs.
    pub otlp_dropped: IntCounterVec,
    /// Every family: (name, help, type), so that one with no series yet
    /// (the `[api, model]` families before a request) is still exported.
    families: Vec<(&'static str, &'static str, &'static str)>,
    /// Model label values seen, each with its series per API.
    models: Mutex<HashMap<String, Vec<&'static Series>>>,
    /// Per-API handles into the `[api]` families, by [`api_labels`] index.
    apis: Vec<ApiSeries>,
}

/// Every `kind` of `tidemark_upstream_errors_total`
/// (`UpstreamError::metric_kind`; a failure mid-stream is a `reset`, or a
/// `timeout` when `--idle-timeout` ended it).
pub const UPSTREAM_ERROR_KINDS: [&str; 4] = ["connect", "timeout", "reset", "tls"];

/// Every `limit` of `tidemark_limits_hit_total`: a body over
/// `--max-body-bytes`, a body or head slower than `--header-read-timeout`,
/// a head over `--max-header-bytes`, `--max-connections` reached.
pub const LIMITS: [&str; 5] = [
    "body",
    "body_timeout",
    "header_timeout",
    "headers",
    "connections",
];

/// Every (`signal`, `reason`) of `tidemark_otlp_dropped_total`.
pub const OTLP_DROPS: [(&str, &str); 3] = [
    ("spans", "queue_full"),
    ("spans", "export_failed"),
    ("metrics", "export_failed"),
];

/// Every `api` label value: each API's name (in [`crate::provider::ALL`]'s
/// order) and `other`, last.
pub fn api_labels() -> impl Iterator<Item = &'static str> {
    crate::provider::ALL
        .iter()
        .map(|p| p.api().as_str())
        .chain(["other"])
}

macro_rules! api_series {
    ($($name:ident: $ty:ty;)*) => {
        /// One API's handles into the families labelled by `api` alone, each
        /// made on first use: every request touches three or four of them,
        /// and a `with_label_values` lookup hashes and locks each time.
        pub struct ApiSeries {
            api: &'static str,
            $($name: OnceLock<$ty>,)*
        }

        impl ApiSeries {
            fn new(api: &'static str) -> Self {
                ApiSeries { api, $($name: OnceLock::new(),)* }
            }
            $(
                pub fn $name(&self) -> &$ty {
                    self.$name
                        .get_or_init(|| get().$name.with_label_values(&[self.api]))
                }
            )*
        }
    };
}

api_series! {
    proxy_overhead: Histogram;
    ttfb: Histogram;
    request_duration: Histogram;
    usage_injected: IntCounter;
}

macro_rules! series {
    ($($name:ident: $ty:ty;)*) => {
        /// One (api, model) pair's handles into the `[api, model]` families,
        /// each made on first use (a series appears in /metrics once it is
        /// touched, as with `with_label_values`).
        pub struct Series {
            api: &'static str,
            pub model: String,
            /// `tidemark_requests_total{status="200"}`, the one status
            /// nearly every request ends with.
            requests_ok: OnceLock<IntCounter>,
            $($name: OnceLock<$ty>,)*
        }

        impl Series {
            fn new(api: &'static str, model: String) -> Self {
                Series { api, model, requests_ok: OnceLock::new(), $($name: OnceLock::new(),)* }
            }

            /// Count one request of this series ending with `status` in
            /// `tidemark_requests_total`.
            pub fn count_request(&self, status: u16) {
                let make = || get().requests.with_label_values(&[self.api, &self.model, &status.to_string()]);
                match status {
                    200 => self.requests_ok.get_or_init(make).inc(),
                    _ => make().inc(),
                }
            }
            $(
                pub fn $name(&self) -> &$ty {
                    self.$name
                        .get_or_init(|| get().$name.with_label_values(&[self.api, &self.model]))
                }
            )*
        }
    };
}

series! {
    prompt_real: IntCounter;
    prompt_estimated: IntCounter;
    cached_prompt: IntCounter;
    output_tokens: IntCounter;
    estimate_drift: Gauge;
    projection_drift: Gauge;
    estimate_error: Histogram;
    projection_error: Histogram;
    utilization: Histogram;
    usage_missing: IntCounter;
    context_window: Gauge;
}

/// Buckets for latencies from 50 µs to a long stream.
const LATENCY: &[f64] = &[
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Buckets for the proxy's own overhead, which should sit well under a millisecond.
const OVERHEAD: &[f64] = &[
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1,
];
/// Buckets for signed error ratios, dense around 0.
const ERROR_RATIO: &[f64] = &[
    -0.75, -0.5, -0.3, -0.2, -0.1, -0.05, -0.02, -0.01, -0.005, 0.0, 0.005, 0.01, 0.02, 0.05, 0.1,
    0.2, 0.3, 0.5, 1.0, 2.0,
];
/// Buckets for utilisation of the window, 0 to past full.
const UTILIZATION: &[f64] = &[
    0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2,
];

/// The registry and the list of its families, filled as they are registered.
struct Families {
    registry: Registry,
    list: Vec<(&'static str, &'static str, &'static str)>,
}

impl Families {
    fn add<C: prometheus::core::Collector + Clone + 'static>(
        &mut self,
        c: C,
        name: &'static str,
        help: &'static str,
        ty: &'static str,
    ) -> C {
        self.registry
            .register(Box::new(c.clone()))
            .expect("metric registered once");
        self.list.push((name, help, ty));
        c
    }
}

fn counter(
    r: &mut Families,
    name: &'static str,
    help: &'static str,
    labels: &[&str],
) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.add(c, name, help, "counter")
}
fn gauge(r: &mut Families, name: &'static str, help: &'static str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.add(g, name, help, "gauge")
}
fn histogram(
    r: &mut Families,
    name: &'static str,
    help: &'static str,
    labels: &[&str],
    b: &[f64],
) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(b.to_vec()), labels)
        .expect("valid metric");
    r.add(h, name, help, "histogram")
}

impl Metrics {
    fn new() -> Self {
        let mut r = Families {
            registry: Registry::new(),
            list: Vec::new(),
        };
        let r = &mut r;
        let am = &["api", "model"];
        let (name, help) = ("tidemark_sessions", "sessions held, by state");
        let sessions = IntGaugeVec::new(Opts::new(name, help), &["state"]).expect("valid metric");
        let sessions = r.add(sessions, name, help, "gauge");
        let (name, help) = ("tidemark_lanes", "lanes held, all sessions");
        let lanes = IntGauge::new(name, help).expect("valid metric");
        let lanes = r.add(lanes, name, help, "gauge");
        let (name, help) = (
            "tidemark_state_backend_errors_total",
            "state backend (redis) operations that failed; requests fell back to local state",
        );
        let state_errors = IntCounter::new(name, help).expect("valid metric");
        let state_errors = r.add(state_errors, name, help, "counter");
        let (name, help) = ("tidemark_up", "1 while the process serves");
        let up = Gauge::new(name, help).expect("valid metric");
        let up = r.add(up, name, help, "gauge");
        up.set(1.0);
        let (name, help) = ("tidemark_websockets", "open proxied WebSockets");
        let websockets = IntGaugeVec::new(Opts::new(name, help), &["api"]).expect("valid metric");
        let websockets = r.add(websockets, name, help, "gauge");
        // Both values from start-up, at zero.
        for api in ["openai-responses", "none"] {
            websockets.with_label_values(&[api]).set(0);
        }
        let m = Metrics {
            requests: counter(
                r,
                "tidemark_requests_total",
                "requests by final status",
                &["api", "model", "code"],
            ),
            request_duration: histogram(
                r,
                "tidemark_request_duration_seconds",
                "request start to last byte",
                &["api"],
                LATENCY,
            ),
            ttfb: histogram(
                r,
                "tidemark_time_to_first_byte_seconds",
                "request start to first body byte to client",
                &["api"],
                LATENCY,
            ),
            proxy_overhead: histogram(
                r,
                "tidemark_proxy_overhead_seconds",
                "time spent in tidemark before the upstream request is sent",
                &["api"],
                OVERHEAD,
            ),
            prompt_real: counter(
                r,
                "tidemark_prompt_tokens_real_total",
                "provider-reported prompt tokens",
                am,
            ),
            prompt_estimated: counter(
                r,
                "tidemark_prompt_tokens_estimated_total",
                "local estimates of the same requests",
                am,
            ),
            cached_prompt: counter(
                r,
                "tidemark_cached_prompt_tokens_total",
                "of the real prompt tokens, how many were cache reads",
                am,
            ),
            output_tokens: counter(
                r,
                "tidemark_output_tokens_total",
                "provider-reported output tokens",
                am,
            ),
            estimate_drift: gauge(
                r,
                "tidemark_estimate_drift_ratio",
                "real / estimate, recent",
                am,
            ),
            projection_drift: gauge(
                r,
                "tidemark_projection_drift_ratio",
                "real / projection, recent",
                am,
            ),
            class_drift: gauge(
                r,
                "tidemark_class_drift_ratio",
                "real / estimate per content class, recent",
                &["api", "model", "class"],
            ),
            estimate_error: histogram(
                r,
                "tidemark_estimate_error_ratio",
                "(estimate - real) / real",
                am,
                ERROR_RATIO,
            ),
            projection_error: histogram(
                r,
                "tidemark_projection_error_ratio",
                "(projection - real) / real",
                am,
                ERROR_RATIO,
            ),
            utilization: histogram(
                r,
                "tidemark_context_utilization",
                "projection / window",
                am,
                UTILIZATION,
            ),
            sessions,
            lanes,
            anchor_lost: counter(r, "tidemark_anchor_lost_total", "anchor losses", am),
            usage_missing: counter(
                r,
                "tidemark_usage_missing_total",
                "2xx responses without usage",
                am,
            ),
            compactions: counter(
                r,
                "tidemark_compactions_detected_total",
                "shrinks detected",
                am,
            ),
            over_budget: counter(
                r,
                "tidemark_over_budget_total",
                "over-budget requests by action",
                &["api", "model", "action"],
            ),
            trimmed_tokens: counter(
                r,
                "tidemark_trimmed_tokens_total",
                "tokens removed by trims (projected)",
                am,
            ),
            context_window: gauge(
                r,
                "tidemark_context_window_tokens",
                "the window in use: flag, learned from the provider, or table",
                am,
            ),
            cache_invalidated: counter(
                r,
                "tidemark_cache_invalidated_tokens_total",
                "tokens the provider had cached and had to process again after a prefix change",
                am,
            ),
            cache_busts: counter(
                r,
                "tidemark_cache_busts_total",
                "prefix changes that broke the prompt cache, by what changed",
                &["api", "model", "cause"],
            ),
            usage_injected: counter(
                r,
                "tidemark_usage_injected_total",
                "usage injections",
                &["api"],
            ),
            upstream_errors: counter(
                r,
                "tidemark_upstream_errors_total",
                "upstream failures by kind",
                &["kind"],
            ),
            usage_parse_errors: counter(
                r,
                "tidemark_usage_parse_errors_total",
                "malformed usage or stream",
                &["api"],
            ),
            limits_hit: counter(
                r,
                "tidemark_limits_hit_total",
                "requests refused by a tidemark limit",
                &["limit"],
            ),
            otlp_dropped: counter(
                r,
                "tidemark_otlp_dropped_total",
                "OpenTelemetry spans and metric points not delivered, by signal and reason",
                &["signal", "reason"],
            ),
            state_errors,
            up,
            websockets,
            registry: r.registry.clone(),
            families: std::mem::take(&mut r.list),
            models: Mutex::new(HashMap::new()),
            apis: api_labels().map(ApiSeries::new).collect(),
        };
        // SPEC §7: series labelled by `api`, `kind` or `limit` alone exist
        // from start-up, at zero for each value (a rate over a counter that
        // appears with its first event misses that event).
        for api in api_labels() {
            m.request_duration.with_label_values(&[api]);
            m.ttfb.with_label_values(&[api]);
            m.proxy_overhead.with_label_values(&[api]);
            m.usage_injected.with_label_values(&[api]);
            m.usage_parse_errors.with_label_values(&[api]);
        }
        for kind in UPSTREAM_ERROR_KINDS {
            m.upstream_errors.with_label_values(&[kind]);
        }
        for limit in LIMITS {
            m.limits_hit.with_label_values(&[limit]);
        }
        for (signal, reason) in OTLP_DROPS {
            m.otlp_dropped.with_label_values(&[signal, reason]);
        }
        m
    }

    /// The handles of one `api` label value (one of [`api_labels`]; any
    /// other name is counted as `other`).
    pub fn api(&self, api: &str) -> &ApiSeries {
        let other = self.apis.len() - 1;
        let i = api_labels().position(|a| a == api).unwrap_or(other);
        &self.apis[i]
    }

    /// The `model` label value for a client-supplied model name: itself while
    /// fewer than [`MAX_MODEL_LABELS`] distinct values have been seen, else `other`.
    pub fn model_label(&self, model: Option<&str>) -> String {
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        slot(&mut models, model).0.to_string()
    }

    /// The series of one (api, model) pair, the model capped as
    /// [`model_label`](Self::model_label) says. Made once per pair and
    /// shared: a response touches a dozen series, and every
    /// `with_label_values` hashes its labels under a lock.
    pub fn series(&self, api: &'static str, model: Option<&str>) -> &'static Series {
        // A worker's requests nearly all name the same API and model: the
        // last pair it asked for is kept on the thread, which spares the
        // shared map's lock (and its cache line crossing cores) and three
        // SipHash lookups per request. A model's label never changes once
        // given, so the kept answer stays right (and there is one
        // `Metrics`, [`get`]'s: `new` is private to it).
        type Last = Option<(&'static str, Option<Box<str>>, &'static Series)>;
        thread_local! {
            static LAST: std::cell::RefCell<Last> = const { std::cell::RefCell::new(None) };
        }
        let kept = LAST.with_borrow(|last| match last {
            Some((a, m, s)) if *a == api && m.as_deref() == model => Some(*s),
            _ => None,
        });
        if let Some(s) = kept {
            return s;
        }
        let s = self.series_shared(api, model);
        LAST.set(Some((api, model.map(Into::into), s)));
        s
    }

    fn series_shared(&self, api: &'static str, model: Option<&str>) -> &'static Series {
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let (label, per_api) = slot(&mut models, model);
        if let Some(s) = per_api.iter().find(|s| s.api == api) {
            return s;
        }
        // Kept for the life of the process, as the map kept them before: a
        // reference needs no count (a count shared by every worker is a
        // cache line crossing cores twice a request). At most
        // MAX_MODEL_LABELS labels plus `other`, times six APIs are ever made.
        let s: &'static Series = Box::leak(Box::new(Series::new(api, label.to_string())));
        per_api.push(s);
        s
    }

    /// The Prometheus text exposition of every family. A family with no
    /// series yet (one labelled by model, before its first request) is
    /// shown by its `HELP` and `TYPE` lines, so every name is there from
    /// start-up (SPEC §7).
    pub fn render(&self) -> Vec<u8> {
        use std::io::Write;
        let mut out = Vec::with_capacity(16 * 1024);
        let gathered = self.registry.gather();
        let _ = TextEncoder::new().encode(&gathered, &mut out);
        for (name, help, ty) in &self.families {
            if !gathered.iter().any(|f| f.name() == *name) {
                let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} {ty}\n");
            }
        }
        out
    }
}

/// The label a client-supplied model name gets, and that label's series.
/// "unknown" (no model named) takes a slot like any other value, so the
/// label never holds more than MAX_MODEL_LABELS values plus "other".
fn slot<'m, 'n>(
    models: &'m mut HashMap<String, Vec<&'static Series>>,
    model: Option<&'n str>,
) -> (&'n str, &'m mut Vec<&'static Series>) {
    let name = model.unwrap_or("unknown");
    let name = match name.char_indices().nth(100) {
        Some((i, _)) => &name[..i],
        None => name,
    };
    let label = if models.contains_key(name) || models.len() < MAX_MODEL_LABELS {
        name
    } else {
        "other"
    };
    // A label seen before (nearly every request) allocates nothing.
    if !models.contains_key(label) {
        models.insert(label.to_string(), Vec::new());
    }
    (label, models.get_mut(label).expect("inserted above"))
}

/// The process-wide metrics.
pub fn get() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::new)
}

/// Convenience for a histogram observation with fixed labels.
pub fn observe(h: &HistogramVec, labels: &[&str], v: f64) {
    h.with_label_values(labels).observe(v);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_upstream_error_kind_starts_at_zero() {
        use crate::upstream::UpstreamError::*;
        for e in [Connect, Tls, Reset, Timeout] {
            assert!(UPSTREAM_ERROR_KINDS.contains(&e.metric_kind()), "{e:?}");
        }
    }

    #[test]
    fn every_api_has_its_own_handles() {
        for a in crate::provider::ALL.iter().map(|p| p.api()) {
            assert_eq!(get().api(a.as_str()).api, a.as_str());
        }
        assert_eq!(get().api("other").api, "other");
    }

    #[test]
    fn cached_request_counters_are_the_labelled_series() {
        let s = get().series("openai-chat", Some("metrics-unit-model"));
        s.count_request(200);
        s.count_request(200);
        s.count_request(429);
        let labelled = |code: &str| {
            get()
                .requests
                .with_label_values(&["openai-chat", "metrics-unit-model", code])
                .get()
        };
        assert_eq!((labelled("200"), labelled("429")), (2, 1));
        get().api("gemini").ttfb().observe(0.5);
        assert_eq!(
            get().ttfb.with_label_values(&["gemini"]).get_sample_count(),
            1
        );
    }
}
