//! `fallow node` and `fallow stat` as users run them: the real binary, flags, the config
//! file, clean shutdown on SIGTERM, and the node's resident memory against its budget.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fallow_client::{BlockingClient, ClientConfig};
use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};

const BIN: &str = env!("CARGO_BIN_EXE_fallow");

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

/// A node process, killed (by PID) when dropped.
struct NodeProcess {
    child: Child,
    addr: String,
    log: std::sync::mpsc::Receiver<String>,
}

impl NodeProcess {
    fn start(args: &[&str]) -> NodeProcess {
        let mut child = Command::new(BIN)
            .arg("node")
            .args(args)
            .env("FALLOW_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, log) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut node = NodeProcess { child, addr: String::new(), log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while node.addr.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = node.log.recv_timeout(left).expect("the node logs its TCP address");
            if let Some(rest) = line.split("listening on TCP addr=").nth(1) {
                node.addr = rest.split_whitespace().next().unwrap().to_string();
            }
        }
        node
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn fallow(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().unwrap()
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
    let node = NodeProcess::start(&["--config", config.to_str().unwrap(), "--lend", "48M"]);
    let out = fallow(&[
        "stat",
        "--node",
        &node.addr,
        "--secret-file",
        secret.to_str().unwrap(),
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["lent_bytes"], 48u64 << 20, "the flag won: {json}");
    assert_eq!(json["lend_auto"], 0);
    let table = fallow(&["stat", "--node", &node.addr, "--secret-file", secret.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&table.stdout);
    assert!(text.contains("lent          48.0 MiB (fixed)"), "{text}");
    assert!(text.contains("hit ratio"), "{text}");
    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_file(secret);
}

#[test]
fn sigterm_stops_the_node_cleanly_and_removes_its_socket() {
    let secret = secret_file();
    let socket = temp("node.sock");
    let listen_unix = format!("unix:{}", socket.display());
    let mut node = NodeProcess::start(&[
        "--listen",
        "127.0.0.1:0",
        "--listen",
        &listen_unix,
        "--lend",
        "16M",
        "--secret-file",
        secret.to_str().unwrap(),
    ]);
    // The Unix listener is bound just after the TCP one.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "the Unix socket never appeared");
        std::thread::sleep(Duration::from_millis(10));
    }
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
    let status = Command::new("kill").args(["-TERM", &node.pid().to_string()]).status().unwrap();
    assert!(status.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = node.child.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "the node did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");
    assert!(!socket.exists(), "the Unix socket file is removed");
    let log: Vec<String> = node.log.try_iter().collect();
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
    let node = NodeProcess::start(&[
        "--listen",
        "127.0.0.1:0",
        "--lend",
        "64M",
        "--secret-file",
        secret.to_str().unwrap(),
    ]);
    let idle = node.rss_bytes();
    let config =
        ClientConfig::new(&node.addr, std::fs::read(&secret).unwrap().trim_ascii().to_vec())
            .unwrap();
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
            peak = peak.max(node.rss_bytes());
        }
    }
    peak = peak.max(node.rss_bytes());
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
