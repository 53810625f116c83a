//! Page requests across nodes: each batch is routed key by key, split into one request
//! per node, sent in parallel, and the answers put back in the caller's order.
//!
//! | pool | put | get, take | invalidate |
//! |---|---|---|---|
//! | private ephemeral | to the key's rendezvous owner; the summary records it, and the key's older copy on another node is invalidated | to the node the summary names; not in the summary: a miss, no request | to the node the summary names |
//! | shared ephemeral | to the owner, and invalidated on every other node (other clients may hold an older placement) | to the owner | on every node |
//! | private persistent | to the key's two best nodes, one put of a key at a time; `Stored` only if both stored it (else the copy that landed is removed); the summary records both when it ends, and names the older copies until then | the first copy that answers (the other if it fails or misses, even on a node listed dead or down); a take removes both | both copies |
//! | shared persistent (one node) | to its node | to its node | to its node |
//!
//! For an ephemeral pool a node that fails or cannot be reached is no error: its keys
//! are misses, puts to it are `NotStored(Full)`, and it is skipped until it answers again.
//! For a private persistent pool a failed node costs nothing while the other copy
//! answers; a page neither copy of which can be read is [`ClusterError::CopiesLost`]. A
//! shared persistent pool's failures are the caller's errors, as with a
//! [`crate::Client`].

#![expect(
    clippy::indexing_slicing,
    reason = "positions of the caller's keys, and the pages laid out for them, computed here"
)]

use std::collections::HashMap;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use fallow_core::{
    check_batch, AsyncPageStore, NotStored, ObjectId, PageKey, PoolId, PoolSpec, PutOutcome,
    StoreError, PAGE_SIZE,
};

use super::client::ClusterClient;
use super::dedup::{prefer_holders, Digest};
use super::placement::{key_hash, owner, top_two, Candidate};
use super::summary::{PutEnd, Slot, Summary};
use super::view::{Kind, LogicalPool, NodeLink, View};
use super::ClusterError;
use tokio::sync::RwLockReadGuard;

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

