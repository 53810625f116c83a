//! The virtio-blk driver of `fallow bench blk` against the reference vhost-user-blk backend,
//! qemu-storage-daemon's export of a raw image: the handshake, a pattern written and read
//! back byte for byte (and found in the image after a FLUSH), zeroing, the statuses of a
//! request past the end and of an unknown request type, short loads in both wait modes,
//! and a backend killed in the middle of a run.
//!
//! qemu-storage-daemon comes with qemu-utils. Without it the tests skip with a message,
//! unless `FALLOW_REQUIRE_GUESTS=1` (the test command sets it). Each test starts its own
//! daemon (`fallow_testkit::qsd`) in a scratch directory and stops it by PID.

use std::path::PathBuf;
use std::time::Duration;

use fallow_bench::blk::request::{header, Status};
use fallow_bench::blk::ring::Descriptor;
use fallow_bench::blk::{self, BlkError, BlkOptions, BlkTarget, Driver, DriverOptions, Rw, Wait};
use fallow_testkit::process::TempDir;
use fallow_testkit::qsd::StorageDaemon;

/// Bytes of the test image.
const DISK_BYTES: u64 = 16 << 20;

/// A running qemu-storage-daemon exporting an image; killed, then its directory removed,
/// when dropped (the fields drop in this order).
struct Qsd {
    daemon: StorageDaemon,
    image: PathBuf,
    socket: PathBuf,
    _dir: TempDir,
}

/// Starts qemu-storage-daemon with a vhost-user-blk export of a fresh image, or returns
/// `None` when it cannot run here (see `StorageDaemon::installed`).
fn qsd(name: &str) -> Option<Qsd> {
    if !StorageDaemon::installed() {
        return None;
    }
    let dir = TempDir::new(name);
    let image = dir.path().join("disk.img");
    std::fs::File::create(&image).unwrap().set_len(DISK_BYTES).unwrap();
    let daemon = StorageDaemon::start(&image, false);
    let socket = daemon.vhost_socket.clone();
    Some(Qsd { daemon, image, socket, _dir: dir })
}

/// Bytes that differ from block to block and within each.
fn pattern(offset: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((offset + i) % 253) as u8 ^ (offset >> 12) as u8).collect()
}

#[test]
fn a_pattern_written_through_the_driver_reads_back() {
    let Some(q) = qsd("blk-qsd-pattern") else { return };
    let opts = DriverOptions { slots: 4, slot_bytes: 64 << 10, ..DriverOptions::default() };
    let mut d = Driver::vhost_user(&q.socket, &opts).unwrap();
    assert_eq!(d.capacity(), DISK_BYTES);
    // Every 37th 4 KiB block, a 64 KiB run between two of them, and the last sector.
    let mut writes: Vec<(u64, usize)> =
        (0..DISK_BYTES / 4096).step_by(37).map(|b| (b * 4096, 4096)).collect();
    writes.push((4096, 64 << 10));
    writes.push((DISK_BYTES - 512, 512));
    for &(offset, len) in &writes {
        assert_eq!(
            d.write(offset, &pattern(offset, len)).unwrap(),
            Status::Ok,
            "write at {offset}"
        );
    }
    assert_eq!(d.flush().unwrap(), Status::Ok);
    for &(offset, len) in &writes {
        let mut buf = vec![0u8; len];
        assert_eq!(d.read(offset, &mut buf).unwrap(), Status::Ok, "read at {offset}");
        assert!(buf == pattern(offset, len), "the {len} bytes at {offset} differ");
    }
    // After the FLUSH the image holds the same.
    let image = std::fs::read(&q.image).unwrap();
    for &(offset, len) in &writes {
        let on_disk = &image[offset as usize..offset as usize + len];
        assert!(on_disk == pattern(offset, len), "the image's {len} bytes at {offset} differ");
    }
    // Zeroing, then the zeros read back.
    assert_eq!(d.write_zeroes(8192, 8192, false).unwrap(), Status::Ok);
    let mut buf = vec![0xaa_u8; 8192];
    assert_eq!(d.read(8192, &mut buf).unwrap(), Status::Ok);
    assert!(buf.iter().all(|b| *b == 0), "zeroed range reads non-zero");
    // Past the end: an error status, and the device goes on.
    let mut past = vec![0u8; 4096];
    assert_eq!(d.read(DISK_BYTES - 512, &mut past).unwrap(), Status::IoErr);
    assert_eq!(d.read(0, &mut past).unwrap(), Status::Ok);
    d.stop().unwrap();
}

#[test]
fn an_unknown_request_type_is_unsupported() {
    let Some(q) = qsd("blk-qsd-unsupp") else { return };
    let mut d = Driver::vhost_user(&q.socket, &DriverOptions::default()).unwrap();
    let s = d.layout().scratch().start;
    let first = d.layout().free_descriptors().start;
    d.memory().fill_canary(s, 8192).unwrap();
    d.memory().write(s, &header(99, 0)).unwrap();
    let head = d
        .place_chain(0, first, &[Descriptor::readable(s, 16), Descriptor::writable(s + 4096, 1)])
        .unwrap();
    d.publish(0, head).unwrap();
    let used = d.wait_used(0, head, Duration::from_secs(10)).unwrap();
    assert_eq!(Status::from(d.memory().read_u8(s + 4096).unwrap()), Status::Unsupp);
    assert_eq!(used.len, 1, "only the status byte is written");
    let damage = d.memory().canary_damage(s, 8192, &[s..s + 16, s + 4096..s + 4097]).unwrap();
    assert!(damage.is_empty(), "written outside the status byte: {damage:x?}");
    assert_eq!(d.flush().unwrap(), Status::Ok);
}

#[test]
fn short_loads_complete_without_errors() {
    let Some(q) = qsd("blk-qsd-load") else { return };
    // Each run is a connection of its own: the export takes them one after the other.
    for (rw, wait, qd) in
        [(Rw::RandRead, Wait::Spin, 4), (Rw::RandWrite, Wait::Call, 2), (Rw::Read, Wait::Spin, 1)]
    {
        let mut opts = BlkOptions::new(BlkTarget::VhostUser(q.socket.clone()));
        (opts.rw, opts.wait, opts.qd) = (rw, wait, qd);
        opts.duration = Duration::from_millis(300);
        let r = blk::run(&opts).unwrap();
        assert!(r.ops > 0 && r.errors == 0, "{r}");
        assert_eq!((r.disk_bytes, r.range_bytes, r.qd), (DISK_BYTES, DISK_BYTES, qd));
        assert!(r.latency_us.p50 > 0.0 && r.latency_us.p50 <= r.latency_us.p99, "{r}");
    }
}

#[test]
fn a_backend_that_goes_away_ends_the_run_with_an_error() {
    let Some(mut q) = qsd("blk-qsd-gone") else { return };
    let mut opts = BlkOptions::new(BlkTarget::VhostUser(q.socket.clone()));
    opts.duration = Duration::from_secs(60);
    let run = std::thread::spawn(move || blk::run(&opts));
    std::thread::sleep(Duration::from_secs(1));
    q.daemon.kill();
    let result = run.join().unwrap();
    assert!(matches!(result, Err(BlkError::Disconnected(_))), "{result:?}");
}
