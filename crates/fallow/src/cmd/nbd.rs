//! `fallow nbd`: export block devices over NBD, their reads served from the page pool.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use fallow_cache::WritePolicy;
use fallow_core::ListenAddr;
use fallow_nbd::metrics::PoolMemory;
use fallow_nbd::{NbdServer, ServerOptions};
use fallow_pool::Engine;
use tokio::signal::unix::{signal, SignalKind};

use super::exports::{
    nbd_exports, open_exports, stop_exports, CacheSettings, ExportArgs, OpenedExport,
};
use super::logging;
use super::nbd_file::NbdFile;
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
///
/// Settings can also come from a TOML file (`--config`; a sample is deploy/nbd/example.toml),
/// with a section per export for settings of its own; a flag wins over the file. SIGHUP
/// reads the file again: the log filter and each export's local tier size and write-back
/// limits change at once, and the server logs which other settings changed (they wait for
/// a restart). SIGTERM stops cleanly: clients finish, dirty data is written out.
#[derive(Debug, Clone, Args)]
pub struct NbdArgs {
    /// A TOML config file: the flags' settings, and `[exports.NAME]` sections.
    #[arg(long, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
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

/// Runs the NBD server until SIGTERM or SIGINT; reloads its config file on SIGHUP.
pub fn run(cli: NbdArgs) -> anyhow::Result<()> {
    let (args, log) = with_file(&cli)?;
    if let (Some(spec), false) = (&log, logging::set_by_environment()) {
        logging::set_filter(spec)?;
    }
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
        // What is in force: each export's cache settings (a reload changes some), and
        // the settings the server started with (the others wait for a restart).
        let mut in_force = BTreeMap::new();
        for export in &opened.exports {
            in_force.insert(export.name.clone(), args.exports.cache_settings(&export.name)?);
        }
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let mut hangup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
        loop {
            tokio::select! {
                _ = term.recv() => break tracing::info!("SIGTERM received"),
                _ = int.recv() => break tracing::info!("SIGINT received"),
                _ = hangup.recv() => reload(&cli, &args, &opened.exports, &mut in_force),
            }
        }
        server.shutdown().await;
        stop_exports(&mut opened, &args.exports).await
    })
}

/// The flags with the config file merged in (the flags win), and the file's log filter.
fn with_file(cli: &NbdArgs) -> anyhow::Result<(NbdArgs, Option<String>)> {
    let mut args = cli.clone();
    let Some(path) = &cli.config else { return Ok((args, None)) };
    let file = NbdFile::load(path)?;
    let log = file.log.clone();
    let a = &mut args;
    file.merge_into(
        &mut a.listen,
        &mut a.metrics,
        &mut a.polling.poll_us,
        &mut a.exports,
        &mut a.tls,
    )?;
    Ok((args, log))
}

/// SIGHUP: reads the config file again, applies to the running exports what can change
/// live (each one's local tier size and write-back limits; the log filter), and logs the
/// other settings that differ from those the server started with, which wait for a
/// restart. A file that does not load, or settings that do not hold, change nothing.
fn reload(
    cli: &NbdArgs,
    started: &NbdArgs,
    exports: &[OpenedExport],
    in_force: &mut BTreeMap<String, CacheSettings>,
) {
    let Some(path) = &cli.config else {
        tracing::info!("SIGHUP: no --config file to reload");
        return;
    };
    tracing::info!(path = %path.display(), "SIGHUP: reloading the config file");
    let loaded = with_file(cli).and_then(|(new, log)| {
        let wanted = exports
            .iter()
            .map(|e| Ok((e.name.clone(), new.exports.cache_settings(&e.name)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok((new, log, wanted))
    });
    let (new, log, wanted) = match loaded {
        Ok(loaded) => loaded,
        Err(err) => {
            tracing::error!(error = %format!("{err:#}"), "reload failed; the running settings stay");
            return;
        }
    };
    let mut applied = Vec::new();
    let mut waiting = restart_only_changes(started, &new);
    if let Some(spec) = log {
        logging::reload_filter(&spec, &mut applied);
    }
    for ((name, then), export) in wanted.into_iter().zip(exports) {
        let Some(now) = in_force.get_mut(&name) else { continue };
        if then.local_pages != now.local_pages {
            if export.cache.set_local_capacity(then.local_pages) {
                applied.push(format!("{name}: local tier {} pages", then.local_pages));
                now.local_pages = then.local_pages;
            } else {
                waiting.push(format!("{name}: local_tier (to or from 0)"));
            }
        }
        match (now.write, then.write) {
            (a, b) if a == b => {}
            (WritePolicy::Back { .. }, WritePolicy::Back { max_dirty_bytes, max_age }) => {
                export.cache.set_dirty_limits(max_dirty_bytes, max_age);
                applied.push(format!(
                    "{name}: max_dirty {max_dirty_bytes} B, max_dirty_age {} ms",
                    max_age.as_millis()
                ));
                now.write = then.write;
            }
            _ => waiting.push(format!("{name}: write_policy")),
        }
        if then.mode != now.mode {
            waiting.push(format!("{name}: mode"));
        }
    }
    logging::report_reload("server", &applied, &waiting);
}

/// The settings that differ between `running` and `new` and cannot change while the
/// server runs: its sockets, exports, pool and TLS are made once, at start.
fn restart_only_changes(running: &NbdArgs, new: &NbdArgs) -> Vec<String> {
    let (a, b) = (&running.exports, &new.exports);
    let specs = |e: &ExportArgs| e.specs().unwrap_or_default();
    [
        ("listen", running.listen != new.listen),
        ("metrics", running.metrics != new.metrics),
        ("poll_us", running.polling.poll_us != new.polling.poll_us),
        ("exports (added, removed or another backing)", specs(a) != specs(b)),
        ("pool", a.pool != b.pool),
        ("secret_file", a.secret_file != b.secret_file),
        ("node_tls", a.node_tls.node_tls != b.node_tls.node_tls),
        ("state_dir", a.state_dir != b.state_dir),
        ("compress", a.compress != b.compress),
        ("read_only", a.read_only != b.read_only),
        (
            "tls",
            running.tls.tls != new.tls.tls
                || running.tls.tls_certificates != new.tls.tls_certificates
                || running.tls.tls_psk != new.tls.tls_psk
                || running.tls.tls_verify_peer != new.tls.tls_verify_peer,
        ),
    ]
    .into_iter()
    .filter(|(_, changed)| *changed)
    .map(|(name, _)| name.to_string())
    .collect()
}
