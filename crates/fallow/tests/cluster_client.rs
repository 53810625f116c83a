//! The cluster client against three real `fallow node` processes joined by gossip on
//! 127.0.0.1: a workload of puts and gets runs while one node is SIGKILLed, and every get
//! is a hit with the bytes last put or a miss, never wrong data and never an error. The
//! time of each request before the kill, until the client stops using the node, and
//! after is printed (BENCHMARKS.md, "Cluster client"). The killed node is then restarted
//! and gets new pages again. A second test puts persistent pages (two copies each),
//! SIGKILLs one node, reads every page, waits until the client re-created the lost
//! copies, SIGKILLs a second node and reads every page again: the re-created copies are
//! all that is left of a third of them. Every process is stopped by its PID
//! (support::Daemon).

mod support;

use std::collections::HashMap;
use std::net::UdpSocket;
use std::path::Path;
use std::time::{Duration, Instant};

use fallow_client::{
    Client, ClientConfig, ClusterClient, ClusterClientConfig, MemberState, NodeState,
};
use fallow_core::{PageKey, PoolSpec, PutOutcome, PAGE_SIZE};
use support::{free_port, start_node, Daemon, Rng, TempDir};

const START_TIMEOUT: Duration = Duration::from_secs(20);
const SECRET: &str = "cluster-client-test-secret-0123456789";

/// One node's fixed addresses, so that a restart comes back on the same ones.
struct Addrs {
    listen: String,
    gossip: String,
}

/// Addresses for `n` nodes on 127.0.0.1, ports assigned by the OS.
fn local_addrs(n: usize) -> Vec<Addrs> {
    (0..n)
        .map(|_| Addrs {
            listen: format!("127.0.0.1:{}", free_port()),
            gossip: format!(
                "127.0.0.1:{}",
                UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
            ),
        })
        .collect()
}

fn start_member(addrs: &Addrs, peers: &[&Addrs], secret: &Path, lend: &str) -> Daemon {
    let join: Vec<&str> = peers.iter().map(|p| p.gossip.as_str()).collect();
    let join = join.join(",");
    let args = [
        "--listen",
        &addrs.listen,
        "--gossip",
        &addrs.gossip,
        "--join",
        &join,
        "--lend",
        lend,
        "--secret-file",
        secret.to_str().unwrap(),
    ];
    start_node(&args, START_TIMEOUT).0
}

