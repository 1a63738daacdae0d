//! Faults one request asks for, so a test can break a single exchange of an
//! otherwise well-behaved provider (and watch the next one succeed) without
//! writing its own upstream. The request header `x-sim-fault` holds
//! comma-separated modes (the stream modes act on HTTP streams; the
//! WebSocket mode keeps to [`SimConfig`]):
//!
//! - `hang`: never answer, not even the headers (any path);
//! - `reset-after=N`: send N stream events, then reset the stream;
//! - `stall-after=N`: send N stream events, then fall silent until the
//!   client leaves;
//! - `pace=MS`: wait MS milliseconds between stream events.
//!
//! Faults change only when and how the bytes go out, never what is counted.
//! A request the sim was still hanging or stalling when its client left is
//! counted in [`Abandoned`], so a test can see that the proxy gave up on it.

use std::time::Duration;

use tokio::sync::watch;

use super::SimConfig;

/// Request header naming the faults for this one request.
pub const X_SIM_FAULT: &str = "x-sim-fault";

/// The faults a request asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Fault {
    pub hang: bool,
    pub reset_after: Option<usize>,
    pub stall_after: Option<usize>,
    pub pace: Option<Duration>,
}

impl Fault {
    /// Parse the header's value; unknown or malformed modes are ignored, so
    /// a typo gives a well-behaved answer rather than a confusing one.
    pub fn parse(v: &str) -> Fault {
        let mut f = Fault::default();
        for mode in v.split(',').map(str::trim) {
            let (k, n) = match mode.split_once('=') {
                Some((k, n)) => (k.trim(), n.trim().parse::<u64>().ok()),
                None => (mode, None),
            };
            match (k, n) {
                ("hang", _) => f.hang = true,
                ("reset-after", Some(n)) => f.reset_after = usize::try_from(n).ok(),
                ("stall-after", Some(n)) => f.stall_after = usize::try_from(n).ok(),
                ("pace", Some(ms)) => f.pace = Some(Duration::from_millis(ms)),
                _ => {}
            }
        }
        f
    }

    /// The faults that act on a stream, laid over the sim's own settings.
    pub fn over(self, cfg: &SimConfig) -> SimConfig {
        SimConfig {
            abort_after_events: self.reset_after.or(cfg.abort_after_events),
            stall_after_events: self.stall_after.or(cfg.stall_after_events),
            chunk_delay: self.pace.unwrap_or(cfg.chunk_delay),
            ..cfg.clone()
        }
    }

    pub fn shapes_stream(self) -> bool {
        self.reset_after.is_some() || self.stall_after.is_some() || self.pace.is_some()
    }
}

/// How many requests the sim was hanging or stalling when their client left.
#[derive(Clone)]
pub struct Abandoned(watch::Sender<u64>);

impl Default for Abandoned {
    fn default() -> Self {
        Abandoned(watch::channel(0).0)
    }
}

impl Abandoned {
    pub fn count(&self) -> u64 {
        *self.0.borrow()
    }

    /// Resolve once at least `n` requests have been abandoned.
    pub async fn reach(&self, n: u64) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|&k| k >= n).await;
    }

    pub(crate) fn bump(&self) {
        self.0.send_modify(|k| *k += 1);
    }

    /// A guard that counts one abandoned request when dropped: held across
    /// a wait that only the client's departure ends.
    pub(crate) fn on_drop(&self) -> Bump {
        Bump(self.clone())
    }
}

pub(crate) struct Bump(Abandoned);

impl Drop for Bump {
    fn drop(&mut self) {
        self.0.bump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_typos_are_ignored() {
        let f = Fault::parse("reset-after=3, pace=20,hang");
        assert_eq!(
            f,
            Fault {
                hang: true,
                reset_after: Some(3),
                stall_after: None,
                pace: Some(Duration::from_millis(20)),
            }
        );
        assert_eq!(Fault::parse("reset-after=x,stal-after=2"), Fault::default());
    }
}
