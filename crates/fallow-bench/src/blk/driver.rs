//! The virtio-blk driver: guest memory, one or more split queues, and a device behind them
//! (a vhost-user backend, or the in-process null device).
//!
//! Three levels, from the load loop's to a hostile test's:
//!
//! * **Slots** ([`Driver::submit`], [`Driver::kick`], [`Driver::poll_used`],
//!   [`Driver::idle`]): request `slot` of queue `q` is built in that slot's header, data and
//!   status (see [`super::layout`]) and made available; many may be in flight; the caller
//!   matches used elements to slots ([`Layout::slot_of_head`]).
//! * **One request at a time** ([`Driver::read`], [`Driver::write`], [`Driver::flush`],
//!   [`Driver::get_id`], [`Driver::discard`], [`Driver::write_zeroes`]): slot 0 of queue 0,
//!   submitted and waited for.
//! * **Raw chains** ([`Driver::set_descriptor`], [`Driver::place_chain`],
//!   [`Driver::write_table`], [`Driver::publish`], [`Driver::wait_used`]): any descriptors
//!   at any free index (from [`Layout::free_descriptors`]), any buffers (in the scratch
//!   area, [`Layout::scratch`]), then a bounded wait for that head in the used ring and the
//!   used length; the test reads the status byte itself ([`GuestMemory::read_u8`]) and
//!   checks canaries ([`GuestMemory::canary_damage`]).
//!
//! # Waiting
//! [`Wait::Spin`] spins on the used ring: the benchmark measures the device, not the
//! driver's wake-up. [`Wait::Call`] sleeps on the call eventfds. Either way the driver asks
//! for calls as a guest's driver does (`used_event` kept current), so the device does the
//! same work as for a guest, and either way a device that hangs up ends the wait with
//! [`BlkError::Disconnected`], and one that answers nothing within the timeout with
//! [`BlkError::Stalled`].

use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use super::frontend::VhostUserBlk;
use super::layout::Layout;
use super::memory::GuestMemory;
use super::notify::{wait_readable, Event};
use super::null::{DeviceQueue, NullDevice};
use super::request::{
    features, header, segment, BlkConfig, RequestType, Status, HEADER_LEN, ID_LEN, SECTOR,
    SEGMENT_LEN,
};
use super::ring::{Descriptor, DriverRing, Used};
use super::{BlkError, Wait};

/// How a [`Driver`] is built. [`DriverOptions::default`]: one queue of 256 entries, 16
/// slots of 4 KiB, spinning, EVENT_IDX when offered.
#[derive(Debug, Clone)]
pub struct DriverOptions {
    /// Queues to start.
    pub queues: u16,
    /// Entries per queue (a power of two).
    pub queue_size: u16,
    /// Request slots per queue: the most requests in flight on it.
    pub slots: u16,
    /// Bytes of each slot's data buffer: the largest read or write.
    pub slot_bytes: u32,
    /// The least scratch memory for a test's own buffers.
    pub min_scratch: u64,
    /// Spin on the used ring, or sleep on the call eventfd.
    pub wait: Wait,
    /// Accept VIRTIO_RING_F_EVENT_IDX when the device offers it.
    pub event_idx: bool,
    /// How long to keep trying to connect to a vhost-user socket.
    pub connect_timeout: Duration,
}

impl Default for DriverOptions {
    fn default() -> Self {
        DriverOptions {
            queues: 1,
            queue_size: 256,
            slots: 16,
            slot_bytes: 4096,
            min_scratch: 1 << 20,
            wait: Wait::Spin,
            event_idx: true,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// What a request asks the device to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Read `len` bytes at `sector` into the slot's buffer.
    Read,
    /// Write `len` bytes of the slot's buffer at `sector`.
    Write,
    /// Make completed writes durable.
    Flush,
    /// Fetch the device id (20 bytes) into the slot's buffer.
    GetId,
    /// Discard `len` bytes at `sector` (one segment).
    Discard,
    /// Zero `len` bytes at `sector` (one segment), deallocating if `unmap`.
    WriteZeroes {
        /// The segment's UNMAP flag.
        unmap: bool,
    },
}

/// One request for a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// What to do.
    pub op: Op,
    /// Where, in 512-byte sectors.
    pub sector: u64,
    /// How many bytes: the data of a read or write, the range of a discard or zeroing.
    pub len: u32,
}

/// A request's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// The status byte.
    pub status: Status,
    /// The used length the device reported.
    pub used_len: u32,
}

