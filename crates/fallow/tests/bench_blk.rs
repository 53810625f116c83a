//! The `fallow bench blk` command, run as a user would: the driver's floor (`--target
//! null`) in both wait modes, qemu-storage-daemon's vhost-user-blk and NBD exports of one
//! image side by side (skipped, with a message, when qemu-storage-daemon is missing, unless
//! `FALLOW_REQUIRE_GUESTS=1`), the JSON object, exit codes.

mod support;

use fallow_testkit::qsd::StorageDaemon;
use support::{fallow, TempDir};

/// Runs `fallow bench blk ARGS --json`; panics unless it succeeds; the JSON object.
fn bench_json(args: &[&str]) -> serde_json::Value {
    let out = fallow().args(["bench", "blk"]).args(args).arg("--json").output().unwrap();
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The fields every report has, with a run that did some work and no errors.
fn check_report(v: &serde_json::Value, target: &str, rw: &str, qd: u64) {
    assert_eq!(v["target"], target);
    assert_eq!(
        (v["rw"].as_str(), v["qd"].as_u64(), v["bs"].as_u64()),
        (Some(rw), Some(qd), Some(4096))
    );
    assert_eq!(v["errors"], 0, "{v}");
    assert!(v["ops"].as_u64().unwrap() > 0, "{v}");
    assert!(v["iops"].as_f64().unwrap() > 0.0 && v["seconds"].as_f64().unwrap() > 0.0, "{v}");
    for q in ["min", "p50", "p90", "p99", "p999", "max", "mean"] {
        assert!(v["latency_us"][q].as_f64().unwrap() > 0.0, "{q}: {v}");
    }
    assert!(v["latency_us"]["p50"].as_f64() <= v["latency_us"]["p99"].as_f64(), "{v}");
}

#[test]
fn the_null_target_measures_the_drivers_floor() {
    for wait in ["spin", "call"] {
        let v =
            bench_json(&["--target", "null", "--duration", "300ms", "--qd", "4", "--wait", wait]);
        check_report(&v, "null", "randread", 4);
        assert_eq!(v["wait"], wait);
        assert_eq!(v["disk_bytes"], 1u64 << 30);
    }
    // Text output names the target and the numbers.
    let out = fallow()
        .args(["bench", "blk", "--target", "null", "--duration", "200ms", "--rw", "write"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("null, write of 4096 B") && text.contains("IOPS") && text.contains("p99"),
        "{text}"
    );
}

#[test]
fn vhost_user_and_nbd_exports_side_by_side() {
    if !StorageDaemon::installed() {
        return;
    }
    let dir = TempDir::new("bench-blk-qsd");
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(8 << 20).unwrap();
    let qsd = StorageDaemon::start(&image, true);
    let vhost = format!("vhost-user:{}", qsd.vhost_socket.display());
    let nbd = qsd.nbd_uri().unwrap();
    for (target, rw) in
        [(&vhost, "randwrite"), (&nbd, "randwrite"), (&vhost, "randread"), (&nbd, "randread")]
    {
        let v = bench_json(&[
            "--target",
            target,
            "--rw",
            rw,
            "--qd",
            "2",
            "--duration",
            "300ms",
            "--range",
            "1M",
        ]);
        check_report(&v, target, rw, 2);
        assert_eq!(
            (v["disk_bytes"].as_u64(), v["range_bytes"].as_u64()),
            (Some(8 << 20), Some(1 << 20))
        );
        if target.starts_with("vhost-user:") {
            assert_eq!(v["wait"], "spin", "{v}");
        } else {
            assert!(v["wait"].is_null(), "waiting is not a choice over NBD: {v}");
        }
    }
    drop(qsd);
}

#[test]
fn bad_arguments_fail_with_a_message() {
    for (args, says) in [
        (&["--target", "file:/x"][..], "expected vhost-user:PATH"),
        (&["--target", "null", "--qd", "86"], "requests in flight per queue must be 1 to 85"),
        (&["--target", "null", "--bs", "1000"], "whole sectors"),
        (
            &["--target", "vhost-user:/nonexistent/fallow.sock", "--duration", "1s"],
            "cannot connect",
        ),
    ] {
        let out = fallow().args(["bench", "blk"]).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
