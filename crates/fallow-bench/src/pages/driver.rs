//! The run: connect, warm up, measure, report. Every connection runs as one tokio task;
//! the calling thread watches them, ticks the progress callback once a second and stops
//! them at the deadline.
//!
//! ```text
//!  run ─ connect N ─▶ [warm-up: put every key once] ─▶ measure: issue until the deadline,
//!                                                       then drain what is in flight
//! ```

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use super::cluster::{ClusterReport, ClusterSnapshot};
use super::report::{process_cpu_seconds, rss_bytes, PagesReport, Rss, ServerCpu, Stats};
use super::workload::RequestGen;
use super::{fallow, memcached, KeyGen, PagesError, PagesOptions, Target};

/// Requests in flight per connection during the warm-up.
const WARMUP_QUEUE_DEPTH: usize = 8;
/// Pages per request during the warm-up.
const WARMUP_BATCH: usize = 32;
/// How long the requests in flight at the deadline may take to drain (each read has its
/// own, shorter timeout; this bounds the whole).
const DRAIN_LIMIT: Duration = Duration::from_secs(30);

/// Which phase a progress tick reports on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Putting every key once; not measured.
    Warmup,
    /// The measured phase.
    Measure,
}

/// A progress report, once a second.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tick {
    /// The phase under way.
    pub phase: Phase,
    /// Time since the phase started.
    pub elapsed: Duration,
    /// Pages completed in the phase so far.
    pub pages: u64,
    /// Pages per second over the last tick.
    pub pages_per_s: f64,
}

/// Runs the benchmark `opts` describes on a runtime of its own, calling `on_tick` once a
/// second, and returns what it measured.
pub fn run(opts: &PagesOptions, mut on_tick: impl FnMut(&Tick)) -> Result<PagesReport, PagesError> {
    opts.validate()?;
    let runtime = if opts.threads == 1 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(opts.threads)
            .enable_all()
            .build()?
    };
    runtime.block_on(run_on_runtime(opts, &mut on_tick))
}

async fn run_on_runtime(
    opts: &PagesOptions,
    on_tick: &mut dyn FnMut(&Tick),
) -> Result<PagesReport, PagesError> {
    let keys = KeyGen::new(opts.keys, opts.dist).map_err(PagesError::Options)?;
    let mut conns = connect(opts).await?;
    let connected = snapshot(&conns);
    let mut rss = Rss { connected: rss_bytes(), ..Rss::default() };
    let mut warmup = (0, Duration::ZERO);
    let mut after_warmup = None;
    if opts.warmup {
        let fill = |i, n| fill_plan(opts, i, n);
        let (back, stats, took) =
            phase(conns, Phase::Warmup, None, false, None, on_tick, fill).await?;
        conns = back;
        warmup = (stats.pages, took);
        after_warmup = snapshot(&conns);
        rss.after_warmup = rss_bytes();
    }
    // The rate is shared by every loop of every connection (fallow: one per request in
    // flight).
    let every = opts
        .rate
        .map(|rate| Duration::from_secs_f64((opts.connections * opts.queue_depth) as f64 / rate));
    let plan = |i: usize, _: usize| {
        let gens = match opts.target {
            Target::Memcached { .. } => 1,
            Target::Fallow { .. } | Target::Cluster { .. } => opts.queue_depth,
        };
        let gens = (0..gens)
            .map(|g| {
                let seed = opts.seed.wrapping_add((i * opts.queue_depth + g) as u64);
                RequestGen::random(seed, keys.clone(), opts.workload, opts.batch, opts.value)
            })
            .collect();
        (gens, opts.queue_depth)
    };
    let duration = Some(opts.duration);
    let server_cpu = |pid| process_cpu_seconds(pid).map_err(PagesError::Options);
    let cpu_before = opts.server_pid.map(server_cpu).transpose()?;
    let (conns, stats, took) =
        phase(conns, Phase::Measure, duration, opts.timeline, every, on_tick, plan).await?;
    let cpu_after = opts.server_pid.map(server_cpu).transpose()?;
    let end = snapshot(&conns);
    rss.end = rss_bytes();
    let mut report = report(opts, &stats, took, warmup);
    report.rss = rss;
    if let (Some(pid), Some(before), Some(after)) = (opts.server_pid, cpu_before, cpu_after) {
        report.server_cpu = Some(ServerCpu::new(pid, after - before, &report));
    }
    // Every fallow handle shares one client and pool: finishing one finishes the run.
    if let Some(Conn::Fallow(c)) = conns.first() {
        if let (Some(connected), Some(end)) = (connected, end) {
            let events = c.events();
            report.cluster = Some(ClusterReport { connected, after_warmup, end, events });
        }
        c.finish().await;
    }
    Ok(report)
}

