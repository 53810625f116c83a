//! The tmem operations for async callers, batched: an NBD server caching in a pool calls
//! these without blocking its runtime, whether the pool is the in-process engine (which
//! answers at once) or nodes across the network (the client library).

use async_trait::async_trait;
use bytes::Bytes;

use crate::{ObjectId, PageKey, PoolId, PoolSpec, PutOutcome, StoreError};

/// The batched tmem operations, async. Same semantics as [`crate::PageStore`]
/// (`docs/semantics.md`); a miss is `None`.
#[async_trait]
pub trait AsyncPageStore: Send + Sync {
    /// Creates a pool, or attaches to the shared pool with the same UUID.
    async fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, StoreError>;

    /// Detaches from a pool.
    async fn destroy_pool(&self, pool: PoolId) -> Result<(), StoreError>;

    /// Puts `keys.len()` pages: the i-th 4096 bytes of `pages` under `keys[i]`.
    async fn put_many(&self, keys: &[PageKey], pages: Bytes)
        -> Result<Vec<PutOutcome>, StoreError>;

    /// Gets pages; they stay. `None` for each miss.
    async fn get_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, StoreError>;

    /// Takes pages: a hit also removes the page. `None` for each miss.
    async fn take_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, StoreError>;

    /// Removes pages, if present.
    async fn invalidate_pages(&self, keys: &[PageKey]) -> Result<(), StoreError>;

    /// Removes every page of one object; returns how many.
    async fn invalidate_object(&self, pool: PoolId, object: ObjectId) -> Result<u64, StoreError>;

    /// Removes every page of a pool; returns how many.
    async fn invalidate_pool(&self, pool: PoolId) -> Result<u64, StoreError>;
}
