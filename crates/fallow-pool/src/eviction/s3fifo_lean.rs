//! `s3fifo-lean`: S3-FIFO in two bytes of policy state per page, its small-queue share
//! chosen by miniature simulations.
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
//! The algorithm is [`super::S3Fifo`]'s (Yang et al., SOSP'23: a small probationary queue
//! for new pages, a main queue with a 2-bit frequency as second chance, a ghost that sends
//! a page missed again soon straight to main), with three changes:
//!
//! * **The small queue is LRU** (a hit moves the page to its back) instead of FIFO, so that
//!   at a share of 100 % the policy *is* LRU: with the whole cache as small queue nothing is
//!   promoted and the ghost is not consulted.
//! * **The share is set by miniature simulations** (Waldspurger et al., "Cache Modeling
//!   and Optimization using Miniature Simulations", USENIX ATC'17; Caffeine's simulator
//!   sizes W-TinyLFU's window the same way in its `MiniSimClimber`, by Ohad Eytan, one of
//!   the authors of "Adaptive Software Cache Management", Middleware'18):
//!   three simulated caches of at most 1024 pages (`adaptive::SIM_PAGES`) run this policy
//!   with a fixed share of 1 %, 10 % (the paper's) and 100 % (LRU), one decade apart, on a
//!   hash-sampled share of the accesses; at the end of every epoch the live share becomes a
//!   geometric blend of the three, in which the simulation that missed least weighs most
//!   and each other weighs less the more consistently it trails, over the epochs rather
//!   than in one burst (`share_chooser.rs`, "How the live share follows"). The live policy
//!   starts at 10 %, the blend of three alike. Changing the share reshapes nothing at once:
//!   the queues drift to their new targets as pages leave. That drift is cheaper than
//!   `adaptive`'s change of expert but not free (a cache that was LRU enters 1 % with an
//!   empty main queue), which is why the share moves only as far as the evidence goes
//!   (until session 16 it moved a whole decade once a lead was consistent). One set of
//!   simulations serves every shard of an engine (`share_chooser.rs`).
//! * **The ghost keeps fingerprints.** As in the paper, it remembers the pages that left the
//!   small queue without being promoted, `0.9 × capacity` of them, and a page inserted again
//!   while remembered goes straight to main. The policy keeps no hash per page (that
//!   would cost 4–8 bytes): the engine, which knows the victim's key, hands its hash back
//!   right after `pop_victim` (`Eviction::evicted`). The ghost keeps an 8-bit fingerprint
//!   of each hash in buckets of four ([`GhostBuckets`]): a bucket forgets its oldest
//!   fingerprint when a fifth key lands in it, so a page is remembered for the last
//!   `0.9 × capacity` such evictions on average, as in the paper, in 0.9 bytes per page;
//!   a false positive (≤ 1.6 %) admits a page to main early. (Until session 14 a pair of
//!   Bloom filters in 1 byte per page remembered the last 0.45–0.9 × capacity evictions,
//!   with ~4 % false positives; the buckets' longer reach made 29 rows of the shared
//!   traces better and 10 worse. Until 2026-11-22 the filter took the hash of every
//!   insertion instead, for want of the victim's.)
//!
//! Bytes per page, counted as Caffeine counts its nodes: the queue links (two 24-bit ids,
//! 6 B) are what the engine's index slot would hold; beyond them the policy keeps **2 B**: one
//! state byte per slot (queue: 2 bits, frequency: 2 bits; four bits spare) and the
//! ghost, 0.9 bytes per page of capacity. On top, per engine (not per shard, since
//! 2026-11-22), the three simulations: at most 3 × 1024 simulated pages with their links,
//! state, filters, 32-bit keys and key maps, 49 KiB whatever the capacity (0.8 B per
//! page of a 256 MiB engine; 74 KiB until session 14, when the key maps stopped filing the
//! sampled keys under the hash that sampled them; 512 pages a simulation took 66 KiB
//! while the key maps were `HashMap`s, and 15 B a page with a set per shard; the test
//! `full_simulations_take_about_49_kib_an_engine` measures it). `heap_bytes` reports the
//! policy's own part and its share of the simulations.

use std::sync::Arc;

use super::s3fifo_queues::{Queues, Q_MAIN, Q_SMALL};
use super::share_chooser::{ShareChooser, FIXED_NAMES, SHARES};
use super::{Eviction, SlotId};

