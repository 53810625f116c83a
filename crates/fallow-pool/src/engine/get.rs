//! The get path: a get or take under its shard lock, the checksum of a get's copy after
//! the shard is let go, and the batched forms (each shard locked once for its keys).

use fallow_core::{check_page, Lookup, PageKey, PoolId, StoreError, PAGE_SIZE};

use super::{Inner, OnHit};
use crate::content::{checksum, write_fill};
use crate::eviction::SlotId;
use crate::hashing::key_hash;
use crate::journal::Record;
use crate::pools::{self, Counter, PoolState};
use crate::shard::{Shard, Value};
use crate::store::{Located, Read};

/// What a get or take found under its shard lock.
#[derive(Debug, Clone, Copy)]
enum Copied {
    Miss,
    /// The page is in the caller's buffer (a fill page, or a take's checked copy).
    Hit,
    /// A get's copy, to be checked against this CRC-32C once the shard is let go.
    Unchecked(u32),
}

impl Inner {
    pub(super) fn get(
        &self,
        key: PageKey,
        out: &mut [u8],
        on_hit: OnHit,
    ) -> Result<Lookup, StoreError> {
        check_page(out.len())?;
        let pools = self.pool_snapshot.load();
        let pool = pools::find(&pools, key.pool)?;
        let hash = key_hash(&key);
        let found = {
            let mut shard = self.shards[self.shard_of(&key)].lock();
            self.read_locked(&mut shard, pool, key, hash, out, on_hit)
        };
        let found = self.check_copy(found, pool, key, hash, out);
        pool.counters.bump(if found.is_hit() { Counter::Hits } else { Counter::Misses });
        Ok(found)
    }

    /// A get or take under the shard lock. A get's copy is checked by the caller after it
    /// lets go of the shard ([`Inner::check_copy`]): the checksum costs as much as the
    /// copy, and another thread's operation on this shard need not wait for it. A take
    /// checks under the lock, since its entry goes with it; in a persistent pool it is
    /// journaled, hit or miss (the journal may hold a page the index dropped as
    /// unreadable, which a replay must not bring back after the client took it).
    fn read_locked(
        &self,
        shard: &mut Shard,
        pool: &PoolState,
        key: PageKey,
        hash: u64,
        out: &mut [u8],
        on_hit: OnHit,
    ) -> Copied {
        let before = shard.len();
        let copied = self.read_unjournaled(shard, pool, key, hash, out, on_hit);
        if on_hit == OnHit::Remove && pool.persistent() {
            let removed = before - shard.len();
            self.journal(shard, Record::Gone(key), -(removed as i64));
        }
        copied
    }

    /// [`Inner::read_locked`] without the journal.
    fn read_unjournaled(
        &self,
        shard: &mut Shard,
        pool: &PoolState,
        key: PageKey,
        hash: u64,
        out: &mut [u8],
        on_hit: OnHit,
    ) -> Copied {
        let Some((id, slot)) = shard.lookup(&key, hash) else { return Copied::Miss };
        let copied = match slot.value {
            Value::Fill(word) => {
                write_fill(word, out);
                Copied::Hit
            }
            Value::Content(content) => {
                let located = self.store.read().locate(content, out, pool.mask);
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
                if on_hit == OnHit::Keep {
                    Copied::Unchecked(crc)
                } else if checksum(out) == crc {
                    Copied::Hit
                } else {
                    // Bound first: the store's guard must be gone before `drop_unreadable`.
                    let judged = self.store.write().read(content, out, pool.mask);
                    if judged != Read::Ok {
                        self.drop_unreadable(shard, pool, id, judged);
                        return Copied::Miss;
                    }
                    Copied::Hit
                }
            }
        };
        if on_hit == OnHit::Remove {
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
    /// store lock ([`crate::store::Store::read`]): a corrupt content is a miss (and
    /// counted); one that the key's entry no longer names was replaced meanwhile, and the
    /// key's page now is read (and checked) under the lock instead.
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
        let mut shard = self.shards[self.shard_of(&key)].lock();
        let Some((id, slot)) = shard.lookup(&key, hash) else { return Lookup::Miss };
        let judged = match slot.value {
            Value::Fill(word) => {
                write_fill(word, out);
                Read::Ok
            }
            Value::Content(content) => self.store.write().read(content, out, pool.mask),
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

    /// A batched get or take: each shard is locked once for all of its keys.
    pub(super) fn read_many(
        &self,
        keys: &[PageKey],
        out: &mut [u8],
        on_hit: OnHit,
    ) -> Result<Vec<Lookup>, StoreError> {
        let snapshot = self.pool_snapshot.load();
        let mut pools: Vec<(PoolId, &PoolState)> = Vec::new();
        let mut order: Vec<(usize, u64, usize)> = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            if !pools.iter().any(|(id, _)| *id == key.pool) {
                pools.push((key.pool, pools::find(&snapshot, key.pool)?));
            }
            let hash = key_hash(key);
            order.push((self.shard_of(key), hash, i));
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
                copied.push(self.read_locked(&mut shard, pool, keys[i], hash, pages[i], on_hit));
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
    use crate::engine::Engine;
    use crate::EngineBuilder;
    use fallow_core::{PageStore, PoolSpec, PutOutcome};

    #[test]
    fn a_corrupt_frame_is_a_miss_and_is_counted() {
        let e = Engine::new(EngineBuilder::new(1 << 20).compress_interval(None).build().unwrap());
        let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
        let key = PageKey::new(pool, 1, 1);
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 7) as u8).collect();
        let _ = e.put(key, &page).unwrap();
        let inner = e.inner();
        let hash = key_hash(&key);
        let (_, slot) = inner.shards[inner.shard_of(&key)].lock().lookup(&key, hash).unwrap();
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
        let (_, slot) =
            inner.shards[inner.shard_of(&keys[0])].lock().lookup(&keys[0], hash).unwrap();
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
            let (_, slot) = inner.shards[inner.shard_of(&key)].lock().lookup(&key, hash).unwrap();
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
        let (_, slot) =
            inner.shards[inner.shard_of(&keys[0])].lock().lookup(&keys[0], hash).unwrap();
        let Value::Content(id) = slot.value else { panic!("not a content page") };
        inner.store.write().corrupt(id);
        assert_eq!(e.take(keys[0], &mut one).unwrap(), Lookup::Miss);
        let stats = e.pool_stats(pool).unwrap();
        assert_eq!((stats.corruptions, stats.pages), (3, 2));
        e.validate();
    }
}
