//! The engine's contract, one behaviour per test, through the public `PageStore` API.

use fallow_core::{
    DedupScope, Lookup, NotStored, PageKey, PageStore, PoolSpec, PutOutcome, StoreError,
    TrustDomain, PAGE_SIZE,
};
use fallow_pool::{Engine, EngineBuilder, FRAMES_PER_SEGMENT, SEGMENT_BYTES};

use fallow_testkit::pages as support;

fn engine(budget_pages: usize) -> Engine {
    Engine::new(
        EngineBuilder::new(budget_pages * PAGE_SIZE)
            .shards(2)
            .compress_interval(None)
            .build()
            .unwrap(),
    )
}

/// A page whose bytes are unique to `seed` and not same-filled.
/// An engine of `budget_pages` with no compressor thread: compression runs only when the
/// test calls `compress_cold`.
fn compressing_engine(budget_pages: usize) -> Engine {
    Engine::new(
        EngineBuilder::new(budget_pages * PAGE_SIZE).compress_interval(None).build().unwrap(),
    )
}

fn page(seed: u64) -> Vec<u8> {
    support::unique_page(seed)
}

fn get(e: &Engine, key: PageKey) -> Option<Vec<u8>> {
    let mut out = vec![0u8; PAGE_SIZE];
    e.get(key, &mut out).unwrap().is_hit().then_some(out)
}

#[test]
fn put_then_get_returns_the_same_bytes_and_the_page_stays() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    let key = PageKey::new(pool, 1, 2);
    assert_eq!(e.put(key, &page(1)).unwrap(), PutOutcome::Stored);
    assert_eq!(get(&e, key), Some(page(1)));
    assert_eq!(get(&e, key), Some(page(1)));
    assert_eq!(get(&e, PageKey::new(pool, 1, 3)), None);
    e.validate();
}

#[test]
fn take_removes_the_page_on_a_hit() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
    let key = PageKey::new(pool, 1, 2);
    let _ = e.put(key, &page(5)).unwrap();
    let mut out = vec![0u8; PAGE_SIZE];
    assert_eq!(e.take(key, &mut out).unwrap(), Lookup::Hit);
    assert_eq!(out, page(5));
    assert_eq!(e.take(key, &mut out).unwrap(), Lookup::Miss);
    assert_eq!(e.stats().frames_used, 0);
    e.validate();
}

#[test]
fn identical_pages_share_one_frame_and_overwriting_one_key_leaves_the_other() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
    let (a, b) = (PageKey::new(pool, 1, 0), PageKey::new(pool, 2, 0));
    let _ = e.put(a, &page(9)).unwrap();
    let _ = e.put(b, &page(9)).unwrap();
    let stats = e.stats();
    assert_eq!((stats.pages, stats.contents, stats.frames_used), (2, 1, 1));
    assert_eq!(stats.dedup_saved_bytes, PAGE_SIZE as u64);
    let _ = e.put(a, &page(10)).unwrap();
    assert_eq!(get(&e, b), Some(page(9)));
    assert_eq!(get(&e, a), Some(page(10)));
    assert_eq!(e.stats().frames_used, 2);
    e.validate();
}

#[test]
fn dedup_never_crosses_trust_domains_or_pools_with_dedup_off() {
    let e = engine(64);
    let d1 = e.create_pool(&PoolSpec::persistent().dedup(DedupScope::Domain(TrustDomain(1))));
    let d2 = e.create_pool(&PoolSpec::persistent().dedup(DedupScope::Domain(TrustDomain(2))));
    let off = e.create_pool(&PoolSpec::persistent().dedup(DedupScope::Off)).unwrap();
    for pool in [d1.unwrap(), d2.unwrap(), off, off] {
        let _ = e.put(PageKey::new(pool, e.stats().pages, 0), &page(3)).unwrap();
    }
    assert_eq!(e.stats().contents, 4);
    e.validate();
}

#[test]
fn zero_and_same_filled_pages_cost_no_frame() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
    let zero = vec![0u8; PAGE_SIZE];
    let ones: Vec<u8> = (0..PAGE_SIZE).map(|i| [1, 2, 3, 4, 5, 6, 7, 8][i % 8]).collect();
    let _ = e.put(PageKey::new(pool, 0, 0), &zero).unwrap();
    let _ = e.put(PageKey::new(pool, 0, 1), &ones).unwrap();
    assert_eq!(e.stats().frames_used, 0);
    assert_eq!(e.stats().fill_pages, 2);
    assert_eq!(get(&e, PageKey::new(pool, 0, 0)), Some(zero));
    assert_eq!(get(&e, PageKey::new(pool, 0, 1)), Some(ones));
    e.validate();
}

