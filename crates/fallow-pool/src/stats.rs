//! What the engine reports about itself: per-pool counters and memory use.

use std::time::Duration;

use fallow_core::{PoolId, PoolKind, PAGE_SIZE};

use crate::pools::{Counter, PoolState};
use crate::store::{ShrinkReport, StoreUsage};

/// Counters of one pool, read at one moment (each counter is exact; the set is not a
/// consistent snapshot while other threads work).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStats {
    /// The pool.
    pub pool: PoolId,
    /// Its kind.
    pub kind: PoolKind,
    /// Logical pages stored.
    pub pages: u64,
    /// Of those, pages that cost no frame because they are same-filled.
    pub fill_pages: u64,
    /// Gets and takes that hit.
    pub hits: u64,
    /// Gets and takes that missed.
    pub misses: u64,
    /// Puts stored.
    pub puts_stored: u64,
    /// Puts refused or dropped.
    pub puts_refused: u64,
    /// Pages evicted or dropped to give memory back.
    pub evictions: u64,
    /// Pages removed by take or invalidate.
    pub invalidations: u64,
    /// Reads whose checksum failed.
    pub corruptions: u64,
}

impl PoolStats {
    pub(crate) fn of(pool: PoolId, state: &PoolState) -> Self {
        let c = |counter| state.counters.get(counter);
        Self {
            pool,
            kind: state.spec.kind,
            pages: c(Counter::Pages),
            fill_pages: c(Counter::FillPages),
            hits: c(Counter::Hits),
            misses: c(Counter::Misses),
            puts_stored: c(Counter::PutsStored),
            puts_refused: c(Counter::PutsRefused),
            evictions: c(Counter::Evictions),
            invalidations: c(Counter::Invalidations),
            corruptions: c(Counter::Corruptions),
        }
    }
}

/// The engine as a whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineStats {
    /// The lent budget in bytes.
    pub budget_bytes: usize,
    /// Bytes mapped for frames (whole 2 MiB segments).
    pub mapped_bytes: usize,
    /// Of those, free frames whose memory is back with the OS: the frames of pages that
    /// were compressed, until they are used again.
    pub discarded_bytes: usize,
    /// Frames holding page bytes.
    pub frames_used: usize,
    /// Logical pages in all pools.
    pub pages: u64,
    /// Pages stored as a fill word.
    pub fill_pages: u64,
    /// Distinct stored contents.
    pub contents: usize,
    /// Bytes that pages would take without dedup and fill detection, minus what they take.
    pub dedup_saved_bytes: u64,
    /// Pages held compressed.
    pub compressed_pages: usize,
    /// Memory holding the compressed pages: their slabs, the holes freed pages left in
    /// them included. Counted against the budget, as frames in use are.
    pub compressed_space_bytes: usize,
    /// Bytes saved by compression: the compressed pages' 4 KiB each, less the memory that
    /// holds them.
    pub compression_saved_bytes: u64,
    /// Reads whose checksum failed.
    pub corruptions: u64,
    /// Pages dropped to give memory back since the engine started.
    pub dropped_by_shrink: u64,
    /// Frames in use beyond the budget: persistent pages that a shrink could not shed
    /// (they are never dropped). Zero in the normal case.
    pub over_budget_frames: usize,
    /// Heap bytes of index, policy and store tables (not page bytes).
    pub metadata_bytes: usize,
    /// Index shards.
    pub shards: usize,
    /// Eviction policy.
    pub policy: &'static str,
    /// The small-queue share of the capacity, in percent (rounded), that the policy chose
    /// from the workload, if it chooses one (`s3fifo-lean`, the default: 1 to 100, 100 when
    /// the workload is best served by LRU); one share for the whole engine.
    pub small_share_percent: Option<u8>,
    /// Every pool.
    pub pools: Vec<PoolStats>,
}