/// The cluster client's state, for a cluster target.
fn snapshot(conns: &[Conn]) -> Option<ClusterSnapshot> {
    match conns.first() {
        Some(Conn::Fallow(c)) => c.snapshot(),
        _ => None,
    }
}

/// The warm-up plan of connection `i` of `n`: its share of the key space, put once.
fn fill_plan(opts: &PagesOptions, i: usize, n: usize) -> (Vec<RequestGen>, usize) {
    // Memcached pipelines on one socket from one generator; fallow runs one generator per
    // request in flight.
    let slots = match opts.target {
        Target::Memcached { .. } => 1,
        Target::Fallow { .. } | Target::Cluster { .. } => WARMUP_QUEUE_DEPTH,
    };
    let parts = (n * slots) as u128;
    // In u128: `keys` may be near 2^61, times up to 2^11 parts.
    let bound = |part: u128| (u128::from(opts.keys) * part / parts) as u64;
    let gens = (0..slots)
        .map(|s| {
            let part = (i * slots + s) as u64;
            let range = bound(part.into())..bound(u128::from(part) + 1);
            // Seeds apart from the measured phase's, which start at `seed`.
            let seed = opts.seed.wrapping_sub(1 + part);
            RequestGen::fill(seed, range, WARMUP_BATCH, opts.value)
        })
        .collect();
    (gens, WARMUP_QUEUE_DEPTH)
}

/// An open connection to the server under test.
enum Conn {
    Memcached(memcached::Connection),
    Fallow(fallow::Connection),
}

async fn connect(opts: &PagesOptions) -> Result<Vec<Conn>, PagesError> {
    let failed = |source| PagesError::Connect { target: opts.target.to_string(), source };
    match &opts.target {
        Target::Memcached { addr } => {
            let mut conns = Vec::with_capacity(opts.connections);
            for _ in 0..opts.connections {
                conns.push(Conn::Memcached(
                    memcached::Connection::connect(addr).await.map_err(failed)?,
                ));
            }
            Ok(conns)
        }
        Target::Fallow { addr: seeds } | Target::Cluster { seeds } => {
            let conns = fallow::Connection::connect(seeds, opts).await?;
            Ok(conns.into_iter().map(Conn::Fallow).collect())
        }
    }
}

impl Conn {
    /// Runs `gens` with `queue_depth` requests in flight; gives the connection back.
    /// `timeline`: keep every request's start and latency. `every`: fallow's loops each
    /// send at most one request per this interval.
    async fn drive(
        self,
        gens: Vec<RequestGen>,
        queue_depth: usize,
        pace: Pace,
    ) -> (Self, Result<Stats, PagesError>) {
        let Pace { live, stop, timeline, every } = pace;
        match self {
            Conn::Memcached(mut c) => {
                // One generator per connection: memcached pipelines on the socket.
                let mut total = Stats::new(live.clone());
                for gen in gens {
                    let stats = Stats::new(live.clone()).with_timeline(timeline);
                    match c.drive(gen, queue_depth, stats, &stop).await {
                        Ok(stats) => total.merge(&stats),
                        Err(e) => return (Conn::Memcached(c), Err(e)),
                    }
                }
                (Conn::Memcached(c), Ok(total))
            }
            Conn::Fallow(c) => {
                let result = c.drive(gens, live, stop, timeline, every).await;
                (Conn::Fallow(c), result)
            }
        }
    }
}

/// What every connection of a phase shares: the progress counter, the stop flag, whether
/// to keep a timeline, and the pacing of fallow's loops.
struct Pace {
    live: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    timeline: bool,
    every: Option<Duration>,
}

