//! `fallow vhost` against hostile descriptor chains, driven by the virtio-blk driver of
//! `fallow bench blk` (`fallow_bench::blk`), which can put any descriptors on a queue.
//!
//! Each case builds its chain in the driver's scratch memory, every byte of which holds a
//! canary first, and checks three things: the answer (IOERR or UNSUPP in the status byte,
//! or, where the chain has no status byte the device could write, the chain returned with a
//! used length of 0 and nothing written); that the device wrote nothing outside the chain's
//! writable buffers (a snapshot of the area, canaries, headers and tables, taken before the
//! chain is published, differs only there); and that the next valid request still works. At the end `fallow vhost` must stop cleanly on SIGTERM, its
//! log free of panics.

mod support;

use std::ops::Range;
use std::process::Stdio;
use std::time::Duration;

use fallow_bench::blk::memory::GUEST_BASE;
use fallow_bench::blk::request::{header, RequestType, Status};
use fallow_bench::blk::ring::{Descriptor, Used, F_WRITE};
use fallow_bench::blk::{Driver, DriverOptions};
use support::{Daemon, TempDir};

const START: Duration = Duration::from_secs(30);

/// Bytes of the test disk.
const DISK_BYTES: u64 = 16 << 20;

/// How long the device may take to return a chain.
const ANSWER: Duration = Duration::from_secs(10);

/// Where a case's buffers go, in the driver's scratch memory.
#[derive(Debug, Clone, Copy)]
struct Area {
    start: u64,
}

impl Area {
    /// Bytes of the area, canaries everywhere but what a case writes into it.
    const LEN: u64 = 64 << 10;

    fn header(self) -> u64 {
        self.start + 512
    }
    fn data(self) -> u64 {
        self.start + 8192
    }
    fn status(self) -> u64 {
        self.start + 16384 + 7 // not aligned: nothing relies on it
    }
    /// The status byte, as the range the device may write.
    fn status_range(self) -> Range<u64> {
        self.status()..self.status() + 1
    }
    fn table(self) -> u64 {
        self.start + 20480
    }
    fn nested(self) -> u64 {
        self.start + 24576
    }
}

/// `fallow vhost` serving a fresh file as export `disk`, and the driver connected to it.
struct Stack {
    vhost: Daemon,
    driver: Driver,
    /// The first descriptor index the driver's own requests leave free.
    first: u16,
    _dir: TempDir,
}

impl Stack {
    fn start() -> Stack {
        let dir = TempDir::new("vhost-hostile");
        let store = dir.path().join("store.img");
        std::fs::File::create(&store).unwrap().set_len(DISK_BYTES).unwrap();
        let (vhost, socket) = Daemon::start(
            "fallow vhost",
            support::fallow()
                .arg("vhost")
                .args(["--export", &format!("disk=file:{}", store.display())])
                .arg("--socket-dir")
                .arg(dir.path().join("sockets"))
                .args(["--pool", "local:16M", "--local-tier", "1M"])
                .env("FALLOW_LOG", "info")
                .stdin(Stdio::null()),
            "socket",
            START,
            support::vhost_socket,
        );
        let driver = Driver::vhost_user(&socket, &DriverOptions::default()).unwrap();
        assert_eq!(driver.capacity(), DISK_BYTES);
        let first = driver.layout().free_descriptors().start;
        Stack { vhost, driver, first, _dir: dir }
    }

    /// A fresh area: canaries everywhere, then a request header of `type_` at `sector` in
    /// its place.
    fn area(&mut self, type_: u32, sector: u64) -> Area {
        let area = Area { start: self.driver.layout().scratch().start };
        let mem = self.driver.memory();
        mem.fill_canary(area.start, Area::LEN).unwrap();
        mem.write(area.header(), &header(type_, sector)).unwrap();
        area
    }

    /// Publishes the chain at `head` and waits for it. Panics if the device changed anything
    /// in the area outside `writable`, or did not return the chain in time. Returns the used
    /// element and the status byte.
    fn answer(&mut self, case: &str, area: Area, head: u16, writable: &[Range<u64>]) -> (Used, u8) {
        let before = self.driver.memory().snapshot(area.start, Area::LEN).unwrap();
        self.driver.publish(0, head).unwrap();
        let used = self
            .driver
            .wait_used(0, head, ANSWER)
            .unwrap_or_else(|e| panic!("{case}: the chain did not come back: {e}"));
        let mem = self.driver.memory();
        let changed = before.changes(mem, writable).unwrap();
        assert!(changed.is_empty(), "{case}: written outside its writable buffers: {changed:x?}");
        (used, mem.read_u8(area.status()).unwrap())
    }

    /// Places `chain` at the first free descriptor and [`Stack::answer`]s it.
    fn send(
        &mut self,
        case: &str,
        area: Area,
        chain: &[Descriptor],
        writable: &[Range<u64>],
    ) -> (Used, u8) {
        let head = self.driver.place_chain(0, self.first, chain).unwrap();
        self.answer(case, area, head, writable)
    }

