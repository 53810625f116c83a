//! Real guests on `fallow vhost`: QEMU's `vhost-user-blk-pci` device (the guest's memory in
//! a shared memfd) served by fallow from a file store, through a local pool. A guest sees
//! the device's geometry and id, writes a pattern, discards and zeroes ranges, syncs and
//! reads everything back; the store's file holds the same afterwards. A QEMU killed in the
//! middle of its writes leaves the device serving the next QEMU, which finds every block
//! the first one synced; and a guest whose `fallow vhost` restarts under it carries on
//! once QEMU has reconnected.
//!
//! Without qemu-system-x86_64 the tests skip with a message, unless
//! `FALLOW_REQUIRE_GUESTS=1` (the test command sets it).

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fallow_testkit::guest::{Disk, Guest, GuestOutput, GuestSpec, MinimalImage};
use support::guests::synced;
use support::{Daemon, TempDir};

/// [`support::guests::run_guest`], which must also exit 0.
fn run_guest(image: &MinimalImage, spec: &GuestSpec) -> GuestOutput {
    let out = support::guests::run_guest(image, spec);
    assert_eq!(out.exit_code, 0, "{}", out.console_text());
    out
}

const START: Duration = Duration::from_secs(30);

/// Bytes of the test disk.
const DISK_BYTES: u64 = 64 << 20;

/// A store file and `fallow vhost` serving it as export `disk`.
struct Stack {
    dir: TempDir,
    store: PathBuf,
    vhost: Option<Daemon>,
    socket: PathBuf,
}

impl Stack {
    fn new(name: &str) -> Stack {
        let dir = TempDir::new(name);
        let store = dir.path().join("store.img");
        std::fs::File::create(&store).unwrap().set_len(DISK_BYTES).unwrap();
        let socket = dir.path().join("sockets/disk.sock");
        Stack { dir, store, vhost: None, socket }
    }

    /// Starts `fallow vhost` over the store, with a pool in the process, a local tier of
    /// 1 MiB (so most reads reach the pool), write policy `policy` and `extra` arguments.
    fn start(&mut self, policy: &str, extra: &[&str]) {
        let (daemon, socket) = Daemon::start(
            "fallow vhost",
            support::fallow()
                .arg("vhost")
                .args(["--export", &format!("disk=file:{}", self.store.display())])
                .arg("--socket-dir")
                .arg(self.dir.path().join("sockets"))
                .args(["--pool", "local:32M", "--local-tier", "1M"])
                .args(["--write-policy", policy, "--queues", "2"])
                .args(extra)
                .env("FALLOW_LOG", "info")
                .stdin(Stdio::null()),
            "socket",
            START,
            support::vhost_socket,
        );
        assert_eq!(socket, self.socket);
        self.vhost = Some(daemon);
    }

    fn vhost(&mut self) -> &mut Daemon {
        self.vhost.as_mut().expect("fallow vhost not started")
    }

    /// Stops `fallow vhost` with SIGTERM (it writes its dirty data out) and checks that it
    /// left no socket behind.
    fn stop(&mut self) {
        let vhost = self.vhost();
        vhost.signal("TERM");
        let status = vhost.wait_timeout(START).expect("fallow vhost did not stop on SIGTERM");
        assert!(status.success(), "fallow vhost failed: {}", vhost.log_so_far());
        assert!(!self.socket.exists(), "the socket was left behind");
        self.vhost = None;
    }

    fn disk(&self) -> Disk {
        Disk::VhostUser { socket: self.socket.clone(), queues: 2 }
    }
}

