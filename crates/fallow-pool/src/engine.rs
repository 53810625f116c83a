//! The engine: pools, the sharded index and the content store behind one [`PageStore`].
//!
//! ```text
//!  put(key, page) ─ fill? hash, crc ─▶ shard ─▶ store: frame ─▶ copy in ─▶ store: dedup table
//!  get(key)       ─────────────────▶ shard ─▶ store: where ─▶ copy out ─▶ (shard let go) crc check
//! ```
//!
//! # Locking
//! Lock order: `shards[i]` (ascending `i` when several are held) → `store` (read or write)
//! → `pools` (read, for validation). Operations find their pool in `pool_snapshot`, with
//! no lock. A get copies its frame with only its shard held; whatever moves or drops page
//! bytes that entries name holds every shard (`store::HeldFrame`). None is held across a
//! call back into user code. See `docs/concurrency.md`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard, RwLock, RwLockWriteGuard};

use fallow_core::{
    check_batch, check_page, DedupScope, HashPutOutcome, Lookup, NotStored, ObjectId, PageKey,
    PageStore, PoolId, PoolSpec, PutOutcome, StoreError, PAGE_SIZE,
};

use crate::arena::ArenaFull;
use crate::compress::Compressor;
use crate::config::{EngineConfig, MAX_BUDGET_BYTES};
use crate::content::{checksum, fill_word, write_fill, Digest};
use crate::eviction::{self, SlotId};
use crate::pools::{self, Counter, PoolCounters, PoolMap, PoolSnapshot, PoolState, PoolTable};
use crate::shard::{key_hash, Shard, Slot, Value};
use crate::stats::{BudgetReport, EngineStats, MemoryUsage, PoolStats};
use crate::store::{InternOptions, Interned, Located, Read, ShrinkReport, Store};
use crate::sweep::{SweepReport, SweepState};

/// Segments released per store-lock hold when shrinking: one extent, so that a step
/// usually empties one mapping (one `munmap`, after the lock). Bounds how long a get can
/// wait behind a shrink: each segment costs a scan of its 512 owner slots, plus any
/// persistent pages it moves.
const SHRINK_STEP_SEGMENTS: usize = crate::arena::EXTENT_SEGMENTS;

/// The in-process page pool. Cheap to share: clone the `Arc` it lives in.
pub struct Engine {
    inner: Arc<Inner>,
    /// Stops and joins the background compressor when the engine is dropped.
    _compressor: Option<Compressor>,
}

pub(crate) struct Inner {
    /// The pool table (see `pools.rs` for its lock rules): taken by creation, destruction
    /// and stats; operations read `pool_snapshot` instead.
    pub(crate) pools: RwLock<PoolTable>,
    /// The live pools as of the last change of `pools`, published under its write lock.
    pub(crate) pool_snapshot: PoolSnapshot,
    /// Index shards, chosen by the high bits of the key hash. `parking_lot` mutexes: each is
    /// held for one index operation (with a get's copy of its page) and never across
    /// blocking work; all of them by a shrink step and a compression pass.
    pub(crate) shards: Box<[Mutex<Shard>]>,
    /// Page bytes, checksums, dedup table. Taken after a shard lock: for reading by a get's
    /// lookup of its frame (several at once; the copy comes after), for writing by
    /// everything that changes the store (a put's copy in, a release, a compression pass, a
    /// shrink step).
    pub(crate) store: RwLock<Store>,
    /// The most index entries one shard may hold.
    entries_per_shard: AtomicUsize,
    /// The background removal of dropped pages' index entries (`sweep.rs`).
    pub(crate) sweep: SweepState,
    config: EngineConfig,
}

