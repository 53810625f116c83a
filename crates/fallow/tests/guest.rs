//! Real guests on fallow: Debian's cloud kernel under QEMU (KVM where the host can boot it,
//! else TCG), its virtio disk served by `fallow nbd`, which caches a slow store (nbdkit's
//! file plugin behind its delay filter) in a `fallow node`'s pool. What a guest writes,
//! syncs and reads back must be in the store's file afterwards; what it synced before
//! `fallow nbd` was SIGKILLed must survive the kill; and an ext4 root file system a guest
//! worked on through fallow must pass `e2fsck -n`.
//!
//! The guests come from `fallow_testkit::guest` (images built from Debian packages into a
//! cache outside the repository). Without qemu-system-x86_64 or nbdkit the tests skip
//! with a message, unless `FALLOW_REQUIRE_GUESTS=1` (the test command sets it), when a
//! missing tool fails them.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use fallow_testkit::guest::{ext4_image, Disk, Guest, GuestSpec, MinimalImage};
use support::guests::{guest_image, run_guest, synced};
use support::{free_port, nbd_serving_uri, start_node, Daemon, KillOnDrop, TempDir};

const START: Duration = Duration::from_secs(30);

/// The store's latency for reads and writes: slow enough that a cache matters, fast
/// enough for a test.
const STORE_DELAY: &str = "1ms";

/// The store, the node and the export in front of them.
struct Stack {
    dir: TempDir,
    /// The store's file, served by nbdkit.
    backing: PathBuf,
    _store: KillOnDrop,
    store_uri: String,
    node: Daemon,
    node_addr: String,
    export: Option<Daemon>,
}

impl Stack {
    /// A store over `backing` (made by `make_backing` in the stack's directory), a node
    /// lending 64 MiB, and no export yet.
    fn new(name: &str, make_backing: impl FnOnce(&Path) -> PathBuf) -> Stack {
        let dir = TempDir::new(name);
        let backing = make_backing(dir.path());
        let port = free_port();
        let store = KillOnDrop::spawn(
            Command::new("nbdkit")
                .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "--exit-with-parent"])
                .args(["--filter=delay", "file"])
                .arg(&backing)
                .arg(format!("delay-read={STORE_DELAY}"))
                .arg(format!("delay-write={STORE_DELAY}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null()),
        );
        assert!(support::port_opens(port, START), "nbdkit did not start");
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "guest-test-secret-0123456789abcdef\n").unwrap();
        let (node, node_addr) = start_node(
            &[
                "--listen",
                "127.0.0.1:0",
                "--lend",
                "64M",
                "--secret-file",
                secret.to_str().unwrap(),
            ],
            START,
        );
        Stack {
            dir,
            backing,
            _store: store,
            store_uri: format!("nbd://127.0.0.1:{port}/"),
            node,
            node_addr,
            export: None,
        }
    }

    /// Starts `fallow nbd` over the store with the node's pool, a local tier of 1 MiB
    /// (so that most reads reach the pool) and `policy` (`through` or `back`); returns the
    /// export's URI.
    fn start_export(&mut self, policy: &str) -> String {
        let secret = self.dir.path().join("secret");
        let (daemon, uri) = Daemon::start(
            "fallow nbd",
            support::fallow()
                .arg("nbd")
                .args(["--export", &format!("disk={}", self.store_uri)])
                .args(["--listen", "127.0.0.1:0", "--local-tier", "1M"])
                .args(["--pool", &format!("fallow://{}", self.node_addr)])
                .args(["--secret-file", secret.to_str().unwrap()])
                .args(["--write-policy", policy])
                .env("FALLOW_LOG", "info"),
            "URI",
            START,
            nbd_serving_uri,
        );
        self.export = Some(daemon);
        uri
    }

    /// The export's process.
    fn export(&mut self) -> &mut Daemon {
        self.export.as_mut().expect("no export started")
    }
}

