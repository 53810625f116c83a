//! The tmem operation set, as a trait, so that callers can swap the in-process engine for a
//! remote pool without changing a line.

use crate::{ObjectId, PageKey, PoolId, PoolSpec, PAGE_SIZE};

/// What can go wrong when using a [`PageStore`]. A miss or a refused put is not an error:
/// see [`Lookup`] and [`PutOutcome`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// No pool has this id (never created, or destroyed).
    #[error("unknown {0}")]
    UnknownPool(PoolId),
    /// A page buffer whose length is not [`PAGE_SIZE`] (or a multiple, for batches).
    #[error("buffer of {got} bytes where {expected} were expected")]
    BadLength {
        /// The length the caller passed.
        got: usize,
        /// The length the operation needs.
        expected: usize,
    },
    /// A shared pool with this UUID exists with another kind or option set.
    #[error("shared pool {uuid:#034x} exists with different options")]
    SharedPoolMismatch {
        /// The UUID presented.
        uuid: u128,
    },
    /// A pool spec that cannot be honoured (for example a quota on an ephemeral pool).
    #[error("invalid pool spec: {0}")]
    InvalidSpec(&'static str),
    /// The store has handed out every pool id it can.
    #[error("no more pool ids")]
    TooManyPools,
    /// The store cannot be reached or failed internally (remote stores; the in-process
    /// engine never returns it).
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// The result of a get or a take.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// The page was found and copied into the caller's buffer.
    Hit,
    /// No page under this key. The caller's buffer is unspecified.
    Miss,
}

impl Lookup {
    /// True for [`Lookup::Hit`].
    pub fn is_hit(self) -> bool {
        self == Lookup::Hit
    }
}

/// The result of a put.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The page is stored (an ephemeral pool may still drop it later).
    Stored,
    /// The page was not stored, and any older page under the same key is gone too, so a
    /// later get can never return stale data.
    NotStored(NotStored),
}

/// The result of storing a page by its content hash instead of its bytes (the node
/// protocol's PUT_HASHES, used for dedup across nodes).
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashPutOutcome {
    /// The store held a live page with this hash and checksum; the key now shares it.
    Stored,
    /// No such content is held (or the pool does not dedup): send the page itself. The
    /// key is left as it was: its older page, if any, stays until the page arrives.
    NotHeld,
    /// Refused, as a put of the page would have been.
    NotStored(NotStored),
}

/// Why a put was not stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotStored {
    /// No frame could be found: the budget is spent and nothing evictable is left.
    Full,
    /// The pool's quota of pages is spent.
    OverQuota,
}

/// The transcendent-memory operations on pools of [`PAGE_SIZE`] pages.
///
/// Every method is safe to call from many threads at once. A get or take that misses
/// returns `Ok(Lookup::Miss)`; errors are for misuse (unknown pool, wrong buffer length)
/// and for stores that can fail (remote ones). The semantics, including what an ephemeral
/// pool may silently do, are in `docs/semantics.md`.
pub trait PageStore: Send + Sync {
    /// Creates a pool, or attaches to the shared pool with the same UUID.
    fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, StoreError>;

    /// Detaches from a pool; its pages are invalidated when its last user detaches.
    fn destroy_pool(&self, pool: PoolId) -> Result<(), StoreError>;

    /// Stores a copy of `page` (exactly [`PAGE_SIZE`] bytes) under `key`, replacing any page
    /// there. When the outcome is [`PutOutcome::NotStored`], the older page is gone too.
    fn put(&self, key: PageKey, page: &[u8]) -> Result<PutOutcome, StoreError>;

    /// Copies the page under `key` into `out` (exactly [`PAGE_SIZE`] bytes); the page stays.
    fn get(&self, key: PageKey, out: &mut [u8]) -> Result<Lookup, StoreError>;

    /// Like [`PageStore::get`], but a hit also removes the page (exclusive caching).
    fn take(&self, key: PageKey, out: &mut [u8]) -> Result<Lookup, StoreError>;

    /// Removes the page under `key`, if any.
    fn invalidate_page(&self, key: PageKey) -> Result<(), StoreError>;

    /// Removes every page of `object` in `pool`; returns how many were removed.
    fn invalidate_object(&self, pool: PoolId, object: ObjectId) -> Result<u64, StoreError>;

    /// Removes every page of `pool`, which stays usable; returns how many were removed.
    fn invalidate_pool(&self, pool: PoolId) -> Result<u64, StoreError>;

    /// Puts `pages.len() / PAGE_SIZE` pages, the i-th under `keys[i]`.
    fn put_many(&self, keys: &[PageKey], pages: &[u8]) -> Result<Vec<PutOutcome>, StoreError> {
        check_batch(keys.len(), pages.len())?;
        keys.iter().zip(pages.chunks_exact(PAGE_SIZE)).map(|(k, p)| self.put(*k, p)).collect()
    }

    /// Gets `keys.len()` pages into consecutive [`PAGE_SIZE`] slices of `out`.
    fn get_many(&self, keys: &[PageKey], out: &mut [u8]) -> Result<Vec<Lookup>, StoreError> {
        check_batch(keys.len(), out.len())?;
        keys.iter().zip(out.chunks_exact_mut(PAGE_SIZE)).map(|(k, o)| self.get(*k, o)).collect()
    }

    /// Takes `keys.len()` pages into consecutive [`PAGE_SIZE`] slices of `out`.
    fn take_many(&self, keys: &[PageKey], out: &mut [u8]) -> Result<Vec<Lookup>, StoreError> {
        check_batch(keys.len(), out.len())?;
        keys.iter().zip(out.chunks_exact_mut(PAGE_SIZE)).map(|(k, o)| self.take(*k, o)).collect()
    }
}

/// Checks that a batch buffer holds exactly one page per key.
pub fn check_batch(keys: usize, bytes: usize) -> Result<(), StoreError> {
    let expected = keys.saturating_mul(PAGE_SIZE);
    if bytes == expected {
        Ok(())
    } else {
        Err(StoreError::BadLength { got: bytes, expected })
    }
}

/// Checks that a buffer holds exactly one page.
pub fn check_page(bytes: usize) -> Result<(), StoreError> {
    check_batch(1, bytes)
}