/// What a get or take found under its shard lock.
#[derive(Debug, Clone, Copy)]
enum Copied {
    Miss,
    /// The page is in the caller's buffer (a fill page, or a take's checked copy).
    Hit,
    /// A get's copy, to be checked against this CRC-32C once the shard is let go.
    Unchecked(u32),
}

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
    /// A content the store already holds, named by the digest (a put by hash).
    Held,
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
        let digest = Digest::of_unless_fill(page, fill, pool.spec.dedup);
        let hash = key_hash(&key);
        let source = Source::Page(page);
        Self { key, source, fill, digest, hash, shard: inner.shard_of(hash), pool }
    }

    fn by_hash(key: PageKey, content: u128, crc: u32, pool: &'a PoolState, inner: &Inner) -> Self {
        let digest = Digest { hash: Some(content), crc };
        let hash = key_hash(&key);
        let source = Source::Held;
        Self { key, source, fill: None, digest, hash, shard: inner.shard_of(hash), pool }
    }
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

impl Engine {
    /// Starts an engine (and its compressor thread, if configured).
    pub fn new(config: EngineConfig) -> Self {
        let frames = config.budget_bytes / PAGE_SIZE;
        let per_shard = frames.div_ceil(config.shards).max(1);
        let shards = eviction::for_shards(config.policy, per_shard, config.shards)
            .expect("config.policy was validated by EngineBuilder::build")
            .into_iter()
            .map(|policy| {
                let mut shard = Shard::new(policy);
                shard.expect(per_shard);
                Mutex::new(shard)
            })
            .collect();
        let inner = Arc::new(Inner {
            pools: RwLock::new(PoolTable::default()),
            pool_snapshot: PoolSnapshot::default(),
            shards,
            store: RwLock::new(Store::new(config.budget_bytes)),
            entries_per_shard: AtomicUsize::new(per_shard * config.entries_per_frame),
            sweep: SweepState::default(),
            config,
        });
        let compressor = inner
            .config
            .compress_interval
            .map(|every| Compressor::start(inner.clone(), every, inner.config.compress_batch));
        tracing::info!(
            budget_bytes = inner.config.budget_bytes,
            shards = inner.config.shards,
            policy = inner.config.policy,
            "page pool engine started"
        );
        Self { inner, _compressor: compressor }
    }

    /// The configuration this engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Changes the lent budget while running. Growing maps segments on demand; shrinking
    /// returns whole segments to the OS, a few per hold of the store lock, dropping the
    /// ephemeral pages in them. Persistent pages are never dropped: when they alone exceed
    /// the new budget, the report says by how many frames (`pinned_over_budget`) and a
    /// warning is logged.
    ///
    /// A budget above [`MAX_BUDGET_BYTES`] is lowered to it (and a warning logged).
    pub fn set_budget(&self, budget_bytes: usize) -> BudgetReport {
        let start = Instant::now();
        if budget_bytes > MAX_BUDGET_BYTES {
            tracing::warn!(
                budget_bytes,
                MAX_BUDGET_BYTES,
                "budget lowered to the most one engine can address"
            );
        }
        let budget_bytes = budget_bytes.min(MAX_BUDGET_BYTES);
        let mut shrink = ShrinkReport::default();
        let mut longest_hold = std::time::Duration::ZERO;
        let mut plan = {
            let mut store = self.inner.store.write();
            store.set_budget(budget_bytes);
            store.shrink_plan()
        };
        loop {
            // Every shard, then the store: a step moves and drops the bytes of pages that
            // index entries name, which no get may be copying meanwhile (`HeldFrame`).
            let shards = self.inner.lock_all_shards();
            let held = Instant::now();
            let mut store = self.inner.store.write();
            let (extents, more) = store.shrink_step(&mut plan, SHRINK_STEP_SEGMENTS, &mut shrink);
            longest_hold = longest_hold.max(held.elapsed());
            // Fair unlocks hand each lock to a get waiting for it, which would otherwise
            // find it taken again by the next step before its thread got to run.
            RwLockWriteGuard::unlock_fair(store);
            shards.into_iter().for_each(MutexGuard::unlock_fair);
            // Unmapped here, with no lock held: freeing the pages is the kernel's slowest
            // part of giving memory back, and no reader has to wait for it.
            drop(extents);
            if !more {
                break;
            }
        }
        let elapsed = start.elapsed();
        // The index entries of the pages just dropped go in the background, not when each
        // is next read: until then they would count as pages and keep their metadata.
        if shrink.contents_dropped > 0 {
            self.inner.sweep_if_worth_it();
        }
        let frames = budget_bytes / PAGE_SIZE;
        let per_shard = frames.div_ceil(self.inner.shards.len()).max(1);
        self.inner
            .entries_per_shard
            .store(per_shard * self.inner.config.entries_per_frame, Ordering::Relaxed);
        for shard in self.inner.shards.iter() {
            shard.lock().set_capacity(per_shard);
        }
        if shrink.pinned_over_budget > 0 {
            tracing::warn!(
                budget_bytes,
                pinned_frames_over = shrink.pinned_over_budget,
                "persistent pages hold more than the new budget; they are kept"
            );
        }
        tracing::info!(budget_bytes, ?shrink, ?elapsed, ?longest_hold, "lent budget changed");
        BudgetReport { shrink, elapsed, longest_hold }
    }