/// Runs `fallow-guest-tool verify FILE FIRST COUNT SEED` on the host and returns its
/// report line; panics unless every block matched.
fn verify_on_host(image: &MinimalImage, file: &Path, first: u64, count: u64, seed: u64) -> String {
    let out = Command::new(image.tool())
        .arg("verify")
        .arg(file)
        .args([first.to_string(), count.to_string(), seed.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "the store's file does not hold what the guest wrote:\n{text}");
    text
}

/// A sparse file of `size` bytes at `dir/name`.
fn sparse_file(dir: &Path, name: &str, size: u64) -> PathBuf {
    let path = dir.join(name);
    std::fs::File::create(&path).unwrap().set_len(size).unwrap();
    path
}

fn writes_syncs_and_verifies(policy: &str) {
    let Some(image) = guest_image(&["nbdkit"]) else { return };
    let mut stack = Stack::new(&format!("guest-pattern-{policy}"), |dir| {
        sparse_file(dir, "store.img", 64 << 20)
    });
    let uri = stack.start_export(policy);
    // 8 MiB of blocks, synced every 256; then read back through the caches (O_DIRECT, so
    // the guest's own page cache answers nothing).
    let script = "fallow-guest-tool write /dev/vda 0 2048 41 256 || exit 10\n\
                  fallow-guest-tool verify /dev/vda 0 2048 41 || exit 11\n";
    let spec = GuestSpec::new(script).disk(Disk::nbd(&uri));
    let out = run_guest(&image, &spec);
    assert_eq!(out.exit_code, 0, "{}", out.console_text());
    assert!(out.marked("FALLOW-VERIFY").any(|r| r == "ok=2048 bad=0"), "{}", out.console_text());
    stack.export().signal("TERM");
    assert!(stack.export().wait_timeout(START).is_some(), "fallow nbd did not stop on SIGTERM");
    verify_on_host(&image, &stack.backing, 0, 2048, 41);
    assert!(stack.node.is_running(), "the node died: {}", stack.node.log_so_far());
}

#[test]
fn a_guest_writes_syncs_and_verifies_through_a_write_through_export() {
    writes_syncs_and_verifies("through");
}

#[test]
fn a_guest_writes_syncs_and_verifies_through_a_write_back_export() {
    writes_syncs_and_verifies("back");
}

#[test]
fn what_a_guest_synced_survives_a_sigkill_of_a_write_back_export() {
    let Some(image) = guest_image(&["nbdkit"]) else { return };
    let mut stack = Stack::new("guest-kill", |dir| sparse_file(dir, "store.img", 64 << 20));
    let uri = stack.start_export("back");
    // 32 MiB of blocks, synced every 64: far more than the guest writes before the kill.
    let script = "fallow-guest-tool write /dev/vda 0 8192 7 64\n";
    let spec = GuestSpec::new(script).disk(Disk::nbd(&uri));
    let mut guest = Guest::boot(&image, &spec).unwrap_or_else(|e| panic!("{e}"));
    let progress = |line: &str| {
        line.split_once("FALLOW-SYNCED ").and_then(|(_, n)| n.trim().parse::<u64>().ok())
            >= Some(1024)
    };
    guest.wait_for("sync 1024 blocks", progress).unwrap_or_else(|e| panic!("{e}"));
    stack.export().signal("KILL");
    stack.export().wait_timeout(START).expect("fallow nbd survived SIGKILL");
    // The guest's next write or flush fails (QEMU's NBD client lost its server); its script
    // ends and the guest powers off.
    let out = guest.finish().unwrap_or_else(|e| panic!("{e}"));
    let durable = synced(&out.console);
    assert!(durable >= 1024, "{}", out.console_text());
    assert!(durable < 8192, "the kill came after the guest was done:\n{}", out.console_text());

    // A new export over the same store, a new guest: every synced block reads back.
    let uri = stack.start_export("back");
    let script = format!("fallow-guest-tool verify /dev/vda 0 {durable} 7\n");
    let out = run_guest(&image, &GuestSpec::new(&script).disk(Disk::nbd(&uri)));
    assert_eq!(out.exit_code, 0, "synced blocks were lost:\n{}", out.console_text());
    verify_on_host(&image, &stack.backing, 0, durable, 7);
}

/// The root file system of the ext4 test: busybox with its applets, the guest tool, and
/// the directories the guest's init mounts on.
fn root_tree(image: &MinimalImage, tree: &Path) {
    for dir in ["bin", "proc", "sys", "dev", "run", "tmp", "work"] {
        std::fs::create_dir_all(tree.join(dir)).unwrap();
    }
    std::fs::copy(image.busybox(), tree.join("bin/busybox")).unwrap();
    let list = Command::new(image.busybox()).arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", tree.join("bin").join(applet)).unwrap();
        }
    }
    std::fs::copy(image.tool(), tree.join("bin/fallow-guest-tool")).unwrap();
}

