//! The Debian package, built around the binary under test: `scripts/package-test.sh`
//! packages it with cargo-deb (no release build), checks the .deb's files, conffiles,
//! maintainer scripts and systemd units (`systemd-analyze verify`), then installs it,
//! runs the installed node and `fallow nbd` (on the sample NBD config) as the `fallow`
//! user with the installed configuration and secret, reinstalls, removes and purges it,
//! and checks that the machine is as before.
//! Installing needs root and dpkg, and a machine with no `fallow` package, user or file
//! yet; without them (or without cargo-deb) the script skips with a message, unless
//! `FALLOW_REQUIRE_GUESTS=1` (the test command sets it), when that is a failure.

mod support;

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{ProcessGroup, TempDir};

/// How long the whole script may take; about 10 s with a debug build on 2 cores.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(300);

#[test]
fn debian_package_installs_runs_and_purges_cleanly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = TempDir::new("package");
    let log = dir.path().join("package-test.log");
    // Its output into a file, read once it has ended; in a process group of its own, so
    // that a timeout sends SIGTERM to the script (whose EXIT trap purges the package) and
    // the node it started, before SIGKILL.
    let out = File::create(&log).unwrap();
    let mut script = ProcessGroup::spawn(
        Command::new("bash")
            .arg(root.join("scripts/package-test.sh"))
            .arg(support::BIN)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out),
    );
    let status = script.wait_until(Instant::now() + SCRIPT_TIMEOUT);
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let Some(status) = status else {
        panic!("scripts/package-test.sh did not finish within {SCRIPT_TIMEOUT:?}:\n{output}");
    };
    assert!(status.success(), "scripts/package-test.sh failed ({status}):\n{output}");
    if let Some(reason) = output.lines().find(|l| l.starts_with("package-test: skipped:")) {
        eprintln!("{reason}");
        return;
    }
    assert!(output.contains("package-test: ok:"), "{output}");
}