/// Who answers the queues.
enum Peer {
    VhostUser(VhostUserBlk),
    Null(NullDevice),
}

/// One queue: its ring, its eventfds, what arrived while waiting for something else.
struct Queue {
    ring: DriverRing,
    kick: Event,
    call: Event,
    /// Used elements read while [`Driver::wait_used`] looked for another head, oldest
    /// first; [`Driver::poll_used`] and `wait_used` hand them out first.
    stash: Vec<Used>,
    /// Per slot: the (op, len) whose descriptors are in the table, so a request of the
    /// same shape rewrites only its header.
    shapes: Vec<Option<(Op, u32)>>,
}

/// Idle spins between two looks at whether the device is still there.
const SPINS_PER_CHECK: u32 = 1 << 14;

/// The longest a sleeping wait lasts before it looks at the device again.
const MAX_SLEEP: Duration = Duration::from_millis(100);

/// The driver; see the module documentation.
pub struct Driver {
    // Declared first: dropped (its thread stopped, its socket closed) before the memory.
    peer: Peer,
    mem: GuestMemory,
    layout: Layout,
    queues: Vec<Queue>,
    wait: Wait,
    features: u64,
    config: BlkConfig,
    target: String,
    idle_spins: u32,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("target", &self.target)
            .field("features", &format_args!("{:#x}", self.features))
            .field("config", &self.config)
            .field("layout", &self.layout)
            .finish()
    }
}

impl Driver {
    /// Connects to the vhost-user-blk backend at `path`, shares the memory and starts the
    /// queues.
    pub fn vhost_user(path: &Path, opts: &DriverOptions) -> Result<Driver, BlkError> {
        let layout = layout(opts)?;
        let mut dev =
            VhostUserBlk::connect(path, opts.queues, opts.event_idx, opts.connect_timeout)?;
        let mem = GuestMemory::new(layout.memory_size()).map_err(BlkError::Io)?;
        dev.set_mem_table(&mem)?;
        let event_idx = dev.features() & features::EVENT_IDX != 0;
        let mut queues = Vec::new();
        for q in 0..opts.queues {
            let queue = new_queue(&mem, &layout, q, event_idx)?;
            dev.start_queue(q, &mem, queue.ring.addrs(), &queue.kick, &queue.call)?;
            queues.push(queue);
        }
        let (features, config) = (dev.features(), dev.config());
        let target = format!("vhost-user:{}", path.display());
        let peer = Peer::VhostUser(dev);
        let wait = opts.wait;
        Ok(Driver { peer, mem, layout, queues, wait, features, config, target, idle_spins: 0 })
    }

    /// Starts the null device (a thread of this process that completes every request at
    /// once: the driver's floor) as a disk of `capacity` bytes.
    pub fn null(capacity: u64, opts: &DriverOptions) -> Result<Driver, BlkError> {
        let layout = layout(opts)?;
        let mem = GuestMemory::new(layout.memory_size()).map_err(BlkError::Io)?;
        let mut queues = Vec::new();
        let mut device_queues = Vec::new();
        for q in 0..opts.queues {
            let queue = new_queue(&mem, &layout, q, opts.event_idx)?;
            device_queues.push(DeviceQueue {
                addrs: queue.ring.addrs(),
                kick: queue.kick.try_clone().map_err(BlkError::Io)?,
                call: queue.call.try_clone().map_err(BlkError::Io)?,
            });
            queues.push(queue);
        }
        let dev = NullDevice::start(mem.clone(), device_queues, opts.wait, opts.event_idx)
            .map_err(BlkError::Io)?;
        let mut features = features::VERSION_1 | features::FLUSH | features::BLK_SIZE;
        if opts.event_idx {
            features |= features::EVENT_IDX;
        }
        let config = BlkConfig {
            capacity: capacity / SECTOR,
            blk_size: SECTOR as u32,
            num_queues: opts.queues,
            ..BlkConfig::default()
        };
        let peer = Peer::Null(dev);
        let (wait, target) = (opts.wait, "null".to_string());
        Ok(Driver { peer, mem, layout, queues, wait, features, config, target, idle_spins: 0 })
    }

    /// The disk's size in bytes.
    pub fn capacity(&self) -> u64 {
        self.config.capacity_bytes()
    }

    /// The device configuration.
    pub fn config(&self) -> BlkConfig {
        self.config
    }

    /// The virtio features agreed with the device.
    pub fn features(&self) -> u64 {
        self.features
    }

