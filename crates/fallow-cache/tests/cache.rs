//! The cache layer against a model, and against races: whatever the tiers hold, a read
//! returns what the backing store holds, and a read that starts after a write was
//! acknowledged never returns the older data.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use fallow_backing::{BackingStore, Capabilities, Durability, MemStore, Zeroing};
use fallow_cache::{CacheConfig, CacheLayer, Mode, PoolTier, WritePolicy};
use fallow_core::{AsyncPageStore, PoolSpec, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};
use proptest::prelude::*;

const SIZE: u64 = 64 * PAGE_SIZE as u64 + 1000; // a partial last page on purpose

async fn pool_tier() -> PoolTier {
    let engine =
        Arc::new(Engine::new(EngineBuilder::new(1 << 20).compress_interval(None).build().unwrap()));
    let pool = engine.create_pool(&PoolSpec::ephemeral()).await.unwrap();
    PoolTier { store: engine, pool, object: 1 }
}

#[derive(Debug, Clone)]
enum Op {
    Read(u64, u32),
    Write(u64, u32, u8),
    Zero(u64, u32),
    Trim(u64, u32),
    Flush,
}

fn range() -> impl Strategy<Value = (u64, u32)> {
    (0..SIZE, 1u32..(6 * PAGE_SIZE as u32)).prop_map(|(o, l)| (o, l.min((SIZE - o) as u32).max(1)))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => range().prop_map(|(o, l)| Op::Read(o, l)),
        3 => (range(), any::<u8>()).prop_map(|((o, l), b)| Op::Write(o, l, b)),
        1 => range().prop_map(|(o, l)| Op::Zero(o, l)),
        1 => range().prop_map(|(o, l)| Op::Trim(o, l)),
        1 => Just(Op::Flush),
    ]
}

