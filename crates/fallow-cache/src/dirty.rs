//! The dirty set of a write-back export: pages acknowledged to the client but not yet in
//! the backing store. They live in this process's heap (never in a pool, which may drop
//! them), and every read looks here first.
//!
//! # Locking
//! `pages` is a `parking_lot` mutex held for one map operation. `flushing` is a tokio
//! mutex held across a whole write-back pass, so that passes do not interleave and a FLUSH
//! waits for the pass under way, and across a discard (TRIM, WRITE_ZEROES) from its
//! write-back to its store operation's end, so that no pass writes a page while the store
//! discards it. Lock order: `flushing` → the coherence gates → `pages`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::sync::{Mutex as AsyncMutex, MutexGuard};

use fallow_core::PAGE_SIZE;

#[derive(Debug)]
struct Entry {
    data: Bytes,
    /// Bumped by every write of the page: a write-back forgets the page only if no newer
    /// write came while it was being written.
    version: u64,
    since: Instant,
}

#[derive(Debug, Default)]
struct Pages {
    map: BTreeMap<u64, Entry>,
    next_version: u64,
}

/// Dirty pages by page number.
#[derive(Debug, Default)]
pub(crate) struct DirtySet {
    pages: Mutex<Pages>,
    flushing: AsyncMutex<()>,
}

impl DirtySet {
    pub(crate) fn get(&self, page: u64) -> Option<Bytes> {
        self.pages.lock().map.get(&page).map(|e| e.data.clone())
    }

    /// Makes `page` dirty with `data` (a copy of it: [`crate::local::own`]).
    pub(crate) fn insert(&self, page: u64, data: Bytes) {
        let data = crate::local::own(&data);
        let mut pages = self.pages.lock();
        pages.next_version += 1;
        let version = pages.next_version;
        let since = pages.map.get(&page).map_or_else(Instant::now, |e| e.since);
        pages.map.insert(page, Entry { data, version, since });
    }

    /// Zeroes bytes `start..end` of `page` if it is dirty, as a new version (a write-back
    /// under way that took the older one leaves the page dirty).
    pub(crate) fn zero(&self, page: u64, start: usize, end: usize) {
        let mut guard = self.pages.lock();
        let pages = &mut *guard;
        if let Some(entry) = pages.map.get_mut(&page) {
            pages.next_version += 1;
            let version = pages.next_version;
            let mut data = BytesMut::from(&entry.data[..]);
            if let Some(bytes) = data.get_mut(start..end) {
                bytes.fill(0);
            }
            entry.data = data.freeze();
            entry.version = version;
        }
    }

    /// Forgets `page` if it is still at `version`.
    pub(crate) fn clean(&self, page: u64, version: u64) {
        let mut pages = self.pages.lock();
        if pages.map.get(&page).is_some_and(|e| e.version == version) {
            pages.map.remove(&page);
        }
    }

    /// The dirty pages (all, or those in `only`), in page order, with their versions.
    pub(crate) fn snapshot(&self, only: Option<&[u64]>) -> Vec<(u64, Bytes, u64)> {
        let pages = self.pages.lock();
        match only {
            None => pages.map.iter().map(|(p, e)| (*p, e.data.clone(), e.version)).collect(),
            Some(wanted) => {
                let mut out: Vec<(u64, Bytes, u64)> = wanted
                    .iter()
                    .filter_map(|p| pages.map.get(p).map(|e| (*p, e.data.clone(), e.version)))
                    .collect();
                out.sort_by_key(|(p, _, _)| *p);
                out.dedup_by_key(|(p, _, _)| *p);
                out
            }
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        (self.pages.lock().map.len() * PAGE_SIZE) as u64
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pages.lock().map.is_empty()
    }

    pub(crate) fn oldest_age(&self) -> Option<Duration> {
        self.pages.lock().map.values().map(|e| e.since).min().map(|t| t.elapsed())
    }

    pub(crate) async fn flushing(&self) -> MutexGuard<'_, ()> {
        self.flushing.lock().await
    }
}
