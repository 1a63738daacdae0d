//! Where and how to export: `--otlp-endpoint`, else the standard `OTEL_*`
//! variables, resolved once at start-up into an [`OtlpConfig`].

use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};

/// OTLP/HTTP export, resolved. `None` of it in [`crate::Config`] means off.
#[derive(Debug, Clone)]
pub struct OtlpConfig {
    /// Where spans go (`.../v1/traces`); `None`: spans are not exported.
    pub traces: Option<Uri>,
    /// Where metrics go (`.../v1/metrics`); `None`: metrics are not exported.
    pub metrics: Option<Uri>,
    /// Sent with every export (`OTEL_EXPORTER_OTLP_HEADERS`, then the
    /// signal's own), e.g. a collector's API key. Never logged.
    pub trace_headers: Vec<(HeaderName, HeaderValue)>,
    pub metric_headers: Vec<(HeaderName, HeaderValue)>,
    /// The resource: `service.name` and `OTEL_RESOURCE_ATTRIBUTES`.
    pub resource: Vec<(String, String)>,
    /// Longest a finished span waits before it is sent (`OTEL_BSP_SCHEDULE_DELAY`).
    pub span_delay: Duration,
    /// Spans held for export at most; more are dropped and counted
    /// (`OTEL_BSP_MAX_QUEUE_SIZE`).
    pub max_queue: usize,
    /// Spans per export request at most (`OTEL_BSP_MAX_EXPORT_BATCH_SIZE`).
    pub max_batch: usize,
    /// Between two metric exports (`OTEL_METRIC_EXPORT_INTERVAL`).
    pub metric_interval: Duration,
    /// One export request, connect to answer (`OTEL_EXPORTER_OTLP_TIMEOUT`).
    pub timeout: Duration,
}

