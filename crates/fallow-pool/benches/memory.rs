//! Memory use of the in-process engine (issue #2), printed as markdown tables:
//!
//! * (a) metadata bytes per cached page: an engine of 256 MiB filled with 65536 unique
//!   pages (ephemeral, ephemeral after putting three times that, then persistent), as the
//!   engine reports it
//!   (`EngineStats::metadata_bytes / pages`) and as the process RSS grows (VmRSS after the
//!   fill minus VmRSS before, minus the page bytes). Each case runs in a child process of
//!   this binary, so that neither sees the heap the other freed. The two ephemeral cases
//!   run again at 1 GiB, where an engine's fixed costs weigh a quarter as much on a page,
//!   and at both sizes with the shards a host of 64 CPUs gets by default
//!   (`FALLOW_BENCH_THREADS=64` in the child: `EngineBuilder::threads`).
//!   `FALLOW_BENCH_SHARDS=N ... --case KIND` runs one case with N shards.
//! * (b) giving back 1 GiB: an engine of 1.25 GiB filled with 327680 unique ephemeral
//!   pages, then `set_budget(256 MiB)`; five runs, refilled each time. Also the longest
//!   put of each fill (the engine's tables grow meanwhile).
//! * (c) the same give-back while a reader thread keeps calling `get`: the longest and the
//!   99th-percentile get latency around the shrink.
//!
//! `FALLOW_BENCH_QUICK=1` (or `--quick`) divides every size by 8.
//! `FALLOW_BENCH_METADATA_MIB=N` sizes (a)'s engine at N MiB instead of 256. (The engine's
//! hash tables grow to the size the budget implies, so N matters little; tables that
//! double would make the bytes per page depend on where the page count falls between
//! powers of two.)
//! The RSS column is VmRSS, so it also counts the code pages first run during the fill;
//! the RssAnon column leaves them out.
//! Run with `cargo bench -p fallow-pool --bench memory`, or `bash bench/engine.sh`.

use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
use fallow_pool::{BudgetReport, Engine, EngineBuilder};

use fallow_testkit::pages as support;

const MIB: usize = 1 << 20;
/// (a)'s cases at the bench's size (`metadata_case`).
const CASES: [&str; 7] = [
    "ephemeral",
    "ephemeral-churn",
    "ephemeral-random",
    "ephemeral-tenth",
    "ephemeral-small",
    "persistent",
    "persistent-lone",
];
/// The host that (a)'s last rows stand for.
const MANY_CPUS: usize = 64;
const RUNS: usize = 5;
/// Target of (a), bytes per page.
const METADATA_TARGET: f64 = 32.0;
/// Target of (b), and of the longest get in (c).
const SHRINK_TARGET: Duration = Duration::from_millis(10);
const STALL_TARGET: Duration = Duration::from_millis(1);

/// Sizes, divided by `scale` in quick mode.
#[derive(Clone, Copy)]
struct Sizes {
    scale: usize,
    metadata_budget: usize,
    big_budget: usize,
    small_budget: usize,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        let scale = if quick { 8 } else { 1 };
        let metadata_mib = std::env::var("FALLOW_BENCH_METADATA_MIB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&mib| mib > 0)
            .unwrap_or(256);
        Self {
            scale,
            metadata_budget: metadata_mib * MIB / scale,
            big_budget: 1280 * MIB / scale,
            small_budget: 256 * MIB / scale,
        }
    }
}

/// A page whose bytes are unique to `seed` and not same-filled.
fn page(seed: u64, out: &mut [u8]) {
    support::unique_page_into(seed, out);
}

/// The key of the `i`-th page: 1024 pages per object.
fn key(pool: fallow_core::PoolId, i: u64) -> PageKey {
    PageKey::new(pool, i / 1024, i % 1024)
}

/// The process's resident set in bytes, from `/proc/self/status`.
fn rss_bytes() -> usize {
    status_bytes("VmRSS:")
}

