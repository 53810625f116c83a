//! Peer forwarding: a node that gossips serves *cluster pools*, whose pages it spreads over
//! the whole cluster, so a client that talks to one node (the Python client, a client
//! written from `docs/protocol.md`) uses the memory of every node, as Archipelago's
//! `synapsed` bridged its peers. `docs/cluster.md` ("Peer forwarding") is the user's view.
//!
//! ```text
//!  simple client ── CREATE_POOL, flag 0x04 ──▶ node A ── ClusterClient ──▶ a pool on A, B, C
//!  simple client ── PUT/GET pool 0x8000_0002 ▶ node A ── ClusterClient ──▶ the key's owner(s)
//!                ◀─ the reply one node would give ───┘
//! ```
//!
//! The node embeds one [`ClusterClient`] (`fallow-client`), connected when the first
//! cluster pool is created, through the node's own protocol address (its MEMBERS lists the
//! rest of the cluster, this node included). It authenticates with the node's own secret:
//! the cluster has one shared secret and every holder of it is trusted (`docs/cluster.md`,
//! "Security"), so forwarding gives a client nothing it could not reach itself. Placement,
//! the summary of placed pages, two copies of persistent pages and failure handling are the
//! cluster client's: a dead owner makes the keys of an ephemeral pool misses, never errors.
//!
//! # Pool ids
//! A cluster pool's id has the top bit set ([`CLUSTER_POOL_BIT`]); the engine's ids never
//! do (`Client::create_pool` refuses one that would), so ids stay unique per node and one
//! bit test tells which path a request takes. The ordinary path is unchanged: only
//! requests for which [`is_forwarded`] holds come here.
//!
//! # Concurrency
//! Each forwarded request runs in its own tokio task, so waiting on other nodes never holds
//! up the connection's other requests or other clients. A connection has at most
//! [`MAX_IN_FLIGHT_PER_CONNECTION`] in flight (then it stops reading until one finishes),
//! and the node at most [`MAX_IN_FLIGHT`] (further tasks wait for a permit); every request
//! to another node is bounded by `NodeConfig::forward_timeout` (250 ms by default).
//!
//! # Locking
//! `admin` (a tokio mutex) serialises creating and releasing cluster pools across their
//! requests to the cluster, so an attach never races the destruction of the same shared
//! pool. `table` (a `parking_lot::Mutex`) guards the id map; it is held for one lookup or
//! update, never across `.await`. Order: `admin` → `table`; the cluster client's own locks
//! are taken only by its calls, with `table` released.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use fallow_client::{ClientError, ClusterClient, ClusterClientConfig, ClusterError};
use fallow_core::{
    HashPutOutcome, PageKey, PoolId, PoolSpec, PutOutcome, Sharing, StoreError, PAGE_SIZE,
};
use fallow_proto::fallow::{encode_error, Op, PageRef, Reply, Request, Status};
use parking_lot::Mutex;
use tokio::sync::{OnceCell, Semaphore};

use crate::clients::Client;
use crate::cmd::Failure;
use crate::metrics::PageEvent;
use crate::node::Node;

/// The bit that marks a cluster pool's id.
pub(crate) const CLUSTER_POOL_BIT: u32 = 1 << 31;

/// Forwarded requests one connection may have in flight; beyond that it stops reading.
pub(crate) const MAX_IN_FLIGHT_PER_CONNECTION: usize = 64;

/// Forwarded requests the node runs at once; more wait for a permit.
pub(crate) const MAX_IN_FLIGHT: usize = 1024;

/// How long a stopping node spends destroying its cluster pools on the other nodes (what
/// it does not finish, their client leases do).
const RELEASE_ON_STOP: Duration = Duration::from_secs(2);

/// True for a cluster pool's id.
pub(crate) fn is_cluster_pool(pool: PoolId) -> bool {
    pool.0 & CLUSTER_POOL_BIT != 0
}

/// True when `request` is served by the forwarder: CREATE_POOL with the cluster flag, or
/// any request that names a cluster pool.
pub(crate) fn is_forwarded(request: &Request) -> bool {
    match request {
        Request::CreateClusterPool(_) => true,
        Request::DestroyPool(pool)
        | Request::InvalidatePool(pool)
        | Request::InvalidateObject { pool, .. }
        | Request::InvalidatePages { pool, .. }
        | Request::Put { pool, .. }
        | Request::PutHashes { pool, .. }
        | Request::Get { pool, .. }
        | Request::Take { pool, .. } => is_cluster_pool(*pool),
        _ => false,
    }
}

