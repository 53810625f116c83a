//! The engine: pools, the sharded index and the content store behind one [`PageStore`].
//! This file holds the engine itself, budget changes, invalidation and stats; the put path
//! is in `put.rs`, the get path in `get.rs`.
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
    check_batch, HashPutOutcome, Lookup, ObjectId, PageKey, PageStore, PoolId, PoolSpec,
    PutOutcome, StoreError, PAGE_SIZE,
};

use crate::compress::Compressor;
use crate::config::{EngineConfig, MAX_BUDGET_BYTES};
use crate::eviction;
use crate::hashing::key_hash;
use crate::journal::Record;
use crate::pools::{self, Counter, PoolCounters, PoolSnapshot, PoolState, PoolTable};
use crate::shard::{Shard, Slot, Value, Visit};
use crate::stats::SweepReport;
use crate::stats::{BudgetReport, EngineStats, MemoryUsage, PoolStats};
use crate::store::{Compression, ShrinkReport, Store};

/// Slabs of compressed pages a compression pass packs at most (`Store::clean_blobs`).
const CLEAN_PER_PASS: usize = 2;
/// Old groups of a table's growth that the background thread moves per table at each
/// wake ([`Engine::finish_growth`]): 256 groups of 8 ids, ~2,000 hashes recomputed under
/// one shard's lock. The index of a shard of 1 GiB (~35,000 groups) finishes in under 14 s
/// of 100 ms wakes, if no insert helps.
const TIDY_GROUPS: usize = 256;

/// Segments released per store-lock hold when shrinking: one extent, so that a step
/// usually empties one mapping (one `munmap`, after the lock). Bounds how long a get can
/// wait behind a shrink: each segment costs a scan of its 512 content flag bytes, plus any
/// persistent pages it moves.
const SHRINK_STEP_SEGMENTS: usize = crate::arena::EXTENT_SEGMENTS;

/// Whether a sweep (`sweep.rs`) is wanted and whether one is running.
#[derive(Debug, Default)]
pub(crate) struct SweepState {
    requested: std::sync::atomic::AtomicBool,
    running: std::sync::atomic::AtomicBool,
}

mod get;
mod journaled;
mod put;
mod sweep;

pub use journaled::JournalStats;

/// What a read does with a page it finds: a tmem get leaves it in the pool (inclusive), a
/// take removes it (exclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnHit {
    /// Get: the page stays.
    Keep,
    /// Take: the page leaves the pool.
    Remove,
}

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
    /// Index shards, chosen by the key's run of 128 indexes (`hashing::shard_of`).
    /// `parking_lot` mutexes: each is held for one index operation (with a get's copy of
    /// its page) and never across blocking work; all of them by a shrink step and a
    /// compression pass.
    pub(crate) shards: Box<[Mutex<Shard>]>,
    /// Page bytes, checksums, dedup table. Taken after a shard lock: for reading by a get's
    /// lookup of its frame (several at once; the copy comes after), for writing by
    /// everything that changes the store (a put's new frame and, after its copy, its dedup
    /// entry; a release; a compression pass; a shrink step).
    pub(crate) store: RwLock<Store>,
    /// The most index entries one shard may hold.
    entries_per_shard: AtomicUsize,
    /// The shard the next compression pass starts in (modulo their number).
    compress_turn: AtomicUsize,
    /// The background removal of dropped pages' index entries (`sweep.rs`).
    pub(crate) sweep: SweepState,
    /// The journal of persistent pages' totals (`journaled.rs`).
    journal: journaled::Totals,
    config: EngineConfig,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

