//! Where everything lives in guest memory: each queue's rings, each request slot's header,
//! status byte and data buffer, and a scratch area the driver never touches (hostile tests
//! build their chains there).
//!
//! ```text
//!  GUEST_BASE
//!  ├ queue 0: descriptor table │ available ring │ used ring    each part page-aligned
//!  ├ queue 1: …
//!  ├ control: per (queue, slot) 32 B: header at +0 (16 B), status at +16 (1 B)
//!  ├ data: per (queue, slot) one buffer of `slot_bytes`, page-aligned
//!  └ scratch: the rest, at least `min_scratch` bytes; the memory is at least 64 MiB
//! ```
//!
//! A slot is one request in flight. Slot `s` always uses descriptors `3s`, `3s+1`, `3s+2`
//! (header, data, status; FLUSH leaves out the data), so a queue of N entries holds at most
//! N / 3 slots, and descriptors from `3 × slots` up are free for a test's own chains.

use std::ops::Range;

use super::memory::GUEST_BASE;
use super::request::SECTOR;
use super::ring::{avail_ring_len, desc_table_len, used_ring_len, RingAddrs};

/// Descriptors of one slot's chain.
pub const SLOT_DESCS: u16 = 3;

/// The smallest guest memory: 64 MiB, most of it scratch (sparse, so it costs nothing
/// until touched).
pub const MIN_MEMORY: u64 = 64 << 20;

/// The largest guest memory the driver makes.
pub const MAX_MEMORY: u64 = 8 << 30;

/// The largest data buffer of a slot.
pub const MAX_SLOT_BYTES: u32 = 4 << 20;

const PAGE: u64 = 4096;

/// Bytes of one slot's control block.
const CONTROL: u64 = 32;

/// Where everything is; see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    queues: u16,
    queue_size: u16,
    slots: u16,
    slot_bytes: u32,
    /// Bytes from one queue's rings to the next's.
    ring_stride: u64,
    control: u64,
    data: u64,
    /// Bytes from one slot's data buffer to the next's.
    data_stride: u64,
    scratch: Range<u64>,
}

impl Layout {
    /// The layout of `queues` queues of `queue_size` entries (a power of two, 2 to 32768),
    /// `slots` request slots in each (1 to `queue_size / 3`) with `slot_bytes` of data each
    /// (whole sectors, up to [`MAX_SLOT_BYTES`]), and at least `min_scratch` bytes of
    /// scratch. `Err` says which value is out of range.
    pub fn new(
        queues: u16,
        queue_size: u16,
        slots: u16,
        slot_bytes: u32,
        min_scratch: u64,
    ) -> Result<Layout, String> {
        if queues == 0 {
            return Err("at least one queue is needed".into());
        }
        if !queue_size.is_power_of_two() || !(2..=32768).contains(&queue_size) {
            return Err(format!(
                "the queue size must be a power of two up to 32768, not {queue_size}"
            ));
        }
        let max_slots = queue_size / SLOT_DESCS;
        if slots == 0 || slots > max_slots {
            return Err(format!(
                "requests in flight per queue must be 1 to {max_slots} (a queue of {queue_size} \
                 entries, {SLOT_DESCS} descriptors per request), not {slots}"
            ));
        }
        if slot_bytes == 0
            || !u64::from(slot_bytes).is_multiple_of(SECTOR)
            || slot_bytes > MAX_SLOT_BYTES
        {
            return Err(format!(
                "the block size must be whole sectors of {SECTOR} bytes up to {MAX_SLOT_BYTES}, \
                 not {slot_bytes}"
            ));
        }
        let page = |n: u64| n.div_ceil(PAGE) * PAGE;
        let ring_stride = page(desc_table_len(queue_size))
            + page(avail_ring_len(queue_size))
            + page(used_ring_len(queue_size));
        let all_slots = u64::from(queues) * u64::from(slots);
        let control = GUEST_BASE + u64::from(queues) * ring_stride;
        let data = control + page(all_slots * CONTROL);
        let data_stride = page(u64::from(slot_bytes));
        let scratch_start = data + all_slots * data_stride;
        let end =
            (scratch_start + min_scratch.max(PAGE)).max(GUEST_BASE + MIN_MEMORY).div_ceil(2 << 20)
                * (2 << 20);
        if end - GUEST_BASE > MAX_MEMORY {
            return Err(format!(
                "the requests' buffers need {} MiB of guest memory, more than the {} MiB allowed",
                (end - GUEST_BASE) >> 20,
                MAX_MEMORY >> 20
            ));
        }
        Ok(Layout {
            queues,
            queue_size,
            slots,
            slot_bytes,
            ring_stride,
            control,
            data,
            data_stride,
            scratch: scratch_start..end,
        })
    }