/// A cluster pool as this node knows it.
#[derive(Debug)]
struct Entry {
    /// Its id in the embedded cluster client.
    remote: PoolId,
    /// As created.
    spec: PoolSpec,
    /// Clients of this node attached to it (1 for a private pool).
    users: usize,
}

#[derive(Debug, Default)]
struct Table {
    pools: HashMap<PoolId, Entry>,
    /// Shared cluster pools by UUID: every client of this node presenting it gets one id.
    by_uuid: HashMap<u128, PoolId>,
    /// The next id, before the top bit is set.
    next: u32,
}

/// The node's forwarder: its cluster pools and the cluster client that serves them.
#[derive(Debug)]
pub struct Forwarder {
    /// Connected on the first cluster pool.
    cluster: OnceCell<ClusterClient>,
    /// Serialises pool creation and release (see the module doc).
    admin: tokio::sync::Mutex<()>,
    /// Cluster pool id → its entry.
    table: Mutex<Table>,
    /// The node-wide bound on forwarded requests running at once.
    permits: Semaphore,
}

impl Default for Forwarder {
    fn default() -> Self {
        Self {
            cluster: OnceCell::new(),
            admin: tokio::sync::Mutex::new(()),
            table: Mutex::new(Table::default()),
            permits: Semaphore::new(MAX_IN_FLIGHT),
        }
    }
}

/// The failure for a cluster pool this client cannot reach: the same as for an engine pool
/// (`cmd::reachable`), so probing ids reveals nothing.
fn unknown(pool: PoolId) -> Failure {
    (Status::UnknownPool, StoreError::UnknownPool(pool).to_string())
}

/// Maps a cluster-client error to the status one node would answer. For ephemeral pools
/// the cluster client has already turned unreachable nodes into misses and `NotStored`,
/// so what is left is a refusal (passed on), misuse, or a persistent pool that lost pages
/// (`INTERNAL`: the node could not do it, a retry may succeed once the repair has run).
fn failure(err: ClusterError, pool: PoolId) -> Failure {
    let message = err.to_string();
    let status = match err {
        ClusterError::Store(StoreError::UnknownPool(_)) => return unknown(pool),
        ClusterError::Store(StoreError::BadLength { .. }) => Status::Malformed,
        ClusterError::PersistentNeedsOneNode { .. } => Status::InvalidSpec,
        ClusterError::Store(StoreError::SharedPoolMismatch { .. }) => Status::SharedPoolMismatch,
        ClusterError::Store(StoreError::InvalidSpec(_)) => Status::InvalidSpec,
        ClusterError::Store(StoreError::TooManyPools) => Status::TooManyPools,
        // A node's refusal (too many pools, an invalid spec) is this node's answer too;
        // a status that closes a connection concerns the node's own connection, not the
        // client's.
        ClusterError::Node(ClientError::Refused { status, .. }) if !status.closes_connection() => {
            status
        }
        ClusterError::Node(_)
        | ClusterError::Store(StoreError::Unavailable(_))
        | ClusterError::NoNodeReachable(_)
        | ClusterError::PoolLost(_)
        | ClusterError::CopiesLost(_) => Status::Internal,
    };
    (status, message)
}

fn keys(remote: PoolId, pages: &[PageRef]) -> Vec<PageKey> {
    pages.iter().map(|p| PageKey::new(remote, p.object, p.index)).collect()
}

impl Forwarder {
    /// Cluster pools this node serves.
    pub fn pool_count(&self) -> usize {
        self.table.lock().pools.len()
    }

    /// The cluster client, connected through this node's own address on first use. A
    /// failed attempt is tried again by the next creation.
    async fn cluster(&self, node: &Node) -> Result<ClusterClient, Failure> {
        let Some(member) = node.cluster() else {
            return Err((
                Status::InvalidSpec,
                "cluster pools (CREATE_POOL flag 0x04) need a node in a cluster; this node \
                 does not gossip (start it with --join or --gossip)"
                    .to_string(),
            ));
        };
        let seed = member.config().protocol_addr.to_string();
        let connect = || async {
            let config = ClusterClientConfig::new(&seed, node.config().secret.clone())
                .map_err(|e| (Status::Internal, format!("forwarding to {seed}: {e}")))?
                .per_node(|c| {
                    c.client_id(rand::random())
                        .timeout(node.config().forward_timeout)
                        .connect_timeout(node.config().forward_timeout)
                        .name("fallow-node forwarder")
                        .connections(2)
                        .tls(node.config().tls.as_ref().map(|tls| tls.client.clone()))
                });
            let cluster = ClusterClient::connect(config).await.map_err(|e| {
                (Status::Internal, format!("cannot reach the cluster to forward: {e}"))
            })?;
            tracing::info!(%seed, nodes = cluster.nodes().len(), "forwarding to the cluster");
            Ok::<_, Failure>(cluster)
        };
        self.cluster.get_or_try_init(connect).await.cloned()
    }

