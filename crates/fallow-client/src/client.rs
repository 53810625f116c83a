//! The async client: connections (opened lazily, reopened after a failure), batching over
//! the node's batch limit, and one retry of idempotent requests on a fresh connection.

#![expect(
    clippy::indexing_slicing,
    reason = "ranges of the caller's keys and connection slots, computed here"
)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use fallow_core::{
    check_batch, ObjectId, PageKey, PoolId, PoolSpec, PutOutcome, Sharing, StoreError, PAGE_SIZE,
};
use fallow_proto::fallow::{MemberInfo, Op, PageRef, Reply, Request, Status};
use parking_lot::Mutex;

use crate::conn::Conn;
use crate::session::Numbering;
use crate::{ClientConfig, ClientError, NodeRestart, NodeStats};

/// A client of one node. Cheap to clone (clones share connections); every method takes
/// `&self`, so any number of requests can be in flight at once, pipelined on the
/// connections.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("config", &self.inner.config).finish_non_exhaustive()
    }
}

struct Inner {
    config: ClientConfig,
    slots: Vec<Slot>,
    next: AtomicUsize,
    /// The node id the first connection saw: a later connection that sees another one
    /// reached a restarted node ([`NodeRestart`]).
    first_node_id: OnceLock<u128>,
    /// The numbering of the connections, for fencing the ones given up on.
    numbering: Arc<Numbering>,
}

/// One connection, replaced when it fails.
struct Slot {
    current: Mutex<Option<Arc<Conn>>>,
    /// Serialises reconnects, so a burst of requests on a dead connection opens one new
    /// connection, not one each.
    connecting: tokio::sync::Mutex<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for slot in &self.slots {
            if let Some(conn) = slot.current.lock().take() {
                conn.close();
            }
        }
    }
}

/// The slot's connection, unless it failed or a give-up fenced it. A fenced one is closed:
/// its requests in flight fail as disconnected (a retry goes on the new connection), and
/// the fence already covers them.
fn usable(current: &Mutex<Option<Arc<Conn>>>) -> Option<Arc<Conn>> {
    let current = current.lock();
    let conn = current.as_ref()?;
    if conn.is_fenced() {
        conn.close();
        return None;
    }
    (!conn.is_closed()).then(|| conn.clone())
}

/// Whether a request may be sent again after its connection broke with it in flight.
/// A repeated take could lose a page the first attempt took, and a repeated destroy could
/// detach twice; everything else has the same effect when repeated.
fn retryable(op: Op) -> bool {
    !matches!(op, Op::Take | Op::DestroyPool)
}

