//! A client of a whole cluster of nodes: the same [`fallow_core::AsyncPageStore`] as one
//! [`crate::Client`] or the in-process engine, so an NBD export can cache in a cluster
//! unchanged.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use fallow_client::{ClusterClient, ClusterClientConfig};
//! use fallow_core::{PageKey, PoolSpec, PAGE_SIZE};
//!
//! let secret = std::fs::read("/etc/fallow/secret")?;
//! let config = ClusterClientConfig::new("fallow://10.0.0.1:7400,10.0.0.2:7400", secret)?;
//! let cluster = ClusterClient::connect(config).await?;
//! let pool = cluster.create_pool(&PoolSpec::ephemeral()).await?; // on every node
//! let keys = [PageKey::new(pool, 1, 0)];
//! cluster.put_many(&keys, vec![7u8; PAGE_SIZE].into()).await?;
//! let pages = cluster.get_many(&keys).await?; // a miss is None, never an error
//! # Ok(()) }
//! ```
//!
//! # Semantics
//!
//! Ephemeral pools: a dead node costs the misses of its pages and nothing else. Private
//! persistent pools keep two copies of every page on two nodes (a put is stored only when
//! both are), and a background repair re-creates the copies a dead node held; shared
//! persistent pools need a one-node cluster. `docs/cluster.md` ("Placement and failure")
//! is the full description.
//!
//! # Components
//! [`ClusterClientConfig`]: seeds, secret, timeouts. [`ClusterClient`]: the handle
//! (`client.rs`: connecting, pools; `pages.rs`: page requests). `placement`: weighted
//! rendezvous hashing. `summary`: where this client put each page. `view`: nodes and
//! pools. `membership`: the refresh that keeps the view true. `repair`: re-creating the
//! copies of persistent pages that a dead node held. `dedup`: nodes' content summaries
//! and pages sent as hashes (dedup across nodes).

mod client;
mod config;
mod dedup;
mod membership;
mod pages;
mod placement;
mod repair;
mod summary;
mod view;

pub use client::{ClusterClient, ClusterNode, NodeState, ReplicationStats};
pub use config::{ClusterClientConfig, ClusterError};
pub use dedup::DedupStats;
pub use summary::SummaryStats;
