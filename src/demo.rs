//! `tidemark demo`: an embedded simulated provider and a scripted agent.
//! (Placeholder until the demo lands: it says so instead of pretending.)

use crate::config::Flags;

pub async fn main(_flags: Flags, _turns: u32, _keep_running: bool) -> Result<(), String> {
    Err("the demo is not built yet (issue 7)".to_string())
}
