//! Exports whose only store is a persistent pool (`--export NAME=pool:SIZE`), driven by the
//! clients people use: qemu-io reads zeros where nothing was written, reads back what it
//! wrote (also less than a page: QEMU aligns to the 4 KiB minimum the export advertises),
//! and gets ENOSPC from a full pool with its earlier writes intact; nbdinfo sees the
//! minimum block size and the holes; fio verifies through one node, and through three
//! nodes while one is SIGKILLed during the verify pass (two copies of every page). Skipped,
//! with a message, without the tools.

mod support;

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{nbd_serving_uri, start_node, Daemon, ProcessGroup, TempDir};

const START: Duration = Duration::from_secs(30);
/// A backstop for a fio run, which bounds itself with `runtime`.
const FIO_TIMEOUT: Duration = Duration::from_secs(120);

/// Starts `fallow nbd` with `args` (after `nbd --listen 127.0.0.1:0`); returns it and the
/// URI of its default export.
fn start_nbd(args: &[&str]) -> (Daemon, String) {
    Daemon::start(
        "fallow nbd",
        support::fallow()
            .args(["nbd", "--listen", "127.0.0.1:0"])
            .args(args)
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
        "`serving` line",
        START,
        nbd_serving_uri,
    )
}

/// Runs qemu-io's `commands` on `uri`; returns whether every command succeeded, and the
/// output.
fn qemu_io(uri: &str, commands: &[&str]) -> (bool, String) {
    let (exited_ok, text) = support::qemu_io(uri, commands);
    (exited_ok && !text.contains("failed") && !text.contains("error"), text)
}

