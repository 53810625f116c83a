//! The thread that applies the lending rule: it samples the host every tick, asks the
//! [`Decider`], and calls [`Engine::set_budget`] when the budget should move by a segment or
//! more. It is a plain OS thread, so a busy async runtime cannot delay a shrink, and no
//! request ever waits for it (a shrink holds the engine's store lock a few segments at a
//! time; see `docs/concurrency.md`).
//!
//! # Components
//! [`Governor`]: starts the thread ([`Governor::spawn`]) or sets a fixed budget
//! ([`Governor::start`]). [`GovernorHandle`]: reads the [`GovernorStatus`] and the recent
//! [`BudgetChange`]s, and stops the thread (also on drop).
//!
//! # Locking
//! One lock, `Shared::state` (a `parking_lot::Mutex`), guards the status and the change
//! log. The governor thread takes it once per tick after its work is done, and readers
//! (metrics, `fallow stat`) hold it only to copy the status out. It is never held while
//! an engine lock is taken or while the host is sampled.

use std::collections::VecDeque;
use std::io;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fallow_core::PAGE_SIZE;
use fallow_pool::Engine;
use parking_lot::Mutex;

use super::decide::{AutoConfig, AutoConfigError, Decider, Decision, Reason};
use super::host::{HostMemory, MemorySource, ProcSource};
use super::mode::LendMode;

/// How many recent budget changes a handle keeps for `fallow stat`.
pub const CHANGE_LOG_LEN: usize = 64;

/// One change of the lent budget.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetChange {
    /// When, in milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// When, for measuring elapsed time in this process.
    pub at: Instant,
    /// The budget before, in bytes.
    pub old_bytes: u64,
    /// The budget after, in bytes.
    pub new_bytes: u64,
    /// Why.
    pub reason: Reason,
    /// Free memory as the rule counted it (see [`HostMemory::free_for_us`]).
    pub free_bytes: u64,
    /// The reserve in force.
    pub reserve_bytes: u64,
    /// Memory PSI `some avg10` at the time, in percent.
    pub psi_some_avg10: f64,
    /// How long [`Engine::set_budget`] took, unmapping included.
    pub elapsed: Duration,
    /// Pages whose bytes were dropped to shrink.
    pub pages_dropped: u64,
    /// 2 MiB segments returned to the OS.
    pub segments_released: u64,
    /// Bytes of persistent pages above the new budget (they are never dropped).
    pub pinned_over_budget_bytes: u64,
}

/// What the governor knows, as of its last tick. Cheap to read from any thread.
#[derive(Debug, Clone, PartialEq)]
pub struct GovernorStatus {
    /// `"auto"` or `"fixed"`.
    pub mode: &'static str,
    /// The governor thread is running (always `false` for a fixed size).
    pub running: bool,
    /// The lent budget, in bytes.
    pub budget_bytes: u64,
    /// The budget the host could take now (auto mode; the fixed size otherwise).
    pub target_bytes: u64,
    /// Bytes this node holds for pages: mapped segments plus compressed pages.
    pub used_bytes: u64,
    /// The host's `MemTotal` (0 for a fixed size).
    pub host_total_bytes: u64,
    /// The host's `MemAvailable` (0 for a fixed size).
    pub host_available_bytes: u64,
    /// Free memory as the rule counts it: `MemAvailable`, or less in a limited cgroup.
    pub free_bytes: u64,
    /// The reserve kept free for the host.
    pub reserve_bytes: u64,
    /// The binding cgroup v2 limit, if any.
    pub cgroup_limit_bytes: Option<u64>,
    /// Memory PSI `some avg10`, in percent.
    pub psi_some_avg10: f64,
    /// The share of the last PSI window in which tasks stalled, in percent.
    pub stall_percent: Option<f64>,
    /// Growth is held after recent pressure.
    pub in_cooldown: bool,
    /// This process's resident size (`VmRSS`), when known.
    pub process_rss_bytes: Option<u64>,
    /// Bytes of persistent pages the budget could not shed.
    pub pinned_over_budget_bytes: u64,
    /// Host samples taken.
    pub ticks: u64,
    /// Times the budget was lowered.
    pub shrinks: u64,
    /// Times the budget was raised (the first sizing included).
    pub grows: u64,
    /// Samples that failed (the budget is kept as it is until one succeeds).
    pub sample_errors: u64,
    /// The last failed sample's error, cleared by the next good one.
    pub last_sample_error: Option<String>,
    /// Pages dropped by shrinks, in total.
    pub pages_dropped: u64,
    /// Segments returned to the OS by shrinks, in total.
    pub segments_released: u64,
    /// The reason of the last decision that changed the budget.
    pub last_reason: &'static str,
    /// When the budget last changed, in milliseconds since the Unix epoch.
    pub last_change_unix_ms: Option<u64>,
    /// When the budget last changed, for measuring elapsed time in this process.
    pub last_change_at: Option<Instant>,
    /// How long the last [`Engine::set_budget`] took.
    pub last_change_elapsed: Duration,
}

