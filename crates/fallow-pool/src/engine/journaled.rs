//! The engine's side of the journal of persistent pages (`crate::journal`): starting it,
//! appending a shard's records under its lock, compacting a shard's file, and the totals
//! that the node reports.
//!
//! Every change of a persistent page calls [`Inner::journal`] with its shard locked, in
//! the same critical section as the index change: a put (its page, or `Gone` when refused:
//! a refused put leaves no older page visible), a take, an invalidation of a page, an
//! object or a pool. Ephemeral pages are never journaled: a crash may lose them, as
//! eviction may.

use std::fs::File;
use std::io::{self, BufWriter};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use fallow_core::PAGE_SIZE;

use super::{Engine, Inner};
use crate::content::checksum;
use crate::journal::{self, Journal, Record};
use crate::pools;
use crate::shard::{Shard, Value};
use crate::store::{Located, Read};

/// The journal's totals over every shard.
#[derive(Debug, Default)]
pub(super) struct Totals {
    /// Bytes in the journal files.
    bytes: AtomicU64,
    /// Records appended.
    records: AtomicU64,
    /// Shards whose journal stopped after a failed write.
    failed: AtomicU64,
    /// Compactions done.
    compactions: AtomicU64,
}

/// The journal's state, for metrics and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JournalStats {
    /// Whether persistent pages are journaled.
    pub on: bool,
    /// Bytes in the journal files: memory of the tmpfs they live in, outside the budget.
    pub bytes: u64,
    /// Records appended since the journal started.
    pub records: u64,
    /// Shards whose journal stopped after a failed write (their persistent pages would not
    /// survive a crash).
    pub failed_shards: u64,
    /// Compactions done.
    pub compactions: u64,
}

impl Engine {
    /// Starts journaling persistent pages into `dir` (created if missing; files there
    /// replaced), one file per shard, so that they survive a crash of the process
    /// (`crate::journal`). Persistent pages already held are journaled at once.
    pub fn start_journal(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let inner = &self.inner;
        for (i, shard) in inner.shards.iter().enumerate() {
            let created = Journal::create(journal::shard_file(dir, i))?;
            let mut shard = shard.lock();
            let len = created.len();
            if let Some(old) = shard.journal.replace(created) {
                inner.journal.bytes.fetch_sub(old.len(), Relaxed);
            }
            inner.journal.bytes.fetch_add(len, Relaxed);
            if shard.len() > 0 {
                inner.compact_journal(&mut shard);
            }
        }
        tracing::info!(dir = %dir.display(), shards = inner.shards.len(), "journaling persistent pages");
        Ok(())
    }

    /// The journal's totals.
    pub fn journal_stats(&self) -> JournalStats {
        let totals = &self.inner.journal;
        JournalStats {
            on: self.inner.shards.first().is_some_and(|s| s.lock().journal.is_some()),
            bytes: totals.bytes.load(Relaxed),
            records: totals.records.load(Relaxed),
            failed_shards: totals.failed.load(Relaxed),
            compactions: totals.compactions.load(Relaxed),
        }
    }
}

impl Inner {
    /// Appends `record` to `shard`'s journal, if it keeps one; `live_change` is what the
    /// change did to the shard's count of persistent pages. Compacts the file when it has
    /// grown to twice what its live pages need. Called after the index change it records,
    /// never before: the compaction it may set off rewrites the file from the index.
    pub(super) fn journal(&self, shard: &mut Shard, record: Record<'_>, live_change: i64) {
        self.journal_with_crc(shard, record, live_change, None);
    }

    /// [`Inner::journal`], for a page record whose bytes' CRC-32C is known.
    fn journal_with_crc(
        &self,
        shard: &mut Shard,
        record: Record<'_>,
        live_change: i64,
        page_crc: Option<u32>,
    ) {
        let Some(journal) = shard.journal.as_mut() else { return };
        let appended = journal.append(record, live_change, page_crc);
        let totals = &self.journal;
        if appended.bytes >= 0 {
            totals.bytes.fetch_add(appended.bytes as u64, Relaxed);
            totals.records.fetch_add(u64::from(appended.bytes > 0), Relaxed);
        } else {
            totals.bytes.fetch_sub(appended.bytes.unsigned_abs(), Relaxed);
        }
        if appended.failed {
            totals.failed.fetch_add(1, Relaxed);
        }
        if journal.wants_compaction() {
            self.compact_journal(shard);
        }
    }

