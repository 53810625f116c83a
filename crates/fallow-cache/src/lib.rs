//! The cache layer of an export: reads go local tier → pool → backing store and populate
//! the tiers on the way back; writes go to the backing store first (write-through) and then
//! update or invalidate every cached copy, so that no reader, on any connection, sees stale
//! data. `docs/nbd.md` describes the modes; `coherence.rs` the rule that makes the
//! "no stale data" promise hold when reads and writes race.
//!
//! ```text
//!  read(offset, len)                                  write(offset, data)
//!   ├─ local tier (this process, CLOCK) ─ hit          ├─ mark stripes written
//!   ├─ pool (AsyncPageStore: engine or nodes) ─ hit    ├─ backing store write (FUA as asked)
//!   │     exclusive: take, inclusive: get              ├─ gates: local updated/removed,
//!   └─ backing store, whole pages                      │         pool copies invalidated
//!        populate local (and pool when inclusive,      └─ acknowledge
//!        or when there is no local tier)
//!  local tier eviction (exclusive) ─▶ demoter task ─▶ pool put, batched, off the request path
//! ```
//!
//! A pool that fails is never an error for the client: a failed lookup is a miss, a failed
//! populate is skipped. A failed invalidation is the one dangerous case (a stale copy may
//! remain in the pool), so the pool is then distrusted, reads skip it, and a background task
//! invalidates the export's whole object in the pool before trusting it again.
//!
//! The layer is its own crate so that every front end (the NBD server, a vhost-user-blk
//! backend) serves an export through the same tiers and the same coherence rule.
//!
//! # Components
//! [`split`]: byte ranges into page pieces. [`coherence`]: the race rule. [`local`]: the
//! local tier. [`CacheLayer`]: all of it over one backing store; its read path is in
//! `read.rs`, its write paths (write-through, write-back, discards) in `write.rs`, the
//! moves between tiers in `tiers.rs`, and the background tasks (the flusher, the demoter,
//! the pool's trust keeper) in `background.rs`.

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

mod background;
pub mod coherence;
mod dirty;
pub mod local;
mod read;
pub mod split;
mod tiers;
mod write;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fallow_backing::BackingStore;
use fallow_core::{AsyncPageStore, ObjectId, PageKey, PoolId, PAGE_SIZE};
use tokio::sync::mpsc;

use background::{demoter, flusher, trust_keeper};
use coherence::{Coherence, Ticket};
use local::LocalTier;

const PAGE: u64 = PAGE_SIZE as u64;

/// Pages demoted to the pool per batch.
const DEMOTE_BATCH: usize = 64;

/// Demotions waiting for the pool; beyond this they are dropped (the pages are clean).
const DEMOTE_QUEUE: usize = 4096;

/// How the local tier and the pool share pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A page lives in one tier: a pool hit moves it to the local tier (take), and a page
    /// evicted from the local tier is put into the pool, in the background.
    Exclusive,
    /// The pool keeps its copy; pages read from the store go into both tiers.
    Inclusive,
}

/// The pool behind the local tier: a store, the pool in it, and the object id under which
/// this export's pages are kept (page number = page index).
#[derive(Clone)]
pub struct PoolTier {
    /// The engine in this process, or nodes through the client library.
    pub store: Arc<dyn AsyncPageStore>,
    /// The pool (ephemeral: a clean-page cache).
    pub pool: PoolId,
    /// This export's object in the pool.
    pub object: ObjectId,
}

impl std::fmt::Debug for PoolTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolTier").field("pool", &self.pool).field("object", &self.object).finish()
    }
}

/// When a write is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WritePolicy {
    /// After the backing store has it (the default).
    Through,
    /// From memory: the page is kept dirty in this process and written to the store by
    /// FLUSH, by FUA, or by the background flusher, which keeps at most `max_dirty_bytes`
    /// dirty and none older than `max_age`. A crash loses dirty pages, never a write
    /// acknowledged before a completed FLUSH.
    Back {
        /// The most dirty bytes; writes wait for the flusher beyond this.
        max_dirty_bytes: u64,
        /// The oldest a dirty page may get before the flusher writes it.
        max_age: Duration,
    },
}

