//! Finished requests into OTLP messages (the official protobuf definitions,
//! `opentelemetry-proto`): spans, the GenAI metrics aggregated here, and
//! tidemark's own metrics read off the Prometheus registry.

use std::collections::HashMap;

use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, InstrumentationScope, KeyValue};
use opentelemetry_proto::tonic::metrics::v1::{
    metric, number_data_point, AggregationTemporality, Gauge, Histogram, HistogramDataPoint,
    Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics, Sum,
};
use opentelemetry_proto::tonic::resource::v1::Resource;
use opentelemetry_proto::tonic::trace::v1::{
    span, status, ResourceSpans, ScopeSpans, Span, Status,
};
use sha2::{Digest, Sha256};

use super::{ErrorType, Finished};

/// `gen_ai.client.token.usage`'s bucket boundaries, as the conventions give them.
const TOKEN_BOUNDS: &[f64] = &[
    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0,
    16777216.0, 67108864.0,
];
/// `gen_ai.client.operation.duration`'s, as the conventions give them.
const DURATION_BOUNDS: &[f64] = &[
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];

/// Distinct models the GenAI metrics keep apart; the rest are `other`
/// (as the Prometheus `model` label is capped).
const MAX_MODELS: usize = crate::metrics::MAX_MODEL_LABELS;

/// tidemark's own metrics, by the Prometheus family each is read from:
/// (family, OTLP name, unit). A family not registered yet is skipped, so a
/// row may name one that another change adds: the cache-bust counting
/// registers `tidemark_cache_busts_total` and it is exported as
/// `tidemark.cache.busts` from then on, with no change here.
pub(super) const OWN: &[(&str, &str, &str)] = &[
    (
        "tidemark_projection_error_ratio",
        "tidemark.projection.error",
        "1",
    ),
    (
        "tidemark_estimate_error_ratio",
        "tidemark.estimate.error",
        "1",
    ),
    (
        "tidemark_projection_drift_ratio",
        "tidemark.projection.drift",
        "1",
    ),
    (
        "tidemark_estimate_drift_ratio",
        "tidemark.estimate.drift",
        "1",
    ),
    (
        "tidemark_context_utilization",
        "tidemark.context.utilization",
        "1",
    ),
    (
        "tidemark_anchor_lost_total",
        "tidemark.anchor.losses",
        "{loss}",
    ),
    (
        "tidemark_usage_missing_total",
        "tidemark.usage.missing",
        "{response}",
    ),
    (
        "tidemark_compactions_detected_total",
        "tidemark.compactions",
        "{compaction}",
    ),
    (
        "tidemark_over_budget_total",
        "tidemark.over_budget",
        "{request}",
    ),
    (
        "tidemark_cache_busts_total",
        "tidemark.cache.busts",
        "{bust}",
    ),
    (
        "tidemark_cache_invalidated_tokens_total",
        "tidemark.cache.invalidated_tokens",
        "{token}",
    ),
    ("tidemark_sessions", "tidemark.sessions", "{session}"),
];

fn kv(key: &str, v: any_value::Value) -> KeyValue {
    KeyValue {
        key: key.to_string(),
        value: Some(AnyValue { value: Some(v) }),
        ..Default::default()
    }
}
fn s(key: &str, v: impl Into<String>) -> KeyValue {
    kv(key, any_value::Value::StringValue(v.into()))
}
fn int(key: &str, v: u64) -> KeyValue {
    kv(
        key,
        any_value::Value::IntValue(v.min(i64::MAX as u64) as i64),
    )
}

pub(super) fn resource(pairs: &[(String, String)]) -> Resource {
    Resource {
        attributes: pairs.iter().map(|(k, v)| s(k, v.as_str())).collect(),
        ..Default::default()
    }
}

fn scope() -> InstrumentationScope {
    InstrumentationScope {
        name: "tidemark".to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        ..Default::default()
    }
}

