//! `fallow nbd` in front of a Ceph RADOS image, on a throwaway single-node cluster started
//! here and torn down by the daemons' PIDs when the test ends, failed or not
//! (`tests/ceph/`): qemu-io's patterns round-trip across object boundaries, whole-object
//! zeroing and trimming delete objects, the image is where `docs/nbd.md` says, it reopens
//! without a size after a restart with its data, and bad specs fail with a clear message.
//! Built with the `rados` feature only; skips when qemu-io or Ceph is not installed.
#![cfg(feature = "rados")]

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use fallow_testkit::ceph::CephCluster;
use support::{have, Daemon};

/// Starts `fallow nbd` with `CEPH_CONF` naming the cluster; returns it with its export's URI.
fn start_fallow(cluster: &CephCluster, export: &str) -> (Daemon, String) {
    Daemon::start(
        "fallow nbd",
        support::fallow()
            .args(["nbd", "--export", export, "--listen", "127.0.0.1:0"])
            .args(["--pool", "local:16M", "--local-tier", "256K"])
            .env("CEPH_CONF", cluster.conf()),
        "URI",
        Duration::from_secs(30),
        |line| line.strip_prefix("fallow nbd: serving ").map(str::to_string),
    )
}

/// Runs qemu-io; asserts that it succeeded and reported no failure.
fn qemu_io(uri: &str, commands: &[&str]) {
    let (exited_ok, text) = support::qemu_io(uri, commands);
    let failed = text.contains("error") || text.contains("failed") || !exited_ok;
    assert!(!failed, "qemu-io {commands:?}:\n{text}");
}

/// Runs `fallow nbd` with an export that must fail to open; returns its stderr.
fn fails_to_start(cluster: &CephCluster, export: &str) -> String {
    let out = Command::new("timeout")
        .arg("60")
        .arg(support::BIN)
        .args(["nbd", "--export", export, "--listen", "127.0.0.1:0"])
        .env("CEPH_CONF", cluster.conf())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{export} should not open:\n{stderr}");
    assert_ne!(out.status.code(), Some(124), "{export} timed out instead of failing:\n{stderr}");
    stderr
}

#[test]
fn a_rados_image_behind_fallow_nbd() {
    if !have("qemu-io") || !have("qemu-img") {
        eprintln!("skipped: qemu-io and qemu-img are needed (Debian package qemu-utils)");
        return;
    }
    let started = Instant::now();
    let Some(cluster) = CephCluster::start("nbd") else { return };
    eprintln!("cluster up in {:?}", started.elapsed());
    let object = |n: u64| format!("img.{n:016x}");
    let exists = |name: &str| cluster.rados(&["stat", name]).0;

    let (fallow, uri) = start_fallow(&cluster, "disk=rados:cache/img,size=64M");
    qemu_io(
        &uri,
        &[
            "write -P 0x5a 0 1M",
            // Across the boundary between objects 0 and 1, unaligned at both ends.
            "write -P 0x11 4190000 10000",
            "write -P 0x22 8M 4M",
            "write -P 0x33 12M 4M",
            "read -P 0x5a 0 1M",
            "read -P 0x11 4190000 10000",
            "read -P 0x22 8M 4M",
            "read -P 0 20M 1M",
            "flush",
        ],
    );
    for n in 0..4 {
        assert!(exists(&object(n)), "object {n} was written");
    }
    assert!(!exists(&object(5)), "object 5 was never written");
    // Zeroing a whole object with unmap allowed, and trimming one, delete them.
    qemu_io(
        &uri,
        &["write -z -u 8M 4M", "discard 12M 4M", "read -P 0 8M 8M", "read -P 0x11 4190000 10000"],
    );
    assert!(!exists(&object(2)) && !exists(&object(3)), "whole objects are deleted");
    // The bytes qemu-io wrote across the boundary, in the objects themselves.
    let (ok, first) = cluster.rados(&["get", &object(0), "-"]);
    assert!(ok && first.len() == 4 << 20 && first[4190000..].iter().all(|b| *b == 0x11));
    let (ok, second) = cluster.rados(&["get", &object(1), "-"]);
    assert!(ok && second.len() == 4190000 + 10000 - (4 << 20));
    assert!(second.iter().all(|b| *b == 0x11));
    if have("nbdinfo") {
        let out = Command::new("timeout").args(["30", "nbdinfo", "--map", &uri]).output().unwrap();
        let map = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && map.contains("hole") && map.contains("data"), "{map}");
    }
    drop(fallow);

    // Restarted without a size: the header has it, and the data is there.
    let (_fallow, uri) = start_fallow(&cluster, "disk=rados:cache/img");
    let info = Command::new("timeout").args(["30", "qemu-img", "info", &uri]).output().unwrap();
    let info = String::from_utf8_lossy(&info.stdout);
    assert!(info.contains("67108864"), "{info}");
    qemu_io(&uri, &["read -P 0x5a 0 1M", "read -P 0x11 4190000 10000", "read -P 0 8M 8M"]);

    // What an operator sees when the spec is wrong.
    let err = fails_to_start(&cluster, "disk=rados:cache/nothing-here");
    assert!(err.contains("does not exist; give its size"), "{err}");
    let err = fails_to_start(&cluster, "disk=rados:cache/img,size=32M");
    assert!(err.contains("exists with 67108864 bytes"), "{err}");
    let err = fails_to_start(&cluster, "disk=rados:no-such-pool/img,size=1M");
    assert!(err.contains("pool \"no-such-pool\" does not exist"), "{err}");
    let err = fails_to_start(&cluster, "disk=rados:cache");
    assert!(err.contains("rados:POOL/PREFIX"), "{err}");
    eprintln!("done in {:?}", started.elapsed());
}
