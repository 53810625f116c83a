//! The split virtqueue (VIRTIO 1.2, 2.7), the driver's side: the descriptor table, the
//! available ring the driver writes, the used ring the device writes. All little-endian.
//!
//! ```text
//!  descriptor table, 16 B per entry, 16-byte aligned
//!    0 le64 addr │ 8 le32 len │ 12 le16 flags (NEXT 1, WRITE 2, INDIRECT 4) │ 14 le16 next
//!  available ring, 2-byte aligned                  used ring, 4-byte aligned
//!    0 le16 flags (NO_INTERRUPT 1)                   0 le16 flags (NO_NOTIFY 1)
//!    2 le16 idx: where the driver writes next        2 le16 idx: where the device writes next
//!    4 le16 ring[N]: descriptor heads                4 {le32 id, le32 len}[N]: done chains
//!    4+2N le16 used_event (EVENT_IDX)                4+8N le16 avail_event (EVENT_IDX)
//! ```
//!
//! Indexes run freely over `u16` and wrap; a ring slot is the index modulo N (a power of
//! two). With `VIRTIO_RING_F_EVENT_IDX` each side says when it next wants a notification:
//! the device writes `avail_event` (kick me once `avail.idx` passes this), the driver
//! `used_event` (call me once `used.idx` passes this); without it, the flags say all or
//! nothing.
//!
//! # Ordering
//! Descriptors and ring entries are written before the index that publishes them (a
//! Release store). Between publishing an index and reading the other side's event index a
//! full fence is needed (a store, then a load of another location): without it the driver
//! could read a stale `avail_event`, skip a kick the device waits for, and hang.

use std::sync::atomic::{fence, Ordering};

use super::memory::{GuestMemory, MemoryError};

/// Bytes of one descriptor.
pub const DESC_LEN: u64 = 16;

/// Descriptor flag: the chain continues at `next`.
pub const F_NEXT: u16 = 1;
/// Descriptor flag: the device writes this buffer (else it reads it).
pub const F_WRITE: u16 = 2;
/// Descriptor flag: the buffer is a table of descriptors (an indirect chain).
pub const F_INDIRECT: u16 = 4;

/// One entry of a descriptor table (see the module documentation). Any value can be
/// written, which is what the hostile-chain tests need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Descriptor {
    /// Guest-physical address of the buffer.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u32,
    /// [`F_NEXT`], [`F_WRITE`], [`F_INDIRECT`], or anything else.
    pub flags: u16,
    /// The next descriptor's index, when `flags` has [`F_NEXT`].
    pub next: u16,
}

impl Descriptor {
    /// A buffer the device reads.
    pub fn readable(addr: u64, len: u32) -> Descriptor {
        Descriptor { addr, len, flags: 0, next: 0 }
    }

    /// A buffer the device writes.
    pub fn writable(addr: u64, len: u32) -> Descriptor {
        Descriptor { addr, len, flags: F_WRITE, next: 0 }
    }

    /// A table of `count` descriptors at `addr`, to be read as the rest of the chain.
    pub fn indirect(addr: u64, count: u32) -> Descriptor {
        let len = count.saturating_mul(DESC_LEN as u32);
        Descriptor { addr, len, flags: F_INDIRECT, next: 0 }
    }

    /// The same, continued at `next` ([`F_NEXT`] set).
    pub fn then(self, next: u16) -> Descriptor {
        Descriptor { flags: self.flags | F_NEXT, next, ..self }
    }

    /// The same, ending the chain ([`F_NEXT`] cleared).
    pub fn last(self) -> Descriptor {
        Descriptor { flags: self.flags & !F_NEXT, next: 0, ..self }
    }

