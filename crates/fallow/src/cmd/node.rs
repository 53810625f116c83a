//! `fallow node`: lend this host's idle memory to clients over the pool protocol.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use fallow_net::cpus::CpuList;
use fallow_node::lending::{parse_size, Governor, LendMode};
use fallow_node::{
    recovery, restart, ClusterSettings, ConfigFile, ListenAddr, Node, NodeConfig, Server,
};
use fallow_pool::{journal, Engine, EngineBuilder};

use super::serving::{read_polling, server_runtime, PollingArgs};
use tokio::signal::unix::{signal, SignalKind};

use super::logging;
use super::tls::{node_tls_client, node_tls_server, NodeTlsArgs};

/// The default address: loopback only, so a node is never exposed by accident.
const DEFAULT_LISTEN: &str = "127.0.0.1:7400";

/// Lend this host's idle memory to fallow clients.
///
/// Serves the pool protocol (docs/protocol.md) on TCP and/or Unix sockets. Every client
/// must prove it knows the shared secret. With `--lend auto` (the default) the node lends
/// only what the host does not need: it follows MemAvailable, memory pressure (PSI) and
/// cgroup v2 limits, keeps `--reserve` free for the host, gives memory back within 100 ms
/// of pressure and grows back in the background (docs/governor.md).
///
/// With `--join` (or `--gossip`) the node joins a cluster: it gossips over UDP with the
/// other nodes (every datagram encrypted and authenticated with a key from the secret,
/// replays refused; clocks must agree within 60 s), publishes
/// how much it lends and has free, and detects a failed node within about a second
/// (docs/cluster.md). `fallow stat --cluster` lists the members.
///
/// With `--poll-us` each connection polls its socket between requests instead of sleeping:
/// lower latency, for up to a core per busy connection (docs/concurrency.md, "Polling").
///
/// Settings can also come from a TOML file (`--config`; sample in deploy/); a flag wins
/// over the file. SIGHUP reads the file again: `lend`, `reserve` and `log` change at once,
/// and the node logs which other settings changed (they wait for a restart). Logs go to
/// stderr (filter from FALLOW_LOG, else the file's `log`, else info). SIGTERM or SIGINT
/// stops the node cleanly (and tells the cluster it left).
#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// A TOML config file (see deploy/fallow-node.toml).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where to listen: HOST:PORT or unix:PATH. Repeat for several [default: 127.0.0.1:7400].
    #[arg(long, value_name = "ADDR")]
    listen: Vec<ListenAddr>,
    /// How much memory to lend: a size (512M, 8GiB) or `auto` [default: auto].
    #[arg(long, value_name = "SIZE|auto")]
    lend: Option<String>,
    /// With `--lend auto`: memory always left free for the host [default: the larger of
    /// 1 GiB and 5 % of the host's memory].
    #[arg(long, value_name = "SIZE")]
    reserve: Option<String>,
    /// File holding the shared cluster secret (at least 16 bytes). Required.
    #[arg(long, value_name = "FILE")]
    secret_file: Option<PathBuf>,
    #[command(flatten)]
    node_tls: NodeTlsArgs,
    /// Warm restarts: a clean stop (SIGTERM) writes the node's pages, pools and clients
    /// into DIR, and a start over the same DIR serves them again under the same node and
    /// pool ids. Persistent pages are also journaled into DIR as they change, so a node
    /// that crashed comes back with its pools and every persistent page it acknowledged
    /// (ephemeral pools come back empty). Put DIR in memory (/run, /dev/shm): the journal
    /// is a second copy of the persistent pages.
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
    /// Eviction policy for ephemeral pages: s3fifo-lean, adaptive, lru, s3fifo, wtinylfu, lirs
    /// [default: s3fifo-lean].
    #[arg(long, value_name = "NAME")]
    policy: Option<String>,
    /// Seconds a client's pools outlive its last connection [default: 300].
    #[arg(long, value_name = "SECS")]
    client_lease: Option<u64>,
    /// The most client connections at once [default: 1024].
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Seconds a reply may wait for a client that stopped reading [default: 30].
    #[arg(long, value_name = "SECS")]
    write_timeout: Option<u64>,
    /// Join a cluster: the gossip addresses (HOST:PORT, UDP) of other nodes, comma-separated
    /// or repeated. Nodes not up yet are retried. Turns gossip on.
    #[arg(long, value_name = "ADDR,...", value_delimiter = ',')]
    join: Vec<String>,
    /// The UDP address to gossip on; turns gossip on [default with --join: the first TCP
    /// --listen IP and its port + 1, e.g. 127.0.0.1:7401].
    #[arg(long, value_name = "ADDR")]
    gossip: Option<SocketAddr>,
    /// The protocol address (IP:PORT) the cluster and its clients are told to reach this
    /// node at, when it is not the TCP address it listens on: behind NAT, a port forward or
    /// a proxy [default: the first TCP --listen address].
    #[arg(long, value_name = "ADDR")]
    advertise: Option<SocketAddr>,
    /// Content summary (cross-node dedup): the false-positive rate its Bloom filter is
    /// sized for, between 0.000001 and 0.5 [default: 0.01, 9.6 bits per page held].
    #[arg(long, value_name = "RATE")]
    summary_fpr: Option<f64>,
    /// Content summary: the largest filter; past it the false-positive rate rises
    /// [default: 16M].
    #[arg(long, value_name = "SIZE")]
    summary_max: Option<String>,
    /// Content summary: seconds a built filter is served before a client's request
    /// rebuilds it [default: 10].
    #[arg(long, value_name = "SECS")]
    summary_refresh: Option<u64>,
    /// Peer forwarding (cluster pools): milliseconds a request forwarded to another node
    /// may wait for its answer; a node slower than that costs misses [default: 250].
    #[arg(long, value_name = "MS")]
    forward_timeout: Option<u64>,
    #[command(flatten)]
    polling: PollingArgs,
}

