//! Client library for fallow nodes: the pool protocol (`docs/protocol.md`) over TCP or a
//! Unix socket, async on tokio with a blocking wrapper that implements the same
//! [`fallow_core::PageStore`] trait as the in-process engine, so a caller can swap one for
//! the other.
//!
//! ```no_run
//! # async fn demo() -> Result<(), fallow_client::ClientError> {
//! use bytes::Bytes;
//! use fallow_client::{Client, ClientConfig};
//! use fallow_core::{PageKey, PoolSpec, PAGE_SIZE};
//!
//! let secret = std::fs::read("/etc/fallow/secret").unwrap();
//! let client = Client::connect(ClientConfig::new("127.0.0.1:7400", secret)?).await?;
//! let pool = client.create_pool(&PoolSpec::ephemeral()).await?;
//! let key = PageKey::new(pool, 1, 0);
//! client.put(key, Bytes::from(vec![7u8; PAGE_SIZE])).await?;
//! let page: Option<Bytes> = client.get(key).await?; // a miss is Ok(None)
//! # Ok(()) }
//! ```
//!
//! # Components
//! [`ClientConfig`]: where, with which secret, how many connections, which timeouts.
//! [`Client`]: the async client (cheap to clone; methods take `&self`, so many requests can
//! be in flight at once). `conn`: one connection (handshake, pipelining, replies matched by
//! id). [`BlockingClient`]: the [`fallow_core::PageStore`] for synchronous callers.
//! [`ClientError`]: every way a request can fail. [`ClusterClient`] (`cluster/`): many
//! nodes as one pool: placement by weighted rendezvous hashing, a summary of where each
//! page went, node failures turned into misses.

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

mod blocking;
mod client;
mod cluster;
mod config;
mod conn;
mod dedup;
mod error;
mod session;
mod stats;

pub use blocking::BlockingClient;
pub use client::Client;
pub use cluster::{
    ClusterClient, ClusterClientConfig, ClusterError, ClusterNode, DedupStats, NodeState,
    ReplicationStats, SummaryStats,
};
pub use config::{ClientConfig, Endpoint, NodeRestart};
pub use dedup::MAX_SUMMARY_BYTES;
pub use error::ClientError;
pub use fallow_proto::fallow::{MemberInfo, MemberState};
pub use stats::NodeStats;