    /// Its 16 bytes as they sit in a table.
    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0u8; 16];
        let (addr, rest) = b.split_at_mut(8);
        addr.copy_from_slice(&self.addr.to_le_bytes());
        let (len, rest) = rest.split_at_mut(4);
        len.copy_from_slice(&self.len.to_le_bytes());
        let (flags, next) = rest.split_at_mut(2);
        flags.copy_from_slice(&self.flags.to_le_bytes());
        next.copy_from_slice(&self.next.to_le_bytes());
        b
    }

    /// A descriptor from its 16 bytes.
    pub fn from_bytes(b: [u8; 16]) -> Descriptor {
        let [a0, a1, a2, a3, a4, a5, a6, a7, l0, l1, l2, l3, f0, f1, n0, n1] = b;
        Descriptor {
            addr: u64::from_le_bytes([a0, a1, a2, a3, a4, a5, a6, a7]),
            len: u32::from_le_bytes([l0, l1, l2, l3]),
            flags: u16::from_le_bytes([f0, f1]),
            next: u16::from_le_bytes([n0, n1]),
        }
    }

    /// `descs` linked in order as a table starting at index `first`: each but the last
    /// gets [`F_NEXT`] and the next index; the last loses [`F_NEXT`]. Other flags stay.
    pub fn link(descs: &[Descriptor], first: u16) -> Vec<Descriptor> {
        let n = descs.len();
        descs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                if i + 1 == n {
                    d.last()
                } else {
                    d.then(first.wrapping_add(i as u16).wrapping_add(1))
                }
            })
            .collect()
    }
}

/// Bytes of the descriptor table of a queue of `size` entries.
pub fn desc_table_len(size: u16) -> u64 {
    DESC_LEN * u64::from(size)
}

/// Bytes of the available ring, `used_event` included.
pub fn avail_ring_len(size: u16) -> u64 {
    6 + 2 * u64::from(size)
}

/// Bytes of the used ring, `avail_event` included.
pub fn used_ring_len(size: u16) -> u64 {
    6 + 8 * u64::from(size)
}

/// Whether an event index asks for a notification now: the other side wants one once the
/// index passes `event`, and it just moved from `old` to `new` (VIRTIO 1.2, 2.7.10;
/// Linux's `vring_need_event`). Wrapping arithmetic: indexes run over `u16`.
pub fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// Where one queue's three parts are, in guest-physical addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingAddrs {
    /// The descriptor table.
    pub desc: u64,
    /// The available ring.
    pub avail: u64,
    /// The used ring.
    pub used: u64,
    /// Entries: a power of two, at most 32768.
    pub size: u16,
}

impl RingAddrs {
    /// Descriptor `index`.
    pub fn desc_at(&self, index: u16) -> u64 {
        self.desc + DESC_LEN * u64::from(index)
    }

    /// `avail.flags`.
    pub fn avail_flags(&self) -> u64 {
        self.avail
    }

    /// `avail.idx`.
    pub fn avail_idx(&self) -> u64 {
        self.avail + 2
    }

    /// The available ring's slot for index `i`.
    pub fn avail_entry(&self, i: u16) -> u64 {
        self.avail + 4 + 2 * u64::from(i % self.size)
    }

    /// `used_event`, after the available ring.
    pub fn used_event(&self) -> u64 {
        self.avail + 4 + 2 * u64::from(self.size)
    }

    /// `used.flags`.
    pub fn used_flags(&self) -> u64 {
        self.used
    }

    /// `used.idx`.
    pub fn used_idx(&self) -> u64 {
        self.used + 2
    }

    /// The used ring's element for index `i`.
    pub fn used_entry(&self, i: u16) -> u64 {
        self.used + 4 + 8 * u64::from(i % self.size)
    }

    /// `avail_event`, after the used ring.
    pub fn avail_event(&self) -> u64 {
        self.used + 4 + 8 * u64::from(self.size)
    }
}

/// A chain the device is done with: an element of the used ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    /// The head of the chain, as the device reports it (unchecked).
    pub id: u32,
    /// Bytes the device says it wrote into the chain's writable buffers.
    pub len: u32,
}

