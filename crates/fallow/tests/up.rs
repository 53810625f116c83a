//! `fallow up`, the embedded default: it creates its image on first run, serves it over
//! NBD, stops cleanly, and a second run serves the same data. Skips without qemu-io.

mod support;

use std::path::Path;
use std::time::Duration;

use support::{Daemon, TempDir};

/// Starts `fallow up` with its data in `dir`; returns it with the URI it serves.
fn up(dir: &Path) -> (Daemon, String) {
    Daemon::start(
        "fallow up",
        support::fallow()
            .args(["up", "--size", "32M", "--listen", "127.0.0.1:0", "--lend", "16M", "--quiet"])
            .arg("--data-dir")
            .arg(dir)
            .env("FALLOW_LOG", "warn"),
        "URI",
        Duration::from_secs(20),
        |line| {
            line.split(" at ")
                .nth(1)
                .filter(|_| line.starts_with("fallow up: serving"))
                .map(str::to_string)
        },
    )
}

/// Runs qemu-io, which must succeed and report no failure.
fn qemu_io(uri: &str, commands: &[&str]) -> String {
    let (exited_ok, text) = support::qemu_io(uri, commands);
    assert!(exited_ok && !text.contains("fail") && !text.contains("error"), "{text}");
    text
}

#[test]
fn up_serves_an_image_that_survives_a_restart() {
    if !support::have("qemu-io") {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    // `fallow up` creates the directory itself on its first run.
    let dir = TempDir::uncreated("up");
    let (mut first, uri) = up(dir.path());
    qemu_io(&uri, &["write -P 0x42 1M 256k", "flush", "read -P 0x42 1M 256k"]);
    let image = dir.path().join("disk.img");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 32 << 20);
    first.signal("TERM");
    let exit =
        first.wait_timeout(Duration::from_secs(15)).expect("fallow up did not stop on SIGTERM");
    assert!(exit.success(), "{exit:?}");
    let (second, uri) = up(dir.path());
    qemu_io(&uri, &["read -P 0x42 1M 256k", "read -P 0 0 1M"]);
    drop(second);
}
