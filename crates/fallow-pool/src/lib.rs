//! The local tmem engine: pools of 4 KiB pages keyed by `(pool, object, index)`. An
//! ephemeral pool may drop any page at any time; a persistent pool keeps an accepted put
//! until it is invalidated. The full contract is in `docs/semantics.md`; the locks and their
//! order are in `docs/concurrency.md`.
//!
//! ```
//! use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, Lookup, PAGE_SIZE};
//! use fallow_pool::{Engine, EngineBuilder};
//!
//! let engine = Engine::new(EngineBuilder::new(64 << 20).build().unwrap());
//! let pool = engine.create_pool(&PoolSpec::ephemeral()).unwrap();
//! let key = PageKey::new(pool, 7, 0);
//! let page = vec![42u8; PAGE_SIZE];
//! assert_eq!(engine.put(key, &page).unwrap(), PutOutcome::Stored);
//! let mut out = vec![0u8; PAGE_SIZE];
//! assert_eq!(engine.get(key, &mut out).unwrap(), Lookup::Hit);
//! assert_eq!(out, page);
//! ```
//!
//! # Components
//! [`Engine`]: the [`fallow_core::PageStore`] over everything below.
//! `shard`: the sharded index (key → slot) and one [`eviction`] policy per shard.
//! `store`: page bytes, checksums, the dedup table and compressed pages.
//! `arena`: 4 KiB frames in 2 MiB segments, returned to the OS a segment at a time.
//! `compress`: the background thread that compresses cold pages, and moves a step of each
//! hash table's growth that inserts left half done.
//! `sweep`: the background thread that, after a shrink, removes the index entries of the
//! pages it dropped.
//!
//! # Memory
//! Page bytes live in the arena and never exceed the budget (rounded up to one segment);
//! compressed bytes count against the same budget. Metadata (index, slots, policy, store
//! tables) is reported by [`EngineStats::metadata_bytes`] and bounded by the
//! entries-per-frame limit. It counts arrays by their length, not what the allocator and
//! the page size add: the memory bench measures both. Many small shards cost more per
//! page, which is why the default shard count is bounded by the budget
//! ([`MIN_SHARD_PAGES`]).

mod arena;
mod compress;
mod config;
mod content;
mod dense;
mod engine;
mod engine_async;
pub mod eviction;
mod hashing;
mod id_table;
pub mod journal;
mod pools;
#[cfg(feature = "research-policies")]
mod prehashed;
mod shard;
mod stats;
mod store;
mod summary;
mod zeroed;

pub use arena::{FRAMES_PER_SEGMENT, SEGMENT_BYTES};
pub use config::{ConfigError, EngineBuilder, EngineConfig, MAX_BUDGET_BYTES, MIN_SHARD_PAGES};
pub use engine::{Engine, JournalStats};
pub use shard::MAX_PAGES as MAX_SHARD_PAGES;
pub use stats::SweepReport;
pub use stats::{BudgetReport, EngineStats, MemoryUsage, PoolStats};
pub use store::ShrinkReport;
