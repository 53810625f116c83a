//! A throwaway single-node Ceph cluster for tests, shared by the test binaries that need one:
//! `tests/ceph/ceph-up.sh` in a scratch directory on a free
//! monitor port, and `ceph-down.sh` (which signals the daemons by their recorded PIDs and
//! deletes the directory) when the [`CephCluster`] is dropped, a failed assertion included.
//! Without the Ceph binaries, [`CephCluster::start`] says so and returns `None`, and the test
//! skips; with them, a cluster that does not come up fails the test.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::process::have;

/// The programs `ceph-up.sh` runs.
const TOOLS: [&str; 7] =
    ["ceph-mon", "ceph-osd", "ceph", "rados", "ceph-authtool", "monmaptool", "uuidgen"];

/// A running cluster: one monitor, one memstore OSD, the pool [`CephCluster::POOL`], cephx
/// with the user `admin`, everything on 127.0.0.1. Torn down when dropped.
pub struct CephCluster {
    dir: PathBuf,
}

impl CephCluster {
    /// The pool `ceph-up.sh` creates.
    pub const POOL: &'static str = "cache";

    /// Starts a cluster in `$TMPDIR/fallow-ceph-NAME-PID`, or returns `None`, having said
    /// why on stderr, when a Ceph program is missing. Panics if the cluster does not come up.
    pub fn start(name: &str) -> Option<CephCluster> {
        let missing: Vec<&str> = TOOLS.iter().copied().filter(|t| !have(t)).collect();
        if !missing.is_empty() {
            eprintln!(
                "skipped: no Ceph here ({} not found; Debian packages ceph-mon ceph-osd \
                 ceph-common, which scripts/test.sh installs)",
                missing.join(", ")
            );
            return None;
        }
        let dir = std::env::temp_dir().join(format!("fallow-ceph-{name}-{}", std::process::id()));
        // The guard exists before any daemon does, so that a failed start is torn down too.
        let cluster = CephCluster { dir };
        cluster.down();
        let script = scripts().join("ceph-up.sh");
        // A second try on a fresh port: another process may take the free port first.
        for attempt in 1..=2 {
            let out = Command::new("timeout")
                .args(["180", "bash"])
                .arg(&script)
                .arg(&cluster.dir)
                .env("MON_PORT", free_port_pair().to_string())
                .env("STORE", "memstore")
                .env("AUTH", "cephx")
                .env("POOL", Self::POOL)
                .output()
                .expect("running ceph-up.sh");
            if out.status.success() {
                break;
            }
            let report = format!(
                "ceph-up.sh failed ({}):\n{}{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                cluster.log_tails()
            );
            if attempt == 2 {
                panic!("{report}");
            }
            eprintln!("{report}\ntrying once more");
            cluster.down();
        }
        Some(cluster)
    }

    /// The configuration file a client reads (it names the monitor and the keyring).
    pub fn conf(&self) -> PathBuf {
        self.dir.join("ceph.conf")
    }

    /// Runs `rados -p POOL ARGS...` against this cluster; returns whether it succeeded and
    /// its stdout (its stderr on failure).
    pub fn rados(&self, args: &[&str]) -> (bool, Vec<u8>) {
        let out = Command::new("timeout")
            .args(["30", "rados", "-p", Self::POOL])
            .args(args)
            .env("CEPH_CONF", self.conf())
            .output()
            .expect("running rados");
        if out.status.success() {
            (true, out.stdout)
        } else {
            (false, out.stderr)
        }
    }

    /// The last lines of each daemon log, for a failure message.
    fn log_tails(&self) -> String {
        let Ok(entries) = std::fs::read_dir(self.dir.join("log")) else { return String::new() };
        let mut text = String::new();
        for entry in entries.flatten() {
            let log = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            text += &format!("--- {}\n", entry.path().display());
            text += &lines[lines.len().saturating_sub(15)..].join("\n");
            text += "\n";
        }
        text
    }

    /// Stops the daemons by their recorded PIDs (SIGKILL: the data is thrown away) and
    /// deletes the directory.
    fn down(&self) {
        let _ = Command::new("bash")
            .arg(scripts().join("ceph-down.sh"))
            .arg(&self.dir)
            .env("FAST", "1")
            .status();
    }
}

impl Drop for CephCluster {
    fn drop(&mut self) {
        self.down();
    }
}

/// `tests/ceph/` at the top of the workspace.
fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/ceph")
}

/// A port P on 127.0.0.1 such that P and P+1 (the monitor's msgr2 and v1 ports) were both
/// free a moment ago.
fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let first = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if port < u16::MAX && TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two consecutive free ports on 127.0.0.1");
}