impl Client {
    /// Connects (the first connection is opened now, so a wrong address or secret is
    /// reported here; the others open on first use).
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        Client::connect_in(config, Arc::new(Numbering::new())).await
    }

    /// Connects as [`Client::connect`] does, numbering its connections in `numbering`'s
    /// session: a client object made to replace another for the same node (a cluster
    /// client adopting a node again) carries the fence of the requests the old one gave up
    /// on, so that none of them lands after its own.
    pub(crate) async fn connect_in(
        config: ClientConfig,
        numbering: Arc<Numbering>,
    ) -> Result<Client, ClientError> {
        let slots = (0..config.connections.max(1))
            .map(|_| Slot { current: Mutex::new(None), connecting: tokio::sync::Mutex::new(()) })
            .collect();
        let inner = Inner {
            config,
            slots,
            next: AtomicUsize::new(0),
            first_node_id: OnceLock::new(),
            numbering,
        };
        let client = Client { inner: Arc::new(inner) };
        client.conn_at(0).await?;
        Ok(client)
    }

    /// The configuration.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// The session its connections are numbered in ([`Client::connect_in`]).
    pub(crate) fn numbering(&self) -> &Arc<Numbering> {
        &self.inner.numbering
    }

    /// The node's id, from the most recent handshake.
    pub async fn node_id(&self) -> Result<u128, ClientError> {
        Ok(self.conn().await?.node_id)
    }

    async fn conn(&self) -> Result<Arc<Conn>, ClientError> {
        let i = self.inner.next.fetch_add(1, Ordering::Relaxed) % self.inner.slots.len();
        self.conn_at(i).await
    }

    /// The connection of slot `i`, opened anew when the slot has none, or has one that
    /// failed or that a give-up fenced ([`usable`]).
    async fn conn_at(&self, i: usize) -> Result<Arc<Conn>, ClientError> {
        let slot = &self.inner.slots[i];
        if let Some(conn) = usable(&slot.current) {
            return Ok(conn);
        }
        let _one_at_a_time = slot.connecting.lock().await;
        if let Some(conn) = usable(&slot.current) {
            return Ok(conn);
        }
        let conn = Conn::open(&self.inner.config, &self.inner.numbering).await?;
        let first = *self.inner.first_node_id.get_or_init(|| conn.node_id);
        if first != conn.node_id && self.inner.config.on_restart == NodeRestart::Refuse {
            conn.close();
            return Err(ClientError::NodeRestarted { expected: first, found: conn.node_id });
        }
        tracing::debug!(endpoint = %self.inner.config.endpoint, slot = i, "connected");
        *slot.current.lock() = Some(conn.clone());
        Ok(conn)
    }

    /// Sends a request and parses its reply; retries once on a fresh connection when the
    /// connection failed and the op allows it. A timeout is not retried: the request has
    /// had its time, and a node that does not answer is likely gone (a retry would double
    /// the wait).
    pub(crate) async fn request(
        &self,
        request: &Request,
        keys: usize,
    ) -> Result<Reply, ClientError> {
        let op = request.op();
        let mut attempts = if retryable(op) { 2 } else { 1 };
        loop {
            attempts -= 1;
            let result = match self.conn().await {
                Ok(conn) => conn.call(request, timeout_for(&self.inner.config, op)).await,
                Err(err) => Err(err),
            };
            match result {
                Ok(frame) => {
                    return Reply::parse(frame, op, keys).map_err(|e| {
                        ClientError::Protocol(format!("bad {} reply: {e}", op.name()))
                    });
                }
                Err(err)
                    if attempts > 0
                        && err.is_connection_error()
                        && !matches!(err, ClientError::Timeout(_)) =>
                {
                    tracing::debug!(%err, op = op.name(), "retrying on a fresh connection");
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// The most pages per request, as the node announced.
    pub(crate) async fn max_batch(&self) -> Result<usize, ClientError> {
        Ok(self.conn().await?.max_batch)
    }

    /// Creates a pool, or attaches to the shared pool with the spec's UUID.
    pub async fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, ClientError> {
        match self.request(&Request::CreatePool(*spec), 0).await? {
            Reply::Pool(pool) => Ok(pool),
            other => Err(failure(other, None)),
        }
    }

    /// Creates a cluster pool through this node (CREATE_POOL with the cluster flag): the
    /// node spreads the pool's pages over the cluster it gossips with and forwards every
    /// request on it, so one connection reaches the whole cluster's memory. A node that
    /// does not gossip refuses with `INVALID_SPEC` (`docs/cluster.md`, "Peer forwarding").
    pub async fn create_cluster_pool(&self, spec: &PoolSpec) -> Result<PoolId, ClientError> {
        match self.request(&Request::CreateClusterPool(*spec), 0).await? {
            Reply::Pool(pool) => Ok(pool),
            other => Err(failure(other, None)),
        }
    }

    /// Detaches from a pool (its pages go when its last user detaches).
    pub async fn destroy_pool(&self, pool: PoolId) -> Result<(), ClientError> {
        match self.request(&Request::DestroyPool(pool), 0).await? {
            Reply::Empty => Ok(()),
            other => Err(failure(other, Some(pool))),
        }
    }

    /// Removes every page of a pool; returns how many were removed.
    pub async fn invalidate_pool(&self, pool: PoolId) -> Result<u64, ClientError> {
        match self.request(&Request::InvalidatePool(pool), 0).await? {
            Reply::Count(n) => Ok(n),
            other => Err(failure(other, Some(pool))),
        }
    }

    /// Removes every page of one object; returns how many were removed.
    pub async fn invalidate_object(
        &self,
        pool: PoolId,
        object: ObjectId,
    ) -> Result<u64, ClientError> {
        match self.request(&Request::InvalidateObject { pool, object }, 0).await? {
            Reply::Count(n) => Ok(n),
            other => Err(failure(other, Some(pool))),
        }
    }

    /// Removes one page.
    pub async fn invalidate_page(&self, key: PageKey) -> Result<(), ClientError> {
        self.invalidate_pages(&[key]).await
    }

    /// Removes a batch of pages (any number, in any pools).
    pub async fn invalidate_pages(&self, keys: &[PageKey]) -> Result<(), ClientError> {
        let max = self.max_batch().await?;
        let requests = runs(keys, max).map(|(pool, range)| {
            let pages = refs(&keys[range]);
            async move {
                match self.request(&Request::InvalidatePages { pool, pages }, 0).await? {
                    Reply::Empty => Ok(()),
                    other => Err(failure(other, Some(pool))),
                }
            }
        });
        futures::future::try_join_all(requests).await.map(|_| ())
    }

    /// Stores one page (exactly 4096 bytes).
    pub async fn put(&self, key: PageKey, page: Bytes) -> Result<PutOutcome, ClientError> {
        Ok(self.put_many(&[key], page).await?[0])
    }

    /// Stores `keys.len()` pages: the i-th 4096 bytes of `pages` under `keys[i]`. Split into
    /// requests of at most the node's batch size, sent pipelined.
    pub async fn put_many(
        &self,
        keys: &[PageKey],
        pages: Bytes,
    ) -> Result<Vec<PutOutcome>, ClientError> {
        check_batch(keys.len(), pages.len()).map_err(|_| ClientError::BadLength {
            got: pages.len(),
            expected: keys.len() * PAGE_SIZE,
        })?;
        let max = self.max_batch().await?;
        let requests = runs(keys, max).map(|(pool, range)| {
            let request = Request::Put {
                pool,
                pages: refs(&keys[range.clone()]),
                data: pages.slice(range.start * PAGE_SIZE..range.end * PAGE_SIZE),
            };
            let n = range.len();
            async move {
                match self.request(&request, n).await? {
                    Reply::Put(outcomes) => Ok(outcomes),
                    other => Err(failure(other, Some(pool))),
                }
            }
        });
        let parts = futures::future::try_join_all(requests).await?;
        Ok(parts.into_iter().flatten().collect())
    }

    /// Reads one page; it stays in the pool. A miss is `Ok(None)`.
    pub async fn get(&self, key: PageKey) -> Result<Option<Bytes>, ClientError> {
        Ok(self.read_many(Op::Get, &[key]).await?.pop().flatten())
    }

    /// Reads one page and removes it from the pool (exclusive caching). A miss is
    /// `Ok(None)`. Never retried: a retry could miss a page the first attempt took.
    pub async fn take(&self, key: PageKey) -> Result<Option<Bytes>, ClientError> {
        Ok(self.read_many(Op::Take, &[key]).await?.pop().flatten())
    }

    /// Reads a batch of pages: `None` for each miss.
    pub async fn get_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, ClientError> {
        self.read_many(Op::Get, keys).await
    }

    /// Takes a batch of pages: `None` for each miss.
    pub async fn take_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, ClientError> {
        self.read_many(Op::Take, keys).await
    }

    async fn read_many(&self, op: Op, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, ClientError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let max = self.max_batch().await?;
        let requests = runs(keys, max).map(|(pool, range)| {
            let pages = refs(&keys[range.clone()]);
            let request = if op == Op::Take {
                Request::Take { pool, pages }
            } else {
                Request::Get { pool, pages }
            };
            let n = range.len();
            async move {
                match self.request(&request, n).await? {
                    Reply::Pages { found, data } => {
                        let mut at = 0;
                        Ok(found
                            .into_iter()
                            .map(|hit| {
                                hit.then(|| {
                                    at += PAGE_SIZE;
                                    data.slice(at - PAGE_SIZE..at)
                                })
                            })
                            .collect::<Vec<_>>())
                    }
                    other => Err(failure(other, Some(pool))),
                }
            }
        });
        let parts = futures::future::try_join_all(requests).await?;
        Ok(parts.into_iter().flatten().collect())
    }

    /// The node's counters and those of the pools this client can reach.
    pub async fn stats(&self) -> Result<NodeStats, ClientError> {
        match self.request(&Request::Stats, 0).await? {
            Reply::Stats(entries) => Ok(NodeStats { entries }),
            other => Err(failure(other, None)),
        }
    }

    /// The cluster's members as the node sees them (itself included, flagged `local`);
    /// empty when the node does not gossip. A node too old to know the request answers
    /// [`ClientError::Refused`] with `UNKNOWN_OP`.
    pub async fn members(&self) -> Result<Vec<MemberInfo>, ClientError> {
        match self.request(&Request::Members, 0).await? {
            Reply::Members(members) => Ok(members),
            other => Err(failure(other, None)),
        }
    }

    /// One round trip with nothing to do; returns how long it took.
    pub async fn ping(&self) -> Result<Duration, ClientError> {
        let start = Instant::now();
        match self.request(&Request::Ping, 0).await? {
            Reply::Empty => Ok(start.elapsed()),
            other => Err(failure(other, None)),
        }
    }
}

/// How long a request of `op` may wait for its reply: slow requests (a whole pool or
/// object walked on the node) get `slow_timeout`, never less than `timeout`.
fn timeout_for(config: &ClientConfig, op: Op) -> Duration {
    match op.is_slow() {
        true => config.slow_timeout.max(config.timeout),
        false => config.timeout,
    }
}

/// Splits `keys` into runs of one pool, at most `max` long, in order.
pub(crate) fn runs(
    keys: &[PageKey],
    max: usize,
) -> impl Iterator<Item = (PoolId, std::ops::Range<usize>)> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= keys.len() {
            return None;
        }
        let pool = keys[start].pool;
        let mut end = start + 1;
        while end < keys.len() && end - start < max && keys[end].pool == pool {
            end += 1;
        }
        let run = (pool, start..end);
        start = end;
        Some(run)
    })
}

