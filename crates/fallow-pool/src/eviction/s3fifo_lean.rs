//! `s3fifo-lean`: S3-FIFO in two bytes of policy state per page ([`super::fixed_share`]),
//! its small-queue share chosen by miniature simulations.
//!
//! ```text
//!  insert ─┬─ left small unpromoted within the last ~0.9 × capacity such evictions? ─► main
//!          └─ else ─► small LRU (share: 1 % to 100 %)
//!                        │ front, ≥ 2 hits ─► main FIFO (the rest) ◄─┐ front: freq > 0,
//!                        │ front, fewer ─► evicted, into the ghost    ┘ freq -= 1; else evicted
//!
//!  sampled accesses ─► minisims[1 %, 10 %, 100 %] (own pages, capacity × rate)
//!                       └─ every epoch: the live small share := the simulations' shares
//!                          blended by how surely each trails the leader (`share_chooser.rs`)
//! ```
//!
//! **The share is set by miniature simulations** (Waldspurger et al., "Cache Modeling and
//! Optimization using Miniature Simulations", USENIX ATC'17; Caffeine's simulator sizes
//! W-TinyLFU's window the same way in its `MiniSimClimber`, by Ohad Eytan, one of the
//! authors of "Adaptive Software Cache Management", Middleware'18): three simulated caches
//! of at most 1024 pages (`mini_sim::SIM_PAGES`) run the policy with a fixed share of 1 %,
//! 10 % (the paper's) and 100 % (LRU), one decade apart, on a hash-sampled share of the
//! accesses; at the end of every epoch the live share becomes a geometric blend of the
//! three, in which the simulation that missed least weighs most and each other weighs less
//! the more consistently it trails, over the epochs rather than in one burst
//! (`share_chooser.rs`, "How the live share follows"). The live policy starts at 10 %, the
//! blend of three alike. Changing the share reshapes nothing at once: the queues drift to
//! their new targets as pages leave. That drift is not free (a cache that was LRU enters
//! 1 % with an empty main queue), which is why the share moves only as far as the
//! evidence goes. One set of simulations serves every shard of an engine
//! (`share_chooser.rs`).
//!
//! Bytes per page: the core's 2 B ([`super::fixed_share`]); on top, per engine (not per
//! shard), the three simulations: at most 3 × 1024 simulated pages with their links,
//! state, filters, 32-bit keys and key maps, 49 KiB whatever the capacity (0.8 B per page
//! of a 256 MiB engine; the test `full_simulations_take_about_49_kib_an_engine` measures
//! it). `heap_bytes` reports the policy's own part and its share of the simulations.

use std::sync::Arc;

use super::fixed_share::FixedShare;
use super::share_chooser::ShareChooser;
use super::{Eviction, SlotId};

/// S3-FIFO with 2 bytes of state per page, its small-queue share chosen by miniature
/// simulations.
pub struct S3FifoLean {
    live: FixedShare,
    /// The simulations, shared with the policies of the engine's other shards.
    chooser: Arc<ShareChooser>,
    capacity: usize,
}

impl S3FifoLean {
    /// A lean S3-FIFO for a cache of `capacity` pages, with simulations of its own.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self::with_chooser(capacity, Arc::new(ShareChooser::new(capacity)))
    }

    /// A lean S3-FIFO for one shard of `capacity` pages whose share `chooser` picks; the
    /// chooser was made for the capacities of all the policies that share it.
    pub fn with_chooser(capacity: usize, chooser: Arc<ShareChooser>) -> Self {
        let capacity = capacity.max(1);
        let share = chooser.share();
        Self { live: FixedShare::new(capacity, share), chooser, capacity }
    }

    /// The small queue's share of the capacity this shard runs with now (1.0: plain LRU);
    /// [`Eviction::small_share`] is the engine's share, which it takes up at its next
    /// insert or eviction.
    pub fn live_share(&self) -> f64 {
        self.live.share()
    }

    /// Takes up the share the simulations chose, if it changed.
    fn follow_choice(&mut self) {
        let share = self.chooser.share();
        if share != self.live.share() {
            self.live.set_share(share);
        }
    }
}

