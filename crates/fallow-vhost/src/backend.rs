//! The vhost-user-blk device of one export: the rust-vmm `VhostUserBackend` whose worker
//! threads take requests off the guest's virtqueues and run them against the export's cache
//! layer, reading and writing the guest's buffers in place.
//!
//! ```text
//!  guest kicks queue q ─▶ worker thread q (pinned with --cpus): handle_event
//!                           notifications off; pop every available chain under the ring
//!                           lock, counting each in flight; bad ones answered at once
//!                           (request.rs: IOERR/UNSUPP); good ones run (io.rs):
//!                             polled once right here: a cache hit completes on this thread
//!                             not finished (a miss, a store write): a tokio task finishes it
//!                           with --poll-us: look at the ring again until it has been idle
//!                           that long; then notifications on, and a last look (event index)
//! ```
//!
//! Requests complete out of order, as virtio allows; a request never waits for another.
//! When QEMU stops a queue (GET_VRING_BASE) the device waits for that queue's requests in
//! flight, so that no completion lands in a ring QEMU has taken back.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use fallow_cache::CacheLayer;
use fallow_net::cpus::CpuList;
use vhost::vhost_user::message::VhostUserProtocolFeatures;
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vm_memory::{
    Bytes, GuestAddressSpace, GuestMemoryAtomic, GuestMemoryLoadGuard, GuestMemoryMmap,
};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::config::{Geometry, QUEUE_SIZE};
use crate::io;
use crate::request::{self, Descriptor, Status};

/// The guest's memory as the device sees it.
pub(crate) type Memory = GuestMemoryAtomic<GuestMemoryMmap>;

/// A descriptor chain, holding its view of guest memory.
type Chain = DescriptorChain<GuestMemoryLoadGuard<GuestMemoryMmap>>;

/// How long a stopping queue waits for its requests before it says so in the log (and
/// waits on: a completion after the stop would corrupt the ring QEMU took back).
const STOP_LOG_EVERY: Duration = Duration::from_secs(5);

/// Counters of one export's vhost-user device.
#[derive(Debug, Default)]
pub struct BlkStats {
    /// Requests completed with OK.
    pub ok: AtomicU64,
    /// Requests refused (malformed) or failed (the cache or the store failed).
    pub failed: AtomicU64,
    /// Requests that completed on the queue's own thread, without a task.
    pub inline: AtomicU64,
}

/// How the queue threads run.
#[derive(Debug, Clone, Default)]
pub struct Polling {
    /// How long a queue thread keeps looking at its ring after the last request before it
    /// sleeps on the kick; zero sleeps at once.
    pub poll: Duration,
    /// CPUs the queue threads are pinned to, in turn; empty leaves them to the scheduler.
    pub cpus: CpuList,
}

/// One export's device: what stays the same across QEMU's connections.
pub struct Device {
    /// The export's name: its id string for GET_ID, and logs.
    pub(crate) name: String,
    pub(crate) cache: CacheLayer,
    pub(crate) geometry: Geometry,
    runtime: tokio::runtime::Handle,
    polling: Polling,
    /// Requests in flight, per queue.
    in_flight: Vec<InFlight>,
    pub(crate) stats: BlkStats,
}

/// The requests of one queue that have been popped and not yet handed back.
#[derive(Default)]
struct InFlight {
    count: Mutex<usize>,
    idle: Condvar,
}

impl InFlight {
    fn add(&self, n: usize) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += n;
    }

    fn done(&self) {
        let mut count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        *count = count.saturating_sub(1);
        if *count == 0 {
            self.idle.notify_all();
        }
    }

    /// Waits until nothing is in flight; logs while it waits.
    fn wait_idle(&self, export: &str, queue: usize) {
        let mut count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        while *count > 0 {
            let (guard, timeout) =
                self.idle.wait_timeout(count, STOP_LOG_EVERY).unwrap_or_else(|e| e.into_inner());
            count = guard;
            if timeout.timed_out() && *count > 0 {
                tracing::warn!(
                    export,
                    queue,
                    in_flight = *count,
                    "queue stop waits for requests in flight"
                );
            }
        }
    }
}

impl Device {
    /// The device of an export served from `cache` with `queues` virtqueues; requests that
    /// cannot finish on a queue thread run on `runtime`.
    pub fn new(
        name: &str,
        cache: CacheLayer,
        queues: u16,
        read_only: bool,
        polling: Polling,
        runtime: tokio::runtime::Handle,
    ) -> Arc<Device> {
        let caps = cache.backing().capabilities();
        let geometry = Geometry {
            capacity: cache.size(),
            queues: queues.max(1),
            read_only: read_only || caps.read_only,
            discard: caps.trim,
            block_size: cache.backing().min_block_size().next_power_of_two(),
        };
        Arc::new(Device {
            name: name.to_string(),
            cache,
            geometry,
            runtime,
            polling,
            in_flight: (0..geometry.queues).map(|_| InFlight::default()).collect(),
            stats: BlkStats::default(),
        })
    }

    /// The export's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The counters.
    pub fn stats(&self) -> &BlkStats {
        &self.stats
    }