/// A `/proc/self/status` field in bytes: `VmRSS:` (all resident pages) or `RssAnon:`
/// (anonymous ones only, leaving out the code pages a fill runs for the first time).
fn status_bytes(field: &str) -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn engine(budget: usize) -> Engine {
    let config =
        support::bench_builder_from_env(EngineBuilder::new(budget)).compress_interval(None).build();
    Engine::new(config.expect("a valid bench configuration"))
}

/// Creates a pool of `spec` and fills it with `budget / PAGE_SIZE` unique pages, showing
/// progress on stderr. Panics if a put is not stored (the budget holds every page).
fn fill(e: &Engine, spec: &PoolSpec, what: &str) -> Filled {
    fill_keyed(e, spec, what, key, 1)
}

/// A filled pool, and how long its slowest put took (the engine's tables grow while it
/// fills: a table rebuilt at once would show here).
struct Filled {
    pool: fallow_core::PoolId,
    longest_put: Duration,
}

/// [`fill`] with keys made by `key`, and `passes` times as many pages as the budget holds
/// (an ephemeral pool evicts the older ones).
fn fill_keyed(
    e: &Engine,
    spec: &PoolSpec,
    what: &str,
    key: impl Fn(fallow_core::PoolId, u64) -> PageKey,
    passes: u64,
) -> Filled {
    let pool = e.create_pool(spec).expect("pool created");
    let n = (e.config().budget_bytes / PAGE_SIZE) as u64 * passes;
    let mut buf = vec![0u8; PAGE_SIZE];
    let start = Instant::now();
    let mut longest_put = Duration::ZERO;
    for i in 0..n {
        page(i, &mut buf);
        let put_start = Instant::now();
        let stored = e.put(key(pool, i), &buf).expect("put");
        longest_put = longest_put.max(put_start.elapsed());
        assert_eq!(stored, PutOutcome::Stored, "page {i} of {n} not stored");
        if i % (n / 8).max(1) == 0 {
            eprint!("\r  {what}: filling {:>3}% ({i}/{n} pages)", i * 100 / n);
        }
    }
    eprintln!(
        "\r  {what}: filled {n} pages in {:.2?}, longest put {longest_put:.2?}          ",
        start.elapsed()
    );
    Filled { pool, longest_put }
}

/// The key of page `i` when every page is an object of its own: the index's worst case,
/// each page paying for an object-table entry.
fn lone_key(pool: fallow_core::PoolId, i: u64) -> PageKey {
    PageKey::new(pool, i, 0)
}

/// The key of the `i`-th put when each is drawn at random (a fixed hash of `i`) from
/// `keys` keys, 1024 pages to an object: a cache that holds a share of them keeps that
/// share of each run of 128 pages.
fn random_key(pool: fallow_core::PoolId, i: u64, keys: u64) -> PageKey {
    key(pool, xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes()) % keys)
}

/// The key of page `i` when objects are 128 pages (512 KiB) long and their ids are hashes
/// (of names, say): one run each, so which shard an object lands on is left to its hash.
/// (Objects numbered in order tile the shards exactly, `hashing::shard_of`.)
fn small_object_key(pool: fallow_core::PoolId, i: u64) -> PageKey {
    PageKey::new(pool, xxhash_rust::xxh3::xxh3_64(&(i / 128).to_le_bytes()), i % 128)
}

/// The key of page `i` when the cache holds a tenth of one large volume, scattered: one
/// page in each ten consecutive indexes, at a position that varies, so a run of 128
/// indexes holds ~13 cached pages and its span is shared by few.
fn tenth_key(pool: fallow_core::PoolId, i: u64) -> PageKey {
    let spread = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % 10;
    PageKey::new(pool, 0, i * 10 + spread)
}

