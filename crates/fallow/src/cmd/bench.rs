//! `fallow bench pages`: one 4 KiB page load against a fallow node or a memcached server
//! (the load generator is `fallow_bench::pages`). `fallow bench blk`: block requests
//! through a virtio-blk driver of our own against a vhost-user-blk backend, an NBD export
//! or the driver's floor (`fallow_bench::blk`). `fallow bench delay-proxy`: a TCP proxy
//! that adds latency (`fallow_bench::delay_proxy`), for fault tests without netem.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};

use fallow_bench::blk::{self, BlkOptions, BlkTarget, Rw, Wait};
use fallow_bench::delay_proxy;
use fallow_bench::pages::{self, KeyDist, PagesOptions, Phase, Target, Tick, ValueMode, Workload};

/// Bench subcommands.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Drive a fallow node or a memcached server with 4 KiB pages; print pages/s, hits and
    /// per-request latency (p50, p99, p99.9).
    ///
    /// N connections each keep up to QUEUE_DEPTH requests in flight; each request carries
    /// BATCH pages (fallow: get_many/put_many; memcached: a multi-get or pipelined sets).
    /// Progress goes to stderr once a second, the report to stdout. The load generator
    /// shares the host's CPUs with a local server.
    Pages(PagesArgs),
    /// Drive a block device with reads or writes from a virtio-blk driver of our own; print
    /// IOPS and per-request latency (min, p50, p90, p99, p99.9, max, mean).
    ///
    /// vhost-user:PATH connects to a vhost-user-blk backend's socket (`fallow vhost`,
    /// qemu-storage-daemon's vhost-user-blk export) as QEMU would, shares a memfd as the
    /// guest's memory, and puts requests on split virtqueues: no emulated guest, so the
    /// backend's own latency is what is measured. null is the driver's floor: a thread of
    /// this process completes every request at once on the same rings; subtract it from a
    /// backend's latency for what the backend adds. nbd://HOST:PORT/NAME (or
    /// nbd+unix:///NAME?socket=PATH) runs the same load over NBD, for side-by-side runs
    /// (fio's nbd engine stays the NBD reference).
    ///
    /// QD requests stay in flight on each queue; one thread drives all queues. A request
    /// that ends with a status other than OK is counted (errors) and the run goes on; a
    /// backend that hangs up, or answers nothing for 10 s, ends it with an error. The
    /// driver shares the host's CPUs with the backend under test, and by default spins.
    Blk(BlkArgs),
    /// Forward TCP connections from --listen to --to, adding --delay to the data in each
    /// direction (a request and its reply cost twice the delay): latency without netem.
    ///
    /// Logs `listening on ADDR` to stderr once bound (`:0` chooses a port); runs until
    /// killed, SIGTERM or SIGINT.
    DelayProxy(DelayProxyArgs),
}

/// Options of `fallow bench delay-proxy`.
#[derive(Debug, Args)]
pub struct DelayProxyArgs {
    /// Where to accept connections: IP:PORT.
    #[arg(long, value_name = "ADDR")]
    listen: std::net::SocketAddr,
    /// Where to forward each connection: HOST:PORT.
    #[arg(long, value_name = "ADDR")]
    to: String,
    /// The latency added in each direction: 5ms, 0.2s, or seconds.
    #[arg(long, value_parser = parse_duration)]
    delay: Duration,
}

/// Options of `fallow bench blk`.
#[derive(Debug, Args)]
pub struct BlkArgs {
    /// The device: vhost-user:PATH, nbd://HOST:PORT/NAME, nbd+unix:///NAME?socket=PATH or
    /// null.
    #[arg(long)]
    target: BlkTarget,
    /// randread, randwrite, read or write (sequential ones wrap at the end of the range).
    /// Writes change the disk's contents.
    #[arg(long, default_value = "randread")]
    rw: Rw,
    /// Bytes per request: whole 512-byte sectors (4096, 4K, 64K).
    #[arg(long, default_value = "4096", value_parser = parse_bytes_u32)]
    bs: u32,
    /// Requests in flight per queue (vhost-user and null: at most 85, three descriptors each
    /// in a queue of 256).
    #[arg(long, default_value_t = 1)]
    qd: u16,
    /// How long to measure: 500ms, 5s, 1m, or seconds.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    duration: Duration,
    /// Address only the first BYTES of the disk (64M, 1G): offsets are block-aligned and
    /// below it. Default: the whole disk.
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    range: Option<u64>,
    /// Queues to drive, each with QD in flight (vhost-user and null).
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// How the driver waits for completions: spin on the used ring (the backend's latency,
    /// without the driver's wake-up), or call (sleep on the call eventfd, as a guest waits
    /// for an interrupt). vhost-user and null.
    #[arg(long, default_value = "spin")]
    wait: Wait,
    /// Seed of the random offsets and the written data.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Print one JSON object instead of text: target, rw, bs, qd, queues, wait, ops,
    /// seconds, iops, mib_per_s, latency_us {min, p50, p90, p99, p999, max, mean}, errors,
    /// first_error, disk_bytes, range_bytes, host_cpus.
    #[arg(long)]
    json: bool,
}

