//! The harness shared by the integration tests of the `fallow` binary: the binary under
//! test, a node started and its address found in its log, the URIs, addresses and sockets
//! its log lines name, qemu-io, and guests (`guests`). The process helpers (children killed
//! by PID when dropped, daemons whose stderr is searched, scratch directories, free ports,
//! bounded polling) are `fallow_testkit::process`, re-exported here; what each test checks
//! stays in the test's own file.

// Each test binary uses a different part of this module.
#![allow(dead_code)]

pub mod faulty;
pub mod guests;
pub mod netns;

use std::process::{Command, Stdio};
use std::time::Duration;

pub use fallow_testkit::process::*;

/// The `fallow` binary under test, built by Cargo for the integration tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_fallow");

/// A command that runs the `fallow` binary under test.
pub fn fallow() -> Command {
    Command::new(BIN)
}

/// Runs `qemu-io -f raw -c COMMAND... URI` under `timeout 60`. Returns whether it exited
/// with status 0, and its stdout and stderr together; what counts as a failure is the
/// caller's to say (qemu-io reports some failed commands with status 0).
pub fn qemu_io(uri: &str, commands: &[&str]) -> (bool, String) {
    let mut cmd = Command::new("timeout");
    cmd.args(["60", "qemu-io", "-f", "raw"]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let out = cmd.arg(uri).output().unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Starts `fallow node ARGS` (logging at `info`, stdin closed) and waits up to `timeout`
/// for the TCP address it logs; returns the running node and that address.
pub fn start_node(args: &[&str], timeout: Duration) -> (Daemon, String) {
    start_node_with(fallow(), args, timeout)
}

/// [`start_node`] with `fallow` as the command that runs the binary under test, e.g.
/// `ip netns exec NETNS BIN` (support::netns).
pub fn start_node_with(mut fallow: Command, args: &[&str], timeout: Duration) -> (Daemon, String) {
    Daemon::start(
        "the node",
        fallow.arg("node").args(args).env("FALLOW_LOG", "info").stdin(Stdio::null()),
        "TCP address",
        timeout,
        node_tcp_addr,
    )
}

/// Starts `count` nodes on 127.0.0.1 that gossip with one another (`--gossip`, `--join`),
/// each with `args` besides, and waits until the first lists them all alive. Returns the
/// nodes and their protocol addresses, in the same order.
pub fn start_cluster(
    count: usize,
    args: &[&str],
    secret: &std::path::Path,
    timeout: Duration,
) -> (Vec<Daemon>, Vec<String>) {
    let s = secret.to_str().unwrap();
    let addrs: Vec<(String, String)> = (0..count)
        .map(|_| {
            let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
            (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", udp.port()))
        })
        .collect();
    let nodes = (0..count)
        .map(|i| {
            let join: Vec<&str> =
                (0..count).filter(|j| *j != i).map(|j| addrs[j].1.as_str()).collect();
            let join = join.join(",");
            let (listen, gossip) = (&addrs[i].0, &addrs[i].1);
            let own = ["--listen", listen, "--gossip", gossip, "--join", &join, "--secret-file", s];
            start_node(&[&own[..], args].concat(), timeout).0
        })
        .collect();
    let first = &addrs[0].0;
    let converged = poll_until(Duration::from_secs(10), || {
        let out = fallow()
            .args(["stat", "--cluster", "--json", "--timeout", "2", "--node", first])
            .args(["--secret-file", s])
            .output()
            .unwrap();
        let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        list["alive"] == count
    });
    assert!(converged, "{count} nodes did not converge");
    (nodes, addrs.into_iter().map(|(tcp, _)| tcp).collect())
}

/// The address in a `fallow node` log line `... listening on TCP addr=127.0.0.1:PORT`.
pub fn node_tcp_addr(line: &str) -> Option<String> {
    if !line.contains("listening on TCP") {
        return None;
    }
    let addr = line.split_once("addr=")?.1.split_whitespace().next()?;
    Some(addr.to_string())
}

/// The URI in a `fallow nbd: serving URI` line.
pub fn nbd_serving_uri(line: &str) -> Option<String> {
    line.strip_prefix("fallow nbd: serving ").map(|u| u.trim().to_string())
}

/// The socket path in a `fallow vhost: serving NAME at PATH` line.
pub fn vhost_socket(line: &str) -> Option<std::path::PathBuf> {
    let rest = line.strip_prefix("fallow vhost: serving ")?;
    Some(std::path::PathBuf::from(rest.split_once(" at ")?.1.trim()))
}

/// The address in a log line `... serving metrics at http://ADDR/metrics ...`.
pub fn metrics_addr(line: &str) -> Option<String> {
    let url = line.split_once("serving metrics at http://")?.1;
    Some(url.split_once("/metrics")?.0.to_string())
}

/// The body of `GET /metrics` on `addr` (a server's `--metrics` address).
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).unwrap();
    text
}

/// The value of the first metric line of `text` that starts with `name{` and contains
/// `labels`, as the caller's number type (a counter's integer, a gauge's float).
pub fn metric<T: std::str::FromStr>(text: &str, name: &str, labels: &str) -> Option<T> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(labels))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A small xorshift generator for tests' random choices: no quality needed, only
/// repeatability from a seed (which must not be 0).
pub struct Rng(pub u64);

impl Rng {
    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }

    /// A delay of up to `ms` milliseconds.
    pub fn up_to_ms(&mut self, ms: u64) -> std::time::Duration {
        std::time::Duration::from_millis(self.below(ms + 1))
    }
}