    /// The cluster client and the cluster client's id of `client`'s cluster pool `pool`.
    fn route(&self, client: &Client, pool: PoolId) -> Result<(ClusterClient, PoolId), Failure> {
        if !client.can_reach_cluster_pool(pool) {
            return Err(unknown(pool));
        }
        let remote = self.table.lock().pools.get(&pool).map(|e| e.remote);
        match (self.cluster.get(), remote) {
            (Some(cluster), Some(remote)) => Ok((cluster.clone(), remote)),
            _ => Err(unknown(pool)),
        }
    }

    /// CREATE_POOL with the cluster flag: creates the pool on the cluster (or attaches to
    /// the shared one) and records it as `client`'s.
    async fn create(
        &self,
        node: &Node,
        client: &Client,
        spec: &PoolSpec,
    ) -> Result<Reply, Failure> {
        let _admin = self.admin.lock().await;
        if let Some(held) = client.held_cluster_pool(spec) {
            return held
                .map(Reply::Pool)
                .map_err(|err| (Status::SharedPoolMismatch, err.to_string()));
        }
        let max = node.config().max_pools_per_client;
        if client.pool_count() >= max {
            return Err((
                Status::TooManyPools,
                format!("this client already holds {max} pools, the most a node allows"),
            ));
        }
        let attached = match spec.sharing {
            Sharing::Shared { uuid } => {
                let mut table = self.table.lock();
                match table.by_uuid.get(&uuid).copied() {
                    Some(id) => {
                        let entry = table.pools.get_mut(&id).ok_or_else(|| unknown(id))?;
                        if entry.spec != *spec {
                            let err = StoreError::SharedPoolMismatch { uuid };
                            return Err((Status::SharedPoolMismatch, err.to_string()));
                        }
                        entry.users += 1;
                        Some(id)
                    }
                    None => None,
                }
            }
            Sharing::Private => None,
        };
        let id = match attached {
            Some(id) => id,
            None => {
                if self.table.lock().next >= CLUSTER_POOL_BIT {
                    return Err((Status::TooManyPools, "no cluster pool ids left".to_string()));
                }
                let cluster = self.cluster(node).await?;
                let remote = cluster.create_pool(spec).await.map_err(|e| failure(e, PoolId(0)))?;
                let mut table = self.table.lock();
                let id = PoolId(CLUSTER_POOL_BIT | table.next);
                table.next += 1;
                table.pools.insert(id, Entry { remote, spec: *spec, users: 1 });
                if let Sharing::Shared { uuid } = spec.sharing {
                    table.by_uuid.insert(uuid, id);
                }
                id
            }
        };
        // Under `admin`, and the client held no pool with this UUID, so this is new.
        let added = client.add_cluster_pool(id, spec);
        debug_assert!(added, "{id} recorded twice");
        tracing::debug!(pool = %id, ?spec, "cluster pool created or attached");
        Ok(Reply::Pool(id))
    }

    /// DESTROY_POOL of a cluster pool: detaches `client`.
    async fn destroy(&self, client: &Client, pool: PoolId) -> Result<Reply, Failure> {
        let _admin = self.admin.lock().await;
        if !client.remove_cluster_pool(pool) {
            return Err(unknown(pool));
        }
        self.release(pool).await.map(|()| Reply::Empty)
    }

    /// Drops one user of `pool` (the caller holds `admin`); the last one destroys it on
    /// the cluster.
    async fn release(&self, pool: PoolId) -> Result<(), Failure> {
        let remote = {
            let mut table = self.table.lock();
            let entry = table.pools.get_mut(&pool).ok_or_else(|| unknown(pool))?;
            entry.users -= 1;
            if entry.users > 0 {
                return Ok(());
            }
            let entry = table.pools.remove(&pool).ok_or_else(|| unknown(pool))?;
            if let Sharing::Shared { uuid } = entry.spec.sharing {
                table.by_uuid.remove(&uuid);
            }
            entry.remote
        };
        let Some(cluster) = self.cluster.get() else { return Ok(()) };
        cluster.destroy_pool(remote).await.map_err(|e| failure(e, pool))
    }

