//! Local token estimates of a request: everything the provider will count
//! (system prompt, messages and their parts, tool calls and results, tool
//! definitions, images, message framing), with the model's own tokenizer
//! where it is public and the closest public one elsewhere.
//!
//! What a message holds is its API's to say (`Provider::walk`, reporting to
//! `count.rs`); this room tokenizes, prices images and caches.
//!
//! Each message (and each system prompt or tool definition) is counted once:
//! its count, shared among content classes (`classes.rs`), is cached under a
//! hash of its exact bytes, so a request that appends a turn to a long
//! history tokenizes and classifies only that turn.

mod cache;
pub mod classes;
mod count;
pub mod images;
pub mod tokenizer;

use std::sync::atomic::{AtomicU64, Ordering};

use xxhash_rust::xxh3::xxh3_128_with_seed;

use crate::json::text as json;
use crate::json::{Raw, RequestView};
pub use crate::provider::Unit;
use crate::provider::{Api, ImagePricing, Provider};
use cache::{Cache, Counted};
pub use classes::{Class, Classes, CLASSES};
use count::Ctx;
pub use tokenizer::Encoding;

/// A request's local estimate.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Estimate {
    /// Tokens the estimator thinks the provider will count.
    pub tokens: u64,
    /// Characters of counted text, for the `chars/4` baseline.
    pub chars: u64,
    /// `tokens` by kind of content: a session calibrates each kind apart.
    pub classes: Classes,
}

/// An estimate known only by its total (no classes: projected with the single ratio).
impl From<u64> for Estimate {
    fn from(tokens: u64) -> Estimate {
        Estimate {
            tokens,
            ..Estimate::default()
        }
    }
}

/// Counters for tests, benchmarks and the curious.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Units (messages, system prompts, tool definitions) found in the cache.
    pub hits: u64,
    /// Units that had to be counted.
    pub misses: u64,
    /// Bytes of text handed to the tokenizer.
    pub tokenized_bytes: u64,
    /// Bytes the cache's tables hold.
    pub cache_bytes: usize,
    pub cache_entries: usize,
}

/// Counts requests; one per process, shared by every connection.
pub struct Estimator {
    cache: Cache,
    tokenized: AtomicU64,
}

impl Estimator {
    /// An estimator whose per-message cache holds at most `cache_bytes`.
    pub fn new(cache_bytes: usize) -> Self {
        Estimator {
            cache: Cache::new(cache_bytes),
            tokenized: AtomicU64::new(0),
        }
    }

    /// Everything the provider will count in `req`, for `model`.
    pub fn estimate(
        &self,
        p: &dyn Provider,
        req: &RequestView<'_>,
        model: Option<&str>,
    ) -> Estimate {
        let mut unbounded = usize::MAX;
        self.estimate_within(p, req, model, &mut unbounded)
            .unwrap_or_default()
    }

    /// [`Estimator::estimate`], unless the parts not in the cache add up to
    /// more than `max_uncached` bytes: then `None`, before tokenizing the
    /// part that goes over (parts counted until then are cached). Warm
    /// requests, nearly all of them, cost the same; a cold long history is
    /// left to a thread that may take milliseconds.
    pub fn estimate_bounded(
        &self,
        p: &dyn Provider,
        req: &RequestView<'_>,
        model: Option<&str>,
        max_uncached: usize,
    ) -> Option<Estimate> {
        let mut budget = max_uncached;
        self.estimate_within(p, req, model, &mut budget)
    }

    fn estimate_within(
        &self,
        p: &dyn Provider,
        req: &RequestView<'_>,
        model: Option<&str>,
        budget: &mut usize,
    ) -> Option<Estimate> {
        Some(self.sum_within(p, req, model, budget, None)?.estimate())
    }

