//! `--on-over trim` as a session makes it: continuing the session's last
//! cut (so the provider's prompt cache survives), measured with the
//! session's own anchored ruler, kept only when it brings the request
//! under the line. The cutting itself is `trim.rs`.
use dashmap::DashMap;

use super::Over;
use crate::config::Config;
use crate::estimate::{Estimate, Estimator};
use crate::json::RequestView;
use crate::metrics;
use crate::policy::trim::{self, Cut, Trimmed};
use crate::provider::Api;
use crate::session::{Begun, Ruler, Store};

/// Each trimmed session's last cut, so the next request is cut at the
/// same place. Keyed by credential and session key ([`cut_key`]); bounded
/// by `--max-sessions`.
pub struct Cuts {
    cuts: DashMap<String, Cut>,
    max: usize,
}

impl Cuts {
    pub fn new(max_sessions: usize) -> Cuts {
        Cuts {
            cuts: DashMap::new(),
            max: max_sessions.max(1),
        }
    }

    /// Remember a session's cut for its next request.
    pub fn remember(&self, key: String, cut: Cut) {
        if self.cuts.len() >= self.max && !self.cuts.contains_key(&key) {
            self.cuts.clear();
        }
        self.cuts.insert(key, cut);
    }

    fn get(&self, key: &str) -> Option<Cut> {
        self.cuts.get(key).map(|c| c.clone())
    }
}

/// The key a session's cut is kept under; only a trim reads or remembers cuts.
pub fn cut_key(cfg: &Config, credential: &str, key: Option<&str>) -> Option<String> {
    match cfg.on_over {
        crate::config::OnOver::Trim => key.map(|k| format!("{credential}\u{0}{k}")),
        _ => None,
    }
}

/// A request to trim: its body (JSON), model, session cut key, and how it
/// is over.
pub struct Trimming<'a> {
    pub api: Api,
    pub body: &'a [u8],
    pub model: Option<&'a str>,
    pub cut_key: Option<&'a str>,
    pub ruler: Ruler,
    pub over: Over,
}

/// Cut the request down to `--trim-to` with the session's ruler,
/// continuing its last cut. Returns the trim and the estimate of the body
/// it produced, only when that is under the line again; `None`: reject.
pub fn trim_request(
    cfg: &Config,
    estimator: &Estimator,
    cuts: &Cuts,
    t: &Trimming<'_>,
) -> Option<(Trimmed, Estimate)> {
    let (api, model, ruler, reserve, window) =
        (t.api, t.model, t.ruler, t.over.reserve, t.over.window);
    // Each candidate cut is weighed by its elements' cached counts, the
    // body rendered once at the end.
    let measure = |e: &Estimate| ruler.measure_estimate(e);
    let need = ((cfg.trim_to * window as f64) as u64).saturating_sub(reserve);
    let keep = ((cfg.limit_at * window as f64) as u64).saturating_sub(reserve);
    let prior = t.cut_key.and_then(|k| cuts.get(k));
    let view = RequestView::parse(t.body)?;
    let (trimmed, est) = trim::trim_estimated(
        estimator,
        api,
        &view,
        model,
        &measure,
        need,
        keep,
        prior.as_ref(),
    )?;
    // Re-projected with the same anchored ruler; a trim that did not
    // shrink below the line is never forwarded.
    ((ruler.measure_estimate(&est) + reserve) as f64 <= t.over.limit).then_some((trimmed, est))
}

/// A trim that will be forwarded: the request re-projected from the
/// trimmed body's estimate, its cut remembered for the session's next
/// request, the tokens it saved counted. Returns P after the trim.
pub fn forwarded(
    store: &dyn Store,
    cuts: &Cuts,
    begun: &mut Begun,
    (api, model): (&str, &str),
    cut_key: Option<String>,
    (t, est, over): (&Trimmed, Estimate, Over),
) -> u64 {
    over.count(api, model, crate::config::OnOver::Trim);
    store.reproject(begun, est);
    let after = begun.projection.tokens + over.reserve;
    if let Some(k) = cut_key {
        cuts.remember(k, t.cut.clone());
    }
    metrics::get()
        .trimmed_tokens
        .with_label_values(&[api, model])
        .inc_by(over.projected.saturating_sub(after));
    after
}

/// A cut as a number: two requests sent with the same cut share it (0:
/// untrimmed). A cut that moves is a prompt-cache bust of its own cause.
pub fn cut_hash(c: &Cut) -> u64 {
    use xxhash_rust::xxh3::Xxh3;
    let mut h = Xxh3::new();
    h.update(&(c.dropped_until as u64).to_le_bytes());
    for e in &c.elided {
        h.update(&(*e as u64).to_le_bytes());
    }
    h.update(&c.prefix_hash.to_le_bytes());
    h.digest().max(1)
}
