//! One function per request type, called once a connection is authenticated. Each
//! checks that the client may reach the pool it names, calls the engine, and appends one
//! reply frame. The handshake (HELLO, AUTH) is in [`handshake`]. Requests on cluster pools
//! never come here: the connection hands them to `crate::forward`.

pub(crate) mod handshake;
mod members;
mod pages;
mod pools;
mod stats;

use bytes::BytesMut;
use fallow_core::{PoolId, StoreError};
use fallow_proto::fallow::{encode_error, Op, Reply, Request, Status};

use crate::clients::Client;
use crate::node::Node;

/// True for requests that may take long (they walk a whole pool or object, or every
/// counter): they run on a blocking thread so that page requests pipelined behind them
/// are answered first. That is where replies leave out of order.
pub(crate) fn is_slow(request: &Request) -> bool {
    request.op().is_slow()
}

/// Executes an authenticated request and appends its reply to `out`. Returns the status
/// sent.
pub(crate) fn execute(
    node: &Node,
    client: &Client,
    request: Request,
    id: u64,
    out: &mut BytesMut,
) -> Status {
    let op = request.op();
    let result = match request {
        Request::Hello(_) | Request::Auth { .. } => {
            Err((Status::Malformed, "HELLO and AUTH are sent once, first".to_string()))
        }
        Request::Ping => Ok(Reply::Empty),
        Request::Stats => Ok(stats::collect(node, client)),
        Request::Members => Ok(members::list(node)),
        Request::CreatePool(spec) => pools::create(node, client, &spec),
        // The connection hands these to `forward::execute` (they wait on other nodes).
        Request::CreateClusterPool(_) => {
            Err((Status::Internal, "cluster pools are served by the forwarder".to_string()))
        }
        Request::DestroyPool(pool) => pools::destroy(node, client, pool),
        Request::InvalidatePool(pool) => pools::invalidate_pool(node, client, pool),
        Request::InvalidateObject { pool, object } => {
            pools::invalidate_object(node, client, pool, object)
        }
        Request::InvalidatePages { pool, pages } => pages::invalidate(node, client, pool, &pages),
        Request::Put { pool, pages, data } => pages::put(node, client, pool, &pages, &data),
        Request::PutHashes { pool, pages, contents } => {
            pages::put_hashes(node, client, pool, &pages, &contents)
        }
        Request::ContentSummary { offset } => {
            Ok(Reply::Summary(node.summaries().piece(node.engine(), offset)))
        }
        Request::Get { pool, pages } | Request::Take { pool, pages } => {
            // Written in place: the pool's pages go straight into the output buffer.
            return pages::read(node, client, op, pool, &pages, id, out);
        }
    };
    match result {
        Ok(reply) => {
            reply.encode(op, id, out);
            Status::Ok
        }
        Err((status, message)) => {
            encode_error(out, op as u8, id, status, &message);
            status
        }
    }
}

/// A failed request: the status to send and a message for the client's logs.
pub(crate) type Failure = (Status, String);

/// The status and message for an engine error.
fn store_failure(err: StoreError) -> Failure {
    let status = match err {
        StoreError::UnknownPool(_) => Status::UnknownPool,
        StoreError::BadLength { .. } => Status::Malformed,
        StoreError::SharedPoolMismatch { .. } => Status::SharedPoolMismatch,
        StoreError::InvalidSpec(_) => Status::InvalidSpec,
        StoreError::TooManyPools => Status::TooManyPools,
        StoreError::Unavailable(_) => Status::Internal,
    };
    (status, err.to_string())
}

/// Checks that `client` may reach `pool`. A pool of another client reads exactly like one
/// that does not exist, so probing ids reveals nothing.
fn reachable(client: &Client, pool: PoolId) -> Result<(), Failure> {
    if client.can_reach(pool) {
        Ok(())
    } else {
        Err(store_failure(StoreError::UnknownPool(pool)))
    }
}

/// Encodes the reply for a request whose op is known.
pub(crate) fn encode_failure(out: &mut BytesMut, op: Op, id: u64, failure: &Failure) {
    encode_error(out, op as u8, id, failure.0, &failure.1);
}
