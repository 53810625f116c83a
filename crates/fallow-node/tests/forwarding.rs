//! Peer forwarding against three in-process gossiping nodes on 127.0.0.1 (OS-chosen
//! ports): a plain single-node `Client` connected to node A creates cluster pools
//! (CREATE_POOL flag 0x04), its pages land on every node, and it reads them back through
//! A; a client of node B attached to the same shared cluster pool reads them through B; a
//! stopped node costs misses and never an error; a node that does not gossip refuses the
//! flag. `docs/cluster.md` ("Peer forwarding").

use fallow_testkit::node as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fallow_client::{Client, ClientError};
use fallow_cluster::MemberEvent;
use fallow_core::{PageKey, PoolSpec, PutOutcome};
use fallow_node::Node;
use fallow_proto::fallow::{Op, Status};
use support::{assert_pages, keys, pages, three_nodes, TestNode};

/// The dedup scope of `PoolSpec::ephemeral()`.
fn spec_scope() -> fallow_core::DedupScope {
    PoolSpec::ephemeral().dedup
}

/// The UUID of the shared cluster pool.
const UUID: u128 = 0xf0f0_4242;

/// Pages stored on `node`, from its STATS.
async fn stored(node: &TestNode) -> u64 {
    let stats = Client::connect(node.config()).await.unwrap().stats().await.unwrap();
    stats.get("pages").expect("STATS has pages")
}

/// Members declared dead by silence, which the test never causes (it stops a node
/// cleanly). A machine loaded enough to stall a node's gossip for half a second makes the
/// detector declare it dead; it is heard again at once, and the cluster clients rightly
/// drop the pools they had there, pages and all. Counts of pages are exact only while
/// this did not happen; no wrong page and no error always hold.
struct Flaps {
    nodes: Vec<Arc<Node>>,
    before: u64,
}

impl Flaps {
    fn count(nodes: &[Arc<Node>]) -> u64 {
        let failed = |n: &Arc<Node>| n.cluster().map_or(0, |c| c.event_count(MemberEvent::Failed));
        nodes.iter().map(failed).sum()
    }

    fn watch(nodes: &[TestNode]) -> Flaps {
        let nodes: Vec<Arc<Node>> = nodes.iter().map(|n| n.node.clone()).collect();
        Flaps { before: Self::count(&nodes), nodes }
    }

    /// True when no member was declared dead since `watch`.
    fn none(&self) -> bool {
        let stable = Self::count(&self.nodes) == self.before;
        if !stable {
            eprintln!("a member was declared dead (a stalled machine): exact counts not checked");
        }
        stable
    }
}

