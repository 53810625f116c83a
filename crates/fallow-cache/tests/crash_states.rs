//! Crash states of the cache layer: clients run random writes, partial writes, zeroings,
//! trims, FLUSHes and FUA writes at once through a cache (write-back and write-through,
//! with and without a local tier and a pool) over a store that records what reaches it
//! (`fallow_testkit::crash`). Then every crash point of the store's log is replayed, with
//! the durable prefix, everything completed, and random subsets in random orders, and
//! each state is checked cell by cell against the client's history: nothing the client
//! was told was durable is missing, no cell holds data never written. Every read the
//! clients made is checked against the history too (nothing stale, nothing unwritten).
//!
//! Rounds of one run per setup go on until `FALLOW_CRASH_STATES` states (3,000 by
//! default; one round checks about 10,000) are checked; `scripts/crash-states.sh` runs
//! more, in release. `FALLOW_CRASH_SEED` fixes the workload's random choices (the
//! interleaving still varies). docs/reliability.md, "Crash states".

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use fallow_backing::{BackingStore, Capabilities, Durability, MemStore, Zeroing};
use fallow_cache::{CacheConfig, CacheLayer, Mode, PoolTier, WritePolicy};
use fallow_core::{AsyncPageStore, PoolSpec, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};
use fallow_testkit::crash::cells::{
    decode, decode_cells, initial_cells, initial_image, stamps, Found,
};
use fallow_testkit::crash::{
    CellChecker, Choice, ClientKind, Clock, History, RecordingStore, Replayer, StoreOp,
    StoreOpKind, CELL,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const PAGE: u64 = PAGE_SIZE as u64;
/// 48 pages and a partial one, whose bytes a write-back cache writes through.
const SIZE: u64 = 48 * PAGE + 1024;
/// The first pages, where half the operations fall, so that they collide.
const HOT: u64 = 6 * PAGE;
const CLIENTS: usize = 4;
const OPS_PER_CLIENT: usize = 120;
/// Random states per crash point, besides the durable prefix and "all completed".
const RANDOM_PER_POINT: usize = 8;

/// A store whose operations yield to the runtime a few times before and after they take
/// effect, so that the cache's requests overlap and complete out of order.
#[derive(Debug)]
struct Jittery {
    inner: MemStore,
    draws: AtomicU64,
}

impl Jittery {
    async fn jitter(&self) {
        let n = self.draws.fetch_add(1, Ordering::Relaxed);
        let x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(23);
        for _ in 0..(x % 4) {
            tokio::task::yield_now().await;
        }
    }
}

#[async_trait]
impl BackingStore for Jittery {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        self.jitter().await;
        self.inner.read(offset, len).await
    }
    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> io::Result<()> {
        self.jitter().await;
        self.inner.write(offset, data, durability).await?;
        self.jitter().await;
        Ok(())
    }
    async fn flush(&self) -> io::Result<()> {
        self.jitter().await;
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        self.jitter().await;
        self.inner.trim(offset, len).await?;
        self.jitter().await;
        Ok(())
    }
    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()> {
        self.jitter().await;
        self.inner.write_zeroes(offset, len, zeroing).await?;
        self.jitter().await;
        Ok(())
    }
}

/// One cache configuration the workload runs through.
#[derive(Debug, Clone, Copy)]
struct Setup {
    name: &'static str,
    write: WritePolicy,
    local_pages: usize,
    pool: Option<Mode>,
}

fn back() -> WritePolicy {
    // A small dirty limit and age, so that writers write back under pressure and the
    // flusher runs between FLUSHes.
    WritePolicy::Back { max_dirty_bytes: 12 * PAGE, max_age: Duration::from_millis(2) }
}

