//! The fallow side of the comparison, through `fallow_client`.
//!
//! One [`fallow_client::Client`] with `connections` connections serves the whole run (it
//! spreads requests over them round-robin), or one [`ClusterClient`] with `connections`
//! connections to each node; every run creates a private ephemeral pool of its own,
//! destroyed at the end: so, unlike memcached, a fallow get run hits only after a warm-up.
//! Each request in flight is its own closed loop (a task): a client's methods take
//! `&self`, and pipelining on the socket is the client library's job.
//!
//! Through the cluster client a failed request is counted and the loop goes on (an
//! ephemeral pool should turn every node failure into misses: an error is a finding);
//! through one node it ends the run, as before.
//!
//! Key id `k` is the page `(pool, k >> 10, k & 1023)`: objects of 1024 pages (4 MiB, the
//! backing-object size of DESIGN.md).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use fallow_client::{Client, ClientConfig, ClientError, ClusterClient, ClusterClientConfig};
use fallow_core::{DedupScope, PageKey, PoolId, PoolSpec, PutOutcome, TrustDomain};
use tokio::task::JoinSet;

use super::cluster::{self, ClusterSnapshot, NodeEvent, Watcher};
use super::report::Stats;
use super::workload::{Op, RequestGen, PAGE};
use super::{PagesError, PagesOptions, Target};

/// How long one request may wait for its reply before the run fails.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// One node's client, or a cluster's.
#[derive(Debug, Clone)]
enum Store {
    Node(Client),
    Cluster(ClusterClient, Arc<Watcher>),
}

impl Store {
    async fn get(&self, keys: &[PageKey]) -> Result<Vec<Option<Bytes>>, PagesError> {
        match self {
            // A batch of one is a plain GET, as a latency-bound caller would send it.
            Store::Node(c) => match keys {
                [key] => Ok(vec![c.get(*key).await.map_err(client_error)?]),
                _ => c.get_many(keys).await.map_err(client_error),
            },
            Store::Cluster(c, _) => c.get_many(keys).await.map_err(cluster_error),
        }
    }

    async fn put(&self, keys: &[PageKey], pages: Bytes) -> Result<Vec<PutOutcome>, PagesError> {
        match self {
            Store::Node(c) => match keys {
                [key] => Ok(vec![c.put(*key, pages).await.map_err(client_error)?]),
                _ => c.put_many(keys, pages).await.map_err(client_error),
            },
            Store::Cluster(c, _) => c.put_many(keys, pages).await.map_err(cluster_error),
        }
    }
}

/// The client and the run's pool, shared by every connection of the run.
#[derive(Debug, Clone)]
pub(crate) struct Connection {
    store: Store,
    pool: PoolId,
}

fn client_error(err: ClientError) -> PagesError {
    PagesError::Fallow(err.to_string())
}

fn cluster_error(err: fallow_client::ClusterError) -> PagesError {
    PagesError::Fallow(err.to_string())
}

impl Connection {
    /// Connects to the node at `addr` (`HOST:PORT` or `unix:PATH`) with
    /// `opts.connections` connections, or to the cluster through the seeds `addr` (with
    /// `opts.connections` to each node), creates the run's pool, and returns one handle per
    /// connection.
    pub(crate) async fn connect(addr: &str, opts: &PagesOptions) -> Result<Vec<Self>, PagesError> {
        let dedup = if opts.dedup { DedupScope::Domain(TrustDomain(0)) } else { DedupScope::Off };
        let kind = if opts.persistent { PoolSpec::persistent() } else { PoolSpec::ephemeral() };
        let spec = kind.dedup(dedup);
        let connect_failed = |e: ClientError| match e {
            ClientError::Connect { source, .. } => {
                PagesError::Connect { target: opts.target.to_string(), source }
            }
            other => client_error(other),
        };
        let (store, pool) = if let Target::Cluster { .. } = opts.target {
            // The cluster client's own timeouts (250 ms by default) are what is measured:
            // they decide how a node's failure shows.
            let config = ClusterClientConfig::new(addr, opts.secret.clone())
                .map_err(|e| PagesError::Options(e.to_string()))?
                .per_node(|c| {
                    c.connections(opts.connections).name("fallow-bench").tls(opts.tls.clone())
                });
            let client = ClusterClient::connect(config).await.map_err(|e| match e {
                fallow_client::ClusterError::NoNodeReachable(e) => connect_failed(e),
                other => cluster_error(other),
            })?;
            let pool = client.create_pool(&spec).await.map_err(cluster_error)?;
            let watcher = Arc::new(Watcher::start(client.clone()));
            (Store::Cluster(client, watcher), pool)
        } else {
            let config = ClientConfig::new(addr, opts.secret.clone())
                .map_err(|e| PagesError::Options(e.to_string()))?
                .connections(opts.connections)
                .timeout(REQUEST_TIMEOUT)
                .name("fallow-bench")
                .tls(opts.tls.clone());
            let client = Client::connect(config).await.map_err(connect_failed)?;
            let pool = client.create_pool(&spec).await.map_err(client_error)?;
            (Store::Node(client), pool)
        };
        Ok(vec![Connection { store, pool }; opts.connections])
    }

    /// The cluster client now (`None` for one node).
    pub(crate) fn snapshot(&self) -> Option<ClusterSnapshot> {
        match &self.store {
            Store::Node(_) => None,
            Store::Cluster(c, _) => Some(cluster::snapshot(c)),
        }
    }

