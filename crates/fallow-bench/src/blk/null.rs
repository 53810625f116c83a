//! The null device: a thread in this process that plays a trivial backend on the driver's
//! own rings, completing every request OK at once without touching data. What the driver
//! measures against it is the driver's floor (its ring work, its kicks, its wait), the
//! number a real backend's latency is compared with: "added latency over the floor".
//!
//! It behaves as a device toward the driver: it takes chains from the available ring,
//! writes the status byte (the chain's last descriptor, when writable and inside memory),
//! returns the chain with the bytes of its writable buffers as the used length, keeps
//! `avail_event` current (so the driver kicks as it would for a real device) and calls
//! when `used_event` asks. With [`Wait::Spin`] it spins on the available ring and never
//! reads its kick eventfd (a kick still costs the driver its `write`); with
//! [`Wait::Call`] it sleeps on the kick eventfd, as the driver sleeps on the call one.
//!
//! The thread stops when the [`NullDevice`] is dropped.

use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use std::os::fd::AsFd;
use std::time::Duration;

use super::memory::{GuestMemory, MemoryError};
use super::notify::{wait_readable, Event};
use super::ring::{need_event, Descriptor, RingAddrs, F_NEXT, F_WRITE};
use super::Wait;

/// One queue as the device sees it.
pub(crate) struct DeviceQueue {
    /// Where the rings are.
    pub(crate) addrs: RingAddrs,
    /// Signalled by the driver.
    pub(crate) kick: Event,
    /// Signalled by the device.
    pub(crate) call: Event,
}

/// The running null device.
pub(crate) struct NullDevice {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), MemoryError>>>,
}

impl NullDevice {
    /// Starts the device's thread on `queues` in `mem`.
    pub(crate) fn start(
        mem: GuestMemory,
        queues: Vec<DeviceQueue>,
        wait: Wait,
        event_idx: bool,
    ) -> std::io::Result<NullDevice> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let thread = std::thread::Builder::new().name("blk-null".into()).spawn(move || {
            let mut states: Vec<QueueState> =
                queues.into_iter().map(|q| QueueState { q, last_avail: 0, used: 0 }).collect();
            serve(&mem, &mut states, wait, event_idx, &stopping)
        })?;
        Ok(NullDevice { stop, thread: Some(thread) })
    }

    /// Whether the thread has ended (it only ends early on a memory error, a bug).
    pub(crate) fn ended(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

impl Drop for NullDevice {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct QueueState {
    q: DeviceQueue,
    /// The next available index to take.
    last_avail: u16,
    /// The next used index to fill.
    used: u16,
}

/// How long a sleeping device waits for a kick before it looks at the stop flag.
const SLEEP: Duration = Duration::from_millis(50);

fn serve(
    mem: &GuestMemory,
    queues: &mut [QueueState],
    wait: Wait,
    event_idx: bool,
    stop: &AtomicBool,
) -> Result<(), MemoryError> {
    while !stop.load(Ordering::Relaxed) {
        let mut done = 0;
        for state in queues.iter_mut() {
            done += serve_queue(mem, state, event_idx)?;
        }
        if done > 0 {
            continue;
        }
        match wait {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Call => sleep_for_kick(mem, queues, event_idx)?,
        }
    }
    Ok(())
}

/// Completes every chain available on one queue; returns how many.
fn serve_queue(
    mem: &GuestMemory,
    state: &mut QueueState,
    event_idx: bool,
) -> Result<usize, MemoryError> {
    let a = state.q.addrs;
    let avail: u16 = mem.load(a.avail_idx(), Ordering::Acquire)?;
    let old_used = state.used;
    let mut done = 0;
    while state.last_avail != avail {
        let head: u16 = mem.load(a.avail_entry(state.last_avail), Ordering::Relaxed)?;
        state.last_avail = state.last_avail.wrapping_add(1);
        let written = complete(mem, a, head);
        let at = a.used_entry(state.used);
        mem.store(u32::from(head), at, Ordering::Relaxed)?;
        mem.store(written, at + 4, Ordering::Relaxed)?;
        state.used = state.used.wrapping_add(1);
        done += 1;
    }
    if done == 0 {
        return Ok(0);
    }
    mem.store(state.used, a.used_idx(), Ordering::Release)?;
    if event_idx {
        // Kick me for anything after what I have taken.
        mem.store(state.last_avail, a.avail_event(), Ordering::Relaxed)?;
    }
    // The used index out, then the driver's wish read: a full fence between them.
    fence(Ordering::SeqCst);
    let call = if event_idx {
        let event: u16 = mem.load(a.used_event(), Ordering::Relaxed)?;
        need_event(event, state.used, old_used)
    } else {
        let flags: u16 = mem.load(a.avail_flags(), Ordering::Relaxed)?;
        flags & 1 == 0
    };
    if call {
        // An eventfd write fails only on overflow of its counter, after 2⁶⁴ − 2 calls.
        let _ = state.q.call.signal();
    }
    Ok(done)
}

/// Walks the chain at `head` and writes OK into its last descriptor when that is writable
/// and inside memory. Returns the bytes of its writable descriptors. A malformed chain
/// (a loop, an index past the table, an indirect table) ends the walk: the null device
/// serves the driver's own requests and never panics on a test's.
fn complete(mem: &GuestMemory, a: RingAddrs, head: u16) -> u32 {
    let mut index = head;
    let mut written = 0u32;
    for _ in 0..a.size {
        if index >= a.size {
            return written;
        }
        let mut raw = [0u8; 16];
        if mem.read(a.desc_at(index), &mut raw).is_err() {
            return written;
        }
        let d = Descriptor::from_bytes(raw);
        if d.flags & F_WRITE != 0 {
            written = written.saturating_add(d.len);
        }
        if d.flags & F_NEXT == 0 {
            if d.flags & F_WRITE != 0 && d.len >= 1 {
                let _ = mem.write(d.addr + u64::from(d.len) - 1, &[0]);
            }
            return written;
        }
        index = d.next;
    }
    written
}

/// Sleeps until a kick on any queue (or [`SLEEP`]), after telling the driver to kick and
/// looking at the rings once more.
fn sleep_for_kick(
    mem: &GuestMemory,
    queues: &[QueueState],
    event_idx: bool,
) -> Result<(), MemoryError> {
    for state in queues {
        let a = state.q.addrs;
        if event_idx {
            mem.store(state.last_avail, a.avail_event(), Ordering::Relaxed)?;
        } else {
            mem.store(0u16, a.used_flags(), Ordering::Relaxed)?;
        }
    }
    fence(Ordering::SeqCst);
    for state in queues {
        let avail: u16 = mem.load(state.q.addrs.avail_idx(), Ordering::Acquire)?;
        if avail != state.last_avail {
            return Ok(());
        }
    }
    let fds: Vec<_> = queues.iter().map(|s| s.q.kick.as_fd()).collect();
    // A failed poll is as good as a timeout here: the loop looks at the rings again.
    let _ = wait_readable(&fds, SLEEP);
    for state in queues {
        state.q.kick.drain();
    }
    Ok(())
}
