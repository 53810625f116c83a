//! Dedup across nodes, the cluster client's side: every node's content summary (a Bloom
//! filter of the content hashes it holds), fetched in the background; pages of a private
//! pool placed on a node that holds their content when one does (the summary of
//! placements finds them there later); and puts that send a page's hash instead of its
//! bytes when the node's summary says it holds that content.
//!
//! ```text
//!  put batch ─ per page: fill? dedup off? no summary? ─ yes ─▶ PUT (bytes) to the owner
//!                  │ no: content hash (before any lock)
//!                  ├─ private pool: the owner(s), unless only another node holds it
//!                  └─ to that node: held? ─ no ─▶ PUT (bytes)
//!                                        └─ yes ─▶ PUT_HASHES ─ "not held" ─▶ PUT (bytes)
//! ```
//!
//! Private persistent pages prefer, for their two copies, nodes that hold the content.
//! Shared pools are placed by key alone (other clients must find their pages by key);
//! their pages go as hashes when their owner holds the content.
//!
//! A false positive of the filter, or content N dropped since the summary was built,
//! costs one more round trip for that page and nothing else: a "not held" answer leaves
//! the key empty, and the page follows at once. Summaries are fetched on a connection of
//! their own, so a megabyte of filter never queues behind (or ahead of) page requests.

#![expect(
    clippy::indexing_slicing,
    reason = "positions of the caller's keys, and the pages laid out for them, computed here"
)]

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use fallow_core::content::{
    checksum, domain_content_hash, fill_word, page_dedup_key, ContentFilter,
};
use fallow_core::{
    DedupScope, HashPutOutcome, NotStored, PageKey, PutOutcome, TrustDomain, PAGE_SIZE,
};
use tokio_util::sync::CancellationToken;

use super::client::Inner;
use super::placement::Candidate;
use super::summary::Slot;
use super::view::{NodeLink, View};
use crate::{Client, ClientError};

/// How long fetching one node's summary may take (a large one is several 1 MiB pieces,
/// and the node may be building it).
const SUMMARY_TIMEOUT: Duration = Duration::from_secs(10);

/// Bytes a page sent as a hash saves: its 4096 bytes, less the 20 of hash and checksum.
const SAVED_PER_PAGE: u64 = (PAGE_SIZE - 20) as u64;

/// What dedup across nodes did ([`crate::ClusterClient::dedup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DedupStats {
    /// Pages stored by hash: the node already held their content.
    pub stored_by_hash: u64,
    /// Pages sent as a hash that the node did not hold (a filter false positive, or the
    /// content left the node since its summary): sent whole right after.
    pub not_held: u64,
    /// Page bytes not sent: `stored_by_hash` × 4076 (a page less its hash and checksum).
    pub bytes_saved: u64,
    /// Summaries fetched, and the bytes they took.
    pub summaries_fetched: u64,
    /// Bytes of summaries fetched.
    pub summary_bytes: u64,
}

/// The counters behind [`DedupStats`].
#[derive(Debug, Default)]
pub(crate) struct DedupCounters {
    stored_by_hash: AtomicU64,
    not_held: AtomicU64,
    summaries_fetched: AtomicU64,
    summary_bytes: AtomicU64,
}

impl DedupCounters {
    pub(crate) fn stats(&self) -> DedupStats {
        let stored_by_hash = self.stored_by_hash.load(Ordering::Relaxed);
        DedupStats {
            stored_by_hash,
            not_held: self.not_held.load(Ordering::Relaxed),
            bytes_saved: stored_by_hash * SAVED_PER_PAGE,
            summaries_fetched: self.summaries_fetched.load(Ordering::Relaxed),
            summary_bytes: self.summary_bytes.load(Ordering::Relaxed),
        }
    }
}

/// Fetches every usable node's summary now and then, while some pool dedups. Stops with
/// the client.
pub(crate) async fn dedup_loop(inner: Weak<Inner>, stop: CancellationToken) {
    let Some(every) = inner.upgrade().and_then(|i| i.config.dedup_refresh) else { return };
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        if inner.any_dedup_pool() {
            inner.fetch_summaries().await;
        }
    }
}

impl Inner {
    fn any_dedup_pool(&self) -> bool {
        self.view.read().pools.values().any(|p| p.spec.dedup != DedupScope::Off)
    }

