//! The load loop over the driver's rings (vhost-user and null targets): every slot of
//! every queue kept busy until the run's end, one thread for all.
//!
//! ```text
//!  fill: QD requests per queue, one kick per queue
//!  loop: per queue, take every used element → its slot → latency, status
//!          before the end: the slot's next request; one kick for all of them
//!        nothing used anywhere: Driver::idle (a spin, or a sleep on the calls)
//!  after the end: no new requests; the ones in flight are drained, not counted
//! ```
//!
//! A request's latency runs from just before it is built until the loop sees it used.
//! Requests that complete with a status other than OK are counted as errors and the run
//! goes on; a device that hangs up or goes quiet for [`STALL`] ends it with an error.

use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use super::driver::{Driver, DriverOptions, Op, Request};
use super::report::{BlkReport, Stats};
use super::request::SECTOR;
use super::{BlkError, BlkOptions, BlkTarget, NULL_CAPACITY};

/// How long the loop waits without any completion before it gives up.
const STALL: Duration = Duration::from_secs(10);

/// The largest request over NBD (the NBD store splits larger ones anyway).
const MAX_NBD_BS: u32 = 32 << 20;

/// The most requests in flight over NBD.
const MAX_NBD_QD: u16 = 1024;

/// Runs the load `opts` describes and reports it.
pub fn run(opts: &BlkOptions) -> Result<BlkReport, BlkError> {
    validate(opts)?;
    let driver_opts = DriverOptions {
        queues: opts.queues,
        slots: opts.qd,
        slot_bytes: opts.bs,
        wait: opts.wait,
        ..DriverOptions::default()
    };
    match &opts.target {
        BlkTarget::Nbd(uri) => super::nbd::run(uri, opts),
        BlkTarget::VhostUser(path) => {
            let mut driver = Driver::vhost_user(path, &driver_opts)?;
            let report = run_driver(&mut driver, opts)?;
            driver.stop()?;
            Ok(report)
        }
        BlkTarget::Null => {
            let mut driver = Driver::null(NULL_CAPACITY, &driver_opts)?;
            run_driver(&mut driver, opts)
        }
    }
}

fn validate(opts: &BlkOptions) -> Result<(), BlkError> {
    let bad = |what: String| Err(BlkError::Options(what));
    if opts.duration.is_zero() {
        return bad("the duration must be above zero".into());
    }
    if opts.bs == 0 || !u64::from(opts.bs).is_multiple_of(SECTOR) {
        return bad(format!("the block size must be whole sectors of {SECTOR} bytes"));
    }
    if opts.range.is_some_and(|r| r < u64::from(opts.bs)) {
        return bad("the range must hold at least one block".into());
    }
    if let BlkTarget::Nbd(_) = opts.target {
        if opts.queues != 1 {
            return bad("--queues applies to vhost-user and null targets".into());
        }
        if opts.bs > MAX_NBD_BS || opts.qd == 0 || opts.qd > MAX_NBD_QD {
            return bad(format!(
                "over NBD the block size must be at most {MAX_NBD_BS} and the queue depth 1 \
                 to {MAX_NBD_QD}"
            ));
        }
    }
    // The driver's layout checks the rest (queue depth, block size, queues) for the rings.
    Ok(())
}

/// The offsets of a run: random or in order, block-aligned, inside the range.
pub(super) struct Offsets {
    rng: SmallRng,
    random: bool,
    bs: u64,
    blocks: u64,
    next: u64,
}

impl Offsets {
    /// Offsets for `opts` on a disk of `capacity` bytes; the range is the disk or less.
    pub(super) fn new(opts: &BlkOptions, capacity: u64) -> Result<(Offsets, u64), BlkError> {
        let range = opts.range.unwrap_or(capacity).min(capacity);
        let bs = u64::from(opts.bs);
        let blocks = range / bs;
        if blocks == 0 {
            return Err(BlkError::Options(format!(
                "the disk ({capacity} bytes) or range ({range} bytes) holds no block of {bs} bytes"
            )));
        }
        let rng = SmallRng::seed_from_u64(opts.seed);
        Ok((Offsets { rng, random: opts.rw.random(), bs, blocks, next: 0 }, range))
    }

    /// The next offset, in bytes.
    pub(super) fn next_offset(&mut self) -> u64 {
        let block = if self.random {
            self.rng.gen_range(0..self.blocks)
        } else {
            let b = self.next;
            self.next = (self.next + 1) % self.blocks;
            b
        };
        block * self.bs
    }

    /// Random bytes for a write's buffer.
    pub(super) fn fill(&mut self, buf: &mut [u8]) {
        self.rng.fill_bytes(buf);
    }
}

