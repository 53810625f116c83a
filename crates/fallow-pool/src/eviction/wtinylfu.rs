//! W-TinyLFU with an adaptive window, as in Caffeine (Einziger, Friedman and Manes,
//! "TinyLFU: A Highly Efficient Cache Admission Policy", ToS 2017; "Adaptive Software Cache
//! Management", Middleware 2018).
//!
//! ```text
//!  insert ─► window LRU ─front─► candidate ─┐  freq(candidate) > freq(victim)?
//!  (1 % at start)                           ├─ yes: candidate stays in probation,
//!                                           │       victim evicted
//!  main SLRU: probation (20 %) ─front─► victim ─┘  no: candidate evicted
//!       ▲ hit: to protected (80 %) ─overflow: front back to probation
//! ```
//!
//! Popularity comes from a [`FrequencySketch`] fed on every hit (`touch`) and every store
//! (`insert`). The window's share is tuned by Caffeine's hill climber: every
//! `10 × capacity` accesses it compares the sample's hit rate with the previous one and
//! keeps moving the window size in the same direction while the hit rate improves, else
//! reverses; steps start at 6.25 % of capacity, shrink by 2 % per sample, and restart when
//! the hit rate jumps by 5 points (a workload change). Recency-heavy workloads thus get a
//! large LRU window, frequency-heavy ones a small one. The window is never under 1 page,
//! so a 12-page cache still admits new pages.
//!
//! Per slot: two 24-bit links, the key's 32-bit fingerprint (admission compares the sketch
//! estimates of two resident pages, and `pop_victim` is not given hashes) and one state
//! byte: 11 bytes, plus the sketch's 8 bytes per page of capacity.

use super::list::{Links, List};
use super::sketch::FrequencySketch;
use super::{Eviction, SlotId};

/// Caffeine's `PERCENT_MAIN`: the window starts at 1 % of the capacity.
const PERCENT_MAIN: f64 = 0.99;
/// Caffeine's `PERCENT_MAIN_PROTECTED`: 80 % of the main space is protected.
const PERCENT_MAIN_PROTECTED: f64 = 0.80;
/// Hill-climber step as a share of the capacity.
const STEP_PERCENT: f64 = 0.0625;
/// Each sample's step is this times the previous one.
const STEP_DECAY_RATE: f64 = 0.98;
/// A hit-rate change at least this large restarts the climb with a full step.
const RESTART_THRESHOLD: f64 = 0.05;
/// Candidates at least this popular are admitted now and then (1 in 128) even when they
/// lose, so an attacker cannot pin a victim by colliding with it in the sketch (Caffeine's
/// hash-flooding defence).
const ADMIT_HASHDOS_THRESHOLD: u8 = 6;
/// The most pages one climb moves between regions, as in Caffeine; unused quota returns.
const QUEUE_TRANSFER_THRESHOLD: usize = 1000;

/// Which region a slot is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Region {
    Untracked = 0,
    Window = 1,
    Probation = 2,
    Protected = 3,
}

/// Window LRU + TinyLFU admission + segmented-LRU main space, window sized by hill climbing.
#[derive(Debug)]
pub struct WTinyLfu {
    links: Links,
    region: Vec<Region>,
    /// Per slot: low 32 bits of the key hash, for sketch look-ups at eviction time.
    fingerprint: Vec<u32>,
    window: List,
    probation: List,
    protected: List,
    sketch: FrequencySketch,
    capacity: usize,
    window_max: usize,
    protected_max: usize,
    climber: Climber,
    /// How the window's share is tuned.
    sizing: WindowSizing,
    /// xorshift state for the hash-flooding defence; deterministic, so runs repeat.
    rng: u64,
}

/// How [`WTinyLfu`] sizes its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowSizing {
    /// Caffeine's hill climber on the sampled hit rate.
    HillClimber,
    /// A fixed window of this many percent of the capacity (at least one page).
    Fixed(u8),
}

/// Caffeine's hill climber state.
#[derive(Debug, Default)]
struct Climber {
    hits: usize,
    misses: usize,
    previous_hit_rate: f64,
    /// Signed pages; negative shrinks the window.
    step: f64,
}

impl WTinyLfu {
    /// An empty W-TinyLFU for a cache of `capacity` pages.
    pub fn new(capacity: usize) -> Self {
        Self::with_sizing(capacity, WindowSizing::HillClimber)
    }