#[test]
fn a_pool_export_reads_zeros_until_written_and_shows_its_holes() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let (mut nbd, uri) = start_nbd(&["--export", "d=pool:64M", "--pool", "local:128M"]);
    let log = nbd.log_so_far();
    assert!(log.contains("persistent pool created for the export"), "{log}");
    let (ok, text) = qemu_io(
        &uri,
        &[
            "read -P 0 0 1M",
            "write -P 0xab 1M 256k",
            // Less than a page: QEMU reads the page, merges and writes it whole.
            "write -P 0x11 8192 512",
            "read -P 0xab 1M 256k",
            "read -P 0x11 8192 512",
            "read -P 0 8704 3584",
            "read -P 0 2M 1M",
        ],
    );
    assert!(ok, "{text}");
    // A second connection sees the same disk; a discard makes the pages read as zeros.
    let (ok, text) = qemu_io(&uri, &["read -P 0xab 1M 256k", "discard 1M 64k", "read -P 0 1M 64k"]);
    assert!(ok, "{text}");
    if support::have("nbdinfo") {
        let out = Command::new("nbdinfo").args(["--json", &uri]).output().unwrap();
        let info: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let export = &info["exports"][0];
        assert_eq!(export["block_size_minimum"], 4096, "{info}");
        assert_eq!(export["export-size"], 64 << 20, "{info}");
        let out = Command::new("nbdinfo").args(["--map", &uri]).output().unwrap();
        let map = String::from_utf8_lossy(&out.stdout);
        // Lines of `START LENGTH TYPE DESCRIPTION`: the description of the byte at `at`.
        let at = |byte: u64| {
            map.lines().find_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                let (start, len) =
                    (f.first()?.parse::<u64>().ok()?, f.get(1)?.parse::<u64>().ok()?);
                (start..start + len).contains(&byte).then(|| f.get(3).copied().unwrap_or(""))
            })
        };
        // Data where the writes left it, holes elsewhere (the discarded 64 KiB included).
        assert_eq!(at(8192), Some("data"), "{map}");
        assert_eq!(at(1 << 20), Some("hole,zero"), "{map}");
        assert_eq!(at((1 << 20) + (64 << 10)), Some("data"), "{map}");
        assert_eq!(at(2 << 20), Some("hole,zero"), "{map}");
    } else {
        eprintln!("nbdinfo checks skipped: nbdinfo is needed (Debian package libnbd-bin)");
    }
    assert!(nbd.signal("TERM").success());
    assert!(nbd.wait_timeout(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

#[test]
fn a_full_pool_answers_enospc_and_keeps_earlier_writes() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    // A 64 MiB disk in a pool that lends 4 MiB.
    let (mut nbd, uri) =
        start_nbd(&["--export", "d=pool:64M", "--pool", "local:4M", "--local-tier", "0"]);
    let (ok, text) = qemu_io(&uri, &["write -P 0x5a 0 1M"]);
    assert!(ok, "{text}");
    let (_, text) = qemu_io(&uri, &["write -P 0x77 1M 16M"]);
    assert!(text.contains("No space left on device"), "{text}");
    let (ok, text) = qemu_io(&uri, &["read -P 0x5a 0 1M"]);
    assert!(ok, "the earlier writes: {text}");
    // Space freed by a discard takes writes again.
    let (ok, text) =
        qemu_io(&uri, &["discard 1M 16M", "write -P 0x33 1M 1M", "read -P 0x33 1M 1M"]);
    assert!(ok, "{text}");
    assert!(nbd.is_running() && !nbd.log_so_far().contains("panicked"));
    assert!(nbd.signal("TERM").success());
    assert!(nbd.wait_timeout(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

/// A fio job file: 4 jobs write 8 MiB each at 4 KiB with crc32c checksums and verify them
/// (or, with `verify_only`, only verify what an earlier run wrote).
fn fio_job(uri: &str, verify_only: bool) -> String {
    let mode = if verify_only { "verify_only=1" } else { "do_verify=1" };
    format!(
        "[global]\nioengine=nbd\nuri={uri}\nrw=randwrite\nbs=4k\nverify=crc32c\nverify_fatal=1\n\
         {mode}\nverify_state_save=0\ngroup_reporting=1\niodepth=16\nruntime=60\n\n\
         [pool]\nsize=8m\nnumjobs=4\noffset=0\noffset_increment=8m\n"
    )
}

/// Starts fio on `job` in `dir`, its output into `dir/NAME.out`.
fn start_fio(dir: &Path, name: &str, job: &str) -> ProcessGroup {
    let file = dir.join(format!("{name}.fio"));
    std::fs::write(&file, job).unwrap();
    let out = File::create(dir.join(format!("{name}.out"))).unwrap();
    ProcessGroup::spawn(
        Command::new("timeout")
            .args(["90", "fio"])
            .arg(&file)
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out),
    )
}

/// Waits for fio `name` in `dir`; panics with its output unless it passed.
fn fio_passed(mut fio: ProcessGroup, dir: &Path, name: &str, log: impl Fn() -> String) {
    let status = fio.wait_until(Instant::now() + FIO_TIMEOUT);
    let out = std::fs::read_to_string(dir.join(format!("{name}.out"))).unwrap_or_default();
    assert!(
        status.is_some_and(|s| s.success()) && out.contains("err= 0"),
        "fio {name} failed ({status:?}):\n{out}\n=== fallow nbd ===\n{}",
        log()
    );
}

/// `fallow nbd` with a 64 MiB pool export on the node (or cluster) at `node`, no local
/// tier: every read goes to the pool.
fn pool_export_on(node: &str, secret: &str) -> (Daemon, String) {
    let pool = format!("fallow://{node}");
    start_nbd(&[
        "--export",
        "d=pool:64M",
        "--pool",
        &pool,
        "--secret-file",
        secret,
        "--local-tier",
        "0",
    ])
}

fn have_fio() -> bool {
    let ok = support::command_works("fio", &["--enghelp=nbd"]);
    if !ok {
        eprintln!("skipped: fio with its nbd engine is needed (Debian package fio)");
    }
    ok
}

#[test]
fn fio_verifies_a_pool_export_on_a_node() {
    if !have_fio() {
        return;
    }
    let dir = TempDir::new("nbd-pool-node");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "nbd-pool-test-secret-0123456789ab\n").unwrap();
    let s = secret.to_str().unwrap();
    let (_node, addr) =
        start_node(&["--listen", "127.0.0.1:0", "--lend", "96M", "--secret-file", s], START);
    let (nbd, uri) = pool_export_on(&addr, s);
    assert!(nbd.log_so_far().contains("caching in one node"));
    let fio = start_fio(dir.path(), "write", &fio_job(&uri, false));
    fio_passed(fio, dir.path(), "write", || nbd.log_so_far());
    let fio = start_fio(dir.path(), "verify", &fio_job(&uri, true));
    fio_passed(fio, dir.path(), "verify", || nbd.log_so_far());
}

#[test]
fn fio_verifies_a_pool_export_on_three_nodes_while_one_is_killed() {
    if !have_fio() {
        return;
    }
    let dir = TempDir::new("nbd-pool-cluster");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "nbd-pool-test-secret-0123456789ab\n").unwrap();
    let s = secret.to_str().unwrap();
    let (mut nodes, addrs) = support::start_cluster(3, &["--lend", "96M"], &secret, START);
    let (nbd, uri) = pool_export_on(&addrs[0], s);
    let log = nbd.log_so_far();
    assert!(log.contains("caching in a cluster") && log.contains("nodes=3"), "{log}");
    let fio = start_fio(dir.path(), "write", &fio_job(&uri, false));
    fio_passed(fio, dir.path(), "write", || nbd.log_so_far());
    // Every page has two copies; one node's go with it, mid-verify.
    let fio = start_fio(dir.path(), "verify", &fio_job(&uri, true));
    std::thread::sleep(Duration::from_millis(300));
    nodes[2].kill();
    fio_passed(fio, dir.path(), "verify", || nbd.log_so_far());
    // And the pages are all still there once the verify pass is over.
    let fio = start_fio(dir.path(), "again", &fio_job(&uri, true));
    fio_passed(fio, dir.path(), "again", || nbd.log_so_far());
    assert!(!nbd.log_so_far().contains("panicked"));
}

#[test]
fn a_restarted_export_finds_its_disk_on_the_node_by_uuid() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let dir = TempDir::new("nbd-pool-uuid");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "nbd-pool-test-secret-0123456789ab\n").unwrap();
    let s = secret.to_str().unwrap();
    let (_node, addr) =
        start_node(&["--listen", "127.0.0.1:0", "--lend", "64M", "--secret-file", s], START);
    let pool = format!("fallow://{addr}");
    let export = "d=pool:16M,uuid=6f1c2a9e-0b7d-4e2f-9a35-1d2c3b4a5f60";
    let args = ["--export", export, "--pool", &pool, "--secret-file", s, "--local-tier", "0"];
    let (mut first, uri) = start_nbd(&args);
    let (ok, text) = qemu_io(&uri, &["write -P 0x42 0 1M", "write -P 0x24 8M 64k"]);
    assert!(ok, "{text}");
    // Killed without warning: its client's lease keeps the pool on the node meanwhile.
    first.kill();
    let (mut second, uri) = start_nbd(&args);
    let (ok, text) =
        qemu_io(&uri, &["read -P 0x42 0 1M", "read -P 0x24 8M 64k", "read -P 0 1M 1M"]);
    assert!(ok, "the restarted export lost its disk: {text}");
    // Another size under the same UUID is refused, with the reason.
    let out = support::fallow()
        .args(["nbd", "--listen", "127.0.0.1:0"])
        .args(["--export", "d=pool:32M,uuid=6f1c2a9e0b7d4e2f9a351d2c3b4a5f60"])
        .args(["--pool", &pool, "--secret-file", s])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("another size"), "{err}");
    assert!(second.signal("TERM").success());
    assert!(second.wait_timeout(Duration::from_secs(10)).is_some_and(|s| s.success()));
}

