//! Moving pages between the tiers: into the local tier (its evictions to the demoter),
//! into the pool, and out of the pool when a write makes its copies stale.

use std::sync::atomic::Ordering::Relaxed;

use bytes::{Bytes, BytesMut};
use fallow_core::{PageKey, PutOutcome, PAGE_SIZE};

use crate::{CacheLayer, Mode, PoolTier, Shared};

impl CacheLayer {
    /// On a clean stop, after the last client and the last dirty page: moves the local
    /// tier's pages into the pool, where an export started again with the same pool finds
    /// them (exclusive mode; in inclusive mode the pool holds them already). Returns how
    /// many pages were offered; the pool may refuse some (full), which costs re-reads.
    pub async fn hand_local_to_pool(&self) -> usize {
        let s = &*self.shared;
        let Some(pool) = &s.pool else { return 0 };
        if s.config.mode != Mode::Exclusive || !s.pool_trusted.load(Relaxed) {
            return 0;
        }
        let pages = s.local.drain();
        for batch in pages.chunks(crate::DEMOTE_BATCH) {
            let batch: Vec<(u64, &Bytes)> = batch.iter().map(|(p, b)| (*p, b)).collect();
            put_into_pool(s, pool, &batch, "handing the local tier to the pool").await;
        }
        pages.len()
    }

    /// Removes cached copies of whole pages in the pool; on failure, distrusts the pool.
    pub(crate) async fn invalidate_in_pool(&self, pages: &[u64]) {
        let s = &*self.shared;
        let Some(pool) = &s.pool else { return };
        if pages.is_empty() {
            return;
        }
        if let Err(err) = pool.store.invalidate_pages(&self.keys(pool, pages)).await {
            s.stats.pool_errors.fetch_add(1, Relaxed);
            s.distrust_epoch.fetch_add(1, Relaxed);
            if s.pool_trusted.swap(false, Relaxed) {
                tracing::warn!(%err, "could not invalidate pages in the pool; skipping the pool until it is cleared");
            }
        }
    }
}

/// Puts clean pages into the pool in one batch; a failure is counted and logged, never an
/// error (the pages are clean: losing them costs a re-read).
pub(crate) async fn put_into_pool(
    s: &Shared,
    pool: &PoolTier,
    pages: &[(u64, &Bytes)],
    what: &str,
) {
    let keys: Vec<PageKey> =
        pages.iter().map(|(p, _)| PageKey::new(pool.pool, pool.object, *p)).collect();
    let mut data = BytesMut::with_capacity(pages.len() * PAGE_SIZE);
    for (_, b) in pages {
        data.extend_from_slice(b);
    }
    match pool.store.put_many(&keys, data.freeze()).await {
        Ok(outcomes) => {
            let stored = outcomes.iter().filter(|o| **o == PutOutcome::Stored).count();
            s.stats.pool_puts.fetch_add(stored as u64, Relaxed);
        }
        Err(err) => {
            s.stats.pool_errors.fetch_add(1, Relaxed);
            tracing::debug!(%err, what, "putting pages into the pool failed");
        }
    }
}

/// Inserts into the local tier; an evicted page goes to the demoter (exclusive mode).
pub(crate) fn keep_local(s: &Shared, page: u64, data: Bytes) {
    if let Some((evicted, bytes)) = s.local.insert(page, data) {
        demote(s, evicted, bytes);
    }
}

/// Hands a page evicted from the local tier to the demoter (exclusive mode; otherwise it
/// is dropped).
pub(crate) fn demote(s: &Shared, page: u64, data: Bytes) {
    let Some(demote) = &s.demote else { return };
    // The evicted page was valid while in the tier; its ticket now guards the trip to the
    // pool against a write that starts meanwhile.
    match s.coherence.ticket(page) {
        Some(ticket) => {
            if demote.try_send((page, data, ticket)).is_err() {
                s.stats.demotions_dropped.fetch_add(1, Relaxed);
            }
        }
        None => {
            s.stats.populate_skipped.fetch_add(1, Relaxed);
        }
    }
}