pub(crate) fn refs(keys: &[PageKey]) -> Vec<PageRef> {
    keys.iter().map(|k| PageRef { object: k.object, index: k.index }).collect()
}

/// The error for a reply that is not the success its request expects.
pub(crate) fn failure(reply: Reply, pool: Option<PoolId>) -> ClientError {
    match reply {
        Reply::Error { status: Status::UnknownPool, message } => match pool {
            Some(pool) => ClientError::UnknownPool(pool),
            None => ClientError::Refused { status: Status::UnknownPool, message },
        },
        Reply::Error { status, message } => ClientError::Refused { status, message },
        other => ClientError::Protocol(format!("unexpected reply {other:?}")),
    }
}

/// The async trait, so an NBD export can cache in nodes exactly as in the in-process
/// engine. Errors become [`StoreError`]s (`Unavailable` for connection failures).
#[async_trait::async_trait]
impl fallow_core::AsyncPageStore for Client {
    async fn create_pool(&self, spec: &PoolSpec) -> Result<PoolId, StoreError> {
        let result = Client::create_pool(self, spec).await;
        // The engine's own error for a mismatch, with the UUID the node's reply leaves out.
        if let (
            Err(ClientError::Refused { status: Status::SharedPoolMismatch, .. }),
            Sharing::Shared { uuid },
        ) = (&result, spec.sharing)
        {
            return Err(StoreError::SharedPoolMismatch { uuid });
        }
        Ok(result?)
    }

