//! The in-process engine, a remote node and a one-node cluster behave the same through
//! `AsyncPageStore`, the trait an NBD export uses to cache in any of them. (Persistent
//! pools of a cluster keep two copies, so a one-node cluster is compared with an
//! ephemeral pool, well within its budget: nothing is evicted.)

use fallow_testkit::node as support;

use bytes::Bytes;
use fallow_core::{AsyncPageStore, PageKey, PoolSpec, PutOutcome, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};
use support::{page, TestNode};

async fn exercise(store: &dyn AsyncPageStore, spec: &PoolSpec) -> Vec<String> {
    let mut log = Vec::new();
    let pool = store.create_pool(spec).await.unwrap();
    let keys: Vec<PageKey> = (0..5).map(|i| PageKey::new(pool, 1, i)).collect();
    let data: Vec<u8> = (0..5).flat_map(page).collect();
    let outcomes = store.put_many(&keys, Bytes::from(data.clone())).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
    let mut probe = keys.clone();
    probe.push(PageKey::new(pool, 1, 99));
    let got = store.get_many(&probe).await.unwrap();
    for (i, page) in got.iter().enumerate().take(5) {
        assert_eq!(page.as_deref(), Some(&data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]));
    }
    log.push(format!("get {:?}", got.iter().map(Option::is_some).collect::<Vec<_>>()));
    let taken = store.take_many(&keys[..2]).await.unwrap();
    log.push(format!("take {:?}", taken.iter().map(Option::is_some).collect::<Vec<_>>()));
    store.invalidate_pages(&keys[2..3]).await.unwrap();
    let got = store.get_many(&keys).await.unwrap();
    log.push(format!("after {:?}", got.iter().map(Option::is_some).collect::<Vec<_>>()));
    log.push(format!("object {}", store.invalidate_object(pool, 1).await.unwrap()));
    let _ = store.put_many(&keys[..1], Bytes::from(page(7))).await.unwrap();
    log.push(format!("pool {}", store.invalidate_pool(pool).await.unwrap()));
    store.destroy_pool(pool).await.unwrap();
    log.push(format!("destroyed {}", store.get_many(&keys[..1]).await.is_err()));
    log
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_and_remote_node_agree() {
    let engine = Engine::new(EngineBuilder::new(16 << 20).compress_interval(None).build().unwrap());
    let local = exercise(&engine, &PoolSpec::persistent()).await;
    let node = TestNode::start();
    let client = fallow_client::Client::connect(node.config()).await.unwrap();
    let remote = exercise(&client, &PoolSpec::persistent()).await;
    assert_eq!(local, remote);
    assert_eq!(exercise(&engine, &PoolSpec::ephemeral()).await, local);
    // A cluster client of a one-node cluster (ephemeral: persistent puts need two nodes).
    let config =
        fallow_client::ClusterClientConfig::new(&node.addr.to_string(), support::SECRET.to_vec())
            .unwrap()
            .per_node(|c| c.timeout(std::time::Duration::from_secs(10)));
    let cluster = fallow_client::ClusterClient::connect(config).await.unwrap();
    assert_eq!(exercise(&cluster, &PoolSpec::ephemeral()).await, local);
    assert_eq!(
        local,
        [
            "get [true, true, true, true, true, false]",
            "take [true, true]",
            "after [false, false, false, true, true]",
            "object 2",
            "pool 1",
            "destroyed true"
        ]
    );
}
