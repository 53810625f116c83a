//! `fallow nbd` in front of nbdkit (the reference server) as the backing store: the data
//! path round-trips, and with nbdkit's error filter switched on mid-run a read of data that
//! is not cached fails with EIO and caches nothing, a write is not acknowledged, and the
//! export works again once the errors stop; and an upstream NBD server's holes show in the
//! export's block status. Skips when nbdkit or qemu-io is missing.

mod support;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{have, Daemon, KillOnDrop};

/// Starts `fallow nbd` and returns it with the URI of its export.
fn start_fallow(args: &[&str]) -> (Daemon, String) {
    Daemon::start(
        "fallow nbd",
        support::fallow().arg("nbd").args(args),
        "URI",
        Duration::from_secs(20),
        |line| line.strip_prefix("fallow nbd: serving ").map(str::to_string),
    )
}

/// Runs qemu-io; returns whether it succeeded (exit status 0 and no failure reported),
/// and its output.
fn qemu_io(uri: &str, commands: &[&str]) -> (bool, String) {
    let (exited_ok, text) = support::qemu_io(uri, commands);
    let failed = text.contains("error") || text.contains("failed") || !exited_ok;
    (!failed, text)
}

#[test]
fn nbdkit_behind_fallow_with_errors_switched_on_and_off() {
    if !have("nbdkit") || !have("qemu-io") {
        eprintln!("skipped: nbdkit and qemu-io are needed (Debian packages nbdkit, qemu-utils)");
        return;
    }
    let trigger = std::env::temp_dir().join(format!("fallow-error-trigger-{}", std::process::id()));
    let _ = std::fs::remove_file(&trigger);
    let port = support::free_port();
    let _nbdkit = KillOnDrop::spawn(
        Command::new("nbdkit")
            .args([
                "-f",
                "-i",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "--exit-with-parent",
                "--filter=error",
                "memory",
                "64M",
            ])
            .arg("error-rate=100%")
            .arg(format!("error-file={}", trigger.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    assert!(support::port_opens(port, Duration::from_secs(10)), "nbdkit did not start");
    let upstream = format!("up=nbd://127.0.0.1:{port}");
    let (_fallow, uri) = start_fallow(&[
        "--export",
        &upstream,
        "--listen",
        "127.0.0.1:0",
        "--pool",
        "local:16M",
        "--local-tier",
        "256K",
    ]);

    // The data path, unaligned pieces included.
    let (ok, text) = qemu_io(
        &uri,
        &[
            "write -P 0x5a 0 1M",
            "write -P 0x11 4000 10000",
            "read -P 0x5a 0 4000",
            "read -P 0x11 4000 10000",
            "read -P 0x5a 14000 100000",
            "flush",
        ],
    );
    assert!(ok, "{text}");

    // Errors on: a read of data not in the caches fails with EIO; a write is not
    // acknowledged.
    std::fs::write(&trigger, b"on").unwrap();
    let (ok, text) = qemu_io(&uri, &["read -P 0x5a 8M 64k"]);
    assert!(!ok && text.contains("Input/output error"), "a failed backing read is an EIO: {text}");
    let (ok, text) = qemu_io(&uri, &["write -P 0x77 2M 4k"]);
    assert!(!ok, "a failed backing write is not acknowledged: {text}");

    // Errors off: the export works again, nothing wrong was cached, and the failed write
    // left the old data (zeros) readable.
    std::fs::remove_file(&trigger).unwrap();
    let (ok, text) = qemu_io(
        &uri,
        &["read -P 0 8M 64k", "read -P 0x5a 0 4000", "write -P 0x33 2M 4k", "read -P 0x33 2M 4k"],
    );
    assert!(ok, "{text}");
}

#[test]
fn a_sparse_file_export_reports_holes() {
    if !have("nbdinfo") {
        eprintln!("skipped: nbdinfo is needed (Debian package libnbd-bin)");
        return;
    }
    let image: PathBuf =
        std::env::temp_dir().join(format!("fallow-map-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&image);
    let export = format!("disk=file:{},size=16M", image.display());
    let (_fallow, uri) = start_fallow(&["--export", &export, "--listen", "127.0.0.1:0"]);
    let (ok, text) =
        if have("qemu-io") { qemu_io(&uri, &["write -P 1 4M 1M"]) } else { (true, String::new()) };
    assert!(ok, "{text}");
    let out = Command::new("timeout").args(["30", "nbdinfo", "--map", &uri]).output().unwrap();
    let map = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{map} {}", String::from_utf8_lossy(&out.stderr));
    assert!(map.contains("hole,zero"), "{map}");
    assert!(map.contains("data"), "{map}");
    let _ = std::fs::remove_file(&image);
}

/// An upstream NBD server's holes show through: fallow passes `base:allocation` on, so
/// `nbdinfo --map` of the export is nbdkit's own map, and the data reads back.
#[test]
fn an_upstream_nbd_export_reports_its_holes() {
    if !have("nbdkit") || !have("nbdinfo") {
        eprintln!("skipped: nbdkit and nbdinfo are needed (Debian packages nbdkit, libnbd-bin)");
        return;
    }
    let port = support::free_port();
    // 16 MiB: 1 MiB of 0x01 at 4 MiB and 64 KiB of 0x02 at 12 MiB, holes elsewhere.
    let _nbdkit = KillOnDrop::spawn(
        Command::new("nbdkit")
            .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "--exit-with-parent"])
            .args(["data", "data=@4194304 1*1048576 @12582912 2*65536", "size=16M"])
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    assert!(support::port_opens(port, Duration::from_secs(10)), "nbdkit did not start");
    let upstream = format!("nbd://127.0.0.1:{port}/");
    let export = format!("disk={upstream}");
    let (_fallow, uri) = start_fallow(&["--export", &export, "--listen", "127.0.0.1:0"]);
    let map = |uri: &str| {
        let out = Command::new("timeout").args(["30", "nbdinfo", "--map", uri]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
        text
    };
    let (ours, theirs) = (map(&uri), map(&upstream));
    assert_eq!(ours, theirs, "fallow's map is the upstream's");
    assert_eq!(ours.matches("hole,zero").count(), 3, "{ours}");
    assert_eq!(ours.matches("data").count(), 2, "{ours}");
    if have("qemu-io") {
        let (ok, text) = qemu_io(&uri, &["read -P 0 0 4M", "read -P 1 4M 1M", "read -P 2 12M 64k"]);
        assert!(ok, "{text}");
    }
}

/// Write-back, killed with SIGKILL: every write acknowledged before a completed FLUSH is in
/// the image afterwards; later writes may or may not be.
#[test]
fn write_back_survives_kill_9_for_everything_flushed() {
    if !have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let image: PathBuf = std::env::temp_dir().join(format!("fallow-wb-{}.img", std::process::id()));
    let _ = std::fs::remove_file(&image);
    let export = format!("disk=file:{},size=32M", image.display());
    let (fallow, uri) = start_fallow(&[
        "--export",
        &export,
        "--listen",
        "127.0.0.1:0",
        "--pool",
        "local:16M",
        "--write-policy",
        "back",
        "--max-dirty",
        "16M",
        "--max-dirty-age",
        "600000",
    ]);
    // Flushed: 4 MiB of 0x61 plus unaligned pieces.
    let (ok, text) = qemu_io(&uri, &["write -P 0x61 0 4M", "write -P 0x62 5000 3000", "flush"]);
    assert!(ok, "{text}");
    // Acknowledged but never flushed (the flusher waits 10 minutes).
    let (ok, text) = qemu_io(&uri, &["write -P 0x63 8M 1M"]);
    assert!(ok, "{text}");
    fallow.signal("KILL");
    drop(fallow);
    let bytes = std::fs::read(&image).unwrap();
    assert!(bytes[..5000].iter().all(|b| *b == 0x61), "flushed data before the piece");
    assert!(bytes[5000..8000].iter().all(|b| *b == 0x62), "the flushed unaligned piece");
    assert!(bytes[8000..4 << 20].iter().all(|b| *b == 0x61), "flushed data after the piece");
    // The unflushed megabyte is all old or partly new: either is allowed, but nothing else.
    assert!(bytes[8 << 20..9 << 20].iter().all(|b| *b == 0 || *b == 0x63));
    let _ = std::fs::remove_file(&image);
}

/// An upstream export that needs 4 KiB-aligned requests (nbdkit's blocksize-policy filter,
/// which fails misaligned ones): fallow advertises the same minimum, qemu-io (which honours
/// it with its own read-modify-write) round-trips unaligned data, and a misaligned write
/// sent anyway is refused with EINVAL on a connection that stays usable. An upstream that
/// needs blocks larger than a page is refused at start, with the reason.
#[test]
fn an_upstream_minimum_block_size_is_advertised_and_enforced() {
    if !have("nbdkit") || !have("nbdinfo") || !have("nbdsh") || !have("qemu-io") {
        eprintln!("skipped: nbdkit, nbdinfo, nbdsh and qemu-io are needed");
        return;
    }
    let nbdkit = |port: u16, minimum: u32| {
        KillOnDrop::spawn(
            Command::new("nbdkit")
                .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "--exit-with-parent"])
                .args(["--filter=blocksize-policy", "memory", "size=16M"])
                .arg(format!("blocksize-minimum={minimum}"))
                .arg(format!("blocksize-preferred={}", minimum.max(4096)))
                .arg("blocksize-error-policy=error")
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        )
    };
    let port = support::free_port();
    let _upstream = nbdkit(port, 4096);
    assert!(support::port_opens(port, Duration::from_secs(10)), "nbdkit did not start");
    let export = format!("disk=nbd://127.0.0.1:{port}/");
    let (_fallow, uri) = start_fallow(&["--export", &export, "--listen", "127.0.0.1:0"]);

    let out = Command::new("timeout").args(["30", "nbdinfo", "--json", &uri]).output().unwrap();
    let info = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{info}");
    assert!(info.contains("\"block_size_minimum\": 4096"), "{info}");

    let (ok, text) = qemu_io(&uri, &["write -P 7 512 1k", "read -P 7 512 1k", "read -P 0 0 512"]);
    assert!(ok, "qemu-io, which aligns for the export: {text}");

    // Strict mode off: libnbd sends the misaligned write as asked.
    let script = r#"
h.set_strict_mode(0)
try:
    h.pwrite(b"x" * 512, 512)
    raise SystemExit("a misaligned write was accepted")
except nbd.Error as e:
    assert e.errnum == errno.EINVAL, e
buf = h.pread(4096, 0)
assert buf[512:1536] == b"\x07" * 1024, buf[:16]
h.pwrite(b"y" * 4096, 8192)
assert h.pread(4096, 8192) == b"y" * 4096
print("ok")
"#;
    // Debian's python3 first: nbdsh runs `python3 -m nbd`, and the module exists only for
    // it, not for a pyenv python3 that may come first on PATH.
    let path = format!("/usr/bin:/bin:{}", std::env::var("PATH").unwrap_or_default());
    let out = Command::new("timeout")
        .args(["30", "nbdsh", "-u", &uri, "-c", "import errno", "-c", script])
        .env("PATH", path)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("ok"), "{text}");

    // Blocks larger than a page: refused when the export opens.
    let big = support::free_port();
    let _big_upstream = nbdkit(big, 65536);
    assert!(support::port_opens(big, Duration::from_secs(10)), "nbdkit did not start");
    let out = support::fallow()
        .args(["nbd", "--listen", "127.0.0.1:0", "--export"])
        .arg(format!("disk=nbd://127.0.0.1:{big}/"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("minimum block size is 65536"), "{text}");
}