    /// Sends `chain`, which the device must answer with `want`, writing nothing outside
    /// `writable`; then the next valid request must work.
    fn refused(
        &mut self,
        case: &str,
        area: Area,
        chain: &[Descriptor],
        writable: &[Range<u64>],
        want: Status,
    ) {
        let got = self.send(case, area, chain, writable);
        answered(case, got, want);
        self.still_works(case);
    }

    /// The next valid request works: a block written and read back.
    fn still_works(&mut self, case: &str) {
        let block: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(self.driver.write(4096, &block).unwrap(), Status::Ok, "after {case}");
        let mut back = vec![0u8; 4096];
        assert_eq!(self.driver.read(4096, &mut back).unwrap(), Status::Ok, "after {case}");
        assert!(back == block, "after {case}: the block read back differs");
    }
}

/// Asserts the device answered `want` with the status byte, writing nothing else.
fn answered(case: &str, (used, status): (Used, u8), want: Status) {
    assert_eq!(Status::from(status), want, "{case}");
    assert!(used.len <= 1, "{case}: used length {} for a refused request", used.len);
}

/// Asserts the chain came back with nothing written: no status byte could be.
fn returned_unanswered(case: &str, (used, status): (Used, u8), canary: u8) {
    assert_eq!(used.len, 0, "{case}: used length");
    assert_eq!(status, canary, "{case}: something was written at the status address");
}