#[test]
fn bad_pool_exports_are_refused_with_the_reason() {
    let cases: &[(&[&str], &str)] = &[
        (&["--export", "d=pool:16M"], "give --pool"),
        (&["--export", "d=pool:1000", "--pool", "local:16M"], "multiple of 4 KiB"),
        (&["--export", "d=pool:16M,uuid=xyz", "--pool", "local:16M"], "32 hex digits"),
        (&["--export", "d=pool:16M,color=red", "--pool", "local:16M"], "pool:SIZE[,uuid=UUID]"),
        (
            &[
                "--export",
                "d=pool:16M,uuid=6f1c2a9e0b7d4e2f9a351d2c3b4a5f60",
                "--pool",
                "local:16M",
            ],
            "goes with the process",
        ),
    ];
    for (args, want) in cases {
        let out = support::fallow().args(["nbd", "--listen", "127.0.0.1:0"]).args(*args).output();
        let out = out.unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn a_backed_up_pool_export_survives_the_loss_of_its_pool() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let dir = TempDir::new("nbd-pool-backup");
    let backup = dir.path().join("backup.img");
    let export = format!("d=pool:16M,backup={}", backup.display());
    let args = ["--export", &export, "--pool", "local:32M", "--local-tier", "0"];
    let (mut first, uri) = start_nbd(&args);
    let (ok, text) = qemu_io(&uri, &["write -P 0x61 0 1M", "write -P 0x62 4M 64k", "flush"]);
    assert!(ok, "{text}");
    let (ok, text) = qemu_io(&uri, &["write -P 0x63 8M 256k", "discard 4M 4k"]);
    assert!(ok, "{text}");
    // SIGTERM: the writes after the flush reach the file too, and the pool, in the
    // process, goes with it.
    assert!(first.signal("TERM").success());
    assert!(first.wait_timeout(Duration::from_secs(15)).is_some_and(|s| s.success()));
    let (mut second, uri) = start_nbd(&args);
    let (ok, text) = qemu_io(
        &uri,
        &[
            "read -P 0x61 0 1M",
            "read -P 0 4M 4k",
            "read -P 0x62 4100k 60k",
            "read -P 0x63 8M 256k",
            "read -P 0 12M 1M",
        ],
    );
    assert!(ok, "the disk did not survive its pool: {text}");
    assert!(second.signal("TERM").success());
    assert!(second.wait_timeout(Duration::from_secs(15)).is_some_and(|s| s.success()));
    assert_eq!(std::fs::metadata(&backup).unwrap().len(), 16 << 20);
}
