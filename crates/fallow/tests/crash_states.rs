//! Crash states of `fallow nbd` under a real file system. The export's store is an
//! upstream NBD server run in this process: fallow-nbd's own server over a
//! `RecordingStore` (`fallow_testkit::crash`), which logs every WRITE, WRITE_ZEROES, TRIM,
//! FUA and FLUSH that `fallow nbd` sends it, with the data. The kernel's ext4 writes files
//! through nbdfuse and a loop device; then crash states of the store's log are replayed
//! onto the initial image (32 MiB, made by `mke2fs -d`), and each must pass `e2fsck -fn` once its
//! journal is replayed (`e2fsck -E journal_only`, what a mount does first), and hold every
//! file that an `fsync` or a `sync` before the crash made durable, byte for byte
//! (`debugfs` dumps them).
//!
//! ```text
//!  ext4 ─ loop ─ nbdfuse ─▶ fallow nbd (--write-policy back) ─▶ fallow-nbd server ─▶ RecordingStore ─▶ MemStore
//!                             a child process                    ─────────── this process ───────────
//! ```
//!
//! Needs root, /dev/fuse, a free loop device, nbdfuse, mke2fs, e2fsck and debugfs; skips
//! without them. `FALLOW_CRASH_EXT4_STATES=N` (40 by default) sets how many states are
//! checked per policy, spread over the crash points; `FALLOW_CRASH_EXT4_POLICIES` (`back`
//! by default; `back,through` for both) which write policies run, and
//! `FALLOW_CRASH_EXT4_ROUNDS` (6 by default) how many rounds of files are written.
//! docs/reliability.md, "Crash states"; `scripts/crash-states.sh` runs more.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fallow_backing::{BackingStore, Durability, MemStore};
use fallow_cache::{CacheConfig, CacheLayer};
use fallow_core::ListenAddr;
use fallow_nbd::{Export, NbdServer};
use fallow_testkit::crash::{Choice, Clock, RecordingStore, Replayer, StoreOp, StoreOpKind};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use support::{have, Daemon, KillOnDrop, TempDir};

const IMAGE_SIZE: u64 = 32 << 20;
/// Rounds of the workload, unless `FALLOW_CRASH_EXT4_ROUNDS` says otherwise.
const ROUNDS: usize = 6;
const FILES_PER_ROUND: usize = 10;

/// The files durable from a tick on: each `(path in the file system, content)`.
#[derive(Debug, Clone)]
struct Marker {
    tick: u64,
    what: String,
    files: Vec<(String, Vec<u8>)>,
}

/// Runs `cmd` under `timeout 120`; panics with its output unless it succeeds.
fn run(cmd: &mut Command) -> String {
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{cmd:?} failed ({}):\n{text}", out.status);
    text
}

fn timed(program: &str) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["120", program]);
    cmd
}

/// Bytes unique to `seed`, `len` of them.
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen()).collect()
}

/// The export as a mounted ext4: nbdfuse shows it as a file, a loop device makes that a
/// block device. Dropping it undoes everything, in reverse order, even after a panic.
struct Mounted {
    fuse_dir: PathBuf,
    mount_dir: PathBuf,
    nbdfuse: Option<KillOnDrop>,
    loop_dev: Option<String>,
    mounted: bool,
}

impl Mounted {
    fn new(dir: &Path, uri: &str) -> Mounted {
        let fuse_dir = dir.join("fuse");
        let mount_dir = dir.join("mnt");
        std::fs::create_dir_all(&fuse_dir).unwrap();
        std::fs::create_dir_all(&mount_dir).unwrap();
        let mut m = Mounted { fuse_dir, mount_dir, nbdfuse: None, loop_dev: None, mounted: false };
        let disk = m.fuse_dir.join("disk");
        m.nbdfuse = Some(KillOnDrop::spawn(
            Command::new("nbdfuse").arg(&disk).arg(uri).stdout(Stdio::null()),
        ));
        assert!(support::poll_until(Duration::from_secs(10), || disk.exists()), "nbdfuse");
        let dev = run(timed("losetup").arg("-f").arg("--show").arg(&disk));
        m.loop_dev = Some(dev.trim().to_string());
        run(timed("mount").args(["-t", "ext4"]).arg(dev.trim()).arg(&m.mount_dir));
        m.mounted = true;
        m
    }

    fn path(&self) -> &Path {
        &self.mount_dir
    }

