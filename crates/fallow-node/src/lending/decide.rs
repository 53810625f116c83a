//! The lending rule: from one sample of the host, how large the lent budget should be.
//! Pure (time is an argument), so that every case is a unit test; the thread that applies
//! it is in `governor.rs` and the rule is explained in `docs/governor.md`.
//!
//! ```text
//!  free    = min(MemAvailable, cgroup limit − memory.current)   (both leave out our pages)
//!  reserve = max(reserve_bytes, reserve_fraction × total)
//!  target  = our page bytes + free − reserve, clamped to [min_lend, max_lend], whole segments
//!
//!  target < budget        → shrink to target now           (reason: low-memory / host-use)
//!  PSI stall in the window → also one pressure_step lower   (reason: pressure)
//!  target ≥ budget + hysteresis, no pressure for `cooldown`, last grow ≥ grow_every ago
//!                         → grow by at most grow_step       (reason: grow)
//! ```
//!
//! # Components
//! [`AutoConfig`]: the knobs and their defaults. [`Decider`]: the rule and the little state
//! it keeps between samples (cooldown, PSI window). [`Decision`] and [`Reason`]: its answer.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use fallow_pool::{MAX_BUDGET_BYTES, SEGMENT_BYTES};

use super::host::HostMemory;

const SEGMENT: u64 = SEGMENT_BYTES as u64;
const MIB: u64 = 1 << 20;
/// The longest any duration of an [`AutoConfig`] may be.
const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// The knobs of `--lend auto`. Every size is in bytes; see `docs/governor.md` for how each
/// one is used.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoConfig {
    /// Memory always left free for the host (default 1 GiB).
    pub reserve_bytes: u64,
    /// The reserve as a share of the host's (or cgroup's) total memory; the larger of this
    /// and `reserve_bytes` is kept free (default 0.05 = 5 %).
    pub reserve_fraction: f64,
    /// Never lend less than this, even under pressure (default 0).
    pub min_lend_bytes: u64,
    /// Never lend more than this (default: the most one engine can address).
    pub max_lend_bytes: u64,
    /// The most one grow adds (default 64 MiB).
    pub grow_step_bytes: u64,
    /// The least time between two grows (default 200 ms): with the default step, the
    /// budget grows back at up to 320 MiB/s.
    pub grow_every: Duration,
    /// Grow only when the target is at least this far above the budget (default 32 MiB):
    /// keeps MemAvailable's noise from moving the budget up and down every tick.
    pub grow_hysteresis_bytes: u64,
    /// Memory PSI `some`, in percent, at or above which the host is under pressure
    /// (default 10 %). Compared with `avg10` and with the stall share over `psi_window`.
    pub psi_threshold_percent: f64,
    /// The window over which the fresh stall share is measured from PSI's `total` counter;
    /// also the least time between two pressure steps (default 100 ms).
    pub psi_window: Duration,
    /// How much lower than the target a fresh PSI stall takes the budget (default 64 MiB).
    pub pressure_step_bytes: u64,
    /// No growth for this long after the last sign of pressure (default 5 s).
    pub cooldown: Duration,
    /// How often the host is sampled (default 25 ms, so a shrink starts within one tick
    /// and ends well within 100 ms of the pressure).
    pub interval: Duration,
}

impl Default for AutoConfig {
    fn default() -> Self {
        Self {
            reserve_bytes: 1 << 30,
            reserve_fraction: 0.05,
            min_lend_bytes: 0,
            max_lend_bytes: MAX_BUDGET_BYTES as u64,
            grow_step_bytes: 64 * MIB,
            grow_every: Duration::from_millis(200),
            grow_hysteresis_bytes: 32 * MIB,
            psi_threshold_percent: 10.0,
            psi_window: Duration::from_millis(100),
            pressure_step_bytes: 64 * MIB,
            cooldown: Duration::from_secs(5),
            interval: Duration::from_millis(25),
        }
    }
}