    /// The guest memory.
    pub fn memory(&self) -> &GuestMemory {
        &self.mem
    }

    /// Where everything is in it.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// `vhost-user:PATH` or `null`.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// How the driver waits.
    pub fn wait_mode(&self) -> Wait {
        self.wait
    }

    // ---- raw chains -------------------------------------------------------------------

    /// Writes `desc` as descriptor `index` of queue `q`, as is.
    pub fn set_descriptor(&mut self, q: u16, index: u16, desc: Descriptor) -> Result<(), BlkError> {
        let queue = queue_mut(&mut self.queues, q)?;
        if let Some(shape) = queue.shapes.get_mut(usize::from(index / super::layout::SLOT_DESCS)) {
            // A slot's descriptors overwritten: rewrite them all at its next request.
            *shape = None;
        }
        queue.ring.set_descriptor(&self.mem, index, desc).map_err(BlkError::Memory)
    }

    /// Writes `descs` as descriptors `first`, `first + 1`, … of queue `q`, linked in that
    /// order ([`Descriptor::link`]); returns the head, `first`.
    pub fn place_chain(
        &mut self,
        q: u16,
        first: u16,
        descs: &[Descriptor],
    ) -> Result<u16, BlkError> {
        for (i, d) in Descriptor::link(descs, first).into_iter().enumerate() {
            self.set_descriptor(q, first.wrapping_add(i as u16), d)?;
        }
        Ok(first)
    }

    /// Writes `descs`, as is, as a descriptor table at guest address `addr` (an indirect
    /// table; [`Descriptor::link`] with `first` 0 links one).
    pub fn write_table(&self, addr: u64, descs: &[Descriptor]) -> Result<(), BlkError> {
        let bytes: Vec<u8> = descs.iter().flat_map(|d| d.to_bytes()).collect();
        self.mem.write(addr, &bytes).map_err(BlkError::Memory)
    }

    /// Makes the chain at `head` available on queue `q` and kicks if the device asks.
    pub fn publish(&mut self, q: u16, head: u16) -> Result<(), BlkError> {
        let queue = queue_mut(&mut self.queues, q)?;
        queue.ring.push(&self.mem, head).map_err(BlkError::Memory)?;
        self.kick(q)
    }

    /// Waits up to `timeout` for the device to return the chain at `head` on queue `q`;
    /// other chains returned meanwhile are kept for [`Driver::poll_used`].
    pub fn wait_used(&mut self, q: u16, head: u16, timeout: Duration) -> Result<Used, BlkError> {
        let deadline = Instant::now() + timeout;
        loop {
            let queue = queue_mut(&mut self.queues, q)?;
            if let Some(i) = queue.stash.iter().position(|u| u.id == u32::from(head)) {
                return Ok(queue.stash.remove(i));
            }
            while let Some(used) = queue.ring.next_used(&self.mem).map_err(BlkError::Memory)? {
                if used.id == u32::from(head) {
                    return Ok(used);
                }
                queue.stash.push(used);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(BlkError::Stalled(timeout));
            }
            self.idle(deadline - now)?;
        }
    }

    // ---- slots ------------------------------------------------------------------------