/// Settings of one export's cache.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Pages in the local tier (0: none).
    pub local_pages: usize,
    /// Exclusive or inclusive.
    pub mode: Mode,
    /// Reads of at least this many bytes are served from the caches when they hit but do
    /// not populate them: a large sequential scan would otherwise flush the working set.
    pub scan_bytes: u32,
    /// Write-through or write-back.
    pub write: WritePolicy,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            local_pages: 0,
            mode: Mode::Exclusive,
            scan_bytes: 1 << 20,
            write: WritePolicy::Through,
        }
    }
}

/// Counters of one export's cache.
#[derive(Debug, Default)]
pub struct CacheStats {
    /// Pages found in the local tier.
    pub local_hits: AtomicU64,
    /// Pages found in the pool.
    pub pool_hits: AtomicU64,
    /// Pages read from the backing store.
    pub misses: AtomicU64,
    /// Reads sent to the backing store.
    pub backing_reads: AtomicU64,
    /// Microseconds spent in those reads, in total (for the mean backing latency).
    pub backing_read_micros: AtomicU64,
    /// Pages put into the pool (populate or demotion).
    pub pool_puts: AtomicU64,
    /// Pool operations that failed (each was treated as a miss or skipped).
    pub pool_errors: AtomicU64,
    /// Pages not cached because a write raced with the read that fetched them.
    pub populate_skipped: AtomicU64,
    /// Demotions dropped because the queue to the pool was full.
    pub demotions_dropped: AtomicU64,
    /// Pages served from the dirty set (write-back).
    pub dirty_hits: AtomicU64,
    /// Dirty pages written to the backing store (write-back).
    pub written_back: AtomicU64,
    /// Write-back attempts that failed (the pages stay dirty and are retried).
    pub write_back_errors: AtomicU64,
}

struct Shared {
    backing: Arc<dyn BackingStore>,
    local: LocalTier,
    pool: Option<PoolTier>,
    /// False after an invalidation in the pool failed: reads skip the pool until the
    /// export's object has been invalidated there.
    pool_trusted: AtomicBool,
    /// Counts distrust events, so a recovery that raced with a new failure does not
    /// restore trust.
    distrust_epoch: AtomicU64,
    coherence: Coherence,
    config: CacheConfig,
    /// Pages wholly inside the export: only these are cached.
    whole_pages: u64,
    stats: CacheStats,
    demote: Option<mpsc::Sender<(u64, Bytes, Ticket)>>,
    dirty: dirty::DirtySet,
    /// Write-back's limits, which a reload may change (`CacheLayer::set_dirty_limits`):
    /// the most dirty bytes, and the age in ms at which the flusher writes a page.
    max_dirty_bytes: AtomicU64,
    max_dirty_age_ms: AtomicU64,
    /// No local tier, no pool, write-through: nothing is ever cached or dirty, so reads go
    /// straight to the store (`read_through`).
    pass_through: bool,
}

/// One export's cache over its backing store. Cheap to share (`Arc` inside); every
/// connection of the export uses the same one, which is what keeps them coherent.
#[derive(Clone)]
pub struct CacheLayer {
    shared: Arc<Shared>,
}

impl Shared {
    /// The write policy with the limits now in force.
    pub(crate) fn write_policy(&self) -> WritePolicy {
        match self.config.write {
            WritePolicy::Through => WritePolicy::Through,
            WritePolicy::Back { .. } => WritePolicy::Back {
                max_dirty_bytes: self.max_dirty_bytes.load(Relaxed),
                max_age: Duration::from_millis(self.max_dirty_age_ms.load(Relaxed)),
            },
        }
    }
}

