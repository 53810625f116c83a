//! `fallow vhost`: serve exports to QEMU guests on this host as vhost-user-blk devices.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use fallow_core::ListenAddr;
use fallow_nbd::{NbdServer, ServerOptions};
use fallow_net::cpus::CpuList;
use fallow_vhost::{Device, Polling, Server};

use super::exports::{nbd_exports, open_exports, stop_exports, ExportArgs};
use super::tls::NbdTlsArgs;

/// Serve block devices to QEMU guests on this host through shared memory (vhost-user-blk),
/// with reads served from the page pool.
///
/// Each `--export NAME=BACKING` (the same exports, pool, tiers and write policies as
/// `fallow nbd`; see `fallow nbd --help`) gets a socket DIR/NAME.sock. A guest uses it with
///
///   -object memory-backend-memfd,id=mem,size=RAM,share=on -numa node,memdev=mem
///   -chardev socket,id=NAME,path=DIR/NAME.sock,reconnect-ms=1000
///   -device vhost-user-blk-pci,chardev=NAME,num-queues=N
///
/// The guest's memory must be shared (memfd or a file with share=on): the device reads
/// requests and copies data in the guest's own memory, with no socket on the data path.
/// One QEMU at a time per socket; when it goes, the socket takes the next one, and a QEMU
/// whose chardev reconnects finds the device again after `fallow vhost` restarts.
/// `--nbd ADDR` serves the same exports over NBD too, over the same caches.
#[derive(Debug, Args)]
pub struct VhostArgs {
    #[command(flatten)]
    exports: ExportArgs,
    /// The directory of the sockets, one per export: DIR/NAME.sock (created if missing).
    #[arg(long, value_name = "DIR")]
    socket_dir: PathBuf,
    /// Virtqueues per device, each served by a thread of its own. QEMU uses up to this many
    /// (its num-queues); more than the guest's vCPUs gains nothing.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    queues: u16,
    /// How long a queue thread keeps looking at its ring for the next request, in
    /// microseconds, before it sleeps until the guest kicks. Polling saves the guest its
    /// kick and the thread its wake-up (tens of microseconds), and burns up to a core per
    /// busy queue while it spins: it spins only while requests keep coming, and sleeps
    /// once the queue has been idle this long. 0 never spins; at most 1000000.
    #[arg(long, value_name = "US", default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    poll_us: u64,
    /// Pin the queue threads to these CPUs, in turn ("2,3" or "2-3"). Best with --poll-us,
    /// on cores nothing else runs on.
    #[arg(long, value_name = "CPUS")]
    cpus: Option<CpuList>,
    /// Also serve the exports over NBD at ADDR (HOST:PORT or unix:PATH); repeatable.
    #[arg(long, value_name = "ADDR")]
    nbd: Vec<ListenAddr>,
    /// Serve Prometheus metrics at http://ADDR/metrics: each export's cache (hits per
    /// tier, backing-store reads, dirty data), whichever front end read it, and the NBD
    /// requests of --nbd; `fallow stat --nbd ADDR` reads them.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// TLS of the --nbd listeners.
    #[command(flatten)]
    tls: NbdTlsArgs,
}

/// Runs the devices until SIGTERM or SIGINT.
pub fn run(args: VhostArgs) -> anyhow::Result<()> {
    let tls = args.tls.policy()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .thread_name("fallow-vhost")
        .max_blocking_threads(super::serving::MAX_BLOCKING_THREADS)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let polling = Polling {
        poll: Duration::from_micros(args.poll_us),
        cpus: args.cpus.clone().unwrap_or_default(),
    };
    std::fs::create_dir_all(&args.socket_dir)
        .with_context(|| format!("creating {}", args.socket_dir.display()))?;
    runtime.block_on(async {
        let mut opened = open_exports(&args.exports).await?;
        let engine = opened.engine.take();
        let mut servers = Vec::new();
        for export in &opened.exports {
            let device = Device::new(
                &export.name,
                export.cache.clone(),
                args.queues,
                args.exports.read_only,
                polling.clone(),
                tokio::runtime::Handle::current(),
            );
            let path = args.socket_dir.join(format!("{}.sock", export.name));
            servers.push(Arc::new(Server::bind(&path, device)?));
        }
        // The NBD server also carries the metrics endpoint (with no NBD address, only that).
        let nbd = match args.nbd.is_empty() && args.metrics.is_none() {
            true => None,
            false => {
                let exports = nbd_exports(&opened.exports, args.exports.read_only);
                let options = ServerOptions { metrics: args.metrics, tls, ..Default::default() };
                Some(NbdServer::start_with(&args.nbd, exports, options).await?)
            }
        };
        let mut threads = Vec::new();
        for server in &servers {
            eprintln!("fallow vhost: serving {} at {}", server.device().name(), server.path().display());
            let server = server.clone();
            let thread = std::thread::Builder::new()
                .name(format!("vhost-{}", server.device().name()))
                .spawn(move || {
                    if let Err(err) = server.serve() {
                        tracing::error!(export = %server.device().name(), %err, "vhost-user socket stopped");
                    }
                })
                .context("starting a socket thread")?;
            threads.push(thread);
        }
        if let (Some(nbd), Some(engine)) = (&nbd, engine) {
            super::nbd::export_engine_memory(nbd, engine);
        }
        if let Some(nbd) = &nbd {
            for addr in nbd.local_addrs() {
                eprintln!("fallow vhost: also serving NBD at {addr}");
            }
        }
        crate::cmd::node::wait_for_signal().await?;
        tracing::info!("stopping");
        for server in &servers {
            server.shutdown();
        }
        // The socket threads end once their session's requests have finished.
        let joined = tokio::task::spawn_blocking(move || {
            for thread in threads {
                let _ = thread.join();
            }
        });
        if tokio::time::timeout(Duration::from_secs(10), joined).await.is_err() {
            tracing::warn!("vhost-user sessions still busy after 10 s; leaving them");
        }
        if let Some(nbd) = nbd {
            nbd.shutdown().await;
        }
        for server in &servers {
            let stats = server.device().stats();
            tracing::info!(
                export = %server.device().name(),
                ok = stats.ok.load(std::sync::atomic::Ordering::Relaxed),
                failed = stats.failed.load(std::sync::atomic::Ordering::Relaxed),
                completed_in_place = stats.inline.load(std::sync::atomic::Ordering::Relaxed),
                "vhost-user device stopped"
            );
        }
        stop_exports(&mut opened, &args.exports).await
    })
}
