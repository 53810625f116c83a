//! Binding the listeners, accepting connections, expiring idle clients, joining the
//! cluster, and stopping cleanly.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fallow_net::{spawn_accept_loop, Listener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::connection;
use crate::membership;
use crate::metrics;
use crate::node::Node;
use fallow_core::ListenAddr;

/// How long a stopping node waits for its connections to finish their replies.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// A running node: its listeners, connections and background tasks.
#[derive(Debug)]
pub struct Server {
    node: Arc<Node>,
    bound: Vec<ListenAddr>,
    metrics: Option<SocketAddr>,
    unix_paths: Vec<PathBuf>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl Server {
    /// Binds every listener of the node's config (and the metrics endpoint), then serves in
    /// the background on the current tokio runtime. Fails if any address cannot be bound.
    pub async fn start(node: Arc<Node>) -> io::Result<Server> {
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        let mut bound = Vec::new();
        let mut unix_paths = Vec::new();
        for listener in Listener::bind_all(&node.config().listen).await? {
            let local = listener.local_addr()?;
            match &local {
                // Tests and scripts read the port chosen for port 0 from this line.
                ListenAddr::Tcp(addr) => tracing::info!(%addr, "listening on TCP"),
                ListenAddr::Unix(path) => {
                    tracing::info!(path = %path.display(), "listening on a Unix socket");
                    unix_paths.push(path.clone());
                }
            }
            bound.push(local);
            let (node, stop) = (node.clone(), shutdown.clone());
            let polling = node.config().read_polling;
            spawn_accept_loop(
                listener,
                polling,
                shutdown.clone(),
                tasks.clone(),
                move |stream, peer| {
                    (!over_limit(&node, &peer))
                        .then(|| connection::serve(node.clone(), stream, peer, stop.clone()))
                },
            );
        }
        let metrics = match node.config().metrics {
            Some(addr) => {
                Some(metrics::serve(node.clone(), addr, shutdown.clone()).await.map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot serve metrics on {addr}: {e}"))
                })?)
            }
            None => None,
        };
        tasks.spawn(expire_clients(node.clone(), shutdown.clone()));
        membership::start(&node, &node.config().listen, &bound, shutdown.clone(), &tasks).await?;
        Ok(Server { node, bound, metrics, unix_paths, shutdown, tasks })
    }

    /// The addresses actually bound (with the ports the OS chose for port 0).
    pub fn local_addrs(&self) -> &[ListenAddr] {
        &self.bound
    }

    /// The first TCP address bound, if any.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.bound.iter().find_map(|a| match a {
            ListenAddr::Tcp(addr) => Some(*addr),
            ListenAddr::Unix(_) => None,
        })
    }

    /// The metrics endpoint, if one is served.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
    }

    /// The node's shared state.
    pub fn node(&self) -> &Arc<Node> {
        &self.node
    }

    /// Leaves the cluster (the other members list this node dead at once), stops
    /// accepting, closes every connection (each writes the replies it has ready), waits
    /// for them up to a few seconds, and removes the Unix socket files.
    pub async fn shutdown(self) {
        // First, while this node still answers: its cluster pools have pages and pools
        // on the other nodes (and on this one, through its own listener).
        self.node.forwarder().shutdown().await;
        if let Some(cluster) = self.node.cluster() {
            cluster.leave().await;
        }
        self.shutdown.cancel();
        self.tasks.close();
        if tokio::time::timeout(DRAIN_TIMEOUT, self.tasks.wait()).await.is_err() {
            tracing::warn!("connections still open after {DRAIN_TIMEOUT:?}; leaving them");
        }
        for path in &self.unix_paths {
            Listener::remove_socket_file(path);
        }
        tracing::info!("node stopped");
    }
}

/// True (and logged, counted) when the node already serves its maximum of connections.
fn over_limit(node: &Node, peer: &str) -> bool {
    let open = node.metrics().connections.get();
    if open >= node.config().max_connections as i64 {
        tracing::warn!(%peer, open, "connection refused: too many connections");
        node.metrics().reject("too_many_connections");
        return true;
    }
    false
}

/// Destroys the pools of clients whose lease ran out, a few times per lease (their cluster
/// pools through the forwarder).
async fn expire_clients(node: Arc<Node>, shutdown: CancellationToken) {
    let lease = node.config().client_lease;
    let every = (lease / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let expiring = node.clone();
        let _ = tokio::task::spawn_blocking(move || {
            if expiring.clients().expire(expiring.engine(), lease) > 0 {
                expiring.save_state();
            }
        })
        .await;
        let released = node.clients().take_released_cluster_pools();
        node.forwarder().release_expired(released).await;
    }
}