fn setups() -> Vec<Setup> {
    vec![
        Setup {
            name: "back, local 8, pool exclusive",
            write: back(),
            local_pages: 8,
            pool: Some(Mode::Exclusive),
        },
        Setup {
            name: "back, local 8, pool inclusive",
            write: back(),
            local_pages: 8,
            pool: Some(Mode::Inclusive),
        },
        Setup {
            name: "back, local 2, pool exclusive",
            write: back(),
            local_pages: 2,
            pool: Some(Mode::Exclusive),
        },
        Setup { name: "back, no tiers", write: back(), local_pages: 0, pool: None },
        Setup { name: "back, local 16", write: back(), local_pages: 16, pool: None },
        Setup {
            name: "through, local 8, pool exclusive",
            write: WritePolicy::Through,
            local_pages: 8,
            pool: Some(Mode::Exclusive),
        },
        Setup {
            name: "through, no tiers",
            write: WritePolicy::Through,
            local_pages: 0,
            pool: None,
        },
    ]
}

async fn pool_tier() -> PoolTier {
    let engine =
        Arc::new(Engine::new(EngineBuilder::new(1 << 20).compress_interval(None).build().unwrap()));
    let pool = engine.create_pool(&PoolSpec::ephemeral()).await.unwrap();
    PoolTier { store: engine, pool, object: 1 }
}

/// A range of whole cells: half in the hot pages; whole aligned pages, runs of cells
/// across pages, or a few cells inside one page.
fn range(rng: &mut impl Rng) -> (u64, u64) {
    let cells = SIZE / CELL as u64;
    let limit = if rng.gen_bool(0.5) { HOT / CELL as u64 } else { cells };
    let (first, n) = match rng.gen_range(0..3) {
        0 => {
            let per_page = PAGE / CELL as u64;
            let page = rng.gen_range(0..limit.div_ceil(per_page));
            (page * per_page, per_page * rng.gen_range(1..=3))
        }
        1 => (rng.gen_range(0..limit), rng.gen_range(1..=3 * PAGE / CELL as u64)),
        _ => (rng.gen_range(0..limit), rng.gen_range(1..=8)),
    };
    let n = n.min(cells - first);
    (first * CELL as u64, n * CELL as u64)
}

/// A read made by a client: where, what it returned, and the ticks around it.
struct Read {
    offset: u64,
    data: Bytes,
    sent: u64,
    answered: u64,
}

/// One client: random operations, each recorded in `history` around the cache's call.
/// Returns the reads it made, checked once the history is complete.
async fn client(cache: CacheLayer, history: Arc<History>, clock: Clock, seed: u64) -> Vec<Read> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut reads = Vec::new();
    for _ in 0..OPS_PER_CLIENT {
        let (offset, len) = range(&mut rng);
        let roll = rng.gen_range(0..100);
        let result = match roll {
            0..=39 => {
                let fua = rng.gen_bool(0.15);
                let sent = history.send(ClientKind::Write { fua }, offset, len);
                let durability = if fua { Durability::Immediate } else { Durability::AtFlush };
                let r = cache.write(offset, stamps(sent.id, offset, len), durability).await;
                Some((sent, r))
            }
            40..=59 => {
                let sent = clock.tick();
                let data = cache.read(offset, len as u32).await.unwrap();
                reads.push(Read { offset, data, sent, answered: clock.tick() });
                None
            }
            60..=69 => {
                let sent = history.send(ClientKind::Zero, offset, len);
                let zeroing =
                    if rng.gen_bool(0.5) { Zeroing::MayDeallocate } else { Zeroing::KeepAllocated };
                Some((sent, cache.write_zeroes(offset, len as u32, zeroing).await))
            }
            70..=76 => {
                let sent = history.send(ClientKind::Trim, offset, len);
                Some((sent, cache.trim(offset, len as u32).await))
            }
            _ => {
                let sent = history.send(ClientKind::Flush, 0, 0);
                Some((sent, cache.flush().await))
            }
        };
        if let Some((sent, r)) = result {
            r.unwrap();
            history.ack(sent);
        }
        // Now and then a pause long enough for the flusher to run.
        if rng.gen_bool(0.05) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        } else {
            tokio::task::yield_now().await;
        }
    }
    reads
}

