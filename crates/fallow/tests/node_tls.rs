//! The node protocol over TLS 1.3 (`fallow node --node-tls DIR`), as users run it: the
//! real binary, certificates made by `openssl` (`fallow_testkit::tls::Pki`), and every
//! client that speaks the protocol — `fallow stat`, `fallow nbd` and `fallow bench pages`
//! on a three-node cluster, the nodes themselves (peer forwarding of cluster pools), and the
//! Python client written from `docs/protocol.md`. A plaintext client is told to use TLS and counted; a TLS client
//! of a plaintext node fails at once with a hint; certificates from another CA, for another
//! host or expired are refused; garbage where a handshake belongs never crashes the node.
//!
//! Skipped, with a message, without `openssl` (the certificates); the Python cases also
//! without `python3`, the NBD case without `qemu-io`. Every process is stopped by its PID
//! (dropped `Daemon`s), every file made is under a `TempDir`.

mod support;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use fallow_testkit::tls::{Pki, PkiError};
use support::{free_port, metrics_addr, nbd_serving_uri, poll_until, start_node, Daemon, TempDir};

/// How long a node or `fallow nbd` may take to start (a debug build on a busy machine).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The backstop on every client command run here: none should come near it.
const COMMAND_TIMEOUT: &str = "60";

/// How long a counter may take to show what just happened: the node counts a refusal after
/// it wrote its answer, so a client can see the answer first.
const COUNT_TIMEOUT: Duration = Duration::from_secs(10);

/// The status a node with `--node-tls` sends to a client that starts in the clear.
const TLS_REQUIRED: u8 = 13;

/// A PKI under `dir`, or `None` (the test skips) when `openssl` cannot be run.
fn pki(dir: &TempDir) -> Option<Pki> {
    match Pki::create(&dir.path().join("pki")) {
        Ok(pki) => Some(pki),
        Err(err @ PkiError::Spawn { .. }) => {
            eprintln!("skipping: {err} (Debian package openssl)");
            None
        }
        Err(err) => panic!("{err}"),
    }
}

/// Whether python3 runs; says why a test skips when it does not.
fn have_python() -> bool {
    let ok = support::command_works("python3", &["--version"]);
    if !ok {
        eprintln!(
            "skipping: python3 is not installed (the client needs only its standard library)"
        );
    }
    ok
}