/// The driver's state of one queue: what it has made available and what it has seen used.
#[derive(Debug)]
pub struct DriverRing {
    addrs: RingAddrs,
    /// Whether `VIRTIO_RING_F_EVENT_IDX` was negotiated.
    event_idx: bool,
    /// The next available index to fill (published or not).
    avail_idx: u16,
    /// `avail.idx` as last published: the old index of the next kick decision.
    published: u16,
    /// The next used index to read.
    last_used: u16,
}

impl DriverRing {
    /// A queue whose rings start empty (index 0 on both sides), as after SET_VRING_BASE 0.
    /// Zeroes the rings' flags and indexes.
    pub fn new(
        mem: &GuestMemory,
        addrs: RingAddrs,
        event_idx: bool,
    ) -> Result<DriverRing, MemoryError> {
        mem.fill(addrs.avail, avail_ring_len(addrs.size), 0)?;
        mem.fill(addrs.used, used_ring_len(addrs.size), 0)?;
        Ok(DriverRing { addrs, event_idx, avail_idx: 0, published: 0, last_used: 0 })
    }

    /// Where the queue lives.
    pub fn addrs(&self) -> RingAddrs {
        self.addrs
    }

    /// Whether EVENT_IDX is in use.
    pub fn event_idx(&self) -> bool {
        self.event_idx
    }

    /// Chains made available and not yet seen used.
    pub fn in_flight(&self) -> u16 {
        self.avail_idx.wrapping_sub(self.last_used)
    }

    /// Writes `desc` as descriptor `index` (any index below the queue size).
    pub fn set_descriptor(
        &self,
        mem: &GuestMemory,
        index: u16,
        desc: Descriptor,
    ) -> Result<(), MemoryError> {
        if index >= self.addrs.size {
            let (addr, len) = (self.addrs.desc_at(index), DESC_LEN);
            let end = self.addrs.desc + desc_table_len(self.addrs.size);
            return Err(MemoryError { addr, len, base: self.addrs.desc, end });
        }
        mem.write(self.addrs.desc_at(index), &desc.to_bytes())
    }

    /// Puts `head` in the next slot of the available ring, not yet visible to the device
    /// (see [`DriverRing::publish`]).
    pub fn push(&mut self, mem: &GuestMemory, head: u16) -> Result<(), MemoryError> {
        mem.store(head, self.addrs.avail_entry(self.avail_idx), Ordering::Relaxed)?;
        self.avail_idx = self.avail_idx.wrapping_add(1);
        Ok(())
    }

    /// Makes everything pushed visible to the device (`avail.idx`), and says whether the
    /// device wants to be kicked for it.
    pub fn publish(&mut self, mem: &GuestMemory) -> Result<bool, MemoryError> {
        let (old, new) = (self.published, self.avail_idx);
        if old == new {
            return Ok(false);
        }
        // Release: the descriptors and ring entries written before are seen with the index.
        mem.store(new, self.addrs.avail_idx(), Ordering::Release)?;
        self.published = new;
        // The store above, then a load of the device's word: a full fence between them
        // (see the module documentation).
        fence(Ordering::SeqCst);
        if self.event_idx {
            let event: u16 = mem.load(self.addrs.avail_event(), Ordering::Relaxed)?;
            Ok(need_event(event, new, old))
        } else {
            let flags: u16 = mem.load(self.addrs.used_flags(), Ordering::Relaxed)?;
            Ok(flags & 1 == 0)
        }
    }

    /// Whether the device has returned a chain not yet read by [`DriverRing::next_used`].
    pub fn has_used(&self, mem: &GuestMemory) -> Result<bool, MemoryError> {
        let used_idx: u16 = mem.load(self.addrs.used_idx(), Ordering::Acquire)?;
        Ok(used_idx != self.last_used)
    }

