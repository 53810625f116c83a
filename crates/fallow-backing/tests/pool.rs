//! The pool store (`PoolStore`, `--export NAME=pool:SIZE`) over the in-process engine: the
//! backing model with whole-page changes, holes and zeros in block status, unaligned
//! changes refused, and a full pool answering `ENOSPC` without losing earlier writes.

use std::sync::Arc;

use bytes::Bytes;
use fallow_backing::{BackingStore, Durability, PoolStore, Zeroing};
use fallow_core::{AsyncPageStore, PoolSpec, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};
use fallow_testkit::backing_model::{aligned, check, op, Geometry, SIZE};
use proptest::prelude::*;

/// A pool store of `size` bytes in a fresh engine lending `budget` bytes, its pool
/// persistent with a quota of the device's pages.
async fn store(size: u64, budget: usize) -> (PoolStore, Arc<Engine>) {
    let engine = Arc::new(Engine::new(EngineBuilder::new(budget).build().unwrap()));
    let spec = PoolSpec { quota_pages: Some(size / PAGE_SIZE as u64), ..PoolSpec::persistent() };
    let pool = AsyncPageStore::create_pool(&*engine, &spec).await.unwrap();
    (PoolStore::new(engine.clone(), pool, 0, size).unwrap(), engine)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn pool_store_matches_the_model(ops in prop::collection::vec(op(Geometry::SMALL), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let ops: Vec<_> = ops.into_iter().map(|o| aligned(o, PAGE_SIZE as u64, SIZE)).collect();
        rt.block_on(async {
            let (store, _engine) = store(SIZE, 8 << 20).await;
            check(&store, &ops).await;
        });
    }
}

#[tokio::test]
async fn unwritten_pages_are_holes_and_zero_pages_cost_no_frame() {
    let (store, engine) = store(1 << 20, 8 << 20).await;
    assert!(store.read(0, 1 << 20).await.unwrap().iter().all(|b| *b == 0));
    store.write(8192, Bytes::from(vec![7u8; 8192]), Durability::AtFlush).await.unwrap();
    store.write_zeroes(65536, 4096, Zeroing::KeepAllocated).await.unwrap();
    let extents = store.block_status(0, 69632).await.unwrap();
    let shape: Vec<(u64, bool, bool)> =
        extents.iter().map(|e| (e.length, e.hole, e.zero)).collect();
    assert_eq!(
        shape,
        [(8192, true, true), (8192, false, false), (49152, true, true), (4096, false, true)]
    );
    // Unaligned starts and ends are reported within the range asked.
    let extents = store.block_status(10000, 100).await.unwrap();
    assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), 100);
    // The zero page is held as a fill: one frame for the two pages of sevens, none for it.
    let stats = engine.stats();
    assert_eq!(stats.pages, 3, "{stats:?}");
    // Trimming a page makes it a hole again.
    store.trim(8192, 4096).await.unwrap();
    assert!(store.block_status(8192, 4096).await.unwrap()[0].hole);
    assert!(store.read(8192, 4096).await.unwrap().iter().all(|b| *b == 0));
}

#[tokio::test]
async fn changes_that_are_not_whole_pages_are_refused() {
    let (store, _engine) = store(1 << 20, 8 << 20).await;
    assert_eq!(store.min_block_size(), 4096);
    let err =
        store.write(512, Bytes::from(vec![1u8; 4096]), Durability::AtFlush).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("whole 4 KiB pages"), "{err}");
    let err = store.trim(0, 100).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
    let err = store.write_zeroes(4096, 4095, Zeroing::MayDeallocate).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
    let err = store.read(1 << 20, 1).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
    assert!(PoolStore::new(
        Arc::new(Engine::new(EngineBuilder::new(0).build().unwrap())),
        fallow_core::PoolId(1),
        0,
        1000
    )
    .is_err());
}

