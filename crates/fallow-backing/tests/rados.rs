//! The RADOS store against a live single-node Ceph cluster, started here and torn down by
//! the daemons' PIDs when the test ends, failed or not (`tests/ceph/`): the shared model
//! (`support/`) with requests that cross object boundaries, the object layout as the
//! `rados` tool sees it, holes and trims, reopening, requests in parallel, and the errors
//! an operator sees. Built with the `rados` feature only; skips when Ceph is not installed.
//!
//! One test function brings the cluster up once (about 6 s) and runs every part in turn.
#![cfg(feature = "rados")]

use fallow_backing::{Durability, Zeroing};
use fallow_testkit::backing_model as support;

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fallow_backing::rados::{RadosConfig, RadosError, RadosStore, OBJECT_SIZE};
use fallow_backing::{BackingStore, Extent};
use fallow_testkit::ceph::CephCluster;
use proptest::prelude::*;
use proptest::test_runner::TestRunner;
use support::{check, op, pattern, Geometry};
use tokio::runtime::Runtime;

/// Every image of these tests lives in this namespace of the pool.
const NS: &str = "backing-tests";
const MIB: u64 = 1 << 20;

fn config(cluster: &CephCluster, prefix: &str) -> RadosConfig {
    RadosConfig::new(CephCluster::POOL, prefix).namespace(NS).conf(cluster.conf())
}

async fn open(cluster: &CephCluster, prefix: &str, size: Option<u64>) -> RadosStore {
    RadosStore::open(&config(cluster, prefix), size).await.unwrap()
}

/// Whether object `name` exists (in the tests' namespace).
fn exists(cluster: &CephCluster, name: &str) -> bool {
    cluster.rados(&["-N", NS, "stat", name]).0
}

#[test]
fn rados_store_against_a_live_cluster() {
    let started = Instant::now();
    let Some(cluster) = CephCluster::start("backing") else { return };
    eprintln!("cluster up in {:?}", started.elapsed());
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let part = |name: &str, since: Instant| eprintln!("{name}: {:?}", since.elapsed());
    let t = Instant::now();
    matches_the_model(&cluster, &rt);
    part("model", t);
    let t = Instant::now();
    rt.block_on(lays_out_objects_as_documented(&cluster));
    rt.block_on(reports_holes_and_trims_whole_objects(&cluster));
    rt.block_on(reopens_and_checks_the_size(&cluster));
    rt.block_on(runs_requests_in_parallel(&cluster));
    part("layout, holes, reopening, parallel", t);
    let t = Instant::now();
    rt.block_on(says_what_is_wrong(&cluster));
    part("errors", t);
}

