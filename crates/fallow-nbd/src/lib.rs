//! fallow's NBD server: block devices whose reads are served from the page pool instead of
//! the slow backing store behind them.
//!
//! # Components
//! [`cache`]: the cache layer of one export (local tier, pool, backing store, coherence).

pub mod cache;