    /// Bytes of guest memory the layout needs.
    pub fn memory_size(&self) -> u64 {
        self.scratch.end - GUEST_BASE
    }

    /// Queues.
    pub fn queues(&self) -> u16 {
        self.queues
    }

    /// Entries per queue.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    /// Request slots per queue.
    pub fn slots(&self) -> u16 {
        self.slots
    }

    /// Bytes of each slot's data buffer.
    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// Queue `q`'s rings.
    pub fn ring(&self, q: u16) -> RingAddrs {
        let desc = GUEST_BASE + u64::from(q) * self.ring_stride;
        let avail = desc + desc_table_len(self.queue_size).div_ceil(PAGE) * PAGE;
        let used = avail + avail_ring_len(self.queue_size).div_ceil(PAGE) * PAGE;
        RingAddrs { desc, avail, used, size: self.queue_size }
    }

    /// The head descriptor of slot `slot`'s chain (the next two follow it).
    pub fn slot_head(slot: u16) -> u16 {
        slot * SLOT_DESCS
    }

    /// The slot whose chain starts at `head`, if it is one.
    pub fn slot_of_head(&self, head: u32) -> Option<u16> {
        let head = u16::try_from(head).ok()?;
        (head.is_multiple_of(SLOT_DESCS) && head / SLOT_DESCS < self.slots)
            .then_some(head / SLOT_DESCS)
    }

    /// The first descriptor no slot uses: `free_descriptors()..queue_size` are a test's.
    pub fn free_descriptors(&self) -> Range<u16> {
        self.slots * SLOT_DESCS..self.queue_size
    }

    /// Slot `slot` of queue `q`'s request header.
    pub fn header(&self, q: u16, slot: u16) -> u64 {
        self.control + self.index(q, slot) * CONTROL
    }

    /// Its status byte.
    pub fn status(&self, q: u16, slot: u16) -> u64 {
        self.header(q, slot) + 16
    }

    /// Its data buffer, [`Layout::slot_bytes`] long.
    pub fn data(&self, q: u16, slot: u16) -> u64 {
        self.data + self.index(q, slot) * self.data_stride
    }

    /// The scratch area.
    pub fn scratch(&self) -> Range<u64> {
        self.scratch.clone()
    }

    fn index(&self, q: u16, slot: u16) -> u64 {
        u64::from(q) * u64::from(self.slots) + u64::from(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_do_not_overlap() {
        let l = Layout::new(2, 256, 16, 4096, 1 << 20).unwrap();
        let (r0, r1) = (l.ring(0), l.ring(1));
        assert_eq!(r0.desc, GUEST_BASE);
        assert_eq!((r0.avail - r0.desc, r0.used - r0.avail), (4096, 4096));
        assert_eq!(r1.desc, r0.used + 4096);
        assert!(l.header(0, 0) >= r1.used + used_ring_len(256));
        assert_eq!(l.status(1, 15), l.header(1, 15) + 16);
        assert!(l.data(0, 0) > l.status(1, 15));
        assert_eq!(l.data(0, 0) % 4096, 0);
        assert_eq!(l.data(1, 0), l.data(0, 15) + 4096);
        assert!(l.scratch().start >= l.data(1, 15) + 4096);
        assert_eq!(l.memory_size(), MIN_MEMORY);
        assert_eq!(l.free_descriptors(), 48..256);
        assert_eq!((Layout::slot_head(5), l.slot_of_head(15)), (15, Some(5)));
        assert_eq!((l.slot_of_head(16), l.slot_of_head(48)), (None, None));
    }

    #[test]
    fn large_buffers_grow_the_memory() {
        let l = Layout::new(1, 256, 85, 1 << 20, 1 << 20).unwrap();
        assert!(l.memory_size() >= 86 << 20);
        assert_eq!(l.memory_size() % (2 << 20), 0);
        assert!(l.scratch().end - l.scratch().start >= 1 << 20);
    }

    #[test]
    fn out_of_range_values_are_refused() {
        for (queues, size, slots, bytes) in [
            (0, 256, 1, 4096),
            (1, 100, 1, 4096),
            (1, 256, 86, 4096),
            (1, 256, 0, 4096),
            (1, 256, 1, 1000),
            (1, 256, 1, 0),
            (1, 256, 1, 8 << 20),
            (64, 32768, 10922, 4 << 20),
        ] {
            assert!(
                Layout::new(queues, size, slots, bytes, 0).is_err(),
                "{queues} {size} {slots} {bytes}"
            );
        }
    }
}
