//! Trace replay through the real engine: every access is a get on an ephemeral pool of a
//! fixed number of pages; a miss is followed by a put (write-allocate), exactly as a
//! second-chance cache in front of slow storage would do. One shard, so the eviction
//! order is the policy's global order and the miss ratio is comparable with simulators.

use std::time::Instant;

use fallow_core::{DedupScope, PageKey, PageStore, PoolSpec, StoreError, PAGE_SIZE};
use fallow_pool::{ConfigError, Engine, EngineBuilder, MAX_SHARD_PAGES};

use crate::trace::{PageAccess, TraceError};

/// What went wrong in a replay.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The engine refused the configuration (unknown policy, ...).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The engine failed an operation.
    #[error("engine: {0}")]
    Store(#[from] StoreError),
    /// A cache of zero pages was asked for.
    #[error("--cache-pages must be at least 1")]
    ZeroCache,
    /// A cache larger than one index shard was asked for.
    #[error(
        "--cache-pages {0} is more than the {MAX_SHARD_PAGES} pages one index shard holds (a \
         replay uses one shard, so that the eviction order is the policy's global order)"
    )]
    TooLarge(usize),
    /// A hit returned bytes of another page: an engine bug, reported rather than counted.
    #[error("engine returned the wrong page for page {0}")]
    WrongPage(u64),
}

/// The outcome of one replay.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ReplayResult {
    /// Eviction policy.
    pub policy: String,
    /// Cache size in pages.
    pub cache_pages: usize,
    /// Page accesses replayed.
    pub accesses: u64,
    /// Accesses that hit.
    pub hits: u64,
    /// Accesses that missed.
    pub misses: u64,
    /// misses / accesses.
    pub miss_ratio: f64,
    /// The small-queue share (percent) the policy ended with, for policies that have one
    /// (`s3fifo-lean`: where its simulations left it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub small_share_percent: Option<u8>,
    /// Wall time of the replay, in seconds.
    pub seconds: f64,
}

/// Replays `accesses` through an engine of `cache_pages` pages under `policy`.
#[expect(clippy::indexing_slicing, reason = "the page buffer has PAGE_SIZE bytes")]
pub fn replay<I>(accesses: I, cache_pages: usize, policy: &str) -> Result<ReplayResult, ReplayError>
where
    I: IntoIterator<Item = Result<PageAccess, TraceError>>,
{
    if cache_pages == 0 {
        return Err(ReplayError::ZeroCache);
    }
    if cache_pages > MAX_SHARD_PAGES {
        return Err(ReplayError::TooLarge(cache_pages));
    }
    let config = EngineBuilder::new(cache_pages * PAGE_SIZE)
        .shards(1)
        .policy(policy)
        .entries_per_frame(1)
        .compress_interval(None)
        .build()?;
    let engine = Engine::new(config);
    let pool = engine.create_pool(&PoolSpec::ephemeral().dedup(DedupScope::Off))?;
    let start = Instant::now();
    let (mut hits, mut misses) = (0u64, 0u64);
    let mut page = vec![0u8; PAGE_SIZE];
    for access in accesses {
        let number = access?.page;
        let key = PageKey::new(pool, 0, number);
        if engine.get(key, &mut page)?.is_hit() {
            if page[..8] != number.to_le_bytes() {
                return Err(ReplayError::WrongPage(number));
            }
            hits += 1;
        } else {
            misses += 1;
            // Unique, non-fill bytes per page: the page number and its complement.
            page.fill(0);
            page[..8].copy_from_slice(&number.to_le_bytes());
            page[8..16].copy_from_slice(&(!number).to_le_bytes());
            let _ = engine.put(key, &page)?;
        }
    }
    let accesses = hits + misses;
    Ok(ReplayResult {
        policy: engine.config().policy.to_string(),
        cache_pages,
        accesses,
        hits,
        misses,
        miss_ratio: if accesses == 0 { 0.0 } else { misses as f64 / accesses as f64 },
        small_share_percent: engine.stats().small_share_percent,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Cache sizes at `percents` of `distinct` pages, rounded to the nearest page (as the
/// reference tables do), at least one page each.
pub fn sizes_at(distinct: u64, percents: &[f64]) -> Vec<usize> {
    percents.iter().map(|p| ((distinct as f64 * p / 100.0).round() as usize).max(1)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pages(v: &[u64]) -> Vec<Result<PageAccess, TraceError>> {
        v.iter().map(|&page| Ok(PageAccess { page, write: false })).collect()
    }

    #[test]
    fn a_loop_that_fits_hits_after_the_first_pass() {
        let trace: Vec<u64> = (0..10).cycle().take(100).collect();
        for policy in fallow_pool::eviction::POLICY_NAMES {
            let r = replay(pages(&trace), 10, policy).unwrap();
            assert_eq!((r.accesses, r.misses), (100, 10), "{policy}");
        }
    }

    #[test]
    fn lru_misses_every_access_of_a_loop_one_larger_than_the_cache() {
        let trace: Vec<u64> = (0..11).cycle().take(110).collect();
        let r = replay(pages(&trace), 10, "lru").unwrap();
        assert_eq!(r.misses, 110);
        assert!((r.miss_ratio - 1.0).abs() < 1e-9);
    }

    #[test]
    fn errors_are_reported_not_panicked() {
        assert!(matches!(replay(pages(&[1]), 0, "lru"), Err(ReplayError::ZeroCache)));
        let too_large = replay(pages(&[1]), MAX_SHARD_PAGES + 1, "lru");
        assert!(matches!(too_large, Err(ReplayError::TooLarge(n)) if n == MAX_SHARD_PAGES + 1));
        assert!(matches!(replay(pages(&[1]), 4, "nope"), Err(ReplayError::Config(_))));
    }

    #[test]
    fn a_policy_with_a_small_queue_reports_the_share_it_ended_with() {
        let trace: Vec<u64> = (0..300).collect();
        let at = |policy| replay(pages(&trace), 200, policy).unwrap().small_share_percent;
        assert_eq!(at("s3fifo-lean-1"), Some(1));
        assert_eq!(at("s3fifo-lean-100"), Some(100));
        assert_eq!(at("lru"), None);
        let json = serde_json::to_value(replay(pages(&trace), 200, "lru").unwrap()).unwrap();
        assert!(json.get("small_share_percent").is_none(), "absent, not null: {json}");
        // A scan of fresh pages ties the simulations: the default stays at its start, 10 %.
        assert_eq!(at("s3fifo-lean"), Some(10));
    }

    #[test]
    fn sizes_round_like_the_reference_tables() {
        assert_eq!(sizes_at(186_880, &[1.0, 5.0, 10.0, 25.0]), vec![1869, 9344, 18688, 46720]);
        assert_eq!(sizes_at(10, &[1.0]), vec![1]);
    }
}
