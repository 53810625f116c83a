//! The repair: re-creating the copies of persistent pages that a dead node held.
//!
//! When a node is retired (membership declared it dead, or it restarted and so lost its
//! pools), or this client could not reach it for [`ClusterClientConfig::repair_after`],
//! every persistent page it held has one copy left. The repair finds them (a pass
//! over the summary's persistent entries), reads each from its surviving node and puts it
//! on the next live node in the key's rendezvous order (the best placeable node other
//! than the survivor), then records the new holder in the summary. Pages are copied in
//! groups of [`CHUNK`] per request pair, [`PARALLEL`] pairs in flight; while a group is
//! copied the repair holds the client's write fence exclusively, so no put, take or
//! invalidation of a persistent page runs meanwhile (a copy never resurrects an older
//! version of a page a write changed). Pages that could not be copied (no other live
//! node, a node refused or failed) are tried again every [`RETRY`] until none is left.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use fallow_core::{PageKey, PoolId, PutOutcome};
use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::client::Inner;
use super::placement::{key_hash, top_two, Candidate};
use super::summary::Slot;
use super::view::{Kind, NodeLink};
#[cfg(doc)]
use super::ClusterClientConfig;

/// Pages copied by one request pair (a get from the survivor, a put to the new holder).
const CHUNK: usize = 256;
/// Request pairs in flight at once.
const PARALLEL: usize = 4;
/// How soon a pass that left pages at risk is tried again.
const RETRY: Duration = Duration::from_secs(1);
/// How often a long pass logs its progress.
const PROGRESS: Duration = Duration::from_secs(2);

/// Runs a repair pass when a node is retired, and again every [`RETRY`] while pages are
/// left at risk, until the client is dropped.
pub(crate) async fn repair_loop(inner: Weak<Inner>, wake: Arc<Notify>, stop: CancellationToken) {
    let mut pending = false;
    loop {
        let woken = tokio::select! {
            _ = stop.cancelled() => return,
            _ = wake.notified() => true,
            _ = tokio::time::sleep(RETRY), if pending => false,
        };
        let Some(inner) = inner.upgrade() else { return };
        // Retries that achieve nothing (no other live node yet) log at debug only.
        pending = inner.repair(!woken).await;
    }
}

/// Pages of one pool to copy from one node to another.
struct Job {
    from: Arc<NodeLink>,
    from_pool: PoolId,
    survivor: Slot,
    to: Arc<NodeLink>,
    to_pool: PoolId,
    target: Slot,
    /// Logical keys.
    keys: Vec<PageKey>,
}

/// What one job did.
#[derive(Default)]
struct Copied {
    /// Keys now on the new holder too: key, survivor, new holder.
    done: Vec<(PageKey, Slot, Slot)>,
    /// Keys not copied this time (a node failed or refused): tried again.
    failed: u64,
    /// Keys the survivor no longer had (it lost the pool): not tried again.
    vanished: u64,
}

impl Inner {
    /// One pass over the persistent pages at risk; returns whether some are left that a
    /// later pass may save, or a node is down that may be declared lost later.
    pub(crate) async fn repair(&self, quiet: bool) -> bool {
        let gone = self.down_slots(self.config.repair_after);
        let any_down = !self.down_slots(Duration::ZERO).is_empty();
        // Under the fence: a write in flight when the node was retired has recorded its
        // holders by the time the fence is ours.
        let risk = {
            let _fence = self.fence.write().await;
            self.summary.lock().at_risk(&gone)
        };
        if risk.pages.is_empty() {
            return any_down;
        }
        let start = Instant::now();
        let total = risk.pages.len();
        match quiet {
            true => tracing::debug!(pages = total, lost = risk.lost, "retrying the repair"),
            false => tracing::info!(
                pages = total,
                lost = risk.lost,
                "re-creating the persistent copies held by a node that is gone"
            ),
        }
        let (mut done, mut failed, mut vanished) = (0u64, 0u64, 0u64);
        let mut logged = Instant::now();
        for group in risk.pages.chunks(CHUNK * PARALLEL) {
            if self.stop.is_cancelled() {
                return false;
            }
            let _fence = self.fence.write().await;
            let (jobs, unplaced) = self.plan(group, &gone);
            failed += unplaced;
            let results: Vec<Copied> =
                futures::stream::iter(jobs.into_iter().map(|j| self.copy(j)))
                    .buffer_unordered(PARALLEL)
                    .collect()
                    .await;
            let mut summary = self.summary.lock();
            let mut recorded = 0;
            for copied in results {
                failed += copied.failed;
                vanished += copied.vanished;
                for (key, survivor, target) in copied.done {
                    // Under the fence only a destroyed pool changes an entry meanwhile.
                    if summary.replace_lost(&key, survivor, target, &gone) {
                        recorded += 1;
                    }
                }
            }
            drop(summary);
            done += recorded;
            self.repaired.fetch_add(recorded, Ordering::Relaxed);
            if logged.elapsed() >= PROGRESS {
                logged = Instant::now();
                tracing::info!(done, of = total, "re-creating persistent copies");
            }
        }
        if done > 0 {
            *self.last_repair.lock() = Some((done, start.elapsed()));
        }
        let ms = start.elapsed().as_millis() as u64;
        match failed + vanished {
            0 => tracing::info!(pages = done, ms, "every lost persistent copy re-created"),
            _ if quiet && done == 0 => {
                tracing::debug!(left = failed, vanished, "no persistent copy re-created")
            }
            _ => tracing::warn!(
                re_created = done,
                left = failed,
                vanished,
                ms,
                "some persistent pages still have one copy; trying again"
            ),
        }
        failed > 0 || any_down
    }