/// (a), run in a child process: prints one `RESULT` line for the parent.
fn metadata_case(sizes: Sizes, kind: &str) {
    let random_keys = 3 * (sizes.metadata_budget / PAGE_SIZE) as u64;
    let (spec, key_of, passes): (_, Box<dyn Fn(_, _) -> _>, _) = match kind {
        "persistent" => (PoolSpec::persistent(), Box::new(key), 1),
        "persistent-lone" => (PoolSpec::persistent(), Box::new(lone_key), 1),
        // A cache in its steady state: it has evicted twice its size, so its tables have
        // seen as many removals as inserts.
        "ephemeral-churn" => (PoolSpec::ephemeral(), Box::new(key), 3),
        "ephemeral-tenth" => (PoolSpec::ephemeral(), Box::new(tenth_key), 1),
        "ephemeral-small" => (PoolSpec::ephemeral(), Box::new(small_object_key), 1),
        // The steady state of random keys over three times what fits (`fallow bench
        // pages --workload put` against a node).
        "ephemeral-random" => {
            (PoolSpec::ephemeral(), Box::new(move |pool, i| random_key(pool, i, random_keys)), 3)
        }
        _ => (PoolSpec::ephemeral(), Box::new(key), 1),
    };
    let (before, anon_before) = (rss_bytes(), status_bytes("RssAnon:"));
    let e = engine(sizes.metadata_budget);
    fill_keyed(&e, &spec, kind, key_of, passes);
    // A table that outgrew its groups near the end of the fill still holds the old ones,
    // which a running engine's background thread frees within seconds (and this bench's
    // engine has no such thread): measure what it leaves.
    e.finish_growth();
    let (after, anon_after) = (rss_bytes(), status_bytes("RssAnon:"));
    let s = e.stats();
    println!(
        "RESULT pages={} metadata={} mapped={} rss_delta={} anon_delta={} shards={}",
        s.pages,
        s.metadata_bytes,
        s.mapped_bytes,
        after.saturating_sub(before),
        anon_after.saturating_sub(anon_before),
        s.shards
    );
}

/// Runs (a) for `kind` in a child process, with an engine of `mib` MiB (before the quick
/// mode's division), and parses its `RESULT` line.
fn metadata_child(
    sizes: Sizes,
    kind: &str,
    mib: usize,
    threads: Option<usize>,
) -> Vec<(String, usize)> {
    let exe = std::env::current_exe().expect("own path");
    let mut cmd = Command::new(exe);
    cmd.args(["--case", kind]).env("FALLOW_BENCH_METADATA_MIB", mib.to_string());
    match threads {
        Some(n) => cmd.env(support::BENCH_THREADS_VAR, n.to_string()),
        None => cmd.env_remove(support::BENCH_THREADS_VAR),
    };
    if sizes.scale > 1 {
        cmd.arg("--quick");
    }
    let out = cmd.output().expect("child process ran");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "metadata case {kind} failed: {}", out.status);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find_map(|l| l.strip_prefix("RESULT ")).expect("a RESULT line");
    line.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.parse().expect("a number")))
        .collect()
}