/// The node's settings after merging defaults, the file and the flags.
struct Settings {
    config: NodeConfig,
    lend: LendMode,
    policy: String,
    /// `--cpus`: the runtime's workers, one pinned to each.
    cpus: Option<CpuList>,
    /// The file's log filter.
    log: Option<String>,
    /// `--node-tls`: the credentials' directory.
    tls_dir: Option<PathBuf>,
    /// `--state-dir`: where a clean stop leaves the snapshot.
    state_dir: Option<PathBuf>,
}

fn settings(args: NodeArgs) -> anyhow::Result<Settings> {
    let file = match &args.config {
        Some(path) => ConfigFile::load(path).map_err(anyhow::Error::msg)?,
        None => ConfigFile::default(),
    };
    let listen = if !args.listen.is_empty() {
        args.listen
    } else if let Some(list) = &file.listen {
        list.iter()
            .map(|s| s.parse::<ListenAddr>().map_err(anyhow::Error::msg))
            .collect::<Result<_, _>>()
            .context("config file: listen")?
    } else {
        vec![DEFAULT_LISTEN.parse().expect("the default address parses")]
    };
    if listen.is_empty() {
        bail!("nothing to listen on: give --listen HOST:PORT or unix:PATH");
    }
    let Some(secret_file) = args.secret_file.or(file.secret_file) else {
        bail!(
            "a secret is required: --secret-file FILE (create one with \
             `head -c 32 /dev/urandom | base64 > FILE`)"
        );
    };
    let secret = fallow_node::config::read_secret(&secret_file).map_err(anyhow::Error::msg)?;
    let lend_text = args.lend.or(file.lend).unwrap_or_else(|| "auto".to_string());
    let mut lend: LendMode = lend_text.parse().with_context(|| format!("--lend {lend_text}"))?;
    if let Some(reserve) = args.reserve.or(file.reserve) {
        let LendMode::Auto(auto) = &mut lend else {
            bail!("--reserve applies only to --lend auto (the node lends a fixed {lend})");
        };
        auto.reserve_bytes =
            parse_size(&reserve).with_context(|| format!("--reserve {reserve}"))?;
    }
    let cluster = cluster_settings(
        (args.join, file.join),
        (args.gossip, file.gossip),
        (args.advertise, file.advertise),
    )?;
    let metrics = match args.metrics {
        Some(addr) => Some(addr),
        None => match &file.metrics {
            Some(text) => Some(
                text.parse()
                    .with_context(|| format!("config file: metrics = {text:?}: not HOST:PORT"))?,
            ),
            None => None,
        },
    };
    let mut config = NodeConfig::new(listen, secret);
    config.metrics = metrics;
    let tls_dir = args.node_tls.node_tls.clone().or(file.node_tls.clone());
    if let (Some(server), Some(client)) =
        (node_tls_server(tls_dir.as_deref())?, node_tls_client(tls_dir.as_deref())?)
    {
        tracing::info!(
            credentials = server.summary(),
            "the node protocol runs over TLS 1.3 on TCP"
        );
        config.tls = Some(fallow_node::NodeTls { server, client });
    }
    config.cluster = cluster;
    if let Some(secs) = args.client_lease.or(file.client_lease_secs) {
        config.client_lease = Duration::from_secs(secs);
    }
    if let Some(n) = args.max_connections.or(file.max_connections) {
        config.max_connections = n;
    }
    if let Some(secs) = args.write_timeout.or(file.write_timeout_secs) {
        if secs == 0 {
            bail!("--write-timeout must be at least 1 second");
        }
        config.write_timeout = Duration::from_secs(secs);
    }
    if let Some(rate) = args.summary_fpr.or(file.summary_fpr) {
        if !(1e-6..=0.5).contains(&rate) {
            bail!("--summary-fpr {rate}: give a rate between 0.000001 and 0.5");
        }
        config.summary.false_positive_rate = rate;
    }
    if let Some(max) = args.summary_max.or(file.summary_max) {
        let bytes = parse_size(&max).with_context(|| format!("--summary-max {max}"))?;
        if bytes < 8 {
            bail!("--summary-max {max}: a summary needs at least 8 bytes");
        }
        config.summary.max_bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    }
    if let Some(secs) = args.summary_refresh.or(file.summary_refresh_secs) {
        config.summary.refresh = Duration::from_secs(secs);
    }
    if let Some(ms) = args.forward_timeout.or(file.forward_timeout_ms) {
        if ms == 0 {
            bail!("--forward-timeout must be at least 1 ms");
        }
        config.forward_timeout = Duration::from_millis(ms);
    }
    if let Some(micros) = args.polling.poll_us.or(file.poll_us) {
        config.read_polling = read_polling(micros)?;
    }
    let cpus = match (args.polling.cpus, &file.cpus) {
        (Some(cpus), _) => Some(cpus),
        (None, Some(text)) => Some(text.parse().context("config file: cpus")?),
        (None, None) => None,
    };
    let policy = args
        .policy
        .or(file.policy)
        .unwrap_or_else(|| fallow_pool::eviction::DEFAULT_POLICY.to_string());
    let state_dir = args.state_dir.or(file.state_dir);
    Ok(Settings { config, lend, policy, cpus, log: file.log, tls_dir, state_dir })
}

