//! Per-operation cost of the in-process engine (issue #2): get (hit, miss), put (new key,
//! overwrite; dedup on and off), take, the 32-page batch calls, and a get and a put running
//! on two threads at once.
//!
//! Every engine here has a 64 MiB budget (16384 frames) and holds 8192 pages with unique,
//! non-fill contents, so every get and take hits and no put evicts. Default shard count
//! (`FALLOW_BENCH_SHARDS=N` sets another: how the two-thread benches wait on shared
//! shards), default eviction policy, background compression off. The 8192 pages (32 MiB) are more
//! than a last-level cache, so copies in and out touch memory, as a real page cache does.
//!
//! Run with `cargo bench -p fallow-pool --bench engine` (or `bash bench/engine.sh`, which
//! records the machine beside the numbers). Times are per operation; the batch benches
//! report per page through `Throughput::Elements`.

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput};
use fallow_core::{
    DedupScope, Lookup, PageKey, PageStore, PoolId, PoolSpec, PutOutcome, PAGE_SIZE,
};
use fallow_pool::{Engine, EngineBuilder};

use fallow_testkit::pages as support;

/// Budget of every engine here.
const BUDGET: usize = 64 << 20;
/// Pages stored before measuring (half the budget).
const KEYS: usize = 8192;
/// Pages per `put_many` / `get_many` call.
const BATCH: usize = 32;

/// A page whose bytes are unique to `seed` and not same-filled.
fn page(seed: u64, out: &mut [u8]) {
    support::unique_page_into(seed, out);
}

/// `KEYS` unique pages laid end to end; `generation` makes a second, different set.
fn pages(generation: u64) -> Vec<u8> {
    let mut buf = vec![0u8; KEYS * PAGE_SIZE];
    for (i, p) in buf.chunks_exact_mut(PAGE_SIZE).enumerate() {
        page(generation << 32 | i as u64, p);
    }
    buf
}

/// An engine with one ephemeral pool (dedup on or off) and, when `fill`, all `KEYS` keys
/// stored with the contents of `data`.
struct Fixture {
    engine: Engine,
    keys: Vec<PageKey>,
    data: Vec<u8>,
}

impl Fixture {
    fn new(dedup: bool, fill: bool) -> Self {
        let config = support::bench_builder_from_env(EngineBuilder::new(BUDGET))
            .compress_interval(None)
            .build();
        let engine = Engine::new(config.expect("a valid bench configuration"));
        let spec = if dedup {
            PoolSpec::ephemeral()
        } else {
            PoolSpec::ephemeral().dedup(DedupScope::Off)
        };
        let pool = engine.create_pool(&spec).expect("pool created");
        let keys = (0..KEYS as u64).map(|i| PageKey::new(pool, i / 64, i % 64)).collect();
        let fixture = Self { engine, keys, data: pages(0) };
        if fill {
            fixture.fill();
        }
        fixture
    }

    fn pool(&self) -> PoolId {
        self.keys[0].pool
    }

    fn page(&self, i: usize) -> &[u8] {
        &self.data[i * PAGE_SIZE..][..PAGE_SIZE]
    }

    fn fill(&self) {
        for i in 0..KEYS {
            let stored = self.engine.put(self.keys[i], self.page(i)).expect("put");
            assert_eq!(stored, PutOutcome::Stored, "the bench pool must hold every page");
        }
    }

    fn put(&self, i: usize) {
        let stored = self.engine.put(self.keys[i], self.page(i)).expect("put");
        assert_eq!(black_box(stored), PutOutcome::Stored);
    }

    fn get(&self, i: usize, out: &mut [u8]) {
        let found = self.engine.get(self.keys[i], out).expect("get");
        assert_eq!(black_box(found), Lookup::Hit);
    }
}

fn get(c: &mut Criterion) {
    let f = Fixture::new(true, true);
    let mut out = vec![0u8; PAGE_SIZE];
    let mut g = c.benchmark_group("get");
    g.throughput(Throughput::Elements(1));
    let mut i = 0;
    g.bench_function("hit", |b| {
        b.iter(|| {
            f.get(i, &mut out);
            i = (i + 1) % KEYS;
        })
    });
    let mut object = 1 << 40;
    g.bench_function("miss", |b| {
        b.iter(|| {
            let key = PageKey::new(f.pool(), object, 0);
            let found = f.engine.get(key, &mut out).expect("get");
            assert_eq!(black_box(found), Lookup::Miss);
            object += 1;
        })
    });
    g.finish();
}

/// Puts under keys that hold no page: each pass of `KEYS` puts is timed, and the pool is
/// emptied (untimed) before the next pass.
fn put_new(f: &Fixture, iters: u64) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters as usize;
    while left > 0 {
        let n = left.min(KEYS);
        f.engine.invalidate_pool(f.pool()).expect("invalidate");
        let start = Instant::now();
        for i in 0..n {
            f.put(i);
        }
        total += start.elapsed();
        left -= n;
    }
    total
}