    /// Releases the cluster pools of clients whose lease expired (`Clients::expire`).
    pub(crate) async fn release_expired(&self, pools: Vec<PoolId>) {
        if pools.is_empty() {
            return;
        }
        let _admin = self.admin.lock().await;
        for pool in pools {
            if let Err((status, message)) = self.release(pool).await {
                tracing::warn!(%pool, status = status.name(), %message,
                    "releasing an expired client's cluster pool failed");
            }
        }
    }

    /// Destroys every cluster pool on the other nodes (the node stops), for at most
    /// [`RELEASE_ON_STOP`]; what is left goes with the nodes' client leases.
    pub(crate) async fn shutdown(&self) {
        let Some(cluster) = self.cluster.get() else { return };
        let remotes: Vec<PoolId> = {
            let mut table = self.table.lock();
            table.by_uuid.clear();
            table.pools.drain().map(|(_, e)| e.remote).collect()
        };
        let destroys = async {
            for remote in remotes {
                if let Err(err) = cluster.destroy_pool(remote).await {
                    tracing::debug!(%err, "destroying a cluster pool at shutdown failed");
                }
            }
        };
        if tokio::time::timeout(RELEASE_ON_STOP, destroys).await.is_err() {
            tracing::info!("cluster pools left to the other nodes' client leases");
        }
    }

    async fn put(
        &self,
        client: &Client,
        pool: PoolId,
        pages: &[PageRef],
        data: Bytes,
    ) -> Result<Reply, Failure> {
        let (cluster, remote) = self.route(client, pool)?;
        let outcomes =
            cluster.put_many(&keys(remote, pages), data).await.map_err(|e| failure(e, pool))?;
        Ok(Reply::Put(outcomes))
    }

    /// PUT_HASHES on a cluster pool: every key is answered "not held" (and so left empty,
    /// as the protocol says), for the client to send the pages; the embedded cluster
    /// client then dedups them against every node's summary itself.
    async fn put_hashes(
        &self,
        client: &Client,
        pool: PoolId,
        pages: &[PageRef],
    ) -> Result<Reply, Failure> {
        let (cluster, remote) = self.route(client, pool)?;
        cluster.invalidate_pages(&keys(remote, pages)).await.map_err(|e| failure(e, pool))?;
        Ok(Reply::PutHashes(vec![HashPutOutcome::NotHeld; pages.len()]))
    }

    async fn read(
        &self,
        client: &Client,
        op: Op,
        pool: PoolId,
        pages: &[PageRef],
    ) -> Result<Reply, Failure> {
        let (cluster, remote) = self.route(client, pool)?;
        let keys = keys(remote, pages);
        let pages = match op {
            Op::Take => cluster.take_many(&keys).await,
            _ => cluster.get_many(&keys).await,
        }
        .map_err(|e| failure(e, pool))?;
        let hits = pages.iter().filter(|p| p.is_some()).count();
        let mut data = BytesMut::with_capacity(hits * PAGE_SIZE);
        let found = pages
            .iter()
            .map(|page| match page {
                Some(page) => {
                    data.put_slice(page);
                    true
                }
                None => false,
            })
            .collect();
        Ok(Reply::Pages { found, data: data.freeze() })
    }

    async fn invalidate(&self, client: &Client, request: Request) -> Result<Reply, Failure> {
        match request {
            Request::InvalidatePool(pool) => {
                let (cluster, remote) = self.route(client, pool)?;
                let n = cluster.invalidate_pool(remote).await.map_err(|e| failure(e, pool))?;
                Ok(Reply::Count(n))
            }
            Request::InvalidateObject { pool, object } => {
                let (cluster, remote) = self.route(client, pool)?;
                let n = cluster
                    .invalidate_object(remote, object)
                    .await
                    .map_err(|e| failure(e, pool))?;
                Ok(Reply::Count(n))
            }
            Request::InvalidatePages { pool, pages } => {
                let (cluster, remote) = self.route(client, pool)?;
                cluster
                    .invalidate_pages(&keys(remote, &pages))
                    .await
                    .map_err(|e| failure(e, pool))?;
                Ok(Reply::Empty)
            }
            other => Err((Status::Internal, format!("{} is not forwarded", other.op().name()))),
        }
    }
}

