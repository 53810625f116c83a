//! fallow's NBD server: block devices whose reads are served from the page pool instead of
//! the slow backing store behind them. Any NBD client works: qemu, qemu-img, nbdcopy,
//! nbdfuse, fio's nbd engine, the kernel's nbd-client.
//!
//! ```text
//!  listener ─▶ handshake (fixed newstyle: GO, INFO, LIST, EXPORT_NAME, structured
//!              replies, base:allocation) ─▶ transmission (requests checked in
//!              validate.rs, run concurrently) ─▶ CacheLayer (local tier → pool →
//!              backing store) ─▶ BackingStore
//! ```
//!
//! # Components
//! [`NbdServer`]: listeners and connections. [`Export`]: a name and its cache.
//! [`handshake`], [`transmission`], [`validate`]: the protocol phases.
//! [`NbdMetrics`]: Prometheus metrics. The cache layer of an export is the
//! `fallow-cache` crate, shared with the other front ends.

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

pub mod export;
pub mod handshake;
pub mod metrics;
pub mod server;
pub mod transmission;
pub mod validate;

pub use export::Export;
pub use handshake::TlsPolicy;
pub use metrics::NbdMetrics;
pub use server::{NbdServer, ServerOptions};
