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
//! [`cache`]: the cache layer of one export. [`NbdMetrics`]: Prometheus metrics.

pub mod cache;
pub mod export;
pub mod handshake;
pub mod metrics;
pub mod server;
pub mod transmission;
pub mod validate;

pub use export::Export;
pub use metrics::NbdMetrics;
pub use server::NbdServer;
