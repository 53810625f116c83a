//! The put path: a put's work without locks ([`Prepared`]), then under its shard and the
//! store, with eviction and reclaim from other shards when the budget is spent. A new
//! page's bytes are copied into its frame with the store let go, and the page enters the
//! dedup table after (`docs/concurrency.md`).

use std::sync::atomic::Ordering;

use parking_lot::MutexGuard;

use fallow_core::{
    check_batch, check_page, DedupScope, HashPutOutcome, NotStored, PageKey, PutOutcome,
    StoreError, PAGE_SIZE,
};

use super::Inner;
use crate::arena::ArenaFull;
use crate::content::{fill_word, Digest};
use crate::hashing::key_hash;
use crate::journal::Record;
use crate::pools::{self, Counter, PoolMap, PoolState};
use crate::shard::{Shard, Slot, Value};
use crate::store::{InternOptions, Interned, Store};

/// Why a put under the shard lock could not finish.
enum PutFail {
    /// This shard had nothing left to evict; others may.
    NeedReclaim,
    Refused(NotStored),
    /// A put by hash found no such content.
    NotHeld,
}

/// Where a put's bytes come from.
#[derive(Clone, Copy)]
enum Source<'a> {
    /// The caller's page.
    Page(&'a [u8]),
    /// A content the store already holds, named by its content hash and the digest (a
    /// put by hash).
    Held(u128),
}

/// A put with everything computed that needs no lock.
struct Prepared<'a> {
    key: PageKey,
    source: Source<'a>,
    /// Borrowed from the pool snapshot the caller loaded for the whole put.
    pool: &'a PoolState,
    fill: Option<u64>,
    digest: Digest,
    hash: u64,
    shard: usize,
}

impl<'a> Prepared<'a> {
    fn new(key: PageKey, page: &'a [u8], pool: &'a PoolState, inner: &Inner) -> Self {
        let fill = fill_word(page);
        let digest = Digest::of_unless_fill(page, fill, pool.dedup);
        let hash = key_hash(&key);
        let source = Source::Page(page);
        Self { key, source, fill, digest, hash, shard: inner.shard_of(&key), pool }
    }

    fn by_hash(key: PageKey, content: u128, crc: u32, pool: &'a PoolState, inner: &Inner) -> Self {
        let digest = Digest::of_checksum(crc, pool.dedup);
        let hash = key_hash(&key);
        let source = Source::Held(content);
        Self { key, source, fill: None, digest, hash, shard: inner.shard_of(&key), pool }
    }
}

impl Inner {
    /// Evicts one ephemeral page of `shard`. False when it has none.
    fn evict_one(&self, shard: &mut Shard, store: &mut Store) -> bool {
        let Some(victim) = shard.evict_one() else { return false };
        let pools = self.pool_snapshot.load();
        let state = pools::find(&pools, victim.key.pool).ok();
        if let Some(state) = state {
            state.counters.bump(Counter::Evictions);
        }
        self.release(store, &victim, state.map(|s| &s.counters));
        true
    }

    /// Evicts from every shard but `except` until the store has room for a frame.
    fn reclaim_elsewhere(&self, except: usize) -> bool {
        let n = self.shards.len();
        for i in (1..n).map(|d| (except + d) % n) {
            let mut shard = self.shards[i].lock();
            let mut store = self.store.write();
            while !store.has_room() {
                if !self.evict_one(&mut shard, &mut store) {
                    break;
                }
            }
            if store.has_room() {
                return true;
            }
        }
        false
    }

    pub(super) fn put(&self, key: PageKey, page: &[u8]) -> Result<PutOutcome, StoreError> {
        check_page(page.len())?;
        let pools = self.pool_snapshot.load();
        let job = Prepared::new(key, page, pools::find(&pools, key.pool)?, self);
        let mut shard = self.shards[job.shard].lock();
        Ok(page_outcome(self.put_one(&mut shard, &job)?))
    }

    /// A batched put: the digests are computed before any lock, and each shard is locked
    /// once for all of its keys (in batch order, so a key put twice keeps the last page).
    pub(super) fn put_many(
        &self,
        keys: &[PageKey],
        pages: &[u8],
    ) -> Result<Vec<PutOutcome>, StoreError> {
        check_batch(keys.len(), pages.len())?;
        let pools = self.pool_snapshot.load();
        let jobs =
            self.prepare(&pools, keys, pages.chunks_exact(PAGE_SIZE), |key, page, pool| {
                Prepared::new(key, page, pool, self)
            })?;
        Ok(self.put_jobs(&jobs)?.into_iter().map(page_outcome).collect())
    }