/// The ghost remembers this share of the capacity in pages evicted from small (the paper
/// sizes the ghost like the main queue, 90 %).
const GHOST_SHARE: f64 = 0.9;

/// Fingerprints a bucket of the ghost keeps: four bytes of a `u32`.
const BUCKET_KEYS: usize = 4;

/// The hashes of about the last `len` pages that left the small queue unpromoted, as 8-bit
/// fingerprints in buckets of [`BUCKET_KEYS`] (`len / 4` buckets of a `u32`: a byte per
/// remembered page). A hash picks a bucket and a fingerprint from bits apart from those
/// that chose its shard and the simulations' sample; an insertion shifts the bucket's
/// bytes up by one and puts the fingerprint in the lowest, so the oldest of the four falls
/// out. A key is thus forgotten after four more keys landed in its bucket: `len`
/// insertions later on average (spread like a sum of four exponentials, so some sooner,
/// some later), the FIFO ghost of the paper in expectation. A lookup compares the
/// fingerprint with the bucket's four bytes at once; a key never inserted matches with
/// probability at most 4/255. Keys are not removed on a hit (a stale fingerprint costs
/// nothing but its byte: an exact ghost that forgot a key once found did the same on the
/// shared traces, RFC 0001 "Session 12").
///
/// Why buckets of four: the fewer fingerprints a bucket holds, the fewer false positives
/// (k/255) but the more random a key's stay; on the shared traces (sample seeds 0–1),
/// buckets of 8 / 4 / 2 / 1 failed criterion 1 on 3 / 4 / 4–5 / 7 rows and criterion 3 on
/// 7 / 5 / 5 / 6, with a mean reduction of 10.8 / 11.0 / 11.0 / 11.0 %.
///
/// The soft stay is a trade, not only a saving. An exact FIFO ghost of the same length
/// (`S3Fifo`'s, ~13 B an entry) wins the rows whose pages come back within the window
/// (cloudPhysicsIO reads-only at 52,500 pages: 0.786 against 0.801) and loses the small
/// caches of loops, where remembering every page that left sends them all to main
/// (lirs_ps at 154: 0.693 against 0.635); on the whole table it fails criterion 3 on 5
/// rows against 2 (RFC 0001, "Session 17").
///
/// The buckets are allocated at the first insertion, not when sized: a cache that never
/// evicts from its small queue (a persistent pool's shard, a cache not yet full) has
/// nothing to remember and pays nothing for it.
#[derive(Debug, Default)]
struct GhostBuckets {
    /// Empty until the first insertion; then `len / 4` buckets, rounded up.
    buckets: Vec<u32>,
    /// Buckets once allocated.
    count: usize,
}

impl GhostBuckets {
    /// Sizes the ghost to remember about `len` keys. A new size starts empty (a budget
    /// change, not a hot path).
    fn set_len(&mut self, len: usize) {
        let count = len.div_ceil(BUCKET_KEYS).max(1);
        if count != self.count {
            self.count = count;
            self.buckets = Vec::new();
        }
    }

    /// The bucket and the fingerprint (never 0, the empty byte) of `hash`.
    fn locate(&self, hash: u64) -> (usize, u32) {
        let h = hash.wrapping_mul(0xd6e8_feb8_6659_fd93);
        let bucket = ((u128::from(h) * self.count as u128) >> 64) as usize;
        let fingerprint = (hash.rotate_left(21).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u32;
        (bucket, fingerprint.max(1))
    }

    fn insert(&mut self, hash: u64) {
        if self.buckets.is_empty() {
            self.buckets = vec![0; self.count];
        }
        let (bucket, fingerprint) = self.locate(hash);
        let b = &mut self.buckets[bucket];
        *b = (*b << 8) | fingerprint;
    }

    fn contains(&self, hash: u64) -> bool {
        if self.buckets.is_empty() {
            return false;
        }
        let (bucket, fingerprint) = self.locate(hash);
        // A zero byte in `x` is a match: the classic test for one, exact (no borrow
        // between bytes).
        let x = self.buckets[bucket] ^ fingerprint.wrapping_mul(0x0101_0101);
        const LOW7: u32 = 0x7f7f_7f7f;
        !((x & LOW7).wrapping_add(LOW7) | x | LOW7) != 0
    }

    fn heap_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<u32>()
    }

