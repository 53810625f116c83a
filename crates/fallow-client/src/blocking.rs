//! A blocking client for synchronous callers: the [`PageStore`] trait, so code written
//! against the in-process engine runs unchanged against a node.

use bytes::Bytes;
use fallow_core::{
    check_batch, check_page, Lookup, ObjectId, PageKey, PageStore, PoolId, PoolSpec, PutOutcome,
    StoreError, PAGE_SIZE,
};

use crate::{Client, ClientConfig, ClientError};

/// A [`Client`] with its own small tokio runtime. Its methods block the calling thread;
/// calling them from inside an async task would block that task's runtime, so async code
/// uses [`Client`] directly.
#[derive(Debug)]
pub struct BlockingClient {
    runtime: tokio::runtime::Runtime,
    client: Client,
}

impl BlockingClient {
    /// Connects, as [`Client::connect`] does.
    pub fn connect(config: ClientConfig) -> Result<Self, ClientError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("fallow-client")
            .enable_all()
            .build()?;
        let client = runtime.block_on(Client::connect(config))?;
        Ok(Self { runtime, client })
    }

    /// The async client inside (for calls the trait does not have: stats, ping).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Runs a future of the async client to completion on this client's runtime.
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.runtime.block_on(future)
    }
}

fn copy_out(page: Option<Bytes>, out: &mut [u8]) -> Lookup {
    match page {
        Some(bytes) => {
            out.copy_from_slice(&bytes);
            Lookup::Hit
        }
        None => Lookup::Miss,
    }
}

impl PageStore for BlockingClient {
    fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, StoreError> {
        Ok(self.block_on(self.client.create_pool(spec))?)
    }

    fn destroy_pool(&self, pool: PoolId) -> Result<(), StoreError> {
        Ok(self.block_on(self.client.destroy_pool(pool))?)
    }

    fn put(&self, key: PageKey, page: &[u8]) -> Result<PutOutcome, StoreError> {
        check_page(page.len())?;
        Ok(self.block_on(self.client.put(key, Bytes::copy_from_slice(page)))?)
    }

    fn get(&self, key: PageKey, out: &mut [u8]) -> Result<Lookup, StoreError> {
        check_page(out.len())?;
        Ok(copy_out(self.block_on(self.client.get(key))?, out))
    }

    fn take(&self, key: PageKey, out: &mut [u8]) -> Result<Lookup, StoreError> {
        check_page(out.len())?;
        Ok(copy_out(self.block_on(self.client.take(key))?, out))
    }

    fn invalidate_page(&self, key: PageKey) -> Result<(), StoreError> {
        Ok(self.block_on(self.client.invalidate_page(key))?)
    }

    fn invalidate_object(&self, pool: PoolId, object: ObjectId) -> Result<u64, StoreError> {
        Ok(self.block_on(self.client.invalidate_object(pool, object))?)
    }

    fn invalidate_pool(&self, pool: PoolId) -> Result<u64, StoreError> {
        Ok(self.block_on(self.client.invalidate_pool(pool))?)
    }

    fn put_many(&self, keys: &[PageKey], pages: &[u8]) -> Result<Vec<PutOutcome>, StoreError> {
        check_batch(keys.len(), pages.len())?;
        Ok(self.block_on(self.client.put_many(keys, Bytes::copy_from_slice(pages)))?)
    }

    fn get_many(&self, keys: &[PageKey], out: &mut [u8]) -> Result<Vec<Lookup>, StoreError> {
        check_batch(keys.len(), out.len())?;
        let pages = self.block_on(self.client.get_many(keys))?;
        Ok(pages
            .into_iter()
            .zip(out.chunks_exact_mut(PAGE_SIZE))
            .map(|(p, o)| copy_out(p, o))
            .collect())
    }

    fn take_many(&self, keys: &[PageKey], out: &mut [u8]) -> Result<Vec<Lookup>, StoreError> {
        check_batch(keys.len(), out.len())?;
        let pages = self.block_on(self.client.take_many(keys))?;
        Ok(pages
            .into_iter()
            .zip(out.chunks_exact_mut(PAGE_SIZE))
            .map(|(p, o)| copy_out(p, o))
            .collect())
    }
}
