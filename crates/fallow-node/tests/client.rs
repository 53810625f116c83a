//! The client library against a real node over TCP and a Unix socket: every operation,
//! the model-based property test through the `PageStore` trait, isolation of private
//! pools, shared pools, authentication, reconnects and leases.

use fallow_testkit::node as support;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use fallow_client::{BlockingClient, Client, ClientConfig, ClientError};
use fallow_core::{
    Lookup, NotStored, PageKey, PageStore, PoolId, PoolSpec, PutOutcome, StoreError, PAGE_SIZE,
};
use proptest::prelude::*;
use support::{page, CutProxy, HoldProxy, Options, TestNode, SECRET};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_over_the_wire() {
    let node = TestNode::start();
    let client = Client::connect(node.config()).await.unwrap();
    let pool = client.create_pool(&PoolSpec::persistent()).await.unwrap();
    let key = |o, i| PageKey::new(pool, o, i);

    assert_eq!(client.put(key(1, 0), Bytes::from(page(1))).await.unwrap(), PutOutcome::Stored);
    assert_eq!(client.get(key(1, 0)).await.unwrap().as_deref(), Some(&page(1)[..]));
    assert_eq!(client.get(key(1, 1)).await.unwrap(), None, "a miss is Ok(None)");

    // A batch larger than the node's limit is split and pipelined by the client.
    let keys: Vec<PageKey> = (0..600).map(|i| key(2, i)).collect();
    let data: Vec<u8> = (0..600).flat_map(page).collect();
    let outcomes = client.put_many(&keys, Bytes::from(data.clone())).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
    let got = client.get_many(&keys).await.unwrap();
    for (i, page) in got.iter().enumerate() {
        assert_eq!(page.as_deref(), Some(&data[i * PAGE_SIZE..(i + 1) * PAGE_SIZE]), "page {i}");
    }

    // take removes; invalidate page, object, pool.
    assert!(client.take(key(1, 0)).await.unwrap().is_some());
    assert_eq!(client.get(key(1, 0)).await.unwrap(), None);
    client.invalidate_page(key(2, 0)).await.unwrap();
    assert_eq!(client.get(key(2, 0)).await.unwrap(), None);
    assert_eq!(client.invalidate_object(pool, 2).await.unwrap(), 599);
    let _ = client.put(key(3, 0), Bytes::from(page(3))).await.unwrap();
    assert_eq!(client.invalidate_pool(pool).await.unwrap(), 1);

    // Stats name this client's pool; ping works; destroy makes the pool unknown.
    let _ = client.put(key(4, 0), Bytes::from(page(4))).await.unwrap();
    let stats = client.stats().await.unwrap();
    assert_eq!(stats.pool(pool, "pages"), Some(1));
    assert_eq!(stats.pools(), vec![pool]);
    assert!(stats.get("lent_bytes").unwrap() >= 64 << 20);
    assert_eq!(stats.get("discarded_bytes"), Some(0), "nothing compressed, nothing discarded");
    assert_eq!(stats.get("compressed_space_bytes"), Some(0), "no slab for compressed pages");
    assert_eq!(stats.get("eviction_small_share_percent"), Some(10), "the default policy's start");
    client.ping().await.unwrap();
    client.destroy_pool(pool).await.unwrap();
    assert!(matches!(client.get(key(4, 0)).await, Err(ClientError::UnknownPool(p)) if p == pool));
    assert!(matches!(
        client.put(key(4, 0), Bytes::from(vec![0u8; 100])).await,
        Err(ClientError::BadLength { got: 100, expected: 4096 })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_serves_the_same_protocol() {
    let node = TestNode::with(Options { unix: true, ..Options::default() });
    let path = node.unix.clone().unwrap();
    let config = ClientConfig::new(&format!("unix:{}", path.display()), SECRET.to_vec()).unwrap();
    let client = Client::connect(config).await.unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral()).await.unwrap();
    let _ = client.put(PageKey::new(pool, 0, 0), Bytes::from(page(9))).await.unwrap();
    assert!(client.get(PageKey::new(pool, 0, 0)).await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_pools_are_invisible_to_other_clients() {
    let node = TestNode::start();
    let a = Client::connect(node.config()).await.unwrap();
    let b = Client::connect(node.config()).await.unwrap();
    let pa = a.create_pool(&PoolSpec::persistent()).await.unwrap();
    let pb = b.create_pool(&PoolSpec::persistent()).await.unwrap();
    assert_ne!(pa, pb);
    let _ = a.put(PageKey::new(pa, 1, 1), Bytes::from(page(1))).await.unwrap();
    // b names a's pool: it reads exactly like a pool that does not exist.
    for result in [
        b.get(PageKey::new(pa, 1, 1)).await.map(|_| ()),
        b.put(PageKey::new(pa, 1, 1), Bytes::from(page(2))).await.map(|_| ()),
        b.invalidate_pool(pa).await.map(|_| ()),
        b.destroy_pool(pa).await,
    ] {
        assert!(matches!(result, Err(ClientError::UnknownPool(p)) if p == pa), "{result:?}");
    }
    assert_eq!(b.stats().await.unwrap().pools(), vec![pb], "stats show only b's pools");
    assert_eq!(a.get(PageKey::new(pa, 1, 1)).await.unwrap().as_deref(), Some(&page(1)[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_pool_is_reached_by_presenting_its_uuid() {
    let node = TestNode::start();
    let uuid = 0x5eed_u128 << 64 | 42;
    let spec = PoolSpec::persistent().shared(uuid);
    let a = Client::connect(node.config()).await.unwrap();
    let b = Client::connect(node.config()).await.unwrap();
    let pool = a.create_pool(&spec).await.unwrap();
    let _ = a.put(PageKey::new(pool, 7, 7), Bytes::from(page(77))).await.unwrap();
    // b cannot use the id before presenting the UUID...
    assert!(matches!(b.get(PageKey::new(pool, 7, 7)).await, Err(ClientError::UnknownPool(_))));
    // ...and reaches the same pool after.
    assert_eq!(b.create_pool(&spec).await.unwrap(), pool);
    assert_eq!(b.get(PageKey::new(pool, 7, 7)).await.unwrap().as_deref(), Some(&page(77)[..]));
    // Other options under the same UUID are refused.
    let err = b.create_pool(&PoolSpec::ephemeral().shared(uuid)).await.unwrap_err();
    assert!(matches!(err, ClientError::Refused { .. }), "{err}");
    // The pool lives until its last user detaches.
    a.destroy_pool(pool).await.unwrap();
    assert!(b.get(PageKey::new(pool, 7, 7)).await.unwrap().is_some());
    b.destroy_pool(pool).await.unwrap();
    let c = Client::connect(node.config()).await.unwrap();
    let again = c.create_pool(&spec).await.unwrap();
    assert_ne!(again, pool, "a new pool: the old one was destroyed with its pages");
    assert_eq!(c.get(PageKey::new(again, 7, 7)).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused_and_reaches_nothing() {
    let node = TestNode::start();
    let config =
        ClientConfig::new(&node.addr.to_string(), b"not-the-secret-at-all".to_vec()).unwrap();
    let err = Client::connect(config).await.unwrap_err();
    assert!(matches!(err, ClientError::AuthFailed), "{err}");
    assert_eq!(node.node.metrics().rejections("auth_failed"), 1);
    assert_eq!(node.node.clients().len(), 0, "nothing was registered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_pools_survive_a_reconnect_and_expire_with_the_lease() {
    let node =
        TestNode::with(Options { client_lease: Duration::from_millis(300), ..Options::default() });
    let id = 0xabcdef_u128;
    let first = Client::connect(node.config().client_id(id)).await.unwrap();
    let pool = first.create_pool(&PoolSpec::persistent()).await.unwrap();
    let _ = first.put(PageKey::new(pool, 1, 1), Bytes::from(page(5))).await.unwrap();
    drop(first);
    // A new connection with the same client id, within the lease, finds the pool.
    let second = Client::connect(node.config().client_id(id)).await.unwrap();
    assert!(second.get(PageKey::new(pool, 1, 1)).await.unwrap().is_some());
    drop(second);
    // Once no connection has been open for the lease, the pool is destroyed.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while node.node.engine().pool_stats(pool).is_ok() {
        assert!(std::time::Instant::now() < deadline, "lease never expired");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let third = Client::connect(node.config().client_id(id)).await.unwrap();
    assert!(matches!(third.get(PageKey::new(pool, 1, 1)).await, Err(ClientError::UnknownPool(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_requests_in_flight_on_few_connections() {
    let node = TestNode::start();
    let client = Client::connect(node.config().connections(2)).await.unwrap();
    let pool = client.create_pool(&PoolSpec::persistent()).await.unwrap();
    let puts = (0..200u64).map(|i| {
        let client = client.clone();
        async move { client.put(PageKey::new(pool, 0, i), Bytes::from(page(i))).await }
    });
    for outcome in futures::future::join_all(puts).await {
        assert_eq!(outcome.unwrap(), PutOutcome::Stored);
    }
    let gets = (0..200u64).map(|i| {
        let client = client.clone();
        async move { (i, client.get(PageKey::new(pool, 0, i)).await) }
    });
    for (i, got) in futures::future::join_all(gets).await {
        assert_eq!(got.unwrap().as_deref(), Some(&page(i)[..]), "page {i}");
    }
}

/// A client through the proxy at `proxy` with request timeout `timeout`, and a key of a
/// persistent pool that holds `page(seed)`.
fn through_proxy(
    proxy: std::net::SocketAddr,
    timeout: Duration,
    seed: u64,
) -> (BlockingClient, PageKey) {
    let config = ClientConfig::new(&proxy.to_string(), SECRET.to_vec()).unwrap().timeout(timeout);
    let client = BlockingClient::connect(config).unwrap();
    let pool = client.create_pool(&PoolSpec::persistent()).unwrap();
    let key = PageKey::new(pool, 1, 2);
    assert_eq!(client.put(key, &page(seed)).unwrap(), PutOutcome::Stored);
    (client, key)
}

#[test]
fn a_cut_connection_is_reopened_and_finds_the_same_pools() {
    let node = TestNode::start();
    let proxy = CutProxy::start(node.addr);
    let (client, key) = through_proxy(proxy.addr, Duration::from_secs(5), 12);
    proxy.cut();
    // The next request finds the connection dead, reconnects (same client id), and the
    // private pool is still there.
    let mut out = vec![0u8; PAGE_SIZE];
    assert_eq!(client.get(key, &mut out).unwrap(), Lookup::Hit);
    assert_eq!(out, page(12));
}

/// A PUT the client gave up on reaches the node late, after the client's next PUT of the
/// page (a proxy holds it back, as a stalled network or a starved node would): the
/// connection that carried the next PUT fenced the old one, so the late PUT never runs
/// and the page keeps the newer data.
#[test]
fn a_put_given_up_on_never_overwrites_a_later_put() {
    let node = TestNode::start();
    let proxy = HoldProxy::start(node.addr);
    let (client, key) = through_proxy(proxy.addr, Duration::from_millis(300), 1);
    proxy.hold();
    let err = client.put(key, &page(2)).unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "the held put times out: {err:?}");
    proxy.pass();
    assert_eq!(client.put(key, &page(3)).unwrap(), PutOutcome::Stored);
    assert_eq!(proxy.release(), 1, "the put given up on was held");
    let mut out = vec![0u8; PAGE_SIZE];
    assert_eq!(client.get(key, &mut out).unwrap(), Lookup::Hit);
    assert!(out == page(3), "the late put overwrote the later one ({})", out == page(2));
    let counted = || node.node.metrics().fenced_connections.get() == 1;
    assert!(fallow_testkit::process::poll_until(Duration::from_secs(5), counted));
}

#[test]
fn a_node_that_went_away_gives_typed_errors() {
    let node = TestNode::start();
    let client = BlockingClient::connect(node.config().timeout(Duration::from_secs(2))).unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral()).unwrap();
    drop(node);
    let err = client.put(PageKey::new(pool, 0, 0), &page(0)).unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    let err = client.get(PageKey::new(pool, 0, 0), &mut [0; 10]).unwrap_err();
    assert!(matches!(err, StoreError::BadLength { got: 10, .. }), "{err:?}");
}

/// Every operation through the `PageStore` trait, against a `BTreeMap` model: exact for
/// the persistent pool; for the ephemeral pool a hit must return the last page put (the
/// node may drop pages, never return wrong ones).
#[derive(Debug, Clone)]
enum Step {
    Put { persistent: bool, object: u64, index: u64, seed: u64 },
    Get { persistent: bool, object: u64, index: u64 },
    Take { persistent: bool, object: u64, index: u64 },
    InvalidatePage { persistent: bool, object: u64, index: u64 },
    InvalidateObject { persistent: bool, object: u64 },
    InvalidatePool { persistent: bool },
    PutMany { persistent: bool, object: u64, seeds: Vec<u64> },
    GetMany { persistent: bool, object: u64, count: u64 },
}

fn step() -> impl Strategy<Value = Step> {
    let p = any::<bool>();
    let o = 0u64..3;
    let i = 0u64..6;
    prop_oneof![
        4 => (p, o.clone(), i.clone(), 0u64..4).prop_map(|(persistent, object, index, seed)| Step::Put { persistent, object, index, seed }),
        3 => (p, o.clone(), i.clone()).prop_map(|(persistent, object, index)| Step::Get { persistent, object, index }),
        1 => (p, o.clone(), i.clone()).prop_map(|(persistent, object, index)| Step::Take { persistent, object, index }),
        1 => (p, o.clone(), i.clone()).prop_map(|(persistent, object, index)| Step::InvalidatePage { persistent, object, index }),
        1 => (p, o.clone()).prop_map(|(persistent, object)| Step::InvalidateObject { persistent, object }),
        1 => p.prop_map(|persistent| Step::InvalidatePool { persistent }),
        1 => (p, o.clone(), prop::collection::vec(0u64..4, 1..6)).prop_map(|(persistent, object, seeds)| Step::PutMany { persistent, object, seeds }),
        1 => (p, o, 1u64..6).prop_map(|(persistent, object, count)| Step::GetMany { persistent, object, count }),
    ]
}

type Model = BTreeMap<(bool, u64, u64), u64>;

fn check_read(model: &Model, k: (bool, u64, u64), lookup: Lookup, out: &[u8]) {
    match (model.get(&k), lookup) {
        (Some(seed), Lookup::Hit) => assert_eq!(out, &page(*seed)[..], "{k:?}: wrong bytes"),
        (Some(_), Lookup::Miss) => assert!(!k.0, "{k:?}: a persistent page was lost"),
        (None, Lookup::Hit) => panic!("{k:?}: a hit on a page never put or invalidated"),
        (None, Lookup::Miss) => {}
    }
}

fn run(store: &dyn PageStore, pools: [PoolId; 2], steps: &[Step]) {
    let pool = |persistent: bool| pools[persistent as usize];
    let mut model = Model::new();
    let mut out = vec![0u8; PAGE_SIZE];
    for step in steps {
        match step.clone() {
            Step::Put { persistent, object, index, seed } => {
                let outcome =
                    store.put(PageKey::new(pool(persistent), object, index), &page(seed)).unwrap();
                match outcome {
                    PutOutcome::Stored => model.insert((persistent, object, index), seed),
                    PutOutcome::NotStored(NotStored::Full | NotStored::OverQuota) => {
                        model.remove(&(persistent, object, index))
                    }
                };
            }
            Step::Get { persistent, object, index } => {
                let lookup =
                    store.get(PageKey::new(pool(persistent), object, index), &mut out).unwrap();
                check_read(&model, (persistent, object, index), lookup, &out);
            }
            Step::Take { persistent, object, index } => {
                let lookup =
                    store.take(PageKey::new(pool(persistent), object, index), &mut out).unwrap();
                check_read(&model, (persistent, object, index), lookup, &out);
                model.remove(&(persistent, object, index));
            }
            Step::InvalidatePage { persistent, object, index } => {
                store.invalidate_page(PageKey::new(pool(persistent), object, index)).unwrap();
                model.remove(&(persistent, object, index));
            }
            Step::InvalidateObject { persistent, object } => {
                let removed = store.invalidate_object(pool(persistent), object).unwrap();
                let before = model.len();
                model.retain(|k, _| !(k.0 == persistent && k.1 == object));
                if persistent {
                    assert_eq!(removed as usize, before - model.len());
                }
            }
            Step::InvalidatePool { persistent } => {
                store.invalidate_pool(pool(persistent)).unwrap();
                model.retain(|k, _| k.0 != persistent);
            }
            Step::PutMany { persistent, object, seeds } => {
                let keys: Vec<PageKey> = (0..seeds.len() as u64)
                    .map(|i| PageKey::new(pool(persistent), object, i))
                    .collect();
                let data: Vec<u8> = seeds.iter().flat_map(|s| page(*s)).collect();
                let outcomes = store.put_many(&keys, &data).unwrap();
                for (i, (seed, outcome)) in seeds.iter().zip(outcomes).enumerate() {
                    let k = (persistent, object, i as u64);
                    if outcome == PutOutcome::Stored {
                        model.insert(k, *seed);
                    } else {
                        model.remove(&k);
                    }
                }
            }
            Step::GetMany { persistent, object, count } => {
                let keys: Vec<PageKey> =
                    (0..count).map(|i| PageKey::new(pool(persistent), object, i)).collect();
                let mut buf = vec![0u8; keys.len() * PAGE_SIZE];
                let lookups = store.get_many(&keys, &mut buf).unwrap();
                for (i, lookup) in lookups.into_iter().enumerate() {
                    check_read(
                        &model,
                        (persistent, object, i as u64),
                        lookup,
                        &buf[i * PAGE_SIZE..(i + 1) * PAGE_SIZE],
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn the_remote_store_behaves_like_the_model(steps in prop::collection::vec(step(), 1..60)) {
        let node = TestNode::start();
        let client = BlockingClient::connect(node.config()).unwrap();
        let pools = [
            client.create_pool(&PoolSpec::ephemeral()).unwrap(),
            client.create_pool(&PoolSpec::persistent()).unwrap(),
        ];
        run(&client, pools, &steps);
        node.node.engine().validate();
    }
}
