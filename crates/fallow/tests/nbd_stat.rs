//! `fallow stat --nbd`: the state of a running `fallow nbd` (and `fallow up`), read from its
//! metrics endpoint, follows the traffic of a real client (qemu-io): requests by command,
//! hits per tier, misses, size and pool use; and an address that is not such an endpoint
//! is a clear error. The qemu-io tests skip without qemu-io.

mod support;

use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::{metrics_addr, Daemon, TempDir};

const START: Duration = Duration::from_secs(20);

/// Starts `fallow nbd` with one 16 MiB RAM export `d` and these extra flags; returns it,
/// its metrics address and the export's URI.
fn start_nbd(extra: &[&str]) -> (Daemon, String, String) {
    let mut nbd = Daemon::spawn(
        "fallow nbd",
        support::fallow()
            .args(["nbd", "--export", "d=mem:16M", "--listen", "127.0.0.1:0"])
            .args(["--metrics", "127.0.0.1:0"])
            .args(extra)
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
    );
    let metrics = nbd.wait_for_line("metrics address", START, metrics_addr);
    let uri = nbd.wait_for_line("NBD URI", START, |line| {
        line.strip_prefix("fallow nbd: serving ").map(str::to_string)
    });
    (nbd, metrics, uri)
}

/// Runs `fallow stat ARGS`; returns whether it succeeded, its stdout and its stderr.
fn stat(args: &[&str]) -> (bool, String, String) {
    let out = support::fallow().arg("stat").args(args).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// `fallow stat --nbd ADDR --json`, parsed.
fn stat_json(addr: &str) -> Value {
    let (ok, stdout, stderr) = stat(&["--nbd", addr, "--json"]);
    assert!(ok, "fallow stat failed: {stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Runs qemu-io, which must succeed and report no failure.
fn qemu_io(uri: &str, commands: &[&str]) {
    let (exited_ok, text) = support::qemu_io(uri, commands);
    assert!(exited_ok && !text.contains("fail") && !text.contains("error"), "{text}");
}

#[test]
fn stat_reports_reads_and_local_hits_of_fallow_nbd() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let (nbd, metrics, uri) = start_nbd(&["--pool", "local:16M"]);
    let before = stat_json(&metrics);
    assert_eq!(before["exports"]["d"]["hits"], 0, "{before}");
    assert_eq!(before["exports"]["d"]["hit_ratio"], Value::Null, "{before}");
    // 16 written pages read back from the local tier; 2 never-written pages from the store.
    qemu_io(&uri, &["write -P 0x5a 0 64k", "read -P 0x5a 0 64k", "read -P 0 1M 8k"]);
    let v = stat_json(&metrics);
    let d = &v["exports"]["d"];
    assert_eq!(d["size_bytes"], 16 << 20, "{v}");
    assert_eq!(d["pages_read"]["local"], 16, "{v}");
    assert_eq!(d["misses"], 2, "{v}");
    assert_eq!(d["hits"], 16, "{v}");
    assert_eq!(d["hit_ratio"], 16.0 / 18.0, "{v}");
    assert!(d["backing_reads"].as_u64().unwrap() >= 1, "{v}");
    assert!(d["local_tier_pages"].as_u64().unwrap() >= 18, "{v}");
    assert_eq!(d["pool_trusted"], true, "{v}");
    assert_eq!(v["requests"]["read"]["ok"], 2, "{v}");
    assert_eq!(v["requests"]["read"]["bytes"], (64 + 8) << 10, "{v}");
    assert_eq!(v["requests"]["write"]["ok"], 1, "{v}");
    assert_eq!(v["connections_accepted"], 1, "{v}");
    // The table says the same.
    let (ok, table, stderr) = stat(&["--nbd", &format!("http://{metrics}/metrics")]);
    assert!(ok, "{stderr}");
    assert!(table.contains("export d      16.0 MiB\n"), "{table}");
    assert!(table.contains("  hit ratio   0.889 (16 hits: 16 local, 0 pool, 0 dirty; 2 misses)"));
    assert!(table.lines().any(|l| l.starts_with("requests      read ")), "{table}");
    drop(nbd);
}

#[test]
fn stat_reports_pool_hits_without_a_local_tier() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let (nbd, metrics, uri) = start_nbd(&["--pool", "local:16M", "--local-tier", "0"]);
    // The first read fills the pool from the store, the second is served by the pool.
    qemu_io(&uri, &["read -P 0 0 64k", "read -P 0 0 64k"]);
    let v = stat_json(&metrics);
    let d = &v["exports"]["d"];
    assert_eq!(d["pages_read"]["backing"], 16, "{v}");
    assert_eq!(d["pages_read"]["pool"], 16, "{v}");
    assert_eq!(d["pages_read"]["local"], 0, "{v}");
    assert_eq!(d["hit_ratio"], 0.5, "{v}");
    assert!(d["pool_put_pages"].as_u64().unwrap() >= 16, "{v}");
    // `--pool local:16M` runs in the server's process: its memory is reported too.
    assert_eq!(v["pool"]["lent_bytes"], 16 << 20, "{v}");
    // (The pages read are zeros, kept as fill words without a frame: 0 bytes is right.)
    assert!(v["pool"]["used_bytes"].is_u64(), "{v}");
    drop(nbd);
}

/// A pool holding many copies of one page, and pages of zeros, holds more than it uses:
/// `fallow stat` says how much more.
#[test]
fn stat_reports_the_apparent_capacity_of_the_pool() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let dir = TempDir::new("nbd-stat-apparent");
    let page = dir.path().join("page");
    let random: Vec<u8> =
        (0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    std::fs::write(&page, random).unwrap();
    let (nbd, metrics, uri) = start_nbd(&["--export", "p=pool:16M", "--pool", "local:32M"]);
    let pool_uri = uri.replace("/d", "/p");
    // 2048 copies of one page (dedup: one frame), then 1024 pages of zeros (fills).
    let copies = format!("write -s {} 0 8M", page.display());
    qemu_io(&pool_uri, &[&copies, "write -P 0 8M 4M"]);
    let v = stat_json(&metrics);
    assert_eq!(v["pool"]["pages"], 3072, "{v}");
    // 12 MiB for users in the frames of one 2 MiB segment at most.
    let ratio = v["pool"]["apparent_capacity"].as_f64().unwrap();
    assert!(ratio >= 6.0, "{v}");
    let (ok, table, stderr) = stat(&["--nbd", &metrics]);
    assert!(ok, "{stderr}");
    assert!(table.contains("3072 pages (apparent capacity "), "{table}");
    drop(nbd);
}

#[test]
fn stat_refuses_what_is_not_an_nbd_metrics_endpoint() {
    let (nbd, metrics, uri) = start_nbd(&[]);
    // The NBD port itself answers, but not with HTTP.
    let nbd_addr = uri.trim_start_matches("nbd://").trim_end_matches("/d");
    let (ok, _, stderr) = stat(&["--nbd", nbd_addr]);
    assert!(!ok && stderr.contains("did not answer with HTTP"), "{stderr}");
    let (ok, _, stderr) = stat(&["--nbd", &format!("http://{metrics}/other")]);
    assert!(!ok && stderr.contains("404"), "{stderr}");
    drop(nbd);
    // Nothing listens there any more.
    let (ok, _, stderr) = stat(&["--nbd", &metrics, "--timeout", "2"]);
    assert!(!ok && stderr.contains("cannot connect to"), "{stderr}");
    let (ok, _, stderr) = stat(&["--nbd", "https://127.0.0.1:1"]);
    assert!(!ok && stderr.contains("plain HTTP"), "{stderr}");
}

/// `fallow up --metrics` says how to run `fallow stat`, and reports its in-process pool.
#[test]
fn up_prints_the_stat_command_and_reports_its_pool() {
    let dir = TempDir::uncreated("nbd-stat-up");
    let mut up = Daemon::spawn(
        "fallow up",
        support::fallow()
            .args(["up", "--size", "32M", "--listen", "127.0.0.1:0", "--lend", "16M", "--quiet"])
            .args(["--metrics", "127.0.0.1:0", "--data-dir"])
            .arg(dir.path())
            .env("FALLOW_LOG", "warn")
            .stdin(Stdio::null()),
    );
    let addr = up.wait_for_line("stat command", START, |line| {
        line.trim().strip_prefix("fallow stat --nbd ").map(str::to_string)
    });
    let v = stat_json(&addr);
    assert_eq!(v["exports"]["disk"]["size_bytes"], 32 << 20, "{v}");
    assert_eq!(v["pool"]["lent_bytes"], 16 << 20, "{v}");
    assert!(v["pool"]["used_bytes"].is_u64(), "{v}");
    drop(up);
}