/// What is wrong with an [`AutoConfig`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AutoConfigError {
    /// `min_lend_bytes` is above `max_lend_bytes`.
    #[error("min lend ({min} bytes) is above max lend ({max} bytes)")]
    MinAboveMax {
        /// `min_lend_bytes`.
        min: u64,
        /// `max_lend_bytes`.
        max: u64,
    },
    /// A share or a percentage is not a finite number in its range.
    #[error("{name} must be between 0 and {limit}, not {value}")]
    OutOfRange {
        /// The field.
        name: &'static str,
        /// Its value.
        value: f64,
        /// The largest value allowed.
        limit: f64,
    },
    /// A duration that must not be zero is zero.
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
    /// A duration is longer than a day: surely a mistake in its unit.
    #[error("{0} must be at most a day")]
    LongDuration(&'static str),
}

impl AutoConfig {
    /// Checks the configuration; [`Governor::spawn`](super::Governor::spawn) calls it.
    pub fn validate(&self) -> Result<(), AutoConfigError> {
        if self.min_lend_bytes > self.max_lend_bytes {
            return Err(AutoConfigError::MinAboveMax {
                min: self.min_lend_bytes,
                max: self.max_lend_bytes,
            });
        }
        for (name, value, limit) in [
            ("reserve fraction", self.reserve_fraction, 1.0),
            ("PSI threshold", self.psi_threshold_percent, 100.0),
        ] {
            if !(0.0..=limit).contains(&value) {
                return Err(AutoConfigError::OutOfRange { name, value, limit });
            }
        }
        for (name, d) in [("interval", self.interval), ("PSI window", self.psi_window)] {
            if d.is_zero() {
                return Err(AutoConfigError::ZeroDuration(name));
            }
        }
        for (name, d) in [
            ("interval", self.interval),
            ("PSI window", self.psi_window),
            ("grow interval", self.grow_every),
            ("cooldown", self.cooldown),
        ] {
            if d > MAX_DURATION {
                return Err(AutoConfigError::LongDuration(name));
            }
        }
        Ok(())
    }

    /// The reserve for a host (or cgroup) of `total` bytes.
    pub fn reserve_for(&self, total: u64) -> u64 {
        // `as` saturates; a share of at most 1.0 of a u64 fits.
        self.reserve_bytes.max((total as f64 * self.reserve_fraction) as u64)
    }

    /// `bytes` clamped to `[min_lend, max_lend]` and rounded down to whole segments.
    fn clamp(&self, bytes: u64) -> u64 {
        let max = self.max_lend_bytes.min(MAX_BUDGET_BYTES as u64);
        round_down(bytes.clamp(self.min_lend_bytes.min(max), max))
    }
}

fn round_down(bytes: u64) -> u64 {
    bytes / SEGMENT * SEGMENT
}

/// Why the budget is what the decider says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The first sample: the budget is set to the target at once.
    Initial,
    /// Nothing to do: the budget is within hysteresis of the target.
    Steady,
    /// Free memory fell below the reserve: shrink at once.
    LowMemory,
    /// The host uses more than when the budget was set, though the reserve is still free:
    /// shrink so that filling the budget would not eat into the reserve.
    HostUse,
    /// Memory PSI shows tasks stalling: shrink one pressure step below the target.
    Pressure,
    /// There is room again: grow by one step.
    Grow,
    /// There is room, but pressure was seen less than `cooldown` ago.
    Cooldown,
    /// The budget is a fixed size (`--lend SIZE`).
    Fixed,
}

impl Reason {
    /// A short, stable name for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Initial => "initial",
            Reason::Steady => "steady",
            Reason::LowMemory => "low-memory",
            Reason::HostUse => "host-use",
            Reason::Pressure => "pressure",
            Reason::Grow => "grow",
            Reason::Cooldown => "cooldown",
            Reason::Fixed => "fixed",
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One answer of the decider.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The budget to set, in bytes (equal to the current budget when nothing changes).
    pub budget_bytes: u64,
    /// The budget the host could take now, before growth limits (whole segments).
    pub target_bytes: u64,
    /// Why.
    pub reason: Reason,
    /// Free memory as the rule counted it ([`HostMemory::free_for_us`]).
    pub free_bytes: u64,
    /// The reserve in force.
    pub reserve_bytes: u64,
    /// The share of the last PSI window in which tasks stalled, in percent (`None` until a
    /// whole window has been seen).
    pub stall_percent: Option<f64>,
    /// Growth is held until the cooldown ends.
    pub in_cooldown: bool,
}