    /// Puts by content hash: `contents[i]` is the hash and checksum of the page for
    /// `keys[i]`. Each is stored only if the store holds a live page with that hash and
    /// checksum that the key's pool may share (its dedup scope is on).
    pub(super) fn put_many_by_hash(
        &self,
        keys: &[PageKey],
        contents: &[(u128, u32)],
    ) -> Result<Vec<HashPutOutcome>, StoreError> {
        if keys.len() != contents.len() {
            return Err(StoreError::BadLength { got: contents.len(), expected: keys.len() });
        }
        let pools = self.pool_snapshot.load();
        let jobs = self.prepare(&pools, keys, contents.iter(), |key, &(content, crc), pool| {
            Prepared::by_hash(key, content, crc, pool, self)
        })?;
        self.put_jobs(&jobs)
    }

    /// Prepares one job per key, its pool borrowed from `snapshot`.
    fn prepare<'a, T>(
        &self,
        snapshot: &'a PoolMap,
        keys: &[PageKey],
        items: impl Iterator<Item = T>,
        make: impl Fn(PageKey, T, &'a PoolState) -> Prepared<'a>,
    ) -> Result<Vec<Prepared<'a>>, StoreError> {
        let mut jobs = Vec::with_capacity(keys.len());
        for (key, item) in keys.iter().zip(items) {
            jobs.push(make(*key, item, pools::find(snapshot, key.pool)?));
        }
        Ok(jobs)
    }

    /// Runs prepared puts, locking each shard once for all of its keys.
    fn put_jobs(&self, jobs: &[Prepared<'_>]) -> Result<Vec<HashPutOutcome>, StoreError> {
        let mut order: Vec<usize> = (0..jobs.len()).collect();
        order.sort_by_key(|&i| jobs[i].shard); // stable: batch order within a shard
        let mut outcomes = vec![HashPutOutcome::NotStored(NotStored::Full); jobs.len()];
        for group in order.chunk_by(|&a, &b| jobs[a].shard == jobs[b].shard) {
            let mut shard = self.shards[jobs[group[0]].shard].lock();
            for &i in group {
                outcomes[i] = self.put_one(&mut shard, &jobs[i])?;
            }
        }
        Ok(outcomes)
    }

    /// One put with its shard locked. When the shard has nothing left to evict, the lock is
    /// released while room is taken from the other shards (the lock order forbids holding
    /// two shards), then taken again for one more try.
    fn put_one(
        &self,
        shard: &mut MutexGuard<'_, Shard>,
        job: &Prepared<'_>,
    ) -> Result<HashPutOutcome, StoreError> {
        let mut result = self.put_locked(shard, job);
        if matches!(result, Ok(Err(PutFail::NeedReclaim))) {
            let reclaimed = MutexGuard::unlocked(shard, || self.reclaim_elsewhere(job.shard));
            result = if reclaimed {
                self.put_locked(shard, job)
            } else {
                Ok(Err(PutFail::Refused(NotStored::Full)))
            };
        }
        let outcome = match result? {
            Ok(()) => HashPutOutcome::Stored,
            Err(PutFail::NeedReclaim) => HashPutOutcome::NotStored(NotStored::Full),
            Err(PutFail::Refused(why)) => HashPutOutcome::NotStored(why),
            Err(PutFail::NotHeld) => HashPutOutcome::NotHeld,
        };
        match outcome {
            HashPutOutcome::Stored => job.pool.counters.bump(Counter::PutsStored),
            HashPutOutcome::NotStored(_) => job.pool.counters.bump(Counter::PutsRefused),
            // Not a refusal: the caller sends the page next.
            HashPutOutcome::NotHeld => {}
        }
        Ok(outcome)
    }

    /// The part of a put that runs under the shard lock (and takes the store lock), and
    /// for a persistent pool its journal record, in the same hold of the lock: the page
    /// when stored, `Gone` when refused (the key's older page went all the same).
    fn put_locked(
        &self,
        shard: &mut MutexGuard<'_, Shard>,
        job: &Prepared<'_>,
    ) -> Result<Result<(), PutFail>, StoreError> {
        let mut replaced = false;
        let result = self.put_unjournaled(shard, job, &mut replaced);
        if job.pool.persistent() && shard.journal.is_some() {
            let page = match job.source {
                Source::Page(page) => Some(page),
                Source::Held(_) => None,
            };
            match &result {
                Ok(Ok(())) => {
                    // The stored checksum is the page's CRC-32C masked by its domain.
                    let crc = job.digest.sum ^ job.pool.mask;
                    let (key, hash, mask) = (job.key, job.hash, job.pool.mask);
                    self.journal_stored(shard, key, hash, page, crc, mask, replaced)
                }
                // Not held: nothing changed.
                Ok(Err(PutFail::NotHeld)) => {}
                Ok(Err(_)) => self.journal(shard, Record::Gone(job.key), -i64::from(replaced)),
                // The pool is gone: its `PoolGone` records say so.
                Err(_) => {}
            }
        }
        result
    }

    /// [`Inner::put_locked`] without the journal; `replaced` is set when the key's older
    /// page was removed.
    fn put_unjournaled(
        &self,
        shard: &mut MutexGuard<'_, Shard>,
        job: &Prepared<'_>,
        replaced: &mut bool,
    ) -> Result<Result<(), PutFail>, StoreError> {
        let Prepared { key, source, pool, fill, digest, hash, .. } = *job;
        // Checked under the shard lock: a destroy marks the pool dead before it sweeps this
        // shard, so a put that gets here first is swept and one that comes later stops here.
        if !pool.alive.load(Ordering::Acquire) {
            return Err(StoreError::UnknownPool(key.pool));
        }
        let mut store = self.store.write();
        let persistent = pool.persistent();
        let opts = InternOptions { pinned: persistent, compressible: pool.spec.compress };
        // A put by hash takes its reference first: before the key's old page is released
        // (the same content put again under its key must not free itself) and before
        // anything is evicted to make room.
        let held = match (source, pool.dedup) {
            (Source::Page(_), _) => Ok(None),
            (Source::Held(content), scope @ DedupScope::Domain(_)) => {
                store.share(content, digest.sum, scope, opts).map(Some).ok_or(PutFail::NotHeld)
            }
            (Source::Held(_), DedupScope::Off) => Err(PutFail::NotHeld),
        };
        // A put by hash of a content not held changes nothing: the caller sends the page
        // next, and until then the key's older page stays (a get meanwhile reads it).
        let held = match held {
            Ok(held) => held,
            Err(fail) => return Ok(Err(fail)),
        };
        // The old page goes, whatever happens next: a refused put must not leave an older
        // page visible.
        if let Some((id, _)) = shard.lookup(&key, hash) {
            let old = shard.remove(id);
            self.release(&mut store, &old, Some(&pool.counters));
            *replaced = true;
        }
        let refusal = self.make_room(shard, &mut store, pool, persistent);
        if let Some(why) = refusal {
            if let Some(id) = held {
                store.release(id);
            }
            return Ok(Err(PutFail::Refused(why)));
        }
        let mut new = None;
        let value = match (fill, source, held) {
            (Some(word), _, _) => Value::Fill(word),
            (None, Source::Held(_), Some(id)) => Value::Content(id),
            (None, Source::Held(_), None) => unreachable!("a put by hash without its content"),
            (None, Source::Page(page), _) => loop {
                match store.intern(page, digest, opts) {
                    Ok(Interned::Shared(id)) => break Value::Content(id),
                    Ok(Interned::New(content)) => {
                        let id = content.id();
                        new = Some((content, page));
                        break Value::Content(id);
                    }
                    Err(ArenaFull::AtLimit) => {
                        if !self.evict_one(shard, &mut store) {
                            return Ok(Err(PutFail::NeedReclaim));
                        }
                    }
                    Err(ArenaFull::MapFailed) => return Ok(Err(PutFail::Refused(NotStored::Full))),
                }
            },
        };
        // A new content's bytes are copied with the store let go, so that gets (and puts
        // that share) go on meanwhile; then it joins the dedup table.
        drop(store);
        if let Some((content, page)) = &new {
            // SAFETY: we hold this shard's lock from `intern` until `publish`, and the
            // content is not published yet; see `NewContent::fill`.
            unsafe { content.fill(page) };
        }
        shard.insert(Slot { key, value, persistent }, hash);
        if let Some((content, _)) = new.filter(|(content, _)| content.shareable()) {
            self.store.write().publish(content);
        }
        pool.counters.bump(Counter::Pages);
        if fill.is_some() {
            pool.counters.bump(Counter::FillPages);
        }
        Ok(Ok(()))
    }

    /// Checks the pool's quota and evicts until the shard may hold one more entry; the
    /// reason when it cannot.
    fn make_room(
        &self,
        shard: &mut Shard,
        store: &mut Store,
        pool: &PoolState,
        persistent: bool,
    ) -> Option<NotStored> {
        if persistent {
            if let Some(quota) = pool.spec.quota_pages {
                if pool.counters.get(Counter::Pages) >= quota {
                    return Some(NotStored::OverQuota);
                }
            }
        }
        let max_entries = self.entries_per_shard.load(Ordering::Relaxed);
        while shard.len() >= max_entries {
            if !self.evict_one(shard, store) {
                return Some(NotStored::Full);
            }
        }
        None
    }
}

/// A put of a page's bytes is never answered "not held".
fn page_outcome(outcome: HashPutOutcome) -> PutOutcome {
    match outcome {
        HashPutOutcome::Stored => PutOutcome::Stored,
        HashPutOutcome::NotStored(why) => PutOutcome::NotStored(why),
        HashPutOutcome::NotHeld => unreachable!("a put with bytes needs no held content"),
    }
}
