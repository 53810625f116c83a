//! Harnesses that fallow's tests and benchmarks share. Nothing here ships in the `fallow`
//! binary; the crate is a dev-dependency, plus the `fallow-guest` command that the
//! benchmark scripts drive.
//!
//! # Components
//!
//! [`process`]: child processes killed by their PID when dropped, daemons whose log is
//! searched for their address, scratch directories, free ports, bounded polling.
//! [`guest`]: real virtual machines: guest images built from Debian packages into a cache
//! outside the repository, booted under QEMU with NBD or vhost-user disks, a script run
//! in them, its results read from the serial console, every guest bounded in time.
//! [`ceph`]: a throwaway one-node Ceph cluster. [`qsd`]: qemu-storage-daemon exporting an
//! image over vhost-user-blk and NBD, the reference backend of `fallow bench blk`. [`tls`]:
//! throwaway certificates and pre-shared keys, made with `openssl`, for the TLS tests. Behind
//! features, for the crates whose tests need them: `node` (a real node on a thread of its
//! own), `backing` (the model every backing store is checked against), `pool` (page
//! contents and the benches' settings), `crash` ([`crash`]: a recording store and the
//! crash states built from its log).

#[cfg(feature = "backing")]
pub mod backing_model;
pub mod ceph;
#[cfg(feature = "crash")]
pub mod crash;
pub mod guest;
#[cfg(feature = "node")]
pub mod node;
#[cfg(feature = "pool")]
pub mod pages;
pub mod process;
pub mod qsd;
pub mod tls;
