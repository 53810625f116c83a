//! Miniature simulations (Waldspurger et al., "Cache Modeling and Optimization using
//! Miniature Simulations", USENIX ATC'17): a small cache run by one policy on a
//! hash-sampled share of the accesses, counting its misses in epochs and keeping a decayed
//! score. `s3fifo-lean`'s share chooser runs three of them (one per small-queue share);
//! the research policy `adaptive` runs one per expert.

use super::{Eviction, SlotId};
use crate::id_table::{Folded, IdTable};

/// Pages in each miniature simulation when the cache is larger: enough for a stable miss
/// ratio (Waldspurger et al. found a few hundred to a few thousand sampled pages adequate).
/// More samples decide sooner: on the shared traces (seeds 0–3) 1024 pages fail criterion
/// 1 on 2–3 rows where 512 fail on 4–5 (2048: 1–2), criterion 3 on 8 where 512 fail on
/// 8–9, with the same mean. Each doubling costs ~25 KiB an engine, 0.4 B a page at
/// 256 MiB (RFC 0001, "Outcome").
pub(super) const SIM_PAGES: usize = 1024;
/// The first epoch is `MIN_EPOCH` sampled accesses; each next one is twice as long, up to
/// a simulated cache's worth, so an obvious winner takes over early while later decisions
/// rest on a whole turnover of the cache.
pub(super) const MIN_EPOCH: usize = 64;
/// Weight of the past when scoring: a score is ≈ the misses of the last hundred epochs
/// (more epochs than most traces last: the scores are nearly cumulative, and forget only
/// in an engine that runs for long).
pub(super) const DECAY: f64 = 0.99;
/// A small cache run by one policy on the sampled accesses, to count its misses.
pub(super) struct MiniSim {
    policy: Box<dyn Eviction>,
    /// Its pages' slot ids by key hash: 4 bytes a slot at a load of 15/16 (a `HashMap` of
    /// hash and id took ~34 bytes a page, half the simulations' memory).
    slot_of: IdTable<Folded>,
    /// Each slot's key, folded to 32 bits ([`sim_key`]).
    key_of: Vec<u32>,
    free: Vec<SlotId>,
    capacity: usize,
    epoch_misses: u64,
    score: f64,
}

impl MiniSim {
    /// A simulated cache of `capacity` pages run by `policy`.
    pub(super) fn with_policy(policy: Box<dyn Eviction>, capacity: usize) -> Self {
        let mut slot_of = IdTable::default();
        slot_of.expect(capacity + 1);
        Self {
            policy,
            slot_of,
            key_of: Vec::with_capacity(capacity + 1),
            free: Vec::new(),
            capacity,
            epoch_misses: 0,
            score: 0.0,
        }
    }

    /// One sampled access: a hit touches, a miss is counted and inserted.
    pub(super) fn access(&mut self, hash: u64) {
        let key = sim_key(hash);
        // The simulation knows its pages by their 32-bit keys, and hands the policy (its
        // ghost) the same remix of them that its map uses, so that an evicted page's hash
        // is known without keeping 64 bits a page.
        let hash = key_hash(key);
        let key_of = &self.key_of;
        if let Some(id) = self.slot_of.find(hash, |id| key_of[id as usize] == key) {
            self.policy.touch(id, hash);
            return;
        }
        self.epoch_misses += 1;
        if self.slot_of.len() >= self.capacity {
            if let Some(victim) = self.policy.pop_victim() {
                let gone = key_hash(self.key_of[victim as usize]);
                self.policy.evicted(gone);
                self.slot_of.remove(gone, |id| id == victim);
                self.free.push(victim);
            }
        }
        let id = match self.free.pop() {
            Some(id) => {
                self.key_of[id as usize] = key;
                id
            }
            None => {
                self.key_of.push(key);
                (self.key_of.len() - 1) as SlotId
            }
        };
        let key_of = &self.key_of;
        self.slot_of.insert_unique(hash, id, |x| key_hash(key_of[x as usize]));
        self.policy.insert(id, hash);
    }

    /// Folds this epoch's misses into the decayed score.
    pub(super) fn end_epoch(&mut self) {
        self.score = self.score * DECAY + self.epoch_misses as f64;
        self.epoch_misses = 0;
    }

    /// Misses in the epoch under way (folded into the score by `end_epoch`).
    pub(super) fn epoch_misses(&self) -> u64 {
        self.epoch_misses
    }

    /// The name of the simulated policy.
    #[cfg(feature = "research-policies")]
    pub(super) fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Decayed misses so far (lower is better).
    pub(super) fn score(&self) -> f64 {
        self.score
    }

    /// Checks the simulated policy and that its map agrees with it.
    pub(super) fn validate(&self) {
        self.policy.validate();
        assert_eq!(self.policy.len(), self.slot_of.len(), "simulation lost track of its pages");
        assert!(self.slot_of.len() <= self.capacity, "simulation over its capacity");
        self.slot_of.validate(|id| key_hash(self.key_of[id as usize]));
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.policy.heap_bytes()
            + self.slot_of.heap_bytes()
            + self.key_of.capacity() * 4
            + self.free.capacity() * 4
    }
}

/// A sampled key's 64-bit hash folded to the 32 bits a simulation keeps of it: two keys
/// of one simulation's ~1000 pages share them once in ~4 million (a hit counted that was
/// a miss), and a 64-bit hash a page would cost ~12 KiB an engine more.
fn sim_key(hash: u64) -> u32 {
    (hash ^ (hash >> 32)) as u32
}

/// The hash a simulation files its key under, and hands its policy.
fn key_hash(key: u32) -> u64 {
    crate::hashing::mix64(u64::from(key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::Lru;

    #[test]
    fn a_simulation_fed_a_sample_keeps_its_key_map_at_its_size() {
        // A sample is the keys whose remixed high bits are small (`sampled`): 1 in 64 here.
        // Filed under those same hashes, they would all have their first group among the
        // table's first few, and the map would grow to twice its size; `key_hash` remixes
        // the keys the map files them under.
        let hashes = (0u64..).map(|k| xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes()));
        let sampled = hashes.filter(|h| (h.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) < 1 << 26);
        let mut sim = MiniSim::with_policy(Box::new(Lru::new()), 1024);
        for hash in sampled.take(20_000) {
            sim.access(hash);
        }
        sim.validate();
        let mut expected = IdTable::<Folded>::default();
        expected.expect(1025);
        for id in 0..1024 {
            expected.insert_unique(key_hash(id), id, key_hash);
        }
        assert_eq!(sim.slot_of.heap_bytes(), expected.heap_bytes());
    }
}
