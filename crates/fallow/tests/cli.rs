//! The `fallow` command run as a user would: real files, real process, exit codes (`trace`,
//! and the `--help` of every daemon).

mod support;

use std::path::PathBuf;

use support::fallow;

/// A LIRS-format trace in a fresh temporary file: a loop of 20 pages, 10 times.
fn loop_trace(name: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!("fallow-cli-{}-{name}", std::process::id()));
    let text: String = (0..10).flat_map(|_| 0..20).map(|p| format!("{p}\n")).collect();
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn replay_json_reports_the_required_fields() {
    let trace = loop_trace("replay");
    let out = fallow()
        .args(["trace", "replay", "--format", "lirs", "--cache-pages", "20", "--json"])
        .arg(&trace)
        .output()
        .unwrap();
    std::fs::remove_file(&trace).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["accesses"], 200);
    assert_eq!(v["misses"], 20, "a 20-page loop in 20 pages misses only the first pass");
    assert_eq!(v["cache_pages"], 20);
    assert_eq!(v["policy"], fallow_pool::eviction::DEFAULT_POLICY);
    assert!((v["miss_ratio"].as_f64().unwrap() - 0.1).abs() < 1e-9);
}

#[test]
fn replay_shows_the_small_share_and_logs_its_epochs_when_asked() {
    let trace = loop_trace("share");
    let out = fallow()
        .env("FALLOW_LOG", "fallow_pool::eviction=debug")
        .args(["trace", "replay", "--format", "lirs", "--cache-pages", "10"])
        .arg(&trace)
        .output()
        .unwrap();
    std::fs::remove_file(&trace).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("small share "), "{stdout}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let epochs = stderr.lines().filter(|l| l.contains("small-queue share after an epoch")).count();
    // 200 accesses, every one sampled (10 pages are fewer than the simulations hold).
    assert!(epochs >= 2, "expected an epoch log line per epoch:\n{stderr}");
    assert!(stderr.contains("share_percent="), "{stderr}");
}

#[test]
fn sweep_prints_one_row_per_size_and_policy() {
    let trace = loop_trace("sweep");
    let out = fallow()
        .args(["trace", "sweep", "--format", "lirs", "--json", "--policies", "lru,s3fifo"])
        .args(["--cache-sizes", "5,19"])
        .arg(&trace)
        .output()
        .unwrap();
    std::fs::remove_file(&trace).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4);
    // LRU on a loop one page larger than the cache misses every access.
    let lru19 = rows.iter().find(|r| r["policy"] == "lru" && r["cache_pages"] == 19).unwrap();
    assert_eq!(lru19["miss_ratio"], 1.0);
}

#[test]
fn malformed_input_names_the_file_and_line_and_fails() {
    let path = std::env::temp_dir().join(format!("fallow-cli-{}-bad.lis", std::process::id()));
    std::fs::write(&path, "10 1 0 0\n11 x 0 1\n").unwrap();
    let out = fallow()
        .args(["trace", "replay", "--format", "arc", "--cache-pages", "4"])
        .arg(&path)
        .output()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.lis:2:"), "{err}");
}

#[test]
fn unknown_policies_and_zero_caches_are_refused() {
    let trace = loop_trace("refuse");
    let policy = fallow()
        .args(["trace", "replay", "--format", "lirs", "--cache-pages", "4", "--policy", "mru"])
        .arg(&trace)
        .output()
        .unwrap();
    let zero = fallow()
        .args(["trace", "replay", "--format", "lirs", "--cache-pages", "0"])
        .arg(&trace)
        .output()
        .unwrap();
    std::fs::remove_file(&trace).unwrap();
    assert!(!policy.status.success());
    assert!(String::from_utf8_lossy(&policy.stderr).contains("mru"));
    assert!(!zero.status.success());
    assert!(String::from_utf8_lossy(&zero.stderr).contains("at least 1"));
}

/// `--help` of each subcommand shows its long explanation (the doc of its argument struct),
/// not only the one-line summary: a doc comment on the subcommand's enum variant would
/// silently replace it.
#[test]
fn help_explains_each_daemon_beyond_its_summary() {
    for (command, explanation) in [
        ("nbd", "Each `--export NAME=BACKING` is one export"),
        ("up", "On first run a sparse image"),
        ("node", "Serves the pool protocol"),
        ("stat", "An NBD server (`--nbd ADDR`"),
    ] {
        let out = fallow().args([command, "--help"]).output().unwrap();
        assert!(out.status.success(), "fallow {command} --help failed");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(explanation),
            "fallow {command} --help lacks {explanation:?}:\n{text}"
        );
    }
}