    /// Builds `req` in slot `slot` of queue `q` and pushes it, not yet published: call
    /// [`Driver::kick`] once the batch is in. For a write the data is whatever the slot's
    /// buffer holds ([`Layout::data`]).
    pub fn submit(&mut self, q: u16, slot: u16, req: &Request) -> Result<(), BlkError> {
        let l = &self.layout;
        if slot >= l.slots() {
            return Err(BlkError::Options(format!("slot {slot} of {}", l.slots())));
        }
        let (hdr, data, status) = (l.header(q, slot), l.data(q, slot), l.status(q, slot));
        let slot_bytes = l.slot_bytes();
        let head = Layout::slot_head(slot);
        let type_ = match req.op {
            Op::Read => RequestType::In,
            Op::Write => RequestType::Out,
            Op::Flush => RequestType::Flush,
            Op::GetId => RequestType::GetId,
            Op::Discard => RequestType::Discard,
            Op::WriteZeroes { .. } => RequestType::WriteZeroes,
        };
        let descs: Vec<Descriptor> = match req.op {
            Op::Read | Op::Write if req.len == 0 || req.len > slot_bytes => {
                return Err(BlkError::Options(format!(
                    "a read or write of {} bytes; a slot holds 1 to {slot_bytes}",
                    req.len
                )))
            }
            Op::Read => vec![Descriptor::writable(data, req.len)],
            Op::Write => vec![Descriptor::readable(data, req.len)],
            Op::Flush => vec![],
            Op::GetId => vec![Descriptor::writable(data, ID_LEN)],
            Op::Discard | Op::WriteZeroes { .. } => vec![Descriptor::readable(data, SEGMENT_LEN)],
        };
        let sector = match req.op {
            Op::Read | Op::Write => req.sector,
            _ => 0,
        };
        if let Op::Discard | Op::WriteZeroes { .. } = req.op {
            let unmap = matches!(req.op, Op::WriteZeroes { unmap: true });
            let sectors = u32::try_from(u64::from(req.len) / SECTOR).unwrap_or(u32::MAX);
            self.mem.write(data, &segment(req.sector, sectors, unmap)).map_err(BlkError::Memory)?;
        }
        self.mem.write(hdr, &header(type_.into(), sector)).map_err(BlkError::Memory)?;
        self.mem.write(status, &[Status::UNWRITTEN]).map_err(BlkError::Memory)?;
        let shape = Some((req.op, req.len));
        let queue = queue_mut(&mut self.queues, q)?;
        let known = queue.shapes.get(usize::from(slot)).copied().flatten();
        if known != shape {
            let mut chain = vec![Descriptor::readable(hdr, HEADER_LEN)];
            chain.extend(descs);
            chain.push(Descriptor::writable(status, 1));
            for (i, d) in Descriptor::link(&chain, head).into_iter().enumerate() {
                queue
                    .ring
                    .set_descriptor(&self.mem, head + i as u16, d)
                    .map_err(BlkError::Memory)?;
            }
            if let Some(s) = queue.shapes.get_mut(usize::from(slot)) {
                *s = shape;
            }
        }
        queue.ring.push(&self.mem, head).map_err(BlkError::Memory)
    }

    /// Publishes what was pushed on queue `q` and kicks the device if it asks.
    pub fn kick(&mut self, q: u16) -> Result<(), BlkError> {
        let queue = queue_mut(&mut self.queues, q)?;
        if queue.ring.publish(&self.mem).map_err(BlkError::Memory)? {
            queue.kick.signal().map_err(BlkError::Io)?;
        }
        Ok(())
    }

    /// The next chain queue `q`'s device returned, if any (never waits).
    pub fn poll_used(&mut self, q: u16) -> Result<Option<Used>, BlkError> {
        let queue = queue_mut(&mut self.queues, q)?;
        if !queue.stash.is_empty() {
            return Ok(Some(queue.stash.remove(0)));
        }
        queue.ring.next_used(&self.mem).map_err(BlkError::Memory)
    }

    /// Slot `slot` of queue `q`'s status byte.
    pub fn slot_status(&self, q: u16, slot: u16) -> Result<Status, BlkError> {
        let b = self.mem.read_u8(self.layout.status(q, slot)).map_err(BlkError::Memory)?;
        Ok(Status::from(b))
    }

    /// Called when a look at the used rings found nothing: spins once ([`Wait::Spin`];
    /// every so often it checks that the device is still there) or sleeps until a call, a
    /// hang-up or at most `budget` ([`Wait::Call`]).
    pub fn idle(&mut self, budget: Duration) -> Result<(), BlkError> {
        match self.wait {
            Wait::Spin => {
                std::hint::spin_loop();
                self.idle_spins += 1;
                if self.idle_spins >= SPINS_PER_CHECK {
                    self.idle_spins = 0;
                    self.check_alive()?;
                }
                Ok(())
            }
            Wait::Call => self.sleep(budget.min(MAX_SLEEP)),
        }
    }

    /// `Err(Disconnected)` if the device has gone.
    pub fn check_alive(&self) -> Result<(), BlkError> {
        let gone = match &self.peer {
            Peer::VhostUser(dev) => dev.hung_up().then_some("the backend closed the connection"),
            Peer::Null(dev) => dev.ended().then_some("the null device's thread ended"),
        };
        match gone {
            Some(why) => Err(BlkError::Disconnected(format!("{}: {why}", self.target))),
            None => Ok(()),
        }
    }

