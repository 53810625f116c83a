//! `adaptive`: several expert policies order the same resident pages, and miniature
//! simulations decide which expert picks the victims. It was the default until
//! `s3fifo-lean` (one expert, its one parameter chosen by the same simulations) beat it on
//! the shared traces with 2 B of policy state per page instead of ~80: RFC 0001, step 5.
//!
//! No single policy wins everywhere: LRU is optimal on recency-friendly patterns (a
//! zigzag, a stack) where S3-FIFO and LIRS lose badly, and S3-FIFO or LIRS win on scans,
//! loops and skewed mixes where LRU loses badly. So every expert tracks every
//! resident page (insert, touch and remove go to all), and one of them, the *leader*,
//! chooses each victim; the others are told it was evicted (`on_evicted`), so their ghost
//! histories stay as if they had chosen it.
//!
//! Which expert leads is decided by miniature simulations (Waldspurger et al., "Cache
//! Modeling and Optimization using Miniature Simulations", USENIX ATC'17): for each expert
//! kind, a small cache of its own runs on a hash-sampled share of the accesses, sized to
//! the same share of the capacity, so its miss count predicts how that policy would do
//! alone. At the end of every epoch, the expert whose simulation missed least (older
//! epochs decay slowly) takes the lead if its simulated miss ratio beats the leader's by a
//! margin and the difference is statistically clear of chance. An expert that takes over
//! has followed every access all along, so it leads with warm ordering; but the pages
//! resident are the ones the old leader kept, and reshaping them costs about one turnover
//! of the cache. That cost is why changes are made reluctantly: on traces whose phases
//! are shorter than a turnover (cloudPhysicsIO), following the simulations loses to
//! staying put (see `BENCHMARKS.md`).
//!
//! ```text
//!  access ─┬─▶ experts[0..k] (shared residency) ── leader.pop_victim() ──▶ victim
//!          └─ sampled? ─▶ sims[0..k] (own residency, capacity × rate) ──▶ misses per epoch
//! ```
//!
//! Cost: every operation runs on each expert (O(1) each), plus on each simulation for the
//! sampled share. Memory: the experts' per-page state added up, plus the simulations
//! (bounded by `SIM_PAGES` pages each).

use super::mini_sim::{MiniSim, DECAY, MIN_EPOCH, SIM_PAGES};
use super::{Eviction, Lirs, Lru, S3Fifo, SlotId};

/// A challenger leads only if its simulated miss ratio (decayed like the scores) is this
/// much below the leader's, doubled for every earlier change of leader: near-ties never
/// make the leader flap, and a workload that keeps changing its mind stops moving it.
const MARGIN: f64 = 0.01;

/// The experts, by name. The first, S3-FIFO, has the lowest mean miss ratio of them on its
/// own, so it leads until a simulation shows another expert is clearly better. W-TinyLFU
/// was a fourth: on the shared traces the committee chose as well without it, and it cost
/// ~16 B per page and a quarter of the per-access work.
const EXPERTS: [&str; 3] = ["s3fifo", "lru", "lirs"];

fn expert(name: &str, capacity: usize) -> Box<dyn Eviction> {
    match name {
        "lru" => Box::new(Lru::new()),
        "lirs" => Box::new(Lirs::new(capacity)),
        _ => Box::new(S3Fifo::new(capacity)),
    }
}

/// A simulation of the expert `name`.
fn sim(name: &str, capacity: usize) -> MiniSim {
    MiniSim::with_policy(expert(name, capacity), capacity)
}

/// Experts led by whichever miniature simulation misses least.
pub struct Adaptive {
    experts: Vec<Box<dyn Eviction>>,
    sims: Vec<MiniSim>,
    leader: usize,
    capacity: usize,
    /// A key hash is sampled when its remixed high 32 bits are below this.
    threshold: u64,
    epoch_len: usize,
    max_epoch_len: usize,
    epoch_accesses: usize,
    /// Sampled accesses, decayed like the scores: turns a score into a miss ratio.
    weight: f64,
    switches: u64,
}