/// Reads `keys` of a shared cluster pool through `client` until `hits` of them are found
/// (at most 10 s), checking every hit against `data`. A miss is allowed on the way: a
/// shared pool is read from each key's owner among the nodes alive *now*, and a node that
/// a loaded machine leaves silent for 300 ms is suspect for a moment, so its keys' owners
/// move. A wrong page, more hits than expected, or an error fail at once; a member
/// declared dead on the way (`Flaps`) ends the wait.
async fn read_until(
    client: &Client,
    keys: &[PageKey],
    data: &Bytes,
    hits: u64,
    flaps: &Flaps,
    what: &str,
) {
    let start = Instant::now();
    loop {
        let got = client.get_many(keys).await.unwrap();
        let mut found = 0;
        for (i, page) in got.iter().enumerate() {
            if let Some(page) = page {
                assert_eq!(page[..], data[i * 4096..(i + 1) * 4096], "{what}: page {i}");
                found += 1;
            }
        }
        assert!(found <= hits, "{what}: {found} hits, {hits} expected");
        if found == hits || !flaps.none() {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{what}: {found} of {hits} hits");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_one_node_uses_the_whole_cluster() {
    let mut nodes = three_nodes().await;
    let flaps = Flaps::watch(&nodes);
    let a = Client::connect(nodes[0].config()).await.unwrap();
    let spec = PoolSpec::ephemeral().shared(UUID);
    let pool = a.create_cluster_pool(&spec).await.unwrap();
    assert!(pool.0 >= 0x8000_0000, "a cluster pool id has the top bit: {pool}");
    assert_eq!(a.create_cluster_pool(&spec).await.unwrap(), pool, "attached once");
    let ordinary = a.create_pool(&PoolSpec::ephemeral()).await.unwrap();
    assert!(ordinary.0 < 0x8000_0000 && ordinary != pool);

    // 300 pages: about 100 a node, far from moving any node's rounded placement weight
    // (free memory plus an eighth of 32 MiB, in steps of 2^(1/8): ~660 pages a node), so
    // B's cluster client computes the owners A's did.
    let n = 300;
    let keys = keys(pool, 1, n);
    let data = pages(1, n);
    let outcomes = a.put_many(&keys, data.clone()).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored) || !flaps.none(), "{outcomes:?}");
    let mut spread = Vec::new();
    for node in &nodes {
        spread.push(stored(node).await);
    }
    if flaps.none() {
        assert_eq!(spread.iter().sum::<u64>(), n, "each page on one node: {spread:?}");
        assert!(spread.iter().all(|&p| p > 0), "every node holds some pages: {spread:?}");
    }
    read_until(&a, &keys, &data, n, &flaps, "through A").await;

    // 300 single-page GETs at once on A's one connection: more than a connection may have
    // forwarded at once (64), so the node pauses reading it and resumes as they finish;
    // PINGs pipelined among them are answered all the same.
    let singles = keys.iter().map(|key| a.get(*key));
    let pings = (0..10).map(|_| a.ping());
    let (singles, pings) =
        tokio::join!(futures::future::join_all(singles), futures::future::join_all(pings));
    let singles: Vec<_> = singles.into_iter().map(Result::unwrap).collect();
    assert!(pings.iter().all(Result::is_ok), "{pings:?}");
    if flaps.none() {
        assert_pages(&singles, &data, "one at a time");
    }
    assert_eq!(nodes[0].node.metrics().forwarded_in_flight.get(), 0);

    // A client of B attaches to the same cluster pool by UUID and reads the same pages.
    let b = Client::connect(nodes[1].config()).await.unwrap();
    let on_b = b.create_cluster_pool(&spec).await.unwrap();
    let keys_b = support::keys(on_b, 1, n);
    read_until(&b, &keys_b, &data, n, &flaps, "through B").await;
    // A page B writes is what A then reads (the shared pool's coherence).
    let newer = pages(2, 1);
    let stored_b = b.put_many(&keys_b[..1], newer.clone()).await.unwrap();
    assert!(stored_b == [PutOutcome::Stored] || !flaps.none(), "{stored_b:?}");
    read_until(&a, &keys[..1], &newer, 1, &flaps, "B's newer page through A").await;
    let stored_a = a.put_many(&keys[..1], data.slice(..4096)).await.unwrap();
    assert!(stored_a == [PutOutcome::Stored] || !flaps.none(), "{stored_a:?}");

    // A private cluster pool: its creator's alone, like a private pool of one node.
    let private = a.create_cluster_pool(&PoolSpec::ephemeral()).await.unwrap();
    assert_ne!(private, pool);
    let private_keys = support::keys(private, 9, 20);
    let private_data = pages(3, 20);
    let outcomes = a.put_many(&private_keys, private_data.clone()).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored) || !flaps.none(), "{outcomes:?}");
    let got = a.get_many(&private_keys).await.unwrap();
    let stranger = Client::connect(nodes[0].config()).await.unwrap();
    let err = stranger.get(private_keys[0]).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownPool(p) if p == private), "{err}");
    let taken = a.take_many(&private_keys[..5]).await.unwrap();
    assert!(a.get_many(&private_keys[..5]).await.unwrap().iter().all(Option::is_none));
    let invalidated = a.invalidate_object(private, 9).await.unwrap();
    if flaps.none() {
        // A private pool is read through the summary of placed pages: no retry needed.
        assert_pages(&got, &private_data, "private");
        assert_pages(&taken, &private_data, "taken");
        assert_eq!(invalidated, 15);
    }
    // PUT_HASHES on a cluster pool: "not held", and the key left empty, for the client to
    // send the page (the node's cluster client dedups it itself).
    let content = (fallow_core::content::content_hash(&private_data[..4096], spec_scope()), 7);
    let asked = [private_keys[10]];
    let outcomes = a.put_hashes(&asked, &[(content.0.unwrap(), content.1)]).await.unwrap();
    assert_eq!(outcomes, [fallow_core::HashPutOutcome::NotHeld]);
    assert_eq!(a.get(asked[0]).await.unwrap(), None);
    a.destroy_pool(private).await.unwrap();
    let err = a.get(private_keys[0]).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownPool(_)), "{err}");

    // The forwarding node counts what it forwarded.
    let metrics = nodes[0].node.metrics();
    assert!(metrics.forwarded_count(Op::Put, Status::Ok) >= 3);
    assert!(metrics.forwarded_count(Op::Get, Status::Ok) >= 3);
    assert_eq!(metrics.forwarded_count(Op::CreatePool, Status::Ok), 3);
    let text = metrics.render(&nodes[0].node);
    assert!(
        text.contains("fallow_node_forwarded_requests_total{op=\"put\",status=\"ok\"}"),
        "{text}"
    );
    assert!(text.contains("fallow_node_cluster_pools 1"), "{text}");
    assert!(
        text.contains("fallow_node_forwarded_pages_total{op=\"get\",result=\"hit\"}"),
        "{text}"
    );

    // Stop node C: its pages are misses through A and through B, never errors; the others
    // are still hits, and new puts go to the nodes left.
    let on_c = stored(&nodes[2]).await;
    assert!(on_c > 0 || !flaps.none());
    drop(nodes.pop());
    read_until(&a, &keys, &data, n - on_c, &flaps, "through A after C stopped").await;
    read_until(&b, &keys_b, &data, n - on_c, &flaps, "through B after C stopped").await;
    let more = support::keys(pool, 2, 50);
    let outcomes = a.put_many(&more, pages(4, 50)).await.unwrap();
    if flaps.none() {
        assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored), "{outcomes:?}");
    }
    read_until(&a, &more, &pages(4, 50), 50, &flaps, "new pages after C stopped").await;
    // A's own pools are untouched by all of this.
    let own = PageKey::new(ordinary, 0, 0);
    assert_eq!(a.put(own, pages(5, 1)).await.unwrap(), PutOutcome::Stored);
    assert_eq!(a.get(own).await.unwrap(), Some(pages(5, 1)));
}

#[tokio::test]
async fn a_node_that_does_not_gossip_refuses_cluster_pools() {
    let alone = TestNode::start();
    let client = Client::connect(alone.config()).await.unwrap();
    let err = client.create_cluster_pool(&PoolSpec::ephemeral()).await.unwrap_err();
    match err {
        ClientError::Refused { status: Status::InvalidSpec, message } => {
            assert!(message.contains("does not gossip"), "{message}");
        }
        other => panic!("expected INVALID_SPEC, got {other}"),
    }
    // The connection goes on, and so do ordinary pools.
    assert!(client.ping().await.unwrap() < Duration::from_secs(5));
    client.create_pool(&PoolSpec::ephemeral()).await.unwrap();
    // A made-up cluster pool id is unknown, like any id the client cannot reach.
    let fake = PageKey::new(fallow_core::PoolId(0x8000_0000), 0, 0);
    let err = client.get(fake).await.unwrap_err();
    assert!(matches!(err, ClientError::UnknownPool(_)), "{err}");
}
