//! `fallow up`: everything on one host, in one process — lend idle memory, export a disk
//! image over NBD with its reads cached in that memory, and show how it goes.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use fallow_backing::{BackingStore, FileStore};
use fallow_cache::{CacheConfig, CacheLayer, Mode, PoolTier};
use fallow_core::{AsyncPageStore, ListenAddr, PoolSpec};
use fallow_nbd::{Export, NbdServer, ServerOptions};
use fallow_node::lending::{parse_size, Governor, LendMode};
use fallow_pool::{Engine, EngineBuilder};

use super::serving::{server_runtime, PollingArgs};

/// Lend this host's idle memory and export a disk image through it, in one process.
///
/// On first run a sparse image of `--size` is created under the data directory; later runs
/// reuse it. The image is exported over NBD; its reads are cached in a local tier and in a
/// pool of memory that follows the host (`--lend auto`: only what the host does not need,
/// given back within 100 ms of memory pressure). Writes go to the image before they are
/// acknowledged. A status line shows the hit ratio, pool use and backing-store latency.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Where the image lives [default: $XDG_DATA_HOME/fallow, ~/.local/share/fallow, or
    /// /var/lib/fallow for root].
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Size of the image created on first run.
    #[arg(long, value_name = "SIZE", default_value = "16G")]
    size: String,
    /// Where to serve NBD.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:10809")]
    listen: ListenAddr,
    /// Memory to lend to the pool: `auto` or a size.
    #[arg(long, value_name = "SIZE|auto", default_value = "auto")]
    lend: String,
    /// Local tier in front of the pool.
    #[arg(long, value_name = "SIZE", default_value = "64M")]
    local_tier: String,
    /// No status line.
    #[arg(long)]
    quiet: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics; `fallow stat --nbd ADDR` shows them
    /// as a table.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    #[command(flatten)]
    polling: PollingArgs,
}

fn default_data_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_DATA_HOME") {
        return PathBuf::from(dir).join("fallow");
    }
    match std::env::var_os("HOME") {
        Some(home) if !running_as_root() => PathBuf::from(home).join(".local/share/fallow"),
        _ => PathBuf::from("/var/lib/fallow"),
    }
}

fn running_as_root() -> bool {
    // The effective uid, from /proc to avoid a libc call.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// Runs until SIGTERM or SIGINT.
pub fn run(args: UpArgs) -> anyhow::Result<()> {
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    std::fs::create_dir_all(&data_dir)
        .with_context(|| format!("creating {}", data_dir.display()))?;
    let image = data_dir.join("disk.img");
    let size = parse_size(&args.size).with_context(|| format!("--size {}", args.size))?;
    let lend: LendMode = args.lend.parse().with_context(|| format!("--lend {}", args.lend))?;
    let local_pages = (parse_size(&args.local_tier)
        .with_context(|| format!("--local-tier {}", args.local_tier))?
        / fallow_core::PAGE_SIZE as u64) as usize;
    let backing: Arc<dyn BackingStore> = if image.exists() {
        let store = FileStore::open(&image, false)?;
        if store.size() != size {
            eprintln!(
                "fallow up: keeping {} at its size of {} bytes (--size applies to a new image)",
                image.display(),
                store.size()
            );
        }
        Arc::new(store)
    } else {
        Arc::new(FileStore::open_or_create(&image, size)?)
    };
    let most = usize::try_from(lend.most_bytes()).unwrap_or(usize::MAX);
    let engine = Arc::new(Engine::new(EngineBuilder::new(0).budget_up_to(most).build()?));
    let governor = Governor::start(engine.clone(), &lend).context("lending governor")?;
    let polling = args.polling.read_polling()?;
    let runtime = server_runtime("fallow-up", args.polling.cpus.as_ref())?;
    runtime.block_on(async move {
        let pool = AsyncPageStore::create_pool(&*engine, &PoolSpec::ephemeral()).await?;
        let tier = PoolTier { store: engine.clone(), pool, object: 0 };
        let config = CacheConfig { local_pages, mode: Mode::Exclusive, ..CacheConfig::default() };
        let cache = CacheLayer::new(backing, Some(tier), config);
        let export = Arc::new(Export {
            name: "disk".into(),
            description: image.display().to_string(),
            cache: cache.clone(),
            read_only: false,
        });
        let listen = std::slice::from_ref(&args.listen);
        let options = ServerOptions { metrics: args.metrics, polling, ..ServerOptions::default() };
        let server = NbdServer::start_with(listen, vec![export], options).await?;
        crate::cmd::nbd::export_engine_memory(&server, engine.clone());
        let watch = match server.metrics_addr() {
            Some(addr) => format!("\n  watch it:\n    fallow stat --nbd {addr}\n"),
            None => "\n  watch it: start with --metrics 127.0.0.1:9100, then\n    \
                     fallow stat --nbd 127.0.0.1:9100\n"
                .to_string(),
        };
        let uri = match &server.local_addrs()[0] {
            ListenAddr::Tcp(addr) => format!("nbd://{addr}/disk"),
            ListenAddr::Unix(path) => format!("nbd+unix:///disk?socket={}", path.display()),
        };
        eprintln!(
            "fallow up: serving {} ({} bytes) at {uri}\n\
             \n  use it:\n    qemu-system-x86_64 -drive file={uri},format=raw,if=virtio ...\n    \
             qemu-img info {uri}\n    nbdfuse /mnt/fallow-disk {uri} &   (then losetup/mount the file it shows)\n    \
             nbd-client -N disk {} /dev/nbd0        (where the kernel has NBD)\n{watch}\n  stop with Ctrl-C.\n",
            image.display(),
            cache.size(),
            match &server.local_addrs()[0] {
                ListenAddr::Tcp(addr) => format!("{} {}", addr.ip(), addr.port()),
                ListenAddr::Unix(path) => format!("-unix {}", path.display()),
            }
        );
        let status = (!args.quiet).then(|| tokio::spawn(status_line(cache, engine, governor)));
        crate::cmd::node::wait_for_signal().await?;
        if let Some(status) = status {
            status.abort();
        }
        eprintln!();
        server.shutdown().await;
        Ok(())
    })
}

/// Prints the hit ratio, pool use and backing latency: in place on a terminal, as a line
/// every 10 s otherwise.
async fn status_line(
    cache: CacheLayer,
    engine: Arc<Engine>,
    governor: fallow_node::lending::GovernorHandle,
) {
    let tty = std::io::stderr().is_terminal();
    let every = if tty { Duration::from_secs(1) } else { Duration::from_secs(10) };
    loop {
        tokio::time::sleep(every).await;
        let s = cache.stats();
        let (local, pool, miss) =
            (s.local_hits.load(Relaxed), s.pool_hits.load(Relaxed), s.misses.load(Relaxed));
        let total = (local + pool + miss).max(1) as f64;
        let reads = s.backing_reads.load(Relaxed).max(1);
        let latency_ms = s.backing_read_micros.load(Relaxed) as f64 / reads as f64 / 1000.0;
        let memory = engine.memory();
        let lent = governor.status().budget_bytes;
        let line = format!(
            "hits {:5.1}% (local {:4.1}%, pool {:4.1}%) | pool {} MiB used of {} MiB lent | backing {:.2} ms/read",
            100.0 * (local + pool) as f64 / total,
            100.0 * local as f64 / total,
            100.0 * pool as f64 / total,
            memory.held_bytes() >> 20,
            lent >> 20,
            latency_ms
        );
        if tty {
            eprint!("\r{line}\x1b[K");
        } else {
            eprintln!("fallow up: {line}");
        }
    }
}