/// The model of every store, on an image of three objects and a bit, with requests of up
/// to 1.5 objects that often start near an object boundary.
fn matches_the_model(cluster: &CephCluster, rt: &Runtime) {
    let g = Geometry {
        size: 3 * OBJECT_SIZE + 12_345,
        max_len: (OBJECT_SIZE + OBJECT_SIZE / 2) as u32,
        boundary: OBJECT_SIZE,
    };
    let config = ProptestConfig { cases: 12, failure_persistence: None, ..Default::default() };
    let case = AtomicU32::new(0);
    let result = TestRunner::new(config).run(&prop::collection::vec(op(g), 1..30), |ops| {
        // A fresh image per case (shrinking reruns cases), emptied afterwards: an OSD on
        // memstore keeps every object in RAM.
        let prefix = format!("model-{}", case.fetch_add(1, Relaxed));
        rt.block_on(async {
            let store = open(cluster, &prefix, Some(g.size)).await;
            check(&store, &ops).await;
            store.trim(0, g.size as u32).await.unwrap();
        });
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// A write across a boundary lands in both objects, at the documented names and offsets;
/// the header names the size; a short object reads as zeros past its end.
async fn lays_out_objects_as_documented(cluster: &CephCluster) {
    let size = 2 * OBJECT_SIZE + 4096;
    let store = open(cluster, "layout", Some(size)).await;
    assert_eq!(store.size(), size);
    let data: Vec<u8> = (0..8192).map(|i| pattern(7, i)).collect();
    store.write(OBJECT_SIZE - 4096, Bytes::from(data.clone()), Durability::AtFlush).await.unwrap();
    assert_eq!(store.read(OBJECT_SIZE - 4096, 8192).await.unwrap(), data);

    let (ok, first) = cluster.rados(&["-N", NS, "get", "layout.0000000000000000", "-"]);
    assert!(ok, "{}", String::from_utf8_lossy(&first));
    assert_eq!(first.len() as u64, OBJECT_SIZE);
    assert!(first[..(OBJECT_SIZE - 4096) as usize].iter().all(|b| *b == 0));
    assert_eq!(&first[(OBJECT_SIZE - 4096) as usize..], &data[..4096]);
    let (ok, second) = cluster.rados(&["-N", NS, "get", "layout.0000000000000001", "-"]);
    assert!(ok);
    assert_eq!(second, &data[4096..], "the second object starts at the boundary");
    let (ok, header) = cluster.rados(&["-N", NS, "get", "layout.header", "-"]);
    assert!(ok);
    assert_eq!(
        String::from_utf8(header).unwrap(),
        format!("fallow-rados-image 1\nsize {size}\nobject_size 4194304\n")
    );
    let (ok, listing) = cluster.rados(&["-N", NS, "ls"]);
    assert!(ok);
    let mut names: Vec<String> = String::from_utf8(listing)
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("layout."))
        .map(str::to_string)
        .collect();
    names.sort();
    assert_eq!(names, ["layout.0000000000000000", "layout.0000000000000001", "layout.header"]);

    // The last object is short (4 KiB of image); a 100-byte write makes it 100 bytes long,
    // and the rest of it reads as zeros.
    store
        .write(2 * OBJECT_SIZE, Bytes::from_static(&[9u8; 100]), Durability::Immediate)
        .await
        .unwrap();
    let got = store.read(2 * OBJECT_SIZE, 4096).await.unwrap();
    assert!(got[..100].iter().all(|b| *b == 9) && got[100..].iter().all(|b| *b == 0));
}

/// Missing objects and the bytes past an object's end are holes; trimming or zeroing a
/// whole object deletes it (unless holes are not allowed), part of one zeroes in place.
async fn reports_holes_and_trims_whole_objects(cluster: &CephCluster) {
    let size = 3 * OBJECT_SIZE;
    let store = open(cluster, "holes", Some(size)).await;
    let object = |n: u64| format!("holes.{n:016x}");
    store
        .write(OBJECT_SIZE, Bytes::from(vec![1u8; MIB as usize]), Durability::AtFlush)
        .await
        .unwrap();
    let extents = store.block_status(0, size as u32).await.unwrap();
    assert_eq!(
        extents,
        [
            Extent { length: OBJECT_SIZE, hole: true, zero: true },
            Extent { length: MIB, hole: false, zero: false },
            Extent { length: 2 * OBJECT_SIZE - MIB, hole: true, zero: true },
        ]
    );
    let inside = store.block_status(OBJECT_SIZE + 4096, 4096).await.unwrap();
    assert_eq!(inside, [Extent { length: 4096, hole: false, zero: false }]);

    // Part of an object: zeroed in place, the object stays.
    store.trim(OBJECT_SIZE, 4096).await.unwrap();
    let got = store.read(OBJECT_SIZE, 8192).await.unwrap();
    assert!(got[..4096].iter().all(|b| *b == 0) && got[4096..].iter().all(|b| *b == 1));
    assert!(exists(cluster, &object(1)));
    // A whole object without may_trim: zeroed, not deleted.
    store.write_zeroes(OBJECT_SIZE, OBJECT_SIZE as u32, Zeroing::KeepAllocated).await.unwrap();
    assert!(exists(cluster, &object(1)));
    assert!(store.read(OBJECT_SIZE, MIB as u32).await.unwrap().iter().all(|b| *b == 0));
    // Zeroing a missing object does not create it.
    store.write_zeroes(0, 4096, Zeroing::KeepAllocated).await.unwrap();
    assert!(!exists(cluster, &object(0)));
    // A whole object with may_trim, and a trim across two whole objects: deleted.
    store.write_zeroes(OBJECT_SIZE, OBJECT_SIZE as u32, Zeroing::MayDeallocate).await.unwrap();
    assert!(!exists(cluster, &object(1)));
    store.write(2 * OBJECT_SIZE + 5, Bytes::from_static(b"x"), Durability::AtFlush).await.unwrap();
    assert!(exists(cluster, &object(2)));
    store.trim(OBJECT_SIZE, 2 * OBJECT_SIZE as u32).await.unwrap();
    assert!(!exists(cluster, &object(2)));
    let extents = store.block_status(0, size as u32).await.unwrap();
    assert_eq!(extents, [Extent { length: size, hole: true, zero: true }]);
}

/// The size lives in the header: reopening needs no size and refuses another one; the
/// data survives closing; a header this version does not know is refused.
async fn reopens_and_checks_the_size(cluster: &CephCluster) {
    let store = open(cluster, "reopen", Some(8 * MIB)).await;
    store.write(OBJECT_SIZE - 2, Bytes::from_static(b"kept"), Durability::Immediate).await.unwrap();
    store.flush().await.unwrap();
    drop(store);
    let again = open(cluster, "reopen", None).await;
    assert_eq!(again.size(), 8 * MIB);
    assert_eq!(&again.read(OBJECT_SIZE - 2, 4).await.unwrap()[..], b"kept");
    drop(again);
    let same = open(cluster, "reopen", Some(8 * MIB)).await;
    assert_eq!(same.size(), 8 * MIB);

    let err = RadosStore::open(&config(cluster, "reopen"), Some(16 * MIB)).await.unwrap_err();
    assert!(
        matches!(err, RadosError::SizeMismatch { stored, asked, .. } if stored == 8 * MIB && asked == 16 * MIB),
        "{err}"
    );
    let err = RadosStore::open(&config(cluster, "never-made"), None).await.unwrap_err();
    assert!(matches!(err, RadosError::ImageMissing(_)), "{err}");
    assert!(err.to_string().contains("size=SIZE"), "{err}");

    let junk = std::env::temp_dir().join(format!("fallow-rados-junk-{}", std::process::id()));
    std::fs::write(&junk, b"not a header\n").unwrap();
    let (ok, out) = cluster.rados(&["-N", NS, "put", "junk.header", junk.to_str().unwrap()]);
    std::fs::remove_file(&junk).unwrap();
    assert!(ok, "{}", String::from_utf8_lossy(&out));
    let err = RadosStore::open(&config(cluster, "junk"), Some(MIB)).await.unwrap_err();
    assert!(matches!(err, RadosError::BadHeader { .. }), "{err}");
}

/// Many requests at once from many tasks, over two objects, all land.
async fn runs_requests_in_parallel(cluster: &CephCluster) {
    let store = Arc::new(open(cluster, "parallel", Some(4 * OBJECT_SIZE)).await);
    let piece = 256 * 1024u64;
    let tasks: Vec<_> = (0..32u64)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let data: Vec<u8> = (0..piece as usize).map(|j| pattern(i as u8, j)).collect();
                // 260 KiB apart from 128 KiB on: piece 15 straddles the boundary at 4 MiB.
                store
                    .write(i * (piece + 4096) + 128 * 1024, Bytes::from(data), Durability::AtFlush)
                    .await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let reads: Vec<_> = (0..32u64)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(
                async move { store.read(i * (piece + 4096) + 128 * 1024, piece as u32).await },
            )
        })
        .collect();
    for (i, r) in reads.into_iter().enumerate() {
        let got = r.await.unwrap().unwrap();
        assert!(got.iter().enumerate().all(|(j, b)| *b == pattern(i as u8, j)), "piece {i}");
    }
}

