//! tidemark: a transparent LLM reverse proxy that knows how full every
//! session's context window really is.
//!
//! (The walk through one request is written when the spine lands.)
#![forbid(unsafe_code)]

pub mod config;
pub mod estimate;
pub mod inspect;
pub mod metrics;
pub mod provider;
pub mod session;
pub mod sse;
pub mod usage;
pub mod window;
