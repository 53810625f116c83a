//! The miniature simulations that choose `s3fifo-lean`'s small-queue share, one set per
//! engine, shared by the policies of all its shards.
//!
//! ```text
//!  shard 0 policy ─┐ sampled key hashes             ┌─ choice (atomic) ─▶ every shard's
//!  shard 1 policy ─┼──────────────▶ sims[1 %, 10 %, 100 %] ┘              live share
//!  …               ┘   (one mutex)    capacity × rate pages each
//! ```
//!
//! The shards hold disjoint slices of one key space picked by hash, so they see the same
//! workload; sampling the keys of all of them at `SIM_PAGES / total capacity` gives the
//! simulations the same sample that one shard's own set would get at
//! `SIM_PAGES / its capacity`, but at one set's cost instead of one per shard. Per shard,
//! the sets took ≈ 120 KiB each: 15 B per page in the 8 shards of a 256 MiB engine, and
//! 4 × the CPUs of them in every engine (RFC 0001).
//!
//! # Locking
//! The mutex is a leaf: it is taken with a shard's mutex held (a sampled access, a budget
//! change, validation) and nothing is taken under it. Only sampled accesses take it, a
//! share `SIM_PAGES / capacity` of them (every access when the whole engine holds fewer
//! than `SIM_PAGES` pages).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::adaptive::{MiniSim, MIN_EPOCH, SIM_PAGES};
use super::s3fifo_lean::FixedShare;

/// Small-queue shares the simulations compare, one decade apart around the paper's 10 %;
/// 100 % is LRU.
pub(super) const SHARES: [f64; 3] = [0.01, 0.10, 1.0];
/// The policy names of each share held fixed (`by_name`): the simulations' own policies,
/// to compare the choice with what each share alone would do.
pub(super) const FIXED_NAMES: [&str; 3] = ["s3fifo-lean-1", "s3fifo-lean-10", "s3fifo-lean-100"];
/// The live policy starts with the paper's share. The start matters on short traces:
/// starting as LRU or at 1 % trades one trace goal for the other (RFC 0001, session 6).
const INITIAL_CHOICE: usize = 1;

/// The simulations and their epoch clock.
struct Sims {
    sims: Vec<MiniSim>,
    /// Pages of every shard together, when full.
    capacity: usize,
    epoch_len: usize,
    max_epoch_len: usize,
    epoch_accesses: usize,
    /// The capacity changed since the simulations were built for it.
    stale: bool,
}

/// Chooses the small-queue share for the `s3fifo-lean` policies of one engine.
pub struct ShareChooser {
    sims: Mutex<Sims>,
    /// Index into [`SHARES`] of the share every policy should use.
    choice: AtomicUsize,
    /// A key hash is sampled when its remixed high 32 bits are below this. Read without
    /// the lock, so that an access that is not sampled costs one load.
    threshold: AtomicU64,
}

impl ShareChooser {
    /// A chooser for policies whose capacities add up to `capacity` pages. The simulations
    /// are built at the first access, so an engine whose pages are all persistent (never
    /// given to a policy) pays nothing for them.
    pub fn new(capacity: usize) -> Self {
        Self {
            sims: Mutex::new(Sims {
                sims: Vec::new(),
                capacity: capacity.max(1),
                epoch_len: 0,
                max_epoch_len: 0,
                epoch_accesses: 0,
                stale: true,
            }),
            choice: AtomicUsize::new(INITIAL_CHOICE),
            // Sample the first access, which builds the simulations and sets the real rate.
            threshold: AtomicU64::new(u64::MAX),
        }
    }

    /// The index into [`SHARES`] of the share to use now.
    pub(super) fn choice(&self) -> usize {
        self.choice.load(Ordering::Relaxed)
    }

    /// One policy's capacity changed from `old` to `new` pages: the total changes by the
    /// difference, and the simulations start over at the new size. A budget change resizes
    /// every shard's policy in turn, so the simulations are rebuilt once, at the next
    /// access, not once per shard.
    pub(super) fn resize(&self, old: usize, new: usize) {
        let mut sims = self.sims.lock();
        let total = (sims.capacity + new).saturating_sub(old).max(1);
        if total != sims.capacity {
            sims.capacity = total;
            sims.stale = true;
            // Sample every access until the rebuild, which sets the real rate.
            self.threshold.store(u64::MAX, Ordering::Relaxed);
        }
    }

    fn reset(&self, sims: &mut Sims) {
        // As `Adaptive::reset_sims`: every key is sampled for small caches, else
        // SIM_PAGES / capacity of them, and each simulation has that share of the pages.
        let rate = (SIM_PAGES as f64 / sims.capacity as f64).min(1.0);
        self.threshold.store((rate * (1u64 << 32) as f64) as u64, Ordering::Relaxed);
        let sim_capacity = ((sims.capacity as f64 * rate).round() as usize).max(1);
        sims.sims = SHARES
            .iter()
            .map(|&share| {
                MiniSim::with_policy(Box::new(FixedShare::new(sim_capacity, share)), sim_capacity)
            })
            .collect();
        sims.stale = false;
        sims.epoch_len = MIN_EPOCH;
        sims.max_epoch_len = sim_capacity.max(MIN_EPOCH);
        sims.epoch_accesses = 0;
    }

    /// True when the key whose hash is `hash` is in the simulations' sample (the same remix
    /// and sample as `adaptive`'s simulations).
    fn sampled(&self, hash: u64) -> bool {
        (hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) < self.threshold.load(Ordering::Relaxed)
    }

    /// An access to the key whose hash is `hash` (a hit or a miss, in any shard).
    pub(super) fn observe(&self, hash: u64) {
        if !self.sampled(hash) {
            return;
        }
        let mut guard = self.sims.lock();
        if guard.stale {
            self.reset(&mut guard);
            if !self.sampled(hash) {
                return;
            }
        }
        let s = &mut *guard;
        s.sims.iter_mut().for_each(|sim| sim.access(hash));
        s.epoch_accesses += 1;
        if s.epoch_accesses < s.epoch_len {
            return;
        }
        s.epoch_accesses = 0;
        s.sims.iter_mut().for_each(MiniSim::end_epoch);
        s.epoch_len = (s.epoch_len * 2).min(s.max_epoch_len);
        let choice = self.choice();
        let best = (0..s.sims.len())
            .min_by(|&a, &b| s.sims[a].score().total_cmp(&s.sims[b].score()))
            .unwrap_or(choice);
        if s.sims[best].score() < s.sims[choice].score() {
            self.choice.store(best, Ordering::Relaxed);
        }
    }

    /// Heap bytes of the simulations (those of the old size until the first access after
    /// a resize rebuilds them).
    pub(super) fn heap_bytes(&self) -> usize {
        self.sims.lock().sims.iter().map(MiniSim::heap_bytes).sum()
    }

    /// Panics unless every simulation is consistent and the choice is a share.
    pub(super) fn validate(&self) {
        self.sims.lock().sims.iter().for_each(MiniSim::validate);
        assert!(self.choice() < SHARES.len(), "share choice out of range");
    }
}
