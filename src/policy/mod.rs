//! Policy: what tidemark does with a request once it is projected.
//!
//! - `decide.rs`: the [`Verdict`](decide::Verdict) — pass, reject (the
//!   session's budget, or over the line with `--on-over reject`), or trim.
//! - `cut.rs`: a trim as the session makes it: the sticky cut (so provider
//!   prompt caches survive), measured with the session's own ruler, and
//!   kept only when it brings the request under the line. The cutting
//!   itself is `trim.rs`.
pub mod cut;
pub mod decide;
pub mod trim;

pub use cut::Cuts;
pub use decide::{decide, over, settled, Over, Refusal, Verdict};
