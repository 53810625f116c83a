//! The cluster client's handle: connecting through the seeds, the background refresh,
//! creating and destroying pools on every node, and what it knows of each node.
//!
//! # Locking
//! Lock order: `admin` → `fence` → `view` → `summary`. `fence` (a tokio `RwLock`) is held
//! shared by writes to private persistent pools (put, take, invalidations) for their
//! whole request, and exclusively by the repair while it copies one group of pages, so
//! a page is never re-created from a copy that a write is changing (`repair.rs`).
//! `admin` is a tokio mutex held across `.await` by pool creation and destruction and by
//! the refresh, so that they never interleave (a pool created on a node twice, or a node
//! adopted with a pool list that changed meanwhile). `view` (a `parking_lot::RwLock`) and `summary` (a
//! `parking_lot::Mutex`) are held only to route or record one batch, never across
//! `.await`; page requests never take `admin`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use fallow_core::{PoolId, PoolKind, PoolSpec, Sharing, StoreError};
use fallow_proto::fallow::{MemberState, Status};
use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::dedup::{DedupCounters, DedupStats};
use super::summary::{Slot, Summary, SummaryStats};
use super::view::{LogicalPool, NodeLink, View};
use super::{ClusterClientConfig, ClusterError};
use crate::session::Numbering;
use crate::ClientError;

/// A client of a whole cluster: pages spread over the live nodes by weighted rendezvous
/// hashing, a summary of where this client put each page, and node failures turned into
/// misses. Cheap to clone (clones share everything); every method takes `&self`.
/// `docs/cluster.md` ("Placement and failure") has the full behaviour.
#[derive(Clone)]
pub struct ClusterClient {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for ClusterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterClient").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

/// Everything the handles and the refresh task share.
pub(crate) struct Inner {
    pub config: ClusterClientConfig,
    /// Serialises pool creation and destruction with the refresh (see the module doc).
    pub admin: tokio::sync::Mutex<()>,
    /// Nodes and pools.
    pub view: RwLock<View>,
    /// Where this client's pages are.
    pub summary: Mutex<Summary>,
    /// Wakes the refresh early (a request failed).
    pub wake: Arc<Notify>,
    /// Stops the refresh when the last handle goes.
    pub stop: CancellationToken,
    /// The next pool id this client hands out; ids are never reused.
    pub next_pool: AtomicU32,
    /// Pools on node incarnations that were retired though they may still run (a
    /// partition): destroyed if the same node id is reached again, forgotten after
    /// [`ORPHANS_KEPT`] (by then the node's client lease has destroyed them).
    pub orphans: Mutex<HashMap<u128, (Instant, Vec<PoolId>)>>,
    /// The sessions of retired nodes' connections, by member id, kept as long as
    /// [`Inner::orphans`]: adopted again, a node is reached in the same session, so the
    /// requests given up on before it was retired are fenced there (docs/protocol.md §3.4)
    /// and cannot land after the ones sent once it is back.
    pub retired_sessions: Mutex<HashMap<String, (Instant, Arc<Numbering>)>>,
    /// Writes to private persistent pools (shared) against the repair (exclusive).
    pub fence: tokio::sync::RwLock<()>,
    /// Wakes the repair (a node was retired).
    pub repair_wake: Arc<Notify>,
    /// Wakes puts waiting for another put of the same persistent page to end.
    pub put_ended: Notify,
    /// Persistent pages whose lost copy was re-created, since the client started.
    pub repaired: AtomicU64,
    /// The last repair pass that re-created copies: how many, and how long it took.
    pub last_repair: Mutex<Option<(u64, Duration)>>,
    /// What dedup across nodes did (`dedup.rs`).
    pub dedup: DedupCounters,
}

/// How long pools of a retired node incarnation are remembered: twice the nodes'
/// default client lease.
pub(crate) const ORPHANS_KEPT: Duration = Duration::from_secs(600);

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// What a cluster client knows of one node.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterNode {
    /// The member's name (its protocol address), or the seed as given.
    pub id: String,
    /// Alive, suspect, or down for this client.
    pub state: NodeState,
    /// Its placement weight (free lent memory plus an eighth of the lent memory, rounded).
    pub weight: f64,
    /// Lendable and free bytes as gossiped; `None` for a node outside a cluster.
    pub capacity: Option<(u64, u64)>,
    /// Pages this client put there (entries of its summary; a persistent page counts on
    /// both of its nodes).
    pub pages: u64,
}