/// Serves one forwarded request (one for which [`is_forwarded`] holds) and appends its
/// reply to `out`: the same frame a single node would send. Returns the status sent.
pub(crate) async fn execute(
    node: &Node,
    client: &Client,
    request: Request,
    id: u64,
    out: &mut BytesMut,
) -> Status {
    let op = request.op();
    let forwarder = node.forwarder();
    let metrics = node.metrics();
    // The semaphore is never closed, so this waits for a permit and never fails.
    let _permit = forwarder.permits.acquire().await;
    metrics.forwarded_in_flight.inc();
    let started = Instant::now();
    let result = match request {
        Request::CreateClusterPool(spec) => forwarder.create(node, client, &spec).await,
        Request::DestroyPool(pool) => forwarder.destroy(client, pool).await,
        Request::Put { pool, pages, data } => forwarder.put(client, pool, &pages, data).await,
        Request::PutHashes { pool, pages, .. } => forwarder.put_hashes(client, pool, &pages).await,
        Request::Get { pool, pages } | Request::Take { pool, pages } => {
            forwarder.read(client, op, pool, &pages).await
        }
        other => forwarder.invalidate(client, other).await,
    };
    metrics.forwarded_in_flight.dec();
    let status = match result {
        Ok(reply) => {
            match &reply {
                Reply::Put(outcomes) => {
                    let stored = outcomes.iter().filter(|o| **o == PutOutcome::Stored).count();
                    metrics.forwarded_pages(op, PageEvent::Stored, stored as u64);
                    metrics.forwarded_pages(
                        op,
                        PageEvent::Refused,
                        (outcomes.len() - stored) as u64,
                    );
                }
                Reply::Pages { found, .. } => {
                    let hits = found.iter().filter(|f| **f).count();
                    metrics.forwarded_pages(op, PageEvent::Hit, hits as u64);
                    metrics.forwarded_pages(op, PageEvent::Miss, (found.len() - hits) as u64);
                }
                _ => {}
            }
            reply.encode(op, id, out);
            Status::Ok
        }
        Err((status, message)) => {
            tracing::debug!(op = op.name(), status = status.name(), %message, "forwarding refused");
            encode_error(out, op as u8, id, status, &message);
            status
        }
    };
    metrics.forwarded(op, status, started.elapsed().as_secs_f64());
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cluster_pool_ids_are_forwarded() {
        let page = vec![PageRef { object: 1, index: 2 }];
        let ordinary = PoolId(7);
        let cluster = PoolId(CLUSTER_POOL_BIT | 7);
        assert!(!is_cluster_pool(ordinary) && is_cluster_pool(cluster));
        assert!(is_forwarded(&Request::CreateClusterPool(PoolSpec::ephemeral())));
        assert!(!is_forwarded(&Request::CreatePool(PoolSpec::ephemeral())));
        for pool in [ordinary, cluster] {
            let requests = [
                Request::DestroyPool(pool),
                Request::InvalidatePool(pool),
                Request::InvalidateObject { pool, object: 1 },
                Request::InvalidatePages { pool, pages: page.clone() },
                Request::Get { pool, pages: page.clone() },
                Request::Take { pool, pages: page.clone() },
                Request::Put { pool, pages: page.clone(), data: Bytes::from(vec![0; PAGE_SIZE]) },
                Request::PutHashes { pool, pages: page.clone(), contents: vec![(1, 2)] },
            ];
            for request in requests {
                assert_eq!(is_forwarded(&request), pool == cluster, "{request:?}");
            }
        }
        for request in [Request::Ping, Request::Stats, Request::Members] {
            assert!(!is_forwarded(&request));
        }
    }

    #[test]
    fn cluster_errors_map_to_single_node_statuses() {
        let pool = PoolId(CLUSTER_POOL_BIT | 3);
        let (status, message) =
            failure(ClusterError::Store(StoreError::UnknownPool(PoolId(0))), pool);
        assert_eq!((status, message), unknown(pool), "names the client's id, not the remote one");
        let refused = ClientError::Refused { status: Status::TooManyPools, message: "x".into() };
        assert_eq!(failure(ClusterError::Node(refused), pool).0, Status::TooManyPools);
        let closing = ClientError::Refused { status: Status::AuthFailed, message: "x".into() };
        assert_eq!(failure(ClusterError::Node(closing), pool).0, Status::Internal);
        assert_eq!(
            failure(ClusterError::Node(ClientError::Disconnected), pool).0,
            Status::Internal
        );
        let mismatch = ClusterError::Store(StoreError::SharedPoolMismatch { uuid: 9 });
        assert_eq!(failure(mismatch, pool).0, Status::SharedPoolMismatch);
        let one_node = ClusterError::PersistentNeedsOneNode { nodes: 3 };
        assert_eq!(failure(one_node, pool).0, Status::InvalidSpec);
        let lost = ClusterError::CopiesLost(PageKey::new(PoolId(0), 1, 1));
        assert_eq!(failure(lost, pool).0, Status::Internal);
    }
}