/// The lending rule with its state between samples. Feed it one sample per tick.
#[derive(Debug, Clone)]
pub struct Decider {
    config: AutoConfig,
    /// A first decision has been made.
    started: bool,
    /// Growth is held until then.
    cooldown_until: Option<Instant>,
    /// When the budget last grew.
    last_grow: Option<Instant>,
    /// When the last pressure step was taken.
    last_step: Option<Instant>,
    /// `(time, PSI some total)` samples covering at least the last `psi_window`, oldest
    /// first.
    psi: VecDeque<(Instant, u64)>,
}

impl Decider {
    /// A decider with `config` (assumed valid, see [`AutoConfig::validate`]).
    pub fn new(config: AutoConfig) -> Self {
        Self {
            config,
            started: false,
            cooldown_until: None,
            last_grow: None,
            last_step: None,
            psi: VecDeque::new(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &AutoConfig {
        &self.config
    }

    /// The budget the host could take now: what we hold plus what it can spare, less the
    /// reserve, clamped and in whole segments. Pure: the governor uses it to tell whether a
    /// shrink is on the table before it reads the dearer inputs.
    pub fn target_bytes(&self, used: u64, host: &HostMemory) -> u64 {
        let reserve = self.config.reserve_for(host.effective_total());
        // Our pages are in neither `free` nor `reserve`, so they are added back.
        self.config.clamp(used.saturating_add(host.free_for_us()).saturating_sub(reserve))
    }

    /// Decides the budget at `now` (times must not go backwards between calls), given the
    /// current budget, the bytes this process holds for pages (`used`: mapped segments plus
    /// compressed pages) and a host sample.
    pub fn decide(&mut self, now: Instant, budget: u64, used: u64, host: &HostMemory) -> Decision {
        let stall = self.stall_percent(now, host.psi_some_total_us);
        let target = self.target_bytes(used, host);
        let c = &self.config;
        let free = host.free_for_us();
        let reserve = c.reserve_for(host.effective_total());
        let stalling = stall.is_some_and(|s| s >= c.psi_threshold_percent);
        let low = free < reserve;
        if low || stalling || host.psi_some_avg10 >= c.psi_threshold_percent {
            // `validate` bounds the cooldown, so this cannot overflow in practice; if it
            // did, the cooldown would end now rather than panic.
            self.cooldown_until = Some(now.checked_add(c.cooldown).unwrap_or(now));
        }
        let in_cooldown = self.cooldown_until.is_some_and(|t| now < t);
        let mut decision = Decision {
            budget_bytes: budget,
            target_bytes: target,
            reason: Reason::Steady,
            free_bytes: free,
            reserve_bytes: reserve,
            stall_percent: stall,
            in_cooldown,
        };
        // Below free memory's noise, a change is not worth a log line and a set_budget.
        let hysteresis = c.grow_hysteresis_bytes.max(SEGMENT);
        let step_due = self.last_step.is_none_or(|t| now.duration_since(t) >= c.psi_window);
        if stalling && step_due {
            self.last_step = Some(now);
            let stepped = target.min(budget).saturating_sub(c.pressure_step_bytes);
            // Never up, even when the budget is still below `min_lend`.
            decision.budget_bytes = c.clamp(stepped).min(budget);
            decision.reason = Reason::Pressure;
        } else if low && target < budget && budget - target >= SEGMENT {
            // The reserve is being eaten into: no hysteresis.
            decision.budget_bytes = target;
            decision.reason = Reason::LowMemory;
        } else if target < budget && budget - target >= hysteresis {
            // Filling the budget would eat into the reserve. Within the hysteresis it is
            // left alone: if it is filled, free memory falls below the reserve and the
            // branch above shrinks it then.
            decision.budget_bytes = target;
            decision.reason = Reason::HostUse;
        } else if !self.started {
            // The first sample sizes the budget at once; under pressure, only up to the
            // floor (`min_lend`), and growth waits for the cooldown.
            let floor = c.clamp(0);
            decision.budget_bytes =
                if in_cooldown { target.min(budget.max(floor)) } else { target };
            decision.reason = Reason::Initial;
        } else if target >= budget.saturating_add(hysteresis) {
            let grow_due = self.last_grow.is_none_or(|t| now.duration_since(t) >= c.grow_every);
            if in_cooldown {
                decision.reason = Reason::Cooldown;
            } else if grow_due {
                let grown = round_down(target.min(budget.saturating_add(c.grow_step_bytes)));
                if grown > budget {
                    decision.budget_bytes = grown;
                    decision.reason = Reason::Grow;
                    self.last_grow = Some(now);
                }
            }
        }
        self.started = true;
        decision
    }

    /// The share of the last `psi_window` in which tasks stalled on memory, in percent,
    /// from PSI's `total` counter; `None` until a whole window has been sampled.
    fn stall_percent(&mut self, now: Instant, total_us: u64) -> Option<f64> {
        if self.psi.back().is_some_and(|&(_, last)| total_us < last) {
            // The counter went backwards (a different source, or a reset): start over.
            self.psi.clear();
        }
        self.psi.push_back((now, total_us));
        let window = self.config.psi_window;
        // Keep exactly one sample at or before the window's start.
        while self.psi.get(1).is_some_and(|&(t, _)| now.duration_since(t) >= window) {
            self.psi.pop_front();
        }
        let &(then, old) = self.psi.front()?;
        let span = now.duration_since(then);
        if span < window {
            return None;
        }
        let stalled = Duration::from_micros(total_us - old);
        Some((stalled.as_secs_f64() / span.as_secs_f64() * 100.0).min(100.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;
    const MS: Duration = Duration::from_millis(1);

    fn config() -> AutoConfig {
        AutoConfig { reserve_fraction: 0.0, ..AutoConfig::default() }
    }

    /// A decider that has made its first decision (budget set to the target) at `t0`.
    fn started(config: AutoConfig, t0: Instant, host: &HostMemory) -> (Decider, u64) {
        let mut d = Decider::new(config);
        let first = d.decide(t0, 0, 0, host);
        assert_eq!(first.reason, Reason::Initial);
        (d, first.budget_bytes)
    }

    #[test]
    fn first_sample_sets_the_target_at_once() {
        let host = HostMemory::idle(16 * GIB, 9 * GIB);
        let (_, budget) = started(config(), Instant::now(), &host);
        assert_eq!(budget, 8 * GIB, "free 9 GiB minus the 1 GiB reserve");
    }

    #[test]
    fn target_counts_our_own_pages_as_ours() {
        let t0 = Instant::now();
        let mut d = Decider::new(config());
        // We hold 2 GiB of pages; the host has 3 GiB more free; 1 GiB is reserved.
        let dec = d.decide(t0, 4 * GIB, 2 * GIB, &HostMemory::idle(16 * GIB, 3 * GIB));
        assert_eq!(dec.target_bytes, 4 * GIB);
        assert_eq!(dec.reason, Reason::Initial);
    }

    #[test]
    fn free_below_reserve_shrinks_at_once_and_holds_growth() {
        let t0 = Instant::now();
        let host = HostMemory::idle(16 * GIB, 5 * GIB);
        let (mut d, budget) = started(config(), t0, &host);
        assert_eq!(budget, 4 * GIB);
        // We filled 3 GiB; then the host's free memory drops to half the reserve.
        let dec = d.decide(t0 + 25 * MS, budget, 3 * GIB, &HostMemory::idle(16 * GIB, GIB / 2));
        assert_eq!(dec.reason, Reason::LowMemory);
        assert_eq!(dec.budget_bytes, 3 * GIB - GIB / 2);
        assert!(dec.in_cooldown);
        // Free again, but within the cooldown: no growth.
        let later = d.decide(t0 + 2000 * MS, dec.budget_bytes, 2 * GIB, &host);
        assert_eq!(later.reason, Reason::Cooldown);
        assert_eq!(later.budget_bytes, dec.budget_bytes);
        // After the cooldown: one step at a time.
        let grow = d.decide(t0 + 5100 * MS, dec.budget_bytes, 2 * GIB, &host);
        assert_eq!(grow.reason, Reason::Grow);
        assert_eq!(grow.budget_bytes, dec.budget_bytes + (64 << 20));
        let too_soon = d.decide(t0 + 5150 * MS, grow.budget_bytes, 2 * GIB, &host);
        assert_eq!((too_soon.reason, too_soon.budget_bytes), (Reason::Steady, grow.budget_bytes));
        let again = d.decide(t0 + 5300 * MS, grow.budget_bytes, 2 * GIB, &host);
        assert_eq!(again.budget_bytes, grow.budget_bytes + (64 << 20));
    }

    #[test]
    fn our_own_release_on_per_cpu_lists_is_not_given_back_twice() {
        let t0 = Instant::now();
        let host = HostMemory::idle(16 * GIB, 5 * GIB);
        let (mut d, budget) = started(config(), t0, &host);
        // 3 GiB filled; then a program takes 2.5 GiB: free falls 0.5 GiB below the reserve.
        let short = HostMemory::idle(16 * GIB, GIB / 2);
        let dec = d.decide(t0 + 25 * MS, budget, 3 * GIB, &short);
        assert_eq!((dec.reason, dec.budget_bytes), (Reason::LowMemory, 3 * GIB - GIB / 2));
        // We unmapped 0.5 GiB, but the kernel parked it on per-CPU lists: MemAvailable has
        // not moved. Read without the lists, our release looks like more demand...
        let used = 3 * GIB - GIB / 2;
        let blind = d.clone().decide(t0 + 50 * MS, dec.budget_bytes, used, &short);
        assert_eq!((blind.reason, blind.budget_bytes), (Reason::LowMemory, 2 * GIB));
        // ...with them, the reserve is whole again and nothing more goes.
        let seen = HostMemory { percpu_free: GIB / 2, ..short };
        let dec2 = d.decide(t0 + 50 * MS, dec.budget_bytes, used, &seen);
        assert_eq!((dec2.reason, dec2.budget_bytes), (Reason::Steady, dec.budget_bytes));
        assert_eq!(d.target_bytes(used, &seen), dec.budget_bytes);
    }

    #[test]
    fn host_use_shrinks_without_pressure() {
        let t0 = Instant::now();
        let (mut d, budget) = started(config(), t0, &HostMemory::idle(16 * GIB, 9 * GIB));
        // Nothing filled yet; another process takes 4 GiB, leaving 5 GiB free.
        let dec = d.decide(t0 + 25 * MS, budget, 0, &HostMemory::idle(16 * GIB, 5 * GIB));
        assert_eq!(
            (dec.reason, dec.budget_bytes, dec.in_cooldown),
            (Reason::HostUse, 4 * GIB, false)
        );
    }

    #[test]
    fn noise_below_hysteresis_changes_nothing() {
        let t0 = Instant::now();
        let (mut d, budget) = started(config(), t0, &HostMemory::idle(16 * GIB, 9 * GIB));
        let host = HostMemory::idle(16 * GIB, 9 * GIB + 20 * MIB);
        let dec = d.decide(t0 + 25 * MS, budget, 0, &host);
        assert_eq!((dec.reason, dec.budget_bytes), (Reason::Steady, budget));
        // A little below, with the reserve still free: no shrink either.
        let host = HostMemory::idle(16 * GIB, 9 * GIB - 20 * MIB);
        let dec = d.decide(t0 + 50 * MS, budget, 0, &host);
        assert_eq!((dec.reason, dec.budget_bytes), (Reason::Steady, budget));
        let host = HostMemory::idle(16 * GIB, 9 * GIB - 40 * MIB);
        let dec = d.decide(t0 + 75 * MS, budget, 0, &host);
        assert_eq!((dec.reason, dec.budget_bytes), (Reason::HostUse, budget - 40 * MIB));
    }

    #[test]
    fn a_fresh_psi_stall_steps_below_the_target_once_per_window() {
        let t0 = Instant::now();
        let mut host = HostMemory::idle(16 * GIB, 9 * GIB);
        let (mut d, budget) = started(config(), t0, &host);
        // 5 ms of stall in each 25 ms tick: 20 %, over the 10 % threshold.
        let mut budget_now = budget;
        let mut steps = 0;
        for tick in 1..=8u32 {
            host.psi_some_total_us += 5_000;
            let dec = d.decide(t0 + tick * 25 * MS, budget_now, 0, &host);
            if tick < 4 {
                assert_eq!(dec.stall_percent, None, "window not yet covered at tick {tick}");
            } else {
                assert!((dec.stall_percent.unwrap() - 20.0).abs() < 1e-9, "{dec:?}");
            }
            if dec.reason == Reason::Pressure {
                steps += 1;
                assert_eq!(dec.budget_bytes, budget_now - (64 << 20));
            }
            budget_now = dec.budget_bytes;
        }
        assert_eq!(steps, 2, "ticks 4 and 8: one step per 100 ms window");
        assert!(d.decide(t0 + 300 * MS, budget_now, 0, &host).in_cooldown);
    }

    #[test]
    fn a_high_avg10_alone_holds_growth_but_does_not_step() {
        let t0 = Instant::now();
        let (mut d, budget) = started(config(), t0, &HostMemory::idle(16 * GIB, 5 * GIB));
        let mut host = HostMemory::idle(16 * GIB, 9 * GIB);
        host.psi_some_avg10 = 30.0;
        let dec = d.decide(t0 + 25 * MS, budget, 0, &host);
        assert_eq!(
            (dec.reason, dec.budget_bytes, dec.in_cooldown),
            (Reason::Cooldown, budget, true)
        );
    }

    #[test]
    fn psi_counter_going_backwards_restarts_the_window() {
        let mut d = Decider::new(config());
        let t0 = Instant::now();
        assert_eq!(d.stall_percent(t0, 1_000_000), None);
        assert_eq!(d.stall_percent(t0 + 200 * MS, 1_000_000), Some(0.0));
        assert_eq!(d.stall_percent(t0 + 225 * MS, 10), None);
        // More stall than wall time (clock skew between sources) is capped at 100 %.
        assert_eq!(d.stall_percent(t0 + 325 * MS, 10 + 500_000), Some(100.0));
    }

    #[test]
    fn min_and_max_lend_bound_every_decision() {
        let c = AutoConfig { min_lend_bytes: 256 * MIB, max_lend_bytes: 2 * GIB, ..config() };
        let t0 = Instant::now();
        let mut d = Decider::new(c);
        assert_eq!(d.decide(t0, 0, 0, &HostMemory::idle(16 * GIB, 15 * GIB)).budget_bytes, 2 * GIB);
        let dec = d.decide(t0 + 25 * MS, 2 * GIB, GIB, &HostMemory::idle(16 * GIB, 0));
        assert_eq!((dec.reason, dec.budget_bytes), (Reason::LowMemory, 256 * MIB));
    }

    #[test]
    fn reserve_is_the_larger_of_bytes_and_share() {
        let c = AutoConfig { reserve_bytes: GIB, reserve_fraction: 0.25, ..AutoConfig::default() };
        assert_eq!(c.reserve_for(16 * GIB), 4 * GIB);
        assert_eq!(c.reserve_for(2 * GIB), GIB);
        let mut host = HostMemory::idle(64 * GIB, 8 * GIB);
        host.cgroup =
            Some(super::super::CgroupMemory { max: Some(8 * GIB), high: None, current: 0 });
        assert_eq!(Decider::new(c).decide(Instant::now(), 0, 0, &host).reserve_bytes, 2 * GIB);
    }

    #[test]
    fn validate_rejects_nonsense() {
        assert!(AutoConfig::default().validate().is_ok());
        let bad = AutoConfig { min_lend_bytes: 2, max_lend_bytes: 1, ..AutoConfig::default() };
        assert_eq!(
            bad.validate().unwrap_err().to_string(),
            "min lend (2 bytes) is above max lend (1 bytes)"
        );
        let bad = AutoConfig { reserve_fraction: f64::NAN, ..AutoConfig::default() };
        assert!(bad.validate().is_err());
        let bad = AutoConfig { psi_threshold_percent: 101.0, ..AutoConfig::default() };
        assert!(bad.validate().is_err());
        let bad = AutoConfig { interval: Duration::ZERO, ..AutoConfig::default() };
        assert_eq!(bad.validate().unwrap_err().to_string(), "interval must be greater than zero");
        let bad = AutoConfig { cooldown: Duration::MAX, ..AutoConfig::default() };
        assert_eq!(bad.validate().unwrap_err().to_string(), "cooldown must be at most a day");
    }

    /// One tick of a random walk: the time step, our used bytes, the host sample.
    fn tick() -> impl Strategy<Value = (u64, u64, u64, u64, f64, u64)> {
        (
            1u64..400,      // ms since the previous tick
            0u64..8 * GIB,  // used
            0u64..16 * GIB, // available
            0u64..30_000,   // PSI µs stalled since the previous tick
            0.0f64..40.0,   // avg10
            0u64..4,        // 0: no cgroup; else a cgroup of that many GiB
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Over any sequence of samples: the budget stays within [min, max] and whole
        /// segments; it shrinks whenever free memory is below the reserve (unless already
        /// at min); it never grows during a cooldown nor by more than one step.
        #[test]
        fn decisions_keep_their_promises(
            ticks in proptest::collection::vec(tick(), 1..60),
            min_segs in 0u64..64,
            max_segs in 64u64..4096,
        ) {
            let c = AutoConfig {
                min_lend_bytes: min_segs * SEGMENT,
                max_lend_bytes: max_segs * SEGMENT,
                cooldown: Duration::from_millis(500),
                ..config()
            };
            let mut d = Decider::new(c.clone());
            let mut now = Instant::now();
            let mut budget = 0u64;
            let mut psi_total = 0u64;
            let mut last_pressure: Option<Instant> = None;
            for (i, (dt, used, available, stalled, avg10, cg)) in ticks.into_iter().enumerate() {
                now += Duration::from_millis(dt);
                psi_total += stalled;
                let mut host = HostMemory::idle(16 * GIB, available);
                host.psi_some_total_us = psi_total;
                host.psi_some_avg10 = avg10;
                if cg > 0 {
                    host.cgroup = Some(super::super::CgroupMemory {
                        max: Some(cg * GIB), high: None, current: used.min(cg * GIB),
                    });
                }
                let dec = d.decide(now, budget, used, &host);
                let new = dec.budget_bytes;
                prop_assert!(new <= c.max_lend_bytes, "{dec:?}");
                prop_assert!(new >= c.min_lend_bytes || new == budget, "{dec:?}");
                prop_assert_eq!(new % SEGMENT, 0);
                let pressure = dec.free_bytes < dec.reserve_bytes
                    || avg10 >= c.psi_threshold_percent
                    || dec.stall_percent.is_some_and(|s| s >= c.psi_threshold_percent);
                if pressure {
                    last_pressure = Some(now);
                }
                if dec.free_bytes < dec.reserve_bytes && i > 0 {
                    // Low memory: never up, and at once down to what restores the reserve.
                    let room = used.saturating_add(dec.free_bytes).saturating_sub(dec.reserve_bytes);
                    prop_assert!(new <= budget, "{dec:?}");
                    prop_assert!(new <= room.max(c.min_lend_bytes), "{dec:?}");
                }
                if i > 0 && new > budget {
                    prop_assert_eq!(dec.reason, Reason::Grow);
                    prop_assert!(new - budget <= c.grow_step_bytes, "{dec:?}");
                    let since = last_pressure.map(|t| now.duration_since(t));
                    prop_assert!(since.is_none_or(|s| s >= c.cooldown), "{dec:?}");
                    prop_assert!(!pressure);
                }
                budget = new;
            }
        }
    }
}
