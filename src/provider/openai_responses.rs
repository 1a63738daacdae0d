//! STUB: to be completed.

use serde_json::Value;

use super::{Api, CountedField, ErrorShape, Observed, Provider};
use crate::inspect::RequestView;

pub struct OpenAiResponses;

impl Provider for OpenAiResponses {
    fn api(&self) -> Api {
        Api::OpenAiResponses
    }
    fn matches_path(&self, path: &str) -> bool {
        path.ends_with("/responses")
    }
    fn model(&self, _path: &str, req: &RequestView<'_>) -> Option<String> {
        req.str("model").map(|s| s.into_owned())
    }
    fn is_stream(&self, _path: &str, _query: Option<&str>, req: &RequestView<'_>) -> bool {
        req.get::<bool>("stream").unwrap_or(false)
    }
    fn counted_fields(&self) -> &'static [CountedField] {
        &[CountedField {
            name: "messages",
            per_element: true,
        }]
    }
    fn max_output_tokens(&self, req: &RequestView<'_>) -> Option<u64> {
        req.get("max_tokens")
    }
    fn may_carry_usage(&self, _event: Option<&str>, data: &[u8]) -> bool {
        memchr::memmem::find(data, b"usage").is_some()
    }
    fn observe(&self, _event: Option<&str>, _json: &Value, _acc: &mut Observed) {}
    fn error_body(&self, _shape: ErrorShape, kind: &str, message: &str) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"error": {"message": message, "type": "api_error", "param": null, "code": kind}}))
            .unwrap_or_default()
    }
}
