//! Dedup across nodes against in-process nodes on 127.0.0.1: a node's content summary
//! and puts by hash over the wire, and a cluster client that sends clone pages as hashes
//! to the node holding their content, falls back to bytes when a summary is stale, and
//! reads back exactly what it wrote.

use fallow_testkit::node as support;

use std::time::Duration;

use fallow_client::{Client, ClusterClient, ClusterClientConfig};
use fallow_core::content::{checksum, content_hash, page_dedup_key};
use fallow_core::{
    DedupScope, HashPutOutcome, PageKey, PoolSpec, PutOutcome, TrustDomain, PAGE_SIZE,
};
use fallow_node::summary::SummarySettings;
use fallow_proto::fallow::Op;
use support::{
    assert_pages, keys, pages, three_nodes, three_nodes_with, Options, TestNode, SECRET,
};

const DOMAIN: DedupScope = DedupScope::Domain(TrustDomain(0x5eed));

fn digests(data: &[u8]) -> Vec<(u128, u32)> {
    data.chunks_exact(PAGE_SIZE).map(|p| (content_hash(p, DOMAIN).unwrap(), checksum(p))).collect()
}

/// A page's key in a node's summary, from its digest.
fn summary_key(&(_, crc): &(u128, u32)) -> u64 {
    page_dedup_key(crc, DOMAIN).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_its_summary_and_stores_pages_by_hash() {
    // Summaries rebuilt on every request, so the test sees each change at once.
    let summary = SummarySettings { refresh: Duration::ZERO, ..SummarySettings::default() };
    let node = TestNode::with(Options { summary, ..Options::default() });
    let client = Client::connect(node.config()).await.unwrap();
    let empty = client.content_summary().await.unwrap();
    assert!(empty.is_empty(), "a node holding nothing: {empty:?}");

    let first = client.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).await.unwrap();
    let n = 200;
    let data = pages(3, n);
    let outcomes = client.put_many(&keys(first, 1, n), data.clone()).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
    let summary = client.content_summary().await.unwrap();
    assert_eq!(summary.entries(), n);
    let contents = digests(&data);
    assert!(contents.iter().all(|d| summary.contains(summary_key(d))));

    // A clone in another pool of the domain: every page by hash, no new frame.
    let frames = node.node.engine().memory().frames_used;
    let clone = client.create_pool(&PoolSpec::persistent().dedup(DOMAIN)).await.unwrap();
    let clone_keys = keys(clone, 2, n);
    let outcomes = client.put_hashes(&clone_keys, &contents).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == HashPutOutcome::Stored), "{outcomes:?}");
    assert_eq!(node.node.engine().memory().frames_used, frames);
    assert_pages(&client.get_many(&clone_keys).await.unwrap(), &data, "pages stored by hash");
    let metrics = node.node.metrics();
    use fallow_node::metrics::PageEvent;
    assert_eq!(metrics.page_count(Op::PutHashes, PageEvent::Stored), n);

    // Content the node does not hold, a wrong checksum, a pool without dedup: not held.
    let plain = client.create_pool(&PoolSpec::ephemeral().dedup(DedupScope::Off)).await.unwrap();
    let other = digests(&pages(4, 1))[0];
    let (hash, crc) = contents[0];
    let asked = [PageKey::new(clone, 3, 0), PageKey::new(clone, 3, 1), PageKey::new(plain, 0, 0)];
    let outcomes = client.put_hashes(&asked, &[other, (hash, !crc), (hash, crc)]).await.unwrap();
    assert_eq!(outcomes, [HashPutOutcome::NotHeld; 3]);
    assert_eq!(metrics.page_count(Op::PutHashes, PageEvent::Miss), 3);
    assert!(client.get_many(&asked).await.unwrap().iter().all(Option::is_none));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_comes_in_pieces_sized_as_the_node_is_told() {
    // 1500 pages at a false-positive rate of 10⁻⁶: ~5.4 KiB of filter, sent 1 KiB a piece.
    let summary = SummarySettings {
        false_positive_rate: 1e-6,
        refresh: Duration::ZERO,
        piece_bytes: 1024,
        ..SummarySettings::default()
    };
    let node = TestNode::with(Options { summary, ..Options::default() });
    let client = Client::connect(node.config()).await.unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).await.unwrap();
    let n = 1500;
    let data = pages(11, n);
    client.put_many(&keys(pool, 0, n), data.clone()).await.unwrap();
    let filter = client.content_summary().await.unwrap();
    assert_eq!(filter.entries(), n);
    assert!(filter.len_bytes() > 5 * 1024, "{filter:?}");
    assert_eq!(filter.hashes(), 16, "28.8 bits per entry would take 20 probes; 16 is the cap");
    assert!(digests(&data).iter().all(|d| filter.contains(summary_key(d))));
    assert!(filter.false_positive_rate() < 2e-6, "{}", filter.false_positive_rate());

    // A size cap wins over the rate.
    let summary = SummarySettings { max_bytes: 64, ..SummarySettings::default() };
    let small = TestNode::with(Options { summary, ..Options::default() });
    let client = Client::connect(small.config()).await.unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).await.unwrap();
    client.put_many(&keys(pool, 0, n), data).await.unwrap();
    let filter = client.content_summary().await.unwrap();
    assert_eq!(filter.len_bytes(), 64);
    assert!(filter.false_positive_rate() > 0.5, "{}", filter.false_positive_rate());
}

