//! qemu-storage-daemon, the reference block backend the benchmarks and tests compare fallow
//! with: one raw image exported as a vhost-user-blk device and, optionally, over NBD, both
//! on Unix sockets beside the image. The daemon is killed by its PID when dropped.
//!
//! qemu-storage-daemon comes with Debian's qemu-utils. [`StorageDaemon::installed`] says
//! whether a test can run; without it a test skips with a message, unless
//! `FALLOW_REQUIRE_GUESTS=1` (the test command sets it), when it fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::process::{have, poll_until, Daemon};

/// The program.
pub const QSD: &str = "qemu-storage-daemon";

/// How long the daemon may take to create its sockets.
const START: Duration = Duration::from_secs(20);

/// A running qemu-storage-daemon; see the module documentation.
pub struct StorageDaemon {
    daemon: Daemon,
    /// The vhost-user-blk export's socket.
    pub vhost_socket: PathBuf,
    /// The NBD server's socket (export name `disk`), if asked for.
    pub nbd_socket: Option<PathBuf>,
}

impl StorageDaemon {
    /// Whether qemu-storage-daemon can be used. `false` (after saying why on stderr) when it
    /// is missing, unless `FALLOW_REQUIRE_GUESTS=1`, which makes it a failure.
    pub fn installed() -> bool {
        if have(QSD) {
            return true;
        }
        let why = "qemu-storage-daemon not installed (Debian qemu-utils)";
        let required = std::env::var("FALLOW_REQUIRE_GUESTS").is_ok_and(|v| v == "1");
        assert!(!required, "FALLOW_REQUIRE_GUESTS=1 but {why}");
        eprintln!("skipped: {why}");
        false
    }

    /// Starts the daemon on `image` (a raw file), with a writable vhost-user-blk export of
    /// one queue at `DIR/vhost.sock` and, when `nbd`, a writable NBD export `disk` at
    /// `DIR/nbd.sock`, where DIR is `image`'s directory. Panics if it does not start.
    pub fn start(image: &Path, nbd: bool) -> StorageDaemon {
        let dir = image.parent().unwrap_or(Path::new("."));
        let vhost_socket = dir.join("vhost.sock");
        let nbd_socket = nbd.then(|| dir.join("nbd.sock"));
        let mut cmd = Command::new(QSD);
        cmd.arg("--blockdev")
            .arg(format!("driver=file,node-name=file0,filename={}", image.display()))
            .args(["--blockdev", "driver=raw,node-name=disk,file=file0"])
            .arg("--export")
            .arg(format!(
                "type=vhost-user-blk,id=vhost0,node-name=disk,addr.type=unix,addr.path={},\
                 writable=on,num-queues=1",
                vhost_socket.display()
            ));
        if let Some(socket) = &nbd_socket {
            cmd.arg("--nbd-server")
                .arg(format!("addr.type=unix,addr.path={}", socket.display()))
                .args(["--export", "type=nbd,id=nbd0,node-name=disk,name=disk,writable=on"]);
        }
        let mut daemon = Daemon::spawn(QSD, &mut cmd);
        let sockets = || vhost_socket.exists() && nbd_socket.as_ref().is_none_or(|s| s.exists());
        let up = poll_until(START, || sockets() || !daemon.is_running());
        assert!(up && daemon.is_running(), "{QSD} did not start: {}", daemon.log_so_far());
        StorageDaemon { daemon, vhost_socket, nbd_socket }
    }

    /// The NBD export's URI (`nbd+unix:///disk?socket=…`), if there is one.
    pub fn nbd_uri(&self) -> Option<String> {
        self.nbd_socket.as_ref().map(|s| format!("nbd+unix:///disk?socket={}", s.display()))
    }

    /// Kills the daemon (SIGKILL) now.
    pub fn kill(&mut self) {
        self.daemon.kill();
    }

    /// Its PID.
    pub fn pid(&self) -> u32 {
        self.daemon.pid()
    }
}
