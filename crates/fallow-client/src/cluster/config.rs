//! How a [`crate::ClusterClient`] finds the cluster and how quickly it gives up on a node.

use std::fmt;
use std::time::Duration;

use fallow_core::{PageKey, PoolId, StoreError};

use crate::{ClientConfig, ClientError, Endpoint, NodeRestart};

/// Seeds, secret and timeouts of a cluster client.
#[derive(Clone)]
pub struct ClusterClientConfig {
    /// Nodes to ask for the cluster's members (any one live node is enough). A seed that
    /// does not gossip makes the seeds themselves the cluster, without failure detection
    /// beyond this client's own.
    pub seeds: Vec<Endpoint>,
    /// How every node is reached: the secret, this client's identity on every node (its
    /// private pools there belong to it), its name for the nodes' logs, connections per
    /// node and the timeouts ([`ClusterClientConfig::node`] fills in each node's endpoint
    /// and refuses a restarted node). The request timeout is short: a node that does not
    /// answer in time costs misses, and is skipped until it answers a ping again. The
    /// timeout of slow requests (destroying or invalidating a pool or object walks every
    /// page of it, hundreds of milliseconds for a few hundred thousand pages) must not
    /// read as a dead node, but a pool's destruction holds up the membership refresh while
    /// it waits, so it is seconds, not minutes.
    pub per_node: ClientConfig,
    /// How often the members are asked again (and unreachable nodes pinged). A failed
    /// request also triggers a refresh at once.
    pub refresh_interval: Duration,
    /// How long a node may stay unreachable before the copies of persistent pages it
    /// holds are re-created elsewhere, as for a node membership declared dead.
    pub repair_after: Duration,
    /// How often each node's content summary is fetched, for dedup across nodes (pages
    /// a node already holds are sent as a hash); `None` turns that off. Only pools whose
    /// dedup scope is on use it.
    pub dedup_refresh: Option<Duration>,
}

impl fmt::Debug for ClusterClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `ClientConfig`'s own Debug never prints the secret.
        f.debug_struct("ClusterClientConfig")
            .field("seeds", &self.seeds)
            .field("per_node", &self.per_node)
            .field("refresh_interval", &self.refresh_interval)
            .field("repair_after", &self.repair_after)
            .field("dedup_refresh", &self.dedup_refresh)
            .finish()
    }
}

impl ClusterClientConfig {
    /// A config for the cluster reached through `seeds`: `A,B,C` or `fallow://A,B,C`, each
    /// `HOST:PORT` or `unix:PATH`. Defaults: a random client id, one connection per node,
    /// 250 ms request and connect timeouts (5 s for slow requests), members asked every
    /// 250 ms, copies on a node unreachable for 5 s re-created elsewhere, content
    /// summaries fetched every 10 s.
    pub fn new(seeds: &str, secret: impl Into<Vec<u8>>) -> Result<Self, ClientError> {
        let list = seeds.strip_prefix("fallow://").unwrap_or(seeds);
        let seeds = list.split(',').map(Endpoint::parse).collect::<Result<Vec<_>, _>>()?;
        let mut per_node = ClientConfig::new("127.0.0.1:0", secret)?
            .timeout(Duration::from_millis(250))
            .connect_timeout(Duration::from_millis(250))
            .slow_timeout(Duration::from_secs(5))
            .on_restart(NodeRestart::Refuse);
        if let Some(first) = seeds.first() {
            per_node.endpoint = first.clone();
        }
        Ok(Self {
            seeds,
            per_node,
            refresh_interval: Duration::from_millis(250),
            repair_after: Duration::from_secs(5),
            dedup_refresh: Some(Duration::from_secs(10)),
        })
    }

    /// Sets how long a node may stay unreachable before its persistent copies are
    /// re-created elsewhere.
    pub fn repair_after(mut self, after: Duration) -> Self {
        self.repair_after = after;
        self
    }