#[test]
fn invalidate_page_object_and_pool_remove_exactly_their_pages() {
    let e = engine(256);
    let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
    let other = e.create_pool(&PoolSpec::persistent()).unwrap();
    for object in 0..4 {
        for index in 0..8 {
            let _ = e.put(PageKey::new(pool, object, index), &page(object * 100 + index));
            let _ = e.put(PageKey::new(other, object, index), &page(7));
        }
    }
    e.invalidate_page(PageKey::new(pool, 0, 0)).unwrap();
    assert_eq!(get(&e, PageKey::new(pool, 0, 0)), None);
    assert_eq!(get(&e, PageKey::new(pool, 0, 1)), Some(page(1)));
    assert_eq!(e.invalidate_object(pool, 1).unwrap(), 8);
    assert_eq!(get(&e, PageKey::new(pool, 1, 3)), None);
    assert_eq!(get(&e, PageKey::new(pool, 2, 3)), Some(page(203)));
    assert_eq!(e.invalidate_pool(pool).unwrap(), 7 + 16);
    assert_eq!(e.pool_stats(pool).unwrap().pages, 0);
    assert_eq!(e.pool_stats(other).unwrap().pages, 32);
    e.validate();
}

#[test]
fn a_destroyed_pool_is_unknown_and_its_id_is_not_reused() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    let _ = e.put(PageKey::new(pool, 0, 0), &page(1)).unwrap();
    e.destroy_pool(pool).unwrap();
    let mut out = vec![0u8; PAGE_SIZE];
    assert_eq!(e.get(PageKey::new(pool, 0, 0), &mut out), Err(StoreError::UnknownPool(pool)));
    assert_eq!(e.destroy_pool(pool), Err(StoreError::UnknownPool(pool)));
    assert_ne!(e.create_pool(&PoolSpec::ephemeral()).unwrap(), pool);
    assert_eq!(e.stats().frames_used, 0);
    e.validate();
}

#[test]
fn shared_pools_attach_by_uuid_and_live_until_the_last_user_leaves() {
    let e = engine(64);
    let spec = PoolSpec::ephemeral().shared(0xfeed);
    let a = e.create_pool(&spec).unwrap();
    let b = e.create_pool(&spec).unwrap();
    assert_eq!(a, b);
    assert_eq!(
        e.create_pool(&PoolSpec::persistent().shared(0xfeed)),
        Err(StoreError::SharedPoolMismatch { uuid: 0xfeed })
    );
    let _ = e.put(PageKey::new(a, 0, 0), &page(1)).unwrap();
    e.destroy_pool(a).unwrap();
    assert_eq!(get(&e, PageKey::new(b, 0, 0)), Some(page(1)));
    e.destroy_pool(b).unwrap();
    assert!(e.pool_stats(a).is_err());
}

#[test]
fn wrong_lengths_and_bad_specs_are_typed_errors() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    let key = PageKey::new(pool, 0, 0);
    let bad = StoreError::BadLength { got: 100, expected: PAGE_SIZE };
    assert_eq!(e.put(key, &[0u8; 100]), Err(bad.clone()));
    assert_eq!(e.get(key, &mut [0u8; 100]), Err(bad));
    assert!(matches!(
        e.get_many(&[key, key], &mut [0u8; PAGE_SIZE]),
        Err(StoreError::BadLength { .. })
    ));
    assert!(matches!(
        e.create_pool(&PoolSpec::ephemeral().quota_pages(3)),
        Err(StoreError::InvalidSpec(_))
    ));
    assert!(EngineBuilder::new(1 << 20).shards(3).build().is_err());
    assert!(EngineBuilder::new(1 << 20).policy("nope").build().is_err());
    assert!(EngineBuilder::new(usize::MAX).build().is_err());
}

#[test]
fn an_ephemeral_pool_stays_within_budget_and_never_returns_wrong_data() {
    let e = engine(32);
    let pool = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    for i in 0..200 {
        let _ = e.put(PageKey::new(pool, 0, i), &page(i)).unwrap();
        assert!(e.stats().frames_used <= 32);
    }
    let hits = (0..200).filter(|&i| get(&e, PageKey::new(pool, 0, i)).is_some()).count();
    assert!(hits > 0 && hits <= 32 * 4, "{hits} hits");
    for i in 0..200 {
        if let Some(p) = get(&e, PageKey::new(pool, 0, i)) {
            assert_eq!(p, page(i));
        }
    }
    assert!(e.pool_stats(pool).unwrap().evictions >= 168);
    e.validate();
}