/// The state of a cluster client's persistent pages ([`ClusterClient::replication`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplicationStats {
    /// Persistent pages this client holds (each with two copies unless at risk or lost).
    pub pages: u64,
    /// Pages with one readable copy: their other node died, restarted or cannot be
    /// reached, and the repair has not re-created the copy yet (or cannot: no other live
    /// node).
    pub at_risk: u64,
    /// Pages whose two nodes are both gone: reads of them fail.
    pub lost: u64,
    /// Copies re-created by the repair since the client started.
    pub re_replicated: u64,
    /// The last repair pass that re-created copies: how many, and how long the pass took
    /// (from finding the pages at risk to the last one recorded).
    pub last_repair: Option<(u64, Duration)>,
}

/// A node's state as a cluster client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    /// Alive: receives new pages.
    Alive,
    /// Suspected by membership: its pages are read, new pages go elsewhere.
    Suspect,
    /// A request to it failed: skipped (its pages are misses) until it answers a ping.
    Down,
}

/// Whether `err` means the node could not be reached (or is not the node it was), as
/// opposed to a refusal of this one request.
pub(crate) fn unreachable(err: &ClientError) -> bool {
    err.is_connection_error()
        || matches!(err, ClientError::NodeRestarted { .. } | ClientError::Protocol(_))
}

impl ClusterClient {
    /// Learns the members from the first seed that answers, connects to each live one and
    /// starts the background refresh. Fails when no seed answers (a wrong address or
    /// secret is reported here) or no member can be reached. Must be called within a
    /// tokio runtime.
    pub async fn connect(config: ClusterClientConfig) -> Result<ClusterClient, ClusterError> {
        let inner = Arc::new(Inner {
            config,
            admin: tokio::sync::Mutex::new(()),
            view: RwLock::new(View::default()),
            summary: Mutex::new(Summary::default()),
            wake: Arc::new(Notify::new()),
            stop: CancellationToken::new(),
            next_pool: AtomicU32::new(0),
            orphans: Mutex::new(HashMap::new()),
            retired_sessions: Mutex::new(HashMap::new()),
            fence: tokio::sync::RwLock::new(()),
            repair_wake: Arc::new(Notify::new()),
            put_ended: Notify::new(),
            repaired: AtomicU64::new(0),
            last_repair: Mutex::new(None),
            dedup: DedupCounters::default(),
        });
        {
            let _admin = inner.admin.lock().await;
            let members = inner.fetch_members().await.map_err(ClusterError::NoNodeReachable)?;
            let failed = inner.reconcile(members).await;
            if inner.view.read().nodes.is_empty() {
                let err = failed.unwrap_or(ClientError::Disconnected);
                return Err(ClusterError::NoNodeReachable(err));
            }
        }
        let weak = Arc::downgrade(&inner);
        tokio::spawn(refresh_loop(weak.clone(), inner.wake.clone(), inner.stop.clone()));
        tokio::spawn(super::dedup::dedup_loop(weak.clone(), inner.stop.clone()));
        tokio::spawn(super::repair::repair_loop(
            weak,
            inner.repair_wake.clone(),
            inner.stop.clone(),
        ));
        Ok(ClusterClient { inner })
    }

    /// The configuration.
    pub fn config(&self) -> &ClusterClientConfig {
        &self.inner.config
    }

    /// What dedup across nodes did: pages sent as hashes, bytes saved, summaries fetched.
    pub fn dedup(&self) -> DedupStats {
        self.inner.dedup.stats()
    }

    /// Fetches every usable node's content summary now instead of at the next round
    /// (`ClusterClientConfig::dedup_refresh`).
    pub async fn refresh_summaries(&self) {
        self.inner.fetch_summaries().await;
    }

    /// Asks the members again now (the refresh also runs every
    /// [`ClusterClientConfig::refresh_interval`] and after a failure).
    pub async fn refresh(&self) {
        self.inner.refresh().await;
    }