    /// What [`Estimator::estimate_within`] adds up, without the field
    /// `skip`.
    fn sum_within(
        &self,
        p: &dyn Provider,
        req: &RequestView<'_>,
        model: Option<&str>,
        budget: &mut usize,
        skip: Option<&str>,
    ) -> Option<Sum> {
        let api = p.api();
        let enc = Encoding::for_model(api, model);
        let images = image_class(api, model);
        let mut sum = Sum::default();
        for f in p.counted_fields() {
            let (field, unit, per_element) = (f.name, f.unit, f.per_element);
            if skip == Some(field) {
                continue;
            }
            let Some(raw) = req.raw(field) else {
                continue;
            };
            let raw = raw.get();
            let mut n = 0u64;
            // Element by element, as the view's scan found them.
            if let Some(els) = req.elements(field).filter(|_| per_element) {
                let mut part = Sum::default();
                // The first elements one by one; the rest of a long history
                // is looked up in one batch, a lock per cache shard instead
                // of per element, so the workers do not pass one lock's
                // cache line between them for every message.
                let (first, rest) = els.split_at(els.len().min(ONE_BY_ONE));
                for el in first {
                    part.add(self.unit(api, enc, model, images, unit, el.get(), budget)?);
                }
                if !rest.is_empty() {
                    let keys: Vec<u128> = rest
                        .iter()
                        .map(|el| unit_key(enc, unit, images, el.get()))
                        .collect();
                    let mut found = Vec::new();
                    self.cache.get_many(&keys, &mut found);
                    for ((el, key), f) in rest.iter().zip(keys).zip(found) {
                        part.add(match f {
                            Some(c) => c,
                            None => {
                                self.unit_keyed(api, enc, model, unit, key, el.get(), budget)?
                            }
                        });
                    }
                }
                n = els.len() as u64;
                sum.add_sum(&part);
                sum.classes[Class::Framing as usize] += block_overhead(api, unit, n);
                continue;
            }
            let unit = unit.whole();
            if json::kind(raw) != b'n' {
                sum.add(self.unit(api, enc, model, images, unit, raw, budget)?);
                n += 1;
            }
            sum.classes[Class::Framing as usize] += block_overhead(api, unit, n);
        }
        sum.classes[Class::Framing as usize] += p.reply_framing();
        Some(sum)
    }

