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
//! # When the live share follows
//! A simulation's lead over the live choice is the difference of their decayed misses.
//! The live share moves to a challenger only when that lead is *consistent*: larger than
//! [`SWITCH_Z`] × √(1 − sample rate) times the root of the decayed sum of the squared
//! per-epoch differences (a t-statistic of the paired epochs). Following the first lead
//! (the rule until 2026-11-23) left the live cache chasing noise and short phases: on
//! cloudPhysicsIO it moved to LRU on a one-miss lead at its 4th epoch, and the switch
//! itself costs the live cache a turnover the simulations never pay. Simulations that see
//! every access (an engine of at most `SIM_PAGES` pages) are exact copies of their shares,
//! so there the factor is 0 and any lead is followed at once, as before: short traces that
//! want LRU from the start need that. RFC 0001 (session 12) has the measurements, over
//! four sample seeds ([`SEED_VAR`]).
//!
//! # Locking
//! The mutex is a leaf: it is taken with a shard's mutex held (a sampled access, a budget
//! change, validation) and nothing is taken under it. Only sampled accesses take it, a
//! share `SIM_PAGES / capacity` of them (every access when the whole engine holds fewer
//! than `SIM_PAGES` pages).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::adaptive::{MiniSim, DECAY, MIN_EPOCH, SIM_PAGES};
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
/// How consistent a lead must be, in standard deviations of the per-epoch differences,
/// before the live share follows it (scaled by √(1 − sample rate), see the module doc).
const SWITCH_Z: f64 = 2.0;
/// An environment variable that, when set to an integer, changes which keys the
/// simulations sample (read once per engine). For measuring how much a result depends on
/// the sample (`bench/trace_compare.py --sim-seeds`); unset, the sample is seed 0.
pub const SEED_VAR: &str = "FALLOW_SIM_SEED";

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
    /// The share of the keys sampled.
    rate: f64,
    /// Per pair of simulations: the decayed sum of the squared differences of their misses
    /// per epoch (symmetric), the spread that a lead is measured against.
    lead_spread: [[f64; SHARES.len()]; SHARES.len()],
}

