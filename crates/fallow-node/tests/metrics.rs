//! `/metrics` over HTTP from a running node: the Prometheus text format with the counters
//! the issue names (hits, misses, puts, refusals, evictions, per-op latency, lent, used and
//! saved bytes, connections), moving as traffic flows.

use fallow_testkit::node as support;

use std::io::{Read, Write};

use fallow_client::BlockingClient;
use fallow_core::{PageKey, PageStore, PoolSpec, PAGE_SIZE};
use support::{page, Options, TestNode};

fn scrape(node: &TestNode) -> String {
    let mut stream = std::net::TcpStream::connect(node.metrics.unwrap()).unwrap();
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    text
}

fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no series {series} in\n{text}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn metrics_follow_the_traffic() {
    let node = TestNode::with(Options { metrics: true, ..Options::default() });
    let client = BlockingClient::connect(node.config()).unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral()).unwrap();
    for i in 0..10 {
        let _ = client.put(PageKey::new(pool, 0, i), &page(i)).unwrap();
    }
    let _ = client.put(PageKey::new(pool, 0, 99), &[0u8; PAGE_SIZE]).unwrap();
    let mut out = vec![0u8; PAGE_SIZE];
    for i in 0..15 {
        let _ = client.get(PageKey::new(pool, 0, i), &mut out).unwrap();
    }
    let text = scrape(&node);
    assert_eq!(value(&text, "fallow_node_pages_total{op=\"get\",result=\"hit\"}"), 10.0);
    assert_eq!(value(&text, "fallow_node_pages_total{op=\"get\",result=\"miss\"}"), 5.0);
    assert_eq!(value(&text, "fallow_node_pages_total{op=\"put\",result=\"stored\"}"), 11.0);
    assert_eq!(value(&text, "fallow_node_pages_total{op=\"put\",result=\"refused\"}"), 0.0);
    assert_eq!(value(&text, "fallow_node_requests_total{op=\"get\",status=\"ok\"}"), 15.0);
    assert_eq!(value(&text, "fallow_node_request_duration_seconds_count{op=\"put\"}"), 11.0);
    assert_eq!(value(&text, "fallow_node_lent_bytes"), (64u64 << 20) as f64);
    assert_eq!(value(&text, "fallow_node_stored_pages"), 11.0);
    assert_eq!(value(&text, "fallow_node_eviction_small_share_ratio"), 0.1, "the default start");
    assert_eq!(value(&text, "fallow_node_dedup_saved_bytes"), PAGE_SIZE as f64, "the zero page");
    assert!(value(&text, "fallow_node_used_bytes") >= (10 * PAGE_SIZE) as f64);
    assert_eq!(value(&text, "fallow_node_compressed_space_bytes"), 0.0, "nothing compressed");
    assert_eq!(value(&text, "fallow_node_discarded_bytes"), 0.0, "no frame given back");
    assert_eq!(value(&text, "fallow_node_connections"), 1.0);
    assert_eq!(value(&text, "fallow_node_clients"), 1.0);
    for name in [
        "fallow_node_live_pool_evictions",
        "fallow_node_compression_saved_bytes",
        "fallow_node_mapped_bytes",
    ] {
        let _ = value(&text, name);
    }
    drop(client);
}