impl GovernorStatus {
    fn new(mode: &'static str, budget_bytes: u64) -> Self {
        Self {
            mode,
            running: false,
            budget_bytes,
            target_bytes: budget_bytes,
            used_bytes: 0,
            host_total_bytes: 0,
            host_available_bytes: 0,
            free_bytes: 0,
            reserve_bytes: 0,
            cgroup_limit_bytes: None,
            psi_some_avg10: 0.0,
            stall_percent: None,
            in_cooldown: false,
            process_rss_bytes: None,
            pinned_over_budget_bytes: 0,
            ticks: 0,
            shrinks: 0,
            grows: 0,
            sample_errors: 0,
            last_sample_error: None,
            pages_dropped: 0,
            segments_released: 0,
            last_reason: Reason::Initial.as_str(),
            last_change_unix_ms: None,
            last_change_at: None,
            last_change_elapsed: Duration::ZERO,
        }
    }

    /// What this process holds beyond its page bytes (`VmRSS − used`): the overhead that
    /// the "budget plus a small overhead" promise is about. `None` when RSS is unknown.
    pub fn overhead_bytes(&self) -> Option<u64> {
        self.process_rss_bytes.map(|rss| rss.saturating_sub(self.used_bytes))
    }
}

/// What the governor thread publishes and handles read.
struct State {
    status: GovernorStatus,
    /// The last [`CHANGE_LOG_LEN`] changes, oldest first.
    changes: VecDeque<BudgetChange>,
}

/// Status and change log, shared by the governor thread and its handle. The lock is held
/// only to copy in or out (see the module's `# Locking`).
type Shared = Arc<Mutex<State>>;