/// Gossip settings from the flags, else the file (each argument is a flag's value and the
/// file's); `None` (no gossip) when neither names a node to join or an address to gossip
/// on.
fn cluster_settings(
    (join, file_join): (Vec<String>, Option<Vec<String>>),
    (gossip, file_gossip): (Option<SocketAddr>, Option<String>),
    (advertise, file_advertise): (Option<SocketAddr>, Option<String>),
) -> anyhow::Result<Option<ClusterSettings>> {
    let join = if join.is_empty() { file_join.unwrap_or_default() } else { join };
    let gossip = match (gossip, &file_gossip) {
        (Some(addr), _) => Some(addr),
        (None, Some(text)) => Some(
            text.parse().with_context(|| format!("config file: gossip = {text:?}: not IP:PORT"))?,
        ),
        (None, None) => None,
    };
    if let Some(bad) = join.iter().find(|s| s.rsplit_once(':').is_none_or(|(h, _)| h.is_empty())) {
        bail!("--join {bad:?}: give the gossip address of a node as HOST:PORT");
    }
    let advertise = match (advertise, &file_advertise) {
        (Some(addr), _) => Some(addr),
        (None, Some(text)) => Some(
            text.parse()
                .with_context(|| format!("config file: advertise = {text:?}: not IP:PORT"))?,
        ),
        (None, None) => None,
    };
    let gossips = !join.is_empty() || gossip.is_some();
    if advertise.is_some() && !gossips {
        bail!("--advertise is what the cluster is told: it needs --join or --gossip");
    }
    Ok(gossips.then_some(ClusterSettings { gossip, join, advertise }))
}

