//! STUB: context window table.
use crate::config::WindowRule;

pub fn window_for(_rules: &[WindowRule], _model: &str) -> Option<u64> {
    None
}
