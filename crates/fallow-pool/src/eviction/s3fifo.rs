//! S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).
//!
//! ```text
//!  insert ──► small FIFO (10 %) ──front, ≥ 2 hits in small─► main FIFO (90 %) ◄─┐
//!     │             │ front, fewer hits                      │ front: freq > 0 ─┘ freq -= 1
//!     │             ▼                                        ▼ freq = 0
//!     │          ghost (key hashes, sized like main)        evicted
//!     └── key in ghost ──────────────────────────────────► main FIFO
//! ```
//!
//! A hit only bumps a 2-bit frequency (no list move), so most one-hit pages leave from the
//! small queue quickly ("quick demotion") and a scan cannot flush the main queue.
//!
//! Per slot: two `u32` links, the key's 32-bit fingerprint (the ghost needs it when the
//! page leaves, and `pop_victim` is not given hashes) and one state byte: 13 bytes, plus
//! the ghost's ring and map (about 13 bytes per remembered eviction, up to 0.9 × capacity).

use super::ghost::Ghost;
use super::list::{Links, List};
use super::{Eviction, SlotId};

/// Share of the capacity given to the small queue (the paper's 10 %).
const SMALL_PERCENT: usize = 10;
/// Frequencies saturate here (2 bits).
pub(super) const MAX_FREQ: u8 = 3;
/// Hits a page needs while in the small queue to move to main. libCacheSim's current
/// S3-FIFO uses 2 (the paper's first version used 1); with 2, our miss ratios match its
/// reference column on the ARC traces, and on the shared traces as a whole it is better.
pub(super) const MOVE_TO_MAIN: u8 = 2;

/// Which queue a slot is on, in the low two bits of its state byte.
const Q_NONE: u8 = 0;
const Q_SMALL: u8 = 1;
const Q_MAIN: u8 = 2;
const Q_MASK: u8 = 0b11;
/// The 2-bit frequency sits above the queue bits.
const FREQ_SHIFT: u32 = 2;

/// S3-FIFO with a 10 % small queue, a 2-bit-frequency main queue and a ghost.
#[derive(Debug, Default)]
pub struct S3Fifo {
    links: Links,
    /// Per slot: queue (bits 0–1) and frequency (bits 2–3).
    state: Vec<u8>,
    /// Per slot: low 32 bits of the key hash, for the ghost.
    fingerprint: Vec<u32>,
    small: List,
    main: List,
    ghost: Ghost,
    small_target: usize,
    capacity: usize,
}

impl S3Fifo {
    /// An empty S3-FIFO for a cache of `capacity` pages.
    pub fn new(capacity: usize) -> Self {
        let mut s = Self::default();
        s.set_capacity(capacity);
        s
    }

    fn queue(&self, id: SlotId) -> u8 {
        self.state.get(id as usize).map_or(Q_NONE, |s| s & Q_MASK)
    }

    fn freq(&self, id: SlotId) -> u8 {
        self.state[id as usize] >> FREQ_SHIFT
    }

    fn set(&mut self, id: SlotId, queue: u8, freq: u8) {
        self.state[id as usize] = queue | (freq << FREQ_SHIFT);
    }

    /// Takes the small queue's front: promotes it if it was hit, else evicts it into the
    /// ghost. Returns the victim, if any.
    fn evict_small(&mut self) -> Option<SlotId> {
        let id = self.small.pop_front(&mut self.links)?;
        if self.freq(id) >= MOVE_TO_MAIN {
            self.main.push_back(&mut self.links, id);
            self.set(id, Q_MAIN, 0);
            None
        } else {
            self.ghost.push(self.fingerprint[id as usize]);
            self.set(id, Q_NONE, 0);
            Some(id)
        }
    }

    /// Takes the main queue's front: re-inserts it with one frequency less if it was hit,
    /// else evicts it.
    fn evict_main(&mut self) -> Option<SlotId> {
        let id = self.main.pop_front(&mut self.links)?;
        let freq = self.freq(id);
        if freq > 0 {
            self.main.push_back(&mut self.links, id);
            self.set(id, Q_MAIN, freq - 1);
            None
        } else {
            self.set(id, Q_NONE, 0);
            Some(id)
        }
    }
}

impl Eviction for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn set_capacity(&mut self, pages: usize) {
        self.capacity = pages;
        self.small_target = (pages * SMALL_PERCENT / 100).max(1);
        self.ghost.set_capacity(pages.saturating_sub(self.small_target));
    }

    fn insert(&mut self, id: SlotId, hash: u64) {
        self.links.ensure(id);
        if self.state.len() <= id as usize {
            self.state.resize(id as usize + 1, Q_NONE);
            self.fingerprint.resize(id as usize + 1, 0);
        }
        debug_assert_eq!(self.queue(id), Q_NONE, "slot {id} is already tracked");
        let fp = hash as u32;
        self.fingerprint[id as usize] = fp;
        // As libCacheSim's S3FIFO.c: once the small queue is full, pages stored while the
        // cache still has room go straight to main, so a cold cache fills main with the
        // first pages instead of churning them through small (better in general, and what
        // keeps a loop longer than the cache from missing every time).
        let room = self.len() < self.capacity && self.small.len() >= self.small_target;
        if self.ghost.take(fp) || room {
            self.main.push_back(&mut self.links, id);
            self.set(id, Q_MAIN, 0);
        } else {
            self.small.push_back(&mut self.links, id);
            self.set(id, Q_SMALL, 0);
        }
    }

    fn touch(&mut self, id: SlotId, _hash: u64) {
        let queue = self.queue(id);
        debug_assert_ne!(queue, Q_NONE, "slot {id} is not tracked");
        let freq = (self.freq(id) + 1).min(MAX_FREQ);
        self.set(id, queue, freq);
    }

    fn remove(&mut self, id: SlotId) {
        match self.queue(id) {
            Q_SMALL => self.small.unlink(&mut self.links, id),
            Q_MAIN => self.main.unlink(&mut self.links, id),
            q => debug_assert!(false, "slot {id} is not tracked (queue {q})"),
        }
        self.set(id, Q_NONE, 0);
    }

    fn on_evicted(&mut self, id: SlotId) {
        // As `evict_small` does with its own victims: only pages leaving small are ghosts.
        if self.queue(id) == Q_SMALL {
            self.ghost.push(self.fingerprint[id as usize]);
        }
        self.remove(id);
    }

    fn pop_victim(&mut self) -> Option<SlotId> {
        // Each pass either evicts or moves a page that used up a hit (promotion clears
        // the frequency, re-insertion lowers it), so this loop is amortized O(1).
        loop {
            if self.small.is_empty() && self.main.is_empty() {
                return None;
            }
            let victim = if self.small.len() >= self.small_target || self.main.is_empty() {
                self.evict_small()
            } else {
                self.evict_main()
            };
            if victim.is_some() {
                return victim;
            }
        }
    }

    fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }

    fn heap_bytes(&self) -> usize {
        self.links.heap_bytes()
            + self.state.capacity()
            + self.fingerprint.capacity() * 4
            + self.ghost.heap_bytes()
    }

    fn validate(&self) {
        for (list, queue) in [(&self.small, Q_SMALL), (&self.main, Q_MAIN)] {
            list.validate(&self.links, |id| {
                assert_eq!(self.queue(id), queue, "slot {id} is on the wrong queue");
                assert!(self.freq(id) <= MAX_FREQ);
            });
        }
        let tracked = self.state.iter().filter(|s| *s & Q_MASK != Q_NONE).count();
        assert_eq!(tracked, self.len(), "state bytes disagree with the queues");
        self.ghost.validate();
    }
}