/// Read a variable: the process environment in production, a table in tests.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process environment, empty values as unset (the OTel convention).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl OtlpConfig {
    /// `flag` is `--otlp-endpoint` (or `TIDEMARK_OTLP_ENDPOINT`): a base URL
    /// as `OTEL_EXPORTER_OTLP_ENDPOINT` is, and it wins over every
    /// endpoint variable. `Ok(None)`: export is off.
    pub fn resolve(flag: Option<&str>, env: Env<'_>) -> Result<Option<OtlpConfig>, String> {
        let get = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        if get("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let flag = flag.map(str::trim).filter(|f| !f.is_empty());
        let base = match flag {
            Some(f) => Some(f.to_string()),
            None => get("OTEL_EXPORTER_OTLP_ENDPOINT"),
        };
        // A signal's endpoint: the flag's base plus its path, else the
        // signal's own variable as it is, else the general base plus the path.
        let signal = |var: &str, path: &str, exporter: &str| -> Result<Option<Uri>, String> {
            if get(exporter).is_some_and(|v| v.trim() == "none") {
                return Ok(None);
            }
            let url = match (flag, get(var)) {
                (None, Some(own)) => own,
                _ => match &base {
                    Some(b) => join(b, path),
                    None => return Ok(None),
                },
            };
            endpoint(&url).map(Some)
        };
        let traces = signal(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "v1/traces",
            "OTEL_TRACES_EXPORTER",
        )?;
        let metrics = signal(
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
            "v1/metrics",
            "OTEL_METRICS_EXPORTER",
        )?;
        if traces.is_none() && metrics.is_none() {
            return Ok(None);
        }
        for var in [
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL",
        ] {
            if let Some(p) = get(var).filter(|p| p.trim() != "http/protobuf") {
                return Err(format!(
                    "{var}={p}: tidemark exports OTLP over HTTP/protobuf only \
                     (a collector's port 4318); unset it or set http/protobuf"
                ));
            }
        }
        let headers = |own: &str| -> Vec<(HeaderName, HeaderValue)> {
            let mut h = header_list("OTEL_EXPORTER_OTLP_HEADERS", get);
            for (k, v) in header_list(own, get) {
                h.retain(|(n, _)| *n != k);
                h.push((k, v));
            }
            h
        };
        let mut resource = match get("OTEL_RESOURCE_ATTRIBUTES") {
            Some(v) => parse_pairs(&v).unwrap_or_else(|| {
                tracing::warn!(
                    "OTEL_RESOURCE_ATTRIBUTES is not a list of key=value pairs \
                     (values percent-encoded); ignored"
                );
                Vec::new()
            }),
            None => Vec::new(),
        };
        let service = get("OTEL_SERVICE_NAME")
            .map(|s| s.trim().to_string())
            .or_else(|| {
                resource
                    .iter()
                    .find(|(k, _)| k == "service.name")
                    .map(|(_, v)| v.clone())
            })
            .unwrap_or_else(|| "tidemark".to_string());
        resource.retain(|(k, _)| k != "service.name");
        resource.insert(0, ("service.name".to_string(), service));
        if !resource.iter().any(|(k, _)| k == "service.version") {
            resource.push((
                "service.version".to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            ));
        }
        let millis = |var: &str, default: u64| -> Duration {
            Duration::from_millis(
                get(var)
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(default),
            )
        };
        let count = |var: &str, default: usize| -> usize {
            get(var)
                .and_then(|v| v.trim().parse().ok())
                .filter(|n| *n > 0)
                .unwrap_or(default)
        };
        let max_queue = count("OTEL_BSP_MAX_QUEUE_SIZE", 2048);
        Ok(Some(OtlpConfig {
            traces,
            metrics,
            trace_headers: headers("OTEL_EXPORTER_OTLP_TRACES_HEADERS"),
            metric_headers: headers("OTEL_EXPORTER_OTLP_METRICS_HEADERS"),
            resource,
            span_delay: millis("OTEL_BSP_SCHEDULE_DELAY", 5000),
            max_queue,
            max_batch: count("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512).min(max_queue),
            metric_interval: millis("OTEL_METRIC_EXPORT_INTERVAL", 60_000)
                .max(Duration::from_millis(10)),
            timeout: millis("OTEL_EXPORTER_OTLP_TIMEOUT", 10_000).max(Duration::from_millis(10)),
        }))
    }
}

/// A base URL and a signal's path, one slash between them (the spec's
/// rule for `OTEL_EXPORTER_OTLP_ENDPOINT`).
fn join(base: &str, path: &str) -> String {
    let base = base.trim();
    match base.ends_with('/') {
        true => format!("{base}{path}"),
        false => format!("{base}/{path}"),
    }
}

fn endpoint(url: &str) -> Result<Uri, String> {
    let uri: Uri = url
        .trim()
        .parse()
        .map_err(|e| format!("OTLP endpoint `{url}`: {e}"))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http" | "https"), Some(_)) => Ok(uri),
        _ => Err(format!(
            "OTLP endpoint `{url}`: an http:// or https:// URL with a host"
        )),
    }
}

/// `OTEL_EXPORTER_OTLP_HEADERS` and the like: pairs that are not valid
/// header names or values are left out (and said so once, without values).
fn header_list(var: &str, get: impl Fn(&str) -> Option<String>) -> Vec<(HeaderName, HeaderValue)> {
    let Some(v) = get(var) else {
        return Vec::new();
    };
    let Some(pairs) = parse_pairs(&v) else {
        tracing::warn!("{var} is not a list of key=value pairs (values percent-encoded); ignored");
        return Vec::new();
    };
    let mut out = Vec::new();
    for (k, v) in pairs {
        match (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_str(&v),
        ) {
            (Ok(k), Ok(mut v)) => {
                v.set_sensitive(true);
                out.push((k, v));
            }
            _ => tracing::warn!(header = %k, "{var}: not a valid header; left out"),
        }
    }
    out
}