/// A cluster client for `seeds` that fetches summaries only when told to.
async fn cluster_client(seeds: &[std::net::SocketAddr]) -> ClusterClient {
    let list: Vec<String> = seeds.iter().map(|a| a.to_string()).collect();
    let config = ClusterClientConfig::new(&list.join(","), SECRET.to_vec())
        .unwrap()
        .per_node(|c| c.timeout(Duration::from_secs(5)).connect_timeout(Duration::from_secs(5)))
        .dedup_refresh(None);
    ClusterClient::connect(config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clones_go_to_the_node_holding_their_content_as_hashes() {
    // Summaries rebuilt on every request, so each round sees the clone before.
    let nodes =
        three_nodes_with(SummarySettings { refresh: Duration::ZERO, ..Default::default() }).await;
    let cluster = cluster_client(&[nodes[0].addr]).await;
    assert_eq!(cluster.nodes().len(), 3);
    let n = 300;
    let data = pages(7, n);
    let image = cluster.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).await.unwrap();
    let outcomes = cluster.put_many(&keys(image, 1, n), data.clone()).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
    let frames = |nodes: &[TestNode]| -> usize {
        nodes.iter().map(|n| n.node.engine().memory().frames_used).sum()
    };
    let before = frames(&nodes);
    assert_eq!(cluster.dedup().stored_by_hash, 0, "no summary fetched yet");

    cluster.refresh_summaries().await;
    assert_eq!(cluster.dedup().summaries_fetched, 3);
    // Three clones: other pools, other objects, the same bytes.
    for clone in 0..3u64 {
        let pool = cluster.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).await.unwrap();
        let clone_keys = keys(pool, 10 + clone, n);
        let outcomes = cluster.put_many(&clone_keys, data.clone()).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
        assert_pages(&cluster.get_many(&clone_keys).await.unwrap(), &data, "a clone");
    }
    // Every clone page goes as a hash to a node holding it, except where a filter's
    // false positive (1 %) sent it to its rendezvous owner, which stores it whole.
    let stats = cluster.dedup();
    assert_eq!(stats.stored_by_hash + stats.not_held, 3 * n, "{stats:?}");
    assert!(stats.not_held <= 3 * n / 25, "{stats:?}");
    assert_eq!(stats.bytes_saved, stats.stored_by_hash * 4076);
    assert_eq!(
        frames(&nodes) - before,
        stats.not_held as usize,
        "only false positives took frames"
    );

    // Persistent clones keep two copies: the first one's copies go by hash where the
    // content is (one copy; the other node has to receive the page), and once both copies'
    // nodes hold it, a second clone sends both as hashes.
    let mut by_hash = Vec::new();
    for clone in 0..2u64 {
        cluster.refresh_summaries().await;
        let before = cluster.dedup().stored_by_hash;
        let pool = cluster.create_pool(&PoolSpec::persistent().dedup(DOMAIN)).await.unwrap();
        let clone_keys = keys(pool, 20 + clone, n);
        let outcomes = cluster.put_many(&clone_keys, data.clone()).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored), "{outcomes:?}");
        assert_pages(&cluster.get_many(&clone_keys).await.unwrap(), &data, "a persistent clone");
        by_hash.push(cluster.dedup().stored_by_hash - before);
    }
    assert!((n * 9 / 10..=n * 11 / 10).contains(&by_hash[0]), "{by_hash:?} of {n} pages");
    assert!(by_hash[1] >= 2 * n * 9 / 10, "{by_hash:?}: both copies by hash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_summary_costs_a_round_trip_not_a_page() {
    let nodes = three_nodes().await;
    let cluster = cluster_client(&[nodes[0].addr]).await;
    let n = 120;
    let data = pages(9, n);
    let image = cluster.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).await.unwrap();
    cluster.put_many(&keys(image, 1, n), data.clone()).await.unwrap();
    cluster.refresh_summaries().await;
    // The content leaves every node after the summaries were fetched.
    cluster.destroy_pool(image).await.unwrap();

    let clone = cluster.create_pool(&PoolSpec::ephemeral().dedup(DOMAIN)).await.unwrap();
    let clone_keys = keys(clone, 2, n);
    let outcomes = cluster.put_many(&clone_keys, data.clone()).await.unwrap();
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
    let stats = cluster.dedup();
    assert_eq!((stats.stored_by_hash, stats.not_held), (0, n), "{stats:?}");
    assert_pages(&cluster.get_many(&clone_keys).await.unwrap(), &data, "pages sent after all");
}
