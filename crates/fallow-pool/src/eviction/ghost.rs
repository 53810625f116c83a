//! A ghost queue: the key hashes of the last N pages a policy let go, without the pages.
//!
//! A FIFO ring of 32-bit fingerprints plus a map from fingerprint to the sequence number of
//! its newest ring entry, so `contains`/`take` are O(1) and expiry is a pop from the ring.
//! An entry that was taken stays in the ring as a dead slot until it expires: the ghost
//! remembers "the last N evictions", counting taken ones. Two keys whose 32-bit
//! fingerprints collide share one entry; a ghost is a hint, so that costs only a little
//! hit ratio, never correctness.

use std::collections::VecDeque;

use crate::prehashed::PrehashedMap;

/// The last `capacity` fingerprints handed to [`Ghost::push`].
#[derive(Debug, Default)]
pub(crate) struct Ghost {
    capacity: usize,
    ring: VecDeque<u32>,
    /// Fingerprint → sequence number of its newest live ring entry.
    live: PrehashedMap<u32, u32>,
    /// Sequence number the next pushed entry gets. Wraps; the ring is far shorter than 2^32.
    next_seq: u32,
}

impl Ghost {
    /// Sets how many evictions the ghost remembers, forgetting the oldest if it shrinks.
    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
        self.trim();
    }

    /// Remembers `fp`.
    pub(crate) fn push(&mut self, fp: u32) {
        if self.capacity == 0 {
            return;
        }
        self.ring.push_back(fp);
        self.live.insert(fp, self.next_seq);
        self.next_seq = self.next_seq.wrapping_add(1);
        self.trim();
    }

    /// Forgets `fp` and returns whether it was remembered.
    pub(crate) fn take(&mut self, fp: u32) -> bool {
        self.live.remove(&fp).is_some()
    }

    /// Heap bytes of the ring and the map (an estimate for the map: key, value and one
    /// control byte per bucket).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.ring.capacity() * 4 + self.live.capacity() * 9
    }

    fn trim(&mut self) {
        while self.ring.len() > self.capacity {
            let seq = self.next_seq.wrapping_sub(self.ring.len() as u32);
            let Some(fp) = self.ring.pop_front() else { break };
            if self.live.get(&fp) == Some(&seq) {
                self.live.remove(&fp);
            }
        }
    }

    /// Panics if a live entry points outside the ring or at a ring slot holding another
    /// fingerprint. O(len).
    pub(crate) fn validate(&self) {
        assert!(self.ring.len() <= self.capacity, "ghost is over its capacity");
        assert!(self.live.len() <= self.ring.len(), "more live ghosts than ring entries");
        let first = self.next_seq.wrapping_sub(self.ring.len() as u32);
        for (&fp, &seq) in &self.live {
            let pos = seq.wrapping_sub(first) as usize;
            assert!(pos < self.ring.len(), "ghost {fp:#x} points outside the ring");
            assert_eq!(self.ring[pos], fp, "ghost {fp:#x} points at another entry");
        }
    }
}
