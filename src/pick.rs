//! The response picker moved to [`crate::json`]; this name stays for the
//! modules not yet moved over.

pub use crate::json::{content, pick};