    fn validate(&self) {
        let len = self.buckets.len();
        assert!(len == 0 || len == self.count, "ghost size drifted");
    }
}

/// S3-FIFO with an LRU small queue of a fixed share: the live policy's core, and the
/// policy each miniature simulation runs.
#[derive(Debug)]
pub(super) struct FixedShare {
    queues: Queues,
    ghost: GhostBuckets,
    capacity: usize,
    share: f64,
    small_target: usize,
    /// The last victim left from the small queue unpromoted: its hash, when the engine
    /// tells it (`evicted`), goes into the ghost.
    victim_from_small: bool,
}

impl FixedShare {
    pub(super) fn new(capacity: usize, share: f64) -> Self {
        let mut s = Self {
            queues: Queues::default(),
            ghost: GhostBuckets::default(),
            capacity: 0,
            share,
            small_target: 1,
            victim_from_small: false,
        };
        s.set_capacity(capacity);
        s
    }

    fn set_share(&mut self, share: f64) {
        self.share = share;
        self.small_target =
            ((self.capacity as f64 * share).round() as usize).clamp(1, self.capacity);
    }

    /// True when the small queue is the whole cache: plain LRU.
    fn lru_only(&self) -> bool {
        self.small_target >= self.capacity
    }
}

impl Eviction for FixedShare {
    fn name(&self) -> &'static str {
        SHARES.iter().position(|&s| s == self.share).map_or("s3fifo-lean", |i| FIXED_NAMES[i])
    }

    fn small_share(&self) -> Option<f64> {
        Some(self.share)
    }

    fn set_capacity(&mut self, pages: usize) {
        self.capacity = pages.max(1);
        self.queues.expect(self.capacity);
        let ghost = ((self.capacity as f64 * GHOST_SHARE) as usize).max(1);
        self.ghost.set_len(ghost);
        self.set_share(self.share);
    }

    fn insert(&mut self, id: SlotId, hash: u64) {
        let missed_recently = self.ghost.contains(hash);
        // As `S3Fifo::insert` (libCacheSim): while the cache still has room and the small
        // queue is full, new pages go straight to main.
        let room = self.len() < self.capacity && self.queues.small_len() >= self.small_target;
        let to_main = !self.lru_only() && (missed_recently || room);
        self.queues.insert(id, if to_main { Q_MAIN } else { Q_SMALL });
    }

    fn touch(&mut self, id: SlotId, _hash: u64) {
        // The small queue is LRU: a hit moves the page to its back.
        self.queues.touch(id, true);
    }

    fn remove(&mut self, id: SlotId) {
        self.queues.remove(id);
    }

    fn pop_victim(&mut self) -> Option<SlotId> {
        // After the share grew, small is under its target and main drains first. With the
        // small queue the whole cache (LRU), nothing is promoted.
        let may_promote = !self.lru_only();
        let (id, from_small) = self.queues.pop_victim(self.small_target, may_promote)?;
        self.victim_from_small = from_small;
        Some(id)
    }

    fn evicted(&mut self, hash: u64) {
        if self.victim_from_small {
            self.ghost.insert(hash);
        }
        self.victim_from_small = false;
    }

    fn len(&self) -> usize {
        self.queues.len()
    }

    fn heap_bytes(&self) -> usize {
        self.queues.heap_bytes() + self.ghost.heap_bytes()
    }

    fn validate(&self) {
        self.queues.validate();
        assert!(self.small_target >= 1 && self.small_target <= self.capacity);
        self.ghost.validate();
    }
}

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
        self.live.share
    }

    /// Takes up the share the simulations chose, if it changed.
    fn follow_choice(&mut self) {
        let share = self.chooser.share();
        if share != self.live.share {
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
    use super::super::adaptive::MiniSim;
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
        // (1024) pages each, full and evicting. 74 KiB until session 14, when the key maps
        // filed the sampled keys under the hash that had sampled them: a sample is the keys
        // whose remixed high bits are small, and so were their first groups, and the maps
        // grew to twice their size. Their 32-bit keys are now remixed (`adaptive::key_hash`).
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

    #[test]
    fn at_full_share_it_is_lru() {
        // Fixed at 100 %, the victim is always the least recently used page.
        let mut p = FixedShare::new(8, 1.0);
        for id in 0..8 {
            p.insert(id, hash(u64::from(id)));
        }
        p.touch(0, hash(0));
        p.touch(3, hash(3));
        let order: Vec<SlotId> = std::iter::from_fn(|| p.pop_victim()).collect();
        assert_eq!(order, [1, 2, 4, 5, 6, 7, 0, 3]);
    }

    #[test]
    fn a_page_evicted_from_small_comes_back_to_main_and_one_from_main_does_not() {
        // Ten pages, small's target five: the first five fill small, the rest go to main
        // while there is room.
        let mut p = FixedShare::new(10, 0.5);
        for id in 0..10 {
            p.insert(id, hash(u64::from(id)));
        }
        // Small is at its target: its front (page 0, no hits) leaves, into the ghost.
        assert_eq!(p.pop_victim(), Some(0));
        p.evicted(hash(0));
        // Small is under its target now: main's front (page 5, no hits) leaves, not into
        // the ghost.
        assert_eq!(p.pop_victim(), Some(5));
        p.evicted(hash(5));
        p.insert(0, hash(0));
        p.insert(5, hash(5));
        assert_eq!(p.queues.queue(0), Q_MAIN, "a ghost hit goes to main");
        assert_eq!(p.queues.queue(5), Q_SMALL, "a page evicted from main is no ghost");
        p.validate();
    }

    #[test]
    fn the_ghost_remembers_recent_evictions_and_forgets_old_ones() {
        let mut g = GhostBuckets::default();
        g.set_len(900);
        for key in 0..900 {
            g.insert(hash(key));
        }
        let remembered = |g: &GhostBuckets, keys: std::ops::Range<u64>| {
            keys.filter(|&k| g.contains(hash(k))).count()
        };
        // The last three keys are certainly there (a bucket forgets only its fifth); of the
        // newest half, a key is gone only if four more landed in its bucket since: ~5 %.
        assert!((897..900).all(|k| g.contains(hash(k))), "a recent key was forgotten");
        let recent = remembered(&g, 450..900);
        // Keys never inserted: false positives stay below 4/255.
        let false_positives = remembered(&g, 1_000_000..1_010_000);
        // Of the oldest half (450–900 insertions old, two to four a bucket since), a key
        // stays while fewer than four landed after it: ~65 %. So a key is remembered for
        // 900 insertions on average, however its stays are spread.
        let older = remembered(&g, 0..450);
        // After another 1800 insertions (eight a bucket on average), few are left.
        for key in 10_000..11_800 {
            g.insert(hash(key));
        }
        let old = remembered(&g, 0..900);
        assert!(recent > 400, "{recent} of the newest 450 keys remembered");
        assert!(false_positives < 200, "{false_positives} false positives in 10000");
        assert!(older > 250 && older < 340, "{older} of the oldest 450 keys remembered");
        assert!(old < 90, "{old} of 900 keys remembered after 1800 more");
        g.validate();
    }

    #[test]
    fn the_ghost_takes_no_memory_until_something_is_evicted_from_small() {
        let mut p = FixedShare::new(4096, 0.1);
        for id in 0..4096 {
            p.insert(id, hash(u64::from(id)));
        }
        assert_eq!(p.ghost.heap_bytes(), 0, "a cache that has not evicted remembers nothing");
        assert!(!p.ghost.contains(hash(1)));
        for id in 4096..4200 {
            let victim = p.pop_victim().expect("a page to evict");
            p.evicted(hash(u64::from(victim)));
            p.insert(id, hash(u64::from(id)));
        }
        // 0.9 × 4096 keys remembered, a byte each.
        assert_eq!(p.ghost.heap_bytes(), 3688, "0.9 bytes per page of capacity, once in use");
        p.validate();
    }

    #[test]
    fn state_is_two_bytes_per_page_beyond_the_links() {
        // Links (6 B per slot) would live in the index entry; the rest is 1 state byte per
        // slot and 0.9 ghost bytes per page of capacity.
        let mut p = FixedShare::new(4096, 0.1);
        for id in 0..4096 {
            p.insert(id, hash(u64::from(id)));
        }
        let victim = p.pop_victim().expect("a page to evict");
        p.evicted(hash(u64::from(victim)));
        p.insert(victim, hash(1 << 40));
        let beyond_links = p.heap_bytes() - p.queues.links_heap_bytes();
        assert!(beyond_links <= 2 * 4096 + 64, "{beyond_links} B for 4096 pages");
    }
}