    /// Removes, now, the index entries of pages whose bytes are gone (dropped by a shrink,
    /// or found corrupt through another key). `set_budget` starts the same sweep on a
    /// thread of its own after every shrink that dropped pages, and a read removes such an
    /// entry when it finds one; this is for callers that want it done before they go on.
    pub fn sweep_dropped(&self) -> SweepReport {
        self.inner.sweep_dropped()
    }

    /// Compresses up to `max` cold pages of pools with compression on, now. Returns how
    /// many were compressed. The background thread calls this periodically.
    pub fn compress_cold(&self, max: usize) -> usize {
        self.inner.compress_pass(max)
    }

    /// Stores pages by content hash instead of bytes (dedup across nodes: a client that
    /// knows this engine holds a page's content sends its hash): `contents[i]` is the
    /// [`fallow_core::content::content_hash`] and [`fallow_core::content::checksum`] of
    /// the page meant for `keys[i]`. A key whose content is not held, or whose pool does
    /// not dedup, is answered [`HashPutOutcome::NotHeld`] and holds no page afterwards.
    pub fn put_many_by_hash(
        &self,
        keys: &[PageKey],
        contents: &[(u128, u32)],
    ) -> Result<Vec<HashPutOutcome>, StoreError> {
        self.inner.put_many_by_hash(keys, contents)
    }

    /// Counters and memory use, for the engine and each pool.
    pub fn stats(&self) -> EngineStats {
        self.inner.stats()
    }

    /// Memory held for pages, under the store lock only.
    pub fn memory(&self) -> MemoryUsage {
        let usage = self.inner.store.read().usage();
        MemoryUsage {
            budget_bytes: usage.budget_bytes,
            mapped_bytes: usage.mapped_bytes,
            frames_used: usage.frames_used,
            compressed_bytes: usage.compressed_bytes,
        }
    }

    /// Counters of one pool.
    pub fn pool_stats(&self, pool: PoolId) -> Result<PoolStats, StoreError> {
        let state = self.inner.pools.read().get(pool)?;
        Ok(PoolStats::of(pool, &state))
    }

    /// Checks every invariant of the index, the policies, the store and the arena, and
    /// panics on the first broken one. Locks everything: for tests and debug builds.
    pub fn validate(&self) {
        self.inner.validate();
    }

    pub(crate) fn inner(&self) -> &Inner {
        &self.inner
    }
}

impl Inner {
    /// The pool `id`, shared: for the long operations (invalidating an object or a pool
    /// walks every shard), which should not pin a snapshot meanwhile. The others borrow
    /// their pool from a `pool_snapshot` guard for their few microseconds.
    fn pool(&self, id: PoolId) -> Result<Arc<PoolState>, StoreError> {
        let pools = self.pool_snapshot.load();
        pools.get(&id).cloned().ok_or(StoreError::UnknownPool(id))
    }

    fn shard_of(&self, hash: u64) -> usize {
        // The shard count is a power of two; the high bits are independent of the low bits
        // some policies use for their own tables.
        (hash >> 48) as usize & (self.shards.len() - 1)
    }

