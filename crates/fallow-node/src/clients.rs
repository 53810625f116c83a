//! Who may reach which pool. A client is known by the 128-bit id it presents in HELLO;
//! every connection with that id reaches the same pools: the private pools it created and
//! the shared pools whose UUID it presented. Pools belong to the client, not to a
//! connection, so a reconnect finds them again; they are destroyed when the client
//! destroys them or when its lease runs out (no connection for `client_lease`). A
//! client's cluster pools (peer forwarding, `forward.rs`) are kept apart from its engine
//! pools, so the reachability check of an ordinary request does not change.
//!
//! # Locking
//! `Clients::table` (a `parking_lot::Mutex`) guards the id → client map and each client's
//! connection count; it is held for map updates only, never across `.await` or an engine
//! call. `Client::pools` (an `RwLock`) guards one client's pools: read-locked for the
//! reachability check of every request, write-locked to create or destroy;
//! `Client::cluster_pools` likewise for cluster pools, never held with `pools`.
//! `Clients::released` (a `Mutex`) is taken alone. Order: `table` → `Client::pools` →
//! the engine's locks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fallow_core::{PageStore, PoolId, PoolSpec, Sharing, StoreError};
use fallow_pool::Engine;
use parking_lot::{Mutex, RwLock};

use crate::forward::is_cluster_pool;

/// One client: its pools.
#[derive(Debug, Default)]
pub struct Client {
    /// Pool id → the spec it was created or attached with.
    pools: RwLock<HashMap<PoolId, PoolSpec>>,
    /// Cluster pool id (`forward.rs`) → its spec. Apart from `pools`, so the ordinary
    /// request path never looks at it.
    cluster_pools: RwLock<HashMap<PoolId, PoolSpec>>,
}

/// Why a pool operation of a client failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolError {
    /// From the engine.
    Store(StoreError),
    /// The client holds its maximum number of pools.
    TooMany(usize),
}

impl Client {
    /// True when this client may use `pool`.
    pub fn can_reach(&self, pool: PoolId) -> bool {
        self.pools.read().contains_key(&pool)
    }

    /// How many pools the client holds, cluster pools included.
    pub fn pool_count(&self) -> usize {
        self.pools.read().len() + self.cluster_pools.read().len()
    }

    /// True when this client may use cluster pool `pool`.
    pub fn can_reach_cluster_pool(&self, pool: PoolId) -> bool {
        self.cluster_pools.read().contains_key(&pool)
    }

    /// The cluster pool this client already holds under a shared spec's UUID: its id when
    /// `spec` is the same, a mismatch when not. `None` for a private spec or a UUID the
    /// client does not hold.
    pub(crate) fn held_cluster_pool(&self, spec: &PoolSpec) -> Option<Result<PoolId, StoreError>> {
        let Sharing::Shared { uuid } = spec.sharing else { return None };
        let pools = self.cluster_pools.read();
        let (id, held) = pools.iter().find(|(_, held)| held.sharing == spec.sharing)?;
        Some(if held == spec { Ok(*id) } else { Err(StoreError::SharedPoolMismatch { uuid }) })
    }

    /// Records a cluster pool the forwarder created or attached for this client. False when
    /// the client already held it (two attaches of one shared pool raced).
    pub(crate) fn add_cluster_pool(&self, pool: PoolId, spec: &PoolSpec) -> bool {
        debug_assert!(is_cluster_pool(pool), "{pool} is not a cluster pool id");
        self.cluster_pools.write().insert(pool, *spec).is_none()
    }

    /// Forgets one of the client's cluster pools; false when it held no such pool.
    pub(crate) fn remove_cluster_pool(&self, pool: PoolId) -> bool {
        self.cluster_pools.write().remove(&pool).is_some()
    }

    /// The pools this client can reach, in id order.
    pub fn pools(&self) -> Vec<PoolId> {
        let mut pools: Vec<PoolId> = self.pools.read().keys().copied().collect();
        pools.sort();
        pools
    }

    /// Creates a private pool, or attaches to a shared one. Presenting the UUID of a shared
    /// pool the client already holds returns the same id without attaching twice.
    pub fn create_pool(
        &self,
        engine: &Engine,
        spec: &PoolSpec,
        max_pools: usize,
    ) -> Result<PoolId, PoolError> {
        let mut pools = self.pools.write();
        if let Sharing::Shared { uuid } = spec.sharing {
            let held = pools.iter().find(|(_, held)| held.sharing == spec.sharing);
            if let Some((id, held)) = held {
                return if held == spec {
                    Ok(*id)
                } else {
                    Err(PoolError::Store(StoreError::SharedPoolMismatch { uuid }))
                };
            }
        }
        if pools.len() >= max_pools {
            return Err(PoolError::TooMany(max_pools));
        }
        let id = engine.create_pool(spec).map_err(PoolError::Store)?;
        if is_cluster_pool(id) {
            // Ids with the top bit name cluster pools; an engine that handed out 2^31
            // ids has none left that cannot be mistaken for one.
            let _ = engine.destroy_pool(id);
            return Err(PoolError::Store(StoreError::TooManyPools));
        }
        pools.insert(id, *spec);
        Ok(id)
    }

