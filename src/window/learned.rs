//! Windows the provider taught: a context-length refusal names the window
//! the endpoint really enforces ([`crate::provider::Provider::context_error`]),
//! and a gateway, a subscription tier or a local server's `n_ctx` often
//! enforces less than the model's published window. What one (upstream,
//! model) refused with replaces the built-in table's value for it; an
//! explicit `--context-window` still wins. With `--state redis://` the
//! lesson is shared (`session/redis.rs`, beside the model's calibration).
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::RwLock;

use crate::config::{Upstream, WindowRule};

/// (upstream, model) pairs remembered; model names come from clients.
pub const MAX_LEARNED: usize = 4096;

/// Where the window a request is measured against came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `--context-window`: the operator said so.
    Flag,
    /// The upstream's own context-length refusal.
    Learned,
    /// The built-in table of published windows.
    Table,
}

/// The window of a request and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub tokens: u64,
    pub source: Source,
}

/// An upstream as a key part: its authority and path prefix
/// (`openrouter.ai/api`), the same on every replica.
pub fn upstream_id(u: &Upstream) -> String {
    let mut s = String::with_capacity(u.authority.as_str().len() + u.prefix.len());
    s.push_str(u.authority.as_str());
    s.push_str(&u.prefix);
    s
}

/// Windows by model, of one upstream.
type ByModel = HashMap<Box<str>, u64>;

/// The windows learned by this process (and, with a shared backend, taken
/// in from it), by (upstream, model).
#[derive(Default)]
pub struct Learned {
    /// upstream -> model -> window (nested, so a lookup borrows its keys).
    map: RwLock<HashMap<Box<str>, ByModel>>,
    /// Anything learned at all: the lookup every request makes is one
    /// atomic load until the first refusal.
    any: AtomicBool,
}

impl Learned {
    /// The window learned for `model` behind `upstream`.
    pub fn get(&self, upstream: &str, model: &str) -> Option<u64> {
        if !self.any.load(Ordering::Relaxed) {
            return None;
        }
        let m = self.map.read().unwrap_or_else(|e| e.into_inner());
        m.get(upstream)?.get(model).copied()
    }

    /// Remember `window` for `model` behind `upstream`; the window known
    /// before, if any. At [`MAX_LEARNED`] pairs a new one is not kept.
    pub fn learn(&self, upstream: &str, model: &str, window: u64) -> Option<u64> {
        let mut m = self.map.write().unwrap_or_else(|e| e.into_inner());
        let held = m.get(upstream).is_some_and(|u| u.contains_key(model));
        if !held && m.values().map(HashMap::len).sum::<usize>() >= MAX_LEARNED {
            return None;
        }
        self.any.store(true, Ordering::Relaxed);
        m.entry(Box::from(upstream))
            .or_default()
            .insert(Box::from(model), window)
    }

    /// Forget what was learned for `model` behind `upstream` (the provider
    /// has since accepted more than it said fits).
    pub fn forget(&self, upstream: &str, model: &str) -> Option<u64> {
        if !self.any.load(Ordering::Relaxed) {
            return None;
        }
        let mut m = self.map.write().unwrap_or_else(|e| e.into_inner());
        m.get_mut(upstream)?.remove(model)
    }

    /// Whether anything was learned (a cheap check before a lookup).
    pub fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Relaxed)
    }
}

/// The window of `model` behind `upstream`: a `--context-window` rule, else
/// what the upstream taught, else the built-in table.
pub fn resolve(
    rules: &[WindowRule],
    learned: &Learned,
    upstream: &str,
    model: &str,
) -> Option<Window> {
    let at = |tokens, source| Some(Window { tokens, source });
    if let Some(w) = super::flag_window(rules, model) {
        return at(w, Source::Flag);
    }
    if let Some(w) = learned.get(upstream, model) {
        return at(w, Source::Learned);
    }
    super::table_window(model).and_then(|w| at(w, Source::Table))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flag_wins_then_what_was_learned_then_the_table() {
        let rules = [WindowRule {
            glob: "claude-*".into(),
            tokens: 1_000_000,
        }];
        let l = Learned::default();
        let w = |up: &str, m: &str| resolve(&rules, &l, up, m).map(|w| (w.tokens, w.source));
        assert_eq!(w("gw", "gpt-4o"), Some((128_000, Source::Table)));
        assert!(l.is_empty());
        assert_eq!(l.learn("gw", "gpt-4o", 32_000), None);
        assert_eq!(l.learn("gw", "claude-sonnet-4-5", 100_000), None);
        assert_eq!(w("gw", "gpt-4o"), Some((32_000, Source::Learned)));
        // Another upstream serving the same model is another endpoint.
        assert_eq!(w("api", "gpt-4o"), Some((128_000, Source::Table)));
        assert_eq!(
            w("gw", "claude-sonnet-4-5"),
            Some((1_000_000, Source::Flag))
        );
        assert_eq!(w("gw", "my-model"), None);
        l.learn("gw", "my-model", 8192);
        assert_eq!(w("gw", "my-model"), Some((8192, Source::Learned)));
        assert_eq!(l.learn("gw", "gpt-4o", 30_000), Some(32_000));
        assert_eq!(l.forget("gw", "gpt-4o"), Some(30_000));
        assert_eq!(w("gw", "gpt-4o"), Some((128_000, Source::Table)));
    }

    #[test]
    fn bounded() {
        let l = Learned::default();
        for i in 0..MAX_LEARNED + 10 {
            l.learn("up", &format!("m{i}"), 1000);
        }
        assert_eq!(l.get("up", "m0"), Some(1000));
        assert_eq!(l.get("up", &format!("m{}", MAX_LEARNED + 5)), None);
        // A pair already held is updated at the cap.
        assert_eq!(l.learn("up", "m1", 2000), Some(1000));
    }
}
