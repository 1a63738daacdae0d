//! Token counts of messages already seen, keyed by a 128-bit xxh3 of the
//! message's exact bytes (seeded with tokenizer, API and field), in shards with
//! a byte budget.
//!
//! Each shard keeps two generations: lookups promote from `old` to `new`;
//! when `new` would outgrow the shard's share of the budget, `old` is dropped
//! and `new` becomes `old`. Recently used entries survive, memory never
//! exceeds the budget, and every operation is O(1).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

use super::classes::{Classes, CLASSES};

/// What one element counted to: its tokens, by content class, and its
/// characters, in 32 bytes (a table entry of 48 with its key). A class
/// holds up to 65,535 tokens as they are; a larger element's classes are
/// kept shifted right (its total exact, each class short of less than the
/// shift's unit, which the largest class gets back).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counted {
    tokens: u32,
    /// Characters in the low 28 bits (saturating), the classes' shift above.
    meta: u32,
    classes: [u16; CLASSES],
}

const CHARS_BITS: u32 = 28;
const CHARS_MAX: u32 = (1 << CHARS_BITS) - 1;

impl Counted {
    pub fn new(classes: &Classes, chars: u64) -> Counted {
        let tokens = u32::try_from(classes.sum()).unwrap_or(u32::MAX);
        let max = classes.0.iter().copied().max().unwrap_or(0);
        let shift = (32 - (max >> 16).leading_zeros()).min(15);
        let chars = u32::try_from(chars).unwrap_or(u32::MAX).min(CHARS_MAX);
        Counted {
            tokens,
            meta: chars | shift << CHARS_BITS,
            classes: classes
                .0
                .map(|n| u16::try_from(n >> shift).unwrap_or(u16::MAX)),
        }
    }

    pub fn tokens(&self) -> u64 {
        u64::from(self.tokens)
    }

    pub fn chars(&self) -> u64 {
        u64::from(self.meta & CHARS_MAX)
    }

    /// Add its classes to `out` (wide sums: a request's cached messages
    /// are added up here, a plain add each, no overflow to guard).
    #[inline]
    pub fn add_to(&self, out: &mut [u64; CLASSES]) {
        let shift = self.meta >> CHARS_BITS;
        if shift == 0 {
            for (o, &n) in out.iter_mut().zip(&self.classes) {
                *o += u64::from(n);
            }
            return;
        }
        // What the shift dropped goes to the largest class.
        let mut given = 0u64;
        let mut largest = 0;
        for (i, &n) in self.classes.iter().enumerate() {
            let v = u64::from(n) << shift;
            out[i] += v;
            given += v;
            if n > self.classes[largest] {
                largest = i;
            }
        }
        out[largest] += u64::from(self.tokens).saturating_sub(given);
    }
}

/// The key is already a uniform hash: use its low bits as the table hash.
#[derive(Default)]
pub struct KeyHasher(u64);
impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}

type Table = HashMap<u128, Counted, BuildHasherDefault<KeyHasher>>;

const SHARDS: usize = 32;
const ENTRY: usize = std::mem::size_of::<(u128, Counted)>();

/// Bytes a hashbrown table of this capacity holds: one slot and one control
/// byte per bucket (buckets: a power of two at 7/8 load), plus a group of
/// trailing control bytes and the map header.
fn table_bytes(capacity: usize) -> usize {
    if capacity == 0 {
        return std::mem::size_of::<Table>();
    }
    let buckets = if capacity < 8 {
        if capacity < 4 {
            4
        } else {
            8
        }
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (ENTRY + 1) + 16 + std::mem::size_of::<Table>()
}

#[derive(Default)]
struct Shard {
    new: Table,
    old: Table,
    /// Lookups, counted under the shard's lock (a process-wide atomic
    /// bumped per message would bounce between cores on every request).
    hits: u64,
    misses: u64,
}

impl Shard {
    fn bytes(&self) -> usize {
        table_bytes(self.new.capacity()) + table_bytes(self.old.capacity())
    }
}

pub struct Cache {
    shards: Box<[Mutex<Shard>]>,
    /// Budget of one shard.
    shard_budget: usize,
}

impl Cache {
    pub fn new(budget_bytes: usize) -> Cache {
        Cache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget: budget_bytes / SHARDS,
        }
    }

    fn shard(&self, key: u128) -> &Mutex<Shard> {
        &self.shards[shard_of(key)]
    }

    pub fn get(&self, key: u128) -> Option<Counted> {
        let mut s = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        let found = lookup(&mut s, key, self.shard_budget);
        if found.is_some() {
            s.hits += 1;
        } else {
            s.misses += 1;
        }
        found
    }

    /// [`Cache::get`] of many keys, one lock per shard rather than per key:
    /// `found[i]` is set for each `keys[i]` present (and counted a hit).
    /// Absent keys are left `None` and not counted: the caller's `get` of
    /// each, just before counting it, counts the miss (or the hit, when an
    /// equal element earlier in the same request was counted meanwhile).
    pub fn get_many(&self, keys: &[u128], found: &mut Vec<Option<Counted>>) {
        found.clear();
        found.resize(keys.len(), None);
        // Keys by shard (a counting sort), then each shard's keys under one lock.
        let mut start = [0u32; SHARDS + 1];
        for &k in keys {
            start[shard_of(k) + 1] += 1;
        }
        for i in 0..SHARDS {
            start[i + 1] += start[i];
        }
        let mut next = start;
        let mut order = vec![0u32; keys.len()];
        for (i, &k) in keys.iter().enumerate() {
            let s = shard_of(k);
            order[next[s] as usize] = i as u32;
            next[s] += 1;
        }
        for (shard, lock) in self.shards.iter().enumerate() {
            let mine = &order[start[shard] as usize..start[shard + 1] as usize];
            if mine.is_empty() {
                continue;
            }
            let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
            for &i in mine {
                let c = lookup(&mut s, keys[i as usize], self.shard_budget);
                if c.is_some() {
                    s.hits += 1;
                }
                found[i as usize] = c;
            }
        }
    }

    /// Lookups so far: (hits, misses).
    pub fn lookups(&self) -> (u64, u64) {
        self.shards.iter().fold((0, 0), |(h, m), s| {
            let s = s.lock().unwrap_or_else(|e| e.into_inner());
            (h + s.hits, m + s.misses)
        })
    }

    pub fn put(&self, key: u128, c: Counted) {
        let mut s = self.shard(key).lock().unwrap_or_else(|e| e.into_inner());
        insert(&mut s, key, c, self.shard_budget);
    }

    /// Bytes the tables hold now (allocation, not just live entries).
    pub fn bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).bytes())
            .sum()
    }

    pub fn entries(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock().unwrap_or_else(|e| e.into_inner());
                s.new.len() + s.old.len()
            })
            .sum()
    }
}