    /// The next used element, if the device has returned one since the last call. With
    /// EVENT_IDX, `used_event` then moves to the next one, as a guest's driver does after
    /// each completion it takes: the device keeps signalling completions, as for a guest.
    /// (Without a fence: a driver about to sleep calls [`DriverRing::want_call`] first.)
    pub fn next_used(&mut self, mem: &GuestMemory) -> Result<Option<Used>, MemoryError> {
        let used_idx: u16 = mem.load(self.addrs.used_idx(), Ordering::Acquire)?;
        if used_idx == self.last_used {
            return Ok(None);
        }
        let at = self.addrs.used_entry(self.last_used);
        let id: u32 = mem.load(at, Ordering::Relaxed)?;
        let len: u32 = mem.load(at + 4, Ordering::Relaxed)?;
        self.last_used = self.last_used.wrapping_add(1);
        if self.event_idx {
            mem.store(self.last_used, self.addrs.used_event(), Ordering::Relaxed)?;
        }
        Ok(Some(Used { id, len }))
    }

    /// Asks the device for a call once it returns the next chain: `used_event` is set to
    /// the next used index (EVENT_IDX), or `avail.flags` cleared. Followed by a full fence,
    /// so that the caller's next look at `used.idx` cannot be answered from before the
    /// request: a chain used in between is either seen then or signalled.
    pub fn want_call(&self, mem: &GuestMemory) -> Result<(), MemoryError> {
        if self.event_idx {
            mem.store(self.last_used, self.addrs.used_event(), Ordering::Relaxed)?;
        } else {
            mem.store(0u16, self.addrs.avail_flags(), Ordering::Relaxed)?;
        }
        fence(Ordering::SeqCst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blk::memory::GUEST_BASE;

    #[test]
    fn a_descriptor_is_16_little_endian_bytes() {
        let d =
            Descriptor { addr: 0x1122_3344_5566_7788, len: 0x99aa_bbcc, flags: 3, next: 0x0102 };
        let bytes = [
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, // addr
            0xcc, 0xbb, 0xaa, 0x99, // len
            0x03, 0x00, // flags: NEXT | WRITE
            0x02, 0x01, // next
        ];
        assert_eq!(d.to_bytes(), bytes);
        assert_eq!(Descriptor::from_bytes(bytes), d);
        assert_eq!(Descriptor::writable(7, 1).then(9).to_bytes()[12..], [3, 0, 9, 0]);
        assert_eq!(Descriptor::indirect(0, 3).flags, F_INDIRECT);
        assert_eq!(Descriptor::indirect(0, 3).len, 48);
    }

    #[test]
    fn ring_offsets_for_256_entries() {
        let r = RingAddrs { desc: 0x10_000, avail: 0x11_000, used: 0x12_000, size: 256 };
        assert_eq!(desc_table_len(256), 4096);
        assert_eq!(avail_ring_len(256), 518);
        assert_eq!(used_ring_len(256), 2054);
        assert_eq!(r.desc_at(255), 0x10_000 + 4080);
        assert_eq!((r.avail_flags(), r.avail_idx()), (0x11_000, 0x11_002));
        assert_eq!(r.avail_entry(0), 0x11_004);
        assert_eq!(r.avail_entry(255), 0x11_004 + 510);
        assert_eq!(r.avail_entry(256), r.avail_entry(0), "indexes wrap at the size");
        assert_eq!(r.used_event(), 0x11_000 + 516);
        assert_eq!((r.used_flags(), r.used_idx()), (0x12_000, 0x12_002));
        assert_eq!(r.used_entry(1), 0x12_00c);
        assert_eq!(r.used_entry(257), r.used_entry(1));
        assert_eq!(r.avail_event(), 0x12_000 + 2052);
    }

    #[test]
    fn event_index_decides_kicks() {
        // The device wants a kick once idx passes 5: moving 3 → 5 does not, 3 → 6 does.
        assert!(!need_event(5, 5, 3));
        assert!(need_event(5, 6, 3));
        assert!(need_event(5, 6, 5), "exactly one past the event");
        assert!(!need_event(5, 6, 6), "nothing new");
        // An event left far behind (a device that stopped asking) wants nothing.
        assert!(!need_event(100, 10, 9));
        // Across the wrap.
        assert!(need_event(0xffff, 1, 0xfffe));
        assert!(!need_event(3, 1, 0xfffe));
        assert!(need_event(0, 1, 0xffff));
    }

    #[test]
    fn publish_kicks_only_when_the_device_asks() {
        let mem = GuestMemory::new(1 << 20).unwrap();
        let addrs = RingAddrs {
            desc: GUEST_BASE,
            avail: GUEST_BASE + 4096,
            used: GUEST_BASE + 8192,
            size: 256,
        };
        let mut ring = DriverRing::new(&mem, addrs, true).unwrap();
        // avail_event 0: the device wants to hear about index 0 → 1.
        ring.push(&mem, 7).unwrap();
        assert!(ring.publish(&mem).unwrap());
        assert_eq!(mem.load::<u16>(addrs.avail_idx(), Ordering::Acquire).unwrap(), 1);
        assert_eq!(mem.load::<u16>(addrs.avail_entry(0), Ordering::Acquire).unwrap(), 7);
        // The device has not caught up (avail_event still 0): no second kick.
        ring.push(&mem, 8).unwrap();
        assert!(!ring.publish(&mem).unwrap());
        // Nothing pushed: nothing to say.
        assert!(!ring.publish(&mem).unwrap());
        // The device read both and asks again from 2.
        mem.store(2u16, addrs.avail_event(), Ordering::Release).unwrap();
        ring.push(&mem, 9).unwrap();
        assert!(ring.publish(&mem).unwrap());
        // Without EVENT_IDX, NO_NOTIFY decides.
        let mut plain = DriverRing::new(&mem, addrs, false).unwrap();
        plain.push(&mem, 1).unwrap();
        assert!(plain.publish(&mem).unwrap());
        mem.store(1u16, addrs.used_flags(), Ordering::Release).unwrap();
        plain.push(&mem, 2).unwrap();
        assert!(!plain.publish(&mem).unwrap());
    }

    #[test]
    fn used_elements_are_read_in_order() {
        let mem = GuestMemory::new(1 << 20).unwrap();
        let addrs = RingAddrs {
            desc: GUEST_BASE,
            avail: GUEST_BASE + 4096,
            used: GUEST_BASE + 8192,
            size: 4,
        };
        let mut ring = DriverRing::new(&mem, addrs, true).unwrap();
        assert_eq!(ring.next_used(&mem).unwrap(), None);
        for i in 0..6u16 {
            ring.push(&mem, i).unwrap();
            ring.publish(&mem).unwrap();
            // Play the device: element i (slot i % 4), then the index.
            mem.store(u32::from(i) + 100, addrs.used_entry(i), Ordering::Relaxed).unwrap();
            mem.store(512u32, addrs.used_entry(i) + 4, Ordering::Relaxed).unwrap();
            mem.store(i + 1, addrs.used_idx(), Ordering::Release).unwrap();
            assert_eq!(ring.in_flight(), 1);
            assert_eq!(
                ring.next_used(&mem).unwrap(),
                Some(Used { id: u32::from(i) + 100, len: 512 })
            );
            assert_eq!(ring.next_used(&mem).unwrap(), None);
            // Each completion taken moves `used_event` to the next one.
            assert_eq!(mem.load::<u16>(addrs.used_event(), Ordering::Acquire).unwrap(), i + 1);
        }
        mem.store(0u16, addrs.used_event(), Ordering::Release).unwrap();
        ring.want_call(&mem).unwrap();
        assert_eq!(mem.load::<u16>(addrs.used_event(), Ordering::Acquire).unwrap(), 6);
        assert!(ring.set_descriptor(&mem, 4, Descriptor::default()).is_err());
    }
}
