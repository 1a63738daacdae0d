//! The sim's prompt cache: per credential and model, the prefixes of recent
//! requests (chains of segment hashes: tools, system, messages in order),
//! read back as the longest one a new request starts with, reported the way
//! each API does, and an accounting tests can query.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex};

use super::prompt::Prompt;

/// How an API caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Style {
    /// Every prompt of at least the minimum size is cached whole; a hit is
    /// reported rounded down to a multiple of `granularity` (OpenAI: 128).
    Automatic { granularity: u64 },
    /// Only prefixes ending at a client's breakpoint are written (Anthropic
    /// `cache_control`); reads and writes are reported apart.
    Breakpoints,
}

/// What one request read from and wrote to the cache, in reported tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Outcome {
    pub read: u64,
    pub write: u64,
}

/// One request as the cache saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEvent {
    pub model: String,
    pub prompt: u64,
    pub read: u64,
    pub write: u64,
    /// Tokens the previous request of this credential and model left cached
    /// that this one could not reuse (0: no bust).
    pub invalidated: u64,
}

/// Totals for one credential.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub requests: u64,
    pub read_tokens: u64,
    pub write_tokens: u64,
    pub busts: u64,
    pub invalidated_tokens: u64,
    pub events: Vec<CacheEvent>,
}

/// A read-only view of a running sim's cache accounting.
#[derive(Clone)]
pub struct Accounting(pub(crate) Arc<PrefixCache>);

impl Accounting {
    /// Totals for the credential a client sent (its API key or bearer
    /// token, as sent); `""` for requests without one.
    pub fn credential(&self, credential: &str) -> CacheStats {
        self.0
            .inner
            .lock()
            .ok()
            .and_then(|i| i.stats.get(credential).cloned())
            .unwrap_or_default()
    }
}

/// Prefixes kept per (credential, model) before the oldest are dropped.
const MAX_ENTRIES: usize = 50_000;

#[derive(Default)]
struct Chain {
    /// Cumulative hash of a written prefix -> its size in raw tokens.
    written: HashMap<u64, u64>,
    order: VecDeque<u64>,
    /// What the last request left cached, in reported tokens.
    last_extent: Option<u64>,
}

#[derive(Default)]
struct Inner {
    chains: HashMap<(String, String), Chain>,
    stats: HashMap<String, CacheStats>,
}

#[derive(Default)]
pub(crate) struct PrefixCache {
    inner: Mutex<Inner>,
}

fn chain_hash(prev: u64, seg: u64) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (prev, seg).hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// Look `prompt` up, write what the style writes, account for it.
    /// Prompts below `min` tokens neither read nor write.
    pub fn serve(
        &self,
        credential: &str,
        model: &str,
        prompt: &Prompt,
        style: Style,
        min: u64,
    ) -> Outcome {
        let Ok(mut inner) = self.inner.lock() else {
            return Outcome::default();
        };
        let chain = inner
            .chains
            .entry((credential.to_string(), model.to_string()))
            .or_default();
        // Cumulative (hash, raw tokens) at the end of each segment.
        let mut cum = Vec::with_capacity(prompt.segs.len());
        let (mut h, mut n) = (0u64, 0u64);
        for s in &prompt.segs {
            h = chain_hash(h, s.hash);
            n += s.tokens;
            cum.push((h, n, s.breakpoint));
        }
        let hit = cum
            .iter()
            .rev()
            .find(|(h, _, _)| chain.written.contains_key(h))
            .map(|c| c.1)
            .unwrap_or(0);
        // What this request reads, what it leaves cached (both as the API
        // reports them), and which prefixes it writes.
        let (read, extent, breakpoints_only) = match style {
            Style::Automatic { granularity } => {
                let round = |x: u64| x / granularity.max(1) * granularity.max(1);
                let read = if hit >= min { round(hit) } else { 0 };
                (read, if n >= min { round(n) } else { 0 }, false)
            }
            Style::Breakpoints => {
                let last_bp = cum.iter().rev().find(|c| c.2).map_or(0, |c| c.1);
                let read = if hit >= min { hit } else { 0 };
                let extent = if last_bp >= min {
                    last_bp.max(read)
                } else {
                    read
                };
                (read, extent, true)
            }
        };
        let outcome = Outcome {
            read,
            write: extent.saturating_sub(read),
        };
        let writes: Vec<(u64, u64)> = cum
            .iter()
            .filter(|c| c.1 >= min && (c.2 || !breakpoints_only))
            .map(|c| (c.0, c.1))
            .collect();
        for (h, t) in writes {
            if chain.written.insert(h, t).is_none() {
                chain.order.push_back(h);
            }
        }
        while chain.order.len() > MAX_ENTRIES {
            if let Some(old) = chain.order.pop_front() {
                chain.written.remove(&old);
            }
        }
        let invalidated = chain
            .last_extent
            .map(|prev| prev.saturating_sub(outcome.read))
            .unwrap_or(0);
        chain.last_extent = Some(extent);
        let st = inner.stats.entry(credential.to_string()).or_default();
        st.requests += 1;
        st.read_tokens += outcome.read;
        st.write_tokens += outcome.write;
        if invalidated > 0 {
            st.busts += 1;
            st.invalidated_tokens += invalidated;
        }
        if st.events.len() < 10_000 {
            st.events.push(CacheEvent {
                model: model.to_string(),
                prompt: n,
                read: outcome.read,
                write: outcome.write,
                invalidated,
            });
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::prompt::Seg;

    fn p(segs: &[(u64, u64, bool)]) -> Prompt {
        Prompt {
            segs: segs
                .iter()
                .map(|&(hash, tokens, breakpoint)| Seg {
                    hash,
                    tokens,
                    breakpoint,
                    head: false,
                })
                .collect(),
        }
    }

    #[test]
    fn automatic_reads_the_longest_prefix_rounded() {
        let c = PrefixCache::default();
        let auto = Style::Automatic { granularity: 128 };
        let first = p(&[(1, 1000, false), (2, 300, false)]);
        assert_eq!(c.serve("k", "m", &first, auto, 1024).read, 0);
        let second = p(&[(1, 1000, false), (2, 300, false), (3, 50, false)]);
        let o = c.serve("k", "m", &second, auto, 1024);
        assert_eq!(o.read, 1280);
        // Another credential shares nothing.
        assert_eq!(c.serve("j", "m", &second, auto, 1024).read, 0);
        // An early edit: only the first segment matches, under the minimum.
        let edited = p(&[(1, 1000, false), (9, 300, false), (3, 50, false)]);
        assert_eq!(c.serve("k", "m", &edited, auto, 1024).read, 0);
        let s = Accounting(Arc::new(c)).0.inner.lock().unwrap().stats["k"].clone();
        assert_eq!(s.busts, 1);
        assert_eq!(s.invalidated_tokens, 1350 / 128 * 128);
    }

    #[test]
    fn breakpoints_write_only_where_marked() {
        let c = PrefixCache::default();
        let first = p(&[(1, 1500, true), (2, 300, false)]);
        let o = c.serve("k", "m", &first, Style::Breakpoints, 1024);
        assert_eq!(
            o,
            Outcome {
                read: 0,
                write: 1500
            }
        );
        let second = p(&[(1, 1500, false), (2, 300, false), (3, 40, true)]);
        let o = c.serve("k", "m", &second, Style::Breakpoints, 1024);
        assert_eq!(
            o,
            Outcome {
                read: 1500,
                write: 340
            }
        );
    }
}
