//! The cache's background tasks, each holding only a weak reference so that it stops when
//! the cache is dropped: the flusher (write-back), the demoter (exclusive mode: local tier
//! evictions into the pool) and the trust keeper (a pool distrusted after a failed
//! invalidation is cleared of the export's pages, then used again).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::coherence::Ticket;
use crate::tiers::put_into_pool;
use crate::write::write_back_all;
use crate::{Shared, WritePolicy, DEMOTE_BATCH};

/// Writes dirty pages out when they get old or too many. Stops when the cache is dropped.
pub(crate) async fn flusher(cache: std::sync::Weak<Shared>) {
    let mut tick = Duration::from_millis(10);
    loop {
        tokio::time::sleep(tick).await;
        let Some(s) = cache.upgrade() else { return };
        // Read each round: a reload may change them.
        let WritePolicy::Back { max_dirty_bytes, max_age } = s.write_policy() else { return };
        tick = (max_age / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        if s.dirty.is_empty() {
            continue;
        }
        let old = s.dirty.oldest_age().is_some_and(|age| age >= max_age);
        if old || s.dirty.bytes() > max_dirty_bytes / 2 {
            if let Err(err) = write_back_all(&s, None).await {
                tracing::debug!(%err, "background write-back failed; retrying later");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Moves pages evicted from the local tier into the pool, in batches, off the request
/// path. Stops when the cache is dropped.
pub(crate) async fn demoter(
    cache: std::sync::Weak<Shared>,
    mut rx: mpsc::Receiver<(u64, Bytes, Ticket)>,
) {
    let mut batch = Vec::with_capacity(DEMOTE_BATCH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < DEMOTE_BATCH {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let Some(s) = cache.upgrade() else { return };
        let Some(pool) = &s.pool else { return };
        if s.pool_trusted.load(Relaxed) {
            let tickets: Vec<Ticket> = batch.iter().map(|(_, _, t)| *t).collect();
            let (_gates, valid) = s.coherence.admit(&tickets).await;
            let items: Vec<&(u64, Bytes, Ticket)> =
                batch.iter().filter(|(_, _, t)| valid.contains(t)).collect();
            if !items.is_empty() {
                let pages: Vec<(u64, &Bytes)> = items.iter().map(|(p, b, _)| (*p, b)).collect();
                put_into_pool(&s, pool, &pages, "demotion").await;
            }
        }
        batch.clear();
    }
}

/// Restores trust in the pool after a failed invalidation, by invalidating the export's
/// whole object there. Stops when the cache is dropped.
pub(crate) async fn trust_keeper(cache: std::sync::Weak<Shared>) {
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let Some(s) = cache.upgrade() else { return };
        if s.pool_trusted.load(Relaxed) {
            continue;
        }
        let Some(pool) = &s.pool else { return };
        let epoch = s.distrust_epoch.load(Relaxed);
        match pool.store.invalidate_object(pool.pool, pool.object).await {
            Ok(n) if s.distrust_epoch.load(Relaxed) == epoch => {
                s.pool_trusted.store(true, Relaxed);
                tracing::info!(pages = n, "pool cleared of this export's pages; using it again");
            }
            Ok(_) => {} // another failure meanwhile: clear again next round
            Err(err) => tracing::debug!(%err, "pool still unavailable"),
        }
    }
}
