//! Page requests across nodes: each batch is routed key by key, split into one request
//! per node, sent in parallel, and the answers put back in the caller's order.
//!
//! | pool | put | get, take | invalidate |
//! |---|---|---|---|
//! | private ephemeral | to the key's rendezvous owner; the summary records it, and the key's older copy on another node is invalidated | to the node the summary names; not in the summary: a miss, no request | to the node the summary names |
//! | shared ephemeral | to the owner, and invalidated on every other node (other clients may hold an older placement) | to the owner | on every node |
//! | persistent (one node) | to its node | to its node | to its node |
//!
//! For an ephemeral pool a node that fails or cannot be reached is no error: its keys
//! are misses, puts to it are `NotStored(Full)`, and it is skipped until it answers again.
//! A persistent pool's failures are the caller's errors, as with a [`crate::Client`].

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use fallow_core::{
    check_batch, AsyncPageStore, NotStored, ObjectId, PageKey, PoolId, PoolSpec, PutOutcome,
    StoreError, PAGE_SIZE,
};

use super::client::ClusterClient;
use super::placement::{key_hash, owner, Candidate};
use super::summary::Slot;
use super::view::{Kind, LogicalPool, NodeLink, View};
use super::ClusterError;

/// A node and a pool's id there.
type Route = (Arc<NodeLink>, PoolId);

/// Keys bound for one node.
struct Part {
    link: Arc<NodeLink>,
    kind: Kind,
    /// Positions in the caller's batch.
    at: Vec<usize>,
    /// The keys, with the node's pool ids.
    keys: Vec<PageKey>,
}

/// A batch split by node (and pool kind, so that failures are handled per kind).
#[derive(Default)]
struct Parts(Vec<Part>);

impl Parts {
    fn add(&mut self, (link, id): &Route, kind: Kind, at: usize, key: &PageKey) {
        let key = PageKey::new(*id, key.object, key.index);
        match self.0.iter_mut().find(|p| p.link.slot == link.slot && p.kind == kind) {
            Some(part) => {
                part.at.push(at);
                part.keys.push(key);
            }
            None => self.0.push(Part { link: link.clone(), kind, at: vec![at], keys: vec![key] }),
        }
    }
}

/// Routing for one batch, under the view's read lock. Caches the last pool's candidates
/// and holders: a batch is nearly always of one pool.
struct Router<'a> {
    view: &'a View,
    cached: Option<(PoolId, Vec<Candidate>, Vec<Route>)>,
}

impl<'a> Router<'a> {
    fn new(view: &'a View) -> Self {
        Router { view, cached: None }
    }

    fn pool(&self, id: PoolId) -> Result<&'a LogicalPool, ClusterError> {
        self.view.pools.get(&id).ok_or(ClusterError::UnknownPool(id))
    }

    fn cache(&mut self, id: PoolId, pool: &LogicalPool) {
        if self.cached.as_ref().is_none_or(|(c, _, _)| *c != id) {
            self.cached = Some((id, self.view.candidates(pool), self.view.holders(pool)));
        }
    }

    /// Where a new page of `key` goes.
    fn owner(&mut self, key: &PageKey, pool: &LogicalPool) -> Option<Slot> {
        self.cache(key.pool, pool);
        let (_, candidates, _) = self.cached.as_ref()?;
        owner(key_hash(pool.seed, key.object, key.index), candidates)
    }

    /// The usable nodes holding the pool.
    fn holders(&mut self, id: PoolId, pool: &LogicalPool) -> &[Route] {
        self.cache(id, pool);
        self.cached.as_ref().map_or(&[], |(_, _, h)| h.as_slice())
    }

    /// A persistent pool's node, whatever its state: its failures are the caller's.
    fn home(&self, id: PoolId, pool: &LogicalPool) -> Result<Route, ClusterError> {
        let slot = pool.home.ok_or(ClusterError::PoolLost(id))?;
        let node = self.view.node(slot).ok_or(ClusterError::PoolLost(id))?;
        Ok((node.link.clone(), *pool.on.get(&slot).ok_or(ClusterError::PoolLost(id))?))
    }
}

