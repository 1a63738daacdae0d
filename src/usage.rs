//! STUB: the tap-side reader: decode -> frame -> provider -> Observed.
use crate::provider::{Framing, Observed, Provider};

pub struct UsageReader {
    observed: Observed,
}

/// What a finished reader knows.
#[derive(Debug, Clone, Default)]
pub struct ReadOutcome {
    pub observed: Observed,
    /// Malformed events, undecodable bytes or a buffer cap hit.
    pub parse_errors: u32,
}

impl UsageReader {
    pub fn new(
        _p: &'static dyn Provider,
        _framing: Framing,
        _content_encoding: Option<&str>,
    ) -> Self {
        UsageReader {
            observed: Observed::default(),
        }
    }
    pub fn feed(&mut self, _chunk: &[u8]) {}
    pub fn finish(&mut self) -> ReadOutcome {
        ReadOutcome {
            observed: self.observed.clone(),
            parse_errors: 0,
        }
    }
}