/// `gen_ai.conversation.id`: the first 16 hex digits (64 bits) of the
/// SHA-256 of `credential:key` — the credential already its 8-hex hash, as
/// in `GET /sessions` — so an operator can find a session's spans from
/// its session object, and no key leaves the process.
pub(super) fn conversation_id(credential_and_key: &str) -> String {
    crate::session::hex(&Sha256::digest(credential_and_key.as_bytes())[..8])
}

/// One request's span (kind CLIENT: tidemark calls the provider on the
/// agent's behalf).
pub(super) fn span(f: &Finished) -> Span {
    let o = &f.open;
    let g = o.api.provider().genai();
    let name = match &f.model {
        Some(m) => format!("{} {m}", g.operation),
        None => g.operation.to_string(),
    };
    let mut a = Vec::with_capacity(20);
    a.push(s("gen_ai.operation.name", g.operation));
    a.push(s("gen_ai.provider.name", g.provider));
    a.push(s("tidemark.api", o.api.as_str()));
    if let Some(m) = &f.model {
        a.push(s("gen_ai.request.model", &**m));
    }
    if let Some(n) = f.max_output {
        a.push(int("gen_ai.request.max_tokens", n));
    }
    let u = &f.usage;
    let usage = [
        ("gen_ai.usage.input_tokens", u.total_context),
        ("gen_ai.usage.output_tokens", u.output),
        ("gen_ai.usage.cache_read.input_tokens", u.cached_input),
        ("gen_ai.usage.cache_creation.input_tokens", u.cache_creation),
    ];
    for (k, v) in usage {
        if let Some(v) = v {
            a.push(int(k, v));
        }
    }
    if let Some(c) = &f.conversation {
        a.push(s("gen_ai.conversation.id", conversation_id(c)));
    }
    a.push(int("tidemark.projection", f.projection));
    a.push(s("tidemark.projection.src", f.src));
    if let Some(w) = f.window.filter(|w| *w > 0) {
        a.push(int("tidemark.window", w));
        a.push(kv(
            "tidemark.utilization",
            any_value::Value::DoubleValue(f.projection as f64 / w as f64),
        ));
    }
    if let Some(l) = f.lane {
        a.push(s("tidemark.lane", crate::session::lane_hex(l)));
    }
    if let Some(k) = f.key_source {
        a.push(s("tidemark.session.key_source", k));
    }
    if f.status > 0 {
        a.push(int("http.response.status_code", f.status as u64));
    }
    let status = match f.error {
        Some(e) => {
            a.push(s("error.type", error_type(e)));
            Status {
                code: status::StatusCode::Error as i32,
                ..Default::default()
            }
        }
        None => Status::default(),
    };
    // The trace flags, and whether the parent is remote (it always is).
    let mut flags = if o.sampled { 1 } else { 0 } | 0x100;
    if o.parent.is_some() {
        flags |= 0x200;
    }
    Span {
        trace_id: o.trace_id.to_vec(),
        span_id: o.span_id.to_vec(),
        trace_state: o.trace_state.as_deref().unwrap_or_default().to_string(),
        parent_span_id: o.parent.map(|p| p.to_vec()).unwrap_or_default(),
        flags,
        name,
        kind: span::SpanKind::Client as i32,
        start_time_unix_nano: o.start_unix_nano,
        end_time_unix_nano: f.end_unix_nano,
        attributes: a,
        status: Some(status),
        ..Default::default()
    }
}

fn error_type(e: ErrorType) -> String {
    match e {
        ErrorType::Own(k) => k.to_string(),
        ErrorType::Status(s) => s.to_string(),
    }
}

