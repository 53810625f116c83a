//! `fallow bench pages` against a fallow node running in this process on 127.0.0.1:0.

use std::sync::Arc;
use std::time::Duration;

use fallow_bench::pages::{self, KeyDist, PagesError, PagesOptions, Target, ValueMode, Workload};
use fallow_node::{ListenAddr, Node, NodeConfig, Server};
use fallow_pool::{Engine, EngineBuilder};

const SECRET: &[u8] = b"0123456789abcdef-bench-secret";

/// A node lending 64 MiB, served by a runtime of its own (the load generator builds
/// another), stopped when dropped.
struct TestNode {
    runtime: tokio::runtime::Runtime,
    server: Option<Server>,
    addr: String,
}

impl TestNode {
    fn start() -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let engine = Arc::new(Engine::new(EngineBuilder::new(64 << 20).build().unwrap()));
        let listen = vec![ListenAddr::Tcp("127.0.0.1:0".parse().unwrap())];
        let node = Arc::new(Node::new(engine, NodeConfig::new(listen, SECRET.to_vec()), None));
        let server = runtime.block_on(Server::start(node)).unwrap();
        let addr = server.tcp_addr().unwrap().to_string();
        Self { runtime, server: Some(server), addr }
    }

    fn options(&self) -> PagesOptions {
        let mut opts = PagesOptions::new(Target::Fallow { addr: self.addr.clone() });
        opts.secret = SECRET.to_vec();
        opts.keys = 2_000;
        opts.duration = Duration::from_millis(800);
        opts
    }
}

impl Drop for TestNode {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            self.runtime.block_on(server.shutdown());
        }
    }
}

#[test]
fn warm_batched_gets_all_hit() {
    let node = TestNode::start();
    let mut opts = node.options();
    opts.warmup = true;
    opts.connections = 2;
    opts.queue_depth = 4;
    opts.batch = 8;
    let r = pages::run(&opts, |_| {}).unwrap();
    assert_eq!(r.warmup_pages, 2_000);
    assert_eq!(r.server, "fallow");
    assert!(r.hits > 100, "{r}");
    assert_eq!(r.misses, 0, "every key was put by the warm-up: {r}");
    assert_eq!(r.wrong, 0, "{r}");
    assert_eq!(r.pages, r.requests * 8);
    assert!(r.pages_per_s > 1_000.0, "{r}");
    let l = r.latency_us;
    assert!(l.p50 > 1.0 && l.p50 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max, "{l:?}");
}

#[test]
fn qd1_single_gets_and_mixed_dup_load() {
    let node = TestNode::start();
    let mut opts = node.options();
    opts.warmup = true;
    let r = pages::run(&opts, |_| {}).unwrap();
    assert!(r.hits > 50 && r.misses == 0 && r.wrong == 0, "{r}");
    assert_eq!(r.pages, r.requests, "batch 1");

    let mut opts = node.options();
    opts.workload = Workload::Mix { read: 0.5 };
    opts.dist = KeyDist::Zipf { theta: 0.99 };
    opts.value = ValueMode::Dup { distinct: 4 };
    opts.queue_depth = 8;
    opts.batch = 4;
    opts.threads = 2;
    let r = pages::run(&opts, |_| {}).unwrap();
    assert!(r.stored > 50 && r.hits > 10, "{r}");
    assert_eq!(r.wrong, 0, "{r}");
    assert_eq!(r.dedup, Some(true));
}

#[test]
fn a_wrong_secret_is_a_clear_error() {
    let node = TestNode::start();
    let mut opts = node.options();
    opts.secret = b"not-the-secret-at-all".to_vec();
    let err = pages::run(&opts, |_| {}).unwrap_err();
    assert!(matches!(err, PagesError::Fallow(_)), "{err:?}");
    assert!(err.to_string().contains("secret"), "{err}");
}

/// Two nodes outside any gossip cluster: the cluster client takes the seeds as the
/// cluster. Pages spread over both, every get hits, the report carries the client's view,
/// and a rate bounds the requests.
#[test]
fn a_cluster_target_spreads_pages_and_reports_the_client() {
    let (a, b) = (TestNode::start(), TestNode::start());
    let mut opts = a.options();
    opts.target = format!("fallow://{},{}", a.addr, b.addr).parse().unwrap();
    assert!(matches!(opts.target, Target::Cluster { .. }));
    opts.warmup = true;
    opts.queue_depth = 2;
    opts.batch = 4;
    opts.rate = Some(200.0);
    let r = pages::run(&opts, |_| {}).unwrap();
    assert_eq!(r.server, "fallow-cluster");
    assert_eq!((r.misses, r.wrong, r.errors), (0, 0, 0), "{r}");
    assert!(r.hits > 0, "{r}");
    // 200 requests/s for 0.8 s: about 160, and never the thousands an unpaced loop sends.
    assert!(r.requests >= 40 && r.requests <= 200, "{} requests at 200/s in 0.8 s", r.requests);
    let cluster = r.cluster.as_ref().expect("a cluster report");
    let warm = cluster.after_warmup.as_ref().expect("a snapshot after the warm-up");
    assert_eq!(warm.summary_pages, 2_000, "every page put is in the summary");
    assert!(warm.summary_heap_bytes > 0);
    assert_eq!(cluster.connected.summary_pages, 0);
    assert_eq!(cluster.end.nodes.len(), 2);
    for node in &cluster.end.nodes {
        assert_eq!(node.state, "alive");
        assert!(node.pages > 300, "pages spread over both nodes: {:?}", cluster.end.nodes);
    }
    let alive: Vec<_> = cluster.events.iter().filter(|e| e.state == "alive").collect();
    assert_eq!(alive.len(), 2, "{:?}", cluster.events);
    assert!(r.rss.connected.is_some() == cfg!(target_os = "linux"));
}