impl Part {
    /// Gets or takes the part's keys.
    async fn read(&self, read: Read) -> Result<Vec<Option<Bytes>>, crate::ClientError> {
        match read {
            Read::Get => self.link.client.get_many(&self.keys).await,
            Read::Take => self.link.client.take_many(&self.keys).await,
        }
    }
}

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
        self.view.pools.get(&id).ok_or(ClusterError::Store(StoreError::UnknownPool(id)))
    }

    fn cache(&mut self, id: PoolId, pool: &LogicalPool) {
        if self.cached.as_ref().is_none_or(|(c, _, _)| *c != id) {
            self.cached = Some((id, self.view.candidates(pool), self.view.holders(pool)));
        }
    }

    /// Where a new persistent page of `key` goes: its two best nodes.
    /// With the page's digest, nodes that hold its content come first (`dedup.rs`).
    fn owners(
        &mut self,
        key: &PageKey,
        pool: &LogicalPool,
        digest: Option<Digest>,
    ) -> [Option<Slot>; 2] {
        self.cache(key.pool, pool);
        let Some((_, candidates, _)) = self.cached.as_ref() else { return [None, None] };
        let two = top_two(key_hash(pool.seed, key.object, key.index), candidates);
        prefer_holders(self.view, candidates, two, digest)
    }

    /// Where a new page of `key` goes.
    fn owner(&mut self, key: &PageKey, pool: &LogicalPool) -> Option<Slot> {
        self.cache(key.pool, pool);
        let (_, candidates, _) = self.cached.as_ref()?;
        owner(key_hash(pool.seed, key.object, key.index), candidates)
    }

    /// Where a private ephemeral page goes, given its owner: a node that holds its
    /// content, if the owner does not and another does (`dedup.rs`).
    fn holder(
        &mut self,
        id: PoolId,
        pool: &LogicalPool,
        owner: Option<Slot>,
        digest: Option<Digest>,
    ) -> Option<Slot> {
        if digest.is_none() {
            return owner;
        }
        self.cache(id, pool);
        match self.cached.as_ref() {
            Some((_, candidates, _)) => {
                prefer_holders(self.view, candidates, [owner, None], digest)[0]
            }
            None => owner,
        }
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

    /// Where `key` goes for `op`, by its pool's kind, and what the summary learns of it:
    /// the one place that knows how each kind of pool is placed.
    ///
    /// | kind | put | get / take | invalidate |
    /// |---|---|---|---|
    /// | persistent | its node | its node | its node |
    /// | replicated | its two best nodes; older copies elsewhere dropped once it ends | a holder (the other, should it fail) | both holders |
    /// | private | its owner, or a node with its content; an older copy dropped | the node the summary names (none: a miss, no request) | that node |
    /// | shared | its owner; every other holder dropped | its owner | every holder |
    fn route(
        &mut self,
        summary: &mut Summary,
        key: &PageKey,
        op: RouteOp,
    ) -> Result<KeyRoute, ClusterError> {
        let view = self.view;
        let pool = self.pool(key.pool)?;
        let kind = pool.kind();
        let mut out = KeyRoute {
            kind,
            send: Vec::new(),
            drop: Vec::new(),
            other: None,
            holders: None,
            ticket: 0,
        };
        match (kind, op) {
            (Kind::Persistent, _) => out.send.push(self.home(key.pool, pool)?),
            (Kind::Replicated, RouteOp::Put(digest)) => {
                let targets = match self.owners(key, pool, digest) {
                    [Some(a), Some(b)] => {
                        view.route(pool, a).zip(view.route(pool, b)).map(|r| ([a, b], r))
                    }
                    _ => None,
                };
                // The older copies go, unless the new ones overwrite them: a put that is
                // refused leaves no older page behind. They stay in the summary until the
                // put ends (a get meanwhile reads the older page), and those on other
                // nodes are removed then (`put_many`); without two nodes to go to, the
                // put is refused now.
                let old = match targets {
                    Some(_) => {
                        out.ticket = summary.put_begins(key);
                        summary.copies(key)
                    }
                    None => summary.remove_copies(key),
                };
                for slot in old.unwrap_or_default().into_iter().filter(|&s| s != 0) {
                    if !targets.as_ref().is_some_and(|(t, _)| t.contains(&slot)) {
                        out.drop.extend(view.route(pool, slot));
                    }
                }
                if let Some((holders, (a, b))) = targets {
                    out.send.extend([a, b]);
                    out.holders = Some(holders);
                }
            }
            (Kind::Replicated, RouteOp::Get | RouteOp::Take) => {
                let holders = match op {
                    RouteOp::Take => summary.remove_copies(key),
                    _ => summary.copies(key),
                };
                // Not in the summary: this client never put it (or it was refused, taken
                // or invalidated): a miss, no request.
                let Some(holders) = holders else { return Ok(out) };
                out.holders = Some(holders);
                // Usable holders first. One that is not (listed dead, or its last request
                // failed) is still asked when no other copy answers: on a starved host a
                // node misses its gossip and its requests time out, yet its copy is there.
                // The page is lost only when a request to each holder fails.
                let mut slots: Vec<Slot> = holders.into_iter().filter(|&s| s != 0).collect();
                slots.sort_by_key(|&s| !view.usable(s));
                let mut routes = slots.into_iter().filter_map(|s| view.route_any(pool, s));
                out.send.push(routes.next().ok_or(ClusterError::CopiesLost(*key))?);
                out.other = routes.next();
            }
            (Kind::Replicated, RouteOp::Invalidate) => {
                let holders = summary.remove_copies(key).unwrap_or_default();
                let routes = holders.into_iter().filter(|&s| s != 0);
                out.send.extend(routes.filter_map(|s| view.route(pool, s)));
            }
            (Kind::Private, RouteOp::Put(digest)) => {
                let owner = self.owner(key, pool);
                let target = self.holder(key.pool, pool, owner, digest);
                let old = summary.remove(key).filter(|old| Some(*old) != target);
                out.drop.extend(old.and_then(|old| view.route(pool, old)));
                out.send.extend(target.and_then(|t| view.route(pool, t)));
            }
            // Not in the summary: this client never put it, or saw it leave. A take (and
            // an invalidation) forgets it now: hit or miss, the page leaves the node.
            (Kind::Private, RouteOp::Get) => {
                out.send.extend(summary.get(key).and_then(|slot| view.route(pool, slot)));
            }
            (Kind::Private, RouteOp::Take | RouteOp::Invalidate) => {
                out.send.extend(summary.remove(key).and_then(|slot| view.route(pool, slot)));
            }
            (Kind::Shared, RouteOp::Put(_)) => {
                let target = self.owner(key, pool);
                for route in self.holders(key.pool, pool) {
                    match Some(route.0.slot) == target {
                        true => out.send.push(route.clone()),
                        false => out.drop.push(route.clone()),
                    }
                }
            }
            (Kind::Shared, RouteOp::Get | RouteOp::Take) => {
                out.send.extend(self.owner(key, pool).and_then(|s| view.route(pool, s)));
            }
            (Kind::Shared, RouteOp::Invalidate) => {
                out.send.extend(self.holders(key.pool, pool).iter().cloned());
            }
        }
        Ok(out)
    }
}

