//! Many threads on one engine: every hit must carry the bytes of the key asked for, in
//! the version some thread put, and the engine's invariants must hold at the end.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fallow_core::{PageKey, PageStore, PoolId, PoolSpec, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};
use rand::{Rng, SeedableRng};

/// A page that names its key and version in its first 24 bytes and repeats a pattern
/// derived from them, so a reader can tell a right page from a wrong or torn one.
fn page(key: PageKey, version: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    p[..8].copy_from_slice(&key.object.to_le_bytes());
    p[8..16].copy_from_slice(&key.index.to_le_bytes());
    p[16..24].copy_from_slice(&version.to_le_bytes());
    let seed = key.object.wrapping_mul(31).wrapping_add(key.index).wrapping_add(version * 7);
    for (i, b) in p[24..].iter_mut().enumerate() {
        *b = (seed as u8).wrapping_add(i as u8) | 1;
    }
    p
}

fn check(key: PageKey, out: &[u8]) {
    let object = u64::from_le_bytes(out[..8].try_into().unwrap());
    let index = u64::from_le_bytes(out[8..16].try_into().unwrap());
    let version = u64::from_le_bytes(out[16..24].try_into().unwrap());
    assert_eq!((object, index), (key.object, key.index), "a hit returned another key's page");
    assert_eq!(out, &page(key, version)[..], "torn or corrupt page for {key:?}");
}

fn worker(engine: Arc<Engine>, pools: [PoolId; 2], seed: u64, stop: Arc<AtomicBool>) -> u64 {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = vec![0u8; PAGE_SIZE];
    let mut ops = 0;
    while !stop.load(Ordering::Relaxed) && ops < 200_000 {
        let pool = pools[rng.gen_range(0..2)];
        let key = PageKey::new(pool, rng.gen_range(0..8), rng.gen_range(0..256));
        match rng.gen_range(0..100) {
            0..=39 => {
                let _ = engine.put(key, &page(key, rng.gen_range(0..4))).unwrap();
            }
            40..=84 => {
                if engine.get(key, &mut out).unwrap().is_hit() {
                    check(key, &out);
                }
            }
            85..=94 => {
                if engine.take(key, &mut out).unwrap().is_hit() {
                    check(key, &out);
                }
            }
            95..=98 => engine.invalidate_page(key).unwrap(),
            _ => {
                engine.invalidate_object(pool, key.object).unwrap();
            }
        }
        ops += 1;
    }
    ops
}

/// An engine of `budget_pages` in `shards` whose compressor runs every millisecond, with
/// a compressing ephemeral pool and a persistent pool of `quota` pages.
fn compressing_engine(
    budget_pages: usize,
    shards: usize,
    quota: u64,
) -> (Arc<Engine>, [PoolId; 2]) {
    let engine = Arc::new(Engine::new(
        EngineBuilder::new(budget_pages * PAGE_SIZE)
            .shards(shards)
            .compress_interval(Some(Duration::from_millis(1)))
            .build()
            .unwrap(),
    ));
    let pools = [
        engine.create_pool(&PoolSpec::ephemeral().compress(true)).unwrap(),
        engine.create_pool(&PoolSpec::persistent().quota_pages(quota)).unwrap(),
    ];
    (engine, pools)
}

/// Cycles the budget through `pages`, one change every `every`, for `seconds`; then stops
/// the worker `threads` and returns how many operations they ran.
fn change_budgets_then_stop(
    engine: &Engine,
    pages: &[usize],
    every: Duration,
    seconds: u64,
    stop: &AtomicBool,
    threads: Vec<std::thread::JoinHandle<u64>>,
) -> u64 {
    let started = Instant::now();
    let mut budgets = pages.iter().cycle();
    while started.elapsed() < Duration::from_secs(seconds) {
        engine.set_budget(budgets.next().unwrap() * PAGE_SIZE);
        std::thread::sleep(every);
    }
    stop.store(true, Ordering::Relaxed);
    threads.into_iter().map(|t| t.join().unwrap()).sum()
}

#[test]
fn threads_never_see_wrong_or_torn_pages() {
    let (engine, pools) = compressing_engine(512, 4, 400);
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::spawn(move || worker(engine, pools, t, stop))
        })
        .collect();
    // The test's own thread changes the budget under the workers' feet.
    let budgets = [128, 512, 64, 1024, 256];
    let ops =
        change_budgets_then_stop(&engine, &budgets, Duration::from_millis(20), 3, &stop, threads);
    assert!(ops > 10_000, "only {ops} operations ran");
    engine.validate();
    assert_eq!(engine.stats().corruptions, 0, "a torn copy fails its checksum");
}

