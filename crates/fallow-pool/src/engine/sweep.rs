//! Removing the index entries of pages whose bytes are gone.
//!
//! A shrink drops the ephemeral pages of the segments it returns to the OS by their
//! contents: finding every index entry that names one would mean visiting every slot
//! while the shrink holds the shards and the store. So the entries stay behind, a miss for
//! whoever reads them next; until then they count as pages in the stats and keep their
//! metadata (about 30–40 bytes each: some 10 MiB after giving back 1 GiB of pages).
//!
//! The sweep removes them after the shrink, on a thread of its own so that `set_budget`
//! (and the governor calling it) returns as soon as the memory is back: it visits the
//! shards in steps of at most [`SLOTS_PER_HOLD`] slots and [`REMOVALS_PER_HOLD`]
//! removals, and hands each lock to a waiting get when it lets go (`unlock_fair`), so no
//! get waits behind it for more than a step (~0.1 ms); in the background it also pauses
//! after each step, so that it holds locks a fifth of its time at most
//! ([`BACKGROUND_DUTY`]). One sweeper runs at a time; a shrink during a sweep makes it go
//! round once more. The store counts the stale entries, so a sweep stops as soon as none
//! is left, and a shrink that left only a few does not start one (reads and evictions
//! remove those as they meet them).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{MutexGuard, RwLockWriteGuard};

use super::Inner;
use crate::pools::Counter;
use crate::stats::SweepReport;

/// Slots looked at per hold of a shard's lock.
const SLOTS_PER_HOLD: usize = 4096;
/// Entries removed per hold. Their contents are released under the store's write lock,
/// which every get's lookup waits for (the entries themselves leave the index before it is
/// taken): ~45 µs for 128, so a step stays around a tenth of a millisecond.
const REMOVALS_PER_HOLD: usize = 128;

/// Stale entries below which a shrink leaves them to be found by reads and evictions: a
/// sweep visits every slot, so it must find enough to be worth it (at least one entry in
/// `1 / SWEEP_SHARE` of the contents, or [`SWEEP_MIN`]).
const SWEEP_SHARE: usize = 64;
const SWEEP_MIN: usize = 4096;

/// How the sweep spaces its steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pace {
    /// A caller waits for it: one step after the other.
    Now,
    /// The sweeper thread: after each step, a pause of `BACKGROUND_DUTY - 1` times the
    /// step's hold.
    Background,
}

/// The background sweep holds a shard (and the store) at most one part in this many of
/// its time. On a VM, a thread can be descheduled by the host for milliseconds while it
/// holds a lock, and a get that needs the lock waits as long: measured after a 1 GiB
/// give-back on 2 vCPUs, gets waited 1–9 ms (asleep, not waiting for a CPU) while the
/// sweep ran flat out: 95 such gets in 24 runs, against 11 paced
/// (docs/benchmarks-history.md, "Where the stalls during a give-back come from"). The
/// chance of that is the share of time the sweep holds locks, so the sweep takes longer
/// instead.
const BACKGROUND_DUTY: u32 = 5;

/// The sweeper thread's nice value.
const SWEEP_NICE: i32 = 10;

impl Inner {
    /// After a shrink: sweeps in the background if enough entries went stale.
    pub(crate) fn sweep_if_worth_it(self: &Arc<Self>) {
        let store = self.store.read();
        let (stale, contents) = (store.stale_entries(), store.usage().contents);
        drop(store);
        if stale >= SWEEP_MIN.min(contents / SWEEP_SHARE).max(1) {
            self.request_sweep();
        }
    }

    /// Asks for a sweep in the background, starting the sweeper thread unless one runs.
    fn request_sweep(self: &Arc<Self>) {
        self.sweep.requested.store(true, Ordering::SeqCst);
        if self.sweep.running.swap(true, Ordering::SeqCst) {
            return; // the running sweeper sees `requested` and goes round again
        }
        let inner = Arc::clone(self);
        let spawned = std::thread::Builder::new().name("fallow-sweep".into()).spawn(move || {
            // Linux keeps a nice value per thread: this one gives way to the readers
            // and writers of the pool (the sweep is tidying up, nothing waits for it).
            if let Err(err) = rustix::process::setpriority_process(None, SWEEP_NICE) {
                tracing::debug!(%err, "the index sweep runs at normal priority");
            }
            inner.sweep_while_requested()
        });
        if let Err(err) = spawned {
            // Nothing is lost: the entries are removed when next read or evicted.
            self.sweep.running.store(false, Ordering::SeqCst);
            tracing::warn!(%err, "no thread for the index sweep; dropped pages go when read");
        }
    }

    fn sweep_while_requested(&self) {
        loop {
            while self.sweep.requested.swap(false, Ordering::SeqCst) {
                let report = self.sweep(Pace::Background);
                tracing::debug!(?report, "index entries of dropped pages removed");
            }
            self.sweep.running.store(false, Ordering::SeqCst);
            // A request that came after the last swap but before `running` went false found
            // a sweeper running and left: take it over, unless another thread already has.
            if !self.sweep.requested.load(Ordering::SeqCst)
                || self.sweep.running.swap(true, Ordering::SeqCst)
            {
                return;
            }
        }
    }

    /// Removes every index entry whose content has lost its bytes (a shrink returned its
    /// segment, or another key's read found it corrupt), counting each as an eviction of
    /// its pool, as a read that found it would have.
    pub(crate) fn sweep_dropped(&self) -> SweepReport {
        self.sweep(Pace::Now)
    }

    fn sweep(&self, pace: Pace) -> SweepReport {
        let start = Instant::now();
        let mut report = SweepReport::default();
        for shard in self.shards.iter() {
            let mut from = 0;
            loop {
                if self.store.read().stale_entries() == 0 {
                    break; // none left anywhere
                }
                let held = Instant::now();
                let mut shard = shard.lock();
                let (stale, next) = {
                    let store = self.store.read();
                    shard.content_slots_where(from, SLOTS_PER_HOLD, REMOVALS_PER_HOLD, |id| {
                        !store.is_live(id)
                    })
                };
                if !stale.is_empty() {
                    // The entries leave the index under the shard's lock alone; the store's
                    // write lock, which every get of every shard waits for, is held only
                    // for the releases of their contents.
                    let slots: Vec<_> = stale.into_iter().map(|id| shard.remove(id)).collect();
                    let pools = self.pool_snapshot.load();
                    let mut store = self.store.write();
                    let store_held = Instant::now();
                    for slot in &slots {
                        let state = crate::pools::find(&pools, slot.key.pool).ok();
                        if let Some(state) = state {
                            state.counters.bump(Counter::Evictions);
                        }
                        self.release(&mut store, slot, state.map(|s| &s.counters));
                    }
                    let store_hold = store_held.elapsed();
                    RwLockWriteGuard::unlock_fair(store);
                    report.entries_removed += slots.len();
                    report.store_holds += 1;
                    report.store_held += store_hold;
                    report.longest_store_hold = report.longest_store_hold.max(store_hold);
                }
                MutexGuard::unlock_fair(shard);
                let hold = held.elapsed();
                report.longest_hold = report.longest_hold.max(hold);
                if pace == Pace::Background {
                    // Locks held a fifth of the time at most: see `BACKGROUND_DUTY`.
                    std::thread::sleep(hold * (BACKGROUND_DUTY - 1));
                }
                match next {
                    Some(next) => from = next,
                    None => break,
                }
            }
        }
        report.elapsed = start.elapsed();
        report
    }
}