impl Adaptive {
    /// An adaptive policy for a cache of `capacity` pages.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        let mut policy = Self {
            experts: EXPERTS.iter().map(|n| expert(n, capacity)).collect(),
            sims: Vec::new(),
            leader: 0,
            capacity,
            threshold: 0,
            epoch_len: 0,
            max_epoch_len: 0,
            epoch_accesses: 0,
            weight: 0.0,
            switches: 0,
        };
        policy.reset_sims();
        policy
    }

    /// The expert currently choosing victims.
    pub fn leader(&self) -> &'static str {
        self.experts[self.leader].name()
    }

    /// Each expert's decayed miss score in its miniature simulation (lower is better).
    pub fn scores(&self) -> Vec<(&'static str, f64)> {
        self.sims.iter().map(|s| (s.policy_name(), s.score())).collect()
    }

    /// How many times the leader changed.
    pub fn switches(&self) -> u64 {
        self.switches
    }

    fn reset_sims(&mut self) {
        // Sample rate: everything for small caches, else SIM_PAGES / capacity.
        let rate = (SIM_PAGES as f64 / self.capacity as f64).min(1.0);
        self.threshold = (rate * (1u64 << 32) as f64) as u64;
        let sim_capacity = ((self.capacity as f64 * rate).round() as usize).max(1);
        self.sims = EXPERTS.iter().map(|n| sim(n, sim_capacity)).collect();
        self.epoch_len = MIN_EPOCH;
        self.max_epoch_len = sim_capacity.max(MIN_EPOCH);
        self.epoch_accesses = 0;
        self.weight = 0.0;
    }

    fn sampled(&self, hash: u64) -> bool {
        // Remix so the choice is independent of the bits that chose the shard.
        (hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) < self.threshold
    }

    fn observe(&mut self, hash: u64) {
        if !self.sampled(hash) {
            return;
        }
        self.sims.iter_mut().for_each(|s| s.access(hash));
        self.epoch_accesses += 1;
        if self.epoch_accesses >= self.epoch_len {
            self.epoch_accesses = 0;
            self.sims.iter_mut().for_each(MiniSim::end_epoch);
            self.weight = self.weight * DECAY + self.epoch_len as f64;
            self.epoch_len = (self.epoch_len * 2).min(self.max_epoch_len);
            let best = (0..self.sims.len())
                .min_by(|&a, &b| self.sims[a].score().total_cmp(&self.sims[b].score()))
                .unwrap_or(self.leader);
            let (lead, challenger) = (self.sims[self.leader].score(), self.sims[best].score());
            let gain = (lead - challenger) / self.weight;
            // Miss counts are noisy (early epochs above all): the difference must also stand
            // two standard deviations clear of chance, treating both as Poisson counts.
            let significant = lead - challenger > 2.0 * (lead + challenger).sqrt();
            if significant && gain > MARGIN {
                self.leader = best;
                self.switches += 1;
            }
        }
    }
}

impl Eviction for Adaptive {
    fn name(&self) -> &'static str {
        "adaptive"
    }

    fn set_capacity(&mut self, pages: usize) {
        let pages = pages.max(1);
        self.experts.iter_mut().for_each(|e| e.set_capacity(pages));
        if pages != self.capacity {
            self.capacity = pages;
            self.reset_sims();
        }
    }

    fn insert(&mut self, id: SlotId, hash: u64) {
        self.experts.iter_mut().for_each(|e| e.insert(id, hash));
        self.observe(hash);
    }

    fn touch(&mut self, id: SlotId, hash: u64) {
        self.experts.iter_mut().for_each(|e| e.touch(id, hash));
        self.observe(hash);
    }

    fn remove(&mut self, id: SlotId) {
        self.experts.iter_mut().for_each(|e| e.remove(id));
    }

    fn pop_victim(&mut self) -> Option<SlotId> {
        let victim = self.experts[self.leader].pop_victim()?;
        for (i, e) in self.experts.iter_mut().enumerate() {
            if i != self.leader {
                e.on_evicted(victim);
            }
        }
        Some(victim)
    }

    fn len(&self) -> usize {
        self.experts[self.leader].len()
    }

    fn heap_bytes(&self) -> usize {
        self.experts.iter().map(|e| e.heap_bytes()).sum::<usize>()
            + self.sims.iter().map(MiniSim::heap_bytes).sum::<usize>()
    }

    fn validate(&self) {
        let len = self.experts[0].len();
        for e in &self.experts {
            e.validate();
            assert_eq!(e.len(), len, "expert {} tracks {} pages, not {len}", e.name(), e.len());
        }
        self.sims.iter().for_each(MiniSim::validate);
        assert!(self.leader < self.experts.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(policy: &mut Adaptive, trace: impl Iterator<Item = u64>, capacity: usize) -> f64 {
        let mut slot_of = std::collections::HashMap::new();
        let mut hash_of = Vec::new();
        let (mut misses, mut n) = (0, 0);
        for key in trace {
            n += 1;
            let hash = xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes());
            if let Some(&id) = slot_of.get(&hash) {
                policy.touch(id, hash);
                continue;
            }
            misses += 1;
            let id = if slot_of.len() >= capacity {
                let v = policy.pop_victim().unwrap();
                slot_of.remove(&hash_of[v as usize]);
                hash_of[v as usize] = hash;
                v
            } else {
                hash_of.push(hash);
                (hash_of.len() - 1) as SlotId
            };
            slot_of.insert(hash, id);
            policy.insert(id, hash);
        }
        policy.validate();
        misses as f64 / n as f64
    }

    #[test]
    fn a_zigzag_makes_lru_lead() {
        // Up and down over 300 pages with a 100-page cache: only recency helps.
        let trace = (0..40).flat_map(|r| {
            let up: Vec<u64> = (0..300).collect();
            if r % 2 == 0 {
                up
            } else {
                up.into_iter().rev().collect()
            }
        });
        let mut p = Adaptive::new(100);
        let ratio = run(&mut p, trace, 100);
        assert_eq!(p.leader(), "lru");
        assert!(ratio < 0.72, "miss ratio {ratio}");
    }

    #[test]
    fn a_loop_larger_than_the_cache_makes_a_scan_resistant_expert_lead() {
        let trace = (0..60).flat_map(|_| 0..150u64);
        let mut p = Adaptive::new(100);
        let ratio = run(&mut p, trace, 100);
        assert_ne!(p.leader(), "lru");
        assert!(ratio < 0.6, "miss ratio {ratio}");
    }
}