#[tokio::test]
async fn a_full_pool_answers_enospc_and_keeps_what_it_held() {
    // 16 MiB of device in a pool that lends 1 MiB: the writes stop with ENOSPC.
    let (store, _engine) = store(16 << 20, 1 << 20).await;
    let page = |i: u64| Bytes::from(vec![(i % 251) as u8 + 1; PAGE_SIZE]);
    let mut stored = 0;
    let err = loop {
        assert!(stored < 4096, "the pool never filled");
        match store.write(stored * 4096, page(stored), Durability::AtFlush).await {
            Ok(()) => stored += 1,
            Err(err) => break err,
        }
    };
    assert_eq!(err.kind(), std::io::ErrorKind::StorageFull, "{err}");
    assert!(err.to_string().contains("full"), "{err}");
    assert!(stored > 100, "only {stored} pages fit in 1 MiB");
    for i in 0..stored {
        assert_eq!(store.read(i * 4096, 4096).await.unwrap(), page(i), "page {i}");
    }
    // An overwrite of a stored page still fits: its old frame is given back first.
    store.write(0, page(7), Durability::AtFlush).await.unwrap();
    assert_eq!(store.read(0, 4096).await.unwrap(), page(7));
}

/// A pool store in a fresh engine, backed up into the file at `path` (created if missing).
async fn backed_up(path: &std::path::Path, size: u64) -> (PoolStore, Arc<Engine>) {
    let (store, engine) = store(size, 8 << 20).await;
    let file = fallow_backing::FileStore::open_or_create(path, size).unwrap();
    (store.with_backup(file, 64 << 10).unwrap(), engine)
}

fn temp(name: &str) -> std::path::PathBuf {
    use std::hash::{BuildHasher, RandomState};
    let id = RandomState::new().hash_one(std::time::Instant::now());
    std::env::temp_dir().join(format!("fallow-pool-backup-{}-{name}-{id}", std::process::id()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// With a backup, the store still matches the model; after a flush the file alone, under
    /// a new and empty pool, gives back the same disk.
    #[test]
    fn a_backed_up_pool_store_matches_the_model_and_its_file_holds_the_disk(
        ops in prop::collection::vec(op(Geometry::SMALL), 1..40)
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let ops: Vec<_> = ops.into_iter().map(|o| aligned(o, PAGE_SIZE as u64, SIZE)).collect();
        let path = temp("model");
        rt.block_on(async {
            let (store, _engine) = backed_up(&path, SIZE).await;
            check(&store, &ops).await;
            let disk = store.read(0, SIZE as u32).await.unwrap();
            store.flush().await.unwrap();
            let (again, _engine) = backed_up(&path, SIZE).await;
            assert_eq!(again.read(0, SIZE as u32).await.unwrap(), disk);
        });
        std::fs::remove_file(&path).unwrap();
    }
}

#[tokio::test]
async fn a_pool_that_loses_its_pages_is_read_from_what_is_on_its_way_and_the_file() {
    let path = temp("lost");
    let (store, engine) = backed_up(&path, 1 << 20).await;
    let page = |b: u8| Bytes::from(vec![b; PAGE_SIZE]);
    for i in 0..64u64 {
        store.write(i * 4096, page(i as u8 + 1), Durability::AtFlush).await.unwrap();
    }
    store.write_zeroes(4096, 4096, Zeroing::MayDeallocate).await.unwrap();
    // Every page of the pool gone at once, flushed or not: the store reads on.
    AsyncPageStore::invalidate_pool(&*engine, store.pool()).await.unwrap();
    for i in 0..64u64 {
        let want = if i == 1 { page(0) } else { page(i as u8 + 1) };
        assert_eq!(store.read(i * 4096, 4096).await.unwrap(), want, "page {i}");
    }
    store.flush().await.unwrap();
    assert_eq!(store.read(0, 8192).await.unwrap()[4096..], page(0)[..]);
    // Block status is not offered: a hole in the pool may be data in the file.
    assert!(!store.capabilities().block_status && store.capabilities().flush);
    std::fs::remove_file(&path).unwrap();
}

#[tokio::test]
async fn a_backup_of_another_size_is_refused() {
    let path = temp("size");
    let (store, _engine) = store(1 << 20, 8 << 20).await;
    let file = fallow_backing::FileStore::open_or_create(&path, 2 << 20).unwrap();
    let err = store.with_backup(file, 1 << 20).unwrap_err();
    assert!(err.to_string().contains("the backup file holds"), "{err}");
    std::fs::remove_file(&path).unwrap();
}
