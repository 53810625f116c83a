//! What a cluster client knows of the cluster: its nodes, each with a [`Client`], and its
//! pools, each a pool on every node.
//!
//! A node is one node id under a member's name: a restart that keeps the node id (from
//! its `--state-dir`) keeps its pools, pool ids and persistent pages, so it keeps its
//! slot and only its generation changes; a restart with a new node id is a new node,
//! with a new slot, because its pools and pool ids are gone. A node is *usable*
//! (gets go to it) unless membership says it is dead or this client found it unreachable
//! ("down", until it answers a ping); it is *placeable* (new puts go to it) when it is
//! also alive rather than suspect and has weight.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fallow_core::content::ContentFilter;
use fallow_core::{PoolId, PoolKind, PoolSpec, Sharing};
use fallow_proto::fallow::MemberState;
use parking_lot::Mutex;

use super::placement::{self, Candidate};
use super::summary::Slot;
use crate::Client;

/// One node incarnation, as a request needs it. Shared by the view and requests in
/// flight.
pub(crate) struct NodeLink {
    /// Its slot (summary and placement).
    pub slot: Slot,
    /// The member's name (its protocol address), or the seed as given.
    pub id: String,
    /// Requests to it.
    pub client: Client,
    /// The node id its HELLO gave.
    pub node_id: u128,
    /// Set when a request failed to reach it; cleared when it answers a ping.
    down: AtomicBool,
    /// Since when it is down (the repair treats a node down for long as lost).
    down_since: Mutex<Option<Instant>>,
    /// Its pools that were destroyed while it was down: destroyed there once it is back.
    /// A `parking_lot` mutex held for a push or a take.
    pub orphans: Mutex<Vec<PoolId>>,
    /// Its content summary as last fetched (`dedup.rs`); empty until then.
    pub content: Mutex<Arc<ContentFilter>>,
}

impl NodeLink {
    pub(crate) fn new(slot: Slot, id: String, client: Client, node_id: u128) -> NodeLink {
        NodeLink {
            slot,
            id,
            client,
            node_id,
            down: AtomicBool::new(false),
            down_since: Mutex::new(None),
            orphans: Mutex::new(Vec::new()),
            content: Mutex::new(Arc::new(ContentFilter::empty())),
        }
    }

    /// Whether a request failed to reach it since it last answered.
    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// Marks it unreachable; true if it was reachable until now.
    pub(crate) fn mark_down(&self) -> bool {
        let first = !self.down.swap(true, Ordering::AcqRel);
        if first {
            *self.down_since.lock() = Some(Instant::now());
        }
        first
    }

    /// How long it has been down, if it is.
    pub(crate) fn down_for(&self) -> Option<Duration> {
        match self.is_down() {
            true => self.down_since.lock().map(|t| t.elapsed()),
            false => None,
        }
    }

    /// Marks it reachable again.
    pub(crate) fn mark_up(&self) {
        *self.down_since.lock() = None;
        self.down.store(false, Ordering::Release);
    }
}

/// A node in the view, with what membership says of it.
pub(crate) struct NodeEntry {
    pub link: Arc<NodeLink>,
    /// The member's generation (0 for a seed outside any cluster): the latest this client
    /// has seen of the node id its link holds.
    pub generation: u64,
    /// [`placement::node_seed`] of its name.
    pub seed: u64,
    pub state: MemberState,
    /// Lendable and free bytes, as gossiped (`None` outside a cluster).
    pub capacity: Option<(u64, u64)>,
}

impl NodeEntry {
    /// Gets may go to it.
    pub(crate) fn usable(&self) -> bool {
        self.state != MemberState::Dead && !self.link.is_down()
    }

    /// Its placement weight: from its capacity, or 1 outside a cluster.
    pub(crate) fn weight(&self) -> f64 {
        self.capacity.map_or(1.0, |(lendable, free)| placement::weight(lendable, free))
    }