/// Waits (at most 10 s) until `node` lists `alive` members alive.
async fn wait_for_members(node: &str, alive: usize) {
    let config = ClientConfig::new(node, SECRET).unwrap();
    let client = Client::connect(config).await.unwrap();
    let start = Instant::now();
    loop {
        let members = client.members().await.unwrap();
        if members.iter().filter(|m| m.state == MemberState::Alive).count() == alive {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{members:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Page `index` as written the `version`-th time.
fn page(index: u64, version: u64) -> Vec<u8> {
    fallow_testkit::pages::unique_page(index << 20 | version)
}

/// The p50, p99 and max of `samples`, in microseconds.
fn percentiles(samples: &mut [Duration]) -> String {
    if samples.is_empty() {
        return "none".to_string();
    }
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize].as_micros();
    format!("p50 {} µs, p99 {} µs, max {} µs, n={}", at(0.5), at(0.99), at(1.0), samples.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_node_costs_misses_never_wrong_data_or_errors() {
    let dir = TempDir::new("cluster-client");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let addrs = local_addrs(3);
    let (a, b, c) = (&addrs[0], &addrs[1], &addrs[2]);
    let _node_a = start_member(a, &[b, c], &secret, "32M");
    let mut node_b = start_member(b, &[a, c], &secret, "32M");
    let _node_c = start_member(c, &[a, b], &secret, "32M");
    wait_for_members(&a.listen, 3).await;

    let seeds = format!("fallow://{},{},{}", a.listen, b.listen, c.listen);
    // A SIGKILLed node resets its connections: detection needs no timeout, and a long
    // one keeps a slow machine from making misses of its own.
    let config = ClusterClientConfig::new(&seeds, SECRET)
        .unwrap()
        .per_node(|c| c.timeout(Duration::from_secs(1)));
    let cluster = ClusterClient::connect(config).await.unwrap();
    assert_eq!(cluster.nodes().len(), 3);
    let pool = cluster.create_pool(&PoolSpec::ephemeral()).await.unwrap();

    // The model: the version each page last had stored, or None (never, or refused).
    let n = 2048u64;
    let mut model: HashMap<u64, Option<u64>> = HashMap::new();
    let mut rng = Rng(11);
    let put = |cluster: &ClusterClient, indexes: Vec<u64>, version: u64| {
        let cluster = cluster.clone();
        async move {
            let keys: Vec<PageKey> = indexes.iter().map(|&i| PageKey::new(pool, 1, i)).collect();
            let data: Vec<u8> = indexes.iter().flat_map(|&i| page(i, version)).collect();
            let outcomes = cluster.put_many(&keys, data.into()).await.expect("put failed");
            (indexes, outcomes)
        }
    };
    for chunk in (0..n).collect::<Vec<_>>().chunks(256) {
        let (indexes, outcomes) = put(&cluster, chunk.to_vec(), 0).await;
        for (i, o) in indexes.into_iter().zip(outcomes) {
            assert_eq!(o, PutOutcome::Stored);
            model.insert(i, Some(0));
        }
    }
    let on_b = cluster.nodes().iter().find(|x| x.id == b.listen).unwrap().pages;
    assert!(on_b > n / 5, "only {on_b} pages on b");

    // The workload: gets of 1 or 32 random pages (checked), and puts of 32 with a new
    // version. b is SIGKILLed after 1.5 s. Get times are kept by phase (before the kill,
    // until the client skips b, after) and by size.
    let mut times: [[Vec<Duration>; 2]; 3] = Default::default();
    let (mut hits, mut misses) = (0u64, 0u64);
    let start = Instant::now();
    let mut killed: Option<Instant> = None;
    let mut skipped: Option<Duration> = None;
    let mut version = 1;
    while start.elapsed() < Duration::from_secs(4) {
        if killed.is_none() && start.elapsed() > Duration::from_millis(1500) {
            node_b.kill();
            killed = Some(Instant::now());
        }
        let size = [1, 32, 32][rng.below(3) as usize];
        let indexes: Vec<u64> = (0..size).map(|_| rng.below(n)).collect();
        if rng.below(4) == 0 {
            let (indexes, outcomes) = put(&cluster, indexes, version).await;
            for (i, o) in indexes.into_iter().zip(outcomes) {
                model.insert(i, (o == PutOutcome::Stored).then_some(version));
            }
            version += 1;
            continue;
        }
        let keys: Vec<PageKey> = indexes.iter().map(|&i| PageKey::new(pool, 1, i)).collect();
        let t = Instant::now();
        let got =
            cluster.get_many(&keys).await.expect("a get failed: the error reached the caller");
        let took = t.elapsed();
        for (i, page_got) in indexes.iter().zip(got) {
            match page_got {
                None => misses += 1,
                Some(bytes) => {
                    hits += 1;
                    let v = model[i].unwrap_or_else(|| panic!("page {i} hit though not stored"));
                    assert!(
                        bytes[..] == page(*i, v)[..],
                        "page {i}: wrong bytes (want version {v})"
                    );
                }
            }
        }
        // The client stops using b when a request failed or membership declared it dead.
        let b_in_use =
            cluster.nodes().iter().any(|x| x.id == b.listen && x.state != NodeState::Down);
        let phase = match killed {
            None => 0,
            Some(at) if b_in_use || skipped.is_none() => {
                if !b_in_use {
                    skipped = Some(at.elapsed());
                }
                1
            }
            Some(_) => 2,
        };
        times[phase][usize::from(size == 32)].push(took);
    }
    let skipped = skipped.expect("the client never stopped using the killed node");
    for (i, size) in [1, 32].into_iter().enumerate() {
        println!("gets of {size} page(s), 3 nodes, one SIGKILLed:");
        println!("  before the kill: {}", percentiles(&mut times[0][i]));
        println!(
            "  from the kill until the client skipped the node ({} ms): {}",
            skipped.as_millis(),
            percentiles(&mut times[1][i])
        );
        println!("  after: {}", percentiles(&mut times[2][i]));
        let (before, after) = (&times[0][i], &times[2][i]);
        let (b50, a50) = (before[before.len() / 2], after[after.len() / 2]);
        assert!(a50 <= b50 + Duration::from_millis(2), "added wait: {b50:?} -> {a50:?}");
    }
    println!("{hits} hits and {misses} misses; no error, no wrong page");

    // Membership declares b dead; the client retires it.
    let t = Instant::now();
    while cluster.nodes().iter().any(|x| x.id == b.listen) {
        assert!(t.elapsed() < Duration::from_secs(5), "b still used: {:#?}", cluster.nodes());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Restarted on the same addresses, b is a new node: it gets the pool and new pages.
    let _node_b = start_member(b, &[a, c], &secret, "32M");
    let t = Instant::now();
    while !cluster.nodes().iter().any(|x| x.id == b.listen && x.state == NodeState::Alive) {
        assert!(t.elapsed() < Duration::from_secs(10), "b not back: {:#?}", cluster.nodes());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fresh: Vec<u64> = (n..n + 600).collect();
    let (_, outcomes) = put(&cluster, fresh.clone(), 0).await;
    assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored));
    let on_b = cluster.nodes().iter().find(|x| x.id == b.listen).unwrap().pages;
    assert!(on_b > 60, "the restarted node got {on_b} of 600 new pages");
    let keys: Vec<PageKey> = fresh.iter().map(|&i| PageKey::new(pool, 1, i)).collect();
    let got = cluster.get_many(&keys).await.unwrap();
    for (i, p) in fresh.iter().zip(got) {
        assert!(p.unwrap()[..] == page(*i, 0)[..], "page {i}");
    }
}

/// Reads every page of `indexes` (object 1 of `pool`) and checks it is version 0.
async fn read_all_persistent(
    cluster: &ClusterClient,
    pool: fallow_core::PoolId,
    n: u64,
    when: &str,
) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(256) {
        let keys: Vec<PageKey> = chunk.iter().map(|&i| PageKey::new(pool, 1, i)).collect();
        let got = cluster
            .get_many(&keys)
            .await
            .unwrap_or_else(|err| panic!("{when}: a persistent read failed: {err}"));
        for (i, p) in chunk.iter().zip(got) {
            let p = p.unwrap_or_else(|| panic!("{when}: persistent page {i} missing"));
            assert!(p[..] == page(*i, 0)[..], "{when}: page {i}: wrong bytes");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_pages_survive_two_successive_node_kills() {
    let dir = TempDir::new("cluster-persistent");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let addrs = local_addrs(3);
    let (a, b, c) = (&addrs[0], &addrs[1], &addrs[2]);
    // FALLOW_PERSISTENT_PAGES=N measures a larger repair (BENCHMARKS.md); each node
    // lends room for every page, which the last two hold after the repair.
    let n: u64 = std::env::var("FALLOW_PERSISTENT_PAGES").map_or(3000, |v| v.parse().unwrap());
    let lend = format!("{}M", ((n * PAGE_SIZE as u64 * 2) >> 20).max(32));
    let _node_a = start_member(a, &[b, c], &secret, &lend);
    let mut node_b = start_member(b, &[a, c], &secret, &lend);
    let mut node_c = start_member(c, &[a, b], &secret, &lend);
    wait_for_members(&a.listen, 3).await;

    let seeds = format!("fallow://{},{},{}", a.listen, b.listen, c.listen);
    let config = ClusterClientConfig::new(&seeds, SECRET)
        .unwrap()
        .per_node(|c| c.timeout(Duration::from_secs(1)));
    let cluster = ClusterClient::connect(config).await.unwrap();
    assert_eq!(cluster.nodes().len(), 3);
    let pool = cluster.create_pool(&PoolSpec::persistent()).await.unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(256) {
        let keys: Vec<PageKey> = chunk.iter().map(|&i| PageKey::new(pool, 1, i)).collect();
        let data: Vec<u8> = chunk.iter().flat_map(|&i| page(i, 0)).collect();
        let outcomes = cluster.put_many(&keys, data.into()).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored), "{outcomes:?}");
    }
    let on_b = cluster.nodes().iter().find(|x| x.id == b.listen).unwrap().pages;
    assert!(on_b > n / 3, "only {on_b} copies on b");

    // The first kill: every page is read from its other copy at once.
    node_b.kill();
    let killed = Instant::now();
    read_all_persistent(&cluster, pool, n, "right after the first kill").await;
    // Membership declares b dead, the client retires it, and the repair copies b's pages
    // from their survivors to the other live node.
    loop {
        let stats = cluster.replication();
        if cluster.nodes().len() == 2 && stats.at_risk == 0 && stats.re_replicated >= on_b {
            break;
        }
        assert!(killed.elapsed() < Duration::from_secs(15), "{stats:?} {:#?}", cluster.nodes());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let repaired = killed.elapsed();
    let stats = cluster.replication();
    let (pass_pages, pass_time) = stats.last_repair.expect("no repair pass recorded");
    println!(
        "persistent: {n} pages on 3 nodes, one SIGKILLed: {} copies re-created, every page \
         on two nodes again {} ms after the kill; the repair pass copied {pass_pages} pages \
         in {} ms",
        stats.re_replicated,
        repaired.as_millis(),
        pass_time.as_millis()
    );
    assert_eq!((stats.pages, stats.lost), (n, 0));
    let spread: Vec<u64> = cluster.nodes().iter().map(|x| x.pages).collect();
    assert_eq!(spread, vec![n, n], "every page on both remaining nodes");
    read_all_persistent(&cluster, pool, n, "after the repair").await;

    // The second kill: the copies made by the repair are what is left.
    node_c.kill();
    read_all_persistent(&cluster, pool, n, "after the second kill").await;
    // With one node left a put cannot keep two copies: refused, never half-kept.
    let keys = [PageKey::new(pool, 1, 0)];
    let t = Instant::now();
    loop {
        let outcome = cluster.put_many(&keys, page(0, 1).into()).await.unwrap()[0];
        if outcome != PutOutcome::Stored {
            break;
        }
        // Until the client notices c is gone, a put may still land on a and c.
        assert!(t.elapsed() < Duration::from_secs(10), "puts still stored with one node");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(cluster.get_many(&keys).await.unwrap()[0], None, "a refused put left a page");
}

/// A get of a persistent page while a put of the same key is in flight returns the old
/// page or the new one, never a miss: the client keeps the old copies in its summary
/// until the new ones are stored. A writer overwrites 16 keys 300 times while a reader
/// reads them in a loop; every read must hit, with a version the writer has sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_during_a_put_of_the_same_persistent_key_never_misses() {
    let dir = TempDir::new("cluster-get-during-put");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, format!("{SECRET}\n")).unwrap();
    let addrs = local_addrs(2);
    let (a, b) = (&addrs[0], &addrs[1]);
    let _node_a = start_member(a, &[b], &secret, "32M");
    let _node_b = start_member(b, &[a], &secret, "32M");
    wait_for_members(&a.listen, 2).await;
    let seeds = format!("fallow://{},{}", a.listen, b.listen);
    let config = ClusterClientConfig::new(&seeds, SECRET)
        .unwrap()
        .per_node(|c| c.timeout(Duration::from_secs(5)));
    let cluster = ClusterClient::connect(config).await.unwrap();
    let pool = cluster.create_pool(&PoolSpec::persistent()).await.unwrap();
    let keys: Vec<PageKey> = (0..16).map(|i| PageKey::new(pool, 1, i)).collect();
    async fn put(cluster: &ClusterClient, keys: &[PageKey], version: u64) {
        let data: Vec<u8> = (0..16).flat_map(|i| page(i, version)).collect();
        let outcomes = cluster.put_many(keys, data.into()).await.unwrap();
        assert!(outcomes.iter().all(|o| *o == PutOutcome::Stored), "{outcomes:?}");
    }
    put(&cluster, &keys, 0).await;
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = {
        let (sent, cluster, keys) = (sent.clone(), cluster.clone(), keys.clone());
        tokio::spawn(async move {
            for version in 1..=300 {
                sent.store(version, std::sync::atomic::Ordering::SeqCst);
                put(&cluster, &keys, version).await;
            }
        })
    };
    let (mut reads, mut misses) = (0u64, Vec::new());
    while !writer.is_finished() {
        let got = cluster.get_many(&keys).await.unwrap();
        // Read after the get: every version it returned had been sent by then.
        let newest = sent.load(std::sync::atomic::Ordering::SeqCst);
        for (i, data) in got.iter().enumerate() {
            reads += 1;
            match data {
                None => misses.push(i),
                Some(data) => assert!(
                    (0..=newest).any(|v| data[..] == page(i as u64, v)[..]),
                    "page {i} holds no version sent"
                ),
            }
        }
    }
    writer.await.unwrap();
    println!("{reads} reads during 300 puts of the same 16 keys, {} misses", misses.len());
    assert!(reads > 0);
    assert!(
        misses.is_empty(),
        "{} of {reads} reads missed; the first pages that did: {:?}",
        misses.len(),
        &misses[..misses.len().min(16)]
    );
}