/// The errors an operator sees: a missing pool, a missing configuration file, names with
/// NUL bytes, and a cluster that does not answer (within the connect timeout).
async fn says_what_is_wrong(cluster: &CephCluster) {
    let missing_pool = RadosConfig::new("no-such-pool", "img").conf(cluster.conf());
    let err = RadosStore::open(&missing_pool, Some(MIB)).await.unwrap_err();
    assert!(matches!(err, RadosError::PoolMissing(ref p) if p == "no-such-pool"), "{err}");
    let missing_conf = config(cluster, "img").conf("/nonexistent/ceph.conf");
    let err = RadosStore::open(&missing_conf, Some(MIB)).await.unwrap_err();
    assert!(matches!(err, RadosError::Config { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/ceph.conf"), "{err}");
    let err = RadosStore::open(&config(cluster, "a\0b"), Some(MIB)).await.unwrap_err();
    assert!(matches!(err, RadosError::InvalidName { what: "prefix", .. }), "{err}");

    // The same cluster's configuration, pointed at a port where no monitor listens. (Ceph
    // refuses a configuration file whose last line has no newline.)
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut conf = String::new();
    for line in std::fs::read_to_string(cluster.conf()).unwrap().lines() {
        if line.starts_with("mon host") {
            conf += &format!("mon host = 127.0.0.1:{port}\n");
        } else {
            conf += &format!("{line}\n");
        }
    }
    let dead = std::env::temp_dir().join(format!("fallow-rados-dead-{}.conf", std::process::id()));
    std::fs::write(&dead, conf).unwrap();
    let unreachable = config(cluster, "img").conf(&dead).connect_timeout(Duration::from_secs(2));
    let started = Instant::now();
    let err = RadosStore::open(&unreachable, Some(MIB)).await.unwrap_err();
    let waited = started.elapsed();
    std::fs::remove_file(&dead).unwrap();
    assert!(matches!(err, RadosError::Connect { .. }), "{err}");
    assert!(err.to_string().contains("cannot connect to the Ceph cluster"), "{err}");
    assert!(waited < Duration::from_secs(15), "gave up after {waited:?}, not about 2 s");
}