    /// The node state changes the cluster client went through so far.
    pub(crate) fn events(&self) -> Vec<NodeEvent> {
        match &self.store {
            Store::Node(_) => Vec::new(),
            Store::Cluster(_, watcher) => watcher.events(),
        }
    }

    /// Destroys the run's pool, so that repeated runs do not fill the node with pages
    /// nobody will read. A failure is ignored: the node drops a departed client's pools
    /// when its lease ends anyway.
    pub(crate) async fn finish(&self) {
        let _ = match &self.store {
            Store::Node(c) => c.destroy_pool(self.pool).await.map_err(client_error),
            Store::Cluster(c, _) => c.destroy_pool(self.pool).await.map_err(cluster_error),
        };
    }

    /// Runs each generator as its own closed loop of requests, until `stop` is set or the
    /// generators run out. `timeline`: keep every request's start and latency. `every`:
    /// each loop sends at most one request per this interval.
    pub(crate) async fn drive(
        &self,
        gens: Vec<RequestGen>,
        live: Arc<AtomicU64>,
        stop: Arc<AtomicBool>,
        timeline: bool,
        every: Option<Duration>,
    ) -> Result<Stats, PagesError> {
        let mut loops = JoinSet::new();
        for gen in gens {
            let stats = Stats::new(live.clone()).with_timeline(timeline);
            let (store, pool, stop) = (self.store.clone(), self.pool, stop.clone());
            loops.spawn(closed_loop(store, pool, gen, stats, stop, every));
        }
        let mut total = Stats::new(live);
        let mut failure = None;
        while let Some(joined) = loops.join_next().await {
            match joined {
                Ok(Ok(stats)) => total.merge(&stats),
                Ok(Err(e)) => {
                    stop.store(true, Ordering::Relaxed);
                    failure.get_or_insert(e);
                }
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    failure.get_or_insert(PagesError::Fallow(format!("request loop failed: {e}")));
                }
            }
        }
        failure.map_or(Ok(total), Err)
    }
}

fn page_key(pool: PoolId, id: u64) -> PageKey {
    PageKey::new(pool, id >> 10, id & 1023)
}

/// One request at a time, each sent when the last is answered (and, with `every`, not
/// before its slot: one per `every`; a loop that fell behind does not catch up in a burst).
async fn closed_loop(
    store: Store,
    pool: PoolId,
    mut gen: RequestGen,
    mut stats: Stats,
    stop: Arc<AtomicBool>,
    every: Option<Duration>,
) -> Result<Stats, PagesError> {
    let mut ids = Vec::new();
    let mut keys = Vec::new();
    let mut slot = Instant::now();
    // Through a cluster an error is counted and the load goes on (see the module doc).
    let keep_going = matches!(store, Store::Cluster(..));
    while !stop.load(Ordering::Relaxed) {
        let Some(op) = gen.next(&mut ids) else { break };
        if let Some(every) = every {
            let now = Instant::now();
            if slot > now {
                tokio::time::sleep_until(slot.into()).await;
            } else {
                slot = now;
            }
            slot += every;
        }
        keys.clear();
        keys.extend(ids.iter().map(|&id| page_key(pool, id)));
        let start = Instant::now();
        let failed = match op {
            Op::Get => match store.get(&keys).await {
                Ok(pages) => {
                    let (hits, wrong) = tally(&gen, &ids, &pages)?;
                    stats.get(start, hits, ids.len() as u64 - hits, wrong);
                    None
                }
                Err(e) => Some(e),
            },
            Op::Put => {
                let mut buf = BytesMut::with_capacity(ids.len() * PAGE);
                for &id in &ids {
                    gen.values.write(id, &mut buf);
                }
                // The page is built before the clock starts: only the request is timed.
                let start = Instant::now();
                match store.put(&keys, buf.freeze()).await {
                    Ok(outcomes) => {
                        let stored =
                            outcomes.iter().filter(|o| **o == PutOutcome::Stored).count() as u64;
                        stats.put(start, stored, ids.len() as u64 - stored);
                        None
                    }
                    Err(e) => Some(e),
                }
            }
        };
        match failed {
            Some(e) if keep_going => stats.error(&e),
            Some(e) => return Err(e),
            None => {}
        }
        // A request answered without any I/O (the cluster client refuses a put or misses
        // a get locally while its node is down) never yields: without this the loops would
        // spin through their keys and starve the client's own refresh, which brings the
        // node back, on a single-threaded runtime.
        tokio::task::coop::consume_budget().await;
    }
    Ok(stats)
}

/// Counts the hits of a get and the hits with the wrong bytes.
fn tally(gen: &RequestGen, ids: &[u64], pages: &[Option<Bytes>]) -> Result<(u64, u64), PagesError> {
    if pages.len() != ids.len() {
        return Err(PagesError::Fallow(format!(
            "{} pages for a get of {}",
            pages.len(),
            ids.len()
        )));
    }
    let (mut hits, mut wrong) = (0, 0);
    for (&id, page) in ids.iter().zip(pages) {
        if let Some(page) = page {
            hits += 1;
            if !gen.values.check(id, page) {
                wrong += 1;
            }
        }
    }
    Ok((hits, wrong))
}
