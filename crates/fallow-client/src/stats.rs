//! A node's STATS reply, with lookups by name.

use fallow_core::PoolId;
use fallow_proto::fallow::StatEntry;

/// Named counters from a node (names in `docs/protocol.md`, "STATS").
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Every entry, in the node's order.
    pub entries: Vec<StatEntry>,
}

impl NodeStats {
    /// The value of a node-wide counter.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.entries.iter().find(|e| e.name == name).map(|e| e.value)
    }

    /// The value of a counter of one pool.
    pub fn pool(&self, pool: PoolId, name: &str) -> Option<u64> {
        self.get(&format!("pool.{}.{name}", pool.0))
    }

    /// The pools the reply describes (those this client can reach), in id order.
    pub fn pools(&self) -> Vec<PoolId> {
        let mut pools: Vec<PoolId> = self
            .entries
            .iter()
            .filter_map(|e| e.name.strip_prefix("pool.")?.split_once('.')?.0.parse().ok())
            .map(PoolId)
            .collect();
        pools.sort();
        pools.dedup();
        pools
    }
}