fn metadata(sizes: Sizes) {
    let mut rows = Vec::new();
    let mib = sizes.metadata_budget * sizes.scale / MIB;
    // The fixed costs of an engine (its threads, the simulations, the first page of each
    // shard's arrays) weigh on a page four times less at 1 GiB: the two ephemeral cases
    // again at that size show how much of a figure is per page.
    let larger = (mib < 1024).then_some(1024);
    // The default shard count grows with the CPUs (4 each, bounded by the budget): the
    // ephemeral cases again as a host of `MANY_CPUS` would run them.
    let kinds = CASES
        .into_iter()
        .map(|kind| (kind, mib, None))
        .chain(
            larger
                .into_iter()
                .flat_map(|big| [("ephemeral", big, None), ("ephemeral-churn", big, None)]),
        )
        .chain(
            [mib, larger.unwrap_or(mib)]
                .into_iter()
                .flat_map(|m| [("ephemeral", m), ("ephemeral-churn", m)])
                .map(|(kind, m)| (kind, m, Some(MANY_CPUS))),
        );
    for (kind, case_mib, threads) in kinds {
        let r = metadata_child(sizes, kind, case_mib, threads);
        let get = |k: &str| r.iter().find(|(n, _)| n == k).map_or(0, |(_, v)| *v);
        let pages = get("pages").max(1);
        let reported = get("metadata") as f64 / pages as f64;
        let page_bytes = (pages * PAGE_SIZE) as f64;
        let rss_meta = get("rss_delta") as f64 - page_bytes;
        let anon_meta = get("anon_delta") as f64 - page_bytes;
        let mut label = kind.to_string();
        if case_mib != mib {
            label += &format!(", {} MiB", case_mib / sizes.scale);
        }
        if let Some(n) = threads {
            label += &format!(", {n} CPUs");
        }
        rows.push(format!(
            "| {label} | {} | {pages} | {} | {reported:.1} | {:.1} | {:.1} | {} |",
            get("shards"),
            get("mapped") / MIB,
            rss_meta / pages as f64,
            anon_meta / pages as f64,
            if reported <= METADATA_TARGET { "met" } else { "**not met**" }
        ));
    }
    println!(
        "### (a) Metadata per cached page ({} MiB budget, full, unless the row says otherwise)\n",
        sizes.metadata_budget / MIB
    );
    println!(
        "Pages are 1024 to an object, except in `persistent-lone`: one page per object, \
         `ephemeral-small`: 128 under hashed object ids, and `ephemeral-tenth`: a tenth \
         of one volume's pages, one in each ten indexes. `ephemeral-random` put three \
         times as many pages as fit, each under a key drawn at random from three times \
         as many keys as fit. \
         `ephemeral-churn` put three times as many pages as fit (the cache's steady state).\n"
    );
    println!("| pool | shards | pages | mapped MiB | self-reported B/page | RSS delta − page bytes, B/page | RssAnon delta − page bytes, B/page | ≤ 32 B/page |");
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    rows.iter().for_each(|r| println!("{r}"));
    println!();
}

/// One give-back: a fresh engine of `big_budget`, filled, then shrunk to `small_budget`.
struct GiveBack {
    report: BudgetReport,
    wall: Duration,
    rss_before: usize,
    rss_after: usize,
    mapped_after: usize,
}

fn give_back(e: &Engine, sizes: Sizes) -> GiveBack {
    let rss_before = rss_bytes();
    let start = Instant::now();
    let report = e.set_budget(sizes.small_budget);
    let wall = start.elapsed();
    let given_back = GiveBack {
        report,
        wall,
        rss_before,
        rss_after: rss_bytes(),
        mapped_after: e.stats().mapped_bytes,
    };
    finish_sweep(e);
    given_back
}

/// Waits for the index sweep a shrink starts in the background (by doing what is left of
/// it here), so that it does not run into the next measurement: its thread would otherwise
/// share the CPUs with the next fill and shrink, and slow the shrink's `munmap` down (TLB
/// shootdowns reach every CPU a thread of the process runs on).
fn finish_sweep(e: &Engine) {
    let start = Instant::now();
    let left = e.sweep_dropped();
    eprintln!(
        "  index sweep: {} entries left for the caller, done {:?} after the shrink returned",
        left.entries_removed,
        start.elapsed()
    );
}