    /// Fetches the summary of every usable node, in parallel. A node whose summary cannot
    /// be read gets the empty filter (its pages are sent whole) until the next round.
    pub(crate) async fn fetch_summaries(&self) {
        let links: Vec<Arc<NodeLink>> =
            self.view.read().nodes.iter().filter(|n| n.usable()).map(|n| n.link.clone()).collect();
        let fetches = links.iter().map(|link| async move {
            let config = link.client.config().clone().connections(1).timeout(SUMMARY_TIMEOUT);
            let result = match Client::connect(config).await {
                Ok(client) => client.content_summary().await,
                Err(err) => Err(err),
            };
            (link, result)
        });
        for (link, result) in futures::future::join_all(fetches).await {
            let filter = match result {
                Ok(filter) => {
                    self.dedup.summaries_fetched.fetch_add(1, Ordering::Relaxed);
                    let bytes = filter.len_bytes() as u64;
                    self.dedup.summary_bytes.fetch_add(bytes, Ordering::Relaxed);
                    tracing::debug!(
                        node = %link.id,
                        entries = filter.entries(),
                        bytes,
                        "content summary fetched"
                    );
                    filter
                }
                Err(err) => {
                    tracing::debug!(node = %link.id, %err, "content summary not fetched");
                    ContentFilter::empty()
                }
            };
            *link.content.lock() = Arc::new(filter);
        }
    }

    /// The content hash of every page of a batch whose pool dedups, or an empty list
    /// while no node's summary holds anything (then nothing is hashed). Computed before
    /// any lock is taken; the checksum waits until a page is sent by hash.
    pub(crate) fn digests(&self, keys: &[PageKey], pages: &[u8]) -> Vec<Option<Digest>> {
        let scopes: Vec<DedupScope> = {
            let view = self.view.read();
            if view.nodes.iter().all(|n| n.link.content.lock().is_empty()) {
                return Vec::new();
            }
            let scope = |k: &PageKey| view.pools.get(&k.pool).map(|p| p.spec.dedup);
            keys.iter().map(|k| scope(k).unwrap_or(DedupScope::Off)).collect()
        };
        pages.chunks_exact(PAGE_SIZE).zip(scopes).map(|(page, scope)| digest(page, scope)).collect()
    }

    /// Puts one node's part of a batch: pages the node's summary says it holds go as
    /// hashes first, the rest (and those it turns out not to hold) as bytes. `digests` is
    /// [`Inner::digests`] for the part's pages (empty: none is sent by hash).
    pub(crate) async fn put_part(
        &self,
        link: &NodeLink,
        keys: &[PageKey],
        pages: Bytes,
        digests: &[Option<Digest>],
    ) -> Result<Vec<PutOutcome>, ClientError> {
        let filter = link.content.lock().clone();
        // Positions the node probably holds, with their digests.
        let held: Vec<(usize, Digest)> = digests
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.filter(|d| filter.contains(d.key)).map(|d| (i, d)))
            .collect();
        // A key repeated in the batch must end with its last page: the two requests
        // below could reorder it, so such a batch goes whole.
        if held.is_empty() || has_repeats(keys) {
            return link.client.put_many(keys, pages).await;
        }
        let by_hash: Vec<usize> = held.iter().map(|&(i, _)| i).collect();
        let hash_keys: Vec<PageKey> = by_hash.iter().map(|&i| keys[i]).collect();
        let page = |i: usize| &pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE];
        // The content hash, which only a page sent by hash needs.
        let contents: Vec<(u128, u32)> =
            held.iter().map(|&(i, d)| (d.content_hash(page(i)), d.crc)).collect();
        let mut sent_whole = vec![true; keys.len()];
        by_hash.iter().for_each(|&i| sent_whole[i] = false);
        let rest: Vec<usize> = (0..keys.len()).filter(|&i| sent_whole[i]).collect();
        let (hashed, sent) = futures::future::join(
            link.client.put_hashes(&hash_keys, &contents),
            put_some(link, keys, &pages, &rest),
        )
        .await;
        let mut outcomes = vec![PutOutcome::NotStored(NotStored::Full); keys.len()];
        for (&i, outcome) in rest.iter().zip(sent?) {
            outcomes[i] = outcome;
        }
        let mut missing = Vec::new();
        for (&i, outcome) in by_hash.iter().zip(hashed?) {
            match outcome {
                HashPutOutcome::Stored => outcomes[i] = PutOutcome::Stored,
                HashPutOutcome::NotStored(why) => outcomes[i] = PutOutcome::NotStored(why),
                HashPutOutcome::NotHeld => missing.push(i),
            }
        }
        let stored = by_hash.len() - missing.len();
        self.dedup.stored_by_hash.fetch_add(stored as u64, Ordering::Relaxed);
        self.dedup.not_held.fetch_add(missing.len() as u64, Ordering::Relaxed);
        for (&i, outcome) in missing.iter().zip(put_some(link, keys, &pages, &missing).await?) {
            outcomes[i] = outcome;
        }
        Ok(outcomes)
    }
}

