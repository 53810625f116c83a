//! SIGHUP: a node reads its config file again, applies what can change while it runs
//! (`lend`, `reserve`, `log`), names what waits for a restart, and keeps its settings when
//! the file is broken; clients under load see no failure.

mod support;

use std::io::Read;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use support::{fallow, Daemon, TempDir};

fn secret_file(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("secret");
    std::fs::write(&path, "reload-test-secret-0123456789").unwrap();
    path
}

/// Writes the node's config file: `lend`, then any `extra` lines.
fn write_config(path: &Path, secret: &Path, lend: &str, extra: &str) {
    let text = format!(
        "listen = [\"127.0.0.1:0\"]\nlend = \"{lend}\"\nsecret_file = \"{}\"\n\
         metrics = \"127.0.0.1:0\"\n{extra}",
        secret.display()
    );
    std::fs::write(path, text).unwrap();
}

fn start(config: &Path) -> (Daemon, String) {
    Daemon::start(
        "the node",
        fallow()
            .args(["node", "--config"])
            .arg(config)
            .env_remove("FALLOW_LOG")
            .stdin(Stdio::null()),
        "TCP address",
        Duration::from_secs(10),
        support::node_tcp_addr,
    )
}

/// The node's lent budget in bytes, from `fallow stat --json`.
fn lent_bytes(addr: &str, secret: &Path) -> u64 {
    let out = fallow()
        .args(["stat", "--json", "--node", addr, "--secret-file"])
        .arg(secret)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    stats["lent_bytes"].as_u64().unwrap_or_else(|| panic!("no lent_bytes in {stats}"))
}

#[test]
fn sighup_applies_a_new_lend_at_once_and_names_what_waits_for_a_restart() {
    let dir = TempDir::new("node-reload");
    let secret = secret_file(dir.path());
    let config = dir.path().join("node.toml");
    write_config(&config, &secret, "64M", "log = \"info\"\n");
    let (mut node, addr) = start(&config);
    let metrics = node.wait_for_line("metrics", Duration::from_secs(5), support::metrics_addr);
    assert_eq!(lent_bytes(&addr, &secret), 64 << 20);

    write_config(&config, &secret, "96M", "log = \"debug\"\nmax_connections = 7\n");
    let sent = Instant::now();
    node.signal("HUP");
    let applied =
        support::poll_until(Duration::from_secs(5), || lent_bytes(&addr, &secret) == 96 << 20);
    let took = sent.elapsed();
    assert!(applied, "the new budget was not applied:\n{}", node.log_so_far());
    println!("budget changed {took:?} after SIGHUP (stat round trips included)");
    node.wait_for_line("the reload's summary", Duration::from_secs(5), |l| {
        l.contains("config reloaded").then(|| {
            assert!(l.contains("lend 96MiB (was 64MiB)") && l.contains("log debug"), "{l}");
        })
    });
    let log = node.log_so_far();
    assert!(
        log.lines()
            .any(|l| l.contains("take effect when the node restarts")
                && l.contains("max_connections")),
        "{log}"
    );
    // The new log filter is in force: debug lines appear.
    assert!(support::poll_until(Duration::from_secs(5), || {
        lent_bytes(&addr, &secret);
        node.log_so_far().contains("DEBUG")
    }));

    // A broken file changes nothing and says why.
    std::fs::write(&config, "lend = [\n").unwrap();
    node.signal("HUP");
    node.wait_for_line("the failed reload", Duration::from_secs(5), |l| {
        (l.contains("reload failed") && l.contains("TOML")).then_some(())
    });
    assert_eq!(lent_bytes(&addr, &secret), 96 << 20);
    let text = support::scrape(&metrics);
    let reloads = |result| support::metric(&text, "fallow_node_config_reloads_total", result);
    assert_eq!(reloads("result=\"applied\""), Some(1.0));
    assert_eq!(reloads("result=\"failed\""), Some(1.0));
    assert!(node.is_running());

    // `lend = "auto"` replaces the fixed size with the governor.
    write_config(&config, &secret, "auto", "reserve = \"1G\"\n");
    node.signal("HUP");
    node.wait_for_line("the governor", Duration::from_secs(5), |l| {
        l.contains("lending governor starting").then_some(())
    });
    node.signal("TERM");
    assert!(node.wait_timeout(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

#[test]
fn clients_under_load_see_no_failure_across_reloads() {
    let dir = TempDir::new("node-reload-load");
    let secret = secret_file(dir.path());
    let config = dir.path().join("node.toml");
    write_config(&config, &secret, "64M", "");
    let (mut node, addr) = start(&config);
    let mut bench = support::KillOnDrop::spawn(
        fallow()
            .args(["bench", "pages", "--target", &format!("fallow://{addr}"), "--secret-file"])
            .arg(&secret)
            .args(["--workload", "mix:0.8", "--keys", "4000", "--warmup", "-q", "4", "-b", "4"])
            .args(["-d", "3s", "--json", "--quiet"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    // Five reloads while the load runs, each moving the budget up or down.
    std::thread::sleep(Duration::from_millis(500));
    for lend in ["32M", "128M", "48M", "96M", "64M"] {
        write_config(&config, &secret, lend, "");
        node.signal("HUP");
        std::thread::sleep(Duration::from_millis(350));
    }
    let status = bench.wait_timeout(Duration::from_secs(30)).expect("the load ended in 30 s");
    let (mut stdout, mut stderr) = (String::new(), String::new());
    bench.child().stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    bench.child().stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(status.success(), "the load failed: {stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["wrong"], 0, "{report}");
    assert_eq!(report["errors"], 0, "{report}");
    assert!(report["hits"].as_u64().unwrap() > 0, "{report}");
    let reloads = node.log_lines().iter().filter(|l| l.contains("config reloaded")).count();
    assert_eq!(reloads, 5, "{}", node.log_so_far());
    assert!(node.is_running());
}
