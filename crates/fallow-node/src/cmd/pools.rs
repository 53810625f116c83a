//! CREATE_POOL, DESTROY_POOL, INVALIDATE_POOL and INVALIDATE_OBJECT.

use fallow_core::{ObjectId, PageStore, PoolId, PoolSpec};
use fallow_proto::fallow::{Reply, Status};

use super::{reachable, store_failure, Failure};
use crate::clients::{Client, PoolError};
use crate::node::Node;

pub(super) fn create(node: &Node, client: &Client, spec: &PoolSpec) -> Result<Reply, Failure> {
    let max = node.config().max_pools_per_client;
    match client.create_pool(node.engine(), spec, max) {
        Ok(pool) => {
            tracing::debug!(%pool, ?spec, "pool created or attached");
            node.save_state();
            Ok(Reply::Pool(pool))
        }
        Err(PoolError::Store(err)) => Err(store_failure(err)),
        Err(PoolError::TooMany(max)) => Err((
            Status::TooManyPools,
            format!("this client already holds {max} pools, the most a node allows"),
        )),
    }
}

pub(super) fn destroy(node: &Node, client: &Client, pool: PoolId) -> Result<Reply, Failure> {
    client.destroy_pool(node.engine(), pool).map_err(store_failure)?;
    node.save_state();
    Ok(Reply::Empty)
}

pub(super) fn invalidate_pool(
    node: &Node,
    client: &Client,
    pool: PoolId,
) -> Result<Reply, Failure> {
    reachable(client, pool)?;
    node.engine().invalidate_pool(pool).map(Reply::Count).map_err(store_failure)
}

pub(super) fn invalidate_object(
    node: &Node,
    client: &Client,
    pool: PoolId,
    object: ObjectId,
) -> Result<Reply, Failure> {
    reachable(client, pool)?;
    node.engine().invalidate_object(pool, object).map(Reply::Count).map_err(store_failure)
}