/// Runs the guest tool on the host (`verify FILE FIRST COUNT SEED` or `zeros FILE FIRST
/// COUNT`); panics unless every block matched.
fn check_on_host(image: &MinimalImage, args: &[&str], file: &Path) {
    let (verb, rest) = args.split_first().unwrap();
    let out = Command::new(image.tool()).arg(verb).arg(file).args(rest).output().unwrap();
    assert!(
        out.status.success(),
        "the store's file does not hold what the guest wrote ({args:?}):\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// What the guest reports of its disk, then the pattern written and read back, a discard
/// and a zeroing in its middle, each read back as zeros, the rest still the pattern.
const GEOMETRY_AND_DATA: &str = "\
q=/sys/block/vda/queue
echo \"FALLOW-RESULT serial $(cat /sys/block/vda/serial)\"
echo \"FALLOW-RESULT sectors $(cat /sys/block/vda/size)\"
echo \"FALLOW-RESULT queues $(ls /sys/block/vda/mq | wc -l)\"
echo \"FALLOW-RESULT blocks $(cat $q/logical_block_size)/$(cat $q/physical_block_size)\"
echo \"FALLOW-RESULT discard $(cat $q/discard_max_bytes)\"
echo \"FALLOW-RESULT zeroes $(cat $q/write_zeroes_max_bytes)\"
echo \"FALLOW-RESULT cache $(cat $q/write_cache)\"
fallow-guest-tool write /dev/vda 0 2048 41 256 || exit 10
fallow-guest-tool verify /dev/vda 0 2048 41 || exit 11
blkdiscard -o $((512 * 4096)) -l $((256 * 4096)) /dev/vda || exit 12
fallow-guest-tool zeros /dev/vda 512 256 || exit 13
fallow-guest-tool zeroout /dev/vda 1024 256 || exit 14
fallow-guest-tool zeros /dev/vda 1024 256 || exit 15
fallow-guest-tool verify /dev/vda 0 512 41 || exit 16
fallow-guest-tool verify /dev/vda 768 256 41 || exit 17
fallow-guest-tool verify /dev/vda 1280 768 41 || exit 18
";

#[test]
fn a_guest_on_vhost_user_blk_sees_its_disk_writes_discards_zeroes_and_verifies() {
    let Some(image) = support::guests::guest_image(&[]) else { return };
    let mut stack = Stack::new("vhost-guest-data");
    stack.start("back", &[]);
    let spec = GuestSpec::new(GEOMETRY_AND_DATA).cpus(2).disk(stack.disk());
    let out = run_guest(&image, &spec);
    assert_eq!(out.result("serial").as_deref(), Some("disk"));
    assert_eq!(out.result("sectors"), Some((DISK_BYTES / 512).to_string()));
    assert_eq!(out.result("queues").as_deref(), Some("2"), "one queue per vCPU");
    assert_eq!(out.result("blocks").as_deref(), Some("512/4096"));
    assert_ne!(out.result("discard").as_deref(), Some("0"), "no discard offered");
    assert_ne!(out.result("zeroes").as_deref(), Some("0"), "no write-zeroes offered");
    assert_eq!(out.result("cache").as_deref(), Some("write back"), "FLUSH not offered");
    stack.stop();
    check_on_host(&image, &["verify", "0", "512", "41"], &stack.store);
    check_on_host(&image, &["zeros", "512", "256"], &stack.store);
    check_on_host(&image, &["verify", "768", "256", "41"], &stack.store);
    check_on_host(&image, &["zeros", "1024", "256"], &stack.store);
    check_on_host(&image, &["verify", "1280", "768", "41"], &stack.store);
}

#[test]
fn a_qemu_killed_mid_write_leaves_the_device_serving_the_next_qemu() {
    let Some(image) = support::guests::guest_image(&[]) else { return };
    let mut stack = Stack::new("vhost-guest-kill");
    // Polling queue threads, so that the spinning path is the one under test here.
    stack.start("back", &["--poll-us", "200"]);
    // 32 MiB of blocks, synced every 64: far more than the guest writes before the kill.
    let spec = GuestSpec::new("fallow-guest-tool write /dev/vda 0 8192 7 64\n").disk(stack.disk());
    let mut guest = Guest::boot(&image, &spec).unwrap_or_else(|e| panic!("{e}"));
    let line = guest
        .wait_for("sync 1024 blocks", |line| {
            line.split_once("FALLOW-SYNCED ").and_then(|(_, n)| n.trim().parse::<u64>().ok())
                >= Some(1024)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    guest.kill();
    let durable: u64 = line.split_once("FALLOW-SYNCED ").unwrap().1.trim().parse().unwrap();
    assert!(stack.vhost().is_running(), "fallow vhost died with its QEMU");

    // The next QEMU on the same socket finds every synced block, and writes on.
    let script = format!(
        "fallow-guest-tool verify /dev/vda 0 {durable} 7 || exit 20\n\
         fallow-guest-tool write /dev/vda 9000 1024 8 256 || exit 21\n\
         fallow-guest-tool verify /dev/vda 9000 1024 8 || exit 22\n"
    );
    let out = run_guest(&image, &GuestSpec::new(&script).disk(stack.disk()));
    assert!(out.marked("FALLOW-VERIFY").any(|r| r == "ok=1024 bad=0"), "{}", out.console_text());
    stack.stop();
    check_on_host(&image, &["verify", "0", &durable.to_string(), "7"], &stack.store);
    check_on_host(&image, &["verify", "9000", "1024", "8"], &stack.store);
}

#[test]
fn a_guest_carries_on_when_fallow_vhost_restarts_under_it() {
    let Some(image) = support::guests::guest_image(&[]) else { return };
    let mut stack = Stack::new("vhost-guest-restart");
    stack.start("through", &[]);
    // The guest waits after its first phase while the host restarts fallow vhost; QEMU
    // reconnects (reconnect-ms on its chardev) and the second phase runs on the new one.
    let script = "fallow-guest-tool write /dev/vda 0 1024 3 256 || exit 30\n\
                  echo FALLOW-RESULT phase1 done\n\
                  sleep 8\n\
                  fallow-guest-tool verify /dev/vda 0 1024 3 || exit 31\n\
                  fallow-guest-tool write /dev/vda 2048 1024 4 256 || exit 32\n\
                  fallow-guest-tool verify /dev/vda 2048 1024 4 || exit 33\n";
    let spec = GuestSpec::new(script).disk(stack.disk());
    let mut guest = Guest::boot(&image, &spec).unwrap_or_else(|e| panic!("{e}"));
    guest
        .wait_for("the first phase", |l| l.contains("phase1 done"))
        .unwrap_or_else(|e| panic!("{e}"));
    stack.stop();
    stack.start("through", &[]);
    let out = guest.finish().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(out.exit_code, 0, "{}", out.console_text());
    assert_eq!(synced(&out.console), 1024, "{}", out.console_text());
    let connects =
        stack.vhost().log_lines().iter().filter(|l| l.contains("frontend connected")).count();
    assert_eq!(connects, 1, "QEMU did not reconnect to the new process");
    stack.stop();
    check_on_host(&image, &["verify", "0", "1024", "3"], &stack.store);
    check_on_host(&image, &["verify", "2048", "1024", "4"], &stack.store);
}