/// Chooses the small-queue share for the `s3fifo-lean` policies of one engine.
pub struct ShareChooser {
    sims: Mutex<Sims>,
    /// Index into [`SHARES`] of the share every policy should use.
    choice: AtomicUsize,
    /// A key hash is sampled when its remixed high 32 bits are below this. Read without
    /// the lock, so that an access that is not sampled costs one load.
    threshold: AtomicU64,
    /// Mixed into a key hash before sampling ([`SEED_VAR`]); 0 by default.
    seed: u64,
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
                rate: 1.0,
                lead_spread: Default::default(),
            }),
            choice: AtomicUsize::new(INITIAL_CHOICE),
            // Sample the first access, which builds the simulations and sets the real rate.
            threshold: AtomicU64::new(u64::MAX),
            seed: sample_seed(),
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
        sims.rate = rate;
        sims.lead_spread = Default::default();
        sims.epoch_len = MIN_EPOCH;
        sims.max_epoch_len = sim_capacity.max(MIN_EPOCH);
        sims.epoch_accesses = 0;
    }

    /// True when the key whose hash is `hash` is in the simulations' sample (the same remix
    /// and sample as `adaptive`'s simulations).
    fn sampled(&self, hash: u64) -> bool {
        ((hash ^ self.seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32)
            < self.threshold.load(Ordering::Relaxed)
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
        for a in 0..s.sims.len() {
            for b in 0..s.sims.len() {
                let d = s.sims[a].epoch_misses() as f64 - s.sims[b].epoch_misses() as f64;
                s.lead_spread[a][b] = s.lead_spread[a][b] * DECAY + d * d;
            }
        }
        s.sims.iter_mut().for_each(MiniSim::end_epoch);
        s.epoch_len = (s.epoch_len * 2).min(s.max_epoch_len);
        let choice = self.choice();
        let scores: [f64; SHARES.len()] = std::array::from_fn(|i| s.sims[i].score());
        if let Some(next) = consistent_leader(&scores, &s.lead_spread, s.rate, choice) {
            self.choice.store(next, Ordering::Relaxed);
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

/// The simulation whose lead over `choice` is the most consistent, if one's is consistent
/// enough to follow (module doc): its lead (the decayed misses it saved, from `scores`)
/// over the root of the decayed squared per-epoch differences (`spread`) exceeds
/// `SWITCH_Z × √(1 − rate)`.
fn consistent_leader(
    scores: &[f64],
    spread: &[[f64; SHARES.len()]; SHARES.len()],
    rate: f64,
    choice: usize,
) -> Option<usize> {
    let hurdle = SWITCH_Z * (1.0 - rate).max(0.0).sqrt();
    let mut best: Option<(usize, f64)> = None;
    for j in (0..scores.len()).filter(|&j| j != choice) {
        let lead = scores[choice] - scores[j];
        let spread = spread[choice][j].sqrt();
        // A positive lead means the two differed in some epoch, so the spread is > 0.
        if lead <= 0.0 || spread <= 0.0 {
            continue;
        }
        let t = lead / spread;
        if t > hurdle && best.is_none_or(|(_, bt)| t > bt) {
            best = Some((j, t));
        }
    }
    best.map(|(j, _)| j)
}

/// The sample seed from [`SEED_VAR`], 0 when unset; a value that is not an integer is
/// reported and ignored.
fn sample_seed() -> u64 {
    match std::env::var(SEED_VAR) {
        Err(_) => 0,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(seed) => spread_seed(seed),
            Err(_) => {
                tracing::warn!("{SEED_VAR}={v:?} is not an integer; sampling with seed 0");
                0
            }
        },
    }
}

/// Seed `seed` spread over all 64 bits, so that seeds 1, 2, 3 differ everywhere.
fn spread_seed(seed: u64) -> u64 {
    seed.wrapping_mul(0xa076_1d64_78bd_642f)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scores and spreads after `epochs` of per-epoch misses (one row per epoch, one
    /// column per share), decayed as the chooser decays them.
    fn after(epochs: &[[f64; 3]]) -> ([f64; 3], [[f64; 3]; 3]) {
        let (mut scores, mut spread) = ([0.0; 3], [[0.0; 3]; 3]);
        for misses in epochs {
            for a in 0..3 {
                scores[a] = scores[a] * DECAY + misses[a];
                for b in 0..3 {
                    let d = misses[a] - misses[b];
                    spread[a][b] = spread[a][b] * DECAY + d * d;
                }
            }
        }
        (scores, spread)
    }

    const SAMPLED: f64 = 0.01;
    const EXACT: f64 = 1.0;

    #[test]
    fn exact_simulations_are_followed_on_any_lead() {
        let (scores, spread) = after(&[[10.0, 10.0, 9.0]]);
        assert_eq!(consistent_leader(&scores, &spread, EXACT, 1), Some(2));
    }

    #[test]
    fn a_lead_of_one_epoch_is_not_followed_when_sampled_and_a_steady_one_is() {
        let one = after(&[[10.0, 10.0, 9.0]]);
        assert_eq!(consistent_leader(&one.0, &one.1, SAMPLED, 1), None);
        // The same one-miss lead, eight epochs running: t = 8 / √8 ≈ 2.8.
        let steady = after(&[[10.0, 10.0, 9.0]; 8]);
        assert_eq!(consistent_leader(&steady.0, &steady.1, SAMPLED, 1), Some(2));
    }

    #[test]
    fn a_lead_won_in_one_burst_is_not_followed_when_sampled() {
        // Ten misses saved in one epoch, then even for seven: a phase, not a trend.
        let mut epochs = vec![[30.0, 30.0, 20.0]];
        epochs.extend([[10.0, 10.0, 10.0]; 7]);
        let (scores, spread) = after(&epochs);
        assert!(scores[1] - scores[2] > 9.0, "the lead is there");
        assert_eq!(consistent_leader(&scores, &spread, SAMPLED, 1), None);
        assert_eq!(consistent_leader(&scores, &spread, EXACT, 1), Some(2));
    }

    #[test]
    fn the_most_consistent_challenger_wins_over_the_largest_lead() {
        // Share 0 leads by 3 per epoch with a wobble; share 2 by 2 per epoch, steadily.
        let epochs: Vec<[f64; 3]> =
            (0..8).map(|i| if i % 2 == 0 { [5.0, 10.0, 8.0] } else { [9.0, 10.0, 8.0] }).collect();
        let (scores, spread) = after(&epochs);
        assert!(scores[0] < scores[2], "share 0 has the larger lead");
        assert_eq!(consistent_leader(&scores, &spread, SAMPLED, 1), Some(2));
        // Once there, share 0's lead of 1 a epoch, wobbling by 2, is not enough to move on;
        // exact simulations would follow it, and nothing leads share 0.
        assert_eq!(consistent_leader(&scores, &spread, SAMPLED, 2), None);
        assert_eq!(consistent_leader(&scores, &spread, EXACT, 2), Some(0));
        assert_eq!(consistent_leader(&scores, &spread, EXACT, 0), None);
    }

    #[test]
    fn a_seed_changes_which_keys_are_sampled_but_not_how_many() {
        let mut chooser = ShareChooser::new(100 * SIM_PAGES);
        chooser.threshold.store(((1u64 << 32) as f64 * 0.01) as u64, Ordering::Relaxed);
        let hashes: Vec<u64> =
            (0..100_000u64).map(|k| xxhash_rust::xxh3::xxh3_64(&k.to_le_bytes())).collect();
        let sample =
            |c: &ShareChooser| -> Vec<bool> { hashes.iter().map(|&h| c.sampled(h)).collect() };
        let unseeded = sample(&chooser);
        chooser.seed = spread_seed(7);
        let seeded = sample(&chooser);
        let count = |v: &[bool]| v.iter().filter(|&&b| b).count();
        for n in [count(&unseeded), count(&seeded)] {
            assert!((800..1200).contains(&n), "sampled {n} of 100000 at 1 %");
        }
        let both = unseeded.iter().zip(&seeded).filter(|(a, b)| **a && **b).count();
        assert!(both < 50, "{both} keys in both samples: the seed changed little");
    }
}