/// Runs a node until SIGTERM or SIGINT; reloads its config file on SIGHUP.
pub fn run(args: NodeArgs) -> anyhow::Result<()> {
    let mut settings = settings(args.clone())?;
    if let (Some(spec), false) = (&settings.log, logging::set_by_environment()) {
        logging::set_filter(spec)?;
    }
    // The budget starts at zero; the governor sizes it before the first client connects.
    let most = usize::try_from(settings.lend.most_bytes()).unwrap_or(usize::MAX);
    let engine_config = EngineBuilder::new(0)
        .budget_up_to(most)
        .policy(&settings.policy)
        .build()
        .with_context(|| format!("engine settings (policy {})", settings.policy))?;
    let engine = Arc::new(Engine::new(engine_config));
    let governor = Governor::start(engine.clone(), &settings.lend).context("lending governor")?;
    let poll_us = settings.config.read_polling.window.as_micros();
    // What the last run left in `--state-dir`, restored before the node serves.
    let restored = match settings.state_dir.as_deref() {
        Some(dir) => warm_start(dir, &engine)?,
        None => None,
    };
    let node = match restored {
        Some(r) => {
            Node::restored(engine, settings.config.clone(), Some(governor), r.node_id, r.clients)
        }
        None => Node::new(engine, settings.config.clone(), Some(governor)),
    };
    let node = match settings.state_dir.clone() {
        Some(dir) => node.keep_state_in(dir),
        None => node,
    };
    let node = Arc::new(node);
    let runtime = server_runtime("fallow-node", settings.cpus.as_ref())?;
    runtime.block_on(async move {
        let server = Server::start(node.clone()).await?;
        let addrs: Vec<String> = server.local_addrs().iter().map(|a| a.to_string()).collect();
        let gossip = node.cluster().map(|c| c.gossip_addr().to_string());
        tracing::info!(
            listen = %addrs.join(", "),
            gossip = %gossip.as_deref().unwrap_or("off"),
            lend = %settings.lend,
            budget_bytes = node.engine().stats().budget_bytes,
            policy = %settings.policy,
            poll_us,
            cpus = %settings.cpus.as_ref().map_or("any".to_string(), CpuList::to_string),
            "fallow node ready"
        );
        // Made once, before the loop: a signal that comes while no stream listens is lost.
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let mut hangup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
        loop {
            tokio::select! {
                _ = term.recv() => break tracing::info!("SIGTERM received"),
                _ = int.recv() => break tracing::info!("SIGINT received"),
                _ = hangup.recv() => {
                    let (args, node) = (args.clone(), node.clone());
                    // Reading files and stopping a governor thread block: off the runtime.
                    settings = tokio::task::spawn_blocking(move || {
                        reload(&args, settings, &node)
                    })
                    .await
                    .context("the reload task")?;
                }
            }
        }
        tracing::info!("stopping");
        server.shutdown().await;
        if let Some(dir) = settings.state_dir.clone() {
            let saving = node.clone();
            let saved = tokio::task::spawn_blocking(move || restart::save(&saving, &dir)).await?;
            match saved {
                Ok(r) => tracing::info!(
                    pools = r.pools,
                    clients = r.clients,
                    pages = r.pages,
                    bytes = r.bytes,
                    elapsed_ms = r.elapsed.as_millis() as u64,
                    "wrote the snapshot for the next start"
                ),
                Err(err) => {
                    tracing::error!(%err, "could not write the snapshot: the next start is empty")
                }
            }
        }
        Ok(())
    })
}

/// Starts journaling persistent pages into `dir` and restores what the last run left
/// there: the snapshot of a clean stop if there is one (its journal then dropped), else
/// the state file and the journal of a crash (`fallow_node::recovery`). A damaged snapshot
/// or state file is logged, set aside and undone; the journal is the fallback for a damaged
/// snapshot.
fn warm_start(dir: &std::path::Path, engine: &Engine) -> anyhow::Result<Option<restart::Restored>> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the state directory {}", dir.display()))?;
    let journal = journal::recover(dir)
        .with_context(|| format!("reading the journal in {}", dir.display()))?;
    engine
        .start_journal(&journal::journal_dir(dir))
        .with_context(|| format!("starting the journal in {}", dir.display()))?;
    if let Some(r) = snapshot(dir, engine) {
        if let Some(journal) = journal {
            journal.discard().context("removing the journal the snapshot supersedes")?;
        }
        tracing::info!(
            pools = r.report.pools,
            clients = r.report.clients,
            pages = r.report.pages,
            elapsed_ms = r.report.elapsed.as_millis() as u64,
            "restored the snapshot of the last clean stop (warm restart)"
        );
        return Ok(Some(r));
    }
    match recovery::recover(dir, engine, journal) {
        Ok(Some(r)) => {
            tracing::info!(
                pools = r.report.pools,
                clients = r.report.clients,
                pages = r.report.pages,
                journal_bytes = r.report.bytes,
                elapsed_ms = r.report.elapsed.as_millis() as u64,
                "restored the state and the journaled persistent pages of the last run"
            );
            Ok(Some(r))
        }
        Ok(None) => Ok(None),
        Err(err) => {
            let path = recovery::state_path(dir);
            let aside = path.with_extension("damaged");
            let _ = std::fs::rename(&path, &aside);
            tracing::error!(%err, kept = %aside.display(), "starting empty");
            Ok(None)
        }
    }
}