/// Runs the workload once through `setup`; returns the store's log and the history.
fn run(setup: Setup, seed: u64) -> (Vec<StoreOp>, Arc<History>, Vec<Read>) {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let clock = Clock::new();
    let history = Arc::new(History::new(clock.clone()));
    let recorder = rt.block_on(async {
        let mem = MemStore::new(SIZE);
        mem.write(0, Bytes::from(initial_image(SIZE)), Durability::AtFlush).await.unwrap();
        let inner = Arc::new(Jittery { inner: mem, draws: AtomicU64::new(seed) });
        Arc::new(RecordingStore::new(inner, clock.clone()))
    });
    let reads = rt.block_on(async {
        let pool = match setup.pool {
            Some(_) => Some(pool_tier().await),
            None => None,
        };
        let config = CacheConfig {
            local_pages: setup.local_pages,
            mode: setup.pool.unwrap_or(Mode::Exclusive),
            scan_bytes: 1 << 20,
            write: setup.write,
        };
        let cache = CacheLayer::new(recorder.clone(), pool, config);
        let tasks: Vec<_> = (0..CLIENTS as u64)
            .map(|c| {
                let (cache, history, clock) = (cache.clone(), history.clone(), clock.clone());
                tokio::spawn(client(cache, history, clock, seed * 31 + c))
            })
            .collect();
        let mut reads = Vec::new();
        for t in tasks {
            reads.extend(t.await.unwrap());
        }
        reads
    });
    // Stops the flusher: what it had not finished is what the crash after everything
    // loses.
    rt.shutdown_timeout(Duration::from_secs(5));
    (recorder.log(), history, reads)
}

#[derive(Debug, Default)]
struct Tally {
    runs: usize,
    client_ops: usize,
    store_ops: usize,
    points: usize,
    states: usize,
    failed: usize,
    reads: usize,
    bad_reads: usize,
    /// Time spent running the workload, and replaying and checking states.
    running: Duration,
    checking: Duration,
}

/// Describes a failed state's first bad cell: the client operations on it and the store
/// operations that touched it.
fn explain(checker: &CellChecker, log: &[StoreOp], at: u64, cell: u64, found: Found) -> String {
    let mut out =
        format!("crash at tick {at}: cell {cell} (byte {}) holds {found:?}\n", cell * CELL as u64);
    let (from, to) = (cell * CELL as u64, (cell + 1) * CELL as u64);
    for id in 1..=checker.len() as u32 {
        let op = checker.op(id);
        if op.offset < to && op.offset + op.len > from {
            out += &format!("  client #{id}: {op:?}\n");
        }
    }
    for op in log {
        let (offset, len) = match &op.kind {
            StoreOpKind::Write { offset, data, .. } => (*offset, data.len() as u64),
            StoreOpKind::Zero { offset, len } | StoreOpKind::Trim { offset, len } => {
                (*offset, *len)
            }
            StoreOpKind::Flush => {
                out += &format!("  store flush {}..{}\n", op.start, op.end);
                continue;
            }
        };
        if offset < to && offset + len > from {
            let what = match &op.kind {
                StoreOpKind::Write { data, fua, .. } => {
                    let at = (from - offset) as usize;
                    format!("write fua={fua} of {:?}", decode(cell, &data[at..at + CELL]))
                }
                other => format!("{other:?}"),
            };
            out += &format!("  store {}..{}: {what}\n", op.start, op.end);
        }
    }
    out
}