fn median_max<T: Copy + Ord>(v: &[T]) -> (T, T) {
    let mut s = v.to_vec();
    s.sort_unstable();
    (s[s.len() / 2], s[s.len() - 1])
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

fn shrink(sizes: Sizes) {
    let mut runs = Vec::new();
    let mut longest_puts = Vec::new();
    for run in 0..RUNS {
        let e = engine(sizes.big_budget);
        let filled = fill(&e, &PoolSpec::ephemeral(), &format!("give-back run {}/{RUNS}", run + 1));
        longest_puts.push(filled.longest_put);
        let g = give_back(&e, sizes);
        eprintln!(
            "  give-back run {}/{RUNS}: elapsed {:?}, wall {:?}, {:?}",
            run + 1,
            g.report.elapsed,
            g.wall,
            g.report.shrink
        );
        runs.push(g);
    }
    let freed = (sizes.big_budget - sizes.small_budget) / MIB;
    let (el_med, el_max) = median_max(&runs.iter().map(|g| g.report.elapsed).collect::<Vec<_>>());
    let (wall_med, wall_max) = median_max(&runs.iter().map(|g| g.wall).collect::<Vec<_>>());
    let (hold_med, hold_max) =
        median_max(&runs.iter().map(|g| g.report.longest_hold).collect::<Vec<_>>());
    let segs: Vec<usize> = runs.iter().map(|g| g.report.shrink.segments_released).collect();
    let dropped: Vec<usize> = runs.iter().map(|g| g.report.shrink.contents_dropped).collect();
    let rss_b: Vec<usize> = runs.iter().map(|g| g.rss_before / MIB).collect();
    let rss_a: Vec<usize> = runs.iter().map(|g| g.rss_after / MIB).collect();
    let mapped: Vec<usize> = runs.iter().map(|g| g.mapped_after / MIB).collect();
    println!(
        "### (b) Give back {freed} MiB: {} MiB → {} MiB, {} ephemeral pages, {RUNS} runs\n",
        sizes.big_budget / MIB,
        sizes.small_budget / MIB,
        sizes.big_budget / PAGE_SIZE
    );
    println!("| measure | median | max | target |");
    println!("|---|---:|---:|---|");
    let verdict = if el_max <= SHRINK_TARGET { "met" } else { "**not met**" };
    println!(
        "| `BudgetReport.elapsed` (whole give-back, unmapping included) | {} | {} | ≤ 10 ms: {verdict} |",
        ms(el_med),
        ms(el_max)
    );
    println!(
        "| `BudgetReport.longest_hold` (longest store-lock hold) | {} | {} | |",
        ms(hold_med),
        ms(hold_max)
    );
    println!("| `set_budget` wall time | {} | {} | |", ms(wall_med), ms(wall_max));
    let row = |name: &str, v: &[usize]| {
        let (m, x) = median_max(v);
        println!("| {name} | {m} | {x} | |");
    };
    let (put_med, put_max) = median_max(&longest_puts);
    println!(
        "| longest put while filling the {} MiB | {} | {} | |",
        sizes.big_budget / MIB,
        ms(put_med),
        ms(put_max)
    );
    row("segments released", &segs);
    row("contents dropped", &dropped);
    row("RSS before, MiB", &rss_b);
    row("RSS after, MiB", &rss_a);
    row("mapped after, MiB", &mapped);
    println!();
}

/// A get's start (ns since the run's epoch) and duration (ns).
type Sample = (u64, u64);

/// One give-back while a reader thread gets pages in a loop. Returns the shrink's
/// `[start, end)` in ns since `epoch`, its report, and every get the reader timed.
fn shrink_under_reads(
    e: &Engine,
    sizes: Sizes,
    pool: fallow_core::PoolId,
) -> (u64, u64, BudgetReport, Vec<Sample>) {
    let n = (sizes.big_budget / PAGE_SIZE) as u64;
    let epoch = Instant::now();
    let stop = AtomicBool::new(false);
    let ready = Barrier::new(2);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut out = vec![0u8; PAGE_SIZE];
            let mut samples: Vec<Sample> = Vec::with_capacity(1 << 22);
            // Touched now, so that recording a sample never page-faults (a fault waits for
            // the process's address-space lock, which the shrink's `munmap` takes).
            samples.resize(samples.capacity(), (0, 0));
            samples.clear();
            let mut i: u64 = 0;
            ready.wait();
            while !stop.load(Ordering::Relaxed) {
                // A stride that is prime to `n` visits every page in a scattered order.
                let k = key(pool, i.wrapping_mul(2_654_435_761) % n);
                let t = Instant::now();
                let _ = std::hint::black_box(e.get(k, &mut out).expect("get"));
                let d = t.elapsed();
                if samples.len() < samples.capacity() {
                    samples.push(((t - epoch).as_nanos() as u64, d.as_nanos() as u64));
                }
                i += 1;
            }
            samples
        });
        ready.wait();
        std::thread::sleep(Duration::from_millis(20));
        let s0 = epoch.elapsed().as_nanos() as u64;
        let report = e.set_budget(sizes.small_budget);
        let s1 = epoch.elapsed().as_nanos() as u64;
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::Relaxed);
        let samples = reader.join().expect("reader thread");
        finish_sweep(e);
        (s0, s1, report, samples)
    })
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn us(ns: u64) -> String {
    if ns >= 1_000_000 {
        format!("{:.1} ms", ns as f64 / 1e6)
    } else {
        format!("{:.1} µs", ns as f64 / 1e3)
    }
}