    async fn destroy_pool(&self, pool: PoolId) -> Result<(), StoreError> {
        Ok(Client::destroy_pool(self, pool).await?)
    }

    async fn put_many(
        &self,
        keys: &[PageKey],
        pages: Bytes,
    ) -> Result<Vec<PutOutcome>, StoreError> {
        Ok(Client::put_many(self, keys, pages).await?)
    }

    async fn get_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, StoreError> {
        Ok(Client::get_many(self, keys).await?)
    }

    async fn take_many(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, StoreError> {
        Ok(Client::take_many(self, keys).await?)
    }

    async fn invalidate_pages(&self, keys: &[PageKey]) -> Result<(), StoreError> {
        Ok(Client::invalidate_pages(self, keys).await?)
    }

    async fn invalidate_object(&self, pool: PoolId, object: ObjectId) -> Result<u64, StoreError> {
        Ok(Client::invalidate_object(self, pool, object).await?)
    }

    async fn invalidate_pool(&self, pool: PoolId) -> Result<u64, StoreError> {
        Ok(Client::invalidate_pool(self, pool).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fallow_proto::fallow::Session;

    /// The session in the HELLO of the next connection to `listener`, which is then cut
    /// before the handshake goes on.
    async fn hello_session(listener: tokio::net::TcpListener) -> Option<Session> {
        use tokio::io::AsyncReadExt;
        let (mut stream, _) = listener.accept().await.unwrap();
        let mut input = bytes::BytesMut::new();
        loop {
            if let Some(frame) = fallow_proto::fallow::frame::decode(&mut input).unwrap() {
                let Request::Hello(hello) = Request::parse(frame).unwrap() else {
                    panic!("the first request is not HELLO")
                };
                return hello.session;
            }
            assert!(stream.read_buf(&mut input).await.unwrap() > 0, "closed before HELLO");
        }
    }

    /// A client object made for a node in place of one that gave up on requests there
    /// opens its connections in the old one's session, carrying the fence.
    #[tokio::test]
    async fn a_client_made_in_an_old_session_carries_its_fence() {
        let old = Arc::new(Numbering::new());
        let first = old.next();
        old.give_up();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let node = tokio::spawn(hello_session(listener));
        let config = ClientConfig::new(&addr, b"0123456789abcdef0123".to_vec()).unwrap();
        let cut = Client::connect_in(config, old.clone()).await;
        assert!(cut.is_err(), "the fake node never finishes the handshake");
        let session = node.await.unwrap().expect("HELLO carries a session");
        assert_eq!(session.id, first.id, "the same session");
        assert_eq!((session.epoch, session.fence_below), (2, 2), "numbered on, fencing the first");
    }

    /// Regression (issue #5, cluster benchmarks): destroying a pool of a few hundred
    /// thousand pages took longer than the cluster client's 250 ms request timeout, so the
    /// client took three healthy nodes for dead.
    #[test]
    fn slow_requests_wait_for_the_slow_timeout() {
        let config = ClientConfig::new("127.0.0.1:1", b"0123456789abcdef".to_vec())
            .unwrap()
            .timeout(Duration::from_millis(250))
            .slow_timeout(Duration::from_secs(5));
        for op in [Op::DestroyPool, Op::InvalidatePool, Op::InvalidateObject, Op::Stats] {
            assert_eq!(timeout_for(&config, op), Duration::from_secs(5), "{op:?}");
        }
        for op in [Op::Get, Op::Put, Op::Take, Op::InvalidatePages, Op::Ping] {
            assert_eq!(timeout_for(&config, op), Duration::from_millis(250), "{op:?}");
        }
        let config = config.slow_timeout(Duration::from_millis(1));
        assert_eq!(timeout_for(&config, Op::Stats), Duration::from_millis(250));
    }

    #[test]
    fn runs_split_by_pool_and_size() {
        let k = |p, i| PageKey::new(PoolId(p), 0, i);
        let keys = [k(1, 0), k(1, 1), k(1, 2), k(2, 0), k(1, 3)];
        let got: Vec<_> = runs(&keys, 2).collect();
        assert_eq!(
            got,
            vec![(PoolId(1), 0..2), (PoolId(1), 2..3), (PoolId(2), 3..4), (PoolId(1), 4..5)]
        );
        assert_eq!(runs(&[], 2).count(), 0);
    }
}