/// Options of `fallow bench pages`.
#[derive(Debug, Args)]
pub struct PagesArgs {
    /// The server: fallow://HOST:PORT, fallow://unix:/PATH or memcached://HOST:PORT; or a
    /// cluster through the cluster client: cluster://A,B,C (also fallow://A,B,C), where
    /// any one seed is enough and the report adds each node, the client's summary and
    /// node state changes.
    #[arg(long)]
    target: Target,
    /// The file holding the cluster secret (fallow targets).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    #[command(flatten)]
    node_tls: super::tls::NodeTlsArgs,
    /// get, put, or mix:R with R the read fraction (mix:0.9).
    #[arg(long, default_value = "get")]
    workload: Workload,
    /// Size of the key space (keys 0..N).
    #[arg(long, default_value_t = 65_536)]
    keys: u64,
    /// Key distribution: uniform or zipf:THETA (zipf:0.99).
    #[arg(long, default_value = "uniform")]
    dist: KeyDist,
    /// Page contents: random (every put unique) or dup:N (N distinct pages, 16 by default,
    /// so that dedup engages).
    #[arg(long, default_value = "random")]
    value: ValueMode,
    /// Connections to the server.
    #[arg(long, short = 'c', default_value_t = 1)]
    connections: usize,
    /// Requests in flight per connection.
    #[arg(long, short = 'q', default_value_t = 1)]
    queue_depth: usize,
    /// Pages per request.
    #[arg(long, short = 'b', default_value_t = 1)]
    batch: usize,
    /// Threads of the load generator (1: a single-threaded runtime).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// How long to measure: 500ms, 3s, 1m, or seconds.
    #[arg(long, short = 'd', default_value = "5s", value_parser = parse_duration)]
    duration: Duration,
    /// First put every key once (not measured), so that gets hit. A fallow run creates a
    /// pool of its own (destroyed at the end), so its gets hit only with this.
    #[arg(long)]
    warmup: bool,
    /// Fallow only: create the benchmark pool with dedup on or off.
    #[arg(long, default_value = "on", value_name = "on|off", value_parser = parse_on_off, action = clap::ArgAction::Set)]
    dedup: bool,
    /// Fallow only: create the benchmark pool persistent instead of ephemeral (never
    /// evicted: keep --keys within the node's budget; journaled by a node with
    /// --state-dir).
    #[arg(long)]
    persistent: bool,
    /// At most N requests per second over all connections and queue slots (fallow and
    /// cluster targets): a steady load, e.g. to watch latency while a node fails.
    #[arg(long, value_name = "N")]
    rate: Option<f64>,
    /// Seed of the keys, the mix and the page contents.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The server's process ID, when it runs on this host: its CPU time (user + system)
    /// over the measured phase is reported, in all and per page (`server_cpu` in JSON).
    #[arg(long, value_name = "PID")]
    server_pid: Option<u32>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Also write every measured request to FILE as CSV (start_unix_ns,latency_ns,op),
    /// oldest first: a latency timeline to line up with events on the host.
    #[arg(long, value_name = "FILE")]
    timeline: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long)]
    quiet: bool,
}

/// Runs a bench subcommand.
pub fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Pages(args) => bench_pages(args),
        BenchCommand::Blk(args) => bench_blk(args),
        BenchCommand::DelayProxy(args) => delay_proxy(args),
    }
}

fn delay_proxy(args: DelayProxyArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (listen, to, delay) = (args.listen, args.to.clone(), args.delay);
    let proxy = delay_proxy::DelayProxy { to: args.to, delay: args.delay };
    runtime.block_on(async move {
        let serve = delay_proxy::run(listen, proxy, |bound| {
            eprintln!(
                "fallow bench delay-proxy: listening on {bound}, forwarding to {to} with \
                 {delay:?} each way"
            );
        });
        tokio::select! {
            result = serve => result.with_context(|| format!("delay proxy on {listen}")),
            signal = crate::cmd::node::wait_for_signal() => signal,
        }
    })
}

