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