    /// The export's cache layer.
    pub fn cache(&self) -> &CacheLayer {
        &self.cache
    }

    /// Waits until no request of any queue is in flight.
    pub fn quiesce(&self) {
        for (queue, in_flight) in self.in_flight.iter().enumerate() {
            in_flight.wait_idle(&self.name, queue);
        }
    }
}

/// The backend of one QEMU connection to a device: the device, and what this connection
/// negotiated. Cheap to clone, as `vhost-user-backend` wants.
#[derive(Clone)]
pub struct BlkBackend {
    device: Arc<Device>,
    connection: Arc<Connection>,
}

#[derive(Default)]
struct Connection {
    /// The guest's memory table, once the frontend has sent one.
    memory: Mutex<Option<Memory>>,
    event_idx: AtomicBool,
}

thread_local! {
    /// Whether this queue thread has been pinned already.
    static PINNED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl BlkBackend {
    /// The backend of a new connection to `device`.
    pub fn new(device: Arc<Device>) -> BlkBackend {
        BlkBackend { device, connection: Arc::default() }
    }

    /// Serves queue `queue` until it is idle: see the module's picture.
    fn serve_queue(&self, queue: usize, vring: &VringRwLock) -> std::io::Result<()> {
        let Some(memory) = self.connection.memory.lock().unwrap_or_else(|e| e.into_inner()).clone()
        else {
            return Ok(()); // no memory table yet: nothing can be read
        };
        let poll = self.device.polling.poll;
        let mut last_request = Instant::now();
        // A ring whose notification fields lie outside guest memory is the guest's fault:
        // it is logged and left, and the thread goes on serving.
        let ring_broken = |err: virtio_queue::Error| {
            tracing::warn!(export = %self.device.name, queue, %err, "virtqueue not usable");
        };
        if let Err(err) = vring.disable_notification() {
            ring_broken(err);
            return Ok(());
        }
        loop {
            let Some(chains) = self.take_available(queue, &memory, vring) else {
                return Ok(()); // the queue was stopped
            };
            if !chains.is_empty() {
                for chain in chains {
                    self.start(queue, &memory, vring, chain);
                }
                last_request = Instant::now();
                continue;
            }
            if last_request.elapsed() < poll {
                std::hint::spin_loop();
                continue;
            }
            // Idle: the guest may kick again; a request it added before it saw that is
            // picked up by this last look.
            match vring.enable_notification().and_then(|more| {
                if more {
                    vring.disable_notification()?;
                }
                Ok(more)
            }) {
                Ok(true) => {}
                Ok(false) => return Ok(()),
                Err(err) => {
                    ring_broken(err);
                    return Ok(());
                }
            }
        }
    }

    /// Pops every available chain, under the ring's lock and only while the queue is
    /// running, counting them in flight before the lock is let go: a queue stop either
    /// comes first and finds nothing popped, or waits for these.
    fn take_available(
        &self,
        queue: usize,
        memory: &Memory,
        vring: &VringRwLock,
    ) -> Option<Vec<Chain>> {
        let mut state = vring.get_mut();
        if !state.is_enabled() || !state.get_queue().ready() {
            return None;
        }
        let chains: Vec<Chain> = match state.get_queue_mut().iter(memory.memory()) {
            Ok(iter) => iter.collect(),
            Err(err) => {
                tracing::warn!(export = %self.device.name, queue, %err, "virtqueue not usable");
                return None;
            }
        };
        if let Some(in_flight) = self.device.in_flight.get(queue) {
            in_flight.add(chains.len());
        }
        Some(chains)
    }

    /// Parses one chain; answers a bad one at once, runs a good one.
    fn start(&self, queue: usize, memory: &Memory, vring: &VringRwLock, chain: Chain) {
        let device = &self.device;
        let head = chain.head_index();
        let descriptors: Vec<Descriptor> =
            chain.clone().map(|d| (d.addr(), d.len(), d.is_write_only())).collect();
        let parsed = request::parse(
            chain.memory(),
            &descriptors,
            device.geometry.capacity,
            device.geometry.read_only,
        );
        let request = match parsed {
            Ok(request) => request,
            Err(refusal) => {
                tracing::warn!(export = %device.name, queue, head, %refusal, "virtio-blk request refused");
                device.stats.failed.fetch_add(1, Ordering::Relaxed);
                let written = match refusal.status() {
                    Some((addr, status)) => {
                        u32::from(chain.memory().write_obj(u8::from(status), addr).is_ok())
                    }
                    None => 0,
                };
                complete(device, queue, vring, head, written);
                return;
            }
        };
        let (device, memory, vring) = (device.clone(), memory.clone(), vring.clone());
        let finish = async move {
            let (status, data_written) = io::run(&device, &memory, &request).await;
            let stat = if status == Status::Ok { &device.stats.ok } else { &device.stats.failed };
            stat.fetch_add(1, Ordering::Relaxed);
            let wrote_status = memory.memory().write_obj(u8::from(status), request.status).is_ok();
            complete(&device, queue, &vring, head, data_written + u32::from(wrote_status));
        };
        if let Some(pending) = run_here(&self.device.runtime, finish) {
            self.device.runtime.spawn(pending);
        } else {
            self.device.stats.inline.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Pins the calling queue thread, once, to its CPU of `--cpus`.
    fn pin(&self, thread: usize) {
        if PINNED.with(|p| p.replace(true)) {
            return;
        }
        if let Some(cpu) = self.device.polling.cpus.for_thread(thread) {
            match CpuList::pin_current_thread(cpu) {
                Ok(()) => {
                    tracing::info!(export = %self.device.name, thread, cpu, "queue thread pinned")
                }
                Err(err) => {
                    tracing::warn!(export = %self.device.name, thread, cpu, %err, "could not pin the queue thread")
                }
            }
        }
    }
}

/// Polls `future` once on this thread, inside `runtime`'s context; returns it if it has
/// not finished, for a task to finish. A read served from memory finishes here, with no
/// wake-up of another thread; one that waits for a store is finished by the task, whose
/// first poll registers the waker that counts.
fn run_here<F>(runtime: &tokio::runtime::Handle, future: F) -> Option<std::pin::Pin<Box<F>>>
where
    F: Future<Output = ()> + Send + 'static,
{
    let _context = runtime.enter();
    let mut future = Box::pin(future);
    match future.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(()) => None,
        Poll::Pending => Some(future),
    }
}

/// Hands a chain back to the guest with the bytes the device wrote into it, calls the guest
/// if it asked to be, and counts the request out of flight.
fn complete(device: &Device, queue: usize, vring: &VringRwLock, head: u16, written: u32) {
    {
        let mut state = vring.get_mut();
        match state.add_used(head, written) {
            Ok(()) => {
                if state.needs_notification().unwrap_or(true) {
                    if let Err(err) = state.signal_used_queue() {
                        tracing::debug!(export = %device.name, queue, %err, "could not signal the guest");
                    }
                }
            }
            Err(err) => {
                tracing::warn!(export = %device.name, queue, head, %err, "could not return a descriptor chain")
            }
        }
    }
    if let Some(in_flight) = device.in_flight.get(queue) {
        in_flight.done();
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        usize::from(self.device.geometry.queues)
    }

    fn max_queue_size(&self) -> usize {
        usize::from(QUEUE_SIZE)
    }

    fn features(&self) -> u64 {
        self.device.geometry.features()
    }

    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG
            | VhostUserProtocolFeatures::MQ
            | VhostUserProtocolFeatures::REPLY_ACK
    }

    fn set_event_idx(&self, enabled: bool) {
        self.connection.event_idx.store(enabled, Ordering::Relaxed);
    }

    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        self.device.geometry.config(offset, size)
    }

    fn update_memory(&self, memory: Memory) -> std::io::Result<()> {
        *self.connection.memory.lock().unwrap_or_else(|e| e.into_inner()) = Some(memory);
        Ok(())
    }

    /// One worker thread per queue, so that the queues of a multi-queue guest are served in
    /// parallel.
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.device.geometry.queues).map(|q| 1u64 << q).collect()
    }

    /// An exit event per thread: the library signals it when the connection's handler is
    /// dropped, and the thread ends.
    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }

    fn stop_vring(&self, queue_index: u32) -> std::io::Result<()> {
        let queue = queue_index as usize;
        if let Some(in_flight) = self.device.in_flight.get(queue) {
            in_flight.wait_idle(&self.device.name, queue);
        }
        Ok(())
    }

    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> std::io::Result<()> {
        if evset != EventSet::IN {
            return Err(std::io::Error::other(format!("unexpected event set {evset:?}")));
        }
        self.pin(thread_id);
        // One queue per thread: the thread's vrings hold just that queue, whose number is
        // the thread's.
        let Some(vring) = vrings.get(usize::from(device_event)) else {
            return Err(std::io::Error::other(format!("no queue {device_event}")));
        };
        self.serve_queue(thread_id, vring)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_stop_waits_for_the_requests_in_flight() {
        let in_flight = Arc::new(InFlight::default());
        in_flight.add(2);
        let finisher = {
            let in_flight = in_flight.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                in_flight.done();
                std::thread::sleep(Duration::from_millis(50));
                in_flight.done();
            })
        };
        in_flight.wait_idle("test", 0);
        assert_eq!(*in_flight.count.lock().unwrap(), 0);
        finisher.join().unwrap();
        // Nothing in flight: no wait at all.
        in_flight.wait_idle("test", 0);
    }

    #[test]
    fn a_finished_future_runs_here_and_a_waiting_one_is_handed_back() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        assert!(
            run_here(runtime.handle(), async move { flag.store(true, Ordering::SeqCst) }).is_none()
        );
        assert!(done.load(Ordering::SeqCst));
        // A future that needs the runtime's timer is polled in its context, and returned.
        let later = run_here(runtime.handle(), async {
            tokio::time::sleep(Duration::from_millis(1)).await;
        });
        let later = later.expect("a sleeping future cannot finish at once");
        runtime.block_on(later);
    }
}
