//! What `deploy/` gives operators, checked against the binary under test:
//! `scripts/check-deploy.sh` runs `promtool check rules` and `promtool test rules` on the
//! Prometheus alerting rules (`deploy/prometheus/`), checks the Grafana dashboard
//! (`deploy/grafana/`), and compares every metric name and label they use with the
//! `/metrics` of a real `fallow node` and `fallow nbd`, which it starts from this binary.
//! Skipped, with a message, without promtool (Debian package `prometheus`), unless
//! `FALLOW_REQUIRE_GUESTS=1` (the test command sets it), when that is a failure.

mod support;

use std::fs::File;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{ProcessGroup, TempDir};

/// How long the whole check may take; about 10 s on a quiet machine with a debug build.
const CHECK_TIMEOUT: Duration = Duration::from_secs(300);

#[test]
fn alerting_rules_and_dashboard_pass_promtool_and_use_served_metrics() {
    if !support::have("promtool") {
        let required = std::env::var("FALLOW_REQUIRE_GUESTS").is_ok_and(|v| v == "1");
        assert!(!required, "FALLOW_REQUIRE_GUESTS=1 but promtool is missing (package prometheus)");
        eprintln!("skipped: promtool is needed (Debian package prometheus)");
        return;
    }
    if !support::command_works("python3", &["--version"]) {
        eprintln!("skipped: python3 is needed");
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = TempDir::new("deploy-rules");
    let log = dir.path().join("check.log");
    // Its output into a file, read once it has ended; in a process group of its own, so
    // that a timeout also stops the node and the NBD server it started.
    let out = File::create(&log).unwrap();
    let mut check = ProcessGroup::spawn(
        Command::new("bash")
            .arg(root.join("scripts/check-deploy.sh"))
            .arg(support::BIN)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out),
    );
    let status = check.wait_until(Instant::now() + CHECK_TIMEOUT);
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let Some(status) = status else {
        panic!("scripts/check-deploy.sh did not finish within {CHECK_TIMEOUT:?}:\n{output}");
    };
    assert!(status.success(), "scripts/check-deploy.sh failed ({status}):\n{output}");
    assert!(output.contains("check-deploy: all checks passed"), "{output}");
}