    /// Asks for calls, looks once more, then sleeps on the call eventfds and the socket.
    fn sleep(&mut self, timeout: Duration) -> Result<(), BlkError> {
        for queue in &self.queues {
            queue.ring.want_call(&self.mem).map_err(BlkError::Memory)?;
            if !queue.stash.is_empty()
                || queue.ring.has_used(&self.mem).map_err(BlkError::Memory)?
            {
                return Ok(());
            }
        }
        let mut fds: Vec<BorrowedFd<'_>> = self.queues.iter().map(|q| q.call.as_fd()).collect();
        if let Peer::VhostUser(dev) = &self.peer {
            fds.push(dev.watch().as_fd());
        }
        let ready = wait_readable(&fds, timeout).map_err(BlkError::Io)?;
        for queue in &self.queues {
            queue.call.drain();
        }
        if ready.get(self.queues.len()).copied().unwrap_or(false) {
            self.check_alive()?;
        }
        if let Peer::Null(_) = self.peer {
            self.check_alive()?;
        }
        Ok(())
    }

    // ---- one request at a time ----------------------------------------------------------

    /// Runs `req` in slot 0 of queue 0 and waits up to `timeout` for it.
    pub fn execute(&mut self, req: &Request, timeout: Duration) -> Result<Completion, BlkError> {
        self.submit(0, 0, req)?;
        self.kick(0)?;
        let used = self.wait_used(0, Layout::slot_head(0), timeout)?;
        Ok(Completion { status: self.slot_status(0, 0)?, used_len: used.len })
    }

    /// Reads `buf.len()` bytes (whole sectors, at most a slot) at byte `offset`.
    pub fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<Status, BlkError> {
        let req = Request { op: Op::Read, sector: sector_of(offset)?, len: len_of(buf.len())? };
        let done = self.execute(&req, SYNC_TIMEOUT)?;
        self.mem.read(self.layout.data(0, 0), buf).map_err(BlkError::Memory)?;
        Ok(done.status)
    }

    /// Writes `data` (whole sectors, at most a slot) at byte `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Result<Status, BlkError> {
        let req = Request { op: Op::Write, sector: sector_of(offset)?, len: len_of(data.len())? };
        self.mem.write(self.layout.data(0, 0), data).map_err(BlkError::Memory)?;
        Ok(self.execute(&req, SYNC_TIMEOUT)?.status)
    }

    /// FLUSH.
    pub fn flush(&mut self) -> Result<Status, BlkError> {
        let req = Request { op: Op::Flush, sector: 0, len: 0 };
        Ok(self.execute(&req, SYNC_TIMEOUT)?.status)
    }

    /// GET_ID: the status and the 20 id bytes.
    pub fn get_id(&mut self) -> Result<(Status, Vec<u8>), BlkError> {
        let req = Request { op: Op::GetId, sector: 0, len: ID_LEN };
        let status = self.execute(&req, SYNC_TIMEOUT)?.status;
        let id =
            self.mem.read_vec(self.layout.data(0, 0), ID_LEN as usize).map_err(BlkError::Memory)?;
        Ok((status, id))
    }

    /// DISCARD of `len` bytes at `offset` (whole sectors).
    pub fn discard(&mut self, offset: u64, len: u32) -> Result<Status, BlkError> {
        let req = Request { op: Op::Discard, sector: sector_of(offset)?, len };
        Ok(self.execute(&req, SYNC_TIMEOUT)?.status)
    }

    /// WRITE_ZEROES of `len` bytes at `offset` (whole sectors).
    pub fn write_zeroes(&mut self, offset: u64, len: u32, unmap: bool) -> Result<Status, BlkError> {
        let req = Request { op: Op::WriteZeroes { unmap }, sector: sector_of(offset)?, len };
        Ok(self.execute(&req, SYNC_TIMEOUT)?.status)
    }

    /// Stops the queues (vhost-user: GET_VRING_BASE) and closes the connection. Dropping
    /// the driver does the same, ignoring failures.
    pub fn stop(mut self) -> Result<(), BlkError> {
        self.stop_device()
    }

    fn stop_device(&mut self) -> Result<(), BlkError> {
        match &mut self.peer {
            Peer::VhostUser(dev) => dev.stop(),
            Peer::Null(_) => Ok(()),
        }
    }
}

/// Queue `q`, as a function of the queues alone so that the memory stays borrowable.
fn queue_mut(queues: &mut [Queue], q: u16) -> Result<&mut Queue, BlkError> {
    let n = queues.len();
    queues
        .get_mut(usize::from(q))
        .ok_or_else(|| BlkError::Options(format!("queue {q}; the driver has {n}")))
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.stop_device();
    }
}

/// How long a one-at-a-time request may take.
const SYNC_TIMEOUT: Duration = Duration::from_secs(30);