/// The OTel environment's list format (W3C Baggage's, without properties):
/// `key1=value1,key2=value2`, blanks around each part ignored, values
/// percent-decoded. `None` when any member is malformed: the spec says to
/// discard the whole value then, not to guess.
pub fn parse_pairs(s: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    for member in s.split(',') {
        let member = member.trim();
        if member.is_empty() {
            continue;
        }
        let (k, v) = member.split_once('=')?;
        let k = k.trim();
        if k.is_empty() {
            return None;
        }
        out.push((percent_decode(k)?, percent_decode(v.trim())?));
    }
    Some(out)
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(flag: Option<&str>, vars: &[(&str, &str)]) -> Result<Option<OtlpConfig>, String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let env = move |k: &str| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        OtlpConfig::resolve(flag, &env)
    }

    #[test]
    fn off_unless_an_endpoint_is_given() {
        assert!(resolve(None, &[]).unwrap().is_none());
        assert!(resolve(None, &[("OTEL_SERVICE_NAME", "x")])
            .unwrap()
            .is_none());
        let c = resolve(None, &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318")])
            .unwrap()
            .unwrap();
        assert_eq!(c.traces.unwrap().to_string(), "http://c:4318/v1/traces");
        assert_eq!(c.metrics.unwrap().to_string(), "http://c:4318/v1/metrics");
        assert!(
            resolve(Some("http://c:4318"), &[("OTEL_SDK_DISABLED", "true")])
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn signal_endpoints_are_used_as_they_are_and_the_flag_wins() {
        let vars = [
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://base:4318/otlp/"),
            ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "https://t:1/custom"),
        ];
        let c = resolve(None, &vars).unwrap().unwrap();
        assert_eq!(c.traces.unwrap().to_string(), "https://t:1/custom");
        assert_eq!(
            c.metrics.unwrap().to_string(),
            "http://base:4318/otlp/v1/metrics"
        );
        let c = resolve(Some("http://flag:9"), &vars).unwrap().unwrap();
        assert_eq!(c.traces.unwrap().to_string(), "http://flag:9/v1/traces");
        let c = resolve(Some("http://flag:9"), &[("OTEL_METRICS_EXPORTER", "none")])
            .unwrap()
            .unwrap();
        assert!(c.metrics.is_none() && c.traces.is_some());
        assert!(resolve(Some("ftp://x"), &[]).is_err());
        assert!(resolve(Some("http://x"), &[("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]).is_err());
    }

    #[test]
    fn headers_and_resource_are_percent_encoded_pairs() {
        let c = resolve(
            Some("http://c"),
            &[
                (
                    "OTEL_EXPORTER_OTLP_HEADERS",
                    " api-key = s%3Dcret%2C1 , x-team=a b",
                ),
                ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-team=traces"),
                (
                    "OTEL_RESOURCE_ATTRIBUTES",
                    "deployment.environment=prod,service.name=from-attrs,k8s.pod.name=p%2D1",
                ),
            ],
        )
        .unwrap()
        .unwrap();
        let h = |v: &[(HeaderName, HeaderValue)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string()))
                .collect()
        };
        assert_eq!(
            h(&c.metric_headers),
            [("api-key", "s=cret,1"), ("x-team", "a b")]
                .map(|(a, b)| (a.to_string(), b.to_string()))
        );
        assert_eq!(
            h(&c.trace_headers),
            [("api-key", "s=cret,1"), ("x-team", "traces")]
                .map(|(a, b)| (a.to_string(), b.to_string()))
        );
        let r: Vec<(&str, &str)> = c
            .resource
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(r[0], ("service.name", "from-attrs"));
        assert!(r.contains(&("deployment.environment", "prod")));
        assert!(r.contains(&("k8s.pod.name", "p-1")));
        let c = resolve(
            Some("http://c"),
            &[
                ("OTEL_SERVICE_NAME", "gateway"),
                ("OTEL_RESOURCE_ATTRIBUTES", "service.name=x"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.resource[0], ("service.name".into(), "gateway".into()));
        // One malformed member discards the whole list.
        assert_eq!(parse_pairs("a=1,b"), None);
        assert_eq!(parse_pairs("a=%zz"), None);
        assert_eq!(parse_pairs(""), Some(vec![]));
    }
}