async fn run(ops: Vec<Op>, mode: Mode, local_pages: usize, pool: bool, write: WritePolicy) {
    let backing = Arc::new(MemStore::new(SIZE));
    let pool = if pool { Some(pool_tier().await) } else { None };
    let config = CacheConfig { local_pages, mode, scan_bytes: 3 * PAGE_SIZE as u32, write };
    let cache = CacheLayer::new(backing.clone(), pool, config);
    let mut model = vec![0u8; SIZE as usize];
    for op in &ops {
        match *op {
            Op::Read(o, l) => {
                let got = cache.read(o, l).await.unwrap();
                assert_eq!(
                    &got[..],
                    &model[o as usize..o as usize + l as usize],
                    "{op:?} in {ops:?}"
                );
            }
            Op::Write(o, l, b) => {
                cache
                    .write(o, Bytes::from(vec![b; l as usize]), Durability::AtFlush)
                    .await
                    .unwrap();
                model[o as usize..o as usize + l as usize].fill(b);
            }
            Op::Zero(o, l) | Op::Trim(o, l) => {
                if matches!(op, Op::Zero(..)) {
                    cache.write_zeroes(o, l, Zeroing::KeepAllocated).await.unwrap();
                } else {
                    cache.trim(o, l).await.unwrap(); // MemStore trims read as zeros
                }
                model[o as usize..o as usize + l as usize].fill(0);
            }
            Op::Flush => {
                cache.flush().await.unwrap();
                // After a flush the store itself holds everything written.
                let stored = backing.read(0, SIZE as u32).await.unwrap();
                assert!(stored[..] == model[..], "the store after FLUSH differs from the model");
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn reads_always_return_what_the_store_holds(
        ops in prop::collection::vec(op(), 1..60),
        exclusive in any::<bool>(),
        local_pages in prop_oneof![Just(0usize), Just(4), Just(32)],
        pool in any::<bool>(),
        write_back in any::<bool>(),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let mode = if exclusive { Mode::Exclusive } else { Mode::Inclusive };
        let write = if write_back {
            // A small dirty limit, so writers also write back under pressure.
            WritePolicy::Back { max_dirty_bytes: 8 * PAGE_SIZE as u64, max_age: Duration::from_millis(5) }
        } else {
            WritePolicy::Through
        };
        rt.block_on(run(ops, mode, local_pages, pool, write));
    }
}

/// A store whose reads take a while, so that reads and writes overlap.
#[derive(Debug)]
struct SlowStore(MemStore);

#[async_trait]
impl BackingStore for SlowStore {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    async fn read(&self, offset: u64, len: u32) -> std::io::Result<Bytes> {
        let data = self.0.read(offset, len).await?;
        tokio::time::sleep(Duration::from_micros(300)).await;
        Ok(data)
    }
    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> std::io::Result<()> {
        tokio::time::sleep(Duration::from_micros(100)).await;
        self.0.write(offset, data, durability).await
    }
    async fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32) -> std::io::Result<()> {
        self.0.trim(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> std::io::Result<()> {
        self.0.write_zeroes(offset, len, zeroing).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_read_after_an_acknowledged_write_sees_older_data() {
    let back = WritePolicy::Back {
        max_dirty_bytes: 2 * PAGE_SIZE as u64,
        max_age: Duration::from_millis(2),
    };
    for (mode, write) in [
        (Mode::Exclusive, WritePolicy::Through),
        (Mode::Inclusive, WritePolicy::Through),
        (Mode::Exclusive, back),
    ] {
        let backing = Arc::new(SlowStore(MemStore::new(8 * PAGE_SIZE as u64)));
        let config = CacheConfig { local_pages: 2, mode, scan_bytes: 1 << 20, write };
        let cache = CacheLayer::new(backing, Some(pool_tier().await), config);
        // Pages 0..4 each hold a version number; each page has one writer (concurrent
        // writes to one page have no order), which bumps it; readers check that they see
        // at least the version acknowledged before they started.
        let acked: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());
        let mut tasks = Vec::new();
        for w in 0..2u64 {
            let (cache, acked) = (cache.clone(), acked.clone());
            tasks.push(tokio::spawn(async move {
                for round in 1..=150u64 {
                    let page = w + 2 * (round % 2);
                    let version = round;
                    let mut data = vec![0u8; PAGE_SIZE];
                    data[..8].copy_from_slice(&version.to_le_bytes());
                    cache
                        .write(page * PAGE_SIZE as u64, Bytes::from(data), Durability::AtFlush)
                        .await
                        .unwrap();
                    acked[page as usize].fetch_max(version, Ordering::SeqCst);
                }
            }));
        }
        for r in 0..4u64 {
            let (cache, acked) = (cache.clone(), acked.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..300u64 {
                    let page = (i + r) % 4;
                    let floor = acked[page as usize].load(Ordering::SeqCst);
                    let got = cache.read(page * PAGE_SIZE as u64, PAGE_SIZE as u32).await.unwrap();
                    let version = u64::from_le_bytes(got[..8].try_into().unwrap());
                    assert!(version >= floor, "{mode:?}: page {page} read version {version} after {floor} was acknowledged");
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        // Under write-back the readers may all finish while every page is still dirty
        // (the flusher ticks every 10 ms): the dirty set is the cache they used then.
        let stats = cache.stats();
        let cached = stats.local_hits.load(Ordering::Relaxed)
            + stats.pool_hits.load(Ordering::Relaxed)
            + stats.dirty_hits.load(Ordering::Relaxed);
        assert!(cached > 0, "{mode:?} {write:?}: no read was served by a cache: {stats:?}");
    }
}

/// A pool whose invalidations fail (a node that is unreachable for writes).
struct FlakyPool {
    inner: Arc<Engine>,
    fail_invalidate: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl AsyncPageStore for FlakyPool {
    async fn create_pool(
        &self,
        spec: &PoolSpec,
    ) -> Result<fallow_core::PoolId, fallow_core::StoreError> {
        self.inner.create_pool(spec).await
    }
    async fn destroy_pool(&self, pool: fallow_core::PoolId) -> Result<(), fallow_core::StoreError> {
        AsyncPageStore::destroy_pool(&*self.inner, pool).await
    }
    async fn put_many(
        &self,
        keys: &[fallow_core::PageKey],
        pages: Bytes,
    ) -> Result<Vec<fallow_core::PutOutcome>, fallow_core::StoreError> {
        AsyncPageStore::put_many(&*self.inner, keys, pages).await
    }
    async fn get_many(
        &self,
        keys: &[fallow_core::PageKey],
    ) -> Result<Vec<Option<Bytes>>, fallow_core::StoreError> {
        AsyncPageStore::get_many(&*self.inner, keys).await
    }
    async fn take_many(
        &self,
        keys: &[fallow_core::PageKey],
    ) -> Result<Vec<Option<Bytes>>, fallow_core::StoreError> {
        AsyncPageStore::take_many(&*self.inner, keys).await
    }
    async fn invalidate_pages(
        &self,
        keys: &[fallow_core::PageKey],
    ) -> Result<(), fallow_core::StoreError> {
        if self.fail_invalidate.load(Ordering::SeqCst) {
            return Err(fallow_core::StoreError::Unavailable("injected".into()));
        }
        AsyncPageStore::invalidate_pages(&*self.inner, keys).await
    }
    async fn invalidate_object(
        &self,
        pool: fallow_core::PoolId,
        object: u64,
    ) -> Result<u64, fallow_core::StoreError> {
        if self.fail_invalidate.load(Ordering::SeqCst) {
            return Err(fallow_core::StoreError::Unavailable("injected".into()));
        }
        AsyncPageStore::invalidate_object(&*self.inner, pool, object).await
    }
    async fn invalidate_pool(
        &self,
        pool: fallow_core::PoolId,
    ) -> Result<u64, fallow_core::StoreError> {
        AsyncPageStore::invalidate_pool(&*self.inner, pool).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_cannot_invalidate_is_skipped_until_cleared() {
    let engine =
        Arc::new(Engine::new(EngineBuilder::new(1 << 20).compress_interval(None).build().unwrap()));
    let pool_id = engine.create_pool(&PoolSpec::ephemeral()).await.unwrap();
    let flaky = Arc::new(FlakyPool { inner: engine, fail_invalidate: false.into() });
    let tier = PoolTier { store: flaky.clone(), pool: pool_id, object: 9 };
    let backing = Arc::new(MemStore::new(4 * PAGE_SIZE as u64));
    // Inclusive, no local tier: every read is served by the pool once populated.
    let config = CacheConfig {
        local_pages: 0,
        mode: Mode::Inclusive,
        scan_bytes: 1 << 20,
        write: WritePolicy::Through,
    };
    let cache = CacheLayer::new(backing, Some(tier), config);
    cache.write(0, Bytes::from(vec![1u8; PAGE_SIZE]), Durability::AtFlush).await.unwrap();
    assert_eq!(cache.read(0, 4096).await.unwrap()[0], 1); // populates the pool
    assert_eq!(cache.read(0, 4096).await.unwrap()[0], 1);
    assert_eq!(cache.stats().pool_hits.load(Ordering::Relaxed), 1);
    // Now the pool cannot invalidate: the write still succeeds, the stale copy stays in
    // the pool, and reads must not use it.
    flaky.fail_invalidate.store(true, Ordering::SeqCst);
    cache.write(0, Bytes::from(vec![2u8; PAGE_SIZE]), Durability::AtFlush).await.unwrap();
    assert!(!cache.pool_trusted());
    assert_eq!(cache.read(0, 4096).await.unwrap()[0], 2, "never the stale pool copy");
    // Once the pool works again the keeper clears the export's pages and trusts it.
    flaky.fail_invalidate.store(false, Ordering::SeqCst);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cache.pool_trusted() {
        assert!(std::time::Instant::now() < deadline, "trust never restored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(cache.read(0, 4096).await.unwrap()[0], 2);
    assert_eq!(cache.read(0, 4096).await.unwrap()[0], 2);
}

#[tokio::test]
async fn write_back_keeps_writes_in_memory_until_flush_or_age() {
    let backing = Arc::new(MemStore::new(16 * PAGE_SIZE as u64));
    let write = WritePolicy::Back { max_dirty_bytes: 1 << 20, max_age: Duration::from_millis(200) };
    let config = CacheConfig { local_pages: 4, mode: Mode::Exclusive, scan_bytes: 1 << 20, write };
    let cache = CacheLayer::new(backing.clone(), None, config);
    cache.write(0, Bytes::from(vec![9u8; 3 * PAGE_SIZE]), Durability::AtFlush).await.unwrap();
    cache.write(5000, Bytes::from(vec![7u8; 10]), Durability::AtFlush).await.unwrap(); // a partial page
    assert_eq!(backing.read(0, 1).await.unwrap()[0], 0, "acknowledged from memory");
    let got = cache.read(0, 3 * PAGE_SIZE as u32).await.unwrap();
    assert!(got[..5000].iter().all(|b| *b == 9) && got[5000..5010].iter().all(|b| *b == 7));
    cache.flush().await.unwrap();
    let stored = backing.read(0, 3 * PAGE_SIZE as u32).await.unwrap();
    assert_eq!(stored, got, "FLUSH wrote everything");
    // FUA is durable at once.
    cache
        .write(8 * PAGE_SIZE as u64, Bytes::from(vec![3u8; PAGE_SIZE]), Durability::Immediate)
        .await
        .unwrap();
    assert_eq!(backing.read(8 * PAGE_SIZE as u64, 1).await.unwrap()[0], 3);
    // Without FLUSH, the flusher writes pages out once they are older than max_age.
    cache
        .write(12 * PAGE_SIZE as u64, Bytes::from(vec![5u8; PAGE_SIZE]), Durability::AtFlush)
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while backing.read(12 * PAGE_SIZE as u64, 1).await.unwrap()[0] != 5 {
        assert!(std::time::Instant::now() < deadline, "the flusher never wrote the page");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(cache.stats().written_back.load(Ordering::Relaxed) >= 5);
}

/// A store that counts how many writes it has in flight at once (each takes a while), and
/// fails every write that starts at `fail_at` while that is set.
#[derive(Debug)]
struct CountingStore {
    inner: MemStore,
    in_flight: AtomicU64,
    most_in_flight: AtomicU64,
    fail_at: std::sync::Mutex<Option<u64>>,
}

#[async_trait]
impl BackingStore for CountingStore {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn read(&self, offset: u64, len: u32) -> std::io::Result<Bytes> {
        self.inner.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> std::io::Result<()> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_in_flight.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(5)).await;
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        if *self.fail_at.lock().unwrap() == Some(offset) {
            return Err(std::io::Error::other("injected write failure"));
        }
        self.inner.write(offset, data, durability).await
    }
    async fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32) -> std::io::Result<()> {
        self.inner.trim(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len, zeroing).await
    }
}

/// 64 dirty runs of one page each (every other page), and a write-back cache over `store`.
async fn scattered_dirty_pages(store: Arc<CountingStore>) -> CacheLayer {
    let write = WritePolicy::Back { max_dirty_bytes: 1 << 30, max_age: Duration::from_secs(3600) };
    let config = CacheConfig { local_pages: 0, mode: Mode::Exclusive, scan_bytes: 1 << 20, write };
    let cache = CacheLayer::new(store, None, config);
    for run in 0..64u64 {
        let page = Bytes::from(vec![run as u8 + 1; PAGE_SIZE]);
        cache.write(2 * run * PAGE_SIZE as u64, page, Durability::AtFlush).await.unwrap();
    }
    cache
}

fn counting_store() -> Arc<CountingStore> {
    Arc::new(CountingStore {
        inner: MemStore::new(128 * PAGE_SIZE as u64),
        in_flight: AtomicU64::new(0),
        most_in_flight: AtomicU64::new(0),
        fail_at: std::sync::Mutex::new(None),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_writes_scattered_dirty_runs_in_parallel() {
    let store = counting_store();
    let cache = scattered_dirty_pages(store.clone()).await;
    cache.flush().await.unwrap();
    let most = store.most_in_flight.load(Ordering::SeqCst);
    assert!(most > 1, "runs were written one at a time");
    assert!(most <= 16, "{most} runs in flight: more than the write-back's limit");
    for run in 0..64u64 {
        let got = store.inner.read(2 * run * PAGE_SIZE as u64, PAGE_SIZE as u32).await.unwrap();
        assert!(got.iter().all(|b| *b == run as u8 + 1), "run {run} was not written back");
    }
    assert_eq!(cache.stats().written_back.load(Ordering::Relaxed), 64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_back_run_stays_dirty_and_the_flush_reports_it() {
    let store = counting_store();
    let cache = scattered_dirty_pages(store.clone()).await;
    let failing = 2 * 10 * PAGE_SIZE as u64;
    *store.fail_at.lock().unwrap() = Some(failing);
    let err = cache.flush().await.expect_err("a flush whose write-back failed succeeded");
    assert!(err.to_string().contains("injected"), "{err}");
    assert_eq!(store.inner.read(failing, 1).await.unwrap()[0], 0, "the failed run was stored");
    // The store recovers: the next flush writes what is still dirty, the failed run too.
    *store.fail_at.lock().unwrap() = None;
    cache.flush().await.unwrap();
    assert_eq!(store.inner.read(failing, 1).await.unwrap()[0], 11);
    for run in 0..64u64 {
        let got = cache.read(2 * run * PAGE_SIZE as u64, 1).await.unwrap();
        assert_eq!(got[0], run as u8 + 1);
    }
}

#[tokio::test]
async fn a_page_written_back_stays_cached_as_a_clean_page() {
    let store = counting_store();
    let write = WritePolicy::Back { max_dirty_bytes: 1 << 30, max_age: Duration::from_secs(3600) };
    let config = CacheConfig { local_pages: 16, mode: Mode::Exclusive, scan_bytes: 1 << 20, write };
    let cache = CacheLayer::new(store.clone(), Some(pool_tier().await), config);
    cache.write(0, Bytes::from(vec![4u8; 8 * PAGE_SIZE]), Durability::AtFlush).await.unwrap();
    cache.flush().await.unwrap();
    assert_eq!(store.inner.read(0, 1).await.unwrap()[0], 4, "the flush wrote the pages");
    let got = cache.read(0, 8 * PAGE_SIZE as u32).await.unwrap();
    assert!(got.iter().all(|b| *b == 4));
    let stats = cache.stats();
    assert_eq!(stats.misses.load(Ordering::Relaxed), 0, "a written-back page was read again");
    assert_eq!(stats.local_hits.load(Ordering::Relaxed), 8);
}

/// A store whose reads fail while `fail_reads` is set (an upstream that answers EIO).
#[derive(Debug)]
struct ReadFailStore {
    inner: MemStore,
    fail_reads: std::sync::atomic::AtomicBool,
}

#[async_trait]
impl BackingStore for ReadFailStore {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn read(&self, offset: u64, len: u32) -> std::io::Result<Bytes> {
        if self.fail_reads.load(Ordering::SeqCst) {
            return Err(std::io::Error::other("injected read failure"));
        }
        self.inner.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> std::io::Result<()> {
        self.inner.write(offset, data, durability).await
    }
    async fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32) -> std::io::Result<()> {
        self.inner.trim(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len, zeroing).await
    }
}

/// A write-back write of a whole page and part of the next one, whose partial page must be
/// read from the store to be merged: when that read fails, the write fails and changes
/// nothing. (It used to leave the whole page dirty with the pool's older copy of it still
/// there, not invalidated; once written back and dropped from the dirty set, reads served
/// that older copy while the store held the new one.)
#[tokio::test]
async fn a_write_back_write_whose_merge_read_fails_changes_nothing() {
    for mode in [Mode::Inclusive, Mode::Exclusive] {
        let store = Arc::new(ReadFailStore {
            inner: MemStore::new(8 * PAGE_SIZE as u64),
            fail_reads: false.into(),
        });
        let write =
            WritePolicy::Back { max_dirty_bytes: 1 << 30, max_age: Duration::from_secs(3600) };
        // No local tier: the pool holds what reads fetched, in either mode.
        let config = CacheConfig { local_pages: 0, mode, scan_bytes: 1 << 20, write };
        let cache = CacheLayer::new(store.clone(), Some(pool_tier().await), config);
        cache.write(0, Bytes::from(vec![1u8; 2 * PAGE_SIZE]), Durability::AtFlush).await.unwrap();
        cache.flush().await.unwrap();
        assert_eq!(cache.read(0, 4096).await.unwrap()[0], 1, "page 0 into the pool");

        store.fail_reads.store(true, Ordering::SeqCst);
        let err = cache
            .write(0, Bytes::from(vec![2u8; PAGE_SIZE + 100]), Durability::AtFlush)
            .await
            .expect_err("a write whose merge read failed was acknowledged");
        assert!(err.to_string().contains("injected"), "{err}");
        store.fail_reads.store(false, Ordering::SeqCst);

        cache.flush().await.unwrap();
        let stored = store.inner.read(0, 2 * PAGE_SIZE as u32).await.unwrap();
        for _ in 0..2 {
            let got = cache.read(0, 2 * PAGE_SIZE as u32).await.unwrap();
            assert!(
                got == stored,
                "{mode:?}: the cache serves {} where the store has {}",
                got[0],
                stored[0]
            );
        }
        assert!(stored.iter().all(|b| *b == 1), "{mode:?}: the failed write reached the store");
    }
}

/// A store that applies a write at once but, for writes of `slow_byte`, answers only
/// after a while: the answer to an earlier write can arrive after that to a later one
/// (two upstream connections, two threads of a file store).
#[derive(Debug)]
struct LateAnswerStore {
    inner: MemStore,
    slow_byte: u8,
}

#[async_trait]
impl BackingStore for LateAnswerStore {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn read(&self, offset: u64, len: u32) -> std::io::Result<Bytes> {
        self.inner.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> std::io::Result<()> {
        let slow = data[0] == self.slow_byte;
        self.inner.write(offset, data, durability).await?;
        if slow {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }
    async fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32) -> std::io::Result<()> {
        self.inner.trim(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len, zeroing).await
    }
}

/// Two overlapping write-through writes of one page: the store applies the first, then
/// the second, but answers the first last. Either may win, but the cache must then hold
/// what the store holds, or nothing: a local copy of the loser would be read until it is
/// evicted, and the store's page after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_writes_of_a_page_leave_the_cache_agreeing_with_the_store() {
    let store =
        Arc::new(LateAnswerStore { inner: MemStore::new(4 * PAGE_SIZE as u64), slow_byte: 1 });
    let config = CacheConfig {
        local_pages: 4,
        mode: Mode::Exclusive,
        scan_bytes: 1 << 20,
        write: WritePolicy::Through,
    };
    let cache = CacheLayer::new(store.clone(), None, config);
    let first = {
        let cache = cache.clone();
        tokio::spawn(async move {
            cache.write(0, Bytes::from(vec![1u8; PAGE_SIZE]), Durability::AtFlush).await
        })
    };
    tokio::time::sleep(Duration::from_millis(10)).await; // the first is in the store
    cache.write(0, Bytes::from(vec![2u8; PAGE_SIZE]), Durability::AtFlush).await.unwrap();
    first.await.unwrap().unwrap();
    let stored = store.inner.read(0, 1).await.unwrap()[0];
    assert_eq!(stored, 2, "the store applied the writes in order");
    assert_eq!(cache.read(0, 1).await.unwrap()[0], stored, "the cache and the store differ");
}

/// A store whose zeroings and trims wait, once entered, until the test lets them go.
#[derive(Debug)]
struct HeldDiscardStore {
    inner: MemStore,
    entered: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

impl HeldDiscardStore {
    async fn hold(&self) {
        self.entered.notify_one();
        self.release.notified().await;
    }
}

#[async_trait]
impl BackingStore for HeldDiscardStore {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn read(&self, offset: u64, len: u32) -> std::io::Result<Bytes> {
        self.inner.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> std::io::Result<()> {
        self.inner.write(offset, data, durability).await
    }
    async fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32) -> std::io::Result<()> {
        self.hold().await;
        self.inner.trim(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> std::io::Result<()> {
        self.hold().await;
        self.inner.write_zeroes(offset, len, zeroing).await
    }
}

/// A write-back write of part of a page, made while a WRITE_ZEROES of that page is in
/// the store: the write merges its bytes with the page as it was before the zeroing
/// (from the store, or the local tier) and makes the page dirty. The zeroing must apply
/// to that dirty copy too; otherwise the copy's write-back, after the store zeroed the
/// page, brings the zeroed bytes back, and a FLUSH after both were acknowledged makes
/// the lost zeroing durable (found by the crash-state enumeration,
/// `tests/crash_states.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partial_write_racing_a_zeroing_of_its_page_does_not_bring_back_zeroed_bytes() {
    for (local_pages, trim) in [(0, false), (4, false), (0, true), (4, true)] {
        let store = Arc::new(HeldDiscardStore {
            inner: MemStore::new(4 * PAGE_SIZE as u64),
            entered: tokio::sync::Notify::new(),
            release: tokio::sync::Notify::new(),
        });
        store
            .inner
            .write(0, Bytes::from(vec![0xaa; PAGE_SIZE]), Durability::AtFlush)
            .await
            .unwrap();
        let write =
            WritePolicy::Back { max_dirty_bytes: 1 << 20, max_age: Duration::from_secs(60) };
        let config = CacheConfig { local_pages, mode: Mode::Exclusive, scan_bytes: 1 << 20, write };
        let cache = CacheLayer::new(store.clone(), None, config);
        assert_eq!(cache.read(0, 1).await.unwrap()[0], 0xaa); // cached when there is a tier
        let discard = {
            let cache = cache.clone();
            tokio::spawn(async move {
                if trim {
                    cache.trim(0, PAGE_SIZE as u32).await
                } else {
                    cache.write_zeroes(0, PAGE_SIZE as u32, Zeroing::MayDeallocate).await
                }
            })
        };
        store.entered.notified().await; // the zeroing is in the store, not yet done
        cache.write(0, Bytes::from(vec![0xbb; 10]), Durability::AtFlush).await.unwrap();
        store.release.notify_one();
        discard.await.unwrap().unwrap();
        cache.flush().await.unwrap();
        // The write and the zeroing overlapped: either came first, so the write's 10
        // bytes are 0xbb or zeros, and the rest of the page is zeros in any case.
        let what = if trim { "trimmed" } else { "zeroed" };
        for (name, page) in [
            ("the store", store.inner.read(0, PAGE_SIZE as u32).await.unwrap()),
            ("the cache", cache.read(0, PAGE_SIZE as u32).await.unwrap()),
        ] {
            assert!(
                page[..10].iter().all(|b| *b == 0xbb) || page[..10].iter().all(|b| *b == 0),
                "{name}, local tier {local_pages}: {:?}",
                &page[..10]
            );
            assert!(
                page[10..].iter().all(|b| *b == 0),
                "{name}, local tier {local_pages}: bytes the {what} page held came back"
            );
        }
    }
}

/// A store that zeroes at once but answers a zeroing only when the test lets it.
#[derive(Debug)]
struct LateZeroStore {
    inner: MemStore,
    zeroed: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

#[async_trait]
impl BackingStore for LateZeroStore {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn read(&self, offset: u64, len: u32) -> std::io::Result<Bytes> {
        self.inner.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> std::io::Result<()> {
        self.inner.write(offset, data, durability).await
    }
    async fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32) -> std::io::Result<()> {
        self.inner.trim(offset, len).await
    }
    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> std::io::Result<()> {
        self.inner.write_zeroes(offset, len, zeroing).await?;
        self.zeroed.notify_one();
        self.release.notified().await;
        Ok(())
    }
}

/// A write-back pass (here a FLUSH's) that writes a page while a WRITE_ZEROES of it is in
/// the store: the store may apply the two in either order, and the page the pass holds
/// is older than the zeroing (a partial write merged it with the local tier's copy while
/// the store was zeroing). No pass may write a page of a discard in flight, or the store
/// keeps the older bytes once the zeroing is acknowledged (found by the crash-state
/// enumeration, `tests/crash_states.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_back_pass_during_a_zeroing_of_its_page_does_not_undo_it() {
    let store = Arc::new(LateZeroStore {
        inner: MemStore::new(4 * PAGE_SIZE as u64),
        zeroed: tokio::sync::Notify::new(),
        release: tokio::sync::Notify::new(),
    });
    let write = WritePolicy::Back { max_dirty_bytes: 1 << 20, max_age: Duration::from_secs(60) };
    let config = CacheConfig { local_pages: 4, mode: Mode::Exclusive, scan_bytes: 1 << 20, write };
    let cache = CacheLayer::new(store.clone(), None, config);
    // Dirty; the zeroing writes it back first, and it stays in the local tier, clean.
    cache.write(0, Bytes::from(vec![0xaa; PAGE_SIZE]), Durability::AtFlush).await.unwrap();
    let zeroing = {
        let cache = cache.clone();
        tokio::spawn(async move {
            cache.write_zeroes(0, PAGE_SIZE as u32, Zeroing::MayDeallocate).await
        })
    };
    store.zeroed.notified().await; // zeroed in the store, not yet answered
    cache.write(0, Bytes::from(vec![0xbb; 10]), Durability::AtFlush).await.unwrap();
    let flush = {
        let cache = cache.clone();
        tokio::spawn(async move { cache.flush().await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await; // time for the FLUSH to write
    store.release.notify_one();
    zeroing.await.unwrap().unwrap();
    flush.await.unwrap().unwrap();
    cache.flush().await.unwrap();
    for (name, page) in [
        ("the store", store.inner.read(0, PAGE_SIZE as u32).await.unwrap()),
        ("the cache", cache.read(0, PAGE_SIZE as u32).await.unwrap()),
    ] {
        assert!(
            page[..10].iter().all(|b| *b == 0xbb) || page[..10].iter().all(|b| *b == 0),
            "{name}: {:?}",
            &page[..10]
        );
        assert!(page[10..].iter().all(|b| *b == 0), "{name}: bytes the zeroed page held came back");
    }
}
