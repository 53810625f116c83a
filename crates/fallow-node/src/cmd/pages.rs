//! PUT, GET, TAKE and INVALIDATE_PAGES: batches of pages in one pool.

use bytes::BytesMut;
use fallow_core::{HashPutOutcome, PageKey, PageStore, PoolId, PutOutcome};
use fallow_proto::fallow::{encode_pages_with, Op, PageRef, Reply, Status};

use super::{encode_failure, reachable, store_failure, Failure};
use crate::clients::Client;
use crate::metrics::PageEvent;
use crate::node::Node;

fn keys(pool: PoolId, pages: &[PageRef]) -> Vec<PageKey> {
    pages.iter().map(|p| PageKey::new(pool, p.object, p.index)).collect()
}

pub(super) fn put(
    node: &Node,
    client: &Client,
    pool: PoolId,
    pages: &[PageRef],
    data: &[u8],
) -> Result<Reply, Failure> {
    reachable(client, pool)?;
    let outcomes = node.engine().put_many(&keys(pool, pages), data).map_err(store_failure)?;
    let stored = outcomes.iter().filter(|o| **o == PutOutcome::Stored).count() as u64;
    let metrics = node.metrics();
    metrics.pages(Op::Put, PageEvent::Stored, stored);
    metrics.pages(Op::Put, PageEvent::Refused, outcomes.len() as u64 - stored);
    Ok(Reply::Put(outcomes))
}

/// PUT_HASHES: pages named by content hash, stored where this node holds the content.
pub(super) fn put_hashes(
    node: &Node,
    client: &Client,
    pool: PoolId,
    pages: &[PageRef],
    contents: &[(u128, u32)],
) -> Result<Reply, Failure> {
    reachable(client, pool)?;
    let outcomes =
        node.engine().put_many_by_hash(&keys(pool, pages), contents).map_err(store_failure)?;
    let count = |want: fn(&HashPutOutcome) -> bool| outcomes.iter().filter(|o| want(o)).count();
    let metrics = node.metrics();
    metrics.pages(Op::PutHashes, PageEvent::Stored, count(|o| *o == HashPutOutcome::Stored) as u64);
    metrics.pages(Op::PutHashes, PageEvent::Miss, count(|o| *o == HashPutOutcome::NotHeld) as u64);
    let refused = count(|o| matches!(o, HashPutOutcome::NotStored(_)));
    metrics.pages(Op::PutHashes, PageEvent::Refused, refused as u64);
    Ok(Reply::PutHashes(outcomes))
}

/// GET or TAKE, with the pages copied from the pool straight into `out`.
pub(super) fn read(
    node: &Node,
    client: &Client,
    op: Op,
    pool: PoolId,
    pages: &[PageRef],
    id: u64,
    out: &mut BytesMut,
) -> Status {
    if let Err(failure) = reachable(client, pool) {
        encode_failure(out, op, id, &failure);
        return failure.0;
    }
    let keys = keys(pool, pages);
    let engine = node.engine();
    let mut hits = 0;
    let written = encode_pages_with(out, op, id, keys.len(), |buf| {
        let lookups =
            if op == Op::Take { engine.take_many(&keys, buf) } else { engine.get_many(&keys, buf) };
        lookups.map(|found| {
            let found: Vec<bool> = found.into_iter().map(|l| l.is_hit()).collect();
            hits = found.iter().filter(|f| **f).count() as u64;
            found
        })
    });
    match written {
        Ok(()) => {
            let metrics = node.metrics();
            metrics.pages(op, PageEvent::Hit, hits);
            metrics.pages(op, PageEvent::Miss, keys.len() as u64 - hits);
            Status::Ok
        }
        Err(err) => {
            let failure = store_failure(err);
            encode_failure(out, op, id, &failure);
            failure.0
        }
    }
}

pub(super) fn invalidate(
    node: &Node,
    client: &Client,
    pool: PoolId,
    pages: &[PageRef],
) -> Result<Reply, Failure> {
    reachable(client, pool)?;
    for key in keys(pool, pages) {
        node.engine().invalidate_page(key).map_err(store_failure)?;
    }
    Ok(Reply::Empty)
}