/// Runs one phase on every connection and returns the connections, the merged stats and
/// the phase's wall time. `plan(i, n)` gives connection `i` of `n` its generators and
/// queue depth; `duration` stops the phase (else it ends when the generators run out);
/// `timeline` keeps every request's start and latency; `every` paces each fallow loop.
async fn phase(
    conns: Vec<Conn>,
    which: Phase,
    duration: Option<Duration>,
    timeline: bool,
    every: Option<Duration>,
    on_tick: &mut dyn FnMut(&Tick),
    plan: impl Fn(usize, usize) -> (Vec<RequestGen>, usize),
) -> Result<(Vec<Conn>, Stats, Duration), PagesError> {
    let live = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let n = conns.len();
    let start = Instant::now();
    let mut tasks = JoinSet::new();
    for (i, conn) in conns.into_iter().enumerate() {
        let (gens, queue_depth) = plan(i, n);
        let pace = Pace { live: live.clone(), stop: stop.clone(), timeline, every };
        tasks.spawn(conn.drive(gens, queue_depth, pace));
    }
    let second = Duration::from_secs(1);
    let mut ticks = tokio::time::interval_at((start + second).into(), second);
    let mut deadline = duration.map(|d| start + d);
    let mut last = (start, 0);
    let mut total = Stats::new(live.clone());
    let mut back = Vec::with_capacity(n);
    let mut failure = None;
    loop {
        tokio::select! {
            joined = tasks.join_next() => match joined {
                None => break,
                Some(Ok((conn, result))) => {
                    back.push(conn);
                    match result {
                        Ok(stats) => total.merge(&stats),
                        Err(e) => {
                            // Stop the others; report the first failure.
                            stop.store(true, Ordering::Relaxed);
                            failure.get_or_insert(e);
                        }
                    }
                }
                Some(Err(join)) => {
                    stop.store(true, Ordering::Relaxed);
                    failure.get_or_insert(PagesError::Fallow(format!("connection task failed: {join}")));
                }
            },
            _ = ticks.tick() => {
                let (now, pages) = (Instant::now(), live.load(Ordering::Relaxed));
                let rate = (pages - last.1) as f64 / now.duration_since(last.0).as_secs_f64().max(1e-9);
                on_tick(&Tick { phase: which, elapsed: now - start, pages, pages_per_s: rate });
                last = (now, pages);
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or(start).into()), if deadline.is_some() => {
                if stop.swap(true, Ordering::Relaxed) {
                    // Already stopped: this is the drain limit passing.
                    tasks.abort_all();
                    return Err(PagesError::Stalled(DRAIN_LIMIT));
                }
                deadline = Some(Instant::now() + DRAIN_LIMIT);
            }
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok((back, total, start.elapsed())),
    }
}

fn report(
    opts: &PagesOptions,
    stats: &Stats,
    took: Duration,
    warmup: (u64, Duration),
) -> PagesReport {
    let secs = took.as_secs_f64().max(1e-9);
    PagesReport {
        target: opts.target.to_string(),
        server: opts.target.kind().to_string(),
        workload: opts.workload.to_string(),
        dist: opts.dist.to_string(),
        value: opts.value.to_string(),
        keys: opts.keys,
        connections: opts.connections,
        queue_depth: opts.queue_depth,
        batch: opts.batch,
        dedup: opts.target.is_fallow().then_some(opts.dedup),
        persistent: opts.target.is_fallow().then_some(opts.persistent),
        client_threads: opts.threads,
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        warmup_pages: warmup.0,
        warmup_seconds: warmup.1.as_secs_f64(),
        seconds: took.as_secs_f64(),
        requests: stats.requests,
        pages: stats.pages,
        requests_per_s: stats.requests as f64 / secs,
        pages_per_s: stats.pages as f64 / secs,
        hits: stats.hits,
        misses: stats.misses,
        stored: stats.stored,
        not_stored: stats.not_stored,
        wrong: stats.wrong,
        errors: stats.errors,
        first_error: stats.first_error.clone(),
        latency_us: stats.latency(),
        rss: Rss::default(),
        server_cpu: None,
        cluster: None,
        timeline: stats.timeline(),
    }
}
