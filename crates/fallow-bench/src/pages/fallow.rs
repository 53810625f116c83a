//! The fallow side of the comparison, through `fallow_client`.
//!
//! One [`fallow_client::Client`] with `connections` connections serves the whole run (it
//! spreads requests over them round-robin), and every run creates a private ephemeral pool
//! of its own, destroyed at the end: so, unlike memcached, a fallow get run hits only
//! after a warm-up. Each request in flight is its own closed loop (a task): a client's
//! methods take `&self`, and pipelining on the socket is the client library's job.
//!
//! Key id `k` is the page `(pool, k >> 10, k & 1023)`: objects of 1024 pages (4 MiB, the
//! backing-object size of DESIGN.md).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use fallow_client::{Client, ClientConfig, ClientError};
use fallow_core::{DedupScope, PageKey, PoolId, PoolSpec, PutOutcome, TrustDomain};
use tokio::task::JoinSet;

use super::report::Stats;
use super::workload::{Op, RequestGen, PAGE};
use super::{PagesError, PagesOptions};

/// How long one request may wait for its reply before the run fails.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The client and the run's pool, shared by every connection of the run.
#[derive(Debug, Clone)]
pub(crate) struct Connection {
    client: Client,
    pool: PoolId,
}

fn client_error(err: ClientError) -> PagesError {
    PagesError::Fallow(err.to_string())
}

impl Connection {
    /// Connects to the node at `addr` (`HOST:PORT` or `unix:PATH`) with
    /// `opts.connections` connections, creates the run's pool, and returns one handle per
    /// connection.
    pub(crate) async fn connect(addr: &str, opts: &PagesOptions) -> Result<Vec<Self>, PagesError> {
        let config = ClientConfig::new(addr, opts.secret.clone())
            .map_err(|e| PagesError::Options(e.to_string()))?
            .connections(opts.connections)
            .timeout(REQUEST_TIMEOUT)
            .name("fallow-bench");
        let client = Client::connect(config).await.map_err(|e| match e {
            ClientError::Connect { source, .. } => {
                PagesError::Connect { target: opts.target.to_string(), source }
            }
            other => client_error(other),
        })?;
        let dedup = if opts.dedup { DedupScope::Domain(TrustDomain(0)) } else { DedupScope::Off };
        let pool =
            client.create_pool(&PoolSpec::ephemeral().dedup(dedup)).await.map_err(client_error)?;
        Ok(vec![Connection { client, pool }; opts.connections])
    }

    /// Destroys the run's pool, so that repeated runs do not fill the node with pages
    /// nobody will read. A failure is ignored: the node drops a departed client's pools
    /// when its lease ends anyway.
    pub(crate) async fn finish(&self) {
        let _ = self.client.destroy_pool(self.pool).await;
    }

    /// Runs each generator as its own closed loop of requests, until `stop` is set or the
    /// generators run out. `timeline`: keep every request's start and latency.
    pub(crate) async fn drive(
        &self,
        gens: Vec<RequestGen>,
        live: Arc<AtomicU64>,
        stop: Arc<AtomicBool>,
        timeline: bool,
    ) -> Result<Stats, PagesError> {
        let mut loops = JoinSet::new();
        for gen in gens {
            let stats = Stats::new(live.clone()).with_timeline(timeline);
            loops.spawn(closed_loop(self.client.clone(), self.pool, gen, stats, stop.clone()));
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

/// One request at a time, each sent when the last is answered.
async fn closed_loop(
    client: Client,
    pool: PoolId,
    mut gen: RequestGen,
    mut stats: Stats,
    stop: Arc<AtomicBool>,
) -> Result<Stats, PagesError> {
    let mut ids = Vec::new();
    let mut keys = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let Some(op) = gen.next(&mut ids) else { break };
        keys.clear();
        keys.extend(ids.iter().map(|&id| page_key(pool, id)));
        match op {
            Op::Get => {
                let start = Instant::now();
                // A batch of one is a plain GET, as a latency-bound caller would send it.
                let pages = match keys[..] {
                    [key] => vec![client.get(key).await.map_err(client_error)?],
                    _ => client.get_many(&keys).await.map_err(client_error)?,
                };
                let (hits, wrong) = tally(&gen, &ids, &pages)?;
                stats.get(start, hits, ids.len() as u64 - hits, wrong);
            }
            Op::Put => {
                let mut buf = BytesMut::with_capacity(ids.len() * PAGE);
                for &id in &ids {
                    gen.values.write(id, &mut buf);
                }
                let pages = buf.freeze();
                let start = Instant::now();
                let outcomes = match keys[..] {
                    [key] => vec![client.put(key, pages).await.map_err(client_error)?],
                    _ => client.put_many(&keys, pages).await.map_err(client_error)?,
                };
                let stored = outcomes.iter().filter(|o| **o == PutOutcome::Stored).count() as u64;
                stats.put(start, stored, ids.len() as u64 - stored);
            }
        }
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
