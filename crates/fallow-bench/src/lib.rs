//! Workloads behind `fallow bench` and `fallow trace`: what a benchmark feeds the page pool.
//!
//! # Components
//!
//! [`trace`]: a streaming reader of third-party block and page traces (VMware vscsi, ARC
//! `.lis`, LIRS, Tencent CBS, MSR Cambridge, SYSTOR'17), optionally compressed, that yields
//! one [`trace::PageAccess`] per 4 KiB page touched.
//!
//! [`replay`]: those accesses through a real `fallow_pool::Engine` (one shard, an
//! ephemeral pool of N pages), counting hits and misses.
//!
//! [`blk`]: a small virtio-blk driver of our own (a vhost-user frontend: memfd memory,
//! split virtqueues, kicks and calls) and the load loop behind `fallow bench blk`, for
//! vhost-user-blk backends, NBD exports and the driver's own floor.
//!
//! [`delay_proxy`]: a TCP proxy that adds a fixed latency in each direction, the netem
//! stand-in of the fault tests (`fallow bench delay-proxy`).

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

pub mod blk;
pub mod delay_proxy;
pub mod pages;
pub mod replay;
pub mod trace;
