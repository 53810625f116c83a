//! The miniature simulations that choose `s3fifo-lean`'s small-queue share, one set per
//! engine, shared by the policies of all its shards.
//!
//! ```text
//!  shard 0 policy ─┐ sampled key hashes              ┌─ share (atomic) ─▶ every shard's
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
//! # How the live share follows
//! At the end of every epoch, the simulation with the fewest decayed misses *leads*. How
//! surely each other one trails it is a t-statistic of the paired epochs: the difference
//! of their decayed misses over the root of the decayed sum of the squared per-epoch
//! differences. The live share is a weighted geometric mean of the three shares: the
//! leader's weight is 1, a trailing simulation's `exp(−x²)`, where `x` is the lesser of
//! `t / h` and `lead / (MOVE_WORTH × pages)`: the hurdle `h` is [`LEAD_Z`] × √(1 − sample
//! rate), and at least [`MIN_HURDLE`]; the second term asks the lead to be worth a move
//! of the live share, a few percent of a simulated cache's pages in misses
//! ([`MOVE_WORTH`]). A simulation that trails by many spreads and many moves' worth weighs
//! nothing; near-ties weigh alike, and three alike give the middle share, 10 %, the one
//! the live policy starts with.
//!
//! Why a blend rather than a choice of one share: moving the live share costs the live
//! cache a turnover that the simulations never pay, and a choice moves it a decade at
//! once. A choice has to trade late moves (following only a consistent lead lags, which
//! loses lirs_gli) against moves on small leads (following the first lead moves
//! cloudPhysicsIO to LRU on a one-miss lead at its 4th epoch; lirs_cpp at 306 pages flaps
//! to LRU on a one-miss lead of exact simulations, lirs_multi1 at 652 on one of 6 misses).
//! A blend moves as far as the evidence goes, and the evidence must be worth the move. On
//! the shared traces, sample seeds 0–3 (RFC 0001, "Outcome"): criterion 1 fails on 2 rows
//! against 4–5 for a choice on a consistent lead (worst +0.008 either way), criterion 3
//! on 2 against 5–6 (worst +0.030 against +0.037–0.042), and the mean reduction is
//! 11.4–11.5 % against 10.8–11.0 %.
//!
//! Simulations that see every access (an engine of at most `SIM_PAGES` pages) are exact
//! copies of their shares, so there the factor √(1 − rate) is 0 and [`MIN_HURDLE`] alone
//! sets how fast a lead is followed: short traces that want LRU from the start need it
//! small. RFC 0001 and its appendix have the measurements, over several sample seeds
//! ([`SEED_VAR`]).
//!
//! # Locking
//! The mutex is a leaf: it is taken with a shard's mutex held (a sampled access, a budget
//! change, validation) and nothing is taken under it. Only sampled accesses take it, a
//! share `SIM_PAGES / capacity` of them (every access when the whole engine holds fewer
//! than `SIM_PAGES` pages).

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::fixed_share::{FixedShare, SHARES};
use super::mini_sim::{MiniSim, DECAY, MIN_EPOCH, SIM_PAGES};
/// The live policy starts with the paper's share, the blend of three simulations alike.
/// The start matters on short traces: starting as LRU or at 1 % trades one trace goal for
/// the other (RFC 0001, "Outcome").
const INITIAL_SHARE: f64 = SHARES[1];
/// How surely a simulation must trail the leader, in standard deviations of the
/// per-epoch differences, before its share weighs little in the blend (scaled by
/// √(1 − sample rate), see the module doc).
const LEAD_Z: f64 = 2.0;
/// The least hurdle, which is the whole of it for exact simulations: a trailing share's
/// weight is e⁻¹ at t = 0.25 and e⁻⁴ at t = 0.5. On the shared traces (seed 0, before
/// [`MOVE_WORTH`]; c1 / c3 rows failing, worst over LRU / over the best reference): 0.15
/// gave 2 / 4 (+0.008 / +0.039), 0.25 3 / 4 (+0.008 / +0.037), 0.35 3 / 4 (+0.012 /
/// +0.034), 0.5 3 / 4 (+0.015 / +0.036), 1.0 5 / 4 (+0.023 / +0.031): lower hurdles suit
/// the short traces that want LRU at once (lirs_sprite at 708 pages), higher ones those
/// that want 1 % (lirs_multi1 at 652). RFC 0001, "Outcome".
const MIN_HURDLE: f64 = 0.25;
/// How many misses, as a share of a simulated cache's pages, a simulation must save over
/// another before the other weighs little: moving the live share costs the live cache a
/// turnover the simulations never pay (its queues drift to their new targets, and a cache
/// that was LRU enters 1 % with an empty main queue), so a consistent lead of a few misses
/// does not pay for the move. lirs_multi1 at 652 pages: after the fill, the exact LRU
/// simulation led by 6 and then 19 misses for two epochs, the live share went to LRU and
/// back to 1 % when 1 % took the lead by hundreds, and the round trip cost ~500 misses
/// (0.440 against 0.407 for 1 % held). On the shared traces (seed 0; c1 / c3 rows failing,
/// mean reduction): no such term 2 / 4, 11.2 %; 0.02 2 / 2, 11.4 %; 0.03 2 / 2, 11.5 %
/// (seeds 1 and 2 the same); 0.04 3 / 2; 0.05 5 / 2 (the short systor17 samples then
/// wait for LRU too long). RFC 0001, "Outcome".
const MOVE_WORTH: f64 = 0.03;
/// A trailing share whose weight is below this counts for nothing, so that a clear leader
/// gives exactly its share (at 100 %, exactly LRU).
const NEGLIGIBLE: f64 = 1e-3;
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
    /// Pages of each simulation.
    sim_capacity: usize,
    epoch_accesses: usize,
    /// The capacity changed since the simulations were built for it.
    stale: bool,
    /// The share of the keys sampled.
    rate: f64,
    /// Epochs ended since the simulations were built (for the log).
    epochs: u64,
    /// Per pair of simulations: the decayed sum of the squared differences of their misses
    /// per epoch (symmetric), the spread that a lead is measured against.
    lead_spread: [[f64; SHARES.len()]; SHARES.len()],
}