fn shard_of(key: u128) -> usize {
    (key >> 64) as usize % SHARDS
}

/// A key's count, promoted from the old generation to the new when found there.
fn lookup(s: &mut Shard, key: u128, budget: usize) -> Option<Counted> {
    match s.new.get(&key) {
        Some(c) => Some(*c),
        None => {
            let c = s.old.remove(&key);
            if let Some(c) = c {
                insert(s, key, c, budget);
            }
            c
        }
    }
}

fn insert(s: &mut Shard, key: u128, c: Counted, budget: usize) {
    if s.new.len() < s.new.capacity() || s.new.contains_key(&key) {
        s.new.insert(key, c);
        return;
    }
    // The next insert grows `new`: to twice its capacity (or a first table).
    let grown = table_bytes((s.new.capacity() * 2).max(3));
    if grown + table_bytes(s.old.capacity()) <= budget {
        s.new.reserve(1);
        s.new.insert(key, c);
        return;
    }
    // Rotate: the old generation goes, the full new one becomes old.
    s.old = std::mem::take(&mut s.new);
    if table_bytes(3) + table_bytes(s.old.capacity()) > budget {
        // Budget too small to keep even a minimal second table.
        s.old = Table::default();
        if table_bytes(3) > budget {
            return;
        }
    }
    s.new.insert(key, c);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counted(tokens: u32) -> Counted {
        let mut classes = Classes::default();
        classes.0[0] = tokens;
        Counted::new(&classes, 1)
    }

    #[test]
    fn counts_stay_exact_and_large_classes_nearly_so() {
        let mut c = Classes::default();
        c.0[0] = 1_000;
        c.0[5] = 65_535;
        let mut out = [0u64; CLASSES];
        Counted::new(&c, 77).add_to(&mut out);
        assert_eq!(out, c.0.map(u64::from));
        assert_eq!(Counted::new(&c, 77).chars(), 77);
        c.0[5] = 3_000_001;
        c.0[2] = 12_345;
        let k = Counted::new(&c, u64::MAX);
        assert_eq!(k.tokens(), c.sum());
        assert_eq!(k.chars(), u64::from(CHARS_MAX));
        let mut out = [0u64; CLASSES];
        k.add_to(&mut out);
        assert_eq!(out.iter().sum::<u64>(), c.sum(), "the total exact");
        // Shifted by 6: each class short by less than 64, the largest given the rest.
        for (i, (&a, &b)) in out.iter().zip(&c.0).enumerate() {
            let (a, b) = (a as f64, f64::from(b));
            assert!(
                (a - b).abs() < 64.0 * CLASSES as f64,
                "class {i}: {a} vs {b}"
            );
        }
        assert_eq!(std::mem::size_of::<Counted>(), 32);
    }

    #[test]
    fn budget_holds_and_recent_entries_survive() {
        let budget = 256 * 1024;
        let c = Cache::new(budget);
        for i in 0..200_000u128 {
            let k = i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
            c.put(k, counted(1));
            if i % 1000 == 0 {
                assert!(c.bytes() <= budget, "over budget at {i}");
            }
        }
        assert!(c.bytes() <= budget);
        assert!(c.entries() > 1000);
        let last = 199_999u128.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
        assert!(c.get(last).is_some());
        let first = 0u128;
        assert!(c.get(first).is_none());
    }

    #[test]
    fn a_batch_finds_what_single_lookups_find_and_counts_only_hits() {
        let c = Cache::new(1 << 20);
        let keys: Vec<u128> = (0..500u128)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
            .collect();
        for (i, &k) in keys.iter().enumerate().filter(|(i, _)| i % 3 == 0) {
            c.put(k, counted(i as u32));
        }
        let mut found = Vec::new();
        c.get_many(&keys, &mut found);
        assert_eq!(found.len(), keys.len());
        for (i, f) in found.iter().enumerate() {
            match i % 3 {
                0 => assert_eq!(f.map(|c| c.tokens()), Some(i as u64), "key {i}"),
                _ => assert_eq!(*f, None, "key {i}"),
            }
        }
        // Hits counted, misses left to the caller's own `get`.
        assert_eq!(c.lookups(), (167, 0));
        assert_eq!(c.get(keys[1]), None);
        assert_eq!(c.lookups(), (167, 1));
    }

    #[test]
    fn zero_budget_caches_nothing() {
        let c = Cache::new(0);
        c.put(1, Counted::default());
        assert!(c.get(1).is_none());
    }
}
