//! fallow's vhost-user-blk backend: an export served to a QEMU guest on the same host
//! through memory the two share. QEMU hands over the guest's memory table and virtqueues on
//! a Unix socket; from then on the guest's requests and their data never cross a socket:
//! the device reads requests off the rings and copies data straight between the guest's
//! buffers and the export's cache layer, the same one `fallow nbd` serves.
//!
//! # Components
//! [`Device`]: one export's disk, what the guest sees (geometry, features, config space)
//! and its counters. [`Server`]: the export's socket, one QEMU connection after another,
//! each a [`BlkBackend`] session. Inside: `request` checks a descriptor chain, `io` runs a
//! request against the cache, `config` is the configuration space.
//!
//! Built on the rust-vmm crates (`vhost`, `vhost-user-backend`, `virtio-queue`,
//! `vm-memory`), which handle the vhost-user messages, the memory table and the split
//! rings; this crate is the block device. `docs/vhost.md` has the protocol and the
//! threading.

// Descriptor chains come from the guest and are never trusted (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

mod backend;
mod config;
mod io;
mod request;
mod server;

pub use backend::{BlkBackend, BlkStats, Device, Polling};
pub use config::{Geometry, QUEUE_SIZE, SEG_MAX};
pub use server::{ServeError, Server};