/// Runs the load on `driver` and reports it.
fn run_driver(driver: &mut Driver, opts: &BlkOptions) -> Result<BlkReport, BlkError> {
    let (mut offsets, range) = Offsets::new(opts, driver.capacity())?;
    let layout = driver.layout().clone();
    let op = if opts.rw.writes() { Op::Write } else { Op::Read };
    if opts.rw.writes() {
        // Random contents, once per slot: a write of zeros could be a cheaper write.
        let mut buf = vec![0u8; opts.bs as usize];
        for q in 0..opts.queues {
            for slot in 0..opts.qd {
                offsets.fill(&mut buf);
                driver.memory().write(layout.data(q, slot), &buf)?;
            }
        }
    }
    let mut next_request = || Request { op, sector: offsets.next_offset() / SECTOR, len: opts.bs };
    let mut starts: Vec<Vec<Option<Instant>>> =
        vec![vec![None; usize::from(opts.qd)]; usize::from(opts.queues)];
    let mut stats = Stats::new();
    let start = Instant::now();
    let end = start + opts.duration;
    for (q, slots) in (0..opts.queues).zip(starts.iter_mut()) {
        for (slot, started) in (0..opts.qd).zip(slots.iter_mut()) {
            *started = Some(Instant::now());
            driver.submit(q, slot, &next_request())?;
        }
        driver.kick(q)?;
    }
    let mut last_progress = Instant::now();
    loop {
        let mut progressed = false;
        for (q, slots) in (0..opts.queues).zip(starts.iter_mut()) {
            let mut refilled = false;
            while let Some(used) = driver.poll_used(q)? {
                let now = Instant::now();
                progressed = true;
                let slot = layout.slot_of_head(used.id).ok_or_else(|| unknown_chain(used.id))?;
                let started = slots
                    .get_mut(usize::from(slot))
                    .and_then(Option::take)
                    .ok_or_else(|| unknown_chain(used.id))?;
                if now <= end {
                    let status = driver.slot_status(q, slot)?;
                    if status.is_ok() {
                        stats.ok(now - started);
                    } else {
                        stats.error(|| format!("{} on queue {q}: {status}", opts.rw));
                    }
                }
                if now < end {
                    if let Some(s) = slots.get_mut(usize::from(slot)) {
                        *s = Some(Instant::now());
                    }
                    driver.submit(q, slot, &next_request())?;
                    refilled = true;
                }
            }
            if refilled {
                driver.kick(q)?;
            }
        }
        let now = Instant::now();
        if progressed {
            last_progress = now;
            continue;
        }
        if now >= end && starts.iter().flatten().all(Option::is_none) {
            break;
        }
        if now - last_progress > STALL {
            return Err(BlkError::Stalled(STALL));
        }
        driver.idle(end.saturating_duration_since(now).max(Duration::from_millis(1)))?;
    }
    Ok(report(opts, driver.target().to_string(), &stats, opts.duration, driver.capacity(), range))
}

fn unknown_chain(id: u32) -> BlkError {
    BlkError::Device(format!("the device returned chain {id}, which was not in flight"))
}

/// The report of a run that measured `stats` over `elapsed`.
pub(super) fn report(
    opts: &BlkOptions,
    target: String,
    stats: &Stats,
    elapsed: Duration,
    disk_bytes: u64,
    range_bytes: u64,
) -> BlkReport {
    let seconds = elapsed.as_secs_f64();
    let ops = stats.ops();
    let per_s = |n: f64| if seconds > 0.0 { n / seconds } else { 0.0 };
    let rings = !matches!(opts.target, BlkTarget::Nbd(_));
    BlkReport {
        target,
        rw: opts.rw.name(),
        bs: opts.bs,
        qd: opts.qd,
        queues: opts.queues,
        wait: rings.then(|| opts.wait.name()),
        ops,
        seconds,
        iops: per_s(ops as f64),
        mib_per_s: per_s(ops as f64 * f64::from(opts.bs) / f64::from(1 << 20)),
        latency_us: stats.latency(),
        errors: stats.errors,
        first_error: stats.first_error.clone(),
        disk_bytes,
        range_bytes,
        host_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blk::{Rw, Wait};

    #[test]
    fn offsets_stay_in_the_range_and_on_blocks() {
        let mut opts = BlkOptions::new(BlkTarget::Null);
        opts.range = Some(10 * 4096 + 100);
        let (mut random, range) = Offsets::new(&opts, 1 << 30).unwrap();
        assert_eq!(range, 10 * 4096 + 100);
        for _ in 0..1000 {
            let o = random.next_offset();
            assert!(o.is_multiple_of(4096) && o < 10 * 4096);
        }
        opts.rw = Rw::Read;
        let (mut seq, _) = Offsets::new(&opts, 8 * 4096).unwrap();
        let got: Vec<u64> = (0..10).map(|_| seq.next_offset() / 4096).collect();
        assert_eq!(got, [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]);
        assert!(Offsets::new(&opts, 4095).is_err());
    }

    #[test]
    fn options_are_checked() {
        let ok = BlkOptions::new(BlkTarget::Null);
        assert!(validate(&ok).is_ok());
        let broken: [fn(&mut BlkOptions); 5] = [
            |o| o.duration = Duration::ZERO,
            |o| o.bs = 1000,
            |o| o.range = Some(512),
            |o| (o.target, o.queues) = (BlkTarget::Nbd("nbd://h/x".into()), 2),
            |o| (o.target, o.qd) = (BlkTarget::Nbd("nbd://h/x".into()), 0),
        ];
        for (i, breaks) in broken.iter().enumerate() {
            let mut o = ok.clone();
            breaks(&mut o);
            assert!(matches!(validate(&o), Err(BlkError::Options(_))), "case {i}");
        }
        // Too deep for a queue of 256 entries: the driver's layout refuses it.
        let mut deep = ok.clone();
        deep.qd = 86;
        assert!(matches!(run(&deep), Err(BlkError::Options(_))));
    }

    #[test]
    fn a_null_run_counts_completions() {
        for (wait, rw, qd) in [(Wait::Spin, Rw::RandRead, 1), (Wait::Call, Rw::Write, 8)] {
            let mut opts = BlkOptions::new(BlkTarget::Null);
            (opts.wait, opts.rw, opts.qd, opts.queues) = (wait, rw, qd, 2);
            opts.duration = Duration::from_millis(200);
            let r = run(&opts).unwrap();
            assert!(r.ops > 100, "{r}");
            assert_eq!((r.errors, r.queues, r.wait), (0, 2, Some(wait.name())), "{r}");
            assert!(r.latency_us.p50 > 0.0 && r.latency_us.p50 <= r.latency_us.p99, "{r}");
            assert_eq!(r.disk_bytes, NULL_CAPACITY);
        }
    }
}