    /// Destroys (or detaches from) one of the client's pools.
    pub fn destroy_pool(&self, engine: &Engine, pool: PoolId) -> Result<(), StoreError> {
        let mut pools = self.pools.write();
        if pools.remove(&pool).is_none() {
            return Err(StoreError::UnknownPool(pool));
        }
        engine.destroy_pool(pool)
    }

    /// Destroys every engine pool of the client (its lease ran out) and hands back its
    /// cluster pools, which the forwarder releases (that takes requests to other nodes).
    fn release_all(&self, engine: &Engine) -> (usize, Vec<PoolId>) {
        let pools: Vec<PoolId> = self.pools.write().drain().map(|(id, _)| id).collect();
        for pool in &pools {
            if let Err(err) = engine.destroy_pool(*pool) {
                tracing::warn!(%pool, %err, "destroying an expired client's pool failed");
            }
        }
        let cluster: Vec<PoolId> = self.cluster_pools.write().drain().map(|(id, _)| id).collect();
        (pools.len() + cluster.len(), cluster)
    }
}

#[derive(Debug)]
struct Entry {
    client: Arc<Client>,
    connections: usize,
    /// When the last connection closed (None while one is open).
    idle_since: Option<Instant>,
}

/// Every client the node knows.
#[derive(Debug, Default)]
pub struct Clients {
    table: Mutex<HashMap<u128, Entry>>,
    /// Cluster pools of expired clients, waiting for the forwarder to release them.
    released: Mutex<Vec<PoolId>>,
}

impl Clients {
    /// Every client with its engine pools (not its cluster pools, which live on other
    /// nodes), for a restart's snapshot.
    pub fn for_restart(&self) -> Vec<(u128, Vec<(PoolId, PoolSpec)>)> {
        let table = self.table.lock();
        let mut clients: Vec<_> = table
            .iter()
            .map(|(id, e)| {
                let mut pools: Vec<_> =
                    e.client.pools.read().iter().map(|(p, s)| (*p, *s)).collect();
                pools.sort_by_key(|(p, _)| *p);
                (*id, pools)
            })
            .collect();
        clients.sort_by_key(|(id, _)| *id);
        clients
    }

    /// Knows client `id` again, with its pools (restored in the engine already), as a
    /// restarted node does: idle from now, so its lease runs from the restart.
    pub fn restore(&self, id: u128, pools: impl IntoIterator<Item = (PoolId, PoolSpec)>) {
        let client = Client::default();
        client.pools.write().extend(pools);
        let entry =
            Entry { client: Arc::new(client), connections: 0, idle_since: Some(Instant::now()) };
        self.table.lock().insert(id, entry);
    }

    /// Registers a new connection of client `id`, returning the client.
    pub fn connect(&self, id: u128) -> Arc<Client> {
        let mut table = self.table.lock();
        let entry = table.entry(id).or_insert_with(|| Entry {
            client: Arc::new(Client::default()),
            connections: 0,
            idle_since: None,
        });
        entry.connections += 1;
        entry.idle_since = None;
        entry.client.clone()
    }

    /// Records that a connection of client `id` closed.
    pub fn disconnect(&self, id: u128) {
        let mut table = self.table.lock();
        if let Some(entry) = table.get_mut(&id) {
            entry.connections = entry.connections.saturating_sub(1);
            if entry.connections == 0 {
                entry.idle_since = Some(Instant::now());
            }
        }
    }

    /// Clients known (connected, or idle within their lease).
    pub fn len(&self) -> usize {
        self.table.lock().len()
    }

    /// True when no client is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pools held by all clients.
    pub fn pool_count(&self) -> usize {
        self.table.lock().values().map(|e| e.client.pool_count()).sum()
    }

    /// Destroys the pools of clients idle for longer than `lease`; returns how many
    /// clients expired.
    pub fn expire(&self, engine: &Engine, lease: Duration) -> usize {
        let expired: Vec<(u128, Arc<Client>)> = {
            let mut table = self.table.lock();
            let ids: Vec<u128> = table
                .iter()
                .filter(|(_, e)| e.idle_since.is_some_and(|t| t.elapsed() >= lease))
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter().filter_map(|id| table.remove(&id).map(|e| (id, e.client))).collect()
        };
        for (id, client) in &expired {
            let (pools, cluster) = client.release_all(engine);
            self.released.lock().extend(cluster);
            tracing::info!(client = %format_args!("{id:032x}"), pools, "client lease expired");
        }
        expired.len()
    }