/// What a client computes of a page to ask a node's summary whether the node holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Digest {
    /// The page's CRC-32C.
    crc: u32,
    /// Its key in a node's summary (`fallow_core::content::page_dedup_key`).
    key: u64,
    /// Its pool's trust domain.
    domain: TrustDomain,
}

impl Digest {
    /// The page's content hash (`fallow_core::content::content_hash`), for a put by hash.
    fn content_hash(&self, page: &[u8]) -> u128 {
        domain_content_hash(page, self.domain)
    }
}

/// The digest of a page that a node could hold as a shared content: not a fill page
/// (nodes keep those without a frame, never in a summary), in a pool that dedups.
fn digest(page: &[u8], scope: DedupScope) -> Option<Digest> {
    let DedupScope::Domain(domain) = scope else { return None };
    if fill_word(page).is_some() {
        return None;
    }
    let crc = checksum(page);
    let key = page_dedup_key(crc, scope)?;
    Some(Digest { crc, key, domain })
}

/// Where a private page goes, given its rendezvous owners (one for an ephemeral page, two
/// for a persistent one): owners that hold its content first, then other candidates that
/// hold it (in the view's order, so that the choice is stable), then the other owners.
/// Without a digest, the owners.
pub(crate) fn prefer_holders(
    view: &View,
    candidates: &[Candidate],
    owners: [Option<Slot>; 2],
    digest: Option<Digest>,
) -> [Option<Slot>; 2] {
    let Some(digest) = digest else { return owners };
    let holds =
        |slot: Slot| view.node(slot).is_some_and(|n| n.link.content.lock().contains(digest.key));
    let wanted = owners.iter().filter(|o| o.is_some()).count();
    let owners = owners.into_iter().flatten();
    let others = candidates.iter().map(|c| c.slot);
    let mut chosen: Vec<Slot> = Vec::with_capacity(2);
    let order =
        owners.clone().filter(|&s| holds(s)).chain(others.filter(|&s| holds(s))).chain(owners);
    for slot in order {
        if chosen.len() == wanted {
            break;
        }
        if !chosen.contains(&slot) {
            chosen.push(slot);
        }
    }
    [chosen.first().copied(), chosen.get(1).copied()]
}

fn has_repeats(keys: &[PageKey]) -> bool {
    let mut seen = HashSet::with_capacity(keys.len());
    !keys.iter().all(|k| seen.insert((k.pool, k.object, k.index)))
}

/// Puts the pages at `positions` of a batch, as bytes.
async fn put_some(
    link: &NodeLink,
    keys: &[PageKey],
    pages: &Bytes,
    positions: &[usize],
) -> Result<Vec<PutOutcome>, ClientError> {
    if positions.is_empty() {
        return Ok(Vec::new());
    }
    let keys: Vec<PageKey> = positions.iter().map(|&i| keys[i]).collect();
    let mut data = BytesMut::with_capacity(positions.len() * PAGE_SIZE);
    for &i in positions {
        data.extend_from_slice(&pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
    }
    link.client.put_many(&keys, data.freeze()).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use fallow_core::{PoolId, TrustDomain};

    #[test]
    fn only_non_fill_pages_of_dedup_pools_have_digests() {
        let scope = DedupScope::Domain(TrustDomain(3));
        let mut page = vec![7u8; PAGE_SIZE];
        page[0] = 8;
        let crc = checksum(&page);
        let key = page_dedup_key(crc, scope).unwrap();
        let d = digest(&page, scope).unwrap();
        assert_eq!(d, Digest { crc, key, domain: TrustDomain(3) });
        let hash = fallow_core::content::content_hash(&page, scope).unwrap();
        assert_eq!(d.content_hash(&page), hash);
        assert_eq!(digest(&page, DedupScope::Off), None);
        assert_eq!(digest(&vec![0; PAGE_SIZE], scope), None);
    }

    #[test]
    fn repeated_keys_are_found() {
        let k = |i| PageKey::new(PoolId(1), 0, i);
        assert!(!has_repeats(&[k(1), k(2), k(3)]));
        assert!(has_repeats(&[k(1), k(2), k(1)]));
    }
}