/// A secret file in `dir`.
fn secret_file(dir: &TempDir) -> PathBuf {
    let path = dir.path().join("secret");
    std::fs::write(&path, "node-tls-test-secret-0123456789abcdef\n").unwrap();
    path
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Starts a node listening on 127.0.0.1 with `args` besides, and Prometheus metrics;
/// returns it, its protocol address and its metrics address.
fn start_with_metrics(args: &[&str]) -> (Daemon, String, String) {
    let own = ["--listen", "127.0.0.1:0", "--lend", "32M", "--metrics", "127.0.0.1:0"];
    let (mut node, addr) = start_node(&[&own[..], args].concat(), START_TIMEOUT);
    let metrics = node.wait_for_line("metrics address", START_TIMEOUT, metrics_addr);
    (node, addr, metrics)
}

/// A node serving the node protocol over TLS with the certificate in `tls_dir`.
fn start_tls_node(tls_dir: &Path, secret: &Path) -> (Daemon, String, String) {
    start_with_metrics(&["--node-tls", s(tls_dir), "--secret-file", s(secret)])
}

/// Runs `fallow ARGS` under `timeout`; returns its output and how long it took.
fn run_fallow(args: &[&str]) -> (Output, Duration) {
    let started = Instant::now();
    let out = Command::new("timeout")
        .arg(COMMAND_TIMEOUT)
        .arg(support::BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (out, started.elapsed())
}

/// `fallow stat --node ADDR` with the secret and, if given, `--node-tls DIR`.
fn stat(addr: &str, secret: &Path, tls: Option<&Path>) -> (Output, Duration) {
    let mut args = vec!["stat", "--node", addr, "--secret-file", s(secret), "--timeout", "10"];
    if let Some(dir) = tls {
        args.extend(["--node-tls", s(dir)]);
    }
    run_fallow(&args)
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

use support::{metric, scrape};

/// How many rejections of `kind` the node with metrics at `addr` has counted.
fn rejections(addr: &str, kind: &str) -> u64 {
    let labels = format!("kind=\"{kind}\"");
    metric(&scrape(addr), "fallow_node_protocol_errors_total", &labels).unwrap_or(0)
}

/// Waits until the node counts `want` rejections of `kind`; panics with the count it
/// stopped at otherwise, or when the count goes past `want`.
fn await_rejections(addr: &str, kind: &str, want: u64) {
    let reached = poll_until(COUNT_TIMEOUT, || rejections(addr, kind) >= want);
    let got = rejections(addr, kind);
    assert!(reached && got == want, "{kind} rejections: {got}, expected {want}");
}

/// Starts `count` nodes on 127.0.0.1 that gossip with one another, all with
/// `--node-tls tls_dir`, and waits until the first lists them all alive (asked with
/// `fallow stat --cluster --node-tls`). `support::start_cluster`, over TLS.
fn start_tls_cluster(
    count: usize,
    tls_dir: &Path,
    secret: &Path,
) -> (Vec<Daemon>, Vec<String>, Vec<String>) {
    let addrs: Vec<(String, String)> = (0..count)
        .map(|_| {
            let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
            (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", udp.port()))
        })
        .collect();
    let mut nodes = Vec::new();
    let mut metrics = Vec::new();
    for (i, (listen, gossip)) in addrs.iter().enumerate() {
        let join: Vec<&str> = (0..count).filter(|j| *j != i).map(|j| addrs[j].1.as_str()).collect();
        let join = join.join(",");
        let args = [
            "--listen",
            listen,
            "--gossip",
            gossip,
            "--join",
            &join,
            "--secret-file",
            s(secret),
            "--node-tls",
            s(tls_dir),
            "--lend",
            "64M",
            "--metrics",
            "127.0.0.1:0",
        ];
        let (mut node, _) = start_node(&args, START_TIMEOUT);
        metrics.push(node.wait_for_line("metrics address", START_TIMEOUT, metrics_addr));
        nodes.push(node);
    }
    let first = &addrs[0].0;
    let converged = poll_until(Duration::from_secs(15), || {
        let (out, _) = run_fallow(&[
            "stat",
            "--cluster",
            "--json",
            "--timeout",
            "2",
            "--node",
            first,
            "--secret-file",
            s(secret),
            "--node-tls",
            s(tls_dir),
        ]);
        let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        list["alive"] == count
    });
    assert!(converged, "{count} TLS nodes did not converge:\n{}", nodes[0].log_so_far());
    (nodes, addrs.into_iter().map(|(tcp, _)| tcp).collect(), metrics)
}

/// Runs the Python `script` (which imports `fallow_client` from tests/compliance) with
/// `args`, bounded by `timeout`; returns whether it succeeded and its output.
fn run_python(script: &str, args: &[&str]) -> (bool, String) {
    let compliance = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/compliance");
    let out = Command::new("timeout")
        .args([COMMAND_TIMEOUT, "python3", "-c", script])
        .args(args)
        .env("PYTHONPATH", compliance)
        // Leaves no __pycache__ in the source tree.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!("{}{}", stdout(&out), stderr(&out));
    (out.status.success(), text)
}

/// Asserts that the node is still running and answers `fallow stat --node-tls`.
fn assert_serves(node: &mut Daemon, addr: &str, secret: &Path, ca: &Path) {
    assert!(node.is_running(), "the node exited:\n{}", node.log_so_far());
    let (out, _) = stat(addr, secret, Some(ca));
    assert!(
        out.status.success() && stdout(&out).contains(addr),
        "the node no longer serves TLS clients: {out:?}\n{}",
        node.log_so_far()
    );
    assert!(!node.log_so_far().contains("panicked"), "{}", node.log_so_far());
}

#[test]
fn a_tls_node_serves_tls_clients_and_tells_plaintext_ones_to_use_tls() {
    let dir = TempDir::new("node-tls-refuse");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let (mut node, addr, metrics) = start_tls_node(&pki.server_dir(), &secret);
    assert!(node.log_so_far().contains("over TLS 1.3"), "{}", node.log_so_far());

    let (out, _) = stat(&addr, &secret, Some(&pki.client_dir()));
    assert!(out.status.success(), "{out:?}");
    let table = stdout(&out);
    assert!(table.contains(&format!("node          {addr}")) && table.contains("lent"), "{table}");
    assert_eq!(rejections(&metrics, "tls_handshake"), 0, "a good handshake was counted");

    let (out, _) = stat(&addr, &secret, None);
    let err = stderr(&out);
    assert!(!out.status.success(), "a plaintext stat was served: {out:?}");
    assert!(err.contains("requires TLS") && err.contains("--node-tls"), "{err}");
    await_rejections(&metrics, "tls_required", 1);

    // What a plaintext client reads: one frame in the clear, then the end of the stream.
    let mut hello = 12u32.to_le_bytes().to_vec();
    hello.extend([0x01, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    let reply = send_raw(&addr, &hello, false);
    assert!(reply.len() > 16, "{reply:?}");
    let length = u32::from_le_bytes(reply[..4].try_into().unwrap()) as usize;
    assert_eq!(length + 4, reply.len(), "one frame, then close: {reply:?}");
    let (op, status, id) =
        (reply[4], reply[5], u64::from_le_bytes(reply[8..16].try_into().unwrap()));
    assert_eq!((op, status, id), (0, TLS_REQUIRED, 0), "{reply:?}");
    let message = String::from_utf8_lossy(&reply[16..]);
    assert!(message.contains("only TLS") && message.contains("--node-tls DIR"), "{message}");
    await_rejections(&metrics, "tls_required", 2);

    assert_serves(&mut node, &addr, &secret, &pki.client_dir());
    assert_eq!(rejections(&metrics, "tls_handshake"), 0);
}

#[test]
fn node_tls_in_the_config_file_secures_tcp_and_leaves_the_unix_socket_in_the_clear() {
    let dir = TempDir::new("node-tls-config");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let socket = dir.path().join("node.sock");
    let config = dir.path().join("node.toml");
    std::fs::write(
        &config,
        format!(
            "listen = [\"127.0.0.1:0\", \"unix:{}\"]\nlend = \"16M\"\nnode_tls = \"{}\"\n",
            socket.display(),
            pki.server_dir().display()
        ),
    )
    .unwrap();
    let (mut node, addr) =
        start_node(&["--config", s(&config), "--secret-file", s(&secret)], START_TIMEOUT);

    let (out, _) = stat(&addr, &secret, None);
    assert!(!out.status.success() && stderr(&out).contains("requires TLS"), "{out:?}");
    let (out, _) = stat(&addr, &secret, Some(&pki.ca_only_dir()));
    assert!(out.status.success() && stdout(&out).contains(&addr), "{out:?}");
    // A Unix socket never leaves the host: plaintext there, with or without the flag.
    let unix = format!("unix:{}", socket.display());
    assert!(poll_until(START_TIMEOUT, || socket.exists()), "no {}", socket.display());
    for tls in [None, Some(pki.ca_only_dir())] {
        let (out, _) = stat(&unix, &secret, tls.as_deref());
        assert!(out.status.success() && stdout(&out).contains("lent"), "{tls:?}: {out:?}");
    }
    assert!(node.is_running());
}

#[test]
fn a_tls_client_of_a_plaintext_node_fails_at_once_with_a_hint() {
    let dir = TempDir::new("node-tls-plain");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let (mut node, addr, metrics) = start_with_metrics(&["--secret-file", s(&secret)]);

    // `--timeout 10` in `stat`: failing well within it proves no wait on a handshake.
    let (out, took) = stat(&addr, &secret, Some(&pki.client_dir()));
    let err = stderr(&out);
    assert!(!out.status.success(), "a TLS stat succeeded against a plaintext node: {out:?}");
    assert!(
        err.contains(&format!("TLS with {addr} failed"))
            && err.contains("does the node run with --node-tls"),
        "{err}"
    );
    assert!(took < Duration::from_secs(3), "the TLS client took {took:?} to give up");
    await_rejections(&metrics, "tls_on_plaintext", 1);

    let (out, _) = stat(&addr, &secret, None);
    assert!(out.status.success() && stdout(&out).contains(&addr), "{out:?}");
    assert!(node.is_running());
}

#[test]
fn certificates_from_another_ca_or_for_another_host_are_refused_and_an_expired_one_never_served() {
    let dir = TempDir::new("node-tls-certs");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let client = pki.client_dir();

    // The good node: the client's own CA is accepted, another CA is not.
    let (_good, addr, metrics) = start_tls_node(&pki.server_dir(), &secret);
    let (out, _) = stat(&addr, &secret, Some(&client));
    assert!(out.status.success(), "the good certificate was refused: {out:?}");
    let (out, _) = stat(&addr, &secret, Some(&pki.other_ca_dir()));
    let err = stderr(&out);
    assert!(!out.status.success(), "a certificate from an untrusted CA was accepted: {out:?}");
    assert!(err.contains("TLS with") && err.contains("unable to get local issuer"), "{err}");
    // The node sees the client abort the handshake.
    await_rejections(&metrics, "tls_handshake", 1);

    // Signed by the trusted CA, but for DNS:wrong.example only, dialled as 127.0.0.1.
    let (_wrong, addr, _) = start_tls_node(&pki.wrong_host_dir(), &secret);
    let (out, _) = stat(&addr, &secret, Some(&client));
    let err = stderr(&out);
    assert!(!out.status.success(), "a certificate for another host was accepted: {out:?}");
    assert!(err.contains("TLS with") && err.contains("IP address mismatch"), "{err}");

    // Signed by the trusted CA, for 127.0.0.1, but expired in 2020: the node refuses to
    // start with it (every client would refuse it, far from the cause), as QEMU does.
    let out = Command::new("timeout")
        .args(["20", support::BIN, "node", "--listen", "127.0.0.1:0", "--lend", "16M"])
        .args(["--secret-file", s(&secret), "--node-tls"])
        .arg(pki.expired_dir())
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "a node started with an expired certificate: {out:?}");
    assert!(err.contains("server-cert.pem") && err.contains("expired on"), "{err}");
}

#[test]
fn an_nbd_export_caches_in_a_tls_cluster() {
    if !support::command_works("qemu-io", &["--version"]) {
        eprintln!("skipping: qemu-io is not installed (Debian package qemu-utils)");
        return;
    }
    let dir = TempDir::new("node-tls-nbd");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let (mut nodes, addrs, _) = start_tls_cluster(3, &pki.server_dir(), &secret);

    let image = dir.path().join("d.img");
    let export = format!("d=file:{},size=16M", image.display());
    let pool = format!("fallow://{}", addrs.join(","));
    let nbd_args = |tls: Option<&Path>| {
        let mut cmd = support::fallow();
        cmd.args(["nbd", "--listen", "127.0.0.1:0", "--export", &export, "--pool", &pool])
            .args(["--secret-file", s(&secret), "--local-tier", "0"])
            .args(["--metrics", "127.0.0.1:0"])
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null());
        if let Some(tls) = tls {
            cmd.args(["--node-tls", s(tls)]);
        }
        cmd
    };

    // Without --node-tls the export cannot use the cluster: it stops, and says why.
    let mut plain = Daemon::spawn("fallow nbd (plaintext)", &mut nbd_args(None));
    let status = plain.wait_timeout(START_TIMEOUT);
    let log = plain.log_so_far();
    assert!(status.is_some_and(|s| !s.success()), "{status:?}\n{log}");
    assert!(log.contains("requires TLS"), "no word of TLS from a plaintext export:\n{log}");

    let mut server = Daemon::spawn("fallow nbd", &mut nbd_args(Some(&pki.client_dir())));
    let metrics = server.wait_for_line("metrics address", START_TIMEOUT, metrics_addr);
    let uri = server.wait_for_line("URI", START_TIMEOUT, nbd_serving_uri);
    let log = server.log_so_far();
    assert!(log.contains("caching in a cluster") && log.contains("nodes=3"), "{log}");

    // Reads of 64 KiB, under the scan threshold, populate the pool (there is no local
    // tier); the second pass reads what the first put there.
    let mut commands = vec!["write -P 0x5a 0 1M".to_string(), "write -P 0xa5 1M 1M".to_string()];
    for _pass in 0..2 {
        for chunk in 0..32 {
            let pattern = if chunk < 16 { "0x5a" } else { "0xa5" };
            commands.push(format!("read -P {pattern} {}k 64k", chunk * 64));
        }
    }
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    let (ok, text) = support::qemu_io(&uri, &commands);
    assert!(ok && !text.contains("fail") && !text.contains("rror"), "{text}");
    let scraped = scrape(&metrics);
    let pool_reads: Option<u64> =
        metric(&scraped, "fallow_nbd_cache_pages_read_total", "tier=\"pool\"");
    let errors: Option<u64> = metric(&scraped, "fallow_nbd_pool_errors_total", "export=\"d\"");
    assert!(pool_reads.is_some_and(|n| n > 0), "the pool served no read:\n{scraped}");
    // A pool request that times out on a loaded machine (250 ms) is a miss, not a fault
    // of TLS: a few are tolerated, a failing channel would make them all fail.
    assert!(errors.unwrap_or(0) <= 2, "pool errors reached the cache:\n{scraped}");
    // Every node holds some of the export's pages: the client spoke TLS to each.
    for (node, addr) in nodes.iter_mut().zip(&addrs) {
        let (out, _) = run_fallow(&[
            "stat",
            "--json",
            "--node",
            addr,
            "--secret-file",
            s(&secret),
            "--node-tls",
            s(&pki.client_dir()),
        ]);
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        assert!(json["pages"].as_u64().is_some_and(|n| n > 0), "{addr}: {out:?}");
        assert!(node.is_running());
    }
    assert!(server.is_running() && !server.log_so_far().contains("panicked"));
    assert!(server.signal("TERM").success());
    assert!(server.wait_timeout(Duration::from_secs(15)).is_some_and(|s| s.success()));
}

#[test]
fn bench_pages_reaches_a_tls_cluster_only_with_node_tls() {
    let dir = TempDir::new("node-tls-bench");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let (mut nodes, addrs, _) = start_tls_cluster(3, &pki.server_dir(), &secret);
    let target = format!("cluster://{}", addrs.join(","));
    let bench = |tls: Option<&Path>| {
        let mut args = vec!["bench", "pages", "--target", &target, "--secret-file", s(&secret)];
        args.extend(["--keys", "300", "--warmup", "-q", "4", "-d", "500ms", "--json", "--quiet"]);
        if let Some(dir) = tls {
            args.extend(["--node-tls", s(dir)]);
        }
        run_fallow(&args).0
    };

    let out = bench(Some(&pki.ca_only_dir()));
    assert!(out.status.success(), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["warmup_pages"], 300, "{report}");
    assert_eq!(report["wrong"], 0, "{report}");
    assert!(report["hits"].as_u64().is_some_and(|n| n > 0), "{report}");
    assert_eq!(report["misses"], 0, "{report}");

    let out = bench(None);
    let err = stderr(&out);
    assert!(!out.status.success(), "a plaintext cluster client was served: {out:?}");
    assert!(err.contains("requires TLS"), "{err}");
    for node in &mut nodes {
        assert!(node.is_running(), "{}", node.log_so_far());
    }
}

/// Puts pages in a cluster pool through the first node given, reads them back, and says
/// how many pages each node holds. Arguments: SECRET_FILE CA_CERT ADDR...
const FORWARD_SCRIPT: &str = r#"
import os, sys
import fallow_client as fc
secret, ca = fc.read_secret(sys.argv[1]), sys.argv[2]
addrs = [a.rsplit(":", 1) for a in sys.argv[3:]]
host, port = addrs[0]
pages = [(9, i, os.urandom(64) * 64) for i in range(300)]
with fc.Client.connect(host, int(port), secret, tls_ca=ca) as c:
    pool = c.create_pool(cluster=True)
    assert pool & 0x80000000, "not a cluster pool: %#x" % pool
    assert c.put(pool, pages) == [fc.STORED] * len(pages)
    got = c.get(pool, [(o, i) for o, i, _ in pages])
    assert got == [p for _, _, p in pages], "pages read back differ"
for host, port in addrs:
    with fc.Client.connect(host, int(port), secret, tls_ca=ca) as c:
        print("pages on %s:%s: %d" % (host, port, c.stats()["pages"]))
print("cluster pool forwarded over TLS")
"#;

#[test]
fn cluster_pools_are_forwarded_between_tls_nodes() {
    if !have_python() {
        return;
    }
    let dir = TempDir::new("node-tls-forward");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let (mut nodes, addrs, metrics) = start_tls_cluster(3, &pki.server_dir(), &secret);
    let ca = pki.ca_only_dir().join("ca-cert.pem");

    let mut args = vec![s(&secret), s(&ca)];
    args.extend(addrs.iter().map(String::as_str));
    let (ok, output) = run_python(FORWARD_SCRIPT, &args);
    assert!(ok, "{output}\n--- first node ---\n{}", nodes[0].log_so_far());
    println!("{output}");
    // The first node kept some pages and handed the others to its peers, over TLS.
    for addr in &addrs {
        let line = format!("pages on {addr}: ");
        let count = output.lines().find_map(|l| l.strip_prefix(&line)?.parse::<u64>().ok());
        assert!(count.is_some_and(|n| n > 0), "no page reached {addr}:\n{output}");
    }
    let scraped = scrape(&metrics[0]);
    let forwarded: Option<u64> =
        metric(&scraped, "fallow_node_forwarded_requests_total", "op=\"put\"");
    assert!(forwarded.is_some_and(|n| n > 0), "nothing forwarded:\n{scraped}");
    for (node, metrics) in nodes.iter_mut().zip(&metrics) {
        assert_eq!(rejections(metrics, "tls_handshake"), 0, "a peer handshake failed");
        assert_eq!(rejections(metrics, "tls_required"), 0, "a peer spoke in the clear");
        assert!(node.is_running(), "{}", node.log_so_far());
    }
}

/// Over TLS: puts and gets a page; in the clear: TlsRequired; with another CA: a
/// certificate error. Arguments: HOST PORT SECRET_FILE CA_CERT OTHER_CA_CERT.
const PYTHON_TLS_SCRIPT: &str = r#"
import ssl, sys
import fallow_client as fc
host, port, secret = sys.argv[1], int(sys.argv[2]), fc.read_secret(sys.argv[3])
ca, other_ca = sys.argv[4], sys.argv[5]
page = bytes(range(256)) * 16
with fc.Client.connect(host, port, secret, tls_ca=ca) as c:
    assert c.sock.version() == "TLSv1.3", c.sock.version()
    c.ping()
    pool = c.create_pool()
    assert c.put(pool, [(7, 3, page)]) == [fc.STORED]
    assert c.get(pool, [(7, 3), (7, 4)]) == [page, None]
    print("over %s: put and got a page" % c.sock.version())
try:
    fc.Client.connect(host, port, secret)
    sys.exit("a plaintext client was served")
except fc.TlsRequired as e:
    assert e.status == fc.TLS_REQUIRED and "--node-tls" in str(e), str(e)
    print("in the clear: %s" % e)
try:
    fc.Client.connect(host, port, secret, tls_ca=other_ca)
    sys.exit("a certificate from another CA was accepted")
except ssl.SSLCertVerificationError as e:
    print("another CA: %s" % e.verify_message)
"#;

#[test]
fn the_python_client_speaks_tls_and_explains_a_plaintext_refusal() {
    if !have_python() {
        return;
    }
    let dir = TempDir::new("node-tls-python");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let (mut node, addr, metrics) = start_tls_node(&pki.server_dir(), &secret);
    let (host, port) = addr.rsplit_once(':').unwrap();
    let ca = pki.ca_only_dir().join("ca-cert.pem");
    let other_ca = pki.other_ca_dir().join("ca-cert.pem");

    let args = [host, port, s(&secret), s(&ca), s(&other_ca)];
    let (ok, output) = run_python(PYTHON_TLS_SCRIPT, &args);
    assert!(ok, "{output}\n--- node ---\n{}", node.log_so_far());
    assert!(output.contains("over TLSv1.3: put and got a page"), "{output}");
    assert!(output.contains("in the clear: the node requires TLS"), "{output}");
    assert!(output.contains("another CA: unable to get local issuer certificate"), "{output}");
    await_rejections(&metrics, "tls_required", 1);
    await_rejections(&metrics, "tls_handshake", 1);
    assert!(node.is_running());
}

/// Connects to `addr`, sends `bytes`, half-closes if `close` says so, and reads until the
/// node closes (at most 10 s). Returns what the node sent. A reset counts as a close: a
/// node that closes with bytes of ours unread makes the kernel send a reset, after what
/// it wrote.
fn send_raw(addr: &str, bytes: &[u8], close: bool) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    stream.write_all(bytes).unwrap();
    if close {
        // The node may have closed already, having read enough to refuse.
        let _ = stream.shutdown(Shutdown::Write);
    }
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(err) => {
                panic!("the node kept {bytes:02x?} open for {:?}: {err}", started.elapsed())
            }
        }
    }
    got
}

/// Bytes from a small xorshift generator: "random", the same on every run.
fn noise(len: usize, mut state: u64) -> Vec<u8> {
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A real TLS 1.3 handshake, then garbage: inside TLS (application data that is no
/// frame), then straight on the TCP stream (bytes that are no TLS record); and a TLS 1.2
/// client, which a TLS 1.3 node refuses. Arguments: HOST PORT CA_CERT.
const GARBAGE_AFTER_HANDSHAKE_SCRIPT: &str = r#"
import os, socket, ssl, sys
import fallow_client as fc
host, port, ca = sys.argv[1], int(sys.argv[2]), sys.argv[3]

raw = fc.RawConnection.open(host, port, tls_ca=ca)
raw.send(b"\xff\xff\xff\x7f" + os.urandom(512))
op, status, rid, body = raw.recv_frame()
assert (op, status, rid) == (0, fc.BAD_FRAME, 0), (op, status, rid, body)
assert raw.at_eof()
print("garbage inside TLS: BAD_FRAME, then close")

raw = fc.RawConnection.open(host, port, tls_ca=ca)
plain = socket.socket(fileno=os.dup(raw.sock.fileno()))
plain.sendall(b"\x17\x03\x03\x00\x40" + os.urandom(64) + os.urandom(300))
plain.settimeout(10)
try:
    while raw.sock.recv(4096):
        pass
except (ssl.SSLError, ConnectionResetError):
    pass
plain.close()
raw.close()
print("garbage records after the handshake: closed")

context = fc.tls_context(ca)
context.minimum_version = ssl.TLSVersion.TLSv1_2
context.maximum_version = ssl.TLSVersion.TLSv1_2
try:
    context.wrap_socket(socket.create_connection((host, port), timeout=10), server_hostname=host)
    sys.exit("a TLS 1.2 client was served")
except ssl.SSLError as e:
    print("TLS 1.2: refused (%s)" % e.reason)
"#;

#[test]
fn garbage_and_truncated_tls_records_never_crash_the_node() {
    let dir = TempDir::new("node-tls-garbage");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let ca = pki.client_dir();
    let (mut node, addr, metrics) = start_tls_node(&pki.server_dir(), &secret);

    // A handshake that stalls does not hold up the node's other clients.
    let mut stalled = TcpStream::connect(&addr).unwrap();
    stalled.write_all(&[0x16, 0x03, 0x01, 0x00, 0x80, 0x01]).unwrap();
    assert_serves(&mut node, &addr, &secret, &ca);

    // (a) A TLS record header, then noise; (b) a ClientHello cut short, then close; (c) a
    // record header announcing 65535 bytes, over TLS's limit: refused without waiting.
    let mut record = vec![0x16, 0x03, 0x01];
    record.extend(noise(2000, 0x9e37_79b9_7f4a_7c15));
    send_raw(&addr, &record, true);
    await_rejections(&metrics, "tls_handshake", 1);
    let mut hello = vec![0x16, 0x03, 0x01, 0x00, 0xc8, 0x01, 0x00, 0x00, 0xc4, 0x03, 0x03];
    hello.extend(noise(32, 42));
    send_raw(&addr, &hello, true);
    await_rejections(&metrics, "tls_handshake", 2);
    let started = Instant::now();
    send_raw(&addr, &[0x16, 0x03, 0x01, 0xff, 0xff, 0x01, 0x00], false);
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    await_rejections(&metrics, "tls_handshake", 3);
    // (d) Nothing at all, then close: a probe (a health check, a port scan), closed
    // quietly and counted as nothing. A later connection proves the node went past it.
    send_raw(&addr, &[], true);
    assert_serves(&mut node, &addr, &secret, &ca);
    let counted = rejections(&metrics, "tls_handshake");
    assert_eq!(counted, 3, "a connect-and-close was counted as a failed handshake");

    // (e) A real handshake, then garbage; and a TLS 1.2 client.
    if have_python() {
        let (host, port) = addr.rsplit_once(':').unwrap();
        let ca_cert = ca.join("ca-cert.pem");
        let (ok, output) = run_python(GARBAGE_AFTER_HANDSHAKE_SCRIPT, &[host, port, s(&ca_cert)]);
        assert!(ok, "{output}\n--- node ---\n{}", node.log_so_far());
        println!("{output}");
        await_rejections(&metrics, "bad_frame", 1);
        await_rejections(&metrics, "tls_handshake", counted + 1);
    }

    drop(stalled);
    assert_serves(&mut node, &addr, &secret, &ca);
    let log = node.log_so_far();
    assert!(log.contains("TLS handshake failed"), "{log}");
}

#[test]
fn a_tls_node_outlives_many_failed_handshakes_in_parallel() {
    let dir = TempDir::new("node-tls-many");
    let Some(pki) = pki(&dir) else { return };
    let secret = secret_file(&dir);
    let (mut node, addr, metrics) = start_tls_node(&pki.server_dir(), &secret);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                for i in 0..25u64 {
                    let mut bytes = vec![0x16, 0x03, 0x01];
                    bytes.extend(noise(64 + (i as usize * 37) % 1500, t * 1000 + i + 1));
                    send_raw(&addr, &bytes, true);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    await_rejections(&metrics, "tls_handshake", 200);
    assert_serves(&mut node, &addr, &secret, &pki.client_dir());
}