    /// `req`'s estimate taken apart for a trimmer: everything but the
    /// elements of its history (the provider's conversation array), and
    /// each of those on its own, from the per-message cache the estimate
    /// filled. `None` when the request has no such array.
    pub fn parts<'e>(
        &'e self,
        p: &dyn Provider,
        req: &RequestView<'_>,
        model: Option<&str>,
    ) -> Option<Parts<'e>> {
        let history = crate::provider::history(p)?;
        let els = req.elements(history.name)?;
        let api = p.api();
        let mut unbounded = usize::MAX;
        let rest = self.sum_within(p, req, model, &mut unbounded, Some(history.name))?;
        let mut parts = Parts {
            est: self,
            api,
            enc: Encoding::for_model(api, model),
            model: model.map(str::to_owned),
            images: image_class(api, model),
            unit: history.unit,
            rest,
            elements: Vec::with_capacity(els.len()),
        };
        for el in els {
            let c = parts.count(el.get());
            parts.elements.push(c);
        }
        Some(parts)
    }

    /// [`Estimator::estimate`] of a raw body; `None` when it is not a JSON object.
    pub fn estimate_body(&self, api: Api, body: &[u8], model: Option<&str>) -> Option<Estimate> {
        let view = RequestView::parse(body)?;
        let p = api.provider();
        let model = model
            .map(str::to_owned)
            .or_else(|| view.str("model").map(|m| m.into_owned()));
        Some(self.estimate(p, &view, model.as_deref()))
    }

    /// Tokens of each element of a per-message field (`messages`, `input`,
    /// `contents`, `tools`), framing included, in order; `None` when the
    /// field is absent, not an array, or not one this API counts per element.
    /// What a trimmer needs to choose what to drop.
    pub fn element_tokens(
        &self,
        api: Api,
        req: &RequestView<'_>,
        model: Option<&str>,
        field: &str,
    ) -> Option<Vec<u64>> {
        let f = api
            .provider()
            .counted_fields()
            .iter()
            .find(|f| f.name == field)?;
        if !f.per_element {
            return None;
        }
        let unit = f.unit;
        let enc = Encoding::for_model(api, model);
        let images = image_class(api, model);
        let els = req.elements(field)?;
        Some(
            els.iter()
                .map(|el| {
                    let mut unbounded = usize::MAX;
                    let c = self.unit(api, enc, model, images, unit, el.get(), &mut unbounded);
                    c.map_or(0, |c| c.tokens())
                })
                .collect(),
        )
    }

    /// Every unit of `req` the provider counts, in the order it sees them
    /// (each element of a per-element field, each other field whole): what
    /// the prompt cache's view of a request is made of (`session/cache.rs`).
    /// For each, `f` gets its field, its raw text, its estimated tokens
    /// (from the per-message cache the estimate just filled), its cache
    /// key (a 128-bit hash of its bytes: a content hash to compare), and
    /// the same key function for other bytes (the unit's content with its
    /// moving markers left out hashes as the same unit without them).
    pub fn each_unit(
        &self,
        p: &dyn Provider,
        req: &RequestView<'_>,
        model: Option<&str>,
        mut f: impl FnMut(&crate::provider::CountedField, Raw<'_>, u64, u128, &dyn Fn(&[u8]) -> u128),
    ) {
        let api = p.api();
        let enc = Encoding::for_model(api, model);
        let images = image_class(api, model);
        let mut unbounded = usize::MAX;
        let mut keys = Vec::new();
        let mut found = Vec::new();
        for field in p.counted_fields() {
            let Some(raw) = req.raw(field.name) else {
                continue;
            };
            if let Some(els) = req.elements(field.name).filter(|_| field.per_element) {
                // As the estimate looks a long history up: a batch, a lock
                // per cache shard.
                keys.clear();
                keys.extend(
                    els.iter()
                        .map(|el| unit_key(enc, field.unit, images, el.get())),
                );
                self.cache.get_many(&keys, &mut found);
                let rekey = |b: &[u8]| unit_key_bytes(enc, field.unit, images, b);
                for ((el, &key), c) in els.iter().zip(&keys).zip(&found) {
                    let c = c.or_else(|| {
                        self.unit_keyed(api, enc, model, field.unit, key, el.get(), &mut unbounded)
                    });
                    f(field, *el, c.map_or(0, |c| c.tokens()), key, &rekey);
                }
                continue;
            }
            if json::kind(raw.get()) == b'n' {
                continue;
            }
            let unit = field.unit.whole();
            let key = unit_key(enc, unit, images, raw.get());
            let c = self.unit_keyed(api, enc, model, unit, key, raw.get(), &mut unbounded);
            let rekey = |b: &[u8]| unit_key_bytes(enc, unit, images, b);
            f(field, raw, c.map_or(0, |c| c.tokens()), key, &rekey);
        }
    }

    /// Tokens of plain text under a model's tokenizer (no framing, no cache).
    pub fn count_text(api: Api, model: Option<&str>, text: &str) -> u64 {
        Encoding::for_model(api, model).count(text) as u64
    }

    pub fn stats(&self) -> Stats {
        let (hits, misses) = self.cache.lookups();
        Stats {
            hits,
            misses,
            tokenized_bytes: self.tokenized.load(Ordering::Relaxed),
            cache_bytes: self.cache.bytes(),
            cache_entries: self.cache.entries(),
        }
    }

    /// One unit's count, from the cache or counted now.
    #[allow(clippy::too_many_arguments)] // one call site per field kind
    fn unit(
        &self,
        api: Api,
        enc: Encoding,
        model: Option<&str>,
        image_class: u64,
        unit: Unit,
        raw: &str,
        budget: &mut usize,
    ) -> Option<Counted> {
        let key = unit_key(enc, unit, image_class, raw);
        self.unit_keyed(api, enc, model, unit, key, raw, budget)
    }

    /// [`Estimator::unit`] with its cache key already made.
    #[allow(clippy::too_many_arguments)]
    fn unit_keyed(
        &self,
        api: Api,
        enc: Encoding,
        model: Option<&str>,
        unit: Unit,
        key: u128,
        raw: &str,
        budget: &mut usize,
    ) -> Option<Counted> {
        if let Some(c) = self.cache.get(key) {
            return Some(c);
        }
        *budget = budget.checked_sub(raw.len())?;
        let mut cx = Ctx {
            enc,
            api,
            model,
            classes: Classes::default(),
            chars: 0,
            tokenized: 0,
        };
        api.provider().walk(unit, raw, &mut cx);
        self.tokenized.fetch_add(cx.tokenized, Ordering::Relaxed);
        let c = Counted::new(&cx.classes, cx.chars);
        self.cache.put(key, c);
        Some(c)
    }
}

