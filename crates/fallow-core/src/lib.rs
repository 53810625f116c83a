//! fallow's vocabulary, shared by every other crate: what a page is, how it is named, what
//! kinds of pool exist, and the [`PageStore`] trait that the in-process engine
//! (`fallow-pool`) implements today and the network client will implement next, so that a
//! caller can swap one for the other.
//!
//! This crate does no I/O and has no runtime. The full contract of every operation is in
//! `docs/semantics.md`.
//!
//! # Components
//! [`PageKey`] names a page; [`PoolSpec`] describes a pool to create; [`PageStore`] is the
//! tmem operation set for synchronous callers, [`AsyncPageStore`] the same for async ones
//! (an NBD server over a remote pool); [`StoreError`], [`PutOutcome`] and [`Lookup`] are
//! their results.

pub mod content;
mod key;
mod listen;
mod member;
mod pool;
mod store;
mod store_async;

pub use key::{ObjectId, PageIndex, PageKey, PoolId};
pub use listen::{prepare_unix_socket, ListenAddr};
pub use member::MemberState;
pub use pool::{DedupScope, PoolKind, PoolSpec, Sharing, TrustDomain};
pub use store::{
    check_batch, check_page, HashPutOutcome, Lookup, NotStored, PageStore, PutOutcome, StoreError,
};
pub use store_async::AsyncPageStore;

/// The size of every page in a pool, in bytes. Fixed: the arena, the checksums, the wire
/// protocol and the NBD cache all count in these units.
pub const PAGE_SIZE: usize = 4096;
