//! decide: the session budget first, then the context budget, then
//! `--on-over` says what an over-the-line request gets.
use crate::config::{Config, OnOver};
use crate::metrics;
use crate::session::Begun;

/// A request over `--limit-at`: P (`projected`, the output reserve
/// included) against the window; `limit` is the line in tokens.
#[derive(Clone, Copy, Debug)]
pub struct Over {
    pub projected: u64,
    pub window: u64,
    pub limit: f64,
    pub reserve: u64,
}

impl Over {
    /// `tidemark_over_budget_total`, labelled with what was done.
    pub fn count(&self, api: &str, model: &str, action: OnOver) {
        metrics::get()
            .over_budget
            .with_label_values(&[api, model, action.as_str()])
            .inc();
    }
}

/// Why a request is refused.
#[derive(Clone, Copy, Debug)]
pub enum Refusal {
    /// The session spent its `--session-budget`.
    SessionBudget { spent: u64, budget: u64 },
    /// Over the line with `--on-over reject` (or a trim that could not
    /// bring it under).
    Context(Over),
}

/// What the policy makes of a projected request.
#[derive(Clone, Copy, Debug)]
pub enum Verdict {
    /// Forwarded as it is; `over`: over the line, but `--on-over pass`.
    Pass {
        over: Option<Over>,
    },
    Reject(Refusal),
    /// Over the line with `--on-over trim`: cut down (`cut.rs`), or
    /// rejected when no cut brings it under.
    Trim(Over),
}

/// decide: session budget first, then the context budget.
pub fn decide(cfg: &Config, begun: &Begun, max_output: Option<u64>) -> Verdict {
    if let Some(budget) = cfg.session_budget {
        if begun.spent > budget {
            let spent = begun.spent;
            return Verdict::Reject(Refusal::SessionBudget { spent, budget });
        }
    }
    let Some(o) = over(cfg, begun, max_output) else {
        return Verdict::Pass { over: None };
    };
    match cfg.on_over {
        OnOver::Pass => Verdict::Pass { over: Some(o) },
        OnOver::Reject => Verdict::Reject(Refusal::Context(o)),
        OnOver::Trim => Verdict::Trim(o),
    }
}

/// The context budget alone: whether the projection (with the output
/// reserve, under `--reserve-output`) is over `--limit-at` of its window.
pub fn over(cfg: &Config, begun: &Begun, max_output: Option<u64>) -> Option<Over> {
    let window = begun.projection.window?;
    let reserve = match cfg.reserve_output {
        true => max_output.unwrap_or(0),
        false => 0,
    };
    let projected = begun.projection.tokens + reserve;
    let limit = cfg.limit_at * window as f64;
    (projected as f64 > limit).then_some(Over {
        projected,
        window,
        limit,
        reserve,
    })
}

/// No verdict can stop or change a request (no `--on-over reject` or
/// `trim`, no `--session-budget`, no `--exact-cold-start`, the defaults):
/// it may go upstream before it is projected (forward-first).
pub fn settled(cfg: &Config) -> bool {
    cfg.on_over == OnOver::Pass && cfg.session_budget.is_none() && !cfg.exact_cold_start
}
