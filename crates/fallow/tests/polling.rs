//! `--poll-us` and `--cpus` on `fallow node` and `fallow nbd`: a server whose connections
//! poll their sockets, with its workers pinned, serves the same bytes as one that sleeps
//! (a node over TCP and a Unix socket, an export read and written by qemu-io); its workers
//! run only on the CPUs named; a connection left idle stops spinning; bad values are
//! refused with the reason.

mod support;

use std::process::Stdio;
use std::time::Duration;

use fallow_client::{BlockingClient, ClientConfig};
use fallow_core::{Lookup, PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
use support::{cpu_time, start_node, Daemon, TempDir};

const START: Duration = Duration::from_secs(20);

/// The CPUs each thread of process `pid` whose name starts with `prefix` may run on
/// (`Cpus_allowed_list` of /proc/PID/task/TID/status).
fn thread_cpus(pid: u32, prefix: &str) -> Vec<String> {
    let mut lists = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        let field = |name: &str| {
            status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_string())
        };
        if field("Name:").is_some_and(|n| n.starts_with(prefix)) {
            lists.push(field("Cpus_allowed_list:").unwrap());
        }
    }
    lists
}

/// Puts `count` distinct pages through `client` and reads each back, one request at a time.
fn put_and_get(client: &BlockingClient, count: u64) {
    let pool = client.create_pool(&PoolSpec::ephemeral()).unwrap();
    for i in 0..count {
        let page = [(i % 251) as u8; PAGE_SIZE];
        let key = PageKey::new(pool, 0, i);
        assert_eq!(client.put(key, &page).unwrap(), PutOutcome::Stored);
    }
    let mut out = [0u8; PAGE_SIZE];
    for i in 0..count {
        let found = client.get(PageKey::new(pool, 0, i), &mut out).unwrap();
        assert_eq!(found, Lookup::Hit, "page {i} is there");
        assert!(out.iter().all(|&b| b == (i % 251) as u8), "page {i} reads back as written");
    }
}

#[test]
fn a_polling_pinned_node_serves_tcp_and_unix_clients_and_stops_spinning_when_idle() {
    let dir = TempDir::new("polling-node");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "polling-test-secret-0123456789ab\n").unwrap();
    let unix = format!("unix:{}", dir.path().join("node.sock").display());
    let (mut node, tcp) = start_node(
        &["--listen", "127.0.0.1:0", "--listen", &unix, "--lend", "32M"]
            .into_iter()
            .chain(["--secret-file", secret.to_str().unwrap(), "--poll-us", "50", "--cpus", "0"])
            .collect::<Vec<_>>(),
        START,
    );
    let ready = node.wait_for_line("ready line", START, |line| {
        line.contains("fallow node ready").then(|| line.to_string())
    });
    assert!(ready.contains("poll_us=50") && ready.contains("cpus=0"), "{ready}");
    let key = std::fs::read(&secret).unwrap().trim_ascii().to_vec();
    let config = |addr: &str| ClientConfig::new(addr, key.clone()).unwrap();
    assert!(
        support::poll_until(Duration::from_secs(10), || {
            BlockingClient::connect(config(&unix)).is_ok()
        }),
        "the Unix socket never accepted"
    );
    let over_tcp = BlockingClient::connect(config(&tcp)).unwrap();
    let over_unix = BlockingClient::connect(config(&unix)).unwrap();
    put_and_get(&over_tcp, 300);
    put_and_get(&over_unix, 300);
    // Every worker took CPU 0 when it first parked, which each has done by now.
    let cpus = thread_cpus(node.pid(), "fallow-node");
    assert!(!cpus.is_empty(), "no fallow-node threads");
    assert!(cpus.iter().all(|c| c == "0"), "workers on {cpus:?}");
    assert!(node.log_so_far().contains("worker thread pinned"));
    // Both connections stay open and idle: once their windows have passed, nothing spins.
    // A connection spinning regardless would take this whole second of CPU.
    std::thread::sleep(Duration::from_millis(100));
    let before = cpu_time(node.pid());
    std::thread::sleep(Duration::from_secs(1));
    let idle = cpu_time(node.pid()) - before;
    assert!(idle < Duration::from_millis(300), "{idle:?} of CPU in a second of idleness");
    // And a client that comes back after the pause is served.
    put_and_get(&over_tcp, 10);
}

#[test]
fn a_polling_nbd_export_reads_back_what_qemu_io_wrote() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let dir = TempDir::new("polling-nbd");
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(8 << 20).unwrap();
    let export = format!("d=file:{}", image.display());
    let mut nbd = Daemon::spawn(
        "fallow nbd",
        support::fallow()
            .args(["nbd", "--export", &export, "--pool", "local:16M", "--listen", "127.0.0.1:0"])
            .args(["--poll-us", "50", "--cpus", "0"])
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
    );
    let uri = nbd.wait_for_line("NBD URI", START, support::nbd_serving_uri);
    let (ok, text) = support::qemu_io(
        &uri,
        &["write -P 0xa7 0 256k", "write -P 0x3c 1M 64k", "read -P 0xa7 0 256k", "flush"],
    );
    assert!(ok && !text.contains("fail") && !text.contains("error"), "{text}");
    // A second connection reads everything back: the writes from the cache, the hole too.
    let reads = ["read -P 0xa7 0 256k", "read -P 0x3c 1M 64k", "read -P 0 2M 64k"];
    let (ok, text) = support::qemu_io(&uri, &reads);
    assert!(ok && !text.contains("fail") && !text.contains("error"), "{text}");
    let cpus = thread_cpus(nbd.pid(), "fallow-nbd");
    assert!(!cpus.is_empty() && cpus.iter().all(|c| c == "0"), "workers on {cpus:?}");
    assert!(nbd.signal("TERM").success());
    assert!(nbd.wait_timeout(Duration::from_secs(10)).is_some_and(|s| s.success()));
    // Write-through: the file holds the bytes.
    let bytes = std::fs::read(&image).unwrap();
    assert!(bytes[..256 << 10].iter().all(|&b| b == 0xa7));
    assert!(bytes[1 << 20..(1 << 20) + (64 << 10)].iter().all(|&b| b == 0x3c));
}

#[test]
fn bad_polling_flags_are_refused_with_the_reason() {
    let dir = TempDir::new("polling-flags");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "polling-test-secret-0123456789ab\n").unwrap();
    let s = secret.to_str().unwrap();
    let node = |extra: &[&str]| {
        let out = support::fallow()
            .args(["node", "--listen", "127.0.0.1:0", "--lend", "8M", "--secret-file", s])
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{extra:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    assert!(node(&["--poll-us", "2000000"]).contains("at most 1000000"));
    assert!(node(&["--poll-us", "soon"]).contains("--poll-us"));
    assert!(node(&["--cpus", "0-"]).contains("--cpus"));
    let config = dir.path().join("node.toml");
    std::fs::write(&config, "poll_us = 5000000\n").unwrap();
    assert!(node(&["--config", config.to_str().unwrap()]).contains("at most 1000000"));
    std::fs::write(&config, "cpus = \"two\"\n").unwrap();
    assert!(node(&["--config", config.to_str().unwrap()]).contains("cpus"));
    let out = support::fallow()
        .args(["nbd", "--export", "d=mem:1M", "--poll-us", "1000001"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("at most 1000000"), "{out:?}");
    let help = support::fallow().args(["node", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--poll-us") && help.contains("core"), "{help}");
}
