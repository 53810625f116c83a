//! `fallow nbd`: export block devices over NBD, their reads served from the page pool.

use std::sync::Arc;

use clap::Args;
use fallow_core::ListenAddr;
use fallow_nbd::metrics::PoolMemory;
use fallow_nbd::{NbdServer, ServerOptions};
use fallow_pool::Engine;

use super::exports::{nbd_exports, open_exports, stop_exports, ExportArgs};
use super::serving::{server_runtime, PollingArgs};
use super::tls::{nbd_scheme, NbdTlsArgs};

/// Export block devices over NBD, with reads served from the page pool.
///
/// Each `--export NAME=BACKING` is one export; BACKING is a file or block device
/// (`file:PATH`, or just a path; `file:PATH,size=SIZE` creates a sparse image if missing),
/// a RAM disk (`mem:SIZE`), an upstream NBD server (`nbd://HOST:PORT/EXPORT`; over TLS
/// `nbds://HOST:PORT/EXPORT?tls-certificates=DIR` or `?tls-psk-file=FILE`) or, in a
/// build with the `rados` feature, a Ceph RADOS image striped over 4 MiB objects
/// (`rados:POOL/PREFIX[,size=SIZE][,conf=PATH][,user=NAME][,namespace=NS][,timeout=SECS]`: `size=`
/// creates it if missing; the configuration defaults to $CEPH_CONF, then
/// /etc/ceph/ceph.conf, the user to admin, and `timeout=`, how long opening waits for the
/// cluster, to 10 s). Reads go to the local tier, then the pool
/// (`--pool local:SIZE` for one in this process, or `fallow://HOST:PORT` for a node or
/// `fallow://A,B,C` for a cluster, with `--secret-file`), then the backing store; writes go through to the backing store before
/// they are acknowledged. Connect with any NBD client, e.g.
/// `qemu-img info nbd://127.0.0.1:10809/NAME`. With `--poll-us` each connection polls its
/// socket between requests instead of sleeping: lower latency, for up to a core per busy
/// connection. With `--tls require`, clients must use TLS
/// (`nbds://HOST:PORT/NAME`, e.g. `nbdinfo 'nbds://HOST/NAME?tls-certificates=DIR'` or
/// qemu's `--object tls-creds-x509`); docs/security.md shows how to make certificates.
#[derive(Debug, Args)]
pub struct NbdArgs {
    #[command(flatten)]
    exports: ExportArgs,
    /// Where to listen: HOST:PORT or unix:PATH. Repeatable [default: the sockets systemd
    /// hands over (socket activation), else 127.0.0.1:10809].
    #[arg(long, value_name = "ADDR")]
    listen: Vec<ListenAddr>,
    /// Serve Prometheus metrics at http://ADDR/metrics (requests by command, latency,
    /// cache hits per tier, backing-store reads, dirty data).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    #[command(flatten)]
    polling: PollingArgs,
    #[command(flatten)]
    tls: NbdTlsArgs,
}

/// Lets the server's metrics (and so `fallow stat --nbd`) show the memory of a pool engine
/// running in this process.
pub(crate) fn export_engine_memory(server: &NbdServer, engine: Arc<Engine>) {
    server.metrics().watch_pool_memory(move || {
        let memory = engine.memory();
        PoolMemory {
            used_bytes: memory.held_bytes() as u64,
            lent_bytes: memory.budget_bytes as u64,
            // A visit of every shard, at scrape time only.
            pages: engine.stats().pages,
        }
    });
}

/// Runs the NBD server until SIGTERM or SIGINT.
pub fn run(args: NbdArgs) -> anyhow::Result<()> {
    let polling = args.polling.read_polling()?;
    let tls = args.tls.policy()?;
    let scheme = nbd_scheme(&tls);
    let runtime = server_runtime("fallow-nbd", args.polling.cpus.as_ref())?;
    runtime.block_on(async move {
        // No --listen: the sockets the service manager handed over, else the default.
        let listen = match (args.listen.is_empty(), fallow_net::activation::any_left()) {
            (false, _) => args.listen.clone(),
            (true, true) => Vec::new(),
            (true, false) => vec!["127.0.0.1:10809".parse().expect("the default address parses")],
        };
        let mut opened = open_exports(&args.exports).await?;
        let engine = opened.engine.take();
        let names: Vec<String> = opened.exports.iter().map(|e| e.name.clone()).collect();
        let exports = nbd_exports(&opened.exports, args.exports.read_only);
        let options = ServerOptions { metrics: args.metrics, polling, tls };
        let server = NbdServer::start_with(&listen, exports, options).await?;
        if fallow_net::activation::any_left() {
            tracing::warn!("sockets handed over by the service manager match no --listen address; they are not served");
        }
        if let Some(engine) = engine {
            export_engine_memory(&server, engine);
        }
        for addr in server.local_addrs() {
            for name in &names {
                match addr {
                    ListenAddr::Tcp(a) => eprintln!("fallow nbd: serving {scheme}://{a}/{name}"),
                    ListenAddr::Unix(p) => eprintln!(
                        "fallow nbd: serving {scheme}+unix:///{name}?socket={}",
                        p.display()
                    ),
                }
            }
        }
        crate::cmd::node::wait_for_signal().await?;
        server.shutdown().await;
        stop_exports(&mut opened).await;
        Ok(())
    })
}
