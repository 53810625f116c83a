//! `fallow vhost` as a user runs it, driven by the vhost-user frontend of `fallow bench blk`
//! (`fallow_bench::blk::Driver`) instead of a guest: its flags and their errors, the two
//! front ends (vhost-user and `--nbd`) over one cache per export, a read-only export, a
//! second frontend after the first hangs up, and the dirty data of a write-back export on
//! the disk once SIGTERM has stopped it.

mod support;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use fallow_bench::blk::request::Status;
use fallow_bench::blk::{Driver, DriverOptions};
use support::{Daemon, TempDir};

const START: Duration = Duration::from_secs(30);

/// The address in a `fallow vhost: also serving NBD at ADDR` line.
fn nbd_addr(line: &str) -> Option<String> {
    line.strip_prefix("fallow vhost: also serving NBD at ").map(|a| a.trim().to_string())
}

/// Starts `fallow vhost ARGS --socket-dir DIR/sockets`; returns it and its first socket.
fn start(dir: &Path, args: &[&str]) -> (Daemon, PathBuf) {
    Daemon::start(
        "fallow vhost",
        support::fallow()
            .arg("vhost")
            .args(args)
            .arg("--socket-dir")
            .arg(dir.join("sockets"))
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
        "socket",
        START,
        support::vhost_socket,
    )
}

fn connect(socket: &Path) -> Driver {
    Driver::vhost_user(socket, &DriverOptions::default()).unwrap()
}

fn stop(vhost: &mut Daemon) {
    vhost.signal("TERM");
    let status = vhost.wait_timeout(START).expect("fallow vhost did not stop on SIGTERM");
    assert!(status.success(), "fallow vhost failed: {}", vhost.log_so_far());
    assert!(!vhost.log_so_far().contains("panicked"), "{}", vhost.log_so_far());
}

#[test]
fn bad_flags_are_refused_with_a_reason() {
    let dir = TempDir::new("vhost-cli-flags");
    let sockets = dir.path().join("s");
    for (args, reason) in [
        (vec!["--queues", "0"], "--queues"),
        (vec!["--queues", "65"], "--queues"),
        (vec!["--cpus", "3-1"], "backwards"),
        (vec!["--cpus", "x"], "not a number"),
        (vec!["--poll-us", "-1"], "-1"),
        (vec!["--poll-us", "2000000"], "--poll-us"),
    ] {
        let out = support::fallow()
            .args(["vhost", "--export", "d=mem:1M", "--socket-dir"])
            .arg(&sockets)
            .args(&args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
    }
    // A socket path taken by something that is not a socket.
    std::fs::create_dir_all(&sockets).unwrap();
    std::fs::write(sockets.join("d.sock"), "not a socket").unwrap();
    let out = support::fallow()
        .args(["vhost", "--export", "d=mem:1M", "--socket-dir"])
        .arg(&sockets)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("not a socket"), "{stderr}");
}