    /// Sets how often content summaries are fetched (`None`: never, no dedup across
    /// nodes).
    pub fn dedup_refresh(mut self, every: Option<Duration>) -> Self {
        self.dedup_refresh = every;
        self
    }

    /// Sets how often members are asked again.
    pub fn refresh_interval(mut self, every: Duration) -> Self {
        self.refresh_interval = every;
        self
    }

    /// Changes how every node is reached (connections, timeouts, client id, name):
    /// `config.per_node(|c| c.timeout(Duration::from_secs(1)))`.
    pub fn per_node(mut self, change: impl FnOnce(ClientConfig) -> ClientConfig) -> Self {
        self.per_node = change(self.per_node);
        self
    }

    /// The config of the [`crate::Client`] for one node: it refuses a restarted node, whose
    /// pool ids no longer mean what this client thinks.
    pub(crate) fn node(&self, endpoint: Endpoint) -> ClientConfig {
        ClientConfig { endpoint, on_restart: NodeRestart::Refuse, ..self.per_node.clone() }
    }
}

/// A failed cluster-client operation. For an ephemeral pool a node that fails or cannot
/// be reached is never an error (its pages are misses, puts to it are not stored); these
/// are misuse, refusals, and failures of persistent pools.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// No seed could be reached, or none accepted this client.
    #[error("no seed node answered: {0}")]
    NoNodeReachable(#[source] ClientError),
    /// What any page store may answer: an unknown pool (never created by this client, or
    /// destroyed), a buffer that is not one page per key, a shared pool that exists with
    /// other options (on a node, or in this client).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Shared persistent pools are not replicated (private ones keep two copies): losing
    /// the node would lose pages. They are created only when the cluster has exactly one
    /// node.
    #[error(
        "a shared persistent pool needs a cluster of exactly one node (the cluster has \
         {nodes}); private persistent pools keep two copies on any cluster"
    )]
    PersistentNeedsOneNode {
        /// Live nodes in the cluster.
        nodes: usize,
    },
    /// The node holding a persistent pool died or restarted: the pool and its pages are
    /// gone.
    #[error("the node holding persistent {0} is gone")]
    PoolLost(PoolId),
    /// No copy of a persistent page this client holds could be read: both its nodes are
    /// gone or unreachable.
    #[error("no copy of persistent page {0:?} can be read: both its nodes are gone")]
    CopiesLost(PageKey),
    /// A node refused the request (too many pools, an invalid spec), or a persistent
    /// pool's node failed.
    #[error(transparent)]
    Node(#[from] ClientError),
}

impl From<ClusterError> for StoreError {
    fn from(err: ClusterError) -> StoreError {
        match err {
            ClusterError::Store(err) => err,
            ClusterError::PersistentNeedsOneNode { .. } => {
                StoreError::InvalidSpec("shared persistent pools need a one-node cluster")
            }
            ClusterError::Node(err) => err.into(),
            other @ (ClusterError::NoNodeReachable(_)
            | ClusterError::PoolLost(_)
            | ClusterError::CopiesLost(_)) => StoreError::Unavailable(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_lists_parse() {
        let c = ClusterClientConfig::new("fallow://127.0.0.1:1,127.0.0.1:2,unix:/s", b"x".to_vec())
            .unwrap();
        let want = [
            Endpoint::Tcp("127.0.0.1:1".into()),
            Endpoint::Tcp("127.0.0.1:2".into()),
            Endpoint::Unix("/s".into()),
        ];
        assert_eq!(c.seeds, want);
        assert_eq!(ClusterClientConfig::new("h:1", b"x".to_vec()).unwrap().seeds.len(), 1);
        for bad in ["", "h:1,", "h:1,,h:2", "fallow://"] {
            assert!(ClusterClientConfig::new(bad, b"x".to_vec()).is_err(), "{bad}");
        }
        let node = c.node(want[1].clone());
        assert_eq!(node.on_restart, NodeRestart::Refuse);
        assert!(!format!("{c:?}").contains("secret"));
    }
}