#[test]
fn hostile_chains_are_refused_and_the_device_goes_on() {
    let mut s = Stack::start();
    let first = s.first;
    let read = u32::from(RequestType::In);
    let write = u32::from(RequestType::Out);
    s.still_works("the start");

    // Each case: a name, then the chain, the expected answer.
    let case = "a header shorter than 16 bytes";
    let a = s.area(read, 0);
    let chain = [
        Descriptor::readable(a.header(), 8),
        Descriptor::writable(a.data(), 4096),
        Descriptor::writable(a.status(), 1),
    ];
    s.refused(case, a, &chain, &[a.status_range()], Status::IoErr);

    let case = "a header the device may write";
    let a = s.area(read, 0);
    let chain = [
        Descriptor::writable(a.header(), 16),
        Descriptor::writable(a.data(), 4096),
        Descriptor::writable(a.status(), 1),
    ];
    s.refused(case, a, &chain, &[a.status_range()], Status::IoErr);

    let case = "a read-only status descriptor";
    let a = s.area(read, 0);
    let canary = s.driver.memory().read_u8(a.status()).unwrap();
    let chain = [
        Descriptor::readable(a.header(), 16),
        Descriptor::writable(a.data(), 4096),
        Descriptor::readable(a.status(), 1),
    ];
    let got = s.send(case, a, &chain, &[]);
    returned_unanswered(case, got, canary);
    s.still_works(case);

    let case = "no status descriptor";
    let a = s.area(write, 0);
    let canary = s.driver.memory().read_u8(a.status()).unwrap();
    let chain = [Descriptor::readable(a.header(), 16), Descriptor::readable(a.data(), 4096)];
    let got = s.send(case, a, &chain, &[]);
    returned_unanswered(case, got, canary);
    s.still_works(case);

    for (case, type_, data) in [
        ("a read into a buffer the device may only read", read, Descriptor::readable(0, 4096)),
        ("a write from a buffer the device may only write", write, Descriptor::writable(0, 4096)),
    ] {
        let a = s.area(type_, 0);
        let chain = [
            Descriptor::readable(a.header(), 16),
            Descriptor { addr: a.data(), ..data },
            Descriptor::writable(a.status(), 1),
        ];
        s.refused(case, a, &chain, &[a.status_range()], Status::IoErr);
    }

    for (case, sector, len) in [
        ("a read past the end", DISK_BYTES / 512 - 4, 4096),
        ("a sector whose byte offset overflows", u64::MAX / 256, 4096),
        ("a length that is not whole sectors", 0, 100),
    ] {
        let a = s.area(read, sector);
        let chain = [
            Descriptor::readable(a.header(), 16),
            Descriptor::writable(a.data(), len),
            Descriptor::writable(a.status(), 1),
        ];
        let data = a.data()..a.data() + u64::from(len);
        s.refused(case, a, &chain, &[data, a.status_range()], Status::IoErr);
    }

    let memory_end = GUEST_BASE + s.driver.memory().size();
    let case = "a header outside the memory table";
    let a = s.area(read, 0);
    let chain = [
        Descriptor::readable(0x1000, 16),
        Descriptor::writable(a.data(), 4096),
        Descriptor::writable(a.status(), 1),
    ];
    s.refused(case, a, &chain, &[a.data()..a.data() + 4096, a.status_range()], Status::IoErr);

    let case = "a data buffer past the end of the memory table";
    let a = s.area(read, 0);
    let chain = [
        Descriptor::readable(a.header(), 16),
        Descriptor::writable(memory_end - 2048, 4096),
        Descriptor::writable(a.status(), 1),
    ];
    s.refused(case, a, &chain, &[a.status_range()], Status::IoErr);

    let case = "a status byte outside the memory table";
    let a = s.area(u32::from(RequestType::Flush), 0);
    let chain = [Descriptor::readable(a.header(), 16), Descriptor::writable(memory_end + 4096, 1)];
    let (used, _) = s.send(case, a, &chain, &[]);
    assert_eq!(used.len, 0, "{case}: used length");
    s.still_works(case);

    let case = "a descriptor loop";
    let a = s.area(read, 0);
    s.driver
        .set_descriptor(0, first, Descriptor::readable(a.header(), 16).then(first + 1))
        .unwrap();
    s.driver.set_descriptor(0, first + 1, Descriptor::writable(a.status(), 1).then(first)).unwrap();
    let (used, status) = s.answer(case, a, first, &[a.status_range()]);
    let status = Status::from(status);
    // The device may refuse the chain with IOERR or give up on it unanswered; never OK.
    assert!(status == Status::IoErr || used.len == 0, "{case}: {status}, used length {}", used.len);
    s.still_works(case);

    let case = "a valid indirect table";
    let a = s.area(read, 8);
    let table = Descriptor::link(
        &[
            Descriptor::readable(a.header(), 16),
            Descriptor::writable(a.data(), 4096),
            Descriptor::writable(a.status(), 1),
        ],
        0,
    );
    s.driver.write_table(a.table(), &table).unwrap();
    s.driver.set_descriptor(0, first, Descriptor::indirect(a.table(), 3)).unwrap();
    let allowed = [a.data()..a.data() + 4096, a.status_range()];
    let (used, status) = s.answer(case, a, first, &allowed);
    assert_eq!((Status::from(status), used.len), (Status::Ok, 4097), "{case}");
    s.still_works(case);

    let case = "an indirect table whose length is not whole descriptors";
    let a = s.area(read, 8);
    s.driver.write_table(a.table(), &table).unwrap();
    let canary = s.driver.memory().read_u8(a.status()).unwrap();
    let bad = Descriptor { len: 40, ..Descriptor::indirect(a.table(), 3) };
    s.driver.set_descriptor(0, first, bad).unwrap();
    let (used, status) = s.answer(case, a, first, &[a.status_range()]);
    assert!(status == canary || Status::from(status) == Status::IoErr, "{case}: status {status}");
    assert!(used.len <= 1, "{case}: used length {}", used.len);
    s.still_works(case);

    let case = "an indirect table inside an indirect table";
    let a = s.area(read, 8);
    let nested = Descriptor::link(
        &[Descriptor::writable(a.data(), 4096), Descriptor::writable(a.status(), 1)],
        0,
    );
    s.driver.write_table(a.nested(), &nested).unwrap();
    let outer = [Descriptor::readable(a.header(), 16).then(1), Descriptor::indirect(a.nested(), 2)];
    s.driver.write_table(a.table(), &outer).unwrap();
    let canary = s.driver.memory().read_u8(a.status()).unwrap();
    s.driver.set_descriptor(0, first, Descriptor::indirect(a.table(), 2)).unwrap();
    let (used, status) = s.answer(case, a, first, &[a.status_range()]);
    assert!(status == canary || Status::from(status) == Status::IoErr, "{case}: status {status}");
    assert!(used.len <= 1, "{case}: used length {}", used.len);
    s.still_works(case);

    let case = "an unknown request type";
    let a = s.area(99, 0);
    let chain = [Descriptor::readable(a.header(), 16), Descriptor::writable(a.status(), 1)];
    s.refused(case, a, &chain, &[a.status_range()], Status::Unsupp);

    for (case, type_, flags) in [("a huge read", read, F_WRITE), ("a huge write", write, 0)] {
        let a = s.area(type_, 0);
        let chain = [
            Descriptor::readable(a.header(), 16),
            Descriptor { addr: a.data(), len: 0xffff_f000, flags, next: 0 },
            Descriptor::writable(a.status(), 1),
        ];
        s.refused(case, a, &chain, &[a.status_range()], Status::IoErr);
    }

    // The device is still whole: it stops cleanly, and nothing in it panicked.
    s.driver.stop().unwrap();
    s.vhost.signal("TERM");
    let status = s.vhost.wait_timeout(START).expect("fallow vhost did not stop on SIGTERM");
    let log = s.vhost.log_so_far();
    assert!(status.success(), "fallow vhost failed: {log}");
    assert!(!log.contains("panicked"), "{log}");
}
