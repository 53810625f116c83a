//! Three real `fallow node` processes on 127.0.0.1 that join each other by gossip: one is
//! SIGKILLed and `fallow stat --cluster --json` on another shows it dead within about a
//! second, then alive again once it is restarted on the same addresses; the membership
//! metrics follow. A gossip datagram replayed or altered on its way is dropped. Every
//! process is stopped by its PID (support::Daemon).

mod support;

use std::io::{Read, Write};
use std::net::{TcpStream, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{free_port, start_node, Daemon, TempDir};

const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A UDP port on 127.0.0.1 that was free a moment ago.
fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// One node's fixed addresses, so that a restart comes back on the same ones.
struct Addrs {
    listen: String,
    gossip: String,
}

fn start(addrs: &Addrs, peers: &[&Addrs], secret: &Path, extra: &[&str]) -> Daemon {
    let join: Vec<&str> = peers.iter().map(|p| p.gossip.as_str()).collect();
    let join = join.join(",");
    let mut args = vec!["--listen", &addrs.listen, "--gossip", &addrs.gossip, "--join", &join];
    args.extend(["--lend", "16M", "--secret-file", secret.to_str().unwrap()]);
    args.extend(extra);
    start_node(&args, START_TIMEOUT).0
}

/// `fallow stat --cluster --json` against `node`.
fn members(node: &str, secret: &Path) -> Value {
    let out = support::fallow()
        .args(["stat", "--cluster", "--json", "--timeout", "2", "--node", node])
        .args(["--secret-file", secret.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "stat --cluster failed: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The state and generation of member `id` in a `stat --cluster --json` answer.
fn member(list: &Value, id: &str) -> Option<(String, u64)> {
    list["members"].as_array()?.iter().find(|m| m["id"] == id).map(|m| {
        (m["state"].as_str().unwrap_or("?").to_string(), m["generation"].as_u64().unwrap_or(0))
    })
}

/// Polls `stat --cluster` on `node` until `done` holds for its answer; returns the time
/// it took, or panics after `limit`.
fn wait_for(
    node: &str,
    secret: &Path,
    what: &str,
    limit: Duration,
    done: impl Fn(&Value) -> bool,
) -> Duration {
    let start = Instant::now();
    loop {
        let list = members(node, secret);
        if done(&list) {
            return start.elapsed();
        }
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}; last answer: {list:#}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Scrapes `addr` until its page holds every line of `want` (or panics after 3 s with
/// the cluster lines of the last page).
fn scrape_until(addr: &str, want: &[&str]) {
    let start = Instant::now();
    loop {
        let text = scrape(addr);
        if want.iter().all(|line| text.lines().any(|l| l == *line)) {
            return;
        }
        let cluster: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("fallow_node_cluster") || l.starts_with("fallow_node_gossip"))
            .collect();
        assert!(start.elapsed() < Duration::from_secs(3), "want {want:?}, got {cluster:#?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The body of `GET /metrics` on `addr`.
fn scrape(addr: &str) -> String {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

#[test]
fn a_killed_node_is_seen_dead_within_a_second_and_alive_after_a_restart() {
    let dir = TempDir::new("cluster");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "cluster-test-secret-0123456789abcdef\n").unwrap();
    let addrs: Vec<Addrs> = (0..3)
        .map(|_| Addrs {
            listen: format!("127.0.0.1:{}", free_port()),
            gossip: format!("127.0.0.1:{}", free_udp_port()),
        })
        .collect();
    let (a, b, c) = (&addrs[0], &addrs[1], &addrs[2]);
    let mut _node_a = start(a, &[b, c], &secret, &["--metrics", "127.0.0.1:0"]);
    let metrics = _node_a.wait_for_line("metrics", START_TIMEOUT, support::metrics_addr);
    let mut node_b = start(b, &[a, c], &secret, &[]);
    let _node_c = start(c, &[a, b], &secret, &[]);

    let took = wait_for(&a.listen, &secret, "three alive members", Duration::from_secs(10), |l| {
        l["alive"] == 3
    });
    println!("three nodes converged {took:?} after the last one logged its address");
    let list = members(&a.listen, &secret);
    let (_, generation) = member(&list, &b.listen).unwrap();
    let b_entry = list["members"].as_array().unwrap().iter().find(|m| m["id"] == b.listen);
    assert_eq!(b_entry.unwrap()["lendable_bytes"], 16u64 << 20);

    // Let the detector learn the pace of news, then kill b without warning.
    std::thread::sleep(Duration::from_secs(1));
    node_b.kill();
    let detected = wait_for(&c.listen, &secret, "b dead on c", Duration::from_secs(5), |l| {
        member(l, &b.listen).is_some_and(|(state, _)| state == "dead")
    });
    println!("SIGKILLed node seen dead by `stat --cluster` on another node after {detected:?}");
    assert!(detected < Duration::from_secs(2), "detection took {detected:?}");

    scrape_until(
        &metrics,
        &[
            "fallow_node_cluster_members{state=\"dead\"} 1",
            "fallow_node_cluster_member_events_total{event=\"failed\"} 1",
        ],
    );

    let restarted = Instant::now();
    let _node_b = start(b, &[a, c], &secret, &[]);
    let back = wait_for(&c.listen, &secret, "b alive again", Duration::from_secs(5), |l| {
        member(l, &b.listen).is_some_and(|(state, g)| state == "alive" && g > generation)
    });
    println!(
        "restarted node alive again {back:?} after it logged its address ({:?} after its start)",
        restarted.elapsed()
    );
    scrape_until(
        &metrics,
        &[
            "fallow_node_cluster_members{state=\"alive\"} 3",
            "fallow_node_gossip_rejected_datagrams_total 0",
        ],
    );
}

#[test]
fn a_node_without_gossip_says_it_is_not_in_a_cluster() {
    let dir = TempDir::new("cluster-alone");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "cluster-test-secret-0123456789abcdef\n").unwrap();
    let s = secret.to_str().unwrap();
    let (_node, addr) = start_node(
        &["--listen", "127.0.0.1:0", "--lend", "16M", "--secret-file", s],
        START_TIMEOUT,
    );
    let out = support::fallow()
        .args(["stat", "--cluster", "--node", &addr, "--secret-file", s])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("not in a cluster"), "{out:?}");
    let unix = format!("unix:{}", dir.path().join("node.sock").display());
    let bad = support::fallow()
        .args(["node", "--listen", &unix, "--join", "127.0.0.1:1", "--secret-file", s])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(!bad.status.success() && err.contains("TCP --listen"), "{err}");
}

/// `--advertise` is the address the cluster is told (a node behind a proxy or NAT): it
/// names the member in `stat --cluster`, which reaches the node at its listen address;
/// without gossip the flag is refused with the reason.
#[test]
fn an_advertised_address_names_the_member() {
    let dir = TempDir::new("cluster-advertise");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "cluster-test-secret-0123456789abcdef\n").unwrap();
    let s = secret.to_str().unwrap();
    let advertised = format!("127.0.0.2:{}", free_port());
    let gossip = format!("127.0.0.1:{}", free_udp_port());
    let (_node, addr) = start_node(
        &["--listen", "127.0.0.1:0", "--gossip", &gossip, "--advertise", &advertised]
            .into_iter()
            .chain(["--lend", "16M", "--secret-file", s])
            .collect::<Vec<_>>(),
        START_TIMEOUT,
    );
    let list = members(&addr, &secret);
    assert_eq!(member(&list, &advertised).map(|m| m.0), Some("alive".to_string()), "{list}");
    let alone = support::fallow()
        .args(["node", "--listen", "127.0.0.1:0", "--advertise", &advertised])
        .args(["--secret-file", s])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&alone.stderr);
    assert!(!alone.status.success() && err.contains("needs --join or --gossip"), "{err}");
}

/// The rejected-datagram counter on the metrics page at `addr`.
fn rejected(addr: &str) -> u64 {
    let text = scrape(addr);
    let line = text.lines().find(|l| l.starts_with("fallow_node_gossip_rejected_datagrams_total "));
    line.and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or_else(|| panic!("{text}"))
}

/// Gossip between two nodes through a relay of the test's own, which keeps a copy of a
/// datagram node B sent node A and later sends it to A again, as it was and with a byte
/// changed: A drops both, and counts them.
#[test]
fn a_gossip_datagram_replayed_or_altered_is_dropped() {
    let dir = TempDir::new("cluster-replay");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "cluster-replay-test-secret-0123456789\n").unwrap();
    let relay = UdpSocket::bind("127.0.0.1:0").unwrap();
    relay.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    let a = Addrs {
        listen: format!("127.0.0.1:{}", free_port()),
        gossip: format!("127.0.0.1:{}", free_udp_port()),
    };
    let b = Addrs {
        listen: format!("127.0.0.1:{}", free_port()),
        gossip: format!("127.0.0.1:{}", free_udp_port()),
    };
    let through = Addrs { listen: String::new(), gossip: relay.local_addr().unwrap().to_string() };
    // A knows no one; B joins A through the relay, and A answers the relay.
    let s = secret.to_str().unwrap();
    let own = ["--listen", &a.listen, "--gossip", &a.gossip, "--metrics", "127.0.0.1:0"];
    let mut _node_a =
        start_node(&[&own[..], &["--lend", "16M", "--secret-file", s]].concat(), START_TIMEOUT).0;
    let metrics = _node_a.wait_for_line("metrics", START_TIMEOUT, support::metrics_addr);
    let _node_b = start(&b, &[&through], &secret, &[]);
    let (a_gossip, b_gossip): (std::net::SocketAddr, std::net::SocketAddr) =
        (a.gossip.parse().unwrap(), b.gossip.parse().unwrap());
    let mut captured: Option<Vec<u8>> = None;
    let mut buf = vec![0u8; 65_536];
    // Relay B's datagrams to A and A's back to B, keeping B's first, until a second after
    // it (A has taken it by then), or 10 s.
    let mut until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let Ok((len, from)) = relay.recv_from(&mut buf) else { continue };
        let to = if from == b_gossip { a_gossip } else { b_gossip };
        if from == b_gossip && captured.is_none() {
            captured = Some(buf[..len].to_vec());
            until = until.min(Instant::now() + Duration::from_secs(1));
        }
        relay.send_to(&buf[..len], to).unwrap();
    }
    let datagram = captured.expect("B sent nothing through the relay");
    assert_eq!(rejected(&metrics), 0, "A refused honest gossip");
    // The same datagram again, then one with a byte of its ciphertext changed.
    relay.send_to(&datagram, a_gossip).unwrap();
    scrape_until(&metrics, &["fallow_node_gossip_rejected_datagrams_total 1"]);
    let mut altered = datagram.clone();
    altered[30] ^= 0x40;
    relay.send_to(&altered, a_gossip).unwrap();
    scrape_until(&metrics, &["fallow_node_gossip_rejected_datagrams_total 2"]);
}
