//! The engine as an [`AsyncPageStore`]: every call completes at once (the engine never
//! waits on I/O; its locks are held for microseconds), so an async caller can use the
//! in-process pool and a remote one through the same trait.

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use fallow_core::{
    AsyncPageStore, Lookup, ObjectId, PageKey, PageStore, PoolId, PoolSpec, PutOutcome, StoreError,
    PAGE_SIZE,
};

use crate::Engine;

/// Copies hits into one buffer and hands out a slice per hit.
fn split(lookups: Vec<Lookup>, buf: BytesMut) -> Vec<Option<Bytes>> {
    let buf = buf.freeze();
    lookups
        .into_iter()
        .enumerate()
        .map(|(i, l)| l.is_hit().then(|| buf.slice(i * PAGE_SIZE..(i + 1) * PAGE_SIZE)))
        .collect()
}

#[async_trait]
impl AsyncPageStore for Engine {
    async fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, StoreError> {
        PageStore::create_pool(self, spec)
    }

    async fn destroy_pool(&self, pool: PoolId) -> Result<(), StoreError> {
        PageStore::destroy_pool(self, pool)
    }

    async fn put_many(
        &self,
        keys: &[PageKey],
        pages: Bytes,
    ) -> Result<Vec<PutOutcome>, StoreError> {
        PageStore::put_many(self, keys, &pages)
    }

    async fn get_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, StoreError> {
        let mut buf = BytesMut::zeroed(keys.len() * PAGE_SIZE);
        let lookups = PageStore::get_many(self, keys, &mut buf)?;
        Ok(split(lookups, buf))
    }

    async fn take_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, StoreError> {
        let mut buf = BytesMut::zeroed(keys.len() * PAGE_SIZE);
        let lookups = PageStore::take_many(self, keys, &mut buf)?;
        Ok(split(lookups, buf))
    }

    async fn invalidate_pages(&self, keys: &[PageKey]) -> Result<(), StoreError> {
        keys.iter().try_for_each(|key| PageStore::invalidate_page(self, *key))
    }

    async fn invalidate_object(&self, pool: PoolId, object: ObjectId) -> Result<u64, StoreError> {
        PageStore::invalidate_object(self, pool, object)
    }

    async fn invalidate_pool(&self, pool: PoolId) -> Result<u64, StoreError> {
        PageStore::invalidate_pool(self, pool)
    }
}
