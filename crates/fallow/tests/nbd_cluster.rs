//! An NBD export caching in a cluster: three `fallow node` processes joined by gossip on
//! 127.0.0.1, `fallow nbd --pool fallow://A --local-tier 0` (one seed: the export learns
//! the other members from it), and fio's nbd engine
//! with `verify=crc32c` (`tests/compliance/nbd/test-fio.sh`) while one node is SIGKILLed
//! in the middle of the verify pass, whose reads the pool serves. fio must pass (no I/O
//! error, no wrong byte), the pool must have served reads, and no pool error may have
//! reached the cache. Skipped, with a message, without bash or fio. Also: a node that does
//! not gossip is used alone, by a plain client, as before clusters. Every process is
//! stopped by its PID or process group.

mod support;

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{nbd_serving_uri as serving_uri, start_node, Daemon, ProcessGroup, TempDir};

const START_TIMEOUT: Duration = Duration::from_secs(30);
/// A backstop for the fio script, which bounds its own commands to 60 s each.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(180);

use support::{metric, scrape};

#[test]
fn fio_verifies_through_a_cluster_while_a_node_is_killed() {
    for (tool, args) in [("bash", &["--version"][..]), ("fio", &["--enghelp=nbd"][..])] {
        if !support::command_works(tool, args) {
            eprintln!("skipping: {tool} {} failed (Debian packages bash, fio)", args.join(" "));
            return;
        }
    }
    let dir = TempDir::new("nbd-cluster");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "nbd-cluster-test-secret-0123456789\n").unwrap();
    let s = secret.to_str().unwrap();
    let (mut nodes, addrs) = support::start_cluster(3, &["--lend", "64M"], &secret, START_TIMEOUT);

    let image = dir.path().join("fio.img");
    let export = format!("fio=file:{},size=64M", image.display());
    let pool = format!("fallow://{}", addrs[0]);
    let (mut server, base_uri) = Daemon::start(
        "fallow nbd",
        support::fallow()
            .args(["nbd", "--listen", "127.0.0.1:0", "--export", &export, "--pool", &pool])
            .args(["--secret-file", s, "--local-tier", "0", "--metrics", "127.0.0.1:0"])
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
        "`serving` line",
        START_TIMEOUT,
        serving_uri,
    );

    // Logged before the URI, so already read: found in the log so far.
    let metrics = server.log_lines().iter().find_map(|l| support::metrics_addr(l)).unwrap();
    let log = server.log_so_far();
    assert!(log.contains("caching in a cluster") && log.contains("nodes=3"), "{log}");

    let scratch = dir.path().join("run");
    std::fs::create_dir_all(&scratch).unwrap();
    let out = scratch.join("output");
    let append = || File::options().create(true).append(true).open(&out).unwrap();
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/compliance/nbd/test-fio.sh");
    let started = Instant::now();
    let mut fio = ProcessGroup::spawn(
        Command::new("bash")
            .arg(&script)
            .arg(&base_uri)
            .env("TMPDIR", &scratch)
            .current_dir(&scratch)
            .stdin(Stdio::null())
            .stdout(append())
            .stderr(append()),
    );
    // Kill a node once the verify-only pass, which reads what the pool holds, is running.
    let verifying = support::poll_until(SCRIPT_TIMEOUT, || {
        std::fs::read_to_string(&out).unwrap_or_default().contains("verify only")
    });
    assert!(
        verifying,
        "fio never reached its verify pass:\n{}",
        std::fs::read_to_string(&out).unwrap_or_default()
    );
    std::thread::sleep(Duration::from_millis(300));
    let before_kill = scrape(&metrics);
    nodes[1].kill();
    println!("killed node {} {:?} after fio started", addrs[1], started.elapsed());

    let status = fio.wait_until(started + SCRIPT_TIMEOUT);
    let output = std::fs::read_to_string(&out).unwrap_or_default();
    let text = scrape(&metrics);
    let pool_reads: Option<u64> =
        metric(&text, "fallow_nbd_cache_pages_read_total", "tier=\"pool\"");
    let errors: Option<u64> = metric(&text, "fallow_nbd_pool_errors_total", "export=\"fio\"");
    let trusted: Option<u64> = metric(&text, "fallow_nbd_pool_trusted", "export=\"fio\"");
    println!(
        "fio through a 3-node cluster, one SIGKILLed: {status:?} in {:?}; pages read from \
         the pool {pool_reads:?} ({:?} before the kill), pool errors {errors:?}",
        started.elapsed(),
        metric::<u64>(&before_kill, "fallow_nbd_cache_pages_read_total", "tier=\"pool\"")
    );
    assert!(
        status.is_some_and(|s| s.success()),
        "fio failed ({status:?}):\n{output}\n=== fallow nbd log ===\n{}",
        server.log_so_far()
    );
    assert!(pool_reads.is_some_and(|n| n > 0), "the pool served nothing:\n{text}");
    assert_eq!(errors, Some(0), "a pool error reached the cache");
    assert_eq!(trusted, Some(1));
    assert!(server.is_running() && !server.log_so_far().contains("panicked"));
    assert!(server.signal("TERM").success());
    assert!(server.wait_timeout(Duration::from_secs(15)).is_some_and(|s| s.success()));
}

#[test]
fn a_node_outside_any_cluster_is_used_alone() {
    if !support::command_works("qemu-io", &["--version"]) {
        eprintln!("skipping: qemu-io is not installed (Debian package qemu-utils)");
        return;
    }
    let dir = TempDir::new("nbd-one-node");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "nbd-cluster-test-secret-0123456789\n").unwrap();
    let s = secret.to_str().unwrap();
    let (_node, addr) = start_node(
        &["--listen", "127.0.0.1:0", "--lend", "16M", "--secret-file", s],
        START_TIMEOUT,
    );
    let pool = format!("fallow://{addr}");
    let (server, uri) = Daemon::start(
        "fallow nbd",
        support::fallow()
            .args(["nbd", "--listen", "127.0.0.1:0", "--export", "m=mem:8M", "--pool", &pool])
            .args(["--secret-file", s, "--local-tier", "0"])
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
        "`serving` line",
        START_TIMEOUT,
        serving_uri,
    );
    let (ok, text) =
        support::qemu_io(&uri, &["write -P 0x5a 0 1M", "read -P 0x5a 0 1M", "read -P 0x5a 0 1M"]);
    assert!(ok && !text.contains("fail") && !text.contains("rror"), "{text}");
    let log = server.log_so_far();
    assert!(log.contains("caching in one node") && !log.contains("cluster"), "{log}");
}
