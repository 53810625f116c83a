//! One conformance suite for every backing store: random reads, writes, trims and zeroing
//! against a byte-vector model (`support/mod.rs`, shared with `rados.rs`), plus the edges
//! (out-of-range, read-only, block status of a sparse image, creating and reopening images).

use fallow_backing::{Durability, Zeroing};
use fallow_testkit::backing_model as support;

use std::path::PathBuf;

use bytes::Bytes;
use fallow_backing::{BackingStore, FileStore, MemStore};
use proptest::prelude::*;
use support::{check, op, Geometry, SIZE};

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("fallow-backing-{}-{name}-{}", std::process::id(), rand_id()))
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::Instant::now())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn mem_store_matches_the_model(ops in prop::collection::vec(op(Geometry::SMALL), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let store = MemStore::new(SIZE);
        rt.block_on(check(&store, &ops));
    }

    #[test]
    fn file_store_matches_the_model(ops in prop::collection::vec(op(Geometry::SMALL), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let path = temp("model");
        let store = FileStore::open_or_create(&path, SIZE).unwrap();
        rt.block_on(check(&store, &ops));
        std::fs::remove_file(path).unwrap();
    }
}

#[tokio::test]
async fn out_of_range_is_an_error_everywhere() {
    let path = temp("range");
    let file = FileStore::open_or_create(&path, SIZE).unwrap();
    let mem = MemStore::new(SIZE);
    for store in [&file as &dyn BackingStore, &mem] {
        assert!(store.read(SIZE - 1, 2).await.is_err());
        assert!(store.read(u64::MAX, 1).await.is_err());
        assert!(store.write(SIZE, Bytes::from_static(b"x"), Durability::AtFlush).await.is_err());
        assert!(store.write_zeroes(SIZE - 10, 11, Zeroing::KeepAllocated).await.is_err());
        assert!(store.trim(SIZE, 1).await.is_err());
        assert!(store.read(SIZE - 1, 1).await.is_ok());
    }
    std::fs::remove_file(path).unwrap();
}

#[tokio::test]
async fn images_are_sparse_and_block_status_tells_holes_from_data() {
    let path = temp("sparse");
    let size = 16 << 20;
    let store = FileStore::open_or_create(&path, size).unwrap();
    let meta = std::fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), size);
    use std::os::unix::fs::MetadataExt;
    assert!(meta.blocks() * 512 < size / 4, "a new image is sparse");
    store.write(4 << 20, Bytes::from(vec![1u8; 1 << 20]), Durability::AtFlush).await.unwrap();
    let extents = store.block_status(0, 8 << 20).await.unwrap();
    let total: u64 = extents.iter().map(|e| e.length).sum();
    assert_eq!(total, 8 << 20);
    assert!(extents[0].hole && extents[0].zero, "{extents:?}");
    let data = extents.iter().find(|e| !e.hole).expect("a data extent");
    assert!(data.length >= 1 << 20, "{extents:?}");
    // Trimming the data makes it a hole that reads as zeros.
    store.trim(4 << 20, 1 << 20).await.unwrap();
    assert!(store.read(4 << 20, 4096).await.unwrap().iter().all(|b| *b == 0));
    let extents = store.block_status(0, 8 << 20).await.unwrap();
    assert!(extents.iter().all(|e| e.hole), "{extents:?}");
    std::fs::remove_file(path).unwrap();
}

#[tokio::test]
async fn reopening_keeps_data_and_refuses_a_different_size() {
    let path = temp("reopen");
    let store = FileStore::open_or_create(&path, SIZE).unwrap();
    store.write(100, Bytes::from_static(b"kept"), Durability::Immediate).await.unwrap();
    drop(store);
    let again = FileStore::open_or_create(&path, SIZE).unwrap();
    assert_eq!(&again.read(100, 4).await.unwrap()[..], b"kept");
    let err = FileStore::open_or_create(&path, SIZE * 2).unwrap_err();
    assert!(err.to_string().contains("exists with"), "{err}");
    let ro = FileStore::open(&path, true).unwrap();
    assert!(ro.capabilities().read_only);
    let err = ro.write(0, Bytes::from_static(b"x"), Durability::AtFlush).await.unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied);
    let err = FileStore::open(&temp("missing"), false).unwrap_err();
    assert!(err.to_string().contains("cannot open"), "{err}");
    std::fs::remove_file(path).unwrap();
}

#[tokio::test]
async fn mem_store_trim_frees_whole_pages() {
    let store = MemStore::new(SIZE);
    store.write(0, Bytes::from(vec![7u8; 3 * 4096]), Durability::AtFlush).await.unwrap();
    assert_eq!(store.allocated_pages(), 3);
    store.trim(4096, 4096).await.unwrap();
    assert_eq!(store.allocated_pages(), 2);
    let extents = store.block_status(0, 3 * 4096).await.unwrap();
    assert_eq!(extents.len(), 3);
    assert!(!extents[0].hole && extents[1].hole && !extents[2].hole);
}
