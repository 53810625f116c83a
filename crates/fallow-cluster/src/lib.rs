//! Membership of a fallow cluster: which nodes lend memory, where clients reach them, how
//! much each lends and has free, and which are alive. Every node runs one [`Cluster`]
//! member; the node answers clients' MEMBERS requests from it, and placement (issue #5)
//! will weigh nodes by the free memory it reports. `docs/cluster.md` has the timings, the
//! measurements and the security model.
//!
//! # Why chitchat
//! Gossip comes from a maintained crate, not a protocol of our own. Of the two candidates,
//! chitchat (Quickwit's: scuttlebutt anti-entropy, a phi-accrual failure detector, tokio,
//! UDP) fits better than foca (SWIM, sans-io):
//! * each member's state is a versioned key-value map that every member converges on,
//!   newcomers included: capacity is just two keys. foca spreads custom data as
//!   fire-and-forget broadcasts, so a late joiner would learn capacities only from their
//!   next re-broadcast, and we would write the dissemination ourselves;
//! * a member id is `(name, generation, gossip address)`: a restarted node (a larger
//!   generation) is told apart from its old self by design;
//! * it runs its own tokio task and timers; foca would need a runtime loop of ours.
//!
//! The costs: no `Suspect` state (derived here from silence, see [`MemberState`]), heavier
//! traffic than SWIM's probes (every member exchanges digests with up to three others per
//! round), and no authentication (added here, see below). We pin 0.11: from 0.12 on,
//! chitchat no longer exposes its message encoding, which a transport of our own needs.
//!
//! # Security
//! Every gossip datagram is sealed with XChaCha20-Poly1305 under a key derived from the
//! cluster secret (`transport`): a host without the secret learns nothing from the
//! datagrams and cannot join or inject state, and replays are refused; such datagrams are
//! dropped and counted.
//!
//! # Components
//! [`ClusterConfig`]: identity, addresses, seeds and timings, validated by its builder.
//! [`Cluster`]: the running member: `members()`, `subscribe()`, `update_capacity()`,
//! `leave()`. [`Member`], [`MemberState`], [`MemberEvent`]: what it reports.
//! [`GossipTraffic`]: datagrams and bytes, for metrics.

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

mod cluster;
mod config;
mod member;
mod transport;

pub use cluster::Cluster;
pub use config::{
    ClusterConfig, ClusterConfigBuilder, DEFAULT_GOSSIP_INTERVAL, DEFAULT_PHI_THRESHOLD,
    MIN_SECRET_LEN,
};
pub use member::{Member, MemberEvent, MemberState};
pub use transport::{GossipTraffic, MAX_AGE, NONCE_LEN, SEAL_OVERHEAD, TAG_LEN};

/// Why a member could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A setting is out of range; the message says which and why.
    #[error("cluster settings: {0}")]
    InvalidConfig(String),
    /// The gossip address could not be bound (in use, not an address of this host).
    #[error("cannot gossip on {addr}/udp: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// chitchat refused to start.
    #[error("gossip did not start: {0}")]
    Start(String),
}