fn layout(opts: &DriverOptions) -> Result<Layout, BlkError> {
    Layout::new(opts.queues, opts.queue_size, opts.slots, opts.slot_bytes, opts.min_scratch)
        .map_err(BlkError::Options)
}

fn new_queue(
    mem: &GuestMemory,
    layout: &Layout,
    q: u16,
    event_idx: bool,
) -> Result<Queue, BlkError> {
    Ok(Queue {
        ring: DriverRing::new(mem, layout.ring(q), event_idx).map_err(BlkError::Memory)?,
        kick: Event::new().map_err(BlkError::Io)?,
        call: Event::new().map_err(BlkError::Io)?,
        stash: Vec::new(),
        shapes: vec![None; usize::from(layout.slots())],
    })
}

fn sector_of(offset: u64) -> Result<u64, BlkError> {
    if !offset.is_multiple_of(SECTOR) {
        return Err(BlkError::Options(format!("offset {offset} is not a multiple of {SECTOR}")));
    }
    Ok(offset / SECTOR)
}

fn len_of(len: usize) -> Result<u32, BlkError> {
    u32::try_from(len)
        .ok()
        .filter(|l| u64::from(*l).is_multiple_of(SECTOR))
        .ok_or_else(|| BlkError::Options(format!("length {len} is not whole sectors")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blk::ring::F_WRITE;

    fn null(wait: Wait) -> Driver {
        let opts = DriverOptions { wait, slots: 4, ..DriverOptions::default() };
        Driver::null(1 << 30, &opts).unwrap()
    }

    #[test]
    fn the_null_device_answers_every_kind_of_request() {
        for wait in [Wait::Spin, Wait::Call] {
            let mut d = null(wait);
            assert_eq!(d.capacity(), 1 << 30);
            let mut buf = vec![0u8; 4096];
            assert_eq!(d.read(8192, &mut buf).unwrap(), Status::Ok);
            assert_eq!(d.write(0, &buf).unwrap(), Status::Ok);
            assert_eq!(d.flush().unwrap(), Status::Ok);
            assert_eq!(d.get_id().unwrap().0, Status::Ok);
            assert_eq!(d.discard(0, 4096).unwrap(), Status::Ok);
            assert_eq!(d.write_zeroes(0, 4096, true).unwrap(), Status::Ok);
            assert!(d.read(1, &mut buf).is_err(), "unaligned offset");
            d.stop().unwrap();
        }
    }

    #[test]
    fn raw_chains_come_back_with_their_used_length() {
        let mut d = null(Wait::Spin);
        let scratch = d.layout().scratch().start;
        let free = d.layout().free_descriptors().start;
        d.memory().fill_canary(scratch, 8192).unwrap();
        let hdr = header(RequestType::In.into(), 0);
        d.memory().write(scratch, &hdr).unwrap();
        let head = d
            .place_chain(
                0,
                free,
                &[
                    Descriptor::readable(scratch, 16),
                    Descriptor::writable(scratch + 512, 512),
                    Descriptor::writable(scratch + 2048, 1),
                ],
            )
            .unwrap();
        d.publish(0, head).unwrap();
        let used = d.wait_used(0, head, Duration::from_secs(5)).unwrap();
        assert_eq!(used, Used { id: u32::from(head), len: 513 });
        assert_eq!(d.memory().read_u8(scratch + 2048).unwrap(), 0);
        let allowed = [scratch..scratch + 16, scratch + 2048..scratch + 2049];
        assert!(d.memory().canary_damage(scratch, 8192, &allowed).unwrap().is_empty());
        // A loop: the null device gives up on it and returns it anyway.
        d.set_descriptor(0, free, Descriptor::readable(scratch, 16).then(free + 1)).unwrap();
        d.set_descriptor(
            0,
            free + 1,
            Descriptor { flags: F_WRITE, ..Descriptor::readable(scratch, 1) }.then(free),
        )
        .unwrap();
        d.publish(0, free).unwrap();
        assert_eq!(d.wait_used(0, free, Duration::from_secs(5)).unwrap().id, u32::from(free));
    }

    #[test]
    fn an_unanswered_chain_times_out() {
        let mut d = null(Wait::Call);
        // Nothing published: nothing comes back.
        let err = d.wait_used(0, 7, Duration::from_millis(50)).unwrap_err();
        assert!(matches!(err, BlkError::Stalled(_)), "{err}");
    }
}