/// Elements of an array counted one by one before the rest go in a batch:
/// a short array (most requests' `tools`, a new conversation) does not pay
/// for the batch's bookkeeping.
const ONE_BY_ONE: usize = 32;

/// A unit's cache key: its exact bytes, seeded with what else its count
/// depends on (tokenizer, kind of unit, how images are priced).
fn unit_key(enc: Encoding, unit: Unit, image_class: u64, raw: &str) -> u128 {
    unit_key_bytes(enc, unit, image_class, raw.as_bytes())
}

fn unit_key_bytes(enc: Encoding, unit: Unit, image_class: u64, raw: &[u8]) -> u128 {
    let seed = enc.id() | (unit as u64) << 8 | image_class << 16;
    xxh3_128_with_seed(raw, seed)
}

/// How a model prices images, part of every cache key (its counts differ).
fn image_class(api: Api, model: Option<&str>) -> u64 {
    match api.provider().image_pricing() {
        ImagePricing::OpenAi => images::openai_class(model),
        _ => 0,
    }
}

/// A request's estimate in parts ([`Estimator::parts`]): what a trimmer
/// adds up for each cut it weighs instead of estimating a body.
pub struct Parts<'e> {
    est: &'e Estimator,
    api: Api,
    enc: Encoding,
    model: Option<String>,
    images: u64,
    /// The history's unit.
    unit: Unit,
    /// Everything outside the history's elements.
    rest: Sum,
    elements: Vec<Part>,
}

/// One history element's count, to be added up by [`Parts::total`].
#[derive(Debug, Clone, Copy)]
pub struct Part(Counted);

impl Parts<'_> {
    /// The `i`th element of the request's history.
    pub fn element(&self, i: usize) -> Part {
        self.elements[i]
    }

    /// An element's text the request did not hold (a tool output elided, a
    /// gap marker), counted as one of its history, through the cache.
    pub fn count(&self, raw: &str) -> Part {
        let mut unbounded = usize::MAX;
        let model = self.model.as_deref();
        let c = self.est.unit(
            self.api,
            self.enc,
            model,
            self.images,
            self.unit,
            raw,
            &mut unbounded,
        );
        Part(c.unwrap_or_default())
    }

    /// The estimate of the request with `kept` as its history's elements:
    /// what estimating that body would give.
    pub fn total(&self, kept: impl IntoIterator<Item = Part>) -> Estimate {
        let mut sum = Sum {
            classes: self.rest.classes,
            chars: self.rest.chars,
        };
        let mut n = 0;
        for Part(c) in kept {
            sum.add(c);
            n += 1;
        }
        sum.classes[Class::Framing as usize] += block_overhead(self.api, self.unit, n);
        sum.estimate()
    }
}

#[derive(Default)]
struct Sum {
    classes: [u64; CLASSES],
    chars: u64,
}

impl Sum {
    fn estimate(&self) -> Estimate {
        Estimate {
            tokens: self.classes.iter().sum(),
            chars: self.chars,
            classes: Classes(self.classes.map(|n| u32::try_from(n).unwrap_or(u32::MAX))),
        }
    }

    fn add(&mut self, c: Counted) {
        c.add_to(&mut self.classes);
        self.chars += c.chars();
    }

    fn add_sum(&mut self, other: &Sum) {
        for (a, b) in self.classes.iter_mut().zip(other.classes) {
            *a += b;
        }
        self.chars += other.chars;
    }
}

/// Fixed cost of a block of `n` units (tool definitions' wrapper).
fn block_overhead(api: Api, unit: Unit, n: u64) -> u64 {
    if n == 0 {
        return 0;
    }
    api.provider().block_framing(unit)
}
