//! `fallow node` and `fallow stat` as users run them: the real binary, flags, the config
//! file, clean shutdown on SIGTERM, and the node's resident memory against its budget.

mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use fallow_client::{BlockingClient, ClientConfig};
use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
use support::start_node;

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("fallow-cli-{}-{}-{name}", std::process::id(), rand_suffix()))
}

fn rand_suffix() -> u32 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(Instant::now()) as u32
}

fn secret_file() -> PathBuf {
    let path = temp("secret");
    std::fs::write(&path, "cli-test-secret-0123456789abcdef\n").unwrap();
    path
}

/// How long a node may take to log its TCP address.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// The resident memory of process `pid`.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

fn fallow(args: &[&str]) -> std::process::Output {
    support::fallow().args(args).output().unwrap()
}

#[test]
fn a_node_without_a_secret_says_how_to_make_one() {
    let out = fallow(&["node", "--listen", "127.0.0.1:0", "--lend", "16M"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--secret-file") && err.contains("/dev/urandom"), "{err}");
}

#[test]
fn bad_flags_and_config_files_are_explained() {
    let secret = secret_file();
    let s = secret.to_str().unwrap();
    let out = fallow(&["node", "--secret-file", s, "--lend", "12 parsecs"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown unit"), "{out:?}");
    let out = fallow(&["node", "--secret-file", s, "--lend", "64M", "--reserve", "1G"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--reserve applies only"), "{out:?}");
    let out = fallow(&["node", "--secret-file", s, "--listen", "localhost"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("HOST:PORT"), "{out:?}");
    let config = temp("bad.toml");
    std::fs::write(&config, "lend = \"1G\"\nlsten = [\"127.0.0.1:1\"]\n").unwrap();
    let out = fallow(&["node", "--config", config.to_str().unwrap(), "--secret-file", s]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown field") && err.contains("bad.toml"), "{err}");
    let short = temp("short");
    std::fs::write(&short, "tiny").unwrap();
    let out = fallow(&["node", "--secret-file", short.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16"), "{out:?}");
    for path in [secret, config, short] {
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn flags_win_over_the_config_file_and_stat_reports_the_node() {
    let secret = secret_file();
    let config = temp("node.toml");
    std::fs::write(
        &config,
        format!(
            "listen = [\"127.0.0.1:0\"]\nlend = \"32M\"\nsecret_file = \"{}\"\npolicy = \"lru\"\n",
            secret.display()
        ),
    )
    .unwrap();
    let (_node, addr) =
        start_node(&["--config", config.to_str().unwrap(), "--lend", "48M"], START_TIMEOUT);
    let out =
        fallow(&["stat", "--node", &addr, "--secret-file", secret.to_str().unwrap(), "--json"]);
    assert!(out.status.success(), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["lent_bytes"], 48u64 << 20, "the flag won: {json}");
    assert_eq!(json["lend_auto"], 0);
    let table = fallow(&["stat", "--node", &addr, "--secret-file", secret.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("lent          48.0 MiB (fixed)"), "{text}");
    assert!(text.contains("hit ratio"), "{text}");
    // The config chose `lru`, which has no small queue to report.
    assert!(!text.contains("small queue"), "{text}");
    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_file(secret);
}

#[test]
fn sigterm_stops_the_node_cleanly_and_removes_its_socket() {
    let secret = secret_file();
    let socket = temp("node.sock");
    let listen_unix = format!("unix:{}", socket.display());
    let (mut node, _addr) = start_node(
        &[
            "--listen",
            "127.0.0.1:0",
            "--listen",
            &listen_unix,
            "--lend",
            "16M",
            "--secret-file",
            secret.to_str().unwrap(),
        ],
        START_TIMEOUT,
    );
    // The Unix listener is bound just after the TCP one.
    assert!(
        support::poll_until(Duration::from_secs(10), || socket.exists()),
        "the Unix socket never appeared"
    );
    // A client is connected while the node stops.
    let client = BlockingClient::connect(
        ClientConfig::new(&listen_unix, std::fs::read(&secret).unwrap().trim_ascii().to_vec())
            .unwrap(),
    )
    .unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral()).unwrap();
    assert_eq!(
        client.put(PageKey::new(pool, 0, 0), &[3u8; PAGE_SIZE]).unwrap(),
        PutOutcome::Stored
    );
    assert!(node.signal("TERM").success());
    let exit =
        node.wait_timeout(Duration::from_secs(10)).expect("the node did not stop on SIGTERM");
    assert!(exit.success(), "{exit:?}");
    assert!(!socket.exists(), "the Unix socket file is removed");
    let log = node.log_lines();
    assert!(log.iter().any(|l| l.contains("SIGTERM received")), "{log:?}");
    assert!(log.iter().any(|l| l.contains("node stopped")), "{log:?}");
    let _ = std::fs::remove_file(secret);
}

/// The node never holds much more than its budget, however much it is sent. The overhead
/// bound (runtime, index, metadata, buffers) is documented in docs/protocol.md, "Memory".
#[test]
fn resident_memory_stays_within_the_budget_plus_overhead() {
    const BUDGET: u64 = 64 << 20;
    const OVERHEAD: u64 = 48 << 20;
    let secret = secret_file();
    let (node, addr) = start_node(
        &["--listen", "127.0.0.1:0", "--lend", "64M", "--secret-file", secret.to_str().unwrap()],
        START_TIMEOUT,
    );
    let idle = rss_bytes(node.pid());
    let config =
        ClientConfig::new(&addr, std::fs::read(&secret).unwrap().trim_ascii().to_vec()).unwrap();
    let client = BlockingClient::connect(config).unwrap();
    let pool = client.create_pool(&PoolSpec::ephemeral()).unwrap();
    // 192 MiB of distinct pages: three times the budget.
    let mut peak = 0;
    for batch in 0..(3 * BUDGET / PAGE_SIZE as u64 / 256) {
        let keys: Vec<PageKey> = (0..256).map(|i| PageKey::new(pool, batch, i)).collect();
        let mut data = vec![0u8; 256 * PAGE_SIZE];
        for (i, page) in data.chunks_exact_mut(PAGE_SIZE).enumerate() {
            page[..8].copy_from_slice(&(batch * 256 + i as u64).to_le_bytes());
            page[8..16].copy_from_slice(&batch.wrapping_mul(0x9e37_79b9).to_le_bytes());
        }
        let _ = client.put_many(&keys, &data).unwrap();
        if batch % 16 == 0 {
            peak = peak.max(rss_bytes(node.pid()));
        }
    }
    peak = peak.max(rss_bytes(node.pid()));
    let stats = client.block_on(client.client().stats()).unwrap();
    println!(
        "idle rss {} MiB, peak rss {} MiB with a {} MiB budget; {} pages held, metadata {} KiB",
        idle >> 20,
        peak >> 20,
        BUDGET >> 20,
        stats.get("pages").unwrap(),
        stats.get("metadata_bytes").unwrap() >> 10
    );
    assert!(peak <= BUDGET + OVERHEAD, "peak rss {peak} over budget {BUDGET} + {OVERHEAD}");
    let _ = std::fs::remove_file(secret);
}