    /// The cluster pools of clients whose lease expired since the last call: each lost
    /// one user.
    pub(crate) fn take_released_cluster_pools(&self) -> Vec<PoolId> {
        std::mem::take(&mut *self.released.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fallow_pool::EngineBuilder;

    fn engine() -> Engine {
        Engine::new(EngineBuilder::new(8 << 20).compress_interval(None).build().unwrap())
    }

    #[test]
    fn private_pools_are_reachable_only_by_their_client() {
        let engine = engine();
        let clients = Clients::default();
        let a = clients.connect(1);
        let b = clients.connect(2);
        let pool = a.create_pool(&engine, &PoolSpec::ephemeral(), 8).unwrap();
        assert!(a.can_reach(pool));
        assert!(!b.can_reach(pool));
        assert_eq!(b.destroy_pool(&engine, pool), Err(StoreError::UnknownPool(pool)));
        let again = clients.connect(1);
        assert!(again.can_reach(pool), "a second connection of the same client");
    }

    #[test]
    fn shared_pools_attach_once_per_client_and_check_options() {
        let engine = engine();
        let clients = Clients::default();
        let spec = PoolSpec::ephemeral().shared(42);
        let a = clients.connect(1);
        let b = clients.connect(2);
        let pa = a.create_pool(&engine, &spec, 8).unwrap();
        assert_eq!(a.create_pool(&engine, &spec, 8).unwrap(), pa);
        assert_eq!(b.create_pool(&engine, &spec, 8).unwrap(), pa);
        let other = PoolSpec::persistent().shared(42);
        assert_eq!(
            b.create_pool(&engine, &other, 8),
            Err(PoolError::Store(StoreError::SharedPoolMismatch { uuid: 42 }))
        );
        a.destroy_pool(&engine, pa).unwrap();
        assert!(engine.pool_stats(pa).is_ok(), "b is still attached");
        b.destroy_pool(&engine, pa).unwrap();
        assert!(engine.pool_stats(pa).is_err());
    }

    #[test]
    fn pool_limit_per_client() {
        let engine = engine();
        let a = Clients::default().connect(1);
        a.create_pool(&engine, &PoolSpec::ephemeral(), 1).unwrap();
        assert_eq!(a.create_pool(&engine, &PoolSpec::ephemeral(), 1), Err(PoolError::TooMany(1)));
    }

    #[test]
    fn cluster_pools_are_kept_apart_and_released_with_the_lease() {
        let engine = engine();
        let clients = Clients::default();
        let a = clients.connect(1);
        let cluster = PoolId(crate::forward::CLUSTER_POOL_BIT | 4);
        let spec = PoolSpec::ephemeral().shared(9);
        assert!(a.add_cluster_pool(cluster, &spec));
        assert!(!a.add_cluster_pool(cluster, &spec), "held already");
        assert!(a.can_reach_cluster_pool(cluster) && !a.can_reach(cluster));
        assert_eq!(a.held_cluster_pool(&spec), Some(Ok(cluster)));
        let other = PoolSpec::persistent().shared(9);
        assert_eq!(
            a.held_cluster_pool(&other),
            Some(Err(StoreError::SharedPoolMismatch { uuid: 9 }))
        );
        assert_eq!(a.held_cluster_pool(&PoolSpec::ephemeral()), None, "private: always new");
        let own = a.create_pool(&engine, &PoolSpec::ephemeral(), 8).unwrap();
        assert_eq!((a.pool_count(), a.pools()), (2, vec![own]));
        clients.disconnect(1);
        assert_eq!(clients.expire(&engine, Duration::ZERO), 1);
        assert_eq!(clients.take_released_cluster_pools(), vec![cluster]);
        assert!(clients.take_released_cluster_pools().is_empty());
        assert!(engine.pool_stats(own).is_err());
    }

    #[test]
    fn leases_expire_only_without_connections() {
        let engine = engine();
        let clients = Clients::default();
        let a = clients.connect(1);
        let pool = a.create_pool(&engine, &PoolSpec::persistent(), 8).unwrap();
        assert_eq!(clients.expire(&engine, Duration::ZERO), 0, "still connected");
        clients.disconnect(1);
        assert_eq!(clients.expire(&engine, Duration::from_secs(3600)), 0, "within the lease");
        assert_eq!(clients.expire(&engine, Duration::ZERO), 1);
        assert!(engine.pool_stats(pool).is_err(), "its pools are gone");
        assert!(clients.is_empty());
    }
}