/// Checks every crash point of one run; adds to `tally`; returns the first failure.
fn check_run(
    log: Vec<StoreOp>,
    history: &History,
    reads: &[Read],
    rng: &mut StdRng,
    tally: &mut Tally,
) -> Option<String> {
    let mut checker = CellChecker::new(history, SIZE);
    let mut first = None;
    for read in reads {
        let bad = checker.check_read(read.offset, &read.data, read.sent, read.answered);
        tally.reads += 1;
        if let Some(v) = bad.first() {
            tally.bad_reads += 1;
            first.get_or_insert_with(|| {
                let at = read.sent;
                format!(
                    "a read sent at tick {at}, answered at {}: {} cells; {}",
                    read.answered,
                    bad.len(),
                    explain(&checker, &log, at, v.cell, v.found)
                )
            });
        }
    }
    let mut replayer =
        Replayer::with_units(log.clone(), initial_cells(SIZE), CELL, Found::Zero, decode_cells);
    tally.runs += 1;
    tally.client_ops += checker.len();
    tally.store_ops += replayer.len();
    let mut image = Vec::new();
    let points = replayer.points().to_vec();
    for t in points {
        replayer.advance(t);
        checker.advance(t);
        tally.points += 1;
        let choices = [Choice::DurableOnly, Choice::AllCompleted]
            .into_iter()
            .chain(std::iter::repeat_n(Choice::Random, RANDOM_PER_POINT));
        for choice in choices {
            replayer.state(choice, rng, &mut image);
            let bad = checker.check_cells(&image);
            tally.states += 1;
            if let Some(v) = bad.first() {
                tally.failed += 1;
                first.get_or_insert_with(|| {
                    format!(
                        "{choice:?}: {} cells; {}",
                        bad.len(),
                        explain(&checker, &log, t, v.cell, v.found)
                    )
                });
            }
        }
    }
    first
}

#[test]
fn every_crash_state_keeps_what_was_flushed_and_nothing_never_written() {
    let target: usize = std::env::var("FALLOW_CRASH_STATES")
        .ok()
        .map(|v| v.parse().expect("FALLOW_CRASH_STATES is a number"))
        .unwrap_or(3000);
    let base_seed: u64 = std::env::var("FALLOW_CRASH_SEED")
        .ok()
        .map(|v| v.parse().expect("FALLOW_CRASH_SEED is a number"))
        .unwrap_or_else(|| std::process::id() as u64);
    let started = Instant::now();
    let setups = setups();
    let mut tallies: Vec<Tally> = setups.iter().map(|_| Tally::default()).collect();
    let mut failures = Vec::new();
    let mut rng = StdRng::seed_from_u64(base_seed);
    let mut round = 0u64;
    while tallies.iter().map(|t| t.states).sum::<usize>() < target {
        for (i, setup) in setups.iter().enumerate() {
            let seed = base_seed.wrapping_mul(1000).wrapping_add(round * 16 + i as u64);
            let began = Instant::now();
            let (log, history, reads) = run(*setup, seed);
            tallies[i].running += began.elapsed();
            let began = Instant::now();
            let first = check_run(log, &history, &reads, &mut rng, &mut tallies[i]);
            tallies[i].checking += began.elapsed();
            if let Some(first) = first {
                failures.push(format!("{} (seed {seed}): {first}", setup.name));
            }
        }
        round += 1;
    }
    println!("crash states, base seed {base_seed}, {:.1} s:", started.elapsed().as_secs_f64());
    println!(
        "{:<34} {:>5} {:>7} {:>7} {:>7} {:>5} {:>7} {:>7} {:>7} {:>7} {:>7}",
        "setup",
        "runs",
        "client",
        "store",
        "reads",
        "bad",
        "points",
        "states",
        "failed",
        "run s",
        "check s"
    );
    for (setup, t) in setups.iter().zip(&tallies) {
        println!(
            "{:<34} {:>5} {:>7} {:>7} {:>7} {:>5} {:>7} {:>7} {:>7} {:>7.1} {:>7.1}",
            setup.name,
            t.runs,
            t.client_ops,
            t.store_ops,
            t.reads,
            t.bad_reads,
            t.points,
            t.states,
            t.failed,
            t.running.as_secs_f64(),
            t.checking.as_secs_f64()
        );
    }
    let states: usize = tallies.iter().map(|t| t.states).sum();
    let failed: usize = tallies.iter().map(|t| t.failed).sum();
    let reads: usize = tallies.iter().map(|t| t.reads).sum();
    let bad_reads: usize = tallies.iter().map(|t| t.bad_reads).sum();
    println!(
        "total: {states} crash states checked, {failed} failed; {reads} reads checked, {bad_reads} wrong"
    );
    assert!(
        failures.is_empty(),
        "{failed} of {states} crash states and {bad_reads} of {reads} reads failed:\n{}",
        failures.join("\n")
    );
}