/// Why the governor could not start.
#[derive(Debug, thiserror::Error)]
pub enum GovernorError {
    /// The `auto` settings are inconsistent.
    #[error("invalid --lend auto settings: {0}")]
    Config(#[from] AutoConfigError),
    /// The OS refused a thread.
    #[error("could not start the lending governor thread: {0}")]
    Spawn(#[source] io::Error),
}

/// The lending governor: follows the host's memory and moves the engine's budget.
pub struct Governor {
    engine: Arc<Engine>,
    decider: Decider,
    source: Box<dyn MemorySource + Send>,
    shared: Shared,
}

impl Governor {
    /// Applies `mode`: sets a fixed budget once, or starts the governor over the real
    /// `/proc` ([`ProcSource`]).
    pub fn start(engine: Arc<Engine>, mode: &LendMode) -> Result<GovernorHandle, GovernorError> {
        match mode {
            LendMode::Auto(config) => {
                Self::spawn(engine, config.clone(), Box::new(ProcSource::new()))
            }
            LendMode::Fixed(bytes) => Ok(Self::fixed(&engine, *bytes)),
        }
    }

    fn fixed(engine: &Engine, bytes: u64) -> GovernorHandle {
        let mut status = GovernorStatus::new("fixed", bytes);
        status.last_reason = Reason::Fixed.as_str();
        let old = engine.memory().budget_bytes as u64;
        if old != bytes {
            let report = engine.set_budget(to_usize(bytes));
            status.last_change_elapsed = report.elapsed;
            status.last_change_at = Some(Instant::now());
            status.last_change_unix_ms = Some(unix_ms());
            status.pinned_over_budget_bytes = (report.shrink.pinned_over_budget * PAGE_SIZE) as u64;
        }
        tracing::info!(budget_bytes = bytes, "lending a fixed budget");
        let shared = Arc::new(Mutex::new(State { status, changes: VecDeque::new() }));
        GovernorHandle { shared, stop: None, thread: None }
    }

    /// Starts the governor on its own thread, sampling `source` every `config.interval`.
    /// The first tick runs before this returns, so the budget is sized when the node
    /// starts serving.
    pub fn spawn(
        engine: Arc<Engine>,
        config: AutoConfig,
        source: Box<dyn MemorySource + Send>,
    ) -> Result<GovernorHandle, GovernorError> {
        config.validate()?;
        let interval = config.interval;
        let budget = engine.memory().budget_bytes as u64;
        let mut status = GovernorStatus::new("auto", budget);
        status.running = true;
        let shared = Arc::new(Mutex::new(State { status, changes: VecDeque::new() }));
        let mut governor =
            Governor { engine, decider: Decider::new(config), source, shared: shared.clone() };
        tracing::info!(config = ?governor.decider.config(), "lending governor starting");
        governor.tick();
        let (stop, stopped) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fallow-governor".to_string())
            .spawn(move || governor.run(interval, stopped))
            .map_err(GovernorError::Spawn)?;
        Ok(GovernorHandle { shared, stop: Some(stop), thread: Some(thread) })
    }

    /// Ticks every `interval` until the handle says stop (or is gone).
    fn run(mut self, interval: Duration, stopped: mpsc::Receiver<()>) {
        while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(interval) {
            self.tick();
        }
        tracing::info!("lending governor stopped");
    }

    /// One sample, one decision, and a budget change if the decision moves it.
    fn tick(&mut self) {
        let now = Instant::now();
        let mut host = match self.source.sample() {
            Ok(host) => host,
            Err(e) => return self.sample_failed(&e),
        };
        let memory = self.engine.memory();
        let used = memory.held_bytes() as u64;
        let budget = memory.budget_bytes as u64;
        // MemAvailable leaves out the free pages on per-CPU lists, where the pages we have
        // just unmapped can sit for seconds: before shrinking, count them, or our own
        // release reads as more demand and the budget is cut again and again, to zero.
        if host.percpu_free == 0 && self.decider.target_bytes(used, &host) < budget {
            if let Some(bytes) = self.source.percpu_free() {
                host.percpu_free = bytes;
            }
        }
        let decision = self.decider.decide(now, budget, used, &host);
        let change =
            (decision.budget_bytes != budget).then(|| self.apply(budget, used, &decision, &host));
        let mut state = self.shared.lock();
        let s = &mut state.status;
        if s.last_sample_error.take().is_some() {
            tracing::info!("host memory readable again");
        }
        s.ticks += 1;
        s.budget_bytes = decision.budget_bytes;
        s.target_bytes = decision.target_bytes;
        s.used_bytes = used;
        s.host_total_bytes = host.total;
        s.host_available_bytes = host.available;
        s.free_bytes = decision.free_bytes;
        s.reserve_bytes = decision.reserve_bytes;
        s.cgroup_limit_bytes = host.cgroup.and_then(|c| c.limit());
        s.psi_some_avg10 = host.psi_some_avg10;
        s.stall_percent = decision.stall_percent;
        s.in_cooldown = decision.in_cooldown;
        s.process_rss_bytes = host.process_rss;
        let Some(change) = change else {
            s.pinned_over_budget_bytes = (memory.over_budget_frames() * PAGE_SIZE) as u64;
            return;
        };
        if change.new_bytes < change.old_bytes {
            s.shrinks += 1;
        } else {
            s.grows += 1;
        }
        s.pages_dropped += change.pages_dropped;
        s.segments_released += change.segments_released;
        s.pinned_over_budget_bytes = change.pinned_over_budget_bytes;
        s.last_reason = change.reason.as_str();
        s.last_change_unix_ms = Some(change.at_unix_ms);
        s.last_change_at = Some(change.at);
        s.last_change_elapsed = change.elapsed;
        if state.changes.len() == CHANGE_LOG_LEN {
            state.changes.pop_front();
        }
        state.changes.push_back(change);
    }

    /// Sets the engine's budget as decided, and logs it.
    fn apply(&self, old: u64, used: u64, d: &Decision, host: &HostMemory) -> BudgetChange {
        let report = self.engine.set_budget(to_usize(d.budget_bytes));
        let change = BudgetChange {
            at_unix_ms: unix_ms(),
            at: Instant::now(),
            old_bytes: old,
            new_bytes: d.budget_bytes,
            reason: d.reason,
            free_bytes: d.free_bytes,
            reserve_bytes: d.reserve_bytes,
            psi_some_avg10: host.psi_some_avg10,
            elapsed: report.elapsed,
            pages_dropped: report.shrink.contents_dropped as u64,
            segments_released: report.shrink.segments_released as u64,
            pinned_over_budget_bytes: (report.shrink.pinned_over_budget * PAGE_SIZE) as u64,
        };
        tracing::info!(
            old_bytes = old,
            new_bytes = d.budget_bytes,
            reason = d.reason.as_str(),
            used_bytes = used,
            free_bytes = d.free_bytes,
            percpu_free_bytes = host.percpu_free,
            reserve_bytes = d.reserve_bytes,
            psi_some_avg10 = host.psi_some_avg10,
            stall_percent = d.stall_percent,
            pages_dropped = change.pages_dropped,
            segments_released = change.segments_released,
            elapsed_us = report.elapsed.as_micros() as u64,
            "lending governor {} the budget",
            if d.budget_bytes < old { "lowered" } else { "raised" },
        );
        change
    }

    /// Keeps the budget as it is: without a sample there is nothing to follow. The first
    /// failure of a streak is logged as a warning, the rest only counted.
    fn sample_failed(&self, e: &io::Error) {
        let mut state = self.shared.lock();
        let s = &mut state.status;
        s.ticks += 1;
        s.sample_errors += 1;
        if s.last_sample_error.is_none() {
            tracing::warn!(error = %e, "cannot read host memory; keeping the lent budget as it is");
        }
        s.last_sample_error = Some(e.to_string());
    }
}

/// Bytes this process holds for pages: mapped segments (their frames are touched as they
/// fill, and a free frame stays resident until its segment goes) plus compressed pages.
fn to_usize(bytes: u64) -> usize {
    // `set_budget` lowers anything above what it can address, so saturating is enough.
    usize::try_from(bytes).unwrap_or(usize::MAX)
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Reads the governor's status and stops it. Dropping the handle stops the governor too
/// (and waits for its thread).
pub struct GovernorHandle {
    shared: Shared,
    /// Dropping (or sending on) it wakes the thread and ends it.
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl GovernorHandle {
    /// The status as of the last tick: a copy, taken under a lock held only for the copy.
    pub fn status(&self) -> GovernorStatus {
        self.shared.lock().status.clone()
    }

    /// The last [`CHANGE_LOG_LEN`] budget changes, oldest first.
    pub fn recent_changes(&self) -> Vec<BudgetChange> {
        self.shared.lock().changes.iter().cloned().collect()
    }

    /// Stops the governor and waits for its thread (at most one tick's work). The budget
    /// stays where it is. Does nothing the second time, or for a fixed size.
    pub fn stop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                tracing::error!("the lending governor thread panicked");
            }
        }
        self.shared.lock().status.running = false;
    }
}

impl Drop for GovernorHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

impl std::fmt::Debug for GovernorHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GovernorHandle").field("status", &self.status()).finish()
    }
}
