//! The state one node shares between all its connections: the engine, the clients and
//! their pools, the secret, the metrics, the lending governor, the cluster membership and
//! the forwarder of cluster pools.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use fallow_cluster::Cluster;
use fallow_pool::Engine;

use crate::clients::Clients;
use crate::config::NodeConfig;
use crate::fence::Sessions;
use crate::forward::Forwarder;
use crate::lending::{Governor, GovernorError, GovernorHandle, GovernorStatus, LendMode};
use crate::metrics::Metrics;
use crate::summary::Summaries;

/// One node's shared state.
#[derive(Debug)]
pub struct Node {
    engine: Arc<Engine>,
    config: NodeConfig,
    node_id: u128,
    clients: Clients,
    metrics: Metrics,
    /// The lending governor: replaced whole when a reload changes how much to lend.
    lending: parking_lot::Mutex<Option<GovernorHandle>>,
    /// Set once by `Server::start` when the node gossips: membership needs the bound
    /// addresses, which exist only after the listeners are.
    cluster: OnceLock<Cluster>,
    /// Cluster pools and the cluster client that serves them (`forward.rs`).
    forwarder: Forwarder,
    /// The content summary for clients that dedup across nodes (`summary.rs`).
    summaries: Summaries,
    /// Every client's session, for fencing (`fence.rs`).
    sessions: Sessions,
    started: Instant,
    /// `--state-dir`, where the state file is kept (`recovery.rs`); the mutex makes its
    /// rewrites one at a time, so the last one written is the newest state.
    state_dir: Option<(std::path::PathBuf, parking_lot::Mutex<()>)>,
}

impl Node {
    /// A node serving `engine` with `config`. `lending` is the governor that sized the
    /// budget (fixed or following the host); the node keeps it running while it lives.
    pub fn new(engine: Arc<Engine>, config: NodeConfig, lending: Option<GovernorHandle>) -> Self {
        Self::restored(engine, config, lending, rand::random(), Clients::default())
    }

    /// [`Node::new`] under a given id and with given clients: a node restarted from a
    /// snapshot keeps its id and its clients' pools, so that its clients see the same
    /// node with the same pools (`restart.rs`).
    pub fn restored(
        engine: Arc<Engine>,
        config: NodeConfig,
        lending: Option<GovernorHandle>,
        node_id: u128,
        clients: Clients,
    ) -> Self {
        let summaries = Summaries::new(config.summary);
        Self {
            engine,
            config,
            node_id,
            clients,
            metrics: Metrics::new(),
            lending: parking_lot::Mutex::new(lending),
            cluster: OnceLock::new(),
            forwarder: Forwarder::default(),
            summaries,
            sessions: Sessions::default(),
            started: Instant::now(),
            state_dir: None,
        }
    }

    /// Keeps the node's state file in `dir` (`--state-dir`), rewritten whenever its pools
    /// or clients change ([`Node::save_state`]); written once now.
    pub fn keep_state_in(mut self, dir: std::path::PathBuf) -> Self {
        self.state_dir = Some((dir, parking_lot::Mutex::new(())));
        self.save_state();
        self
    }

    /// Rewrites the state file (node id, pools, clients), if the node keeps one: called
    /// after each pool creation, destruction and lease expiry, before the reply. A failure
    /// is logged: the node goes on, but a crash would bring back an older set of pools.
    pub fn save_state(&self) {
        let Some((dir, lock)) = &self.state_dir else { return };
        let _one_at_a_time = lock.lock();
        if let Err(err) = crate::recovery::save_state(self, dir) {
            tracing::error!(
                dir = %dir.display(),
                %err,
                "could not write the node's state file: after a crash it would come back \
                 with an older set of pools"
            );
        }
    }

    /// The page pool.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The settings.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// This node's random id, chosen at start.
    pub fn node_id(&self) -> u128 {
        self.node_id
    }

    /// The clients and their pools.
    pub fn clients(&self) -> &Clients {
        &self.clients
    }

    /// Every client's session (`fence.rs`).
    pub(crate) fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The lending governor's state, if the node has one.
    pub fn lending_status(&self) -> Option<GovernorStatus> {
        self.lending.lock().as_ref().map(|l| l.status())
    }

    /// Lends as `mode` says from now on (a config reload): the running governor stops
    /// (after at most its tick), and one for `mode` starts, which applies a fixed size at
    /// once and takes its first sample of the host before this returns. `mode` is checked
    /// before anything stops, so a bad one leaves the running governor as it was.
    pub fn relend(&self, mode: &LendMode) -> Result<(), GovernorError> {
        if let LendMode::Auto(config) = mode {
            config.validate()?;
        }
        let mut lending = self.lending.lock();
        if let Some(mut running) = lending.take() {
            running.stop();
        }
        *lending = Some(Governor::start(self.engine.clone(), mode)?);
        Ok(())
    }

    /// The cluster member, when the node gossips.
    pub fn cluster(&self) -> Option<&Cluster> {
        self.cluster.get()
    }

    /// Records the cluster member (once; a second call is ignored).
    pub(crate) fn set_cluster(&self, cluster: Cluster) {
        let _ = self.cluster.set(cluster);
    }

    /// The forwarder of cluster pools.
    pub(crate) fn forwarder(&self) -> &Forwarder {
        &self.forwarder
    }

    /// Cluster pools this node serves for its clients (peer forwarding).
    pub fn cluster_pool_count(&self) -> usize {
        self.forwarder.pool_count()
    }

    /// The content summaries served to clients (CONTENT_SUMMARY).
    pub(crate) fn summaries(&self) -> &Summaries {
        &self.summaries
    }

    /// Seconds since the node started.
    pub fn uptime_secs(&self) -> u64 {
        self.started.elapsed().as_secs()
    }
}