/// The most index entries a shard of `frames` budget frames may hold: `entries_per_frame`
/// for each, up to what a shard can index at all ([`crate::shard::MAX_PAGES`], 2²⁴ − 1:
/// reached from 2²⁴ / `entries_per_frame` frames a shard, 16 GiB with the default 4).
fn entry_limit(frames: usize, entries_per_frame: usize) -> usize {
    frames.saturating_mul(entries_per_frame).min(crate::shard::MAX_PAGES)
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
            entries_per_shard: AtomicUsize::new(entry_limit(per_shard, config.entries_per_frame)),
            compress_turn: AtomicUsize::new(0),
            sweep: SweepState::default(),
            journal: journaled::Totals::default(),
            config,
        });
        let compressor = inner.config.compress_interval.map(|every| {
            let inner = inner.clone();
            Compressor::start(every, move || {
                inner.tidy_pass(TIDY_GROUPS);
                inner.compress_pass(inner.config.compress_batch).1
            })
        });
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
    /// returns whole segments to the OS, a few per hold of every shard lock and the
    /// store's, dropping the ephemeral pages in them. Persistent pages are never dropped:
    /// when they alone exceed the new budget, the report says by how many frames
    /// (`pinned_over_budget`) and a warning is logged.
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
        if per_shard > crate::shard::MAX_PAGES {
            tracing::warn!(
                budget_bytes,
                shards = self.inner.shards.len(),
                "the budget is more than this engine's shards can index (2^24 - 1 pages each); \
                 the rest of it stays unused until the engine is restarted with more shards"
            );
        }
        self.inner
            .entries_per_shard
            .store(entry_limit(per_shard, self.inner.config.entries_per_frame), Ordering::Relaxed);
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

    /// Finishes every hash table's growth now. A table that outgrows its groups moves
    /// them to larger ones a few at a time, with each insert; until the last is moved it
    /// holds both, and a cache filled and then only read would hold both for good. The
    /// background thread (`EngineBuilder::compress_interval`) moves `TIDY_GROUPS` of each
    /// table at each wake; this is for an engine without it, or a caller that wants it
    /// done (a memory measurement).
    pub fn finish_growth(&self) {
        while self.inner.tidy_pass(TIDY_GROUPS) {}
    }

    /// Compresses up to `max` cold pages of pools with compression on, now. Returns how
    /// many were compressed. The background thread calls this periodically.
    pub fn compress_cold(&self, max: usize) -> usize {
        self.inner.compress_pass(max).0
    }

    /// Stores pages by content hash instead of bytes (dedup across nodes: a client that
    /// knows this engine holds a page's content sends its hash): `contents[i]` is the
    /// [`fallow_core::content::content_hash`] and [`fallow_core::content::checksum`] of
    /// the page meant for `keys[i]`. A key whose content is not held, or whose pool does
    /// not dedup, is answered [`HashPutOutcome::NotHeld`] and left as it was (its older
    /// page stays until the caller puts the bytes).
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
            discarded_bytes: usage.discarded_bytes,
            frames_used: usage.frames_used,
            compressed_bytes: usage.compressed_bytes,
            compressed_space_bytes: usage.compressed_space_bytes,
        }
    }

    /// Every pool with its spec and users, for a restart's snapshot.
    pub fn pools_for_restart(&self) -> Vec<(PoolId, PoolSpec, u32)> {
        self.inner.pools.read().with_users()
    }

    /// Recreates pool `id` with its spec and users (a restart): its id stays what its
    /// clients know it by.
    pub fn restore_pool(&self, id: PoolId, spec: &PoolSpec, users: u32) -> Result<(), StoreError> {
        let mut table = self.inner.pools.write();
        table.restore(id, spec, users)?;
        self.inner.pool_snapshot.publish(&table);
        Ok(())
    }

    /// Every key `pool` holds now, shard by shard (pages may come and go meanwhile).
    pub fn pool_keys(&self, pool: PoolId) -> Vec<PageKey> {
        let mut keys = Vec::new();
        for shard in self.inner.shards.iter() {
            let shard = shard.lock();
            keys.extend(shard.slots().map(|(_, slot)| slot.key).filter(|k| k.pool == pool));
        }
        keys
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

    fn shard_of(&self, key: &PageKey) -> usize {
        crate::hashing::shard_of(key, self.shards.len())
    }

    /// Every shard's lock, in ascending order. Taken, before the store's write lock, by
    /// the steps that move or drop the bytes of contents that index entries still name (a
    /// shrink step, a compression pass): a get copies a frame with only its shard held
    /// (`HeldFrame`), so holding every shard is what keeps those bytes still under it.
    pub(crate) fn lock_all_shards(&self) -> Vec<MutexGuard<'_, Shard>> {
        self.shards.iter().map(|s| s.lock()).collect()
    }

    /// Moves up to `groups` old groups of every table's growth under way: each shard's
    /// under its own lock, then the dedup table's under the store's, so that each hold is
    /// a step's length (`TIDY_GROUPS`: ~2,000 ids rehashed, some tens of µs). True while
    /// some are left. The store's write lock, which every get waits for, is taken only
    /// when its table is growing (nearly never: it runs at every wake of the background
    /// thread).
    pub(crate) fn tidy_pass(&self, groups: usize) -> bool {
        let mut left = false;
        for shard in self.shards.iter() {
            left |= shard.lock().tidy(groups);
        }
        let store_growing = self.store.read().growing();
        left | (store_growing && self.store.write().tidy(groups))
    }

    /// One compression pass: compresses at most `max` cold pages, looking at no more than
    /// four times as many; returns how many it compressed, and whether it stopped at one of
    /// those limits (so more may be waiting). It walks index entries, not
    /// contents, so that it can write a compressed page's new id into the entry naming it
    /// (`store/compress.rs`); each shard keeps its own hand, and the shard a pass starts in
    /// takes turns, so a pass that ends early does not always favour the first ones.
    pub(crate) fn compress_pass(&self, max: usize) -> (usize, bool) {
        let mut shards = self.lock_all_shards();
        let mut store = self.store.write();
        let (mut done, mut examined) = (0, 0);
        let n = shards.len();
        let first = self.compress_turn.fetch_add(1, Ordering::Relaxed);
        for k in 0..n {
            shards[(first + k) % n].walk_contents(|id| {
                if done == max || examined == max.saturating_mul(4) {
                    return Visit::Stop;
                }
                examined += 1;
                match store.compress(id) {
                    Compression::Left => Visit::Next,
                    Compression::Kept => {
                        done += 1;
                        Visit::Next
                    }
                    Compression::Renamed(new) => {
                        done += 1;
                        Visit::Rename(new)
                    }
                }
            });
        }
        // Pages dropped or overwritten since the last pass left holes among the compressed
        // ones: pack a few slabs (each a copy of at most 64 KiB under these locks).
        store.clean_blobs(CLEAN_PER_PASS);
        (done, done == max || examined == max.saturating_mul(4))
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

    fn invalidate_page(&self, key: PageKey) -> Result<(), StoreError> {
        let pools = self.pool_snapshot.load();
        let pool = pools::find(&pools, key.pool)?;
        let hash = key_hash(&key);
        let mut shard = self.shards[self.shard_of(&key)].lock();
        let found = shard.lookup(&key, hash);
        if let Some((id, _)) = found {
            let slot = shard.remove(id);
            self.release(&mut self.store.write(), &slot, Some(&pool.counters));
            pool.counters.bump(Counter::Invalidations);
        }
        if pool.persistent() {
            // Journaled even when the index had no entry: the journal may still hold the
            // key's page (one dropped as unreadable), which a replay must not bring back.
            self.journal(&mut shard, Record::Gone(key), -i64::from(found.is_some()));
        }
        Ok(())
    }

    /// Removes every page of `pool` (of `object` only, when given), shard by shard.
    fn invalidate_pages(&self, pool: PoolId, state: &PoolState, object: Option<ObjectId>) -> u64 {
        let counters = &state.counters;
        let mut removed = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let ids = match object {
                Some(object) => shard.object_pages(pool, object),
                None => shard.pool_pages(pool),
            };
            let count = ids.len();
            if count > 0 {
                let mut store = self.store.write();
                for id in ids {
                    let slot = shard.remove(id);
                    self.release(&mut store, &slot, Some(counters));
                }
                removed += count as u64;
            }
            // After the removal (a compaction the append sets off copies the index as it
            // is then), and in every shard: its journal may hold pages its index dropped.
            if state.persistent() {
                let record = match object {
                    Some(object) => Record::ObjectGone(pool, object),
                    None => Record::PoolGone(pool),
                };
                self.journal(&mut shard, record, -(count as i64));
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
            let removed = self.invalidate_pages(id, &state, None);
            self.pools.write().release_domain(state.dedup);
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
        self.inner.get(key, out, OnHit::Keep)
    }

    fn take(&self, key: PageKey, out: &mut [u8]) -> Result<Lookup, StoreError> {
        self.inner.get(key, out, OnHit::Remove)
    }

    fn invalidate_page(&self, key: PageKey) -> Result<(), StoreError> {
        self.inner.invalidate_page(key)
    }

    fn invalidate_object(&self, pool: PoolId, object: ObjectId) -> Result<u64, StoreError> {
        let state = self.inner.pool(pool)?;
        Ok(self.inner.invalidate_pages(pool, &state, Some(object)))
    }

    fn invalidate_pool(&self, pool: PoolId) -> Result<u64, StoreError> {
        let state = self.inner.pool(pool)?;
        Ok(self.inner.invalidate_pages(pool, &state, None))
    }

    fn put_many(&self, keys: &[PageKey], pages: &[u8]) -> Result<Vec<PutOutcome>, StoreError> {
        self.inner.put_many(keys, pages)
    }

    fn get_many(&self, keys: &[PageKey], out: &mut [u8]) -> Result<Vec<Lookup>, StoreError> {
        check_batch(keys.len(), out.len())?;
        self.inner.read_many(keys, out, OnHit::Keep)
    }

    fn take_many(&self, keys: &[PageKey], out: &mut [u8]) -> Result<Vec<Lookup>, StoreError> {
        check_batch(keys.len(), out.len())?;
        self.inner.read_many(keys, out, OnHit::Remove)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineBuilder;

    #[test]
    fn a_shard_never_takes_more_entries_than_its_slot_and_span_ids_can_name() {
        assert_eq!(entry_limit(1000, 4), 4000);
        let frames_per_shard = MAX_BUDGET_BYTES / PAGE_SIZE;
        assert_eq!(entry_limit(frames_per_shard, 4), crate::shard::MAX_PAGES);
        assert_eq!(entry_limit(usize::MAX, 4), crate::shard::MAX_PAGES, "no overflow");
    }

    #[test]
    fn dedup_never_crosses_trust_domains_whose_checksum_masks_collide() {
        // A page is found for dedup by its checksum masked by its domain: two domains with
        // one mask would share pages, so the second one's pools store theirs without dedup.
        use fallow_core::{DedupScope, PoolSpec, PutOutcome};
        let (first, second) = crate::pools::colliding_domains();
        let e = Engine::new(
            EngineBuilder::new(64 * PAGE_SIZE).compress_interval(None).build().unwrap(),
        );
        let spec = |domain| PoolSpec::persistent().dedup(DedupScope::Domain(domain));
        let pools = [spec(first), spec(second), spec(second), spec(first)]
            .map(|spec| e.create_pool(&spec).unwrap());
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i % 251) as u8).collect();
        for pool in pools {
            assert_eq!(e.put(PageKey::new(pool, 0, 0), &page).unwrap(), PutOutcome::Stored);
        }
        assert_eq!(e.stats().contents, 3, "only the first domain's two pools share");
        let mut out = vec![0u8; PAGE_SIZE];
        for pool in pools {
            assert!(e.get(PageKey::new(pool, 0, 0), &mut out).unwrap().is_hit());
            assert_eq!(out, page);
        }
        e.validate();
    }

    #[test]
    fn runs_spread_over_every_shard_and_a_runs_pages_share_one() {
        let e = Engine::new(EngineBuilder::new(1 << 20).shards(8).build().unwrap());
        let shard_of = |object, index| e.inner().shard_of(&PageKey::new(PoolId(0), object, index));
        let run = crate::shard::RUN_PAGES;
        let mut objects = [0; 8];
        let mut hashed = [0; 8];
        let mut runs = [0; 8];
        let mut strided = [0; 8];
        for i in 0..800 {
            objects[shard_of(i, 0)] += 1;
            hashed[shard_of(crate::hashing::mix64(i), 0)] += 1;
            runs[shard_of(0, i * run)] += 1;
            strided[shard_of(0, i * 8 * run)] += 1;
            assert_eq!(shard_of(i, i * run), shard_of(i, i * run + run - 1), "one run, one shard");
        }
        assert_eq!(runs, [100; 8], "a dense object's runs spread exactly");
        assert_eq!(objects, [100; 8], "so do the first runs of objects numbered in order");
        // 100 a shard on average; ±40 is over four standard deviations.
        for count in hashed.iter().chain(&strided) {
            assert!((60..=140).contains(count), "{hashed:?} {strided:?}");
        }
    }

    #[test]
    fn objects_of_fewer_runs_than_shards_numbered_in_order_cover_each_shard_once() {
        // A 4 MiB object is 8 runs: half of a 16-shard engine's shards. Any aligned block
        // of objects that together have as many runs as there are shards covers each once.
        let e = Engine::new(EngineBuilder::new(1 << 20).shards(16).build().unwrap());
        let shard_of = |object, index| e.inner().shard_of(&PageKey::new(PoolId(3), object, index));
        let run = crate::shard::RUN_PAGES;
        for runs_per_object in [1, 2, 4, 8, 16, 32] {
            let per_block = (16 / runs_per_object).max(1);
            for first in (0..64).step_by(per_block as usize) {
                let mut count = [0; 16];
                for object in first..first + per_block {
                    for r in 0..runs_per_object {
                        count[shard_of(object, r * run + object % run)] += 1;
                    }
                }
                let each = (runs_per_object / 16).max(1);
                assert_eq!(count, [each; 16], "{runs_per_object} runs an object, from {first}");
            }
        }
    }
}