impl Eviction for S3FifoLean {
    fn name(&self) -> &'static str {
        "s3fifo-lean"
    }

    fn set_capacity(&mut self, pages: usize) {
        let pages = pages.max(1);
        self.live.set_capacity(pages);
        if pages != self.capacity {
            self.chooser.resize(self.capacity, pages);
            self.capacity = pages;
        }
    }

    fn insert(&mut self, id: SlotId, hash: u64) {
        self.follow_choice();
        self.live.insert(id, hash);
        self.chooser.observe(hash);
    }

    fn touch(&mut self, id: SlotId, hash: u64) {
        self.live.touch(id, hash);
        self.chooser.observe(hash);
    }

    fn remove(&mut self, id: SlotId) {
        self.live.remove(id);
    }

    fn pop_victim(&mut self) -> Option<SlotId> {
        self.follow_choice();
        self.live.pop_victim()
    }

    fn evicted(&mut self, hash: u64) {
        self.live.evicted(hash);
    }

    fn small_share(&self) -> Option<f64> {
        // The engine's share, which this shard takes up at its next insert or eviction.
        Some(self.chooser.share())
    }

    fn len(&self) -> usize {
        self.live.len()
    }

    fn heap_bytes(&self) -> usize {
        // Each sharing policy reports its part of the simulations, so that the shards'
        // reports add up to what the engine holds.
        let sharers = Arc::strong_count(&self.chooser).max(1);
        self.live.heap_bytes() + self.chooser.heap_bytes() / sharers
    }

    fn validate(&self) {
        self.live.validate();
        self.chooser.validate();
    }
}

#[cfg(test)]
mod tests {
    use super::super::mini_sim::MiniSim;
    use super::*;