/// The snapshot in `dir` restored into `engine`; a damaged one is logged, set aside and
/// undone.
fn snapshot(dir: &std::path::Path, engine: &Engine) -> Option<restart::Restored> {
    match restart::restore(dir, engine) {
        Ok(restored) => restored,
        Err(err) => {
            let path = restart::snapshot_path(dir);
            let aside = path.with_extension("damaged");
            let _ = std::fs::rename(&path, &aside);
            tracing::error!(%err, kept = %aside.display(), "the snapshot is set aside");
            None
        }
    }
}

/// SIGHUP: reads the config file again (the flags still win over it), applies what can
/// change while the node runs (`lend`, `reserve`, `log`), and logs the other settings
/// that changed, which wait for a restart. A file that does not load, or settings that do
/// not hold, change nothing. Returns the settings now in force.
fn reload(args: &NodeArgs, mut running: Settings, node: &Node) -> Settings {
    let Some(path) = &args.config else {
        tracing::info!("SIGHUP: no --config file to reload");
        return running;
    };
    tracing::info!(path = %path.display(), "SIGHUP: reloading the config file");
    let new = match settings(args.clone()) {
        Ok(new) => new,
        Err(err) => {
            tracing::error!(error = %format!("{err:#}"), "reload failed; the running settings stay");
            node.metrics().reloaded(false);
            return running;
        }
    };
    let mut applied = Vec::new();
    if new.lend != running.lend {
        if let Err(err) = node.relend(&new.lend) {
            tracing::error!(%err, "reload failed; the running settings stay");
            node.metrics().reloaded(false);
            return running;
        }
        applied.push(format!("lend {} (was {})", new.lend, running.lend));
        running.lend = new.lend.clone();
    }
    if new.log != running.log {
        logging::reload_filter(new.log.as_deref().unwrap_or("info"), &mut applied);
        running.log = new.log.clone();
    }
    let waiting: Vec<String> =
        restart_only_changes(&running, &new).into_iter().map(String::from).collect();
    logging::report_reload("node", &applied, &waiting);
    node.metrics().reloaded(true);
    running
}

/// The settings that differ between `running` and `new` and cannot change while the node
/// runs: its sockets, secret, engine, runtime and cluster are made once, at start.
fn restart_only_changes(running: &Settings, new: &Settings) -> Vec<&'static str> {
    let (a, b) = (&running.config, &new.config);
    [
        ("listen", a.listen != b.listen),
        ("secret_file", a.secret != b.secret),
        ("metrics", a.metrics != b.metrics),
        ("node_tls", running.tls_dir != new.tls_dir),
        ("policy", running.policy != new.policy),
        ("client_lease_secs", a.client_lease != b.client_lease),
        ("max_connections", a.max_connections != b.max_connections),
        ("write_timeout_secs", a.write_timeout != b.write_timeout),
        ("join/gossip/advertise", a.cluster != b.cluster),
        ("forward_timeout_ms", a.forward_timeout != b.forward_timeout),
        ("summary_*", a.summary != b.summary),
        ("poll_us", a.read_polling != b.read_polling),
        ("cpus", running.cpus != new.cpus),
        ("state_dir", running.state_dir != new.state_dir),
    ]
    .into_iter()
    .filter_map(|(name, changed)| changed.then_some(name))
    .collect()
}

/// Waits for SIGTERM or SIGINT.
pub(crate) async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
    Ok(())
}