/// The operation a key is routed for.
#[derive(Debug, Clone, Copy)]
enum RouteOp {
    /// A put, with the page's content digest when content-aware placement is on.
    Put(Option<Digest>),
    Get,
    Take,
    Invalidate,
}

/// Where one key goes ([`Router::route`]).
struct KeyRoute {
    /// Its pool's kind.
    kind: Kind,
    /// The nodes the operation goes to (for a read, the first copy).
    send: Vec<Route>,
    /// Nodes whose older copy a put removes.
    drop: Vec<Route>,
    /// A read's other copy, if the first fails (replicated pools).
    other: Option<Route>,
    /// A replicated put's two holders, or those the summary named to a replicated read.
    holders: Option<[Slot; 2]>,
    /// A replicated put's ticket ([`Summary::put_begins`]), with its holders.
    ticket: u64,
}

impl ClusterClient {
    /// Holds the write fence (shared) if the batch touches a private persistent pool, so
    /// that the repair never copies a page while a write changes it.
    async fn fence(&self, pools: impl Iterator<Item = PoolId>) -> Option<RwLockReadGuard<'_, ()>> {
        let replicated = {
            let view = self.inner.view.read();
            let mut last = None;
            let mut any = false;
            for pool in pools {
                if last != Some(pool) {
                    last = Some(pool);
                    any |= view.pools.get(&pool).is_some_and(|p| p.kind() == Kind::Replicated);
                }
            }
            any
        };
        match replicated {
            true => Some(self.inner.fence.read().await),
            false => None,
        }
    }

    /// Puts `keys.len()` pages: the i-th 4096 bytes of `pages` under `keys[i]`.
    pub async fn put_many(
        &self,
        keys: &[PageKey],
        pages: Bytes,
    ) -> Result<Vec<PutOutcome>, ClusterError> {
        check_batch(keys.len(), pages.len()).map_err(|_| StoreError::BadLength {
            got: pages.len(),
            expected: keys.len() * PAGE_SIZE,
        })?;
        let inner = &*self.inner;
        let _fence = self.fence(keys.iter().map(|k| k.pool)).await;
        let digests = inner.digests(keys, &pages);
        // `late`: older copies of persistent pages, removed once the put has ended.
        let (mut puts, mut drops, mut late) =
            (Parts::default(), Parts::default(), Parts::default());
        // Persistent keys of private pools: position → their two holders and what each
        // answered.
        let mut replicas: HashMap<usize, Replica> = HashMap::new();
        loop {
            // One put of a persistent page at a time: a put whose copy was refused on one
            // node removes the copy that landed on the other, which must not be the copy
            // of a concurrent put of the key that was stored. Concurrent puts of a page
            // have no order, so waiting gives one of them, held on both nodes.
            let ended = inner.put_ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            {
                let view = inner.view.read();
                let mut summary = inner.summary.lock();
                if !keys.iter().any(|key| summary.put_writing(key)) {
                    let mut router = Router::new(&view);
                    for (i, key) in keys.iter().enumerate() {
                        let digest = digests.get(i).copied().flatten();
                        let route = match router.route(&mut summary, key, RouteOp::Put(digest)) {
                            Ok(route) => route,
                            Err(err) => {
                                for (at, replica) in &replicas {
                                    summary.put_ends(&keys[*at], replica.ticket, PutEnd::Abandoned);
                                    summary.put_released(&keys[*at]);
                                }
                                drop(summary);
                                inner.put_ended.notify_waiters();
                                return Err(err);
                            }
                        };
                        route.send.iter().for_each(|to| puts.add(to, route.kind, i, key));
                        let dropped = if route.holders.is_some() { &mut late } else { &mut drops };
                        route.drop.iter().for_each(|to| dropped.add(to, route.kind, i, key));
                        if let Some(holders) = route.holders {
                            let ticket = route.ticket;
                            replicas.insert(i, Replica { holders, ticket, ..Replica::default() });
                        }
                    }
                    break;
                }
            }
            ended.await;
        }
        // From here a put that is dropped (its caller gave up) still ends, as refused, and
        // releases its keys.
        let mut pending = PendingPuts {
            inner,
            ends: replicas.iter().map(|(&at, r)| (keys[at], r.ticket)).collect(),
            keys: replicas.keys().map(|&at| keys[at]).collect(),
        };
        let data: Vec<Bytes> = puts.0.iter().map(|p| pages_of(&pages, &p.at)).collect();
        let part_digests: Vec<Vec<Option<Digest>>> = puts
            .0
            .iter()
            .map(|p| p.at.iter().filter_map(|&at| digests.get(at).copied()).collect())
            .collect();
        let sends = puts
            .0
            .iter()
            .zip(data)
            .zip(&part_digests)
            .map(|((p, d), digests)| inner.put_part(&p.link, &p.keys, d, digests));
        let invalidations = drops.0.iter().map(|p| p.link.client.invalidate_pages(&p.keys));
        let (sent, invalidated) = futures::future::join(
            futures::future::join_all(sends),
            futures::future::join_all(invalidations),
        )
        .await;
        let mut outcomes = vec![PutOutcome::NotStored(NotStored::Full); keys.len()];
        let mut stored = Vec::new();
        let mut error = None;
        for (part, result) in puts.0.iter().zip(sent) {
            match result {
                Ok(results) => {
                    for ((&at, key), outcome) in part.at.iter().zip(&part.keys).zip(results) {
                        if let Some(replica) = replicas.get_mut(&at) {
                            match outcome {
                                PutOutcome::Stored => {
                                    replica.stored.push((part.link.clone(), *key))
                                }
                                refused => replica.refused = replica.refused.or(Some(refused)),
                            }
                            continue;
                        }
                        outcomes[at] = outcome;
                        if part.kind == Kind::Private && outcome == PutOutcome::Stored {
                            stored.push((keys[at], part.link.slot));
                        }
                    }
                }
                Err(err) if part.kind == Kind::Persistent => error = error.or(Some(err)),
                Err(err) => inner.absorb(&part.link, &err),
            }
        }
        for (part, result) in drops.0.iter().zip(invalidated) {
            if let Err(err) = result {
                inner.absorb(&part.link, &err);
            }
        }
        // A persistent page is stored when both copies are; otherwise the copy that
        // landed is removed and the put reports the refusal (`NotStored(Full)` for a
        // node that failed). The summary learns the outcome first, then the copies that
        // no longer count are removed: the landed copy of a refused put, and older copies
        // on nodes the put did not go to.
        let mut ends = Vec::new();
        for (at, replica) in replicas {
            if replica.stored.len() == 2 {
                outcomes[at] = PutOutcome::Stored;
                ends.push((keys[at], replica.ticket, PutEnd::Stored(replica.holders)));
                continue;
            }
            outcomes[at] = replica.refused.unwrap_or(PutOutcome::NotStored(NotStored::Full));
            ends.push((keys[at], replica.ticket, PutEnd::Refused));
            for (link, key) in replica.stored {
                late.add(&(link, key.pool), Kind::Replicated, at, &keys[at]);
            }
        }
        {
            let mut summary = inner.summary.lock();
            for (key, slot) in stored {
                summary.insert(&key, slot);
            }
            for (key, ticket, end) in ends {
                summary.put_ends(&key, ticket, end);
            }
            pending.ends.clear();
        }
        if !late.0.is_empty() {
            let requests = late.0.iter().map(|p| p.link.client.invalidate_pages(&p.keys));
            for (part, result) in late.0.iter().zip(futures::future::join_all(requests).await) {
                if let Err(err) = result {
                    inner.absorb(&part.link, &err);
                }
            }
        }
        // The keys are released once the copies that no longer count are removed: a later
        // put of a key could otherwise land a copy that this removal takes away.
        drop(pending);
        match error {
            Some(err) => Err(err.into()),
            None => Ok(outcomes),
        }
    }

    /// Gets pages; they stay. `None` for each miss, including every page of a node that
    /// failed (for an ephemeral pool). A persistent page is read from its first copy that
    /// answers.
    pub async fn get_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, ClusterError> {
        self.read_many(keys, Read::Get).await
    }

    /// Takes pages: a hit also removes the page (both copies of a persistent page).
    /// `None` for each miss.
    pub async fn take_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, ClusterError> {
        let _fence = self.fence(keys.iter().map(|k| k.pool)).await;
        self.read_many(keys, Read::Take).await
    }

    async fn read_many(
        &self,
        keys: &[PageKey],
        read: Read,
    ) -> Result<Vec<Option<Bytes>>, ClusterError> {
        let (mut out, routed) = self.read_round(keys, read).await?;
        if read == Read::Get {
            // A persistent page that both its copies missed, while a put of it that ended
            // meanwhile moved it to other nodes (and removed the copies read): read once
            // more, from the copies the summary names now.
            let moved: Vec<usize> = {
                let summary = self.inner.summary.lock();
                routed
                    .into_iter()
                    .filter(|(at, _)| out[*at].is_none())
                    .filter(|(at, read)| summary.copies(&keys[*at]).is_some_and(|now| now != *read))
                    .map(|(at, _)| at)
                    .collect()
            };
            if !moved.is_empty() {
                let again: Vec<PageKey> = moved.iter().map(|&at| keys[at]).collect();
                let (pages, _) = self.read_round(&again, read).await?;
                for (at, page) in moved.into_iter().zip(pages) {
                    out[at] = page;
                }
            }
        }
        Ok(out)
    }

    /// One read of `keys`: the pages, and for each persistent page of a private pool
    /// (position) the copies the summary named.
    async fn read_round(
        &self,
        keys: &[PageKey],
        read: Read,
    ) -> Result<(Vec<Option<Bytes>>, Vec<(usize, [Slot; 2])>), ClusterError> {
        let inner = &*self.inner;
        let mut parts = Parts::default();
        let mut routed = Vec::new();
        // Persistent pages of private pools: position → the other copy, if usable.
        let mut other: HashMap<usize, Route> = HashMap::new();
        {
            let view = inner.view.read();
            let mut summary = inner.summary.lock();
            let mut router = Router::new(&view);
            let op = match read {
                Read::Get => RouteOp::Get,
                Read::Take => RouteOp::Take,
            };
            for (i, key) in keys.iter().enumerate() {
                let route = router.route(&mut summary, key, op)?;
                if let Some(first) = route.send.first() {
                    parts.add(first, route.kind, i, key);
                }
                if let Some(holders) = route.holders {
                    routed.push((i, holders));
                }
                if let Some(second) = route.other {
                    other.insert(i, second);
                }
            }
        }
        let answers = futures::future::join_all(parts.0.iter().map(|p| p.read(read))).await;
        let mut out = vec![None; keys.len()];
        let mut left = Vec::new();
        // Second round, for persistent pages: the other copy where the first failed or
        // missed; for a take that hit, the other copy removed.
        let (mut retry, mut remove) = (Parts::default(), Parts::default());
        let mut error = None;
        for (part, answer) in parts.0.iter().zip(answers) {
            match answer {
                Ok(pages) => {
                    for (&at, page) in part.at.iter().zip(pages) {
                        if part.kind == Kind::Replicated {
                            if let Some(route) = other.remove(&at) {
                                match (&page, read) {
                                    (None, _) => retry.add(&route, part.kind, at, &keys[at]),
                                    (Some(_), Read::Take) => {
                                        remove.add(&route, part.kind, at, &keys[at])
                                    }
                                    (Some(_), Read::Get) => {}
                                }
                            }
                        }
                        if page.is_none() && part.kind == Kind::Private && read == Read::Get {
                            left.push((keys[at], part.link.slot));
                        }
                        out[at] = page;
                    }
                }
                Err(err) if part.kind == Kind::Persistent => return Err(err.into()),
                Err(err) => {
                    inner.absorb(&part.link, &err);
                    if part.kind == Kind::Replicated {
                        for &at in &part.at {
                            match other.remove(&at) {
                                Some(route) => retry.add(&route, part.kind, at, &keys[at]),
                                None => error = error.or(Some(ClusterError::CopiesLost(keys[at]))),
                            }
                        }
                    }
                }
            }
        }
        if !retry.0.is_empty() || !remove.0.is_empty() {
            let (answers, removed) = futures::future::join(
                futures::future::join_all(retry.0.iter().map(|p| p.read(read))),
                futures::future::join_all(
                    remove.0.iter().map(|p| p.link.client.invalidate_pages(&p.keys)),
                ),
            )
            .await;
            for (part, answer) in retry.0.iter().zip(answers) {
                match answer {
                    Ok(pages) => {
                        for (&at, page) in part.at.iter().zip(pages) {
                            out[at] = page;
                        }
                    }
                    Err(err) => {
                        inner.absorb(&part.link, &err);
                        error = error.or(Some(ClusterError::CopiesLost(keys[part.at[0]])));
                    }
                }
            }
            for (part, result) in remove.0.iter().zip(removed) {
                if let Err(err) = result {
                    inner.absorb(&part.link, &err);
                }
            }
        }
        if let Some(err) = error {
            return Err(err);
        }
        // A page its node no longer has (evicted) is a local miss from now on.
        if !left.is_empty() {
            let mut summary = inner.summary.lock();
            for (key, slot) in left {
                summary.remove_if(&key, slot);
            }
        }
        Ok((out, routed))
    }

    /// Removes pages, if present (both copies of a persistent page).
    pub async fn invalidate_pages(&self, keys: &[PageKey]) -> Result<(), ClusterError> {
        let inner = &*self.inner;
        let _fence = self.fence(keys.iter().map(|k| k.pool)).await;
        let mut parts = Parts::default();
        {
            let view = inner.view.read();
            let mut summary = inner.summary.lock();
            let mut router = Router::new(&view);
            for (i, key) in keys.iter().enumerate() {
                let route = router.route(&mut summary, key, RouteOp::Invalidate)?;
                route.send.iter().for_each(|to| parts.add(to, route.kind, i, key));
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
    /// (on the nodes that answered; for a private persistent pool, the pages this client
    /// held, each counted once).
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
        let _fence = self.fence(std::iter::once(id)).await;
        let (kind, targets, held) = {
            let view = inner.view.read();
            let router = Router::new(&view);
            let pool = router.pool(id)?;
            let targets = match pool.kind() {
                Kind::Persistent => vec![router.home(id, pool)?],
                _ => view.holders(pool),
            };
            let mut summary = inner.summary.lock();
            let held = match object {
                Some(object) => summary.forget_object(id, object),
                None => summary.forget_pool(id),
            };
            (pool.kind(), targets, held)
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
        // Two copies of each page answered: the pages this client held, once each.
        Ok(if kind == Kind::Replicated { held } else { total })
    }
}

/// The persistent puts of a batch, from their routing until their last request. Dropped
/// before they ended (the batch's future was dropped midway), they end as refused: what
/// reached the nodes is unknown, so the page is forgotten unless another put of it was
/// stored. Dropped at all, they release their keys to the puts waiting for them.
struct PendingPuts<'a> {
    inner: &'a super::client::Inner,
    /// Puts not ended yet: key and ticket.
    ends: Vec<(PageKey, u64)>,
    /// Keys to release.
    keys: Vec<PageKey>,
}

impl Drop for PendingPuts<'_> {
    fn drop(&mut self) {
        if self.ends.is_empty() && self.keys.is_empty() {
            return;
        }
        let mut summary = self.inner.summary.lock();
        for (key, ticket) in self.ends.drain(..) {
            summary.put_ends(&key, ticket, PutEnd::Refused);
        }
        for key in self.keys.drain(..) {
            summary.put_released(&key);
        }
        drop(summary);
        self.inner.put_ended.notify_waiters();
    }
}

/// A persistent page's put: its two holders, the copies stored (node and key there) and
/// the first refusal.
#[derive(Default)]
struct Replica {
    holders: [Slot; 2],
    /// Its ticket ([`Summary::put_begins`]).
    ticket: u64,
    stored: Vec<(Arc<NodeLink>, PageKey)>,
    refused: Option<PutOutcome>,
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