pub(super) fn traces(resource: &Resource, spans: Vec<Span>) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(resource.clone()),
            scope_spans: vec![ScopeSpans {
                scope: Some(scope()),
                spans,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

pub(super) fn metrics(resource: &Resource, metrics: Vec<Metric>) -> ExportMetricsServiceRequest {
    ExportMetricsServiceRequest {
        resource_metrics: vec![ResourceMetrics {
            resource: Some(resource.clone()),
            scope_metrics: vec![ScopeMetrics {
                scope: Some(scope()),
                metrics,
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
}

/// An explicit-bucket histogram, cumulative since the exporter started.
struct Hist {
    bounds: &'static [f64],
    counts: Vec<u64>,
    count: u64,
    sum: f64,
    min: f64,
    max: f64,
}

impl Hist {
    fn new(bounds: &'static [f64]) -> Self {
        Hist {
            bounds,
            counts: vec![0; bounds.len() + 1],
            count: 0,
            sum: 0.0,
            min: f64::INFINITY,
            max: f64::NEG_INFINITY,
        }
    }
    fn observe(&mut self, v: f64) {
        // A bucket holds values up to and including its bound.
        self.counts[self.bounds.partition_point(|b| *b < v)] += 1;
        self.count += 1;
        self.sum += v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
    }
    fn point(&self, attributes: Vec<KeyValue>, start: u64, now: u64) -> HistogramDataPoint {
        HistogramDataPoint {
            attributes,
            start_time_unix_nano: start,
            time_unix_nano: now,
            count: self.count,
            sum: Some(self.sum),
            bucket_counts: self.counts.clone(),
            explicit_bounds: self.bounds.to_vec(),
            min: Some(self.min),
            max: Some(self.max),
            ..Default::default()
        }
    }
}

/// The attributes a GenAI metric point is kept apart by.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    operation: &'static str,
    provider: &'static str,
    model: Option<Box<str>>,
    /// `gen_ai.token.type` (token usage), or `error.type` (duration).
    kind: Option<Box<str>>,
}

impl Key {
    fn attributes(&self, kind_name: &str) -> Vec<KeyValue> {
        let mut a = vec![
            s("gen_ai.operation.name", self.operation),
            s("gen_ai.provider.name", self.provider),
        ];
        if let Some(m) = &self.model {
            a.push(s("gen_ai.request.model", &**m));
        }
        if let Some(k) = &self.kind {
            a.push(s(kind_name, &**k));
        }
        a
    }
}

/// The GenAI client metrics, aggregated on the exporter's side of the
/// queue (the request path only pushes).
pub(super) struct GenAiMetrics {
    start: u64,
    tokens: HashMap<Key, Hist>,
    duration: HashMap<Key, Hist>,
    models: std::collections::HashSet<Box<str>>,
}

impl GenAiMetrics {
    pub(super) fn new(start: u64) -> Self {
        GenAiMetrics {
            start,
            tokens: HashMap::new(),
            duration: HashMap::new(),
            models: Default::default(),
        }
    }

    pub(super) fn add(&mut self, f: &Finished) {
        let g = f.open.api.provider().genai();
        let model = f.model.as_ref().map(|m| {
            if self.models.contains(m) || self.models.len() < MAX_MODELS {
                self.models.insert(m.clone());
                m.clone()
            } else {
                "other".into()
            }
        });
        let key = |kind: Option<&str>| Key {
            operation: g.operation,
            provider: g.provider,
            model: model.clone(),
            kind: kind.map(Into::into),
        };
        for (kind, n) in [("input", f.usage.total_context), ("output", f.usage.output)] {
            if let Some(n) = n {
                self.tokens
                    .entry(key(Some(kind)))
                    .or_insert_with(|| Hist::new(TOKEN_BOUNDS))
                    .observe(n as f64);
            }
        }
        let error = f.error.map(error_type);
        self.duration
            .entry(key(error.as_deref()))
            .or_insert_with(|| Hist::new(DURATION_BOUNDS))
            .observe(f.duration);
    }

    pub(super) fn metrics(&self, now: u64) -> Vec<Metric> {
        let hist =
            |name: &str, desc: &str, unit: &str, map: &HashMap<Key, Hist>, kind: &str| Metric {
                name: name.to_string(),
                description: desc.to_string(),
                unit: unit.to_string(),
                data: Some(metric::Data::Histogram(Histogram {
                    data_points: map
                        .iter()
                        .map(|(k, h)| h.point(k.attributes(kind), self.start, now))
                        .collect(),
                    aggregation_temporality: AggregationTemporality::Cumulative as i32,
                })),
                ..Default::default()
            };
        let mut out = Vec::new();
        if !self.tokens.is_empty() {
            out.push(hist(
                "gen_ai.client.token.usage",
                "Number of input and output tokens used",
                "{token}",
                &self.tokens,
                "gen_ai.token.type",
            ));
        }
        if !self.duration.is_empty() {
            out.push(hist(
                "gen_ai.client.operation.duration",
                "GenAI operation duration",
                "s",
                &self.duration,
                "error.type",
            ));
        }
        out
    }
}

/// tidemark's own metrics ([`OWN`]), read off the Prometheus registry the
/// request path already feeds: nothing more to do per request.
pub(super) fn own_metrics(
    families: &[prometheus::proto::MetricFamily],
    start: u64,
    now: u64,
) -> Vec<Metric> {
    use prometheus::proto::MetricType;
    let mut out = Vec::new();
    for f in families {
        let Some((_, name, unit)) = OWN.iter().find(|(p, _, _)| *p == f.name()) else {
            continue;
        };
        let attrs = |m: &prometheus::proto::Metric| -> Vec<KeyValue> {
            let mut a = Vec::new();
            for l in m.get_label() {
                let v = l.value();
                match l.name() {
                    "api" => {
                        if let Some(p) = crate::provider::ALL.iter().find(|p| p.api().as_str() == v)
                        {
                            a.push(s("gen_ai.provider.name", p.genai().provider));
                        }
                        a.push(s("tidemark.api", v));
                    }
                    "model" => a.push(s("gen_ai.request.model", v)),
                    other => a.push(s(&format!("tidemark.{other}"), v)),
                }
            }
            a
        };
        let number = |m: &prometheus::proto::Metric, v: number_data_point::Value| NumberDataPoint {
            attributes: attrs(m),
            start_time_unix_nano: start,
            time_unix_nano: now,
            value: Some(v),
            ..Default::default()
        };
        let data = match f.get_field_type() {
            MetricType::COUNTER => metric::Data::Sum(Sum {
                data_points: f
                    .get_metric()
                    .iter()
                    .map(|m| {
                        let v = m.get_counter().get_value();
                        number(m, number_data_point::Value::AsInt(v as i64))
                    })
                    .collect(),
                aggregation_temporality: AggregationTemporality::Cumulative as i32,
                is_monotonic: true,
            }),
            MetricType::GAUGE => metric::Data::Gauge(Gauge {
                data_points: f
                    .get_metric()
                    .iter()
                    .map(|m| {
                        let v = m.get_gauge().get_value();
                        number(m, number_data_point::Value::AsDouble(v))
                    })
                    .collect(),
            }),
            MetricType::HISTOGRAM => metric::Data::Histogram(Histogram {
                data_points: f
                    .get_metric()
                    .iter()
                    .map(|m| {
                        let h = m.get_histogram();
                        let buckets: Vec<_> = h
                            .get_bucket()
                            .iter()
                            .filter(|b| b.upper_bound().is_finite())
                            .collect();
                        // Prometheus counts are cumulative per bucket;
                        // OTLP's are each bucket's own, the last past every bound.
                        let mut counts = Vec::with_capacity(buckets.len() + 1);
                        let mut below = 0;
                        for b in &buckets {
                            counts.push(b.cumulative_count().saturating_sub(below));
                            below = b.cumulative_count();
                        }
                        counts.push(h.get_sample_count().saturating_sub(below));
                        HistogramDataPoint {
                            attributes: attrs(m),
                            start_time_unix_nano: start,
                            time_unix_nano: now,
                            count: h.get_sample_count(),
                            sum: Some(h.get_sample_sum()),
                            bucket_counts: counts,
                            explicit_bounds: buckets.iter().map(|b| b.upper_bound()).collect(),
                            ..Default::default()
                        }
                    })
                    .collect(),
                aggregation_temporality: AggregationTemporality::Cumulative as i32,
            }),
            _ => continue,
        };
        out.push(Metric {
            name: name.to_string(),
            description: f.help().to_string(),
            unit: unit.to_string(),
            data: Some(data),
            ..Default::default()
        });
    }
    out
}

/// Data points in a metrics request (what a failed export drops).
pub(super) fn points(metrics: &[Metric]) -> u64 {
    metrics
        .iter()
        .map(|m| match &m.data {
            Some(metric::Data::Histogram(h)) => h.data_points.len(),
            Some(metric::Data::Sum(s)) => s.data_points.len(),
            Some(metric::Data::Gauge(g)) => g.data_points.len(),
            _ => 0,
        } as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_on_a_bound_is_in_that_bound_s_bucket() {
        let mut h = Hist::new(TOKEN_BOUNDS);
        for v in [0.5, 1.0, 1.5, 4.0, 1e9] {
            h.observe(v);
        }
        assert_eq!(&h.counts[..3], &[2, 2, 0]);
        assert_eq!(h.counts[TOKEN_BOUNDS.len()], 1);
        assert_eq!((h.count, h.min, h.max), (5, 0.5, 1e9));
    }

    #[test]
    fn prometheus_histograms_become_per_bucket_counts() {
        let reg = prometheus::Registry::new();
        let h = prometheus::HistogramVec::new(
            prometheus::HistogramOpts::new("tidemark_context_utilization", "u")
                .buckets(vec![0.5, 1.0]),
            &["api", "model"],
        )
        .unwrap();
        reg.register(Box::new(h.clone())).unwrap();
        for v in [0.2, 0.7, 0.9, 3.0] {
            h.with_label_values(&["gemini", "g"]).observe(v);
        }
        let m = own_metrics(&reg.gather(), 1, 2);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].name, "tidemark.context.utilization");
        let Some(metric::Data::Histogram(h)) = &m[0].data else {
            panic!("a histogram");
        };
        let p = &h.data_points[0];
        assert_eq!(p.bucket_counts, vec![1, 2, 1]);
        assert_eq!(p.explicit_bounds, vec![0.5, 1.0]);
        let keys: Vec<_> = p.attributes.iter().map(|k| k.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "gen_ai.provider.name",
                "tidemark.api",
                "gen_ai.request.model"
            ]
        );
    }

    /// The cache-bust counting is exported once its family exists, by
    /// name: the hook this file leaves for it.
    #[test]
    fn a_cache_bust_family_is_exported_when_registered() {
        let reg = prometheus::Registry::new();
        let c = prometheus::IntCounterVec::new(
            prometheus::Opts::new("tidemark_cache_busts_total", "busts"),
            &["api", "model", "cause"],
        )
        .unwrap();
        reg.register(Box::new(c.clone())).unwrap();
        c.with_label_values(&["anthropic-messages", "m", "system"])
            .inc_by(3);
        let m = own_metrics(&reg.gather(), 1, 2);
        assert_eq!(m[0].name, "tidemark.cache.busts");
        let Some(metric::Data::Sum(s)) = &m[0].data else {
            panic!("a sum");
        };
        assert!(s.is_monotonic);
        assert_eq!(
            s.data_points[0].value,
            Some(number_data_point::Value::AsInt(3))
        );
        assert!(s.data_points[0]
            .attributes
            .iter()
            .any(|k| k.key == "tidemark.cause"));
    }

    #[test]
    fn the_conversation_id_is_a_sha256_prefix_never_the_key() {
        let id = conversation_id("1a2b3c4d:my-session");
        assert_eq!(id.len(), 16);
        assert_eq!(
            id,
            crate::session::hex(&Sha256::digest(b"1a2b3c4d:my-session")[..8])
        );
        assert!(!id.contains("my-session"));
    }
}
