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

/// What one element counted to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counted {
    pub tokens: u32,
    pub chars: u32,
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

    #[test]
    fn budget_holds_and_recent_entries_survive() {
        let budget = 256 * 1024;
        let c = Cache::new(budget);
        for i in 0..200_000u128 {
            let k = i.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
            c.put(
                k,
                Counted {
                    tokens: 1,
                    chars: 1,
                },
            );
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
            c.put(
                k,
                Counted {
                    tokens: i as u32,
                    chars: 1,
                },
            );
        }
        let mut found = Vec::new();
        c.get_many(&keys, &mut found);
        assert_eq!(found.len(), keys.len());
        for (i, f) in found.iter().enumerate() {
            match i % 3 {
                0 => assert_eq!(f.map(|c| c.tokens), Some(i as u32), "key {i}"),
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
