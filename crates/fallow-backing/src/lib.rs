//! The slow storage behind an NBD export, behind one trait: [`BackingStore`].
//!
//! A store is a byte-addressed device of fixed size. Every operation is async so that an
//! object store (Ceph RADOS, 4 MiB objects, requests in flight in parallel) fits beside
//! local files; a store that is synchronous underneath (a file) runs its system calls on
//! tokio's blocking threads.
//!
//! # Semantics every store keeps
//! * `read` returns exactly `len` bytes (holes and never-written ranges read as zeros).
//! * A `write` that returns `Ok` is visible to every later `read`, from any connection.
//!   With `fua`, it is also durable when it returns.
//! * `flush` makes every write that completed before it durable.
//! * `trim` may discard data (later reads return zeros or the old data; fallow's cache
//!   reads zeros after a trim only if the store says `trim_zeroes`); `write_zeroes` makes
//!   the range read as zeros.
//! * Errors are `std::io::Error`s; the NBD server maps their kinds to NBD error codes.
//!
//! # Components
//! [`FileStore`]: a local file or block device. [`MemStore`]: a RAM disk.
//! [`NbdStore`]: an upstream NBD server. [`PoolStore`]: a persistent pool, the only copy.
//! `RadosStore` (cargo feature `rados`): an image striped over 4 MiB Ceph RADOS objects.

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

mod file;
mod mem;
mod nbd;
mod pool;
#[cfg(feature = "rados")]
pub mod rados;
mod write_behind;

use std::fmt;
use std::io;

use async_trait::async_trait;
use bytes::Bytes;

pub use file::FileStore;
pub use mem::MemStore;
pub use nbd::{NbdStore, NbdUri, UpstreamTls};
pub use pool::PoolStore;
#[cfg(feature = "rados")]
pub use rados::{RadosConfig, RadosError, RadosStore};

/// What a store can do; fixed when it is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Writes are refused.
    pub read_only: bool,
    /// `flush` does something (the store has a volatile write cache).
    pub flush: bool,
    /// Writes can be made durable one by one (`fua`).
    pub fua: bool,
    /// `trim` can discard data.
    pub trim: bool,
    /// After a `trim`, the range reads as zeros.
    pub trim_zeroes: bool,
    /// `write_zeroes` is cheaper than writing zeros (it punches or allocates).
    pub fast_zero: bool,
    /// `block_status` tells holes from data.
    pub block_status: bool,
    /// Several connections may use the store at once and see each other's completed
    /// writes, and one `flush` covers writes from all of them.
    pub multi_conn: bool,
}

/// One extent of a block-status answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Bytes covered.
    pub length: u64,
    /// Not allocated in the store.
    pub hole: bool,
    /// Reads as zeros.
    pub zero: bool,
}

/// When a write must be durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Once a later flush completes (an ordinary write).
    AtFlush,
    /// Before the write completes (NBD's FUA flag).
    Immediate,
}

/// What making a range read as zeros may do with its storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zeroing {
    /// The range may be deallocated (punched) as long as it reads as zeros.
    MayDeallocate,
    /// The range stays allocated (NBD's `NO_HOLE` flag): zeros are written.
    KeepAllocated,
}

/// A byte-addressed device of fixed size: the slow storage an export caches.
#[async_trait]
pub trait BackingStore: Send + Sync + fmt::Debug {
    /// The size in bytes.
    fn size(&self) -> u64;

    /// What the store can do.
    fn capabilities(&self) -> Capabilities;

    /// The alignment writes, trims and zeroes must keep (offset and length both), a power
    /// of two up to 4096: 1 for stores that take any byte range; an upstream NBD export's
    /// advertised minimum. Exports advertise it to their clients and refuse misaligned
    /// writes with `EINVAL`.
    fn min_block_size(&self) -> u32 {
        1
    }

    /// The I/O size the store prefers: smaller requests cost it a read-modify-write (a
    /// file: 4 KiB; an object store that writes byte ranges in place, as RADOS does: 4 KiB
    /// too, not its object size).
    fn preferred_block_size(&self) -> u32 {
        4096
    }

    /// Reads `len` bytes at `offset` (within the size).
    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes>;

    /// Writes `data` at `offset`, durable as `durability` says.
    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> io::Result<()>;

    /// Makes every completed write durable.
    async fn flush(&self) -> io::Result<()>;

    /// Discards a range (a hint: it may keep the data).
    async fn trim(&self, offset: u64, len: u32) -> io::Result<()>;

    /// Makes a range read as zeros, deallocating it only if `zeroing` allows.
    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()>;

    /// Which parts of a range are holes or zeros, as consecutive extents covering at least
    /// the first byte of the range and at most the whole range.
    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        let _ = (offset, len);
        Err(io::Error::new(io::ErrorKind::Unsupported, "block status is not supported"))
    }
}

/// Checks that `offset..offset+len` lies within `size`.
pub fn check_range(offset: u64, len: u64, size: u64) -> io::Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("range {offset}+{len} is beyond the end of the store ({size} bytes)"),
        )),
    }
}
