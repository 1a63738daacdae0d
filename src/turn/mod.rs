//! A turn: what an HTTP request on a recognised API (`proxy/`) and a
//! WebSocket `response.create` (`ws/responses.rs`) share, in a room below
//! both so that neither imports the other.
//!
//! - `state.rs`: [`State`], what every request needs that outlives it, and
//!   [`Local`], one worker's handle on it.
//! - `error.rs`: every error tidemark answers, mapped to a response in the
//!   API's own shape in one place ([`error_response`]).
//! - `phases.rs`: the phases of a turn either side runs: `identify`,
//!   `estimate`, `project`, `record` (and the window a request is measured
//!   against, and what a refusal teaches).
//! - `outgoing.rs`: the request as it goes upstream.
use http::HeaderName;

pub mod error;
pub mod outgoing;
pub mod phases;
pub mod state;

pub use error::{error_response, shape_provider, ProxyError};
pub use phases::Turn;
pub use state::{Local, State};

pub const X_CONTEXT_PROJECTION: HeaderName = HeaderName::from_static("x-context-projection");
pub const X_CONTEXT_WARNING: HeaderName = HeaderName::from_static("x-context-warning");
pub const X_CONTEXT_TRIMMED: HeaderName = HeaderName::from_static("x-context-trimmed");
pub const X_CONTEXT_RESET: HeaderName = HeaderName::from_static("x-context-reset");
pub const X_TIDEMARK_ERROR: HeaderName = HeaderName::from_static("x-tidemark-error");
pub const X_SHOULD_RETRY: HeaderName = HeaderName::from_static("x-should-retry");