    /// Where each page of `group` is copied from and to, in jobs of at most [`CHUNK`]
    /// keys; and how many pages have nowhere to go now (no other live node, or the
    /// survivor is unreachable).
    fn plan(&self, group: &[(PageKey, Slot)], gone: &[Slot]) -> (Vec<Job>, u64) {
        let view = self.view.read();
        let summary = self.summary.lock();
        let mut jobs: HashMap<(PoolId, Slot, Slot), Job> = HashMap::new();
        let mut unplaced = 0;
        let mut cached: Option<(PoolId, Vec<Candidate>)> = None;
        for &(key, survivor) in group {
            // Written, taken or invalidated since the pass began: nothing to re-create.
            let holders =
                summary.copies(&key).map(|h| h.map(|s| if gone.contains(&s) { 0 } else { s }));
            if !matches!(holders, Some([a, 0] | [0, a]) if a == survivor) {
                continue;
            }
            let Some(pool) = view.pools.get(&key.pool).filter(|p| p.kind() == Kind::Replicated)
            else {
                continue; // destroyed meanwhile
            };
            if cached.as_ref().is_none_or(|(id, _)| *id != key.pool) {
                cached = Some((key.pool, view.candidates(pool)));
            }
            let candidates = cached.as_ref().map_or(&[][..], |(_, c)| c.as_slice());
            let target = match top_two(key_hash(pool.seed, key.object, key.index), candidates) {
                [Some(first), second] if first == survivor => second,
                [first, _] => first,
            };
            let routes =
                target.and_then(|t| Some((view.route(pool, survivor)?, view.route(pool, t)?)));
            let (Some(target), Some(((from, from_pool), (to, to_pool)))) = (target, routes) else {
                unplaced += 1;
                continue;
            };
            jobs.entry((key.pool, survivor, target))
                .or_insert_with(|| Job {
                    from,
                    from_pool,
                    survivor,
                    to,
                    to_pool,
                    target,
                    keys: Vec::new(),
                })
                .keys
                .push(key);
        }
        let mut out = Vec::new();
        for job in jobs.into_values() {
            for keys in job.keys.chunks(CHUNK) {
                out.push(Job {
                    from: job.from.clone(),
                    to: job.to.clone(),
                    keys: keys.to_vec(),
                    ..job
                });
            }
        }
        (out, unplaced)
    }

    /// Copies one job's pages: a get from the survivor, a put of those it had to the new
    /// holder.
    async fn copy(&self, job: Job) -> Copied {
        let mut out = Copied::default();
        let on = |pool: PoolId| -> Vec<PageKey> {
            job.keys.iter().map(|k| PageKey::new(pool, k.object, k.index)).collect()
        };
        let pages = match job.from.client.get_many(&on(job.from_pool)).await {
            Ok(pages) => pages,
            Err(err) => {
                self.absorb(&job.from, &err);
                out.failed = job.keys.len() as u64;
                return out;
            }
        };
        let mut data = BytesMut::new();
        let mut keys = Vec::new();
        for (key, page) in job.keys.iter().zip(pages) {
            match page {
                Some(page) => {
                    data.extend_from_slice(&page);
                    keys.push(*key);
                }
                None => out.vanished += 1,
            }
        }
        if out.vanished > 0 {
            tracing::warn!(
                node = %job.from.id, pages = out.vanished,
                "a persistent page's surviving copy is missing; it cannot be re-created"
            );
        }
        if keys.is_empty() {
            return out;
        }
        let targets: Vec<PageKey> =
            keys.iter().map(|k| PageKey::new(job.to_pool, k.object, k.index)).collect();
        match job.to.client.put_many(&targets, data.freeze()).await {
            Ok(outcomes) => {
                for (key, outcome) in keys.iter().zip(outcomes) {
                    match outcome {
                        PutOutcome::Stored => out.done.push((*key, job.survivor, job.target)),
                        PutOutcome::NotStored(_) => out.failed += 1,
                    }
                }
            }
            Err(err) => {
                self.absorb(&job.to, &err);
                out.failed += keys.len() as u64;
            }
        }
        out
    }
}
