//! The fallow node: lends this host's idle memory to clients over the pool protocol
//! (`docs/protocol.md`).
//!
//! ```text
//!  listeners (TCP, Unix) ──▶ connection (one task each) ──▶ cmd/<request> ──▶ Engine
//!                                 │  HELLO/AUTH first              ▲
//!                                 └─ slow requests on blocking threads
//!  lending governor (a thread) ── set_budget ──────────────────────┘
//!  /metrics (Prometheus) ◀── Metrics, engine stats at scrape time
//!  cluster member (gossip, UDP) ◀── capacity once a second; MEMBERS reads its list
//! ```
//!
//! # Components
//! [`Server`]: binds the listeners and runs everything below until shut down.
//! `connection`: one client connection, its handshake, pipelining and hostile-input rules.
//! `cmd`: one function per request type. [`clients`]: who may reach which pool.
//! [`metrics`]: Prometheus counters and the `/metrics` endpoint. [`lending`]: how much to
//! lend, following the host's memory pressure. [`config`]: settings and the TOML file.
//! `membership`: joining the cluster (`fallow-cluster`) and publishing capacity.
//! `forward`: peer forwarding, cluster pools served through an embedded cluster client.
//! [`summary`]: the content summary (a Bloom filter) for clients that dedup across nodes.
//! [`restart`]: the snapshot a clean stop writes and the next start loads (warm restart).

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

pub mod clients;
mod cmd;
pub mod config;
mod connection;
mod fence;
mod forward;
pub mod lending;
mod membership;
pub mod metrics;
mod node;
pub mod recovery;
pub mod restart;
mod server;
pub mod summary;

pub use config::{ClusterSettings, ConfigFile, NodeConfig, NodeTls};
pub use fallow_core::ListenAddr;
pub use node::Node;
pub use server::Server;