    fn hash(key: u64) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes())
    }

    /// Replays `keys` on a cache of `capacity` pages run by `policy` (the replay is
    /// `MiniSim`'s: a hit touches, a miss is counted and inserted); returns the miss ratio.
    fn miss_ratio(policy: S3FifoLean, keys: &[u64], capacity: usize) -> f64 {
        let mut sim = MiniSim::with_policy(Box::new(policy), capacity);
        keys.iter().for_each(|&k| sim.access(hash(k)));
        sim.validate();
        sim.end_epoch();
        sim.score() / keys.len() as f64
    }

    fn zigzag(pages: u64, rounds: u64) -> Vec<u64> {
        (0..rounds)
            .flat_map(|r| {
                let up: Vec<u64> = (0..pages).collect();
                if r % 2 == 0 {
                    up
                } else {
                    up.into_iter().rev().collect()
                }
            })
            .collect()
    }

    /// Drives the policies of a few shards as an engine would: a key lives in shard
    /// `key % shards`, a hit touches it, a miss evicts when its shard is full and inserts.
    struct Driver {
        slot_of: std::collections::HashMap<u64, SlotId>,
        key_of: Vec<Vec<u64>>,
        per_shard: usize,
    }

    impl Driver {
        fn new(shards: usize, per_shard: usize) -> Self {
            Self { slot_of: Default::default(), key_of: vec![Vec::new(); shards], per_shard }
        }

        /// One access; true when it missed.
        fn access(&mut self, policies: &mut [S3FifoLean], key: u64) -> bool {
            let shard = (key % policies.len() as u64) as usize;
            let p = &mut policies[shard];
            if let Some(&id) = self.slot_of.get(&key) {
                p.touch(id, hash(key));
                return false;
            }
            let keys = &mut self.key_of[shard];
            let id = if keys.len() >= self.per_shard {
                let victim = p.pop_victim().expect("a full shard has a victim");
                p.evicted(hash(keys[victim as usize]));
                self.slot_of.remove(&keys[victim as usize]);
                keys[victim as usize] = key;
                victim
            } else {
                keys.push(key);
                (keys.len() - 1) as SlotId
            };
            self.slot_of.insert(key, id);
            p.insert(id, hash(key));
            true
        }
    }

    #[test]
    fn a_zigzag_makes_the_small_queue_the_whole_cache() {
        // Up and down over 300 pages with a 100-page cache: only recency helps. LRU hits
        // the first 100 pages of every sweep after the first: a miss ratio of ~0.68.
        let mut p = [S3FifoLean::new(100)];
        let mut driver = Driver::new(1, 100);
        let keys = zigzag(300, 40);
        let misses = keys.iter().filter(|&&key| driver.access(&mut p, key)).count();
        p[0].validate();
        assert_eq!(p[0].live_share(), 1.0, "the LRU simulation should lead");
        let ratio = misses as f64 / keys.len() as f64;
        assert!(ratio < 0.70, "miss ratio {ratio}");
    }

    #[test]
    fn shards_that_share_a_chooser_follow_one_choice() {
        // A zigzag over 300 pages, split over two 50-page shards by key: together a
        // 100-page cache. The shared simulations see both halves and move both to LRU.
        let chooser = Arc::new(ShareChooser::new(100));
        let mut shards: Vec<S3FifoLean> =
            (0..2).map(|_| S3FifoLean::with_chooser(50, chooser.clone())).collect();
        let mut driver = Driver::new(2, 50);
        for key in zigzag(300, 40) {
            driver.access(&mut shards, key);
        }
        for p in &mut shards {
            p.pop_victim();
            p.validate();
            assert_eq!(p.live_share(), 1.0, "every shard follows the shared choice");
        }
    }

    #[test]
    fn a_sampled_chooser_follows_a_steady_lead() {
        // 4 shards of 2048 pages: the simulations see 1 key in 16, so the share moves
        // toward a leader only as far as its lead has been consistent (`share_chooser.rs`).
        // A zigzag over three times the cache gives LRU such a lead, sweep after sweep.
        let chooser = Arc::new(ShareChooser::new(4 * 2048));
        let mut shards: Vec<S3FifoLean> =
            (0..4).map(|_| S3FifoLean::with_chooser(2048, chooser.clone())).collect();
        let mut driver = Driver::new(4, 2048);
        let mut shares = Vec::new();
        for _ in 0..3 {
            for key in zigzag(3 * 8192, 8) {
                driver.access(&mut shards, key);
            }
            shares.push(shards[0].small_share().expect("s3fifo-lean has a share"));
        }
        for p in &mut shards {
            p.pop_victim();
            p.validate();
            assert_eq!(p.live_share(), shares[2], "every shard takes up the engine's share");
        }
        assert!(shares[0] > 0.2, "eight sweeps move it toward LRU: {shares:?}");
        assert!(shares.windows(2).all(|w| w[0] <= w[1]), "and on: {shares:?}");
        assert!(shares[2] > 0.9, "the sampled simulations' LRU lead was not followed: {shares:?}");
    }

    #[test]
    fn shards_report_one_set_of_simulations_between_them() {
        // Eight shards of 8192 pages sharing a chooser report one set of simulations
        // between them; eight policies of their own would hold eight sets.
        // Each policy sees one access: the simulations are built at the first.
        let accessed = |mut p: S3FifoLean| {
            p.insert(0, hash(1));
            p
        };
        let separate: usize = (0..8).map(|_| accessed(S3FifoLean::new(8192)).heap_bytes()).sum();
        let chooser = Arc::new(ShareChooser::new(8 * 8192));
        assert_eq!(chooser.heap_bytes(), 0, "no simulation before the first access");
        let shards: Vec<S3FifoLean> =
            (0..8).map(|_| accessed(S3FifoLean::with_chooser(8192, chooser.clone()))).collect();
        let shared: usize = shards.iter().map(S3FifoLean::heap_bytes).sum();
        let sims = chooser.heap_bytes();
        assert!(sims > 10_000, "a set of simulations takes {sims} B");
        assert!(shared + 7 * sims <= separate, "{shared} B shared, {separate} B separate");
    }

    #[test]
    fn full_simulations_take_about_49_kib_an_engine() {
        // The figure the module doc and BENCHMARKS.md give: three simulations of SIM_PAGES
        // (1024) pages each, full and evicting. Key maps that filed the sampled keys under
        // the hash that sampled them would be twice this size (a sample is the keys whose
        // remixed high bits are small, and so would be their first groups): the keys are
        // remixed (`mini_sim::key_hash`).
        let chooser = Arc::new(ShareChooser::new(8 * 8192));
        let mut p = S3FifoLean::with_chooser(8192, chooser.clone());
        for id in 0..8192u32 {
            p.insert(id, hash(u64::from(id)));
        }
        for i in 0..200_000u64 {
            let id = p.pop_victim().expect("a page to evict");
            p.evicted(hash(u64::from(id)));
            p.insert(id, hash(i + 10_000));
        }
        let sims = chooser.heap_bytes();
        eprintln!("simulations: {sims} B");
        assert!(sims > 44 << 10 && sims < 54 << 10, "{sims} B of simulations");
    }

    #[test]
    fn a_budget_change_in_one_shard_resizes_the_shared_simulations() {
        let chooser = Arc::new(ShareChooser::new(2 * 4096));
        let mut a = S3FifoLean::with_chooser(4096, chooser.clone());
        let mut b = S3FifoLean::with_chooser(4096, chooser.clone());
        b.insert(0, hash(0));
        let full = chooser.heap_bytes();
        a.set_capacity(64);
        b.set_capacity(64);
        // 128 pages in all: below SIM_PAGES, so each simulation holds the whole cache. The
        // simulations are rebuilt once, at the next access.
        a.insert(0, hash(1));
        assert!(chooser.heap_bytes() < full / 2, "simulations did not shrink with the budget");
        a.validate();
        b.validate();
    }

    #[test]
    fn a_loop_larger_than_the_cache_mostly_hits() {
        // A 150-page loop on a 100-page cache: LRU misses every access; S3-FIFO keeps most
        // of its main queue.
        let keys: Vec<u64> = (0..60).flat_map(|_| 0..150u64).collect();
        let ratio = miss_ratio(S3FifoLean::new(100), &keys, 100);
        assert!(ratio < 0.6, "miss ratio {ratio}");
    }
}