fn bench_pages(args: PagesArgs) -> anyhow::Result<()> {
    let mut opts = PagesOptions::new(args.target);
    if let Some(path) = &args.secret_file {
        // Read exactly as the node reads it, so that the same file always matches.
        opts.secret = fallow_node::config::read_secret(path).map_err(anyhow::Error::msg)?;
    }
    opts.tls = args.node_tls.client()?;
    opts.workload = args.workload;
    opts.keys = args.keys;
    opts.dist = args.dist;
    opts.value = args.value;
    opts.connections = args.connections;
    opts.queue_depth = args.queue_depth;
    opts.batch = args.batch;
    opts.threads = args.threads;
    opts.duration = args.duration;
    opts.warmup = args.warmup;
    opts.dedup = args.dedup;
    opts.persistent = args.persistent;
    opts.seed = args.seed;
    opts.timeline = args.timeline.is_some();
    opts.rate = args.rate;
    opts.server_pid = args.server_pid;
    let quiet = args.quiet;
    let report = pages::run(&opts, |tick| {
        if !quiet {
            eprintln!("{}", progress_line(tick));
        }
    })?;
    if let Some(path) = &args.timeline {
        write_timeline(path, &report.timeline)
            .with_context(|| format!("writing the timeline to {}", path.display()))?;
    }
    print_report(&report, args.json)
}

/// Prints `report` on stdout as one JSON object or as text. A closed stdout (`| head`) is an
/// error to report, not a panic as `println!` would make it.
fn print_report<R: serde::Serialize + std::fmt::Display>(
    report: &R,
    json: bool,
) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if json {
        writeln!(out, "{}", serde_json::to_string(report)?)?;
    } else {
        writeln!(out, "{report}")?;
    }
    Ok(())
}

fn bench_blk(args: BlkArgs) -> anyhow::Result<()> {
    let mut opts = BlkOptions::new(args.target);
    opts.rw = args.rw;
    opts.bs = args.bs;
    opts.qd = args.qd;
    opts.duration = args.duration;
    opts.range = args.range;
    opts.queues = args.queues;
    opts.wait = args.wait;
    opts.seed = args.seed;
    let report = blk::run(&opts).with_context(|| format!("fallow bench blk on {}", opts.target))?;
    print_report(&report, args.json)
}

/// One CSV line per request: `start_unix_ns,latency_ns,get|put`.
fn write_timeline(path: &std::path::Path, timeline: &[pages::TimedRequest]) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(out, "start_unix_ns,latency_ns,op")?;
    for r in timeline {
        let op = if r.get { "get" } else { "put" };
        writeln!(out, "{},{},{op}", r.start_unix_ns, r.latency_ns)?;
    }
    out.flush()
}

fn progress_line(tick: &Tick) -> String {
    let phase = match tick.phase {
        Phase::Warmup => "warm-up",
        Phase::Measure => "measure",
    };
    format!(
        "{phase} {:>5.1} s: {:>9.0} pages/s, {} pages",
        tick.elapsed.as_secs_f64(),
        tick.pages_per_s,
        tick.pages
    )
}

/// `500ms`, `3s`, `2m`, or a number of seconds (`1.5`).
fn parse_duration(s: &str) -> Result<Duration, String> {
    let (number, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let scale = match unit {
        "ms" => 1e-3,
        "s" => 1.0,
        "m" | "min" => 60.0,
        _ => return Err(format!("unknown unit {unit:?} in {s:?}: use ms, s or m")),
    };
    let value: f64 = number.trim().parse().map_err(|_| format!("{s:?} is not a duration"))?;
    Duration::try_from_secs_f64(value * scale).map_err(|_| format!("{s:?} is out of range"))
}

/// A byte count: `4096`, `4K`, `64M`, `1G` (powers of 1024).
fn parse_bytes(s: &str) -> Result<u64, String> {
    fallow_node::lending::parse_size(s).map_err(|e| e.to_string())
}

fn parse_bytes_u32(s: &str) -> Result<u32, String> {
    let n = parse_bytes(s)?;
    u32::try_from(n).map_err(|_| format!("{s:?} is too large"))
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, not {s:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("3s"), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        for bad in ["", "s", "3h", "-1s", "x"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes_u32("4096"), Ok(4096));
        assert_eq!(parse_bytes_u32("64K"), Ok(65536));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        assert!(parse_bytes_u32("8G").is_err());
        assert!(parse_bytes("x").is_err());
    }
}
