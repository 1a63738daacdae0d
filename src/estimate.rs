//! STUB: local token estimates (to be replaced).
use crate::inspect::RequestView;
use crate::provider::Provider;

/// A request's local estimate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Estimate {
    /// Tokens the estimator thinks the provider will count.
    pub tokens: u64,
    /// Characters of counted text, for the `chars/4` baseline.
    pub chars: u64,
}

pub struct Estimator;

impl Estimator {
    pub fn new(_cache_bytes: usize) -> Self {
        Estimator
    }
    pub fn estimate(
        &self,
        _p: &dyn Provider,
        req: &RequestView<'_>,
        _model: Option<&str>,
    ) -> Estimate {
        Estimate {
            tokens: req.body.len() as u64 / 4,
            chars: req.body.len() as u64,
        }
    }
}
