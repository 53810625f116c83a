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
//! Per slot: two 24-bit links, the key's 32-bit fingerprint (the ghost needs it when the
//! page leaves, and `pop_victim` is not given hashes) and one state byte: 11 bytes, plus
//! the ghost's ring and map (about 13 bytes per remembered eviction, up to 0.9 × capacity).

use super::ghost::Ghost;
use super::s3fifo_queues::{Queues, Q_MAIN, Q_SMALL};
use super::{Eviction, SlotId};

/// Share of the capacity given to the small queue (the paper's 10 %).
const SMALL_PERCENT: usize = 10;

/// S3-FIFO with a 10 % small queue, a 2-bit-frequency main queue and a ghost.
#[derive(Debug, Default)]
pub struct S3Fifo {
    queues: Queues,
    /// Per slot: low 32 bits of the key hash, for the ghost.
    fingerprint: Vec<u32>,
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
}

impl Eviction for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn set_capacity(&mut self, pages: usize) {
        self.capacity = pages;
        self.queues.expect(pages);
        self.small_target = (pages * SMALL_PERCENT / 100).max(1);
        self.ghost.set_capacity(pages.saturating_sub(self.small_target));
    }

    fn insert(&mut self, id: SlotId, hash: u64) {
        if self.fingerprint.len() <= id as usize {
            self.fingerprint.resize(id as usize + 1, 0);
        }
        let fp = hash as u32;
        self.fingerprint[id as usize] = fp;
        // As libCacheSim's S3FIFO.c: once the small queue is full, pages stored while the
        // cache still has room go straight to main, so a cold cache fills main with the
        // first pages instead of churning them through small (better in general, and what
        // keeps a loop longer than the cache from missing every time).
        let room = self.len() < self.capacity && self.queues.small_len() >= self.small_target;
        let queue = if self.ghost.take(fp) || room { Q_MAIN } else { Q_SMALL };
        self.queues.insert(id, queue);
    }

    fn touch(&mut self, id: SlotId, _hash: u64) {
        self.queues.touch(id, false);
    }

    fn remove(&mut self, id: SlotId) {
        self.queues.remove(id);
    }

    fn on_evicted(&mut self, id: SlotId) {
        // As `pop_victim` does with its own victims: only pages leaving small are ghosts.
        if self.queues.queue(id) == Q_SMALL {
            self.ghost.push(self.fingerprint[id as usize]);
        }
        self.remove(id);
    }

    fn pop_victim(&mut self) -> Option<SlotId> {
        // A page small evicts (one not hit enough to be promoted) leaves a ghost entry.
        let (id, from_small) = self.queues.pop_victim(self.small_target, true)?;
        if from_small {
            self.ghost.push(self.fingerprint[id as usize]);
        }
        Some(id)
    }

    fn len(&self) -> usize {
        self.queues.len()
    }

    fn heap_bytes(&self) -> usize {
        self.queues.heap_bytes() + self.fingerprint.capacity() * 4 + self.ghost.heap_bytes()
    }

    fn validate(&self) {
        self.queues.validate();
        self.ghost.validate();
    }
}