fn shrink_with_reader(sizes: Sizes) {
    const MARGIN: u64 = 10_000_000; // ns either side of the shrink
    let mut rows = Vec::new();
    let mut worst = 0;
    for run in 0..RUNS {
        let e = engine(sizes.big_budget);
        let pool = fill(&e, &PoolSpec::ephemeral(), &format!("reader run {}/{RUNS}", run + 1)).pool;
        let (s0, s1, report, samples) = shrink_under_reads(&e, sizes, pool);
        let lo = s0.saturating_sub(MARGIN);
        let hi = s1 + MARGIN;
        let mut window: Vec<u64> =
            samples.iter().filter(|(t, _)| *t >= lo && *t < hi).map(|(_, d)| *d).collect();
        window.sort_unstable();
        let mut before: Vec<u64> =
            samples.iter().filter(|(t, d)| t + d < lo).map(|(_, d)| *d).collect();
        before.sort_unstable();
        let max = window.last().copied().unwrap_or(0);
        let stalled = window.iter().filter(|&&d| d > STALL_TARGET.as_nanos() as u64).count();
        for (t, d) in samples.iter().filter(|(t, d)| *t >= lo && *t < hi && *d > 1_000_000) {
            eprintln!(
                "  a get of {} µs, {} µs after the shrink began (set_budget took {} µs)",
                d / 1000,
                (*t as i64 - s0 as i64) / 1000,
                (s1 - s0) / 1000
            );
        }
        worst = worst.max(max);
        eprintln!(
            "  reader run {}/{RUNS}: shrink {:?}, {} gets in window, max {}, p99 {}",
            run + 1,
            report.elapsed,
            window.len(),
            us(max),
            us(percentile(&window, 0.99))
        );
        rows.push(format!(
            "| {} | {} | {} | {} | {} | {} | {} | {stalled} | {} |",
            run + 1,
            ms(report.elapsed),
            ms(report.longest_hold),
            window.len(),
            us(percentile(&window, 0.5)),
            us(percentile(&window, 0.99)),
            us(max),
            us(percentile(&before, 0.99)),
        ));
    }
    println!(
        "### (c) The same give-back while one thread keeps calling `get` ({RUNS} runs)\n\n\
         Window: gets that started from 10 ms before the shrink to 10 ms after it. \
         Baseline: gets that ended before the window.\n"
    );
    println!("| run | shrink (whole) | longest lock hold | gets in window | p50 | p99 | max | gets > 1 ms | baseline p99 |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    rows.iter().for_each(|r| println!("{r}"));
    let verdict = if worst <= STALL_TARGET.as_nanos() as u64 { "met" } else { "**not met**" };
    println!("\nLongest get over all runs: {} (target: none > 1 ms: {verdict}).\n", us(worst));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick")
        || std::env::var("FALLOW_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let sizes = Sizes::new(quick);
    if let Some(pos) = args.iter().position(|a| a == "--case") {
        let kind = args.get(pos + 1).map_or("ephemeral", String::as_str);
        metadata_case(sizes, kind);
        return;
    }
    let probe = engine(sizes.small_budget);
    let s = probe.stats();
    println!(
        "## fallow-pool memory bench{}\n\nDefault shards ({}), policy ({}), compression off.\n",
        if quick { " (quick: sizes / 8)" } else { "" },
        s.shards,
        s.policy
    );
    drop(probe);
    metadata(sizes);
    shrink(sizes);
    shrink_with_reader(sizes);
}