    /// The nodes this client uses, by name.
    pub fn nodes(&self) -> Vec<ClusterNode> {
        let view = self.inner.view.read();
        let summary = self.inner.summary.lock();
        let mut nodes: Vec<ClusterNode> = view
            .nodes
            .iter()
            .map(|n| ClusterNode {
                id: n.link.id.clone(),
                state: match n.state {
                    _ if n.link.is_down() => NodeState::Down,
                    MemberState::Alive => NodeState::Alive,
                    MemberState::Suspect | MemberState::Dead => NodeState::Suspect,
                },
                weight: n.weight(),
                capacity: n.capacity,
                pages: summary.pages_on(n.link.slot),
            })
            .collect();
        nodes.sort_by(|a, b| a.id.cmp(&b.id));
        nodes
    }

    /// The size of the summary of placed pages.
    pub fn summary(&self) -> SummaryStats {
        self.inner.summary.lock().stats()
    }

    /// Persistent pages: how many, how many have one copy left, and how many copies the
    /// repair re-created. A full pass over the summary's persistent entries.
    pub fn replication(&self) -> ReplicationStats {
        let down = self.inner.down_slots(Duration::ZERO);
        let summary = self.inner.summary.lock();
        let risk = summary.at_risk(&down);
        ReplicationStats {
            pages: summary.stats().persistent,
            at_risk: risk.pages.len() as u64,
            lost: risk.lost,
            re_replicated: self.inner.repaired.load(Ordering::Relaxed),
            last_repair: *self.inner.last_repair.lock(),
        }
    }

    /// Creates a pool on every usable node (and, later, on nodes that join), or attaches
    /// to a shared pool there: the same UUID names it on every node. A private persistent
    /// pool keeps two copies of each page on two nodes (`docs/cluster.md`); a shared
    /// persistent pool is refused unless the cluster has exactly one node
    /// ([`ClusterError::PersistentNeedsOneNode`]).
    /// A node that cannot be reached gets the pool when it answers again; a node that
    /// refuses (a shared pool with other options, too many pools) fails the creation.
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, ClusterError> {
        let inner = &*self.inner;
        let _admin = inner.admin.lock().await;
        let (links, home) = {
            let view = inner.view.read();
            if let Some((id, pool)) = view.pools.iter().find(|(_, p)| {
                matches!(spec.sharing, Sharing::Shared { .. }) && p.spec.sharing == spec.sharing
            }) {
                return match pool.spec == *spec {
                    true => Ok(*id),
                    false => Err(mismatch(spec)),
                };
            }
            let live: Vec<_> = view.nodes.iter().filter(|n| n.state != MemberState::Dead).collect();
            match (spec.kind, spec.sharing) {
                (PoolKind::Persistent, Sharing::Shared { .. }) => match live.as_slice() {
                    [only] => (vec![only.link.clone()], Some(only.link.slot)),
                    _ => {
                        return Err(ClusterError::PersistentNeedsOneNode { nodes: live.len() });
                    }
                },
                _ => (
                    view.nodes.iter().filter(|n| n.usable()).map(|n| n.link.clone()).collect(),
                    None,
                ),
            }
        };
        let created =
            futures::future::join_all(links.iter().map(|l| l.client.create_pool(spec))).await;
        let mut on = HashMap::new();
        let mut refused = None;
        for (link, result) in links.iter().zip(created) {
            match result {
                Ok(id) => {
                    on.insert(link.slot, id);
                }
                Err(err) if unreachable(&err) && home.is_none() => inner.absorb(link, &err),
                Err(err) => refused = refused.or(Some(err)),
            }
        }
        if let Some(err) = refused {
            let undo =
                links.iter().filter_map(|l| on.get(&l.slot).map(|id| l.client.destroy_pool(*id)));
            futures::future::join_all(undo).await;
            return Err(match err {
                ClientError::Refused { status: Status::SharedPoolMismatch, .. } => mismatch(spec),
                other => ClusterError::Node(other),
            });
        }
        let seed = match spec.sharing {
            Sharing::Shared { uuid } => xxhash_rust::xxh3::xxh3_64(&uuid.to_le_bytes()),
            Sharing::Private => rand::random(),
        };
        let id = PoolId(inner.next_pool.fetch_add(1, Ordering::Relaxed));
        inner.view.write().pools.insert(id, LogicalPool { spec: *spec, seed, home, on });
        Ok(id)
    }

