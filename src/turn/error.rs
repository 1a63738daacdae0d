//! Errors mapped to responses, in one place: every error tidemark answers
//! itself, by the side it came from, in the API's own error shape.
use std::time::Instant;

use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Response, StatusCode};

use super::{X_SHOULD_RETRY, X_TIDEMARK_ERROR};
use crate::metrics;
use crate::policy::Refusal;
use crate::provider::{self, Api, ErrorShape, Provider};
use crate::tap::ObservedBody;
use crate::upstream::UpstreamError;

/// Errors tidemark itself answers, by the side they came from.
#[derive(Debug)]
pub enum ProxyError {
    /// The client's body is over `--max-body-bytes`.
    BodyTooLarge,
    /// The client's body could not be read (client gone or broken framing).
    ClientBody,
    /// The client stopped sending its body (silent past `--header-read-timeout`).
    ClientTimeout,
    /// The upstream could not be reached or failed before answering.
    Upstream(UpstreamError),
    /// The projection is over the line and the policy is reject (or a trim could not shrink enough).
    ContextBudget { projected: u64, window: u64 },
    /// The session spent its `--session-budget`.
    SessionBudget { spent: u64, budget: u64 },
}

impl From<Refusal> for ProxyError {
    fn from(r: Refusal) -> ProxyError {
        match r {
            Refusal::SessionBudget { spent, budget } => ProxyError::SessionBudget { spent, budget },
            Refusal::Context(o) => ProxyError::ContextBudget {
                projected: o.projected,
                window: o.window,
            },
        }
    }
}

impl ProxyError {
    /// The error's shape in the API's own terms (its body is the provider's).
    pub fn shape(&self) -> ErrorShape {
        match *self {
            ProxyError::ContextBudget { projected, window } => {
                ErrorShape::ContextLength { projected, window }
            }
            ProxyError::SessionBudget { spent, budget } => {
                ErrorShape::SessionBudget { spent, budget }
            }
            ref other => ErrorShape::Generic {
                status: other.status().as_u16(),
            },
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ClientBody => StatusCode::BAD_REQUEST,
            ProxyError::ClientTimeout => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Upstream(UpstreamError::Timeout) => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::Upstream(_) => StatusCode::BAD_GATEWAY,
            ProxyError::ContextBudget { .. } | ProxyError::SessionBudget { .. } => {
                StatusCode::BAD_REQUEST
            }
        }
    }
    pub fn kind(&self) -> &'static str {
        match self {
            ProxyError::BodyTooLarge => "body-too-large",
            ProxyError::ClientBody => "client-body",
            ProxyError::ClientTimeout => "client-timeout",
            ProxyError::Upstream(u) => u.header_kind(),
            ProxyError::ContextBudget { .. } => "context-budget",
            ProxyError::SessionBudget { .. } => "session-budget",
        }
    }
    pub fn message(&self, max_body: usize) -> String {
        match self {
            ProxyError::BodyTooLarge => {
                format!("request body exceeds the proxy's limit of {max_body} bytes")
            }
            ProxyError::ClientBody => "the request body could not be read".to_string(),
            ProxyError::ClientTimeout => "the client stopped sending the request body".to_string(),
            ProxyError::Upstream(UpstreamError::Connect) => {
                "tidemark could not connect to the upstream".to_string()
            }
            ProxyError::Upstream(UpstreamError::Tls) => {
                "TLS handshake with the upstream failed".to_string()
            }
            ProxyError::Upstream(UpstreamError::Reset) => {
                "the upstream closed the connection before answering".to_string()
            }
            ProxyError::Upstream(UpstreamError::Timeout) => {
                "the upstream did not answer in time".to_string()
            }
            ProxyError::ContextBudget { projected, window } => {
                format!("projected prompt of {projected} tokens is over the budget for a {window}-token window")
            }
            ProxyError::SessionBudget { spent, budget } => {
                format!("session_budget_exceeded: this session spent {spent} tokens of its {budget}-token budget")
            }
        }
    }
}

/// The provider whose error shape fits a path: its own API, else a guess from
/// the path, else OpenAI's (the default upstream).
pub fn shape_provider(path: &str) -> &'static dyn Provider {
    provider::for_path(path)
        .or_else(|| {
            provider::ALL
                .iter()
                .copied()
                .find(|p| p.resembles_path(path))
        })
        .unwrap_or_else(|| Api::OpenAiChat.provider())
}

/// Map an error to its response: status, body in the API's shape, `x-tidemark-error`.
pub fn error_response(
    err: &ProxyError,
    p: &dyn Provider,
    max_body: usize,
) -> Response<ObservedBody> {
    let body = p.error_body(err.shape(), err.kind(), &err.message(max_body));
    let mut resp = Response::new(ObservedBody::full(body));
    *resp.status_mut() = err.status();
    let h = resp.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert(X_TIDEMARK_ERROR, HeaderValue::from_static(err.kind()));
    if matches!(
        err,
        ProxyError::ContextBudget { .. } | ProxyError::SessionBudget { .. }
    ) {
        h.insert(X_SHOULD_RETRY, HeaderValue::from_static("false"));
    }
    resp
}

/// A response tidemark answers itself, before or instead of an upstream's:
/// counted in `tidemark_requests_total` and timed from `start` in the
/// duration histogram, as every request is (SPEC §7).
pub fn answered(api: &str, model: &str, status: StatusCode, start: Instant) {
    let m = metrics::get();
    m.requests
        .with_label_values(&[api, model, status.as_str()])
        .inc();
    m.api(api)
        .request_duration()
        .observe(start.elapsed().as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unowned_paths_get_the_shape_they_resemble() {
        let api = |path| shape_provider(path).api();
        assert_eq!(api("/v1/messages"), Api::Anthropic);
        assert_eq!(api("/v2/messages/batches"), Api::Anthropic);
        assert_eq!(api("/api/embed"), Api::Ollama);
        assert_eq!(api("/api/models/x:y"), Api::Ollama);
        assert_eq!(api("/api/messages"), Api::Anthropic);
        assert_eq!(api("/v1/models/gemini-2.5-pro:embedContent"), Api::Gemini);
        assert_eq!(api("/v1/embeddings"), Api::OpenAiChat);
        assert_eq!(api("/v1/models"), Api::OpenAiChat);
    }
}