#[test]
fn shrinking_and_growing_under_load_keeps_persistent_pages_and_never_serves_stale_ones() {
    use fallow_pool::SEGMENT_BYTES;
    let seg_pages = SEGMENT_BYTES / PAGE_SIZE;
    let engine = Arc::new(Engine::new(
        EngineBuilder::new(8 * SEGMENT_BYTES).shards(4).compress_interval(None).build().unwrap(),
    ));
    let cache = engine.create_pool(&PoolSpec::ephemeral()).unwrap();
    let keep = engine.create_pool(&PoolSpec::persistent()).unwrap();
    // A persistent page in every 64, spread over every segment as the cache fills.
    let persistent: Vec<PageKey> =
        (0..seg_pages as u64 / 8).map(|i| PageKey::new(keep, 0, i)).collect();
    for key in &persistent {
        let _ = engine.put(*key, &page(*key, 0)).unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|t| {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(100 + t);
                let mut out = vec![0u8; PAGE_SIZE];
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) && ops < 2_000_000 {
                    let key = PageKey::new(cache, t, rng.gen_range(0..(6 * seg_pages) as u64));
                    if rng.gen_bool(0.5) {
                        let _ = engine.put(key, &page(key, rng.gen_range(0..2))).unwrap();
                    } else if engine.get(key, &mut out).unwrap().is_hit() {
                        check(key, &out);
                    }
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    let mut out = vec![0u8; PAGE_SIZE];
    for round in 0..12 {
        // Let the workers fill more than the smaller budget (bounded in time).
        let waited = Instant::now();
        while round % 2 == 0
            && engine.stats().mapped_bytes <= 3 * SEGMENT_BYTES
            && waited.elapsed() < Duration::from_secs(5)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        let segments = if round % 2 == 0 { 2 } else { 8 };
        let report = engine.set_budget(segments * SEGMENT_BYTES);
        assert!(engine.stats().mapped_bytes <= 8 * SEGMENT_BYTES);
        if round % 2 == 0 {
            let stats = engine.stats();
            assert!(stats.frames_used <= 2 * seg_pages, "{report:?}");
            assert!(stats.mapped_bytes <= 2 * SEGMENT_BYTES, "{report:?}");
            assert!(report.shrink.segments_released > 0, "{report:?}");
        }
        for key in &persistent {
            assert!(engine.get(*key, &mut out).unwrap().is_hit(), "persistent {key:?} lost");
            check(*key, &out);
        }
        engine.validate();
    }
    stop.store(true, Ordering::Relaxed);
    let ops: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(ops > 1000, "only {ops} operations ran");
    engine.validate();
}

/// A page shared by every key whose index falls in the same class of 8: `(class, version)`
/// in its first 16 bytes and a pattern derived from them after.
fn shared_page(class: u64, version: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    p[..8].copy_from_slice(&class.to_le_bytes());
    p[8..16].copy_from_slice(&version.to_le_bytes());
    for (i, b) in p[16..].iter_mut().enumerate() {
        *b = (class as u8 ^ version as u8).wrapping_mul(13).wrapping_add(i as u8) | 1;
    }
    p
}

/// Threads putting the same few pages under many keys (every put races the dedup table:
/// identical new pages on two shards, shares of pages another thread is releasing) while
/// others read them with no store lock held during the copy, the budget changes and the
/// compressor runs: every hit is whole and of the key's class.
#[test]
fn threads_sharing_pages_never_see_wrong_or_torn_ones() {
    let (engine, pools) = compressing_engine(256, 8, 200);
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(1000 + t);
                let mut out = vec![0u8; PAGE_SIZE];
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) && ops < 300_000 {
                    let pool = pools[rng.gen_range(0..2)];
                    let key = PageKey::new(pool, rng.gen_range(0..4), rng.gen_range(0..512));
                    let class = key.index % 8;
                    match rng.gen_range(0..10) {
                        0..=4 => {
                            let page = shared_page(class, rng.gen_range(0..3));
                            let _ = engine.put(key, &page).unwrap();
                        }
                        5..=8 => {
                            if engine.get(key, &mut out).unwrap().is_hit() {
                                let version = u64::from_le_bytes(out[8..16].try_into().unwrap());
                                assert_eq!(out, shared_page(class, version), "{key:?}");
                            }
                        }
                        _ => engine.invalidate_page(key).unwrap(),
                    }
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    let budgets = [64, 256, 32, 512];
    let ops =
        change_budgets_then_stop(&engine, &budgets, Duration::from_millis(15), 2, &stop, threads);
    assert!(ops > 10_000, "only {ops} operations ran");
    engine.validate();
    let stats = engine.stats();
    // A torn copy would fail its checksum and read as a miss: count those too.
    assert_eq!(stats.corruptions, 0, "pages failed their checksums: {stats:?}");
    assert!(stats.dedup_saved_bytes > 0, "the pages were never shared: {stats:?}");
    assert!(stats.pools.iter().all(|p| p.hits > 0), "a pool never hit: {stats:?}");
}