    /// Destroys (detaches from) a pool on every node. A node that cannot be reached now
    /// is told when it answers again (or its client lease expires and it destroys the pool
    /// itself). Errors only for a persistent pool whose node fails.
    pub async fn destroy_pool(&self, pool: PoolId) -> Result<(), ClusterError> {
        let inner = &*self.inner;
        let _admin = inner.admin.lock().await;
        let (logical, targets) = {
            let mut view = inner.view.write();
            let logical = view.pools.remove(&pool).ok_or(StoreError::UnknownPool(pool))?;
            let targets: Vec<(Arc<NodeLink>, PoolId)> = logical
                .on
                .iter()
                .filter_map(|(slot, id)| view.node(*slot).map(|n| (n.link.clone(), *id)))
                .collect();
            (logical, targets)
        };
        inner.summary.lock().forget_pool(pool);
        let strict = logical.home.is_some();
        let destroys = targets.iter().map(|(link, id)| async move {
            if link.is_down() && !strict {
                link.orphans.lock().push(*id);
                return Ok(());
            }
            link.client.destroy_pool(*id).await
        });
        let results = futures::future::join_all(destroys).await;
        for ((link, id), result) in targets.iter().zip(results) {
            match result {
                Ok(()) => {}
                Err(err) if strict => return Err(err.into()),
                Err(err) => {
                    if unreachable(&err) {
                        link.orphans.lock().push(*id);
                    }
                    inner.absorb(link, &err);
                }
            }
        }
        Ok(())
    }
}

/// The error for a shared pool whose UUID this client or a node knows with other options.
fn mismatch(spec: &PoolSpec) -> ClusterError {
    let uuid = match spec.sharing {
        Sharing::Shared { uuid } => uuid,
        Sharing::Private => 0,
    };
    ClusterError::Store(StoreError::SharedPoolMismatch { uuid })
}

impl Inner {
    /// The nodes this client found unreachable at least `for_at_least` ago.
    pub(crate) fn down_slots(&self, for_at_least: Duration) -> Vec<Slot> {
        let view = self.view.read();
        let down =
            view.nodes.iter().filter(|n| n.link.down_for().is_some_and(|d| d >= for_at_least));
        down.map(|n| n.link.slot).collect()
    }

    /// A request to `link` failed: an unreachable node is skipped from now on (and the
    /// refresh woken to ask membership and ping it); a node that lost one of this
    /// client's pools gets it again at the next refresh; any other refusal is a miss.
    pub(crate) fn absorb(&self, link: &NodeLink, err: &ClientError) {
        if unreachable(err) {
            if link.mark_down() {
                tracing::warn!(
                    node = %link.id, %err,
                    "node unreachable: its pages are misses until it answers again"
                );
                // Its persistent copies are re-created if it stays down.
                self.repair_wake.notify_one();
            }
            self.wake.notify_one();
        } else if let ClientError::UnknownPool(lost) = err {
            tracing::warn!(node = %link.id, pool = lost.0, "the node lost a pool; creating it again");
            let mut view = self.view.write();
            for pool in view.pools.values_mut() {
                if pool.on.get(&link.slot) == Some(lost) {
                    pool.on.remove(&link.slot);
                }
            }
            self.wake.notify_one();
        } else {
            tracing::debug!(node = %link.id, %err, "request refused; its pages count as misses");
        }
    }
}

/// Refreshes every `refresh_interval`, or at once when woken, until the client is dropped.
async fn refresh_loop(inner: Weak<Inner>, wake: Arc<Notify>, stop: CancellationToken) {
    let Some(every) = inner.upgrade().map(|i| i.config.refresh_interval) else { return };
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
            _ = wake.notified() => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        inner.refresh().await;
        drop(inner);
        // A burst of failures wakes the refresh once per burst, not once per request.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