    /// Every shard's lock, in ascending order. Taken, before the store's write lock, by
    /// the steps that move or drop the bytes of contents that index entries still name (a
    /// shrink step, a compression pass): a get copies a frame with only its shard held
    /// (`HeldFrame`), so holding every shard is what keeps those bytes still under it.
    pub(crate) fn lock_all_shards(&self) -> Vec<MutexGuard<'_, Shard>> {
        self.shards.iter().map(|s| s.lock()).collect()
    }

    /// One compression pass of at most `max` cold pages (it replaces their frames).
    pub(crate) fn compress_pass(&self, max: usize) -> usize {
        let _shards = self.lock_all_shards();
        self.store.write().compress_pass(max)
    }

    /// Forgets a removed slot's page: drops its content reference and its pool's count.
    /// `counters` is `None` only when the pool is being destroyed: nobody reads them then.
    pub(crate) fn release(&self, store: &mut Store, slot: &Slot, counters: Option<&PoolCounters>) {
        if let Value::Content(id) = slot.value {
            store.release(id);
        }
        let Some(counters) = counters else { return };
        counters.drop_one(Counter::Pages);
        if matches!(slot.value, Value::Fill(_)) {
            counters.drop_one(Counter::FillPages);
        }
    }

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

    fn put(&self, key: PageKey, page: &[u8]) -> Result<PutOutcome, StoreError> {
        check_page(page.len())?;
        let pools = self.pool_snapshot.load();
        let job = Prepared::new(key, page, pools::find(&pools, key.pool)?, self);
        let mut shard = self.shards[job.shard].lock();
        Ok(page_outcome(self.put_one(&mut shard, &job)?))
    }

    /// A batched put: the digests are computed before any lock, and each shard is locked
    /// once for all of its keys (in batch order, so a key put twice keeps the last page).
    fn put_many(&self, keys: &[PageKey], pages: &[u8]) -> Result<Vec<PutOutcome>, StoreError> {
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
    fn put_many_by_hash(
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

    /// The part of a put that runs under the shard lock (and takes the store lock).
    fn put_locked(
        &self,
        shard: &mut MutexGuard<'_, Shard>,
        job: &Prepared<'_>,
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
        let held = match (source, digest.hash, pool.spec.dedup) {
            (Source::Page(_), _, _) => Ok(None),
            (Source::Held, Some(content), scope @ DedupScope::Domain(_)) => {
                store.share(content, digest.crc, scope, opts).map(Some).ok_or(PutFail::NotHeld)
            }
            (Source::Held, _, _) => Err(PutFail::NotHeld),
        };
        // The old page goes, whatever happens next: a refused put must not leave an older
        // page visible.
        if let Some((id, _)) = shard.lookup(&key, hash) {
            let old = shard.remove(id);
            self.release(&mut store, &old, Some(&pool.counters));
        }
        let held = match held {
            Ok(held) => held,
            Err(fail) => return Ok(Err(fail)),
        };
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
            (None, Source::Held, Some(id)) => Value::Content(id),
            (None, Source::Held, None) => unreachable!("a put by hash without its content"),
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

    fn get(&self, key: PageKey, out: &mut [u8], remove: bool) -> Result<Lookup, StoreError> {
        check_page(out.len())?;
        let pools = self.pool_snapshot.load();
        let pool = pools::find(&pools, key.pool)?;
        let hash = key_hash(&key);
        let found = {
            let mut shard = self.shards[self.shard_of(hash)].lock();
            self.read_locked(&mut shard, pool, key, hash, out, remove)
        };
        let found = self.check_copy(found, pool, key, hash, out);
        pool.counters.bump(if found.is_hit() { Counter::Hits } else { Counter::Misses });
        Ok(found)
    }

    /// A get or take under the shard lock. A get's copy is checked by the caller after it
    /// lets go of the shard ([`Inner::check_copy`]): the checksum costs as much as the
    /// copy, and another thread's operation on this shard need not wait for it. A take
    /// checks under the lock, since its entry goes with it.
    fn read_locked(
        &self,
        shard: &mut Shard,
        pool: &PoolState,
        key: PageKey,
        hash: u64,
        out: &mut [u8],
        remove: bool,
    ) -> Copied {
        let Some((id, slot)) = shard.lookup(&key, hash) else { return Copied::Miss };
        let copied = match slot.value {
            Value::Fill(word) => {
                write_fill(word, out);
                Copied::Hit
            }
            Value::Content(content) => {
                let located = self.store.read().locate(content, out);
                let crc = match located {
                    Located::Frame(frame, crc) => {
                        // SAFETY: we hold this shard's lock, and `slot`, an entry of this
                        // shard, names the content; see `HeldFrame`.
                        unsafe { frame.copy_into(out) };
                        crc
                    }
                    Located::Copied(crc) => crc,
                    Located::Dead => {
                        self.drop_unreadable(shard, pool, id, Read::Dead);
                        return Copied::Miss;
                    }
                };
                if !remove {
                    Copied::Unchecked(crc)
                } else if checksum(out) == crc {
                    Copied::Hit
                } else {
                    // Bound first: the store's guard must be gone before `drop_unreadable`.
                    let judged = self.store.write().read(content, out);
                    if judged != Read::Ok {
                        self.drop_unreadable(shard, pool, id, judged);
                        return Copied::Miss;
                    }
                    Copied::Hit
                }
            }
        };
        if remove {
            let slot = shard.remove(id);
            self.release(&mut self.store.write(), &slot, Some(&pool.counters));
            pool.counters.bump(Counter::Invalidations);
        } else {
            shard.touch(id, hash);
        }
        copied
    }

    /// The end of a get, with no lock held: checks its copy against the checksum found
    /// with it. On a mismatch the key is looked up again and its content judged under the
    /// store lock ([`Store::read`]): a corrupt content is a miss (and counted); one that the
    /// key's entry no longer names was replaced meanwhile, and the key's page now is read
    /// (and checked) under the lock instead.
    fn check_copy(
        &self,
        copied: Copied,
        pool: &PoolState,
        key: PageKey,
        hash: u64,
        out: &mut [u8],
    ) -> Lookup {
        match copied {
            Copied::Miss => return Lookup::Miss,
            Copied::Hit => return Lookup::Hit,
            Copied::Unchecked(crc) if checksum(out) == crc => return Lookup::Hit,
            Copied::Unchecked(_) => {}
        }
        let mut shard = self.shards[self.shard_of(hash)].lock();
        let Some((id, slot)) = shard.lookup(&key, hash) else { return Lookup::Miss };
        let judged = match slot.value {
            Value::Fill(word) => {
                write_fill(word, out);
                Read::Ok
            }
            Value::Content(content) => self.store.write().read(content, out),
        };
        if judged != Read::Ok {
            self.drop_unreadable(&mut shard, pool, id, judged);
            return Lookup::Miss;
        }
        Lookup::Hit
    }

    /// Removes the entry `id` of a page that could not be read: its bytes were dropped
    /// (counted as an eviction) or corrupt (counted as a corruption).
    fn drop_unreadable(&self, shard: &mut Shard, pool: &PoolState, id: SlotId, judged: Read) {
        let counter = match judged {
            Read::Corrupt => Counter::Corruptions,
            _ => Counter::Evictions,
        };
        pool.counters.bump(counter);
        let slot = shard.remove(id);
        self.release(&mut self.store.write(), &slot, Some(&pool.counters));
    }

    fn invalidate_page(&self, key: PageKey) -> Result<(), StoreError> {
        let pools = self.pool_snapshot.load();
        let pool = pools::find(&pools, key.pool)?;
        let hash = key_hash(&key);
        let mut shard = self.shards[self.shard_of(hash)].lock();
        if let Some((id, _)) = shard.lookup(&key, hash) {
            let slot = shard.remove(id);
            self.release(&mut self.store.write(), &slot, Some(&pool.counters));
            pool.counters.bump(Counter::Invalidations);
        }
        Ok(())
    }

    /// Removes every page of `pool` (of `object` only, when given), shard by shard.
    fn invalidate_pages(
        &self,
        pool: PoolId,
        counters: &PoolCounters,
        object: Option<ObjectId>,
    ) -> u64 {
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let ids = match object {
                Some(object) => shard.object_pages(pool, object),
                None => shard.pool_pages(pool),
            };
            if ids.is_empty() {
                continue;
            }
            let mut store = self.store.write();
            for id in ids {
                let slot = shard.remove(id);
                self.release(&mut store, &slot, Some(counters));
                removed += 1;
            }
        }
        counters.add(Counter::Invalidations, removed);
        removed
    }

    fn destroy_pool(&self, id: PoolId) -> Result<(), StoreError> {
        let last = {
            let mut table = self.pools.write();
            let last = table.detach(id)?;
            self.pool_snapshot.publish(&table);
            last
        };
        if let Some(state) = last {
            let removed = self.invalidate_pages(id, &state.counters, None);
            tracing::debug!(pool = id.0, removed, "pool destroyed");
        }
        Ok(())
    }

    fn stats(&self) -> EngineStats {
        let mut metadata = 0;
        let mut policy = "";
        let mut small_share = None;
        for shard in self.shards.iter() {
            let shard = shard.lock();
            metadata += shard.heap_bytes();
            policy = shard.policy_name();
            small_share = shard.small_share();
        }
        let usage = self.store.read().usage();
        let pools: Vec<PoolStats> =
            self.pools.read().all().iter().map(|(id, s)| PoolStats::of(*id, s)).collect();
        let mut stats = EngineStats::new(usage, metadata, self.shards.len(), policy, pools);
        stats.small_share_percent =
            small_share.map(|s| (s * 100.0).round().clamp(0.0, 100.0) as u8);
        stats
    }

    fn validate(&self) {
        let shards: Vec<_> = self.shards.iter().map(|s| s.lock()).collect();
        let store = self.store.read();
        let mut refs = std::collections::HashMap::new();
        let mut pages = std::collections::HashMap::<PoolId, u64>::new();
        for shard in &shards {
            shard.validate();
            for (_, slot) in shard.slots() {
                *pages.entry(slot.key.pool).or_default() += 1;
                if let Value::Content(id) = slot.value {
                    *refs.entry(id).or_insert(0u32) += 1;
                }
                let state = self.pools.read().get(slot.key.pool);
                let state = state.unwrap_or_else(|_| panic!("{:?} in an unknown pool", slot.key));
                assert_eq!(
                    slot.persistent,
                    state.persistent(),
                    "{:?} has the wrong kind",
                    slot.key
                );
            }
        }
        store.validate(&refs);
        for (id, state) in self.pools.read().all() {
            let counted = pages.get(&id).copied().unwrap_or(0);
            let recorded = state.counters.get(Counter::Pages);
            assert_eq!(counted, recorded, "{id}: {counted} pages indexed, {recorded} counted");
        }
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

impl PageStore for Engine {
    fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, StoreError> {
        let mut table = self.inner.pools.write();
        let id = table.create(spec)?;
        self.inner.pool_snapshot.publish(&table);
        Ok(id)
    }

    fn destroy_pool(&self, pool: PoolId) -> Result<(), StoreError> {
        self.inner.destroy_pool(pool)
    }

    fn put(&self, key: PageKey, page: &[u8]) -> Result<PutOutcome, StoreError> {
        self.inner.put(key, page)
    }

    fn get(&self, key: PageKey, out: &mut [u8]) -> Result<Lookup, StoreError> {
        self.inner.get(key, out, false)
    }

    fn take(&self, key: PageKey, out: &mut [u8]) -> Result<Lookup, StoreError> {
        self.inner.get(key, out, true)
    }

    fn invalidate_page(&self, key: PageKey) -> Result<(), StoreError> {
        self.inner.invalidate_page(key)
    }

    fn invalidate_object(&self, pool: PoolId, object: ObjectId) -> Result<u64, StoreError> {
        let state = self.inner.pool(pool)?;
        Ok(self.inner.invalidate_pages(pool, &state.counters, Some(object)))
    }

    fn invalidate_pool(&self, pool: PoolId) -> Result<u64, StoreError> {
        let state = self.inner.pool(pool)?;
        Ok(self.inner.invalidate_pages(pool, &state.counters, None))
    }

    fn put_many(&self, keys: &[PageKey], pages: &[u8]) -> Result<Vec<PutOutcome>, StoreError> {
        self.inner.put_many(keys, pages)
    }

    fn get_many(&self, keys: &[PageKey], out: &mut [u8]) -> Result<Vec<Lookup>, StoreError> {
        check_batch(keys.len(), out.len())?;
        self.inner.read_many(keys, out, false)
    }

    fn take_many(&self, keys: &[PageKey], out: &mut [u8]) -> Result<Vec<Lookup>, StoreError> {
        check_batch(keys.len(), out.len())?;
        self.inner.read_many(keys, out, true)
    }
}

impl Inner {
    /// A batched get or take: each shard is locked once for all of its keys.
    fn read_many(
        &self,
        keys: &[PageKey],
        out: &mut [u8],
        remove: bool,
    ) -> Result<Vec<Lookup>, StoreError> {
        let snapshot = self.pool_snapshot.load();
        let mut pools: Vec<(PoolId, &PoolState)> = Vec::new();
        let mut order: Vec<(usize, u64, usize)> = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            if !pools.iter().any(|(id, _)| *id == key.pool) {
                pools.push((key.pool, pools::find(&snapshot, key.pool)?));
            }
            let hash = key_hash(key);
            order.push((self.shard_of(hash), hash, i));
        }
        order.sort_unstable();
        let mut results = vec![Lookup::Miss; keys.len()];
        let mut pages: Vec<&mut [u8]> = out.chunks_exact_mut(PAGE_SIZE).collect();
        let pool_of =
            |key: &PageKey| pools.iter().find(|(id, _)| *id == key.pool).expect("found").1;
        let mut copied = Vec::with_capacity(keys.len());
        for group in order.chunk_by(|a, b| a.0 == b.0) {
            copied.clear();
            let mut shard = self.shards[group[0].0].lock();
            for &(_, hash, i) in group {
                let pool = pool_of(&keys[i]);
                copied.push(self.read_locked(&mut shard, pool, keys[i], hash, pages[i], remove));
            }
            drop(shard);
            // Checked with the shard let go, as a single get does.
            for (&(_, hash, i), &copy) in group.iter().zip(&copied) {
                let pool = pool_of(&keys[i]);
                let found = self.check_copy(copy, pool, keys[i], hash, pages[i]);
                pool.counters.bump(if found.is_hit() { Counter::Hits } else { Counter::Misses });
                results[i] = found;
            }
        }
        Ok(results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineBuilder;

    #[test]
    fn a_corrupt_frame_is_a_miss_and_is_counted() {
        let e = Engine::new(EngineBuilder::new(1 << 20).compress_interval(None).build().unwrap());
        let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
        let key = PageKey::new(pool, 1, 1);
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 7) as u8).collect();
        let _ = e.put(key, &page).unwrap();
        let inner = e.inner();
        let hash = key_hash(&key);
        let (_, slot) = inner.shards[inner.shard_of(hash)].lock().lookup(&key, hash).unwrap();
        let Value::Content(id) = slot.value else { panic!("not a content page") };
        inner.store.write().corrupt(id);
        let mut out = vec![0u8; PAGE_SIZE];
        assert_eq!(e.get(key, &mut out).unwrap(), Lookup::Miss);
        let stats = e.pool_stats(pool).unwrap();
        assert_eq!((stats.corruptions, stats.pages), (1, 0));
        assert_eq!(e.stats().corruptions, 1);
        e.validate();
    }

    /// A corrupt content that other keys share keeps its frame until the last of them lets
    /// go (a get on another shard may be copying it with no store lock), leaves the dedup
    /// table at once (no new page joins it), and is a miss, counted, through every key.
    #[test]
    fn a_corrupt_shared_frame_is_freed_by_its_last_reader_and_shared_no_more() {
        let e = Engine::new(EngineBuilder::new(1 << 20).compress_interval(None).build().unwrap());
        let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 7) as u8).collect();
        let keys = [PageKey::new(pool, 1, 1), PageKey::new(pool, 2, 9)];
        for key in keys {
            assert_eq!(e.put(key, &page).unwrap(), PutOutcome::Stored);
        }
        assert_eq!(e.memory().frames_used, 1, "the two keys share one frame");
        let inner = e.inner();
        let hash = key_hash(&keys[0]);
        let (_, slot) = inner.shards[inner.shard_of(hash)].lock().lookup(&keys[0], hash).unwrap();
        let Value::Content(id) = slot.value else { panic!("not a content page") };
        inner.store.write().corrupt(id);
        let mut out = vec![0u8; PAGE_SIZE];
        assert_eq!(e.get(keys[0], &mut out).unwrap(), Lookup::Miss);
        assert_eq!(e.memory().frames_used, 1, "the other key still names the frame");
        e.validate();
        // The same bytes put again get a frame of their own, not the corrupt one.
        let third = PageKey::new(pool, 3, 0);
        assert_eq!(e.put(third, &page).unwrap(), PutOutcome::Stored);
        assert_eq!(e.memory().frames_used, 2);
        assert_eq!(e.get(keys[1], &mut out).unwrap(), Lookup::Miss);
        assert_eq!(e.memory().frames_used, 1, "the last reader freed the corrupt frame");
        assert_eq!(e.get(third, &mut out).unwrap(), Lookup::Hit);
        assert_eq!(out, page);
        let stats = e.pool_stats(pool).unwrap();
        assert_eq!((stats.corruptions, stats.pages), (2, 1));
        e.validate();
    }

    /// Gets check their copies after letting go of the shard (a batch after each shard's
    /// group), takes before: either way a corrupt page is a counted miss among hits.
    #[test]
    fn a_corrupt_page_in_a_batch_or_a_take_is_a_counted_miss() {
        let e = Engine::new(EngineBuilder::new(1 << 20).compress_interval(None).build().unwrap());
        let pool = e.create_pool(&PoolSpec::ephemeral()).unwrap();
        let keys: Vec<PageKey> = (0..6).map(|i| PageKey::new(pool, 7, i)).collect();
        let page =
            |i: u64| -> Vec<u8> { (0..PAGE_SIZE).map(|b| (b as u64 * 3 + i) as u8).collect() };
        for (i, key) in keys.iter().enumerate() {
            assert_eq!(e.put(*key, &page(i as u64)).unwrap(), PutOutcome::Stored);
        }
        let inner = e.inner();
        for key in [keys[1], keys[4]] {
            let hash = key_hash(&key);
            let (_, slot) = inner.shards[inner.shard_of(hash)].lock().lookup(&key, hash).unwrap();
            let Value::Content(id) = slot.value else { panic!("not a content page") };
            inner.store.write().corrupt(id);
        }
        let mut out = vec![0u8; 5 * PAGE_SIZE];
        let found = e.get_many(&keys[..5], &mut out).unwrap();
        let hits: Vec<bool> = found.iter().map(|f| f.is_hit()).collect();
        assert_eq!(hits, [true, false, true, true, false]);
        for i in [0, 2, 3] {
            assert_eq!(out[i * PAGE_SIZE..][..PAGE_SIZE], page(i as u64)[..], "page {i}");
        }
        let mut one = vec![0u8; PAGE_SIZE];
        assert_eq!(e.take(keys[5], &mut one).unwrap(), Lookup::Hit);
        assert_eq!(one, page(5));
        let hash = key_hash(&keys[0]);
        let (_, slot) = inner.shards[inner.shard_of(hash)].lock().lookup(&keys[0], hash).unwrap();
        let Value::Content(id) = slot.value else { panic!("not a content page") };
        inner.store.write().corrupt(id);
        assert_eq!(e.take(keys[0], &mut one).unwrap(), Lookup::Miss);
        let stats = e.pool_stats(pool).unwrap();
        assert_eq!((stats.corruptions, stats.pages), (3, 2));
        e.validate();
    }

    #[test]
    fn keys_spread_over_every_shard() {
        let e = Engine::new(EngineBuilder::new(1 << 20).shards(8).build().unwrap());
        let mut seen = [false; 8];
        for i in 0..256 {
            seen[e.inner().shard_of(key_hash(&PageKey::new(PoolId(0), 0, i)))] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