#[test]
fn help_explains_the_shared_memory_and_the_polling_cost() {
    let out = support::fallow().args(["vhost", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for needle in ["vhost-user-blk-pci", "share=on", "--poll-us", "core", "--nbd", "reconnect"] {
        assert!(help.contains(needle), "--help does not mention {needle}:\n{help}");
    }
}

#[test]
fn both_front_ends_share_one_cache_and_write_back_reaches_the_disk_on_sigterm() {
    let dir = TempDir::new("vhost-cli-shared");
    let image = dir.path().join("disk.img");
    let export = format!("disk=file:{},size=16M", image.display());
    let (mut vhost, socket) =
        start(dir.path(), &["--export", &export, "--write-policy", "back", "--nbd", "127.0.0.1:0"]);
    let nbd = vhost.wait_for_line("the NBD address", START, nbd_addr);
    let uri = format!("nbd://{nbd}/disk");

    // Written over vhost-user, read over NBD, and the other way round.
    let mut driver = connect(&socket);
    assert_eq!(driver.write(1 << 20, &[0xa5; 4096]).unwrap(), Status::Ok);
    let (ok, text) = support::qemu_io(&uri, &["read -P 0xa5 1M 4k", "write -P 0x3c 2M 4k"]);
    assert!(
        ok && !text.contains("fail") && !text.contains("Pattern verification failed"),
        "{text}"
    );
    let mut page = vec![0u8; 4096];
    assert_eq!(driver.read(2 << 20, &mut page).unwrap(), Status::Ok);
    assert!(page.iter().all(|&b| b == 0x3c), "NBD's write not seen over vhost-user");
    let (status, id) = driver.get_id().unwrap();
    assert_eq!(status, Status::Ok);
    assert_eq!(&id[..4], b"disk");
    assert!(id[4..].iter().all(|&b| b == 0));
    driver.stop().unwrap();

    // Write-back: acknowledged from memory, on the disk once SIGTERM has stopped the server.
    stop(&mut vhost);
    let on_disk = std::fs::read(&image).unwrap();
    assert!(on_disk[1 << 20..(1 << 20) + 4096].iter().all(|&b| b == 0xa5));
    assert!(on_disk[2 << 20..(2 << 20) + 4096].iter().all(|&b| b == 0x3c));
}

#[test]
fn a_read_only_export_refuses_writes_and_serves_reads_to_the_next_frontend() {
    let dir = TempDir::new("vhost-cli-ro");
    let image = dir.path().join("disk.img");
    std::fs::write(&image, vec![0x77u8; 4 << 20]).unwrap();
    let export = format!("disk=file:{}", image.display());
    let (mut vhost, socket) = start(dir.path(), &["--export", &export, "--read-only"]);
    let mut driver = connect(&socket);
    assert_ne!(driver.features() & (1 << virtio_blk_f_ro()), 0, "VIRTIO_BLK_F_RO not offered");
    assert_eq!(driver.write(0, &[1; 4096]).unwrap(), Status::IoErr);
    assert_eq!(driver.discard(0, 4096).unwrap(), Status::IoErr);
    driver.stop().unwrap();

    // The next frontend on the same socket: the disk as it was.
    let mut driver = connect(&socket);
    let mut page = vec![0u8; 4096];
    assert_eq!(driver.read(0, &mut page).unwrap(), Status::Ok);
    assert!(page.iter().all(|&b| b == 0x77));
    assert_eq!(driver.flush().unwrap(), Status::Ok, "a flush of a read-only disk is allowed");
    driver.stop().unwrap();
    stop(&mut vhost);
    assert!(std::fs::read(&image).unwrap().iter().all(|&b| b == 0x77));
}

/// VIRTIO_BLK_F_RO's bit number (VIRTIO 1.2, 5.2.3).
fn virtio_blk_f_ro() -> u32 {
    5
}

/// A pool export offered to a guest: 4 KiB logical blocks, so that the guest never writes
/// less than the whole pages the store takes; pages never written read as zeros, a write
/// less than a page fails alone, discarded pages read as zeros again.
#[test]
fn a_pool_export_has_4k_blocks_and_reads_zeros_until_written() {
    let dir = TempDir::new("vhost-cli-pool");
    let (mut vhost, socket) = start(dir.path(), &["--export", "d=pool:16M", "--pool", "local:32M"]);
    let mut driver = connect(&socket);
    assert_eq!(driver.config().blk_size, 4096);
    assert_eq!(driver.capacity(), 16 << 20);
    let mut page = vec![1u8; 4096];
    assert_eq!(driver.read(8192, &mut page).unwrap(), Status::Ok);
    assert!(page.iter().all(|&b| b == 0), "never written");
    for offset in [8192, 12288] {
        assert_eq!(driver.write(offset, &[0x3c; 4096]).unwrap(), Status::Ok);
    }
    assert_eq!(driver.write(512, &[9; 512]).unwrap(), Status::IoErr, "less than a page");
    assert_eq!(driver.read(8192, &mut page).unwrap(), Status::Ok);
    assert!(page.iter().all(|&b| b == 0x3c));
    assert_eq!(driver.read(0, &mut page).unwrap(), Status::Ok);
    assert!(page.iter().all(|&b| b == 0), "the refused write left nothing");
    assert_eq!(driver.discard(8192, 4096).unwrap(), Status::Ok);
    assert_eq!(driver.read(8192, &mut page).unwrap(), Status::Ok);
    assert!(page.iter().all(|&b| b == 0), "discarded");
    assert_eq!(driver.read(12288, &mut page).unwrap(), Status::Ok);
    assert!(page.iter().all(|&b| b == 0x3c), "its neighbour stays");
    driver.stop().unwrap();
    stop(&mut vhost);
}