/// Chooses the small-queue share for the `s3fifo-lean` policies of one engine.
pub struct ShareChooser {
    sims: Mutex<Sims>,
    /// The small-queue share every policy should use (an `f64`'s bits): a blend of
    /// [`SHARES`].
    share: AtomicU64,
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
                sim_capacity: 1,
                epoch_accesses: 0,
                stale: true,
                rate: 1.0,
                epochs: 0,
                lead_spread: Default::default(),
            }),
            share: AtomicU64::new(INITIAL_SHARE.to_bits()),
            // Sample the first access, which builds the simulations and sets the real rate.
            threshold: AtomicU64::new(u64::MAX),
            seed: sample_seed(),
        }
    }

    /// The small-queue share to use now, between the least and the greatest of [`SHARES`].
    pub(super) fn share(&self) -> f64 {
        f64::from_bits(self.share.load(Ordering::Relaxed))
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
        sims.sim_capacity = sim_capacity;
        sims.epoch_accesses = 0;
        sims.epochs = 0;
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
        let scores: [f64; SHARES.len()] = std::array::from_fn(|i| s.sims[i].score());
        let share = blended_share(&scores, &s.lead_spread, s.rate, s.sim_capacity);
        self.share.store(share.to_bits(), Ordering::Relaxed);
        s.epochs += 1;
        let (epoch, next_len, sim_pages) = (s.epochs, s.epoch_len, s.sim_capacity);
        drop(guard);
        // Epoch ends are rare (one per `epoch_len` sampled accesses, at most one per
        // simulated cache's worth): this is how a run shows why its share moved
        // (`FALLOW_LOG=fallow_pool::eviction=debug fallow trace replay ...`).
        tracing::debug!(
            epoch,
            sim_pages,
            next_epoch_accesses = next_len,
            misses_1 = scores[0],
            misses_10 = scores[1],
            misses_100 = scores[2],
            share_percent = share * 100.0,
            "small-queue share after an epoch of the simulations (decayed misses per share)"
        );
    }

    /// Heap bytes of the simulations (those of the old size until the first access after
    /// a resize rebuilds them).
    pub(super) fn heap_bytes(&self) -> usize {
        self.sims.lock().sims.iter().map(MiniSim::heap_bytes).sum()
    }

    /// Panics unless every simulation is consistent and the share is within [`SHARES`].
    pub(super) fn validate(&self) {
        self.sims.lock().sims.iter().for_each(MiniSim::validate);
        let share = self.share();
        assert!((SHARES[0]..=SHARES[SHARES.len() - 1]).contains(&share), "share {share}");
    }
}