    /// New puts may go to it.
    pub(crate) fn placeable(&self) -> bool {
        self.state == MemberState::Alive && !self.link.is_down() && self.weight() > 0.0
    }
}

/// How a pool's pages are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Private and ephemeral: placed by rendezvous hashing, found through the summary.
    Private,
    /// Shared and ephemeral: placed and found by rendezvous hashing alone (other clients
    /// put pages too); a put invalidates the key on every other node.
    Shared,
    /// Private and persistent: two copies, on the key's two best nodes by rendezvous
    /// hashing, both recorded in the summary; a lost copy is re-created elsewhere.
    Replicated,
    /// Shared and persistent: lives on the cluster's one node, which every request goes
    /// to; its failures are errors.
    Persistent,
}

/// One pool of the cluster client: a pool on each node.
pub(crate) struct LogicalPool {
    pub spec: PoolSpec,
    /// Placement seed: random for a private pool, from the UUID for a shared one.
    pub seed: u64,
    /// A shared persistent pool's one node.
    pub home: Option<Slot>,
    /// Slot → the pool's id on that node.
    pub on: HashMap<Slot, PoolId>,
}

impl LogicalPool {
    pub(crate) fn kind(&self) -> Kind {
        match (self.spec.kind, self.spec.sharing) {
            (PoolKind::Persistent, Sharing::Private) => Kind::Replicated,
            (PoolKind::Persistent, Sharing::Shared { .. }) => Kind::Persistent,
            (PoolKind::Ephemeral, Sharing::Private) => Kind::Private,
            (PoolKind::Ephemeral, Sharing::Shared { .. }) => Kind::Shared,
        }
    }
}

/// Nodes and pools. Behind the cluster client's `RwLock`: read by every request (held
/// for routing only, never across `.await`), written by the refresh and by pool creation
/// and destruction.
#[derive(Default)]
pub(crate) struct View {
    pub nodes: Vec<NodeEntry>,
    pub pools: HashMap<PoolId, LogicalPool>,
}

impl View {
    pub(crate) fn node(&self, slot: Slot) -> Option<&NodeEntry> {
        self.nodes.iter().find(|n| n.link.slot == slot)
    }

    /// The nodes a new page of `pool` may go to.
    pub(crate) fn candidates(&self, pool: &LogicalPool) -> Vec<Candidate> {
        self.nodes
            .iter()
            .filter(|n| n.placeable() && pool.on.contains_key(&n.link.slot))
            .map(|n| Candidate { slot: n.link.slot, seed: n.seed, weight: n.weight() })
            .collect()
    }

    /// The usable nodes that hold `pool`, with its id there.
    pub(crate) fn holders(&self, pool: &LogicalPool) -> Vec<(Arc<NodeLink>, PoolId)> {
        self.nodes
            .iter()
            .filter(|n| n.usable())
            .filter_map(|n| pool.on.get(&n.link.slot).map(|id| (n.link.clone(), *id)))
            .collect()
    }

    /// `slot`'s link and the pool's id there, if the node is usable and holds the pool.
    pub(crate) fn route(&self, pool: &LogicalPool, slot: Slot) -> Option<(Arc<NodeLink>, PoolId)> {
        let node = self.node(slot).filter(|n| n.usable())?;
        Some((node.link.clone(), *pool.on.get(&slot)?))
    }

    /// `slot`'s link and the pool's id there, usable or not: for the copies of a
    /// persistent page, which a node listed dead or down may still serve.
    pub(crate) fn route_any(
        &self,
        pool: &LogicalPool,
        slot: Slot,
    ) -> Option<(Arc<NodeLink>, PoolId)> {
        let node = self.node(slot)?;
        Some((node.link.clone(), *pool.on.get(&slot)?))
    }

    /// True if `slot` is in the view and usable.
    pub(crate) fn usable(&self, slot: Slot) -> bool {
        self.node(slot).is_some_and(NodeEntry::usable)
    }
}