impl EngineStats {
    pub(crate) fn new(
        usage: StoreUsage,
        index_bytes: usize,
        shards: usize,
        policy: &'static str,
        pools: Vec<PoolStats>,
    ) -> Self {
        let pages: u64 = pools.iter().map(|p| p.pages).sum();
        let fill_pages: u64 = pools.iter().map(|p| p.fill_pages).sum();
        let framed = pages - fill_pages;
        let page = PAGE_SIZE as u64;
        Self {
            budget_bytes: usage.budget_bytes,
            mapped_bytes: usage.mapped_bytes,
            discarded_bytes: usage.discarded_bytes,
            frames_used: usage.frames_used,
            pages,
            fill_pages,
            contents: usage.contents,
            dedup_saved_bytes: (framed.saturating_sub(usage.contents as u64) + fill_pages) * page,
            compressed_pages: usage.compressed_pages,
            compressed_space_bytes: usage.compressed_space_bytes,
            compression_saved_bytes: (usage.compressed_pages as u64 * page)
                .saturating_sub(usage.compressed_space_bytes as u64),
            corruptions: usage.corruptions,
            dropped_by_shrink: usage.dropped_by_shrink,
            over_budget_frames: (usage.frames_used
                + usage.compressed_space_bytes.div_ceil(PAGE_SIZE))
            .saturating_sub(usage.budget_bytes / PAGE_SIZE),
            metadata_bytes: index_bytes + usage.heap_bytes,
            shards,
            policy,
            small_share_percent: None,
            pools,
        }
    }

    /// Metadata bytes per logical page (0 when empty).
    pub fn metadata_per_page(&self) -> f64 {
        if self.pages == 0 {
            0.0
        } else {
            self.metadata_bytes as f64 / self.pages as f64
        }
    }
}

/// What a budget change did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetReport {
    /// Segments released, pages dropped or moved, pinned frames over budget.
    pub shrink: ShrinkReport,
    /// Time the whole change took, unmapping included.
    pub elapsed: Duration,
    /// The longest single hold of every shard lock and the store's (one shrink step): how
    /// long a get could have waited.
    pub longest_hold: Duration,
}

/// What the engine holds in memory for pages, read under one lock: cheap enough for a
/// governor that samples many times a second (unlike [`EngineStats`], which visits every
/// shard and pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUsage {
    /// The lent budget in bytes.
    pub budget_bytes: usize,
    /// Bytes mapped for frames (whole 2 MiB segments).
    pub mapped_bytes: usize,
    /// Of those, free frames whose memory is back with the OS (a compressed page's
    /// frame, until it is used again).
    pub discarded_bytes: usize,
    /// Frames holding page bytes.
    pub frames_used: usize,
    /// Bytes of compressed page data.
    pub compressed_bytes: usize,
    /// Memory holding the compressed data (slabs of 64 KiB, holes included): what the
    /// budget is charged for it.
    pub compressed_space_bytes: usize,
}

impl MemoryUsage {
    /// Bytes held for pages: mapped segments, less their discarded frames, plus the
    /// compressed data's slabs.
    pub fn held_bytes(&self) -> usize {
        self.mapped_bytes - self.discarded_bytes + self.compressed_space_bytes
    }

    /// Frames in use beyond the budget (as [`EngineStats::over_budget_frames`]).
    pub fn over_budget_frames(&self) -> usize {
        (self.frames_used + self.compressed_space_bytes.div_ceil(PAGE_SIZE))
            .saturating_sub(self.budget_bytes / PAGE_SIZE)
    }
}

/// What a sweep did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Index entries removed: pages whose bytes had been dropped.
    pub entries_removed: usize,
    /// The longest hold of a shard's lock.
    pub longest_hold: Duration,
    /// Steps that took the store's write lock (to release contents), every get's wait.
    pub store_holds: usize,
    /// Their time with the store's write lock held, in all.
    pub store_held: Duration,
    /// The longest of those holds.
    pub longest_store_hold: Duration,
    /// The sweep's whole time.
    pub elapsed: Duration,
}
