//! CONTENT_SUMMARY: this node's Bloom filter of the content hashes it holds, for clients
//! that dedup across nodes (`docs/cluster.md`, "Cross-node dedup").
//!
//! Built on demand, not in the background: a node nobody asks pays nothing. A request for
//! the first piece (offset 0) rebuilds the filter when the last one is older than the
//! refresh interval; later pieces come from the same build, so a client reads one
//! consistent filter (the generation tells it when a rebuild happened mid-download).
//! Requests run on a blocking thread (`cmd::is_slow`), and concurrent ones wait for a
//! single build.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fallow_core::content::ContentFilter;
use fallow_pool::Engine;
use fallow_proto::fallow::{SummaryChunk, SUMMARY_CHUNK};
use parking_lot::Mutex;

/// How summaries are sized and how long one is served.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SummarySettings {
    /// The false-positive rate a summary is sized for.
    pub false_positive_rate: f64,
    /// The largest filter in bytes; a node holding more content gets a higher rate.
    pub max_bytes: usize,
    /// How long a built summary is served before a request rebuilds it.
    pub refresh: Duration,
    /// The most filter bytes per reply, at most [`SUMMARY_CHUNK`] (1 MiB): a client reads
    /// pieces of any size.
    pub piece_bytes: usize,
}

impl Default for SummarySettings {
    /// 1 % false positives (9.6 bits per page), at most 16 MiB (enough for 14 million
    /// pages, 53 GiB of lent memory, at that rate), rebuilt at most every 10 s.
    fn default() -> Self {
        Self {
            false_positive_rate: 0.01,
            max_bytes: 16 << 20,
            refresh: Duration::from_secs(10),
            piece_bytes: SUMMARY_CHUNK,
        }
    }
}

/// One build.
struct Built {
    filter: ContentFilter,
    generation: u64,
    at: Instant,
}

/// The node's current summary.
pub(crate) struct Summaries {
    settings: SummarySettings,
    current: Mutex<Option<Arc<Built>>>,
    builds: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Summaries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Summaries").field("settings", &self.settings).finish_non_exhaustive()
    }
}

impl Summaries {
    pub(crate) fn new(settings: SummarySettings) -> Self {
        Self { settings, current: Mutex::new(None), builds: Default::default() }
    }

    /// The piece of the summary that starts at byte `offset` (empty past the end).
    pub(crate) fn piece(&self, engine: &Engine, offset: u64) -> SummaryChunk {
        let built = self.current(engine, offset == 0);
        let filter = &built.filter;
        let total = filter.len_bytes();
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(total);
        SummaryChunk {
            generation: built.generation,
            entries: filter.entries(),
            total_len: total as u64,
            hashes: filter.hashes(),
            offset: start as u64,
            data: Bytes::from(
                filter.bytes(start, self.settings.piece_bytes.clamp(8, SUMMARY_CHUNK)),
            ),
        }
    }

    /// How many summaries were built, and the size of the last one.
    pub(crate) fn usage(&self) -> (u64, usize) {
        let bytes = self.current.lock().as_ref().map_or(0, |b| b.filter.len_bytes());
        (self.builds.load(std::sync::atomic::Ordering::Relaxed), bytes)
    }

    fn current(&self, engine: &Engine, may_rebuild: bool) -> Arc<Built> {
        let mut current = self.current.lock();
        let stale = current.as_ref().is_none_or(|b| b.at.elapsed() >= self.settings.refresh);
        if let Some(built) = current.as_ref().filter(|_| !(stale && may_rebuild)) {
            return built.clone();
        }
        let started = Instant::now();
        let filter =
            engine.content_filter(self.settings.false_positive_rate, self.settings.max_bytes);
        let generation = self.builds.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        tracing::debug!(
            generation,
            entries = filter.entries(),
            bytes = filter.len_bytes(),
            false_positive_rate = filter.false_positive_rate(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "content summary built"
        );
        let built = Arc::new(Built { filter, generation, at: Instant::now() });
        *current = Some(built.clone());
        built
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
    use fallow_pool::EngineBuilder;

    fn engine_with(pages: u64) -> Engine {
        let engine = Engine::new(EngineBuilder::new(64 << 20).build().unwrap());
        let pool = engine.create_pool(&PoolSpec::ephemeral()).unwrap();
        for i in 0..pages {
            let mut page = vec![0u8; PAGE_SIZE];
            page[..8].copy_from_slice(&(i + 1).to_le_bytes());
            assert_eq!(engine.put(PageKey::new(pool, 0, i), &page).unwrap(), PutOutcome::Stored);
        }
        engine
    }

    #[test]
    fn pieces_cover_the_filter_and_share_a_generation() {
        let engine = engine_with(3000);
        let settings = SummarySettings { max_bytes: 64 << 20, ..Default::default() };
        let summaries = Summaries::new(settings);
        let first = summaries.piece(&engine, 0);
        assert_eq!(first.entries, 3000);
        assert_eq!(first.total_len, first.data.len() as u64, "one piece holds a small filter");
        let past = summaries.piece(&engine, first.total_len + 8);
        assert!(past.data.is_empty());
        assert_eq!(past.generation, first.generation);
        assert_eq!(summaries.usage(), (1, first.total_len as usize));
    }

    #[test]
    fn a_first_piece_rebuilds_only_after_the_refresh_interval() {
        let engine = engine_with(10);
        let summaries = Summaries::new(SummarySettings {
            refresh: Duration::from_millis(50),
            ..Default::default()
        });
        let a = summaries.piece(&engine, 0).generation;
        assert_eq!(summaries.piece(&engine, 0).generation, a);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(summaries.piece(&engine, 8).generation, a, "later pieces never rebuild");
        assert_eq!(summaries.piece(&engine, 0).generation, a + 1);
    }

    #[test]
    fn an_empty_node_serves_an_empty_filter() {
        let engine = engine_with(0);
        let piece = Summaries::new(SummarySettings::default()).piece(&engine, 0);
        assert_eq!((piece.total_len, piece.hashes, piece.entries), (0, 0, 0));
        assert!(piece.data.is_empty());
    }
}