impl ClusterClient {
    /// Puts `keys.len()` pages: the i-th 4096 bytes of `pages` under `keys[i]`.
    pub async fn put_many(
        &self,
        keys: &[PageKey],
        pages: Bytes,
    ) -> Result<Vec<PutOutcome>, ClusterError> {
        check_batch(keys.len(), pages.len()).map_err(|_| ClusterError::BadLength {
            got: pages.len(),
            expected: keys.len() * PAGE_SIZE,
        })?;
        let inner = &*self.inner;
        let (mut puts, mut drops) = (Parts::default(), Parts::default());
        {
            let view = inner.view.read();
            let mut summary = inner.summary.lock();
            let mut router = Router::new(&view);
            for (i, key) in keys.iter().enumerate() {
                let pool = router.pool(key.pool)?;
                match pool.kind() {
                    Kind::Persistent => {
                        puts.add(&router.home(key.pool, pool)?, Kind::Persistent, i, key)
                    }
                    Kind::Private => {
                        let target = router.owner(key, pool);
                        let old = summary.remove(key).filter(|old| Some(*old) != target);
                        if let Some(route) = old.and_then(|old| view.route(pool, old)) {
                            drops.add(&route, Kind::Private, i, key);
                        }
                        if let Some(route) = target.and_then(|t| view.route(pool, t)) {
                            puts.add(&route, Kind::Private, i, key);
                        }
                    }
                    Kind::Shared => {
                        let target = router.owner(key, pool);
                        for route in router.holders(key.pool, pool) {
                            match Some(route.0.slot) == target {
                                true => puts.add(route, Kind::Shared, i, key),
                                false => drops.add(route, Kind::Shared, i, key),
                            }
                        }
                    }
                }
            }
        }
        let data: Vec<Bytes> = puts.0.iter().map(|p| pages_of(&pages, &p.at)).collect();
        let sends = puts.0.iter().zip(data).map(|(p, d)| p.link.client.put_many(&p.keys, d));
        let invalidations = drops.0.iter().map(|p| p.link.client.invalidate_pages(&p.keys));
        let (sent, invalidated) = futures::future::join(
            futures::future::join_all(sends),
            futures::future::join_all(invalidations),
        )
        .await;
        let mut outcomes = vec![PutOutcome::NotStored(NotStored::Full); keys.len()];
        let mut stored = Vec::new();
        for (part, result) in puts.0.iter().zip(sent) {
            match result {
                Ok(results) => {
                    for (&at, outcome) in part.at.iter().zip(results) {
                        outcomes[at] = outcome;
                        if part.kind == Kind::Private && outcome == PutOutcome::Stored {
                            stored.push((keys[at], part.link.slot));
                        }
                    }
                }
                Err(err) if part.kind == Kind::Persistent => return Err(err.into()),
                Err(err) => inner.absorb(&part.link, &err),
            }
        }
        for (part, result) in drops.0.iter().zip(invalidated) {
            if let Err(err) = result {
                inner.absorb(&part.link, &err);
            }
        }
        let mut summary = inner.summary.lock();
        for (key, slot) in stored {
            summary.insert(&key, slot);
        }
        Ok(outcomes)
    }

    /// Gets pages; they stay. `None` for each miss, including every page of a node that
    /// failed.
    pub async fn get_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, ClusterError> {
        self.read_many(keys, Read::Get).await
    }

    /// Takes pages: a hit also removes the page. `None` for each miss.
    pub async fn take_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, ClusterError> {
        self.read_many(keys, Read::Take).await
    }

    async fn read_many(
        &self,
        keys: &[PageKey],
        read: Read,
    ) -> Result<Vec<Option<Bytes>>, ClusterError> {
        let inner = &*self.inner;
        let mut parts = Parts::default();
        {
            let view = inner.view.read();
            let mut summary = inner.summary.lock();
            let mut router = Router::new(&view);
            for (i, key) in keys.iter().enumerate() {
                let pool = router.pool(key.pool)?;
                let kind = pool.kind();
                let route = match kind {
                    Kind::Persistent => Some(router.home(key.pool, pool)?),
                    // Not in the summary: this client never put it, or saw it leave. A
                    // take forgets it now: hit or miss, the page leaves the node.
                    Kind::Private => match read {
                        Read::Get => summary.get(key),
                        Read::Take => summary.remove(key),
                    }
                    .and_then(|slot| view.route(pool, slot)),
                    Kind::Shared => router.owner(key, pool).and_then(|s| view.route(pool, s)),
                };
                if let Some(route) = route {
                    parts.add(&route, kind, i, key);
                }
            }
        }
        let requests = parts.0.iter().map(|p| match read {
            Read::Get => futures::future::Either::Left(p.link.client.get_many(&p.keys)),
            Read::Take => futures::future::Either::Right(p.link.client.take_many(&p.keys)),
        });
        let answers = futures::future::join_all(requests).await;
        let mut out = vec![None; keys.len()];
        let mut left = Vec::new();
        for (part, answer) in parts.0.iter().zip(answers) {
            match answer {
                Ok(pages) => {
                    for (&at, page) in part.at.iter().zip(pages) {
                        if page.is_none() && part.kind == Kind::Private && read == Read::Get {
                            left.push((keys[at], part.link.slot));
                        }
                        out[at] = page;
                    }
                }
                Err(err) if part.kind == Kind::Persistent => return Err(err.into()),
                Err(err) => inner.absorb(&part.link, &err),
            }
        }
        // A page its node no longer has (evicted) is a local miss from now on.
        if !left.is_empty() {
            let mut summary = inner.summary.lock();
            for (key, slot) in left {
                summary.remove_if(&key, slot);
            }
        }
        Ok(out)
    }