fn put(c: &mut Criterion) {
    let mut g = c.benchmark_group("put");
    g.throughput(Throughput::Elements(1));
    for (dedup, name) in [(true, "dedup_on"), (false, "dedup_off")] {
        let f = Fixture::new(dedup, false);
        g.bench_function(format!("new_key/{name}"), |b| b.iter_custom(|iters| put_new(&f, iters)));
        f.fill();
        let mut i = 0;
        g.bench_function(format!("overwrite/{name}"), |b| {
            b.iter(|| {
                f.put(i);
                i = (i + 1) % KEYS;
            })
        });
    }
    g.finish();
}

/// Takes that hit: each pass of `KEYS` takes is timed, and the pages are put back
/// (untimed) before the next pass.
fn take_hits(f: &Fixture, out: &mut [u8], iters: u64) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters as usize;
    while left > 0 {
        let n = left.min(KEYS);
        let start = Instant::now();
        for i in 0..n {
            let found = f.engine.take(f.keys[i], out).expect("take");
            assert_eq!(black_box(found), Lookup::Hit);
        }
        total += start.elapsed();
        for i in 0..n {
            f.put(i);
        }
        left -= n;
    }
    total
}

fn take(c: &mut Criterion) {
    let f = Fixture::new(true, true);
    let mut out = vec![0u8; PAGE_SIZE];
    let mut g = c.benchmark_group("take");
    g.throughput(Throughput::Elements(1));
    g.bench_function("hit", |b| b.iter_custom(|iters| take_hits(&f, &mut out, iters)));
    g.finish();
}

fn batch(c: &mut Criterion) {
    let f = Fixture::new(true, true);
    let mut out = vec![0u8; BATCH * PAGE_SIZE];
    let mut g = c.benchmark_group("batch32");
    g.throughput(Throughput::Elements(BATCH as u64));
    let mut at = 0;
    g.bench_function("get_many", |b| {
        b.iter(|| {
            let found = f.engine.get_many(&f.keys[at..at + BATCH], &mut out).expect("get_many");
            assert!(black_box(found).iter().all(|l| l.is_hit()));
            at = (at + BATCH) % KEYS;
        })
    });
    g.bench_function("put_many_overwrite", |b| {
        b.iter(|| {
            let data = &f.data[at * PAGE_SIZE..(at + BATCH) * PAGE_SIZE];
            let stored = f.engine.put_many(&f.keys[at..at + BATCH], data).expect("put_many");
            assert!(black_box(stored).iter().all(|s| *s == PutOutcome::Stored));
            at = (at + BATCH) % KEYS;
        })
    });
    // One batch of new keys per iteration; the batch is invalidated in the setup.
    g.bench_function("put_many_new_key", |b| {
        b.iter_batched(
            || {
                at = (at + BATCH) % KEYS;
                for key in &f.keys[at..at + BATCH] {
                    f.engine.invalidate_page(*key).expect("invalidate");
                }
                at
            },
            |at| {
                let data = &f.data[at * PAGE_SIZE..(at + BATCH) * PAGE_SIZE];
                let stored = f.engine.put_many(&f.keys[at..at + BATCH], data).expect("put_many");
                assert!(black_box(stored).iter().all(|s| *s == PutOutcome::Stored));
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// Thread 0 gets keys `0..KEYS/2`, thread 1 overwrites keys `KEYS/2..KEYS`, `iters`
/// operations each, started together. Returns the longer of the two threads' times, so
/// the reported time is per operation of each thread while the other one runs.
fn get_and_put(f: &Fixture, iters: u64) -> Duration {
    let half = KEYS / 2;
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut out = vec![0u8; PAGE_SIZE];
            barrier.wait();
            let start = Instant::now();
            for n in 0..iters as usize {
                f.get(n % half, &mut out);
            }
            start.elapsed()
        });
        let writer = s.spawn(|| {
            barrier.wait();
            let start = Instant::now();
            for n in 0..iters as usize {
                f.put(half + n % half);
            }
            start.elapsed()
        });
        let r = reader.join().expect("reader thread");
        let w = writer.join().expect("writer thread");
        r.max(w)
    })
}

/// Both threads get (disjoint halves of the keys): how much two readers slow each other.
fn get_and_get(f: &Fixture, iters: u64) -> Duration {
    let half = KEYS / 2;
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        let threads: Vec<_> = (0..2)
            .map(|t| {
                let barrier = &barrier;
                s.spawn(move || {
                    let mut out = vec![0u8; PAGE_SIZE];
                    barrier.wait();
                    let start = Instant::now();
                    for n in 0..iters as usize {
                        f.get(t * half + n % half, &mut out);
                    }
                    start.elapsed()
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("bench thread")).max().unwrap_or_default()
    })
}

fn two_threads(c: &mut Criterion) {
    let f = Fixture::new(true, true);
    let mut g = c.benchmark_group("2threads");
    g.throughput(Throughput::Elements(1));
    g.bench_function("get_hit+put_overwrite", |b| b.iter_custom(|iters| get_and_put(&f, iters)));
    g.bench_function("get_hit+get_hit", |b| b.iter_custom(|iters| get_and_get(&f, iters)));
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20)
}

fn main() {
    // What `criterion_group!` and `criterion_main!` expand to, without the undocumented
    // `pub fn` the first one generates.
    let mut c = config().configure_from_args();
    get(&mut c);
    put(&mut c);
    take(&mut c);
    batch(&mut c);
    two_threads(&mut c);
    c.final_summary();
}