    /// An empty W-TinyLFU whose window is sized by `sizing`.
    pub fn with_sizing(capacity: usize, sizing: WindowSizing) -> Self {
        let mut s = Self {
            links: Links::default(),
            region: Vec::new(),
            fingerprint: Vec::new(),
            window: List::default(),
            probation: List::default(),
            protected: List::default(),
            sketch: FrequencySketch::default(),
            capacity: 0,
            window_max: 1,
            protected_max: 0,
            climber: Climber::default(),
            sizing,
            rng: 0x2545_f491_4f6c_dd1d,
        };
        s.set_capacity(capacity);
        s
    }

    /// The window's current target size in pages (for tests and metrics).
    pub fn window_target(&self) -> usize {
        self.window_max
    }

    fn region(&self, id: SlotId) -> Region {
        self.region.get(id as usize).copied().unwrap_or(Region::Untracked)
    }

    fn relink(&mut self, id: SlotId, to: Region) {
        let from = self.region(id);
        let links = &mut self.links;
        match from {
            Region::Window => self.window.unlink(links, id),
            Region::Probation => self.probation.unlink(links, id),
            Region::Protected => self.protected.unlink(links, id),
            Region::Untracked => {}
        }
        match to {
            Region::Window => self.window.push_back(links, id),
            Region::Probation => self.probation.push_back(links, id),
            Region::Protected => self.protected.push_back(links, id),
            Region::Untracked => {}
        }
        self.region[id as usize] = to;
    }

    /// Moves protected pages over the protected target back to probation.
    fn demote_protected(&mut self) {
        while self.protected.len() > self.protected_max {
            let Some(id) = self.protected.front() else { break };
            self.relink(id, Region::Probation);
        }
    }

    fn record(&mut self, hit: bool, fp: u32) {
        self.sketch.increment(fp);
        if hit {
            self.climber.hits += 1;
        } else {
            self.climber.misses += 1;
        }
        if self.sizing == WindowSizing::HillClimber
            && self.climber.hits + self.climber.misses >= self.sketch.sample_size()
        {
            self.climb();
        }
    }

    /// One hill-climbing step (Caffeine's `determineAdjustment` then `increaseWindow` or
    /// `decreaseWindow`).
    fn climb(&mut self) {
        let c = &mut self.climber;
        let hit_rate = c.hits as f64 / (c.hits + c.misses) as f64;
        let change = hit_rate - c.previous_hit_rate;
        let amount = if change >= 0.0 { c.step } else { -c.step };
        c.step = if change.abs() >= RESTART_THRESHOLD {
            STEP_PERCENT * self.capacity as f64 * if amount >= 0.0 { 1.0 } else { -1.0 }
        } else {
            STEP_DECAY_RATE * amount
        };
        c.previous_hit_rate = hit_rate;
        c.hits = 0;
        c.misses = 0;
        let amount = amount as i64;
        if amount > 0 {
            self.increase_window(amount.unsigned_abs() as usize);
        } else if amount < 0 {
            self.decrease_window(amount.unsigned_abs() as usize);
        }
    }

    /// Takes up to `quota` pages of target from the protected region, and the oldest main
    /// pages with them, into the window.
    fn increase_window(&mut self, quota: usize) {
        let quota = quota.min(self.protected_max);
        self.protected_max -= quota;
        self.window_max += quota;
        self.demote_protected();
        let mut moved = 0;
        while moved < quota.min(QUEUE_TRANSFER_THRESHOLD) {
            let Some(id) = self.probation.front().or_else(|| self.protected.front()) else {
                break;
            };
            self.relink(id, Region::Window);
            moved += 1;
        }
        // Quota with no page to move behind it (the cache is not full) stays granted:
        // the window fills from new inserts.
    }

    /// Gives up to `quota` pages of window target to the protected region, moving the
    /// window's oldest pages to probation. The window keeps at least one page.
    fn decrease_window(&mut self, quota: usize) {
        let quota = quota.min(self.window_max.saturating_sub(1));
        self.protected_max += quota;
        self.window_max -= quota;
        for _ in 0..quota.min(QUEUE_TRANSFER_THRESHOLD) {
            if self.window.len() <= self.window_max {
                break;
            }
            let Some(id) = self.window.front() else { break };
            self.relink(id, Region::Probation);
        }
    }