impl std::fmt::Debug for CacheLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheLayer")
            .field("backing", &self.shared.backing)
            .field("pool", &self.shared.pool)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl CacheLayer {
    /// A cache over `backing`, with an optional pool behind the local tier. Starts the
    /// demoter (exclusive mode with both tiers) and the pool's trust keeper on the current
    /// tokio runtime.
    pub fn new(
        backing: Arc<dyn BackingStore>,
        pool: Option<PoolTier>,
        config: CacheConfig,
    ) -> Self {
        let demoting = pool.is_some() && config.mode == Mode::Exclusive && config.local_pages > 0;
        let (demote, demotions) = if demoting {
            let (tx, rx) = mpsc::channel(DEMOTE_QUEUE);
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        let pass_through =
            pool.is_none() && config.local_pages == 0 && config.write == WritePolicy::Through;
        let (max_dirty_bytes, max_dirty_age_ms) = match config.write {
            WritePolicy::Back { max_dirty_bytes, max_age } => {
                (max_dirty_bytes, max_age.as_millis() as u64)
            }
            WritePolicy::Through => (0, 0),
        };
        let shared = Arc::new(Shared {
            pass_through,
            whole_pages: backing.size() / PAGE,
            backing,
            local: LocalTier::new(config.local_pages),
            pool,
            pool_trusted: AtomicBool::new(true),
            distrust_epoch: AtomicU64::new(0),
            coherence: Coherence::new(),
            config,
            stats: CacheStats::default(),
            demote,
            dirty: dirty::DirtySet::default(),
            max_dirty_bytes: AtomicU64::new(max_dirty_bytes),
            max_dirty_age_ms: AtomicU64::new(max_dirty_age_ms),
        });
        if let Some(rx) = demotions {
            tokio::spawn(demoter(Arc::downgrade(&shared), rx));
        }
        if let WritePolicy::Back { .. } = shared.config.write {
            tokio::spawn(flusher(Arc::downgrade(&shared)));
        }
        if shared.pool.is_some() {
            tokio::spawn(trust_keeper(Arc::downgrade(&shared)));
        }
        CacheLayer { shared }
    }

    /// The backing store.
    pub fn backing(&self) -> &Arc<dyn BackingStore> {
        &self.shared.backing
    }

    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.shared.backing.size()
    }

    /// The counters.
    pub fn stats(&self) -> &CacheStats {
        &self.shared.stats
    }

    /// Pages in the local tier.
    pub fn local_pages(&self) -> usize {
        self.shared.local.len()
    }

    /// Bytes acknowledged but not yet written to the backing store (write-back).
    pub fn dirty_bytes(&self) -> u64 {
        self.shared.dirty.bytes()
    }

    /// How long the oldest dirty page has waited for the backing store (write-back), if
    /// there is one. Visits every dirty page: for metrics, not for a hot path.
    pub fn dirty_oldest_age(&self) -> Option<Duration> {
        self.shared.dirty.oldest_age()
    }

    /// When writes are acknowledged, and the write-back limits now in force.
    pub fn write_policy(&self) -> WritePolicy {
        self.shared.write_policy()
    }

    /// The mode the cache was made with.
    pub fn mode(&self) -> Mode {
        self.shared.config.mode
    }

    /// Changes write-back's limits (a reload): a smaller `max_dirty_bytes` makes the next
    /// writer write back first, a shorter `max_age` is the flusher's next deadline. False,
    /// and nothing changes, for a write-through cache.
    pub fn set_dirty_limits(&self, max_dirty_bytes: u64, max_age: Duration) -> bool {
        let s = &*self.shared;
        if s.config.write == WritePolicy::Through {
            return false;
        }
        s.max_dirty_bytes.store(max_dirty_bytes, Relaxed);
        s.max_dirty_age_ms.store((max_age.as_millis() as u64).max(1), Relaxed);
        true
    }

    /// Changes the local tier's size (a reload). Pages a shrink evicts go to the pool in
    /// exclusive mode, as evictions do. False, and nothing changes, when either size is
    /// zero: a cache made without a local tier (or given none) is laid out differently
    /// (no demoter; a cache with nothing to cache reads straight through).
    pub fn set_local_capacity(&self, pages: usize) -> bool {
        let s = &*self.shared;
        if pages == 0 || s.local.capacity() == 0 {
            return false;
        }
        for (page, data) in s.local.set_capacity(pages) {
            tiers::demote(s, page, data);
        }
        true
    }

    /// False while the pool is skipped after a failed invalidation.
    pub fn pool_trusted(&self) -> bool {
        self.shared.pool_trusted.load(Relaxed)
    }

    fn keys(&self, pool: &PoolTier, pages: &[u64]) -> Vec<PageKey> {
        pages.iter().map(|p| PageKey::new(pool.pool, pool.object, *p)).collect()
    }
}