    /// Removes pages, if present.
    pub async fn invalidate_pages(&self, keys: &[PageKey]) -> Result<(), ClusterError> {
        let inner = &*self.inner;
        let mut parts = Parts::default();
        {
            let view = inner.view.read();
            let mut summary = inner.summary.lock();
            let mut router = Router::new(&view);
            for (i, key) in keys.iter().enumerate() {
                let pool = router.pool(key.pool)?;
                match pool.kind() {
                    Kind::Persistent => {
                        parts.add(&router.home(key.pool, pool)?, Kind::Persistent, i, key)
                    }
                    Kind::Private => {
                        if let Some(route) = summary.remove(key).and_then(|s| view.route(pool, s)) {
                            parts.add(&route, Kind::Private, i, key);
                        }
                    }
                    Kind::Shared => {
                        for route in router.holders(key.pool, pool) {
                            parts.add(route, Kind::Shared, i, key);
                        }
                    }
                }
            }
        }
        let requests = parts.0.iter().map(|p| p.link.client.invalidate_pages(&p.keys));
        for (part, result) in parts.0.iter().zip(futures::future::join_all(requests).await) {
            match result {
                Ok(()) => {}
                Err(err) if part.kind == Kind::Persistent => return Err(err.into()),
                Err(err) => inner.absorb(&part.link, &err),
            }
        }
        Ok(())
    }

    /// Removes every page of one object on every node; returns how many were removed
    /// (on the nodes that answered).
    pub async fn invalidate_object(
        &self,
        pool: PoolId,
        object: ObjectId,
    ) -> Result<u64, ClusterError> {
        self.invalidate_whole(pool, Some(object)).await
    }

    /// Removes every page of a pool on every node; returns how many were removed.
    pub async fn invalidate_pool(&self, pool: PoolId) -> Result<u64, ClusterError> {
        self.invalidate_whole(pool, None).await
    }

    async fn invalidate_whole(
        &self,
        id: PoolId,
        object: Option<ObjectId>,
    ) -> Result<u64, ClusterError> {
        let inner = &*self.inner;
        let (kind, targets) = {
            let view = inner.view.read();
            let router = Router::new(&view);
            let pool = router.pool(id)?;
            let targets = match pool.kind() {
                Kind::Persistent => vec![router.home(id, pool)?],
                _ => view.holders(pool),
            };
            let mut summary = inner.summary.lock();
            match object {
                Some(object) => summary.forget_object(id, object),
                None => summary.forget_pool(id),
            }
            (pool.kind(), targets)
        };
        let requests = targets.iter().map(|(link, pool)| async move {
            match object {
                Some(object) => link.client.invalidate_object(*pool, object).await,
                None => link.client.invalidate_pool(*pool).await,
            }
        });
        let mut total = 0;
        for ((link, _), result) in targets.iter().zip(futures::future::join_all(requests).await) {
            match result {
                Ok(n) => total += n,
                Err(err) if kind == Kind::Persistent => return Err(err.into()),
                Err(err) => inner.absorb(link, &err),
            }
        }
        Ok(total)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Read {
    Get,
    Take,
}

/// The pages at positions `at` of the caller's buffer, in that order: the buffer itself
/// when that is all of it.
fn pages_of(pages: &Bytes, at: &[usize]) -> Bytes {
    if at.len() * PAGE_SIZE == pages.len() && at.iter().enumerate().all(|(i, &a)| i == a) {
        return pages.clone();
    }
    let mut out = BytesMut::with_capacity(at.len() * PAGE_SIZE);
    for &i in at {
        out.extend_from_slice(&pages[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]);
    }
    out.freeze()
}

/// The async trait, so that an NBD export caches in a cluster exactly as in one node or
/// the in-process engine.
#[async_trait::async_trait]
impl AsyncPageStore for ClusterClient {
    async fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, StoreError> {
        Ok(ClusterClient::create_pool(self, spec).await?)
    }

    async fn destroy_pool(&self, pool: PoolId) -> Result<(), StoreError> {
        Ok(ClusterClient::destroy_pool(self, pool).await?)
    }

    async fn put_many(
        &self,
        keys: &[PageKey],
        pages: Bytes,
    ) -> Result<Vec<PutOutcome>, StoreError> {
        Ok(ClusterClient::put_many(self, keys, pages).await?)
    }

    async fn get_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, StoreError> {
        Ok(ClusterClient::get_many(self, keys).await?)
    }

    async fn take_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, StoreError> {
        Ok(ClusterClient::take_many(self, keys).await?)
    }

    async fn invalidate_pages(&self, keys: &[PageKey]) -> Result<(), StoreError> {
        Ok(ClusterClient::invalidate_pages(self, keys).await?)
    }

    async fn invalidate_object(&self, pool: PoolId, object: ObjectId) -> Result<u64, StoreError> {
        Ok(ClusterClient::invalidate_object(self, pool, object).await?)
    }

    async fn invalidate_pool(&self, pool: PoolId) -> Result<u64, StoreError> {
        Ok(ClusterClient::invalidate_pool(self, pool).await?)
    }
}