    /// Unmounts and detaches (each step once), then waits for nbdfuse to exit.
    fn teardown(&mut self) {
        if std::mem::take(&mut self.mounted) {
            let ok =
                Command::new("umount").arg(&self.mount_dir).status().is_ok_and(|s| s.success());
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&self.mount_dir).status();
            }
        }
        if let Some(dev) = self.loop_dev.take() {
            let _ = Command::new("losetup").args(["-d", &dev]).status();
        }
        if let Some(mut nbdfuse) = self.nbdfuse.take() {
            let unmount = if have("fusermount3") { "fusermount3" } else { "fusermount" };
            let _ = Command::new(unmount).arg("-u").arg(&self.fuse_dir).status();
            if nbdfuse.wait_timeout(Duration::from_secs(10)).is_none() {
                nbdfuse.kill();
            }
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Writes the files: each round a directory of files (one renamed), a log appended to,
/// a scratch file replaced, blocks of a database file overwritten in place and
/// fdatasynced; one file fsynced (with its directory) half-way through, everything
/// `sync`ed at the end. Returns the markers of what each made durable (the files that
/// are never changed again; the log, the scratch files and the database are not
/// compared).
fn workload(fs: &Path, clock: &Clock, rounds: usize) -> Vec<Marker> {
    use std::os::unix::fs::FileExt;

    let mut markers = Vec::new();
    let mut durable: Vec<(String, Vec<u8>)> = Vec::new();
    let db = std::fs::File::create(fs.join("db")).unwrap();
    db.write_all_at(&content(1000, 1 << 20), 0).unwrap();
    let mut rng = StdRng::seed_from_u64(1001);
    for round in 0..rounds {
        let dir = format!("r{round}");
        std::fs::create_dir(fs.join(&dir)).unwrap();
        let mut written = Vec::new();
        for block in 0..16u64 {
            let at = rng.gen_range(0..256u64) * 4096;
            db.write_all_at(&content(round as u64 * 1000 + block, 4096), at).unwrap();
        }
        db.sync_data().unwrap();
        for k in 0..FILES_PER_ROUND {
            let len = [700, 4096, 5000, 20_000, 65_536, 100_000, 1, 150_000, 12_345, 8192][k];
            let data = content((round * 100 + k) as u64, len);
            let name = format!("{dir}/f{k}");
            std::fs::write(fs.join(&name), &data).unwrap();
            if k == FILES_PER_ROUND / 2 {
                // fsync the file and its directory: durable on their own, before `sync`.
                let fsynced = format!("{dir}/fsynced");
                let data = content((round * 100 + 99) as u64, 30_000);
                let file = std::fs::File::create(fs.join(&fsynced)).unwrap();
                std::io::Write::write_all(&mut &file, &data).unwrap();
                file.sync_all().unwrap();
                std::fs::File::open(fs.join(&dir)).unwrap().sync_all().unwrap();
                durable.push((fsynced.clone(), data));
                markers.push(Marker {
                    tick: clock.tick(),
                    what: format!("fsync of {fsynced}"),
                    files: durable.clone(),
                });
            }
            written.push((name, data));
        }
        let (from, to) = (format!("{dir}/f3"), format!("{dir}/f3.renamed"));
        std::fs::rename(fs.join(&from), fs.join(&to)).unwrap();
        written[3].0 = to;
        let mut log =
            std::fs::OpenOptions::new().create(true).append(true).open(fs.join("log")).unwrap();
        std::io::Write::write_all(&mut log, format!("round {round}\n").as_bytes()).unwrap();
        if round > 0 {
            std::fs::remove_file(fs.join(format!("scratch-{}", round - 1))).unwrap();
        }
        std::fs::write(fs.join(format!("scratch-{round}")), content(round as u64, 200_000))
            .unwrap();
        run(&mut timed("sync"));
        durable.extend(written);
        markers.push(Marker {
            tick: clock.tick(),
            what: format!("sync of round {round}"),
            files: durable.clone(),
        });
        // Long enough for `fallow nbd`'s flusher to write back between rounds.
        std::thread::sleep(Duration::from_millis(120));
    }
    markers
}

/// What the checks of one policy's states found.
#[derive(Debug, Default)]
struct Tally {
    store_ops: usize,
    flushes: usize,
    points: usize,
    states: usize,
    recovered: usize,
    files_checked: usize,
    failed: Vec<String>,
}

/// Checks one crash state's image: journal replay, `e2fsck -fn`, then the files durable
/// at `t`. Returns what failed, if anything.
fn check_state(
    dir: &Path,
    image: &[u8],
    markers: &[Marker],
    t: u64,
    tally: &mut Tally,
) -> Option<String> {
    let path = dir.join("state.img");
    // Rewritten in place, not truncated: cheaper on tmpfs, where a truncation frees every
    // page and the write allocates them again.
    let mut file =
        std::fs::OpenOptions::new().create(true).write(true).truncate(false).open(&path).unwrap();
    std::io::Write::write_all(&mut file, image).unwrap();
    drop(file);
    let replay = timed("e2fsck").args(["-y", "-E", "journal_only"]).arg(&path).output().unwrap();
    let replay_text = String::from_utf8_lossy(&replay.stdout).to_string();
    if replay_text.contains("recovering journal") {
        tally.recovered += 1;
    }
    if !replay.status.success() {
        return Some(format!("journal replay failed ({}): {replay_text}", replay.status));
    }
    let check = timed("e2fsck").arg("-fn").arg(&path).output().unwrap();
    if !check.status.success() {
        return Some(format!(
            "e2fsck -fn: {}\n{}{}",
            check.status,
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        ));
    }
    let marker = markers.iter().rev().find(|m| m.tick < t)?;
    let out = dir.join("dump");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let commands: String = marker
        .files
        .iter()
        .enumerate()
        .map(|(i, (name, _))| format!("dump /{name} {}\n", out.join(i.to_string()).display()))
        .collect();
    std::fs::write(dir.join("dump.cmds"), commands).unwrap();
    run(timed("debugfs").arg("-f").arg(dir.join("dump.cmds")).arg(&path));
    for (i, (name, data)) in marker.files.iter().enumerate() {
        tally.files_checked += 1;
        match std::fs::read(out.join(i.to_string())) {
            Ok(got) if got == *data => {}
            Ok(got) => {
                let first = got.iter().zip(data).position(|(a, b)| a != b);
                return Some(format!(
                    "{name} after {}: {} bytes, {} expected, first difference at byte {}",
                    marker.what,
                    got.len(),
                    data.len(),
                    first.unwrap_or(got.len().min(data.len()))
                ));
            }
            Err(_) => return Some(format!("{name} is missing after {}", marker.what)),
        }
    }
    None
}

/// The states to check: `target` of them, over evenly spaced crash points, each point
/// first with its durable prefix, then everything completed, then random subsets.
fn plan(points: &[u64], target: usize) -> Vec<(u64, Vec<Choice>)> {
    let per_point = target.div_ceil(points.len()).max(2);
    let chosen = target.div_ceil(per_point).min(points.len());
    (0..chosen)
        .map(|i| {
            // Evenly spaced, the last point (after everything) always among them.
            let at = points[points.len() - 1 - i * (points.len() - 1) / chosen.max(1)];
            let choices = (0..per_point)
                .map(|j| match j {
                    0 => Choice::DurableOnly,
                    1 => Choice::AllCompleted,
                    _ => Choice::Random,
                })
                .collect();
            (at, choices)
        })
        .rev()
        .collect()
}

fn ext4_states(policy: &str, target: usize, rounds: usize) -> Tally {
    let dir = TempDir::new(&format!("crash-ext4-{policy}"));
    let seed = dir.path().join("seed");
    std::fs::create_dir_all(seed.join("etc")).unwrap();
    std::fs::write(seed.join("etc/hello"), b"made by mke2fs -d\n").unwrap();
    std::fs::write(seed.join("big"), content(7, 1 << 20)).unwrap();
    let image_file = dir.path().join("initial.img");
    run(timed("mke2fs")
        .args(["-t", "ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", "-d"])
        .arg(&seed)
        .arg(&image_file)
        .arg("32M"));
    let initial = std::fs::read(&image_file).unwrap();
    assert_eq!(initial.len() as u64, IMAGE_SIZE);

    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let clock = Clock::new();
    let socket = dir.path().join("recorder.sock");
    let (recorder, server) = rt.block_on(async {
        let mem = MemStore::new(IMAGE_SIZE);
        mem.write(0, Bytes::from(initial.clone()), Durability::AtFlush).await.unwrap();
        let recorder = Arc::new(RecordingStore::new(Arc::new(mem), clock.clone()));
        // No tiers, write-through: every request goes straight to the recorder.
        let cache = CacheLayer::new(recorder.clone(), None, CacheConfig::default());
        let export = Export {
            name: "rec".into(),
            description: "the recording store".into(),
            cache,
            read_only: false,
        };
        let listen = [ListenAddr::Unix(socket.clone())];
        let server = NbdServer::start(&listen, vec![Arc::new(export)], None).await.unwrap();
        (recorder, server)
    });

    let upstream = format!("disk=nbd+unix:///rec?socket={}", socket.display());
    let listen = format!("unix:{}", dir.path().join("fallow.sock").display());
    let (mut fallow, uri) = Daemon::start(
        "fallow nbd",
        support::fallow().args([
            "nbd",
            "--export",
            &upstream,
            "--listen",
            &listen,
            "--write-policy",
            policy,
            "--max-dirty",
            "4M",
            "--max-dirty-age",
            "50",
            "--pool",
            "local:32M",
            "--local-tier",
            "2M",
        ]),
        "URI",
        Duration::from_secs(20),
        |line| line.strip_prefix("fallow nbd: serving ").map(str::to_string),
    );
    let mut mounted = Mounted::new(dir.path(), &uri);
    let mut markers = workload(mounted.path(), &clock, rounds);
    mounted.teardown();
    markers.push(Marker {
        tick: clock.tick(),
        what: "unmount".into(),
        files: markers.last().unwrap().files.clone(),
    });
    fallow.signal("TERM");
    assert!(
        fallow.wait_timeout(Duration::from_secs(30)).is_some_and(|s| s.success()),
        "fallow nbd did not stop cleanly"
    );
    let log: Vec<StoreOp> = recorder.log();
    rt.block_on(server.shutdown());
    drop(rt);

    let mut tally = Tally {
        store_ops: log.len(),
        flushes: log.iter().filter(|op| op.kind == StoreOpKind::Flush).count(),
        ..Tally::default()
    };
    let mut replayer = Replayer::new(log, initial);
    tally.points = replayer.points().len();
    let mut rng = StdRng::seed_from_u64(std::process::id() as u64);
    let mut image = Vec::new();
    for (t, choices) in plan(replayer.points(), target) {
        replayer.advance(t);
        for choice in choices {
            let applied = replayer.state(choice, &mut rng, &mut image);
            tally.states += 1;
            if let Some(why) = check_state(dir.path(), &image, &markers, t, &mut tally) {
                tally.failed.push(format!("{policy}: crash at tick {t}, {choice:?} ({applied} ops on top of the durable part): {why}"));
            }
        }
    }
    tally
}

#[test]
fn ext4_through_fallow_nbd_survives_every_checked_crash_state() {
    let missing: Vec<&str> = ["nbdfuse", "losetup", "mke2fs", "e2fsck", "debugfs", "mount"]
        .into_iter()
        .filter(|tool| !have(tool))
        .collect();
    if !missing.is_empty() {
        eprintln!(
            "skipped: {} not installed (Debian packages libnbd-bin, e2fsprogs, mount)",
            missing.join(", ")
        );
        return;
    }
    let uid = Command::new("id").arg("-u").output().unwrap();
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" || !Path::new("/dev/fuse").exists() {
        eprintln!("skipped: needs root (loop devices, mount) and /dev/fuse");
        return;
    }
    let target: usize = std::env::var("FALLOW_CRASH_EXT4_STATES")
        .ok()
        .map(|v| v.parse().expect("FALLOW_CRASH_EXT4_STATES is a number"))
        .unwrap_or(40);
    let rounds: usize = std::env::var("FALLOW_CRASH_EXT4_ROUNDS")
        .ok()
        .map(|v| v.parse().expect("FALLOW_CRASH_EXT4_ROUNDS is a number"))
        .unwrap_or(ROUNDS);
    let policies = std::env::var("FALLOW_CRASH_EXT4_POLICIES").unwrap_or_else(|_| "back".into());
    let mut failures = Vec::new();
    for policy in policies.split(',') {
        let started = Instant::now();
        let tally = ext4_states(policy, target, rounds);
        println!(
            "ext4, --write-policy {policy}, {rounds} rounds: {} store operations ({} flushes), {} crash points; \
             {} states checked ({} needed journal recovery, {} durable files compared), \
             {} failed, {:.1} s",
            tally.store_ops,
            tally.flushes,
            tally.points,
            tally.states,
            tally.recovered,
            tally.files_checked,
            tally.failed.len(),
            started.elapsed().as_secs_f64()
        );
        failures.extend(tally.failed);
    }
    assert!(
        failures.is_empty(),
        "{} crash states failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