/// The guest's work on its root file system: directories of files copied, archived,
/// partly deleted and rewritten, checksummed before and after a sync; it reports the
/// archive's checksum so the host can read the same file from the image.
const EXT4_WORKLOAD: &str = r#"
set -e
cd /work
for d in 1 2 3 4 5 6; do
    mkdir -p "tree$d"
    cp -a /bin/busybox "tree$d/busybox"
    for f in 1 2 3 4 5 6 7 8; do
        head -c $((d * 7000 + f * 1300)) /dev/urandom > "tree$d/file$f"
    done
done
tar cf archive.tar tree1 tree2 tree3 tree4 tree5 tree6
rm -rf tree2 tree4
# The freed blocks become discards (virtio-blk DISCARD, then NBD TRIM).
echo "FALLOW-RESULT fstrim $(fstrim -v /)"
head -c 3000000 /dev/urandom > big
md5sum archive.tar big tree1/* tree3/* > sums
sync
echo 3 > /proc/sys/vm/drop_caches
md5sum -c -s sums
echo "FALLOW-RESULT archive $(md5sum archive.tar | cut -d' ' -f1)"
"#;

#[test]
fn an_ext4_root_a_guest_worked_on_through_fallow_stays_clean() {
    let Some(image) = guest_image(&["nbdkit"]) else { return };
    let mut stack = Stack::new("guest-ext4", |dir| {
        let tree = dir.join("tree");
        root_tree(&image, &tree);
        let img = dir.join("root.ext4");
        ext4_image(&tree, &img, 96 << 20).unwrap();
        img
    });
    let uri = stack.start_export("back");
    let spec = GuestSpec::new(EXT4_WORKLOAD).disk(Disk::nbd(&uri)).root("/dev/vda", true);
    let out = run_guest(&image, &spec);
    assert_eq!(out.exit_code, 0, "{}", out.console_text());
    let archive = out.result("archive").expect("the guest reported no checksum");
    stack.export().signal("TERM");
    assert!(stack.export().wait_timeout(START).is_some(), "fallow nbd did not stop on SIGTERM");

    let fsck = Command::new("e2fsck").arg("-fn").arg(&stack.backing).output().unwrap();
    assert!(
        fsck.status.success(),
        "e2fsck -fn found problems:\n{}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    let cat = Command::new("debugfs")
        .args(["-R", "cat /work/archive.tar"])
        .arg(&stack.backing)
        .stderr(Stdio::null())
        .output()
        .unwrap();
    let digest = Command::new("md5sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut md5| {
            use std::io::Write;
            md5.stdin.take().unwrap().write_all(&cat.stdout)?;
            md5.wait_with_output()
        })
        .unwrap();
    let host_sum = String::from_utf8_lossy(&digest.stdout);
    assert_eq!(host_sum.split_whitespace().next(), Some(archive.as_str()));
}