#[test]
fn persistent_pages_are_never_evicted_and_a_full_store_refuses_puts() {
    let e = engine(16);
    let keep = e.create_pool(&PoolSpec::persistent()).unwrap();
    let cache = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    for i in 0..16 {
        assert_eq!(e.put(PageKey::new(keep, 0, i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    let full = PutOutcome::NotStored(NotStored::Full);
    assert_eq!(e.put(PageKey::new(keep, 0, 99), &page(99)).unwrap(), full);
    assert_eq!(e.put(PageKey::new(cache, 0, 0), &page(1000)).unwrap(), full);
    for i in 0..16 {
        assert_eq!(get(&e, PageKey::new(keep, 0, i)), Some(page(i)));
    }
    // A refused overwrite hides the older page.
    e.invalidate_page(PageKey::new(keep, 0, 0)).unwrap();
    let _ = e.put(PageKey::new(cache, 0, 0), &page(1000)).unwrap();
    assert_eq!(e.put(PageKey::new(keep, 0, 1), &page(2000)).unwrap(), PutOutcome::Stored);
    e.validate();
}

#[test]
fn a_persistent_quota_refuses_and_hides_the_older_page() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::persistent().quota_pages(2)).unwrap();
    let _ = e.put(PageKey::new(pool, 0, 0), &page(0)).unwrap();
    let _ = e.put(PageKey::new(pool, 0, 1), &page(1)).unwrap();
    let over = PutOutcome::NotStored(NotStored::OverQuota);
    assert_eq!(e.put(PageKey::new(pool, 0, 2), &page(2)).unwrap(), over);
    // Overwriting within the quota is fine.
    assert_eq!(e.put(PageKey::new(pool, 0, 1), &page(11)).unwrap(), PutOutcome::Stored);
    e.validate();
}

#[test]
fn shrinking_returns_segments_and_keeps_every_persistent_page() {
    let seg_pages = SEGMENT_BYTES / PAGE_SIZE;
    let e = engine(8 * seg_pages);
    let keep = e.create_pool(&PoolSpec::persistent()).unwrap();
    let cache = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    let n = 8 * seg_pages as u64;
    for i in 0..n {
        let pool = if i % 16 == 0 { keep } else { cache };
        let _ = e.put(PageKey::new(pool, 0, i), &page(i)).unwrap();
    }
    assert_eq!(e.stats().mapped_bytes, 8 * SEGMENT_BYTES);
    let report = e.set_budget(2 * SEGMENT_BYTES);
    assert_eq!(report.shrink.segments_released, 6);
    assert_eq!(e.stats().dropped_by_shrink, report.shrink.contents_dropped as u64);
    assert!(e.stats().mapped_bytes <= 2 * SEGMENT_BYTES);
    for i in (0..n).step_by(16) {
        assert_eq!(get(&e, PageKey::new(keep, 0, i)), Some(page(i)), "persistent page {i}");
    }
    for i in (1..n).filter(|i| i % 16 != 0) {
        if let Some(p) = get(&e, PageKey::new(cache, 0, i)) {
            assert_eq!(p, page(i));
        }
    }
    e.validate();
    // Below the persistent pages, the shrink says so and keeps them.
    let report = e.set_budget(SEGMENT_BYTES / 4);
    assert!(report.shrink.pinned_over_budget > 0);
    assert_eq!(e.stats().over_budget_frames, report.shrink.pinned_over_budget);
    assert_eq!(get(&e, PageKey::new(keep, 0, 16)), Some(page(16)));
    e.validate();
    // Growing again works.
    e.set_budget(8 * SEGMENT_BYTES);
    assert_eq!(e.put(PageKey::new(cache, 1, 0), &page(5)).unwrap(), PutOutcome::Stored);
    e.validate();
}

/// An engine of `segments` full segments, filled with unique pages of one ephemeral pool
/// (page `i` under object `i % 7`, index `i`): the engine, its pool and the page count.
fn full_of_unique_pages(segments: usize) -> (Engine, fallow_core::PoolId, u64) {
    let e = engine(segments * SEGMENT_BYTES / PAGE_SIZE);
    let pool = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    let n = (segments * SEGMENT_BYTES / PAGE_SIZE) as u64;
    for i in 0..n {
        assert_eq!(e.put(PageKey::new(pool, i % 7, i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    (e, pool, n)
}

/// Issue #2: the pages a shrink dropped left their index entries behind until each was read
/// again, so the stats still counted them (and their metadata stayed) after a give-back.
#[test]
fn a_shrink_removes_the_index_entries_of_the_pages_it_dropped() {
    let seg_pages = SEGMENT_BYTES / PAGE_SIZE;
    let (e, pool, n) = full_of_unique_pages(8);
    let report = e.set_budget(2 * SEGMENT_BYTES);
    let dropped = report.shrink.contents_dropped;
    assert!(dropped >= 6 * seg_pages, "{dropped} pages dropped");
    // The background sweep has started; this one finishes whatever it has not done yet.
    let swept = e.sweep_dropped();
    assert!(swept.entries_removed <= dropped);
    let stats = e.stats();
    assert_eq!(stats.pages, n - dropped as u64, "the stats count only pages still held");
    assert_eq!(stats.pools[0].evictions, dropped as u64, "dropped pages count as evicted");
    e.validate();
    // What the stats count is exactly what reads back.
    let held = (0..n).filter(|&i| get(&e, PageKey::new(pool, i % 7, i)).is_some()).count();
    assert_eq!(held as u64, stats.pages);
    assert_eq!(e.stats().pools[0].evictions, dropped as u64, "no entry was left to find");
}

/// The sweep after a shrink runs on its own: without anyone calling `sweep_dropped`, the
/// stats soon count only the pages still held.
#[test]
fn the_entries_of_dropped_pages_go_in_the_background() {
    let (e, _, n) = full_of_unique_pages(4);
    let dropped = e.set_budget(SEGMENT_BYTES).shrink.contents_dropped as u64;
    assert!(dropped > 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while e.stats().pages != n - dropped {
        assert!(std::time::Instant::now() < deadline, "no background sweep: {:?}", e.stats());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    e.validate();
}

#[test]
fn cold_pages_compress_in_the_background_pass_and_still_read_back() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::persistent().compress(true)).unwrap();
    let text = |i: u64| -> Vec<u8> {
        let s = format!("page {i} of a fairly compressible text file; ");
        s.bytes().cycle().take(PAGE_SIZE).collect()
    };
    for i in 0..10 {
        let _ = e.put(PageKey::new(pool, 0, i), &text(i)).unwrap();
    }
    // First pass clears the "recently used" bit, second one compresses.
    e.compress_cold(100);
    assert_eq!(e.compress_cold(100), 10);
    let stats = e.stats();
    assert_eq!((stats.compressed_pages, stats.frames_used), (10, 0));
    // Ten short blobs share the first page of a slab of the blob space.
    assert_eq!(stats.compression_saved_bytes, 9 * PAGE_SIZE as u64);
    for i in 0..10 {
        assert_eq!(get(&e, PageKey::new(pool, 0, i)), Some(text(i)));
    }
    e.validate();
}

#[test]
fn batched_operations_match_single_ones() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    let keys: Vec<PageKey> = (0..10).map(|i| PageKey::new(pool, i % 3, i)).collect();
    let pages: Vec<u8> = (0..10).flat_map(page).collect();
    let outcomes = e.put_many(&keys, &pages).unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
    let mut out = vec![0u8; 10 * PAGE_SIZE];
    let found = e.get_many(&keys, &mut out).unwrap();
    assert!(found.iter().all(|l| l.is_hit()));
    assert_eq!(out, pages);
    let found = e.take_many(&keys[..5], &mut out[..5 * PAGE_SIZE]).unwrap();
    assert!(found.iter().all(|l| l.is_hit()));
    let found = e.get_many(&keys, &mut out).unwrap();
    assert_eq!(found.iter().filter(|l| l.is_hit()).count(), 5);
    e.validate();
}

#[test]
fn put_many_with_a_key_twice_keeps_the_last_page() {
    let e = engine(64);
    let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
    let keys = [PageKey::new(pool, 1, 1), PageKey::new(pool, 2, 2), PageKey::new(pool, 1, 1)];
    let pages: Vec<u8> = [page(1), page(2), page(3)].concat();
    let outcomes = e.put_many(&keys, &pages).unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
    assert_eq!(get(&e, keys[0]), Some(page(3)));
    assert_eq!(e.pool_stats(pool).unwrap().pages, 2);
    e.validate();
}

#[test]
fn a_persistent_batch_takes_room_from_ephemeral_pages_in_every_shard() {
    let e = engine(16);
    let cache = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    let keep = e.create_pool(&PoolSpec::persistent()).unwrap();
    for i in 0..16 {
        assert_eq!(e.put(PageKey::new(cache, 0, i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    // Sixteen persistent pages need every frame: whichever shard a key lands in, it must
    // evict ephemeral pages from the other shard once its own are gone.
    let keys: Vec<PageKey> = (0..16).map(|i| PageKey::new(keep, 0, i)).collect();
    let pages: Vec<u8> = (100..116).flat_map(page).collect();
    let outcomes = e.put_many(&keys, &pages).unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored), "{outcomes:?}");
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(get(&e, *key), Some(page(100 + i as u64)));
    }
    assert_eq!(e.pool_stats(cache).unwrap().pages, 0);
    e.validate();
}

/// Replays `keys` as a cache would (a get, and a put on a miss) in one ephemeral pool.
fn replay(e: &Engine, pool: fallow_core::PoolId, keys: impl Iterator<Item = u64>) {
    let mut out = vec![0u8; PAGE_SIZE];
    for k in keys {
        let key = PageKey::new(pool, k / 64, k % 64);
        if !e.get(key, &mut out).unwrap().is_hit() {
            // An ephemeral put may be dropped; either outcome is a fine cache.
            let _ = e.put(key, &page(k)).unwrap();
        }
    }
}

#[test]
fn every_shard_follows_one_share_learned_from_the_whole_workload() {
    // Four shards of a 512-page engine share one set of simulations. A zigzag over three
    // times the cache is served best by LRU. Then a hot set of 200 pages, read three times
    // in a row between scans of 400 new pages: LRU loses the hot set to every scan, S3-FIFO
    // keeps it in its main queue.
    let e = Engine::new(
        EngineBuilder::new(512 * PAGE_SIZE).shards(4).compress_interval(None).build().unwrap(),
    );
    let pool = e.create_pool(&PoolSpec::ephemeral()).unwrap();
    assert_eq!(e.stats().small_share_percent, Some(10), "the default policy starts at 10 %");
    let zigzag = (0..12u64)
        .flat_map(|round| (0..1536u64).map(move |i| if round % 2 == 0 { i } else { 1535 - i }));
    replay(&e, pool, zigzag);
    e.validate();
    assert_eq!(e.stats().small_share_percent, Some(100), "a zigzag should make it LRU");
    let hot_and_scans = (0..40u64).flat_map(|round| {
        let hot = (0..3).flat_map(|_| 20_000..20_200u64);
        hot.chain(100_000 + round * 400..100_000 + (round + 1) * 400)
    });
    replay(&e, pool, hot_and_scans);
    e.validate();
    let share = e.stats().small_share_percent;
    assert!(matches!(share, Some(1 | 10)), "scans should make it leave LRU, share {share:?}");
}

#[test]
fn a_compressing_pool_holds_no_more_memory_than_its_budget() {
    // A frame freed by compression goes back to the OS. Were it kept resident on the
    // free list while its blob counted against the budget too, an engine that kept
    // compressing would hold its mapped segments plus its blobs (RssAnon 1.61 times its
    // budget, measured).
    let budget = 4 * FRAMES_PER_SEGMENT;
    let e = compressing_engine(budget);
    let pool = e.create_pool(&PoolSpec::ephemeral().compress(true)).unwrap();
    // Unique bytes in the first half, zeros in the second: lz4 halves it, so frames stay
    // in use beside the blobs.
    let page = |i: u64| {
        let mut p = support::unique_page(i);
        p[PAGE_SIZE / 2..].fill(0);
        p
    };
    let key = |i: u64| PageKey::new(pool, i / 1024, i % 1024);
    let held_within_budget = |when: &str| {
        let memory = e.memory();
        assert!(
            memory.held_bytes() <= memory.budget_bytes + SEGMENT_BYTES,
            "{when}: {} bytes held for a budget of {}: {memory:?}",
            memory.held_bytes(),
            memory.budget_bytes
        );
    };
    // The budget's frames, all mapped; then every page compressed.
    for i in 0..budget as u64 {
        assert_eq!(e.put(key(i), &page(i)).unwrap(), PutOutcome::Stored);
    }
    assert_eq!(e.memory().mapped_bytes, budget * PAGE_SIZE);
    for _ in 0..3 {
        e.compress_cold(budget);
    }
    assert!(e.memory().compressed_bytes > budget * PAGE_SIZE / 4);
    held_within_budget("after compressing a full cache");
    // More pages into the frames compression freed, compressed in turn.
    for i in budget as u64..4 * budget as u64 {
        let _ = e.put(key(i), &page(i)).unwrap();
        if i % 256 == 255 {
            e.compress_cold(budget);
        }
    }
    held_within_budget("after three times as many pages");
    e.validate();
    let hits = (0..4 * budget as u64).filter(|&i| get(&e, key(i)) == Some(page(i))).count();
    assert!(hits > budget, "compression should fit more pages than frames: {hits}");
}

#[test]
fn holes_that_evicted_compressed_pages_leave_are_packed_and_charged() {
    // Were each compressed page's bytes a heap allocation of their own, with the budget
    // counting only those bytes, the holes freed ones leave in the heap would be held but
    // uncounted (RssAnon 1.11 times the budget, measured). Blobs are records in slabs
    // that the budget is charged for whole, and the
    // holes are packed (cleaned) by the compressor's passes and by a put that finds the
    // budget spent.
    let budget = 4 * FRAMES_PER_SEGMENT;
    let e = compressing_engine(budget);
    let pool = e.create_pool(&PoolSpec::ephemeral().compress(true)).unwrap();
    // Unique bytes for a length that varies with the key, zeros after: blobs of every size.
    let page = |i: u64| {
        let mut p = vec![0u8; PAGE_SIZE];
        let len = 64 + (i.wrapping_mul(0x9e37_79b9) % (PAGE_SIZE as u64 - 700)) as usize;
        support::unique_page_into(i, &mut p[..len & !7]);
        p
    };
    let keys = 4 * budget as u64;
    let key = |i: u64| PageKey::new(pool, i / 1024, i % 1024);
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    for n in 0..8 * budget {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = x % keys;
        let _ = e.put(key(i), &page(i)).unwrap();
        if n % 256 == 255 {
            e.compress_cold(budget);
        }
    }
    let memory = e.memory();
    let stats = e.stats();
    assert!(stats.compressed_pages > budget, "most pages compressed: {stats:?}");
    // The records' bytes: the blobs and a 6-byte header each.
    let live = memory.compressed_bytes + 6 * stats.compressed_pages;
    let slack = 6 * (64 << 10); // slabs of 64 KiB: the open one, one more, and the spares
    assert!(
        memory.compressed_space_bytes <= live + live / 8 + slack,
        "{} bytes of slabs for {live} bytes of records",
        memory.compressed_space_bytes
    );
    assert!(
        memory.held_bytes() <= memory.budget_bytes + SEGMENT_BYTES,
        "{} bytes held for a budget of {}: {memory:?}",
        memory.held_bytes(),
        memory.budget_bytes
    );
    e.validate();
    for i in 0..keys {
        let got = get(&e, key(i));
        assert!(got.is_none() || got == Some(page(i)), "page {i} came back wrong");
    }
}

#[test]
fn a_shrink_below_the_compressed_pages_drops_ephemeral_ones_and_keeps_persistent_ones() {
    // The compressed pages' slabs are charged to the budget: a shrink below them drops
    // the unpinned pages a slab at a time (packing first), never a persistent one.
    let budget = 4 * FRAMES_PER_SEGMENT;
    let e = compressing_engine(budget);
    let kept = e.create_pool(&PoolSpec::persistent().compress(true)).unwrap();
    let cache = e.create_pool(&PoolSpec::ephemeral().compress(true)).unwrap();
    let page = |i: u64, unique: usize| {
        let mut p = vec![0u8; PAGE_SIZE];
        support::unique_page_into(i, &mut p[..unique]);
        p
    };
    let persistent = |i: u64| page(i, PAGE_SIZE / 8);
    let ephemeral = |i: u64| page(1 << 40 | i, PAGE_SIZE / 2);
    for i in 0..512 {
        assert_eq!(e.put(PageKey::new(kept, 0, i), &persistent(i)).unwrap(), PutOutcome::Stored);
    }
    for i in 0..2048 {
        let _ = e.put(PageKey::new(cache, i / 1024, i % 1024), &ephemeral(i)).unwrap();
    }
    for _ in 0..3 {
        e.compress_cold(budget);
    }
    let before = e.memory();
    assert!(before.compressed_space_bytes > SEGMENT_BYTES, "more than the next budget: {before:?}");
    let report = e.set_budget(SEGMENT_BYTES);
    let after = e.memory();
    assert!(report.shrink.contents_dropped > 0, "{report:?}");
    assert_eq!(report.shrink.pinned_over_budget, 0, "{report:?}");
    assert!(
        after.held_bytes() <= SEGMENT_BYTES,
        "{} bytes held for a budget of {SEGMENT_BYTES}: {after:?}",
        after.held_bytes()
    );
    e.validate();
    for i in 0..512 {
        assert_eq!(get(&e, PageKey::new(kept, 0, i)), Some(persistent(i)), "persistent page {i}");
    }
    for i in 0..2048 {
        let got = get(&e, PageKey::new(cache, i / 1024, i % 1024));
        assert!(got.is_none() || got == Some(ephemeral(i)), "ephemeral page {i} came back wrong");
    }
}

#[test]
fn compressed_persistent_pages_over_a_lowered_budget_are_kept_and_reported() {
    // A shrink never drops a persistent page, compressed or not: what it cannot shed is
    // reported, the slabs' part included.
    let e = compressing_engine(4 * FRAMES_PER_SEGMENT);
    let pool = e.create_pool(&PoolSpec::persistent().compress(true)).unwrap();
    let page = |i: u64| {
        let mut p = vec![0u8; PAGE_SIZE];
        support::unique_page_into(i, &mut p[..PAGE_SIZE / 2]);
        p
    };
    let n = 3 * FRAMES_PER_SEGMENT as u64;
    for i in 0..n {
        assert_eq!(
            e.put(PageKey::new(pool, i / 1024, i % 1024), &page(i)).unwrap(),
            PutOutcome::Stored
        );
    }
    for _ in 0..3 {
        e.compress_cold(usize::MAX);
    }
    let compressed = e.memory().compressed_space_bytes;
    assert!(compressed > SEGMENT_BYTES, "more than the next budget: {:?}", e.memory());
    let report = e.set_budget(SEGMENT_BYTES);
    let stats = e.stats();
    assert_eq!(report.shrink.contents_dropped, 0, "{report:?}");
    assert!(report.shrink.pinned_over_budget > 0, "{report:?}");
    assert_eq!(report.shrink.pinned_over_budget, stats.over_budget_frames, "{stats:?}");
    e.validate();
    for i in 0..n {
        assert_eq!(get(&e, PageKey::new(pool, i / 1024, i % 1024)), Some(page(i)), "page {i}");
    }
}

#[test]
fn pages_put_in_frames_that_compression_freed_cost_no_more_than_others() {
    // The compressed page takes a new (virtual) id and its frame keeps its number, so a
    // page put later in that frame is an ordinary one: had the compressed page kept the
    // frame's number, each such page would take a virtual id, 68 B of metadata a page
    // instead of ~21 B here, and a map lookup on every get.
    let budget = 8192;
    let e = compressing_engine(budget);
    let pool = e.create_pool(&PoolSpec::persistent().compress(true)).unwrap();
    let half = budget as u64 / 2;
    let text = |i: u64| format!("page {i} of a fairly compressible text file; ").repeat(100);
    let cold = |i: u64| text(i).into_bytes()[..PAGE_SIZE].to_vec();
    for i in 0..half {
        assert_eq!(e.put(PageKey::new(pool, 0, i), &cold(i)).unwrap(), PutOutcome::Stored);
    }
    for _ in 0..4 {
        e.compress_cold(budget);
    }
    let before = e.stats();
    assert_eq!(before.compressed_pages, half as usize, "every cold page compressed");
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..half {
        support::unique_page_into(i, &mut buf);
        assert_eq!(e.put(PageKey::new(pool, 1, i), &buf).unwrap(), PutOutcome::Stored);
    }
    let after = e.stats();
    let per_page = (after.metadata_bytes - before.metadata_bytes) as f64 / half as f64;
    assert!(per_page <= 30.0, "{per_page:.1} B of metadata per page put after compression");
    for i in 0..half {
        support::unique_page_into(i, &mut buf);
        assert_eq!(get(&e, PageKey::new(pool, 1, i)), Some(buf.clone()));
        assert_eq!(get(&e, PageKey::new(pool, 0, i)), Some(cold(i)));
    }
    e.validate();
}

/// The engine's own count of its metadata per page, after filling `budget_pages` with pages
/// of 1024-page objects (a volume's layout) in a pool of `spec`, in the default shards.
fn metadata_per_page(budget_pages: usize, spec: &PoolSpec) -> f64 {
    metadata_per_page_at(budget_pages, spec, |i| (i / 1024, i % 1024))
}

/// [`metadata_per_page`] with the `i`-th page put at `(object, index) = at(i)`.
fn metadata_per_page_at(
    budget_pages: usize,
    spec: &PoolSpec,
    at: impl Fn(u64) -> (u64, u64),
) -> f64 {
    let e = compressing_engine(budget_pages);
    let pool = e.create_pool(spec).unwrap();
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..budget_pages as u64 {
        support::unique_page_into(i, &mut buf);
        let (object, index) = at(i);
        let stored = e.put(PageKey::new(pool, object, index), &buf).unwrap();
        assert_eq!(stored, PutOutcome::Stored);
    }
    let s = e.stats();
    assert_eq!(s.pages, budget_pages as u64);
    s.metadata_bytes as f64 / s.pages as f64
}

#[test]
fn a_page_of_a_dense_object_costs_at_most_32_bytes_of_metadata_when_persistent() {
    // 22.4 B at this size: 8-byte slots, a dense object's runs spread over the shards
    // exactly, 4-byte dedup slots, 4 shards, runs of 128 (RFC 0001, "Outcome"). Ephemeral
    // pages add the eviction policy's links and state, and at this small size its
    // simulations' fixed 49 KiB (3.1 B a page): 32.5 B. The bounds keep both from growing
    // back.
    let persistent = metadata_per_page(16_384, &PoolSpec::persistent());
    let ephemeral = metadata_per_page(16_384, &PoolSpec::ephemeral());
    eprintln!(
        "metadata per page at 64 MiB: persistent {persistent:.1} B, ephemeral {ephemeral:.1} B"
    );
    assert!(persistent <= 23.2, "{persistent:.1} B of metadata per persistent page");
    assert!(ephemeral <= 33.5, "{ephemeral:.1} B of metadata per ephemeral page");
}

#[test]
fn pages_scattered_over_a_volume_share_their_runs_records() {
    // A cache that holds a tenth of a volume's pages, one in each ten indexes. A run's
    // record of its key (its span, 44 B) is shared by the ~13 pages of its 128 cached here:
    // 26.2 B a page (runs of 64, 36-byte spans shared by ~6, would give 29.1 B). A dense
    // object's page costs 22.4 B (above).
    let tenth = |i: u64| (0, i * 10 + i % 7);
    let persistent = metadata_per_page_at(16_384, &PoolSpec::persistent(), tenth);
    eprintln!("metadata per page at 64 MiB, a tenth of a volume: persistent {persistent:.1} B");
    assert!(persistent <= 27.0, "{persistent:.1} B of metadata per scattered page");
}

#[test]
fn a_page_alone_in_its_object_pays_a_whole_span_and_no_more() {
    // The key layout's worst case: one page per object, each with a span (44 B), a span
    // table entry and an object list head of its own. 77.4 B a page at this size with runs
    // of 128 (69.4 B with runs of 64 and 36-byte spans); docs/semantics.md
    // advises numbering small items as pages of a few objects instead.
    let lone = |i: u64| (i, 0);
    let persistent = metadata_per_page_at(16_384, &PoolSpec::persistent(), lone);
    eprintln!("metadata per page at 64 MiB, one page per object: persistent {persistent:.1} B");
    assert!(persistent <= 78.0, "{persistent:.1} B of metadata per lone page");
}

/// An engine of 1024 pages in one shard and no background thread whose index has just
/// grown past its expected size and stopped inserting, with its pool and how many
/// same-filled pages it holds (keys `(pool, 0, 0..n)`). Same-filled pages cost an index
/// entry but no frame, so the index can outgrow the size the budget implies; a growth
/// moves the old groups a few per insert, and the inserts stop three after it.
fn outgrown_index() -> (Engine, fallow_core::PoolId, u64) {
    let e = Engine::new(
        EngineBuilder::new(1024 * PAGE_SIZE).shards(1).compress_interval(None).build().unwrap(),
    );
    let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
    let (mut last, mut grew_at, mut n) = (e.stats().metadata_bytes, None, 0);
    while grew_at.is_none_or(|g| n < g + 3) {
        assert!(n < 4000, "the index never grew past its expected size");
        put_zero_pages(&e, pool, n..n + 1);
        n += 1;
        let now = e.stats().metadata_bytes;
        // Past the budget's 1024 pages, a jump is the growth past the expected size.
        if n > 1024 && grew_at.is_none() && now > last + 1024 {
            grew_at = Some(n);
        }
        last = now;
    }
    (e, pool, n)
}

fn put_zero_pages(e: &Engine, pool: fallow_core::PoolId, indexes: std::ops::Range<u64>) {
    let zero = vec![0u8; PAGE_SIZE];
    for i in indexes {
        assert_eq!(e.put(PageKey::new(pool, 0, i), &zero).unwrap(), PutOutcome::Stored);
    }
}

#[test]
fn a_cache_filled_then_only_read_keeps_no_table_it_outgrew() {
    let (e, pool, n) = outgrown_index();
    let zero = vec![0u8; PAGE_SIZE];
    let before = e.stats().metadata_bytes;
    e.finish_growth();
    let after = e.stats().metadata_bytes;
    eprintln!("metadata before the tables' growth finished {before} B, after {after} B");
    assert!(after + 1024 < before, "{before} B → {after} B: the old groups are still held");
    e.validate();
    let mut out = vec![1u8; PAGE_SIZE];
    for i in 0..n {
        assert!(e.get(PageKey::new(pool, 0, i), &mut out).unwrap().is_hit(), "page {i} lost");
        assert_eq!(out, zero);
    }
}

#[test]
fn the_background_thread_finishes_a_growth_that_inserts_left_half_done() {
    // A twin without the thread, given the same puts, says what inserts alone leave and
    // what a finished growth holds; the engine with the thread must get to the latter (it
    // may have got there during the puts already).
    let (twin, _, n) = outgrown_index();
    let half_done = twin.stats().metadata_bytes;
    twin.finish_growth();
    let finished = twin.stats().metadata_bytes;
    assert!(finished + 1024 < half_done, "{half_done} → {finished} B: no growth was left");
    let every = std::time::Duration::from_millis(5);
    let e = Engine::new(
        EngineBuilder::new(1024 * PAGE_SIZE)
            .shards(1)
            .compress_interval(Some(every))
            .build()
            .unwrap(),
    );
    let pool = e.create_pool(&PoolSpec::persistent()).unwrap();
    put_zero_pages(&e, pool, 0..n);
    let start = std::time::Instant::now();
    while e.stats().metadata_bytes > finished {
        assert!(start.elapsed().as_secs() < 10, "no background step freed the old groups");
        std::thread::sleep(every);
    }
    e.validate();
}