    /// TinyLFU admission: does `candidate` deserve `victim`'s place?
    fn admit(&mut self, candidate: SlotId, victim: SlotId) -> bool {
        let cand = self.sketch.frequency(self.fingerprint[candidate as usize]);
        let vict = self.sketch.frequency(self.fingerprint[victim as usize]);
        if cand > vict {
            return true;
        }
        if cand < ADMIT_HASHDOS_THRESHOLD {
            return false;
        }
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng & 127 == 0
    }

    fn evict(&mut self, id: SlotId) -> SlotId {
        self.relink(id, Region::Untracked);
        id
    }
}

impl Eviction for WTinyLfu {
    fn name(&self) -> &'static str {
        "wtinylfu"
    }

    fn set_capacity(&mut self, pages: usize) {
        // As Caffeine's `setMaximumSize`: the window restarts at 1 % and the climb anew.
        let pages = pages.max(1);
        self.capacity = pages;
        let window = match self.sizing {
            WindowSizing::Fixed(percent) => pages * usize::from(percent.min(100)) / 100,
            _ => pages - (PERCENT_MAIN * pages as f64) as usize,
        };
        self.window_max = window.clamp(1, pages);
        self.protected_max = (PERCENT_MAIN_PROTECTED * (pages - self.window_max) as f64) as usize;
        self.climber = Climber { step: -STEP_PERCENT * pages as f64, ..Climber::default() };
        self.sketch.set_capacity(pages);
        self.demote_protected();
    }

    fn insert(&mut self, id: SlotId, hash: u64) {
        self.links.ensure(id);
        if self.region.len() <= id as usize {
            self.region.resize(id as usize + 1, Region::Untracked);
            self.fingerprint.resize(id as usize + 1, 0);
        }
        debug_assert_eq!(self.region(id), Region::Untracked, "slot {id} is already tracked");
        let fp = hash as u32;
        self.fingerprint[id as usize] = fp;
        self.relink(id, Region::Window);
        // Before the cache is full the window spills into probation without evicting.
        while self.window.len() > self.window_max {
            let Some(old) = self.window.front() else { break };
            self.relink(old, Region::Probation);
        }
        self.record(false, fp);
    }

    fn touch(&mut self, id: SlotId, hash: u64) {
        match self.region(id) {
            Region::Window => self.window.move_to_back(&mut self.links, id),
            Region::Probation => {
                self.relink(id, Region::Protected);
                self.demote_protected();
            }
            Region::Protected => self.protected.move_to_back(&mut self.links, id),
            Region::Untracked => debug_assert!(false, "slot {id} is not tracked"),
        }
        self.record(true, hash as u32);
    }

    fn remove(&mut self, id: SlotId) {
        debug_assert_ne!(self.region(id), Region::Untracked, "slot {id} is not tracked");
        self.relink(id, Region::Untracked);
    }

    fn pop_victim(&mut self) -> Option<SlotId> {
        // The caller is about to insert a page into the window. If that will push the
        // window's oldest page out, it becomes the candidate and duels the probation
        // victim now, exactly as Caffeine does after the insert.
        if !self.window.is_empty() && self.window.len() >= self.window_max {
            let candidate = self.window.front()?;
            self.relink(candidate, Region::Probation);
            let victim = match self.probation.front() {
                Some(v) if v != candidate => Some(v),
                _ => self.protected.front(),
            };
            let Some(victim) = victim else {
                return Some(self.evict(candidate));
            };
            let loser = if self.admit(candidate, victim) { victim } else { candidate };
            return Some(self.evict(loser));
        }
        let id = self.probation.front().or(self.protected.front()).or(self.window.front())?;
        Some(self.evict(id))
    }

    fn len(&self) -> usize {
        self.window.len() + self.probation.len() + self.protected.len()
    }

    fn heap_bytes(&self) -> usize {
        self.links.heap_bytes()
            + self.region.capacity()
            + self.fingerprint.capacity() * 4
            + self.sketch.heap_bytes()
    }

    fn validate(&self) {
        for (list, region) in [
            (&self.window, Region::Window),
            (&self.probation, Region::Probation),
            (&self.protected, Region::Protected),
        ] {
            list.validate(&self.links, |id| {
                assert_eq!(self.region(id), region, "slot {id} is on the wrong list");
            });
        }
        let tracked = self.region.iter().filter(|r| **r != Region::Untracked).count();
        assert_eq!(tracked, self.len(), "region bytes disagree with the lists");
        assert!(self.window_max >= 1, "the window must hold at least one page");
        assert!(self.window_max + self.protected_max <= self.capacity.max(1));
    }
}