/// The live share for the simulations' decayed misses `scores` and per-pair `spread`s, in
/// simulations of `sim_capacity` pages (module doc): the shares' geometric mean, the
/// leader's weighing 1 and each other's `exp(−x²)`, where `x` is the lesser of how many
/// hurdles its `t` is and how many moves' worth ([`MOVE_WORTH`]) of misses it trails by.
fn blended_share(
    scores: &[f64],
    spread: &[[f64; SHARES.len()]; SHARES.len()],
    rate: f64,
    sim_capacity: usize,
) -> f64 {
    let hurdle = (LEAD_Z * (1.0 - rate).max(0.0).sqrt()).max(MIN_HURDLE);
    let worth = MOVE_WORTH * sim_capacity as f64;
    let leader =
        (0..scores.len()).fold(0, |best, i| if scores[i] < scores[best] { i } else { best });
    let (mut log_sum, mut weights) = (0.0, 0.0);
    for (i, &share) in SHARES.iter().enumerate() {
        let weight = if i == leader {
            1.0
        } else {
            let lead = scores[i] - scores[leader];
            let spread = spread[i][leader].sqrt();
            // No spread: the two never differed in an epoch, a tie.
            let t = if spread > 0.0 { lead / spread } else { 0.0 };
            let w = (-(t / hurdle).min(lead / worth).powi(2)).exp();
            if w < NEGLIGIBLE {
                continue;
            }
            w
        };
        log_sum += weight * share.ln();
        weights += weight;
    }
    if weights == 1.0 {
        // The leader alone: exactly its share, not the logarithm's round trip.
        return SHARES[leader];
    }
    (log_sum / weights).exp().clamp(SHARES[0], SHARES[SHARES.len() - 1])
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

    /// The blend after `epochs`, in simulations of 10 pages: a lead of one miss is then
    /// worth three moves, so how consistent a lead is decides alone.
    fn blend(epochs: &[[f64; 3]], rate: f64) -> f64 {
        blend_in(epochs, rate, 10)
    }

    fn blend_in(epochs: &[[f64; 3]], rate: f64, sim_capacity: usize) -> f64 {
        let (scores, spread) = after(epochs);
        blended_share(&scores, &spread, rate, sim_capacity)
    }

    #[test]
    fn a_consistent_lead_worth_less_than_a_move_moves_the_share_little() {
        // Exact simulations of 652 pages: LRU saves 2 misses an epoch for four epochs, a
        // lead as consistent as can be, but worth 8 misses against a move's 0.03 × 652.
        let small = blend_in(&[[100.0, 100.0, 98.0]; 4], EXACT, 652);
        assert!(small > SHARES[1] && small < 0.2, "{small}");
        // 25 misses an epoch: 100 misses, five moves' worth, is followed whole.
        assert_eq!(blend_in(&[[100.0, 100.0, 75.0]; 4], EXACT, 652), 1.0);
    }

    #[test]
    fn shares_alike_blend_to_the_middle_one() {
        // Never apart: no share trails, all weigh 1, and their geometric mean is 10 %.
        for rate in [SAMPLED, EXACT] {
            let share = blend(&[[10.0, 10.0, 10.0]; 4], rate);
            assert!((share - SHARES[1]).abs() < 1e-12, "{share}");
        }
        assert_eq!(INITIAL_SHARE, SHARES[1], "the start is the blend of no evidence");
    }

    #[test]
    fn exact_simulations_are_followed_on_a_lead_of_one_miss() {
        assert_eq!(blend(&[[10.0, 10.0, 9.0]], EXACT), 1.0, "exactly LRU");
        assert_eq!(blend(&[[9.0, 10.0, 10.0]], EXACT), 0.01);
    }

    #[test]
    fn a_sampled_share_moves_as_far_as_its_lead_is_consistent() {
        // LRU saves one miss an epoch, epoch after epoch: t = n / √n after n epochs.
        let after_epochs = |n| blend(&vec![[10.0, 10.0, 9.0]; n], SAMPLED);
        let shares: Vec<f64> = [1, 8, 16, 40].into_iter().map(after_epochs).collect();
        assert!(shares[0] > SHARES[1] && shares[0] < 0.2, "one epoch moves it little: {shares:?}");
        assert!(shares.windows(2).all(|w| w[0] < w[1]), "each epoch further: {shares:?}");
        assert!(shares[2] > 0.8, "{shares:?}");
        assert_eq!(shares[3], 1.0, "a lead of 6 spreads is followed whole: {shares:?}");
    }

    #[test]
    fn a_lead_won_in_one_burst_moves_a_sampled_share_little() {
        // Ten misses saved in one epoch, then even for seven: a phase, not a trend.
        let mut epochs = vec![[30.0, 30.0, 20.0]];
        epochs.extend([[10.0, 10.0, 10.0]; 7]);
        let (scores, _) = after(&epochs);
        assert!(scores[1] - scores[2] > 9.0, "the lead is there");
        let sampled = blend(&epochs, SAMPLED);
        assert!(sampled < 0.2, "{sampled}");
        assert_eq!(blend(&epochs, EXACT), 1.0, "exact simulations follow it");
    }

    #[test]
    fn a_steady_trailer_weighs_less_than_a_wobbling_one() {
        // Share 0 leads; share 2 trails it by 1 miss an epoch with a wobble of ±3 (t ≈ 0.9
        // after 8 epochs), share 1 by 2 misses, steadily (t ≈ 2.8): the blend
        // keeps share 2 in and leaves share 1 nearly out, so it lies above 1 % and below the
        // 10 % that shares 0 and 2 alike would give.
        let epochs: Vec<[f64; 3]> =
            (0..8).map(|i| if i % 2 == 0 { [8.0, 10.0, 6.0] } else { [8.0, 10.0, 12.0] }).collect();
        let (scores, _) = after(&epochs);
        assert!(scores[0] < scores[2] && scores[2] < scores[1], "{scores:?}");
        let share = blend(&epochs, SAMPLED);
        assert!(share > 0.02 && share < SHARES[1], "{share}");
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