    /// The record of a stored put: the page's bytes (`page`, or read back from the store
    /// for a put by hash), or its fill word. `crc` is the CRC-32C of the page's bytes,
    /// which the put computed (or was given, by hash).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn journal_stored(
        &self,
        shard: &mut Shard,
        key: fallow_core::PageKey,
        hash: u64,
        page: Option<&[u8]>,
        crc: u32,
        mask: u32,
        replaced: bool,
    ) {
        if shard.journal.is_none() {
            return;
        }
        let live_change = i64::from(!replaced);
        let value = shard.lookup(&key, hash).map(|(_, slot)| slot.value);
        let mut buf = Vec::new();
        let record = match (value, page) {
            (Some(Value::Fill(word)), _) => Record::Fill(key, word),
            (Some(Value::Content(_)), Some(page)) => Record::Page(key, page),
            (Some(Value::Content(id)), None) => {
                buf.resize(PAGE_SIZE, 0);
                match self.store.write().read(id, &mut buf, mask) {
                    Read::Ok => Record::Page(key, &buf),
                    // Unreadable already: the put reads as lost, and so must a replay.
                    _ => Record::Gone(key),
                }
            }
            (None, _) => Record::Gone(key),
        };
        self.journal_with_crc(shard, record, live_change, Some(crc));
    }

    /// Rewrites `shard`'s journal with one record per persistent page its index holds,
    /// read back from the store (a page that no longer reads is left out), and renames
    /// the new file over the old one. Runs under the shard's lock, so no append can come
    /// in between: it stalls this shard for the copy (~1 µs a page), once per doubling of
    /// the file. A failure leaves the old file, which is still right, and postpones the
    /// next try until the file has grown by half again.
    pub(super) fn compact_journal(&self, shard: &mut Shard) {
        let Some(mut journal) = shard.journal.take() else { return };
        let before = journal.len();
        let tmp = journal.compaction_path();
        let written = self.write_compacted(shard, &tmp);
        match written.and_then(|(file, live)| journal.replace(file, &tmp, live)) {
            Ok(()) => {
                let totals = &self.journal;
                totals.bytes.fetch_sub(before, Relaxed);
                totals.bytes.fetch_add(journal.len(), Relaxed);
                totals.compactions.fetch_add(1, Relaxed);
                tracing::debug!(before, after = journal.len(), "journal compacted");
            }
            Err(err) => {
                let _ = std::fs::remove_file(&tmp);
                journal.postpone_compaction();
                tracing::warn!(%err, bytes = before, "compacting a journal failed; it keeps growing");
            }
        }
        shard.journal = Some(journal);
    }

    /// Writes `shard`'s persistent pages as a journal at `path`; the file and how many
    /// pages it holds.
    fn write_compacted(&self, shard: &Shard, path: &Path) -> io::Result<(File, u64)> {
        let mut out = BufWriter::with_capacity(1 << 20, journal::create_file(path)?);
        journal::write_header(&mut out)?;
        let pools = self.pool_snapshot.load();
        let mut page = vec![0u8; PAGE_SIZE];
        let mut live = 0;
        for (_, slot) in shard.slots() {
            if !slot.persistent {
                continue;
            }
            let (record, crc) = match slot.value {
                Value::Fill(word) => (Record::Fill(slot.key, word), None),
                Value::Content(id) => {
                    let Ok(pool) = pools::find(&pools, slot.key.pool) else { continue };
                    // Found under the store's read lock and copied after it, as a get does.
                    let located = self.store.read().locate(id, &mut page, pool.mask);
                    let crc = match located {
                        // SAFETY: the caller holds this shard's lock, and `slot`, an entry
                        // of this shard, names the content; see `HeldFrame`.
                        Located::Frame(frame, crc) => unsafe {
                            frame.copy_into(&mut page);
                            crc
                        },
                        Located::Copied(crc) => crc,
                        Located::Dead => continue,
                    };
                    // A page that fails its checksum is left out; a get will find it so.
                    if checksum(&page) != crc {
                        continue;
                    }
                    (Record::Page(slot.key, &page), Some(crc))
                }
            };
            journal::write_record(&mut out, record, crc)?;
            live += 1;
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        Ok((file, live))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::path::PathBuf;

    use fallow_core::{
        content, DedupScope, Lookup, PageKey, PageStore, PoolId, PoolSpec, PutOutcome, TrustDomain,
    };
    use rand::{rngs::StdRng, Rng, SeedableRng};

    use super::*;
    use crate::journal::{journal_dir, recover};
    use crate::EngineBuilder;

    struct State(PathBuf);

    impl State {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("fallow-journal-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for State {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn engine(budget: usize) -> Engine {
        let config = EngineBuilder::new(budget).shards(4).compress_interval(None).build().unwrap();
        Engine::new(config)
    }

    /// A start after a crash: the journals of the dead engine read back into a new one,
    /// whose pools are `pools` (their ids kept), journaling anew.
    fn restart(state: &Path, pools: &[(PoolId, PoolSpec)], budget: usize) -> Engine {
        let recovered = recover(state).unwrap();
        let engine = engine(budget);
        for (id, spec) in pools {
            engine.restore_pool(*id, spec, 1).unwrap();
        }
        engine.start_journal(&journal_dir(state)).unwrap();
        if let Some(recovered) = recovered {
            recovered.for_each_batch(64, |keys, pages| {
                let stored = engine.put_many(keys, pages).unwrap();
                assert!(stored.iter().all(|o| *o == PutOutcome::Stored), "{stored:?}");
            });
            recovered.finish().unwrap();
        }
        engine
    }

    fn page(rng: &mut StdRng) -> Vec<u8> {
        match rng.gen_range(0..4) {
            // A fill page: journaled as its word.
            0 => rng.gen::<u64>().to_le_bytes().repeat(PAGE_SIZE / 8),
            // One of a few contents: shared by dedup.
            1 => vec![rng.gen_range(1..4u8); PAGE_SIZE],
            _ => (0..PAGE_SIZE).map(|_| rng.gen()).collect(),
        }
    }

    fn check(engine: &Engine, pool: PoolId, model: &HashMap<PageKey, Vec<u8>>) {
        let mut held = engine.pool_keys(pool);
        held.sort_by_key(|k| (k.object, k.index));
        let mut expected: Vec<PageKey> = model.keys().copied().collect();
        expected.sort_by_key(|k| (k.object, k.index));
        assert_eq!(held, expected, "the keys after a restart");
        let mut out = vec![0u8; PAGE_SIZE];
        for (key, page) in model {
            assert_eq!(engine.get(*key, &mut out).unwrap(), Lookup::Hit, "{key:?}");
            assert!(out == *page, "{key:?} came back with other bytes");
        }
    }

    /// Random puts (bytes, fills, shared contents, by hash), gets, takes and invalidations
    /// of pages and objects on a persistent pool, with a crash (the engine dropped, its
    /// journal files left) every few hundred operations and compactions on the way: after
    /// each restart the pool holds exactly the model's pages.
    #[test]
    fn a_crashed_engine_comes_back_with_exactly_the_persistent_pages_it_acknowledged() {
        let state = State::new("model");
        let budget = 8 << 20;
        let spec = PoolSpec { dedup: DedupScope::Domain(TrustDomain(7)), ..PoolSpec::persistent() };
        let mut engine = engine(budget);
        let pool = engine.create_pool(&spec).unwrap();
        let scratch = engine.create_pool(&PoolSpec::ephemeral()).unwrap();
        engine.start_journal(&journal_dir(&state.0)).unwrap();
        let mut model: HashMap<PageKey, Vec<u8>> = HashMap::new();
        let mut rng = StdRng::seed_from_u64(0x6a6f_7572);
        let mut out = vec![0u8; PAGE_SIZE];
        let mut compactions = 0;
        for round in 0..6 {
            for _ in 0..700 {
                let key = PageKey::new(pool, rng.gen_range(0..4), rng.gen_range(0..48));
                match rng.gen_range(0..10) {
                    0..=4 => {
                        let bytes = page(&mut rng);
                        let _ = engine.put(PageKey::new(scratch, 0, key.index), &bytes);
                        if engine.put(key, &bytes).unwrap() == PutOutcome::Stored {
                            model.insert(key, bytes);
                        } else {
                            model.remove(&key);
                        }
                    }
                    5 => {
                        // By hash: stored only when the content is held.
                        let bytes = vec![rng.gen_range(1..4u8); PAGE_SIZE];
                        let hash = content::content_hash(&bytes, spec.dedup).unwrap();
                        let by_hash = (hash, content::checksum(&bytes));
                        match engine.put_many_by_hash(&[key], &[by_hash]).unwrap()[0] {
                            fallow_core::HashPutOutcome::Stored => {
                                model.insert(key, bytes);
                            }
                            // Not held: the key is left as it was.
                            fallow_core::HashPutOutcome::NotHeld => {}
                            fallow_core::HashPutOutcome::NotStored(_) => {
                                model.remove(&key);
                            }
                        }
                    }
                    6 => {
                        let hit = engine.take(key, &mut out).unwrap() == Lookup::Hit;
                        assert_eq!(hit, model.remove(&key).is_some(), "take {key:?}");
                    }
                    7 => {
                        engine.invalidate_page(key).unwrap();
                        model.remove(&key);
                    }
                    8 if rng.gen_range(0..8) == 0 => {
                        engine.invalidate_object(pool, key.object).unwrap();
                        model.retain(|k, _| k.object != key.object);
                    }
                    _ => {
                        let hit = engine.get(key, &mut out).unwrap() == Lookup::Hit;
                        assert_eq!(hit, model.contains_key(&key), "get {key:?}");
                    }
                }
            }
            let stats = engine.journal_stats();
            assert!(stats.on && stats.failed_shards == 0, "round {round}: {stats:?}");
            compactions += stats.compactions;
            drop(engine);
            engine = restart(&state.0, &[(pool, spec), (scratch, PoolSpec::ephemeral())], budget);
            check(&engine, pool, &model);
            assert!(engine.pool_keys(scratch).is_empty(), "ephemeral pages are not journaled");
            engine.validate();
        }
        assert!(compactions > 0, "the rounds compacted no journal");
    }

    /// A pool destroyed and a new one given its id: the old pool's pages stay gone.
    #[test]
    fn a_destroyed_pools_pages_do_not_come_back_under_a_reused_id() {
        let state = State::new("reuse");
        let engine = engine(4 << 20);
        engine.start_journal(&journal_dir(&state.0)).unwrap();
        let old = engine.create_pool(&PoolSpec::persistent()).unwrap();
        for i in 0..20 {
            let _ = engine.put(PageKey::new(old, 1, i), &vec![i as u8 + 1; PAGE_SIZE]).unwrap();
        }
        engine.destroy_pool(old).unwrap();
        let mut model = HashMap::new();
        let page = vec![9u8; PAGE_SIZE];
        engine.restore_pool(old, &PoolSpec::persistent(), 1).unwrap();
        assert_eq!(engine.put(PageKey::new(old, 1, 3), &page).unwrap(), PutOutcome::Stored);
        model.insert(PageKey::new(old, 1, 3), page);
        drop(engine);
        let engine = restart(&state.0, &[(old, PoolSpec::persistent())], 4 << 20);
        check(&engine, old, &model);
    }

    /// Compaction keeps the journal near what its live pages need, while overwrites
    /// would grow it without end.
    #[test]
    fn overwrites_compact_the_journal_instead_of_growing_it() {
        let state = State::new("compact");
        let engine = engine(4 << 20);
        engine.start_journal(&journal_dir(&state.0)).unwrap();
        let pool = engine.create_pool(&PoolSpec::persistent()).unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        for round in 0..200u32 {
            for i in 0..16 {
                let bytes: Vec<u8> = (0..PAGE_SIZE).map(|_| rng.gen()).collect();
                let _ = engine.put(PageKey::new(pool, u64::from(round % 2), i), &bytes).unwrap();
            }
        }
        let stats = engine.journal_stats();
        assert!(stats.compactions > 0, "{stats:?}");
        // 32 live pages over 4 shards, each file below the floor or twice its live pages.
        let bound =
            4 * crate::journal::COMPACT_FLOOR.max(2 * 8 * crate::journal::PAGE_RECORD as u64);
        assert!(stats.bytes <= bound + 4 * crate::journal::PAGE_RECORD as u64, "{stats:?}");
        let on_disk: u64 = std::fs::read_dir(journal_dir(&state.0))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        // The files are allocated up to 4 MiB ahead of their records.
        assert!(on_disk >= stats.bytes && on_disk <= stats.bytes + 4 * (4 << 20), "{on_disk}");
    }
}
